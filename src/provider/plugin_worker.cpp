/// @file plugin_worker.cpp
/// The plugin worker manager (docs/plugins.md). Everything below the public methods runs on
/// the manager's own io_context thread, in plain completion handlers (no coroutines), so no
/// state here needs a lock except the readiness snapshot read by other threads.
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

#include "provider/plugin_worker.hpp"

#include "provider/spawn.hpp"

#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <span>
#include <thread>

#ifndef P_PIDFD
#define P_PIDFD 3  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using descriptor = net::posix::stream_descriptor;
/// A call's completion: the result, or the error (an rpc_error) as an exception_ptr.
using ReplyFn = std::function<void(json result, std::exception_ptr error)>;

constexpr std::size_t stdin_write_chunk = 48 * 1024;  // 64 KiB of base64
constexpr std::size_t max_session_id = 256;
constexpr std::size_t stderr_line_max = 4096;
constexpr std::size_t log_text_max = 4096;  // of one `log` notification in the daemon's log
constexpr int api_version = 1;               // the SDK's PLUGIN_API_VERSION

struct SignalName {
    int number;
    const char* name;
};
/// The signals a channel may forward (protocol section 3's duplexChannelSignal names).
constexpr SignalName forwardable[] = {{SIGINT, "INT"},   {SIGTERM, "TERM"}, {SIGHUP, "HUP"},
                                      {SIGQUIT, "QUIT"}, {SIGKILL, "KILL"}, {SIGUSR1, "USR1"},
                                      {SIGUSR2, "USR2"}, {SIGWINCH, "WINCH"}};
