// The project's acceptance cases (B01, B02, ...: a case list kept outside this repository) that
// apply to one node: one TEST_CASE per case, tagged [cases][Bnn]. Each drives the real daemon
// (127.0.0.1:0, real bubblewrap) and asserts exact bytes, exit codes, outcomes and error reasons.
//
// Repetition counts are reduced by default to keep CI fast; SANDBOXD_FULL_CASES=1 runs the
// counts that the cases prescribe. Waits are bounded: on bytes or events from the daemon, or
// (for outside processes and /proc) by polling with `eventually`. A sleep appears only where a
// case prescribes client behaviour (a reader that pauses or reads slowly, a header sent in
// pieces).
//
// Process checks run on the host with unique markers (e.g. `sleep 6091`): the command runs in
// its own PID namespace, so `ps` in a new channel would only see that channel, and other test
// files (run in parallel by ctest -j) use markers of their own.
#include "support/daemon_fixture.hpp"
#include "support/raw_ws.hpp"
#include "support/sha256.hpp"

#include <sandboxd/client/client_impl.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <thread>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

namespace {

bool full_cases() {
    const char* v = std::getenv("SANDBOXD_FULL_CASES");
    return v != nullptr && std::string(v) == "1";
}

/// `reduced` by default, `full` (the count the case prescribes) with SANDBOXD_FULL_CASES=1.
int reps(int reduced, int full) { return full_cases() ? full : reduced; }

long long ms_since(steady::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(steady::now() - t).count();
}

json with_pty(json params, int cols, int rows) {
    params["pty"] = {{"cols", cols}, {"rows", rows}};
    return params;
}

std::uint32_t open_channel(Client& c, const json& params) {
    return c.call("duplexChannelOpen", params)["channel"].get<std::uint32_t>();
}

/// "1\n2\n...n\n", the output of `seq 1 n`.
std::string seq_text(int n) {
    std::string s;
    for (int i = 1; i <= n; ++i) {
        s += std::to_string(i);
        s += '\n';
    }
    return s;
}

/// "<prefix>0\n<prefix>1\n...", `count` lines.
std::string numbered(const std::string& prefix, int count) {
    std::string s;
    for (int i = 0; i < count; ++i) s += prefix + std::to_string(i) + "\n";
    return s;
}

std::string last_line(const std::string& text) {
    if (text.empty()) return {};
    const auto end = text.back() == '\n' ? text.size() - 1 : text.size();
    const auto start = text.rfind('\n', end - 1);
    return text.substr(start == std::string::npos ? 0 : start + 1,
                       end - (start == std::string::npos ? 0 : start + 1));
}

/// Called for every output chunk of the channel, before it is credited; false stops reading.
using Hook = std::function<bool(const ClientEvent&, const ChannelRun&)>;

/// Reads the channel's messages (those kept back first), crediting output, until its exit (or
/// until `hook` says stop). Other messages are handed back to the client's queue.
ChannelRun collect(Client& c, std::uint32_t channel, const Hook& hook = {}) {
    ChannelRun run;
    run.channel = channel;
    std::deque<ClientEvent> others;
    bool go = true;
    auto handle = [&](ClientEvent& ev) {
        const bool mine = ev.type == ClientEvent::kind::notification
                              ? ev.message["params"].value("channel", 0U) == channel
                              : ev.type != ClientEvent::kind::response && ev.channel == channel;
        if (!mine) {
            others.push_back(std::move(ev));
            return;
        }
        if (!run.exit.is_null()) {
            ++run.messages_after_exit;
            return;
        }
        if (ev.type == ClientEvent::kind::data) {
            (ev.stream == stream_id::stderr_ ? run.err : run.out) += ev.bytes;
            if (hook && !hook(ev, run)) {
                go = false;
                return;
            }
            c.send_credit(channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::notification) {
            const auto& p = ev.message["params"];
            const auto method = ev.message.value("method", "");
            if (method == "duplexChannel.exit") {
                run.exit = p;
            } else if (method == "duplexChannel.data") {
                const auto bytes = base64_decode(p["chunk"].get<std::string>());
                const bool err = p["stream"] == "stderr";
                (err ? run.err : run.out) += bytes;
                ClientEvent data;
                data.type = ClientEvent::kind::data;
                data.channel = channel;
                data.stream = err ? stream_id::stderr_ : stream_id::stdout_;
                data.bytes = bytes;
                if (hook && !hook(data, run)) {
                    go = false;
                    return;
                }
                c.send_credit(channel, data.stream, static_cast<std::uint32_t>(bytes.size()));
            }
        }
    };
    for (auto& ev : c.take_queued()) {
        if (go && run.exit.is_null()) {
            handle(ev);
        } else {
            others.push_back(std::move(ev));
        }
    }
    while (go && run.exit.is_null()) {
        auto ev = c.next_event();
        handle(ev);
    }
    for (auto& ev : others) c.impl().pending.push_back(std::move(ev));
    return run;
}

/// Proves that nothing of a finished channel follows its exit: a request's response comes
/// after everything the daemon queued before it, so whatever is kept back meanwhile came
/// after the exit.
void expect_nothing_after_exit(Client& c) {
    c.call("initialize", {{"protocolVersion", 1}});
    auto stray = c.take_queued();
    INFO("first stray message: " << (stray.empty() ? json() : stray.front().message).dump()
                                 << " bytes=" << (stray.empty() ? "" : stray.front().bytes));
    CHECK(stray.empty());
}

/// Opens every channel of `params` at once (pipelined), then reads until every exit.
std::vector<ChannelRun> run_batch(Client& c, const std::vector<json>& params) {
    std::map<std::int64_t, std::size_t> by_request;
    for (std::size_t i = 0; i < params.size(); ++i) {
        by_request[c.send_request("duplexChannelOpen", params[i])] = i;
    }
    std::vector<ChannelRun> runs(params.size());
    std::map<std::uint32_t, std::size_t> by_channel;
    std::size_t ended = 0;
    while (ended < params.size()) {
        auto ev = c.next_event();
        if (ev.type == ClientEvent::kind::response) {
            auto it = by_request.find(ev.message.value("id", std::int64_t{-1}));
            REQUIRE(it != by_request.end());
            auto& run = runs[it->second];
            if (ev.message.contains("error")) {
                run.exit = {{"openError", ev.message["error"]}};
                ++ended;
                continue;
            }
            run.open_result = ev.message["result"];
            run.channel = run.open_result["channel"].get<std::uint32_t>();
            by_channel[run.channel] = it->second;
        } else if (ev.type == ClientEvent::kind::data) {
            auto it = by_channel.find(ev.channel);
            REQUIRE(it != by_channel.end());  // the open result precedes the first data frame
            auto& run = runs[it->second];
            (ev.stream == stream_id::stderr_ ? run.err : run.out) += ev.bytes;
            c.send_credit(ev.channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit") {
            const auto ch = ev.message["params"].value("channel", 0U);
            auto it = by_channel.find(ch);
            REQUIRE(it != by_channel.end());
            runs[it->second].exit = ev.message["params"];
            ++ended;
        }
    }
    return runs;
}

/// Resets the client's TCP connection (RST, no WebSocket close).
void hard_drop(std::unique_ptr<Client>& c) {
    auto& socket = beast::get_lowest_layer(c->impl().ws).socket();
    beast::error_code ec;
    socket.set_option(net::socket_base::linger(true, 0), ec);
    socket.close(ec);
    c.reset();
}

std::size_t count_lines_with(const std::string& text, const std::string& needle) {
    std::size_t n = 0;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) n += line.find(needle) != std::string::npos ? 1 : 0;
    return n;
}

std::size_t ptys_held(const DaemonProcess& d) {
    std::size_t n = 0;
    for (const auto& t : d.fd_targets())
        n += (t == "/dev/ptmx" || t.rfind("/dev/pts/", 0) == 0) ? 1 : 0;
    return n;
}

/// Waits (bounded) until the processes whose command line starts with `needle` have ended or
/// stopped writing (their written byte count unchanged for 0.5 s): the daemon's memory for
/// their channels has settled.
bool wait_until_quiet(const std::string& needle, std::chrono::milliseconds timeout) {
    long long last = -1;
    int stable = 0;
    return eventually(
        [&] {
            const auto pids = pids_with(needle);
            if (pids.empty()) return true;
            const auto now = proc_io_field(pids.front(), "wchar");
            stable = now == last ? stable + 1 : 0;
            last = now;
            return stable >= 50;
        },
        timeout);
}

/// Waits (bounded) for one readable byte on `fd`.
bool wait_byte(int fd, std::chrono::milliseconds timeout) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
    char b = 0;
    return ::read(fd, &b, 1) == 1;
}

constexpr const char* seq_2m_sha =
    "d2d7c0abc3eb76d91b0b5a2702e92a9f2908269c9c1b3604bdfe2521c71d6274";
constexpr const char* seq_200k_sha =
    "5af7b95208fdcff454bab3f5eddf567a688a3796c703d4fef91072e38645c062";

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("cases: B02: seq output through a slow or dropped link is exact or never a success",
          "[cases][B02]") {
    const int runs = reps(1, 20);
    static const std::string expected = seq_text(2000000);
    REQUIRE(expected.size() == 14888896);
    REQUIRE(sha256_hex(expected) == seq_2m_sha);
    DaemonProcess daemon;
    auto control = daemon.connect();
    const auto lease = acquire_lease(*control);
    const auto params = open_params(lease, {"sh", "-c", "seq 1 2000000; exit 0"});
    auto expect_exact = [&](Client& c, const ChannelRun& run) {
        CHECK(run.out.size() == 14888896);
        CHECK(sha256_hex(run.out) == seq_2m_sha);
        const bool same = run.out == expected;
        CHECK(same);
        CHECK(last_line(run.out) == "2000000");
        CHECK(run.err.empty());
        CHECK(run.exit["exitCode"] == 0);
        CHECK(run.exit["outcome"] == "exited");
        CHECK(run.exit["stdoutBytes"] == 14888896);
        expect_nothing_after_exit(c);
    };

    SECTION("variant 1: read at 256 KiB/s for 2 s, then at full speed") {
        for (int i = 0; i < runs; ++i) {
            auto c = daemon.connect();
            const auto ch = open_channel(*c, params);
            const auto start = steady::now();
            auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
                if (steady::now() - start < 2s) {
                    // Client behaviour of the case, not synchronisation: pace the reader.
                    std::this_thread::sleep_until(
                        start + std::chrono::microseconds(r.out.size() * 1000000 / (256 * 1024)));
                }
                return true;
            });
            expect_exact(*c, run);
        }
    }
    SECTION("variant 2: a 4 KiB TCP receive buffer for the whole run") {
        for (int i = 0; i < runs; ++i) {
            auto c = std::make_unique<Client>(daemon.url(), daemon.token(), 60s, 4096);
            const auto ch = open_channel(*c, params);
            auto run = collect(*c, ch);
            expect_exact(*c, run);
        }
    }
    SECTION("variant 3: the connection is hard-dropped at 50 %") {
        for (int i = 0; i < runs; ++i) {
            auto c = daemon.connect();
            const auto ch = open_channel(*c, params);
            auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
                return r.out.size() < expected.size() / 2;
            });
            REQUIRE(run.exit.is_null());  // no exit before the drop
            const bool prefix = run.out == expected.substr(0, run.out.size());
            CHECK(prefix);
            hard_drop(c);
            CHECK(eventually([] { return count_processes_with("seq 1 2000000") == 0; }, 10s));
            // Reconnecting and asking about the channel gets an explicit error.
            auto again = daemon.connect();
            CHECK(error_reason(*again, "duplexChannelSignal",
                               {{"channel", ch}, {"signal", "INT"}}) == "CHANNEL_NOT_FOUND");
        }
        // The daemon never logs such a channel as a clean success.
        CHECK(eventually(
            [&] {
                return count_lines_with(daemon.log(), "ended: outcome=transportClosed") ==
                       static_cast<std::size_t>(runs);
            },
            10s));
        CHECK(count_lines_with(daemon.log(), "ended: outcome=exited") == 0);
    }
}

