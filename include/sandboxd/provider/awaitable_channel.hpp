#pragma once
/// @file awaitable_channel.hpp
/// ChannelBackend's waits awaited from a coroutine: adapters over its callback calls
/// (notify_output_ready(), notify_exit(), notify_gone()), for a caller that drives a backend
/// from a coroutine rather than as the daemon's Channel does (leaseExecute, tests). Each
/// adapter makes one ChannelEvents of its own, bound to the awaiting coroutine's executor, and
/// completes when the backend has reported to it.
///
/// Threading: as the backend's calls, on the backend's executor (the coroutine must run
/// there); the rules of channel_backend.hpp apply unchanged (one wait of a kind at a time,
/// notify_exit() and notify_gone() once per backend). Nothing blocks; nothing throws but
/// std::bad_alloc.

#include <sandboxd/core/async.hpp>
#include <sandboxd/provider/channel_backend.hpp>

#include <cstddef>
#include <memory>

namespace sandboxd {
namespace detail {
class AwaitedEvents;  // what the backend reported, for the awaiting coroutine
}  // namespace detail

/// notify_output_ready(`stream`) awaited: the bytes read_output() can return now (at least 1),
/// or 0 once the stream has ended.
awaitable<std::size_t> output_ready(ChannelBackend& backend, output_stream stream);

/// notify_exit() awaited: how the command's main process ended.
awaitable<ChannelExit> wait_exit(ChannelBackend& backend);

/// notify_gone() awaited, in its two steps: ended() (no process of the command is left) and
/// gone() (every process of the channel is). Ask once per backend, after wait_exit().
class GoneWait {
public:
    /// Completes at notify_gone()'s first report: true when every process of the channel is
    /// gone, false when only the channel's init remains, on its way out (the backend said so
    /// with ended()): keep the backend until gone() completes then. Asks the backend (its
    /// notify_gone()) unless this wait has already.
    awaitable<bool> ended(ChannelBackend& backend);
    /// Completes once every process of the channel is gone. Asks the backend unless this wait
    /// has already.
    awaitable<void> gone(ChannelBackend& backend);

private:
    awaitable<void> ask(ChannelBackend& backend);
    std::shared_ptr<detail::AwaitedEvents> events_;
};

/// notify_gone() awaited to its end (GoneWait::gone()).
awaitable<void> wait_gone(ChannelBackend& backend);

}  // namespace sandboxd
