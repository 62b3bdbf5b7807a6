/// @file plugin_worker_protocol.cpp
/// JSON-RPC over the plugin worker's stdin and stdout (plugin_worker_state.hpp): requests
/// and their timeouts, the line reader and writer, and the worker's own requests and
/// notifications (config.get, log, duplexChannel.data and .exit).

#include "provider/plugin_worker_state.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/net.hpp>

#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace sandboxd {

// The state's types and helpers, used throughout this file.
using namespace plugin_detail;  // NOLINT(google-build-using-namespace)

// ---------------------------------------------------------------------------------------
// JSON-RPC over the worker's stdin and stdout

void WorkerManager::Impl::request(const std::shared_ptr<Worker>& w, const std::string& method,
                                  json params, ReplyFn done,
                                  std::optional<std::chrono::milliseconds> timeout, json context,
                                  json invocation) {
    const std::int64_t id = w->next_id++;
    std::string line;
    json kept = method == "environmentAcquireLease"
                    ? json{{"params", params}, {"context", std::move(context)}}
                    : json();
    try {
        line = invocation.is_null()
                   ? jsonrpc::request(id, method, std::move(params))
                   : jsonrpc::request(id, method, std::move(params), "paperclipInvocation",
                                      std::move(invocation));
    } catch (const json::exception&) {
        // Strings that are not UTF-8 (e.g. argv bytes) cannot travel in JSON.
        done(json(), error_ptr(errc::provider_error, "plugin " + config.plugin_id + ": " + method +
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
        spdlog::warn("plugin={} worker pid={}: {} (id {}) timed out after {} ms", config.plugin_id,
                     w->pid, p.method, id, limit.count());
        p.done(json(), error_ptr(errc::provider_error, "plugin " + config.plugin_id + ": " +
                                                           p.method + " timed out after " +
                                                           std::to_string(limit.count()) + " ms"));
    });
    w->pending.emplace(id,
                       Worker::Pending{method, std::move(done), std::move(timer), std::move(kept)});
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
    w->err.async_read_some(
        net::buffer(*chunk), [this, w, chunk](beast::error_code ec, std::size_t n) {
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
        case worker_line_kind::blank: return;
        case worker_line_kind::text:
            // A plugin's console.log writes plain text to stdout (the SDK does not redirect it):
            // logged and dropped, as paperclip's host does. It can answer or forge nothing.
            spdlog::info("plugin={} pid={} stdout: {}", config.plugin_id, w->pid,
                         line.substr(0, log_text_max));
            return;
        case worker_line_kind::response: on_response(w, parsed.message); return;
        case worker_line_kind::request: on_worker_request(w, parsed.message); return;
        case worker_line_kind::notification: on_notification(w, parsed.message); return;
        case worker_line_kind::invalid:
            spdlog::warn(
                "plugin={} worker pid={}: a message that is neither a response, a request "
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
    spdlog::debug("plugin={} worker pid={}: host method {} is not served", config.plugin_id, w->pid,
                  method);
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
        spdlog::warn("plugin={} worker pid={}: late answer to {} (id {})", config.plugin_id, w->pid,
                     method, id);
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
        const json* id =
            msg.contains("paperclipInvocationId") ? &msg["paperclipInvocationId"] : nullptr;
        auto it =
            id && id->is_string() ? invocations.find(id->get<std::string>()) : invocations.end();
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
        spdlog::debug("plugin={} worker pid={}: notification {} ignored", config.plugin_id, w->pid,
                      method);
        return;
    }
    auto str = [&p](const char* k) { return p.is_object() && p.contains(k) && p[k].is_string(); };
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

}  // namespace sandboxd
