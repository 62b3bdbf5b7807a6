// Fault trials (issue 15, item 4): three real sandboxd nodes on one registry (SQLite, or a
// private etcd), a stream of host work (acquire, open channels that echo their stdin, release)
// from several connections, and in each trial one fault during that stream:
//   kill9     SIGKILL a node, restart it on the same state directory;
//   sigstop   SIGSTOP a node for 1.5 node TTLs, then SIGCONT;
//   registry  (etcd) stop etcd for 0.5 to 1.5 node TTLs, then start it again;
//   link_cut  cut every link to a node (its address is blackholed by a routing rule in the
//             network namespace this program makes) for 0.5 to 1.5 node TTLs.
// After each trial the stream stops, every lease still active is released, and within
// 3 node TTLs of the trial's end (of a working registry: on etcd, the time that etcd itself
// stalled, measured by a probe of its own, is added and counted) every lease must be released,
// expired, retained or in pending_cleanup, with no process (by cgroup) and no sandbox directory
// left of a released or expired one. At the end every node is stopped and the checker reads every
// node's audit file
// (`audit: {file}`) and log:
//   - every channel.opened names the lease's owner and the epoch it was acquired with, and its
//     command started (by the line's time, or by its startDeadline, the node's fencing deadline
//     that the sandbox's supervisor enforces) before the lease left `active` (the first
//     "lease=<id> pending_cleanup|released|expired" line of any node's log);
//   - no lease has channels on two nodes, and no sandbox of a lease is on a node that does not
//     own it;
//   - every channel.opened has exactly one channel.ended of its process (instance), unless that
//     process was killed;
//   - no answer on the wire shows a status outside the protocol's.
// Usage: fault_trials [--registry sqlite|etcd] [--trials N] [--seed S] [--node-ttl-ms MS]
//                     [--max-seconds S] [--workers N]
// Exit status 0 when every verdict holds, 1 when one fails, 2 for a usage error. Needs root
// (the network namespace, bubblewrap's sandboxes); without a namespace of its own the link_cut
// fault is skipped (said at start).
#include "support/daemon_fixture.hpp"
#include "support/etcd_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using steady = std::chrono::steady_clock;

namespace {

const std::string host_token = "host-secret";
constexpr int node_count = 3;

/// The parts joined, in one string.
template <typename... Parts>
std::string concat(const Parts&... parts) {
    std::string out;
    (out += ... += parts);
    return out;
}

enum class fault { kill9, sigstop, registry, link_cut };

const char* name_of(fault f) {
    switch (f) {
        case fault::kill9: return "kill9";
        case fault::sigstop: return "sigstop";
        case fault::registry: return "registry";
        case fault::link_cut: return "link_cut";
    }
    return "?";
}

struct Options {
    std::string registry = "sqlite";
    int trials = 50;
    std::uint64_t seed = 0;
    int node_ttl_ms = 2000;
    int max_seconds = 0;  // 0: no bound but the trial count
    int workers = 3;
};

[[noreturn]] void usage(const std::string& why) {
    std::cerr << "fault_trials: " << why
              << "\nusage: fault_trials [--registry sqlite|etcd] [--trials N] [--seed S]"
                 " [--node-ttl-ms MS] [--max-seconds S] [--workers N]\n";
    std::exit(2);
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (i + 1 >= argc) usage("missing value after " + a);
        const std::string v = argv[++i];
        try {
            if (a == "--registry") {
                if (v != "sqlite" && v != "etcd") usage("--registry must be sqlite or etcd");
                o.registry = v;
            } else if (a == "--trials") {
                o.trials = std::stoi(v);
            } else if (a == "--seed") {
                o.seed = std::stoull(v);
            } else if (a == "--node-ttl-ms") {
                o.node_ttl_ms = std::stoi(v);
            } else if (a == "--max-seconds") {
                o.max_seconds = std::stoi(v);
            } else if (a == "--workers") {
                o.workers = std::stoi(v);
            } else {
                usage("unknown option " + a);
            }
        } catch (const std::logic_error&) {
            usage(concat("bad number for ", a, ": ", v));
        }
    }
    if (o.trials < 1 || o.node_ttl_ms < 600 || o.workers < 1 || o.max_seconds < 0) {
        usage("--trials and --workers must be at least 1, --node-ttl-ms at least 600");
    }
    return o;
}

/// Runs `command` with /bin/sh; true when it exits 0.
bool sh(const std::string& command) { return std::system(command.c_str()) == 0; }

/// A network namespace of this process's own, where 127.0.0.2.. can be cut one by one:
/// the `local` routing table moves behind rule 100, so a `blackhole` rule before it drops what
/// is sent to one address (connects fail, established connections stall).
bool private_network() {
    if (::unshare(CLONE_NEWNET) != 0) {
        std::cout << "no network namespace of its own (unshare: " << std::strerror(errno)
                  << "): the link_cut fault is skipped\n";
        return false;
    }
    if (!sh("ip link set lo up && ip rule add pref 100 lookup local && ip rule del pref 0")) {
        std::cerr << "fault_trials: cannot set up the network namespace (is iproute2 there?)\n";
        std::exit(1);
    }
    return true;
}

std::string host_of(int node) { return "127.0.0." + std::to_string(node + 2); }

/// What the stream saw; shared by the workers and the main thread (under `mutex`).
struct Ledger {
    struct LeaseRecord {
        std::string owner, provider_lease_id;
        std::int64_t epoch = 0;
        int trial = 0;
    };
    std::mutex mutex;
    std::map<std::string, LeaseRecord> leases;
    std::map<std::string, long> errors;        // reason (or "transport") -> count
    std::map<std::string, long> channel_ends;  // outcome -> count
    long acquires = 0, releases = 0, channels_echoed = 0;
    std::vector<std::string> violations;

    void lease(const json& l, int trial) {
        std::lock_guard lock(mutex);
        leases.emplace(l["id"].get<std::string>(),
                       LeaseRecord{l["ownerNodeId"], l["providerLeaseId"], l["epoch"], trial});
    }
    void error(const std::string& reason) {
        std::lock_guard lock(mutex);
        ++errors[reason];
    }
    void violation(const std::string& what) {
        std::lock_guard lock(mutex);
        violations.push_back(what);
        std::cout << "VIOLATION: " << what << "\n" << std::flush;
    }
    /// Every status the wire shows must be one of the protocol's (no intermediate state).
    void status_seen(const json& lease, const std::string& where) {
        static const std::set<std::string> known = {"active", "released",        "expired",
                                                    "failed", "pending_cleanup", "retained"};
        const auto status = lease.value("status", "");
        if (!known.contains(status)) violation(where + " answered status '" + status + "'");
    }
};

