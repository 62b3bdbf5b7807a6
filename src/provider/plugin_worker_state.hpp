#pragma once
/// @file plugin_worker_state.hpp
/// The plugin worker manager's state, shared by the files that make it up (internal to the
/// provider layer): one worker process (Worker), one channel on the manager's thread
/// (Route) and on the channel's executor (Inbox), and WorkerManager::Impl, whose methods are
/// defined in plugin_worker_process.cpp (the worker's process and lifecycle),
/// plugin_worker_protocol.cpp (JSON-RPC over its stdin and stdout), plugin_worker_routes.cpp
/// (calls from other threads and the channels' routes) and plugin_worker.cpp (the public
/// face and the channel backend).
///
/// Everything here is used on the manager's own io_context thread only, except the Inbox
/// (the channel's executor) and the fields of Impl that say otherwise.

#include "provider/plugin_worker.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>

#include <nlohmann/json.hpp>

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace sandboxd {
namespace plugin_detail {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using descriptor = net::posix::stream_descriptor;
/// A call's completion: the result, or the error (an rpc_error) as an exception_ptr.
using ReplyFn = std::function<void(json result, std::exception_ptr error)>;

inline constexpr std::size_t stdin_write_chunk = 48 * 1024;  // 64 KiB of base64
inline constexpr std::size_t max_session_id = 256;
inline constexpr std::size_t stderr_line_max = 4096;
inline constexpr std::size_t log_text_max = 4096;  // of one `log` notification in the daemon's log
inline constexpr int api_version = 1;              // the SDK's PLUGIN_API_VERSION

struct SignalName {
    int number;
    const char* name;
};
/// The signals a channel may forward (protocol section 3's duplexChannelSignal names).
inline constexpr SignalName forwardable[] = {
    {SIGINT, "INT"},   {SIGTERM, "TERM"}, {SIGHUP, "HUP"},   {SIGQUIT, "QUIT"},
    {SIGKILL, "KILL"}, {SIGUSR1, "USR1"}, {SIGUSR2, "USR2"}, {SIGWINCH, "WINCH"}};
/// Names a worker may report in duplexChannel.exit's `signal`.
inline constexpr SignalName exit_signals[] = {
    {SIGHUP, "HUP"},   {SIGINT, "INT"},   {SIGQUIT, "QUIT"}, {SIGILL, "ILL"},    {SIGTRAP, "TRAP"},
    {SIGABRT, "ABRT"}, {SIGBUS, "BUS"},   {SIGFPE, "FPE"},   {SIGKILL, "KILL"},  {SIGUSR1, "USR1"},
    {SIGSEGV, "SEGV"}, {SIGUSR2, "USR2"}, {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"},  {SIGTERM, "TERM"},
    {SIGXCPU, "XCPU"}, {SIGXFSZ, "XFSZ"}, {SIGSYS, "SYS"},   {SIGWINCH, "WINCH"}};

inline std::exception_ptr error_ptr(errc code, std::string message) {
    return std::make_exception_ptr(rpc_error(code, std::move(message)));
}

inline void close_quietly(descriptor& d) {
    beast::error_code ignored;
    if (d.is_open()) d.close(ignored);
}

/// Whether `method` is a lease lifecycle call (its timeout is the lifecycle timeout).
inline bool is_lifecycle(const std::string& method) {
    return method == "environmentAcquireLease" || method == "environmentResumeLease" ||
           method == "environmentReleaseLease" || method == "environmentDestroyLease";
}

/// The manifest sent in `initialize`: the configured file, or the smallest one the SDK's
/// pluginManifestV1Schema accepts, built from the plugin id and provider key. Throws
/// config_error when the file cannot be read or is not a JSON object.
json load_manifest(const PluginConfig& config);

struct Route;

/// One incarnation of the worker process.
struct Worker {
    explicit Worker(net::io_context& ioc)
        : in(ioc), out(ioc), err(ioc), pidfd(ioc), eof_timer(ioc), kill_timer(ioc) {}

    struct Pending {
        std::string method;
        ReplyFn done;
        std::shared_ptr<net::steady_timer> timer;
        json params;  // kept for environmentAcquireLease only (a late answer needs them)
    };

    std::uint64_t generation = 0;
    pid_t pid = -1;
    descriptor in, out, err, pidfd;
    net::steady_timer eof_timer, kill_timer;
    std::deque<std::string> outbox;
    bool writing = false;
    std::string out_buf;
    std::string err_buf;
    std::map<std::int64_t, Pending> pending;
    /// Timed-out calls: their method and kept params (Pending::params).
    std::map<std::int64_t, std::pair<std::string, json>> abandoned;
    std::int64_t next_id = 1;
    std::set<std::string> supported;
    bool initialized = false;
    bool retired = false;  // no frame of it is processed any more
    bool exited = false;
    std::map<std::string, std::shared_ptr<Route>> routes;  // by hostRouteId, opening or bound
    std::set<std::string> sessions;                        // workerSessionIds of bound routes
};

/// The channel's side of a plugin channel: what the worker sent, until the daemon's Channel
/// reads it. Used on the channel's executor only; the manager's thread posts to it.
struct Inbox {
    explicit Inbox(const net::any_io_executor& executor) : changed(executor) {
        changed.expires_at(net::steady_timer::time_point::max());
    }
    void wake() { changed.cancel(); }

    net::steady_timer changed;       ///< woken (cancelled) on every change below
    std::deque<std::string> out[2];  // stdout, stderr: chunks, never empty
    std::size_t offset[2] = {0, 0};  // bytes of out[i].front() already read
    bool ended = false;              // no more output will come
    std::optional<ChannelExit> exit;
    bool gone = false;
    std::shared_ptr<std::atomic<std::size_t>> buffered;  // shared with the Route
};

/// One channel on the manager's thread: its ids and its phase on the worker.
struct Route {
    explicit Route(net::io_context& ioc) : stop_timer(ioc) {}

    enum class phase {
        opening,  // no open answer yet: frames are held
        open,     // frames are delivered
        exited,   // the worker sent its exit; any further frame is a violation
        closing,  // ended by the daemon; frames until the close is acknowledged are dropped
    };

    std::weak_ptr<Worker> worker;
    std::string host_route_id;
    std::string session_id;
    net::any_io_executor channel_executor;  // the Inbox's
    std::weak_ptr<Inbox> inbox;
    /// Output bytes the worker sent that the channel has not read yet (max_buffered).
    std::shared_ptr<std::atomic<std::size_t>> buffered;
    bool stdin_open = true;
    phase ph = phase::opening;
    /// Frames that came before the open answer, in order: (workerSessionId, params).
    std::vector<std::pair<std::string, json>> held;
    std::size_t held_bytes = 0;
    std::string held_overflow;  // why the route ended before its answer; "" when it did not
    bool stop_sent = false;
    bool forgotten = false;
    bool severed = false;
    net::steady_timer stop_timer;
};

/// Where open_on_io() leaves the new route for the awaiting open_channel().
struct OpenSlot {
    std::shared_ptr<Route> route;
    std::shared_ptr<Inbox> inbox;
    std::shared_ptr<std::atomic<std::size_t>> buffered;
    net::any_io_executor executor;
    // The controls the worker listed in its supportedMethods when it answered the open.
    bool close_stdin = false;
    bool signal = false;
    bool resize = false;
};

/// A worker's supportedMethods check, on the io thread.
inline bool has(const Worker& w, const char* method) { return w.supported.count(method) > 0; }

/// Kills what the worker left in its process group (the SDK exits on stdin EOF without
/// stopping the children a plugin started). Only while the worker is not yet reaped: its pid,
/// which is the group's id (spawn_process starts a session), cannot be reused until then.
inline void kill_group(const Worker& w) {
    if (w.pid > 0) ::kill(-w.pid, SIGKILL);
}

}  // namespace plugin_detail

struct WorkerManager::Impl {
    using Worker = plugin_detail::Worker;
    using Route = plugin_detail::Route;
    using Inbox = plugin_detail::Inbox;
    using OpenSlot = plugin_detail::OpenSlot;
    using ReplyFn = plugin_detail::ReplyFn;
    using Clock = plugin_detail::Clock;
    using json = plugin_detail::json;

    Impl(PluginConfig c, PluginTuning t)
        : config(std::move(c)),
          tuning(std::move(t)),
          manifest(plugin_detail::load_manifest(config)),
          work(net::make_work_guard(ioc)),
          restart_timer(ioc) {}

    PluginConfig config;
    PluginTuning tuning;
    const json manifest;
    std::function<void(json, json, json)> late_acquire;  // set before the first call
    net::io_context ioc;
    net::executor_work_guard<net::io_context::executor_type> work;
    std::thread thread;
    std::thread::id io_thread;

    std::shared_ptr<Worker> current;
    net::steady_timer restart_timer;
    std::deque<Clock::time_point> crashes;
    std::uint64_t generations = 0;
    std::uint64_t next_route = 1;
    bool gave_up = false;
    bool stopping_io = false;
    std::shared_ptr<std::promise<void>> stopped;
    /// Calls in flight within an invocation, by the paperclipInvocation id minted for them.
    struct InvocationSlot {
        net::any_io_executor executor;
        WorkerManager::Invocation invocation;
    };
    std::map<std::string, std::shared_ptr<InvocationSlot>> invocations;
    std::uint64_t next_invocation = 1;

    std::atomic<bool> ready_flag{false};
    std::atomic<std::uint64_t> ready_generation{0};
    std::atomic<std::uint64_t> restarts{0};
    std::atomic<bool> stopping{false};
    mutable std::mutex supported_mutex;
    std::set<std::string> supported_snapshot;

    // --- lifecycle
    void start_worker();
    /// Spawns the worker's process into `w` (its pid and pipes); throws when it cannot.
    void spawn_worker(Worker& w);
    /// The worker's answer to `initialize`: ready, or retired.
    void on_initialized(const std::shared_ptr<Worker>& w, json result, std::exception_ptr error);
    void on_start_failure(const std::string& why);
    void schedule_restart();
    void watch_exit(const std::shared_ptr<Worker>& w);
    void on_exit(const std::shared_ptr<Worker>& w);
    void retire(const std::shared_ptr<Worker>& w, const std::string& why);
    void fail_everything(const std::shared_ptr<Worker>& w, errc code, const std::string& why);
    void set_ready(const std::shared_ptr<Worker>& w, bool ready);
    void begin_stop(std::shared_ptr<std::promise<void>> done);
    void terminate(const std::shared_ptr<Worker>& w);
    std::string not_ready_message() const;

    // --- JSON-RPC
    void request(const std::shared_ptr<Worker>& w, const std::string& method, json params,
                 ReplyFn done, std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                 json context = nullptr, json invocation = nullptr);
    void notify_ignoring(const std::shared_ptr<Worker>& w, const std::string& method, json params);
    void send_line(const std::shared_ptr<Worker>& w, std::string line);
    void write_next(const std::shared_ptr<Worker>& w);
    void read_lines(const std::shared_ptr<Worker>& w);
    void read_stderr(const std::shared_ptr<Worker>& w);
    void on_line(const std::shared_ptr<Worker>& w, std::string_view line);
    void on_response(const std::shared_ptr<Worker>& w, const json& msg);
    void on_worker_request(const std::shared_ptr<Worker>& w, const json& msg);
    void on_log(const std::shared_ptr<Worker>& w, const json& params);
    void on_notification(const std::shared_ptr<Worker>& w, const json& msg);
    /// A data or exit frame of `r` (bound), in order.
    void deliver(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r, bool is_data,
                 const json& params);
    /// Whether `route_id` is one this manager minted (so a frame for it, unknown now, is
    /// for a route that ended: dropped, not a violation).
    bool minted(const std::string& route_id) const;
    std::chrono::milliseconds timeout_for(const std::string& method) const {
        auto it = config.timeouts_ms.find(method);
        if (it != config.timeouts_ms.end()) return std::chrono::milliseconds(it->second);
        return plugin_detail::is_lifecycle(method) ? tuning.lifecycle_timeout : tuning.rpc_timeout;
    }
    bool usable(const std::shared_ptr<Worker>& w) const {
        return w && w == current && w->initialized && !w->retired && !w->exited;
    }

    // --- calls from other threads, run here
    void call_on_io(const std::string& method, json params, bool optional, ReplyFn done,
                    json context = nullptr);
    void invoke_on_io(const std::string& method, json params, std::shared_ptr<InvocationSlot> slot,
                      ReplyFn done);
    void open_on_io(json params, std::uint64_t generation, std::shared_ptr<OpenSlot> slot,
                    ReplyFn done);
    /// The worker's answer to a route's duplexChannelOpen: the route bound to its session and
    /// what came before the answer delivered, or the open failed (`done` says which).
    void on_open_answer(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r,
                        OpenSlot& slot, const ReplyFn& done, json result, std::exception_ptr error);
    /// A route whose open failed or was lost: closed by hostRouteId alone.
    void open_failed(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r,
                     const std::string& why);
    void write_on_io(const std::shared_ptr<Route>& r, std::string bytes, ReplyFn done);
    void close_stdin_on_io(const std::shared_ptr<Route>& r);
    void signal_on_io(const std::shared_ptr<Route>& r, int sig, bool all);

    // --- channels
    /// Runs `f(inbox)` on the channel's executor, unless the channel has dropped its backend
    /// or the manager is stopping (the daemon's io_context may be gone then).
    template <typename F>
    void to_channel(const std::shared_ptr<Route>& r, F f);
    void route_data(const std::shared_ptr<Route>& r, int stream, std::string bytes);
    void route_exit(const std::shared_ptr<Route>& r, const json& params);
    void stop_route(const std::shared_ptr<Route>& r);
    void end_locally(const std::shared_ptr<Route>& r, const std::string& why,
                     errc code = errc::provider_error);
    void close_session(const std::shared_ptr<Route>& r);
    void forget(const std::shared_ptr<Route>& r);
    /// Ends the channel on the daemon's side now: no more output, and an exit with no report
    /// (outcome transportClosed, or `error` when given) unless the worker's exit came first.
    void sever(const std::shared_ptr<Route>& r, const std::string& error = {},
               errc code = errc::provider_error);
};

}  // namespace sandboxd
