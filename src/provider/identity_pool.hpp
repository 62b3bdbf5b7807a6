#pragma once
/// @file identity_pool.hpp
/// The host uids (each also used as the gid) that leases of the built-in provider run as: one
/// per lease, from the configured range [first, first + count), never 0 and never the daemon's
/// own. Internal to the provider layer.
///
/// Every daemon on the host that uses an overlapping range must not hand out the same id
/// twice, so a claim is an open-file-description lock (F_OFD_SETLK) on the byte at offset
/// `id` of one shared lock file: the kernel drops a process's claims when it dies, and another
/// daemon's claim shows as a conflict. A claim is also held, across restarts, by the lease's
/// files: the provider reclaims the id of every sandbox it still has on disk before handing
/// out new ones (claim_existing), and releases an id only once the lease's files are gone.
///
/// Thread-safety: every member is safe to call from any thread. Calls do not block (fcntl
/// with F_OFD_SETLK never waits).

#include <sandboxd/core/unique_fd.hpp>

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <mutex>
#include <set>

namespace sandboxd::detail {

class IdentityPool {
public:
    /// Opens (creating it and its directory, mode 0700) the lock file. Throws
    /// rpc_error(errc::provider_error) when it cannot, or std::invalid_argument for a range
    /// that holds 0, the daemon's uid or gid, or ends past 2^32 - 2.
    IdentityPool(std::uint32_t first, std::uint32_t count, const std::filesystem::path& lock_file);

    /// Claims a free id. Throws rpc_error(errc::provider_error, "no free identity ...") when
    /// every id of the range is taken (by this process or another).
    uid_t acquire();
    /// Claims `id` that a sandbox of ours on disk still uses (after a restart). False when it
    /// is outside the range or another process holds it.
    bool claim_existing(uid_t id);
    /// Returns `id` to the pool. Call only once its lease's files are gone.
    void release(uid_t id) noexcept;
    /// Ids held now by this process.
    std::size_t in_use() const;

private:
    bool try_lock(uid_t id) noexcept;

    const std::uint32_t first_;
    const std::uint32_t count_;
    unique_fd lock_fd_;
    mutable std::mutex mutex_;
    std::set<uid_t> held_;
    std::uint32_t next_ = 0;  ///< where the next search starts (round robin: ids rest a while)
};

}  // namespace sandboxd::detail
