// The reference plugin worker of sandboxd (docs/plugins.md): runs each channel's command as
// a local process in a per-lease directory under $PROCESS_PLUGIN_ROOT. No isolation beyond
// the directory: use it where bubblewrap is not wanted, and as the model for provider authors.
//
// One thread, one poll() loop. JSON-RPC 2.0, one object per line: requests on stdin, answers
// and notifications on stdout; diagnostics on stderr (the daemon logs them).
//
// Environment:
//   PROCESS_PLUGIN_ROOT        required: leases live in <root>/<providerLeaseId>/
//   PROCESS_PLUGIN_TEST_HOOKS  "1" enables the test hooks below (never in production)
//   PROCESS_PLUGIN_FAIL_FILE   with hooks: if this file exists at start, exit 3 at once
//   PROCESS_PLUGIN_DESTROY_HOLD_FILE with hooks: while this file exists, environmentDestroyLease
//                              waits (at most 60 s) before it destroys: a teardown that hangs.
//                              The worker serves nothing else meanwhile (one thread).
//   PROCESS_PLUGIN_TEST_NO_CHANNELS  with hooks, when set: supportedMethods lists no
//                              duplexChannel* method (a lease-only worker)
// Test hooks (only with PROCESS_PLUGIN_TEST_HOOKS=1), chosen by the command's argv[0]:
//   __forge_frame__ [cross|unknown]  answers the open, then sends a duplexChannel.data
//       ("FORGED") for a pair that is not its own: "cross" (default) pairs another live
//       channel's hostRouteId with this channel's workerSessionId; "unknown" invents both.
//       Then it runs `sleep 60`.
//   __duplicate_reply__              answers the open twice, then runs `sleep 60`.
//   __slow_open__ <ms> <command...>  answers the open only after <ms> milliseconds (the
//       whole worker waits, as a slow provider would), then runs <command...>.

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef P_PIDFD
// glibc 2.36 lacks it; waitid() takes it as idtype_t.
// NOLINTNEXTLINE(cppcoreguidelines-macro-usage)
#define P_PIDFD 3
#endif

extern char** environ;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using sandboxd::base64_decode;
using sandboxd::base64_encode;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds drain_grace{250};
constexpr std::size_t read_chunk = 64 * 1024;
constexpr std::size_t max_stdin_queue = 4U << 20;

// --- output ---

void write_all(int fd, std::string_view s) {
    while (!s.empty()) {
        ssize_t n = ::write(fd, s.data(), s.size());
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                pollfd p{fd, POLLOUT, 0};
                ::poll(&p, 1, -1);
                continue;
            }
            std::_Exit(1);  // the daemon is gone
        }
        s.remove_prefix(static_cast<std::size_t>(n));
    }
}

void emit(const json& msg) { write_all(1, msg.dump() + "\n"); }

void reply(const json& id, json result) {
    write_all(1, sandboxd::jsonrpc::result(id, std::move(result)) + "\n");
}

void reply_error(const json& id, int code, const std::string& message) {
    write_all(1, sandboxd::jsonrpc::error(id, {{"code", code}, {"message", message}}) + "\n");
}

void log_line(const std::string& line) { write_all(2, line + "\n"); }

struct Failure {  // an error answer
    int code;
    std::string message;
};

[[noreturn]] void fail(int code, std::string message) { throw Failure{code, std::move(message)}; }

