// TLS on the listener and between nodes (docs/protocol.md sections 1, 6 and 7), against real
// daemons on 127.0.0.1:0 with certificates that the `openssl` command makes for each test
// (tests/support/pki.hpp): wss:// verified against the test CA, plainListen beside it, peer
// links over mutual TLS, certificate problems at start, and a SIGHUP that rotates the
// certificate and revokes a token while a stream runs.
#include "support/clusters.hpp"
#include "support/daemon_fixture.hpp"
#include "support/pki.hpp"

#include <sandboxd/client/client_impl.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/tls.hpp>

#include <catch2/catch.hpp>

#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using namespace sandboxd;
using namespace sandboxd::test;
using json = nlohmann::json;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string host_token = "host-secret";
const std::string peer_token = "peer-secret";

json token_entry(const std::string& name, const std::string& secret,
                 const std::string& role = "host") {
    return json{{"name", name}, {"token", secret}, {"role", role}, {"tenants", json::array({"*"})}};
}

/// A node serving TLS on `listen` with `cert` and `key`, one host token.
json tls_config(const fs::path& cert, const fs::path& key) {
    return json{{"listen", "127.0.0.1:0"},
                {"tls", {{"certFile", cert.string()}, {"keyFile", key.string()}}},
                {"auth", {{"tokens", json::array({token_entry("host", host_token)})}}}};
}

std::string wss_url(const DaemonProcess& node) { return "wss://" + node.address() + "/v1/ws"; }

/// Line `index` (0: listen, 1: plainListen) of the node's --ready-file. DaemonProcess writes
/// it beside its state directory (<its temp dir>/ready, daemon_fixture.cpp) and reads only
/// the first line.
std::string ready_line(const DaemonProcess& node, int index) {
    std::ifstream in(node.state_dir().parent_path() / "ready");
    std::string line;
    for (int i = 0; i <= index; ++i) {
        if (!std::getline(in, line)) return {};
    }
    return line;
}

ClientTls trusting(const fs::path& ca) {
    ClientTls t;
    t.ca_file = ca.string();
    return t;
}

ClientTls presenting(const fs::path& ca, const fs::path& cert, const fs::path& key) {
    ClientTls t = trusting(ca);
    t.cert_file = cert.string();
    t.key_file = key.string();
    return t;
}

ClientTls insecure() {
    ClientTls t;
    t.insecure_skip_verify = true;
    return t;
}

/// How a connection attempt ended: connected, or the client_error's HTTP status (0 when the
/// upgrade was never answered) and message.
struct Attempt {
    bool connected = false;
    int http_status = 0;
    std::string what;
};

Attempt try_connect(const std::string& url, const std::string& token, const ClientTls& tls,
                    const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    Attempt a;
    try {
        Client c(url, token, 10s, 0, headers, tls);
        a.connected = true;
    } catch (const client_error& e) {
        a.http_status = e.http_status();
        a.what = e.what();
    }
    return a;
}

bool contains(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
}

std::size_t occurrences(const std::string& text, const std::string& part) {
    std::size_t n = 0;
    for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size()))
        ++n;
    return n;
}

std::string without_leading_zeros(std::string hex) {
    const auto first = hex.find_first_not_of('0');
    return first == std::string::npos ? "0" : hex.substr(first);
}

/// The serial number (upper-case hex, no leading zeros) of the certificate the node presented
/// to `c`'s TLS handshake.
std::string served_serial(Client& c) {
    auto* tls = c.impl().ws.next_layer().tls();
    if (tls == nullptr) return "(not a TLS connection)";
    X509* cert = SSL_get1_peer_certificate(tls->native_handle());
    if (cert == nullptr) return "(no certificate)";
    BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get0_serialNumber(cert), nullptr);
    X509_free(cert);
    if (bn == nullptr) return "(no serial)";
    char* hex = BN_bn2hex(bn);
    BN_free(bn);
    if (hex == nullptr) return "(no serial)";
    std::string out(hex);
    OPENSSL_free(hex);
    return without_leading_zeros(out);
}

