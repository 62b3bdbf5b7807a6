#include "support/daemon_fixture.hpp"

#include "init/supervisor_protocol.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace sandboxd::test {
namespace fs = std::filesystem;

std::string read_proc_file(const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return {};
    std::string out;
    char buf[4096];
    for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n <= 0) break;
        out.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
    return out;
}

TempDir::TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/sandboxd-test.XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
}

TempDir::~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
}

namespace {

/// Tests stop their daemons with SIGTERM: without a limits.drainTimeoutMs of their own, the
/// drain is 0 (its 30 s default would hold every stop with a channel left running). A config
/// that does not parse is passed on unchanged (the tests of bad configs).
///
/// Likewise their sandboxes end with their daemon (providers.bwrap.adoptTimeoutMs 0) unless
/// the test's config says otherwise: only the tests of restarts (adopt_test.cpp) keep them.
std::string with_test_drain(const std::string& config_json) {
    // Bounded like the daemon's own parse: a config nested too deep (a test of that) is
    // written as it is, never walked here.
    auto config = config_json.empty()
                      ? nlohmann::json::object()
                      : try_parse_json(config_json, {/*ignore_comments=*/true}).value;
    if (!config.is_object()) return config_json;
    bool changed = false;
    auto& limits = config["limits"];
    if (limits.is_null()) limits = nlohmann::json::object();
    if (limits.is_object() && !limits.contains("drainTimeoutMs")) {
        limits["drainTimeoutMs"] = 0;
        changed = true;
    }
    auto& providers = config["providers"];
    if (providers.is_null()) providers = nlohmann::json::object();
    if (providers.is_object()) {
        auto& bwrap = providers["bwrap"];
        if (bwrap.is_null()) bwrap = nlohmann::json::object();
        if (bwrap.is_object() && !bwrap.contains("adoptTimeoutMs")) {
            bwrap["adoptTimeoutMs"] = 0;
            changed = true;
        }
    }
    return changed ? config.dump() : config_json;
}

}  // namespace

DaemonProcess::DaemonProcess(std::string node_id, std::string config_json,
                             std::vector<std::string> extra_args, start_mode mode,
                             std::string listen)
    : node_id_(std::move(node_id)),
      config_json_(std::move(config_json)),
      listen_(std::move(listen)),
      extra_args_(std::move(extra_args)),
      state_dir_(dir_.path() / "state") {
    launch(mode);
}

DaemonProcess::~DaemonProcess() {
    if (pid_ > 0) stop();
    // A daemon whose sandboxes outlive it (adopt_test.cpp) leaves them waiting for the next
    // process: each is asked to end through its own adoption socket, as a daemon would.
    end_kept_sandboxes();
    // A daemon killed with SIGKILL (and not restarted) leaves its sandboxes' disks mounted
    // under its runtime directory, which a restart would unmount; nothing will restart it.
    std::error_code ec;
    const auto runtime = fs::read_symlink(state_dir_ / "sandboxes" / ".runtime", ec);
    if (ec || runtime.empty()) return;
    for (const auto& entry : fs::directory_iterator(runtime, ec)) {
        const auto name = entry.path().filename().string();
        // The tmpfs mounts of the generated /etc and the init's copy, too.
        if (name == ".etc" || name == ".init") ::umount2(entry.path().c_str(), MNT_DETACH);
        if (name.rfind("bw-", 0) != 0) continue;
        ::umount2((entry.path() / "workspace").c_str(), MNT_DETACH);
    }
    fs::remove_all(runtime, ec);
}

namespace {

/// The capabilities that systemd/*.service keep (CapabilityBoundingSet=); the operations test
/// checks this list against the unit file.
struct KeptCapability {
    const char* name;
    int value;
};
constexpr KeptCapability unit_capabilities[] = {{"CAP_SYS_ADMIN", CAP_SYS_ADMIN},
                                                {"CAP_SETUID", CAP_SETUID},
                                                {"CAP_SETGID", CAP_SETGID},
                                                {"CAP_CHOWN", CAP_CHOWN},
                                                {"CAP_DAC_OVERRIDE", CAP_DAC_OVERRIDE},
                                                {"CAP_FOWNER", CAP_FOWNER},
                                                {"CAP_KILL", CAP_KILL}};

/// In the forked child before the exec: what DaemonProcess::confine_like_the_unit_for_next_start
/// promises. No allocation here: the test process may have other threads.
bool confine_like_the_unit() {
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible") !=
            0) {
        return false;
    }
    for (int cap = 0; cap <= CAP_LAST_CAP; ++cap) {
        const bool kept = std::any_of(std::begin(unit_capabilities), std::end(unit_capabilities),
                                      [cap](const KeptCapability& k) { return k.value == cap; });
        if (!kept && ::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) return false;
    }
    ::umask(077);
    return true;
}

}  // namespace

