#pragma once
/// @file supervisor_protocol.hpp
/// The wire between the daemon and a lease's supervisor (`sandboxd-init --lease`, PID 1 of the
/// lease's long-lived sandbox). Shared by the daemon (src/provider/bwrap_provider.cpp) and the
/// init (src/init/init_main.cpp); plain structs, no library beyond libc.
///
/// Transport: one AF_UNIX SOCK_SEQPACKET socket pair per lease; the supervisor holds its end at
/// fd `socket_fd`. Each message is one packet: a fixed header, then for a request the payload
/// (cwd, argv and env as NUL-terminated strings), with descriptors passed by SCM_RIGHTS.
///  - Request (daemon -> supervisor): `Request` + payload; SCM_RIGHTS carries, in this order,
///    the channel's stdin, stdout and stderr (under a PTY, the slave three times), the status
///    pipe's write end, the control pipe's read end, then `cgroup_fds` cgroup join files
///    opened by the daemon (the channel's child cgroup, one per hierarchy: v1 `tasks`, v2
///    cgroup.procs; ChannelCgroup::open_procs).
///    A payload above `max_inline_payload` bytes travels instead in a sealed memfd of exactly
///    `payload_size` bytes, the last descriptor, with `flag_payload_memfd` set and nothing after
///    the header: a packet must fit the socket's send buffer, and the default one (wmem_default,
///    208 KiB) is smaller than `max_payload`. Raising it would take SO_SNDBUFFORCE, that is
///    CAP_NET_ADMIN, which the daemon does without (systemd/sandboxd.service).
///  - Reply (supervisor -> daemon): `Reply`; when `error` is 0, SCM_RIGHTS carries one pidfd of
///    the channel's init (PID 1 of the channel's own PID namespace; made ahead of the request
///    when a warm init was ready, init_main.cpp), and with `flag_pty_lease` the terminal's
///    master after it. Replies come in request
///    order, one per request. The first reply, id 0 ("hello": the supervisor serves), carries
///    a pidfd of the supervisor itself, which the daemon kills to end the whole sandbox.
/// Nothing here is parsed from the sandbox's commands: the supervisor and each channel's init
/// are not dumpable, so a command (same uid, no capabilities) cannot open their descriptors,
/// and this socket is closed in every channel before its command runs.
///
/// **Adoption** (issue 47). Started with `--adopt-timeout-ms N`, the supervisor outlives its
/// daemon: it also holds a listening SOCK_SEQPACKET socket (`listen_fd`, bound by the daemon at
/// `<runtimeDir>/<providerLeaseId>/supervisor.sock`, a path no sandbox can reach) and the lease's
/// secret (`secret_size` random bytes, read once from a memfd and kept only in
/// its memory; the daemon keeps its copy in `<stateDir>/sandboxes/<providerLeaseId>/secret`,
/// 0600). When the daemon's end of the socket pair closes, the channels whose pipes the daemon
/// held end by themselves (their init sees its status pipe's reader gone), and the supervisor
/// waits up to N ms for a daemon to connect; then it exits. A daemon connects and sends one
/// `Adopt` packet:
///  - with the right secret and a version range that holds `version`, the supervisor answers
///    with a `Welcome` (error 0) carrying a pidfd of itself (from version 4, and then a
///    descriptor of the lease's /workspace as the sandbox sees it, when it opens: under
///    systemd each daemon start has a mount namespace of its own, so a later daemon finds
///    the workspace's disk mounted only inside the sandbox), closes the socket it served before
///    (a daemon that takes over) and serves requests on the new connection, as on the pair;
///  - with the right secret and `adopt_end`, it answers with a `Welcome` and exits: the daemon
///    ends a sandbox it will not adopt (whatever the versions: this packet's layout never
///    changes);
///  - with the right secret and a range without `version`, the answer is a `Welcome` with
///    error EPROTONOSUPPORT and this supervisor's version, and nothing else changes;
///  - anything else (a short packet, a wrong secret) is closed without an answer.
/// The daemon checks SO_PEERCRED of the connection (the lease's uid, and the pid its pidfd
/// names) before it trusts the welcome.
///
/// **Kept channels** (version 3). A channel that must outlive its daemon (a detached one) is
/// followed, right after its reply, by a `Held` packet (`hold_magic`) carrying copies of the
/// daemon's own ends of it (the slots of `held_slot` whose bits are set in `mask`, in slot
/// order) under the daemon's `key`: the supervisor keeps them, so that the channel's init
/// never sees its status pipe's reader go and the command's output waits in its pipes while
/// no daemon runs. A `Held` with `release_magic` closes the slots of `mask` of that key (its
/// stdin once the daemon closed it, so that the command reads EOF; every slot once the
/// channel is over), and the entry goes with its last slot. A `Held` with `return_magic`
/// (after a welcome) asks for them all: the supervisor answers with one `Held`
/// (`hold_magic`, its copies by SCM_RIGHTS) per entry, then one with an empty mask and key.
/// None of these is answered otherwise; a supervisor keeps at most `max_held` entries (more
/// are closed at once: that channel does not outlive its daemon). Every channel init closes
/// the copies it inherits at its clone. Without `--adopt-timeout-ms` the supervisor exits when
/// the daemon's end closes. Either way, as PID 1 of the lease's PID namespace, its exit kills
/// every process of the lease.
///
/// **PTYs made inside the lease** (version 4, issue 47). A request with `flag_pty_lease` has
/// its terminal made by its channel's init, never by the daemon: in its new mount namespace
/// the init mounts a devpts instance of its own over /dev/pts (`newinstance`, so no channel
/// sees another's terminals, and the lease's own instance stays hidden below), opens its
/// `ptmx`, sets the window, and gives the supervisor the master over a socket pair made for
/// it; the slave becomes the command's fds 0-2 and its controlling terminal, so that inside,
/// `tty` names `/dev/pts/0` and `/dev/tty` opens. The reply then carries the pidfd and the
/// master, in that order. Such a request always gets an init cloned for it, never the warm
/// one, whose syscall filter (no mount) is on already. The master reaches the daemon like any
/// other channel end, and a kept channel's is held by the supervisor as before.

