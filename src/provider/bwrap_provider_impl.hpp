#pragma once
/// @file bwrap_provider_impl.hpp
/// The bubblewrap provider's class (bwrap_provider.cpp has the whole story), internal to the
/// provider layer. Its methods are defined by concern: bwrap_provider.cpp (the Provider calls,
/// a lease's create and destroy), bwrap_node.cpp (what the provider sets up on the node at
/// start and removes at stop, and a sandbox's files), bwrap_supervisor.cpp (bubblewrap's start
/// and the link to each sandbox's supervisor: its channel requests), bwrap_adopt.cpp (a
/// sandbox outliving its daemon, and its re-adoption by the next).

#include <sandboxd/core/net.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/provider/provider.hpp>

#include "init/supervisor_protocol.hpp"
#include "provider/bwrap_config.hpp"
#include "provider/bwrap_sandbox.hpp"
#include "provider/cgroups.hpp"
#include "provider/identity_pool.hpp"
#include "provider/lease_network.hpp"
#include "provider/node_budget.hpp"
#include "provider/process_backend.hpp"
#include "provider/spawn.hpp"

#include <nlohmann/json.hpp>

#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace sandboxd::bwrap {

namespace proto = supervisor;
using detail::LeaseConfig;
using nlohmann::json;

constexpr std::string_view sandbox_path =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
constexpr const char* init_in_sandbox = "/.sandboxd/init";
constexpr int supervisor_timeout_ms = 10000;
constexpr std::size_t max_blocking_threads = 64;

/// Throws rpc_error(PROVIDER_ERROR, `message`).
[[noreturn]] void provider_failure(std::string message);
/// The default init: next to the running executable, else the install location.
fs::path default_init_path();
/// INVALID_PARAMS unless `spec`'s argv, cwd and env can be passed to a command.
void validate_spec(const ExecSpec& spec);
/// `cwd` inside the sandbox: relative to /workspace, which is also the default.
std::string sandbox_cwd(const std::string& cwd);
/// An O_PATH descriptor of `path`; PROVIDER_ERROR naming `what` when it cannot be opened.
unique_fd open_path(const fs::path& path, const char* what);
/// Writes `text` to `path` (truncated); throws std::runtime_error on failure.
void write_file(const fs::path& path, std::string_view text);
/// One packet of the `count` buffers of `iov`, with `fds` by SCM_RIGHTS (none when empty),
/// without waiting (MSG_DONTWAIT; EINTR retried): the bytes sent, or -errno (EAGAIN: try when
/// writable).
ssize_t send_with_fds(int socket, iovec* iov, std::size_t count, const std::vector<int>& fds);
/// One packet of at most `size` bytes into `data`, and the descriptors it carries (at most 8,
/// close-on-exec) into `fds`; `truncated` when the kernel dropped some (MSG_CTRUNC). Its size,
/// 0 at EOF, or -errno (EINTR retried). `flags`: MSG_DONTWAIT, or 0 to block (up to
/// SO_RCVTIMEO).
ssize_t recv_with_fds(int socket, void* data, std::size_t size, std::vector<unique_fd>& fds,
                      bool& truncated, int flags);
/// FNV-1a, for a stable short name of the sandboxes directory.
std::string short_hash(std::string_view text);

class BwrapProvider final : public Provider {
public:
    explicit BwrapProvider(BwrapOptions options);

    BwrapProvider(const BwrapProvider&) = delete;
    BwrapProvider& operator=(const BwrapProvider&) = delete;
    ~BwrapProvider() override;

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }

    std::string degraded() const override {
        if (!probe_problem_.empty()) return "cannot make a sandbox: " + probe_problem_;
        return options_.limits.enforce ? std::string()
                                       : "no limits are enforced (providers.bwrap.limits.enforce "
                                         "is false)";
    }

    bool ready() const noexcept override { return probe_problem_.empty(); }

    std::map<std::string, std::uint64_t> egress_denied() const override {
        return network_ ? network_->denied() : std::map<std::string, std::uint64_t>{};
    }

    LimitEvents limit_events() const noexcept override {
        return {counters_->memory.load(), counters_->pids.load()};
    }

    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override;

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        auto work = [this, sandbox = std::move(sandbox)] { destroy_now(*sandbox); };
        co_await offload(workers_, std::move(work));
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override;

    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override;

    awaitable<std::vector<std::string>> stored_sandboxes() override;

    awaitable<std::string> describe_stored(std::string provider_lease_id) override {
        auto work = [this, id = std::move(provider_lease_id)] { return describe_stored_now(id); };
        co_return co_await offload(workers_, std::move(work));
    }

    std::string describe_stored_now(const std::string& provider_lease_id) const;

    std::vector<std::string> capabilities() const override {
        return {"channels", "pty",   "stderr",  "signals",        "closeStdin",
                "resize",   "probe", "execute", "validateConfig", "network"};
    }

    awaitable<json> validate_config(std::string company_id, json config) override {
        (void)company_id;
        json result = validation_of(config);
        co_return result;
    }

    awaitable<json> probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease) override {
        (void)lease;
        // usage() reads the cgroup's files and statvfs: not on the caller's strand.
        auto work = [this, sandbox = std::move(sandbox)] { return probe_of(*sandbox); };
        co_return co_await offload(workers_, std::move(work));
    }

    json usage(const SandboxHandle& sandbox) const override;

    awaitable<json> update_network(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                   json network) override {
        (void)lease;
        auto work = [this, sandbox = std::move(sandbox), network = std::move(network)] {
            return update_network_now(*sandbox, network);
        };
        co_return co_await offload(workers_, std::move(work));
    }

