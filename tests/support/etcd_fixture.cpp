#include "support/etcd_fixture.hpp"
#include "support/daemon_fixture.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/tls.hpp>

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace sandboxd::test {
namespace fs = std::filesystem;

namespace {

/// Whether every thread of `pid` is stopped: state T in each /proc/PID/task/TID/stat.
bool all_threads_stopped(pid_t pid) {
    std::error_code ec;
    bool any = false;
    for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
        const std::string stat = read_proc_file(task.path() / "stat");
        // "TID (comm) S ...": the state follows the last ')' (comm may hold one).
        const auto close = stat.rfind(')');
        if (close == std::string::npos || close + 2 >= stat.size()) continue;  // exited meanwhile
        if (stat[close + 2] != 'T') return false;
        any = true;
    }
    return any;
}

/// A loopback TCP port that was free a moment ago.
unsigned short free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error("socket failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        ::close(fd);
        throw std::runtime_error("cannot find a free port");
    }
    ::close(fd);
    return ntohs(addr.sin_port);
}

/// A fresh directory, on tmpfs (/dev/shm) when there is one: etcd fsyncs every write.
fs::path make_temp_dir() {
    std::vector<std::string> bases;
    std::error_code ec;
    if (fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
        bases.emplace_back("/dev/shm");
    }
    const char* tmp = std::getenv("TMPDIR");
    bases.emplace_back(tmp && *tmp ? tmp : "/tmp");
    for (const auto& base : bases) {
        std::string tmpl = base + "/sandboxd-etcd.XXXXXX";
        if (::mkdtemp(tmpl.data()) != nullptr) return tmpl;
    }
    throw std::runtime_error("mkdtemp failed");
}

std::string etcd_binary() {
    const char* bin = std::getenv("SANDBOXD_ETCD_BIN");
    std::string path = bin && *bin ? bin : "/usr/bin/etcd";
    if (::access(path.c_str(), X_OK) != 0) {
        throw std::runtime_error(path +
                                 " not found: install the Debian package etcd-server "
                                 "or set SANDBOXD_ETCD_ENDPOINT");
    }
    return path;
}

/// Parses "http://HOST:PORT" into host and port for the health probe.
bool split_endpoint(const std::string& endpoint, std::string& host, unsigned short& port) {
    HostPort parsed;
    try {
        parsed = parse_http_endpoint(endpoint);
    } catch (const address_error&) {
        return false;
    }
    host = parsed.host == "localhost" ? "127.0.0.1" : parsed.host;
    port = parsed.port;
    return true;
}

std::atomic<int> prefix_counter{0};

}  // namespace

namespace {

/// Sends `request`, a whole HTTP/1.0 request, to the plain http:// `endpoint` and returns the
/// whole answer (the server closes after it), or what came within `timeout`; "" when it
/// could not connect.
std::string http_exchange(const std::string& endpoint, const std::string& request,
                          std::chrono::milliseconds timeout) {
    std::string host;
    unsigned short port = 0;
    if (!split_endpoint(endpoint, host, port)) return {};
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return {};
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
        ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        return {};
    }
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(request.size())) {
        ::close(fd);
        return {};
    }
    std::string answer;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
        char buf[4096];
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        answer.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
    return answer;
}

/// POSTs `body` to etcd's JSON gateway at `path` and returns the reply's JSON body. Throws
/// std::runtime_error unless etcd answered 200 within 10 s.
nlohmann::json etcd_post(const std::string& endpoint, const std::string& path,
                         const nlohmann::json& body) {
    const std::string text = body.dump();
    const std::string answer =
        http_exchange(endpoint,
                      "POST " + path + " HTTP/1.0\r\nContent-Type: application/json\r\n" +
                          "Content-Length: " + std::to_string(text.size()) + "\r\n\r\n" + text,
                      std::chrono::seconds(10));
    const auto head_end = answer.find("\r\n\r\n");
    const auto status_line = answer.substr(0, answer.find("\r\n"));
    if (status_line.find(" 200 ") == std::string::npos || head_end == std::string::npos) {
        throw std::runtime_error("etcd " + path + " failed: " + answer.substr(0, 300));
    }
    return nlohmann::json::parse(answer.substr(head_end + 4));
}

}  // namespace

bool etcd_healthy(const std::string& endpoint, std::chrono::milliseconds timeout) {
    std::string host;
    unsigned short port = 0;
    if (!split_endpoint(endpoint, host, port)) return false;
    const std::string answer =
        http_exchange(endpoint, "GET /health HTTP/1.0\r\nHost: " + host + "\r\n\r\n", timeout);
    return answer.find("\"health\":\"true\"") != std::string::npos;
}

