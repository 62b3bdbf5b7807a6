#include <sandboxd/core/config.hpp>

#include "core/config_keys.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/json_limits.hpp>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/network_v4.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace sandboxd {
namespace {

using json = nlohmann::json;
using config_keys::fail;

// The cross-field rules, and the checks of a value's form that its type and range cannot
// state, one function each. validate_config runs them in this order, which decides which of
// two errors a config gets.

void check_listen_and_state_dir(const Config& c) {
    try {
        parse_host_port(c.listen);
    } catch (const address_error& e) {
        fail("listen", e.what());
    }
    if (!c.advertise_url.empty() && c.advertise_url.rfind("ws://", 0) != 0 &&
        c.advertise_url.rfind("wss://", 0) != 0) {
        fail("advertiseUrl", "must start with ws:// or wss://");
    }
    if (c.state_dir.empty()) fail("stateDir", "must not be empty");
}

void check_listener_tls(const Config& c) {
    if (c.tls.enabled() != !c.tls.key_file.empty()) {
        fail(c.tls.enabled() ? "tls.keyFile" : "tls.certFile",
             "tls.certFile and tls.keyFile go together");
    }
    if (!c.tls.enabled() && !c.tls.client_ca_file.empty()) {
        fail("tls.clientCaFile", "needs tls.certFile and tls.keyFile");
    }
}

/// plainListen is served beside a TLS listen, and only on a loopback address.
void check_plain_listen(const Config& c) {
    if (c.plain_listen.empty()) return;
    if (!c.tls.enabled()) {
        fail("plainListen", "is served beside a TLS listen: set tls.certFile and tls.keyFile");
    }
    HostPort plain;
    try {
        plain = parse_host_port(c.plain_listen);
    } catch (const address_error& e) {
        fail("plainListen", e.what());
    }
    boost::system::error_code ec;
    const auto addr = boost::asio::ip::make_address(plain.host, ec);
    if (plain.host != "localhost" && (ec || !addr.is_loopback())) {
        fail("plainListen", "must be a loopback address (127.0.0.0/8 or [::1]), got \"" +
                                c.plain_listen + "\": plain text must not leave the host");
    }
}

void check_advertise_url_with_tls(const Config& c) {
    if (c.tls.enabled() && c.advertise_url.rfind("ws://", 0) == 0) {
        fail("advertiseUrl", "must start with wss:// when tls is set");
    }
}

/// routing.peerTls and registry.tls: a certificate and its key go together; peer TLS needs
/// the cluster CA, a certificate and TLS on the listener.
void check_tls_files(const Config& c) {
    using Named = std::pair<std::string, const TlsFilesConfig*>;
    for (const auto& [field, t] :
         {Named{"routing.peerTls", &c.peer_tls}, Named{"registry.tls", &c.registry.tls}}) {
        if (t->cert_file.empty() != t->key_file.empty()) {
            std::string why = field;
            why.append(".certFile and ").append(field).append(".keyFile go together");
            fail(field + (t->cert_file.empty() ? ".certFile" : ".keyFile"), why);
        }
    }
    if (!c.peer_tls.empty()) {
        if (c.peer_tls.ca_file.empty()) {
            fail("routing.peerTls.caFile", "the cluster CA is required");
        }
        if (c.peer_tls.cert_file.empty()) {
            fail("routing.peerTls.certFile", "a node presents a certificate to its peers");
        }
        if (!c.tls.enabled()) {
            fail("routing.peerTls", "needs tls on the listener (peers connect with wss://)");
        }
    }
}

/// Each default within its cap, the enforced ones always set; and a cap without a default
/// would let a lease that asks for nothing go uncapped.
void check_bwrap_limits(const LeaseLimits& d, const LeaseLimits& m) {
    auto check = [](const char* key, const auto& def, const auto& max, bool required) {
        const std::string path = std::string("providers.bwrap.limits.defaults.") + key;
        if (required && !def) fail(path, "must be set");
        if (def && max && *def > *max) {
            fail(path, "must not exceed providers.bwrap.limits.max." + std::string(key) + " (" +
                           std::to_string(*max) + ")");
        }
    };
    check("memoryBytes", d.memory_bytes, m.memory_bytes, true);
    check("pids", d.pids, m.pids, true);
    check("cpuWeight", d.cpu_weight, m.cpu_weight, true);
    check("cpuQuotaPercent", d.cpu_quota_percent, m.cpu_quota_percent, false);
    check("diskBytes", d.disk_bytes, m.disk_bytes, true);
    check("openFiles", d.open_files, m.open_files, true);
    check("ioReadBps", d.io_read_bps, m.io_read_bps, false);
    check("ioWriteBps", d.io_write_bps, m.io_write_bps, false);
    check("ioReadIops", d.io_read_iops, m.io_read_iops, false);
    check("ioWriteIops", d.io_write_iops, m.io_write_iops, false);
    check("ioWeight", d.io_weight, m.io_weight, false);
    check("egressBps", d.egress_bps, m.egress_bps, false);
    auto capped = [](const char* key, bool def, bool max) {
        if (max && !def) {
            fail(std::string("providers.bwrap.limits.defaults.") + key,
                 std::string("must be set when providers.bwrap.limits.max.") + key + " is");
        }
    };
    capped("cpuQuotaPercent", d.cpu_quota_percent.has_value(), m.cpu_quota_percent.has_value());
    capped("ioReadBps", d.io_read_bps.has_value(), m.io_read_bps.has_value());
    capped("ioWriteBps", d.io_write_bps.has_value(), m.io_write_bps.has_value());
    capped("ioReadIops", d.io_read_iops.has_value(), m.io_read_iops.has_value());
    capped("ioWriteIops", d.io_write_iops.has_value(), m.io_write_iops.has_value());
    capped("ioWeight", d.io_weight.has_value(), m.io_weight.has_value());
    capped("egressBps", d.egress_bps.has_value(), m.egress_bps.has_value());
}

void check_bwrap_identity_and_etc(const BwrapConfig& b) {
    const auto& id = b.identity;
    if (std::uint64_t{id.host_id_first} + id.host_id_count > 0xFFFFFFFFULL) {
        fail("providers.bwrap.identity.hostIdCount", "the range must end below 4294967295");
    }
    for (const auto& e : b.etc_files) {
        if (e.empty() || e.front() == '/' || e.find("..") != std::string::npos) {
            fail("providers.bwrap.etcFiles",
                 "entries are relative paths under /etc, got \"" + e + "\"");
        }
    }
}

std::optional<std::uint16_t> parse_port(const std::string& text) {
    if (text.empty() || text.size() > 5 ||
        !std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
        return std::nullopt;
    }
    const unsigned long n = std::stoul(text);
    if (n == 0 || n > 65535) return std::nullopt;
    return static_cast<std::uint16_t>(n);
}

void check_bwrap_network(const BwrapNetworkConfig& n) {
    const std::string base = "providers.bwrap.network.";
    boost::system::error_code ec;
    const auto pool = boost::asio::ip::make_network_v4(n.pool, ec);
    if (ec || pool.canonical() != pool) {
        fail(base + "pool", "must be an IPv4 CIDR with its host bits zero, got \"" + n.pool + "\"");
    }
    if (pool.prefix_length() < 8 || pool.prefix_length() > 28) {
        fail(base + "pool", "must be a /8 to a /28, got /" + std::to_string(pool.prefix_length()));
    }
    if (n.uplink.size() >= 16 || n.uplink.find_first_of("\"*/ ") != std::string::npos) {
        fail(base + "uplink",
             "must be an interface name (at most 15 characters), got \"" + n.uplink + "\"");
    }
    auto cidrs = [&](const std::vector<std::string>& list, const std::string& key) {
        for (std::size_t i = 0; i < list.size(); ++i) {
            const std::string& text = list[i];
            boost::system::error_code e;
            if (text.find('/') == std::string::npos) {
                boost::asio::ip::make_address_v4(text, e);
            } else {
                auto net = boost::asio::ip::make_network_v4(text, e);
                if (!e && net.canonical() != net) e = boost::asio::error::invalid_argument;
            }
            if (e) {
                fail(base + key + "[" + std::to_string(i) + "]",
                     "must be an IPv4 address or CIDR (host bits zero), got \"" + text + "\"");
            }
        }
    };
    cidrs(n.deny, "deny");
    cidrs(n.open, "open");
    for (std::size_t i = 0; i < n.dns.size(); ++i) {
        if (!parse_dns_server(n.dns[i])) {
            fail(base + "dns[" + std::to_string(i) + "]",
                 "must be ADDRESS, ADDRESS:PORT or [IPv6]:PORT, got \"" + n.dns[i] + "\"");
        }
    }
    for (const auto& [key, value] : n.defaults.items()) {
        std::string path = base + "defaults.";
        path += key;
        if (key != "allow" && key != "deny") fail(path, "unknown key");
        if (!value.is_array()) fail(path, "must be an array of rules");
    }
}

void check_heartbeat(const Config& c) {
    if (std::uint64_t{c.heartbeat_ms} * 3 > c.node_ttl_ms) {
        // A node fences itself when it has not renewed for 2/3 of the TTL: it must get at
        // least two tries within that time.
        fail("routing.heartbeatMs", "must be at most a third of routing.nodeTtlMs (" +
                                        std::to_string(c.node_ttl_ms) + "), got " +
                                        std::to_string(c.heartbeat_ms));
    }
}

void check_registry(const RegistryConfig& r) {
    if (r.kind == "etcd" && r.endpoints.empty()) {
        fail("registry.endpoints", "etcd needs at least one endpoint");
    }
    for (std::size_t i = 0; i < r.endpoints.size(); ++i) {
        try {
            parse_http_endpoint(r.endpoints[i]);
        } catch (const address_error& e) {
            fail("registry.endpoints[" + std::to_string(i) + "]", e.what());
        }
    }
    if (r.username.empty() != r.password_file.empty()) {
        fail(r.username.empty() ? "registry.username" : "registry.passwordFile",
             "registry.username and registry.passwordFile go together");
    }
}

/// A token is named, holds exactly one of token and tokenFile, and names its tenants; only a
/// peer token is bound to a node.
void check_tokens(const std::vector<TokenConfig>& tokens) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        const auto& t = tokens[i];
        const std::string p = "auth.tokens[" + std::to_string(i) + "]";
        if (t.name.empty()) fail(p + ".name", "must not be empty");
        if (t.token.empty() == t.token_file.empty()) {
            fail(p, "needs exactly one of token or tokenFile");
        }
        if (t.tenants.empty()) fail(p + ".tenants", "must list at least one companyId or \"*\"");
        if (!t.node_id.empty() && t.role != "peer") {
            fail(p + ".nodeId", "binds a peer token to a node; this token has role " + t.role);
        }
    }
}

