// Detached channels (issue 46) on a real daemon, bubblewrap sandboxes and the SQLite registry:
// a detached command outlives the connection that opened it, while an undetached one in the
// same connection is hung up; the lease's release ends it.
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

TEST_CASE("A detached channel's command outlives its connection, and its lease's release ends it",
          "[daemon][detached]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    auto detached = open_params(lease, {"sh", "-c", "echo started; exec sleep 6461"});
    detached["detach"] = {{"retainMs", 60000}, {"retainBytes", 65536}};
    detached["name"] = "worker";
    const auto opened = c->call("duplexChannelOpen", detached);
    CHECK(opened["handle"].get<std::string>().rfind("dch_", 0) == 0);
    CHECK(opened["name"] == "worker");
    // Its output reaches the connection that opened it, as any channel's.
    std::string out;
    while (out != "started\n") {
        auto got = c->poll_event(5s);
        if (!got) FAIL(daemon.log());
        auto e = *got;
        if (e.type == ClientEvent::kind::data && e.channel == opened["channel"]) out += e.bytes;
    }
    // A second name "worker" in the lease is refused while the first runs.
    try {
        c->call("duplexChannelOpen", detached);
        FAIL("a second detached channel named worker was opened");
    } catch (const rpc_error& e) {
        CHECK(e.data().value("field", "") == "name");
    }
    c->call("duplexChannelOpen", open_params(lease, {"sleep", "6462"}));  // not detached
    REQUIRE(eventually([] { return count_processes_with("sleep 6462") == 1; }, 10s));
    c.reset();  // the connection drops
    // The undetached command is hung up; the detached one goes on.
    REQUIRE(eventually([] { return count_processes_with("sleep 6462") == 0; }, 20s));
    CHECK(count_processes_with("sleep 6461") == 1);

    auto again = daemon.connect();
    again->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(eventually([] { return count_processes_with("sleep 6461") == 0; }, 20s));
}
