// The registry contract (include/sandboxd/registry/registry.hpp): one suite run against every
// backend, SQLite on a temporary file and etcd on a real server (tests/support/etcd_fixture.hpp),
// so both pass the same assertions; then what only etcd has: an unreachable or frozen server,
// failover across endpoints, node keys that vanish with their etcd lease, token auth, and the
// daemon itself on etcd.
#include "support/daemon_fixture.hpp"
#include "support/etcd_fixture.hpp"
#include "support/registry_cases.hpp"
#include "support/tcp_relay.hpp"

#include "registry/etcd_client.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/registry/registry.hpp>

#include "support/sync_registry.hpp"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace sandboxd;
using namespace std::chrono_literals;
using json = nlohmann::json;
using test::EtcdServer;
using test::ids_of;
using test::make_lease;
using test::rpc_error_of;

namespace {

/// One backend's store; open() makes another registry object on the same store.
struct SqliteBackend {
    /// Epochs are stored as the caller gives them (expected + 1 on a change).
    static constexpr bool revision_epochs = false;
    test::TempDir dir;
    std::unique_ptr<test::SyncRegistry> open(std::int64_t /*node_ttl_ms*/ = 30000) {
        return test::open_sqlite((dir.path() / "registry.db").string());
    }
};

struct EtcdBackend {
    /// Epochs are the revisions of the writes that set them (registry.hpp, update_lease).
    static constexpr bool revision_epochs = true;
    std::string prefix = EtcdServer::unique_prefix();
    std::unique_ptr<test::SyncRegistry> open(std::int64_t node_ttl_ms = 30000) {
        return test::open_etcd({EtcdServer::shared().endpoint()}, prefix, node_ttl_ms);
    }
};

void check_same(const Lease& got, const Lease& want) {
    CHECK(got.id == want.id);
    CHECK(got.company_id == want.company_id);
    CHECK(got.environment_id == want.environment_id);
    CHECK(got.run_id == want.run_id);
    CHECK(got.issue_id == want.issue_id);
    CHECK(got.heartbeat_run_id == want.heartbeat_run_id);
    CHECK(got.execution_workspace_id == want.execution_workspace_id);
    CHECK(got.status == want.status);
    CHECK(got.provider == want.provider);
    CHECK(got.provider_lease_id == want.provider_lease_id);
    CHECK(got.owner_node_id == want.owner_node_id);
    CHECK(got.epoch == want.epoch);
    CHECK(got.acquired_at_ms == want.acquired_at_ms);
    CHECK(got.last_used_at_ms == want.last_used_at_ms);
    CHECK(got.expires_at_ms == want.expires_at_ms);
    CHECK(got.released_at_ms == want.released_at_ms);
    CHECK(got.failure_reason == want.failure_reason);
    CHECK(got.cleanup_status == want.cleanup_status);
    CHECK(got.metadata == want.metadata);
    CHECK(got.idempotency_key == want.idempotency_key);
    CHECK(got.config == want.config);
    CHECK(got.cleanup_attempts == want.cleanup_attempts);
    CHECK(got.limits == want.limits);
    CHECK(got.agent_id == want.agent_id);
    CHECK(got.provider_metadata == want.provider_metadata);
    CHECK(got.host_metadata == want.host_metadata);
    CHECK(got.capabilities == want.capabilities);
    CHECK(got.lease_policy == want.lease_policy);
}

/// The epoch contract of a write that asked for a new epoch `requested` over `previous`:
/// SQLite stores `requested`; etcd the write's revision, greater than `previous`.
template <typename Backend>
void check_new_epoch(std::int64_t got, std::int64_t requested, std::int64_t previous) {
    if constexpr (Backend::revision_epochs) {
        CHECK(got > previous);
    } else {
        CHECK(got == requested);
    }
}

/// create_lease(l), checking the returned lease against `l` and the epoch contract; returns
/// the lease as stored (the epoch the backend chose).
template <typename Backend>
Lease created(test::SyncRegistry& registry, Lease l) {
    Lease stored = registry.create_lease(l);
    check_new_epoch<Backend>(stored.epoch, l.epoch, 0);
    l.epoch = stored.epoch;
    check_same(stored, l);
    return stored;
}

/// Starts `a` on `io` without waiting for it (several calls in flight at once).
template <typename T>
std::future<T> net_spawn(test::IoThread& io, awaitable<T> a) {
    return boost::asio::co_spawn(io.executor(), std::move(a), boost::asio::use_future);
}

std::int64_t elapsed_ms(std::chrono::steady_clock::time_point since) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 since)
        .count();
}

}  // namespace

// --- the contract, for every backend ---------------------------------------------------------

TEMPLATE_TEST_CASE("Contract: a lease round-trips every field, absent ones as nulls",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();

    Lease full = make_lease("lease-full");
    full.run_id = "run-1";
    full.issue_id = "issue-1";
    full.heartbeat_run_id = "hb-1";
    full.execution_workspace_id = "ws-1";
    full.status = lease_status::pending_cleanup;
    full.epoch = 7;
    full.acquired_at_ms = 1'700'000'000'123;
    full.last_used_at_ms = 1'700'000'000'456;
    full.expires_at_ms = 1'700'000'060'000;
    full.released_at_ms = 1'700'000'030'000;
    full.failure_reason = "sandbox exited with status 3";
    full.cleanup_status = "retrying";
    full.metadata = {{"pluginId", "plugin-x"},
                     {"provider", "bwrap"},
                     {"nested", {{"list", {1, 2, 3}}, {"flag", true}, {"none", nullptr}}},
                     {"unicode", "h\u00e9llo \u2603"}};
    full.idempotency_key = "idem-1";
    full.config = {{"image", "debian"}, {"memoryMb", 512}};
    full.cleanup_attempts = 2;
    full.lease_policy = "reuse_by_execution_workspace";
    full.limits = {{"pids", 64}};
    full.agent_id = "agent-1";
    full.provider_metadata = {{"dir", "/x"}};
    full.host_metadata = {{"team", "blue"}};
    full.capabilities = {"channels", "retain"};

    Lease bare = make_lease("lease-bare");
    bare.metadata = nlohmann::json::object();

    full = created<TestType>(*registry, full);
    bare = created<TestType>(*registry, bare);

    auto got_full = registry->get_lease("lease-full");
    REQUIRE(got_full);
    check_same(*got_full, full);

    auto got_bare = registry->get_lease("lease-bare");
    REQUIRE(got_bare);
    check_same(*got_bare, bare);
    CHECK_FALSE(got_bare->run_id);
    CHECK_FALSE(got_bare->expires_at_ms);
    CHECK_FALSE(got_bare->idempotency_key);
    CHECK(got_bare->metadata == nlohmann::json::object());
    CHECK(got_bare->config == nlohmann::json::object());

    CHECK_FALSE(registry->get_lease("no-such-lease"));
}

