// The etcd backend of the lease registry, through etcd's v3 JSON gateway (etcd_client.hpp),
// natively asynchronous on the daemon's io_context.
//
// Layout under the prefix (path components percent-encode '%' and '/'; docs/protocol.md
// section 8):
//   <prefix>leases/<id>                      JSON of every stored Lease field (lease_fields.hpp)
//   <prefix>idem/<company>/<env>/<key>       the lease id made with that idempotency key
//   <prefix>plid/<provider>/<providerLeaseId>
//                                            the lease id of that provider's sandbox
//   <prefix>owner/<status>/<nodeId>/<acquired>/<id>
//                                            {"expiresAtMs": n|null}: one key per lease, at
//                                            its current status and owner; <acquired> is
//                                            acquiredAt as 20 digits (offset by 2^63), so
//                                            keys sort by (acquiredAt, id) like leaseList
//   <prefix>meta/indexes                     "1" once every lease has its index keys
//   <prefix>nodes/<nodeId>                   JSON of the NodeRecord, attached to the node's
//                                            etcd lease so that it vanishes when the node dies
// Writes are transactions that compare create or mod revisions, so several processes may share
// one prefix; the index keys change in the same transaction as the lease record. Reads through
// an index fetch the records and check them again, so a stale index key (left by a version
// without indexes) is skipped, never returned.
#include "registry/etcd_client.hpp"

#include "registry/bad_records.hpp"
#include "registry/cursor.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/lease_fields.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/registry/registry.hpp>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>
#include <mutex>
#include <set>
#include <string_view>
#include <utility>

namespace sandboxd {
namespace {

using json = nlohmann::json;

constexpr std::size_t max_page = 1000;
constexpr int max_cas_attempts = 8;
constexpr std::chrono::milliseconds request_timeout{2000};
/// Operations per txn: etcd's default --max-txn-ops is 128.
constexpr std::size_t txn_ops = 100;
constexpr std::array all_statuses = {lease_status::active,          lease_status::released,
                                     lease_status::expired,         lease_status::failed,
                                     lease_status::pending_cleanup, lease_status::retained};

[[noreturn]] void throw_unavailable(std::string_view op, std::string_view detail) {
    throw rpc_error(errc::registry_unavailable,
                    "registry: " + std::string(op) + ": " + std::string(detail));
}

/// Rethrows the exception in flight as registry_unavailable when it is an etcd error answer
/// or a malformed answer or record; anything else as it is.
[[noreturn]] void rethrow_unavailable(const std::string& op) {
    try {
        throw;
    } catch (const etcd::status_error& e) {
        throw_unavailable(op, "etcd: " + std::string(e.what()));
    } catch (const json::exception& e) {
        throw_unavailable(op, std::string("malformed answer or record: ") + e.what());
    } catch (const std::invalid_argument& e) {
        throw_unavailable(op, std::string("malformed answer or record: ") + e.what());
    }
}

/// Awaits `a`, turning etcd error answers and malformed answers into registry_unavailable.
template <typename T>
awaitable<T> guarded(std::string op, awaitable<T> a) {
    try {
        co_return co_await std::move(a);
    } catch (...) {
        rethrow_unavailable(op);
    }
}

template <>
awaitable<void> guarded(std::string op, awaitable<void> a) {
    try {
        co_await std::move(a);
    } catch (...) {
        rethrow_unavailable(op);
    }
}

/// A JSON array of `items`. Inside a co_await expression instead of json::array({...}): GCC 12
/// rejects an initializer list there ("array used as initializer").
template <typename... J>
json array_of(J&&... items) {
    json a = json::array();
    (a.push_back(std::forward<J>(items)), ...);
    return a;
}

/// Percent-encodes '%' and '/' so that a component cannot change the key's structure.
std::string escape(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (char c : s) {
        if (c == '%') {
            out += "%25";
        } else if (c == '/') {
            out += "%2F";
        } else {
            out += c;
        }
    }
    return out;
}

/// Inverse of escape().
std::string unescape(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '%' && s.substr(i, 3) == "%25") {
            out += '%';
            i += 2;
        } else if (s[i] == '%' && s.substr(i, 3) == "%2F") {
            out += '/';
            i += 2;
        } else {
            out += s[i];
        }
    }
    return out;
}

/// acquiredAt as 20 decimal digits that sort like the signed value.
std::string sortable(std::int64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof buf, "%020llu",
                  static_cast<unsigned long long>(static_cast<std::uint64_t>(v) + (1ULL << 63)));
    return buf;
}

// --- records -----------------------------------------------------------------------------

// A lease record is a JSON object with one key per stored field of lease_fields
// (sandboxd/core/lease_fields.hpp), named like the SQLite columns.

json record_value(const std::string& v) { return v; }
json record_value(lease_status v) { return std::string(to_string(v)); }
json record_value(std::int64_t v) { return v; }
json record_value(int v) { return v; }
json record_value(const json& v) { return v; }
template <typename T>
json record_value(const std::optional<T>& v) {
    return v ? record_value(*v) : json(nullptr);
}

/// `stored_epoch` is what the record keeps as its epoch: 0 means "the revision of this very
/// write" (an owner or status change: the fencing token is the winning revision).
std::string encode_lease(const Lease& l, std::int64_t stored_epoch) {
    json j = json::object();
    for (const auto& f : lease_fields) {
        if (!f.stored()) continue;
        j[std::string(f.column)] = std::visit([&](auto m) { return record_value(l.*m); }, f.member);
    }
    j["epoch"] = stored_epoch;
    return j.dump();
}

