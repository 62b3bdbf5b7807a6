// intersect_tenants (src/server/node.hpp): what a forwarded request may act for is held to the
// peer token's own tenants (issue 44, item 4).
#include "server/node.hpp"

#include <catch2/catch.hpp>

using namespace sandboxd;
using V = std::vector<std::string>;

TEST_CASE("peer tenants: a forwarded request acts only within the peer token's own tenants",
          "[auth]") {
    CHECK(intersect_tenants({"*"}, {"acme"}) == V{"acme"});
    CHECK(intersect_tenants({"acme"}, {"*"}) == V{"acme"});
    CHECK(intersect_tenants({"*"}, {"*"}) == V{"*"});
    CHECK(intersect_tenants({"other", "acme", "acme"}, {"acme", "beta"}) == V{"acme"});
    CHECK(intersect_tenants({"other"}, {"acme"}).empty());
    CHECK(intersect_tenants({}, {"*"}).empty());
    CHECK(intersect_tenants({"b", "a"}, {"*"}) == V{"b", "a"});
    // No tenant at all allows nothing, and is never read as "every tenant".
    Principal none{"x", "host", intersect_tenants({"other"}, {"acme"})};
    CHECK_FALSE(none.allows("acme"));
    CHECK_FALSE(none.allows("other"));
}
