/// @file init_main.cpp
/// sandboxd-init: the supervisor of a lease's sandbox and the init of each of its channels.
///
/// Usage: sandboxd-init --lease [--cgroup-fds N] [--adopt-timeout-ms MS]   (run by bubblewrap
/// as PID 1 of the lease's PID namespace; supervisor_protocol.hpp says what adoption is)
///
/// As the **supervisor** it first joins the lease's cgroup through the N join files at fds 8..
/// (supervisor_protocol.hpp, cgroup_fd) and makes a cgroup namespace rooted there, reads the
/// seccomp program from fd 4, empties the capability bounding set and resets every signal
/// disposition (once for every channel: each is its clone), then serves channel requests on
/// the SOCK_SEQPACKET socket at fd 3 until the daemon closes it; it reaps every process
/// reparented to it. Each request goes to a **channel init**, PID 1 of a new PID and mount
/// namespace (so channels of one lease cannot see or signal each other), and the answer
/// carries a pidfd of it. The supervisor makes that init ahead: once the init it last handed a
/// request has started its command, it clones the next one (the warm init, `make_warm`), which
/// mounts its /proc, applies the syscall filter to itself, takes ahead the page faults its
/// request would take (`prefault`) and waits for exactly one request; a request that finds
/// none clones its init itself.
///
/// The **channel init** has the channel's own /proc mounted, joins the channel's cgroup through the
/// join files (v1 `tasks`, v2 cgroup.procs) that the daemon opened, takes the channel's fds
/// (0-2 for the command, 3 for the status line, 4 for control bytes), makes itself
/// non-dumpable (the command, same uid without capabilities, cannot open its descriptors or
/// trace it), changes to the working directory and starts the command in its own process
/// group: capabilities dropped from every set, RLIMIT_NOFILE and RLIMIT_CORE set,
/// no_new_privs and the seccomp filter applied, then exec. It forwards the signals it
/// receives to that group, obeys the daemon's control bytes on fd 4, reaps every process
/// reparented to it and reports the end of the command's main process on fd 3 ("exit N\n" or
/// "signal N\n"; see include/sandboxd/provider/provider.hpp).
///
/// With a drain grace, once the command's main process has ended the channel init waits until
/// no other process is left or the grace has passed, kills what remains (kill(-1, SIGKILL)),
/// reaps it and exits; as PID 1 of the channel's namespace its exit kills anything left, and
/// every copy of the channel's pipes closes, so the daemon reads output to EOF. Once nothing
/// else is left it closes its own copies of fds 0-2 and writes "end" on fd 3 before it exits,
/// so that the daemon need not wait for the exit itself (provider.hpp). It exits early
/// only when fd 3's reader is gone or fd 4 reaches EOF after the command ended.
///
/// Built static and self-contained: libc and libstdc++ only.

#include "init/channel_init.hpp"
#include "init/supervisor_protocol.hpp"
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

// The program's text, from the linker (a static executable: one mapping).
extern "C" char __executable_start[];
extern "C" char etext[];

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; <sys/mman.h> of older C libraries lacks it
#endif

namespace {

namespace proto = sandboxd::supervisor;
using namespace sandboxd::init;  // NOLINT(google-build-using-namespace): its own helpers

// --- The supervisor. ---

/// What adoption needs (supervisor_protocol.hpp): the listening socket, the secret, and how
/// long to wait for a daemon once the one it served let go.
struct Adoption {
    int listen = -1;  ///< -1: no adoption; the supervisor exits when its daemon lets go
    unsigned char secret[proto::secret_size] = {};
    long timeout_ms = 0;
};

class Supervisor {
public:
    explicit Supervisor(const Adoption& adoption) : adoption_(adoption) {}

