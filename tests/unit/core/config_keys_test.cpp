// Unit tests of the config's key table: every key reads back what it prints, a value out of
// range or not allowed names its key, the restart diff sees exactly the keys a reload does
// not apply, and docs/config.md is the table as generated.
#include <sandboxd/core/config.hpp>

#include "core/config_keys.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

using namespace sandboxd;
using json = nlohmann::json;

namespace {

/// A config that sets every key to a value other than its default and passes the cross-field
/// rules. The two tokens between them set every token key (token and tokenFile exclude each
/// other).
json every_key_set() {
    return json::parse(R"({
      "nodeId": "n1", "listen": "0.0.0.0:7443", "advertiseUrl": "wss://n1.example:7443/v1/ws",
      "tls": {"certFile": "/c/cert.pem", "keyFile": "/c/key.pem", "clientCaFile": "/c/ca.pem",
              "minVersion": "1.3"},
      "plainListen": "127.0.0.1:7801", "stateDir": "/srv/sandboxd", "threads": 3,
      "registry": {"kind": "etcd", "path": "/srv/r.db", "endpoints": ["https://10.0.0.5:2379"],
                   "tls": {"caFile": "/e/ca.pem", "certFile": "/e/c.pem", "keyFile": "/e/k.pem"},
                   "prefix": "/x/", "username": "u", "passwordFile": "/e/pw",
                   "startupTimeoutMs": 5},
      "auth": {"tokens": [
          {"name": "ci", "token": "s3cret", "role": "metrics", "tenants": ["acme"]},
          {"name": "peer", "tokenFile": "/t/peer", "role": "peer", "tenants": ["*"],
           "nodeId": "n2"}]},
      "routing": {"mode": "redirect", "nodeTtlMs": 30000, "heartbeatMs": 5000, "adoptGraceMs": 7000,
                  "peerTls": {"caFile": "/p/ca.pem", "certFile": "/p/c.pem",
                              "keyFile": "/p/k.pem"}},
      "providers": {
        "bwrap": {"enabled": false, "path": "/opt/bwrap", "initPath": "/opt/init",
                  "allowNetwork": true, "adoptTimeoutMs": 9000,
                  "network": {"egress": true, "pool": "10.99.0.0/16", "uplink": "eth1",
                              "deny": ["203.0.113.9"], "open": ["10.1.0.0/16"],
                              "dns": ["192.0.2.53:5353"], "defaults": {"deny": ["bad.example"]}},
                  "limits": {"enforce": false, "overcommit": 2,
                             "defaults": {"memoryBytes": 33554432, "pids": 64, "cpuWeight": 50,
                                          "cpuQuotaPercent": 200, "diskBytes": 16777216,
                                          "openFiles": 64, "ioReadBps": 1048576,
                                          "ioWriteBps": 1048576, "ioReadIops": 100,
                                          "ioWriteIops": 100, "ioWeight": 50,
                                          "egressBps": 1048576},
                             "max": {"memoryBytes": 67108864, "pids": 128, "cpuWeight": 500,
                                     "cpuQuotaPercent": 400, "diskBytes": 33554432,
                                     "openFiles": 128, "ioReadBps": 2097152,
                                     "ioWriteBps": 2097152, "ioReadIops": 200,
                                     "ioWriteIops": 200, "ioWeight": 500,
                                     "egressBps": 2097152}},
                  "identity": {"hostIdFirst": 200000, "hostIdCount": 10, "insideUid": 1000,
                               "insideGid": 1000, "lockFile": "/run/x.lock"},
                  "etcFiles": ["hosts.allow"]},
        "noop": {"enabled": true},
        "plugins": [{"pluginId": "vm", "provider": "cloudvm", "command": ["/bin/vm", "-x"],
                     "env": {"A": "b"}, "manifest": "/m.json", "config": {"k": [1, 2]},
                     "timeoutsMs": {"health": 5, "duplexChannelOpen": 6},
                     "cleanup": {"attempts": 2, "backoffMs": 3, "slowRetryMs": 4},
                     "maxBufferedBytes": 65536}]},
      "limits": {"maxTextMessage": 2097152, "maxDataPayload": 131072,
                 "channelsPerConnection": 8, "channelsPerNode": 9, "requestsPerConnection": 10,
                 "outputWindow": 4096, "stdinWindow": 8192, "maxOutputWindow": 16384,
                 "maxStdinWindow": 32768, "detachRetainMs": 5000, "maxDetachRetainMs": 9000,
                 "detachRetainBytes": 65536, "maxDetachRetainBytes": 131072,
                 "detachKeptBytesPerLease": 262144, "detachKeptExitsPerLease": 7,
                 "sendQueueBytes": 1048576,
                 "sendQueueBytesPerConnection": 524288, "sendStallTimeoutMs": 2000,
                 "connections": 100, "pendingConnections": 10, "authTimeoutMs": 1000,
                 "pingIntervalMs": 1000, "idleTimeoutMs": 3000, "drainGraceMs": 10,
                 "hangupGraceMs": 20, "drainTimeoutMs": 40, "defaultTtlMs": 5000,
                 "maxTtlMs": 6000, "executeOutputBytes": 2048, "executeTimeoutMs": 7,
                 "retainedTtlMs": 8000},
      "log": {"level": "debug", "format": "json"},
      "audit": {"file": "/var/log/audit", "journald": true},
      "metrics": {"public": true},
      "console": {"enabled": true, "assetsDir": "/srv/console"}
    })");
}

