#pragma once
/// @file channel_backend.hpp
/// The daemon's side of one running command, whatever runs it: the process backend (a
/// channel init of sandboxd-init behind pipes or a PTY, src/provider/process_backend.hpp) or
/// the plugin backend (a worker's duplex channel, src/provider/plugin_worker.cpp).
///
/// The backend moves bytes and reports events; it keeps no window. Flow control (the output
/// credit window that stdout and stderr share, the stdin window, FLOW_CONTROL errors) and the
/// exit-after-output rule belong to the daemon's Channel (src/server/channel.hpp), which drives
/// every backend the same way:
///  - one output pump per stream that has_output(): notify_output_ready(), then
///    read_output() at most as many bytes as its window allows, until the stream reports 0;
///  - one stdin pump: write_stdin() one chunk at a time, each awaited before the next (the
///    backpressure), then close_stdin() when the host half-closes;
///  - notify_exit() once, then notify_gone() once; the exit is sent after every output pump
///    ended.
///
/// Each operation has one form. The waits are callbacks (ChannelEvents), so that a channel
/// that merely waits holds a pending readiness wait and no coroutine frame (issue 19: a held
/// channel cost about 5 KiB of frames; 10,000 held channels fit in 64 MiB). A caller that
/// drives a backend from a coroutine (leaseExecute) awaits them through the adapters of
/// awaitable_channel.hpp.
///
/// Threading: a backend is bound to the executor its provider's open() was awaited on (a
/// strand, or a single-threaded io_context). Every call, and the destructor, must run on that
/// executor. Calls of different kinds may be outstanding at the same time (a
/// notify_output_ready() per stream, one write_stdin(), one notify_exit() or notify_gone());
/// two calls of the same kind at once are not allowed. No call blocks the thread.

#include <sandboxd/core/async.hpp>
#include <sandboxd/core/errors.hpp>

#include <boost/asio/any_io_executor.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

namespace sandboxd {

/// A channel control that not every backend can carry (a paperclip SDK worker has none).
enum class channel_control : std::uint8_t { close_stdin, signal, resize };

/// An output stream of a command. Under a PTY, stderr is merged into stdout.
enum class output_stream : std::uint8_t { out = 0, err = 1 };

/// How the command's main process ended, as its backend learnt it.
struct ChannelExit {
    /// 0..255 when the main process exited.
    std::optional<int> exit_code;
    /// 1..64 when a signal ended the main process; 0 otherwise.
    int signal = 0;
    /// The limit that ended it ("memory" when its cgroup counted an OOM kill and the signal is
    /// SIGKILL), else "". Counted once in the provider's limit_events().
    std::string limit;
    /// Not empty when the channel ended in error: the message of an `error_code` error
    /// (PROVIDER_ERROR for an invalid report of the end; FLOW_CONTROL for a plugin channel
    /// whose output outran its host). The caller kills what is left.
    std::string error;
    errc error_code = errc::provider_error;
    /// The backend lost the command without a report (a plugin worker that went away, or
    /// reported exitCode null): the outcome is transportClosed unless the daemon ended it.
    bool lost = false;
};

/// Where a backend's notify_*() calls report (the daemon's Channel). Every callback runs on
/// events_executor(), never inside the notify_*() call that asked for it, and at most once per
/// notify_*() call. The backend holds the ChannelEvents (a shared_ptr) until it has called it.
class ChannelEvents {
public:
    virtual ~ChannelEvents() = default;
    /// The executor that the backend is bound to (a strand), where the callbacks run.
    virtual boost::asio::any_io_executor events_executor() const = 0;
    /// notify_output_ready(`stream`)'s answer: the number of bytes that read_output() can
    /// return now (at least 1, possibly an underestimate), or 0 once the stream has ended
    /// (every byte read; EOF).
    virtual void output_ready(output_stream stream, std::size_t bytes) = 0;
    /// notify_exit()'s answer: how the command's main process ended.
    virtual void exited(ChannelExit exit) = 0;
    /// notify_gone()'s answer: every process of the channel is gone (the output streams end at
    /// the latest then).
    virtual void gone() = 0;
    /// An early notice after exited() and before gone(), from a backend that can tell: no
    /// process of the channel's command is left (its init alone remains, on its way out, and
    /// holds none of the channel's streams), so the exit may be sent without waiting for the
    /// init's own end (the process backend: the init's "end" line; gone() comes about 1 ms
    /// later, after the kernel tears its namespaces down). At most once; gone() still follows.
    /// The default ignores it.
    virtual void ended() {}
};

class ChannelBackend {
public:
    /// Releases everything the backend holds. A command still running is killed (the process
    /// backend) or stopped through its worker (the plugin backend); never blocks.
    virtual ~ChannelBackend() = default;