    int run() {
        if (!read_program()) return 1;
        ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        if (!empty_bounding_set()) {
            print_error("cannot empty the capability bounding set", "", errno);
            return 1;
        }
        reset_signal_dispositions();
        ignore_sigpipe();
        sigset_t mask;
        ::sigemptyset(&mask);
        ::sigaddset(&mask, SIGCHLD);
        struct sigaction handler {};
        handler.sa_handler = ignore_signal;
        ::sigaction(SIGCHLD, &handler, nullptr);
        ::sigprocmask(SIG_BLOCK, &mask, nullptr);
        signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
        if (signal_fd_ < 0) {
            print_error("signalfd", "", errno);
            return 1;
        }
        ::fcntl(socket_, F_SETFD, FD_CLOEXEC);
        // Hello (id 0): the sandbox is up and serving. It carries a pidfd of this process
        // (PID 1 here), by which the daemon ends the sandbox without reading /proc (which a
        // unit's ProtectProc=invisible hides from it: this process runs as the lease's uid).
        const int self = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
        if (self < 0) {
            print_error("pidfd_open", "", errno);
            return 1;
        }
        send_reply(socket_, proto::Reply{}, self);
        ::close(self);
        // Not zero-filled: pages are touched only as large requests need them.
        buffer_.reset(new char[buffer_size]);
        make_warm();  // with touch_for_next_request(), which gives request_ its storage
        for (;;) {
            // A negative fd is skipped by poll(): no daemon, no channel starting, or no
            // adoption.
            pollfd fds[4] = {{socket_, POLLIN, 0},
                             {signal_fd_, POLLIN, 0},
                             {starting_socket_, POLLIN, 0},
                             {adoption_.listen, POLLIN, 0}};
            int timeout = -1;
            if (socket_ < 0) {  // waiting for a daemon: until the adoption deadline
                const long left = orphaned_until_ms_ - now_ms();
                if (left <= 0) return 0;  // nobody came: the sandbox ends with this process
                timeout = static_cast<int>(std::min<long>(left, 60'000));
            }
            if (::poll(fds, 4, timeout) < 0) {
                if (errno == EINTR) continue;
                return 1;
            }
            if (fds[1].revents != 0) reap();
            if (fds[2].revents != 0) started();
            if (fds[3].revents != 0 && !adopt_one()) return 0;  // asked to end
            // (not when adopt_one() just replaced the socket polled)
            if (fds[0].fd == socket_ && socket_ >= 0 && fds[0].revents != 0 && !serve_one() &&
                !let_go()) {
                return 0;  // the daemon let go, and no other may come
            }
        }
    }

private:
    static long now_ms() {
        timespec ts{};
        ::clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000L + ts.tv_nsec / 1'000'000L;
    }

    // The daemon's end of the socket closed (it stopped, or died): false when this supervisor
    // is not adoptable (it exits, as before). Else it waits for the next daemon, up to the
    // adoption timeout. The channels whose pipes that daemon held end by themselves.
    bool let_go() {
        if (adoption_.listen < 0) return false;
        ::close(socket_);
        socket_ = -1;
        orphaned_until_ms_ = now_ms() + adoption_.timeout_ms;
        return true;
    }

    // Same length, compared in a time that does not depend on where they differ.
    bool right_secret(const unsigned char* given) const {
        unsigned char diff = 0;
        for (std::size_t i = 0; i < proto::secret_size; ++i) {
            diff |= static_cast<unsigned char>(given[i] ^ adoption_.secret[i]);
        }
        return diff == 0;
    }

    // One connection to the adoption socket (supervisor_protocol.hpp, "Adoption"): false when
    // an authenticated daemon asked this sandbox to end.
    bool adopt_one() {
        const int conn = ::accept4(adoption_.listen, nullptr, nullptr, SOCK_CLOEXEC);
        if (conn < 0) return true;
        // Only the daemon can reach the socket; still, a connection that says nothing must
        // not hold this supervisor for long.
        const timeval tv{2, 0};
        ::setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ::setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        proto::Adopt adopt{};
        ssize_t n = 0;
        do {
            n = ::recv(conn, &adopt, sizeof adopt, 0);
        } while (n < 0 && errno == EINTR);
        if (n != static_cast<ssize_t>(sizeof adopt) || adopt.magic != proto::adopt_magic ||
            !right_secret(adopt.secret)) {
            ::close(conn);  // no answer for a stranger
            return true;
        }
        proto::Welcome welcome;
        welcome.version = proto::version;
        const bool end = (adopt.flags & proto::adopt_end) != 0;
        if (!end && (adopt.min_version > proto::version || adopt.max_version < proto::version)) {
            welcome.error = EPROTONOSUPPORT;
            send_packet(conn, &welcome, sizeof welcome, -1);
            ::close(conn);
            return true;
        }
        const int self = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
        if (self < 0) {
            ::close(conn);
            return true;
        }
        // A daemon that adopts reads the workspace's disk through it (supervisor_protocol.hpp).
        // A mount point: nothing in the sandbox can rename or replace it.
        const int workspace =
            end ? -1 : ::open("/workspace", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        const int ends[2] = {self, workspace};
        send_fds(conn, &welcome, sizeof welcome, ends, workspace < 0 ? 1 : 2);
        ::close(self);
        if (workspace >= 0) ::close(workspace);
        if (end) {
            ::close(conn);
            return false;
        }
        const timeval none{0, 0};
        ::setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
        ::setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
        if (socket_ >= 0) ::close(socket_);  // a daemon that takes over from another
        socket_ = conn;
        orphaned_until_ms_ = 0;
        return true;
    }

    // What a clone (a channel's init) must not keep: the daemon's socket, the adoption
    // socket and the kept channels' ends (another channel's pipes).
    void close_in_child() const {
        if (socket_ >= 0) ::close(socket_);
        if (adoption_.listen >= 0) ::close(adoption_.listen);
        for (const auto& h : held_) {
            for (int fd : h.fds) {
                if (fd >= 0) ::close(fd);
            }
        }
    }

    // --- Kept channels (supervisor_protocol.hpp): the daemon's ends, held for the next one.

    struct HeldEntry {
        char key[proto::key_size] = {};
        int fds[proto::held_slots] = {-1, -1, -1, -1, -1, -1, -1, -1};
    };

    HeldEntry* find_held(const char* key) {
        for (auto& h : held_) {
            if (std::memcmp(h.key, key, proto::key_size) == 0) return &h;
        }
        return nullptr;
    }

    // A packet of `n` bytes that is a Held (any of its three magics): served here; false when
    // it is none (a channel request).
    bool serve_held(std::size_t n, std::vector<int>& fds) {
        std::uint32_t magic = 0;
        if (n < sizeof magic) return false;
        std::memcpy(&magic, buffer_.get(), sizeof magic);
        if (magic != proto::hold_magic && magic != proto::release_magic &&
            magic != proto::return_magic) {
            return false;
        }
        proto::Held packet;
        if (n != sizeof packet) return true;  // malformed: its descriptors close below
        std::memcpy(&packet, buffer_.get(), sizeof packet);
        packet.key[proto::key_size - 1] = '\0';
        if (magic == proto::hold_magic) {
            keep_held(packet, fds);
        } else if (magic == proto::release_magic) {
            release_held(packet);
        } else {
            return_held();
        }
        return true;
    }

    // Keeps the packet's descriptors (taken out of `fds`, which the caller closes) under its
    // key; a key held already, a count that does not match the mask or a full table keeps none.
    void keep_held(const proto::Held& packet, std::vector<int>& fds) {
        const auto bits = static_cast<std::size_t>(__builtin_popcount(packet.mask));
        if (packet.key[0] == '\0' || bits != fds.size() ||
            packet.mask >= (1U << proto::held_slots) || held_.size() >= proto::max_held ||
            find_held(packet.key) != nullptr) {
            return;
        }
        HeldEntry entry;
        std::memcpy(entry.key, packet.key, proto::key_size);
        std::size_t next = 0;
        for (std::uint32_t slot = 0; slot < proto::held_slots; ++slot) {
            if ((packet.mask & (1U << slot)) != 0) entry.fds[slot] = fds[next++];
        }
        held_.push_back(entry);
        fds.clear();
    }

    void release_held(const proto::Held& packet) {
        HeldEntry* h = find_held(packet.key);
        if (h == nullptr) return;
        bool left = false;
        for (std::uint32_t slot = 0; slot < proto::held_slots; ++slot) {
            int& fd = h->fds[slot];
            if ((packet.mask & (1U << slot)) != 0 && fd >= 0) {
                ::close(fd);
                fd = -1;
            }
            left = left || fd >= 0;
        }
        if (!left) held_.erase(held_.begin() + (h - held_.data()));
    }

    // Every entry to the daemon that asked (copies: this process keeps its own), then the end.
    void return_held() {
        for (const auto& h : held_) {
            proto::Held packet;
            std::memcpy(packet.key, h.key, proto::key_size);
            int fds[proto::held_slots];
            std::size_t count = 0;
            for (std::uint32_t slot = 0; slot < proto::held_slots; ++slot) {
                if (h.fds[slot] < 0) continue;
                packet.mask |= 1U << slot;
                fds[count++] = h.fds[slot];
            }
            send_fds(socket_, &packet, sizeof packet, fds, count);
        }
        const proto::Held end;
        send_fds(socket_, &end, sizeof end, nullptr, 0);
    }

    bool read_program() {
        struct stat st {};
        if (::fstat(proto::program_fd, &st) < 0) return true;  // no filter given
        if (st.st_size < 0 || static_cast<std::size_t>(st.st_size) > proto::max_program) {
            print_error("the syscall filter is too large", "", E2BIG);
            return false;
        }
        program_.resize(static_cast<std::size_t>(st.st_size));
        std::size_t done = 0;
        while (done < program_.size()) {
            ssize_t n = ::pread(proto::program_fd, program_.data() + done, program_.size() - done,
                                static_cast<off_t>(done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                print_error("cannot read the syscall filter", "", n < 0 ? errno : EIO);
                return false;
            }
            done += static_cast<std::size_t>(n);
        }
        ::close(proto::program_fd);
        return true;
    }

    void reap() {
        signalfd_siginfo info[16];
        while (::read(signal_fd_, info, sizeof info) > 0) {
        }
        for (;;) {
            pid_t pid = ::waitpid(-1, nullptr, WNOHANG);
            if (pid < 0 && errno == EINTR) continue;
            if (pid <= 0) return;
        }
    }

    // One packet from `socket` into buffer_, its descriptors into req.fds: its size, 0 at
    // EOF, -1 on failure (errno).
    ssize_t receive(int socket, ChannelRequest& req, int& msg_flags) {
        return receive_fds(socket, buffer_.get(), buffer_size, req.fds, msg_flags, 0);
    }

    // One packet of at most `size` bytes into `data`, its descriptors appended to `fds` (at
    // most proto::max_fds), close-on-exec: its size, 0 at EOF, or -1 with errno.
    static ssize_t receive_fds(int socket, void* data, std::size_t size, std::vector<int>& fds,
                               int& msg_flags, int flags) {
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::max_fds)];
        iovec iov{data, size};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        const ssize_t n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | flags);
        if (n <= 0) return n;
        msg_flags = msg.msg_flags;
        for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (std::size_t i = 0; i < count; ++i) {
                int fd = -1;
                std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                fds.push_back(fd);
            }
        }
        return n;
    }

