// A plugin written with the real paperclip plugin SDK (@paperclipai/plugin-sdk, pinned in
// plugins/sdk-local/package-lock.json), run unchanged by the real daemon under Node: the
// lifecycle, channels, worker restarts and resume, late answers, failing teardowns, and the
// quirks the SDK allows. The plugin journals every lifecycle call it receives
// ($SDK_LOCAL_ROOT/journal.jsonl), so the tests check what the daemon really sent.
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#ifndef SANDBOXD_SOURCE_DIR
#error "SANDBOXD_SOURCE_DIR must name the source tree"
#endif

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

const fs::path plugin_dir = fs::path(SANDBOXD_SOURCE_DIR) / "plugins" / "sdk-local";

/// A daemon whose only plugin is sdk-local, test hooks on. `entry` is merged into the
/// plugin's config entry, `top` into the daemon's config.
struct SdkDaemon {
    explicit SdkDaemon(json entry = json::object(), json top = json::object(),
                       const std::string& node_id = "node-a") {
        REQUIRE(fs::exists(plugin_dir / "node_modules" / "@paperclipai" / "plugin-sdk" /
                           "package.json"));  // scripts/test runs `npm ci` there
        json plugin = {{"pluginId", "sdk-local"},
                       {"provider", "sdk-local"},
                       {"command", {"node", (plugin_dir / "worker.js").string()}},
                       {"env",
                        {{"SDK_LOCAL_ROOT", root().string()},
                         {"SDK_LOCAL_TEST_HOOKS", "1"},
                         {"SDK_LOCAL_STOP_GRACE_MS", "200"}}},
                       {"manifest", (plugin_dir / "manifest.json").string()},
                       {"config", {{"region", "local"}}}};
        plugin.update(entry);
        json config = top;
        config["providers"] = {{"plugins", {plugin}}};
        daemon = std::make_unique<DaemonProcess>(node_id, config.dump());
    }
    fs::path root() const { return dir.path() / "leases"; }

    /// Every lifecycle call the plugin received, in order.
    std::vector<json> journal() const {
        std::vector<json> out;
        std::ifstream in(root() / "journal.jsonl");
        for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
        return out;
    }
    std::vector<json> journal_of(const std::string& method) const {
        std::vector<json> out;
        for (auto& entry : journal()) {
            if (entry["method"] == method) out.push_back(entry);
        }
        return out;
    }
    /// The daemon's live children that run the worker (found through its own pid).
    std::vector<pid_t> worker_pids() const {
        std::vector<pid_t> out;
        for (pid_t pid : daemon->children()) {
            const std::string cmdline = read_proc_file("/proc/" + std::to_string(pid) + "/cmdline");
            if (cmdline.find("worker.js") != std::string::npos && proc_state(pid) != 'Z') {
                out.push_back(pid);
            }
        }
        return out;
    }
    /// Lease directories left under the root.
    std::vector<std::string> lease_dirs() const {
        std::vector<std::string> out;
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(root(), ec)) {
            if (e.is_directory()) out.push_back(e.path().filename().string());
        }
        return out;
    }

    TempDir dir;
    std::unique_ptr<DaemonProcess> daemon;
};

json acquire_params(json extra = json::object()) {
    json p = {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "sdk-local"}};
    p.update(extra);
    return p;
}

/// leaseAcquire, waiting out PROVIDER_NOT_READY while the worker starts (Node takes ~1 s).
json acquire(Client& c, json extra = json::object()) {
    const auto deadline = std::chrono::steady_clock::now() + seconds(60);
    for (;;) {
        try {
            return c.call("leaseAcquire", acquire_params(extra));
        } catch (const rpc_error& e) {
            if (e.data().value("reason", "") != "PROVIDER_NOT_READY" ||
                std::chrono::steady_clock::now() > deadline) {
                throw;
            }
        }
        std::this_thread::sleep_for(milliseconds(100));
    }
}

std::string every_byte(std::size_t size) {
    std::string s(size, '\0');
    for (std::size_t i = 0; i < size; ++i) s[i] = static_cast<char>((i * 7 + i / 256) & 0xff);
    return s;
}

/// Runs a channel to its exit. The SDK has no stdin half-close: stdin stays open.
ChannelRun run_sdk(Client& c, const json& params, const std::string& data = {}) {
    return c.run_channel(params, data, false);
}

/// Reads events until `channel`'s exit and returns its params (each wait is bounded by the
/// client's timeout, which throws). Data of the channel is counted in `data_bytes`, never
/// credited.
json wait_exit(Client& c, const json& channel, std::size_t* data_bytes = nullptr) {
    for (;;) {
        ClientEvent ev = c.next_event();
        if (ev.type == ClientEvent::kind::data && channel == ev.channel) {
            if (data_bytes) *data_bytes += ev.bytes.size();
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit" &&
                   ev.message["params"]["channel"] == channel) {
            return ev.message["params"];
        }
    }
}

/// "2026-12-01T21:18:28.123Z" as ms since the epoch.
std::int64_t parse_rfc3339_ms(const std::string& text) {
    std::tm tm{};
    const char* rest = ::strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
    REQUIRE(rest != nullptr);
    const int ms = std::atoi(rest + 1);
    return static_cast<std::int64_t>(::timegm(&tm)) * 1000 + ms;
}

/// The daemon config of two nodes sharing the SQLite registry in `shared`, in proxy mode, with
/// a host token "host-secret" and a peer token.
json two_nodes(const TempDir& shared) {
    return {
        {"registry", {{"kind", "sqlite"}, {"path", (shared.path() / "registry.db").string()}}},
        {"auth",
         {{"tokens",
           {{{"name", "host"}, {"token", "host-secret"}, {"role", "host"}, {"tenants", {"*"}}},
            {{"name", "peer"}, {"token", "peer-secret"}, {"role", "peer"}, {"tenants", {"*"}}}}}}},
        {"routing", {{"mode", "proxy"}, {"nodeTtlMs", 3000}, {"heartbeatMs", 300}}}};
}

