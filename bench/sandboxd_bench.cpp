// sandboxd_bench: the load client of bench/run (issue 7).
//
// One subcommand per scenario; each prints one JSON object on stdout (its figures) and exits 0,
// or prints a message on stderr and exits 1. `report` merges those objects into
// bench/results/latest.json and prints the table. Blocking Beast WebSocket clients, one thread
// per connection; the throughput loops read whole messages into one reused buffer, credit in
// batches and send stdin from one static buffer (no per-frame allocation).
//
// Every subcommand runs under a watchdog (--deadline-s, default 600): a daemon that stops
// answering makes the bench fail, never hang.

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/tls.hpp>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace websocket = beast::websocket;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}
double secs_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// ---------------------------------------------------------------- options

struct Args {
    std::string command;
    std::map<std::string, std::string> opts;
    std::vector<std::string> positional;

    bool has(const std::string& k) const { return opts.count(k) != 0; }
    std::string str(const std::string& k, const std::string& def = {}) const {
        auto it = opts.find(k);
        return it == opts.end() ? def : it->second;
    }
    std::string need(const std::string& k) const {
        auto it = opts.find(k);
        if (it == opts.end()) throw std::runtime_error("missing --" + k);
        return it->second;
    }
    std::uint64_t num(const std::string& k, std::uint64_t def) const {
        auto it = opts.find(k);
        return it == opts.end() ? def : std::stoull(it->second);
    }
};

Args parse_args(int argc, char** argv) {
    Args a;
    if (argc < 2) throw std::runtime_error("usage: sandboxd_bench COMMAND [--key value]...");
    a.command = argv[1];
    for (int i = 2; i < argc; ++i) {
        std::string s = argv[i];
        if (s.rfind("--", 0) == 0) {
            std::string key = s.substr(2);
            if (auto eq = key.find('='); eq != std::string::npos) {
                a.opts[key.substr(0, eq)] = key.substr(eq + 1);
            } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
                a.opts[key] = argv[++i];
            } else {
                a.opts[key] = "1";
            }
        } else {
            a.positional.push_back(s);
        }
    }
    return a;
}

std::string read_file(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
    return s;
}

// ---------------------------------------------------------------- statistics

/// Nearest-rank percentile of `v` (sorted in place), p in (0, 100].
double percentile(std::vector<double>& v, double p) {
    if (v.empty()) return std::nan("");
    std::sort(v.begin(), v.end());
    auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
    return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
}

double median(std::vector<double> v) { return percentile(v, 50); }

json summary(std::vector<double> v) {
    json j;
    j["n"] = v.size();
    j["p50"] = percentile(v, 50);
    j["p90"] = percentile(v, 90);
    j["p99"] = percentile(v, 99);
    j["max"] = v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    j["mean"] = v.empty() ? 0.0 : sum / static_cast<double>(v.size());
    return j;
}

double cpu_self_s() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    auto tv = [](timeval t) {
        return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
    };
    return tv(ru.ru_utime) + tv(ru.ru_stime);
}

/// utime+stime of a process in seconds (from /proc/PID/stat), or NaN.
double cpu_of_pid(long pid) {
    if (pid <= 0) return std::nan("");
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string s;
    std::getline(in, s);  // one line
    auto close = s.rfind(')');
    if (close == std::string::npos) return std::nan("");
    std::istringstream fields(s.substr(close + 2));
    std::string f;
    std::vector<std::string> v;
    while (fields >> f) v.push_back(f);
    // Fields after the command: state(3) ... utime is field 14, stime 15 (1-based overall).
    if (v.size() < 13) return std::nan("");
    const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
    return (std::stod(v[11]) + std::stod(v[12])) / ticks;
}

/// VmRSS of a process in KiB (from /proc/PID/status), or -1.
long rss_kib(long pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    }
    return -1;
}

// ---------------------------------------------------------------- WebSocket connection

struct Url {
    std::string host, port, target;
    bool tls = false;
    std::string cacert;  ///< wss://: the CA that verifies the node
};

Url parse_url(const std::string& url, const std::string& cacert = "") {
    const auto parsed = sandboxd::parse_ws_url(url);  // throws sandboxd::address_error
    return Url{parsed.endpoint.host, parsed.endpoint.port_text(), parsed.target, parsed.tls,
               cacert};
}

/// The stream of a connection to `u`: TLS for wss:// (verified with u.cacert).
sandboxd::ConnStream make_stream(net::io_context& ioc, const Url& u) {
    if (!u.tls) return sandboxd::ConnStream(beast::tcp_stream(ioc));
    sandboxd::TlsClientOptions o;
    o.ca_file = u.cacert;
    return sandboxd::ConnStream(beast::tcp_stream(ioc), sandboxd::make_client_tls(o, "bench"));
}

class RpcError : public std::runtime_error {
public:
    RpcError(std::string reason, const std::string& message)
        : std::runtime_error(reason + ": " + message), reason_(std::move(reason)) {}
    const std::string& reason() const noexcept { return reason_; }

private:
    std::string reason_;
};

/// One message from the daemon. For binary frames only the header is decoded; the payload
/// stays in the connection's buffer (valid until the next read).
// json's noexcept move calls assert_invariant(), which clang-tidy 14 counts as throwing.
// NOLINTNEXTLINE(bugprone-exception-escape)
struct Msg {
    bool text = false;
    json j;
    std::uint8_t kind = 0;
    std::uint32_t channel = 0;
    std::uint8_t stream = 0;
    std::size_t payload = 0;
    std::uint32_t credit = 0;

    bool is_exit() const { return text && j.value("method", "") == "duplexChannel.exit"; }
    bool is_response() const { return text && !j.contains("method"); }
};

std::uint32_t be32(const unsigned char* p) {
    return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
           std::uint32_t{p[3]};
}
void put_be32(unsigned char* p, std::uint32_t v) {
    p[0] = static_cast<unsigned char>(v >> 24);
    p[1] = static_cast<unsigned char>(v >> 16);
    p[2] = static_cast<unsigned char>(v >> 8);
    p[3] = static_cast<unsigned char>(v);
}

class Conn {
public:
    /// `token` empty: no Authorization header and no subprotocol (websocketd).
    Conn(const Url& u, const std::string& token) : ws_(make_stream(ioc_, u)) {
        tcp::resolver resolver(ioc_);
        auto& socket = beast::get_lowest_layer(ws_).socket();
        net::connect(socket, resolver.resolve(u.host, u.port));
        socket.set_option(tcp::no_delay(true));
        if (auto* t = ws_.next_layer().tls()) {
            sandboxd::expect_server_name(t->native_handle(), u.host, true);
            t->handshake(sandboxd::ssl::stream_base::client);
        }
        // One frame per message (Beast fragments at 4 KiB by default) and a masking buffer
        // as large as a data frame, so a 256 KiB stdin frame is one write.
        ws_.auto_fragment(false);
        ws_.write_buffer_bytes(512 * 1024);
        ws_.read_message_max(64ULL << 20);
        ws_.set_option(websocket::stream_base::decorator([token](websocket::request_type& req) {
            if (!token.empty()) {
                req.set(beast::http::field::authorization, "Bearer " + token);
                req.set(beast::http::field::sec_websocket_protocol, "sandboxd.v1");
            }
            req.set(beast::http::field::user_agent, "sandboxd_bench");
        }));
        ws_.handshake(u.host + ":" + u.port, u.target);
    }
    Conn(const Conn&) = delete;
    Conn& operator=(const Conn&) = delete;
    ~Conn() {
        beast::error_code ec;
        beast::get_lowest_layer(ws_).socket().close(ec);
    }

    /// Reads one message; false when the connection closed (websocketd at process exit).
    bool read(Msg& m, bool allow_close = false) {
        buf_.consume(buf_.size());
        beast::error_code ec;
        ws_.read(buf_, ec);
        if (ec) {
            if (allow_close && (ec == websocket::error::closed || ec == net::error::eof ||
                                ec == net::error::connection_reset)) {
                return false;
            }
            throw std::runtime_error("websocket read: " + ec.message());
        }
        const auto* p = static_cast<const unsigned char*>(buf_.data().data());
        const std::size_t n = buf_.size();
        m = Msg{};
        if (ws_.got_text()) {
            m.text = true;
            m.j = json::parse(std::string_view(reinterpret_cast<const char*>(p), n));
            return true;
        }
        if (n < 6) {
            m.kind = 0;
            m.payload = n;  // websocketd: raw bytes
            return true;
        }
        m.kind = p[0];
        m.channel = be32(p + 1);
        m.stream = p[5];
        if (m.kind == 0x01) m.payload = n - 6;
        if (m.kind == 0x02 && n == 10) m.credit = be32(p + 6);
        return true;
    }
    /// Size of the last binary message (websocketd payloads have no header).
    std::size_t last_size() const { return buf_.size(); }

    std::int64_t send_request(const std::string& method, const json& params) {
        const auto id = next_id_++;
        const std::string text = sandboxd::jsonrpc::request(id, method, params);
        ws_.text(true);
        ws_.write(net::buffer(text));
        return id;
    }

    /// Waits for the response to `id`; other messages are queued for next(). Responses may
    /// come out of id order (docs/protocol.md), so one read earlier may already be queued.
    json wait(std::int64_t id) {
        for (auto it = pending_.begin(); it != pending_.end(); ++it) {
            if (it->is_response() && it->j.value("id", json()) == id) {
                const json response = std::move(it->j);
                pending_.erase(it);
                return result_of(response);
            }
        }
        for (;;) {
            Msg m;
            read(m);
            if (m.is_response() && m.j.value("id", json()) == id) return result_of(m.j);
            if (m.text) pending_.push_back(std::move(m));  // binary frames are not kept
        }
    }
    json call(const std::string& method, const json& params) {
        return wait(send_request(method, params));
    }