TEST_CASE("cases: memory: a channel's memory is bounded by its windows whatever the host does",
          "[cases][memory]") {
    const auto memory_env = measure_memory_env();
    DaemonProcess daemon;
    auto control = daemon.connect();
    const auto lease = acquire_lease(*control);
    const long before = daemon.rss_kib();
    REQUIRE(before > 0);

    SECTION("output: head -c 100000000 /dev/zero to a client that never reads") {
        auto c = daemon.connect();
        const auto result = c->call("duplexChannelOpen",
                                    open_params(lease, {"head", "-c", "100000000", "/dev/zero"}));
        const std::uint64_t window = result["outputWindow"].get<std::uint64_t>();
        CHECK(window == 1 << 20);
        // The command blocks once the daemon stops reading: its written byte count settles.
        std::vector<pid_t> head;
        REQUIRE(eventually([&] { return !(head = pids_with("head -c 100000000")).empty(); }, 10s));
        long long last = -1;
        int stable = 0;
        REQUIRE(eventually(
            [&] {
                const auto now = proc_io_field(head.front(), "wchar");
                stable = now == last ? stable + 1 : 0;
                last = now;
                return stable >= 50;  // unchanged for 0.5 s
            },
            20s));
        // The output window (read buffers included) + what the pipe holds, nothing more.
        const long long pipe = pipe_capacity(head.front(), 1);
        REQUIRE(pipe > 0);
        INFO("written " << last << ", window " << window << ", pipe " << pipe);
        CHECK(last <= static_cast<long long>(window) + pipe);
        const long growth = daemon.peak_rss_kib() - before;
        INFO("RSS growth " << growth << " KiB");
        if (rss_is_meaningful) CHECK(growth < static_cast<long>(window / 1024 + 16 * 1024));
        c.reset();
        CHECK(eventually([] { return count_processes_with("head -c 100000000") == 0; }, 10s));
    }
    SECTION("stdin: a full window to a command that never reads, then one byte more") {
        auto c = daemon.connect();
        const auto result = c->call("duplexChannelOpen", open_params(lease, {"sleep", "6092"}));
        const auto ch = result["channel"].get<std::uint32_t>();
        const std::uint64_t window = result["stdinWindow"].get<std::uint64_t>();
        const std::string chunk(64 * 1024, 'x');
        for (std::uint64_t sent = 0; sent < window; sent += chunk.size()) c->send_stdin(ch, chunk);
        // The pipe takes 64 KiB, which the daemon credits back; then its writes block and the
        // rest of the window stays queued in the daemon.
        std::uint64_t credited = 0;
        while (credited < 65536) {
            auto ev = c->next_event();
            if (ev.type == ClientEvent::kind::credit && ev.channel == ch) credited += ev.credit;
        }
        CHECK(credited == 65536);
        c->call("initialize", {{"protocolVersion", 1}});  // every frame above has been read
        const long growth = daemon.peak_rss_kib() - before;
        INFO("RSS growth " << growth << " KiB");
        if (rss_is_meaningful) CHECK(growth < static_cast<long>(window / 1024 + 16 * 1024));
        // One byte over the window ends the channel with FLOW_CONTROL.
        c->send_stdin(ch, std::string(credited + 1, 'y'));
        auto run = collect(*c, ch);
        CHECK(run.exit["outcome"] == "error");
        CHECK(run.exit["error"]["data"]["reason"] == "FLOW_CONTROL");
        CHECK(eventually([] { return count_processes_with("sleep 6092") == 0; }, 5s));
    }
}

TEST_CASE("cases: B03: the exit status never overtakes output", "[cases][B03]") {
    const int runs = reps(50, 1000);
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("variant 1: stdout and stderr") {
        const auto params = open_params(lease, {"sh", "-c", "printf abc; printf def >&2; exit 9"});
        int mismatches = 0;
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(params);
            const bool ok = run.out == "abc" && run.err == "def" && run.exit["exitCode"] == 9 &&
                            run.exit["outcome"] == "exited" && run.messages_after_exit == 0 &&
                            c->take_queued().empty();
            if (!ok) {
                ++mismatches;
                UNSCOPED_INFO("run " << i << ": out=" << run.out << " err=" << run.err
                                     << " exit=" << run.exit.dump());
            }
        }
        CHECK(mismatches == 0);
        expect_nothing_after_exit(*c);
    }
    SECTION("variant 2: output of a subshell") {
        const auto params = open_params(lease, {"sh", "-c", "(printf tail-from-subshell); exit 9"});
        int mismatches = 0;
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(params);
            const bool ok = run.out == "tail-from-subshell" && run.err.empty() &&
                            run.exit["exitCode"] == 9 && run.messages_after_exit == 0 &&
                            c->take_queued().empty();
            if (!ok) {
                ++mismatches;
                UNSCOPED_INFO("run " << i << ": out=" << run.out << " exit=" << run.exit.dump());
            }
        }
        CHECK(mismatches == 0);
        expect_nothing_after_exit(*c);
    }
}

TEST_CASE("cases: B04: an unterminated last line and a trailing CRLF are preserved",
          "[cases][B04]") {
    const int runs = reps(50, 500);
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("A: pipes, no newline at the end") {
        const auto params = open_params(lease, {"sh", "-c", "printf 'line1\\nno-newline-tail'"});
        int mismatches = 0;
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(params);
            if (run.out != "line1\nno-newline-tail" || run.exit["exitCode"] != 0) {
                ++mismatches;
                UNSCOPED_INFO("run " << i << ": out=" << run.out << " exit=" << run.exit.dump());
            }
        }
        CHECK(mismatches == 0);
    }
    SECTION("B: a PTY at 80x24, onlcr applies") {
        const auto params =
            with_pty(open_params(lease, {"sh", "-c", "printf 'The answer\\n0\\n'"}), 80, 24);
        int mismatches = 0;
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(params, "", false);
            if (run.out != "The answer\r\n0\r\n" || run.exit["exitCode"] != 0) {
                ++mismatches;
                UNSCOPED_INFO("run " << i << ": out=" << run.out << " exit=" << run.exit.dump());
            }
        }
        CHECK(mismatches == 0);
    }
    expect_nothing_after_exit(*c);
}