/// The nodes, the registry and the faults. The workers read urls under `mutex`; everything
/// else belongs to the main thread.
class Cluster {
public:
    Cluster(const Options& o, bool netns) : options_(o), netns_(netns) {
        if (o.registry == "etcd") etcd_ = std::make_unique<EtcdServer>();
        for (int i = 0; i < node_count; ++i) {
            audit_[i] = dir_.path() / ("audit-" + std::to_string(i + 1) + ".jsonl");
            nodes_[i] = std::make_unique<DaemonProcess>(
                id_of(i), config(i), std::vector<std::string>{},
                DaemonProcess::start_mode::wait_ready, netns ? host_of(i) + ":0" : "127.0.0.1:0");
            urls_[i] = nodes_[i]->url();
        }
    }

    static std::string id_of(int i) { return "node-" + std::to_string(i + 1); }
    std::string url(int i) {
        std::lock_guard lock(mutex_);
        return urls_[i];
    }
    DaemonProcess& node(int i) { return *nodes_[i]; }
    const fs::path& audit(int i) const { return audit_[i]; }
    bool has_link_cut() const { return netns_; }
    bool has_registry_fault() const { return etcd_ != nullptr; }
    /// etcd's client URL ("http://127.0.0.1:PORT"); only with has_registry_fault().
    const std::string& registry_endpoint() const { return etcd_->endpoint(); }
    std::chrono::milliseconds ttl() const {
        return std::chrono::milliseconds(options_.node_ttl_ms);
    }

    /// Injects `f` on node `victim` for `hold`, then undoes it and waits until every node is
    /// ready again (at most 30 s; false when one is not).
    bool inject(fault f, int victim, std::chrono::milliseconds hold) {
        switch (f) {
            case fault::kill9:
                nodes_[victim]->kill9();
                std::this_thread::sleep_for(hold);  // the fault's length, not a wait for state
                nodes_[victim]->restart();
                {
                    std::lock_guard lock(mutex_);
                    urls_[victim] = nodes_[victim]->url();
                }
                break;
            case fault::sigstop:
                ::kill(nodes_[victim]->pid(), SIGSTOP);
                std::this_thread::sleep_for(hold);
                ::kill(nodes_[victim]->pid(), SIGCONT);
                break;
            case fault::registry:
                etcd_->stop();
                std::this_thread::sleep_for(hold);
                etcd_->start();
                break;
            case fault::link_cut: {
                const auto rule = "ip rule add pref 50 to " + host_of(victim) + " blackhole";
                if (!sh(rule)) throw std::runtime_error("cannot add: " + rule);
                std::this_thread::sleep_for(hold);
                if (!sh("ip rule del pref 50")) throw std::runtime_error("cannot remove the cut");
                break;
            }
        }
        std::string unready;
        const bool ready = eventually(
            [&] {
                for (int i = 0; i < node_count; ++i) {
                    const auto& n = nodes_[static_cast<std::size_t>(i)];
                    try {
                        const auto [status, body] = http_get(n->address(), "/readyz");
                        if (status == 200) continue;
                        unready = concat(id_of(i), " answers /readyz ", std::to_string(status),
                                         ": ", body);
                    } catch (const std::exception& e) {  // refused: restarting, or gone
                        unready = concat(id_of(i), " at ", n->address(), ": ", e.what());
                    }
                    unready_node_ = i;
                    return false;
                }
                return true;
            },
            30s);
        if (!ready) {
            const auto& n = nodes_[static_cast<std::size_t>(unready_node_)];
            const auto log = n->log();
            not_ready_ = concat(
                unready, n->alive() ? " (its process is alive)" : " (its process has exited)",
                "; its log ends:\n", log.size() > 3000 ? log.substr(log.size() - 3000) : log);
        }
        return ready;
    }
    /// Why the last inject() found a node not ready.
    const std::string& not_ready() const { return not_ready_; }

    /// Sandbox directories of each node (providerLeaseIds), and the providerLeaseIds whose
    /// cgroup holds a live process of this program's tree.
    std::map<std::string, std::set<int>> sandbox_dirs() const {
        std::map<std::string, std::set<int>> out;
        for (int i = 0; i < node_count; ++i) {
            std::error_code ec;
            for (const auto& e : fs::directory_iterator(nodes_[i]->state_dir() / "sandboxes", ec)) {
                const auto name = e.path().filename().string();
                if (name.rfind("bw-", 0) == 0) out[name].insert(i);
            }
        }
        return out;
    }
    /// The lease a sandbox was made for, from the "sandbox <id> created ... lease=<lease>"
    /// line of whichever node made it ("" when no log says).
    std::string lease_of_sandbox(const std::string& id) const {
        const std::string mark = "sandbox " + id + " created ";
        for (int i = 0; i < node_count; ++i) {
            const auto log = nodes_[i]->log();
            const auto at = log.find(mark);
            if (at == std::string::npos) continue;
            const auto eol = log.find('\n', at);
            const auto line =
                log.substr(at, eol == std::string::npos ? std::string::npos : eol - at);
            const auto lease = line.find(" lease=");
            if (lease != std::string::npos)
                return line.substr(lease + 7, line.find(' ', lease + 7) - lease - 7);
        }
        return {};
    }
    /// What a leftover sandbox directory of node `i` holds and when it was made (its birth
    /// time, UTC, as the node logs write it), for a violation to be lined up with the logs.
    std::string describe_sandbox_dir(int i, const std::string& id) const {
        const fs::path dir = nodes_[i]->state_dir() / "sandboxes" / id;
        struct statx st {};
        std::string made = "birth time unknown";
        if (::statx(AT_FDCWD, dir.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BTIME, &st) == 0 &&
            (st.stx_mask & STATX_BTIME) != 0) {
            const std::time_t secs = st.stx_btime.tv_sec;
            std::tm tm{};
            ::gmtime_r(&secs, &tm);
            char text[40];
            std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%S", &tm);
            char ms[8];
            std::snprintf(ms, sizeof ms, ".%03uZ", st.stx_btime.tv_nsec / 1000000U);
            made = std::string("made ") + text + ms;
        }
        std::string names;
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(dir, ec)) {
            names += (names.empty() ? "" : ", ") + e.path().filename().string();
        }
        return concat(made, ", holding ", names.empty() ? std::string("nothing") : names);
    }
    /// Copies every node's log and audit to a new directory that outlives the run and
    /// returns its path (for a failed verdict; the run's own directories are removed).
    std::string keep_files() const {
        std::string tmpl = "/tmp/sandboxd-fault-kept-XXXXXX";
        if (::mkdtemp(tmpl.data()) == nullptr)
            return std::string("(cannot make a directory: ") + std::strerror(errno) + ")";
        for (int i = 0; i < node_count; ++i) {
            std::ofstream(fs::path(tmpl) / (id_of(i) + ".log")) << nodes_[i]->log();
            std::error_code ec;
            fs::copy_file(audit_[i], fs::path(tmpl) / (id_of(i) + ".audit.jsonl"), ec);
        }
        return tmpl;
    }
    static std::set<std::string> sandboxes_with_processes() {
        static const std::regex id(R"(bw-[0-9a-f]{16})");
        std::set<std::string> out;
        for (pid_t pid : descendants_of(::getpid())) {
            const char state = proc_state(pid);
            if (state == 0 || state == 'Z' || state == 'X') continue;
            const std::string text = read_proc_file("/proc/" + std::to_string(pid) + "/cgroup");
            for (std::sregex_iterator it(text.begin(), text.end(), id), end; it != end; ++it) {
                out.insert(it->str());
            }
        }
        return out;
    }

    /// Stops every node (SIGTERM: their channels end and are audited).
    void stop_all() {
        for (auto& n : nodes_) n->stop();
    }

