// Exactly one exit per channel, whatever the timing (issue 15, item 1): a channel stopped,
// closed, timed out, dropped with its connection, ended by its lease's release or by the
// daemon's shutdown right after it opened gets exactly one exit (none on the wire after a
// close, as docs/protocol.md says), every process of it is gone, its slot is free, and no
// zombie, orphan or descriptor is left.
//
// Each race runs SANDBOXD_STRESS_ITERATIONS times (default 100, the CI count; the full count is
// 1,000: `scripts/stress`) on pipes and under a PTY.
//
// Processes are counted as descendants of this test process, which makes itself a child
// subreaper first: a process of the daemon's tree that loses its parent is re-parented here,
// not to the machine's init, so an orphan is counted like any other leftover.
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

int iterations() {
    const char* v = std::getenv("SANDBOXD_STRESS_ITERATIONS");
    return v && *v ? std::max(1, std::atoi(v)) : 100;
}

/// The test's own descendants: the daemons it started and everything below them, orphans
/// included (see the file comment).
std::size_t own_descendants() { return descendants_of(::getpid()).size(); }

/// The same, less a lease supervisor's warm init (the next channel's init, made ahead, named
/// "warm-init"): whether one is there at a given moment depends on when its supervisor last
/// served a request (it makes the first one right after its hello, which may come after
/// leaseAcquire's answer on a loaded machine), not on what a channel left behind.
std::size_t own_descendants_but_warm_init() {
    std::size_t n = 0;
    for (pid_t p : descendants_of(::getpid())) {
        n += read_proc_file("/proc/" + std::to_string(p) + "/comm") != "warm-init\n";
    }
    return n;
}

/// Makes this process a child subreaper; on destruction (after the daemons declared later are
/// gone) reaps what their trees left here, for at most 20 s, so that the next section starts
/// from nothing.
struct Subreaper {
    Subreaper() {
        REQUIRE(::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0);
        reap();
    }
    ~Subreaper() { reap(); }
    Subreaper(const Subreaper&) = delete;
    Subreaper& operator=(const Subreaper&) = delete;
    Subreaper(Subreaper&&) = delete;
    Subreaper& operator=(Subreaper&&) = delete;
    static void reap() {
        eventually(
            [] {
                while (::waitpid(-1, nullptr, WNOHANG) > 0) {
                }
                return own_descendants() == 0;
            },
            seconds(20));
    }
};

json channel_params(const json& lease, bool pty) {
    auto p = open_params(lease, {"cat"});
    if (pty) p["pty"] = {{"cols", 80}, {"rows", 24}};
    return p;
}

/// Exit notifications seen per channel, and every outcome.
struct ExitTally {
    std::map<std::uint32_t, int> exits;
    std::map<std::string, int> outcomes;
    void take(const ClientEvent& ev) {
        if (ev.type != ClientEvent::kind::notification) return;
        if (ev.message.value("method", "") != "duplexChannel.exit") return;
        const auto& p = ev.message["params"];
        ++exits[p["channel"].get<std::uint32_t>()];
        ++outcomes[p["outcome"].get<std::string>()];
    }
    int of(std::uint32_t channel) const {
        auto it = exits.find(channel);
        return it == exits.end() ? 0 : it->second;
    }
};

/// Reads events, counting exits, until the response to request `id`; returns that response.
json await_response(Client& c, ExitTally& tally, std::int64_t id) {
    auto is_it = [&](const ClientEvent& ev) {
        return ev.type == ClientEvent::kind::response && ev.message.value("id", json()) == id;
    };
    std::optional<json> answer;
    for (auto& ev : c.take_queued()) {
        if (!answer && is_it(ev)) {
            answer = ev.message;
        } else {
            tally.take(ev);
        }
    }
    while (!answer) {
        auto ev = c.next_event();
        if (is_it(ev)) {
            answer = ev.message;
        } else {
            tally.take(ev);
        }
    }
    return *answer;
}

/// Reads events, counting exits, until channel `ch` has had its exit.
void await_exit(Client& c, ExitTally& tally, std::uint32_t ch) {
    for (auto& ev : c.take_queued()) tally.take(ev);
    while (tally.of(ch) == 0) tally.take(c.next_event());
}

/// A request whose answer must be a success or CHANNEL_NOT_FOUND (the channel ended first).
void control(Client& c, ExitTally& tally, const std::string& method, std::uint32_t ch) {
    const auto answer = await_response(c, tally, c.send_request(method, {{"channel", ch}}));
    if (answer.contains("error")) {
        INFO(answer.dump());
        REQUIRE(answer["error"]["data"]["reason"] == "CHANNEL_NOT_FOUND");
    }
}

std::uint32_t open_channel(Client& c, ExitTally& tally, const json& params) {
    const auto answer = await_response(c, tally, c.send_request("duplexChannelOpen", params));
    INFO(answer.dump());
    REQUIRE(answer.contains("result"));
    return answer["result"]["channel"].get<std::uint32_t>();
}

