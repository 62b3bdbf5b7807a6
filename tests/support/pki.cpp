#include "support/pki.hpp"

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace sandboxd::test {
namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

void write_file(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) throw std::runtime_error("cannot write " + path.string());
}

namespace {

/// What every certificate of a server carries (server_cert, the rotated ones, the expired one).
const char* const server_extensions =
    "basicConstraints = CA:FALSE\n"
    "keyUsage = critical, digitalSignature\n"
    "extendedKeyUsage = serverAuth, clientAuth\n"
    "subjectAltName = IP:127.0.0.1, DNS:localhost\n";

const char* const client_extensions =
    "basicConstraints = CA:FALSE\n"
    "keyUsage = critical, digitalSignature\n"
    "extendedKeyUsage = clientAuth\n";

const char* const wrong_name_extensions =
    "basicConstraints = CA:FALSE\n"
    "keyUsage = critical, digitalSignature\n"
    "extendedKeyUsage = serverAuth, clientAuth\n"
    "subjectAltName = DNS:wrong.example\n";

}  // namespace

std::string TestPki::quote(const fs::path& path) {
    std::string out = "'";
    for (const char ch : path.string()) {
        if (ch == '\'') {
            out += "'\\''";
        } else {
            out += ch;
        }
    }
    return out + "'";
}

void TestPki::openssl(const std::string& args) const {
    const fs::path log = dir / "openssl.log";
    // A configuration of our own for every command (`req` reads one): the host's
    // openssl.cnf, or an OPENSSL_CONF of the environment, changes nothing here.
    const std::string command = "OPENSSL_CONF=" + quote(dir / "openssl.cnf") + " openssl " + args +
                                " </dev/null >>" + quote(log) + " 2>&1";
    const int status = std::system(command.c_str());
    if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::string tail = read_file(log);
        if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
        throw std::runtime_error("TestPki: `" + command + "` failed (status " +
                                 std::to_string(status) + "):\n" + tail);
    }
}

void TestPki::make_key(const fs::path& key) const {
    openssl("genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out " + quote(key));
}

void TestPki::issue(const fs::path& cert, const fs::path& key, const std::string& cn,
                    const fs::path& ca_crt, const fs::path& ca_k,
                    const std::string& extensions) const {
    const std::string n = std::to_string(++issued_);
    const fs::path csr = dir / ("request-" + n + ".csr");
    const fs::path ext = dir / ("request-" + n + ".ext");
    write_file(ext, extensions);
    make_key(key);
    openssl("req -new -key " + quote(key) + " -subj " + quote("/CN=" + cn) + " -out " + quote(csr));
    // -CAcreateserial: a random serial the first time, then one more per certificate.
    openssl("x509 -req -in " + quote(csr) + " -CA " + quote(ca_crt) + " -CAkey " + quote(ca_k) +
            " -CAserial " + quote(dir / (ca_crt.stem().string() + ".srl")) + " -CAcreateserial" +
            " -days 365 -sha256 -extfile " + quote(ext) + " -out " + quote(cert));
}

