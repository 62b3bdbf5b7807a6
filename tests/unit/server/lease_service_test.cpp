// Unit tests of the lease service (src/server/lease_service.cpp): leaseAcquire, leaseGet,
// leaseRenew, leaseRelease, the fail-closed checks of an open (resolve_lease,
// cached_sandbox, owner_link), lease_orphan and reconcile_lease, on a real Node over an
// in-memory registry and provider (tests/support/node_harness.hpp).
#include "support/node_harness.hpp"

#include <catch2/catch.hpp>

#include <chrono>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

/// The open's `lease` object naming `l` exactly as a host would send it back.
json lease_param(const Lease& l) {
    return {{"id", l.id},
            {"companyId", l.company_id},
            {"environmentId", l.environment_id},
            {"providerLeaseId", l.provider_lease_id},
            {"epoch", l.epoch},
            {"metadata", l.metadata}};
}

}  // namespace

TEST_CASE("leaseAcquire creates the sandbox through the provider and stores the lease",
          "[unit][lease-service]") {
    NodeHarness h;
    const auto before = now_ms();
    auto lease = h.acquire({{"ttlMs", 60000}, {"runId", "run-1"}, {"config", {{"x", 1}}}});
    const auto after = now_ms();

    CHECK(lease.id.rfind("lse_", 0) == 0);
    CHECK(lease.company_id == "acme");
    CHECK(lease.environment_id == "dev");
    CHECK(lease.provider == "fake");
    CHECK(lease.provider_lease_id == "fake-1");
    CHECK(lease.owner_node_id == "node-a");
    CHECK(lease.status == lease_status::active);
    CHECK(lease.epoch == 1);
    CHECK(lease.run_id == std::optional<std::string>("run-1"));
    CHECK(lease.acquired_at_ms >= before);
    CHECK(lease.acquired_at_ms <= after);
    REQUIRE(lease.expires_at_ms);
    CHECK(*lease.expires_at_ms - lease.acquired_at_ms == 60000);
    CHECK(lease.limits == h.provider->limits);
    CHECK(lease.metadata == json{{"pluginId", "builtin"}, {"provider", "fake"}});

    // The provider made one sandbox, for this lease, with the lease's config.
    CHECK(h.provider->creates == 1);
    CHECK(h.provider->live() == std::set<std::string>{"fake-1"});
    CHECK(h.provider->last_lease_id() == lease.id);
    CHECK(h.provider->last_config() == json{{"x", 1}});

    // The registry holds what was returned; the cache holds the sandbox; the node claims it.
    auto stored = h.registry->lease_for_test(lease.id);
    REQUIRE(stored);
    CHECK(to_json(*stored) == to_json(lease));
    CHECK(stored->config == json{{"x", 1}});
    auto cached = h.node.cache.find(scope_of(lease));
    REQUIRE(cached);
    CHECK(cached->lease_id == lease.id);
    CHECK(h.node.claim_of(lease.id) == std::optional<std::int64_t>(1));

    SECTION("without ttlMs the lease gets the configured default") {
        auto other = h.acquire();
        REQUIRE(other.expires_at_ms);
        CHECK(*other.expires_at_ms - other.acquired_at_ms ==
              static_cast<std::int64_t>(h.node.config.limits.default_ttl_ms));
        CHECK(other.provider_lease_id == "fake-2");
        CHECK(other.id != lease.id);
    }
}

