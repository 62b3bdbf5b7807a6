#pragma once
/// @file provider.hpp
/// Sandbox providers: they create and destroy sandboxes and start a channel's process inside
/// one. The built-in provider is `bwrap` (bubblewrap); docs/protocol.md section 3 and the
/// design's "Providers" say what a sandboxed process may see.
///
/// The built-in provider makes each lease one long-lived sandbox (docs/security.md): its own
/// namespaces, an unprivileged host uid, a minimal filesystem, a cgroup with the lease's
/// limits and a workspace disk of its own, with `sandboxd-init --lease` as its supervisor. A
/// channel is a request to that supervisor, which starts the channel's init as PID 1 of a PID
/// namespace of the channel's own; the daemon serves it through the process backend
/// (src/provider/process_backend.hpp). The channel init's contract with the daemon (its fds):
///  - fd 3 (write end, daemon reads): one line when the command's main process ends:
///    "exit N\n" (N 0..255) or "signal N\n" (N the signal number); then, only when the init
///    has reaped every other process of the channel (after the drain grace's kill, or once
///    none was left) and closed its own copies of fds 0-2, "end\n" just before it exits.
///    Nothing else. The daemon reads at most 32 bytes for the first line and accepts only
///    those two forms (anything else is an error); it sends the exit once the streams have
///    ended and either "end" came or the init is gone (its pidfd), whichever is first: the
///    init's own exit (its namespaces' teardown) is no longer on the exit's path.
///  - fd 4 (read end, daemon writes): one byte per request: 1..64 sends that signal to the
///    command's process group; 0x80|N sends signal N to every process of the channel
///    (kill(-1, N)). EOF on fd 4 is ignored.
///  - Neither fd reaches the command: it sees fds 0, 1, 2 only, and the init is not dumpable.
///  - If the channel cannot be set up (e.g. a bad cwd), fd 3 reaches EOF with no line and the
///    reason is on stderr.
///  - The channel's pipes reach EOF once the channel init has closed them (before its "end"
///    line) or exited (after the drain grace, or when the daemon kills it).
///  - The channel init is the supervisor's child, not the daemon's: it is watched and killed
///    through its pidfd only (never waitpid).

#include <sandboxd/core/async.hpp>
#include <sandboxd/core/config.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/provider/channel_backend.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd {

/// The full scope a cached sandbox is found by (never a bare id). protocol section 3 step 6.
struct SandboxScope {
    std::string provider;
    std::string company_id;
    std::string environment_id;
    std::string provider_lease_id;
    auto operator<=>(const SandboxScope&) const = default;
};

/// The scope of `lease`'s sandbox. A plain function: GCC 12 miscompiles brace-initialised
/// aggregates of strings inside coroutine bodies, so coroutines call this instead.
inline SandboxScope scope_of(const Lease& lease) {
    return {lease.provider, lease.company_id, lease.environment_id, lease.provider_lease_id};
}

/// What a provider keeps for one live sandbox beyond the handle's fields (the bwrap provider:
/// its supervisor, cgroup and identity). Opaque to everyone else; released with the handle.
class SandboxState {
public:
    virtual ~SandboxState() = default;
};

/// A live sandbox held by this process. Immutable after creation; shared between the cache
/// and running channels.
struct SandboxHandle {
    SandboxScope scope;
    std::string lease_id;
    std::filesystem::path workspace;  ///< host directory bound at /workspace
    /// The lease's network policy, as Lease.network gives it ({mode, allow, deny}); null for a
    /// provider without one.
    nlohmann::json network = nullptr;
    /// The limits enforced on the sandbox, as the Lease's `limits` field (protocol section
    /// 2); null when the provider enforces none.
    nlohmann::json limits = nullptr;
    std::shared_ptr<SandboxState> state;  ///< the provider's own; may be null
    /// What the provider said about the sandbox when it made or resumed it: a plugin's
    /// `metadata` (stored as Lease.providerMetadata and sent back to the worker as
    /// `leaseMetadata`); null when it said nothing (built-in providers).
    nlohmann::json provider_metadata = nullptr;
    /// The provider's own expiry of the sandbox (ms since the epoch), when it has one: the
    /// lease never outlives it.
    std::optional<std::int64_t> expires_at_ms;
};

