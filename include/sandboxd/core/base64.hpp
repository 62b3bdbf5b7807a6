#pragma once
/// @file base64.hpp
/// Base64 of RFC 4648 section 4 (alphabet `A-Z a-z 0-9 + /`, `=` padding), on OpenSSL's
/// EVP_EncodeBlock / EVP_DecodeBlock. Used for duplexChannelWrite / duplexChannel.data chunks,
/// plugin worker messages and the etcd gateway's keys and values.
/// Pure functions; thread-safe; never block.

#include <stdexcept>
#include <string>
#include <string_view>

namespace sandboxd {

/// Thrown by base64_decode for malformed text; what() names the problem (e.g.
/// "base64: invalid character at offset 5"). An std::invalid_argument, so callers that caught
/// that before keep working.
class base64_error : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// Base64 of `bytes`, with padding, no line breaks: 4 * ceil(size / 3) characters.
/// Throws std::bad_alloc only.
std::string base64_encode(std::string_view bytes);

/// Decodes the canonical form base64_encode writes, strictly: the length must be a multiple
/// of 4; every character must be in the alphabet, except one or two `=` that may end the
/// text; no whitespace or line breaks. Like most decoders (and the ones this replaced), the
/// unused low bits of the last group are not checked. The empty text decodes to "".
/// Throws base64_error naming the first problem found.
std::string base64_decode(std::string_view text);

}  // namespace sandboxd
