/// @file awaitable_channel.cpp
/// ChannelBackend's waits awaited from a coroutine (awaitable_channel.hpp): a ChannelEvents
/// that keeps what the backend reported and wakes the awaiting coroutine.

#include <sandboxd/provider/awaitable_channel.hpp>

#include <sandboxd/core/net.hpp>

#include <optional>
#include <utility>

namespace sandboxd {

/// What a backend reported, kept for the coroutine that awaits it. The callbacks run on the
/// coroutine's executor (events_executor()), never inside the notify_*() call, so a check
/// of the state and the wait that follows it cannot miss a report.
namespace detail {

class AwaitedEvents final : public ChannelEvents {
public:
    explicit AwaitedEvents(const net::any_io_executor& executor)
        : executor_(executor), changed_(executor) {
        changed_.expires_at(net::steady_timer::time_point::max());
    }

    net::any_io_executor events_executor() const override { return executor_; }
    void output_ready(output_stream, std::size_t bytes) override {
        bytes_ = bytes;
        changed_.cancel();
    }
    void exited(ChannelExit exit) override {
        exit_ = std::move(exit);
        changed_.cancel();
    }
    void gone() override {
        gone_ = true;
        changed_.cancel();
    }
    void ended() override {
        ended_ = true;
        changed_.cancel();
    }

    /// Completes once `done()` holds (checked now, then after each report).
    template <typename Done>
    awaitable<void> until(Done done) {
        while (!done()) co_await changed_.async_wait(as_tuple_awaitable);
    }

    std::optional<std::size_t> bytes_;
    std::optional<ChannelExit> exit_;
    bool gone_ = false;
    bool ended_ = false;

private:
    net::any_io_executor executor_;
    net::steady_timer changed_;  ///< woken (cancelled) by every report
};

}  // namespace detail

namespace {
using detail::AwaitedEvents;
}  // namespace

awaitable<std::size_t> output_ready(ChannelBackend& backend, output_stream stream) {
    auto events = std::make_shared<AwaitedEvents>(co_await net::this_coro::executor);
    backend.notify_output_ready(stream, events);
    co_await events->until([&events] { return events->bytes_.has_value(); });
    co_return *events->bytes_;
}

awaitable<ChannelExit> wait_exit(ChannelBackend& backend) {
    auto events = std::make_shared<AwaitedEvents>(co_await net::this_coro::executor);
    backend.notify_exit(events);
    co_await events->until([&events] { return events->exit_.has_value(); });
    co_return std::move(*events->exit_);
}

awaitable<void> GoneWait::ask(ChannelBackend& backend) {
    if (events_) co_return;
    events_ = std::make_shared<AwaitedEvents>(co_await net::this_coro::executor);
    backend.notify_gone(events_);
}

awaitable<bool> GoneWait::ended(ChannelBackend& backend) {
    co_await ask(backend);
    const auto events = events_;
    co_await events->until([&events] { return events->ended_ || events->gone_; });
    co_return events->gone_;
}

awaitable<void> GoneWait::gone(ChannelBackend& backend) {
    co_await ask(backend);
    const auto events = events_;
    co_await events->until([&events] { return events->gone_; });
}

awaitable<void> wait_gone(ChannelBackend& backend) {
    GoneWait wait;
    co_await wait.gone(backend);
}

}  // namespace sandboxd
