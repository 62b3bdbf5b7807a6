// The hostile-tenant suite (issue 11): a real daemon, real bubblewrap, real cgroups, and
// commands that try to get out of their lease, read what is not theirs, exhaust the node or
// lie to the daemon. Every test is tagged [hostile] (run them alone with
// `integration_tests '[hostile]'`). docs/security.md names the test behind each claim.
//
// Processes are found only as descendants of the daemon this test started (by pid), and
// cgroups only as the ones those processes are in.
#include "support/daemon_fixture.hpp"
#include "support/received.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

/// Bytes that the files under `dir` hold on its file system (st_blocks), without crossing
/// into other mounts (a lease's disk is mounted inside the state dir).
double allocated_bytes(const fs::path& dir) {
    struct stat root {};
    REQUIRE(::lstat(dir.c_str(), &root) == 0);
    double total = 0;
    std::error_code ec;
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        struct stat st {};
        if (::lstat(it->path().c_str(), &st) != 0) continue;  // removed meanwhile
        if (st.st_dev != root.st_dev) {
            it.disable_recursion_pending();  // a mount point: another file system
            continue;
        }
        total += static_cast<double>(st.st_blocks) * 512.0;
    }
    return total;
}

std::string read_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

json acquire_with(Client& c, const json& limits = json::object(),
                  const std::string& company = "acme") {
    json params = {{"companyId", company}, {"environmentId", "dev"}, {"provider", "bwrap"}};
    if (!limits.empty()) params["config"] = {{"limits", limits}};
    return c.call("leaseAcquire", params);
}

ChannelRun run(Client& c, const json& lease, std::vector<std::string> argv,
               const std::string& stdin_data = {}, json extra = json::object()) {
    json params = open_params(lease, std::move(argv));
    for (auto& [k, v] : extra.items()) params[k] = v;
    return c.run_channel(params, stdin_data, true);
}

ChannelRun sh(Client& c, const json& lease, const std::string& script) {
    return run(c, lease, {"sh", "-c", script});
}

/// Every live descendant of `root` (children of every thread, recursively).
std::vector<pid_t> descendants(pid_t root) {
    std::vector<pid_t> out;
    std::vector<pid_t> todo = {root};
    while (!todo.empty()) {
        const pid_t p = todo.back();
        todo.pop_back();
        std::error_code ec;
        for (const auto& task :
             fs::directory_iterator("/proc/" + std::to_string(p) + "/task", ec)) {
            std::istringstream in(read_file(task.path() / "children"));
            for (pid_t child = 0; in >> child;) {
                out.push_back(child);
                todo.push_back(child);
            }
        }
    }
    return out;
}

std::vector<std::string> cmdline(pid_t pid) {
    const std::string raw = read_file("/proc/" + std::to_string(pid) + "/cmdline");
    std::vector<std::string> args;
    std::string cur;
    for (char ch : raw) {
        if (ch == '\0') {
            args.push_back(cur);
            cur.clear();
        } else {
            cur += ch;
        }
    }
    return args;
}

/// The descendant of the daemon whose argv is exactly `argv` (waits up to 10 s).
pid_t find_command(const DaemonProcess& d, const std::vector<std::string>& argv) {
    pid_t found = -1;
    eventually(
        [&] {
            for (pid_t p : descendants(d.pid())) {
                if (cmdline(p) == argv) {
                    found = p;
                    return true;
                }
            }
            return false;
        },
        10s);
    return found;
}

/// The cgroup of `pid` in the v1 pids hierarchy (host path), "" when unknown.
fs::path pids_cgroup_of(pid_t pid) {
    std::istringstream in(read_file("/proc/" + std::to_string(pid) + "/cgroup"));
    for (std::string line; std::getline(in, line);) {
        const auto a = line.find(':');
        const auto b = line.find(':', a + 1);
        if (a == std::string::npos || b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1);
        if (controllers == "pids" || controllers.find("pids,") == 0 ||
            controllers.find(",pids") != std::string::npos) {
            return fs::path("/sys/fs/cgroup/pids") / line.substr(b + 2);
        }
        if (controllers.empty()) return fs::path("/sys/fs/cgroup") / line.substr(b + 2);  // v2
    }
    return {};
}

