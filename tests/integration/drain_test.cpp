// Drain (docs/protocol.md section 7, issue 18 item 5): SIGTERM and POST /admin/drain refuse
// new opens and leases at once (OWNER_UNAVAILABLE with data.draining), /readyz says draining,
// running channels get limits.drainTimeoutMs and are then stopped, a second SIGTERM stops at
// once, and a rolling restart of three nodes under a stream of opens loses no channel.
#include "support/clusters.hpp"
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <csignal>
#include <mutex>
#include <thread>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string& host_token = test_host_token;
const std::string& peer_token = test_peer_token;
json tokens() { return host_and_peer_tokens(); }

/// The rpc_error of `method`, which must fail.
rpc_error failure_of(Client& c, const std::string& method, const json& params) {
    try {
        c.call(method, params);
    } catch (const rpc_error& e) {
        return e;
    }
    FAIL(method << " succeeded where it must fail");
    throw std::logic_error("unreachable");
}

bool readyz_says(const DaemonProcess& d, const std::string& text) {
    const auto [status, body] = http_get(d.address(), "/readyz");
    return body.find(text) != std::string::npos;
}

/// An open channel of a test: what it printed, and its exit once it came. (clang-tidy counts
/// the implicit moves of nlohmann::json, whose invariant checks it cannot see through, as
/// throwing.)
struct Running {  // NOLINT(bugprone-exception-escape)
    std::uint32_t channel = 0;
    std::string out;
    json exit;
};

Running open(Client& c, const json& params) {
    Running r;
    r.channel = c.call("duplexChannelOpen", params)["channel"].get<std::uint32_t>();
    return r;
}

/// Reads `c` until `r`'s exit (crediting its output); throws client_error when the
/// connection ends first.
void until_exit(Client& c, Running& r) {
    while (r.exit.is_null()) {
        auto ev = c.next_event();
        if (ev.type == ClientEvent::kind::data && ev.channel == r.channel) {
            r.out += ev.bytes;
            c.send_credit(r.channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit" &&
                   ev.message["params"].value("channel", 0U) == r.channel) {
            r.exit = ev.message["params"];
        }
    }
}

/// until_exit(), with the daemon's log in the failure when the connection ends first.
void until_exit(Client& c, Running& r, const DaemonProcess& d) {
    try {
        until_exit(c, r);
    } catch (const std::exception& e) {
        FAIL("no exit for channel " << r.channel << ": " << e.what() << "\ndaemon log:\n"
                                    << d.log());
    }
}

void check_draining_refusal(const rpc_error& e, const std::string& node) {
    CHECK(e.code() == errc::owner_unavailable);
    CHECK(e.data().value("reason", "") == "OWNER_UNAVAILABLE");
    CHECK(e.data().value("draining", false) == true);
    CHECK(std::string(e.what()).find("node " + node + " is draining") != std::string::npos);
}

}  // namespace

TEST_CASE("drain: SIGTERM refuses opens and leases at once, and the running channel finishes",
          "[drain]") {
    const auto config = json{{"auth", tokens()}, {"limits", {{"drainTimeoutMs", 60000}}}}.dump();
    DaemonProcess d("node-a", config);
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    // It waits for a line on stdin: it runs until the test lets it end.
    auto running = open(c, open_params(lease, {"sh", "-c", "read line; echo \"got $line\""}));

    REQUIRE(::kill(d.pid(), SIGTERM) == 0);
    REQUIRE(eventually([&] { return readyz_says(d, "not ready: draining"); }, 10s));
    CHECK(http_get(d.address(), "/readyz").first == 503);
    CHECK(http_get(d.address(), "/healthz").first == 200);

    // New work is refused with data.draining; the lease's other calls go on.
    check_draining_refusal(failure_of(c, "duplexChannelOpen", open_params(lease, {"true"})),
                           "node-a");
    check_draining_refusal(
        failure_of(c, "leaseAcquire",
                   {{"companyId", "acme"}, {"environmentId", "other"}, {"provider", "bwrap"}}),
        "node-a");
    CHECK(c.call("leaseRenew", {{"leaseId", lease["id"]}, {"ttlMs", 60000}})["status"] == "active");
    // Bad input is still told as such, not as draining.
    CHECK(failure_of(c, "duplexChannelOpen", {{"lease", lease_ref(lease)}}).code() ==
          errc::invalid_params);
    // A new connection is still accepted (a host may come back to release its lease).
    Client late(d.url(), host_token);
    check_draining_refusal(failure_of(late, "duplexChannelOpen", open_params(lease, {"true"})),
                           "node-a");
    CHECK(d.alive());

    // The channel that was running finishes as it would have: its output and exit are whole.
    c.send_stdin(running.channel, "drained\n");
    until_exit(c, running, d);
    CHECK(running.out == "got drained\n");
    CHECK(running.exit["outcome"] == "exited");
    CHECK(running.exit["exitCode"] == 0);
    // Then, with no channel left, the daemon stops by itself.
    CHECK(d.wait_exit(20s) == 0);
    const auto log = d.log();
    CHECK(log.find("draining: new opens and leases are refused; 1 channels") != std::string::npos);
    CHECK(log.find("drained: no channel runs here") != std::string::npos);
}

