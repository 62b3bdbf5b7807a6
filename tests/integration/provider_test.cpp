// The bubblewrap provider and sandboxd-init against the real bwrap. A lease is one long-lived
// sandbox (its supervisor `sandboxd-init --lease` as PID 1, running as the lease's own host
// uid); a channel is a channel init that the supervisor starts as PID 1 of a PID namespace of
// the channel's own. The channel init is not this process's child: it is watched and killed
// through its pidfd only. Channels are opened through Provider::open() and the process
// backend's descriptors are then taken back (release_for_test), so that sandboxd-init's fd
// contract is driven byte by byte with plain poll()/read() loops; every wait is bounded;
// processes are found by the pids and namespaces of our own channels, never by name. The
// ChannelBackend interface itself is driven by the "process backend" cases.

#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/awaitable_channel.hpp>
#include <sandboxd/provider/provider.hpp>

#include "provider/bwrap_config.hpp"
#include "provider/node_budget.hpp"
#include "provider/process_backend.hpp"
#include "support/daemon_fixture.hpp"
#include "support/run_awaitable.hpp"
#include "support/wait_readable.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#ifndef SANDBOXD_INIT_BIN
#error "SANDBOXD_INIT_BIN must name the built sandboxd-init"
#endif

namespace {

using namespace sandboxd;
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds status_timeout{20000};
constexpr milliseconds teardown_timeout{10000};
constexpr std::uint64_t mib = std::uint64_t{1} << 20;
/// BwrapIdentityConfig's default range starts here.
constexpr uid_t first_lease_uid = 1500000000;

boost::asio::io_context& test_io();

int open_fd_count() {
    // The tests' io_context holds descriptors of its own for the whole process: made first.
    test_io();
    int n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator("/proc/self/fd")) ++n;
    return n;
}

using sandboxd::detail::ProcessBackend;
using sandboxd::detail::ProcessEnds;
using sandboxd::test::wait_readable;

/// The io_context the provider's awaitables run on in these tests (one test at a time).
boost::asio::io_context& test_io() {
    static boost::asio::io_context ioc;
    // Its reactor (epoll, eventfd, timerfd) is made on first use of a timer: made now.
    static boost::asio::steady_timer warm(ioc);
    return ioc;
}

std::shared_ptr<SandboxHandle> create_sandbox(Provider& provider, SandboxScope scope,
                                              std::string lease_id, json config) {
    Lease lease;
    lease.id = std::move(lease_id);
    lease.provider = scope.provider;
    lease.company_id = scope.company_id;
    lease.environment_id = scope.environment_id;
    lease.config = std::move(config);
    return sandboxd::test::run_awaitable(test_io(), provider.create(std::move(lease)));
}

void destroy_sandbox(Provider& provider, std::shared_ptr<SandboxHandle> sandbox) {
    sandboxd::test::run_awaitable(test_io(), provider.destroy(std::move(sandbox)));
}

/// Opens a channel and takes its descriptors back from the process backend.
ProcessEnds open_process(Provider& provider, std::shared_ptr<SandboxHandle> sandbox,
                         ExecSpec spec) {
    auto backend = sandboxd::test::run_awaitable(
        test_io(), provider.open(std::move(sandbox), std::move(spec)));
    auto* process = dynamic_cast<ProcessBackend*>(backend.get());
    REQUIRE(process != nullptr);
    return process->release_for_test();
}

std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

/// The command line of `pid` with NULs as spaces ("" for a zombie or a gone process).
std::string cmdline_of(pid_t pid) {
    std::string cmdline = read_text("/proc/" + std::to_string(pid) + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    return cmdline;
}

/// True for a process that has not exited: false once it is gone, a zombie waiting for its
/// parent ("Z"), or being reaped by its parent right now ("X").
bool is_live(const fs::path& proc_dir) {
    std::string stat = read_text(proc_dir / "stat");
    auto paren = stat.rfind(')');
    return paren != std::string::npos && stat.compare(paren, 4, ") Z ") != 0 &&
           stat.compare(paren, 4, ") X ") != 0;
}

/// Whether `pid` is alive (not exited) with a command line that starts with `prefix`.
bool running_as(pid_t pid, const std::string& prefix) {
    return is_live("/proc/" + std::to_string(pid)) && cmdline_of(pid).rfind(prefix, 0) == 0;
}

/// Inode of the PID namespace `pid` is in; 0 if it is gone.
ino_t pid_ns_of(pid_t pid) {
    struct stat st {};
    if (::stat(("/proc/" + std::to_string(pid) + "/ns/pid").c_str(), &st) != 0) return 0;
    return st.st_ino;
}

/// Host pids of the live (not exited) processes in the PID namespace of inode `ns_inode`.
std::vector<pid_t> processes_in_pid_ns(ino_t ns_inode) {
    std::vector<pid_t> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
        pid_t pid = std::stoi(name);
        if (pid_ns_of(pid) == ns_inode && is_live(entry.path())) out.push_back(pid);
    }
    return out;
}

/// Host pids of the children of `pid`'s main thread.
std::vector<pid_t> children_of(pid_t pid) {
    std::istringstream in(
        read_text("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children"));
    std::vector<pid_t> out;
    for (pid_t child = 0; in >> child;) out.push_back(child);
    return out;
}

/// The children of this process (of each of its threads: the provider spawns from its
/// workers), zombies included.
std::set<pid_t> own_children() {
    const auto children = test::children_of_every_thread(::getpid());
    return {children.begin(), children.end()};
}

/// Children of this process that `before` did not list: what a test left unreaped. (Not
/// waitpid(-1): the test runner is a subreaper, and in a run of several cases the orphans of
/// earlier ones may be its children too.)
std::vector<pid_t> new_children(const std::set<pid_t>& before) {
    std::vector<pid_t> out;
    for (pid_t pid : own_children()) {
        if (!before.count(pid)) out.push_back(pid);
    }
    return out;
}

/// The fields of the "<key>:" line of /proc/<pid>/status (e.g. "Uid": real, effective, saved,
/// filesystem); empty when the process is gone.
std::vector<std::string> status_field(pid_t pid, const std::string& key) {
    std::istringstream in(read_text("/proc/" + std::to_string(pid) + "/status"));
    for (std::string line; std::getline(in, line);) {
        if (line.rfind(key + ":", 0) != 0) continue;
        std::istringstream fields(line.substr(key.size() + 1));
        std::vector<std::string> out;
        for (std::string f; fields >> f;) out.push_back(f);
        return out;
    }
    return {};
}

/// The parent of `pid` as this process sees it (-1 if it is gone).
pid_t parent_of(pid_t pid) {
    auto f = status_field(pid, "PPid");
    return f.size() == 1 ? static_cast<pid_t>(std::stol(f[0])) : -1;
}

/// The host directory of `pid`'s cgroup in the memory hierarchy (cgroup v1) or the unified
/// one (v2); empty if it is gone.
fs::path memory_cgroup_of(pid_t pid) {
    std::istringstream in(read_text("/proc/" + std::to_string(pid) + "/cgroup"));
    fs::path unified;
    for (std::string line; std::getline(in, line);) {
        // "<id>:<controllers>:<path>"
        auto first = line.find(':');
        auto second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) continue;
        std::string controllers = line.substr(first + 1, second - first - 1);
        std::string path = line.substr(second + 1);
        std::istringstream list(controllers);
        for (std::string c; std::getline(list, c, ',');) {
            if (c == "memory") return fs::path("/sys/fs/cgroup/memory") / path.substr(1);
        }
        if (line.rfind("0::", 0) == 0) unified = fs::path("/sys/fs/cgroup") / path.substr(1);
    }
    return unified;
}

/// The mount points in this process's mount namespace, with their filesystem types.
std::vector<std::pair<std::string, std::string>> mounts() {
    std::vector<std::pair<std::string, std::string>> out;
    std::istringstream in(read_text("/proc/self/mountinfo"));
    for (std::string line; std::getline(in, line);) {
        // id parent major:minor root mount-point options [optional...] - fstype source ...
        std::istringstream fields(line);
        std::string id, parent, dev, root, point;
        fields >> id >> parent >> dev >> root >> point;
        auto dash = line.find(" - ");
        std::string fstype;
        if (dash != std::string::npos) std::istringstream(line.substr(dash + 3)) >> fstype;
        out.emplace_back(point, fstype);
    }
    return out;
}

/// Mounts at `path` or below it.
std::vector<std::string> mounts_under(const fs::path& path) {
    std::vector<std::string> out;
    const std::string prefix = path.string();
    for (const auto& [point, type] : mounts()) {
        if (point == prefix || point.rfind(prefix + "/", 0) == 0)
            out.push_back(std::string(point).append(" ").append(type));
    }
    return out;
}

/// Entries of `dir` that name a sandbox ("bw-..."); none if `dir` is missing.
std::vector<std::string> sandbox_entries(const fs::path& dir) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
        const auto name = entry.path().filename().string();
        if (name.rfind("bw-", 0) == 0) out.push_back(name);
    }
    return out;
}

/// Subdirectories of `dir` (a cgroup's children); none if it is missing.
std::vector<std::string> subdirectories(const fs::path& dir) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
        if (entry.is_directory(ec)) out.push_back(entry.path().filename().string());
    }
    return out;
}

struct stat stat_of(const fs::path& path) {
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    return st;
}

/// The host uid a lease runs as: the owner of its workspace.
uid_t lease_uid(const SandboxHandle& sandbox) { return stat_of(sandbox.workspace).st_uid; }

std::vector<std::string> sorted_lines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    std::sort(lines.begin(), lines.end());
    return lines;
}

struct TempDir {
    fs::path path;
    TempDir() {
        char tmpl[] = "/tmp/sandboxd-provider-test.XXXXXX";
        const char* made = ::mkdtemp(tmpl);
        if (made == nullptr) throw std::runtime_error("mkdtemp failed");
        path = made;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    TempDir(TempDir&&) = delete;
    TempDir& operator=(TempDir&&) = delete;
};

/// Removes what a provider that is gone left for its leases' uids to reach (the directory its
/// workspaces are in, with its generated /etc and copy of sandboxd-init) when that is outside
/// the test's own directory (the default is under /run) and no lease is left in it.
void remove_lease_root(const fs::path& lease_root, const TempDir& dir) {
    const auto rel = lease_root.lexically_relative(dir.path);
    if (lease_root.empty() || rel.empty() || *rel.begin() != "..") return;
    if (!sandbox_entries(lease_root).empty() || !mounts_under(lease_root).empty()) {
        FAIL_CHECK("leases left in " << lease_root);
        return;
    }
    std::error_code ec;
    fs::remove_all(lease_root, ec);
}

BwrapOptions test_options(const fs::path& sandboxes_dir) {
    BwrapOptions options;
    options.init_path = SANDBOXD_INIT_BIN;
    options.sandboxes_dir = sandboxes_dir;
    return options;
}

/// Destroys a sandbox when the test leaves the scope, however it leaves (its disk is a mount).
class LeaseGuard {
public:
    LeaseGuard(Provider& provider, std::shared_ptr<SandboxHandle> sandbox)
        : provider_(provider), sandbox_(std::move(sandbox)) {}
    ~LeaseGuard() {
        try {
            destroy_sandbox(provider_, sandbox_);  // idempotent: the test may have destroyed it
        } catch (const std::exception& e) {
            FAIL_CHECK("destroy failed: " << e.what());
        }
    }
    LeaseGuard(const LeaseGuard&) = delete;
    LeaseGuard& operator=(const LeaseGuard&) = delete;
    LeaseGuard(LeaseGuard&&) = delete;
    LeaseGuard& operator=(LeaseGuard&&) = delete;

private:
    Provider& provider_;
    std::shared_ptr<SandboxHandle> sandbox_;
};

/// A provider on a temporary sandboxes dir and one sandbox in it, destroyed at the end.
struct Fixture {
    TempDir dir;
    std::unique_ptr<Provider> provider;
    std::shared_ptr<SandboxHandle> sandbox;