/// Processes in `cgroup` and every cgroup below it.
std::size_t processes_in(const fs::path& cgroup) {
    std::size_t n = 0;
    std::error_code ec;
    if (!fs::exists(cgroup, ec)) return 0;
    std::istringstream top(read_file(cgroup / "cgroup.procs"));
    for (pid_t p = 0; top >> p;) ++n;
    for (const auto& e : fs::recursive_directory_iterator(cgroup, ec)) {
        if (!e.is_directory()) continue;
        std::istringstream in(read_file(e.path() / "cgroup.procs"));
        for (pid_t p = 0; in >> p;) ++n;
    }
    return n;
}

/// The "Uid:" line of /proc/<pid>/status: real, effective, saved, fs.
std::vector<long> uids_of(pid_t pid) {
    std::istringstream in(read_file("/proc/" + std::to_string(pid) + "/status"));
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("Uid:", 0) != 0) continue;
        std::istringstream f(line.substr(4));
        std::vector<long> out;
        for (long v = 0; f >> v;) out.push_back(v);
        return out;
    }
    return {};
}

std::string exit_outcome(const ChannelRun& r) { return r.exit.value("outcome", ""); }

/// Opens a channel and returns its number without waiting for its exit.
std::uint32_t open_only(Client& c, const json& params) {
    return c.call("duplexChannelOpen", params)["channel"].get<std::uint32_t>();
}

/// Reads events until the exit of `channel`; returns its params. Bounded by the client's
/// timeout (30 s) per event.
json wait_exit(Client& c, std::uint32_t channel) {
    for (;;) {
        auto ev = c.next_event();
        if (ev.message.is_object() && ev.message.value("method", "") == "duplexChannel.exit" &&
            ev.message["params"]["channel"] == channel) {
            return ev.message["params"];
        }
    }
}

}  // namespace

TEST_CASE("hostile: host secrets, tokens and the registry are unreachable from inside",
          "[hostile]") {
    TempDir etc_dir;  // like /etc/sandboxd: token files outside the state directory
    const fs::path host_token = etc_dir.path() / "host.token";
    std::ofstream(host_token) << "host-token-0123456789abcdef\n";
    fs::permissions(host_token, fs::perms::owner_read | fs::perms::owner_write);
    const json config = {{"auth",
                          {{"tokens",
                            {{{"name", "host"},
                              {"tokenFile", host_token.string()},
                              {"role", "host"},
                              {"tenants", {"*"}}}}}}}};
    DaemonProcess configured("node-a", config.dump());
    DaemonProcess generated("node-b");  // makes <stateDir>/admin.token
    REQUIRE(fs::exists(generated.state_dir() / "admin.token"));

    for (DaemonProcess* d : {&configured, &generated}) {
        auto c = d == &configured
                     ? std::make_unique<Client>(d->url(), "host-token-0123456789abcdef")
                     : d->connect();
        const auto lease = acquire_lease(*c);
        const std::vector<fs::path> secrets = {"/etc/shadow", host_token,
                                               d->state_dir() / "admin.token",
                                               d->state_dir() / "registry.db", d->state_dir()};
        for (const auto& path : secrets) {
            INFO("path " << path);
            // By path, through the channel init's /proc entries, and through any process's root.
            auto r = sh(*c, lease,
                        "for p in '" + path.string() + "' '/proc/1/root" + path.string() +
                            "' /proc/*/root'" + path.string() +
                            "'; do cat \"$p\" 2>/dev/null && echo LEAKED; ls \"$p\" "
                            "2>/dev/null && echo LISTED; done; exit 0");
            CHECK(r.out.find("LEAKED") == std::string::npos);
            CHECK(r.out.find("LISTED") == std::string::npos);
            CHECK(r.out.find("host-token-0123456789abcdef") == std::string::npos);
            CHECK(exit_outcome(r) == "exited");
        }
        // The sandbox's /etc is the generated one.
        auto passwd = run(*c, lease, {"cat", "/etc/passwd"});
        CHECK(passwd.out.rfind("root:x:0:0:root:/workspace:/bin/sh\n", 0) == 0);
        CHECK(passwd.out.find(":/root:") == std::string::npos);
        auto ls = run(*c, lease, {"ls", "/"});
        CHECK(ls.out.find("home") == std::string::npos);
        CHECK(ls.out.find("root") == std::string::npos);
        CHECK(ls.out.find("var") == std::string::npos);
        CHECK(ls.out.find("sys") == std::string::npos);
    }
}

