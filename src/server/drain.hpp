#pragma once
// Draining a node (docs/protocol.md section 6): from the first moment no opens and no
// leases; the channels running get limits.drainTimeoutMs to finish, then are stopped; and,
// when asked (SIGTERM: Daemon::drain_then_stop), the node stops once drained. Started by
// Daemon::drain, SIGUSR2 or POST /admin/drain (http_routes.cpp). Each drain runs once.
//
// Threading: begin() and then_stop() from any thread; the drain itself runs on the node's
// io_context.
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <atomic>
#include <chrono>
#include <functional>

namespace sandboxd {

class Drain {
public:
    /// `stop`: stops the node (Daemon's stop; idempotent, any thread).
    Drain(Node& node, net::io_context& ioc, std::function<void()> stop)
        : node_(node), ioc_(ioc), stop_(std::move(stop)) {}
    Drain(const Drain&) = delete;
    Drain& operator=(const Drain&) = delete;

    /// Starts the drain (once; later calls do nothing).
    void begin();
    /// Drains, then stops: at once when a drain is already over.
    void then_stop();
    /// Whether a drain was started.
    [[nodiscard]] bool started() const noexcept { return started_.load(); }
    /// Waits until `done()` or `until`, woken by each channel that ends here and every
    /// 100 ms (relayed channels end on their connections' strands, with no signal).
    awaitable<void> wait_channels(std::function<bool()> done,
                                  std::chrono::steady_clock::time_point until);

private:
    awaitable<void> run();
    /// Stops the channels still running here once the drain's time is over.
    awaitable<void> stop_left_channels(std::chrono::milliseconds timeout);

    Node& node_;
    net::io_context& ioc_;
    std::function<void()> stop_;
    std::atomic<bool> started_{false};
    std::atomic<bool> over_{false};
    std::atomic<bool> stop_when_drained_{false};
};

}  // namespace sandboxd
