#pragma once
/// @file bwrap_sandbox.hpp
/// One sandbox of the bubblewrap provider (bwrap_provider_impl.hpp), internal to the provider
/// layer: its supervisor process and socket, its cgroups and what it takes from the node's
/// budgets (BwrapSandbox), the turns its requests take (Turns), the resources of one of its
/// channels (BwrapChannelResources), and where a sandbox dropped without a teardown ends its
/// processes (TeardownLane). The teardown itself is in bwrap_sandbox.cpp.

#include <sandboxd/core/async.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/provider/provider.hpp>

#include "provider/bwrap_config.hpp"
#include "provider/cgroups.hpp"
#include "provider/lease_network.hpp"
#include "provider/node_budget.hpp"
#include "provider/process_backend.hpp"
#include "provider/spawn.hpp"

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace sandboxd::bwrap {

namespace fs = std::filesystem;
using detail::EffectiveLimits;

/// Requests to one supervisor take turns (its replies come in request order), and a request
/// that waits for its turn holds no thread: it waits on a timer of its own executor, which
/// the request before it wakes. Thread-safe; each waiter must run on a strand or a
/// single-threaded io_context (the wake is posted there, after the waiter has suspended).
class Turns {
public:
    /// Completes once it is the caller's turn; give it back with leave().
    awaitable<void> enter() {
        auto executor = co_await net::this_coro::executor;
        auto timer = std::make_shared<net::steady_timer>(executor);
        timer->expires_at(net::steady_timer::time_point::max());
        bool mine = false;
        {
            std::lock_guard lock(mutex_);
            mine = !busy_;
            busy_ = true;
            if (!mine) waiting_.push_back(timer);
        }
        // Woken (cancelled) by the leave() of the request before this one.
        if (!mine) co_await timer->async_wait(as_tuple_awaitable);
    }

    /// Hands the turn to the next waiter that is still there, else frees it.
    void leave() {
        std::lock_guard lock(mutex_);
        while (!waiting_.empty()) {
            auto next = waiting_.front().lock();
            waiting_.pop_front();
            if (!next) continue;  // its coroutine is gone
            net::post(next->get_executor(), [next] { next->cancel(); });
            return;
        }
        busy_ = false;
    }

private:
    std::mutex mutex_;
    bool busy_ = false;
    std::deque<std::weak_ptr<net::steady_timer>> waiting_;
};

/// Counters shared by the provider and its channels' resources.
struct Counters {
    std::atomic<std::uint64_t> memory{0};
    std::atomic<std::uint64_t> pids{0};
};

/// A channel's cgroup, taken for one channel, with the counts it had when taken: a spare one
/// has served earlier channels, and its counts were read when it was put back (nothing runs
/// in it between), so that taking it reads nothing.
struct TakenCgroup {
    std::unique_ptr<detail::ChannelCgroup> cgroup;
    std::uint64_t oom_kills_before = 0;
    std::uint64_t pids_hits_before = 0;
};

/// Where a sandbox dropped without a teardown ends its processes: the provider's pool while
/// the provider runs, so that the wait for bubblewrap (up to BwrapSandbox::bwrap_exit_grace_ms)
/// and its reaping stay off the thread that dropped the last reference (a channel's end on a
/// connection's strand, an I/O thread); the dropping thread itself once the provider stops
/// (it joins its pool: nothing else is served then). Thread-safe.
class TeardownLane {
public:
    explicit TeardownLane(net::thread_pool& pool) : pool_(pool) {}

    /// Runs `f` (which must not throw) on the pool, or here once the lane is closed.
    void run(std::function<void()> f) noexcept {
        {
            std::lock_guard lock(mutex_);
            if (open_) {
                try {
                    net::post(pool_, std::move(f));
                    return;
                } catch (...) {  // out of memory: run it here instead
                }
            }
        }
        f();
    }

    /// From the provider's destructor, before it joins the pool.
    void close() noexcept {
        std::lock_guard lock(mutex_);
        open_ = false;
    }

    /// From the daemon's stop when it keeps its sandboxes for the next process
    /// (Provider::keep_at_stop): a sandbox dropped from then on is let go, not ended.
    void keep() noexcept { keep_.store(true); }
    bool keeping() const noexcept { return keep_.load(); }

private:
    net::thread_pool& pool_;
    std::mutex mutex_;
    bool open_ = true;
    std::atomic<bool> keep_{false};
};

/// A running sandbox: its supervisor, cgroup and identity.
class BwrapSandbox final : public SandboxState {
public:
    BwrapSandbox() = default;
    BwrapSandbox(const BwrapSandbox&) = delete;
    BwrapSandbox& operator=(const BwrapSandbox&) = delete;
    /// Ends what is left (shutdown(true)): on `lane` when there is one, with the processes,
    /// cgroups and mount handed to a sandbox of its own there; else here. Once the lane is
    /// keeping (the daemon stops and keeps its sandboxes), it only closes its descriptors:
    /// the supervisor then waits for the next daemon (supervisor_protocol.hpp, adoption).
    ~BwrapSandbox() override;

    /// Ends every process of the sandbox and reaps bubblewrap; with `unmount`, also unmounts
    /// the workspace disk (its image stays, for a later teardown). Idempotent. May block
    /// briefly (the cgroup kill waits for the processes to go).
    void shutdown(bool unmount = false) noexcept;

    /// How long bubblewrap has to exit by itself once the supervisor is killed, ms.
    static constexpr int bwrap_exit_grace_ms = 2000;

    /// Whether bubblewrap (and so the supervisor, PID 1 inside) still runs and its socket
    /// is in step. A poll of its pidfd (the supervisor's, for an adopted sandbox: its
    /// bubblewrap is no child of this process); no wait.
    bool supervisor_alive() {
        std::lock_guard lock(mutex);
        const int watched = pid > 0 ? pidfd.get() : supervisor_pidfd.get();
        if (watched < 0 || broken || !socket) return false;
        pollfd p{watched, POLLIN, 0};
        return ::poll(&p, 1, 0) == 0;  // readable: it has exited
    }

    fs::path workspace;  ///< the mount point on the host

    Turns turns;       ///< one request in flight on the socket
    std::mutex mutex;  ///< guards the fields below (never held across a wait)
    /// An adopted sandbox's /workspace as the sandbox sees it (its supervisor's welcome):
    /// under systemd the disk is no longer mounted in this process's mount namespace, and
    /// usage() reads it here. Empty for a sandbox this process made.
    unique_fd workspace_root;
    pid_t pid = -1;  ///< bubblewrap, our child; -1 once reaped, and for an adopted sandbox
    unique_fd pidfd;
    unique_fd socket;  ///< the daemon's end of the supervisor's socket pair
    /// The supervisor (PID 1 of the lease's namespaces, bubblewrap's child), from its hello:
    /// its death ends every process of the sandbox. Empty before the hello and after shutdown.
    unique_fd supervisor_pidfd;
    std::uint64_t next_request = 1;
    /// The prefix of its channels' cgroup names: "ch-" for a sandbox this process made; for
    /// one it adopted, a prefix of its own, apart from the emptied cgroups its maker kept.
    std::string channel_prefix = "ch-";
    bool broken = false;  ///< a request timed out: the replies may be out of step
    /// The supervisor's protocol version (supervisor_protocol.hpp): this build's for a sandbox
    /// this process made, its welcome's for an adopted one. Kept channels need 3 or later.
    std::uint32_t supervisor_version = 0;
    /// The ends of the channels an earlier process kept (ExecSpec::keep_key), handed back at
    /// the adoption, by key, until the daemon takes them (take_kept_channel). Each array is
    /// indexed by supervisor::held_slot; an absent end is empty. Under `mutex`.
    std::map<std::string, std::vector<unique_fd>> kept_channels;

    std::unique_ptr<detail::LeaseCgroup> cgroup;  ///< null when limits are not enforced
    /// The lease's network: removed once its processes are gone (shutdown), kept as it is for
    /// the next process when the daemon keeps its sandboxes.
    std::unique_ptr<detail::LeaseNetwork> network;
    /// Emptied channel cgroups of this lease, for its next channels: a channel then opens
    /// the five join files of one of them instead of making (and later freezing,
    /// killing and removing) a cgroup in five hierarchies. With their counts as they were
    /// put back. Under `mutex`; at most max_spare_cgroups.
    std::vector<TakenCgroup> spare_cgroups;
    static constexpr std::size_t max_spare_cgroups = 16;
    EffectiveLimits limits;
    /// What this lease takes from the node's budgets, given back once (release_budget()).
    std::shared_ptr<detail::NodeBudget> budget;
    detail::BudgetShare budget_share;
    std::atomic<bool> budget_held{false};
    void release_budget() noexcept {
        if (budget && budget_held.exchange(false)) budget->give_back(budget_share);
    }
    std::atomic<std::uint64_t> pids_hits_seen{0};
    std::atomic<std::uint64_t> channels{0};
    /// Where the destructor ends what is left (the provider's); null: the destructor itself.
    std::shared_ptr<TeardownLane> lane;
};

class BwrapChannelResources final : public detail::ChannelResources {
public:
    BwrapChannelResources(TakenCgroup cgroup, std::shared_ptr<BwrapSandbox> sandbox,
                          std::shared_ptr<Counters> counters)
        : cgroup_(std::move(cgroup)),
          sandbox_(std::move(sandbox)),
          counters_(std::move(counters)) {}

    std::string limit_hit(int term_signal) noexcept override {
        // One read each: the channel's own count where the kernel keeps it there (v1), else
        // the lease's (v2), never a walk over the lease's channels.
        const auto own = cgroup_.cgroup ? cgroup_.cgroup->own_pids_limit_hits() : std::nullopt;
        if (own) {
            if (*own > cgroup_.pids_hits_before) counters_->pids += *own - cgroup_.pids_hits_before;
            cgroup_.pids_hits_before = *own;
        } else if (sandbox_->cgroup) {
            const auto hits = sandbox_->cgroup->pids_limit_hits();
            const auto seen = sandbox_->pids_hits_seen.exchange(hits);
            if (hits > seen) counters_->pids += hits - seen;
        }
        if (cgroup_.cgroup && term_signal == SIGKILL &&
            cgroup_.cgroup->oom_kills() > cgroup_.oom_kills_before) {
            ++counters_->memory;
            return "memory";
        }
        return {};
    }

    /// The channel outlives this process (a kept channel whose daemon stops): its cgroup is
    /// left as it is.
    void keep() noexcept override {
        if (cgroup_.cgroup) cgroup_.cgroup->keep();
    }

    void release(bool processes_gone) noexcept override {
        if (!cgroup_.cgroup || !processes_gone) return;  // killed and removed by its destructor
        cgroup_.cgroup->mark_empty();
        // The next channel's baselines, read now that this channel has ended, rather than on
        // the next open's path (nothing runs in the cgroup until then).
        cgroup_.oom_kills_before = cgroup_.cgroup->oom_kills();
        cgroup_.pids_hits_before = cgroup_.cgroup->own_pids_limit_hits().value_or(0);
        std::lock_guard lock(sandbox_->mutex);
        // Not once the lease is being destroyed (its cgroup is gone or going).
        if (sandbox_->pid > 0 && sandbox_->cgroup &&
            sandbox_->spare_cgroups.size() < BwrapSandbox::max_spare_cgroups) {
            sandbox_->spare_cgroups.push_back(std::move(cgroup_));
        }
    }

private:
    TakenCgroup cgroup_;
    std::shared_ptr<BwrapSandbox> sandbox_;
    std::shared_ptr<Counters> counters_;
};

}  // namespace sandboxd::bwrap
