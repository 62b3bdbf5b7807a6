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
#include <string>

namespace sandboxd {

/// Bounds and timings of a plugin worker; the defaults are the documented ones.
struct PluginTuning {
    /// A call to the worker whose method has no timeoutsMs entry in the plugin's config and
    /// is not an environment*Lease method (those default to lifecycle_timeout).
    std::chrono::milliseconds rpc_timeout{30000};
    std::chrono::milliseconds lifecycle_timeout{300000};  ///< environment*Lease by default
    std::chrono::milliseconds restart_initial{1000};      ///< first restart delay
    std::chrono::milliseconds restart_max{300000};        ///< the delay doubles up to this
    int crash_limit = 10;                                 ///< give up after this many exits...
    std::chrono::milliseconds crash_window{600000};       ///< ...within this window
    std::chrono::milliseconds shutdown_grace{5000};       ///< `shutdown` answer; SIGTERM to SIGKILL
    std::chrono::milliseconds stop_grace{10000};          ///< duplexChannelStop to its exit
    /// One JSON line from the worker (over it the worker is retired). The SDK bounds
    /// nothing; a data frame of this many base64 bytes carries 24 MiB.
    std::size_t max_line = 32U << 20;
    /// Frames a route may hold before its open answer (then the route ends, not the worker):
    /// paperclip's host holds as many.
    std::size_t max_held_frames = 10001;
    std::size_t max_held_bytes = 393216;  ///< decoded bytes held before the open answer
    /// `initialize`'s instanceInfo.instanceId: the node id.
    std::string instance_id = "sandboxd";
};

/// A Provider whose sandboxes live behind a plugin worker (key config.provider, pluginId
/// config.plugin_id). Does not block: the worker starts asynchronously, and until it has
/// answered `initialize` the provider's calls fail with errc::provider_not_ready.
std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning = {});

}  // namespace sandboxd
