// Unit tests of the host methods' typed params (server/methods.hpp) and of the JSON-RPC
// envelopes (sandboxd/core/jsonrpc.hpp): each parse names the failing field, exactly.
#include "server/methods.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include <catch2/catch.hpp>

#include <csignal>
#include <functional>

using namespace sandboxd;
using json = nlohmann::json;

namespace {

/// The error a parse threw: {field, message}; {"", ""} when it did not throw.
std::pair<std::string, std::string> failure(const std::function<void()>& parse) {
    try {
        parse();
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        return {e.data().value("field", ""), e.what()};
    }
    return {"", ""};
}

json open_params() { return {{"lease", {{"id", "l-1"}}}, {"command", {"sh", "-c", "true"}}}; }

}  // namespace

TEST_CASE("Method params that are not an object are refused as a whole", "[methods]") {
    CHECK(methods::params_object(nullptr) == json::object());
    CHECK(failure([] { methods::params_object(json::array()); }) ==
          std::pair<std::string, std::string>{"params", "params: must be an object"});
}

TEST_CASE("Channel method params are parsed once into their struct", "[methods]") {
    auto w = methods::parse_write({{"channel", 7}, {"data", "aGk="}});
    CHECK(w.channel == 7);
    CHECK(w.data == "hi");
    auto r = methods::parse_resize({{"channel", 2}, {"cols", 80}, {"rows", 24}});
    CHECK((r.channel == 2 && r.cols == 80 && r.rows == 24));
    CHECK(methods::parse_signal({{"channel", 1}, {"signal", "TERM"}}).signal == SIGTERM);
    CHECK(methods::parse_channel({{"channel", 4294967295U}}).channel == 4294967295U);
}

TEST_CASE("Channel method params name the field on error", "[methods]") {
    using F = std::pair<std::string, std::string>;
    CHECK(failure([] {
              methods::parse_channel({{"channel", 1}, {"extra", 1}});
          }) == F{"extra", "extra: unknown parameter"});
    CHECK(failure([] { methods::parse_channel(json::object()); }) ==
          F{"channel", "channel: is required"});
    CHECK(failure([] {
              methods::parse_channel({{"channel", -1}});
          }) == F{"channel", "channel: must be an integer in 0..4294967295"});
    CHECK(failure([] {
              methods::parse_write({{"channel", 1}});
          }) == F{"data", "data: is required (base64)"});
    CHECK(failure([] {
              methods::parse_write({{"channel", 1}, {"data", "abc"}});
          }) == F{"data", "data: is not valid base64"});
    CHECK(failure([] {
              methods::parse_resize({{"channel", 1}, {"cols", 0}, {"rows", 1}});
          }) == F{"cols", "cols: must be an integer in 1..4096"});
    CHECK(failure([] {
              methods::parse_resize({{"channel", 1}, {"cols", 1}});
          }) == F{"rows", "rows: is required"});
    CHECK(failure([] {
              methods::parse_signal({{"channel", 1}, {"signal", "STOP"}});
          }) ==
          F{"signal", "signal: must be one of INT, TERM, HUP, QUIT, KILL, USR1, USR2, WINCH"});
}

TEST_CASE("Lease method params name the field on error", "[methods]") {
    using F = std::pair<std::string, std::string>;
    CHECK(methods::parse_lease_id({{"leaseId", "l-1"}}).lease_id == "l-1");
    CHECK(failure([] {
              methods::parse_lease_id({{"leaseId", ""}});
          }) == F{"leaseId", "leaseId: must not be empty"});
    CHECK(failure([] {
              methods::parse_lease_renew({{"leaseId", "l"}, {"ttlMs", 999}});
          }) == F{"ttlMs", "ttlMs: must be an integer in 1000..4611686018427387903"});
    CHECK(methods::parse_lease_renew({{"leaseId", "l"}, {"ttlMs", 5000}}).ttl_ms == 5000);
    CHECK(methods::parse_lease_update_network({{"leaseId", "l"}, {"network", true}}).network ==
          true);
    CHECK(methods::parse_lease_update_network({{"leaseId", "l"}, {"network", {{"mode", "none"}}}})
              .network["mode"] == "none");
    CHECK(failure([] {
              methods::parse_lease_update_network({{"leaseId", "l"}});
          }) == F{"network", "network: is required"});
    CHECK(failure([] {
              methods::parse_lease_update_network({{"leaseId", "l"}, {"network", "egress"}});
          }) == F{"network", "network: must be a policy object or a boolean"});
    CHECK(failure([] {
              methods::parse_lease_update_network(
                  {{"leaseId", "l"}, {"network", true}, {"ttlMs", 1}});
          }).first == "ttlMs");
    CHECK(failure([] {
              methods::parse_initialize({{"protocolVersion", 2}});
          }) == F{"protocolVersion", "protocolVersion: only version 1 is supported"});
}

