#pragma once
/// @file outside_net.hpp
/// The network tests' own world (issue 48): this test process moves into a network namespace
/// of its own (the "node": the daemons it starts live there, so the machine's nftables and
/// ip_forward are never touched), linked by a veth pair to an "outside" namespace that the
/// test also makes, where test hosts serve HTTP, TCP echo, UDP echo and DNS on addresses of
/// their own. Traffic goes only to those and to loopback.
///
/// Addresses (the documentation ranges of RFC 5737, and private and link-local ones to
/// stand for a private service and a cloud metadata endpoint):
///  - node uplink `up0` 198.51.100.1/24, default route via the outside (198.51.100.2);
///  - `public_host` 198.51.100.3: HTTP :80 and :8080, TCP echo :7000, UDP echo :7001, DNS :53;
///  - `other_host` 198.51.100.4: HTTP :80;
///  - `private_host` 10.77.0.2: HTTP :80;
///  - `metadata_host` 169.254.169.254: HTTP :80.
/// The DNS server answers A records: allowed.test and www.allowed.test -> public_host,
/// other.test -> other_host, private.test -> private_host, metadata.test -> metadata_host,
/// alias.test -> CNAME allowed.test; anything else NXDOMAIN. An HTTP answer's body is
/// "hello from ADDRESS:PORT\n"; GET /bulk/N answers N bytes.
///
/// Requires root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2 and util-linux's unshare. Not
/// thread-safe: make one per test process, on its main thread, before any daemon starts.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace sandboxd::test {

class OutsideNet {
public:
    static constexpr const char* node_uplink = "198.51.100.1";
    static constexpr const char* public_host = "198.51.100.3";
    static constexpr const char* other_host = "198.51.100.4";
    static constexpr const char* private_host = "10.77.0.2";
    static constexpr const char* metadata_host = "169.254.169.254";

    /// Makes both namespaces and starts the test hosts. Throws std::runtime_error saying
    /// which step failed.
    OutsideNet();
    ~OutsideNet();
    OutsideNet(const OutsideNet&) = delete;
    OutsideNet& operator=(const OutsideNet&) = delete;

    /// Runs `command` with /bin/sh in the node's namespace (this process's); its output.
    std::string node_sh(const std::string& command) const;
    /// DNS queries the outside's server has answered (to check a refused name never left).
    [[nodiscard]] std::uint64_t dns_queries() const;
    /// Connections the TCP echo server holds open now.
    [[nodiscard]] int echo_connections() const;

    struct State;

private:
    std::unique_ptr<State> state_;
};

}  // namespace sandboxd::test
