/// @file plugin_worker_process.cpp
/// The plugin worker's process and lifecycle (plugin_worker_state.hpp): spawning the worker,
/// `initialize`, watching its exit, restarts with backoff, retiring a worker that broke the
/// protocol, and the manager's stop.

#include "provider/plugin_worker_state.hpp"

#include "provider/spawn.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

#ifndef P_PIDFD
#define P_PIDFD 3  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd {

// The state's types and helpers, used throughout this file.
using namespace plugin_detail;  // NOLINT(google-build-using-namespace)

namespace plugin_detail {
namespace {

namespace fs = std::filesystem;

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

std::string exe_dir() {
    std::error_code ec;
    fs::path self = fs::read_symlink("/proc/self/exe", ec);
    return ec ? std::string() : self.parent_path().string();
}

}  // namespace

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

}  // namespace plugin_detail

// ---------------------------------------------------------------------------------------
// Lifecycle

void WorkerManager::Impl::start_worker() {
    if (stopping_io) return;
    auto w = std::make_shared<Worker>(ioc);
    w->generation = ++generations;
    try {
        spawn_worker(*w);
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
    json params = {
        {"manifest", manifest},
        {"config", config.config},
        {"instanceInfo", {{"instanceId", tuning.instance_id}, {"hostVersion", version_string}}},
        {"apiVersion", api_version}};
    request(w, "initialize", std::move(params), [this, w](json result, std::exception_ptr error) {
        on_initialized(w, std::move(result), std::move(error));
    });
}

void WorkerManager::Impl::spawn_worker(Worker& w) {
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
    w.pid = child.pid;
    w.pidfd.assign(child.pidfd.release());
    w.in.assign(in.write_end.release());
    w.out.assign(out.read_end.release());
    w.err.assign(err.read_end.release());
}

void WorkerManager::Impl::on_initialized(const std::shared_ptr<Worker>& w, json result,
                                         std::exception_ptr error) {
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
    spdlog::info("plugin={} worker pid={} ready: supportedMethods={}", config.plugin_id, w->pid,
                 list);
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
        spdlog::error(
            "plugin={} gave up: its worker exited {} times within {} s; the provider "
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
    std::string state = gave_up                        ? "gave up after repeated crashes"
                        : stopping_io                  ? "stopping"
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
        request(
            w, "shutdown", json::object(), [this, w](json, std::exception_ptr) { terminate(w); },
            tuning.shutdown_grace);
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

}  // namespace sandboxd
