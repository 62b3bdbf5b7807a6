// PeerLink (src/server/peer_link.hpp): a link that cannot reach its peer fails its calls with
// OWNER_UNAVAILABLE and breaks, and PeerLinks then makes a new one (the peer's url is refused
// before any connection); and the relaying, over an in-process connection that the node's
// peer_dialer hands the link (ws_pair.hpp), with the test as the owner node: the owner's
// frames and exits renumbered to the host's channel, the host's stdin renumbered to the
// owner's, nothing relayed after a channel's exit, and transportClosed for the channels still
// open when the link dies.
#include "server/peer_link.hpp"
#include "server/node.hpp"
#include "support/node_harness.hpp"
#include "unit/server/ws_pair.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/frame.hpp>

#include <sandboxd/core/errors.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

#include <catch2/catch.hpp>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace sandboxd;

namespace {

NodeRecord peer_at(std::string url) {
    NodeRecord r;
    r.node_id = "node-b";
    r.url = std::move(url);
    r.instance_id = "inst-b";
    return r;
}

/// Runs link->call(...) to its end on `ioc` (it ends without waiting: no socket is made) and
/// returns the rpc_error it threw, or nullopt when it returned.
std::optional<rpc_error> call_error(boost::asio::io_context& ioc, PeerLink& link) {
    std::optional<rpc_error> failed;
    bool done = false;
    boost::asio::co_spawn(ioc, link.call("leaseGet", {{"leaseId", "l1"}}, nlohmann::json::object()),
                          [&](const std::exception_ptr& e, const nlohmann::json&) {
                              done = true;
                              if (!e) return;
                              try {
                                  std::rethrow_exception(e);
                              } catch (const rpc_error& r) {
                                  failed = r;
                              }
                          });
    for (int i = 0; i < 100 && !done; ++i) {
        ioc.restart();
        ioc.poll();
    }
    REQUIRE(done);
    return failed;
}

}  // namespace

TEST_CASE("A peer link that cannot reach its peer fails calls with OWNER_UNAVAILABLE and breaks",
          "[peer_link]") {
    boost::asio::io_context ioc;
    Node node;
    node.ioc = &ioc;
    auto link = std::make_shared<PeerLink>(node, peer_at("http://node-b.test:1/"), "peer-secret",
                                           boost::asio::make_strand(ioc));
    CHECK_FALSE(link->broken());
    const auto first = call_error(ioc, *link);
    REQUIRE(first.has_value());
    CHECK(first->code() == errc::owner_unavailable);
    CHECK(first->data()["ownerNodeId"] == "node-b");
    CHECK(std::string(first->what()).find("its url") != std::string::npos);
    CHECK(link->broken());
    CHECK_FALSE(link->up());
    // Broken for good: the next call fails the same way, without trying again.
    const auto second = call_error(ioc, *link);
    REQUIRE(second.has_value());
    CHECK(second->code() == errc::owner_unavailable);
    CHECK(std::string(second->what()).find("its url") != std::string::npos);
}

TEST_CASE("The node's links keep one per peer and replace a broken one", "[peer_link]") {
    boost::asio::io_context ioc;
    Node node;
    node.ioc = &ioc;
    PeerLinks links;
    const auto peer = peer_at("not a url");
    auto a = links.get(node, peer, "peer-secret", ioc);
    CHECK(links.get(node, peer, "peer-secret", ioc) == a);
    CHECK(links.states() == std::map<std::string, bool>{{"node-b", false}});
    REQUIRE(call_error(ioc, *a).has_value());
    auto b = links.get(node, peer, "peer-secret", ioc);
    CHECK(b != a);
    CHECK_FALSE(b->broken());
    links.clear();
    CHECK(links.states().empty());
}

namespace {

/// The host's connection as a relay target: what the link relays to it, in order.
struct RecordingTarget final : RelayTarget {
    explicit RecordingTarget(strand_t s) : strand(std::move(s)) {}
    strand_t strand;
    std::vector<std::pair<std::uint32_t, std::string>> frames;
    std::vector<nlohmann::json> exits;
    std::vector<nlohmann::json> gaps;
    void relay_binary(std::uint32_t local_channel, std::string frame) override {
        frames.emplace_back(local_channel, std::move(frame));
    }
    void relay_exit(std::uint32_t /*local_channel*/, nlohmann::json exit_params) override {
        exits.push_back(std::move(exit_params));
    }
    void relay_gap(std::uint32_t /*local_channel*/, nlohmann::json gap_params) override {
        gaps.push_back(std::move(gap_params));
    }
    net::any_io_executor relay_executor() override { return strand; }
};

/// The owner's side of the link: it accepts the link's upgrade and reads and writes as a node.
struct Owner {
    std::optional<websocket::stream<beast::tcp_stream>> ws;
    http::request<http::string_body> upgrade;

