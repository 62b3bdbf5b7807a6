#include "server/send_budget.hpp"

#include <algorithm>
#include <utility>

namespace sandboxd {

SendBudget::Account::~Account() {
    if (queued_ > 0) sub(queued_);
}

void SendBudget::Account::add(std::uint64_t bytes) noexcept {
    if (bytes == 0) return;
    if (queued_ == 0) budget_.active_.fetch_add(1, std::memory_order_relaxed);
    queued_ += bytes;
    budget_.total_.fetch_add(bytes);
}

void SendBudget::Account::sub(std::uint64_t bytes) {
    bytes = std::min(bytes, queued_);
    if (bytes == 0) return;
    queued_ -= bytes;
    if (queued_ == 0) budget_.active_.fetch_sub(1, std::memory_order_relaxed);
    budget_.total_.fetch_sub(bytes);  // before released() reads the waiters (seq_cst)
    budget_.released();
}

bool SendBudget::Account::has_room() const noexcept {
    if (exempt_) return true;
    if (queued_ >= budget_.connection_bytes_) return false;
    return !held_by_node();
}

bool SendBudget::Account::held_by_node() const noexcept {
    if (exempt_ || queued_ == 0) return false;
    if (budget_.total_.load() < budget_.node_bytes_) return false;
    const std::uint64_t active =
        std::max<std::uint32_t>(1, budget_.active_.load(std::memory_order_relaxed));
    return queued_ >= budget_.node_bytes_ / active;
}

void SendBudget::when_node_has_room(std::function<void()> wake) {
    {
        std::lock_guard lock(mutex_);
        if (total_.load() >= node_bytes_) {
            waiters_.push_back(std::move(wake));
            has_waiters_.store(true);
            // Read again after the flag is set (all seq_cst): a release that read the flag
            // before it was set took its bytes off before this read, which then sees them gone.
            if (total_.load() >= node_bytes_) return;
            wake = std::move(waiters_.back());
            waiters_.pop_back();
        }
    }
    wake();
}

void SendBudget::released() {
    if (!has_waiters_.load()) return;
    if (total_.load() >= node_bytes_) return;
    std::vector<std::function<void()>> woken;
    {
        std::lock_guard lock(mutex_);
        woken.swap(waiters_);
        has_waiters_.store(false);
    }
    for (auto& w : woken) w();  // each posts to its own strand
}

}  // namespace sandboxd