TEST_CASE("leaseAcquire with an idempotency key returns the same lease and no second sandbox",
          "[unit][lease-service]") {
    NodeHarness h;
    auto first = h.acquire({{"idempotencyKey", "k-1"}});
    auto again = h.acquire({{"idempotencyKey", "k-1"}});
    CHECK(again.id == first.id);
    CHECK(again.epoch == first.epoch);
    CHECK(h.provider->creates == 1);
    CHECK(h.registry->lease_count_for_test() == 1);

    SECTION("the key is scoped by environment") {
        auto other = h.acquire({{"idempotencyKey", "k-1"}, {"environmentId", "prod"}});
        CHECK(other.id != first.id);
        CHECK(h.provider->creates == 2);
    }
    SECTION(
        "a lost race (the lookup missed, create_lease found the winner) destroys the "
        "loser's sandbox and returns the winner") {
        h.registry->miss_idempotency_lookups = true;
        auto raced = h.acquire({{"idempotencyKey", "k-1"}});
        CHECK(raced.id == first.id);
        CHECK(h.provider->creates == 2);
        CHECK(h.provider->destroys == 1);
        CHECK(h.provider->live() == std::set<std::string>{first.provider_lease_id});
        CHECK(h.node.cache.size() == 1);
        CHECK(h.registry->lease_count_for_test() == 1);
    }
}

TEST_CASE("leaseAcquire leaves nothing behind when the provider or the registry fails",
          "[unit][lease-service]") {
    NodeHarness h;
    SECTION("a provider that throws: no lease, no sandbox") {
        h.provider->create_error = errc::provider_error;
        auto err = rpc_error_of([&] { h.acquire(); });
        REQUIRE(err);
        CHECK(err->code() == errc::provider_error);
        CHECK(h.registry->lease_count_for_test() == 0);
        CHECK(h.provider->live().empty());
        CHECK(h.node.cache.size() == 0);
    }
    SECTION("a registry that fails after create: the sandbox is destroyed") {
        h.registry->fail_leases = true;
        auto err = rpc_error_of([&] { h.acquire(); });
        REQUIRE(err);
        CHECK(err->code() == errc::registry_unavailable);
        CHECK(h.provider->creates == 1);
        CHECK(h.provider->destroys == 1);
        CHECK(h.provider->live().empty());
        CHECK(h.node.cache.size() == 0);
        CHECK(h.registry->lease_count_for_test() == 0);
    }
}

TEST_CASE("leaseAcquire refuses bad requests before touching the registry or a provider",
          "[unit][lease-service]") {
    NodeHarness h;
    errc expected = errc::invalid_params;
    json params = {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "fake"}};
    SECTION("another tenant") { params["companyId"] = "globex"; }
    SECTION("an unknown provider") { params["provider"] = "nope"; }
    SECTION("an unknown key") { params["bogus"] = 1; }
    SECTION("a ttl over the maximum") { params["ttlMs"] = h.node.config.limits.max_ttl_ms + 1; }
    SECTION("a ttl under a second") { params["ttlMs"] = 999; }
    SECTION("a config that is not an object") { params["config"] = "x"; }
    SECTION("a draining node") {
        h.node.draining = true;
        expected = errc::owner_unavailable;
    }
    h.registry->reset_counts_for_test();
    auto err = rpc_error_of([&] { h.run(lease_acquire(h.node, h.host, h.parse_acquire(params))); });
    REQUIRE(err);
    CHECK(err->code() == expected);
    CHECK(h.registry->calls == 0);
    CHECK(h.provider->creates == 0);
}