TEST_CASE("An open's params are parsed into an exec spec, naming the field on error", "[methods]") {
    using F = std::pair<std::string, std::string>;
    auto p = open_params();
    p["env"] = {{"A", "1"}};
    p["pty"] = {{"cols", 100}, {"rows", 30}};
    p["timeoutMs"] = 2500;
    p["dataEncoding"] = "base64";
    p["stdin"] = false;
    auto o = methods::parse_open(p);
    CHECK(o.spec.argv == std::vector<std::string>{"sh", "-c", "true"});
    CHECK(o.spec.env.at("A") == "1");
    REQUIRE(o.spec.pty);
    CHECK((o.spec.pty->cols == 100 && o.spec.pty->rows == 30));
    CHECK(o.timeout == std::chrono::milliseconds(2500));
    CHECK(o.base64);
    CHECK_FALSE(o.spec.stdin_attached);
    CHECK_FALSE(o.output_window);
    // The lease reference, read once: {"id": "l-1"} names no pluginId, provider or
    // providerLeaseId, so it carries the LEASE_INCOMPLETE that step 2 reports.
    CHECK(o.lease.problem);
    const auto whole =
        methods::parse_lease_ref(json{{"id", "l-1"},
                                      {"providerLeaseId", "p-1"},
                                      {"companyId", "c"},
                                      {"environmentId", "e"},
                                      {"epoch", 3},
                                      {"metadata", {{"pluginId", "x"}, {"provider", "bwrap"}}}});
    CHECK_FALSE(whole.problem);
    CHECK(whole.id == std::optional<std::string>("l-1"));
    CHECK(whole.epoch == std::optional<std::uint64_t>(3));
    CHECK(
        (whole.provider == "bwrap" && whole.plugin_id == "x" && whole.provider_lease_id == "p-1"));

    SECTION("the first bad field is named") {
        auto with = [](const char* key, json value) {
            auto q = open_params();
            q[key] = std::move(value);
            return q;
        };
        CHECK(failure([&] {
                  methods::parse_open(with("command", {"", "x"}));
              }) == F{"command[0]", "command[0]: must not be empty"});
        CHECK(failure([&] {
                  methods::parse_open(with("command", {"a", 1}));
              }) == F{"command[1]", "command[1]: must be a string"});
        CHECK(failure([&] { methods::parse_open(with("lease", "l-1")); }) ==
              F{"lease", "lease: must be an object"});
        CHECK(failure([&] {
                  methods::parse_open(with("env", {{"A=B", "1"}}));
              }) == F{"env.A=B", "env.A=B: is not a valid variable name"});
        CHECK(failure([&] {
                  methods::parse_open(with("pty", {{"cols", 5000}, {"rows", 1}}));
              }) == F{"cols", "cols: must be an integer in 1..4096"});
        CHECK(failure([&] { methods::parse_open(with("outputWindow", 2048), 1024); }) ==
              F{"outputWindow", "outputWindow: must be an integer in 1024..1024"});
        CHECK(failure([&] { methods::parse_open(with("stdinWindow", 4096), 1 << 20, 2048); }) ==
              F{"stdinWindow", "stdinWindow: must be an integer in 1024..2048"});
        CHECK(failure([&] { methods::parse_open(with("outputWindow", 10)); }) ==
              F{"outputWindow", "outputWindow: must be an integer in 1024..1073741824"});
        CHECK(failure([&] { methods::parse_open(with("dataEncoding", "hex")); }) ==
              F{"dataEncoding", "dataEncoding: must be \"binary\" or \"base64\""});
        CHECK(failure([&] { methods::parse_open(with("bogus", 1)); }) ==
              F{"bogus", "bogus: unknown parameter"});
    }
}

