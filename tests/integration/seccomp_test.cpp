// The syscall filter (src/provider/seccomp_filter.hpp) against the real kernel. Each check runs
// in a child forked from this single-threaded test process: the child applies the filter, makes
// its calls and reports what did not hold through a pipe (nothing: all held), so that the test
// process itself stays unfiltered. Calls are chosen to succeed, or to fail otherwise than the
// filter does, when run unfiltered as root, so that an EPERM here is the filter's.

#include "provider/seccomp_filter.hpp"
#include "provider/seccomp_rules.hpp"

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <linux/keyctl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <seccomp.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

namespace rules = sandboxd::detail::seccomp_rules;
using sandboxd::detail::apply_seccomp_filter;
using sandboxd::detail::build_seccomp_filter;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds child_timeout{20000};

const std::string& filter_program() {
    static const std::string program = build_seccomp_filter();
    return program;
}

/// What a check in the child found wrong, one line per failure.
using report = std::string;

/// Records a failure unless `rc` is -1 with errno `expected`. errno is read first thing, so
/// pass the call itself as `rc`.
void expect_denied(report& out, const std::string& call, long rc, int expected) {
    int err = errno;
    if (rc == -1 && err == expected) return;
    out += call + ": expected errno " + std::to_string(expected) + ", got " + std::to_string(rc) +
           (rc == -1 ? " errno " + std::to_string(err) + " (" + std::strerror(err) + ")" : "") +
           "\n";
}

/// Records a failure unless `rc` is a success (>= 0).
void expect_allowed(report& out, const std::string& call, long rc) {
    int err = errno;
    if (rc >= 0) return;
    out += call + ": expected success, got errno " + std::to_string(err) + " (" +
           std::strerror(err) + ")\n";
}

void write_all(int fd, const std::string& data) {
    std::size_t done = 0;
    while (done < data.size()) {
        ssize_t n = ::write(fd, data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        done += static_cast<std::size_t>(n);
    }
}

/// Forks; the child runs `prepare` unfiltered, applies the filter, runs `check` and exits.
/// Returns the child's report, plus a line if it did not exit normally or timed out.
report run_filtered(const std::function<void(report&)>& check,
                    const std::function<void()>& prepare = {}) {
    const std::string& program = filter_program();
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        ::close(fds[0]);
        report out;
        if (prepare) prepare();
        if (int err = apply_seccomp_filter(program.data(), program.size()); err != 0) {
            out = std::string("apply_seccomp_filter: ") + std::strerror(err) + "\n";
        } else {
            check(out);
        }
        write_all(fds[1], out);
        ::_exit(0);  // no atexit handlers, no sanitizer leak check, no Catch2 teardown
    }
    ::close(fds[1]);
    report out;
    bool timed_out = false;
    auto deadline = Clock::now() + child_timeout;
    for (;;) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{fds[0], POLLIN, 0};
        int r = left.count() > 0 ? ::poll(&p, 1, static_cast<int>(left.count())) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            timed_out = true;
            ::kill(pid, SIGKILL);  // our own child only
            break;
        }
        char buf[4096];
        ssize_t n = ::read(fds[0], buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        out.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fds[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    if (timed_out) out += "child timed out\n";
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        out += "child ended abnormally, wait status " + std::to_string(status) + "\n";
    return out;
}

/// For clone-like calls only: ends the new child if the filter let the call through (so that it
/// cannot go on as a second copy of the check), and reaps it.
long reap_if_created(long rc) {
    if (rc == 0) ::_exit(0);
    if (rc > 0) ::waitpid(static_cast<pid_t>(rc), nullptr, 0);
    return rc;
}

bool absent_here(std::string_view name) {
    return std::ranges::find(rules::absent_here, name) != std::ranges::end(rules::absent_here);
}

bool named_by_a_rule(std::string_view name) {
    return std::ranges::any_of(rules::plain_rules, [&](auto& r) { return r.name == name; }) ||
           std::ranges::any_of(rules::arg_rules, [&](auto& r) { return r.name == name; });
}

}  // namespace

TEST_CASE("The filter is a whole BPF program within the kernel's size limit", "[seccomp]") {
    const std::string& program = filter_program();
    INFO("program size " << program.size());
    CHECK(!program.empty());
    CHECK(program.size() % sizeof(sock_filter) == 0);
    CHECK(program.size() < std::size_t{64} * 1024);
    CHECK(program.size() / sizeof(sock_filter) <= BPF_MAXINSNS);
    CHECK(build_seccomp_filter() == program);
}