std::vector<std::string> split_path(const std::string& path) {
    std::vector<std::string> parts;
    std::stringstream ss(path);
    for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
    return parts;
}

/// The values at a reference-table path ("a.b[].c": c of every element of a.b).
std::vector<json> values_at(const json& j, const std::string& path) {
    std::vector<json> at = {j};
    for (auto part : split_path(path)) {
        const bool each = part.size() > 2 && part.compare(part.size() - 2, 2, "[]") == 0;
        if (each) part.resize(part.size() - 2);
        std::vector<json> next;
        for (const auto& v : at) {
            if (!v.is_object() || !v.contains(part)) continue;
            if (!each) {
                next.push_back(v[part]);
                continue;
            }
            for (const auto& element : v[part]) next.push_back(element);
        }
        at = std::move(next);
    }
    return at;
}

/// J with the value at PATH (no array on the way) replaced by V, objects made as needed.
json with_value(json j, const std::string& path, const json& v) {
    json* at = &j;
    for (const auto& part : split_path(path)) at = &(*at)[part];
    *at = v;
    return j;
}

std::string error_of(const std::string& text) {
    try {
        parse_config(text);
    } catch (const config_error& e) {
        return e.what();
    }
    return "accepted";
}

bool in_array(const std::string& key) { return key.find("[]") != std::string::npos; }

/// What a reload listed before the key table: the top-level keys whose JSON differs once the
/// tokens and the TLS files are taken out.
std::vector<std::string> sections_by_json(const Config& running, const Config& next) {
    const auto without_reloaded = [](const Config& c) {
        auto j = config_to_json(c);
        j["auth"].erase("tokens");
        j.erase("tls");
        j["routing"].erase("peerTls");
        j["registry"].erase("tls");
        return j;
    };
    const auto before = without_reloaded(running);
    const auto after = without_reloaded(next);
    std::vector<std::string> out;
    for (const auto& [key, value] : after.items()) {
        if (!before.contains(key) || before[key] != value) out.push_back(key);
    }
    return out;
}

}  // namespace

TEST_CASE("Every config key reads back what it prints, and differs from its default", "[config]") {
    const auto doc = every_key_set();
    const auto config = parse_config(doc.dump());
    auto printed = config_to_json(config);
    CHECK(printed["auth"]["tokens"][0]["token"] == "<redacted>");
    auto expected = doc;
    expected["auth"]["tokens"][0]["token"] = "<redacted>";
    CHECK(printed == expected);
    // Printed again after reading what was printed: the same (the redacted secret aside).
    printed["auth"]["tokens"][0]["token"] = "s3cret";
    CHECK(config_to_json(parse_config(printed.dump())) == expected);

    const auto rows = config_keys::reference_rows();
    CHECK(rows.size() > 100);
    for (const auto& row : rows) {
        INFO(row.key);
        const auto values = values_at(doc, row.key);
        REQUIRE_FALSE(values.empty());  // the document above sets every key
        if (row.type == "object" || row.type == "array of objects") continue;
        bool differs = false;
        for (const auto& v : values) differs = differs || v.dump() != row.default_value;
        CHECK(differs);
    }
}

