#pragma once
/// @file network_policy.hpp
/// A lease's network policy (issue 48): the value of `config.network` and `Lease.network`,
/// `{mode: "none" | "egress", allow?: [rule], deny?: [rule]}`, parsed, checked and normalised.
/// Only the parse is here: what enforces the policy (the lease's network namespace, its veth
/// pair, NAT and the node's nftables) reads the parsed value.
///
/// A rule is a string naming a host, or an object `{host, ports?, protocol?}`:
///  - `host`: a domain name (`example.com`, lower-cased; `*.example.com` matches the
///    subdomains of example.com at any depth, not example.com itself), an IPv4 or IPv6 address,
///    or a CIDR (`203.0.113.0/24`, `2001:db8::/32`; host bits must be zero). Domain names are
///    ASCII (an internationalised name in its `xn--` form): labels of 1..63 letters, digits and
///    hyphens, neither starting nor ending with a hyphen, at most 253 characters in all, not all
///    digits in the last label (that would be an address), one trailing dot dropped.
///  - `ports`: 1..64 entries, each a port (1..65535) or a range `"LO-HI"` with LO <= HI;
///    absent: every port. Entries are sorted and merged in the normalised form.
///  - `protocol`: "tcp" or "udp"; absent: both.
/// The old boolean is accepted: `false` is `{mode: "none"}`, `true` is `{mode: "egress"}`
/// (the node's default rules apply to it as to any egress policy). `mode: "none"` takes no
/// rules. At most `max_rules` rules in `allow` and in `deny` each.
///
/// Errors: rpc_error INVALID_PARAMS whose message names the field
/// (`config.network.allow[2].ports[0]`, say) and says what is wrong, with `data.field`; nothing is
/// kept of a bad policy. Thread-safety: pure functions of their arguments.

#include <nlohmann/json.hpp>

#include <boost/asio/ip/network_v4.hpp>
#include <boost/asio/ip/network_v6.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace sandboxd::detail {

enum class network_mode { none, egress };

/// A rule's host: a domain name (exact, or its subdomains), or a network (an address is a
/// network of its full length).
struct DomainName {
    std::string name;         ///< lower-case, no trailing dot, no "*." prefix
    bool subdomains = false;  ///< "*.name": the subdomains of name, not name itself
    bool operator==(const DomainName&) const = default;
};
using RuleHost = std::variant<DomainName, boost::asio::ip::network_v4, boost::asio::ip::network_v6>;

struct PortRange {
    std::uint16_t first = 1;  ///< 1..65535
    std::uint16_t last = 65535;
    bool operator==(const PortRange&) const = default;
};

enum class rule_protocol { any, tcp, udp };

struct NetworkRule {
    RuleHost host;
    std::vector<PortRange> ports;  ///< sorted, merged; empty: every port
    rule_protocol protocol = rule_protocol::any;
};

struct NetworkPolicy {
    network_mode mode = network_mode::none;
    std::vector<NetworkRule> allow;  ///< empty under egress: everything not denied
    std::vector<NetworkRule> deny;
};

inline constexpr std::size_t max_rules = 256;
inline constexpr std::size_t max_ports = 64;

/// Parses `value` (the JSON of `field`, e.g. "config.network"): a boolean or a policy object.
/// Throws rpc_error INVALID_PARAMS as above.
NetworkPolicy parse_network_policy(const nlohmann::json& value,
                                   const std::string& field = "config.network");

/// The normalised JSON of a policy: `{mode, allow, deny}`, each rule an object with `host`
/// (its text: "*.example.com", "203.0.113.0/24", and an address without a prefix length)
/// and, when set, `ports` (numbers and "LO-HI" strings) and `protocol`. Parsing it gives the
/// same policy.
nlohmann::json to_json(const NetworkPolicy& policy);

}  // namespace sandboxd::detail