void check_plugins(const std::vector<PluginConfig>& plugins) {
    for (std::size_t i = 0; i < plugins.size(); ++i) {
        const auto& pl = plugins[i];
        const std::string p = "providers.plugins[" + std::to_string(i) + "]";
        if (pl.plugin_id.empty()) fail(p + ".pluginId", "must not be empty");
        if (pl.provider.empty()) fail(p + ".provider", "must not be empty");
        if (pl.command.empty()) fail(p + ".command", "must not be empty");
    }
}

/// Each default within its maximum, each share within its whole.
void check_limits(const LimitsConfig& l) {
    if (l.default_ttl_ms > l.max_ttl_ms) {
        fail("limits.defaultTtlMs", "must not exceed limits.maxTtlMs");
    }
    if (l.output_window > l.max_output_window) {
        fail("limits.outputWindow", "must not exceed limits.maxOutputWindow");
    }
    if (l.stdin_window > l.max_stdin_window) {
        fail("limits.stdinWindow", "must not exceed limits.maxStdinWindow");
    }
    if (l.detach_retain_ms > l.max_detach_retain_ms) {
        fail("limits.detachRetainMs", "must not exceed limits.maxDetachRetainMs");
    }
    if (l.detach_retain_bytes > l.max_detach_retain_bytes) {
        fail("limits.detachRetainBytes", "must not exceed limits.maxDetachRetainBytes");
    }
    if (l.detach_kept_bytes_per_lease < 2 * l.detach_retain_bytes) {
        fail("limits.detachKeptBytesPerLease",
             "must be at least twice limits.detachRetainBytes (a default open keeps both streams)");
    }
    if (l.send_queue_bytes_per_connection > l.send_queue_bytes) {
        fail("limits.sendQueueBytesPerConnection", "must not exceed limits.sendQueueBytes");
    }
    if (l.pending_connections > l.connections) {
        fail("limits.pendingConnections", "must not exceed limits.connections");
    }
}

