#include "server/channel.hpp"

#include "server/frame_guard.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <spdlog/spdlog.h>

#include <sys/ioctl.h>

#include <algorithm>
#include <csignal>

namespace sandboxd {
namespace {

constexpr std::size_t read_chunk = 256 * 1024;
/// Spliced frames of one stream queued at once: one being written while the next waits, so
/// that the socket never idles between two frames.
constexpr int max_spliced_in_flight = 2;
/// Output coalescing (docs/protocol.md, "Output frames"): a stream whose previous read took at
/// least coalesce_after bytes less than streaming_gap ago waits up to coalesce_waits times
/// coalesce_wait (200 us in all) for a fuller frame.
constexpr std::size_t coalesce_after = 4096;
constexpr auto streaming_gap = std::chrono::milliseconds(2);
constexpr auto coalesce_wait = std::chrono::microseconds(100);
constexpr int coalesce_waits = 2;

std::string_view stream_name(output_stream s) {
    return s == output_stream::err ? "stderr" : "stdout";
}

stream_id wire_stream(output_stream s) {
    return s == output_stream::err ? stream_id::stderr_ : stream_id::stdout_;
}

/// What a Channel holds in place of its backend once the command is gone, its exit sent and
/// nothing of it in flight: the backend's constant answers, and no descriptor, process or
/// cgroup (a detached channel's exit is kept for hours; its pipes and pidfd are not). Nothing
/// calls its notify_*() or reads from it: the pumps have ended.
class EndedBackend final : public ChannelBackend {
public:
    explicit EndedBackend(const ChannelBackend& was)
        : out_(was.has_output(output_stream::out)),
          err_(was.has_output(output_stream::err)),
          stdin_(was.has_stdin()),
          close_stdin_(was.supports(channel_control::close_stdin)),
          signal_(was.supports(channel_control::signal)),
          resize_(was.supports(channel_control::resize)) {}
    /// A bwrap channel's answers: stdout, stderr unless under a PTY, every control.
    explicit EndedBackend(bool pty)
        : out_(true), err_(!pty), stdin_(false), close_stdin_(true), signal_(true), resize_(true) {}