/// Reads one key of a record into a member (throws json::exception when it is missing or of
/// the wrong type); `l.id` is read first, for error messages.
struct RecordReader {
    const json& j;
    const LeaseField& f;
    std::string_view op;
    Lease& l;
    std::string key = std::string(f.column);

    const json* find() const {
        auto it = j.find(key);
        return it == j.end() || it->is_null() ? nullptr : &*it;
    }
    void operator()(std::string Lease::*m) const {
        // A record older than the field keeps the Lease's default.
        if (f.has(lease_field_flags::added_later) && !j.contains(key)) return;
        l.*m = j.at(key).get<std::string>();
    }
    void operator()(std::optional<std::string> Lease::*m) const {
        const json* v = find();
        l.*m = v ? std::optional(v->get<std::string>()) : std::nullopt;
    }
    void operator()(lease_status Lease::*m) const {
        auto status = parse_lease_status(j.at(key).get<std::string>());
        if (!status) throw_unavailable(op, "unknown status in lease " + l.id);
        l.*m = *status;
    }
    void operator()(std::int64_t Lease::*m) const { l.*m = j.at(key).get<std::int64_t>(); }
    void operator()(std::optional<std::int64_t> Lease::*m) const {
        const json* v = find();
        l.*m = v ? std::optional(v->get<std::int64_t>()) : std::nullopt;
    }
    void operator()(int Lease::*m) const { l.*m = static_cast<int>(j.at(key).get<std::int64_t>()); }
    void operator()(json Lease::*m) const {
        if (f.has(lease_field_flags::added_later) && !j.contains(key)) {
            l.*m = nullptr;
        } else {
            l.*m = j.at(key);
        }
    }
};

/// The lease id of a record key (`<prefix>leases/<escaped id>`).
std::string lease_id_of_key(std::string_view key) {
    const auto slash = key.rfind('/');
    return unescape(slash == std::string_view::npos ? key : key.substr(slash + 1));
}

/// The lease of a record. Throws unreadable_lease (data.leaseId from the key) for a record
/// that cannot be decoded: not JSON, nested deeper than max_json_depth, a field of the wrong
/// type, an unknown status.
Lease decode_lease(const etcd::KeyValue& kv, std::string_view op) {
    auto parsed = try_parse_json(kv.value);
    if (!parsed.ok()) {
        throw unreadable_lease(op, lease_id_of_key(kv.key), parsed.error, kv.mod_revision);
    }
    try {
        const json& j = parsed.value;
        Lease l;
        for (const auto& f : lease_fields) {
            if (f.stored()) std::visit(RecordReader{j, f, op, l}, f.member);
        }
        if (l.epoch == 0) l.epoch = kv.mod_revision;  // set by this write: its revision
        return l;
    } catch (const json::exception& e) {
        throw unreadable_lease(op, lease_id_of_key(kv.key), e.what(), kv.mod_revision);
    } catch (const rpc_error& e) {  // an unknown status
        throw unreadable_lease(op, lease_id_of_key(kv.key), e.what(), kv.mod_revision);
    }
}

std::string get_str(const json& j, const char* name) { return j.at(name).get<std::string>(); }
std::int64_t get_int(const json& j, const char* name) { return j.at(name).get<std::int64_t>(); }

std::string encode_node(const NodeRecord& n) {
    json j = {{"node_id", n.node_id},
              {"url", n.url},
              {"started_at_ms", n.started_at_ms},
              {"heartbeat_at_ms", n.heartbeat_at_ms},
              {"instance_id", n.instance_id}};
    return j.dump();
}

NodeRecord decode_node(const etcd::KeyValue& kv, std::string_view op) {
    try {
        json j = parse_json(kv.value);
        NodeRecord n;
        n.node_id = get_str(j, "node_id");
        n.url = get_str(j, "url");
        n.started_at_ms = get_int(j, "started_at_ms");
        n.heartbeat_at_ms = get_int(j, "heartbeat_at_ms");
        n.instance_id = get_str(j, "instance_id");
        n.revision = kv.mod_revision;
        return n;
    } catch (const json::exception&) {
        throw_unavailable(op, "corrupt node record " + kv.key);
    }
}

/// One entry of the owner index.
struct OwnerEntry {
    std::string suffix;  ///< "<acquired>/<escaped id>": the key below the node's prefix
    std::string id;
    std::optional<std::int64_t> expires_at_ms;
};

/// What a LeaseWatch and its coroutine share: the coroutine keeps it alive until it ends.
struct WatchState {
    WatchState(net::any_io_executor ex, std::function<void(const Lease&)> change,
               std::function<void()> resync, std::shared_ptr<BadRecordLog> bad_records)
        : strand(net::make_strand(ex)),
          stop_timer(strand, std::chrono::steady_clock::time_point::max()),
          on_change(std::move(change)),
          on_resync(std::move(resync)),
          bad(std::move(bad_records)) {}

    net::strand<net::any_io_executor> strand;
    /// Expires (at once, and for every later wait) when the watch stops; only on `strand`.
    net::steady_timer stop_timer;
    std::mutex mutex;  // held while a callback runs, so the destructor waits for it
    bool stopped = false;
    const std::function<void(const Lease&)> on_change;
    const std::function<void()> on_resync;
    const std::shared_ptr<BadRecordLog> bad;
    /// The store revision from which every change was delivered (the store's when the feed
    /// (re)started, then each event's), and whether the next round must start again from the
    /// store's current revision (a resync); only on `strand`.
    std::int64_t revision = 0;
    bool resync_needed = true;

