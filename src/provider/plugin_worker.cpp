/// @file plugin_worker.cpp
/// The plugin worker manager (docs/plugins.md). Everything below the public methods runs on
/// the manager's own io_context thread, in plain completion handlers (no coroutines), so no
/// state here needs a lock except the readiness snapshot read by other threads.
///
/// Fail closed at the worker boundary: a frame is delivered only to the channel registered
/// under its exact (hostRouteId, workerSessionId) pair; anything else that breaks the protocol
/// retires the worker (SIGKILL, every channel of it closed, restart with backoff).

#include "provider/plugin_worker.hpp"

#include "provider/spawn.hpp"
#include "server/net.hpp"

#include <sandboxd/base64.hpp>
#include <sandboxd/errors.hpp>

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>
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

constexpr std::size_t stdin_read_chunk = 48 * 1024;  // 64 KiB of base64
constexpr std::size_t max_session_id = 256;
constexpr std::size_t stderr_line_max = 4096;

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

void set_nonblocking(int fd) {
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        throw rpc_error(errc::provider_error, "cannot set up a plugin channel pipe");
    }
}

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
        std::string candidate = dir + "/" + name;
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
        start = end + 1;
    }
    return name;  // spawn reports ENOENT
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
    std::map<std::int64_t, std::string> abandoned;  // timed-out ids and their methods
    std::int64_t next_id = 1;
    std::set<std::string> supported;
    bool initialized = false;
    bool retired = false;  // no frame of it is processed any more
    bool exited = false;
    std::map<std::pair<std::string, std::string>, std::shared_ptr<Route>> routes;
    std::set<std::string> sessions;  // workerSessionIds of live routes
};

/// One bridged channel: the adapter's ends of the pipes the daemon's Channel reads and writes.
struct Route {
    explicit Route(net::io_context& ioc)
        : stdin_rd(ioc), control_rd(ioc), out{Out(ioc), Out(ioc)}, stop_timer(ioc) {}

    struct Out {
        explicit Out(net::io_context& ioc) : sd(ioc) {}
        descriptor sd;
        std::deque<std::string> queue;
        std::size_t offset = 0;
        bool writing = false;
        bool close_when_drained = false;
    };
    enum class phase {
        open,     // frames are delivered
        exited,   // the worker sent its exit; any further frame is a violation
        closing,  // ended by the daemon; frames until the close is acknowledged are dropped
    };

    std::weak_ptr<Worker> worker;
    std::string host_route_id;
    std::string session_id;
    descriptor stdin_rd, control_rd;
    Out out[2];  // stdout, stderr
    unique_fd status_wr;
    std::size_t buffered = 0;
    phase ph = phase::open;
    bool stop_sent = false;
    bool forgotten = false;
    net::steady_timer stop_timer;
};

/// The adapter's ends of a new bridge, made by the calling thread of open_channel().
struct BridgeEnds {
    unique_fd stdin_rd, stdout_wr, stderr_wr, status_wr, control_rd;
};

}  // namespace

struct WorkerManager::Impl {
    Impl(PluginConfig c, PluginTuning t)
        : config(std::move(c)), tuning(t), work(net::make_work_guard(ioc)), restart_timer(ioc) {}

    PluginConfig config;
    PluginTuning tuning;
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

