#include "registry/cursor.hpp"

#include <sandboxd/core/errors.hpp>

#include <charconv>

namespace sandboxd {

std::string encode_cursor(const Lease& last) {
    return std::to_string(last.acquired_at_ms) + ":" + last.id;
}

std::pair<std::int64_t, std::string> decode_cursor(const std::string& cursor) {
    auto colon = cursor.find(':');
    std::int64_t ms = 0;
    if (colon == std::string::npos || colon == 0 || colon + 1 == cursor.size()) {
        throw rpc_error(errc::invalid_params, "cursor: malformed");
    }
    const char* end = cursor.data() + colon;
    auto [ptr, ec] = std::from_chars(cursor.data(), end, ms);
    if (ec != std::errc() || ptr != end) throw rpc_error(errc::invalid_params, "cursor: malformed");
    return {ms, cursor.substr(colon + 1)};
}

}  // namespace sandboxd