    explicit Fixture(const json& config = json::object()) {
        ::signal(SIGPIPE, SIG_IGN);  // the tests write to pipes whose readers may be gone
        auto options = test_options(dir.path / "sandboxes");
        provider = make_bwrap_provider(std::move(options));
        sandbox = create_sandbox(*provider, SandboxScope{"bwrap", "company-1", "env-1", ""},
                                 "lease-1", config);
    }
    ~Fixture() {
        // Its disk is a mount: it must not outlive the test.
        try {
            destroy_sandbox(*provider, sandbox);
        } catch (const std::exception& e) {
            FAIL_CHECK("destroy failed: " << e.what());
        }
        provider.reset();
        remove_lease_root(sandbox->workspace.parent_path().parent_path(), dir);
    }
    Fixture(const Fixture&) = delete;
    Fixture& operator=(const Fixture&) = delete;
    Fixture(Fixture&&) = delete;
    Fixture& operator=(Fixture&&) = delete;
};

/// One spawned channel, driven to completion by hand. Its init is not our child: it is
/// watched through its pidfd and killed with pidfd_send_signal.
class Channel {
public:
    /// `may_end_at_once`: the channel's set-up is meant to fail, so its init may already be
    /// gone (and its pid unknown, -1) when spawn() returns. Otherwise the init lives until we
    /// kill it or let go of it, and its pid is known.
    Channel(Provider& provider, std::shared_ptr<SandboxHandle> sandbox, const ExecSpec& spec,
            bool may_end_at_once = false)
        : proc_(open_process(provider, std::move(sandbox), spec)) {
        REQUIRE(proc_.pidfd);
        if (!may_end_at_once) REQUIRE(proc_.pid > 0);
        // The channel's PID namespace, known only while the pidfd says the init has not
        // exited (after that the pid could name another process).
        if (proc_.pid > 0) ns_ = pid_ns_of(proc_.pid);
        if (wait_readable(proc_.pidfd.get(), milliseconds{0})) ns_ = 0;
    }

    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    Channel(Channel&&) = delete;
    Channel& operator=(Channel&&) = delete;

    ~Channel() {
        if (!reaped_) kill_and_reap();
    }

    /// Queues bytes for the command's stdin; `close_after`: close it once they are written.
    void send(std::string data, bool close_after) {
        pending_in_ += data;
        close_in_ = close_after;
        flush_stdin();
    }

    void control(unsigned char byte) { REQUIRE(::write(proc_.control_fd.get(), &byte, 1) == 1); }

    /// Pumps every fd until `done()` holds; false on timeout.
    bool pump_until(const std::function<bool()>& done, milliseconds timeout,
                    milliseconds tick = milliseconds{-1}) {
        auto deadline = Clock::now() + timeout;
        while (!done()) {
            auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
            if (left.count() <= 0) return false;
            if (tick.count() >= 0) left = std::min(left, tick);
            pump_once(left);
        }
        return true;
    }

    bool status_done() const { return !proc_.status_fd || status_.find('\n') != std::string::npos; }
    /// stdout, stderr and the status pipe have all reached EOF.
    bool output_eof() const { return !proc_.stdout_fd && !proc_.stderr_fd && !proc_.status_fd; }

    /// Waits for the status line, kills the channel init, reads the output (and the status
    /// pipe) to EOF and checks the channel's namespace is empty. False on any timeout.
    bool finish(milliseconds timeout = status_timeout) {
        if (!pump_until([this] { return status_done(); }, timeout)) return false;
        kill_and_reap();
        return pump_until([this] { return output_eof(); }, teardown_timeout) && reap_ok_;
    }

    /// Host pid of the channel's init (PID 1 of the channel's namespace).
    pid_t init_pid() const { return proc_.pid; }

    /// Host pid of the command's main process (the channel init's only child), -1 if none.
    pid_t command_pid() const {
        auto children = children_of(proc_.pid);
        return children.size() == 1 ? children.front() : -1;
    }

    /// Inode of the channel's PID namespace (0 if the init had exited by the time we looked).
    ino_t pid_ns() const { return ns_; }

    /// Host pids of the live processes of the channel (before finish()).
    std::vector<pid_t> members() const {
        return ns_ != 0 ? processes_in_pid_ns(ns_) : std::vector<pid_t>{};
    }

    ProcessEnds& proc() { return proc_; }
    const std::string& out() const { return out_; }
    const std::string& err() const { return err_; }
    /// The status line without its newline.
    std::string status() const { return status_.substr(0, status_.find('\n')); }
    /// Every byte read from the status pipe.
    const std::string& raw_status() const { return status_; }
    /// Processes of the channel's PID namespace still alive once its init had exited.
    const std::vector<pid_t>& leftovers() const { return leftovers_; }

    /// Waits for the channel init to exit on its own (no signal from us), then records what
    /// is left of its namespace.
    bool wait_exit(milliseconds timeout) {
        if (!wait_readable(proc_.pidfd.get(), timeout)) return false;
        reaped_ = true;
        if (ns_ != 0) leftovers_ = processes_in_pid_ns(ns_);
        return true;
    }

private:
    void kill_and_reap() {
        // ESRCH when it has exited already: then the wait below returns at once.
        ::syscall(SYS_pidfd_send_signal, proc_.pidfd.get(), SIGKILL, nullptr, 0);
        // Readable once the init has exited, which the kernel lets happen only after every
        // other process of its namespace is gone.
        reap_ok_ = wait_readable(proc_.pidfd.get(), teardown_timeout);
        reaped_ = true;
        if (ns_ != 0) leftovers_ = processes_in_pid_ns(ns_);
    }

    void flush_stdin() {
        while (proc_.stdin_fd && !pending_in_.empty()) {
            ssize_t n = ::write(proc_.stdin_fd.get(), pending_in_.data(), pending_in_.size());
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN) return;
                pending_in_.clear();  // EPIPE: the reader is gone
                break;
            }
            pending_in_.erase(0, static_cast<std::size_t>(n));
        }
        if (pending_in_.empty() && close_in_) proc_.stdin_fd.reset();
    }

    static void drain(unique_fd& fd, std::string& into) {
        char buf[65536];
        for (;;) {
            ssize_t n = ::read(fd.get(), buf, sizeof buf);
            if (n > 0) {
                into.append(buf, static_cast<std::size_t>(n));
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && errno == EAGAIN) return;
            fd.reset();  // EOF, or EIO from a PTY master whose slave is closed
            return;
        }
    }

    void pump_once(milliseconds timeout) {
        std::vector<pollfd> fds;
        auto add = [&fds](const unique_fd& fd, short events) {
            if (fd) fds.push_back({fd.get(), events, 0});
        };
        if (!pending_in_.empty()) add(proc_.stdin_fd, POLLOUT);
        add(proc_.stdout_fd, POLLIN);
        add(proc_.stderr_fd, POLLIN);
        add(proc_.status_fd, POLLIN);  // to EOF: nothing may follow the line
        int r = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
        if (r <= 0) return;
        flush_stdin();
        if (proc_.stdout_fd) drain(proc_.stdout_fd, out_);
        if (proc_.stderr_fd) drain(proc_.stderr_fd, err_);
        if (proc_.status_fd) drain(proc_.status_fd, status_);
    }

    ProcessEnds proc_;
    ino_t ns_ = 0;
    std::string pending_in_;
    bool close_in_ = false;
    std::string out_, err_, status_;
    bool reaped_ = false;
    bool reap_ok_ = false;
    std::vector<pid_t> leftovers_;
};

struct Result {
    std::string out, err, status;
};

ExecSpec command(std::vector<std::string> argv) {
    ExecSpec spec;
    spec.argv = std::move(argv);
    return spec;
}

/// Runs `spec` to completion with `input` on stdin (then closed).
Result run(Fixture& fx, const ExecSpec& spec, const std::string& input = "") {
    Channel ch(*fx.provider, fx.sandbox, spec);
    ch.send(input, true);
    REQUIRE(ch.finish());
    CHECK(ch.leftovers().empty());
    CHECK(ch.raw_status() == ch.status() + "\n");  // exactly one line, nothing after it
    return {ch.out(), ch.err(), ch.status()};
}

/// Host uids of `pid` (real, effective, saved, filesystem) as one string.
std::string uids_of(pid_t pid) {
    auto f = status_field(pid, "Uid");
    std::string out;
    for (const auto& v : f) out += (out.empty() ? "" : " ") + v;
    return out;
}

std::string four_times(uid_t id) {
    const auto s = std::to_string(id);
    return s + " " + s + " " + s + " " + s;
}

}  // namespace

/// What a channel backend gave: its output per stream and its exit.
struct BackendRun {
    std::string out, err;
    ChannelExit exit;
    bool stdin_taken = false;
};

awaitable<void> read_stream(ChannelBackend* backend, output_stream stream,
                            std::shared_ptr<BackendRun> run) {
    auto& into = stream == output_stream::err ? run->err : run->out;
    for (;;) {
        const std::size_t avail = co_await output_ready(*backend, stream);
        if (avail == 0) co_return;
        std::string buf(avail, '\0');
        const auto n = backend->read_output(stream, buf);
        if (!n) co_return;
        into.append(buf.data(), *n);
    }
}

awaitable<void> drive_backend(ChannelBackend* backend, std::string input,
                              std::shared_ptr<BackendRun> run) {
    using namespace boost::asio::experimental::awaitable_operators;
    if (backend->has_stdin()) {
        run->stdin_taken = co_await backend->write_stdin(std::move(input));
        backend->close_stdin();
    }
    run->exit = co_await (wait_exit(*backend) && read_stream(backend, output_stream::out, run) &&
                          read_stream(backend, output_stream::err, run));
    co_await wait_gone(*backend);
}

