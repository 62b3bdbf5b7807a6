#pragma once
/// @file spawn.hpp
/// Starting a program from the multi-threaded daemon without fork (clone with
/// CLONE_VM|CLONE_VFORK, as posix_spawn does), and the pipes and PTYs that go with it.
/// Internal to the providers. Every function is safe to call from any thread.

#include <sandboxd/core/unique_fd.hpp>
#include <sandboxd/provider/provider.hpp>

#include <sys/types.h>

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd::detail {

/// A pipe with both ends close-on-exec. The ends meant for the daemon are made non-blocking;
/// the ends handed to a child stay blocking.
struct Pipe {
    unique_fd read_end;
    unique_fd write_end;
};

/// Which end of a pipe the daemon keeps (and so makes non-blocking).
enum class daemon_end { read, write };

/// Creates a pipe; throws rpc_error(errc::provider_error) on failure, or
/// rpc_error(errc::channel_limit) when the process is out of descriptors (EMFILE, ENFILE), as
/// every function here does.
Pipe make_pipe(daemon_end kept);

/// A new pseudo-terminal: the master is non-blocking, both are close-on-exec, and the
/// window size is already set on the slave.
struct Pty {
    unique_fd master;
    unique_fd slave;
};

/// Opens a PTY of `size`; throws rpc_error(errc::provider_error) on failure.
Pty open_pty(const PtySize& size);

struct SpawnRequest {
    /// argv[0] is the program's path (no PATH search). Must be non-empty.
    std::vector<std::string> argv;
    /// The complete environment, "NAME=value" entries.
    std::vector<std::string> envp;
    /// The child's fds 0..7; -1 means /dev/null for 0..2 and closed for 3..7.
    /// The fds stay owned by the caller (close the child's ends after spawn returns).
    std::array<int, 8> fds = {-1, -1, -1, -1, -1, -1, -1, -1};
    /// The child's fds 8, 9, ... (at most max_extra_fds): passed on as they are, open across
    /// the exec. Owned by the caller, as `fds`. (A lease's supervisor takes up to 8 cgroup
    /// join files, then its adoption socket and secret.)
    std::vector<int> extra_fds;
    static constexpr std::size_t max_extra_fds = 10;
    /// If >= 0, a PTY slave to make the child's controlling terminal (after setsid).
    int controlling_tty = -1;
    /// If >= 0, a network namespace the child enters (setns) first: a lease's own (issue 48).
    /// Owned by the caller.
    int netns = -1;
    /// If set, the child drops to this uid and gid (no supplementary groups) before exec.
    std::optional<std::pair<uid_t, gid_t>> run_as;
};

struct SpawnResult {
    pid_t pid = -1;
    unique_fd pidfd;  ///< close-on-exec and non-blocking
};

/// Starts `request` in a new session: the child gets exactly the fds asked for, an empty signal
/// mask and default dispositions. The child shares the daemon's memory until its exec (CLONE_VM,
/// CLONE_VFORK): only async-signal-safe calls run in it, and the calling thread blocks (with
/// every signal blocked) until the exec or the child's failure, typically well under 1 ms.
/// Returns once the exec has succeeded. If it fails, the child is reaped and
/// rpc_error(errc::provider_error, "cannot start <what>: <strerror>") is thrown.
/// The caller must reap `pid` (e.g. once `pidfd` is readable).
SpawnResult spawn_process(const SpawnRequest& request, const std::string& what);

}  // namespace sandboxd::detail
