// Issue 47: a lease's sandbox outlives its daemon (providers.bwrap.adoptTimeoutMs), and the
// next process on the same state re-adopts it. Real daemons on loopback, real bubblewrap and
// supervisors, the SQLite registry.
#include "support/clusters.hpp"
#include "support/daemon_fixture.hpp"
#include "support/received.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

/// Sandboxes that outlive their daemon by `adopt_ms`, with both token roles.
std::string adopting_config(int adopt_ms = 120000, const std::string& init_path = "") {
    json bwrap = {{"adoptTimeoutMs", adopt_ms}};
    if (!init_path.empty()) bwrap["initPath"] = init_path;
    return json{{"auth", host_and_peer_tokens()}, {"providers", {{"bwrap", bwrap}}}}.dump();
}

std::unique_ptr<Client> host(const DaemonProcess& d) {
    return std::make_unique<Client>(d.url(), test_host_token);
}

/// A bwrap lease for acme/dev, with `limits` in its config when not empty.
json acquire(Client& c, const json& limits = json::object()) {
    json params = {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "bwrap"}};
    if (!limits.empty()) params["config"] = {{"limits", limits}};
    return c.call("leaseAcquire", params);
}

/// Runs `script` under sh in the lease over a duplex channel: its stdout and exit code.
std::pair<std::string, int> run(Client& c, const json& lease, const std::string& script) {
    const auto done = c.run_channel(open_params(lease, {"sh", "-c", script}));
    return {done.out, done.exit.value("exitCode", -1)};
}

/// A lease of `d` in whose sandbox `script` has run and exited 0.
json lease_after(const DaemonProcess& d, const std::string& script) {
    auto c = host(d);
    json lease = acquire(*c);
    REQUIRE(run(*c, lease, script).second == 0);
    return lease;
}

fs::path runtime_of(const DaemonProcess& d) {
    return fs::read_symlink(d.state_dir() / "sandboxes" / ".runtime");
}

/// Whether a process listens on the lease's adoption socket (its supervisor waits or serves).
bool supervisor_listens(const DaemonProcess& d, const std::string& provider_lease_id) {
    const std::string path = (runtime_of(d) / provider_lease_id / "supervisor.sock").string();
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    const bool up = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);  // says nothing: the supervisor closes it, unanswered
    return up;
}

std::string lease_status(Client& c, const json& lease) {
    return c.call("leaseGet", {{"leaseId", lease["id"]}})["status"];
}

}  // namespace

TEST_CASE("adopt: after kill -9 and after SIGTERM the next process re-adopts every sandbox",
          "[adopt][restart]") {
    DaemonProcess d("node-a", adopting_config());
    std::vector<json> leases;
    {
        auto c = host(d);
        for (int i = 0; i < 3; ++i) {
            leases.push_back(acquire(*c));
            // /tmp is the lease's own tmpfs, made with its sandbox: it survives only if the
            // sandbox does.
            auto [out, code] =
                run(*c, leases.back(), "echo lease-" + std::to_string(i) + " > /tmp/mark; echo ok");
            REQUIRE(code == 0);
            REQUIRE(out == "ok\n");
        }
    }
    for (const auto* how : {"kill -9", "SIGTERM"}) {
        INFO(how);
        if (std::string(how) == "kill -9") {
            d.kill9();
        } else {
            REQUIRE(d.stop() == 0);
            CHECK(d.log().find("keeping 3 sandbox(es)") != std::string::npos);
        }
        // With no daemon, every supervisor is still there, waiting.
        for (const auto& lease : leases) CHECK(supervisor_listens(d, lease["providerLeaseId"]));
        d.restart();
        CHECK(d.log().find("re-adopted 3 sandbox(es)") != std::string::npos);
        auto c = host(d);
        for (std::size_t i = 0; i < leases.size(); ++i) {
            CHECK(lease_status(*c, leases[i]) == "active");
            auto [out, code] = run(*c, leases[i], "cat /tmp/mark");
            CHECK(code == 0);
            CHECK(out == "lease-" + std::to_string(i) + "\n");
        }
    }
    // A re-adopted sandbox ends like any other: released, nothing of it is left.
    auto c = host(d);
    const std::string first = leases.front()["providerLeaseId"];
    CHECK(c->call("leaseRelease", {{"leaseId", leases.front()["id"]}})["status"] == "released");
    CHECK_FALSE(fs::exists(d.state_dir() / "sandboxes" / first));
    CHECK_FALSE(supervisor_listens(d, first));
}

