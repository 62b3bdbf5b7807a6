// Transport (src/server/transport.hpp) without a connection: its stream is a TCP stream that
// was never opened (no socket exists), so nothing it queues is ever written. What that leaves
// to check is the queue's side of the contract: the bytes it counts toward the send budgets
// and has_room(), close() from another thread, what is dropped once it closes, and the end of
// serve() (the queue emptied, the budget given back, spliced frames failed, feeders woken).
// The order in which queued messages reach the peer, and the order in which the peer's reach
// the receiver, are checked over a connected pair (ws_pair.hpp).
#include "server/transport.hpp"
#include "unit/server/channel_rig.hpp"
#include "unit/server/ws_pair.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;

namespace {

/// Takes whatever the peer sends (never called here: nothing is read).
struct NullReceiver final : Transport::Receiver {
    virtual ~NullReceiver() = default;  // Receiver's own is protected: never deleted through it
    awaitable<void> on_text(std::string_view) override { co_return; }
    std::optional<websocket::close_reason> on_binary(std::string_view) override {
        return std::nullopt;
    }
};

struct TransportRig {
    boost::asio::io_context ioc;
    strand_t strand = boost::asio::make_strand(ioc);
    LimitsConfig limits;
    SendBudget budget{/*node_bytes=*/1000, /*connection_bytes=*/100};
    Transport transport{ConnStream(beast::tcp_stream(strand)), limits, &budget};

    void run(const std::function<void()>& f) { on_strand(ioc, strand, f); }
};

}  // namespace

TEST_CASE("A transport counts what it queues toward its send budgets", "[transport]") {
    TransportRig t;
    int woken = 0;
    t.transport.on_written([&] { ++woken; });
    t.run([&] {
        CHECK(t.transport.has_room());
        t.transport.send(false, std::string(60, 't'));
        CHECK(t.transport.queued_bytes() == 60);
        CHECK(t.budget.queued() == 60);
        CHECK(t.transport.has_room());
        t.transport.send(true, std::string(40, 'b'));  // the connection's budget, exactly
        CHECK(t.transport.queued_bytes() == 100);
        CHECK(t.budget.queued() == 100);
        CHECK_FALSE(t.transport.has_room());
        CHECK_FALSE(t.transport.held_by_node());  // its own budget holds it, not the node's
    });
    CHECK(woken == 0);  // nothing written yet: serve() is not running
}

TEST_CASE("A transport's close() takes effect on its strand, and what follows is dropped",
          "[transport]") {
    TransportRig t;
    t.run([&] { t.transport.send(false, std::string(100, 'q')); });
    CHECK_FALSE(t.transport.has_room());
    t.transport.close(websocket::close_code::going_away, nullptr);  // from off the strand
    settle(t.ioc);
    t.run([&] {
        CHECK(t.transport.closing());
        // What was queued before the close stays queued, to be written before the close frame.
        CHECK(t.transport.queued_bytes() == 100);
        CHECK_FALSE(t.transport.close_written());
        CHECK(t.transport.has_room());                  // feeders drain and stop
        t.transport.send(false, std::string(10, 'x'));  // dropped
        CHECK(t.transport.queued_bytes() == 100);
        CHECK(t.budget.queued() == 100);
    });
}

TEST_CASE("A closed transport fails a spliced frame, later, on its strand", "[transport]") {
    TransportRig t;
    t.transport.close(websocket::close_code::going_away, nullptr);
    settle(t.ioc);
    std::vector<bool> done;
    t.run([&] {
        t.transport.send_spliced(websocket_binary_header(10), -1, 10,
                                 [&](bool written) { done.push_back(written); });
        CHECK_FALSE(t.transport.can_splice());
        CHECK(done.empty());  // never inside the call
    });
    CHECK(done == std::vector<bool>{false});
}

