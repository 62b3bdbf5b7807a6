// Unit tests of sandboxd/core/lease_fields.hpp: the wire JSON and the SQLite schema generated from
// the one Lease field table are the ones written by hand before it (byte for byte).
#include <sandboxd/core/lease.hpp>
#include <sandboxd/core/lease_fields.hpp>

#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <set>
#include <string>

using namespace sandboxd;

namespace {

Lease minimal_lease() {
    Lease l;
    l.id = "l1";
    l.company_id = "acme";
    l.environment_id = "dev";
    l.provider = "bwrap";
    l.provider_lease_id = "bw-1";
    l.owner_node_id = "n1";
    l.acquired_at_ms = 1764546569123;
    l.last_used_at_ms = 1764546570000;
    return l;
}

/// PRAGMA table_info(leases) of a fresh in-memory database made with `create_sql`, one line
/// per column: "cid|name|type|notnull|dflt_value|pk".
std::string table_info(const std::string& create_sql) {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(":memory:", &db) == SQLITE_OK);
    char* error = nullptr;
    const int rc = sqlite3_exec(db, create_sql.c_str(), nullptr, nullptr, &error);
    INFO((error != nullptr ? error : ""));
    sqlite3_free(error);
    REQUIRE(rc == SQLITE_OK);
    sqlite3_stmt* stmt = nullptr;
    REQUIRE(sqlite3_prepare_v2(db, "PRAGMA table_info(leases)", -1, &stmt, nullptr) == SQLITE_OK);
    std::string out;
    while (sqlite3_step(stmt) == SQLITE_ROW) {
        for (int col = 0; col < 6; ++col) {
            const auto* text = sqlite3_column_text(stmt, col);
            out += text != nullptr ? reinterpret_cast<const char*>(text) : "NULL";
            out += col < 5 ? "|" : "\n";
        }
    }
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    return out;
}

}  // namespace

TEST_CASE("The wire JSON of a lease is the protocol's, byte for byte", "[lease]") {
    SECTION("absent optional ids are left out, other absent fields are null") {
        CHECK(
            to_json(minimal_lease()).dump() ==
            R"({"acquiredAt":"2025-11-30T23:49:29.123Z","capabilities":null,"cleanupStatus":null,)"
            R"("companyId":"acme","environmentId":"dev","epoch":1,"expiresAt":null,)"
            R"("failureReason":null,"hostMetadata":null,"id":"l1",)"
            R"("lastUsedAt":"2025-11-30T23:49:30.000Z","leasePolicy":"ephemeral",)"
            R"("limits":null,"metadata":{},"network":null,"ownerNodeId":"n1","provider":"bwrap",)"
            R"("providerLeaseId":"bw-1","providerMetadata":null,"releasedAt":null,)"
            R"("status":"active","usage":null})");
    }
    SECTION("every field set; idempotency key, config and cleanup attempts stay internal") {
        Lease l = minimal_lease();
        l.run_id = "r";
        l.issue_id = "i";
        l.heartbeat_run_id = "h";
        l.execution_workspace_id = "w";
        l.agent_id = "a";
        l.provider_metadata = {{"dir", "/x"}};
        l.host_metadata = {{"team", "t"}};
        l.capabilities = {"pty"};
        l.status = lease_status::pending_cleanup;
        l.epoch = 42;
        l.expires_at_ms = 1764546571000;
        l.released_at_ms = 1764546572001;
        l.failure_reason = "boom";
        l.cleanup_status = "retrying";
        l.metadata = {{"pluginId", "builtin"}, {"provider", "bwrap"}};
        l.limits = {{"pids", 64}};
        l.network = {{"mode", "none"}};
        l.usage = {{"cpuMs", 5}};
        l.idempotency_key = "k";
        l.config = {{"image", "x"}};
        l.cleanup_attempts = 3;
        CHECK(
            to_json(l).dump() ==
            R"({"acquiredAt":"2025-11-30T23:49:29.123Z","agentId":"a","capabilities":["pty"],)"
            R"("cleanupStatus":"retrying",)"
            R"("companyId":"acme","environmentId":"dev","epoch":42,"executionWorkspaceId":"w",)"
            R"("expiresAt":"2025-11-30T23:49:31.000Z","failureReason":"boom",)"
            R"("heartbeatRunId":"h","hostMetadata":{"team":"t"},"id":"l1","issueId":"i",)"
            R"("lastUsedAt":"2025-11-30T23:49:30.000Z","leasePolicy":"ephemeral","limits":{"pids":64},)"
            R"("metadata":{"pluginId":"builtin","provider":"bwrap"},"network":{"mode":"none"},)"
            R"("ownerNodeId":"n1",)"
            R"("provider":"bwrap","providerLeaseId":"bw-1","providerMetadata":{"dir":"/x"},)"
            R"("releasedAt":"2025-11-30T23:49:32.001Z","runId":"r","status":"pending_cleanup",)"
            R"("usage":{"cpuMs":5}})");
    }
}