/// Whether the node presented to `c` exactly the (first) certificate of the PEM file `pem`.
bool serves_certificate(Client& c, const fs::path& pem) {
    auto* tls = c.impl().ws.next_layer().tls();
    if (tls == nullptr) return false;
    X509* served = SSL_get1_peer_certificate(tls->native_handle());
    X509* expected = nullptr;
    if (std::FILE* f = std::fopen(pem.c_str(), "rb")) {
        expected = PEM_read_X509(f, nullptr, nullptr, nullptr);
        std::fclose(f);
    }
    const bool same = served != nullptr && expected != nullptr && X509_cmp(served, expected) == 0;
    X509_free(served);
    X509_free(expected);
    return same;
}

/// HTTPS GET on `address` (HOST:PORT), the server verified against `ca` and its name.
std::pair<int, std::string> https_get(const std::string& address, const std::string& target,
                                      const fs::path& ca) {
    net::io_context ioc;
    TlsClientOptions options;
    options.ca_file = ca.string();
    auto context = make_client_tls(options, "test");
    beast::ssl_stream<beast::tcp_stream> stream(ioc, *context);
    const auto colon = address.rfind(':');
    const std::string host = address.substr(0, colon);
    expect_server_name(stream.native_handle(), host, true);
    tcp::resolver resolver(ioc);
    beast::get_lowest_layer(stream).connect(resolver.resolve(host, address.substr(colon + 1)));
    stream.handshake(ssl::stream_base::client);
    http::request<http::empty_body> req{http::verb::get, target, 11};
    req.set(http::field::host, address);
    req.keep_alive(false);
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    return {static_cast<int>(res.result_int()), res.body()};
}

/// Reads one channel's output, crediting it as it comes, until its exit.
class ChannelReader {
public:
    ChannelReader(Client& client, std::uint32_t channel) : client_(client), channel_(channel) {}
    /// Handles the next message of the connection.
    void step() {
        auto ev = client_.next_event();
        if (ev.type == ClientEvent::kind::data && ev.channel == channel_) {
            (ev.stream == stream_id::stderr_ ? err : out) += ev.bytes;
            client_.send_credit(channel_, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::notification &&
                   ev.message.value("method", "") == "duplexChannel.exit" &&
                   ev.message["params"].value("channel", 0U) == channel_) {
            exit = ev.message["params"];
        }
    }
    std::string out, err;
    json exit;

private:
    Client& client_;
    std::uint32_t channel_;
};

/// Waits (at most `limit`) for the node to close `c`'s connection; the close code it sent
/// (0 when none came: a timeout, or a drop without a close frame) and the client's message.
std::pair<int, std::string> wait_for_close(Client& c, std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        try {
            c.poll_event(std::max(left, std::chrono::milliseconds(1)));  // anything else: ignored
        } catch (const client_error& e) {
            return {static_cast<int>(c.impl().ws.reason().code), e.what()};
        }
    }
}

/// `sandboxd --check-config --config <config>`: exit status, stdout, stderr.
struct CheckRun {
    int status = -1;
    std::string out, err;
};

CheckRun check_config(const fs::path& config, const fs::path& scratch) {
    const auto out = scratch / "check.out";
    const auto err = scratch / "check.err";
    const std::string command = TestPki::quote(SANDBOXD_BIN) + " --check-config --config " +
                                TestPki::quote(config) + " >" + TestPki::quote(out) + " 2>" +
                                TestPki::quote(err);
    const int status = std::system(command.c_str());
    CheckRun run;
    run.status = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.out = read_file(out);
    run.err = read_file(err);
    return run;
}

}  // namespace