TEST_CASE("cases: B06: a channel opened without stdin lives as long as its command",
          "[cases][B06]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    auto no_stdin = [&](std::vector<std::string> argv) {
        auto p = open_params(lease, std::move(argv));
        p["stdin"] = false;
        return p;
    };
    SECTION("case 1: output across two seconds") {
        const auto start = steady::now();
        const auto ch = open_channel(
            *c, no_stdin({"sh", "-c", "echo one; sleep 1; echo two; sleep 1; echo three; exit 6"}));
        bool exit_before_three = false;
        auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
            exit_before_three = exit_before_three || !r.exit.is_null();
            return true;
        });
        const auto elapsed = ms_since(start);
        CHECK(run.out == "one\ntwo\nthree\n");
        CHECK(run.exit["exitCode"] == 6);
        CHECK(run.exit["outcome"] == "exited");
        CHECK_FALSE(exit_before_three);
        CHECK(elapsed >= 2000);
        CHECK(elapsed <= 3000);
        expect_nothing_after_exit(*c);
    }
    SECTION("case 2: cat reads EOF at once") {
        const auto start = steady::now();
        auto run = c->run_channel(no_stdin({"cat"}), "", false);
        CHECK(ms_since(start) < 1000);
        CHECK(run.out.empty());
        CHECK(run.exit["exitCode"] == 0);
    }
    SECTION("case 3: read gets EOF") {
        const auto start = steady::now();
        auto run = c->run_channel(no_stdin({"sh", "-c", "read x; echo \"got[$x]\""}), "", false);
        CHECK(ms_since(start) < 1000);
        CHECK(run.out == "got[]\n");
        CHECK(run.exit["exitCode"] == 0);
    }
    SECTION("writing to a running channel opened without stdin is INVALID_PARAMS") {
        const auto ch = open_channel(*c, no_stdin({"sleep", "6061"}));
        CHECK(error_reason(*c, "duplexChannelWrite", {{"channel", ch}, {"data", "eA=="}}) ==
              "INVALID_PARAMS");
        c->call("duplexChannelStop", {{"channel", ch}});
        auto run = collect(*c, ch);
        CHECK(run.exit["outcome"] == "stopped");
    }
}

TEST_CASE("cases: B08: binary data is byte-exact on stdout, stderr and stdin", "[cases][B08]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    std::string every;
    for (int i = 0; i < 256; ++i) every.push_back(static_cast<char>(i));

    SECTION("case 1: stdout carries 00..FF") {
        for (const char* encoding : {"binary", "base64"}) {
            auto p = open_params(lease,
                                 {"sh", "-c",
                                  "i=0; while [ $i -lt 256 ]; do printf \"\\\\$(printf %03o $i)\"; "
                                  "i=$((i+1)); done"});
            p["dataEncoding"] = encoding;
            auto run = c->run_channel(p);
            INFO("dataEncoding " << encoding);
            CHECK(run.out.size() == 256);
            CHECK(run.out == every);
            CHECK(sha256_hex(run.out) ==
                  "40aff2e9d2d8922e47afd4648e6967497158785fbd1da870e7110266bf944880");
            CHECK(run.exit["exitCode"] == 0);
        }
    }
    SECTION("case 2: 1 MiB through stdin in random chunks, to sha256sum and to cat") {
        std::string input;
        for (int i = 0; i < 4096; ++i) input += every;
        REQUIRE(sha256_hex(input) ==
                "fbbab289f7f94b25736c58be46a994c441fd02552cc6022352e3d86d2fab7c83");
        // Chunk sizes 1..65536 from a fixed seed, with one-byte chunks of 00, 0A, 0D and FF.
        std::mt19937 rng(20240611);
        std::uniform_int_distribution<std::size_t> size(1, 65536);
        const std::vector<std::size_t> singles = {0, 10, 13, 255, 65536 * 3 + 10};
        std::vector<std::string> chunks;
        for (std::size_t pos = 0; pos < input.size();) {
            std::size_t n = size(rng);
            for (auto s : singles) {
                if (pos == s)
                    n = 1;
                else if (pos < s && pos + n > s)
                    n = s - pos;
            }
            n = std::min(n, input.size() - pos);
            chunks.push_back(input.substr(pos, n));
            pos += n;
        }
        // Sends the chunks within the stdin window (binary frames, or duplexChannelWrite),
        // then stdin EOF, crediting output (binary or duplexChannel.data) meanwhile.
        auto send_chunks = [&](const json& params, bool base64_writes) {
            const auto result = c->call("duplexChannelOpen", params);
            const auto ch = result["channel"].get<std::uint32_t>();
            const std::uint64_t window = result["stdinWindow"].get<std::uint64_t>();
            std::uint64_t unacked = 0;
            ChannelRun run;
            auto absorb = [&](const ClientEvent& ev) {
                if (ev.type == ClientEvent::kind::credit && ev.channel == ch) {
                    unacked -= std::min<std::uint64_t>(unacked, ev.credit);
                } else if (ev.type == ClientEvent::kind::data && ev.channel == ch) {
                    (ev.stream == stream_id::stderr_ ? run.err : run.out) += ev.bytes;
                    c->send_credit(ch, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
                } else if (ev.type == ClientEvent::kind::notification &&
                           ev.message["params"].value("channel", 0U) == ch) {
                    const auto& p = ev.message["params"];
                    if (ev.message["method"] == "duplexChannel.exit") {
                        run.exit = p;
                    } else if (ev.message["method"] == "duplexChannel.data") {
                        const auto bytes = base64_decode(p["chunk"].get<std::string>());
                        const bool err = p["stream"] == "stderr";
                        (err ? run.err : run.out) += bytes;
                        c->send_credit(ch, err ? stream_id::stderr_ : stream_id::stdout_,
                                       static_cast<std::uint32_t>(bytes.size()));
                    }
                }
            };
            std::size_t next = 0;
            bool closed = false;
            while (run.exit.is_null()) {
                while (next < chunks.size() && unacked + chunks[next].size() <= window) {
                    if (base64_writes) {
                        c->call("duplexChannelWrite",
                                {{"channel", ch}, {"data", base64_encode(chunks[next])}});
                    } else {
                        c->send_stdin(ch, chunks[next]);
                    }
                    unacked += chunks[next].size();
                    ++next;
                }
                if (next == chunks.size() && !closed) {
                    c->call("duplexChannelCloseStdin", {{"channel", ch}});
                    closed = true;
                }
                absorb(c->next_event());
            }
            return run;
        };
        REQUIRE(std::count_if(chunks.begin(), chunks.end(),
                              [](const std::string& s) { return s.size() == 1; }) >= 4);
        for (const bool base64 : {false, true}) {
            INFO((base64 ? "base64: duplexChannelWrite and duplexChannel.data" : "binary frames"));
            auto sha_params = open_params(lease, {"sha256sum"});
            auto cat_params = open_params(lease, {"cat"});
            if (base64) sha_params["dataEncoding"] = cat_params["dataEncoding"] = "base64";
            auto sha = send_chunks(sha_params, base64);
            CHECK(sha.out ==
                  "fbbab289f7f94b25736c58be46a994c441fd02552cc6022352e3d86d2fab7c83  -\n");
            CHECK(sha.exit["exitCode"] == 0);
            CHECK(sha.exit["stdinBytes"] == 1048576);
            auto cat = send_chunks(cat_params, base64);
            CHECK(cat.out.size() == 1048576);
            const bool same = cat.out == input;
            CHECK(same);
            CHECK(cat.exit["exitCode"] == 0);
        }
    }
    SECTION("case 3: stderr carries 00 FF 0A 0D") {
        auto run =
            c->run_channel(open_params(lease, {"sh", "-c", "printf \"\\000\\377\\n\\r\" >&2"}));
        CHECK(run.err == std::string("\0\xff\n\r", 4));
        CHECK(run.out.empty());
        CHECK(run.exit["exitCode"] == 0);
    }
}

TEST_CASE("cases: B09: a client disconnect leaves no process behind", "[cases][B09]") {
    DaemonProcess daemon;
    auto control = daemon.connect();
    const auto lease = acquire_lease(*control);
    const std::string marker = "sleep 6091";
    const bool pty = GENERATE(false, true);
    auto params = open_params(lease, {"sleep", "6091"});
    if (pty) params = with_pty(params, 80, 24);
    INFO("pty " << pty);
    const double baseline = daemon.metric("sandboxd_channels_running");
    REQUIRE(baseline == 0);

    SECTION("(a) a WebSocket close (1000) without stdin EOF") {
        auto c = daemon.connect();
        open_channel(*c, params);
        REQUIRE(eventually([&] { return count_processes_with(marker) == 1; }, 10s));
        c->close();
    }
    SECTION("(b) the client process is killed") {
        int ready[2];
        REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
        const pid_t child = ::fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            ::close(ready[0]);
            try {
                Client cc(daemon.url(), daemon.token());
                cc.call("duplexChannelOpen", params);
                const char b = 1;
                if (::write(ready[1], &b, 1) != 1) ::_exit(3);
            } catch (...) {
                ::_exit(3);
            }
            for (;;) ::pause();  // killed by the test
        }
        ::close(ready[1]);
        const bool opened = wait_byte(ready[0], 30s);
        ::close(ready[0]);
        ::kill(child, SIGKILL);
        ::waitpid(child, nullptr, 0);
        REQUIRE(opened);
    }
    SECTION("(c) one connection carrying 10 channels is dropped") {
        auto c = daemon.connect();
        for (int i = 0; i < 10; ++i) open_channel(*c, params);
        REQUIRE(eventually([&] { return count_processes_with(marker) == 10; }, 20s));
        c.reset();  // the socket closes without a WebSocket close
    }
    SECTION("(d) the hangup comes first: a command that traps SIGHUP runs its trap") {
        auto c = daemon.connect();
        auto p = open_params(lease, {"sh", "-c",
                                     "trap 'echo hup > /workspace/hup; exit 0' HUP; echo ready; "
                                     "while :; do sleep 6091; done"});
        if (pty) p = with_pty(p, 80, 24);
        const auto ch = open_channel(*c, p);
        collect(*c, ch, [](const ClientEvent&, const ChannelRun& r) {
            return r.out.find("ready") == std::string::npos;
        });
        // Once the loop's sleep runs: a HUP that lands between the shell's fork and the
        // sleep's exec is taken by the shell's handler in the child and lost, and the shell
        // defers its trap until the foreground sleep ends (POSIX). SIGKILL after the grace
        // covers that case; this section checks the HUP itself.
        REQUIRE(eventually([&] { return count_processes_with(marker) == 1; }, 10s));
        c.reset();
        // The trap's file, read from inside the lease (the workspace is the lease's own disk).
        CHECK(eventually(
            [&] {
                auto r = control->run_channel(open_params(lease, {"cat", "/workspace/hup"}));
                return r.out == "hup\n";
            },
            5s));
    }
    const auto dropped = steady::now();
    CHECK(eventually([&] { return count_processes_with(marker) == 0; }, 5s));
    INFO("gone after " << ms_since(dropped) << " ms");
    CHECK(eventually([&] { return daemon.metric("sandboxd_channels_running") == baseline; }, 5s));
    CHECK(eventually([&] { return daemon.channel_processes().empty(); }, 5s));
    auto ok = control->run_channel(open_params(lease, {"echo", "ok"}));
    CHECK(ok.out == "ok\n");
    CHECK(ok.exit["exitCode"] == 0);
}