std::vector<std::string> unit_capability_names() {
    std::vector<std::string> out;
    for (const auto& k : unit_capabilities) out.emplace_back(k.name);
    return out;
}

namespace {
std::string& daemon_binary_path() {
    static std::string path = SANDBOXD_BIN;
    return path;
}
}  // namespace

const std::string& daemon_binary() { return daemon_binary_path(); }

void set_daemon_binary(std::string path) { daemon_binary_path() = std::move(path); }

void DaemonProcess::launch(start_mode mode) {
    const auto ready = dir_.path() / "ready";
    fs::remove(ready);
    std::vector<std::string> args = {daemon_binary(), "--state-dir", state_dir_.string(),
                                     "--listen",      listen_,       "--ready-file",
                                     ready.string(),  "--node-id",   node_id_,
                                     "--log-level",   "debug"};
    {
        const auto cfg = dir_.path() / "config.json";
        std::ofstream(cfg) << with_test_drain(config_json_);
        args.insert(args.begin() + 1, {"--config", cfg.string()});
    }
    args.insert(args.end(), extra_args_.begin(), extra_args_.end());
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const auto log_path = dir_.path() / "daemon.log";
    const rlimit nofile{fd_limit_, fd_limit_};
    pid_ = ::fork();
    if (pid_ == 0) {
        int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        ::dup2(fd, 2);
        if (fd_limit_ > 0 && ::setrlimit(RLIMIT_NOFILE, &nofile) != 0) ::_exit(126);
        if (unit_confined_ && !confine_like_the_unit()) ::_exit(124);
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    if (mode == start_mode::no_wait) return;
    if (!wait_ready(std::chrono::seconds(30))) {
        throw std::runtime_error("sandboxd did not become ready:\n" + log());
    }
}

bool DaemonProcess::wait_ready(std::chrono::milliseconds timeout) {
    const auto ready = dir_.path() / "ready";
    const bool up = eventually(
        [&] {
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                throw std::runtime_error("sandboxd exited during start:\n" + log());
            }
            return fs::exists(ready);
        },
        timeout);
    if (!up) return false;
    std::ifstream in(ready);
    std::getline(in, address_);
    return true;
}

std::optional<int> DaemonProcess::wait_exit(std::chrono::milliseconds timeout) {
    if (pid_ <= 0) return std::nullopt;
    int status = 0;
    if (!eventually([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; }, timeout)) {
        return std::nullopt;
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string DaemonProcess::bound_address() const {
    const std::string text = log();
    // "node=<id> bound HOST:PORT": the first " bound " followed by an address (a warning may
    // say "bound" before it).
    const std::string marker = " bound ";
    auto at = text.find(marker);
    while (at != std::string::npos && at + marker.size() < text.size() &&
           !std::isdigit(static_cast<unsigned char>(text[at + marker.size()])) &&
           text[at + marker.size()] != '[' &&
           text.compare(at + marker.size(), 9, "localhost") != 0) {
        at = text.find(marker, at + 1);
    }
    if (at == std::string::npos) return {};
    const auto start = at + marker.size();
    const auto end = text.find_first_of("; \n", start);
    return text.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

int DaemonProcess::stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int status = 0;
    const bool done = eventually([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; },
                                 std::chrono::seconds(20));
    if (!done) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
        return -1;
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void DaemonProcess::kill9() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
}

void DaemonProcess::restart() {
    if (pid_ > 0) stop();
    launch();
}

std::string DaemonProcess::token() const {
    std::ifstream in(state_dir_ / "admin.token");
    std::string t;
    std::getline(in, t);
    return t;
}

std::string DaemonProcess::metrics_token() const {
    if (!config_json_.empty()) {
        const auto config = try_parse_json(config_json_, {/*ignore_comments=*/true}).value;
        if (config.is_object() && config.contains("auth") && config["auth"].contains("tokens")) {
            for (const auto& t : config["auth"]["tokens"]) {
                const auto role = t.value("role", std::string("host"));
                if ((role == "metrics" || role == "peer") && t.contains("token")) {
                    return t["token"].get<std::string>();
                }
            }
        }
    }
    return token();
}

std::string DaemonProcess::log() const {
    std::ifstream in(dir_.path() / "daemon.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::vector<pid_t> children_of_every_thread(pid_t pid) {
    std::vector<pid_t> out;
    std::error_code ec;
    for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
        std::istringstream in(read_proc_file(task.path() / "children"));
        pid_t child = 0;
        while (in >> child) out.push_back(child);
    }
    return out;
}

std::vector<pid_t> DaemonProcess::children() const {
    return pid_ > 0 ? children_of_every_thread(pid_) : std::vector<pid_t>{};
}

std::vector<pid_t> descendants_of(pid_t pid) {
    std::vector<pid_t> out = children_of_every_thread(pid);
    for (std::size_t i = 0; i < out.size(); ++i) {
        for (pid_t grandchild : children_of_every_thread(out[i])) out.push_back(grandchild);
    }
    return out;
}

std::vector<pid_t> DaemonProcess::descendants() const {
    return pid_ > 0 ? descendants_of(pid_) : std::vector<pid_t>{};
}

std::vector<pid_t> DaemonProcess::channel_processes() const {
    std::vector<pid_t> out;
    for (pid_t child : children()) {
        std::error_code ec;
        const auto exe = fs::read_symlink("/proc/" + std::to_string(child) + "/exe", ec);
        if (ec || exe.filename() != "bwrap") continue;
        for (pid_t supervisor : children_of_every_thread(child)) {
            for (pid_t init : children_of_every_thread(supervisor)) {
                // The lease's warm init (src/init/init_main.cpp) is no channel's until it
                // takes a request, when it renames itself "init".
                if (read_proc_file("/proc/" + std::to_string(init) + "/comm") == "warm-init\n") {
                    continue;
                }
                out.push_back(init);
            }
        }
    }
    return out;
}

ScopedEnv::ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) {
        had_ = true;
        old_ = old;
    }
    ::setenv(name_.c_str(), value.c_str(), 1);
}

