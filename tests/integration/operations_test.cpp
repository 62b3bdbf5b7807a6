// What an operator runs the daemon by (docs/protocol.md section 7): the systemd notify
// protocol (on a socket the test makes), GET /metrics over two nodes (checked by promtool),
// the audit trail of a lease's whole life, its reopening on SIGHUP, and JSON log fields.
#include "support/clusters.hpp"
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <deque>
#include <fstream>
#include <map>
#include <sstream>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string& host_token = test_host_token;
const std::string& peer_token = test_peer_token;
json tokens() { return host_and_peer_tokens(); }

/// A datagram socket bound in `dir`: what systemd listens on for sd_notify.
class NotifySocket {
public:
    explicit NotifySocket(const std::filesystem::path& dir)
        : path_((dir / "notify").string()), fd_(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {
        REQUIRE(fd_ >= 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        REQUIRE(path_.size() < sizeof addr.sun_path);
        std::copy(path_.begin(), path_.end(), addr.sun_path);
        REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    }
    ~NotifySocket() { ::close(fd_); }
    NotifySocket(const NotifySocket&) = delete;
    NotifySocket& operator=(const NotifySocket&) = delete;
    const std::string& path() const { return path_; }

    /// The next message (one datagram, e.g. "READY=1"), or "" when none came within `timeout`.
    std::string next(std::chrono::milliseconds timeout) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return {};
        char buf[4096];
        const auto n = ::recv(fd_, buf, sizeof buf, 0);
        return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
    }
    /// The first message that starts with `prefix`, from those read before and not taken yet
    /// or from new ones, waiting at most `timeout`; "" when none came. Messages it passes
    /// over stay for later calls.
    std::string until(const std::string& prefix, std::chrono::milliseconds timeout) {
        for (auto it = backlog_.begin(); it != backlog_.end(); ++it) {
            if (it->rfind(prefix, 0) == 0) {
                auto m = *it;
                backlog_.erase(it);
                return m;
            }
        }
        const auto end = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                end - std::chrono::steady_clock::now());
            if (left <= 0ms) return {};
            auto m = next(left);
            if (m.rfind(prefix, 0) == 0) return m;
            if (!m.empty()) backlog_.push_back(std::move(m));
        }
    }
    /// Drops every message read or waiting.
    void drain() {
        backlog_.clear();
        while (!next(0ms).empty()) {
        }
    }

private:
    std::string path_;
    int fd_ = -1;
    std::deque<std::string> backlog_;
};

std::vector<json> audit_lines(const std::filesystem::path& file) {
    std::vector<json> lines;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) lines.push_back(json::parse(line));
    return lines;
}

std::vector<json> events_named(const std::vector<json>& lines, const std::string& event) {
    std::vector<json> out;
    for (const auto& l : lines) {
        if (l.value("event", "") == event) out.push_back(l);
    }
    return out;
}

/// The value of the sample `name` (with its labels, as rendered) in a metrics text; -1 absent.
double sample(const std::string& text, const std::string& name) {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
        if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
    }
    return -1;
}

/// Whether every thread of `pid` is in the stopped state (T).
bool all_threads_stopped(pid_t pid) {
    const auto tasks = std::filesystem::path("/proc") / std::to_string(pid) / "task";
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
        if (proc_state(static_cast<pid_t>(std::stol(task.path().filename().string()))) != 'T') {
            // proc_state reads /proc/<tid>/stat, which Linux serves for thread ids too.
            return false;
        }
    }
    return !ec;
}

bool have_promtool() { return std::system("command -v promtool >/dev/null 2>&1") == 0; }

/// promtool check metrics on `text`: its exit status and output.
std::pair<int, std::string> promtool_check(const TempDir& dir, const std::string& text) {
    const auto in = dir.path() / "metrics.txt";
    const auto out = dir.path() / "promtool.out";
    std::ofstream(in) << text;
    const int rc = std::system(
        ("promtool check metrics < " + in.string() + " > " + out.string() + " 2>&1").c_str());
    std::ifstream o(out);
    std::stringstream ss;
    ss << o.rdbuf();
    return {WEXITSTATUS(rc), ss.str()};
}

}  // namespace

