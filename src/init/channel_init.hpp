#pragma once
/// @file channel_init.hpp
/// The channel init of sandboxd-init (init_main.cpp has the whole story): PID 1 of a
/// channel's PID and mount namespace, which starts the channel's command, forwards signals to
/// it, obeys the daemon's control bytes, reaps and reports the command's end. The lease
/// supervisor (init_main.cpp) clones one per channel and calls run_channel_init() in it; the
/// few helpers both need are here too. Built into the static sandboxd-init only: libc and
/// libstdc++, single-threaded, nothing here may allocate after a clone(CLONE_VM).

#include "init/supervisor_protocol.hpp"

#include <cstddef>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace sandboxd::init {

/// Writes all of `data` to `fd`, retrying on EINTR; gives up silently on any other error.
void write_all(int fd, const char* data, std::size_t size);
/// "sandboxd-init: <what><detail>: <strerror(err)>" on stderr.
void print_error(const char* what, const char* detail, int err);
/// Writes to a pipe whose reader is gone fail with EPIPE instead of killing the process.
void ignore_sigpipe();
/// An empty handler: PID 1 of a namespace only receives signals it has a handler for. The
/// signals are blocked and read from a signalfd, so this never runs in practice.
void ignore_signal(int);
/// Once per lease, in the supervisor: every channel init is its clone and inherits the result.
/// Empties the capability bounding set, so that no exec in the sandbox (as uid 0 of its user
/// namespace, or of a file with capabilities) grants any; the supervisor's own effective set,
/// which a channel's init needs for its mounts, stays. False (with errno) on failure: the
/// sandbox then refuses to serve.
bool empty_bounding_set();
/// Once per lease, in the supervisor: every disposition back to the default, whatever
/// bubblewrap or the daemon left, so that a command only needs the init's own changes undone.
void reset_signal_dispositions();

/// The stack of a command's child before its exec (the channel init's start of its
/// command): room for execvp's copy of argv (a script without "#!" runs through /bin/sh with
/// argv on the stack, as in posix_spawn) above a guard page, so that an overflow faults
/// instead of writing into the memory that the child shares with the init.
struct CommandStack {
    void* map = nullptr;   ///< the mapping, guard page first; nullptr: none
    std::size_t size = 0;  ///< the mapping's bytes, guard page included
    std::size_t argc = 0;  ///< the most arguments it has room for

    static CommandStack make(std::size_t argc) {
        const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
        const std::size_t usable =
            (64 * 1024 + (argc + 3) * sizeof(char*) + page - 1) / page * page;
        CommandStack stack;
        void* map = ::mmap(nullptr, usable + page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (map == MAP_FAILED) return stack;
        if (::mprotect(map, page, PROT_NONE) < 0) {
            ::munmap(map, usable + page);
            return stack;
        }
        stack.map = map;
        stack.size = usable + page;
        stack.argc = argc;
        return stack;
    }
    char* top() const { return static_cast<char*>(map) + size; }
    void unmap() {
        if (map != nullptr) ::munmap(map, size);
        map = nullptr;
    }
};

/// A channel request as the supervisor received it.
struct ChannelRequest {
    supervisor::Request header;
    std::vector<int> fds;  // channel_fds, then header.cgroup_fds
    const char* cwd = nullptr;
    std::vector<char*> argv;  // null-terminated
    std::vector<char*> envp;  // null-terminated
};

/// A /proc of this channel's own PID namespace, in a mount namespace of its own, mounted over
/// the lease's (which stays hidden below it: nothing here can unmount), with the host-wide
/// files above masked. 0 or an errno.
int mount_channel_proc();

/// With flag_pty_lease (supervisor_protocol.hpp), in a channel init's own mount namespace
/// before any syscall filter: mounts a devpts instance of the channel's own over /dev/pts
/// (newinstance: the lease's and every other channel's terminals stay out of reach; ptmx
/// 0666, as bubblewrap's own instance, so that the command may open terminals of its own)
/// and opens a terminal in it, unlocked and of `window` (rows << 16 | columns). `master` and
/// `slave` receive its ends, close-on-exec. 0 or an errno (whatever it opened is closed).
int make_channel_pty(std::uint32_t window, int& master, int& slave);

/// What a channel init sets up that no request decides (a warm init does it before it waits,
/// so that an open does not pay for it; a cloned init at its start): its own session (the
/// command's terminal, if any, becomes its controlling one), not dumpable (the command shares
/// its uid: keep it out of the init's descriptors and memory; a clone of the supervisor is so
/// already, this says it where it matters), the command's umask, as `docker exec` and a login
/// give it (not the daemon's 0077, daemon_main.cpp and the unit's UMask=, which every process
/// it starts inherits), and its signal handling. Failures are kept for the request, whose
/// stderr is where they are told.
struct PreparedInit {
    int session_error = 0;  ///< setsid()'s errno, or 0
    int signals_error = 0;  ///< block_init_signals()'s errno, or 0
    CommandStack stack;     ///< made ahead by a warm init; none for a cloned one
};

/// Sets up what PreparedInit describes, in the process that will be the channel init.
PreparedInit prepare_channel_init();

/// The channel init's work once it has its request; its /proc is mounted (mount_channel_proc)
/// and prepare_channel_init() has run. `filtered`: the init itself is under `program` already
/// (a warm init applies it ahead), which every process it starts inherits; else the command
/// applies it before its exec.
/// `started`: a warm init's socket with the supervisor (closed once the command is started),
/// or -1.
[[noreturn]] void run_channel_init(const ChannelRequest& req, const std::string& program,
                                   bool filtered, const PreparedInit& prepared, int started);

}  // namespace sandboxd::init