    bool is_stopped() {
        std::lock_guard lock(mutex);
        return stopped;
    }
    void deliver(const etcd::KeyValue& kv);
    void resynced() {
        std::lock_guard lock(mutex);
        if (!stopped && on_resync) on_resync();
    }
};

/// The change feed of one EtcdRegistry: a coroutine on a strand of the registry's executor
/// that reads the store's current revision (one key of the prefix, without its value), says
/// so through on_resync, then follows a watch from that revision. When the watch breaks (etcd
/// restarted, a connection lost) it watches again from the last revision it delivered, so etcd
/// replays only what changed meanwhile; it starts again from the current revision, with a
/// resync, only when etcd canceled the watch (that revision was compacted) or the store is
/// behind that revision (a different store). It never lists the leases: a listing reads and
/// decodes every lease record of the store, seconds of CPU once it holds many thousands, at
/// every node start and after every compaction (fault trials, issue 15); the caller reconciles
/// what it holds instead, which costs what it holds.
class EtcdLeaseWatch final : public LeaseWatch {
public:
    explicit EtcdLeaseWatch(std::shared_ptr<WatchState> state) : state_(std::move(state)) {}
    EtcdLeaseWatch(const EtcdLeaseWatch&) = delete;
    EtcdLeaseWatch& operator=(const EtcdLeaseWatch&) = delete;
    ~EtcdLeaseWatch() override {
        // Only the lock and the post's allocation can fail: the process cannot go on then.
        try {
            {
                // Waits for a callback in progress; none starts after this.
                std::lock_guard lock(state_->mutex);
                state_->stopped = true;
            }
            net::post(state_->strand, [state = state_] {
                state->stop_timer.expires_at(std::chrono::steady_clock::time_point::min());
            });
        } catch (...) {
            std::terminate();
        }
    }

private:
    std::shared_ptr<WatchState> state_;
};

awaitable<void> run_watch(std::shared_ptr<etcd::Client> client, std::shared_ptr<WatchState> state,
                          std::string prefix, std::chrono::milliseconds retry);

class EtcdRegistry final : public Registry {
public:
    EtcdRegistry(net::any_io_executor ex, std::vector<std::string> endpoints, std::string prefix,
                 std::int64_t node_ttl_ms, std::string username, std::string password,
                 etcd::TlsSource tls, Counter* bad_records)
        : ex_(ex),
          bad_(std::make_shared<BadRecordLog>(bad_records)),
          client_(std::make_shared<etcd::Client>(ex, endpoints, username, password, request_timeout,
                                                 tls)),
          membership_(std::make_shared<etcd::Client>(ex, std::move(endpoints), std::move(username),
                                                     std::move(password), request_timeout, tls)),
          prefix_(std::move(prefix)),
          node_ttl_s_(std::max<std::int64_t>(1, (node_ttl_ms + 999) / 1000)) {
        if (node_ttl_ms <= 0) throw std::invalid_argument("etcd registry: node TTL must be > 0");
    }

    std::unique_ptr<LeaseWatch> watch_leases(net::any_io_executor ex,
                                             std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync,
                                             std::int64_t retry_ms) override {
        auto state = std::make_shared<WatchState>(std::move(ex), std::move(on_change),
                                                  std::move(on_resync), bad_);
        net::co_spawn(state->strand,
                      run_watch(client_, state, prefix_ + "leases/",
                                std::chrono::milliseconds(std::max<std::int64_t>(retry_ms, 10))),
                      net::detached);
        return std::make_unique<EtcdLeaseWatch>(std::move(state));
    }

    awaitable<Lease> create_lease(Lease lease) override {
        return guarded<Lease>("create lease", do_create(std::move(lease)));
    }
    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        return guarded<std::optional<Lease>>("get lease", read_lease(std::move(id), "get lease"));
    }
    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        return guarded<std::optional<Lease>>(
            "find lease by idempotency key",
            do_find_idem(std::move(company_id), std::move(environment_id), std::move(key)));
    }
    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        return guarded<std::optional<Lease>>(
            "find lease by provider lease id",
            do_find_plid(std::move(provider), std::move(provider_lease_id)));
    }
    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        return guarded<LeasePage>("list leases", do_list(std::move(query)));
    }
    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        return guarded<std::optional<Lease>>("update lease",
                                             do_update(std::move(next), expected_epoch));
    }
    awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) override {
        return guarded<std::optional<Lease>>(
            "update lease",
            do_update(std::move(next), expected_epoch, OwnerFence{std::move(owner_seen)}));
    }
    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        return guarded<std::vector<Lease>>("expired leases",
                                           do_expired(std::move(owner_node_id), at_ms));
    }
    awaitable<std::vector<std::string>> active_owner_nodes() override {
        return guarded<std::vector<std::string>>("active owner nodes", do_active_owners());
    }
    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        return guarded<void>("register node", do_register(std::move(node), liveness_ttl_ms));
    }
    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        return guarded<bool>("heartbeat node",
                             do_heartbeat(std::move(node_id), std::move(instance_id), at_ms));
    }
    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        return guarded<void>("remove node", do_remove(std::move(node_id), std::move(instance_id)));
    }
    awaitable<std::vector<NodeRecord>> list_nodes() override {
        return guarded<std::vector<NodeRecord>>("list nodes", do_list_nodes());
    }
    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        return guarded<std::optional<NodeRecord>>("get node", do_get_node(std::move(node_id)));
    }

