/// @file plugin_provider.cpp
/// A Provider whose sandboxes live behind a plugin worker (docs/plugins.md). Leases map to
/// environmentAcquireLease / environmentReleaseLease / environmentDestroyLease; channels to
/// duplexChannelOpen, served by the WorkerManager as channel backends. Every call completes
/// when the worker answers (or its RPC timeout fires); none blocks a thread.

#include "provider/plugin_worker.hpp"

#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

namespace sandboxd {
namespace {

using json = nlohmann::json;

constexpr std::size_t max_provider_lease_id = 256;

class PluginProvider final : public Provider {
public:
    PluginProvider(PluginConfig config, PluginTuning tuning)
        : key_(config.provider), plugin_id_(config.plugin_id),
          manager_(std::move(config), tuning) {}

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }
    bool ready() const noexcept override { return manager_.ready(); }

    awaitable<std::shared_ptr<SandboxHandle>> create(SandboxScope scope, std::string lease_id,
                                                     json config) override {
        if (!config.is_null() && !config.is_object()) {
            throw rpc_error(errc::invalid_params, "config: must be an object");
        }
        json params = acquire_params(scope, lease_id, config);
        json result = co_await manager_.call("environmentAcquireLease", std::move(params));
        const json* id = result.is_object() && result.contains("providerLeaseId")
                             ? &result["providerLeaseId"]
                             : nullptr;
        if (!id || !id->is_string() || id->get<std::string>().empty() ||
            id->get<std::string>().size() > max_provider_lease_id ||
            id->get<std::string>().find_first_of(std::string("\0\n\r", 3)) != std::string::npos) {
            spdlog::error("plugin={} environmentAcquireLease returned no usable providerLeaseId: {}",
                          plugin_id_, result.dump());
            throw rpc_error(errc::provider_error,
                            "plugin " + plugin_id_ +
                                ": environmentAcquireLease returned no usable providerLeaseId");
        }
        auto handle = std::make_shared<SandboxHandle>();
        scope.provider_lease_id = id->get<std::string>();
        handle->scope = std::move(scope);
        handle->lease_id = lease_id;
        co_return handle;
    }

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        const json params = release_params(*sandbox);
        // Either call throws PROVIDER_NOT_READY while the worker is down: the sweeper then
        // retries without spending an attempt.
        co_await manager_.call_if_supported("environmentReleaseLease", params);
        co_await manager_.call_if_supported("environmentDestroyLease", params);
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        if (spec.pty) {
            throw rpc_error(errc::provider_error,
                            "plugin " + plugin_id_ + " does not support PTY channels");
        }
        json params = open_params(*sandbox, spec);
        co_return co_await manager_.open_channel(std::move(params), spec.stdin_attached);
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const SandboxScope& scope,
                                                       const std::string& lease_id) override {
        // The worker tears down by scope: any node's daemon can release through it.
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope;
        handle->lease_id = lease_id;
        return handle;
    }

private:
    // The params are built in plain functions: GCC 12 miscompiles brace-initialised
    // aggregates of strings inside coroutine bodies.
    json acquire_params(const SandboxScope& scope, const std::string& lease_id,
                        const json& config) const {
        return {{"driverKey", key_},
                {"companyId", scope.company_id},
                {"environmentId", scope.environment_id},
                {"leaseId", lease_id},
                {"config", config.is_null() ? json::object() : config}};
    }

    json release_params(const SandboxHandle& sandbox) const {
        return {{"driverKey", key_},
                {"companyId", sandbox.scope.company_id},
                {"environmentId", sandbox.scope.environment_id},
                {"providerLeaseId", sandbox.scope.provider_lease_id},
                {"leaseId", sandbox.lease_id}};
    }

    json open_params(const SandboxHandle& sandbox, const ExecSpec& spec) const {
        json params = {{"driverKey", key_},
                       {"companyId", sandbox.scope.company_id},
                       {"environmentId", sandbox.scope.environment_id},
                       {"providerLeaseId", sandbox.scope.provider_lease_id},
                       {"command", spec.argv}};
        if (!spec.cwd.empty()) params["cwd"] = spec.cwd;
        if (!spec.env.empty()) params["env"] = spec.env;
        return params;
    }

    const std::string key_;
    const std::string plugin_id_;
    WorkerManager manager_;
};

}  // namespace

std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning) {
    return std::make_unique<PluginProvider>(std::move(config), tuning);
}

}  // namespace sandboxd
