/// @file init_main.cpp
/// sandboxd-init: PID 1 of a channel's PID namespace (bwrap --unshare-pid --as-pid-1).
///
/// Usage: sandboxd-init [--pty] [--grace-ms N] -- CMD [ARG...]
///
/// With --grace-ms, once CMD's main process has ended the init waits until no other process
/// is left or N ms have passed, kills what remains (kill(-1, SIGKILL)), reaps it and exits:
/// the daemon's drain grace (docs/protocol.md section 3). The outer bubblewrap then exits
/// and every copy of the channel's pipes closes, so the daemon reads output to EOF.
///
/// It starts CMD in its own process group, forwards the signals it receives to that group,
/// obeys the daemon's control bytes on fd 4, reaps every process reparented to it and
/// reports the end of CMD's main process on fd 3 ("exit N\n" or "signal N\n"); see
/// include/sandboxd/provider.hpp. After that report it keeps running (reaping, obeying fd 4)
/// so that background descendants may finish their output; the daemon kills the namespace.
/// It exits early only when fd 3's reader is gone or fd 4 reaches EOF after CMD ended.
///
/// Built static and self-contained: libc and libstdc++ only.

#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace {

constexpr int status_fd = 3;   // write: one line when the command ends
constexpr int control_fd = 4;  // read: one byte per request

// Signals the init forwards to the command's process group.
constexpr int forwarded_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};

void write_all(int fd, const char* data, std::size_t size) {
    while (size > 0) {
        ssize_t n = ::write(fd, data, size);
        if (n < 0) {
            if (errno == EINTR) continue;
            return;
        }
        data += n;
        size -= static_cast<std::size_t>(n);
    }
}

void print_error(const char* what, const char* detail, int err) {
    char buf[512];
    int n = std::snprintf(buf, sizeof buf, "sandboxd-init: %s%s: %s\n", what, detail,
                          std::strerror(err));
    if (n > 0) {
        write_all(STDERR_FILENO, buf, std::min(static_cast<std::size_t>(n), sizeof buf - 1));
    }
}

// An empty handler: PID 1 of a namespace only receives signals it has a handler for. The
// signals are blocked and read from the signalfd, so this never runs in practice.
void ignore_signal(int) {}

struct Options {
    bool pty = false;
    long grace_ms = -1;  // < 0: keep running after the report (the daemon kills the namespace)
    char** command = nullptr;
};

bool parse_args(int argc, char** argv, Options& opts) {
    int i = 1;
    for (; i < argc; ++i) {
        if (std::strcmp(argv[i], "--pty") == 0) {
            opts.pty = true;
        } else if (std::strcmp(argv[i], "--grace-ms") == 0 && i + 1 < argc) {
            char* end = nullptr;
            opts.grace_ms = std::strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end != '\0' || opts.grace_ms < 0) return false;
        } else if (std::strcmp(argv[i], "--") == 0) {
            ++i;
            break;
        } else {
            return false;
        }
    }
    if (i >= argc) return false;
    opts.command = argv + i;
    return true;
}

// In the forked child: becomes its own group, takes the terminal if any, restores default
// signal handling and execs. Never returns.
[[noreturn]] void exec_command(const Options& opts) {
    ::setpgid(0, 0);
    if (opts.pty) {
        // SIGTTOU is blocked (inherited mask), so this works from a background group.
        ::tcsetpgrp(STDIN_FILENO, ::getpid());
    }
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigemptyset(&dfl.sa_mask);
    for (int sig = 1; sig < NSIG; ++sig) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        ::sigaction(sig, &dfl, nullptr);  // fails harmlessly for libc-reserved signals
    }
    sigset_t empty;
    ::sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);

    ::execvp(opts.command[0], opts.command);
    int err = errno;
    print_error("cannot run ", opts.command[0], err);
    ::_exit(err == EACCES || err == ENOEXEC ? 126 : 127);
}

class Init {
public:
    explicit Init(Options opts) : opts_(opts) {}

