#pragma once
/// @file utf8.hpp
/// Turning a command's output bytes into JSON text (leaseExecute's stdout, stderr and log
/// chunks, docs/protocol.md section 2): valid UTF-8 passes through unchanged; each byte that
/// cannot start or continue a well-formed sequence (RFC 3629: no overlongs, no surrogates,
/// nothing above U+10FFFF) becomes U+FFFD. A sequence split across two reads is kept whole.
///
/// Value type; no shared state; not thread-safe (one decoder per stream).

#include <cstddef>
#include <string>
#include <string_view>

namespace sandboxd {

class Utf8Text {
public:
    /// The text of `bytes` after what came before. Up to 3 bytes of an incomplete sequence at
    /// the end are held for the next call (or finish()).
    std::string feed(std::string_view bytes);
    /// The text of what is still held (each held byte becomes U+FFFD): the stream ended.
    std::string finish();

private:
    std::string held_;
};

/// `bytes` as valid UTF-8 in one go (feed() then finish()).
std::string to_utf8_text(std::string_view bytes);

}  // namespace sandboxd
