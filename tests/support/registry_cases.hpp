#pragma once
// The registry cases (idempotency key scopes, list_leases) that the SQLite registry's unit tests
// (tests/unit/registry_test.cpp) and the contract suite over every backend
// (tests/integration/registry_contract_test.cpp) both check, written once: each function is the
// body of a test case, run on an empty registry, and reports through Catch (CHECK/REQUIRE,
// SECTIONs). Plus the helpers those bodies use.
#include "support/sync_registry.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/registry/registry.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd::test {

/// An active lease `id` of `company` in `environment`, owned by node-a, acquired (and last used)
/// at `acquired_at_ms`, provider bwrap, with metadata {pluginId, provider}.
inline Lease make_lease(const std::string& id, const std::string& company = "co-1",
                        const std::string& environment = "env-1",
                        std::int64_t acquired_at_ms = 1000) {
    Lease l;
    l.id = id;
    l.company_id = company;
    l.environment_id = environment;
    l.provider = "bwrap";
    l.provider_lease_id = "pl-" + id;
    l.owner_node_id = "node-a";
    l.acquired_at_ms = acquired_at_ms;
    l.last_used_at_ms = acquired_at_ms;
    l.metadata = {{"pluginId", "plugin-x"}, {"provider", "bwrap"}};
    return l;
}

/// The rpc_error that `f()` throws, or nullopt when it returns.
template <typename F>
std::optional<rpc_error> rpc_error_of(F&& f) {
    try {
        f();
    } catch (const rpc_error& e) {
        return e;
    }
    return std::nullopt;
}

/// The ids of `leases`, in their order.
inline std::vector<std::string> ids_of(const std::vector<Lease>& leases) {
    std::vector<std::string> ids;
    ids.reserve(leases.size());
    for (const auto& l : leases) ids.push_back(l.id);
    return ids;
}

/// The ids of the first page (at most 1,000 leases) of `query`.
inline std::vector<std::string> ids_of(SyncRegistry& registry, LeaseQuery query) {
    query.limit = 1000;
    return ids_of(registry.list_leases(query).leases);
}

/// One idempotency key in three (company, environment) scopes makes three leases; leases without
/// a key never clash; find_by_idempotency_key finds each in its scope.
inline void check_idempotency_key_scopes(SyncRegistry& registry) {
    Lease a = make_lease("lease-a", "co-1", "env-1");
    Lease b = make_lease("lease-b", "co-2", "env-1");
    Lease c = make_lease("lease-c", "co-1", "env-2");
    for (auto* l : {&a, &b, &c}) l->idempotency_key = "shared-key";

    CHECK(registry.create_lease(a).id == "lease-a");
    CHECK(registry.create_lease(b).id == "lease-b");
    CHECK(registry.create_lease(c).id == "lease-c");

    // Leases without a key never clash with each other.
    CHECK(registry.create_lease(make_lease("lease-d")).id == "lease-d");
    CHECK(registry.create_lease(make_lease("lease-e")).id == "lease-e");

    CHECK(ids_of(registry, {}) ==
          std::vector<std::string>{"lease-a", "lease-b", "lease-c", "lease-d", "lease-e"});
    CHECK(registry.find_by_idempotency_key("co-2", "env-1", "shared-key")->id == "lease-b");
    CHECK(registry.find_by_idempotency_key("co-1", "env-2", "shared-key")->id == "lease-c");
}

/// list_leases over four leases in two companies, environments, statuses and owners: each
/// filter, tenants, their combinations, and a query that matches nothing.
inline void check_list_filters(SyncRegistry& registry) {
    Lease l1 = make_lease("l1", "co-1", "env-1", 100);
    Lease l2 = make_lease("l2", "co-1", "env-2", 200);
    l2.status = lease_status::released;
    Lease l3 = make_lease("l3", "co-2", "env-1", 300);
    l3.owner_node_id = "node-b";
    Lease l4 = make_lease("l4", "co-3", "env-1", 400);
    l4.owner_node_id = "node-b";
    l4.status = lease_status::released;
    for (const auto& l : {l4, l2, l3, l1}) registry.create_lease(l);

    using ids = std::vector<std::string>;
    CHECK(ids_of(registry, {}) == ids{"l1", "l2", "l3", "l4"});

    LeaseQuery q;
    q.company_id = "co-1";
    CHECK(ids_of(registry, q) == ids{"l1", "l2"});

    q = {};
    q.environment_id = "env-1";
    CHECK(ids_of(registry, q) == ids{"l1", "l3", "l4"});

    q = {};
    q.status = lease_status::released;
    CHECK(ids_of(registry, q) == ids{"l2", "l4"});

    q = {};
    q.owner_node_id = "node-b";
    CHECK(ids_of(registry, q) == ids{"l3", "l4"});

    q = {};
    q.tenants = {"co-1", "co-3"};
    CHECK(ids_of(registry, q) == ids{"l1", "l2", "l4"});

    q = {};
    q.tenants = {"co-2"};
    q.status = lease_status::active;
    CHECK(ids_of(registry, q) == ids{"l3"});

    q = {};
    q.tenants = {"co-1"};
    q.company_id = "co-2";
    CHECK(ids_of(registry, q).empty());

    q = {};
    q.company_id = "co-1";
    q.environment_id = "env-1";
    q.status = lease_status::active;
    q.owner_node_id = "node-a";
    CHECK(ids_of(registry, q) == ids{"l1"});

    q = {};
    q.company_id = "co-none";
    auto empty = registry.list_leases(q);
    CHECK(empty.leases.empty());
    CHECK(empty.next_cursor.empty());
}

