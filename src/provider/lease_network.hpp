#pragma once
/// @file lease_network.hpp
/// Each lease's network (issue 48): a network namespace of its own, always, made by the
/// daemon (so owned by the host's user namespace: nothing inside the sandbox, root there
/// included, may change its addresses, routes or filters), and for an egress policy a veth
/// pair to the host, NAT to the uplink, the policy in the node's nftables table, and a resolver
/// of its own (lease_resolver.hpp). Internal to the provider layer.
///
/// The model (docs/security.md, "Network"):
///  - Leases get one address each from the node's IPv4 pool (a /32, the lease side of its veth
///    pair); the pool's first address is the gateway, the host side of every lease's veth, and
///    the lease's resolver (port 53 there is redirected to the lease's own resolver socket).
///  - The node's table `inet sandboxd_<tag>` holds everything: the forward and input filters,
///    the NAT, one chain per lease and one set per domain rule of a lease. A packet a lease
///    sends is checked, in this order: its source must be the lease's address; the node's
///    always-deny list (`deny`); other leases (the pool); the ranges the node opens (`open`);
///    the built-in never-reachable ranges (builtin_deny_v4()); the lease's `deny`; the lease's
///    `allow` (then nothing else when `allow` is not empty). The host itself is reachable only
///    at the gateway's resolver port. Nothing new enters a lease.
///  - A connection once accepted is marked with the lease's policy generation; a policy update
///    bumps it, so that every live connection is checked again at its next packet and cut
///    (TCP reset, ICMP admin-prohibited) if no longer allowed.
///  - Domain rules: the lease's resolver refuses a name that a `deny` rule matches, and, when
///    `allow` has domain rules, a name that none of them matches; an address answered for an
///    allowed name joins the set of each allow rule matching the name, for the answer's TTL (at
///    least 60 s), and is still subject to every rule before the lease's `allow`.
///  - IPv6: a lease has no IPv6 address but link-local and no IPv6 route, so IPv6 fails closed.
///
/// Errors: std::runtime_error naming the step and the kernel's or nftables' words. Thread-safety:
/// every call of NodeNetwork may come from any thread (they are serialised); a LeaseNetwork is
/// used by one sandbox under its own lock. Calls block briefly (netlink and nftables
/// transactions, a thread made to enter or make a namespace): run them on a blocking pool.

#include "provider/lease_resolver.hpp"
#include "provider/network_policy.hpp"

#include <sandboxd/core/unique_fd.hpp>

#include <boost/asio/ip/address_v4.hpp>
#include <boost/asio/ip/network_v4.hpp>
#include <boost/asio/ip/udp.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd::detail {

/// The IPv4 ranges no lease reaches unless the node opens them: "this network", RFC 1918,
/// RFC 6598 shared space, loopback, link-local (cloud metadata), multicast, reserved and
/// broadcast.
const std::vector<boost::asio::ip::network_v4>& builtin_deny_v4();

struct NodeNetworkOptions {
    /// Whether any lease may have egress; false: every lease is `mode: "none"`.
    bool egress = false;
    /// Lease addresses; its first address is the gateway. /8../28.
    boost::asio::ip::network_v4 pool = boost::asio::ip::make_network_v4("10.200.0.0/16");
    /// The interface NAT sends egress out of; "": whichever the host's routes choose.
    std::string uplink;
    std::vector<boost::asio::ip::network_v4> deny;  ///< the node's always-deny list
    std::vector<boost::asio::ip::network_v4> open;  ///< opened on purpose (an internal mirror)
    /// Upstream resolvers of the leases' resolvers (the host's /etc/resolv.conf by default).
    std::vector<boost::asio::ip::udp::endpoint> dns;
    /// Names the node's table and interfaces: 6 lower-case hex digits.
    std::string tag;
};

class NodeNetwork;

/// What a lease's resolver answered for allowed names, until when: an update keeps what its
/// new rules still allow. Guarded by the node's lock.
struct ResolvedNames {
    std::map<std::string,
             std::map<boost::asio::ip::address_v4, std::chrono::steady_clock::time_point>>
        names;
    /// At most this many names are kept (expired ones go first, then the first by name), and
    /// at most max_addresses per name (the one expiring first goes): what a tenant's lookups
    /// make the daemon hold is bounded.
    static constexpr std::size_t max_names = 4096;
    static constexpr std::size_t max_addresses = 64;
    /// Each domain rule's set holds at most this many addresses (kernel memory, bounded the
    /// same way); an answer beyond it is not added, so its address stays refused.
    static constexpr std::size_t max_set_elements = 65536;
    void add(const std::string& name, boost::asio::ip::address_v4 address,
             std::chrono::steady_clock::time_point until);
};

/// What a lease's network is, for its record and for adoption.
struct LeaseNetworkInfo {
    std::uint32_t index = 0;  ///< 0: no veth (mode none); else its address's offset in the pool
    boost::asio::ip::address_v4 address;
    std::string host_interface;  ///< "" without a veth
};

