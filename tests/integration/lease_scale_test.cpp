// Scale without scans (issue 12, deliver 6): with 20,000 lease records in a SQLite registry
// (no sandboxes behind them), leaseGet, an open's lease resolved by providerLeaseId and one
// sweep each read a bounded number of records. The lease service runs in-process on a Node
// whose registry is wrapped in a decorator that counts what the registry returns.
#include "server/lease_service.hpp"
#include "support/sync_registry.hpp"
#include "support/temp_dir.hpp"

#include <sandboxd/core/errors.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <stdexcept>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

constexpr int many = 20000;

/// Forwards every call to a real registry and counts calls and lease records returned.
class CountingRegistry final : public Registry {
public:
    explicit CountingRegistry(std::unique_ptr<Registry> inner) : inner_(std::move(inner)) {}

    std::atomic<std::size_t> calls{0};
    std::atomic<std::size_t> records{0};  ///< lease records returned by any call
    void reset() {
        calls = 0;
        records = 0;
    }

    awaitable<Lease> create_lease(Lease lease) override {
        ++calls;
        ++records;
        co_return co_await inner_->create_lease(std::move(lease));
    }
    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        co_return counted(co_await inner_->get_lease(std::move(id)));
    }
    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        co_return counted(co_await inner_->find_by_idempotency_key(
            std::move(company_id), std::move(environment_id), std::move(key)));
    }
    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        co_return counted(co_await inner_->find_by_provider_lease(std::move(provider),
                                                                  std::move(provider_lease_id)));
    }
    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        auto page = co_await inner_->list_leases(std::move(query));
        ++calls;
        records += page.leases.size();
        co_return page;
    }
    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        co_return counted(co_await inner_->update_lease(std::move(next), expected_epoch));
    }
    awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) override {
        co_return counted(co_await inner_->update_lease_if_owner_unchanged(
            std::move(next), expected_epoch, std::move(owner_seen)));
    }
    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        auto leases = co_await inner_->expired_leases(std::move(owner_node_id), at_ms);
        ++calls;
        records += leases.size();
        co_return leases;
    }
    awaitable<std::vector<std::string>> active_owner_nodes() override {
        ++calls;
        co_return co_await inner_->active_owner_nodes();
    }
    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        ++calls;
        co_await inner_->register_node(std::move(node), liveness_ttl_ms);
    }
    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        ++calls;
        co_return co_await inner_->heartbeat_node(std::move(node_id), std::move(instance_id),
                                                  at_ms);
    }
    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        ++calls;
        co_await inner_->remove_node(std::move(node_id), std::move(instance_id));
    }
    awaitable<std::vector<NodeRecord>> list_nodes() override {
        ++calls;
        co_return co_await inner_->list_nodes();
    }
    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        ++calls;
        co_return co_await inner_->get_node(std::move(node_id));
    }

private:
    std::optional<Lease> counted(std::optional<Lease> lease) {
        ++calls;
        if (lease) ++records;
        return lease;
    }

    std::unique_ptr<Registry> inner_;
};

Lease record(int i, const std::string& owner) {
    Lease l;
    l.id = "lse_" + std::to_string(i);
    l.company_id = "acme";
    l.environment_id = "dev";
    l.provider = "bwrap";
    l.provider_lease_id = "pl-" + std::to_string(i);
    l.owner_node_id = owner;
    l.epoch = 1;
    l.acquired_at_ms = 1000 + i;
    l.last_used_at_ms = l.acquired_at_ms;
    l.expires_at_ms = now_ms() + 3'600'000;
    l.metadata = {{"pluginId", "bwrap"}, {"provider", "bwrap"}};
    return l;
}

/// Runs `op` to completion on a private io_context of the test's thread.
template <typename T>
T run(awaitable<T> op) {
    boost::asio::io_context ioc;
    auto result = boost::asio::co_spawn(ioc, std::move(op), boost::asio::use_future);
    ioc.run();
    return result.get();
}

}  // namespace

TEST_CASE("With 20,000 leases, leaseGet, an open by providerLeaseId and a sweep read a few records",
          "[lease][scale]") {
    TempDir dir;
    const auto path = dir.file("registry.db");
    {
        // Written straight to the registry: node-b owns 20,000 active leases, node-c (whose
        // membership lapsed: no record) two.
        // All queued at once: the writer lane takes them one after the other.
        auto writer = sync_sqlite(path);
        std::vector<std::future<Lease>> writes;
        writes.reserve(many + 2);
        for (int i = 0; i < many + 2; ++i) {
            writes.push_back(boost::asio::co_spawn(
                writer->executor(),
                writer->async().create_lease(record(i, i < many ? "node-b" : "node-c")),
                boost::asio::use_future));
        }
        for (auto& w : writes) w.get();
    }

    Node node;
    node.node_id = "node-a";
    node.instance_id = "inst-a";
    node.started_at_ms = now_ms() - 10 * static_cast<std::int64_t>(node.config.node_ttl_ms);
    node.renewed_at_ms = steady_now_ms();  // freshly renewed: not fenced
    auto counting = std::make_unique<CountingRegistry>(make_sqlite_registry(path));
    auto& counts = *counting;
    node.registry = std::move(counting);
    const Principal who{"admin", "host", {"*"}};

    // leaseGet reads the one lease.
    counts.reset();
    auto got = run(lease_get(node, who, "lse_12345"));
    CHECK(got.provider_lease_id == "pl-12345");
    CHECK(counts.calls.load() == 1);
    CHECK(counts.records.load() == 1);

    // An open's lease without an id is found by providerLeaseId, past any first page.
    counts.reset();
    const json lease_param = {{"companyId", "acme"},
                              {"environmentId", "dev"},
                              {"providerLeaseId", "pl-19999"},
                              {"metadata", {{"pluginId", "bwrap"}, {"provider", "bwrap"}}}};
    auto resolved = run(resolve_lease(node, who, lease_param));
    CHECK(resolved.id == "lse_19999");
    CHECK(counts.calls.load() == 1);
    CHECK(counts.records.load() == 1);

    // A sweep reads only the leases of the owner whose membership lapsed: node-c's two, read
    // once and stored once each as pending_cleanup; nothing of node-b's 20,000 (node-b is
    // alive: it has just registered) and nothing of node-a's (it has none).
    const auto now = now_ms();
    NodeRecord b{"node-b", "ws://127.0.0.1:1/v1/ws", now, now, "inst-b"};
    run(node.registry->register_node(b, 1000));
    counts.reset();
    run(sweep(node));
    CHECK(counts.records.load() == 4);
    CHECK(counts.calls.load() <= 10);
    auto check = sync_sqlite(path);
    CHECK(check->get_lease("lse_20000")->status == lease_status::pending_cleanup);
    CHECK(check->get_lease("lse_20001")->status == lease_status::pending_cleanup);
    CHECK(check->get_lease("lse_0")->status == lease_status::active);
}
