#pragma once
/// @file server.hpp
/// The daemon as a library: one node serving `/v1/ws`, `/healthz`, `/readyz` and `/metrics`
/// on one port (docs/protocol.md sections 1 and 7). The `sandboxd` executable is a thin
/// wrapper around it.

#include <sandboxd/core/config.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace sandboxd {

class Daemon {
public:
    /// Validates `config` (config_error), creates the state directory, opens the registry
    /// (rpc_error REGISTRY_UNAVAILABLE), resolves tokens, sets up providers. Binds nothing yet.
    explicit Daemon(Config config);
    ~Daemon();
    Daemon(const Daemon&) = delete;
    Daemon& operator=(const Daemon&) = delete;

    /// Binds the listener (port 0 picks one), registers the node in the registry (throws
    /// rpc_error(errc::invalid_params) if a live process holds the same nodeId), starts the
    /// heartbeat and sweeper. Returns the bound "HOST:PORT". Call once, before run().
    std::string start();

    /// Runs the I/O threads until stop() completes. Blocks the caller (which is one of them).
    /// Config `threads` (0: one per core) event loops, one thread each: the caller's also
    /// runs the node's own work (registry calls, heartbeat, sweeper); the others start in
    /// start(), so that connections accepted during the registration are served. Each
    /// connection is served by one loop for its whole life (round robin), so a stream's
    /// handlers do not hop between threads.
    void run();

    /// Stops now, from any thread: no new connections, every channel hung up (SIGHUP, then
    /// SIGKILL after limits.hangupGraceMs; no exit is sent, connections close with 1001), the
    /// node record removed. Idempotent; run() returns once done. Does not block.
    void stop();

    /// Begins a drain from any thread (docs/protocol.md section 7; POST /admin/drain): from
    /// this call on, opens (own and relayed) and leaseAcquire/leaseExecute/leaseProbe are
    /// refused with OWNER_UNAVAILABLE and data.draining true, /readyz answers 503 draining,
    /// while heartbeats, renewals, releases and running channels go on. Channels running here
    /// and relayed from here get limits.drainTimeoutMs to end; this node's own are then stopped
    /// (their exits say "stopped"). The node stays up. Idempotent; does not block.
    void drain();

    /// SIGTERM: drain(), then stop() once the drain is over (at once when it is already
    /// over). Idempotent; does not block. A stop() meanwhile (a second SIGTERM) cuts it short.
    void drain_then_stop();

    /// SIGHUP: applies the tokens (auth.tokens, every tokenFile read again) and the TLS
    /// material (tls, routing.peerTls: certificates, keys and CAs read again) of `next`, the
    /// config file read again. New connections get the new material; open connections stay,
    /// except those whose token is no longer accepted (or whose name, role or tenants
    /// changed): they are closed with 1008 at once. Any other difference is logged as not
    /// applied. When `next` is invalid or a file cannot be used, nothing changes, the reason
    /// is logged, and it returns false. Thread-safe; does not block on I/O beyond reading
    /// the files.
    bool reload(const Config& next);

    /// Calls `fn` every `interval` (> 0) on the daemon's io_context, from now until stop()
    /// completes: while the I/O threads are wedged, no call is made (the systemd watchdog
    /// relies on it). `fn` must not block. Call before run().
    void on_tick(std::chrono::milliseconds interval, std::function<void()> fn);

    /// One line for systemd's STATUS=: "<N> channels, <M> leases, serving" (or "fenced",
    /// "draining"); the lease count is this node's active leases as last read from the
    /// registry (a call starts a new reading in the background when the last is over 10 s
    /// old, shared with /metrics). Thread-safe; does not block.
    std::string status() const;

    /// The plainListen address once bound ("" without one).
    const std::string& plain_address() const noexcept;

    const std::string& node_id() const noexcept;
    /// The bearer token made for a config without tokens (<stateDir>/admin.token), or "".
    const std::string& generated_token_path() const noexcept;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace sandboxd
