#include "provider/spawn.hpp"

#include <sandboxd/core/errors.hpp>

#include <fcntl.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>

namespace sandboxd::detail {
namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
    if (err == EMFILE || err == ENFILE) {
        // Not the provider's fault: the node has no descriptor left for another channel
        // (RLIMIT_NOFILE, or the system's file table). Like a full channel limit, it passes
        // once channels end.
        throw rpc_error(errc::channel_limit,
                        what + ": this node has no file descriptor left for another channel (" +
                            (err == EMFILE ? "RLIMIT_NOFILE" : "system file table") + ")");
    }
    throw rpc_error(errc::provider_error, what + ": " + std::strerror(err));
}

void set_nonblocking(int fd, const char* what) {
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throw_errno(what, errno);
}

// --- Between fork and exec: async-signal-safe calls only. ---

[[noreturn]] void child_fail(int err_fd) {
    int err = errno;
    ssize_t ignored = ::write(err_fd, &err, sizeof err);
    (void)ignored;
    ::_exit(127);
}

int close_fds_from(unsigned first, unsigned last) {
    if (first > last) return 0;
    return static_cast<int>(::syscall(SYS_close_range, first, last, 0U));
}

constexpr int child_fds = 8;

[[noreturn]] void child_main(char* const* argv, char* const* envp,
                             const std::array<int, child_fds>& fds, int controlling_tty,
                             const int* cgroups, std::size_t cgroup_count,
                             const std::pair<uid_t, gid_t>* run_as, int err_fd) {
    // Into the cgroups before anything else, so that nothing of the child runs outside them.
    for (std::size_t i = 0; i < cgroup_count; ++i) {
        if (::write(cgroups[i], "0", 1) != 1) child_fail(err_fd);
    }
    // Every signal to its default while all are still blocked (the parent blocked them
    // around fork, so none of its handlers can run here).
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
        if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
    }

    if (::setsid() < 0) child_fail(err_fd);

    // Move everything above the target range first, so that no dup2 below can clobber a
    // source that happens to live in 0..4.
    if (err_fd < child_fds) {
        err_fd = ::fcntl(err_fd, F_DUPFD_CLOEXEC, child_fds);
        if (err_fd < 0) ::_exit(127);
    }
    int moved[child_fds];
    for (int i = 0; i < child_fds; ++i) {
        moved[i] = -1;
        if (fds[i] >= 0) {
            moved[i] = ::fcntl(fds[i], F_DUPFD_CLOEXEC, child_fds);
            if (moved[i] < 0) child_fail(err_fd);
        }
    }
    if (controlling_tty >= 0 && ::ioctl(controlling_tty, TIOCSCTTY, 0) < 0) child_fail(err_fd);
    for (int i = 0; i < child_fds; ++i) {
        if (moved[i] >= 0) {
            if (::dup2(moved[i], i) < 0) child_fail(err_fd);
        } else {
            ::close(i);
        }
    }
    // Close everything else but the error pipe (close-on-exec: it goes away with the exec).
    auto err = static_cast<unsigned>(err_fd);
    if (close_fds_from(child_fds, err - 1) < 0 || close_fds_from(err + 1, UINT_MAX) < 0) {
        child_fail(err_fd);
    }
    if (run_as != nullptr) {
        // Raw syscalls: glibc's setresuid would signal every thread of the parent's image to
        // change credentials too (setxid broadcast), which must not run in a forked child.
        if (::syscall(SYS_setgroups, 0, nullptr) < 0 ||
            ::syscall(SYS_setresgid, run_as->second, run_as->second, run_as->second) < 0 ||
            ::syscall(SYS_setresuid, run_as->first, run_as->first, run_as->first) < 0) {
            child_fail(err_fd);
        }
    }

    sigset_t empty;
    ::sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);

    ::execve(argv[0], argv, envp);
    child_fail(err_fd);
}

// --- End of the fork/exec section. ---

