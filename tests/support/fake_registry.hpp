#pragma once
// An in-memory Registry for unit tests of the code above the registry (LeaseService, the
// sweeper, membership and fencing): a fake of a dependency, never of the thing under test.
//
// It follows the contract of include/sandboxd/registry/registry.hpp with SQLite's epoch rule (the
// caller's next.epoch is stored as given) and completes every call at once, on the awaiting
// coroutine's executor. It counts the lease records each call reads (`records_read`), so
// tests can assert that a lookup touched a bounded number of records, and it can be told to
// fail (`fail_leases`, `fail_membership`: every such call throws registry_unavailable) or to
// hold membership calls until released (`hold_membership`), to drive the fencing logic.
// Thread-safe (one mutex; no callback runs under it).
#include <sandboxd/core/errors.hpp>
#include <sandboxd/registry/registry.hpp>

#include <boost/asio/deferred.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <set>

namespace sandboxd::test {

class FakeRegistry final : public Registry {
public:
    std::atomic<std::uint64_t> records_read{0};
    std::atomic<std::uint64_t> calls{0};
    std::atomic<bool> fail_leases{false};
    std::atomic<bool> fail_membership{false};
    /// find_by_idempotency_key answers "none" even when a lease has the key, as when another
    /// process creates the lease between that lookup and create_lease (an idempotency race).
    std::atomic<bool> miss_idempotency_lookups{false};
    /// Race windows made deterministic: create_lease and update_lease call `before_write`
    /// (before storing) and `after_write` (after storing) with the op's name and the lease,
    /// outside the lock, and after each call yield to the executor once, so that what the hook
    /// started (e.g. a co_spawn'ed sweep) runs right there, between the write and the
    /// caller's next step. Set before the calls; run on the awaiting executor.
    std::function<void(const std::string&op, const Lease&lease)> before_write, after_write;

    awaitable<Lease> create_lease(Lease lease) override {
        co_await window(before_write, "create_lease", lease);
        Lease stored = create_locked(std::move(lease));
        co_await window(after_write, "create_lease", stored);
        co_return stored;
    }

    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        std::lock_guard lock(mutex_);
        begin_lease_call("get_lease");
        auto it = leases_.find(id);
        if (it == leases_.end()) co_return std::nullopt;
        ++records_read;
        co_return it->second;
    }

    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        std::lock_guard lock(mutex_);
        begin_lease_call("find_by_idempotency_key");
        if (miss_idempotency_lookups) co_return std::nullopt;
        for (const auto& [id, l] : leases_) {
            if (l.idempotency_key == key && l.company_id == company_id &&
                l.environment_id == environment_id) {
                ++records_read;
                co_return l;
            }
        }
        co_return std::nullopt;
    }

    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        std::lock_guard lock(mutex_);
        begin_lease_call("find_by_provider_lease");
        for (const auto& [id, l] : leases_) {  // an index in a real store; not counted
            if (l.provider == provider && l.provider_lease_id == provider_lease_id) {
                ++records_read;
                co_return l;
            }
        }
        co_return std::nullopt;
    }

    awaitable<LeasePage> list_leases(LeaseQuery q) override {
        std::lock_guard lock(mutex_);
        begin_lease_call("list_leases");
        std::vector<const Lease*> matching;
        for (const auto& [id, l] : leases_) {
            if (q.company_id && l.company_id != *q.company_id) continue;
            if (q.environment_id && l.environment_id != *q.environment_id) continue;
            if (q.status && l.status != *q.status) continue;
            if (q.owner_node_id && l.owner_node_id != *q.owner_node_id) continue;
            if (!q.tenants.empty() &&
                std::find(q.tenants.begin(), q.tenants.end(), l.company_id) == q.tenants.end()) {
                continue;
            }
            matching.push_back(&l);
        }
        std::sort(matching.begin(), matching.end(), [](const Lease* a, const Lease* b) {
            return std::tie(a->acquired_at_ms, a->id) < std::tie(b->acquired_at_ms, b->id);
        });
        // The cursor is the index of the next record (a fake needs no stable cursor).
        std::size_t start = q.cursor.empty() ? 0 : std::stoul(q.cursor);
        LeasePage page;
        for (std::size_t i = start; i < matching.size() && page.leases.size() < q.limit; ++i) {
            page.leases.push_back(*matching[i]);
            ++records_read;
        }
        if (start + page.leases.size() < matching.size()) {
            page.next_cursor = std::to_string(start + page.leases.size());
        }
        co_return page;
    }

    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        co_await window(before_write, "update_lease", next);
        auto stored = update_locked(std::move(next), expected_epoch);
        if (stored) co_await window(after_write, "update_lease", *stored);
        co_return stored;
    }

    /// The owner's record is compared as SQLite does: same instanceId and heartbeatAt.
    awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) override {
        co_await window(before_write, "update_lease", next);
        auto stored = update_locked(std::move(next), expected_epoch, &owner_seen);
        if (stored) co_await window(after_write, "update_lease", *stored);
        co_return stored;
    }

    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        std::lock_guard lock(mutex_);
        begin_lease_call("expired_leases");
        std::vector<Lease> out;
        for (const auto& [id, l] : leases_) {
            if (l.status == lease_status::active && l.owner_node_id == owner_node_id &&
                l.expires_at_ms && *l.expires_at_ms <= at_ms) {
                ++records_read;
                out.push_back(l);
            }
        }
        co_return out;
    }

    awaitable<std::vector<std::string>> active_owner_nodes() override {
        std::lock_guard lock(mutex_);
        begin_lease_call("active_owner_nodes");
        std::set<std::string> owners;
        for (const auto& [id, l] : leases_) {
            if (l.status == lease_status::active) owners.insert(l.owner_node_id);
        }
        co_return std::vector<std::string>(owners.begin(), owners.end());
    }

    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        co_await membership_gate();
        std::lock_guard lock(mutex_);
        begin_membership_call("register_node");
        auto it = nodes_.find(node.node_id);
        if (it != nodes_.end() && it->second.instance_id != node.instance_id &&
            now_ms() - it->second.heartbeat_at_ms < liveness_ttl_ms) {
            throw rpc_error(errc::invalid_params, "node " + node.node_id + " is alive elsewhere");
        }
        nodes_[node.node_id] = node;
    }

    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        co_await membership_gate();
        std::lock_guard lock(mutex_);
        begin_membership_call("heartbeat_node");
        auto it = nodes_.find(node_id);
        if (it == nodes_.end() || it->second.instance_id != instance_id) co_return false;
        it->second.heartbeat_at_ms = at_ms;
        ++heartbeats_;
        co_return true;
    }

    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        co_await membership_gate();
        std::lock_guard lock(mutex_);
        begin_membership_call("remove_node");
        auto it = nodes_.find(node_id);
        if (it != nodes_.end() && it->second.instance_id == instance_id) nodes_.erase(it);
    }

    awaitable<std::vector<NodeRecord>> list_nodes() override {
        co_await membership_gate();
        std::lock_guard lock(mutex_);
        begin_membership_call("list_nodes");
        std::vector<NodeRecord> out;
        for (const auto& [id, n] : nodes_) out.push_back(n);
        co_return out;
    }

    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        co_await membership_gate();
        std::lock_guard lock(mutex_);
        begin_membership_call("get_node");
        auto it = nodes_.find(node_id);
        if (it == nodes_.end()) co_return std::nullopt;
        co_return it->second;
    }

    // ---- test helpers (not part of Registry) ----

    /// Writes `lease` as is (no checks), e.g. to seed 20,000 records.
    void put_for_test(const Lease& lease) {
        std::lock_guard lock(mutex_);
        leases_[lease.id] = lease;
    }
    void put_node_for_test(const NodeRecord& node) {
        std::lock_guard lock(mutex_);
        nodes_[node.node_id] = node;
    }
    std::optional<Lease> lease_for_test(const std::string& id) const {
        std::lock_guard lock(mutex_);
        auto it = leases_.find(id);
        return it == leases_.end() ? std::nullopt : std::optional<Lease>(it->second);
    }
    std::size_t lease_count_for_test() const {
        std::lock_guard lock(mutex_);
        return leases_.size();
    }
    /// Zeroes `calls` and `records_read`.
    void reset_counts_for_test() {
        calls = 0;
        records_read = 0;
    }
    std::uint64_t heartbeats_for_test() const {
        std::lock_guard lock(mutex_);
        return heartbeats_;
    }
    /// While held, membership calls wait (on their own executor) until released.
    void hold_membership(bool hold) { membership_held_ = hold; }

