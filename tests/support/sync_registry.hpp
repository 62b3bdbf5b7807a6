#pragma once
// Tests drive the awaitable Registry (include/sandboxd/registry/registry.hpp) from plain test code:
// an io_context runs on a thread of its own (IoThread) and SyncRegistry offers the Registry's calls
// under the same names, each run to completion there while the test thread waits. The registry
// under test is the real one; only the waiting is added.
#include <sandboxd/registry/registry.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sandboxd::test {

/// An io_context run by one thread from construction to destruction. Thread-safe.
class IoThread {
public:
    IoThread() : work_(boost::asio::make_work_guard(ioc_)), thread_([this] { ioc_.run(); }) {}
    ~IoThread() { stop(); }
    IoThread(const IoThread&) = delete;
    IoThread& operator=(const IoThread&) = delete;

    boost::asio::any_io_executor executor() { return ioc_.get_executor(); }

    /// Runs `a` on the io_context and waits for it: its result, or what it threw. Never call
    /// it on the io_context's own thread.
    template <typename T>
    T run(awaitable<T> a) {
        return boost::asio::co_spawn(ioc_, std::move(a), boost::asio::use_future).get();
    }

    /// Stops the io_context and joins its thread (idempotent).
    void stop() {
        if (!thread_.joinable()) return;
        work_.reset();
        ioc_.stop();
        thread_.join();
    }

private:
    boost::asio::io_context ioc_;
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
    std::thread thread_;
};

/// A Registry on an IoThread of its own, with each call waited for.
class SyncRegistry {
public:
    using Factory = std::function<std::unique_ptr<Registry>(boost::asio::any_io_executor)>;
    explicit SyncRegistry(const Factory& make) : registry_(make(io_.executor())) {}
    ~SyncRegistry() {
        // Its sockets live on the io_context: the thread stops first, then they go.
        io_.stop();
        registry_.reset();
    }
    SyncRegistry(const SyncRegistry&) = delete;
    SyncRegistry& operator=(const SyncRegistry&) = delete;

    Registry& async() { return *registry_; }
    IoThread& io() { return io_; }
    boost::asio::any_io_executor executor() { return io_.executor(); }
    /// Waits for `op` (an awaitable of this registry) on the wrapper's thread.
    template <typename T>
    T wait(awaitable<T> op) {
        return io_.run(std::move(op));
    }

    std::unique_ptr<LeaseWatch> watch_leases(std::function<void(const Lease&)> on_change,
                                             std::function<void()> on_resync = {},
                                             std::int64_t retry_ms = 500) {
        return registry_->watch_leases(io_.executor(), std::move(on_change), std::move(on_resync),
                                       retry_ms);
    }
    Lease create_lease(const Lease& l) { return io_.run(registry_->create_lease(l)); }
    std::optional<Lease> get_lease(const std::string& id) {
        return io_.run(registry_->get_lease(id));
    }
    std::optional<Lease> find_by_idempotency_key(const std::string& c, const std::string& e,
                                                 const std::string& k) {
        return io_.run(registry_->find_by_idempotency_key(c, e, k));
    }
    std::optional<Lease> find_by_provider_lease(const std::string& p, const std::string& id) {
        return io_.run(registry_->find_by_provider_lease(p, id));
    }
    LeasePage list_leases(const LeaseQuery& q) { return io_.run(registry_->list_leases(q)); }
    std::optional<Lease> update_lease(const Lease& next, std::int64_t expected_epoch) {
        return io_.run(registry_->update_lease(next, expected_epoch));
    }
    std::optional<Lease> update_lease_if_owner_unchanged(const Lease& next,
                                                         std::int64_t expected_epoch,
                                                         std::optional<NodeRecord> owner_seen) {
        return io_.run(registry_->update_lease_if_owner_unchanged(next, expected_epoch,
                                                                  std::move(owner_seen)));
    }
    std::vector<Lease> expired_leases(const std::string& owner, std::int64_t at_ms) {
        return io_.run(registry_->expired_leases(owner, at_ms));
    }
    std::vector<std::string> active_owner_nodes() {
        return io_.run(registry_->active_owner_nodes());
    }
    void register_node(const NodeRecord& n, std::int64_t ttl_ms) {
        io_.run(registry_->register_node(n, ttl_ms));
    }
    bool heartbeat_node(const std::string& node, const std::string& instance, std::int64_t at) {
        return io_.run(registry_->heartbeat_node(node, instance, at));
    }
    void remove_node(const std::string& node, const std::string& instance) {
        io_.run(registry_->remove_node(node, instance));
    }
    std::vector<NodeRecord> list_nodes() { return io_.run(registry_->list_nodes()); }
    std::optional<NodeRecord> get_node(const std::string& node) {
        return io_.run(registry_->get_node(node));
    }

private:
    IoThread io_;
    std::unique_ptr<Registry> registry_;
};

inline std::unique_ptr<SyncRegistry> open_sqlite(std::string path, int readers = 2) {
    return std::make_unique<SyncRegistry>(
        [&](boost::asio::any_io_executor) { return make_sqlite_registry(path, readers); });
}
inline std::unique_ptr<SyncRegistry> sync_sqlite(std::string path, int readers = 2) {
    return open_sqlite(std::move(path), readers);
}

inline std::unique_ptr<SyncRegistry> open_etcd(std::vector<std::string> endpoints,
                                               std::string prefix, std::int64_t node_ttl_ms,
                                               std::string username = "",
                                               std::string password = "") {
    return std::make_unique<SyncRegistry>([&](boost::asio::any_io_executor ex) {
        return make_etcd_registry(std::move(ex), endpoints, prefix, node_ttl_ms, username,
                                  password);
    });
}

inline std::unique_ptr<SyncRegistry> sync_etcd(std::vector<std::string> endpoints,
                                               std::string prefix, std::int64_t node_ttl_ms,
                                               std::string username = "",
                                               std::string password = "") {
    return open_etcd(std::move(endpoints), std::move(prefix), node_ttl_ms, std::move(username),
                     std::move(password));
}

}  // namespace sandboxd::test