TEST_CASE("cases: B10: signals reach the right processes", "[cases][B10]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("case 1: TERM reaches a trapping shell") {
        const auto ch =
            open_channel(*c, open_params(lease, {"sh", "-c",
                                                 "trap \"echo got-term; exit 7\" TERM; echo ready; "
                                                 "while :; do sleep 0.1; done"}));
        steady::time_point sent{};
        bool signalled = false;
        auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
            if (!signalled && r.out == "ready\n") {
                signalled = true;
                sent = steady::now();
                c->call("duplexChannelSignal", {{"channel", ch}, {"signal", "TERM"}});
            }
            return true;
        });
        CHECK(run.out == "ready\ngot-term\n");  // (stderr may carry the shell's "Terminated")
        CHECK(run.exit["exitCode"] == 7);
        CHECK(run.exit["outcome"] == "exited");
        CHECK(ms_since(sent) < 1000);
    }
    SECTION("case 2: KILL reaches the whole process group") {
        const auto ch = open_channel(
            *c, open_params(lease, {"sh", "-c", "sleep 3010 & sleep 3011; echo never"}));
        REQUIRE(eventually(
            [] {
                return count_processes_exactly("sleep 3011") == 1 &&
                       count_processes_exactly("sleep 3010") == 1;
            },
            10s));
        c->call("duplexChannelSignal", {{"channel", ch}, {"signal", "KILL"}});
        auto run = collect(*c, ch);
        CHECK(run.out.empty());
        CHECK(run.exit["exitCode"].is_null());
        CHECK(run.exit["signal"] == "KILL");
        CHECK(run.exit["outcome"] == "signaled");
        CHECK(eventually(
            [] {
                return count_processes_exactly("sleep 3010") == 0 &&
                       count_processes_exactly("sleep 3011") == 0;
            },
            1s));
    }
    SECTION("case 3: Ctrl-C (0x03) under a PTY interrupts the command") {
        const auto ch = open_channel(*c, with_pty(open_params(lease, {"sleep", "30"}), 80, 24));
        REQUIRE(eventually([] { return count_processes_exactly("sleep 30") == 1; }, 10s));
        const auto sent = steady::now();
        c->send_stdin(ch, "\x03");
        auto run = collect(*c, ch);
        CHECK(ms_since(sent) < 1000);
        CHECK(run.exit["signal"] == "INT");
        CHECK(run.exit["exitCode"].is_null());
        CHECK(run.exit["outcome"] == "signaled");
    }
    SECTION("case 4: an unknown signal, or one to an ended channel, is an error; others run on") {
        const auto cat = open_channel(*c, open_params(lease, {"cat"}));
        const auto ch = open_channel(*c, open_params(lease, {"sleep", "6101"}));
        for (const char* bad : {"BOGUS", "9", "SIGTERM", "", "STOP"}) {
            INFO("signal \"" << bad << "\"");
            CHECK(error_reason(*c, "duplexChannelSignal", {{"channel", ch}, {"signal", bad}}) ==
                  "INVALID_PARAMS");
        }
        c->call("duplexChannelStop", {{"channel", ch}});
        auto stopped = collect(*c, ch);
        CHECK(stopped.exit["outcome"] == "stopped");
        CHECK(error_reason(*c, "duplexChannelSignal", {{"channel", ch}, {"signal", "TERM"}}) ==
              "CHANNEL_NOT_FOUND");
        CHECK(error_reason(*c, "duplexChannelStop", {{"channel", ch}}) == "CHANNEL_NOT_FOUND");
        c->call("duplexChannelClose", {{"channel", ch}});  // idempotent
        c->call("duplexChannelClose", {{"channel", ch}});
        c->send_stdin(cat, "still here\n");
        c->call("duplexChannelCloseStdin", {{"channel", cat}});
        auto run = collect(*c, cat);
        CHECK(run.out == "still here\n");
        CHECK(run.exit["exitCode"] == 0);
        CHECK(daemon.alive());
    }
}

TEST_CASE("cases: B11: descendants are reaped and background children never hold the exit",
          "[cases][B11]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("case 1: background sleeps hold stdout; the exit does not wait for them") {
        const auto start = steady::now();
        auto run =
            c->run_channel(open_params(lease, {"sh", "-c", "sleep 1 & sleep 3 & echo hi; exit 4"}));
        CHECK(run.out == "hi\n");
        CHECK(run.exit["exitCode"] == 4);
        CHECK(ms_since(start) < 2000);
        CHECK(eventually(
            [] {
                return count_processes_exactly("sleep 1") == 0 &&
                       count_processes_exactly("sleep 3") == 0;
            },
            5s));
        // Orphans are reaped by the sandbox's init: no zombie ever shows in the sandbox.
        const int polls = reps(3, 10);
        auto zombies = c->run_channel(
            open_params(lease, {"sh", "-c",
                                "i=0; while [ $i -lt " + std::to_string(polls) +
                                    " ]; do (sleep 0.05 &); (true &); sleep 1; "
                                    "ps -eo stat= | grep -c '^Z'; i=$((i+1)); done; exit 0"}));
        std::string expected;
        for (int i = 0; i < polls; ++i) expected += "0\n";
        CHECK(zombies.out == expected);
        CHECK(zombies.exit["exitCode"] == 0);
    }
    SECTION("case 2: many channels with a background child leave no zombie") {
        const int runs = reps(50, 200);
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(open_params(lease, {"sh", "-c", "true & exit 0"}));
            REQUIRE(run.exit["exitCode"] == 0);
        }
        CHECK(eventually([&] { return daemon.channel_processes().empty(); }, 5s));
        int zombies = 0;
        for (pid_t child : daemon.channel_processes()) zombies += proc_state(child) == 'Z' ? 1 : 0;
        CHECK(zombies == 0);
    }
    SECTION("case 3: a setsid'd descendant is gone at the latest when the lease is released") {
        auto run = c->run_channel(open_params(lease, {"sh", "-c", "setsid sleep 500 & exit 0"}));
        CHECK(run.exit["exitCode"] == 0);
        CHECK(eventually([] { return count_processes_exactly("sleep 500") == 0; }, 5s));
        c->call("leaseRelease", {{"leaseId", lease["id"]}});
        CHECK(count_processes_exactly("sleep 500") == 0);
        CHECK(eventually([&] { return daemon.channel_processes().empty(); }, 5s));
    }
}

