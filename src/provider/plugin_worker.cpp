/// @file plugin_worker.cpp
/// The plugin worker manager (docs/plugins.md). Everything but the public methods and the
/// channel backend runs on the manager's own io_context thread, in plain completion handlers (no
/// coroutines), so no state here needs a lock except the readiness snapshot read by other threads.
///
/// The worker speaks the protocol of @paperclipai/plugin-sdk 2026.916.1 (docs/plugins.md):
/// newline-delimited JSON-RPC 2.0 both ways, the worker's own requests (config.get) and
/// notifications (log) served.
///
/// Fail closed at the worker boundary: a frame is delivered only to the channel registered
/// under its hostRouteId, with the workerSessionId that the open answer bound (frames that
/// come before the answer are held and checked at the bind); a frame for a route that ended
/// is dropped; anything else that breaks the protocol retires the worker (SIGKILL of its
/// process group, every channel of it closed, restart with backoff).
///
/// This file holds the manager's public face and the channel backend; the rest is in
/// plugin_worker_state.hpp and the plugin_worker_*.cpp files it names.

#include "provider/plugin_worker_state.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>

#include <spdlog/spdlog.h>

#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>

#ifndef P_PIDFD
#define P_PIDFD 3  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd {

// The state's types and helpers, used throughout this file.
using namespace plugin_detail;  // NOLINT(google-build-using-namespace)

// ---------------------------------------------------------------------------------------
// Public face

namespace {

/// Runs `start(reply)` on the manager's thread and completes on the awaiting executor with
/// what `reply` got (its exception rethrown). No thread waits: the awaiting coroutine is
/// suspended until the worker answers or the call's timer fires.
///
/// The initiation captures only a raw pointer (see sandboxd/core/offload.hpp for the GCC 12
/// bug that a closure with a destructor there triggers); `start` travels as an argument.
template <typename Start>
awaitable<json> on_manager(WorkerManager::Impl* impl, Start start) {
    if (impl->stopping) {
        throw rpc_error(errc::provider_not_ready,
                        "plugin " + impl->config.plugin_id + " is stopping");
    }
    co_return co_await net::async_initiate<decltype(use_awaitable), void(std::exception_ptr, json)>(
        [impl](auto handler, Start fn) {
            // The awaiting executor's io_context keeps running until the answer is back.
            auto back = net::prefer(net::get_associated_executor(handler),
                                    net::execution::outstanding_work.tracked);
            auto shared = std::make_shared<decltype(handler)>(std::move(handler));
            net::post(impl->ioc, [shared, back, fn = std::move(fn)]() mutable {
                fn([shared, back](json result, std::exception_ptr error) {
                    net::post(back, [shared, result = std::move(result), error]() mutable {
                        (*shared)(error, std::move(result));
                    });
                });
            });
        },
        use_awaitable, std::move(start));
}

/// A plugin channel as the daemon's Channel sees it. Lives on the channel's executor; every
/// request to the worker is posted to the manager's thread.
/// Posts `f` to the manager's I/O thread from a noexcept path (a destructor, a signal). The
/// handler's allocation is the only thing that can fail; out of memory there ends the process,
/// as it would in any noexcept function.
template <typename F>
void post_noexcept(net::io_context& ioc, F f) noexcept {
    try {
        net::post(ioc, std::move(f));
    } catch (...) {
        std::terminate();
    }
}

class PluginChannelBackend final : public ChannelBackend {
public:
    PluginChannelBackend(std::shared_ptr<WorkerManager::Impl> impl, std::shared_ptr<OpenSlot> slot)
        : impl_(std::move(impl)),
          route_(std::move(slot->route)),
          inbox_(std::move(slot->inbox)),
          close_stdin_(slot->close_stdin),
          signal_(slot->signal),
          resize_(slot->resize) {}

    ~PluginChannelBackend() override {
        // The daemon dropped the channel: the worker stops it (unless it has ended).
        WorkerManager::Impl* impl = impl_.get();
        post_noexcept(impl->ioc, [impl, r = std::move(route_)] {
            impl->end_locally(r, "the daemon closed the channel");
        });
    }
    PluginChannelBackend(const PluginChannelBackend&) = delete;
    PluginChannelBackend& operator=(const PluginChannelBackend&) = delete;

    bool has_output(output_stream) const noexcept override { return true; }
    bool has_stdin() const noexcept override { return true; }
    bool supports(channel_control control) const noexcept override {
        switch (control) {
            case channel_control::close_stdin: return close_stdin_;
            case channel_control::signal: return signal_;
            case channel_control::resize: return resize_;
        }
        return false;
    }

    void notify_output_ready(output_stream stream, std::shared_ptr<ChannelEvents> to) override {
        // Checked on the channel's executor, after this call: a callback never runs inside it.
        net::post(inbox_->changed.get_executor(), [in = inbox_, stream, to = std::move(to)] {
            report_output_ready(in, stream, to);
        });
    }

