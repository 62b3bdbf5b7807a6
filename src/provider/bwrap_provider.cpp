/// @file bwrap_provider.cpp
/// The built-in bubblewrap provider: a lease is one long-lived sandbox (docs/security.md).
///
/// create() gives the lease a host uid of its own (IdentityPool), a workspace disk
/// (lease_disk.hpp), a cgroup with its limits (cgroups.hpp) and starts bubblewrap as that uid:
/// new user (uid mapped to the configured inside uid), mount, PID, IPC, UTS, cgroup and
/// (unless allowed) network namespaces over a minimal root (read-only /usr, a generated /etc,
/// private /tmp, /run and /dev/shm, the workspace at /workspace), with `sandboxd-init --lease`
/// as PID 1: the supervisor (src/init/supervisor_protocol.hpp). open() asks the supervisor
/// for a channel, asynchronously, and serves it through a ProcessBackend; destroy() kills the
/// cgroup, unmounts the disk and returns the uid. create() and destroy() block (mkfs, mount,
/// cgroups, bubblewrap's start): they run on the provider's own bounded pool.

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/provider/provider.hpp>

#include "init/supervisor_protocol.hpp"
#include "provider/bwrap_config.hpp"
#include "provider/cgroups.hpp"
#include "provider/identity_pool.hpp"
#include "provider/lease_disk.hpp"
#include "provider/node_budget.hpp"
#include "provider/process_backend.hpp"
#include "provider/seccomp_filter.hpp"
#include "provider/spawn.hpp"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <string_view>
#include <system_error>

#ifndef SANDBOXD_LIBEXECDIR
#define SANDBOXD_LIBEXECDIR "/usr/libexec/sandboxd"  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd {
namespace {

namespace fs = std::filesystem;
namespace proto = supervisor;
using nlohmann::json;
using detail::EffectiveLimits;
using detail::LeaseConfig;

constexpr std::string_view sandbox_path =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
constexpr const char* init_in_sandbox = "/.sandboxd/init";
constexpr int supervisor_timeout_ms = 10000;
constexpr std::size_t max_blocking_threads = 64;

[[noreturn]] void provider_failure(std::string message) {
    throw rpc_error(errc::provider_error, std::move(message));
}

/// The default init: next to the running executable, else the install location.
fs::path default_init_path() {
    std::error_code ec;
    fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) {
        fs::path candidate = self.parent_path() / "sandboxd-init";
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return fs::path(SANDBOXD_LIBEXECDIR) / "sandboxd-init";
}

bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

void validate_spec(const ExecSpec& spec) {
    if (spec.argv.empty()) throw rpc_error(errc::invalid_params, "argv: must not be empty");
    for (const auto& arg : spec.argv) {
        if (has_nul(arg)) throw rpc_error(errc::invalid_params, "argv: contains a NUL byte");
    }
    if (has_nul(spec.cwd)) throw rpc_error(errc::invalid_params, "cwd: contains a NUL byte");
    for (const auto& [name, value] : spec.env) {
        if (name.empty() || name.find('=') != std::string::npos || has_nul(name)) {
            throw rpc_error(errc::invalid_params, "env: invalid variable name \"" + name + "\"");
        }
        if (has_nul(value)) {
            throw rpc_error(errc::invalid_params, "env." + name + ": contains a NUL byte");
        }
    }
}

std::string sandbox_cwd(const std::string& cwd) {
    if (cwd.empty()) return "/workspace";
    if (cwd.front() == '/') return cwd;
    return "/workspace/" + cwd;
}

unique_fd open_path(const fs::path& path, const char* what) {
    unique_fd fd(::open(path.c_str(), O_PATH | O_CLOEXEC));
    if (!fd) provider_failure(std::string("cannot open ") + what + " " + path.string() + ": " +
                              std::strerror(errno));
    return fd;
}

void write_file(const fs::path& path, std::string_view text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + path.string());
}

/// FNV-1a, for a stable short name of the sandboxes directory.
std::string short_hash(std::string_view text) {
    std::uint64_t h = 1469598103934665603ULL;
    for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
    return std::string(out, 8);
}

class BwrapSandbox;

/// Requests to one supervisor take turns (its replies come in request order), and a request
/// that waits for its turn holds no thread: it waits on a timer of its own executor, which
/// the request before it wakes. Thread-safe; each waiter must run on a strand or a
/// single-threaded io_context (the wake is posted there, after the waiter has suspended).
class Turns {
public:
    /// Completes once it is the caller's turn; give it back with leave().
    awaitable<void> enter() {
        auto executor = co_await net::this_coro::executor;
        auto timer = std::make_shared<net::steady_timer>(executor);
        timer->expires_at(net::steady_timer::time_point::max());
        bool mine = false;
        {
            std::lock_guard lock(mutex_);
            mine = !busy_;
            busy_ = true;
            if (!mine) waiting_.push_back(timer);
        }
        // Woken (cancelled) by the leave() of the request before this one.
        if (!mine) co_await timer->async_wait(as_tuple_awaitable);
    }

    /// Hands the turn to the next waiter that is still there, else frees it.
    void leave() {
        std::lock_guard lock(mutex_);
        while (!waiting_.empty()) {
            auto next = waiting_.front().lock();
            waiting_.pop_front();
            if (!next) continue;  // its coroutine is gone
            net::post(next->get_executor(), [next] { next->cancel(); });
            return;
        }
        busy_ = false;
    }

private:
    std::mutex mutex_;
    bool busy_ = false;
    std::deque<std::weak_ptr<net::steady_timer>> waiting_;
};

/// Counters shared by the provider and its channels' resources.
struct Counters {
    std::atomic<std::uint64_t> memory{0};
    std::atomic<std::uint64_t> pids{0};
};

/// A channel's cgroup, taken for one channel, with the counts it had when taken: a spare one
/// has served earlier channels, and its counts were read when it was put back (nothing runs
/// in it between), so that taking it reads nothing.
struct TakenCgroup {
    std::unique_ptr<detail::ChannelCgroup> cgroup;
    std::uint64_t oom_kills_before = 0;
    std::uint64_t pids_hits_before = 0;
};

/// A running sandbox: its supervisor, cgroup and identity.
class BwrapSandbox final : public SandboxState {
public:
    BwrapSandbox() = default;
    BwrapSandbox(const BwrapSandbox&) = delete;
    BwrapSandbox& operator=(const BwrapSandbox&) = delete;
    ~BwrapSandbox() override { shutdown(true); }

    /// Ends every process of the sandbox and reaps bubblewrap; with `unmount`, also unmounts
    /// the workspace disk (its image stays, for a later teardown). Idempotent. May block
    /// briefly (the cgroup kill waits for the processes to go).
    void shutdown(bool unmount = false) noexcept {
        std::lock_guard lock(mutex);
        socket.reset();  // the supervisor exits, and with it the lease's PID namespace
        if (pid > 0) {
            // The supervisor dies first, so that bubblewrap (its parent, which exits once it
            // has reaped it) is never killed under it: a supervisor that outlived bubblewrap
            // would be re-parented out of the daemon's tree (to the host's init) as an orphan.
            if (supervisor_pidfd) {
                ::syscall(SYS_pidfd_send_signal, supervisor_pidfd.get(), SIGKILL, nullptr, 0);
                supervisor_pidfd.reset();
            }
            pollfd p{pidfd.get(), POLLIN, 0};
            if (::poll(&p, 1, bwrap_exit_grace_ms) != 1) {
                ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
            }
            while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
            }
            pid = -1;
        }
        spare_cgroups.clear();  // emptied ones: removed, not killed
        if (cgroup) cgroup->kill();  // whatever is left (a sandbox whose bubblewrap is gone)
        // A sandbox dropped without a teardown (the daemon stops): nothing can use it again
        // in this process, so its loop device and mount go now; a later teardown removes
        // the rest.
        if (unmount && !workspace.empty()) ::umount2(workspace.c_str(), MNT_DETACH);
    }

    /// How long bubblewrap has to exit by itself once the supervisor is killed, ms.
    static constexpr int bwrap_exit_grace_ms = 2000;

    /// Whether bubblewrap (and so the supervisor, PID 1 inside) still runs and its socket
    /// is in step. A poll of its pidfd; no wait.
    bool supervisor_alive() {
        std::lock_guard lock(mutex);
        if (pid <= 0 || broken || !socket) return false;
        pollfd p{pidfd.get(), POLLIN, 0};
        return ::poll(&p, 1, 0) == 0;  // readable: it has exited
    }

    fs::path workspace;  ///< the mount point on the host

    Turns turns;  ///< one request in flight on the socket
    std::mutex mutex;  ///< guards the fields below (never held across a wait)
    pid_t pid = -1;    ///< bubblewrap, our child
    unique_fd pidfd;
    unique_fd socket;  ///< the daemon's end of the supervisor's socket pair
    /// The supervisor (PID 1 of the lease's namespaces, bubblewrap's child), from its hello:
    /// its death ends every process of the sandbox. Empty before the hello and after shutdown.
    unique_fd supervisor_pidfd;
    std::uint64_t next_request = 1;
    bool broken = false;  ///< a request timed out: the replies may be out of step

    std::unique_ptr<detail::LeaseCgroup> cgroup;  ///< null when limits are not enforced
    /// Emptied channel cgroups of this lease, for its next channels: a channel then opens
    /// the five join files of one of them instead of making (and later freezing,
    /// killing and removing) a cgroup in five hierarchies. With their counts as they were
    /// put back. Under `mutex`; at most max_spare_cgroups.
    std::vector<TakenCgroup> spare_cgroups;
    static constexpr std::size_t max_spare_cgroups = 16;
    EffectiveLimits limits;
    /// What this lease takes from the node's budgets, given back once (release_budget()).
    std::shared_ptr<detail::NodeBudget> budget;
    detail::BudgetShare budget_share;
    std::atomic<bool> budget_held{false};
    void release_budget() noexcept {
        if (budget && budget_held.exchange(false)) budget->give_back(budget_share);
    }
    std::atomic<std::uint64_t> pids_hits_seen{0};
    std::atomic<std::uint64_t> channels{0};
};

