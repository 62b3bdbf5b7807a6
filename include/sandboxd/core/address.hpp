#pragma once
/// @file address.hpp
/// The one parser of network addresses in configs and on the command line, on Boost.URL
/// (RFC 3986 authority and URI grammar):
///  - `HOST:PORT`: the daemon's `listen`, the tests' raw connections;
///  - `ws://HOST[:PORT][/PATH[?QUERY]]`: the client's url, a peer's advertiseUrl;
///  - `http://HOST:PORT[/]`: an etcd endpoint.
/// HOST is a DNS name (letters, digits, '-', '.', '_'), an IPv4 address, or an IPv6 address
/// in brackets (`[::1]:7800`); it is never empty. PORT is decimal, at most 65535.
/// Nothing is resolved: a name stays a name.
/// Pure functions; thread-safe; never block.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace sandboxd {

/// Thrown for text that is not the address asked for. what() is a sentence without a field
/// name, e.g. `must be HOST:PORT, got "7800"` or `port must be 0..65535, got "99999"`: callers
/// prefix what the text was ("config: listen: ...").
class address_error : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// A TCP address before resolution.
struct HostPort {
    std::string host;  ///< DNS name, IPv4 address, or IPv6 address without brackets
    std::uint16_t port = 0;

    bool is_ipv6() const noexcept { return host.find(':') != std::string::npos; }
    /// The port in decimal, for a resolver's service argument.
    std::string port_text() const { return std::to_string(port); }
    /// `host:port` with an IPv6 host in brackets: for a Host header or a message.
    std::string authority() const;

    bool operator==(const HostPort&) const = default;
};

/// Whether port 0 ("any free port", only meaningful for listening) is accepted.
enum class port_zero { allowed, rejected };

/// Parses `HOST:PORT`. The port is required. Throws address_error:
/// `must be HOST:PORT, got "<text>"` (no port, empty host, user info, a path, an IPv6 address
/// without brackets, a host with characters outside a DNS name), or
/// `port must be 0..65535, got "<port>"` (1..65535 with port_zero::rejected).
HostPort parse_host_port(std::string_view text, port_zero zero = port_zero::allowed);

/// A WebSocket URL split for a connect and a handshake.
struct WsUrl {
    HostPort endpoint;   ///< port 80 (ws) or 443 (wss) when the URL names none
    std::string target;  ///< path and query as written; "/v1/ws" for no path or "/"
    bool tls = false;    ///< wss://
};

/// Parses `ws://HOST[:PORT][/PATH[?QUERY]]` or the same with `wss://` (no user info, no
/// fragment). Throws address_error: `must be ws://HOST[:PORT][/PATH] or
/// wss://HOST[:PORT][/PATH], got "<text>"`, or `port must be 1..65535, got "<port>"`.
WsUrl parse_ws_url(std::string_view text);

/// Parses an etcd endpoint `http://HOST:PORT` or `https://HOST:PORT` (then `*https` is set,
/// when given), optionally with one trailing "/" and nothing else (no path, query, user info).
/// Throws address_error: `must be http://HOST:PORT or https://HOST:PORT, got "<text>"`, or
/// `port must be 1..65535, got "<port>"`.
HostPort parse_http_endpoint(std::string_view text, bool* https = nullptr);

}  // namespace sandboxd
