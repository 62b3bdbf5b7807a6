// Unit tests of the pure parts: frame codec, config, error mapping, handle cache, leases.
#include <sandboxd/core/config.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/provider/handle_cache.hpp>

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

using namespace sandboxd;

TEST_CASE("A data frame round-trips with its header", "[frame]") {
    const std::string payload("\x00\xff\n\r", 4);
    auto bytes = encode_data(0x01020304, stream_id::stderr_, payload);
    CHECK(bytes == std::string("\x01\x01\x02\x03\x04\x02\x00\xff\n\r", 10));
    auto decoded = decode_frame(bytes, 1024);
    auto* data = std::get_if<DataFrame>(&decoded);
    REQUIRE(data != nullptr);
    CHECK(data->channel == 0x01020304);
    CHECK(data->stream == stream_id::stderr_);
    CHECK(data->payload == payload);
}

TEST_CASE("A credit frame round-trips", "[frame]") {
    auto bytes = encode_credit(7, stream_id::stdout_, 0x00100000);
    CHECK(bytes == std::string("\x02\x00\x00\x00\x07\x01\x00\x10\x00\x00", 10));
    auto decoded = decode_frame(bytes, 1024);
    auto* credit = std::get_if<CreditFrame>(&decoded);
    REQUIRE(credit != nullptr);
    CHECK(credit->channel == 7);
    CHECK(credit->bytes == 0x00100000);
}

TEST_CASE("A relay renumbers a frame of either kind in place", "[frame]") {
    auto data = encode_data(7, stream_id::stdout_, "hi");
    set_frame_channel(data, 0xa1b2c3d4);
    CHECK(data == std::string("\x01\xa1\xb2\xc3\xd4\x01hi", 8));
    auto credit = encode_credit(7, stream_id::stderr_, 9);
    set_frame_channel(credit, 3);
    CHECK(credit == encode_credit(3, stream_id::stderr_, 9));
}

TEST_CASE("Malformed frames are rejected with a reason", "[frame]") {
    auto error_of = [](const std::string& bytes, std::size_t max = 16) {
        auto d = decode_frame(bytes, max);
        auto* e = std::get_if<FrameError>(&d);
        REQUIRE(e != nullptr);
        return *e;
    };
    CHECK(error_of(std::string("\x01\x00\x00", 3)).what ==
          "binary frame shorter than its 6-byte header");
    CHECK(error_of(std::string("\x01\x00\x00\x00\x01\x00", 6)).what ==
          "data frame with an empty payload");
    CHECK(error_of(std::string("\x03\x00\x00\x00\x01\x00x", 7)).what ==
          "binary frame of unknown kind 3");
    CHECK(error_of(std::string("\x01\x00\x00\x00\x01\x03x", 7)).what ==
          "binary frame names unknown stream 3");
    CHECK(error_of(std::string("\x02\x00\x00\x00\x01\x01\x00", 7)).what ==
          "credit frame is not 10 bytes");
    CHECK(error_of(encode_credit(1, stream_id::stdout_, 0)).what == "credit frame grants 0 bytes");
    auto big = error_of(encode_data(1, stream_id::stdin_, std::string(17, 'x')));
    CHECK(big.too_big);
    CHECK(big.what == "data frame payload of 17 bytes is over the limit of 16");
}

TEST_CASE("Every error maps to its protocol code and reason", "[errors]") {
    struct Row {
        errc e;
        int code;
        const char* reason;
    };
    const Row rows[] = {
        {errc::parse_error, -32700, "PARSE_ERROR"},
        {errc::invalid_request, -32600, "INVALID_REQUEST"},
        {errc::method_not_found, -32601, "METHOD_NOT_FOUND"},
        {errc::invalid_params, -32602, "INVALID_PARAMS"},
        {errc::lease_incomplete, -32010, "LEASE_INCOMPLETE"},
        {errc::sandbox_not_cached, -32011, "SANDBOX_NOT_CACHED"},
        {errc::lease_not_found, -32012, "LEASE_NOT_FOUND"},
        {errc::lease_not_active, -32013, "LEASE_NOT_ACTIVE"},
        {errc::owner_unavailable, -32014, "OWNER_UNAVAILABLE"},
        {errc::owner_elsewhere, -32015, "OWNER_ELSEWHERE"},
        {errc::channel_limit, -32016, "CHANNEL_LIMIT"},
        {errc::provider_error, -32017, "PROVIDER_ERROR"},
        {errc::provider_not_ready, -32018, "PROVIDER_NOT_READY"},
        {errc::channel_not_found, -32019, "CHANNEL_NOT_FOUND"},
        {errc::flow_control, -32020, "FLOW_CONTROL"},
        {errc::registry_unavailable, -32021, "REGISTRY_UNAVAILABLE"},
        {errc::routing_loop, -32022, "ROUTING_LOOP"},
        {errc::forbidden, -32023, "FORBIDDEN"},
    };
    for (const auto& r : rows) {
        CHECK(rpc_code(r.e) == r.code);
        CHECK(reason(r.e) == r.reason);
        CHECK(make_error_code(r.e).message() == r.reason);
    }
    auto j = rpc_error(errc::sandbox_not_cached, std::string(sandbox_not_cached_message),
                       {{"leaseId", "l1"}})
                 .to_json();
    CHECK(j ==
          nlohmann::json{
              {"code", -32011},
              {"message", "Sandbox duplex channel: no cached sandbox resolves the provider lease."},
              {"data", {{"reason", "SANDBOX_NOT_CACHED"}, {"leaseId", "l1"}}}});
    CHECK(lease_not_active_message("l9") == "Sandbox lease l9 is no longer active.");
}