    // Receives and serves one request; false once the daemon's end is closed.
    bool serve_one() {
        // The request's vectors keep their storage from one request to the next (no malloc
        // on an open's path; touch_for_next_request()).
        ChannelRequest& req = request_;
        req.header = {};
        req.fds.clear();
        req.cwd = nullptr;
        req.argv.clear();
        req.envp.clear();
        int msg_flags = 0;
        const ssize_t n = receive(socket_, req, msg_flags);
        if (n < 0) return errno == EINTR || errno == EAGAIN;
        if (n == 0) return false;

        if (serve_held(static_cast<std::size_t>(n), req.fds)) {
            for (int fd : req.fds) ::close(fd);
            return true;
        }
        proto::Reply reply;
        int err = parse(static_cast<std::size_t>(n), msg_flags, req);
        reply.id = req.header.id;
        int ends[2] = {-1, -1};  // the init's pidfd; with flag_pty_lease, the terminal's master
        if (err == 0 && past_deadline(req.header)) err = ETIMEDOUT;
        if (err == 0 && !hand_over(req, static_cast<std::size_t>(n), ends[0])) {
            err = start_channel(req, ends[0], ends[1]);
        }
        for (int fd : req.fds) ::close(fd);
        reply.error = err;
        send_fds(socket_, &reply, sizeof reply, ends, ends[0] < 0 ? 0 : ends[1] < 0 ? 1 : 2);
        for (int fd : ends) {
            if (fd >= 0) ::close(fd);
        }
        if (warm_socket_ < 0 && starting_socket_ < 0) make_warm();
        return true;
    }