std::string status_of(Client& c, const json& lease) {
    return c.call("leaseGet", {{"leaseId", lease["id"]}})["status"].get<std::string>();
}

}  // namespace

TEST_CASE(
    "An SDK plugin's lease: acquire with the SDK's params, its metadata kept, release and "
    "destroy with config and leaseMetadata",
    "[plugin][sdk]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    // No runId from the host: the lease id is sent (the SDK requires one).
    auto lease = acquire(*c, {{"config", {{"size", "small"}, {"expiresInMs", 600000}}},
                              {"issueId", "iss-1"},
                              {"agentId", "agent-7"},
                              {"ttlMs", 3600000}});
    CHECK(lease["metadata"] == json{{"pluginId", "sdk-local"}, {"provider", "sdk-local"}});
    const std::string plid = lease["providerLeaseId"].get<std::string>();
    CHECK(lease["providerMetadata"] ==
          json{{"dir", (sd.root() / plid).string()}, {"createdBy", "sdk-local"}});
    CHECK(lease["agentId"] == "agent-7");
    // The plugin's expiresAt (10 min) bounds the lease's (1 h).
    auto acquired = sd.journal_of("environmentAcquireLease");
    REQUIRE(acquired.size() == 1);
    CHECK(acquired[0]["result"]["expiresAt"] == lease["expiresAt"]);
    const json& sent = acquired[0]["params"];
    CHECK(sent["driverKey"] == "sdk-local");
    CHECK(sent["companyId"] == "acme");
    CHECK(sent["environmentId"] == "dev");
    CHECK(sent["issueId"] == "iss-1");
    CHECK(sent["runId"] == lease["id"]);
    CHECK(sent["agentId"] == "agent-7");
    CHECK(sent["executionWorkspaceId"].is_null());
    CHECK(sent["config"] == json{{"size", "small"}, {"expiresInMs", 600000}});
    CHECK(sent["requestedExpiresAt"].is_string());
    // The worker's config.get was served from the entry's instance config.
    auto acquire_record = json::parse(std::ifstream(sd.root() / plid / "acquire.json"));
    CHECK(acquire_record["instanceConfig"] == json{{"region", "local"}});

    // The host's runId is sent as it is.
    auto second = acquire(*c, {{"runId", "run-42"}});
    CHECK(sd.journal_of("environmentAcquireLease").back()["params"]["runId"] == "run-42");

    auto released = c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(released["status"] == "released");
    for (const char* method : {"environmentReleaseLease", "environmentDestroyLease"}) {
        auto calls = sd.journal_of(method);
        REQUIRE(calls.size() == 1);
        CHECK_FALSE(calls[0].contains("error"));
        const json& p = calls[0]["params"];
        CHECK(p["providerLeaseId"] == plid);
        CHECK(p["config"] == json{{"size", "small"}, {"expiresInMs", 600000}});
        CHECK(p["leaseMetadata"] == lease["providerMetadata"]);
        CHECK(p["issueId"] == "iss-1");
        CHECK(p["cancelActiveWork"] == false);
    }
    CHECK_FALSE(fs::exists(sd.root() / plid));
    c->call("leaseRelease", {{"leaseId", second["id"]}});
    CHECK(sd.lease_dirs().empty());
    // The worker's log notifications reach the daemon's log with the plugin id.
    CHECK(sd.daemon->log().find("plugin=sdk-local") != std::string::npos);
    CHECK(sd.daemon->log().find("environmentAcquireLease ok") != std::string::npos);
}

TEST_CASE(
    "SDK plugin channels: bytes exact both ways, exit codes, and what the SDK cannot carry "
    "refused",
    "[plugin][sdk]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    auto lease = acquire(*c);

    // 1 MiB of every byte value in, and back out, byte for byte; the exit code passes.
    const std::string data = every_byte(1 << 20);
    auto run = run_sdk(
        *c, open_params(lease, {"sh", "-c", "head -c " + std::to_string(data.size()) + "; exit 7"}),
        data);
    CHECK(run.out.size() == data.size());
    CHECK(run.out == data);
    CHECK(run.exit["exitCode"] == 7);
    CHECK(run.exit["outcome"] == "exited");
    CHECK(run.exit["stdinBytes"] == data.size());

    // The SDK has one output stream: stderr arrives merged, stderrBytes stays 0.
    run = run_sdk(*c, open_params(lease, {"sh", "-c", "printf out; printf err >&2"}));
    CHECK(run.out.find("out") != std::string::npos);
    CHECK(run.out.find("err") != std::string::npos);
    CHECK(run.err.empty());
    CHECK(run.exit["stderrBytes"] == 0);
    CHECK(run.exit["exitCode"] == 0);

    // Any integer exit code passes through.
    run = run_sdk(*c, open_params(lease, {"__exit__", "300"}));
    CHECK(run.exit["exitCode"] == 300);

    // Data and exit sent before the open answer are held and delivered after it, in order.
    run = run_sdk(*c, open_params(lease, {"__data_before_answer__", "sh", "-c", "printf after"}));
    CHECK(run.out == "data before answer\nafter");
    CHECK(run.exit["exitCode"] == 0);
    run =
        run_sdk(*c, open_params(lease, {"__data_before_answer__", "__exit_before_answer__", "5"}));
    CHECK(run.out == "data before answer\n");
    CHECK(run.exit["exitCode"] == 5);
    CHECK(run.messages_after_exit == 0);

    // Controls the SDK has no method for are refused, naming the method; the channel goes on.
    auto ch = c->call("duplexChannelOpen", open_params(lease, {"cat"}))["channel"];
    for (const auto& [method, params] : std::vector<std::pair<std::string, json>>{
             {"duplexChannelCloseStdin", {{"channel", ch}}},
             {"duplexChannelSignal", {{"channel", ch}, {"signal", "INT"}}}}) {
        try {
            c->call(method, params);
            FAIL(method << " was accepted");
        } catch (const rpc_error& e) {
            CHECK(e.data().value("reason", "") == "INVALID_PARAMS");
            CHECK(e.data().value("field", "") == method);
        }
    }
    // duplexChannelStop ends it (the plugin closes stdin, then signals).
    c->call("duplexChannelStop", {{"channel", ch}});
    CHECK(wait_exit(*c, ch)["outcome"] == "stopped");

    // Fields the SDK's open has no room for are refused, naming the field.
    CHECK(plugin_fields_not_refused(*c, lease).empty());
}

