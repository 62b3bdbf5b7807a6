#pragma once
// Small pieces the HTTP side of the server shares (listeners, routes, drain): plain-text
// responses and printable addresses. No state; thread-safe.
#include <sandboxd/core/net.hpp>

#include <string>

namespace sandboxd {

/// A text/plain response with the Server header, `keep_alive` set and the length prepared.
http::response<http::string_body> plain(http::status status, std::string body, unsigned version,
                                        bool keep_alive);

/// "HOST:PORT", IPv6 hosts in brackets.
std::string format_endpoint(const tcp::endpoint& ep);

/// The remote address of a connected stream ("0.0.0.0:0" when the socket cannot say).
template <typename Stream>
std::string remote_address(Stream& stream) {
    beast::error_code ignored;
    return format_endpoint(beast::get_lowest_layer(stream).socket().remote_endpoint(ignored));
}

}  // namespace sandboxd
