// The cgroup manager of the built-in provider against this machine's real cgroups (v1 here).
// Each test makes its own instance subtree ("cgtest-<pid>-<random>") and removes it whatever
// happens. The only processes touched are ones the test forked (by pid) and, in cleanup after
// a failure, whatever sits in the test's own instance subtree. This process is a child
// subreaper, so the grandchildren that tests fork come back to it to be reaped.

#include "provider/cgroups.hpp"

#include <sandboxd/core/errors.hpp>

#include "support/wait_readable.hpp"

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace sandboxd;
using namespace sandboxd::detail;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;
using Catch::Matchers::StartsWith;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds step_timeout{10000};
constexpr std::uint64_t mib = std::uint64_t{1024} * 1024;
const std::vector<std::string> controllers = {"memory", "pids", "cpu", "cpuacct", "freezer"};

std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

/// This process's cgroup directory in the v1 hierarchy of `controller`, found independently
/// of the code under test (Debian mounts co-mounted controllers as /sys/fs/cgroup/cpu,cpuacct).
fs::path own_dir(const std::string& controller) {
    std::istringstream lines(read_text("/proc/self/cgroup"));
    for (std::string line; std::getline(lines, line);) {
        auto first = line.find(':');
        auto second = line.find(':', first + 1);
        std::string list = line.substr(first + 1, second - first - 1);
        std::istringstream names(list);
        for (std::string name; std::getline(names, name, ',');) {
            if (name == controller) {
                return fs::path("/sys/fs/cgroup") / list / line.substr(second + 2);
            }
        }
    }
    return {};
}

/// The descriptors open in this process (without the one that listed them).
std::vector<int> open_fds() {
    std::vector<int> fds;
    for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
        fds.push_back(std::stoi(entry.path().filename().string()));
    }
    std::erase_if(fds, [](int fd) { return ::fcntl(fd, F_GETFD) < 0; });
    return fds;
}

using sandboxd::test::wait_readable;

/// Writes "0" to each descriptor: the calling process joins those cgroups.
bool join(const std::vector<unique_fd>& fds) {
    return std::all_of(fds.begin(), fds.end(),
                       [](const unique_fd& fd) { return ::write(fd.get(), "0", 1) == 1; });
}

/// One int at a time from forked children to the test.
class Pipe {
public:
    Pipe() {
        int fds[2];
        REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
        read_.reset(fds[0]);
        write_.reset(fds[1]);
    }
    void send(int value) const noexcept {
        ssize_t ignored = ::write(write_.get(), &value, sizeof value);
        (void)ignored;
    }
    std::optional<int> receive(milliseconds timeout = step_timeout) const {
        int value = 0;
        if (!wait_readable(read_.get(), timeout)) return std::nullopt;
        if (::read(read_.get(), &value, sizeof value) != sizeof value) return std::nullopt;
        return value;
    }

private:
    unique_fd read_, write_;
};

/// An instance of its own, its manager, and the children forked for it; cleans up whatever a
/// test leaves, failed or not.
class Fixture {
public:
    explicit Fixture(const fs::path& root = "/sys/fs/cgroup") : instance_(unique_instance()) {
        int was = 0;
        ::prctl(PR_GET_CHILD_SUBREAPER, &was);
        was_subreaper_ = was != 0;
        ::prctl(PR_SET_CHILD_SUBREAPER, 1);
        manager_ = probe_cgroups(instance_, root);
    }
    Fixture(const Fixture&) = delete;
    Fixture& operator=(const Fixture&) = delete;
    Fixture(Fixture&&) = delete;
    Fixture& operator=(Fixture&&) = delete;
    ~Fixture() { cleanup(); }

    CgroupManager& manager() { return *manager_; }
    const std::string& instance() const { return instance_; }
    fs::path dir(const std::string& controller, const std::string& rel = "") const {
        return own_dir(controller) / instance_ / rel;
    }

