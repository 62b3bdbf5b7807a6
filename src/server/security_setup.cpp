#include "server/security_setup.hpp"

#include <sandboxd/core/tls.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace sandboxd {

std::string read_secret_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw config_error("config: auth: cannot read token file " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    while (!s.empty() &&
           (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) {
        s.pop_back();
    }
    if (s.empty()) throw config_error("config: auth: token file " + path + " is empty");
    return s;
}

Security build_security(const Config& c, const std::string& admin_token_path) {
    Security s;
    for (const auto& t : c.tokens) {
        const std::string secret = t.token.empty() ? read_secret_file(t.token_file) : t.token;
        Principal p{t.name, t.role, t.tenants};
        p.token_sha256 = token_hash(secret);
        p.node_id = t.node_id;
        p.reads_metrics = t.role == "metrics" || t.role == "peer";
        if (t.role == "peer" && s.peer_token.empty()) s.peer_token = secret;
        s.credentials.push_back({std::move(p)});
    }
    if (s.credentials.empty() && !admin_token_path.empty()) {
        Principal p{"admin", "host", {"*"}};
        p.token_sha256 = token_hash(read_secret_file(admin_token_path));
        // The node's only credential when none is configured: the operator's, who may scrape.
        p.reads_metrics = true;
        s.credentials.push_back({std::move(p)});
    }
    if (c.tls.enabled()) {
        TlsServerOptions o;
        o.cert_file = c.tls.cert_file;
        o.key_file = c.tls.key_file;
        o.client_ca_file = c.tls.client_ca_file;
        o.peer_ca_file = c.peer_tls.ca_file;
        o.min_version = c.tls.min_version;
        s.listener_tls = make_server_tls(o, "tls");
    }
    if (!c.peer_tls.empty()) {
        TlsClientOptions o;
        o.ca_file = c.peer_tls.ca_file;
        o.cert_file = c.peer_tls.cert_file;
        o.key_file = c.peer_tls.key_file;
        s.peer_client_tls = make_client_tls(o, "routing.peerTls");
        s.peer_ca = std::make_shared<const ClientCertVerifier>(c.peer_tls.ca_file,
                                                               "routing.peerTls.caFile");
    }
    const bool https_registry =
        c.registry.kind == "etcd" &&
        std::any_of(c.registry.endpoints.begin(), c.registry.endpoints.end(),
                    [](const std::string& e) { return e.rfind("https://", 0) == 0; });
    if (!c.registry.tls.empty() || https_registry) {
        // Built once here (not per connection): registry.tls, else the system's trust store.
        TlsClientOptions o;
        o.ca_file = c.registry.tls.ca_file;
        o.cert_file = c.registry.tls.cert_file;
        o.key_file = c.registry.tls.key_file;
        s.registry_tls = make_client_tls(o, "registry.tls");
    }
    if (!s.peer_client_tls && c.tls.enabled()) {
        // Peers of a TLS node are reached with wss://: the system's trust store, no client
        // certificate, built once.
        s.peer_client_tls = make_client_tls(TlsClientOptions{}, "routing.peerTls");
    }
    return s;
}

bool same_grant(const Principal& a, const Principal& b) {
    return a.token_sha256 == b.token_sha256 && a.name == b.name && a.role == b.role &&
           a.tenants == b.tenants && a.node_id == b.node_id && a.reads_metrics == b.reads_metrics;
}

}  // namespace sandboxd