/// Opens `spec`, writes `input` to its stdin, reads both streams to their end and waits for
/// the exit and the end of every process, through the ChannelBackend interface only.
BackendRun run_backend(Fixture& fx, ExecSpec spec, std::string input) {
    using namespace boost::asio::experimental::awaitable_operators;
    spec.drain_grace_ms = 0;  // the init exits with the command, as the daemon's channels do
    auto backend = sandboxd::test::run_awaitable(test_io(), fx.provider->open(fx.sandbox, spec));
    auto run = std::make_shared<BackendRun>();
    boost::asio::steady_timer bound(test_io(), status_timeout);
    auto finished = sandboxd::test::run_awaitable(
        test_io(), drive_backend(backend.get(), std::move(input), run) ||
                       bound.async_wait(boost::asio::use_awaitable));
    CHECK(finished.index() == 0);
    return *run;
}

TEST_CASE("process backend: output, stdin and the exit through the ChannelBackend interface",
          "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto run = run_backend(fx, command({"sh", "-c", "cat; echo err >&2; exit 3"}), "hello");
        CHECK(run.stdin_taken);
        CHECK(run.out == "hello");
        CHECK(run.err == "err\n");
        CHECK(run.exit.exit_code == 3);
        CHECK(run.exit.signal == 0);
        CHECK(run.exit.error.empty());
        CHECK_FALSE(run.exit.lost);

        auto killed = run_backend(fx, command({"sh", "-c", "kill -TERM $$"}), "");
        CHECK_FALSE(killed.exit.exit_code);
        CHECK(killed.exit.signal == SIGTERM);

        auto backend = sandboxd::test::run_awaitable(
            test_io(), fx.provider->open(fx.sandbox, command({"true"})));
        CHECK(backend->has_output(output_stream::err));
        try {
            backend->resize(100, 30);
            FAIL("resize of a pipe channel succeeded");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::invalid_params);
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE(
    "process backend: an emptied channel cgroup serves the lease's next channel, its "
    "counts from that channel on",
    "[provider][cgroup]") {
    Fixture fx(json{{"limits", {{"memoryBytes", 64 << 20}}}});
    // The channel's memory cgroup, as its own cgroup namespace shows it.
    const std::string memory_line = "grep ':memory:' /proc/self/cgroup";
    auto first = run_backend(fx, command({"sh", "-c", memory_line}), "");
    REQUIRE(first.exit.exit_code == 0);
    REQUIRE(first.out.find(":memory:/") != std::string::npos);

    // Killed by its lease's memory limit: reported as memory.
    auto hog = run_backend(
        fx,
        command({"sh", "-c", memory_line + "; exec awk 'BEGIN { s = \"x\"; while (1) s = s s }'"}),
        "");
    CHECK(hog.out == first.out);  // the first channel's cgroup, emptied, again
    CHECK(hog.exit.signal == SIGKILL);
    CHECK(hog.exit.limit == "memory");

    // The same cgroup once more, which has one OOM kill on its count: a SIGKILL that no limit
    // caused is not reported as one.
    auto killed = run_backend(fx, command({"sh", "-c", memory_line + "; kill -KILL $$"}), "");
    CHECK(killed.out == first.out);
    CHECK(killed.exit.signal == SIGKILL);
    CHECK(killed.exit.limit.empty());

    // Two channels at once cannot share one.
    Channel held(*fx.provider, fx.sandbox, command({"sh", "-c", memory_line + "; exec sleep 60"}));
    auto beside = run_backend(fx, command({"sh", "-c", memory_line}), "");
    CHECK(beside.exit.exit_code == 0);
    CHECK(beside.out.find(":memory:/") != std::string::npos);
    CHECK(beside.out != first.out);
}

/// Records what a backend reports through the callback forms (ChannelBackend::notify_*()).
class Recorder final : public ChannelEvents {
public:
    explicit Recorder(boost::asio::any_io_executor executor) : executor_(std::move(executor)) {}
    boost::asio::any_io_executor events_executor() const override { return executor_; }
    void output_ready(output_stream stream, std::size_t bytes) override {
        ready.emplace_back(stream, bytes);
    }
    void exited(ChannelExit e) override { exit = std::move(e); }
    void gone() override { gone_reported = true; }
    void ended() override {
        ++ended_reported;
        ended_before_gone = !gone_reported;
    }

    std::vector<std::pair<output_stream, std::size_t>> ready;
    std::optional<ChannelExit> exit;
    bool gone_reported = false;
    int ended_reported = 0;
    bool ended_before_gone = false;

private:
    boost::asio::any_io_executor executor_;
};

namespace {

/// Runs `io`'s handlers until `done` or a bound (never a sleep: each step waits on a pipe);
/// returns `done`.
bool run_io_until(boost::asio::io_context& io, const std::function<bool()>& done) {
    const auto deadline = Clock::now() + status_timeout;
    while (!done() && Clock::now() < deadline) {
        io.restart();
        io.run_one_for(milliseconds(100));
    }
    return done();
}

}  // namespace

/// A process backend over pipes that the test writes itself (its stdout and its status line),
/// around a `sleep` child of this process as the channel init that its pidfd watches.
struct PipeBackend {
    explicit PipeBackend(boost::asio::io_context& io) {
        const char* argv[] = {"sleep", "60", nullptr};
        REQUIRE(::posix_spawnp(&child, "sleep", nullptr, nullptr, const_cast<char**>(argv),
                               environ) == 0);
        ProcessEnds ends;
        ends.pid = child;
        ends.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, child, 0)));
        REQUIRE(ends.pidfd);
        int status[2], out[2], control[2];
        REQUIRE(::pipe2(status, O_CLOEXEC | O_NONBLOCK) == 0);
        REQUIRE(::pipe2(out, O_CLOEXEC | O_NONBLOCK) == 0);
        REQUIRE(::pipe2(control, O_CLOEXEC | O_NONBLOCK) == 0);
        ends.status_fd.reset(status[0]);
        status_w.reset(status[1]);
        ends.stdout_fd.reset(out[0]);
        out_w.reset(out[1]);
        control_r.reset(control[0]);
        ends.control_fd.reset(control[1]);
        backend = std::make_unique<ProcessBackend>(io.get_executor(), std::move(ends));
    }
    ~PipeBackend() {
        backend.reset();  // SIGKILL to the child unless it is known to be gone
        int status = 0;
        ::waitpid(child, &status, 0);
    }
    PipeBackend(const PipeBackend&) = delete;
    PipeBackend& operator=(const PipeBackend&) = delete;

    void write_status(std::string_view text) const {
        REQUIRE(::write(status_w.get(), text.data(), text.size()) ==
                static_cast<ssize_t>(text.size()));
    }

    pid_t child = -1;
    unique_fd status_w, out_w, control_r;
    std::unique_ptr<ProcessBackend> backend;
};

