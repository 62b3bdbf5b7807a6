/// @file execute_channel.cpp
/// Provider::execute()'s default: leaseExecute run as a channel of the sandbox (open()),
/// driven to its end here rather than by a host. The output is read as fast as the command
/// writes it; each read goes to the log sink and, up to the request's output_limit per
/// stream, into the result. A timer kills the command at the request's timeout.

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/utf8.hpp>
#include <sandboxd/provider/awaitable_channel.hpp>
#include <sandboxd/provider/provider.hpp>

#include <boost/asio/experimental/awaitable_operators.hpp>

#include <array>
#include <chrono>
#include <csignal>
#include <cstring>

namespace sandboxd {
namespace {

using json = nlohmann::json;
using namespace net::experimental::awaitable_operators;

constexpr std::size_t read_size = 64 * 1024;

/// One output stream of the command: what the result keeps of it.
struct Capture {
    const char* name;
    Utf8Text decoder;
    std::string text;
    std::size_t bytes = 0;  // every byte the command wrote
    bool truncated = false;
};

/// Passes `bytes` to the log and, within `limit`, to the result.
void take(Capture& c, std::string_view bytes, std::size_t limit, const ExecuteLog& log) {
    const std::size_t room = c.bytes < limit ? limit - c.bytes : 0;
    c.bytes += bytes.size();
    if (bytes.size() > room) {
        c.truncated = true;
        bytes = bytes.substr(0, room);
    }
    if (bytes.empty()) return;
    std::string text = c.decoder.feed(bytes);
    if (text.empty()) return;
    c.text += text;
    if (log) log(c.name, std::move(text));
}

void finish(Capture& c, const ExecuteLog& log) {
    std::string rest = c.decoder.finish();
    if (rest.empty()) return;
    c.text += rest;
    if (log) log(c.name, std::move(rest));
}

awaitable<void> pump(ChannelBackend& backend, output_stream stream, Capture& capture,
                     std::size_t limit, const ExecuteLog& log,
                     const std::function<awaitable<void>()>& wait_for_room) {
    if (!backend.has_output(stream)) co_return;
    std::array<char, read_size> buffer{};
    for (;;) {
        if (wait_for_room) co_await wait_for_room();
        const std::size_t ready = co_await output_ready(backend, stream);
        if (ready == 0) break;
        auto n = backend.read_output(stream, buffer);
        if (!n) break;
        take(capture, std::string_view(buffer.data(), *n), limit, log);
    }
    finish(capture, log);
}

awaitable<void> feed_stdin(ChannelBackend& backend, std::string data) {
    if (!backend.has_stdin()) co_return;
    if (!data.empty()) (void)co_await backend.write_stdin(std::move(data));
    backend.close_stdin();
}

/// The command's exit, once none of its processes is left; `gone` says whether the channel's
/// init is gone too (GoneWait::ended()).
awaitable<ChannelExit> end_of(ChannelBackend& backend, GoneWait& end, bool& gone) {
    ChannelExit exit = co_await wait_exit(backend);
    gone = co_await end.ended(backend);
    co_return exit;
}

/// Keeps `backend` until its channel's init is gone too, off the answer's path.
awaitable<void> keep_until_gone(std::unique_ptr<ChannelBackend> backend, GoneWait end) {
    co_await end.gone(*backend);
}

std::string sdk_signal_name(int sig) {
    const char* abbrev = ::sigabbrev_np(sig);
    return abbrev ? std::string("SIG") + abbrev : "SIG" + std::to_string(sig);
}

}  // namespace

awaitable<json> Provider::execute(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                  ExecuteRequest request, ExecuteLog log) {
    (void)lease;
    ExecSpec spec;
    spec.argv = std::move(request.argv);
    spec.cwd = std::move(request.cwd);
    spec.env = std::move(request.env);
    spec.stdin_attached = !request.stdin_data.empty();
    spec.drain_grace_ms = request.drain_grace_ms;
    spec.start_deadline_ms = request.start_deadline_ms;
    const auto started = std::chrono::steady_clock::now();
    std::unique_ptr<ChannelBackend> backend = co_await open(std::move(sandbox), std::move(spec));

    // The timeout kills the command; everything below then ends on its own (the pipes reach
    // EOF once its processes are gone). `done` keeps a late timer from touching the backend.
    auto done = std::make_shared<bool>(false);
    auto timed_out = std::make_shared<bool>(false);
    net::steady_timer timer(co_await net::this_coro::executor);
    timer.expires_after(std::chrono::milliseconds(request.timeout_ms));
    timer.async_wait([b = backend.get(), done, timed_out](boost::system::error_code ec) {
        if (ec || *done) return;
        *timed_out = true;
        b->kill();
    });

    Capture out{"stdout", {}, {}, 0, false};
    Capture err{"stderr", {}, {}, 0, false};
    const std::size_t limit = request.output_limit;
    bool gone = false;
    GoneWait end;
    auto results = co_await (
        pump(*backend, output_stream::out, out, limit, log, request.wait_for_room) &&
        pump(*backend, output_stream::err, err, limit, log, request.wait_for_room) &&
        feed_stdin(*backend, std::move(request.stdin_data)) && end_of(*backend, end, gone));
    ChannelExit exit = std::move(results);
    *done = true;
    timer.cancel();
    if (!gone) {
        net::co_spawn(co_await net::this_coro::executor,
                      keep_until_gone(std::move(backend), std::move(end)), net::detached);
    }
    const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - started);

    if (!exit.error.empty() && exit.error_code != errc::provider_error) {
        throw rpc_error(exit.error_code, exit.error);
    }
    json result;
    result["exitCode"] = exit.exit_code && !*timed_out ? json(*exit.exit_code) : json(nullptr);
    // The timeout's kill is SIGKILL, however the backend learnt of the end.
    const int signal = *timed_out ? SIGKILL : exit.signal;
    result["signal"] = signal > 0 ? json(sdk_signal_name(signal)) : json(nullptr);
    result["timedOut"] = *timed_out;
    result["stdout"] = std::move(out.text);
    result["stderr"] = std::move(err.text);
    result["metadata"] = {{"stdoutBytes", out.bytes},
                          {"stderrBytes", err.bytes},
                          {"truncated", out.truncated || err.truncated},
                          {"durationMs", elapsed.count()}};
    if (!exit.limit.empty()) result["metadata"]["limit"] = exit.limit;
    if (!exit.error.empty()) result["metadata"]["error"] = exit.error;
    co_return result;
}

}  // namespace sandboxd