/// How the sweeper retries a lease whose teardown failed (docs/protocol.md section 2,
/// "pending_cleanup"). A failed attempt waits backoff_ms << (attempts - 1) (capped at
/// slow_retry_ms) before the next; after `attempts` failures the sweeper warns once and then
/// retries every slow_retry_ms, for ever. slow_retry_ms 0 instead makes the lease `failed`
/// after `attempts` failures (for a provider whose sandboxes cannot outlive the node).
struct CleanupPolicy {
    int attempts = 5;                ///< 1..1000
    std::int64_t backoff_ms = 1000;  ///< 1..86400000
    std::int64_t slow_retry_ms = 0;  ///< 0, or 1..86400000
};

/// leaseExecute (docs/protocol.md section 2): one command run to its end in a lease's
/// sandbox, its output returned and streamed.
struct ExecuteRequest {
    /// The SDK's environmentExecute fields as the host gave them, checked: command, args?,
    /// cwd?, env?, stdin?, timeoutMs (always set: the host's or the default), bypassSession?.
    /// A plugin gets them verbatim.
    nlohmann::json params = nlohmann::json::object();
    /// The same command for a provider that runs it as a channel: argv = command + args, cwd,
    /// env; stdin_attached when `stdin` is a non-empty string; drain_grace_ms set.
    std::vector<std::string> argv;
    std::string cwd;
    std::map<std::string, std::string> env;
    std::string stdin_data;
    std::optional<std::uint32_t> drain_grace_ms;
    std::optional<std::int64_t> start_deadline_ms;  ///< as ExecSpec::start_deadline_ms
    /// How long the command may run (ms, 1..86400000): then it is killed and the result says
    /// timedOut. A plugin is sent it as timeoutMs and given 30 s more to answer.
    std::uint64_t timeout_ms = 300000;
    /// Bytes of each stream (stdout, stderr) kept in the result (a channel-run command; the
    /// rest is read and dropped, and the result's metadata says so).
    std::size_t output_limit = 1U << 20;
    /// Awaited before each read of the command's output (a channel-run command), on the
    /// executor that awaits execute(): completes once whoever receives the log can take more
    /// (the host connection's send budgets). Until then the output waits in its pipes and the
    /// command blocks on write. Empty: never waits.
    std::function<awaitable<void>()> wait_for_room;
};

/// One piece of a running execute's output: `stream` is "stdout" or "stderr", `chunk`
/// non-empty UTF-8 text. Called on the executor that awaits Provider::execute(), in order,
/// before execute() completes; never after.
using ExecuteLog = std::function<void(std::string stream, std::string chunk)>;

struct PtySize {
    std::uint16_t cols = 80;  ///< 1..4096
    std::uint16_t rows = 24;  ///< 1..4096
};

/// What to run. Validated by the caller (argv non-empty, no NUL bytes, sizes in range).
struct ExecSpec {
    std::vector<std::string> argv;
    std::string cwd;  ///< inside the sandbox; "" means /workspace; relative is under /workspace
    std::map<std::string, std::string> env;  ///< added after PATH, HOME, TERM, LANG
    std::optional<PtySize> pty;              ///< present: run under a PTY of that size
    bool stdin_attached = true;              ///< false: stdin is /dev/null (EOF at once)
    /// Present: once the main process ends, the init lets descendants run at most this long
    /// (ms), then kills them and exits, so the pipes reach EOF (the drain grace). Absent: the
    /// init keeps running until the daemon kills the namespace.
    std::optional<std::uint32_t> drain_grace_ms;
    /// Present: std::chrono::steady_clock ms (CLOCK_MONOTONIC) by which the command must have
    /// started, else it is not started and open() throws start_deadline_passed. The
    /// daemon's fencing deadline (protocol section 6), enforced by providers that start the
    /// command on this machine (bwrap: its supervisor checks it right before the clone);
    /// providers that cannot (plugins, whose workers start commands themselves) ignore it.
    std::optional<std::int64_t> start_deadline_ms;
    /// Non-empty (1..31 bytes, no NUL): the channel is kept across a daemon restart under this
    /// key when the provider's sandboxes outlive the daemon (Provider::outlives_daemon(): the
    /// bwrap provider's supervisor holds the daemon's ends of it, issue 47), so that the next
    /// process takes it back with take_kept_channel(). A provider that cannot keep it ignores
    /// the key: the channel then ends with its daemon, as any other.
    std::string keep_key;
};

