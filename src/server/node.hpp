#pragma once
// The state one daemon process (a node) shares between its sessions.
#include <sandboxd/core/net.hpp>
#include "server/audit.hpp"
#include "server/detached_channels.hpp"
#include "server/node_metrics.hpp"
#include "server/peer_link.hpp"
#include "server/send_budget.hpp"

#include <boost/asio/experimental/concurrent_channel.hpp>

#include <sandboxd/core/config.hpp>
#include <sandboxd/core/tls.hpp>
#include <sandboxd/provider/handle_cache.hpp>
#include <sandboxd/provider/provider.hpp>
#include <sandboxd/registry/registry.hpp>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd {

class Channel;

/// Who is calling: the token that authenticated the connection (never the secret itself).
struct Principal {
    std::string name;
    std::string role;  ///< "host" or "peer"
    std::vector<std::string> tenants;
    /// SHA-256 of the token that authenticated the connection (all zero for a principal a
    /// peer forwarded): a reload that drops it revokes the connection.
    std::array<unsigned char, 32> token_sha256{};
    /// A peer token's node (auth.tokens[].nodeId): its links must come from that node. "":
    /// not bound.
    std::string node_id{};
    /// May read GET /metrics: role metrics or peer, or the generated admin token.
    bool reads_metrics = false;
    /// True when this token may act for `company_id` ("*" or listed).
    bool allows(const std::string& company_id) const;
    /// Tenants for a registry query: empty when the token has "*". A principal with no tenant
    /// at all (an empty `tenants`) must not be queried: its empty list would mean every one.
    std::vector<std::string> query_tenants() const;
};

/// The tenants of both lists: `*` in one gives the other; else the companyIds in both, in the
/// order of `forwarded`, each once. Empty: no tenant at all (never "every tenant").
std::vector<std::string> intersect_tenants(const std::vector<std::string>& forwarded,
                                           const std::vector<std::string>& own);

/// `{tokenName, tenants}` of `who`: a forwarded request's forwardedFor (docs/protocol.md
/// section 6).
nlohmann::json forwarded_for(const Principal& who);

/// A configured token, its secret resolved (tokenFile read) and kept only as its SHA-256
/// (principal.token_sha256).
struct Credential {
    Principal principal;
};

/// SHA-256 of `secret`.
std::array<unsigned char, 32> token_hash(std::string_view secret);

/// The tokens a node accepts, and the TLS material of its listener and peer links: built
/// whole at start and on each SIGHUP, then never changed (readers hold a shared_ptr).
struct Security {
    std::vector<Credential> credentials;
    /// The secret of the first `peer` token: what this node presents to its peers ("" none).
    std::string peer_token;
    std::shared_ptr<ssl::context> listener_tls;  ///< `tls`; null: plain
    /// routing.peerTls; else, on a TLS node, the system trust store; null: none (built when a
    /// link needs it)
    std::shared_ptr<ssl::context> peer_client_tls;
    /// registry.tls, or the system trust store for https:// endpoints; null: not needed
    std::shared_ptr<ssl::context> registry_tls;
    /// routing.peerTls.caFile: a `peer` token needs a client certificate it verifies; null
    /// when peerTls is not set.
    std::shared_ptr<const ClientCertVerifier> peer_ca;
};

/// Every live channel of this node, by lease, for release and the node channel limit.
/// Thread-safe (one mutex; no channel code runs under it).
class ChannelTable {
public:
    struct Entry {
        std::weak_ptr<Channel> channel;
        strand_t strand;
        std::string lease_id;
        /// A detached channel that its provider keeps across a daemon restart (issue 47):
        /// a stop that keeps the node's sandboxes neither waits for it nor stops it.
        bool kept = false;
    };
    /// Reserves a slot; false when `limit` channels already run.
    bool try_reserve(std::size_t limit);
    void unreserve();
    /// Records a started channel in a reserved slot; returns its key for remove().
    std::uint64_t add(Entry entry);
    void remove(std::uint64_t key);
    std::size_t size() const;
    /// The entries that are `kept`.
    std::size_t kept() const;
    /// Forgets every entry (the daemon's end: kept channels are still in the table; their
    /// strands go before the io_context they live on).
    void clear();
    std::vector<Entry> of_lease(const std::string& lease_id) const;
    std::vector<Entry> all() const;

