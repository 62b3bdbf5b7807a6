#include "server/lease_service.hpp"

#include "server/channel.hpp"
#include "server/channel_service.hpp"
#include "server/lease_ops.hpp"
#include "server/params.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <spdlog/spdlog.h>

#include <sys/random.h>

#include <set>

namespace sandboxd {
namespace {

using json = nlohmann::json;

[[noreturn]] void not_found(const std::string& id) {
    throw rpc_error(errc::lease_not_found, "Sandbox lease " + id + " was not found.",
                    {{"leaseId", id}});
}

/// The lease if it exists and the caller may see it; LEASE_NOT_FOUND otherwise (another
/// tenant's lease is reported exactly like a missing one).
awaitable<Lease> load_visible(Node& node, const Principal& who, std::string id) {
    auto lease = co_await node.registry->get_lease(id);
    if (!lease || !who.allows(lease->company_id)) not_found(id);
    co_return *lease;
}

/// A plugin whose worker is not up cannot say what it serves: PROVIDER_NOT_READY (retry)
/// rather than a refusal.
void not_ready_to_say(const Provider& provider) {
    if (provider.ready()) return;
    throw rpc_error(
        errc::provider_not_ready,
        "provider \"" + provider.key() + "\" is not ready: its worker is down or starting");
}

/// The lease as the registry holds it now (after a write that lost to another writer).
awaitable<Lease> current_record(Node& node, const std::string& id) {
    auto current = co_await node.registry->get_lease(id);
    if (!current) not_found(id);
    co_return *current;
}

}  // namespace

namespace lease_ops {

Provider* provider_of(Node& node, const std::string& key) {
    auto it = node.providers.find(key);
    return it == node.providers.end() ? nullptr : it->second.get();
}

/// Appends a lease.* line to the audit trail (when one is configured).
void audit_lease(Node& node, std::string_view event, const Lease& lease, std::string_view actor) {
    if (!node.audit) return;
    node.audit->write(event, {{"lease", lease.id},
                              {"tenant", lease.company_id},
                              {"environment", lease.environment_id},
                              {"provider", lease.provider},
                              {"status", std::string(to_string(lease.status))},
                              {"epoch", lease.epoch},
                              {"actor", actor}});
}

/// Every lease that `q` matches, all pages.
awaitable<std::vector<Lease>> all_leases(Node& node, LeaseQuery q) {
    std::vector<Lease> out;
    q.limit = 1000;
    for (;;) {
        auto page = co_await node.registry->list_leases(q);
        for (auto& l : page.leases) out.push_back(std::move(l));
        if (page.next_cursor.empty()) break;
        q.cursor = page.next_cursor;
    }
    co_return out;
}

/// Tears the sandbox down and records the outcome: released (or `final_status`), or
/// pending_cleanup with the failure. Returns the stored lease.
awaitable<Lease> teardown(Node& node, Lease lease, lease_status final_status, std::string actor) {
    // One teardown of a lease at a time here (a release racing the sweeper's pass over a
    // lease pending cleanup): the later one finds the record changed and does not destroy
    // again (issue 15, item 2: no double teardown).
    const auto turn = co_await node.teardown_locks.lock(lease.id);
    if (turn.waited) {
        auto current = co_await node.registry->get_lease(lease.id);
        if (!current) not_found(lease.id);
        if (current->epoch != lease.epoch) co_return *current;
    }
    auto scope = scope_of(lease);
    auto handle = node.cache.begin_teardown(scope);
    co_await end_lease_channels(node, lease.id, std::chrono::milliseconds(3000));
    forget_detached_channels(node, lease.id);  // their exits and output end with the lease
    Provider* provider = provider_of(node, lease.provider);
    if (!handle && provider) handle = provider->handle_for_teardown(lease);
    std::optional<std::string> failure;
    bool transient = false;  // a plugin worker that is down: no retry attempt is spent
    if (!provider) {
        failure = "no provider \"" + lease.provider + "\" on node " + node.node_id;
    } else if (!handle) {
        failure = "provider \"" + lease.provider + "\" cannot tear down an uncached sandbox";
    } else {
        try {
            co_await provider->destroy(handle);
        } catch (const rpc_error& e) {
            failure = e.what();
            transient = e.code() == errc::provider_not_ready;
        } catch (const std::exception& e) {
            failure = e.what();
        }
    }
    Lease next = lease;
    const auto now = now_ms();
    next.epoch = lease.epoch + 1;
    next.last_used_at_ms = now;
    node.metrics.teardowns.with({failure ? "failed" : "done"}).inc();
    if (failure) {
        spdlog::warn("lease={} teardown failed: {}", lease.id, *failure);
        next.status = lease_status::pending_cleanup;
        next.failure_reason = *failure;
        next.cleanup_status = "teardown failed";
        next.cleanup_attempts = lease.cleanup_attempts + (transient ? 0 : 1);
    } else {
        next.status = final_status;
        next.released_at_ms = now;
        next.cleanup_status = "destroyed";
    }
    auto stored = co_await node.registry->update_lease(next, lease.epoch);
    if (!failure) {
        // Forgotten only once the record says so: until then the lease is active in the
        // registry, and a sandbox missing from the cache would look lost to the sweeper.
        node.cache.erase(scope);
        node.unclaim(lease.id);
    }
    if (!stored) co_return co_await current_record(node, lease.id);
    spdlog::info("lease={} {} node={}", lease.id, to_string(stored->status), node.node_id);
    if (!failure) audit_lease(node, "lease.torn_down", *stored, actor);
    co_return *stored;
}

}  // namespace lease_ops

using lease_ops::all_leases;
using lease_ops::audit_lease;
using lease_ops::provider_of;
using lease_ops::teardown;

namespace {

bool is_reuse(const std::string& policy) {
    return policy == "reuse_by_environment" || policy == "reuse_by_execution_workspace";
}

/// Every lease of (company, environment) with `status`.
awaitable<std::vector<Lease>> leases_in(Node& node, std::string company_id,
                                        std::string environment_id, lease_status status) {
    LeaseQuery q;
    q.company_id = std::move(company_id);
    q.environment_id = std::move(environment_id);
    q.status = status;
    co_return co_await all_leases(node, std::move(q));
}

/// Whether `candidate` may be reused for `wanted` under wanted's policy: the same tenant
/// scope, provider, policy, config and (reuse_by_execution_workspace) execution workspace.
bool reusable_for(const Lease& candidate, const Lease& wanted) {
    return candidate.company_id == wanted.company_id &&
           candidate.environment_id == wanted.environment_id &&
           candidate.provider == wanted.provider && candidate.lease_policy == wanted.lease_policy &&
           candidate.config == wanted.config &&
           (wanted.lease_policy != "reuse_by_execution_workspace" ||
            candidate.execution_workspace_id == wanted.execution_workspace_id);
}

/// Brings a retained lease back on this node: the provider resumes its sandbox, and the lease
/// becomes active here (owner this node, a new epoch). nullopt when it cannot be resumed (it
/// is then torn down) or another node changed it first and it is not active.
awaitable<std::optional<Lease>> resume_retained(Node& node, Provider& provider, Lease lease,
                                                std::uint64_t ttl_ms) {
    std::shared_ptr<SandboxHandle> handle;
    std::string failure;
    try {
        handle = co_await provider.resume(lease);
    } catch (const rpc_error& e) {
        if (e.code() == errc::provider_not_ready) throw;  // nothing changed: retry later
        failure = e.what();
    }
    if (!handle) {
        spdlog::warn("lease={} retained, but its sandbox cannot be resumed ({}): destroying it",
                     lease.id, failure);
        Lease mine = lease;
        mine.owner_node_id = node.node_id;  // this node's sweeper finishes a failed teardown
        (void)co_await teardown(node, std::move(mine), lease_status::released, "node");
        co_return std::nullopt;
    }
    const auto now = now_ms();
    Lease next = lease;
    next.status = lease_status::active;
    next.owner_node_id = node.node_id;
    next.epoch = lease.epoch + 1;
    next.last_used_at_ms = now;
    next.expires_at_ms = now + static_cast<std::int64_t>(ttl_ms);
    if (handle->expires_at_ms && *handle->expires_at_ms < *next.expires_at_ms) {
        next.expires_at_ms = handle->expires_at_ms;
    }
    next.released_at_ms = std::nullopt;
    next.cleanup_status = std::nullopt;
    next.provider_metadata = handle->provider_metadata;
    handle->lease_id = lease.id;
    node.cache.put(handle);  // held before the record says active (see make_lease)
    std::optional<Lease> stored;
    std::exception_ptr not_stored;
    try {
        stored = co_await node.registry->update_lease(next, lease.epoch);
    } catch (...) {
        not_stored = std::current_exception();
    }
    if (!stored) node.cache.erase(handle->scope);
    if (not_stored) std::rethrow_exception(not_stored);
    if (!stored) {
        // Another node resumed or released it first: its record decides. The sandbox this
        // node resumed is that same sandbox, so it is dropped, not destroyed.
        auto current = co_await node.registry->get_lease(lease.id);
        if (current && current->status == lease_status::active) co_return *current;
        co_return std::nullopt;
    }
    node.claim(stored->id, stored->epoch);
    spdlog::info("lease={} resumed from retained on node={}", stored->id, node.node_id);
    co_return *stored;
}

/// The lease a reuse policy gives `wanted`: an active one of its scope (renewed to the
/// acquire's TTL), else a retained one resumed (the most recently retained first); nullopt
/// when there is none.
awaitable<std::optional<Lease>> reuse_lease(Node& node, const Principal& who, Provider& provider,
                                            Lease wanted, std::uint64_t ttl_ms) {
    for (auto& l :
         co_await leases_in(node, wanted.company_id, wanted.environment_id, lease_status::active)) {
        if (!reusable_for(l, wanted) || !l.is_live(now_ms())) continue;
        try {
            Lease renewed = co_await lease_renew(node, who, l.id, ttl_ms);
            spdlog::info("lease={} reused ({})", renewed.id, wanted.lease_policy);
            co_return renewed;
        } catch (const rpc_error& e) {
            if (e.code() != errc::lease_not_active) throw;  // it ended meanwhile: next one
        }
    }
    auto retained =
        co_await leases_in(node, wanted.company_id, wanted.environment_id, lease_status::retained);
    std::erase_if(retained, [&wanted](const Lease& l) { return !reusable_for(l, wanted); });
    std::sort(retained.begin(), retained.end(),
              [](const Lease& a, const Lease& b) { return a.last_used_at_ms > b.last_used_at_ms; });
    for (auto& l : retained) {
        if (auto resumed = co_await resume_retained(node, provider, std::move(l), ttl_ms)) {
            co_return resumed;
        }
    }
    co_return std::nullopt;
}

/// A new sandbox and its lease record (leaseAcquire when nothing is reused).
awaitable<Lease> make_lease(Node& node, Provider* provider, Lease lease, std::uint64_t ttl) {
    lease.id = "lse_" + random_hex(12);
    lease.owner_node_id = node.node_id;
    lease.status = lease_status::active;
    lease.epoch = 1;
    lease.acquired_at_ms = lease.last_used_at_ms = now_ms();
    lease.expires_at_ms = lease.acquired_at_ms + static_cast<std::int64_t>(ttl);
    lease.metadata = {{"pluginId", provider->plugin_id()}, {"provider", provider->key()}};

    // providerLeaseId is minted by create(); expires_at_ms bounds the sandbox's own expiry.
    auto handle = co_await provider->create(lease);
    // After create(): a plugin provider knows its capabilities only once its worker is up
    // (its supportedMethods), and create() waits for the worker to come up.
    lease.capabilities = provider->capabilities();
    lease.provider_lease_id = handle->scope.provider_lease_id;
    lease.limits = handle->limits;
    lease.network = handle->network;
    lease.provider_metadata = handle->provider_metadata;
    if (handle->expires_at_ms && *handle->expires_at_ms < *lease.expires_at_ms) {
        lease.expires_at_ms = handle->expires_at_ms;  // the lease never outlives its sandbox
    }
    // Cached before the record exists: from the moment the registry holds the lease active,
    // the sweeper finds its sandbox held here (it orphans active leases whose sandbox this
    // node does not hold). reconcile_cached skips a cached sandbox with no record yet.
    node.cache.put(handle);
    Lease stored;
    std::exception_ptr not_stored;  // no co_await in a handler: the cleanup runs after it
    try {
        stored = co_await node.registry->create_lease(lease);
    } catch (...) {
        not_stored = std::current_exception();
    }
    if (not_stored) {
        node.cache.erase(handle->scope);
        try {
            co_await provider->destroy(handle);
        } catch (const std::exception& e) {
            spdlog::warn("lease={} not stored; destroying its sandbox failed too: {}", lease.id,
                         e.what());
        }
        std::rethrow_exception(not_stored);
    }
    if (stored.id != lease.id) {  // lost an idempotency race: keep the winner's lease
        node.cache.erase(handle->scope);
        co_await provider->destroy(handle);
        co_return stored;
    }
    node.claim(stored.id, stored.epoch);
    spdlog::info("lease={} acquired provider={} providerLeaseId={} company={} node={}", lease.id,
                 lease.provider, lease.provider_lease_id, lease.company_id, node.node_id);
    co_return stored;
}

}  // namespace

namespace {
awaitable<Lease> acquire(Node& node, const Principal& who, methods::LeaseAcquireParams p);
}  // namespace

awaitable<Lease> lease_acquire(Node& node, const Principal& who, methods::LeaseAcquireParams p) {
    Lease lease = co_await acquire(node, who, std::move(p));
    audit_lease(node, "lease.acquired", lease, who.name);
    co_return lease;
}

namespace {
awaitable<Lease> acquire(Node& node, const Principal& who, methods::LeaseAcquireParams p) {
    Lease lease;
    lease.company_id = std::move(p.company_id);
    lease.environment_id = std::move(p.environment_id);
    lease.provider = std::move(p.provider);
    lease.run_id = std::move(p.run_id);
    lease.issue_id = std::move(p.issue_id);
    lease.heartbeat_run_id = std::move(p.heartbeat_run_id);
    lease.execution_workspace_id = std::move(p.execution_workspace_id);
    lease.agent_id = std::move(p.agent_id);
    lease.host_metadata = std::move(p.host_metadata);
    lease.idempotency_key = std::move(p.idempotency_key);
    lease.config = std::move(p.config);
    const auto ttl = p.ttl_ms.value_or(node.config.limits.default_ttl_ms);
    if (!who.allows(lease.company_id)) {
        params::invalid("companyId",
                        "this token may not act for tenant \"" + lease.company_id + "\"");
    }
    if (node.draining) {
        throw rpc_error(errc::owner_unavailable,
                        "node " + node.node_id + " is draining: it takes no new leases",
                        {{"nodeId", node.node_id}, {"draining", true}});
    }
    node.require_membership();
    Provider* provider = provider_of(node, lease.provider);
    if (!provider)
        params::invalid("provider", "no provider \"" + lease.provider + "\" on this node");

    if (lease.idempotency_key) {
        auto existing = co_await node.registry->find_by_idempotency_key(
            lease.company_id, lease.environment_id, *lease.idempotency_key);
        if (existing) co_return *existing;
    }

    lease.lease_policy = std::move(p.lease_policy);
    if (lease.lease_policy != "ephemeral" && !provider->can_retain()) {
        not_ready_to_say(*provider);
        params::invalid("leasePolicy",
                        "provider \"" + lease.provider +
                            "\" accepts only \"ephemeral\": it cannot keep a sandbox for a "
                            "reuse (leaseRelease disposition \"retain\")");
    }
    if (!is_reuse(lease.lease_policy)) {
        co_return co_await make_lease(node, provider, std::move(lease), ttl);
    }
    // One reuse of a scope at a time on this node, so that two acquires do not both make one.
    std::string key = lease.company_id + '\n' + lease.environment_id + '\n' + lease.provider +
                      '\n' + lease.lease_policy + '\n' + lease.execution_workspace_id.value_or("");
    auto held = co_await node.reuse_locks.lock(std::move(key));
    if (auto reused = co_await reuse_lease(node, who, *provider, lease, ttl)) co_return *reused;
    co_return co_await make_lease(node, provider, std::move(lease), ttl);
}
}  // namespace

awaitable<Lease> lease_get(Node& node, const Principal& who, std::string lease_id) {
    co_return co_await load_visible(node, who, lease_id);
}

void attach_usage(Node& node, Lease& lease) {
    if (lease.owner_node_id != node.node_id || lease.status != lease_status::active) return;
    Provider* provider = provider_of(node, lease.provider);
    auto handle = provider ? node.cache.find(scope_of(lease)) : nullptr;
    if (handle) lease.usage = provider->usage(*handle);
}

awaitable<json> lease_list(Node& node, const Principal& who, LeaseQuery q) {
    q.tenants = who.query_tenants();
    // No tenant at all (a peer token's tenants and the forwarded ones have none in common):
    // nothing, never the whole registry that an empty filter would list.
    if (who.tenants.empty() || (q.company_id && !who.allows(*q.company_id))) {
        co_return json{{"leases", json::array()}, {"nextCursor", nullptr}};
    }
    auto page = co_await node.registry->list_leases(q);
    json leases = json::array();
    for (const auto& l : page.leases) leases.push_back(to_json(l));
    co_return json{
        {"leases", std::move(leases)},
        {"nextCursor", page.next_cursor.empty() ? json(nullptr) : json(page.next_cursor)}};
}

awaitable<Lease> lease_renew(Node& node, const Principal& who, std::string lease_id,
                             std::uint64_t ttl_ms) {
    if (ttl_ms > node.config.limits.max_ttl_ms) {
        params::invalid("ttlMs", "must be an integer in 1000.." +
                                     std::to_string(node.config.limits.max_ttl_ms));
    }
    node.require_membership();
    for (int attempt = 0; attempt < 5; ++attempt) {
        Lease lease = co_await load_visible(node, who, lease_id);
        const auto now = now_ms();
        if (!lease.is_live(now)) {
            throw rpc_error(
                errc::lease_not_active, lease_not_active_message(lease.id),
                {{"leaseId", lease.id}, {"status", std::string(to_string(lease.status))}});
        }
        Lease next = lease;
        next.expires_at_ms = now + static_cast<std::int64_t>(ttl_ms);
        // The lease never outlives its sandbox's own expiry (a plugin's expiresAt).
        if (auto handle = node.cache.find(scope_of(lease)); handle && handle->expires_at_ms) {
            next.expires_at_ms = std::min(*next.expires_at_ms, *handle->expires_at_ms);
        }
        next.last_used_at_ms = now;
        auto stored = co_await node.registry->update_lease(next, next.epoch);
        if (stored) {
            audit_lease(node, "lease.renewed", *stored, who.name);
            co_return *stored;
        }
    }
    throw rpc_error(errc::registry_unavailable,
                    "lease " + lease_id + " kept changing during renew");
}

namespace {

/// leaseRelease with disposition "retain" on the owner: the provider stops the sandbox and
/// keeps it, and the lease becomes `retained` (expiring after limits.retainedTtlMs). A
/// provider that cannot retain, or a stop that fails, changes nothing.
awaitable<Lease> retain_lease(Node& node, Lease lease) {
    Provider* provider = provider_of(node, lease.provider);
    if (!provider || !provider->can_retain()) {
        if (provider) not_ready_to_say(*provider);
        params::invalid("disposition", "provider \"" + lease.provider +
                                           "\" cannot retain a sandbox: it accepts only "
                                           "\"destroy\"");
    }
    auto handle = co_await sandbox_for(node, lease, sandbox_use::release);
    const auto scope = scope_of(lease);
    (void)node.cache.begin_teardown(scope);  // no new channel, and no reconcile destroys it
    co_await end_lease_channels(node, lease.id, std::chrono::milliseconds(3000));
    std::exception_ptr not_stopped;
    try {
        co_await provider->stop(handle);
    } catch (...) {
        not_stopped = std::current_exception();
    }
    if (not_stopped) {
        node.cache.erase(scope);  // still the lease's sandbox: served again
        node.cache.put(handle);
        std::rethrow_exception(not_stopped);
    }
    const auto now = now_ms();
    Lease next = lease;
    next.status = lease_status::retained;
    next.epoch = lease.epoch + 1;
    next.last_used_at_ms = now;
    next.expires_at_ms = now + static_cast<std::int64_t>(node.config.limits.retained_ttl_ms);
    next.cleanup_status = "stopped";
    auto stored = co_await node.registry->update_lease(next, lease.epoch);
    node.cache.erase(scope);
    node.unclaim(lease.id);
    if (!stored) co_return co_await current_record(node, lease.id);
    spdlog::info("lease={} retained node={}", lease.id, node.node_id);
    co_return *stored;
}

/// The disposition a release without one takes: the reuse policies keep their sandbox,
/// retain_on_failure keeps a failed run's, ephemeral leases are destroyed.
bool retains_by_default(const std::string& policy, bool failed) {
    return policy == "reuse_by_environment" || policy == "reuse_by_execution_workspace" ||
           (policy == "retain_on_failure" && failed);
}

}  // namespace

namespace {
awaitable<Lease> release(Node& node, const Principal& who, methods::LeaseReleaseParams p);
}  // namespace

awaitable<Lease> lease_release(Node& node, const Principal& who, methods::LeaseReleaseParams p) {
    Lease lease = co_await release(node, who, std::move(p));
    audit_lease(node, "lease.released", lease, who.name);
    co_return lease;
}

namespace {
awaitable<Lease> release(Node& node, const Principal& who, methods::LeaseReleaseParams p) {
    node.require_membership();
    Lease lease = co_await load_visible(node, who, p.lease_id);
    if (lease.status == lease_status::released || lease.status == lease_status::failed) {
        co_return lease;  // idempotent
    }
    const bool retain = p.disposition ? *p.disposition == "retain"
                                      : retains_by_default(lease.lease_policy, p.failed);
    if (lease.status == lease_status::retained) {
        if (retain) co_return lease;  // idempotent
        // No node holds a retained sandbox: this one destroys it from the lease's record.
        lease.owner_node_id = node.node_id;
        co_return co_await teardown(node, std::move(lease), lease_status::released, who.name);
    }
    if (retain && lease.status == lease_status::active) {
        co_return co_await retain_lease(node, std::move(lease));
    }
    if (retain) {
        params::invalid("disposition", "lease " + lease.id + " is " +
                                           std::string(to_string(lease.status)) +
                                           ": only an active lease can be retained");
    }
    co_return co_await teardown(node, std::move(lease), lease_status::released, who.name);
}
}  // namespace

namespace {

/// A live lease of the caller's that this node owns, its provider and its sandbox (resumed
/// when a plugin lost it): what leaseProbe, leaseExecute and leaseRealizeWorkspace act on.
struct LiveLease {
    Lease lease;
    Provider* provider = nullptr;
    std::shared_ptr<SandboxHandle> sandbox;
};

awaitable<LiveLease> live_lease(Node& node, const Principal& who, std::string lease_id) {
    LiveLease live;
    live.lease = co_await load_visible(node, who, lease_id);
    if (!live.lease.is_live(now_ms())) {
        throw rpc_error(
            errc::lease_not_active, lease_not_active_message(live.lease.id),
            {{"leaseId", live.lease.id}, {"status", std::string(to_string(live.lease.status))}});
    }
    live.provider = provider_of(node, live.lease.provider);
    if (!live.provider) {
        throw rpc_error(errc::provider_error,
                        "no provider \"" + live.lease.provider + "\" on node " + node.node_id);
    }
    live.sandbox = co_await sandbox_for(node, live.lease);
    co_return live;
}

}  // namespace

awaitable<Lease> lease_release(Node& node, const Principal& who, std::string lease_id) {
    methods::LeaseReleaseParams p;
    p.lease_id = std::move(lease_id);
    co_return co_await lease_release(node, who, std::move(p));
}

awaitable<json> lease_probe(Node& node, const Principal& who, std::string lease_id) {
    LiveLease live = co_await live_lease(node, who, std::move(lease_id));
    co_return co_await live.provider->probe(live.sandbox, live.lease);
}

awaitable<json> lease_execute(Node& node, const Principal& who, methods::ExecuteParams p,
                              ExecuteLog log) {
    LiveLease live = co_await live_lease(node, who, std::move(p.lease_id));
    const auto& limits = node.config.limits;
    // It is a command running in the sandbox: it counts against the node's channels.
    if (!node.channels.try_reserve(limits.channels_per_node)) {
        throw rpc_error(errc::channel_limit, "this node already runs its limit of " +
                                                 std::to_string(limits.channels_per_node) +
                                                 " channels");
    }
    const ScopeExit unreserve([&node] { node.channels.unreserve(); });
    p.request.drain_grace_ms = limits.drain_grace_ms;
    p.request.output_limit = limits.execute_output_bytes;
    spdlog::info("lease={} execute: {}", live.lease.id, p.request.argv.front());
    // As an open (Session): a start refused for its deadline is tried again with a renewed one
    // while the membership held without a break; nothing ran, so no log line was sent.
    const std::uint64_t breaks = node.membership_breaks.load(std::memory_order_acquire);
    for (int attempt = 1;; ++attempt) {
        ExecuteRequest request = p.request;
        const std::int64_t deadline = node.fence_deadline_ms();
        request.start_deadline_ms = deadline;
        try {
            co_return co_await live.provider->execute(live.sandbox, live.lease, std::move(request),
                                                      log);
        } catch (const start_deadline_passed&) {
            if (attempt >= 3 || !node.may_retry_start(deadline, breaks)) throw;
            spdlog::info(
                "lease={} execute: its start deadline passed in the sandbox's queue; again with "
                "the renewed one (attempt {})",
                live.lease.id, attempt + 1);
        }
    }
}

awaitable<Lease> lease_update_network(Node& node, const Principal& who,
                                      methods::LeaseUpdateNetworkParams p) {
    if (node.draining) {
        throw rpc_error(errc::owner_unavailable,
                        "node " + node.node_id + " is draining: it changes no lease's network",
                        {{"ownerNodeId", node.node_id}, {"draining", true}});
    }
    LiveLease live = co_await live_lease(node, who, p.lease_id);
    json applied =
        co_await live.provider->update_network(live.sandbox, live.lease, std::move(p.network));
    for (int attempt = 0; attempt < 5; ++attempt) {
        Lease lease = co_await load_visible(node, who, p.lease_id);
        Lease next = lease;
        next.network = applied;
        next.last_used_at_ms = now_ms();
        if (auto stored = co_await node.registry->update_lease(next, next.epoch)) {
            audit_lease(node, "lease.network_updated", *stored, who.name);
            spdlog::info("lease={} network: {}", stored->id, applied.dump());
            co_return *stored;
        }
    }
    throw rpc_error(errc::registry_unavailable,
                    "lease " + p.lease_id + " kept changing during leaseUpdateNetwork");
}

awaitable<json> lease_realize_workspace(Node& node, const Principal& who,
                                        methods::RealizeWorkspaceParams p) {
    LiveLease live = co_await live_lease(node, who, std::move(p.lease_id));
    co_return co_await live.provider->realize_workspace(live.sandbox, live.lease,
                                                        std::move(p.workspace));
}

awaitable<json> provider_validate_config(Node& node, const Principal& who,
                                         methods::ValidateConfigParams p) {
    (void)who;  // any host may ask: nothing is made, and no tenant's data is read
    Provider* provider = provider_of(node, p.provider);
    if (!provider) params::invalid("provider", "no provider \"" + p.provider + "\" on this node");
    co_return co_await provider->validate_config("", std::move(p.config));
}

json provider_list(const Node& node) {
    json out = json::array();
    for (const auto& [key, provider] : node.providers) {
        out.push_back({{"provider", key},
                       {"pluginId", provider->plugin_id()},
                       {"ready", provider->ready()},
                       {"capabilities", provider->capabilities()}});
    }
    return out;
}

awaitable<json> node_list(Node& node) {
    auto nodes = co_await node.registry->list_nodes();
    const auto now = now_ms();
    json out = json::array();
    for (const auto& n : nodes) {
        LeaseQuery q;
        q.owner_node_id = n.node_id;
        q.status = lease_status::active;
        q.limit = 1000;
        auto page = co_await node.registry->list_leases(q);
        const bool alive = node.member_alive(n, now);
        json entry = {
            {"nodeId", n.node_id},
            {"url", n.url},
            {"startedAt", format_rfc3339(n.started_at_ms)},
            {"heartbeatAt", format_rfc3339(n.heartbeat_at_ms)},
            {"alive", alive},
            {"leases", page.leases.size()},
            {"channels", n.node_id == node.node_id ? json(node.channels.size()) : json(nullptr)}};
        out.push_back(std::move(entry));
    }
    co_return json{{"nodes", std::move(out)}};
}

awaitable<Lease> resolve_lease(Node& node, const Principal& who, json lease_param) {
    co_return co_await resolve_lease(node, who, methods::parse_lease_ref(lease_param));
}

awaitable<Lease> resolve_lease(Node& node, const Principal& who, methods::LeaseRef ref) {
    // Step 2: the lease must name its plugin, provider and providerLeaseId, all strings,
    // before anything else is looked at (methods::parse_lease_ref kept what was wrong).
    if (ref.problem) std::rethrow_exception(ref.problem);
    const std::string& provider_key = ref.provider;
    const std::string& plugin_id = ref.plugin_id;
    const std::string& provider_lease_id = ref.provider_lease_id;
    const std::string& company = ref.company_id;
    const std::string& environment = ref.environment_id;
    const auto& lease_id = ref.id;
    const auto& epoch = ref.epoch;

    // Step 3: the registry's lease, in the caller's tenants, with the same scope.
    std::optional<Lease> lease;
    if (lease_id) {
        lease = co_await node.registry->get_lease(*lease_id);
    } else {
        // By index: (provider, providerLeaseId) names at most one lease in the registry.
        lease = co_await node.registry->find_by_provider_lease(provider_key, provider_lease_id);
    }
    const std::string shown_id = lease_id.value_or(provider_lease_id);
    if (!lease || !who.allows(lease->company_id) || lease->company_id != company ||
        lease->environment_id != environment || lease->provider != provider_key ||
        lease->provider_lease_id != provider_lease_id ||
        lease->metadata.value("pluginId", "") != plugin_id) {
        not_found(shown_id);
    }
    // Step 4: active, unexpired, and the epoch the caller holds.
    if (!lease->is_live(now_ms()) || (epoch && static_cast<std::int64_t>(*epoch) != lease->epoch)) {
        throw rpc_error(errc::lease_not_active, lease_not_active_message(lease->id),
                        {{"leaseId", lease->id},
                         {"status", std::string(to_string(lease->status))},
                         {"epoch", lease->epoch}});
    }
    co_return *lease;
}

std::shared_ptr<SandboxHandle> cached_sandbox(Node& node, const Lease& lease, sandbox_use use) {
    if (use == sandbox_use::new_work && node.draining) {
        throw rpc_error(errc::owner_unavailable,
                        "node " + node.node_id + " is draining: it opens no new channels",
                        {{"ownerNodeId", node.node_id}, {"draining", true}});
    }
    node.require_membership();
    // Step 6: the cache must resolve the full scope; never a re-create, never a bare id.
    auto sandbox = node.cache.find(scope_of(lease));
    if (!sandbox) {
        throw rpc_error(errc::sandbox_not_cached, std::string(sandbox_not_cached_message),
                        {{"leaseId", lease.id}});
    }
    // The fencing token: the lease must still carry the epoch this node created it under.
    if (auto claimed = node.claim_of(lease.id); claimed && *claimed != lease.epoch) {
        throw rpc_error(errc::lease_not_active, lease_not_active_message(lease.id),
                        {{"leaseId", lease.id},
                         {"status", std::string(to_string(lease.status))},
                         {"epoch", lease.epoch},
                         {"claimedEpoch", *claimed}});
    }
    return sandbox;
}

awaitable<std::shared_ptr<SandboxHandle>> sandbox_for(Node& node, Lease lease, sandbox_use use) {
    std::exception_ptr missing;
    try {
        co_return cached_sandbox(node, lease, use);
    } catch (const rpc_error& e) {
        if (e.code() != errc::sandbox_not_cached) throw;
        missing = std::current_exception();
    }
    Provider* provider = provider_of(node, lease.provider);
    if (!provider || !provider->can_resume() || lease.owner_node_id != node.node_id) {
        std::rethrow_exception(missing);
    }
    std::shared_ptr<SandboxHandle> handle;
    std::string failure;
    try {
        handle = co_await provider->resume(lease);
    } catch (const rpc_error& e) {
        if (e.code() == errc::provider_not_ready) throw;
        failure = e.what();
    } catch (const std::exception& e) {
        failure = e.what();
    }
    if (!handle) {
        co_await forget_unresumable(node, lease, "resume failed: " + failure);
        throw rpc_error(errc::sandbox_not_cached,
                        std::string(sandbox_not_cached_message) +
                            " (the provider could not "
                            "resume it: " +
                            failure + ")",
                        {{"leaseId", lease.id}});
    }
    if (handle->provider_metadata != lease.provider_metadata) {
        Lease next = lease;
        next.provider_metadata = handle->provider_metadata;
        next.last_used_at_ms = now_ms();
        if (auto stored = co_await node.registry->update_lease(next, lease.epoch)) lease = *stored;
    }
    node.cache.put(handle);
    node.claim(lease.id, lease.epoch);
    spdlog::info("lease={} resumed through provider={} on node={}", lease.id, lease.provider,
                 node.node_id);
    co_return handle;
}

awaitable<void> forget_unresumable(Node& node, Lease lease, std::string why) {
    node.cache.erase(scope_of(lease));
    node.unclaim(lease.id);
    co_await lease_orphan(node, std::move(lease), std::move(why), "node");
}

namespace {
awaitable<void> store_late_sandbox(Node& node, Lease lease) {
    Provider* provider = provider_of(node, lease.provider);
    if (!provider) co_return;
    if (lease.id.empty()) lease.id = "lse_" + random_hex(12);
    lease.owner_node_id = node.node_id;
    lease.status = lease_status::pending_cleanup;
    lease.epoch = 1;
    lease.acquired_at_ms = lease.last_used_at_ms = now_ms();
    lease.metadata = {{"pluginId", provider->plugin_id()}, {"provider", provider->key()}};
    lease.cleanup_status = "acquire answered after its timeout";
    lease.failure_reason = "the provider answered environmentAcquireLease after its timeout";
    try {
        co_await node.registry->create_lease(lease);
        spdlog::warn(
            "lease={} recorded in pending_cleanup: provider={} answered its acquire late "
            "(providerLeaseId {})",
            lease.id, lease.provider, lease.provider_lease_id);
    } catch (const std::exception& e) {
        spdlog::error("lease={}: cannot record the late sandbox {} of provider={} for cleanup: {}",
                      lease.id, lease.provider_lease_id, lease.provider, e.what());
    }
}
}  // namespace

void record_late_sandbox(Node& node, Lease lease) {
    if (!node.ioc) return;
    net::co_spawn(*node.ioc, store_late_sandbox(node, std::move(lease)), net::detached);
}

awaitable<std::shared_ptr<PeerLink>> owner_link(Node& node, const Lease& lease) {
    auto record = co_await node.registry->get_node(lease.owner_node_id);
    const auto now = now_ms();
    if (!record || !node.member_alive(*record, now)) {
        throw rpc_error(errc::owner_unavailable,
                        "Owner node " + lease.owner_node_id + " of sandbox lease " + lease.id +
                            " is not alive.",
                        {{"ownerNodeId", lease.owner_node_id}, {"leaseId", lease.id}});
    }
    if (node.config.routing_mode == "redirect") {
        throw rpc_error(
            errc::owner_elsewhere,
            "Sandbox lease " + lease.id + " is served by node " + record->node_id + ".",
            {{"ownerNodeId", record->node_id}, {"ownerUrl", record->url}, {"leaseId", lease.id}});
    }
    const auto security = node.security();
    if (security->peer_token.empty()) {
        throw rpc_error(errc::owner_unavailable,
                        "Owner node " + lease.owner_node_id +
                            " is unavailable: this node has no "
                            "peer token to reach it.",
                        {{"ownerNodeId", lease.owner_node_id}});
    }
    co_return node.peers.get(node, *record, security->peer_token, *node.ioc);
}

awaitable<void> end_lease_channels(Node& node, const std::string& lease_id,
                                   std::chrono::milliseconds wait) {
    auto entries = node.channels.of_lease(lease_id);
    for (auto& e : entries) {
        net::post(e.strand, [weak = e.channel] {
            if (auto ch = weak.lock()) ch->stop(channel_outcome::lease_released);
        });
    }
    // Woken by each channel that ends (ChannelTable::watch_removals), not by polling.
    using namespace net::experimental::awaitable_operators;
    if (node.channels.of_lease(lease_id).empty()) co_return;
    auto ex = co_await net::this_coro::executor;
    auto removed = std::make_shared<ChannelTable::RemovalSignal>(ex, 1);
    node.channels.watch_removals(removed);
    net::steady_timer deadline(ex);
    deadline.expires_after(wait);
    while (!node.channels.of_lease(lease_id).empty()) {
        auto woken = co_await (removed->async_receive(as_tuple_awaitable) ||
                               deadline.async_wait(as_tuple_awaitable));
        if (woken.index() == 1) break;  // the wait is over
    }
}

}  // namespace sandboxd
