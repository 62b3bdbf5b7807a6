// Unit tests of sandboxd/core/address.hpp: HOST:PORT, ws:// URLs and etcd endpoints.
#include <sandboxd/core/address.hpp>

#include <catch2/catch.hpp>

#include <functional>
#include <string>

using namespace sandboxd;

namespace {

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const address_error& e) {
        return e.what();
    }
    return "accepted";
}

}  // namespace

TEST_CASE("HOST:PORT accepts names, IPv4 and bracketed IPv6", "[address]") {
    CHECK(parse_host_port("127.0.0.1:7800") == HostPort{"127.0.0.1", 7800});
    CHECK(parse_host_port("localhost:0") == HostPort{"localhost", 0});
    CHECK(parse_host_port("node-1.example_internal.com:65535") ==
          HostPort{"node-1.example_internal.com", 65535});
    const auto v6 = parse_host_port("[::1]:7800");
    CHECK(v6 == HostPort{"::1", 7800});
    CHECK(v6.is_ipv6());
    CHECK(v6.authority() == "[::1]:7800");
    CHECK(v6.port_text() == "7800");
    CHECK(parse_host_port("[fe80::1:2]:1").host == "fe80::1:2");
    CHECK(parse_host_port("127.0.0.1:007").authority() == "127.0.0.1:7");
}

TEST_CASE("HOST:PORT rejects what is not one, naming the problem", "[address]") {
    auto bad = [](const char* text) { return error_of([&] { parse_host_port(text); }); };
    CHECK(bad("7800") == R"(must be HOST:PORT, got "7800")");
    CHECK(bad("localhost") == R"(must be HOST:PORT, got "localhost")");
    CHECK(bad("localhost:") == R"(must be HOST:PORT, got "localhost:")");
    CHECK(bad(":7800") == R"(must be HOST:PORT, got ":7800")");
    CHECK(bad("") == R"(must be HOST:PORT, got "")");
    CHECK(bad("::1:7800") == R"(must be HOST:PORT, got "::1:7800")");
    CHECK(bad("[::1:7800") == R"(must be HOST:PORT, got "[::1:7800")");
    CHECK(bad("user@host:7800") == R"(must be HOST:PORT, got "user@host:7800")");
    CHECK(bad("host:7800/path") == R"(must be HOST:PORT, got "host:7800/path")");
    CHECK(bad("ho%20st:7800") == R"(must be HOST:PORT, got "ho%20st:7800")");
    CHECK(bad("a,b:7800") == R"(must be HOST:PORT, got "a,b:7800")");
    CHECK(bad("host:99999") == R"(port must be 0..65535, got "99999")");
    CHECK(bad("host:65536") == R"(port must be 0..65535, got "65536")");
    CHECK(bad("host:123456") == R"(port must be 0..65535, got "123456")");
    CHECK(error_of([] { parse_host_port("host:0", port_zero::rejected); }) ==
          R"(port must be 1..65535, got "0")");
    CHECK_THROWS_AS(parse_host_port("x"), std::invalid_argument);
}

TEST_CASE("ws:// URLs give the endpoint and the handshake target", "[address]") {
    auto url = parse_ws_url("ws://127.0.0.1:7800/v1/ws");
    CHECK(url.endpoint == HostPort{"127.0.0.1", 7800});
    CHECK(url.target == "/v1/ws");
    SECTION("the default port and target") {
        CHECK(parse_ws_url("ws://example.com").endpoint == HostPort{"example.com", 80});
        CHECK(!parse_ws_url("ws://example.com").tls);
        CHECK(parse_ws_url("wss://example.com").endpoint == HostPort{"example.com", 443});
        CHECK(parse_ws_url("wss://example.com:8443/v1/ws").tls);
        CHECK(parse_ws_url("ws://example.com").target == "/v1/ws");
        CHECK(parse_ws_url("ws://example.com/").target == "/v1/ws");
        CHECK(parse_ws_url("ws://example.com:/x").endpoint.port == 80);
    }
    SECTION("IPv6 without brackets in the host, with them in the authority") {
        auto v6 = parse_ws_url("ws://[::1]:9/a/b?c=d");
        CHECK(v6.endpoint.host == "::1");
        CHECK(v6.endpoint.authority() == "[::1]:9");
        CHECK(v6.target == "/a/b?c=d");
    }
    SECTION("errors") {
        auto bad = [](const char* text) { return error_of([&] { parse_ws_url(text); }); };
        CHECK(bad("http://h/") ==
              R"(must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got "http://h/")");
        CHECK(bad("h:7800") ==
              R"(must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got "h:7800")");
        CHECK(bad("ws:///v1/ws") ==
              R"(must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got "ws:///v1/ws")");
        CHECK(bad("ws://u:p@h/") ==
              R"(must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got "ws://u:p@h/")");
        CHECK(bad("ws://h/#x") ==
              R"(must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got "ws://h/#x")");
        CHECK(bad("ws://h:0/") == R"(port must be 1..65535, got "0")");
        CHECK(bad("ws://h:70000/") == R"(port must be 1..65535, got "70000")");
    }
}

TEST_CASE("etcd endpoints are http://HOST:PORT with nothing after", "[address]") {
    CHECK(parse_http_endpoint("http://127.0.0.1:2379") == HostPort{"127.0.0.1", 2379});
    CHECK(parse_http_endpoint("http://etcd-0:2379/") == HostPort{"etcd-0", 2379});
    CHECK(parse_http_endpoint("http://[::1]:2379").authority() == "[::1]:2379");
    auto bad = [](const char* text) { return error_of([&] { parse_http_endpoint(text); }); };
    CHECK(bad("127.0.0.1:2379") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "127.0.0.1:2379")");
    bool https = false;
    CHECK(parse_http_endpoint("https://h:2379", &https) == HostPort{"h", 2379});
    CHECK(https);
    CHECK(bad("ftp://h:2379") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "ftp://h:2379")");
    CHECK(bad("http://h") == R"(must be http://HOST:PORT or https://HOST:PORT, got "http://h")");
    CHECK(bad("http://h:2379/v3") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "http://h:2379/v3")");
    CHECK(bad("http://h:2379//") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "http://h:2379//")");
    CHECK(bad("http://h:2379?x") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "http://h:2379?x")");
    CHECK(bad("http://[::1:2379") ==
          R"(must be http://HOST:PORT or https://HOST:PORT, got "http://[::1:2379")");
    CHECK(bad("http://h:0") == R"(port must be 1..65535, got "0")");
}