    /// A signal that remove() sends (without waiting: capacity 1, so removals coalesce) to
    /// every watcher still alive; awaited on the watcher's own executor.
    using RemovalSignal = net::experimental::concurrent_channel<void(boost::system::error_code)>;
    /// Sends on `signal` after each remove() until it is destroyed.
    void watch_removals(const std::shared_ptr<RemovalSignal>& signal);

private:
    mutable std::mutex mutex_;
    std::vector<std::weak_ptr<RemovalSignal>> removal_watchers_;
    std::map<std::uint64_t, Entry> entries_;
    std::size_t reserved_ = 0;
    std::uint64_t next_key_ = 1;
};

/// Async locks by name: the reuse acquires of one lease scope on this node run one at a time
/// (docs/protocol.md, "Lease policies"), and so do the teardowns of one lease. Thread-safe; a
/// lock is awaited without blocking a thread, and released when the returned guard's `held`
/// is destroyed (on any thread).
class KeyedLocks {
public:
    struct Guard {
        std::shared_ptr<void> held;
        /// Whether another guard of the key was alive or awaited when this one was asked for
        /// (the caller waited its turn), decided atomically with taking the turn.
        bool waited = false;
    };
    /// Waits until no other guard of `key` is alive, then returns this caller's.
    awaitable<Guard> lock(std::string key);

private:
    /// A semaphore of one: a send takes it (waiting while it is full), a receive frees it.
    using Gate = net::experimental::concurrent_channel<void(boost::system::error_code)>;
    std::mutex mutex_;
    std::map<std::string, std::weak_ptr<Gate>> gates_;
};

/// Milliseconds of the steady (monotonic) clock, which keeps counting while the process is
/// stopped (SIGSTOP), unlike the process's own sense of time.
std::int64_t steady_now_ms();

struct Node {
    Config config;
    std::string node_id;
    std::string instance_id;
    /// The instance of the process that ran this node on this state directory before, when a
    /// provider's sandboxes outlive their daemon ("" otherwise, or on a first start): this
    /// process holds the state's lock, so that instance is gone, and its node record may be
    /// taken over at once rather than after a liveness TTL (issue 47).
    std::string predecessor_instance;
    /// Set by POST /admin/decommission: the stop ends this node's sandboxes, releases its
    /// leases and removes its record, instead of keeping them for the next process.
    std::atomic<bool> decommissioning{false};
    std::string advertise_url;
    std::int64_t started_at_ms = 0;
    /// When the sweeper last looked for sandboxes of ended leases on this node's disk (ms
    /// since the epoch; the sweep loop's own, one pass at a time).
    std::int64_t leftovers_checked_at_ms = 0;
    std::unique_ptr<Registry> registry;
    std::map<std::string, std::unique_ptr<Provider>> providers;
    HandleCache cache;
    /// Channels made and not yet ended (ChannelOptions::unended): stop waits for 0. Declared
    /// before `channels`, whose channels count it down when they are destroyed.
    std::atomic<std::int64_t> channels_unended{0};
    ChannelTable channels;
    /// The detached channels of this node (issue 46): they outlive their connections.
    DetachedChannels detached;
    /// Draining (SIGTERM, POST /admin/drain; docs/protocol.md section 7): no new opens and
    /// no new leases here, running channels finish; heartbeats, renewals and releases go on.
    std::atomic<bool> draining{false};
    /// Stopping (Daemon::stop): connections and channels are being closed; loops end.
    std::atomic<bool> stopping{false};
    /// Channels of this node's connections relayed to their owners (ChannelMux), open or
    /// being opened now.
    std::atomic<std::int64_t> relays_open{0};
    /// duplexChannelOpen calls past the draining check and not yet answered: a drain waits
    /// for them (Session::channel_open counts first, then reads `draining`).
    std::atomic<std::int64_t> opens_in_flight{0};
    /// Set once this node has registered at start (docs/protocol.md section 7): before, it
    /// answers /readyz and WebSocket upgrades with 503 and startup_problem.
    std::atomic<bool> registered{false};
    mutable std::mutex startup_mutex;
    std::string startup_problem;  ///< guarded by startup_mutex
    /// GET /metrics (node_metrics.hpp).
    NodeMetrics metrics;
    /// Bytes queued toward hosts, node-wide (limits.sendQueueBytes, ...PerConnection); made
    /// by the Daemon once the config is known, before any connection.
    std::unique_ptr<SendBudget> send_budget;
    net::thread_pool blocking{4};
    net::io_context* ioc = nullptr;
    PeerLinks peers;
    /// How the links in `peers` connect; unset (the daemon's): TCP (and TLS) to the peer's url.
    PeerDialer peer_dialer;
    KeyedLocks reuse_locks;
    /// One teardown of a lease at a time on this node (a release racing the sweeper).
    KeyedLocks teardown_locks;
    /// The audit trail (config audit.file); null when none is configured.
    std::shared_ptr<AuditLog> audit;

private:
    mutable std::mutex claims_mutex_;
    std::map<std::string, std::int64_t> claims_;

public:
    /// Self-fencing (docs/protocol.md section 8): steady-clock milliseconds at which the last
    /// successful renewal of this node's registry membership was sent.
    std::atomic<std::int64_t> renewed_at_ms{0};
    /// Incremented each time a heartbeat finds this node fenced, or its membership lost or
    /// being rejoined: while it is unchanged, every renewal in between kept the membership
    /// without a gap, so a command refused for a passed start deadline may be started again
    /// with the later one (Node::retry_start).
    std::atomic<std::uint64_t> membership_breaks{0};
    /// The change feed of the registry (etcd); nullptr for SQLite.
    std::unique_ptr<LeaseWatch> lease_watch;

