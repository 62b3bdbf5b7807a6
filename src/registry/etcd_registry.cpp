// The etcd backend of the lease registry, through etcd's v3 JSON gateway (etcd_client.hpp).
//
// Layout under the prefix (path components percent-encode '%' and '/'):
//   <prefix>leases/<id>                      JSON of every stored Lease field (lease_fields.hpp)
//   <prefix>idem/<company>/<env>/<key>       the lease id made with that idempotency key
//   <prefix>nodes/<nodeId>                   JSON of the NodeRecord, attached to the node's
//                                            etcd lease so that it vanishes when the node dies
// Writes are transactions that compare create or mod revisions, so several processes may share
// one prefix.
#include "registry/etcd_client.hpp"

#include "core/offload.hpp"
#include "registry/cursor.hpp"

#include <sandboxd/errors.hpp>
#include <sandboxd/lease_fields.hpp>
#include <sandboxd/registry.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/strand.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <string_view>
#include <thread>
#include <utility>

namespace sandboxd {
namespace {

using json = nlohmann::json;
namespace net = boost::asio;

constexpr std::size_t max_page = 1000;
constexpr int max_cas_attempts = 8;
constexpr std::chrono::milliseconds request_timeout{2000};

[[noreturn]] void throw_unavailable(std::string_view op, std::string_view detail) {
    throw rpc_error(errc::registry_unavailable,
                    "registry: " + std::string(op) + ": " + std::string(detail));
}

/// Runs `f`, turning etcd error answers and malformed answers into registry_unavailable.
template <typename F>
auto guarded(std::string_view op, F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (const etcd::status_error& e) {
        throw_unavailable(op, "etcd: " + std::string(e.what()));
    } catch (const json::exception& e) {
        throw_unavailable(op, std::string("malformed answer or record: ") + e.what());
    } catch (const std::invalid_argument& e) {
        throw_unavailable(op, std::string("malformed answer or record: ") + e.what());
    }
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

// --- records -----------------------------------------------------------------------------

// A lease record is a JSON object with one key per stored field of lease_fields
// (sandboxd/lease_fields.hpp), named like the SQLite columns.

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
    void operator()(std::string Lease::*m) const { l.*m = j.at(key).get<std::string>(); }
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

Lease decode_lease(const etcd::KeyValue& kv, std::string_view op) {
    try {
        json j = json::parse(kv.value);
        Lease l;
        for (const auto& f : lease_fields) {
            if (f.stored()) std::visit(RecordReader{j, f, op, l}, f.member);
        }
        if (l.epoch == 0) l.epoch = kv.mod_revision;  // set by this write: its revision
        return l;
    } catch (const json::exception&) {
        throw_unavailable(op, "corrupt lease record " + kv.key);
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
        json j = json::parse(kv.value);
        NodeRecord n;
        n.node_id = get_str(j, "node_id");
        n.url = get_str(j, "url");
        n.started_at_ms = get_int(j, "started_at_ms");
        n.heartbeat_at_ms = get_int(j, "heartbeat_at_ms");
        n.instance_id = get_str(j, "instance_id");
        return n;
    } catch (const json::exception&) {
        throw_unavailable(op, "corrupt node record " + kv.key);
    }
}

bool by_acquired(const Lease& a, const Lease& b) {
    return std::tie(a.acquired_at_ms, a.id) < std::tie(b.acquired_at_ms, b.id);
}

/// Revokes a granted etcd lease on scope exit unless released.
class LeaseGuard {
public:
    LeaseGuard(etcd::Client& client, std::string_view op) : client_(client), op_(op) {}
    LeaseGuard(const LeaseGuard&) = delete;
    LeaseGuard& operator=(const LeaseGuard&) = delete;
    ~LeaseGuard() {
        if (id_ == 0) return;
        try {
            client_.lease_revoke(op_, id_);
        } catch (...) {  // best effort: it expires on its own after its TTL
        }
    }
    std::int64_t get(std::int64_t ttl_s) {
        if (id_ == 0) id_ = client_.lease_grant(op_, ttl_s);
        return id_;
    }
    void release() { id_ = 0; }

private:
    etcd::Client& client_;
    std::string_view op_;
    std::int64_t id_ = 0;
};

/// The change feed of one EtcdRegistry: a thread that lists the leases, then follows a watch
/// on them from the listing's revision, listing again whenever the watch ends (broken,
/// compacted, canceled).
class EtcdLeaseWatch final : public LeaseWatch {
public:
    EtcdLeaseWatch(etcd::Client& client, std::string leases_prefix,
                   std::function<void(const Lease&)> on_change, std::function<void()> on_resync,
                   std::chrono::milliseconds retry)
        : client_(client),
          prefix_(std::move(leases_prefix)),
          on_change_(std::move(on_change)),
          on_resync_(std::move(on_resync)),
          retry_(retry),
          thread_([this] { run(); }) {}

    ~EtcdLeaseWatch() override {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        wake_.notify_all();
        stop_.stop();
        thread_.join();
    }

private:
    void run() {
        constexpr std::string_view op = "watch leases";
        while (!stop_.stopped()) {
            try {
                std::int64_t revision = 0;
                auto kvs = client_.get_prefix(op, prefix_, &revision);
                for (const auto& kv : kvs) deliver(kv);
                if (on_resync_) on_resync_();
                client_.watch(op, prefix_, revision + 1, stop_, [this](const etcd::WatchMessage& m) {
                    for (const auto& ev : m.events) {
                        if (!ev.deleted) deliver(ev.kv);
                    }
                });
            } catch (const std::exception&) {
                // etcd unreachable or the stream carried an error: list and watch again.
            }
            std::unique_lock lock(mutex_);
            wake_.wait_for(lock, retry_, [this] { return stopping_; });
        }
    }

    void deliver(const etcd::KeyValue& kv) {
        std::optional<Lease> lease;
        try {
            lease = decode_lease(kv, "watch leases");
        } catch (const std::exception&) {
            return;  // a corrupt record: every other read of it fails closed as well
        }
        on_change_(*lease);
    }

    etcd::Client& client_;
    const std::string prefix_;
    const std::function<void(const Lease&)> on_change_;
    const std::function<void()> on_resync_;
    const std::chrono::milliseconds retry_;
    etcd::WatchStop stop_;
    std::mutex mutex_;
    std::condition_variable wake_;
    bool stopping_ = false;
    std::thread thread_;  // last: starts after every member above exists
};

/// The registry's calls, blocking (etcd_client.hpp); EtcdRegistry below runs them off the
/// awaiting thread.
class BlockingEtcdRegistry {
public:
    BlockingEtcdRegistry(std::vector<std::string> endpoints, std::string prefix,
                         std::int64_t node_ttl_ms, std::string username, std::string password)
        : client_(std::move(endpoints), std::move(username), std::move(password), request_timeout),
          prefix_(std::move(prefix)),
          node_ttl_s_(std::max<std::int64_t>(1, (node_ttl_ms + 999) / 1000)) {
        if (node_ttl_ms <= 0) throw std::invalid_argument("etcd registry: node TTL must be > 0");
    }

    std::unique_ptr<LeaseWatch> watch_leases(std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync,
                                             std::int64_t retry_ms) {
        return std::make_unique<EtcdLeaseWatch>(client_, prefix_ + "leases/", std::move(on_change),
                                                std::move(on_resync),
                                                std::chrono::milliseconds(std::max<std::int64_t>(
                                                    retry_ms, 10)));
    }

    Lease create_lease(const Lease& lease) {
        constexpr std::string_view op = "create lease";
        return guarded(op, [&] {
            const std::string lk = lease_key(lease.id);
            json compare = json::array({etcd::compare_create_revision(lk, 0)});
            json success = json::array({etcd::request_put(lk, encode_lease(lease, 0))});
            json failure = json::array();
            if (lease.idempotency_key) {
                const std::string ik =
                    idem_key(lease.company_id, lease.environment_id, *lease.idempotency_key);
                compare.push_back(etcd::compare_create_revision(ik, 0));
                success.push_back(etcd::request_put(ik, lease.id));
                failure.push_back(etcd::request_range(ik));
            }
            auto result =
                client_.txn(op, std::move(compare), std::move(success), std::move(failure));
            if (result.succeeded) {
                Lease stored = lease;
                stored.epoch = result.revision;  // the claim's revision is the first epoch
                return stored;
            }
            if (lease.idempotency_key && !result.responses.empty()) {
                const auto& rr = result.responses.at(0).at("response_range");
                if (auto kvs = rr.find("kvs"); kvs != rr.end() && !kvs->empty()) {
                    const auto existing_id = etcd::decode_kv(kvs->at(0)).value;
                    auto existing = read_lease(existing_id, op);
                    if (!existing) throw_unavailable(op, "idempotency clash without a lease");
                    return std::move(*existing);
                }
            }
            throw_unavailable(op, "lease id " + lease.id + " already exists");
        });
    }

    std::optional<Lease> get_lease(const std::string& id) {
        constexpr std::string_view op = "get lease";
        return guarded(op, [&] { return read_lease(id, op); });
    }

    std::optional<Lease> find_by_idempotency_key(const std::string& company_id,
                                                 const std::string& environment_id,
                                                 const std::string& key) {
        constexpr std::string_view op = "find lease by idempotency key";
        return guarded(op, [&]() -> std::optional<Lease> {
            auto kv = client_.get(op, idem_key(company_id, environment_id, key));
            if (!kv) return std::nullopt;
            auto lease = read_lease(kv->value, op);
            if (!lease || lease->company_id != company_id ||
                lease->environment_id != environment_id) {
                return std::nullopt;
            }
            return lease;
        });
    }

    LeasePage list_leases(const LeaseQuery& query) {
        constexpr std::string_view op = "list leases";
        std::optional<std::pair<std::int64_t, std::string>> after;
        if (!query.cursor.empty()) after = decode_cursor(query.cursor);
        auto limit = std::clamp<std::size_t>(query.limit, 1, max_page);

        auto matches = [&](const Lease& l) {
            if (query.company_id && l.company_id != *query.company_id) return false;
            if (query.environment_id && l.environment_id != *query.environment_id) return false;
            if (query.status && l.status != *query.status) return false;
            if (query.owner_node_id && l.owner_node_id != *query.owner_node_id) return false;
            if (!query.tenants.empty() && std::find(query.tenants.begin(), query.tenants.end(),
                                                    l.company_id) == query.tenants.end()) {
                return false;
            }
            if (after &&
                std::tie(l.acquired_at_ms, l.id) <= std::tie(after->first, after->second)) {
                return false;
            }
            return true;
        };
        auto leases = guarded(op, [&] { return all_leases(op); });
        std::erase_if(leases, [&](const Lease& l) { return !matches(l); });
        std::sort(leases.begin(), leases.end(), by_acquired);

        LeasePage page;
        if (leases.size() > limit) {
            leases.resize(limit);
            page.next_cursor = encode_cursor(leases.back());
        }
        page.leases = std::move(leases);
        return page;
    }

    std::optional<Lease> update_lease(const Lease& next, std::int64_t expected_epoch) {
        constexpr std::string_view op = "update lease";
        return guarded(op, [&]() -> std::optional<Lease> {
            const std::string lk = lease_key(next.id);
            const bool new_epoch = next.epoch != expected_epoch;
            for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
                auto kv = client_.get(op, lk);
                if (!kv) return std::nullopt;
                Lease stored = decode_lease(*kv, op);
                if (stored.epoch != expected_epoch) return std::nullopt;
                stored.status = next.status;
                stored.owner_node_id = next.owner_node_id;
                stored.last_used_at_ms = next.last_used_at_ms;
                stored.expires_at_ms = next.expires_at_ms;
                stored.released_at_ms = next.released_at_ms;
                stored.failure_reason = next.failure_reason;
                stored.cleanup_status = next.cleanup_status;
                stored.cleanup_attempts = next.cleanup_attempts;
                stored.metadata = next.metadata;
                auto result = client_.txn(
                    op, json::array({etcd::compare_mod_revision(lk, kv->mod_revision)}),
                    json::array({etcd::request_put(
                        lk, encode_lease(stored, new_epoch ? 0 : expected_epoch))}));
                if (result.succeeded) {
                    stored.epoch = new_epoch ? result.revision : expected_epoch;
                    return stored;
                }
                // Another writer came between the read and the write: read again.
            }
            throw_unavailable(op, "lease " + next.id + " keeps changing under contention");
        });
    }

    std::vector<Lease> expired_leases(const std::string& owner_node_id,
                                      std::int64_t at_ms) {
        constexpr std::string_view op = "expired leases";
        auto leases = guarded(op, [&] { return all_leases(op); });
        std::erase_if(leases, [&](const Lease& l) {
            return !(l.owner_node_id == owner_node_id && l.status == lease_status::active &&
                     l.expires_at_ms && *l.expires_at_ms <= at_ms);
        });
        std::sort(leases.begin(), leases.end(), [](const Lease& a, const Lease& b) {
            return std::tie(*a.expires_at_ms, a.id) < std::tie(*b.expires_at_ms, b.id);
        });
        return leases;
    }

    void register_node(const NodeRecord& node, std::int64_t liveness_ttl_ms) {
        constexpr std::string_view op = "register node";
        guarded(op, [&] {
            const std::string nk = node_key(node.node_id);
            LeaseGuard granted(client_, op);
            for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
                auto kv = client_.get(op, nk);
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
                const std::int64_t lease_id = granted.get(node_ttl_s_);
                auto result =
                    client_.txn(op, json::array({std::move(compare)}),
                                json::array({etcd::request_put(nk, encode_node(node), lease_id)}));
                if (!result.succeeded) continue;
                granted.release();
                // The record moved to the new etcd lease; the old one (a refresh of this
                // instance, or a dead instance's) holds nothing any more.
                if (old_lease != 0 && old_lease != lease_id) {
                    try {
                        client_.lease_revoke(op, old_lease);
                    } catch (...) {  // best effort: it expires on its own
                    }
                }
                return;
            }
            throw_unavailable(op, "node " + node.node_id + " keeps changing under contention");
        });
    }

