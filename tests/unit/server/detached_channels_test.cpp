// DetachedChannels (src/server/detached_channels.hpp): handles, names unique per lease while
// a channel runs or its exit is kept, the order of a lease's list, and expiry (by retain_ms
// after the end, or all of a lease's at once).
#include "server/detached_channels.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <string>

using namespace sandboxd;

namespace {

DetachedChannels::Entry entry(std::string lease, std::string name, std::uint64_t retain_ms = 1000) {
    DetachedChannels::Entry e;
    e.lease_id = std::move(lease);
    e.name = std::move(name);
    e.argv0 = "sh";
    e.retain_ms = retain_ms;
    return e;
}

}  // namespace

TEST_CASE("Detached channels are found by handle and by name within their lease",
          "[detached_channels]") {
    DetachedChannels t;
    const auto a = t.add(entry("lse_1", "build"));
    const auto b = t.add(entry("lse_1", ""));
    const auto c = t.add(entry("lse_2", "build"));  // the same name in another lease
    CHECK(a.rfind("dch_", 0) == 0);
    CHECK(a.size() == 4 + 24);
    CHECK(a != b);
    CHECK(t.find(a)->name == "build");
    CHECK(t.find("lse_1", "build")->handle == a);
    CHECK(t.find("lse_2", "build")->handle == c);
    CHECK_FALSE(t.find("lse_3", "build"));
    CHECK_FALSE(t.find("dch_nonesuch"));
    const auto list = t.of_lease("lse_1");
    REQUIRE(list.size() == 2);
    CHECK(list[0]->handle == a);  // oldest first
    CHECK(list[1]->handle == b);
    CHECK(t.running() == 3);
}

TEST_CASE("A name is refused while its channel runs or its exit is kept, and free after",
          "[detached_channels]") {
    DetachedChannels t;
    const auto a = t.add(entry("lse_1", "build", /*retain_ms=*/1000));
    try {
        t.add(entry("lse_1", "build"));
        FAIL("a second \"build\" was added");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        CHECK(e.data().value("field", "") == "name");
    }
    CHECK(t.size() == 1);  // the refused one changed nothing
    t.ended(a, 5000);
    CHECK(t.running() == 0);
    CHECK(t.expire(5999).empty());  // kept for 1000 ms after its end
    CHECK_THROWS_AS(t.add(entry("lse_1", "build")), rpc_error);
    const auto gone = t.expire(6000);
    REQUIRE(gone.size() == 1);
    CHECK(gone[0]->handle == a);
    CHECK_FALSE(t.find(a));
    CHECK_NOTHROW(t.add(entry("lse_1", "build")));
}

TEST_CASE("A lease that ends takes all of its detached channels with it", "[detached_channels]") {
    DetachedChannels t;
    t.add(entry("lse_1", "a"));
    t.add(entry("lse_1", "b"));
    const auto other = t.add(entry("lse_2", "a"));
    const auto gone = t.expire(0, "lse_1");
    CHECK(gone.size() == 2);
    CHECK(t.of_lease("lse_1").empty());
    CHECK(t.find(other));
    CHECK_NOTHROW(t.add(entry("lse_1", "a")));
}

TEST_CASE("A lease's detached channels keep at most its budget of output together",
          "[detached_channels]") {
    DetachedChannels t;
    auto sized = [](std::string lease, std::uint64_t bytes) {
        auto e = entry(std::move(lease), "");
        e.kept_bytes = bytes;
        return e;
    };
    t.add(sized("lse_1", 600), 1000);
    try {
        t.add(sized("lse_1", 500), 1000);
        FAIL("went past the lease's budget");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::channel_limit);
        CHECK(e.data().value("limit", "") == "detachKeptBytesPerLease");
    }
    CHECK(t.size() == 1);  // the refusal changed nothing
    CHECK_NOTHROW(t.check_new("lse_1", "", 400, 1000));
    CHECK_THROWS_AS(t.check_new("lse_1", "", 401, 1000), rpc_error);
    t.add(sized("lse_2", 1000), 1000);  // another lease's budget is its own
    // An ended entry still counts until it is forgotten; then the room is back.
    const auto h = t.of_lease("lse_1").front()->handle;
    t.ended(h, 0);
    CHECK_THROWS_AS(t.check_new("lse_1", "", 500, 1000), rpc_error);
    t.expire(1000);
    CHECK_NOTHROW(t.check_new("lse_1", "", 1000, 1000));
}

TEST_CASE("A lease keeps a bounded number of ended channels: the oldest opened go first",
          "[detached_channels]") {
    DetachedChannels t;
    std::vector<std::string> handles;
    handles.reserve(5);
    for (int i = 0; i < 5; ++i) handles.push_back(t.add(entry("lse_1", "n" + std::to_string(i))));
    const auto other = t.add(entry("lse_2", "n0"));
    // They end out of order; at most 2 ended are kept per lease.
    CHECK(t.ended(handles[3], 100, 2).empty());
    CHECK(t.ended(handles[1], 101, 2).empty());
    CHECK(t.ended(other, 102, 2).empty());  // another lease's count is its own
    auto gone = t.ended(handles[4], 103, 2);
    REQUIRE(gone.size() == 1);
    CHECK(gone[0]->handle == handles[1]);  // opened before 3 and 4, though it ended after 3
    CHECK_FALSE(t.find("lse_1", "n1"));
    CHECK_NOTHROW(t.check_new("lse_1", "n1", 0, UINT64_MAX));  // its name is free again
    gone = t.ended(handles[0], 104, 2);
    REQUIRE(gone.size() == 1);
    CHECK(gone[0]->handle == handles[0]);  // the one that just ended was the oldest opened
    // The running one is never forgotten this way.
    CHECK(t.find(handles[2]));
    CHECK(t.running() == 1);
    CHECK(t.of_lease("lse_1").size() == 3);
    CHECK(t.of_lease("lse_2").size() == 1);
}
