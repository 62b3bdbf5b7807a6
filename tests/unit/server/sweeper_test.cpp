// Unit tests of the sweeper (sweep() in src/server/lease_service.cpp) on a real Node over an
// in-memory registry and provider (tests/support/node_harness.hpp). Time is injected through
// the lease records (expiresAt, lastUsedAt) and the membership records (heartbeatAt): no test
// waits for a clock.
#include "support/node_harness.hpp"

#include <catch2/catch.hpp>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

/// Rewrites the stored record of `id` through `change` (no epoch check: the test is the
/// other writer).
template <typename F>
void edit(NodeHarness& h, const std::string& id, F change) {
    auto l = h.registry->lease_for_test(id);
    REQUIRE(l);
    change(*l);
    h.registry->put_for_test(*l);
}

}  // namespace

TEST_CASE("The sweeper tears down this node's expired leases", "[unit][sweeper]") {
    NodeHarness h;
    auto expired = h.acquire();
    auto live = h.acquire();
    edit(h, expired.id, [](Lease& l) { l.expires_at_ms = now_ms() - 1; });

    h.run(sweep(h.node));
    auto stored = h.registry->lease_for_test(expired.id);
    CHECK(stored->status == lease_status::expired);
    CHECK(stored->epoch == expired.epoch + 1);
    CHECK(stored->released_at_ms);
    CHECK(h.provider->destroyed() == std::vector<std::string>{expired.provider_lease_id});
    CHECK_FALSE(h.node.cache.find(scope_of(expired)));
    CHECK_FALSE(h.node.claim_of(expired.id));

    // The unexpired lease is untouched and still served.
    CHECK(h.registry->lease_for_test(live.id)->status == lease_status::active);
    CHECK(h.registry->lease_for_test(live.id)->epoch == live.epoch);
    CHECK(h.node.cache.find(scope_of(live)));

    // A second pass has nothing left to do.
    h.run(sweep(h.node));
    CHECK(h.provider->destroys == 1);
}

TEST_CASE(
    "The sweeper orphans the active leases of a dead owner and never touches a live "
    "owner's",
    "[unit][sweeper]") {
    NodeHarness h;
    h.put_live_node("node-b");
    constexpr int live_leases = 50;
    for (int i = 0; i < live_leases; ++i) {
        h.registry->put_for_test(lease_record("lse_b" + std::to_string(i), "node-b"));
    }
    std::string dead_owner = "node-c";
    SECTION("an owner without a membership record") {}
    SECTION("an owner whose heartbeat is a TTL old") {
        h.put_live_node("node-c", h.node.config.node_ttl_ms);
    }
    constexpr std::uint64_t dead_leases = 3;
    for (std::uint64_t i = 0; i < dead_leases; ++i) {
        h.registry->put_for_test(lease_record("lse_c" + std::to_string(i), "node-c"));
    }
    // node-c's lease already released is not its to clean up again.
    h.registry->put_for_test(lease_record("lse_c_done", "node-c", lease_status::released));

    h.registry->reset_counts_for_test();
    h.run(sweep(h.node));

    for (std::uint64_t i = 0; i < dead_leases; ++i) {
        auto l = h.registry->lease_for_test("lse_c" + std::to_string(i));
        CHECK(l->status == lease_status::pending_cleanup);
        CHECK(l->epoch == 2);
        CHECK(l->owner_node_id == "node-c");  // the owner tears down when it comes back
        CHECK(l->cleanup_status == std::optional<std::string>("owner node node-c is dead"));
    }
    CHECK(h.registry->lease_for_test("lse_c_done")->status == lease_status::released);
    for (int i = 0; i < live_leases; ++i) {
        auto l = h.registry->lease_for_test("lse_b" + std::to_string(i));
        CHECK(l->status == lease_status::active);
        CHECK(l->epoch == 1);
    }
    // No sandbox of another node is destroyed from here.
    CHECK(h.provider->destroys == 0);
    // Bounded: node-c's three leases read once and written once each; none of node-b's 50
    // read. Calls: expired_leases, one page of this node's retained, list_nodes,
    // active_owner_nodes, one page of node-c's, three updates, one page of this node's
    // pending_cleanup.
    CHECK(h.registry->records_read == 2 * dead_leases);
    CHECK(h.registry->calls == 6 + dead_leases);

    // Once orphaned, a second pass reads none of them again.
    h.registry->reset_counts_for_test();
    h.run(sweep(h.node));
    CHECK(h.registry->records_read == 0);
    CHECK(h.registry->calls == 5);
}