TEST_CASE("A killed SDK worker is restarted and its leases are resumed on first use",
          "[plugin][sdk][supervision]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    auto lease = acquire(*c);
    auto run = run_sdk(*c, open_params(lease, {"echo", "before"}));
    REQUIRE(run.out == "before\n");

    // A channel running when the worker dies ends as transportClosed.
    auto ch = c->call("duplexChannelOpen", open_params(lease, {"sleep", "60"}))["channel"];
    auto pids = sd.worker_pids();
    REQUIRE(pids.size() == 1);
    REQUIRE(::kill(pids[0], SIGKILL) == 0);
    CHECK(wait_exit(*c, ch)["outcome"] == "transportClosed");

    // The restarted worker's cache is empty: the first open resumes the lease through
    // environmentResumeLease with its leaseMetadata, then runs.
    REQUIRE(eventually(
        [&] {
            auto now = sd.worker_pids();
            return now.size() == 1 && now[0] != pids[0];
        },
        seconds(20)));
    const auto open_deadline = std::chrono::steady_clock::now() + seconds(30);
    for (;;) {
        try {
            run = run_sdk(*c, open_params(lease, {"echo", "after"}));
            break;
        } catch (const rpc_error& e) {
            if (e.data().value("reason", "") != "PROVIDER_NOT_READY" ||
                std::chrono::steady_clock::now() > open_deadline) {
                throw;
            }
        }
        std::this_thread::sleep_for(milliseconds(100));
    }
    CHECK(run.out == "after\n");
    CHECK(run.exit["exitCode"] == 0);
    auto resumed = sd.journal_of("environmentResumeLease");
    INFO("journal: " << json(sd.journal()).dump() << "\nlog: " << sd.daemon->log());
    REQUIRE(resumed.size() == 1);
    CHECK(resumed[0]["params"]["providerLeaseId"] == lease["providerLeaseId"]);
    CHECK(resumed[0]["params"]["leaseMetadata"] == lease["providerMetadata"]);
    CHECK_FALSE(resumed[0].contains("error"));
    CHECK(status_of(*c, lease) == "active");
    // Once resumed, later opens go straight through.
    run = run_sdk(*c, open_params(lease, {"echo", "again"}));
    CHECK(run.out == "again\n");
    CHECK(sd.journal_of("environmentResumeLease").size() == 1);

    // A lease the plugin cannot resume (its sandbox is gone) fails closed and is cleaned up.
    auto other = acquire(*c);
    fs::remove_all(sd.root() / other["providerLeaseId"].get<std::string>());
    pids = sd.worker_pids();
    REQUIRE(pids.size() == 1);
    REQUIRE(::kill(pids[0], SIGKILL) == 0);
    REQUIRE(eventually(
        [&] {
            auto now = sd.worker_pids();
            return now.size() == 1 && now[0] != pids[0];
        },
        seconds(20)));
    std::string reason;
    REQUIRE(eventually(
        [&] {
            reason = error_reason(*c, "duplexChannelOpen", open_params(other, {"true"}));
            return reason != "PROVIDER_NOT_READY";
        },
        seconds(30)));
    CHECK(reason == "SANDBOX_NOT_CACHED");
    CHECK(status_of(*c, other) != "active");
}

TEST_CASE("An SDK acquire answered after its timeout is recorded and torn down: no leak",
          "[plugin][sdk]") {
    SdkDaemon sd({{"timeoutsMs", {{"environmentAcquireLease", 1000}}}},
                 {{"routing", {{"heartbeatMs", 100}}}});
    auto c = sd.daemon->connect();
    acquire(*c);  // the worker is up
    try {
        c->call("leaseAcquire", acquire_params({{"config", {{"acquireDelayMs", 3000}}}}));
        FAIL("the slow acquire succeeded");
    } catch (const rpc_error& e) {
        CHECK(e.data().value("reason", "") == "PROVIDER_ERROR");
        CHECK(std::string(e.what()).find("timed out after 1000 ms") != std::string::npos);
    }
    // The late sandbox becomes a pending_cleanup lease of this node, then released.
    json late;
    REQUIRE(eventually(
        [&] {
            const json list = c->call("leaseList", {{"companyId", "acme"}});
            for (const auto& l : list["leases"]) {
                if (l["cleanupStatus"] == "acquire answered after its timeout" ||
                    l["failureReason"] ==
                        "the provider answered environmentAcquireLease after its timeout") {
                    late = l;
                }
            }
            return !late.is_null() && late["status"] == "released";
        },
        seconds(30)));
    const std::string plid = late["providerLeaseId"].get<std::string>();
    CHECK_FALSE(fs::exists(sd.root() / plid));
    auto destroyed = sd.journal_of("environmentDestroyLease");
    REQUIRE(destroyed.size() == 1);
    CHECK(destroyed[0]["params"]["providerLeaseId"] == plid);
    CHECK(destroyed[0]["params"]["config"] == json{{"acquireDelayMs", 3000}});
}