    /// Forks a child that runs `body` and exits with its result (never returns into Catch).
    pid_t spawn(const std::function<int()>& body) {
        pid_t pid = ::fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            int code = 120;
            try {
                code = body();
            } catch (...) {
            }
            ::_exit(code);
        }
        children_.push_back(pid);
        return pid;
    }

    /// The wait status of our child `pid` once it exits; nullopt on timeout.
    std::optional<int> wait_exit(pid_t pid, milliseconds timeout = step_timeout) {
        unique_fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
        if (!pidfd || !wait_readable(pidfd.get(), timeout)) return std::nullopt;
        int status = 0;
        if (::waitpid(pid, &status, 0) != pid) return std::nullopt;
        children_.erase(std::remove(children_.begin(), children_.end(), pid), children_.end());
        return status;
    }

    /// Reaps children that the subreaper inherited (a killed child's children).
    void reap_orphans() {
        auto deadline = Clock::now() + step_timeout;
        while (Clock::now() < deadline) {
            pid_t pid = ::waitpid(-1, nullptr, WNOHANG);
            if (pid < 0) return;  // ECHILD: none left
            if (pid > 0) {
                children_.erase(std::remove(children_.begin(), children_.end(), pid),
                                children_.end());
                continue;
            }
            pollfd none{};
            ::poll(&none, 0, 5);  // children still dying; poll again shortly
        }
    }

private:
    static std::string unique_instance() {
        unsigned char bytes[6] = {};
        REQUIRE(::getrandom(bytes, sizeof bytes, 0) == static_cast<ssize_t>(sizeof bytes));
        std::string name = "cgtest-" + std::to_string(::getpid()) + "-";
        for (unsigned char b : bytes) {
            name += "0123456789abcdef"[b >> 4];
            name += "0123456789abcdef"[b & 15];
        }
        return name;
    }

    void cleanup() {
        // Thaw first: a frozen process would not act on SIGKILL.
        std::vector<fs::path> dirs;
        for (const auto& c : controllers) {
            std::error_code ec;
            if (!fs::is_directory(dir(c), ec)) continue;
            dirs.push_back(dir(c));
            for (fs::recursive_directory_iterator it(dir(c), ec), end; !ec && it != end;
                 it.increment(ec)) {
                if (it->is_directory(ec)) dirs.push_back(it->path());
            }
        }
        for (const auto& d : dirs) {
            if (fs::exists(d / "freezer.state")) std::ofstream(d / "freezer.state") << "THAWED";
        }
        std::vector<pid_t> pids = children_;
        for (const auto& d : dirs) {
            std::istringstream procs(read_text(d / "cgroup.procs"));
            for (pid_t pid = 0; procs >> pid;) pids.push_back(pid);
        }
        for (pid_t pid : pids) ::kill(pid, SIGKILL);
        reap_orphans();
        manager_.reset();
        std::sort(dirs.begin(), dirs.end(), [](const fs::path& a, const fs::path& b) {
            return a.string().size() > b.string().size();
        });
        for (const auto& d : dirs) ::rmdir(d.c_str());
        // As it was before: the test runner's main makes every test process a subreaper
        // (tests/support/catch_main.cpp), which the process scans of later tests rely on.
        ::prctl(PR_SET_CHILD_SUBREAPER, was_subreaper_ ? 1 : 0);
    }

    std::string instance_;
    std::unique_ptr<CgroupManager> manager_;
    std::vector<pid_t> children_;
    bool was_subreaper_ = false;
};

/// The cgroup path of `pid` in the hierarchy of `controller` ("" when not found).
std::string cgroup_of(pid_t pid, const std::string& controller) {
    std::istringstream lines(read_text("/proc/" + std::to_string(pid) + "/cgroup"));
    for (std::string line; std::getline(lines, line);) {
        auto first = line.find(':');
        auto second = line.find(':', first + 1);
        std::string list = "," + line.substr(first + 1, second - first - 1) + ",";
        if (list.find("," + controller + ",") != std::string::npos) {
            return line.substr(second + 1);
        }
    }
    return "";
}