private:
    // --- keys ------------------------------------------------------------------------------
    std::string lease_key(std::string_view id) const { return prefix_ + "leases/" + escape(id); }
    std::string idem_key(std::string_view company, std::string_view environment,
                         std::string_view key) const {
        return prefix_ + "idem/" + escape(company) + "/" + escape(environment) + "/" + escape(key);
    }
    std::string plid_key(std::string_view provider, std::string_view provider_lease_id) const {
        return prefix_ + "plid/" + escape(provider) + "/" + escape(provider_lease_id);
    }
    std::string owner_base(lease_status status) const {
        return prefix_ + "owner/" + std::string(to_string(status)) + "/";
    }
    std::string owner_prefix(lease_status status, std::string_view node) const {
        return owner_base(status) + escape(node) + "/";
    }
    static std::string owner_suffix(std::int64_t acquired_at_ms, std::string_view id) {
        return sortable(acquired_at_ms) + "/" + escape(id);
    }
    std::string owner_key(const Lease& l) const {
        return owner_prefix(l.status, l.owner_node_id) + owner_suffix(l.acquired_at_ms, l.id);
    }
    static std::string owner_value(const Lease& l) {
        return json{{"expiresAtMs", l.expires_at_ms ? json(*l.expires_at_ms) : json(nullptr)}}
            .dump();
    }
    std::string node_key(std::string_view id) const { return prefix_ + "nodes/" + escape(id); }
    std::string meta_key() const { return prefix_ + "meta/indexes"; }
    /// The txn writes that mark the store as indexed. Not in the coroutine: GCC 12 rejects
    /// some string literals in coroutine bodies ("array used as initializer").
    json mark_indexed() const { return json::array({etcd::request_put(meta_key(), "1")}); }
    static void log_indexed(std::size_t written) {
        spdlog::info("registry: indexed {} lease(s) stored without index keys", written);
    }

    /// Decodes an owner index key below `base` (an owner_prefix).
    static OwnerEntry decode_owner(const etcd::KeyValue& kv, std::string_view base) {
        OwnerEntry e;
        e.suffix = kv.key.substr(base.size());
        auto slash = e.suffix.find('/');
        if (slash == std::string::npos) throw std::invalid_argument("bad index key " + kv.key);
        e.id = unescape(std::string_view(e.suffix).substr(slash + 1));
        if (!kv.value.empty()) {
            auto v = try_parse_json(kv.value);
            const json* x = nullptr;
            if (v.ok() && v.value.is_object()) {
                auto it = v.value.find("expiresAtMs");
                if (it != v.value.end()) x = &*it;
            }
            if (x != nullptr && x->is_number_integer()) {
                e.expires_at_ms = x->get<std::int64_t>();
            } else if (x == nullptr || !x->is_null()) {
                // An index value that cannot be read: the lease's record decides (the sweeper
                // reads it as possibly expired and checks the record itself).
                e.expires_at_ms = std::numeric_limits<std::int64_t>::min();
            }
        }
        return e;
    }

    // --- reads -----------------------------------------------------------------------------
    /// decode_lease, logging and counting a bad record before passing its error on.
    Lease strict_decode(const etcd::KeyValue& kv, std::string_view op) {
        try {
            return decode_lease(kv, op);
        } catch (const unreadable_lease& e) {
            bad_->note(e);
            throw;
        }
    }
    /// decode_lease, or std::nullopt (logged and counted) for a bad record: for listings.
    std::optional<Lease> lenient_decode(const etcd::KeyValue& kv, std::string_view op) {
        try {
            return decode_lease(kv, op);
        } catch (const unreadable_lease& e) {
            bad_->note(e);
            return std::nullopt;
        }
    }

    awaitable<std::optional<Lease>> read_lease(std::string id, std::string op) {
        auto kv = co_await client_->get(op, lease_key(id));
        if (!kv) co_return std::nullopt;
        co_return strict_decode(*kv, op);
    }

    /// The leases with these ids that exist, in the order given, read in batched txns.
    awaitable<std::vector<Lease>> read_leases(std::vector<std::string> ids, std::string op) {
        std::vector<Lease> out;
        for (std::size_t from = 0; from < ids.size(); from += txn_ops) {
            json reads = json::array();
            for (std::size_t i = from; i < std::min(ids.size(), from + txn_ops); ++i) {
                reads.push_back(etcd::request_range(lease_key(ids[i])));
            }
            auto result = co_await client_->txn(op, json::array(), std::move(reads));
            for (const auto& r : result.responses) {
                for (const auto& kv : etcd::txn_range_kvs(r)) {
                    if (auto l = lenient_decode(kv, op)) out.push_back(std::move(*l));
                }
            }
        }
        co_return out;
    }

    /// At most `n` owner index entries after `after` (a suffix; empty: from the start) over
    /// `nodes` x `statuses`, in suffix order, i.e. by (acquiredAt, escaped id): one range of
    /// at most `n` keys per (status, node), all at one revision (the first answer's), merged.
    /// At one revision a lease whose status changes meanwhile is seen once (its old and new
    /// index keys change in one txn); read again at the newest revision if that one is
    /// compacted between two ranges. Costs O(nodes x statuses x n) keys, whatever the number
    /// of leases stored: never a scan of the whole index.
    awaitable<std::vector<OwnerEntry>> owner_entries(std::vector<std::string> nodes,
                                                     std::vector<lease_status> statuses,
                                                     std::string after, std::size_t n,
                                                     std::string op) {
        for (int attempt = 0;; ++attempt) {
            std::vector<OwnerEntry> out;
            std::int64_t revision = 0;
            try {
                for (const auto& node : nodes) {
                    for (auto st : statuses) {
                        const std::string base = owner_prefix(st, node);
                        std::string from = base;
                        if (!after.empty()) from += after + std::string(1, '\0');
                        auto r = co_await client_->range(op, from, etcd::prefix_end(base),
                                                         static_cast<std::int64_t>(n), revision);
                        if (revision == 0) revision = r.revision;
                        for (const auto& kv : r.kvs) out.push_back(decode_owner(kv, base));
                    }
                }
            } catch (const etcd::status_error& e) {
                if (e.code() != etcd::code_out_of_range || attempt >= 3) throw;
                continue;
            }
            std::sort(out.begin(), out.end(),
                      [](const OwnerEntry& a, const OwnerEntry& b) { return a.suffix < b.suffix; });
            if (out.size() > n) out.resize(n);
            co_return out;
        }
    }

    /// The nodes that have owner index keys of `status`, in key order: a skip scan, one range
    /// of one key per node (keys only), so it costs the number of such nodes, not of leases.
    awaitable<std::vector<std::string>> index_nodes(lease_status status, std::string op) {
        const std::string base = owner_base(status);
        const std::string end = etcd::prefix_end(base);
        std::vector<std::string> out;
        std::string from = base;
        for (;;) {
            auto r = co_await client_->range(op, from, end, 1, 0, /*keys_only=*/true);
            if (r.kvs.empty()) break;
            const std::string rest = r.kvs.front().key.substr(base.size());
            const auto slash = rest.find('/');
            if (slash == std::string::npos) throw std::invalid_argument("bad index key " + rest);
            out.push_back(unescape(std::string_view(rest).substr(0, slash)));
            from = etcd::prefix_end(base + rest.substr(0, slash + 1));
        }
        co_return out;
    }

    /// Writes the missing index keys of leases stored before they existed, once per store (the
    /// marker key says it was done) and per process. Idempotent: each lease's keys are written
    /// in a txn that compares its record's revision, so a lease changed meanwhile is left to
    /// the write that changed it.
    awaitable<void> ensure_indexed() {
        if (indexed_.load()) co_return;
        const std::string op = "index leases";
        auto marker = co_await client_->get(op, meta_key());
        if (!marker) {
            auto all = co_await client_->get_prefix(op, prefix_ + "leases/");
            std::size_t written = 0;
            for (std::size_t from = 0; from < all.kvs.size(); from += txn_ops / 2) {
                const std::size_t to = std::min(all.kvs.size(), from + txn_ops / 2);
                json compare = json::array();
                json puts = json::array();
                for (std::size_t i = from; i < to; ++i) {
                    const auto& kv = all.kvs[i];
                    auto decoded = lenient_decode(kv, op);
                    if (!decoded) continue;  // no index keys: it is unreadable anyway
                    const Lease& l = *decoded;
                    compare.push_back(etcd::compare_mod_revision(kv.key, kv.mod_revision));
                    puts.push_back(
                        etcd::request_put(plid_key(l.provider, l.provider_lease_id), l.id));
                    puts.push_back(etcd::request_put(owner_key(l), owner_value(l)));
                }
                auto result = co_await client_->txn(op, compare, puts);
                if (result.succeeded) {
                    written += to - from;
                    continue;
                }
                // One of them changed meanwhile: one at a time, skipping the changed ones
                // (their writer wrote their keys).
                for (std::size_t i = from; i < to; ++i) {
                    auto one = co_await client_->txn(
                        op, array_of(compare[i - from]),
                        array_of(puts[2 * (i - from)], puts[2 * (i - from) + 1]));
                    if (one.succeeded) ++written;
                }
            }
            co_await client_->txn(op, json::array(), mark_indexed());
            log_indexed(written);
        }
        indexed_.store(true);
    }

    // --- leases ----------------------------------------------------------------------------
    awaitable<Lease> do_create(Lease lease) {
        const std::string op = "create lease";
        const std::string lk = lease_key(lease.id);
        json compare = json::array({etcd::compare_create_revision(lk, 0)});
        json success = json::array(
            {etcd::request_put(lk, encode_lease(lease, 0)),
             etcd::request_put(plid_key(lease.provider, lease.provider_lease_id), lease.id),
             etcd::request_put(owner_key(lease), owner_value(lease))});
        json failure = json::array();
        if (lease.idempotency_key) {
            const std::string ik =
                idem_key(lease.company_id, lease.environment_id, *lease.idempotency_key);
            compare.push_back(etcd::compare_create_revision(ik, 0));
            success.push_back(etcd::request_put(ik, lease.id));
            failure.push_back(etcd::request_range(ik));
        }
        auto result =
            co_await client_->txn(op, std::move(compare), std::move(success), std::move(failure));
        if (result.succeeded) {
            lease.epoch = result.revision;  // the claim's revision is the first epoch
            co_return lease;
        }
        if (lease.idempotency_key && !result.responses.empty()) {
            auto kvs = etcd::txn_range_kvs(result.responses.at(0));
            if (!kvs.empty()) {
                auto existing = co_await read_lease(kvs.front().value, op);
                if (!existing) throw_unavailable(op, "idempotency clash without a lease");
                co_return std::move(*existing);
            }
        }
        throw_unavailable(op, "lease id " + lease.id + " already exists");
    }

    awaitable<std::optional<Lease>> do_find_idem(std::string company_id, std::string environment_id,
                                                 std::string key) {
        const std::string op = "find lease by idempotency key";
        auto kv = co_await client_->get(op, idem_key(company_id, environment_id, key));
        if (!kv) co_return std::nullopt;
        auto lease = co_await read_lease(kv->value, op);
        if (!lease || lease->company_id != company_id || lease->environment_id != environment_id) {
            co_return std::nullopt;
        }
        co_return lease;
    }

    awaitable<std::optional<Lease>> do_find_plid(std::string provider,
                                                 std::string provider_lease_id) {
        const std::string op = "find lease by provider lease id";
        co_await ensure_indexed();
        auto kv = co_await client_->get(op, plid_key(provider, provider_lease_id));
        if (!kv) co_return std::nullopt;
        auto lease = co_await read_lease(kv->value, op);
        if (!lease || lease->provider != provider ||
            lease->provider_lease_id != provider_lease_id) {
            co_return std::nullopt;
        }
        co_return lease;
    }

    awaitable<LeasePage> do_list(LeaseQuery query) {
        const std::string op = "list leases";
        std::optional<std::pair<std::int64_t, std::string>> after;
        if (!query.cursor.empty()) after = decode_cursor(query.cursor);
        const auto limit = std::clamp<std::size_t>(query.limit, 1, max_page);

        auto matches = [&](const Lease& l) {
            if (query.company_id && l.company_id != *query.company_id) return false;
            if (query.environment_id && l.environment_id != *query.environment_id) return false;
            if (query.status && l.status != *query.status) return false;
            if (query.owner_node_id && l.owner_node_id != *query.owner_node_id) return false;
            if (!query.tenants.empty() && std::find(query.tenants.begin(), query.tenants.end(),
                                                    l.company_id) == query.tenants.end()) {
                return false;
            }
            return true;
        };

        // From the owner index, in its (acquiredAt, escaped id) order, over the one owner asked
        // for or over every node that has index keys of the statuses asked for: chunks of
        // limit + 1 entries until limit + 1 records match (one more tells whether a next page
        // exists). Each chunk reads at most limit + 1 keys per (node, status), starting after
        // the cursor, so a page costs the same with 100 leases stored or 100,000: reading
        // every index key for each page (as before) made a listing of the whole store
        // quadratic, and its pages took 2 s each with 13,000 leases.
        co_await ensure_indexed();
        std::vector<lease_status> statuses;
        if (query.status) {
            statuses.push_back(*query.status);
        } else {
            statuses.assign(all_statuses.begin(), all_statuses.end());
        }
        std::vector<std::string> nodes;
        if (query.owner_node_id) {
            nodes.push_back(*query.owner_node_id);
        } else {
            std::set<std::string> seen;
            for (auto st : statuses) {
                for (auto& n : co_await index_nodes(st, op)) seen.insert(std::move(n));
            }
            nodes.assign(seen.begin(), seen.end());
        }
        std::vector<Lease> leases;
        std::string from = after ? owner_suffix(after->first, after->second) : std::string();
        std::set<std::string> listed;  // ids: a lease is listed once, whatever its records say
        while (!nodes.empty()) {
            auto entries = co_await owner_entries(nodes, statuses, from, limit + 1, op);
            std::vector<std::string> ids;
            ids.reserve(entries.size());
            for (const auto& e : entries) ids.push_back(e.id);
            auto fetched = co_await read_leases(std::move(ids), op);
            // read_leases keeps the index order, which is the cursor's order; a lease whose
            // status changed between the index and its record read has matches() against its
            // record (its acquiredAt, hence its place, never changes).
            for (auto& l : fetched) {
                if (matches(l) && leases.size() <= limit && listed.insert(l.id).second) {
                    leases.push_back(std::move(l));
                }
            }
            if (leases.size() > limit || entries.size() <= limit) break;
            from = entries.back().suffix;
        }

        LeasePage page;
        if (leases.size() > limit) {
            leases.resize(limit);
            page.next_cursor = encode_cursor(leases.back());
        }
        page.leases = std::move(leases);
        co_return page;
    }

    /// The membership record that an update requires of the lease's owner (std::nullopt:
    /// none): compared by mod revision (or absence) in the update's transaction.
    struct OwnerFence {
        std::optional<NodeRecord> seen;
    };

    awaitable<std::optional<Lease>> do_update(Lease next, std::int64_t expected_epoch,
                                              std::optional<OwnerFence> fence = std::nullopt) {
        const std::string op = "update lease";
        const std::string lk = lease_key(next.id);
        const bool new_epoch = next.epoch != expected_epoch;
        const std::string nk = node_key(next.owner_node_id);
        auto fence_compare = [&] {
            return fence->seen ? etcd::compare_mod_revision(nk, fence->seen->revision)
                               : etcd::compare_create_revision(nk, 0);
        };
        for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
            auto kv = co_await client_->get(op, lk);
            if (!kv) co_return std::nullopt;
            Lease stored = strict_decode(*kv, op);
            if (stored.epoch != expected_epoch) co_return std::nullopt;
            const std::string old_owner_key = owner_key(stored);
            stored.status = next.status;
            stored.owner_node_id = next.owner_node_id;
            stored.last_used_at_ms = next.last_used_at_ms;
            stored.expires_at_ms = next.expires_at_ms;
            stored.released_at_ms = next.released_at_ms;
            stored.failure_reason = next.failure_reason;
            stored.cleanup_status = next.cleanup_status;
            stored.cleanup_attempts = next.cleanup_attempts;
            stored.metadata = next.metadata;
            json writes = json::array(
                {etcd::request_put(lk, encode_lease(stored, new_epoch ? 0 : expected_epoch))});
            const std::string new_owner_key = owner_key(stored);
            if (new_owner_key != old_owner_key)
                writes.push_back(etcd::request_delete(old_owner_key));
            writes.push_back(etcd::request_put(new_owner_key, owner_value(stored)));
            json compares = array_of(etcd::compare_mod_revision(lk, kv->mod_revision));
            if (fence) compares.push_back(fence_compare());
            auto result = co_await client_->txn(op, std::move(compares), std::move(writes));
            if (result.succeeded) {
                stored.epoch = new_epoch ? result.revision : expected_epoch;
                co_return stored;
            }
            if (fence) {
                // Which compare failed: an owner record that moved ends the attempt.
                auto owner = co_await client_->get(op, nk);
                const bool unchanged =
                    fence->seen ? owner && owner->mod_revision == fence->seen->revision : !owner;
                if (!unchanged) co_return std::nullopt;
            }
            // Another writer came between the read and the write: read again.
        }
        throw_unavailable(op, "lease " + next.id + " keeps changing under contention");
    }

    awaitable<std::vector<Lease>> do_expired(std::string owner_node_id, std::int64_t at_ms) {
        const std::string op = "expired leases";
        co_await ensure_indexed();
        const std::string base = owner_prefix(lease_status::active, owner_node_id);
        auto index = co_await client_->get_prefix(op, base);
        std::vector<std::string> ids;
        for (const auto& kv : index.kvs) {
            auto e = decode_owner(kv, base);
            if (e.expires_at_ms && *e.expires_at_ms <= at_ms) ids.push_back(std::move(e.id));
        }
        auto leases = co_await read_leases(std::move(ids), op);
        std::erase_if(leases, [&](const Lease& l) {
            return !(l.owner_node_id == owner_node_id && l.status == lease_status::active &&
                     l.expires_at_ms && *l.expires_at_ms <= at_ms);
        });
        std::sort(leases.begin(), leases.end(), [](const Lease& a, const Lease& b) {
            return std::tie(*a.expires_at_ms, a.id) < std::tie(*b.expires_at_ms, b.id);
        });
        co_return leases;
    }

    /// A skip scan of the active owner index: one keys-only range of one key per node.
    awaitable<std::vector<std::string>> do_active_owners() {
        const std::string op = "active owner nodes";
        co_await ensure_indexed();
        co_return co_await index_nodes(lease_status::active, op);
    }

    // --- nodes (the membership lane: membership_, a connection of its own) ----------------
    awaitable<void> do_register(NodeRecord node, std::int64_t liveness_ttl_ms) {
        const std::string op = "register node";
        const std::string nk = node_key(node.node_id);
        std::int64_t granted = 0;
        std::exception_ptr failed;
        try {
            for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
                auto kv = co_await membership_->get(op, nk);
                json compare;
                std::int64_t old_lease = 0;
                if (kv) {
                    auto held = decode_node(*kv, op);
                    if (held.instance_id != node.instance_id &&
                        held.heartbeat_at_ms > node.heartbeat_at_ms - liveness_ttl_ms) {
                        throw rpc_error(
                            errc::invalid_params,
                            "node id " + node.node_id +
                                " is already held by a live process (last heartbeat " +
                                std::to_string(node.heartbeat_at_ms - held.heartbeat_at_ms) +
                                " ms ago)");
                    }
                    old_lease = kv->lease;
                    compare = etcd::compare_mod_revision(nk, kv->mod_revision);
                } else {
                    compare = etcd::compare_create_revision(nk, 0);
                }
                if (granted == 0) granted = co_await membership_->lease_grant(op, node_ttl_s_);
                auto result = co_await membership_->txn(
                    op, array_of(std::move(compare)),
                    array_of(etcd::request_put(nk, encode_node(node), granted)));
                if (!result.succeeded) continue;
                // The record moved to the new etcd lease; the old one (a refresh of this
                // instance, or a dead instance's) holds nothing any more.
                if (old_lease != 0 && old_lease != granted) {
                    try {
                        co_await membership_->lease_revoke(op, old_lease);
                    } catch (...) {  // best effort: it expires on its own
                    }
                }
                co_return;
            }
            throw_unavailable(op, "node " + node.node_id + " keeps changing under contention");
        } catch (...) {
            failed = std::current_exception();
        }
        if (granted != 0) {
            try {
                co_await membership_->lease_revoke(op, granted);
            } catch (...) {  // best effort: it expires on its own after its TTL
            }
        }
        std::rethrow_exception(failed);
    }

    awaitable<bool> do_heartbeat(std::string node_id, std::string instance_id, std::int64_t at_ms) {
        const std::string op = "heartbeat node";
        const std::string nk = node_key(node_id);
        bool renewed = false;
        for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
            auto kv = co_await membership_->get(op, nk);
            if (!kv) co_return false;
            auto record = decode_node(*kv, op);
            if (record.instance_id != instance_id) co_return false;
            if (kv->lease != 0 && !renewed) {
                // A TTL of 0 (omitted) means the etcd lease expired: the record is gone or
                // about to be, and this instance has lost its membership.
                if (co_await membership_->lease_keepalive(op, kv->lease) <= 0) co_return false;
                renewed = true;
            }
            record.heartbeat_at_ms = at_ms;
            try {
                auto result = co_await membership_->txn(
                    op, array_of(etcd::compare_mod_revision(nk, kv->mod_revision)),
                    array_of(etcd::request_put(nk, encode_node(record), kv->lease)));
                if (result.succeeded) co_return true;
            } catch (const etcd::status_error& e) {
                if (e.code() == etcd::code_not_found) co_return false;  // lease expired
                throw;
            }
        }
        throw_unavailable(op, "node " + node_id + " keeps changing under contention");
    }

    awaitable<void> do_remove(std::string node_id, std::string instance_id) {
        const std::string op = "remove node";
        const std::string nk = node_key(node_id);
        for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
            auto kv = co_await membership_->get(op, nk);
            if (!kv) co_return;
            if (decode_node(*kv, op).instance_id != instance_id) co_return;
            auto result = co_await membership_->txn(
                op, array_of(etcd::compare_mod_revision(nk, kv->mod_revision)),
                array_of(etcd::request_delete(nk)));
            if (!result.succeeded) continue;
            if (kv->lease != 0) co_await membership_->lease_revoke(op, kv->lease);
            co_return;
        }
        throw_unavailable(op, "node " + node_id + " keeps changing under contention");
    }

    awaitable<std::vector<NodeRecord>> do_list_nodes() {
        const std::string op = "list nodes";
        std::vector<NodeRecord> out;
        auto all = co_await membership_->get_prefix(op, prefix_ + "nodes/");
        for (const auto& kv : all.kvs) {
            try {
                out.push_back(decode_node(kv, op));
            } catch (const rpc_error& e) {  // skipped: the others are served
                bad_->note("node " + lease_id_of_key(kv.key), kv.mod_revision, e.what());
            }
        }
        std::sort(out.begin(), out.end(),
                  [](const NodeRecord& a, const NodeRecord& b) { return a.node_id < b.node_id; });
        co_return out;
    }

    awaitable<std::optional<NodeRecord>> do_get_node(std::string node_id) {
        const std::string op = "get node";
        auto kv = co_await membership_->get(op, node_key(node_id));
        if (!kv) co_return std::nullopt;
        co_return decode_node(*kv, op);
    }

    net::any_io_executor ex_;
    /// Shared with the change feeds, which may outlive the registry by a callback.
    std::shared_ptr<BadRecordLog> bad_;
    /// Lease calls and the watch.
    std::shared_ptr<etcd::Client> client_;
    /// The membership lane: node calls only, so no lease backlog delays a heartbeat.
    std::shared_ptr<etcd::Client> membership_;
    const std::string prefix_;
    const std::int64_t node_ttl_s_;
    std::atomic<bool> indexed_{false};
};

