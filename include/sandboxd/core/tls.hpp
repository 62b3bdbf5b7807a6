#pragma once
/// @file tls.hpp
/// TLS for the connections the daemon serves and makes (docs/protocol.md sections 1 and 7):
/// OpenSSL 3 through boost::asio::ssl and Beast's ssl_stream.
///
/// - TlsContext: an ssl::context built from PEM files and checked when built: every file is
///   read, parsed, in its validity period, and the key matches the certificate; otherwise
///   config_error names the config field and the file. TLS 1.2 at the least. Immutable once
///   built; shared (std::shared_ptr) by every connection made with it, so that a reload
///   (SIGHUP) swaps in a new one while old connections keep theirs.
/// - ConnStream: a stream that is plain TCP or TLS over TCP, chosen per connection, with one
///   type for the WebSocket and HTTP code above it.
///
/// Thread-safety: building a context may be called from any thread; a ConnStream follows
/// Asio's rules (one read and one write at a time, on its executor).
#include <sandboxd/core/net.hpp>

#include <boost/asio/ssl.hpp>
#include <boost/beast/ssl.hpp>

#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace sandboxd {

namespace ssl = boost::asio::ssl;

/// What a TLS listener serves (config `tls`): its certificate chain and key, the lowest
/// protocol version ("1.2" or "1.3"), and the CAs whose client certificates it accepts.
struct TlsServerOptions {
    std::string cert_file;  ///< PEM: the server's certificate, then its chain
    std::string key_file;   ///< PEM: the private key of cert_file
    /// PEM CAs; non-empty: every client must present a certificate that one of them verified
    /// (the handshake fails otherwise).
    std::string client_ca_file;
    /// PEM CAs of the cluster (routing.peerTls.caFile); non-empty: a client certificate is
    /// asked for (not required) and, when presented, must verify against it or client_ca_file.
    std::string peer_ca_file;
    std::string min_version = "1.2";
};

/// How a client connection verifies its server and presents itself.
struct TlsClientOptions {
    std::string ca_file;    ///< PEM CAs to verify the server with; "" = the system's trust store
    std::string cert_file;  ///< PEM client certificate (mutual TLS); "" = none
    std::string key_file;   ///< its key; required with cert_file
    /// No verification of the server's certificate or name at all (sandboxctl
    /// --insecure-skip-tls-verify; the caller warns).
    bool insecure_skip_verify = false;
    std::string min_version = "1.2";
};

/// Builds a server context. Throws config_error "config: <field>: ..." naming the file that
/// is missing, unreadable, not a PEM certificate or key, expired or not yet valid, or whose
/// key does not match the certificate; or an unknown min_version.
std::shared_ptr<ssl::context> make_server_tls(const TlsServerOptions& options,
                                              const std::string& field);
/// Builds a client context; same errors as make_server_tls (the client certificate is
/// checked as the server's is).
std::shared_ptr<ssl::context> make_client_tls(const TlsClientOptions& options,
                                              const std::string& field);

/// Sets the name (DNS name or IP address literal) that the server's certificate must carry,
/// and the SNI, on a client stream before its handshake. No-op for names when the context
/// skips verification (the SNI is still sent for a DNS name).
void expect_server_name(SSL* ssl, const std::string& host, bool verify);

/// Whether the certificate the peer of `ssl` presented (after a handshake) chains to a CA of
/// `ca_file` for client use. Loads the file once; immutable afterwards; thread-safe.
class ClientCertVerifier {
public:
    /// Throws config_error naming `field` when the file cannot be read or holds no CA.
    ClientCertVerifier(const std::string& ca_file, const std::string& field);
    ~ClientCertVerifier();
    ClientCertVerifier(const ClientCertVerifier&) = delete;
    ClientCertVerifier& operator=(const ClientCertVerifier&) = delete;
    /// False when no certificate was presented or it does not verify. Never throws.
    bool verifies(SSL* ssl) const noexcept;

private:
    X509_STORE* store_ = nullptr;
};

/// The certificate's subject common name of the peer of `ssl`, "" without one (for logs).
std::string peer_certificate_name(SSL* ssl);

/// The DNS names in the subjectAltName of the certificate the peer of `ssl` presented, in
/// its order; empty without a certificate or without DNS names. Never throws for the
/// certificate's content (a name with a NUL byte is skipped).
std::vector<std::string> peer_certificate_dns_names(SSL* ssl);

