#include "provider/process_backend.hpp"

#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <termios.h>
#include <unistd.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <variant>

namespace sandboxd::detail {
namespace {

/// A pipe holding this much is full at its default size (64 KiB, less what a page holds).
constexpr int streaming_pipe_threshold = 60 * 1024;
/// What a streaming pipe grows to: fs.pipe-max-size's default, four 256 KiB frames.
constexpr int streaming_pipe_size = 1 << 20;
constexpr std::size_t max_status_line = 32;  // "signal 64\n" is 10 bytes

std::optional<int> parse_number(std::string_view digits, int max) {
    if (digits.empty() || digits.size() > 3) return std::nullopt;
    int value = 0;
    for (char c : digits) {
        if (c < '0' || c > '9') return std::nullopt;
        value = value * 10 + (c - '0');
    }
    if (value > max) return std::nullopt;
    return value;
}

/// The line comes from the channel's init, yet it is read as untrusted input: bounded, and
/// only "exit N" (0..255) or "signal N" (1..64).
constexpr const char* invalid_status = "the channel's init sent an invalid status";

/// A whole status line without its '\n'.
ChannelExit parse_status_line(std::string_view text) {
    ChannelExit exit;
    if (text.rfind("exit ", 0) == 0) {
        exit.exit_code = parse_number(text.substr(5), 255);
    } else if (text.rfind("signal ", 0) == 0) {
        if (auto sig = parse_number(text.substr(7), 64); sig && *sig > 0) exit.signal = *sig;
    }
    if (!exit.exit_code && exit.signal == 0) exit.error = invalid_status;
    return exit;
}

}  // namespace

pid_t pid_of_pidfd(int pidfd) noexcept {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char text[512];
    const ssize_t n = ::read(fd, text, sizeof text - 1);
    ::close(fd);
    if (n <= 0) return -1;
    text[n] = '\0';
    const char* line = std::strstr(text, "\nPid:");
    if (line == nullptr) return -1;
    return static_cast<pid_t>(std::strtol(line + 5, nullptr, 10));
}

ProcessBackend::ProcessBackend(net::any_io_executor executor, ProcessEnds ends)
    : pid_(ends.pid),
      pty_(ends.pty),
      control_(std::move(ends.control_fd)),
      pidfd_(executor, ends.pidfd.release()),
      status_(executor, ends.status_fd.release()),
      output_{std::move(ends.stdout_fd), std::move(ends.stderr_fd)},
      waits_{net::posix::stream_descriptor(executor), net::posix::stream_descriptor(executor)},
      stdin_(executor),
      resources_(std::move(ends.resources)) {
    if (ends.stdin_fd) stdin_.assign(ends.stdin_fd.release());
    if (pty_ && ends.relay_read && ends.relay_write) {
        master_ = std::move(output_[index(output_stream::out)]);
        output_[index(output_stream::out)] = std::move(ends.relay_read);
        relay_write_ = std::move(ends.relay_write);
    }
}

ProcessBackend::~ProcessBackend() {
    // The channel init is the supervisor's child: killing it is all this process can do (its
    // namespace goes with it); the supervisor reaps it. Not a channel kept for the next
    // daemon process.
    const bool kept = resources_ && resources_->kept_past_daemon();
    if (!gone_ && !kept) {
        ::syscall(SYS_pidfd_send_signal, pidfd_.native_handle(), SIGKILL, nullptr, 0);
    }
    if (resources_ && !kept) resources_->release(gone_);
    // A wait still registered (its io_context was destroyed with the handler): the
    // descriptor is output_'s to close, not the wait's.
    end_wait(output_stream::out);
    end_wait(output_stream::err);
}

pid_t ProcessBackend::pid() noexcept {
    if (pid_ < 0 && pidfd_.is_open()) pid_ = pid_of_pidfd(pidfd_.native_handle());
    return pid_;
}

bool ProcessBackend::has_output(output_stream s) const noexcept {
    return static_cast<bool>(output_[index(s)]);
}

bool ProcessBackend::start_wait(output_stream s) noexcept {
    auto& wait = waits_[index(s)];
    if (wait.is_open()) return true;
    beast::error_code ec;
    wait.assign(output_fd(s).get(), ec);
    if (!ec) return true;
    spdlog::error("pid={} {}: cannot wait for output: {}", pid(),
                  s == output_stream::err ? "stderr" : "stdout", ec.message());
    output_fd(s).reset();  // fail closed: the stream ends here
    return false;
}

void ProcessBackend::end_wait(output_stream s) noexcept {
    auto& wait = waits_[index(s)];
    if (wait.is_open()) (void)wait.release();  // deregisters; output_ keeps the descriptor
}

void ProcessBackend::report_ready_later(output_stream s, std::shared_ptr<ChannelEvents> to) {
    net::post(waits_[index(s)].get_executor(),
              [this, s, to = std::move(to)] { to->output_ready(s, readable_now(s)); });
}

void ProcessBackend::notify_output_ready(output_stream s, std::shared_ptr<ChannelEvents> to) {
    // A handler of a few words while the channel waits, no coroutine frame. Bytes already
    // there (a streaming command): no readiness wait, which costs an epoll_ctl and a turn of
    // the reactor per frame; one turn of the executor instead, so that the connection's writes
    // run between this stream's reads. No buffer while idle: wait until the pipe is readable.
    auto& wait = waits_[index(s)];
    const int fd = output_fd(s).get();
    int avail = 0;
    if (master_ && s == output_stream::out && fd >= 0) {
        // The relay: what the master holds goes into it first; the wait is on the master.
        fill_relay();
        if ((::ioctl(fd, FIONREAD, &avail) == 0 && avail > 0) || master_ended_) {
            report_ready_later(s, std::move(to));
            return;
        }
        beast::error_code ec;
        wait.assign(master_.get(), ec);
        if (ec) {
            master_ended_ = true;  // fail closed: the stream ends with what the relay holds
            report_ready_later(s, std::move(to));
            return;
        }
        wait.async_wait(net::posix::descriptor_base::wait_read,
                        [this, s, to = std::move(to)](const beast::error_code& e) {
                            end_wait(s);
                            if (e) master_ended_ = true;
                            fill_relay();
                            to->output_ready(s, readable_now(s));
                        });
        return;
    }
    if (fd < 0 || (::ioctl(fd, FIONREAD, &avail) == 0 && avail > 0) || !start_wait(s)) {
        report_ready_later(s, std::move(to));
        return;
    }
    wait.async_wait(net::posix::descriptor_base::wait_read,
                    [this, s, to = std::move(to)](const beast::error_code& ec) {
                        end_wait(s);
                        to->output_ready(s, ec ? 0 : readable_now(s));
                    });
}

std::size_t ProcessBackend::readable_now(output_stream s) noexcept {
    const int fd = output_fd(s).get();
    if (fd < 0) return 0;
    // Readable with nothing queued is EOF (or EIO on a PTY): read_output() finds out.
    int avail = 0;
    if (::ioctl(fd, FIONREAD, &avail) < 0 || avail <= 0) avail = 1;
    // A pipe that fills its default 64 KiB streams: grow it so that the channel can send whole
    // frames of 256 KiB (issue 19). Only then: a bigger pipe costs kernel memory (15 KiB per
    // idle channel at 1 MiB), and most channels never stream. Not a pipe (a PTY): nothing.
    auto& grown = grown_[index(s)];
    if (!grown && avail >= streaming_pipe_threshold) {
        grown = true;
        (void)::fcntl(fd, F_SETPIPE_SZ, streaming_pipe_size);
    }
    return static_cast<std::size_t>(avail);
}

std::optional<std::size_t> ProcessBackend::read_output(output_stream s, std::span<char> into) {
    auto& fd = output_fd(s);
    if (!fd) return std::nullopt;
    const bool relay = master_ && s == output_stream::out;
    if (relay) fill_relay();
    for (;;) {
        const ssize_t n = ::read(fd.get(), into.data(), into.size());
        if (n > 0) return static_cast<std::size_t>(n);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            // The relay is empty: its writers (this process, the kept copy) never close it,
            // so the stream ends when the master has ended.
            if (!relay || !master_ended_) return 0;
        }
        break;  // EOF; EIO on a PTY master once every slave is closed
    }
    end_wait(s);
    fd.reset();
    if (relay) {
        master_.reset();
        relay_write_.reset();
    }
    return std::nullopt;
}