    // The channel init that took the last warm one's place has started its command (or
    // failed, or is gone): its end of the socket pair is closed. The next warm init is made
    // now rather than right after the reply, where its clone (page tables copied, the mount
    // namespace copied) took the CPU from the channel that was starting (issue 19: on two
    // cores the init waited ~0.4 ms for it).
    void started() {
        ::close(starting_socket_);
        starting_socket_ = -1;
        if (warm_socket_ < 0) make_warm();
    }

    // --- The warm channel init: the next channel's init, made before its request. ---
    //
    // Cloning a channel's init (page tables copied, then copy-on-write faults on both sides)
    // and setting up its namespaces is most of what an open costs the kernel (issue 19,
    // docs/BENCHMARKS.md): done here once the last channel has started its command (started()),
    // it runs while that command and the daemon do their part, not in the next open. The warm init
    // is PID 1 of a new PID namespace, in a new mount namespace with its /proc mounted, in the
    // lease's cgroup; it waits on a socket pair of its own for exactly one request, which the
    // supervisor passes on as it came (same packet, same descriptors) once it has checked it, and
    // from then on it is that channel's init, as a cloned one would be. One at most; none when the
    // clone fails (at the lease's pids limit, say) or the request's payload came in a memfd: that
    // request's init is cloned for it, as before.

    /// The warm init's name (comm) until it takes a request; a channel's init is "init".
    static constexpr const char* warm_name = "warm-init";