    /// Next message: queued ones first.
    bool next(Msg& m, bool allow_close = false) {
        if (!pending_.empty()) {
            m = std::move(pending_.front());
            pending_.pop_front();
            return true;
        }
        return read(m, allow_close);
    }

    static json result_of(const json& response) {
        if (response.contains("error")) {
            const auto& e = response["error"];
            std::string reason = "ERROR";
            if (e.contains("data") && e["data"].is_object())
                reason = e["data"].value("reason", reason);
            throw RpcError(reason, e.value("message", e.dump()));
        }
        return response.at("result");
    }

    void send_credit(std::uint32_t channel, std::uint8_t stream, std::uint32_t bytes) {
        std::array<unsigned char, 10> f{};
        f[0] = 0x02;
        put_be32(f.data() + 1, channel);
        f[5] = stream;
        put_be32(f.data() + 6, bytes);
        ws_.binary(true);
        ws_.write(net::buffer(f));
    }

    void send_stdin(std::uint32_t channel, const char* data, std::size_t n) {
        std::array<unsigned char, 6> h{};
        h[0] = 0x01;
        put_be32(h.data() + 1, channel);
        h[5] = 0;
        const std::array<net::const_buffer, 2> bufs{net::buffer(h), net::buffer(data, n)};
        ws_.binary(true);
        ws_.write(bufs);
    }

    void close() {
        beast::error_code ec;
        ws_.close(websocket::close_code::normal, ec);
    }

private:
    net::io_context ioc_;
    websocket::stream<sandboxd::ConnStream> ws_;
    beast::flat_buffer buf_;
    std::deque<Msg> pending_;
    std::int64_t next_id_ = 1;
};

// ---------------------------------------------------------------- shared helpers

struct Target {
    Url url;
    std::string token;
};

Target target_of(const Args& a, const std::string& url_key = "url",
                 const std::string& token_key = "token-file") {
    return Target{parse_url(a.need(url_key), a.str("cacert", "")), read_file(a.need(token_key))};
}

json acquire(Conn& c, const std::string& company = "bench", const std::string& env = "bench",
             const json& limits = json::object(), const std::string& provider = "bwrap") {
    json params = {{"companyId", company}, {"environmentId", env}, {"provider", provider}};
    if (!limits.empty()) params["config"] = {{"limits", limits}};
    return c.call("leaseAcquire", params);
}

json lease_ref(const json& lease) {
    return {{"id", lease.at("id")},
            {"providerLeaseId", lease.at("providerLeaseId")},
            {"companyId", lease.at("companyId")},
            {"environmentId", lease.at("environmentId")},
            {"metadata", lease.at("metadata")}};
}

json open_params(const json& lease, std::vector<std::string> command, bool with_stdin,
                 std::optional<std::uint64_t> window = std::nullopt) {
    json p = {{"lease", lease_ref(lease)}, {"command", std::move(command)}, {"stdin", with_stdin}};
    if (window) p["outputWindow"] = *window;
    return p;
}

/// Opens a channel running `true` and waits for its exit; returns {ms to exit, ms to result}.
std::pair<double, double> open_true_once(Conn& c, const json& lease) {
    const auto t0 = clock_type::now();
    const auto id = c.send_request("duplexChannelOpen", open_params(lease, {"true"}, false));
    const json result = c.wait(id);
    const double to_result = ms_since(t0);
    const auto channel = result.at("channel").get<std::uint32_t>();
    for (;;) {
        Msg m;
        c.next(m);
        if (m.is_exit() && m.j["params"].value("channel", 0U) == channel) {
            const auto& p = m.j["params"];
            if (p.value("exitCode", json()) != 0) {
                throw std::runtime_error("`true` did not exit 0: " + p.dump());
            }
            return {ms_since(t0), to_result};
        }
    }
}

/// Sequential opens of `true` on one connection. A non-empty `samples_path` gets one line per
/// open: ms since the first open started, ms to the result, ms to the exit (to look at a tail).
/// `pause_ms` > 0: that long idle before each open (a workload shape, not a wait for anything:
/// the opens of a host that runs commands now and then, whose last channel's teardown and the
/// next warm init are done before the next open comes).
json sequential_opens(const Target& t, const json& lease, std::size_t count,
                      const std::string& samples_path = {}, std::uint64_t pause_ms = 0) {
    Conn c(t.url, t.token);
    open_true_once(c, lease);  // warm-up
    std::vector<double> exit_ms, result_ms, start_ms;
    const auto first = clock_type::now();
    for (std::size_t i = 0; i < count; ++i) {
        if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        start_ms.push_back(ms_since(first));
        auto [e, r] = open_true_once(c, lease);
        exit_ms.push_back(e);
        result_ms.push_back(r);
    }
    c.close();
    if (!samples_path.empty()) {
        std::ofstream out(samples_path);
        if (!out) throw std::runtime_error("cannot write " + samples_path);
        for (std::size_t i = 0; i < count; ++i) {
            out << start_ms[i] << ' ' << result_ms[i] << ' ' << exit_ms[i] << '\n';
        }
    }
    return {{"to_exit_ms", summary(exit_ms)}, {"to_result_ms", summary(result_ms)}};
}

/// Sequential leaseExecute of `true` on one connection (the one-shot path: request to answer,
/// which comes after the command's exit).
json sequential_executes(const Target& t, const json& lease, std::size_t count) {
    Conn c(t.url, t.token);
    const json params = {{"leaseId", lease["id"]}, {"command", "true"}};
    std::vector<double> ms;
    for (std::size_t i = 0; i <= count; ++i) {  // the first is a warm-up
        const auto t0 = clock_type::now();
        const json result = c.wait(c.send_request("leaseExecute", params));
        if (result.value("exitCode", json()) != 0) {
            throw std::runtime_error("leaseExecute `true` did not exit 0: " + result.dump());
        }
        if (i > 0) ms.push_back(ms_since(t0));
    }
    c.close();
    return summary(ms);
}

/// `total` opens in flight at once, over `connections` connections (pipelined requests), for
/// `rounds` rounds; each measured from its request to its exit.
json concurrent_opens(const Target& t, const json& lease, std::size_t total,
                      std::size_t connections, std::size_t rounds) {
    std::vector<std::unique_ptr<Conn>> conns;
    for (std::size_t i = 0; i < connections; ++i)
        conns.push_back(std::make_unique<Conn>(t.url, t.token));
    std::mutex mu;
    std::vector<double> exit_ms, result_ms;
    std::string failure;
    std::barrier sync(static_cast<std::ptrdiff_t>(connections));
    double wall_s = 0;
    std::vector<std::thread> threads;
    for (std::size_t ci = 0; ci < connections; ++ci) {
        const std::size_t mine = total / connections + (ci < total % connections ? 1 : 0);
        threads.emplace_back([&, ci, mine] {
            Conn& c = *conns[ci];
            for (std::size_t r = 0; r < rounds; ++r) {
                sync.arrive_and_wait();
                const auto round_start = clock_type::now();
                try {
                    std::map<std::int64_t, clock_type::time_point> sent;
                    std::map<std::uint32_t, clock_type::time_point> started;
                    for (std::size_t i = 0; i < mine; ++i) {
                        const auto t0 = clock_type::now();
                        sent[c.send_request("duplexChannelOpen",
                                            open_params(lease, {"true"}, false))] = t0;
                    }
                    std::size_t exits = 0;
                    std::vector<double> e_local, r_local;
                    while (exits < mine) {
                        Msg m;
                        c.next(m);
                        if (m.is_response()) {
                            auto it = sent.find(m.j.value("id", std::int64_t{-1}));
                            if (it == sent.end()) continue;
                            const json res = Conn::result_of(m.j);
                            r_local.push_back(ms_since(it->second));
                            started[res.at("channel").get<std::uint32_t>()] = it->second;
                        } else if (m.is_exit()) {
                            auto it = started.find(m.j["params"].value("channel", 0U));
                            if (it == started.end()) continue;
                            if (m.j["params"].value("exitCode", json()) != 0) {
                                throw std::runtime_error("`true` did not exit 0: " +
                                                         m.j["params"].dump());
                            }
                            e_local.push_back(ms_since(it->second));
                            ++exits;
                        }
                    }
                    std::lock_guard lock(mu);
                    exit_ms.insert(exit_ms.end(), e_local.begin(), e_local.end());
                    result_ms.insert(result_ms.end(), r_local.begin(), r_local.end());
                    if (ci == 0) wall_s += secs_since(round_start);
                } catch (const std::exception& e) {
                    std::lock_guard lock(mu);
                    failure = e.what();
                }
                sync.arrive_and_wait();
            }
        });
    }
    for (auto& th : threads) th.join();
    if (!failure.empty()) throw std::runtime_error("concurrent opens: " + failure);
    for (auto& c : conns) c->close();
    return {{"in_flight", total},
            {"connections", connections},
            {"rounds", rounds},
            {"to_exit_ms", summary(exit_ms)},
            {"to_result_ms", summary(result_ms)},
            {"opens_per_s", static_cast<double>(total * rounds) / std::max(wall_s, 1e-9)}};
}

/// Reads channel `channel` of `c` to its exit, crediting every `batch` bytes; the bytes read.
std::uint64_t drain_channel(Conn& c, std::uint32_t channel, std::uint64_t batch, json& exit,
                            std::uint64_t* frames = nullptr) {
    std::uint64_t got = 0, uncredited = 0;
    for (;;) {
        Msg m;
        c.next(m);
        if (!m.text && m.kind == 0x01 && m.channel == channel) {
            got += m.payload;
            uncredited += m.payload;
            if (frames) ++*frames;
            if (uncredited >= batch) {
                c.send_credit(channel, m.stream, static_cast<std::uint32_t>(uncredited));
                uncredited = 0;
            }
        } else if (m.is_exit() && m.j["params"].value("channel", 0U) == channel) {
            exit = m.j["params"];
            return got;
        }
    }
}

