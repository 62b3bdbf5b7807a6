#pragma once
// One running command and its streams (docs/protocol.md sections 3 and 4), over the
// ChannelBackend of whichever provider runs it. The Channel owns the flow control (the output
// credit window shared by stdout and stderr, the stdin window, FLOW_CONTROL errors) and the
// exit-after-output rule, the same for every backend.
//
// Threading: a Channel lives on its session's strand, the executor its backend is bound to;
// every public method must be called on that strand. Its output pumps and its end are state
// machines driven by the backend's reports (ChannelEvents) on the same strand; its stdin pump
// is a coroutine there while stdin bytes are queued. A channel that merely waits holds the
// backend's pending readiness waits and no coroutine frame (issue 19).
#include <sandboxd/core/net.hpp>

#include <sandboxd/core/frame.hpp>
#include <sandboxd/provider/channel_backend.hpp>
#include <sandboxd/provider/provider.hpp>

#include "server/audit.hpp"
#include "server/node_metrics.hpp"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>

namespace sandboxd {

/// Where a channel's frames and its one exit notification go (the session's write queue).
class ChannelSink {
public:
    virtual ~ChannelSink() = default;
    /// Queues a binary frame, already encoded.
    virtual void send_binary(std::string frame) = 0;
    /// A string to resize and overwrite entirely, then send_binary(): a frame written before,
    /// with its old size and bytes (or an empty one). Reusing it spares the allocation, the
    /// zero-fill and the page faults of a fresh 256 KiB buffer per frame.
    virtual std::string frame_buffer() { return {}; }
    /// Whether send_spliced() can be used now (a plain connection still writing; not TLS).
    virtual bool can_splice() { return false; }
    /// Queues a data frame whose first bytes are `head` (its WebSocket header and data
    /// header, websocket_binary_header()) and whose other `count` bytes are then moved from
    /// the pipe `pipe_fd` into the connection with splice(2), in turn with the other frames.
    /// The pipe must hold `count` bytes that nobody else reads until `done` runs, and stay
    /// open until then. `done(written)` runs once, on the sink's strand, never inside this
    /// call: true once the frame is written; false when the connection ended first (the
    /// pipe's bytes, or some of them, are still there). Only when can_splice().
    virtual void send_spliced(std::string head, int pipe_fd, std::size_t count,
                              std::function<void(bool written)> done) {
        (void)head;
        (void)pipe_fd;
        (void)count;
        (void)done;
        std::terminate();  // only when can_splice(), which is false here
    }
    /// Queues a text frame (a JSON-RPC notification).
    virtual void send_text(std::string text) = 0;
    /// Whether the connection may be fed more output now (its send budgets, send_budget.hpp);
    /// true once it is closing.
    virtual bool has_send_room() { return true; }
    /// Runs `resume` once on the sink's strand (never inside this call) when has_send_room()
    /// may have become true; the caller checks again. Only when has_send_room() was false.
    virtual void when_send_room(std::function<void()> resume) { (void)resume; }
    /// The channel has sent its exit (or can no longer send it) and may be forgotten.
    virtual void channel_finished(std::uint32_t channel) = 0;
};

struct ChannelOptions {
    std::uint32_t id = 0;
    std::string host_route_id;
    std::string lease_id;
    bool pty = false;
    bool stdin_attached = true;
    bool base64 = false;  ///< dataEncoding "base64": duplexChannel.data notifications
    std::uint32_t output_window = 1 << 20;
    std::uint32_t stdin_window = 1 << 20;
    std::optional<std::chrono::milliseconds> timeout;
    std::chrono::milliseconds hangup_grace{5000};
    /// Once the command is gone and its exit sent, the backend is destroyed (its descriptors,
    /// processes and cgroup given back) and the Channel answers from what it kept: for a
    /// detached channel, whose Channel outlives its command by its retainMs.
    bool release_backend_at_end = false;
    /// Called once on the strand when no process of the channel's command is left: at the
    /// backend's ended() or gone(), the first (the channel's init may still be exiting then;
    /// its cgroup goes back to the lease when the backend sees it gone).
    std::function<void()> on_reaped;
    /// The audit trail (null: none) and what its lines name: the lease's epoch at the open and
    /// the channel's node-wide key (ChannelTable), unique within this daemon process.
    std::shared_ptr<AuditLog> audit;
    /// The token name of the host it was opened for (on a peer link: forwardedFor.tokenName).
    std::string opened_for;
    /// The command's program and the SHA-256 (hex) of its whole argv as a JSON array, for
    /// the audit (never the arguments themselves).
    std::string argv0;
    std::string argv_sha256;
    std::int64_t epoch = 0;
    /// The node-wide key (ChannelTable), unique within this daemon process: what the audit
    /// and the log call the channel (`channel=<key>`; the connection's id is per connection).
    std::uint64_t audit_key = 0;
    /// Counts this channel from its construction until its end is recorded (send_exit) or it
    /// is destroyed unended (null: not counted). The daemon's stop waits for it to reach 0, so
    /// that every channel.opened gets its channel.ended (docs/protocol.md section 7).
    std::atomic<std::int64_t>* unended = nullptr;
    /// Counts the payload bytes of each stream (null: not counted).
    const ChannelByteCounters* bytes = nullptr;
};

enum class channel_outcome {
    exited,
    signaled,
    timed_out,
    stopped,
    lease_released,
    transport_closed,
    error
};
std::string_view to_string(channel_outcome o) noexcept;
/// "INT", "TERM", ... for a signal number; "SIG<n>" when it has no short name here.
std::string signal_name(int sig);
/// The signal number of a protocol name ("INT", "TERM", "HUP", "QUIT", "KILL", "USR1", "USR2",
/// "WINCH"), or 0 for any other text.
int parse_signal_name(std::string_view name) noexcept;

class Channel final : public ChannelEvents, public std::enable_shared_from_this<Channel> {
public:
    /// `backend` is bound to `strand` (the provider's open() was awaited on it).
    Channel(strand_t strand, ChannelOptions options, std::unique_ptr<ChannelBackend> backend,
            std::shared_ptr<SandboxHandle> sandbox, std::weak_ptr<ChannelSink> sink);
    ~Channel() override;
    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;

