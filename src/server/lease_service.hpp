#pragma once
// The lease methods of docs/protocol.md section 2 and the fail-closed checks of section 3.
// Coroutines run on the caller's strand; registry calls are awaited (the registry does its
// I/O off this thread, registry.hpp), and so are provider create/destroy (the provider does
// its blocking work on a pool of its own, provider.hpp). Errors are thrown as rpc_error with
// the protocol's reasons.
#include "server/methods.hpp"
#include "server/node.hpp"

#include <nlohmann/json.hpp>

namespace sandboxd {

awaitable<Lease> lease_acquire(Node& node, const Principal& who,
                               methods::LeaseAcquireParams params);
awaitable<Lease> lease_get(Node& node, const Principal& who, std::string lease_id);
/// Sets `lease.usage` from its provider when this node owns the active lease and holds its
/// sandbox (protocol section 2); leaves it null otherwise. Reads a few kernel files; fast.
void attach_usage(Node& node, Lease& lease);
/// `query` without tenants: the caller's are added.
awaitable<nlohmann::json> lease_list(Node& node, const Principal& who, LeaseQuery query);
awaitable<Lease> lease_renew(Node& node, const Principal& who, std::string lease_id,
                             std::uint64_t ttl_ms);
/// leaseRelease: `disposition` (or the lease policy's default) "destroy" tears the sandbox
/// down (released); "retain" stops it through the provider and leaves the lease `retained`
/// (INVALID_PARAMS naming disposition when the provider cannot). A retained lease is
/// destroyed by any node. Idempotent for released, failed, and retained-then-retain.
awaitable<Lease> lease_release(Node& node, const Principal& who, methods::LeaseReleaseParams p);
/// leaseRelease {leaseId} alone: the policy's default disposition.
awaitable<Lease> lease_release(Node& node, const Principal& who, std::string lease_id);
awaitable<nlohmann::json> node_list(Node& node);
/// leaseProbe on the owner: the lease's provider probes its sandbox (resumed first when a
/// plugin lost it). LEASE_NOT_ACTIVE for a lease that is not live; INVALID_PARAMS naming
/// leaseProbe when the provider cannot probe.
awaitable<nlohmann::json> lease_probe(Node& node, const Principal& who, std::string lease_id);
/// leaseExecute on the owner: the command runs in the lease's sandbox through its provider
/// (counted against limits.channelsPerNode while it runs), its output streamed to `log` on
/// the calling strand. Errors as lease_probe, and CHANNEL_LIMIT.
awaitable<nlohmann::json> lease_execute(Node& node, const Principal& who,
                                        methods::ExecuteParams params, ExecuteLog log);
/// leaseRealizeWorkspace on the owner. Errors as lease_probe.
awaitable<nlohmann::json> lease_realize_workspace(Node& node, const Principal& who,
                                                  methods::RealizeWorkspaceParams params);
/// leaseUpdateNetwork on the owner (issue 48): the provider applies the new policy, then the
/// lease record's `network` is updated; the lease as stored. OWNER_UNAVAILABLE while the node
/// drains; otherwise errors as lease_probe, INVALID_PARAMS naming `network` for a bad policy.
awaitable<Lease> lease_update_network(Node& node, const Principal& who,
                                      methods::LeaseUpdateNetworkParams params);
/// providerValidateConfig on any node with the provider: INVALID_PARAMS naming `provider`
/// for an unknown one, naming providerValidateConfig when it cannot validate.
awaitable<nlohmann::json> provider_validate_config(Node& node, const Principal& who,
                                                   methods::ValidateConfigParams params);
/// The node's providers for `initialize`: [{provider, pluginId, ready, capabilities}].
nlohmann::json provider_list(const Node& node);

/// Checks 2-4 of protocol section 3 for `lease_param` (the open's `lease` object): step 2
/// (LEASE_INCOMPLETE) before anything touches the registry or a provider, then the lease in
/// the caller's tenants with the same scope (LEASE_NOT_FOUND), then active, unexpired and of
/// the given epoch (LEASE_NOT_ACTIVE). Returns the registered lease.
awaitable<Lease> resolve_lease(Node& node, const Principal& who, methods::LeaseRef ref);
/// The same for a reference still in JSON (methods::parse_lease_ref first).
awaitable<Lease> resolve_lease(Node& node, const Principal& who, nlohmann::json lease_param);

/// What the sandbox is wanted for: new work (an open, an execute, a probe) is refused while
/// this node drains; a release (retain) is not.
enum class sandbox_use { new_work, release };

/// Step 6 on the owner: the cached sandbox of exactly the lease's scope, else
/// SANDBOX_NOT_CACHED; OWNER_UNAVAILABLE (data.draining) while this node drains, for new work.
std::shared_ptr<SandboxHandle> cached_sandbox(Node& node, const Lease& lease,
                                              sandbox_use use = sandbox_use::new_work);

/// Step 6 with resume: cached_sandbox(), or, when this node owns the active lease but does
/// not cache it (it restarted with the same nodeId) and its provider can_resume(), the
/// sandbox resumed from the lease's record and cached. A resume that fails orphans the lease
/// (pending_cleanup, for the sweeper) and gives SANDBOX_NOT_CACHED; PROVIDER_NOT_READY while
/// the provider cannot serve (nothing changes).
awaitable<std::shared_ptr<SandboxHandle>> sandbox_for(Node& node, Lease lease,
                                                      sandbox_use use = sandbox_use::new_work);

/// The provider could not resume the cached sandbox of `lease` (a plugin worker restarted
/// and its environmentResumeLease failed): evicts it and orphans the lease for the sweeper.
awaitable<void> forget_unresumable(Node& node, Lease lease, std::string why);

/// Records a sandbox its provider made after the acquire had failed (a plugin's late
/// answer) as a lease of this node in pending_cleanup, for the sweeper to tear down. Called
/// on any thread; posts to the node's io_context.
void record_late_sandbox(Node& node, Lease lease);

/// Step 5 for a lease owned by another node: the link to its live owner (proxy mode), or
/// OWNER_ELSEWHERE with its URL (redirect mode), or OWNER_UNAVAILABLE when the owner's
/// heartbeat is older than the liveness TTL or it has no record.
awaitable<std::shared_ptr<PeerLink>> owner_link(Node& node, const Lease& lease);

/// The membership record of a lease's owner as read when it was judged dead (std::nullopt:
/// it had none).
struct OwnerSeen {
    std::optional<NodeRecord> record;
};

/// Moves an active lease whose owner cannot serve it to pending_cleanup (epoch + 1), with
/// `why` as its cleanupStatus. Returns the stored lease (another writer's if it changed).
/// Audited as lease.orphaned with `actor` (a token name, "sweeper" or "node"). With `owner`,
/// the write is fenced by that record (Registry::update_lease_if_owner_unchanged): when the
/// owner registered or heartbeated since, nothing is written and the lease is returned as it
/// now stands (still active).
awaitable<Lease> lease_orphan(Node& node, Lease lease, std::string why,
                              std::string actor = "sweeper",
                              std::optional<OwnerSeen> owner = std::nullopt);

/// One pass of the sweeper (run every heartbeat): releases this node's expired leases
/// (status `expired`); once this process has run for a liveness TTL, moves its own active
/// leases that its cache does not hold (a restart) to pending_cleanup; moves active leases of
/// dead owners (no heartbeat within the TTL) to pending_cleanup; tears down this node's
/// pending_cleanup leases through their recorded provider, as its CleanupPolicy says: quick
/// attempts backing off, then either `failed` (built-in providers) or, once warned, a slow
/// retry for ever (plugins: a remote sandbox may still exist); once per nodeTtlMs,
/// destroy_leftover_sandboxes. Leases of this node whose
/// provider can_resume() stay active after a restart (the first use resumes them). It never touches
/// a lease whose owner is alive and holds it (acceptance cases B21, B23). Reads only this node's
/// leases (owner index) and those of owners whose membership lapsed (Registry::active_owner_nodes
/// against list_nodes), never the leases of live owners.
awaitable<void> sweep(Node& node);

/// True when this node has channels or a cached sandbox of `lease` although the lease is no
/// longer this node's to serve (not active, owned elsewhere, or under another epoch than the
/// one it claimed). Cheap and thread-safe: the registry's change feed calls it on its thread.
bool needs_reconcile(const Node& node, const Lease& lease);

/// Brings this node in line with `lease` as the registry holds it: when needs_reconcile(),
/// ends the lease's channels here (outcome leaseReleased) and, unless the lease is this
/// node's pending_cleanup (which the sweeper tears down), destroys and evicts its cached
/// sandbox. Run for the change feed's events and, for every cached sandbox, by the sweeper.
awaitable<void> reconcile_lease(Node& node, Lease lease);

/// reconcile_lease for the registry's record of every sandbox in this node's cache.
awaitable<void> reconcile_cached(Node& node);

/// At start, once registered and before serving: destroys every sandbox that a provider keeps
/// on this node's disk (Provider::stored_sandboxes) and that no lease of this node records in
/// a status that may hold one (active, pending_cleanup, retained, failed). Such a sandbox was
/// made by an earlier process of this node that was killed before it stored the lease, so no
/// host ever got it and nothing else would ever remove it. Returns how many were destroyed.
/// Throws what the registry throws (then nothing was destroyed); a sandbox whose teardown
/// fails is logged and left for the next start.
awaitable<std::size_t> destroy_unrecorded_sandboxes(Node& node);

/// At start, before the node serves (issue 47): every active lease of this node whose
/// provider's sandboxes outlive their daemon (Provider::outlives_daemon) and that this process
/// does not cache is re-adopted through sandbox_for() (Provider::resume), under the lease's
/// current epoch; one that cannot be (its supervisor is gone, its version is not served) is
/// orphaned to pending_cleanup, and the sweeper tears it down. Returns how many were
/// re-adopted. Throws what the registry throws when it lists the leases.
awaitable<std::size_t> adopt_own_sandboxes(Node& node);

/// POST /admin/decommission: tears down the sandbox of every lease this node owns (active,
/// retained or pending_cleanup) and records it released, audited with `actor`. Returns how
/// many were released; a teardown that fails leaves its lease pending_cleanup (logged).
/// Throws what the registry throws when it lists the leases.
awaitable<std::size_t> release_own_leases(Node& node, std::string actor);

/// Run by the sweeper once per nodeTtlMs: destroys every sandbox that a provider keeps on
/// this node's disk, that this process does not cache, and whose lease (by providerLeaseId)
/// is released or expired, by this node or another: a teardown recorded the end, yet the
/// sandbox is there. Logged as a warning with what the disk holds (Provider::describe_stored) and
/// counted as sandboxd_teardowns_total{outcome="leftover"}. A sandbox with no record (being
/// created, or left by a killed process: destroy_unrecorded_sandboxes at the next start) or
/// in any other status is left alone. Returns how many were destroyed; throws what the
/// registry throws.
awaitable<std::size_t> destroy_leftover_sandboxes(Node& node);

/// Ends every channel of `lease_id` on this node with outcome leaseReleased and waits (at
/// most `wait`) until their processes are gone.
awaitable<void> end_lease_channels(Node& node, const std::string& lease_id,
                                   std::chrono::milliseconds wait);

}  // namespace sandboxd