/// Waits until the daemon is back at its baseline: no channel open, the test's descendants and
/// the daemon's descriptors as before, no zombie. Reports what differs when it does not get
/// there.
void require_baseline(const DaemonProcess& d, std::size_t descendants,
                      const std::vector<std::string>& fds) {
    // The descriptors first: metric() is a connection to the daemon, which holds its end for
    // a moment after the answer (eventually() waits 10 ms between its tries).
    const bool back = eventually(
        [&] {
            return d.fd_count() == fds.size() && own_descendants_but_warm_init() == descendants &&
                   d.metric("sandboxd_channels_running") == 0;
        },
        seconds(20));
    // What the daemon holds now beyond its baseline, by target (before metric() connects).
    std::vector<std::string> beyond;
    std::multiset<std::string> before(fds.begin(), fds.end());
    const std::vector<std::string> now = d.fd_targets();
    for (const auto& target : now) {
        if (auto it = before.find(target); it != before.end()) {
            before.erase(it);
        } else {
            beyond.push_back(target);
        }
    }
    INFO("fds " << now.size() << " (baseline " << fds.size() << "), descendants but a warm init "
                << own_descendants_but_warm_init() << " (baseline " << descendants
                << "), channels open " << d.metric("sandboxd_channels_running"));
    if (!back) {
        for (pid_t p : descendants_of(::getpid())) {
            const std::string line = read_proc_file("/proc/" + std::to_string(p) + "/stat");
            UNSCOPED_INFO("left: " << line.substr(0, 120));
        }
        for (const auto& target : beyond) UNSCOPED_INFO("fd beyond the baseline: " << target);
        for (const auto& target : before) UNSCOPED_INFO("fd of the baseline gone: " << target);
    }
    REQUIRE(back);
    for (pid_t p : descendants_of(::getpid())) {
        INFO("pid " << p);
        CHECK(proc_state(p) != 'Z');
    }
}

/// A round trip after the daemon is back at its baseline: every message it sent before its
/// answer has been counted.
void round_trip(Client& c, ExitTally& tally) {
    const auto answer = await_response(c, tally, c.send_request("nodeList", json::object()));
    REQUIRE(answer.contains("result"));
}

void require_one_exit_each(const ExitTally& tally, int n, const std::string& outcome) {
    CHECK(tally.exits.size() == static_cast<std::size_t>(n));
    int more_than_one = 0;
    for (const auto& [ch, count] : tally.exits) more_than_one += count != 1;
    CHECK(more_than_one == 0);
    INFO(json(tally.outcomes).dump());
    CHECK(tally.outcomes.size() == 1);
    CHECK(tally.outcomes.count(outcome) == 1);
}

/// What an audit file says about channels: per (instance, channel key) the lines opened and
/// ended, and the outcomes of the ends.
struct AuditTally {
    std::map<std::string, std::pair<int, int>> lines;  // opened, ended
    std::map<std::string, int> outcomes;
    explicit AuditTally(const std::filesystem::path& file) {
        std::ifstream in(file);
        std::string line;
        while (std::getline(in, line)) {
            const auto j = json::parse(line);
            // Only the channel lines: the audit also records connections and lease changes.
            if (j["event"] != "channel.opened" && j["event"] != "channel.ended") continue;
            const std::string key = j["instance"].get<std::string>() + "/" +
                                    std::to_string(j["channel"].get<std::uint64_t>());
            if (j["event"] == "channel.opened") ++lines[key].first;
            if (j["event"] == "channel.ended") {
                ++lines[key].second;
                ++outcomes[j["outcome"].get<std::string>()];
            }
        }
    }
    /// Channels whose lines are not exactly one opened and one ended.
    int not_one_each() const {
        int bad = 0;
        for (const auto& [key, counts] : lines) bad += counts != std::pair{1, 1};
        return bad;
    }
};

/// The audit file must show `n` channels, each opened once and ended once with `outcome`.
void require_audit(const std::filesystem::path& file, int n, const std::string& outcome) {
    const AuditTally audit(file);
    CHECK(audit.lines.size() == static_cast<std::size_t>(n));
    CHECK(audit.not_one_each() == 0);
    INFO(json(audit.outcomes).dump());
    CHECK(audit.outcomes.size() == 1);
    CHECK(audit.outcomes.count(outcome) == 1);
}

json audit_config(const TempDir& dir) {
    return {{"audit", {{"file", (dir.path() / "audit.jsonl").string()}}}};
}

}  // namespace

