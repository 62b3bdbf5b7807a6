/// @file plugin_worker_routes.cpp
/// The plugin worker manager's side of calls and channels (plugin_worker_state.hpp): calls
/// posted from other threads to the manager's thread, and each channel's route: delivering
/// the worker's frames to the channel's Inbox, stopping, severing and forgetting a route.

#include "provider/plugin_worker_state.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace sandboxd {

// The state's types and helpers, used throughout this file.
using namespace plugin_detail;  // NOLINT(google-build-using-namespace)

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
    auto reply = [this, w, r, slot, done](json result, std::exception_ptr error) {
        on_open_answer(w, r, *slot, done, std::move(result), std::move(error));
    };
    request(w, "duplexChannelOpen", std::move(params), std::move(reply));
}

void WorkerManager::Impl::open_failed(const std::shared_ptr<Worker>& w,
                                      const std::shared_ptr<Route>& r, const std::string& why) {
    // Paperclip's way: a route whose open failed or was lost is closed by hostRouteId
    // alone (the worker may have bound a session the daemon never learnt).
    r->ph = Route::phase::closing;
    r->held.clear();
    forget(r);
    if (!w->retired && !w->exited && has(*w, "duplexChannelClose")) {
        notify_ignoring(w, "duplexChannelClose", {{"hostRouteId", r->host_route_id}});
    }
    spdlog::debug("plugin={} channel route={} not opened: {}", config.plugin_id, r->host_route_id,
                  why);
}

void WorkerManager::Impl::on_open_answer(const std::shared_ptr<Worker>& w,
                                         const std::shared_ptr<Route>& r, OpenSlot& slot,
                                         const ReplyFn& done, json result,
                                         std::exception_ptr error) {
    if (w->retired || w->exited) {
        done(json(), error ? error : error_ptr(errc::provider_not_ready, not_ready_message()));
        return;
    }
    if (error) {
        open_failed(w, r, "the open failed or timed out");
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
        retire(w, "answered duplexChannelOpen without echoing hostRouteId " + r->host_route_id +
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
                          held_session.substr(0, 200) + ", not the one it bound (" + session + ")");
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
    slot.route = r;
    slot.close_stdin = has(*w, "duplexChannelCloseStdin");
    slot.signal = has(*w, "duplexChannelSignal");
    slot.resize = has(*w, "duplexChannelResize");
    done(json{{"hostRouteId", r->host_route_id}, {"workerSessionId", session}}, nullptr);
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
    notify_ignoring(
        w, "duplexChannelSignal",
        {{"hostRouteId", r->host_route_id}, {"workerSessionId", r->session_id}, {"signal", name}});
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
    spdlog::warn("plugin={} channel route={} session={} ended by the daemon: {}", config.plugin_id,
                 r->host_route_id, r->session_id, why);
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

}  // namespace sandboxd