TEMPLATE_TEST_CASE("Contract: an idempotency key returns the existing lease and writes nothing",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();

    Lease first = make_lease("lease-1");
    first.idempotency_key = "key-1";
    first = created<TestType>(*registry, first);

    Lease retry = make_lease("lease-2");
    retry.idempotency_key = "key-1";
    retry.provider_lease_id = "other";
    check_same(registry->create_lease(retry), first);

    auto page = registry->list_leases({});
    REQUIRE(page.leases.size() == 1);
    CHECK(page.leases[0].id == "lease-1");
    CHECK_FALSE(registry->get_lease("lease-2"));

    auto found = registry->find_by_idempotency_key("co-1", "env-1", "key-1");
    REQUIRE(found);
    check_same(*found, first);
    CHECK_FALSE(registry->find_by_idempotency_key("co-1", "env-1", "key-2"));
    CHECK_FALSE(registry->find_by_idempotency_key("co-2", "env-1", "key-1"));
}

TEMPLATE_TEST_CASE("Contract: the same idempotency key in another scope makes a new lease",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    test::check_idempotency_key_scopes(*registry);
}

TEMPLATE_TEST_CASE("Contract: ids and keys with slashes and percent signs stay apart",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();

    // ("a/b", "c") and ("a", "b/c") must not name the same idempotency record.
    Lease x = make_lease("lease/x%2F", "a/b", "c");
    x.idempotency_key = "k/1";
    Lease y = make_lease("lease%2Fx/", "a", "b/c");
    y.idempotency_key = "k/1";
    Lease z = make_lease("lease-z", "a", "b");
    z.idempotency_key = "c/k/1";
    for (auto* l : {&x, &y, &z}) *l = created<TestType>(*registry, *l);  // each a new lease
    check_same(*registry->get_lease("lease/x%2F"), x);
    check_same(*registry->get_lease("lease%2Fx/"), y);
    CHECK(registry->find_by_idempotency_key("a/b", "c", "k/1")->id == "lease/x%2F");
    CHECK(registry->find_by_idempotency_key("a", "b/c", "k/1")->id == "lease%2Fx/");
    CHECK(registry->find_by_idempotency_key("a", "b", "c/k/1")->id == "lease-z");
    CHECK_FALSE(registry->find_by_idempotency_key("a", "b", "c"));

    registry->register_node({"node/1", "ws://10.0.0.1:7000", 1, 2, "inst-1"}, 30000);
    REQUIRE(registry->get_node("node/1"));
    CHECK_FALSE(registry->get_node("node"));
    REQUIRE(registry->list_nodes().size() == 1);
    CHECK(registry->list_nodes()[0].node_id == "node/1");
}

TEMPLATE_TEST_CASE("Contract: update_lease stores every mutable field when the epoch matches",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    Lease original = make_lease("lease-1");
    original.expires_at_ms = 5000;
    original.idempotency_key = "key-1";
    original.config = {{"image", "debian"}};
    original = created<TestType>(*registry, original);
    const std::int64_t e1 = original.epoch;

    Lease next = original;
    next.status = lease_status::released;
    next.owner_node_id = "node-b";
    next.epoch = e1 + 1;
    next.last_used_at_ms = 2500;
    next.expires_at_ms = std::nullopt;
    next.released_at_ms = 3000;
    next.failure_reason = "killed";
    next.cleanup_status = "done";
    next.cleanup_attempts = 3;
    next.metadata["extra"] = 42;

    auto written = registry->update_lease(next, e1);
    REQUIRE(written);
    check_new_epoch<TestType>(written->epoch, e1 + 1, e1);
    next.epoch = written->epoch;
    check_same(*written, next);
    auto stored = registry->get_lease("lease-1");
    REQUIRE(stored);
    check_same(*stored, next);
    const std::int64_t e2 = next.epoch;

    SECTION("a stale epoch writes nothing") {
        Lease stale = next;
        stale.status = lease_status::failed;
        stale.owner_node_id = "node-c";
        stale.epoch = e2 + 1;
        stale.cleanup_attempts = 9;
        CHECK_FALSE(registry->update_lease(stale, e1));
        auto after = registry->get_lease("lease-1");
        REQUIRE(after);
        check_same(*after, next);
    }
    SECTION("a missing lease is not updated") {
        Lease ghost = next;
        ghost.id = "no-such-lease";
        CHECK_FALSE(registry->update_lease(ghost, e2));
        CHECK_FALSE(registry->get_lease("no-such-lease"));
    }
    SECTION("immutable fields are left alone") {
        Lease changed = next;
        changed.epoch = e2 + 1;
        changed.company_id = "co-other";
        changed.provider_lease_id = "pl-other";
        changed.acquired_at_ms = 1;
        changed.idempotency_key = "key-other";
        changed.config = {{"image", "alpine"}};
        auto changed_written = registry->update_lease(changed, e2);
        REQUIRE(changed_written);
        check_new_epoch<TestType>(changed_written->epoch, e2 + 1, e2);
        auto after = registry->get_lease("lease-1");
        REQUIRE(after);
        Lease want = next;
        want.epoch = changed_written->epoch;
        check_same(*after, want);
        check_same(*changed_written, want);
        // The idempotency record still names the lease under its original key.
        CHECK(registry->find_by_idempotency_key("co-1", "env-1", "key-1")->id == "lease-1");
        CHECK_FALSE(registry->find_by_idempotency_key("co-1", "env-1", "key-other"));
    }
}

TEMPLATE_TEST_CASE(
    "Contract: update_lease_if_owner_unchanged writes only while the owner's record is as seen",
    "[registry][contract][fencing]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    Lease lease = created<TestType>(*registry, make_lease("lease-1"));  // owner node-a
    const std::int64_t e1 = lease.epoch;
    Lease orphaned = lease;
    orphaned.status = lease_status::pending_cleanup;
    orphaned.epoch = e1 + 1;
    orphaned.cleanup_status = "owner node node-a is dead";
    // Refused: nothing of the lease changed.
    auto unchanged = [&] {
        auto stored = registry->get_lease("lease-1");
        REQUIRE(stored);
        CHECK(stored->status == lease_status::active);
        CHECK(stored->epoch == e1);
        CHECK_FALSE(stored->cleanup_status);
    };

    SECTION("no record, still none: written") {
        auto written = registry->update_lease_if_owner_unchanged(orphaned, e1, std::nullopt);
        REQUIRE(written);
        CHECK(written->status == lease_status::pending_cleanup);
        check_new_epoch<TestType>(written->epoch, e1 + 1, e1);
        CHECK(registry->get_lease("lease-1")->status == lease_status::pending_cleanup);
    }
    SECTION("no record when seen, registered since: refused") {
        registry->register_node({"node-a", "ws://a:1", 10, 20, "inst-a"}, 30000);
        CHECK_FALSE(registry->update_lease_if_owner_unchanged(orphaned, e1, std::nullopt));
        unchanged();
    }
    registry->register_node({"node-a", "ws://a:1", 10, 20, "inst-a"}, 30000);
    auto seen = registry->get_node("node-a");
    REQUIRE(seen);
    SECTION("the record as seen: written") {
        auto written = registry->update_lease_if_owner_unchanged(orphaned, e1, seen);
        REQUIRE(written);
        CHECK(written->status == lease_status::pending_cleanup);
        CHECK(written->cleanup_status == orphaned.cleanup_status);
    }
    SECTION("the owner heartbeated since: refused, and written with the new record") {
        REQUIRE(registry->heartbeat_node("node-a", "inst-a", 30));
        CHECK_FALSE(registry->update_lease_if_owner_unchanged(orphaned, e1, seen));
        unchanged();
        auto now_seen = registry->get_node("node-a");
        CHECK(registry->update_lease_if_owner_unchanged(orphaned, e1, now_seen));
    }
    SECTION("the owner's record was removed since: refused") {
        registry->remove_node("node-a", "inst-a");
        CHECK_FALSE(registry->update_lease_if_owner_unchanged(orphaned, e1, seen));
        unchanged();
    }
    SECTION("another instance registered since, with the same heartbeatAt: refused") {
        registry->remove_node("node-a", "inst-a");
        registry->register_node({"node-a", "ws://a:1", 10, 20, "inst-a2"}, 30000);
        CHECK_FALSE(registry->update_lease_if_owner_unchanged(orphaned, e1, seen));
        unchanged();
    }
    SECTION("a stale epoch with the record as seen: refused") {
        Lease renewed = lease;
        renewed.epoch = e1 + 1;
        auto moved = registry->update_lease(renewed, e1);
        REQUIRE(moved);
        CHECK_FALSE(registry->update_lease_if_owner_unchanged(orphaned, e1, seen));
        CHECK(registry->get_lease("lease-1")->status == lease_status::active);
        CHECK(registry->get_lease("lease-1")->epoch == moved->epoch);
    }
}

