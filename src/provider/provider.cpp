/// @file provider.cpp
/// The Provider interface's defaults that are coroutines.

#include <sandboxd/core/net.hpp>

#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/channel_backend.hpp>
#include <sandboxd/provider/provider.hpp>

namespace sandboxd {
namespace {

/// A host method the provider does not implement: INVALID_PARAMS naming it (protocol
/// section 2).
[[noreturn]] void not_implemented(const Provider& provider, const char* method) {
    throw rpc_error(
        errc::invalid_params,
        std::string(method) + ": provider \"" + provider.key() + "\" does not implement it",
        {{"field", method}});
}

}  // namespace

awaitable<std::shared_ptr<SandboxHandle>> Provider::resume(Lease lease) {
    // Built-in providers keep nothing outside the process that made the sandbox: fail closed.
    throw rpc_error(errc::sandbox_not_cached, std::string(sandbox_not_cached_message),
                    {{"leaseId", lease.id}});
    co_return nullptr;
}

awaitable<nlohmann::json> Provider::validate_config(std::string company_id, nlohmann::json config) {
    (void)company_id;
    (void)config;
    not_implemented(*this, "providerValidateConfig");
    co_return nullptr;
}

awaitable<nlohmann::json> Provider::probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease) {
    (void)sandbox;
    (void)lease;
    not_implemented(*this, "leaseProbe");
    co_return nullptr;
}

awaitable<nlohmann::json> Provider::realize_workspace(std::shared_ptr<SandboxHandle> sandbox,
                                                      Lease lease, nlohmann::json workspace) {
    (void)sandbox;
    (void)lease;
    (void)workspace;
    not_implemented(*this, "leaseRealizeWorkspace");
    co_return nullptr;
}

awaitable<nlohmann::json> Provider::update_network(std::shared_ptr<SandboxHandle> sandbox,
                                                   Lease lease, nlohmann::json network) {
    (void)sandbox;
    (void)lease;
    (void)network;
    not_implemented(*this, "leaseUpdateNetwork");
    co_return nullptr;
}

awaitable<void> Provider::stop(std::shared_ptr<SandboxHandle> sandbox) {
    (void)sandbox;
    throw rpc_error(errc::invalid_params,
                    "disposition: provider \"" + key() +
                        "\" cannot retain a sandbox (it accepts only \"destroy\")",
                    {{"field", "disposition"}});
    co_return;
}

}  // namespace sandboxd