std::string random_hex(std::size_t bytes) {
    std::string raw(bytes, '\0');
    std::size_t got = 0;
    while (got < bytes) {
        ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
        if (n > 0) got += static_cast<std::size_t>(n);
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (char c : raw) {
        out.push_back(digits[static_cast<unsigned char>(c) >> 4]);
        out.push_back(digits[static_cast<unsigned char>(c) & 15]);
    }
    return out;
}

const std::map<std::string, int>& signal_numbers() {
    static const std::map<std::string, int> m = {
        {"INT", SIGINT},   {"TERM", SIGTERM}, {"HUP", SIGHUP},   {"QUIT", SIGQUIT},
        {"KILL", SIGKILL}, {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"WINCH", SIGWINCH}};
    return m;
}

std::string signal_name(int sig) {
    static const std::map<int, std::string> m = {
        {SIGHUP, "HUP"},   {SIGINT, "INT"},   {SIGQUIT, "QUIT"},  {SIGILL, "ILL"},
        {SIGTRAP, "TRAP"}, {SIGABRT, "ABRT"}, {SIGBUS, "BUS"},    {SIGFPE, "FPE"},
        {SIGKILL, "KILL"}, {SIGUSR1, "USR1"}, {SIGSEGV, "SEGV"},  {SIGUSR2, "USR2"},
        {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"}, {SIGTERM, "TERM"},  {SIGXCPU, "XCPU"},
        {SIGXFSZ, "XFSZ"}, {SIGSYS, "SYS"},   {SIGWINCH, "WINCH"}};
    auto it = m.find(sig);
    return it == m.end() ? "SIG" + std::to_string(sig) : it->second;
}

// --- state ---

struct Session {
    std::string id;             // workerSessionId
    std::string host_route_id;  // the daemon's id, echoed on every frame
    std::string provider_lease_id;
    pid_t pid = -1;
    int pidfd = -1;
    int in_fd = -1, out_fd = -1, err_fd = -1;
    std::string stdin_queue;
    std::vector<json> write_ids;  // duplexChannelWrite requests answered once written
    bool close_stdin = false;
    bool reaped = false;
    int status = 0;
    Clock::time_point drain_deadline;
    bool exit_sent = false;
};

class Worker {
public:
    explicit Worker(fs::path root, bool hooks) : root_(std::move(root)), hooks_(hooks) {}
    int run();

private:
    void handle_line(const std::string& line);
    json dispatch(const std::string& method, const json& params, const json& id, bool& answered);
    json acquire(const json& p);
    json release(const json& p, bool destroy);
    json open(const json& p, const json& id, bool& answered);
    Session& session_of(const json& p);
    void start_process(Session& s, const std::vector<std::string>& argv, const fs::path& dir,
                       const std::map<std::string, std::string>& env);
    /// Forwards one read of `fd`; false when nothing more is there now (EAGAIN, or EOF: closed).
    bool on_readable(Session& s, int& fd, const char* stream);
    void flush_stdin(Session& s);
    void finish_stdin(Session& s);
    void reap(Session& s);
    void maybe_exit(Session& s);
    void kill_session(Session& s, int sig);
    void close_fd(int& fd) {
        if (fd >= 0) ::close(fd);
        fd = -1;
    }
    fs::path lease_dir(const std::string& id) const;
    json lease_record(const json& p) const;

    fs::path root_;
    bool hooks_;
    std::map<std::string, std::unique_ptr<Session>> sessions_;
    std::uint64_t next_session_ = 1;
    std::string inbuf_;
    bool shutting_down_ = false;
};

std::string str_param(const json& p, const char* key) {
    if (!p.is_object() || !p.contains(key) || !p[key].is_string() ||
        p[key].get<std::string>().empty()) {
        fail(-32602, std::string(key) + ": must be a non-empty string");
    }
    return p[key].get<std::string>();
}

fs::path Worker::lease_dir(const std::string& id) const {
    // Only ids this worker mints name a directory ("proc-" and 16 hex digits).
    if (id.size() != 21 || id.rfind("proc-", 0) != 0 ||
        id.find_first_not_of("0123456789abcdef", 5) != std::string::npos) {
        fail(-32012, "no such lease");
    }
    return root_ / id;
}

json Worker::lease_record(const json& p) const {
    const auto dir = lease_dir(str_param(p, "providerLeaseId"));
    std::ifstream in(dir / "lease.json");
    json rec = json::parse(in, nullptr, false);
    // Another tenant's lease is reported exactly like a missing one.
    if (rec.is_discarded() || !rec.is_object() ||
        rec.value("companyId", "") != str_param(p, "companyId") ||
        rec.value("environmentId", "") != str_param(p, "environmentId") ||
        rec.value("driverKey", "") != p.value("driverKey", rec.value("driverKey", ""))) {
        fail(-32012, "no such lease");
    }
    return rec;
}

json Worker::acquire(const json& p) {
    json rec = {{"companyId", str_param(p, "companyId")},
                {"environmentId", str_param(p, "environmentId")},
                {"driverKey", p.value("driverKey", "")},
                {"runId", p.value("runId", "")}};
    if (p.contains("config") && !p["config"].is_null()) {
        if (!p["config"].is_object()) fail(-32602, "config: must be an object");
        for (const auto& [k, v] : p["config"].items())
            fail(-32602, "config." + k + ": unknown key");
    }
    for (int attempt = 0; attempt < 8; ++attempt) {
        const std::string id = "proc-" + random_hex(8);
        const fs::path dir = root_ / id;
        std::error_code ec;
        if (!fs::create_directory(dir, ec)) {
            if (ec) fail(-32000, "cannot create " + dir.string() + ": " + ec.message());
            continue;  // taken
        }
        fs::create_directory(dir / "workspace", ec);
        if (ec) fail(-32000, "cannot create the workspace: " + ec.message());
        {
            std::ofstream out(dir / "lease.json.tmp");
            out << rec.dump() << "\n";
            if (!out) fail(-32000, "cannot write the lease record");
        }
        fs::rename(dir / "lease.json.tmp", dir / "lease.json", ec);
        if (ec) fail(-32000, "cannot write the lease record: " + ec.message());
        log_line("acquired " + id + " for " + rec["companyId"].get<std::string>());
        return {{"providerLeaseId", id}};
    }
    fail(-32000, "cannot mint a lease id");
}

json Worker::release(const json& p, bool destroy) {
    const std::string id = str_param(p, "providerLeaseId");
    fs::path dir;
    try {
        dir = lease_dir(id);
    } catch (const Failure&) {
        return json::object();  // never ours: nothing to release
    }
    std::error_code ec;
    if (!fs::exists(dir, ec)) return json::object();  // idempotent
    lease_record(p);                                  // the scope must match
    for (auto& [sid, s] : sessions_) {
        if (s->provider_lease_id == id && !s->reaped) kill_session(*s, SIGKILL);
    }
    if (destroy) {
        const char* hold = hooks_ ? std::getenv("PROCESS_PLUGIN_DESTROY_HOLD_FILE") : nullptr;
        if (hold != nullptr && fs::exists(hold, ec)) {
            log_line("holding destroy " + id);
            const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
            while (fs::exists(hold, ec) && std::chrono::steady_clock::now() < limit) {
                ::poll(nullptr, 0, 10);  // a test hook: the test removes the file to release it
            }
        }
        fs::remove_all(dir, ec);
        if (ec) fail(-32000, "cannot remove " + dir.string() + ": " + ec.message());
        log_line("destroyed " + id);
    }
    return json::object();
}

void Worker::start_process(Session& s, const std::vector<std::string>& argv, const fs::path& dir,
                           const std::map<std::string, std::string>& env) {
    int in[2], out[2], err[2];
    if (::pipe2(in, O_CLOEXEC) < 0 || ::pipe2(out, O_CLOEXEC) < 0 || ::pipe2(err, O_CLOEXEC) < 0) {
        fail(-32000, std::string("cannot create pipes: ") + std::strerror(errno));
    }
    std::vector<std::string> envs = {"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir.string(),
                                     "LANG=C.UTF-8", "TERM=dumb"};
    for (const auto& [k, v] : env) envs.push_back(std::string(k).append("=").append(v));
    std::vector<char*> envp, args;
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (auto& a : argv_copy) args.push_back(a.data());
    args.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) fail(-32000, std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
        // The command dies with this worker, and gets its own process group for signals.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(127);
        ::setpgid(0, 0);
        ::dup2(in[0], 0);
        ::dup2(out[1], 1);
        ::dup2(err[1], 2);
        ::syscall(SYS_close_range, 3U, ~0U, 0U);
        sigset_t none;
        ::sigemptyset(&none);
        ::sigprocmask(SIG_SETMASK, &none, nullptr);
        ::signal(SIGPIPE, SIG_DFL);
        if (::chdir(dir.c_str()) != 0) {
            std::string msg =
                "worker: cannot enter " + dir.string() + ": " + std::strerror(errno) + "\n";
            (void)!::write(2, msg.data(), msg.size());
            ::_exit(127);
        }
        environ = envp.data();
        ::execvp(args[0], args.data());
        std::string msg = "worker: cannot run " + argv[0] + ": " + std::strerror(errno) + "\n";
        (void)!::write(2, msg.data(), msg.size());
        ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no signal may race the child's own setpgid
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    s.pid = pid;
    s.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    s.in_fd = in[1];
    s.out_fd = out[0];
    s.err_fd = err[0];
    for (int fd : {s.in_fd, s.out_fd, s.err_fd})
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

json Worker::open(const json& p, const json& id, bool& answered) {
    const std::string route = str_param(p, "hostRouteId");
    const json rec = lease_record(p);
    const std::string lease = p["providerLeaseId"].get<std::string>();
    if (!p.contains("command") || !p["command"].is_array() || p["command"].empty()) {
        fail(-32602, "command: must be a non-empty array of strings");
    }
    std::vector<std::string> argv;
    for (const auto& a : p["command"]) {
        if (!a.is_string()) fail(-32602, "command: must be a non-empty array of strings");
        argv.push_back(a.get<std::string>());
    }
    std::map<std::string, std::string> env;
    if (p.contains("env") && p["env"].is_object()) {
        for (const auto& [k, v] : p["env"].items()) {
            if (v.is_string()) env[k] = v.get<std::string>();
        }
    }
    fs::path dir = lease_dir(lease) / "workspace";
    if (p.contains("cwd") && p["cwd"].is_string() && !p["cwd"].get<std::string>().empty()) {
        const std::string cwd = p["cwd"].get<std::string>();
        dir = cwd.front() == '/' ? fs::path(cwd) : dir / cwd;
    }

    auto s = std::make_unique<Session>();
    s->id = "ws-" + std::to_string(next_session_++) + "-" + random_hex(4);
    s->host_route_id = route;
    s->provider_lease_id = lease;

    std::optional<json> forged;
    bool duplicate = false;
    if (hooks_ && argv[0] == "__forge_frame__") {
        const std::string mode = argv.size() > 1 ? argv[1] : "cross";
        std::string other_route = "no-such-route";
        for (const auto& [sid, other] : sessions_) {
            if (!other->exit_sent) other_route = other->host_route_id;
        }
        const std::string session = mode == "unknown" ? "no-such-session" : s->id;
        if (mode == "unknown") other_route = "no-such-route";
        forged = json{{"jsonrpc", "2.0"},
                      {"method", "duplexChannel.data"},
                      {"params",
                       {{"hostRouteId", other_route},
                        {"workerSessionId", session},
                        {"stream", "stdout"},
                        {"chunk", base64_encode("FORGED")}}}};
        argv = {"sleep", "60"};
    } else if (hooks_ && argv[0] == "__duplicate_reply__") {
        duplicate = true;
        argv = {"sleep", "60"};
    }
    if (hooks_ && argv[0] == "__slow_open__" && argv.size() > 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::stoul(argv[1])));
        argv.erase(argv.begin(), argv.begin() + 2);
    }

    start_process(*s, argv, dir, env);
    // The answer goes out before any frame of the session: the daemon routes frames only to
    // sessions it has been told about.
    json result = {{"hostRouteId", route}, {"workerSessionId", s->id}};
    reply(id, result);
    answered = true;
    if (duplicate) reply(id, result);
    if (forged) emit(*forged);
    log_line("session " + s->id + " route " + route + " runs " + argv[0] + " (lease " + lease +
             ", company " + rec.value("companyId", "") + ")");
    sessions_.emplace(s->id, std::move(s));
    return json();
}

Session& Worker::session_of(const json& p) {
    const std::string route = str_param(p, "hostRouteId");
    const std::string sid = str_param(p, "workerSessionId");
    auto it = sessions_.find(sid);
    // Both ids must match: a pair is the only key.
    if (it == sessions_.end() || it->second->host_route_id != route)
        fail(-32019, "no such session");
    return *it->second;
}

void Worker::kill_session(Session& s, int sig) {
    if (s.reaped) return;
    ::kill(-s.pid, sig);
    ::kill(s.pid, sig);
}

json Worker::dispatch(const std::string& method, const json& p, const json& id, bool& answered) {
    if (method == "initialize") {
        json methods = {"shutdown", "environmentAcquireLease", "environmentResumeLease",
                        "environmentReleaseLease", "environmentDestroyLease"};
        if (!(hooks_ && std::getenv("PROCESS_PLUGIN_TEST_NO_CHANNELS"))) {
            for (const char* m :
                 {"duplexChannelOpen", "duplexChannelWrite", "duplexChannelCloseStdin",
                  "duplexChannelSignal", "duplexChannelStop", "duplexChannelClose"}) {
                methods.push_back(m);
            }
        }
        return {{"ok", true}, {"supportedMethods", methods}};
    }
    if (method == "shutdown") {
        shutting_down_ = true;
        return json::object();
    }
    if (method == "environmentAcquireLease") return acquire(p);
    if (method == "environmentResumeLease") {
        // Leases live on disk: resuming one is finding it, in the caller's scope.
        lease_record(p);
        return {{"providerLeaseId", str_param(p, "providerLeaseId")}};
    }
    if (method == "environmentReleaseLease") return release(p, false);
    if (method == "environmentDestroyLease") return release(p, true);
    if (method == "duplexChannelOpen") return open(p, id, answered);
    if (method == "duplexChannelWrite") {
        Session& s = session_of(p);
        std::string data;
        try {
            data = base64_decode(str_param(p, "data"));
        } catch (const sandboxd::base64_error&) {
            fail(-32602, "data: not base64");
        }
        if (s.in_fd < 0 || s.close_stdin) fail(-32000, "stdin is closed");
        if (s.stdin_queue.size() + data.size() > max_stdin_queue) fail(-32000, "stdin queue full");
        s.stdin_queue += data;
        s.write_ids.push_back(id);  // answered once written
        answered = true;
        flush_stdin(s);
        return json();
    }
    if (method == "duplexChannelCloseStdin") {
        Session& s = session_of(p);
        s.close_stdin = true;
        flush_stdin(s);
        return json::object();
    }
    if (method == "duplexChannelSignal") {
        Session& s = session_of(p);
        auto it = signal_numbers().find(str_param(p, "signal"));
        if (it == signal_numbers().end()) fail(-32602, "signal: unknown name");
        kill_session(s, it->second);
        return json::object();
    }
    if (method == "duplexChannelStop") {
        kill_session(session_of(p), SIGKILL);
        return json::object();
    }
    if (method == "duplexChannelClose") {
        Session& s = session_of(p);
        if (!s.reaped) {
            kill_session(s, SIGKILL);
            ::waitpid(s.pid, nullptr, 0);
            s.reaped = true;
        }
        close_fd(s.in_fd);
        close_fd(s.out_fd);
        close_fd(s.err_fd);
        close_fd(s.pidfd);
        sessions_.erase(s.id);  // no exit follows
        return json::object();
    }
    fail(-32601, "Method not found: " + method);
}

void Worker::handle_line(const std::string& line) {
    json msg = json::parse(line, nullptr, false);
    if (msg.is_discarded() || !msg.is_object() || !msg.contains("method") ||
        !msg["method"].is_string()) {
        log_line("ignored a line that is not a JSON-RPC request");
        return;
    }
    const json id = msg.value("id", json());
    const json params = msg.value("params", json::object());
    bool answered = false;
    try {
        json result = dispatch(msg["method"].get<std::string>(), params, id, answered);
        if (!answered && !id.is_null()) reply(id, std::move(result));
    } catch (const Failure& f) {
        if (!answered && !id.is_null()) reply_error(id, f.code, f.message);
    } catch (const std::exception& e) {
        if (!answered && !id.is_null()) reply_error(id, -32000, e.what());
    }
}

void Worker::flush_stdin(Session& s) {
    while (s.in_fd >= 0 && !s.stdin_queue.empty()) {
        ssize_t n = ::write(s.in_fd, s.stdin_queue.data(), s.stdin_queue.size());
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;  // poll says when to go on
            // EPIPE: the command no longer reads stdin; what is queued is dropped.
            for (const auto& wid : s.write_ids) reply_error(wid, -32000, "stdin is closed");
            s.write_ids.clear();
            s.stdin_queue.clear();
            close_fd(s.in_fd);
            return;
        }
        s.stdin_queue.erase(0, static_cast<std::size_t>(n));
    }
    if (s.stdin_queue.empty()) {
        for (const auto& wid : s.write_ids) reply(wid, json::object());
        s.write_ids.clear();
        if (s.close_stdin) close_fd(s.in_fd);
    }
}

