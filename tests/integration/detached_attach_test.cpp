// Reattaching to detached channels (issue 46, docs/protocol.md section 4.6) on real daemons,
// bubblewrap sandboxes and a shared SQLite registry: a host that drops its connection while
// 20 detached channels stream (pipes and PTY) reattaches to all of them through another node
// and reads, joined across the drop, exactly what each command wrote, and one exit each; a
// kept output that overflowed starts with a gap at the right offset; one attachment at a
// time, or a takeover; no tenant reaches another's channels; a flood stays out of the
// daemon's memory. Nothing sleeps: every wait is for an event or a state, with a bound.
#include "support/clusters.hpp"
#include "support/daemon_fixture.hpp"
#include "support/received.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <map>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

const std::string& host_token = test_host_token;

/// A command that writes `lines` numbered lines tagged `tag`, waits for a line on stdin,
/// writes as many again and exits 7. Under a PTY, without echo: the output is the lines alone.
std::vector<std::string> two_part_command(const std::string& tag, int lines, bool pty) {
    const std::string part1 = "seq -f '" + tag + "-%g' 1 " + std::to_string(lines);
    const std::string part2 =
        "seq -f '" + tag + "-%g' " + std::to_string(lines + 1) + " " + std::to_string(2 * lines);
    return {"sh", "-c",
            std::string(pty ? "stty -echo; " : "") + part1 + "; read go; " + part2 + "; exit 7"};
}

std::string expected_output(const std::string& tag, int from, int to, bool pty) {
    std::string s;
    for (int i = from; i <= to; ++i) s += tag + "-" + std::to_string(i) + (pty ? "\r\n" : "\n");
    return s;
}

json detached_open(const json& lease, std::vector<std::string> argv, const std::string& name,
                   std::uint64_t retain_bytes = 1 << 20) {
    auto p = open_params(lease, std::move(argv));
    p["detach"] = {{"retainMs", 60000}, {"retainBytes", retain_bytes}};
    p["name"] = name;
    return p;
}

}  // namespace

TEST_CASE(
    "20 detached channels reattached through another node after a drop: byte-exact, one "
    "exit each",
    "[daemon][detached][multinode]") {
    SqliteCluster cluster;
    DaemonProcess owner("node-1", cluster_config(cluster));
    DaemonProcess other("node-2", cluster_config(cluster));
    constexpr int channels = 20;
    constexpr int lines = 3000;
    auto first = std::make_unique<Client>(owner.url(), host_token);
    const auto lease = acquire_lease(*first);
    REQUIRE(lease["ownerNodeId"] == "node-1");
    std::vector<std::string> names;
    std::vector<bool> pty;
    std::map<std::string, std::uint32_t> first_id;
    for (int i = 0; i < channels; ++i) {
        names.push_back("job-" + std::to_string(i));
        pty.push_back(i % 4 == 3);  // 5 of 20 under a PTY
        auto p = detached_open(lease, two_part_command(names[i], lines, pty[i]), names[i]);
        if (pty[i]) p["pty"] = {{"cols", 80}, {"rows", 24}};
        first_id[names[i]] = first->call("duplexChannelOpen", p)["channel"].get<std::uint32_t>();
    }
    // The host reads a part of each channel's output, then its connection drops.
    Received before;
    REQUIRE(before.until(*first, [&] {
        for (const auto& [name, id] : first_id) {
            if (before.out[id].size() < 1000) return false;
        }
        return true;
    }));
    first->close();
    first.reset();

    // It comes back through the other node and reattaches each channel from what it read.
    Client second(other.url(), host_token);
    const auto listed = second.call("duplexChannelList", {{"leaseId", lease["id"]}});
    REQUIRE(listed["channels"].size() == static_cast<std::size_t>(channels));
    std::map<std::string, std::uint32_t> second_id;
    for (int i = 0; i < channels; ++i) {
        const auto& read = before.out[first_id[names[i]]];
        const auto attached = second.call("duplexChannelAttach",
                                          {{"leaseId", lease["id"]},
                                           {"name", names[i]},
                                           {"offsets", {{"stdout", read.size()}, {"stderr", 0}}}});
        CHECK(attached["routed"] == true);
        CHECK(attached["offsets"]["stdout"] == read.size());
        second_id[names[i]] = attached["channel"].get<std::uint32_t>();
    }
    Received after;
    auto has_part1 = [&] {
        for (int i = 0; i < channels; ++i) {
            const auto joined = before.out[first_id[names[i]]] + after.out[second_id[names[i]]];
            if (joined.size() < expected_output(names[i], 1, lines, pty[i]).size()) return false;
        }
        return true;
    };
    REQUIRE(after.until(second, has_part1));
    // Stdin reaches each command through its new attachment; then the second part and the exit.
    for (int i = 0; i < channels; ++i)
        second.send_stdin(second_id[names[i]], pty[i] ? "go\r" : "go\n");
    REQUIRE(after.until(
        second, [&] { return after.exits.size() == channels; }, 120s));
    // A round trip after the exits: anything more for these channels would have come first.
    second.call("duplexChannelList", {{"leaseId", lease["id"]}});
    while (auto e = second.poll_event(0ms)) after.take(second, *e);
    for (int i = 0; i < channels; ++i) {
        INFO(names[i] << (pty[i] ? " (pty)" : ""));
        const auto id = second_id[names[i]];
        CHECK(before.out[first_id[names[i]]] + after.out[id] ==
              expected_output(names[i], 1, 2 * lines, pty[i]));
        REQUIRE(after.exits[id].size() == 1);
        CHECK(after.exits[id][0]["exitCode"] == 7);
        CHECK(after.gaps[id].empty());
        CHECK(before.exits[first_id[names[i]]].empty());
    }
    const auto ended = second.call("duplexChannelList", {{"leaseId", lease["id"]}});
    for (const auto& ch : ended["channels"]) {
        CHECK(ch["state"] == "exited");
        CHECK(ch["exit"]["exitCode"] == 7);
    }
}

