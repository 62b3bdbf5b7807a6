// Several real daemon processes on loopback sharing one SQLite registry (docs/protocol.md
// section 6): routing to the owner, fail-closed answers, restarts and the sweeper.
#include "support/daemon_fixture.hpp"

#include <sandboxd/errors.hpp>

#include <catch2/catch.hpp>

#include <csignal>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

const std::string host_token = "host-secret";
const std::string peer_token = "peer-secret";

std::string cluster_config(const TempDir& shared, const std::string& mode = "proxy") {
    return json{{"registry", {{"kind", "sqlite"}, {"path", (shared.path() / "registry.db").string()}}},
                {"auth",
                 {{"tokens",
                   {{{"name", "host"}, {"token", host_token}, {"role", "host"}, {"tenants", {"*"}}},
                    {{"name", "peer"}, {"token", peer_token}, {"role", "peer"}, {"tenants", {"*"}}}}}}},
                {"routing", {{"mode", mode}, {"nodeTtlMs", 3000}, {"heartbeatMs", 300}}}}
        .dump();
}

std::string reason_of(Client& c, const std::string& method, const json& params) {
    try {
        c.call(method, params);
    } catch (const rpc_error& e) {
        return e.data().value("reason", "");
    }
    return "no error";
}

json acquire(Client& c) {
    return c.call("leaseAcquire", {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "bwrap"}});
}

std::string random_bytes(std::size_t n) {
    std::string s(n, '\0');
    std::uint32_t x = 2463534242U;
    for (auto& ch : s) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        ch = static_cast<char>(x & 0xff);
    }
    return s;
}

}  // namespace