TEST_CASE(
    "A host reaches a TLS node over wss:// with the CA, and is refused without it or in plain text",
    "[tls]") {
    TestPki pki;
    json config = tls_config(pki.server_cert, pki.server_key);
    config["plainListen"] = "127.0.0.1:0";
    DaemonProcess node("node-1", config.dump());
    const std::string url = wss_url(node);

    // Verified against the test CA: the whole protocol works.
    {
        Client c(url, host_token, 30s, 0, {}, trusting(pki.ca_cert));
        CHECK(c.call("nodeList", json::object())["nodes"].size() == 1);
        auto lease = acquire_lease(c);
        auto run = c.run_channel(open_params(lease, {"echo", "hi"}));
        CHECK(run.out == "hi\n");
        CHECK(run.exit["exitCode"] == 0);
        CHECK(served_serial(c) == without_leading_zeros(pki.serial(pki.server_cert)));
    }
    // The system's trust store does not know the test CA: the client's handshake fails.
    {
        const auto a = try_connect(url, host_token, ClientTls{});
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 0);
        CHECK(contains(a.what, "TLS handshake"));
    }
    // Plain text to the TLS port: the node's handshake fails and it drops the connection.
    {
        const auto handshakes_failed = occurrences(node.log(), "TLS handshake failed");
        const auto a = try_connect("ws://" + node.address() + "/v1/ws", host_token, ClientTls{});
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 0);
        CHECK(eventually(
            [&] { return occurrences(node.log(), "TLS handshake failed") > handshakes_failed; },
            5s));
        CHECK_THROWS(http_get(node.address(), "/healthz"));
    }
    // Without verification (sandboxctl --insecure-skip-tls-verify): accepted.
    {
        Client c(url, host_token, 30s, 0, {}, insecure());
        CHECK(c.call("nodeList", json::object())["nodes"].size() == 1);
    }
    // HTTPS on the TLS port.
    {
        const auto [status, body] = https_get(node.address(), "/healthz", pki.ca_cert);
        CHECK(status == 200);
        CHECK(body == "ok\n");
        CHECK(https_get(node.address(), "/readyz", pki.ca_cert).first == 200);
    }
    // plainListen: the ready file's second line; plain HTTP and ws:// there, not TLS.
    {
        CHECK(ready_line(node, 0) == node.address());
        const std::string plain = ready_line(node, 1);
        REQUIRE_FALSE(plain.empty());
        CHECK(plain.rfind("127.0.0.1:", 0) == 0);
        CHECK(plain != node.address());
        const auto [status, body] = http_get(plain, "/readyz");
        INFO(body);
        CHECK(status == 200);
        CHECK(body.rfind("ready\n", 0) == 0);
        Client c("ws://" + plain + "/v1/ws", host_token);
        CHECK(c.call("nodeList", json::object())["nodes"].size() == 1);
        const auto a = try_connect("wss://" + plain + "/v1/ws", host_token, trusting(pki.ca_cert));
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(contains(a.what, "TLS handshake"));
    }
    // A certificate of the right CA that does not name 127.0.0.1: refused, though the node
    // serves (it is accepted without verification).
    {
        DaemonProcess wrong("node-wrong-name",
                            tls_config(pki.wrong_name_cert, pki.wrong_name_key).dump());
        const auto a = try_connect(wss_url(wrong), host_token, trusting(pki.ca_cert));
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 0);
        CHECK(contains(a.what, "TLS handshake"));
        CHECK(try_connect(wss_url(wrong), host_token, insecure()).connected);
    }
}

