/// @file cgroups.cpp
/// Lease and channel cgroups (see cgroups.hpp). probe_cgroups() (cgroups_probe.cpp) fixes a
/// Layout once: where the instance subtree lives in each hierarchy used and which hierarchy
/// carries which controller. A lease or channel object is then only a path relative to that
/// subtree.
///
/// Killing on v2 is one write to cgroup.kill. v1 has no such file, and signalling pids one by
/// one races with forks, so the subtree is frozen first (freezer.state), every pid in it is
/// signalled while frozen, and it is thawed so that the pending SIGKILLs land; repeated until
/// the subtree is empty. Signals go through pidfds, and only to pids still seen in the subtree
/// after their pidfd was opened, so a pid recycled by an unrelated process is never signalled.

#include "provider/cgroups.hpp"

#include "provider/cgroups_internal.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/unique_fd.hpp>

#include <spdlog/spdlog.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace sandboxd::detail::cgroups_detail {
namespace {

using steady = std::chrono::steady_clock;
using namespace std::chrono_literals;

// A lease has one level of channel children; these bounds only keep a walk of a subtree that
// something else filled finite.
constexpr std::size_t max_walk_dirs = 1024;
constexpr int max_walk_depth = 4;
// v2 forbids processes in a cgroup that enables controllers for its children, so the lease's
// own processes (the supervisor) live in this leaf. The dot keeps it apart from channel names.
constexpr const char* v2_lease_leaf = "lease.self";
constexpr std::uint64_t cpu_period_us = 100000;

bool valid_name(std::string_view name) {
    return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '_' || c == '-';
    });
}

[[noreturn]] void fail(const std::string& message) {
    throw rpc_error(errc::provider_error, message);
}

}  // namespace

[[noreturn]] void throw_errno(const std::string& what, int err) {
    if (err == EMFILE || err == ENFILE) {
        // Not the provider's fault: the node has no descriptor left (RLIMIT_NOFILE or the
        // system's file table), which passes once channels end.
        throw rpc_error(errc::channel_limit,
                        what + ": this node has no file descriptor left (" +
                            (err == EMFILE ? "RLIMIT_NOFILE" : "system file table") + ")");
    }
    fail(what + ": " + std::strerror(err));
}

void check_name(const std::string& name, const char* what) {
    if (!valid_name(name)) {
        fail(std::string("invalid ") + what + " cgroup name '" + name.substr(0, 80) +
             "' (1..64 of A-Z a-z 0-9 _ -)");
    }
}

// --- Small cgroupfs and procfs files. ---

std::optional<std::string> read_text(const fs::path& path) {
    unique_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return std::nullopt;
    std::string text;
    char buf[4096];
    for (;;) {
        ssize_t n = ::read(fd.get(), buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return std::nullopt;
        if (n == 0) return text;
        text.append(buf, static_cast<std::size_t>(n));
    }
}

int try_write(const fs::path& path, std::string_view value) noexcept {
    unique_fd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) return errno;
    return ::write(fd.get(), value.data(), value.size()) < 0 ? errno : 0;
}

void write_value(const fs::path& path, std::string_view value) {
    if (int err = try_write(path, value); err != 0) {
        throw_errno("cannot write '" + std::string(value) + "' to " + path.string(), err);
    }
}

std::vector<std::string> split(std::string_view s, std::string_view seps) {
    std::vector<std::string> out;
    while (!s.empty()) {
        auto part = s.substr(0, s.find_first_of(seps));
        if (!part.empty()) out.emplace_back(part);
        s.remove_prefix(std::min(s.size(), part.size() + 1));
    }
    return out;
}

