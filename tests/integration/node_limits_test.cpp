// A node that no host client can take down (issue 44, items 2 and 3): hosts that stop reading
// cannot grow the daemon (send budgets), a flood of unauthenticated connections cannot take
// its descriptors (connection caps, the auth deadline, the reserve), and a connection whose
// socket takes nothing is closed. Real daemons on 127.0.0.1:0, real bubblewrap sandboxes.
//
// The counts are reduced here; scripts/stress runs them in full:
//   SANDBOXD_STALL_CHANNELS (8; full 64) channels, pipes and PTYs, each writing
//   SANDBOXD_STALL_BYTES (256 MiB; full 1 GiB), and SANDBOXD_STALL_EXECUTES (8; full 64)
//   pipelined leaseExecute calls, on connections that do not read;
//   SANDBOXD_FLOOD_CONNECTIONS (2,000 against RLIMIT_NOFILE 1,024; full 20,000 against the
//   default limits) unauthenticated connections from several client processes.
#include "support/daemon_fixture.hpp"
#include "support/raw_ws.hpp"

#include <sandboxd/client/client.hpp>
#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string& host_token = test_host_token;

std::uint64_t env_count(const char* name, std::uint64_t fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::stoull(v) : fallback;
}

json tokens() { return host_and_peer_tokens(); }

/// The bytes that pattern_command() writes: "0123456789abcde" over and over.
constexpr std::string_view pattern = "0123456789abcde";

/// Writes `bytes` of the pattern (no newline: a PTY passes it unchanged).
std::vector<std::string> pattern_command(std::uint64_t bytes) {
    return {"sh", "-c",
            "yes " + std::string(pattern) + " | tr -d '\\n' | head -c " + std::to_string(bytes)};
}

/// Bytes per second of one channel streaming `bytes` of zeros to a host that reads at once.
double stream_rate(Client& c, const json& lease, std::uint64_t bytes) {
    const auto start = std::chrono::steady_clock::now();
    auto run =
        c.run_channel(open_params(lease, {"head", "-c", std::to_string(bytes), "/dev/zero"}));
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    REQUIRE(run.out.size() == bytes);
    return static_cast<double>(bytes) / took.count();
}

/// One channel of a stalled host, checked as it is read back.
struct Stream {
    std::uint64_t got = 0;
    bool in_order = true;
    bool exited = false;
    std::int64_t exit_code = -1;  ///< the exit's exitCode (-1: none, or not a number)
};

/// Reads everything `c` was sent for its opens `opens` (request id -> expected bytes): every
/// channel's output, credited as it arrives and checked against the pattern, and its exit.
void read_back(Client& c, const std::map<std::int64_t, std::uint64_t>& opens,
               std::map<std::uint32_t, Stream>& streams,
               std::map<std::uint32_t, std::uint64_t>& expected) {
    std::size_t exited = 0;
    while (exited < opens.size()) {
        auto ev = c.next_event();
        if (ev.type == ClientEvent::kind::response) {
            const auto id = ev.message["id"].get<std::int64_t>();
            REQUIRE(ev.message.contains("result"));
            const auto channel = ev.message["result"]["channel"].get<std::uint32_t>();
            expected[channel] = opens.at(id);
            streams[channel];
        } else if (ev.type == ClientEvent::kind::data) {
            auto& s = streams[ev.channel];
            for (std::size_t i = 0; i < ev.bytes.size() && s.in_order; ++i) {
                if (ev.bytes[i] != pattern[(s.got + i) % pattern.size()]) s.in_order = false;
            }
            s.got += ev.bytes.size();
            c.send_credit(ev.channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit") {
            auto& s = streams[ev.message["params"]["channel"].get<std::uint32_t>()];
            s.exited = true;
            const auto& code = ev.message["params"]["exitCode"];
            s.exit_code = code.is_number_integer() ? code.get<std::int64_t>() : -1;
            ++exited;
        }
    }
}

}  // namespace

