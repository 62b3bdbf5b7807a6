#pragma once
/// @file async.hpp
/// The one spelling of an asynchronous operation in sandboxd's public interfaces: a C++20
/// coroutine of Boost.Asio (`awaitable<T>`), awaited on the caller's executor. An interface
/// that returns one never blocks the awaiting thread: work that must block (disk, a forked
/// helper) runs on a pool the implementation owns and bounds, and the coroutine resumes on
/// its own executor with the result or the exception.

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>

namespace sandboxd {
template <typename T = void>
using awaitable = boost::asio::awaitable<T>;
}  // namespace sandboxd