/// Streams `bytes` of zeros from `head` through a channel; returns MB/s (10^6 bytes).
json stream_once(const Target& t, const json& lease, std::uint64_t bytes, std::uint64_t window,
                 std::uint64_t batch, long daemon_pid, long relay_pid = 0,
                 const json& extra = json::object()) {
    Conn c(t.url, t.token);
    const double cpu0 = cpu_self_s();
    const double dcpu0 = cpu_of_pid(daemon_pid);
    const double rcpu0 = cpu_of_pid(relay_pid);
    const auto t0 = clock_type::now();
    auto params =
        open_params(lease, {"head", "-c", std::to_string(bytes), "/dev/zero"}, false, window);
    params.update(extra);
    const auto id = c.send_request("duplexChannelOpen", params);
    const json result = c.wait(id);
    const auto channel = result.at("channel").get<std::uint32_t>();
    std::uint64_t frames = 0;
    json exit;
    const auto got = drain_channel(c, channel, batch, exit, &frames);
    const double secs = secs_since(t0);
    const double cpu = cpu_self_s() - cpu0;
    const double dcpu = cpu_of_pid(daemon_pid) - dcpu0;
    const double rcpu = cpu_of_pid(relay_pid) - rcpu0;
    c.close();
    if (got != bytes || exit.value("exitCode", json()) != 0) {
        throw std::runtime_error("stream: got " + std::to_string(got) + " of " +
                                 std::to_string(bytes) + " bytes, exit " + exit.dump());
    }
    json j = {{"mb_s", static_cast<double>(bytes) / 1e6 / secs},
              {"seconds", secs},
              {"frames", frames},
              {"avg_frame", frames ? static_cast<double>(got) / static_cast<double>(frames) : 0.0},
              {"client_cpu_s", cpu}};
    if (!std::isnan(dcpu)) j["daemon_cpu_s"] = dcpu;
    if (!std::isnan(rcpu)) j["relay_daemon_cpu_s"] = rcpu;
    return j;
}

json runs_summary(const std::vector<json>& runs);

/// Replay of kept output (issue 46): a detached `head -c BYTES /dev/zero` that nobody reads,
/// kept whole, then attached from offset 0 and read to its exit; MB/s of the attach.
json detached_replay_once(const Target& t, const json& lease, std::uint64_t bytes,
                          std::uint64_t window) {
    std::string handle;
    {
        Conn c(t.url, t.token);
        auto p = open_params(lease, {"head", "-c", std::to_string(bytes), "/dev/zero"}, false);
        p["detach"] = {{"retainBytes", bytes}, {"retainMs", 60000}};
        handle = c.call("duplexChannelOpen", p).at("handle").get<std::string>();
        c.close();  // the command goes on, kept
    }
    Conn c(t.url, t.token);
    // Polled: the bench waits for the command to have written everything (not a test).
    for (int i = 0;; ++i) {
        const auto l = c.call("duplexChannelList", {{"leaseId", lease.at("id")}});
        bool done = false;
        for (const auto& ch : l["channels"])
            done |= ch["handle"] == handle && ch["state"] == "exited";
        if (done) break;
        if (i > 6000) throw std::runtime_error("replay: the detached command did not end");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const auto t0 = clock_type::now();
    const auto attached = c.call("duplexChannelAttach", {{"leaseId", lease.at("id")},
                                                         {"handle", handle},
                                                         {"offsets", {{"stdout", 0}}},
                                                         {"outputWindow", window}});
    json exit;
    const auto got =
        drain_channel(c, attached.at("channel").get<std::uint32_t>(), window / 8, exit);
    const double secs = secs_since(t0);
    c.close();
    if (got != bytes || exit.value("exitCode", json()) != 0) {
        throw std::runtime_error("replay: got " + std::to_string(got) + " of " +
                                 std::to_string(bytes) + " bytes, exit " + exit.dump());
    }
    return {{"mb_s", static_cast<double>(bytes) / 1e6 / secs}, {"seconds", secs}};
}

/// detached (issue 46), in one run: a detached stream against an undetached one (alternating
/// runs), the replay of kept output, and opens of `true` with and without detach (alternating).
json cmd_detached(const Args& a) {
    const Target t = target_of(a);
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    const std::uint64_t replay_bytes = a.num("replay-bytes", 64ULL << 20);
    const std::uint64_t window = a.num("window", 16ULL << 20);
    const std::size_t count = a.num("count", 200);
    const long pid = static_cast<long>(a.num("pid", 0));
    Conn c(t.url, t.token);
    const json lease = acquire(c);
    const json detach = {{"detach", {{"retainBytes", 8ULL << 20}, {"retainMs", 1000}}}};
    stream_once(t, lease, 32ULL << 20, window, window / 8, pid);  // warm-up
    std::vector<json> plain, detached;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i) {
        plain.push_back(stream_once(t, lease, bytes, window, window / 8, pid));
        detached.push_back(stream_once(t, lease, bytes, window, window / 8, pid, 0, detach));
    }
    // The replays and the opens each on a lease of their own: each lease's kept output is
    // bounded (limits.detachKeptBytesPerLease, 1 GiB by default).
    const json replay_lease = acquire(c);
    std::vector<json> replays;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i)
        replays.push_back(detached_replay_once(t, replay_lease, replay_bytes, window));
    c.call("leaseRelease", {{"leaseId", replay_lease["id"]}});
    // Opens: `true` without and with detach (256 KiB kept per stream, exit kept 1 s), in turns.
    const json small = {{"retainBytes", 256 << 10}, {"retainMs", 1000}};
    std::vector<double> plain_ms, detached_ms;
    for (std::size_t i = 0; i < count; ++i) {
        plain_ms.push_back(open_true_once(c, lease).first);
        auto p = open_params(lease, {"true"}, false);
        p["detach"] = small;
        const auto t0 = clock_type::now();
        const auto channel = c.call("duplexChannelOpen", p).at("channel").get<std::uint32_t>();
        json exit;
        drain_channel(c, channel, 1 << 20, exit);
        detached_ms.push_back(ms_since(t0));
    }
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    json sp = runs_summary(plain), sd = runs_summary(detached), sr = runs_summary(replays);
    const double ratio = sd["median_mb_s"].get<double>() / sp["median_mb_s"].get<double>();
    const double open_plain = median(plain_ms), open_detached = median(detached_ms);
    return {{"detached_stream_ratio", ratio},
            {"detached_replay_mb_s", sr["median_mb_s"]},
            {"detached_open_ratio", open_detached / open_plain},
            {"details",
             {{"detached",
               {{"stream_mb_s", sp},
                {"detached_stream_mb_s", sd},
                {"replay_mb_s", sr},
                {"replay_bytes", replay_bytes},
                {"bytes", bytes},
                {"open_ms", summary(plain_ms)},
                {"detached_open_ms", summary(detached_ms)}}}}}};
}

/// Writes `bytes` of zeros as stdin into `cat > /dev/null`; returns MB/s.
json stdin_once(const Target& t, const json& lease, std::uint64_t bytes, long daemon_pid) {
    static const std::vector<char> zeros(16 << 20, '\0');
    Conn c(t.url, t.token);
    const json init = c.call("initialize", {{"protocolVersion", 1}});
    const std::uint64_t max_payload = init["limits"].value("maxDataPayload", 262144ULL);
    const double cpu0 = cpu_self_s();
    const double dcpu0 = cpu_of_pid(daemon_pid);
    const auto t0 = clock_type::now();
    const json result =
        c.call("duplexChannelOpen", open_params(lease, {"sh", "-c", "cat > /dev/null"}, true));
    const auto channel = result.at("channel").get<std::uint32_t>();
    const std::uint64_t window = result.value("stdinWindow", 1ULL << 20);
    const std::uint64_t chunk =
        std::min({max_payload, window, static_cast<std::uint64_t>(zeros.size())});
    std::uint64_t sent = 0, unacked = 0;
    bool closed = false;
    json exit;
    while (exit.is_null()) {
        while (sent < bytes && unacked + std::min(chunk, bytes - sent) <= window) {
            const std::uint64_t n = std::min(chunk, bytes - sent);
            c.send_stdin(channel, zeros.data(), n);
            sent += n;
            unacked += n;
        }
        if (sent == bytes && !closed) {
            c.send_request("duplexChannelCloseStdin", {{"channel", channel}});
            closed = true;
        }
        Msg m;
        c.next(m);
        if (!m.text && m.kind == 0x02 && m.channel == channel && m.stream == 0) {
            unacked -= std::min<std::uint64_t>(unacked, m.credit);
        } else if (m.is_exit() && m.j["params"].value("channel", 0U) == channel) {
            exit = m.j["params"];
        } else if (m.is_response()) {
            Conn::result_of(m.j);  // throws on an error response
        }
    }
    const double secs = secs_since(t0);
    const double cpu = cpu_self_s() - cpu0;
    const double dcpu = cpu_of_pid(daemon_pid) - dcpu0;
    c.close();
    if (exit.value("stdinBytes", std::uint64_t{0}) != bytes ||
        exit.value("exitCode", json()) != 0) {
        throw std::runtime_error("stdin: sent " + std::to_string(bytes) + " bytes, exit " +
                                 exit.dump());
    }
    json j = {{"mb_s", static_cast<double>(bytes) / 1e6 / secs},
              {"seconds", secs},
              {"stdin_window", window},
              {"frame_payload", chunk},
              {"client_cpu_s", cpu}};
    if (!std::isnan(dcpu)) j["daemon_cpu_s"] = dcpu;
    return j;
}

json runs_summary(const std::vector<json>& runs) {
    std::vector<double> v;
    v.reserve(runs.size());
    for (const auto& r : runs) v.push_back(r["mb_s"].get<double>());
    return {{"median_mb_s", median(v)},
            {"best_mb_s", *std::max_element(v.begin(), v.end())},
            {"runs", runs}};
}

// ---------------------------------------------------------------- scenarios

