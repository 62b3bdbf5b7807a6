// frame_guard's write side (src/server/frame_guard.hpp): frames spliced from a pipe around
// Beast never land inside one of Beast's frames, whatever Beast writes meanwhile (messages,
// pings, automatic pongs). A real TCP connection on loopback with small socket buffers, so
// that writes are partial and wait for room; a Beast client checks every message and frame.
#include "server/frame_guard.hpp"

#include <sandboxd/core/tls.hpp>
#include <sandboxd/core/unique_fd.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <csignal>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using namespace sandboxd;

namespace {

/// The bytes of spliced frame `j`: its size and a pattern that differs per frame and offset.
std::string spliced_payload(int j) {
    const std::size_t size = 1 + static_cast<std::size_t>(j) * 7919 % (200 * 1024);
    std::string out(size, '\0');
    for (std::size_t i = 0; i < size; ++i)
        out[i] = static_cast<char>('a' + (i * 31 + static_cast<std::size_t>(j)) % 26);
    return out;
}

/// A frame_guard on one end of a loopback TCP connection, and a pipe holding "abc".
struct GuardedPipe {
    net::io_context ioc;
    tcp::acceptor acceptor{ioc, tcp::endpoint(net::ip::address_v4::loopback(), 0)};
    tcp::socket client_socket{ioc};
    std::optional<frame_guard<ConnStream>> guard;
    unique_fd pipe_r;
    unique_fd pipe_w;

    /// `frames`: call begin_frames() (no handshake here: frames from the first byte).
    explicit GuardedPipe(bool frames) {
        client_socket.connect(acceptor.local_endpoint());
        guard.emplace(ConnStream{beast::tcp_stream{acceptor.accept()}});
        if (frames) guard->begin_frames();
        int fds[2];
        REQUIRE(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0);
        pipe_r.reset(fds[0]);
        pipe_w.reset(fds[1]);
        REQUIRE(::write(pipe_w.get(), "abc", 3) == 3);
    }
    std::tuple<net::io_context&, frame_guard<ConnStream>&, unique_fd&, unique_fd&> parts() {
        return {ioc, *guard, pipe_r, pipe_w};
    }
};

}  // namespace

