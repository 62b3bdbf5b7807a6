#pragma once
// A Channel (src/server/channel.hpp) on a running FakeChannelBackend and a FakeChannelSink,
// on the test's own io_context: the test plays the command (backend->write(), end_output(),
// finish()) and the host (on_strand() calls of the channel's methods), and settle() runs
// whatever is ready, never waiting (poll(), not run(): a hangup's grace timer stays pending).
#include "server/channel.hpp"
#include "support/fake_channel_sink.hpp"
#include "support/fake_provider.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <utility>

namespace sandboxd::test {

/// The options of a test channel: id 1, stdin attached, the windows given.
inline ChannelOptions channel_options(std::uint32_t output_window = 1 << 20,
                                      std::uint32_t stdin_window = 1 << 20) {
    ChannelOptions o;
    o.id = 1;
    o.host_route_id = "route-1";
    o.lease_id = "lease-1";
    o.output_window = output_window;
    o.stdin_window = stdin_window;
    return o;
}

/// Runs everything ready on `ioc`, without waiting for timers.
inline void settle(boost::asio::io_context& ioc) {
    ioc.restart();
    ioc.poll();
}

/// Runs `ioc` until `done()` holds, for at most `limit`; returns whether it held.
inline bool pump(boost::asio::io_context& ioc, const std::function<bool()>& done,
                 std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    ioc.restart();
    while (!done()) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        ioc.run_one_for(std::chrono::milliseconds(50));
        if (ioc.stopped()) ioc.restart();
    }
    return true;
}

/// Runs `f` on `strand` and settles; rethrows what `f` threw.
inline void on_strand(boost::asio::io_context& ioc, const strand_t& strand,
                      const std::function<void()>& f) {
    std::exception_ptr failed;
    boost::asio::post(strand, [&] {
        try {
            f();
        } catch (...) {
            failed = std::current_exception();
        }
    });
    settle(ioc);
    if (failed) std::rethrow_exception(failed);
}

struct ChannelRig {
    boost::asio::io_context ioc;
    strand_t strand = boost::asio::make_strand(ioc);
    std::shared_ptr<FakeChannelSink> sink = std::make_shared<FakeChannelSink>(strand);
    FakeChannelBackend* backend = nullptr;  ///< owned by the channel
    std::shared_ptr<Channel> channel;

    /// A channel whose command runs (nothing written yet), started unless `started` is false
    /// (then start() it).
    explicit ChannelRig(ChannelOptions options = channel_options(), bool started = true) {
        auto b = FakeChannelBackend::running();
        backend = b.get();
        channel =
            std::make_shared<Channel>(strand, std::move(options), std::move(b), nullptr, sink);
        if (started) start();
    }
    ChannelRig(const ChannelRig&) = delete;
    ChannelRig& operator=(const ChannelRig&) = delete;
    ~ChannelRig() {
        // The backend's pending reports hold the channel, which owns the backend.
        backend->forget_events();
    }

    void start() {
        run([&] { channel->start(); });
    }
    void settle() { test::settle(ioc); }
    void run(const std::function<void()>& f) { on_strand(ioc, strand, f); }

    /// The command wrote `bytes` to stdout (or stderr), and the channel has done what it would.
    void write(std::string_view bytes, output_stream stream = output_stream::out) {
        backend->write(stream, bytes);
        settle();
    }
    /// The command exited with `code`: its streams end and every process of it is gone.
    void exit(int code) {
        backend->end_output(output_stream::out);
        backend->end_output(output_stream::err);
        ChannelExit e;
        e.exit_code = code;
        backend->finish(e);
        settle();
    }
    void credit(std::uint32_t bytes) {
        run([&] { channel->add_credit(bytes); });
    }
    std::string out() const { return sink->data(1, stream_id::stdout_); }
    std::string err() const { return sink->data(1, stream_id::stderr_); }
    std::vector<nlohmann::json> exits() const { return sink->notifications("duplexChannel.exit"); }
};

}  // namespace sandboxd::test