TEST_CASE("An SDK teardown that fails 7 times is retried until it succeeds, never failed",
          "[plugin][sdk]") {
    SdkDaemon sd({{"cleanup", {{"attempts", 3}, {"backoffMs", 100}, {"slowRetryMs", 300}}}},
                 {{"routing", {{"heartbeatMs", 100}}}});
    auto c = sd.daemon->connect();
    auto lease = acquire(*c, {{"config", {{"failTeardowns", 7}}}});
    auto released = c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(released["status"] == "pending_cleanup");
    std::set<std::string> seen;
    REQUIRE(eventually(
        [&] {
            const auto status = status_of(*c, lease);
            seen.insert(status);
            return status == "released";
        },
        seconds(60)));
    CHECK_FALSE(seen.count("failed"));
    auto releases = sd.journal_of("environmentReleaseLease");
    int failures = 0;
    for (auto& r : releases) failures += r.contains("error") ? 1 : 0;
    CHECK(failures == 7);
    CHECK(releases.size() == 8);
    CHECK(sd.journal_of("environmentDestroyLease").size() == 1);
    CHECK_FALSE(fs::exists(sd.root() / lease["providerLeaseId"].get<std::string>()));
    // Warned once when the quick attempts ran out.
    const auto log = sd.daemon->log();
    const auto first = log.find("retrying every 300 ms");
    CHECK(first != std::string::npos);
    CHECK(log.find("retrying every 300 ms", first + 1) == std::string::npos);
}

TEST_CASE(
    "A node restarted with the same nodeId keeps its SDK plugin leases active and resumes "
    "them on first use",
    "[plugin][sdk][supervision]") {
    SdkDaemon sd(json::object(), {{"routing", {{"heartbeatMs", 100}, {"nodeTtlMs", 1000}}}});
    auto c = sd.daemon->connect();
    auto lease = acquire(*c);
    REQUIRE(run_sdk(*c, open_params(lease, {"echo", "before"})).out == "before\n");
    c.reset();
    sd.daemon->restart();
    c = sd.daemon->connect();
    // Past a liveness TTL the sweeper has looked at this node's own leases: it leaves a
    // lease its plugin can resume active instead of orphaning it.
    acquire(*c);  // the new worker is up
    // The node's own heartbeats say when it has run for a TTL plus a few sweeps.
    REQUIRE(eventually(
        [&] {
            const json nodes = c->call("nodeList", json::object());
            for (const auto& n : nodes["nodes"]) {
                if (n["nodeId"] != "node-a") continue;
                return parse_rfc3339_ms(n["heartbeatAt"].get<std::string>()) -
                           parse_rfc3339_ms(n["startedAt"].get<std::string>()) >=
                       1500;
            }
            return false;
        },
        seconds(20)));
    CHECK(status_of(*c, lease) == "active");
    auto run = run_sdk(*c, open_params(lease, {"echo", "after"}));
    CHECK(run.out == "after\n");
    auto resumed = sd.journal_of("environmentResumeLease");
    INFO("journal: " << json(sd.journal()).dump() << "\nlog: " << sd.daemon->log());
    REQUIRE(resumed.size() == 1);
    CHECK(resumed[0]["params"]["leaseMetadata"] == lease["providerMetadata"]);
    CHECK(status_of(*c, lease) == "active");
}

TEST_CASE("An SDK plugin channel whose host does not credit its output ends with FLOW_CONTROL",
          "[plugin][sdk]") {
    SdkDaemon sd(json{{"maxBufferedBytes", 65536}});
    auto c = sd.daemon->connect();
    auto lease = acquire(*c);
    // 64 MiB of output; the host credits nothing (its window is 1 MiB by default).
    auto ch = c->call("duplexChannelOpen",
                      open_params(lease, {"head", "-c", "67108864", "/dev/zero"}))["channel"];
    std::size_t received = 0;
    const json exit = wait_exit(*c, ch, &received);
    CHECK(exit["outcome"] == "error");
    CHECK(exit["error"]["data"]["reason"] == "FLOW_CONTROL");
    CHECK(received <= (1U << 20));
    CHECK(sd.daemon->log().find("maxBufferedBytes") != std::string::npos);
}

