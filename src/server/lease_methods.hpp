#pragma once
// The handlers of the lease and node methods (docs/protocol.md sections 2 and 6), as the
// method table (method_table.cpp) calls them: typed params in, the lease service
// (lease_service.hpp) or the lease's owner (a peer link) doing the work.
//
// Threading: on the connection's strand.
#include "server/connection.hpp"
#include "server/methods.hpp"
#include "server/peer_link.hpp"

#include <sandboxd/core/net.hpp>

#include <chrono>
#include <optional>
#include <string>

namespace sandboxd::handlers {

/// Params of a method that takes none (nodeList): whatever it is given is ignored.
struct NoParams {};

awaitable<MethodReply> initialize(Connection& c, MethodCall& call,
                                  methods::InitializeParams params);
awaitable<MethodReply> lease_acquire(Connection& c, MethodCall& call,
                                     methods::LeaseAcquireParams params);
awaitable<MethodReply> lease_get(Connection& c, MethodCall& call, methods::LeaseIdParams params);
awaitable<MethodReply> lease_list(Connection& c, MethodCall& call, LeaseQuery params);
awaitable<MethodReply> lease_renew(Connection& c, MethodCall& call,
                                   methods::LeaseRenewParams params);
awaitable<MethodReply> lease_release(Connection& c, MethodCall& call,
                                     methods::LeaseReleaseParams params);
awaitable<MethodReply> lease_probe(Connection& c, MethodCall& call, methods::LeaseIdParams params);
awaitable<MethodReply> lease_update_network(Connection& c, MethodCall& call,
                                            methods::LeaseUpdateNetworkParams params);
awaitable<MethodReply> lease_execute(Connection& c, MethodCall& call,
                                     methods::ExecuteParams params);
awaitable<MethodReply> lease_realize_workspace(Connection& c, MethodCall& call,
                                               methods::RealizeWorkspaceParams params);
awaitable<MethodReply> provider_validate_config(Connection& c, MethodCall& call,
                                                methods::ValidateConfigParams params);
awaitable<MethodReply> node_list(Connection& c, MethodCall& call, NoParams params);

/// Renewals, releases, probes, executes and workspaces of a lease owned by another node are
/// answered by the owner (so that its cache and channels follow); nullopt when this node
/// answers: it owns the lease, the lease is settled (held by no node), or the call was
/// forwarded here already. `orphan_if_owner_dead`: a release whose owner is unreachable
/// orphans the lease instead (it waits for cleanup). `notify` and `answer_within` as
/// PeerLink::call's, for a call that streams.
awaitable<std::optional<MethodReply>> at_owner(
    Connection& c, const MethodCall& call, const std::string& lease_id,
    bool orphan_if_owner_dead = false, std::optional<PeerLink::Notify> notify = std::nullopt,
    std::chrono::milliseconds answer_within = std::chrono::milliseconds(0));

}  // namespace sandboxd::handlers