/// Thrown by Provider::open() and execute() when the sandbox did not start the command because
/// its start deadline (ExecSpec::start_deadline_ms) had passed: nothing ran. To a host it is
/// REGISTRY_UNAVAILABLE; the daemon may try again with a later deadline while its membership
/// held without a break (a long queue of opens at one sandbox is not a fenced node).
class start_deadline_passed : public rpc_error {
public:
    explicit start_deadline_passed(std::string message)
        : rpc_error(errc::registry_unavailable, std::move(message)) {}
};

/// Counts of limits that sandboxes hit, for /metrics (sandboxd_limit_events_total).
struct LimitEvents {
    std::uint64_t memory = 0;  ///< channels whose main process was OOM-killed
    std::uint64_t pids = 0;    ///< forks refused by a lease's pids limit
};

/// A plugin provider's worker, for /metrics (sandboxd_plugin_worker_up and
/// sandboxd_plugin_worker_restarts_total).
struct WorkerStatus {
    bool up = false;             ///< a worker is running and has answered `initialize`
    std::uint64_t restarts = 0;  ///< starts after the first since the daemon started
};

class Provider {
public:
    virtual ~Provider() = default;
    /// The driver key, e.g. "bwrap".
    virtual const std::string& key() const noexcept = 0;
    /// metadata.pluginId of its leases: "builtin" for built-in providers.
    virtual const std::string& plugin_id() const noexcept = 0;

