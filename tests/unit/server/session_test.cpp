// Session (src/server/session.hpp): admission (limits.requestsPerConnection) and ordering
// (requests and frames that name a channel are applied in arrival order, those that name the
// channel an open in flight will have wait for it), on a real Node over the fake registry and
// provider (NodeHarness) and a connected pair (ws_pair.hpp): the test is the host. The fake
// provider's open waits at a gate the test opens, so an open is in flight for as long as the
// test needs, with nothing timed.
#include "server/session.hpp"
#include "support/node_harness.hpp"
#include "unit/server/ws_pair.hpp"

#include <sandboxd/core/frame.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>

#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

struct SessionRig {
    NodeHarness h;
    Lease lease;
    std::unique_ptr<WsPair> pair;
    std::shared_ptr<Session> session;
    /// Responses read so far, by id.
    std::map<int, json> responses;

    explicit SessionRig(std::size_t requests_per_connection = 64) {
        h.node.config.limits.requests_per_connection = requests_per_connection;
        lease = h.acquire();
        h.provider->open_running = true;
        h.provider->open_gate = std::make_shared<boost::asio::steady_timer>(
            h.ioc, boost::asio::steady_timer::time_point::max());
        pair = std::make_unique<WsPair>(h.ioc);
        const auto request = pair->start_handshake();
        session = std::make_shared<Session>(h.node, pair->take_server(), h.host);
        boost::asio::co_spawn(session->strand(), session->run(request), boost::asio::detached);
        REQUIRE(pair->finish_handshake());
    }
    SessionRig(const SessionRig&) = delete;
    SessionRig& operator=(const SessionRig&) = delete;
    /// Ends the commands, closes the connection and runs until the session is gone (its
    /// coroutines hold it, and it must not outlive the node).
    /// (A teardown that fails shows as a leak or use-after-free report: nothing is thrown.)
    ~SessionRig() {
        try {
            for (auto* b : h.provider->running_backends()) {
                b->end_output(output_stream::out);
                b->end_output(output_stream::err);
                b->finish(ChannelExit{});
            }
            session->shutdown();
            pair->drop_client();
            pump(h.ioc, [&] { return session.use_count() == 1; });
        } catch (...) {
            // Nothing to do: see above.
        }
        session.reset();
    }

    void call(int id, const std::string& method, json params) {
        pair->send(
            json{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", params}}.dump());
    }
    void open(int id) {
        call(id, "duplexChannelOpen",
             {{"lease",
               {{"id", lease.id},
                {"providerLeaseId", lease.provider_lease_id},
                {"companyId", lease.company_id},
                {"environmentId", lease.environment_id},
                {"metadata", {{"provider", "fake"}, {"pluginId", "builtin"}}}}},
              {"command", {"cat"}}});
    }
    /// Lets the opens in flight (and later ones) go.
    void open_gate() {
        auto gate = std::exchange(h.provider->open_gate, nullptr);
        gate->cancel();
    }
    /// Reads until the response with `id` has come (binary frames, such as stdin credit, are
    /// skipped); false when the connection ended first.
    bool await_response(int id) {
        while (!responses.count(id)) {
            auto m = pair->read();
            if (!m) return false;
            if (m->binary) continue;
            auto j = json::parse(m->bytes);
            if (j.contains("id") && j["id"].is_number()) responses[j["id"].get<int>()] = j;
        }
        return true;
    }
};

}  // namespace

TEST_CASE(
    "A request and a frame naming the channel an open in flight will have wait for it, "
    "and go in arrival order",
    "[session][order]") {
    SessionRig r;
    r.open(1);  // held at the gate: its channel will be 1
    r.pair->send(encode_data(1, stream_id::stdin_, "data"), true);
    r.call(2, "duplexChannelCloseStdin", {{"channel", 1}});
    // Neither is answered or applied while the open runs (without the wait, the close would
    // fail at once: no channel 1 yet).
    CHECK(r.pair->unread_bytes() == 0);
    REQUIRE(r.h.provider->running_backends().empty());
    r.open_gate();
    REQUIRE(r.await_response(1));
    CHECK(r.responses[1]["result"]["channel"] == 1);
    REQUIRE(r.await_response(2));
    CHECK(r.responses[2].contains("result"));
    REQUIRE(r.h.provider->running_backends().size() == 1);
    const auto* backend = r.h.provider->running_backends()[0];
    CHECK(pump(r.h.ioc, [&] { return backend->stdin_closed; }));
    CHECK(backend->stdin_bytes == "data");  // the frame before the close, as sent
}

TEST_CASE(
    "A connection over its requests in flight refuses the next one and takes more once "
    "one ends",
    "[session][admission]") {
    SessionRig r(/*requests_per_connection=*/2);
    r.open(1);
    r.open(2);
    REQUIRE(r.pair->unread_bytes() == 0);
    r.open(3);  // the third while two are in flight
    REQUIRE(r.await_response(3));
    const auto& error = r.responses[3]["error"];
    CHECK(error["code"] == -32016);
    CHECK(error["data"]["reason"] == "CHANNEL_LIMIT");
    CHECK(error["data"]["limit"] == "requestsPerConnection");
    CHECK_FALSE(r.responses.count(1));
    CHECK_FALSE(r.responses.count(2));
    r.open_gate();
    REQUIRE(r.await_response(1));
    REQUIRE(r.await_response(2));
    CHECK(r.responses[1]["result"]["channel"] == 1);
    CHECK(r.responses[2]["result"]["channel"] == 2);
    // The slots are free again.
    r.call(4, "leaseGet", {{"leaseId", r.lease.id}});
    REQUIRE(r.await_response(4));
    CHECK(r.responses[4]["result"]["id"] == r.lease.id);
}