TEST_CASE("hostile: another lease's workspace is unreachable by path and through /proc",
          "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto a = acquire_lease(*c);
    const auto b = acquire_lease(*c);
    const std::string a_id = a["providerLeaseId"];
    REQUIRE(sh(*c, a, "echo secret-of-a > /workspace/marker-a").exit["exitCode"] == 0);

    // A holds a process open in its workspace while B looks.
    const std::vector<std::string> holder = {"sleep", "7311"};
    auto ca = d.connect();
    const auto held = open_only(*ca, open_params(a, holder));
    REQUIRE(find_command(d, holder) > 0);

    auto r = sh(*c, b,
                "ls -a /workspace; for p in /proc/*/root/workspace /proc/*/cwd; do ls -a \"$p\"; "
                "done 2>/dev/null; cat /proc/self/mountinfo; "
                "grep -rs secret-of-a /workspace /tmp /run /proc/*/root/workspace; exit 0");
    CHECK(r.out.find("marker-a") == std::string::npos);
    CHECK(r.out.find("secret-of-a") == std::string::npos);
    CHECK(r.out.find(a_id) == std::string::npos);
    // B sees no process but its own channel's: its init (1) and itself.
    auto ps = run(*c, b, {"sh", "-c", "ls -d /proc/[0-9]*"});
    CHECK(ps.out == "/proc/1\n/proc/2\n");  // sh expands the glob before it starts ls
    ca->call("duplexChannelStop", {{"channel", held}});
    CHECK(wait_exit(*ca, held).value("outcome", "") == "stopped");
}

TEST_CASE("hostile: seen from the host, a command runs as its lease's unprivileged uid",
          "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto a = acquire_lease(*c);
    const auto b = acquire_lease(*c);
    std::vector<long> uids[2];
    const json* leases[2] = {&a, &b};
    for (int i = 0; i < 2; ++i) {
        const std::vector<std::string> marker = {"sleep", i == 0 ? "7321" : "7322"};
        auto ci = d.connect();
        const auto ch = open_only(*ci, open_params(*leases[i], marker));
        const pid_t pid = find_command(d, marker);
        REQUIRE(pid > 0);
        uids[i] = uids_of(pid);
        REQUIRE(uids[i].size() == 4);
        ci->call("duplexChannelStop", {{"channel", ch}});
        CHECK(wait_exit(*ci, ch).value("outcome", "") == "stopped");
    }
    for (const auto& u : uids) {
        CHECK(u[0] >= 1500000000);  // the default identity range
        CHECK(std::all_of(u.begin(), u.end(), [&](long v) { return v == u[0]; }));
    }
    CHECK(uids[0][0] != uids[1][0]);  // one uid per lease
    // Inside, it is uid 0 of its own user namespace, with no capability.
    auto r = run(*c, a, {"sh", "-c", "id -u; grep CapEff /proc/self/status"});
    CHECK(r.out == "0\nCapEff:\t0000000000000000\n");
}

TEST_CASE("hostile: a fork bomb at a pids limit of 128 leaves the node and other leases working",
          "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto bomb_lease = acquire_with(*c, {{"pids", 128}});
    CHECK(bomb_lease["limits"]["pids"] == 128);
    const auto other = acquire_lease(*c);

    auto cb = d.connect();
    // Forks busy children for ever; a refused fork (EAGAIN at the limit) is simply retried.
    const std::vector<std::string> bomb = {
        "perl", "-e", "while (1) { my $p = fork; if (defined $p && $p == 0) { 1 while 1; } }"};
    const auto ch = open_only(*cb, open_params(bomb_lease, bomb));
    const pid_t bomber = find_command(d, bomb);
    REQUIRE(bomber > 0);
    const fs::path channel_cgroup = pids_cgroup_of(bomber);
    REQUIRE(!channel_cgroup.empty());
    const fs::path lease_cgroup = channel_cgroup.parent_path();
    // The bomb reaches its limit...
    REQUIRE(eventually([&] { return processes_in(lease_cgroup) >= 120; }, 20s));

    // ...while the daemon answers at once and another lease streams 16 MiB exactly.
    for (int i = 0; i < 3; ++i) {
        const auto began = std::chrono::steady_clock::now();
        auto got = c->call("leaseGet", {{"leaseId", bomb_lease["id"]}});
        CHECK(std::chrono::steady_clock::now() - began < 1s);
        CHECK(got["usage"]["pids"].get<long>() >= 100);
        CHECK(got["usage"]["pids"].get<long>() <= 128);
    }
    std::string data(16 << 20, '\0');
    for (std::size_t i = 0; i < data.size(); ++i)
        data[i] = static_cast<char>((i * 7 + i / 251) & 0xff);
    auto streamed = run(*c, other, {"cat"}, data);
    CHECK(streamed.out.size() == data.size());
    CHECK(streamed.out == data);
    CHECK(streamed.exit["exitCode"] == 0);

    cb->call("duplexChannelStop", {{"channel", ch}});
    const auto exit = wait_exit(*cb, ch);
    CHECK(exit.value("outcome", "") == "stopped");
    // Nothing of the bomb is left: the lease holds its supervisor (and bubblewrap) only.
    CHECK(eventually([&] { return processes_in(channel_cgroup) == 0; }, 10s));
    CHECK(processes_in(lease_cgroup) <= 2);
    CHECK(d.metric("sandboxd_limit_events_total{kind=\"pids\"}") >= 1);
}