bool killed_by_sigkill(const std::optional<int>& status) {
    return status && WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL;
}

/// Lines of cgroup.procs of `rel` and its children in every hierarchy.
std::size_t procs_in(const Fixture& f, const std::string& rel) {
    std::size_t n = 0;
    for (const auto& c : controllers) {
        std::error_code ec;
        std::vector<fs::path> dirs{f.dir(c, rel)};
        for (fs::directory_iterator it(f.dir(c, rel), ec), end; !ec && it != end;
             it.increment(ec)) {
            if (it->is_directory(ec)) dirs.push_back(it->path());
        }
        for (const auto& d : dirs) {
            auto text = read_text(d / "cgroup.procs");
            n += static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
        }
    }
    return n;
}

bool exists_anywhere(const Fixture& f, const std::string& rel) {
    return std::any_of(controllers.begin(), controllers.end(),
                       [&](const std::string& c) { return fs::exists(f.dir(c, rel)); });
}

bool exists_everywhere(const Fixture& f, const std::string& rel) {
    return std::all_of(controllers.begin(), controllers.end(),
                       [&](const std::string& c) { return fs::is_directory(f.dir(c, rel)); });
}

template <class F>
void require_provider_error(F&& f) {
    try {
        f();
        FAIL("no rpc_error was thrown");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::provider_error);
    }
}

}  // namespace

TEST_CASE("The probe finds cgroup v1 on this machine and describes where", "[cgroup]") {
    Fixture f;
    REQUIRE(f.manager().mode() == cgroup_mode::v1);
    std::string text = f.manager().describe();
    CHECK_THAT(text, StartsWith("cgroup v1 (") && Contains("memory") && Contains("pids") &&
                         Contains("cpuacct") && Contains("freezer"));
    CHECK_THAT(text, EndsWith(" under " + (own_dir("memory") / f.instance()).string()));
    CHECK(exists_everywhere(f, ""));
    CHECK(f.manager().remove_orphans(nullptr) == 0);
}

TEST_CASE("The probe of a directory without cgroups gives a manager that cannot make leases",
          "[cgroup]") {
    Fixture f(fs::temp_directory_path());
    CHECK(f.manager().mode() == cgroup_mode::none);
    CHECK_THAT(f.manager().describe(), StartsWith("no usable cgroups: v2: "));
    require_provider_error([&] { f.manager().create_lease("x", {}); });
    CHECK(f.manager().find_lease("x") == nullptr);
    CHECK(f.manager().remove_orphans(nullptr) == 0);
    require_provider_error([] { probe_cgroups("bad/name"); });
}

TEST_CASE("The probe refuses a cgroup2 mount that offers no memory controller", "[cgroup]") {
    // This machine's unified mount has no controllers; where it has some (a systemd host),
    // probing it would move this process, so the test only runs on machines like this one.
    fs::path unified = "/sys/fs/cgroup/unified";
    if (!fs::exists(unified / "cgroup.controllers") ||
        read_text(unified / "cgroup.controllers").find("memory") != std::string::npos) {
        return;
    }
    Fixture f(unified);
    CHECK(f.manager().mode() == cgroup_mode::none);
    CHECK_THAT(f.manager().describe(),
               Contains("v2: " + unified.string() + " does not offer the memory controller"));
}

