#include "server/drain.hpp"

#include "server/channel.hpp"

#include <boost/asio/experimental/awaitable_operators.hpp>

#include <spdlog/spdlog.h>

#include <algorithm>

namespace sandboxd {

void Drain::begin() {
    if (started_.exchange(true)) return;
    node_.draining = true;  // from this moment: no opens, no leases, /readyz draining
    net::co_spawn(ioc_, run(), net::detached);
}

void Drain::then_stop() {
    // Either this sees the drain over, or the drain's end sees the flag (both sequentially
    // consistent): stop runs at least once, and it is idempotent.
    stop_when_drained_ = true;
    if (over_) {
        stop_();
    } else {
        begin();
    }
}

awaitable<void> Drain::wait_channels(std::function<bool()> done,
                                     std::chrono::steady_clock::time_point until) {
    using namespace net::experimental::awaitable_operators;
    auto ex = co_await net::this_coro::executor;
    auto removed = std::make_shared<ChannelTable::RemovalSignal>(ex, 1);
    node_.channels.watch_removals(removed);
    net::steady_timer timer(ex);
    while (!done() && !node_.stopping && std::chrono::steady_clock::now() < until) {
        timer.expires_at(
            std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)));
        co_await (removed->async_receive(as_tuple_awaitable) ||
                  timer.async_wait(as_tuple_awaitable));
    }
}

awaitable<void> Drain::run() {
    const auto timeout = std::chrono::milliseconds(node_.config.limits.drain_timeout_ms);
    // A channel is over once its exit is queued on its connection (channels_unended), which
    // follows its removal from the table (the reap).
    // Kept detached channels (issue 47) go on across a restart: neither waited for nor
    // stopped, unless the node is being decommissioned.
    const auto kept = [this] {
        return node_.keeps_across_restart() ? node_.channels.kept() : std::size_t{0};
    };
    const auto running = [this, kept] {
        const auto k = kept();
        return node_.channels.size() > k ||
               node_.channels_unended.load() > static_cast<std::int64_t>(k) ||
               node_.relays_open.load() > 0 || node_.opens_in_flight.load() > 0;
    };
    spdlog::info(
        "node={} draining: new opens and leases are refused; {} channels and {} relayed "
        "channels running get up to {} ms to finish",
        node_.node_id, node_.channels.size(), node_.relays_open.load(), timeout.count());
    if (node_.audit) {
        node_.audit->write("node.draining", {{"channels", node_.channels.size()},
                                             {"relayedChannels", node_.relays_open.load()},
                                             {"drainTimeoutMs", timeout.count()}});
    }
    co_await wait_channels([&] { return !running(); }, std::chrono::steady_clock::now() + timeout);
    if (node_.stopping) co_return;
    co_await stop_left_channels(timeout);
    over_ = true;
    if (stop_when_drained_) stop_();
}

awaitable<void> Drain::stop_left_channels(std::chrono::milliseconds timeout) {
    auto left = node_.channels.all();
    const bool keep = node_.keeps_across_restart();
    if (keep) std::erase_if(left, [](const ChannelTable::Entry& e) { return e.kept; });
    if (left.empty()) {
        spdlog::info("node={} drained: no channel runs here", node_.node_id);
        co_return;
    }
    // The time is over: the channels still running here are stopped (their exits say
    // "stopped"); relayed ones are closed with the connections when the node stops.
    spdlog::info("node={} drain timeout of {} ms over: stopping {} channels", node_.node_id,
                 timeout.count(), left.size());
    for (const auto& e : left) {
        net::post(e.strand, [weak = e.channel] {
            if (auto ch = weak.lock()) ch->stop(channel_outcome::stopped);
        });
    }
    const auto ended_here = [this, keep] {
        const auto k = keep ? node_.channels.kept() : std::size_t{0};
        return node_.channels.size() <= k &&
               node_.channels_unended.load() <= static_cast<std::int64_t>(k);
    };
    co_await wait_channels(ended_here,
                           std::chrono::steady_clock::now() +
                               std::chrono::milliseconds(node_.config.limits.hangup_grace_ms) +
                               std::chrono::seconds(5));
}

}  // namespace sandboxd