TEST_CASE("A value out of range or not allowed names its key and the range", "[config]") {
    int checked = 0;
    for (const auto& row : config_keys::reference_rows()) {
        if (in_array(row.key) || row.range.empty()) continue;
        INFO(row.key);
        if (row.type == "string") {  // one of the allowed values
            CHECK(error_of(with_value(json::object(), row.key, "nope").dump()) ==
                  "config: " + row.key + ": must be one of " +
                      [&] {
                          std::string list = row.range;
                          list.erase(std::remove(list.begin(), list.end(), '"'), list.end());
                          return list;
                      }() +
                      ", got \"nope\"");
            ++checked;
            continue;
        }
        const auto dots = row.range.find("..");
        const auto lo = std::stoull(row.range.substr(0, dots));
        const auto hi = std::stoull(row.range.substr(dots + 2));
        const std::string range = "must be an integer in " + row.range;
        CHECK(error_of(with_value(json::object(), row.key, "1").dump()) ==
              "config: " + row.key + ": " + range);
        if (lo > 0) {
            CHECK(error_of(with_value(json::object(), row.key, lo - 1).dump()) ==
                  "config: " + row.key + ": " + range + ", got " + std::to_string(lo - 1));
        }
        CHECK(error_of(with_value(json::object(), row.key, hi + 1).dump()) ==
              "config: " + row.key + ": " + range + ", got " + std::to_string(hi + 1));
        ++checked;
    }
    CHECK(checked > 50);
    CHECK(error_of(R"({"limits": {"sendQueueBytes": 1}})") ==
          "config: limits.sendQueueBytes: must be an integer in 65536..68719476736, got 1");
    CHECK(error_of(R"({"providers": {"plugins": [{"timeoutsMs": {"health": 0}}]}})") ==
          "config: providers.plugins[0].timeoutsMs.health: must be an integer in 1..86400000, "
          "got 0");
    CHECK(error_of(R"({"providers": {"plugins": [{"timeoutsMs": {"nap": 1}}]}})") ==
          "config: providers.plugins[0].timeoutsMs.nap: unknown key");
    CHECK(error_of(R"({"providers": {"plugins": [{"env": {"A": 1}}]}})") ==
          "config: providers.plugins[0].env.A: must be a string");
    CHECK(error_of(R"({"auth": {"tokens": {}}})") == "config: auth.tokens: must be an array");
    CHECK(error_of(R"({"tls": []})") == "config: tls: must be an object");
    CHECK(error_of("[]") == "config: (top level): must be an object");
}

TEST_CASE("The restart diff names the changed keys a reload does not apply", "[config]") {
    const auto doc = every_key_set();
    Config rich;
    config_keys::read(doc, rich);
    const auto defaults = config_to_json(Config{});
    int restart = 0;
    int reloadable = 0;
    for (const auto& row : config_keys::reference_rows()) {
        if (in_array(row.key) || row.type == "object") continue;
        INFO(row.key);
        // The key alone put back to its default: the cross-field rules are not the diff's
        // business, so read without them.
        Config next;
        config_keys::read(with_value(doc, row.key, values_at(defaults, row.key).at(0)), next);
        const auto changes = config_restart_changes(rich, next);
        if (row.reloadable) {
            CHECK(changes.empty());
            ++reloadable;
        } else {
            CHECK(changes == std::vector<std::string>{row.key});
            ++restart;
        }
        CHECK(config_restart_sections(rich, next) == sections_by_json(rich, next));
    }
    CHECK(reloadable == 11);  // tls (4), routing.peerTls (3), registry.tls (3), auth.tokens
    CHECK(restart > 80);

    CHECK(config_restart_changes(rich, rich).empty());
    CHECK(config_restart_sections(Config{}, rich) == sections_by_json(Config{}, rich));
    CHECK(config_restart_sections(rich, Config{}) ==
          std::vector<std::string>{"advertiseUrl", "audit", "console", "limits", "listen", "log",
                                   "metrics", "nodeId", "plainListen", "providers", "registry",
                                   "routing", "stateDir", "threads"});
    Config plugin = rich;
    plugin.plugins[0].timeouts_ms["health"] = 9;
    CHECK(config_restart_changes(rich, plugin) == std::vector<std::string>{"providers.plugins"});
    Config tokens = rich;
    tokens.tokens.pop_back();
    tokens.tls.cert_file = "/c/other.pem";
    tokens.peer_tls.key_file = "/p/other.pem";
    tokens.registry.tls.ca_file = "";
    CHECK(config_restart_changes(rich, tokens).empty());
    Config limits = rich;
    limits.limits.send_queue_bytes = 1 << 21;
    limits.bwrap.limits.max.pids.reset();
    CHECK(config_restart_changes(rich, limits) ==
          std::vector<std::string>{"providers.bwrap.limits.max.pids", "limits.sendQueueBytes"});
    CHECK(config_restart_sections(rich, limits) == std::vector<std::string>{"limits", "providers"});
}