TestPki::TestPki() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/sandboxd-pki.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("TestPki: mkdtemp failed");
    dir = tmpl;
    try {
        ca_cert = dir / "ca.crt";
        ca_key = dir / "ca.key";
        other_ca_cert = dir / "other-ca.crt";
        other_ca_key = dir / "other-ca.key";
        server_cert = dir / "server.crt";
        server_key = dir / "server.key";
        client_cert = dir / "client.crt";
        client_key = dir / "client.key";
        other_client_cert = dir / "other-client.crt";
        other_client_key = dir / "other-client.key";
        expired_cert = dir / "expired.crt";
        expired_key = dir / "expired.key";
        wrong_name_cert = dir / "wrong-name.crt";
        wrong_name_key = dir / "wrong-name.key";
        mismatched_key = dir / "mismatched.key";

        // `req` needs a distinguished_name section; -subj gives the names.
        write_file(dir / "openssl.cnf",
                   "[ req ]\n"
                   "distinguished_name = req_dn\n"
                   "prompt = no\n"
                   "[ req_dn ]\n"
                   "CN = unused\n");
        const auto make_ca = [this](const fs::path& crt, const fs::path& key,
                                    const std::string& cn) {
            make_key(key);
            openssl("req -x509 -new -key " + quote(key) + " -sha256 -days 3650 -subj " +
                    quote("/CN=" + cn) + " -addext " + quote("basicConstraints=critical,CA:TRUE") +
                    " -addext " + quote("keyUsage=critical,keyCertSign,cRLSign") + " -out " +
                    quote(crt));
        };
        make_ca(ca_cert, ca_key, "sandboxd test CA");
        make_ca(other_ca_cert, other_ca_key, "unrelated test CA");
        issue(server_cert, server_key, "127.0.0.1", ca_cert, ca_key, server_extensions);
        issue(client_cert, client_key, "sandboxd test client", ca_cert, ca_key, client_extensions);
        issue(other_client_cert, other_client_key, "client of the other CA", other_ca_cert,
              other_ca_key, client_extensions);
        issue(wrong_name_cert, wrong_name_key, "wrong.example", ca_cert, ca_key,
              wrong_name_extensions);
        make_key(mismatched_key);

        // Expired: `openssl x509 -req` (OpenSSL 3.0) cannot set the validity period's start;
        // `openssl ca` can, with a database of its own.
        const fs::path db = dir / "ca-db";
        fs::create_directories(db);
        write_file(db / "index.txt", "");
        write_file(db / "serial", "1000\n");
        write_file(dir / "expired.ext", server_extensions);
        write_file(dir / "ca.cnf",
                   "[ ca ]\n"
                   "default_ca = test_ca\n"
                   "[ test_ca ]\n"
                   "database = " +
                       (db / "index.txt").string() +
                       "\n"
                       "serial = " +
                       (db / "serial").string() +
                       "\n"
                       "new_certs_dir = " +
                       db.string() +
                       "\n"
                       "default_md = sha256\n"
                       "policy = test_policy\n"
                       "unique_subject = no\n"
                       "copy_extensions = none\n"
                       "[ test_policy ]\n"
                       "commonName = supplied\n");
        const fs::path expired_csr = dir / "expired.csr";
        make_key(expired_key);
        openssl("req -new -key " + quote(expired_key) + " -subj " + quote("/CN=127.0.0.1") +
                " -out " + quote(expired_csr));
        openssl("ca -batch -notext -config " + quote(dir / "ca.cnf") + " -cert " + quote(ca_cert) +
                " -keyfile " + quote(ca_key) + " -in " + quote(expired_csr) +
                " -startdate 20200101000000Z -enddate 20200102000000Z -extfile " +
                quote(dir / "expired.ext") + " -out " + quote(expired_cert));
    } catch (...) {
        std::error_code ec;
        fs::remove_all(dir, ec);
        throw;
    }
}

TestPki::~TestPki() {
    std::error_code ec;
    fs::remove_all(dir, ec);
}

void TestPki::issue_server_certificate(const fs::path& cert, const fs::path& key) const {
    issue(cert, key, "127.0.0.1", ca_cert, ca_key, server_extensions);
}

void TestPki::issue_node_certificate(const fs::path& cert, const fs::path& key,
                                     const std::string& node_id) const {
    const std::string extensions = std::string(
                                       "basicConstraints = CA:FALSE\n"
                                       "keyUsage = critical, digitalSignature\n"
                                       "extendedKeyUsage = serverAuth, clientAuth\n"
                                       "subjectAltName = IP:127.0.0.1, DNS:localhost, DNS:") +
                                   node_id + "\n";
    issue(cert, key, "127.0.0.1", ca_cert, ca_key, extensions);
}

std::string TestPki::serial(const fs::path& cert) const {
    const std::string n = std::to_string(++issued_);
    const fs::path out = dir / ("serial-" + n + ".txt");
    openssl("x509 -in " + quote(cert) + " -noout -serial -out " + quote(out));
    std::string text = read_file(out);
    const std::string prefix = "serial=";
    if (text.rfind(prefix, 0) != 0)
        throw std::runtime_error("TestPki: unexpected serial output: " + text);
    text = text.substr(prefix.size());
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    return text;
}

}  // namespace sandboxd::test