TEST_CASE(
    "A host that stops reading cannot grow the daemon: its output waits in the pipes, "
    "other hosts stream, and every byte arrives in order once it reads",
    "[limits][memory]") {
    const auto channels = env_count("SANDBOXD_STALL_CHANNELS", 8);
    const auto bytes = env_count("SANDBOXD_STALL_BYTES", 256ULL << 20);
    const auto executes = env_count("SANDBOXD_STALL_EXECUTES", 8);
    constexpr std::uint64_t node_budget = 64ULL << 20;
    constexpr std::uint64_t connection_budget = 16ULL << 20;
    // ASan keeps freed blocks in a quarantine (256 MiB by default): that is the sanitizer's
    // memory, not the daemon's. A small one, so that RSS measures what the daemon holds.
    const char* asan = std::getenv("ASAN_OPTIONS");
    ScopedEnv asan_env("ASAN_OPTIONS",
                       std::string(asan ? asan : "") +
                           ":quarantine_size_mb=4:thread_local_quarantine_size_kb=256");
    json config = {
        {"auth", tokens()},
        {"limits",
         {{"sendQueueBytes", node_budget},
          {"sendQueueBytesPerConnection", connection_budget},
          {"maxOutputWindow", 1 << 30},
          {"channelsPerConnection", 1024},
          {"channelsPerNode", 4096},
          {"requestsPerConnection", 1024},
          {"idleTimeoutMs", 3 * 3600000},
          // The stalled hosts take nothing for as long as the checks below run.
          {"sendStallTimeoutMs", 3600000}}},
        {"providers",
         {{"bwrap", {{"limits", {{"defaults", {{"pids", 2048}}}, {"max", {{"pids", 4096}}}}}}}}}};
    DaemonProcess d("node-a", config.dump());
    Client host(d.url(), host_token, 120s);
    const auto lease = acquire_lease(host);
    // The unloaded rate of another host's stream, and the daemon's RSS after it (its
    // buffers made once).
    const std::uint64_t probe = 64ULL << 20;
    const double unloaded =
        std::max(stream_rate(host, lease, probe), stream_rate(host, lease, probe));
    const long baseline_kib = d.rss_kib();
    INFO("baseline RSS " << baseline_kib << " KiB, unloaded stream " << unloaded / 1e6 << " MB/s");

    // Hosts that send their opens and executes and then read nothing: four channels per
    // connection, pipes and PTYs in turn, each asking for a 1 GiB output window (so that only
    // the send budgets hold them), on a small receive buffer.
    const std::uint64_t per_connection = 4;
    std::vector<std::unique_ptr<Client>> stalled;
    std::vector<std::map<std::int64_t, std::uint64_t>> opens;
    for (std::uint64_t i = 0; i < channels; ++i) {
        if (i % per_connection == 0) {
            stalled.push_back(std::make_unique<Client>(d.url(), host_token, 300s, 64 * 1024));
            opens.emplace_back();
        }
        auto params = open_params(lease, pattern_command(bytes));
        params["outputWindow"] = 1 << 30;
        if (i % 2 == 1) params["pty"] = {{"cols", 80}, {"rows", 24}};
        opens.back()[stalled.back()->send_request("duplexChannelOpen", params)] = bytes;
    }
    Client executor(d.url(), host_token, 300s, 64 * 1024);
    // 1 MiB of byte 0x01 to stdout, then to stderr (6 bytes each once escaped in JSON).
    const std::string ones_script =
        "head -c 1048576 /dev/zero | tr '\\0' '\\1'; "
        "head -c 1048576 /dev/zero | tr '\\0' '\\1' >&2";
    std::vector<std::int64_t> execute_ids;
    for (std::uint64_t i = 0; i < executes; ++i) {
        execute_ids.push_back(executor.send_request(
            "leaseExecute",
            {{"leaseId", lease["id"]}, {"command", "sh"}, {"args", {"-c", ones_script}}}));
    }

    // Every stalled connection fills its own budget (the node's is larger than their sum
    // here), and stays there: the commands block on their pipes and PTYs.
    const std::uint64_t connections = stalled.size() + (executes > 0 ? 1 : 0);
    const double saturated =
        static_cast<double>(std::min(node_budget, connections * connection_budget));
    REQUIRE(
        eventually([&] { return d.metric("sandboxd_send_queue_bytes") >= saturated * 0.9; }, 120s));
    const long loaded_kib = d.rss_kib();
    const long bound_kib = baseline_kib + static_cast<long>(node_budget / 1024) + 32 * 1024;
    INFO("loaded RSS " << loaded_kib << " KiB, bound " << bound_kib << " KiB, queued "
                       << d.metric("sandboxd_send_queue_bytes"));
    CHECK(loaded_kib <= bound_kib);
    CHECK(d.metric("sandboxd_send_queue_bytes") <= static_cast<double>(node_budget) * 1.1);

    // Another host on the same node streams at half its unloaded rate or better.
    Client other(d.url(), host_token, 120s);
    const double loaded =
        std::max(stream_rate(other, lease, probe), stream_rate(other, lease, probe));
    INFO("loaded stream " << loaded / 1e6 << " MB/s");
    CHECK(loaded >= unloaded / 2);
    CHECK(d.rss_kib() <= bound_kib);
    CHECK(d.peak_rss_kib() <= bound_kib);

    // The readers resume: every byte arrives, in order, then the exit.
    for (std::size_t i = 0; i < stalled.size(); ++i) {
        std::map<std::uint32_t, Stream> streams;
        std::map<std::uint32_t, std::uint64_t> expected;
        read_back(*stalled[i], opens[i], streams, expected);
        for (const auto& [channel, s] : streams) {
            INFO("connection " << i << " channel " << channel);
            CHECK(s.got == expected[channel]);
            CHECK(s.in_order);
            CHECK(s.exited);
            CHECK(s.exit_code == 0);
        }
    }
    for (const auto id : execute_ids) {
        const auto result = executor.wait_response(id);
        CHECK(result["exitCode"] == 0);
        CHECK(result["stdout"].get<std::string>() == std::string(1 << 20, '\1'));
        CHECK(result["stderr"].get<std::string>() == std::string(1 << 20, '\1'));
    }
    CHECK(d.peak_rss_kib() <= bound_kib);
}