private:
    std::string config(int i) const {
        json registry;
        if (etcd_) {
            registry = {{"kind", "etcd"},
                        {"endpoints", {etcd_->endpoint()}},
                        {"prefix", "/sandboxd-fault/"}};
        } else {
            registry = {{"kind", "sqlite"}, {"path", (dir_.path() / "registry.db").string()}};
        }
        return json{
            {"registry", registry},
            {"auth",
             {{"tokens",
               {{{"name", "host"}, {"token", host_token}, {"role", "host"}, {"tenants", {"*"}}},
                {{"name", "peer"},
                 {"token", "peer-secret"},
                 {"role", "peer"},
                 {"tenants", {"*"}}}}}}},
            {"routing",
             {{"mode", "proxy"},
              {"nodeTtlMs", options_.node_ttl_ms},
              {"heartbeatMs", options_.node_ttl_ms / 4}}},
            {"audit", {{"file", audit_[i].string()}}}}
            .dump();
    }

    Options options_;
    bool netns_;
    TempDir dir_;
    std::unique_ptr<EtcdServer> etcd_;
    std::array<std::unique_ptr<DaemonProcess>, node_count> nodes_;
    std::string not_ready_;
    int unready_node_ = 0;
    std::array<fs::path, node_count> audit_;
    std::mutex mutex_;
    std::array<std::string, node_count> urls_;
};

/// One connection of the stream: acquire on a random node, 1 to 3 channels through random
/// nodes (each echoes a line and lingers briefly, so that faults meet running channels), and
/// release through a random node, until `stop`. Leases whose release failed stay for the
/// trial's settling.
void stream(Cluster& cluster, Ledger& ledger, const std::atomic<bool>& stop, unsigned seed,
            int trial) {
    std::mt19937 rng(seed);
    std::array<std::unique_ptr<Client>, node_count> clients;
    const auto pick = [&] { return static_cast<int>(rng() % node_count); };
    // Runs `f` on node `i`'s connection: false after an error answer or a broken connection
    // (which is dropped, to reconnect next time).
    const auto attempt = [&](int i, auto&& f) {
        try {
            if (!clients[i]) clients[i] = std::make_unique<Client>(cluster.url(i), host_token, 3s);
            f(*clients[i]);
            return true;
        } catch (const rpc_error& e) {
            ledger.error(
                e.data().value("reason", "code " + std::to_string(static_cast<int>(e.code()))));
        } catch (const std::exception&) {
            clients[i].reset();
            ledger.error("transport (timeout or connection lost)");
        }
        return false;
    };
    long n = 0;
    while (!stop) {
        json lease;
        const bool acquired = attempt(pick(), [&](Client& c) {
            lease =
                c.call("leaseAcquire",
                       {{"companyId", "acme"}, {"environmentId", "fault"}, {"provider", "bwrap"}});
        });
        if (!acquired) {
            std::this_thread::sleep_for(50ms);  // pacing while a node is down
            continue;
        }
        ledger.status_seen(lease, "leaseAcquire");
        ledger.lease(lease, trial);
        {
            std::lock_guard lock(ledger.mutex);
            ++ledger.acquires;
        }
        const int channels = 1 + static_cast<int>(rng() % 3);
        for (int k = 0; k < channels && !stop; ++k) {
            const std::string line =
                "line " + std::to_string(seed) + "-" + std::to_string(++n) + "\n";
            const std::string linger = "0." + std::to_string(rng() % 4);
            attempt(pick(), [&](Client& c) {
                auto run =
                    c.run_channel(open_params(lease, {"sh", "-c", "cat; sleep " + linger}), line);
                const auto outcome = run.exit.value("outcome", "");
                std::lock_guard lock(ledger.mutex);
                ++ledger.channel_ends[outcome];
                if (outcome == "exited" && run.exit.value("exitCode", -1) == 0) {
                    if (run.out == line) {
                        ++ledger.channels_echoed;
                    } else {
                        ledger.violations.push_back("channel on " + lease["id"].get<std::string>() +
                                                    " echoed '" + run.out + "' for '" + line + "'");
                    }
                }
            });
        }
        attempt(pick(), [&](Client& c) {
            auto released = c.call("leaseRelease", {{"leaseId", lease["id"]}});
            ledger.status_seen(released, "leaseRelease");
            std::lock_guard lock(ledger.mutex);
            ++ledger.releases;
        });
    }
}

