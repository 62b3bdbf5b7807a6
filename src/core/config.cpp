#include <sandboxd/core/config.hpp>

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/json_limits.hpp>

#include <boost/asio/ip/address.hpp>

#include <fstream>
#include <set>
#include <sstream>

namespace sandboxd {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& why) {
    throw config_error("config: " + path + ": " + why);
}

/// Walks one JSON object, remembering which keys were read, so that unknown ones can be
/// reported by their full path.
class Obj {
public:
    Obj(const json& j, std::string path) : j_(j), path_(std::move(path)) {
        if (!j_.is_object()) fail(path_.empty() ? "(top level)" : path_, "must be an object");
    }
    ~Obj() = default;
    Obj(const Obj&) = delete;
    Obj& operator=(const Obj&) = delete;

    std::string sub(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
    const json* get(const std::string& key) {
        seen_.insert(key);
        auto it = j_.find(key);
        return it == j_.end() ? nullptr : &*it;
    }
    void str(const std::string& key, std::string& out) {
        if (const auto* v = get(key)) {
            if (!v->is_string()) fail(sub(key), "must be a string");
            out = v->get<std::string>();
        }
    }
    void boolean(const std::string& key, bool& out) {
        if (const auto* v = get(key)) {
            if (!v->is_boolean()) fail(sub(key), "must be true or false");
            out = v->get<bool>();
        }
    }
    template <typename T>
    void integer(const std::string& key, T& out, std::uint64_t lo, std::uint64_t hi) {
        if (const auto* v = get(key)) {
            if (!v->is_number_integer() || (v->is_number_integer() && !v->is_number_unsigned() &&
                                            v->get<std::int64_t>() < 0)) {
                fail(sub(key), "must be an integer in " + std::to_string(lo) + ".." +
                                   std::to_string(hi));
            }
            auto n = v->get<std::uint64_t>();
            if (n < lo || n > hi) {
                fail(sub(key), "must be an integer in " + std::to_string(lo) + ".." +
                                   std::to_string(hi) + ", got " + std::to_string(n));
            }
            out = static_cast<T>(n);
        }
    }
    void strings(const std::string& key, std::vector<std::string>& out) {
        if (const auto* v = get(key)) {
            if (!v->is_array()) fail(sub(key), "must be an array of strings");
            out.clear();
            for (std::size_t i = 0; i < v->size(); ++i) {
                if (!(*v)[i].is_string()) {
                    fail(sub(key) + "[" + std::to_string(i) + "]", "must be a string");
                }
                out.push_back((*v)[i].get<std::string>());
            }
        }
    }
    void one_of(const std::string& key, std::string& out, std::initializer_list<const char*> allowed) {
        str(key, out);
        if (j_.contains(key)) {
            for (const char* a : allowed) {
                if (out == a) return;
            }
            std::string list;
            for (const char* a : allowed) list += std::string(list.empty() ? "" : ", ") + a;
            fail(sub(key), "must be one of " + list + ", got \"" + out + "\"");
        }
    }
    /// Throws for the first key that no reader asked for.
    void done() const {
        for (const auto& [key, value] : j_.items()) {
            if (!seen_.count(key)) fail(sub(key), "unknown key");
        }
    }

private:
    const json& j_;
    std::string path_;
    std::set<std::string> seen_;
};

/// One `LeaseLimits` object; null clears a key (no default, or no cap).
void parse_lease_limits(Obj& o, LeaseLimits& l) {
    auto one = [&o](const char* key, auto& out, std::uint64_t lo, std::uint64_t hi) {
        const auto* v = o.get(key);
        if (v == nullptr) return;
        if (v->is_null()) {
            out.reset();
            return;
        }
        typename std::remove_reference_t<decltype(out)>::value_type value{};
        o.integer(key, value, lo, hi);
        out = value;
    };
    one("memoryBytes", l.memory_bytes, 16ULL << 20, 1ULL << 50);
    one("pids", l.pids, 8, 4194304);
    one("cpuWeight", l.cpu_weight, 1, 10000);
    one("cpuQuotaPercent", l.cpu_quota_percent, 1, 100000);
    one("diskBytes", l.disk_bytes, 8ULL << 20, 1ULL << 40);
    one("openFiles", l.open_files, 16, 1048576);
    one("ioReadBps", l.io_read_bps, 65536, 1ULL << 40);
    one("ioWriteBps", l.io_write_bps, 65536, 1ULL << 40);
    one("ioReadIops", l.io_read_iops, 16, 10000000);
    one("ioWriteIops", l.io_write_iops, 16, 10000000);
    one("ioWeight", l.io_weight, 1, 10000);
    o.done();
}

nlohmann::json lease_limits_json(const LeaseLimits& l) {
    auto v = [](const auto& opt) { return opt ? nlohmann::json(*opt) : nlohmann::json(nullptr); };
    return {{"memoryBytes", v(l.memory_bytes)}, {"pids", v(l.pids)},
            {"cpuWeight", v(l.cpu_weight)},     {"cpuQuotaPercent", v(l.cpu_quota_percent)},
            {"diskBytes", v(l.disk_bytes)},     {"openFiles", v(l.open_files)},
            {"ioReadBps", v(l.io_read_bps)},    {"ioWriteBps", v(l.io_write_bps)},
            {"ioReadIops", v(l.io_read_iops)},  {"ioWriteIops", v(l.io_write_iops)},
            {"ioWeight", v(l.io_weight)}};
}

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = 1024 * kib;
constexpr std::uint64_t gib = 1024 * mib;

void parse_limits(Obj& o, LimitsConfig& l) {
    o.integer("maxTextMessage", l.max_text_message, kib, 64 * mib);
    o.integer("maxDataPayload", l.max_data_payload, kib, 16 * mib);
    o.integer("channelsPerConnection", l.channels_per_connection, 1, 1 << 20);
    o.integer("channelsPerNode", l.channels_per_node, 1, 1 << 20);
    o.integer("requestsPerConnection", l.requests_per_connection, 1, 1 << 16);
    o.integer("outputWindow", l.output_window, kib, gib);
    o.integer("stdinWindow", l.stdin_window, kib, gib);
    o.integer("maxOutputWindow", l.max_output_window, kib, gib);
    o.integer("maxStdinWindow", l.max_stdin_window, kib, gib);
    o.integer("sendQueueBytes", l.send_queue_bytes, 64 * kib, 64 * gib);
    o.integer("sendQueueBytesPerConnection", l.send_queue_bytes_per_connection, 64 * kib, 64 * gib);
    o.integer("sendStallTimeoutMs", l.send_stall_timeout_ms, 1000, 86400000);
    o.integer("connections", l.connections, 1, 1 << 20);
    o.integer("pendingConnections", l.pending_connections, 1, 1 << 20);
    o.integer("authTimeoutMs", l.auth_timeout_ms, 100, 600000);
    o.integer("pingIntervalMs", l.ping_interval_ms, 100, 3600000);
    o.integer("idleTimeoutMs", l.idle_timeout_ms, 300, 3 * 3600000);
    o.integer("drainGraceMs", l.drain_grace_ms, 0, 60000);
    o.integer("hangupGraceMs", l.hangup_grace_ms, 0, 5000);
    o.integer("drainTimeoutMs", l.drain_timeout_ms, 0, 3600000);
    o.integer("defaultTtlMs", l.default_ttl_ms, 1000, 365ULL * 24 * 3600000);
    o.integer("maxTtlMs", l.max_ttl_ms, 1000, 365ULL * 24 * 3600000);
    o.integer("executeOutputBytes", l.execute_output_bytes, kib, 64 * mib);
    o.integer("executeTimeoutMs", l.execute_timeout_ms, 1, 86400000);
    o.integer("retainedTtlMs", l.retained_ttl_ms, 1000, 365ULL * 24 * 3600000);
    o.done();
}

void parse_token(Obj& o, TokenConfig& t) {
    o.str("name", t.name);
    o.str("token", t.token);
    o.str("tokenFile", t.token_file);
    o.one_of("role", t.role, {"host", "peer", "metrics"});
    o.strings("tenants", t.tenants);
    o.str("nodeId", t.node_id);
    o.done();
}

}  // namespace

