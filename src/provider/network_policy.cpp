/// @file network_policy.cpp
/// A lease's network policy: parse, checks and normal form (network_policy.hpp). Addresses
/// and networks are Boost.Asio's (ip::make_address, ip::make_network_v4/v6).
#include "provider/network_policy.hpp"

#include <sandboxd/core/errors.hpp>

#include <boost/asio/ip/address.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <string_view>
#include <system_error>

namespace sandboxd::detail {
namespace {

using json = nlohmann::json;
namespace ip = boost::asio::ip;

[[noreturn]] void invalid(const std::string& field, const std::string& why) {
    throw rpc_error(errc::invalid_params, field + ": " + why, {{"field", field}});
}

/// `field`.`key`, the name of a member in an error.
std::string member(const std::string& field, const std::string& key) {
    std::string out = field;
    out += '.';
    out += key;
    return out;
}

bool is_label_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-'; }

/// A domain name's labels as network_policy.hpp says; `text` is lower-cased already.
bool valid_domain(std::string_view text) {
    if (text.empty() || text.size() > 253) return false;
    std::size_t start = 0;
    std::string_view last;
    for (;;) {
        const std::size_t dot = text.find('.', start);
        const std::string_view label = text.substr(
            start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
        if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-' ||
            !std::all_of(label.begin(), label.end(), is_label_char)) {
            return false;
        }
        last = label;
        if (dot == std::string_view::npos) break;
        start = dot + 1;
    }
    // A last label of digits only is an address (or a typo of one), never a name.
    return !std::all_of(last.begin(), last.end(),
                        [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
}

RuleHost parse_host(const json& value, const std::string& field) {
    if (!value.is_string()) invalid(field, "must be a string: a domain name, an address or a CIDR");
    std::string text = value.get<std::string>();
    if (text.empty()) invalid(field, "must not be empty");
    if (text.size() > 256) invalid(field, "is longer than 256 characters");
    if (text.find('/') != std::string::npos) {
        boost::system::error_code ec;
        if (text.find(':') != std::string::npos) {
            const auto net = ip::make_network_v6(text, ec);
            if (!ec && net.canonical() == net) return net;
        } else {
            const auto net = ip::make_network_v4(text, ec);
            if (!ec && net.canonical() == net) return net;
        }
        invalid(field, "\"" + text +
                           "\" is not a CIDR (an address, '/', a prefix length; the "
                           "bits after the prefix zero)");
    }
    boost::system::error_code ec;
    const auto address = ip::make_address(text, ec);
    if (!ec) {
        if (address.is_v4()) return ip::network_v4(address.to_v4(), 32);
        if (address.to_v6().scope_id() != 0)
            invalid(field, "an address with a scope is not a rule");
        return ip::network_v6(address.to_v6(), 128);
    }
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    DomainName name;
    if (text.rfind("*.", 0) == 0) {
        name.subdomains = true;
        text.erase(0, 2);
    }
    if (!text.empty() && text.back() == '.') text.pop_back();
    if (!valid_domain(text)) {
        invalid(field, "\"" + value.get<std::string>() +
                           "\" is neither an address, a CIDR nor a domain name (labels of "
                           "letters, digits and '-', at most 253 characters; \"*.\" first for "
                           "the subdomains)");
    }
    name.name = std::move(text);
    return name;
}

std::uint16_t port_number(std::string_view text, const std::string& field) {
    unsigned value = 0;
    const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (err != std::errc() || end != text.data() + text.size() || value < 1 || value > 65535) {
        invalid(field, "a port must be 1..65535");
    }
    return static_cast<std::uint16_t>(value);
}

std::vector<PortRange> parse_ports(const json& value, const std::string& field) {
    if (!value.is_array() || value.empty() || value.size() > max_ports) {
        invalid(field, "must be an array of 1.." + std::to_string(max_ports) +
                           " ports (1..65535) or \"LO-HI\" ranges");
    }
    std::vector<PortRange> ports;
    for (std::size_t i = 0; i < value.size(); ++i) {
        const std::string at = field + "[" + std::to_string(i) + "]";
        const json& p = value[i];
        PortRange range;
        if (p.is_number_integer()) {
            const auto n = p.get<std::int64_t>();
            if (n < 1 || n > 65535) invalid(at, "a port must be 1..65535");
            range.first = range.last = static_cast<std::uint16_t>(n);
        } else if (p.is_string()) {
            const std::string& s = p.get_ref<const std::string&>();
            const std::size_t dash = s.find('-');
            if (dash == std::string::npos) invalid(at, "a range is \"LO-HI\"");
            range.first = port_number(std::string_view(s).substr(0, dash), at);
            range.last = port_number(std::string_view(s).substr(dash + 1), at);
            if (range.first > range.last) invalid(at, "a range's first port is above its last");
        } else {
            invalid(at, "must be a port (1..65535) or a \"LO-HI\" range");
        }
        ports.push_back(range);
    }
    // Sorted and merged: overlapping and adjacent ranges become one.
    std::sort(ports.begin(), ports.end(),
              [](const PortRange& a, const PortRange& b) { return a.first < b.first; });
    std::vector<PortRange> merged;
    for (const auto& r : ports) {
        if (!merged.empty() && r.first <= static_cast<unsigned>(merged.back().last) + 1) {
            merged.back().last = std::max(merged.back().last, r.last);
        } else {
            merged.push_back(r);
        }
    }
    return merged;
}

NetworkRule parse_rule(const json& value, const std::string& field) {
    NetworkRule rule;
    if (value.is_string()) {
        rule.host = parse_host(value, field);
        return rule;
    }
    if (!value.is_object()) {
        invalid(field, "must be a host (string) or an object {host, ports?, protocol?}");
    }
    if (!value.contains("host")) invalid(field + ".host", "is required");
    for (const auto& [key, v] : value.items()) {
        if (key == "host") {
            rule.host = parse_host(v, field + ".host");
        } else if (key == "ports") {
            rule.ports = parse_ports(v, field + ".ports");
        } else if (key == "protocol") {
            if (v == "tcp") {
                rule.protocol = rule_protocol::tcp;
            } else if (v == "udp") {
                rule.protocol = rule_protocol::udp;
            } else {
                invalid(field + ".protocol", "must be \"tcp\" or \"udp\"");
            }
        } else {
            invalid(member(field, key), "unknown key (host, ports, protocol)");
        }
    }
    return rule;
}

std::vector<NetworkRule> parse_rules(const json& value, const std::string& field) {
    if (!value.is_array()) invalid(field, "must be an array of rules");
    if (value.size() > max_rules) {
        invalid(field, std::to_string(value.size()) + " rules, more than the " +
                           std::to_string(max_rules) + " a policy may have");
    }
    std::vector<NetworkRule> rules;
    rules.reserve(value.size());
    for (std::size_t i = 0; i < value.size(); ++i) {
        rules.push_back(parse_rule(value[i], field + "[" + std::to_string(i) + "]"));
    }
    return rules;
}

std::string host_text(const RuleHost& host) {
    if (const auto* name = std::get_if<DomainName>(&host)) {
        return (name->subdomains ? "*." : "") + name->name;
    }
    if (const auto* v4 = std::get_if<ip::network_v4>(&host)) {
        return v4->prefix_length() == 32 ? v4->address().to_string() : v4->to_string();
    }
    const auto& v6 = std::get<ip::network_v6>(host);
    return v6.prefix_length() == 128 ? v6.address().to_string() : v6.to_string();
}

json rule_json(const NetworkRule& rule) {
    json out = {{"host", host_text(rule.host)}};
    if (!rule.ports.empty()) {
        json ports = json::array();
        for (const auto& r : rule.ports) {
            if (r.first == r.last) {
                ports.push_back(r.first);
            } else {
                ports.push_back(std::to_string(r.first) + "-" + std::to_string(r.last));
            }
        }
        out["ports"] = std::move(ports);
    }
    if (rule.protocol != rule_protocol::any) {
        out["protocol"] = rule.protocol == rule_protocol::tcp ? "tcp" : "udp";
    }
    return out;
}

}  // namespace

NetworkPolicy parse_network_policy(const json& value, const std::string& field) {
    NetworkPolicy policy;
    if (value.is_boolean()) {
        policy.mode = value.get<bool>() ? network_mode::egress : network_mode::none;
        return policy;
    }
    if (!value.is_object()) {
        invalid(field, "must be an object {mode, allow?, deny?} (or the old boolean)");
    }
    const auto mode = value.find("mode");
    if (mode == value.end()) invalid(field + ".mode", "is required (\"none\" or \"egress\")");
    if (*mode == "none") {
        policy.mode = network_mode::none;
    } else if (*mode == "egress") {
        policy.mode = network_mode::egress;
    } else {
        invalid(field + ".mode", "must be \"none\" or \"egress\"");
    }
    for (const auto& [key, v] : value.items()) {
        if (key == "mode") continue;
        if (key != "allow" && key != "deny") {
            invalid(member(field, key), "unknown key (mode, allow, deny)");
        }
        if (policy.mode == network_mode::none) {
            invalid(member(field, key), "takes no rules under mode \"none\"");
        }
        (key == "allow" ? policy.allow : policy.deny) = parse_rules(v, member(field, key));
    }
    return policy;
}

json to_json(const NetworkPolicy& policy) {
    json out = {{"mode", policy.mode == network_mode::egress ? "egress" : "none"}};
    json allow = json::array(), deny = json::array();
    for (const auto& r : policy.allow) allow.push_back(rule_json(r));
    for (const auto& r : policy.deny) deny.push_back(rule_json(r));
    out["allow"] = std::move(allow);
    out["deny"] = std::move(deny);
    return out;
}

}  // namespace sandboxd::detail