TEST_CASE(
    "The sweeper leaves a dead owner's leases whose sandboxes outlive it for adoptGraceMs, "
    "then orphans them",
    "[unit][sweeper][adopt]") {
    NodeHarness h;
    h.provider->outlives = true;
    const std::int64_t ttl = h.node.config.node_ttl_ms;
    const std::int64_t grace = h.node.config.adopt_grace_ms;
    REQUIRE(grace == 60000);  // the default
    h.registry->put_for_test(lease_record("lse_c", "node-c"));
    // Dead by its heartbeat, and still within the grace: left for its restart.
    h.put_live_node("node-c", ttl + grace - 1000);
    h.run(sweep(h.node));
    CHECK(h.registry->lease_for_test("lse_c")->status == lease_status::active);
    CHECK(h.registry->lease_for_test("lse_c")->epoch == 1);
    // Past the grace: orphaned as any dead owner's.
    h.put_live_node("node-c", ttl + grace + 1000);
    h.run(sweep(h.node));
    CHECK(h.registry->lease_for_test("lse_c")->status == lease_status::pending_cleanup);
    // An owner with no record (decommissioned, or stopped without keeping) gets no grace.
    h.registry->put_for_test(lease_record("lse_d", "node-d"));
    h.run(sweep(h.node));
    CHECK(h.registry->lease_for_test("lse_d")->status == lease_status::pending_cleanup);
}

TEST_CASE(
    "The sweeper orphans nothing of an owner that heartbeats after the sweeper judged it dead",
    "[unit][sweeper][fencing]") {
    // The sweeper's view of node-c is a TTL old when it lists the nodes; node-c then
    // heartbeats (the sweeper's own node was frozen meanwhile) before the first orphaning is
    // written. The registry refuses that write, and the sweeper leaves node-c's other leases.
    NodeHarness h;
    h.put_live_node("node-c", h.node.config.node_ttl_ms);
    for (int i = 0; i < 3; ++i) {
        h.registry->put_for_test(lease_record("lse_c" + std::to_string(i), "node-c"));
    }
    int writes = 0;
    h.registry->before_write = [&](const std::string& op, const Lease& next) {
        if (op != "update_lease" || next.owner_node_id != "node-c") return;
        if (writes++ == 0) h.put_live_node("node-c");  // heartbeats now
    };
    h.run(sweep(h.node));
    h.registry->before_write = nullptr;
    CHECK(writes == 1);
    for (int i = 0; i < 3; ++i) {
        auto l = h.registry->lease_for_test("lse_c" + std::to_string(i));
        CHECK(l->status == lease_status::active);
        CHECK(l->epoch == 1);
    }
    CHECK(h.provider->destroys == 0);

    // Once node-c's record is a TTL old again, the next pass orphans all three.
    h.put_live_node("node-c", h.node.config.node_ttl_ms);
    h.run(sweep(h.node));
    for (int i = 0; i < 3; ++i) {
        CHECK(h.registry->lease_for_test("lse_c" + std::to_string(i))->status ==
              lease_status::pending_cleanup);
    }
}

TEST_CASE("Once it has run for a node TTL, the sweeper orphans its own leases it does not hold",
          "[unit][sweeper]") {
    SECTION("settled: a lease of this node with no cached sandbox (a restart) is orphaned") {
        NodeHarness h(/*started_ago_ms=*/20000);
        auto held = h.acquire();
        h.registry->put_for_test(lease_record("lse_lost", "node-a"));
        h.run(sweep(h.node));
        auto lost = h.registry->lease_for_test("lse_lost");
        // Orphaned, then (this node being its owner) torn down by scope in the same pass.
        CHECK(lost->status == lease_status::released);
        CHECK(lost->epoch == 3);
        CHECK(h.provider->destroyed() == std::vector<std::string>{"pl-lse_lost"});
        CHECK(h.registry->lease_for_test(held.id)->status == lease_status::active);
        CHECK(h.node.cache.find(scope_of(held)));
    }
    SECTION("not settled: such a lease is left alone") {
        NodeHarness h(/*started_ago_ms=*/0);
        h.registry->put_for_test(lease_record("lse_lost", "node-a"));
        h.run(sweep(h.node));
        CHECK(h.registry->lease_for_test("lse_lost")->status == lease_status::active);
        CHECK(h.provider->destroys == 0);
    }
}

