#pragma once
/// @file handle_cache.hpp
/// The per-process sandbox handle cache (docs/protocol.md section 3 step 6): a node can
/// reach only the sandboxes it created and still holds. Keyed by the full scope
/// {provider, companyId, environmentId, providerLeaseId}; there is no lookup by a bare id.
///
/// Thread-safety: every method may be called from any thread (one internal mutex, held only
/// for map operations; nothing unknown runs under it).

#include <sandboxd/provider/provider.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace sandboxd {

class HandleCache {
public:
    /// The handle for exactly this scope, or nullptr. An entry whose teardown has begun
    /// (see begin_teardown) is not returned: a release that is draining admits no new channel.
    std::shared_ptr<SandboxHandle> find(const SandboxScope& scope) const;
    /// Whether this node holds a sandbox for exactly this scope, its teardown begun or not (the
    /// sweeper: a lease being released is held, not lost).
    bool holds(const SandboxScope& scope) const;

    /// Seeds the cache with a new sandbox (on acquire). Replaces nothing: returns false if the
    /// scope is already cached.
    bool put(std::shared_ptr<SandboxHandle> handle);

    /// Marks the entry as tearing down (find() stops returning it) and returns it, or nullptr
    /// when the scope is not cached.
    std::shared_ptr<SandboxHandle> begin_teardown(const SandboxScope& scope);

    /// Like begin_teardown, but only the first caller gets the handle: nullptr when the scope
    /// is not cached or its teardown has already begun (so a sandbox is destroyed once).
    std::shared_ptr<SandboxHandle> try_begin_teardown(const SandboxScope& scope);
    /// Removes the entry (after release, expiry, teardown or a failed health check).
    std::shared_ptr<SandboxHandle> erase(const SandboxScope& scope);

    std::size_t size() const;
    /// Every cached handle (including ones tearing down), for shutdown and metrics.
    std::vector<std::shared_ptr<SandboxHandle>> snapshot() const;

private:
    struct Entry {
        std::shared_ptr<SandboxHandle> handle;
        bool tearing_down = false;
    };
    mutable std::mutex mutex_;
    std::map<SandboxScope, Entry> entries_;
};

}  // namespace sandboxd
