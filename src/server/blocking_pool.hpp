#pragma once
// Runs blocking work (SQLite, provider create/destroy) off the I/O threads.
#include "server/net.hpp"

#include <exception>
#include <optional>
#include <type_traits>

namespace sandboxd {

/// Runs `f` on `pool`, then resumes the awaiting coroutine on its own executor (its strand)
/// with the result, or rethrows what `f` threw. No capturing coroutine lambda is involved
/// (C++ Core Guidelines CP.51): the work travels as a plain function object.
///
/// GCC 12 mishandles a closure temporary with a destructor inside a co_await expression: with
/// `co_await this_coro::executor` captured by value in the initiation lambda, every call lost
/// one reference to the session's strand until the strand was freed under the session
/// (heap-use-after-free after ~30 channel opens on one connection; CASES.md B03). So the
/// initiation lambdas capture nothing with a destructor, and the executor is the handler's
/// (the coroutine's own).
template <typename F>
awaitable<std::invoke_result_t<F>> run_blocking(net::thread_pool& pool, F f) {
    using R = std::invoke_result_t<F>;
    if constexpr (std::is_void_v<R>) {
        co_await net::async_initiate<decltype(use_awaitable), void(std::exception_ptr)>(
            [&pool](auto handler, F fn) {
                auto ex = net::get_associated_executor(handler);
                net::post(pool, [handler = std::move(handler), fn = std::move(fn), ex]() mutable {
                    std::exception_ptr error;
                    try {
                        fn();
                    } catch (...) {
                        error = std::current_exception();
                    }
                    net::post(ex, [handler = std::move(handler), error]() mutable { handler(error); });
                });
            },
            use_awaitable, std::move(f));
    } else {
        auto result = co_await net::async_initiate<decltype(use_awaitable),
                                                   void(std::exception_ptr, std::optional<R>)>(
            [&pool](auto handler, F fn) {
                auto ex = net::get_associated_executor(handler);
                net::post(pool, [handler = std::move(handler), fn = std::move(fn), ex]() mutable {
                    std::exception_ptr error;
                    std::optional<R> value;
                    try {
                        value.emplace(fn());
                    } catch (...) {
                        error = std::current_exception();
                    }
                    net::post(ex, [handler = std::move(handler), error,
                                   value = std::move(value)]() mutable {
                        handler(error, std::move(value));
                    });
                });
            },
            use_awaitable, std::move(f));
        co_return std::move(*result);
    }
}

}  // namespace sandboxd