const std::set<std::string> settled_statuses = {"released", "expired", "retained",
                                                "pending_cleanup"};

/// Spans of time in which a probe's operation took over `slow` (an operation still running
/// past it counts up to now), merged while they last. Thread-safe.
class StallSpans {
public:
    static constexpr auto slow = 500ms;
    void begin(steady::time_point at) {
        std::lock_guard lock(mutex_);
        in_flight_ = at;
    }
    /// The operation begun at `sent` ended at `answered`; `ok` false counts as a stall.
    void end(steady::time_point sent, steady::time_point answered, bool ok) {
        std::lock_guard lock(mutex_);
        in_flight_.reset();
        if (ok && answered - sent <= slow) return;
        if (!spans_.empty() && spans_.back().second >= sent - 200ms) {
            spans_.back().second = answered;  // one span while it lasts
        } else {
            spans_.emplace_back(sent, answered);
        }
    }
    /// The time within [from, to] spent stalled.
    std::chrono::milliseconds within(steady::time_point from, steady::time_point to) const {
        std::lock_guard lock(mutex_);
        auto spans = spans_;
        if (in_flight_ && to - *in_flight_ > slow) spans.emplace_back(*in_flight_, to);
        std::chrono::milliseconds total{0};
        for (const auto& [a, b] : spans) {
            const auto lo = std::max(a, from), hi = std::min(b, to);
            if (hi > lo) total += std::chrono::duration_cast<std::chrono::milliseconds>(hi - lo);
        }
        return total;
    }

private:
    mutable std::mutex mutex_;
    std::optional<steady::time_point> in_flight_;
    std::vector<std::pair<steady::time_point, steady::time_point>> spans_;
};

/// Stalls of this machine as a writer sees them: every 100 ms, one 4 KiB page rewritten in an
/// unlinked file in /tmp (where the nodes write their logs and audit files); a stall is a
/// round that ended over 500 ms after it was due (a late wake-up or a throttled write). Never
/// added to a deadline, only reported beside a violation: it tells a node starved by other
/// work on the machine (a linker dirtying hundreds of MB throttles every writer) from a fault
/// of the daemon.
class HostProbe {
public:
    HostProbe() {
        std::string path = "/tmp/sandboxd-fault-probe-XXXXXX";
        fd_ = ::mkostemp(path.data(), O_CLOEXEC);
        if (fd_ >= 0) ::unlink(path.c_str());
        thread_ = std::thread([this] { run(); });
    }
    ~HostProbe() {
        stop_ = true;
        thread_.join();
        if (fd_ >= 0) ::close(fd_);
    }
    HostProbe(const HostProbe&) = delete;
    HostProbe& operator=(const HostProbe&) = delete;

    std::chrono::milliseconds stalled(steady::time_point from, steady::time_point to) const {
        return spans_.within(from, to);
    }

private:
    void run() {
        std::array<char, 4096> page{};
        while (!stop_) {
            const auto due = steady::now() + 100ms;
            std::this_thread::sleep_for(100ms);  // the probe's period, not a synchronisation
            spans_.begin(due);
            const bool ok = fd_ >= 0 && ::pwrite(fd_, page.data(), page.size(), 0) ==
                                            static_cast<ssize_t>(page.size());
            spans_.end(due, steady::now(), ok);
        }
    }

    int fd_ = -1;
    std::atomic<bool> stop_{false};
    StallSpans spans_;
    std::thread thread_;  // last: started once the rest is made
};

/// Measures the registry itself (etcd), apart from the nodes: a write every 100 ms from its own
/// thread (a put, so that it waits for etcd's fsync as the nodes' renewals do), and the
/// spans during which etcd did not answer one within 500 ms or refused it. A trial's
/// settling time is counted in node TTLs of a working registry: settle() extends its deadline
/// by the stall time inside it (at most 30 s), and the report counts those extensions, so a
/// host whose disk stalls etcd for seconds is told apart from a node that does not recover.
class RegistryProbe {
public:
    explicit RegistryProbe(const std::string& endpoint) {
        const auto hostport = endpoint.substr(endpoint.find("//") + 2);
        const auto colon = hostport.rfind(':');
        addr_.sin_family = AF_INET;
        addr_.sin_port = htons(static_cast<std::uint16_t>(std::stoi(hostport.substr(colon + 1))));
        ::inet_pton(AF_INET, hostport.substr(0, colon).c_str(), &addr_.sin_addr);
        thread_ = std::thread([this] { run(); });
    }
    ~RegistryProbe() {
        stop_ = true;
        thread_.join();
    }
    RegistryProbe(const RegistryProbe&) = delete;
    RegistryProbe& operator=(const RegistryProbe&) = delete;

    /// The time within [from, to] that the registry stalled (including a write still
    /// unanswered after 500 ms).
    std::chrono::milliseconds stalled(steady::time_point from, steady::time_point to) const {
        return spans_.within(from, to);
    }

private:
    void run() {
        while (!stop_) {
            const auto sent = steady::now();
            spans_.begin(sent);
            const bool ok = put();
            spans_.end(sent, steady::now(), ok);
            std::this_thread::sleep_for(100ms);  // the probe's period, not a synchronisation
        }
    }
    /// One etcd v3 put through its JSON gateway; true on an HTTP 200 within 30 s.
    bool put() const {
        const std::string body = R"({"key":"c2FuZGJveGQtZmF1bHQtcHJvYmU=","value":"MQ=="})";
        const std::string req =
            "POST /v3/kv/put HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n"
            "Content-Length: " +
            std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return false;
        const timeval limit{30, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
        std::string answer;
        if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr_), sizeof addr_) == 0 &&
            ::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
            char buf[1024];
            for (ssize_t n = 0; (n = ::read(fd, buf, sizeof buf)) > 0;) {
                answer.append(buf, static_cast<std::size_t>(n));
            }
        }
        ::close(fd);
        return answer.rfind("HTTP/1.1 200", 0) == 0;
    }

    sockaddr_in addr_{};
    std::atomic<bool> stop_{false};
    StallSpans spans_;
    std::thread thread_;  // last: started once the rest is made
};

