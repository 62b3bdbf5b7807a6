/// @file channel_init.cpp
/// The channel init (channel_init.hpp): PID 1 of a channel's namespaces, which runs the
/// channel's command and reports its end; and the helpers the lease supervisor shares.

#include "init/channel_init.hpp"

/// Built static and self-contained: libc and libstdc++ only.

#include "provider/seccomp_filter.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
#include <memory>
#include <string>
#include <vector>

namespace sandboxd::init {
namespace {

namespace proto = supervisor;

constexpr int status_fd = 3;   // write: one line when the command ends
constexpr int control_fd = 4;  // read: one byte per request

// Signals the init forwards to the command's process group.
constexpr int forwarded_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};

}  // namespace

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

// Writes to a pipe whose reader is gone fail with EPIPE instead of killing us.
void ignore_sigpipe() {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, nullptr);
}

// An empty handler: PID 1 of a namespace only receives signals it has a handler for. The
// signals are blocked and read from the signalfd, so this never runs in practice.
void ignore_signal(int) {}

// Once per lease, in the supervisor: every channel init is its clone and inherits the result.
// Empties the capability bounding set, so that no exec in the sandbox (as uid 0 of its user
// namespace, or of a file with capabilities) grants any; the supervisor's own effective set,
// which a channel's init needs for its mounts, stays. False (with errno) on failure: the
// sandbox then refuses to serve.
bool empty_bounding_set() {
    for (int cap = 0; cap <= 63; ++cap) {
        if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0) continue;
        if (errno == EINVAL) return true;  // past the kernel's last capability
        return false;
    }
    return true;
}

// Once per lease, in the supervisor: every disposition back to the default, whatever
// bubblewrap or the daemon left, so that a command only needs the init's own changes undone
// (exec_command()).
void reset_signal_dispositions() {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigemptyset(&dfl.sa_mask);
    for (int sig = 1; sig < NSIG; ++sig) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        ::sigaction(sig, &dfl, nullptr);  // fails harmlessly for libc-reserved signals
    }
}

namespace {

struct Options {
    bool pty = false;
    long grace_ms = -1;  // < 0: keep running after the report (the daemon kills the namespace)
    char** command = nullptr;
    char** envp = nullptr;
    std::uint64_t open_files = 0;          // RLIMIT_NOFILE of the command; 0: inherited
    const std::string* program = nullptr;  // seccomp BPF; empty: none
    /// A warm init's end of its socket pair with the supervisor (close-on-exec), closed once
    /// the command has been exec'd (or has failed to start): the supervisor makes the next
    /// warm init then, not while this channel starts; -1: none (a cloned init).
    int started_fd = -1;
    /// A stack made ahead (a warm init's, its top page written); used when it has room for
    /// the command's argv, else one is made for it.
    CommandStack stack;
};

// In the child made by start_command() (CLONE_VM | CLONE_VFORK: the init waits until the exec
// and shares this memory, so nothing here writes to the init's state but `environ`, which the
// init never reads): becomes its own group, takes the terminal if any, sheds every privilege,
// restores default signal handling and execs. Never returns.
[[noreturn]] void exec_command(const Options& opts) {
    ::setpgid(0, 0);
    if (opts.pty) {
        // SIGTTOU is blocked (inherited mask), so this works from a background group.
        ::tcsetpgrp(STDIN_FILENO, ::getpid());
    }
    // No capability survives: the bounding set is already empty (the supervisor emptied it
    // once, empty_bounding_set(), so that exec as uid 0 grants none); here the ambient,
    // effective, permitted and inheritable sets.
    ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2] = {};
    if (::syscall(SYS_capset, &header, data) < 0) {
        print_error("cannot drop capabilities", "", errno);
        ::_exit(126);
    }
    struct rlimit no_core {
        0, 0
    };
    ::setrlimit(RLIMIT_CORE, &no_core);
    if (opts.open_files > 0) {
        struct rlimit files {};
        ::getrlimit(RLIMIT_NOFILE, &files);
        rlim_t want = static_cast<rlim_t>(opts.open_files);
        if (files.rlim_max != RLIM_INFINITY && want > files.rlim_max) want = files.rlim_max;
        files.rlim_cur = files.rlim_max = want;
        if (::setrlimit(RLIMIT_NOFILE, &files) < 0) {
            print_error("cannot limit open files", "", errno);
            ::_exit(126);
        }
    }
    // Before the mask opens: a signal already pending acts as it would on the command.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigemptyset(&dfl.sa_mask);
    // The init's own changes (block_init_signals()); the rest are the defaults
    // that the supervisor set once (reset_signal_dispositions()).
    for (int sig : forwarded_signals) ::sigaction(sig, &dfl, nullptr);
    ::sigaction(SIGCHLD, &dfl, nullptr);
    ::sigaction(SIGPIPE, &dfl, nullptr);
    if (opts.program != nullptr && !opts.program->empty()) {
        if (int err =
                sandboxd::detail::apply_seccomp_filter(opts.program->data(), opts.program->size());
            err != 0) {
            print_error("cannot apply the syscall filter", "", err);
            ::_exit(126);
        }
    }
    sigset_t empty;
    ::sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);

    // execvp searches the command's own PATH, from the environment it will have.
    environ = opts.envp;
    ::execvp(opts.command[0], opts.command);
    int err = errno;
    print_error("cannot run ", opts.command[0], err);
    ::_exit(err == EACCES || err == ENOEXEC ? 126 : 127);
}