TEST_CASE(
    "adopt: with a mount namespace of its own at each start, as under systemd, a re-adopted "
    "lease's disk is still measured",
    "[adopt][restart]") {
    DaemonProcess d("node-a", adopting_config());
    d.confine_like_the_unit_for_next_start();  // this start and every later one
    d.restart();
    auto c = host(d);
    const json lease = acquire(*c, {{"diskBytes", 64 << 20}});
    REQUIRE(run(*c, lease, "head -c 20971520 /dev/urandom > /workspace/f && sync").second == 0);
    auto disk = [&] {
        return c->call("leaseGet", {{"leaseId", lease["id"]}})["usage"]["diskBytes"].get<double>();
    };
    const double before = disk();
    CHECK(before > 20.0 * (1 << 20));
    d.kill9();
    d.restart();
    c = host(d);
    // The next process's mount namespace has no mount of the workspace's disk: it reads it
    // through the descriptor its sandbox's supervisor gave it.
    const std::string workspace =
        (runtime_of(d) / lease["providerLeaseId"].get<std::string>() / "workspace").string();
    const std::string mounts = read_proc_file("/proc/" + std::to_string(d.pid()) + "/mountinfo");
    CHECK(mounts.find(" " + workspace + " ") == std::string::npos);
    const double after = disk();
    CHECK(after > 20.0 * (1 << 20));
    CHECK(after < before + (1 << 20));
    REQUIRE(run(*c, lease, "rm /workspace/f && sync").second == 0);
    CHECK(disk() < before - 19.0 * (1 << 20));
}

TEST_CASE(
    "adopt: a kept channel killed at its memory limit after the restart is reported as "
    "memory",
    "[adopt][restart]") {
    DaemonProcess d("node-a", adopting_config());
    auto c = host(d);
    const json lease = acquire(*c, {{"memoryBytes", 128 << 20}});
    // It waits for the next process, then doubles a string until the kernel stops it.
    auto p = open_params(
        lease, {"sh", "-c", "read go && exec awk 'BEGIN { s = \"x\"; while (1) s = s s }'"});
    p["name"] = "hungry";
    p["detach"] = {{"retainMs", 60000}, {"retainBytes", 4096}};
    c->call("duplexChannelOpen", p);
    c.reset();
    d.kill9();
    d.restart();
    c = host(d);
    const auto id =
        c->call("duplexChannelAttach", {{"leaseId", lease["id"]}, {"name", "hungry"}})["channel"]
            .get<std::uint32_t>();
    c->send_stdin(id, "go\n");
    Received got;
    REQUIRE(got.until(*c, [&] { return !got.exits[id].empty(); }));
    const json& exit = got.exits[id].front();
    CHECK(exit["signal"] == "KILL");
    CHECK(exit.value("limit", "") == "memory");
    CHECK(d.metric("sandboxd_limit_events_total{kind=\"memory\"}") == 1);
    CHECK(run(*c, lease, "echo alive").first == "alive\n");
}

TEST_CASE("adopt: a supervisor that no daemon adopts ends its sandbox after adoptTimeoutMs",
          "[adopt][restart]") {
    DaemonProcess d("node-a", adopting_config(1000));
    const json lease = lease_after(d, "true");
    const std::string id = lease["providerLeaseId"];
    d.kill9();
    REQUIRE(supervisor_listens(d, id));
    // Nobody comes: the supervisor ends the sandbox by itself.
    CHECK(eventually([&] { return !supervisor_listens(d, id); }, 10s));
    // The next process finds nothing to adopt: the lease goes to cleanup and its files go.
    d.restart();
    CHECK(d.log().find("lease=" + lease["id"].get<std::string>() +
                       ": its sandbox was not re-adopted") != std::string::npos);
    auto c = host(d);
    CHECK(lease_status(*c, lease) != "active");
    CHECK(eventually([&] { return !fs::exists(d.state_dir() / "sandboxes" / id); }, 15s));
}

