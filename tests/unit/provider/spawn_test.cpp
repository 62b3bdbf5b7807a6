// detail::spawn_process: the daemon starts programs without fork (clone with CLONE_VM and
// CLONE_VFORK, issue 19). What the child gets, what it does not inherit, what a failure says,
// and that the daemon's own signal handling is untouched by the child's resets.
#include "provider/spawn.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

using namespace sandboxd;
using namespace sandboxd::detail;

namespace {

std::string read_all(int fd) {
    std::string out;
    char buf[4096];
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 10000) <= 0) break;  // a bound, not a sync: EOF comes first
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n <= 0) break;
        out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
}

int wait_status(pid_t pid) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
}

void on_usr2(int /*sig*/) {}

}  // namespace

TEST_CASE("spawn_process runs the program with exactly the fds and environment asked for",
          "[spawn]") {
    Pipe out = make_pipe(daemon_end::read);
    // A descriptor of this process without close-on-exec: the child must not get it.
    const int leak = ::fcntl(out.write_end.get(), F_DUPFD, 20);
    REQUIRE(leak >= 20);
    const std::string fd = std::to_string(leak);
    SpawnRequest req;
    req.argv = {"/bin/sh", "-c",
                "printf '%s|' \"$FOO\"; for f in 0 1 2 3 4 5 6 7 " + fd +
                    "; do [ -e /proc/$$/fd/$f ] && printf '%s ' $f; done; echo; exit 3"};
    req.envp = {"FOO=bar baz"};
    req.fds[1] = out.write_end.get();
    auto child = spawn_process(req, "test shell");
    out.write_end.reset();
    ::close(leak);
    REQUIRE(child.pid > 0);
    REQUIRE(child.pidfd);
    CHECK(::getsid(child.pid) == child.pid);  // its own session
    // stdin and stderr are /dev/null, stdout the pipe; nothing else of this process leaks in.
    CHECK(read_all(out.read_end.get()) == "bar baz|0 1 2 \n");
    const int status = wait_status(child.pid);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
}

TEST_CASE("spawn_process gives the child an empty mask and default handlers and leaves ours alone",
          "[spawn]") {
    struct sigaction ours {};
    ours.sa_handler = on_usr2;
    struct sigaction saved_usr2 {};
    struct sigaction saved_hup {};
    REQUIRE(::sigaction(SIGUSR2, &ours, &saved_usr2) == 0);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    REQUIRE(::sigaction(SIGHUP, &ignore, &saved_hup) == 0);
    sigset_t block;
    sigset_t saved_mask;
    ::sigemptyset(&block);
    ::sigaddset(&block, SIGUSR1);
    REQUIRE(::pthread_sigmask(SIG_BLOCK, &block, &saved_mask) == 0);

    Pipe out = make_pipe(daemon_end::read);
    SpawnRequest req;
    req.argv = {"/bin/sh", "-c", "grep -E '^Sig(Blk|Ign):' /proc/self/status"};
    req.envp = {"PATH=/usr/bin:/bin"};
    req.fds[1] = out.write_end.get();
    auto child = spawn_process(req, "test shell");
    out.write_end.reset();
    const std::string status_lines = read_all(out.read_end.get());
    wait_status(child.pid);

    // Ours, after the child reset every handler to its default in its own copy of the table.
    struct sigaction now {};
    REQUIRE(::sigaction(SIGUSR2, nullptr, &now) == 0);
    CHECK(now.sa_handler == on_usr2);
    REQUIRE(::sigaction(SIGHUP, nullptr, &now) == 0);
    CHECK(now.sa_handler == SIG_IGN);
    sigset_t mask_now;
    REQUIRE(::pthread_sigmask(SIG_SETMASK, nullptr, &mask_now) == 0);
    CHECK(::sigismember(&mask_now, SIGUSR1) == 1);
    CHECK(::sigismember(&mask_now, SIGUSR2) == 0);

    ::pthread_sigmask(SIG_SETMASK, &saved_mask, nullptr);
    ::sigaction(SIGUSR2, &saved_usr2, nullptr);
    ::sigaction(SIGHUP, &saved_hup, nullptr);

    // The child: nothing blocked, nothing ignored (grep's own status, after exec).
    CHECK(status_lines == "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
}

TEST_CASE("spawn_process reports a program that cannot start and leaves no child", "[spawn]") {
    SpawnRequest req;
    req.argv = {"/nonexistent/sandboxd-test-program"};
    try {
        (void)spawn_process(req, "a missing program");
        FAIL("spawn_process started a program that does not exist");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::provider_error);
        CHECK(std::string(e.what()) == "cannot start a missing program: No such file or directory");
    }
    // The failed child was reaped: this process has no child left (the unit tests start none
    // beside this case).
    CHECK(::waitpid(-1, nullptr, WNOHANG) == -1);
    CHECK(errno == ECHILD);

    SpawnRequest empty;
    CHECK_THROWS_AS(spawn_process(empty, "nothing"), rpc_error);
}
