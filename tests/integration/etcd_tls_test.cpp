// The etcd registry over TLS (issue 17, item 2): an etcd that serves only https:// and
// requires client certificates (--cert-file --key-file --trusted-ca-file --client-cert-auth)
// serves as the registry of a node whose registry.tls names the CA and a client certificate;
// a node without a client certificate, or that does not trust etcd's CA, never registers.
#include "support/daemon_fixture.hpp"
#include "support/etcd_fixture.hpp"
#include "support/pki.hpp"

#include <catch2/catch.hpp>

using namespace sandboxd;
using namespace sandboxd::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

const std::string host_token = "host-secret";

json node_config(const EtcdServer& etcd, const json& registry_tls) {
    return json{
        {"registry",
         {{"kind", "etcd"},
          {"endpoints", {etcd.endpoint()}},
          {"prefix", EtcdServer::unique_prefix()},
          {"startupTimeoutMs", 3000},
          {"tls", registry_tls}}},
        {"auth", {{"tokens", {{{"name", "host"}, {"token", host_token}, {"role", "host"}}}}}},
        {"routing", {{"nodeTtlMs", 3000}, {"heartbeatMs", 300}}}};
}

}  // namespace

TEST_CASE("An etcd with client TLS serves as the registry", "[tls][etcd][registry][daemon]") {
    TestPki pki;
    EtcdServer etcd(EtcdTls{pki.server_cert, pki.server_key, pki.ca_cert});
    REQUIRE(etcd.endpoint().rfind("https://", 0) == 0);

    DaemonProcess node("node-1", node_config(etcd, {{"caFile", pki.ca_cert.string()},
                                                    {"certFile", pki.client_cert.string()},
                                                    {"keyFile", pki.client_key.string()}})
                                     .dump());
    Client c(node.url(), host_token);
    const auto nodes = c.call("nodeList", json::object());
    REQUIRE(nodes["nodes"].size() == 1);
    CHECK(nodes["nodes"][0]["nodeId"] == "node-1");
    auto lease = acquire_lease(c);
    auto run = c.run_channel(open_params(lease, {"sh", "-c", "echo over-tls"}));
    CHECK(run.out == "over-tls\n");
    CHECK(run.exit["exitCode"] == 0);
    CHECK(c.call("leaseRelease", {{"leaseId", lease["id"]}})["status"] == "released");

    SECTION("without a client certificate the node never registers") {
        DaemonProcess refused("node-2",
                              node_config(etcd, {{"caFile", pki.ca_cert.string()}}).dump(), {},
                              DaemonProcess::start_mode::no_wait);
        const auto status = refused.wait_exit(30s);
        REQUIRE(status.has_value());
        CHECK(*status == 1);
        CHECK(refused.log().find("registry") != std::string::npos);
    }
    SECTION("a node that does not trust etcd's CA never registers") {
        DaemonProcess refused("node-3",
                              node_config(etcd, {{"caFile", pki.other_ca_cert.string()},
                                                 {"certFile", pki.client_cert.string()},
                                                 {"keyFile", pki.client_key.string()}})
                                  .dump(),
                              {}, DaemonProcess::start_mode::no_wait);
        const auto status = refused.wait_exit(30s);
        REQUIRE(status.has_value());
        CHECK(*status == 1);
        CHECK(refused.log().find("certificate verify failed") != std::string::npos);
    }
}