    int run() {
        if (!setup_signals()) return 1;
        start_command();
        loop();
        return exit_code_;
    }

private:
    bool setup_signals() {
        struct sigaction ign {};
        ign.sa_handler = SIG_IGN;
        ::sigemptyset(&ign.sa_mask);
        ::sigaction(SIGPIPE, &ign, nullptr);

        sigset_t mask;
        ::sigemptyset(&mask);
        for (int sig : forwarded_signals) ::sigaddset(&mask, sig);
        ::sigaddset(&mask, SIGCHLD);

        struct sigaction handler {};
        handler.sa_handler = ignore_signal;
        handler.sa_mask = mask;
        handler.sa_flags = SA_RESTART;
        for (int sig : forwarded_signals) ::sigaction(sig, &handler, nullptr);
        ::sigaction(SIGCHLD, &handler, nullptr);

        // Blocked for good but not read: lets the init (and the child before exec) call
        // tcsetpgrp from a background process group.
        sigset_t blocked = mask;
        ::sigaddset(&blocked, SIGTTOU);
        ::sigaddset(&blocked, SIGTTIN);
        ::sigaddset(&blocked, SIGTSTP);
        if (::sigprocmask(SIG_BLOCK, &blocked, nullptr) != 0) {
            print_error("sigprocmask", "", errno);
            return false;
        }
        signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
        if (signal_fd_ < 0) {
            print_error("signalfd", "", errno);
            return false;
        }
        return true;
    }

    void start_command() {
        pid_t pid = ::fork();
        if (pid < 0) {
            print_error("fork", "", errno);
            report("exit 126\n");
            command_done_ = true;
            return;
        }
        if (pid == 0) exec_command(opts_);
        command_pid_ = pid;
        // Also done by the child; whichever runs first wins, the other fails harmlessly.
        ::setpgid(pid, pid);
        if (opts_.pty) ::tcsetpgrp(STDIN_FILENO, pid);
    }

    void loop() {
        while (!exit_now_) {
            struct pollfd fds[3];
            nfds_t n = 0;
            fds[n++] = {signal_fd_, POLLIN, 0};
            int control_index = -1;
            if (control_open_) {
                control_index = static_cast<int>(n);
                fds[n++] = {control_fd, POLLIN, 0};
            }
            int status_index = -1;
            if (command_done_ && status_open_) {
                // A pipe's write end polls POLLERR once its reader is gone.
                status_index = static_cast<int>(n);
                fds[n++] = {status_fd, 0, 0};
            }
            int timeout = -1;
            if (command_done_ && opts_.grace_ms >= 0) {
                if (no_children_ || now_ms() >= grace_deadline_) {
                    finish();
                    return;
                }
                timeout = static_cast<int>(grace_deadline_ - now_ms());
            }
            int r = ::poll(fds, n, timeout);
            if (r < 0) {
                if (errno == EINTR) continue;
                print_error("poll", "", errno);
                exit_code_ = 1;
                return;
            }
            if (fds[0].revents != 0) read_signals();
            if (control_index >= 0 && fds[control_index].revents != 0) read_control();
            if (status_index >= 0 && (fds[status_index].revents & (POLLERR | POLLHUP)) != 0) {
                status_open_ = false;
                exit_now_ = true;
            }
        }
    }

    void read_signals() {
        struct signalfd_siginfo info[16];
        for (;;) {
            ssize_t n = ::read(signal_fd_, info, sizeof info);
            if (n < 0) {
                if (errno == EINTR) continue;
                return;  // EAGAIN: drained
            }
            if (n == 0) return;
            auto count = static_cast<std::size_t>(n) / sizeof info[0];
            for (std::size_t i = 0; i < count; ++i) {
                int sig = static_cast<int>(info[i].ssi_signo);
                if (sig == SIGCHLD) {
                    reap();
                } else if (command_pid_ > 0) {
                    ::kill(-command_pid_, sig);
                }
            }
        }
    }

