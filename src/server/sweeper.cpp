#include "server/lease_ops.hpp"
#include "server/lease_service.hpp"

#include "server/channel.hpp"

#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

#include <set>

// The sweeper and reconciliation (lease_service.hpp: sweep, reconcile_lease,
// reconcile_cached, lease_orphan, destroy_unrecorded_sandboxes, destroy_leftover_sandboxes):
// what moves leases whose owner is gone, tears down pending_cleanup leases, and keeps this
// node's sandboxes and channels in line with the registry.
namespace sandboxd {

using json = nlohmann::json;
using lease_ops::all_leases;
using lease_ops::audit_lease;
using lease_ops::provider_of;
using lease_ops::teardown;

namespace {

/// The lease is this node's to serve: active, owned here, under the epoch it was claimed with.
bool held_here(const Node& node, const Lease& lease) {
    if (lease.status != lease_status::active || lease.owner_node_id != node.node_id) return false;
    auto claimed = node.claim_of(lease.id);
    return !claimed || *claimed == lease.epoch;
}

}  // namespace

bool needs_reconcile(const Node& node, const Lease& lease) {
    if (held_here(node, lease)) return false;
    return node.cache.find(scope_of(lease)) != nullptr || !node.channels.of_lease(lease.id).empty();
}

awaitable<void> reconcile_lease(Node& node, Lease lease) {
    if (!needs_reconcile(node, lease)) co_return;
    spdlog::info("lease={} is {} on node {} (epoch {}): ending its channels here", lease.id,
                 to_string(lease.status), lease.owner_node_id, lease.epoch);
    co_await end_lease_channels(node, lease.id, std::chrono::milliseconds(3000));
    if (lease.owner_node_id == node.node_id && lease.status == lease_status::pending_cleanup) {
        co_return;  // the sweeper tears it down, counting attempts
    }
    // Released, expired, failed, or another node's now: nothing will ask this node to tear
    // its sandbox down, so it does so itself, once.
    const auto scope = scope_of(lease);
    auto handle = node.cache.try_begin_teardown(scope);
    if (!handle) co_return;
    Provider* provider = provider_of(node, lease.provider);
    try {
        if (provider) {
            co_await provider->destroy(handle);
        }
        spdlog::info("lease={} evicted from the cache of node {}", lease.id, node.node_id);
    } catch (const std::exception& e) {
        spdlog::warn("lease={} evicted; destroying its sandbox failed: {}", lease.id, e.what());
    }
    node.cache.erase(scope);
    node.unclaim(lease.id);
}

awaitable<void> reconcile_cached(Node& node) {
    for (const auto& handle : node.cache.snapshot()) {
        auto lease = co_await node.registry->get_lease(handle->lease_id);
        if (lease && lease->provider == handle->scope.provider &&
            lease->provider_lease_id == handle->scope.provider_lease_id) {
            co_await reconcile_lease(node, std::move(*lease));
        }
    }
}

awaitable<Lease> lease_orphan(Node& node, Lease lease, std::string why, std::string actor,
                              std::optional<OwnerSeen> owner) {
    if (lease.status != lease_status::active) co_return lease;
    Lease next = lease;
    next.status = lease_status::pending_cleanup;
    next.epoch = lease.epoch + 1;
    next.cleanup_status = why;
    next.last_used_at_ms = now_ms();
    std::optional<Lease> stored;
    if (owner) {  // (no co_await inside ?: : GCC 12 miscompiles its temporaries)
        stored = co_await node.registry->update_lease_if_owner_unchanged(next, lease.epoch,
                                                                         std::move(owner->record));
    } else {
        stored = co_await node.registry->update_lease(next, lease.epoch);
    }
    if (stored) {
        spdlog::info("lease={} pending_cleanup: {}", lease.id, why);
        node.metrics.orphans_found.only().inc();
        audit_lease(node, "lease.orphaned", *stored, actor);
        co_return *stored;
    }
    auto current = co_await node.registry->get_lease(lease.id);
    co_return current ? *current : next;
}

namespace {

/// Every lease of `owner_node_id` with `status` (by the owner index).
awaitable<std::vector<Lease>> leases_of(Node& node, std::string owner_node_id,
                                        lease_status status) {
    LeaseQuery q;
    q.owner_node_id = std::move(owner_node_id);
    q.status = status;
    co_return co_await all_leases(node, std::move(q));
}

constexpr int max_cleanup_attempts = 5;

/// A sandbox that a provider keeps on this node's disk.
struct StoredSandbox {
    std::string provider_key;
    Provider* provider;
    std::string provider_lease_id;
};

/// Every sandbox on this node's disk, of every provider (listed off this thread).
awaitable<std::vector<StoredSandbox>> stored_sandboxes(Node& node) {
    std::vector<StoredSandbox> stored;
    for (const auto& [key, provider] : node.providers) {
        auto ids = co_await provider->stored_sandboxes();
        for (auto& id : ids) stored.push_back({key, provider.get(), std::move(id)});
    }
    co_return stored;
}

}  // namespace

awaitable<std::size_t> destroy_unrecorded_sandboxes(Node& node) {
    std::set<std::pair<std::string, std::string>> recorded;  // provider key, providerLeaseId
    for (const auto status : {lease_status::active, lease_status::pending_cleanup,
                              lease_status::retained, lease_status::failed}) {
        for (const auto& lease : co_await leases_of(node, node.node_id, status)) {
            recorded.emplace(lease.provider, lease.provider_lease_id);
        }
    }
    std::size_t destroyed = 0;
    const auto stored = co_await stored_sandboxes(node);
    for (const auto& [key, provider, id] : stored) {
        if (recorded.contains({key, id})) continue;
        // The listings skip a lease whose record cannot be read: if one such lease names this
        // sandbox, keep it (fail closed; its calls answer REGISTRY_UNAVAILABLE).
        bool unreadable = false;
        try {
            (void)co_await node.registry->find_by_provider_lease(key, id);
        } catch (const rpc_error& e) {
            if (e.code() != errc::registry_unavailable || !e.data().contains("leaseId")) throw;
            unreadable = true;
        }
        if (unreadable) {
            spdlog::warn("sandbox {} of provider={}: its lease's record cannot be read; kept", id,
                         key);
            continue;
        }
        Lease orphan;
        orphan.id = "(none)";
        orphan.provider = key;
        orphan.provider_lease_id = id;
        orphan.owner_node_id = node.node_id;
        auto handle = provider->handle_for_teardown(orphan);
        if (!handle) continue;
        try {
            co_await provider->destroy(handle);
            ++destroyed;
            spdlog::warn(
                "sandbox {} of provider={}: no lease records it (an earlier process "
                "was killed before storing its lease); destroyed",
                id, key);
        } catch (const std::exception& e) {
            spdlog::warn(
                "sandbox {} of provider={}: no lease records it; destroying it "
                "failed (retried at the next start): {}",
                id, key, e.what());
        }
    }
    co_return destroyed;
}

awaitable<std::size_t> adopt_own_sandboxes(Node& node) {
    std::size_t adopted = 0;
    std::size_t lost = 0;
    for (auto& lease : co_await leases_of(node, node.node_id, lease_status::active)) {
        Provider* provider = provider_of(node, lease.provider);
        if (provider == nullptr || !provider->outlives_daemon()) continue;
        if (node.cache.holds(scope_of(lease))) continue;
        const std::string id = lease.id;
        try {
            co_await sandbox_for(node, std::move(lease), sandbox_use::release);
            ++adopted;
        } catch (const std::exception& e) {
            ++lost;  // orphaned by sandbox_for (pending_cleanup), unless not ready
            spdlog::warn("lease={}: its sandbox was not re-adopted: {}", id, e.what());
        }
    }
    if (adopted + lost > 0) {
        spdlog::info("node={} re-adopted {} sandbox(es) of an earlier process; {} could not be",
                     node.node_id, adopted, lost);
    }
    co_return adopted;
}

awaitable<std::size_t> release_own_leases(Node& node, std::string actor) {
    std::size_t released = 0;
    for (const auto status :
         {lease_status::active, lease_status::retained, lease_status::pending_cleanup}) {
        for (auto& lease : co_await leases_of(node, node.node_id, status)) {
            const std::string id = lease.id;
            try {
                const auto after =
                    co_await teardown(node, std::move(lease), lease_status::released, actor);
                if (after.status == lease_status::released) ++released;
            } catch (const std::exception& e) {
                spdlog::warn("lease={}: its release at decommission failed: {}", id, e.what());
            }
        }
    }
    co_return released;
}

awaitable<std::size_t> destroy_leftover_sandboxes(Node& node) {
    std::set<std::pair<std::string, std::string>> cached;  // provider key, providerLeaseId
    for (const auto& handle : node.cache.snapshot()) {
        cached.emplace(handle->scope.provider, handle->scope.provider_lease_id);
    }
    std::size_t destroyed = 0;
    const auto stored = co_await stored_sandboxes(node);
    for (const auto& [key, provider, id] : stored) {
        if (cached.contains({key, id})) continue;
        // Read after the listing: a sandbox being created now has no record yet (skipped),
        // and a record that says released or expired never becomes active again.
        auto lease = co_await node.registry->find_by_provider_lease(key, id);
        // Whichever node recorded the end (a retained lease is released from its record,
        // by any node): the sandbox on this disk is nobody's any more.
        if (!lease ||
            (lease->status != lease_status::released && lease->status != lease_status::expired)) {
            continue;
        }
        if (node.cache.holds(scope_of(*lease))) continue;  // cached since the snapshot
        auto handle = provider->handle_for_teardown(*lease);
        if (!handle) continue;
        const auto held = co_await provider->describe_stored(id);
        spdlog::warn(
            "lease={} is {} but its sandbox {} of provider={} is still on node {}: "
            "destroying it ({})",
            lease->id, to_string(lease->status), id, key, node.node_id, held);
        try {
            co_await provider->destroy(handle);
            ++destroyed;
            node.metrics.teardowns.with({"leftover"}).inc();
        } catch (const std::exception& e) {
            spdlog::warn(
                "lease={}: destroying the leftover sandbox {} failed (retried at the "
                "next check): {}",
                lease->id, id, e.what());
        }
    }
    co_return destroyed;
}

awaitable<void> expire_leases(Node& node);

namespace {

/// Once this process has run for a liveness TTL: its own active leases that its cache does
/// not hold (a restart) go to pending_cleanup, except those its provider resumes on first use.
awaitable<void> orphan_unheld_own(Node& node) {
    // Sandboxes held here, including those tearing down (a slow release is not a lost one).
    std::set<std::string> held;
    for (const auto& handle : node.cache.snapshot()) held.insert(handle->lease_id);
    for (auto& lease : co_await leases_of(node, node.node_id, lease_status::active)) {
        Provider* provider = provider_of(node, lease.provider);
        if (provider && provider->can_resume()) continue;  // resumed on first use
        // Read again now: the snapshot may predate an acquire, and a release that began
        // since (its record still active) is held, not lost.
        if (!held.count(lease.id) && !node.cache.holds(scope_of(lease))) {
            co_await lease_orphan(node, std::move(lease),
                                  "owner node restarted without the sandbox", "sweeper");
        }
    }
}

/// The active leases of owners whose membership lapsed (by `nodes`, the membership records
/// read at `now`) go to pending_cleanup. False when this
/// node fenced itself meanwhile (the pass stops: no lease changes on stale membership).
awaitable<bool> orphan_dead_owners(Node& node, std::int64_t now, std::vector<NodeRecord> nodes) {
    // The owner's record as read (an empty one: none), when it is dead by it.
    auto dead = [&](const std::string& id) -> std::optional<OwnerSeen> {
        for (const auto& n : nodes) {
            if (n.node_id == id) {
                if (node.member_alive(n, now)) return std::nullopt;
                return OwnerSeen{n};
            }
        }
        return OwnerSeen{};
    };
    // Each orphaning is fenced by the owner's record as judged dead here: the list above may
    // be seconds old by the write. A node frozen (SIGSTOP, a stalled VM) after reading it, then
    // unfenced, must not orphan the leases of an owner that heartbeated meanwhile (a fault
    // trial caught that: a node resumed after 4 s orphaned a live owner's lease while it
    // opened a channel); the registry refuses the write when the record moved.
    for (const auto& owner : co_await node.registry->active_owner_nodes()) {
        if (owner == node.node_id) continue;
        auto seen = dead(owner);
        if (!seen) continue;
        // A dead owner's sandboxes of a provider that outlives its daemon (bwrap) wait
        // routing.adoptGraceMs more for its restart (issue 47), measured from its last
        // heartbeat; an owner with no record at all (removed: decommissioned, or stopped
        // without keeping) has none to wait for.
        const bool in_grace =
            seen->record &&
            now - seen->record->heartbeat_at_ms <
                static_cast<std::int64_t>(node.config.node_ttl_ms) + node.config.adopt_grace_ms;
        for (auto& lease : co_await leases_of(node, owner, lease_status::active)) {
            if (node.fenced_for_ms() != 0) co_return false;
            if (in_grace) {
                // By this node's provider of that key (nodes share their configuration).
                Provider* provider = provider_of(node, lease.provider);
                if (provider != nullptr ? provider->outlives_daemon() : lease.provider == "bwrap") {
                    continue;
                }
            }
            const auto epoch = lease.epoch;
            auto after = co_await lease_orphan(node, std::move(lease),
                                               "owner node " + owner + " is dead", "sweeper", seen);
            // Still active under the same epoch: the owner's record moved (it is alive).
            if (after.status == lease_status::active && after.epoch == epoch) break;
        }
    }
    co_return true;
}

/// A lease past its quick attempts whose provider retries slowly for ever (a plugin: a
/// remote sandbox may still exist): warned once, then torn down every slow_retry_ms.
awaitable<void> retry_slowly(Node& node, Lease lease, const CleanupPolicy& policy,
                             std::int64_t now) {
    if (lease.cleanup_attempts == policy.attempts &&
        lease.cleanup_status != std::optional<std::string>("slow retry")) {
        Lease next = lease;
        next.epoch = lease.epoch + 1;
        next.cleanup_status = "slow retry";
        if (co_await node.registry->update_lease(next, lease.epoch)) {
            spdlog::warn(
                "lease={} teardown failed {} times ({}); retrying every {} ms until it succeeds",
                lease.id, lease.cleanup_attempts, lease.failure_reason.value_or("unknown"),
                policy.slow_retry_ms);
        }
        co_return;
    }
    if (now - lease.last_used_at_ms < policy.slow_retry_ms) co_return;
    co_await teardown(node, std::move(lease), lease_status::released, "sweeper");
}

/// A lease past its attempts whose provider gives up (built-in providers): `failed`.
awaitable<void> give_up(Node& node, const Lease& lease) {
    Lease next = lease;
    next.status = lease_status::failed;
    next.epoch = lease.epoch + 1;
    next.failure_reason = "teardown failed " + std::to_string(lease.cleanup_attempts) +
                          " times: " + lease.failure_reason.value_or("unknown");
    if (co_await node.registry->update_lease(next, lease.epoch)) {
        // Nothing will tear it down again: forget the handle and the claim, so the cache
        // holds live sandboxes only (the operator finds the lease `failed`).
        node.cache.erase(scope_of(lease));
        node.unclaim(lease.id);
        node.metrics.teardowns.with({"given_up"}).inc();
        spdlog::warn("lease={} failed: {}", lease.id, *next.failure_reason);
    }
}

/// This node's pending_cleanup leases (only the owner holds their sandboxes), torn down as
/// their provider's CleanupPolicy says: quick attempts backing off, then failed or slowly.
awaitable<void> clean_pending(Node& node, std::int64_t now) {
    for (auto& lease : co_await leases_of(node, node.node_id, lease_status::pending_cleanup)) {
        Provider* provider = provider_of(node, lease.provider);
        const auto heartbeat = static_cast<std::int64_t>(node.config.heartbeat_ms);
        const CleanupPolicy policy = provider ? provider->cleanup_policy(heartbeat)
                                              : CleanupPolicy{max_cleanup_attempts, heartbeat, 0};
        if (lease.cleanup_attempts >= policy.attempts && policy.slow_retry_ms > 0) {
            co_await retry_slowly(node, std::move(lease), policy, now);
            continue;
        }
        if (lease.cleanup_attempts >= policy.attempts) {
            co_await give_up(node, lease);
            continue;
        }
        const std::int64_t backoff = lease.cleanup_attempts == 0
                                         ? 0
                                         : policy.backoff_ms
                                               << std::min(lease.cleanup_attempts - 1, 20);
        const std::int64_t wait =
            policy.slow_retry_ms > 0 ? std::min(backoff, policy.slow_retry_ms) : backoff;
        if (lease.cleanup_attempts > 0 && now - lease.last_used_at_ms < wait) continue;
        co_await teardown(node, std::move(lease), lease_status::released, "sweeper");
    }
}

}  // namespace

awaitable<void> sweep(Node& node) {
    if (node.fenced_for_ms() != 0) co_return;  // no lease changes on stale membership
    co_await reconcile_cached(node);
    co_await expire_leases(node);
    const auto now = now_ms();
    auto nodes = co_await node.registry->list_nodes();
    // Scale: only this node's leases, and those of owners whose membership lapsed; the
    // active leases of live owners are never read (owners come from an index).
    if (now - node.started_at_ms >= node.config.node_ttl_ms) co_await orphan_unheld_own(node);
    if (!co_await orphan_dead_owners(node, now, std::move(nodes))) co_return;
    co_await clean_pending(node, now);
    if (const auto at = now_ms(); at - node.leftovers_checked_at_ms >= node.config.node_ttl_ms) {
        node.leftovers_checked_at_ms = at;
        co_await destroy_leftover_sandboxes(node);
    }
    node.metrics.sweeper_passes.only().inc();
}

awaitable<void> expire_leases(Node& node) {
    auto expired = co_await node.registry->expired_leases(node.node_id, now_ms());
    for (auto& lease : expired) {
        spdlog::info("lease={} expired", lease.id);
        audit_lease(node, "lease.expired", lease, "sweeper");
        co_await teardown(node, std::move(lease), lease_status::expired, "sweeper");
    }
    // Retained leases that no reuse came for within limits.retainedTtlMs (by the owner index).
    const auto now = now_ms();
    for (auto& lease : co_await leases_of(node, node.node_id, lease_status::retained)) {
        if (!lease.expires_at_ms || *lease.expires_at_ms > now) continue;
        spdlog::info("lease={} retained and not reused: expired", lease.id);
        audit_lease(node, "lease.expired", lease, "sweeper");
        co_await teardown(node, std::move(lease), lease_status::expired, "sweeper");
    }
}

}  // namespace sandboxd
