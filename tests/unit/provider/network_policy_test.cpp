// A lease's network policy (src/provider/network_policy.hpp, issue 48): what `config.network`
// accepts, its normal form, and the field and reason of each refusal.
#include "provider/network_policy.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <string>

using namespace sandboxd;
using namespace sandboxd::detail;
using json = nlohmann::json;

namespace {

/// The field named by the INVALID_PARAMS error that parsing `value` throws; "" if none.
std::string refused_field(const json& value) {
    try {
        parse_network_policy(value);
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        return e.data().value("field", "");
    }
    return "";
}

json normal(const json& value) { return to_json(parse_network_policy(value)); }

}  // namespace

TEST_CASE("The old boolean is a policy: false is none, true is egress without rules",
          "[network_policy]") {
    CHECK(normal(false) ==
          json{{"mode", "none"}, {"allow", json::array()}, {"deny", json::array()}});
    CHECK(normal(true) ==
          json{{"mode", "egress"}, {"allow", json::array()}, {"deny", json::array()}});
}

TEST_CASE("Rules are hosts or objects, and come back in their normal form", "[network_policy]") {
    const json policy = {
        {"mode", "egress"},
        {"allow",
         {"Example.COM.",
          "*.example.org",
          "203.0.113.7",
          "203.0.113.0/24",
          "2001:DB8::1",
          "2001:db8::/32",
          {{"host", "api.example.com"},
           {"ports", {8443, "8000-8100", 443, "8050-8200"}},
           {"protocol", "tcp"}},
          {{"host", "dns.example"}, {"ports", {53}}, {"protocol", "udp"}}}},
        {"deny", {"xn--bcher-kva.example", {{"host", "198.51.100.0/24"}, {"ports", {"1-65535"}}}}}};
    const json got = normal(policy);
    CHECK(got["mode"] == "egress");
    CHECK(got["allow"] ==
          json::parse(R"([{"host":"example.com"},{"host":"*.example.org"},{"host":"203.0.113.7"},
            {"host":"203.0.113.0/24"},{"host":"2001:db8::1"},{"host":"2001:db8::/32"},
            {"host":"api.example.com","ports":[443,"8000-8200",8443],"protocol":"tcp"},
            {"host":"dns.example","ports":[53],"protocol":"udp"}])"));
    CHECK(got["deny"] == json::parse(R"([{"host":"xn--bcher-kva.example"},
            {"host":"198.51.100.0/24","ports":["1-65535"]}])"));
    // The normal form parses to itself.
    CHECK(normal(got) == got);
    const auto parsed = parse_network_policy(policy);
    REQUIRE(std::holds_alternative<DomainName>(parsed.allow[1].host));
    CHECK(std::get<DomainName>(parsed.allow[1].host) == DomainName{"example.org", true});
    CHECK(parsed.allow[6].ports == std::vector<PortRange>{{443, 443}, {8000, 8200}, {8443, 8443}});
}

TEST_CASE("A bad policy is refused naming the field, whatever is wrong", "[network_policy]") {
    CHECK(refused_field("egress") == "config.network");
    CHECK(refused_field(json::object()) == "config.network.mode");
    CHECK(refused_field({{"mode", "open"}}) == "config.network.mode");
    CHECK(refused_field({{"mode", "none"}, {"allow", {"example.com"}}}) == "config.network.allow");
    CHECK(refused_field({{"mode", "egress"}, {"allowed", json::array()}}) ==
          "config.network.allowed");
    CHECK(refused_field({{"mode", "egress"}, {"allow", "example.com"}}) == "config.network.allow");
    for (const char* host :
         {"", "-a.example", "a-.example", "a..example", "exa mple.com", "203.0.113.0/33",
          "203.0.113.1/24", "1.2.3", "999.1.1.1", "fe80::1%eth0", "*.", "*.*.example",
          "under_score.example", "example.com/24"}) {
        INFO(host);
        CHECK(refused_field({{"mode", "egress"}, {"deny", {"ok.example", host}}}) ==
              "config.network.deny[1]");
    }
    CHECK(refused_field({{"mode", "egress"}, {"allow", {std::string(64, 'a') + ".example"}}}) ==
          "config.network.allow[0]");
    const json bad_rules[] = {
        {{"ports", {80}}},
        {{"host", "example.com"}, {"port", 80}},
        {{"host", 7}},
    };
    CHECK(refused_field({{"mode", "egress"}, {"allow", {bad_rules[0]}}}) ==
          "config.network.allow[0].host");
    CHECK(refused_field({{"mode", "egress"}, {"allow", {bad_rules[1]}}}) ==
          "config.network.allow[0].port");
    CHECK(refused_field({{"mode", "egress"}, {"allow", {bad_rules[2]}}}) ==
          "config.network.allow[0].host");
    for (const json& ports : {json::array(), json{0}, json{65536}, json{"90-80"}, json{"80"},
                              json{"a-b"}, json{"1-65536"}, json{true}}) {
        INFO(ports.dump());
        CHECK(refused_field(
                  {{"mode", "egress"}, {"allow", {{{"host", "example.com"}, {"ports", ports}}}}})
                  .rfind("config.network.allow[0].ports", 0) == 0);
    }
    CHECK(refused_field(
              {{"mode", "egress"}, {"allow", {{{"host", "example.com"}, {"protocol", "icmp"}}}}}) ==
          "config.network.allow[0].protocol");
    json many = json::array();
    for (std::size_t i = 0; i <= max_rules; ++i)
        many.push_back("h" + std::to_string(i) + ".example");
    CHECK(refused_field({{"mode", "egress"}, {"allow", many}}) == "config.network.allow");
    many.erase(many.begin());
    CHECK(parse_network_policy({{"mode", "egress"}, {"allow", many}}).allow.size() == max_rules);
}