TEST_CASE("drain: channels still running at drainTimeoutMs are stopped with an exit", "[drain]") {
    const auto config = json{{"auth", tokens()}, {"limits", {{"drainTimeoutMs", 700}}}}.dump();
    DaemonProcess d("node-a", config);
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    auto running =
        open(c, open_params(lease, {"sh", "-c", "trap '' TERM HUP; echo started; exec sleep 120"}));
    const auto sent = std::chrono::steady_clock::now();
    REQUIRE(::kill(d.pid(), SIGTERM) == 0);
    until_exit(c, running, d);
    const auto took = std::chrono::steady_clock::now() - sent;
    CHECK(running.out == "started\n");
    CHECK(running.exit["outcome"] == "stopped");
    CHECK(took >= 700ms);
    CHECK(took < 10s);
    CHECK(d.wait_exit(20s) == 0);
    CHECK(d.log().find("drain timeout of 700 ms over: stopping 1 channels") != std::string::npos);
}

TEST_CASE("drain: a second SIGTERM stops at once", "[drain]") {
    const auto config =
        json{{"auth", tokens()}, {"limits", {{"drainTimeoutMs", 600000}, {"hangupGraceMs", 200}}}}
            .dump();
    DaemonProcess d("node-a", config);
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    open(c, open_params(lease, {"sleep", "120"}));
    REQUIRE(::kill(d.pid(), SIGTERM) == 0);
    REQUIRE(eventually([&] { return readyz_says(d, "draining"); }, 10s));
    // Still draining: the channel may run for ten minutes.
    CHECK(!d.wait_exit(300ms).has_value());
    const auto sent = std::chrono::steady_clock::now();
    REQUIRE(::kill(d.pid(), SIGTERM) == 0);
    CHECK(d.wait_exit(15s) == 0);
    CHECK(std::chrono::steady_clock::now() - sent < 10s);
    CHECK(d.log().find("again: stopping now") != std::string::npos);
}

