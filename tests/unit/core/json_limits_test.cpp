// Unit tests of bounded JSON parsing (include/sandboxd/core/json_limits.hpp) and of the
// readers that use it: JSON-RPC messages, the config, plugin worker lines, etcd replies.
#include "provider/worker_line.hpp"
#include "registry/etcd_client.hpp"

#include <sandboxd/core/config.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include <catch2/catch.hpp>

#include <string>

using namespace sandboxd;
using json = nlohmann::json;

namespace {

/// `depth` arrays, one inside the other: "[[[...]]]".
std::string nested_arrays(std::size_t depth) {
    return std::string(depth, '[') + std::string(depth, ']');
}

/// `depth` objects, one inside the other: {"a":{"a":...{}}}.
std::string nested_objects(std::size_t depth) {
    std::string text;
    text.reserve(depth * 6);
    for (std::size_t i = 1; i < depth; ++i) text += "{\"a\":";
    text += "{}";
    text.append(depth - 1, '}');
    return text;
}

/// A JSON-RPC request whose params nest `depth` levels below the request object.
std::string deep_request(std::size_t depth) {
    return R"({"jsonrpc":"2.0","id":1,"method":"leaseGet","params":)" + nested_arrays(depth) + "}";
}

}  // namespace

TEST_CASE("JSON nested exactly max_json_depth levels parses", "[json]") {
    SECTION("arrays") {
        auto r = try_parse_json(nested_arrays(max_json_depth));
        REQUIRE(r.ok());
        CHECK(r.value.is_array());
        CHECK(r.error.empty());
        CHECK(!r.exception);
    }
    SECTION("objects") {
        auto r = try_parse_json(nested_objects(max_json_depth));
        REQUIRE(r.ok());
        CHECK(r.value.is_object());
    }
    SECTION("siblings do not add up: depth is nesting, not count") {
        std::string text = "[";
        for (int i = 0; i < 1000; ++i) text += nested_arrays(max_json_depth - 1) + ",";
        text += "1]";
        auto r = try_parse_json(text);
        REQUIRE(r.ok());
        CHECK(r.value.size() == 1001);
    }
}

TEST_CASE("JSON one level deeper than max_json_depth is refused for its depth", "[json]") {
    for (const auto& text : {nested_arrays(max_json_depth + 1), nested_objects(max_json_depth + 1),
                             // unclosed: refused at the level, before the missing brackets
                             std::string(max_json_depth + 1, '[')}) {
        auto r = try_parse_json(text);
        CHECK(r.status == json_parse_status::too_deep);
        CHECK(r.value.is_null());
        CHECK(r.error == "nested deeper than 64 levels");
        CHECK_THROWS_AS(parse_json(text), json::parse_error);
        CHECK_THROWS_WITH(parse_json(text),
                          Catch::Matchers::Contains("nested deeper than 64 levels"));
    }
}

TEST_CASE("JSON nested a million levels is refused without exhausting the stack", "[json]") {
    auto r = try_parse_json(nested_arrays(1'000'000));
    CHECK(r.status == json_parse_status::too_deep);
    auto o = try_parse_json(nested_objects(1'000'000));
    CHECK(o.status == json_parse_status::too_deep);
}

TEST_CASE("Malformed JSON keeps nlohmann's error and exception type", "[json]") {
    SECTION("syntax") {
        auto r = try_parse_json("{\"a\":");
        CHECK(r.status == json_parse_status::malformed);
        CHECK_THAT(r.error, Catch::Matchers::Contains("parse_error"));
        CHECK_THROWS_AS(parse_json("{\"a\":"), json::parse_error);
    }
    SECTION("trailing input") {
        CHECK(try_parse_json("{} x").status == json_parse_status::malformed);
        CHECK(try_parse_json("{}{}").status == json_parse_status::malformed);
    }
    SECTION("a number beyond a double") {
        CHECK(try_parse_json("[2E802]").status == json_parse_status::malformed);
        CHECK_THROWS_AS(parse_json("[2E802]"), json::out_of_range);
    }
    SECTION("empty") { CHECK(try_parse_json("").status == json_parse_status::malformed); }
}

TEST_CASE("Comments are accepted only when asked for", "[json]") {
    const std::string text = "// note\n{\"a\": /* one */ 1}";
    CHECK(try_parse_json(text).status == json_parse_status::malformed);
    auto r = try_parse_json(text, {.ignore_comments = true});
    REQUIRE(r.ok());
    CHECK(r.value == json{{"a", 1}});
}

TEST_CASE("A bounded parse gives what json::parse gives", "[json]") {
    for (const char* text :
         {"null", "1", "-2.5", "\"s\\u00e9\"", "[]", "{}",
          R"({"jsonrpc":"2.0","id":7,"method":"leaseGet","params":{"x":[1,{"y":null}]}})"}) {
        CHECK(parse_json(text) == json::parse(text));
    }
}

TEST_CASE("A request nested too deep is a parse error naming the depth", "[json][jsonrpc]") {
    // 64 levels below the request object: the request object itself is level 1.
    auto ok = jsonrpc::parse_request(deep_request(max_json_depth - 1), 1 << 20);
    CHECK(std::holds_alternative<jsonrpc::Request>(ok));
    for (std::size_t depth : {std::size_t{max_json_depth}, std::size_t{500'000}}) {
        auto r = jsonrpc::parse_request(deep_request(depth), 4 << 20);
        auto* invalid = std::get_if<jsonrpc::Invalid>(&r);
        REQUIRE(invalid != nullptr);
        CHECK(invalid->id.is_null());
        CHECK(invalid->error.code() == errc::parse_error);
        CHECK(std::string(invalid->error.what()) ==
              "Parse error: the text frame is nested deeper than 64 levels");
    }
    CHECK(std::holds_alternative<std::monostate>(jsonrpc::parse_message(deep_request(500'000))));
}

TEST_CASE("A config nested too deep is a config error naming the depth", "[json][config]") {
    const std::string text = "{\"listen\": " + nested_arrays(100'000) + "}";
    CHECK_THROWS_AS(parse_config(text), config_error);
    CHECK_THROWS_WITH(parse_config(text),
                      Catch::Matchers::Contains("config: not valid JSON") &&
                          Catch::Matchers::Contains("nested deeper than 64 levels"));
}

TEST_CASE("A plugin worker line nested too deep is text, dropped", "[json][plugin]") {
    auto line =
        parse_worker_line(R"({"jsonrpc":"2.0","id":1,"result":)" + nested_arrays(500'000) + "}");
    CHECK(line.kind == worker_line_kind::text);
    CHECK(line.message.is_null());
    auto ok = parse_worker_line(R"({"jsonrpc":"2.0","id":1,"result":)" +
                                nested_arrays(max_json_depth - 1) + "}");
    CHECK(ok.kind == worker_line_kind::response);
}

TEST_CASE("An etcd reply nested too deep is refused", "[json][etcd]") {
    CHECK_THROWS_AS(etcd::parse_reply_body(nested_arrays(500'000)), json::parse_error);
    CHECK_THROWS_WITH(etcd::parse_reply_body(nested_arrays(500'000)),
                      Catch::Matchers::Contains("nested deeper than 64 levels"));
    // The first line of a stream is read alone; a deep first line is refused just the same.
    CHECK_THROWS_AS(etcd::parse_reply_body(nested_arrays(500'000) + "\n{}"), json::parse_error);
    CHECK(etcd::parse_reply_body("{\"a\":1}\n{\"b\":2}") == json{{"a", 1}});
}
