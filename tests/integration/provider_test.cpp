// The bubblewrap provider and sandboxd-init against the real bwrap. Every fd is driven with
// plain poll()/read() loops; every wait is bounded.

#include <sandboxd/errors.hpp>
#include <sandboxd/provider.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#ifndef SANDBOXD_INIT_BIN
#error "SANDBOXD_INIT_BIN must name the built sandboxd-init"
#endif

namespace {

using namespace sandboxd;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds status_timeout{20000};
constexpr milliseconds teardown_timeout{10000};

int open_fd_count() {
    int n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator("/proc/self/fd")) ++n;
    return n;
}

/// Waits until `fd` is readable; false on timeout.
bool wait_readable(int fd, milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
        if (left.count() < 0) return false;
        pollfd p{fd, POLLIN, 0};
        int r = ::poll(&p, 1, static_cast<int>(left.count()));
        if (r > 0) return true;
        if (r < 0 && errno != EINTR) return false;
    }
}

std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

/// The command line of `pid` with NULs as spaces ("" for a zombie or a gone process).
std::string cmdline_of(pid_t pid) {
    std::string cmdline = read_text("/proc/" + std::to_string(pid) + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    return cmdline;
}

/// True for a zombie: dead, waiting to be reaped by whoever inherited it (for a sandbox's
/// init that is the host's PID 1, which may take its time).
bool is_zombie(const fs::path& proc_dir) {
    std::string stat = read_text(proc_dir / "stat");
    auto paren = stat.rfind(')');
    return paren != std::string::npos && stat.compare(paren, 4, ") Z ") == 0;
}

/// Whether `pid` is alive (not a zombie) with a command line that starts with `prefix`.
bool running_as(pid_t pid, const std::string& prefix) {
    const fs::path dir = "/proc/" + std::to_string(pid);
    std::error_code ec;
    return fs::exists(dir, ec) && !is_zombie(dir) && cmdline_of(pid).rfind(prefix, 0) == 0;
}

/// Inode of the PID namespace `pid` is in; 0 if it is gone.
ino_t pid_ns_of(pid_t pid) {
    struct stat st {};
    if (::stat(("/proc/" + std::to_string(pid) + "/ns/pid").c_str(), &st) != 0) return 0;
    return st.st_ino;
}

/// Host pids of the live (non-zombie) processes in the PID namespace of inode `ns_inode`.
std::vector<pid_t> processes_in_pid_ns(ino_t ns_inode) {
    std::vector<pid_t> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
        pid_t pid = std::stoi(name);
        if (pid_ns_of(pid) == ns_inode && !is_zombie(entry.path())) out.push_back(pid);
    }
    return out;
}

std::vector<std::string> sorted_lines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    std::sort(lines.begin(), lines.end());
    return lines;
}

struct TempDir {
    fs::path path;
    TempDir() {
        char tmpl[] = "/tmp/sandboxd-provider-test.XXXXXX";
        const char* made = ::mkdtemp(tmpl);
        if (made == nullptr) throw std::runtime_error("mkdtemp failed");
        path = made;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    TempDir(TempDir&&) = delete;
    TempDir& operator=(TempDir&&) = delete;
};

/// A provider on a temporary sandboxes dir and one sandbox in it.
struct Fixture {
    TempDir dir;
    std::unique_ptr<Provider> provider;
    std::shared_ptr<SandboxHandle> sandbox;

    explicit Fixture(bool allow_network = false,
                     const nlohmann::json& config = nlohmann::json::object()) {
        ::signal(SIGPIPE, SIG_IGN);  // the tests write to pipes whose readers may be gone
        BwrapOptions options;
        options.init_path = SANDBOXD_INIT_BIN;
        options.sandboxes_dir = dir.path / "sandboxes";
        options.allow_network = allow_network;
        provider = make_bwrap_provider(std::move(options));
        sandbox =
            provider->create(SandboxScope{"bwrap", "company-1", "env-1", ""}, "lease-1", config);
    }
};

/// One spawned process, driven to completion by hand.
class Channel {
public:
    Channel(Provider& provider, const SandboxHandle& sandbox, const ExecSpec& spec)
        : proc_(provider.spawn(sandbox, spec)) {}

    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    Channel(Channel&&) = delete;
    Channel& operator=(Channel&&) = delete;