    std::optional<std::size_t> read_output(output_stream stream, std::span<char> into) override {
        const auto i = static_cast<std::size_t>(stream);
        auto& queue = inbox_->out[i];
        if (queue.empty()) return inbox_->ended ? std::nullopt : std::optional<std::size_t>(0);
        auto& offset = inbox_->offset[i];
        const std::size_t n = std::min(into.size(), queue.front().size() - offset);
        std::memcpy(into.data(), queue.front().data() + offset, n);
        offset += n;
        if (offset == queue.front().size()) {
            queue.pop_front();
            offset = 0;
        }
        *inbox_->buffered -= n;
        return n;
    }

    awaitable<bool> write_stdin(std::string data) override {
        WorkerManager::Impl* impl = impl_.get();
        for (std::size_t at = 0; at < data.size(); at += stdin_write_chunk) {
            auto write = [impl, r = route_,
                          chunk = data.substr(at, stdin_write_chunk)](ReplyFn done) mutable {
                impl->write_on_io(r, std::move(chunk), std::move(done));
            };
            bool taken = false;
            try {
                taken = (co_await on_manager(impl, std::move(write))).get<bool>();
            } catch (const std::exception&) {
                taken = false;  // the manager is stopping
            }
            if (!taken) co_return false;
        }
        co_return true;
    }

    void close_stdin() noexcept override {
        WorkerManager::Impl* impl = impl_.get();
        post_noexcept(impl->ioc, [impl, r = route_] { impl->close_stdin_on_io(r); });
    }

    void signal(int sig) noexcept override { post_signal(sig, false); }
    void signal_all(int sig) noexcept override { post_signal(sig, true); }
    void kill() noexcept override { post_signal(SIGKILL, true); }

    void resize(std::uint16_t, std::uint16_t) override {
        throw rpc_error(errc::invalid_params, "a plugin channel has no PTY to resize");
    }

    void notify_exit(std::shared_ptr<ChannelEvents> to) override {
        net::post(inbox_->changed.get_executor(),
                  [in = inbox_, to = std::move(to)] { report_exit(in, to); });
    }

    void notify_gone(std::shared_ptr<ChannelEvents> to) override {
        net::post(inbox_->changed.get_executor(),
                  [in = inbox_, to = std::move(to)] { report_gone(in, to); });
    }

private:
    // The reports: each checks the Inbox, and waits for its next change until it can answer.
    // A wait holds the Inbox (not the backend), so a change that comes after the backend is
    // gone touches nothing freed.
    static void report_output_ready(const std::shared_ptr<Inbox>& in, output_stream stream,
                                    const std::shared_ptr<ChannelEvents>& to) {
        const auto i = static_cast<std::size_t>(stream);
        if (!in->out[i].empty()) {
            to->output_ready(stream, in->out[i].front().size() - in->offset[i]);
        } else if (in->ended) {
            to->output_ready(stream, 0);
        } else {
            in->changed.async_wait(
                [in, stream, to](beast::error_code) { report_output_ready(in, stream, to); });
        }
    }

    static void report_exit(const std::shared_ptr<Inbox>& in,
                            const std::shared_ptr<ChannelEvents>& to) {
        if (in->exit) {
            to->exited(*in->exit);
        } else {
            in->changed.async_wait([in, to](beast::error_code) { report_exit(in, to); });
        }
    }

    static void report_gone(const std::shared_ptr<Inbox>& in,
                            const std::shared_ptr<ChannelEvents>& to) {
        if (in->gone) {
            to->gone();
        } else {
            in->changed.async_wait([in, to](beast::error_code) { report_gone(in, to); });
        }
    }

    void post_signal(int sig, bool all) noexcept {
        WorkerManager::Impl* impl = impl_.get();
        post_noexcept(impl->ioc, [impl, r = route_, sig, all] { impl->signal_on_io(r, sig, all); });
    }

    std::shared_ptr<WorkerManager::Impl> impl_;
    std::shared_ptr<Route> route_;  // used on the manager's thread only
    std::shared_ptr<Inbox> inbox_;
    const bool close_stdin_;
    const bool signal_;
    const bool resize_;
};

}  // namespace

WorkerManager::WorkerManager(PluginConfig config, PluginTuning tuning)
    : impl_(std::make_shared<Impl>(std::move(config), tuning)) {
    if (impl_->config.command.empty()) {
        throw config_error("config: providers.plugins: plugin " + impl_->config.plugin_id +
                           " has no command");
    }
    Impl* impl = impl_.get();
    net::post(impl->ioc, [impl] { impl->start_worker(); });
    impl->thread = std::thread([impl] { impl->ioc.run(); });
    impl->io_thread = impl->thread.get_id();
}