    /// Whether `stream` exists: false for err under a PTY. Constant for the backend's life.
    virtual bool has_output(output_stream stream) const noexcept = 0;
    /// Whether the command has a stdin to write (the channel was opened with stdin, or runs
    /// under a PTY). Constant for the backend's life.
    virtual bool has_stdin() const noexcept = 0;
    /// Whether the backend can carry `control` (the Channel answers the host's request
    /// INVALID_PARAMS naming the method when it cannot). Constant for the backend's life.
    virtual bool supports(channel_control control) const noexcept {
        (void)control;
        return true;
    }

    /// Reads up to `into.size()` bytes of `stream` without waiting. Returns the number read
    /// (0: nothing right now, wait again), or nullopt once the stream has ended.
    virtual std::optional<std::size_t> read_output(output_stream stream, std::span<char> into) = 0;
    /// The read end of `stream` when it is a pipe (a pipe channel of the process backend):
    /// the caller may move bytes from it itself, with splice(2), in place of read_output()
    /// (issue 19: output written to the socket without a copy through user space). -1 when
    /// the stream is no pipe (a PTY, a plugin worker's channel) or has ended. The descriptor
    /// stays the backend's (never close it): open until read_output() finds the stream's end
    /// or the backend is destroyed. Constant for the stream's life.
    virtual int output_pipe(output_stream stream) noexcept {
        (void)stream;
        return -1;
    }

    /// Hands `data` to the command's stdin; completes once the command (its pipe, its PTY or
    /// its worker) has taken every byte: awaiting each write before the next is the
    /// backpressure. Returns false when the command no longer takes stdin (it closed it, or
    /// it ended); the bytes are then dropped. Requires has_stdin(). Never throws.
    virtual awaitable<bool> write_stdin(std::string data) = 0;
    /// The host half-closed stdin: the command reads EOF once the bytes written so far are
    /// read (under a PTY: the terminal's EOF character is written). Not while a write_stdin()
    /// is outstanding. Idempotent.
    virtual void close_stdin() noexcept = 0;

    /// Sends `sig` (1..64) to the command's process group. A backend that cannot carry that
    /// signal ignores it (a plugin worker forwards only the protocol's names).
    virtual void signal(int sig) noexcept = 0;
    /// Sends `sig` (1..64) to every process of the channel (SIGHUP at a hangup).
    virtual void signal_all(int sig) noexcept = 0;
    /// Ends every process of the channel now (SIGKILL; the plugin backend: duplexChannelStop,
    /// then the channel ends on the daemon's side after the worker's stop grace). Idempotent.
    virtual void kill() noexcept = 0;
    /// Sets the PTY's size (1..4096 each, checked by the caller). A resize to the current size
    /// sends SIGWINCH to the foreground group. Does nothing once the terminal is gone; throws
    /// rpc_error(errc::invalid_params) when the command has no PTY.
    virtual void resize(std::uint16_t cols, std::uint16_t rows) = 0;

    /// Reports, once, to `to`->output_ready() when `stream` has bytes to read or has ended.
    /// Never throws (bad_alloc aside).
    virtual void notify_output_ready(output_stream stream, std::shared_ptr<ChannelEvents> to) = 0;
    /// Reports, once, to `to`->exited() when the command's main process has ended, with how.
    /// At most once per backend. Never throws (bad_alloc aside).
    virtual void notify_exit(std::shared_ptr<ChannelEvents> to) = 0;
    /// Reports, once, to `to`->gone() when every process of the channel is gone (after
    /// notify_exit() reported). A backend that can tell calls `to`->ended() first, once no
    /// process of the command is left (ChannelEvents::ended()): a caller that needs no more
    /// than that (leaseExecute's answer) may go on then, but keeps the backend until gone()
    /// (destroying it earlier kills the channel's init and throws away the channel's cgroup,
    /// which the lease would otherwise use again). At most once per backend. Never throws
    /// (bad_alloc aside).
    virtual void notify_gone(std::shared_ptr<ChannelEvents> to) = 0;
};

}  // namespace sandboxd