TEST_CASE("A transport's serve() ends with its queue empty and its budget given back",
          "[transport]") {
    TransportRig t;
    int woken = 0;
    t.transport.on_written([&] { ++woken; });
    std::vector<bool> spliced;
    t.run([&] {
        t.transport.send(false, "{\"jsonrpc\":\"2.0\"}");
        t.transport.send_spliced(websocket_binary_header(10), -1, 10,
                                 [&](bool written) { spliced.push_back(written); });
        t.transport.send(true, std::string(30, 'b'));
    });
    REQUIRE(t.budget.queued() > 0);
    NullReceiver receiver;
    bool served = false;
    boost::asio::co_spawn(t.strand, t.transport.serve(receiver),
                          [&](const std::exception_ptr&) { served = true; });
    // The stream was never opened: every loop ends at once, and serve() with them.
    for (int i = 0; i < 100 && !served; ++i) settle(t.ioc);
    settle(t.ioc);
    REQUIRE(served);
    CHECK(t.transport.closing());
    CHECK(t.transport.close_written());
    CHECK(t.transport.queued_bytes() == 0);
    CHECK(t.budget.queued() == 0);
    CHECK(t.budget.active() == 0);
    CHECK(woken >= 1);
    CHECK(spliced == std::vector<bool>{false});
}

namespace {

/// A transport over a connected pair (ws_pair.hpp), its upgrade accepted, serving `receiver`
/// on its strand until the connection ends (`served`).
struct ServedTransport {
    boost::asio::io_context ioc;
    WsPair pair{ioc};
    LimitsConfig limits;
    http::request<http::string_body> request;
    std::optional<Transport> transport;
    bool served = false;

    explicit ServedTransport(Transport::Receiver& receiver) {
        request = pair.start_handshake();
        transport.emplace(pair.take_server(), limits);
        boost::asio::co_spawn(
            transport->strand(),
            // clang-tidy 14 takes a coroutine lambda for one that may throw out of a
            // noexcept function; the exception goes to the completion handler below.
            // NOLINTNEXTLINE(bugprone-exception-escape)
            [this, &receiver]() -> awaitable<void> {
                if (co_await transport->accept(request)) co_await transport->serve(receiver);
            },
            [this](const std::exception_ptr&) { served = true; });
        REQUIRE(pair.finish_handshake());
    }
};

}  // namespace

TEST_CASE(
    "A transport writes its messages in the order queued, spliced frames among them, "
    "and the close frame after them",
    "[transport][order]") {
    NullReceiver receiver;
    ServedTransport t(receiver);
    auto& transport = *t.transport;

    // The spliced frame's payload waits in a pipe, as a channel's output does.
    int pipe_fds[2] = {-1, -1};
    REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
    REQUIRE(::write(pipe_fds[1], "third", 5) == 5);
    std::vector<bool> spliced;
    on_strand(t.ioc, transport.strand(), [&] {
        REQUIRE(transport.can_splice());
        transport.send(false, "first");
        transport.send(true, "second");
        transport.send_spliced(websocket_binary_header(5), pipe_fds[0], 5,
                               [&](bool written) { spliced.push_back(written); });
        transport.send(false, "fourth");
    });
    transport.close(websocket::close_code::normal, nullptr);  // after all four, from off the strand

    std::vector<std::pair<std::string, bool>> got;
    while (auto m = t.pair.read()) got.emplace_back(m->bytes, m->binary);
    CHECK(got == std::vector<std::pair<std::string, bool>>{
                     {"first", false}, {"second", true}, {"third", true}, {"fourth", false}});
    CHECK(t.pair.close_code() == websocket::close_code::normal);
    CHECK(spliced == std::vector<bool>{true});
    CHECK(transport.close_written());
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    // The client answers the close (Beast does when it reads one), and serve() ends.
    CHECK(pump(t.ioc, [&] { return t.served; }));
    CHECK(transport.queued_bytes() == 0);
}

TEST_CASE("A transport hands the peer's messages to its receiver in the order sent",
          "[transport][order]") {
    struct Recorder final : Transport::Receiver {
        virtual ~Recorder() = default;
        std::vector<std::string> got;
        awaitable<void> on_text(std::string_view text) override {
            got.emplace_back("text:" + std::string(text));
            co_return;
        }
        std::optional<websocket::close_reason> on_binary(std::string_view message) override {
            got.emplace_back("binary:" + std::string(message));
            if (message == "bad")
                return websocket::close_reason(websocket::close_code::protocol_error);
            return std::nullopt;
        }
    };
    Recorder receiver;
    ServedTransport t(receiver);
    t.pair.send("a");
    t.pair.send("b", true);
    t.pair.send("c");
    t.pair.send("bad", true);  // the receiver's close reason ends the connection
    CHECK_FALSE(t.pair.read());
    CHECK(t.pair.close_code() == websocket::close_code::protocol_error);
    CHECK(receiver.got == std::vector<std::string>{"text:a", "binary:b", "text:c", "binary:bad"});
    CHECK(pump(t.ioc, [&] { return t.served; }));
}
