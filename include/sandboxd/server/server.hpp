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
    void run();

    /// Begins a graceful stop from any thread or a signal handler's strand: no new
    /// connections, every channel hung up (SIGHUP, then SIGKILL after the grace), the node
    /// record removed. Idempotent; run() returns once done.
    void stop();

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