/// open: sequential and concurrent opens of `true` (--pause-ms: idle before each sequential one).
json cmd_open(const Args& a) {
    const Target t = target_of(a);
    Conn c(t.url, t.token);
    const json lease = acquire(c);
    json seq =
        sequential_opens(t, lease, a.num("count", 500), a.str("samples"), a.num("pause-ms", 0));
    json conc = concurrent_opens(t, lease, a.num("concurrent", 100), a.num("connections", 4),
                                 a.num("rounds", 3));
    json exec = sequential_executes(t, lease, a.num("count", 500));
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    return {{"open_p50_ms", seq["to_exit_ms"]["p50"]},
            {"open_p99_ms", seq["to_exit_ms"]["p99"]},
            {"execute_p50_ms", exec["p50"]},
            {"execute_p99_ms", exec["p99"]},
            {"details",
             {{"open_sequential", seq}, {"open_concurrent", conc}, {"execute_sequential", exec}}}};
}

/// open-ab: a paired A/B of two daemons (issue 19; bench/ab --paired): sequential opens of
/// `true` on one connection to each (--url/--token-file and --url-b/--token-file-b), taking
/// turns open by open (A then B, then B then A, so neither always goes first), so that each
/// pair sees the same moment of the machine. Gives each side's to-exit summary, the median of
/// the pairs' differences (B - A, ms) and how many pairs B won: a change of a tenth of a
/// millisecond shows here where rounds of hundreds of opens drift by more than that.
json cmd_open_ab(const Args& a) {
    const Target ta = target_of(a);
    const Target tb = target_of(a, "url-b", "token-file-b");
    Conn ca(ta.url, ta.token);
    Conn cb(tb.url, tb.token);
    const json lease_a = acquire(ca);
    const json lease_b = acquire(cb);
    open_true_once(ca, lease_a);  // warm-up
    open_true_once(cb, lease_b);
    const std::size_t count = a.num("count", 500);
    std::vector<double> a_ms, b_ms, diff_ms, a_result, b_result;
    std::size_t b_faster = 0;
    for (std::size_t i = 0; i < count; ++i) {
        std::pair<double, double> ra, rb;
        if (i % 2 == 0) {
            ra = open_true_once(ca, lease_a);
            rb = open_true_once(cb, lease_b);
        } else {
            rb = open_true_once(cb, lease_b);
            ra = open_true_once(ca, lease_a);
        }
        a_ms.push_back(ra.first);
        b_ms.push_back(rb.first);
        a_result.push_back(ra.second);
        b_result.push_back(rb.second);
        diff_ms.push_back(rb.first - ra.first);
        if (rb.first < ra.first) ++b_faster;
    }
    ca.call("leaseRelease", {{"leaseId", lease_a["id"]}});
    cb.call("leaseRelease", {{"leaseId", lease_b["id"]}});
    ca.close();
    cb.close();
    return {{"pairs", count},
            {"b_minus_a_p50_ms", median(diff_ms)},
            {"b_faster_pairs", b_faster},
            {"a", {{"to_exit_ms", summary(a_ms)}, {"to_result_ms", summary(a_result)}}},
            {"b", {{"to_exit_ms", summary(b_ms)}, {"to_result_ms", summary(b_result)}}}};
}

/// tls: the same node through its TLS `listen` (--tls-url, verified with --cacert) and its
/// plainListen (--url), in one run: sequential opens of `true` and streams of --bytes, the two
/// transports taking turns run by run, so that both see the same machine.
json cmd_tls(const Args& a) {
    const Target plain = target_of(a);
    const Target tls = target_of(a, "tls-url");
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    const std::uint64_t window = a.num("window", 16ULL << 20);
    const std::uint64_t batch = a.num("credit-batch", window / 8);
    const long pid = static_cast<long>(a.num("pid", 0));
    const std::size_t count = a.num("count", 500);
    Conn c(plain.url, plain.token);
    const json lease = acquire(c);
    stream_once(tls, lease, std::min<std::uint64_t>(bytes, 32ULL << 20), window, batch,
                pid);  // warm-up
    std::vector<json> plain_runs, tls_runs;
    json plain_opens, tls_opens;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i) {
        plain_runs.push_back(stream_once(plain, lease, bytes, window, batch, pid));
        tls_runs.push_back(stream_once(tls, lease, bytes, window, batch, pid));
    }
    plain_opens = sequential_opens(plain, lease, count);
    tls_opens = sequential_opens(tls, lease, count);
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    json ps = runs_summary(plain_runs);
    json ts = runs_summary(tls_runs);
    return {{"tls_stream_mb_s", ts["median_mb_s"]},
            {"plain_stream_mb_s", ps["median_mb_s"]},
            {"tls_open_p50_ms", tls_opens["to_exit_ms"]["p50"]},
            {"plain_open_p50_ms", plain_opens["to_exit_ms"]["p50"]},
            {"details",
             {{"tls",
               {{"stream", ts},
                {"plain_stream", ps},
                {"open", tls_opens},
                {"plain_open", plain_opens},
                {"bytes", bytes}}}}}};
}

/// stream: head -c N /dev/zero through a channel.
json cmd_stream(const Args& a) {
    const Target t = target_of(a);
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    const std::uint64_t window = a.num("window", 16ULL << 20);
    const std::uint64_t batch = a.num("credit-batch", window / 8);
    const long pid = static_cast<long>(a.num("pid", 0));
    Conn c(t.url, t.token);
    const json lease = acquire(c);
    stream_once(t, lease, std::min<std::uint64_t>(bytes, 32ULL << 20), window, batch,
                pid);  // warm-up
    std::vector<json> runs;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i)
        runs.push_back(stream_once(t, lease, bytes, window, batch, pid));
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    json s = runs_summary(runs);
    s["bytes"] = bytes;
    s["output_window"] = window;
    s["credit_batch"] = batch;
    return {{a.str("key", "stream_mb_s"), s["median_mb_s"]},
            {"details", {{a.str("key", "stream_mb_s"), s}}}};
}

/// stdin: N bytes into `cat > /dev/null`.
json cmd_stdin(const Args& a) {
    const Target t = target_of(a);
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    const long pid = static_cast<long>(a.num("pid", 0));
    Conn c(t.url, t.token);
    const json lease = acquire(c);
    stdin_once(t, lease, std::min<std::uint64_t>(bytes, 32ULL << 20), pid);  // warm-up
    std::vector<json> runs;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i)
        runs.push_back(stdin_once(t, lease, bytes, pid));
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    json s = runs_summary(runs);
    s["bytes"] = bytes;
    return {{"stdin_mb_s", s["median_mb_s"]}, {"details", {{"stdin_mb_s", s}}}};
}

/// pipe: `head -c N /dev/zero | cat > /dev/null`, timed here from spawn to exit.
json cmd_pipe(const Args& a) {
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    std::vector<json> runs;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i) {
        const std::string script =
            "head -c " + std::to_string(bytes) + " /dev/zero | cat > /dev/null";
        const char* argv[] = {"/bin/sh", "-c", script.c_str(), nullptr};
        const auto t0 = clock_type::now();
        pid_t pid = 0;
        if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) !=
            0) {
            throw std::runtime_error("cannot spawn /bin/sh");
        }
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        const double secs = secs_since(t0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            throw std::runtime_error("pipe anchor failed");
        runs.push_back({{"mb_s", static_cast<double>(bytes) / 1e6 / secs}, {"seconds", secs}});
    }
    json s = runs_summary(runs);
    s["bytes"] = bytes;
    return {{"pipe_mb_s", s["median_mb_s"]}, {"details", {{"pipe_mb_s", s}}}};
}

/// One websocketd spawn of its command (/bin/true): connect to close; ms.
double ws_open_once(const Url& u) {
    const auto t0 = clock_type::now();
    Conn c(u, "");
    Msg m;
    while (c.read(m, true)) {
    }
    return ms_since(t0);
}

/// ws-open: websocketd spawning /bin/true per connection; connect to close.
json cmd_ws_open(const Args& a) {
    const Url u = parse_url(a.need("url"));
    const std::size_t count = a.num("count", 500);
    std::vector<double> ms;
    ws_open_once(u);  // warm-up
    for (std::size_t i = 0; i < count; ++i) ms.push_back(ws_open_once(u));
    json s = summary(ms);
    return {{"websocketd_open_alone_p50_ms", s["p50"]},
            {"details", {{"websocketd_open_alone", s}}}};
}

/// open-refused: sequential duplexChannelOpen requests on a lease of the no-op provider, each
/// answered with its PROVIDER_ERROR (src/provider/noop_provider.cpp), timed from the request to
/// that answer: the daemon's own part of an open (the WebSocket request and answer, the lease's
/// registry read and checks, the handle cache, the provider call) with no sandbox and no
/// process. Next to the open floor (no daemon), it shows what each side of an open costs.
json cmd_open_refused(const Args& a) {
    const Target t = target_of(a);
    Conn c(t.url, t.token);
    const json lease = acquire(c, "bench", "open-refused", json::object(), "noop");
    const std::size_t count = a.num("count", 500);
    auto refused_once = [&] {
        const auto t0 = clock_type::now();
        try {
            c.call("duplexChannelOpen", open_params(lease, {"true"}, false));
        } catch (const RpcError& e) {
            const double ms = ms_since(t0);
            if (e.reason() != "PROVIDER_ERROR") throw;
            return ms;
        }
        throw std::runtime_error("open-refused: the no-op provider opened a channel");
    };
    refused_once();  // warm-up
    std::vector<double> ms;
    for (std::size_t i = 0; i < count; ++i) ms.push_back(refused_once());
    c.call("leaseRelease", {{"leaseId", lease.at("id")}});
    json s = summary(ms);
    return {{"open_refused_p50_ms", s["p50"]}, {"details", {{"open_refused", s}}}};
}