TEST_CASE(
    "SDK plugin leases carry capabilities and the host's metadata, and probe and config "
    "validation reach the plugin",
    "[plugin][sdk]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    const json host_metadata = {{"team", "blue"}, {"pluginId", "not-trusted"}};
    auto lease = acquire(*c, {{"metadata", host_metadata}});
    const json capabilities = {"channels",         "probe", "validateConfig", "resume", "execute",
                               "realizeWorkspace", "retain"};
    CHECK(lease["capabilities"] == capabilities);
    CHECK(lease["hostMetadata"] == host_metadata);
    CHECK(lease["metadata"] == json{{"pluginId", "sdk-local"}, {"provider", "sdk-local"}});
    CHECK(c->call("leaseGet", {{"leaseId", lease["id"]}})["hostMetadata"] == host_metadata);
    // initialize names every provider and what it serves, before any acquire.
    const json init = c->call("initialize", {{"protocolVersion", 1}});
    bool listed = false;
    for (const auto& p : init["providers"]) {
        if (p["provider"] != "sdk-local") continue;
        listed = true;
        CHECK(p["pluginId"] == "sdk-local");
        CHECK(p["ready"] == true);
        CHECK(p["capabilities"] == capabilities);
    }
    CHECK(listed);
    // A bad host metadata changes nothing.
    CHECK(error_reason(*c, "leaseAcquire", acquire_params({{"metadata", "text"}})) ==
          "INVALID_PARAMS");

    // leaseProbe: the plugin's environmentProbe with the lease's scope, its result verbatim.
    const json probe = c->call("leaseProbe", {{"leaseId", lease["id"]}});
    CHECK(probe["ok"] == true);
    CHECK(probe["metadata"]["root"] == sd.root().string());
    CHECK(probe["metadata"]["companyId"] == "acme");
    auto probes = sd.journal_of("environmentProbe");
    REQUIRE(probes.size() == 1);
    CHECK(probes[0]["params"]["driverKey"] == "sdk-local");
    CHECK(probes[0]["params"]["environmentId"] == "dev");
    CHECK(probes[0]["params"]["config"] == json::object());

    // providerValidateConfig: environmentValidateConfig, verbatim.
    json v = c->call("providerValidateConfig",
                     {{"provider", "sdk-local"}, {"config", {{"expiresInMs", -1}}}});
    CHECK(v["ok"] == false);
    CHECK(v["errors"] == json{"config.expiresInMs must be a non-negative integer"});
    v = c->call("providerValidateConfig",
                {{"provider", "sdk-local"}, {"config", {{"expiresInMs", 5000}}}});
    CHECK(v["ok"] == true);
    CHECK(v["normalizedConfig"] == json{{"expiresInMs", 5000}});
    CHECK(error_reason(*c, "providerValidateConfig", {{"provider", "nope"}}) == "INVALID_PARAMS");

    // A released lease cannot be probed.
    c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(error_reason(*c, "leaseProbe", {{"leaseId", lease["id"]}}) == "LEASE_NOT_ACTIVE");
}

TEST_CASE(
    "leaseExecute and leaseRealizeWorkspace reach the SDK plugin: its logs stream before "
    "the answer, which is the plugin's verbatim",
    "[plugin][sdk]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    auto lease = acquire(*c);
    const std::string plid = lease["providerLeaseId"].get<std::string>();
    const auto pids = sd.worker_pids();
    REQUIRE(pids.size() == 1);

    auto ex = execute(
        *c, {{"leaseId", lease["id"]},
             {"command", "sh"},
             {"args", {"-c", "printf 'one '; printf 'err' >&2; read x; printf \"$x $A\"; exit 3"}},
             {"env", {{"A", "env-a"}}},
             {"stdin", "from-stdin\n"}});
    CHECK(ex.result == json{{"exitCode", 3},
                            {"signal", nullptr},
                            {"timedOut", false},
                            {"stdout", "one from-stdin env-a"},
                            {"stderr", "err"},
                            {"metadata", {{"pid", pids[0]}}}});
    // Every chunk the plugin logged came before the answer, under this request's id.
    CHECK(ex.logged("stdout") == "one from-stdin env-a");
    CHECK(ex.logged("stderr") == "err");
    // The SDK's params: the lease's scope and reference filled in by the daemon, the host's
    // fields as given, timeoutMs defaulted; no leaseId.
    auto calls = sd.journal_of("environmentExecute");
    REQUIRE(calls.size() == 1);
    const json& p = calls[0]["params"];
    CHECK(p["driverKey"] == "sdk-local");
    CHECK(p["companyId"] == "acme");
    CHECK(p["environmentId"] == "dev");
    CHECK(p["lease"]["providerLeaseId"] == plid);
    CHECK(p["lease"]["metadata"] == lease["providerMetadata"]);
    CHECK(p["command"] == "sh");
    CHECK(p["stdin"] == "from-stdin\n");
    CHECK(p["timeoutMs"] == 300000);
    CHECK_FALSE(p.contains("leaseId"));

    // The plugin's own timeout: timedOut, killed.
    ex = execute(
        *c, {{"leaseId", lease["id"]}, {"command", "sleep"}, {"args", {"30"}}, {"timeoutMs", 300}});
    CHECK(ex.result["timedOut"] == true);
    CHECK(ex.result["exitCode"].is_null());
    CHECK(ex.result["signal"] == "SIGKILL");

    // Bad params change nothing and never reach the worker.
    CHECK(error_reason(*c, "leaseExecute", {{"leaseId", lease["id"]}}) == "INVALID_PARAMS");
    CHECK(error_reason(*c, "leaseExecute",
                       {{"leaseId", lease["id"]}, {"command", "true"}, {"args", "x"}}) ==
          "INVALID_PARAMS");
    CHECK(error_reason(*c, "leaseExecute",
                       {{"leaseId", lease["id"]}, {"command", "true"}, {"timeoutMs", 0}}) ==
          "INVALID_PARAMS");
    CHECK(error_reason(*c, "leaseExecute",
                       {{"leaseId", lease["id"]}, {"command", "true"}, {"companyId", "x"}}) ==
          "INVALID_PARAMS");
    CHECK(error_reason(*c, "leaseExecute", {{"leaseId", "lse_nope"}, {"command", "true"}}) ==
          "LEASE_NOT_FOUND");
    CHECK(sd.journal_of("environmentExecute").size() == 2);

    // leaseRealizeWorkspace: environmentRealizeWorkspace with the lease, verbatim answer.
    const json realized = c->call(
        "leaseRealizeWorkspace",
        {{"leaseId", lease["id"]}, {"workspace", {{"remotePath", "src"}, {"mode", "fresh"}}}});
    CHECK(realized == json{{"cwd", (sd.root() / plid / "src").string()},
                           {"metadata", {{"mode", "fresh"}, {"providerLeaseId", plid}}}});
    CHECK(fs::is_directory(sd.root() / plid / "src"));
    // localPath names a file of the node: refused before the worker sees it.
    try {
        c->call("leaseRealizeWorkspace",
                {{"leaseId", lease["id"]}, {"workspace", {{"localPath", "/etc"}}}});
        FAIL("localPath accepted");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        CHECK(e.data().value("field", "") == "workspace.localPath");
    }
    CHECK(sd.journal_of("environmentRealizeWorkspace").size() == 1);

    c->call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(error_reason(*c, "leaseExecute", {{"leaseId", lease["id"]}, {"command", "true"}}) ==
          "LEASE_NOT_ACTIVE");
}