/// Names a worker may report in duplexChannel.exit's `signal`.
constexpr SignalName exit_signals[] = {
    {SIGHUP, "HUP"},   {SIGINT, "INT"},   {SIGQUIT, "QUIT"}, {SIGILL, "ILL"},  {SIGTRAP, "TRAP"},
    {SIGABRT, "ABRT"}, {SIGBUS, "BUS"},   {SIGFPE, "FPE"},   {SIGKILL, "KILL"}, {SIGUSR1, "USR1"},
    {SIGSEGV, "SEGV"}, {SIGUSR2, "USR2"}, {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"}, {SIGTERM, "TERM"},
    {SIGXCPU, "XCPU"}, {SIGXFSZ, "XFSZ"}, {SIGSYS, "SYS"},   {SIGWINCH, "WINCH"}};

std::exception_ptr error_ptr(errc code, std::string message) {
    return std::make_exception_ptr(rpc_error(code, std::move(message)));
}

void close_quietly(descriptor& d) {
    beast::error_code ignored;
    if (d.is_open()) d.close(ignored);
}

/// The executable for command[0]: a path as given, else the first match on $PATH.
std::string resolve_program(const std::string& name) {
    if (name.find('/') != std::string::npos) return name;
    const char* path = std::getenv("PATH");
    std::string dirs = path && *path ? path : "/usr/local/bin:/usr/bin:/bin";
    std::size_t start = 0;
    while (start <= dirs.size()) {
        auto end = dirs.find(':', start);
        if (end == std::string::npos) end = dirs.size();
        std::string dir = dirs.substr(start, end - start);
        if (dir.empty()) dir = ".";
        std::string candidate = dir;
        candidate.append("/").append(name);
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
        start = end + 1;
    }
    return name;  // spawn reports ENOENT
}

/// The manifest sent in `initialize`: the configured file, or the smallest one the SDK's
/// pluginManifestV1Schema accepts, built from the plugin id and provider key.
json load_manifest(const PluginConfig& config) {
    if (config.manifest.empty()) {
        return {{"id", config.plugin_id},
                {"apiVersion", api_version},
                {"version", "0.0.0"},
                {"displayName", config.plugin_id},
                {"description", "sandboxd plugin provider " + config.provider},
                {"author", "sandboxd"},
                {"categories", {"workspace"}},
                {"capabilities", {"environment.drivers.register"}},
                {"entrypoints", {{"worker", "worker.js"}}},
                {"environmentDrivers",
                 {{{"driverKey", config.provider},
                   {"kind", "sandbox_provider"},
                   {"displayName", config.provider},
                   {"configSchema", json::object()}}}}};
    }
    const std::string where = "providers.plugins (" + config.plugin_id + ").manifest";
    std::ifstream in(config.manifest, std::ios::binary);
    if (!in) throw config_error(where + ": cannot read " + config.manifest);
    std::ostringstream text;
    text << in.rdbuf();
    auto parsed = try_parse_json(text.str(), {.ignore_comments = true});
    if (parsed.status == json_parse_status::too_deep) {
        throw config_error(where + ": " + config.manifest + " is " + parsed.error);
    }
    if (!parsed.ok() || !parsed.value.is_object()) {
        throw config_error(where + ": " + config.manifest + " is not a JSON object");
    }
    return std::move(parsed.value);
}

bool is_lifecycle(const std::string& method) {
    return method == "environmentAcquireLease" || method == "environmentResumeLease" ||
           method == "environmentReleaseLease" || method == "environmentDestroyLease";
}

std::string exe_dir() {
    std::error_code ec;
    fs::path self = fs::read_symlink("/proc/self/exe", ec);
    return ec ? std::string() : self.parent_path().string();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// State (io thread only)

namespace {

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
    std::set<std::string> sessions;  // workerSessionIds of bound routes
};

/// The channel's side of a plugin channel: what the worker sent, until the daemon's Channel
/// reads it. Used on the channel's executor only; the manager's thread posts to it.
struct Inbox {
    explicit Inbox(const net::any_io_executor& executor) : changed(executor) {
        changed.expires_at(net::steady_timer::time_point::max());
    }
    void wake() { changed.cancel(); }

    net::steady_timer changed;  ///< woken (cancelled) on every change below
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

}  // namespace

struct WorkerManager::Impl {
    Impl(PluginConfig c, PluginTuning t)
        : config(std::move(c)), tuning(std::move(t)), manifest(load_manifest(config)),
          work(net::make_work_guard(ioc)), restart_timer(ioc) {}

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
    void deliver(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r,
                 bool is_data, const json& params);
    /// Whether `route_id` is one this manager minted (so a frame for it, unknown now, is
    /// for a route that ended: dropped, not a violation).
    bool minted(const std::string& route_id) const;
    std::chrono::milliseconds timeout_for(const std::string& method) const {
        auto it = config.timeouts_ms.find(method);
        if (it != config.timeouts_ms.end()) return std::chrono::milliseconds(it->second);
        return is_lifecycle(method) ? tuning.lifecycle_timeout : tuning.rpc_timeout;
    }
    bool usable(const std::shared_ptr<Worker>& w) const {
        return w && w == current && w->initialized && !w->retired && !w->exited;
    }

    // --- calls from other threads, run here
    void call_on_io(const std::string& method, json params, bool optional, ReplyFn done,
                    json context = nullptr);
    void invoke_on_io(const std::string& method, json params,
                      std::shared_ptr<InvocationSlot> slot, ReplyFn done);
    void open_on_io(json params, std::uint64_t generation, std::shared_ptr<OpenSlot> slot,
                    ReplyFn done);
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

namespace {
/// A worker's supportedMethods check, on the io thread.
bool has(const Worker& w, const char* method) { return w.supported.count(method) > 0; }
}  // namespace

// ---------------------------------------------------------------------------------------
// Lifecycle

void WorkerManager::Impl::start_worker() {
    if (stopping_io) return;
    auto w = std::make_shared<Worker>(ioc);
    w->generation = ++generations;
    try {
        std::map<std::string, std::string> env;
        const char* path = std::getenv("PATH");
        env["PATH"] = path && *path ? path : "/usr/local/bin:/usr/bin:/bin";
        env["LANG"] = "C.UTF-8";
        for (const char* name : {"HOME", "TMPDIR"}) {
            if (const char* v = std::getenv(name); v && *v) env[name] = v;
        }
        env["SANDBOXD_PLUGIN_ID"] = config.plugin_id;
        env["SANDBOXD_PLUGIN_PROVIDER"] = config.provider;
        env["SANDBOXD_EXE_DIR"] = exe_dir();
        for (const auto& [k, v] : config.env) env[k] = v;

        detail::SpawnRequest req;
        req.argv = config.command;
        req.argv[0] = resolve_program(config.command[0]);
        req.envp.reserve(env.size());
        for (const auto& [k, v] : env) req.envp.push_back(std::string(k).append("=").append(v));
        auto in = detail::make_pipe(detail::daemon_end::write);
        auto out = detail::make_pipe(detail::daemon_end::read);
        auto err = detail::make_pipe(detail::daemon_end::read);
        req.fds[0] = in.read_end.get();
        req.fds[1] = out.write_end.get();
        req.fds[2] = err.write_end.get();
        auto child = detail::spawn_process(req, "plugin " + config.plugin_id + " worker");
        w->pid = child.pid;
        w->pidfd.assign(child.pidfd.release());
        w->in.assign(in.write_end.release());
        w->out.assign(out.read_end.release());
        w->err.assign(err.read_end.release());
    } catch (const std::exception& e) {
        on_start_failure(e.what());
        return;
    }
    current = w;
    spdlog::info("plugin={} worker started: pid={} command={}", config.plugin_id, w->pid,
                 config.command[0]);
    watch_exit(w);
    read_lines(w);
    read_stderr(w);
    json params = {{"manifest", manifest},
                   {"config", config.config},
                   {"instanceInfo",
                    {{"instanceId", tuning.instance_id}, {"hostVersion", version_string}}},
                   {"apiVersion", api_version}};
    request(w, "initialize", std::move(params), [this, w](json result, std::exception_ptr error) {
        if (w->retired || w->exited) return;
        if (error) {
            std::string why = "initialize failed";
            try {
                std::rethrow_exception(error);
            } catch (const std::exception& e) {
                why += std::string(": ") + e.what();
            }
            retire(w, why);
            return;
        }
        // The SDK answers {ok: true, supportedMethods?}; the list names the optional methods
        // the plugin implements (health and shutdown are always served).
        if (!result.is_object() || result.value("ok", true) != true) {
            retire(w, "initialize did not answer {ok: true}: " + result.dump().substr(0, 200));
            return;
        }
        const json methods = result.value("supportedMethods", json::array());
        if (!methods.is_array()) {
            retire(w, "initialize's supportedMethods is not an array");
            return;
        }
        w->supported.insert("health");
        w->supported.insert("shutdown");
        for (const auto& m : methods) {
            if (!m.is_string()) {
                retire(w, "supportedMethods holds a non-string");
                return;
            }
            w->supported.insert(m.get<std::string>());
        }
        w->initialized = true;
        set_ready(w, true);
        std::string list;
        for (const auto& m : w->supported) list += (list.empty() ? "" : ",") + m;
        spdlog::info("plugin={} worker pid={} ready: supportedMethods={}", config.plugin_id,
                     w->pid, list);
        // What the plugin says of itself, for the log; readiness does not wait for it.
        request(w, "health", json::object(), [this, w](json health, std::exception_ptr failed) {
            if (failed) return;
            const std::string status = health.is_object() ? health.value("status", "?") : "?";
            if (status == "ok") {
                spdlog::info("plugin={} worker pid={} health: ok", config.plugin_id, w->pid);
            } else {
                spdlog::warn("plugin={} worker pid={} health: {}", config.plugin_id, w->pid,
                             health.dump().substr(0, log_text_max));
            }
        });
    });
}

void WorkerManager::Impl::on_start_failure(const std::string& why) {
    spdlog::error("plugin={} cannot start its worker: {}", config.plugin_id, why);
    schedule_restart();
}

void WorkerManager::Impl::schedule_restart() {
    if (stopping_io) return;
    const auto now = Clock::now();
    crashes.push_back(now);
    while (!crashes.empty() && now - crashes.front() > tuning.crash_window) crashes.pop_front();
    const auto n = static_cast<int>(crashes.size());
    if (n >= tuning.crash_limit) {
        gave_up = true;
        spdlog::error("plugin={} gave up: its worker exited {} times within {} s; the provider "
                      "stays not ready until the daemon restarts",
                      config.plugin_id, n,
                      std::chrono::duration_cast<std::chrono::seconds>(tuning.crash_window).count());
        return;
    }
    auto delay = tuning.restart_initial;
    for (int i = 1; i < n && delay < tuning.restart_max; ++i) delay *= 2;
    delay = std::min(delay, tuning.restart_max);
    spdlog::warn("plugin={} restarting its worker in {} ms ({} exits within the window)",
                 config.plugin_id, delay.count(), n);
    restart_timer.expires_after(delay);
    restart_timer.async_wait([this](beast::error_code ec) {
        if (ec) return;
        restarts.fetch_add(1, std::memory_order_relaxed);
        start_worker();
    });
}

void WorkerManager::Impl::watch_exit(const std::shared_ptr<Worker>& w) {
    w->pidfd.async_wait(net::posix::descriptor_base::wait_read,
                        [this, w](beast::error_code) { on_exit(w); });
}

namespace {
/// Kills what the worker left in its process group (the SDK exits on stdin EOF without
/// stopping the children a plugin started). Only while the worker is not yet reaped: its pid,
/// which is the group's id (spawn_process starts a session), cannot be reused until then.
void kill_group(const Worker& w) {
    if (w.pid > 0) ::kill(-w.pid, SIGKILL);
}
}  // namespace

void WorkerManager::Impl::on_exit(const std::shared_ptr<Worker>& w) {
    if (w->exited) return;
    kill_group(*w);
    siginfo_t info{};
    ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(w->pidfd.native_handle()), &info,
             WEXITED);
    w->exited = true;
    std::string how = info.si_code == CLD_EXITED ? "exit status " + std::to_string(info.si_status)
                                                 : "signal " + std::to_string(info.si_status);
    if (stopping_io) {
        spdlog::info("plugin={} worker pid={} stopped ({})", config.plugin_id, w->pid, how);
    } else if (!w->retired) {
        spdlog::error("plugin={} worker pid={} exited ({})", config.plugin_id, w->pid, how);
    }
    fail_everything(w, errc::provider_not_ready,
                    "plugin " + config.plugin_id + ": its worker exited during the call");
    w->kill_timer.cancel();
    w->eof_timer.cancel();
    close_quietly(w->in);
    close_quietly(w->out);
    close_quietly(w->pidfd);
    // w->err is left to read to EOF: its last lines still reach the log.
    if (w == current) {
        set_ready(w, false);
        current.reset();
        if (stopping_io) {
            if (stopped) std::exchange(stopped, nullptr)->set_value();
        } else {
            schedule_restart();
        }
    }
}

void WorkerManager::Impl::retire(const std::shared_ptr<Worker>& w, const std::string& why) {
    if (w->retired || w->exited) return;
    w->retired = true;
    spdlog::error("plugin={} retiring worker pid={}: {}", config.plugin_id, w->pid, why);
    if (w == current) set_ready(w, false);
    fail_everything(w, errc::provider_not_ready,
                    "plugin " + config.plugin_id + ": its worker was retired during the call");
    close_quietly(w->in);
    close_quietly(w->out);
    ::syscall(SYS_pidfd_send_signal, w->pidfd.native_handle(), SIGKILL, nullptr, 0);
    kill_group(*w);
    // on_exit (the pidfd) reaps it and schedules the restart.
}

void WorkerManager::Impl::fail_everything(const std::shared_ptr<Worker>& w, errc code,
                                          const std::string& why) {
    auto routes = std::move(w->routes);
    w->routes.clear();
    w->sessions.clear();
    for (auto& [key, r] : routes) {
        r->forgotten = true;
        sever(r);
    }
    auto pending = std::move(w->pending);
    w->pending.clear();
    for (auto& [id, p] : pending) {
        p.timer->cancel();
        p.done(json(), error_ptr(code, why));
    }
    w->abandoned.clear();
}

void WorkerManager::Impl::set_ready(const std::shared_ptr<Worker>& w, bool ready) {
    std::lock_guard lock(supported_mutex);
    supported_snapshot = ready ? w->supported : std::set<std::string>{};
    ready_generation = ready ? w->generation : 0;
    ready_flag = ready;
}

std::string WorkerManager::Impl::not_ready_message() const {
    std::string state = gave_up                     ? "gave up after repeated crashes"
                        : stopping_io               ? "stopping"
                        : current && !current->retired ? "starting"
                                                       : "down, restarting";
    return "plugin " + config.plugin_id + " (provider " + config.provider +
           ") is not ready: its worker is " + state;
}

void WorkerManager::Impl::begin_stop(std::shared_ptr<std::promise<void>> done) {
    stopping_io = true;
    restart_timer.cancel();
    auto w = current;
    if (!w) {
        done->set_value();
        return;
    }
    stopped = std::move(done);
    set_ready(w, false);
    if (w->initialized && !w->retired) {
        request(w, "shutdown", json::object(),
                [this, w](json, std::exception_ptr) { terminate(w); }, tuning.shutdown_grace);
    } else {
        terminate(w);
    }
}

void WorkerManager::Impl::terminate(const std::shared_ptr<Worker>& w) {
    if (w->exited) return;
    close_quietly(w->in);  // stdin at EOF: a worker must exit
    // A moment to exit on its own after `shutdown`, then SIGTERM, then SIGKILL.
    w->kill_timer.expires_after(std::chrono::seconds(1));
    w->kill_timer.async_wait([this, w](beast::error_code ec) {
        if (ec || w->exited) return;
        ::syscall(SYS_pidfd_send_signal, w->pidfd.native_handle(), SIGTERM, nullptr, 0);
        w->kill_timer.expires_after(tuning.shutdown_grace);
        w->kill_timer.async_wait([w](beast::error_code ec2) {
            if (ec2 || w->exited) return;
            ::syscall(SYS_pidfd_send_signal, w->pidfd.native_handle(), SIGKILL, nullptr, 0);
        });
    });
}

// ---------------------------------------------------------------------------------------
// JSON-RPC over the worker's stdin and stdout

void WorkerManager::Impl::request(const std::shared_ptr<Worker>& w, const std::string& method,
                                  json params, ReplyFn done,
                                  std::optional<std::chrono::milliseconds> timeout,
                                  json context, json invocation) {
    const std::int64_t id = w->next_id++;
    std::string line;
    json kept = method == "environmentAcquireLease"
                    ? json{{"params", params}, {"context", std::move(context)}}
                    : json();
    try {
        if (invocation.is_null()) {
            line = jsonrpc::request(id, method, std::move(params));
        } else {
            line = json{{"jsonrpc", "2.0"}, {"id", id}, {"method", method},
                        {"params", std::move(params)}, {"paperclipInvocation", std::move(invocation)}}
                       .dump();
        }
    } catch (const json::exception&) {
        // Strings that are not UTF-8 (e.g. argv bytes) cannot travel in JSON.
        done(json(), error_ptr(errc::provider_error,
                               "plugin " + config.plugin_id + ": " + method +
                                   " params are not valid UTF-8 text"));
        return;
    }
    auto timer = std::make_shared<net::steady_timer>(ioc);
    const auto limit = timeout.value_or(timeout_for(method));
    timer->expires_after(limit);
    timer->async_wait([this, w, id, limit](beast::error_code ec) {
        if (ec) return;
        auto it = w->pending.find(id);
        if (it == w->pending.end()) return;
        auto p = std::move(it->second);
        w->pending.erase(it);
        w->abandoned[id] = std::make_pair(p.method, std::move(p.params));
        spdlog::warn("plugin={} worker pid={}: {} (id {}) timed out after {} ms",
                     config.plugin_id, w->pid, p.method, id, limit.count());
        p.done(json(), error_ptr(errc::provider_error,
                                 "plugin " + config.plugin_id + ": " + p.method +
                                     " timed out after " + std::to_string(limit.count()) + " ms"));
    });
    w->pending.emplace(id, Worker::Pending{method, std::move(done), std::move(timer),
                                           std::move(kept)});
    send_line(w, std::move(line));
}

void WorkerManager::Impl::notify_ignoring(const std::shared_ptr<Worker>& w,
                                          const std::string& method, json params) {
    request(w, method, std::move(params), [](json, std::exception_ptr) {});
}

void WorkerManager::Impl::send_line(const std::shared_ptr<Worker>& w, std::string line) {
    if (w->exited || w->retired || !w->in.is_open()) return;
    line.push_back('\n');
    w->outbox.push_back(std::move(line));
    if (!w->writing) write_next(w);
}

void WorkerManager::Impl::write_next(const std::shared_ptr<Worker>& w) {
    if (w->outbox.empty() || !w->in.is_open()) {
        w->writing = false;
        return;
    }
    w->writing = true;
    net::async_write(w->in, net::buffer(w->outbox.front()),
                     [this, w](beast::error_code ec, std::size_t) {
                         if (ec) {  // the worker is gone or closing: its exit is handled there
                             w->outbox.clear();
                             w->writing = false;
                             return;
                         }
                         w->outbox.pop_front();
                         write_next(w);
                     });
}

void WorkerManager::Impl::read_lines(const std::shared_ptr<Worker>& w) {
    net::async_read_until(
        w->out, net::dynamic_buffer(w->out_buf, tuning.max_line), '\n',
        [this, w](beast::error_code ec, std::size_t n) {
            if (w->retired || w->exited) return;
            if (ec == net::error::not_found) {
                retire(w, "sent a line longer than " + std::to_string(tuning.max_line) + " bytes");
                return;
            }
            if (ec) {
                // EOF: normally the process is exiting (the pidfd follows); one that lives on
                // without its stdout can answer nothing.
                w->eof_timer.expires_after(std::chrono::seconds(1));
                w->eof_timer.async_wait([this, w](beast::error_code tec) {
                    if (!tec && !w->exited) retire(w, "closed its stdout");
                });
                return;
            }
            std::string line = w->out_buf.substr(0, n - 1);
            w->out_buf.erase(0, n);
            on_line(w, line);
            if (!w->retired && !w->exited) read_lines(w);
        });
}

void WorkerManager::Impl::read_stderr(const std::shared_ptr<Worker>& w) {
    auto chunk = std::make_shared<std::array<char, 4096>>();
    w->err.async_read_some(net::buffer(*chunk), [this, w, chunk](beast::error_code ec,
                                                                 std::size_t n) {
        w->err_buf.append(chunk->data(), n);
        std::size_t pos = 0;
        for (;;) {
            auto nl = w->err_buf.find('\n', pos);
            if (nl == std::string::npos) break;
            spdlog::info("plugin={} pid={} {}", config.plugin_id, w->pid,
                         std::string_view(w->err_buf).substr(pos, nl - pos));
            pos = nl + 1;
        }
        w->err_buf.erase(0, pos);
        if (w->err_buf.size() >= stderr_line_max || (ec && !w->err_buf.empty())) {
            spdlog::info("plugin={} pid={} {}", config.plugin_id, w->pid, w->err_buf);
            w->err_buf.clear();
        }
        if (ec) {
            close_quietly(w->err);
            return;
        }
        read_stderr(w);
    });
}

void WorkerManager::Impl::on_line(const std::shared_ptr<Worker>& w, std::string_view line) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    auto parsed = parse_worker_line(line);
    switch (parsed.kind) {
    case worker_line_kind::blank:
        return;
    case worker_line_kind::text:
        // A plugin's console.log writes plain text to stdout (the SDK does not redirect it):
        // logged and dropped, as paperclip's host does. It can answer or forge nothing.
        spdlog::info("plugin={} pid={} stdout: {}", config.plugin_id, w->pid,
                     line.substr(0, log_text_max));
        return;
    case worker_line_kind::response:
        on_response(w, parsed.message);
        return;
    case worker_line_kind::request:
        on_worker_request(w, parsed.message);
        return;
    case worker_line_kind::notification:
        on_notification(w, parsed.message);
        return;
    case worker_line_kind::invalid:
        spdlog::warn("plugin={} worker pid={}: a message that is neither a response, a request "
                     "nor a notification was dropped: {}",
                     config.plugin_id, w->pid, line.substr(0, 200));
        return;
    }
}

void WorkerManager::Impl::on_worker_request(const std::shared_ptr<Worker>& w, const json& msg) {
    const std::string method = msg["method"].get<std::string>();
    if (method == "config.get") {
        // The instance config of the plugin's entry, whatever company it names: one daemon
        // serves one config per plugin (docs/plugins.md, "Worker to host").
        send_line(w, jsonrpc::result(msg["id"], config.config));
        return;
    }
    spdlog::debug("plugin={} worker pid={}: host method {} is not served", config.plugin_id,
                  w->pid, method);
    send_line(w, jsonrpc::error(msg["id"], {{"code", -32601},
                                            {"message", "Host does not handle method \"" +
                                                            method.substr(0, 200) + "\""}}));
}

void WorkerManager::Impl::on_log(const std::shared_ptr<Worker>& w, const json& params) {
    if (!params.is_object()) return;
    const std::string level = params.value("level", "info");
    std::string text = params.contains("message") && params["message"].is_string()
                           ? params["message"].get<std::string>()
                           : std::string("(no message)");
    if (params.contains("meta") && !params["meta"].is_null()) {
        text += " " + params["meta"].dump(-1, ' ', false, json::error_handler_t::replace);
    }
    if (text.size() > log_text_max) text.resize(log_text_max);
    const auto lvl = level == "error"   ? spdlog::level::err
                     : level == "warn"  ? spdlog::level::warn
                     : level == "debug" ? spdlog::level::debug
                                        : spdlog::level::info;
    spdlog::log(lvl, "plugin={} pid={} {}", config.plugin_id, w->pid, text);
}

void WorkerManager::Impl::on_response(const std::shared_ptr<Worker>& w, const json& msg) {
    if (!msg["id"].is_number_integer()) {
        retire(w, "answered with an id the daemon never used");
        return;
    }
    const auto id = msg["id"].get<std::int64_t>();
    auto it = w->pending.find(id);
    if (it == w->pending.end()) {
        auto late = w->abandoned.find(id);
        if (late == w->abandoned.end()) {
            retire(w, "answered request " + std::to_string(id) +
                          ", which is not pending (a duplicate or unknown reply)");
            return;
        }
        auto [method, kept] = std::move(late->second);
        w->abandoned.erase(late);
        spdlog::warn("plugin={} worker pid={}: late answer to {} (id {})", config.plugin_id,
                     w->pid, method, id);
        // An acquire that answered after its timeout made a sandbox nobody holds: the node
        // records it and tears it down (no leak). A late open was closed at its timeout.
        if (method == "environmentAcquireLease" && msg.contains("result") && late_acquire) {
            late_acquire(std::move(kept["params"]), msg["result"], std::move(kept["context"]));
        }
        return;
    }
    auto p = std::move(it->second);
    w->pending.erase(it);
    p.timer->cancel();
    if (msg.contains("error")) {
        const json& e = msg["error"];
        const int code = e.is_object() && e.contains("code") && e["code"].is_number_integer()
                             ? e["code"].get<int>()
                             : 0;
        const std::string text = e.is_object() && e.contains("message") && e["message"].is_string()
                                     ? e["message"].get<std::string>()
                                     : e.dump();
        spdlog::warn("plugin={} worker pid={}: {} failed: code={} {}", config.plugin_id, w->pid,
                     p.method, code, text.substr(0, log_text_max));
        if (code == -32602) {
            p.done(json(), error_ptr(errc::invalid_params, text));
        } else {
            p.done(json(), error_ptr(errc::provider_error,
                                     "plugin " + config.plugin_id + ": " + p.method +
                                         " failed (the daemon log has the worker's message)"));
        }
        return;
    }
    p.done(msg["result"], nullptr);
}

bool WorkerManager::Impl::minted(const std::string& route_id) const {
    const std::string prefix = config.plugin_id + "-";
    if (route_id.compare(0, prefix.size(), prefix) != 0) return false;
    const std::string digits = route_id.substr(prefix.size());
    if (digits.empty() || digits.size() > 19 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
        return false;
    }
    return std::stoull(digits) < next_route;
}

void WorkerManager::Impl::on_notification(const std::shared_ptr<Worker>& w, const json& msg) {
    const std::string method = msg["method"].get<std::string>();
    const json& p = msg.contains("params") ? msg["params"] : json();
    if (method == "log") {
        on_log(w, p);
        return;
    }
    if (method == "execute.log") {
        // Routed by the invocation id the SDK stamps, as paperclip's host does; without one
        // (or after its call was answered) it has nowhere to go.
        const json* id = msg.contains("paperclipInvocationId") ? &msg["paperclipInvocationId"]
                                                               : nullptr;
        auto it = id && id->is_string() ? invocations.find(id->get<std::string>())
                                        : invocations.end();
        if (it == invocations.end()) {
            spdlog::debug("plugin={} worker pid={}: execute.log outside a call dropped",
                          config.plugin_id, w->pid);
            return;
        }
        net::post(it->second->executor, [slot = it->second, method, p]() {
            slot->invocation.on_notification(method, p);
        });
        return;
    }
    const bool is_data = method == "duplexChannel.data";
    const bool is_exit = method == "duplexChannel.exit";
    if (!is_data && !is_exit) {
        spdlog::debug("plugin={} worker pid={}: notification {} ignored", config.plugin_id,
                      w->pid, method);
        return;
    }
    auto str = [&p](const char* k) {
        return p.is_object() && p.contains(k) && p[k].is_string();
    };
    if (!str("hostRouteId") || !str("workerSessionId")) {
        retire(w, method + " without a hostRouteId and workerSessionId");
        return;
    }
    const std::string route_id = p["hostRouteId"].get<std::string>();
    const std::string session = p["workerSessionId"].get<std::string>();
    auto it = w->routes.find(route_id);
    if (it == w->routes.end()) {
        if (minted(route_id)) return;  // a route that ended (closed): dropped
        retire(w, method + " for a hostRouteId the daemon never opened (" +
                      route_id.substr(0, 200) + ")");
        return;
    }
    auto r = it->second;
    if (r->ph == Route::phase::opening) {
        // Before the open answer (the SDK allows it): held, bounded, checked at the bind.
        if (!r->held_overflow.empty()) return;
        std::size_t bytes = is_data && str("chunk") ? p["chunk"].get<std::string>().size() : 0;
        if (r->held.size() >= tuning.max_held_frames ||
            r->held_bytes + bytes / 4 * 3 > tuning.max_held_bytes) {
            r->held_overflow = "more than " + std::to_string(tuning.max_held_frames) +
                               " frames or " + std::to_string(tuning.max_held_bytes) +
                               " bytes came before the open answer";
            r->held.clear();
            return;
        }
        r->held_bytes += bytes / 4 * 3;
        r->held.emplace_back(session, msg);
        return;
    }
    if (session != r->session_id) {
        retire(w, method + " for a foreign (hostRouteId, workerSessionId) pair (" + route_id +
                      ", " + session.substr(0, 200) + ")");
        return;
    }
    deliver(w, r, is_data, p);
}

void WorkerManager::Impl::deliver(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r,
                                  bool is_data, const json& p) {
    if (r->ph == Route::phase::exited) return;  // after its exit: dropped (closing follows)
    if (is_data) {
        int stream = 0;
        if (p.contains("stream")) {  // a sandboxd extension; the SDK has stdout only
            if (p["stream"] == "stderr") {
                stream = 1;
            } else if (p["stream"] != "stdout") {
                retire(w, "duplexChannel.data with a stream that is not stdout or stderr");
                return;
            }
        }
        if (!p.contains("chunk") || !p["chunk"].is_string()) {
            retire(w, "duplexChannel.data without a chunk");
            return;
        }
        std::string bytes;
        try {
            bytes = base64_decode(p["chunk"].get<std::string>());
        } catch (const std::exception&) {
            retire(w, "duplexChannel.data with a chunk that is not base64");
            return;
        }
        if (r->ph == Route::phase::closing) return;  // ended by the daemon: dropped
        route_data(r, stream, std::move(bytes));
        return;
    }
    // duplexChannel.exit: exitCode is any number or null (the SDK passes what the plugin gave).
    const json code = p.value("exitCode", json());
    if (!code.is_null() && !code.is_number()) {
        retire(w, "duplexChannel.exit with an exitCode that is neither a number nor null");
        return;
    }
    if (r->ph == Route::phase::closing) {
        if (!has(*w, "duplexChannelClose")) forget(r);
        return;
    }
    route_exit(r, p);
}

// ---------------------------------------------------------------------------------------
// Calls from other threads

void WorkerManager::Impl::call_on_io(const std::string& method, json params, bool optional,
                                     ReplyFn done, json context) {
    auto w = current;
    if (!usable(w) || stopping_io) {
        done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
        return;
    }
    if (optional) {
        // call_if_supported(): null for "not called", {result} for a result (even null).
        if (!w->supported.count(method)) {
            done(json(nullptr), nullptr);
            return;
        }
        done = [done = std::move(done)](json result, std::exception_ptr error) {
            done(error ? json() : json{{"result", std::move(result)}}, error);
        };
    }
    request(w, method, std::move(params), std::move(done), std::nullopt, std::move(context));
}

void WorkerManager::Impl::invoke_on_io(const std::string& method, json params,
                                       std::shared_ptr<InvocationSlot> slot, ReplyFn done) {
    auto w = current;
    if (!usable(w) || stopping_io) {
        done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
        return;
    }
    if (!w->supported.count(method)) {
        done(json(nullptr), nullptr);
        return;
    }
    const std::string id = config.plugin_id + "-invocation-" + std::to_string(next_invocation++);
    json envelope = {{"id", id}, {"scope", {{"companyId", slot->invocation.company_id}}}};
    const auto timeout = slot->invocation.timeout;
    invocations.emplace(id, std::move(slot));
    done = [this, id, done = std::move(done)](json result, std::exception_ptr error) {
        invocations.erase(id);  // what the worker stamps with it from now on is dropped
        done(error ? json() : json{{"result", std::move(result)}}, error);
    };
    request(w, method, std::move(params), std::move(done), timeout, nullptr, std::move(envelope));
}

void WorkerManager::Impl::open_on_io(json params, std::uint64_t generation,
                                     std::shared_ptr<OpenSlot> slot, ReplyFn done) {
    auto w = current;
    if (!usable(w) || stopping_io) {
        done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
        return;
    }
    if (w->generation != generation) {
        done(json(), error_ptr(errc::provider_not_ready,
                               "plugin " + config.plugin_id +
                                   ": its worker restarted during the open; retry"));
        return;
    }
    if (!has(*w, "duplexChannelOpen")) {
        done(json(), error_ptr(errc::provider_error,
                               "plugin " + config.plugin_id +
                                   " does not support duplex channels (duplexChannelOpen is not "
                                   "in its supportedMethods)"));
        return;
    }
    const std::string route_id = config.plugin_id + "-" + std::to_string(next_route++);
    params["hostRouteId"] = route_id;
    // The route exists from now on: frames the worker sends before its answer are held.
    auto r = std::make_shared<Route>(ioc);
    r->worker = w;
    r->host_route_id = route_id;
    r->channel_executor = slot->executor;
    r->inbox = slot->inbox;
    r->buffered = slot->buffered;
    w->routes.emplace(route_id, r);
    auto fail = [this, w, r](const std::string& why) {
        // Paperclip's way: a route whose open failed or was lost is closed by hostRouteId
        // alone (the worker may have bound a session the daemon never learnt).
        r->ph = Route::phase::closing;
        r->held.clear();
        forget(r);
        if (!w->retired && !w->exited && has(*w, "duplexChannelClose")) {
            notify_ignoring(w, "duplexChannelClose", {{"hostRouteId", r->host_route_id}});
        }
        spdlog::debug("plugin={} channel route={} not opened: {}", config.plugin_id,
                      r->host_route_id, why);
    };
    auto reply = [this, w, r, slot, done, fail](json result, std::exception_ptr error) {
        if (w->retired || w->exited) {
            done(json(), error ? error : error_ptr(errc::provider_not_ready, not_ready_message()));
            return;
        }
        if (error) {
            fail("the open failed or timed out");
            done(json(), error);
            return;
        }
        const bool shaped = result.is_object() && result.contains("hostRouteId") &&
                            result["hostRouteId"] == r->host_route_id &&
                            result.contains("workerSessionId") &&
                            result["workerSessionId"].is_string() &&
                            !result["workerSessionId"].get<std::string>().empty() &&
                            result["workerSessionId"].get<std::string>().size() <= max_session_id;
        if (!shaped) {
            retire(w, "answered duplexChannelOpen without echoing hostRouteId " +
                          r->host_route_id + " or without a workerSessionId (1.." +
                          std::to_string(max_session_id) + " bytes)");
            done(json(), error_ptr(errc::provider_error,
                                   "plugin " + config.plugin_id +
                                       ": the worker answered duplexChannelOpen wrongly and was "
                                       "retired"));
            return;
        }
        std::string session = result["workerSessionId"].get<std::string>();
        if (w->sessions.count(session)) {
            retire(w, "reused workerSessionId " + session + " of a live channel");
            done(json(), error_ptr(errc::provider_error,
                                   "plugin " + config.plugin_id +
                                       ": the worker reused a live workerSessionId and was "
                                       "retired"));
            return;
        }
        r->session_id = session;
        w->sessions.insert(session);
        if (!r->held_overflow.empty()) {
            const std::string why = r->held_overflow;
            r->ph = Route::phase::closing;
            close_session(r);
            done(json(), error_ptr(errc::provider_error,
                                   "plugin " + config.plugin_id + ": the channel " + why));
            return;
        }
        r->ph = Route::phase::open;
        spdlog::debug("plugin={} channel route={} session={} opened", config.plugin_id,
                      r->host_route_id, session);
        // What came before the answer, in order, through the exact-pair check.
        auto held = std::move(r->held);
        r->held.clear();
        for (auto& [held_session, msg] : held) {
            if (held_session != session) {
                retire(w, "sent " + msg["method"].get<std::string>() +
                              " before the open answer under workerSessionId " +
                              held_session.substr(0, 200) + ", not the one it bound (" +
                              session + ")");
                break;
            }
            deliver(w, r, msg["method"] == "duplexChannel.data", msg["params"]);
            if (w->retired) break;
        }
        if (w->retired) {
            done(json(), error_ptr(errc::provider_error,
                                   "plugin " + config.plugin_id +
                                       ": the worker broke the protocol and was retired"));
            return;
        }
        slot->route = r;
        slot->close_stdin = has(*w, "duplexChannelCloseStdin");
        slot->signal = has(*w, "duplexChannelSignal");
        slot->resize = has(*w, "duplexChannelResize");
        done(json{{"hostRouteId", r->host_route_id}, {"workerSessionId", session}}, nullptr);
    };
    request(w, "duplexChannelOpen", std::move(params), std::move(reply));
}

void WorkerManager::Impl::write_on_io(const std::shared_ptr<Route>& r, std::string bytes,
                                      ReplyFn done) {
    auto w = r->worker.lock();
    if (!r->stdin_open || r->ph != Route::phase::open || !w || w->retired || w->exited) {
        done(json(false), nullptr);
        return;
    }
    json p = {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}};
    p["data"] = base64_encode(bytes);
    // One write in flight per channel: the worker's answer is the flow control.
    request(w, "duplexChannelWrite", std::move(p),
            [r, done = std::move(done)](json, std::exception_ptr error) {
                // An error: the command no longer takes stdin; later writes are dropped.
                if (error) r->stdin_open = false;
                done(json(!error), nullptr);
            });
}

