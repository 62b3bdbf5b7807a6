/// @file open_floor.cpp
/// sandboxd_open_floor: the kernel's own cost of each piece of isolation that a channel of a
/// bwrap lease gets (issue 19), with no daemon, no WebSocket and no lease sandbox around it:
/// the floor under `open true` that no daemon can go below while it keeps those pieces.
///
///   sandboxd_open_floor [--count N] [--cgroup-root DIR]
///
/// Each iteration times, in turn, seven ways of running /bin/true to its end, each adding one
/// piece to the one before:
///   spawn     posix_spawn + waitpid, what websocketd does for a connection (the anchor minus
///             its WebSocket);
///   init      a process of its own (clone, as the lease's supervisor makes each channel's
///             init) that spawns the command and waits for it;
///   pid_ns    that process as PID 1 of a new PID namespace (CLONE_NEWPID);
///   mount_ns  in a new mount namespace too, with its own /proc mounted (CLONE_NEWNS);
///   cgroup    joining a cgroup first, by "0" written to a join file opened beforehand (v1:
///             `tasks` in each of the cpu, cpuacct, memory, pids and freezer hierarchies that
///             are mounted under DIR; v2: one cgroup.procs), as a channel's init joins its
///             channel's cgroup;
///   seccomp   the command's process applying sandboxd's syscall filter before its exec;
///   warm      all of that, with the init made (clone, namespaces, /proc) before the timer
///             starts and woken by a byte on a pipe: a channel init made ahead of its open.
/// Beside them, each iteration times one round trip of 64 bytes over a loopback TCP connection
/// to a forked echo process (`tcp_rtt`, TCP_NODELAY both ways): the least that a request
/// from a client and an answer to it (the open's request and its exit frame) add to any of
/// the rows, wherever the process runs.
///
/// Every row but spawn stops its timer when the init says that its command has ended (a byte
/// on a pipe, written once it has reaped it), not at the init's own exit: sandboxd sends a
/// channel's exit on its init's "end" line (include/sandboxd/provider/provider.hpp), so the
/// init's exit (its namespaces' teardown, about 1 ms here) is on no open's path; the init is
/// reaped after the timer. Prints one JSON object for bench/run's report: p50 and p99 (ms) of each.
/// Run as root (namespaces, mounts, cgroups). N defaults to 200; DIR to /sys/fs/cgroup.
///
/// What it leaves out is what the lease's sandbox adds once per lease (the user namespace,
/// bubblewrap's mounts), which is not paid per channel. Its process is small, as the
/// supervisor (a static binary) is: a fork costs in proportion to what the parent has
/// mapped.

#include "provider/seccomp_filter.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

enum class step : int { spawn, init, pid_ns, mount_ns, cgroup, seccomp, warm };
constexpr std::array<const char*, 7> step_names = {"spawn",  "init",    "pid_ns", "mount_ns",
                                                   "cgroup", "seccomp", "warm"};

struct Setup {
    step upto = step::spawn;
    int wake_fd = -1;                  // warm: the init waits for a byte on it,
    int ready_fd = -1;                 // having written one on this
    int done_fd = -1;                  // the init's byte once its command has ended
    std::string program;               // the seccomp filter
    std::vector<int> join_fds;         // opened join files of the floor's own cgroups
    std::vector<std::string> cgroups;  // the floor's own cgroups, removed at the end
};

Setup setup;
volatile std::sig_atomic_t interrupted = 0;  // SIGINT, SIGTERM or SIGHUP: stop, clean up

/// Removes the floor's cgroups (best effort: a process still in one keeps it).
void remove_cgroups() {
    for (int fd : setup.join_fds) ::close(fd);
    setup.join_fds.clear();
    for (const auto& dir : setup.cgroups) ::rmdir(dir.c_str());
    setup.cgroups.clear();
}

[[noreturn]] void fail(const std::string& what, int err) {
    std::fprintf(stderr, "sandboxd_open_floor: %s: %s\n", what.c_str(), std::strerror(err));
    remove_cgroups();
    std::exit(1);
}

bool at_least(step s) { return static_cast<int>(setup.upto) >= static_cast<int>(s); }