TEST_CASE("A lease is made with its limits written to the cgroup files", "[cgroup]") {
    Fixture f;
    CgroupLimits limits;
    limits.memory_bytes = 64 * mib;
    limits.pids = 20;
    limits.cpu_weight = 200;
    limits.cpu_quota_percent = 50;
    auto lease = f.manager().create_lease("limits", limits);
    REQUIRE(exists_everywhere(f, "limits"));

    CHECK(read_text(f.dir("memory", "limits") / "memory.limit_in_bytes") == "67108864\n");
    if (fs::exists(f.dir("memory", "limits") / "memory.memsw.limit_in_bytes")) {
        CHECK(read_text(f.dir("memory", "limits") / "memory.memsw.limit_in_bytes") == "67108864\n");
    }
    CHECK(read_text(f.dir("pids", "limits") / "pids.max") == "20\n");
    CHECK(read_text(f.dir("cpu", "limits") / "cpu.shares") == "2048\n");
    CHECK(read_text(f.dir("cpu", "limits") / "cpu.cfs_period_us") == "100000\n");
    CHECK(read_text(f.dir("cpu", "limits") / "cpu.cfs_quota_us") == "50000\n");

    SECTION("default limits leave everything unlimited") {
        auto plain = f.manager().create_lease("plain", {});
        CHECK(read_text(f.dir("pids", "plain") / "pids.max") == "max\n");
        CHECK(read_text(f.dir("cpu", "plain") / "cpu.shares") == "1024\n");
        CHECK(read_text(f.dir("cpu", "plain") / "cpu.cfs_quota_us") == "-1\n");
    }
    SECTION("a lease name that exists already is an error and the lease stays") {
        require_provider_error([&] { f.manager().create_lease("limits", {}); });
        CHECK(exists_everywhere(f, "limits"));
        CHECK(read_text(f.dir("pids", "limits") / "pids.max") == "20\n");
    }
    SECTION("invalid names and limits are refused and leave nothing behind") {
        for (const auto& name :
             std::vector<std::string>{"", "a/b", "..", "a.b", "x y", std::string(65, 'a')}) {
            require_provider_error([&] { f.manager().create_lease(name, {}); });
            require_provider_error([&] { lease->create_channel(name); });
        }
        CgroupLimits bad;
        bad.cpu_weight = 0;
        require_provider_error([&] { f.manager().create_lease("bad", bad); });
        bad.cpu_weight = 100;
        bad.cpu_quota_percent = 0;
        require_provider_error([&] { f.manager().create_lease("bad", bad); });
        CHECK_FALSE(exists_anywhere(f, "bad"));
        // Refused by the kernel half way through: the error names the file, nothing is left.
        bad.cpu_quota_percent.reset();
        bad.pids = 4'000'000'000U;
        try {
            f.manager().create_lease("bad", bad);
            FAIL("the kernel took pids.max 4000000000");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::provider_error);
            CHECK_THAT(e.what(), Contains("/bad/pids.max") && Contains("Invalid argument"));
        }
        CHECK_FALSE(exists_anywhere(f, "bad"));
        CHECK(f.manager().create_lease(std::string(64, 'a'), {}) != nullptr);
    }
    SECTION("channels are child cgroups with unique names") {
        auto channel = lease->create_channel("c-1");
        CHECK(exists_everywhere(f, "limits/c-1"));
        require_provider_error([&] { lease->create_channel("c-1"); });
        channel.reset();
        CHECK_FALSE(exists_anywhere(f, "limits/c-1"));
    }
    SECTION("find_channel finds a kept channel's cgroup again, or gives nullptr") {
        lease->create_channel("c-2")->keep();
        CHECK(exists_everywhere(f, "limits/c-2"));
        CHECK(lease->find_channel("absent") == nullptr);
        CHECK(lease->find_channel("../limits") == nullptr);
        auto found = lease->find_channel("c-2");
        REQUIRE(found != nullptr);
        found->mark_empty();
        found.reset();
        CHECK_FALSE(exists_anywhere(f, "limits/c-2"));
    }
    SECTION("find_lease returns a lease to remove, or nullptr") {
        CHECK(f.manager().find_lease("absent") == nullptr);
        auto found = f.manager().find_lease("limits");
        REQUIRE(found != nullptr);
        found.reset();
        CHECK_FALSE(exists_anywhere(f, "limits"));
    }
    lease.reset();
    CHECK_FALSE(exists_anywhere(f, "limits"));
}