TEST_CASE("adopt: POST /admin/decommission ends the sandboxes, releases the leases and stops",
          "[adopt][drain]") {
    DaemonProcess d("node-a", adopting_config());
    std::vector<json> leases;
    {
        auto c = host(d);
        for (int i = 0; i < 2; ++i) leases.push_back(acquire(*c));
    }
    CHECK(http_post(d.address(), "/admin/decommission", "Bearer " + test_host_token).first == 403);
    auto [status, body] =
        http_post(d.address(), "/admin/decommission", "Bearer " + test_peer_token);
    CHECK(status == 202);
    CHECK(json::parse(body)["decommissioning"] == true);
    const auto code = d.wait_exit(30s);
    REQUIRE(code);
    CHECK(*code == 0);
    for (const auto& lease : leases) {
        const std::string id = lease["providerLeaseId"];
        CHECK_FALSE(fs::exists(d.state_dir() / "sandboxes" / id));
        CHECK_FALSE(supervisor_listens(d, id));
    }
    CHECK(d.end_kept_sandboxes() == 0);  // nothing was kept
    // The next process on this state finds the leases released and nothing to adopt.
    d.restart();
    auto c = host(d);
    for (const auto& lease : leases) CHECK(lease_status(*c, lease) == "released");
}

TEST_CASE(
    "adopt: a supervisor of the previous version is re-adopted, one of a newer version "
    "is torn down",
    "[adopt][restart][upgrade]") {
    struct Case {
        const char* init;
        bool adopted;
    };
    for (const Case& k : {Case{SANDBOXD_INIT_V1_BIN, true}, Case{SANDBOXD_INIT_V5_BIN, false}}) {
        INFO(k.init);
        // The earlier process ran that supervisor; the next one is this build's.
        DaemonProcess d("node-a", adopting_config(120000, k.init));
        const json lease = lease_after(d, "echo v > /tmp/mark");
        const std::string id = lease["providerLeaseId"];
        {
            // A detached channel: a supervisor before version 3 cannot keep it.
            auto c = host(d);
            auto p = open_params(lease, {"sleep", "3600"});
            p["detach"] = {{"retainMs", 60000}, {"retainBytes", 4096}};
            c->call("duplexChannelOpen", p);
        }
        d.kill9();
        d.set_config_for_next_start(adopting_config());
        d.restart();
        auto c = host(d);
        if (k.adopted) {
            CHECK(lease_status(*c, lease) == "active");
            auto [out, code] = run(*c, lease, "cat /tmp/mark");
            CHECK(out == "v\n");
            CHECK(d.log().find("not kept across the restart: its command did not outlive") !=
                  std::string::npos);
            CHECK(c->call("duplexChannelList", {{"leaseId", lease["id"]}})["channels"].empty());
            // A supervisor before version 4 makes no terminal: the daemon makes it, as then.
            auto pty = open_params(lease, {"sh", "-c", "stty size; echo typed"});
            pty["pty"] = {{"cols", 100}, {"rows", 30}};
            const auto shown = c->run_channel(pty);
            CHECK(shown.out == "30 100\r\ntyped\r\n");
            CHECK(shown.exit["exitCode"] == 0);
        } else {
            CHECK(d.log().find("its supervisor speaks version 5, and this daemon serves 1..4") !=
                  std::string::npos);
            CHECK(lease_status(*c, lease) != "active");
            CHECK_FALSE(supervisor_listens(d, id));
            CHECK(eventually([&] { return !fs::exists(d.state_dir() / "sandboxes" / id); }, 15s));
        }
    }
}

