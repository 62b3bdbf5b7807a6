#pragma once
// Decorators that time every registry call and provider operation into the node's metrics
// (sandboxd_registry_call_seconds, sandboxd_registry_errors_total,
// sandboxd_provider_operation_seconds, sandboxd_provider_failures_total). Each forwards every
// call unchanged to what it wraps: results, exceptions, blocking and thread-safety are the
// wrapped object's.
#include "server/node_metrics.hpp"

#include <sandboxd/provider/provider.hpp>
#include <sandboxd/registry/registry.hpp>

#include <memory>

namespace sandboxd {

/// `inner` with each awaitable call timed (label op = the call's name, e.g. "update_lease") and
/// each exception counted as a registry error. `metrics` must outlive the result.
std::unique_ptr<Registry> metered_registry(std::unique_ptr<Registry> inner, NodeMetrics& metrics);

/// `inner` with create, destroy, open, resume, stop, probe, execute, realize_workspace and
/// validate_config timed (labels provider = its key, op = the operation) and their failures
/// counted, except errc::invalid_params (the caller's mistake, not the provider's).
/// `metrics` must outlive the result.
std::unique_ptr<Provider> metered_provider(std::unique_ptr<Provider> inner, NodeMetrics& metrics);

}  // namespace sandboxd
