// What a lease's lookups make the daemon hold (src/provider/lease_network.hpp, ResolvedNames):
// bounded in names and in addresses per name, whatever the tenant resolves.
#include "provider/lease_network.hpp"

#include <catch2/catch.hpp>

#include <string>

using sandboxd::detail::ResolvedNames;
namespace ip = boost::asio::ip;

TEST_CASE("A lease's resolved names are bounded in names and addresses", "[network]") {
    ResolvedNames r;
    const auto now = std::chrono::steady_clock::now();
    // One name answered with more addresses than it keeps: the one expiring first goes.
    for (std::uint32_t i = 0; i < ResolvedNames::max_addresses + 10; ++i) {
        r.add("cdn.test", ip::address_v4(0xC6336400U + i), now + std::chrono::seconds(100 + i));
    }
    REQUIRE(r.names.at("cdn.test").size() == ResolvedNames::max_addresses);
    CHECK(r.names.at("cdn.test").count(ip::address_v4(0xC6336400U)) == 0);
    CHECK(r.names.at("cdn.test").count(ip::address_v4(0xC6336400U + 73)) == 1);
    // More names than it keeps: expired ones go first, and it never grows past the bound.
    r.add("old.test", ip::address_v4(0xC0000201U), now - std::chrono::seconds(1));
    for (std::size_t i = 0; i < ResolvedNames::max_names + 100; ++i) {
        r.add("n" + std::to_string(i) + ".test", ip::address_v4(0xCB007101U),
              now + std::chrono::seconds(60));
    }
    CHECK(r.names.size() <= ResolvedNames::max_names);
    CHECK(r.names.count("old.test") == 0);
    // An address seen again keeps the later of its two expiries.
    r.add("cdn.test", ip::address_v4(0xC6336400U + 73), now + std::chrono::seconds(1000));
    r.add("cdn.test", ip::address_v4(0xC6336400U + 73), now + std::chrono::seconds(5));
    CHECK(r.names.at("cdn.test").at(ip::address_v4(0xC6336400U + 73)) ==
          now + std::chrono::seconds(1000));
}
