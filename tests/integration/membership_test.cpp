// The membership lane (issue 12): heartbeats and self-fencing never wait behind provider or
// registry backlog. A real daemon on SQLite with the reference plugin worker whose teardowns
// are held (PROCESS_PLUGIN_DESTROY_HOLD_FILE) for longer than the node TTL.
//
// Why the plugin worker: its hold is a real teardown that does not return (the daemon's
// provider call waits on the worker's answer exactly as it would on a stuck plugin), the test
// controls it with one file, and it needs no root, no bwrap and no timing of other processes.
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#ifndef SANDBOXD_SOURCE_DIR
#error "SANDBOXD_SOURCE_DIR must name the source tree"
#endif

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

constexpr int node_ttl_ms = 2000;
constexpr int hung_teardowns = 8;

}  // namespace

TEST_CASE("membership: a node whose teardowns hang past its TTL keeps its membership",
          "[daemon][membership][plugin]") {
    TempDir dir;
    const fs::path hold = dir.path() / "hold";
    const json env = {{"PROCESS_PLUGIN_ROOT", (dir.path() / "leases").string()},
                      {"PROCESS_PLUGIN_TEST_HOOKS", "1"},
                      {"PROCESS_PLUGIN_DESTROY_HOLD_FILE", hold.string()}};
    const json config = {
        {"routing", {{"nodeTtlMs", node_ttl_ms}, {"heartbeatMs", 200}}},
        {"providers",
         {{"plugins",
           {{{"pluginId", "process-ref"},
             {"provider", "process"},
             {"command", {std::string(SANDBOXD_SOURCE_DIR) + "/plugins/process/worker"}},
             {"env", env}}}}}}};
    DaemonProcess daemon("node-a", config.dump());
    auto c = daemon.connect();
    std::vector<json> leases;
    leases.reserve(hung_teardowns);
    for (int i = 0; i < hung_teardowns; ++i) leases.push_back(acquire_plugin_lease(*c));
    const json kept = acquire_plugin_lease(*c);

    // Eight releases at once (one connection each), all stuck in the worker's teardown.
    std::ofstream(hold) << "hold\n";
    std::vector<std::unique_ptr<Client>> releasers;
    std::vector<std::int64_t> ids;
    for (const auto& lease : leases) {
        releasers.push_back(daemon.connect());
        ids.push_back(releasers.back()->send_request("leaseRelease", {{"leaseId", lease["id"]}}));
    }
    REQUIRE(eventually([&] { return daemon.log().find("holding destroy") != std::string::npos; },
                       seconds(10)));

    // Well past the TTL (and the fencing limit, 2/3 of it) the node still renews: it stays
    // ready and serves what needs its membership.
    const auto held_until = std::chrono::steady_clock::now() + milliseconds(2 * node_ttl_ms);
    int checks = 0;
    while (std::chrono::steady_clock::now() < held_until) {
        INFO("check " << checks);
        CHECK(http_get(daemon.address(), "/readyz") == std::pair<int, std::string>{200, "ready\n"});
        CHECK(error_reason(*c, "leaseRenew", {{"leaseId", kept["id"]}, {"ttlMs", 60000}}) == "ok");
        ++checks;
        std::this_thread::sleep_for(milliseconds(100));  // pacing of the probes
    }
    CHECK(checks > 10);
    // No teardown finished meanwhile.
    for (const auto& lease : leases) {
        CHECK(fs::exists(dir.path() / "leases" / lease["providerLeaseId"].get<std::string>()));
    }

    fs::remove(hold);
    for (std::size_t i = 0; i < releasers.size(); ++i) {
        auto released = releasers[i]->wait_response(ids[i]);
        CHECK(released["status"] == "released");
    }
    const auto log = daemon.log();
    CHECK(log.find("fenc") == std::string::npos);
    CHECK(log.find("lost its membership") == std::string::npos);
}
