#include <sandboxd/core/tls.hpp>

#include <sandboxd/core/config.hpp>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace sandboxd {
namespace {

[[noreturn]] void fail(const std::string& field, const std::string& what) {
    throw config_error("config: " + field + ": " + what);
}

std::string openssl_error() {
    const unsigned long e = ERR_get_error();
    ERR_clear_error();
    if (e == 0) return "unknown error";
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    return buf;
}

struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
};
struct X509Free {
    void operator()(X509* x) const { X509_free(x); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

std::unique_ptr<std::FILE, FileCloser> open_file(const std::string& field,
                                                 const std::string& path) {
    if (path.empty()) fail(field, "no file given");
    std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) fail(field, "cannot read " + path + ": " + std::strerror(errno));
    return f;
}

/// Every certificate of a PEM file; at least one, each within its validity period.
std::vector<X509Ptr> read_certificates(const std::string& field, const std::string& path) {
    auto f = open_file(field, path);
    std::vector<X509Ptr> out;
    while (X509* x = PEM_read_X509(f.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
    ERR_clear_error();  // the read that ended the loop
    if (out.empty()) fail(field, path + " holds no PEM certificate");
    for (const auto& x : out) {
        if (X509_cmp_current_time(X509_get0_notAfter(x.get())) <= 0) {
            fail(field, "the certificate in " + path + " has expired");
        }
        if (X509_cmp_current_time(X509_get0_notBefore(x.get())) >= 0) {
            fail(field, "the certificate in " + path + " is not valid yet");
        }
    }
    return out;
}

void set_min_version(ssl::context& ctx, const std::string& field, const std::string& version) {
    int v = 0;
    if (version == "1.2") {
        v = TLS1_2_VERSION;
    } else if (version == "1.3") {
        v = TLS1_3_VERSION;
    } else {
        fail(field + ".minVersion", "must be \"1.2\" or \"1.3\"");
    }
    SSL_CTX_set_min_proto_version(ctx.native_handle(), v);
}

/// The certificate chain and its key; both files checked (readable, PEM, in date, matching).
void use_identity(ssl::context& ctx, const std::string& field, const std::string& cert_file,
                  const std::string& key_file) {
    const auto certs = read_certificates(field + ".certFile", cert_file);
    auto f = open_file(field + ".keyFile", key_file);
    std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
        PEM_read_PrivateKey(f.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
    if (!key)
        fail(field + ".keyFile", key_file + " holds no usable PEM private key: " + openssl_error());
    if (X509_check_private_key(certs.front().get(), key.get()) != 1) {
        ERR_clear_error();
        fail(field + ".keyFile",
             "the key in " + key_file + " does not match the certificate in " + cert_file);
    }
    SSL_CTX* c = ctx.native_handle();
    if (SSL_CTX_use_certificate_chain_file(c, cert_file.c_str()) != 1) {
        fail(field + ".certFile", "cannot use " + cert_file + ": " + openssl_error());
    }
    if (SSL_CTX_use_PrivateKey(c, key.get()) != 1) {
        fail(field + ".keyFile", "cannot use " + key_file + ": " + openssl_error());
    }
}

/// Adds the CAs of `ca_file` to the context's trust store (and, for a server, to the names it
/// sends in its certificate request).
void trust(ssl::context& ctx, const std::string& field, const std::string& ca_file, bool server) {
    auto cas = read_certificates(field, ca_file);
    X509_STORE* store = SSL_CTX_get_cert_store(ctx.native_handle());
    for (const auto& x : cas) {
        if (X509_STORE_add_cert(store, x.get()) != 1) ERR_clear_error();  // a duplicate
        if (server) SSL_CTX_add_client_CA(ctx.native_handle(), x.get());
    }
}

std::shared_ptr<ssl::context> base_context(ssl::context::method method) {
    auto ctx = std::make_shared<ssl::context>(method);
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                     ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                     ssl::context::single_dh_use);
    SSL_CTX_set_options(ctx->native_handle(), SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
    return ctx;
}

}  // namespace

std::shared_ptr<ssl::context> make_server_tls(const TlsServerOptions& o, const std::string& field) {
    auto ctx = base_context(ssl::context::tls_server);
    set_min_version(*ctx, field, o.min_version);
    use_identity(*ctx, field, o.cert_file, o.key_file);
    if (!o.client_ca_file.empty()) trust(*ctx, field + ".clientCaFile", o.client_ca_file, true);
    if (!o.peer_ca_file.empty()) trust(*ctx, "routing.peerTls.caFile", o.peer_ca_file, true);
    if (!o.client_ca_file.empty()) {
        ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
    } else if (!o.peer_ca_file.empty()) {
        ctx->set_verify_mode(ssl::verify_peer);
    } else {
        ctx->set_verify_mode(ssl::verify_none);
    }
    // No session tickets or cache: every connection is verified afresh (a resumed session
    // would carry a client certificate verified under an earlier, possibly revoked, CA).
    SSL_CTX_set_session_cache_mode(ctx->native_handle(), SSL_SESS_CACHE_OFF);
    SSL_CTX_set_options(ctx->native_handle(), SSL_OP_NO_TICKET);
    SSL_CTX_set_num_tickets(ctx->native_handle(), 0);
    return ctx;
}

std::shared_ptr<ssl::context> make_client_tls(const TlsClientOptions& o, const std::string& field) {
    auto ctx = base_context(ssl::context::tls_client);
    set_min_version(*ctx, field, o.min_version);
    if (!o.cert_file.empty() || !o.key_file.empty()) {
        if (o.cert_file.empty()) fail(field + ".certFile", "required with keyFile");
        if (o.key_file.empty()) fail(field + ".keyFile", "required with certFile");
        use_identity(*ctx, field, o.cert_file, o.key_file);
    }
    if (o.insecure_skip_verify) {
        ctx->set_verify_mode(ssl::verify_none);
        return ctx;
    }
    if (o.ca_file.empty()) {
        ctx->set_default_verify_paths();
    } else {
        trust(*ctx, field + ".caFile", o.ca_file, false);
    }
    ctx->set_verify_mode(ssl::verify_peer);
    return ctx;
}

void expect_server_name(SSL* ssl, const std::string& host, bool verify) {
    std::string name = host;
    if (name.size() > 2 && name.front() == '[' && name.back() == ']')
        name = name.substr(1, name.size() - 2);
    boost::system::error_code ec;
    net::ip::make_address(name, ec);
    const bool is_ip = !ec;
    if (!is_ip) SSL_set_tlsext_host_name(ssl, name.c_str());
    if (!verify) return;
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    if (is_ip) {
        X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str());
    } else {
        X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
        X509_VERIFY_PARAM_set1_host(param, name.c_str(), name.size());
    }
}

ClientCertVerifier::ClientCertVerifier(const std::string& ca_file, const std::string& field)
    : store_(X509_STORE_new()) {
    if (!store_) throw std::bad_alloc();
    std::vector<X509Ptr> cas;
    try {
        cas = read_certificates(field, ca_file);
    } catch (...) {
        X509_STORE_free(store_);
        throw;
    }
    for (const auto& x : cas) {
        if (X509_STORE_add_cert(store_, x.get()) != 1) ERR_clear_error();
    }
}

ClientCertVerifier::~ClientCertVerifier() { X509_STORE_free(store_); }

bool ClientCertVerifier::verifies(SSL* ssl) const noexcept {
    X509* leaf = SSL_get0_peer_certificate(ssl);
    if (!leaf) return false;
    // The chain the client sent (on a server, without the leaf).
    STACK_OF(X509)* chain = SSL_get_peer_cert_chain(ssl);
    X509_STORE_CTX* ctx = X509_STORE_CTX_new();
    if (!ctx) return false;
    bool ok = false;
    if (X509_STORE_CTX_init(ctx, store_, leaf, chain) == 1) {
        X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_SSL_CLIENT);
        ok = X509_verify_cert(ctx) == 1;
    }
    X509_STORE_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

std::string peer_certificate_name(SSL* ssl) {
    X509* leaf = SSL_get0_peer_certificate(ssl);
    if (!leaf) return "";
    char buf[256] = {};
    X509_NAME_get_text_by_NID(X509_get_subject_name(leaf), NID_commonName, buf, sizeof buf);
    return buf;
}

std::vector<std::string> peer_certificate_dns_names(SSL* ssl) {
    std::vector<std::string> out;
    X509* leaf = SSL_get0_peer_certificate(ssl);
    if (!leaf) return out;
    auto* names =
        static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(leaf, NID_subject_alt_name, nullptr, nullptr));
    if (!names) return out;
    for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
        const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
        int type = 0;
        const void* value = GENERAL_NAME_get0_value(name, &type);
        if (type != GEN_DNS || value == nullptr) continue;
        const auto* dns = static_cast<const ASN1_IA5STRING*>(value);
        std::string s(reinterpret_cast<const char*>(ASN1_STRING_get0_data(dns)),
                      static_cast<std::size_t>(ASN1_STRING_length(dns)));
        if (s.find('\0') == std::string::npos) out.push_back(std::move(s));
    }
    GENERAL_NAMES_free(names);
    return out;
}

}  // namespace sandboxd