TEST_CASE(
    "A detached channel's kept output that overflowed starts with a gap at the first kept "
    "byte",
    "[daemon][detached]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    // 20000 numbered lines (108894 bytes), then it waits for stdin; 4096 bytes are kept.
    auto p = detached_open(lease, {"sh", "-c", "seq 1 20000; read x; echo done"}, "flood", 4096);
    p["outputWindow"] = 1024;  // the opener reads little, and never credits
    const auto opened = c->call("duplexChannelOpen", p);
    c->close();
    c.reset();
    auto again = daemon.connect();
    std::string lines;
    for (int i = 1; i <= 20000; ++i) lines += std::to_string(i) + "\n";
    REQUIRE(eventually(
        [&] {
            const auto l = again->call("duplexChannelList", {{"leaseId", lease["id"]}});
            return l["channels"][0]["offsets"]["stdout"] == lines.size();
        },
        30s));
    const auto attached = again->call(
        "duplexChannelAttach",
        {{"leaseId", lease["id"]}, {"handle", opened["handle"]}, {"offsets", {{"stdout", 0}}}});
    CHECK(attached["offsets"]["stdout"] == 0);
    const auto id = attached["channel"].get<std::uint32_t>();
    Received r;
    REQUIRE(r.until(*again, [&] { return r.out[id].size() >= 4096; }));
    REQUIRE(r.gaps[id].size() == 1);
    CHECK(r.gaps[id][0]["stream"] == "stdout");
    CHECK(r.gaps[id][0]["firstKept"] == lines.size() - 4096);
    CHECK(r.out[id] == lines.substr(lines.size() - 4096));
    again->send_stdin(id, "x\n");
    REQUIRE(r.until(*again, [&] { return !r.exits[id].empty(); }));
    CHECK(r.out[id] == lines.substr(lines.size() - 4096) + "done\n");
    CHECK(r.exits[id][0]["exitCode"] == 0);
}

