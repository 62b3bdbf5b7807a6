#include <sandboxd/app/app.hpp>
#include <sandboxd/client/client.hpp>
#include <sandboxd/client/client_impl.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/version.hpp>

#include <boost/program_options.hpp>

#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

namespace sandboxd {
namespace po = boost::program_options;
using json = nlohmann::json;

namespace {

constexpr int exit_error = 255;

const char* usage_text =
    "Usage: sandboxctl [--url URL] [--token TOKEN | --token-file FILE] [--output text|json]\n"
    "                  [--cacert FILE | --insecure-skip-tls-verify] COMMAND [ARGS]\n\n"
    "  --url wss://...  TLS: the node's certificate must chain to a CA of --cacert (default:\n"
    "                   the system's trust store) and name the URL's host.\n"
    "  --insecure-skip-tls-verify  no check of the node's certificate at all (warns).\n\n"
    "Commands:\n"
    "  lease acquire --company ID --environment ID [--provider KEY] [--ttl-ms N]\n"
    "                [--config JSON] [--idempotency-key KEY] [--run-id ID] [--policy P]\n"
    "                [--egress] [--allow RULE]... [--deny RULE]...\n"
    "                (RULE: a domain, *.domain, address or CIDR, or a JSON rule\n"
    "                {\"host\", \"ports\", \"protocol\"}; any of them gives egress)\n"
    "                [--output id]   (P: ephemeral, reuse_by_environment,\n"
    "                reuse_by_execution_workspace with --execution-workspace ID, "
    "retain_on_failure)\n"
    "  lease get LEASE | lease list [--company ID] [--environment ID] [--status S]\n"
    "                [--owner NODE] [--limit N] | lease renew LEASE --ttl-ms N |\n"
    "  lease release LEASE [--disposition destroy|retain] [--failed] | lease probe LEASE\n"
    "  lease network LEASE [--none | --egress] [--allow RULE]... [--deny RULE]...\n"
    "       without options prints the lease's network policy; with them replaces it\n"
    "       (leaseUpdateNetwork: connections no longer allowed are cut at once)\n"
    "  run [--cwd DIR] [-e NAME=VALUE]... [--stdin TEXT] [--timeout-ms N] LEASE -- CMD [ARG...]\n"
    "       leaseExecute: runs CMD to its end, its output streamed as it comes; exits with\n"
    "       its status (128+N for signal N, 124 on timeout, 255 for an error)\n"
    "  exec [-i] [-t] [--cwd DIR] [-e NAME=VALUE]... [--timeout-ms N] LEASE -- CMD [ARG...]\n"
    "       runs CMD in the lease's sandbox; -i streams stdin, -t allocates a PTY; exits with\n"
    "       the command's status (128+N for signal N, 255 for an error)\n"
    "  exec --detach [--name NAME] [--retain-ms N] [--retain-bytes N] [-t] ... LEASE -- CMD\n"
    "       starts CMD as a detached channel that outlives this connection and prints its\n"
    "       handle; `attach` comes back to it\n"
    "  attach [-i] [-t] [--takeover] [--from-end] LEASE NAME|HANDLE\n"
    "       attaches to a detached channel: its kept output from the start (--from-end: only\n"
    "       what comes next), then live output; exits with its status like exec. Leaving\n"
    "       (Ctrl-C without -t, or a dropped connection) detaches; the command goes on\n"
    "  ps LEASE                      lists the lease's detached channels\n"
    "  nodes                         lists the nodes sharing the registry\n\n"
    "Environment: SANDBOXD_URL (default ws://127.0.0.1:7800/v1/ws), SANDBOXD_TOKEN,\n"
    "SANDBOXD_TOKEN_FILE, SANDBOXD_CACERT.\n";

struct Globals {
    std::string url;
    std::string token;
    std::string output = "text";
};

std::string env_or(const char* name, const std::string& fallback) {
    const char* v = std::getenv(name);
    return v && *v ? v : fallback;
}

std::string read_token_file(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw client_error("cannot read token file " + path);
    std::string token;
    std::getline(in, token);
    while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
    return token;
}

void print_lease_line(const json& l) {
    std::cout << l.value("id", "") << "  " << l.value("status", "") << "  "
              << l.value("companyId", "") << "/" << l.value("environmentId", "") << "  "
              << l.value("provider", "") << ":" << l.value("providerLeaseId", "")
              << "  owner=" << l.value("ownerNodeId", "") << "  expires="
              << (l["expiresAt"].is_string() ? l["expiresAt"].get<std::string>() : "-") << "\n";
}

void print_lease(const json& lease, const std::string& output) {
    if (output == "json") {
        std::cout << lease.dump(2) << "\n";
    } else if (output == "id") {
        std::cout << lease.value("id", "") << "\n";
    } else {
        print_lease_line(lease);
    }
}

po::variables_map parse_sub(const std::vector<std::string>& args,
                            const po::options_description& opts,
                            const po::positional_options_description& pos) {
    po::variables_map vm;
    po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
    po::notify(vm);
    return vm;
}

/// The network options of `lease acquire` and `lease network`.
void add_network_options(po::options_description& opts) {
    opts.add_options()("egress", "")("none", "")(
        "allow", po::value<std::vector<std::string>>()->composing(), "")(
        "deny", po::value<std::vector<std::string>>()->composing(), "");
}

/// A rule of --allow or --deny: a JSON object as it is, else the host string.
json network_rule(const std::string& text) {
    if (!text.empty() && text.front() == '{') return parse_json(text);
    return text;
}

/// The policy the network options give, or null when none is given.
json network_policy(const po::variables_map& vm) {
    const bool rules = vm.count("allow") > 0 || vm.count("deny") > 0;
    if (vm.count("none") > 0) {
        if (rules || vm.count("egress") > 0) {
            throw po::error("--none takes no --egress, --allow or --deny");
        }
        return {{"mode", "none"}};
    }
    if (!rules && vm.count("egress") == 0) return nullptr;
    json policy = {{"mode", "egress"}};
    for (const char* key : {"allow", "deny"}) {
        if (vm.count(key) == 0) continue;
        json list = json::array();
        for (const auto& text : vm[key].as<std::vector<std::string>>()) {
            list.push_back(network_rule(text));
        }
        policy[key] = std::move(list);
    }
    return policy;
}

/// sandboxctl lease acquire: `opts` (with --output, bound to `output`) and its own options.
int lease_acquire(Client& client, const std::vector<std::string>& rest,
                  po::options_description& opts, po::positional_options_description& pos,
                  const std::string& output) {
    opts.add_options()("company", po::value<std::string>()->required(), "")(
        "environment", po::value<std::string>()->required(), "")(
        "provider", po::value<std::string>()->default_value("bwrap"), "")(
        "ttl-ms", po::value<std::uint64_t>(), "")("config", po::value<std::string>(), "")(
        "idempotency-key", po::value<std::string>(), "")("run-id", po::value<std::string>(), "")(
        "policy", po::value<std::string>(), "")("execution-workspace", po::value<std::string>(),
                                                "");
    add_network_options(opts);
    auto vm = parse_sub(rest, opts, pos);
    json p = {{"companyId", vm["company"].as<std::string>()},
              {"environmentId", vm["environment"].as<std::string>()},
              {"provider", vm["provider"].as<std::string>()}};
    if (vm.count("ttl-ms")) p["ttlMs"] = vm["ttl-ms"].as<std::uint64_t>();
    if (vm.count("config")) p["config"] = parse_json(vm["config"].as<std::string>());
    if (json network = network_policy(vm); !network.is_null()) {
        if (!p.contains("config")) p["config"] = json::object();
        if (!p["config"].is_object() || p["config"].contains("network")) {
            throw po::error(
                "--egress, --allow and --deny set config.network: give it in one "
                "place (--config without \"network\")");
        }
        p["config"]["network"] = std::move(network);
    }
    if (vm.count("idempotency-key")) p["idempotencyKey"] = vm["idempotency-key"].as<std::string>();
    if (vm.count("run-id")) p["runId"] = vm["run-id"].as<std::string>();
    if (vm.count("policy")) p["leasePolicy"] = vm["policy"].as<std::string>();
    if (vm.count("execution-workspace")) {
        p["executionWorkspaceId"] = vm["execution-workspace"].as<std::string>();
    }
    print_lease(client.call("leaseAcquire", p), output);
    return 0;
}

/// sandboxctl lease list: `opts` (with --output, bound to `output`) and its own options.
int lease_list(Client& client, const std::vector<std::string>& rest, po::options_description& opts,
               po::positional_options_description& pos, const std::string& output) {
    opts.add_options()("company", po::value<std::string>(), "")(
        "environment", po::value<std::string>(), "")("status", po::value<std::string>(), "")(
        "owner", po::value<std::string>(), "")("limit", po::value<unsigned>(), "")(
        "cursor", po::value<std::string>(), "");
    auto vm = parse_sub(rest, opts, pos);
    json p = json::object();
    if (vm.count("company")) p["companyId"] = vm["company"].as<std::string>();
    if (vm.count("environment")) p["environmentId"] = vm["environment"].as<std::string>();
    if (vm.count("status")) p["status"] = vm["status"].as<std::string>();
    if (vm.count("owner")) p["ownerNodeId"] = vm["owner"].as<std::string>();
    if (vm.count("limit")) p["limit"] = vm["limit"].as<unsigned>();
    if (vm.count("cursor")) p["cursor"] = vm["cursor"].as<std::string>();
    auto page = client.call("leaseList", p);
    if (output == "json") {
        std::cout << page.dump(2) << "\n";
    } else {
        for (const auto& l : page["leases"]) print_lease(l, output);
        if (page["nextCursor"].is_string() && output == "text") {
            std::cout << "(more: --cursor " << page["nextCursor"].get<std::string>() << ")\n";
        }
    }
    return 0;
}

int lease_command(Client& client, const Globals& g, const std::vector<std::string>& args) {
    if (args.empty()) {
        throw po::error(
            "lease needs a subcommand: acquire, get, list, renew, release, probe, network");
    }
    const std::string& sub = args[0];
    const std::vector<std::string> rest(args.begin() + 1, args.end());
    po::options_description opts;
    po::positional_options_description pos;
    std::string output = g.output;
    opts.add_options()("output", po::value<std::string>(&output), "text|json|id");
    if (sub == "acquire") {
        return lease_acquire(client, rest, opts, pos, output);
    }
    if (sub == "get" || sub == "release" || sub == "probe") {
        opts.add_options()("lease", po::value<std::string>()->required(), "");
        if (sub == "release") {
            opts.add_options()("disposition", po::value<std::string>(), "")("failed", "");
        }
        pos.add("lease", 1);
        auto vm = parse_sub(rest, opts, pos);
        json p = {{"leaseId", vm["lease"].as<std::string>()}};
        if (sub == "probe") {
            std::cout << client.call("leaseProbe", p).dump(2) << "\n";
            return 0;
        }
        if (vm.count("disposition")) p["disposition"] = vm["disposition"].as<std::string>();
        if (vm.count("failed")) p["failed"] = true;
        auto lease = client.call(sub == "get" ? "leaseGet" : "leaseRelease", p);
        print_lease(lease, output);
        return 0;
    }
    if (sub == "network") {
        opts.add_options()("lease", po::value<std::string>()->required(), "");
        add_network_options(opts);
        pos.add("lease", 1);
        auto vm = parse_sub(rest, opts, pos);
        json p = {{"leaseId", vm["lease"].as<std::string>()}};
        json policy = network_policy(vm);
        json lease = policy.is_null()
                         ? client.call("leaseGet", p)
                         : client.call("leaseUpdateNetwork",
                                       {{"leaseId", p["leaseId"]}, {"network", policy}});
        std::cout << lease["network"].dump(output == "json" ? 2 : -1) << "\n";
        return 0;
    }
    if (sub == "renew") {
        opts.add_options()("lease", po::value<std::string>()->required(), "")(
            "ttl-ms", po::value<std::uint64_t>()->required(), "");
        pos.add("lease", 1);
        auto vm = parse_sub(rest, opts, pos);
        print_lease(client.call("leaseRenew", {{"leaseId", vm["lease"].as<std::string>()},
                                               {"ttlMs", vm["ttl-ms"].as<std::uint64_t>()}}),
                    output);
        return 0;
    }
    if (sub == "list") {
        return lease_list(client, rest, opts, pos, output);
    }
    throw po::error("unknown lease subcommand \"" + sub + "\"");
}

/// sandboxctl run: leaseExecute, its leaseExecute.log chunks written as they come.
int run_command(Client& client, const std::vector<std::string>& args) {
    auto dashes = std::find(args.begin(), args.end(), "--");
    if (dashes == args.end() || dashes + 1 == args.end()) {
        throw po::error("run needs LEASE -- CMD [ARG...]");
    }
    po::options_description opts;
    opts.add_options()("lease", po::value<std::string>()->required(), "")(
        "cwd", po::value<std::string>(), "")("env,e", po::value<std::vector<std::string>>(), "")(
        "stdin", po::value<std::string>(), "")("timeout-ms", po::value<std::uint64_t>(), "");
    po::positional_options_description pos;
    pos.add("lease", 1);
    auto vm = parse_sub(std::vector<std::string>(args.begin(), dashes), opts, pos);
    json p = {{"leaseId", vm["lease"].as<std::string>()}, {"command", *(dashes + 1)}};
    p["args"] = std::vector<std::string>(dashes + 2, args.end());
    if (vm.count("cwd")) p["cwd"] = vm["cwd"].as<std::string>();
    if (vm.count("stdin")) p["stdin"] = vm["stdin"].as<std::string>();
    if (vm.count("timeout-ms")) p["timeoutMs"] = vm["timeout-ms"].as<std::uint64_t>();
    if (vm.count("env")) {
        json env = json::object();
        for (const auto& kv : vm["env"].as<std::vector<std::string>>()) {
            auto eq = kv.find('=');
            if (eq == std::string::npos) throw po::error("-e needs NAME=VALUE, got \"" + kv + "\"");
            env[kv.substr(0, eq)] = kv.substr(eq + 1);
        }
        p["env"] = std::move(env);
    }
    const auto id = client.send_request("leaseExecute", p);
    for (;;) {
        auto ev = client.poll_event(std::chrono::seconds(1));  // a quiet command is not an error
        if (!ev) continue;
        const json& m = ev->message;
        if (ev->type == ClientEvent::kind::notification &&
            m.value("method", "") == "leaseExecute.log" && m["params"]["requestId"] == id) {
            auto& out = m["params"]["stream"] == "stderr" ? std::cerr : std::cout;
            out << m["params"]["chunk"].get<std::string>() << std::flush;
            continue;
        }
        if (ev->type != ClientEvent::kind::response || m.value("id", json()) != id) continue;
        if (m.contains("error")) {
            throw rpc_error(static_cast<errc>(m["error"].value("code", -32603)),
                            m["error"].value("message", "error"),
                            m["error"].value("data", json::object()));
        }
        const json& r = m["result"];
        if (r.value("timedOut", false)) return 124;
        if (r["exitCode"].is_number_integer()) return r["exitCode"].get<int>() & 0xff;
        if (r["signal"].is_string()) {
            const std::string name = r["signal"].get<std::string>();
            for (int sig = 1; sig < 65; ++sig) {
                const char* abbrev = ::sigabbrev_np(sig);
                if (abbrev && name == std::string("SIG") + abbrev) return 128 + sig;
            }
        }
        return exit_error;
    }
}

int nodes_command(Client& client, const Globals& g) {
    auto result = client.call("nodeList", json::object());
    if (g.output == "json") {
        std::cout << result.dump(2) << "\n";
        return 0;
    }
    for (const auto& n : result["nodes"]) {
        std::cout << n.value("nodeId", "") << "  " << (n.value("alive", false) ? "alive" : "dead")
                  << "  " << n.value("url", "") << "  leases=" << n["leases"].dump()
                  << "  channels=" << n["channels"].dump()
                  << "  heartbeat=" << n.value("heartbeatAt", "") << "\n";
    }
    return 0;
}

/// Restores the terminal mode on every exit path.
class RawTerminal {
public:
    explicit RawTerminal(bool enable) {
        if (!enable || tcgetattr(STDIN_FILENO, &saved_) != 0) return;
        termios raw = saved_;
        cfmakeraw(&raw);
        active_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    ~RawTerminal() {
        if (active_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
    }
    RawTerminal(const RawTerminal&) = delete;
    RawTerminal& operator=(const RawTerminal&) = delete;

private:
    termios saved_{};
    bool active_ = false;
};

void write_all(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
        auto n = ::write(fd, bytes.data(), bytes.size());
        if (n < 0) {
            if (errno == EINTR) continue;
            return;  // the reader went away: drop the rest
        }
        bytes.remove_prefix(static_cast<std::size_t>(n));
    }
}

/// Streams stdin, stdout and stderr of one channel like `docker exec`, on the client's own
/// io_context: one coroutine reads the WebSocket, one reads stdin, one writes in order.
class ExecSession {
public:
    ExecSession(Client& client, std::uint32_t channel, std::uint64_t stdin_window,
                bool attach_stdin, bool tty)
        : client_(client),
          io_(client.impl()),
          channel_(channel),
          stdin_window_(stdin_window),
          attach_stdin_(attach_stdin),
          tty_(tty),
          wake_writer_(io_.ioc),
          wake_stdin_(io_.ioc),
          winch_(io_.ioc) {
        wake_writer_.expires_at(net::steady_timer::time_point::max());
        wake_stdin_.expires_at(net::steady_timer::time_point::max());
    }

