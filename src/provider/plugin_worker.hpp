#pragma once
/// @file plugin_worker.hpp
/// Plugin providers (docs/plugins.md): a supervised worker process per configured plugin,
/// spoken to in JSON-RPC 2.0, one JSON object per line on its stdin and stdout.
///
/// A WorkerManager owns one plugin's worker: it spawns it, calls `initialize`, restarts it
/// with backoff when it exits, retires (kills and restarts) it when it breaks the protocol,
/// and serves each duplex channel as a ChannelBackend (channel_backend.hpp) fed by the
/// worker's messages directly.
///
/// Threading: the manager runs the worker's I/O on its own io_context thread. Its public
/// methods are thread-safe; the awaitable ones complete on the awaiting executor once the
/// worker answers (at most the RPC timeout) and never block a thread.

#include <sandboxd/core/config.hpp>
#include <sandboxd/provider/plugin_provider.hpp>
#include <sandboxd/provider/provider.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "provider/worker_line.hpp"

namespace sandboxd {

class WorkerManager {
public:
    /// Starts the worker (asynchronously: the provider is not ready until `initialize` has
    /// been answered).
    WorkerManager(PluginConfig config, PluginTuning tuning = {});
    /// Stops the worker: `shutdown`, then SIGTERM, then SIGKILL after the grace; joins the
    /// manager's thread. Every bridged channel ends with its status pipe closed.
    ~WorkerManager();
    WorkerManager(const WorkerManager&) = delete;
    WorkerManager& operator=(const WorkerManager&) = delete;

    const PluginConfig& config() const noexcept;

    /// True while a worker is up and has answered `initialize`.
    bool ready() const noexcept;
    /// Which incarnation of the worker is ready (1, 2, ... as it restarts); 0 while none is.
    /// A sandbox acquired or resumed under another generation is not in the worker's own
    /// handle cache. Fast; thread-safe.
    std::uint64_t generation() const noexcept;
    /// How many times the worker was started again after it exited, was retired or failed to
    /// start (sandboxd_plugin_worker_restarts_total). Fast; thread-safe.
    std::uint64_t restarts() const noexcept;
    /// Called on the manager's thread with the params, result and caller's context (see
    /// call()) of an environmentAcquireLease answered after its timeout: a sandbox nobody
    /// holds. Set once, before the first call.
    void on_late_acquire(
        std::function<void(nlohmann::json params, nlohmann::json result, nlohmann::json context)>
            f);
    /// Whether the running worker listed `method` in its supportedMethods; false when down.
    bool supports(const std::string& method) const;

    /// Calls `method` and returns its result (null for a void one). The timeout is the
    /// plugin's timeoutsMs for the method, else the tuning's defaults. Throws rpc_error:
    /// errc::provider_not_ready when the worker is down, restarting or exits during the call,
    /// or the manager is stopping; errc::invalid_params when the worker answers -32602 (its
    /// message is kept); errc::provider_error for any other error answer or the timeout (the
    /// worker's own text goes to the log only).
    /// `context` is kept with an environmentAcquireLease call and handed to on_late_acquire.
    awaitable<nlohmann::json> call(std::string method, nlohmann::json params,
                                   nlohmann::json context = nullptr);
    /// What call_answered() returns: the result, and the generation of the worker that
    /// answered it (whose handle cache now holds what the call made or resumed).
    struct Answer {
        nlohmann::json result;
        std::uint64_t generation = 0;
    };
    /// Like call(), but also says which worker answered. Reading generation() before a call
    /// is not that: a worker that becomes ready between the read and the call serves it under
    /// a generation the caller never saw.
    awaitable<Answer> call_answered(std::string method, nlohmann::json params,
                                    nlohmann::json context = nullptr);
    /// Like call(), but when the running worker does not list `method` in its
    /// supportedMethods, returns nullopt without calling it (decided atomically with the
    /// readiness check: a worker that is down still gives errc::provider_not_ready).
    awaitable<std::optional<nlohmann::json>> call_if_supported(std::string method,
                                                               nlohmann::json params);

    /// A call made for one host invocation (leaseExecute): the request carries the SDK's
    /// `paperclipInvocation: {id, scope: {companyId}}`, and the worker's notifications stamped
    /// with that id (`paperclipInvocationId`; the SDK stamps every notification sent from the
    /// hook's async context, such as ctx.execution.log's `execute.log`) go to
    /// `on_notification(method, params)`. It is called on the awaiting executor, in the
    /// worker's order, only before the call completes; notifications of the invocation that
    /// come after the answer, or carry an id the manager did not mint, are dropped.
    struct Invocation {
        std::string company_id;
        std::function<void(const std::string& method, nlohmann::json params)> on_notification;
        std::chrono::milliseconds timeout{30000};  ///< the worker's answer is awaited this long
    };
    /// Like call_if_supported(), within `invocation`.
    awaitable<std::optional<nlohmann::json>> call_in_invocation(std::string method,
                                                                nlohmann::json params,
                                                                Invocation invocation);

    /// Opens a duplex channel (`duplexChannelOpen` with `params`, to which a fresh hostRouteId
    /// is added) and returns its backend, bound to the awaiting executor: the worker's
    /// duplexChannel.data and .exit reach it directly, also those sent before the open
    /// answer (held, bounded by the tuning's max_held_*), and at most the plugin's
    /// maxBufferedBytes of output the channel has not read (over it the channel ends with
    /// FLOW_CONTROL). Throws like call(); errc::provider_error when the worker does not
    /// support duplexChannelOpen; errc::provider_not_ready when the ready worker is not of
    /// `generation` any more (it restarted: its handle cache may lack the sandbox).
    awaitable<std::unique_ptr<ChannelBackend>> open_channel(nlohmann::json params,
                                                            std::uint64_t generation);

    struct Impl;

private:
    std::shared_ptr<Impl> impl_;
};

}  // namespace sandboxd