    bool heartbeat_node(const std::string& node_id, const std::string& instance_id,
                        std::int64_t at_ms) {
        constexpr std::string_view op = "heartbeat node";
        return guarded(op, [&] {
            const std::string nk = node_key(node_id);
            bool renewed = false;
            for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
                auto kv = client_.get(op, nk);
                if (!kv) return false;
                auto record = decode_node(*kv, op);
                if (record.instance_id != instance_id) return false;
                if (kv->lease != 0 && !renewed) {
                    // A TTL of 0 (omitted) means the etcd lease expired: the record is gone or
                    // about to be, and this instance has lost its membership.
                    if (client_.lease_keepalive(op, kv->lease) <= 0) return false;
                    renewed = true;
                }
                record.heartbeat_at_ms = at_ms;
                try {
                    auto result = client_.txn(
                        op, json::array({etcd::compare_mod_revision(nk, kv->mod_revision)}),
                        json::array({etcd::request_put(nk, encode_node(record), kv->lease)}));
                    if (result.succeeded) return true;
                } catch (const etcd::status_error& e) {
                    if (e.code() == etcd::code_not_found) return false;  // lease expired
                    throw;
                }
            }
            throw_unavailable(op, "node " + node_id + " keeps changing under contention");
        });
    }

    void remove_node(const std::string& node_id, const std::string& instance_id) {
        constexpr std::string_view op = "remove node";
        guarded(op, [&] {
            const std::string nk = node_key(node_id);
            for (int attempt = 0; attempt < max_cas_attempts; ++attempt) {
                auto kv = client_.get(op, nk);
                if (!kv) return;
                if (decode_node(*kv, op).instance_id != instance_id) return;
                auto result =
                    client_.txn(op, json::array({etcd::compare_mod_revision(nk, kv->mod_revision)}),
                                json::array({etcd::request_delete(nk)}));
                if (!result.succeeded) continue;
                if (kv->lease != 0) client_.lease_revoke(op, kv->lease);
                return;
            }
            throw_unavailable(op, "node " + node_id + " keeps changing under contention");
        });
    }

