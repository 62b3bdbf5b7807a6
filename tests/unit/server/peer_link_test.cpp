// PeerLink (src/server/peer_link.hpp) as far as it goes without a connection: a link that
// cannot reach its peer fails its calls with OWNER_UNAVAILABLE and breaks, and PeerLinks then
// makes a new one. Nothing here opens a socket: the peer's url is refused before any.
//
// Not checked here: the relaying itself (the owner's frames and exits renumbered to the host's
// channel, the routes made before the next frame is read, the transportClosed exits when the
// link dies). A PeerLink makes its own TCP stream and connects it in ensure_connected(), and
// reads frames only from that stream, so a test cannot hand it frames without a socket. A
// constructor over a given stream, or the routing (routes_, pending_, on_text, on_binary,
// fail_all) as a class of its own that takes frames as arguments, would make it testable.
#include "server/peer_link.hpp"
#include "server/node.hpp"

#include <sandboxd/core/errors.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

#include <catch2/catch.hpp>

#include <exception>
#include <optional>
#include <string>

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