// The signals a channel init reads from its signalfd: those it forwards, and SIGCHLD.
sigset_t init_signal_set() {
    sigset_t mask;
    ::sigemptyset(&mask);
    for (int sig : forwarded_signals) ::sigaddset(&mask, sig);
    ::sigaddset(&mask, SIGCHLD);
    return mask;
}

// A channel init's signal handling, before its signalfd: SIGPIPE ignored, an empty handler
// for each signal it reads (PID 1 of a namespace receives only signals it handles), all of
// them blocked, and the terminal's stop signals too (blocked for good but not read: the init,
// and the command's child before its exec, may call tcsetpgrp from a background group).
// Request-independent, so a warm init does it before it waits. 0 or an errno.
int block_init_signals() {
    ignore_sigpipe();
    const sigset_t mask = init_signal_set();
    struct sigaction handler {};
    handler.sa_handler = ignore_signal;
    handler.sa_mask = mask;
    handler.sa_flags = SA_RESTART;
    for (int sig : forwarded_signals) ::sigaction(sig, &handler, nullptr);
    ::sigaction(SIGCHLD, &handler, nullptr);
    sigset_t blocked = mask;
    ::sigaddset(&blocked, SIGTTOU);
    ::sigaddset(&blocked, SIGTTIN);
    ::sigaddset(&blocked, SIGTSTP);
    return ::sigprocmask(SIG_BLOCK, &blocked, nullptr) == 0 ? 0 : errno;
}

class Init {
public:
    explicit Init(Options opts) : opts_(opts) {}

