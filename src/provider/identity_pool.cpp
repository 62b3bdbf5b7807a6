#include "provider/identity_pool.hpp"

#include <sandboxd/core/errors.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace sandboxd::detail {

IdentityPool::IdentityPool(std::uint32_t first, std::uint32_t count,
                           const std::filesystem::path& lock_file)
    : first_(first), count_(count) {
    const std::uint64_t last = std::uint64_t{first} + count;  // one past the end
    if (count == 0 || first == 0 || last > 0xFFFFFFFFULL) {
        throw std::invalid_argument(
            "the identity range must be non-empty, above 0 and below 2^32 - 1");
    }
    for (std::uint64_t own : {std::uint64_t{::getuid()}, std::uint64_t{::getgid()}}) {
        if (own >= first && own < last) {
            throw std::invalid_argument("the identity range holds the daemon's own uid or gid " +
                                        std::to_string(own));
        }
    }
    std::error_code ec;
    std::filesystem::create_directories(lock_file.parent_path(), ec);
    lock_fd_.reset(::open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock_fd_) {
        throw rpc_error(errc::provider_error, "cannot open the identity lock file " +
                                                  lock_file.string() + ": " + std::strerror(errno));
    }
}

bool IdentityPool::try_lock(uid_t id) noexcept {
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = static_cast<off_t>(id);
    lock.l_len = 1;
    return ::fcntl(lock_fd_.get(), F_OFD_SETLK, &lock) == 0;
}

uid_t IdentityPool::acquire() {
    std::lock_guard lock(mutex_);
    for (std::uint32_t i = 0; i < count_; ++i) {
        const std::uint32_t offset = (next_ + i) % count_;
        const uid_t id = first_ + offset;
        if (held_.count(id) != 0) continue;  // OFD locks of one description never conflict
        if (!try_lock(id)) continue;         // another daemon holds it
        held_.insert(id);
        next_ = (offset + 1) % count_;
        return id;
    }
    throw rpc_error(errc::provider_error, "no free identity: all " + std::to_string(count_) +
                                              " host ids from " + std::to_string(first_) +
                                              " are in use");
}

bool IdentityPool::claim_existing(uid_t id) {
    std::lock_guard lock(mutex_);
    if (id < first_ || id - first_ >= count_) return false;
    if (held_.count(id) != 0) return true;
    if (!try_lock(id)) return false;
    held_.insert(id);
    return true;
}

void IdentityPool::release(uid_t id) noexcept {
    std::lock_guard lock(mutex_);
    if (held_.erase(id) == 0) return;
    struct flock unlock {};
    unlock.l_type = F_UNLCK;
    unlock.l_whence = SEEK_SET;
    unlock.l_start = static_cast<off_t>(id);
    unlock.l_len = 1;
    ::fcntl(lock_fd_.get(), F_OFD_SETLK, &unlock);
}

std::size_t IdentityPool::in_use() const {
    std::lock_guard lock(mutex_);
    return held_.size();
}

}  // namespace sandboxd::detail