/// Calls methods on any node that answers, from the main thread.
class AnyNode {
public:
    /// `timeout` bounds each call (a listing of every lease of a long run takes longer).
    AnyNode(Cluster& cluster, std::mt19937& rng, std::chrono::milliseconds timeout = 2s)
        : cluster_(cluster), rng_(rng), timeout_(timeout) {}
    /// The result of `method` from the first node that answers (nodes in random order), or
    /// nullopt after an error answer or when none answers; `error` says which.
    std::optional<json> call(const std::string& method, const json& params) {
        const int first = static_cast<int>(rng_() % node_count);
        for (int k = 0; k < node_count; ++k) {
            const int i = (first + k) % node_count;
            try {
                if (!clients_[i])
                    clients_[i] = std::make_unique<Client>(cluster_.url(i), host_token, timeout_);
                return clients_[i]->call(method, params);
            } catch (const rpc_error& e) {
                error = method + ": " + e.what();
                return std::nullopt;
            } catch (const std::exception& e) {
                error = method + " on " + Cluster::id_of(i) + ": " + e.what();
                clients_[i].reset();
            }
        }
        return std::nullopt;
    }
    /// Every lease of the registry with `status` ("" for all), page by page; nullopt when a
    /// page did not come.
    std::optional<std::vector<json>> list(const std::string& status) {
        std::vector<json> out;
        std::string cursor;
        do {
            json params = {{"limit", 500}};
            if (!status.empty()) params["status"] = status;
            if (!cursor.empty()) params["cursor"] = cursor;
            auto page = call("leaseList", params);
            if (!page) return std::nullopt;
            for (auto& l : (*page)["leases"]) out.push_back(l);
            const auto& next = (*page)["nextCursor"];
            cursor = next.is_string() ? next.get<std::string>() : "";
        } while (!cursor.empty());
        return out;
    }
    std::string error;

private:
    Cluster& cluster_;
    std::mt19937& rng_;
    std::chrono::milliseconds timeout_;
    std::array<std::unique_ptr<Client>, node_count> clients_;
};

/// Adds what the registry says of `leases` to the ledger (a lease whose acquire answer was
/// lost is known from here on), for `trial`.
void learn(Ledger& ledger, const std::vector<json>& leases, int trial) {
    std::lock_guard lock(ledger.mutex);
    for (const auto& l : leases) {
        ledger.leases.emplace(
            l["id"].get<std::string>(),
            Ledger::LeaseRecord{l["ownerNodeId"], l["providerLeaseId"], l["epoch"], trial});
    }
}

/// After a trial: releases what is still active (the registry's view, so an acquire whose
/// answer was lost is released too) and waits, at most 3 node TTLs from `end`, until every
/// lease of the trial is settled (released, expired, retained or pending_cleanup) and no
/// sandbox directory or process is left but those of leases in pending_cleanup. Records a
/// violation for what is still wrong then.
void settle(Cluster& cluster, Ledger& ledger, int trial, steady::time_point end, AnyNode& any,
            const RegistryProbe* probe, const HostProbe& host,
            std::map<std::string, long>& counts) {
    const auto due = end + 3 * cluster.ttl();
    // 3 node TTLs of a working registry: the registry's own stalls since `end` are added.
    const auto extension = [&] {
        return probe ? std::min<std::chrono::milliseconds>(probe->stalled(end, steady::now()), 30s)
                     : 0ms;
    };
    std::map<std::string, std::string> status;         // lease -> status last seen
    std::map<std::string, std::string> sandbox_lease;  // providerLeaseId -> lease
    {
        std::lock_guard lock(ledger.mutex);
        for (auto& [id, rec] : ledger.leases) {
            sandbox_lease[rec.provider_lease_id] = id;
            if (rec.trial == trial) status[id] = "active";
        }
    }
    std::string problem;
    const auto settled = [&] {
        auto active = any.list("active");
        if (!active) {
            problem = any.error;
            return false;
        }
        learn(ledger, *active, trial);
        for (const auto& l : *active) {
            const std::string id = l["id"];
            sandbox_lease[l["providerLeaseId"]] = id;
            status[id] = "active";
            if (auto r = any.call("leaseRelease", {{"leaseId", id}})) {
                ledger.status_seen(*r, "leaseRelease");
                status[id] = (*r)["status"];
            }
        }
        bool done = true;
        for (auto& [id, st] : status) {
            if (settled_statuses.contains(st)) continue;
            if (auto l = any.call("leaseGet", {{"leaseId", id}})) {
                ledger.status_seen(*l, "leaseGet");
                st = (*l)["status"];
            }
            if (!settled_statuses.contains(st)) {
                problem = concat("lease ", id, " is ", st);
                done = false;
            }
        }
        if (!done) return false;
        const auto pending = [&](const std::string& sandbox) {
            const auto it = sandbox_lease.find(sandbox);
            if (it == sandbox_lease.end()) return false;
            const auto st = status.find(it->second);
            return st != status.end() && st->second == "pending_cleanup";
        };
        // The sandbox, its lease and that lease's last seen status and owner: what a
        // violation needs to be followed in the kept logs.
        const auto name = [&](const std::string& sandbox) {
            const auto it = sandbox_lease.find(sandbox);
            if (it == sandbox_lease.end()) return "sandbox " + sandbox + " (lease unknown)";
            const auto st = status.find(it->second);
            std::string owner;
            {
                std::lock_guard lock(ledger.mutex);
                if (auto rec = ledger.leases.find(it->second); rec != ledger.leases.end()) {
                    owner = rec->second.owner;
                }
            }
            return concat("sandbox ", sandbox, " (lease ", it->second, ", ",
                          st == status.end() ? std::string("status unknown") : st->second,
                          ", owner ", owner.empty() ? std::string("unknown") : owner, ")");
        };
        auto dirs = cluster.sandbox_dirs();
        auto running = Cluster::sandboxes_with_processes();
        const bool unknown =
            std::any_of(dirs.begin(), dirs.end(),
                        [&](const auto& d) { return !sandbox_lease.contains(d.first); }) ||
            std::any_of(running.begin(), running.end(),
                        [&](const auto& r) { return !sandbox_lease.contains(r); });
        if (unknown) {
            // A lease whose acquire answer was lost and that is no longer active: learn it from
            // the log line of the node that made its sandbox, then its record. (Not a listing of
            // every lease: that grows with the run, 12,600 leases after 1,000 trials.)
            std::set<std::string> ids;
            for (const auto& d : dirs) {
                if (!sandbox_lease.contains(d.first)) ids.insert(d.first);
            }
            for (const auto& r : running) {
                if (!sandbox_lease.contains(r)) ids.insert(r);
            }
            std::vector<json> found;
            for (const auto& id : ids) {
                const auto lease = cluster.lease_of_sandbox(id);
                if (lease.empty()) {
                    problem = "sandbox " + id + " is on disk, and no node's log says it made it";
                    return false;
                }
                auto l = any.call("leaseGet", {{"leaseId", lease}});
                if (!l) {
                    problem = any.error;
                    return false;
                }
                found.push_back(std::move(*l));
                ++counts["sandboxes whose lease the checker learnt from a node's log"];
            }
            learn(ledger, found, trial);
            for (const auto& l : found) {
                sandbox_lease[l["providerLeaseId"]] = l["id"];
                if (!status.contains(l["id"])) status[l["id"]] = l["status"];
            }
        }
        for (const auto& [sandbox, on] : dirs) {
            if (!pending(sandbox)) {
                std::string where;
                for (int n : on) {
                    where += concat(where.empty() ? "" : ", ", Cluster::id_of(n), " (",
                                    cluster.describe_sandbox_dir(n, sandbox), ")");
                }
                problem = name(sandbox) + " still has its directory on " + where;
                return false;
            }
        }
        for (const auto& sandbox : running) {
            if (!pending(sandbox)) {
                problem = name(sandbox) + " still has processes";
                return false;
            }
        }
        return true;
    };
    // Said once: a leftover stays (and is checked again) in the trials after it.
    static std::set<std::string> said;
    const auto note_extension = [&](std::chrono::milliseconds more) {
        if (more <= 0ms) return;
        ++counts["settles that needed a registry stall's extension"];
        auto& longest = counts["longest registry stall in a settle (ms)"];
        longest = std::max(longest, static_cast<long>(more.count()));
    };
    while (!settled()) {
        if (const auto more = extension(); steady::now() >= due + more) {
            note_extension(more);
            if (said.insert(problem).second) {
                // This machine's own stalls meanwhile (other work on it), said, not excused.
                const auto host_stalls = host.stalled(end, steady::now());
                if (host_stalls > 0ms) {
                    ++counts["violations during host stalls"];
                    auto& longest = counts["longest host stall in a violating settle (ms)"];
                    longest = std::max(longest, static_cast<long>(host_stalls.count()));
                }
                ledger.violation(concat(
                    "trial ", std::to_string(trial), ": 3 node TTLs after its end",
                    more > 0ms
                        ? concat(" (and ", std::to_string(more.count()), " ms of registry stalls)")
                        : std::string(),
                    host_stalls > 0ms
                        ? concat(" (this machine stalled ", std::to_string(host_stalls.count()),
                                 " ms meanwhile)")
                        : std::string(),
                    ", ", problem));
            }
            return;
        }
        std::this_thread::sleep_for(100ms);  // polling the registry, bounded by the deadline
    }
    if (steady::now() > due) note_extension(extension());
    // A sandbox is only ever on its owner (two live owners would show as two nodes here).
    std::lock_guard lock(ledger.mutex);
    for (const auto& [sandbox, on] : cluster.sandbox_dirs()) {
        const auto it = sandbox_lease.find(sandbox);
        if (it == sandbox_lease.end()) continue;
        const auto& owner = ledger.leases[it->second].owner;
        for (int n : on) {
            if (Cluster::id_of(n) != owner) {
                ledger.violations.push_back("lease " + it->second + " has a sandbox on " +
                                            Cluster::id_of(n) + ", owner " + owner);
            }
        }
    }
}