    /// `signals_error`: block_init_signals() has run (0) or failed (its errno), before
    /// the request (prepare_channel_init()).
    int run(int signals_error) {
        if (signals_error != 0) {
            print_error("sigprocmask", "", signals_error);
            return 1;
        }
        const sigset_t mask = init_signal_set();
        signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
        if (signal_fd_ < 0) {
            print_error("signalfd", "", errno);
            return 1;
        }
        start_command();
        loop();
        return exit_code_;
    }

private:
    // The command's process, as posix_spawn makes one: clone(CLONE_VM | CLONE_VFORK) on a
    // stack of its own (CommandStack), so that no page table is copied and no page is faulted
    // in twice (the init resumes once the child has exec'd or exited).
    void start_command() {
        std::size_t argc = 0;
        while (opts_.command[argc] != nullptr) ++argc;
        CommandStack stack = opts_.stack;
        opts_.stack = {};
        if (stack.map != nullptr && stack.argc < argc) stack.unmap();
        if (stack.map == nullptr) stack = CommandStack::make(argc);
        int pid = -1;
        if (stack.map != nullptr) {
            pid =
                ::clone([](void* opts) -> int { exec_command(*static_cast<const Options*>(opts)); },
                        stack.top(), CLONE_VM | CLONE_VFORK | SIGCHLD, &opts_);
        }
        const int err = errno;
        stack.unmap();
        // Exec'd or failed: the supervisor may make the next warm init now.
        if (opts_.started_fd >= 0) ::close(opts_.started_fd);
        if (pid < 0) {
            print_error("cannot start the command", "", err);
            report("exit 126\n");
            command_done_ = true;
            return;
        }
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

    // The drain grace is over: nothing of the channel may outlive its main process. Once
    // every other process is reaped (ECHILD: in this PID namespace every process descends from
    // the init, and orphans are reparented to it), the init lets go of the channel's streams
    // and says "end": the daemon may send the exit now, without waiting for this process's
    // own exit, whose namespace teardown takes about a millisecond (provider.hpp, fd 3).
    void finish() {
        // With no child left (reap() saw ECHILD) there is nothing to kill: only this process
        // could start another.
        if (!no_children_) ::kill(-1, SIGKILL);
        while (!no_children_) {
            pid_t pid = ::waitpid(-1, nullptr, 0);
            if (pid < 0 && errno == EINTR) continue;
            if (pid < 0) no_children_ = true;
        }
        ::close(STDIN_FILENO);
        ::close(STDOUT_FILENO);
        ::close(STDERR_FILENO);
        if (status_open_) report("end\n");
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

// Moves `fds` (channel_fds of them) to 0..4 and `keep` (if >= 0) to `kept_fd`, close-on-exec,
// closing every other descriptor.
constexpr int kept_fd = 5;
bool take_channel_fds(const std::vector<int>& fds, int keep) {
    int moved[proto::channel_fds];
    for (std::size_t i = 0; i < proto::channel_fds; ++i) {
        moved[i] = ::fcntl(fds[i], F_DUPFD, 16);
        if (moved[i] < 0) return false;
    }
    // Out of the way of 0..4 before they are taken (it may be one of them now).
    if (keep >= 0 && (keep = ::fcntl(keep, F_DUPFD_CLOEXEC, 16)) < 0) return false;
    for (std::size_t i = 0; i < proto::channel_fds; ++i) {
        if (::dup2(moved[i], static_cast<int>(i)) < 0) return false;
    }
    ::fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(control_fd, F_SETFD, FD_CLOEXEC);
    if (keep >= 0 && ::dup3(keep, kept_fd, O_CLOEXEC) < 0) return false;
    return ::syscall(SYS_close_range, keep >= 0 ? kept_fd + 1U : 5U, ~0U, 0U) == 0;
}

// Host-wide files of /proc that a fresh procfs shows whatever namespace reads it: those that
// container runtimes mask (runc's and podman's defaults), and /proc/locks (every process's
// byte-range locks: the daemons' identity locks, so the uids of active leases),
// /proc/diskstats and /proc/partitions (the host's loop devices: other leases' disk activity).
// /dev/null is bound over each file (it reads as empty), an empty read-only tmpfs over each
// directory. Done inside the lease's user namespace, after mounting the channel's /proc: a
// mask made outside it would be locked, and the kernel would then refuse a fresh /proc.
constexpr const char* masked_proc_files[] = {
    "/proc/kcore",       "/proc/keys",        "/proc/key-users",     "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/sysrq-trigger", "/proc/latency_stats",
    "/proc/locks",       "/proc/diskstats",   "/proc/partitions",    "/proc/interrupts",
    "/proc/kallsyms",    "/proc/kmsg",        "/proc/vmallocinfo",   "/proc/slabinfo"};
constexpr const char* masked_proc_dirs[] = {
    "/proc/acpi", "/proc/asound", "/proc/scsi", "/proc/driver",
    "/proc/fs",   "/proc/irq",    "/proc/bus",  "/proc/sys/fs/binfmt_misc"};

// Masks the files above in the fresh /proc. One absent on this kernel is skipped. 0 or an
// errno.
int mask_channel_proc() {
    for (const char* file : masked_proc_files) {
        if (::mount("/dev/null", file, nullptr, MS_BIND, nullptr) < 0 && errno != ENOENT) {
            return errno;
        }
    }
    for (const char* dir : masked_proc_dirs) {
        if (::mount("masked", dir, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                    "size=4k,mode=0555") < 0 &&
            errno != ENOENT) {
            return errno;
        }
    }
    return 0;
}

}  // namespace

// A /proc of this channel's own PID namespace, in a mount namespace of its own, mounted over
// the lease's (which stays hidden below it: nothing here can unmount), with the host-wide
// files above masked. 0 or an errno.
int mount_channel_proc() {
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) < 0 ||
        ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) < 0) {
        return errno;
    }
    return mask_channel_proc();
}