TEST_CASE(
    "One attachment at a time: another is refused, a takeover ends the first and the command "
    "goes on",
    "[daemon][detached]") {
    DaemonProcess daemon;
    auto a = daemon.connect();
    auto b = daemon.connect();
    const auto lease = acquire_lease(*a);
    const auto opened = a->call("duplexChannelOpen", detached_open(lease, {"cat"}, "shell"));
    const auto a_id = opened["channel"].get<std::uint32_t>();
    const json attach = {{"leaseId", lease["id"]}, {"name", "shell"}};
    try {
        b->call("duplexChannelAttach", attach);
        FAIL("a second attachment was made without takeover");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::channel_attached);
    }
    // The refusal changed nothing: the first host still talks to the command.
    Received ra;
    a->send_stdin(a_id, "one\n");
    REQUIRE(ra.until(*a, [&] { return ra.out[a_id] == "one\n"; }));

    auto took = attach;
    took["takeover"] = true;
    const auto b_id = b->call("duplexChannelAttach", took)["channel"].get<std::uint32_t>();
    REQUIRE(ra.until(*a, [&] { return !ra.exits[a_id].empty(); }));
    CHECK(ra.exits[a_id][0]["outcome"] == "takenOver");
    CHECK(ra.exits[a_id][0]["exitCode"].is_null());
    // The command goes on for the new host, which replays from the oldest kept byte.
    Received rb;
    b->send_stdin(b_id, "two\n");
    REQUIRE(rb.until(*b, [&] { return rb.out[b_id] == "one\ntwo\n"; }));
    CHECK(a->call("duplexChannelList", {{"leaseId", lease["id"]}})["channels"][0]["state"] ==
          "running");
    // The first host's channel has ended for it; the second one stops the command.
    CHECK(error_reason(*a, "duplexChannelSignal", {{"channel", a_id}, {"signal", "INT"}}) ==
          "CHANNEL_NOT_FOUND");
    b->call("duplexChannelStop", {{"channel", b_id}});
    REQUIRE(rb.until(*b, [&] { return !rb.exits[b_id].empty(); }));
    CHECK(rb.exits[b_id][0]["outcome"] == "stopped");
    CHECK(rb.exits[b_id].size() == 1);
}

TEST_CASE("No tenant reaches another tenant's detached channels", "[daemon][detached]") {
    const std::string config = json{{"auth",
                                     {{"tokens",
                                       {{{"name", "acme-host"},
                                         {"token", "acme-secret"},
                                         {"role", "host"},
                                         {"tenants", {"acme"}}},
                                        {{"name", "globex-host"},
                                         {"token", "globex-secret"},
                                         {"role", "host"},
                                         {"tenants", {"globex"}}}}}}}}
                                   .dump();
    DaemonProcess daemon("node-a", config);
    Client acme(daemon.url(), "acme-secret");
    Client globex(daemon.url(), "globex-secret");
    const auto lease = acquire_lease(acme);
    const auto opened =
        acme.call("duplexChannelOpen", detached_open(lease, {"sleep", "6463"}, "private"));
    const auto theirs = globex.call(
        "leaseAcquire", {{"companyId", "globex"}, {"environmentId", "dev"}, {"provider", "bwrap"}});
    for (const json& p :
         {json{{"leaseId", lease["id"]}, {"name", "private"}},
          json{{"leaseId", lease["id"]}, {"handle", opened["handle"]}},
          json{{"leaseId", lease["id"]}, {"handle", opened["handle"]}, {"takeover", true}}}) {
        INFO(p.dump());
        CHECK(error_reason(globex, "duplexChannelAttach", p) == "LEASE_NOT_FOUND");
    }
    CHECK(error_reason(globex, "duplexChannelList", {{"leaseId", lease["id"]}}) ==
          "LEASE_NOT_FOUND");
    // Its own lease does not lend it the other's handle.
    CHECK(error_reason(globex, "duplexChannelAttach",
                       {{"leaseId", theirs["id"]}, {"handle", opened["handle"]}}) ==
          "CHANNEL_NOT_FOUND");
    CHECK(globex.call("duplexChannelList", {{"leaseId", theirs["id"]}})["channels"].empty());
    CHECK(acme.call("duplexChannelList", {{"leaseId", lease["id"]}})["channels"][0]["attached"] ==
          true);
    acme.call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(eventually([] { return count_processes_with("sleep 6463") == 0; }, 20s));
    // The channel ended with its lease, and so did its entry.
    CHECK(error_reason(acme, "duplexChannelAttach",
                       {{"leaseId", lease["id"]}, {"name", "private"}}) == "CHANNEL_NOT_FOUND");
}