WorkerManager::~WorkerManager() {
    // Nothing may escape a destructor: a failure to stop the worker cleanly is logged.
    try {
        Impl* impl = impl_.get();
        impl->stopping = true;
        auto done = std::make_shared<std::promise<void>>();
        auto finished = done->get_future();
        net::post(impl->ioc, [impl, done] { impl->begin_stop(done); });
        // shutdown's answer, 1 s to exit, then SIGTERM to SIGKILL: two graces and some slack.
        finished.wait_for(impl->tuning.shutdown_grace * 2 + std::chrono::seconds(3));
        impl->work.reset();
        impl->ioc.stop();
        impl->thread.join();
        if (auto w = impl->current; w && !w->exited && w->pidfd.is_open()) {
            ::syscall(SYS_pidfd_send_signal, w->pidfd.native_handle(), SIGKILL, nullptr, 0);
            kill_group(*w);
            siginfo_t info{};
            ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(w->pidfd.native_handle()),
                     &info, WEXITED);
            w->exited = true;
        }
        if (auto w = impl->current) {
            for (auto& [key, r] : w->routes) impl->sever(r);
            w->routes.clear();
        }
        impl->current.reset();
    } catch (const std::exception& e) {
        spdlog::error("plugin {}: stopping its worker failed: {}", impl_->config.plugin_id,
                      e.what());
    }
}

const PluginConfig& WorkerManager::config() const noexcept { return impl_->config; }

bool WorkerManager::ready() const noexcept { return impl_->ready_flag.load(); }

std::uint64_t WorkerManager::generation() const noexcept { return impl_->ready_generation.load(); }

std::uint64_t WorkerManager::restarts() const noexcept { return impl_->restarts.load(); }

void WorkerManager::on_late_acquire(std::function<void(json params, json result, json context)> f) {
    impl_->late_acquire = std::move(f);
}

bool WorkerManager::supports(const std::string& method) const {
    std::lock_guard lock(impl_->supported_mutex);
    return impl_->supported_snapshot.count(method) > 0;
}

awaitable<json> WorkerManager::call(std::string method, json params, json context) {
    Impl* impl = impl_.get();
    auto start = [impl, method = std::move(method), params = std::move(params),
                  context = std::move(context)](ReplyFn done) mutable {
        impl->call_on_io(method, std::move(params), false, std::move(done), std::move(context));
    };
    co_return co_await on_manager(impl, std::move(start));
}

awaitable<WorkerManager::Answer> WorkerManager::call_answered(std::string method, json params,
                                                              json context) {
    Impl* impl = impl_.get();
    // Written on the manager's thread before the reply is handed back (the hand-off orders it).
    auto served_by = std::make_shared<std::uint64_t>(0);
    auto start = [impl, method = std::move(method), params = std::move(params),
                  context = std::move(context), served_by](ReplyFn done) mutable {
        if (impl->usable(impl->current)) *served_by = impl->current->generation;
        impl->call_on_io(method, std::move(params), false, std::move(done), std::move(context));
    };
    json result = co_await on_manager(impl, std::move(start));
    co_return Answer{std::move(result), *served_by};
}

awaitable<std::optional<json>> WorkerManager::call_if_supported(std::string method, json params) {
    Impl* impl = impl_.get();
    auto start = [impl, method = std::move(method),
                  params = std::move(params)](ReplyFn done) mutable {
        impl->call_on_io(method, std::move(params), true, std::move(done));
    };
    json r = co_await on_manager(impl, std::move(start));
    if (r.is_null()) co_return std::nullopt;
    co_return r["result"];
}

awaitable<std::optional<json>> WorkerManager::call_in_invocation(std::string method, json params,
                                                                 Invocation invocation) {
    auto slot = std::make_shared<Impl::InvocationSlot>();
    slot->executor = co_await net::this_coro::executor;
    slot->invocation = std::move(invocation);
    Impl* impl = impl_.get();
    auto start = [impl, method = std::move(method), params = std::move(params),
                  slot = std::move(slot)](ReplyFn done) mutable {
        impl->invoke_on_io(method, std::move(params), std::move(slot), std::move(done));
    };
    json r = co_await on_manager(impl, std::move(start));
    if (r.is_null()) co_return std::nullopt;
    co_return r["result"];
}

awaitable<std::unique_ptr<ChannelBackend>> WorkerManager::open_channel(json params,
                                                                       std::uint64_t generation) {
    auto slot = std::make_shared<OpenSlot>();
    slot->executor = co_await net::this_coro::executor;
    slot->inbox = std::make_shared<Inbox>(slot->executor);
    slot->buffered = std::make_shared<std::atomic<std::size_t>>(0);
    slot->inbox->buffered = slot->buffered;
    Impl* impl = impl_.get();
    auto start = [impl, params = std::move(params), generation, slot](ReplyFn done) mutable {
        impl->open_on_io(std::move(params), generation, slot, std::move(done));
    };
    co_await on_manager(impl, std::move(start));
    co_return std::make_unique<PluginChannelBackend>(impl_, std::move(slot));
}

}  // namespace sandboxd