TEST_CASE("Frames spliced around Beast never interleave with its messages, pings or pongs",
          "[frame_guard]") {
    constexpr int texts = 300;
    constexpr int splices = 120;
    constexpr int pings = 200;
    // As in the daemon: a splice into a socket the peer closed is EPIPE, not a signal.
    std::signal(SIGPIPE, SIG_IGN);
    net::io_context ioc;
    tcp::acceptor acceptor(ioc, tcp::endpoint(net::ip::address_v4::loopback(), 0));
    tcp::socket client_socket(ioc);
    client_socket.connect(acceptor.local_endpoint());
    tcp::socket server_socket = acceptor.accept();
    // A small send buffer: writes are partial and wait for room, mid-frame. (A small receive
    // buffer at the client as well stalls loopback TCP in its zero-window probes for tens of
    // seconds: the client had read everything while 32 KiB stayed queued at the server.)
    server_socket.set_option(net::socket_base::send_buffer_size(4096));

    using Guarded = websocket::stream<frame_guard<ConnStream>>;
    Guarded server(
        frame_guard<ConnStream>(ConnStream(beast::tcp_stream(std::move(server_socket)))));
    websocket::stream<beast::tcp_stream> client(beast::tcp_stream(std::move(client_socket)));
    REQUIRE(server.next_layer().can_splice());

    int pipe_fds[2];
    REQUIRE(::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0);
    const unique_fd pipe_r(pipe_fds[0]);
    const unique_fd pipe_w(pipe_fds[1]);
    REQUIRE(::fcntl(pipe_w.get(), F_SETPIPE_SZ, 1 << 20) >= 256 * 1024);

    std::vector<std::string> got_texts;
    std::vector<std::string> got_binaries;
    int server_pings_seen = 0;  // at the client: the server's pings
    int client_pongs_seen = 0;  // at the client: the server's automatic pongs
    std::string failure;

    client.control_callback([&](websocket::frame_type kind, beast::string_view) {
        if (kind == websocket::frame_type::ping) ++server_pings_seen;
        if (kind == websocket::frame_type::pong) ++client_pongs_seen;
    });

    auto fail = [&](const std::string& what, const beast::error_code& ec) {
        if (failure.empty()) failure = what + ": " + ec.message();
    };

    // Server: a read loop (it answers the client's pings), a text writer, a pinger and a
    // splicer, all at once on one thread.
    auto server_reader = [&]() -> net::awaitable<void> {
        beast::flat_buffer buffer;
        for (;;) {
            auto [ec, n] = co_await server.async_read(buffer, as_tuple_awaitable);
            if (ec) co_return;  // the client's close ends it
            buffer.consume(n);
        }
    };
    auto server_texts = [&]() -> net::awaitable<void> {
        server.text(true);
        for (int i = 0; i < texts; ++i) {
            const std::string message = "text " + std::to_string(i) +
                                        std::string(static_cast<std::size_t>(i) * 37 % 3000, 't');
            auto [ec, n] = co_await server.async_write(net::buffer(message), as_tuple_awaitable);
            if (ec) co_return fail("server text", ec);
        }
    };
    auto server_pinger = [&]() -> net::awaitable<void> {
        for (int i = 0; i < pings; ++i) {
            auto [ec] = co_await server.async_ping("s", as_tuple_awaitable);
            if (ec) co_return fail("server ping", ec);
        }
    };
    auto server_splicer = [&]() -> net::awaitable<void> {
        for (int j = 0; j < splices; ++j) {
            const std::string payload = spliced_payload(j);
            const std::string prefix = "bin " + std::to_string(j) + ":";
            if (::write(pipe_w.get(), payload.data(), payload.size()) !=
                static_cast<ssize_t>(payload.size())) {
                co_return fail("filling the pipe",
                               beast::error_code(errno, beast::system_category()));
            }
            auto [ec, n] = co_await server.next_layer().async_write_spliced(
                websocket_binary_header(prefix.size() + payload.size()) + prefix, pipe_r.get(),
                payload.size(), as_tuple_awaitable);
            if (ec) co_return fail("server splice", ec);
            CHECK(n == websocket_binary_header(prefix.size() + payload.size()).size() +
                           prefix.size() + payload.size());
        }
    };
    // Client: reads everything and pings the server meanwhile.
    auto client_reader = [&]() -> net::awaitable<void> {
        beast::flat_buffer buffer;
        while (static_cast<int>(got_texts.size()) < texts ||
               static_cast<int>(got_binaries.size()) < splices) {
            auto [ec, n] = co_await client.async_read(buffer, as_tuple_awaitable);
            if (ec) co_return fail("client read", ec);
            const auto data = buffer.data();
            std::string message(static_cast<const char*>(data.data()), data.size());
            (client.got_text() ? got_texts : got_binaries).push_back(std::move(message));
            buffer.consume(n);
        }
        // Every pong of the client's pings has come once the server read them all; the close
        // handshake comes after the pongs on the same stream.
        auto [cec] = co_await client.async_close(websocket::close_code::normal, as_tuple_awaitable);
        (void)cec;
    };
    auto client_pinger = [&]() -> net::awaitable<void> {
        for (int i = 0; i < pings; ++i) {
            auto [ec] = co_await client.async_ping("c", as_tuple_awaitable);
            if (ec) co_return fail("client ping", ec);
        }
    };

    net::co_spawn(
        ioc,
        [&]() -> net::awaitable<void> {
            auto [ec] = co_await server.async_accept(as_tuple_awaitable);
            if (ec) co_return fail("accept", ec);
            server.next_layer().begin_frames();  // as the transport does after its handshake
            net::co_spawn(ioc, server_reader(), net::detached);
            net::co_spawn(ioc, server_texts(), net::detached);
            net::co_spawn(ioc, server_pinger(), net::detached);
            net::co_spawn(ioc, server_splicer(), net::detached);
        },
        net::detached);
    net::co_spawn(
        ioc,
        [&]() -> net::awaitable<void> {
            auto [ec] = co_await client.async_handshake("127.0.0.1", "/", as_tuple_awaitable);
            if (ec) co_return fail("handshake", ec);
            net::co_spawn(ioc, client_pinger(), net::detached);
            co_await client_reader();
        },
        net::detached);
    ioc.run_for(std::chrono::seconds(60));

    int client_inq = -1;
    ::ioctl(client.next_layer().socket().native_handle(), FIONREAD, &client_inq);
    int server_outq = -1;
    ::ioctl(beast::get_lowest_layer(server).socket().native_handle(), TIOCOUTQ, &server_outq);
    int pipe_left = -1;
    ::ioctl(pipe_r.get(), FIONREAD, &pipe_left);
    INFO("client inq " << client_inq << ", server outq " << server_outq << ", pipe " << pipe_left);
    INFO("texts " << got_texts.size() << ", spliced " << got_binaries.size() << ", server pings "
                  << server_pings_seen << ", pongs " << client_pongs_seen << "; "
                  << server.next_layer().write_state());
    REQUIRE(failure.empty());
    REQUIRE(got_texts.size() == static_cast<std::size_t>(texts));
    REQUIRE(got_binaries.size() == static_cast<std::size_t>(splices));
    for (int i = 0; i < texts; ++i) {
        CHECK(got_texts[static_cast<std::size_t>(i)] ==
              "text " + std::to_string(i) +
                  std::string(static_cast<std::size_t>(i) * 37 % 3000, 't'));
    }
    for (int j = 0; j < splices; ++j) {
        CHECK(got_binaries[static_cast<std::size_t>(j)] ==
              "bin " + std::to_string(j) + ":" + spliced_payload(j));
    }
    CHECK(server_pings_seen == pings);
    CHECK(client_pongs_seen == pings);
    int left = 0;
    CHECK(::ioctl(pipe_r.get(), FIONREAD, &left) == 0);
    CHECK(left == 0);
    // Every path of the gate ran: waits for room, splices waiting for Beast's frame to end,
    // Beast's writes waiting for a splice.
    const auto& stats = server.next_layer().write_stats();
    CHECK(stats.splice_waits > 0);
    CHECK(stats.splices_parked > 0);
    CHECK(stats.writes_deferred > 0);
}

