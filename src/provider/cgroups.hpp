#pragma once
/// @file cgroups.hpp
/// Kernel-enforced limits of the built-in provider: one cgroup per lease, one child cgroup per
/// channel. Internal to the provider layer.
///
/// Two mechanisms, chosen once by probe():
///  - cgroup v2: the unified hierarchy at <root> (a `cgroup2` mount) whose cgroup of this
///    process offers `memory`, `pids` and `cpu` in cgroup.controllers (a systemd service with
///    Delegate=yes). The daemon moves itself into a leaf `<own>/daemon` (the "no internal
///    processes" rule) and enables the controllers on `<own>`'s subtree_control.
///  - cgroup v1: separate hierarchies <root>/memory, <root>/pids, <root>/cpu, <root>/cpuacct
///    and <root>/freezer (co-mounted ones such as "cpu,cpuacct" are found by /proc/self/mounts),
///    writable by this process. This project's test machines have only these.
/// The subtree of this daemon instance is `<this process's cgroup>/<instance>` in every
/// hierarchy used; leases are `<instance>/<lease name>`, channels `<lease>/<channel name>`.
///
/// Limits (v1 file / v2 file):
///  - memory_bytes: memory.limit_in_bytes (and memory.memsw.limit_in_bytes when present, so
///    that swap cannot extend it) / memory.max (and memory.swap.max = 0). tmpfs pages written
///    by the lease's processes are charged to it.
///  - pids: pids.max / pids.max.
///  - cpu_weight 1..10000: cpu.shares = weight * 1024 / 100 (clamped to 2..262144) / cpu.weight.
///  - cpu_quota_percent (of one core): cpu.cfs_quota_us over cpu.cfs_period_us 100000 /
///    cpu.max "<quota> 100000".
///  - io_* on one device (the lease's loop device, MAJ:MIN): blkio.throttle.read_bps_device,
///    write_bps_device, read_iops_device, write_iops_device / io.max "MAJ:MIN rbps= wbps=
///    riops= wiops=". v1 needs the `blkio` hierarchy (optional: without it an io limit is
///    refused). v1 throttling is not hierarchical (checked on this project's kernel: a limit on
///    a parent does not slow a child's writes), so in the blkio hierarchy a lease's channels
///    join the lease's own cgroup: the lease's channels share one budget, as on v2.
///  - io_weight 1..10000: v2 io.weight "default N" only; v1 refuses it (no weight without BFQ).
///
/// Errors: every call that fails throws rpc_error(errc::provider_error) naming the file and
/// the errno text, and leaves nothing half made (a create that fails removes what it made).
/// Thread-safety: a CgroupManager is safe to use from any thread; LeaseCgroup and
/// ChannelCgroup objects are safe for concurrent const calls (usage reads) and otherwise used
/// by one thread at a time. Every call may block briefly on cgroupfs (no network, no waiting
/// on other processes) except kill(), which waits (bounded, see there).