TEST_CASE("The generated leases table is schema version 2's plus the columns of versions 4-8",
          "[lease][registry]") {
    // CREATE TABLE leases as schema version 2 wrote it by hand, and the columns versions 4,
    // 5, 6 and 8 add with ALTER TABLE (at the end): databases made with it and migrated must keep
    // working, so every column's name, type, NOT NULL, default and key must match.
    const std::string v2 = R"sql(CREATE TABLE leases (
    id TEXT PRIMARY KEY NOT NULL,
    company_id TEXT NOT NULL,
    environment_id TEXT NOT NULL,
    run_id TEXT,
    issue_id TEXT,
    heartbeat_run_id TEXT,
    execution_workspace_id TEXT,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    provider_lease_id TEXT NOT NULL,
    owner_node_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    acquired_at_ms INTEGER NOT NULL,
    last_used_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER,
    released_at_ms INTEGER,
    failure_reason TEXT,
    cleanup_status TEXT,
    metadata TEXT NOT NULL,
    idempotency_key TEXT,
    config TEXT NOT NULL,
    cleanup_attempts INTEGER NOT NULL DEFAULT 0,
    limits TEXT NOT NULL DEFAULT 'null',
    agent_id TEXT,
    provider_metadata TEXT NOT NULL DEFAULT 'null',
    host_metadata TEXT NOT NULL DEFAULT 'null',
    capabilities TEXT NOT NULL DEFAULT 'null',
    lease_policy TEXT NOT NULL DEFAULT 'ephemeral',
    network TEXT NOT NULL DEFAULT 'null'
) STRICT;)sql";
    const std::string generated =
        "CREATE TABLE leases (\n    " + lease_column_definitions() + "\n) STRICT;";
    CHECK(table_info(generated) == table_info(v2));
    CHECK(lease_column_list() ==
          "id, company_id, environment_id, run_id, issue_id, heartbeat_run_id, "
          "execution_workspace_id, status, provider, provider_lease_id, owner_node_id, epoch, "
          "acquired_at_ms, last_used_at_ms, expires_at_ms, released_at_ms, failure_reason, "
          "cleanup_status, metadata, idempotency_key, config, cleanup_attempts, limits, "
          "agent_id, provider_metadata, host_metadata, capabilities, lease_policy, network");
}

TEST_CASE("Lease field names are unique and every field goes somewhere", "[lease]") {
    std::set<std::string_view> wire, columns;
    for (const auto& f : lease_fields) {
        CAPTURE(f.wire, f.column);
        CHECK((f.on_wire() || f.stored()));
        if (f.on_wire()) CHECK(wire.insert(f.wire).second);
        if (f.stored()) CHECK(columns.insert(f.column).second);
    }
    CHECK(wire.size() == 27);
    CHECK(columns.size() == 29);
}
