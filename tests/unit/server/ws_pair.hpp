#pragma once
// Both ends of a WebSocket connection inside the test process: the server's end is the
// ConnStream that a Transport or Session takes, the client's a Beast WebSocket stream that the
// test reads and writes. They are the two ends of a socketpair(2), each assigned to an Asio TCP
// socket: the code under test splices into its socket (frame_guard::async_write_spliced), so
// an in-memory stream (boost/beast/_experimental/test/stream.hpp) cannot stand in, but no
// network, port or other process takes part. Everything runs on the test's io_context, which
// pump() runs until what the test waits for has happened (bounded, never a sleep).
#include "unit/server/channel_rig.hpp"

#include <sandboxd/core/net.hpp>
#include <sandboxd/core/tls.hpp>

#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/http/read.hpp>

#include <catch2/catch.hpp>

#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>

namespace sandboxd::test {

/// A message the client read: its bytes and whether it was binary.
struct ClientMessage {
    std::string bytes;
    bool binary = false;
};

/// The two ends of a socketpair: the code under test's as a ConnStream on `ours_on` (its
/// strand), the test's as a WebSocket stream on `ioc`, neither handshaken.
struct SocketEnds {
    ConnStream ours;
    websocket::stream<beast::tcp_stream> theirs;
};
inline SocketEnds socket_ends(const net::any_io_executor& ours_on, net::io_context& ioc) {
    int fds[2] = {-1, -1};
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
    beast::tcp_stream ours(ours_on);
    ours.socket().assign(net::ip::tcp::v4(), fds[0]);
    websocket::stream<beast::tcp_stream> theirs(ioc);
    theirs.next_layer().socket().assign(net::ip::tcp::v4(), fds[1]);
    return {ConnStream(std::move(ours)), std::move(theirs)};
}

class WsPair {
public:
    /// The pair on `ioc`, the server's end on a strand of its own.
    explicit WsPair(net::io_context& ioc) : WsPair(ioc, socket_ends(net::make_strand(ioc), ioc)) {}

    /// The client's upgrade request as the server read it (the client waits for the answer,
    /// which the code under test writes: finish_handshake() then reads it).
    http::request<http::string_body> start_handshake() {
        client_.async_handshake("sandboxd.test", "/v1/ws",
                                [this](beast::error_code ec) { handshake_ = ec; });
        http::request<http::string_body> request;
        std::optional<beast::error_code> read;
        http::async_read(*server_, buffer_, request,
                         [&](beast::error_code ec, std::size_t) { read = ec; });
        REQUIRE(pump(ioc_, [&] { return read.has_value(); }));
        REQUIRE_FALSE(*read);
        REQUIRE(buffer_.size() == 0);  // the client sends nothing more before the answer
        return request;
    }
    /// Waits for the client's handshake to complete; true when the server accepted.
    bool finish_handshake() {
        return pump(ioc_, [&] { return handshake_.has_value(); }) && !*handshake_;
    }

    /// The server's end (once: the code under test takes it).
    ConnStream take_server() { return std::move(*std::exchange(server_, std::nullopt)); }
    websocket::stream<beast::tcp_stream>& client() { return client_; }

    /// Writes a message from the client (text unless `binary`) and waits until it is written.
    void send(const std::string& bytes, bool binary = false) {
        client_.binary(binary);
        std::optional<beast::error_code> sent;
        client_.async_write(net::buffer(bytes),
                            [&](beast::error_code ec, std::size_t) { sent = ec; });
        REQUIRE(pump(ioc_, [&] { return sent.has_value(); }));
        REQUIRE_FALSE(*sent);
    }

    /// The next message the client reads; nullopt when the connection closed (close_code()
    /// then tells how). A read that takes over 10 s fails the test (a WebSocket stream whose
    /// read was cancelled cannot be used again, so there is no reading "for a while").
    std::optional<ClientMessage> read() {
        beast::flat_buffer in;
        std::optional<beast::error_code> got;
        client_.async_read(in, [&](beast::error_code ec, std::size_t) { got = ec; });
        if (!pump(ioc_, [&] { return got.has_value(); })) {
            beast::get_lowest_layer(client_).socket().close();
            pump(ioc_, [&] { return got.has_value(); });
            FAIL("no message within 10 s");
        }
        if (*got) return std::nullopt;
        return ClientMessage{beast::buffers_to_string(in.data()), client_.got_binary()};
    }

    /// Runs whatever is ready on the io_context (never waiting for a timer), then tells how
    /// many bytes have reached the client and are not read yet: 0 means the server has
    /// written nothing since the last read.
    std::size_t unread_bytes() {
        ioc_.restart();
        ioc_.poll();
        return beast::get_lowest_layer(client_).socket().available();
    }

    /// Ends the client's side at once, without a close handshake (the server's reads fail).
    void drop_client() {
        beast::error_code ignored;
        beast::get_lowest_layer(client_).socket().shutdown(net::socket_base::shutdown_both,
                                                           ignored);
    }

    /// The close code the server sent (after read() returned nullopt for a close).
    std::uint16_t close_code() const { return client_.reason().code; }

private:
    WsPair(net::io_context& ioc, SocketEnds ends)
        : ioc_(ioc), server_(std::move(ends.ours)), client_(std::move(ends.theirs)) {}

    net::io_context& ioc_;
    std::optional<ConnStream> server_;
    websocket::stream<beast::tcp_stream> client_;
    beast::flat_buffer buffer_;
    std::optional<beast::error_code> handshake_;
};

}  // namespace sandboxd::test
