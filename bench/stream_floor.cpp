/// @file stream_floor.cpp
/// sandboxd_stream_floor: what moving `head -c N /dev/zero` to a reader over loopback TCP
/// costs with no daemon, no WebSocket library, no sandbox and no flow control (issue 19): the
/// floor under bench/run's stream figure, measured beside its anchor, `head | cat`.
///
///   sandboxd_stream_floor [--bytes N] [--runs R]
///
/// Each run times, in turn, four ways of moving the N bytes, from the spawn of `head` to the
/// reader's last byte:
///   pipe          `head -c N /dev/zero | cat > /dev/null`, as bench/run's anchor (two
///                 processes);
///   tcp           `head`'s stdout is one end of a loopback TCP connection; a reader process
///                 recv()s the other end into a 1 MiB buffer and drops it: the transport with
///                 no relay (two processes, one copy, the TCP stack);
///   relay_copy    `head` writes into a pipe (grown to 1 MiB, as a streaming channel's); a relay
///                 (this process) reads it and writes each read as one WebSocket binary frame
///                 (header and payload in one writev) into the connection (three processes);
///   relay_splice  the same relay, the payload spliced from the pipe into the socket after a
///                 write of the header (no copy through user space), as the daemon sends a
///                 channel's stdout.
/// The relays frame as the daemon does (docs/protocol.md, "Output frames"): up to 256 KiB per
/// frame, waiting at most 2 x 100 us for a fuller one while the stream runs. The reader only
/// counts bytes: no frame parsing, no checks, no credit. So each figure is an upper bound of
/// what a daemon relaying the same stream over the same transport can reach on this machine.
/// Prints one JSON object for bench/run's report: the median MB/s of each way (MB = 10^6
/// bytes), each run's MB/s and the CPU seconds its processes used (user + system, from
/// getrusage: this process and its reaped children; with two cores, a run of S seconds has 2S
/// to use). N defaults to 1 GiB, R to 3.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <string>
#include <vector>

extern char** environ;

namespace {

enum class way : int { pipe, tcp, relay_copy, relay_splice };
constexpr std::array<const char*, 4> way_names = {"pipe", "tcp", "relay_copy", "relay_splice"};

constexpr std::size_t frame_limit = 256 * 1024;  // the daemon's maxDataPayload
constexpr int streaming_pipe_size = 1 << 20;     // what a streaming channel's pipe grows to
constexpr auto coalesce_wait = std::chrono::microseconds(100);
constexpr int coalesce_waits = 2;
constexpr std::size_t read_buffer = 1 << 20;

[[noreturn]] void fail(const std::string& what, int err) {
    std::fprintf(stderr, "sandboxd_stream_floor: %s: %s\n", what.c_str(), std::strerror(err));
    std::exit(1);
}

void check(bool ok, const char* what) {
    if (!ok) fail(what, errno);
}

/// Spawns `argv` with stdout on `out` (the child's other descriptors are close-on-exec).
pid_t spawn_with_stdout(const std::vector<std::string>& args, int out) {
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    if (out >= 0) ::posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);
    pid_t pid = -1;
    const int err = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    if (err != 0) fail("spawn " + args[0], err);
    return pid;
}

void wait_ok(pid_t pid, const char* what) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) fail(std::string("wait for ") + what, errno);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "sandboxd_stream_floor: %s failed (status %d)\n", what, status);
        std::exit(1);
    }
}