class BwrapChannelResources final : public detail::ChannelResources {
public:
    BwrapChannelResources(TakenCgroup cgroup, std::shared_ptr<BwrapSandbox> sandbox,
                          std::shared_ptr<Counters> counters)
        : cgroup_(std::move(cgroup)), sandbox_(std::move(sandbox)), counters_(std::move(counters)) {}

    std::string limit_hit(int term_signal) noexcept override {
        // One read each: the channel's own count where the kernel keeps it there (v1), else
        // the lease's (v2), never a walk over the lease's channels.
        const auto own = cgroup_.cgroup ? cgroup_.cgroup->own_pids_limit_hits() : std::nullopt;
        if (own) {
            if (*own > cgroup_.pids_hits_before) counters_->pids += *own - cgroup_.pids_hits_before;
            cgroup_.pids_hits_before = *own;
        } else if (sandbox_->cgroup) {
            const auto hits = sandbox_->cgroup->pids_limit_hits();
            const auto seen = sandbox_->pids_hits_seen.exchange(hits);
            if (hits > seen) counters_->pids += hits - seen;
        }
        if (cgroup_.cgroup && term_signal == SIGKILL &&
            cgroup_.cgroup->oom_kills() > cgroup_.oom_kills_before) {
            ++counters_->memory;
            return "memory";
        }
        return {};
    }

    void release(bool processes_gone) noexcept override {
        if (!cgroup_.cgroup || !processes_gone) return;  // killed and removed by its destructor
        cgroup_.cgroup->mark_empty();
        // The next channel's baselines, read now that this channel has ended, rather than on
        // the next open's path (nothing runs in the cgroup until then).
        cgroup_.oom_kills_before = cgroup_.cgroup->oom_kills();
        cgroup_.pids_hits_before = cgroup_.cgroup->own_pids_limit_hits().value_or(0);
        std::lock_guard lock(sandbox_->mutex);
        // Not once the lease is being destroyed (its cgroup is gone or going).
        if (sandbox_->pid > 0 && sandbox_->cgroup &&
            sandbox_->spare_cgroups.size() < BwrapSandbox::max_spare_cgroups) {
            sandbox_->spare_cgroups.push_back(std::move(cgroup_));
        }
    }

private:
    TakenCgroup cgroup_;
    std::shared_ptr<BwrapSandbox> sandbox_;
    std::shared_ptr<Counters> counters_;
};

class BwrapProvider final : public Provider {
public:
    explicit BwrapProvider(BwrapOptions options)
        : options_(std::move(options)),
          init_path_(options_.init_path.empty() ? default_init_path() : options_.init_path),
          pool_(options_.identity.host_id_first, options_.identity.host_id_count,
                options_.identity.lock_file),
          workers_(checked_threads(options_.blocking_threads)) {
        std::error_code ec;
        fs::create_directories(options_.sandboxes_dir, ec);
        ::chmod(options_.sandboxes_dir.c_str(), 0700);
        lock_dir();
        instance_ = "sandboxd-" +
                    short_hash(fs::weakly_canonical(options_.sandboxes_dir, ec).string());
        runtime_dir_ = options_.runtime_dir.empty() ? fs::path("/run/sandboxd") / instance_
                                                    : options_.runtime_dir;
        // Traversable by the leases' uids (bubblewrap resolves its bind sources by path, as
        // that uid); each sandbox's own directory there is open to its uid's group only.
        fs::create_directories(runtime_dir_, ec);
        if (ec) {
            throw std::runtime_error("cannot create " + runtime_dir_.string() + ": " +
                                     ec.message());
        }
        ::chmod(runtime_dir_.c_str(), 0711);
        if (options_.runtime_dir.empty()) ::chmod(runtime_dir_.parent_path().c_str(), 0711);
        // bubblewrap runs as each lease's uid and reaches these by path.
        std::vector<fs::path> reached = {runtime_dir_, options_.bwrap_path};
        reached.insert(reached.end(), options_.ro_binds.begin(), options_.ro_binds.end());
        for (const auto& target : reached) require_reachable(target);
        // Where this directory's mounts live, for an operator (or a test) cleaning up after a
        // daemon that was killed and not restarted.
        const fs::path link = options_.sandboxes_dir / ".runtime";
        fs::remove(link, ec);
        fs::create_symlink(runtime_dir_, link, ec);
        if (options_.limits.enforce) probe_enforcement();
        program_ = make_program_fd();
        try {
            init_path_ = install_init();
            stage_on_tmpfs(runtime_dir_ / ".etc");
            write_etc(runtime_dir_ / ".etc" / "private", false);
            write_etc(runtime_dir_ / ".etc" / "net", true);
            reclaim_identities();
            release_stale_mounts();
        } catch (...) {
            unstage();  // no destructor runs for a failed start
            throw;
        }
        probe_problem_ = probe_sandbox();
        if (!probe_problem_.empty()) {
            spdlog::error("bwrap provider: cannot make a sandbox on this node: {}; /readyz says "
                          "not ready and every leaseAcquire fails until the daemon restarts",
                          probe_problem_);
        }
    }