    bool has_output(output_stream s) const noexcept override {
        return s == output_stream::err ? err_ : out_;
    }
    bool has_stdin() const noexcept override { return stdin_; }
    bool supports(channel_control c) const noexcept override {
        switch (c) {
            case channel_control::close_stdin: return close_stdin_;
            case channel_control::signal: return signal_;
            case channel_control::resize: return resize_;
        }
        return false;
    }
    std::optional<std::size_t> read_output(output_stream, std::span<char>) override {
        return std::nullopt;
    }
    awaitable<bool> write_stdin(std::string) override { co_return false; }
    void close_stdin() noexcept override {}
    void signal(int) noexcept override {}
    void signal_all(int) noexcept override {}
    void kill() noexcept override {}
    void resize(std::uint16_t, std::uint16_t) override {}  // the terminal is gone
    void notify_output_ready(output_stream, std::shared_ptr<ChannelEvents>) override {}
    void notify_exit(std::shared_ptr<ChannelEvents>) override {}
    void notify_gone(std::shared_ptr<ChannelEvents>) override {}

private:
    bool out_, err_, stdin_, close_stdin_, signal_, resize_;
};

}  // namespace

Channel::Channel(strand_t strand, ChannelOptions options, std::unique_ptr<ChannelBackend> backend,
                 std::shared_ptr<SandboxHandle> sandbox, std::weak_ptr<ChannelSink> sink)
    : strand_(std::move(strand)),
      options_(std::move(options)),
      sandbox_(std::move(sandbox)),
      sink_(std::move(sink)),
      backend_(std::move(backend)),
      started_(std::chrono::steady_clock::now()) {
    if (options_.unended) options_.unended->fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<Channel> Channel::make_ended(strand_t strand, ChannelOptions options,
                                             std::shared_ptr<SandboxHandle> sandbox) {
    options.unended = nullptr;  // its end was counted by the process that saw it
    const bool pty = options.pty;
    auto channel = std::make_shared<Channel>(std::move(strand), std::move(options),
                                             std::make_unique<EndedBackend>(pty),
                                             std::move(sandbox), std::weak_ptr<ChannelSink>());
    channel->begun_ = true;
    channel->main_exited_ = true;
    channel->reaped_ = true;
    channel->exit_sent_ = true;
    channel->stdin_closed_ = true;
    channel->backend_released_ = true;
    return channel;
}

// The backend kills what is left of a channel that never started or was not reaped.
Channel::~Channel() {
    if (!exit_sent_ && options_.unended) options_.unended->fetch_sub(1, std::memory_order_release);
}

void Channel::start() {
    begun_ = true;
    for (auto stream : {output_stream::out, output_stream::err}) {
        if (!backend_->has_output(stream)) continue;
        ++pumps_running_;
        pump_next(stream);
    }
    // A PTY channel opened with stdin: false has a terminal, yet no stdin from the host.
    if (!backend_->has_stdin() || !options_.stdin_attached) stdin_closed_ = true;
    kick_stdin();  // bytes the host sent before the start
    if (options_.timeout) {
        deadline_ = std::make_unique<net::steady_timer>(strand_, *options_.timeout);
        deadline_->async_wait([self = shared_from_this()](beast::error_code ec) {
            if (!ec && !self->main_exited_) self->stop(channel_outcome::timed_out);
        });
    }
    backend_->notify_exit(shared_from_this());
}

void Channel::exited(ChannelExit exit) {
    exit_code_ = exit.exit_code;
    term_signal_ = exit.signal;
    lost_ = exit.lost;
    limit_ = exit.limit;
    main_exited_ = true;
    if (deadline_) deadline_->cancel();
    if (!exit.error.empty()) {
        error_ = rpc_error(exit.error_code, exit.error).to_json();
        if (exit.error_code == errc::flow_control) {
            // The host did not keep up: what it has not credited is dropped, not waited on.
            abandon_output_ = true;
            resume_credit_waiters();
            resume_room_waiters();
        }
        kill_tree();  // a backend that says nonsense is not waited for
    }
    backend_->notify_gone(shared_from_this());
}

void Channel::gone() {
    reaped_ = true;
    if (hangup_timer_) hangup_timer_->cancel();
    if (options_.on_reaped) std::exchange(options_.on_reaped, nullptr)();
    maybe_finish();
}

void Channel::ended() {
    ended_ = true;
    // Nothing of the command runs any more: it no longer counts as running on this node.
    if (options_.on_reaped) std::exchange(options_.on_reaped, nullptr)();
    maybe_finish();
}

void Channel::maybe_finish() {
    // Exit after output: every byte the command wrote is sent before its exit.
    if ((!reaped_ && !ended_) || pumps_running_ > 0 || exit_sent_) {
        release_backend_when_done();
        return;
    }
    stdin_closed_ = true;  // a running stdin pump stops after its write
    send_exit();
    release_backend_when_done();
}

void Channel::release_backend_when_done() {
    const auto done = [this] {
        return options_.release_backend_at_end && reaped_ && exit_sent_ && !stdin_running_ &&
               pumps_running_ == 0 && pump(output_stream::out).in_flight == 0 &&
               pump(output_stream::err).in_flight == 0 && !backend_released_;
    };
    if (!done()) return;
    // On a turn of its own: never under a caller that may still use the backend.
    net::post(strand_, [self = shared_from_this(), done] {
        if (!done()) return;
        self->backend_released_ = true;
        self->backend_ = std::make_unique<EndedBackend>(*self->backend_);
    });
}

void Channel::pump_next(output_stream stream) {
    auto& p = pump(stream);
    p.coalesce_round = 0;
    if (abandon_output_) return pump_ended(stream);
    if (unacked_ >= options_.output_window && !hung_up_) {
        p.waiting_credit = true;  // add_credit() or hangup() resumes it
        return;
    }
    if (!hung_up_) {
        // The connection's send budgets (issue 44, item 2): a host that does not read makes
        // its channels stop reading, so the command blocks on its pipe or PTY, as in a
        // terminal, and the bytes wait there, not in this process.
        if (auto sink = sink_.lock(); sink && !sink->has_send_room()) {
            if (!p.waiting_room) {
                p.waiting_room = true;
                sink->when_send_room([weak = weak_from_this()] {
                    if (auto self = weak.lock()) self->resume_room_waiters();
                });
            }
            return;
        }
    }
    // No buffer while idle: wait until the backend has bytes, then size the frame to them.
    backend_->notify_output_ready(stream, shared_from_this());
}

void Channel::output_ready(output_stream stream, std::size_t avail) {
    auto& p = pump(stream);
    if (p.coalesce_round > 0) {
        // The bytes seen before are still there (or the stream ended, which the read finds).
        avail = std::max(p.avail, avail);
    } else if (avail == 0) {
        return pump_ended(stream);  // the stream ended
    }
    if (abandon_output_) return pump_ended(stream);
    // The other stream took the window meanwhile: wait for credit again. Reading takes no
    // wait: stdout and stderr together never have more than outputWindow bytes in flight.
    if (unacked_ >= options_.output_window && !hung_up_) return pump_next(stream);
    const std::uint64_t room = std::min<std::uint64_t>(
        read_chunk, hung_up_ ? read_chunk : options_.output_window - unacked_);
    if (p.claimed > 0) {
        // Spliced frames still queued hold bytes of the pipe: only the rest is new. A second
        // frame is queued only when a whole one is there beside them; else the end of the
        // frame in flight resumes the pump (the bytes gather meanwhile).
        const std::size_t fresh = avail > p.claimed ? avail - p.claimed : 0;
        if (p.in_flight >= max_spliced_in_flight || fresh < room || hung_up_) {
            p.coalesce_round = 0;
            p.waiting_splice = true;
            return;
        }
        p.coalesce_round = 0;
        return pump_send(stream, static_cast<std::size_t>(room));
    }
    // Full frames while a stream runs (docs/protocol.md, "Output frames"): the frame count,
    // not the copying, bounds throughput, and a writer of 8 KiB at a time wakes this pump for
    // each write. So when the previous read of this stream was large and recent, wait up to
    // coalesce_waits x coalesce_wait for the rest of a frame. Interactive output (a small or
    // first read) is never held back.
    const bool coalesce =
        p.coalesce_round > 0 ||
        (p.last_bytes >= coalesce_after &&
         std::chrono::steady_clock::now() - p.last_at < streaming_gap && !hung_up_);
    if (coalesce && p.coalesce_round < coalesce_waits && avail < room) {
        ++p.coalesce_round;
        p.avail = avail;
        if (!p.coalesce_timer) p.coalesce_timer = std::make_unique<net::steady_timer>(strand_);
        p.coalesce_timer->expires_after(coalesce_wait);
        p.coalesce_timer->async_wait([self = shared_from_this(), stream](beast::error_code) {
            self->backend_->notify_output_ready(stream, self);
        });
        return;
    }
    p.coalesce_round = 0;
    pump_send(stream, static_cast<std::size_t>(std::min<std::uint64_t>(avail, room)));
}

void Channel::pump_send(output_stream stream, std::size_t size) {
    auto& p = pump(stream);
    auto sink = sink_.lock();
    if (sink && !hung_up_ && !options_.base64) {
        // A pipe and a plain connection: the payload goes from the pipe into the socket
        // without a copy through this process (docs/protocol.md, "Output frames").
        if (const int fd = backend_->output_pipe(stream); fd >= 0 && sink->can_splice()) {
            int queued = 0;  // the exact count: a frame may declare only bytes the pipe holds
            if (::ioctl(fd, FIONREAD, &queued) == 0 &&
                static_cast<std::size_t>(std::max(queued, 0)) > p.claimed) {
                return pump_splice(*sink, stream, fd,
                                   std::min(size, static_cast<std::size_t>(queued) - p.claimed));
            }
        }
    }
    if (p.claimed > 0) {
        // Never read bytes that a queued spliced frame will send: wait for its end.
        p.waiting_splice = true;
        return;
    }
    std::string frame = sink && !options_.base64 ? sink->frame_buffer() : std::string();
    frame.resize(frame_header_size + size);
    const auto n =
        backend_->read_output(stream, std::span<char>(frame.data() + frame_header_size, size));
    if (!n) return pump_ended(stream);
    if (*n == 0) return pump_next(stream);
    p.last_bytes = *n;
    p.last_at = std::chrono::steady_clock::now();
    if (!hung_up_) unacked_ += *n;
    (stream == output_stream::out ? stdout_bytes_ : stderr_bytes_) += *n;
    if (options_.bytes) options_.bytes->count(wire_stream(stream), *n);
    if (!hung_up_ && sink) {  // else nobody to send to: drain so that writers never block
        if (options_.base64) {
            sink->send_text(jsonrpc::notification(
                "duplexChannel.data",
                {{"channel", options_.id},
                 {"stream", stream_name(stream)},
                 {"chunk", base64_encode(std::string_view(frame).substr(frame_header_size, *n))}}));
        } else {
            frame.resize(frame_header_size + *n);
            write_data_header(frame.data(), options_.id, wire_stream(stream));
            sink->send_binary(std::move(frame));
            if (options_.bytes) options_.bytes->count_frame(false);
        }
    }
    pump_next(stream);
}

void Channel::pump_splice(ChannelSink& sink, output_stream stream, int pipe_fd, std::size_t size) {
    auto& p = pump(stream);
    p.last_bytes = size;
    p.last_at = std::chrono::steady_clock::now();
    unacked_ += size;
    (stream == output_stream::out ? stdout_bytes_ : stderr_bytes_) += size;
    if (options_.bytes) {
        options_.bytes->count(wire_stream(stream), size);
        options_.bytes->count_frame(true);
    }
    std::string head = websocket_binary_header(frame_header_size + size);
    const std::size_t at = head.size();
    head.resize(at + frame_header_size);
    write_data_header(head.data() + at, options_.id, wire_stream(stream));
    // Its bytes stay claimed until it is written: nothing reads them meanwhile, and the next
    // frame takes the bytes after them.
    p.claimed += size;
    ++p.in_flight;
    sink.send_spliced(std::move(head), pipe_fd, size,
                      [self = shared_from_this(), stream, size](bool written) {
                          // Not written: the connection ended, and the session hangs the channel
                          // up; the pump then drains what is left of the pipe, as it does after any
                          // hangup.
                          (void)written;
                          auto& q = self->pump(stream);
                          q.claimed -= size;
                          --q.in_flight;
                          if (q.waiting_splice) {
                              q.waiting_splice = false;
                              self->pump_next(stream);
                          }
                      });
    pump_next(stream);
}

void Channel::pump_ended(output_stream stream) {
    pump(stream).waiting_credit = false;
    --pumps_running_;
    maybe_finish();
}

void Channel::resume_parked(bool OutputPump::*parked) {
    // On the next turn, as a woken coroutine would: never inside the caller (a frame handler
    // of the session), which an exit sent from here would reach again.
    for (auto stream : {output_stream::out, output_stream::err}) {
        auto& p = pump(stream);
        if (!(p.*parked)) continue;
        p.*parked = false;
        net::post(strand_, [self = shared_from_this(), stream] { self->pump_next(stream); });
    }
}

void Channel::kick_stdin() {
    if (!begun_ || stdin_running_ || stdin_closed_) return;
    if (stdin_queue_.empty() && !stdin_eof_requested_) return;
    stdin_running_ = true;
    net::co_spawn(strand_, pump_stdin(), [key = options_.audit_key](const std::exception_ptr& e) {
        if (e) log_task_failure("channel=" + std::to_string(key) + " task", e);
    });
}

awaitable<void> Channel::pump_stdin() {
    auto self = shared_from_this();
    while (!stdin_closed_) {
        if (stdin_queue_.empty()) {
            if (stdin_eof_requested_) break;
            stdin_running_ = false;  // kick_stdin() starts it again with the next bytes
            co_return;
        }
        const auto n = static_cast<std::uint32_t>(stdin_queue_.front().size());
        // Backpressure: the next chunk goes once the command has taken this one.
        const bool taken = co_await backend_->write_stdin(stdin_queue_.front());
        if (!taken) break;  // the command no longer reads; the rest is discarded below
        stdin_bytes_ += n;
        if (options_.bytes) options_.bytes->count(stream_id::stdin_, n);
        stdin_pending_ -= n;
        stdin_queue_.pop_front();
        if (auto sink = sink_.lock(); sink && !hung_up_) {
            sink->send_binary(encode_credit(options_.id, stream_id::stdin_, n));
        }
    }
    if (!stdin_queue_.empty() && stdin_pending_ > 0) {
        if (auto sink = sink_.lock(); sink && !hung_up_ && !exit_sent_) {
            sink->send_binary(encode_credit(options_.id, stream_id::stdin_,
                                            static_cast<std::uint32_t>(stdin_pending_)));
        }
    }
    stdin_queue_.clear();
    stdin_pending_ = 0;
    if (stdin_eof_requested_) backend_->close_stdin();
    stdin_closed_ = true;
    stdin_running_ = false;
    release_backend_when_done();
}

void Channel::write_stdin(std::string_view data) {
    if (!options_.stdin_attached) {
        throw rpc_error(errc::invalid_params,
                        "channel " + std::to_string(options_.id) + " was opened without stdin");
    }
    if (stdin_eof_requested_) {
        throw rpc_error(errc::invalid_params,
                        "channel " + std::to_string(options_.id) + ": stdin is already closed");
    }
    if (stdin_closed_) {
        // The command has stopped reading (it exited or closed its stdin): the bytes are
        // discarded and credited back so the host is never stuck on its window.
        if (auto sink = sink_.lock(); sink && !exit_sent_) {
            sink->send_binary(encode_credit(options_.id, stream_id::stdin_,
                                            static_cast<std::uint32_t>(data.size())));
        }
        return;
    }
    if (stdin_pending_ + data.size() > options_.stdin_window) {
        error_ = rpc_error(errc::flow_control, "channel " + std::to_string(options_.id) +
                                                   ": the host overran its stdin window of " +
                                                   std::to_string(options_.stdin_window) + " bytes")
                     .to_json();
        stop(channel_outcome::error);
        throw rpc_error(errc::flow_control, (*error_)["message"].get<std::string>());
    }
    stdin_pending_ += data.size();
    stdin_queue_.emplace_back(data);
    kick_stdin();
}

void Channel::close_stdin() {
    require(channel_control::close_stdin, "duplexChannelCloseStdin");
    if (!options_.stdin_attached) return;
    stdin_eof_requested_ = true;
    kick_stdin();
}

void Channel::add_credit(std::uint32_t bytes) {
    unacked_ = bytes >= unacked_ ? 0 : unacked_ - bytes;
    if (unacked_ < options_.output_window) resume_credit_waiters();
}

void Channel::require(channel_control control, const char* method) const {
    if (backend_->supports(control)) return;
    throw rpc_error(errc::invalid_params,
                    std::string(method) + ": the provider of channel " +
                        std::to_string(options_.id) +
                        " cannot carry it (its plugin worker does not list it in "
                        "supportedMethods)",
                    {{"field", method}});
}

void Channel::send_signal(int sig) {
    require(channel_control::signal, "duplexChannelSignal");
    if (main_exited_ || killed_) {
        throw rpc_error(errc::channel_not_found,
                        "channel " + std::to_string(options_.id) + " has already ended");
    }
    backend_->signal(sig);
}

void Channel::resize(std::uint16_t cols, std::uint16_t rows) {
    if (!options_.pty) {
        throw rpc_error(errc::invalid_params,
                        "channel " + std::to_string(options_.id) + " has no PTY to resize");
    }
    backend_->resize(cols, rows);
}

void Channel::stop(channel_outcome outcome) {
    if (exit_sent_ || reaped_) return;
    if (!forced_outcome_) forced_outcome_ = outcome;
    kill_tree();
}

void Channel::hangup(channel_outcome why, bool keep_sink) {
    if (hung_up_ || reaped_) return;
    hung_up_ = true;
    // Whatever the command does from now on, nobody receives it: never logged as a success.
    if (!forced_outcome_) forced_outcome_ = why;
    if (!keep_sink) sink_.reset();
    resume_credit_waiters();
    resume_room_waiters();
    backend_->signal_all(SIGHUP);
    hangup_timer_ = std::make_unique<net::steady_timer>(strand_, options_.hangup_grace);
    hangup_timer_->async_wait([self = shared_from_this()](beast::error_code ec) {
        if (!ec) self->kill_tree();
    });
}

void Channel::kill_tree() noexcept {
    if (killed_ || reaped_) return;
    killed_ = true;
    backend_->kill();
}

void Channel::send_exit() {
    if (exit_sent_) return;
    exit_sent_ = true;
    // Counted down after the audit line below, on every path out of this function.
    const ScopeExit ended([unended = options_.unended] {
        if (unended) unended->fetch_sub(1, std::memory_order_release);
    });
    nlohmann::json exit_code = nullptr;
    nlohmann::json signal = nullptr;
    channel_outcome outcome = channel_outcome::error;
    if (exit_code_) {
        exit_code = *exit_code_;
        outcome = channel_outcome::exited;
    } else if (term_signal_ > 0) {
        signal = signal_name(term_signal_);
        outcome = channel_outcome::signaled;
    } else if (error_) {
        outcome = channel_outcome::error;
    } else if (killed_) {
        signal = "KILL";
        outcome = channel_outcome::stopped;
    } else if (lost_) {
        outcome = channel_outcome::transport_closed;  // the provider's transport ended it
    }
    if (forced_outcome_) outcome = *forced_outcome_;
    const auto duration = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - started_);
    spdlog::info(
        "channel={} lease={} ended: outcome={} exit={} signal={}{}{} stdout={} "
        "stderr={} stdin={} duration_ms={}",
        options_.audit_key, options_.lease_id, to_string(outcome),
        exit_code_ ? std::to_string(*exit_code_) : std::string("-"),
        term_signal_ > 0 ? signal_name(term_signal_) : std::string("-"),
        limit_.empty() ? "" : " limit=", limit_, stdout_bytes_, stderr_bytes_, stdin_bytes_,
        duration.count());
    if (options_.audit) {
        options_.audit->write("channel.ended", {{"lease", options_.lease_id},
                                                {"epoch", options_.epoch},
                                                {"channel", options_.audit_key},
                                                {"token", options_.opened_for},
                                                {"argv0", options_.argv0},
                                                {"argvSha256", options_.argv_sha256},
                                                {"pty", options_.pty},
                                                {"outcome", std::string(to_string(outcome))},
                                                {"exitCode", exit_code},
                                                {"signal", signal},
                                                {"stdoutBytes", stdout_bytes_},
                                                {"stderrBytes", stderr_bytes_},
                                                {"stdinBytes", stdin_bytes_},
                                                {"durationMs", duration.count()}});
    }
    auto sink = sink_.lock();
    if (!sink) return;
    nlohmann::json params = {{"channel", options_.id},
                             {"hostRouteId", options_.host_route_id},
                             {"exitCode", exit_code},
                             {"signal", signal},
                             {"outcome", std::string(to_string(outcome))},
                             {"stdoutBytes", stdout_bytes_},
                             {"stderrBytes", stderr_bytes_},
                             {"stdinBytes", stdin_bytes_},
                             {"durationMs", duration.count()}};
    if (!limit_.empty()) params["limit"] = limit_;
    if (error_) params["error"] = *error_;
    sink->send_text(jsonrpc::notification("duplexChannel.exit", std::move(params)));
    sink->channel_finished(options_.id);
}

}  // namespace sandboxd