TEST_CASE("hostile: allocating 1 GiB under a 128 MiB limit is killed and reported as memory",
          "[hostile]") {
    const auto memory_env = measure_memory_env();
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_with(*c, {{"memoryBytes", 128 << 20}});
    CHECK(lease["limits"]["memoryBytes"] == (128 << 20));
    sh(*c, lease, "true");  // first use of every code path before the baseline
    const long before = d.rss_kib();
    // awk doubles a string until the kernel stops it.
    auto r = run(*c, lease, {"awk", "BEGIN { s = \"x\"; while (1) s = s s }"});
    CHECK(r.exit["signal"] == "KILL");
    CHECK(r.exit["outcome"] == "signaled");
    CHECK(r.exit.value("limit", "") == "memory");
    CHECK(r.exit["exitCode"].is_null());
    if (rss_is_meaningful) CHECK(d.peak_rss_kib() - before < 4 * 1024);
    CHECK(d.metric("sandboxd_limit_events_total{kind=\"memory\"}") == 1);
    // The lease goes on working after the kill.
    CHECK(sh(*c, lease, "echo alive").out == "alive\n");
}

TEST_CASE(
    "hostile: writing 200 MiB into a 64 MiB disk fails inside and costs the host at most "
    "the limit",
    "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    // What the daemon's own files hold on the host's disk (not the disk's free space, which
    // any other work on the machine changes meanwhile).
    const double before = allocated_bytes(d.state_dir());
    const auto lease = acquire_with(*c, {{"diskBytes", 64 << 20}});
    auto r = sh(*c, lease, "head -c 209715200 /dev/zero > /workspace/big; echo rc=$?");
    CHECK(r.out == "rc=1\n");
    CHECK(r.err.find("No space left on device") != std::string::npos);
    const double grew = allocated_bytes(d.state_dir()) - before;
    INFO("the daemon's files grew by " << grew << " bytes");
    CHECK(grew > 50.0 * (1 << 20));  // the image holds what was written
    CHECK(grew <= (64 << 20) + (1 << 20));
    auto got = c->call("leaseGet", {{"leaseId", lease["id"]}});
    CHECK(got["usage"]["diskBytes"].get<double>() > 50.0 * (1 << 20));
    CHECK(got["limits"]["diskBytes"] == (64 << 20));
    // Another lease writes as usual.
    const auto other = acquire_lease(*c);
    CHECK(sh(*c, other, "head -c 1048576 /dev/zero > /workspace/f && echo ok").out == "ok\n");
}

#if defined(__x86_64__)
TEST_CASE("hostile: user namespaces, keyrings and TIOCSTI are refused with EPERM", "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    auto userns = run(*c, lease, {"unshare", "-U", "true"});
    CHECK(userns.exit["exitCode"] != 0);
    CHECK(userns.err.find("Operation not permitted") != std::string::npos);
    // x86_64 numbers: add_key 248, request_key 249, keyctl 250. errno 1 is EPERM.
    auto keys = run(*c, lease,
                    {"perl", "-e",
                     "my ($t, $d, $p) = ('user', 'sandboxd', 'secret'); "
                     "syscall(248, $t, $d, $p, 6, -4); print $! + 0, ' '; "
                     "syscall(249, $t, $d, 0, 0); print $! + 0, ' '; "
                     "syscall(250, 0, -4, 0); print $! + 0, qq(\\n);"});
    CHECK(keys.out == "1 1 1\n");
    json pty_open =
        open_params(lease, {"perl", "-e",
                            "my $c = 'x'; ioctl(STDIN, 0x5412, $c) and print qq(ok\\n); "
                            "print $! + 0, qq(\\n);"});
    pty_open["pty"] = {{"cols", 80}, {"rows", 24}};
    auto tiocsti = c->run_channel(pty_open, "", false);
    CHECK(tiocsti.out == "1\r\n");
}
#endif

