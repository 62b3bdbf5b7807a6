#pragma once
// A real etcd server for the registry tests: a private `etcd` process on free loopback ports
// with a temporary data directory, or the server named by SANDBOXD_ETCD_ENDPOINT, or the one
// that ctest's fixture started (SANDBOXD_ETCD_ENDPOINT_FILE, tests/support/ctest_etcd). Not
// thread-safe; the shared() instance lives until the test process exits.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

namespace sandboxd::test {

/// The files of an etcd that serves its clients over TLS only and requires their
/// certificates (etcd --cert-file --key-file --trusted-ca-file --client-cert-auth). The
/// fixture's own health probe presents cert_file/key_file as its client certificate: it must
/// allow clientAuth.
struct EtcdTls {
    std::filesystem::path cert_file;
    std::filesystem::path key_file;
    std::filesystem::path ca_file;
};

class EtcdServer {
public:
    /// Starts a private etcd (the binary $SANDBOXD_ETCD_BIN, else /usr/bin/etcd) and waits
    /// (at most 30 s) until GET /health answers {"health":"true"}. Throws std::runtime_error
    /// with etcd's log when it does not come up.
    EtcdServer();
    /// The same, serving https:// with client certificate authentication (endpoint() is
    /// "https://127.0.0.1:PORT").
    explicit EtcdServer(EtcdTls tls);
    /// Stops it (SIGTERM, SIGKILL after 10 s) and removes its data directory.
    ~EtcdServer();
    EtcdServer(const EtcdServer&) = delete;
    EtcdServer& operator=(const EtcdServer&) = delete;

    /// The server every contract test shares: SANDBOXD_ETCD_ENDPOINT when set, else the
    /// endpoint= line of the file SANDBOXD_ETCD_ENDPOINT_FILE names when there is one (ctest's
    /// etcd fixture writes it; both are external: never stopped by the tests), else one private
    /// etcd started on first use. Throws std::runtime_error when an external one does not answer
    /// GET /health within 5 s. Tests keep apart by using unique_prefix().
    static EtcdServer& shared();
    /// A key prefix no other test (or test process) uses: "/sandboxd-test/<pid>-<n>-<ms>/".
    static std::string unique_prefix();

    /// "http://127.0.0.1:PORT" (https:// with EtcdTls).
    const std::string& endpoint() const { return endpoint_; }
    /// True for an external server (SANDBOXD_ETCD_ENDPOINT or the ctest fixture's), which
    /// stop()/start()/pause() refuse.
    bool external() const { return external_; }
    /// True while the private process runs (it may be paused).
    bool running() const { return pid_ > 0; }

    /// SIGTERM and wait (SIGKILL after 10 s).
    void stop();
    /// Starts it again on the same data directory and ports; waits for /health.
    void start();
    /// Compacts the store's history up to its current revision (physically) and returns that
    /// revision: a watch asked to start at or before it is then canceled by etcd. Private
    /// plain-http servers only (a shared server's other watchers would see it); throws
    /// std::runtime_error when etcd refuses.
    std::int64_t compact();
    /// SIGSTOP / SIGCONT: a server that accepts connections but never answers.
    void pause();
    void resume();

    /// How long the last start() took until /health answered.
    std::chrono::milliseconds last_start_duration() const { return last_start_; }
    /// etcd's own log (stdout and stderr).
    std::string log() const;

private:
    struct External {};
    EtcdServer(External, std::string endpoint);
    void require_private(const char* what) const;

    bool external_ = false;
    std::filesystem::path dir_;  ///< holds data/ and etcd.log
    std::string endpoint_;
    unsigned short client_port_ = 0;
    unsigned short peer_port_ = 0;
    pid_t pid_ = -1;
    bool paused_ = false;
    std::chrono::milliseconds last_start_{0};
    std::optional<EtcdTls> tls_;
    bool healthy(std::chrono::milliseconds timeout) const;
};

/// True when GET `endpoint`/health answers {"health":"true"} within `timeout`.
bool etcd_healthy(const std::string& endpoint, std::chrono::milliseconds timeout);
/// The same over TLS, verifying etcd with tls.ca_file and presenting tls.cert_file.
bool etcd_healthy_tls(const std::string& endpoint, const EtcdTls& tls,
                      std::chrono::milliseconds timeout);

}  // namespace sandboxd::test