TEST_CASE(
    "Built-in leases carry capabilities, and probe, config validation and execute go "
    "through bwrap",
    "[plugin][sdk]") {
    SdkDaemon sd;  // the built-in provider is on beside the plugin
    auto c = sd.daemon->connect();
    auto lease = c->call("leaseAcquire", {{"companyId", "acme"},
                                          {"environmentId", "dev"},
                                          {"provider", "bwrap"},
                                          {"metadata", {{"k", 1}}}});
    CHECK(lease["capabilities"] == json{"channels", "pty", "stderr", "signals", "closeStdin",
                                        "resize", "probe", "execute", "validateConfig", "network"});
    CHECK(lease["hostMetadata"] == json{{"k", 1}});
    CHECK(lease["providerMetadata"].is_null());
    const json probe = c->call("leaseProbe", {{"leaseId", lease["id"]}});
    CHECK(probe["ok"] == true);
    CHECK(probe["summary"] ==
          "sandbox " + lease["providerLeaseId"].get<std::string>() + " is running");
    CHECK(probe["metadata"]["limits"] == lease["limits"]);
    json v = c->call("providerValidateConfig",
                     {{"provider", "bwrap"}, {"config", {{"limits", {{"pids", 1}}}}}});
    CHECK(v["ok"] == false);
    REQUIRE(v["errors"].size() == 1);
    CHECK(v["errors"][0].get<std::string>().find("config.limits.pids") != std::string::npos);
    v = c->call("providerValidateConfig", {{"provider", "bwrap"}, {"config", json::object()}});
    CHECK(v["ok"] == true);
    CHECK(v["normalizedConfig"]["limits"] == lease["limits"]);

    // leaseExecute runs as a channel in the sandbox: stdout and stderr apart, stdin, env,
    // cwd, the exit code; its logs come before the answer.
    auto ex = execute(
        *c, {{"leaseId", lease["id"]},
             {"command", "/bin/sh"},
             {"args",
              {"-c", "printf out; printf err >&2; cat; printf \" $A $(pwd) $(id -u)\"; exit 3"}},
             {"env", {{"A", "a1"}}},
             {"cwd", "/tmp"},
             {"stdin", "in"}});
    CHECK(ex.result["exitCode"] == 3);
    CHECK(ex.result["signal"].is_null());
    CHECK(ex.result["timedOut"] == false);
    CHECK(ex.result["stdout"] == "outin a1 /tmp 0");  // uid 0 of the sandbox's namespace
    CHECK(ex.result["stderr"] == "err");
    CHECK(ex.result["metadata"]["truncated"] == false);
    CHECK(ex.result["metadata"]["stdoutBytes"] == 15);
    CHECK(ex.logged("stdout") == ex.result["stdout"]);
    CHECK(ex.logged("stderr") == ex.result["stderr"]);

    // The timeout kills it.
    ex = execute(
        *c, {{"leaseId", lease["id"]}, {"command", "sleep"}, {"args", {"30"}}, {"timeoutMs", 200}});
    CHECK(ex.result["timedOut"] == true);
    CHECK(ex.result["exitCode"].is_null());
    CHECK(ex.result["signal"] == "SIGKILL");

    // A command that leaves a process behind: the answer, with the command's own output,
    // comes once the drain grace has ended that process. Executes back to back then each
    // answer at the channel init's "end" (the init's own exit comes after the answer) and
    // leave nothing held once those inits are gone.
    ex = execute(
        *c,
        {{"leaseId", lease["id"]}, {"command", "/bin/sh"}, {"args", {"-c", "sleep 60 & echo bg"}}});
    CHECK(ex.result["exitCode"] == 0);
    CHECK(ex.result["stdout"] == "bg\n");
    const std::size_t fds_before = sd.daemon->fd_count();
    for (int i = 0; i < 20; ++i) {
        ex = execute(*c, {{"leaseId", lease["id"]}, {"command", "true"}});
        REQUIRE(ex.result["exitCode"] == 0);
    }
    CHECK(eventually([&] { return sd.daemon->fd_count() <= fds_before; }, seconds(5)));

    // Bytes that are not UTF-8 become U+FFFD; over limits.executeOutputBytes (1 MiB) the
    // output is read to its end but neither kept nor logged.
    ex = execute(*c, {{"leaseId", lease["id"]},
                      {"command", "/bin/sh"},
                      {"args", {"-c", "printf 'a\\377b'; head -c 1572864 /dev/zero >&2"}}});
    CHECK(ex.result["exitCode"] == 0);
    CHECK(ex.result["stdout"] ==
          "a\xEF\xBF\xBD"
          "b");
    CHECK(ex.result["stderr"].get<std::string>().size() == (1U << 20));
    CHECK(ex.logged("stderr").size() == (1U << 20));
    CHECK(ex.result["metadata"]["stderrBytes"] == 1572864);
    CHECK(ex.result["metadata"]["truncated"] == true);

    // What bwrap does not serve is refused naming the method.
    try {
        c->call("leaseRealizeWorkspace", {{"leaseId", lease["id"]}, {"workspace", json::object()}});
        FAIL("bwrap realized a workspace");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        CHECK(e.data().value("field", "") == "leaseRealizeWorkspace");
    }
    c->call("leaseRelease", {{"leaseId", lease["id"]}});
}