    /// A channel whose command ended under an earlier process of this daemon and whose exit
    /// that process kept (a detached channel kept across a restart, issue 47): finished,
    /// with no backend (its answers are those of a bwrap channel with or without a PTY), and
    /// never started.
    static std::shared_ptr<Channel> make_ended(strand_t strand, ChannelOptions options,
                                               std::shared_ptr<SandboxHandle> sandbox);

    /// Starts the output pumps, the stdin pump (when bytes come) and the wait for the end.
    /// Call once.
    void start();

    std::uint32_t id() const noexcept { return options_.id; }
    const ChannelOptions& options() const noexcept { return options_; }
    const std::shared_ptr<SandboxHandle>& sandbox() const noexcept { return sandbox_; }
    bool finished() const noexcept { return exit_sent_; }
    /// Stdin bytes received and not yet credited back: a host attaching to a detached channel
    /// may send its stdin window less these (the credits for them reach that host).
    std::uint64_t stdin_pending() const noexcept { return stdin_pending_; }
    /// Sets the callback run once every process of the channel is gone (before start()).
    void set_on_reaped(std::function<void()> f) { options_.on_reaped = std::move(f); }
    /// Sets the channel's node-wide key for its audit lines (before start()).
    void set_audit_key(std::uint64_t key) { options_.audit_key = key; }

    /// Stdin bytes from the host. Throws rpc_error(errc::flow_control) and ends the channel
    /// when they would overrun the stdin window; errc::invalid_params when stdin was closed or
    /// not attached.
    void write_stdin(std::string_view data);
    /// Half-close: the command reads EOF once queued bytes are written (under a PTY: the EOF
    /// character is written instead).
    void close_stdin();
    /// Output credit from the host (kind 0x02, stream 1 or 2).
    void add_credit(std::uint32_t bytes);
    /// Sends `sig` to the command's process group. Throws errc::channel_not_found once the
    /// command has ended.
    void send_signal(int sig);
    /// Throws INVALID_PARAMS naming `method` when the backend cannot carry `control`.
    void require(channel_control control, const char* method) const;
    /// Sets the PTY size (1..4096 each, checked by the caller). Throws errc::invalid_params on
    /// a pipe channel.
    void resize(std::uint16_t cols, std::uint16_t rows);
    /// Kills the whole process tree now; the exit reports `outcome`.
    void stop(channel_outcome outcome);
    /// The connection dropped (`why` transport_closed) or the host closed the channel
    /// (stopped): SIGHUP to every process of the channel, SIGKILL after the hangup grace; no
    /// exit is sent, and the channel is logged with outcome `why`. With `keep_sink` (a
    /// detached channel nobody attached to for its hangupAfterMs), the sink is kept and is sent
    /// the exit, with outcome `why`; the output after the hangup is read and dropped.
    void hangup(channel_outcome why = channel_outcome::transport_closed, bool keep_sink = false);

private:
    /// One output stream's pump: wait for credit, wait for bytes (and, while the stream
    /// streams, a little longer for a fuller frame), read one frame, send it; again until the
    /// stream ends.
    struct OutputPump {
        bool waiting_credit = false;  ///< parked until credit arrives or the host hangs up
        int coalesce_round = 0;       ///< waits done for a fuller frame (0: not coalescing)
        std::size_t avail = 0;        ///< bytes known to be readable while coalescing
        std::size_t last_bytes = 0;   ///< the previous read of the stream, and when
        std::chrono::steady_clock::time_point last_at{};
        std::unique_ptr<net::steady_timer> coalesce_timer;  ///< made when the stream streams
        std::size_t claimed = 0;      ///< pipe bytes of spliced frames queued, not yet written
        int in_flight = 0;            ///< spliced frames queued, not yet written
        bool waiting_splice = false;  ///< parked until a spliced frame's end
        bool waiting_room = false;    ///< parked until the connection has send room again
    };
    OutputPump& pump(output_stream s) noexcept { return pumps_[s == output_stream::err ? 1 : 0]; }