/// One lease's network. Destroying it removes its veth, addresses, chains, sets and resolver
/// (the namespace goes with the sandbox's last process and this object's descriptor).
class LeaseNetwork {
public:
    ~LeaseNetwork();
    LeaseNetwork(const LeaseNetwork&) = delete;
    LeaseNetwork& operator=(const LeaseNetwork&) = delete;

    /// The namespace's descriptor: bubblewrap enters it (setns) before it starts. Invalid
    /// on a node without egress (bubblewrap makes the namespace then, --unshare-net) and for
    /// a re-adopted lease (the namespace is its supervisor's; nothing here needs it).
    [[nodiscard]] int netns() const noexcept { return netns_.get(); }
    [[nodiscard]] const LeaseNetworkInfo& info() const noexcept { return info_; }
    [[nodiscard]] const NetworkPolicy& policy() const noexcept { return policy_; }
    /// Bytes the lease received and sent through its veth (0 without one).
    struct Counts {
        std::uint64_t rx_bytes = 0;
        std::uint64_t tx_bytes = 0;
    };
    [[nodiscard]] Counts counts() const;
    /// The daemon stops and keeps its sandboxes: the resolver stops, and the veth, policy and
    /// addresses stay for the next process (its start keeps what it re-adopts).
    void keep() noexcept;

private:
    friend class NodeNetwork;
    LeaseNetwork() = default;
    std::shared_ptr<NodeNetwork> node_;
    unique_fd netns_;
    LeaseNetworkInfo info_;
    NetworkPolicy policy_;
    std::uint32_t generation_ = 1;
    std::optional<std::uint64_t> egress_bps_;
    std::unique_ptr<LeaseResolver> resolver_;
    std::shared_ptr<ResolvedNames> resolved_ = std::make_shared<ResolvedNames>();
    std::vector<std::string> sets_;  ///< the domain sets its chain names
};

class NodeNetwork : public std::enable_shared_from_this<NodeNetwork> {
public:
    /// Checks the pool against the routes and addresses of other interfaces (another node's
    /// pool on this host, a LAN), removes what an earlier process with the same tag left
    /// (interfaces of a lease index not in `kept`, and the table, rebuilt), and with egress
    /// turns on IPv4 forwarding. Throws std::runtime_error naming what is wrong.
    static std::shared_ptr<NodeNetwork> start(NodeNetworkOptions options,
                                              const std::vector<std::uint32_t>& kept);
    ~NodeNetwork();
    NodeNetwork(const NodeNetwork&) = delete;
    NodeNetwork& operator=(const NodeNetwork&) = delete;

    /// A new namespace with loopback up and, for an egress policy, its veth pair, routes,
    /// policy and resolver. Throws rpc_error INVALID_PARAMS (field config.network) for an
    /// egress policy on a node without egress, PROVIDER_ERROR when the pool is exhausted or a
    /// step fails (then nothing is left).
    /// `egress_bps`: bytes per second each way through its veth (a token bucket on both ends,
    /// outside the lease's reach), when it gets one.
    std::unique_ptr<LeaseNetwork> attach(const NetworkPolicy& policy,
                                         std::optional<std::uint64_t> egress_bps = std::nullopt);
    /// A lease of an earlier process, re-adopted: its veth (`info`) is still there; its
    /// chains, sets and resolver are made again. Throws like attach().
    std::unique_ptr<LeaseNetwork> readopt(const LeaseNetworkInfo& info,
                                          const NetworkPolicy& policy);
    /// leaseUpdateNetwork: replaces the lease's policy. Egress to none removes nothing but
    /// refuses everything (the veth stays until release); none to egress adds the veth when
    /// this process made the namespace, else throws rpc_error INVALID_PARAMS saying why.
    void update(LeaseNetwork& lease, const NetworkPolicy& policy);
    /// A stored lease that is torn down without being re-adopted: its veth goes (its chains
    /// went with the table at start).
    void forget(const LeaseNetworkInfo& info) noexcept;

    [[nodiscard]] const NodeNetworkOptions& options() const noexcept { return options_; }
    /// Packets refused so far by reason (the table's counters denied_<reason>); empty without
    /// egress. Does not wait: while another call holds the node's lock, what it read last.
    [[nodiscard]] std::map<std::string, std::uint64_t> denied() const;
    [[nodiscard]] boost::asio::ip::address_v4 gateway() const noexcept { return gateway_; }
    /// The node's resolv.conf for a lease's /etc: the gateway.
    [[nodiscard]] std::string resolv_conf() const;

    struct Impl;

private:
    friend class LeaseNetwork;
    explicit NodeNetwork(NodeNetworkOptions options);
    void detach(LeaseNetwork& lease) noexcept;
    void stop_resolver(LeaseNetwork& lease) noexcept;
    void delete_link(const std::string& name) noexcept;  // lock held
    void add_veth(LeaseNetwork& lease);
    void start_resolver(LeaseNetwork& lease);
    void apply(LeaseNetwork& lease, const NetworkPolicy& policy);
    ResolverPolicy resolver_policy(const LeaseNetwork& lease, const NetworkPolicy& policy);
    NodeNetworkOptions options_;
    boost::asio::ip::address_v4 gateway_;
    std::unique_ptr<Impl> impl_;
};

}  // namespace sandboxd::detail