TEST_CASE("process backend: its callback forms report what its awaitables do, without a frame",
          "[provider]") {
    const int fds_before = open_fd_count();
    {
        boost::asio::io_context io;
        // Runs the handlers that are ready now (an io_context that ran out of work is stopped
        // until restarted).
        auto poll = [&io] {
            io.restart();
            return io.poll();
        };
        auto run_until = [&io](const std::function<bool()>& done) {
            return run_io_until(io, done);
        };
        auto recorder = std::make_shared<Recorder>(io.get_executor());
        PipeBackend pipes(io);
        auto& backend = *pipes.backend;

        SECTION("a status line in two writes is one exit") {
            backend.notify_exit(recorder);
            poll();
            CHECK_FALSE(recorder->exit);
            pipes.write_status("sig");
            io.restart();
            REQUIRE(io.run_one_for(status_timeout) == 1);  // reads "sig", waits again
            CHECK_FALSE(recorder->exit);
            pipes.write_status("nal 9\n");
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK(recorder->exit->signal == 9);
            CHECK_FALSE(recorder->exit->exit_code);
            CHECK(recorder->exit->error.empty());
        }
        SECTION("a whole line") {
            pipes.write_status("exit 3\n");
            backend.notify_exit(recorder);
            CHECK_FALSE(recorder->exit);  // never inside the call
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK(recorder->exit->exit_code == 3);
            CHECK(recorder->exit->error.empty());
        }
        SECTION("the init's \"end\" line after the exit line: ended() before gone()") {
            const bool one_write = GENERATE(true, false);
            CAPTURE(one_write);
            pipes.write_status(one_write ? "exit 0\nend\n" : "exit 0\n");
            backend.notify_exit(recorder);
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK(recorder->exit->exit_code == 0);
            CHECK(recorder->exit->error.empty());
            backend.notify_gone(recorder);
            CHECK(recorder->ended_reported == 0);  // never inside the call
            if (!one_write) {
                poll();
                CHECK(recorder->ended_reported == 0);  // waits for the line
                pipes.write_status("en");
                poll();
                CHECK(recorder->ended_reported == 0);  // half a line is no end
                pipes.write_status("d\n");
            }
            REQUIRE(run_until([&] { return recorder->ended_reported == 1; }));
            CHECK_FALSE(recorder->gone_reported);  // the init itself is still there
            backend.kill();
            REQUIRE(run_until([&] { return recorder->gone_reported; }));
            CHECK(recorder->ended_reported == 1);
            CHECK(recorder->ended_before_gone);
        }
        SECTION("anything but \"end\" after the exit line, or EOF, leaves the end to the pidfd") {
            const std::string after = GENERATE(std::string("done\n"), std::string("endless"),
                                               std::string("exit 0\n"), std::string());
            CAPTURE(after);
            pipes.write_status("exit 0\n" + after);
            backend.notify_exit(recorder);
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK(recorder->exit->exit_code == 0);
            backend.notify_gone(recorder);
            // Until the backend has read all of it (FIONREAD works on either end of a pipe).
            REQUIRE(run_until([&] {
                int queued = -1;
                return ::ioctl(pipes.status_w.get(), FIONREAD, &queued) == 0 && queued == 0;
            }));
            pipes.status_w.reset();  // then EOF
            poll();
            poll();
            CHECK(recorder->ended_reported == 0);
            CHECK_FALSE(recorder->gone_reported);
            backend.kill();
            REQUIRE(run_until([&] { return recorder->gone_reported; }));
            CHECK(recorder->ended_reported == 0);
        }
        SECTION("a line too long to be one is an invalid status") {
            pipes.write_status(std::string(40, '7'));
            backend.notify_exit(recorder);
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK_FALSE(recorder->exit->exit_code);
            CHECK(recorder->exit->error == "the channel's init sent an invalid status");
        }
        SECTION("a number out of range is an invalid status") {
            pipes.write_status("exit 300\n");
            backend.notify_exit(recorder);
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK_FALSE(recorder->exit->exit_code);
            CHECK_FALSE(recorder->exit->error.empty());
        }
        SECTION("EOF with no line is an end with no report") {
            pipes.status_w.reset();
            backend.notify_exit(recorder);
            REQUIRE(run_until([&] { return recorder->exit.has_value(); }));
            CHECK_FALSE(recorder->exit->exit_code);
            CHECK(recorder->exit->signal == 0);
            CHECK(recorder->exit->error.empty());
        }
        SECTION("output readiness: bytes, then the end; and the init's end") {
            backend.notify_output_ready(output_stream::out, recorder);
            poll();
            CHECK(recorder->ready.empty());  // an empty pipe waits
            REQUIRE(::write(pipes.out_w.get(), "abc", 3) == 3);
            REQUIRE(run_until([&] { return !recorder->ready.empty(); }));
            CHECK(recorder->ready.back() == std::pair{output_stream::out, std::size_t{3}});
            std::string buf(8, '\0');
            CHECK(backend.read_output(output_stream::out, buf) == std::optional<std::size_t>{3});
            pipes.out_w.reset();
            backend.notify_output_ready(output_stream::out, recorder);
            REQUIRE(run_until([&] { return recorder->ready.size() == 2; }));
            CHECK(recorder->ready.back().second >= 1);  // readable: read_output finds the end
            CHECK_FALSE(backend.read_output(output_stream::out, buf));
            backend.notify_output_ready(output_stream::out, recorder);
            REQUIRE(run_until([&] { return recorder->ready.size() == 3; }));
            CHECK(recorder->ready.back().second == 0);  // closed: ended

            backend.notify_gone(recorder);
            poll();
            CHECK_FALSE(recorder->gone_reported);
            backend.kill();
            REQUIRE(run_until([&] { return recorder->gone_reported; }));
        }
        // The handlers hold the recorder until they have run; none is left pending.
        poll();
        CHECK(recorder.use_count() == 1);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE(
    "process backend: notify_gone() reports ended() at the init's \"end\" line, or gone() with its "
    "pidfd",
    "[provider]") {
    const int fds_before = open_fd_count();
    {
        boost::asio::io_context io;
        auto run_until = [&io](const std::function<bool()>& done) {
            return run_io_until(io, done);
        };
        PipeBackend pipes(io);
        auto& backend = *pipes.backend;
        std::optional<ChannelExit> exit;
        std::optional<bool> gone_at_end;  // GoneWait::ended()'s answer
        bool gone = false;
        boost::asio::co_spawn(
            io,
            [&]() -> sandboxd::awaitable<void> {
                exit = co_await wait_exit(backend);
                GoneWait end;
                gone_at_end = co_await end.ended(backend);
                if (!*gone_at_end) co_await end.gone(backend);
                gone = true;
            },
            boost::asio::detached);

        SECTION("\"end\" in the exit line's write, or after it: the init still runs") {
            const bool one_write = GENERATE(true, false);
            CAPTURE(one_write);
            pipes.write_status(one_write ? "exit 0\nend\n" : "exit 0\n");
            REQUIRE(run_until([&] { return exit.has_value(); }));
            CHECK(exit->exit_code == 0);
            if (!one_write) {
                io.restart();
                io.poll();
                CHECK_FALSE(gone_at_end);  // waits for the line
                pipes.write_status("end\n");
            }
            REQUIRE(run_until([&] { return gone_at_end.has_value(); }));
            CHECK_FALSE(*gone_at_end);
            CHECK(::kill(pipes.child, 0) == 0);  // the init is still there
            CHECK_FALSE(gone);
            backend.kill();
            REQUIRE(run_until([&] { return gone; }));
        }
        SECTION("no \"end\": the pidfd answers, gone") {
            const std::string after = GENERATE(std::string(), std::string("bogus\n"));
            CAPTURE(after);
            pipes.write_status("exit 0\n" + after);
            REQUIRE(run_until([&] { return exit.has_value(); }));
            io.restart();
            io.poll();
            CHECK_FALSE(gone_at_end);
            backend.kill();  // the status pipe stays open: only the pidfd can tell
            REQUIRE(run_until([&] { return gone; }));
            CHECK(gone_at_end == true);
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("A command is started only before its start deadline (the node's fencing deadline)",
          "[provider][fencing]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        const auto now_ms = [] {
            return std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                .count();
        };
        const auto marker = fx.sandbox->workspace / "started";
        auto spec = command({"touch", "/workspace/started"});
        spec.start_deadline_ms = now_ms() - 1;
        try {
            sandboxd::test::run_awaitable(test_io(), fx.provider->open(fx.sandbox, spec));
            FAIL("a command past its start deadline was started");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::registry_unavailable);
            CHECK(std::string(e.what()).find("fencing deadline passed") != std::string::npos);
        }
        CHECK_FALSE(std::filesystem::exists(marker));
        // The sandbox serves on: a deadline ahead starts the command.
        spec.start_deadline_ms = now_ms() + 60000;
        auto r = run(fx, spec);
        CHECK(r.status == "exit 0");
        CHECK(std::filesystem::exists(marker));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("exit status, stdout and stderr are reported", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "printf hello; printf err >&2; exit 3"}));
        CHECK(r.out == "hello");
        CHECK(r.err == "err");
        CHECK(r.status == "exit 3");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("stdin is passed through byte for byte", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        std::string data(1 << 20, '\0');
        for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i & 0xff);
        auto r = run(fx, command({"cat"}), data);
        CHECK(r.out.size() == data.size());
        CHECK(r.out == data);
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("death by signal is reported", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "kill -TERM $$"}));
        CHECK(r.status == "signal 15");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command has no capabilities", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // None in any set, not even in the bounding set (so exec as uid 0 grants none).
        auto r = run(fx, command({"grep", "^Cap", "/proc/self/status"}));
        CHECK(r.out ==
              "CapInh:\t0000000000000000\n"
              "CapPrm:\t0000000000000000\n"
              "CapEff:\t0000000000000000\n"
              "CapBnd:\t0000000000000000\n"
              "CapAmb:\t0000000000000000\n");
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command starts with no signal blocked, ignored or caught", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // The supervisor resets every disposition once and each channel's init hands its own
        // handlers (the forwarded signals, SIGCHLD) and its ignored SIGPIPE back to the default
        // before the exec; the mask is empty. A shell would change these: cat reads them.
        auto r = run(fx, command({"cat", "/proc/self/status"}));
        std::string sig;
        std::istringstream lines(r.out);
        for (std::string line; std::getline(lines, line);) {
            if (line.rfind("SigBlk:", 0) == 0 || line.rfind("SigIgn:", 0) == 0 ||
                line.rfind("SigCgt:", 0) == 0) {
                sig += line + "\n";
            }
        }
        CHECK(sig ==
              "SigBlk:\t0000000000000000\n"
              "SigIgn:\t0000000000000000\n"
              "SigCgt:\t0000000000000000\n");
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command sees fds 0, 1 and 2 only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // Inheritable fds of our own must not reach the sandbox.
        unique_fd extra1(::open("/dev/null", O_RDONLY));
        unique_fd extra2(::open("/dev/null", O_RDONLY));
        int p[2];
        REQUIRE(::pipe(p) == 0);
        unique_fd extra3(p[0]), extra4(p[1]);
        auto r = run(fx, command({"ls", "/proc/self/fd"}));
        CHECK(r.out == "0\n1\n2\n3\n");  // 3: ls's own directory fd
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the environment is exactly the fixed one plus spec.env", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"env"});
        spec.env["SANDBOXD_TEST"] = "a value=with equals";
        auto r = run(fx, spec);
        CHECK(sorted_lines(r.out) ==
              std::vector<std::string>{
                  "HOME=/workspace",
                  "LANG=C.UTF-8",
                  "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "SANDBOXD_TEST=a value=with equals",
                  "TERM=dumb",
              });
        CHECK(r.status == "exit 0");

        auto bad = command({"env"});
        bad.env["A=B"] = "x";
        try {
            open_process(*fx.provider, fx.sandbox, bad);
            FAIL("spawn accepted an invalid variable name");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::invalid_params);
            CHECK(std::string(e.what()).rfind("env: ", 0) == 0);
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the workspace is the host workspace dir at /workspace", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"pwd"}));
        CHECK(r.out == "/workspace\n");
        CHECK(r.status == "exit 0");

        // The lease's host uid is root inside.
        r = run(fx, command({"stat", "-c", "%u %g %a", "/workspace"}));
        CHECK(r.out == "0 0 755\n");

        r = run(fx, command({"sh", "-c", "echo data > file.txt && mkdir sub"}));
        CHECK(r.status == "exit 0");
        CHECK(read_text(fx.sandbox->workspace / "file.txt") == "data\n");
        CHECK(stat_of(fx.sandbox->workspace / "file.txt").st_uid == lease_uid(*fx.sandbox));

        auto spec = command({"pwd"});
        spec.cwd = "sub";
        CHECK(run(fx, spec).out == "/workspace/sub\n");
        spec.cwd = "/tmp";
        CHECK(run(fx, spec).out == "/tmp\n");
    }
    CHECK(open_fd_count() == fds_before);
}

// With egress (a namespace the daemon makes, a veth pair, the policy): network_test.cpp, which
// runs the daemon in a network namespace of its own.
TEST_CASE("without egress on the node a lease has loopback only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        CHECK(fx.sandbox->network ==
              json{{"mode", "none"}, {"allow", json::array()}, {"deny", json::array()}});
        auto r = run(fx, command({"cat", "/proc/net/dev"}));
        auto lines = sorted_lines(r.out);
        std::set<std::string> interfaces;
        for (const auto& line : lines) {
            auto colon = line.find(':');
            if (colon == std::string::npos || line.find('|') != std::string::npos) continue;
            auto name = line.substr(0, colon);
            name.erase(0, name.find_first_not_of(' '));
            interfaces.insert(name);
        }
        CHECK(interfaces == std::set<std::string>{"lo"});
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("32 leases of the default limits fit the budgets of a host with pid_max 32,768",
          "[provider][budget]") {
    // This project's machines: pid_max 32,768, fs.file-max 2,466,239; the default overcommit.
    const BwrapLimitsConfig node;
    detail::NodeBudget budget(32768, 2466239, node.overcommit);
    const auto defaults = detail::parse_lease_config(nullptr, node, {}).limits;
    CHECK(defaults.pids == 512);
    CHECK(defaults.open_files_total() == 512 * 512);  // less than 1 GiB / 512
    const detail::BudgetShare share{defaults.pids, defaults.open_files_total()};
    for (int i = 0; i < 32; ++i) {
        INFO("lease " << i);
        CHECK_NOTHROW(budget.take(share));
    }
    // The largest lease's pids are well below pid_max.
    REQUIRE(node.max.pids.has_value());
    CHECK(*node.max.pids <= 32768 / 8);
}

