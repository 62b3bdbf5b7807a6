#pragma once
// The bridge from blocking code (SQLite, a blocking client, a forked helper) to awaitables:
// the work runs on a thread pool, the awaiting coroutine resumes on its own executor.
#include <sandboxd/core/async.hpp>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <cstddef>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace sandboxd {

/// Runs `f` on `pool`, then resumes the awaiting coroutine on its own executor (its strand)
/// with the result, or rethrows what `f` threw. The awaiting thread never blocks. No
/// capturing coroutine lambda is involved (C++ Core Guidelines CP.51): the work travels as a
/// plain function object. Cancelling the awaiting coroutine does not stop `f`.
///
/// GCC 12 mishandles a closure temporary with a destructor inside a co_await expression: with
/// `co_await this_coro::executor` captured by value in the initiation lambda, every call lost
/// one reference to the session's strand until the strand was freed under the session
/// (heap-use-after-free after ~30 channel opens on one connection; acceptance case B03). So the
/// initiation lambdas capture nothing with a destructor, and the executor is the handler's
/// (the coroutine's own).
template <typename F>
awaitable<std::invoke_result_t<F>> offload(boost::asio::thread_pool& pool, F f) {
    namespace net = boost::asio;
    using R = std::invoke_result_t<F>;
    if constexpr (std::is_void_v<R>) {
        co_await net::async_initiate<decltype(net::use_awaitable), void(std::exception_ptr)>(
            [&pool](auto handler, F fn) {
                auto ex = net::get_associated_executor(handler);
                net::post(pool, [handler = std::move(handler), fn = std::move(fn), ex]() mutable {
                    std::exception_ptr error;
                    try {
                        fn();
                    } catch (...) {
                        error = std::current_exception();
                    }
                    net::post(ex,
                              [handler = std::move(handler), error]() mutable { handler(error); });
                });
            },
            net::use_awaitable, std::move(f));
    } else {
        auto result = co_await net::async_initiate<decltype(net::use_awaitable),
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
            net::use_awaitable, std::move(f));
        co_return std::move(*result);
    }
}

/// A pool of threads of its own for one kind of blocking work (a "lane"), with a count of
/// the calls queued or running on it, so that one kind of backlog never delays another.
/// Thread-safe. The destructor waits for the calls already queued to finish; a call awaited
/// after destruction began is undefined, so the owner outlives its callers.
class WorkLane {
public:
    explicit WorkLane(std::size_t threads) : pool_(threads) {}
    WorkLane(const WorkLane&) = delete;
    WorkLane& operator=(const WorkLane&) = delete;
    ~WorkLane() { pool_.join(); }

    /// Runs `f` on this lane (see offload()); the awaiting thread never blocks.
    template <typename F>
    awaitable<std::invoke_result_t<F>> run(F f) {
        pending_.fetch_add(1, std::memory_order_relaxed);
        return offload(pool_, Counted<F>{std::move(f), &pending_});
    }

    /// Calls queued or running on this lane.
    std::size_t pending() const noexcept { return pending_.load(std::memory_order_relaxed); }

private:
    /// `f`, and one fewer pending call once it returned or threw (on the lane's thread).
    template <typename F>
    struct Counted {
        F f;
        std::atomic<std::size_t>* pending;
        auto operator()() {
            struct Done {
                std::atomic<std::size_t>* pending;
                ~Done() { pending->fetch_sub(1, std::memory_order_relaxed); }
            } done{pending};
            return f();
        }
    };

    std::atomic<std::size_t> pending_{0};
    boost::asio::thread_pool pool_;  // last: joined first
};

}  // namespace sandboxd
