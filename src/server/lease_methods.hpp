#pragma once
// The handlers of the lease and node methods (docs/protocol.md sections 2 and 6), as the
// method table (method_table.cpp) calls them: typed params in, the lease service
// (lease_service.hpp) or the lease's owner (a peer link) doing the work.
//
// Threading: on the connection's strand.
#include "server/connection.hpp"
#include "server/methods.hpp"

#include <sandboxd/core/net.hpp>

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
awaitable<MethodReply> lease_execute(Connection& c, MethodCall& call,
                                     methods::ExecuteParams params);
awaitable<MethodReply> lease_realize_workspace(Connection& c, MethodCall& call,
                                               methods::RealizeWorkspaceParams params);
awaitable<MethodReply> provider_validate_config(Connection& c, MethodCall& call,
                                                methods::ValidateConfigParams params);
awaitable<MethodReply> node_list(Connection& c, MethodCall& call, NoParams params);

}  // namespace sandboxd::handlers
