// Unit tests of a node's membership fencing and claims (src/server/node.cpp) and of what the
// lease service refuses while fenced, on a real Node over an in-memory registry and provider
// (tests/support/node_harness.hpp). The age of the last renewal is injected through
// Node::renewed_at_ms: nothing sleeps.
#include "support/node_harness.hpp"

#include <catch2/catch.hpp>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

TEST_CASE("A node fences itself once its renewal is older than 2/3 of the node TTL, not before",
          "[unit][membership]") {
    NodeHarness h;
    h.node.config.node_ttl_ms = 9000;  // fenced past 6000 ms
    SECTION("just renewed") {
        h.renewed_ago(0);
        CHECK(h.node.fenced_for_ms() == 0);
        CHECK_NOTHROW(h.node.require_membership());
    }
    SECTION("under the limit (a second to spare for a slow machine)") {
        h.renewed_ago(5000);
        CHECK(h.node.fenced_for_ms() == 0);
        CHECK_NOTHROW(h.node.require_membership());
    }
    SECTION("one millisecond over the limit") {
        h.renewed_ago(6001);
        CHECK(h.node.fenced_for_ms() >= 6001);
        auto err = rpc_error_of([&] { h.node.require_membership(); });
        REQUIRE(err);
        CHECK(err->code() == errc::registry_unavailable);
        CHECK(err->data().value("nodeId", "") == "node-a");
        CHECK_THAT(std::string(err->what()), Catch::Contains("nodeTtlMs 9000 ms"));
    }
    SECTION("never renewed") {
        h.node.renewed_at_ms = 0;
        CHECK(h.node.fenced_for_ms() > 6000);
        CHECK_THROWS_AS(h.node.require_membership(), rpc_error);
    }
    SECTION("a renewal lifts the fence") {
        h.renewed_ago(60000);
        CHECK(h.node.fenced_for_ms() >= 60000);
        h.renewed_ago(0);
        CHECK(h.node.fenced_for_ms() == 0);
        CHECK_NOTHROW(h.node.require_membership());
    }
}

TEST_CASE("A fenced node changes no lease and opens nothing, without asking the registry",
          "[unit][membership]") {
    NodeHarness h;
    auto lease = h.acquire();
    h.renewed_ago(h.node.config.node_ttl_ms);
    h.registry->reset_counts_for_test();
    const auto creates = h.provider->creates.load();

    auto expect_fenced = [&](const std::function<void()>& f) {
        auto err = rpc_error_of(f);
        REQUIRE(err);
        CHECK(err->code() == errc::registry_unavailable);
    };
    expect_fenced([&] { h.acquire(); });
    expect_fenced([&] { h.run(lease_renew(h.node, h.host, lease.id, 60000)); });
    expect_fenced([&] { h.run(lease_release(h.node, h.host, lease.id)); });
    expect_fenced([&] { cached_sandbox(h.node, lease); });
    CHECK(h.registry->calls == 0);
    CHECK(h.provider->creates == creates);
    CHECK(h.provider->destroys == 0);
    CHECK(h.registry->lease_for_test(lease.id)->epoch == lease.epoch);

    // Reads stay served: they change nothing.
    CHECK(h.run(lease_get(h.node, h.host, lease.id)).id == lease.id);

    // Renewed, it serves again.
    h.renewed_ago(0);
    CHECK(cached_sandbox(h.node, lease));
    CHECK(h.run(lease_release(h.node, h.host, lease.id)).status == lease_status::released);
}

TEST_CASE("A fenced node's sweep changes nothing and reads nothing", "[unit][membership]") {
    NodeHarness h(/*started_ago_ms=*/60000);
    auto expired = h.acquire();
    auto lease = h.registry->lease_for_test(expired.id);
    lease->expires_at_ms = now_ms() - 1;
    h.registry->put_for_test(*lease);
    h.registry->put_for_test(lease_record("lse_dead", "node-c"));
    h.registry->put_for_test(lease_record("lse_lost", "node-a"));
    h.registry->put_for_test(lease_record("lse_pending", "node-a", lease_status::pending_cleanup));
    h.registry->reset_counts_for_test();

    h.renewed_ago(h.node.config.node_ttl_ms * 2 / 3 + 1);
    h.run(sweep(h.node));
    CHECK(h.registry->calls == 0);
    CHECK(h.provider->destroys == 0);
    CHECK(h.registry->lease_for_test(expired.id)->status == lease_status::active);
    CHECK(h.registry->lease_for_test("lse_dead")->status == lease_status::active);
    CHECK(h.registry->lease_for_test("lse_lost")->status == lease_status::active);
    CHECK(h.registry->lease_for_test("lse_pending")->cleanup_attempts == 0);

    // The same pass once renewed does all four.
    h.renewed_ago(0);
    h.run(sweep(h.node));
    CHECK(h.registry->lease_for_test(expired.id)->status == lease_status::expired);
    CHECK(h.registry->lease_for_test("lse_dead")->status == lease_status::pending_cleanup);
    CHECK(h.registry->lease_for_test("lse_lost")->status == lease_status::released);
    CHECK(h.registry->lease_for_test("lse_pending")->status == lease_status::released);
}

TEST_CASE("A node claims the epoch of each lease it creates and drops it on release",
          "[unit][membership]") {
    NodeHarness h;
    CHECK_FALSE(h.node.claim_of("lse_x"));
    h.node.claim("lse_x", 4);
    CHECK(h.node.claim_of("lse_x") == std::optional<std::int64_t>(4));
    h.node.claim("lse_x", 5);
    CHECK(h.node.claim_of("lse_x") == std::optional<std::int64_t>(5));
    h.node.unclaim("lse_x");
    CHECK_FALSE(h.node.claim_of("lse_x"));
    h.node.unclaim("lse_x");  // idempotent

    auto lease = h.acquire();
    CHECK(h.node.claim_of(lease.id) == std::optional<std::int64_t>(lease.epoch));
    h.run(lease_release(h.node, h.host, lease.id));
    CHECK_FALSE(h.node.claim_of(lease.id));
}
