#pragma once
/// @file registry.hpp
/// The lease registry: the source of truth for leases and nodes, shared by every node
/// process (docs/protocol.md sections 2 and 6; docs/architecture.md).
///
/// Every call is an awaitable (async.hpp): it runs on the awaiting coroutine's executor and
/// never blocks that thread. SQLite does its file I/O on a small pool of its own (readers in
/// parallel under WAL, one writer); etcd speaks HTTP/1.1 natively on the executor given at
/// construction. Implementations are thread-safe: calls may be awaited from several
/// coroutines and threads at once, and several processes may share one store.
///
/// Membership lane: register_node, heartbeat_node, remove_node, get_node and list_nodes never
/// wait behind lease calls (SQLite: a connection and thread of their own; etcd: a connection
/// of its own), so a backlog of lease work cannot delay a heartbeat past the node TTL.
///
/// Scale: every lookup below is served by an index (id, idempotency key, provider and
/// providerLeaseId, owner node and status): no call reads more records than it returns, plus
/// a constant, except the list_leases filters documented at LeaseQuery.
///
/// Errors: a store that cannot be read or written throws rpc_error(errc::registry_unavailable)
/// with a message that names the operation; the caller fails closed.
///
/// Records that cannot be decoded (not JSON, nested deeper than max_json_depth, wrong types,
/// an unknown status; docs/protocol.md section 8): a call about one lease (get, find, update,
/// create's idempotency clash) throws rpc_error(errc::registry_unavailable, "registry: <op>:
/// the record of lease <id> cannot be read", {leaseId}); list_leases, expired_leases, the
/// change feed, etcd's start-up indexing and list_nodes skip the record and serve the others.
/// Each bad record is logged (warning) and counted in the factory's `bad_records` counter
/// once per version of it, not per read. Cancelling an awaiting
/// coroutine (e.g. `op || timer`) abandons the wait; a write already sent may still land.

#include <sandboxd/core/async.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/core/metrics.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace boost::asio::ssl {
class context;
}  // namespace boost::asio::ssl

namespace sandboxd {

/// Filter of leaseList (a page at a time, in (acquiredAt, id) order). Empty optionals match
/// everything. `tenants` restricts to these companyIds; empty means every tenant (a `*`
/// token). Both registries serve a query that names owner_node_id or status from the owner
/// index (etcd: the keys of that status over every node, then only the records of a page),
/// so the sweeper and a listing of the active leases read only what they asked for. Other
/// filters: SQLite uses its company index; etcd reads the owner index keys of every status
/// (one key per lease stored, no record) and then the records of a page, skipping those the
/// filter rejects, so a tenant's leaseList on etcd without a status costs in proportion to
/// every lease stored (the host-facing list, not on any per-request path).
struct LeaseQuery {
    std::optional<std::string> company_id;
    std::optional<std::string> environment_id;
    std::optional<lease_status> status;
    std::optional<std::string> owner_node_id;
    std::vector<std::string> tenants;
    std::size_t limit = 100;  ///< 1..1000
    std::string cursor;       ///< opaque; "" for the first page
};

struct LeasePage {
    std::vector<Lease> leases;  ///< ordered by (acquiredAt, id)
    std::string next_cursor;    ///< "" when there is no further page
};

/// A node's membership record (protocol section 6).
struct NodeRecord {
    std::string node_id;
    std::string url;  ///< advertiseUrl, ws:// or wss://
    std::int64_t started_at_ms = 0;
    std::int64_t heartbeat_at_ms = 0;
    std::string instance_id;  ///< random per process start; tells restarts apart
    /// etcd: the mod revision of the record as read (what update_lease_if_owner_unchanged
    /// compares); SQLite: 0. Not stored.
    std::int64_t revision = 0;
};

/// A running change feed of lease records (Registry::watch_leases). Destroying it stops the
/// feed (see watch_leases for when callbacks may still run).
class LeaseWatch {
public:
    virtual ~LeaseWatch() = default;
};

class Registry {
public:
    virtual ~Registry() = default;