    /// Creates a sandbox for the lease being acquired: `lease` holds its id, scope (its
    /// providerLeaseId is empty: it is minted here and set in the result's scope), config,
    /// run/issue/agent/workspace ids and expires_at_ms (the upper bound of the sandbox's own
    /// expiry). The result's provider_metadata and expires_at_ms become the lease's. Completes on
    /// the awaiting executor; the blocking work (disks, cgroups, starting the supervisor) runs on a
    /// pool the provider owns and bounds, or behind a plugin worker's answer (bounded by its RPC
    /// timeout). Throws rpc_error(errc::invalid_params) for a bad config, errc::provider_not_ready
    /// while the provider cannot serve, errc::provider_error otherwise; nothing is left behind
    /// then.
    virtual awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) = 0;

    /// Destroys the sandbox (its workspace). The caller has stopped its channels first.
    /// Idempotent: destroying a missing sandbox succeeds. Awaitable like create(). Throws
    /// rpc_error(errc::provider_error) when it cannot remove it, errc::provider_not_ready
    /// while the provider cannot serve (nothing was done: retry later).
    virtual awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) = 0;

    /// Starts `spec` in `sandbox` and returns its channel backend, bound to the awaiting
    /// executor (see channel_backend.hpp). One round trip to the sandbox's supervisor or
    /// worker, asynchronous, bounded by a timeout (bwrap: 10 s; a plugin: its RPC timeout).
    /// Throws rpc_error(errc::provider_error) if the sandbox is gone or the process cannot be
    /// started, errc::channel_limit when the sandbox or the daemon is out of processes or
    /// descriptors, errc::invalid_params for a spec it cannot carry,
    /// errc::provider_not_ready while the provider cannot serve; nothing is left running then.
    virtual awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                            ExecSpec spec) = 0;

    /// The keys (ExecSpec::keep_key) of the channels of `sandbox` that an earlier process of
    /// this daemon started and its provider kept running (a sandbox resume() re-adopted):
    /// take each with take_kept_channel(). Any thread; no I/O.
    virtual std::vector<std::string> kept_channels(const SandboxHandle& sandbox) const {
        (void)sandbox;
        return {};
    }

    /// The backend of kept channel `key` of `sandbox`, bound to `executor` (the channel's
    /// strand), once; null when the provider keeps no channel of that key. The command goes on
    /// where it was; output it wrote while no daemon ran is still to be read, and an exit is
    /// reported as for a channel this process started. A key not taken is given up when the
    /// sandbox's handle goes. Any thread; no I/O.
    virtual std::unique_ptr<ChannelBackend> take_kept_channel(
        SandboxHandle& sandbox, const std::string& key, boost::asio::any_io_executor executor) {
        (void)sandbox;
        (void)key;
        (void)executor;
        return nullptr;
    }

    /// The sandbox's current usage as the Lease's `usage` field ({memoryBytes, pids,
    /// diskBytes, cpuMs}), or null when the provider cannot measure it. Reads a few kernel
    /// files; does not block on other processes.
    virtual nlohmann::json usage(const SandboxHandle& sandbox) const {
        (void)sandbox;
        return nullptr;
    }

    /// Limit events since start. Fast; thread-safe.
    virtual LimitEvents limit_events() const noexcept { return {}; }

    /// Packets its network policy refused from its leases so far, by reason (issue 48;
    /// sandboxd_egress_denied_total); empty without one. Never blocks: while the policy is
    /// being changed it gives what it read last.
    virtual std::map<std::string, std::uint64_t> egress_denied() const { return {}; }

    /// The state of the provider's worker process; nullopt for a provider without one
    /// (built-in). Fast; thread-safe.
    virtual std::optional<WorkerStatus> worker_status() const noexcept { return std::nullopt; }

    /// A sentence for /readyz and the log when the node serves with a weaker guarantee than
    /// the operator would assume (e.g. "no limits are enforced"), else "". Fast.
    virtual std::string degraded() const { return {}; }

    /// False while the provider cannot serve (a plugin worker that is down, restarting or
    /// given up): create() and open() then throw errc::provider_not_ready. Fast; no I/O.
    virtual bool ready() const noexcept { return true; }

    /// A handle good enough to destroy() the sandbox of `lease` that this process no longer
    /// caches (after a restart, for the sweeper), or nullptr when the provider cannot tear
    /// down from the lease's record alone. Never used to open channels. Fast; no I/O.
    virtual std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) {
        (void)lease;
        return nullptr;
    }

    /// The providerLeaseIds of every sandbox this provider keeps on this node's own disk,
    /// whether or not a lease records it, for the start-up reconciliation: a sandbox that no
    /// lease of this node records (its process was killed between create() and storing the
    /// lease) is destroyed through handle_for_teardown() before the node serves. Providers
    /// whose sandboxes live elsewhere (plugins) keep none here: empty. The directory listing
    /// runs off the caller's thread (the provider's blocking workers); called at start and by
    /// the sweeper (once per nodeTtlMs), which destroys a stored sandbox whose lease is
    /// released or expired. Never throws: an unreadable directory lists nothing.
    virtual awaitable<std::vector<std::string>> stored_sandboxes() {
        co_return std::vector<std::string>{};
    }
    /// What this node's disk holds of stored sandbox `provider_lease_id`, in a few words for
    /// a log line ("directory: identity, disk.img; runtime directory: absent"). Reads the file
    /// system off the caller's thread, like stored_sandboxes(); never throws.
    virtual awaitable<std::string> describe_stored(std::string provider_lease_id) {
        (void)provider_lease_id;
        co_return std::string{};
    }

    /// Whether resume() may bring back a sandbox this process no longer caches (a plugin
    /// whose worker serves environmentResumeLease, or whose worker is not up yet to say).
    /// The sweeper leaves such leases active rather than orphaning them. Fast; no I/O.
    virtual bool can_resume() const noexcept { return false; }

    /// Reconnects to the sandbox of an active lease this process owns but does not cache (it
    /// restarted with the same nodeId), from the lease's record; the result goes into the
    /// cache. Throws rpc_error(errc::sandbox_not_cached) when the provider cannot resume it
    /// (the lease is then orphaned), errc::provider_not_ready while it cannot serve (retry
    /// later). Awaitable like create().
    virtual awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease);

    /// Whether this provider's sandboxes outlive the daemon process (the bwrap provider with
    /// providers.bwrap.adoptTimeoutMs > 0; issue 47): the next process on the same state
    /// re-adopts them through resume(), and a stopping daemon keeps them (keep_at_stop()).
    /// Fast; no I/O.
    virtual bool outlives_daemon() const noexcept { return false; }

    /// From the daemon's stop, before it drops its handles, when it keeps its leases for the
    /// next process: a sandbox dropped from now on is let go (its descriptors close; its
    /// supervisor waits for the next daemon), not ended. Any thread; no I/O.
    virtual void keep_at_stop() noexcept {}

    /// How the sweeper retries this provider's failed teardowns. `heartbeat_ms` is the node's
    /// (the built-in default backs off from it). Fast.
    virtual CleanupPolicy cleanup_policy(std::int64_t heartbeat_ms) const {
        return {5, 2 * heartbeat_ms, 0};
    }

    /// A sandbox the provider made for a lease whose acquire had already failed (a plugin
    /// worker answered after the call's timeout). The node records it as a lease in
    /// pending_cleanup and tears it down. Called on any thread; must not block.
    using LateSandboxSink = std::function<void(Lease lease)>;
    /// Set once by the node before it serves; a provider that never makes late sandboxes
    /// ignores it.
    virtual void on_late_sandbox(LateSandboxSink sink) { (void)sink; }

    /// What the provider serves, as Lease.capabilities names it (docs/protocol.md section
    /// 2): "channels", "pty", "stderr", "signals", "closeStdin", "resize", "probe",
    /// "validateConfig", "resume". A plugin's follow its worker's supportedMethods (empty
    /// while no worker is ready). Fast; no I/O; thread-safe.
    virtual std::vector<std::string> capabilities() const { return {}; }

    /// providerValidateConfig: checks a lease config without making anything. The result is
    /// the SDK's {ok, warnings?, errors?, normalizedConfig?}. Throws
    /// rpc_error(errc::invalid_params) naming the method when the provider cannot validate,
    /// errc::provider_not_ready while it cannot serve. Awaitable like create().
    virtual awaitable<nlohmann::json> validate_config(std::string company_id,
                                                      nlohmann::json config);

    /// leaseProbe on the owner: the SDK's {ok, summary?, diagnostics?, metadata?} about the
    /// sandbox of `lease`. Throws like validate_config().
    virtual awaitable<nlohmann::json> probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease);

    /// leaseExecute on the owner: runs `request` in `sandbox` to its end and returns the
    /// SDK's {exitCode, signal, timedOut, stdout, stderr, metadata?}, streaming output to
    /// `log` while it runs. The default runs it as a channel through open(): exitCode null
    /// and signal "SIGKILL" with timedOut true when the timeout killed it; stdout and stderr
    /// as UTF-8 text (utf8.hpp), at most output_limit bytes each; metadata {stdoutBytes,
    /// stderrBytes, truncated, durationMs}. A plugin calls environmentExecute and returns its
    /// answer verbatim. Throws like open(); INVALID_PARAMS naming leaseExecute when the
    /// provider cannot execute.
    virtual awaitable<nlohmann::json> execute(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                              ExecuteRequest request, ExecuteLog log);

    /// leaseRealizeWorkspace on the owner: the SDK's {cwd, metadata?} for `workspace`
    /// ({remotePath?, mode?, metadata?}, checked). Throws like validate_config(), naming
    /// leaseRealizeWorkspace.
    virtual awaitable<nlohmann::json> realize_workspace(std::shared_ptr<SandboxHandle> sandbox,
                                                        Lease lease, nlohmann::json workspace);

    /// leaseUpdateNetwork on the owner (issue 48): replaces the network policy of `sandbox`
    /// with `network` (a policy object or a boolean, as config.network) and returns it
    /// normalised, as Lease.network then gives it. Connections the new policy no longer
    /// allows are cut at once. Throws INVALID_PARAMS naming `network` (or its field) for a
    /// policy that does not parse or that the node does not allow, naming leaseUpdateNetwork
    /// when the provider has no network policy (plugins). Awaitable like create().
    virtual awaitable<nlohmann::json> update_network(std::shared_ptr<SandboxHandle> sandbox,
                                                     Lease lease, nlohmann::json network);

    /// Whether stop() and a later resume() keep a sandbox for a retained lease (leasePolicy,
    /// docs/protocol.md section 2): a plugin whose worker serves environmentReleaseLease and
    /// environmentResumeLease. Fast; no I/O.
    virtual bool can_retain() const noexcept { return false; }

    /// leaseRelease with disposition "retain": stops the sandbox but keeps it for a later
    /// resume() (a plugin's environmentReleaseLease). The caller has ended its channels.
    /// Throws INVALID_PARAMS naming `disposition` when the provider cannot retain, and like
    /// destroy() otherwise.
    virtual awaitable<void> stop(std::shared_ptr<SandboxHandle> sandbox);
};

