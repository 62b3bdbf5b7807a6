#pragma once
/// @file bwrap_config.hpp
/// A bwrap lease's config (leaseAcquire's `config`: {network?, limits?}), checked against the
/// node's defaults and caps (providers.bwrap.limits). Internal to the provider layer.
///
/// Errors: rpc_error(errc::invalid_params) with `data.field` naming the offending key, e.g.
/// "config.limits.memoryBytes: 34359738368 is above this node's maximum of 17179869184".
/// Pure functions of their arguments; thread-safe; no blocking.

#include <sandboxd/core/config.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>

namespace sandboxd::detail {

/// The limits a lease runs with: every one set (docs/security.md, "Limits").
struct EffectiveLimits {
    std::uint64_t memory_bytes = 0;
    std::uint32_t pids = 0;
    std::uint32_t cpu_weight = 100;
    std::optional<std::uint32_t> cpu_quota_percent;
    std::uint64_t disk_bytes = 0;
    std::uint32_t open_files = 0;

    /// The Lease's `limits` field.
    nlohmann::json to_json() const;
};

struct LeaseConfig {
    bool network = false;
    EffectiveLimits limits;
};

/// Parses a lease's provider config (null: the defaults). `allow_network`: whether
/// `network: true` may be asked for on this node.
LeaseConfig parse_lease_config(const nlohmann::json& config, const BwrapLimitsConfig& node,
                               bool allow_network);

}  // namespace sandboxd::detail
