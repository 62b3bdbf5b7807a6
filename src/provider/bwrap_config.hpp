#pragma once
/// @file bwrap_config.hpp
/// A bwrap lease's config (leaseAcquire's `config`: {network?, limits?}), checked against the
/// node's defaults and caps (providers.bwrap.limits). Internal to the provider layer.
///
/// Errors: rpc_error(errc::invalid_params) with `data.field` naming the offending key, e.g.
/// "config.limits.memoryBytes: 34359738368 is above this node's maximum of 17179869184".
/// Pure functions of their arguments; thread-safe; no blocking.

#include <sandboxd/core/config.hpp>

#include "provider/network_policy.hpp"

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
    std::optional<std::uint64_t> io_read_bps;  ///< bytes/s on the workspace disk; absent: none
    std::optional<std::uint64_t> io_write_bps;
    std::optional<std::uint32_t> io_read_iops;  ///< operations/s; absent: none
    std::optional<std::uint32_t> io_write_iops;
    std::optional<std::uint32_t> io_weight;   ///< cgroup v2 only
    std::optional<std::uint64_t> egress_bps;  ///< network bytes/s each way; absent: none

    /// The lease's open-file cap, counted against the node's open-file budget: the lesser of
    /// openFiles x pids (RLIMIT_NOFILE of each of at most `pids` processes) and
    /// memoryBytes / 512 (the kernel charges each open file, about 500 bytes, to the lease's
    /// memory cgroup).
    [[nodiscard]] std::uint64_t open_files_total() const noexcept;

    /// The Lease's `limits` field (with `openFilesTotal`, the cap above).
    nlohmann::json to_json() const;
};

struct LeaseConfig {
    NetworkPolicy network;  ///< absent from the config: mode none
    EffectiveLimits limits;
};

/// What the node says of a lease's network policy.
struct NetworkDefaults {
    bool egress = false;  ///< may a lease have egress (providers.bwrap.network.egress)
    /// What `network: true` stands for: mode egress with the node's default rules.
    NetworkPolicy egress_default{network_mode::egress, {}, {}};
};

/// Parses a lease's provider config (null: the defaults). An egress policy on a node without
/// egress is INVALID_PARAMS naming config.network.
LeaseConfig parse_lease_config(const nlohmann::json& config, const BwrapLimitsConfig& node,
                               const NetworkDefaults& network);

}  // namespace sandboxd::detail
