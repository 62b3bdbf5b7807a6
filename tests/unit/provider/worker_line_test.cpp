// The plugin worker's line protocol (src/provider/worker_line.hpp): one line of its stdout,
// classified as a response, a request to the host, a notification, text (a console.log),
// blank, or invalid, whatever the bytes.
#include "provider/worker_line.hpp"

#include <sandboxd/core/json_limits.hpp>

#include <catch2/catch.hpp>

#include <string>

using namespace sandboxd;

namespace {

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

}  // namespace

TEST_CASE("A worker line is classified by its JSON-RPC shape", "[plugin][worker_line]") {
    SECTION("a response has an id and a result or an error, and no method") {
        auto ok = parse_worker_line(R"({"jsonrpc":"2.0","id":7,"result":{"a":1}})");
        CHECK(ok.kind == worker_line_kind::response);
        CHECK(ok.message["result"]["a"] == 1);
        auto err = parse_worker_line(R"({"jsonrpc":"2.0","id":"x","error":{"code":-1}})");
        CHECK(err.kind == worker_line_kind::response);
        // A null id still answers (a worker that could not read the request's id).
        CHECK(parse_worker_line(R"({"id":null,"error":{"code":-32700}})").kind ==
              worker_line_kind::response);
    }
    SECTION("a request has a method and an id that is not null") {
        auto r = parse_worker_line(R"({"jsonrpc":"2.0","id":3,"method":"config.get"})");
        CHECK(r.kind == worker_line_kind::request);
        CHECK(r.message["method"] == "config.get");
        CHECK(parse_worker_line(R"({"id":"q","method":"m","params":[]})").kind ==
              worker_line_kind::request);
    }
    SECTION("a notification has a method and no id") {
        auto n = parse_worker_line(R"({"jsonrpc":"2.0","method":"log","params":{"m":"hi"}})");
        CHECK(n.kind == worker_line_kind::notification);
        CHECK(n.message["params"]["m"] == "hi");
    }
}

TEST_CASE("A worker line that is no message is blank, text or invalid", "[plugin][worker_line]") {
    SECTION("blank: empty, spaces and tabs, a lone carriage return") {
        for (const char* line : {"", " ", "\t \t", "\r", "  \r"}) {
            auto b = parse_worker_line(line);
            CHECK(b.kind == worker_line_kind::blank);
            CHECK(b.message.is_null());
        }
    }
    SECTION("text: not JSON, or JSON that is not an object (a console.log)") {
        for (const char* line :
             {"hello world", "{not json", "[1,2]", "42", "\"a string\"", "null", "{}x"}) {
            auto t = parse_worker_line(line);
            CHECK(t.kind == worker_line_kind::text);
            CHECK(t.message.is_null());
        }
    }
    SECTION("invalid: an object that is none of the three, kept for the log") {
        for (const char* line : {R"({})", R"({"id":1})", R"({"result":1})",
                                 R"({"method":1,"id":2})", R"({"method":"m","id":null})"}) {
            auto i = parse_worker_line(line);
            CHECK(i.kind == worker_line_kind::invalid);
            CHECK(i.message.is_object());
        }
    }
}

TEST_CASE("A worker line's trailing carriage return is ignored", "[plugin][worker_line]") {
    auto crlf = parse_worker_line("{\"id\":1,\"result\":true}\r");
    CHECK(crlf.kind == worker_line_kind::response);
    CHECK(crlf.message["result"] == true);
    // A CRLF blank line is blank, not text.
    CHECK(parse_worker_line(" \t\r").kind == worker_line_kind::blank);
}

TEST_CASE("A worker line is bounded by the JSON depth limit, never by a throw",
          "[plugin][worker_line]") {
    const std::string head = R"({"id":1,"result":)";
    // The object is level 1: its result may nest max_json_depth - 1 levels.
    CHECK(parse_worker_line(head + nested(max_json_depth - 1) + "}").kind ==
          worker_line_kind::response);
    auto deep = parse_worker_line(head + nested(max_json_depth) + "}");
    CHECK(deep.kind == worker_line_kind::text);
    CHECK(deep.message.is_null());
    // Bytes that are no UTF-8, a NUL inside the line, a truncated message: text, no throw.
    CHECK(parse_worker_line(std::string("{\"id\":1,\"result\":\"\xff\xfe\"}")).kind ==
          worker_line_kind::text);
    constexpr char with_nul[] = "{\"id\":1,\0\"result\":1}";
    CHECK(parse_worker_line(std::string(with_nul, sizeof with_nul - 1)).kind ==
          worker_line_kind::text);
    CHECK(parse_worker_line(R"({"id":1,"result":)").kind == worker_line_kind::text);
}