    std::vector<NodeRecord> list_nodes() {
        constexpr std::string_view op = "list nodes";
        return guarded(op, [&] {
            std::vector<NodeRecord> out;
            for (const auto& kv : client_.get_prefix(op, prefix_ + "nodes/")) {
                out.push_back(decode_node(kv, op));
            }
            std::sort(out.begin(), out.end(), [](const NodeRecord& a, const NodeRecord& b) {
                return a.node_id < b.node_id;
            });
            return out;
        });
    }

    std::optional<NodeRecord> get_node(const std::string& node_id) {
        constexpr std::string_view op = "get node";
        return guarded(op, [&]() -> std::optional<NodeRecord> {
            auto kv = client_.get(op, node_key(node_id));
            if (!kv) return std::nullopt;
            return decode_node(*kv, op);
        });
    }    // No index keys in this version: both scan the leases (the native client replaces it).
    std::optional<Lease> find_by_provider_lease(const std::string& provider,
                                                const std::string& provider_lease_id) {
        constexpr std::string_view op = "find lease by provider lease id";
        return guarded(op, [&]() -> std::optional<Lease> {
            for (auto& l : all_leases(op)) {
                if (l.provider == provider && l.provider_lease_id == provider_lease_id) return l;
            }
            return std::nullopt;
        });
    }

