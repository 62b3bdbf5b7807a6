#pragma once
/// @file process_backend.hpp
/// The channel backend of a process started by sandboxd-init (the bwrap provider's channels):
/// its pidfd, its pipes or PTY master, and the channel init's status and control fds, whose
/// contract provider.hpp states. Internal to the providers.

#include <sandboxd/core/net.hpp>

#include <sandboxd/core/unique_fd.hpp>
#include <sandboxd/provider/channel_backend.hpp>

#include <sys/types.h>

#include <memory>
#include <string>

namespace sandboxd::detail {

/// The host pid of a pidfd (its fdinfo's "Pid:" line); -1 when unknown (or the process has
/// been reaped: the kernel then says -1 itself). Reads /proc/self/fdinfo once; noexcept.
pid_t pid_of_pidfd(int pidfd) noexcept;

/// What a provider keeps for one channel beyond its descriptors (the bwrap provider: the
/// channel's cgroup). Owned by the backend; destroying it releases them. Used on the backend's
/// executor only.
class ChannelResources {
public:
    virtual ~ChannelResources() = default;
    /// Called once, after the channel's main process has ended with `term_signal` (0 for an
    /// exit): the limit that ended it ("memory"), or "". Counts the limit events of the
    /// channel. Fast; no blocking.
    virtual std::string limit_hit(int term_signal) noexcept = 0;
    /// Called once, by the backend's destructor just before it destroys this:
    /// `processes_gone` when the channel's init was reaped, so that no process of the
    /// channel is left. Fast; no blocking.
    virtual void release(bool processes_gone) noexcept { (void)processes_gone; }
    /// Called once, when the backend closed its stdin end (a pipe's: the command is to read
    /// EOF, so copies of that end kept elsewhere must go too). Fast; no blocking.
    virtual void stdin_closed() noexcept {}
    /// Whether the channel outlives this backend (a kept channel whose daemon stops and
    /// keeps its sandboxes, issue 47): then the destructor neither kills the channel's init
    /// nor calls release(). Fast; no blocking.
    virtual bool kept_past_daemon() const noexcept { return false; }
    /// The channel outlives this process: what these resources hold (its cgroup) is left as
    /// it is when they are destroyed. Fast; no blocking.
    virtual void keep() noexcept {}
};

/// The daemon's ends of a started channel init. Every fd is non-blocking and close-on-exec.
struct ProcessEnds {
    /// The channel init's host pid (not our child: never waitpid it); -1 when unknown: then
    /// ProcessBackend::pid() reads it from the pidfd when it is asked for. For diagnostics
    /// only.
    pid_t pid = -1;
    unique_fd pidfd;       ///< pidfd of `pid`; readable when it exits. Required.
    unique_fd stdin_fd;    ///< write end of stdin; the PTY master under a PTY; empty when
                           ///< !stdin_attached and no PTY
    unique_fd stdout_fd;   ///< read end of stdout; under a PTY, a dup of the master
    unique_fd stderr_fd;   ///< read end of stderr; empty under a PTY
    unique_fd status_fd;   ///< read end of the init's fd 3. Required.
    unique_fd control_fd;  ///< write end of the init's fd 4. Required.
    bool pty = false;
    /// Under a PTY, optionally: a pipe that the master's output is moved into (splice(2))
    /// before it is read, so that output taken from the terminal is never only in this
    /// process (a kept channel: a copy of the pipe outlives the daemon). Both or neither.
    unique_fd relay_read;
    unique_fd relay_write;
    std::unique_ptr<ChannelResources> resources;  ///< may be null
};

class ProcessBackend final : public ChannelBackend {
public:
    /// Binds `ends` to `executor` (see channel_backend.hpp for the threading contract).
    ProcessBackend(net::any_io_executor executor, ProcessEnds ends);
    /// SIGKILL to the channel init unless it is known to be gone.
    ~ProcessBackend() override;
    ProcessBackend(const ProcessBackend&) = delete;
    ProcessBackend& operator=(const ProcessBackend&) = delete;

    bool has_output(output_stream stream) const noexcept override;
    bool has_stdin() const noexcept override { return stdin_.is_open(); }
    std::optional<std::size_t> read_output(output_stream stream, std::span<char> into) override;
    /// The stream's pipe for splice(2); -1 under a PTY without a relay (a terminal is no pipe)
    /// or once ended. Under a PTY with a relay: the relay.
    int output_pipe(output_stream stream) noexcept override;
    awaitable<bool> write_stdin(std::string data) override;
    void close_stdin() noexcept override;
    void signal(int sig) noexcept override;
    void signal_all(int sig) noexcept override;
    void kill() noexcept override;
    void resize(std::uint16_t cols, std::uint16_t rows) override;
    /// Readiness waits on the descriptors themselves: no coroutine frame while a channel waits.
    void notify_output_ready(output_stream stream, std::shared_ptr<ChannelEvents> to) override;
    void notify_exit(std::shared_ptr<ChannelEvents> to) override;
    void notify_gone(std::shared_ptr<ChannelEvents> to) override;

