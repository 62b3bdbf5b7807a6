#pragma once
// The registry that the nodes of one multi-node test share, one type per backend, for
// TEMPLATE_TEST_CASE: the backend's kind is the suffix of the test's name ("- SqliteCluster",
// "- EtcdCluster"). Not thread-safe; one per test.
#include "support/daemon_fixture.hpp"
#include "support/etcd_fixture.hpp"

#include <nlohmann/json.hpp>

#include <string>

namespace sandboxd::test {

/// One SQLite file in a temporary directory.
struct SqliteCluster {
    static constexpr const char* kind = "sqlite";
    static constexpr int id = 0;  // tells its processes apart (ctest -j runs both at once)
    TempDir dir;
    nlohmann::json registry() const {
        return {{"kind", "sqlite"}, {"path", (dir.path() / "registry.db").string()}};
    }
};

/// A prefix of its own on the shared etcd server (EtcdServer::shared(): SANDBOXD_ETCD_ENDPOINT,
/// ctest's etcd fixture, or one the test process starts).
struct EtcdCluster {
    static constexpr const char* kind = "etcd";
    static constexpr int id = 1;
    std::string prefix = EtcdServer::unique_prefix();
    nlohmann::json registry() const {
        return {
            {"kind", "etcd"}, {"endpoints", {EtcdServer::shared().endpoint()}}, {"prefix", prefix}};
    }
};

/// A node's config in `cluster`: its registry, the host and peer tokens of
/// host_and_peer_tokens() (test_host_token, test_peer_token), routing `mode` ("proxy" or
/// "redirect"), and a short liveness TTL (3 s; heartbeats every 300 ms) so that tests of dead
/// owners do not wait long.
template <typename Cluster>
std::string cluster_config(const Cluster& cluster, const std::string& mode = "proxy") {
    return nlohmann::json{{"registry", cluster.registry()},
                          {"auth", host_and_peer_tokens()},
                          {"routing", {{"mode", mode}, {"nodeTtlMs", 3000}, {"heartbeatMs", 300}}}}
        .dump();
}

}  // namespace sandboxd::test
