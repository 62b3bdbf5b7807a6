// DetachedOutput (src/server/detached_output.hpp) under a real Channel on a running
// FakeChannelBackend: the command is never held back by a missing or slow host, a host that
// attaches gets the kept bytes from its offsets within its credit, then live output, then the
// exit once; a gap is announced with the first kept offset; a new attachment replaces the old.
#include "server/detached_output.hpp"

#include <sandboxd/core/errors.hpp>
#include "server/strand_hop_sink.hpp"
#include "support/temp_dir.hpp"
#include "unit/server/channel_rig.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;

namespace {

std::string digits(std::size_t n, std::size_t from = 0) {
    std::string s(n, '0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>('0' + (from + i) % 10);
    return s;
}

/// A channel whose sink is a DetachedOutput keeping `capacity` bytes per stream.
struct DetachedRig {
    TempDir tmp;
    boost::asio::io_context ioc;
    strand_t strand = boost::asio::make_strand(ioc);
    std::shared_ptr<DetachedOutput> kept;
    FakeChannelBackend* backend = nullptr;
    std::shared_ptr<Channel> channel;

    explicit DetachedRig(std::uint64_t capacity = 1 << 20) {
        kept = std::make_shared<DetachedOutput>(strand,
                                                KeptOutput::create(tmp.path() / "kept", capacity));
        auto b = FakeChannelBackend::running();
        backend = b.get();
        auto options = channel_options(/*output_window=*/64 * 1024);
        channel = std::make_shared<Channel>(strand, options, std::move(b), nullptr, kept);
        kept->bind(channel);
        run([&] { channel->start(); });
    }
    DetachedRig(const DetachedRig&) = delete;
    DetachedRig& operator=(const DetachedRig&) = delete;
    ~DetachedRig() { backend->forget_events(); }

    void run(const std::function<void()>& f) { on_strand(ioc, strand, f); }
    /// The command writes `bytes`; returns once the channel has read them all (it may wait
    /// a few ms on its own timer for a fuller frame) and what follows has run.
    void write(std::string_view bytes, output_stream s = output_stream::out) {
        backend->write(s, bytes);
        REQUIRE(pump(ioc, [&] { return backend->unread(s) == 0; }));
        settle(ioc);
    }
    /// The command exits with `code`; returns once the channel has sent its exit here.
    void exit(int code) {
        backend->end_output(output_stream::out);
        backend->end_output(output_stream::err);
        ChannelExit e;
        e.exit_code = code;
        backend->finish(e);
        REQUIRE(pump(ioc, [&] { return !kept->exit().is_null(); }));
        settle(ioc);
    }
    std::shared_ptr<FakeChannelSink> attach(std::uint32_t id, std::uint32_t window,
                                            std::optional<DetachedOutput::Offsets> from = {},
                                            bool takeover = false, bool hold = false) {
        auto host = std::make_shared<FakeChannelSink>(strand);
        run([&] { last = kept->attach(host, id, window, from, takeover, hold).id; });
        return host;
    }
    std::uint64_t last = 0;  ///< the id of the last attachment made
};

}  // namespace

TEST_CASE("A detached channel's command is not held back without a host, and its output is kept",
          "[detached]") {
    DetachedRig r;
    // Far more than the channel's 64 KiB window, with nobody attached.
    for (int i = 0; i < 8; ++i) r.write(digits(32 * 1024, i * 32 * 1024));
    r.write("oops", output_stream::err);
    CHECK(r.backend->unread(output_stream::out) == 0);  // all read: the command never blocks
    CHECK(r.kept->kept().end(output_stream::out) == 8 * 32 * 1024);
    CHECK(r.kept->kept().end(output_stream::err) == 4);
}

TEST_CASE(
    "An attachment gets the kept bytes from its offsets within its credit, then live "
    "output, then the exit once",
    "[detached]") {
    DetachedRig r;
    r.write(digits(10000));
    r.write("e1", output_stream::err);
    auto host = r.attach(5, /*window=*/4096, DetachedOutput::Offsets{1000, 0});
    // Its window holds: stdout and stderr together stop at 4096 bytes until it credits.
    CHECK(host->data(5, stream_id::stdout_).size() + host->data(5, stream_id::stderr_).size() ==
          4096);
    for (int i = 0; i < 10; ++i) r.run([&] { r.kept->add_credit(4096); });
    CHECK(host->data(5, stream_id::stdout_) == digits(9000, 1000));
    CHECK(host->data(5, stream_id::stderr_) == "e1");
    r.write(digits(100, 10000));  // live
    CHECK(host->data(5, stream_id::stdout_) == digits(9100, 1000));
    r.exit(3);
    const auto exits = host->notifications("duplexChannel.exit");
    REQUIRE(exits.size() == 1);
    CHECK(exits[0]["channel"] == 5);
    CHECK(exits[0]["exitCode"] == 3);
    CHECK(host->finished == std::vector<std::uint32_t>{5});
    r.run([&] { r.kept->add_credit(1 << 20); });
    CHECK(host->notifications("duplexChannel.exit").size() == 1);  // once
}

TEST_CASE("An attachment that asks for bytes no longer kept is told where they begin",
          "[detached]") {
    DetachedRig r(/*capacity=*/8192);
    r.write(digits(20000));
    auto host = r.attach(2, 1 << 20, DetachedOutput::Offsets{100, 0});
    const auto gaps = host->notifications("duplexChannel.gap");
    REQUIRE(gaps.size() == 1);
    CHECK(gaps[0] ==
          nlohmann::json{{"channel", 2}, {"stream", "stdout"}, {"firstKept", 20000 - 8192}});
    CHECK(host->data(2, stream_id::stdout_) == digits(8192, 20000 - 8192));
}

TEST_CASE(
    "A takeover ends the previous attachment, and the exit waits for the host's last "
    "byte",
    "[detached]") {
    DetachedRig r;
    r.write(digits(3000));
    auto first = r.attach(1, 1000);
    CHECK(first->data(1, stream_id::stdout_) == digits(1000));
    // Another connection takes over from where the first stopped reading.
    auto second = r.attach(9, 1500, DetachedOutput::Offsets{1000, 0}, /*takeover=*/true);
    CHECK(second->data(9, stream_id::stdout_) == digits(1500, 1000));
    const auto ended = first->notifications("duplexChannel.exit");
    REQUIRE(ended.size() == 1);
    CHECK(ended[0]["outcome"] == "takenOver");
    CHECK(ended[0]["exitCode"].is_null());
    CHECK(first->finished == std::vector<std::uint32_t>{1});
    r.exit(0);
    CHECK(first->data(1, stream_id::stdout_) == digits(1000));  // nothing more to the first
    CHECK(first->notifications("duplexChannel.exit").size() == 1);
    CHECK(second->notifications("duplexChannel.exit").empty());  // 500 bytes it has not read
    r.run([&] { r.kept->add_credit(1500); });
    CHECK(second->data(9, stream_id::stdout_) == digits(2000, 1000));
    CHECK(second->notifications("duplexChannel.exit").size() == 1);
}

TEST_CASE("An attachment on another strand gets the same bytes and exit through a hop",
          "[detached]") {
    DetachedRig r;
    r.write(digits(5000));
    // The host's connection runs on a strand of its own; the channel's sink reaches it by
    // posting there.
    const strand_t host_strand = boost::asio::make_strand(r.ioc);
    auto host = std::make_shared<FakeChannelSink>(host_strand);
    auto hop = std::make_shared<StrandHopSink>(host_strand, host);
    r.run([&] { r.kept->attach(hop, 4, 1 << 20, DetachedOutput::Offsets{0, 0}); });
    r.write(digits(100, 5000), output_stream::out);
    r.exit(7);
    REQUIRE(pump(r.ioc, [&] { return !host->notifications("duplexChannel.exit").empty(); }));
    CHECK(host->data(4, stream_id::stdout_) == digits(5100));
    CHECK(host->notifications("duplexChannel.exit")[0]["exitCode"] == 7);
    CHECK(host->finished == std::vector<std::uint32_t>{4});
    // The hop holds the host weakly: once it is gone, what follows is dropped.
    host.reset();
    r.run([&] { hop->send_text("{}"); });
}

TEST_CASE("A second attachment without takeover is refused and changes nothing", "[detached]") {
    DetachedRig r;
    r.write(digits(100));
    auto first = r.attach(1, 1 << 20);
    auto refused = std::make_shared<FakeChannelSink>(r.strand);
    r.run([&] {
        try {
            r.kept->attach(refused, 2, 1 << 20, std::nullopt);
            FAIL("attached without takeover");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::channel_attached);
        }
    });
    r.write(digits(50, 100));
    CHECK(first->data(1, stream_id::stdout_) == digits(150));
    CHECK(first->notifications("duplexChannel.exit").empty());
    CHECK(refused->data(2, stream_id::stdout_).empty());
}