TEST_CASE("A forked child that writes 0 to the open procs descriptors joins the cgroup",
          "[cgroup]") {
    Fixture f;
    Pipe ready;
    auto fds_before = open_fds();
    auto lease = f.manager().create_lease("join", {});
    auto channel = lease->create_channel("ch");
    bool in_user_namespace = false;
    SECTION("as root") {}
    SECTION("as an unprivileged user inside a new user namespace") { in_user_namespace = true; }

    auto start = [&](std::vector<unique_fd> fds) {
        REQUIRE(fds.size() >= 4);  // memory, pids, cpu(+cpuacct), freezer
        return f.spawn([&] {
            if (in_user_namespace &&
                (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0 ||
                 ::unshare(CLONE_NEWUSER) != 0)) {
                return 2;
            }
            if (!join(fds)) return 3;
            ready.send(1);
            ::pause();
            return 0;
        });
    };
    pid_t in_lease = start(lease->open_procs());
    REQUIRE(ready.receive() == 1);
    pid_t in_channel = start(channel->open_procs());
    REQUIRE(ready.receive() == 1);

    for (const auto& c : controllers) {
        INFO("controller " << c);
        CHECK_THAT(cgroup_of(in_lease, c), EndsWith("/" + f.instance() + "/join"));
        CHECK_THAT(cgroup_of(in_channel, c), EndsWith("/" + f.instance() + "/join/ch"));
    }
    CHECK(lease->usage().pids == 2);

    lease.reset();
    CHECK(killed_by_sigkill(f.wait_exit(in_lease)));
    CHECK(killed_by_sigkill(f.wait_exit(in_channel)));
    channel.reset();
    CHECK_FALSE(exists_anywhere(f, "join"));
    CHECK(open_fds() == fds_before);
}

TEST_CASE("open_procs without a descriptor left fails with channel_limit", "[cgroup]") {
    Fixture f;
    auto lease = f.manager().create_lease("nofile", {});
    auto fds_before = open_fds();
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
    // Room for two of the (at least four) descriptors: open_procs fails half way.
    int limit = 0;
    while (limit - std::count_if(fds_before.begin(), fds_before.end(),
                                 [&](int fd) { return fd < limit; }) <
           2) {
        ++limit;
    }
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(limit);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
    std::optional<errc> code;
    try {
        lease->open_procs();
    } catch (const rpc_error& e) {
        code = e.code();
    }
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
    auto fds_after = open_fds();
    CHECK(code == errc::channel_limit);
    CHECK(fds_after == fds_before);
}

TEST_CASE("A pids limit of 20 makes the 21st fork of the lease fail", "[cgroup]") {
    Fixture f;
    CgroupLimits limits;
    limits.pids = 20;
    auto lease = f.manager().create_lease("pids", limits);
    std::unique_ptr<ChannelCgroup> channel;
    std::vector<unique_fd> fds;
    SECTION("forking in the lease itself") { fds = lease->open_procs(); }
    SECTION("forking in a channel of the lease") {
        channel = lease->create_channel("forks");
        fds = channel->open_procs();
    }
    CHECK(lease->pids_limit_hits() == 0);
    Pipe forked;
    pid_t forker = f.spawn([&] {
        if (!join(fds)) return 3;
        int ok = 0;
        for (int i = 0; i < 30; ++i) {
            pid_t pid = ::fork();
            if (pid == 0) {
                ::pause();
                ::_exit(0);
            }
            if (pid < 0) break;
            ++ok;
        }
        forked.send(ok);
        ::pause();
        return 0;
    });
    fds.clear();

    CHECK(forked.receive() == 19);  // the forker is the 20th
    CHECK(lease->pids_limit_hits() > 0);
    CHECK(lease->usage().pids == 20);
    lease->kill();
    CHECK(killed_by_sigkill(f.wait_exit(forker)));
    CHECK(procs_in(f, "pids") == 0);
    f.reap_orphans();
    CHECK(lease->usage().pids == 0);  // the pids controller counts zombies until reaped
}

