#pragma once
// The completion handler of a detached coroutine of the node (accept loops, membership loops,
// a session's requests, a channel's stdin pump, a peer link's loops): an exception that ended
// it is logged, never lost. Thread-safe (spdlog).
#include <spdlog/spdlog.h>

#include <exception>
#include <string>
#include <string_view>
#include <utility>

namespace sandboxd {

/// Logs `e`, when set, as "<what> failed: <message>" at `level`.
inline void log_task_failure(std::string_view what, const std::exception_ptr& e,
                             spdlog::level::level_enum level = spdlog::level::err) {
    if (!e) return;
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& ex) {
        spdlog::log(level, "{} failed: {}", what, ex.what());
    }
}

/// A co_spawn completion handler that logs as log_task_failure(`what`, ...) (`what` is kept).
inline auto logged_as(std::string what) {
    return [what = std::move(what)](const std::exception_ptr& e) { log_task_failure(what, e); };
}

}  // namespace sandboxd
