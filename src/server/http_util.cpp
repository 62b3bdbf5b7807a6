#include "server/http_util.hpp"

#include <sandboxd/version.hpp>

#include <utility>

namespace sandboxd {

http::response<http::string_body> plain(http::status status, std::string body, unsigned version,
                                        bool keep_alive) {
    http::response<http::string_body> res{status, version};
    res.set(http::field::server, std::string("sandboxd/") + version_string);
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.keep_alive(keep_alive);
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
}

std::string format_endpoint(const tcp::endpoint& ep) {
    auto addr = ep.address();
    std::string host = addr.is_v6() ? "[" + addr.to_string() + "]" : addr.to_string();
    return host + ":" + std::to_string(ep.port());
}

}  // namespace sandboxd