    /// Follows changes to lease records written by any process, so that an owner can evict
    /// cached handles and end channels of leases released, expired or taken elsewhere without
    /// waiting for its next sweep (docs/protocol.md section 8, "Change feed").
    ///
    /// Runs as a coroutine on `ex` (no thread of its own) and calls `on_change` there with
    /// each lease record as written, one call at a time, in revision order. It starts at the
    /// registry's current revision: records written before are not delivered (the feed never
    /// lists the leases, whose cost grows with the store, not with what the caller holds), and
    /// `on_resync` says that the feed has (re)started, so that the caller reconciles what it
    /// holds against the records. When the feed breaks (the registry restarts, the connection
    /// drops) it resumes from the last revision it delivered, so only what changed meanwhile
    /// arrives and no resync is needed; only when that revision is gone (compacted) or the
    /// registry is behind it (another store) does it start again from the current revision,
    /// with another `on_resync`. It retries every `retry_ms` milliseconds while the registry is
    /// unreachable. `on_change` and `on_resync` must not block and must not throw.
    /// Destroying the returned LeaseWatch stops the feed: no callback runs after
    /// the destructor returns when it is destroyed on `ex`'s thread (the daemon's io_context
    /// runs on its threads; the watch is destroyed at shutdown after it stopped).
    /// Returns nullptr when the backend has no change feed (SQLite): callers then rely on
    /// their periodic pass alone.
    virtual std::unique_ptr<LeaseWatch> watch_leases(boost::asio::any_io_executor ex,
                                                     std::function<void(const Lease&)> on_change,
                                                     std::function<void()> on_resync = {},
                                                     std::int64_t retry_ms = 500) {
        (void)ex;
        (void)on_change;
        (void)on_resync;
        (void)retry_ms;
        return nullptr;
    }

    /// Inserts a new lease. If the lease has an idempotency key and a lease with the same
    /// (companyId, environmentId, idempotencyKey) exists, nothing is written and that
    /// existing lease is returned; otherwise returns `lease` as stored: SQLite keeps
    /// `lease.epoch`; etcd sets it to the revision of the creating transaction (the claim).
    virtual awaitable<Lease> create_lease(Lease lease) = 0;

    /// The lease with this id, or std::nullopt.
    virtual awaitable<std::optional<Lease>> get_lease(std::string id) = 0;

    /// The lease made with this idempotency key in this scope, or std::nullopt.
    virtual awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                                    std::string environment_id,
                                                                    std::string key) = 0;

    /// The lease whose sandbox `provider` made as `provider_lease_id` (both unique together
    /// across the registry: a provider never mints one id twice), or std::nullopt. By index.
    virtual awaitable<std::optional<Lease>> find_by_provider_lease(
        std::string provider, std::string provider_lease_id) = 0;

    /// One page of leases matching `query`.
    virtual awaitable<LeasePage> list_leases(LeaseQuery query) = 0;

    /// Compare-and-swap: stores every mutable field of `next` (status, owner, epoch, times,
    /// failure/cleanup fields, cleanup_attempts, metadata) if the stored lease still has
    /// `expected_epoch`. Returns the lease as stored, or std::nullopt (and writes nothing)
    /// when the epoch differs or the lease does not exist.
    ///
    /// Epochs (the fencing token of protocol section 1): the caller asks for a new epoch on an
    /// owner or status change by passing `next.epoch != expected_epoch`, and must then use the
    /// epoch of the returned lease: SQLite stores `next.epoch` as given (the caller passes
    /// expected + 1); etcd stores the revision of the winning write (strictly greater than
    /// every earlier epoch of the lease, but not + 1). `next.epoch == expected_epoch` keeps
    /// the epoch (renewals).
    virtual awaitable<std::optional<Lease>> update_lease(Lease next,
                                                         std::int64_t expected_epoch) = 0;