TEMPLATE_TEST_CASE("Contract: concurrent updates from one epoch have exactly one winner",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto first = backend.open();
    auto second = backend.open();
    const std::int64_t e0 = created<TestType>(*first, make_lease("lease-1")).epoch;

    // Four writers race to move the lease from each epoch to a new one; each epoch is won
    // exactly once, and the wins form one chain from the first epoch to the stored one.
    constexpr int rounds = 10;
    std::atomic<int> wins{0};
    std::mutex won_mutex;
    std::map<std::int64_t, std::int64_t> won;  // from epoch -> to epoch
    int duplicate_wins = 0;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        test::SyncRegistry& registry = t % 2 == 0 ? *first : *second;
        threads.emplace_back([&, t] {
            for (int i = 0; i < rounds * 4 && wins.load() < rounds; ++i) {
                auto current = registry.get_lease("lease-1");
                if (!current) return;
                Lease next = *current;
                next.epoch = current->epoch + 1;
                next.owner_node_id = "node-" + std::to_string(t);
                if (auto w = registry.update_lease(next, current->epoch)) {
                    ++wins;
                    std::lock_guard lock(won_mutex);
                    if (!won.emplace(current->epoch, w->epoch).second) ++duplicate_wins;
                }
            }
        });
    }
    for (auto& th : threads) th.join();

    CHECK(duplicate_wins == 0);  // no epoch won twice
    CHECK(won.size() >= static_cast<std::size_t>(rounds));
    std::int64_t at = e0;  // follow the chain: none skipped
    for (std::size_t i = 0; i < won.size(); ++i) {
        auto it = won.find(at);
        REQUIRE(it != won.end());
        check_new_epoch<TestType>(it->second, at + 1, at);
        at = it->second;
    }
    auto final_lease = first->get_lease("lease-1");
    REQUIRE(final_lease);
    CHECK(final_lease->epoch == at);
}

TEMPLATE_TEST_CASE("Contract: list_leases filters by company, environment, status, owner, tenants",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    test::check_list_filters(*registry);
}

TEMPLATE_TEST_CASE("Contract: list_leases pages through 250 leases exactly once, in order",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    test::check_list_pages(*registry);
}

TEMPLATE_TEST_CASE(
    "Contract: list_leases with or without a status pages over every owner in (acquiredAt, id) "
    "order",
    "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    // 90 leases over three owners (one of them none) and two tenants; every third released.
    // Inserted in reverse, with acquiredAt shared by pairs so that the id breaks ties.
    const std::vector<std::string> owners = {"node-a", "node-b", ""};
    std::vector<std::string> active_co1, released;
    std::vector<Lease> all;
    for (int i = 0; i < 90; ++i) {
        char id[16];
        std::snprintf(id, sizeof id, "lease-%03d", i);
        Lease l = make_lease(id, i % 2 ? "co-2" : "co-1", "env-1", 5000 + i / 2);
        l.owner_node_id = owners[static_cast<std::size_t>(i) % owners.size()];
        l.status = i % 3 == 2 ? lease_status::released : lease_status::active;
        if (l.status == lease_status::released) released.push_back(l.id);
        if (l.status == lease_status::active && l.company_id == "co-1") active_co1.push_back(l.id);
        all.push_back(std::move(l));
    }
    std::reverse(all.begin(), all.end());
    for (const auto& l : all) registry->create_lease(l);

    const auto pages = [&](LeaseQuery q) {
        std::vector<std::string> got;
        for (int n = 0; n < 100; ++n) {
            auto page = registry->list_leases(q);
            CHECK(page.leases.size() <= q.limit);
            for (const auto& l : page.leases) got.push_back(l.id);
            if (page.next_cursor.empty()) break;
            q.cursor = page.next_cursor;
        }
        return got;
    };
    LeaseQuery q;
    q.limit = 7;
    q.status = lease_status::released;
    CHECK(pages(q) == released);
    // A tenant filter on top: pages skip the other tenant's leases, none is lost.
    q.status = lease_status::active;
    q.tenants = {"co-1"};
    CHECK(pages(q) == active_co1);
    // A status change moves the lease between the listings.
    Lease moved = *registry->get_lease("lease-000");
    moved.status = lease_status::released;
    REQUIRE(registry->update_lease(moved, moved.epoch));
    auto after = pages(q);
    CHECK(std::find(after.begin(), after.end(), "lease-000") == after.end());
    CHECK(after.size() == active_co1.size() - 1);
    q.tenants.clear();
    q.status = lease_status::released;
    auto now_released = pages(q);
    CHECK(now_released.front() == "lease-000");
    CHECK(now_released.size() == released.size() + 1);
    // No status: every lease once, over every owner and status, in (acquiredAt, id) order.
    q.status.reset();
    std::vector<std::string> every;
    for (int i = 0; i < 90; ++i) {
        char id[16];
        std::snprintf(id, sizeof id, "lease-%03d", i);
        every.emplace_back(id);
    }
    CHECK(pages(q) == every);
}

TEMPLATE_TEST_CASE("Contract: list_leases clamps the limit to 1..1000", "[registry][contract]",
                   SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    test::check_list_limit_clamped(*registry);
}

TEMPLATE_TEST_CASE("Contract: a malformed cursor is rejected with invalid_params",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    test::check_malformed_cursors(*registry);
}