TEST_CASE("the node's budgets refuse a lease beyond them, counting its lesser open-file cap",
          "[provider][budget]") {
    TempDir dir;
    // A host of its own for the budgets: pid_max 2048 (a reserve of 1024 for the host leaves
    // 1024), file-max 200000 (less 65536: 134464), no overcommit.
    const fs::path proc_sys = dir.path / "proc-sys";
    fs::create_directories(proc_sys / "kernel");
    fs::create_directories(proc_sys / "fs");
    std::ofstream(proc_sys / "kernel" / "pid_max") << "2048\n";
    std::ofstream(proc_sys / "fs" / "file-max") << "200000\n";
    const fs::path sandboxes = dir.path / "sandboxes";
    fs::path lease_root;
    {
        auto options = test_options(sandboxes);
        options.proc_sys = proc_sys;
        options.limits.overcommit = 1;
        auto provider = make_bwrap_provider(options);
        SandboxScope scope{"bwrap", "c", "e", ""};
        auto lease = [&](std::uint32_t pids, std::uint32_t open_files, std::uint64_t memory) {
            return create_sandbox(*provider, scope, "lease",
                                  {{"limits",
                                    {{"pids", pids},
                                     {"openFiles", open_files},
                                     {"memoryBytes", memory},
                                     {"diskBytes", 16 * mib}}}});
        };
        auto refused = [&](std::uint32_t pids, std::uint32_t open_files, std::uint64_t memory) {
            try {
                auto made = lease(pids, open_files, memory);
                LeaseGuard guard(*provider, made);
                FAIL("created a lease beyond the budget");
            } catch (const rpc_error& e) {
                CHECK(e.code() == errc::channel_limit);
                return std::make_pair(std::string(e.what()), e.data());
            }
            return std::make_pair(std::string(), json());
        };
        // 512 pids and min(64 x 512, 64 MiB / 512) = 32768 files.
        auto a = lease(512, 64, 64 * mib);
        LeaseGuard a_guard(*provider, a);
        lease_root = a->workspace.parent_path().parent_path();
        CHECK(a->limits["openFilesTotal"] == 32768);
        // 512 pids and min(1024 x 512, 32 MiB / 512) = 65536 files: memory is the lesser
        // (the product, 524288, would not fit the 134464 files of the budget).
        auto b = lease(512, 1024, 32 * mib);
        LeaseGuard b_guard(*provider, b);
        CHECK(b->limits["openFilesTotal"] == 65536);
        // The pids budget (1024) is taken: 8 more are refused, and nothing is made for it.
        const auto entries = sandbox_entries(sandboxes).size();
        auto [message, data] = refused(8, 16, 64 * mib);
        CHECK(data == json{{"limit", "nodePids"}});
        CHECK(message ==
              "this node's pids budget is full: its leases hold 1024 of 1024 (kernel.pid_max "
              "2048 less 1024 kept for the host, times overcommit 1) and this lease asks for 8");
        CHECK(sandbox_entries(sandboxes).size() == entries);
        // A destroyed lease gives its share back.
        destroy_sandbox(*provider, a);
        auto c = lease(8, 16, 64 * mib);  // 8 pids, min(128, 131072) files
        LeaseGuard c_guard(*provider, c);
        // Files held: 65536 + 128; a lease of min(65536 x 64, 64 MiB / 512) = 131072 more
        // exceeds 134464.
        std::tie(message, data) = refused(64, 65536, 64 * mib);
        CHECK(data == json{{"limit", "nodeOpenFiles"}});
        CHECK(message.rfind("this node's open-file budget is full: its leases hold 65664 of "
                            "134464 (fs.file-max 200000 less 65536",
                            0) == 0);
        // ... and one whose memory makes its cap small enough fits: min(4194304, 32768).
        auto d = lease(64, 65536, 16 * mib);
        LeaseGuard d_guard(*provider, d);
        CHECK(d->limits["openFilesTotal"] == 32768);
    }
    remove_lease_root(lease_root, dir);
}