    json run() {
        beast::get_lowest_layer(io_.ws).expires_never();
        auto fail = [this](const std::exception_ptr& e) {
            if (!e) return;
            try {
                std::rethrow_exception(e);
            } catch (const std::exception& ex) {
                if (error_.empty()) error_ = ex.what();
            }
            io_.ioc.stop();
        };
        net::co_spawn(io_.ioc, read_loop(), fail);
        net::co_spawn(io_.ioc, write_loop(), fail);
        if (attach_stdin_) net::co_spawn(io_.ioc, stdin_loop(), fail);
        if (tty_) {
            winch_.add(SIGWINCH);
            net::co_spawn(io_.ioc, winch_loop(), fail);
        }
        // Events that arrived before the open's response are replayed first.
        while (!io_.pending.empty()) {
            handle(std::move(io_.pending.front()));
            io_.pending.pop_front();
        }
        io_.ioc.restart();
        io_.ioc.run();
        if (exit_.is_null())
            throw client_error(error_.empty() ? "connection closed before the exit" : error_);
        return exit_;
    }

private:
    void queue(bool binary, std::string bytes) {
        out_.emplace_back(binary, std::move(bytes));
        wake_writer_.cancel();
    }

    void handle(ClientEvent ev) {
        if (ev.type == ClientEvent::kind::data && ev.channel == channel_) {
            write_all(ev.stream == stream_id::stderr_ ? STDERR_FILENO : STDOUT_FILENO, ev.bytes);
            queue(true,
                  encode_credit(channel_, ev.stream, static_cast<std::uint32_t>(ev.bytes.size())));
        } else if (ev.type == ClientEvent::kind::credit && ev.channel == channel_) {
            unacked_ -= std::min<std::uint64_t>(unacked_, ev.credit);
            wake_stdin_.cancel();
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.gap" &&
                   ev.message["params"].value("channel", 0U) == channel_) {
            const auto& gap = ev.message["params"];
            std::cerr << "sandboxctl: " << gap.value("stream", "stdout") << " before offset "
                      << gap.value("firstKept", 0ULL) << " is no longer kept\n";
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit" &&
                   ev.message["params"].value("channel", 0U) == channel_) {
            exit_ = ev.message["params"];
            io_.ioc.stop();
        }
    }