TEMPLATE_TEST_CASE(
    "adopt: other nodes leave a dead owner's sandboxes for adoptGraceMs, and its "
    "restart serves them again at once",
    "[adopt][multinode][restart]", SqliteCluster, EtcdCluster) {
    TestType cluster;
    INFO("registry: " << TestType::kind);
    constexpr int ttl_ms = 3000;
    constexpr int grace_ms = 4000;
    auto config = json::parse(cluster_config(cluster));
    config["routing"]["adoptGraceMs"] = grace_ms;
    config["providers"] = {{"bwrap", {{"adoptTimeoutMs", 120000}}}};
    DaemonProcess p1("node-1", config.dump());
    DaemonProcess p2("node-2", config.dump());
    Client c2(p2.url(), test_host_token);
    json lease;
    {
        Client c1(p1.url(), test_host_token);
        lease = acquire(c1);
        REQUIRE(run(c1, lease, "echo kept > /tmp/mark").second == 0);
    }
    // A crash and a quick restart: the record is taken over at once (no TTL's wait), and the
    // lease serves again, routed through node-2, from the same sandbox.
    p1.kill9();
    p1.restart();
    CHECK(p1.log().find("node=node-1 took over the record of its previous process") !=
          std::string::npos);
    CHECK(run(c2, lease, "cat /tmp/mark").first == "kept\n");

    // A crash with no restart: node-2 leaves the lease active until the TTL and the grace
    // have passed since node-1's last heartbeat, then orphans it.
    const auto killed = std::chrono::steady_clock::now();
    p1.kill9();
    CHECK(error_reason(c2, "duplexChannelOpen", open_params(lease, {"true"})) ==
          "OWNER_UNAVAILABLE");
    REQUIRE(
        eventually([&] { return lease_status(c2, lease) != "active"; }, std::chrono::seconds(30)));
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - killed);
    CHECK(waited.count() >= ttl_ms + grace_ms - 500);  // its last heartbeat was at most 300 ms
                                                       // before the kill, and one more may lag
    CHECK(lease_status(c2, lease) == "pending_cleanup");
}

namespace {

constexpr int batches = 40;
constexpr int batch_lines = 150;

/// A command that streams `batches` batches of numbered lines tagged `tag` (a pause between
/// two: it is still writing when the daemon goes), then (with `then_read`) waits for a line on
/// stdin, and exits 7. Under a PTY, without echo.
std::vector<std::string> streaming_command(const std::string& tag, bool pty,
                                           bool then_read = false) {
    return {"sh", "-c",
            std::string(pty ? "stty -echo; " : "") + "for b in $(seq 1 " + std::to_string(batches) +
                "); do seq -f \"" + tag + "-$b-%g\" 1 " + std::to_string(batch_lines) +
                "; sleep 0.05; done; " + (then_read ? "read go; " : "") + "exit 7"};
}

std::string streamed_output(const std::string& tag, bool pty) {
    std::string s;
    for (int b = 1; b <= batches; ++b) {
        for (int i = 1; i <= batch_lines; ++i) {
            s += tag + "-" + std::to_string(b) + "-" + std::to_string(i) + (pty ? "\r\n" : "\n");
        }
    }
    return s;
}

}  // namespace