#include <cstddef>
#include <cstdint>

namespace sandboxd::supervisor {

inline constexpr std::uint32_t request_magic = 0x53425251;  // "SBRQ"
inline constexpr std::uint32_t reply_magic = 0x53425250;    // "SBRP"
inline constexpr int socket_fd = 3;   ///< the supervisor's end of the socket pair
inline constexpr int program_fd = 4;  ///< memfd holding the seccomp BPF program (read at start)
/// The first of the lease's cgroup join files (v1 `tasks`, v2 cgroup.procs), opened by the
/// daemon and passed through bubblewrap when the supervisor runs as `--lease --cgroup-fds N`
/// (1 <= N <= max_cgroup_fds): fds cgroup_fd .. cgroup_fd + N - 1. The supervisor joins them
/// before it serves, then unshares its cgroup namespace.
inline constexpr int cgroup_fd = 8;
/// With `--adopt-timeout-ms`, bubblewrap passes the adoption socket and the secret's memfd
/// right after the cgroup join files (fds cgroup_fd + N and cgroup_fd + N + 1, N the
/// `--cgroup-fds` count or 0); the supervisor reads and closes the secret's, and keeps the
/// socket at `listen_fd`.
inline constexpr int listen_fd = 16;
inline constexpr std::size_t secret_size = 32;
/// This supervisor's protocol version: the Request/Reply layout and the requests it serves.
/// SANDBOXD_SUPERVISOR_VERSION replaces it only in the test builds that play an older or a
/// newer supervisor (tests/CMakeLists.txt).
#ifdef SANDBOXD_SUPERVISOR_VERSION
inline constexpr std::uint32_t version = SANDBOXD_SUPERVISOR_VERSION;
#else
inline constexpr std::uint32_t version = 4;
#endif
/// The oldest supervisor version this daemon adopts: version 1's Request and Reply are
/// these, unchanged by 2 (which added adoption), 3 (kept channels: the daemon sends `Held`
/// packets only to a supervisor of version 3 or later) and 4 (`flag_pty_lease`, sent only to
/// a supervisor of version 4 or later). A version whose requests change raises it.
inline constexpr std::uint32_t oldest_adoptable = 1;
inline constexpr std::size_t max_payload = 2U << 20;  ///< cwd + argv + env, as execve allows
/// The largest payload sent in the packet itself; above it, a memfd carries it.
inline constexpr std::size_t max_inline_payload = 64U << 10;
inline constexpr std::size_t max_cgroup_fds = 8;
inline constexpr std::size_t channel_fds = 5;
inline constexpr std::size_t max_fds = channel_fds + max_cgroup_fds + 1;  ///< + the payload memfd
static_assert(max_fds >= 8, "a Held packet carries up to 8 descriptors");
inline constexpr std::size_t max_program = 64U << 10;   ///< bytes of BPF
inline constexpr std::uint32_t max_strings = 1U << 16;  ///< argc + envc

enum request_flags : std::uint32_t {
    flag_pty = 1U << 0,            ///< fd 0 is a PTY slave: make it the controlling terminal
    flag_payload_memfd = 1U << 1,  ///< the payload is in the last descriptor, a sealed memfd
    /// With flag_pty (version 4): the terminal is made inside the lease, in a devpts instance
    /// of the channel's own; fds 0-2 are placeholders (/dev/null), the window is
    /// `Request::reserved` (rows << 16 | columns), and a reply without error carries the
    /// terminal's master after the pidfd ("PTYs made inside the lease", above).
    flag_pty_lease = 1U << 2,
};

inline constexpr std::uint32_t adopt_magic = 0x53424144;    // "SBAD"
inline constexpr std::uint32_t welcome_magic = 0x53425745;  // "SBWE"

enum adopt_flags : std::uint32_t {
    adopt_end = 1U << 0,  ///< end the sandbox instead of serving this daemon
};

inline constexpr std::uint32_t hold_magic = 0x5342484C;     // "SBHL"
inline constexpr std::uint32_t release_magic = 0x5342524C;  // "SBRL"
inline constexpr std::uint32_t return_magic = 0x53425254;   // "SBRT"
/// The first version that serves `Held` packets.
inline constexpr std::uint32_t kept_channels_version = 3;
/// The first version that serves `flag_pty_lease`, and whose welcome carries /workspace.
inline constexpr std::uint32_t lease_pty_version = 4;
/// How long the supervisor waits for a channel's init to pass its terminal before it answers
/// ETIMEDOUT: well below the daemon's wait for a reply (10 s), so that a stuck init fails
/// one open rather than the whole sandbox.
inline constexpr int terminal_timeout_ms = 5000;
inline constexpr std::uint32_t workspace_welcome_version = 4;
inline constexpr std::size_t key_size = 32;  ///< NUL-padded; at most key_size - 1 bytes
inline constexpr std::size_t max_held = 4096;

/// The daemon's ends of a kept channel, in the order a `Held` packet carries them.
enum held_slot : std::uint32_t {
    slot_pidfd,        ///< the channel init's pidfd
    slot_stdin,        ///< the write end of stdin (under a PTY: the master)
    slot_stdout,       ///< the read end of stdout (under a PTY: a copy of the master)
    slot_stderr,       ///< the read end of stderr
    slot_status,       ///< the read end of the init's status pipe
    slot_control,      ///< the write end of the init's control pipe
    slot_relay_read,   ///< under a PTY: the pipe the master's output is moved into
    slot_relay_write,  ///< and its write end
    held_slots
};

/// A kept channel's packet (see "Kept channels" above); the same layout for its three uses.
struct Held {
    std::uint32_t magic = hold_magic;
    std::uint32_t mask = 0;  ///< bit i: slot i (held_slot) is carried, or to be closed
    char key[key_size] = {};
};

/// Daemon -> supervisor, the first packet on a connection to `listen_fd`. Its layout is fixed
/// for every version.
struct Adopt {
    std::uint32_t magic = adopt_magic;
    std::uint32_t flags = 0;
    std::uint32_t min_version = 0;  ///< the versions this daemon can serve a sandbox with
    std::uint32_t max_version = 0;
    unsigned char secret[secret_size] = {};
};

/// Supervisor -> daemon, the answer to an Adopt. Its layout is fixed for every version. With
/// error 0, SCM_RIGHTS carries a pidfd of the supervisor.
struct Welcome {
    std::uint32_t magic = welcome_magic;
    std::uint32_t version = 0;  ///< the supervisor's
    std::int32_t error = 0;     ///< 0, or EPROTONOSUPPORT
    std::uint32_t reserved = 0;
};

struct Request {
    std::uint32_t magic = request_magic;
    std::uint32_t flags = 0;
    std::uint64_t id = 0;        ///< echoed in the reply
    std::int32_t grace_ms = -1;  ///< drain grace after the main process ends; < 0: none
    std::uint32_t argc = 0;      ///< >= 1
    std::uint32_t envc = 0;
    std::uint32_t cgroup_fds = 0;    ///< <= max_cgroup_fds
    std::uint64_t open_files = 0;    ///< RLIMIT_NOFILE of the command; 0: inherited
    std::uint32_t payload_size = 0;  ///< <= max_payload: after the header, or in the memfd
    /// With flag_pty_lease: the terminal's window, rows << 16 | columns; else 0 (version 1..3
    /// read nothing here).
    std::uint32_t reserved = 0;
    /// CLOCK_MONOTONIC, ms: the channel is started only before it (else the reply's error is
    /// ETIMEDOUT and nothing runs); 0: no deadline. The daemon's fencing deadline (its last
    /// renewal + 2/3 of the node TTL): a daemon frozen between its checks and this request
    /// cannot start a command after another node may have taken the lease over. The clock is
    /// the daemon's too (no time namespace).
    std::int64_t start_deadline_ms = 0;
};

struct Reply {
    std::uint32_t magic = reply_magic;
    std::int32_t error = 0;  ///< 0, or the errno of what failed (the channel was not started)
    std::uint64_t id = 0;
};

}  // namespace sandboxd::supervisor