const std::vector<std::string>& plugin_timeout_methods() {
    static const std::vector<std::string> methods = {
        "initialize",          "health",
        "shutdown",            "environmentAcquireLease",
        "environmentResumeLease", "environmentReleaseLease",
        "environmentDestroyLease", "duplexChannelOpen",
        "duplexChannelWrite",  "duplexChannelStop",
        "duplexChannelClose",  "duplexChannelCloseStdin",
        "duplexChannelSignal", "duplexChannelResize"};
    return methods;
}

namespace {

void parse_plugin(Obj& o, PluginConfig& p) {
    o.str("pluginId", p.plugin_id);
    o.str("provider", p.provider);
    o.strings("command", p.command);
    if (const auto* env = o.get("env")) {
        if (!env->is_object()) fail(o.sub("env"), "must be an object of strings");
        for (const auto& [k, v] : env->items()) {
            if (!v.is_string()) fail(o.sub("env") + "." + k, "must be a string");
            p.env[k] = v.get<std::string>();
        }
    }
    o.str("manifest", p.manifest);
    if (const auto* cfg = o.get("config")) {
        if (!cfg->is_object()) fail(o.sub("config"), "must be an object");
        p.config = *cfg;
    }
    if (const auto* t = o.get("timeoutsMs")) {
        Obj to(*t, o.sub("timeoutsMs"));
        for (const auto& method : plugin_timeout_methods()) {
            std::uint64_t ms = 0;
            if (!t->contains(method)) continue;
            to.integer(method, ms, 1, 86400000);
            p.timeouts_ms[method] = ms;
        }
        to.done();
    }
    if (const auto* c = o.get("cleanup")) {
        Obj co(*c, o.sub("cleanup"));
        co.integer("attempts", p.cleanup.attempts, 1, 1000);
        co.integer("backoffMs", p.cleanup.backoff_ms, 1, 86400000);
        co.integer("slowRetryMs", p.cleanup.slow_retry_ms, 1, 86400000);
        co.done();
    }
    o.integer("maxBufferedBytes", p.max_buffered_bytes, 64ULL << 10, 1ULL << 30);
    o.done();
}

void parse_tls_files(Obj& o, TlsFilesConfig& t) {
    o.str("caFile", t.ca_file);
    o.str("certFile", t.cert_file);
    o.str("keyFile", t.key_file);
    o.done();
}

void parse_top(const json& j, Config& c) {
    Obj top(j, "");
    top.str("nodeId", c.node_id);
    top.str("listen", c.listen);
    top.str("advertiseUrl", c.advertise_url);
    if (const auto* t = top.get("tls")) {
        Obj o(*t, "tls");
        o.str("certFile", c.tls.cert_file);
        o.str("keyFile", c.tls.key_file);
        o.str("clientCaFile", c.tls.client_ca_file);
        o.one_of("minVersion", c.tls.min_version, {"1.2", "1.3"});
        o.done();
    }
    top.str("plainListen", c.plain_listen);
    top.str("stateDir", c.state_dir);
    top.integer("threads", c.threads, 0, 256);
    if (const auto* r = top.get("registry")) {
        Obj o(*r, "registry");
        o.one_of("kind", c.registry.kind, {"sqlite", "etcd"});
        o.str("path", c.registry.path);
        o.strings("endpoints", c.registry.endpoints);
        o.str("prefix", c.registry.prefix);
        o.str("username", c.registry.username);
        o.str("passwordFile", c.registry.password_file);
        o.integer("startupTimeoutMs", c.registry.startup_timeout_ms, 0, 3600000);
        if (const auto* t = o.get("tls")) {
            Obj to(*t, "registry.tls");
            parse_tls_files(to, c.registry.tls);
        }
        o.done();
    }
    if (const auto* a = top.get("auth")) {
        Obj o(*a, "auth");
        if (const auto* tokens = o.get("tokens")) {
            if (!tokens->is_array()) fail("auth.tokens", "must be an array");
            for (std::size_t i = 0; i < tokens->size(); ++i) {
                Obj t((*tokens)[i], "auth.tokens[" + std::to_string(i) + "]");
                c.tokens.emplace_back();
                parse_token(t, c.tokens.back());
            }
        }
        o.done();
    }
    if (const auto* r = top.get("routing")) {
        Obj o(*r, "routing");
        o.one_of("mode", c.routing_mode, {"proxy", "redirect"});
        o.integer("nodeTtlMs", c.node_ttl_ms, 1000, 600000);
        o.integer("heartbeatMs", c.heartbeat_ms, 100, 60000);
        if (const auto* t = o.get("peerTls")) {
            Obj to(*t, "routing.peerTls");
            parse_tls_files(to, c.peer_tls);
        }
        o.done();
    }
    if (const auto* p = top.get("providers")) {
        Obj o(*p, "providers");
        if (const auto* b = o.get("bwrap")) {
            Obj bo(*b, "providers.bwrap");
            bo.boolean("enabled", c.bwrap.enabled);
            bo.str("path", c.bwrap.path);
            bo.str("initPath", c.bwrap.init_path);
            bo.boolean("allowNetwork", c.bwrap.allow_network);
            if (const auto* lim = bo.get("limits")) {
                Obj lo(*lim, "providers.bwrap.limits");
                lo.boolean("enforce", c.bwrap.limits.enforce);
                lo.integer("overcommit", c.bwrap.limits.overcommit, 1, 1000);
                if (const auto* d = lo.get("defaults")) {
                    Obj dobj(*d, "providers.bwrap.limits.defaults");
                    parse_lease_limits(dobj, c.bwrap.limits.defaults);
                }
                if (const auto* m = lo.get("max")) {
                    Obj mobj(*m, "providers.bwrap.limits.max");
                    parse_lease_limits(mobj, c.bwrap.limits.max);
                }
                lo.done();
            }
            if (const auto* id = bo.get("identity")) {
                Obj io(*id, "providers.bwrap.identity");
                auto& ic = c.bwrap.identity;
                io.integer("hostIdFirst", ic.host_id_first, 1, 0xFFFFFFFEULL);
                io.integer("hostIdCount", ic.host_id_count, 1, 0xFFFFFFFEULL);
                io.integer("insideUid", ic.inside_uid, 0, 0xFFFFFFFEULL);
                io.integer("insideGid", ic.inside_gid, 0, 0xFFFFFFFEULL);
                io.str("lockFile", ic.lock_file);
                io.done();
            }
            bo.strings("etcFiles", c.bwrap.etc_files);
            bo.done();
        }
        if (const auto* n = o.get("noop")) {
            Obj no(*n, "providers.noop");
            no.boolean("enabled", c.noop_provider);
            no.done();
        }
        if (const auto* pl = o.get("plugins")) {
            if (!pl->is_array()) fail("providers.plugins", "must be an array");
            for (std::size_t i = 0; i < pl->size(); ++i) {
                Obj po((*pl)[i], "providers.plugins[" + std::to_string(i) + "]");
                c.plugins.emplace_back();
                parse_plugin(po, c.plugins.back());
            }
        }
        o.done();
    }
    if (const auto* l = top.get("limits")) {
        Obj o(*l, "limits");
        parse_limits(o, c.limits);
    }
    if (const auto* l = top.get("log")) {
        Obj o(*l, "log");
        o.one_of("level", c.log_level,
                 {"trace", "debug", "info", "warn", "error", "critical", "off"});
        o.one_of("format", c.log_format, {"text", "json"});
        o.done();
    }
    if (const auto* a = top.get("audit")) {
        Obj o(*a, "audit");
        o.str("file", c.audit_file);
        o.boolean("journald", c.audit_journald);
        o.done();
    }
    if (const auto* m = top.get("metrics")) {
        Obj o(*m, "metrics");
        o.boolean("public", c.metrics_public);
        o.done();
    }
    if (const auto* k = top.get("console")) {
        Obj o(*k, "console");
        o.boolean("enabled", c.console_enabled);
        o.str("assetsDir", c.console_assets_dir);
        o.done();
    }
    top.done();
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
    parse_top(j, c);
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
    if (c.tls.enabled() != !c.tls.key_file.empty()) {
        fail(c.tls.enabled() ? "tls.keyFile" : "tls.certFile", "tls.certFile and tls.keyFile go together");
    }
    if (!c.tls.enabled() && !c.tls.client_ca_file.empty()) {
        fail("tls.clientCaFile", "needs tls.certFile and tls.keyFile");
    }
    if (!c.plain_listen.empty()) {
        if (!c.tls.enabled()) fail("plainListen", "is served beside a TLS listen: set tls.certFile and tls.keyFile");
        HostPort plain;
        try {
            plain = parse_host_port(c.plain_listen);
        } catch (const address_error& e) {
            fail("plainListen", e.what());
        }
        boost::system::error_code ec;
        const auto addr = boost::asio::ip::make_address(plain.host, ec);
        if (plain.host != "localhost" && (ec || !addr.is_loopback())) {
            fail("plainListen", "must be a loopback address (127.0.0.0/8 or [::1]), got \"" + c.plain_listen +
                                    "\": plain text must not leave the host");
        }
    }
    if (c.tls.enabled() && c.advertise_url.rfind("ws://", 0) == 0) {
        fail("advertiseUrl", "must start with wss:// when tls is set");
    }
    for (const auto& [field, t] : {std::pair<std::string, const TlsFilesConfig*>{"routing.peerTls", &c.peer_tls},
                                   {"registry.tls", &c.registry.tls}}) {
        if (t->cert_file.empty() != t->key_file.empty()) {
            std::string why = field;
            why.append(".certFile and ").append(field).append(".keyFile go together");
            fail(field + (t->cert_file.empty() ? ".certFile" : ".keyFile"), why);
        }
    }
    if (!c.peer_tls.empty()) {
        if (c.peer_tls.ca_file.empty()) fail("routing.peerTls.caFile", "the cluster CA is required");
        if (c.peer_tls.cert_file.empty()) fail("routing.peerTls.certFile", "a node presents a certificate to its peers");
        if (!c.tls.enabled()) fail("routing.peerTls", "needs tls on the listener (peers connect with wss://)");
    }
    {
        const auto& d = c.bwrap.limits.defaults;
        const auto& m = c.bwrap.limits.max;
        auto check = [](const char* key, const auto& def, const auto& max, bool required) {
            const std::string path = std::string("providers.bwrap.limits.defaults.") + key;
            if (required && !def) fail(path, "must be set");
            if (def && max && *def > *max) {
                fail(path, "must not exceed providers.bwrap.limits.max." + std::string(key) +
                               " (" + std::to_string(*max) + ")");
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
        // A cap without a default would let a lease that asks for nothing go uncapped.
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
        const auto& id = c.bwrap.identity;
        if (std::uint64_t{id.host_id_first} + id.host_id_count > 0xFFFFFFFFULL) {
            fail("providers.bwrap.identity.hostIdCount",
                 "the range must end below 4294967295");
        }
        for (const auto& e : c.bwrap.etc_files) {
            if (e.empty() || e.front() == '/' || e.find("..") != std::string::npos) {
                fail("providers.bwrap.etcFiles", "entries are relative paths under /etc, got \"" +
                                                     e + "\"");
            }
        }
    }
    if (std::uint64_t{c.heartbeat_ms} * 3 > c.node_ttl_ms) {
        // A node fences itself when it has not renewed for 2/3 of the TTL: it must get at
        // least two tries within that time.
        fail("routing.heartbeatMs", "must be at most a third of routing.nodeTtlMs (" +
                                        std::to_string(c.node_ttl_ms) + "), got " +
                                        std::to_string(c.heartbeat_ms));
    }
    if (c.registry.kind == "etcd" && c.registry.endpoints.empty()) {
        fail("registry.endpoints", "etcd needs at least one endpoint");
    }
    for (std::size_t i = 0; i < c.registry.endpoints.size(); ++i) {
        try {
            parse_http_endpoint(c.registry.endpoints[i]);
        } catch (const address_error& e) {
            fail("registry.endpoints[" + std::to_string(i) + "]", e.what());
        }
    }
    if (c.registry.username.empty() != c.registry.password_file.empty()) {
        fail(c.registry.username.empty() ? "registry.username" : "registry.passwordFile",
             "registry.username and registry.passwordFile go together");
    }
    for (std::size_t i = 0; i < c.tokens.size(); ++i) {
        const auto& t = c.tokens[i];
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
    for (std::size_t i = 0; i < c.plugins.size(); ++i) {
        const auto& pl = c.plugins[i];
        const std::string p = "providers.plugins[" + std::to_string(i) + "]";
        if (pl.plugin_id.empty()) fail(p + ".pluginId", "must not be empty");
        if (pl.provider.empty()) fail(p + ".provider", "must not be empty");
        if (pl.command.empty()) fail(p + ".command", "must not be empty");
    }
    if (c.limits.default_ttl_ms > c.limits.max_ttl_ms) {
        fail("limits.defaultTtlMs", "must not exceed limits.maxTtlMs");
    }
    if (c.limits.output_window > c.limits.max_output_window) {
        fail("limits.outputWindow", "must not exceed limits.maxOutputWindow");
    }
    if (c.limits.stdin_window > c.limits.max_stdin_window) {
        fail("limits.stdinWindow", "must not exceed limits.maxStdinWindow");
    }
    if (c.limits.send_queue_bytes_per_connection > c.limits.send_queue_bytes) {
        fail("limits.sendQueueBytesPerConnection", "must not exceed limits.sendQueueBytes");
    }
    if (c.limits.pending_connections > c.limits.connections) {
        fail("limits.pendingConnections", "must not exceed limits.connections");
    }
    if (c.metrics_public && c.plain_listen.empty()) {
        fail("metrics.public", "opens GET /metrics on plainListen only; set plainListen (a loopback address)");
    }
    if (c.limits.max_data_payload > c.limits.max_text_message * 16ULL) {
        fail("limits.maxDataPayload", "must not exceed 16 times limits.maxTextMessage");
    }
}

namespace {
json tls_files_json(const TlsFilesConfig& t) {
    return {{"caFile", t.ca_file}, {"certFile", t.cert_file}, {"keyFile", t.key_file}};
}
}  // namespace

nlohmann::json config_to_json(const Config& c) {
    json tokens = json::array();
    for (const auto& t : c.tokens) {
        json tj = {{"name", t.name}, {"role", t.role}, {"tenants", t.tenants}};
        if (!t.token.empty()) tj["token"] = "<redacted>";
        if (!t.token_file.empty()) tj["tokenFile"] = t.token_file;
        if (!t.node_id.empty()) tj["nodeId"] = t.node_id;
        tokens.push_back(std::move(tj));
    }
    json plugins = json::array();
    for (const auto& p : c.plugins) {
        json timeouts = json::object();
        for (const auto& [method, ms] : p.timeouts_ms) timeouts[method] = ms;
        plugins.push_back({{"pluginId", p.plugin_id},
                           {"provider", p.provider},
                           {"command", p.command},
                           {"env", p.env},
                           {"manifest", p.manifest},
                           {"config", p.config},
                           {"timeoutsMs", timeouts},
                           {"cleanup",
                            {{"attempts", p.cleanup.attempts},
                             {"backoffMs", p.cleanup.backoff_ms},
                             {"slowRetryMs", p.cleanup.slow_retry_ms}}},
                           {"maxBufferedBytes", p.max_buffered_bytes}});
    }
    const auto& l = c.limits;
    return {
        {"nodeId", c.node_id},
        {"listen", c.listen},
        {"advertiseUrl", c.advertise_url},
        {"tls",
         {{"certFile", c.tls.cert_file},
          {"keyFile", c.tls.key_file},
          {"clientCaFile", c.tls.client_ca_file},
          {"minVersion", c.tls.min_version}}},
        {"plainListen", c.plain_listen},
        {"stateDir", c.state_dir},
        {"threads", c.threads},
        {"registry",
         {{"kind", c.registry.kind},
          {"path", c.registry.path},
          {"endpoints", c.registry.endpoints},
          {"prefix", c.registry.prefix},
          {"username", c.registry.username},
          {"passwordFile", c.registry.password_file},
          {"startupTimeoutMs", c.registry.startup_timeout_ms},
          {"tls", tls_files_json(c.registry.tls)}}},
        {"auth", {{"tokens", tokens}}},
        {"routing",
         {{"mode", c.routing_mode},
          {"nodeTtlMs", c.node_ttl_ms},
          {"heartbeatMs", c.heartbeat_ms},
          {"peerTls", tls_files_json(c.peer_tls)}}},
        {"providers",
         {{"bwrap",
           {{"enabled", c.bwrap.enabled},
            {"path", c.bwrap.path},
            {"initPath", c.bwrap.init_path},
            {"allowNetwork", c.bwrap.allow_network},
            {"limits",
             {{"enforce", c.bwrap.limits.enforce},
              {"overcommit", c.bwrap.limits.overcommit},
              {"defaults", lease_limits_json(c.bwrap.limits.defaults)},
              {"max", lease_limits_json(c.bwrap.limits.max)}}},
            {"identity",
             {{"hostIdFirst", c.bwrap.identity.host_id_first},
              {"hostIdCount", c.bwrap.identity.host_id_count},
              {"insideUid", c.bwrap.identity.inside_uid},
              {"insideGid", c.bwrap.identity.inside_gid},
              {"lockFile", c.bwrap.identity.lock_file}}},
            {"etcFiles", c.bwrap.etc_files}}},
          {"noop", {{"enabled", c.noop_provider}}},
          {"plugins", plugins}}},
        {"limits",
         {{"maxTextMessage", l.max_text_message},
          {"maxDataPayload", l.max_data_payload},
          {"channelsPerConnection", l.channels_per_connection},
          {"channelsPerNode", l.channels_per_node},
          {"requestsPerConnection", l.requests_per_connection},
          {"outputWindow", l.output_window},
          {"stdinWindow", l.stdin_window},
          {"maxOutputWindow", l.max_output_window},
          {"maxStdinWindow", l.max_stdin_window},
          {"sendQueueBytes", l.send_queue_bytes},
          {"sendQueueBytesPerConnection", l.send_queue_bytes_per_connection},
          {"sendStallTimeoutMs", l.send_stall_timeout_ms},
          {"connections", l.connections},
          {"pendingConnections", l.pending_connections},
          {"authTimeoutMs", l.auth_timeout_ms},
          {"pingIntervalMs", l.ping_interval_ms},
          {"idleTimeoutMs", l.idle_timeout_ms},
          {"drainGraceMs", l.drain_grace_ms},
          {"hangupGraceMs", l.hangup_grace_ms},
          {"drainTimeoutMs", l.drain_timeout_ms},
          {"defaultTtlMs", l.default_ttl_ms},
          {"maxTtlMs", l.max_ttl_ms},
          {"executeOutputBytes", l.execute_output_bytes},
          {"executeTimeoutMs", l.execute_timeout_ms},
          {"retainedTtlMs", l.retained_ttl_ms}}},
        {"log", {{"level", c.log_level}, {"format", c.log_format}}},
        {"audit", {{"file", c.audit_file}, {"journald", c.audit_journald}}},
        {"metrics", {{"public", c.metrics_public}}},
        {"console", {{"enabled", c.console_enabled}, {"assetsDir", c.console_assets_dir}}},
    };
}

std::string default_config_text() { return config_to_json(Config{}).dump(2) + "\n"; }

}  // namespace sandboxd
