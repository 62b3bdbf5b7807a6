#pragma once
// A Node built in-process for unit tests of the lease service, the sweeper and fencing: the
// real Node and src/server/lease_service.cpp over a FakeRegistry and a FakeProvider (key
// "fake"), driven on the test's own io_context. No sockets, no processes, no threads beyond
// the Node's own pool.
#include "server/lease_service.hpp"
#include "support/fake_provider.hpp"
#include "support/fake_registry.hpp"
#include "support/run_awaitable.hpp"

#include <sandboxd/core/errors.hpp>

#include <boost/asio/io_context.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace sandboxd::test {

struct NodeHarness {
    boost::asio::io_context ioc;
    Node node;
    FakeRegistry* registry = nullptr;  ///< owned by node.registry
    FakeProvider* provider = nullptr;  ///< owned by node.providers["fake"]
    /// A host token for tenant "acme" only.
    Principal host{"host-acme", "host", {"acme"}};

    /// node-a, freshly renewed (not fenced), started `started_ago_ms` ago (less than the node
    /// TTL: the sweeper does not yet orphan its own uncached leases), with its own live
    /// membership record in the registry.
    explicit NodeHarness(std::int64_t started_ago_ms = 0) {
        node.node_id = "node-a";
        node.instance_id = "inst-a";
        node.advertise_url = "ws://127.0.0.1:1/v1/ws";
        node.started_at_ms = now_ms() - started_ago_ms;
        node.renewed_at_ms = steady_now_ms();
        node.ioc = &ioc;
        auto r = std::make_unique<FakeRegistry>();
        registry = r.get();
        node.registry = std::move(r);
        auto p = std::make_unique<FakeProvider>();
        provider = p.get();
        node.providers["fake"] = std::move(p);
        put_live_node("node-a");
    }
    NodeHarness(const NodeHarness&) = delete;
    NodeHarness& operator=(const NodeHarness&) = delete;

    /// Runs `op` to completion on `ioc`; every operation here completes without waiting on
    /// anything but the fakes (end_lease_channels is bounded by its own `wait`).
    template <typename T>
    T run(awaitable<T> op) {
        return run_awaitable(ioc, std::move(op));
    }

    /// A membership record of `node_id` that heartbeated `ago_ms` ago.
    void put_live_node(const std::string& node_id, std::int64_t ago_ms = 0) {
        const auto at = now_ms() - ago_ms;
        registry->put_node_for_test(
            NodeRecord{node_id, "ws://" + node_id + ".test:1/v1/ws", at, at, "inst-" + node_id});
    }

    /// leaseAcquire's params as the session parses them.
    methods::LeaseAcquireParams parse_acquire(const nlohmann::json& p) const {
        return methods::parse_lease_acquire(p, node.config.limits.max_ttl_ms);
    }

    /// Acquires a lease for acme/dev on the fake provider.
    Lease acquire(nlohmann::json extra = nlohmann::json::object()) {
        nlohmann::json p = {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "fake"}};
        p.update(extra);
        return run(lease_acquire(node, host, parse_acquire(p)));
    }

    /// Makes the node's last renewal `age_ms` old (the time is injected, nothing sleeps).
    void renewed_ago(std::int64_t age_ms) { node.renewed_at_ms = steady_now_ms() - age_ms; }
};

/// An active lease record of acme/dev on provider "fake", owned by `owner`, to write straight
/// to the registry (put_for_test).
inline Lease lease_record(const std::string& id, const std::string& owner,
                          lease_status status = lease_status::active) {
    Lease l;
    l.id = id;
    l.company_id = "acme";
    l.environment_id = "dev";
    l.provider = "fake";
    l.provider_lease_id = "pl-" + id;
    l.owner_node_id = owner;
    l.status = status;
    l.epoch = 1;
    l.acquired_at_ms = now_ms() - 1000;
    l.last_used_at_ms = l.acquired_at_ms;
    l.expires_at_ms = now_ms() + 3'600'000;
    l.metadata = {{"pluginId", "builtin"}, {"provider", "fake"}};
    return l;
}

/// The rpc_error that `f` throws, or nullopt when it returns. Any other exception propagates.
inline std::optional<rpc_error> rpc_error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const rpc_error& e) {
        return e;
    }
    return std::nullopt;
}

}  // namespace sandboxd::test
