// SendBudget (src/server/send_budget.hpp): the node's and each connection's budget of bytes
// queued toward hosts, fair shares, peer links exempt, and the wake when the node has room.
#include "server/send_budget.hpp"

#include <catch2/catch.hpp>

using namespace sandboxd;

TEST_CASE("send budget: a connection over its own budget has no room until bytes are written",
          "[send_budget]") {
    SendBudget budget(1000, 100);
    SendBudget::Account a(budget, false);
    CHECK(a.has_room());
    a.add(99);
    CHECK(a.has_room());
    a.add(1);
    CHECK_FALSE(a.has_room());
    CHECK_FALSE(a.held_by_node());  // its own budget, not the node's
    CHECK(budget.queued() == 100);
    a.sub(1);
    CHECK(a.has_room());
    CHECK(budget.active() == 1);
    a.sub(1000);  // more than queued: clamped
    CHECK(a.queued() == 0);
    CHECK(budget.queued() == 0);
    CHECK(budget.active() == 0);
}

TEST_CASE("send budget: with the node's budget spent, only connections above their fair share stop",
          "[send_budget]") {
    SendBudget budget(100, 80);
    SendBudget::Account stalled(budget, false);
    SendBudget::Account reading(budget, false);
    SendBudget::Account idle(budget, false);
    stalled.add(70);
    reading.add(30);
    // 100 queued over two connections: each may hold 50.
    CHECK_FALSE(stalled.has_room());
    CHECK(stalled.held_by_node());
    CHECK(reading.has_room());
    CHECK(idle.has_room());  // nothing queued: always room
    reading.sub(10);         // the node is under its budget again: everyone has room
    CHECK(stalled.has_room());
    reading.add(10);
    idle.add(1);  // three connections: a share of 33
    CHECK_FALSE(stalled.has_room());
    CHECK(reading.has_room());
    CHECK(idle.has_room());
}

TEST_CASE("send budget: a peer link is counted but never refused room", "[send_budget]") {
    SendBudget budget(100, 10);
    SendBudget::Account link(budget, true);
    SendBudget::Account host(budget, false);
    link.add(500);
    CHECK(link.has_room());
    CHECK_FALSE(link.held_by_node());
    CHECK(budget.queued() == 500);
    host.add(5);  // under its own budget; the node's is spent and its share is 50
    CHECK(host.has_room());
}

TEST_CASE(
    "send budget: a wake for the node's room runs once, when the node's total falls below its "
    "budget",
    "[send_budget]") {
    SendBudget budget(100, 100);
    int woken = 0;
    budget.when_node_has_room([&] { ++woken; });  // under the budget: at once
    CHECK(woken == 1);
    {
        SendBudget::Account a(budget, false);
        a.add(100);
        budget.when_node_has_room([&] { ++woken; });
        budget.when_node_has_room([&] { ++woken; });
        CHECK(woken == 1);
        a.add(10);
        a.sub(5);  // 105: still spent
        CHECK(woken == 1);
        a.sub(10);  // 95
        CHECK(woken == 3);
        a.sub(10);  // no waiter left: nothing more
        CHECK(woken == 3);
    }  // the account's bytes go with it
    CHECK(budget.queued() == 0);
    CHECK(budget.active() == 0);
}
