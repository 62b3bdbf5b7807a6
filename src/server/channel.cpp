#include "server/channel.hpp"

#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

#include <csignal>

namespace sandboxd {
namespace {

constexpr std::size_t read_chunk = 256 * 1024;
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

void make_endless(net::steady_timer& t) { t.expires_at(net::steady_timer::time_point::max()); }

}  // namespace

Channel::Channel(strand_t strand, ChannelOptions options, std::unique_ptr<ChannelBackend> backend,
                 std::shared_ptr<SandboxHandle> sandbox, std::weak_ptr<ChannelSink> sink)
    : strand_(strand),
      options_(std::move(options)),
      sandbox_(std::move(sandbox)),
      sink_(std::move(sink)),
      backend_(std::move(backend)),
      credit_timer_(strand),
      stdin_timer_(strand),
      deadline_(strand),
      hangup_timer_(strand),
      done_timer_(strand),
      started_(std::chrono::steady_clock::now()) {
    if (options_.unended) options_.unended->fetch_add(1, std::memory_order_relaxed);
    make_endless(credit_timer_);
    make_endless(stdin_timer_);
    make_endless(done_timer_);
}

// The backend kills what is left of a channel that never started or was not reaped.
Channel::~Channel() {
    if (!exit_sent_ && options_.unended) options_.unended->fetch_sub(1, std::memory_order_release);
}

void Channel::start() {
    auto log_failure = [key = options_.audit_key](const std::exception_ptr& e) {
        if (!e) return;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("channel={} task failed: {}", key, ex.what());
        }
    };
    for (auto stream : {output_stream::out, output_stream::err}) {
        if (!backend_->has_output(stream)) continue;
        ++pumps_running_;
        net::co_spawn(strand_, pump_output(stream), log_failure);
    }
    // A PTY channel opened with stdin: false has a terminal, yet no stdin from the host.
    if (backend_->has_stdin() && options_.stdin_attached) {
        net::co_spawn(strand_, pump_stdin(), log_failure);
    } else {
        stdin_closed_ = true;
    }
    if (options_.timeout) {
        deadline_.expires_after(*options_.timeout);
        deadline_.async_wait([self = shared_from_this()](beast::error_code ec) {
            if (!ec && !self->main_exited_) self->stop(channel_outcome::timed_out);
        });
    }
    net::co_spawn(strand_, supervise(), log_failure);
}

awaitable<void> Channel::supervise() {
    auto self = shared_from_this();
    const ChannelExit exit = co_await backend_->wait_exit();
    exit_code_ = exit.exit_code;
    term_signal_ = exit.signal;
    lost_ = exit.lost;
    limit_ = exit.limit;
    main_exited_ = true;
    deadline_.cancel();
    if (!exit.error.empty()) {
        error_ = rpc_error(exit.error_code, exit.error).to_json();
        if (exit.error_code == errc::flow_control) {
            // The host did not keep up: what it has not credited is dropped, not waited on.
            abandon_output_ = true;
            wake(credit_timer_);
        }
        kill_tree();  // a backend that says nonsense is not waited for
    }
    co_await backend_->wait_gone();
    reaped_ = true;
    hangup_timer_.cancel();
    if (options_.on_reaped) std::exchange(options_.on_reaped, nullptr)();
    // Exit after output: every byte the command wrote is sent before its exit.
    while (pumps_running_ > 0) {
        co_await done_timer_.async_wait(as_tuple_awaitable);
    }
    stdin_closed_ = true;
    wake(stdin_timer_);
    send_exit();
}

