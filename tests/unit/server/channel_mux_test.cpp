// ChannelMux (src/server/channel_mux.hpp): a connection's channel ids, its local channels
// (frames routed to them, ended ones remembered), and its relayed channels (the owner's frames
// held until the open's result is queued, the stdin window of the owner, the relay count).
#include "server/channel_mux.hpp"
#include "server/node.hpp"
#include "server/strand_hop_sink.hpp"
#include "support/temp_dir.hpp"
#include "unit/server/channel_rig.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <csignal>
#include <optional>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;

namespace {

constexpr std::size_t max_payload = 1 << 16;

/// A peer link that never connects (on `strand`): what is sent on it is dropped.
std::shared_ptr<PeerLink> unconnected_link(Node& node, const strand_t& strand) {
    return std::make_shared<PeerLink>(
        node, NodeRecord{"node-b", "ws://node-b.test:1/v1/ws", 0, 0, "inst-b"}, "peer-secret",
        strand);
}

/// A ChannelRig's channel (id 1, started) and a mux over the rig's sink.
struct MuxRig {
    ChannelRig rig;
    std::atomic<std::int64_t> relays{0};
    ChannelMux mux{*rig.sink, max_payload, "test-peer", nullptr, &relays};

    explicit MuxRig(ChannelOptions options = channel_options()) : rig(std::move(options)) {}

    /// The route of a channel relayed over `node`'s unconnected link as `remote_id`.
    ChannelMux::Relayed route(Node& node, std::uint32_t remote_id, std::uint64_t stdin_window = 0) {
        return {.link = unconnected_link(node, rig.strand),
                .remote_id = remote_id,
                .forwarded_for = nlohmann::json::object(),
                .stdin_window = stdin_window,
                .stdin_outstanding = 0,
                .stdin_overrun = false};
    }
    void apply(const std::string& frame) {
        rig.run([&] { mux.apply_frame(frame); });
    }
};

/// What local(`id`) throws; nullopt when it returns a channel.
std::optional<rpc_error> local_error(const ChannelMux& mux, std::uint32_t id) {
    try {
        (void)mux.local(id);
    } catch (const rpc_error& e) {
        return e;
    }
    return std::nullopt;
}

}  // namespace

TEST_CASE("A connection's channel ids start at 1 and are never reused", "[mux]") {
    MuxRig m;
    CHECK(m.mux.peek_next_id() == 1);
    CHECK(m.mux.next_id() == 1);
    CHECK(m.mux.next_id() == 2);
    m.mux.add_local(2, m.rig.channel);
    m.mux.finished(2);
    CHECK(m.mux.peek_next_id() == 3);
    CHECK(m.mux.next_id() == 3);
}

TEST_CASE("A connection counts its local, relayed and reserved channels", "[mux]") {
    Node node;
    MuxRig m;
    CHECK(m.mux.count() == 0);
    m.mux.reserve();  // an open under way
    CHECK(m.mux.count() == 1);
    m.mux.add_local(1, m.rig.channel);
    m.mux.release();
    CHECK(m.mux.count() == 1);
    CHECK(m.mux.local_count() == 1);
    m.mux.opened(2, m.route(node, 20));
    CHECK(m.mux.count() == 2);
    CHECK(m.mux.local_count() == 1);
    m.mux.finished(1);
    CHECK(m.mux.take_relayed(2).has_value());
    CHECK(m.mux.count() == 0);
}

TEST_CASE("A connection tells a channel that ended from one it never had", "[mux]") {
    MuxRig m;
    const auto never = local_error(m.mux, 1);
    REQUIRE(never.has_value());
    CHECK(never->code() == errc::channel_not_found);
    CHECK(std::string(never->what()).find("is not open on this connection") != std::string::npos);
    m.mux.add_local(1, m.rig.channel);
    CHECK(m.mux.local(1) == m.rig.channel);
    CHECK(m.mux.find_local(1) == m.rig.channel);
    m.mux.finished(1);
    CHECK(m.mux.find_local(1) == nullptr);
    CHECK(m.mux.ended(1));
    const auto ended = local_error(m.mux, 1);
    REQUIRE(ended.has_value());
    CHECK(ended->code() == errc::channel_not_found);
    CHECK(std::string(ended->what()).find("has already ended") != std::string::npos);
    CHECK(ended->data()["channel"] == 1);
    // The last 4096 ended channels are remembered, no more.
    for (std::uint32_t id = 2; id <= 4097; ++id) m.mux.finished(id);
    CHECK(m.mux.ended(1) == false);
    CHECK(m.mux.ended(2));
    CHECK(m.mux.ended(4097));
}

