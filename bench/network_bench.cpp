// sandboxd_network_bench (issue 48): what a lease's network costs, measured in one run.
//  - connect: the median TCP connect time (curl's time_connect, 200 connects) to a test host
//    from inside an egress lease, and from the node itself (no veth, no NAT, no policy);
//  - throughput: the median of 3 downloads of 1 GB from the same test host, both ways;
//  - acquire and release: medians of 20 leases each with loopback only on a node without
//    egress (bubblewrap makes the namespace), and with an egress policy on a node with it.
// It makes its own network namespaces (tests/support/outside_net.hpp): run as root. Prints
// one JSON object. Usage: sandboxd_network_bench [SANDBOXD_BINARY] (default: the dev build's).
#include "support/daemon_fixture.hpp"
#include "support/outside_net.hpp"

#include <sandboxd/client/client.hpp>
#include <sandboxd/core/errors.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;

namespace {

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

std::vector<double> numbers(const std::string& text) {
    std::vector<double> out;
    std::istringstream in(text);
    for (double x = 0; in >> x;) out.push_back(x);
    return out;
}

std::string config(bool egress) {
    json bwrap = {{"adoptTimeoutMs", 0}};
    if (egress) bwrap["network"] = {{"egress", true}, {"dns", {OutsideNet::public_host}}};
    return json{{"auth", host_and_peer_tokens()}, {"providers", {{"bwrap", bwrap}}}}.dump();
}

json acquire(Client& c, const json& network) {
    return c.call("leaseAcquire", {{"companyId", "acme"},
                                   {"environmentId", "dev"},
                                   {"provider", "bwrap"},
                                   {"config", {{"network", network}}}});
}

/// Medians (ms) of `n` acquires and of their releases.
std::pair<double, double> lease_cost(Client& c, const json& network, int n) {
    std::vector<double> acquires, releases;
    using clock = std::chrono::steady_clock;
    for (int i = 0; i < n; ++i) {
        auto t0 = clock::now();
        json lease = acquire(c, network);
        auto t1 = clock::now();
        c.call("leaseRelease", {{"leaseId", lease["id"]}});
        auto t2 = clock::now();
        acquires.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        releases.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    return {median(acquires), median(releases)};
}

std::string in_lease(Client& c, const json& lease, const std::string& script) {
    return c.run_channel(open_params(lease, {"bash", "-c", script})).out;
}

}  // namespace

int run_bench(int argc, char** argv);

int main(int argc, char** argv) {
    try {
        return run_bench(argc, argv);
    } catch (const rpc_error& e) {
        std::cerr << "sandboxd_network_bench: " << e.what() << " " << e.data().dump() << "\n";
    } catch (const std::exception& e) {
        std::cerr << "sandboxd_network_bench: " << e.what() << "\n";
    }
    return 1;
}

int run_bench(int argc, char** argv) {
    if (argc > 1) set_daemon_binary(argv[1]);
    OutsideNet net;
    json out;
    {
        DaemonProcess d("bench", config(false));
        Client c(d.url(), test_host_token);
        auto [acquire_ms, release_ms] = lease_cost(c, false, 20);
        out["acquireMsNoEgressNode"] = acquire_ms;
        out["releaseMsNoEgressNode"] = release_ms;
    }
    DaemonProcess d("bench", config(true));
    Client c(d.url(), test_host_token);
    {
        auto [acquire_ms, release_ms] = lease_cost(c, json{{"mode", "egress"}}, 20);
        out["acquireMsEgress"] = acquire_ms;
        out["releaseMsEgress"] = release_ms;
        auto [none_acquire, none_release] = lease_cost(c, false, 20);
        out["acquireMsNoneOnEgressNode"] = none_acquire;
        out["releaseMsNoneOnEgressNode"] = none_release;
    }
    json lease = acquire(c, json{{"mode", "egress"}});
    const std::string url = "http://" + std::string(OutsideNet::public_host) + "/";
    const std::string connects =
        "for i in $(seq 200); do curl -s -o /dev/null -w "
        "'%{time_connect}\\n' " +
        url + "; done";
    const std::string bulk = "for i in 1 2 3; do curl -s -o /dev/null -w '%{speed_download}\\n' " +
                             url + "bulk/1000000000; done";
    // Alternated, so that the machine's noise falls on both alike.
    std::vector<double> lease_connect, host_connect, lease_bps, host_bps;
    for (int round = 0; round < 2; ++round) {
        for (double s : numbers(in_lease(c, lease, connects))) lease_connect.push_back(s * 1000);
        for (double s : numbers(net.node_sh(connects))) host_connect.push_back(s * 1000);
        for (double b : numbers(in_lease(c, lease, bulk))) lease_bps.push_back(b);
        for (double b : numbers(net.node_sh(bulk))) host_bps.push_back(b);
    }
    out["connectMsLease"] = median(lease_connect);
    out["connectMsHost"] = median(host_connect);
    out["connectMsAdded"] = median(lease_connect) - median(host_connect);
    out["throughputMiBsLease"] = median(lease_bps) / (1 << 20);
    out["throughputMiBsHost"] = median(host_bps) / (1 << 20);
    out["throughputRatio"] = median(host_bps) > 0 ? median(lease_bps) / median(host_bps) : 0;
    out["samples"] = {{"connects", lease_connect.size()}, {"downloads", lease_bps.size()}};
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    std::cout << out.dump(2) << "\n";
    return 0;
}