TEST_CASE("A spliced frame whose pipe holds fewer bytes than it declared fails with message_size",
          "[frame_guard]") {
    GuardedPipe t(true);
    auto [ioc, guard, pipe_r, pipe_w] = t.parts();
    beast::error_code result;
    std::size_t written = 0;
    guard.async_write_spliced(websocket_binary_header(10), pipe_r.get(), 10,
                              [&](beast::error_code ec, std::size_t n) {
                                  result = ec;
                                  written = n;
                              });
    ioc.run_for(std::chrono::seconds(10));
    CHECK(result == net::error::message_size);
    CHECK(written == 2 + 3);  // the header and the 3 bytes there were
}

TEST_CASE("After a spliced frame failed, the next one fails at once and writes nothing",
          "[frame_guard]") {
    GuardedPipe t(true);
    auto [ioc, guard, pipe_r, pipe_w] = t.parts();
    std::vector<beast::error_code> results;
    std::vector<std::size_t> written;
    const auto record = [&](beast::error_code ec, std::size_t n) {
        results.push_back(ec);
        written.push_back(n);
    };
    guard.async_write_spliced(websocket_binary_header(10), pipe_r.get(), 10, record);
    ioc.run_for(std::chrono::seconds(10));
    REQUIRE(results.size() == 1);
    // The peer holds a cut frame: 3 more bytes in the pipe must not be taken as its rest.
    REQUIRE(::write(pipe_w.get(), "def", 3) == 3);
    guard.async_write_spliced(websocket_binary_header(3), pipe_r.get(), 3, record);
    ioc.restart();
    ioc.run_for(std::chrono::seconds(10));
    REQUIRE(results.size() == 2);
    CHECK(results[1] == net::error::message_size);
    CHECK(written[1] == 0);
    int queued = -1;
    CHECK(::ioctl(pipe_r.get(), FIONREAD, &queued) == 0);
    CHECK(queued == 3);
}