TEST_CASE(
    "hostile: each PTY channel's terminal is in a devpts of its own, named inside, and no other "
    "channel reaches it",
    "[hostile][pty]") {
    DaemonProcess d;
    auto a = d.connect();
    auto b = d.connect();
    const auto lease = acquire_lease(*a);
    const json size = {{"cols", 80}, {"rows", 24}};
    // A: names its terminal, writes through /dev/tty, lists its devpts, then echoes its input.
    json first = open_params(lease, {"sh", "-c",
                                     "tty; echo via-dev-tty > /dev/tty; stty size; "
                                     "ls -1 /dev/pts; echo READY; exec cat"});
    first["pty"] = size;
    const auto channel = open_only(*a, first);
    Received got;
    REQUIRE(got.until(*a, [&] { return got.out[channel].find("READY") != std::string::npos; }));
    CHECK(got.out[channel] == "/dev/pts/0\r\nvia-dev-tty\r\n24 80\r\n0\r\nptmx\r\nREADY\r\n");

    // B, another PTY channel of the same lease and uid, while A runs: its terminal has the same
    // name in its own instance, and every terminal it can name is its own.
    json second = open_params(lease, {"sh", "-c",
                                      "tty; ls -1 /dev/pts; for t in /dev/pts/[0-9]*; do "
                                      "echo INJECT > $t; done"});
    second["pty"] = size;
    const auto other = b->run_channel(second);
    CHECK(other.out == "/dev/pts/0\r\n0\r\nptmx\r\nINJECT\r\n");
    CHECK(other.exit["exitCode"] == 0);

    // C, without a terminal: the lease's own instance holds no channel's terminal, and a
    // terminal it opens there itself is not A's.
    const auto plain = b->run_channel(open_params(
        lease,
        {"sh", "-c",
         "ls -1 /dev/pts; tty || true; "
         "perl -e 'open(my $m, \"+<\", \"/dev/ptmx\") or die qq(ptmx: $!); print qq(opened\\n)'; "
         "ls -1 /dev/pts | grep -c '^[0-9]'"}));
    CHECK(plain.out == "ptmx\nnot a tty\nopened\n0\n");
    CHECK(plain.err.empty());

    // A saw nothing of B's or C's, and still serves its own input.
    a->send_stdin(channel, "bye\n\x04");
    REQUIRE(got.until(*a, [&] { return !got.exits[channel].empty(); }));
    CHECK(got.out[channel].find("INJECT") == std::string::npos);
    CHECK(got.out[channel].find("bye\r\nbye\r\n") != std::string::npos);
    CHECK(got.exits[channel].front()["exitCode"] == 0);
}

TEST_CASE("hostile: with the network unshared the daemon's own port is unreachable", "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    const std::string port = parse_host_port(d.address()).port_text();
    auto r =
        run(*c, lease,
            {"bash", "-c", "echo > /dev/tcp/127.0.0.1/" + port + " && echo CONNECTED; exit 0"});
    CHECK(r.out.find("CONNECTED") == std::string::npos);
    CHECK(r.err.find("Connection refused") != std::string::npos);
}

TEST_CASE(
    "hostile: after kill -9 of the daemon and a restart no process of an old sandbox is "
    "left",
    "[hostile]") {
    DaemonProcess d;
    fs::path cgroups[2];
    {
        auto c = d.connect();
        for (int i = 0; i < 2; ++i) {
            const auto lease = acquire_lease(*c);
            // A channel, and a background process of it that tries to outlive everything.
            const std::vector<std::string> marker = {"sleep", i == 0 ? "7331" : "7332"};
            open_only(*c, open_params(lease,
                                      {"sh", "-c", "setsid sleep 7339 & exec sleep " + marker[1]}));
            const pid_t pid = find_command(d, marker);
            REQUIRE(pid > 0);
            cgroups[i] = pids_cgroup_of(pid).parent_path();
            REQUIRE(processes_in(cgroups[i]) >= 3);  // supervisor, init, sleeps
        }
        d.kill9();
    }
    d.restart();
    for (const auto& cg : cgroups) {
        INFO("cgroup " << cg);
        CHECK(processes_in(cg) == 0);
    }
    // The node serves again.
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    CHECK(sh(*c, lease, "echo up").out == "up\n");
}