    awaitable<void> read_loop() {
        for (;;) {
            io_.buffer.clear();
            co_await io_.ws.async_read(io_.buffer, use_awaitable);
            const auto data = io_.buffer.data();
            std::string_view message(static_cast<const char*>(data.data()), data.size());
            ClientEvent ev;
            try {
                ev = decode_event(io_.ws.got_text(), message);
            } catch (const client_error&) {
                continue;  // a frame this client does not understand: skip it
            }
            handle(std::move(ev));
        }
    }

    awaitable<void> write_loop() {
        for (;;) {
            if (out_.empty()) {
                co_await wake_writer_.async_wait(as_tuple_awaitable);
                continue;
            }
            auto item = std::move(out_.front());
            out_.pop_front();
            io_.ws.binary(item.first);
            co_await io_.ws.async_write(net::buffer(item.second), use_awaitable);
        }
    }

    awaitable<void> stdin_loop() {
        // Pipes, terminals and sockets are read asynchronously; a regular file (which epoll
        // refuses) is read with plain read() calls, which never block for long.
        net::posix::stream_descriptor in(io_.ioc);
        const int fd = ::dup(STDIN_FILENO);
        beast::error_code ec;
        in.assign(fd, ec);
        const bool async = !ec;
        if (!async) in.release();
        std::string buf(64 * 1024, '\0');
        for (;;) {
            while (unacked_ >= stdin_window_) co_await wake_stdin_.async_wait(as_tuple_awaitable);
            const std::size_t want = std::min<std::uint64_t>(buf.size(), stdin_window_ - unacked_);
            std::size_t n = 0;
            if (async) {
                auto [rec, got] =
                    co_await in.async_read_some(net::buffer(buf.data(), want), as_tuple_awaitable);
                if (rec) break;
                n = got;
            } else {
                auto got = ::read(fd, buf.data(), want);
                if (got <= 0) break;
                n = static_cast<std::size_t>(got);
            }
            unacked_ += n;
            queue(true, encode_data(channel_, stream_id::stdin_, std::string_view(buf.data(), n)));
        }
        if (!async) ::close(fd);
        queue(false,
              jsonrpc::request(io_.next_id++, "duplexChannelCloseStdin", {{"channel", channel_}}));
    }

