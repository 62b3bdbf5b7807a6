#pragma once
// Runs an awaitable to completion on a test's own io_context, from plain test code.
#include <sandboxd/core/async.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <utility>

namespace sandboxd::test {

/// Runs `op` on `ioc` (on this thread) until it completes, and returns its result or rethrows
/// its exception. Objects the awaitable binds to `ioc` (a channel backend) must go before it.
/// Bounded by the operation's own timeouts: use it only for operations that have one.
template <typename T>
T run_awaitable(boost::asio::io_context& ioc, awaitable<T> op) {
    auto result = boost::asio::co_spawn(ioc, std::move(op), boost::asio::use_future);
    ioc.restart();
    ioc.run();
    return result.get();
}

}  // namespace sandboxd::test
