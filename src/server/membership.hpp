#pragma once
// A node's membership in the cluster (docs/protocol.md section 6, docs/architecture.md):
// registering at start (taking over the record of a dead predecessor), the heartbeat that
// renews it, fencing (the node stops opening channels and changing leases when a renewal is
// late), rejoining after a lost membership, the lease change feed and the sweeper's timer.
//
// Threading: every coroutine runs on the node's io_context (`ioc`), never on a connection's
// loop. cancel() may be called from any thread that the io_context runs on (Daemon's stop).
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <atomic>
#include <cstdint>

namespace sandboxd {

class Membership {
public:
    Membership(Node& node, net::io_context& ioc) : node_(node), ioc_(ioc) {}
    Membership(const Membership&) = delete;
    Membership& operator=(const Membership&) = delete;

    /// Registers `record` (register_or_take_over), retried with backoff while the registry is
    /// unreachable, for at most registry.startupTimeoutMs; every failed attempt is logged and
    /// kept as node.startup_problem. Throws the last error when the time runs out, and at once
    /// for anything but REGISTRY_UNAVAILABLE (a live node with the same id). Returns the
    /// steady-clock time the registration that succeeded was sent (the first renewal).
    awaitable<std::int64_t> register_at_start(NodeRecord record);
    /// Starts the change feed, the heartbeat, the sweeper and the fencing watch (once, after
    /// the registration).
    void start();
    /// Stops the timers of the loops (the node is stopping): they end at their next turn.
    void cancel();
    /// Whether the registry answers now (GET /readyz).
    awaitable<bool> registry_reachable();

private:
    void start_lease_watch();
    awaitable<void> heartbeat_loop();
    /// Registers again after the record expired or was taken (the heartbeat said so).
    awaitable<void> register_again();
    awaitable<void> rejoin();
    awaitable<void> sweep_loop();
    /// Logs the moment this node fences itself (its membership not renewed within 2/3 of
    /// nodeTtlMs) and the moment it unfences, and keeps sandboxd_fenced.
    awaitable<void> fence_watch();

    Node& node_;
    net::io_context& ioc_;
    net::steady_timer heartbeat_timer_{ioc_};
    net::steady_timer sweep_timer_{ioc_};
    net::steady_timer fence_timer_{ioc_};
    /// Steady-clock time at which the last heartbeat that succeeded was sent.
    std::atomic<std::int64_t> beat_sent_ms_{0};
    /// A rejoin() runs: the node stays fenced until it ended what it lost.
    std::atomic<bool> rejoining_{false};
};

}  // namespace sandboxd