TEST_CASE("An open through any node runs in the owner's sandbox, byte-exact",
          "[routing][multinode]") {
    TempDir shared;
    DaemonProcess p1("node-1", cluster_config(shared));
    DaemonProcess p2("node-2", cluster_config(shared));
    DaemonProcess p3("node-3", cluster_config(shared));
    Client c1(p1.url(), host_token);
    Client c2(p2.url(), host_token);
    Client c3(p3.url(), host_token);
    auto lease = acquire(c1);
    CHECK(lease["ownerNodeId"] == "node-1");
    auto mark = c1.run_channel(open_params(lease, {"sh", "-c", "echo owner-is-p1 > marker"}));
    REQUIRE(mark.exit["exitCode"] == 0);

    for (Client* c : {&c2, &c3}) {
        auto run = c->run_channel(open_params(lease, {"sh", "-c", "cat marker; exit 5"}));
        CHECK(run.out == "owner-is-p1\n");
        CHECK(run.exit["exitCode"] == 5);
        CHECK(run.exit["outcome"] == "exited");
        CHECK(run.open_result["routed"] == true);
        CHECK(run.open_result["ownerNodeId"] == "node-1");
        CHECK(run.exit["channel"] == run.channel);
    }
    // 16 MiB each way through the proxy.
    const auto data = random_bytes(16 << 20);
    auto big = c2.run_channel(open_params(lease, {"sh", "-c", "cat; exit 7"}), data);
    REQUIRE(big.out.size() == data.size());
    CHECK(big.out == data);
    CHECK(big.exit["exitCode"] == 7);
    CHECK(big.exit["stdinBytes"] == 16 << 20);

    auto nodes = c3.call("nodeList", json::object())["nodes"];
    REQUIRE(nodes.size() == 3);
    for (const auto& n : nodes) CHECK(n["alive"] == true);

    SECTION("release through another node ends the owner's channels with leaseReleased") {
        auto open = c3.call("duplexChannelOpen", open_params(lease, {"sh", "-c", "echo start; sleep 600"}));
        const auto channel = open["channel"].get<std::uint32_t>();
        std::string out;
        while (out != "start\n") {
            auto ev = c3.next_event();
            if (ev.type == ClientEvent::kind::data) {
                out += ev.bytes;
                c3.send_credit(channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
            }
        }
        const auto t0 = std::chrono::steady_clock::now();
        auto released = c2.call("leaseRelease", {{"leaseId", lease["id"]}});
        CHECK(released["status"] == "released");
        json exit;
        while (exit.is_null()) {
            auto ev = c3.next_event();
            if (ev.type == ClientEvent::kind::notification && ev.message["method"] == "duplexChannel.exit") {
                exit = ev.message["params"];
            }
        }
        CHECK(exit["outcome"] == "leaseReleased");
        CHECK(exit["exitCode"].is_null());
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
        CHECK(count_processes_with("sleep 600") == 0);
        CHECK(reason_of(c2, "duplexChannelOpen", open_params(lease, {"true"})) == "LEASE_NOT_ACTIVE");
    }
}

TEST_CASE("A dead owner fails closed, and a restarted owner's lease is swept",
          "[routing][multinode][restart]") {
    TempDir shared;
    DaemonProcess p1("node-1", cluster_config(shared));
    DaemonProcess p2("node-2", cluster_config(shared));
    Client c2(p2.url(), host_token);
    json lease;
    {
        Client c1(p1.url(), host_token);
        lease = acquire(c1);
    }
    REQUIRE(c2.run_channel(open_params(lease, {"true"})).exit["exitCode"] == 0);
    const auto killed = std::chrono::steady_clock::now();
    p1.kill9();
    CHECK(reason_of(c2, "duplexChannelOpen", open_params(lease, {"true"})) == "OWNER_UNAVAILABLE");
    CHECK(std::chrono::steady_clock::now() - killed < std::chrono::seconds(3));

    p1.restart();  // waits out the old instance's TTL, then takes the node id over
    Client c1(p1.url(), host_token);
    auto direct = reason_of(c1, "duplexChannelOpen", open_params(lease, {"true"}));
    auto routed = reason_of(c2, "duplexChannelOpen", open_params(lease, {"true"}));
    CHECK((direct == "SANDBOX_NOT_CACHED" || direct == "LEASE_NOT_ACTIVE"));
    CHECK((routed == "SANDBOX_NOT_CACHED" || routed == "LEASE_NOT_ACTIVE"));
    // After one liveness TTL the restarted owner moves it to pending_cleanup and tears it down.
    CHECK(eventually([&] { return c2.call("leaseGet", {{"leaseId", lease["id"]}})["status"] == "released"; },
                     std::chrono::seconds(15)));
    auto swept = c2.call("leaseGet", {{"leaseId", lease["id"]}});
    CHECK(swept["cleanupStatus"] == "destroyed");
    CHECK(swept["epoch"].get<int>() >= lease["epoch"].get<int>() + 2);
}

TEST_CASE("Redirect mode answers OWNER_ELSEWHERE with the owner's URL", "[routing][multinode]") {
    TempDir shared;
    DaemonProcess p1("node-1", cluster_config(shared));
    DaemonProcess p2("node-2", cluster_config(shared, "redirect"));
    Client c1(p1.url(), host_token);
    Client c2(p2.url(), host_token);
    auto lease = acquire(c1);
    try {
        c2.call("duplexChannelOpen", open_params(lease, {"true"}));
        FAIL("open through a non-owner in redirect mode succeeded");
    } catch (const rpc_error& e) {
        CHECK(e.data()["reason"] == "OWNER_ELSEWHERE");
        CHECK(e.data()["ownerNodeId"] == "node-1");
        CHECK(e.data()["ownerUrl"] == p1.url());
    }
    CHECK(p2.children().empty());
}

TEST_CASE("A forwarded open is never forwarded again", "[routing][multinode]") {
    TempDir shared;
    DaemonProcess p1("node-1", cluster_config(shared));
    DaemonProcess p2("node-2", cluster_config(shared));
    Client c1(p1.url(), host_token);
    auto lease = acquire(c1);
    Client as_peer(p2.url(), peer_token, std::chrono::seconds(10), 0,
                   {{"Sandboxd-Forwarded-By", "node-3"}});
    CHECK(reason_of(as_peer, "duplexChannelOpen", open_params(lease, {"true"})) == "ROUTING_LOOP");
    CHECK(p2.children().empty());
    CHECK(p1.children().empty());
}

TEST_CASE("A second live process with the same node id refuses to start", "[routing][multinode]") {
    TempDir shared;
    DaemonProcess p1("node-1", cluster_config(shared));
    try {
        DaemonProcess twin("node-1", cluster_config(shared));
        FAIL("a second node-1 started");
    } catch (const std::runtime_error& e) {
        CHECK(std::string(e.what()).find("node id node-1 is already held by a live process") !=
              std::string::npos);
    }
}