/// open-pair: the open of `true` (to its exit) on the node (--url, --token-file) and
/// websocketd's spawn of /bin/true (--ws-url) taking turns in blocks of --block opens (25;
/// sandboxd first, then websocketd first), so that the ratio of the two compares them over the
/// same minute of a shared machine (issue 19's open targets), where separate runs a minute
/// apart drift by a fifth (websocketd's p50 went from 2.4 to 3.3 ms between runs). Blocks
/// rather than single opens, so that each side's opens follow its own as they do alone (the
/// ratios came out the same at blocks of 1, 25 and 500 in one session: p50 1.57-1.74, p99
/// 1.44-1.86). Gives both summaries (the anchor: websocketd_open).
json cmd_open_pair(const Args& a) {
    const Target t = target_of(a);
    const Url ws = parse_url(a.need("ws-url"));
    Conn c(t.url, t.token);
    const json lease = acquire(c);
    open_true_once(c, lease);  // warm-ups
    ws_open_once(ws);
    const std::size_t count = a.num("count", 500);
    const std::size_t block = std::max<std::uint64_t>(1, a.num("block", 25));
    std::vector<double> sd_ms, ws_ms;
    for (std::size_t done = 0, turn = 0; done < count; done += block, ++turn) {
        const std::size_t n = std::min(block, count - done);
        for (int side = 0; side < 2; ++side) {
            if ((side == 0) == (turn % 2 == 0)) {
                for (std::size_t i = 0; i < n; ++i) sd_ms.push_back(open_true_once(c, lease).first);
            } else {
                for (std::size_t i = 0; i < n; ++i) ws_ms.push_back(ws_open_once(ws));
            }
        }
    }
    c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    json sd = summary(sd_ms), w = summary(ws_ms);
    return {{"open_paired_p50_ms", sd["p50"]},
            {"open_paired_p99_ms", sd["p99"]},
            {"websocketd_open_p50_ms", w["p50"]},
            {"details", {{"open_paired", sd}, {"websocketd_open", w}}}};
}

/// ws-stream: websocketd --binary streaming `head -c N /dev/zero`; connect to close.
json cmd_ws_stream(const Args& a) {
    const Url u = parse_url(a.need("url"));
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    std::vector<json> runs;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i) {
        const double cpu0 = cpu_self_s();
        const auto t0 = clock_type::now();
        Conn c(u, "");
        std::uint64_t got = 0, frames = 0;
        Msg m;
        while (c.read(m, true)) {
            got += c.last_size();
            ++frames;
        }
        const double secs = secs_since(t0);
        if (got != bytes) {
            throw std::runtime_error("websocketd stream: got " + std::to_string(got) + " of " +
                                     std::to_string(bytes) + " bytes");
        }
        runs.push_back({{"mb_s", static_cast<double>(bytes) / 1e6 / secs},
                        {"seconds", secs},
                        {"frames", frames},
                        {"client_cpu_s", cpu_self_s() - cpu0}});
    }
    json s = runs_summary(runs);
    s["bytes"] = bytes;
    return {{"websocketd_stream_mb_s", s["median_mb_s"]},
            {"details", {{"websocketd_stream_mb_s", s}}}};
}

/// hold: N channels of `sleep 600` at once over several connections; the daemon's RSS; open
/// p99 of `true` while they are held; then stops them all.
json cmd_hold(const Args& a) {
    const Target t = target_of(a);
    const long pid = static_cast<long>(a.num("pid", 0));
    if (pid <= 0) throw std::runtime_error("hold needs --pid of the daemon");
    const std::size_t total = a.num("channels", 1000);
    const std::size_t nconn = a.num("connections", 8);
    const std::size_t probes = a.num("probe", 200);
    const std::size_t nleases = a.num("leases", 1);
    if (nleases < 1 || nleases > total)
        throw std::runtime_error("hold: --leases must be 1..channels");

    Conn control(t.url, t.token);
    // The channels go round-robin over the leases. Every held channel is two processes of its
    // lease (its init and the command): room for them all above the default pids limit (1024).
    std::vector<json> leases;
    const std::size_t per_lease = (total + nleases - 1) / nleases;
    for (std::size_t i = 0; i < nleases; ++i) {
        // Few files per process (each held channel is `sleep`): the node's open-file budget
        // counts openFiles x pids per lease (issue 44, item 5), and 40 leases must fit it.
        leases.push_back(acquire(control, "bench", "hold-" + std::to_string(i),
                                 {{"pids", 2 * per_lease + 64}, {"openFiles", 64}}));
    }
    const json& lease = leases.front();
    open_true_once(control, lease);  // warm the daemon's paths once
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const long rss_before = rss_kib(pid);

    std::vector<std::unique_ptr<Conn>> conns;
    for (std::size_t i = 0; i < nconn; ++i) conns.push_back(std::make_unique<Conn>(t.url, t.token));
    std::mutex mu;
    std::condition_variable cv;
    std::size_t opened_conns = 0;
    bool stop = false;
    std::string failure;
    std::size_t opened = 0, exits_total = 0;
    const auto open_start = clock_type::now();
    double open_all_s = 0, stop_all_s = 0;
    std::vector<std::thread> threads;
    for (std::size_t ci = 0; ci < nconn; ++ci) {
        const std::size_t mine = total / nconn + (ci < total % nconn ? 1 : 0);
        threads.emplace_back([&, ci, mine] {
            Conn& c = *conns[ci];
            std::vector<std::uint32_t> channels;
            try {
                // Pipelined, but never more requests in flight than the daemon serves at once
                // on one connection (it refuses the rest with CHANNEL_LIMIT).
                const std::size_t window = std::min<std::size_t>(
                    a.num("window", 64),
                    c.call("initialize", {{"protocolVersion", 1}})["limits"].value(
                        "requestsPerConnection", 1U));
                std::deque<std::int64_t> ids;
                std::size_t sent = 0;
                while (sent < mine || !ids.empty()) {
                    while (sent < mine && ids.size() < window) {
                        const json& on = leases[(ci + sent * nconn) % nleases];
                        ids.push_back(c.send_request("duplexChannelOpen",
                                                     open_params(on, {"sleep", "600"}, false)));
                        ++sent;
                    }
                    channels.push_back(c.wait(ids.front()).at("channel").get<std::uint32_t>());
                    ids.pop_front();
                }
            } catch (const std::exception& e) {
                std::lock_guard lock(mu);
                failure = "open: " + std::string(e.what());
            }
            {
                std::unique_lock lock(mu);
                opened += channels.size();
                ++opened_conns;
                cv.notify_all();
                cv.wait(lock, [&] { return stop; });
            }
            try {
                std::map<std::int64_t, bool> ids;
                for (auto ch : channels)
                    ids[c.send_request("duplexChannelStop", {{"channel", ch}})] = true;
                std::size_t exits = 0;
                while (exits < channels.size()) {
                    Msg m;
                    c.next(m);
                    if (m.is_exit()) ++exits;
                    if (m.is_response()) Conn::result_of(m.j);
                }
                std::lock_guard lock(mu);
                exits_total += exits;
            } catch (const std::exception& e) {
                std::lock_guard lock(mu);
                failure = "stop: " + std::string(e.what());
            }
        });
    }
    {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return opened_conns == nconn; });
        open_all_s = secs_since(open_start);
    }
    // Let the daemon settle (bwrap children finish their setup), then read its RSS.
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    const long rss_held = rss_kib(pid);
    std::vector<double> probe_ms;
    std::string probe_failure;
    if (failure.empty()) {
        try {
            for (std::size_t i = 0; i < probes; ++i)
                probe_ms.push_back(open_true_once(control, lease).first);
        } catch (const std::exception& e) {
            probe_failure = e.what();
        }
    }
    const long rss_after_probe = rss_kib(pid);
    const auto stop_start = clock_type::now();
    {
        std::lock_guard lock(mu);
        stop = true;
        cv.notify_all();
    }
    for (auto& th : threads) th.join();
    stop_all_s = secs_since(stop_start);
    for (auto& c : conns) c->close();
    for (const auto& l : leases) control.call("leaseRelease", {{"leaseId", l["id"]}});
    control.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const long rss_after = rss_kib(pid);
    if (!failure.empty()) throw std::runtime_error("hold: " + failure);
    if (!probe_failure.empty()) throw std::runtime_error("hold probe: " + probe_failure);
    if (opened != total || exits_total != total) {
        throw std::runtime_error("hold: opened " + std::to_string(opened) + ", exits " +
                                 std::to_string(exits_total) + " of " + std::to_string(total));
    }
    json probe = summary(probe_ms);
    const double per_channel_kib =
        static_cast<double>(rss_held - rss_before) / static_cast<double>(total);
    return {{"held_channels", opened},
            {"held_rss_mb", static_cast<double>(rss_held) / 1024.0},
            {"details",
             {{"hold",
               {{"channels", opened},
                {"leases", nleases},
                {"connections", nconn},
                {"rss_before_kib", rss_before},
                {"rss_held_kib", rss_held},
                {"rss_after_probe_kib", rss_after_probe},
                {"rss_after_stop_kib", rss_after},
                {"rss_per_channel_kib", per_channel_kib},
                {"open_all_s", open_all_s},
                {"stop_all_s", stop_all_s},
                {"open_while_held_ms", probe}}}}}};
}

/// One connection's leaseAcquire + leaseRelease pairs, one after the other, for `seconds`.
struct LeasePairs {
    std::size_t pairs = 0;
    std::vector<double> acquire_ms, release_ms;
};

LeasePairs lease_pairs(const Target& t, const std::string& provider, double seconds,
                       std::size_t index) {
    Conn c(t.url, t.token);
    LeasePairs out;
    const auto t0 = clock_type::now();
    while (secs_since(t0) < seconds) {
        auto t1 = clock_type::now();
        const json lease =
            acquire(c, "bench", "ops-" + std::to_string(index), json::object(), provider);
        out.acquire_ms.push_back(ms_since(t1));
        t1 = clock_type::now();
        c.call("leaseRelease", {{"leaseId", lease["id"]}});
        out.release_ms.push_back(ms_since(t1));
        ++out.pairs;
    }
    c.close();
    return out;
}