TEST_CASE(
    "A connection whose socket takes nothing is closed after sendStallTimeoutMs, and one that "
    "only gives no credit is not",
    "[limits]") {
    json config = {
        {"auth", tokens()},
        {"limits", {{"sendStallTimeoutMs", 1000}, {"sendQueueBytesPerConnection", 1 << 20}}}};
    DaemonProcess d("node-a", config.dump());
    Client host(d.url(), host_token, 60s);
    const auto lease = acquire_lease(host);

    // Gives no credit but reads: the channel waits for credit, nothing stays queued.
    Client stingy(d.url(), host_token, 60s);
    auto params = open_params(lease, {"head", "-c", "100000000", "/dev/zero"});
    params["outputWindow"] = 65536;
    const auto opened = stingy.call("duplexChannelOpen", params);
    std::uint64_t got = 0;
    while (got < 65536) {
        auto ev = stingy.next_event();
        if (ev.type == ClientEvent::kind::data) got += ev.bytes.size();
    }
    // Longer than the stall timeout, measured by a command of the node's own.
    CHECK(host.call(
              "leaseExecute",
              {{"leaseId", lease["id"]}, {"command", "sleep"}, {"args", {"2"}}})["exitCode"] == 0);
    CHECK(d.log().find("took no message for") == std::string::npos);
    CHECK(stingy.call("duplexChannelStop", {{"channel", opened["channel"]}}).is_object());

    // Reads nothing: its queue fills and its socket takes no message for a second.
    Client deaf(d.url(), host_token, 60s, 16 * 1024);
    auto flood = open_params(lease, {"head", "-c", "100000000", "/dev/zero"});
    flood["outputWindow"] = 64 << 20;
    deaf.send_request("duplexChannelOpen", flood);
    CHECK(
        eventually([&] { return d.log().find("took no message for") != std::string::npos; }, 20s));
    // The deaf host's channel was hung up with its connection; the node serves on.
    CHECK(eventually([&] { return d.metric("sandboxd_channels_running") == 0; }, 20s));
    CHECK(host.call("leaseExecute", {{"leaseId", lease["id"]}, {"command", "true"}})["exitCode"] ==
          0);
}

namespace {

/// A client process holding `count` TCP connections to `address`, each of which has sent one
/// byte of an HTTP request and nothing more, until its `release` pipe closes. It writes one
/// byte to `ready` once all are connected (or as many as the node let it have). Never returns.
[[noreturn]] void hold_connections(const std::string& address, std::uint64_t count, int ready,
                                   int release) {
    rlimit lim{};
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0) {
        lim.rlim_cur = lim.rlim_max;
        ::setrlimit(RLIMIT_NOFILE, &lim);
    }
    const auto colon = address.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
    std::vector<int> fds;
    for (std::uint64_t i = 0; i < count; ++i) {
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) break;
        if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
            (void)::send(fd, "G", 1, MSG_NOSIGNAL);
        }
        fds.push_back(fd);
    }
    const char one = 1;
    (void)::write(ready, &one, 1);
    char c = 0;
    while (::read(release, &c, 1) > 0) {
    }
    ::_exit(0);
}

}  // namespace