    std::vector<std::string> active_owner_nodes() {
        constexpr std::string_view op = "active owner nodes";
        return guarded(op, [&] {
            std::vector<std::string> out;
            for (const auto& l : all_leases(op)) {
                if (l.status == lease_status::active) out.push_back(l.owner_node_id);
            }
            std::sort(out.begin(), out.end());
            out.erase(std::unique(out.begin(), out.end()), out.end());
            return out;
        });
    }



private:
    std::string lease_key(std::string_view id) const { return prefix_ + "leases/" + escape(id); }
    std::string idem_key(std::string_view company, std::string_view environment,
                         std::string_view key) const {
        return prefix_ + "idem/" + escape(company) + "/" + escape(environment) + "/" + escape(key);
    }
    std::string node_key(std::string_view id) const { return prefix_ + "nodes/" + escape(id); }

    std::optional<Lease> read_lease(const std::string& id, std::string_view op) {
        auto kv = client_.get(op, lease_key(id));
        if (!kv) return std::nullopt;
        return decode_lease(*kv, op);
    }

    std::vector<Lease> all_leases(std::string_view op) {
        std::vector<Lease> out;
        for (const auto& kv : client_.get_prefix(op, prefix_ + "leases/")) {
            out.push_back(decode_lease(kv, op));
        }
        return out;
    }