TEST_CASE("A channel child that buffers 300 MiB under a 64 MiB lease limit is OOM-killed",
          "[cgroup]") {
    Fixture f;
    CgroupLimits limits;
    limits.memory_bytes = 64 * mib;
    auto lease = f.manager().create_lease("oom", limits);
    auto channel = lease->create_channel("hog");
    CHECK(channel->oom_kills() == 0);
    auto fds = channel->open_procs();
    pid_t hog = f.spawn([&] {
        if (!join(fds)) return 3;
        std::size_t size = 300 * mib;
        auto buffer = std::make_unique<char[]>(size);  // zeroed: every page touched
        volatile char* bytes = buffer.get();
        for (std::size_t i = 0; i < size; i += 4096) bytes[i] = 1;
        return 0;
    });
    fds.clear();

    auto status = f.wait_exit(hog, milliseconds(60000));
    CHECK(killed_by_sigkill(status));
    CHECK(channel->oom_kills() == 1);
}

TEST_CASE("Killing a lease kills a forking process tree and destroying it removes every cgroup",
          "[cgroup]") {
    Fixture f;
    auto lease = f.manager().create_lease("tree", {});
    auto channel = lease->create_channel("work");
    Pipe ready;
    auto channel_fds = channel->open_procs();
    pid_t forker = f.spawn([&] {
        if (!join(channel_fds)) return 3;
        for (int i = 0; i < 50; ++i) {
            pid_t pid = ::fork();
            if (pid < 0) return 4;
            if (pid == 0) {
                ::pause();
                ::_exit(0);
            }
        }
        ready.send(1);
        for (;;) {  // and keeps forking while it is being killed
            pid_t pid = ::fork();
            if (pid == 0) ::_exit(0);
            if (pid > 0) ::waitpid(pid, nullptr, 0);
        }
    });
    channel_fds.clear();
    auto lease_fds = lease->open_procs();
    pid_t sleeper = f.spawn([&] {
        if (!join(lease_fds)) return 3;
        ready.send(1);
        ::pause();
        return 0;
    });
    lease_fds.clear();
    REQUIRE(ready.receive() == 1);
    REQUIRE(ready.receive() == 1);
    CHECK(lease->usage().pids >= 52);

    auto started = Clock::now();
    lease->kill();
    CHECK(Clock::now() - started < milliseconds(2500));
    CHECK(killed_by_sigkill(f.wait_exit(forker)));
    CHECK(killed_by_sigkill(f.wait_exit(sleeper)));
    CHECK(procs_in(f, "tree") == 0);
    f.reap_orphans();
    CHECK(lease->usage().pids == 0);

    channel.reset();
    lease.reset();
    CHECK_FALSE(exists_anywhere(f, "tree"));
}

TEST_CASE("Killing a channel leaves the rest of its lease running", "[cgroup]") {
    Fixture f;
    auto lease = f.manager().create_lease("part", {});
    auto channel = lease->create_channel("one");
    Pipe pids;
    auto start = [&](std::vector<unique_fd> fds, int children) {
        return f.spawn([&, children] {
            if (!join(fds)) return 3;
            for (int i = 0; i < children; ++i) {
                pid_t pid = ::fork();
                if (pid == 0) {
                    ::pause();
                    ::_exit(0);
                }
                pids.send(pid);
            }
            pids.send(0);
            ::pause();
            return 0;
        });
    };
    pid_t survivor = start(lease->open_procs(), 0);
    REQUIRE(pids.receive() == 0);
    pid_t victim = start(channel->open_procs(), 5);
    std::vector<pid_t> grandchildren;
    for (auto pid = pids.receive(); pid && *pid > 0; pid = pids.receive()) {
        grandchildren.push_back(*pid);
    }
    REQUIRE(grandchildren.size() == 5);

    channel->kill();
    CHECK(killed_by_sigkill(f.wait_exit(victim)));
    for (pid_t pid : grandchildren) CHECK(killed_by_sigkill(f.wait_exit(pid)));
    CHECK(procs_in(f, "part/one") == 0);
    CHECK_FALSE(f.wait_exit(survivor, milliseconds(0)).has_value());
    CHECK(lease->usage().pids == 1);
    channel.reset();
    CHECK_FALSE(exists_anywhere(f, "part/one"));
    CHECK(exists_everywhere(f, "part"));
}