    void accept(net::io_context& ioc) {
        REQUIRE(test::pump(ioc, [&] { return ws.has_value(); }));
        beast::flat_buffer buffer;
        std::optional<beast::error_code> read, accepted;
        http::async_read(ws->next_layer(), buffer, upgrade,
                         [&](beast::error_code ec, std::size_t) { read = ec; });
        REQUIRE(test::pump(ioc, [&] { return read.has_value(); }));
        REQUIRE_FALSE(*read);
        ws->async_accept(upgrade, [&](beast::error_code ec) { accepted = ec; });
        REQUIRE(test::pump(ioc, [&] { return accepted.has_value(); }));
        REQUIRE_FALSE(*accepted);
    }
    /// The next message from the link (text as JSON, binary as its bytes).
    std::string read(net::io_context& ioc) {
        beast::flat_buffer in;
        std::optional<beast::error_code> got;
        ws->async_read(in, [&](beast::error_code ec, std::size_t) { got = ec; });
        REQUIRE(test::pump(ioc, [&] { return got.has_value(); }));
        REQUIRE_FALSE(*got);
        return beast::buffers_to_string(in.data());
    }
    void write(net::io_context& ioc, const std::string& bytes, bool binary) {
        ws->binary(binary);
        std::optional<beast::error_code> sent;
        ws->async_write(net::buffer(bytes), [&](beast::error_code ec, std::size_t) { sent = ec; });
        REQUIRE(test::pump(ioc, [&] { return sent.has_value(); }));
        REQUIRE_FALSE(*sent);
    }
    /// Answers the open `request` (as read()) with the owner's channel `remote`.
    void answer_open(net::io_context& ioc, const std::string& request, std::uint32_t remote) {
        const auto r = nlohmann::json::parse(request);
        REQUIRE(r["method"] == "duplexChannelOpen");
        write(ioc,
              nlohmann::json{{"jsonrpc", "2.0"}, {"id", r["id"]}, {"result", {{"channel", remote}}}}
                  .dump(),
              false);
    }
};

}  // namespace

TEST_CASE(
    "A peer link relays the owner's frames and exits under the host's channel ids, and "
    "the host's stdin under the owner's",
    "[peer_link][relay]") {
    test::NodeHarness h;
    Owner owner;
    h.node.peer_dialer = [&](const WsUrl& url,
                             const net::any_io_executor& strand) -> awaitable<ConnStream> {
        CHECK(url.endpoint.host == "node-b.test");
        auto ends = test::socket_ends(strand, h.ioc);
        owner.ws.emplace(std::move(ends.theirs));
        co_return std::move(ends.ours);
    };
    const strand_t link_strand = boost::asio::make_strand(h.ioc);
    auto link = std::make_shared<PeerLink>(h.node, peer_at("ws://node-b.test:1/v1/ws"),
                                           "peer-secret", link_strand);
    auto target = std::make_shared<RecordingTarget>(boost::asio::make_strand(h.ioc));
    const nlohmann::json forwarded_for = {{"tokenName", "host-acme"}, {"tenants", {"acme"}}};

    // Two channels, the host's 7 and 8, the owner's 42 and 43.
    std::vector<nlohmann::json> opened;
    auto open = [&](std::uint32_t local) {
        boost::asio::co_spawn(
            link_strand,
            link->open("duplexChannelOpen", {{"command", {"cat"}}}, forwarded_for, target, local),
            [&](const std::exception_ptr& e, nlohmann::json r) {
                CHECK_FALSE(e);
                opened.push_back(std::move(r));
            });
    };
    open(7);
    owner.accept(h.ioc);
    CHECK(owner.upgrade[http::field::authorization] == "Bearer peer-secret");
    CHECK(owner.upgrade["Sandboxd-Forwarded-By"] == "node-a");
    CHECK(owner.upgrade["Sandboxd-Forwarded-To"] == "node-b");
    const auto first = owner.read(h.ioc);
    CHECK(nlohmann::json::parse(first)["forwardedFor"] == forwarded_for);
    // The owner's first frame follows its answer at once: the route exists before it is read.
    owner.answer_open(h.ioc, first, 42);
    owner.write(h.ioc, encode_data(42, stream_id::stdout_, "hello"), true);
    REQUIRE(test::pump(h.ioc, [&] { return opened.size() == 1; }));
    open(8);
    owner.answer_open(h.ioc, owner.read(h.ioc), 43);
    REQUIRE(test::pump(h.ioc, [&] { return opened.size() == 2; }));
    CHECK(opened[0]["channel"] == 42);
    CHECK(opened[1]["channel"] == 43);

    owner.write(h.ioc, encode_data(43, stream_id::stderr_, "world"), true);
    owner.write(
        h.ioc,
        nlohmann::json{{"jsonrpc", "2.0"},
                       {"method", "duplexChannel.exit"},
                       {"params", {{"channel", 42}, {"exitCode", 0}, {"outcome", "exited"}}}}
            .dump(),
        false);
    owner.write(h.ioc, encode_data(42, stream_id::stdout_, "late"), true);  // after its exit
    REQUIRE(test::pump(h.ioc, [&] { return target->exits.size() == 1; }));

    // The host's stdin for its channel 8 reaches the owner as channel 43's.
    link->send_frame(encode_data(43, stream_id::stdin_, "in"));
    CHECK(owner.read(h.ioc) == encode_data(43, stream_id::stdin_, "in"));

    // The owner goes: channel 8, still open, ends as transportClosed.
    owner.ws->next_layer().socket().shutdown(net::socket_base::shutdown_both);
    REQUIRE(test::pump(h.ioc, [&] { return target->exits.size() == 2; }));
    CHECK(target->frames == std::vector<std::pair<std::uint32_t, std::string>>{
                                {7, encode_data(7, stream_id::stdout_, "hello")},
                                {8, encode_data(8, stream_id::stderr_, "world")}});
    CHECK(target->exits[0]["channel"] == 7);
    CHECK(target->exits[0]["outcome"] == "exited");
    CHECK(target->exits[1]["channel"] == 8);
    CHECK(target->exits[1]["outcome"] == "transportClosed");
    CHECK(link->broken());
    REQUIRE(test::pump(h.ioc, [&] { return link.use_count() == 1; }));
    link.reset();
}