TEST_CASE("An open's detach and name are parsed within the node's bounds", "[methods][detach]") {
    using F = std::pair<std::string, std::string>;
    const methods::DetachLimits limits{60000, 120000, 1 << 20, 4 << 20};
    auto parse = [&](json extra) {
        auto q = open_params();
        q.update(extra);
        return methods::parse_open(q, 1 << 20, 1 << 20, limits);
    };
    CHECK_FALSE(parse(json::object()).detach);
    const auto defaults = parse({{"detach", json::object()}});
    REQUIRE(defaults.detach);
    CHECK(defaults.detach->retain_ms == 60000);
    CHECK(defaults.detach->retain_bytes == 1 << 20);
    CHECK(defaults.name.empty());
    const auto asked =
        parse({{"detach", {{"retainMs", 120000}, {"retainBytes", 4096}}}, {"name", "build-1.x_y"}});
    CHECK(asked.detach->retain_ms == 120000);
    CHECK(asked.detach->retain_bytes == 4096);
    CHECK(asked.name == "build-1.x_y");
    CHECK_FALSE(asked.detach->hangup_after);
    const auto idle = parse({{"detach", {{"hangupAfterMs", 30000}}}});
    REQUIRE(idle.detach->hangup_after);
    CHECK(idle.detach->hangup_after->count() == 30000);

    CHECK(failure([&] {
              parse({{"detach", true}});
          }) == F{"detach", "detach: must be an object {retainMs?, retainBytes?, hangupAfterMs?}"});
    CHECK(failure([&] {
              parse({{"detach", {{"hangupAfterMs", 999}}}});
          }) == F{"detach.hangupAfterMs",
                  "detach.hangupAfterMs: must be an integer in 1000..2592000000"});
    CHECK(failure([&] {
              parse({{"detach", {{"retainMs", 120001}}}});
          }) == F{"detach.retainMs", "detach.retainMs: must be an integer in 1000..120000"});
    CHECK(failure([&] {
              parse({{"detach", {{"retainBytes", 100}}}});
          }) == F{"detach.retainBytes", "detach.retainBytes: must be an integer in 4096..4194304"});
    CHECK(failure([&] {
              parse({{"detach", {{"keep", 1}}}});
          }) == F{"detach.keep", "detach.keep: is not a field of detach"});
    CHECK(failure([&] {
              parse({{"name", "n"}});
          }) == F{"name", "name: names a detached channel: give detach too"});
    CHECK(failure([&] {
              parse({{"detach", json::object()}, {"name", "a b"}});
          }) == F{"name", "name: must be 1 to 128 of A-Z, a-z, 0-9, '.', '_', '-'"});
    CHECK(failure([&] {
              parse({{"detach", json::object()}, {"name", std::string(129, 'a')}});
          }).first == "name");
    CHECK(failure([&] {
              parse({{"detach", json::object()}, {"dataEncoding", "base64"}});
          }) ==
          F{"dataEncoding",
            "dataEncoding: must be \"binary\" with detach: kept output is sent as binary frames"});
}

TEST_CASE("An attach names one detached channel of a lease, with offsets and a takeover",
          "[methods][detach]") {
    using F = std::pair<std::string, std::string>;
    const std::string handle = "dch_0123456789abcdef01234567";
    const auto by_handle = methods::parse_attach({{"leaseId", "l1"}, {"handle", handle}});
    CHECK(by_handle.lease_id == "l1");
    CHECK(by_handle.handle == handle);
    CHECK_FALSE(by_handle.offsets);
    CHECK_FALSE(by_handle.takeover);
    const auto full = methods::parse_attach({{"leaseId", "l1"},
                                             {"name", "job"},
                                             {"offsets", {{"stdout", 5}}},
                                             {"takeover", true},
                                             {"outputWindow", 4096},
                                             {"resize", {{"cols", 100}, {"rows", 30}}}});
    CHECK(full.name == "job");
    REQUIRE(full.offsets);
    CHECK(full.offsets->stdout_offset == 5);
    CHECK(full.offsets->stderr_offset == 0);
    CHECK(full.takeover);
    CHECK(full.output_window == 4096U);
    CHECK(full.resize == std::make_pair(std::uint16_t{100}, std::uint16_t{30}));

    auto fails = [](json p) { return failure([&] { methods::parse_attach(p); }); };
    CHECK(fails({{"leaseId", "l1"}}).first == "handle");
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"handle", handle}}).first == "name");
    CHECK(fails({{"name", "a"}}) == F{"leaseId", "leaseId: is required"});
    CHECK(fails({{"leaseId", "l1"}, {"handle", "dch_XYZ"}}) ==
          F{"handle", "handle: must be \"dch_\" and 24 lowercase hex digits"});
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"offsets", {{"stdout", -1}}}}) ==
          F{"offsets.stdout", "offsets.stdout: must be an integer in 0..4611686018427387903"});
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"offsets", {{"stdin", 1}}}}) ==
          F{"offsets.stdin", "offsets.stdin: is not a field of offsets"});
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"resize", {{"cols", 10}}}}).first == "resize");
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"takeover", 1}}).first == "takeover");
    CHECK(fails({{"leaseId", "l1"}, {"name", "a"}, {"extra", 1}}).first == "extra");
}