/// lease-ops [--provider P] [--connections N] [--key NAME]: leaseAcquire + leaseRelease pairs
/// per second, sequential on each of N connections (1: one after the other), all N in
/// parallel; the figure is named NAME (default lease_ops_per_s).
json cmd_lease_ops(const Args& a) {
    const Target t = target_of(a);
    const double seconds = static_cast<double>(a.num("seconds", 10));
    const std::string provider = a.str("provider", "bwrap");
    const std::size_t connections = a.num("connections", 1);
    const std::string key = a.str("key", "lease_ops_per_s");
    if (connections < 1 || connections > 64) throw std::runtime_error("--connections: 1..64");
    std::vector<LeasePairs> results(connections);
    std::vector<std::exception_ptr> errors(connections);
    const auto t0 = clock_type::now();
    {
        std::vector<std::jthread> threads;
        threads.reserve(connections);
        for (std::size_t i = 0; i < connections; ++i) {
            threads.emplace_back([&, i] {
                try {
                    results[i] = lease_pairs(t, provider, seconds, i);
                } catch (...) {
                    errors[i] = std::current_exception();
                }
            });
        }
    }
    const double secs = secs_since(t0);
    for (const auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
    LeasePairs all;
    for (auto& r : results) {
        all.pairs += r.pairs;
        all.acquire_ms.insert(all.acquire_ms.end(), r.acquire_ms.begin(), r.acquire_ms.end());
        all.release_ms.insert(all.release_ms.end(), r.release_ms.begin(), r.release_ms.end());
    }
    const double rate = static_cast<double>(all.pairs) / secs;
    const std::string detail = key.substr(0, key.size() - std::string_view("_per_s").size());
    return {{key, rate},
            {"details",
             {{detail,
               {{"provider", provider},
                {"connections", connections},
                {"pairs", all.pairs},
                {"seconds", secs},
                {"acquire_ms", summary(all.acquire_ms)},
                {"release_ms", summary(all.release_ms)}}}}}};
}

/// proxy: a lease owned by node A (--owner-url), opened through node B (--url).
json cmd_proxy(const Args& a) {
    const Target owner = target_of(a, "owner-url", "owner-token-file");
    const Target via = target_of(a);
    const std::uint64_t bytes = a.num("bytes", 1ULL << 30);
    const std::uint64_t window = a.num("window", 16ULL << 20);
    const long pid = static_cast<long>(a.num("pid", 0));
    Conn oc(owner.url, owner.token);
    const json lease = acquire(oc);
    json out;
    try {
        Conn c(via.url, via.token);
        open_true_once(c, lease);  // the first open tells whether routing is there
        c.close();
    } catch (const RpcError& e) {
        if (e.reason() != "OWNER_UNAVAILABLE" && e.reason() != "OWNER_ELSEWHERE") throw;
        oc.call("leaseRelease", {{"leaseId", lease["id"]}});
        oc.close();
        return {{"proxy_open_p50_ms", nullptr},
                {"proxy_stream_mb_s", nullptr},
                {"details", {{"proxy", {{"unavailable", e.what()}}}}}};
    }
    json seq = sequential_opens(via, lease, a.num("count", 500));
    stream_once(via, lease, std::min<std::uint64_t>(bytes, 32ULL << 20), window, window / 8,
                pid);  // warm-up
    std::vector<json> runs;
    for (std::uint64_t i = 0; i < a.num("runs", 3); ++i) {
        runs.push_back(stream_once(via, lease, bytes, window, a.num("credit-batch", window / 8),
                                   pid, static_cast<long>(a.num("via-pid", 0))));
    }
    oc.call("leaseRelease", {{"leaseId", lease["id"]}});
    oc.close();
    json s = runs_summary(runs);
    s["bytes"] = bytes;
    return {{"proxy_open_p50_ms", seq["to_exit_ms"]["p50"]},
            {"proxy_stream_mb_s", s["median_mb_s"]},
            {"details", {{"proxy", {{"open_sequential", seq}, {"stream", s}}}}}};
}

/// free-port: a free TCP port on 127.0.0.1 (for websocketd, which has no port 0).
json cmd_free_port(const Args&) {
    net::io_context ioc;
    tcp::acceptor acc(ioc, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0));
    std::cout << acc.local_endpoint().port() << "\n";
    return nullptr;
}

// ---------------------------------------------------------------- report

const std::vector<std::string> required_keys = {
    "open_p50_ms",   "open_p99_ms",       "websocketd_open_p50_ms",
    "stream_mb_s",   "pipe_mb_s",         "websocketd_stream_mb_s",
    "stdin_mb_s",    "proxy_open_p50_ms", "proxy_stream_mb_s",
    "held_channels", "held_rss_mb",       "lease_ops_per_s"};

std::string fmt(const json& v, int precision = 1) {
    if (v.is_null()) return "n/a";
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", precision, v.get<double>());
    return buf;
}

std::string verdict(bool met) { return met ? "met" : "MISSED"; }