TEST_CASE("drain: POST /admin/drain takes only a peer token, and the node stays up", "[drain]") {
    const auto config = json{{"auth", tokens()}, {"limits", {{"drainTimeoutMs", 60000}}}}.dump();
    DaemonProcess d("node-a", config);
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    auto running = open(c, open_params(lease, {"sh", "-c", "read line; echo \"got $line\""}));

    // Refused, and nothing changes: no token, a wrong one, a host's, the wrong method.
    CHECK(http_post(d.address(), "/admin/drain").first == 401);
    CHECK(http_post(d.address(), "/admin/drain", "Bearer wrong").first == 401);
    const auto [host_status, host_body] =
        http_post(d.address(), "/admin/drain", "Bearer " + host_token);
    CHECK(host_status == 403);
    CHECK(host_body == "token \"host\" has role host; POST /admin/drain takes a peer-role token\n");
    CHECK(http_get(d.address(), "/admin/drain", "Bearer " + peer_token).first == 405);
    CHECK(http_get(d.address(), "/readyz").first == 200);
    c.call("duplexChannelOpen", open_params(lease, {"true"}));

    const auto [status, body] = http_post(d.address(), "/admin/drain", "Bearer " + peer_token);
    REQUIRE(status == 202);
    const auto answer = json::parse(body);
    CHECK(answer["nodeId"] == "node-a");
    CHECK(answer["draining"] == true);
    CHECK(answer["drainTimeoutMs"] == 60000);
    // Draining from the answer on: /readyz and opens say so.
    CHECK(http_get(d.address(), "/readyz").second == "not ready: draining\n");
    check_draining_refusal(failure_of(c, "duplexChannelOpen", open_params(lease, {"true"})),
                           "node-a");
    // Again: the same drain.
    CHECK(http_post(d.address(), "/admin/drain", "Bearer " + peer_token).first == 202);

    c.send_stdin(running.channel, "x\n");
    until_exit(c, running, d);
    CHECK(running.exit["exitCode"] == 0);
    // Drained, and still up: the lease is released through it, then SIGTERM stops it at once.
    REQUIRE(eventually(
        [&] { return d.log().find("drained: no channel runs here") != std::string::npos; }, 10s));
    CHECK(d.alive());
    CHECK(c.call("leaseRelease", {{"leaseId", lease["id"]}})["status"] == "released");
    CHECK(d.stop() == 0);
}