TEST_CASE("A held attachment is sent nothing until it is released", "[detached]") {
    DetachedRig r;
    r.write(digits(500));
    auto host = r.attach(4, 1 << 20, DetachedOutput::Offsets{100, 0}, false, /*hold=*/true);
    settle(r.ioc);
    CHECK(host->data(4, stream_id::stdout_).empty());
    r.run([&] { r.kept->release(r.last); });
    settle(r.ioc);
    CHECK(host->data(4, stream_id::stdout_) == digits(400, 100));
}

TEST_CASE("An attachment that got the exit is over: the next host needs no takeover",
          "[detached]") {
    DetachedRig r;
    r.write(digits(10));
    auto first = r.attach(1, 1 << 20);
    r.exit(0);
    REQUIRE(first->notifications("duplexChannel.exit").size() == 1);
    CHECK_FALSE(r.kept->attached());
    auto second = r.attach(2, 1 << 20);
    settle(r.ioc);
    CHECK(second->data(2, stream_id::stdout_) == digits(10));
    CHECK(second->notifications("duplexChannel.exit").size() == 1);
    CHECK(first->notifications("duplexChannel.exit").size() == 1);
}

TEST_CASE("An attached host paces the command, and once it lets go the command runs free",
          "[detached]") {
    DetachedRig r;
    auto host = r.attach(3, /*window=*/4096);
    // The host takes 4 KiB and credits nothing: the channel stops within its own 64 KiB window.
    r.backend->write(output_stream::out, digits(200 * 1024));
    settle(r.ioc);
    CHECK(r.backend->unread(output_stream::out) > 0);
    CHECK(host->data(3, stream_id::stdout_) == digits(4096));
    CHECK(r.kept->kept().end(output_stream::out) <= 64 * 1024 + 4096);
    // Its credit lets the command go on as far as it is sent.
    r.run([&] { r.kept->add_credit(4096); });
    settle(r.ioc);
    CHECK(host->data(3, stream_id::stdout_) == digits(8192));
    // Detached: nobody holds it back any more, and nothing was lost.
    r.run([&] { r.kept->detach(r.last); });
    REQUIRE(pump(r.ioc, [&] { return r.backend->unread(output_stream::out) == 0; }));
    settle(r.ioc);
    CHECK(r.kept->kept().end(output_stream::out) == 200 * 1024);
}

