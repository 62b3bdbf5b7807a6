#include "support/tcp_relay.hpp"

#include <sandboxd/core/net.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>

#include <array>
#include <atomic>
#include <exception>
#include <future>
#include <thread>
#include <vector>

namespace sandboxd::test {
namespace net = boost::asio;
using tcp = net::ip::tcp;

struct TcpRelay::Impl {
    net::io_context ioc;
    tcp::acceptor acceptor{ioc};
    tcp::endpoint target;
    // Touched on the relay's thread only.
    bool holding = false;
    std::vector<std::weak_ptr<tcp::socket>> sockets;
    std::atomic<std::size_t> relayed{0};
    std::atomic<std::size_t> bytes_from_target{0};
    std::thread thread;

    void close_all() {
        for (auto& weak : sockets) {
            if (auto s = weak.lock()) {
                boost::system::error_code ignored;
                s->close(ignored);
            }
        }
        sockets.clear();
    }

    /// Runs `f` on the relay's thread and waits for it.
    template <typename F>
    void run(F f) {
        std::promise<void> done;
        net::post(ioc, [&] {
            f();
            done.set_value();
        });
        done.get_future().wait();
    }
};

namespace {

/// Copies `from` to `to` until either side ends, then closes both; adds each read's size to
/// `count` when it is not null.
net::awaitable<void> pump(std::shared_ptr<tcp::socket> from, std::shared_ptr<tcp::socket> to,
                          std::atomic<std::size_t>* count) {
    std::array<char, 16384> buf{};
    for (;;) {
        auto [ec, n] = co_await from->async_read_some(net::buffer(buf), as_tuple_awaitable);
        if (ec) break;
        if (count) *count += n;
        auto [wec, written] =
            co_await net::async_write(*to, net::buffer(buf.data(), n), as_tuple_awaitable);
        if (wec) break;
    }
    boost::system::error_code ignored;
    from->close(ignored);
    to->close(ignored);
}

net::awaitable<void> relay(TcpRelay::Impl* s, std::shared_ptr<tcp::socket> client) {
    auto server = std::make_shared<tcp::socket>(s->ioc);
    s->sockets.push_back(client);
    s->sockets.push_back(server);
    auto [ec] = co_await server->async_connect(s->target, as_tuple_awaitable);
    if (ec || !client->is_open()) {
        boost::system::error_code ignored;
        client->close(ignored);
        server->close(ignored);
        co_return;
    }
    net::co_spawn(s->ioc, pump(client, server, nullptr), net::detached);
    net::co_spawn(s->ioc, pump(server, client, &s->bytes_from_target), net::detached);
}

net::awaitable<void> accept_loop(TcpRelay::Impl* s) {
    for (;;) {
        auto [ec, socket] = co_await s->acceptor.async_accept(as_tuple_awaitable);
        if (ec == net::error::operation_aborted || !s->acceptor.is_open()) co_return;
        if (ec) continue;
        if (s->holding) {
            boost::system::error_code ignored;
            socket.close(ignored);
            continue;
        }
        ++s->relayed;
        net::co_spawn(s->ioc, relay(s, std::make_shared<tcp::socket>(std::move(socket))),
                      net::detached);
    }
}

}  // namespace

TcpRelay::TcpRelay(const std::string& target_host, std::uint16_t target_port)
    : impl_(std::make_unique<Impl>()) {
    impl_->target = tcp::endpoint(net::ip::make_address_v4(target_host), target_port);
    const tcp::endpoint local(net::ip::address_v4::loopback(), 0);
    impl_->acceptor.open(local.protocol());
    impl_->acceptor.bind(local);
    impl_->acceptor.listen();
    net::co_spawn(impl_->ioc, accept_loop(impl_.get()), net::detached);
    impl_->thread = std::thread([s = impl_.get()] { s->ioc.run(); });
}

TcpRelay::~TcpRelay() {
    // Only the post's allocation or the promise can fail: a test cannot go on then.
    try {
        impl_->run([s = impl_.get()] {
            boost::system::error_code ignored;
            s->acceptor.close(ignored);
            s->close_all();
        });
        impl_->ioc.stop();
        impl_->thread.join();
    } catch (...) {
        std::terminate();
    }
}

std::string TcpRelay::endpoint() const {
    return "http://127.0.0.1:" + std::to_string(impl_->acceptor.local_endpoint().port());
}

void TcpRelay::cut() {
    impl_->run([s = impl_.get()] {
        s->holding = true;
        s->close_all();
    });
}

void TcpRelay::resume() {
    impl_->run([s = impl_.get()] { s->holding = false; });
}

std::size_t TcpRelay::relayed() const { return impl_->relayed.load(); }

std::size_t TcpRelay::bytes_from_target() const { return impl_->bytes_from_target.load(); }

}  // namespace sandboxd::test