TEMPLATE_TEST_CASE("Contract: expired_leases returns the owner's active leases expiring by a time",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();

    Lease due = make_lease("due");
    due.expires_at_ms = 5000;
    Lease exactly = make_lease("exactly");
    exactly.expires_at_ms = 6000;
    Lease later = make_lease("later");
    later.expires_at_ms = 6001;
    Lease forever = make_lease("forever");
    Lease released = make_lease("released");
    released.expires_at_ms = 1000;
    released.status = lease_status::released;
    Lease elsewhere = make_lease("elsewhere");
    elsewhere.expires_at_ms = 1000;
    elsewhere.owner_node_id = "node-b";
    for (auto* l : {&due, &exactly, &later, &forever, &released, &elsewhere}) {
        *l = created<TestType>(*registry, *l);
    }

    CHECK(ids_of(registry->expired_leases("node-a", 6000)) ==
          std::vector<std::string>{"due", "exactly"});
    CHECK(ids_of(registry->expired_leases("node-a", 4999)).empty());
    CHECK(ids_of(registry->expired_leases("node-b", 6000)) ==
          std::vector<std::string>{"elsewhere"});
    CHECK(ids_of(registry->expired_leases("node-c", 9000)).empty());
    auto got = registry->expired_leases("node-a", 5000);
    REQUIRE(got.size() == 1);
    check_same(got[0], due);
}

TEMPLATE_TEST_CASE("Contract: find_by_provider_lease finds a lease by provider and its id",
                   "[registry][contract][index]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    Lease a = make_lease("a");
    a.provider_lease_id = "sb/1%";  // slashes and percent signs stay apart
    Lease b = make_lease("b");
    b.provider = "plugin-x";
    b.provider_lease_id = "sb/1%";
    a = created<TestType>(*registry, a);
    b = created<TestType>(*registry, b);

    auto got = registry->find_by_provider_lease("bwrap", "sb/1%");
    REQUIRE(got);
    check_same(*got, a);
    got = registry->find_by_provider_lease("plugin-x", "sb/1%");
    REQUIRE(got);
    CHECK(got->id == "b");
    CHECK_FALSE(registry->find_by_provider_lease("bwrap", "sb"));
    CHECK_FALSE(registry->find_by_provider_lease("nope", "sb/1%"));

    // A released lease is still found (the index follows the record, not its status).
    Lease next = a;
    next.status = lease_status::released;
    next.epoch = a.epoch + 1;
    REQUIRE(registry->update_lease(next, a.epoch));
    got = registry->find_by_provider_lease("bwrap", "sb/1%");
    REQUIRE(got);
    CHECK(got->status == lease_status::released);
}

TEMPLATE_TEST_CASE("Contract: active_owner_nodes lists each owner of an active lease once",
                   "[registry][contract][index]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    CHECK(registry->active_owner_nodes().empty());
    std::map<std::string, Lease> leases;
    for (const auto& [id, owner] : std::vector<std::pair<std::string, std::string>>{
             {"l1", "node-a"}, {"l2", "node-a"}, {"l3", "node/b"}, {"l4", "node-c"}}) {
        Lease l = make_lease(id);
        l.owner_node_id = owner;
        leases[id] = created<TestType>(*registry, l);
    }
    using ids = std::vector<std::string>;
    auto owners = [&] {
        auto got = registry->active_owner_nodes();
        std::sort(got.begin(), got.end());
        return got;
    };
    CHECK(owners() == ids{"node-a", "node-c", "node/b"});

    // node-c's only lease is released: it owns no active lease any more.
    Lease next = leases["l4"];
    next.status = lease_status::released;
    next.epoch = leases["l4"].epoch + 1;
    REQUIRE(registry->update_lease(next, leases["l4"].epoch));
    // l3 moves from node/b to node-a.
    next = leases["l3"];
    next.owner_node_id = "node-a";
    next.epoch = leases["l3"].epoch + 1;
    REQUIRE(registry->update_lease(next, leases["l3"].epoch));
    CHECK(owners() == ids{"node-a"});
}

TEMPLATE_TEST_CASE("Contract: list_leases by owner follows owner and status changes, in pages",
                   "[registry][contract][index]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    std::vector<Lease> stored;
    for (int i = 0; i < 30; ++i) {
        char id[16];
        std::snprintf(id, sizeof id, "lease-%02d", i);
        Lease l = make_lease(id, i % 2 == 0 ? "co-1" : "co-2", "env-1", 1000 + i / 4);
        l.owner_node_id = i % 3 == 0 ? "node-b" : "node-a";
        stored.push_back(created<TestType>(*registry, l));
    }
    // Every fifth lease is released or retained (in turn); lease-01 moves to node-b.
    for (int i = 0; i < 30; i += 5) {
        Lease next = stored[static_cast<std::size_t>(i)];
        next.status = i % 10 == 0 ? lease_status::released : lease_status::retained;
        next.epoch = next.epoch + 1;
        auto w = registry->update_lease(next, stored[static_cast<std::size_t>(i)].epoch);
        REQUIRE(w);
        stored[static_cast<std::size_t>(i)] = *w;
    }
    {
        Lease next = stored[1];
        next.owner_node_id = "node-b";
        next.epoch = next.epoch + 1;
        auto w = registry->update_lease(next, stored[1].epoch);
        REQUIRE(w);
        stored[1] = *w;
    }
    auto want = [&](const std::string& owner, std::optional<lease_status> status,
                    std::optional<std::string> company) {
        std::vector<std::string> out;
        for (const auto& l : stored) {
            if (l.owner_node_id == owner && (!status || l.status == *status) &&
                (!company || l.company_id == *company)) {
                out.push_back(l.id);
            }
        }
        return out;  // ids sort like (acquiredAt, id) here
    };
    for (const std::string owner : {"node-a", "node-b", "node-none"}) {
        for (auto status : std::vector<std::optional<lease_status>>{
                 std::nullopt, lease_status::active, lease_status::released,
                 lease_status::retained}) {
            for (const auto& company :
                 std::vector<std::optional<std::string>>{std::nullopt, "co-1"}) {
                CAPTURE(owner, status ? std::string(to_string(*status)) : "any",
                        company.value_or("any"));
                LeaseQuery q;
                q.owner_node_id = owner;
                q.status = status;
                q.company_id = company;
                q.limit = 4;
                std::vector<std::string> got;
                for (int pages = 0; pages < 20; ++pages) {
                    auto page = registry->list_leases(q);
                    CHECK(page.leases.size() <= 4);
                    for (const auto& l : page.leases) got.push_back(l.id);
                    if (page.next_cursor.empty()) break;
                    q.cursor = page.next_cursor;
                }
                CHECK(got == want(owner, status, company));
            }
        }
    }
}

TEMPLATE_TEST_CASE("Contract: two registries on one store see each other's writes",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto first = backend.open();
    auto second = backend.open();

    Lease lease = make_lease("lease-1");
    lease.idempotency_key = "key-1";
    lease = created<TestType>(*first, lease);
    auto seen = second->get_lease("lease-1");
    REQUIRE(seen);
    check_same(*seen, lease);

    Lease retry = make_lease("lease-2");
    retry.idempotency_key = "key-1";
    CHECK(second->create_lease(retry).id == "lease-1");

    Lease next = lease;
    next.epoch = lease.epoch + 1;
    next.status = lease_status::expired;
    auto written = second->update_lease(next, lease.epoch);
    REQUIRE(written);
    check_new_epoch<TestType>(written->epoch, lease.epoch + 1, lease.epoch);
    CHECK_FALSE(first->update_lease(next, lease.epoch));
    CHECK(first->get_lease("lease-1")->status == lease_status::expired);
    CHECK(first->get_lease("lease-1")->epoch == written->epoch);

    first->register_node({"node-a", "ws://10.0.0.1:7000", 100, 200, "inst-1"}, 30000);
    auto nodes = second->list_nodes();
    REQUIRE(nodes.size() == 1);
    CHECK(nodes[0].node_id == "node-a");
    CHECK(nodes[0].instance_id == "inst-1");
    // Heartbeat and removal work from any registry object of the store.
    CHECK(second->heartbeat_node("node-a", "inst-1", 300));
    CHECK(first->get_node("node-a")->heartbeat_at_ms == 300);
    second->remove_node("node-a", "inst-1");
    CHECK_FALSE(first->get_node("node-a"));
}