void ProcessBackend::fill_relay() noexcept {
    if (!master_ || master_ended_) return;
    // One call moves what the terminal has (its buffer is 4 KiB pages); a few more while it
    // keeps having some, until the relay is full or the master has nothing.
    for (int round = 0; round < 16; ++round) {
        const ssize_t n = ::splice(master_.get(), nullptr, relay_write_.get(), nullptr, 1 << 16,
                                   SPLICE_F_NONBLOCK);
        if (n > 0) continue;
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n < 0 && errno != EIO) {
            spdlog::error("pid={} pty: cannot move terminal output: {}", pid(),
                          std::strerror(errno));
        }
        master_ended_ = true;  // EOF, or EIO: every slave is closed
        return;
    }
}

int ProcessBackend::output_pipe(output_stream s) noexcept {
    if (pty_ && !(master_ && s == output_stream::out)) return -1;
    return output_fd(s).get();
}

awaitable<bool> ProcessBackend::write_stdin(std::string data) {
    if (!stdin_.is_open()) co_return false;
    // async_write retries short writes until every byte is in the pipe (or the PTY).
    auto [ec, n] = co_await net::async_write(stdin_, net::buffer(data), as_tuple_awaitable);
    co_return !ec;  // EPIPE: the command no longer reads
}

void ProcessBackend::close_stdin() noexcept {
    if (!stdin_.is_open()) return;
    if (pty_) {
        const char eof = '\x04';
        [[maybe_unused]] auto n = ::write(stdin_.native_handle(), &eof, 1);
    }
    beast::error_code ignored;
    stdin_.close(ignored);
    if (!pty_ && resources_) resources_->stdin_closed();
}