/// Reaps the processes of killed nodes' trees that were re-parented to this program (a child
/// subreaper) and have exited; the nodes and etcd are reaped by their own fixtures.
void reap_orphans() {
    for (pid_t pid : descendants_of(::getpid())) {
        if (proc_state(pid) != 'Z') continue;
        const std::string stat = read_proc_file("/proc/" + std::to_string(pid) + "/stat");
        const auto open = stat.find('('), close = stat.rfind(')');
        if (open == std::string::npos || close == std::string::npos) continue;
        const std::string comm = stat.substr(open + 1, close - open - 1);
        if (comm == "sandboxd" || comm == "etcd") continue;
        std::istringstream fields(stat.substr(close + 2));
        char state = 0;
        pid_t parent = 0;
        fields >> state >> parent;
        if (parent == ::getpid()) ::waitpid(pid, nullptr, WNOHANG);
    }
}

/// The audit and the logs, after every node stopped.
void check_audit(Cluster& cluster, Ledger& ledger, std::map<std::string, long>& counts) {
    // When each lease left `active`: the earliest transition line of any node's log.
    static const std::regex left(
        R"(^(\S+) \w+ lease=(lse_[0-9a-f]+) (pending_cleanup:|released node=|expired node=|failed node=|retained))");
    std::map<std::string, std::string> left_at;
    for (int i = 0; i < node_count; ++i) {
        std::istringstream in(cluster.node(i).log());
        std::string line;
        while (std::getline(in, line)) {
            std::smatch m;
            // The sweeper's safety net (destroy_leftover_sandboxes): counted, so that a run
            // shows how often a teardown left a sandbox behind.
            if (line.find(" is still on node ") != std::string::npos &&
                line.find("destroying it") != std::string::npos) {
                ++counts["sandboxes of ended leases found left on disk by a sweeper"];
            }
            if (!std::regex_search(line, m, left)) continue;
            auto [it, fresh] = left_at.emplace(m[2], m[1]);
            if (!fresh && m[1].str() < it->second) it->second = m[1];
        }
    }
    struct Channel {  // NOLINT(bugprone-exception-escape): json's members, never thrown here
        json opened, ended;
        int ends = 0;
        int node = 0;
    };
    std::map<std::string, Channel> channels;  // instance/channel
    std::map<std::string, std::set<std::string>> nodes_of_lease;
    // The process that was stopped at the end is each node's last start ("... instance=<id>");
    // the earlier ones were killed.
    static const std::regex started(R"( version=\S+ registry=\S+ providers=\d+ instance=(\S+))");
    std::array<std::string, node_count> last_instance;
    for (int i = 0; i < node_count; ++i) {
        std::istringstream log(cluster.node(i).log());
        std::string line;
        while (std::getline(log, line)) {
            std::smatch m;
            if (std::regex_search(line, m, started)) last_instance[i] = m[1];
        }
        if (last_instance[i].empty()) {
            ledger.violations.push_back(
                concat(Cluster::id_of(i), "'s log never says its instance"));
        }
    }
    for (int i = 0; i < node_count; ++i) {
        std::ifstream in(cluster.audit(i));
        std::string text;
        while (std::getline(in, text)) {
            json line;
            try {
                line = json::parse(text);
            } catch (const json::exception&) {
                ledger.violations.push_back("audit of " + Cluster::id_of(i) +
                                            ": not JSON: " + text);
                continue;
            }
            // Only the channel lines: the audit also records connections and lease changes.
            const std::string event = line.value("event", "");
            if (event != "channel.opened" && event != "channel.ended") continue;
            const std::string key =
                line.value("instance", "") + "/" + std::to_string(line.value("channel", -1));
            auto& ch = channels[key];
            ch.node = i;
            if (line["event"] == "channel.opened") {
                ++counts["channels opened"];
                if (!ch.opened.is_null())
                    ledger.violations.push_back("channel " + key + " opened twice");
                ch.opened = line;
            } else if (line["event"] == "channel.ended") {
                ++counts["channels ended"];
                ++ch.ends;
                ch.ended = line;
            }
        }
    }
    std::lock_guard lock(ledger.mutex);
    for (const auto& [key, ch] : channels) {
        if (ch.opened.is_null()) {
            ledger.violations.push_back("channel " + key + " ended but never opened");
            continue;
        }
        const std::string lease = ch.opened.value("lease", "");
        const std::string node = ch.opened.value("node", "");
        nodes_of_lease[lease].insert(node);
        const auto rec = ledger.leases.find(lease);
        if (rec == ledger.leases.end()) {
            ledger.violations.push_back(
                concat("channel ", key, " ran on lease ", lease, " that no one acquired"));
        } else {
            if (node != rec->second.owner) {
                ledger.violations.push_back(concat("channel ", key, " of lease ", lease, " ran on ",
                                                   node, ", owner ", rec->second.owner));
            }
            if (ch.opened.value("epoch", std::int64_t{-1}) != rec->second.epoch) {
                ledger.violations.push_back(concat("channel ", key, " of lease ", lease,
                                                   " opened under epoch ",
                                                   ch.opened["epoch"].dump(), ", acquired under ",
                                                   std::to_string(rec->second.epoch)));
            }
        }
        // The command started by the time the line was written, and (for the built-in
        // provider, whose supervisor enforces it) before the node's fencing deadline.
        const std::string opened_at = ch.opened.value("time", "");
        const std::string deadline = ch.opened.value("startDeadline", opened_at);
        const std::string started_by = std::min(opened_at, deadline);
        const auto l = left_at.find(lease);
        if (l != left_at.end() && started_by > l->second) {
            ledger.violations.push_back(concat(
                "channel ", key, " of lease ", lease, " on ", node, " started by ", started_by,
                " (audited at ", opened_at, "), after the lease left active at ", l->second));
        }
        if (ch.ends > 1)
            ledger.violations.push_back("channel " + key + " ended " + std::to_string(ch.ends) +
                                        " times");
        const bool killed = ch.opened.value("instance", "") != last_instance[ch.node];
        if (ch.ends == 0) {
            if (killed) {
                ++counts["channels of killed processes (no end audited)"];
            } else {
                ledger.violations.push_back("channel " + key + " opened and never ended");
            }
        } else {
            ++counts["outcome " + ch.ended.value("outcome", "?")];
        }
    }
    for (const auto& [lease, nodes] : nodes_of_lease) {
        if (nodes.size() > 1) {
            ledger.violations.push_back("lease " + lease + " had channels on " +
                                        std::to_string(nodes.size()) + " nodes");
        }
    }
}