bool Worker::on_readable(Session& s, int& fd, const char* stream) {
    std::string buf(read_chunk, '\0');
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) return true;
    if (n < 0 && errno == EAGAIN) return false;
    if (n <= 0) {
        close_fd(fd);
        return false;
    }
    buf.resize(static_cast<std::size_t>(n));
    write_all(
        1, sandboxd::jsonrpc::notification("duplexChannel.data", {{"hostRouteId", s.host_route_id},
                                                                  {"workerSessionId", s.id},
                                                                  {"stream", stream},
                                                                  {"chunk", base64_encode(buf)}}) +
               "\n");
    return true;
}

void Worker::reap(Session& s) {
    siginfo_t info{};
    if (::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(s.pidfd), &info,
                 WEXITED | WNOHANG) != 0 ||
        info.si_pid == 0) {
        return;
    }
    s.reaped = true;
    s.status = info.si_code == CLD_EXITED ? (info.si_status & 0xff) : -info.si_status;
    s.drain_deadline = Clock::now() + drain_grace;
    close_fd(s.pidfd);
}

void Worker::maybe_exit(Session& s) {
    if (!s.reaped || s.exit_sent) return;
    if ((s.out_fd >= 0 || s.err_fd >= 0) && Clock::now() < s.drain_deadline) return;
    // What is already in the pipes goes out first; descendants that still hold them are
    // ended with the channel.
    while (s.out_fd >= 0 && on_readable(s, s.out_fd, "stdout")) {
    }
    while (s.err_fd >= 0 && on_readable(s, s.err_fd, "stderr")) {
    }
    ::kill(-s.pid, SIGKILL);
    close_fd(s.out_fd);
    close_fd(s.err_fd);
    close_fd(s.in_fd);
    for (const auto& wid : s.write_ids) reply_error(wid, -32000, "stdin is closed");
    s.write_ids.clear();
    json p = {{"hostRouteId", s.host_route_id}, {"workerSessionId", s.id}};
    if (s.status >= 0) {
        p["exitCode"] = s.status;
    } else {
        p["exitCode"] = nullptr;
        p["signal"] = signal_name(-s.status);
    }
    write_all(1, sandboxd::jsonrpc::notification("duplexChannel.exit", p) + "\n");
    s.exit_sent = true;  // kept until duplexChannelClose
}

