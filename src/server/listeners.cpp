#include "server/listeners.hpp"

#include "server/http_routes.hpp"
#include "server/http_util.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>

namespace sandboxd {

void Listeners::bind() {
    bound_ = bind(acceptor_, node_.config.listen, "listen");
    if (!node_.config.plain_listen.empty()) {
        plain_bound_ = bind(plain_acceptor_, node_.config.plain_listen, "plainListen");
    }
}

std::string Listeners::bind(tcp::acceptor& acc, const std::string& address,
                            const std::string& field) {
    const auto listen = parse_host_port(address);  // validate_config checked it
    tcp::resolver resolver(ioc_);
    beast::error_code ec;
    auto results = resolver.resolve(listen.host, listen.port_text(),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
    if (ec || results.empty()) {
        throw config_error("config: " + field + ": cannot resolve " + address + ": " +
                           ec.message());
    }
    tcp::endpoint endpoint = results.begin()->endpoint();
    acc.open(endpoint.protocol());
    acc.set_option(net::socket_base::reuse_address(true));
    acc.bind(endpoint, ec);
    if (ec)
        throw config_error("config: " + field + ": cannot bind " + address + ": " + ec.message());
    acc.listen(net::socket_base::max_listen_connections);
    return format_endpoint(acc.local_endpoint());
}

void Listeners::start() {
    start_loops();
    set_caps();
    const bool tls = node_.security()->listener_tls != nullptr;
    const auto failed = logged_as("daemon task");
    net::co_spawn(ioc_, accept_loop(acceptor_, tls, listener_kind::main), failed);
    if (plain_acceptor_.is_open()) {
        net::co_spawn(ioc_, accept_loop(plain_acceptor_, false, listener_kind::plain), failed);
    }
}

void Listeners::close() {
    beast::error_code ec;
    acceptor_.close(ec);
    plain_acceptor_.close(ec);
}

void Listeners::start_loops() {
    if (!loops_.empty()) return;
    const unsigned n = node_.config.threads ? node_.config.threads
                                            : std::max(1U, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < n; ++i) {
        loops_.push_back(std::make_unique<net::io_context>(1));
        work_.push_back(net::make_work_guard(*loops_.back()));
    }
    for (auto& loop : loops_) {
        threads_.emplace_back([&ctx = *loop] { ctx.run(); });
    }
}

void Listeners::stop_loops() {
    work_.clear();
    for (auto& loop : loops_) loop->stop();
    for (auto& t : threads_) {
        if (t.joinable()) t.join();
    }
    threads_.clear();
}

net::io_context& Listeners::next_loop() {
    const auto i = next_loop_.fetch_add(1, std::memory_order_relaxed) % (loops_.size() + 1);
    return i == 0 ? ioc_ : *loops_[i - 1];
}

void Listeners::set_caps() {
    const auto& l = node_.config.limits;
    rlimit lim{};
    std::uint64_t nofile = 1024;
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
        nofile = lim.rlim_cur;
    // The greater of 256 and a tenth, but never more than half: a node run with a tiny limit
    // (a test of descriptor exhaustion) still takes connections.
    const std::uint64_t reserve =
        std::min<std::uint64_t>(std::max<std::uint64_t>(256, nofile / 10), nofile / 2);
    const std::uint64_t room = nofile > reserve ? nofile - reserve : 0;
    counts_.cap = static_cast<std::uint32_t>(std::min<std::uint64_t>(l.connections, room));
    counts_.pending_cap =
        static_cast<std::uint32_t>(std::min<std::uint64_t>(l.pending_connections, counts_.cap));
    spdlog::info(
        "node={} connections: at most {} open and {} not yet authenticated (limits.connections "
        "{}, limits.pendingConnections {}; {} of RLIMIT_NOFILE {} kept for the node's own work)",
        node_.node_id, counts_.cap, counts_.pending_cap, l.connections, l.pending_connections,
        reserve, nofile);
    if (counts_.cap == 0) {
        spdlog::error(
            "node={} RLIMIT_NOFILE {} leaves no descriptor for connections beyond the "
            "reserve of {}: every connection is refused",
            node_.node_id, nofile, reserve);
    }
}

std::optional<ConnectionSlot> Listeners::admit(std::string& refused_by) {
    // Counted first, then checked: two accepts on two listeners never both take the last place.
    const auto open = counts_.open.fetch_add(1, std::memory_order_acq_rel);
    const auto pending = counts_.pending.fetch_add(1, std::memory_order_acq_rel);
    if (open >= counts_.cap || pending >= counts_.pending_cap) {
        counts_.open.fetch_sub(1, std::memory_order_acq_rel);
        counts_.pending.fetch_sub(1, std::memory_order_acq_rel);
        refused_by = open >= counts_.cap ? "connections" : "pendingConnections";
        return std::nullopt;
    }
    return std::optional<ConnectionSlot>(std::in_place, counts_);
}

void Listeners::refuse(int fd, const std::string& refused_by) {
    node_.metrics.connections_refused.with({refused_by}).inc();
    const auto cap = refused_by == "connections" ? counts_.cap : counts_.pending_cap;
    const std::string body = "node at its connection limit (limits." + refused_by + ", " +
                             std::to_string(cap) + "); try again later\n";
    const std::string res = "HTTP/1.1 503 Service Unavailable\r\nServer: sandboxd/" +
                            std::string(version_string) +
                            "\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
                            "Connection: close\r\nContent-Length: " +
                            std::to_string(body.size()) + "\r\n\r\n" + body;
    // One non-blocking send into an empty socket buffer: it takes the whole answer or the
    // peer gets the close alone. Over TLS the peer sees a failed handshake (closed).
    (void)::send(fd, res.data(), res.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_RDWR);
}

awaitable<void> Listeners::accept_loop(tcp::acceptor& acc, bool tls, listener_kind listener) {
    // A failed accept (EMFILE, ENFILE, ENOBUFS) leaves the connection in the backlog: retrying
    // at once would spin. Back off 10 ms, doubling to 1 s, and log once per streak.
    // (The wait sits outside the scope of the accept's structured binding: GCC 12 corrupts a
    // binding that lives across a second suspension in a nested scope.)
    net::steady_timer backoff(ioc_);
    std::chrono::milliseconds delay{0};
    for (;;) {
        if (delay.count() != 0) {
            backoff.expires_after(delay);
            auto waited = co_await backoff.async_wait(as_tuple_awaitable);
            if (std::get<0>(waited) || !acc.is_open()) co_return;
        }
        auto [ec, socket] =
            co_await acc.async_accept(net::make_strand(next_loop()), as_tuple_awaitable);
        if (ec) {
            if (ec == net::error::operation_aborted || !acc.is_open()) co_return;
            if (delay.count() == 0) spdlog::warn("accept failed: {}; backing off", ec.message());
            delay = std::min<std::chrono::milliseconds>(
                delay.count() == 0 ? std::chrono::milliseconds(10) : delay * 2,
                std::chrono::milliseconds(1000));
            continue;
        }
        if (delay.count() != 0) spdlog::info("accepting connections again");
        delay = std::chrono::milliseconds(0);
        std::string refused_by;
        auto slot = admit(refused_by);
        if (!slot) {
            // At a cap: refused at once, the accepts go on (the reserve keeps descriptors for
            // this and for the node's own work).
            refuse(socket.native_handle(), refused_by);
            beast::error_code ignored;
            socket.close(ignored);
            continue;
        }
        beast::error_code nodelay_ec;
        socket.set_option(tcp::no_delay(true),
                          nodelay_ec);  // no Nagle wait behind an unacked frame
        auto ex = socket.get_executor();
        net::co_spawn(ex, serve(std::move(socket), tls, listener, std::move(*slot)),
                      logged_as("connection"));
    }
}

awaitable<void> Listeners::serve(tcp::socket socket, bool tls, listener_kind listener,
                                 ConnectionSlot slot) {
    if (!tls) {
        co_await routes_.serve(ConnStream(beast::tcp_stream(std::move(socket))), listener, slot);
        co_return;
    }
    // The listener's context as of now: a reload (SIGHUP) changes what later connections get.
    ConnStream stream(beast::tcp_stream(std::move(socket)), node_.security()->listener_tls);
    // The handshake and the first request share one deadline from the accept (authTimeoutMs).
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(node_.config.limits.auth_timeout_ms);
    beast::get_lowest_layer(stream).expires_at(deadline);
    auto [ec] =
        co_await stream.tls()->async_handshake(ssl::stream_base::server, as_tuple_awaitable);
    if (ec) {
        // Plain HTTP to the TLS port, an untrusted or missing client certificate, an old
        // protocol version: the handshake fails and the connection is dropped.
        const auto remote = remote_address(stream);
        spdlog::info("peer={} TLS handshake failed: {}", remote, ec.message());
        if (node_.audit) {
            node_.audit->write("connection.refused",
                               {{"peer", remote},
                                {"token", nullptr},
                                {"reason", "TLS handshake failed: " + ec.message()}});
        }
        co_return;
    }
    co_await routes_.serve(std::move(stream), listener, slot);
}

}  // namespace sandboxd
