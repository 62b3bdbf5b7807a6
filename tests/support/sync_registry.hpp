#pragma once
// A Registry driven from a test's thread: each call runs on an io_context of the wrapper's
// own (one thread) and the caller waits for its result. Tests that check what a registry
// stores read best as plain calls; the daemon itself always awaits.
#include <sandboxd/registry.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <functional>
#include <memory>
#include <thread>
#include <utility>

namespace sandboxd::test {

class SyncRegistry {
public:
    /// `make` builds the registry on the wrapper's executor (etcd needs one; SQLite ignores it).
    template <typename Make>
    explicit SyncRegistry(Make make)
        : work_(boost::asio::make_work_guard(ioc_)), thread_([this] { ioc_.run(); }) {
        try {
            registry_ = make(ioc_.get_executor());
        } catch (...) {
            stop();
            throw;
        }
    }
    SyncRegistry(const SyncRegistry&) = delete;
    SyncRegistry& operator=(const SyncRegistry&) = delete;
    ~SyncRegistry() { stop(); }

    /// Waits for `op` (an awaitable of this registry) on the wrapper's thread.
    template <typename T>
    T wait(awaitable<T> op) {
        return boost::asio::co_spawn(ioc_, std::move(op), boost::asio::use_future).get();
    }

    Registry& async() { return *registry_; }
    boost::asio::any_io_executor executor() { return ioc_.get_executor(); }

    Lease create_lease(const Lease& l) { return wait(registry_->create_lease(l)); }
    std::optional<Lease> get_lease(const std::string& id) { return wait(registry_->get_lease(id)); }
    std::optional<Lease> find_by_idempotency_key(const std::string& company,
                                                 const std::string& environment,
                                                 const std::string& key) {
        return wait(registry_->find_by_idempotency_key(company, environment, key));
    }
    std::optional<Lease> find_by_provider_lease(const std::string& provider,
                                                const std::string& provider_lease_id) {
        return wait(registry_->find_by_provider_lease(provider, provider_lease_id));
    }
    LeasePage list_leases(const LeaseQuery& q) { return wait(registry_->list_leases(q)); }
    std::optional<Lease> update_lease(const Lease& next, std::int64_t expected_epoch) {
        return wait(registry_->update_lease(next, expected_epoch));
    }
    std::vector<Lease> expired_leases(const std::string& owner, std::int64_t at_ms) {
        return wait(registry_->expired_leases(owner, at_ms));
    }
    std::vector<std::string> active_owner_nodes() { return wait(registry_->active_owner_nodes()); }
    void register_node(const NodeRecord& n, std::int64_t ttl_ms) {
        wait(registry_->register_node(n, ttl_ms));
    }
    bool heartbeat_node(const std::string& node_id, const std::string& instance_id,
                        std::int64_t at_ms) {
        return wait(registry_->heartbeat_node(node_id, instance_id, at_ms));
    }
    void remove_node(const std::string& node_id, const std::string& instance_id) {
        wait(registry_->remove_node(node_id, instance_id));
    }
    std::vector<NodeRecord> list_nodes() { return wait(registry_->list_nodes()); }
    std::optional<NodeRecord> get_node(const std::string& node_id) {
        return wait(registry_->get_node(node_id));
    }
    /// Callbacks run on the wrapper's thread.
    std::unique_ptr<LeaseWatch> watch_leases(std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync = {},
                                             std::int64_t retry_ms = 500) {
        return registry_->watch_leases(ioc_.get_executor(), std::move(on_change),
                                       std::move(on_resync), retry_ms);
    }

private:
    void stop() {
        registry_.reset();
        work_.reset();
        if (thread_.joinable()) thread_.join();
    }

    boost::asio::io_context ioc_;
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
    std::thread thread_;
    std::unique_ptr<Registry> registry_;
};

inline std::unique_ptr<SyncRegistry> sync_sqlite(const std::string& path, int readers = 2) {
    return std::make_unique<SyncRegistry>(
        [&](const boost::asio::any_io_executor&) { return make_sqlite_registry(path, readers); });
}

inline std::unique_ptr<SyncRegistry> sync_etcd(std::vector<std::string> endpoints,
                                               std::string prefix, std::int64_t node_ttl_ms,
                                               std::string username = "",
                                               std::string password = "") {
    return std::make_unique<SyncRegistry>([&](boost::asio::any_io_executor ex) {
        return make_etcd_registry(std::move(ex), std::move(endpoints), std::move(prefix),
                                  node_ttl_ms, std::move(username), std::move(password));
    });
}

}  // namespace sandboxd::test