TEST_CASE("operations: systemd hears READY, WATCHDOG, STATUS, RELOADING and STOPPING",
          "[operations]") {
    TempDir dir;
    NotifySocket notify(dir.path());
    // A watchdog of 400 ms: a ping every 200 ms while the I/O loop turns.
    ScopedEnv socket_env("NOTIFY_SOCKET", notify.path());
    ScopedEnv watchdog_env("WATCHDOG_USEC", "400000");
    DaemonProcess d("node-a", json{{"auth", tokens()}}.dump());
    CHECK(notify.until("READY=1", 10s) == "READY=1");
    CHECK(notify.until("WATCHDOG=1", 2s) == "WATCHDOG=1");
    CHECK(notify.until("WATCHDOG=1", 2s) == "WATCHDOG=1");
    CHECK(notify.until("STATUS=", 3s) == "STATUS=0 channels, 0 leases, serving");

    // A running channel shows in the status.
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    auto open = c.call("duplexChannelOpen", open_params(lease, {"sleep", "60"}));
    CHECK(notify.until("STATUS=1 channels", 5s).rfind("STATUS=1 channels, ", 0) == 0);

    // A stopped process sends nothing: the pings come from its running loop.
    REQUIRE(::kill(d.pid(), SIGSTOP) == 0);
    REQUIRE(eventually([&] { return all_threads_stopped(d.pid()); }, 5s));
    notify.drain();
    CHECK(notify.next(600ms).empty());
    REQUIRE(::kill(d.pid(), SIGCONT) == 0);
    CHECK(notify.until("WATCHDOG=1", 2s) == "WATCHDOG=1");

    REQUIRE(::kill(d.pid(), SIGHUP) == 0);
    CHECK(notify.until("RELOADING=1", 5s) == "RELOADING=1");
    CHECK(notify.until("READY=1", 5s) == "READY=1");

    REQUIRE(::kill(d.pid(), SIGTERM) == 0);
    CHECK(notify.until("STOPPING=1", 5s) == "STOPPING=1");
    // Read on, as systemd does: a full notify socket would block the daemon's sd_notify.
    std::optional<int> code;
    for (int i = 0; i < 300 && !code; ++i) {
        notify.drain();
        code = d.wait_exit(100ms);
    }
    INFO(d.log());
    CHECK(code == 0);
}

