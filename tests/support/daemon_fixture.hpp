#pragma once
// A real sandboxd process on 127.0.0.1:0 with its own temporary state directory, for the
// integration tests. Not thread-safe; one per test.
#include <sandboxd/client/client.hpp>

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd::test {

/// A directory under $TMPDIR removed (recursively) on destruction.
class TempDir {
public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::filesystem::path& path() const { return path_; }

private:
    std::filesystem::path path_;
};

/// The sandboxd binary that DaemonProcess starts: SANDBOXD_BIN unless set_daemon_binary()
/// named another. sandboxd finds sandboxd-init beside itself.
const std::string& daemon_binary();
/// Makes DaemonProcess start `path` from now on: a long run's own copy of the binaries, so
/// that rebuilding the tree under it (ld replaces the file) never meets a restart. Set it
/// before any daemon starts: not thread-safe against a launch.
void set_daemon_binary(std::string path);

class DaemonProcess {
public:
    enum class start_mode { wait_ready, no_wait };
    /// Starts the daemon and (start_mode::wait_ready) waits at most 30 s for its ready file.
    /// `config_json` is written to a file and passed with --config when not empty. `listen`
    /// is the --listen address (HOST:PORT; port 0 takes a free one, again on each restart).
    explicit DaemonProcess(std::string node_id = "node-a", std::string config_json = "",
                           std::vector<std::string> extra_args = {},
                           start_mode mode = start_mode::wait_ready,
                           std::string listen = "127.0.0.1:0");
    /// Waits for the ready file (then address() is set); false when it did not come within
    /// `timeout`. Throws std::runtime_error (with the log) when the daemon exits meanwhile.
    bool wait_ready(std::chrono::milliseconds timeout);
    /// Waits for the daemon to exit by itself: its exit status (-1 for a signal), or nullopt
    /// when it still runs after `timeout`.
    std::optional<int> wait_exit(std::chrono::milliseconds timeout);
    /// The address the daemon logged once bound ("bound HOST:PORT"), "" before.
    std::string bound_address() const;
    ~DaemonProcess();
    DaemonProcess(const DaemonProcess&) = delete;
    DaemonProcess& operator=(const DaemonProcess&) = delete;

    /// SIGTERM and wait (SIGKILL after 20 s); returns the exit status (-1 if killed).
    int stop();
    /// SIGKILL and reap.
    void kill9();
    /// Starts it again on the same state directory (and a new port).
    void restart();

    pid_t pid() const { return pid_; }
    const std::string& address() const { return address_; }
    std::string url() const { return "ws://" + address_ + "/v1/ws"; }
    std::string token() const;
    /// A token that may read GET /metrics: the first metrics- or peer-role token (with its
    /// secret inline) of the config, else the generated admin token (token()).
    std::string metrics_token() const;
    const std::filesystem::path& state_dir() const { return state_dir_; }
    std::string log() const;
    std::unique_ptr<Client> connect() const { return std::make_unique<Client>(url(), token()); }
    /// PIDs of the daemon's direct children (a bubblewrap per lease sandbox, plugin workers).
    std::vector<pid_t> children() const;
    /// PIDs of the channels' inits: the children of each lease sandbox's supervisor (itself
    /// the child of the daemon's bubblewrap child) but its warm init, which has taken no
    /// request (named "warm-init"). Empty when no channel process is left.
    std::vector<pid_t> channel_processes() const;
    /// PIDs of every descendant of the daemon (children, their children, ...), zombies included.
    std::vector<pid_t> descendants() const;
    /// True while the daemon process runs (not exited, not a zombie).
    bool alive() const;

    /// Resident set size (VmRSS) and its peak (VmHWM) of the daemon, KiB, from
    /// /proc/<pid>/status.
    long rss_kib() const;
    long peak_rss_kib() const;
    /// Entries of /proc/<pid>/fd, and what each one points to ("pipe:[..]", "/dev/ptmx").
    std::size_t fd_count() const;
    std::vector<std::string> fd_targets() const;
    /// RLIMIT_NOFILE (soft and hard) for the next start (restart()); 0 inherits the test's.
    void set_fd_limit_for_next_start(unsigned long limit) { fd_limit_ = limit; }
    /// The value of a sample in GET /metrics (e.g. "sandboxd_channels_running"), read with
    /// metrics_token(); -1 if absent.
    double metric(const std::string& name) const;
    /// From the next start (restart()) on, runs the daemon confined as systemd/sandboxd.service
    /// confines it, as far as a test can without systemd: in a mount namespace of its own
    /// (PrivateMounts=) whose /proc is a fresh instance with hidepid=invisible (ProtectProc=),
    /// with only the unit's capability bounding set, and under umask 0077 (UMask=).
    void confine_like_the_unit_for_next_start() { unit_confined_ = true; }

    /// The config (JSON) of the next start (restart()), as the constructor takes it.
    void set_config_for_next_start(std::string config_json) {
        config_json_ = std::move(config_json);
    }

    /// Asks every sandbox supervisor that this daemon's state left waiting for a daemon
    /// (providers.bwrap.adoptTimeoutMs > 0, after a stop or a kill) to end its sandbox, through
    /// its adoption socket with its secret (src/init/supervisor_protocol.hpp), and waits for
    /// each to go. Returns how many answered. For the destructor, and for tests that check
    /// what a supervisor does.
    std::size_t end_kept_sandboxes() const;

private:
    void launch(start_mode mode = start_mode::wait_ready);
    std::string node_id_;
    std::string config_json_;
    std::string listen_;
    std::vector<std::string> extra_args_;
    TempDir dir_;
    std::filesystem::path state_dir_;
    pid_t pid_ = -1;
    std::string address_;
    unsigned long fd_limit_ = 0;
    bool unit_confined_ = false;
};

/// Sets an environment variable (inherited by daemons started meanwhile) and restores it.
class ScopedEnv {
public:
    ScopedEnv(std::string name, const std::string& value);
    ~ScopedEnv();
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    std::string name_;
    bool had_ = false;
    std::string old_;
};

/// Whether a daemon's RSS says what it keeps. Not under ThreadSanitizer, whose shadow memory
/// makes RSS several times the heap: bounds on RSS are checked in the other builds (ASan with
/// its quarantine off, see measure_memory_env(), and release).
#if defined(__SANITIZE_THREAD__)
inline constexpr bool rss_is_meaningful = false;
#else
inline constexpr bool rss_is_meaningful = true;
#endif

/// For tests that measure a daemon's RSS: ASAN_OPTIONS (the current ones, if any) with
/// AddressSanitizer's quarantine off, so that RSS shows what the daemon keeps, not the freed
/// memory that ASan holds back (up to 256 MiB by default) to catch use-after-free.
ScopedEnv measure_memory_env();

/// The capability names that confine_like_the_unit_for_next_start() keeps in the bounding set
/// ("CAP_SYS_ADMIN", ...), in no particular order.
std::vector<std::string> unit_capability_names();

/// Waits until `pred` holds or `timeout` passes; returns whether it held.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout);

/// PIDs of the children of every thread of `pid`, from /proc/<pid>/task/*/children (zombies
/// included).
std::vector<pid_t> children_of_every_thread(pid_t pid);
/// PIDs of every descendant of `pid`, from /proc/<pid>/task/*/children (zombies included).
std::vector<pid_t> descendants_of(pid_t pid);

/// The process scans below look only at this test process's own tree (descendants_of(getpid()):
/// the daemons it started, their sandboxes, and orphans of them, which a child subreaper keeps),
/// never at the other processes of the machine.
/// Number of this test's processes whose command line starts with `needle`.
int count_processes_with(const std::string& needle);
/// Number of this test's processes whose command line (arguments joined by spaces) is `command`.
int count_processes_exactly(const std::string& command);
/// PIDs of this test's processes whose command line starts with `needle`.
std::vector<pid_t> pids_with(const std::string& needle);
/// A "Name:" field of /proc/<pid>/status as a number (e.g. "VmRSS" in KiB); -1 if absent.
long proc_status_field(pid_t pid, const std::string& name);
/// A field of /proc/<pid>/io (e.g. "wchar"); -1 if absent.
long long proc_io_field(pid_t pid, const std::string& name);
/// The capacity of the pipe that is `fd` of process `pid` (F_GETPIPE_SZ), or -1.
long long pipe_capacity(pid_t pid, int fd);
/// The whole of a small /proc file, or "" when it cannot be read. Plain read(2): a process
/// that exits meanwhile makes the read fail with ESRCH, which libstdc++'s filebuf reports by
/// throwing from underflow() whatever the stream's exception mask (so never read /proc of
/// another process with std::ifstream).
std::string read_proc_file(const std::filesystem::path& path);
/// The one-letter state of /proc/<pid>/stat ('R', 'S', 'Z', ...); 0 if gone.
char proc_state(pid_t pid);

/// leaseAcquire of a bwrap lease for companyId "acme", environmentId "dev".
nlohmann::json acquire_lease(Client& c);

/// leaseAcquire of the reference plugin (provider "process") for `company`/dev, retried while
/// its worker starts (PROVIDER_NOT_READY), for at most `limit`; any other error is thrown.
nlohmann::json acquire_plugin_lease(Client& c, const std::string& company = "acme",
                                    std::chrono::seconds limit = std::chrono::seconds(30));

/// The `reason` of the error that `method` answers, "ok" when it succeeds.
std::string error_reason(Client& c, const std::string& method, const nlohmann::json& params);

/// What leaseExecute answered and the leaseExecute.log notifications of its request that came
/// before the answer (each {stream, chunk}, in order).
struct ExecuteRun {
    nlohmann::json result;
    std::vector<nlohmann::json> logs;
    std::string logged(const std::string& stream) const;  ///< the chunks of `stream`, joined
};
/// leaseExecute with `params`; throws rpc_error for an error answer. Other messages that came
/// before the answer stay queued for next_event().
ExecuteRun execute(Client& c, const nlohmann::json& params);

/// The `lease` object of a duplexChannelOpen for `lease` (as returned by leaseAcquire).
nlohmann::json lease_ref(const nlohmann::json& lease);

/// Open params running `argv` on `lease`.
nlohmann::json open_params(const nlohmann::json& lease, std::vector<std::string> argv);

/// Opens `touch refused` on a plugin `lease` once with each open field the plugin protocol
/// cannot carry (pty, cwd, env, stdin: false). Returns the fields whose open was not
/// INVALID_PARAMS naming that field (empty when all were refused as they must be).
std::vector<std::string> plugin_fields_not_refused(Client& c, const nlohmann::json& lease);

/// The tokens of tests that need both roles: `auth` with "host" (host-secret) and "peer"
/// (peer-secret), both for every tenant.
inline const std::string test_host_token = "host-secret";
inline const std::string test_peer_token = "peer-secret";
nlohmann::json host_and_peer_tokens();

/// Raw HTTP GET on the daemon's port (`address` is host:port), with `headers` added: status
/// and body.
std::pair<int, std::string> http_get(
    const std::string& address, const std::string& target, const std::string& authorization = "",
    bool upgrade = false, const std::vector<std::pair<std::string, std::string>>& headers = {});
/// Raw HTTP POST with an empty body: status and body.
std::pair<int, std::string> http_post(const std::string& address, const std::string& target,
                                      const std::string& authorization = "");

}  // namespace sandboxd::test

#include "support/daemon_fixture_impl.hpp"