TEST_CASE(
    "Two nodes on peer mTLS route an open, and a node without a valid client certificate is "
    "refused "
    "as a peer",
    "[tls][multinode]") {
    TestPki pki;
    SqliteCluster cluster;
    json config = tls_config(pki.server_cert, pki.server_key);
    config["registry"] = cluster.registry();
    config["auth"]["tokens"] =
        json::array({token_entry("host", host_token), token_entry("peer", peer_token, "peer")});
    // Each node presents a certificate that names its node id (and so binds its links to it).
    const auto node_config = [&](const std::string& node) {
        const auto cert = pki.dir / (node + ".crt");
        const auto key = pki.dir / (node + ".key");
        pki.issue_node_certificate(cert, key, node);
        json c = config;
        c["routing"] = {{"mode", "proxy"},
                        {"nodeTtlMs", 3000},
                        {"heartbeatMs", 300},
                        {"peerTls",
                         {{"caFile", pki.ca_cert.string()},
                          {"certFile", cert.string()},
                          {"keyFile", key.string()}}}};
        return c.dump();
    };
    DaemonProcess p1("node-1", node_config("node-1"));
    DaemonProcess p2("node-2", node_config("node-2"));
    Client c1(wss_url(p1), host_token, 30s, 0, {}, trusting(pki.ca_cert));
    Client c2(wss_url(p2), host_token, 30s, 0, {}, trusting(pki.ca_cert));
    auto lease = acquire_lease(c1);
    CHECK(lease["ownerNodeId"] == "node-1");

    // Node 2 forwards to node 1 over wss://, presenting its certificate to the cluster CA.
    auto run = c2.run_channel(open_params(lease, {"sh", "-c", "echo routed; exit 3"}));
    CHECK(run.open_result["routed"] == true);
    CHECK(run.open_result["ownerNodeId"] == "node-1");
    CHECK(run.out == "routed\n");
    CHECK(run.exit["exitCode"] == 3);
    CHECK(run.exit["outcome"] == "exited");
    CHECK_FALSE(contains(p1.log(), "rejected an upgrade: peer token"));

    // The peer token without a client certificate: the upgrade is refused.
    {
        const auto a = try_connect(wss_url(p1), peer_token, trusting(pki.ca_cert));
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 403);
        CHECK(eventually(
            [&] { return contains(p1.log(), "rejected an upgrade: peer token \"peer\""); }, 5s));
    }
    // A client certificate of another CA: the node asks for one and verifies it; its
    // handshake fails. With TLS 1.3 the client has finished its side of the handshake by then
    // and learns of the failure from the node's alert (or a reset) while it waits for the
    // upgrade's answer: no HTTP status either way.
    {
        const auto handshakes_failed = occurrences(p1.log(), "TLS handshake failed");
        const auto a =
            try_connect(wss_url(p1), peer_token,
                        presenting(pki.ca_cert, pki.other_client_cert, pki.other_client_key));
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 0);
        CHECK(eventually(
            [&] { return occurrences(p1.log(), "TLS handshake failed") > handshakes_failed; }, 5s));
    }
    // A client certificate of the cluster CA: accepted as a peer.
    {
        const auto a = try_connect(wss_url(p1), peer_token,
                                   presenting(pki.ca_cert, pki.client_cert, pki.client_key));
        INFO(a.what);
        CHECK(a.connected);
    }
    // node-2's certificate binds its links to node-2 (issue 44, item 4): a link that says it
    // comes from another node is refused before anything runs.
    {
        const auto as_node_2 =
            presenting(pki.ca_cert, pki.dir / "node-2.crt", pki.dir / "node-2.key");
        const auto a =
            try_connect(wss_url(p1), peer_token, as_node_2, {{"Sandboxd-Forwarded-By", "node-3"}});
        INFO(a.what);
        CHECK_FALSE(a.connected);
        CHECK(a.http_status == 403);
        CHECK(eventually([&] { return contains(p1.log(), "client certificate names DNS"); }, 5s));
        CHECK(try_connect(wss_url(p1), peer_token, as_node_2, {{"Sandboxd-Forwarded-By", "node-2"}})
                  .connected);
    }
    // The host token needs no client certificate.
    CHECK(try_connect(wss_url(p1), host_token, trusting(pki.ca_cert)).connected);
    CHECK(p2.stop() == 0);
    CHECK(p1.stop() == 0);
}

