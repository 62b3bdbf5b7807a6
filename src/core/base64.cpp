#include <sandboxd/core/base64.hpp>

#include <openssl/evp.h>

#include <algorithm>
#include <climits>
#include <cstddef>

namespace sandboxd {
namespace {

// EVP_*Block take an int length: work in pieces well below INT_MAX, multiples of 3 bytes
// (encode) and 4 characters (decode), so every piece but the last has no padding.
constexpr std::size_t encode_piece = 3U << 28;
constexpr std::size_t decode_piece = 4U << 28;
static_assert(encode_piece < INT_MAX && decode_piece < INT_MAX);

bool in_alphabet(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
           c == '/';
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
    std::string out((bytes.size() + 2) / 3 * 4, '\0');
    // EVP_EncodeBlock writes a terminating NUL after the text: keep a byte for it.
    out.push_back('\0');
    auto* to = reinterpret_cast<unsigned char*>(out.data());
    for (std::size_t pos = 0; pos < bytes.size(); pos += encode_piece) {
        const auto n = std::min(encode_piece, bytes.size() - pos);
        to += EVP_EncodeBlock(to, reinterpret_cast<const unsigned char*>(bytes.data() + pos),
                              static_cast<int>(n));
    }
    out.pop_back();
    return out;
}

std::string base64_decode(std::string_view text) {
    if (text.size() % 4 != 0) {
        throw base64_error("base64: length " + std::to_string(text.size()) +
                           " is not a multiple of 4");
    }
    // EVP_DecodeBlock is lenient where we are strict: it skips leading and trailing
    // whitespace and reads a '=' anywhere as zero bits. So check the text first.
    std::size_t padding = 0;
    if (!text.empty() && text.back() == '=') padding = text[text.size() - 2] == '=' ? 2 : 1;
    for (std::size_t i = 0; i < text.size() - padding; ++i) {
        if (in_alphabet(text[i])) continue;
        throw base64_error(
            text[i] == '=' ? "base64: padding '=' before the end, at offset " + std::to_string(i)
                           : "base64: invalid character at offset " + std::to_string(i));
    }
    // EVP_DecodeBlock decodes the padding as zero bits and counts them in its result
    // (3 bytes for every 4 characters): drop those bytes.
    std::string out(text.size() / 4 * 3, '\0');
    auto* to = reinterpret_cast<unsigned char*>(out.data());
    for (std::size_t pos = 0; pos < text.size(); pos += decode_piece) {
        const auto n = std::min(decode_piece, text.size() - pos);
        const int written = EVP_DecodeBlock(
            to, reinterpret_cast<const unsigned char*>(text.data() + pos), static_cast<int>(n));
        // Unreachable after the checks above; kept so a change in OpenSSL cannot pass silently.
        if (written < 0 || static_cast<std::size_t>(written) != n / 4 * 3) {
            throw base64_error("base64: rejected by the decoder");
        }
        to += written;
    }
    out.resize(out.size() - padding);
    return out;
}

}  // namespace sandboxd
