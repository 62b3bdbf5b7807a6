#include "server/channel.hpp"

#include <sandboxd/base64.hpp>
#include <sandboxd/errors.hpp>

#include <spdlog/spdlog.h>

#include <csignal>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

namespace sandboxd {
namespace {

constexpr std::size_t read_chunk = 256 * 1024;
constexpr std::size_t max_status_line = 32;  // "signal 64\n" is 10 bytes

struct SignalName {
    int number;
    const char* name;
};
constexpr SignalName signal_names[] = {
    {SIGHUP, "HUP"},   {SIGINT, "INT"},   {SIGQUIT, "QUIT"}, {SIGILL, "ILL"},
    {SIGTRAP, "TRAP"}, {SIGABRT, "ABRT"}, {SIGBUS, "BUS"},   {SIGFPE, "FPE"},
    {SIGKILL, "KILL"}, {SIGUSR1, "USR1"}, {SIGSEGV, "SEGV"}, {SIGUSR2, "USR2"},
    {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"}, {SIGTERM, "TERM"}, {SIGCHLD, "CHLD"},
    {SIGCONT, "CONT"}, {SIGSTOP, "STOP"}, {SIGTSTP, "TSTP"}, {SIGTTIN, "TTIN"},
    {SIGTTOU, "TTOU"}, {SIGURG, "URG"},   {SIGXCPU, "XCPU"}, {SIGXFSZ, "XFSZ"},
    {SIGVTALRM, "VTALRM"}, {SIGPROF, "PROF"}, {SIGWINCH, "WINCH"}, {SIGIO, "IO"},
    {SIGPWR, "PWR"},   {SIGSYS, "SYS"},
};

std::string_view stream_name(stream_id s) {
    return s == stream_id::stderr_ ? "stderr" : "stdout";
}

void make_endless(net::steady_timer& t) { t.expires_at(net::steady_timer::time_point::max()); }

}  // namespace

std::string_view to_string(channel_outcome o) noexcept {
    switch (o) {
        case channel_outcome::exited: return "exited";
        case channel_outcome::signaled: return "signaled";
        case channel_outcome::timed_out: return "timedOut";
        case channel_outcome::stopped: return "stopped";
        case channel_outcome::lease_released: return "leaseReleased";
        case channel_outcome::transport_closed: return "transportClosed";
        case channel_outcome::error: return "error";
    }
    return "error";
}

std::string signal_name(int sig) {
    for (const auto& s : signal_names) {
        if (s.number == sig) return s.name;
    }
    return "SIG" + std::to_string(sig);
}

int parse_signal_name(std::string_view name) noexcept {
    static constexpr std::string_view allowed[] = {"INT",  "TERM", "HUP",  "QUIT",
                                                   "KILL", "USR1", "USR2", "WINCH"};
    for (auto a : allowed) {
        if (a != name) continue;
        for (const auto& s : signal_names) {
            if (name == s.name) return s.number;
        }
    }
    return 0;
}

Channel::Channel(strand_t strand, ChannelOptions options, SpawnedProcess process,
                 std::shared_ptr<SandboxHandle> sandbox, std::weak_ptr<ChannelSink> sink)
    : strand_(strand),
      options_(std::move(options)),
      sandbox_(std::move(sandbox)),
      sink_(std::move(sink)),
      pid_(process.pid),
      control_fd_(std::move(process.control_fd)),
      pidfd_(strand),
      status_(strand, process.status_fd.release()),
      stdout_(strand),
      stderr_(strand),
      stdin_(strand),
      credit_timer_(strand),
      stdin_timer_(strand),
      deadline_(strand),
      hangup_timer_(strand),
      done_timer_(strand),
      started_(std::chrono::steady_clock::now()) {
    resources_ = std::move(process.resources);
    // No pidfd: a channel without a process of ours (a plugin provider's bridge).
    if (process.pidfd) pidfd_.assign(process.pidfd.release());
    if (process.stdout_fd) stdout_.assign(process.stdout_fd.release());
    if (process.stderr_fd) stderr_.assign(process.stderr_fd.release());
    if (process.stdin_fd) stdin_.assign(process.stdin_fd.release());
    make_endless(credit_timer_);
    make_endless(stdin_timer_);
    make_endless(done_timer_);
}

Channel::~Channel() {
    // The supervisor holds the channel until the process is reaped; this is a last resort for
    // a channel that never started.
    if (!reaped_ && pidfd_.is_open()) {
        ::syscall(SYS_pidfd_send_signal, pidfd_.native_handle(), SIGKILL, nullptr, 0);
        siginfo_t info{};
        ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd_.native_handle()), &info,
                 WEXITED);
    }
}

