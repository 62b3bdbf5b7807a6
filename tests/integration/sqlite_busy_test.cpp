// The SQLite registry against another process holding its write lock past the 5 s busy
// timeout (a real database file; moved out of tests/unit: it waits the timeout out, and the
// unit suite stays under 10 s).
#include "support/registry_cases.hpp"
#include "support/sync_registry.hpp"
#include "support/temp_dir.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/registry/registry.hpp>

#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;

TEST_CASE("A write blocked past the busy timeout is unavailable and leaves no transaction",
          "[registry]") {
    TempDir dir;
    auto path = dir.file("registry.db");
    auto registry = sync_sqlite(path);
    registry->create_lease(make_lease("lease-1"));

    // Another "process" holds the write lock for longer than the 5 s busy timeout.
    sqlite3* other = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &other) == SQLITE_OK);
    REQUIRE(sqlite3_exec(other, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) == SQLITE_OK);

    auto err = rpc_error_of([&] { registry->create_lease(make_lease("lease-2")); });
    REQUIRE(err);
    CHECK(err->code() == errc::registry_unavailable);
    CHECK(std::string(err->what()) == "registry: create lease: database is locked");
    // WAL readers are not blocked by a writer.
    CHECK(registry->get_lease("lease-1"));

    REQUIRE(sqlite3_exec(other, "ROLLBACK", nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(other);

    CHECK(registry->create_lease(make_lease("lease-2")).id == "lease-2");
    CHECK(ids_of(*registry, {}) == std::vector<std::string>{"lease-1", "lease-2"});
}