/// A connection that is plain TCP or TLS over TCP. next_layer() is the TCP stream in both
/// cases (Beast's get_lowest_layer reaches it: timeouts and socket options go there).
class ConnStream {
public:
    using executor_type = net::any_io_executor;
    using tls_stream = beast::ssl_stream<beast::tcp_stream>;

    /// Plain TCP.
    explicit ConnStream(beast::tcp_stream plain) : stream_(std::move(plain)) {}
    /// TLS over `plain` with `context` (kept alive by the stream); the handshake is the
    /// caller's (tls()->async_handshake).
    ConnStream(beast::tcp_stream plain, std::shared_ptr<ssl::context> context)
        : context_(std::move(context)),
          stream_(std::in_place_type<tls_stream>, std::move(plain), *context_) {}

    [[nodiscard]] bool is_tls() const noexcept {
        return std::holds_alternative<tls_stream>(stream_);
    }
    /// The TLS layer, nullptr for plain TCP.
    tls_stream* tls() noexcept { return std::get_if<tls_stream>(&stream_); }

    beast::tcp_stream& next_layer() noexcept {
        if (auto* t = tls()) return t->next_layer();
        return std::get<beast::tcp_stream>(stream_);
    }
    executor_type get_executor() noexcept { return next_layer().get_executor(); }

    template <typename MutableBufferSequence, typename ReadHandler>
    auto async_read_some(const MutableBufferSequence& buffers, ReadHandler&& handler) {
        return net::async_initiate<ReadHandler, void(beast::error_code, std::size_t)>(
            [this](auto h, const MutableBufferSequence& b) {
                if (auto* t = tls()) {
                    t->async_read_some(b, std::move(h));
                } else {
                    std::get<beast::tcp_stream>(stream_).async_read_some(b, std::move(h));
                }
            },
            handler, buffers);
    }

    template <typename ConstBufferSequence, typename WriteHandler>
    auto async_write_some(const ConstBufferSequence& buffers, WriteHandler&& handler) {
        return net::async_initiate<WriteHandler, void(beast::error_code, std::size_t)>(
            [this](auto h, const ConstBufferSequence& b) {
                if (auto* t = tls()) {
                    t->async_write_some(b, std::move(h));
                } else {
                    std::get<beast::tcp_stream>(stream_).async_write_some(b, std::move(h));
                }
            },
            handler, buffers);
    }

    // Blocking forms (Beast's SyncStream), for blocking clients (benchmarks, tools).
    template <typename MutableBufferSequence>
    std::size_t read_some(const MutableBufferSequence& buffers, beast::error_code& ec) {
        if (auto* t = tls()) return t->read_some(buffers, ec);
        return std::get<beast::tcp_stream>(stream_).socket().read_some(buffers, ec);
    }
    template <typename MutableBufferSequence>
    std::size_t read_some(const MutableBufferSequence& buffers) {
        beast::error_code ec;
        const auto n = read_some(buffers, ec);
        if (ec) throw boost::system::system_error(ec);
        return n;
    }
    template <typename ConstBufferSequence>
    std::size_t write_some(const ConstBufferSequence& buffers, beast::error_code& ec) {
        if (auto* t = tls()) return t->write_some(buffers, ec);
        return std::get<beast::tcp_stream>(stream_).socket().write_some(buffers, ec);
    }
    template <typename ConstBufferSequence>
    std::size_t write_some(const ConstBufferSequence& buffers) {
        beast::error_code ec;
        const auto n = write_some(buffers, ec);
        if (ec) throw boost::system::system_error(ec);
        return n;
    }

private:
    std::shared_ptr<ssl::context> context_;
    std::variant<beast::tcp_stream, tls_stream> stream_;
};

/// Beast's WebSocket closing handshake: TLS close_notify then TCP shutdown, or TCP shutdown.
template <typename TeardownHandler>
void async_teardown(beast::role_type role, ConnStream& stream, TeardownHandler&& handler) {
    using beast::websocket::async_teardown;
    if (auto* t = stream.tls()) {
        async_teardown(role, *t, std::forward<TeardownHandler>(handler));
    } else {
        async_teardown(role, stream.next_layer().socket(), std::forward<TeardownHandler>(handler));
    }
}

inline void teardown(beast::role_type role, ConnStream& stream, beast::error_code& ec) {
    using beast::websocket::teardown;
    if (auto* t = stream.tls()) {
        teardown(role, *t, ec);
    } else {
        teardown(role, stream.next_layer().socket(), ec);
    }
}

}  // namespace sandboxd
