#include "support/registry_cases.hpp"
#include "support/sync_registry.hpp"
#include "support/temp_dir.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/registry/registry.hpp>

#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;

namespace {

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
}

/// The first column of the first row of `sql`, as text ("" when there is none).
std::string scalar_of(sqlite3* db, const char* sql) {
    sqlite3_stmt* s = nullptr;
    std::string out;
    if (sqlite3_prepare_v2(db, sql, -1, &s, nullptr) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW) {
        const auto* text = sqlite3_column_text(s, 0);
        if (text != nullptr) out = reinterpret_cast<const char*>(text);
    }
    sqlite3_finalize(s);
    return out;
}

/// The details of EXPLAIN QUERY PLAN `sql`, joined by ';'.
std::string query_plan_of(sqlite3* db, const std::string& sql) {
    sqlite3_stmt* s = nullptr;
    std::string out;
    const std::string eqp = "EXPLAIN QUERY PLAN " + sql;
    if (sqlite3_prepare_v2(db, eqp.c_str(), -1, &s, nullptr) == SQLITE_OK) {
        while (sqlite3_step(s) == SQLITE_ROW) {
            const auto* text = sqlite3_column_text(s, 3);
            if (text != nullptr) out += std::string(reinterpret_cast<const char*>(text)) + ";";
        }
    }
    sqlite3_finalize(s);
    return out;
}

/// A database as version 2 left it: today's schema without the indexes version 3 added and
/// the columns versions 4, 5 and 6 added, with the two indexes version 7 dropped, and with
/// lease "lease-1" in it.
void registry_of_version_2(const std::string& path) {
    sync_sqlite(path)->create_lease(make_lease("lease-1"));
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "DROP INDEX leases_by_provider_lease; DROP INDEX leases_by_status_owner; "
                         "CREATE INDEX leases_by_owner "
                         "ON leases (owner_node_id, status, expires_at_ms); "
                         "CREATE INDEX leases_by_expiry ON leases (status, expires_at_ms); "
                         "ALTER TABLE leases DROP COLUMN agent_id; "
                         "ALTER TABLE leases DROP COLUMN provider_metadata; "
                         "ALTER TABLE leases DROP COLUMN host_metadata; "
                         "ALTER TABLE leases DROP COLUMN capabilities; "
                         "ALTER TABLE leases DROP COLUMN lease_policy; "
                         "ALTER TABLE leases DROP COLUMN network; "
                         "PRAGMA user_version = 2;",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    REQUIRE(scalar_of(db, "PRAGMA user_version") == "2");
    sqlite3_close(db);
}

}  // namespace

TEST_CASE("A lease round-trips every field, absent ones as nulls", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));

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

    Lease bare = make_lease("lease-bare");
    bare.metadata = nlohmann::json::object();

    check_same(registry->create_lease(full), full);
    check_same(registry->create_lease(bare), bare);

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

TEST_CASE("An idempotency key returns the existing lease and writes nothing new", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));

    Lease first = make_lease("lease-1");
    first.idempotency_key = "key-1";
    check_same(registry->create_lease(first), first);

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

TEST_CASE("The same idempotency key in another scope makes a new lease", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    check_idempotency_key_scopes(*registry);
}

TEST_CASE("update_lease stores every mutable field when the epoch matches", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    Lease original = make_lease("lease-1");
    original.expires_at_ms = 5000;
    original.idempotency_key = "key-1";
    original.config = {{"image", "debian"}};
    registry->create_lease(original);

    Lease next = original;
    next.status = lease_status::released;
    next.owner_node_id = "node-b";
    next.epoch = 2;
    next.last_used_at_ms = 2500;
    next.expires_at_ms = std::nullopt;
    next.released_at_ms = 3000;
    next.failure_reason = "killed";
    next.cleanup_status = "done";
    next.cleanup_attempts = 3;
    next.metadata["extra"] = 42;

    REQUIRE(registry->update_lease(next, 1));
    auto stored = registry->get_lease("lease-1");
    REQUIRE(stored);
    check_same(*stored, next);

    SECTION("a stale epoch writes nothing") {
        Lease stale = next;
        stale.status = lease_status::failed;
        stale.owner_node_id = "node-c";
        stale.epoch = 3;
        stale.cleanup_attempts = 9;
        CHECK_FALSE(registry->update_lease(stale, 1));
        auto after = registry->get_lease("lease-1");
        REQUIRE(after);
        check_same(*after, next);
    }
    SECTION("a missing lease is not updated") {
        Lease ghost = next;
        ghost.id = "no-such-lease";
        CHECK_FALSE(registry->update_lease(ghost, 2));
        CHECK_FALSE(registry->get_lease("no-such-lease"));
    }
    SECTION("immutable fields are left alone") {
        Lease changed = next;
        changed.epoch = 3;
        changed.company_id = "co-other";
        changed.provider_lease_id = "pl-other";
        changed.acquired_at_ms = 1;
        changed.idempotency_key = "key-other";
        changed.config = {{"image", "alpine"}};
        REQUIRE(registry->update_lease(changed, 2));
        auto after = registry->get_lease("lease-1");
        REQUIRE(after);
        Lease want = next;
        want.epoch = 3;
        check_same(*after, want);
    }
}