struct BwrapOptions {
    /// Run as each lease's uid: it must be reachable (every directory above it searchable)
    /// and executable by others.
    std::filesystem::path bwrap_path = "/usr/bin/bwrap";
    std::filesystem::path init_path;  ///< sandboxd-init; "" = next to the running executable
    /// Each sandbox's records live in <sandboxes_dir>/<providerLeaseId>/ (disk.img,
    /// identity), root's alone. One daemon per directory (a lock).
    std::filesystem::path sandboxes_dir;
    /// What bubblewrap binds, which the lease's uid must reach by path: the workspace mount
    /// points (<runtime_dir>/<providerLeaseId>/workspace), the generated /etc and a copy of
    /// sandboxd-init. "" = /run/sandboxd/<a name derived from sandboxes_dir>.
    std::filesystem::path runtime_dir;
    /// Each lease's network namespace and what it may reach (issue 48). Checked as
    /// validate_config() does; the provider's construction throws std::runtime_error for a pool
    /// that overlaps a route of the host or a `defaults` rule that does not parse.
    BwrapNetworkConfig network;
    std::vector<std::string> ro_binds = {"/usr"};  ///< read-only if present
    BwrapLimitsConfig limits;
    BwrapIdentityConfig identity;
    std::vector<std::string> etc_files = BwrapConfig{}.etc_files;
    std::filesystem::path etc_source = "/etc";  ///< where etc_files are copied from
    std::filesystem::path cgroup_root = "/sys/fs/cgroup";
    /// Where kernel/pid_max and fs/file-max are read at start, for the node's budgets (with
    /// limits.enforce); tests point it at a directory of their own.
    std::filesystem::path proc_sys = "/proc/sys";
    /// How long a lease's supervisor waits for a daemon once its own is gone (stopped or
    /// dead), ms, before it ends the sandbox by itself; a daemon that starts on the same
    /// sandboxes_dir within it re-adopts the sandbox (Provider::resume). 0: sandboxes end with
    /// their daemon (bubblewrap's --die-with-parent), as before issue 47.
    std::int64_t adopt_timeout_ms = 0;
    /// Threads of the provider's own pool for create() and destroy() (1..64): at most this
    /// many run at once, the rest wait their turn without holding a thread of the node.
    std::size_t blocking_threads = 4;
};

/// The built-in bubblewrap provider (key "bwrap", pluginId "builtin"). Thread-safe.
/// Construction probes the machine: with limits.enforce it throws std::runtime_error naming
/// what is missing when neither cgroup v2 nor v1 offers memory, pids and cpu, or when loop
/// devices or mkfs.ext4 are unavailable. It kills and removes the cgroups that a previous
/// process on the same sandboxes_dir left with no sandbox record (a sandbox with a record is
/// re-adopted by resume() or destroyed by destroy()), and throws when another live process
/// holds sandboxes_dir. Logs the mechanism it uses.
std::unique_ptr<Provider> make_bwrap_provider(BwrapOptions options);

/// The no-op provider (key "noop", pluginId "builtin", src/provider/noop_provider.cpp): its
/// sandboxes are nothing, create and destroy return at once, and every open fails with
/// rpc_error(errc::provider_error). For measuring the node's own cost per lease operation
/// (bench/run); enabled only by providers.noop.enabled. Thread-safe.
std::unique_ptr<Provider> make_noop_provider();

}  // namespace sandboxd
