#pragma once
// The bytes a node holds queued toward its hosts (issue 44, item 2; docs/protocol.md section
// 7, limits.sendQueueBytes and limits.sendQueueBytesPerConnection): messages that the
// connections' sockets have not taken yet. A host that stops reading must not grow the
// daemon: a connection over its own budget, or over its fair share while the node's budget
// is spent, is no longer fed (its channels' output pumps and its leaseExecute reads park)
// until its socket takes bytes again.
//
// Fair share: the node budget divided by the connections that have bytes queued now. So a
// handful of stalled hosts can take at most the node budget between them, and a host that
// keeps reading always has room for a share of it.
//
// Thread-safety: SendBudget is shared by every connection of the node and is safe from any
// thread (atomics, and a mutex around the waiter list: nothing else is called under it). An
// Account belongs to one connection and is used only on that connection's strand.
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace sandboxd {

class SendBudget {
public:
    /// `node_bytes` and `connection_bytes`: the two budgets, bytes (> 0).
    SendBudget(std::uint64_t node_bytes, std::uint64_t connection_bytes) noexcept
        : node_bytes_(node_bytes), connection_bytes_(connection_bytes) {}
    ~SendBudget() = default;
    SendBudget(const SendBudget&) = delete;
    SendBudget& operator=(const SendBudget&) = delete;
    SendBudget(SendBudget&&) = delete;
    SendBudget& operator=(SendBudget&&) = delete;

    /// Bytes queued on the whole node now.
    [[nodiscard]] std::uint64_t queued() const noexcept {
        return total_.load(std::memory_order_relaxed);
    }
    /// Connections with bytes queued now.
    [[nodiscard]] std::uint32_t active() const noexcept {
        return active_.load(std::memory_order_relaxed);
    }

    /// One connection's share: what it has queued and whether it may be fed more.
    class Account {
    public:
        /// `exempt`: a peer link, which carries many hosts' channels and is bounded by their
        /// credit windows: counted in the node's total, never refused room.
        Account(SendBudget& budget, bool exempt) noexcept : budget_(budget), exempt_(exempt) {}
        ~Account();
        Account(const Account&) = delete;
        Account& operator=(const Account&) = delete;
        Account(Account&&) = delete;
        Account& operator=(Account&&) = delete;

        /// `bytes` were queued / were written (or dropped). Never blocks; sub() may run the
        /// wakes of other connections waiting for the node's budget (when_node_has_room).
        void add(std::uint64_t bytes) noexcept;
        void sub(std::uint64_t bytes);
        [[nodiscard]] std::uint64_t queued() const noexcept { return queued_; }
        /// Whether this connection may be fed more: under its own budget, and under its fair
        /// share when the node's budget is spent. Always true when exempt.
        [[nodiscard]] bool has_room() const noexcept;
        /// Whether the node's budget (not this connection's own) is what keeps it from room.
        [[nodiscard]] bool held_by_node() const noexcept;

    private:
        SendBudget& budget_;
        bool exempt_;
        std::uint64_t queued_ = 0;
    };

    /// Runs `wake` once (from whichever thread releases bytes) the next time the node's total
    /// falls below its budget, or at once when it is below now. `wake` must only post work to
    /// its connection's strand: it runs under no lock of the caller's but may run inside
    /// Account::sub() of another connection.
    void when_node_has_room(std::function<void()> wake);

private:
    void released();
    const std::uint64_t node_bytes_;
    const std::uint64_t connection_bytes_;
    std::atomic<std::uint64_t> total_{0};
    std::atomic<std::uint32_t> active_{0};
    std::atomic<bool> has_waiters_{false};
    std::mutex mutex_;
    std::vector<std::function<void()>> waiters_;
};

}  // namespace sandboxd