TEST_CASE("Every rule names a syscall of this architecture or one listed as absent here",
          "[seccomp]") {
    std::vector<std::string_view> names;
    for (const auto& r : rules::plain_rules) names.push_back(r.name);
    for (const auto& r : rules::arg_rules) names.push_back(r.name);
    for (std::string_view name : names) {
        INFO("rule " << name);
        int nr = seccomp_syscall_resolve_name(std::string(name).c_str());
        CHECK((nr >= 0 || absent_here(name)));
    }
    // The list hides nothing: each name on it is a syscall libseccomp knows (not a typo), that
    // this architecture lacks, and that a rule names.
    for (std::string_view name : rules::absent_here) {
        INFO("absent_here " << name);
        std::string n(name);
        int nr = seccomp_syscall_resolve_name(n.c_str());
        CHECK(nr < 0);
        CHECK(nr != __NR_SCMP_ERROR);
        CHECK(named_by_a_rule(name));
    }
#if defined(__x86_64__)
    // stime exists on i386 only: its rule is skipped here, and the filter still builds.
    CHECK(seccomp_syscall_resolve_name("stime") < 0);
    CHECK(absent_here("stime"));
    CHECK(named_by_a_rule("stime"));
    CHECK_NOTHROW(build_seccomp_filter());
#endif
}