TEMPLATE_TEST_CASE("operations: /metrics of two nodes names every family and passes promtool",
                   "[operations][multinode]", SqliteCluster) {
    TestType cluster;
    const auto config = json{{"registry", cluster.registry()},
                             {"auth", tokens()},
                             {"routing", {{"nodeTtlMs", 3000}, {"heartbeatMs", 300}}}}
                            .dump();
    DaemonProcess owner("node-1", config);
    DaemonProcess router("node-2", config);
    Client c1(owner.url(), host_token);
    Client c2(router.url(), host_token);
    const auto lease = acquire_lease(c1);
    auto local = c1.run_channel(open_params(lease, {"sh", "-c", "printf hello; printf oops >&2"}));
    REQUIRE(local.exit["exitCode"] == 0);
    auto routed = c2.run_channel(open_params(lease, {"cat"}), "0123456789");
    REQUIRE(routed.out == "0123456789");
    REQUIRE(routed.open_result["routed"] == true);
    // A refused open: a lease that does not exist.
    auto bad = lease_ref(lease);
    bad["id"] = "lse_000000000000000000000000";
    CHECK(error_reason(c1, "duplexChannelOpen", {{"lease", bad}, {"command", {"true"}}}) != "ok");
    c1.call("leaseRenew", {{"leaseId", lease["id"]}, {"ttlMs", 60000}});
    // The sweeper has passed on both nodes.
    CHECK(eventually([&] { return owner.metric("sandboxd_sweeper_passes_total") >= 1; }, 10s));

    const auto [status1, m1] = http_get(owner.address(), "/metrics", "Bearer " + test_peer_token);
    const auto [status2, m2] = http_get(router.address(), "/metrics", "Bearer " + test_peer_token);
    REQUIRE(status1 == 200);
    REQUIRE(status2 == 200);
    INFO("owner's /metrics:\n" << m1);
    INFO("router's /metrics:\n" << m2);
    for (const auto* family : {"sandboxd_build_info",
                               "sandboxd_connections",
                               "sandboxd_connections_open",
                               "sandboxd_connections_pending",
                               "sandboxd_connections_refused_total",
                               "sandboxd_send_queue_bytes",
                               "sandboxd_registry_bad_records_total",
                               "sandboxd_channel_opens_total",
                               "sandboxd_channel_open_seconds",
                               "sandboxd_channels_running",
                               "sandboxd_channel_bytes_total",
                               "sandboxd_leases",
                               "sandboxd_lease_operations_total",
                               "sandboxd_registry_call_seconds",
                               "sandboxd_registry_errors_total",
                               "sandboxd_provider_operation_seconds",
                               "sandboxd_provider_failures_total",
                               "sandboxd_plugin_worker_up",
                               "sandboxd_plugin_worker_restarts_total",
                               "sandboxd_peer_link_up",
                               "sandboxd_sweeper_passes_total",
                               "sandboxd_orphans_found_total",
                               "sandboxd_teardowns_total",
                               "sandboxd_fenced",
                               "sandboxd_limit_events_total",
                               "process_cpu_seconds_total",
                               "process_resident_memory_bytes",
                               "process_open_fds",
                               "process_start_time_seconds"}) {
        CHECK(m1.find(std::string("# TYPE ") + family + " ") != std::string::npos);
    }
    // The owner: both opens ran here, one of them forwarded over the peer link.
    CHECK(sample(m1, "sandboxd_channel_opens_total{result=\"ok\"}") == 2);
    CHECK(sample(m1, "sandboxd_channel_opens_total{result=\"LEASE_NOT_FOUND\"}") == 1);
    CHECK(sample(m1, "sandboxd_channel_open_seconds_count{route=\"local\"}") == 2);
    CHECK(sample(m1, "sandboxd_channel_bytes_total{direction=\"out\",stream=\"stdout\"}") == 15);
    CHECK(sample(m1, "sandboxd_channel_bytes_total{direction=\"out\",stream=\"stderr\"}") == 4);
    CHECK(sample(m1, "sandboxd_channel_bytes_total{direction=\"in\",stream=\"stdin\"}") == 10);
    CHECK(sample(m1, "sandboxd_connections{role=\"host\"}") == 1);
    CHECK(sample(m1, "sandboxd_connections{role=\"peer\"}") == 1);
    CHECK(sample(m1, "sandboxd_leases{status=\"active\"}") == 1);
    CHECK(sample(m1, "sandboxd_lease_operations_total{method=\"leaseAcquire\",result=\"ok\"}") ==
          1);
    CHECK(sample(m1, "sandboxd_lease_operations_total{method=\"leaseRenew\",result=\"ok\"}") == 1);
    CHECK(
        sample(m1, "sandboxd_provider_operation_seconds_count{provider=\"bwrap\",op=\"create\"}") ==
        1);
    CHECK(sample(m1, "sandboxd_provider_operation_seconds_count{provider=\"bwrap\",op=\"open\"}") ==
          2);
    CHECK(sample(m1, "sandboxd_registry_call_seconds_count{op=\"create_lease\"}") == 1);
    CHECK(sample(m1, "sandboxd_registry_errors_total") == 0);
    CHECK(sample(m1, "sandboxd_fenced") == 0);
    CHECK(sample(m1, "sandboxd_channels_running") == 0);
    CHECK(m1.find("\nsandboxd_build_info{version=\"") != std::string::npos);
    // The router: the routed open, its bytes, its link to the owner.
    CHECK(sample(m2, "sandboxd_channel_opens_total{result=\"ok\"}") == 1);
    CHECK(sample(m2, "sandboxd_channel_open_seconds_count{route=\"routed\"}") == 1);
    CHECK(sample(m2, "sandboxd_channel_bytes_total{direction=\"in\",stream=\"stdin\"}") == 10);
    CHECK(sample(m2, "sandboxd_channel_bytes_total{direction=\"out\",stream=\"stdout\"}") == 10);
    CHECK(sample(m2, "sandboxd_peer_link_up{peer=\"node-1\"}") == 1);
    // Bounded labels: no lease id anywhere.
    CHECK(m1.find(lease["id"].get<std::string>()) == std::string::npos);
    CHECK(m1.find(host_token) == std::string::npos);

    if (!have_promtool()) {
        WARN("promtool is not installed (apt-get install prometheus): the format check is skipped");
        return;
    }
    TempDir tmp;
    for (const auto* text : {&m1, &m2}) {
        const auto [rc, out] = promtool_check(tmp, *text);
        INFO("promtool: " << out);
        CHECK(rc == 0);
        CHECK(out.empty());
    }
}

