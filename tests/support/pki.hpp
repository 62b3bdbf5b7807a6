#pragma once
// Certificates for the TLS tests, made with the `openssl` command (EC P-256 keys) in a
// temporary directory of their own, removed with everything in it on destruction. Not
// thread-safe; one per test.
#include <filesystem>
#include <string>

namespace sandboxd::test {

/// The whole file ("" when it cannot be read).
std::string read_file(const std::filesystem::path& path);
/// Replaces the file's contents with `text`; std::runtime_error when it cannot.
void write_file(const std::filesystem::path& path, const std::string& text);

class TestPki {
public:
    /// Makes every file below. Throws std::runtime_error naming the openssl command (and its
    /// output) that failed.
    TestPki();
    ~TestPki();
    TestPki(const TestPki&) = delete;
    TestPki& operator=(const TestPki&) = delete;

    std::filesystem::path dir;  ///< the directory holding them all

    std::filesystem::path ca_cert, ca_key;              ///< the cluster's CA (self-signed)
    std::filesystem::path other_ca_cert, other_ca_key;  ///< an unrelated CA
    /// Signed by the CA: SAN IP:127.0.0.1 and DNS:localhost, extendedKeyUsage serverAuth and
    /// clientAuth (a node presents it to its clients and, as routing.peerTls.certFile, to
    /// its peers).
    std::filesystem::path server_cert, server_key;
    /// Signed by the CA, clientAuth only (a client's mutual TLS certificate).
    std::filesystem::path client_cert, client_key;
    /// Signed by the other CA, clientAuth.
    std::filesystem::path other_client_cert, other_client_key;
    /// Signed by the CA like server_cert, valid from 2020-01-01 to 2020-01-02 only.
    std::filesystem::path expired_cert, expired_key;
    /// Signed by the CA, serverAuth, but names only DNS:wrong.example (no IP:127.0.0.1).
    std::filesystem::path wrong_name_cert, wrong_name_key;
    /// A private key that belongs to no certificate here (does not match server_cert).
    std::filesystem::path mismatched_key;

    /// Writes a new key to `key` and a new certificate for it to `cert`, signed by the CA,
    /// with server_cert's names and usages (and a serial of its own): a rotated server
    /// certificate. Overwrites both files.
    void issue_server_certificate(const std::filesystem::path& cert,
                                  const std::filesystem::path& key) const;
    /// Like issue_server_certificate(), with `node_id` added to its DNS names: a node's
    /// certificate that binds its peer links to that node (docs/protocol.md section 6).
    void issue_node_certificate(const std::filesystem::path& cert, const std::filesystem::path& key,
                                const std::string& node_id) const;
    /// The certificate's serial number as `openssl x509 -serial` prints it (upper-case hex,
    /// e.g. "7D47F0..."), without "serial=".
    std::string serial(const std::filesystem::path& cert) const;

    /// Runs `openssl <args>` (args are passed to the shell as they are: quote paths with
    /// quote()), its output appended to <dir>/openssl.log. Throws std::runtime_error with
    /// the command and the log's tail when it does not exit 0.
    void openssl(const std::string& args) const;
    /// `path` in single quotes for the shell.
    static std::string quote(const std::filesystem::path& path);

private:
    /// A new EC P-256 key at `key`.
    void make_key(const std::filesystem::path& key) const;
    /// A new key at `key` and a certificate for it at `cert`, signed by the CA
    /// (ca_cert, ca_key), with subject CN=`cn` and the extensions of `extensions` (lines of
    /// an openssl extension file), valid for a year.
    void issue(const std::filesystem::path& cert, const std::filesystem::path& key,
               const std::string& cn, const std::filesystem::path& ca_crt,
               const std::filesystem::path& ca_k, const std::string& extensions) const;
    /// Numbers the scratch files (requests, extension files) of each openssl run.
    mutable unsigned issued_ = 0;
};

}  // namespace sandboxd::test