TEST_CASE("create validates the lease config", "[provider]") {
    const int fds_before = open_fd_count();
    TempDir dir;
    const fs::path sandboxes = dir.path / "sandboxes";
    fs::path lease_root;  // where the leases' own directories are
    {
        auto options = test_options(sandboxes);
        options.limits.max.memory_bytes = 2048 * mib;
        auto provider = make_bwrap_provider(options);
        CHECK(provider->key() == "bwrap");
        CHECK(provider->plugin_id() == "builtin");
        SandboxScope scope{"bwrap", "c", "e", ""};
        auto expect_invalid = [&](const json& config, const std::string& message,
                                  const std::string& field) {
            try {
                create_sandbox(*provider, scope, "lease", config);
                FAIL("create accepted " << config.dump());
            } catch (const rpc_error& e) {
                CHECK(e.code() == errc::invalid_params);
                CHECK(std::string(e.what()) == message);
                CHECK(e.data().value("field", "") == field);
            }
        };
        const std::string no_egress =
            "config.network: egress is not allowed on this node "
            "(providers.bwrap.network.egress is false)";
        expect_invalid({{"network", true}}, no_egress, "config.network");
        expect_invalid({{"network", {{"mode", "egress"}}}}, no_egress, "config.network");
        expect_invalid({{"network", 1}},
                       "config.network: must be an object {mode, allow?, deny?} (or the old "
                       "boolean)",
                       "config.network");
        expect_invalid({{"network", {{"mode", "none"}, {"allow", {"example.com"}}}}},
                       "config.network.allow: takes no rules under mode \"none\"",
                       "config.network.allow");
        expect_invalid({{"disk", 1}}, "config.disk: unknown key", "config.disk");
        expect_invalid(json::array(), "config: must be an object", "config");
        expect_invalid({{"limits", 5}}, "config.limits: must be an object", "config.limits");
        const std::string memory_range =
            "config.limits.memoryBytes: must be an integer in 16777216..1125899906842624";
        expect_invalid({{"limits", {{"memoryBytes", 1}}}}, memory_range,
                       "config.limits.memoryBytes");
        expect_invalid({{"limits", {{"memoryBytes", -1}}}}, memory_range,
                       "config.limits.memoryBytes");
        expect_invalid({{"limits", {{"memoryBytes", 64.5 * mib}}}}, memory_range,
                       "config.limits.memoryBytes");
        expect_invalid({{"limits", {{"memoryBytes", "64M"}}}}, memory_range,
                       "config.limits.memoryBytes");
        expect_invalid({{"limits", {{"memoryBytes", 4096 * mib}}}},
                       "config.limits.memoryBytes: 4294967296 is above this node's maximum of "
                       "2147483648",
                       "config.limits.memoryBytes");
        expect_invalid({{"limits", {{"pids", 7}}}},
                       "config.limits.pids: must be an integer in 8..4194304",
                       "config.limits.pids");
        expect_invalid({{"limits", {{"x", 1}}}}, "config.limits.x: unknown key", "config.limits.x");
        // A refused config leaves nothing behind.
        CHECK(sandbox_entries(sandboxes).empty());

        auto handle = create_sandbox(*provider, scope, "lease", nullptr);
        LeaseGuard handle_guard(*provider, handle);
        const std::string id = handle->scope.provider_lease_id;
        CHECK(id.rfind("bw-", 0) == 0);
        CHECK(id.size() == 19);
        CHECK(handle->scope.company_id == "c");
        CHECK(handle->lease_id == "lease");
        CHECK(handle->network["mode"] == "none");
        const json no_io = {{"ioReadBps", nullptr},  {"ioWriteBps", nullptr},
                            {"ioReadIops", nullptr}, {"ioWriteIops", nullptr},
                            {"ioWeight", nullptr},   {"egressBps", nullptr}};
        json expected = {{"memoryBytes", 1024 * mib},  {"pids", 512},
                         {"cpuWeight", 100},           {"cpuQuotaPercent", nullptr},
                         {"diskBytes", 1024 * mib},    {"openFiles", 512},
                         {"openFilesTotal", 512 * 512}};  // less than 1 GiB / 512
        expected.update(no_io);
        CHECK(handle->limits == expected);

        // The workspace: the mount point of the lease's own ext4 disk, in the lease's own
        // directory, owned by the lease's host uid.
        const fs::path workspace = handle->workspace;
        const fs::path lease_dir = workspace.parent_path();
        lease_root = lease_dir.parent_path();
        CHECK(workspace.filename() == "workspace");
        CHECK(lease_dir.filename() == id);
        CHECK(fs::is_directory(sandboxes / id));  // the lease's records (disk image, uid)
        CHECK(mounts_under(workspace) == std::vector<std::string>{workspace.string() + " ext4"});
        const auto ws = stat_of(workspace);
        const uid_t uid = ws.st_uid;
        CHECK(uid >= first_lease_uid);
        CHECK(ws.st_gid == uid);
        CHECK((ws.st_mode & 07777) == 0755);
        // root:<the lease's gid> 0750: the lease's bubblewrap may enter, no other uid may.
        const auto ld = stat_of(lease_dir);
        CHECK(ld.st_uid == 0);
        CHECK(ld.st_gid == uid);
        CHECK((ld.st_mode & 07777) == 0750);
        struct statvfs vfs {};
        REQUIRE(::statvfs(workspace.c_str(), &vfs) == 0);
        const auto disk_size = std::uint64_t{vfs.f_blocks} * vfs.f_frsize;
        CHECK(disk_size <= 1024 * mib);
        CHECK(disk_size >= 900 * mib);

        // The lease's cgroup: where its channels' inits are (ch-1 under the lease's).
        fs::path lease_cgroup;
        {
            Channel ch(*provider, handle, command({"true"}));
            REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
            CHECK(ch.status() == "exit 0");
            // The init joined the channel's cgroup before it started the command.
            const fs::path channel_cgroup = memory_cgroup_of(ch.init_pid());
            lease_cgroup = channel_cgroup.parent_path();
            CHECK(lease_cgroup.filename() == id);
            CHECK(fs::is_directory(lease_cgroup));
            REQUIRE(ch.finish());
            CHECK(ch.leftovers().empty());
        }

        // Limits given by the lease are those it runs with.
        auto other = create_sandbox(*provider, scope, "lease",
                                    {{"network", false},
                                     {"limits",
                                      {{"memoryBytes", 64 * mib},
                                       {"pids", 64},
                                       {"cpuQuotaPercent", 50},
                                       {"diskBytes", 64 * mib}}}});
        LeaseGuard other_guard(*provider, other);
        CHECK(other->scope.provider_lease_id != id);
        CHECK(lease_uid(*other) != uid);
        expected = {{"memoryBytes", 64 * mib},   {"pids", 64},
                    {"cpuWeight", 100},          {"cpuQuotaPercent", 50},
                    {"diskBytes", 64 * mib},     {"openFiles", 512},
                    {"openFilesTotal", 64 * 512}};  // less than 64 MiB / 512
        expected.update(no_io);
        CHECK(other->limits == expected);
        REQUIRE(::statvfs(other->workspace.c_str(), &vfs) == 0);
        CHECK(std::uint64_t{vfs.f_blocks} * vfs.f_frsize <= 64 * mib);

        destroy_sandbox(*provider, handle);
        CHECK_FALSE(fs::exists(workspace));
        CHECK_FALSE(fs::exists(lease_dir));
        CHECK_FALSE(fs::exists(sandboxes / id));
        CHECK(mounts_under(lease_dir).empty());
        CHECK_FALSE(fs::exists(lease_cgroup));
        destroy_sandbox(*provider, handle);  // idempotent
        CHECK(fs::exists(other->workspace));
        CHECK(mounts_under(other->workspace).size() == 1);

        destroy_sandbox(*provider, other);
        CHECK(sandbox_entries(sandboxes).empty());
        CHECK(sandbox_entries(lease_root).empty());
        CHECK(mounts_under(other->workspace).empty());
    }
    remove_lease_root(lease_root, dir);
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the root file system is read-only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "echo x > /usr/sandboxd-probe"}));
        CHECK(r.status != "exit 0");
        CHECK(r.err.find("Read-only file system") != std::string::npos);
        CHECK_FALSE(fs::exists("/usr/sandboxd-probe"));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("host sysctls are read-only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        const std::string host_value = read_text("/proc/sys/kernel/core_pattern");
        // Writes the current value back: harmless should the protection ever be missing.
        auto r = run(fx, command({"sh", "-c",
                                  "v=$(cat /proc/sys/kernel/core_pattern) && "
                                  "printf '%s\\n' \"$v\" > /proc/sys/kernel/core_pattern"}));
        CHECK(r.status != "exit 0");
        // A read-only /proc/sys, or (the sysctl belongs to the host's user namespace) EACCES.
        INFO(r.err);
        CHECK((r.err.find("Read-only file system") != std::string::npos ||
               r.err.find("Permission denied") != std::string::npos));
        CHECK(read_text("/proc/sys/kernel/core_pattern") == host_value);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a PTY has the requested size", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"stty", "size"});
        spec.pty = PtySize{132, 43};
        Channel ch(*fx.provider, fx.sandbox, spec);
        CHECK_FALSE(ch.proc().stderr_fd);
        REQUIRE(ch.finish());
        CHECK(ch.out() == "43 132\r\n");
        CHECK(ch.status() == "exit 0");
        CHECK(ch.leftovers().empty());

        spec.argv = {"env"};
        auto r = run(fx, spec);
        CHECK(r.out.find("TERM=xterm-256color\r\n") != std::string::npos);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a control byte signals the command's process group", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel ch(*fx.provider, fx.sandbox,
                   command({"sh", "-c",
                            "trap \"echo got-term; exit 7\" TERM; echo ready; "
                            "while :; do sleep 0.1; done"}));
        REQUIRE(ch.pump_until([&] { return ch.out() == "ready\n"; }, status_timeout));
        ch.control(15);
        REQUIRE(ch.finish());
        CHECK(ch.out() == "ready\ngot-term\n");
        CHECK(ch.status() == "exit 7");
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("signals sent to the init reach the command's group", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c",
                                  "trap \"echo got-usr1; exit 9\" USR1; kill -USR1 1; "
                                  "while :; do sleep 0.1; done"}));
        CHECK(r.out == "got-usr1\n");
        CHECK(r.status == "exit 9");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a control byte with 0x80 signals every process of the sandbox", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // The descendant left the command's process group: only kill(-1) reaches it.
        // The command ignores TERM only after it started the descendant (an ignored signal
        // could not be trapped there), and says so: the signal is sent after both are ready.
        Channel ch(*fx.provider, fx.sandbox,
                   command({"sh", "-c",
                            "setsid sh -c 'trap \"echo bg-term; exit 0\" TERM; echo bg-ready; "
                            "while :; do sleep 0.1; done' & "
                            "trap '' TERM; echo armed; wait"}));
        const auto ready = [&] {
            return ch.out().find("bg-ready\n") != std::string::npos &&
                   ch.out().find("armed\n") != std::string::npos;
        };
        REQUIRE(ch.pump_until(ready, status_timeout));
        ch.control(0x80 | 15);
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 0");  // `wait` returned: the descendant exited
        REQUIRE(ch.finish());
        CHECK(
            (ch.out() == "bg-ready\narmed\nbg-term\n" || ch.out() == "armed\nbg-ready\nbg-term\n"));
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("Ctrl-C on the PTY interrupts the foreground command", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"sh", "-c", "echo ready; exec sleep 30"});
        spec.pty = PtySize{80, 24};
        Channel ch(*fx.provider, fx.sandbox, spec);
        // "ready" comes after the init made the command's group the foreground group.
        REQUIRE(ch.pump_until([&] { return ch.out().find("ready\r\n") != std::string::npos; },
                              status_timeout));
        ch.send("\x03", false);
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, milliseconds{2000}));
        CHECK(ch.status() == "signal 2");
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("SIGKILL by control byte, and no process outlives the channel init", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel ch(*fx.provider, fx.sandbox, command({"sh", "-c", "sleep 300 & sleep 301"}));
        // Wait until both sleeps run (they may still be forking when the first byte comes).
        std::vector<pid_t> sleeps;
        REQUIRE(ch.pump_until(
            [&] {
                sleeps.clear();
                for (pid_t p : ch.members()) {
                    if (running_as(p, "sleep 300") || running_as(p, "sleep 301")) {
                        sleeps.push_back(p);
                    }
                }
                return sleeps.size() == 2;
            },
            status_timeout, milliseconds{10}));
        ch.control(9);
        REQUIRE(ch.finish());
        CHECK(ch.status() == "signal 9");
        CHECK(ch.leftovers().empty());
        for (pid_t p : sleeps) {
            CHECK_FALSE(running_as(p, "sleep 300"));
            CHECK_FALSE(running_as(p, "sleep 301"));
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the init outlives the command until the daemon kills the namespace", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // A descendant that left the command's process group writes after the command
        // ended, once the test creates the file it waits for.
        Channel ch(*fx.provider, fx.sandbox,
                   command({"sh", "-c",
                            "setsid sh -c 'while [ ! -e go ]; do sleep 0.05; done; echo late' "
                            "& echo early; exit 4"}));
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 4");
        std::ofstream(fx.sandbox->workspace / "go").put('\n');
        REQUIRE(ch.pump_until([&] { return ch.out() == "early\nlate\n"; }, status_timeout));
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
    }
    {
        Fixture fx;
        // The escaped descendant is killed with the namespace.
        Channel ch(*fx.provider, fx.sandbox,
                   command({"sh", "-c", "setsid sleep 302 >/dev/null 2>&1 & echo $!"}));
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 0");
        std::vector<pid_t> members = ch.members();
        CHECK(members.size() == 2);  // the init and the escaped descendant
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
        for (pid_t p : members) CHECK_FALSE(running_as(p, ""));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE(
    "with a drain grace the init says \"end\" once nothing but itself is left, its streams "
    "closed",
    "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // A background child holding stdout and stderr: the grace (0 ms) ends it.
        auto spec = command({"sh", "-c", "sleep 60 & echo hi; echo err >&2"});
        spec.drain_grace_ms = 0;
        Channel ch(*fx.provider, fx.sandbox, spec);
        REQUIRE(ch.pump_until([&] { return ch.raw_status().find("end\n") != std::string::npos; },
                              status_timeout));
        CHECK(ch.raw_status() == "exit 0\nend\n");
        // At the "end" line no process of the command is left: at most the init, exiting.
        for (const pid_t member : ch.members()) CHECK(member == ch.init_pid());
        // And both streams are at their end already: every byte is there, then EOF, no wait.
        auto rest_of = [](unique_fd& fd) {
            std::string text;
            if (!fd) return text;  // the pump saw its EOF already
            char buf[256];
            for (;;) {
                const ssize_t n = ::read(fd.get(), buf, sizeof buf);
                if (n > 0) {
                    text.append(buf, static_cast<std::size_t>(n));
                    continue;
                }
                if (n < 0 && errno == EINTR) continue;
                return n == 0 ? text : text + "<not at EOF: errno " + std::to_string(errno) + ">";
            }
        };
        CHECK(ch.out() + rest_of(ch.proc().stdout_fd) == "hi\n");
        CHECK(ch.err() + rest_of(ch.proc().stderr_fd) == "err\n");
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the init exits once the daemon lets go after the command ended", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        SECTION("control fd closed") {
            Channel ch(*fx.provider, fx.sandbox, command({"true"}));
            REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
            CHECK(ch.status() == "exit 0");
            ch.proc().control_fd.reset();
            // We send no signal: the init exits by itself, and with it the namespace.
            REQUIRE(ch.wait_exit(teardown_timeout));
            CHECK(ch.leftovers().empty());
            REQUIRE(ch.pump_until([&] { return ch.output_eof(); }, teardown_timeout));
            CHECK(ch.raw_status() == "exit 0\n");
        }
        SECTION("status fd closed") {
            Channel ch(*fx.provider, fx.sandbox, command({"true"}));
            REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
            CHECK(ch.status() == "exit 0");
            ch.proc().status_fd.reset();
            // We send no signal: the init exits by itself, and with it the namespace.
            REQUIRE(ch.wait_exit(teardown_timeout));
            CHECK(ch.leftovers().empty());
            REQUIRE(ch.pump_until([&] { return ch.output_eof(); }, teardown_timeout));
        }
        SECTION("control fd closed before the command ended is ignored") {
            Channel ch(*fx.provider, fx.sandbox, command({"sh", "-c", "read x; exit 5"}));
            ch.proc().control_fd.reset();
            ch.send("go\n", true);
            REQUIRE(ch.finish());
            CHECK(ch.status() == "exit 5");
            CHECK(ch.leftovers().empty());
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("stdin not attached reads EOF at once", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"cat"});
        spec.stdin_attached = false;
        Channel ch(*fx.provider, fx.sandbox, spec);
        CHECK_FALSE(ch.proc().stdin_fd);
        REQUIRE(ch.finish());
        CHECK(ch.out().empty());
        CHECK(ch.status() == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("spawning into a destroyed sandbox fails and starts nothing", "[provider]") {
    const int fds_before = open_fd_count();
    const auto children_before = own_children();
    {
        Fixture fx;
        destroy_sandbox(*fx.provider, fx.sandbox);
        CHECK_FALSE(fs::exists(fx.sandbox->workspace));
        try {
            open_process(*fx.provider, fx.sandbox, command({"true"}));
            FAIL("spawn succeeded");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::provider_error);
            CHECK(std::string(e.what()) == "sandbox " + fx.sandbox->scope.provider_lease_id +
                                               " is gone: its supervisor has exited");
        }
        CHECK(new_children(children_before).empty());  // bubblewrap reaped
        CHECK_FALSE(fs::exists(fx.sandbox->workspace));
    }
    CHECK(open_fd_count() == fds_before);
}

/// The comm of `pid` ("" once it is gone).
std::string comm_of(pid_t pid) {
    std::string comm = read_text("/proc/" + std::to_string(pid) + "/comm");
    if (!comm.empty() && comm.back() == '\n') comm.pop_back();
    return comm;
}

/// The supervisor's child named "warm-init" (its init made ahead of the next request), or 0.
pid_t warm_init_of(pid_t supervisor) {
    for (pid_t child : children_of(supervisor)) {
        if (comm_of(child) == "warm-init") return child;
    }
    return 0;
}

TEST_CASE("the supervisor makes the next channel's init ahead, in the lease's cgroup",
          "[provider]") {
    Fixture fx;
    Channel first(*fx.provider, fx.sandbox, command({"sh", "-c", "echo ready; read x"}));
    REQUIRE(first.pump_until([&] { return first.out() == "ready\n"; }, status_timeout));
    const pid_t supervisor = parent_of(first.init_pid());
    REQUIRE(supervisor > 0);
    const pid_t bwrap = parent_of(supervisor);
    REQUIRE(bwrap > 0);
    CHECK(comm_of(first.init_pid()) == "init");

    // Made after the first request was answered: PID 1 of a PID namespace of its own, in the
    // lease's cgroup (with the supervisor; bubblewrap stays in the daemon's), under the
    // command's syscall filter already: its last step before it waits (it has its name from
    // the clone on, so the wait is for the filter).
    pid_t warm = 0;
    REQUIRE(sandboxd::test::eventually(
        [&] {
            warm = warm_init_of(supervisor);
            return warm > 0 && status_field(warm, "Seccomp") == std::vector<std::string>{"2"};
        },
        status_timeout));
    CHECK(pid_ns_of(warm) != pid_ns_of(supervisor));
    CHECK(pid_ns_of(warm) != first.pid_ns());
    CHECK(status_field(warm, "NSpid").back() == "1");
    const fs::path lease_cgroup = memory_cgroup_of(first.init_pid()).parent_path();
    CHECK(lease_cgroup.filename() == fx.sandbox->scope.provider_lease_id);
    CHECK(memory_cgroup_of(supervisor) == lease_cgroup);
    CHECK(memory_cgroup_of(warm) == lease_cgroup);
    CHECK(memory_cgroup_of(bwrap) != lease_cgroup);
    CHECK(status_field(warm, "NoNewPrivs") == std::vector<std::string>{"1"});

    // The next channel is that init: its command is PID 2 under it, with a /proc of its own
    // and the channel's cgroup.
    Channel second(*fx.provider, fx.sandbox,
                   command({"sh", "-c", "echo $$; cat /proc/1/comm; echo /proc/[0-9]*"}));
    REQUIRE(second.finish());
    CHECK(second.init_pid() == warm);
    CHECK(second.status() == "exit 0");
    CHECK(second.out() == "2\ninit\n/proc/1 /proc/2\n");  // the init and sh (cat is reaped)

    // A warm init that is gone (killed here) is passed over: the request clones its own.
    pid_t next = 0;
    REQUIRE(sandboxd::test::eventually([&] { return (next = warm_init_of(supervisor)) > 0; },
                                       status_timeout));
    // Gone, not dying: a SIGKILL still pending leaves its socket open, and a request passed
    // on then would be this init's (and fail with it), as a cloned init killed at its start.
    unique_fd next_fd(static_cast<int>(::syscall(SYS_pidfd_open, next, 0)));
    REQUIRE(next_fd);
    REQUIRE(::kill(next, SIGKILL) == 0);
    REQUIRE(wait_readable(next_fd.get(), status_timeout));
    Channel third(*fx.provider, fx.sandbox, command({"echo", "cloned"}));
    REQUIRE(third.finish());
    CHECK(third.init_pid() != next);
    CHECK(third.status() == "exit 0");
    CHECK(third.out() == "cloned\n");
    first.send("", true);
    REQUIRE(first.finish());
}

TEST_CASE(
    "the next warm init comes once the last one has started its command, however "
    "its start ends",
    "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel first(*fx.provider, fx.sandbox, command({"sh", "-c", "echo ready; read x"}));
        REQUIRE(first.pump_until([&] { return first.out() == "ready\n"; }, status_timeout));
        const pid_t supervisor = parent_of(first.init_pid());
        REQUIRE(supervisor > 0);
        // Its init lets go of the socket it was handed the request on once the command has
        // started: right after its clone returns, which may be after the command's first
        // output has come (the init and the command run at once from the exec on).
        std::vector<std::string> sockets;
        auto init_sockets = [&] {
            sockets.clear();
            std::error_code ec;
            for (const auto& fd :
                 fs::directory_iterator("/proc/" + std::to_string(first.init_pid()) + "/fd", ec)) {
                const std::string target = fs::read_symlink(fd.path(), ec).string();
                if (target.rfind("socket:", 0) == 0)
                    sockets.push_back(fd.path().filename().string() + " -> " + target);
            }
            return sockets;
        };
        const bool let_go =
            sandboxd::test::eventually([&] { return init_sockets().empty(); }, status_timeout);
        INFO("the init's sockets: " << (sockets.empty() ? "" : sockets.front()));
        CHECK(let_go);
        // Each channel below takes the warm init there is, and the supervisor makes the next
        // one when that init's start ends: a command that runs, one that cannot be found
        // (its exec fails), an init that gives up before it starts anything (its cwd).
        auto next_warm = [&](pid_t taken) {
            pid_t warm = 0;
            REQUIRE(sandboxd::test::eventually(
                [&] {
                    warm = warm_init_of(supervisor);
                    return warm > 0 && warm != taken &&
                           status_field(warm, "Seccomp") == std::vector<std::string>{"2"};
                },
                status_timeout));
            return warm;
        };
        pid_t warm = next_warm(0);
        {
            Channel ch(*fx.provider, fx.sandbox, command({"echo", "ran"}));
            REQUIRE(ch.finish());
            CHECK(ch.init_pid() == warm);
            CHECK(ch.out() == "ran\n");
        }
        warm = next_warm(warm);
        {
            Channel ch(*fx.provider, fx.sandbox, command({"no-such-command-xyz"}));
            REQUIRE(ch.finish());
            CHECK(ch.init_pid() == warm);
            CHECK(ch.status() == "exit 127");
        }
        warm = next_warm(warm);
        {
            auto spec = command({"true"});
            spec.cwd = "/no-such-dir";
            Channel ch(*fx.provider, fx.sandbox, spec, true);
            REQUIRE(ch.pump_until([&] { return ch.output_eof(); }, status_timeout));
            CHECK(ch.raw_status().empty());
            REQUIRE(ch.wait_exit(teardown_timeout));
        }
        // That init may be gone before its pid is read (it exits by itself): that it was the
        // warm one shows in the next, another process.
        warm = next_warm(warm);
        // The command never holds the init's end of that socket: only fds 0-2 reach it.
        Channel last(*fx.provider, fx.sandbox, command({"ls", "/proc/self/fd"}));
        REQUIRE(last.finish());
        CHECK(last.init_pid() == warm);
        CHECK(last.out() == "0\n1\n2\n3\n");  // 3: ls's own directory fd
        first.send("", true);
        REQUIRE(first.finish());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("destroy ends every process of the lease", "[provider]") {
    const auto children_before = own_children();
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // A descendant that left the command's process group, and the command, both alive.
        Channel ch(*fx.provider, fx.sandbox,
                   command({"sh", "-c", "setsid sleep 304 >/dev/null 2>&1 & echo ready; read x"}));
        REQUIRE(ch.pump_until([&] { return ch.out() == "ready\n"; }, status_timeout));
        // The tree: this process -> bubblewrap -> the supervisor (PID 1 of the lease's
        // namespace) -> the channel init (PID 1 of the channel's).
        const pid_t supervisor = parent_of(ch.init_pid());
        REQUIRE(supervisor > 0);
        const pid_t bwrap = parent_of(supervisor);
        CHECK(parent_of(bwrap) == ::getpid());
        unique_fd supervisor_fd(static_cast<int>(::syscall(SYS_pidfd_open, supervisor, 0)));
        REQUIRE(supervisor_fd);
        const ino_t lease_ns = pid_ns_of(supervisor);
        REQUIRE(lease_ns != 0);
        CHECK(lease_ns != pid_ns_of(::getpid()));
        CHECK(lease_ns != ch.pid_ns());
        CHECK(ch.members().size() == 3);                   // the init, sh and the escaped sleep
        CHECK(processes_in_pid_ns(lease_ns).size() == 1);  // the supervisor alone
        const fs::path lease_cgroup = memory_cgroup_of(ch.init_pid()).parent_path();
        CHECK(lease_cgroup.filename() == fx.sandbox->scope.provider_lease_id);

        destroy_sandbox(*fx.provider, fx.sandbox);
        // The supervisor's pidfd is readable once its namespace is empty.
        CHECK(wait_readable(supervisor_fd.get(), teardown_timeout));
        CHECK(wait_readable(ch.proc().pidfd.get(), teardown_timeout));
        CHECK(processes_in_pid_ns(lease_ns).empty());
        CHECK(ch.members().empty());
        CHECK(new_children(children_before).empty());  // bubblewrap was reaped
        CHECK_FALSE(fs::exists(lease_cgroup));
        CHECK(mounts_under(fx.sandbox->workspace).empty());
        // Every copy of the channel's pipes is closed: the output reaches EOF.
        REQUIRE(ch.pump_until([&] { return ch.output_eof(); }, teardown_timeout));
        CHECK(ch.out() == "ready\n");
        CHECK(ch.raw_status().empty());  // killed before the command ended: no line
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a channel that cannot be set up has no status line", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        {
            auto spec = command({"true"});
            spec.cwd = "/no-such-dir";
            Channel ch(*fx.provider, fx.sandbox, spec, true);
            // The init gives up by itself: every pipe reaches EOF, the status one empty.
            REQUIRE(ch.pump_until([&] { return ch.output_eof(); }, status_timeout));
            CHECK(ch.raw_status().empty());
            CHECK(ch.out().empty());
            CHECK(ch.err() ==
                  "sandboxd-init: cannot change to directory /no-such-dir: No such "
                  "file or directory\n");
            REQUIRE(ch.wait_exit(teardown_timeout));
            CHECK(ch.leftovers().empty());
        }
        // The sandbox serves on.
        auto r = run(fx, command({"true"}));
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a missing command exits 127", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"no-such-command-xyz", "arg"}));
        CHECK(r.status == "exit 127");
        CHECK(r.err.find("no-such-command-xyz") != std::string::npos);
        CHECK(r.out.empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a script without #! runs through sh with all of a long argv", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // execvp runs a file the kernel cannot exec (ENOEXEC) with /bin/sh, copying argv onto
        // the stack of the init's child: that stack must fit 50,000 arguments.
        const std::string script = "printf 'echo $# \"$1\" \"${50000}\"\\n' > /tmp/s";
        auto made = run(fx, command({"sh", "-c", script + " && chmod +x /tmp/s"}));
        REQUIRE(made.status == "exit 0");
        std::vector<std::string> argv{"/tmp/s"};
        argv.reserve(50001);
        for (int i = 1; i <= 50000; ++i) argv.push_back(std::to_string(i));
        auto r = run(fx, command(argv));
        CHECK(r.out == "50000 1 50000\n");
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a missing bubblewrap or init is a provider error", "[provider]") {
    const auto children_before = own_children();
    const int fds_before = open_fd_count();
    {
        TempDir dir;
        const fs::path sandboxes = dir.path / "sandboxes";
        {
            // A missing init: the provider cannot even be made.
            auto options = test_options(sandboxes);
            options.init_path = dir.path / "no-init";
            try {
                make_bwrap_provider(options);
                FAIL("make_bwrap_provider accepted a missing init");
            } catch (const rpc_error& e) {
                FAIL("an rpc_error, not a construction error: " << e.what());
            } catch (const std::runtime_error& e) {
                CHECK(std::string(e.what()).find((dir.path / "no-init").string()) !=
                      std::string::npos);
            }
        }
        // Where this sandboxes dir's leases live (their directories and cgroups), learnt
        // from a lease that works.
        fs::path leases_dir, instance_cgroup;
        {
            auto provider = make_bwrap_provider(test_options(sandboxes));
            auto handle = create_sandbox(*provider, {"bwrap", "c", "e", ""}, "lease", nullptr);
            LeaseGuard guard(*provider, handle);
            leases_dir = handle->workspace.parent_path().parent_path();
            {
                Channel ch(*provider, handle, command({"true"}));
                REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
                instance_cgroup = memory_cgroup_of(ch.init_pid()).parent_path().parent_path();
                REQUIRE(ch.finish());
            }
            destroy_sandbox(*provider, handle);
        }
        REQUIRE_FALSE(instance_cgroup.empty());
        {
            // A missing bubblewrap: the start-up probe finds it, the provider is not ready
            // (saying why), and create fails, leaving no process, directory, mount or cgroup.
            // Searchable by the lease's uid (which execs bubblewrap): ENOENT, not EACCES.
            fs::permissions(dir.path, fs::perms(0711));
            auto options = test_options(sandboxes);
            options.bwrap_path = dir.path / "no-bwrap";
            auto provider = make_bwrap_provider(options);
            CHECK_FALSE(provider->ready());
            CHECK(provider->degraded() ==
                  "cannot make a sandbox: cannot start bubblewrap: No such file or directory");
            try {
                create_sandbox(*provider, {"bwrap", "c", "e", ""}, "lease", nullptr);
                FAIL("create succeeded");
            } catch (const rpc_error& e) {
                CHECK(e.code() == errc::provider_not_ready);
                CHECK(std::string(e.what()) ==
                      "provider bwrap cannot make a sandbox on this node: cannot start bubblewrap: "
                      "No such file or directory");
            }
            CHECK(new_children(children_before).empty());
            CHECK(sandbox_entries(sandboxes).empty());
            CHECK(sandbox_entries(leases_dir).empty());
            CHECK(mounts_under(sandboxes).empty());
            // None but the provider's own tmpfs mounts: the generated /etc, and the init's
            // copy where the leases' uids cannot reach the build's (a clone under /root).
            auto mounts = mounts_under(leases_dir);
            std::erase(mounts, (leases_dir / ".init").string() + " tmpfs");
            CHECK(mounts == std::vector<std::string>{(leases_dir / ".etc").string() + " tmpfs"});
            CHECK(subdirectories(instance_cgroup).empty());
        }
        remove_lease_root(leases_dir, dir);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command runs as the lease's unprivileged host uid", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        const uid_t uid = lease_uid(*fx.sandbox);
        REQUIRE(uid >= first_lease_uid);
        Channel ch(*fx.provider, fx.sandbox, command({"sh", "-c", "id -u; id -g; read x"}));
        REQUIRE(ch.pump_until([&] { return ch.out() == "0\n0\n"; }, status_timeout));
        // Root inside; the lease's uid on the host, for the command and the init alike.
        const pid_t cmd = ch.command_pid();
        REQUIRE(cmd > 0);
        CHECK(uids_of(cmd) == four_times(uid));
        CHECK(status_field(cmd, "Gid") == std::vector<std::string>(4, std::to_string(uid)));
        CHECK(uids_of(ch.init_pid()) == four_times(uid));
        CHECK(uids_of(parent_of(ch.init_pid())) == four_times(uid));  // the supervisor
        ch.send("\n", true);
        REQUIRE(ch.finish());
        CHECK(ch.status() == "exit 0");
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("two sandboxes of one provider run as different uids", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto second = create_sandbox(*fx.provider, SandboxScope{"bwrap", "company-1", "env-1", ""},
                                     "lease-2", nullptr);
        LeaseGuard second_guard(*fx.provider, second);
        const uid_t first_uid = lease_uid(*fx.sandbox);
        const uid_t second_uid = lease_uid(*second);
        CHECK(first_uid >= first_lease_uid);
        CHECK(second_uid >= first_lease_uid);
        CHECK(first_uid != second_uid);
        {
            Channel a(*fx.provider, fx.sandbox, command({"sh", "-c", "echo a; read x"}));
            Channel b(*fx.provider, second, command({"sh", "-c", "echo b; read x"}));
            REQUIRE(a.pump_until([&] { return a.out() == "a\n"; }, status_timeout));
            REQUIRE(b.pump_until([&] { return b.out() == "b\n"; }, status_timeout));
            CHECK(uids_of(a.command_pid()) == four_times(first_uid));
            CHECK(uids_of(b.command_pid()) == four_times(second_uid));
            // Different leases: different namespaces all the way up.
            CHECK(pid_ns_of(parent_of(a.init_pid())) != pid_ns_of(parent_of(b.init_pid())));
            a.send("\n", true);
            b.send("\n", true);
            REQUIRE(a.finish());
            REQUIRE(b.finish());
            CHECK(a.status() == "exit 0");
            CHECK(b.status() == "exit 0");
        }
        destroy_sandbox(*fx.provider, second);
        CHECK_FALSE(fs::exists(second->workspace));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a channel cannot see another channel's processes", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel other(*fx.provider, fx.sandbox, command({"sh", "-c", "echo ready; read x"}));
        REQUIRE(other.pump_until([&] { return other.out() == "ready\n"; }, status_timeout));
        REQUIRE(other.members().size() == 2);  // its init and sh

        // Only its own init (1) and itself (2).
        auto r = run(fx, command({"ps", "-A", "-o", "pid=,comm="}));
        std::vector<std::string> lines;
        for (auto line : sorted_lines(r.out)) {
            line.erase(0, line.find_first_not_of(' '));
            lines.push_back(line);
        }
        CHECK(lines == std::vector<std::string>{"1 init", "2 ps"});
        CHECK(r.status == "exit 0");

        r = run(fx, command({"ls", "/proc"}));
        std::vector<std::string> pids;
        for (const auto& entry : sorted_lines(r.out)) {
            if (std::all_of(entry.begin(), entry.end(), ::isdigit)) pids.push_back(entry);
        }
        CHECK(pids == std::vector<std::string>{"1", "2"});

        // kill -1 (every process but the caller and PID 1) reaches its own namespace only.
        r = run(fx, command({"sh", "-c", "kill -9 -1; echo survived"}));
        CHECK(r.out == "survived\n");
        CHECK(r.status == "exit 0");
        CHECK(other.members().size() == 2);

        other.send("\n", true);
        REQUIRE(other.finish());
        CHECK(other.status() == "exit 0");
        CHECK(other.out() == "ready\n");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the sandbox's /etc is the generated one", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"cat", "/etc/shadow"}));
        CHECK(r.status == "exit 1");
        CHECK(r.err == "cat: /etc/shadow: No such file or directory\n");
        CHECK(r.out.empty());

        r = run(fx, command({"cat", "/etc/passwd"}));
        CHECK(r.status == "exit 0");
        std::vector<std::string> root_lines;
        for (const auto& line : sorted_lines(r.out)) {
            if (line.rfind("root:", 0) == 0) root_lines.push_back(line);
        }
        CHECK(root_lines == std::vector<std::string>{"root:x:0:0:root:/workspace:/bin/sh"});

        r = run(fx, command({"id", "-un"}));
        CHECK(r.out == "root\n");
        CHECK(r.status == "exit 0");

        r = run(fx, command({"sh", "-c", "echo x > /etc/sandboxd-probe"}));
        CHECK(r.status != "exit 0");
        CHECK(r.err.find("Read-only file system") != std::string::npos);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("without a cgroup mechanism the provider refuses to start unless told not to enforce",
          "[provider]") {
    TempDir dir;
    const fs::path no_cgroups = dir.path / "cgroup";  // an empty directory: neither v2 nor v1
    fs::create_directories(no_cgroups);
    auto options = test_options(dir.path / "sandboxes");
    options.cgroup_root = no_cgroups;
    try {
        make_bwrap_provider(options);
        FAIL("a provider started with no way to enforce its limits");
    } catch (const std::runtime_error& e) {
        const std::string what = e.what();
        CHECK(what.find("no cgroup mechanism can enforce the limits") != std::string::npos);
        CHECK(what.find("providers.bwrap.limits.enforce: false") != std::string::npos);
    }
    options.limits.enforce = false;
    auto provider = make_bwrap_provider(options);
    CHECK(provider->degraded() ==
          "no limits are enforced (providers.bwrap.limits.enforce is false)");
    auto sandbox = create_sandbox(*provider, SandboxScope{"bwrap", "c", "e", ""}, "lease", nullptr);
    LeaseGuard guard(*provider, sandbox);
    CHECK(sandbox->limits.is_null());
    CHECK(provider->usage(*sandbox).is_null());
}

TEST_CASE("a runtime directory the leases' uids cannot reach is a start-up error naming it",
          "[provider]") {
    TempDir dir;
    const fs::path closed = dir.path / "closed";
    fs::create_directories(closed);
    fs::permissions(closed, fs::perms::owner_all);  // 0700: no search for others
    auto options = test_options(dir.path / "sandboxes");
    options.runtime_dir = closed / "run";
    try {
        make_bwrap_provider(options);
        FAIL("a provider started with bind sources its sandboxes cannot reach");
    } catch (const std::runtime_error& e) {
        CHECK(std::string(e.what()) ==
              "providers.bwrap: the sandboxes' uids cannot reach " + (closed / "run").string() +
                  ": " + closed.string() +
                  " is not searchable by others (mode 0700; every directory above it needs o+x)");
    }
}