void WorkerManager::Impl::close_stdin_on_io(const std::shared_ptr<Route>& r) {
    auto w = r->worker.lock();
    const bool was_open = r->stdin_open;
    r->stdin_open = false;
    if (!was_open || r->ph != Route::phase::open || !w || w->retired || w->exited) return;
    if (has(*w, "duplexChannelCloseStdin")) {
        notify_ignoring(w, "duplexChannelCloseStdin",
                        {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}});
    }
}

void WorkerManager::Impl::signal_on_io(const std::shared_ptr<Route>& r, int sig, bool all) {
    auto w = r->worker.lock();
    if (r->ph != Route::phase::open || !w || w->retired || w->exited) return;
    if (all && sig == SIGKILL) {
        stop_route(r);
        return;
    }
    const char* name = nullptr;
    for (const auto& s : forwardable) {
        if (s.number == sig) name = s.name;
    }
    if (!name || !has(*w, "duplexChannelSignal")) return;  // ignored
    notify_ignoring(w, "duplexChannelSignal", {{"hostRouteId", r->host_route_id},
                                               {"workerSessionId", r->session_id},
                                               {"signal", name}});
}

// ---------------------------------------------------------------------------------------
// Channels

template <typename F>
void WorkerManager::Impl::to_channel(const std::shared_ptr<Route>& r, F f) {
    if (stopping) return;
    net::post(r->channel_executor, [inbox = r->inbox, f = std::move(f)]() mutable {
        if (auto in = inbox.lock()) f(*in);
    });
}