TEMPLATE_TEST_CASE(
    "drain: a rolling restart of three nodes under a stream of opens loses no channel",
    "[drain][multinode]", SqliteCluster) {
    TestType cluster;
    const auto config = json{{"registry", cluster.registry()},
                             {"auth", tokens()},
                             {"routing", {{"nodeTtlMs", 3000}, {"heartbeatMs", 300}}},
                             {"limits", {{"drainTimeoutMs", 20000}}}}
                            .dump();
    constexpr int nodes = 3;
    std::vector<std::unique_ptr<DaemonProcess>> daemons;
    daemons.reserve(nodes);
    for (int i = 0; i < nodes; ++i) {
        daemons.push_back(std::make_unique<DaemonProcess>("node-" + std::to_string(i), config));
    }
    // What the streams read: each node's current URL, and which node restarts now.
    std::mutex urls_mutex;
    std::vector<std::string> urls;
    urls.reserve(nodes);
    for (auto& d : daemons) urls.push_back(d->url());
    std::atomic<int> restarting{-1};
    std::atomic<bool> done{false};

    // One stream of opens per node, on a lease that node owns, each from its own client of
    // that node: `cat` echoes a line. A channel whose open succeeded must end with its whole
    // output and exit 0, whatever node restarts (the drain lets it finish); an open may fail
    // only while its own node restarts, and then only as refused for the drain or with the
    // connection gone before the open's answer.
    struct Stream {
        std::atomic<int> ok{0};
        std::atomic<int> refused{0};
        std::mutex m;
        std::vector<std::string> losses;
        void lose(std::string what) {
            std::lock_guard lock(m);
            losses.push_back(std::move(what));
        }
    };
    std::vector<Stream> streams(nodes);
    std::vector<std::thread> threads;
    threads.reserve(nodes);
    for (int i = 0; i < nodes; ++i) {
        threads.emplace_back([&, i] {
            auto& s = streams[static_cast<std::size_t>(i)];
            std::unique_ptr<Client> c;
            json lease;
            int generation = 0;
            for (int n = 0; !done; ++n) {
                const bool mine_restarting = restarting == i;
                bool opened = false;
                try {
                    if (!c) {
                        std::string url;
                        {
                            std::lock_guard lock(urls_mutex);
                            url = urls[static_cast<std::size_t>(i)];
                        }
                        c = std::make_unique<Client>(url, host_token);
                    }
                    if (lease.is_null()) {
                        lease = c->call("leaseAcquire",
                                        {{"companyId", "acme"},
                                         {"environmentId", "n" + std::to_string(i) + "-" +
                                                               std::to_string(generation++)},
                                         {"provider", "bwrap"}});
                    }
                    auto r = open(*c, open_params(lease, {"cat"}));
                    opened = true;
                    const std::string line =
                        "node " + std::to_string(i) + " line " + std::to_string(n) + "\n";
                    c->send_stdin(r.channel, line);
                    c->call("duplexChannelCloseStdin", {{"channel", r.channel}});
                    until_exit(*c, r);
                    if (r.out != line || r.exit.value("exitCode", -1) != 0) {
                        s.lose("node " + std::to_string(i) + ": a channel ended with " +
                               json(r.out).dump() + " and " + r.exit.dump());
                    } else {
                        ++s.ok;
                    }
                } catch (const std::exception& e) {
                    const bool excused = !opened && (mine_restarting || restarting == i);
                    const auto* rpc = dynamic_cast<const rpc_error*>(&e);
                    if (!excused) {
                        s.lose("node " + std::to_string(i) + (opened ? " (after its open)" : "") +
                               ": " + e.what());
                    } else if (rpc && rpc->data().value("draining", false)) {
                        ++s.refused;
                    }
                    // After a restart the node has no sandbox of its old lease: a new one.
                    if (!rpc || rpc->code() != errc::owner_unavailable) lease = nullptr;
                    if (!rpc) c.reset();
                    if (!rpc || rpc->code() == errc::owner_unavailable) {
                        // Until the node is back, do not spin on a refused or closed node.
                        std::this_thread::sleep_for(20ms);
                    }
                }
            }
        });
    }
    const auto all_ok_beyond = [&](std::vector<int> marks) {
        return eventually(
            [&] {
                for (int i = 0; i < nodes; ++i) {
                    if (streams[static_cast<std::size_t>(i)].ok <=
                        marks[static_cast<std::size_t>(i)])
                        return false;
                }
                return true;
            },
            30s);
    };
    const auto marks = [&] {
        std::vector<int> m;
        m.reserve(nodes);
        for (auto& s : streams) m.push_back(s.ok);
        return m;
    };
    REQUIRE(all_ok_beyond({2, 2, 2}));
    for (int k = 0; k < nodes; ++k) {
        restarting = k;
        auto& d = *daemons[static_cast<std::size_t>(k)];
        const auto before = marks();
        // A channel of its own runs on the node when its SIGTERM comes, and holds the drain
        // open until the test lets it end.
        Client holder(d.url(), host_token);
        const auto held_lease =
            holder.call("leaseAcquire", {{"companyId", "acme"},
                                         {"environmentId", "held-" + std::to_string(k)},
                                         {"provider", "bwrap"}});
        auto held =
            open(holder, open_params(held_lease, {"sh", "-c", "read line; echo \"got $line\""}));
        const int refused_before = streams[static_cast<std::size_t>(k)].refused;
        REQUIRE(::kill(d.pid(), SIGTERM) == 0);
        // While it drains, its own stream is refused, and the other streams go on.
        REQUIRE(eventually(
            [&] { return streams[static_cast<std::size_t>(k)].refused > refused_before; }, 20s));
        CHECK(eventually(
            [&] {
                for (int j = 0; j < nodes; ++j) {
                    const auto u = static_cast<std::size_t>(j);
                    if (j != k && streams[u].ok <= before[u] + 2) return false;
                }
                return true;
            },
            20s));
        holder.send_stdin(held.channel, "node " + std::to_string(k) + "\n");
        until_exit(holder, held, d);
        CHECK(held.out == "got node " + std::to_string(k) + "\n");
        CHECK(held.exit["exitCode"] == 0);
        REQUIRE(d.wait_exit(60s) == 0);
        d.restart();
        {
            std::lock_guard lock(urls_mutex);
            urls[static_cast<std::size_t>(k)] = d.url();
        }
        // Every stream, the restarted node's too, has run channels since.
        REQUIRE(all_ok_beyond(before));
        restarting = -1;
    }
    done = true;
    for (auto& t : threads) t.join();
    for (int i = 0; i < nodes; ++i) {
        auto& s = streams[static_cast<std::size_t>(i)];
        INFO("node-" << i << ": " << s.ok << " channels, " << s.refused
                     << " opens refused while draining");
        std::string losses;
        for (const auto& loss : s.losses) losses += loss + "\n";
        INFO(losses);
        CHECK(s.losses.empty());
        CHECK(s.ok > 0);
    }
}