TEST_CASE("cases: B12: no fd leak across many channels, and none at a low RLIMIT_NOFILE",
          "[cases][B12]") {
    const int sequential = reps(150, 2000);
    const int parallel = reps(100, 300);
    const auto memory_env = measure_memory_env();
    DaemonProcess daemon;
    auto c = daemon.connect();
    auto lease = acquire_lease(*c);
    auto echo_pid = open_params(lease, {"sh", "-c", "echo $$"});
    auto held = open_params(lease, {"sh", "-c", "echo $$; exec cat"});
    // Warm up (first spawn, registry, logging), then the baseline.
    REQUIRE(c->run_channel(echo_pid).out == "2\n");
    REQUIRE(c->run_channel(with_pty(echo_pid, 80, 24), "", false).out == "2\r\n");
    const auto fds_before = daemon.fd_count();
    const long rss_before = daemon.rss_kib();
    int failures = 0;
    for (int i = 0; i < sequential; ++i) {
        const bool pty = (i / 3) % 2 == 1;
        const std::string first = pty ? "2\r\n" : "2\n";
        auto fit = [&](json p) { return pty ? with_pty(std::move(p), 80, 24) : p; };
        switch (i % 3) {
            case 0: {  // ends normally
                auto run = c->run_channel(fit(echo_pid), "", !pty);
                if (run.out != first || run.exit["exitCode"] != 0) {
                    ++failures;
                    UNSCOPED_INFO("normal " << i << ": " << run.out << " " << run.exit.dump());
                }
                break;
            }
            case 1: {  // the WebSocket is closed (or the TCP connection reset) mid-run
                auto a = daemon.connect();
                const auto ch = open_channel(*a, fit(held));
                auto run = collect(*a, ch, [&](const ClientEvent&, const ChannelRun& r) {
                    return r.out != first;
                });
                if (run.out != first) ++failures;
                if (i % 2 == 0) {
                    a->close();
                    a.reset();
                } else {
                    hard_drop(a);
                }
                break;
            }
            default: {  // ended with signal KILL
                const auto ch = open_channel(*c, fit(held));
                bool killed = false;
                auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
                    if (!killed && r.out == first) {
                        killed = true;
                        c->call("duplexChannelSignal", {{"channel", ch}, {"signal", "KILL"}});
                    }
                    return true;
                });
                if (run.out != first || run.exit["signal"] != "KILL") {
                    ++failures;
                    UNSCOPED_INFO("kill " << i << ": " << run.out << " " << run.exit.dump());
                }
            }
        }
    }
    CHECK(failures == 0);
    // 5 s after quiescence: fds back to the baseline (+8), no PTY held, RSS bounded.
    CHECK(eventually(
        [&] {
            return daemon.channel_processes().empty() &&
                   daemon.metric("sandboxd_channels_running") == 0;
        },
        10s));
    const bool fds_back = eventually([&] { return daemon.fd_count() <= fds_before + 8; }, 5s);
    {
        std::map<std::string, int> kinds;  // what is open, for the failure message
        for (const auto& t : daemon.fd_targets()) ++kinds[t.substr(0, t.find('['))];
        std::ostringstream list;
        for (const auto& [k, n] : kinds) list << k << " x" << n << "; ";
        INFO("fds before " << fds_before << ", after " << daemon.fd_count() << ": " << list.str());
        CHECK(fds_back);
    }
    CHECK(ptys_held(daemon) == 0);
    const long growth = daemon.rss_kib() - rss_before;
    INFO("RSS growth " << growth << " KiB");
    if (rss_is_meaningful) CHECK(growth <= 32 * 1024);
    auto next = c->run_channel(echo_pid);
    CHECK(next.out == "2\n");
    CHECK(next.exit["exitCode"] == 0);

    // Restarted with RLIMIT_NOFILE=256: parallel batches of 50 all succeed.
    c.reset();
    daemon.set_fd_limit_for_next_start(256);
    daemon.restart();
    {
        std::ifstream limits("/proc/" + std::to_string(daemon.pid()) + "/limits");
        std::string text((std::istreambuf_iterator<char>(limits)),
                         std::istreambuf_iterator<char>());
        INFO(text);
        REQUIRE(text.find("Max open files            256                  256") !=
                std::string::npos);
    }
    c = daemon.connect();
    lease = acquire_lease(*c);
    echo_pid = open_params(lease, {"sh", "-c", "echo $$"});
    int batch_failures = 0;
    for (int done = 0; done < parallel; done += 50) {
        std::vector<json> batch;
        batch.reserve(50);
        for (int i = 0; i < 50; ++i)
            batch.push_back((i % 2 == 1) ? with_pty(echo_pid, 80, 24) : echo_pid);
        auto runs = run_batch(*c, batch);
        for (std::size_t i = 0; i < runs.size(); ++i) {
            const std::string want = (i % 2 == 1) ? "2\r\n" : "2\n";
            if (runs[i].out != want || runs[i].exit.value("exitCode", json()) != 0) {
                ++batch_failures;
                UNSCOPED_INFO("batch run " << done + static_cast<int>(i) << ": " << runs[i].out
                                           << " " << runs[i].exit.dump());
            }
        }
    }
    CHECK(batch_failures == 0);
    CHECK(daemon.log().find("Too many open files") == std::string::npos);
    CHECK(eventually([&] { return daemon.channel_processes().empty(); }, 10s));
}

TEST_CASE(
    "cases: B12: a node out of file descriptors refuses opens with CHANNEL_LIMIT and recovers",
    "[cases][B12]") {
    DaemonProcess daemon;
    daemon.set_fd_limit_for_next_start(64);
    daemon.restart();
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    std::vector<std::uint32_t> open;
    std::string reason;
    for (int i = 0; i < 64 && reason.empty(); ++i) {
        try {
            open.push_back(open_channel(*c, open_params(lease, {"sleep", "6121"})));
        } catch (const rpc_error& e) {
            reason = e.data().value("reason", "");
            INFO(e.what());
            CHECK(std::string(e.what()).find("file descriptor") != std::string::npos);
        }
    }
    CHECK(reason == "CHANNEL_LIMIT");  // an explicit limit, not a provider failure
    // Not absurdly early: at 64 descriptors a node fits a few channels (each holds 6 and takes
    // about 17 while it starts). Since issue 12 the SQLite registry keeps three lanes of
    // connections (reads, lease writes, membership), 9 descriptors more than one connection,
    // so 4 fit where 5 did.
    CHECK(open.size() >= 4);
    CHECK(eventually(
        [&] { return count_processes_with("sleep 6121") == static_cast<int>(open.size()); }, 10s));
    for (auto ch : open) {
        c->call("duplexChannelStop", {{"channel", ch}});
        CHECK(collect(*c, ch).exit["outcome"] == "stopped");
    }
    CHECK(eventually([] { return count_processes_with("sleep 6121") == 0; }, 10s));
    // Descriptors are back: new connections and channels work again.
    auto again = daemon.connect();
    auto ok = again->run_channel(open_params(lease, {"echo", "ok"}));
    CHECK(ok.out == "ok\n");
    CHECK(ok.exit["exitCode"] == 0);
    CHECK(daemon.alive());
}

/// User plus system CPU time of `pid` in clock ticks (/proc/<pid>/stat fields 14 and 15).
long long cpu_ticks(pid_t pid) {
    const std::string stat = read_proc_file("/proc/" + std::to_string(pid) + "/stat");
    std::istringstream fields(stat.substr(stat.rfind(')') + 2));
    std::string field;
    long long utime = 0;
    long long stime = 0;
    for (int i = 3; i <= 15 && fields >> field; ++i) {
        if (i == 14) utime = std::stoll(field);
        if (i == 15) stime = std::stoll(field);
    }
    return utime + stime;
}

TEST_CASE("cases: B12: a node out of file descriptors at accept backs off, then accepts again",
          "[cases][B12]") {
    DaemonProcess daemon;
    daemon.set_fd_limit_for_next_start(64);
    daemon.restart();
    // Connections alone cannot take the node's last descriptors (limits.connections stays
    // below RLIMIT_NOFILE less a reserve, issue 44): its own work takes them here, channels
    // opened until one is refused for want of a descriptor.
    auto holder = daemon.connect();
    const auto held_lease = acquire_lease(*holder);
    std::vector<std::uint32_t> held;
    for (int i = 0; i < 64; ++i) {
        try {
            held.push_back(open_channel(*holder, open_params(held_lease, {"sleep", "6122"})));
        } catch (const rpc_error& e) {
            INFO(e.what());
            CHECK(e.data().value("reason", "") == "CHANNEL_LIMIT");
            break;
        }
    }
    REQUIRE_FALSE(held.empty());
    std::vector<int> waiting;  // plain TCP connections: more than the daemon has room for
    waiting.reserve(80);
    for (int i = 0; i < 80; ++i) waiting.push_back(connect_tcp(daemon.address()));
    REQUIRE(eventually(
        [&] {
            return daemon.log().find("accept failed: Too many open files") != std::string::npos;
        },
        10s));
    // Connections wait in the backlog; the daemon must not spin retrying accept meanwhile.
    const auto before = cpu_ticks(daemon.pid());
    std::this_thread::sleep_for(2s);
    const auto spent = cpu_ticks(daemon.pid()) - before;
    INFO("CPU ticks in 2 s: " << spent << " (" << ::sysconf(_SC_CLK_TCK) << " per second)");
    CHECK(spent < ::sysconf(_SC_CLK_TCK) / 2);  // a spinning loop burns all 2 s
    for (int fd : waiting) ::close(fd);
    for (auto ch : held) holder->call("duplexChannelStop", {{"channel", ch}});
    CHECK(eventually([] { return count_processes_with("sleep 6122") == 0; }, 10s));
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    auto ok = c->run_channel(open_params(lease, {"echo", "ok"}));
    CHECK(ok.out == "ok\n");
    CHECK(ok.exit["exitCode"] == 0);
    CHECK(eventually(
        [&] { return daemon.log().find("accepting connections again") != std::string::npos; }, 5s));
    CHECK(daemon.alive());
}