#include <sandboxd/core/unique_fd.hpp>

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd::detail {

enum class cgroup_mode { v1, v2, none };

struct CgroupLimits {
    std::optional<std::uint64_t> memory_bytes;       ///< absent: no limit
    std::optional<std::uint32_t> pids;               ///< absent: no limit
    std::uint32_t cpu_weight = 100;                  ///< 1..10000 (100 is the default share)
    std::optional<std::uint32_t> cpu_quota_percent;  ///< percent of one core, 1..(100 * cores)
    /// The device io_* apply to (the lease's loop device); required when any io_* is set.
    std::optional<dev_t> io_device;
    std::optional<std::uint64_t> io_read_bps;  ///< bytes per second; absent: no limit
    std::optional<std::uint64_t> io_write_bps;
    std::optional<std::uint64_t> io_read_iops;  ///< operations per second; absent: no limit
    std::optional<std::uint64_t> io_write_iops;
    std::optional<std::uint32_t> io_weight;  ///< 1..10000, v2 only
};

struct CgroupUsage {
    std::uint64_t memory_bytes = 0;  ///< memory.usage_in_bytes / memory.current
    std::uint32_t pids = 0;          ///< pids.current
    std::uint64_t cpu_ms = 0;        ///< cpuacct.usage / cpu.stat usage_usec, in milliseconds
};

/// A channel's child cgroup. Destroying it kills what is left in it and removes it
/// (best effort: a directory the kernel still holds is removed with its lease), or, once
/// mark_empty() has said that nothing is left, only removes it (no freeze, no kill: a v1
/// freeze and thaw alone take milliseconds). One cgroup may serve several channels in turn
/// (the bwrap provider keeps emptied ones for the next channels of the lease); its counters
/// then count since it was made, and a user keeps its own baseline.
class ChannelCgroup {
public:
    virtual ~ChannelCgroup() = default;
    /// Says that every process that was in this cgroup has ended (e.g. the channel's init,
    /// PID 1 of the namespace that held them all, has been reaped). The caller vouches for
    /// it; a cgroup that still holds a process then stays until its lease is removed.
    virtual void mark_empty() noexcept = 0;
    /// From now on the destructor leaves the cgroup and its processes as they are: the
    /// channel is kept for the next daemon process (a kept detached channel, issue 47). No
    /// I/O.
    virtual void keep() noexcept = 0;
    /// Forks that failed on a pids limit while made by a process of this cgroup, since it
    /// was made: v1 pids.events "max" of this cgroup (the kernel counts a failed fork in the
    /// forking task's own cgroup there). std::nullopt on v2, which counts them in the
    /// cgroup whose limit was hit (the lease: LeaseCgroup::pids_limit_hits()). One read.
    virtual std::optional<std::uint64_t> own_pids_limit_hits() const noexcept = 0;
    /// The join files of this cgroup in every hierarchy used (v1 `tasks`, v2 cgroup.procs),
    /// opened O_WRONLY|O_CLOEXEC by this (root) process. A single-threaded process that writes
    /// "0" to each joins the cgroup (on v1 the write moves the writing thread only, which
    /// spares the kernel's global threadgroup lock). The kernel checks the opener's
    /// credentials, so an unprivileged process inside a user namespace may use them. Throws
    /// provider_error (or errc::channel_limit on EMFILE/ENFILE).
    virtual std::vector<unique_fd> open_procs() const = 0;
    /// OOM kills of processes in this cgroup since it was made (v1 memory.oom_control
    /// "oom_kill", v2 memory.events "oom_kill"). 0 when unreadable.
    virtual std::uint64_t oom_kills() const noexcept = 0;
    /// Kills every process in this cgroup from outside (v2 cgroup.kill; v1 freeze, SIGKILL
    /// each pid in cgroup.procs, thaw, repeat until empty). Waits at most ~1 s. noexcept: a
    /// failure is logged.
    virtual void kill() noexcept = 0;
};

/// A lease's cgroup. Destroying it kills every process of the lease and removes its cgroups
/// (children first) in every hierarchy.
class LeaseCgroup {
public:
    virtual ~LeaseCgroup() = default;
    /// As ChannelCgroup::open_procs, for the lease's own cgroup (the supervisor joins it).
    virtual std::vector<unique_fd> open_procs() const = 0;
    /// Makes the child cgroup `name` ([A-Za-z0-9_-], 1..64 chars) for a channel.
    virtual std::unique_ptr<ChannelCgroup> create_channel(const std::string& name) = 0;
    /// The child cgroup `name` made earlier (by this or an earlier process: a kept channel
    /// restored after a restart), in every hierarchy; nullptr when it is not there (or the
    /// name is not a channel's).
    virtual std::unique_ptr<ChannelCgroup> find_channel(const std::string& name) = 0;
    /// Current usage. noexcept: unreadable fields are 0.
    virtual CgroupUsage usage() const noexcept = 0;
    /// Times a fork in this lease failed on its pids limit (v1 and v2 pids.events "max").
    virtual std::uint64_t pids_limit_hits() const noexcept = 0;
    /// Kills every process of the lease, channels included (v2 cgroup.kill; v1 freezer:
    /// freeze, SIGKILL every pid of the subtree, thaw, until empty). Waits at most ~2 s.
    virtual void kill() noexcept = 0;
    /// From now on the destructor leaves the cgroup and its processes as they are: the
    /// sandbox is kept for the next daemon process (BwrapProvider, adoption). No I/O.
    virtual void keep() noexcept = 0;
};

class CgroupManager {
public:
    virtual ~CgroupManager() = default;
    virtual cgroup_mode mode() const noexcept = 0;
    /// One line for the start-up log, e.g. "cgroup v1 (memory, pids, cpu, cpuacct, freezer)
    /// under /sys/fs/cgroup/memory/process_api/x/sandboxd-ab12cd34", or the reason neither
    /// v2 nor v1 can be used.
    virtual std::string describe() const = 0;
    /// Whether create_lease can apply io_* throttles (v1: a blkio hierarchy; v2: the io
    /// controller) and io_weight (v2 with the io controller only).
    virtual bool io_throttle() const noexcept = 0;
    virtual bool io_weight() const noexcept = 0;
    /// Kills every process left in this instance's subtree (a previous process with the same
    /// instance name that was killed) and removes the cgroups, except the lease cgroups for
    /// whose name `keep` is true (a sandbox that the next process may re-adopt). Returns how
    /// many lease cgroups were removed. Call before serving.
    virtual std::size_t remove_orphans(const std::function<bool(const std::string&)>& keep) = 0;
    /// Makes the lease cgroup `name` ([A-Za-z0-9_-], 1..64 chars) with `limits` set.
    /// Throws provider_error (an existing cgroup of that name is an error; so is an io limit
    /// this machine cannot apply, see io_throttle() and io_weight()).
    virtual std::unique_ptr<LeaseCgroup> create_lease(const std::string& name,
                                                      const CgroupLimits& limits) = 0;
    /// The lease cgroup `name` made earlier (by this or a previous process), to kill and
    /// remove it; nullptr when it does not exist.
    virtual std::unique_ptr<LeaseCgroup> find_lease(const std::string& name) = 0;
};

/// Probes the machine under `root` (normally /sys/fs/cgroup) and returns a manager for v2,
/// else v1, else one whose mode() is none (create_lease then throws provider_error).
/// `instance` ([A-Za-z0-9_-], 1..64 chars) names this daemon's subtree. Never throws for an
/// unusable machine; throws provider_error only when the subtree cannot be made although a
/// mechanism was found.
std::unique_ptr<CgroupManager> probe_cgroups(const std::string& instance,
                                             const std::filesystem::path& root = "/sys/fs/cgroup");

}  // namespace sandboxd::detail