TEST_CASE("operations: the audit trail follows one lease's whole life", "[operations]") {
    TempDir dir;
    const auto audit = dir.path() / "audit.jsonl";
    DaemonProcess d("node-a", json{{"auth", tokens()},
                                   {"routing", {{"nodeTtlMs", 3000}, {"heartbeatMs", 200}}},
                                   {"audit", {{"file", audit.string()}}}}
                                  .dump());
    {
        Client c(d.url(), host_token);
        const auto lease = acquire_lease(c);
        const auto id = lease["id"].get<std::string>();
        c.call("leaseRenew", {{"leaseId", id}, {"ttlMs", 60000}});
        auto run = c.run_channel(open_params(lease, {"sh", "-c", "echo secret-output; exit 3"}));
        REQUIRE(run.exit["exitCode"] == 3);
        auto bad = lease_ref(lease);
        bad["id"] = "lse_000000000000000000000000";
        CHECK(error_reason(c, "duplexChannelOpen", {{"lease", bad}, {"command", {"true"}}}) ==
              "LEASE_NOT_FOUND");
        CHECK(c.call("leaseRelease", {{"leaseId", id}})["status"] == "released");

        // A lease left to expire: the sweeper ends it.
        auto params = json{{"companyId", "acme"},
                           {"environmentId", "dev"},
                           {"provider", "bwrap"},
                           {"ttlMs", 1000}};
        const auto short_lived = c.call("leaseAcquire", params);
        const auto short_id = short_lived["id"].get<std::string>();
        // Expired in the registry, then torn down (its audit line written after the teardown).
        REQUIRE(eventually(
            [&] {
                if (c.call("leaseGet", {{"leaseId", short_id}})["status"] != "expired")
                    return false;
                for (const auto& l : events_named(audit_lines(audit), "lease.torn_down")) {
                    if (l.value("lease", "") == short_id) return true;
                }
                return false;
            },
            15s));
        const auto lines = audit_lines(audit);
        std::string all;
        for (const auto& l : lines) {
            CHECK(l.contains("time"));
            CHECK(l.contains("event"));
            CHECK(l.value("node", "") == "node-a");
            all += l.dump() + "\n";
        }
        INFO("audit:\n" << all);
        CHECK(all.find(host_token) == std::string::npos);       // never a token value
        CHECK(all.find("secret-output") == std::string::npos);  // never payload bytes

        const auto accepted = events_named(lines, "connection.accepted");
        REQUIRE_FALSE(accepted.empty());
        CHECK(accepted[0]["token"] == "host");
        CHECK(accepted[0]["peer"].get<std::string>().rfind("127.0.0.1:", 0) == 0);

        const auto of = [&](const std::string& event, const std::string& lease_id) {
            std::vector<json> out;
            for (const auto& l : events_named(lines, event)) {
                if (l.value("lease", "") == lease_id) out.push_back(l);
            }
            return out;
        };
        // Acquired, renewed, the channel, released, torn down: in that order, by the host.
        std::vector<std::string> order;
        for (const auto& l : lines) {
            if (l.value("lease", "") == id) order.push_back(l["event"]);
        }
        CHECK(order == std::vector<std::string>{"lease.acquired", "lease.renewed", "channel.opened",
                                                "channel.ended", "lease.torn_down",
                                                "lease.released"});
        for (const auto* event :
             {"lease.acquired", "lease.renewed", "lease.released", "lease.torn_down"}) {
            const auto l = of(event, id);
            REQUIRE(l.size() == 1);
            CHECK(l[0]["tenant"] == "acme");
            CHECK(l[0]["provider"] == "bwrap");
            CHECK(l[0]["actor"] == "host");
        }
        const auto opened = of("channel.opened", id);
        const auto ended = of("channel.ended", id);
        REQUIRE(opened.size() == 1);
        REQUIRE(ended.size() == 1);
        CHECK(opened[0]["token"] == "host");
        CHECK(opened[0]["argv0"] == "sh");
        // sha256 of ["sh","-c","echo secret-output; exit 3"] as compact JSON.
        CHECK(opened[0]["argvSha256"].get<std::string>().size() == 64);
        CHECK(opened[0]["pty"] == false);
        CHECK(ended[0]["channel"] == opened[0]["channel"]);
        CHECK(ended[0]["argvSha256"] == opened[0]["argvSha256"]);
        CHECK(ended[0]["outcome"] == "exited");
        CHECK(ended[0]["exitCode"] == 3);
        CHECK(ended[0]["signal"].is_null());
        CHECK(ended[0]["stdoutBytes"] == 14);
        CHECK(ended[0]["stderrBytes"] == 0);
        CHECK(ended[0]["stdinBytes"] == 0);
        CHECK(ended[0].contains("durationMs"));

        const auto refused = events_named(lines, "open.refused");
        REQUIRE(refused.size() == 1);
        CHECK(refused[0]["reason"] == "LEASE_NOT_FOUND");
        CHECK(refused[0]["lease"] == "lse_000000000000000000000000");
        CHECK(refused[0]["token"] == "host");

        const auto expired = of("lease.expired", short_id);
        REQUIRE(expired.size() == 1);
        CHECK(expired[0]["actor"] == "sweeper");
        const auto torn = of("lease.torn_down", short_id);
        REQUIRE(torn.size() == 1);
        CHECK(torn[0]["actor"] == "sweeper");
        CHECK(torn[0]["status"] == "expired");
    }
    // A wrong token: refused, its value nowhere.
    CHECK(http_get(d.address(), "/v1/ws", "Bearer not-a-token", true).first == 401);
    const auto after = audit_lines(audit);
    const auto refused = events_named(after, "connection.refused");
    REQUIRE(refused.size() == 1);
    CHECK(refused[0]["token"].is_null());
    CHECK(refused[0]["reason"] == "missing or invalid bearer token");
    std::ifstream raw(audit);
    std::stringstream text;
    text << raw.rdbuf();
    CHECK(text.str().find("not-a-token") == std::string::npos);
}

