#pragma once
/// @file client_impl.hpp
/// The transport behind a Client (client.hpp), public in the client layer for callers that
/// drive its WebSocket themselves through Client::impl(): sandboxctl's attach loop and tests
/// that send raw frames. Same rules as the Client that owns it: one thread at a time; `run`
/// blocks the calling thread for at most `timeout` and throws client_error when it expires or
/// fails.
#include <sandboxd/client/client.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/tls.hpp>

namespace sandboxd {

struct Client::Impl {
    /// `tls`: the context of a wss:// connection; null for ws://.
    explicit Impl(std::shared_ptr<ssl::context> tls)
        : ws(tls ? ConnStream(beast::tcp_stream(ioc), std::move(tls))
                 : ConnStream(beast::tcp_stream(ioc))) {}
    net::io_context ioc;
    websocket::stream<ConnStream> ws;
    std::chrono::milliseconds timeout;
    std::deque<ClientEvent> pending;
    std::int64_t next_id = 1;
    beast::flat_buffer buffer;
    /// A message read started by read_one() or poll_event() and not taken yet: poll_event()
    /// leaves it in flight when nothing arrived in time (cancelling it would close the
    /// WebSocket), and the next read takes it over. Drivers of `ws` that read themselves must
    /// not start while one is in flight.
    bool read_in_flight = false;
    bool read_done = false;
    beast::error_code read_error;

    /// Runs one async operation to completion on `ioc`; at `timeout` closes the connection
    /// (as a Beast stream timeout would) and throws client_error("timed out after N ms").
    /// The deadline is the loop's, not a Beast stream timer, so that it never touches the
    /// timer of a read left in flight.
    template <typename Start>
    void run(Start start);
    /// The next message, within `timeout` (then as run()).
    ClientEvent read_one();
    /// Runs `ioc` until the read in flight completes or `deadline`; whether it completed.
    bool wait_read(std::chrono::steady_clock::time_point deadline);
    /// Closes the connection (a timeout) and runs `ioc` until `done()`: the handler of the
    /// operation that was waiting has run and no longer refers to anything of the caller's.
    template <typename Done>
    void close_and_drain(Done done);
    /// Starts a message read unless one is in flight.
    void start_read();
    /// Decodes the completed read (throws client_error for its error).
    ClientEvent take_read();
};

}  // namespace sandboxd