/// report --out FILE --details FILE --command CMD --machine M FRAGMENT.json...
json cmd_report(const Args& a) {
    json all = json::object(), details = json::object();
    for (const auto& path : a.positional) {
        json frag = json::parse(read_file(path));
        for (auto& [k, v] : frag.items()) {
            if (k == "details") {
                for (auto& [dk, dv] : v.items()) details[dk] = dv;
            } else {
                all[k] = v;
            }
        }
    }
    json latest = json::object();
    for (const auto& k : required_keys) {
        if (!all.contains(k)) throw std::runtime_error("report: no figure for " + k);
        if (!all[k].is_number() && !(all[k].is_null() && k.rfind("proxy_", 0) == 0)) {
            throw std::runtime_error("report: " + k + " is not a number: " + all[k].dump());
        }
        latest[k] = all[k];
    }
    // The open targets' rows come from open-pair.
    if (!details.contains("open_paired") || !details.contains("websocketd_open")) {
        throw std::runtime_error("report: no open-pair figures (sandboxd_bench open-pair)");
    }
    // Optional figures: scenarios that a run may leave out.
    for (const char* k :
         {"node_client_stream_mb_s", "tls_stream_mb_s", "plain_stream_mb_s", "tls_open_p50_ms",
          "plain_open_p50_ms", "noop_lease_ops_per_s", "noop_lease_ops_parallel_per_s",
          "open_floor_p50_ms", "stream_floor_mb_s", "open_paired_p50_ms", "open_paired_p99_ms",
          "websocketd_open_alone_p50_ms", "open_refused_p50_ms", "restart_serving_ms"}) {
        if (all.contains(k)) latest[k] = all[k];
    }
    if (details.contains("hold")) {  // measured at 10,000 channels, or extrapolated to it
        const auto& h = details["hold"];
        latest["held_rss_10k_mb"] =
            (h["rss_before_kib"].get<double>() + h["rss_per_channel_kib"].get<double>() * 10000.0) /
            1024.0;
    }
    if (details.contains("lease_ops")) {  // bwrap: leaseAcquire p50 + leaseRelease p50
        latest["lease_pair_p50_ms"] = details["lease_ops"]["acquire_ms"]["p50"].get<double>() +
                                      details["lease_ops"]["release_ms"]["p50"].get<double>();
    }
    latest["machine"] = a.need("machine");
    latest["command"] = a.need("command");
    {
        std::ofstream out(a.need("out"));
        out << latest.dump(2) << "\n";
        if (!out) throw std::runtime_error("cannot write " + a.need("out"));
    }
    if (a.has("details")) {
        json d = {{"machine", latest["machine"]},
                  {"command", latest["command"]},
                  {"figures", latest},
                  {"details", details}};
        std::ofstream out(a.need("details"));
        out << d.dump(2) << "\n";
    }

    // The table.
    auto num = [&](const std::string& k) { return all[k]; };
    auto ratio = [](const json& x, const json& y) -> json {
        if (x.is_null() || y.is_null() || y.get<double>() == 0) return nullptr;
        return x.get<double>() / y.get<double>();
    };
    std::ostringstream t;
    char line[512];
    auto row = [&](const std::string& what, const std::string& value, const std::string& anchor,
                   const std::string& target, const std::string& status) {
        std::snprintf(line, sizeof line, "| %-44s | %-16s | %-32s | %-18s | %-13s |\n",
                      what.c_str(), value.c_str(), anchor.c_str(), target.c_str(), status.c_str());
        t << line;
    };
    row("scenario", "sandboxd", "anchor", "target", "status");
    t << "|" << std::string(46, '-') << "|" << std::string(18, '-') << "|" << std::string(34, '-')
      << "|" << std::string(20, '-') << "|" << std::string(15, '-') << "|\n";

    // The targets' rows: sandboxd and websocketd taking turns in blocks (open-pair).
    {
        const auto& sd = details["open_paired"];
        const auto& ws = details["websocketd_open"];
        const json p50_ratio = ratio(sd["p50"], ws["p50"]);
        const json p99_ratio = ratio(sd["p99"], ws["p99"]);
        row("open `true` p50, turns with websocketd (ms)", fmt(sd["p50"], 2),
            "websocketd /bin/true " + fmt(ws["p50"], 2), "<= 1.0x websocketd",
            p50_ratio.is_null()
                ? "n/a"
                : verdict(p50_ratio.get<double>() <= 1.0) + " " + fmt(p50_ratio, 2) + "x");
        row("open `true` p99, turns with websocketd (ms)", fmt(sd["p99"], 2),
            "websocketd p99 " + fmt(ws["p99"], 2), "<= 1.5x websocketd",
            p99_ratio.is_null()
                ? "n/a"
                : verdict(p99_ratio.get<double>() <= 1.5) + " " + fmt(p99_ratio, 2) + "x");
        std::string alone_anchor;
        if (details.contains("websocketd_open_alone")) {
            const auto& wa = details["websocketd_open_alone"];
            alone_anchor = "websocketd alone " + fmt(wa["p50"], 2) + " / " + fmt(wa["p99"], 2);
        }
        row("  p50 / p99, each alone, a minute apart (ms)",
            fmt(num("open_p50_ms"), 2) + " / " + fmt(num("open_p99_ms"), 2), alone_anchor, "", "");
    }
    if (details.contains("open_floor")) {
        // sandboxd_open_floor: the kernel's part of a channel's isolation, no daemon at all,
        // each line adding one piece to the line before (bench/open_floor.cpp).
        const auto& f = details["open_floor"];
        const json bare = f["spawn"]["p50"];
        // The floor runs right after websocketd alone: the anchor of that moment.
        const json ws_p50 = num("websocketd_open_alone_p50_ms");
        row("  floor, no daemon: posix_spawn true (ms)", fmt(bare, 2),
            "websocketd " + fmt(ws_p50, 2), "", "");
        for (const auto& [key, what] : std::vector<std::pair<std::string, std::string>>{
                 {"init", "+ an init process"},
                 {"pid_ns", "+ its PID namespace"},
                 {"mount_ns", "+ mount namespace, /proc"},
                 {"cgroup", "+ cgroup join"},
                 {"seccomp", "+ seccomp filter"},
                 {"warm", "all, init made ahead"}}) {
            if (!f.contains(key)) continue;
            const json r = ratio(f[key]["p50"], ws_p50);
            row("  floor " + what + " (ms)", fmt(f[key]["p50"], 2), "(ratio: to websocketd)", "",
                r.is_null() ? "" : fmt(r, 2) + "x");
        }
        if (f.contains("tcp_rtt") && f.contains("warm")) {
            // The least a request and its answer over loopback TCP add to the warm floor: what
            // no daemon serving opens over a connection goes below on this machine.
            const double with_rtt =
                f["warm"]["p50"].get<double>() + f["tcp_rtt"]["p50"].get<double>();
            const json r = ratio(json(with_rtt), ws_p50);
            row("  floor all + a loopback round trip (ms)", fmt(json(with_rtt), 2),
                "round trip " + fmt(f["tcp_rtt"]["p50"], 3) + " ms", "",
                r.is_null() ? "" : fmt(r, 2) + "x");
        }
        if (details.contains("open_refused") && f.contains("warm")) {
            // The daemon's own part (request to answer, no sandbox) on top of the kernel's:
            // the least that this design of an open comes to on this machine.
            const json refused = details["open_refused"]["p50"];
            row("  daemon alone: open refused, no-op provider (ms)", fmt(refused, 2),
                "request to its error, no sandbox", "", "");
            const double least = f["warm"]["p50"].get<double>() + refused.get<double>();
            const json r = ratio(json(least), ws_p50);
            row("  floor all + daemon alone (ms)", fmt(json(least), 2), "(ratio: to websocketd)",
                "", r.is_null() ? "" : fmt(r, 2) + "x");
        }
    }
    if (details.contains("execute_sequential")) {
        const json exec_ratio = ratio(num("execute_p50_ms"), num("open_p50_ms"));
        row("leaseExecute `true` p50 / p99, sequential (ms)",
            fmt(num("execute_p50_ms"), 2) + " / " + fmt(num("execute_p99_ms"), 2),
            "open `true` " + fmt(num("open_p50_ms"), 2), "",
            exec_ratio.is_null() ? "n/a" : fmt(exec_ratio, 2) + "x open");
    }
    if (details.contains("open_concurrent")) {
        const auto& c = details["open_concurrent"];
        row("open p50 / p99, " + std::to_string(c["in_flight"].get<int>()) + " in flight (ms)",
            fmt(c["to_exit_ms"]["p50"], 1) + " / " + fmt(c["to_exit_ms"]["p99"], 1),
            fmt(c["opens_per_s"], 0) + " opens/s", "", "");
    }
    const json stream_ratio = ratio(num("stream_mb_s"), num("pipe_mb_s"));
    row("stream head|channel (MB/s)", fmt(num("stream_mb_s"), 0),
        "pipe " + fmt(num("pipe_mb_s"), 0), ">= 90% of pipe",
        stream_ratio.is_null() ? "n/a"
                               : verdict(stream_ratio.get<double>() >= 0.9) + " " +
                                     fmt(json(stream_ratio.get<double>() * 100), 0) + "%");
    if (details.contains("stream_floor")) {
        // sandboxd_stream_floor: the same bytes over loopback TCP with no daemon, each way beside
        // its own `head | cat` in one run (bench/stream_floor.cpp); ratios to that pipe.
        const auto& f = details["stream_floor"];
        const json own_pipe = f["pipe"]["median_mb_s"];
        for (const auto& [key, what] : std::vector<std::pair<std::string, std::string>>{
                 {"tcp", "head -> TCP -> reader"},
                 {"relay_copy", "+ bare relay, read+write"},
                 {"relay_splice", "+ bare relay, splice"}}) {
            if (!f.contains(key)) continue;
            const json r = ratio(f[key]["median_mb_s"], own_pipe);
            row("  floor: " + what + " (MB/s)", fmt(f[key]["median_mb_s"], 0),
                "its pipe " + fmt(own_pipe, 0), "",
                r.is_null() ? "" : fmt(json(r.get<double>() * 100), 0) + "%");
        }
    }
    row("websocketd --binary head (MB/s)", "",
        fmt(num("websocketd_stream_mb_s"), 0) + " (" +
            fmt(ratio(num("stream_mb_s"), num("websocketd_stream_mb_s")), 2) + "x of it)",
        "", "");
    if (all.contains("node_client_stream_mb_s")) {
        const json node_ratio = ratio(num("node_client_stream_mb_s"), num("stream_mb_s"));
        row("stream, @sandboxd/client for Node (MB/s)", fmt(num("node_client_stream_mb_s"), 0),
            "C++ client " + fmt(num("stream_mb_s"), 0), "",
            node_ratio.is_null() ? "n/a"
                                 : fmt(json(node_ratio.get<double>() * 100), 0) + "% of C++");
    }
    if (all.contains("detached_stream_ratio")) {
        const auto& d = details["detached"];
        const double sr = num("detached_stream_ratio").get<double>();
        row("  detached stream (MB/s)", fmt(d["detached_stream_mb_s"]["median_mb_s"], 0),
            "undetached " + fmt(d["stream_mb_s"]["median_mb_s"], 0), ">= 0.8x",
            fmt(json(sr), 2) + "x " + verdict(sr >= 0.8));
        row("  replay of kept output (MB/s)", fmt(num("detached_replay_mb_s"), 0),
            fmt(json(d["replay_bytes"].get<double>() / 1048576.0), 0) + " MiB kept", "", "");
        const double orat = num("detached_open_ratio").get<double>();
        row("  open `true` p50, detached (ms)", fmt(d["detached_open_ms"]["p50"], 2),
            "undetached " + fmt(d["open_ms"]["p50"], 2), "<= 1.05x",
            fmt(json(orat), 3) + "x " + verdict(orat <= 1.05));
    }
    if (all.contains("tls_stream_mb_s")) {
        const json tr = ratio(num("tls_stream_mb_s"), num("plain_stream_mb_s"));
        row("stream over TLS (wss://) (MB/s)", fmt(num("tls_stream_mb_s"), 0),
            "plain " + fmt(num("plain_stream_mb_s"), 0), "",
            tr.is_null() ? "n/a" : fmt(json(tr.get<double>() * 100), 0) + "% of plain");
        row("open `true` p50 over TLS (ms)", fmt(num("tls_open_p50_ms"), 2),
            "plain " + fmt(num("plain_open_p50_ms"), 2), "", "");
    }
    row("stdin into cat > /dev/null (MB/s)", fmt(num("stdin_mb_s"), 0),
        "pipe " + fmt(num("pipe_mb_s"), 0), "", "");
    if (num("proxy_open_p50_ms").is_null()) {
        row("proxied open p50 (ms)", "n/a", "routing not available", "", "n/a");
        row("proxied stream (MB/s)", "n/a", "routing not available", "90-110% of direct", "n/a");
    } else {
        const json pr = ratio(num("proxy_stream_mb_s"), num("stream_mb_s"));
        row("proxied open p50 (ms)", fmt(num("proxy_open_p50_ms"), 2),
            "direct " + fmt(num("open_p50_ms"), 2) + " (" +
                fmt(ratio(num("proxy_open_p50_ms"), num("open_p50_ms")), 2) + "x)",
            "", "");
        row("proxied stream (MB/s)", fmt(num("proxy_stream_mb_s"), 0),
            "direct " + fmt(num("stream_mb_s"), 0), "90-110% of direct",
            pr.is_null() ? "n/a"
                         : verdict(pr.get<double>() >= 0.9 && pr.get<double>() <= 1.1) + " " +
                               fmt(json(pr.get<double>() * 100), 0) + "%");
    }
    row("held `sleep 600` channels: daemon RSS (MiB)", fmt(num("held_rss_mb"), 1),
        fmt(num("held_channels"), 0) + " channels", "", "");
    if (details.contains("hold")) {
        const auto& h = details["hold"];
        // 10,000 channels need some 50,000 descriptors: where the process may not have them,
        // the run holds fewer and the figure at 10,000 is its per-channel cost times 10,000.
        const double at_10k =
            (h["rss_before_kib"].get<double>() + h["rss_per_channel_kib"].get<double>() * 10000.0) /
            1024.0;
        const bool measured = num("held_channels").get<double>() >= 10000;
        row(measured ? "  daemon RSS at 10,000 channels (MiB)"
                     : "  daemon RSS at 10,000, extrapolated (MiB)",
            fmt(json(at_10k), 1), fmt(h.value("leases", json(1)), 0) + " leases", "<= 64 MiB",
            verdict(at_10k <= 64.0));
        row("  RSS per held channel (KiB)", fmt(h["rss_per_channel_kib"], 1),
            "before " + fmt(json(h["rss_before_kib"].get<double>() / 1024.0), 1) + " MiB", "", "");
        row("  open p50 / p99 while held (ms)",
            fmt(h["open_while_held_ms"]["p50"], 1) + " / " + fmt(h["open_while_held_ms"]["p99"], 1),
            "idle p99 " + fmt(num("open_p99_ms"), 1), "", "");
    }
    if (details.contains("restart")) {
        const auto& r = details["restart"];
        row("restart after kill -9: start to every lease serving (ms)", fmt(r["serving_ms"], 0),
            fmt(r["leases"], 0) + " leases, " + fmt(r["channels_running"], 0) +
                " detached channels kept",
            "", "");
        row("  start to ready (ms)", fmt(r["ready_ms"], 0), "", "", "");
    }
    row("leaseAcquire+leaseRelease (per s)", fmt(num("lease_ops_per_s"), 0), "sqlite registry", "",
        "");
    if (details.contains("lease_ops")) {
        const auto& l = details["lease_ops"];
        const double pair =
            l["acquire_ms"]["p50"].get<double>() + l["release_ms"]["p50"].get<double>();
        row("  bwrap acquire + release p50 (ms)", fmt(json(pair), 1),
            fmt(l["acquire_ms"]["p50"], 1) + " + " + fmt(l["release_ms"]["p50"], 1), "<= 30 ms",
            verdict(pair <= 30.0));
    }
    if (all.contains("noop_lease_ops_per_s")) {
        row("  no-op provider, 1 connection (per s)", fmt(num("noop_lease_ops_per_s"), 0),
            "sqlite registry", ">= 1,000",
            verdict(num("noop_lease_ops_per_s").get<double>() >= 1000.0));
    }
    if (all.contains("noop_lease_ops_parallel_per_s")) {
        row("  no-op provider, 4 connections (per s)", fmt(num("noop_lease_ops_parallel_per_s"), 0),
            "1 connection " + fmt(num("noop_lease_ops_per_s"), 0), "> 1 connection",
            verdict(num("noop_lease_ops_parallel_per_s").get<double>() >
                    num("noop_lease_ops_per_s").get<double>()));
    }
    if (details.contains("load")) {
        t << "load average (1/5/15 min) before: " << details["load"].value("before", "?")
          << ", after: " << details["load"].value("after", "?") << "\n";
    }
    std::cout << t.str();
    if (a.has("table")) {
        std::ofstream out(a.need("table"));
        out << t.str();
    }
    return nullptr;
}