TEST_CASE(
    "A certificate that is missing, expired, mismatched or unreadable stops the start with an "
    "error "
    "naming the file",
    "[tls][config]") {
    TestPki pki;
    TempDir files;
    const fs::path missing = files.path() / "missing.crt";
    const fs::path garbage_cert = files.path() / "garbage.crt";
    const fs::path garbage_key = files.path() / "garbage.key";
    write_file(garbage_cert, "not a certificate\n");
    write_file(garbage_key, "not a key\n");
    const std::string server_cert = pki.server_cert.string();
    const std::string server_key = pki.server_key.string();

    struct Case {
        std::string name;
        json config;
        std::string field;    ///< the config field the log names ("config: <field>: ...")
        std::string path;     ///< the file it names
        std::string message;  ///< the whole message, when it is fixed ("": field and path only)
    };
    std::vector<Case> cases;
    cases.push_back(
        {"missing certificate", tls_config(missing, pki.server_key), "tls.certFile",
         missing.string(),
         "config: tls.certFile: cannot read " + missing.string() + ": No such file or directory"});
    cases.push_back(
        {"expired certificate", tls_config(pki.expired_cert, pki.expired_key), "tls.certFile",
         pki.expired_cert.string(),
         "config: tls.certFile: the certificate in " + pki.expired_cert.string() + " has expired"});
    cases.push_back({"key of another certificate", tls_config(pki.server_cert, pki.mismatched_key),
                     "tls.keyFile", pki.mismatched_key.string(),
                     "config: tls.keyFile: the key in " + pki.mismatched_key.string() +
                         " does not match the certificate in " + server_cert});
    cases.push_back(
        {"certificate file that is not PEM", tls_config(garbage_cert, pki.server_key),
         "tls.certFile", garbage_cert.string(),
         "config: tls.certFile: " + garbage_cert.string() + " holds no PEM certificate"});
    cases.push_back(
        {"key file that is not PEM", tls_config(pki.server_cert, garbage_key), "tls.keyFile",
         garbage_key.string(),
         "config: tls.keyFile: " + garbage_key.string() + " holds no usable PEM private key"});
    {
        // Unreadable as a file whoever the test runs as (root reads a file of mode 0000).
        const fs::path directory = files.path() / "directory.key";
        fs::create_directory(directory);
        cases.push_back({"key path that is a directory", tls_config(pki.server_cert, directory),
                         "tls.keyFile", directory.string(), ""});
    }
    if (::geteuid() != 0) {
        const fs::path locked = files.path() / "locked.key";
        fs::copy_file(pki.server_key, locked);
        fs::permissions(locked, fs::perms::none);
        cases.push_back(
            {"key file nobody may read", tls_config(pki.server_cert, locked), "tls.keyFile",
             locked.string(),
             "config: tls.keyFile: cannot read " + locked.string() + ": Permission denied"});
    }
    {
        json c = tls_config(pki.server_cert, pki.server_key);
        c["tls"]["clientCaFile"] = missing.string();
        cases.push_back({"missing client CA", c, "tls.clientCaFile", missing.string(),
                         "config: tls.clientCaFile: cannot read " + missing.string() +
                             ": No such file or directory"});
    }
    const auto with_peer_tls = [&](const std::string& ca, const std::string& cert,
                                   const std::string& key) {
        json c = tls_config(pki.server_cert, pki.server_key);
        c["routing"] = {{"peerTls", {{"caFile", ca}, {"certFile", cert}, {"keyFile", key}}}};
        return c;
    };
    cases.push_back({"missing peer certificate",
                     with_peer_tls(pki.ca_cert.string(), missing.string(), server_key),
                     "routing.peerTls.certFile", missing.string(),
                     "config: routing.peerTls.certFile: cannot read " + missing.string() +
                         ": No such file or directory"});
    cases.push_back({"missing cluster CA", with_peer_tls(missing.string(), server_cert, server_key),
                     "routing.peerTls.caFile", missing.string(),
                     "config: routing.peerTls.caFile: cannot read " + missing.string() +
                         ": No such file or directory"});
    cases.push_back(
        {"expired peer certificate",
         with_peer_tls(pki.ca_cert.string(), pki.expired_cert.string(), pki.expired_key.string()),
         "routing.peerTls.certFile", pki.expired_cert.string(),
         "config: routing.peerTls.certFile: the certificate in " + pki.expired_cert.string() +
             " has expired"});

    for (const auto& k : cases) {
        INFO("case: " << k.name);
        DaemonProcess node("node-1", k.config.dump(), {}, DaemonProcess::start_mode::no_wait);
        const auto status = node.wait_exit(30s);
        const std::string log = node.log();
        INFO(log);
        REQUIRE(status.has_value());
        CHECK(*status == 2);
        CHECK(contains(log, "config: " + k.field + ": "));
        CHECK(contains(log, k.path));
        if (!k.message.empty()) CHECK(contains(log, k.message));
    }
}