TEST_CASE("Every plain rule answers its errno whatever the arguments", "[seccomp]") {
    struct call {
        std::string name;
        int nr;
        int expected;
    };
    std::vector<call> calls;
    for (const auto& r : rules::plain_rules) {
        int nr = seccomp_syscall_resolve_name(std::string(r.name).c_str());
        if (nr < 0) continue;  // absent here (checked above)
        calls.push_back({std::string(r.name), nr, r.act == rules::action::enosys ? ENOSYS : EPERM});
    }
    REQUIRE(calls.size() > 50);
    // Every argument -1: a bad pointer, flag set, descriptor or size, so that a call the filter
    // missed fails with EFAULT, EINVAL or EBADF instead of acting on the host (as root,
    // kexec_load with no segment would unload the loaded kernel, acct(NULL) stop accounting).
    report out = run_filtered([&](report& r) {
        for (const auto& c : calls) {
            expect_denied(r, c.name, ::syscall(c.nr, -1L, -1L, -1L, -1L, -1L, -1L), c.expected);
        }
    });
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("Kernel keyrings, bpf, userfaultfd, perf and io_uring are refused with EPERM",
          "[seccomp]") {
    report out = run_filtered([](report& r) {
        expect_denied(r, "keyctl(GET_KEYRING_ID)",
                      ::syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 1),
                      EPERM);
        expect_denied(r, "add_key",
                      ::syscall(SYS_add_key, "user", "sandboxd-seccomp-test", "x", 1,
                                KEY_SPEC_PROCESS_KEYRING),
                      EPERM);
        expect_denied(r, "request_key",
                      ::syscall(SYS_request_key, "user", "sandboxd-seccomp-test", nullptr, 0),
                      EPERM);
        unsigned char bpf_attr[128] = {};
        expect_denied(r, "bpf(BPF_PROG_LOAD)", ::syscall(SYS_bpf, 5, bpf_attr, sizeof bpf_attr),
                      EPERM);
        expect_denied(r, "userfaultfd", ::syscall(SYS_userfaultfd, O_CLOEXEC), EPERM);
        unsigned char perf_attr[128] = {};
        expect_denied(r, "perf_event_open", ::syscall(SYS_perf_event_open, perf_attr, 0, -1, -1, 0),
                      EPERM);
        unsigned char uring_params[120] = {};
        expect_denied(r, "io_uring_setup", ::syscall(SYS_io_uring_setup, 4, uring_params), EPERM);
    });
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("No namespace can be made or joined, while unshare of other state works", "[seccomp]") {
    struct probe {
        const char* what;
        std::function<long()> call;
    };
    // x86_64 clone(flags, stack, parent_tid, child_tid, tls): the flags come first.
    const probe denied[] = {
        {"unshare(CLONE_NEWUSER)", [] { return long{::unshare(CLONE_NEWUSER)}; }},
        {"unshare(CLONE_NEWUSER|CLONE_FILES)",
         [] { return long{::unshare(CLONE_NEWUSER | CLONE_FILES)}; }},
        {"unshare(CLONE_NEWNS)", [] { return long{::unshare(CLONE_NEWNS)}; }},
        {"unshare(CLONE_NEWNET)", [] { return long{::unshare(CLONE_NEWNET)}; }},
        {"unshare(CLONE_NEWTIME)", [] { return long{::unshare(CLONE_NEWTIME)}; }},
        {"clone(CLONE_NEWUSER)",
         [] { return reap_if_created(::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)); }},
        {"clone(CLONE_NEWPID)",
         [] { return reap_if_created(::syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0)); }},
        {"setns(own uts namespace)",
         [] {
             int ns = ::open("/proc/self/ns/uts", O_RDONLY | O_CLOEXEC);
             long rc = ::setns(ns, CLONE_NEWUTS);
             int err = errno;
             ::close(ns);
             errno = err;
             return rc;
         }},
    };
    // One child per call: a call the filter let through would change what the next one sees
    // (a new user namespace leaves the caller unmapped, and the kernel itself refuses the next).
    for (const auto& p : denied) {
        report out = run_filtered([&](report& r) { expect_denied(r, p.what, p.call(), EPERM); });
        INFO(out);
        CHECK(out.empty());
    }
    report out = run_filtered([](report& r) {
        expect_allowed(r, "unshare(CLONE_FILES)", ::unshare(CLONE_FILES));
        expect_allowed(r, "unshare(CLONE_FS|CLONE_SYSVSEM)", ::unshare(CLONE_FS | CLONE_SYSVSEM));
    });
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("clone3 answers ENOSYS and threads, fork and posix_spawn still work", "[seccomp]") {
    report out = run_filtered([](report& r) {
        std::uint64_t args[11] = {};  // struct clone_args, version 2 (88 bytes)
        args[4] = SIGCHLD;            // exit_signal
        expect_denied(r, "clone3", reap_if_created(::syscall(SYS_clone3, args, sizeof args)),
                      ENOSYS);

        // glibc 2.34+ tries clone3 first for threads and posix_spawn, and falls back to clone
        // on ENOSYS only.
        pthread_t thread{};
        static int value = 0;
        int rc = ::pthread_create(
            &thread, nullptr, [](void*) -> void* { return &value; }, nullptr);
        if (rc != 0) {
            r += std::string("pthread_create: ") + std::strerror(rc) + "\n";
        } else {
            void* result = nullptr;
            ::pthread_join(thread, &result);
            if (result != &value) r += "pthread_join: wrong result\n";
        }

        pid_t child = 0;
        char true_path[] = "/bin/true";
        char* argv[] = {true_path, nullptr};
        rc = ::posix_spawn(&child, true_path, nullptr, nullptr, argv, environ);
        if (rc != 0) {
            r += std::string("posix_spawn(/bin/true): ") + std::strerror(rc) + "\n";
        } else {
            int status = 0;
            ::waitpid(child, &status, 0);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                r += "/bin/true: wait status " + std::to_string(status) + "\n";
        }

        child = ::fork();
        if (child == 0) ::_exit(7);
        if (child < 0) {
            r += std::string("fork: ") + std::strerror(errno) + "\n";
        } else {
            int status = 0;
            ::waitpid(child, &status, 0);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 7)
                r += "fork child: wait status " + std::to_string(status) + "\n";
        }
    });
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("Mounting by either API is refused", "[seccomp]") {
    char dir_template[] = "/tmp/sandboxd-seccomp-XXXXXX";
    REQUIRE(::mkdtemp(dir_template) != nullptr);
    std::string dir = dir_template;
    // A private mount namespace first, so that a rule the filter missed mounts nothing that
    // the host sees.
    auto prepare = [] {
        if (::unshare(CLONE_NEWNS) != 0 ||
            ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
            ::_exit(3);
    };
    report out = run_filtered(
        [&](report& r) {
            expect_denied(r, "mount(tmpfs)", ::mount("none", dir.c_str(), "tmpfs", 0, ""), EPERM);
            expect_denied(r, "fsopen(tmpfs)", ::syscall(SYS_fsopen, "tmpfs", FSOPEN_CLOEXEC),
                          EPERM);
            expect_denied(r, "open_tree(/)",
                          ::syscall(SYS_open_tree, AT_FDCWD, "/", OPEN_TREE_CLONE), EPERM);
            expect_denied(r, "umount2(/proc)", ::umount2("/proc", MNT_DETACH), EPERM);
            expect_denied(r, "chroot", ::chroot(dir.c_str()), EPERM);
        },
        prepare);
    ::rmdir(dir.c_str());
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("Faking terminal input is refused and other terminal ioctls work", "[seccomp]") {
    int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    REQUIRE(master >= 0);
    REQUIRE(::grantpt(master) == 0);
    REQUIRE(::unlockpt(master) == 0);
    int slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY | O_CLOEXEC);
    REQUIRE(slave >= 0);
    char c = 'x';
    // Unfiltered, root may push input into any terminal: the EPERM below is the filter's.
    if (::geteuid() == 0) CHECK(::ioctl(slave, TIOCSTI, &c) == 0);

    report out = run_filtered([&](report& r) {
        expect_denied(r, "ioctl(TIOCSTI)", ::ioctl(slave, TIOCSTI, &c), EPERM);
        // The kernel reads the request as 32 bits; so must the filter.
        expect_denied(r, "ioctl(TIOCSTI | 1 << 32)",
                      ::syscall(SYS_ioctl, slave, TIOCSTI | (1UL << 32), &c), EPERM);
        char subcode = 6;  // TIOCL_GETSHIFTSTATE
        expect_denied(r, "ioctl(TIOCLINUX)", ::ioctl(slave, TIOCLINUX, &subcode), EPERM);
        winsize ws{};
        expect_allowed(r, "ioctl(TIOCGWINSZ)", ::ioctl(slave, TIOCGWINSZ, &ws));
        termios tio{};
        expect_allowed(r, "tcgetattr", ::tcgetattr(slave, &tio));
    });
    ::close(slave);
    ::close(master);
    INFO(out);
    CHECK(out.empty());
}

TEST_CASE("Only the personalities Docker allows can be set, and the query works", "[seccomp]") {
    report out = run_filtered([](report& r) {
        // Docker's list, spelled out: PER_LINUX, PER_LINUX32, UNAME26, both, the query.
        auto allowed = [](std::uint64_t v) {
            return v == 0 || v == 0x8 || v == 0x20000 || v == 0x20008 || v == 0xffffffff;
        };
        auto try_one = [&](std::uint64_t v) {
            long rc = ::syscall(SYS_personality, v);
            int err = errno;
            if (rc >= 0 && v != 0xffffffff) ::personality(PER_LINUX);  // undo a wrong success
            bool ok = allowed(v) ? rc >= 0 : rc == -1 && err == EPERM;
            if (!ok) {
                char buf[96];
                std::snprintf(buf, sizeof buf, "personality(%#llx): %ld errno %d\n",
                              static_cast<unsigned long long>(v), rc, err);
                r += buf;
            }
        };
        expect_denied(r, "personality(READ_IMPLIES_EXEC)", ::personality(READ_IMPLIES_EXEC), EPERM);
        expect_allowed(r, "personality(0xffffffff)", ::personality(0xffffffff));
        for (std::uint64_t v : {0x0ULL, 0x8ULL, 0x20000ULL, 0x20008ULL, 0xffffffffULL}) try_one(v);
        for (unsigned b = 0; b < 32; ++b) {
            try_one(std::uint64_t{1} << b);
            try_one(0xffffffff & ~(std::uint64_t{1} << b));
            try_one(0x20008 | std::uint64_t{1} << b);
        }
        try_one(std::uint64_t{1} << 32);
        try_one(~std::uint64_t{0});
        std::uint64_t x = 0x9e3779b97f4a7c15ULL;  // xorshift64: a fixed sample of 32-bit values
        for (int i = 0; i < 20000; ++i) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            try_one(x & 0xffffffff);
        }
    });
    INFO(out);
    CHECK(out.empty());
}