TEMPLATE_TEST_CASE("operations: a lease whose owner died is audited as orphaned by its releaser",
                   "[operations][multinode]", SqliteCluster) {
    TestType cluster;
    TempDir dir;
    const auto config = [&](const std::string& file) {
        return json{{"registry", cluster.registry()},
                    {"auth", tokens()},
                    {"routing", {{"nodeTtlMs", 1500}, {"heartbeatMs", 300}}},
                    {"audit", {{"file", (dir.path() / file).string()}}}}
            .dump();
    };
    DaemonProcess owner("node-1", config("owner.jsonl"));
    DaemonProcess other("node-2", config("other.jsonl"));
    Client c1(owner.url(), host_token);
    const auto lease = acquire_lease(c1);
    owner.kill9();
    // The other node's sweeper records the dead owner's lease as orphaned.
    REQUIRE(eventually(
        [&] {
            return !events_named(audit_lines(dir.path() / "other.jsonl"), "lease.orphaned").empty();
        },
        20s));
    const auto orphaned = events_named(audit_lines(dir.path() / "other.jsonl"), "lease.orphaned");
    REQUIRE(orphaned.size() == 1);
    CHECK(orphaned[0]["lease"] == lease["id"]);
    CHECK(orphaned[0]["actor"] == "sweeper");
    CHECK(orphaned[0]["status"] == "pending_cleanup");
    CHECK(other.metric("sandboxd_orphans_found_total") == 1);
}