    ~Channel() {
        if (!reaped_) kill_and_reap();
    }

    /// Queues bytes for the command's stdin; `close_after`: close it once they are written.
    void send(std::string data, bool close_after) {
        pending_in_ += data;
        close_in_ = close_after;
        flush_stdin();
    }

    void control(unsigned char byte) { REQUIRE(::write(proc_.control_fd.get(), &byte, 1) == 1); }

    /// Pumps every fd until `done()` holds; false on timeout.
    bool pump_until(const std::function<bool()>& done, milliseconds timeout,
                    milliseconds tick = milliseconds{-1}) {
        auto deadline = Clock::now() + timeout;
        while (!done()) {
            auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
            if (left.count() <= 0) return false;
            if (tick.count() >= 0) left = std::min(left, tick);
            pump_once(left);
        }
        return true;
    }

    bool status_done() const { return !proc_.status_fd || status_.find('\n') != std::string::npos; }
    bool output_eof() const { return !proc_.stdout_fd && !proc_.stderr_fd; }

    /// Waits for the status line, kills bubblewrap, reads the output to EOF, reaps it and
    /// waits for the namespace's init to be gone. Returns false on any timeout.
    bool finish(milliseconds timeout = status_timeout) {
        if (!pump_until([this] { return status_done(); }, timeout)) return false;
        kill_and_reap();
        return pump_until([this] { return output_eof(); }, teardown_timeout) && reap_ok_;
    }

    /// Host pid of the namespace's init (bubblewrap's only child), -1 if there is none.
    pid_t init_pid() const {
        std::string children = read_text("/proc/" + std::to_string(proc_.pid) + "/task/" +
                                         std::to_string(proc_.pid) + "/children");
        return children.empty() ? -1 : std::stoi(children);
    }

    /// Host pids of the live processes of the sandbox (before finish()).
    std::vector<pid_t> members() const {
        pid_t init = init_pid();
        ino_t ns = init > 0 ? pid_ns_of(init) : 0;
        return ns != 0 ? processes_in_pid_ns(ns) : std::vector<pid_t>{};
    }

    SpawnedProcess& proc() { return proc_; }
    const std::string& out() const { return out_; }
    const std::string& err() const { return err_; }
    /// The status line without its newline.
    std::string status() const { return status_.substr(0, status_.find('\n')); }
    /// Processes of the sandbox's PID namespace still alive after finish().
    const std::vector<pid_t>& leftovers() const { return leftovers_; }
    int bwrap_wait_status() const { return wait_status_; }

    /// Waits for bubblewrap to exit on its own (no kill) and reaps it.
    bool wait_exit(milliseconds timeout) {
        if (!wait_readable(proc_.pidfd.get(), timeout)) return false;
        REQUIRE(::waitpid(proc_.pid, &wait_status_, 0) == proc_.pid);
        reaped_ = true;
        return true;
    }

private:
    void kill_and_reap() {
        // Find the init first, so that its death (and so the namespace's) can be awaited.
        pid_t init = init_pid();
        unique_fd init_fd;
        ino_t ns_inode = 0;
        if (init > 0) {
            init_fd.reset(static_cast<int>(::syscall(SYS_pidfd_open, init, 0)));
            ns_inode = pid_ns_of(init);
        }
        ::kill(proc_.pid, SIGKILL);
        reap_ok_ = wait_readable(proc_.pidfd.get(), teardown_timeout) &&
                   ::waitpid(proc_.pid, &wait_status_, 0) == proc_.pid;
        reaped_ = true;
        if (init_fd) reap_ok_ = wait_readable(init_fd.get(), teardown_timeout) && reap_ok_;
        if (ns_inode != 0) leftovers_ = processes_in_pid_ns(ns_inode);
    }