void WorkerManager::Impl::route_data(const std::shared_ptr<Route>& r, int stream,
                                     std::string bytes) {
    if (bytes.empty()) return;
    // The SDK has no credit: the worker is always read, and a channel whose host does not
    // keep up ends here rather than holding more than maxBufferedBytes.
    if (*r->buffered + bytes.size() > config.max_buffered_bytes) {
        end_locally(r,
                    "the plugin channel holds more than " +
                        std::to_string(config.max_buffered_bytes) +
                        " output bytes the host has not credited (providers.plugins[]."
                        "maxBufferedBytes)",
                    errc::flow_control);
        return;
    }
    *r->buffered += bytes.size();
    to_channel(r, [stream, bytes = std::move(bytes)](Inbox& in) mutable {
        if (in.ended) return;
        in.out[stream].push_back(std::move(bytes));
        in.wake();
    });
}

namespace {
/// How the worker's duplexChannel.exit params say the command ended (already validated).
ChannelExit exit_of(const json& p) {
    ChannelExit exit;
    const json code = p.value("exitCode", json());
    // Any integer passes (the SDK sends the number the plugin gave: 300, -1, ...); one beyond
    // int32 or with a fraction is reported as null.
    const bool fits = code.is_number_integer() &&
                      (code.is_number_unsigned() ? code.get<std::uint64_t>() <= INT32_MAX
                                                 : code.get<std::int64_t>() >= INT32_MIN &&
                                                       code.get<std::int64_t>() <= INT32_MAX);
    if (fits) {
        exit.exit_code = static_cast<int>(code.get<std::int64_t>());
    } else if (p.contains("signal") && p["signal"].is_string()) {
        for (const auto& s : exit_signals) {
            if (p["signal"] == s.name) exit.signal = s.number;
        }
    }
    // exitCode null with no signal it may name, or transportClosed: true: the Channel
    // reports transportClosed.
    exit.lost = (!exit.exit_code && exit.signal == 0) ||
               (p.contains("transportClosed") && p["transportClosed"] == true);
    return exit;
}
}  // namespace

