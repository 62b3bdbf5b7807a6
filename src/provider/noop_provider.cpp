/// The no-op provider (key "noop", pluginId "builtin"): a lease whose sandbox is nothing at
/// all. It exists to measure what the node itself costs per lease operation (the registry,
/// the handle cache, the protocol), apart from any sandbox (issue 19, bench/run's
/// lease-ops-noop step). Disabled unless the config enables it (providers.noop.enabled);
/// it runs no command: every open or execute fails with PROVIDER_ERROR.

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/provider/provider.hpp>

#include <string>
#include <utility>

namespace sandboxd {
namespace {

constexpr std::string_view id_prefix = "noop-";

/// The handle of `lease`'s (empty) sandbox: its scope and id, nothing else.
std::shared_ptr<SandboxHandle> handle_of(const Lease& lease) {
    auto handle = std::make_shared<SandboxHandle>();
    handle->scope = scope_of(lease);
    handle->lease_id = lease.id;
    return handle;
}

class NoopProvider final : public Provider {
public:
    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }

    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override {
        auto handle = handle_of(lease);
        handle->scope.provider_lease_id = std::string(id_prefix) + random_hex(8);
        co_return handle;
    }

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        (void)sandbox;
        co_return;
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        (void)sandbox;
        (void)spec;
        throw rpc_error(errc::provider_error,
                        "provider noop runs no commands: it measures lease operations only");
        co_return nullptr;  // not reached
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override {
        if (lease.provider_lease_id.rfind(id_prefix, 0) != 0) return nullptr;
        return handle_of(lease);
    }

    /// Nothing is lost with the process: a restarted node serves its leases again.
    bool can_resume() const noexcept override { return true; }
    awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease) override {
        co_return handle_of(lease);
    }

private:
    std::string key_ = "noop";
    std::string plugin_id_ = "builtin";
};

}  // namespace

std::unique_ptr<Provider> make_noop_provider() { return std::make_unique<NoopProvider>(); }

}  // namespace sandboxd