    BwrapProvider(const BwrapProvider&) = delete;
    BwrapProvider& operator=(const BwrapProvider&) = delete;
    ~BwrapProvider() override {
        workers_.join();  // a create() or destroy() still running finishes first
        // What only this process used: the generated /etc, the init's copy, and the mount
        // points of sandboxes already unmounted (their records stay in sandboxes_dir for a
        // later teardown). A directory still in use is left alone.
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(runtime_dir_, ec)) {
            const auto name = entry.path().filename().string();
            if (is_sandbox_id(name)) {
                ::rmdir((entry.path() / "workspace").c_str());
                ::rmdir(entry.path().c_str());
            }
        }
        unstage();
        ::rmdir(runtime_dir_.c_str());
    }

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }

    std::string degraded() const override {
        if (!probe_problem_.empty()) return "cannot make a sandbox: " + probe_problem_;
        return options_.limits.enforce ? std::string()
                                       : "no limits are enforced (providers.bwrap.limits.enforce "
                                         "is false)";
    }

    bool ready() const noexcept override { return probe_problem_.empty(); }

    LimitEvents limit_events() const noexcept override {
        return {counters_->memory.load(), counters_->pids.load()};
    }

    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override {
        if (!probe_problem_.empty()) {
            throw rpc_error(errc::provider_not_ready,
                            "provider " + key_ + " cannot make a sandbox on this node: " + probe_problem_);
        }
        auto work = [this, lease = std::move(lease)] {
            return create_now(scope_of(lease), lease.id, lease.config);
        };
        co_return co_await offload(workers_, std::move(work));
    }

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        auto work = [this, sandbox = std::move(sandbox)] { destroy_now(*sandbox); };
        co_await offload(workers_, std::move(work));
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        validate_spec(spec);
        auto state = std::static_pointer_cast<BwrapSandbox>(sandbox->state);
        if (!state) {
            provider_failure("sandbox " + sandbox->scope.provider_lease_id +
                             " has no supervisor in this process");
        }
        // Opens of one sandbox take turns before they take any descriptor, so that many opens
        // in flight at once (a connection's requests run concurrently) hold the descriptors
        // of one channel being set up, not of all of them (CASES.md B12). The turn goes back
        // however this coroutine ends.
        co_await state->turns.enter();
        const ScopeExit turn_back([&turns = state->turns] { turns.leave(); });
        // The socket's copy first, and a spare that keeps a descriptor free for the reply's
        // pidfd: out of descriptors, the open fails before anything starts.
        unique_fd socket_copy = copy_socket(*state, sandbox->scope.provider_lease_id);
        unique_fd spare = copy_socket(*state, sandbox->scope.provider_lease_id);
        PreparedChannel prepared = prepare_channel(*state, spec);
        unique_fd init_pidfd =
            co_await ask_supervisor(state, sandbox->scope.provider_lease_id,
                                    std::move(socket_copy), std::move(spare),
                                    prepared.request, prepared.payload, prepared.fds);
        detail::ProcessEnds ends = channel_ends(std::move(prepared), std::move(init_pidfd), state);
        auto executor = co_await net::this_coro::executor;
        co_return std::make_unique<detail::ProcessBackend>(executor, std::move(ends));
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override {
        // Only ids this provider mints ("bw-" and 16 hex digits) name a sandbox: anything
        // else (a path, "..") is refused rather than trusted.
        const auto& id = lease.provider_lease_id;
        if (!is_sandbox_id(id)) return nullptr;
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope_of(lease);
        handle->lease_id = lease.id;
        handle->workspace = runtime_dir_ / id / "workspace";
        return handle;
    }

    awaitable<std::vector<std::string>> stored_sandboxes() override {
        auto work = [this] {
            std::vector<std::string> ids;
            std::error_code ec;
            try {  // an entry that cannot be read ends the listing, as its contract says
                for (const auto& entry : fs::directory_iterator(options_.sandboxes_dir, ec)) {
                    auto name = entry.path().filename().string();
                    if (is_sandbox_id(name)) ids.push_back(std::move(name));
                }
            } catch (const fs::filesystem_error& e) {
                spdlog::warn("listing {}: {}", options_.sandboxes_dir.string(), e.what());
            }
            return ids;
        };
        co_return co_await offload(workers_, std::move(work));
    }

    awaitable<std::string> describe_stored(std::string provider_lease_id) override {
        auto work = [this, id = std::move(provider_lease_id)] { return describe_stored_now(id); };
        co_return co_await offload(workers_, std::move(work));
    }

    std::string describe_stored_now(const std::string& provider_lease_id) const {
        if (!is_sandbox_id(provider_lease_id)) return "not a sandbox id";
        const auto list = [](const fs::path& d) {
            std::error_code ec;
            if (!fs::exists(fs::symlink_status(d, ec))) return std::string("absent");
            std::string names;
            for (const auto& e : fs::directory_iterator(d, ec)) {
                names += (names.empty() ? "" : ", ") + e.path().filename().string();
            }
            return names.empty() ? std::string("empty") : names;
        };
        return "directory: " + list(options_.sandboxes_dir / provider_lease_id) +
               "; runtime directory: " + list(runtime_dir_ / provider_lease_id);
    }

    std::vector<std::string> capabilities() const override {
        return {"channels", "pty", "stderr", "signals", "closeStdin", "resize", "probe", "execute",
                "validateConfig"};
    }

    awaitable<json> validate_config(std::string company_id, json config) override {
        (void)company_id;
        json result = validation_of(config);
        co_return result;
    }

    awaitable<json> probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease) override {
        (void)lease;
        json result = probe_of(*sandbox);
        co_return result;
    }

    json usage(const SandboxHandle& sandbox) const override {
        auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
        if (!state || !state->cgroup) return nullptr;
        const auto u = state->cgroup->usage();
        return {{"memoryBytes", u.memory_bytes},
                {"pids", u.pids},
                {"diskBytes", detail::disk_used_bytes(sandbox.workspace)},
                {"cpuMs", u.cpu_ms}};
    }

