#pragma once
// The node's listeners (docs/protocol.md sections 1 and 7): `listen` (TLS or not) and
// plainListen, the connection loops that serve accepted connections, the caps on open and
// unauthenticated connections (issue 44, item 3), and the TLS handshake. An accepted
// connection goes to HttpRoutes::serve, which reads its requests.
//
// Threading: the accept loops run on the node's io_context; each accepted connection runs on
// one connection loop (round robin) for its whole life. The counters are atomics.
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sandboxd {

class HttpRoutes;

/// Which listener a connection came in on: `listen` (TLS or not) or plainListen.
enum class listener_kind { main, plain };

/// Connections open now, and those not yet authenticated; the caps in force
/// (limits.connections and limits.pendingConnections, each at most RLIMIT_NOFILE less the
/// descriptor reserve).
struct ConnectionCounts {
    std::atomic<std::uint32_t> open{0};
    std::atomic<std::uint32_t> pending{0};
    std::uint32_t cap = 0;
    std::uint32_t pending_cap = 0;
};

/// One accepted connection's place under the caps: open (and pending) until destroyed,
/// pending until authenticated(). Moves with the connection's coroutine.
class ConnectionSlot {
public:
    explicit ConnectionSlot(ConnectionCounts& counts) : counts_(&counts) {}
    ConnectionSlot(ConnectionSlot&& o) noexcept
        : counts_(std::exchange(o.counts_, nullptr)), pending_(o.pending_) {}
    ConnectionSlot& operator=(ConnectionSlot&&) = delete;
    ConnectionSlot(const ConnectionSlot&) = delete;
    ConnectionSlot& operator=(const ConnectionSlot&) = delete;
    ~ConnectionSlot() {
        if (!counts_) return;
        authenticated();
        counts_->open.fetch_sub(1, std::memory_order_acq_rel);
    }
    /// The connection has its WebSocket session: it no longer counts as pending.
    void authenticated() noexcept {
        if (counts_ && std::exchange(pending_, false)) {
            counts_->pending.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

private:
    ConnectionCounts* counts_;
    bool pending_ = true;
};

class Listeners {
public:
    /// `counts`: where the connections are counted (the metrics read them); outlives this.
    Listeners(Node& node, net::io_context& ioc, HttpRoutes& routes, ConnectionCounts& counts)
        : node_(node), ioc_(ioc), routes_(routes), counts_(counts) {}
    ~Listeners() { stop_loops(); }
    Listeners(const Listeners&) = delete;
    Listeners& operator=(const Listeners&) = delete;

    /// Binds `listen` and plainListen (config_error naming the field when one cannot be).
    void bind();
    /// Starts the connection loops, sets the caps and starts accepting (once, from
    /// Daemon::start; the io_context need not run yet).
    void start();
    /// Closes the acceptors (the node is stopping). On the node's io_context.
    void close();
    /// Stops the connection loops and joins their threads (idempotent).
    void stop_loops();

    [[nodiscard]] const std::string& bound() const noexcept { return bound_; }
    [[nodiscard]] const std::string& plain_bound() const noexcept { return plain_bound_; }

private:
    /// Binds `acc` to `address` (config field `field`); returns the bound HOST:PORT.
    std::string bind(tcp::acceptor& acc, const std::string& address, const std::string& field);
    void start_loops();
    /// The loop of the next accepted connection: `ioc` or one of the connection loops.
    net::io_context& next_loop();
    /// Sets the caps from the config and RLIMIT_NOFILE; logs them.
    void set_caps();
    /// Takes a slot for a connection just accepted, or says which cap refuses it.
    std::optional<ConnectionSlot> admit(std::string& refused_by);
    /// Answers 503 naming the cap on the accepted socket `fd` and shuts it down, without
    /// waiting for the peer (never blocks); the caller closes it.
    void refuse(int fd, const std::string& refused_by);
    /// Accepts on `acc`; `tls`: each connection's TLS handshake first (the listener's
    /// context at the time of the accept).
    awaitable<void> accept_loop(tcp::acceptor& acc, bool tls, listener_kind listener);
    awaitable<void> serve(tcp::socket socket, bool tls, listener_kind listener,
                          ConnectionSlot slot);

    Node& node_;
    net::io_context& ioc_;
    HttpRoutes& routes_;
    tcp::acceptor acceptor_{ioc_};
    /// plainListen: plain text on loopback beside a TLS `listen`; closed when not configured.
    tcp::acceptor plain_acceptor_{ioc_};
    std::string bound_;
    std::string plain_bound_;
    ConnectionCounts& counts_;
    /// The connections' event loops beside `ioc` (threads - 1 of them, one thread each). A
    /// connection runs on one loop for its whole life (round robin over `ioc` and these): its
    /// socket, its channels' pipes and its timers are served by one thread, so a stream's
    /// handlers never hop between threads.
    std::vector<std::unique_ptr<net::io_context>> loops_;
    std::vector<net::executor_work_guard<net::io_context::executor_type>> work_;
    std::vector<std::thread> threads_;
    std::atomic<std::size_t> next_loop_{0};
};

}  // namespace sandboxd