private:
    /// A started channel init: its pidfd, and with flag_pty_lease the terminal's master.
    struct StartedInit {
        unique_fd pidfd;
        unique_fd master;
    };

    /// A channel's request and the descriptors it passes, before the supervisor answers.
    struct PreparedChannel {
        proto::Request request;
        std::string payload;
        std::vector<int> fds;  ///< the child's ends below, in the protocol's order
        bool pty = false;
        /// The terminal is made inside the lease (flag_pty_lease: a supervisor of
        /// lease_pty_version or later); else pty_ends is the daemon's own.
        bool lease_pty = false;
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
                                              const json& config);

    void destroy_now(const SandboxHandle& sandbox);

    /// A new sandbox id and its directory under sandboxes_dir (root's, 0700).
    std::string make_sandbox_dir() const;

    /// The sandbox's workspace at handle.workspace, owned by `uid`: with limits enforced, its
    /// own disk mounted there and its cgroup made; else a plain directory.
    void make_workspace(BwrapSandbox& sandbox, const SandboxHandle& handle, uid_t uid,
                        const LeaseConfig& cfg);

    /// io limits this node's cgroups can apply; else INVALID_PARAMS naming the field, before
    /// anything is made.
    void check_io_limits(const EffectiveLimits& limits) const;

    /// The request, payload and descriptors of a channel: fast, no waiting (pipes, a PTY,
    /// the channel's cgroup directory).
    PreparedChannel prepare_channel(BwrapSandbox& state, const ExecSpec& spec);

    /// A spare cgroup of the lease (with its counts as it was put back), else a new one.
    static TakenCgroup take_channel_cgroup(BwrapSandbox& state);

    /// A memfd holding `bytes`, sealed against any change; empty (errno set) on failure.
    static unique_fd sealed_memfd(const char* name, const std::string& bytes);

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
    detail::ProcessEnds channel_ends(PreparedChannel prepared, StartedInit started,
                                     const std::shared_ptr<BwrapSandbox>& state);

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
    void lock_dir();

    /// The node's network (issue 48): the defaults' rules parsed, the stored leases' veths
    /// kept for their re-adoption, the rest of an earlier process's removed.
    void start_network();

    /// <sandboxes_dir>/<id>/network: the lease's veth index and current policy, for its
    /// re-adoption and teardown by a later process.
    void write_network_record(const std::string& id, const detail::LeaseNetwork& network) const;
    struct NetworkRecord {
        detail::LeaseNetworkInfo info;
        std::optional<detail::NetworkPolicy> policy;
    };
    std::optional<NetworkRecord> read_network_record(const std::string& id) const;
    /// A re-adopted lease's network (its policy applied again), or null when that fails: then
    /// its veth is removed and it keeps loopback only (logged).
    std::unique_ptr<detail::LeaseNetwork> readopt_network(
        const std::string& id, const std::string& lease_id,
        const std::optional<NetworkRecord>& record, const detail::NetworkPolicy& policy) noexcept;

    /// At start: bubblewrap with a lease's own namespaces, mounts and capabilities, as a
    /// lease's uid, running /usr/bin/true (about 10 ms). "" when it exits 0; else why not,
    /// with bubblewrap's own words (a container without the privileges it needs, a seccomp
    /// profile that refuses sethostname, no user namespaces).
    std::string probe_sandbox();

    void probe_enforcement();

    /// Throws, naming the directory, when an unprivileged uid cannot search every directory
    /// from / down to `target` (e.g. a root file system whose / is 0700).
    static void require_reachable(const fs::path& target);

    /// sandboxd-init where every lease's uid can reach it by path (bubblewrap resolves its
    /// bind sources as that uid): where it is, when every directory above it is searchable by
    /// others and it is root's (so no lease can replace it), else a copy in the runtime dir.
    fs::path install_init() const;

    /// Mounts a tmpfs of its own at `dir` (made if missing; a mount an earlier process left
    /// there is unmounted first), mode 0711. What bubblewrap binds from it shows in a
    /// sandbox's mountinfo as a path within that tmpfs (e.g. `/private`, source `sandboxd`),
    /// never as a path under the runtime directory: a bind's mountinfo root is the source's
    /// path within its own filesystem, whether bound by path or by descriptor.
    static void stage_on_tmpfs(const fs::path& dir);

    /// Unmounts and removes what stage_on_tmpfs() made (the generated /etc, the init's copy).
    void unstage() const noexcept {
        std::error_code ec;
        for (const char* staged : {".etc", ".init"}) {
            while (::umount2((runtime_dir_ / staged).c_str(), MNT_DETACH) == 0) {
            }
            fs::remove_all(runtime_dir_ / staged, ec);
        }
    }

    static unique_fd make_program_fd();

    /// The generated /etc: fixed files naming the sandbox user, plus copies of the configured
    /// host entries. Written at start, read-only in every sandbox.
    void write_etc(const fs::path& dir, bool network) const;

    /// Claims the ids of the sandboxes an earlier process left on disk, so that no new lease
    /// gets a uid that still owns files.
    void reclaim_identities();

    /// The workspaces of an earlier process (killed, so it could not unmount them) can never
    /// be used again: unmount them now, freeing their loop devices. Their images and records
    /// stay until the sweeper tears the leases down.
    void release_stale_mounts() const;

    static std::optional<uid_t> read_identity(const fs::path& dir) {
        std::ifstream in(dir / "identity");
        unsigned long long uid = 0;
        if (!(in >> uid) || uid == 0 || uid > 0xFFFFFFFEULL) return std::nullopt;
        return static_cast<uid_t>(uid);
    }

    /// Unmounts and removes a sandbox's files, then returns its uid. Its processes are gone.
    void teardown_files(const SandboxHandle& sandbox);

    /// leaseUpdateNetwork, on the provider's pool.
    json update_network_now(const SandboxHandle& sandbox, const json& network);

    /// The SDK's validation result for a lease config: the effective limits when it is good.
    json validation_of(const json& config) const;

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
        return detail::parse_lease_config(config, options_.limits, net_defaults_);
    }

    /// `cgroup_fds`: how many lease cgroup join files bubblewrap passes on at fds 8, 9, ...
    /// `own_netns`: bubblewrap makes the lease's network namespace (loopback only): on a node
    /// without egress, whose daemon may lack CAP_NET_ADMIN; else it starts in the one the
    /// daemon made (lease_network.hpp).
    std::vector<std::string> bwrap_argv(const LeaseConfig& cfg, std::size_t cgroup_fds,
                                        bool own_netns) const;

    void start_supervisor(BwrapSandbox& sandbox, const std::string& id, const fs::path& workspace,
                          uid_t uid, const LeaseConfig& cfg);

    // --- Adoption (bwrap_adopt.cpp; the protocol in supervisor_protocol.hpp). ---

    /// What a supervisor that may outlive this process is given: its adoption socket (bound
    /// at <runtime_dir>/<id>/supervisor.sock, not listening: the supervisor listens, so that
    /// SO_PEERCRED names it) and a sealed memfd of the lease's secret, whose copy is written
    /// to <sandboxes_dir>/<id>/secret (0600).
    struct AdoptionEnds {
        unique_fd listen;
        unique_fd secret;
    };
    AdoptionEnds prepare_adoption(const std::string& id) const;

    /// The supervisor of stored sandbox `id`, reached through its adoption socket: the
    /// connection, its welcome and the supervisor's pidfd. Checks the peer's credentials (the
    /// lease's uid, the pid of the pidfd). Throws provider_error saying what failed.
    struct Reached {
        unique_fd socket;
        proto::Welcome welcome{};
        unique_fd pidfd;
        unique_fd workspace;  ///< the sandbox's /workspace (version 4 on); may be empty
    };
    Reached reach_supervisor(const std::string& id, std::uint32_t flags) const;

    /// resume(): re-adopts the running sandbox of `lease` (blocking: on the workers).
    std::shared_ptr<SandboxHandle> adopt_now(const Lease& lease);

    /// Asks the supervisor of stored sandbox `id` to end its sandbox (adopt_end); false when
    /// none answered. Never throws.
    bool end_stored_supervisor(const std::string& id) const noexcept;

    // --- Kept channels (bwrap_kept.cpp; supervisor_protocol.hpp, "Kept channels"). ---

    /// After a kept channel's reply: gives its supervisor copies of the daemon's ends of it
    /// (`ends`) under `key`, and makes `ends.resources` release them at the channel's end.
    /// Under a PTY, first adds the relay pipe to `ends`. A failure (out of descriptors, a full
    /// socket) is logged: the channel then does not outlive this process. Fast; no waiting.
    void hold_channel(const std::shared_ptr<BwrapSandbox>& state, const std::string& key,
                      detail::ProcessEnds& ends) const;
    /// At an adoption (the connection just welcomed): asks the supervisor for the kept
    /// channels' ends and stores them in `state.kept_channels`. Blocking, bounded by the
    /// socket's timeouts; a failure is logged and leaves what was received.
    static void take_back_kept(BwrapSandbox& state, int socket, const std::string& id);

