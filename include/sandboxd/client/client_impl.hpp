#pragma once
/// @file client_impl.hpp
/// The transport behind a Client (client.hpp), public in the client layer for callers that
/// drive its WebSocket themselves through Client::impl(): sandboxctl's attach loop and tests
/// that send raw frames. Same rules as the Client that owns it: one thread at a time; `run`
/// blocks the calling thread for at most `timeout` and throws client_error when it expires or fails.
#include <sandboxd/client/client.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/tls.hpp>

namespace sandboxd {

struct Client::Impl {
    /// `tls`: the context of a wss:// connection; null for ws://.
    explicit Impl(std::shared_ptr<ssl::context> tls)
        : ws(tls ? ConnStream(beast::tcp_stream(ioc), std::move(tls)) : ConnStream(beast::tcp_stream(ioc))) {}
    net::io_context ioc;
    websocket::stream<ConnStream> ws;
    std::chrono::milliseconds timeout;
    std::deque<ClientEvent> pending;
    std::int64_t next_id = 1;
    beast::flat_buffer buffer;

    /// Runs one async operation to completion on `ioc` under the timeout.
    template <typename Start>
    void run(Start start);
    ClientEvent read_one();
};

}  // namespace sandboxd