ScopedEnv::~ScopedEnv() {
    if (had_) {
        ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
        ::unsetenv(name_.c_str());
    }
}

ScopedEnv measure_memory_env() {
    const char* old = std::getenv("ASAN_OPTIONS");
    std::string value = old && *old ? std::string(old) + ":" : std::string();
    return ScopedEnv("ASAN_OPTIONS",
                     value + "quarantine_size_mb=0:thread_local_quarantine_size_kb=0");
}

bool DaemonProcess::alive() const {
    if (pid_ <= 0) return false;
    const char state = proc_state(pid_);
    return state != 0 && state != 'Z' && state != 'X';
}

long DaemonProcess::rss_kib() const { return proc_status_field(pid_, "VmRSS"); }

long DaemonProcess::peak_rss_kib() const { return proc_status_field(pid_, "VmHWM"); }

std::size_t DaemonProcess::fd_count() const { return fd_targets().size(); }

std::vector<std::string> DaemonProcess::fd_targets() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid_) + "/fd", ec)) {
        std::error_code ec2;
        out.push_back(fs::read_symlink(e.path(), ec2).string());
    }
    return out;
}

double DaemonProcess::metric(const std::string& name) const {
    const auto colon = address_.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address_.substr(colon + 1))));
    ::inet_pton(AF_INET, address_.substr(0, colon).c_str(), &sa.sin_addr);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error("metric: socket failed");
    std::string body;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
        const std::string req = "GET /metrics HTTP/1.1\r\nHost: " + address_ +
                                "\r\nAuthorization: Bearer " + metrics_token() +
                                "\r\nConnection: close\r\n\r\n";
        if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
            char buf[4096];
            for (;;) {
                pollfd p{fd, POLLIN, 0};
                if (::poll(&p, 1, 10000) <= 0) break;  // bounded: 10 s per read
                ssize_t n = ::read(fd, buf, sizeof buf);
                if (n <= 0) break;
                body.append(buf, static_cast<std::size_t>(n));
            }
        }
    }
    ::close(fd);
    std::istringstream lines(body);
    std::string line;
    while (std::getline(lines, line)) {
        if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
    }
    return -1;
}