TEMPLATE_TEST_CASE("Contract: concurrent creates with one idempotency key make exactly one lease",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto first = backend.open();
    auto second = backend.open();

    constexpr int per_thread = 25;
    std::vector<std::vector<std::string>> results(4);
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < results.size(); ++t) {
        test::SyncRegistry& registry = t % 2 == 0 ? *first : *second;
        threads.emplace_back([&registry, &results, t] {
            for (int i = 0; i < per_thread; ++i) {
                Lease keyed = make_lease("keyed-" + std::to_string(t) + "-" + std::to_string(i));
                keyed.idempotency_key = "the-key";
                results[t].push_back(registry.create_lease(keyed).id);
                registry.create_lease(
                    make_lease("plain-" + std::to_string(t) + "-" + std::to_string(i)));
            }
        });
    }
    for (auto& th : threads) th.join();

    std::set<std::string> returned;
    for (const auto& r : results) returned.insert(r.begin(), r.end());
    REQUIRE(returned.size() == 1);
    auto stored = first->find_by_idempotency_key("co-1", "env-1", "the-key");
    REQUIRE(stored);
    CHECK(*returned.begin() == stored->id);

    LeaseQuery q;
    q.limit = 1000;
    CHECK(second->list_leases(q).leases.size() == 1 + results.size() * per_thread);
}

TEMPLATE_TEST_CASE("Contract: a node registers, heartbeats and is removed", "[registry][contract]",
                   SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    CHECK(registry->list_nodes().empty());
    CHECK_FALSE(registry->get_node("node-a"));

    registry->register_node({"node-b", "wss://b.example:443", 10, 20, "inst-b"}, 30000);
    registry->register_node({"node-a", "ws://10.0.0.1:7000", 100, 200, "inst-a"}, 30000);

    auto nodes = registry->list_nodes();
    REQUIRE(nodes.size() == 2);
    CHECK(nodes[0].node_id == "node-a");
    CHECK(nodes[1].node_id == "node-b");
    auto a = registry->get_node("node-a");
    REQUIRE(a);
    CHECK(a->url == "ws://10.0.0.1:7000");
    CHECK(a->started_at_ms == 100);
    CHECK(a->heartbeat_at_ms == 200);
    CHECK(a->instance_id == "inst-a");

    CHECK(registry->heartbeat_node("node-a", "inst-a", 700));
    CHECK(registry->get_node("node-a")->heartbeat_at_ms == 700);
    CHECK_FALSE(registry->heartbeat_node("node-a", "inst-other", 800));
    CHECK_FALSE(registry->heartbeat_node("node-z", "inst-a", 800));
    CHECK(registry->get_node("node-a")->heartbeat_at_ms == 700);

    // The same instance may register again while live (a refresh).
    registry->register_node({"node-a", "ws://10.0.0.2:7000", 100, 900, "inst-a"}, 30000);
    CHECK(registry->get_node("node-a")->url == "ws://10.0.0.2:7000");
    CHECK(registry->get_node("node-a")->heartbeat_at_ms == 900);
    CHECK(registry->heartbeat_node("node-a", "inst-a", 1000));

    registry->remove_node("node-a", "inst-other");
    CHECK(registry->get_node("node-a"));
    registry->remove_node("node-a", "inst-a");
    CHECK_FALSE(registry->get_node("node-a"));
    CHECK_FALSE(registry->heartbeat_node("node-a", "inst-a", 1100));
    REQUIRE(registry->list_nodes().size() == 1);
    CHECK(registry->list_nodes()[0].node_id == "node-b");
}

TEMPLATE_TEST_CASE("Contract: a second live instance of a node id is refused until the TTL passes",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    auto registry = backend.open();
    constexpr std::int64_t ttl = 30000;
    registry->register_node({"node-a", "ws://10.0.0.1:7000", 1000, 1000, "inst-1"}, ttl);

    auto err = rpc_error_of([&] {
        registry->register_node({"node-a", "ws://10.0.0.9:7000", 30999, 30999, "inst-2"}, ttl);
    });
    REQUIRE(err);
    CHECK(err->code() == errc::invalid_params);
    CHECK(std::string(err->what()) ==
          "node id node-a is already held by a live process (last heartbeat 29999 ms ago)");
    auto kept = registry->get_node("node-a");
    REQUIRE(kept);
    CHECK(kept->instance_id == "inst-1");
    CHECK(kept->url == "ws://10.0.0.1:7000");

    // The refused registration left the store usable: writes still work.
    CHECK(registry->heartbeat_node("node-a", "inst-1", 1000));

    registry->register_node({"node-a", "ws://10.0.0.9:7000", 31000, 31000, "inst-2"}, ttl);
    auto taken = registry->get_node("node-a");
    REQUIRE(taken);
    CHECK(taken->instance_id == "inst-2");
    CHECK(taken->url == "ws://10.0.0.9:7000");
    CHECK(taken->started_at_ms == 31000);
    CHECK(taken->heartbeat_at_ms == 31000);

    CHECK_FALSE(registry->heartbeat_node("node-a", "inst-1", 31001));
    CHECK(registry->get_node("node-a")->heartbeat_at_ms == 31000);
}

TEMPLATE_TEST_CASE("Contract: a lease survives closing and reopening the registry",
                   "[registry][contract]", SqliteBackend, EtcdBackend) {
    TestType backend;
    Lease lease = make_lease("lease-1");
    lease.idempotency_key = "key-1";
    lease.expires_at_ms = 9000;
    {
        auto registry = backend.open();
        lease = created<TestType>(*registry, lease);
        registry->register_node({"node-a", "ws://10.0.0.1:7000", 1, 2, "inst-1"}, 30000);
    }
    auto reopened = backend.open();
    auto got = reopened->get_lease("lease-1");
    REQUIRE(got);
    check_same(*got, lease);
    REQUIRE(reopened->get_node("node-a"));
    CHECK(reopened->get_node("node-a")->instance_id == "inst-1");

    Lease retry = make_lease("lease-2");
    retry.idempotency_key = "key-1";
    CHECK(reopened->create_lease(retry).id == "lease-1");
}

// --- etcd only -------------------------------------------------------------------------------