    awaitable<void> winch_loop() {
        for (;;) {
            co_await winch_.async_wait(use_awaitable);
            winsize ws{};
            if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
                queue(false,
                      jsonrpc::request(
                          io_.next_id++, "duplexChannelResize",
                          {{"channel", channel_}, {"cols", ws.ws_col}, {"rows", ws.ws_row}}));
            }
        }
    }

    [[maybe_unused]] Client& client_;
    Client::Impl& io_;
    std::uint32_t channel_;
    std::uint64_t stdin_window_;
    bool attach_stdin_;
    bool tty_;
    net::steady_timer wake_writer_;
    net::steady_timer wake_stdin_;
    net::signal_set winch_;
    std::deque<std::pair<bool, std::string>> out_;
    std::uint64_t unacked_ = 0;
    json exit_;
    std::string error_;
};

int session_status(Client& client, const json& result, bool interactive, bool tty);

int exec_command(Client& client, const Globals& g, const std::vector<std::string>& args) {
    po::options_description opts;
    bool interactive = false, tty = false;
    std::vector<std::string> env;
    bool detach = false;
    opts.add_options()("interactive,i", po::bool_switch(&interactive), "")(
        "tty,t", po::bool_switch(&tty), "")("detach,d", po::bool_switch(&detach), "")(
        "name", po::value<std::string>(), "")("retain-ms", po::value<std::uint64_t>(), "")(
        "retain-bytes", po::value<std::uint64_t>(), "")("cwd", po::value<std::string>(), "")(
        "env,e", po::value<std::vector<std::string>>(&env), "")(
        "timeout-ms", po::value<std::uint64_t>(), "")("lease", po::value<std::string>()->required(),
                                                      "")(
        "cmd", po::value<std::vector<std::string>>(), "");
    po::positional_options_description pos;
    pos.add("lease", 1).add("cmd", -1);
    auto vm = parse_sub(args, opts, pos);
    if (!vm.count("cmd"))
        throw po::error("exec needs a command after the lease: exec LEASE -- CMD [ARG...]");
    const auto lease = client.call("leaseGet", {{"leaseId", vm["lease"].as<std::string>()}});
    json open = {{"lease",
                  {{"id", lease["id"]},
                   {"providerLeaseId", lease["providerLeaseId"]},
                   {"companyId", lease["companyId"]},
                   {"environmentId", lease["environmentId"]},
                   {"metadata", lease["metadata"]}}},
                 {"command", vm["cmd"].as<std::vector<std::string>>()},
                 {"hostRouteId", "sandboxctl-" + std::to_string(::getpid())}};
    // A plugin provider's channels always have a stdin (the paperclip plugin protocol cannot
    // open one without): without -i nothing is written to it, and it is never closed.
    if (lease["metadata"].value("pluginId", "builtin") == "builtin") open["stdin"] = interactive;
    if (vm.count("cwd")) open["cwd"] = vm["cwd"].as<std::string>();
    if (vm.count("timeout-ms")) open["timeoutMs"] = vm["timeout-ms"].as<std::uint64_t>();
    json env_obj = json::object();
    for (const auto& e : env) {
        auto eq = e.find('=');
        if (eq == std::string::npos || eq == 0)
            throw po::error("-e needs NAME=VALUE, got \"" + e + "\"");
        env_obj[e.substr(0, eq)] = e.substr(eq + 1);
    }
    if (!env_obj.empty()) open["env"] = env_obj;
    if (tty) {
        winsize ws{};
        std::uint16_t cols = 80, rows = 24;
        if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
            cols = ws.ws_col;
            rows = ws.ws_row;
        }
        open["pty"] = {{"cols", cols}, {"rows", rows}};
    }
    if (!detach && (vm.count("name") || vm.count("retain-ms") || vm.count("retain-bytes"))) {
        throw po::error("--name, --retain-ms and --retain-bytes go with --detach");
    }
    if (detach) {
        if (interactive) throw po::error("exec --detach takes no -i: attach -i gives it stdin");
        json d = json::object();
        if (vm.count("retain-ms")) d["retainMs"] = vm["retain-ms"].as<std::uint64_t>();
        if (vm.count("retain-bytes")) d["retainBytes"] = vm["retain-bytes"].as<std::uint64_t>();
        open["detach"] = d;
        open["stdin"] = true;  // an attachment may write to it later
        if (vm.count("name")) open["name"] = vm["name"].as<std::string>();
        const auto result = client.call("duplexChannelOpen", open);
        if (g.output == "json") {
            std::cout << json{{"handle", result["handle"]}, {"name", result.value("name", json())}}
                             .dump(2)
                      << "\n";
        } else {
            std::cout << result["handle"].get<std::string>() << "\n";
        }
        return 0;
    }
    auto result = client.call("duplexChannelOpen", open);
    return session_status(client, result, interactive, tty);
}

/// sandboxctl attach: a detached channel, by name or handle ("dch_...").
int attach_command(Client& client, const std::vector<std::string>& args) {
    po::options_description opts;
    bool interactive = false, tty = false, takeover = false, from_end = false;
    opts.add_options()("interactive,i", po::bool_switch(&interactive), "")(
        "tty,t", po::bool_switch(&tty), "")("takeover", po::bool_switch(&takeover), "")(
        "from-end", po::bool_switch(&from_end), "")("lease", po::value<std::string>()->required(),
                                                    "")("channel",
                                                        po::value<std::string>()->required(), "");
    po::positional_options_description pos;
    pos.add("lease", 1).add("channel", 1);
    auto vm = parse_sub(args, opts, pos);
    const auto& lease = vm["lease"].as<std::string>();
    const auto& which = vm["channel"].as<std::string>();
    json p = {{"leaseId", lease}, {"takeover", takeover}};
    p[which.rfind("dch_", 0) == 0 ? "handle" : "name"] = which;
    if (from_end) {
        for (const auto& ch : client.call("duplexChannelList", {{"leaseId", lease}})["channels"]) {
            if (ch["handle"] == which || ch["name"] == which) p["offsets"] = ch["offsets"];
        }
    }
    winsize ws{};
    if (tty && ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
        p["resize"] = {{"cols", ws.ws_col}, {"rows", ws.ws_row}};
    }
    json result;
    try {
        result = client.call("duplexChannelAttach", p);
    } catch (const rpc_error& e) {
        // A pipe channel refuses a size: attach without one.
        if (!p.contains("resize") || e.code() != errc::invalid_params) throw;
        p.erase("resize");
        result = client.call("duplexChannelAttach", p);
    }
    return session_status(client, result, interactive, tty && result.value("pty", false));
}

/// sandboxctl ps: the lease's detached channels.
int ps_command(Client& client, const Globals& g, const std::vector<std::string>& args) {
    if (args.size() != 1) throw po::error("ps needs one lease: ps LEASE");
    const auto listed = client.call("duplexChannelList", {{"leaseId", args[0]}});
    if (g.output == "json") {
        std::cout << listed.dump(2) << "\n";
        return 0;
    }
    std::cout << "HANDLE                        NAME              STATE    ATTACHED  STDOUT  "
                 "STDERR  EXIT  COMMAND\n";
    for (const auto& ch : listed["channels"]) {
        std::string exit = "-";
        if (ch["exit"].is_object()) {
            const auto& e = ch["exit"];
            exit = e["exitCode"].is_number() ? std::to_string(e["exitCode"].get<int>())
                   : e["signal"].is_string() ? e["signal"].get<std::string>()
                                             : e.value("outcome", "?");
        }
        std::string name = ch["name"].is_string() ? ch["name"].get<std::string>() : "-";
        std::printf("%-29s %-17s %-8s %-9s %-7llu %-7llu %-5s %s\n", ch.value("handle", "").c_str(),
                    name.c_str(), ch.value("state", "").c_str(),
                    ch.value("attached", false) ? "yes" : "no",
                    static_cast<unsigned long long>(ch["offsets"].value("stdout", 0ULL)),
                    static_cast<unsigned long long>(ch["offsets"].value("stderr", 0ULL)),
                    exit.c_str(), ch.value("command", "").c_str());
    }
    return 0;
}

/// Streams the channel of `result` (an open's or an attach's) to its exit; the exit status as
/// exec gives it.
int session_status(Client& client, const json& result, bool interactive, bool tty) {
    RawTerminal raw(tty && interactive && ::isatty(STDIN_FILENO));
    ExecSession session(client, result["channel"].get<std::uint32_t>(),
                        result.value("stdinWindow", 1U << 20), interactive, tty);
    auto exit = session.run();
    if (exit["exitCode"].is_number_integer()) return exit["exitCode"].get<int>();
    if (exit["signal"].is_string()) {
        static const std::pair<const char*, int> names[] = {
            {"HUP", 1},   {"INT", 2},   {"QUIT", 3},  {"ABRT", 6},  {"KILL", 9}, {"SEGV", 11},
            {"PIPE", 13}, {"ALRM", 14}, {"TERM", 15}, {"USR1", 10}, {"USR2", 12}};
        for (const auto& [name, num] : names) {
            if (exit["signal"] == name) return 128 + num;
        }
    }
    std::cerr << "sandboxctl: channel ended without an exit status (outcome "
              << exit.value("outcome", "?") << ")\n";
    return exit_error;
}

}  // namespace