int make_channel_pty(std::uint32_t window, int& master, int& slave) {
    master = -1;
    slave = -1;
    if (::mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=0620") < 0) {
        return errno;
    }
    master = ::open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) return errno;
    int unlock = 0;
    struct winsize ws {};
    ws.ws_row = static_cast<unsigned short>(window >> 16);
    ws.ws_col = static_cast<unsigned short>(window & 0xFFFFU);
    if (::ioctl(master, TIOCSPTLCK, &unlock) == 0 && ::ioctl(master, TIOCSWINSZ, &ws) == 0) {
        slave = ::ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    }
    if (slave < 0) {
        const int err = errno;
        ::close(master);
        master = -1;
        return err;
    }
    return 0;
}

PreparedInit prepare_channel_init() {
    PreparedInit prepared;
    if (::setsid() < 0) prepared.session_error = errno;
    ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    ::umask(022);
    prepared.signals_error = block_init_signals();
    return prepared;
}

// The channel init's work once it has its request; its /proc is mounted (mount_channel_proc)
// and prepare_channel_init() has run. `filtered`: the init itself is under `program` already
// (a warm init applies it ahead), which every process it starts inherits; else the command
// applies it before its exec.
// `started`: a warm init's socket with the supervisor (closed once the command is started), or -1.
[[noreturn]] void run_channel_init(const ChannelRequest& req, const std::string& program,
                                   bool filtered, const PreparedInit& prepared, int started) {
    // Join the channel's cgroup: the daemon opened these files, so the kernel checks its
    // credentials, not ours. This process is single-threaded, so "0" written to a v1 `tasks`
    // file moves all of it.
    for (std::uint32_t i = 0; i < req.header.cgroup_fds; ++i) {
        if (::write(req.fds[proto::channel_fds + i], "0", 1) != 1) {
            print_error("cannot join the channel's cgroup", "", errno);
            ::_exit(125);
        }
    }
    if (!take_channel_fds(req.fds, started)) {
        print_error("cannot set up the channel", "", errno);
        ::_exit(125);
    }
    if (prepared.session_error != 0) {
        print_error("cannot set up the channel", "", prepared.session_error);
        ::_exit(125);
    }
    const bool pty = (req.header.flags & proto::flag_pty) != 0;
    if (pty && ::ioctl(STDIN_FILENO, TIOCSCTTY, 0) < 0) {
        print_error("cannot take the terminal", "", errno);
        ::_exit(125);
    }
    if (::chdir(req.cwd) < 0) {
        // No status line: the daemon reports the channel as failed, with this on stderr.
        print_error("cannot change to directory ", req.cwd, errno);
        ::_exit(125);
    }
    Options opts;
    opts.pty = pty;
    opts.grace_ms = req.header.grace_ms;
    opts.command = const_cast<char**>(req.argv.data());
    opts.envp = const_cast<char**>(req.envp.data());
    opts.open_files = req.header.open_files;
    opts.program = filtered ? nullptr : &program;
    opts.started_fd = started >= 0 ? kept_fd : -1;
    opts.stack = prepared.stack;
    ::_exit(Init(opts).run(prepared.signals_error));
}

}  // namespace sandboxd::init