void WatchState::deliver(const etcd::KeyValue& kv) {
    std::optional<Lease> lease;
    try {
        lease = decode_lease(kv, "watch leases");
    } catch (const unreadable_lease& e) {
        bad->note(e);  // skipped: every other read of it fails closed as well
        return;
    }
    std::lock_guard lock(mutex);
    if (!stopped) on_change(*lease);
}

/// The store's current revision (header.revision of a read of at most one key of `prefix`,
/// keys only), or std::nullopt when it failed. Never throws: `op || stop` completes on the
/// first operation that succeeds (wait_for_one_success), so a throwing op would wait for stop.
awaitable<std::optional<std::int64_t>> try_current_revision(std::shared_ptr<etcd::Client> client,
                                                            std::string op, std::string prefix) {
    try {
        const std::string end = etcd::prefix_end(prefix);
        auto page = co_await client->range(op, std::move(prefix), end, 1, 0, true);
        co_return page.revision;
    } catch (const std::exception&) {
        co_return std::nullopt;  // etcd unreachable: try again after the pause
    }
}

/// Follows the watch until it ends or fails (see try_current_revision).
awaitable<void> try_watch(std::shared_ptr<etcd::Client> client, std::shared_ptr<WatchState> state,
                          std::string op, std::string prefix, std::int64_t start_revision) {
    auto on_message = [state](const etcd::WatchMessage& m) {
        if (m.canceled) {
            state->resync_needed = true;  // compacted past the start revision, or ended by etcd
            return;
        }
        if (m.created && m.revision < state->revision) {
            // The store is behind what this watch delivered: not the store it watched. Ends
            // the watch (Client::watch passes the exception on); the next round resyncs.
            state->resync_needed = true;
            throw std::runtime_error("etcd's revision went back");
        }
        for (const auto& ev : m.events) {
            if (!ev.deleted) state->deliver(ev.kv);
            state->revision = std::max(state->revision, ev.kv.mod_revision);
        }
    };
    try {
        co_await client->watch(op, prefix, start_revision, std::move(on_message));
    } catch (const std::exception&) {
        // etcd unreachable or the stream carried an error: watch again (resync if needed).
    }
}