    void make_warm() {
        int sv[2];
        if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) return;
        int pidfd = -1;
        // Named apart while it waits (ps, /proc/PID/comm): it is no channel's yet. Set around
        // the clone, so that the child has the name from its first instant.
        ::prctl(PR_SET_NAME, warm_name, 0, 0, 0);
        const long pid = ::syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | CLONE_PIDFD | SIGCHLD,
                                   nullptr, &pidfd, nullptr, 0L);
        if (pid != 0) ::prctl(PR_SET_NAME, "init", 0, 0, 0);
        if (pid < 0) {
            ::close(sv[0]);
            ::close(sv[1]);
            return;
        }
        if (pid == 0) {
            ::close(signal_fd_);
            close_in_child();
            ::close(sv[0]);
            run_warm_init(sv[1]);
        }
        ::close(sv[1]);
        ::fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        warm_socket_ = sv[0];
        warm_pidfd_ = pidfd;
        touch_for_next_request();
    }

    [[noreturn]] void run_warm_init(int socket) {
        const int mounted = mount_channel_proc();
        PreparedInit prepared = prepare_channel_init();
        // The command's syscall filter, on this init already: its cost (the kernel runs the
        // program once per syscall number to fill its cache) is then paid ahead too. Nothing
        // the init does after this is denied by it (no mount, no namespace, no TIOCSTI); if
        // applying fails, the command applies it and reports the failure as before.
        const bool filtered = program_.empty() || sandboxd::detail::apply_seccomp_filter(
                                                      program_.data(), program_.size()) == 0;
        ChannelRequest req;
        prefault(req, prepared);
        int msg_flags = 0;
        ssize_t n = 0;
        do {
            n = receive(socket, req, msg_flags);
        } while (n < 0 && errno == EINTR);
        if (n <= 0) ::_exit(0);  // the supervisor let go of this init
        ::prctl(PR_SET_NAME, "init", 0, 0, 0);
        // Checked by the supervisor already: this cannot fail but for a bug.
        if (parse(static_cast<std::size_t>(n), msg_flags, req) != 0) ::_exit(125);
        if (mounted != 0) {
            print_error("cannot mount the channel's /proc", "", mounted);
            ::_exit(125);
        }
        // The socket stays open until the command has started (Options::started_fd).
        run_channel_init(req, program_, filtered, prepared, socket);
    }

    // Takes ahead, while this warm init waits, the page faults that its request would take
    // (issue 19: one costs 20-60 us on these machines, and a dozen were on an open's path).
    // A clone shares the supervisor's pages copy-on-write and none of its page table entries
    // for the program's text: the text is mapped in here (MADV_POPULATE_READ: page table
    // entries only, no copy), and the pages the request writes are written once now: the
    // first page of the receive buffer, the request's vectors (with malloc's own state), the
    // stack, `environ` (the command's child sets it before its exec, in this memory) and the
    // top of the command's stack, made now for up to prefaulted_strings arguments.
    void prefault(ChannelRequest& req, PreparedInit& prepared) {
        const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
        // madvise() wants a page-aligned start: back to the page's beginning.
        char* text =
            __executable_start - reinterpret_cast<std::uintptr_t>(__executable_start) % page;
        ::madvise(text, static_cast<std::size_t>(etext - text), MADV_POPULATE_READ);
        *static_cast<volatile char*>(buffer_.get()) = 0;
        reserve(req);
        touch_stack();
        *static_cast<char** volatile*>(&environ) = environ;
        prepared.stack = CommandStack::make(prefaulted_strings);
        if (prepared.stack.map != nullptr) {
            char* top = prepared.stack.top();
            *static_cast<volatile char*>(top - 1) = 0;
            *static_cast<volatile char*>(top - 1 - static_cast<std::ptrdiff_t>(page)) = 0;
        }
    }

    // Gives the request's vectors their storage and writes its first element (then empties
    // them): the heap pages that a request's parse writes, and malloc's own state.
    static void reserve(ChannelRequest& req) {
        req.fds.reserve(proto::max_fds);
        req.argv.reserve(prefaulted_strings);
        req.envp.reserve(prefaulted_strings);
        req.fds.push_back(-1);
        req.argv.push_back(nullptr);
        req.envp.push_back(nullptr);
        req.fds.clear();
        req.argv.clear();
        req.envp.clear();
    }

    // The supervisor's side of prefault(), after each clone of a warm init: the pages that
    // serving the next request writes are shared with that clone, copy-on-write; they are
    // written now, not on the open's path.
    void touch_for_next_request() {
        *static_cast<volatile char*>(buffer_.get()) = 0;
        reserve(request_);
        *static_cast<volatile int*>(&errno) = 0;
        touch_stack();
    }

    // Writes the next `stack_bytes` of stack below this frame.
    [[gnu::noinline]] static void touch_stack() {
        constexpr std::size_t stack_bytes = 16 * 1024;
        char below[stack_bytes];
        for (std::size_t i = 0; i < stack_bytes; i += 512) below[i] = 0;
        asm volatile("" : : "r"(below) : "memory");  // the writes are kept
    }

    static constexpr std::size_t prefaulted_strings = 64;

    // Passes the checked request of `size` bytes in buffer_ and its descriptors to the warm
    // init; `pidfd` is then that init's. False when there is none, the payload came in a
    // memfd (it was read into buffer_, not sent on), the terminal is to be made inside the
    // lease (the warm init's filter is on: it can mount no devpts), or the warm init is gone.
    bool hand_over(const ChannelRequest& req, std::size_t size, int& pidfd) {
        if (warm_socket_ < 0 ||
            (req.header.flags & (proto::flag_payload_memfd | proto::flag_pty_lease)) != 0) {
            return false;
        }
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::max_fds)] = {};
        iovec iov{buffer_.get(), size};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * req.fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        if (c == nullptr) return false;  // cannot be: msg_controllen holds one header
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * req.fds.size());
        std::memcpy(CMSG_DATA(c), req.fds.data(), sizeof(int) * req.fds.size());
        ssize_t sent = 0;
        do {
            sent = ::sendmsg(warm_socket_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        } while (sent < 0 && errno == EINTR);
        if (sent != static_cast<ssize_t>(size)) {
            ::close(warm_socket_);
            warm_socket_ = -1;
            // Gone (killed, say); reap() reaps it.
            ::close(warm_pidfd_);
            warm_pidfd_ = -1;
            return false;
        }
        // Watched until the init has started the command (started()).
        if (starting_socket_ >= 0) ::close(starting_socket_);
        starting_socket_ = warm_socket_;
        warm_socket_ = -1;
        pidfd = warm_pidfd_;
        warm_pidfd_ = -1;
        return true;
    }

    // The daemon's fencing deadline (Request::start_deadline_ms) has passed.
    static bool past_deadline(const proto::Request& h) {
        if (h.start_deadline_ms <= 0) return false;
        timespec now{};
        ::clock_gettime(CLOCK_MONOTONIC, &now);
        const std::int64_t now_ms =
            static_cast<std::int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
        return now_ms >= h.start_deadline_ms;
    }

    // Validates the request of `size` bytes in buffer_ in place (the strings point into
    // buffer_), reading a memfd payload into it first. Returns 0 or an errno.
    int parse(std::size_t size, int msg_flags, ChannelRequest& req) {
        char* data = buffer_.get();
        if ((msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) return EMSGSIZE;
        if (size < sizeof(proto::Request)) return EPROTO;
        std::memcpy(&req.header, data, sizeof req.header);
        const auto& h = req.header;
        const bool in_memfd = (h.flags & proto::flag_payload_memfd) != 0;
        const bool lease_pty = (h.flags & proto::flag_pty_lease) != 0;
        if (h.magic != proto::request_magic || h.argc == 0 ||
            (lease_pty && (h.flags & proto::flag_pty) == 0) ||
            h.cgroup_fds > proto::max_cgroup_fds ||
            req.fds.size() != proto::channel_fds + h.cgroup_fds + (in_memfd ? 1U : 0U) ||
            static_cast<std::uint64_t>(h.argc) + h.envc > proto::max_strings) {
            return EPROTO;
        }
        if (in_memfd ? size != sizeof h || h.payload_size > proto::max_payload
                     : h.payload_size != size - sizeof h) {
            return EPROTO;
        }
        if (in_memfd) {
            const int err = read_payload(req);
            if (err != 0) return err;
        }
        return parse_strings(data + sizeof h, req);
    }

    // Reads a memfd payload (the request's last descriptor, closed here) into buffer_ after
    // the header. Returns 0 or an errno.
    int read_payload(ChannelRequest& req) {
        const int fd = req.fds.back();
        req.fds.pop_back();
        struct stat st {};
        int err = 0;
        if (::fstat(fd, &st) < 0) {
            err = errno;
        } else if (static_cast<std::uint64_t>(st.st_size) != req.header.payload_size) {
            err = EPROTO;
        }
        char* to = buffer_.get() + sizeof req.header;
        for (std::size_t done = 0; err == 0 && done < req.header.payload_size;) {
            const ssize_t n =
                ::pread(fd, to + done, req.header.payload_size - done, static_cast<off_t>(done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                err = n < 0 ? errno : EPROTO;
                break;
            }
            done += static_cast<std::size_t>(n);
        }
        ::close(fd);
        return err;
    }

    // The cwd, argv and env strings of a payload of header.payload_size bytes at `data`.
    static int parse_strings(char* data, ChannelRequest& req) {
        const auto& h = req.header;
        char* p = data;
        char* end = p + h.payload_size;
        auto next = [&p, end]() -> char* {
            char* s = p;
            auto* nul = static_cast<char*>(std::memchr(p, '\0', static_cast<std::size_t>(end - p)));
            if (nul == nullptr) return nullptr;
            p = nul + 1;
            return s;
        };
        req.cwd = next();
        if (req.cwd == nullptr) return EPROTO;
        for (std::uint32_t i = 0; i < h.argc; ++i) {
            char* s = next();
            if (s == nullptr) return EPROTO;
            req.argv.push_back(s);
        }
        req.argv.push_back(nullptr);
        for (std::uint32_t i = 0; i < h.envc; ++i) {
            char* s = next();
            if (s == nullptr) return EPROTO;
            req.envp.push_back(s);
        }
        req.envp.push_back(nullptr);
        return p == end ? 0 : EPROTO;
    }

    // Clones the request's channel init (no warm one could take it). With flag_pty_lease
    // the init makes the channel's terminal and passes its master here, into `master`, over
    // a socket pair of its own. 0 or an errno (nothing is left running then).
    int start_channel(ChannelRequest& req, int& pidfd, int& master) {
        const bool lease_pty = (req.header.flags & proto::flag_pty_lease) != 0;
        int pair[2] = {-1, -1};
        if (lease_pty && ::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) {
            return errno;
        }
        // A raw clone without a new stack returns twice, like fork; CLONE_PIDFD stores the
        // child's pidfd in the parent_tid argument. This process is single-threaded.
        long pid = ::syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | CLONE_PIDFD | SIGCHLD, nullptr,
                             &pidfd, nullptr, 0L);
        if (pid < 0) {
            const int err = errno;
            for (int fd : pair) {
                if (fd >= 0) ::close(fd);
            }
            return err;
        }
        if (pid == 0) {
            ::close(signal_fd_);
            close_in_child();
            if (const int err = mount_channel_proc(); err != 0) {
                print_error("cannot mount the channel's /proc", "", err);
                ::_exit(125);
            }
            if (lease_pty) pass_terminal(req, pair[1]);
            run_channel_init(req, program_, false, prepare_channel_init(), -1);
        }
        ::fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        if (!lease_pty) return 0;
        ::close(pair[1]);
        const int err = receive_terminal(pair[0], master);
        ::close(pair[0]);
        if (err != 0) {
            // The init ends at once (it exits when it cannot pass the terminal): no command ran.
            ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
            ::close(pidfd);
            pidfd = -1;
        }
        return err;
    }

    // In the cloned init of a flag_pty_lease request: makes the channel's terminal
    // (make_channel_pty), sends its master and 0 on `socket` (or only the errno, and exits),
    // and makes the slave the request's fds 0-2 in place of the daemon's placeholders.
    void pass_terminal(ChannelRequest& req, int socket) {
        int master = -1;
        int slave = -1;
        const std::int32_t err = make_channel_pty(req.header.reserved, master, slave);
        send_fds(socket, &err, sizeof err, &master, err == 0 ? 1 : 0);
        if (err != 0) ::_exit(125);
        ::close(master);
        ::close(socket);
        for (std::size_t i = 0; i < 3; ++i) {
            ::close(req.fds[i]);
            req.fds[i] = slave;
        }
    }

    // The supervisor's side of pass_terminal(): the init's errno, or 0 with the master in
    // `master`. EIO when the init ended first; ETIMEDOUT after proto::terminal_timeout_ms.
    static int receive_terminal(int socket, int& master) {
        pollfd p{socket, POLLIN, 0};
        int ready = 0;
        do {
            ready = ::poll(&p, 1, proto::terminal_timeout_ms);
        } while (ready < 0 && errno == EINTR);
        if (ready == 0) return ETIMEDOUT;
        std::int32_t err = 0;
        std::vector<int> fds;
        int msg_flags = 0;
        ssize_t n = 0;
        do {
            n = receive_fds(socket, &err, sizeof err, fds, msg_flags, MSG_DONTWAIT);
        } while (n < 0 && errno == EINTR);
        if (fds.size() == 1) master = fds[0];
        if (fds.size() > 1 || n != static_cast<ssize_t>(sizeof err)) {
            for (int fd : fds) ::close(fd);
            master = -1;
            return EIO;
        }
        if (err == 0 && master < 0) return EIO;
        if (err != 0 && master >= 0) {
            ::close(master);
            master = -1;
        }
        return err;
    }

    static void send_reply(int socket, const proto::Reply& reply, int pidfd) {
        send_packet(socket, &reply, sizeof reply, pidfd);
    }

    // One packet of `size` bytes, with `pidfd` by SCM_RIGHTS when it is not negative.
    static void send_packet(int socket, const void* data, std::size_t size, int pidfd) {
        send_fds(socket, data, size, &pidfd, pidfd >= 0 ? 1 : 0);
    }

    // One packet of `size` bytes, with the `count` descriptors of `fds` by SCM_RIGHTS.
    static void send_fds(int socket, const void* data, std::size_t size, const int* fds,
                         std::size_t count) {
        iovec iov{const_cast<void*>(data), size};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::held_slots)] = {};
        if (count > 0) {
            msg.msg_control = control;
            msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
            cmsghdr* c = CMSG_FIRSTHDR(&msg);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int) * count);
            std::memcpy(CMSG_DATA(c), fds, sizeof(int) * count);
        }
        while (::sendmsg(socket, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
        }
    }

    static constexpr std::size_t buffer_size = sizeof(proto::Request) + proto::max_payload + 1;
    Adoption adoption_;
    int socket_ = proto::socket_fd;  ///< the daemon's socket; -1 while waiting for one
    long orphaned_until_ms_ = 0;     ///< CLOCK_MONOTONIC: no daemon after it, the sandbox ends
    std::unique_ptr<char[]> buffer_;
    ChannelRequest request_;  ///< the request being served; its vectors' storage is kept
    std::string program_;
    int signal_fd_ = -1;
    int warm_socket_ = -1;  ///< the supervisor's end of the warm init's socket pair; -1: none
    int warm_pidfd_ = -1;   ///< the warm init's pidfd, close-on-exec
    /// The socket of the last warm init handed a request, until it has started its command
    /// (it closes its end then; started()); -1: none.
    int starting_socket_ = -1;
    std::vector<HeldEntry> held_;  ///< the kept channels' ends (serve_held)
};

}  // namespace