TEST_CASE("hostile: a forged exit status is never believed and the timeout holds", "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    const auto began = std::chrono::steady_clock::now();
    auto r = run(*c, lease,
                 {"sh", "-c",
                  "for f in /proc/1/fd/* /proc/*/fd/* /proc/1/task/*/fd/*; do "
                  "printf 'exit 0\\nexit 99999999999999\\nsignal 0\\n' > \"$f\" 2>/dev/null; "
                  "done; echo tried; sleep 6; exit 7"},
                 "", {{"timeoutMs", 2000}});
    CHECK(r.exit["outcome"] == "timedOut");
    CHECK(r.exit["exitCode"].is_null());
    CHECK(std::chrono::steady_clock::now() - began < 5s);
    // The log reports the channel without anything it could have read from the sandbox.
    const std::string log = d.log();
    const auto ended = log.find(" lease=" + lease["id"].get<std::string>() + " ended:");
    REQUIRE(ended != std::string::npos);
    const std::string line = log.substr(ended, log.find('\n', ended) - ended);
    INFO("log line: " << line);
    // No exit status; the signal is "-" or KILL (the daemon's own kill at the timeout, which
    // the channel's init may report before it is killed too).
    CHECK(line.find("outcome=timedOut exit=- signal=") != std::string::npos);
    CHECK((line.find("signal=- ") != std::string::npos ||
           line.find("signal=KILL ") != std::string::npos));
    CHECK(log.find("99999999999999") == std::string::npos);
    // The slot is free: more channels run.
    CHECK(sh(*c, lease, "exit 4").exit["exitCode"] == 4);
}

TEST_CASE("hostile: a 30,000-level tree and 200,000 files cost the daemon nothing at teardown",
          "[hostile]") {
    const auto memory_env = measure_memory_env();
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_with(*c, {{"diskBytes", 4ULL << 30}});
    auto made = run(*c, lease,
                    {"perl", "-e",
                     "mkdir 'deep' or die; chdir 'deep' or die; "
                     "for (1..30000) { mkdir 'd' or die qq(mkdir: $!); chdir 'd' or die; } "
                     "chdir '/workspace' or die; mkdir 'many' or die; "
                     "for (1..200000) { open(my $h, '>', qq(many/$_)) or die qq(open: $!); } "
                     "mkdir 'locked'; chmod 0, 'locked'; symlink '/usr', 'link'; "
                     "print qq(made\\n);"});
    REQUIRE(made.out == "made\n");
    const long rss_before = d.rss_kib();
    const auto fds_before = d.fd_count();
    auto released = c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(released["status"] == "released");
    if (rss_is_meaningful) CHECK(d.peak_rss_kib() - rss_before < 16 * 1024);
    CHECK(d.fd_count() < fds_before + 16);
    std::error_code ec;
    CHECK_FALSE(
        fs::exists(d.state_dir() / "sandboxes" / lease["providerLeaseId"].get<std::string>(), ec));
}

#if defined(__x86_64__)
TEST_CASE("hostile: keyrings and inotify instances are not shared between leases or with root",
          "[hostile]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto a = acquire_lease(*c);
    const auto b = acquire_lease(*c);
    // add_key (248) in A, then keyctl(KEYCTL_SEARCH = 10) for it from B: both refused.
    auto add = run(*c, a,
                   {"perl", "-e",
                    "my ($t, $d, $p) = ('user', 'shared-key', 'secret'); "
                    "my $r = syscall(248, $t, $d, $p, 6, -4); print $r, ' ', $! + 0;"});
    CHECK(add.out == "-1 1");
    auto find = run(*c, b,
                    {"perl", "-e",
                     "my ($t, $d) = ('user', 'shared-key'); "
                     "my $r = syscall(250, 10, -4, $t, $d, 0); print $r, ' ', $! + 0;"});
    CHECK(find.out == "-1 1");
    // 128 inotify instances held in A (inotify_init1 is 294) while root makes its own.
    auto ca = d.connect();
    const std::vector<std::string> holder = {
        "perl", "-e",
        "$| = 1; my @fds; for (1..128) { my $fd = syscall(294, 0); push @fds, $fd if $fd >= 0; } "
        "print scalar(@fds), qq(\\n); sleep 7341;"};
    const auto ch = open_only(*ca, open_params(a, holder));
    REQUIRE(find_command(d, holder) > 0);
    std::string held;
    while (held.find('\n') == std::string::npos) {
        auto ev = ca->next_event();  // bounded by the client's timeout
        if (ev.type == ClientEvent::kind::data) held += ev.bytes;
    }
    CHECK(std::stoi(held) >= 1);
    const int fd = ::inotify_init1(IN_CLOEXEC);
    CHECK(fd >= 0);
    if (fd >= 0) ::close(fd);
    ca->call("duplexChannelStop", {{"channel", ch}});
    CHECK(wait_exit(*ca, ch).value("outcome", "") == "stopped");
}
#endif

