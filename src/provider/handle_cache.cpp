#include <sandboxd/provider/handle_cache.hpp>

namespace sandboxd {

std::shared_ptr<SandboxHandle> HandleCache::find(const SandboxScope& scope) const {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(scope);
    if (it == entries_.end() || it->second.tearing_down) return nullptr;
    return it->second.handle;
}

bool HandleCache::holds(const SandboxScope& scope) const {
    std::lock_guard lock(mutex_);
    return entries_.count(scope) > 0;
}

bool HandleCache::put(std::shared_ptr<SandboxHandle> handle) {
    std::lock_guard lock(mutex_);
    auto scope = handle->scope;
    return entries_.emplace(std::move(scope), Entry{std::move(handle), false}).second;
}

std::shared_ptr<SandboxHandle> HandleCache::begin_teardown(const SandboxScope& scope) {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(scope);
    if (it == entries_.end()) return nullptr;
    it->second.tearing_down = true;
    return it->second.handle;
}

std::shared_ptr<SandboxHandle> HandleCache::try_begin_teardown(const SandboxScope& scope) {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(scope);
    if (it == entries_.end() || it->second.tearing_down) return nullptr;
    it->second.tearing_down = true;
    return it->second.handle;
}

std::shared_ptr<SandboxHandle> HandleCache::erase(const SandboxScope& scope) {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(scope);
    if (it == entries_.end()) return nullptr;
    auto handle = std::move(it->second.handle);
    entries_.erase(it);
    return handle;
}

std::size_t HandleCache::size() const {
    std::lock_guard lock(mutex_);
    return entries_.size();
}

std::vector<std::shared_ptr<SandboxHandle>> HandleCache::snapshot() const {
    std::lock_guard lock(mutex_);
    std::vector<std::shared_ptr<SandboxHandle>> out;
    out.reserve(entries_.size());
    for (const auto& [scope, entry] : entries_) out.push_back(entry.handle);
    return out;
}

}  // namespace sandboxd
