#pragma once
// The node's open WebSocket sessions, for what reaches all of them: a stop (shutdown), a
// reload (revoking the connections of a token that is gone) and the stop's wait for their
// close frames. Holds them weakly: a session lives by its own coroutines.
// Thread-safe (one mutex; the callbacks run under it and must not block).
#include "server/session.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace sandboxd {

class SessionSet {
public:
    /// Adds `session` (and forgets the ended ones).
    void add(const std::shared_ptr<Session>& session) {
        std::lock_guard lock(mutex_);
        std::erase_if(sessions_, [](const auto& w) { return w.expired(); });
        sessions_.push_back(session);
    }
    /// Calls `fn(Session&)` for every live session.
    template <typename Fn>
    void for_each(Fn&& fn) {
        std::lock_guard lock(mutex_);
        for (auto& weak : sessions_) {
            if (auto s = weak.lock()) fn(*s);
        }
    }
    /// Sessions still alive that have not written their close frame.
    std::size_t not_closed() {
        std::lock_guard lock(mutex_);
        return static_cast<std::size_t>(
            std::count_if(sessions_.begin(), sessions_.end(), [](const auto& w) {
                auto s = w.lock();
                return s && !s->close_written();
            }));
    }

private:
    std::mutex mutex_;
    std::vector<std::weak_ptr<Session>> sessions_;
};

}  // namespace sandboxd