TEST_CASE(
    "A flood of unauthenticated connections leaves existing hosts working, and a new host "
    "connects within 1 s of its end",
    "[limits][connections]") {
    const auto flood = env_count("SANDBOXD_FLOOD_CONNECTIONS", 2000);
    const bool full = flood > 2000;
    // Reduced: a node whose descriptor limit is 1,024. Full: the default limits.
    DaemonProcess d("node-a",
                    json{{"auth", tokens()}, {"limits", {{"authTimeoutMs", 60000}}}}.dump());
    if (!full) {
        d.set_fd_limit_for_next_start(1024);
        d.restart();
    }
    INFO(d.log());
    Client host(d.url(), host_token, 60s);
    const auto lease = acquire_lease(host);

    // Several client processes hold the flood open.
    const std::uint64_t processes = std::max<std::uint64_t>(2, flood / 5000);
    int ready[2];
    int release[2];
    REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(release, O_CLOEXEC) == 0);
    std::vector<pid_t> children;
    for (std::uint64_t i = 0; i < processes; ++i) {
        const pid_t pid = ::fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            ::close(ready[0]);
            ::close(release[1]);
            hold_connections(d.address(), flood / processes, ready[1], release[0]);
        }
        children.push_back(pid);
    }
    ::close(ready[1]);
    ::close(release[0]);
    for (std::uint64_t i = 0; i < processes; ++i) {
        char c = 0;
        pollfd p{ready[0], POLLIN, 0};
        REQUIRE(::poll(&p, 1, 120000) == 1);
        REQUIRE(::read(ready[0], &c, 1) == 1);
    }
    // The node holds its cap of pending connections and refused the rest at once.
    REQUIRE(eventually(
        [&] {
            const auto log = d.log();
            return log.find("connections: at most") != std::string::npos;
        },
        5s));

    // Meanwhile the existing host works: acquire, open, execute.
    const auto second = acquire_lease(host);
    auto run = host.run_channel(open_params(second, {"echo", "through the flood"}));
    CHECK(run.out == "through the flood\n");
    CHECK(run.exit["exitCode"] == 0);
    CHECK(host.call("leaseExecute", {{"leaseId", lease["id"]}, {"command", "true"}})["exitCode"] ==
          0);
    // A new host is refused at once while the flood holds the pending places.
    CHECK_THROWS_AS(Client(d.url(), host_token, 5s), client_error);

    // The flood ends: a new host connects within 1 s.
    ::close(release[1]);
    for (const auto pid : children) ::waitpid(pid, nullptr, 0);
    ::close(ready[0]);
    const auto ended = std::chrono::steady_clock::now();
    std::unique_ptr<Client> fresh;
    while (!fresh && std::chrono::steady_clock::now() - ended < 5s) {
        try {
            fresh = std::make_unique<Client>(d.url(), host_token, 5s);
        } catch (const client_error&) {
        }
    }
    const auto took = std::chrono::steady_clock::now() - ended;
    REQUIRE(fresh);
    CHECK(took <= 1s);
    CHECK(fresh->call("leaseExecute",
                      {{"leaseId", lease["id"]}, {"command", "true"}})["exitCode"] == 0);
    CHECK(d.metric("sandboxd_connections_refused_total{limit=\"pendingConnections\"}") > 0);
}

TEST_CASE("An unauthenticated connection is closed at authTimeoutMs", "[limits][connections]") {
    DaemonProcess d("node-a",
                    json{{"auth", tokens()}, {"limits", {{"authTimeoutMs", 300}}}}.dump());
    const int fd = connect_tcp(d.address());
    REQUIRE(::send(fd, "GET /v1/ws HTTP/1.1\r\n", 21, MSG_NOSIGNAL) == 21);
    const auto start = std::chrono::steady_clock::now();
    pollfd p{fd, POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    char buf[64];
    CHECK(::read(fd, buf, sizeof buf) <= 0);  // closed, nothing answered
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(took < 5s);
    ::close(fd);
    // A host that sends its request in time is served.
    Client host(d.url(), host_token, 10s);
    CHECK(host.call("nodeList", json::object())["nodes"].size() == 1);
}