private:
    /// A channel's request and the descriptors it passes, before the supervisor answers.
    struct PreparedChannel {
        proto::Request request;
        std::string payload;
        std::vector<int> fds;  ///< the child's ends below, in the protocol's order
        bool pty = false;
        detail::Pty pty_ends;
        detail::Pipe stdin_pipe, stdout_pipe, stderr_pipe, status_pipe, control_pipe;
        /// Its own open of /dev/null for each channel: no open file description is shared
        /// between channels (of different tenants, too), however harmless /dev/null's state.
        unique_fd dev_null;
        TakenCgroup cgroup;
        std::vector<unique_fd> procs;
        unique_fd payload_memfd;  ///< a payload above max_inline_payload (the last of fds)
    };

    std::shared_ptr<SandboxHandle> create_now(SandboxScope scope, const std::string& lease_id,
                                              const json& config) {
        const LeaseConfig cfg = parse_config(config);
        check_io_limits(cfg.limits);
        // Taken before anything is made, given back unless the sandbox is made.
        const detail::BudgetShare share{cfg.limits.pids, cfg.limits.open_files_total()};
        if (budget_) budget_->take(share);
        bool budget_kept = false;
        ScopeExit give_back([&] {
            if (budget_ && !budget_kept) budget_->give_back(share);
        });
        if (::access(init_path_.c_str(), X_OK) != 0) {
            provider_failure("sandboxd-init is missing: " + init_path_.string() + ": " +
                             std::strerror(errno));
        }
        std::string id;
        fs::path dir;
        for (int attempt = 0;; ++attempt) {
            id = "bw-" + random_hex(8);
            dir = options_.sandboxes_dir / id;
            if (::mkdir(dir.c_str(), 0700) == 0) break;  // root's until the uid is known
            if (errno != EEXIST || attempt >= 8) {
                provider_failure("cannot create sandbox directory " + dir.string() + ": " +
                                 std::strerror(errno));
            }
        }
        auto handle = std::make_shared<SandboxHandle>();
        scope.provider_lease_id = id;
        handle->scope = std::move(scope);
        handle->lease_id = lease_id;
        const fs::path run_dir = runtime_dir_ / id;
        handle->workspace = run_dir / "workspace";
        handle->network = cfg.network;
        handle->limits = options_.limits.enforce ? cfg.limits.to_json() : json(nullptr);

        uid_t uid = 0;
        try {
            uid = pool_.acquire();
            write_file(dir / "identity", std::to_string(uid) + "\n");
            ::chmod((dir / "identity").c_str(), 0600);
            // root:<the lease's gid> 0750: the lease's bubblewrap may enter, no other uid may.
            if (::mkdir(run_dir.c_str(), 0700) < 0 || ::chown(run_dir.c_str(), 0, uid) < 0 ||
                ::chmod(run_dir.c_str(), 0750) < 0) {
                provider_failure("cannot make " + run_dir.string() + " for its lease: " +
                                 std::strerror(errno));
            }
            auto sandbox = std::make_shared<BwrapSandbox>();
            sandbox->limits = cfg.limits;
            if (budget_) {
                sandbox->budget = budget_;
                sandbox->budget_share = share;
            }
            if (options_.limits.enforce) sandbox->workspace = handle->workspace;
            if (options_.limits.enforce) {
                detail::create_lease_disk(dir / "disk.img", handle->workspace,
                                          cfg.limits.disk_bytes, uid, uid);
                detail::CgroupLimits cl;
                cl.memory_bytes = cfg.limits.memory_bytes;
                cl.pids = cfg.limits.pids;
                cl.cpu_weight = cfg.limits.cpu_weight;
                cl.cpu_quota_percent = cfg.limits.cpu_quota_percent;
                cl.io_read_bps = cfg.limits.io_read_bps;
                cl.io_write_bps = cfg.limits.io_write_bps;
                cl.io_read_iops = cfg.limits.io_read_iops;
                cl.io_write_iops = cfg.limits.io_write_iops;
                cl.io_weight = cfg.limits.io_weight;
                // The lease's own loop device, which its workspace is mounted from.
                struct stat st {};
                if (::stat(handle->workspace.c_str(), &st) != 0) {
                    provider_failure("cannot stat " + handle->workspace.string() + ": " +
                                     std::strerror(errno));
                }
                cl.io_device = st.st_dev;
                sandbox->cgroup = cgroups_->create_lease(id, cl);
            } else {
                fs::create_directory(handle->workspace);
                if (::chown(handle->workspace.c_str(), uid, uid) < 0) {
                    provider_failure("cannot give the workspace to uid " + std::to_string(uid) +
                                     ": " + std::strerror(errno));
                }
                ::chmod(handle->workspace.c_str(), 0755);
            }
            start_supervisor(*sandbox, handle->workspace, uid, cfg);
            if (budget_) sandbox->budget_held = true;
            budget_kept = true;
            handle->state = std::move(sandbox);
        } catch (...) {
            // Nothing may be left: no process, no mount, no cgroup, no claimed id.
            if (handle->state) std::static_pointer_cast<BwrapSandbox>(handle->state)->shutdown();
            try {
                teardown_files(*handle);
            } catch (const std::exception& e) {
                spdlog::warn("sandbox {}: cleanup after a failed create: {}", id, e.what());
            }
            throw;
        }
        spdlog::debug("sandbox {} created uid={} lease={}", id, uid, lease_id);
        return handle;
    }

    void destroy_now(const SandboxHandle& sandbox) {
        if (!is_sandbox_id(sandbox.scope.provider_lease_id)) return;
        auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
        std::unique_ptr<detail::LeaseCgroup> left_behind;
        if (state) {
            state->shutdown();
        } else if (cgroups_) {
            // A sandbox of an earlier process: its cgroup may still hold processes.
            left_behind = cgroups_->find_lease(sandbox.scope.provider_lease_id);
            if (left_behind) left_behind->kill();
        }
        teardown_files(sandbox);
        left_behind.reset();
        if (state) {
            state->cgroup.reset();
            state->release_budget();
        }
    }

    /// io limits this node's cgroups can apply; else INVALID_PARAMS naming the field, before
    /// anything is made.
    void check_io_limits(const EffectiveLimits& limits) const {
        if (!cgroups_) return;  // limits not enforced
        const std::string mode =
            cgroups_->mode() == detail::cgroup_mode::v2 ? "cgroup v2" : "cgroup v1";
        auto refuse = [](const char* key, const std::string& why) {
            const std::string field = std::string("config.limits.") + key;
            throw rpc_error(errc::invalid_params, field + ": " + why, {{"field", field}});
        };
        if (limits.io_weight && !cgroups_->io_weight()) {
            refuse("ioWeight",
                   "needs cgroup v2 with the io controller (cgroup v1 has no io "
                   "weight without BFQ); this node uses " +
                       mode);
        }
        const std::pair<const char*, bool> throttles[] = {
            {"ioReadBps", limits.io_read_bps.has_value()},
            {"ioWriteBps", limits.io_write_bps.has_value()},
            {"ioReadIops", limits.io_read_iops.has_value()},
            {"ioWriteIops", limits.io_write_iops.has_value()}};
        for (const auto& [key, set] : throttles) {
            if (set && !cgroups_->io_throttle()) {
                refuse(key,
                       "needs the cgroup v1 blkio hierarchy or the v2 io controller, which "
                       "this node (" +
                           mode + ") does not have");
            }
        }
    }

    /// The request, payload and descriptors of a channel: fast, no waiting (pipes, a PTY,
    /// the channel's cgroup directory).
    PreparedChannel prepare_channel(BwrapSandbox& state, const ExecSpec& spec) {
        // The request's payload: cwd, argv, then the environment, NUL-terminated.
        // The fixed variables first, in this order, then spec.env (sorted); a spec.env entry
        // of a fixed name replaces its value in place, as setenv(3) does.
        std::vector<std::pair<std::string, std::string>> env = {
            {"PATH", std::string(sandbox_path)},
            {"HOME", "/workspace"},
            {"TERM", spec.pty ? "xterm-256color" : "dumb"},
            {"LANG", "C.UTF-8"}};
        for (const auto& entry : spec.env) {
            const auto& [name, value] = entry;
            auto it = std::find_if(env.begin(), env.end(),
                                   [&entry](const auto& e) { return e.first == entry.first; });
            if (it != env.end()) {
                it->second = value;
            } else {
                env.emplace_back(name, value);
            }
        }
        PreparedChannel out;
        proto::Request& request = out.request;
        std::string& payload = out.payload;
        payload = sandbox_cwd(spec.cwd);
        payload.push_back('\0');
        for (const auto& arg : spec.argv) {
            payload += arg;
            payload.push_back('\0');
        }
        for (const auto& [name, value] : env) {
            payload += name;
            payload.push_back('=');
            payload += value;
            payload.push_back('\0');
        }
        if (payload.size() > proto::max_payload) {
            throw rpc_error(errc::invalid_params,
                            "argv, env and cwd: " + std::to_string(payload.size()) +
                                " bytes, more than the " + std::to_string(proto::max_payload) +
                                " a command may be given");
        }
        request.argc = static_cast<std::uint32_t>(spec.argv.size());
        request.envc = static_cast<std::uint32_t>(env.size());
        request.payload_size = static_cast<std::uint32_t>(payload.size());
        request.grace_ms = spec.drain_grace_ms ? static_cast<std::int32_t>(std::min<std::uint32_t>(
                                                     *spec.drain_grace_ms, INT32_MAX))
                                               : -1;
        request.open_files = state.limits.open_files;
        request.start_deadline_ms = spec.start_deadline_ms.value_or(0);

        std::vector<int>& fds = out.fds;
        out.pty = spec.pty.has_value();
        if (spec.pty) {
            out.pty_ends = detail::open_pty(*spec.pty);
            fds = {out.pty_ends.slave.get(), out.pty_ends.slave.get(), out.pty_ends.slave.get()};
            request.flags |= proto::flag_pty;
        } else {
            if (spec.stdin_attached) {
                out.stdin_pipe = detail::make_pipe(detail::daemon_end::write);
                fds.push_back(out.stdin_pipe.read_end.get());
            } else {
                out.dev_null.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
                if (!out.dev_null) {
                    provider_failure(std::string("cannot open /dev/null: ") +
                                     std::strerror(errno));
                }
                fds.push_back(out.dev_null.get());
            }
            out.stdout_pipe = detail::make_pipe(detail::daemon_end::read);
            out.stderr_pipe = detail::make_pipe(detail::daemon_end::read);
            // The pipes keep their default size: ProcessBackend grows one once it streams.
            fds.push_back(out.stdout_pipe.write_end.get());
            fds.push_back(out.stderr_pipe.write_end.get());
        }
        out.status_pipe = detail::make_pipe(detail::daemon_end::read);
        out.control_pipe = detail::make_pipe(detail::daemon_end::write);
        fds.push_back(out.status_pipe.write_end.get());
        fds.push_back(out.control_pipe.read_end.get());

        if (state.cgroup) {
            out.cgroup = take_channel_cgroup(state);
            out.procs = out.cgroup.cgroup->open_procs();
            for (const auto& fd : out.procs) fds.push_back(fd.get());
        }
        request.cgroup_fds = static_cast<std::uint32_t>(out.procs.size());
        if (payload.size() > proto::max_inline_payload) {
            out.payload_memfd = payload_in_memfd(payload);
            fds.push_back(out.payload_memfd.get());
            request.flags |= proto::flag_payload_memfd;
            payload.clear();
        }
        return out;
    }

    /// A spare cgroup of the lease (with its counts as it was put back), else a new one.
    static TakenCgroup take_channel_cgroup(BwrapSandbox& state) {
        TakenCgroup out;
        {
            std::lock_guard lock(state.mutex);
            if (!state.spare_cgroups.empty()) {
                out = std::move(state.spare_cgroups.back());
                state.spare_cgroups.pop_back();
                return out;
            }
        }
        out.cgroup = state.cgroup->create_channel("ch-" + std::to_string(++state.channels));
        return out;
    }

    /// A memfd holding `bytes`, sealed against any change; empty (errno set) on failure.
    static unique_fd sealed_memfd(const char* name, const std::string& bytes) {
        unique_fd fd(static_cast<int>(
            ::syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING)));
        std::size_t done = 0;
        while (fd && done < bytes.size()) {
            const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                if (n == 0) errno = EIO;
                return {};
            }
            done += static_cast<std::size_t>(n);
        }
        if (!fd || ::fcntl(fd.get(), F_ADD_SEALS,
                           F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) != 0) {
            return {};
        }
        return fd;
    }

    /// The payload of a request in a sealed memfd (supervisor_protocol.hpp: above
    /// max_inline_payload).
    static unique_fd payload_in_memfd(const std::string& payload) {
        unique_fd fd = sealed_memfd("sandboxd-request", payload);
        if (!fd) {
            provider_failure(std::string("cannot pass a command's arguments to its sandbox: ") +
                             std::strerror(errno));
        }
        return fd;
    }

    /// The daemon's ends of a started channel; the child's ends close with `prepared`.
    detail::ProcessEnds channel_ends(PreparedChannel prepared, unique_fd init_pidfd,
                                     const std::shared_ptr<BwrapSandbox>& state) {
        detail::ProcessEnds out;
        out.pidfd = std::move(init_pidfd);  // out.pid stays -1: ProcessBackend reads it if asked
        out.pty = prepared.pty;
        if (prepared.pty) {
            int dup = ::fcntl(prepared.pty_ends.master.get(), F_DUPFD_CLOEXEC, 0);
            if (dup < 0) {
                int err = errno;
                // Nothing may be left running: the caller never sees this channel.
                ::syscall(SYS_pidfd_send_signal, out.pidfd.get(), SIGKILL, nullptr, 0);
                provider_failure(std::string("cannot set up a pty: ") + std::strerror(err));
            }
            out.stdout_fd.reset(dup);
            out.stdin_fd = std::move(prepared.pty_ends.master);
        } else {
            out.stdin_fd = std::move(prepared.stdin_pipe.write_end);
            out.stdout_fd = std::move(prepared.stdout_pipe.read_end);
            out.stderr_fd = std::move(prepared.stderr_pipe.read_end);
        }
        out.status_fd = std::move(prepared.status_pipe.read_end);
        out.control_fd = std::move(prepared.control_pipe.write_end);
        out.resources = std::make_unique<BwrapChannelResources>(std::move(prepared.cgroup), state,
                                                                counters_);
        return out;
    }

    static std::size_t checked_threads(std::size_t n) {
        if (n < 1 || n > max_blocking_threads) {
            throw std::runtime_error("providers.bwrap: blocking_threads must be 1.." +
                                     std::to_string(max_blocking_threads) + ", not " +
                                     std::to_string(n));
        }
        return n;
    }

    static bool is_sandbox_id(const std::string& id) {
        return id.size() == 19 && id.rfind("bw-", 0) == 0 &&
               id.find_first_not_of("0123456789abcdef", 3) == std::string::npos;
    }

    /// One daemon per sandboxes directory: a second one would kill the first one's sandboxes
    /// as orphans.
    void lock_dir() {
        const fs::path lock_path = options_.sandboxes_dir / ".lock";
        dir_lock_.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
        if (!dir_lock_) {
            throw std::runtime_error("cannot open " + lock_path.string() + ": " +
                                     std::strerror(errno));
        }
        if (::flock(dir_lock_.get(), LOCK_EX | LOCK_NB) < 0) {
            throw std::runtime_error("another live sandboxd process uses " +
                                     options_.sandboxes_dir.string());
        }
    }

    /// At start: bubblewrap with a lease's own namespaces, mounts and capabilities, as a
    /// lease's uid, running /usr/bin/true (about 10 ms). "" when it exits 0; else why not,
    /// with bubblewrap's own words (a container without the privileges it needs, a seccomp
    /// profile that refuses sethostname, no user namespaces).
    std::string probe_sandbox() {
        uid_t uid = 0;
        try {
            uid = pool_.acquire();
        } catch (const std::exception& e) {
            return e.what();
        }
        const ScopeExit release([&] { pool_.release(uid); });
        auto argv = bwrap_argv(parse_config(json::object()), 0);
        // The lease's command line up to "--", then true instead of the supervisor.
        argv.erase(std::find(argv.rbegin(), argv.rend(), std::string("--")).base(), argv.end());
        argv.emplace_back("/usr/bin/true");
        try {
            unique_fd workspace = open_path(runtime_dir_ / ".etc" / "private", "the probe's workspace");
            unique_fd etc = open_path(runtime_dir_ / ".etc" / "private", "the sandbox /etc");
            unique_fd init = open_path(init_path_, "sandboxd-init");
            detail::Pipe errors = detail::make_pipe(detail::daemon_end::read);
            detail::SpawnRequest request;
            request.argv = std::move(argv);
            request.envp = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"};
            request.fds = {-1, -1, errors.write_end.get(), -1, -1, workspace.get(), etc.get(), init.get()};
            request.run_as = std::make_pair(uid, static_cast<gid_t>(uid));
            auto child = detail::spawn_process(request, "bubblewrap");
            errors.write_end.reset();
            pollfd p{child.pidfd.get(), POLLIN, 0};
            if (::poll(&p, 1, 10000) != 1) {
                ::kill(child.pid, SIGKILL);
                ::waitpid(child.pid, nullptr, 0);
                return "bubblewrap did not exit within 10 s";
            }
            int status = 0;
            ::waitpid(child.pid, &status, 0);
            if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {};
            char text[2048];
            const ssize_t got = ::read(errors.read_end.get(), text, sizeof text - 1);
            std::string why = got > 0 ? std::string(text, static_cast<std::size_t>(got)) : "";
            while (!why.empty() && (why.back() == '\n' || why.back() == '\r')) why.pop_back();
            return "bubblewrap " +
                   (WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                      : "died of signal " + std::to_string(WTERMSIG(status))) +
                   (why.empty() ? std::string() : ": " + why);
        } catch (const std::exception& e) {
            return e.what();
        }
    }

    void probe_enforcement() {
        std::error_code ec;
        cgroups_ = detail::probe_cgroups(instance_, options_.cgroup_root);
        if (cgroups_->mode() == detail::cgroup_mode::none) {
            throw std::runtime_error(
                "providers.bwrap.limits.enforce: no cgroup mechanism can enforce the limits (" +
                cgroups_->describe() +
                "); on a systemd host give the unit Delegate=yes, or set "
                "providers.bwrap.limits.enforce: false to run without limits");
        }
        if (::access("/dev/loop-control", R_OK | W_OK) != 0) {
            throw std::runtime_error(
                "providers.bwrap.limits.enforce: workspace disks need loop devices, and "
                "/dev/loop-control is not usable: " + std::string(std::strerror(errno)) +
                " (or set providers.bwrap.limits.enforce: false)");
        }
        if (::access("/usr/sbin/mkfs.ext4", X_OK) != 0 && ::access("/sbin/mkfs.ext4", X_OK) != 0) {
            throw std::runtime_error(
                "providers.bwrap.limits.enforce: workspace disks need mkfs.ext4 (Debian "
                "package e2fsprogs)");
        }
        // The node's defaults must be usable by a lease that asks for nothing.
        try {
            check_io_limits(parse_config(nullptr).limits);
        } catch (const rpc_error& e) {
            throw std::runtime_error("providers.bwrap.limits.defaults: " + std::string(e.what()));
        }
        budget_ = detail::NodeBudget::read_host(options_.proc_sys, options_.limits.overcommit);
        spdlog::info("bwrap provider: node budgets: {}", budget_->describe());
        const auto removed = cgroups_->remove_orphans();
        spdlog::info("bwrap provider: limits enforced with {}; workspace disks: loop-mounted "
                     "ext4{}",
                     cgroups_->describe(),
                     removed > 0 ? "; killed and removed " + std::to_string(removed) +
                                       " orphaned sandbox cgroup(s) of an earlier process"
                                 : std::string());
    }

    /// Throws, naming the directory, when an unprivileged uid cannot search every directory
    /// from / down to `target` (e.g. a root file system whose / is 0700).
    static void require_reachable(const fs::path& target) {
        for (fs::path p = target.parent_path();; p = p.parent_path()) {
            struct stat st {};
            if (::stat(p.c_str(), &st) == 0 && (st.st_mode & S_IXOTH) == 0) {
                char mode[8];
                std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
                throw std::runtime_error("providers.bwrap: the sandboxes' uids cannot reach " +
                                         target.string() + ": " + p.string() +
                                         " is not searchable by others (mode " + mode +
                                         "; every directory above it needs o+x)");
            }
            if (p == p.root_path() || p.empty()) break;
        }
    }

    /// sandboxd-init where every lease's uid can reach it by path (bubblewrap resolves its
    /// bind sources as that uid): where it is, when every directory above it is searchable by
    /// others and it is root's (so no lease can replace it), else a copy in the runtime dir.
    fs::path install_init() const {
        bool reachable = true;
        for (fs::path p = init_path_; reachable && !p.empty(); p = p.parent_path()) {
            struct stat st {};
            reachable = ::stat(p.c_str(), &st) == 0 && st.st_uid == 0 &&
                        (st.st_mode & S_IXOTH) != 0 &&
                        (st.st_mode & S_IWOTH) == 0;
            if (p == p.root_path()) break;
        }
        if (reachable) return init_path_;
        const fs::path dir = runtime_dir_ / ".init";
        fs::path target = dir / "sandboxd-init";
        std::error_code ec;
        stage_on_tmpfs(dir);
        const fs::path tmp = dir / "sandboxd-init.tmp";
        fs::copy_file(init_path_, tmp, fs::copy_options::overwrite_existing, ec);
        if (ec) {
            throw std::runtime_error("cannot copy sandboxd-init from " + init_path_.string() +
                                     ": " + ec.message());
        }
        ::chmod(tmp.c_str(), 0755);
        fs::rename(tmp, target);
        return target;
    }

    /// Mounts a tmpfs of its own at `dir` (made if missing; a mount an earlier process left
    /// there is unmounted first), mode 0711. What bubblewrap binds from it shows in a
    /// sandbox's mountinfo as a path within that tmpfs (e.g. `/private`, source `sandboxd`),
    /// never as a path under the runtime directory: a bind's mountinfo root is the source's
    /// path within its own filesystem, whether bound by path or by descriptor.
    static void stage_on_tmpfs(const fs::path& dir) {
        std::error_code ec;
        fs::create_directories(dir, ec);
        while (::umount2(dir.c_str(), MNT_DETACH) == 0) {
        }
        fs::remove_all(dir, ec);
        fs::create_directories(dir, ec);
        if (::mount("sandboxd", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV,
                    "mode=0711,size=256m") != 0) {
            throw std::runtime_error("cannot mount a tmpfs at " + dir.string() + ": " +
                                     std::strerror(errno));
        }
    }

    /// Unmounts and removes what stage_on_tmpfs() made (the generated /etc, the init's copy).
    void unstage() const noexcept {
        std::error_code ec;
        for (const char* staged : {".etc", ".init"}) {
            while (::umount2((runtime_dir_ / staged).c_str(), MNT_DETACH) == 0) {
            }
            fs::remove_all(runtime_dir_ / staged, ec);
        }
    }

    static unique_fd make_program_fd() {
        // Sealed: nothing may change the filter that every later sandbox reads.
        unique_fd fd = sealed_memfd("sandboxd-seccomp", detail::build_seccomp_filter());
        if (!fd) {
            throw std::runtime_error(std::string("cannot hold the syscall filter: ") +
                                     std::strerror(errno));
        }
        return fd;
    }

    /// The generated /etc: fixed files naming the sandbox user, plus copies of the configured
    /// host entries. Written at start, read-only in every sandbox.
    void write_etc(const fs::path& dir, bool network) const {
        std::error_code ec;
        fs::remove_all(dir, ec);
        fs::create_directories(dir);
        fs::permissions(dir.parent_path(), fs::perms::owner_all | fs::perms::group_exec |
                                               fs::perms::others_exec);
        fs::permissions(dir, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                 fs::perms::others_read | fs::perms::others_exec);
        for (const auto& entry : options_.etc_files) {
            const fs::path source = options_.etc_source / entry;
            if (!fs::exists(fs::symlink_status(source, ec))) continue;
            fs::create_directories((dir / entry).parent_path(), ec);
            fs::copy(source, dir / entry,
                     fs::copy_options::recursive | fs::copy_options::copy_symlinks |
                         fs::copy_options::overwrite_existing,
                     ec);
            if (ec) spdlog::warn("bwrap provider: cannot copy {} into the sandbox /etc: {}",
                                 source.string(), ec.message());
        }
        const auto uid = options_.identity.inside_uid;
        const auto gid = options_.identity.inside_gid;
        std::string passwd = "root:x:0:0:root:/workspace:/bin/sh\n";
        std::string group = "root:x:0:\n";
        if (uid != 0) passwd += "sandbox:x:" + std::to_string(uid) + ":" + std::to_string(gid) +
                                ":sandbox:/workspace:/bin/sh\n";
        if (gid != 0) group += "sandbox:x:" + std::to_string(gid) + ":\n";
        passwd += "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
        group += "nogroup:x:65534:\n";
        write_file(dir / "passwd", passwd);
        write_file(dir / "group", group);
        write_file(dir / "hostname", "sandbox\n");
        write_file(dir / "hosts", "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost "
                                  "ip6-loopback\n");
        write_file(dir / "nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\n"
                                          "hosts: files dns\nnetworks: files\nprotocols: files\n"
                                          "services: files\n");
        if (network) {
            std::ifstream in(options_.etc_source / "resolv.conf", std::ios::binary);
            std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            write_file(dir / "resolv.conf", text);
        }
        // Readable by the sandbox's uid: world-readable files, traversable directories.
        for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
            std::error_code ignored;
            if (it->is_symlink(ignored)) continue;
            fs::permissions(it->path(),
                            it->is_directory(ignored) ? fs::perms(0755) : fs::perms(0644), ignored);
        }
    }

    /// Claims the ids of the sandboxes an earlier process left on disk, so that no new lease
    /// gets a uid that still owns files.
    void reclaim_identities() {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(options_.sandboxes_dir, ec)) {
            const auto name = entry.path().filename().string();
            if (!is_sandbox_id(name)) continue;
            const auto uid = read_identity(entry.path());
            if (uid && !pool_.claim_existing(*uid)) {
                spdlog::warn("sandbox {}: its uid {} is held by another process or outside the "
                             "configured range",
                             name, *uid);
            }
        }
    }

    /// The workspaces of an earlier process (killed, so it could not unmount them) can never
    /// be used again: unmount them now, freeing their loop devices. Their images and records
    /// stay until the sweeper tears the leases down.
    void release_stale_mounts() const {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(runtime_dir_, ec)) {
            if (!is_sandbox_id(entry.path().filename().string())) continue;
            const fs::path ws = entry.path() / "workspace";
            if (::umount2(ws.c_str(), MNT_DETACH) == 0) {
                spdlog::info("sandbox {}: unmounted the workspace an earlier process left",
                             entry.path().filename().string());
            }
        }
    }

    static std::optional<uid_t> read_identity(const fs::path& dir) {
        std::ifstream in(dir / "identity");
        unsigned long long uid = 0;
        if (!(in >> uid) || uid == 0 || uid > 0xFFFFFFFEULL) return std::nullopt;
        return static_cast<uid_t>(uid);
    }

    /// Unmounts and removes a sandbox's files, then returns its uid. Its processes are gone.
    void teardown_files(const SandboxHandle& sandbox) {
        const fs::path dir = options_.sandboxes_dir / sandbox.scope.provider_lease_id;
        const fs::path run_dir = runtime_dir_ / sandbox.scope.provider_lease_id;
        const fs::path workspace = run_dir / "workspace";
        std::error_code ec;
        const bool have_dir = fs::exists(fs::symlink_status(dir, ec));
        const bool have_run_dir = fs::exists(fs::symlink_status(run_dir, ec));
        spdlog::debug("sandbox {} teardown: directory {}, runtime directory {}",
                      sandbox.scope.provider_lease_id, have_dir ? "present" : "absent",
                      have_run_dir ? "present" : "absent");
        if (!have_dir && !have_run_dir) return;
        const auto uid = have_dir ? read_identity(dir) : std::nullopt;
        detail::destroy_lease_disk(dir / "disk.img", workspace);
        if (fs::exists(fs::symlink_status(workspace, ec))) {
            // No disk of its own (limits not enforced): a bounded walk, off this process.
            detail::remove_tree_bounded(workspace);
        }
        for (const auto& d : {run_dir, dir}) {
            fs::remove(d / "identity", ec);
            if (::rmdir(d.c_str()) < 0 && errno != ENOENT) {
                provider_failure("cannot remove sandbox " + sandbox.scope.provider_lease_id +
                                 ": " + d.string() + ": " + std::strerror(errno));
            }
        }
        if (uid) pool_.release(*uid);
        spdlog::debug("sandbox {} teardown: files removed", sandbox.scope.provider_lease_id);
    }

    /// The SDK's validation result for a lease config: the effective limits when it is good.
    json validation_of(const json& config) const {
        try {
            const LeaseConfig cfg = parse_config(config);
            return {{"ok", true},
                    {"normalizedConfig",
                     {{"network", cfg.network}, {"limits", cfg.limits.to_json()}}}};
        } catch (const rpc_error& e) {
            return {{"ok", false}, {"errors", {e.what()}}};
        }
    }

    /// The SDK's probe result for a cached sandbox: up while its supervisor runs.
    json probe_of(const SandboxHandle& sandbox) const {
        auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
        const bool up = state && state->supervisor_alive();
        return {{"ok", up},
                {"summary", "sandbox " + sandbox.scope.provider_lease_id +
                                (up ? " is running" : " has no running supervisor")},
                {"metadata", {{"usage", usage(sandbox)}, {"limits", sandbox.limits}}}};
    }

    LeaseConfig parse_config(const json& config) const {
        return detail::parse_lease_config(config, options_.limits, options_.allow_network);
    }

    /// `cgroup_fds`: how many lease cgroup join files bubblewrap passes on at fds 8, 9, ...
    std::vector<std::string> bwrap_argv(const LeaseConfig& cfg, std::size_t cgroup_fds) const {
        const auto& id = options_.identity;
        std::vector<std::string> a = {
            options_.bwrap_path.string(), "--die-with-parent", "--unshare-user",
            "--uid", std::to_string(id.inside_uid), "--gid", std::to_string(id.inside_gid),
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        };
        if (!cfg.network) a.emplace_back("--unshare-net");
        // The supervisor needs these two inside the lease's user namespace only: to make each
        // channel's PID and mount namespaces and mount its /proc, and to empty the bounding
        // set of every command (which then runs with no capability at all).
        a.insert(a.end(), {"--as-pid-1", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
                           "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"});
        std::error_code ec;
        for (const auto& dir : options_.ro_binds) {
            if (fs::exists(dir, ec)) a.insert(a.end(), {"--ro-bind", dir, dir});
        }
        // The merged-/usr links of the host, or the real directories where there are some.
        for (const char* dir : {"/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}) {
            auto status = fs::symlink_status(dir, ec);
            if (fs::is_symlink(status)) {
                fs::path target = fs::read_symlink(dir, ec);
                if (!ec) a.insert(a.end(), {"--symlink", target.string(), dir});
            } else if (fs::is_directory(status)) {
                a.insert(a.end(), {"--ro-bind", dir, dir});
            }
        }
        // tmpfs pages are charged to the lease's memory; the size makes a full one ENOSPC.
        const std::string tmpfs_size = std::to_string(cfg.limits.memory_bytes);
        a.insert(a.end(), {"--ro-bind-fd", "6", "/etc", "--proc", "/proc", "--dev", "/dev"});
        for (const char* dir : {"/tmp", "/run", "/dev/shm"}) {
            if (options_.limits.enforce) a.insert(a.end(), {"--size", tmpfs_size});
            a.insert(a.end(), {"--tmpfs", dir});
        }
        a.insert(a.end(), {"--bind-fd", "5", "/workspace", "--ro-bind-fd", "7", init_in_sandbox,
                           "--chdir", "/workspace", "--hostname", "sandbox", "--", init_in_sandbox,
                           "--lease"});
        if (cgroup_fds > 0) a.insert(a.end(), {"--cgroup-fds", std::to_string(cgroup_fds)});
        return a;
    }

    void start_supervisor(BwrapSandbox& sandbox, const fs::path& workspace, uid_t uid,
                          const LeaseConfig& cfg) {
        int sv[2];
        if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
            provider_failure(std::string("cannot create the supervisor's socket: ") +
                             std::strerror(errno));
        }
        unique_fd ours(sv[0]);
        unique_fd theirs(sv[1]);
        const timeval tv{supervisor_timeout_ms / 1000, 0};
        ::setsockopt(ours.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ::setsockopt(ours.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);

        unique_fd workspace_fd = open_path(workspace, "the workspace");
        unique_fd etc = open_path(runtime_dir_ / ".etc" / (cfg.network ? "net" : "private"),
                                  "the sandbox /etc");
        unique_fd init = open_path(init_path_, "sandboxd-init");
        detail::Pipe errors = detail::make_pipe(detail::daemon_end::read);

        detail::SpawnRequest request;
        // The lease's cgroup is joined by the supervisor itself, through these join files
        // (fds 8, 9, ... of bubblewrap and of the supervisor), before it serves: bubblewrap
        // stays in the daemon's cgroup, so that the lease's cgroup holds the sandbox's own
        // processes only (its supervisor, a channel init made ahead, its channels).
        std::vector<unique_fd> procs;
        if (sandbox.cgroup) procs = sandbox.cgroup->open_procs();
        for (const auto& fd : procs) request.extra_fds.push_back(fd.get());
        request.argv = bwrap_argv(cfg, procs.size());
        request.envp = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"};
        request.fds = {-1, -1, errors.write_end.get(), theirs.get(), program_.get(),
                       workspace_fd.get(), etc.get(), init.get()};
        request.run_as = std::make_pair(uid, static_cast<gid_t>(uid));
        auto child = detail::spawn_process(request, "bubblewrap");
        sandbox.pid = child.pid;
        sandbox.pidfd = std::move(child.pidfd);
        errors.write_end.reset();
        theirs.reset();

        // The supervisor says hello (a reply with id 0) once it serves; EOF means bubblewrap
        // failed, and its stderr says why.
        // The hello carries the supervisor's pidfd.
        proto::Reply hello{};
        unique_fd supervisor;
        const ssize_t n = recv_reply(ours.get(), hello, supervisor, 0);
        if (n != static_cast<ssize_t>(sizeof hello) || hello.magic != proto::reply_magic ||
            hello.id != 0 || hello.error != 0 || !supervisor) {
            const int err = n < 0 ? static_cast<int>(-n) : 0;
            char text[2048];
            ssize_t got = ::read(errors.read_end.get(), text, sizeof text - 1);
            std::string why = got > 0 ? std::string(text, static_cast<std::size_t>(got)) : "";
            while (!why.empty() && (why.back() == '\n' || why.back() == '\r')) why.pop_back();
            if (why.empty()) why = err != 0 ? std::strerror(err) : "no answer from its supervisor";
            sandbox.shutdown();
            provider_failure("cannot start the sandbox: " + why);
        }
        sandbox.socket = std::move(ours);
        sandbox.supervisor_pidfd = std::move(supervisor);
    }

    /// What one exchange with a supervisor got: 0 or the errno that ended it, the reply and
    /// the descriptor it carried.
    struct Exchanged {
        int error = 0;
        ssize_t got = 0;
        proto::Reply reply{};
        unique_fd pidfd;
    };

    /// One request packet with its descriptors; -errno on failure (EAGAIN: try when writable).
    static ssize_t send_request(int socket, const proto::Request& request,
                                const std::string& payload, const std::vector<int>& fds) {
        iovec iov[2] = {{const_cast<proto::Request*>(&request), sizeof request},
                        {const_cast<char*>(payload.data()), payload.size()}};
        std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()), '\0');
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = 2;
        msg.msg_control = control.data();
        msg.msg_controllen = control.size();
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
        ssize_t sent = 0;
        do {
            sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        } while (sent < 0 && errno == EINTR);
        return sent < 0 ? -errno : sent;
    }

    /// One reply packet and the pidfd it may carry; -errno on failure (EAGAIN: try when
    /// readable), 0 at EOF. `flags`: MSG_DONTWAIT, or 0 to block (up to SO_RCVTIMEO).
    static ssize_t recv_reply(int socket, proto::Reply& reply, unique_fd& pidfd,
                              int flags = MSG_DONTWAIT) {
        alignas(cmsghdr) char reply_control[CMSG_SPACE(sizeof(int))];
        iovec riov{&reply, sizeof reply};
        msghdr rmsg{};
        rmsg.msg_iov = &riov;
        rmsg.msg_iovlen = 1;
        rmsg.msg_control = reply_control;
        rmsg.msg_controllen = sizeof reply_control;
        ssize_t got = 0;
        do {
            got = ::recvmsg(socket, &rmsg, MSG_CMSG_CLOEXEC | flags);
        } while (got < 0 && errno == EINTR);
        if (got < 0) return -errno;
        for (cmsghdr* rc = CMSG_FIRSTHDR(&rmsg); rc != nullptr; rc = CMSG_NXTHDR(&rmsg, rc)) {
            if (rc->cmsg_level == SOL_SOCKET && rc->cmsg_type == SCM_RIGHTS &&
                rc->cmsg_len >= CMSG_LEN(sizeof(int))) {
                int fd = -1;
                std::memcpy(&fd, CMSG_DATA(rc), sizeof fd);
                pidfd.reset(fd);
            }
        }
        return got;
    }

    /// Sends the request and reads its reply, waiting on `socket` (the awaiting executor's)
    /// whenever the kernel would block. Never throws for the supervisor's failures: they are
    /// in the result.
    static awaitable<Exchanged> exchange(std::shared_ptr<net::posix::stream_descriptor> socket,
                                         unique_fd spare, proto::Request request,
                                         std::string payload, std::vector<int> fds) {
        Exchanged out;
        const int fd = socket->native_handle();
        const ssize_t sent = co_await when_ready(*socket, net::posix::descriptor_base::wait_write,
                                                 [&] { return send_request(fd, request, payload, fds); });
        if (sent < 0) {
            out.error = static_cast<int>(-sent);
            co_return out;
        }
        spare.reset();  // the reply's pidfd takes its place
        out.got = co_await when_ready(*socket, net::posix::descriptor_base::wait_read,
                                      [&] { return recv_reply(fd, out.reply, out.pidfd); });
        if (out.got < 0) out.error = static_cast<int>(-out.got);
        if (out.got == 0) out.error = EPIPE;
        co_return out;
    }

    /// Calls `attempt` (a non-blocking socket call: its result, or -errno) again each time
    /// `socket` is ready for `wait` while it says EAGAIN. Returns its result, or -EPIPE when the
    /// wait fails (the socket closed or the wait was cancelled).
    template <typename Attempt>
    static awaitable<ssize_t> when_ready(net::posix::stream_descriptor& socket,
                                         net::posix::descriptor_base::wait_type wait,
                                         Attempt attempt) {
        for (;;) {
            const ssize_t result = attempt();
            if (result != -EAGAIN && result != -EWOULDBLOCK) co_return result;
            auto [ec] = co_await socket.async_wait(wait, as_tuple_awaitable);
            if (ec) co_return -EPIPE;
        }
    }

    /// A descriptor of the supervisor's socket for one request, on the awaiting executor:
    /// shutdown() may close the sandbox's own meanwhile (the supervisor sees EOF once both
    /// are closed).
    static unique_fd copy_socket(BwrapSandbox& sandbox, const std::string& name) {
        std::lock_guard lock(sandbox.mutex);
        if (!sandbox.socket || sandbox.broken) {
            provider_failure("sandbox " + name + " is gone: its supervisor has exited");
        }
        unique_fd copy(::fcntl(sandbox.socket.get(), F_DUPFD_CLOEXEC, 0));
        if (!copy) {
            const int err = errno;
            if (err == EMFILE || err == ENFILE) {
                throw rpc_error(errc::channel_limit,
                                "cannot start a channel: this node has no file descriptor left "
                                "for another channel (" +
                                    std::string(err == EMFILE ? "RLIMIT_NOFILE"
                                                              : "system file table") +
                                    ")");
            }
            provider_failure(std::string("cannot start a channel: ") + std::strerror(err));
        }
        return copy;
    }

    /// Sends one request with its descriptors and returns the channel init's pidfd. The caller
    /// holds the sandbox's turn (replies come in request order); no thread waits meanwhile.
    awaitable<unique_fd> ask_supervisor(std::shared_ptr<BwrapSandbox> sandbox, std::string name,
                                        unique_fd socket_copy, unique_fd spare,
                                        proto::Request request, std::string payload,
                                        std::vector<int> fds) {
        using namespace net::experimental::awaitable_operators;
        // The caller (open) holds the sandbox's turn: one request in flight on the socket.
        {
            std::lock_guard lock(sandbox->mutex);
            if (sandbox->broken) {
                provider_failure("sandbox " + name + " is gone: its supervisor has exited");
            }
            request.id = sandbox->next_request++;
        }
        auto executor = co_await net::this_coro::executor;
        auto socket =
            std::make_shared<net::posix::stream_descriptor>(executor, socket_copy.release());
        net::steady_timer timer(executor);
        timer.expires_after(std::chrono::milliseconds(supervisor_timeout_ms));
        auto outcome = co_await (exchange(socket, std::move(spare), request, std::move(payload),
                                          std::move(fds)) ||
                                 timer.async_wait(as_tuple_awaitable));
        if (outcome.index() == 1) fail_supervisor(*sandbox, name, ETIMEDOUT);
        Exchanged got = std::get<0>(std::move(outcome));
        if (got.error != 0) fail_supervisor(*sandbox, name, got.error);
        const proto::Reply& reply = got.reply;
        if (got.got != static_cast<ssize_t>(sizeof reply) || reply.magic != proto::reply_magic ||
            reply.id != request.id || (reply.error == 0) != static_cast<bool>(got.pidfd)) {
            fail_supervisor(*sandbox, name, EPROTO);
        }
        if (reply.error != 0) {
            if (reply.error == ETIMEDOUT) {
                throw start_deadline_passed("sandbox " + name + ": the channel was not started: its node's "
                                            "fencing deadline passed before it could start");
            }
            if (reply.error == EMFILE || reply.error == ENFILE || reply.error == EAGAIN) {
                throw rpc_error(errc::channel_limit,
                                "sandbox " + name + " cannot start another process: " +
                                    std::strerror(reply.error));
            }
            provider_failure("sandbox " + name + " could not start the channel: " +
                             std::strerror(reply.error));
        }
        ::fcntl(got.pidfd.get(), F_SETFL, O_NONBLOCK);
        co_return std::move(got.pidfd);
    }

    [[noreturn]] static void fail_supervisor(BwrapSandbox& sandbox, const std::string& name,
                                             int err) {
        // The supervisor is gone or out of step: no later request could be trusted.
        {
            std::lock_guard lock(sandbox.mutex);
            sandbox.broken = true;
        }
        if (err == ETIMEDOUT) {
            provider_failure("the supervisor of sandbox " + name + " did not answer within " +
                             std::to_string(supervisor_timeout_ms) + " ms");
        }
        provider_failure("sandbox " + name + " is gone: its supervisor has exited (" +
                         std::strerror(err) + ")");
    }

    const std::string key_ = "bwrap";
    const std::string plugin_id_ = "builtin";
    const BwrapOptions options_;
    fs::path init_path_;
    detail::IdentityPool pool_;
    unique_fd dir_lock_;
    std::string instance_;   ///< this daemon's name in cgroups and /run
    fs::path runtime_dir_;
    /// Why the start-up probe could not make a sandbox ("" when it could); set once in the
    /// constructor, read-only after.
    std::string probe_problem_;
    unique_fd program_;
    std::unique_ptr<detail::CgroupManager> cgroups_;
    /// The node's pids and open-file budgets; null when limits are not enforced.
    std::shared_ptr<detail::NodeBudget> budget_;
    std::shared_ptr<Counters> counters_ = std::make_shared<Counters>();
    /// create() and destroy() run here, never on the node's pool or an I/O thread. Last: its
    /// threads are joined before anything they use goes.
    net::thread_pool workers_;
};

}  // namespace

std::unique_ptr<Provider> make_bwrap_provider(BwrapOptions options) {
    return std::make_unique<BwrapProvider>(std::move(options));
}

}  // namespace sandboxd