int ctl_main(int argc, char** argv) {
    std::signal(SIGPIPE, SIG_IGN);
    Globals g;
    g.url = env_or("SANDBOXD_URL", "ws://127.0.0.1:7800/v1/ws");
    g.token = env_or("SANDBOXD_TOKEN", "");
    std::string token_file = env_or("SANDBOXD_TOKEN_FILE", "");
    ClientTls tls;
    tls.ca_file = env_or("SANDBOXD_CACERT", "");
    std::vector<std::string> args(argv + 1, argv + argc);
    std::size_t i = 0;
    try {
        for (; i < args.size(); ++i) {
            const auto& a = args[i];
            auto value = [&](const char* flag) {
                if (i + 1 >= args.size()) throw po::error(std::string(flag) + " needs a value");
                return args[++i];
            };
            if (a == "--help" || a == "-h") {
                std::cout << usage_text;
                return 0;
            } else if (a == "--version") {
                std::cout << "sandboxctl " << version_string << "\n";
                return 0;
            } else if (a == "--url") {
                g.url = value("--url");
            } else if (a == "--token") {
                g.token = value("--token");
            } else if (a == "--token-file") {
                token_file = value("--token-file");
            } else if (a == "--output") {
                g.output = value("--output");
            } else if (a == "--cacert") {
                tls.ca_file = value("--cacert");
            } else if (a == "--insecure-skip-tls-verify") {
                tls.insecure_skip_verify = true;
            } else if (!a.empty() && a[0] == '-') {
                throw po::error("unknown option " + a);
            } else {
                break;
            }
        }
        if (g.output != "text" && g.output != "json" && g.output != "id") {
            throw po::error("--output must be text, json or id");
        }
        if (i >= args.size()) throw po::error("a command is needed");
        const std::string command = args[i];
        const std::vector<std::string> rest(args.begin() + static_cast<long>(i) + 1, args.end());
        if (command != "lease" && command != "exec" && command != "run" && command != "nodes" &&
            command != "attach" && command != "ps") {
            throw po::error("unknown command \"" + command + "\"");
        }
        if (g.token.empty() && !token_file.empty()) g.token = read_token_file(token_file);
        if (tls.insecure_skip_verify) {
            std::cerr
                << "sandboxctl: warning: --insecure-skip-tls-verify: the node's certificate is not "
                   "checked; anyone on the path can read and change this session, token included\n";
        }
        Client client(g.url, g.token, std::chrono::seconds(30), 0, {}, tls);
        client.call("initialize",
                    {{"protocolVersion", 1},
                     {"client", {{"name", "sandboxctl"}, {"version", version_string}}}});
        if (command == "lease") return lease_command(client, g, rest);
        if (command == "nodes") return nodes_command(client, g);
        if (command == "run") return run_command(client, rest);
        if (command == "attach") return attach_command(client, rest);
        if (command == "ps") return ps_command(client, g, rest);
        return exec_command(client, g, rest);
    } catch (const po::error& e) {
        std::cerr << "sandboxctl: " << e.what() << "\n\n" << usage_text;
        return exit_error;
    } catch (const rpc_error& e) {
        std::cerr << "sandboxctl: " << e.what() << " (" << e.data().value("reason", "ERROR")
                  << ")\n";
        return exit_error;
    } catch (const std::exception& e) {
        std::cerr << "sandboxctl: " << e.what() << "\n";
        return exit_error;
    }
}

}  // namespace sandboxd