int Worker::run() {
    ::fcntl(0, F_SETFL, ::fcntl(0, F_GETFL) | O_NONBLOCK);
    for (;;) {
        std::vector<pollfd> fds;
        std::vector<std::pair<Session*, int*>> owners;  // per fd: its session and slot
        fds.push_back({0, POLLIN, 0});
        owners.emplace_back(nullptr, nullptr);
        int timeout = -1;
        const auto now = Clock::now();
        for (auto& [sid, s] : sessions_) {
            for (int* slot : {&s->out_fd, &s->err_fd, &s->pidfd}) {
                if (*slot >= 0) {
                    fds.push_back({*slot, POLLIN, 0});
                    owners.emplace_back(s.get(), slot);
                }
            }
            if (s->in_fd >= 0 && !s->stdin_queue.empty()) {
                fds.push_back({s->in_fd, POLLOUT, 0});
                owners.emplace_back(s.get(), &s->in_fd);
            }
            if (s->reaped && !s->exit_sent) {
                auto left =
                    std::chrono::duration_cast<std::chrono::milliseconds>(s->drain_deadline - now)
                        .count();
                left = std::max<long long>(left, 0) + 1;
                if (timeout < 0 || left < timeout) timeout = static_cast<int>(left);
            }
        }
        if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) return 1;
        for (std::size_t i = 1; i < fds.size(); ++i) {
            if (!fds[i].revents) continue;
            auto [s, slot] = owners[i];
            if (*slot != fds[i].fd) continue;  // closed meanwhile
            if (slot == &s->pidfd)
                reap(*s);
            else if (slot == &s->in_fd)
                flush_stdin(*s);
            else
                on_readable(*s, *slot, slot == &s->out_fd ? "stdout" : "stderr");
        }
        for (auto& [sid, s] : sessions_) maybe_exit(*s);
        if (fds[0].revents) {
            char buf[65536];
            ssize_t n = ::read(0, buf, sizeof buf);
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
                shutting_down_ = true;  // the daemon is gone
            } else if (n > 0) {
                inbuf_.append(buf, static_cast<std::size_t>(n));
                std::size_t pos = 0;
                while ((pos = inbuf_.find('\n')) != std::string::npos) {
                    std::string line = inbuf_.substr(0, pos);
                    inbuf_.erase(0, pos + 1);
                    handle_line(line);
                }
            }
        }
        if (shutting_down_) {
            for (auto& [sid, s] : sessions_) kill_session(*s, SIGKILL);
            return 0;
        }
    }
}

}  // namespace