namespace {

// Joins the lease's cgroup through the `count` join files at fds proto::cgroup_fd, ... (the
// daemon opened them: the kernel checks its credentials, not ours), then makes a cgroup
// namespace rooted there, so that the sandbox sees its own cgroup as "/". False, with the
// reason on stderr, when either fails: the sandbox must not serve outside its limits.
bool join_lease_cgroup(unsigned count) {
    // Single-threaded: "0" written to a v1 `tasks` file moves all of this process.
    for (unsigned i = 0; i < count; ++i) {
        if (::write(proto::cgroup_fd + static_cast<int>(i), "0", 1) != 1) {
            print_error("cannot join the lease's cgroup", "", errno);
            return false;
        }
    }
    if (count > 0 && ::unshare(CLONE_NEWCGROUP) < 0) {
        print_error("cannot make the lease's cgroup namespace", "", errno);
        return false;
    }
    return true;
}

}  // namespace

namespace {

// Reads the lease's secret from the memfd at `fd` and closes it; false, with the reason on
// stderr, when it does not hold secret_size bytes.
bool read_secret(int fd, Adoption& adoption) {
    std::size_t done = 0;
    while (done < proto::secret_size) {
        const ssize_t n = ::pread(fd, adoption.secret + done, proto::secret_size - done,
                                  static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            print_error("cannot read the lease's secret", "", n < 0 ? errno : EIO);
            return false;
        }
        done += static_cast<std::size_t>(n);
    }
    ::close(fd);
    return true;
}

// A whole decimal number in [low, high], or false.
bool parse_number(const char* text, unsigned long low, unsigned long high, unsigned long& out) {
    char* end = nullptr;
    errno = 0;
    out = std::strtoul(text, &end, 10);
    return errno == 0 && end != text && *end == '\0' && text[0] != '-' && out >= low && out <= high;
}

}  // namespace

