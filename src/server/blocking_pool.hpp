#pragma once
// Runs blocking provider work (create/destroy) off the I/O threads.
#include "core/offload.hpp"
#include "server/net.hpp"

#include <type_traits>

namespace sandboxd {

/// Runs `f` on `pool` (core/offload.hpp), resuming the awaiting coroutine on its executor.
template <typename F>
awaitable<std::invoke_result_t<F>> run_blocking(net::thread_pool& pool, F f) {
    return offload(pool, std::move(f));
}

}  // namespace sandboxd