    void reap() {
        for (;;) {
            int status = 0;
            pid_t pid = ::waitpid(-1, &status, WNOHANG);
            if (pid < 0 && errno == EINTR) continue;
            if (pid < 0 && errno == ECHILD) no_children_ = true;
            if (pid <= 0) return;
            if (pid != command_pid_ || command_done_) continue;
            command_done_ = true;
            grace_deadline_ = now_ms() + opts_.grace_ms;
            char line[32];
            if (WIFSIGNALED(status)) {
                std::snprintf(line, sizeof line, "signal %d\n", WTERMSIG(status));
                exit_code_ = 128 + WTERMSIG(status);
            } else {
                std::snprintf(line, sizeof line, "exit %d\n", WEXITSTATUS(status));
                exit_code_ = WEXITSTATUS(status);
            }
            report(line);
        }
    }

    void report(const char* line) {
        std::size_t size = std::strlen(line);
        const char* p = line;
        while (size > 0) {
            ssize_t n = ::write(status_fd, p, size);
            if (n < 0) {
                if (errno == EINTR) continue;
                // EPIPE (the daemon is gone) or no fd 3 at all: nobody to keep running for.
                status_open_ = false;
                exit_now_ = true;
                return;
            }
            p += n;
            size -= static_cast<std::size_t>(n);
        }
    }

    void read_control() {
        unsigned char buf[64];
        ssize_t n = ::read(control_fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) return;
            control_open_ = false;  // unusable; treat like EOF
        } else if (n == 0) {
            control_open_ = false;
        }
        if (!control_open_) {
            // EOF before the command ended is ignored (fd 4 is just no longer polled); after
            // it, the daemon has let go of the channel.
            if (command_done_) exit_now_ = true;
            return;
        }
        for (ssize_t i = 0; i < n; ++i) {
            int sig = buf[i] & 0x7f;
            if (sig < 1 || sig > 64) continue;
            if ((buf[i] & 0x80) != 0) {
                ::kill(-1, sig);  // every process of the namespace but the init itself
            } else if (sig == SIGWINCH && opts_.pty) {
                // As the kernel does on a size change: the terminal's foreground group.
                const pid_t fg = ::tcgetpgrp(STDIN_FILENO);
                if (fg > 0) {
                    ::kill(-fg, sig);
                } else if (command_pid_ > 0) {
                    ::kill(-command_pid_, sig);
                }
            } else if (command_pid_ > 0) {
                ::kill(-command_pid_, sig);
            }
        }
    }

    static long long now_ms() {
        timespec ts{};
        ::clock_gettime(CLOCK_MONOTONIC, &ts);
        return static_cast<long long>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
    }

    // The drain grace is over: nothing of the channel may outlive its main process.
    void finish() {
        ::kill(-1, SIGKILL);
        for (;;) {
            pid_t pid = ::waitpid(-1, nullptr, 0);
            if (pid < 0 && errno == EINTR) continue;
            if (pid < 0) break;
        }
        exit_now_ = true;
    }

    Options opts_;
    long long grace_deadline_ = 0;
    bool no_children_ = false;
    int signal_fd_ = -1;
    pid_t command_pid_ = -1;
    bool command_done_ = false;
    bool control_open_ = true;
    bool status_open_ = true;
    bool exit_now_ = false;
    int exit_code_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
    // Keep only the protocol fds: nothing else may reach the command.
    ::fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(control_fd, F_SETFD, FD_CLOEXEC);
    ::syscall(SYS_close_range, 5U, ~0U, 0U);

    Options opts;
    if (!parse_args(argc, argv, opts)) {
        static const char usage[] = "usage: sandboxd-init [--pty] -- CMD [ARG...]\n";
        write_all(STDERR_FILENO, usage, sizeof usage - 1);
        return 2;
    }
    // bwrap exports PWD after --chdir; the command's environment is exactly what the daemon
    // asked for.
    ::unsetenv("PWD");
    return Init(opts).run();
}