TEST_CASE("A probe and an open through a second node reach the owner's plugin worker",
          "[plugin][sdk][routing]") {
    TempDir shared;
    const json top = two_nodes(shared);
    SdkDaemon owner(json::object(), top, "node-1");
    SdkDaemon other(json::object(), top, "node-2");
    Client c1(owner.daemon->url(), "host-secret");
    Client c2(other.daemon->url(), "host-secret");
    auto lease = acquire(c1);
    CHECK(lease["ownerNodeId"] == "node-1");
    acquire(c2);  // node-2's own worker is up too: the calls must not reach it
    const auto owner_pids = owner.worker_pids();
    REQUIRE(owner_pids.size() == 1);

    const json probe = c2.call("leaseProbe", {{"leaseId", lease["id"]}});
    CHECK(probe["metadata"]["root"] == owner.root().string());
    CHECK(probe["metadata"]["pid"] == owner_pids[0]);
    CHECK(owner.journal_of("environmentProbe").size() == 1);
    CHECK(other.journal_of("environmentProbe").empty());

    auto run = c2.run_channel(open_params(lease, {"sh", "-c", "pwd; exit 4"}), {}, false);
    CHECK(run.out == (owner.root() / lease["providerLeaseId"].get<std::string>()).string() + "\n");
    CHECK(run.exit["exitCode"] == 4);
    CHECK(run.open_result["routed"] == true);

    // leaseExecute through node-2: run by the owner's worker, its logs relayed back to this
    // host before the answer, under this request's id.
    auto ex = execute(c2, {{"leaseId", lease["id"]},
                           {"command", "sh"},
                           {"args", {"-c", "printf 'routed-out'; printf 'routed-err' >&2; pwd"}}});
    const std::string owner_dir =
        (owner.root() / lease["providerLeaseId"].get<std::string>()).string();
    CHECK(ex.result["stdout"] == "routed-out" + owner_dir + "\n");
    CHECK(ex.result["stderr"] == "routed-err");
    CHECK(ex.result["metadata"]["pid"] == owner_pids[0]);
    CHECK(ex.logged("stdout") == ex.result["stdout"]);
    CHECK(ex.logged("stderr") == ex.result["stderr"]);
    CHECK(owner.journal_of("environmentExecute").size() == 1);
    CHECK(other.journal_of("environmentExecute").empty());
    // leaseRealizeWorkspace likewise.
    const json realized = c2.call("leaseRealizeWorkspace",
                                  {{"leaseId", lease["id"]}, {"workspace", {{"remotePath", "w"}}}});
    CHECK(realized["cwd"] == owner_dir + "/w");
    CHECK(owner.journal_of("environmentRealizeWorkspace").size() == 1);
    CHECK(other.journal_of("environmentRealizeWorkspace").empty());

    auto released = c2.call("leaseRelease", {{"leaseId", lease["id"]}});
    CHECK(released["status"] == "released");
    CHECK(owner.journal_of("environmentDestroyLease").size() == 1);
    CHECK(other.journal_of("environmentDestroyLease").empty());
}

TEST_CASE(
    "Lease policies with an SDK plugin: concurrent reuses share one lease, retain stops "
    "the sandbox through environmentReleaseLease and a reuse resumes it",
    "[plugin][sdk][policy]") {
    SdkDaemon sd;
    auto c = sd.daemon->connect();
    (void)acquire(*c);  // the worker is up
    // The worker answers the acquire after 300 ms (test hook acquireDelayMs), so that both
    // acquires below are in flight at once: one lease, one environmentAcquireLease (the
    // second waits for the first and reuses its lease).
    const json reuse = acquire_params(
        {{"leasePolicy", "reuse_by_environment"}, {"config", {{"acquireDelayMs", 300}}}});
    const auto first = c->send_request("leaseAcquire", reuse);
    const auto second = c->send_request("leaseAcquire", reuse);
    const json a = c->wait_response(first);
    const json b = c->wait_response(second);
    CHECK(a["id"] == b["id"]);
    CHECK(a["leasePolicy"] == "reuse_by_environment");
    CHECK(sd.journal_of("environmentAcquireLease").size() == 2);  // the warm-up's and a's
    const std::string plid = a["providerLeaseId"].get<std::string>();

    // The default disposition of a reuse policy retains: stopped, not destroyed.
    const json retained = c->call("leaseRelease", {{"leaseId", a["id"]}});
    CHECK(retained["status"] == "retained");
    CHECK(sd.journal_of("environmentReleaseLease").size() == 1);
    CHECK(sd.journal_of("environmentDestroyLease").empty());
    CHECK(fs::is_directory(sd.root() / plid));
    const json listed = c->call("leaseList", {{"status", "retained"}});
    REQUIRE(listed["leases"].size() == 1);
    CHECK(listed["leases"][0]["id"] == a["id"]);
    CHECK(error_reason(*c, "leaseExecute", {{"leaseId", a["id"]}, {"command", "true"}}) ==
          "LEASE_NOT_ACTIVE");
    CHECK(error_reason(*c, "duplexChannelOpen", open_params(a, {"true"})) == "LEASE_NOT_ACTIVE");

    // A reuse resumes the retained sandbox (environmentResumeLease) and it serves again.
    const json back = c->call("leaseAcquire", reuse);
    CHECK(back["id"] == a["id"]);
    CHECK(back["status"] == "active");
    CHECK(back["providerLeaseId"] == plid);
    CHECK(back["epoch"].get<std::int64_t>() > retained["epoch"].get<std::int64_t>());
    CHECK(sd.journal_of("environmentResumeLease").size() == 1);
    CHECK(sd.journal_of("environmentAcquireLease").size() == 2);
    auto ex = execute(*c, {{"leaseId", back["id"]}, {"command", "pwd"}});
    CHECK(ex.result["stdout"] == (sd.root() / plid).string() + "\n");
    auto run = run_sdk(*c, open_params(back, {"sh", "-c", "echo again"}));
    CHECK(run.out == "again\n");

    // disposition destroy overrides the policy.
    CHECK(c->call("leaseRelease", {{"leaseId", a["id"]}, {"disposition", "destroy"}})["status"] ==
          "released");
    CHECK(sd.journal_of("environmentDestroyLease").size() == 1);
    CHECK_FALSE(fs::exists(sd.root() / plid));

    // retain_on_failure: a failed run keeps its sandbox; releasing the retained lease again
    // destroys it.
    const json kept = acquire(*c, {{"leasePolicy", "retain_on_failure"}});
    CHECK(c->call("leaseRelease", {{"leaseId", kept["id"]}, {"failed", true}})["status"] ==
          "retained");
    CHECK(fs::is_directory(sd.root() / kept["providerLeaseId"].get<std::string>()));
    CHECK(c->call("leaseRelease", {{"leaseId", kept["id"]}})["status"] == "released");
    CHECK_FALSE(fs::exists(sd.root() / kept["providerLeaseId"].get<std::string>()));
    const json fine = acquire(*c, {{"leasePolicy", "retain_on_failure"}});
    CHECK(c->call("leaseRelease", {{"leaseId", fine["id"]}, {"failed", false}})["status"] ==
          "released");

    // The built-in provider accepts only ephemeral and destroy; a refusal changes nothing.
    try {
        c->call("leaseAcquire", {{"companyId", "acme"},
                                 {"environmentId", "dev"},
                                 {"provider", "bwrap"},
                                 {"leasePolicy", "reuse_by_environment"}});
        FAIL("bwrap accepted a reuse policy");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        CHECK(e.data().value("field", "") == "leasePolicy");
    }
    const json bw = c->call(
        "leaseAcquire", {{"companyId", "acme"}, {"environmentId", "dev"}, {"provider", "bwrap"}});
    try {
        c->call("leaseRelease", {{"leaseId", bw["id"]}, {"disposition", "retain"}});
        FAIL("bwrap retained a sandbox");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::invalid_params);
        CHECK(e.data().value("field", "") == "disposition");
    }
    CHECK(status_of(*c, bw) == "active");
    CHECK(c->run_channel(open_params(bw, {"echo", "still"})).out == "still\n");
    CHECK(c->call("leaseRelease", {{"leaseId", bw["id"]}})["status"] == "released");
}