void WorkerManager::Impl::route_exit(const std::shared_ptr<Route>& r, const json& p) {
    r->ph = Route::phase::exited;
    r->severed = true;
    r->stop_timer.cancel();
    // After the output already posted: the channel reads it all before it sees the end.
    to_channel(r, [exit = exit_of(p)](Inbox& in) {
        in.exit = exit;
        in.ended = true;
        in.gone = true;
        in.wake();
    });
    close_session(r);
}

void WorkerManager::Impl::stop_route(const std::shared_ptr<Route>& r) {
    auto w = r->worker.lock();
    if (r->stop_sent || !w) return;
    if (!has(*w, "duplexChannelStop")) {
        end_locally(r, "the worker cannot stop channels (no duplexChannelStop)");
        return;
    }
    r->stop_sent = true;
    notify_ignoring(w, "duplexChannelStop",
                    {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}});
    r->stop_timer.expires_after(tuning.stop_grace);
    r->stop_timer.async_wait([this, r](beast::error_code ec) {
        if (!ec && r->ph == Route::phase::open) {
            end_locally(r, "no duplexChannel.exit within " +
                               std::to_string(tuning.stop_grace.count()) +
                               " ms of duplexChannelStop");
        }
    });
}

void WorkerManager::Impl::end_locally(const std::shared_ptr<Route>& r, const std::string& why,
                                      errc code) {
    if (r->ph != Route::phase::open) return;
    spdlog::warn("plugin={} channel route={} session={} ended by the daemon: {}",
                 config.plugin_id, r->host_route_id, r->session_id, why);
    r->ph = Route::phase::closing;
    sever(r, code == errc::flow_control ? why : std::string(), code);
    auto w = r->worker.lock();
    if (!w || w->retired || w->exited) return;
    if (!r->stop_sent && has(*w, "duplexChannelStop")) {
        r->stop_sent = true;
        notify_ignoring(w, "duplexChannelStop",
                        {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}});
    }
    if (has(*w, "duplexChannelClose")) close_session(r);
    // else: the route stays (frames dropped) until the worker's exit for it.
}

