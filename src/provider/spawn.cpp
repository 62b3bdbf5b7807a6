#include "provider/spawn.hpp"

#include <sandboxd/core/errors.hpp>

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
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

// --- In the child, which shares the daemon's memory (CLONE_VM) while the daemon's thread waits
// (CLONE_VFORK): async-signal-safe calls only, no allocation, no write to memory but the
// child's own stack and `ChildStart::error`. ---

constexpr int child_fds = 8;

struct ChildStart {
    char* const* argv = nullptr;
    char* const* envp = nullptr;
    std::array<int, child_fds> fds{};
    const int* extra_fds = nullptr;  ///< to the child's fds child_fds, child_fds + 1, ...
    std::size_t extra_count = 0;     ///< <= SpawnRequest::max_extra_fds
    int controlling_tty = -1;
    const std::pair<uid_t, gid_t>* run_as = nullptr;
    int netns = -1;
    /// Set by the child when a step fails (its errno); the spawning thread reads it once the
    /// child has exec'd or exited, which is when clone() returns (CLONE_VFORK).
    volatile int error = 0;
};

[[noreturn]] void child_fail(ChildStart& start) {
    start.error = errno != 0 ? errno : EIO;
    ::_exit(127);
}

int close_fds_from(unsigned first, unsigned last) {
    if (first > last) return 0;
    return static_cast<int>(::syscall(SYS_close_range, first, last, 0U));
}

// Closes every descriptor of the child that is not a source of start's fds, extra fds or
// controlling terminal. No allocation: the sources (at most 17) are sorted on the stack.
int close_all_but_sources(const ChildStart& start) {
    int sources[child_fds + SpawnRequest::max_extra_fds + 1];
    std::size_t n = 0;
    auto add = [&](int fd) {
        if (fd < 0) return;
        std::size_t i = n++;
        for (; i > 0 && sources[i - 1] > fd; --i) sources[i] = sources[i - 1];
        sources[i] = fd;
    };
    for (int fd : start.fds) add(fd);
    for (std::size_t i = 0; i < start.extra_count; ++i) add(start.extra_fds[i]);
    add(start.controlling_tty);
    unsigned next = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const auto fd = static_cast<unsigned>(sources[i]);
        if (fd > next && close_fds_from(next, fd - 1) < 0) return -1;
        next = fd + 1;
    }
    return close_fds_from(next, UINT_MAX);
}