TEST_CASE("The example config equals the defaults", "[config]") {
    std::ifstream in(SANDBOXD_SOURCE_DIR "/config/sandboxd.jsonc");
    std::stringstream ss;
    ss << in.rdbuf();
    auto parsed = parse_config(ss.str());
    CHECK(config_to_json(parsed) == config_to_json(Config{}));
    CHECK(parse_config(default_config_text()).listen == "127.0.0.1:7800");
}

TEST_CASE("Invalid configs are rejected with the field path", "[config]") {
    auto error_of = [](const std::string& text) -> std::string {
        try {
            parse_config(text);
        } catch (const config_error& e) {
            return e.what();
        }
        return "accepted";
    };
    CHECK(error_of(R"({"nope": 1})") == "config: nope: unknown key");
    // A number beyond a double: not valid JSON, not an escaping out_of_range (fuzzing found it).
    CHECK(error_of(R"({"limits": {"outputWindow": 1e999}})").rfind("config: not valid JSON: ", 0) ==
          0);
    CHECK(error_of(R"({"limits": {"outputWindow": 10}})") ==
          "config: limits.outputWindow: must be an integer in 1024..1073741824, got 10");
    CHECK(error_of(R"({"limits": {"outputWindow": "big"}})") ==
          "config: limits.outputWindow: must be an integer in 1024..1073741824");
    CHECK(error_of(R"({"limits": {"requestsPerConnection": 0}})") ==
          "config: limits.requestsPerConnection: must be an integer in 1..65536, got 0");
    CHECK(parse_config(R"({"limits": {"requestsPerConnection": 3}})")
              .limits.requests_per_connection == 3);
    CHECK(Config{}.limits.requests_per_connection == 64);
    CHECK(error_of(R"({"routing": {"mode": "teleport"}})") ==
          "config: routing.mode: must be one of proxy, redirect, got \"teleport\"");
    CHECK(error_of(R"({"auth": {"tokens": [{"name": "x", "role": "host"}]}})") ==
          "config: auth.tokens[0]: needs exactly one of token or tokenFile");
    CHECK(error_of(R"({"auth": {"tokens": [{"name": "x", "token": "t", "colour": "red"}]}})") ==
          "config: auth.tokens[0].colour: unknown key");
    CHECK(error_of(R"({"listen": "7800"})") == "config: listen: must be HOST:PORT, got \"7800\"");
    CHECK(error_of(R"({"listen": "host:99999"})") ==
          "config: listen: port must be 0..65535, got \"99999\"");
    CHECK(error_of("{").rfind("config: not valid JSON", 0) == 0);
    CHECK(error_of(R"({"registry": {"kind": "etcd"}})") ==
          "config: registry.endpoints: etcd needs at least one endpoint");
    CHECK(error_of(R"(// comment
        {"listen": "0.0.0.0:0" /* port 0 */})") == "accepted");
}

TEST_CASE("The handle cache resolves only the full scope", "[cache]") {
    HandleCache cache;
    auto h = std::make_shared<SandboxHandle>();
    h->scope = {"bwrap", "acme", "dev", "bw-1"};
    h->lease_id = "l1";
    CHECK(cache.put(h));
    CHECK_FALSE(cache.put(h));
    CHECK(cache.find({"bwrap", "acme", "dev", "bw-1"}) == h);
    CHECK(cache.find({"bwrap", "acme", "prod", "bw-1"}) == nullptr);
    CHECK(cache.find({"bwrap", "globex", "dev", "bw-1"}) == nullptr);
    CHECK(cache.find({"plugin", "acme", "dev", "bw-1"}) == nullptr);
    CHECK(cache.find({"bwrap", "acme", "dev", "bw-2"}) == nullptr);
    CHECK(cache.begin_teardown({"bwrap", "acme", "dev", "bw-1"}) == h);
    CHECK(cache.find({"bwrap", "acme", "dev", "bw-1"}) == nullptr);
    CHECK(cache.size() == 1);
    CHECK(cache.erase({"bwrap", "acme", "dev", "bw-1"}) == h);
    CHECK(cache.size() == 0);
}

TEST_CASE("Leases serialise with RFC 3339 times and nulls", "[lease]") {
    Lease l;
    l.id = "l1";
    l.company_id = "acme";
    l.environment_id = "dev";
    l.provider = "bwrap";
    l.provider_lease_id = "bw-1";
    l.owner_node_id = "n1";
    l.acquired_at_ms = l.last_used_at_ms = 1764546569123;
    l.expires_at_ms = 1764546569123 + 1000;
    l.metadata = {{"pluginId", "builtin"}, {"provider", "bwrap"}};
    auto j = to_json(l);
    CHECK(j["acquiredAt"] == "2025-11-30T23:49:29.123Z");
    CHECK(j["expiresAt"] == "2025-11-30T23:49:30.123Z");
    CHECK(j["releasedAt"].is_null());
    CHECK(j["failureReason"].is_null());
    CHECK(j["status"] == "active");
    CHECK_FALSE(j.contains("runId"));
    CHECK(l.is_live(1764546569123));
    CHECK_FALSE(l.is_live(1764546569123 + 1000));
    CHECK(parse_lease_status("pending_cleanup") == lease_status::pending_cleanup);
    CHECK_FALSE(parse_lease_status("gone"));
}

TEST_CASE("providers.bwrap limits, identity and etcFiles are parsed and checked", "[config]") {
    auto c = sandboxd::parse_config(R"({"providers": {"bwrap": {
        "limits": {"enforce": false, "defaults": {"pids": 64, "cpuQuotaPercent": 50},
                   "max": {"diskBytes": null}},
        "identity": {"hostIdFirst": 200000, "hostIdCount": 10, "insideUid": 1000},
        "etcFiles": ["hosts.allow"]}}})");
    CHECK_FALSE(c.bwrap.limits.enforce);
    CHECK(c.bwrap.limits.defaults.pids == 64u);
    CHECK(c.bwrap.limits.defaults.cpu_quota_percent == 50u);
    CHECK(c.bwrap.limits.defaults.memory_bytes == 1ULL << 30);  // untouched keys keep defaults
    CHECK_FALSE(c.bwrap.limits.max.disk_bytes.has_value());     // null: no cap
    CHECK(c.bwrap.identity.host_id_first == 200000u);
    CHECK(c.bwrap.identity.inside_uid == 1000u);
    CHECK(c.bwrap.etc_files == std::vector<std::string>{"hosts.allow"});

    auto error_of = [](const char* text) {
        try {
            sandboxd::parse_config(text);
        } catch (const sandboxd::config_error& e) {
            return std::string(e.what());
        }
        return std::string("accepted");
    };
    CHECK(error_of(R"({"providers": {"bwrap": {"limits": {"defaults": {"pids": 4}}}}})") ==
          "config: providers.bwrap.limits.defaults.pids: must be an integer in 8..4194304, got 4");
    CHECK(error_of(R"({"providers": {"bwrap": {"limits": {"max": {"memoryBytes": 16777216}}}}})") ==
          "config: providers.bwrap.limits.defaults.memoryBytes: must not exceed "
          "providers.bwrap.limits.max.memoryBytes (16777216)");
    CHECK(error_of(R"({"providers": {"bwrap": {"limits": {"defaults": {"swap": 1}}}}})") ==
          "config: providers.bwrap.limits.defaults.swap: unknown key");
    CHECK(
        error_of(
            R"({"limits": {"detachRetainBytes": 1048576, "detachKeptBytesPerLease": 1048576}})") ==
        "config: limits.detachKeptBytesPerLease: must be at least twice limits.detachRetainBytes "
        "(a default open keeps both streams)");
    CHECK(error_of(R"({"limits": {"detachRetainMs": 9000, "maxDetachRetainMs": 5000}})") ==
          "config: limits.detachRetainMs: must not exceed limits.maxDetachRetainMs");
    CHECK(error_of(R"({"providers": {"bwrap": {"etcFiles": ["../shadow"]}}})") ==
          "config: providers.bwrap.etcFiles: entries are relative paths under /etc, got "
          "\"../shadow\"");
    CHECK(error_of(R"({"providers": {"bwrap": {"identity": {"hostIdFirst": 4294967000,
          "hostIdCount": 1000}}}})") ==
          "config: providers.bwrap.identity.hostIdCount: the range must end below 4294967295");
}