TEST_CASE("Stress: every race of a channel's end gives exactly one exit and leaves nothing behind",
          "[stress][channel]") {
    Subreaper subreaper;
    TempDir dir;
    const auto audit_file = dir.path() / "audit.jsonl";
    DaemonProcess daemon("node-a", audit_config(dir).dump());
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    const int n = iterations();
    const std::size_t base_descendants =
        own_descendants_but_warm_init();  // the lease's sandbox is up
    const std::vector<std::string> base_fds = daemon.fd_targets();
    ExitTally tally;

    for (const bool pty : {false, true}) {
        DYNAMIC_SECTION((pty ? "pty" : "pipes")) {
            const auto params = channel_params(lease, pty);
            SECTION("stop right after the open") {
                for (int i = 0; i < n; ++i) {
                    const auto ch = open_channel(*c, tally, params);
                    control(*c, tally, "duplexChannelStop", ch);
                    await_exit(*c, tally, ch);
                }
                require_baseline(daemon, base_descendants, base_fds);
                round_trip(*c, tally);
                require_one_exit_each(tally, n, "stopped");
                require_audit(audit_file, n, "stopped");
            }
            SECTION("close right after the open: no exit follows") {
                for (int i = 0; i < n; ++i) {
                    const auto ch = open_channel(*c, tally, params);
                    control(*c, tally, "duplexChannelClose", ch);
                }
                require_baseline(daemon, base_descendants, base_fds);
                round_trip(*c, tally);
                CHECK(tally.exits.empty());
                require_audit(audit_file, n, "stopped");
            }
            SECTION("timeoutMs 1") {
                auto timed = params;
                timed["timeoutMs"] = 1;
                for (int i = 0; i < n; ++i) {
                    const auto ch = open_channel(*c, tally, timed);
                    await_exit(*c, tally, ch);
                }
                require_baseline(daemon, base_descendants, base_fds);
                round_trip(*c, tally);
                require_one_exit_each(tally, n, "timedOut");
                require_audit(audit_file, n, "timedOut");
            }
            SECTION("the connection dropped right after the open") {
                for (int i = 0; i < n; ++i) {
                    auto other = daemon.connect();
                    ExitTally unused;
                    open_channel(*other, unused, params);
                    other.reset();  // the socket closes with no close frame
                }
                require_baseline(daemon, base_descendants, base_fds);
                require_audit(audit_file, n, "transportClosed");
            }
            SECTION("the lease released right after the open") {
                for (int i = 0; i < n; ++i) {
                    const auto own = acquire_lease(*c);
                    const auto ch = open_channel(*c, tally, channel_params(own, pty));
                    const auto answer = await_response(
                        *c, tally, c->send_request("leaseRelease", {{"leaseId", own["id"]}}));
                    INFO(answer.dump());
                    REQUIRE(answer["result"]["status"] == "released");
                    await_exit(*c, tally, ch);
                }
                require_baseline(daemon, base_descendants, base_fds);
                round_trip(*c, tally);
                require_one_exit_each(tally, n, "leaseReleased");
                require_audit(audit_file, n, "leaseReleased");
            }
        }
    }
}

TEST_CASE("Stress: SIGTERM right after an open ends within the graces, one end per channel",
          "[stress][channel][signal]") {
    // The command ignores SIGHUP and SIGTERM. With limits.drainTimeoutMs 0 the drain is over
    // at once: the channel is stopped (SIGKILL) with its exit, which is written before the
    // connection closes (1001), and the daemon exits. A bound of the graces plus 3 s for the
    // daemon's own exit (its node record removed, its sandboxes ended).
    constexpr int hangup_grace_ms = 200, drain_grace_ms = 250;
    const int n = std::max(1, iterations() / 4);
    for (const bool pty : {false, true}) {
        DYNAMIC_SECTION((pty ? "pty" : "pipes")) {
            Subreaper subreaper;
            TempDir dir;
            auto config = audit_config(dir);
            config["limits"] = {{"hangupGraceMs", hangup_grace_ms},
                                {"drainGraceMs", drain_grace_ms},
                                {"drainTimeoutMs", 0}};
            for (int i = 0; i < n; ++i) {
                DaemonProcess daemon("node-a", config.dump());
                auto c = daemon.connect();
                const auto lease = acquire_lease(*c);
                auto params = open_params(lease, {"sh", "-c", "trap '' HUP TERM; exec cat"});
                if (pty) params["pty"] = {{"cols", 80}, {"rows", 24}};
                ExitTally tally;
                open_channel(*c, tally, params);
                const auto sent = std::chrono::steady_clock::now();
                CHECK(daemon.stop() == 0);
                const auto took = std::chrono::steady_clock::now() - sent;
                CHECK(took < milliseconds(hangup_grace_ms + drain_grace_ms + 3000));
                Subreaper::reap();
                REQUIRE(own_descendants() == 0);
                // Everything the daemon sent before its close: one exit for the channel.
                for (auto& ev : c->take_queued()) tally.take(ev);
                try {
                    for (;;) tally.take(c->next_event());
                } catch (const client_error&) {
                }
                require_one_exit_each(tally, 1, "stopped");
            }
            require_audit(dir.path() / "audit.jsonl", n, "stopped");
        }
    }
}