TEST_CASE("A spliced frame waiting for the end of Beast's frame fails when cancelled",
          "[frame_guard]") {
    // Beast writes a message the client never reads, so its frame stays unfinished; a spliced
    // frame waits for its end. Cancelling the spliced frame (the connection ending) completes
    // it with operation_aborted at once, having written nothing.
    net::io_context ioc;
    tcp::acceptor acceptor(ioc, tcp::endpoint(net::ip::address_v4::loopback(), 0));
    tcp::socket client_socket(ioc);
    client_socket.connect(acceptor.local_endpoint());
    tcp::socket server_socket = acceptor.accept();
    server_socket.set_option(net::socket_base::send_buffer_size(4096));
    using Guarded = websocket::stream<frame_guard<ConnStream>>;
    Guarded server(
        frame_guard<ConnStream>(ConnStream(beast::tcp_stream(std::move(server_socket)))));
    websocket::stream<beast::tcp_stream> client(beast::tcp_stream(std::move(client_socket)));
    bool accepted = false;
    bool handshaken = false;
    server.async_accept([&](beast::error_code ec) { accepted = !ec; });
    client.async_handshake("localhost", "/", [&](beast::error_code ec) { handshaken = !ec; });
    for (int i = 0; i < 200 && !(accepted && handshaken); ++i)
        ioc.run_one_for(std::chrono::milliseconds(50));
    REQUIRE(accepted);
    REQUIRE(handshaken);
    server.next_layer().begin_frames();
    server.auto_fragment(false);
    server.binary(true);
    // From here on the client reads nothing.
    ioc.restart();  // it ran out of work after the handshake

    int pipe_fds[2];
    REQUIRE(::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0);
    const unique_fd pipe_r(pipe_fds[0]);
    const unique_fd pipe_w(pipe_fds[1]);
    REQUIRE(::write(pipe_w.get(), "abc", 3) == 3);

    const std::string big(8 << 20, 'b');  // far more than the socket buffers hold
    beast::error_code beast_result;
    bool beast_done = false;
    bool spliced_done = false;
    beast::error_code spliced_result;
    std::size_t spliced_written = 99;
    net::cancellation_signal cancel;
    net::post(ioc, [&] {
        server.async_write(net::buffer(big), [&](beast::error_code ec, std::size_t) {
            beast_result = ec;
            beast_done = true;
        });
        server.next_layer().async_write_spliced(
            websocket_binary_header(3), pipe_r.get(), 3,
            net::bind_cancellation_slot(cancel.slot(), [&](beast::error_code ec, std::size_t n) {
                spliced_result = ec;
                spliced_written = n;
                spliced_done = true;
            }));
    });
    // Until the spliced frame is parked behind Beast's unfinished frame.
    for (int i = 0; i < 200 && server.next_layer().write_stats().splices_parked == 0; ++i) {
        ioc.run_one_for(std::chrono::milliseconds(50));
    }
    INFO(server.next_layer().write_state()
         << " spliced_done=" << spliced_done << " " << spliced_result.message());
    REQUIRE(server.next_layer().write_stats().splices_parked == 1);
    CHECK_FALSE(spliced_done);
    cancel.emit(net::cancellation_type::terminal);
    for (int i = 0; i < 200 && !spliced_done; ++i) ioc.run_one_for(std::chrono::milliseconds(50));
    REQUIRE(spliced_done);
    CHECK(spliced_result == net::error::operation_aborted);
    CHECK(spliced_written == 0);
    CHECK_FALSE(beast_done);  // Beast's frame was still being written
    int queued = -1;
    CHECK(::ioctl(pipe_r.get(), FIONREAD, &queued) == 0);
    CHECK(queued == 3);  // the pipe's bytes untouched
    // Beast's write ends when the socket does.
    beast::get_lowest_layer(server).socket().close();
    for (int i = 0; i < 200 && !beast_done; ++i) ioc.run_one_for(std::chrono::milliseconds(50));
    CHECK(beast_done);
    CHECK(beast_result);
}

TEST_CASE("A spliced frame before the handshake's end fails and writes nothing", "[frame_guard]") {
    // Until begin_frames(), what is written (the HTTP upgrade response) is no frame, so the
    // guard cannot know where a frame may start.
    GuardedPipe t(false);
    auto [ioc, guard, pipe_r, pipe_w] = t.parts();
    beast::error_code result;
    std::size_t written = 99;
    guard.async_write_spliced(websocket_binary_header(3), pipe_r.get(), 3,
                              [&](beast::error_code ec, std::size_t n) {
                                  result = ec;
                                  written = n;
                              });
    ioc.run_for(std::chrono::seconds(10));
    CHECK(result == net::error::operation_not_supported);
    CHECK(written == 0);
    int queued = -1;
    CHECK(::ioctl(pipe_r.get(), FIONREAD, &queued) == 0);
    CHECK(queued == 3);
}