TEST_CASE("A connection's binary frames are checked on arrival", "[mux][frames]") {
    MuxRig m;
    auto channel_of = [&](const std::string& frame) {
        auto checked = m.mux.check_frame(frame);
        REQUIRE(std::holds_alternative<std::uint32_t>(checked));
        return std::get<std::uint32_t>(checked);
    };
    auto close_code = [&](const std::string& frame) {
        auto checked = m.mux.check_frame(frame);
        REQUIRE(std::holds_alternative<websocket::close_reason>(checked));
        return std::get<websocket::close_reason>(checked).code;
    };
    CHECK(channel_of(encode_data(9, stream_id::stdin_, "x")) == 9);
    CHECK(channel_of(encode_credit(12, stream_id::stdout_, 5)) == 12);
    CHECK(close_code(std::string(5, '\x01')) == websocket::close_code::protocol_error);
    CHECK(close_code(encode_credit(1, stream_id::stdout_, 0)) ==
          websocket::close_code::protocol_error);
    CHECK(close_code(encode_data(1, stream_id::stdin_, std::string(max_payload + 1, 'x'))) ==
          websocket::close_code::too_big);
}

TEST_CASE("A connection routes stdin and credit frames to its local channel", "[mux][frames]") {
    MuxRig m(channel_options(/*output_window=*/4, /*stdin_window=*/8));
    m.mux.add_local(1, m.rig.channel);
    m.apply(encode_data(1, stream_id::stdin_, "typed"));
    CHECK(m.rig.backend->stdin_bytes == "typed");

    m.rig.write("abcdefgh");
    CHECK(m.rig.out() == "abcd");
    m.apply(encode_credit(1, stream_id::stdout_, 4));
    CHECK(m.rig.out() == "abcdefgh");

    // Dropped, never thrown: output bytes sent by the host, an unknown channel, a stdin credit.
    m.apply(encode_data(1, stream_id::stdout_, "no"));
    m.apply(encode_data(99, stream_id::stdin_, "no"));
    m.apply(encode_credit(1, stream_id::stdin_, 100));
    CHECK(m.rig.backend->stdin_bytes == "typed");
    m.rig.write("ijklm");
    CHECK(m.rig.out() == "abcdefgh");  // the stdin credit gave the output window nothing

    // A frame the channel refuses (its stdin window overrun) ends the channel, not the mux.
    m.apply(encode_data(1, stream_id::stdin_, "123456789"));
    CHECK(m.rig.backend->killed);
}

TEST_CASE("A relayed channel's frames wait for its open's result, then go in order",
          "[mux][relay]") {
    Node node;
    MuxRig m;
    const auto a = encode_data(3, stream_id::stdout_, "first");
    const auto b = encode_data(3, stream_id::stderr_, "second");
    m.mux.opening(3);
    CHECK(m.relays.load() == 1);
    m.mux.relay_binary(3, a);
    m.mux.relay_binary(3, b);
    CHECK(m.rig.sink->sent.empty());
    m.mux.opened(3, m.route(node, 30));
    REQUIRE(m.rig.sink->sent.size() == 2);
    CHECK(m.rig.sink->sent[0].bytes == a);
    CHECK(m.rig.sink->sent[1].bytes == b);
    REQUIRE(m.mux.relayed(3) != nullptr);
    CHECK(m.mux.relayed(3)->remote_id == 30);
    CHECK(m.relays.load() == 1);

    m.mux.relay_exit(3, {{"channel", 3}, {"exitCode", 0}});
    CHECK(m.rig.exits().size() == 1);
    CHECK(m.mux.relayed(3) == nullptr);
    CHECK(m.relays.load() == 0);
    m.mux.relay_binary(3, a);  // after the exit: the route is gone
    CHECK(m.rig.sink->sent.size() == 3);
}

TEST_CASE("A relayed channel whose exit overtook its open's result ends there", "[mux][relay]") {
    Node node;
    MuxRig m;
    m.mux.opening(4);
    m.mux.relay_binary(4, encode_data(4, stream_id::stdout_, "bye"));
    m.mux.relay_exit(4, {{"channel", 4}, {"exitCode", 1}});
    m.mux.opened(4, m.route(node, 40));
    REQUIRE(m.rig.sink->sent.size() == 2);
    CHECK(m.rig.sink->sent[0].binary);
    CHECK_FALSE(m.rig.sink->sent[1].binary);
    CHECK(m.mux.relayed(4) == nullptr);
    CHECK(m.relays.load() == 0);

    m.mux.opening(5);
    m.mux.relay_binary(5, encode_data(5, stream_id::stdout_, "lost"));
    m.mux.open_failed(5);  // what waited is dropped
    CHECK(m.rig.sink->sent.size() == 2);
    CHECK(m.relays.load() == 0);
}