TEST_CASE(
    "cases: B13: an idle period neither kills a silent command nor fakes success and a dead peer "
    "is "
    "dropped",
    "[cases][B13]") {
    // T: pings every second, a peer silent for 3 s (three ping intervals) is dropped.
    DaemonProcess daemon("node-a",
                         R"({"limits": {"pingIntervalMs": 1000, "idleTimeoutMs": 3000}})");
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("a silent command of at least 2.5 T runs to its end") {
        const int seconds = full_cases() ? 25 : 8;
        const auto start = steady::now();
        auto run = c->run_channel(open_params(
            lease, {"sh", "-c", "sleep " + std::to_string(seconds) + "; echo done; exit 5"}));
        const auto elapsed = ms_since(start);
        CHECK(run.out == "done\n");
        CHECK(run.exit["exitCode"] == 5);
        CHECK(run.exit["outcome"] == "exited");
        CHECK(elapsed >= seconds * 1000 - 1000);
        CHECK(elapsed <= seconds * 1000 + 1000);
    }
    SECTION("a peer that stops answering pings is dropped within 3 ping intervals") {
        auto dead = daemon.connect();
        open_channel(*dead, open_params(lease, {"sleep", "6131"}));
        const auto silent_since = steady::now();  // the client reads nothing from now on
        CHECK(eventually([] { return count_processes_with("sleep 6131") == 1; }, 5s));
        CHECK(eventually([] { return count_processes_with("sleep 6131") == 0; }, 10s));
        const auto gone_after = ms_since(silent_since);
        INFO("process gone " << gone_after << " ms after the client fell silent");
        CHECK(gone_after >= 2000);
        CHECK(gone_after <= 3000 + 1000);
        // (The idle control connection `c` is dropped too: it read nothing either.) The daemon
        // serves a new connection, and the dropped one was never told about an exit.
        auto again = daemon.connect();
        CHECK(again->run_channel(open_params(lease, {"echo", "ok"})).out == "ok\n");
        CHECK(count_lines_with(daemon.log(), "ended: outcome=transportClosed") == 1);
    }
    SECTION("timeoutMs ends the channel with outcome timedOut, never a made-up exit code") {
        auto p = open_params(lease, {"sleep", "6132"});
        p["timeoutMs"] = 1000;
        const auto start = steady::now();
        auto run = c->run_channel(p);
        CHECK(ms_since(start) < 2500);
        CHECK(run.exit["outcome"] == "timedOut");
        CHECK(run.exit["exitCode"].is_null());
        CHECK(eventually([] { return count_processes_with("sleep 6132") == 0; }, 5s));
    }
}

TEST_CASE("cases: B15: huge or endless frames close the connection and harm nothing else",
          "[cases][B15]") {
    const auto memory_env = measure_memory_env();
    DaemonProcess daemon;
    auto healthy = daemon.connect();
    const auto lease = acquire_lease(*healthy);
    // The healthy channel's output is larger than its window: it is mid-flight during the attack.
    const auto ch = open_channel(*healthy, open_params(lease, {"sh", "-c", "seq 1 200000"}));
    REQUIRE(wait_until_quiet("seq 1 200000", 20s));  // its window is full: memory settled
    const long before = daemon.rss_kib();
    RawWebSocket raw(daemon.address(), daemon.token());
    REQUIRE(raw.status() == 101);

    SECTION("case a: a masked binary frame declaring 2^62 bytes") {
        std::string bytes = {'\x82', '\xff', '\x40', 0, 0, 0, 0, 0, 0, 0};
        bytes += std::string("\x11\x22\x33\x44", 4) + std::string(16, 'p');
        const auto sent = steady::now();
        REQUIRE(raw.send_raw(bytes));
        const int code = raw.read_close_code(5s);
        CHECK(ms_since(sent) < 1000);
        CHECK((code == 1009 || code == -1));
        const long growth = daemon.peak_rss_kib() - before;
        INFO("RSS growth " << growth << " KiB");
        if (rss_is_meaningful) CHECK(growth < 16 * 1024);
    }
    SECTION("case b: a declared length with the top bit set") {
        std::string bytes = {'\x82', '\xff', '\x80', 0, 0, 0, 0, 0, 0, 0};
        bytes += std::string("\x11\x22\x33\x44", 4) + std::string(16, 'p');
        REQUIRE(raw.send_raw(bytes));
        CHECK(raw.read_close_code(5s) == 1002);
    }
    SECTION("case b, the header split over several TCP segments") {
        // A ping first, so that the guard's frame tracking is exercised across a frame.
        REQUIRE(raw.send_raw(client_frame(9, "hi")));
        const auto pong = raw.read_frame(5s);
        REQUIRE(pong);
        CHECK(pong->opcode == 10);
        CHECK(pong->payload == "hi");
        const std::string bytes = {'\x82', '\xff', '\x80', 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4};
        std::size_t from = 0;
        for (const std::size_t cut : {1, 2, 3, 14}) {
            REQUIRE(raw.send_raw(bytes.substr(from, cut - from)));
            from = cut;
            // Give the daemon a chance to read each piece on its own (no synchronisation
            // depends on it: the close code is the same however the pieces are read).
            std::this_thread::sleep_for(20ms);
        }
        CHECK(raw.read_close_code(5s) == 1002);
    }
    SECTION("case c: endless non-final 1 MiB fragments") {
        const std::string payload(1 << 20, 'f');
        const std::string first = client_frame(2, payload, false, 0);
        const std::string more = client_frame(0, payload, false, 0);
        int sent = 0;
        bool closed = false;
        for (; sent < 200 && !closed; ++sent) {
            if (!raw.send_raw(sent == 0 ? first : more)) break;
            closed = raw.readable(0ms);
        }
        INFO("fragments sent before the close: " << sent);
        CHECK(raw.read_close_code(10s) == 1009);
        // The documented maximum message is 1 MiB (limits.maxTextMessage); the daemon stops
        // at it, not at 200 MiB, whatever the socket buffers took in meanwhile.
        CHECK(sent <= 17);
        const long growth = daemon.peak_rss_kib() - before;
        INFO("RSS growth " << growth << " KiB");
        // Twice the 1 MiB maximum, plus 4 MiB for what the allocator and the sanitizer keep
        // and for the node's own activity meanwhile (registry heartbeats): 200 fragments
        // held would be 200 MiB.
        if (rss_is_meaningful) CHECK(growth < 2 * 1024 + 4 * 1024);
    }
    // In every case the healthy connection's output is exact.
    auto run = collect(*healthy, ch);
    CHECK(run.out.size() == 1288895);
    CHECK(sha256_hex(run.out) == seq_200k_sha);
    CHECK(run.exit["exitCode"] == 0);
    CHECK(daemon.alive());
}

TEST_CASE("cases: B16: permessage-deflate is not negotiated and RSV1 frames are refused",
          "[cases][B16]") {
    DaemonProcess daemon;
    auto healthy = daemon.connect();
    const auto lease = acquire_lease(*healthy);
    const auto ch = open_channel(*healthy, open_params(lease, {"sh", "-c", "seq 1 200000"}));
    RawWebSocket raw(daemon.address(), daemon.token(),
                     {"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits"});
    REQUIRE(raw.status() == 101);
    CHECK(raw.headers().find("sec-websocket-extensions") == std::string::npos);
    // A "compressed" data frame: RSV1 set although no extension was agreed.
    REQUIRE(raw.send_raw(client_frame(2, std::string("\x01\x00\x00\x00\x01\x00", 6) + "abc", true,
                                      0x01020304, true)));
    CHECK(raw.read_close_code(5s) == 1002);
    auto run = collect(*healthy, ch);
    CHECK(sha256_hex(run.out) == seq_200k_sha);
    CHECK(run.exit["exitCode"] == 0);
    // And the daemon still accepts and serves new connections.
    auto again = daemon.connect();
    CHECK(again->run_channel(open_params(lease, {"echo", "ok"})).out == "ok\n");
}