TEST_CASE("remove_orphans of a new manager kills and removes a lease a dead process left",
          "[cgroup]") {
    Fixture f;
    Pipe joined;
    // A previous daemon: makes a lease, starts a process in it, and dies without cleaning up.
    pid_t old_daemon = f.spawn([&]() -> int {
        auto manager = probe_cgroups(f.instance());
        auto lease = manager->create_lease("left", {});
        auto fds = lease->open_procs();
        if (::fork() == 0) {
            joined.send(join(fds) ? ::getpid() : -1);
            ::pause();
            ::_exit(0);
        }
        ::_exit(0);  // no destructors: as if killed
    });
    auto status = f.wait_exit(old_daemon);
    REQUIRE(status);
    CHECK(WIFEXITED(*status));
    auto left = joined.receive();
    REQUIRE(left);
    REQUIRE(*left > 0);  // now a child of this subreaper
    REQUIRE(exists_everywhere(f, "left"));

    auto manager = probe_cgroups(f.instance());
    CHECK(manager->remove_orphans(nullptr) == 1);
    CHECK(killed_by_sigkill(f.wait_exit(*left)));
    CHECK_FALSE(exists_anywhere(f, "left"));
    CHECK(manager->remove_orphans(nullptr) == 0);
}

TEST_CASE("A kept lease cgroup outlives its handle, and remove_orphans spares what keep names",
          "[cgroup]") {
    Fixture f;
    {
        auto kept = f.manager().create_lease("kept", {});
        auto gone = f.manager().create_lease("gone", {});
        kept->keep();
        gone->keep();
    }  // both handles dropped: neither is removed
    REQUIRE(exists_everywhere(f, "kept"));
    REQUIRE(exists_everywhere(f, "gone"));
    auto manager = probe_cgroups(f.instance());
    CHECK(manager->remove_orphans([](const std::string& name) { return name == "kept"; }) == 1);
    CHECK(exists_everywhere(f, "kept"));
    CHECK_FALSE(exists_anywhere(f, "gone"));
    auto found = manager->find_lease("kept");
    REQUIRE(found);
    found.reset();  // not kept: this handle removes it
    CHECK_FALSE(exists_anywhere(f, "kept"));
}

TEST_CASE("usage reports the memory and CPU time of a lease", "[cgroup]") {
    Fixture f;
    auto lease = f.manager().create_lease("usage", {});
    CHECK(lease->usage().cpu_ms == 0);
    auto fds = lease->open_procs();
    Pipe ready;
    pid_t burner = f.spawn([&] {
        if (!join(fds)) return 3;
        std::size_t size = 16 * mib;
        auto buffer = std::make_unique<char[]>(size);  // zeroed: every page touched
        volatile char* bytes = buffer.get();
        for (std::size_t i = 0; i < size; i += 4096) bytes[i] = 1;
        timespec t{};
        do {
            ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
        } while (t.tv_sec == 0 && t.tv_nsec < 200'000'000);
        ready.send(1);
        ::pause();
        return 0;
    });
    fds.clear();
    REQUIRE(ready.receive() == 1);

    auto usage = lease->usage();
    CHECK(usage.memory_bytes >= 16 * mib);
    CHECK(usage.cpu_ms >= 150);
    CHECK(usage.cpu_ms < 10000);
    CHECK(usage.pids == 1);
    lease.reset();
    CHECK(killed_by_sigkill(f.wait_exit(burner)));
}
