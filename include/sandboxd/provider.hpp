#pragma once
/// @file provider.hpp
/// Sandbox providers: they create and destroy sandboxes and start a channel's process inside
/// one. The built-in provider is `bwrap` (bubblewrap); docs/protocol.md section 3 and the
/// design's "Providers" say what a sandboxed process may see.
///
/// Every process is started under `sandboxd-init`, a small init that runs as PID 1 of the
/// channel's own PID namespace. Its contract with the daemon (fds as seen by the init):
///  - fd 3 (write end, daemon reads): one line when the command's main process ends:
///    "exit N\n" (N 0..255) or "signal N\n" (N the signal number). Nothing else.
///  - fd 4 (read end, daemon writes): one byte per request: 1..64 sends that signal to the
///    command's process group; 0x80|N sends signal N to every process of the namespace
///    (kill(-1, N)). EOF on fd 4 is ignored.
///  - Neither fd reaches the command: it sees fds 0, 1, 2 only.
///  - If bubblewrap fails before the init runs (e.g. a bad cwd), fd 3 reaches EOF with no
///    line; the outer process's wait status and stderr tell why.
///  - The outer bubblewrap keeps the pipes open while it lives: stdout/stderr reach EOF only
///    once it has exited (the init exits after the drain grace, or the daemon kills it).
///  - Nobody in the daemon may reap with waitpid(-1) or ignore SIGCHLD: `pid` is waited for
///    through its pidfd only.
/// Killing the outer bubblewrap process (our direct child, `SpawnedProcess::pid`) with
/// SIGKILL kills the init (--die-with-parent) and so every process of the channel.

#include <sandboxd/lease.hpp>
#include <sandboxd/unique_fd.hpp>

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
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

/// A live sandbox held by this process. Immutable after creation; shared between the cache
/// and running channels.
struct SandboxHandle {
    SandboxScope scope;
    std::string lease_id;
    std::filesystem::path workspace;  ///< host directory bound at /workspace
    bool network = false;             ///< share the host network (lease config "network": true)
};

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
};

/// The daemon's side of a started process. Every fd is non-blocking and close-on-exec.
struct SpawnedProcess {
    pid_t pid = -1;    ///< the outer bubblewrap process, our direct child
    unique_fd pidfd;   ///< pidfd of `pid`; readable when it exits
    unique_fd stdin_fd;   ///< write end of the command's stdin; the PTY master under a PTY;
                          ///< empty when !stdin_attached and no PTY
    unique_fd stdout_fd;  ///< read end of stdout; under a PTY, a dup of the master
    unique_fd stderr_fd;  ///< read end of stderr; empty under a PTY (merged into stdout)
    unique_fd status_fd;  ///< read end of the init's fd 3
    unique_fd control_fd; ///< write end of the init's fd 4
};

class Provider {
public:
    virtual ~Provider() = default;
    /// The driver key, e.g. "bwrap".
    virtual const std::string& key() const noexcept = 0;
    /// metadata.pluginId of its leases: "builtin" for built-in providers.
    virtual const std::string& plugin_id() const noexcept = 0;

    /// Creates a sandbox for `scope` (provider_lease_id is minted here and set in the result).
    /// `config` is the lease's provider config. Blocking; call off the I/O threads.
    /// Throws rpc_error(errc::invalid_params) for a bad config, errc::provider_error otherwise.
    virtual std::shared_ptr<SandboxHandle> create(SandboxScope scope, const std::string& lease_id,
                                                  const nlohmann::json& config) = 0;

    /// Destroys the sandbox (its workspace). The caller has stopped its channels first.
    /// Idempotent: destroying a missing sandbox succeeds. Blocking. Throws
    /// rpc_error(errc::provider_error) when it cannot remove it.
    virtual void destroy(const SandboxHandle& sandbox) = 0;

    /// Starts `spec` in `sandbox`. Fast (one fork/exec), callable from any thread.
    /// Throws rpc_error(errc::provider_error) if the sandbox is gone (its workspace was
    /// removed) or the process cannot be started; nothing is left running then.
    virtual SpawnedProcess spawn(const SandboxHandle& sandbox, const ExecSpec& spec) = 0;

    /// False while the provider cannot serve (a plugin worker that is down, restarting or
    /// given up): create() and spawn() then throw errc::provider_not_ready. Fast; no I/O.
    virtual bool ready() const noexcept { return true; }

    /// A handle good enough to destroy() the sandbox of `scope` that this process no longer
    /// caches (after a restart, for the sweeper), or nullptr when the provider cannot tear
    /// down by scope alone. Never used to open channels. Fast; no I/O.
    virtual std::shared_ptr<SandboxHandle> handle_for_teardown(const SandboxScope& scope,
                                                               const std::string& lease_id) {
        (void)scope;
        (void)lease_id;
        return nullptr;
    }
};

struct BwrapOptions {
    std::filesystem::path bwrap_path = "/usr/bin/bwrap";
    std::filesystem::path init_path;    ///< sandboxd-init; "" = next to the running executable
    std::filesystem::path sandboxes_dir;  ///< workspaces live in <sandboxes_dir>/<providerLeaseId>
    bool allow_network = false;         ///< whether a lease config may ask for "network": true
    std::vector<std::string> ro_binds = {"/usr", "/etc", "/opt"};  ///< read-only if present
};

/// The built-in bubblewrap provider (key "bwrap", pluginId "builtin"). Thread-safe.
std::unique_ptr<Provider> make_bwrap_provider(BwrapOptions options);

}  // namespace sandboxd