TEST_CASE(
    "Through a second node: a reuse returns the owner's lease, a release retains it at "
    "the owner, and a reuse there resumes it on that node",
    "[plugin][sdk][policy][routing]") {
    TempDir shared;
    const json top = two_nodes(shared);
    // One lease root for both workers, as one cloud account behind two nodes.
    const json entry = {{"env",
                         {{"SDK_LOCAL_ROOT", (shared.path() / "leases").string()},
                          {"SDK_LOCAL_TEST_HOOKS", "1"},
                          {"SDK_LOCAL_STOP_GRACE_MS", "200"}}}};
    SdkDaemon node1(entry, top, "node-1");
    SdkDaemon node2(entry, top, "node-2");
    Client c1(node1.daemon->url(), "host-secret");
    Client c2(node2.daemon->url(), "host-secret");
    const json reuse = {{"leasePolicy", "reuse_by_environment"}};
    const json lease = acquire(c1, reuse);
    CHECK(lease["ownerNodeId"] == "node-1");
    acquire(c2);  // node-2's worker is up
    const auto pids1 = node1.worker_pids();
    const auto pids2 = node2.worker_pids();
    REQUIRE(pids1.size() == 1);
    REQUIRE(pids2.size() == 1);
    auto calls_by = [&shared](const std::string& method, pid_t pid) {
        std::size_t n = 0;
        std::ifstream in(shared.path() / "leases" / "journal.jsonl");
        for (std::string line; std::getline(in, line);) {
            const json e = json::parse(line);
            if (e["method"] == method && e["pid"] == pid) ++n;
        }
        return n;
    };

    // node-2 reuses node-1's active lease: the same lease, still owned by node-1.
    const json reused = c2.call("leaseAcquire", acquire_params(reuse));
    CHECK(reused["id"] == lease["id"]);
    CHECK(reused["ownerNodeId"] == "node-1");
    // A release through node-2 retains it at the owner's worker.
    CHECK(c2.call("leaseRelease", {{"leaseId", lease["id"]}})["status"] == "retained");
    CHECK(calls_by("environmentReleaseLease", pids1[0]) == 1);
    CHECK(calls_by("environmentReleaseLease", pids2[0]) == 0);
    // A reuse on node-2 resumes it there: node-2's worker holds it, node-2 owns it.
    const json resumed = c2.call("leaseAcquire", acquire_params(reuse));
    CHECK(resumed["id"] == lease["id"]);
    CHECK(resumed["ownerNodeId"] == "node-2");
    CHECK(calls_by("environmentResumeLease", pids2[0]) == 1);
    // Executes from node-1 now go to node-2's worker.
    auto ex = execute(c1, {{"leaseId", lease["id"]}, {"command", "true"}});
    CHECK(ex.result["exitCode"] == 0);
    CHECK(ex.result["metadata"]["pid"] == pids2[0]);
    CHECK(calls_by("environmentExecute", pids2[0]) == 1);
    CHECK(calls_by("environmentExecute", pids1[0]) == 0);
    CHECK(c1.call("leaseRelease",
                  {{"leaseId", lease["id"]}, {"disposition", "destroy"}})["status"] == "released");
    CHECK(calls_by("environmentDestroyLease", pids2[0]) == 1);
}