void ProcessBackend::signal(int sig) noexcept { send_control(static_cast<unsigned char>(sig)); }

void ProcessBackend::signal_all(int sig) noexcept {
    send_control(static_cast<unsigned char>(0x80 | sig));
}

void ProcessBackend::kill() noexcept {
    send_control(static_cast<unsigned char>(0x80 | SIGKILL));
    if (!gone_) ::syscall(SYS_pidfd_send_signal, pidfd_.native_handle(), SIGKILL, nullptr, 0);
}

void ProcessBackend::resize(std::uint16_t cols, std::uint16_t rows) {
    if (!pty_) throw rpc_error(errc::invalid_params, "the channel has no PTY to resize");
    const int master = pty_master();
    if (master < 0) return;  // the terminal is gone with its process
    winsize ws{};
    if (::ioctl(master, TIOCGWINSZ, &ws) == 0 && ws.ws_col == cols && ws.ws_row == rows) {
        // The kernel signals only a change; a resize to the current size (a client that
        // re-sends its size to get a redraw) still owes the foreground group its SIGWINCH.
        // TIOCSIG on a master sends only INT, QUIT and TSTP: the init delivers it instead.
        signal(SIGWINCH);
        return;
    }
    ws = winsize{};
    ws.ws_col = cols;
    ws.ws_row = rows;
    ::ioctl(master, TIOCSWINSZ, &ws);
}

void ProcessBackend::notify_exit(std::shared_ptr<ChannelEvents> to) {
    status_.async_wait(net::posix::descriptor_base::wait_read,
                       [this, to = std::move(to)](const beast::error_code& ec) mutable {
                           read_status(std::move(to), ec);
                       });
}

void ProcessBackend::read_status(std::shared_ptr<ChannelEvents> to, const beast::error_code& ec) {
    // A line, EOF before one (no error unless a partial line meets a read error) or a line
    // too long to be one.
    ChannelExit exit;
    if (ec) {
        if (!status_line_.empty()) exit.error = invalid_status;
    } else {
        for (;;) {
            char chunk[max_status_line];
            const ssize_t n =
                ::read(status_.native_handle(), chunk, max_status_line - status_line_.size());
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                notify_exit(std::move(to));  // the rest of the line is still to come
                return;
            }
            if (n <= 0) {
                if (n < 0 && !status_line_.empty()) exit.error = invalid_status;
                break;
            }
            status_line_.append(chunk, static_cast<std::size_t>(n));
            if (const auto end = status_line_.find('\n'); end != std::string::npos) {
                exit = parse_status_line(std::string_view(status_line_).substr(0, end));
                // What came after the exit line belongs to the "end" line (notify_gone()).
                status_line_.erase(0, end + 1);
                add_limit(exit);
                to->exited(std::move(exit));
                return;
            }
            if (status_line_.size() >= max_status_line) {
                exit.error = invalid_status;
                break;
            }
        }
    }
    status_line_ = std::string();
    add_limit(exit);
    to->exited(std::move(exit));
}