private:
    Lease create_locked(Lease lease) {
        std::lock_guard lock(mutex_);
        begin_lease_call("create_lease");
        if (lease.idempotency_key) {
            for (const auto& [id, l] : leases_) {
                if (l.idempotency_key == lease.idempotency_key &&
                    l.company_id == lease.company_id && l.environment_id == lease.environment_id) {
                    ++records_read;
                    return l;
                }
            }
        }
        leases_[lease.id] = lease;
        return lease;
    }
    /// `owner_seen`, when given, must still be the owner's membership record (or its absence).
    std::optional<Lease> update_locked(Lease next, std::int64_t expected_epoch,
                                       const std::optional<NodeRecord>* owner_seen = nullptr) {
        std::lock_guard lock(mutex_);
        begin_lease_call("update_lease");
        if (owner_seen) {
            auto owner = nodes_.find(next.owner_node_id);
            const bool unchanged =
                *owner_seen ? owner != nodes_.end() &&
                                  owner->second.instance_id == (*owner_seen)->instance_id &&
                                  owner->second.heartbeat_at_ms == (*owner_seen)->heartbeat_at_ms
                            : owner == nodes_.end();
            if (!unchanged) return std::nullopt;
        }
        auto it = leases_.find(next.id);
        if (it == leases_.end() || it->second.epoch != expected_epoch) return std::nullopt;
        ++records_read;
        next.idempotency_key = it->second.idempotency_key;
        next.config = it->second.config;
        next.limits = it->second.limits;
        next.usage = nullptr;
        it->second = next;
        return next;
    }
    static awaitable<void> window(const std::function<void(const std::string&, const Lease&)>& hook,
                                  const char* op, const Lease& lease) {
        if (!hook) co_return;
        hook(op, lease);
        co_await boost::asio::post(co_await boost::asio::this_coro::executor, use_awaitable);
    }
    void begin_lease_call(const char* op) {
        ++calls;
        if (fail_leases) injected_failure(op);
    }
    void begin_membership_call(const char* op) {
        ++calls;
        if (fail_membership) injected_failure(op);
    }
    [[noreturn]] static void injected_failure(const char* op) {
        throw rpc_error(errc::registry_unavailable,
                        std::string("registry: ") + op + ": injected failure");
    }
    awaitable<void> membership_gate() {
        boost::asio::steady_timer t(co_await boost::asio::this_coro::executor);
        while (membership_held_) {  // polls a test knob: a fake's own pacing, not a test's
            t.expires_after(std::chrono::milliseconds(5));
            co_await t.async_wait(boost::asio::use_awaitable);
        }
    }

    mutable std::mutex mutex_;
    std::map<std::string, Lease> leases_;
    std::map<std::string, NodeRecord> nodes_;
    std::uint64_t heartbeats_ = 0;
    std::atomic<bool> membership_held_{false};
};

}  // namespace sandboxd::test