std::int64_t EtcdServer::compact() {
    require_private("compact");
    if (tls_) throw std::logic_error("EtcdServer::compact: plain http:// servers only");
    // Any read answers with the store's revision in its header.
    const auto range = etcd_post(endpoint_, "/v3/kv/range", {{"key", "AA=="}});
    const std::int64_t revision = std::stoll(range.at("header").at("revision").get<std::string>());
    etcd_post(endpoint_, "/v3/kv/compaction",
              {{"revision", std::to_string(revision)}, {"physical", true}});
    return revision;
}

bool etcd_healthy_tls(const std::string& endpoint, const EtcdTls& tls,
                      std::chrono::milliseconds timeout) {
    std::string host;
    unsigned short port = 0;
    if (!split_endpoint(endpoint, host, port)) return false;
    try {
        TlsClientOptions o;
        o.ca_file = tls.ca_file.string();
        o.cert_file = tls.cert_file.string();
        o.key_file = tls.key_file.string();
        auto context = make_client_tls(o, "etcd health probe");
        net::io_context ioc;
        ConnStream stream(beast::tcp_stream(ioc), context);
        auto& lowest = beast::get_lowest_layer(stream);
        lowest.expires_after(timeout);
        expect_server_name(stream.tls()->native_handle(), host, true);
        bool ok = false;
        lowest.async_connect(
            tcp::endpoint(net::ip::make_address(host), port), [&](beast::error_code ec) {
                if (ec) return;
                stream.tls()->async_handshake(ssl::stream_base::client, [&](beast::error_code hec) {
                    if (hec) return;
                    auto req = std::make_shared<http::request<http::empty_body>>(http::verb::get,
                                                                                 "/health", 11);
                    req->set(http::field::host, host);
                    auto buffer = std::make_shared<beast::flat_buffer>();
                    auto res = std::make_shared<http::response<http::string_body>>();
                    http::async_write(
                        stream, *req, [&, req, buffer, res](beast::error_code wec, std::size_t) {
                            if (wec) return;
                            http::async_read(stream, *buffer, *res,
                                             [&, buffer, res](beast::error_code rec, std::size_t) {
                                                 ok = !rec &&
                                                      res->body().find("\"health\":\"true\"") !=
                                                          std::string::npos;
                                             });
                        });
                });
            });
        ioc.run();
        return ok;
    } catch (const std::exception&) {
        return false;
    }
}

bool EtcdServer::healthy(std::chrono::milliseconds timeout) const {
    return tls_ ? etcd_healthy_tls(endpoint_, *tls_, timeout) : etcd_healthy(endpoint_, timeout);
}

EtcdServer::EtcdServer(EtcdTls tls)
    : dir_(make_temp_dir()), client_port_(free_port()), tls_(std::move(tls)) {
    do {
        peer_port_ = free_port();
    } while (peer_port_ == client_port_);
    endpoint_ = "https://127.0.0.1:" + std::to_string(client_port_);
    try {
        start();
    } catch (...) {
        std::error_code ec;
        fs::remove_all(dir_, ec);
        throw;
    }
}

EtcdServer::EtcdServer() : dir_(make_temp_dir()) {
    // A free port may be taken by another process before etcd binds it: try other ports.
    for (int attempt = 1;; ++attempt) {
        client_port_ = free_port();
        do {
            peer_port_ = free_port();
        } while (peer_port_ == client_port_);
        endpoint_ = "http://127.0.0.1:" + std::to_string(client_port_);
        try {
            start();
            return;
        } catch (...) {
            std::error_code ec;
            if (attempt < 3 && log().find("address already in use") != std::string::npos) {
                fs::remove_all(dir_ / "data", ec);
                fs::remove(dir_ / "etcd.log", ec);
                continue;
            }
            fs::remove_all(dir_, ec);
            throw;
        }
    }
}

EtcdServer::EtcdServer(External, std::string endpoint)
    : external_(true), endpoint_(std::move(endpoint)) {
    while (!endpoint_.empty() && endpoint_.back() == '/') endpoint_.pop_back();
}

EtcdServer::~EtcdServer() {
    if (external_) return;
    try {
        stop();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "etcd fixture: stopping etcd failed: %s\n", e.what());
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
}

namespace {

/// The endpoint= line of the file that SANDBOXD_ETCD_ENDPOINT_FILE names (written by the
/// ctest fixture's setup, tests/support/ctest_etcd), or "" when the variable is unset or the
/// file or the line is missing.
std::string endpoint_from_file() {
    const char* path = std::getenv("SANDBOXD_ETCD_ENDPOINT_FILE");
    if (path == nullptr || *path == '\0') return {};
    std::ifstream in(path);
    std::string line;
    const std::string key = "endpoint=";
    while (std::getline(in, line)) {
        if (line.rfind(key, 0) == 0) return line.substr(key.size());
    }
    return {};
}

}  // namespace