namespace {

/// What a refused acquire says: its message and data (FAIL when it was accepted).
std::pair<std::string, json> refused_acquire(Client& c, const json& limits) {
    try {
        const auto lease = acquire_with(c, limits);
        FAIL("leaseAcquire accepted " << limits.dump() << ": " << lease.dump());
    } catch (const rpc_error& e) {
        return {e.what(), e.data()};
    }
    return {};
}

std::uint64_t read_number(const fs::path& path) {
    std::uint64_t v = 0;
    std::ifstream(path) >> v;
    return v;
}

}  // namespace

TEST_CASE("hostile: /proc hides the host's locks and disks and the files runtimes mask",
          "[hostile][proc]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    // On the host these are not empty: the daemon holds its lease's identity lock, and the
    // lease's disk is a loop device.
    REQUIRE_FALSE(read_file("/proc/locks").empty());
    REQUIRE(read_file("/proc/diskstats").find("loop") != std::string::npos);
    const std::vector<std::string> files = {
        "/proc/locks",       "/proc/diskstats",     "/proc/partitions",    "/proc/kcore",
        "/proc/keys",        "/proc/key-users",     "/proc/timer_list",    "/proc/timer_stats",
        "/proc/sched_debug", "/proc/sysrq-trigger", "/proc/latency_stats", "/proc/interrupts",
        "/proc/kallsyms",    "/proc/vmallocinfo",   "/proc/slabinfo"};
    for (const auto& f : files) {
        INFO(f);
        // Absent, or empty: "<bytes read>" is 0 either way.
        auto r = run(*c, lease, {"sh", "-c", "cat \"$0\" 2>/dev/null | wc -c", f});
        CHECK(r.out == "0\n");
        CHECK(exit_outcome(r) == "exited");
    }
    for (const std::string dir : {"/proc/acpi", "/proc/scsi", "/proc/asound", "/proc/fs",
                                  "/proc/bus", "/proc/irq", "/proc/driver"}) {
        INFO(dir);
        // Empty, and nothing can be written there ($0 is the directory).
        auto r = run(*c, lease,
                     {"sh", "-c",
                      "ls -A \"$0\" 2>/dev/null | wc -l; touch \"$0/x\" 2>/dev/null && echo WROTE; "
                      "exit 0",
                      dir});
        CHECK(r.out == "0\n");
    }
    // The channel's own processes are still there.
    CHECK(sh(*c, lease, "cat /proc/self/status | head -1").out == "Name:\tcat\n");
}

TEST_CASE("hostile: mountinfo inside names no path of the daemon's state or runtime directory",
          "[hostile][proc]") {
    DaemonProcess d;
    auto c = d.connect();
    const auto lease = acquire_lease(*c);
    const fs::path runtime = fs::read_symlink(d.state_dir() / "sandboxes" / ".runtime");
    REQUIRE_FALSE(runtime.empty());
    auto r = run(*c, lease, {"cat", "/proc/self/mountinfo", "/proc/1/mountinfo"});
    REQUIRE(exit_outcome(r) == "exited");
    INFO(r.out);
    REQUIRE(r.out.find(" /etc ") != std::string::npos);  // it is the lease's mountinfo
    CHECK(r.out.find(d.state_dir().string()) == std::string::npos);
    CHECK(r.out.find(runtime.string()) == std::string::npos);
    // Nor relative to the file system that holds them (a bind's root field is that path).
    CHECK(r.out.find(runtime.filename().string()) == std::string::npos);
    CHECK(r.out.find("/sandboxd/") == std::string::npos);
    CHECK(r.out.find(".etc") == std::string::npos);
    CHECK(r.out.find(".init/") == std::string::npos);
    CHECK(r.out.find(lease["providerLeaseId"].get<std::string>()) == std::string::npos);
}