TEST_CASE(
    "adopt: 20 detached channels streaming when the daemon goes (kill -9 or SIGTERM) go on "
    "in the next process, byte-exact from their offsets",
    "[adopt][detached][restart]") {
    for (const auto* how : {"kill -9", "SIGTERM"}) {
        INFO(how);
        DaemonProcess d("node-a", adopting_config());
        auto first = host(d);
        std::vector<json> leases = {acquire(*first), acquire(*first)};
        constexpr int channels = 20;
        std::vector<std::string> names;
        std::vector<bool> pty;
        std::vector<std::size_t> lease_of;
        std::map<std::string, std::uint32_t> first_id;
        for (int i = 0; i < channels; ++i) {
            names.push_back("job-" + std::to_string(i));
            pty.push_back(i % 4 == 3);  // 5 of 20 under a PTY
            lease_of.push_back(static_cast<std::size_t>(i % 2));
            auto p = open_params(leases[lease_of[i]], streaming_command(names[i], pty[i]));
            p["detach"] = {{"retainMs", 60000}, {"retainBytes", 1 << 20}};
            p["name"] = names[i];
            if (pty[i]) p["pty"] = {{"cols", 80}, {"rows", 24}};
            first_id[names[i]] =
                first->call("duplexChannelOpen", p)["channel"].get<std::uint32_t>();
        }
        // One that has ended before the daemon goes: its exit is kept across the restart too.
        auto quick = open_params(leases[0], {"sh", "-c", "echo quick; exit 3"});
        quick["detach"] = {{"retainMs", 60000}, {"retainBytes", 4096}};
        quick["name"] = "quick";
        const auto quick_id =
            first->call("duplexChannelOpen", quick)["channel"].get<std::uint32_t>();
        Received before;
        // The host has read a part of every channel (each is streaming), and the quick exit.
        REQUIRE(before.until(*first, [&] {
            if (before.exits[quick_id].empty()) return false;
            for (const auto& [name, id] : first_id) {
                if (before.out[id].size() < 4000) return false;
            }
            return true;
        }));
        if (std::string(how) == "kill -9") {
            d.kill9();
        } else {
            REQUIRE(d.stop() == 0);
        }
        first.reset();
        d.restart();
        CHECK(d.log().find("serves 21 detached channel(s) kept across its restart") !=
              std::string::npos);
        auto second = host(d);
        // The kept exit of the quick one, from its start.
        Received quick_after;
        const auto q =
            second->call("duplexChannelAttach", {{"leaseId", leases[0]["id"]}, {"name", "quick"}});
        CHECK(q["state"] == "exited");
        const auto qid = q["channel"].get<std::uint32_t>();
        REQUIRE(quick_after.until(*second, [&] { return !quick_after.exits[qid].empty(); }));
        CHECK(quick_after.out[qid] == "quick\n");
        CHECK(quick_after.exits[qid][0]["exitCode"] == 3);
        // Every other one is still running, and resumes from what the host read.
        std::map<std::string, std::uint32_t> second_id;
        for (int i = 0; i < channels; ++i) {
            const auto& read = before.out[first_id[names[i]]];
            const auto attached = second->call(
                "duplexChannelAttach", {{"leaseId", leases[lease_of[i]]["id"]},
                                        {"name", names[i]},
                                        {"offsets", {{"stdout", read.size()}, {"stderr", 0}}}});
            CHECK(attached["offsets"]["stdout"] == read.size());
            second_id[names[i]] = attached["channel"].get<std::uint32_t>();
        }
        Received after;
        // Meanwhile both leases serve new opens.
        for (const auto& lease : leases) {
            const auto ran = second->run_channel(open_params(lease, {"echo", "still-here"}));
            CHECK(ran.out == "still-here\n");  // the others' frames wait in the queue
        }
        const auto all_exited = [&] {
            for (const auto& [name, id] : second_id) {
                if (after.exits[id].empty()) return false;
            }
            return true;
        };
        REQUIRE(after.until(*second, all_exited, 90s));
        for (int i = 0; i < channels; ++i) {
            INFO(names[i] << (pty[i] ? " (pty)" : ""));
            const auto id = second_id[names[i]];
            CHECK(before.out[first_id[names[i]]] + after.out[id] ==
                  streamed_output(names[i], pty[i]));
            REQUIRE(after.exits[id].size() == 1);
            INFO(after.exits[id][0].dump());
            CHECK(after.exits[id][0]["exitCode"] == 7);
            CHECK(after.gaps[id].empty());
        }
        for (const auto& lease : leases) {
            second->call("leaseRelease", {{"leaseId", lease["id"]}});
        }
        // Nothing of the kept channels is left once their leases are gone.
        CHECK(eventually(
            [&] {
                return !fs::exists(d.state_dir() / "kept" / leases[0]["id"].get<std::string>());
            },
            10s));
    }
}