#if defined(__x86_64__)
namespace {
/// i386 getpid (20) through the compat entry; the kernel clears r8-r11 on the way back.
long int80_getpid() {
    long rc = 20;
    asm volatile("int $0x80" : "+a"(rc) : : "r8", "r9", "r10", "r11", "memory", "cc");
    return rc;
}

/// Whether this kernel runs i386 system calls at all: a kernel built without IA32 emulation,
/// or booted with it off, answers `int 0x80` with SIGSEGV. Tried in a child, unfiltered.
bool kernel_has_ia32_entry() {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        ::signal(SIGSEGV, SIG_DFL);  // a plain death, not a report
        ::_exit(int80_getpid() == ::getpid() ? 0 : 1);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
}  // namespace
#endif

TEST_CASE("Syscalls of another architecture are refused with EPERM", "[seccomp]") {
#if defined(__x86_64__)
    const bool ia32 = kernel_has_ia32_entry();
    if (!ia32)
        WARN(
            "this kernel has no i386 system call entry (int 0x80 faults): nothing to filter there");
    report out = run_filtered([ia32](report& r) {
        if (ia32) {
            const long rc = int80_getpid();
            if (static_cast<int>(rc) != -EPERM)
                r += "int 0x80 getpid: " + std::to_string(rc) + ", expected -EPERM\n";
        }
        // x32 getpid: the x86_64 audit architecture, but numbers with bit 30 set.
        expect_denied(r, "x32 getpid", ::syscall(__X32_SYSCALL_BIT | SYS_getpid), EPERM);
        expect_allowed(r, "getpid", ::syscall(SYS_getpid));
    });
    INFO(out);
    CHECK(out.empty());
#else
    SUCCEED("no compat syscall ABI checked on this architecture");
#endif
}

TEST_CASE("vsock sockets are refused while other sockets open", "[seccomp]") {
    report out = run_filtered([](report& r) {
        expect_denied(r, "socket(AF_VSOCK)", ::socket(AF_VSOCK, SOCK_STREAM, 0), EPERM);
        int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        expect_allowed(r, "socket(AF_UNIX)", fd);
        ::close(fd);
    });
    INFO(out);
    CHECK(out.empty());
}