TEST_CASE("A request names its channel only with an unsigned 32-bit id", "[methods]") {
    CHECK(methods::channel_named({{"channel", 3}}) == 3U);
    CHECK_FALSE(methods::channel_named({{"channel", -3}}));
    CHECK_FALSE(methods::channel_named({{"channel", "3"}}));
    CHECK_FALSE(methods::channel_named({{"channel", 4294967296ULL}}));
    CHECK_FALSE(methods::channel_named(json::array()));
}

TEST_CASE("A server classifies text messages with the protocol's errors", "[jsonrpc]") {
    auto invalid = [](std::string_view text, std::size_t max = 1024) {
        auto parsed = jsonrpc::parse_request(text, max);
        auto* bad = std::get_if<jsonrpc::Invalid>(&parsed);
        REQUIRE(bad != nullptr);
        return std::make_pair(bad->id, bad->error.to_json());
    };
    CHECK(invalid("{", 1024).second["code"] == -32700);
    // A number beyond a double is a parse error too (found by tests/fuzz/fuzz_jsonrpc.cpp).
    CHECK(invalid("2E802").second["code"] == -32700);
    CHECK(invalid(R"({"jsonrpc":"2.0","id":1,"method":"x","params":{"n":1e999}})").second["code"] ==
          -32700);
    CHECK(invalid("[]").second["message"] == "Batch requests are not supported");
    CHECK(invalid("3").second["message"] == "A request must be a JSON object");
    CHECK(invalid("{\"jsonrpc\":\"2.0\",\"method\":\"x\"}", 10).second["message"] ==
          "text message of 30 bytes is over the limit of 10");
    auto [id, error] = invalid(R"({"jsonrpc":"2.0","id":7,"method":1})");
    CHECK(id == 7);
    CHECK(error["data"]["reason"] == "INVALID_REQUEST");

    auto parsed = jsonrpc::parse_request(R"({"jsonrpc":"2.0","method":"m"})", 1024);
    auto* request = std::get_if<jsonrpc::Request>(&parsed);
    REQUIRE(request != nullptr);
    CHECK_FALSE(request->id);  // a notification
    CHECK(request->params == json::object());
}

TEST_CASE("A client reads responses and rethrows their errors with the reason's code",
          "[jsonrpc]") {
    CHECK(json::parse(jsonrpc::request(1, "m", {{"a", 1}})) ==
          json{{"jsonrpc", "2.0"}, {"id", 1}, {"method", "m"}, {"params", {{"a", 1}}}});
    auto message = jsonrpc::parse_message(
        jsonrpc::error(4, rpc_error(errc::channel_limit, "full", {{"limit", "x"}}).to_json()));
    auto* response = std::get_if<jsonrpc::Response>(&message);
    REQUIRE(response != nullptr);
    CHECK(response->id == 4);
    try {
        jsonrpc::result_or_throw(*response);
        FAIL("no error thrown");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::channel_limit);
        CHECK(std::string(e.what()) == "full");
        CHECK(e.data()["limit"] == "x");
    }
    CHECK(std::holds_alternative<std::monostate>(jsonrpc::parse_message("not json")));
    auto note =
        jsonrpc::parse_message(jsonrpc::notification("duplexChannel.exit", {{"channel", 1}}));
    REQUIRE(std::holds_alternative<jsonrpc::Request>(note));
    CHECK(std::get<jsonrpc::Request>(note).method == "duplexChannel.exit");
}