namespace {

/// Drives one connection asynchronously for B17: reads without pause, credits output, and
/// writes (requests, frames, pings) through a single queue, as Beast requires.
class ConcurrentDriver {
public:
    explicit ConcurrentDriver(Client& c) : io_(c.impl()) {
        beast::get_lowest_layer(io_.ws).expires_never();
        io_.ws.control_callback([this](websocket::frame_type kind, beast::string_view) {
            if (kind == websocket::frame_type::pong) ++pongs;
        });
    }
    ConcurrentDriver(const ConcurrentDriver&) = delete;  // the callback captures `this`
    ConcurrentDriver& operator=(const ConcurrentDriver&) = delete;
    ~ConcurrentDriver() { io_.ws.control_callback(); }

    void text(std::string s) { push({0, std::move(s)}); }
    void binary(std::string s) { push({1, std::move(s)}); }
    void ping() {
        ++pings_sent;
        push({2, {}});
    }
    /// Calls `on_message` for every message until `done()` holds after one, or `timeout`.
    bool run(const std::function<void(ClientEvent&)>& on_message,
             const std::function<void()>& every_ms, const std::function<bool()>& done,
             std::chrono::milliseconds timeout) {
        on_message_ = on_message;
        done_ = done;
        tick_ = every_ms;
        read_next();
        net::steady_timer ticker(io_.ioc);
        std::function<void()> arm = [&] {
            ticker.expires_after(1ms);
            ticker.async_wait([&](beast::error_code ec) {
                if (ec || finished_) return;
                if (done_()) {  // e.g. the last pong arrived inside a read (a control frame)
                    finished_ = true;
                    io_.ioc.stop();
                    return;
                }
                tick_();
                arm();
            });
        };
        arm();
        io_.ioc.restart();
        io_.ioc.run_for(timeout);
        ticker.cancel();
        const bool ok = finished_ && !failed_;
        finished_ = true;
        // Let the cancelled operations finish so that nothing refers to this frame.
        io_.ioc.restart();
        beast::get_lowest_layer(io_.ws).socket().cancel();
        io_.ioc.run_for(1s);
        return ok;
    }

    std::size_t pings_sent = 0;
    std::size_t pongs = 0;
    std::string failure;

private:
    struct Out {
        int kind;  // 0 text, 1 binary, 2 ping
        std::string bytes;
    };
    void push(Out out) {
        queue_.push_back(std::move(out));
        if (!writing_) write_next();
    }
    void write_next() {
        if (queue_.empty() || finished_) {
            writing_ = false;
            return;
        }
        writing_ = true;
        auto on_done = [this](beast::error_code ec, std::size_t = 0) {
            if (ec) return fail("write: " + ec.message());
            queue_.pop_front();
            write_next();
        };
        if (queue_.front().kind == 2) {
            io_.ws.async_ping({}, [on_done](beast::error_code ec) { on_done(ec); });
        } else {
            io_.ws.binary(queue_.front().kind == 1);
            io_.ws.async_write(net::buffer(queue_.front().bytes), on_done);
        }
    }
    void read_next() {
        io_.buffer.clear();
        io_.ws.async_read(io_.buffer, [this](beast::error_code ec, std::size_t) {
            if (finished_) return;
            if (ec) return fail("read: " + ec.message());
            const auto data = io_.buffer.data();
            std::string_view message(static_cast<const char*>(data.data()), data.size());
            ClientEvent ev;
            try {
                ev = decode_event(io_.ws.got_text(), message);
            } catch (const client_error&) {
                return fail("malformed binary frame");
            }
            on_message_(ev);
            if (done_()) {
                finished_ = true;
                io_.ioc.stop();
                return;
            }
            read_next();
        });
    }
    void fail(std::string why) {
        if (failed_) return;
        failed_ = true;
        failure = std::move(why);
        finished_ = true;
        io_.ioc.stop();
    }

    Client::Impl& io_;
    std::deque<Out> queue_;
    bool writing_ = false;
    bool finished_ = false;
    bool failed_ = false;
    std::function<void(ClientEvent&)> on_message_;
    std::function<bool()> done_;
    std::function<void()> tick_;
};

/// The non-empty lines of PTY output (split at CRLF).
std::vector<std::string> pty_lines(const std::string& out) {
    std::vector<std::string> lines;
    std::size_t pos = 0;
    while (pos < out.size()) {
        auto end = out.find("\r\n", pos);
        if (end == std::string::npos) end = out.size();
        if (end > pos) lines.push_back(out.substr(pos, end - pos));
        pos = end + 2;
    }
    return lines;
}

}  // namespace

TEST_CASE("cases: B17: concurrent writers on one WebSocket: pings, resizes, stdin and 16 channels",
          "[cases][B17]") {
    // 4 I/O threads; the daemon's own keepalive pings every 100 ms (its smallest interval).
    DaemonProcess daemon("node-a", R"({"threads": 4, "limits": {"pingIntervalMs": 100}})");
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    const std::string loop =
        "i=0; while [ $i -lt 20000 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done; exit 0";
    // json's noexcept move calls assert_invariant(), which clang-tidy 14 counts as throwing.
    // NOLINTNEXTLINE(bugprone-exception-escape)
    struct Chan {
        bool pty = false;
        std::uint32_t id = 0;
        std::string out, err;
        json exit;
    };
    std::vector<Chan> chans(16);
    std::map<std::int64_t, std::size_t> by_request;
    std::map<std::uint32_t, std::size_t> by_id;
    std::int64_t next_request = 100000;
    ConcurrentDriver driver(*c);
    for (std::size_t i = 0; i < chans.size(); ++i) {
        chans[i].pty = i % 2 == 1;
        auto p = open_params(lease, {"sh", "-c", loop});
        if (chans[i].pty) p = with_pty(p, 80, 24);
        by_request[next_request] = i;
        driver.text(json{
            {"jsonrpc", "2.0"},
            {"id", next_request++},
            {"method", "duplexChannelOpen"},
            {"params",
             p}}.dump());
    }
    std::size_t exits = 0, resizes = 0, resize_errors = 0, stdin_frames = 0;
    std::vector<std::string> errors;
    int tick = 0;
    auto on_message = [&](ClientEvent& ev) {
        if (ev.type == ClientEvent::kind::response) {
            const auto id = ev.message.value("id", std::int64_t{0});
            if (auto it = by_request.find(id); it != by_request.end()) {
                if (ev.message.contains("error")) {
                    errors.push_back(ev.message.dump());
                    ++exits;
                    return;
                }
                chans[it->second].id = ev.message["result"]["channel"].get<std::uint32_t>();
                by_id[chans[it->second].id] = it->second;
            } else if (ev.message.contains("error") &&
                       ev.message["error"]["data"].value("reason", "") != "CHANNEL_NOT_FOUND") {
                ++resize_errors;  // a resize racing a channel's exit may find it gone
                errors.push_back(ev.message.dump());
            }
        } else if (ev.type == ClientEvent::kind::data) {
            auto& ch = chans[by_id.at(ev.channel)];
            (ev.stream == stream_id::stderr_ ? ch.err : ch.out) += ev.bytes;
            driver.binary(
                encode_credit(ev.channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size())));
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit") {
            chans[by_id.at(ev.message["params"]["channel"].get<std::uint32_t>())].exit =
                ev.message["params"];
            ++exits;
        }
    };
    auto every_ms = [&] {
        ++tick;
        if (exits < chans.size()) driver.ping();
        if (tick % 10 != 0) return;
        for (auto& ch : chans) {
            if (ch.id == 0 || !ch.exit.is_null()) continue;
            if (ch.pty) {
                const bool wide = (tick / 10) % 2 == 0;
                driver.text(json{
                    {"jsonrpc", "2.0"},
                    {"id", next_request++},
                    {"method", "duplexChannelResize"},
                    {"params",
                     {{"channel", ch.id}, {"cols", wide ? 100 : 80}, {"rows", wide ? 30 : 24}}}}
                                .dump());
                ++resizes;
            }
            if (tick % 100 == 0) {
                driver.binary(encode_data(ch.id, stream_id::stdin_, "\n"));
                ++stdin_frames;
            }
        }
    };
    auto done = [&] { return exits == chans.size() && driver.pongs == driver.pings_sent; };
    const bool finished = driver.run(on_message, every_ms, done, 240s);
    INFO("driver: " << driver.failure << "; pings " << driver.pings_sent << ", pongs "
                    << driver.pongs << ", resizes " << resizes << ", stdin frames "
                    << stdin_frames);
    REQUIRE(finished);
    CHECK(errors.empty());
    CHECK(resize_errors == 0);
    CHECK(driver.pings_sent > 100);
    CHECK(driver.pongs == driver.pings_sent);
    std::vector<std::string> expected_pty;
    for (int i = 0; i < 20000; ++i) {
        expected_pty.push_back("out" + std::to_string(i));
        expected_pty.push_back("err" + std::to_string(i));
    }
    for (const auto& ch : chans) {
        INFO("channel " << ch.id << (ch.pty ? " (pty)" : " (pipes)"));
        CHECK(ch.exit["exitCode"] == 0);
        if (ch.pty) {
            const bool in_order = pty_lines(ch.out) == expected_pty;
            CHECK(in_order);
        } else {
            CHECK(ch.out.size() == 168890);
            CHECK(sha256_hex(ch.out) ==
                  "e633da501c673243655dfe7e54cdc2862307b9cf02adff13c59ebcad6c577298");
            CHECK(sha256_hex(ch.err) ==
                  "98033722cacaccad15b203f90939ed87cd6a57a178cf76f8b35b675c9970dba3");
        }
    }
    CHECK(numbered("out", 20000).size() == 168890);
    CHECK(daemon.alive());
    // No error logged, and no report of the sanitizer the daemon was built with (ASan and
    // UBSan in the dev preset, TSan in the tsan preset).
    const auto log = daemon.log();
    CHECK(log.find(" error ") == std::string::npos);
    CHECK(log.find("Sanitizer") == std::string::npos);
    CHECK(log.find("runtime error") == std::string::npos);
}