TEST_CASE("list_leases filters by company, environment, status, owner and tenants", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    check_list_filters(*registry);
}

TEST_CASE("list_leases pages through 250 leases exactly once, in order", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    check_list_pages(*registry);
}

TEST_CASE("list_leases clamps the limit to 1..1000", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    check_list_limit_clamped(*registry);
}

TEST_CASE("A malformed cursor is rejected with invalid_params", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    check_malformed_cursors(*registry);
}

TEST_CASE("expired_leases returns the owner's active leases expiring at or before a time",
          "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));

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
    for (const auto& l : {due, exactly, later, forever, released, elsewhere}) {
        registry->create_lease(l);
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

TEST_CASE("Two registries on the same file see each other's writes", "[registry]") {
    TempDir dir;
    auto first = sync_sqlite(dir.file("registry.db"));
    auto second = sync_sqlite(dir.file("registry.db"));

    Lease lease = make_lease("lease-1");
    lease.idempotency_key = "key-1";
    first->create_lease(lease);
    auto seen = second->get_lease("lease-1");
    REQUIRE(seen);
    check_same(*seen, lease);

    Lease retry = make_lease("lease-2");
    retry.idempotency_key = "key-1";
    CHECK(second->create_lease(retry).id == "lease-1");

    Lease next = lease;
    next.epoch = 2;
    next.status = lease_status::expired;
    REQUIRE(second->update_lease(next, 1));
    CHECK_FALSE(first->update_lease(next, 1));
    CHECK(first->get_lease("lease-1")->status == lease_status::expired);
    CHECK(first->get_lease("lease-1")->epoch == 2);

    first->register_node({"node-a", "ws://10.0.0.1:7000", 100, 200, "inst-1"}, 30000);
    auto nodes = second->list_nodes();
    REQUIRE(nodes.size() == 1);
    CHECK(nodes[0].node_id == "node-a");
    CHECK(nodes[0].instance_id == "inst-1");
}

TEST_CASE("Concurrent creates with one idempotency key make exactly one lease", "[registry]") {
    TempDir dir;
    auto first = sync_sqlite(dir.file("registry.db"));
    auto second = sync_sqlite(dir.file("registry.db"));

    constexpr int per_thread = 25;
    std::vector<std::vector<std::string>> results(4);
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < results.size(); ++t) {
        SyncRegistry& registry = t % 2 == 0 ? *first : *second;
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

TEST_CASE("A node registers, heartbeats and is removed", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
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

    registry->remove_node("node-a", "inst-other");
    CHECK(registry->get_node("node-a"));
    registry->remove_node("node-a", "inst-a");
    CHECK_FALSE(registry->get_node("node-a"));
    REQUIRE(registry->list_nodes().size() == 1);
    CHECK(registry->list_nodes()[0].node_id == "node-b");
}

TEST_CASE("A second live instance of a node id is refused until the TTL passes", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
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

    // The refused registration left no transaction open: writes still work.
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

TEST_CASE("A registry whose directory cannot be created is unavailable", "[registry]") {
    auto err = rpc_error_of([] { sync_sqlite("/proc/sandboxd-registry-test/sub/registry.db"); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(std::string(err->what()).rfind("registry: open: ", 0) == 0);
}

TEST_CASE("A file that is not a database makes the registry unavailable", "[registry]") {
    TempDir dir;
    auto path = dir.file("registry.db");
    std::ofstream(path) << "this is not an SQLite database, not even close to one...\n"
                        << std::string(4096, 'x');
    auto err = rpc_error_of([&] { sync_sqlite(path); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(std::string(err->what()) == "registry: open: file is not a database");
}

TEST_CASE("The registry creates a missing parent directory", "[registry]") {
    TempDir dir;
    auto path = dir.file("a/b/registry.db");
    auto registry = sync_sqlite(path);
    registry->create_lease(make_lease("lease-1"));
    CHECK(std::filesystem::exists(path));
}

TEST_CASE("A lease survives closing and reopening the registry", "[registry]") {
    TempDir dir;
    Lease lease = make_lease("lease-1");
    lease.idempotency_key = "key-1";
    lease.expires_at_ms = 9000;
    {
        auto registry = sync_sqlite(dir.file("registry.db"));
        registry->create_lease(lease);
        registry->register_node({"node-a", "ws://10.0.0.1:7000", 1, 2, "inst-1"}, 30000);
    }
    auto reopened = sync_sqlite(dir.file("registry.db"));
    auto got = reopened->get_lease("lease-1");
    REQUIRE(got);
    check_same(*got, lease);
    REQUIRE(reopened->get_node("node-a"));
    CHECK(reopened->get_node("node-a")->instance_id == "inst-1");

    Lease retry = make_lease("lease-2");
    retry.idempotency_key = "key-1";
    CHECK(reopened->create_lease(retry).id == "lease-1");
}

TEST_CASE("A lease is found by its provider and providerLeaseId, and by nothing less",
          "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    registry->create_lease(make_lease("lease-1"));
    Lease other = make_lease("lease-2");
    other.provider = "process";
    other.provider_lease_id = "pl-lease-1";  // the same id minted by another provider
    registry->create_lease(other);

    auto found = registry->find_by_provider_lease("bwrap", "pl-lease-1");
    REQUIRE(found);
    CHECK(found->id == "lease-1");
    CHECK(registry->find_by_provider_lease("process", "pl-lease-1")->id == "lease-2");
    CHECK_FALSE(registry->find_by_provider_lease("bwrap", "pl-lease-2"));
    CHECK_FALSE(registry->find_by_provider_lease("other", "pl-lease-1"));

    // A provider never mints one id twice: a second lease with the pair is refused.
    Lease twin = make_lease("lease-3");
    twin.provider_lease_id = "pl-lease-1";
    auto err = rpc_error_of([&] { registry->create_lease(twin); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK_FALSE(registry->get_lease("lease-3"));
}

TEST_CASE("active_owner_nodes names each owner of an active lease once", "[registry]") {
    TempDir dir;
    auto registry = sync_sqlite(dir.file("registry.db"));
    CHECK(registry->active_owner_nodes().empty());
    int n = 0;
    for (const char* owner : {"node-b", "node-a", "node-b", "node-c", "node-a"}) {
        Lease l = make_lease("lease-" + std::to_string(++n));
        l.owner_node_id = owner;
        registry->create_lease(l);
    }
    Lease released = make_lease("lease-released");
    released.owner_node_id = "node-d";
    released.status = lease_status::released;
    registry->create_lease(released);
    CHECK(registry->active_owner_nodes() == std::vector<std::string>{"node-a", "node-b", "node-c"});
}

TEST_CASE("A version 2 database is migrated in place and keeps its leases", "[registry]") {
    TempDir dir;
    const auto path = dir.file("registry.db");
    registry_of_version_2(path);
    auto registry = sync_sqlite(path);
    REQUIRE(registry->get_lease("lease-1"));
    CHECK(registry->get_lease("lease-1")->provider_metadata.is_null());
    CHECK(!registry->get_lease("lease-1")->agent_id);
    CHECK(registry->get_lease("lease-1")->host_metadata.is_null());
    CHECK(registry->get_lease("lease-1")->capabilities.is_null());
    CHECK(registry->get_lease("lease-1")->lease_policy == "ephemeral");
    CHECK(registry->get_lease("lease-1")->network.is_null());
    CHECK(registry->find_by_provider_lease("bwrap", "pl-lease-1")->id == "lease-1");

    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    CHECK(scalar_of(db, "PRAGMA user_version") == "8");
    CHECK(scalar_of(db,
                    "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name IN "
                    "('leases_by_provider_lease', 'leases_by_status_owner')") == "2");
    CHECK(scalar_of(db,
                    "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name IN "
                    "('leases_by_owner', 'leases_by_expiry')") == "0");
    CHECK(scalar_of(db,
                    "SELECT group_concat(name, ',') FROM pragma_index_info("
                    "'leases_by_status_owner')") == "status,owner_node_id,expires_at_ms");
    // The owner's expired leases are found through it, not by a scan of the table.
    const auto plan = query_plan_of(
        db,
        "SELECT id FROM leases WHERE owner_node_id = 'n' AND status = 'active' "
        "AND expires_at_ms IS NOT NULL AND expires_at_ms <= 5 ORDER BY expires_at_ms, id");
    CAPTURE(plan);
    CHECK(plan.find("USING INDEX leases_by_status_owner (status=? AND owner_node_id=? AND "
                    "expires_at_ms") != std::string::npos);
    sqlite3_close(db);
}

TEST_CASE("The number of reader connections is checked", "[registry]") {
    TempDir dir;
    for (int readers : {0, 17}) {
        auto err = rpc_error_of([&] { make_sqlite_registry(dir.file("registry.db"), readers); });
        REQUIRE(err);
        CHECK(std::string(err->what()) == "registry: open: readers must be in 1..16");
    }
    CHECK_FALSE(std::filesystem::exists(dir.file("registry.db")));
}