/// posix_spawn of /bin/true (applying the filter in the child first when asked, as the
/// channel init does between its vfork and the command's exec) and its wait. 0 or an errno.
int run_true() {
    char arg0[] = "true";
    char* argv[] = {arg0, nullptr};
    pid_t pid = -1;
    if (at_least(step::seccomp)) {
        // posix_spawn cannot run code between its fork and exec: vfork can, as the init's
        // clone(CLONE_VM | CLONE_VFORK) does.
        pid = ::vfork();
        if (pid == 0) {
            if (sandboxd::detail::apply_seccomp_filter(setup.program.data(),
                                                       setup.program.size()) != 0) {
                ::_exit(126);
            }
            ::execve("/bin/true", argv, environ);
            ::_exit(127);
        }
        if (pid < 0) return errno;
    } else if (int err = ::posix_spawn(&pid, "/bin/true", nullptr, nullptr, argv, environ);
               err != 0) {
        return err;
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return errno;
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : ECHILD;
}

/// The channel init's part: its namespace's /proc, its cgroup, then the command.
int init_main(void*) {
    if (at_least(step::mount_ns) &&
        (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) < 0 ||
         ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) < 0)) {
        return 2;
    }
    if (setup.wake_fd >= 0) {
        char byte = 0;
        if (::write(setup.ready_fd, "r", 1) != 1 || ::read(setup.wake_fd, &byte, 1) != 1) return 5;
    }
    if (at_least(step::cgroup)) {
        for (int fd : setup.join_fds) {
            if (::write(fd, "0", 1) != 1) return 3;
        }
    }
    if (run_true() != 0) return 4;
    return ::write(setup.done_fd, "d", 1) == 1 ? 0 : 6;
}

/// One timed run of `s` (ms).
double timed(step s) {
    setup.upto = s;
    int done[2] = {-1, -1};
    if (s != step::spawn) {
        if (::pipe2(done, O_CLOEXEC) < 0) fail("pipe2", errno);
        setup.done_fd = done[1];
    }
    int wake[2] = {-1, -1};
    int ready[2] = {-1, -1};
    pid_t pid = -1;
    auto start_init = [&] {
        int flags = SIGCHLD;
        if (at_least(step::pid_ns)) flags |= CLONE_NEWPID;
        if (at_least(step::mount_ns)) flags |= CLONE_NEWNS;
        alignas(16) static char stack[256 << 10];
        pid = ::clone(init_main, stack + sizeof stack, flags, nullptr);
        if (pid < 0) fail(std::string("clone for ") + step_names[static_cast<int>(s)], errno);
    };
    if (s == step::warm) {
        // Made, and through its mounts, before the timer: it then waits for its byte.
        if (::pipe2(wake, O_CLOEXEC) < 0 || ::pipe2(ready, O_CLOEXEC) < 0) fail("pipe2", errno);
        setup.wake_fd = wake[0];
        setup.ready_fd = ready[1];
        start_init();
        setup.wake_fd = setup.ready_fd = -1;
        ::close(wake[0]);
        ::close(ready[1]);
        // Its byte on `ready`: through its namespaces and mounts, it waits for ours.
        char byte = 0;
        if (::read(ready[0], &byte, 1) != 1) fail("the warm init did not start", EPROTO);
        ::close(ready[0]);
    }
    const auto began = std::chrono::steady_clock::now();
    if (s == step::spawn) {
        if (int err = run_true(); err != 0) fail("spawn /bin/true", err);
    } else {
        if (s == step::warm) {
            if (::write(wake[1], "x", 1) != 1) fail("wake the init", errno);
            ::close(wake[1]);
        } else {
            start_init();
        }
        // The init's word, or EOF when it failed before it (its status says how, below).
        ::close(done[1]);
        setup.done_fd = -1;
        char byte = 0;
        while (::read(done[0], &byte, 1) < 0 && errno == EINTR) {
        }
    }
    const auto ended = std::chrono::steady_clock::now();
    if (s != step::spawn) {
        ::close(done[0]);
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0) {
            if (errno != EINTR) fail("waitpid", errno);
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            std::fprintf(stderr, "sandboxd_open_floor: %s: the init failed (status %d)\n",
                         step_names[static_cast<int>(s)], status);
            std::exit(1);
        }
    }
    return std::chrono::duration<double, std::milli>(ended - began).count();
}

/// A loopback TCP connection to a forked process that echoes what it reads; the client's end.
/// The echo process exits at EOF (reaped by close_echo()).
struct Echo {
    int fd = -1;
    pid_t pid = -1;
};