namespace {

/// Calls every Registry method once; returns how many threw registry_unavailable, failing the
/// test for any other outcome.
int count_unavailable(test::SyncRegistry& registry) {
    int unavailable = 0;
    std::vector<std::pair<std::string, std::function<void()>>> calls = {
        {"create_lease", [&] { registry.create_lease(make_lease("lease-x")); }},
        {"get_lease", [&] { registry.get_lease("lease-1"); }},
        {"find_by_idempotency_key",
         [&] { registry.find_by_idempotency_key("co-1", "env-1", "key-1"); }},
        {"list_leases", [&] { registry.list_leases({}); }},
        {"update_lease", [&] { registry.update_lease(make_lease("lease-1"), 1); }},
        {"expired_leases", [&] { registry.expired_leases("node-a", 1); }},
        {"register_node",
         [&] {
             registry.register_node({"node-b", "ws://b:1", 1, 1, "inst-b"}, 30000);
         }},
        {"heartbeat_node", [&] { registry.heartbeat_node("node-a", "inst-1", 5); }},
        {"remove_node", [&] { registry.remove_node("node-a", "inst-1"); }},
        {"list_nodes", [&] { registry.list_nodes(); }},
        {"get_node", [&] { registry.get_node("node-a"); }},
    };
    for (auto& [name, call] : calls) {
        CAPTURE(name);
        auto err = rpc_error_of(call);
        CHECK(err);
        if (!err) continue;
        CHECK(err->code() == errc::registry_unavailable);
        CHECK(std::string(err->what()).rfind("registry: ", 0) == 0);
        if (err->code() == errc::registry_unavailable) ++unavailable;
    }
    return unavailable;
}

}  // namespace

TEST_CASE("etcd stopped: every call fails closed at once, and works again after a restart",
          "[registry][etcd]") {
    EtcdServer etcd;
    auto registry = test::open_etcd({etcd.endpoint()}, "/sandboxd/v1/", 30000);
    Lease lease = make_lease("lease-1");
    lease.idempotency_key = "key-1";
    lease = created<EtcdBackend>(*registry, lease);
    registry->register_node({"node-a", "ws://a:1", 1, 1, "inst-1"}, 30000);

    etcd.stop();
    const auto began = std::chrono::steady_clock::now();
    CHECK(count_unavailable(*registry) == 11);
    CHECK(elapsed_ms(began) < 3000);  // connection refused: no waiting
    auto err = rpc_error_of([&] { registry->get_lease("lease-1"); });
    REQUIRE(err);
    CHECK(std::string(err->what()).rfind("registry: get lease: " + etcd.endpoint(), 0) == 0);

    etcd.start();
    auto back = registry->get_lease("lease-1");
    REQUIRE(back);
    check_same(*back, lease);
    CHECK(registry->find_by_idempotency_key("co-1", "env-1", "key-1"));
    CHECK(registry->heartbeat_node("node-a", "inst-1", 2));
    CHECK(registry->create_lease(make_lease("lease-2")).id == "lease-2");
}

TEST_CASE("etcd frozen: calls time out after 2 s, then recover", "[registry][etcd]") {
    EtcdServer etcd;
    auto registry = test::open_etcd({etcd.endpoint()}, "/sandboxd/v1/", 30000);
    registry->create_lease(make_lease("lease-1"));

    etcd.pause();
    for (int i = 0; i < 2; ++i) {  // a pooled connection, then a fresh one
        const auto began = std::chrono::steady_clock::now();
        auto err = rpc_error_of([&] { registry->get_lease("lease-1"); });
        const auto took = elapsed_ms(began);
        REQUIRE(err);
        CHECK(err->code() == errc::registry_unavailable);
        CHECK(std::string(err->what()).find("timed out after 2000 ms") != std::string::npos);
        CHECK(took >= 1900);
        CHECK(took < 4000);
    }
    etcd.resume();
    CHECK(test::eventually(
        [&] {
            try {
                return registry->get_lease("lease-1").has_value();
            } catch (const rpc_error&) {
                return false;
            }
        },
        10s));
}