void Channel::start() {
    auto log_failure = [id = options_.id](const std::exception_ptr& e) {
        if (!e) return;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("channel={} task failed: {}", id, ex.what());
        }
    };
    if (stdout_.is_open()) {
        ++pumps_running_;
        net::co_spawn(strand_, pump_output(stdout_, stream_id::stdout_), log_failure);
    }
    if (stderr_.is_open()) {
        ++pumps_running_;
        net::co_spawn(strand_, pump_output(stderr_, stream_id::stderr_), log_failure);
    }
    if (stdin_.is_open() && options_.stdin_attached) {
        net::co_spawn(strand_, pump_stdin(), log_failure);
    } else if (stdin_.is_open()) {
        stdin_closed_ = true;  // a PTY channel opened with stdin: false
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

awaitable<void> Channel::read_status() {
    // The line comes from a process of ours (the channel's init, or a plugin bridge), yet it
    // is read as untrusted input: bounded, and only "exit N" (0..255) or "signal N" (1..64).
    std::string line;
    auto [ec, n] = co_await net::async_read_until(
        status_, net::dynamic_buffer(line, max_status_line), '\n', as_tuple_awaitable);
    if (ec && n == 0) {
        // EOF with no line (the channel could not be set up, or its init was killed), or a
        // line too long to be one.
        if (ec != net::error::eof && !line.empty()) {
            error_ = rpc_error(errc::provider_error, "the channel's init sent an invalid status")
                         .to_json();
        }
        co_return;
    }
    line.resize(n - 1);
    auto number = [](std::string_view digits, int max) -> std::optional<int> {
        if (digits.empty() || digits.size() > 3) return std::nullopt;
        int value = 0;
        for (char c : digits) {
            if (c < '0' || c > '9') return std::nullopt;
            value = value * 10 + (c - '0');
        }
        if (value > max) return std::nullopt;
        return value;
    };
    const std::string_view text(line);
    if (text.rfind("exit ", 0) == 0) {
        exit_code_ = number(text.substr(5), 255);
        if (exit_code_) co_return;
    } else if (text.rfind("signal ", 0) == 0) {
        if (auto sig = number(text.substr(7), 64); sig && *sig > 0) {
            term_signal_ = *sig;
            co_return;
        }
    }
    error_ = rpc_error(errc::provider_error, "the channel's init sent an invalid status").to_json();
}

awaitable<void> Channel::supervise() {
    auto self = shared_from_this();
    co_await read_status();
    main_exited_ = true;
    deadline_.cancel();
    if (error_) kill_tree();  // an init that says nonsense is not waited for
    if (resources_) limit_ = resources_->limit_hit(term_signal_);
    if (pidfd_.is_open()) {
        // The channel's init kills what is left of its namespace and exits. It is the lease
        // supervisor's child, not ours (the supervisor reaps it): waitid below only reaps a
        // process of ours (a plugin provider's), and otherwise fails at once with ECHILD.
        co_await pidfd_.async_wait(net::posix::descriptor_base::wait_read, as_tuple_awaitable);
        siginfo_t info{};
        ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd_.native_handle()),
                 &info, WEXITED);
    } else {
        // No process of ours: the channel is over when the provider closes the status pipe.
        for (char sink[64];;) {
            auto [ec, n] = co_await status_.async_read_some(net::buffer(sink), as_tuple_awaitable);
            if (ec) break;
        }
    }
    reaped_ = true;
    hangup_timer_.cancel();
    if (options_.on_reaped) std::exchange(options_.on_reaped, nullptr)();
    while (pumps_running_ > 0) {
        co_await done_timer_.async_wait(as_tuple_awaitable);
    }
    stdin_closed_ = true;
    wake(stdin_timer_);
    send_exit();
}

