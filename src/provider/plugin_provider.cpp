/// @file plugin_provider.cpp
/// A Provider whose sandboxes live behind a plugin worker (docs/plugins.md). Leases map to
/// environmentAcquireLease / environmentReleaseLease / environmentDestroyLease; channels to
/// duplexChannelOpen, bridged by the WorkerManager into the pipes a Channel reads.

#include "provider/plugin_worker.hpp"

#include <sandboxd/errors.hpp>

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

    std::shared_ptr<SandboxHandle> create(SandboxScope scope, const std::string& lease_id,
                                          const json& config) override {
        if (!config.is_null() && !config.is_object()) {
            throw rpc_error(errc::invalid_params, "config: must be an object");
        }
        json params = {{"driverKey", key_},
                       {"companyId", scope.company_id},
                       {"environmentId", scope.environment_id},
                       {"leaseId", lease_id},
                       {"config", config.is_null() ? json::object() : config}};
        json result = manager_.call("environmentAcquireLease", std::move(params));
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
        return handle;
    }

    void destroy(const SandboxHandle& sandbox) override {
        const json params = {{"driverKey", key_},
                             {"companyId", sandbox.scope.company_id},
                             {"environmentId", sandbox.scope.environment_id},
                             {"providerLeaseId", sandbox.scope.provider_lease_id},
                             {"leaseId", sandbox.lease_id}};
        // Either call throws PROVIDER_NOT_READY while the worker is down: the sweeper then
        // retries without spending an attempt.
        manager_.call_if_supported("environmentReleaseLease", params);
        manager_.call_if_supported("environmentDestroyLease", params);
    }

    SpawnedProcess spawn(const SandboxHandle& sandbox, const ExecSpec& spec) override {
        if (spec.pty) {
            throw rpc_error(errc::provider_error,
                            "plugin " + plugin_id_ + " does not support PTY channels");
        }
        json params = {{"driverKey", key_},
                       {"companyId", sandbox.scope.company_id},
                       {"environmentId", sandbox.scope.environment_id},
                       {"providerLeaseId", sandbox.scope.provider_lease_id},
                       {"command", spec.argv}};
        if (!spec.cwd.empty()) params["cwd"] = spec.cwd;
        if (!spec.env.empty()) params["env"] = spec.env;
        return manager_.open_channel(std::move(params), spec.stdin_attached);
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
    const std::string key_;
    const std::string plugin_id_;
    WorkerManager manager_;
};

}  // namespace

std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning) {
    return std::make_unique<PluginProvider>(std::move(config), tuning);
}

}  // namespace sandboxd