int main(int argc, char** argv) {
    unsigned long cgroup_fds = 0;
    unsigned long adopt_timeout_ms = 0;
    // --lease, then options that each take a value.
    bool usage_ok = argc >= 2 && argc % 2 == 0 && std::strcmp(argv[1], "--lease") == 0;
    for (int i = 2; usage_ok && i + 1 < argc; i += 2) {
        if (std::strcmp(argv[i], "--cgroup-fds") == 0) {
            usage_ok = parse_number(argv[i + 1], 1, proto::max_cgroup_fds, cgroup_fds);
        } else if (std::strcmp(argv[i], "--adopt-timeout-ms") == 0) {
            usage_ok = parse_number(argv[i + 1], 1, 86'400'000, adopt_timeout_ms);
        } else {
            usage_ok = false;
        }
    }
    if (!usage_ok) {
        static const char usage[] =
            "usage: sandboxd-init --lease [--cgroup-fds N] [--adopt-timeout-ms MS]  (started by "
            "sandboxd inside a lease's sandbox)\n";
        write_all(STDERR_FILENO, usage, sizeof usage - 1);
        return 2;
    }
    Adoption adoption;
    if (adopt_timeout_ms > 0) {
        const int given = proto::cgroup_fd + static_cast<int>(cgroup_fds);
        if (!read_secret(given + 1, adoption)) return 1;
        if (given != proto::listen_fd && ::dup2(given, proto::listen_fd) < 0) {
            print_error("cannot keep the adoption socket", "", errno);
            return 1;
        }
        adoption.listen = proto::listen_fd;
        adoption.timeout_ms = static_cast<long>(adopt_timeout_ms);
        ::fcntl(adoption.listen, F_SETFD, FD_CLOEXEC);
        // Non-blocking: a connection gone between poll() and accept4() must not hold the
        // supervisor (the accepted sockets are blocking, with timeouts).
        ::fcntl(adoption.listen, F_SETFL, O_NONBLOCK);
        // This process listens, so that SO_PEERCRED of every connection names it, not the
        // daemon that bound the socket.
        if (::listen(adoption.listen, 4) != 0) {
            print_error("cannot listen on the adoption socket", "", errno);
            return 1;
        }
    }
    if (!join_lease_cgroup(static_cast<unsigned>(cgroup_fds))) return 1;
    // Keep only the protocol fds (and the adoption socket).
    ::syscall(SYS_close_range, 5U, static_cast<unsigned>(proto::listen_fd) - 1U, 0U);
    ::syscall(SYS_close_range, static_cast<unsigned>(proto::listen_fd) + 1U, ~0U, 0U);
    if (adoption.listen < 0) ::close(proto::listen_fd);
    // bwrap exports PWD after --chdir; every command's environment is exactly the daemon's.
    ::unsetenv("PWD");
    return Supervisor(adoption).run();
}