TEST_CASE("etcd: requests fail over to the next endpoint", "[registry][etcd]") {
    auto& etcd = EtcdServer::shared();
    // A loopback port nobody listens on comes first.
    const std::string dead = "http://127.0.0.1:1";
    auto prefix = EtcdServer::unique_prefix();
    auto registry = test::open_etcd({dead, etcd.endpoint()}, prefix, 30000);
    CHECK(registry->create_lease(make_lease("lease-1")).id == "lease-1");
    CHECK(registry->get_lease("lease-1"));

    auto only_dead = test::open_etcd({dead, "http://127.0.0.1:2"}, prefix, 30000);
    auto err = rpc_error_of([&] { only_dead->get_lease("lease-1"); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    const std::string what = err->what();
    CHECK(what.find("http://127.0.0.1:1/v3/kv/range") != std::string::npos);
    CHECK(what.find("http://127.0.0.1:2/v3/kv/range") != std::string::npos);
}

TEST_CASE("etcd: 200 calls in flight at once on one registry all complete, after failing over",
          "[registry][etcd][concurrency]") {
    auto& etcd = EtcdServer::shared();
    // A loopback port nobody listens on comes first: the first calls fail over.
    auto registry = test::open_etcd({"http://127.0.0.1:1", etcd.endpoint()},
                                    EtcdServer::unique_prefix(), 30000);
    auto& io = registry->io();
    constexpr int n = 200;
    std::vector<std::future<Lease>> creates;
    creates.reserve(n);
    for (int i = 0; i < n; ++i) {
        creates.push_back(net_spawn(
            io, registry->async().create_lease(make_lease("lease-" + std::to_string(i)))));
    }
    for (int i = 0; i < n; ++i)
        CHECK(creates[static_cast<std::size_t>(i)].get().id == "lease-" + std::to_string(i));
    std::vector<std::future<std::optional<Lease>>> gets;
    gets.reserve(n);
    for (int i = 0; i < n; ++i) {
        gets.push_back(net_spawn(io, registry->async().get_lease("lease-" + std::to_string(i))));
    }
    for (int i = 0; i < n; ++i) {
        auto got = gets[static_cast<std::size_t>(i)].get();
        REQUIRE(got);
        CHECK(got->id == "lease-" + std::to_string(i));
    }
    LeaseQuery q;
    q.owner_node_id = "node-a";
    q.limit = 1000;
    CHECK(registry->list_leases(q).leases.size() == n);
}

TEST_CASE("etcd: leases stored without index keys are indexed on first use",
          "[registry][etcd][index]") {
    auto& etcd = EtcdServer::shared();
    const auto prefix = EtcdServer::unique_prefix();
    {
        // What an older version wrote: the lease record alone, and no marker.
        auto registry = test::open_etcd({etcd.endpoint()}, prefix, 30000);
        Lease l = make_lease("old");
        l.expires_at_ms = 500;
        registry->create_lease(l);
        test::IoThread io;
        etcd::Client raw(io.executor(), {etcd.endpoint()}, "", "", 2s);
        io.run(raw.call("test", "/v3/kv/deleterange",
                        {{"key", base64_encode(prefix + "plid/")},
                         {"range_end", base64_encode(etcd::prefix_end(prefix + "plid/"))}}));
        io.run(raw.call("test", "/v3/kv/deleterange",
                        {{"key", base64_encode(prefix + "owner/")},
                         {"range_end", base64_encode(etcd::prefix_end(prefix + "owner/"))}}));
    }
    auto registry = test::open_etcd({etcd.endpoint()}, prefix, 30000);
    auto got = registry->find_by_provider_lease("bwrap", "pl-old");
    REQUIRE(got);
    CHECK(got->id == "old");
    CHECK(registry->active_owner_nodes() == std::vector<std::string>{"node-a"});
    CHECK(ids_of(registry->expired_leases("node-a", 1000)) == std::vector<std::string>{"old"});
}

TEST_CASE("etcd: a leaseList page reads keys for that page, not every index key of the store",
          "[registry][etcd][index]") {
    // 20 leases of two owners (half released), then 5,000 more index keys of a third owner that
    // sort after all of them. Pages of 5 over the 20, with or without a status, read at most a
    // page's worth of keys per owner and status: before, every page read the whole index
    // (quadratic over a listing: 2 s a page with 13,000 leases on the daemon's ASan build).
    auto& etcd = EtcdServer::shared();
    const auto target = parse_http_endpoint(etcd.endpoint());
    test::TcpRelay relay("127.0.0.1", target.port);
    const auto prefix = EtcdServer::unique_prefix();
    auto registry = test::open_etcd({relay.endpoint()}, prefix, 30000);
    std::vector<std::string> want;
    for (int i = 0; i < 20; ++i) {
        const std::string id = "lse_" + std::to_string(100 + i);
        Lease l = make_lease(id, "co-1", "env-1", 1000 + i);
        l.owner_node_id = i % 2 == 0 ? "node-a" : "node-b";
        if (i % 4 >= 2) l.status = lease_status::released;
        registry->create_lease(l);
        want.push_back(id);
    }
    {
        test::IoThread io;
        etcd::Client raw(io.executor(), {etcd.endpoint()}, "", "", 10s);
        const std::string value = json{{"expiresAtMs", nullptr}}.dump();
        for (int batch = 0; batch < 50; ++batch) {
            json puts = json::array();
            for (int i = 0; i < 100; ++i) {
                char key[64];
                std::snprintf(key, sizeof key, "owner/released/node-z/99999999999999999999/x%05d",
                              batch * 100 + i);
                puts.push_back(etcd::request_put(prefix + key, value));
            }
            io.run(raw.txn("test", json::array(), std::move(puts)));
        }
    }
    const std::size_t whole_index = 5000 * (prefix.size() + 60);  // bytes of its keys alone
    for (const std::optional<lease_status> status :
         {std::optional<lease_status>(), std::optional<lease_status>(lease_status::active)}) {
        LeaseQuery q;
        q.limit = 5;
        q.status = status;
        std::vector<std::string> got;
        for (int page = 0; page < 2; ++page) {
            const auto before = relay.bytes_from_target();
            auto p = registry->list_leases(q);
            const auto read = relay.bytes_from_target() - before;
            INFO("page " << page << " read " << read << " bytes");
            CHECK(read < whole_index / 4);
            REQUIRE(p.leases.size() == 5);
            // The 10 active leases end on page 1; the listing of all goes on.
            CHECK(p.next_cursor.empty() == (status && page == 1));
            for (const auto& l : p.leases) got.push_back(l.id);
            q.cursor = p.next_cursor;
        }
        std::vector<std::string> expected;
        for (std::size_t i = 0; i < want.size() && expected.size() < 10; ++i) {
            if (!status || i % 4 < 2) expected.push_back(want[i]);
        }
        CHECK(got == expected);
    }
}

namespace {

/// A loopback HTTP server that answers every request with `response`, verbatim.
class CannedServer {
public:
    explicit CannedServer(std::string response)
        : response_(std::move(response)), fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof addr;
        REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
        REQUIRE(::listen(fd_, 16) == 0);
        REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
        endpoint_ = "http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
        thread_ = std::thread([this] { serve(); });
    }
    ~CannedServer() {
        stop_ = true;
        thread_.join();
        ::close(fd_);
    }
    CannedServer(const CannedServer&) = delete;
    CannedServer& operator=(const CannedServer&) = delete;
    const std::string& endpoint() const { return endpoint_; }

private:
    void serve() {
        while (!stop_) {
            pollfd p{fd_, POLLIN, 0};
            if (::poll(&p, 1, 50) <= 0) continue;
            int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (c < 0) continue;
            std::string request;
            char buf[4096];
            // Reads the headers and the body (Content-Length) of one request, then answers.
            for (;;) {
                pollfd q{c, POLLIN, 0};
                if (::poll(&q, 1, 1000) <= 0) break;
                ssize_t n = ::recv(c, buf, sizeof buf, 0);
                if (n <= 0) break;
                request.append(buf, static_cast<std::size_t>(n));
                auto end = request.find("\r\n\r\n");
                if (end == std::string::npos) continue;
                auto cl = request.find("Content-Length: ");
                std::size_t body =
                    cl == std::string::npos ? 0 : std::stoul(request.substr(cl + 16));
                if (request.size() >= end + 4 + body) break;
            }
            ::send(c, response_.data(), response_.size(), MSG_NOSIGNAL);
            ::shutdown(c, SHUT_WR);
            ::close(c);
        }
    }

    std::string response_;
    int fd_ = -1;
    std::string endpoint_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

std::string canned(const std::string& status, const std::string& body) {
    return "HTTP/1.1 " + status +
           "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
}

}  // namespace

TEST_CASE("etcd: a gateway answering 5xx, garbage or an error fails closed", "[registry][etcd]") {
    struct Case {
        std::string response;
        std::string want;  // in the message
    };
    const std::vector<Case> cases = {
        {canned("503 Service Unavailable",
                R"({"error":"etcdserver: no leader","message":"etcdserver: no leader","code":14})"),
         "HTTP 503: etcdserver: no leader"},
        {canned("500 Internal Server Error", "oops"), "HTTP 500"},
        {canned("200 OK", "this is not JSON"), "malformed answer"},
        {canned("200 OK", "[1, 2]"), "malformed answer"},
        {canned("200 OK", R"({"kvs": [{"key": "!!not base64!!", "value": "eA=="}]})"),
         "malformed answer or record"},
        {canned("200 OK", R"({"kvs": [{"key": "eA==", "mod_revision": "12x"}]})"),
         "malformed answer or record"},
        {canned(
             "400 Bad Request",
             R"({"error":"etcdserver: permission denied","message":"etcdserver: permission denied","code":7})"),
         "etcd: etcdserver: permission denied"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"kvs\"", "/v3/kv/range: partial message"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.response);
        CannedServer server(c.response);
        auto registry = test::open_etcd({server.endpoint()}, "/p/", 30000);
        auto err = rpc_error_of([&] { registry->get_lease("lease-1"); });
        REQUIRE(err);
        CHECK(err->code() == errc::registry_unavailable);
        const std::string what = err->what();
        CAPTURE(what);
        CHECK(what.rfind("registry: get lease: ", 0) == 0);
        CHECK(what.find(c.want) != std::string::npos);
    }

    // A bad answer from one endpoint fails over to the next.
    CannedServer broken(canned("503 Service Unavailable", "{}"));
    auto registry =
        test::open_etcd({broken.endpoint(), EtcdServer::shared().endpoint()}, "/p/", 30000);
    CHECK_FALSE(registry->get_lease("no-such-lease"));
}

TEST_CASE("etcd: bad endpoints are rejected when the registry is made", "[registry][etcd]") {
    for (std::string bad : {"127.0.0.1:2379", "ftp://127.0.0.1:2379", "http://", "http://host",
                            "http://host:0", "http://host:99999", "http://host:2379/path"}) {
        CAPTURE(bad);
        CHECK_THROWS_AS(test::open_etcd({bad}, "/p/", 1000), std::invalid_argument);
    }
    CHECK_THROWS_AS(test::open_etcd({}, "/p/", 1000), std::invalid_argument);
    CHECK_THROWS_AS(test::open_etcd({"http://127.0.0.1:2379"}, "/p/", 0), std::invalid_argument);
    CHECK_NOTHROW(test::open_etcd({"http://localhost:2379/", "http://[::1]:2379"}, "/p/", 1));
}

TEST_CASE("etcd: a node record vanishes after its TTL once heartbeats stop", "[registry][etcd]") {
    auto prefix = EtcdServer::unique_prefix();
    auto registry = test::open_etcd({EtcdServer::shared().endpoint()}, prefix, 2000);
    auto other = test::open_etcd({EtcdServer::shared().endpoint()}, prefix, 2000);
    registry->register_node({"node-a", "ws://a:1", 1, 1, "inst-1"}, 2000);

    // Heartbeats keep it alive well past the TTL.
    const auto began = std::chrono::steady_clock::now();
    while (elapsed_ms(began) < 4000) {
        REQUIRE(registry->heartbeat_node("node-a", "inst-1", elapsed_ms(began)));
        std::this_thread::sleep_for(500ms);
    }
    REQUIRE(other->get_node("node-a"));

    // Then they stop: the record goes by itself, within the TTL plus etcd's expiry check.
    const auto stopped = std::chrono::steady_clock::now();
    while (other->get_node("node-a") && elapsed_ms(stopped) < 10000) {
        std::this_thread::sleep_for(100ms);
    }
    const auto gone_after = elapsed_ms(stopped);
    CHECK_FALSE(other->get_node("node-a"));
    CHECK(gone_after >= 1500);
    CHECK(gone_after < 5000);
    CHECK(other->list_nodes().empty());
    // The instance learns it lost its record, and may register again.
    CHECK_FALSE(registry->heartbeat_node("node-a", "inst-1", 99));
    registry->register_node({"node-a", "ws://a:1", 1, 100, "inst-1"}, 2000);
    CHECK(registry->heartbeat_node("node-a", "inst-1", 101));

    // A clean removal revokes the etcd lease: the record is gone at once.
    registry->remove_node("node-a", "inst-1");
    CHECK_FALSE(other->get_node("node-a"));
}

TEST_CASE("etcd: token auth, re-authenticating after the server forgets the token",
          "[registry][etcd]") {
    EtcdServer etcd;
    {
        test::IoThread io;
        etcd::Client admin(io.executor(), {etcd.endpoint()}, "", "", 2s);
        io.run(admin.call("test", "/v3/auth/role/add", {{"name", "root"}}));
        io.run(admin.call("test", "/v3/auth/user/add", {{"name", "root"}, {"password", "rootpw"}}));
        io.run(admin.call("test", "/v3/auth/user/grant", {{"user", "root"}, {"role", "root"}}));
        io.run(admin.call("test", "/v3/auth/enable", json::object()));
    }
    auto registry = test::open_etcd({etcd.endpoint()}, "/sandboxd/v1/", 30000, "root", "rootpw");
    CHECK(registry->create_lease(make_lease("lease-1")).id == "lease-1");
    registry->register_node({"node-a", "ws://a:1", 1, 1, "inst-1"}, 30000);
    CHECK(registry->heartbeat_node("node-a", "inst-1", 2));

    auto anonymous = test::open_etcd({etcd.endpoint()}, "/sandboxd/v1/", 30000);
    auto err = rpc_error_of([&] { anonymous->get_lease("lease-1"); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(std::string(err->what()).find("user name is empty") != std::string::npos);

    auto wrong = test::open_etcd({etcd.endpoint()}, "/sandboxd/v1/", 30000, "root", "nope");
    err = rpc_error_of([&] { wrong->get_lease("lease-1"); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(std::string(err->what()).find("authenticate as root") != std::string::npos);

    // Simple tokens live in the server's memory: after a restart the old one is refused
    // ("invalid auth token") and the client authenticates again, unseen by the caller.
    etcd.stop();
    etcd.start();
    auto got = registry->get_lease("lease-1");
    REQUIRE(got);
    CHECK(got->id == "lease-1");
    CHECK(registry->heartbeat_node("node-a", "inst-1", 3));
}

TEST_CASE("etcd: the daemon runs on an etcd registry", "[registry][etcd][daemon]") {
    auto prefix = EtcdServer::unique_prefix();
    const std::string config = json{
        {"registry",
         {{"kind", "etcd"},
          {"endpoints", {EtcdServer::shared().endpoint()}},
          {"prefix", prefix}}}}.dump();
    test::DaemonProcess daemon("node-etcd", config);
    auto c = daemon.connect();
    auto lease = c->call("leaseAcquire",
                         {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "bwrap"}});
    CHECK(lease["status"] == "active");
    CHECK(lease["ownerNodeId"] == "node-etcd");
    auto listed = c->call("leaseList", json::object());
    REQUIRE(listed["leases"].size() == 1);
    CHECK(listed["leases"][0]["id"] == lease["id"]);
    auto nodes = c->call("nodeList", json::object())["nodes"];
    REQUIRE(nodes.size() == 1);
    CHECK(nodes[0]["nodeId"] == "node-etcd");

    // What the daemon wrote is in etcd under the prefix.
    auto registry = test::open_etcd({EtcdServer::shared().endpoint()}, prefix, 30000);
    auto stored = registry->get_lease(lease["id"].get<std::string>());
    REQUIRE(stored);
    CHECK(stored->owner_node_id == "node-etcd");
    REQUIRE(registry->get_node("node-etcd"));

    auto released = c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(released["status"] == "released");
    c->close();
    CHECK(daemon.stop() == 0);
    // A clean shutdown removes the node record.
    CHECK_FALSE(registry->get_node("node-etcd"));
}

TEST_CASE("etcd: measured times", "[.][bench][etcd-bench]") {
    auto& etcd = EtcdServer::shared();
    if (!etcd.external()) {
        std::cout << "etcd fixture start: " << etcd.last_start_duration().count() << " ms\n";
    }
    auto registry = test::open_etcd({etcd.endpoint()}, EtcdServer::unique_prefix(), 30000);
    registry->get_lease("warm-up");
    constexpr int n = 200;
    auto began = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) registry->create_lease(make_lease("lease-" + std::to_string(i)));
    auto create_us = std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::steady_clock::now() - began)
                         .count();
    began = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) registry->get_lease("lease-" + std::to_string(i));
    auto get_us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now() - began)
                      .count();
    std::cout << "create_lease round trip: " << create_us / n << " us (mean of " << n << ")\n"
              << "get_lease round trip: " << get_us / n << " us (mean of " << n << ")\n";
}