void check_metrics_public(const Config& c) {
    if (c.metrics_public && c.plain_listen.empty()) {
        fail("metrics.public",
             "opens GET /metrics on plainListen only; set plainListen (a loopback address)");
    }
}

void check_data_payload(const LimitsConfig& l) {
    if (l.max_data_payload > l.max_text_message * 16ULL) {
        fail("limits.maxDataPayload", "must not exceed 16 times limits.maxTextMessage");
    }
}

/// Text in a Markdown table cell: `|` would end the cell, `<` open an HTML tag (`<stateDir>`),
/// `*` emphasis. In a code span (IN_CODE) only `|` is special.
std::string cell(const std::string& text, bool in_code = false) {
    std::string out;
    for (const char ch : text) {
        if (ch == '|' || (!in_code && (ch == '<' || ch == '*'))) out += '\\';
        out += ch;
    }
    return out;
}

std::string code(const std::string& text) {
    return text.empty() ? "" : "`" + cell(text, true) + "`";
}

}  // namespace

Config parse_config(std::string_view text) {
    json j;
    try {
        j = parse_json(text, {.ignore_comments = true});  // nested deeper than 64: parse_error
    } catch (const json::exception& e) {
        // parse_error, and out_of_range for a number beyond a double (1e999): found by fuzzing.
        throw config_error(std::string("config: not valid JSON: ") + e.what());
    }
    Config c;
    config_keys::read(j, c);
    validate_config(c);
    return c;
}

