// Channel (src/server/channel.hpp) on a fake backend and a fake sink: the output credit window
// that stdout and stderr share, credit resuming a parked pump, send room, the stdin window,
// and the exit: sent after every byte of output, exactly once, never after a hangup.
#include "unit/server/channel_rig.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <csignal>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;

TEST_CASE("A channel sends no more output than its window, and credit resumes it",
          "[channel][flow]") {
    ChannelRig rig(channel_options(/*output_window=*/10));
    const std::string bytes = "0123456789abcdefghijklmno";  // 25 bytes
    rig.write(bytes);
    CHECK(rig.out() == bytes.substr(0, 10));
    CHECK(rig.backend->unread(output_stream::out) == 15);  // left in the pipe, not read
    rig.settle();
    CHECK(rig.out() == bytes.substr(0, 10));  // parked until credit, not polling

    rig.credit(4);
    CHECK(rig.out() == bytes.substr(0, 14));
    rig.credit(3);
    CHECK(rig.out() == bytes.substr(0, 17));
    rig.credit(100);  // more than was sent: the window is whole again, never larger
    CHECK(rig.out() == bytes);
    rig.write(std::string(20, 'z'));
    CHECK(rig.out() == bytes + std::string(2, 'z'));  // 8 unacknowledged + 2 = the window
}

TEST_CASE("Stdout and stderr share one output window", "[channel][flow]") {
    ChannelRig rig(channel_options(/*output_window=*/10));
    rig.backend->write(output_stream::out, "oooooooo");
    rig.backend->write(output_stream::err, "eeeeeeee");
    rig.settle();
    CHECK(rig.out().size() + rig.err().size() == 10);
    rig.credit(6);
    CHECK(rig.out() == "oooooooo");
    CHECK(rig.err() == "eeeeeeee");
}

TEST_CASE("A channel reads no output while its connection has no send room", "[channel][flow]") {
    ChannelRig rig(channel_options(), /*started=*/false);
    rig.sink->room = false;
    rig.start();
    rig.write("parked");
    CHECK(rig.out().empty());
    CHECK(rig.backend->unread(output_stream::out) == 6);  // the bytes wait in the pipe
    CHECK(rig.sink->room_waits >= 1);
    rig.sink->give_room();
    rig.settle();
    CHECK(rig.out() == "parked");
    CHECK(rig.backend->unread(output_stream::out) == 0);
}

TEST_CASE("A channel's exit follows every byte of its output", "[channel][exit]") {
    ChannelRig rig(channel_options(/*output_window=*/4));
    rig.write("abcdefgh");
    rig.backend->write(output_stream::err, "E");
    rig.exit(3);  // the command is gone while 4 of its bytes still wait for credit
    CHECK(rig.out() == "abcd");
    CHECK(rig.exits().empty());
    CHECK(rig.sink->finished.empty());
    CHECK_FALSE(rig.channel->finished());

    rig.credit(4);
    CHECK(rig.exits().empty());  // "E" still waits
    rig.credit(4);
    CHECK(rig.out() == "abcdefgh");
    CHECK(rig.err() == "E");
    REQUIRE(rig.exits().size() == 1);
    CHECK(rig.sink->first_text() > rig.sink->last_binary());  // the exit comes last
    const auto exit = rig.exits().front();
    CHECK(exit["channel"] == 1);
    CHECK(exit["hostRouteId"] == "route-1");
    CHECK(exit["exitCode"] == 3);
    CHECK(exit["outcome"] == "exited");
    CHECK(exit["stdoutBytes"] == 8);
    CHECK(exit["stderrBytes"] == 1);
    CHECK(rig.sink->finished == std::vector<std::uint32_t>{1});
    CHECK(rig.channel->finished());
}

TEST_CASE("A channel sends exactly one exit", "[channel][exit]") {
    ChannelRig rig;
    rig.backend->report_ended = true;  // the early notice, then gone(): two chances to finish
    rig.write("out");
    rig.exit(0);
    REQUIRE(rig.exits().size() == 1);
    // Nothing the host or the node does afterwards sends another.
    rig.run([&] {
        rig.channel->add_credit(3);
        rig.channel->stop(channel_outcome::stopped);
        rig.channel->hangup();
    });
    rig.settle();
    CHECK(rig.exits().size() == 1);
    CHECK(rig.sink->finished == std::vector<std::uint32_t>{1});
    CHECK_FALSE(rig.backend->killed);  // nothing left to kill
}

TEST_CASE("A hung-up channel drains its output, sends nothing and no exit", "[channel][exit]") {
    std::atomic<std::int64_t> unended{0};
    auto options = channel_options(/*output_window=*/2);
    options.unended = &unended;
    ChannelRig rig(std::move(options));
    CHECK(unended.load() == 1);
    rig.write("ab");
    CHECK(rig.out() == "ab");
    rig.run([&] { rig.channel->hangup(); });
    CHECK(rig.backend->signals == std::vector<int>{SIGHUP});
    const auto sent = rig.sink->sent.size();
    rig.write("cdefgh");  // beyond the window: read all the same, so the command never blocks
    CHECK(rig.backend->unread(output_stream::out) == 0);
    rig.exit(0);
    CHECK(rig.sink->sent.size() == sent);
    CHECK(rig.exits().empty());
    CHECK(rig.sink->finished.empty());
    CHECK(unended.load() == 0);  // its end is recorded all the same
}

TEST_CASE("A channel hands stdin on and credits it back once the command took it",
          "[channel][stdin]") {
    ChannelRig rig(channel_options(1 << 20, /*stdin_window=*/8));
    rig.run([&] { rig.channel->write_stdin("hello"); });
    CHECK(rig.backend->stdin_bytes == "hello");
    CHECK(rig.sink->stdin_credit(1) == 5);
    rig.run([&] { rig.channel->write_stdin("12345678"); });  // the whole window again
    CHECK(rig.backend->stdin_bytes == "hello12345678");
    rig.run([&] { rig.channel->close_stdin(); });
    CHECK(rig.backend->stdin_closed);
    CHECK_THROWS_AS(rig.run([&] { rig.channel->write_stdin("x"); }), rpc_error);
}

TEST_CASE("A host that overruns the stdin window ends its channel with FLOW_CONTROL",
          "[channel][stdin]") {
    ChannelRig rig(channel_options(1 << 20, /*stdin_window=*/4));
    try {
        rig.run([&] { rig.channel->write_stdin("12345"); });
        FAIL("no FLOW_CONTROL");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::flow_control);
    }
    CHECK(rig.backend->stdin_bytes.empty());
    CHECK(rig.backend->killed);
    rig.exit(137);
    REQUIRE(rig.exits().size() == 1);
    CHECK(rig.exits().front()["outcome"] == "error");
    CHECK(rig.exits().front()["error"]["code"] ==
          rpc_error(errc::flow_control, "").to_json()["code"]);
}
