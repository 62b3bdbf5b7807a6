#include <sandboxd/core/utf8.hpp>

namespace sandboxd {
namespace {

constexpr std::string_view replacement = "\xEF\xBF\xBD";

/// The length of the well-formed sequence at the start of `s` (1..4), 0 when it is not one,
/// or -1 when `s` is a proper prefix of one (more bytes may complete it). RFC 3629 table.
int sequence_at(std::string_view s) {
    const auto b = [&s](std::size_t i) { return static_cast<unsigned char>(s[i]); };
    const unsigned char c = b(0);
    if (c < 0x80) return 1;
    int len = 0;
    unsigned char lo = 0x80;
    unsigned char hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;  // no overlongs
        if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;  // no overlongs
        if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
    } else {
        return 0;
    }
    for (int i = 1; i < len; ++i) {
        if (static_cast<std::size_t>(i) >= s.size()) return -1;
        const unsigned char lower = i == 1 ? lo : 0x80;
        const unsigned char upper = i == 1 ? hi : 0xBF;
        if (b(i) < lower || b(i) > upper) return 0;
    }
    return len;
}

}  // namespace

std::string Utf8Text::feed(std::string_view bytes) {
    std::string in;
    std::string_view s = bytes;
    if (!held_.empty()) {
        in = std::move(held_);
        held_.clear();
        in.append(bytes);
        s = in;
    }
    std::string out;
    out.reserve(s.size());
    std::size_t i = 0;
    while (i < s.size()) {
        const int len = sequence_at(s.substr(i));
        if (len < 0) {
            held_.assign(s.substr(i));
            break;
        }
        if (len == 0) {
            out.append(replacement);
            ++i;
            continue;
        }
        out.append(s.substr(i, static_cast<std::size_t>(len)));
        i += static_cast<std::size_t>(len);
    }
    return out;
}

std::string Utf8Text::finish() {
    std::string out;
    for (std::size_t i = 0; i < held_.size(); ++i) out.append(replacement);
    held_.clear();
    return out;
}

std::string to_utf8_text(std::string_view bytes) {
    Utf8Text t;
    std::string out = t.feed(bytes);
    out += t.finish();
    return out;
}

}  // namespace sandboxd