TEST_CASE("docs/config.md is the generated reference table", "[config]") {
    std::ifstream in(SANDBOXD_SOURCE_DIR "/docs/config.md", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    // On a difference: build/dev/sandboxd --print-config-reference > docs/config.md
    CHECK(ss.str() == config_reference_markdown());
    const auto text = config_reference_markdown();
    CHECK(text.find("| `limits.sendQueueBytes` | integer | `67108864` | 65536..68719476736 | "
                    "no | ") != std::string::npos);
    CHECK(text.find("| `auth.tokens[].role` | string | `\"host\"` | \"host\", \"peer\", "
                    "\"metrics\" | yes | ") != std::string::npos);
}

TEST_CASE("providers.bwrap.network: a bad pool, range, uplink or resolver names its key",
          "[config]") {
    auto bad = [](const char* network) {
        return error_of(std::string(R"({"providers": {"bwrap": {"network": )") + network + "}}}");
    };
    CHECK(bad(R"({"pool": "10.200.0.1/16"})") ==
          "config: providers.bwrap.network.pool: must be an IPv4 CIDR with its host bits zero, "
          "got \"10.200.0.1/16\"");
    CHECK(bad(R"({"pool": "10.0.0.0/7"})") ==
          "config: providers.bwrap.network.pool: must be a /8 to a /28, got /7");
    CHECK(bad(R"({"pool": "fd00::/64"})").rfind("config: providers.bwrap.network.pool:", 0) == 0);
    CHECK(bad(R"({"uplink": "a-very-long-interface-name"})")
              .rfind("config: providers.bwrap.network.uplink: must be an interface name", 0) == 0);
    CHECK(bad(R"({"deny": ["203.0.113.0/24", "example.com"]})") ==
          "config: providers.bwrap.network.deny[1]: must be an IPv4 address or CIDR (host bits "
          "zero), got \"example.com\"");
    CHECK(bad(R"({"open": ["10.1.0.1/16"]})") ==
          "config: providers.bwrap.network.open[0]: must be an IPv4 address or CIDR (host bits "
          "zero), got \"10.1.0.1/16\"");
    CHECK(bad(R"({"dns": ["192.0.2.53:0"]})") ==
          "config: providers.bwrap.network.dns[0]: must be ADDRESS, ADDRESS:PORT or "
          "[IPv6]:PORT, got \"192.0.2.53:0\"");
    CHECK(bad(R"({"defaults": {"allow": ["a"], "mode": "none"}})") ==
          "config: providers.bwrap.network.defaults.mode: unknown key");
    CHECK(bad(R"({"defaults": {"deny": "a"}})") ==
          "config: providers.bwrap.network.defaults.deny: must be an array of rules");
    CHECK(error_of(R"({"providers": {"bwrap": {"network": {"egress": true,
          "pool": "100.64.0.0/24", "deny": ["203.0.113.9"], "dns": ["[2001:db8::1]:53"]}}}})") ==
          "accepted");
}

TEST_CASE("An upstream resolver is ADDRESS, IPv4:PORT or [IPv6]:PORT", "[config]") {
    CHECK(parse_dns_server("192.0.2.1") ==
          boost::asio::ip::udp::endpoint(boost::asio::ip::make_address("192.0.2.1"), 53));
    CHECK(parse_dns_server("192.0.2.1:5353")->port() == 5353);
    CHECK(parse_dns_server("2001:db8::1")->address().to_string() == "2001:db8::1");
    CHECK(parse_dns_server("[2001:db8::1]:54")->port() == 54);
    CHECK(parse_dns_server("[2001:db8::1]")->port() == 53);
    for (const char* bad : {"", "example.com", "192.0.2.1:", "192.0.2.1:65536", "[2001:db8::1",
                            "[2001:db8::1]54", "192.0.2.1:x"}) {
        INFO(bad);
        CHECK_FALSE(parse_dns_server(bad));
    }
}