void WorkerManager::Impl::close_session(const std::shared_ptr<Route>& r) {
    auto w = r->worker.lock();
    if (!w || w->retired || w->exited) return;
    if (!has(*w, "duplexChannelClose")) {
        forget(r);
        return;
    }
    request(w, "duplexChannelClose",
            {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}},
            [this, w, r](json, std::exception_ptr error) {
                if (w->retired || w->exited) return;
                if (error) {
                    retire(w, "did not acknowledge duplexChannelClose of " + r->host_route_id);
                    return;
                }
                forget(r);
            });
}

void WorkerManager::Impl::forget(const std::shared_ptr<Route>& r) {
    if (r->forgotten) return;
    r->forgotten = true;
    if (auto w = r->worker.lock()) {
        w->routes.erase(r->host_route_id);
        if (!r->session_id.empty()) w->sessions.erase(r->session_id);
    }
    spdlog::debug("plugin={} channel route={} session={} closed", config.plugin_id,
                  r->host_route_id, r->session_id);
}

void WorkerManager::Impl::sever(const std::shared_ptr<Route>& r, const std::string& error,
                                errc code) {
    if (r->ph == Route::phase::open || r->ph == Route::phase::opening) {
        r->ph = Route::phase::closing;
    }
    r->stop_timer.cancel();
    r->stdin_open = false;
    if (r->severed) return;
    r->severed = true;
    // What the channel holds already is still read (bounded by maxBufferedBytes).
    to_channel(r, [error, code](Inbox& in) {
        if (!in.exit) {
            in.exit.emplace();
            in.exit->lost = error.empty();
            in.exit->error = error;
            in.exit->error_code = code;
        }
        in.ended = true;
        in.gone = true;
        in.wake();
    });
}

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
    co_return co_await net::async_initiate<decltype(use_awaitable),
                                           void(std::exception_ptr, json)>(
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

    awaitable<std::size_t> output_ready(output_stream stream) override {
        const auto i = static_cast<std::size_t>(stream);
        for (;;) {
            if (!inbox_->out[i].empty()) {
                co_return inbox_->out[i].front().size() - inbox_->offset[i];
            }
            if (inbox_->ended) co_return 0;
            co_await inbox_->changed.async_wait(as_tuple_awaitable);
        }
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
            auto write = [impl, r = route_, chunk = data.substr(at, stdin_write_chunk)](
                             ReplyFn done) mutable {
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

    awaitable<ChannelExit> wait_exit() override {
        while (!inbox_->exit) co_await inbox_->changed.async_wait(as_tuple_awaitable);
        co_return *inbox_->exit;
    }

    awaitable<void> wait_gone() override {
        while (!inbox_->gone) co_await inbox_->changed.async_wait(as_tuple_awaitable);
    }

private:
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
        spdlog::error("plugin {}: stopping its worker failed: {}", impl_->config.plugin_id, e.what());
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

awaitable<std::optional<json>> WorkerManager::call_if_supported(std::string method,
                                                                json params) {
    Impl* impl = impl_.get();
    auto start = [impl, method = std::move(method), params = std::move(params)](
                     ReplyFn done) mutable {
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