awaitable<void> Channel::pump_output(net::posix::stream_descriptor& fd, stream_id stream) {
    auto self = shared_from_this();
    const bool is_stdout = stream == stream_id::stdout_;
    for (;;) {
        while (unacked_ >= options_.output_window && !hung_up_) {
            co_await credit_timer_.async_wait(as_tuple_awaitable);
        }
        // No buffer while idle: wait until the pipe is readable, then size it to what is there.
        auto [wec] = co_await fd.async_wait(net::posix::descriptor_base::wait_read, as_tuple_awaitable);
        if (wec) break;
        if (unacked_ >= options_.output_window && !hung_up_) continue;  // the other stream took it
        const std::size_t want = std::min<std::uint64_t>(
            read_chunk, hung_up_ ? read_chunk : options_.output_window - unacked_);
        int avail = 0;
        if (::ioctl(fd.native_handle(), FIONREAD, &avail) < 0 || avail <= 0) avail = 1;
        const std::size_t size = std::min<std::size_t>(want, static_cast<std::size_t>(avail));
        std::string frame(frame_header_size + size, '\0');
        // The window is reserved before the read so that stdout and stderr together never
        // have more than outputWindow bytes in flight.
        if (!hung_up_) unacked_ += size;
        auto [ec, n] = co_await fd.async_read_some(
            net::buffer(frame.data() + frame_header_size, size), as_tuple_awaitable);
        if (!hung_up_) unacked_ -= std::min<std::uint64_t>(unacked_, size - (ec ? 0 : n));
        if (ec) break;  // EOF; EIO on a PTY master once every slave is closed
        (is_stdout ? stdout_bytes_ : stderr_bytes_) += n;
        if (hung_up_) continue;  // nobody to send to: drain so that writers never block
        auto sink = sink_.lock();
        if (!sink) continue;
        if (options_.base64) {
            nlohmann::json note = {
                {"jsonrpc", "2.0"},
                {"method", "duplexChannel.data"},
                {"params",
                 {{"channel", options_.id},
                  {"stream", stream_name(stream)},
                  {"chunk", base64_encode(std::string_view(frame).substr(frame_header_size, n))}}}};
            sink->send_text(note.dump());
        } else {
            frame.resize(frame_header_size + n);
            write_data_header(frame.data(), options_.id, stream);
            sink->send_binary(std::move(frame));
        }
    }
    fd.close();
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
        // async_write retries short writes until every byte of the chunk is in.
        auto [ec, n] = co_await net::async_write(stdin_, net::buffer(stdin_queue_.front()),
                                                 as_tuple_awaitable);
        if (ec) break;  // EPIPE: the command no longer reads; the rest is discarded below
        stdin_bytes_ += n;
        stdin_pending_ -= n;
        stdin_queue_.pop_front();
        if (auto sink = sink_.lock(); sink && !hung_up_) {
            sink->send_binary(encode_credit(options_.id, stream_id::stdin_,
                                            static_cast<std::uint32_t>(n)));
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
    if (options_.pty && stdin_eof_requested_ && stdin_.is_open()) {
        const char eof = '\x04';
        beast::error_code ignored;
        net::write(stdin_, net::buffer(&eof, 1), ignored);
    }
    stdin_closed_ = true;
    beast::error_code ignored;
    stdin_.close(ignored);
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
    if (!options_.stdin_attached) return;
    stdin_eof_requested_ = true;
    wake(stdin_timer_);
}

void Channel::add_credit(std::uint32_t bytes) {
    unacked_ = bytes >= unacked_ ? 0 : unacked_ - bytes;
    wake(credit_timer_);
}

void Channel::send_signal(int sig) {
    if (main_exited_ || killed_) {
        throw rpc_error(errc::channel_not_found,
                        "channel " + std::to_string(options_.id) + " has already ended");
    }
    send_control(static_cast<unsigned char>(sig));
}

void Channel::resize(std::uint16_t cols, std::uint16_t rows) {
    if (!options_.pty) {
        throw rpc_error(errc::invalid_params,
                        "channel " + std::to_string(options_.id) + " has no PTY to resize");
    }
    if (!stdout_.is_open()) return;  // the terminal is gone with its process
    const int master = stdout_.native_handle();
    winsize ws{};
    if (::ioctl(master, TIOCGWINSZ, &ws) == 0 && ws.ws_col == cols && ws.ws_row == rows) {
        // The kernel signals only a change; a resize to the current size (a client that
        // re-sends its size to get a redraw) still owes the foreground group its SIGWINCH.
        // TIOCSIG on a master sends only INT, QUIT and TSTP: the init delivers it instead.
        send_control(static_cast<unsigned char>(SIGWINCH));
        return;
    }
    ws = winsize{};
    ws.ws_col = cols;
    ws.ws_row = rows;
    ::ioctl(master, TIOCSWINSZ, &ws);
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
    send_control(static_cast<unsigned char>(0x80 | SIGHUP));
    hangup_timer_.expires_after(options_.hangup_grace);
    hangup_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
        if (!ec) self->kill_tree();
    });
}

void Channel::kill_tree() noexcept {
    if (killed_ || reaped_) return;
    killed_ = true;
    send_control(static_cast<unsigned char>(0x80 | SIGKILL));
    if (pidfd_.is_open()) ::syscall(SYS_pidfd_send_signal, pidfd_.native_handle(), SIGKILL, nullptr, 0);
}

void Channel::send_control(unsigned char byte) noexcept {
    if (!control_fd_) return;
    // One byte into a pipe that the init drains: it cannot be short. EAGAIN (a full pipe of
    // unread requests) drops the request; EPIPE means the init is gone.
    [[maybe_unused]] auto n = ::write(control_fd_.get(), &byte, 1);
}

void Channel::send_exit() {
    if (exit_sent_) return;
    exit_sent_ = true;
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
    } else if (!pidfd_.is_open()) {
        outcome = channel_outcome::transport_closed;  // the provider's transport ended it
    }
    if (forced_outcome_) outcome = *forced_outcome_;
    const auto duration = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - started_);
    spdlog::info("channel={} lease={} ended: outcome={} exit={} signal={}{}{} stdout={} "
                 "stderr={} stdin={} duration_ms={}",
                 options_.id, options_.lease_id, to_string(outcome),
                 exit_code_ ? std::to_string(*exit_code_) : std::string("-"),
                 term_signal_ > 0 ? signal_name(term_signal_) : std::string("-"),
                 limit_.empty() ? "" : " limit=", limit_,
                 stdout_bytes_, stderr_bytes_, stdin_bytes_, duration.count());
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
    sink->send_text(
        nlohmann::json{{"jsonrpc", "2.0"}, {"method", "duplexChannel.exit"}, {"params", params}}
            .dump());
    sink->channel_finished(options_.id);
}

}  // namespace sandboxd
