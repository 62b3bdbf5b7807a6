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

#include <sandboxd/config.hpp>
#include <sandboxd/provider.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd {

/// Bounds and timings of a plugin worker; the defaults are the documented ones.
struct PluginTuning {
    std::chrono::milliseconds rpc_timeout{30000};        ///< any call to the worker
    std::chrono::milliseconds restart_initial{1000};     ///< first restart delay
    std::chrono::milliseconds restart_max{300000};       ///< the delay doubles up to this
    int crash_limit = 10;                                ///< give up after this many exits...
    std::chrono::milliseconds crash_window{600000};      ///< ...within this window
    std::chrono::milliseconds shutdown_grace{5000};      ///< `shutdown` answer; SIGTERM to SIGKILL
    std::chrono::milliseconds stop_grace{10000};         ///< duplexChannelStop to its exit
    std::size_t max_line = 4U << 20;                     ///< one JSON line from the worker
    std::size_t max_chunk = 1U << 20;                    ///< one decoded data chunk
    std::size_t max_buffered = 4U << 20;  ///< output bytes held per channel, unread by it
};

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
    /// Whether the running worker listed `method` in its supportedMethods; false when down.
    bool supports(const std::string& method) const;

    /// Calls `method` and returns its result. Throws rpc_error: errc::provider_not_ready when
    /// the worker is down, restarting or exits during the call, or the manager is stopping;
    /// errc::invalid_params when the worker answers -32602 (its message is kept);
    /// errc::provider_error for any other error answer or the RPC timeout (the worker's own
    /// text goes to the log only).
    awaitable<nlohmann::json> call(std::string method, nlohmann::json params);
    /// Like call(), but when the running worker does not list `method` in its
    /// supportedMethods, returns nullopt without calling it (decided atomically with the
    /// readiness check: a worker that is down still gives errc::provider_not_ready).
    awaitable<std::optional<nlohmann::json>> call_if_supported(std::string method,
                                                               nlohmann::json params);

    /// Opens a duplex channel (`duplexChannelOpen` with `params`, to which a fresh hostRouteId
    /// is added) and returns its backend, bound to the awaiting executor: the worker's
    /// duplexChannel.data and .exit reach it directly, bounded by the tuning's max_chunk and
    /// max_buffered (over them the channel ends). Throws like call(); errc::provider_error
    /// when the worker does not support duplexChannelOpen.
    awaitable<std::unique_ptr<ChannelBackend>> open_channel(nlohmann::json params,
                                                            bool stdin_attached);

    struct Impl;

private:
    std::shared_ptr<Impl> impl_;
};

/// A Provider whose sandboxes live behind a plugin worker (key config.provider, pluginId
/// config.plugin_id).
std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning = {});

}  // namespace sandboxd