Config load_config_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw config_error("config: cannot read " + path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return parse_config(ss.str());
}

void validate_config(const Config& c) {
    check_listen_and_state_dir(c);
    check_listener_tls(c);
    check_plain_listen(c);
    check_advertise_url_with_tls(c);
    check_tls_files(c);
    check_bwrap_limits(c.bwrap.limits.defaults, c.bwrap.limits.max);
    check_bwrap_identity_and_etc(c.bwrap);
    check_bwrap_network(c.bwrap.network);
    check_heartbeat(c);
    check_registry(c.registry);
    check_tokens(c.tokens);
    check_plugins(c.plugins);
    check_limits(c.limits);
    check_metrics_public(c);
    check_data_payload(c.limits);
}

std::optional<boost::asio::ip::udp::endpoint> parse_dns_server(const std::string& text) {
    boost::system::error_code ec;
    std::string host = text;
    std::uint16_t port = 53;
    if (!text.empty() && text.front() == '[') {
        const auto close = text.find(']');
        if (close == std::string::npos) return std::nullopt;
        host = text.substr(1, close - 1);
        const std::string rest = text.substr(close + 1);
        if (!rest.empty()) {
            if (rest.size() < 2 || rest[0] != ':') return std::nullopt;
            const auto p = parse_port(rest.substr(1));
            if (!p) return std::nullopt;
            port = *p;
        }
    } else if (const auto colon = text.find(':');
               colon != std::string::npos && text.find(':', colon + 1) == std::string::npos) {
        host = text.substr(0, colon);
        const auto p = parse_port(text.substr(colon + 1));
        if (!p) return std::nullopt;
        port = *p;
    }
    const auto address = boost::asio::ip::make_address(host, ec);
    if (ec) return std::nullopt;
    return boost::asio::ip::udp::endpoint(address, port);
}

nlohmann::json config_to_json(const Config& c) { return config_keys::write(c); }

std::string default_config_text() { return config_to_json(Config{}).dump(2) + "\n"; }

std::vector<std::string> config_restart_changes(const Config& running, const Config& next) {
    return config_keys::restart_changes(running, next);
}

std::vector<std::string> config_restart_sections(const Config& running, const Config& next) {
    std::vector<std::string> sections;
    for (const auto& key : config_keys::restart_changes(running, next)) {
        sections.push_back(key.substr(0, key.find('.')));
    }
    std::sort(sections.begin(), sections.end());
    sections.erase(std::unique(sections.begin(), sections.end()), sections.end());
    return sections;
}

std::string config_reference_markdown() {
    std::string out =
        "# Configuration reference\n\n"
        "Generated by `sandboxd --print-config-reference` from the config's key table "
        "(src/core/config_keys.cpp); do not edit by hand. config/sandboxd.jsonc explains each "
        "key at length. Every key is optional; an unknown key, a wrong type or a value out of "
        "range stops the start naming the key. Reloadable: a reload (SIGHUP) applies a "
        "change; a change to any other key is logged as not applied until a restart.\n\n"
        "| Key | Type | Default | Range | Reloadable | Description |\n"
        "|---|---|---|---|---|---|\n";
    for (const auto& row : config_keys::reference_rows()) {
        out += "| " + code(row.key) + " | " + cell(row.type) + " | " + code(row.default_value) +
               " | " + cell(row.range) + " | " + (row.reloadable ? "yes" : "no") + " | " +
               cell(row.doc) + " |\n";
    }
    return out;
}

}  // namespace sandboxd