int main() {
    // A worker that fails says why on stderr (the daemon logs it) and exits 1.
    try {
        std::signal(SIGPIPE, SIG_IGN);
        const char* hooks_env = std::getenv("PROCESS_PLUGIN_TEST_HOOKS");
        const bool hooks = hooks_env && std::string(hooks_env) == "1";
        if (hooks) {
            const char* fail_file = std::getenv("PROCESS_PLUGIN_FAIL_FILE");
            if (fail_file && *fail_file && ::access(fail_file, F_OK) == 0) {
                log_line("test hook: " + std::string(fail_file) + " exists; exiting");
                return 3;
            }
        }
        const char* root = std::getenv("PROCESS_PLUGIN_ROOT");
        if (!root || !*root) {
            log_line("PROCESS_PLUGIN_ROOT must name the directory that holds the leases");
            return 2;
        }
        std::error_code ec;
        fs::create_directories(root, ec);
        if (ec) {
            log_line(std::string("cannot create ") + root + ": " + ec.message());
            return 2;
        }
        log_line(std::string("process plugin worker ready; leases under ") + root +
                 (hooks ? " (test hooks enabled)" : ""));
        return Worker(root, hooks).run();
    } catch (const std::exception& e) {
        log_line(std::string("process plugin worker failed: ") + e.what());
        return 1;
    }
}