    etcd::Client client_;
    const std::string prefix_;
    const std::int64_t node_ttl_s_;
};


/// Delivers the callbacks of the blocking feed on `ex`, one at a time and in order (a strand).
/// The gate makes sure no callback runs once the destructor returned, from any thread.
class PostedLeaseWatch final : public LeaseWatch {
public:
    PostedLeaseWatch(BlockingEtcdRegistry& registry, net::any_io_executor ex,
                     std::function<void(const Lease&)> on_change, std::function<void()> on_resync,
                     std::int64_t retry_ms)
        : gate_(std::make_shared<Gate>()) {
        auto strand = net::make_strand(std::move(ex));
        auto changed = [gate = gate_, strand,
                        f = std::make_shared<std::function<void(const Lease&)>>(
                            std::move(on_change))](const Lease& lease) {
            net::post(strand, [gate, f, lease] {
                std::lock_guard lock(gate->mutex);
                if (gate->open) (*f)(lease);
            });
        };
        std::function<void()> resynced;
        if (on_resync) {
            resynced = [gate = gate_, strand,
                        f = std::make_shared<std::function<void()>>(std::move(on_resync))] {
                net::post(strand, [gate, f] {
                    std::lock_guard lock(gate->mutex);
                    if (gate->open) (*f)();
                });
            };
        }
        feed_ = registry.watch_leases(std::move(changed), std::move(resynced), retry_ms);
    }