namespace {

std::string read_cmdline(const fs::path& proc_dir) {
    std::string cmd = read_proc_file(proc_dir / "cmdline");
    if (!cmd.empty() && cmd.back() == '\0') cmd.pop_back();
    for (auto& c : cmd) {
        if (c == '\0') c = ' ';
    }
    return cmd;
}

/// Calls `f(pid, command line)` for every process of this test's own tree: its descendants
/// (the daemons it started and everything below them). The test process is a child subreaper
/// (tests/support/catch_main.cpp), so a process of that tree that loses its parent stays in
/// it; processes of other tests and other work on the machine are never looked at.
template <typename F>
void for_each_process(F f) {
    for (pid_t pid : descendants_of(::getpid())) {
        f(pid, read_cmdline("/proc/" + std::to_string(pid)));
    }
}

}  // namespace

int count_processes_exactly(const std::string& command) {
    int count = 0;
    for_each_process([&](pid_t, const std::string& cmd) { count += cmd == command ? 1 : 0; });
    return count;
}

std::vector<pid_t> pids_with(const std::string& needle) {
    std::vector<pid_t> out;
    for_each_process([&](pid_t pid, const std::string& cmd) {
        if (cmd.rfind(needle, 0) == 0) out.push_back(pid);
    });
    return out;
}

long proc_status_field(pid_t pid, const std::string& name) {
    std::istringstream in(read_proc_file("/proc/" + std::to_string(pid) + "/status"));
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind(name + ":", 0) == 0) return std::stol(line.substr(name.size() + 1));
    }
    return -1;
}

long long proc_io_field(pid_t pid, const std::string& name) {
    std::istringstream in(read_proc_file("/proc/" + std::to_string(pid) + "/io"));
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind(name + ":", 0) == 0) return std::stoll(line.substr(name.size() + 1));
    }
    return -1;
}

long long pipe_capacity(pid_t pid, int fd) {
    const auto path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    const int own = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (own < 0) return -1;
    const long long size = ::fcntl(own, F_GETPIPE_SZ);
    ::close(own);
    return size;
}