TEST_CASE(
    "SIGHUP rotates the certificate and revokes a token without losing a byte of a running stream",
    "[tls][reload]") {
    TestPki pki;
    TempDir files;
    const fs::path live_cert = files.path() / "live.crt";
    const fs::path live_key = files.path() / "live.key";
    fs::copy_file(pki.server_cert, live_cert);
    fs::copy_file(pki.server_key, live_key);
    const fs::path a_file = files.path() / "a.token";
    const std::string token_a = "token-a-first";
    const std::string token_a2 = "token-a-second";
    const std::string token_b = "token-b-kept";
    write_file(a_file, token_a + "\n");
    json config = tls_config(live_cert, live_key);
    config["auth"]["tokens"] = json::array({json{{"name", "a"},
                                                 {"tokenFile", a_file.string()},
                                                 {"role", "host"},
                                                 {"tenants", json::array({"*"})}},
                                            token_entry("b", token_b)});
    DaemonProcess node("node-1", config.dump());
    const std::string url = wss_url(node);
    const auto trust = trusting(pki.ca_cert);
    const std::string old_serial = without_leading_zeros(pki.serial(pki.server_cert));

    Client b(url, token_b, 30s, 0, {}, trust);
    Client a(url, token_a, 30s, 0, {}, trust);
    CHECK(served_serial(b) == old_serial);
    auto lease = acquire_lease(b);

    // About 3.4 MB: more than the output window (1 MiB) and the pipes hold, so the command
    // is still running (blocked on its output) while the first 64 KiB are read.
    constexpr int lines = 500000;
    std::string expected;
    for (int i = 1; i <= lines; ++i) expected += std::to_string(i) + "\n";
    auto params = open_params(lease, {"seq", "1", std::to_string(lines)});
    params["stdin"] = false;
    const auto channel = b.call("duplexChannelOpen", params)["channel"].get<std::uint32_t>();
    ChannelReader stream(b, channel);
    while (stream.out.size() < (64U << 10) && stream.exit.is_null()) stream.step();
    REQUIRE(stream.exit.is_null());

    // A new certificate of the same CA in place of the old one, and a new secret in A's file.
    const fs::path new_cert = files.path() / "new.crt";
    const fs::path new_key = files.path() / "new.key";
    pki.issue_server_certificate(new_cert, new_key);
    const std::string new_serial = without_leading_zeros(pki.serial(new_cert));
    REQUIRE(new_serial != old_serial);
    fs::copy_file(new_cert, live_cert, fs::copy_options::overwrite_existing);
    fs::copy_file(new_key, live_key, fs::copy_options::overwrite_existing);
    write_file(a_file, token_a2 + "\n");

    const auto hup = std::chrono::steady_clock::now();
    REQUIRE(::kill(node.pid(), SIGHUP) == 0);
    // A's connection, idle, is closed with 1008 at once.
    const auto [code, what] = wait_for_close(a, 5s);
    const auto closed_after = std::chrono::steady_clock::now() - hup;
    INFO("A's connection: "
         << what << " after "
         << std::chrono::duration_cast<std::chrono::milliseconds>(closed_after).count() << " ms");
    CHECK(code == 1008);
    CHECK(closed_after < 1s);

    // B's stream, over a connection made before the rotation, loses nothing.
    while (stream.exit.is_null()) stream.step();
    CHECK(stream.out.size() == expected.size());
    CHECK((stream.out == expected));
    CHECK(stream.err.empty());
    CHECK(stream.exit["exitCode"] == 0);
    CHECK(stream.exit["outcome"] == "exited");
    CHECK(b.call("nodeList", json::object())["nodes"].size() == 1);
    CHECK(eventually([&] { return contains(node.log(), "reloaded:"); }, 5s));

    // The old secret is refused; the new one is accepted, and new connections get the new
    // certificate.
    {
        const auto refused = try_connect(url, token_a, trust);
        INFO(refused.what);
        CHECK_FALSE(refused.connected);
        CHECK(refused.http_status == 401);
    }
    Client a2(url, token_a2, 30s, 0, {}, trust);
    CHECK(a2.call("nodeList", json::object())["nodes"].size() == 1);
    CHECK(served_serial(a2) == new_serial);
    CHECK(serves_certificate(a2, new_cert));

    // A reload with a broken key fails and keeps what is in use.
    const auto failed_before = occurrences(node.log(), "reload failed");
    write_file(live_key, "not a key any more\n");
    REQUIRE(::kill(node.pid(), SIGHUP) == 0);
    REQUIRE(
        eventually([&] { return occurrences(node.log(), "reload failed") > failed_before; }, 10s));
    CHECK(contains(node.log(), "tls.keyFile"));
    CHECK(node.alive());
    {
        Client after(url, token_a2, 30s, 0, {}, trust);
        CHECK(after.call("nodeList", json::object())["nodes"].size() == 1);
        CHECK(served_serial(after) == new_serial);
        CHECK(serves_certificate(after, new_cert));
        CHECK(try_connect(url, token_a, trust).http_status == 401);
    }
    CHECK(a2.call("nodeList", json::object())["nodes"].size() == 1);
    CHECK(b.call("nodeList", json::object())["nodes"].size() == 1);
}