    ~PostedLeaseWatch() override {
        feed_.reset();  // joins the feed's thread
        std::lock_guard lock(gate_->mutex);
        gate_->open = false;
    }

private:
    struct Gate {
        std::mutex mutex;
        bool open = true;
    };
    std::shared_ptr<Gate> gate_;
    std::unique_ptr<LeaseWatch> feed_;
};

/// The blocking registry behind the awaitable interface: lease calls on a lane of four
/// threads, membership calls on a lane of their own, so that a lease backlog never delays a
/// heartbeat. Interim: the native asynchronous client replaces this.
class EtcdRegistry final : public Registry {
public:
    EtcdRegistry(std::vector<std::string> endpoints, std::string prefix, std::int64_t node_ttl_ms,
                 std::string username, std::string password)
        : blocking_(std::move(endpoints), std::move(prefix), node_ttl_ms, std::move(username),
                    std::move(password)) {}

    std::unique_ptr<LeaseWatch> watch_leases(net::any_io_executor ex,
                                             std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync,
                                             std::int64_t retry_ms) override {
        return std::make_unique<PostedLeaseWatch>(blocking_, std::move(ex), std::move(on_change),
                                                  std::move(on_resync), retry_ms);
    }

    awaitable<Lease> create_lease(Lease lease) override {
        auto work = [this, lease = std::move(lease)] { return blocking_.create_lease(lease); };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        auto work = [this, id = std::move(id)] { return blocking_.get_lease(id); };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        auto work = [this, company_id = std::move(company_id),
                     environment_id = std::move(environment_id), key = std::move(key)] {
            return blocking_.find_by_idempotency_key(company_id, environment_id, key);
        };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::optional<Lease>> find_by_provider_lease(
        std::string provider, std::string provider_lease_id) override {
        auto work = [this, provider = std::move(provider),
                     provider_lease_id = std::move(provider_lease_id)] {
            return blocking_.find_by_provider_lease(provider, provider_lease_id);
        };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        auto work = [this, query = std::move(query)] { return blocking_.list_leases(query); };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::optional<Lease>> update_lease(Lease next,
                                                 std::int64_t expected_epoch) override {
        auto work = [this, next = std::move(next), expected_epoch] {
            return blocking_.update_lease(next, expected_epoch);
        };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        auto work = [this, owner_node_id = std::move(owner_node_id), at_ms] {
            return blocking_.expired_leases(owner_node_id, at_ms);
        };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<std::vector<std::string>> active_owner_nodes() override {
        auto work = [this] { return blocking_.active_owner_nodes(); };
        co_return co_await leases_.run(std::move(work));
    }
    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        auto work = [this, node = std::move(node), liveness_ttl_ms] {
            blocking_.register_node(node, liveness_ttl_ms);
        };
        co_await membership_.run(std::move(work));
    }
    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        auto work = [this, node_id = std::move(node_id), instance_id = std::move(instance_id),
                     at_ms] { return blocking_.heartbeat_node(node_id, instance_id, at_ms); };
        co_return co_await membership_.run(std::move(work));
    }
    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        auto work = [this, node_id = std::move(node_id), instance_id = std::move(instance_id)] {
            blocking_.remove_node(node_id, instance_id);
        };
        co_await membership_.run(std::move(work));
    }
    awaitable<std::vector<NodeRecord>> list_nodes() override {
        auto work = [this] { return blocking_.list_nodes(); };
        co_return co_await membership_.run(std::move(work));
    }
    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        auto work = [this, node_id = std::move(node_id)] { return blocking_.get_node(node_id); };
        co_return co_await membership_.run(std::move(work));
    }

private:
    BlockingEtcdRegistry blocking_;
    WorkLane leases_{4};
    WorkLane membership_{1};  // last: joined first
};

}  // namespace

std::unique_ptr<Registry> make_etcd_registry(boost::asio::any_io_executor ex,
                                             std::vector<std::string> endpoints, std::string prefix,
                                             std::int64_t node_ttl_ms, std::string username,
                                             std::string password) {
    (void)ex;  // the blocking client runs on the registry's own lanes
    return std::make_unique<EtcdRegistry>(std::move(endpoints), std::move(prefix), node_ttl_ms,
                                          std::move(username), std::move(password));
}

}  // namespace sandboxd