TEST_CASE(
    "adopt: a rolling restart of three nodes under long-running detached commands loses no "
    "command and no byte",
    "[adopt][detached][multinode][restart]") {
    SqliteCluster cluster;
    auto config = json::parse(cluster_config(cluster));
    config["providers"] = {{"bwrap", {{"adoptTimeoutMs", 120000}}}};
    std::vector<std::unique_ptr<DaemonProcess>> nodes;
    for (int n = 1; n <= 3; ++n) {
        nodes.push_back(
            std::make_unique<DaemonProcess>("node-" + std::to_string(n), config.dump()));
    }
    struct Job {
        json lease;
        std::string name;
        bool pty = false;
    };
    std::vector<Job> jobs;
    // Each node owns a lease with three detached commands (one under a PTY) that stream, then
    // wait for a line on stdin, and exit 7.
    for (std::size_t n = 0; n < nodes.size(); ++n) {
        auto c = host(*nodes[n]);
        const json lease = acquire(*c);
        REQUIRE(lease["ownerNodeId"] == "node-" + std::to_string(n + 1));
        for (int k = 0; k < 3; ++k) {
            Job job{lease, "n" + std::to_string(n + 1) + "-job" + std::to_string(k), k == 2};
            auto p = open_params(lease, streaming_command(job.name, job.pty, true));
            p["detach"] = {{"retainMs", 60000}, {"retainBytes", 1 << 20}};
            p["name"] = job.name;
            if (job.pty) p["pty"] = {{"cols", 80}, {"rows", 24}};
            c->call("duplexChannelOpen", p);
            jobs.push_back(job);
        }
    }
    // One node at a time: SIGTERM, then the next process on the same state. The other nodes
    // leave its leases alone (adoptGraceMs) and it serves them again at once.
    for (auto& node : nodes) {
        REQUIRE(node->stop() == 0);
        CHECK(node->log().find("keeping 1 sandbox(es)") != std::string::npos);
        node->restart();
        CHECK(node->log().find("serves 3 detached channel(s) kept across its restart") !=
              std::string::npos);
    }
    // A host on node-1 reattaches to all nine (six routed to their owners) from offset 0, lets
    // each finish, and gets every byte each wrote and its exit.
    auto c = host(*nodes[0]);
    Received got;
    std::map<std::string, std::uint32_t> id;
    for (const auto& job : jobs) {
        CHECK(lease_status(*c, job.lease) == "active");
        const auto attached =
            c->call("duplexChannelAttach", {{"leaseId", job.lease["id"]},
                                            {"name", job.name},
                                            {"offsets", {{"stdout", 0}, {"stderr", 0}}}});
        CHECK(attached["state"] == "running");
        id[job.name] = attached["channel"].get<std::uint32_t>();
    }
    const auto all_written = [&] {
        for (const auto& job : jobs) {
            if (got.out[id[job.name]].size() < streamed_output(job.name, job.pty).size()) {
                return false;
            }
        }
        return true;
    };
    REQUIRE(got.until(*c, all_written, 90s));
    for (const auto& job : jobs) c->send_stdin(id[job.name], job.pty ? "go\r" : "go\n");
    const auto all_exited = [&] {
        for (const auto& job : jobs) {
            if (got.exits[id[job.name]].empty()) return false;
        }
        return true;
    };
    REQUIRE(got.until(*c, all_exited, 60s));
    for (const auto& job : jobs) {
        INFO(job.name << (job.pty ? " (pty)" : ""));
        const auto i = id[job.name];
        CHECK(got.out[i] == streamed_output(job.name, job.pty));
        REQUIRE(got.exits[i].size() == 1);
        CHECK(got.exits[i][0]["exitCode"] == 7);
        CHECK(got.gaps[i].empty());
    }
    for (std::size_t n = 0; n < nodes.size(); ++n) {
        CHECK(host(*nodes[n])->call(
                  "leaseRelease", {{"leaseId", jobs[3 * n].lease["id"]}})["status"] == "released");
    }
}
