// Bounded parsing on a real daemon (issue 44, item 1): requests nested deeper than
// max_json_depth on every method, and lease records that cannot be read, in SQLite and etcd.
#include "support/daemon_fixture.hpp"
#include "support/etcd_fixture.hpp"
#include "support/sync_registry.hpp"

#include "registry/etcd_client.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/registry/registry.hpp>

#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

/// The largest request to `method` whose params are `[[[...]]]` and that fits `max` bytes.
std::string deepest_request(const std::string& method, std::size_t max) {
    const std::string head = R"({"jsonrpc":"2.0","id":1,"method":")" + method + R"(","params":)";
    const std::size_t depth = (max - head.size() - 1) / 2;
    std::string text;
    text.reserve(max);
    text += head;
    text.append(depth, '[');
    text.append(depth, ']');
    text += '}';
    return text;
}

/// Sends the deepest params that fit `max_text` on every method the node serves and checks
/// each answer; then the connection still serves.
void check_every_method_refuses_depth(DaemonProcess& daemon, std::size_t max_text) {
    auto c = daemon.connect();
    auto init = c->call("initialize", {{"protocolVersion", 1}});
    REQUIRE(init["limits"]["maxTextMessage"] == max_text);
    auto methods = init["supportedMethods"].get<std::vector<std::string>>();
    methods.emplace_back("initialize");
    methods.emplace_back("noSuchMethod");
    REQUIRE(methods.size() > 10);
    for (const auto& method : methods) {
        INFO(method);
        const auto text = deepest_request(method, max_text);
        CHECK(text.size() <= max_text);
        CHECK(text.size() + 2 > max_text);
        c->send_text(text);
        auto ev = c->next_event();
        REQUIRE(ev.type == ClientEvent::kind::response);
        CHECK(ev.message["error"]["code"] == -32700);
        CHECK(ev.message["error"]["message"] ==
              "Parse error: the text frame is nested deeper than 64 levels");
        CHECK(ev.message["id"].is_null());
    }
    // Still serving, on this connection and a new one.
    CHECK(c->call("leaseList", json::object())["leases"].is_array());
    CHECK(daemon.connect()->call("initialize", {{"protocolVersion", 1}})["nodeId"] == "node-a");
}

std::string deep(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

json acquire_noop(Client& c) {
    return c.call("leaseAcquire",
                  {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "noop"}});
}

const char* const noop_config = R"({"providers": {"noop": {"enabled": true}}})";

/// Acquires two noop leases on `daemon` (the one to poison, the one to keep), then stops it.
std::pair<std::string, std::string> two_leases_then_stop(DaemonProcess& daemon) {
    std::pair<std::string, std::string> ids;
    {
        auto c = daemon.connect();
        ids.first = acquire_noop(*c)["id"];
        ids.second = acquire_noop(*c)["id"];
    }
    daemon.stop();
    return ids;
}

/// On a node restarted over a registry whose record of `bad_id` cannot be read: that lease
/// fails closed with REGISTRY_UNAVAILABLE naming it, the other is listed and served, and the
/// bad record was counted once (not per read).
void check_poisoned_lease(DaemonProcess& daemon, const std::string& bad_id,
                          const std::string& good_id) {
    auto c = daemon.connect();
    try {
        c->call("leaseGet", {{"leaseId", bad_id}});
        FAIL("leaseGet of the poisoned lease succeeded");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::registry_unavailable);
        CHECK(e.data()["leaseId"] == bad_id);
        CHECK_THAT(e.what(), Catch::Matchers::Contains("cannot be read"));
    }
    CHECK(c->call("leaseGet", {{"leaseId", good_id}})["id"] == good_id);
    auto listed = c->call("leaseList", json::object())["leases"];
    REQUIRE(listed.size() == 1);
    CHECK(listed[0]["id"] == good_id);
    CHECK(c->call("leaseRelease", {{"leaseId", good_id}})["status"] == "released");
    CHECK(daemon.metric("sandboxd_registry_bad_records_total") == 1);
}

}  // namespace