TEST_CASE("The sweeper retries a pending cleanup with backoff and fails it after 5 attempts",
          "[unit][sweeper]") {
    NodeHarness h;
    h.provider->destroy_error = errc::provider_error;
    h.registry->put_for_test(lease_record("lse_1", "node-a", lease_status::pending_cleanup));
    // Makes the last attempt look old enough for any backoff (heartbeat * 2^attempts).
    auto age_last_attempt = [&] {
        edit(h, "lse_1", [](Lease& l) { l.last_used_at_ms = now_ms() - 3'600'000; });
    };

    // The first attempt is made at once.
    h.run(sweep(h.node));
    CHECK(h.provider->destroys == 1);
    CHECK(h.registry->lease_for_test("lse_1")->cleanup_attempts == 1);
    CHECK(h.registry->lease_for_test("lse_1")->status == lease_status::pending_cleanup);

    // Within the backoff nothing is tried.
    h.run(sweep(h.node));
    CHECK(h.provider->destroys == 1);

    // Attempts 2 to 5, each once its backoff is over.
    for (int attempt = 2; attempt <= 5; ++attempt) {
        age_last_attempt();
        h.run(sweep(h.node));
        CHECK(h.provider->destroys == attempt);
        CHECK(h.registry->lease_for_test("lse_1")->cleanup_attempts == attempt);
    }

    // The next pass gives up: failed, with what failed, and no sixth attempt.
    age_last_attempt();
    const auto before = *h.registry->lease_for_test("lse_1");
    h.run(sweep(h.node));
    auto failed = h.registry->lease_for_test("lse_1");
    CHECK(failed->status == lease_status::failed);
    CHECK(failed->epoch == before.epoch + 1);
    CHECK(failed->failure_reason ==
          std::optional<std::string>("teardown failed 5 times: fake provider: destroy failed"));
    CHECK(h.provider->destroys == 5);

    // A failed lease is never tried again.
    h.run(sweep(h.node));
    CHECK(h.provider->destroys == 5);
    CHECK(h.registry->lease_for_test("lse_1")->status == lease_status::failed);
}

TEST_CASE("A lease whose teardown failed for good leaves the cache and the node's claims",
          "[unit][sweeper]") {
    NodeHarness h;
    auto lease = h.acquire();
    h.provider->destroy_error = errc::provider_error;
    h.run(lease_release(h.node, h.host, lease.id));  // attempt 1 fails: pending_cleanup
    REQUIRE(h.registry->lease_for_test(lease.id)->status == lease_status::pending_cleanup);
    for (int pass = 0; pass < 5; ++pass) {  // attempts 2..5 fail, then the lease fails
        edit(h, lease.id, [](Lease& l) { l.last_used_at_ms = now_ms() - 3'600'000; });
        h.run(sweep(h.node));
    }
    REQUIRE(h.registry->lease_for_test(lease.id)->status == lease_status::failed);
    CHECK(h.node.cache.size() == 0);
    CHECK_FALSE(h.node.claim_of(lease.id));
}

TEST_CASE("The sweeper backs off by heartbeat * 2^attempts", "[unit][sweeper]") {
    NodeHarness h;
    h.provider->destroy_error = errc::provider_error;
    auto lease = lease_record("lse_1", "node-a", lease_status::pending_cleanup);
    lease.cleanup_attempts = 3;
    const auto backoff = static_cast<std::int64_t>(h.node.config.heartbeat_ms) << 3;
    SECTION("not yet over") {
        lease.last_used_at_ms = now_ms() - (backoff - 1000);  // a second to spare
        h.registry->put_for_test(lease);
        h.run(sweep(h.node));
        CHECK(h.provider->destroys == 0);
    }
    SECTION("over") {
        lease.last_used_at_ms = now_ms() - backoff - 1;
        h.registry->put_for_test(lease);
        h.run(sweep(h.node));
        CHECK(h.provider->destroys == 1);
        CHECK(h.registry->lease_for_test("lse_1")->cleanup_attempts == 4);
    }
}

TEST_CASE("The sweeper completes a pending cleanup when the provider succeeds", "[unit][sweeper]") {
    NodeHarness h;
    SECTION("a sandbox still cached (a release whose destroy failed once)") {
        auto lease = h.acquire();
        h.provider->destroy_error = errc::provider_error;
        h.run(lease_release(h.node, h.host, lease.id));
        h.provider->destroy_error.reset();
        edit(h, lease.id, [](Lease& l) { l.last_used_at_ms = now_ms() - 3'600'000; });
        h.run(sweep(h.node));
        auto l = h.registry->lease_for_test(lease.id);
        CHECK(l->status == lease_status::released);
        CHECK(l->cleanup_status == std::optional<std::string>("destroyed"));
        CHECK(h.provider->live().empty());
        CHECK(h.node.cache.size() == 0);
    }
    SECTION("a provider not ready spends no attempt; a later pass succeeds") {
        h.registry->put_for_test(lease_record("lse_1", "node-a", lease_status::pending_cleanup));
        h.provider->destroy_error = errc::provider_not_ready;
        h.run(sweep(h.node));
        CHECK(h.registry->lease_for_test("lse_1")->cleanup_attempts == 0);
        h.provider->destroy_error.reset();
        h.run(sweep(h.node));
        CHECK(h.registry->lease_for_test("lse_1")->status == lease_status::released);
        CHECK(h.provider->destroys == 2);
    }
    SECTION("a provider that cannot tear down by scope counts as a failed attempt") {
        h.provider->teardown_by_scope = false;
        h.registry->put_for_test(lease_record("lse_1", "node-a", lease_status::pending_cleanup));
        h.run(sweep(h.node));
        auto l = h.registry->lease_for_test("lse_1");
        CHECK(l->status == lease_status::pending_cleanup);
        CHECK(l->cleanup_attempts == 1);
        CHECK(h.provider->destroys == 0);
    }
}

