#pragma once
// The completion handler of a detached coroutine of the node (accept loops, membership
// loops): an exception that ended it is logged, never lost. Thread-safe (spdlog).
#include <spdlog/spdlog.h>

#include <exception>
#include <string_view>

namespace sandboxd {

/// Logs `e`, when set, as "<what> failed: <message>" at error level.
inline void log_task_failure(std::string_view what, const std::exception_ptr& e) {
    if (!e) return;
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& ex) {
        spdlog::error("{} failed: {}", what, ex.what());
    }
}

/// A co_spawn completion handler that logs as log_task_failure(`what`, ...).
inline auto logged_as(std::string_view what) {
    return [what](const std::exception_ptr& e) { log_task_failure(what, e); };
}

}  // namespace sandboxd