TEST_CASE("hostile: dsync writes stay within the lease's ioWriteBps, shared by its channels",
          "[hostile][io]") {
    DaemonProcess d;
    auto c = d.connect();
    constexpr double write_bps = 4 << 20;
    const auto lease = acquire_with(*c, {{"ioWriteBps", 4 << 20}, {"diskBytes", 64 << 20}});
    CHECK(lease["limits"]["ioWriteBps"] == 4 << 20);
    // Two channels at once, 4 MiB of synchronous 64 KiB writes each.
    auto ca = d.connect();
    auto cb = d.connect();
    const auto start = std::chrono::steady_clock::now();
    const auto a = open_only(*ca, open_params(lease, {"dd", "if=/dev/zero", "of=/workspace/a",
                                                      "bs=64k", "count=64", "oflag=dsync"}));
    const auto b = open_only(*cb, open_params(lease, {"dd", "if=/dev/zero", "of=/workspace/b",
                                                      "bs=64k", "count=64", "oflag=dsync"}));
    CHECK(wait_exit(*ca, a)["exitCode"] == 0);
    CHECK(wait_exit(*cb, b)["exitCode"] == 0);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = 8.0 * (1 << 20) / secs;
    INFO("8 MiB in " << secs << " s: " << rate / (1 << 20) << " MiB/s");
    CHECK(rate <= write_bps * 1.1);
    CHECK(sh(*c, lease, "cat /workspace/a /workspace/b | wc -c").out == "8388608\n");
}

TEST_CASE("hostile: ioWeight is refused on cgroup v1, which has no io weight", "[hostile][io]") {
    if (!fs::exists("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device")) {
        WARN("not a cgroup v1 host with blkio: nothing to check here");
        return;
    }
    DaemonProcess d;
    auto c = d.connect();
    auto [message, data] = refused_acquire(*c, {{"ioWeight", 100}});
    CHECK(data["reason"] == "INVALID_PARAMS");
    CHECK(data["field"] == "config.limits.ioWeight");
    CHECK(message.rfind("config.limits.ioWeight: needs cgroup v2 with the io controller", 0) == 0);
    CHECK(c->call("leaseList", json::object())["leases"].empty());
}

TEST_CASE("hostile: leases beyond the node's pids budget are refused, and the log states it",
          "[hostile][budget]") {
    // The budget: pid_max less its reserve (an eighth, at least 1024). Leases of a third of it
    // and one pid: two fit, a third is refused.
    const std::uint64_t pid_max = read_number("/proc/sys/kernel/pid_max");
    REQUIRE(pid_max > 4096);
    const std::uint64_t budget = pid_max - std::max<std::uint64_t>(pid_max / 8, 1024);
    const std::uint64_t per = std::min<std::uint64_t>(budget / 3 + 1, 4194304);
    const json config = {
        {"providers", {{"bwrap", {{"limits", {{"overcommit", 1}, {"max", {{"pids", per}}}}}}}}}};
    DaemonProcess d("node-a", config.dump());
    CHECK(d.log().find("node budgets: pids " + std::to_string(budget) + " (kernel.pid_max " +
                       std::to_string(pid_max)) != std::string::npos);
    auto c = d.connect();
    const json limits = {{"pids", per}, {"diskBytes", 16 << 20}, {"memoryBytes", 64 << 20}};
    const auto a = acquire_with(*c, limits);
    const auto b = acquire_with(*c, limits);
    auto [message, data] = refused_acquire(*c, limits);
    CHECK(data["reason"] == "CHANNEL_LIMIT");
    CHECK(data["limit"] == "nodePids");
    CHECK(message == "this node's pids budget is full: its leases hold " + std::to_string(2 * per) +
                         " of " + std::to_string(budget) + " (kernel.pid_max " +
                         std::to_string(pid_max) + " less " + std::to_string(pid_max - budget) +
                         " kept for the host, times overcommit 1) and this lease asks for " +
                         std::to_string(per));
    CHECK(c->call("leaseList", json::object())["leases"].size() == 2);
    // A released lease gives its share back.
    c->call("leaseRelease", {{"leaseId", a["id"]}});
    const auto again = acquire_with(*c, limits);
    CHECK(again["status"] == "active");
}