/// Set by SIGINT or SIGTERM: the run stops starting trials and goes on to its checks and report
/// (and stops its nodes), instead of dying and leaving them running.
std::atomic<bool> interrupted{false};

extern "C" void on_interrupt(int /*signal*/) { interrupted = true; }

/// Sets the stream's stop flag and joins its threads when it goes out of scope.
struct StopAndJoin {
    std::atomic<bool>& stop;
    std::vector<std::thread>& workers;
    StopAndJoin(std::atomic<bool>& s, std::vector<std::thread>& w) : stop(s), workers(w) {}
    StopAndJoin(const StopAndJoin&) = delete;
    StopAndJoin& operator=(const StopAndJoin&) = delete;
    ~StopAndJoin() {
        stop = true;
        for (auto& w : workers) {
            if (w.joinable()) w.join();
        }
    }
};

}  // namespace

/// Copies of sandboxd and sandboxd-init (found beside it) for this run, removed at exit: a run
/// lasts an hour or more, and a rebuild of the tree meanwhile replaced the binary while a node
/// restarted (its exec failed: a violation that was the build's, not the daemon's).
class PrivateBinaries {
public:
    PrivateBinaries() {
        std::string tmpl = "/tmp/sandboxd-fault-bin-XXXXXX";
        if (::mkdtemp(tmpl.data()) == nullptr) {
            throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
        }
        dir_ = tmpl;
        std::filesystem::copy_file(SANDBOXD_BIN, dir_ / "sandboxd");
        std::filesystem::copy_file(SANDBOXD_INIT_BIN, dir_ / "sandboxd-init");
        set_daemon_binary((dir_ / "sandboxd").string());
    }
    ~PrivateBinaries() {
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    PrivateBinaries(const PrivateBinaries&) = delete;
    PrivateBinaries& operator=(const PrivateBinaries&) = delete;

private:
    std::filesystem::path dir_;
};

int main(int argc, char** argv) {
    const Options o = parse(argc, argv);
    std::optional<PrivateBinaries> binaries;
    try {
        binaries.emplace();
    } catch (const std::exception& e) {
        std::cerr << "fault_trials: cannot copy sandboxd for the run: " << e.what() << "\n";
        return 1;
    }
    // Orphans of the nodes' trees stay this program's descendants (the process checks).
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    struct sigaction stop_action {};
    stop_action.sa_handler = on_interrupt;
    ::sigaction(SIGINT, &stop_action, nullptr);
    ::sigaction(SIGTERM, &stop_action, nullptr);
    const bool netns = private_network();
    const std::uint64_t seed =
        o.seed ? o.seed : static_cast<std::uint64_t>(steady::now().time_since_epoch().count());
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::cout << "fault trials: registry " << o.registry << ", " << o.trials << " trials, seed "
              << seed << ", nodeTtlMs " << o.node_ttl_ms << ", " << o.workers
              << " stream connections\n"
              << std::flush;
    const auto started = steady::now();
    Ledger ledger;
    std::map<std::string, long> counts;
    int ran = 0;
    try {
        Cluster cluster(o, netns);
        std::vector<fault> kinds = {fault::kill9, fault::sigstop};
        if (cluster.has_registry_fault()) kinds.push_back(fault::registry);
        if (cluster.has_link_cut()) kinds.push_back(fault::link_cut);
        const auto ttl = cluster.ttl();
        AnyNode any(cluster, rng);
        const HostProbe host;
        std::unique_ptr<RegistryProbe> probe;
        if (cluster.has_registry_fault())
            probe = std::make_unique<RegistryProbe>(cluster.registry_endpoint());
        for (int t = 0; t < o.trials; ++t) {
            if (interrupted) {
                std::cout << "stopping after " << t << " trials: interrupted\n";
                break;
            }
            if (o.max_seconds > 0 &&
                steady::now() - started > std::chrono::seconds(o.max_seconds)) {
                std::cout << "stopping after " << t << " trials: --max-seconds " << o.max_seconds
                          << "\n";
                break;
            }
            const fault f = kinds[static_cast<std::size_t>(t) % kinds.size()];
            const int victim = static_cast<int>(rng() % node_count);
            std::chrono::milliseconds hold =
                f == fault::sigstop ? ttl * 3 / 2
                                    : std::chrono::milliseconds(
                                          ttl.count() / 2 + static_cast<long>(rng() % ttl.count()));
            if (f == fault::kill9) hold = std::chrono::milliseconds(rng() % 500);
            std::atomic<bool> stop{false};
            std::vector<std::thread> workers;
            // Whatever happens below, the stream stops and its threads are joined (a thread
            // destroyed while joinable would end the run with std::terminate and no report).
            const StopAndJoin joiner{stop, workers};
            workers.reserve(static_cast<std::size_t>(o.workers));
            for (int w = 0; w < o.workers; ++w) {
                workers.emplace_back(stream, std::ref(cluster), std::ref(ledger), std::cref(stop),
                                     static_cast<unsigned>(rng()), t);
            }
            // The stream runs before, during and after the fault (pacing, not synchronisation).
            std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 500));
            try {
                if (!cluster.inject(f, victim, hold)) {
                    ledger.violation(concat("trial ", std::to_string(t),
                                            ": a node was not ready 30 s after ", name_of(f), ": ",
                                            cluster.not_ready()));
                }
            } catch (const std::exception& e) {
                // A node that did not come back (e.g. it exited during its restart): a violation
                // with its log's tail, and the run goes on to its checks and report.
                const std::string what = e.what();
                ledger.violation(concat(
                    "trial ", std::to_string(t), ": ", name_of(f), " of ", Cluster::id_of(victim),
                    " failed: ", what.size() > 4000 ? what.substr(what.size() - 4000) : what));
                stop = true;
                for (auto& w : workers) w.join();
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 300));
            stop = true;
            for (auto& w : workers) w.join();
            settle(cluster, ledger, t, steady::now(), any, probe.get(), host, counts);
            reap_orphans();
            ++counts[std::string("trials ") + name_of(f)];
            ++ran;
            if ((t + 1) % 10 == 0) {
                std::cout << "  " << t + 1 << " trials, " << ledger.violations.size()
                          << " violations, "
                          << std::chrono::duration_cast<std::chrono::seconds>(steady::now() -
                                                                              started)
                                 .count()
                          << " s\n"
                          << std::flush;
            }
        }
        // Every lease of the run, once more: settled, and known to the checker (pages of 500
        // leases: up to 30 s each).
        AnyNode lister(cluster, rng, 30s);
        if (auto all = lister.list("")) {
            learn(ledger, *all, -1);
            for (const auto& l : *all) {
                ledger.status_seen(l, "leaseList");
                ++counts["leases " + l["status"].get<std::string>()];
                if (!settled_statuses.contains(l["status"].get<std::string>())) {
                    ledger.violation("lease " + l["id"].get<std::string>() + " ends the run " +
                                     l["status"].get<std::string>());
                }
            }
        } else {
            ledger.violation("the final leaseList did not answer: " + lister.error);
        }
        cluster.stop_all();
        check_audit(cluster, ledger, counts);
        if (!ledger.violations.empty()) {
            // The nodes' logs, audits and state, to follow each violation.
            std::cout << "kept for the violations below: " << cluster.keep_files() << "\n";
        }
    } catch (const std::exception& e) {
        std::cerr << "fault_trials: " << e.what() << "\n";
        return 1;
    }
    const auto seconds =
        std::chrono::duration_cast<std::chrono::seconds>(steady::now() - started).count();
    std::cout << "\n" << ran << " trials on " << o.registry << " in " << seconds << " s\n";
    for (const auto& [k, v] : counts) std::cout << "  " << k << ": " << v << "\n";
    std::cout << "  acquires " << ledger.acquires << ", releases " << ledger.releases
              << ", channels echoed " << ledger.channels_echoed << "\n";
    for (const auto& [k, v] : ledger.channel_ends)
        std::cout << "  channel exit '" << k << "': " << v << "\n";
    for (const auto& [k, v] : ledger.errors) std::cout << "  error " << k << ": " << v << "\n";
    std::cout << "verdict: " << (ledger.violations.empty() ? "PASS" : "FAIL") << ", "
              << ledger.violations.size() << " violations\n";
    for (const auto& v : ledger.violations) std::cout << "  " << v << "\n";
    return ledger.violations.empty() ? 0 : 1;
}
