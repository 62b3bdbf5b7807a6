#pragma once
// SHA-256 (FIPS 180-4, OpenSSL's EVP_Digest) for the tests' byte-exact checks against the
// digests in CASES.md. Pure function; thread-safe.
#include <string>
#include <string_view>

namespace sandboxd::test {

/// Lower-case hex SHA-256 of `bytes`.
std::string sha256_hex(std::string_view bytes);

}  // namespace sandboxd::test
