#include "server/metered.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <chrono>
#include <type_traits>

namespace sandboxd {
namespace {

/// Awaits `call`, observing its duration in `seconds` whatever its end, and counting in
/// `failures` an exception that `counts` accepts.
template <class T, class Counts>
awaitable<T> timed(awaitable<T> call, Histogram& seconds, Counter& failures, Counts counts) {
    const auto started = std::chrono::steady_clock::now();
    const ScopeExit observe([&seconds, started] {
        seconds.observe(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    });
    try {
        if constexpr (std::is_void_v<T>) {
            co_await std::move(call);
        } else {
            co_return co_await std::move(call);
        }
    } catch (const rpc_error& e) {
        if (counts(e.code())) failures.inc();
        throw;
    } catch (...) {
        failures.inc();
        throw;
    }
}

constexpr auto every_error = [](errc) { return true; };
constexpr auto not_invalid_params = [](errc e) { return e != errc::invalid_params; };

class MeteredRegistry final : public Registry {
public:
    MeteredRegistry(std::unique_ptr<Registry> inner, NodeMetrics& metrics)
        : inner_(std::move(inner)), metrics_(metrics) {}

    std::unique_ptr<LeaseWatch> watch_leases(boost::asio::any_io_executor ex,
                                             std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync,
                                             std::int64_t retry_ms) override {
        return inner_->watch_leases(std::move(ex), std::move(on_change), std::move(on_resync),
                                    retry_ms);
    }
    awaitable<Lease> create_lease(Lease lease) override {
        return time("create_lease", inner_->create_lease(std::move(lease)));
    }
    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        return time("get_lease", inner_->get_lease(std::move(id)));
    }
    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        return time("find_by_idempotency_key",
                    inner_->find_by_idempotency_key(std::move(company_id),
                                                    std::move(environment_id), std::move(key)));
    }
    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        return time(
            "find_by_provider_lease",
            inner_->find_by_provider_lease(std::move(provider), std::move(provider_lease_id)));
    }
    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        return time("list_leases", inner_->list_leases(std::move(query)));
    }
    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        return time("update_lease", inner_->update_lease(std::move(next), expected_epoch));
    }
    awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) override {
        return time("update_lease", inner_->update_lease_if_owner_unchanged(
                                        std::move(next), expected_epoch, std::move(owner_seen)));
    }
    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        return time("expired_leases", inner_->expired_leases(std::move(owner_node_id), at_ms));
    }
    awaitable<std::vector<std::string>> active_owner_nodes() override {
        return time("active_owner_nodes", inner_->active_owner_nodes());
    }
    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        return time("register_node", inner_->register_node(std::move(node), liveness_ttl_ms));
    }
    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        return time("heartbeat_node",
                    inner_->heartbeat_node(std::move(node_id), std::move(instance_id), at_ms));
    }
    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        return time("remove_node", inner_->remove_node(std::move(node_id), std::move(instance_id)));
    }
    awaitable<std::vector<NodeRecord>> list_nodes() override {
        return time("list_nodes", inner_->list_nodes());
    }
    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        return time("get_node", inner_->get_node(std::move(node_id)));
    }

private:
    template <class T>
    awaitable<T> time(std::string_view op, awaitable<T> call) {
        return timed(std::move(call), metrics_.registry_call_seconds.with({op}),
                     metrics_.registry_errors.only(), every_error);
    }

    std::unique_ptr<Registry> inner_;
    NodeMetrics& metrics_;
};

class MeteredProvider final : public Provider {
public:
    MeteredProvider(std::unique_ptr<Provider> inner, NodeMetrics& metrics)
        : inner_(std::move(inner)), metrics_(metrics) {}