awaitable<void> Channel::pump_output(output_stream stream) {
    auto self = shared_from_this();
    const bool is_stdout = stream == output_stream::out;
    std::optional<net::steady_timer> coalesce_timer;  // made when this stream first streams
    for (;;) {
        while (unacked_ >= options_.output_window && !hung_up_ && !abandon_output_) {
            co_await credit_timer_.async_wait(as_tuple_awaitable);
        }
        if (abandon_output_) break;
        // No buffer while idle: wait until the backend has bytes, then size it to them.
        std::size_t avail = co_await backend_->output_ready(stream);
        if (avail == 0 || abandon_output_) break;  // the stream ended
        if (unacked_ >= options_.output_window && !hung_up_) continue;  // the other stream took it
        // Reading takes no wait: stdout and stderr together never have more than
        // outputWindow bytes in flight.
        auto room = [&] {
            return std::min<std::uint64_t>(read_chunk, hung_up_ ? read_chunk : options_.output_window - unacked_);
        };
        // Full frames while a stream runs (docs/protocol.md, "Output frames"): the frame count,
        // not the copying, bounds throughput, and a writer of 8 KiB at a time wakes this pump
        // for each write. So when the previous read of this stream was large and recent, wait
        // up to coalesce_waits x coalesce_wait for the rest of a frame. Interactive output (a
        // small or first read) is never held back.
        const auto now = std::chrono::steady_clock::now();
        auto& last = is_stdout ? stdout_last_read_ : stderr_last_read_;
        if (last.bytes >= coalesce_after && now - last.at < streaming_gap && !hung_up_) {
            for (int i = 0; i < coalesce_waits && avail < room(); ++i) {
                if (!coalesce_timer) coalesce_timer.emplace(strand_);
                coalesce_timer->expires_after(coalesce_wait);
                co_await coalesce_timer->async_wait(as_tuple_awaitable);
                // Returns at once: the bytes seen before are still there (or the stream ended,
                // which the read below finds out).
                avail = std::max(avail, co_await backend_->output_ready(stream));
                if (abandon_output_) break;
            }
            if (abandon_output_) break;
            if (unacked_ >= options_.output_window && !hung_up_) continue;
        }
        const std::size_t size = std::min<std::uint64_t>(avail, room());
        auto sink = sink_.lock();
        std::string frame = sink && !options_.base64 ? sink->frame_buffer() : std::string();
        frame.resize(frame_header_size + size);
        const auto n = backend_->read_output(
            stream, std::span<char>(frame.data() + frame_header_size, size));
        if (!n) break;
        if (*n == 0) continue;
        last = {*n, std::chrono::steady_clock::now()};
        if (!hung_up_) unacked_ += *n;
        (is_stdout ? stdout_bytes_ : stderr_bytes_) += *n;
        if (options_.bytes) options_.bytes->count(wire_stream(stream), *n);
        if (hung_up_ || !sink) continue;  // nobody to send to: drain so that writers never block
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
        }
    }
    --pumps_running_;
    wake(done_timer_);
}

awaitable<void> Channel::pump_stdin() {
    auto self = shared_from_this();
    while (!stdin_closed_) {
        if (stdin_queue_.empty()) {
            if (stdin_eof_requested_) break;
            co_await stdin_timer_.async_wait(as_tuple_awaitable);
            continue;
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
        error_ = rpc_error(errc::flow_control,
                           "channel " + std::to_string(options_.id) +
                               ": the host overran its stdin window of " +
                               std::to_string(options_.stdin_window) + " bytes")
                     .to_json();
        stop(channel_outcome::error);
        throw rpc_error(errc::flow_control, (*error_)["message"].get<std::string>());
    }
    stdin_pending_ += data.size();
    stdin_queue_.emplace_back(data);
    wake(stdin_timer_);
}

void Channel::close_stdin() {
    require(channel_control::close_stdin, "duplexChannelCloseStdin");
    if (!options_.stdin_attached) return;
    stdin_eof_requested_ = true;
    wake(stdin_timer_);
}

void Channel::add_credit(std::uint32_t bytes) {
    unacked_ = bytes >= unacked_ ? 0 : unacked_ - bytes;
    wake(credit_timer_);
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

void Channel::hangup(channel_outcome why) {
    if (hung_up_ || reaped_) return;
    hung_up_ = true;
    // Whatever the command does from now on, nobody receives it: never logged as a success.
    if (!forced_outcome_) forced_outcome_ = why;
    sink_.reset();
    wake(credit_timer_);
    backend_->signal_all(SIGHUP);
    hangup_timer_.expires_after(options_.hangup_grace);
    hangup_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
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
    spdlog::info("channel={} lease={} ended: outcome={} exit={} signal={}{}{} stdout={} "
                 "stderr={} stdin={} duration_ms={}",
                 options_.audit_key, options_.lease_id, to_string(outcome),
                 exit_code_ ? std::to_string(*exit_code_) : std::string("-"),
                 term_signal_ > 0 ? signal_name(term_signal_) : std::string("-"),
                 limit_.empty() ? "" : " limit=", limit_,
                 stdout_bytes_, stderr_bytes_, stdin_bytes_, duration.count());
    if (options_.audit) {
        options_.audit->write("channel.ended",
                              {{"lease", options_.lease_id},
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
