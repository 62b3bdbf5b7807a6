#pragma once
// What the lease operations (lease_service.cpp) and the sweeper (sweeper.cpp) share: a
// lease's provider, its audit line, paged listings and the teardown that records its outcome.
// Private to the server layer. Threading: on the node's executors, like lease_service.hpp.
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace sandboxd::lease_ops {

/// The node's provider under `key`, or nullptr.
Provider* provider_of(Node& node, const std::string& key);
/// Appends a lease.* line to the audit trail (when one is configured).
void audit_lease(Node& node, std::string_view event, const Lease& lease, std::string_view actor);
/// Every lease that `q` matches, all pages.
awaitable<std::vector<Lease>> all_leases(Node& node, LeaseQuery q);
/// Tears the sandbox down and records the outcome: released (or `final_status`), or
/// pending_cleanup with the failure. Returns the stored lease.
awaitable<Lease> teardown(Node& node, Lease lease, lease_status final_status, std::string actor);

}  // namespace sandboxd::lease_ops