    std::atomic<bool> ready_flag{false};
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
                 ReplyFn done, std::optional<std::chrono::milliseconds> timeout = std::nullopt);
    void notify_ignoring(const std::shared_ptr<Worker>& w, const std::string& method, json params);
    void send_line(const std::shared_ptr<Worker>& w, std::string line);
    void write_next(const std::shared_ptr<Worker>& w);
    void read_lines(const std::shared_ptr<Worker>& w);
    void read_stderr(const std::shared_ptr<Worker>& w);
    void on_line(const std::shared_ptr<Worker>& w, std::string_view line);
    void on_response(const std::shared_ptr<Worker>& w, const json& msg);
    void on_notification(const std::shared_ptr<Worker>& w, const json& msg);
    bool usable(const std::shared_ptr<Worker>& w) const {
        return w && w == current && w->initialized && !w->retired && !w->exited;
    }

    // --- calls from other threads, run here
    void call_on_io(const std::string& method, json params, bool optional, ReplyFn done);
    void open_on_io(json params, bool stdin_attached, std::shared_ptr<BridgeEnds> ends,
                    ReplyFn done);

    // --- channels
    void start_route(const std::shared_ptr<Worker>& w, const std::shared_ptr<Route>& r,
                     bool stdin_attached);
    void pump_stdin(const std::shared_ptr<Route>& r);
    void pump_control(const std::shared_ptr<Route>& r);
    void pump_out(const std::shared_ptr<Route>& r, int i);
    void route_data(const std::shared_ptr<Route>& r, int stream, std::string bytes);
    void route_exit(const std::shared_ptr<Route>& r, const json& params);
    void stop_route(const std::shared_ptr<Route>& r);
    void end_locally(const std::shared_ptr<Route>& r, const std::string& why);
    void close_session(const std::shared_ptr<Route>& r);
    void forget(const std::shared_ptr<Route>& r);
    /// Closes every daemon-facing end now (status without a line: exitCode null).
    void sever(const std::shared_ptr<Route>& r);
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
        for (const auto& [k, v] : env) req.envp.push_back(k + "=" + v);
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
    json params = {{"protocolVersion", 1},
                   {"pluginId", config.plugin_id},
                   {"provider", config.provider}};
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
        const json* methods = result.is_object() && result.contains("supportedMethods")
                                  ? &result["supportedMethods"]
                                  : nullptr;
        if (!methods || !methods->is_array()) {
            retire(w, "initialize result has no supportedMethods array");
            return;
        }
        for (const auto& m : *methods) {
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
        if (!ec) start_worker();
    });
}

void WorkerManager::Impl::watch_exit(const std::shared_ptr<Worker>& w) {
    w->pidfd.async_wait(net::posix::descriptor_base::wait_read,
                        [this, w](beast::error_code) { on_exit(w); });
}

