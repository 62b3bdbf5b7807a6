#pragma once
// The lease methods of docs/protocol.md section 2 and the fail-closed checks of section 3.
// Coroutines run on the caller's strand; blocking registry and provider calls run on the
// node's blocking pool. Errors are thrown as rpc_error with the protocol's reasons.
#include "server/node.hpp"

#include <nlohmann/json.hpp>

namespace sandboxd {

awaitable<Lease> lease_acquire(Node& node, const Principal& who, nlohmann::json params);
awaitable<Lease> lease_get(Node& node, const Principal& who, std::string lease_id);
awaitable<nlohmann::json> lease_list(Node& node, const Principal& who, nlohmann::json params);
awaitable<Lease> lease_renew(Node& node, const Principal& who, std::string lease_id,
                             std::uint64_t ttl_ms);
awaitable<Lease> lease_release(Node& node, const Principal& who, std::string lease_id);
awaitable<nlohmann::json> node_list(Node& node);

/// What the open checks resolved: the lease as registered and the cached sandbox.
struct ResolvedOpen {
    Lease lease;
    std::shared_ptr<SandboxHandle> sandbox;
};

/// Checks 2-6 of protocol section 3 for `lease_param` (the open's `lease` object). Step 2
/// (LEASE_INCOMPLETE) runs before anything else touches the registry or a provider.
awaitable<ResolvedOpen> resolve_open(Node& node, const Principal& who,
                                     nlohmann::json lease_param);

/// Releases leases of this node that expired (status `expired`); run by the sweeper.
awaitable<void> expire_leases(Node& node);

/// Ends every channel of `lease_id` on this node with outcome leaseReleased and waits (at
/// most `wait`) until their processes are gone.
awaitable<void> end_lease_channels(Node& node, const std::string& lease_id,
                                   std::chrono::milliseconds wait);

}  // namespace sandboxd