    /// The channel init's host pid (-1 when unknown, or once the init has been reaped), for
    /// logs and tests: the one the ends gave, else read once from the pidfd's
    /// /proc/self/fdinfo entry (one open and read of a kernel-written file, no wait), so that
    /// an open does not pay for a figure only a log line or a test reads. On the backend's
    /// strand, as every other call here.
    pid_t pid() noexcept;

    /// Hands every descriptor back (deregistered from the executor), so that a test can drive
    /// sandboxd-init's fd contract byte by byte. The backend is empty afterwards: only its
    /// destructor may be called. Must not run while an operation is outstanding.
    ProcessEnds release_for_test();

private:
    static std::size_t index(output_stream s) noexcept { return s == output_stream::err ? 1 : 0; }
    /// The stream's descriptor (stdout or stderr; under a PTY, stdout is the master).
    unique_fd& output_fd(output_stream s) noexcept { return output_[index(s)]; }
    /// Registers the stream with the executor's reactor for one readiness wait; false (the
    /// stream closed, logged) when the reactor refuses it.
    bool start_wait(output_stream s) noexcept;
    /// Ends the registration that start_wait() made (no operation may be outstanding).
    void end_wait(output_stream s) noexcept;
    void send_control(unsigned char byte) noexcept;
    /// After readiness: the bytes that `s` holds (at least 1 while it is open: a readable
    /// stream with nothing queued is at its end, which read_output() finds), or 0 once it is
    /// closed. Grows a pipe that streams.
    std::size_t readable_now(output_stream s) noexcept;
    /// Reports `s` ready with what it holds then, on the next turn of the executor (never
    /// inside the notify_*() call that asked).
    void report_ready_later(output_stream s, std::shared_ptr<ChannelEvents> to);
    /// Under a PTY with a relay: moves what the master holds now into the relay (as much as
    /// it takes), and notes the master's end (EOF, or EIO once no slave is open).
    void fill_relay() noexcept;
    /// The PTY's master (for resize): the relay's source, or the stdout descriptor.
    int pty_master() const noexcept {
        return master_ ? master_.get() : output_[index(output_stream::out)].get();
    }
    /// Reads what the status fd holds now; reports the exit once the line (or EOF) is there,
    /// else waits for readiness again.
    void read_status(std::shared_ptr<ChannelEvents> to, const beast::error_code& ec);
    /// After the exit line: reads the status fd for the init's "end" line and calls
    /// `to`->ended() when it is there (anything else, or EOF, leaves it to the pidfd).
    void read_end(std::shared_ptr<ChannelEvents> to, const beast::error_code& ec);
    /// Reads what the status fd holds of the "end" line now, without waiting: true once it is
    /// there, false when anything else or EOF comes (the pidfd decides then), nullopt when the
    /// rest is still to come.
    std::optional<bool> take_end_line();
    /// Adds the limit that ended the channel (when its resources know one).
    void add_limit(ChannelExit& exit);

    pid_t pid_;
    bool pty_;
    bool gone_ = false;
    /// Per output stream: its pipe was grown to streaming_pipe_size (once it first filled).
    bool grown_[2] = {false, false};
    unique_fd control_;
    net::posix::stream_descriptor pidfd_;
    net::posix::stream_descriptor status_;
    /// stdout and stderr. Registered with the reactor only while a readiness wait is
    /// outstanding (`waits_`, which then holds the same descriptor): a registered pipe wakes
    /// the reactor at every write into it (edge-triggered epoll), that is 32 times for one
    /// frame of a writer of 8 KiB at a time, while the pump needs no readiness at all as long
    /// as the pipe holds bytes or a spliced frame is being written.
    unique_fd output_[2];
    net::posix::stream_descriptor waits_[2];
    net::posix::stream_descriptor stdin_;
    std::unique_ptr<ChannelResources> resources_;
    /// Under a PTY with a relay (ProcessEnds::relay_read): the master (output_[0] is then the
    /// relay's read end), the relay's write end, and whether the master has ended.
    unique_fd master_;
    unique_fd relay_write_;
    bool master_ended_ = false;
    /// What notify_exit() has read of the status line so far; after the exit line, what
    /// notify_gone() has read of the "end" line (the rest of the read that had the exit line).
    std::string status_line_;
};

}  // namespace sandboxd::detail