TEST_CASE("cases: B18: terminal size: initial size, early resize, invalid sizes", "[cases][B18]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("case 1: the opening size is in force before the command starts") {
        const int runs = reps(20, 200);
        const auto params = with_pty(open_params(lease, {"stty", "size"}), 132, 43);
        int mismatches = 0;
        for (int i = 0; i < runs; ++i) {
            auto run = c->run_channel(params, "", false);
            if (run.out != "43 132\r\n" || run.exit["exitCode"] != 0) {
                ++mismatches;
                UNSCOPED_INFO("run " << i << ": " << run.out << " " << run.exit.dump());
            }
        }
        CHECK(mismatches == 0);
    }
    SECTION("case 2: a resize in the same TCP write as the open") {
        auto fresh = daemon.connect();  // its first channel is channel 1
        const auto open = json{
            {"jsonrpc", "2.0"},
            {"id", 9001},
            {"method", "duplexChannelOpen"},
            {"params", with_pty(open_params(lease, {"sh", "-c", "sleep 0.5; stty size"}), 80, 24)}};
        const auto resize = json{{"jsonrpc", "2.0"},
                                 {"id", 9002},
                                 {"method", "duplexChannelResize"},
                                 {"params", {{"channel", 1}, {"cols", 100}, {"rows", 30}}}};
        const std::string both = client_frame(1, open.dump()) + client_frame(1, resize.dump());
        net::write(beast::get_lowest_layer(fresh->impl().ws).socket(), net::buffer(both));
        CHECK(fresh->wait_response(9001)["channel"] == 1);
        CHECK(fresh->wait_response(9002) == json::object());
        auto run = collect(*fresh, 1);
        CHECK(run.out == "30 100\r\n");
        CHECK(run.exit["exitCode"] == 0);
    }
    SECTION("cases 3 and 4: SIGWINCH on resize; invalid sizes refused, the size kept") {
        const auto ch =
            open_channel(*c, with_pty(open_params(lease, {"sh", "-c",
                                                          "trap \"stty size\" WINCH; echo ready; "
                                                          "while :; do sleep 0.1; done"}),
                                      80, 24));
        // Reads exactly `want` (the next output of the channel); returns how long it took.
        auto wait_for = [&](const std::string& want) {
            const auto start = steady::now();
            std::size_t last_chunk = 0;
            auto run = collect(*c, ch, [&](const ClientEvent& ev, const ChannelRun& r) {
                last_chunk = ev.bytes.size();
                return r.out.size() < want.size();
            });
            c->send_credit(ch, stream_id::stdout_, static_cast<std::uint32_t>(last_chunk));
            CHECK(run.exit.is_null());
            CHECK(run.out == want);
            return ms_since(start);
        };
        wait_for("ready\r\n");
        c->call("duplexChannelResize", {{"channel", ch}, {"cols", 120}, {"rows", 40}});
        CHECK(wait_for("40 120\r\n") < 1000);
        // Case 4: out-of-range sizes are refused; the size stays 120x40.
        CHECK(error_reason(*c, "duplexChannelResize",
                           {{"channel", ch}, {"cols", 0}, {"rows", 0}}) == "INVALID_PARAMS");
        CHECK(error_reason(*c, "duplexChannelResize",
                           {{"channel", ch}, {"cols", 65536}, {"rows", 65536}}) ==
              "INVALID_PARAMS");
        c->call("duplexChannelResize", {{"channel", ch}, {"cols", 120}, {"rows", 40}});
        CHECK(wait_for("40 120\r\n") < 1000);
        c->call("duplexChannelStop", {{"channel", ch}});
        auto run = collect(*c, ch);
        CHECK(run.out.empty());  // nothing was printed for the refused resizes
        CHECK(run.exit["outcome"] == "stopped");
    }
    SECTION("case 5: a resize on a pipe channel is an error") {
        const auto ch = open_channel(*c, open_params(lease, {"sleep", "6181"}));
        CHECK(error_reason(*c, "duplexChannelResize",
                           {{"channel", ch}, {"cols", 80}, {"rows", 24}}) == "INVALID_PARAMS");
        c->call("duplexChannelStop", {{"channel", ch}});
        CHECK(collect(*c, ch).exit["outcome"] == "stopped");
        CHECK(daemon.alive());
    }
}

TEST_CASE("cases: B19: large stdin is never truncated and writing to an exited command is safe",
          "[cases][B19]") {
    const auto memory_env = measure_memory_env();
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("case 1: 8 MiB in 64 KiB messages to a command that reads late") {
        const long before = daemon.rss_kib();
        auto run = c->run_channel(open_params(lease, {"sh", "-c", "sleep 2; wc -c"}),
                                  std::string(8388608, 'z'));
        CHECK(run.out == "8388608\n");
        CHECK(run.exit["exitCode"] == 0);
        CHECK(run.exit["stdinBytes"] == 8388608);
        const long growth = daemon.peak_rss_kib() - before;
        INFO("RSS growth " << growth << " KiB");
        if (rss_is_meaningful) CHECK(growth <= 32 * 1024);
    }
    SECTION("case 2: 64 KiB in one message to a raw PTY: short writes are retried") {
        const auto ch = open_channel(
            *c,
            with_pty(open_params(lease, {"sh", "-c",
                                         "stty raw -echo; echo ready; head -c 65536 | sha256sum"}),
                     80, 24));
        std::string input;
        while (input.size() < 65536) input += "0123456789abcdef\n";
        input.resize(65536);
        bool sent = false;
        auto run = collect(*c, ch, [&](const ClientEvent&, const ChannelRun& r) {
            if (!sent && r.out.find("ready") != std::string::npos) {
                c->send_stdin(ch, input);
                sent = true;
            }
            return true;
        });
        CHECK(run.out.find("d7eb4931cfecaaacd253616125905d950b794b6df90b0708bed156949b55686d  -") !=
              std::string::npos);
        CHECK(run.exit["exitCode"] == 0);
    }
    SECTION("case 3: 8 MiB to head -c 10") {
        std::string input(8388608, '\0');
        for (std::size_t i = 0; i < input.size(); ++i) input[i] = static_cast<char>('a' + i % 26);
        auto run = c->run_channel(open_params(lease, {"head", "-c", "10"}), input);
        CHECK(run.out == input.substr(0, 10));
        CHECK(run.exit["exitCode"] == 0);
        CHECK(run.exit["durationMs"] < 1000);
        CHECK(daemon.alive());
        auto next = c->run_channel(open_params(lease, {"echo", "ok"}));
        CHECK(next.out == "ok\n");
        CHECK(next.exit["exitCode"] == 0);
    }
}

TEST_CASE("cases: B22: output produced before the reader attaches is kept", "[cases][B22]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    const auto lease = acquire_lease(*c);
    SECTION("case 1: the client reads nothing for 1 s after the open") {
        for (const bool pty : {false, true}) {
            INFO("pty " << pty);
            auto p = open_params(lease, {"sh", "-c", "printf early; sleep 2; printf late; exit 2"});
            if (pty) p = with_pty(p, 80, 24);
            const auto id = c->send_request("duplexChannelOpen", p);
            std::this_thread::sleep_for(1s);  // client behaviour of the case: a late reader
            const auto ch = c->wait_response(id)["channel"].get<std::uint32_t>();
            auto run = collect(*c, ch);
            CHECK(run.out == "earlylate");
            CHECK(run.exit["exitCode"] == 2);
        }
    }
    SECTION("case 2: a command that exits at once, read 3 s later") {
        const auto id =
            c->send_request("duplexChannelOpen", open_params(lease, {"printf", "instant"}));
        std::this_thread::sleep_for(3s);  // client behaviour of the case: a late reader
        const auto ch = c->wait_response(id)["channel"].get<std::uint32_t>();
        auto run = collect(*c, ch);
        CHECK(run.out == "instant");
        CHECK(run.exit["exitCode"] == 0);
    }
}
