#pragma once
// Bounded waits on a descriptor, for tests that drive fds by hand. Header-only.
#include <poll.h>

#include <cerrno>
#include <chrono>

namespace sandboxd::test {

/// Waits until `fd` is readable (or hung up); false when `timeout` passes first or poll fails.
inline bool wait_readable(int fd, std::chrono::milliseconds timeout) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
        if (left.count() < 0) return false;
        pollfd p{fd, POLLIN, 0};
        const int r = ::poll(&p, 1, static_cast<int>(left.count()));
        if (r > 0) return true;
        if (r < 0 && errno != EINTR) return false;
    }
}

}  // namespace sandboxd::test
