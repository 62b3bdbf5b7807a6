#include "server/membership.hpp"

#include "server/lease_service.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>

namespace sandboxd {
namespace {

/// Registers this node. When the record belongs to another instance whose heartbeat is still
/// fresh, waits one liveness TTL: a live process keeps heartbeating (then this start is
/// refused), a dead one (e.g. killed with SIGKILL) does not, and its record is taken over.
/// Returns the steady-clock time (steady_now_ms) at which the registration that succeeded was
/// sent: the node's first renewal.
awaitable<std::int64_t> register_or_take_over(Registry& registry, NodeRecord record,
                                              std::int64_t ttl_ms, std::int64_t heartbeat_ms,
                                              std::string predecessor) {
    try {
        const auto sent = steady_now_ms();
        co_await registry.register_node(record, ttl_ms);
        co_return sent;
    } catch (const rpc_error& e) {
        if (e.code() != errc::invalid_params) throw;
    }
    const auto seen = co_await registry.get_node(record.node_id);
    if (seen && !predecessor.empty() && seen->instance_id == predecessor) {
        // The record is this state directory's previous process, which is gone (this one
        // holds the state's lock): taken over at once, its leases with it (issue 47).
        co_await registry.remove_node(record.node_id, seen->instance_id);
        const auto sent = steady_now_ms();
        co_await registry.register_node(record, ttl_ms);
        spdlog::info("node={} took over the record of its previous process (instance {})",
                     record.node_id, predecessor);
        co_return sent;
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(ttl_ms + heartbeat_ms);
    spdlog::info("node={} is held by another instance; waiting up to {} ms to see if it is alive",
                 record.node_id, ttl_ms + heartbeat_ms);
    net::steady_timer pause(co_await net::this_coro::executor);
    while (std::chrono::steady_clock::now() < deadline) {
        pause.expires_after(std::chrono::milliseconds(100));
        co_await pause.async_wait(use_awaitable);
        const auto now = co_await registry.get_node(record.node_id);
        if (seen && now && now->instance_id == seen->instance_id &&
            now->heartbeat_at_ms != seen->heartbeat_at_ms) {
            throw rpc_error(errc::invalid_params,
                            "node id " + record.node_id +
                                " is already held by a live process "
                                "(its heartbeat advanced); give this process another --node-id");
        }
        NodeRecord fresh = record;
        fresh.heartbeat_at_ms = now_ms();
        try {
            const auto sent = steady_now_ms();
            co_await registry.register_node(fresh, ttl_ms);
            co_return sent;
        } catch (const rpc_error& e) {
            if (e.code() != errc::invalid_params) throw;
        }
    }
    throw rpc_error(errc::invalid_params,
                    "node id " + record.node_id + " is still held by another process");
}

}  // namespace

awaitable<std::int64_t> Membership::register_at_start(NodeRecord record) {
    const auto& c = node_.config;
    const auto limit = std::chrono::milliseconds(c.registry.startup_timeout_ms);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    auto backoff = std::chrono::milliseconds(200);
    net::steady_timer pause(co_await net::this_coro::executor);
    for (int attempt = 1;; ++attempt) {
        std::string problem;
        try {
            record.heartbeat_at_ms = now_ms();
            const auto sent = co_await register_or_take_over(
                *node_.registry, record, c.node_ttl_ms, c.heartbeat_ms, node_.predecessor_instance);
            if (attempt > 1) {
                spdlog::info("node={} registered at attempt {}", node_.node_id, attempt);
            }
            co_return sent;
        } catch (const rpc_error& e) {
            if (e.code() != errc::registry_unavailable) throw;
            problem = e.what();
        }
        {
            std::lock_guard lock(node_.startup_mutex);
            node_.startup_problem = problem;
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            throw rpc_error(errc::registry_unavailable,
                            "register node: the registry could not be reached for " +
                                std::to_string(limit.count()) +
                                " ms (registry.startupTimeoutMs), " + std::to_string(attempt) +
                                " attempts; the last: " + problem);
        }
        const auto wait = std::min(backoff, left);
        spdlog::warn("node={} register attempt {} failed: {}; retrying in {} ms ({} ms left)",
                     node_.node_id, attempt, problem, wait.count(), left.count());
        pause.expires_after(wait);
        co_await pause.async_wait(use_awaitable);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
    }
}

void Membership::start() {
    start_lease_watch();
    net::co_spawn(ioc_, heartbeat_loop(), logged_as("daemon task"));
    net::co_spawn(ioc_, sweep_loop(), logged_as("daemon task"));
    net::co_spawn(ioc_, fence_watch(), logged_as("daemon task"));
}

void Membership::cancel() {
    heartbeat_timer_.cancel();
    sweep_timer_.cancel();
    fence_timer_.cancel();
}

awaitable<bool> Membership::registry_reachable() {
    try {
        co_await node_.registry->get_node(node_.node_id);
        co_return true;
    } catch (const std::exception&) {
        co_return false;
    }
}

void Membership::start_lease_watch() {
    // Events arrive on an I/O thread; only those that concern this node's cache or channels
    // start a reconciliation.
    auto on_change = [this](const Lease& lease) {
        if (!needs_reconcile(node_, lease)) return;
        net::co_spawn(ioc_, reconcile_lease(node_, lease), net::detached);
    };
    // The feed (re)started at the registry's current revision (at start, after a compaction):
    // what changed before is not delivered, so every cached lease is checked against its
    // record. At start the cache is empty (a fresh process holds no sandbox).
    // A registry that fails meanwhile leaves it to the sweeper's next pass.
    auto on_resync = [this] {
        net::co_spawn(
            ioc_,
            [this]() -> awaitable<void> {
                try {
                    co_await reconcile_cached(node_);
                } catch (const std::exception& e) {
                    spdlog::warn(
                        "node={} change feed resync: could not reconcile its sandboxes: {}",
                        node_.node_id, e.what());
                }
            },
            net::detached);
    };
    node_.lease_watch = node_.registry->watch_leases(
        ioc_.get_executor(), std::move(on_change), std::move(on_resync),
        std::max<std::int64_t>(node_.config.heartbeat_ms / 2, 100));
}

awaitable<void> Membership::heartbeat_loop() {
    // Renews this node's membership every heartbeatMs. `renewed_at_ms` is the time a renewal
    // that succeeded was sent: the node fences itself (Node::require_membership) when it is
    // older than 2/3 of nodeTtlMs. The membership lane: this loop awaits only the registry's
    // membership calls (registry.hpp), never lease work or a provider, so no backlog there
    // can delay a renewal. Ending what the node lost runs beside it, in rejoin().
    for (;;) {
        heartbeat_timer_.expires_after(std::chrono::milliseconds(node_.config.heartbeat_ms));
        auto [ec] = co_await heartbeat_timer_.async_wait(as_tuple_awaitable);
        if (ec || node_.stopping) co_return;
        const auto sent = steady_now_ms();
        const auto fenced = node_.fenced_for_ms();
        try {
            bool mine =
                co_await node_.registry->heartbeat_node(node_.node_id, node_.instance_id, now_ms());
            if (const auto took = steady_now_ms() - sent; took > node_.config.heartbeat_ms) {
                // A renewal that takes longer than the period eats into the fencing margin
                // (2/3 of nodeTtlMs): said, so that a slow registry shows in the log.
                spdlog::warn("node={} heartbeat took {} ms (heartbeatMs {})", node_.node_id, took,
                             node_.config.heartbeat_ms);
            }
            if (!mine) co_await register_again();
            beat_sent_ms_.store(sent, std::memory_order_release);
            if (!mine || fenced != 0 || rejoining_.load()) {
                node_.membership_breaks.fetch_add(1, std::memory_order_acq_rel);
                if (!rejoining_.exchange(true)) net::co_spawn(ioc_, rejoin(), net::detached);
            } else {
                node_.renewed_at_ms.store(sent, std::memory_order_release);
            }
        } catch (const std::exception& e) {
            spdlog::warn("node={} heartbeat failed: {}", node_.node_id, e.what());
        }
    }
}

awaitable<void> Membership::register_again() {
    // The record expired (the process was stopped, or the registry unreachable, past the
    // TTL) or another process took the node id. Other nodes may have orphaned this node's
    // leases meanwhile: register again, end what it lost, and only then serve again.
    spdlog::warn("node={} lost its membership (not renewed for {} ms); registering again",
                 node_.node_id, steady_now_ms() - node_.renewed_at_ms.load());
    NodeRecord record;
    record.node_id = node_.node_id;
    record.url = node_.advertise_url;
    record.started_at_ms = node_.started_at_ms;
    record.heartbeat_at_ms = now_ms();
    record.instance_id = node_.instance_id;
    co_await node_.registry->register_node(record, node_.config.node_ttl_ms);
    spdlog::info("node={} registered again", node_.node_id);
}

awaitable<void> Membership::rejoin() {
    // Ends the channels and sandboxes of leases this node lost while fenced, then lets it
    // serve again from the last renewal that succeeded (the heartbeat loop keeps renewing).
    const auto since = steady_now_ms() - node_.renewed_at_ms.load();
    try {
        co_await reconcile_cached(node_);
        node_.renewed_at_ms.store(beat_sent_ms_.load(std::memory_order_acquire),
                                  std::memory_order_release);
        spdlog::info("node={} unfenced after {} ms", node_.node_id, since);
    } catch (const std::exception& e) {
        spdlog::warn("node={} could not reconcile its sandboxes: {}", node_.node_id, e.what());
    }
    rejoining_.store(false);
}

awaitable<void> Membership::sweep_loop() {
    for (;;) {
        sweep_timer_.expires_after(std::chrono::milliseconds(node_.config.heartbeat_ms));
        auto [ec] = co_await sweep_timer_.async_wait(as_tuple_awaitable);
        if (ec || node_.stopping) co_return;
        try {
            co_await sweep(node_);
        } catch (const std::exception& e) {
            spdlog::warn("node={} sweep failed: {}", node_.node_id, e.what());
        }
    }
}

awaitable<void> Membership::fence_watch() {
    bool fenced = false;
    for (;;) {
        const auto fenced_for = node_.fenced_for_ms();
        if ((fenced_for != 0) != fenced) {
            fenced = !fenced;
            node_.metrics.fenced.only().set(fenced ? 1 : 0);
            if (fenced) {
                spdlog::warn(
                    "node={} fenced: membership not renewed for {} ms (limit {} ms): no "
                    "opens and no lease changes until it renews",
                    node_.node_id, fenced_for, node_.config.node_ttl_ms * 2 / 3);
            } else {
                spdlog::info("node={} unfenced: membership renewed", node_.node_id);
            }
        }
        // Awake at the fencing deadline; while fenced, often enough to see the renewal.
        const auto wait =
            fenced ? std::int64_t{50}
                   : std::clamp<std::int64_t>(node_.fence_deadline_ms() - steady_now_ms() + 1, 1,
                                              static_cast<std::int64_t>(node_.config.heartbeat_ms));
        fence_timer_.expires_after(std::chrono::milliseconds(wait));
        auto [ec] = co_await fence_timer_.async_wait(as_tuple_awaitable);
        if (ec || node_.stopping) co_return;
    }
}

}  // namespace sandboxd
