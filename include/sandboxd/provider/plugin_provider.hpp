#pragma once
/// @file plugin_provider.hpp
/// The plugin provider (docs/plugins.md): sandboxes that live behind a supervised worker
/// process speaking JSON-RPC 2.0 on its stdin and stdout. Implemented in
/// src/provider/plugin_provider.cpp on the worker manager of src/provider/plugin_worker.hpp.

#include <sandboxd/core/config.hpp>
#include <sandboxd/provider/provider.hpp>

#include <chrono>
#include <cstddef>
#include <memory>

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

/// A Provider whose sandboxes live behind a plugin worker (key config.provider, pluginId
/// config.plugin_id). Does not block: the worker starts asynchronously, and until it has
/// answered `initialize` the provider's calls fail with errc::provider_not_ready.
std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning = {});

}  // namespace sandboxd