    // ChannelEvents: the backend's reports, on the strand.
    net::any_io_executor events_executor() const override { return strand_; }
    void output_ready(output_stream stream, std::size_t bytes) override;
    void exited(ChannelExit exit) override;
    void gone() override;
    void ended() override;

    void pump_next(output_stream stream);
    void pump_send(output_stream stream, std::size_t avail);
    /// Queues `size` bytes of the pipe `pipe_fd` (which holds them beyond those already
    /// claimed) as one spliced frame and claims them until it is written; the pump goes on at
    /// once, and parks (waiting_splice) while max_spliced_in_flight frames are queued or no
    /// whole frame's worth of new bytes is there, until a queued frame's end resumes it.
    void pump_splice(ChannelSink& sink, output_stream stream, int pipe_fd, std::size_t size);
    void pump_ended(output_stream stream);
    /// Resumes the pumps parked on `parked` (waiting_credit, waiting_room), on the next turn
    /// of the strand.
    void resume_parked(bool OutputPump::*parked);
    /// Resumes the pumps parked for credit.
    void resume_credit_waiters() { resume_parked(&OutputPump::waiting_credit); }
    /// Resumes the pumps parked for send room (the connection took bytes, or is closing, or
    /// the channel was hung up).
    void resume_room_waiters() { resume_parked(&OutputPump::waiting_room); }
    /// Sends the exit once every process of the command is gone (ended() or gone()) and every
    /// output pump has ended.
    void maybe_finish();
    /// Once the command is gone, its exit sent and nothing of it in flight (no pump, no stdin
    /// write, no spliced frame): the backend is swapped, on a later turn, for a stand-in that
    /// holds no descriptor (a detached channel's entry keeps this Channel for its retainMs).
    void release_backend_when_done();
    /// Starts the stdin pump when bytes or the half-close wait and it is not running.
    void kick_stdin();
    awaitable<void> pump_stdin();
    void kill_tree() noexcept;
    void send_exit();

    strand_t strand_;
    ChannelOptions options_;
    std::shared_ptr<SandboxHandle> sandbox_;
    std::weak_ptr<ChannelSink> sink_;
    std::unique_ptr<ChannelBackend> backend_;
    OutputPump pumps_[2];
    std::unique_ptr<net::steady_timer> deadline_;      // timeoutMs
    std::unique_ptr<net::steady_timer> hangup_timer_;  // made at a hangup
    std::chrono::steady_clock::time_point started_;

    std::uint64_t unacked_ = 0;           // output bytes sent and not yet credited
    std::list<std::string> stdin_queue_;  // (an empty std::deque allocates 576 bytes)
    std::uint64_t stdin_pending_ = 0;     // received from the host, not yet credited back
    bool stdin_eof_requested_ = false;
    bool stdin_closed_ = false;
    bool stdin_running_ = false;  // pump_stdin() is running
    bool begun_ = false;          // start() has run
    int pumps_running_ = 0;
    bool main_exited_ = false;
    bool exit_sent_ = false;
    bool killed_ = false;
    bool hung_up_ = false;
    bool abandon_output_ = false;  // FLOW_CONTROL from the backend: undelivered output is dropped
    bool reaped_ = false;
    bool backend_released_ = false;  ///< backend_ is an EndedBackend (release_backend_when_done)
    bool ended_ = false;  ///< the backend said nothing of the command is left (before reaped_)
    std::optional<channel_outcome> forced_outcome_;
    std::uint64_t stdout_bytes_ = 0, stderr_bytes_ = 0, stdin_bytes_ = 0;
    /// The end of the main process as the backend reported it: exited with exit_code_, or
    /// killed by term_signal_ (> 0). Neither: no valid report.
    std::optional<int> exit_code_;
    int term_signal_ = 0;
    bool lost_ = false;  ///< the backend lost the command without a report
    std::string limit_;  ///< the limit that ended it ("memory")
    std::optional<nlohmann::json> error_;
};

}  // namespace sandboxd