/// A connected loopback TCP pair: [0] the sending end, [1] the reading end.
std::array<int, 2> tcp_pair() {
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    check(listener >= 0, "socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    check(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0, "bind");
    check(::listen(listener, 1) == 0, "listen");
    check(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getsockname");
    const int reader = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    check(reader >= 0, "socket");
    check(::connect(reader, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0, "connect");
    const int sender = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    check(sender >= 0, "accept");
    ::close(listener);
    const int one = 1;
    ::setsockopt(sender, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // as Beast's server
    return {sender, reader};
}

/// A reader process on `fd`: recv() until EOF, then its byte count on `report`. It closes its
/// copies of `others` (the sending end: it would never see EOF while it held one).
pid_t start_reader(int fd, int report, std::initializer_list<int> others) {
    const pid_t pid = ::fork();
    check(pid >= 0, "fork");
    if (pid != 0) return pid;
    for (int other : others) ::close(other);
    std::vector<char> buffer(read_buffer);
    std::uint64_t total = 0;
    for (;;) {
        const ssize_t n = ::recv(fd, buffer.data(), buffer.size(), 0);
        if (n > 0) {
            total += static_cast<std::uint64_t>(n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) ::_exit(1);
        break;
    }
    ::_exit(::write(report, &total, sizeof total) == sizeof total ? 0 : 1);
}

/// A WebSocket binary frame's header for `size` bytes of payload (RFC 6455 5.2, unmasked as a
/// server's): into `out`, returns its length. The same bytes as the daemon's
/// websocket_binary_header() (src/server/frame_guard.hpp), written into a stack buffer here so
/// that this tool stays free of Asio and Beast (and of an allocation per frame).
std::size_t frame_header(std::uint64_t size, unsigned char* out) {
    out[0] = 0x82;
    if (size < 126) {
        out[1] = static_cast<unsigned char>(size);
        return 2;
    }
    if (size <= 0xffff) {
        out[1] = 126;
        out[2] = static_cast<unsigned char>(size >> 8);
        out[3] = static_cast<unsigned char>(size);
        return 4;
    }
    out[1] = 127;
    for (int i = 0; i < 8; ++i) out[2 + i] = static_cast<unsigned char>(size >> (56 - 8 * i));
    return 10;
}

void write_all(int fd, const iovec* iov, int count) {
    std::vector<iovec> rest(iov, iov + count);
    std::size_t first = 0;
    while (first < rest.size()) {
        const ssize_t n = ::writev(fd, rest.data() + first, static_cast<int>(rest.size() - first));
        if (n < 0 && errno == EINTR) continue;
        check(n >= 0, "writev");
        auto left = static_cast<std::size_t>(n);
        while (first < rest.size() && left >= rest[first].iov_len) left -= rest[first++].iov_len;
        if (first < rest.size()) {
            rest[first].iov_base = static_cast<char*>(rest[first].iov_base) + left;
            rest[first].iov_len -= left;
        }
    }
}

/// Bytes waiting in the pipe; 0 at EOF (readable with nothing queued).
std::size_t wait_readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, -1) < 0) {
        if (errno != EINTR) fail("poll", errno);
    }
    int avail = 0;
    check(::ioctl(fd, FIONREAD, &avail) == 0, "FIONREAD");
    return static_cast<std::size_t>(std::max(avail, 0));
}

/// The relay: frames of the pipe's bytes into the socket until the pipe's EOF. Returns the
/// bytes of frame headers it sent.
std::uint64_t relay(int pipe_fd, int socket, bool splice_payload) {
    std::vector<char> buffer(splice_payload ? 0 : frame_limit);
    std::uint64_t header_bytes = 0;
    for (;;) {
        std::size_t avail = wait_readable(pipe_fd);
        if (avail == 0) return header_bytes;
        // A stream is running: wait a little for a fuller frame, as the daemon does.
        for (int round = 0; round < coalesce_waits && avail < frame_limit; ++round) {
            const timespec pause{0, std::chrono::nanoseconds(coalesce_wait).count()};
            ::nanosleep(&pause, nullptr);
            int now = 0;
            if (::ioctl(pipe_fd, FIONREAD, &now) == 0) avail = std::max<std::size_t>(avail, now);
        }
        const std::size_t size = std::min(avail, frame_limit);
        unsigned char header[10];
        iovec iov[2] = {{header, 0}, {nullptr, 0}};
        if (splice_payload) {
            iov[0].iov_len = frame_header(size, header);
            write_all(socket, iov, 1);
            std::size_t left = size;
            while (left > 0) {
                const ssize_t n = ::splice(pipe_fd, nullptr, socket, nullptr, left, SPLICE_F_MORE);
                if (n < 0 && errno == EINTR) continue;
                check(n > 0, "splice");
                left -= static_cast<std::size_t>(n);
            }
        } else {
            std::size_t got = 0;
            while (got < size) {  // the bytes are in the pipe: read() returns them at once
                const ssize_t n = ::read(pipe_fd, buffer.data() + got, size - got);
                if (n < 0 && errno == EINTR) continue;
                check(n > 0, "read");
                got += static_cast<std::size_t>(n);
            }
            iov[0].iov_len = frame_header(size, header);
            iov[1] = {buffer.data(), size};
            write_all(socket, iov, 2);
        }
        header_bytes += iov[0].iov_len;
    }
}

/// CPU seconds (user + system) of this process and of its reaped children so far.
double cpu_seconds() {
    double total = 0;
    for (int who : {RUSAGE_SELF, RUSAGE_CHILDREN}) {
        rusage u{};
        ::getrusage(who, &u);
        total += static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
                 static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
    }
    return total;
}

struct Timed {
    double mb_s;
    double cpu_s;  ///< CPU of every process of the way (head, cat or reader, relay), per run
};

/// One timed run of `w`.
Timed timed(way w, std::uint64_t bytes) {
    const std::string count = std::to_string(bytes);
    const double cpu_before = cpu_seconds();
    const auto began = std::chrono::steady_clock::now();
    std::uint64_t expected = bytes;
    std::uint64_t received = 0;
    if (w == way::pipe) {
        const pid_t sh = spawn_with_stdout(
            {"/bin/sh", "-c", "head -c " + count + " /dev/zero | cat > /dev/null"}, -1);
        wait_ok(sh, "head | cat");
        received = bytes;
    } else {
        const auto [sender, reader] = tcp_pair();
        int report[2];
        check(::pipe2(report, O_CLOEXEC) == 0, "pipe2");
        const pid_t reader_pid = start_reader(reader, report[1], {sender, report[0]});
        ::close(reader);
        ::close(report[1]);
        if (w == way::tcp) {
            const pid_t head = spawn_with_stdout({"head", "-c", count, "/dev/zero"}, sender);
            ::close(sender);
            wait_ok(head, "head");
        } else {
            int p[2];
            check(::pipe2(p, O_CLOEXEC) == 0, "pipe2");
            (void)::fcntl(p[0], F_SETPIPE_SZ, streaming_pipe_size);
            const pid_t head = spawn_with_stdout({"head", "-c", count, "/dev/zero"}, p[1]);
            ::close(p[1]);
            expected += relay(p[0], sender, w == way::relay_splice);
            ::close(p[0]);
            ::close(sender);
            wait_ok(head, "head");
        }
        ssize_t n = -1;
        do {
            n = ::read(report[0], &received, sizeof received);
        } while (n < 0 && errno == EINTR);
        ::close(report[0]);
        wait_ok(reader_pid, "reader");
        if (n != sizeof received) fail("the reader's count", EPROTO);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    if (received != expected) {
        std::fprintf(stderr, "sandboxd_stream_floor: %s: %llu of %llu bytes\n",
                     way_names[static_cast<int>(w)], static_cast<unsigned long long>(received),
                     static_cast<unsigned long long>(expected));
        std::exit(1);
    }
    return {static_cast<double>(bytes) / 1e6 / secs, cpu_seconds() - cpu_before};
}

}  // namespace

int main(int argc, char** argv) {
    std::uint64_t bytes = 1ULL << 30;
    int runs = 3;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--bytes" && i + 1 < argc) {
            bytes = std::strtoull(argv[++i], nullptr, 10);
        } else if (a == "--runs" && i + 1 < argc) {
            runs = std::atoi(argv[++i]);
        } else {
            std::fprintf(stderr, "usage: sandboxd_stream_floor [--bytes N] [--runs R]\n");
            return 2;
        }
    }
    if (bytes == 0 || runs < 1) {
        std::fprintf(stderr, "sandboxd_stream_floor: --bytes and --runs must be positive\n");
        return 2;
    }
    ::signal(SIGPIPE, SIG_IGN);  // a reader that died shows as EPIPE, then a failed run
    std::array<std::vector<double>, way_names.size()> rates;
    std::array<std::vector<double>, way_names.size()> cpus;
    for (int r = 0; r < runs; ++r) {
        for (std::size_t w = 0; w < way_names.size(); ++w) {
            const Timed t = timed(static_cast<way>(w), bytes);
            rates[w].push_back(t.mb_s);
            cpus[w].push_back(t.cpu_s);
        }
    }
    std::string ways;
    std::array<double, way_names.size()> medians{};
    for (std::size_t w = 0; w < way_names.size(); ++w) {
        auto v = rates[w];
        std::sort(v.begin(), v.end());
        medians[w] = v[v.size() / 2];
        std::string runs_list;
        for (double x : rates[w]) runs_list += (runs_list.empty() ? "" : ", ") + std::to_string(x);
        std::string cpu_list;
        for (double x : cpus[w]) cpu_list += (cpu_list.empty() ? "" : ", ") + std::to_string(x);
        char entry[512];
        std::snprintf(entry, sizeof entry,
                      "%s\"%s\": {\"median_mb_s\": %.1f, \"runs\": [%s], \"cpu_s\": [%s]}",
                      w == 0 ? "" : ", ", way_names[w], medians[w], runs_list.c_str(),
                      cpu_list.c_str());
        ways += entry;
    }
    std::printf(
        "{\"stream_floor_mb_s\": %.1f, \"details\": {\"stream_floor\": {\"bytes\": %llu, %s}}}\n",
        medians[static_cast<int>(way::relay_splice)], static_cast<unsigned long long>(bytes),
        ways.c_str());
    return 0;
}