std::vector<char*> pointers(std::vector<std::string>& strings) {
    std::vector<char*> out;
    out.reserve(strings.size() + 1);
    for (auto& s : strings) out.push_back(s.data());
    out.push_back(nullptr);
    return out;
}

void reap(pid_t pid) {
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
}

}  // namespace

Pipe make_pipe(daemon_end kept) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) < 0) throw_errno("cannot create a pipe", errno);
    Pipe p{unique_fd(fds[0]), unique_fd(fds[1])};
    set_nonblocking(kept == daemon_end::read ? fds[0] : fds[1], "cannot set up a pipe");
    return p;
}

Pty open_pty(const PtySize& size) {
    Pty pty;
    pty.master.reset(::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!pty.master) throw_errno("cannot open a pty", errno);
    if (::grantpt(pty.master.get()) < 0 || ::unlockpt(pty.master.get()) < 0) {
        throw_errno("cannot set up a pty", errno);
    }
    char name[128];
    if (int err = ::ptsname_r(pty.master.get(), name, sizeof name); err != 0) {
        throw_errno("cannot name a pty", err);
    }
    pty.slave.reset(::open(name, O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!pty.slave) throw_errno(std::string("cannot open ") + name, errno);
    struct winsize ws {};
    ws.ws_col = size.cols;
    ws.ws_row = size.rows;
    if (::ioctl(pty.slave.get(), TIOCSWINSZ, &ws) < 0) throw_errno("cannot size a pty", errno);
    set_nonblocking(pty.master.get(), "cannot set up a pty");
    return pty;
}

SpawnResult spawn_process(const SpawnRequest& request, const std::string& what) {
    if (request.argv.empty()) {
        throw rpc_error(errc::provider_error, "cannot start " + what + ": empty argv");
    }
    // Everything the child touches is prepared here: no allocation after fork.
    std::vector<std::string> argv_storage = request.argv;
    std::vector<std::string> envp_storage = request.envp;
    std::vector<char*> argv = pointers(argv_storage);
    std::vector<char*> envp = pointers(envp_storage);

    std::array<int, child_fds> fds = request.fds;
    unique_fd dev_null;
    for (int i = 0; i < 3; ++i) {
        if (fds[i] >= 0) continue;
        if (!dev_null) {
            dev_null.reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
            if (!dev_null) throw_errno("cannot open /dev/null", errno);
        }
        fds[i] = dev_null.get();
    }

    int err_pipe[2];
    if (::pipe2(err_pipe, O_CLOEXEC) < 0) throw_errno("cannot create a pipe", errno);
    unique_fd err_read(err_pipe[0]);
    unique_fd err_write(err_pipe[1]);

    sigset_t all;
    sigset_t old;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = ::fork();
    if (pid == 0) {
        child_main(argv.data(), envp.data(), fds, request.controlling_tty,
                   request.join_cgroups.data(), request.join_cgroups.size(),
                   request.run_as ? &*request.run_as : nullptr, err_write.get());
    }
    int fork_errno = errno;
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    err_write.reset();
    if (pid < 0) throw_errno("cannot start " + what, fork_errno);

    // EOF: the exec succeeded (the pipe is close-on-exec). An int: the child's errno.
    int child_errno = 0;
    ssize_t n = 0;
    do {
        n = ::read(err_read.get(), &child_errno, sizeof child_errno);
    } while (n < 0 && errno == EINTR);
    if (n != 0) {
        int err = n == static_cast<ssize_t>(sizeof child_errno) ? child_errno : EIO;
        reap(pid);
        throw_errno("cannot start " + what, err);
    }

    // PIDFD_NONBLOCK is O_NONBLOCK. pid cannot be recycled: it is our unreaped child.
    long pidfd = ::syscall(SYS_pidfd_open, pid, O_NONBLOCK);
    if (pidfd < 0) {
        int err = errno;
        ::kill(pid, SIGKILL);
        reap(pid);
        throw_errno("cannot watch " + what, err);
    }
    return SpawnResult{pid, unique_fd(static_cast<int>(pidfd))};
}

}  // namespace sandboxd::detail