awaitable<void> run_watch(std::shared_ptr<etcd::Client> client, std::shared_ptr<WatchState> state,
                          std::string prefix, std::chrono::milliseconds retry) {
    using namespace net::experimental::awaitable_operators;
    const std::string op = "watch leases";
    net::steady_timer pause(state->strand);
    while (!state->is_stopped()) {
        if (state->resync_needed) {
            auto current = co_await (try_current_revision(client, op, prefix) ||
                                     state->stop_timer.async_wait(as_tuple_awaitable));
            if (current.index() == 1) break;
            if (const auto& revision = std::get<0>(current)) {
                state->revision = *revision;
                state->resync_needed = false;
                state->resynced();
            }
        }
        if (!state->resync_needed) {
            co_await (try_watch(client, state, op, prefix, state->revision + 1) ||
                      state->stop_timer.async_wait(as_tuple_awaitable));
        }
        pause.expires_after(retry);
        co_await (pause.async_wait(as_tuple_awaitable) ||
                  state->stop_timer.async_wait(as_tuple_awaitable));
    }
}

}  // namespace

std::unique_ptr<Registry> make_etcd_registry(net::any_io_executor ex,
                                             std::vector<std::string> endpoints, std::string prefix,
                                             std::int64_t node_ttl_ms, std::string username,
                                             std::string password, etcd::TlsSource tls,
                                             Counter* bad_records) {
    return std::make_unique<EtcdRegistry>(std::move(ex), std::move(endpoints), std::move(prefix),
                                          node_ttl_ms, std::move(username), std::move(password),
                                          std::move(tls), bad_records);
}

}  // namespace sandboxd