TEST_CASE("A detached channel that floods its kept output does not grow the daemon",
          "[daemon][detached][memory]") {
    const ScopedEnv asan = measure_memory_env();
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    const long baseline = daemon.rss_kib();
    // 512 MiB through a 64 MiB kept output, nobody attached.
    constexpr std::uint64_t flood = 512ULL << 20;
    c->call("duplexChannelOpen",
            detached_open(lease, {"head", "-c", std::to_string(flood), "/dev/zero"}, "flood",
                          64ULL << 20));
    c->close();
    c.reset();
    auto again = daemon.connect();
    REQUIRE(eventually(
        [&] {
            const auto l = again->call("duplexChannelList", {{"leaseId", lease["id"]}});
            return l["channels"][0]["state"] == "exited";
        },
        120s));
    const auto l = again->call("duplexChannelList", {{"leaseId", lease["id"]}});
    CHECK(l["channels"][0]["offsets"]["stdout"] == flood);
    CHECK(l["channels"][0]["firstKept"]["stdout"] == flood - (64ULL << 20));
    INFO("baseline " << baseline << " KiB, peak " << daemon.peak_rss_kib() << " KiB");
    if (rss_is_meaningful) CHECK(daemon.peak_rss_kib() <= baseline + 32 * 1024);
}

TEST_CASE("A lease's detached output is bounded: an open past it is refused before it starts",
          "[daemon][detached]") {
    const std::string config =
        json{{"limits", {{"detachRetainBytes", 4096}, {"detachKeptBytesPerLease", 16384}}}}.dump();
    DaemonProcess daemon("node-a", config);
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    c->call("duplexChannelOpen", detached_open(lease, {"sleep", "6464"}, "a", 4096));
    c->call("duplexChannelOpen", detached_open(lease, {"sleep", "6464"}, "b", 4096));
    REQUIRE(eventually([] { return count_processes_with("sleep 6464") == 2; }, 20s));
    try {
        c->call("duplexChannelOpen", detached_open(lease, {"sleep", "6465"}, "c", 4096));
        FAIL("a third detached channel went past the lease's budget");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::channel_limit);
        CHECK(e.data().value("limit", "") == "detachKeptBytesPerLease");
    }
    CHECK(count_processes_with("sleep 6465") == 0);  // nothing started
    // Another lease has a budget of its own; an undetached channel needs none.
    const auto other = acquire_lease(*c);
    c->call("duplexChannelOpen", detached_open(other, {"sleep", "6466"}, "a", 4096));
    c->call("duplexChannelOpen", open_params(lease, {"sleep", "6467"}));
    CHECK(eventually([] { return count_processes_with("sleep 6466") == 1; }, 20s));
    CHECK(eventually([] { return count_processes_with("sleep 6467") == 1; }, 20s));
}