    /// Throws rpc_error(errc::registry_unavailable) while this node's membership has not been
    /// renewed for more than 2/3 of nodeTtlMs: other nodes may soon (or already) consider it
    /// dead, so it serves no open and no lease change until it renews.
    void require_membership() const;
    /// Milliseconds since the last renewal, when that is over the fencing limit; 0 otherwise.
    std::int64_t fenced_for_ms() const;
    /// Whether the node of `record` is alive at `at_ms` (wall-clock ms, as heartbeatAt): its
    /// last heartbeat is less than nodeTtlMs old (docs/protocol.md section 6). A record read
    /// before `at_ms` is taken can only look older, never younger. Thread-safe, no I/O.
    bool member_alive(const NodeRecord& record, std::int64_t at_ms) const {
        return at_ms - record.heartbeat_at_ms < config.node_ttl_ms;
    }
    /// Steady-clock ms at which this node fences itself unless it renews first: the last
    /// renewal + 2/3 of nodeTtlMs. A command is started only before it (ExecSpec).
    std::int64_t fence_deadline_ms() const;
    /// Whether a stop now keeps this node's sandboxes, leases and kept channels for its next
    /// process (a provider outlives the daemon, and the node is not being decommissioned;
    /// issue 47).
    bool keeps_across_restart() const;
    /// Whether a command refused for passing `deadline` (start_deadline_passed) may be started
    /// again: the membership was renewed since (a later deadline, not yet passed) without a
    /// break since `breaks` (membership_breaks when the first attempt began). At most a few
    /// attempts: the caller counts them.
    bool may_retry_start(std::int64_t deadline, std::uint64_t breaks) const;

    /// The epoch of each lease whose sandbox this node created (its claim), compared on every
    /// open this node serves as owner. Thread-safe.
    void claim(const std::string& lease_id, std::int64_t epoch);
    std::optional<std::int64_t> claim_of(const std::string& lease_id) const;
    void unclaim(const std::string& lease_id);

    /// The principal of `bearer_token`: its SHA-256 compared in constant time against every
    /// credential's; nullopt when none matches. Thread-safe.
    std::optional<Principal> authenticate(std::string_view bearer_token) const;
    /// The current tokens and TLS material (none until the Daemon's constructor sets them).
    /// Thread-safe; never null.
    std::shared_ptr<const Security> security() const;
    /// Replaces them (start, SIGHUP). Thread-safe.
    void set_security(std::shared_ptr<const Security> next);

private:
    mutable std::mutex security_mutex_;
    std::shared_ptr<const Security> security_ = std::make_shared<const Security>();

public:
};

}  // namespace sandboxd