TEST_CASE("leaseGet shows a lease only to its tenant", "[unit][lease-service]") {
    NodeHarness h;
    h.registry->put_for_test(lease_record("lse_1", "node-b"));
    CHECK(h.run(lease_get(h.node, h.host, "lse_1")).provider_lease_id == "pl-lse_1");

    const Principal globex{"host-globex", "host", {"globex"}};
    for (const auto& [who, id] : {std::pair{globex, "lse_1"}, std::pair{h.host, "lse_none"}}) {
        auto err = rpc_error_of([&, &who = who, &id = id] { h.run(lease_get(h.node, who, id)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_found);
        CHECK(err->data().value("leaseId", "") == id);
    }
}

TEST_CASE("resolve_lease refuses an incomplete lease before any registry call",
          "[unit][lease-service]") {
    NodeHarness h;
    json lp = {{"companyId", "acme"},
               {"environmentId", "dev"},
               {"providerLeaseId", "pl-1"},
               {"metadata", {{"pluginId", "builtin"}, {"provider", "fake"}}}};
    SECTION("no metadata") { lp.erase("metadata"); }
    SECTION("metadata not an object") { lp["metadata"] = "builtin"; }
    SECTION("no pluginId") { lp["metadata"].erase("pluginId"); }
    SECTION("an empty provider") { lp["metadata"]["provider"] = ""; }
    SECTION("a provider that is not a string") { lp["metadata"]["provider"] = 1; }
    SECTION("no providerLeaseId") { lp.erase("providerLeaseId"); }
    SECTION("a providerLeaseId that is not a string") { lp["providerLeaseId"] = 7; }
    SECTION("a null providerLeaseId, even without a companyId") {
        lp["providerLeaseId"] = nullptr;
        lp.erase("companyId");
    }
    h.registry->reset_counts_for_test();
    auto err = rpc_error_of([&] { h.run(resolve_lease(h.node, h.host, lp)); });
    REQUIRE(err);
    CHECK(err->code() == errc::lease_incomplete);
    CHECK(std::string(err->what()) == lease_incomplete_message);
    CHECK(h.registry->calls == 0);
    CHECK(h.provider->creates == 0);
}

TEST_CASE("resolve_lease finds the lease by id or by providerLeaseId, and fails closed",
          "[unit][lease-service]") {
    NodeHarness h;
    const auto lease = lease_record("lse_1", "node-a");
    h.registry->put_for_test(lease);

    SECTION("by id") {
        h.registry->reset_counts_for_test();
        CHECK(h.run(resolve_lease(h.node, h.host, lease_param(lease))).id == "lse_1");
        CHECK(h.registry->calls == 1);
        CHECK(h.registry->records_read == 1);
    }
    SECTION("by providerLeaseId, without id nor epoch") {
        auto lp = lease_param(lease);
        lp.erase("id");
        lp.erase("epoch");
        h.registry->reset_counts_for_test();
        CHECK(h.run(resolve_lease(h.node, h.host, lp)).id == "lse_1");
        CHECK(h.registry->calls == 1);
        CHECK(h.registry->records_read == 1);
    }

    // LEASE_NOT_FOUND: another tenant, or any part of the scope that differs.
    SECTION("not found") {
        auto lp = lease_param(lease);
        Principal who = h.host;
        std::string shown = "lse_1";
        SECTION("a foreign tenant") { who = Principal{"host-globex", "host", {"globex"}}; }
        SECTION("another companyId") {
            who = Principal{"host-all", "host", {"*"}};
            lp["companyId"] = "globex";
        }
        SECTION("another environmentId") { lp["environmentId"] = "prod"; }
        SECTION("another provider") { lp["metadata"]["provider"] = "bwrap"; }
        SECTION("another pluginId") { lp["metadata"]["pluginId"] = "acme-plugin"; }
        SECTION("another providerLeaseId") { lp["providerLeaseId"] = "pl-other"; }
        SECTION("an unknown id") {
            lp["id"] = "lse_none";
            shown = "lse_none";
        }
        SECTION("an unknown providerLeaseId without id") {
            lp.erase("id");
            lp["providerLeaseId"] = "pl-none";
            shown = "pl-none";
        }
        auto err = rpc_error_of([&] { h.run(resolve_lease(h.node, who, lp)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_found);
        CHECK(err->data().value("leaseId", "") == shown);
    }

    // LEASE_NOT_ACTIVE: the right lease, but not live or not under the caller's epoch.
    SECTION("not active") {
        auto lp = lease_param(lease);
        Lease changed = lease;
        std::string status = "active";
        SECTION("a wrong epoch") { lp["epoch"] = 2; }
        SECTION("released") {
            changed.status = lease_status::released;
            changed.epoch = 2;
            lp["epoch"] = 2;
            status = "released";
        }
        SECTION("pending_cleanup") {
            changed.status = lease_status::pending_cleanup;
            lp.erase("epoch");
            status = "pending_cleanup";
        }
        SECTION("past its expiry, still marked active") { changed.expires_at_ms = now_ms() - 1; }
        h.registry->put_for_test(changed);
        auto err = rpc_error_of([&] { h.run(resolve_lease(h.node, h.host, lp)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_active);
        CHECK(std::string(err->what()) == lease_not_active_message("lse_1"));
        CHECK(err->data().value("leaseId", "") == "lse_1");
        CHECK(err->data().value("status", "") == status);
        CHECK(err->data().value("epoch", -1) == changed.epoch);
    }
}

TEST_CASE("cached_sandbox serves only the cached sandbox of the claimed epoch",
          "[unit][lease-service]") {
    NodeHarness h;
    auto lease = h.acquire();
    auto handle = cached_sandbox(h.node, lease);
    REQUIRE(handle);
    CHECK(handle->scope == scope_of(lease));

    errc expected = errc::sandbox_not_cached;
    Lease asked = lease;
    SECTION("another providerLeaseId") { asked.provider_lease_id = "fake-99"; }
    SECTION("another environment") { asked.environment_id = "prod"; }
    SECTION("a lease this node holds under an older epoch") {
        asked.epoch = lease.epoch + 1;
        expected = errc::lease_not_active;
    }
    SECTION("a sandbox whose teardown has begun") { h.node.cache.begin_teardown(scope_of(lease)); }
    SECTION("a draining node") {
        h.node.draining = true;
        expected = errc::owner_unavailable;
    }
    SECTION("a fenced node") {
        h.renewed_ago(h.node.config.node_ttl_ms);
        expected = errc::registry_unavailable;
    }
    auto err = rpc_error_of([&] { cached_sandbox(h.node, asked); });
    REQUIRE(err);
    CHECK(err->code() == expected);
}

TEST_CASE(
    "owner_link decides for a dead, a redirecting or an unreachable owner without the "
    "network",
    "[unit][lease-service]") {
    NodeHarness h;
    auto lease = lease_record("lse_1", "node-b");
    errc expected = errc::owner_unavailable;
    SECTION("an owner without a membership record") {}
    SECTION("an owner whose heartbeat is a TTL old") {
        h.put_live_node("node-b", h.node.config.node_ttl_ms);
    }
    SECTION("a live owner in redirect mode") {
        h.put_live_node("node-b");
        h.node.config.routing_mode = "redirect";
        expected = errc::owner_elsewhere;
    }
    SECTION("a live owner in proxy mode, with no peer token to reach it") {
        h.put_live_node("node-b");
        h.node.set_security(std::make_shared<const Security>());
    }
    auto err = rpc_error_of([&] { h.run(owner_link(h.node, lease)); });
    REQUIRE(err);
    CHECK(err->code() == expected);
    CHECK(err->data().value("ownerNodeId", "") == "node-b");
    if (expected == errc::owner_elsewhere) {
        CHECK(err->data().value("ownerUrl", "") == "ws://node-b.test:1/v1/ws");
        CHECK(err->data().value("leaseId", "") == "lse_1");
    }
}

TEST_CASE("leaseRenew moves the expiry and keeps the epoch, and refuses a lease that is not live",
          "[unit][lease-service]") {
    NodeHarness h;
    auto lease = h.acquire({{"ttlMs", 5000}});
    const auto before = now_ms();
    auto renewed = h.run(lease_renew(h.node, h.host, lease.id, 120000));
    CHECK(renewed.epoch == lease.epoch);
    CHECK(renewed.status == lease_status::active);
    REQUIRE(renewed.expires_at_ms);
    CHECK(*renewed.expires_at_ms >= before + 120000);
    CHECK(renewed.last_used_at_ms >= before);
    CHECK(h.registry->lease_for_test(lease.id)->expires_at_ms == renewed.expires_at_ms);
    CHECK(h.provider->creates == 1);
    CHECK(h.provider->destroys == 0);

    SECTION("another tenant's lease is not found") {
        const Principal globex{"host-globex", "host", {"globex"}};
        auto err = rpc_error_of([&] { h.run(lease_renew(h.node, globex, lease.id, 60000)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_found);
        CHECK(h.registry->lease_for_test(lease.id)->expires_at_ms == renewed.expires_at_ms);
    }
    SECTION("a ttl over the maximum") {
        auto err = rpc_error_of([&] {
            h.run(lease_renew(h.node, h.host, lease.id, h.node.config.limits.max_ttl_ms + 1));
        });
        REQUIRE(err);
        CHECK(err->code() == errc::invalid_params);
    }
    SECTION("a released lease") {
        h.run(lease_release(h.node, h.host, lease.id));
        auto err = rpc_error_of([&] { h.run(lease_renew(h.node, h.host, lease.id, 60000)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_active);
        CHECK(err->data().value("status", "") == "released");
    }
}

TEST_CASE("leaseRelease destroys the sandbox once and records the release under a new epoch",
          "[unit][lease-service]") {
    NodeHarness h;
    auto lease = h.acquire();
    SECTION("released by its tenant, then again") {
        auto released = h.run(lease_release(h.node, h.host, lease.id));
        CHECK(released.status == lease_status::released);
        CHECK(released.epoch == lease.epoch + 1);
        CHECK(released.released_at_ms);
        CHECK(released.cleanup_status == std::optional<std::string>("destroyed"));
        CHECK(h.provider->destroyed() == std::vector<std::string>{lease.provider_lease_id});
        CHECK(h.provider->live().empty());
        CHECK(h.node.cache.size() == 0);
        CHECK_FALSE(h.node.claim_of(lease.id));
        CHECK(h.registry->lease_for_test(lease.id)->status == lease_status::released);

        // Idempotent: the same record back, nothing destroyed again, nothing written.
        h.registry->reset_counts_for_test();
        auto again = h.run(lease_release(h.node, h.host, lease.id));
        CHECK(again.epoch == released.epoch);
        CHECK(again.status == lease_status::released);
        CHECK(h.provider->destroys == 1);
        CHECK(h.registry->calls == 1);
    }
    SECTION("another tenant's release is refused and changes nothing") {
        const Principal globex{"host-globex", "host", {"globex"}};
        auto err = rpc_error_of([&] { h.run(lease_release(h.node, globex, lease.id)); });
        REQUIRE(err);
        CHECK(err->code() == errc::lease_not_found);
        CHECK(h.provider->destroys == 0);
        CHECK(h.registry->lease_for_test(lease.id)->status == lease_status::active);
        CHECK(h.registry->lease_for_test(lease.id)->epoch == lease.epoch);
        CHECK(h.node.cache.find(scope_of(lease)));
    }
    SECTION("a destroy that fails leaves the lease pending_cleanup, one attempt spent") {
        h.provider->destroy_error = errc::provider_error;
        auto pending = h.run(lease_release(h.node, h.host, lease.id));
        CHECK(pending.status == lease_status::pending_cleanup);
        CHECK(pending.epoch == lease.epoch + 1);
        CHECK(pending.cleanup_attempts == 1);
        CHECK(pending.failure_reason ==
              std::optional<std::string>("fake provider: destroy failed"));
        CHECK(h.provider->live().size() == 1);
        // Not served any more while it tears down.
        CHECK_FALSE(h.node.cache.find(scope_of(lease)));
    }
    SECTION("a sandbox this node no longer caches (a restart) is torn down by its scope") {
        h.registry->put_for_test(lease_record("lse_old", "node-a"));
        auto released = h.run(lease_release(h.node, h.host, "lse_old"));
        CHECK(released.status == lease_status::released);
        CHECK(h.provider->destroyed() == std::vector<std::string>{"pl-lse_old"});
        CHECK(h.node.cache.find(scope_of(lease)));  // the other lease is still served
    }
    SECTION("a provider that is not ready spends no attempt") {
        h.provider->destroy_error = errc::provider_not_ready;
        auto pending = h.run(lease_release(h.node, h.host, lease.id));
        CHECK(pending.status == lease_status::pending_cleanup);
        CHECK(pending.cleanup_attempts == 0);
    }
}

TEST_CASE("lease_orphan moves an active lease to pending_cleanup once", "[unit][lease-service]") {
    NodeHarness h;
    const auto lease = lease_record("lse_1", "node-b");
    h.registry->put_for_test(lease);
    auto orphaned = h.run(lease_orphan(h.node, lease, "owner node node-b is dead"));
    CHECK(orphaned.status == lease_status::pending_cleanup);
    CHECK(orphaned.epoch == 2);
    CHECK(orphaned.cleanup_status == std::optional<std::string>("owner node node-b is dead"));
    CHECK(h.registry->lease_for_test("lse_1")->status == lease_status::pending_cleanup);

    SECTION("a stale copy returns the stored lease and writes nothing") {
        h.registry->reset_counts_for_test();
        auto again = h.run(lease_orphan(h.node, lease, "again"));
        CHECK(again.epoch == 2);
        CHECK(again.cleanup_status == std::optional<std::string>("owner node node-b is dead"));
        CHECK(h.registry->calls == 2);  // the failed compare-and-swap, then the read
    }
    SECTION("a lease that is not active is returned as is, without a registry call") {
        h.registry->reset_counts_for_test();
        auto same = h.run(lease_orphan(h.node, orphaned, "again"));
        CHECK(same.epoch == 2);
        CHECK(h.registry->calls == 0);
    }
}

TEST_CASE("reconcile_lease evicts a cached sandbox whose lease is no longer this node's",
          "[unit][lease-service]") {
    NodeHarness h;
    auto lease = h.acquire();
    Lease seen = lease;
    bool evicted = true;
    SECTION("released elsewhere") {
        seen.status = lease_status::released;
        seen.epoch = 2;
    }
    SECTION("taken by another node") {
        seen.owner_node_id = "node-b";
        seen.epoch = 2;
    }
    SECTION("active here under a newer epoch than claimed") { seen.epoch = 2; }
    SECTION("held here under the claimed epoch: untouched") { evicted = false; }
    SECTION("this node's pending_cleanup: left to the sweeper") {
        seen.status = lease_status::pending_cleanup;
        seen.epoch = 2;
        evicted = false;
    }
    CHECK(needs_reconcile(h.node, seen) == (seen.epoch != lease.epoch));
    h.run(reconcile_lease(h.node, seen));
    CHECK(h.provider->destroys == (evicted ? 1 : 0));
    CHECK((h.node.cache.size() == 0) == evicted);
    CHECK(h.node.claim_of(lease.id).has_value() != evicted);
    // Nothing is left to do: a second pass destroys nothing more.
    h.run(reconcile_lease(h.node, seen));
    CHECK(h.provider->destroys == (evicted ? 1 : 0));
}

TEST_CASE("end_lease_channels returns at once when the lease has no channel here",
          "[unit][lease-service]") {
    NodeHarness h;
    const auto start = std::chrono::steady_clock::now();
    h.run(end_lease_channels(h.node, "lse_1", std::chrono::milliseconds(10000)));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(5000));
    CHECK(h.node.channels.size() == 0);
}

TEST_CASE(
    "A provider without probe or config validation answers INVALID_PARAMS naming the "
    "method, and leases record its capabilities and the host's metadata",
    "[unit][lease-service]") {
    NodeHarness h;
    auto lease = h.acquire({{"metadata", {{"team", "blue"}}}});
    CHECK(lease.host_metadata == json{{"team", "blue"}});
    CHECK(lease.capabilities == json::array());  // the fake provider names none
    CHECK(lease.metadata == json{{"pluginId", "builtin"}, {"provider", "fake"}});

    auto err = rpc_error_of([&] { h.run(lease_probe(h.node, h.host, lease.id)); });
    REQUIRE(err);
    CHECK(err->code() == errc::invalid_params);
    CHECK(err->data().value("field", "") == "leaseProbe");

    methods::ValidateConfigParams v;
    v.provider = "fake";
    err = rpc_error_of([&] { h.run(provider_validate_config(h.node, h.host, v)); });
    REQUIRE(err);
    CHECK(err->code() == errc::invalid_params);
    CHECK(err->data().value("field", "") == "providerValidateConfig");

    v.provider = "none";
    err = rpc_error_of([&] { h.run(provider_validate_config(h.node, h.host, v)); });
    REQUIRE(err);
    CHECK(err->data().value("field", "") == "provider");

    // A released lease is not probed at all.
    h.run(lease_release(h.node, h.host, lease.id));
    err = rpc_error_of([&] { h.run(lease_probe(h.node, h.host, lease.id)); });
    REQUIRE(err);
    CHECK(err->code() == errc::lease_not_active);
}

namespace {

Lease release_with(NodeHarness& h, const std::string& id, json extra) {
    json p = {{"leaseId", id}};
    p.update(extra);
    return h.run(lease_release(h.node, h.host, methods::parse_lease_release(p)));
}

}  // namespace

TEST_CASE(
    "Lease policies: a provider that cannot retain accepts only ephemeral and destroy, "
    "and a refusal changes nothing",
    "[unit][lease-service][policy]") {
    NodeHarness h;  // the fake provider cannot retain unless told
    auto err = rpc_error_of([&] { h.acquire({{"leasePolicy", "reuse_by_environment"}}); });
    REQUIRE(err);
    CHECK(err->code() == errc::invalid_params);
    CHECK(err->data().value("field", "") == "leasePolicy");
    CHECK(h.provider->creates == 0);

    auto lease = h.acquire();
    CHECK(lease.lease_policy == "ephemeral");
    err = rpc_error_of([&] { release_with(h, lease.id, {{"disposition", "retain"}}); });
    REQUIRE(err);
    CHECK(err->code() == errc::invalid_params);
    CHECK(err->data().value("field", "") == "disposition");
    auto stored = h.run(lease_get(h.node, h.host, lease.id));
    CHECK(stored.status == lease_status::active);
    CHECK(stored.epoch == lease.epoch);
    CHECK(h.node.cache.find(scope_of(lease)) != nullptr);

    CHECK(release_with(h, lease.id, {{"disposition", "destroy"}}).status == lease_status::released);
    CHECK(h.provider->destroys == 1);
    // Bad policies and dispositions are refused before anything is read.
    err = rpc_error_of([&] { h.acquire({{"leasePolicy", "forever"}}); });
    REQUIRE(err);
    CHECK(err->data().value("field", "") == "leasePolicy");
    err = rpc_error_of([&] { h.acquire({{"leasePolicy", "reuse_by_execution_workspace"}}); });
    REQUIRE(err);
    CHECK(err->data().value("field", "") == "executionWorkspaceId");
    err = rpc_error_of([&] { release_with(h, lease.id, {{"disposition", "keep"}}); });
    REQUIRE(err);
    CHECK(err->data().value("field", "") == "disposition");
}

TEST_CASE(
    "Lease policies: reuse returns the scope's active lease, retain stops the sandbox "
    "and a reuse resumes it, and each policy has its default disposition",
    "[unit][lease-service][policy]") {
    NodeHarness h;
    h.provider->retainable = true;
    const json reuse = {{"leasePolicy", "reuse_by_environment"}};
    auto a = h.acquire(reuse);
    CHECK(a.lease_policy == "reuse_by_environment");
    CHECK(h.acquire(reuse).id == a.id);  // the active lease of the scope
    CHECK(h.provider->creates == 1);
    // Another environment, another config, or another policy is another lease.
    json other_env = reuse;
    other_env["environmentId"] = "prod";
    CHECK(h.acquire(other_env).id != a.id);
    json other_config = reuse;
    other_config["config"] = {{"k", 1}};
    CHECK(h.acquire(other_config).id != a.id);
    CHECK(h.acquire().id != a.id);  // ephemeral: never shared
    CHECK(h.provider->creates == 4);

    // The reuse policies retain by default: the provider stops the sandbox and keeps it.
    auto retained = release_with(h, a.id, json::object());
    CHECK(retained.status == lease_status::retained);
    CHECK(retained.epoch > a.epoch);
    CHECK(h.provider->stops == 1);
    CHECK(h.provider->destroys == 0);
    CHECK(h.node.cache.find(scope_of(a)) == nullptr);
    CHECK(release_with(h, a.id, {{"disposition", "retain"}}).epoch ==
          retained.epoch);  // idempotent
    auto listed =
        h.run(lease_list(h.node, h.host, methods::parse_lease_list({{"status", "retained"}})));
    REQUIRE(listed["leases"].size() == 1);
    CHECK(listed["leases"][0]["id"] == a.id);
    CHECK(listed["leases"][0]["status"] == "retained");

    // A reuse resumes it: the same lease and sandbox, active again under a new epoch.
    auto back = h.acquire(reuse);
    CHECK(back.id == a.id);
    CHECK(back.status == lease_status::active);
    CHECK(back.epoch > retained.epoch);
    CHECK(back.provider_lease_id == a.provider_lease_id);
    CHECK(h.provider->resumes == 1);
    CHECK(h.provider->creates == 4);
    CHECK(h.node.cache.find(scope_of(back)) != nullptr);

    // disposition destroy overrides the policy.
    CHECK(release_with(h, a.id, {{"disposition", "destroy"}}).status == lease_status::released);
    CHECK(h.provider->destroys == 1);

    // A retained lease whose sandbox is gone is destroyed, and the reuse makes a new one.
    auto b = h.acquire(reuse);
    CHECK(b.id != a.id);
    CHECK(release_with(h, b.id, json::object()).status == lease_status::retained);
    h.provider->lose(b.provider_lease_id);  // the sandbox vanished while retained
    auto c = h.acquire(reuse);
    CHECK(c.id != b.id);
    CHECK(h.run(lease_get(h.node, h.host, b.id)).status == lease_status::released);

    // reuse_by_execution_workspace: one lease per execution workspace.
    auto w1 = h.acquire(
        {{"leasePolicy", "reuse_by_execution_workspace"}, {"executionWorkspaceId", "w1"}});
    auto w2 = h.acquire(
        {{"leasePolicy", "reuse_by_execution_workspace"}, {"executionWorkspaceId", "w2"}});
    CHECK(w1.id != w2.id);
    CHECK(
        h.acquire({{"leasePolicy", "reuse_by_execution_workspace"}, {"executionWorkspaceId", "w1"}})
            .id == w1.id);

    // retain_on_failure: a failed run's sandbox is kept, a successful one's destroyed; a new
    // acquire never reuses.
    const json on_failure = {{"leasePolicy", "retain_on_failure"}};
    auto ok_run = h.acquire(on_failure);
    auto failed_run = h.acquire(on_failure);
    CHECK(ok_run.id != failed_run.id);
    CHECK(release_with(h, ok_run.id, {{"failed", false}}).status == lease_status::released);
    auto kept = release_with(h, failed_run.id, {{"failed", true}});
    CHECK(kept.status == lease_status::retained);
    CHECK(h.acquire(on_failure).id != failed_run.id);

    // A retained lease no reuse came for expires: the sweeper destroys its sandbox.
    const int destroyed_before = h.provider->destroys;
    Lease past = kept;
    past.expires_at_ms = now_ms() - 1;
    REQUIRE(h.run(h.node.registry->update_lease(past, kept.epoch)));
    h.run(sweep(h.node));
    CHECK(h.run(lease_get(h.node, h.host, kept.id)).status == lease_status::expired);
    CHECK(h.provider->destroys == destroyed_before + 1);
}