TEST_CASE("operations: SIGHUP reopens the audit file after a rotation", "[operations]") {
    TempDir dir;
    const auto audit = dir.path() / "audit.jsonl";
    DaemonProcess d("node-a",
                    json{{"auth", tokens()}, {"audit", {{"file", audit.string()}}}}.dump());
    { Client c(d.url(), host_token); }
    REQUIRE(eventually(
        [&] { return !events_named(audit_lines(audit), "connection.accepted").empty(); }, 5s));
    const auto rotated = dir.path() / "audit.jsonl.1";
    std::filesystem::rename(audit, rotated);
    const auto log_before = d.log().size();
    REQUIRE(::kill(d.pid(), SIGHUP) == 0);
    REQUIRE(
        eventually([&] { return d.log().find("reloaded:", log_before) != std::string::npos; }, 5s));
    { Client c(d.url(), host_token); }
    REQUIRE(eventually(
        [&] {
            return std::filesystem::exists(audit) &&
                   events_named(audit_lines(audit), "connection.accepted").size() == 1;
        },
        5s));
    CHECK(events_named(audit_lines(rotated), "connection.accepted").size() == 1);
    CHECK((std::filesystem::status(audit).permissions() & std::filesystem::perms::all) ==
          (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
}

TEST_CASE("operations: JSON logs carry node, lease, channel and peer as fields", "[operations]") {
    DaemonProcess d("node-a", json{{"auth", tokens()}, {"log", {{"format", "json"}}}}.dump());
    Client c(d.url(), host_token);
    const auto lease = acquire_lease(c);
    auto run = c.run_channel(open_params(lease, {"true"}));
    REQUIRE(run.exit["exitCode"] == 0);
    const auto id = lease["id"].get<std::string>();
    json opened;
    REQUIRE(eventually(
        [&] {
            std::istringstream in(d.log());
            for (std::string line; std::getline(in, line);) {
                if (line.empty() || line[0] != '{') continue;
                auto j = json::parse(line);
                if (j.value("lease", "") == id && j.value("msg", "").rfind("opened:", 0) == 0) {
                    opened = j;
                    return true;
                }
            }
            return false;
        },
        5s));
    INFO(opened.dump());
    CHECK(opened["channel"] == "1");
    CHECK(opened["peer"].get<std::string>().rfind("127.0.0.1:", 0) == 0);
    CHECK(opened["msg"].get<std::string>().find("lease=") == std::string::npos);
    CHECK(opened["msg"].get<std::string>().find("(connection channel ") != std::string::npos);
    // A refused upgrade names the client's address.
    CHECK(http_get(d.address(), "/v1/ws", "Bearer wrong", true).first == 401);
    CHECK(eventually(
        [&] {
            return d.log().find("rejected an upgrade: missing or invalid bearer token") !=
                   std::string::npos;
        },
        5s));
}

TEST_CASE("operations: /readyz is not ready while bubblewrap cannot make a sandbox",
          "[operations]") {
    // A bubblewrap that fails as it does in a container without the privileges it needs. A
    // stand-in for the failure only: the real one is probed in every other test's start.
    TempDir dir;
    std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all |
                                                 std::filesystem::perms::group_exec |
                                                 std::filesystem::perms::others_exec);
    const auto fake = dir.path() / "bwrap";
    std::ofstream(fake) << "#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not "
                           "permitted' >&2\nexit 1\n";
    std::filesystem::permissions(
        fake, std::filesystem::perms::owner_all | std::filesystem::perms::group_exec |
                  std::filesystem::perms::group_read | std::filesystem::perms::others_exec |
                  std::filesystem::perms::others_read);
    DaemonProcess d("node-a",
                    json{{"auth", tokens()},
                         {"providers",
                          {{"bwrap", {{"path", fake.string()}, {"limits", {{"enforce", false}}}}}}}}
                        .dump());
    const auto [status, body] = http_get(d.address(), "/readyz");
    CHECK(status == 503);
    CHECK(body ==
          "not ready: provider bwrap not ready: cannot make a sandbox: bubblewrap exited with "
          "status 1: "
          "bwrap: Creating new namespace failed: Operation not permitted\n");
    Client c(d.url(), host_token);
    try {
        acquire_lease(c);
        FAIL("leaseAcquire succeeded with a bubblewrap that cannot make a sandbox");
    } catch (const rpc_error& e) {
        CHECK(e.data().value("reason", "") == "PROVIDER_NOT_READY");
        CHECK(std::string(e.what()).find(
                  "cannot make a sandbox on this node: bubblewrap exited with status 1") !=
              std::string::npos);
    }
    CHECK(d.log().find("bwrap provider: cannot make a sandbox on this node") != std::string::npos);
}

TEST_CASE("operations: /readyz is ready once the start-up probe made a sandbox", "[operations]") {
    DaemonProcess d("node-a", json{{"auth", tokens()}}.dump());
    CHECK(http_get(d.address(), "/readyz") == std::pair<int, std::string>(200, "ready\n"));
}

TEST_CASE("operations: a daemon confined as its systemd unit confines it runs and ends sandboxes",
          "[operations]") {
    // 4 MiB requests: room for an argv of up to 2 MiB (the supervisor's limit) in JSON.
    // The fixture keeps exactly the capabilities that the unit keeps.
    {
        std::ifstream unit(std::string(SANDBOXD_SOURCE_DIR) + "/systemd/sandboxd.service");
        std::vector<std::string> in_unit;
        std::string line;
        while (std::getline(unit, line)) {
            if (line.rfind("CapabilityBoundingSet=", 0) != 0) continue;
            std::istringstream names(line.substr(line.find('=') + 1));
            for (std::string name; names >> name;) in_unit.push_back(name);
        }
        auto in_fixture = unit_capability_names();
        std::sort(in_unit.begin(), in_unit.end());
        std::sort(in_fixture.begin(), in_fixture.end());
        CHECK(in_unit == in_fixture);
    }
    DaemonProcess d("node-a", json{{"limits", {{"maxTextMessage", 4 << 20}}}}.dump());
    d.confine_like_the_unit_for_next_start();
    d.restart();
    {
        // The unit's bounding set: no CAP_NET_ADMIN (12), no CAP_NET_BIND_SERVICE (10).
        std::ifstream status("/proc/" + std::to_string(d.pid()) + "/status");
        std::string line;
        unsigned long long bounding = ~0ULL;
        while (std::getline(status, line)) {
            if (line.rfind("CapBnd:", 0) == 0) bounding = std::stoull(line.substr(7), nullptr, 16);
        }
        CHECK((bounding & (1ULL << 12)) == 0);
        CHECK((bounding & (1ULL << 10)) == 0);
        CHECK((bounding & (1ULL << 21)) != 0);  // CAP_SYS_ADMIN kept
    }
    Client c(d.url(), d.token());
    const auto lease = acquire_lease(c);

    // 15 arguments of 100,000 bytes: a 1.5 MB request to the lease's supervisor, far above the
    // socket's default send buffer, which the daemon cannot raise without CAP_NET_ADMIN.
    std::vector<std::string> argv = {"sh", "-c",
                                     "n=0; for a; do n=$((n + ${#a})); done; echo \"$# $n\"", "sh"};
    for (char letter = 'a'; letter < 'a' + 15; ++letter) argv.emplace_back(100000, letter);
    auto big = c.run_channel(open_params(lease, argv));
    CHECK(big.out == "15 1500000\n");
    CHECK(big.exit["exitCode"] == 0);

    // Above the supervisor's 2 MiB: refused, and the lease goes on serving.
    for (char letter = 'a'; letter < 'a' + 7; ++letter) argv.emplace_back(100000, letter);
    CHECK(error_reason(c, "duplexChannelOpen", open_params(lease, argv)) == "INVALID_PARAMS");
    // Small requests still travel in the packet itself; the command's umask is its own.
    auto small = c.run_channel(open_params(lease, {"sh", "-c", "echo small; umask"}));
    CHECK(small.out == "small\n0022\n");

    // A channel still running when its lease is released: the supervisor is killed by the
    // pidfd its hello carried (ProtectProc=invisible hides the lease's processes from the
    // daemon's /proc), and nothing of the sandbox is left.
    c.send_request("duplexChannelOpen", open_params(lease, {"sleep", "600"}));
    REQUIRE(eventually([&] { return !d.channel_processes().empty(); }, 10s));
    CHECK(c.call("leaseRelease", {{"leaseId", lease["id"]}})["status"] == "released");
    CHECK(eventually([&] { return d.descendants().empty(); }, 10s));
    CHECK(d.stop() == 0);
}