    const std::string& key() const noexcept override { return inner_->key(); }
    const std::string& plugin_id() const noexcept override { return inner_->plugin_id(); }
    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override {
        return time("create", inner_->create(std::move(lease)));
    }
    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        return time("destroy", inner_->destroy(std::move(sandbox)));
    }
    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        return time("open", inner_->open(std::move(sandbox), std::move(spec)));
    }
    nlohmann::json usage(const SandboxHandle& sandbox) const override {
        return inner_->usage(sandbox);
    }
    LimitEvents limit_events() const noexcept override { return inner_->limit_events(); }
    std::map<std::string, std::uint64_t> egress_denied() const override {
        return inner_->egress_denied();
    }
    std::optional<WorkerStatus> worker_status() const noexcept override {
        return inner_->worker_status();
    }
    std::string degraded() const override { return inner_->degraded(); }
    bool ready() const noexcept override { return inner_->ready(); }
    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override {
        return inner_->handle_for_teardown(lease);
    }
    awaitable<std::vector<std::string>> stored_sandboxes() override {
        return inner_->stored_sandboxes();
    }
    awaitable<std::string> describe_stored(std::string provider_lease_id) override {
        return inner_->describe_stored(std::move(provider_lease_id));
    }
    bool can_resume() const noexcept override { return inner_->can_resume(); }
    bool outlives_daemon() const noexcept override { return inner_->outlives_daemon(); }
    void keep_at_stop() noexcept override { inner_->keep_at_stop(); }
    std::vector<std::string> kept_channels(const SandboxHandle& sandbox) const override {
        return inner_->kept_channels(sandbox);
    }
    std::unique_ptr<ChannelBackend> take_kept_channel(
        SandboxHandle& sandbox, const std::string& key,
        boost::asio::any_io_executor executor) override {
        return inner_->take_kept_channel(sandbox, key, std::move(executor));
    }
    awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease) override {
        return time("resume", inner_->resume(std::move(lease)));
    }
    CleanupPolicy cleanup_policy(std::int64_t heartbeat_ms) const override {
        return inner_->cleanup_policy(heartbeat_ms);
    }
    void on_late_sandbox(LateSandboxSink sink) override {
        inner_->on_late_sandbox(std::move(sink));
    }
    std::vector<std::string> capabilities() const override { return inner_->capabilities(); }
    awaitable<nlohmann::json> validate_config(std::string company_id,
                                              nlohmann::json config) override {
        return time("validate_config",
                    inner_->validate_config(std::move(company_id), std::move(config)));
    }
    awaitable<nlohmann::json> probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease) override {
        return time("probe", inner_->probe(std::move(sandbox), std::move(lease)));
    }
    awaitable<nlohmann::json> execute(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                      ExecuteRequest request, ExecuteLog log) override {
        return time("execute", inner_->execute(std::move(sandbox), std::move(lease),
                                               std::move(request), std::move(log)));
    }
    awaitable<nlohmann::json> realize_workspace(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                                nlohmann::json workspace) override {
        return time(
            "realize_workspace",
            inner_->realize_workspace(std::move(sandbox), std::move(lease), std::move(workspace)));
    }
    awaitable<nlohmann::json> update_network(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                             nlohmann::json network) override {
        return time("update_network", inner_->update_network(std::move(sandbox), std::move(lease),
                                                             std::move(network)));
    }
    bool can_retain() const noexcept override { return inner_->can_retain(); }
    awaitable<void> stop(std::shared_ptr<SandboxHandle> sandbox) override {
        return time("stop", inner_->stop(std::move(sandbox)));
    }

private:
    template <class T>
    awaitable<T> time(std::string_view op, awaitable<T> call) {
        return timed(std::move(call), metrics_.provider_operation_seconds.with({inner_->key(), op}),
                     metrics_.provider_failures.with({inner_->key(), op}), not_invalid_params);
    }

    std::unique_ptr<Provider> inner_;
    NodeMetrics& metrics_;
};

}  // namespace

std::unique_ptr<Registry> metered_registry(std::unique_ptr<Registry> inner, NodeMetrics& metrics) {
    return std::make_unique<MeteredRegistry>(std::move(inner), metrics);
}

std::unique_ptr<Provider> metered_provider(std::unique_ptr<Provider> inner, NodeMetrics& metrics) {
    return std::make_unique<MeteredProvider>(std::move(inner), metrics);
}

}  // namespace sandboxd
