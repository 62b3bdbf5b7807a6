#pragma once
/// @file node_budget.hpp
/// The node's share of the host's kernel-wide tables (docs/security.md, "Limits"): how many
/// pids and open files the caps of its leases may add up to. Internal to the provider layer.
///
/// Budgets are derived once, at start, from kernel.pid_max and fs.file-max, each less a reserve
/// for the host (an eighth, at least 1,024 pids and 65,536 files), times the configured
/// overcommit (providers.bwrap.limits.overcommit): a lease's caps are upper bounds that few
/// leases reach at once.
///
/// Thread-safety: every call may be made from any thread. No blocking but read_host().

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>

namespace sandboxd::detail {

/// What one lease's caps take from the budgets.
struct BudgetShare {
    std::uint64_t pids = 0;        ///< its pids limit
    std::uint64_t open_files = 0;  ///< its open-file cap (EffectiveLimits::open_files_total)
};

class NodeBudget {
public:
    /// Budgets from kernel/pid_max and fs/file-max under `proc_sys` (normally /proc/sys),
    /// `overcommit` 1..1000. Throws std::runtime_error naming the file that cannot be read or
    /// parsed.
    static std::unique_ptr<NodeBudget> read_host(const std::filesystem::path& proc_sys,
                                                 std::uint32_t overcommit);
    /// Budgets from the given host values (a reserve is taken off as above).
    NodeBudget(std::uint64_t pid_max, std::uint64_t file_max, std::uint32_t overcommit);

    /// Takes `share`, or throws rpc_error(errc::channel_limit) with data.limit "nodePids" or
    /// "nodeOpenFiles" naming the budget it would exceed, the budget's derivation and what is
    /// held; then nothing is taken.
    void take(const BudgetShare& share);
    /// Gives back what take() took (exactly once per take). noexcept.
    void give_back(const BudgetShare& share) noexcept;

    /// One line for the start log: each budget, how it was derived, the overcommit.
    [[nodiscard]] std::string describe() const;
    /// What the node's leases hold now.
    [[nodiscard]] BudgetShare held() const;

private:
    std::uint64_t pid_max_, file_max_, pid_reserve_, file_reserve_;
    std::uint32_t overcommit_;
    std::uint64_t pids_limit_, files_limit_;  ///< (host value - reserve) x overcommit
    mutable std::mutex mutex_;
    BudgetShare held_;  ///< under mutex_
};

}  // namespace sandboxd::detail