EtcdServer& EtcdServer::shared() {
    static std::unique_ptr<EtcdServer> server = [] {
        std::string source = "SANDBOXD_ETCD_ENDPOINT";
        const char* env = std::getenv("SANDBOXD_ETCD_ENDPOINT");
        std::string ext = env != nullptr ? env : "";
        if (ext.empty()) {
            source = "the endpoint in SANDBOXD_ETCD_ENDPOINT_FILE";
            ext = endpoint_from_file();
        }
        if (!ext.empty()) {
            auto s = std::unique_ptr<EtcdServer>(new EtcdServer(External{}, ext));
            if (!etcd_healthy(s->endpoint(), std::chrono::seconds(5))) {
                throw std::runtime_error(source + " " + s->endpoint() +
                                         " does not answer GET /health");
            }
            return s;
        }
        return std::make_unique<EtcdServer>();
    }();
    return *server;
}

std::string EtcdServer::unique_prefix() {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    return "/sandboxd-test/" + std::to_string(::getpid()) + "-" +
           std::to_string(prefix_counter.fetch_add(1)) + "-" + std::to_string(ms) + "/";
}

void EtcdServer::require_private(const char* what) const {
    if (external_) {
        throw std::logic_error(std::string("EtcdServer::") + what +
                               ": not allowed on an external server (SANDBOXD_ETCD_ENDPOINT, "
                               "ctest's fixture)");
    }
}

void EtcdServer::start() {
    require_private("start");
    if (pid_ > 0) return;
    const std::string bin = etcd_binary();
    const std::string client_url = endpoint_;
    const std::string peer_url = "http://127.0.0.1:" + std::to_string(peer_port_);
    // clang-format off
    std::vector<std::string> args = {bin,
                                     "--name", "t",
                                     "--data-dir", (dir_ / "data").string(),
                                     "--listen-client-urls", client_url,
                                     "--advertise-client-urls", client_url,
                                     "--listen-peer-urls", peer_url,
                                     "--initial-advertise-peer-urls", peer_url,
                                     "--initial-cluster", "t=" + peer_url};
    // clang-format on
    if (tls_) {
        for (const auto& a :
             {std::string("--cert-file"), tls_->cert_file.string(), std::string("--key-file"),
              tls_->key_file.string(), std::string("--trusted-ca-file"), tls_->ca_file.string(),
              std::string("--client-cert-auth")}) {
            args.push_back(a);
        }
    }
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log_path = (dir_ / "etcd.log").string();

    const auto began = std::chrono::steady_clock::now();
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid_ == 0) {
        // Never outlive the test process, whatever happens to it.
        ::prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (::getppid() != parent) ::_exit(125);
        int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (fd >= 0) {
            ::dup2(fd, 1);
            ::dup2(fd, 2);
        }
#if !defined(__x86_64__)
        utsname u{};
        if (::uname(&u) == 0) {
            std::string arch = u.machine;
            if (arch == "aarch64") arch = "arm64";
            ::setenv("ETCD_UNSUPPORTED_ARCH", arch.c_str(), 1);
        }
#endif
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    paused_ = false;
    const auto deadline = began + std::chrono::seconds(30);
    while (!healthy(std::chrono::milliseconds(500))) {
        int status = 0;
        if (::waitpid(pid_, &status, WNOHANG) == pid_) {
            pid_ = -1;
            throw std::runtime_error("etcd exited during start:\n" + log());
        }
        if (std::chrono::steady_clock::now() >= deadline) {
            stop();
            throw std::runtime_error("etcd did not become healthy in 30 s:\n" + log());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    last_start_ = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - began);
}

void EtcdServer::stop() {
    require_private("stop");
    if (pid_ <= 0) return;
    if (paused_) resume();
    ::kill(pid_, SIGTERM);
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (::waitpid(pid_, &status, WNOHANG) != pid_) {
        if (std::chrono::steady_clock::now() >= deadline) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, &status, 0);
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
}

void EtcdServer::pause() {
    require_private("pause");
    if (pid_ <= 0 || paused_) return;
    ::kill(pid_, SIGSTOP);
    paused_ = true;
    // kill() returns once the signal is queued; a thread of etcd running on the other core
    // can still answer a request until it is stopped too. Paused means every thread stopped.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!all_threads_stopped(pid_)) {
        if (std::chrono::steady_clock::now() > deadline) {
            throw std::runtime_error("etcd (pid " + std::to_string(pid_) +
                                     ") did not stop within 10 s");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

void EtcdServer::resume() {
    require_private("resume");
    if (pid_ <= 0 || !paused_) return;
    ::kill(pid_, SIGCONT);
    paused_ = false;
}

std::string EtcdServer::log() const {
    if (external_) return {};
    std::ifstream in(dir_ / "etcd.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

}  // namespace sandboxd::test