    void flush_stdin() {
        while (proc_.stdin_fd && !pending_in_.empty()) {
            ssize_t n = ::write(proc_.stdin_fd.get(), pending_in_.data(), pending_in_.size());
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN) return;
                pending_in_.clear();  // EPIPE: the reader is gone
                break;
            }
            pending_in_.erase(0, static_cast<std::size_t>(n));
        }
        if (pending_in_.empty() && close_in_) proc_.stdin_fd.reset();
    }

    static void drain(unique_fd& fd, std::string& into) {
        char buf[65536];
        for (;;) {
            ssize_t n = ::read(fd.get(), buf, sizeof buf);
            if (n > 0) {
                into.append(buf, static_cast<std::size_t>(n));
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && errno == EAGAIN) return;
            fd.reset();  // EOF, or EIO from a PTY master whose slave is closed
            return;
        }
    }

    void pump_once(milliseconds timeout) {
        std::vector<pollfd> fds;
        auto add = [&fds](const unique_fd& fd, short events) {
            if (fd) fds.push_back({fd.get(), events, 0});
        };
        if (!pending_in_.empty()) add(proc_.stdin_fd, POLLOUT);
        add(proc_.stdout_fd, POLLIN);
        add(proc_.stderr_fd, POLLIN);
        if (!status_done()) add(proc_.status_fd, POLLIN);
        int r = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
        if (r <= 0) return;
        flush_stdin();
        if (proc_.stdout_fd) drain(proc_.stdout_fd, out_);
        if (proc_.stderr_fd) drain(proc_.stderr_fd, err_);
        if (!status_done()) drain(proc_.status_fd, status_);
    }

    SpawnedProcess proc_;
    std::string pending_in_;
    bool close_in_ = false;
    std::string out_, err_, status_;
    bool reaped_ = false;
    bool reap_ok_ = false;
    int wait_status_ = 0;
    std::vector<pid_t> leftovers_;
};

struct Result {
    std::string out, err, status;
};

ExecSpec command(std::vector<std::string> argv) {
    ExecSpec spec;
    spec.argv = std::move(argv);
    return spec;
}

/// Runs `spec` to completion with `input` on stdin (then closed).
Result run(Fixture& fx, const ExecSpec& spec, const std::string& input = "") {
    Channel ch(*fx.provider, *fx.sandbox, spec);
    ch.send(input, true);
    REQUIRE(ch.finish());
    CHECK(ch.leftovers().empty());
    return {ch.out(), ch.err(), ch.status()};
}

}  // namespace