void WorkerManager::Impl::on_exit(const std::shared_ptr<Worker>& w) {
    if (w->exited) return;
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
                                  std::optional<std::chrono::milliseconds> timeout) {
    const std::int64_t id = w->next_id++;
    std::string line;
    try {
        line = json{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", std::move(params)}}
                   .dump();
    } catch (const json::exception&) {
        // Strings that are not UTF-8 (e.g. argv bytes) cannot travel in JSON.
        done(json(), error_ptr(errc::provider_error,
                               "plugin " + config.plugin_id + ": " + method +
                                   " params are not valid UTF-8 text"));
        return;
    }
    auto timer = std::make_shared<net::steady_timer>(ioc);
    const auto limit = timeout.value_or(tuning.rpc_timeout);
    timer->expires_after(limit);
    timer->async_wait([this, w, id, limit](beast::error_code ec) {
        if (ec) return;
        auto it = w->pending.find(id);
        if (it == w->pending.end()) return;
        auto p = std::move(it->second);
        w->pending.erase(it);
        w->abandoned[id] = p.method;
        spdlog::warn("plugin={} worker pid={}: {} (id {}) timed out after {} ms",
                     config.plugin_id, w->pid, p.method, id, limit.count());
        p.done(json(), error_ptr(errc::provider_error,
                                 "plugin " + config.plugin_id + ": " + p.method +
                                     " timed out after " + std::to_string(limit.count()) + " ms"));
    });
    w->pending.emplace(id, Worker::Pending{method, std::move(done), std::move(timer)});
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
    if (line.find_first_not_of(" \t") == std::string_view::npos) return;
    json msg = json::parse(line, nullptr, false);
    if (msg.is_discarded() || !msg.is_object()) {
        retire(w, "sent a line that is not a JSON object");
        return;
    }
    const bool has_method = msg.contains("method");
    if (!has_method && msg.contains("id") && (msg.contains("result") || msg.contains("error"))) {
        on_response(w, msg);
    } else if (has_method && msg["method"].is_string()) {
        if (msg.contains("id")) {
            // Workers make no requests of the daemon.
            send_line(w, json{{"jsonrpc", "2.0"},
                              {"id", msg["id"]},
                              {"error", {{"code", -32601}, {"message", "Method not found"}}}}
                             .dump());
            return;
        }
        on_notification(w, msg);
    } else {
        retire(w, "sent a message that is neither a response nor a notification");
    }
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
        const std::string method = late->second;
        w->abandoned.erase(late);
        spdlog::warn("plugin={} worker pid={}: late answer to {} (id {}) ignored",
                     config.plugin_id, w->pid, method, id);
        // A channel the daemon gave up on may still run on the worker: end it there.
        const json& r = msg.contains("result") ? msg["result"] : json();
        if (method == "duplexChannelOpen" && r.is_object() && r.contains("workerSessionId") &&
            r["workerSessionId"].is_string() && r.contains("hostRouteId") &&
            r["hostRouteId"].is_string()) {
            json p = {{"hostRouteId", r["hostRouteId"]}, {"workerSessionId", r["workerSessionId"]}};
            if (has(*w, "duplexChannelStop")) notify_ignoring(w, "duplexChannelStop", p);
            if (has(*w, "duplexChannelClose")) notify_ignoring(w, "duplexChannelClose", p);
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
                     p.method, code, text);
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

void WorkerManager::Impl::on_notification(const std::shared_ptr<Worker>& w, const json& msg) {
    const std::string method = msg["method"].get<std::string>();
    const bool is_data = method == "duplexChannel.data";
    const bool is_exit = method == "duplexChannel.exit";
    if (!is_data && !is_exit) {
        spdlog::debug("plugin={} worker pid={}: notification {} ignored", config.plugin_id,
                      w->pid, method);
        return;
    }
    const json& p = msg.contains("params") ? msg["params"] : json();
    auto str = [&p](const char* k) {
        return p.is_object() && p.contains(k) && p[k].is_string();
    };
    if (!str("hostRouteId") || !str("workerSessionId")) {
        retire(w, method + " without a hostRouteId and workerSessionId");
        return;
    }
    auto key = std::make_pair(p["hostRouteId"].get<std::string>(),
                              p["workerSessionId"].get<std::string>());
    auto it = w->routes.find(key);
    if (it == w->routes.end()) {
        retire(w, method + " for an unknown or foreign (hostRouteId, workerSessionId) pair (" +
                      key.first + ", " + key.second + ")");
        return;
    }
    auto r = it->second;
    if (r->ph == Route::phase::exited) {
        retire(w, method + " after the exit of channel " + key.first);
        return;
    }
    if (is_data) {
        int stream = 0;
        if (p.contains("stream")) {
            if (p["stream"] == "stderr") stream = 1;
            else if (p["stream"] != "stdout") {
                retire(w, "duplexChannel.data with a stream that is not stdout or stderr");
                return;
            }
        }
        if (!str("chunk")) {
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
    // duplexChannel.exit
    const json code = p.value("exitCode", json());
    if (!code.is_null() &&
        !(code.is_number_integer() && code.get<std::int64_t>() >= 0 && code.get<std::int64_t>() <= 255)) {
        retire(w, "duplexChannel.exit with an exitCode that is neither null nor 0..255");
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
                                     ReplyFn done) {
    auto w = current;
    if (!usable(w) || stopping_io) {
        done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
        return;
    }
    if (optional && !w->supported.count(method)) {
        done(json(nullptr), nullptr);
        return;
    }
    request(w, method, std::move(params), std::move(done));
}

void WorkerManager::Impl::open_on_io(json params, bool stdin_attached,
                                     std::shared_ptr<BridgeEnds> ends, ReplyFn done) {
    auto w = current;
    if (!usable(w) || stopping_io) {
        done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
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
    auto reply = [this, w, route_id, ends, stdin_attached, done](json result,
                                                                 std::exception_ptr error) {
        if (error) {
            done(json(), error);
            return;
        }
        if (w->retired || w->exited) {
            done(json(), error_ptr(errc::provider_not_ready, not_ready_message()));
            return;
        }
        const bool shaped = result.is_object() && result.contains("hostRouteId") &&
                            result["hostRouteId"] == route_id &&
                            result.contains("workerSessionId") &&
                            result["workerSessionId"].is_string() &&
                            !result["workerSessionId"].get<std::string>().empty() &&
                            result["workerSessionId"].get<std::string>().size() <= max_session_id;
        if (!shaped) {
            retire(w, "answered duplexChannelOpen without echoing hostRouteId " + route_id +
                          " or without a workerSessionId (1.." + std::to_string(max_session_id) +
                          " bytes)");
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
        auto r = std::make_shared<Route>(ioc);
        r->worker = w;
        r->host_route_id = route_id;
        r->session_id = session;
        try {
            for (int fd : {ends->stdin_rd.get(), ends->stdout_wr.get(), ends->stderr_wr.get(),
                           ends->control_rd.get()}) {
                if (fd >= 0) set_nonblocking(fd);
            }
            if (ends->stdin_rd) r->stdin_rd.assign(ends->stdin_rd.release());
            r->out[0].sd.assign(ends->stdout_wr.release());
            r->out[1].sd.assign(ends->stderr_wr.release());
            r->control_rd.assign(ends->control_rd.release());
            r->status_wr = std::move(ends->status_wr);
        } catch (const std::exception& e) {
            // The worker runs a session the daemon cannot bridge: end it there.
            json p = {{"hostRouteId", route_id}, {"workerSessionId", session}};
            if (has(*w, "duplexChannelStop")) notify_ignoring(w, "duplexChannelStop", p);
            if (has(*w, "duplexChannelClose")) notify_ignoring(w, "duplexChannelClose", p);
            done(json(), error_ptr(errc::provider_error,
                                   "plugin " + config.plugin_id + ": " + e.what()));
            return;
        }
        w->routes.emplace(std::make_pair(route_id, session), r);
        w->sessions.insert(session);
        spdlog::debug("plugin={} channel route={} session={} opened", config.plugin_id,
                      route_id, session);
        start_route(w, r, stdin_attached);
        done(json{{"hostRouteId", route_id}, {"workerSessionId", session}}, nullptr);
    };
    request(w, "duplexChannelOpen", std::move(params), std::move(reply));
}

// ---------------------------------------------------------------------------------------
// Channels

void WorkerManager::Impl::start_route(const std::shared_ptr<Worker>& w,
                                      const std::shared_ptr<Route>& r, bool stdin_attached) {
    if (r->stdin_rd.is_open()) {
        pump_stdin(r);
    } else if (!stdin_attached && has(*w, "duplexChannelCloseStdin")) {
        notify_ignoring(w, "duplexChannelCloseStdin",
                        {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}});
    }
    pump_control(r);
}

void WorkerManager::Impl::pump_stdin(const std::shared_ptr<Route>& r) {
    auto chunk = std::make_shared<std::string>(stdin_read_chunk, '\0');
    r->stdin_rd.async_read_some(net::buffer(*chunk), [this, r, chunk](beast::error_code ec,
                                                                      std::size_t n) {
        auto w = r->worker.lock();
        if (r->ph != Route::phase::open || !w || w->retired || w->exited) return;
        const json ids = {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}};
        if (ec) {  // EOF: the host half-closed stdin
            close_quietly(r->stdin_rd);
            if (has(*w, "duplexChannelCloseStdin")) notify_ignoring(w, "duplexChannelCloseStdin", ids);
            return;
        }
        json p = ids;
        p["data"] = base64_encode(std::string_view(*chunk).substr(0, n));
        // One write in flight per channel: the worker's answer is the flow control.
        request(w, "duplexChannelWrite", std::move(p), [this, r](json, std::exception_ptr error) {
            if (r->ph != Route::phase::open) return;
            if (error) {
                // The command no longer takes stdin: the daemon's writes now fail with EPIPE
                // and it discards and credits them.
                close_quietly(r->stdin_rd);
                return;
            }
            pump_stdin(r);
        });
    });
}

void WorkerManager::Impl::pump_control(const std::shared_ptr<Route>& r) {
    auto bytes = std::make_shared<std::array<unsigned char, 64>>();
    r->control_rd.async_read_some(net::buffer(*bytes), [this, r, bytes](beast::error_code ec,
                                                                        std::size_t n) {
        if (r->ph != Route::phase::open) return;
        if (ec) {  // the daemon dropped the channel
            end_locally(r, "the daemon closed the channel");
            return;
        }
        auto w = r->worker.lock();
        if (!w) return;
        for (std::size_t i = 0; i < n && r->ph == Route::phase::open; ++i) {
            const unsigned char b = (*bytes)[i];
            if (b == (0x80 | SIGKILL)) {
                stop_route(r);
                continue;
            }
            const int sig = b & 0x7f;
            const char* name = nullptr;
            for (const auto& s : forwardable) {
                if (s.number == sig) name = s.name;
            }
            if (!name || !has(*w, "duplexChannelSignal")) continue;  // ignored
            notify_ignoring(w, "duplexChannelSignal", {{"hostRouteId", r->host_route_id},
                                                       {"workerSessionId", r->session_id},
                                                       {"signal", name}});
        }
        if (r->ph == Route::phase::open) pump_control(r);
    });
}

void WorkerManager::Impl::pump_out(const std::shared_ptr<Route>& r, int i) {
    auto& o = r->out[i];
    if (o.writing || !o.sd.is_open()) return;
    if (o.queue.empty()) {
        if (o.close_when_drained) close_quietly(o.sd);
        return;
    }
    o.writing = true;
    o.sd.async_write_some(
        net::buffer(o.queue.front().data() + o.offset, o.queue.front().size() - o.offset),
        [this, r, i](beast::error_code ec, std::size_t n) {
            auto& out = r->out[i];
            out.writing = false;
            if (!out.sd.is_open() || out.queue.empty()) return;  // severed meanwhile
            if (ec) {  // EPIPE: the daemon stopped reading; nobody gets these bytes
                for (const auto& s : out.queue) r->buffered -= s.size();
                r->buffered += out.offset;
                out.queue.clear();
                out.offset = 0;
                close_quietly(out.sd);
                return;
            }
            out.offset += n;
            r->buffered -= n;
            if (out.offset == out.queue.front().size()) {
                out.queue.pop_front();
                out.offset = 0;
            }
            pump_out(r, i);
        });
}

void WorkerManager::Impl::route_data(const std::shared_ptr<Route>& r, int stream,
                                     std::string bytes) {
    if (bytes.empty()) return;
    if (bytes.size() > tuning.max_chunk) {
        end_locally(r, "a chunk of " + std::to_string(bytes.size()) + " bytes is over the bound of " +
                           std::to_string(tuning.max_chunk));
        return;
    }
    if (r->buffered + bytes.size() > tuning.max_buffered) {
        end_locally(r, "more than " + std::to_string(tuning.max_buffered) +
                           " output bytes are waiting for the daemon");
        return;
    }
    if (!r->out[stream].sd.is_open()) return;  // the daemon stopped reading this stream
    r->buffered += bytes.size();
    r->out[stream].queue.push_back(std::move(bytes));
    pump_out(r, stream);
}

void WorkerManager::Impl::route_exit(const std::shared_ptr<Route>& r, const json& p) {
    std::string line;
    const json code = p.value("exitCode", json());
    if (code.is_number_integer()) {
        line = "exit " + std::to_string(code.get<int>()) + "\n";
    } else if (p.contains("signal") && p["signal"].is_string()) {
        for (const auto& s : exit_signals) {
            if (p["signal"] == s.name) line = "signal " + std::to_string(s.number) + "\n";
        }
    }
    // exitCode null (no signal): nothing is written; the Channel reports transportClosed.
    if (!line.empty() && r->status_wr) {
        [[maybe_unused]] auto n = ::write(r->status_wr.get(), line.data(), line.size());
    }
    r->status_wr.reset();
    r->ph = Route::phase::exited;
    r->stop_timer.cancel();
    close_quietly(r->stdin_rd);
    close_quietly(r->control_rd);
    for (int i = 0; i < 2; ++i) {
        r->out[i].close_when_drained = true;
        pump_out(r, i);
    }
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

void WorkerManager::Impl::end_locally(const std::shared_ptr<Route>& r, const std::string& why) {
    if (r->ph != Route::phase::open) return;
    spdlog::warn("plugin={} channel route={} session={} ended by the daemon: {}",
                 config.plugin_id, r->host_route_id, r->session_id, why);
    r->ph = Route::phase::closing;
    sever(r);
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
        w->routes.erase(std::make_pair(r->host_route_id, r->session_id));
        w->sessions.erase(r->session_id);
    }
    spdlog::debug("plugin={} channel route={} session={} closed", config.plugin_id,
                  r->host_route_id, r->session_id);
}

void WorkerManager::Impl::sever(const std::shared_ptr<Route>& r) {
    if (r->ph == Route::phase::open) r->ph = Route::phase::closing;
    r->status_wr.reset();
    r->stop_timer.cancel();
    close_quietly(r->stdin_rd);
    close_quietly(r->control_rd);
    for (auto& o : r->out) {
        o.queue.clear();
        o.offset = 0;
        close_quietly(o.sd);
    }
    r->buffered = 0;
}

// ---------------------------------------------------------------------------------------
// Public face

namespace {

/// Runs `f(done)` on the manager's thread and waits for `done`.
template <typename F>
json run_on(WorkerManager::Impl& impl, const std::string& what, F f) {
    if (impl.stopping) {
        throw rpc_error(errc::provider_not_ready,
                        "plugin " + impl.config.plugin_id + " is stopping");
    }
    if (std::this_thread::get_id() == impl.io_thread) {
        throw rpc_error(errc::internal_error, what + " called on the plugin worker's own thread");
    }
    auto promise = std::make_shared<std::promise<json>>();
    auto future = promise->get_future();
    net::post(impl.ioc, [f = std::move(f), promise]() mutable {
        f([promise](json result, std::exception_ptr error) {
            if (error) promise->set_exception(error);
            else promise->set_value(std::move(result));
        });
    });
    try {
        return future.get();
    } catch (const std::future_error&) {  // the manager stopped before it ran
        throw rpc_error(errc::provider_not_ready,
                        "plugin " + impl.config.plugin_id + " is stopping");
    }
}

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
}

const PluginConfig& WorkerManager::config() const noexcept { return impl_->config; }

bool WorkerManager::ready() const noexcept { return impl_->ready_flag.load(); }

bool WorkerManager::supports(const std::string& method) const {
    std::lock_guard lock(impl_->supported_mutex);
    return impl_->supported_snapshot.count(method) > 0;
}

json WorkerManager::call(const std::string& method, json params) {
    Impl* impl = impl_.get();
    return run_on(*impl, method, [impl, method, params = std::move(params)](ReplyFn done) mutable {
        impl->call_on_io(method, std::move(params), false, std::move(done));
    });
}

std::optional<json> WorkerManager::call_if_supported(const std::string& method, json params) {
    Impl* impl = impl_.get();
    json r = run_on(*impl, method, [impl, method, params = std::move(params)](ReplyFn done) mutable {
        impl->call_on_io(method, std::move(params), true,
                         [done = std::move(done)](json result, std::exception_ptr error) {
                             // A supported method's null result is still a result.
                             done(error ? json() : json{{"result", std::move(result)}}, error);
                         });
    });
    if (r.is_null()) return std::nullopt;
    return r["result"];
}

SpawnedProcess WorkerManager::open_channel(json params, bool stdin_attached) {
    SpawnedProcess out;
    auto ends = std::make_shared<BridgeEnds>();
    if (stdin_attached) {
        auto p = detail::make_pipe(detail::daemon_end::write);
        out.stdin_fd = std::move(p.write_end);
        ends->stdin_rd = std::move(p.read_end);
    }
    auto so = detail::make_pipe(detail::daemon_end::read);
    auto se = detail::make_pipe(detail::daemon_end::read);
    auto st = detail::make_pipe(detail::daemon_end::read);
    auto ct = detail::make_pipe(detail::daemon_end::write);
    out.stdout_fd = std::move(so.read_end);
    out.stderr_fd = std::move(se.read_end);
    out.status_fd = std::move(st.read_end);
    out.control_fd = std::move(ct.write_end);
    ends->stdout_wr = std::move(so.write_end);
    ends->stderr_wr = std::move(se.write_end);
    ends->status_wr = std::move(st.write_end);
    ends->control_rd = std::move(ct.read_end);
    Impl* impl = impl_.get();
    run_on(*impl, "duplexChannelOpen",
           [impl, params = std::move(params), stdin_attached, ends](ReplyFn done) mutable {
               impl->open_on_io(std::move(params), stdin_attached, ends, std::move(done));
           });
    out.pid = -1;
    return out;
}

}  // namespace sandboxd
