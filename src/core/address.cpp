#include <sandboxd/core/address.hpp>

#include <boost/url/authority_view.hpp>
#include <boost/url/parse.hpp>
#include <boost/url/url_view.hpp>

#include <algorithm>

namespace sandboxd {
namespace {

namespace urls = boost::urls;

std::string quoted(std::string_view text) { return "\"" + std::string(text) + "\""; }

bool dns_name(std::string_view host) {
    return !host.empty() && std::all_of(host.begin(), host.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '-' || c == '.' || c == '_';
    });
}

/// The host of an authority Boost.URL accepted, or "" when it is not one we take: user info,
/// IPvFuture, an empty name, or a name that only RFC 3986's reg-name allows (percent
/// escapes, sub-delims), which no resolver would find.
std::string host_of(const urls::authority_view& a) {
    if (a.has_userinfo()) return {};
    switch (a.host_type()) {
        case urls::host_type::ipv4:
        case urls::host_type::ipv6: return a.host_address();  // without brackets
        case urls::host_type::name: {
            std::string name(a.encoded_host_address());
            return dns_name(name) ? name : std::string();
        }
        default: return {};
    }
}

/// The port digits as a number; throws `port must be <min>..65535` otherwise.
std::uint16_t port_of(std::string_view digits, std::uint16_t min) {
    const bool numeric =
        !digits.empty() && digits.size() <= 5 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    const unsigned long value = numeric ? std::stoul(std::string(digits)) : 0;
    if (!numeric || value > 65535 || value < min) {
        throw address_error("port must be " + std::to_string(min) + "..65535, got " +
                            quoted(digits));
    }
    return static_cast<std::uint16_t>(value);
}

}  // namespace

std::string HostPort::authority() const {
    return (is_ipv6() ? "[" + host + "]" : host) + ":" + port_text();
}

HostPort parse_host_port(std::string_view text, port_zero zero) {
    const auto bad = [&] { return address_error("must be HOST:PORT, got " + quoted(text)); };
    auto parsed = urls::parse_authority(text);
    if (!parsed || !parsed->has_port() || parsed->port().empty()) throw bad();
    HostPort out;
    out.host = host_of(*parsed);
    if (out.host.empty()) throw bad();
    out.port = port_of(parsed->port(), zero == port_zero::allowed ? 0 : 1);
    return out;
}

WsUrl parse_ws_url(std::string_view text) {
    const auto bad = [&] {
        return address_error("must be ws://HOST[:PORT][/PATH] or wss://HOST[:PORT][/PATH], got " +
                             quoted(text));
    };
    auto parsed = urls::parse_uri(text);
    if (!parsed || (parsed->scheme() != "ws" && parsed->scheme() != "wss") ||
        !parsed->has_authority() || parsed->has_fragment()) {
        throw bad();
    }
    WsUrl out;
    out.tls = parsed->scheme() == "wss";
    out.endpoint.host = host_of(parsed->authority());
    if (out.endpoint.host.empty()) throw bad();
    // "ws://host:/" has a port separator without digits: RFC 3986 allows it, meaning default.
    out.endpoint.port = parsed->port().empty() ? (out.tls ? 443 : 80) : port_of(parsed->port(), 1);
    out.target = std::string(parsed->encoded_target());
    if (out.target.empty() || out.target == "/") out.target = "/v1/ws";
    return out;
}

HostPort parse_http_endpoint(std::string_view text, bool* https) {
    const auto bad = [&] {
        return address_error("must be http://HOST:PORT or https://HOST:PORT, got " + quoted(text));
    };
    auto parsed = urls::parse_uri(text);
    if (!parsed || (parsed->scheme() != "http" && parsed->scheme() != "https") ||
        !parsed->has_authority() || parsed->has_query() || parsed->has_fragment() ||
        (!parsed->encoded_path().empty() && parsed->encoded_path() != "/")) {
        throw bad();
    }
    const auto authority = parsed->authority();
    if (!authority.has_port() || authority.port().empty()) throw bad();
    HostPort out;
    out.host = host_of(authority);
    if (out.host.empty()) throw bad();
    out.port = port_of(authority.port(), 1);
    if (https) *https = parsed->scheme() == "https";
    return out;
}

}  // namespace sandboxd