TEST_CASE("A registry failure ends the sweep without changing anything", "[unit][sweeper]") {
    NodeHarness h;
    h.registry->put_for_test(lease_record("lse_c", "node-c"));
    h.registry->fail_membership = true;
    auto err = rpc_error_of([&] { h.run(sweep(h.node)); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(h.registry->lease_for_test("lse_c")->status == lease_status::active);
}

TEST_CASE(
    "A sweep in the middle of an acquire or a release neither orphans nor tears down "
    "the lease twice",
    "[unit][sweeper][race]") {
    NodeHarness h(/*started_ago_ms=*/20000);  // settled: it orphans leases it does not hold
    int sweeps = 0;
    // The sweep runs right after the registry stored the new active lease, before the acquire
    // goes on (the race window between the record and the cache).
    h.registry->after_write = [&](const std::string& op, const Lease& lease) {
        if (op != "create_lease" || lease.status != lease_status::active) return;
        ++sweeps;
        boost::asio::co_spawn(h.ioc, sweep(h.node), boost::asio::detached);
    };
    auto lease = h.acquire();
    h.registry->after_write = nullptr;
    REQUIRE(sweeps == 1);
    CHECK(h.registry->lease_for_test(lease.id)->status == lease_status::active);
    CHECK(h.registry->lease_for_test(lease.id)->epoch == lease.epoch);
    CHECK(h.provider->destroys == 0);
    CHECK(h.node.cache.find(scope_of(lease)));

    // The sweep runs right before the release's record is written (the sandbox is destroyed,
    // the record still says active).
    h.registry->before_write = [&](const std::string& op, const Lease& next) {
        if (op != "update_lease" || next.status != lease_status::released) return;
        ++sweeps;
        boost::asio::co_spawn(h.ioc, sweep(h.node), boost::asio::detached);
    };
    auto released = h.run(lease_release(h.node, h.host, lease.id));
    h.registry->before_write = nullptr;
    REQUIRE(sweeps == 2);
    CHECK(released.status == lease_status::released);
    CHECK(released.epoch == lease.epoch + 1);  // one transition: never via pending_cleanup
    CHECK(h.provider->destroys == 1);          // one teardown
    CHECK_FALSE(h.node.cache.find(scope_of(lease)));
}

TEST_CASE(
    "A release racing the sweeper's teardown of a lease pending cleanup destroys its "
    "sandbox once",
    "[unit][sweeper][race]") {
    // Issue 15, item 2: a lease is torn down once. The release of a lease pending cleanup and
    // the sweeper's pass over it both tear it down; the one that comes second waits for the
    // first and finds the record changed.
    NodeHarness h;
    auto lease = h.acquire();
    edit(h, lease.id, [](Lease& l) {
        l.status = lease_status::pending_cleanup;
        l.epoch += 1;
        l.cleanup_status = "owner node node-a is dead";
    });
    const auto pending_epoch = lease.epoch + 1;
    bool swept = false;
    // The sweep starts while the release's teardown is between its destroy and its record.
    h.registry->before_write = [&](const std::string& op, const Lease& next) {
        if (op != "update_lease" || next.status != lease_status::released || swept) return;
        swept = true;
        boost::asio::co_spawn(h.ioc, sweep(h.node), boost::asio::detached);
    };
    auto released = h.run(lease_release(h.node, h.host, lease.id));
    h.registry->before_write = nullptr;
    h.ioc.restart();
    h.ioc.run();  // the sweep, once the release's turn is over
    REQUIRE(swept);
    CHECK(released.status == lease_status::released);
    CHECK(released.epoch == pending_epoch + 1);
    CHECK(h.registry->lease_for_test(lease.id)->status == lease_status::released);
    CHECK(h.registry->lease_for_test(lease.id)->epoch == pending_epoch + 1);
    CHECK(h.provider->destroys == 1);
    CHECK_FALSE(h.node.cache.find(scope_of(lease)));
}
