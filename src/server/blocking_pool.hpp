#pragma once
// Runs blocking work (SQLite, provider create/destroy) off the I/O threads.
#include "server/net.hpp"

#include <type_traits>

namespace sandboxd {

/// Runs `f` on `pool` and resumes the awaiting coroutine on its own executor with the result
/// (or the exception `f` threw). `f` is moved into the spawned task.
template <typename F>
awaitable<std::invoke_result_t<F>> run_blocking(net::thread_pool& pool, F f) {
    using R = std::invoke_result_t<F>;
    co_return co_await net::co_spawn(
        pool.get_executor(),
        [fn = std::move(f)]() mutable -> awaitable<R> { co_return fn(); }, use_awaitable);
}

}  // namespace sandboxd