namespace {

std::uint64_t parse_u64(std::string_view s) noexcept {
    std::uint64_t v = 0;
    std::from_chars(s.data(), s.data() + s.size(), v);
    return v;
}

/// The number after `key ` on a line of a flat-keyed file (memory.events, cpu.stat, ...).
std::uint64_t keyed_value(const fs::path& path, std::string_view key) noexcept {
    for (std::string_view line : split(read_text(path).value_or(""), "\n")) {
        if (line.starts_with(key) && line.size() > key.size() && line[key.size()] == ' ') {
            return parse_u64(line.substr(key.size() + 1));
        }
    }
    return 0;
}

std::uint64_t read_u64(const fs::path& path) noexcept {
    auto text = read_text(path);
    return text ? parse_u64(*text) : 0;
}

bool is_dir(const fs::path& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

/// The names of the subdirectories of `dir` (none when it cannot be read), at most `limit`.
std::vector<std::string> child_dirs(const fs::path& dir, std::size_t limit = max_walk_dirs) {
    std::vector<std::string> names;
    std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
    if (!d) return names;
    while (dirent* e = ::readdir(d.get())) {
        std::string_view name = e->d_name;
        if (e->d_type != DT_DIR || name == "." || name == "..") continue;
        if (names.size() == limit) break;
        names.emplace_back(name);
    }
    return names;
}

/// `top` and the directories below it, parents before children. Bounded in depth and count
/// (breadth first), whatever someone else made there.
std::vector<fs::path> subtree_dirs(const fs::path& top) {
    std::vector<fs::path> dirs;
    if (!is_dir(top)) return dirs;
    dirs.push_back(top);
    std::size_t level_begin = 0;
    for (int depth = 0; depth < max_walk_depth && level_begin < dirs.size(); ++depth) {
        std::size_t level_end = dirs.size();
        for (std::size_t i = level_begin; i < level_end; ++i) {
            for (auto& name : child_dirs(dirs[i], max_walk_dirs - dirs.size())) {
                dirs.push_back(dirs[i] / name);
            }
        }
        level_begin = level_end;
    }
    return dirs;
}

/// Every pid in cgroup.procs of `rel` and its descendants, in every hierarchy (a process
/// that joined only some hierarchies is found too), sorted.
std::vector<pid_t> subtree_pids(const Layout& layout, const std::string& rel) {
    std::vector<pid_t> pids;
    for (std::size_t h = 0; h < layout.hierarchies.size(); ++h) {
        for (const auto& dir : subtree_dirs(layout.dir(h, rel))) {
            auto text = read_text(dir / "cgroup.procs");
            if (!text) continue;
            for (const auto& line : split(*text, "\n")) {
                pids.push_back(static_cast<pid_t>(parse_u64(line)));
            }
        }
    }
    std::sort(pids.begin(), pids.end());
    pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
    pids.erase(std::remove(pids.begin(), pids.end(), 0), pids.end());
    return pids;
}

/// Polls `done` until it holds or `deadline`. cgroupfs v1 has no event for "empty" or
/// "frozen", so short sleeps it is.
template <class Pred>
bool poll_until(Pred done, steady::time_point deadline) {
    auto pause = 200us;
    for (;;) {
        if (done()) return true;
        if (steady::now() >= deadline) return false;
        std::this_thread::sleep_for(pause);
        pause = std::min<std::chrono::microseconds>(pause * 2, 10ms);
    }
}

void signal_pids(const Layout& layout, const std::string& rel, const std::vector<pid_t>& pids) {
    std::vector<std::pair<pid_t, unique_fd>> pidfds;
    for (pid_t pid : pids) {
        long fd = ::syscall(SYS_pidfd_open, pid, 0);
        if (fd >= 0) pidfds.emplace_back(pid, unique_fd(static_cast<int>(fd)));
    }
    // A pid read from cgroup.procs may have been reaped and recycled before its pidfd was
    // opened. Seen in the subtree again now, it names the process the pidfd holds (or that
    // process is gone and the signal fails with ESRCH).
    auto again = subtree_pids(layout, rel);
    for (const auto& [pid, fd] : pidfds) {
        if (std::binary_search(again.begin(), again.end(), pid)) {
            ::syscall(SYS_pidfd_send_signal, fd.get(), SIGKILL, nullptr, 0);
        }
    }
}

/// Kills everything in `rel` and below; true when it is empty within `budget`.
bool kill_subtree(const Layout& layout, const std::string& rel, steady::duration budget) {
    auto deadline = steady::now() + budget;
    auto empty = [&] { return subtree_pids(layout, rel).empty(); };
    // Nothing to kill, and nothing comes in: joining takes a join file, which only this
    // process opens, and which it gives only to a process of this subtree or to its own
    // spawn child. The usual case on release, where the lease's PID 1 has been killed and
    // reaped already; freezing an empty v1 subtree still waited for FROZEN, 12 ms in one
    // strace of a release.
    if (empty()) return true;
    if (layout.mode == cgroup_mode::v2) {
        // cgroup.kill (5.14+) kills the subtree atomically; without it, the loop below.
        fs::path dir = layout.dir(0, rel);
        int err = try_write(dir / "cgroup.kill", "1");
        if (err == 0) return poll_until(empty, deadline);
        if (!is_dir(dir)) return true;
    }
    fs::path state;
    if (layout.mode == cgroup_mode::v1) state = layout.dir(layout.freezer, rel) / "freezer.state";
    for (;;) {
        // Frozen, nothing in the subtree forks; if freezing stalls (a task in D state), kill
        // anyway and let the next round pick up what was forked meanwhile.
        bool freezing = !state.empty() && try_write(state, "FROZEN") == 0;
        if (freezing) {
            poll_until([&] { return read_text(state).value_or("").starts_with("FROZEN"); },
                       std::min(deadline, steady::now() + 200ms));
        }
        auto pids = subtree_pids(layout, rel);
        if (!pids.empty()) signal_pids(layout, rel, pids);
        // Frozen tasks act on SIGKILL only once thawed.
        if (freezing) try_write(state, "THAWED");
        if (pids.empty()) return true;
        if (poll_until(empty, std::min(deadline, steady::now() + 100ms))) return true;
        if (steady::now() >= deadline) return false;
    }
}

void kill_logged(const Layout& layout, const std::string& rel,
                 std::chrono::seconds budget) noexcept {
    try {
        if (!kill_subtree(layout, rel, budget)) {
            spdlog::warn("cgroup={} still has processes after {} s of killing", rel,
                         budget.count());
        }
    } catch (const std::exception& e) {
        spdlog::warn("cgroup={} kill failed: {}", rel, e.what());
    }
}

/// rmdir of `rel` and its descendants, children first, in hierarchy `h`. 0 or the first errno
/// (with the directory in `failed`).
int remove_in(const Layout& layout, std::size_t h, const std::string& rel, fs::path& failed) {
    auto dirs = subtree_dirs(layout.dir(h, rel));
    int first_err = 0;
    for (std::size_t i = dirs.size(); i-- > 0;) {
        if (::rmdir(dirs[i].c_str()) != 0 && errno != ENOENT && first_err == 0) {
            first_err = errno;
            failed = dirs[i];
        }
    }
    return first_err;
}

/// Removes `rel` everywhere; false (logged at `level`) when something is left.
bool remove_subtree(const Layout& layout, const std::string& rel, spdlog::level::level_enum level) {
    fs::path failed;
    int err = 0;
    for (std::size_t h = 0; h < layout.hierarchies.size(); ++h) {
        int e = remove_in(layout, h, rel, failed);
        if (err == 0) err = e;
    }
    if (err != 0)
        spdlog::log(level, "cannot remove cgroup {}: {}", failed.string(), std::strerror(err));
    return err == 0;
}

/// Makes `rel` in every hierarchy; on failure removes what it made and throws.
void make_everywhere(const Layout& layout, const std::string& rel) {
    for (std::size_t h = 0; h < layout.hierarchies.size(); ++h) {
        if (layout.absent_in(h, rel)) continue;
        fs::path dir = layout.dir(h, rel);
        if (::mkdir(dir.c_str(), 0755) != 0) {
            int err = errno;
            fs::path ignored;
            for (std::size_t made = 0; made < h; ++made) remove_in(layout, made, rel, ignored);
            throw_errno("cannot make cgroup " + dir.string(), err);
        }
    }
}

/// The files a process joins `rel` by. On v1 they are `tasks`: a thread that writes "0" there
/// moves itself only, and the kernel then takes no cgroup_threadgroup_rwsem (only a write to
/// cgroup.procs, or of another pid, does: kernel/cgroup/cgroup.c, cgroup_procs_write_start).
/// Taking that rwsem for writing waits an RCU grace period once it has been idle, long when
/// the CPUs are busy: with both cores of this project's machines busy, a join by cgroup.procs
/// took 1.1-1.8 ms mean (up to 7.3) against 0.09-0.11 ms by `tasks` (bench/cgroup-join; idle,
/// both about 0.1). Every joiner is single-threaded (a channel init, a spawn child before its
/// exec), so moving the thread moves the process. v2 has no `tasks`: cgroup.procs there.
std::vector<unique_fd> open_procs_of(const Layout& layout, const std::string& rel) {
    const char* name = layout.mode == cgroup_mode::v1 ? "tasks" : "cgroup.procs";
    std::vector<unique_fd> fds;
    for (std::size_t h = 0; h < layout.hierarchies.size(); ++h) {
        fs::path path = layout.home(h, rel) / name;
        unique_fd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
        if (!fd) throw_errno("cannot open " + path.string(), errno);
        fds.push_back(std::move(fd));
    }
    return fds;
}

/// "MAJ:MIN" of a block device, as the io files take it.
std::string device_key(dev_t dev) {
    return std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
}

void write_limits(const Layout& layout, const std::string& rel, const CgroupLimits& limits) {
    auto file = [&](std::size_t h, const char* name) { return layout.dir(h, rel) / name; };
    std::uint32_t weight = limits.cpu_weight;
    if (layout.mode == cgroup_mode::v2) {
        if (limits.memory_bytes) {
            write_value(file(layout.memory, "memory.max"), std::to_string(*limits.memory_bytes));
            // Missing without swap accounting (swapaccount=0): then no cgroup file can keep
            // swap from extending the limit, and memory.max alone has to do.
            int err = try_write(file(layout.memory, "memory.swap.max"), "0");
            if (err != 0 && err != ENOENT) {
                throw_errno(
                    "cannot write '0' to " + file(layout.memory, "memory.swap.max").string(), err);
            }
        }
        if (limits.pids) write_value(file(layout.pids, "pids.max"), std::to_string(*limits.pids));
        write_value(file(layout.cpu, "cpu.weight"), std::to_string(weight));
        if (limits.cpu_quota_percent) {
            write_value(file(layout.cpu, "cpu.max"),
                        std::to_string(std::uint64_t{*limits.cpu_quota_percent} * 1000) + " " +
                            std::to_string(cpu_period_us));
        }
        if (limits.io_device) {
            std::string max = device_key(*limits.io_device);
            auto add = [&max](const char* key, const std::optional<std::uint64_t>& v) {
                if (v) max += std::string(" ") + key + "=" + std::to_string(*v);
            };
            add("rbps", limits.io_read_bps);
            add("wbps", limits.io_write_bps);
            add("riops", limits.io_read_iops);
            add("wiops", limits.io_write_iops);
            if (max.find('=') != std::string::npos) write_value(file(0, "io.max"), max);
        }
        if (limits.io_weight) {
            write_value(file(0, "io.weight"), "default " + std::to_string(*limits.io_weight));
        }
        return;
    }
    if (limits.memory_bytes) {
        // limit_in_bytes first: memsw may never be below it.
        auto bytes = std::to_string(*limits.memory_bytes);
        write_value(file(layout.memory, "memory.limit_in_bytes"), bytes);
        if (layout.memsw) write_value(file(layout.memory, "memory.memsw.limit_in_bytes"), bytes);
    }
    if (limits.pids) write_value(file(layout.pids, "pids.max"), std::to_string(*limits.pids));
    auto shares = std::clamp<std::uint64_t>(std::uint64_t{weight} * 1024 / 100, 2, 262144);
    write_value(file(layout.cpu, "cpu.shares"), std::to_string(shares));
    if (limits.cpu_quota_percent) {
        write_value(file(layout.cpu, "cpu.cfs_period_us"), std::to_string(cpu_period_us));
        write_value(file(layout.cpu, "cpu.cfs_quota_us"),
                    std::to_string(std::uint64_t{*limits.cpu_quota_percent} * 1000));
    }
    if (limits.io_device && layout.blkio) {
        const std::string dev = device_key(*limits.io_device) + " ";
        auto put = [&](const char* name, const std::optional<std::uint64_t>& v) {
            if (v) write_value(file(*layout.blkio, name), dev + std::to_string(*v));
        };
        put("blkio.throttle.read_bps_device", limits.io_read_bps);
        put("blkio.throttle.write_bps_device", limits.io_write_bps);
        put("blkio.throttle.read_iops_device", limits.io_read_iops);
        put("blkio.throttle.write_iops_device", limits.io_write_iops);
    }
}

void check_limits(const Layout& layout, const CgroupLimits& limits) {
    const bool throttled =
        limits.io_read_bps || limits.io_write_bps || limits.io_read_iops || limits.io_write_iops;
    if (throttled && !limits.io_device) fail("an io limit needs the device it applies to");
    if (throttled && !(layout.mode == cgroup_mode::v2 ? layout.io : layout.blkio.has_value())) {
        fail(layout.mode == cgroup_mode::v2
                 ? "io limits need the io controller, which this cgroup does not offer"
                 : "io limits need the cgroup v1 blkio hierarchy, which is not mounted");
    }
    if (limits.io_weight && !(layout.mode == cgroup_mode::v2 && layout.io)) {
        fail("an io weight needs cgroup v2 with the io controller (v1 has no weight without BFQ)");
    }
    if (limits.cpu_weight < 1 || limits.cpu_weight > 10000) {
        fail("cpu weight " + std::to_string(limits.cpu_weight) + " is outside 1..10000");
    }
    auto cores = static_cast<std::uint32_t>(std::max(1, ::get_nprocs()));
    if (limits.cpu_quota_percent &&
        (*limits.cpu_quota_percent < 1 || *limits.cpu_quota_percent > 100 * cores)) {
        fail("cpu quota " + std::to_string(*limits.cpu_quota_percent) + "% is outside 1.." +
             std::to_string(100 * cores) + "%");
    }
}

// --- Leases and channels. ---

class Channel final : public ChannelCgroup {
public:
    Channel(std::shared_ptr<const Layout> layout, std::string rel)
        : layout_(std::move(layout)), rel_(std::move(rel)) {}
    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    Channel(Channel&&) = delete;
    Channel& operator=(Channel&&) = delete;
    ~Channel() override {
        if (kept_) return;  // its processes go on for the next daemon process
        if (empty_) {
            // A channel's cgroup has no children: one rmdir per hierarchy. Debug only: one
            // the kernel still holds goes with the lease.
            for (std::size_t h = 0; h < layout_->hierarchies.size(); ++h) {
                const fs::path dir = layout_->dir(h, rel_);
                if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) {
                    spdlog::debug("cannot remove cgroup {}: {}", dir.string(),
                                  std::strerror(errno));
                }
            }
            return;
        }
        kill();
        // Debug only: whatever is left goes with the lease.
        remove_subtree(*layout_, rel_, spdlog::level::debug);
    }

    void mark_empty() noexcept override { empty_ = true; }
    void keep() noexcept override { kept_ = true; }

    std::optional<std::uint64_t> own_pids_limit_hits() const noexcept override {
        if (layout_->mode != cgroup_mode::v1) return std::nullopt;
        return keyed_value(layout_->dir(layout_->pids, rel_) / "pids.events", "max");
    }

    std::vector<unique_fd> open_procs() const override { return open_procs_of(*layout_, rel_); }

    std::uint64_t oom_kills() const noexcept override {
        if (layout_->mode == cgroup_mode::v2) {
            return keyed_value(layout_->dir(0, rel_) / "memory.events", "oom_kill");
        }
        return keyed_value(layout_->dir(layout_->memory, rel_) / "memory.oom_control", "oom_kill");
    }

    void kill() noexcept override { kill_logged(*layout_, rel_, 1s); }

private:
    std::shared_ptr<const Layout> layout_;
    std::string rel_;
    bool empty_ = false;
    bool kept_ = false;
};

class Lease final : public LeaseCgroup {
public:
    Lease(std::shared_ptr<const Layout> layout, std::string name)
        : layout_(std::move(layout)), name_(std::move(name)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease(Lease&&) = delete;
    Lease& operator=(Lease&&) = delete;
    ~Lease() override {
        if (!kept_) destroy();
    }

    void keep() noexcept override { kept_ = true; }

    /// Kills and removes the lease; false when something is left (logged).
    bool destroy() noexcept {
        kill();
        try {
            return remove_subtree(*layout_, name_, spdlog::level::warn);
        } catch (const std::exception& e) {
            spdlog::warn("cgroup={} removal failed: {}", name_, e.what());
            return false;
        }
    }

    std::vector<unique_fd> open_procs() const override {
        bool v2 = layout_->mode == cgroup_mode::v2;
        return open_procs_of(*layout_, v2 ? name_ + "/" + v2_lease_leaf : name_);
    }

    std::unique_ptr<ChannelCgroup> create_channel(const std::string& name) override {
        check_name(name, "channel");
        std::string rel = name_ + "/" + name;
        make_everywhere(*layout_, rel);
        return std::make_unique<Channel>(layout_, std::move(rel));
    }

    std::unique_ptr<ChannelCgroup> find_channel(const std::string& name) override {
        if (!valid_name(name) || name == v2_lease_leaf) return nullptr;
        std::string rel = name_ + "/" + name;
        for (std::size_t h = 0; h < layout_->hierarchies.size(); ++h) {
            std::error_code ec;
            if (!layout_->absent_in(h, rel) && !fs::is_directory(layout_->dir(h, rel), ec)) {
                return nullptr;
            }
        }
        return std::make_unique<Channel>(layout_, std::move(rel));
    }

    CgroupUsage usage() const noexcept override {
        const Layout& l = *layout_;
        CgroupUsage u;
        u.pids = static_cast<std::uint32_t>(read_u64(l.dir(l.pids, name_) / "pids.current"));
        if (l.mode == cgroup_mode::v2) {
            u.memory_bytes = read_u64(l.dir(0, name_) / "memory.current");
            u.cpu_ms = keyed_value(l.dir(0, name_) / "cpu.stat", "usage_usec") / 1000;
        } else {
            u.memory_bytes = read_u64(l.dir(l.memory, name_) / "memory.usage_in_bytes");
            u.cpu_ms = read_u64(l.dir(l.cpuacct, name_) / "cpuacct.usage") / 1000000;
        }
        return u;
    }

    std::uint64_t pids_limit_hits() const noexcept override {
        const Layout& l = *layout_;
        if (l.mode == cgroup_mode::v2) return keyed_value(l.dir(0, name_) / "pids.events", "max");
        // v1 counts a failed fork in the forking task's own cgroup (kernels differ on whether
        // the limiting ancestor counts too), so the lease's count is the sum over its subtree.
        std::uint64_t hits = 0;
        for (const auto& dir : subtree_dirs(l.dir(l.pids, name_))) {
            hits += keyed_value(dir / "pids.events", "max");
        }
        return hits;
    }

    void kill() noexcept override { kill_logged(*layout_, name_, 2s); }

private:
    std::shared_ptr<const Layout> layout_;
    std::string name_;
    bool kept_ = false;
};

class Manager final : public CgroupManager {
public:
    Manager(std::shared_ptr<const Layout> layout, std::string description)
        : layout_(std::move(layout)), description_(std::move(description)) {}
    Manager(const Manager&) = delete;
    Manager& operator=(const Manager&) = delete;
    Manager(Manager&&) = delete;
    Manager& operator=(Manager&&) = delete;