TEST_CASE("Ended detached channels hold no descriptors, and a lease keeps a bounded number",
          "[daemon][detached]") {
    // 40 detached channels end at once with 10 minutes of retention each: the daemon keeps
    // the exits of the last 16 (limits.detachKeptExitsPerLease) and no descriptor for any of
    // them, so no tenant can run the node out of descriptors or memory with ended channels.
    const std::string config = json{{"limits",
                                     {{"detachRetainBytes", 4096},
                                      {"detachKeptBytesPerLease", 1 << 20},
                                      {"detachKeptExitsPerLease", 16}}}}
                                   .dump();
    DaemonProcess daemon("node-a", config);
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    // A first channel that ended: what the daemon holds with nothing detached running.
    c->call("duplexChannelOpen", detached_open(lease, {"true"}, "warm", 4096));
    Received got;
    REQUIRE(got.until(*c, [&] { return got.exits.size() == 1; }));
    const auto fds_before = daemon.fd_count();
    constexpr int count = 40;
    for (int i = 0; i < count; ++i) {
        c->call("duplexChannelOpen", detached_open(lease, {"sh", "-c", "echo " + std::to_string(i)},
                                                   "ended-" + std::to_string(i), 4096));
    }
    REQUIRE(got.until(*c, [&] { return got.exits.size() == count + 1; }));
    c->close();
    c.reset();
    auto again = daemon.connect();
    const auto listed = again->call("duplexChannelList", {{"leaseId", lease["id"]}});
    REQUIRE(listed["channels"].size() == 16);
    // The oldest were forgotten first: the last 16 are kept, in order, with their output.
    for (int i = 0; i < 16; ++i) {
        const auto& ch = listed["channels"][i];
        CHECK(ch["name"] == "ended-" + std::to_string(count - 16 + i));
        CHECK(ch["state"] == "exited");
        CHECK(ch["exit"]["exitCode"] == 0);
    }
    const auto fds_after = daemon.fd_count();
    INFO("descriptors before " << fds_before << ", after " << fds_after);
    CHECK(fds_after <= fds_before + 4);
    // A kept one replays from its files, reopened for the attachment.
    auto attached =
        again->call("duplexChannelAttach", {{"leaseId", lease["id"]}, {"name", "ended-39"}});
    const auto id = attached["channel"].get<std::uint32_t>();
    Received replay;
    REQUIRE(replay.until(*again, [&] { return replay.exits.count(id) == 1; }));
    CHECK(replay.out[id] == "39\n");
    CHECK(replay.exits[id][0]["exitCode"] == 0);
    // A forgotten one's name is free again; its attach says it is not kept.
    CHECK(error_reason(*again, "duplexChannelAttach",
                       {{"leaseId", lease["id"]}, {"name", "ended-0"}}) == "CHANNEL_NOT_FOUND");
    again->call("duplexChannelOpen", detached_open(lease, {"true"}, "ended-0", 4096));
    CHECK(eventually([&] { return daemon.fd_count() <= fds_before + 4; }, 20s));
}

TEST_CASE("A detached channel with hangupAfterMs is hung up once no host is attached for that long",
          "[daemon][detached]") {
    DaemonProcess daemon("node-a");
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    // It says when it is hung up (the trap runs on SIGHUP), then exits on its own.
    auto p = detached_open(lease,
                           {"sh", "-c",
                            "trap 'echo hung-up >&2; exit 3' HUP; echo up; "
                            "while :; do sleep 0.05; done"},
                           "idle");
    p["detach"]["hangupAfterMs"] = 1000;
    const auto opened = c->call("duplexChannelOpen", p);
    const auto id = opened["channel"].get<std::uint32_t>();
    Received got;
    REQUIRE(got.until(*c, [&] { return got.out[id] == "up\n"; }));
    const auto dropped_at = std::chrono::steady_clock::now();
    c->close();
    c.reset();
    auto again = daemon.connect();
    json entry;
    REQUIRE(eventually(
        [&] {
            entry = again->call("duplexChannelList", {{"leaseId", lease["id"]}})["channels"][0];
            return entry["state"] == "exited";
        },
        30s));
    CHECK(std::chrono::steady_clock::now() - dropped_at >= 1000ms);
    CHECK(entry["exit"]["outcome"] == "transportClosed");
    CHECK(entry["exit"]["exitCode"] == 3);
    // Its output up to the hangup is kept, and its trap's line (written after it) is not.
    CHECK(entry["offsets"]["stdout"] == 3);
    auto attached =
        again->call("duplexChannelAttach", {{"leaseId", lease["id"]}, {"name", "idle"}});
    const auto replay_id = attached["channel"].get<std::uint32_t>();
    Received replay;
    REQUIRE(replay.until(*again, [&] { return replay.exits.count(replay_id) == 1; }));
    CHECK(replay.out[replay_id] == "up\n");
    CHECK(replay.exits[replay_id][0]["outcome"] == "transportClosed");
}