/// restart-setup (issue 47): --leases leases and --channels detached `sleep 3600` channels over
/// them, round robin, for restart-serve once bench/run has killed the daemon (kill -9) and
/// started it again on the same state; writes the leases to --leases-file. The channels
/// outlive the connection (detached).
json cmd_restart_setup(const Args& a) {
    const Target t = target_of(a);
    const std::size_t total = a.num("channels", 1000);
    const std::size_t nleases = a.num("leases", 40);
    if (nleases < 1 || nleases > total) {
        throw std::runtime_error("restart-setup: --leases must be 1..channels");
    }
    Conn c(t.url, t.token);
    const std::size_t per_lease = (total + nleases - 1) / nleases;
    json leases = json::array();
    for (std::size_t i = 0; i < nleases; ++i) {
        leases.push_back(acquire(c, "bench", "restart-" + std::to_string(i),
                                 {{"pids", 2 * per_lease + 64}, {"openFiles", 64}}));
    }
    c.close();
    const auto start = clock_type::now();
    std::size_t sent = 0, opened = 0;
    // At most 200 on one connection (limits.channelsPerConnection is 256 by default), which
    // closes once they are open: they are detached.
    while (sent < total) {
        Conn conn(t.url, t.token);
        const std::size_t window = std::min<std::size_t>(
            64, conn.call("initialize", {{"protocolVersion", 1}})["limits"].value(
                    "requestsPerConnection", 1U));
        const std::size_t last = std::min(total, sent + 200);
        std::deque<std::int64_t> ids;
        while (sent < last || !ids.empty()) {
            while (sent < last && ids.size() < window) {
                json p = open_params(leases[sent % nleases], {"sleep", "3600"}, false);
                p["detach"] = {{"retainMs", 600000}, {"retainBytes", 4096}};
                ids.push_back(conn.send_request("duplexChannelOpen", p));
                ++sent;
            }
            conn.wait(ids.front());
            ids.pop_front();
            ++opened;
        }
        conn.close();
    }
    const double open_all_s = secs_since(start);
    {
        std::ofstream out(a.need("leases-file"));
        out << leases.dump() << "\n";
        if (!out) throw std::runtime_error("cannot write " + a.need("leases-file"));
    }
    return {{"details",
             {{"restart_setup",
               {{"leases", nleases}, {"channels", opened}, {"open_all_s", open_all_s}}}}}};
}

/// restart-serve (issue 47): the daemon was started again at --start-ns (CLOCK_REALTIME, ns,
/// as `date +%s%N` gives it) on restart-setup's state. Waits for its --ready-file (polled
/// every millisecond), then opens `true` on every lease of --leases-file at once and lists
/// each lease's detached channels. Reports the time from the start to the ready file and to
/// every lease having served an open, and how many detached channels came back running
/// (--channels of them are expected). Releases the leases at the end.
json cmd_restart_serve(const Args& a) {
    const std::int64_t start_ns = static_cast<std::int64_t>(a.num("start-ns", 0));
    if (start_ns <= 0) throw std::runtime_error("restart-serve needs --start-ns");
    auto since_start_ms = [start_ns] {
        const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
        return static_cast<double>(now - start_ns) / 1e6;
    };
    const std::string ready_file = a.need("ready-file");
    std::string address;
    for (;;) {
        std::ifstream in(ready_file);
        if (in && std::getline(in, address) && !address.empty()) break;
        if (since_start_ms() > 60000) {
            throw std::runtime_error("restart-serve: no ready file " + ready_file +
                                     " 60 s after the start (did the daemon exit?)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const double ready_ms = since_start_ms();
    const json leases = json::parse(read_file(a.need("leases-file")));
    Conn c(parse_url("ws://" + address + "/v1/ws", ""), read_file(a.need("token-file")));
    std::map<std::uint32_t, std::size_t> pending;  // channel -> lease index
    std::vector<std::int64_t> ids;
    for (const auto& lease : leases) {
        ids.push_back(c.send_request("duplexChannelOpen", open_params(lease, {"true"}, false)));
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
        pending[c.wait(ids[i]).at("channel").get<std::uint32_t>()] = i;
    }
    while (!pending.empty()) {
        Msg m;
        c.next(m);
        if (!m.is_exit()) continue;
        const auto& p = m.j["params"];
        if (pending.erase(p.value("channel", 0U)) == 0) continue;
        if (p.value("exitCode", json()) != 0) {
            throw std::runtime_error("`true` did not exit 0 after the restart: " + p.dump());
        }
    }
    const double serving_ms = since_start_ms();
    std::size_t running = 0;
    for (const auto& lease : leases) {
        const json listed = c.call("duplexChannelList", {{"leaseId", lease["id"]}});
        for (const auto& ch : listed["channels"]) running += ch["state"] == "running" ? 1 : 0;
    }
    const std::size_t expected = a.num("channels", 0);
    for (const auto& lease : leases) c.call("leaseRelease", {{"leaseId", lease["id"]}});
    c.close();
    if (expected != 0 && running != expected) {
        throw std::runtime_error("restart-serve: " + std::to_string(running) + " of " +
                                 std::to_string(expected) + " detached channels came back running");
    }
    return {{"restart_serving_ms", serving_ms},
            {"details",
             {{"restart",
               {{"leases", leases.size()},
                {"channels_running", running},
                {"ready_ms", ready_ms},
                {"serving_ms", serving_ms}}}}}};
}

json dispatch(const Args& a) {
    if (a.command == "open") return cmd_open(a);
    if (a.command == "open-ab") return cmd_open_ab(a);
    if (a.command == "stream") return cmd_stream(a);
    if (a.command == "detached") return cmd_detached(a);
    if (a.command == "tls") return cmd_tls(a);
    if (a.command == "stdin") return cmd_stdin(a);
    if (a.command == "pipe") return cmd_pipe(a);
    if (a.command == "ws-open") return cmd_ws_open(a);
    if (a.command == "open-pair") return cmd_open_pair(a);
    if (a.command == "open-refused") return cmd_open_refused(a);
    if (a.command == "ws-stream") return cmd_ws_stream(a);
    if (a.command == "hold") return cmd_hold(a);
    if (a.command == "restart-setup") return cmd_restart_setup(a);
    if (a.command == "restart-serve") return cmd_restart_serve(a);
    if (a.command == "lease-ops") return cmd_lease_ops(a);
    if (a.command == "proxy") return cmd_proxy(a);
    if (a.command == "free-port") return cmd_free_port(a);
    if (a.command == "report") return cmd_report(a);
    throw std::runtime_error(
        "unknown command \"" + a.command +
        "\" (open, open-ab, open-pair, open-refused, stream, detached, stdin, pipe, "
        "ws-open, ws-stream, hold, restart-setup, restart-serve, lease-ops, "
        "proxy, free-port, report)");
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Args a = parse_args(argc, argv);
        const auto deadline = std::chrono::seconds(a.num("deadline-s", 600));
        std::thread([deadline, cmd = a.command] {
            std::this_thread::sleep_for(deadline);
            std::fprintf(stderr, "sandboxd_bench %s: deadline of %llds passed, giving up\n",
                         cmd.c_str(), static_cast<long long>(deadline.count()));
            std::_Exit(3);
        }).detach();
        json out = dispatch(a);
        if (!out.is_null()) std::cout << out.dump() << std::endl;
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "sandboxd_bench: " << e.what() << std::endl;
        return 1;
    }
}
