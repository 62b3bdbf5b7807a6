#pragma once
// SHA-256 (FIPS 180-4, OpenSSL's EVP_Digest) for the tests' byte-exact checks against the
// digests that the acceptance cases give (tests/integration/cases_test.cpp). Pure function;
// thread-safe.
#include <string>
#include <string_view>

namespace sandboxd::test {

/// Lower-case hex SHA-256 of `bytes`.
std::string sha256_hex(std::string_view bytes);

}  // namespace sandboxd::test