TEST_CASE(
    "The deepest params that fit maxTextMessage get -32700 on every method and the "
    "daemon serves on",
    "[daemon][rpc][json]") {
    DaemonProcess daemon;
    check_every_method_refuses_depth(daemon, 1 << 20);  // about 524,000 levels
}

TEST_CASE("A million levels with maxTextMessage at 4 MiB get -32700 and the daemon serves on",
          "[daemon][rpc][json]") {
    DaemonProcess daemon("node-a", R"({"limits": {"maxTextMessage": 4194304}})");
    auto c = daemon.connect();
    const std::string text =
        R"({"jsonrpc":"2.0","id":1,"method":"leaseGet","params":)" + deep(1'000'000) + "}";
    REQUIRE(text.size() < 4u << 20);
    c->send_text(text);
    auto ev = c->next_event();
    REQUIRE(ev.type == ClientEvent::kind::response);
    CHECK(ev.message["error"]["code"] == -32700);
    CHECK(c->call("leaseList", json::object())["leases"].is_array());
    check_every_method_refuses_depth(daemon, 4u << 20);
}

TEST_CASE("A config nested too deep stops the daemon with a config error naming the depth",
          "[daemon][config][json]") {
    DaemonProcess daemon("node-a", R"({"providers": )" + deep(200'000) + "}", {},
                         DaemonProcess::start_mode::no_wait);
    auto status = daemon.wait_exit(30s);
    REQUIRE(status);
    CHECK(*status != 0);
    CHECK_THAT(daemon.log(), Catch::Matchers::Contains("nested deeper than 64 levels"));
}

TEST_CASE(
    "A lease record in SQLite that cannot be read fails closed and the node serves the "
    "others",
    "[daemon][registry][json]") {
    DaemonProcess daemon("node-a", noop_config);
    const auto [bad_id, good_id] = two_leases_then_stop(daemon);
    SECTION("metadata nested 200,000 levels") {
        sqlite3* db = nullptr;
        REQUIRE(sqlite3_open((daemon.state_dir() / "registry.db").c_str(), &db) == SQLITE_OK);
        sqlite3_stmt* s = nullptr;
        REQUIRE(sqlite3_prepare_v2(db, "UPDATE leases SET metadata = ? WHERE id = ?", -1, &s,
                                   nullptr) == SQLITE_OK);
        const std::string value = deep(200'000);
        sqlite3_bind_text(s, 1, value.c_str(), static_cast<int>(value.size()), SQLITE_TRANSIENT);
        sqlite3_bind_text(s, 2, bad_id.c_str(), -1, SQLITE_TRANSIENT);
        CHECK(sqlite3_step(s) == SQLITE_DONE);
        CHECK(sqlite3_changes(db) == 1);
        sqlite3_finalize(s);
        sqlite3_close(db);
    }
    daemon.restart();
    check_poisoned_lease(daemon, bad_id, good_id);
}

TEST_CASE(
    "A lease record in etcd that cannot be read fails closed and the node serves the "
    "others",
    "[daemon][registry][etcd][json]") {
    auto& etcd = EtcdServer::shared();
    const auto prefix = EtcdServer::unique_prefix();
    const json config = {
        {"providers", {{"noop", {{"enabled", true}}}}},
        {"registry", {{"kind", "etcd"}, {"endpoints", {etcd.endpoint()}}, {"prefix", prefix}}}};
    DaemonProcess daemon("node-a", config.dump());
    const auto [bad_id, good_id] = two_leases_then_stop(daemon);
    std::string value;
    SECTION("a record nested 500,000 levels") { value = deep(500'000); }
    SECTION("a record of the wrong types") { value = R"({"id": 5, "status": []})"; }
    SECTION("a record that is not JSON") { value = "{\"id\":"; }
    {
        IoThread io;
        etcd::Client raw(io.executor(), {etcd.endpoint()}, "", "", 10s);
        io.run(raw.call("test", "/v3/kv/put",
                        {{"key", base64_encode(prefix + "leases/" + bad_id)},
                         {"value", base64_encode(value)}}));
    }
    daemon.restart();
    check_poisoned_lease(daemon, bad_id, good_id);
}