char proc_state(pid_t pid) {
    const std::string stat = read_proc_file("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size()) return 0;
    return stat[paren + 2];
}

int count_processes_with(const std::string& needle) {
    // Zombies have an empty command line and are not "left running"; bubblewrap and the init
    // carry the command in their arguments, so only a command line that starts with `needle`
    // is the command itself.
    int count = 0;
    for_each_process([&](pid_t, const std::string& cmd) { count += cmd.rfind(needle, 0) == 0; });
    return count;
}

nlohmann::json lease_ref(const nlohmann::json& lease) {
    return {{"id", lease["id"]},
            {"providerLeaseId", lease["providerLeaseId"]},
            {"companyId", lease["companyId"]},
            {"environmentId", lease["environmentId"]},
            {"metadata", lease["metadata"]}};
}

nlohmann::json open_params(const nlohmann::json& lease, std::vector<std::string> argv) {
    return {{"lease", lease_ref(lease)}, {"command", std::move(argv)}};
}

std::vector<std::string> plugin_fields_not_refused(Client& c, const nlohmann::json& lease) {
    std::vector<std::string> wrong;
    for (const std::string field : {"pty", "cwd", "env", "stdin"}) {
        auto params = open_params(lease, {"touch", "refused"});
        if (field == "pty") params["pty"] = {{"cols", 80}, {"rows", 24}};
        if (field == "cwd") params["cwd"] = "/tmp";
        if (field == "env") params["env"] = {{"A", "b"}};
        if (field == "stdin") params["stdin"] = false;
        try {
            c.call("duplexChannelOpen", params);
            wrong.push_back(field + " (accepted)");
        } catch (const rpc_error& e) {
            if (e.data().value("reason", "") != "INVALID_PARAMS" ||
                e.data().value("field", "") != field) {
                wrong.push_back(field + " (" + e.what() + ")");
            }
        }
    }
    return wrong;
}

nlohmann::json acquire_plugin_lease(Client& c, const std::string& company,
                                    std::chrono::seconds limit) {
    const nlohmann::json params = {
        {"companyId", company}, {"environmentId", "dev"}, {"provider", "process"}};
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
        try {
            return c.call("leaseAcquire", params);
        } catch (const rpc_error& e) {
            if (e.data().value("reason", "") != "PROVIDER_NOT_READY" ||
                std::chrono::steady_clock::now() > deadline) {
                throw;
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // retry pacing
    }
}

nlohmann::json acquire_lease(Client& c) {
    return c.call("leaseAcquire",
                  {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "bwrap"}});
}

std::string error_reason(Client& c, const std::string& method, const nlohmann::json& params) {
    try {
        c.call(method, params);
    } catch (const rpc_error& e) {
        return e.data().value("reason", "");
    }
    return "ok";
}

std::string ExecuteRun::logged(const std::string& stream) const {
    std::string out;
    for (const auto& l : logs) {
        if (l["stream"] == stream) out += l["chunk"].get<std::string>();
    }
    return out;
}

ExecuteRun execute(Client& c, const nlohmann::json& params) {
    ExecuteRun run;
    const auto id = c.send_request("leaseExecute", params);
    run.result = c.wait_response(id);
    // Everything that came while the call ran was kept back, in arrival order.
    std::deque<ClientEvent> others;
    for (auto& ev : c.take_queued()) {
        const auto& m = ev.message;
        if (ev.type == ClientEvent::kind::notification &&
            m.value("method", "") == "leaseExecute.log" && m["params"]["requestId"] == id) {
            run.logs.push_back(
                {{"stream", m["params"]["stream"]}, {"chunk", m["params"]["chunk"]}});
            continue;
        }
        others.push_back(std::move(ev));
    }
    c.requeue(std::move(others));
    return run;
}

namespace {

std::pair<int, std::string> http_request(
    boost::beast::http::verb verb, const std::string& address, const std::string& target,
    const std::string& authorization, bool upgrade,
    const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    namespace net = boost::asio;
    namespace http = boost::beast::http;
    net::io_context ioc;
    net::ip::tcp::resolver resolver(ioc);
    auto colon = address.rfind(':');
    net::ip::tcp::socket socket(ioc);
    net::connect(socket, resolver.resolve(address.substr(0, colon), address.substr(colon + 1)));
    http::request<http::empty_body> req{verb, target, 11};
    req.set(http::field::host, address);
    if (!authorization.empty()) req.set(http::field::authorization, authorization);
    for (const auto& [name, value] : headers) req.set(name, value);
    if (upgrade) {
        req.set(http::field::connection, "Upgrade");
        req.set(http::field::upgrade, "websocket");
        req.set(http::field::sec_websocket_key, "dGhlIHNhbXBsZSBub25jZQ==");
        req.set(http::field::sec_websocket_version, "13");
    }
    http::write(socket, req);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(socket, buffer, res);
    return {static_cast<int>(res.result_int()), res.body()};
}

}  // namespace

nlohmann::json host_and_peer_tokens() {
    return {
        {"tokens",
         {{{"name", "host"}, {"token", test_host_token}, {"role", "host"}, {"tenants", {"*"}}},
          {{"name", "peer"}, {"token", test_peer_token}, {"role", "peer"}, {"tenants", {"*"}}}}}};
}

std::pair<int, std::string> http_get(
    const std::string& address, const std::string& target, const std::string& authorization,
    bool upgrade, const std::vector<std::pair<std::string, std::string>>& headers) {
    return http_request(boost::beast::http::verb::get, address, target, authorization, upgrade,
                        headers);
}

std::pair<int, std::string> http_post(const std::string& address, const std::string& target,
                                      const std::string& authorization) {
    return http_request(boost::beast::http::verb::post, address, target, authorization, false);
}

std::size_t DaemonProcess::end_kept_sandboxes() const {
    namespace proto = sandboxd::supervisor;
    std::error_code ec;
    const auto runtime = fs::read_symlink(state_dir_ / "sandboxes" / ".runtime", ec);
    if (ec || runtime.empty()) return 0;
    std::size_t ended = 0;
    for (const auto& entry : fs::directory_iterator(state_dir_ / "sandboxes", ec)) {
        const auto name = entry.path().filename().string();
        if (name.rfind("bw-", 0) != 0) continue;
        proto::Adopt adopt;
        adopt.flags = proto::adopt_end;
        std::ifstream in(entry.path() / "secret", std::ios::binary);
        in.read(reinterpret_cast<char*>(adopt.secret), sizeof adopt.secret);
        if (in.gcount() != static_cast<std::streamsize>(sizeof adopt.secret)) continue;
        const std::string path = (runtime / name / "supervisor.sock").string();
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        if (path.size() >= sizeof addr.sun_path) continue;
        std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
        const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        const timeval tv{5, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0 &&
            ::send(fd, &adopt, sizeof adopt, MSG_NOSIGNAL) == sizeof adopt) {
            // The welcome, then EOF once the supervisor (and with it the sandbox) is gone.
            char buf[64];
            if (::recv(fd, buf, sizeof buf, 0) > 0) {
                ++ended;
                while (::recv(fd, buf, sizeof buf, 0) > 0) {
                }
            }
        }
        ::close(fd);
    }
    return ended;
}

}  // namespace sandboxd::test