public:
    std::vector<std::string> kept_channels(const SandboxHandle& sandbox) const override;
    std::unique_ptr<ChannelBackend> take_kept_channel(SandboxHandle& sandbox,
                                                      const std::string& key,
                                                      net::any_io_executor executor) override;

private:
    bool outlives_daemon() const noexcept override { return options_.adopt_timeout_ms > 0; }
    void keep_at_stop() noexcept override { lane_->keep(); }
    bool can_resume() const noexcept override { return options_.adopt_timeout_ms > 0; }
    awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease) override {
        auto work = [this, lease = std::move(lease)] { return adopt_now(lease); };
        co_return co_await offload(workers_, std::move(work));
    }

    /// What one exchange with a supervisor got: 0 or the errno that ended it, the reply and
    /// the descriptors it carried (the init's pidfd; with flag_pty_lease, the terminal's master).
    struct Exchanged {
        int error = 0;
        ssize_t got = 0;
        proto::Reply reply{};
        unique_fd pidfd;
        unique_fd master;
    };

    /// One request packet with its descriptors; -errno on failure (EAGAIN: try when writable).
    static ssize_t send_request(int socket, const proto::Request& request,
                                const std::string& payload, const std::vector<int>& fds);

    /// One reply packet and the pidfd it may carry; -errno on failure (EAGAIN: try when
    /// readable), 0 at EOF. `flags`: MSG_DONTWAIT, or 0 to block (up to SO_RCVTIMEO).
    /// `master`, if given, receives a second descriptor (flag_pty_lease); else it is closed.
    static ssize_t recv_reply(int socket, proto::Reply& reply, unique_fd& pidfd,
                              int flags = MSG_DONTWAIT, unique_fd* master = nullptr);

    /// Sends the request and reads its reply, waiting on `socket` (the awaiting executor's)
    /// whenever the kernel would block. Never throws for the supervisor's failures: they are
    /// in the result.
    /// `spares` are closed once the request is sent: the reply's descriptors take their place.
    static awaitable<Exchanged> exchange(std::shared_ptr<net::posix::stream_descriptor> socket,
                                         std::vector<unique_fd> spares, proto::Request request,
                                         std::string payload, std::vector<int> fds);

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
    static unique_fd copy_socket(BwrapSandbox& sandbox, const std::string& name);

    /// Sends one request with its descriptors and returns what the reply carried. The caller
    /// holds the sandbox's turn (replies come in request order); no thread waits meanwhile.
    awaitable<StartedInit> ask_supervisor(std::shared_ptr<BwrapSandbox> sandbox, std::string name,
                                          unique_fd socket_copy, std::vector<unique_fd> spares,
                                          proto::Request request, std::string payload,
                                          std::vector<int> fds);

    [[noreturn]] static void fail_supervisor(BwrapSandbox& sandbox, const std::string& name,
                                             int err);

    const std::string key_ = "bwrap";
    const std::string plugin_id_ = "builtin";
    const BwrapOptions options_;
    fs::path init_path_;
    detail::IdentityPool pool_;
    unique_fd dir_lock_;
    std::string instance_;  ///< this daemon's name in cgroups and /run
    fs::path runtime_dir_;
    /// Why the start-up probe could not make a sandbox ("" when it could); set once in the
    /// constructor, read-only after.
    std::string probe_problem_;
    unique_fd program_;
    std::unique_ptr<detail::CgroupManager> cgroups_;
    /// The node's pids and open-file budgets; null when limits are not enforced.
    std::shared_ptr<detail::NodeBudget> budget_;
    /// What `network: true` stands for, and whether egress is allowed (set first).
    detail::NetworkDefaults net_defaults_;
    /// Every lease's network namespace, and with egress its veth pair, policy and resolver.
    std::shared_ptr<detail::NodeNetwork> network_;
    std::shared_ptr<Counters> counters_ = std::make_shared<Counters>();
    /// create() and destroy() run here, never on the node's pool or an I/O thread. Its
    /// threads are joined (by the destructor) before anything they use goes.
    net::thread_pool workers_;
    /// On workers_: where a sandbox dropped without a teardown ends its processes.
    std::shared_ptr<TeardownLane> lane_ = std::make_shared<TeardownLane>(workers_);
};

}  // namespace sandboxd::bwrap