Echo start_echo() {
    Echo echo;
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0 ||
        ::listen(listener, 1) < 0 ||
        ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) < 0) {
        fail("loopback listener", errno);
    }
    echo.pid = ::fork();
    if (echo.pid < 0) fail("fork of the echo process", errno);
    if (echo.pid == 0) {
        const int conn = ::accept(listener, nullptr, nullptr);
        const int one = 1;
        ::setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char buf[4096];
        for (;;) {
            const ssize_t n = ::read(conn, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0 || ::write(conn, buf, static_cast<std::size_t>(n)) != n) ::_exit(0);
        }
    }
    ::close(listener);
    echo.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (echo.fd < 0 || ::connect(echo.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0 ||
        ::setsockopt(echo.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) {
        fail("loopback connection", errno);
    }
    return echo;
}

/// One round trip of 64 bytes (ms).
double round_trip(const Echo& echo) {
    char out[64] = {};
    char in[64];
    const auto began = std::chrono::steady_clock::now();
    if (::write(echo.fd, out, sizeof out) != static_cast<ssize_t>(sizeof out)) {
        fail("write to the echo process", errno);
    }
    std::size_t got = 0;
    while (got < sizeof in) {
        const ssize_t n = ::read(echo.fd, in + got, sizeof in - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("read from the echo process", n < 0 ? errno : EPIPE);
        got += static_cast<std::size_t>(n);
    }
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began)
        .count();
}

void close_echo(Echo& echo) {
    ::close(echo.fd);
    while (::waitpid(echo.pid, nullptr, 0) < 0 && errno == EINTR) {
    }
}

/// The floor's own cgroups (setup.cgroups, their join files in setup.join_fds): one per v1
/// hierarchy a channel joins, or one (v2).
void make_cgroups(const std::string& root) {
    const std::string name = "sandboxd-open-floor-" + std::to_string(::getpid());
    auto make = [&](const std::string& hierarchy, const char* join_file) {
        const std::string dir = hierarchy + "/" + name;
        if (::mkdir(dir.c_str(), 0755) < 0) fail("mkdir " + dir, errno);
        setup.cgroups.push_back(dir);
        const int fd = ::open((dir + "/" + join_file).c_str(), O_WRONLY | O_CLOEXEC);
        if (fd < 0) fail("open " + dir + "/" + join_file, errno);
        setup.join_fds.push_back(fd);
    };
    struct stat st {};
    if (::stat((root + "/cgroup.controllers").c_str(), &st) == 0) {
        make(root, "cgroup.procs");  // v2
        return;
    }
    std::vector<std::string> seen;  // cpu and cpuacct are often one hierarchy, linked twice
    for (const char* h : {"cpu", "cpuacct", "memory", "pids", "freezer"}) {
        const std::string hierarchy = root + "/" + h;
        char real[4096];
        if (::stat((hierarchy + "/tasks").c_str(), &st) != 0 ||
            ::realpath(hierarchy.c_str(), real) == nullptr ||
            std::find(seen.begin(), seen.end(), real) != seen.end()) {
            continue;
        }
        seen.emplace_back(real);
        make(real, "tasks");
    }
    if (setup.cgroups.empty()) fail("no cgroup hierarchy under " + root, ENOENT);
}

}  // namespace

int main(int argc, char** argv) {
    int count = 200;
    std::string cgroup_root = "/sys/fs/cgroup";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--count" && i + 1 < argc) {
            count = std::atoi(argv[++i]);
        } else if (a == "--cgroup-root" && i + 1 < argc) {
            cgroup_root = argv[++i];
        } else {
            std::fprintf(stderr, "usage: sandboxd_open_floor [--count N] [--cgroup-root DIR]\n");
            return 2;
        }
    }
    if (count < 1) count = 1;
    setup.program = sandboxd::detail::build_seccomp_filter();
    struct sigaction stop {};
    stop.sa_handler = [](int) { interrupted = 1; };
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &stop, nullptr);
    make_cgroups(cgroup_root);

    Echo echo = start_echo();
    std::array<std::vector<double>, step_names.size()> times;
    std::vector<double> rtt;
    for (int i = 0; i < count && interrupted == 0; ++i) {
        for (std::size_t s = 0; s < step_names.size(); ++s) {
            times[s].push_back(timed(static_cast<step>(s)));
        }
        rtt.push_back(round_trip(echo));
    }
    close_echo(echo);
    // Every process that joined has exited: the cgroups are empty.
    remove_cgroups();
    if (interrupted != 0) {
        std::fprintf(stderr, "sandboxd_open_floor: interrupted\n");
        return 130;
    }

    std::string steps;
    auto add = [&steps](const char* name, std::vector<double>& v) {
        std::sort(v.begin(), v.end());
        const double p50 = v[v.size() / 2];
        const double p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
        char entry[160];
        std::snprintf(entry, sizeof entry, "%s\"%s\": {\"p50\": %.4f, \"p99\": %.4f, \"n\": %zu}",
                      steps.empty() ? "" : ", ", name, p50, p99, v.size());
        steps += entry;
    };
    for (std::size_t s = 0; s < step_names.size(); ++s) add(step_names[s], times[s]);
    add("tcp_rtt", rtt);
    // The figure: every piece, the init made on the open's path (as sandboxd makes it).
    const auto& full = times[static_cast<std::size_t>(step::seccomp)];
    std::printf("{\"open_floor_p50_ms\": %.4f, \"details\": {\"open_floor\": {%s}}}\n",
                full[full.size() / 2], steps.c_str());
    return 0;
}