    /// update_lease, fenced by the owner's membership: writes only if, in the same
    /// transaction, the membership record of `next.owner_node_id` is still `owner_seen` as
    /// get_node or list_nodes returned it (the same write of it: etcd compares its mod
    /// revision, SQLite its instanceId and heartbeatAt), or, for std::nullopt, there is still
    /// none. Otherwise writes nothing and returns std::nullopt, like an epoch that differs.
    /// For the sweeper, which orphans the leases of an owner it judged dead from `owner_seen`:
    /// an owner that registered or heartbeated since (the sweeper's view was stale: its node
    /// was frozen between the read and the write) keeps its leases (docs/protocol.md
    /// section 8, "Orphaning").
    virtual awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) = 0;

    /// Active leases of `owner_node_id` whose expiresAt is at or before `at_ms`.
    virtual awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                         std::int64_t at_ms) = 0;

    /// The distinct owner node ids of active leases (for the sweeper, to find owners whose
    /// membership lapsed without reading their leases). By index; reads no lease records.
    virtual awaitable<std::vector<std::string>> active_owner_nodes() = 0;

    /// Registers or refreshes this node. Throws rpc_error(errc::invalid_params) when another
    /// instance of the same nodeId has heartbeated within `liveness_ttl_ms` (two live
    /// processes must not claim one nodeId).
    virtual awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) = 0;
    /// Sets heartbeatAt of this node instance; returns false if the record now belongs to
    /// another instance (this process lost its nodeId).
    virtual awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                           std::int64_t at_ms) = 0;
    /// Removes this instance's node record (clean shutdown).
    virtual awaitable<void> remove_node(std::string node_id, std::string instance_id) = 0;
    virtual awaitable<std::vector<NodeRecord>> list_nodes() = 0;
    virtual awaitable<std::optional<NodeRecord>> get_node(std::string node_id) = 0;
};

/// Opens (creating if needed) a SQLite registry at `path` in WAL mode, with a busy timeout so
/// several processes can share it. Its file I/O runs on threads of its own: `readers`
/// connections (1..16) for reads in parallel, one writer connection for lease writes, and one
/// connection for membership (the lane above). Throws rpc_error(errc::registry_unavailable) if
/// the file cannot be opened or its schema created or migrated. Blocking (call at start).
/// `bad_records` (may be null; must outlive the registry) counts records that cannot be read.
std::unique_ptr<Registry> make_sqlite_registry(const std::string& path, int readers = 2,
                                               Counter* bad_records = nullptr);

/// An etcd registry, spoken to through etcd's v3 JSON gateway (HTTP POST to /v3/...) with an
/// asynchronous HTTP/1.1 client on `ex` (keep-alive, one connection per endpoint for calls,
/// one for membership, one long-lived stream for the watch); several processes on several
/// hosts may share one `prefix`.
///
/// - `endpoints`: "http://HOST:PORT" URLs of the cluster's members (no TLS); each request goes
///   to the last one that answered and fails over to the others in turn.
/// - `prefix`: every key lives under it (`<prefix>leases/<id>`, `<prefix>idem/<company>/<env>/
///   <key>`, `<prefix>nodes/<nodeId>`, and the index keys docs/protocol.md section 8 lists);
///   it should end with "/".
/// - `node_ttl_ms`: milliseconds; register_node attaches the node record to an etcd lease of
///   this TTL (rounded up to whole seconds, at least 1; etcd itself may raise it to its
///   minimum, about 2 s), renewed by heartbeat_node, so a node that stops heartbeating
///   vanishes from list_nodes after it.
/// - `username`/`password`: when `username` is not empty, the client authenticates
///   (/v3/auth/authenticate) and sends the token, authenticating again when it is refused.
///
/// Each call waits at most 2 s per endpoint tried. Thread-safe, like every Registry.
/// Errors: malformed `endpoints` (none, or not http://HOST:PORT) or `node_ttl_ms` <= 0 throw
/// std::invalid_argument here; nothing is sent until the first call. Afterwards, an etcd that
/// cannot be reached, times out, answers HTTP 5xx, an error or a malformed body makes the call
/// throw rpc_error(errc::registry_unavailable, "registry: <op>: <detail>").
///
/// https:// endpoints: `tls` gives the client context (registry.tls: its CA, certificate and
/// key), asked again for every new connection, so that a reload applies to the next ones;
/// without it (or when it returns null) the system's trust store and no client certificate.
///
/// `bad_records` (may be null; must outlive the registry) counts records that cannot be read.
std::unique_ptr<Registry> make_etcd_registry(
    boost::asio::any_io_executor ex, std::vector<std::string> endpoints, std::string prefix,
    std::int64_t node_ttl_ms, std::string username = "", std::string password = "",
    std::function<std::shared_ptr<boost::asio::ssl::context>()> tls = {},
    Counter* bad_records = nullptr);

}  // namespace sandboxd