TEST_CASE("exit status, stdout and stderr are reported", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "printf hello; printf err >&2; exit 3"}));
        CHECK(r.out == "hello");
        CHECK(r.err == "err");
        CHECK(r.status == "exit 3");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("stdin is passed through byte for byte", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        std::string data(1 << 20, '\0');
        for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i & 0xff);
        auto r = run(fx, command({"cat"}), data);
        CHECK(r.out.size() == data.size());
        CHECK(r.out == data);
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("death by signal is reported", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "kill -TERM $$"}));
        CHECK(r.status == "signal 15");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command has no capabilities", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"grep", "CapEff", "/proc/self/status"}));
        CHECK(r.out == "CapEff:\t0000000000000000\n");
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the command sees fds 0, 1 and 2 only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // Inheritable fds of our own must not reach the sandbox.
        unique_fd extra1(::open("/dev/null", O_RDONLY));
        unique_fd extra2(::open("/dev/null", O_RDONLY));
        int p[2];
        REQUIRE(::pipe(p) == 0);
        unique_fd extra3(p[0]), extra4(p[1]);
        auto r = run(fx, command({"ls", "/proc/self/fd"}));
        CHECK(r.out == "0\n1\n2\n3\n");  // 3: ls's own directory fd
        CHECK(r.status == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the environment is exactly the fixed one plus spec.env", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"env"});
        spec.env["SANDBOXD_TEST"] = "a value=with equals";
        auto r = run(fx, spec);
        CHECK(sorted_lines(r.out) ==
              std::vector<std::string>{
                  "HOME=/workspace",
                  "LANG=C.UTF-8",
                  "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "SANDBOXD_TEST=a value=with equals",
                  "TERM=dumb",
              });
        CHECK(r.status == "exit 0");

        auto bad = command({"env"});
        bad.env["A=B"] = "x";
        try {
            fx.provider->spawn(*fx.sandbox, bad);
            FAIL("spawn accepted an invalid variable name");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::invalid_params);
            CHECK(std::string(e.what()).rfind("env: ", 0) == 0);
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the workspace is the host workspace dir at /workspace", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"pwd"}));
        CHECK(r.out == "/workspace\n");
        CHECK(r.status == "exit 0");

        r = run(fx, command({"sh", "-c", "echo data > file.txt && mkdir sub"}));
        CHECK(r.status == "exit 0");
        CHECK(read_text(fx.sandbox->workspace / "file.txt") == "data\n");

        auto spec = command({"pwd"});
        spec.cwd = "sub";
        CHECK(run(fx, spec).out == "/workspace/sub\n");
        spec.cwd = "/tmp";
        CHECK(run(fx, spec).out == "/tmp\n");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the network is private unless the lease asks for it", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        CHECK_FALSE(fx.sandbox->network);
        auto r = run(fx, command({"cat", "/proc/net/dev"}));
        auto lines = sorted_lines(r.out);
        std::set<std::string> interfaces;
        for (const auto& line : lines) {
            auto colon = line.find(':');
            if (colon == std::string::npos || line.find('|') != std::string::npos) continue;
            auto name = line.substr(0, colon);
            name.erase(0, name.find_first_not_of(' '));
            interfaces.insert(name);
        }
        CHECK(interfaces == std::set<std::string>{"lo"});
    }
    {
        Fixture fx(true, {{"network", true}});
        CHECK(fx.sandbox->network);
        auto r = run(fx, command({"cat", "/proc/net/dev"}));
        // Same interfaces as the host (the counters differ).
        auto names = [](const std::string& text) {
            std::set<std::string> out;
            for (const auto& line : sorted_lines(text)) {
                auto colon = line.find(':');
                if (colon != std::string::npos && line.find('|') == std::string::npos) {
                    out.insert(line.substr(0, colon));
                }
            }
            return out;
        };
        CHECK(names(r.out) == names(read_text("/proc/self/net/dev")));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("create validates the lease config", "[provider]") {
    TempDir dir;
    BwrapOptions options;
    options.init_path = SANDBOXD_INIT_BIN;
    options.sandboxes_dir = dir.path;
    auto provider = make_bwrap_provider(options);
    CHECK(provider->key() == "bwrap");
    CHECK(provider->plugin_id() == "builtin");
    SandboxScope scope{"bwrap", "c", "e", ""};
    auto expect_invalid = [&](const nlohmann::json& config, const std::string& message) {
        try {
            provider->create(scope, "lease", config);
            FAIL("create accepted " << config.dump());
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::invalid_params);
            CHECK(std::string(e.what()) == message);
        }
    };
    expect_invalid({{"network", true}}, "config.network: not allowed on this node");
    expect_invalid({{"disk", 1}}, "config.disk: unknown key");
    expect_invalid(nlohmann::json::array(), "config: must be an object");
    CHECK(fs::is_empty(dir.path));

    auto handle = provider->create(scope, "lease", nullptr);
    CHECK(handle->scope.provider_lease_id.rfind("bw-", 0) == 0);
    CHECK(handle->scope.provider_lease_id.size() == 19);
    CHECK(handle->scope.company_id == "c");
    CHECK(handle->lease_id == "lease");
    CHECK(handle->workspace == dir.path / handle->scope.provider_lease_id);
    CHECK((fs::status(handle->workspace).permissions() & fs::perms::all) == fs::perms::owner_all);
    auto other = provider->create(scope, "lease", {{"network", false}});
    CHECK(other->scope.provider_lease_id != handle->scope.provider_lease_id);

    provider->destroy(*handle);
    CHECK_FALSE(fs::exists(handle->workspace));
    provider->destroy(*handle);  // idempotent
    CHECK(fs::exists(other->workspace));
}