/// 250 leases (three to an acquiredAt) paged 100 at a time: each exactly once, in (acquiredAt,
/// id) order, no cursor after the last page, filters applied on every page (two SECTIONs).
inline void check_list_pages(SyncRegistry& registry) {
    // Three leases share each acquiredAt, so the id breaks ties; inserted in reverse order.
    std::vector<std::string> want;
    for (int i = 0; i < 250; ++i) {
        char id[16];
        std::snprintf(id, sizeof id, "lease-%03d", i);
        want.emplace_back(id);
    }
    for (int i = 249; i >= 0; --i) {
        registry.create_lease(
            make_lease(want[static_cast<std::size_t>(i)], "co-1", "env-1", 1000 + i / 3));
    }

    LeaseQuery q;
    q.limit = 100;
    std::vector<std::string> got;
    std::vector<std::size_t> page_sizes;
    for (int pages = 0; pages < 10; ++pages) {
        auto page = registry.list_leases(q);
        page_sizes.push_back(page.leases.size());
        for (const auto& l : page.leases) got.push_back(l.id);
        if (page.next_cursor.empty()) break;
        q.cursor = page.next_cursor;
    }
    CHECK(page_sizes == std::vector<std::size_t>{100, 100, 50});
    CHECK(got == want);

    SECTION("a page that ends exactly at the last lease has no next cursor") {
        LeaseQuery all;
        all.limit = 250;
        auto page = registry.list_leases(all);
        CHECK(page.leases.size() == 250);
        CHECK(page.next_cursor.empty());
    }
    SECTION("filters apply on every page") {
        LeaseQuery f;
        f.limit = 1;
        f.company_id = "co-1";
        auto p1 = registry.list_leases(f);
        REQUIRE(p1.leases.size() == 1);
        CHECK(p1.leases[0].id == "lease-000");
        f.cursor = p1.next_cursor;
        f.company_id = "co-2";
        auto p2 = registry.list_leases(f);
        CHECK(p2.leases.empty());
        CHECK(p2.next_cursor.empty());
    }
}

/// 1,001 leases: a limit of 0 gives one, of 5,000 gives 1,000 and a cursor to the last one.
inline void check_list_limit_clamped(SyncRegistry& registry) {
    for (int i = 0; i < 1001; ++i) {
        registry.create_lease(make_lease("lease-" + std::to_string(10000 + i), "co-1", "env-1", i));
    }
    LeaseQuery q;
    q.limit = 0;
    auto one = registry.list_leases(q);
    REQUIRE(one.leases.size() == 1);
    CHECK(one.leases[0].id == "lease-10000");
    CHECK_FALSE(one.next_cursor.empty());

    q.limit = 5000;
    auto most = registry.list_leases(q);
    REQUIRE(most.leases.size() == 1000);
    CHECK(most.leases.back().id == "lease-10999");
    q.cursor = most.next_cursor;
    auto rest = registry.list_leases(q);
    REQUIRE(rest.leases.size() == 1);
    CHECK(rest.leases[0].id == "lease-11000");
    CHECK(rest.next_cursor.empty());
}

/// Malformed cursors are invalid_params "cursor: malformed"; a well-formed one past every
/// lease is the end.
inline void check_malformed_cursors(SyncRegistry& registry) {
    registry.create_lease(make_lease("lease-1"));

    for (std::string cursor : {"garbage", "123", ":lease-1", "123:", "12x:lease-1", " 1:lease-1",
                               "99999999999999999999999:lease-1"}) {
        CAPTURE(cursor);
        LeaseQuery q;
        q.cursor = cursor;
        auto err = rpc_error_of([&] { registry.list_leases(q); });
        REQUIRE(err);
        CHECK(err->code() == errc::invalid_params);
        CHECK(std::string(err->what()) == "cursor: malformed");
    }

    // A well-formed cursor past every lease is simply the end.
    LeaseQuery q;
    q.cursor = "1000:lease-1";
    auto page = registry.list_leases(q);
    CHECK(page.leases.empty());
    CHECK(page.next_cursor.empty());
}

}  // namespace sandboxd::test