    ~Manager() override {
        // A clean exit leaves no empty instance directory behind; one that still holds
        // leases (EBUSY, ENOTEMPTY) stays for the next process's remove_orphans().
        for (const auto& h : layout_->hierarchies) ::rmdir(h.instance.c_str());
    }

    cgroup_mode mode() const noexcept override { return layout_->mode; }
    bool io_throttle() const noexcept override {
        return layout_->mode == cgroup_mode::v2 ? layout_->io : layout_->blkio.has_value();
    }
    bool io_weight() const noexcept override {
        return layout_->mode == cgroup_mode::v2 && layout_->io;
    }
    std::string describe() const override { return description_; }

    std::size_t remove_orphans(const std::function<bool(const std::string&)>& keep) override {
        std::vector<std::string> names;
        for (const auto& h : layout_->hierarchies) {
            for (auto& name : child_dirs(h.instance)) names.push_back(std::move(name));
        }
        std::sort(names.begin(), names.end());
        names.erase(std::unique(names.begin(), names.end()), names.end());
        std::size_t removed = 0;
        for (auto& name : names) {
            if (keep && keep(name)) continue;
            if (Lease(layout_, std::move(name)).destroy()) ++removed;
        }
        return removed;
    }

    std::unique_ptr<LeaseCgroup> create_lease(const std::string& name,
                                              const CgroupLimits& limits) override {
        check_name(name, "lease");
        if (layout_->mode == cgroup_mode::none) fail("no usable cgroups: " + description_);
        check_limits(*layout_, limits);
        make_everywhere(*layout_, name);
        try {
            if (layout_->mode == cgroup_mode::v2) {
                write_value(layout_->dir(0, name) / "cgroup.subtree_control",
                            layout_->io ? v2_controllers_io : v2_controllers);
                fs::path leaf = layout_->dir(0, name) / v2_lease_leaf;
                if (::mkdir(leaf.c_str(), 0755) != 0) {
                    throw_errno("cannot make cgroup " + leaf.string(), errno);
                }
            }
            write_limits(*layout_, name, limits);
        } catch (...) {
            remove_subtree(*layout_, name, spdlog::level::warn);
            throw;
        }
        return std::make_unique<Lease>(layout_, name);
    }

    std::unique_ptr<LeaseCgroup> find_lease(const std::string& name) override {
        check_name(name, "lease");
        for (std::size_t h = 0; h < layout_->hierarchies.size(); ++h) {
            if (is_dir(layout_->dir(h, name))) return std::make_unique<Lease>(layout_, name);
        }
        return nullptr;
    }

private:
    std::shared_ptr<const Layout> layout_;
    std::string description_;
};

}  // namespace

std::unique_ptr<CgroupManager> make_manager(std::shared_ptr<const Layout> layout,
                                            std::string description) {
    return std::make_unique<Manager>(std::move(layout), std::move(description));
}

}  // namespace sandboxd::detail::cgroups_detail