void ProcessBackend::add_limit(ChannelExit& exit) {
    if (resources_) exit.limit = resources_->limit_hit(exit.signal);
}

void ProcessBackend::notify_gone(std::shared_ptr<ChannelEvents> to) {
    if (status_.is_open()) {
        if (status_line_.find('\n') != std::string::npos) {
            // The "end" line came in the exit line's read: a callback never runs inside the
            // notify_*() call that asked for it.
            net::post(status_.get_executor(), [this, to] { read_end(to, beast::error_code()); });
        } else {
            status_.async_wait(net::posix::descriptor_base::wait_read,
                               [this, to](const beast::error_code& ec) { read_end(to, ec); });
        }
    }
    pidfd_.async_wait(net::posix::descriptor_base::wait_read,
                      [this, to = std::move(to)](const beast::error_code&) {
                          gone_ = true;
                          beast::error_code ignored;  // a wait for "end" still pending ends
                          status_.cancel(ignored);    // unanswered
                          to->gone();
                      });
}

void ProcessBackend::read_end(std::shared_ptr<ChannelEvents> to, const beast::error_code& ec) {
    if (ec || gone_) return;  // gone() has reported it, or will
    const std::optional<bool> end = take_end_line();
    if (!end) {
        status_.async_wait(net::posix::descriptor_base::wait_read,
                           [this, to](const beast::error_code& e) { read_end(to, e); });
        return;
    }
    if (*end) to->ended();
}

std::optional<bool> ProcessBackend::take_end_line() {
    constexpr std::string_view end_line = "end\n";
    for (;;) {
        if (const auto nl = status_line_.find('\n'); nl != std::string::npos) {
            const bool end = std::string_view(status_line_).substr(0, nl + 1) == end_line;
            status_line_ = std::string();
            return end;  // anything else: not the init's word
        }
        if (status_line_.size() >= end_line.size()) {
            status_line_ = std::string();
            return false;
        }
        char chunk[end_line.size()];
        const ssize_t n =
            ::read(status_.native_handle(), chunk, end_line.size() - status_line_.size());
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
        if (n <= 0) {
            status_line_ = std::string();
            return false;  // EOF without "end": the init was killed, or exits another way
        }
        status_line_.append(chunk, static_cast<std::size_t>(n));
    }
}

ProcessEnds ProcessBackend::release_for_test() {
    ProcessEnds ends;
    auto take = [](net::posix::stream_descriptor& d, unique_fd& into) {
        if (d.is_open()) into.reset(d.release());
    };
    ends.pid = pid();
    ends.pty = pty_;
    take(pidfd_, ends.pidfd);
    take(status_, ends.status_fd);
    end_wait(output_stream::out);
    end_wait(output_stream::err);
    if (master_) {  // the ends as they were given
        ends.relay_read = std::move(output_fd(output_stream::out));
        ends.relay_write = std::move(relay_write_);
        output_fd(output_stream::out) = std::move(master_);
    }
    ends.stdout_fd = std::move(output_fd(output_stream::out));
    ends.stderr_fd = std::move(output_fd(output_stream::err));
    take(stdin_, ends.stdin_fd);
    ends.control_fd = std::move(control_);
    ends.resources = std::move(resources_);
    gone_ = true;  // the test owns the channel init now
    return ends;
}

void ProcessBackend::send_control(unsigned char byte) noexcept {
    if (!control_) return;
    // One byte into a pipe that the init drains: it cannot be short. EAGAIN (a full pipe of
    // unread requests) drops the request; EPIPE means the init is gone.
    [[maybe_unused]] auto n = ::write(control_.get(), &byte, 1);
}

}  // namespace sandboxd::detail