TEST_CASE("An ended channel nobody reads holds no descriptor, and an attach opens its files again",
          "[detached]") {
    DetachedRig r;
    r.write(digits(300));
    r.exit(0);
    CHECK_FALSE(r.kept->kept().files_open());  // nobody attached: closed at the exit
    // The attach opens them again and the replay reads from them (attach() settles: the whole
    // replay and the exit have been sent when it returns).
    auto host = r.attach(6, 1 << 20);
    CHECK(host->data(6, stream_id::stdout_) == digits(300));
    CHECK(host->notifications("duplexChannel.exit").size() == 1);
    CHECK_FALSE(r.kept->kept().files_open());  // it got everything: closed again
    // An attachment that lets go early closes them too.
    auto early = r.attach(7, /*window=*/100);
    CHECK(r.kept->kept().files_open());
    r.run([&] { r.kept->detach(r.last); });
    CHECK_FALSE(r.kept->kept().files_open());
    // Files gone: the attach is refused with the reason and changes nothing.
    r.run([&] { r.kept->remove_kept(); });
    std::optional<rpc_error> refused;
    r.run([&] {
        try {
            r.kept->attach(std::make_shared<FakeChannelSink>(r.strand), 8, 1 << 20, {});
        } catch (const rpc_error& e) {
            refused = e;
        }
    });
    REQUIRE(refused);
    CHECK(refused->code() == errc::provider_error);
    CHECK_FALSE(r.kept->attached());
}

TEST_CASE("A running channel's files stay open with nobody attached", "[detached]") {
    DetachedRig r;
    r.write(digits(10));
    CHECK(r.kept->kept().files_open());
    auto host = r.attach(1, 1 << 20);
    r.run([&] { r.kept->detach(r.last); });
    CHECK(r.kept->kept().files_open());
    r.write(digits(10, 10));
    CHECK(r.kept->kept().end(output_stream::out) == 20);
}

TEST_CASE("A detached channel nobody attaches to for its hangupAfterMs is hung up, its exit kept",
          "[detached]") {
    using namespace std::chrono_literals;
    DetachedRig r;
    r.kept->hang_up_when_idle(1000ms);
    const auto hung_up = [&] { return !r.backend->signals.empty(); };
    auto first = r.attach(1, 1 << 20);
    r.run([&] { r.kept->detach(r.last); });  // the count starts
    auto second = r.attach(2, 1 << 20);      // and stops: attached, it is never hung up
    CHECK_FALSE(pump(r.ioc, hung_up, 1500ms));
    const auto let_go_at = std::chrono::steady_clock::now();
    r.run([&] { r.kept->detach(r.last); });  // counted again from here
    REQUIRE(pump(r.ioc, hung_up));
    CHECK(std::chrono::steady_clock::now() - let_go_at >= 1000ms);
    CHECK(r.backend->signals == std::vector<int>{SIGHUP});
    r.write(digits(10));  // output after the hangup is read and dropped, never kept
    CHECK(r.kept->kept().end(output_stream::out) == 0);
    ChannelExit e;
    e.signal = SIGHUP;
    r.backend->end_output(output_stream::out);
    r.backend->end_output(output_stream::err);
    r.backend->finish(e);
    REQUIRE(pump(r.ioc, [&] { return !r.kept->exit().is_null(); }));
    CHECK(r.kept->exit()["outcome"] == "transportClosed");
    // A host that comes back reads that exit.
    auto third = r.attach(3, 1 << 20);
    settle(r.ioc);
    CHECK(third->notifications("duplexChannel.exit").size() == 1);
}