TEST_CASE("the root file system is read-only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c", "echo x > /usr/sandboxd-probe"}));
        CHECK(r.status != "exit 0");
        CHECK(r.err.find("Read-only file system") != std::string::npos);
        CHECK_FALSE(fs::exists("/usr/sandboxd-probe"));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("host sysctls are read-only", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // Writes the current value back: harmless should the protection ever be missing.
        auto r = run(fx, command({"sh", "-c",
                                  "v=$(cat /proc/sys/kernel/core_pattern) && "
                                  "printf '%s\\n' \"$v\" > /proc/sys/kernel/core_pattern"}));
        CHECK(r.status != "exit 0");
        CHECK(r.err.find("Read-only file system") != std::string::npos);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a PTY has the requested size", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"stty", "size"});
        spec.pty = PtySize{132, 43};
        Channel ch(*fx.provider, *fx.sandbox, spec);
        CHECK_FALSE(ch.proc().stderr_fd);
        REQUIRE(ch.finish());
        CHECK(ch.out() == "43 132\r\n");
        CHECK(ch.status() == "exit 0");
        CHECK(ch.leftovers().empty());

        spec.argv = {"env"};
        auto r = run(fx, spec);
        CHECK(r.out.find("TERM=xterm-256color\r\n") != std::string::npos);
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a control byte signals the command's process group", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel ch(*fx.provider, *fx.sandbox,
                   command({"sh", "-c",
                            "trap \"echo got-term; exit 7\" TERM; echo ready; "
                            "while :; do sleep 0.1; done"}));
        REQUIRE(ch.pump_until([&] { return ch.out() == "ready\n"; }, status_timeout));
        ch.control(15);
        REQUIRE(ch.finish());
        CHECK(ch.out() == "ready\ngot-term\n");
        CHECK(ch.status() == "exit 7");
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("signals sent to the init reach the command's group", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"sh", "-c",
                                  "trap \"echo got-usr1; exit 9\" USR1; kill -USR1 1; "
                                  "while :; do sleep 0.1; done"}));
        CHECK(r.out == "got-usr1\n");
        CHECK(r.status == "exit 9");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a control byte with 0x80 signals every process of the sandbox", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // The descendant left the command's process group: only kill(-1) reaches it.
        Channel ch(*fx.provider, *fx.sandbox,
                   command({"sh", "-c",
                            "setsid sh -c 'trap \"echo bg-term; exit 0\" TERM; echo bg-ready; "
                            "while :; do sleep 0.1; done' & "
                            "trap '' TERM; wait"}));
        REQUIRE(ch.pump_until([&] { return ch.out() == "bg-ready\n"; }, status_timeout));
        ch.control(0x80 | 15);
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 0");  // `wait` returned: the descendant exited
        REQUIRE(ch.finish());
        CHECK(ch.out() == "bg-ready\nbg-term\n");
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("Ctrl-C on the PTY interrupts the foreground command", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"sh", "-c", "echo ready; exec sleep 30"});
        spec.pty = PtySize{80, 24};
        Channel ch(*fx.provider, *fx.sandbox, spec);
        // "ready" comes after the init made the command's group the foreground group.
        REQUIRE(ch.pump_until([&] { return ch.out().find("ready\r\n") != std::string::npos; },
                              status_timeout));
        ch.send("\x03", false);
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, milliseconds{2000}));
        CHECK(ch.status() == "signal 2");
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("SIGKILL by control byte, and no process outlives bubblewrap", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        Channel ch(*fx.provider, *fx.sandbox, command({"sh", "-c", "sleep 300 & sleep 301"}));
        // Wait until both sleeps run (they may still be forking when the first byte comes).
        std::vector<pid_t> sleeps;
        REQUIRE(ch.pump_until(
            [&] {
                sleeps.clear();
                for (pid_t p : ch.members()) {
                    if (running_as(p, "sleep 300") || running_as(p, "sleep 301")) {
                        sleeps.push_back(p);
                    }
                }
                return sleeps.size() == 2;
            },
            status_timeout, milliseconds{10}));
        ch.control(9);
        REQUIRE(ch.finish());
        CHECK(ch.status() == "signal 9");
        CHECK(ch.leftovers().empty());
        for (pid_t p : sleeps) {
            CHECK_FALSE(running_as(p, "sleep 300"));
            CHECK_FALSE(running_as(p, "sleep 301"));
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the init outlives the command until the daemon kills the namespace", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        // A descendant that left the command's process group writes after the command
        // ended, once the test creates the file it waits for.
        Channel ch(*fx.provider, *fx.sandbox,
                   command({"sh", "-c",
                            "setsid sh -c 'while [ ! -e go ]; do sleep 0.05; done; echo late' "
                            "& echo early; exit 4"}));
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 4");
        std::ofstream(fx.sandbox->workspace / "go").put('\n');
        REQUIRE(ch.pump_until([&] { return ch.out() == "early\nlate\n"; }, status_timeout));
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
    }
    {
        Fixture fx;
        // The escaped descendant is killed with the namespace.
        Channel ch(*fx.provider, *fx.sandbox,
                   command({"sh", "-c", "setsid sleep 302 >/dev/null 2>&1 & echo $!"}));
        REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
        CHECK(ch.status() == "exit 0");
        std::vector<pid_t> members = ch.members();
        CHECK(members.size() == 2);  // the init and the escaped descendant
        REQUIRE(ch.finish());
        CHECK(ch.leftovers().empty());
        for (pid_t p : members) CHECK_FALSE(running_as(p, ""));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("the init exits once the daemon lets go after the command ended", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        SECTION("control fd closed") {
            Channel ch(*fx.provider, *fx.sandbox, command({"true"}));
            REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
            CHECK(ch.status() == "exit 0");
            ch.proc().control_fd.reset();
            REQUIRE(ch.wait_exit(teardown_timeout));
            CHECK(WIFEXITED(ch.bwrap_wait_status()));  // not killed: the init ended it all
        }
        SECTION("status fd closed") {
            Channel ch(*fx.provider, *fx.sandbox, command({"true"}));
            REQUIRE(ch.pump_until([&] { return ch.status_done(); }, status_timeout));
            CHECK(ch.status() == "exit 0");
            ch.proc().status_fd.reset();
            REQUIRE(ch.wait_exit(teardown_timeout));
            CHECK(WIFEXITED(ch.bwrap_wait_status()));  // not killed: the init ended it all
        }
        SECTION("control fd closed before the command ended is ignored") {
            Channel ch(*fx.provider, *fx.sandbox, command({"sh", "-c", "read x; exit 5"}));
            ch.proc().control_fd.reset();
            ch.send("go\n", true);
            REQUIRE(ch.finish());
            CHECK(ch.status() == "exit 5");
        }
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("stdin not attached reads EOF at once", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto spec = command({"cat"});
        spec.stdin_attached = false;
        Channel ch(*fx.provider, *fx.sandbox, spec);
        CHECK_FALSE(ch.proc().stdin_fd);
        REQUIRE(ch.finish());
        CHECK(ch.out().empty());
        CHECK(ch.status() == "exit 0");
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("spawning into a destroyed sandbox fails and starts nothing", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        fx.provider->destroy(*fx.sandbox);
        CHECK_FALSE(fs::exists(fx.sandbox->workspace));
        try {
            fx.provider->spawn(*fx.sandbox, command({"true"}));
            FAIL("spawn succeeded");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::provider_error);
            CHECK(std::string(e.what()) == "sandbox " + fx.sandbox->scope.provider_lease_id +
                                               " is gone: its workspace no longer exists");
        }
        errno = 0;
        CHECK(::waitpid(-1, nullptr, WNOHANG) == -1);  // no child at all
        CHECK(errno == ECHILD);
        CHECK_FALSE(fs::exists(fx.sandbox->workspace));
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a missing command exits 127", "[provider]") {
    const int fds_before = open_fd_count();
    {
        Fixture fx;
        auto r = run(fx, command({"no-such-command-xyz", "arg"}));
        CHECK(r.status == "exit 127");
        CHECK(r.err.find("no-such-command-xyz") != std::string::npos);
        CHECK(r.out.empty());
    }
    CHECK(open_fd_count() == fds_before);
}

TEST_CASE("a missing bubblewrap or init is a provider error", "[provider]") {
    const int fds_before = open_fd_count();
    {
        TempDir dir;
        for (int which = 0; which < 2; ++which) {
            BwrapOptions options;
            options.init_path = SANDBOXD_INIT_BIN;
            options.sandboxes_dir = dir.path;
            if (which == 0) options.bwrap_path = dir.path / "no-bwrap";
            if (which == 1) options.init_path = dir.path / "no-init";
            auto provider = make_bwrap_provider(options);
            auto handle = provider->create({"bwrap", "c", "e", ""}, "lease", nullptr);
            try {
                provider->spawn(*handle, command({"true"}));
                FAIL("spawn succeeded");
            } catch (const rpc_error& e) {
                CHECK(e.code() == errc::provider_error);
                std::string expected = which == 0 ? "cannot start bubblewrap: " : "sandboxd-init";
                CHECK(std::string(e.what()).find(expected) != std::string::npos);
            }
            errno = 0;
            CHECK(::waitpid(-1, nullptr, WNOHANG) == -1);
            CHECK(errno == ECHILD);
        }
    }
    CHECK(open_fd_count() == fds_before);
}
