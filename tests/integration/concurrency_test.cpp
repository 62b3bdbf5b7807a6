// Requests run concurrently on one connection (docs/protocol.md, "Concurrency"): a slow open
// beside a streaming channel, the requestsPerConnection limit, and per-channel arrival order.
// The slow open is the reference plugin worker's __slow_open__ test hook.
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <thread>

#ifndef SANDBOXD_SOURCE_DIR
#error "SANDBOXD_SOURCE_DIR must name the source tree"
#endif

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;
using clock_type = std::chrono::steady_clock;

namespace {

/// A daemon with bwrap and the reference plugin (provider "process", test hooks on).
struct PluginNode {
    explicit PluginNode(json top = json::object()) {
        json config = std::move(top);
        config["providers"] = {
            {"plugins",
             {{{"pluginId", "process-ref"},
               {"provider", "process"},
               {"command", {std::string(SANDBOXD_SOURCE_DIR) + "/plugins/process/worker"}},
               {"env",
                {{"PROCESS_PLUGIN_ROOT", (dir.path() / "leases").string()},
                 {"PROCESS_PLUGIN_TEST_HOOKS", "1"}}}}}}};
        daemon = std::make_unique<DaemonProcess>("node-a", config.dump());
    }
    TempDir dir;
    std::unique_ptr<DaemonProcess> daemon;
};

bool is_response(const ClientEvent& ev, std::int64_t id) {
    return ev.type == ClientEvent::kind::response && ev.message.value("id", json()) == id;
}

}  // namespace

TEST_CASE("A 5 s plugin open does not stall a channel streaming on the same connection",
          "[session][concurrency][plugin]") {
    PluginNode node;
    auto c = node.daemon->connect();
    auto bwrap_lease = acquire_lease(*c);
    auto plugin_lease = acquire_plugin_lease(*c);
    // A small window: the stream moves only while this connection's credit frames are applied.
    constexpr std::uint32_t window = 64 * 1024;
    auto stream_params = open_params(bwrap_lease, {"yes", "0123456789abcdef"});
    stream_params["outputWindow"] = window;
    const auto stream = c->call("duplexChannelOpen", stream_params)["channel"].get<std::uint32_t>();

    std::uint64_t streamed = 0;
    auto take = [&](const ClientEvent& ev) {
        if (ev.type == ClientEvent::kind::data && ev.channel == stream) {
            streamed += ev.bytes.size();
            c->send_credit(stream, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        }
    };
    for (auto& ev : c->take_queued()) take(ev);
    while (streamed < 4 * window) {  // flowing before the slow open starts
        auto ev = c->poll_event(milliseconds(5000));
        REQUIRE(ev);
        take(*ev);
    }

    const auto slow = c->send_request("duplexChannelOpen",
                                      open_params(plugin_lease, {"__slow_open__", "5000", "true"}));
    const auto sent = clock_type::now();
    std::optional<std::uint64_t> at_1s, at_4s;
    std::optional<ClientEvent> answer;
    while (!answer && clock_type::now() < sent + seconds(30)) {
        auto ev = c->poll_event(milliseconds(200));
        const auto elapsed = clock_type::now() - sent;
        if (!at_1s && elapsed >= seconds(1)) at_1s = streamed;
        if (!at_4s && elapsed >= seconds(4)) at_4s = streamed;
        if (!ev) continue;
        if (is_response(*ev, slow)) {
            answer = std::move(ev);
        } else {
            take(*ev);
        }
    }
    REQUIRE(answer);
    INFO("open answer: " << answer->message.dump());
    CHECK(answer->message.contains("result"));
    // The open really was outstanding from 1 s to 4 s ...
    REQUIRE(clock_type::now() - sent >= milliseconds(4500));
    REQUIRE(at_1s);
    REQUIRE(at_4s);
    // ... and meanwhile the stream kept moving: many windows, each one credited back.
    INFO("streamed between 1 s and 4 s into the open: " << (*at_4s - *at_1s) << " bytes");
    CHECK(*at_4s - *at_1s >= 16 * window);
    c->send_request("duplexChannelStop", {{"channel", stream}});
}

TEST_CASE("Requests over limits.requestsPerConnection get CHANNEL_LIMIT while the others run",
          "[session][concurrency][plugin]") {
    PluginNode node(json{{"limits", {{"requestsPerConnection", 2}}}});
    auto c = node.daemon->connect();
    auto lease = acquire_plugin_lease(*c);
    const auto first =
        c->send_request("duplexChannelOpen", open_params(lease, {"__slow_open__", "1500", "true"}));
    const auto second =
        c->send_request("duplexChannelOpen", open_params(lease, {"__slow_open__", "1500", "true"}));
    const auto third = c->send_request("nodeList", json::object());
    try {
        c->wait_response(third);
        FAIL("the third request was served");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::channel_limit);
        CHECK(std::string(e.what()) ==
              "this connection already has 2 requests in flight (limit 2)");
        CHECK(e.data() == json{{"limit", "requestsPerConnection"}, {"reason", "CHANNEL_LIMIT"}});
    }
    // The refused request answered first; the two in flight are served in full.
    CHECK(c->wait_response(first).contains("channel"));
    CHECK(c->wait_response(second).contains("channel"));
    CHECK(c->call("nodeList", json::object()).contains("nodes"));
}

TEST_CASE("Requests and data frames naming one channel are applied in arrival order",
          "[session][concurrency]") {
    DaemonProcess daemon;
    auto c = daemon.connect();
    auto lease = acquire_lease(*c);
    const auto ch =
        c->call("duplexChannelOpen", open_params(lease, {"cat"}))["channel"].get<std::uint32_t>();
    std::string expected;
    std::vector<std::int64_t> requests;
    for (int i = 0; i < 300; ++i) {
        const std::string piece = (i % 2 ? "r" : "f") + std::to_string(i) + ";";
        expected += piece;
        if (i % 2) {
            requests.push_back(c->send_request("duplexChannelWrite",
                                               {{"channel", ch}, {"data", base64_encode(piece)}}));
        } else {
            c->send_stdin(ch, piece);
        }
    }
    requests.push_back(c->send_request("duplexChannelCloseStdin", {{"channel", ch}}));
    std::string out;
    std::size_t answered = 0;
    bool exited = false;
    const auto deadline = clock_type::now() + seconds(60);
    while ((!exited || answered < requests.size()) && clock_type::now() < deadline) {
        auto ev = c->poll_event(milliseconds(200));
        if (!ev) continue;
        if (ev->type == ClientEvent::kind::data && ev->channel == ch) {
            out += ev->bytes;
            c->send_credit(ch, ev->stream, static_cast<std::uint32_t>(ev->bytes.size()));
        } else if (ev->type == ClientEvent::kind::response) {
            INFO(ev->message.dump());
            CHECK(ev->message.contains("result"));
            ++answered;
        } else if (ev->type == ClientEvent::kind::notification &&
                   ev->message.value("method", "") == "duplexChannel.exit") {
            exited = true;
        }
    }
    CHECK(exited);
    CHECK(answered == requests.size());
    CHECK(out == expected);
}