int child_main(void* arg) {
    auto& start = *static_cast<ChildStart*>(arg);
    // Every signal to its default while all are still blocked (the parent blocked them
    // around clone, so none of its handlers can run here). Without CLONE_SIGHAND the child
    // has its own copy of the handlers: the daemon's stay as they are.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
        if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
    }

    if (::setsid() < 0) child_fail(start);
    // Before its privileges go (entering a namespace needs CAP_SYS_ADMIN).
    if (start.netns >= 0 && ::setns(start.netns, CLONE_NEWNET) < 0) child_fail(start);

    // The daemon's other descriptors go first (this table is the child's own copy): the moves
    // below then never need more free slots than the child has sources, however close to
    // RLIMIT_NOFILE the daemon is.
    if (close_all_but_sources(start) < 0) child_fail(start);

    // Move everything above the target range first, so that no dup2 below can clobber a
    // source that happens to live in 0..7 or among the extra fds' targets.
    const int first_free = child_fds + static_cast<int>(start.extra_count);
    int moved[child_fds];
    for (int i = 0; i < child_fds; ++i) {
        moved[i] = -1;
        if (start.fds[i] >= 0) {
            moved[i] = ::fcntl(start.fds[i], F_DUPFD_CLOEXEC, first_free);
            if (moved[i] < 0) child_fail(start);
        }
    }
    int moved_extra[SpawnRequest::max_extra_fds];
    for (std::size_t i = 0; i < start.extra_count; ++i) {
        moved_extra[i] = ::fcntl(start.extra_fds[i], F_DUPFD_CLOEXEC, first_free);
        if (moved_extra[i] < 0) child_fail(start);
    }
    if (start.controlling_tty >= 0 && ::ioctl(start.controlling_tty, TIOCSCTTY, 0) < 0) {
        child_fail(start);
    }
    for (int i = 0; i < child_fds; ++i) {
        if (moved[i] >= 0) {
            if (::dup2(moved[i], i) < 0) child_fail(start);
        } else {
            ::close(i);
        }
    }
    for (std::size_t i = 0; i < start.extra_count; ++i) {
        if (::dup2(moved_extra[i], child_fds + static_cast<int>(i)) < 0) child_fail(start);
    }
    // The descriptor table is the child's own (no CLONE_FILES): close everything else.
    if (close_fds_from(static_cast<unsigned>(first_free), UINT_MAX) < 0) child_fail(start);
    if (start.run_as != nullptr) {
        // Raw syscalls: glibc's setresuid would signal every thread of the daemon to change
        // credentials too (setxid broadcast), which must not happen from this child.
        if (::syscall(SYS_setgroups, 0, nullptr) < 0 ||
            ::syscall(SYS_setresgid, start.run_as->second, start.run_as->second,
                      start.run_as->second) < 0 ||
            ::syscall(SYS_setresuid, start.run_as->first, start.run_as->first,
                      start.run_as->first) < 0) {
            child_fail(start);
        }
    }

    sigset_t empty;
    ::sigemptyset(&empty);
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);

    ::execve(start.argv[0], start.argv, start.envp);
    child_fail(start);
}

/// The child's stack: mapped for each start and unmapped after it (the child has exec'd or
/// exited by then). Only the pages it touches cost memory.
constexpr std::size_t child_stack_size = 256U << 10;

// --- End of the child. ---

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
    // A new pipe's end has no status flag but its access mode, which F_SETFL ignores: no
    // F_GETFL first (one system call less per pipe, four per channel).
    if (::fcntl(kept == daemon_end::read ? fds[0] : fds[1], F_SETFL, O_NONBLOCK) < 0) {
        throw_errno("cannot set up a pipe", errno);
    }
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
    if (request.extra_fds.size() > SpawnRequest::max_extra_fds) {
        throw rpc_error(errc::provider_error, "cannot start " + what + ": more than " +
                                                  std::to_string(SpawnRequest::max_extra_fds) +
                                                  " extra descriptors");
    }
    // Everything the child touches is prepared here: it allocates nothing.
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

    ChildStart start;
    start.argv = argv.data();
    start.envp = envp.data();
    start.fds = fds;
    start.extra_fds = request.extra_fds.data();
    start.extra_count = request.extra_fds.size();
    start.controlling_tty = request.controlling_tty;
    start.run_as = request.run_as ? &*request.run_as : nullptr;
    start.netns = request.netns;

    void* stack = ::mmap(nullptr, child_stack_size, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) throw_errno("cannot start " + what, errno);

    // Not fork: copying the daemon's page tables costs milliseconds once it is large (6.3 ms
    // with 64 MiB touched, against 0.6 ms here; issue 19). The child borrows the daemon's
    // memory and this thread waits until it has exec'd or exited, as posix_spawn does; all
    // signals stay blocked meanwhile so that no daemon handler runs on the child's stack.
    sigset_t all;
    sigset_t old;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = ::clone(child_main, static_cast<char*>(stack) + child_stack_size,
                        CLONE_VM | CLONE_VFORK | SIGCHLD, &start);
    int clone_errno = errno;
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ::munmap(stack, child_stack_size);
    if (pid < 0) throw_errno("cannot start " + what, clone_errno);

    // The child has exec'd (error 0) or failed a step and exited (its errno).
    if (const int child_errno = start.error; child_errno != 0) {
        reap(pid);
        throw_errno("cannot start " + what, child_errno);
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