TEST_CASE("A relay forwards stdin up to the owner's window and one frame beyond it",
          "[mux][relay]") {
    Node node;
    MuxRig m;
    m.mux.opened(6, m.route(node, 60, /*stdin_window=*/10));
    m.apply(encode_data(6, stream_id::stdin_, "123456"));
    CHECK(m.mux.relayed(6)->stdin_outstanding == 6);
    // The owner's stdin credit comes back through the relay and reaches the host.
    const auto credit = encode_credit(6, stream_id::stdin_, 4);
    m.mux.relay_binary(6, credit);
    CHECK(m.mux.relayed(6)->stdin_outstanding == 2);
    CHECK(m.rig.sink->stdin_credit(6) == 4);
    m.apply(encode_data(6, stream_id::stdin_, "abcdefgh"));  // exactly the window
    CHECK(m.mux.relayed(6)->stdin_outstanding == 10);
    CHECK_FALSE(m.mux.relayed(6)->stdin_overrun);
    m.apply(encode_data(6, stream_id::stdin_, "!"));  // the frame that overruns it still goes
    CHECK(m.mux.relayed(6)->stdin_outstanding == 11);
    CHECK(m.mux.relayed(6)->stdin_overrun);
    m.apply(encode_data(6, stream_id::stdin_, "dropped"));
    CHECK(m.mux.relayed(6)->stdin_outstanding == 11);
}

TEST_CASE("A connection that ends hangs up its local channels and forgets its relays", "[mux]") {
    Node node;
    MuxRig m;
    m.mux.add_local(1, m.rig.channel);
    m.mux.opened(2, m.route(node, 20));
    m.mux.opening(3);
    CHECK(m.relays.load() == 2);
    m.rig.run([&] { m.mux.close_all(); });
    CHECK(m.rig.backend->signals == std::vector<int>{SIGHUP});
    CHECK(m.mux.local_count() == 0);
    CHECK(m.mux.relayed(2) == nullptr);
    CHECK(m.relays.load() == 1);  // the open under way counts until it ends
}

TEST_CASE("A connection gives its relays back to the node's count when it goes", "[mux]") {
    Node node;
    ChannelRig rig;
    std::atomic<std::int64_t> node_relays{5};  // other connections' relays
    {
        ChannelMux mux(*rig.sink, max_payload, "test-peer", nullptr, &node_relays);
        mux.opening(7);
        mux.opened(8, {.link = unconnected_link(node, rig.strand),
                       .remote_id = 80,
                       .forwarded_for = nlohmann::json::object(),
                       .stdin_window = 0,
                       .stdin_outstanding = 0,
                       .stdin_overrun = false});
        CHECK(node_relays.load() == 7);
    }
    CHECK(node_relays.load() == 5);
}

TEST_CASE(
    "A connection attached to a detached channel posts its stdin and credit to the "
    "channel's strand, and detaches it when it goes",
    "[mux][detached]") {
    TempDir tmp;
    boost::asio::io_context ioc;
    const strand_t conn_strand = boost::asio::make_strand(ioc);
    const strand_t channel_strand = boost::asio::make_strand(ioc);
    auto host = std::make_shared<FakeChannelSink>(conn_strand);
    ChannelMux mux{*host, max_payload, "test-peer"};
    // The detached channel, on its own strand, its output kept.
    auto output = std::make_shared<DetachedOutput>(
        channel_strand, KeptOutput::create(tmp.path() / "kept", 1 << 20));
    auto b = FakeChannelBackend::running();
    auto* backend = b.get();
    auto channel =
        std::make_shared<Channel>(channel_strand, channel_options(), std::move(b), nullptr, output);
    output->bind(channel);
    on_strand(ioc, channel_strand, [&] { channel->start(); });
    DetachedOutput::AttachResult attached;
    auto hop = std::make_shared<StrandHopSink>(conn_strand, host);
    on_strand(ioc, channel_strand, [&] {
        attached = output->attach(hop, 3, 4, DetachedOutput::Offsets{0, 0});
    });
    on_strand(ioc, conn_strand, [&] {
        mux.add_attached(
            3, {"dch_x", channel, output, channel_strand, attached.id, std::move(hop), "host"});
        CHECK(mux.count() == 1);
        mux.apply_frame(encode_data(3, stream_id::stdin_, "in"));
    });
    REQUIRE(pump(ioc, [&] { return backend->stdin_bytes == "in"; }));
    backend->write(output_stream::out, "0123456789");
    REQUIRE(pump(ioc, [&] { return host->data(3, stream_id::stdout_) == "0123"; }));  // window 4
    auto credit = [&](std::uint32_t n) {
        on_strand(ioc, conn_strand,
                  [&] { mux.apply_frame(encode_credit(3, stream_id::stdout_, n)); });
    };
    credit(4);
    REQUIRE(pump(ioc, [&] { return host->data(3, stream_id::stdout_) == "01234567"; }));
    credit(4);
    REQUIRE(pump(ioc, [&] { return host->data(3, stream_id::stdout_) == "0123456789"; }));

    // The connection goes: the command goes on, detached, and keeps its output.
    on_strand(ioc, conn_strand, [&] { mux.close_all(); });
    REQUIRE(pump(ioc, [&] { return !output->attached(); }));
    CHECK(mux.count() == 0);
    CHECK(backend->signals.empty());
    backend->write(output_stream::out, "more");
    REQUIRE(pump(ioc, [&] { return output->kept().end(output_stream::out) == 14; }));
    CHECK(host->data(3, stream_id::stdout_) == "0123456789");
    backend->forget_events();
}
