#include "server/detached_channels.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/lease.hpp>

#include <algorithm>
#include <utility>

namespace sandboxd {

std::string DetachedChannels::make_handle() { return "dch_" + random_hex(12); }

std::uint64_t DetachedChannels::kept_bytes_locked(const std::string& lease_id) const {
    std::uint64_t total = 0;
    for (const auto& [handle, entry] : by_handle_) {
        if (entry->lease_id == lease_id) total += entry->kept_bytes;
    }
    return total;
}

void DetachedChannels::check_new_locked(const std::string& lease_id, const std::string& name,
                                        std::uint64_t bytes, std::uint64_t lease_budget) const {
    if (!name.empty() && by_name_.count({lease_id, name})) {
        throw rpc_error(errc::invalid_params,
                        "name: lease " + lease_id + " already has a detached channel named \"" +
                            name + "\" (running, or its exit still kept)",
                        {{"field", "name"}});
    }
    const auto kept = kept_bytes_locked(lease_id);
    if (kept + bytes <= lease_budget) return;
    throw rpc_error(errc::channel_limit,
                    "lease " + lease_id + " keeps " + std::to_string(kept) +
                        " bytes of detached output already; " + std::to_string(bytes) +
                        " more would pass its limit of " + std::to_string(lease_budget) +
                        " (limits.detachKeptBytesPerLease)",
                    {{"limit", "detachKeptBytesPerLease"}});
}

void DetachedChannels::check_new(const std::string& lease_id, const std::string& name,
                                 std::uint64_t bytes, std::uint64_t lease_budget) const {
    std::lock_guard lock(mutex_);
    check_new_locked(lease_id, name, bytes, lease_budget);
}

std::string DetachedChannels::add(Entry entry, std::uint64_t lease_budget) {
    std::lock_guard lock(mutex_);
    check_new_locked(entry.lease_id, entry.name, entry.kept_bytes, lease_budget);
    std::string handle = entry.handle;
    while (handle.empty() || by_handle_.count(handle)) handle = make_handle();
    entry.handle = handle;
    if (!entry.name.empty()) by_name_[{entry.lease_id, entry.name}] = handle;
    added_order_[handle] = order_++;
    by_handle_.emplace(handle, std::make_shared<Entry>(std::move(entry)));
    return handle;
}

std::shared_ptr<const DetachedChannels::Entry> DetachedChannels::find(
    const std::string& handle) const {
    std::lock_guard lock(mutex_);
    const auto it = by_handle_.find(handle);
    return it == by_handle_.end() ? nullptr : it->second;
}

std::shared_ptr<const DetachedChannels::Entry> DetachedChannels::find(
    const std::string& lease_id, const std::string& name) const {
    std::lock_guard lock(mutex_);
    const auto named = by_name_.find({lease_id, name});
    if (named == by_name_.end()) return nullptr;
    const auto it = by_handle_.find(named->second);
    return it == by_handle_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const DetachedChannels::Entry>> DetachedChannels::of_lease(
    const std::string& lease_id) const {
    std::lock_guard lock(mutex_);
    std::vector<std::shared_ptr<Entry>> found;
    for (const auto& [handle, entry] : by_handle_) {
        if (entry->lease_id == lease_id) found.push_back(entry);
    }
    std::sort(found.begin(), found.end(), [this](const auto& a, const auto& b) {
        return added_order_.at(a->handle) < added_order_.at(b->handle);
    });
    return {found.begin(), found.end()};
}

std::map<std::string, std::shared_ptr<DetachedChannels::Entry>>::iterator
DetachedChannels::erase_locked(std::map<std::string, std::shared_ptr<Entry>>::iterator it) {
    const auto& e = *it->second;
    if (!e.name.empty()) by_name_.erase({e.lease_id, e.name});
    added_order_.erase(e.handle);
    return by_handle_.erase(it);
}

std::vector<std::shared_ptr<const DetachedChannels::Entry>> DetachedChannels::ended(
    const std::string& handle, std::int64_t at_ms, std::size_t max_kept_exits) {
    std::lock_guard lock(mutex_);
    const auto it = by_handle_.find(handle);
    if (it == by_handle_.end()) return {};
    if (!it->second->ended_at_ms) it->second->ended_at_ms = at_ms;
    const auto lease_id = it->second->lease_id;
    // The lease's ended entries, oldest added first.
    std::vector<std::pair<std::uint64_t, std::string>> lease_ended;
    for (const auto& [h, entry] : by_handle_) {
        if (entry->lease_id == lease_id && entry->ended_at_ms) {
            lease_ended.emplace_back(added_order_.at(h), h);
        }
    }
    std::vector<std::shared_ptr<const Entry>> gone;
    if (lease_ended.size() <= max_kept_exits) return gone;
    std::sort(lease_ended.begin(), lease_ended.end());
    lease_ended.resize(lease_ended.size() - max_kept_exits);
    for (const auto& [order, h] : lease_ended) {
        const auto at = by_handle_.find(h);
        gone.push_back(at->second);
        erase_locked(at);
    }
    return gone;
}

std::vector<std::shared_ptr<const DetachedChannels::Entry>> DetachedChannels::expire(
    std::int64_t now_ms, const std::string& lease_id) {
    std::lock_guard lock(mutex_);
    std::vector<std::shared_ptr<const Entry>> gone;
    for (auto it = by_handle_.begin(); it != by_handle_.end();) {
        const auto& e = *it->second;
        const bool lapsed =
            e.ended_at_ms && now_ms - *e.ended_at_ms >= static_cast<std::int64_t>(e.retain_ms);
        if (!lapsed && (lease_id.empty() || e.lease_id != lease_id)) {
            ++it;
            continue;
        }
        gone.push_back(it->second);
        it = erase_locked(it);
    }
    return gone;
}

std::size_t DetachedChannels::running() const {
    std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(
        std::count_if(by_handle_.begin(), by_handle_.end(),
                      [](const auto& kv) { return !kv.second->ended_at_ms; }));
}

std::size_t DetachedChannels::size() const {
    std::lock_guard lock(mutex_);
    return by_handle_.size();
}

void DetachedChannels::clear() {
    std::map<std::string, std::shared_ptr<Entry>> gone;
    {
        std::lock_guard lock(mutex_);
        gone.swap(by_handle_);
        by_name_.clear();
        added_order_.clear();
    }
}  // destroyed here, outside the lock

}  // namespace sandboxd