TEST_CASE(
    "plainListen must be loopback, and --check-config warns about secret files others can read",
    "[tls][config]") {
    TestPki pki;
    TempDir files;
    const fs::path config_file = files.path() / "config.json";

    // plainListen beyond loopback: refused.
    {
        json config = tls_config(pki.server_cert, pki.server_key);
        config["plainListen"] = "0.0.0.0:0";
        write_file(config_file, config.dump());
        const auto run = check_config(config_file, files.path());
        INFO(run.err);
        CHECK(run.status == 2);
        CHECK(contains(run.err, "plainListen"));
        CHECK(contains(run.err, "loopback"));
    }
    // On loopback: accepted.
    {
        json config = tls_config(pki.server_cert, pki.server_key);
        config["plainListen"] = "127.0.0.1:0";
        write_file(config_file, config.dump());
        const auto run = check_config(config_file, files.path());
        INFO(run.err);
        CHECK(run.status == 0);
    }
    // A token file others can read: a warning naming it; mode 0600: none.
    const fs::path token_file = files.path() / "host.token";
    write_file(token_file, "a-secret\n");
    const json token = {{"name", "host"},
                        {"tokenFile", token_file.string()},
                        {"role", "host"},
                        {"tenants", json::array({"*"})}};
    json config = json::object();
    config["auth"]["tokens"] = json::array({token});
    write_file(config_file, config.dump());
    {
        fs::permissions(token_file, fs::perms::owner_read | fs::perms::owner_write |
                                        fs::perms::group_read | fs::perms::others_read);
        const auto run = check_config(config_file, files.path());
        INFO(run.err);
        CHECK(run.status == 0);
        CHECK(contains(run.err, "warning"));
        CHECK(contains(run.err, token_file.string()));
        CHECK(contains(run.err, "auth.tokens[0].tokenFile"));
    }
    {
        fs::permissions(token_file, fs::perms::owner_read | fs::perms::owner_write);
        const auto run = check_config(config_file, files.path());
        INFO(run.err);
        CHECK(run.status == 0);
        CHECK_FALSE(contains(run.err, "warning"));
    }
}

TEST_CASE("GET /metrics takes a metrics or peer token, and metrics.public opens plainListen alone",
          "[tls][metrics][auth]") {
    // issue 44, item 7.
    TestPki pki;
    json config = tls_config(pki.server_cert, pki.server_key);
    config["plainListen"] = "127.0.0.1:0";
    config["auth"]["tokens"] =
        json::array({token_entry("host", host_token), token_entry("peer", peer_token, "peer"),
                     token_entry("scraper", "scrape-secret", "metrics")});
    SECTION("by default: a token of role metrics or peer, on every listener") {
        DaemonProcess node("node-1", config.dump());
        const std::string plain = ready_line(node, 1);
        REQUIRE_FALSE(plain.empty());
        const auto [none, none_body] = http_get(plain, "/metrics");
        CHECK(none == 401);
        CHECK(none_body.find("role metrics or peer") != std::string::npos);
        const auto [as_host, host_body] = http_get(plain, "/metrics", "Bearer " + host_token);
        CHECK(as_host == 403);
        CHECK(host_body.find("has role host") != std::string::npos);
        const auto [scraped, text] = http_get(plain, "/metrics", "Bearer scrape-secret");
        CHECK(scraped == 200);
        CHECK(text.find("# TYPE sandboxd_build_info gauge") != std::string::npos);
        CHECK(http_get(plain, "/metrics", "Bearer " + peer_token).first == 200);
        CHECK(https_get(node.address(), "/metrics", pki.ca_cert).first == 401);
        // A metrics token reads /metrics only: no WebSocket session.
        const auto [upgrade, upgrade_body] =
            http_get(plain, "/v1/ws", "Bearer scrape-secret", true);
        CHECK(upgrade == 403);
        CHECK(upgrade_body.find("may only read GET /metrics") != std::string::npos);
        // The other routes keep answering without a token.
        CHECK(http_get(plain, "/healthz").first == 200);
    }
    SECTION("metrics.public: plainListen without a token; listen still asks for one") {
        config["metrics"] = {{"public", true}};
        DaemonProcess node("node-1", config.dump());
        const std::string plain = ready_line(node, 1);
        REQUIRE_FALSE(plain.empty());
        CHECK(http_get(plain, "/metrics").first == 200);
        CHECK(https_get(node.address(), "/metrics", pki.ca_cert).first == 401);
    }
    SECTION("metrics.public without plainListen is refused at start") {
        config.erase("plainListen");
        config["metrics"] = {{"public", true}};
        TempDir files;
        const fs::path config_file = files.path() / "config.json";
        write_file(config_file, config.dump());
        const auto run = check_config(config_file, files.path());
        INFO(run.err);
        CHECK(run.status == 2);
        CHECK(run.err.find("metrics.public") != std::string::npos);
    }
}
