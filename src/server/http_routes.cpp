#include "server/http_routes.hpp"

#include "server/drain.hpp"
#include "server/http_util.hpp"
#include "server/lease_service.hpp"
#include "server/membership.hpp"
#include "server/node_gauges.hpp"
#include "server/session.hpp"
#include "server/session_set.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/metrics.hpp>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <mutex>

namespace sandboxd {
namespace {

bool matches(const HttpRoute& route, std::string_view path) {
    if (path == route.path) return true;
    return route.subtree && path.size() > route.path.size() && path.starts_with(route.path) &&
           path[route.path.size()] == '/';
}

std::optional<Principal> bearer_principal(const Node& node,
                                          const http::request<http::string_body>& req) {
    std::string_view auth = req[http::field::authorization];
    if (auth.size() > 7 && beast::iequals(auth.substr(0, 7), "Bearer ")) {
        return node.authenticate(auth.substr(7));
    }
    return std::nullopt;
}

std::string join_names(const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

/// Answers a request too large to read with its status, then closes (the rest is unread).
awaitable<void> reject_oversized(ConnStream& stream, bool header) {
    auto res = plain(
        header ? http::status::request_header_fields_too_large : http::status::payload_too_large,
        header ? "request header fields over 16 KiB\n" : "request body over 64 KiB\n", 11, false);
    spdlog::info("rejected an HTTP request: {}",
                 header ? "headers over 16 KiB" : "body over 64 KiB");
    co_await http::async_write(stream, res, as_tuple_awaitable);
    // A lingering close: what the client still sends is read and dropped (at most 1 MiB or
    // 2 s), so that closing with unread bytes does not reset the connection and lose the
    // status on the client's side.
    beast::error_code ignored;
    beast::get_lowest_layer(stream).socket().shutdown(tcp::socket::shutdown_send, ignored);
    beast::get_lowest_layer(stream).expires_after(std::chrono::seconds(2));
    std::array<char, 16384> sink{};
    for (std::size_t drained = 0; drained < (1U << 20);) {
        auto [rec, got] = co_await stream.async_read_some(net::buffer(sink), as_tuple_awaitable);
        if (rec) break;
        drained += got;
    }
}

}  // namespace

std::span<const HttpRoute> HttpRoutes::routes() {
    // The handlers are private members: the table lives in a member function.
    static constexpr std::array<HttpRoute, 7> table{{
        {http::verb::unknown, "/v1/ws", false, route_access::session, "", "", "connection.refused",
         &HttpRoutes::upgrade},
        {http::verb::post, "/admin/drain", false, route_access::peer,
         "missing or invalid bearer token", "a peer-role token", "drain.refused",
         &HttpRoutes::admin_drain},
        {http::verb::post, "/admin/decommission", false, route_access::peer,
         "missing or invalid bearer token", "a peer-role token", "decommission.refused",
         &HttpRoutes::admin_decommission},
        {http::verb::get, "/healthz", false, route_access::open, "", "", "", &HttpRoutes::healthz},
        {http::verb::get, "/readyz", false, route_access::open, "", "", "", &HttpRoutes::readyz},
        {http::verb::get, "/console", true, route_access::open, "", "", "", &HttpRoutes::console},
        {http::verb::get, "/metrics", false, route_access::metrics,
         "GET /metrics takes a bearer token with role metrics or peer",
         "a token with role metrics or peer", "", &HttpRoutes::metrics},
    }};
    return table;
}

awaitable<void> HttpRoutes::serve(ConnStream stream, listener_kind listener, ConnectionSlot& slot) {
    beast::flat_buffer buffer;
    // The first request's deadline runs from the accept (the TLS handshake's, when there was
    // one); each later request on a kept-alive connection gets authTimeoutMs of its own.
    const auto auth_timeout = std::chrono::milliseconds(node_.config.limits.auth_timeout_ms);
    bool first = true;
    for (;;) {
        http::request_parser<http::string_body> parser;
        parser.header_limit(16 * 1024);
        parser.body_limit(64 * 1024);
        if (!first || !stream.tls()) beast::get_lowest_layer(stream).expires_after(auth_timeout);
        first = false;
        auto [ec, n] = co_await http::async_read(stream, buffer, parser, as_tuple_awaitable);
        if (ec == http::error::header_limit || ec == http::error::body_limit) {
            co_await reject_oversized(stream, ec == http::error::header_limit);
            co_return;
        }
        if (ec) co_return;
        auto req = parser.release();
        const std::string_view target = req.target();
        HttpExchange ex{req,
                        stream,
                        listener,
                        slot,
                        target.substr(0, target.find('?')),
                        remote_address(stream),
                        req.keep_alive(),
                        bearer_principal(node_, req)};
        auto res = co_await dispatch(ex);
        if (!res) co_return;  // upgraded: the session served the connection to its end
        auto [wec, wn] = co_await http::async_write(stream, *res, as_tuple_awaitable);
        if (wec || !res->keep_alive()) {
            beast::get_lowest_layer(stream).socket().shutdown(tcp::socket::shutdown_send, wec);
            co_return;
        }
    }
}

awaitable<std::optional<HttpResponse>> HttpRoutes::dispatch(HttpExchange& ex) {
    const auto version = ex.req.version();
    const auto table = routes();
    const auto route = std::find_if(table.begin(), table.end(),
                                    [&](const HttpRoute& r) { return matches(r, ex.path); });
    if (route == table.end()) {
        co_return ex.req.method() != http::verb::get
            ? plain(http::status::method_not_allowed, "method not allowed\n", version, ex.keep)
            : plain(http::status::not_found, "not found\n", version, ex.keep);
    }
    if (route->verb != http::verb::unknown && ex.req.method() != route->verb) {
        const std::string verb(http::to_string(route->verb));
        auto res = plain(http::status::method_not_allowed,
                         "method not allowed: " + verb + " " + std::string(route->path) + "\n",
                         version, ex.keep);
        res.set(http::field::allow, verb);
        co_return res;
    }
    if (auto refused = authorize(*route, ex)) co_return refused;
    co_return co_await (this->*(route->handler))(ex);
}

std::optional<HttpResponse> HttpRoutes::authorize(const HttpRoute& route, HttpExchange& ex) {
    switch (route.access) {
        case route_access::open:
        case route_access::session: return std::nullopt;  // the upgrade checks its own
        case route_access::metrics:
            // issue 44, item 7: a credential by default; metrics.public opens plainListen alone.
            if (node_.config.metrics_public && ex.listener == listener_kind::plain)
                return std::nullopt;
            break;
        case route_access::peer: break;
    }
    if (!ex.bearer)
        return refuse(route, ex, http::status::unauthorized, std::string(route.unauthenticated));
    const auto& who = *ex.bearer;
    const bool role_ok =
        route.access == route_access::peer ? who.role == "peer" : who.reads_metrics;
    if (!role_ok) {
        return refuse(route, ex, http::status::forbidden,
                      "token \"" + who.name + "\" has role " + who.role + "; " +
                          std::string(http::to_string(route.verb)) + " " + std::string(route.path) +
                          " takes " + std::string(route.takes));
    }
    if (route.access == route_access::peer && !peer_certified(ex.stream, who)) {
        return refuse(route, ex, http::status::forbidden,
                      "peer token \"" + who.name +
                          "\": no client certificate that routing.peerTls.caFile verifies");
    }
    return std::nullopt;
}

HttpResponse HttpRoutes::refuse(const HttpRoute& route, HttpExchange& ex, http::status status,
                                const std::string& why) {
    if (!route.refusal_event.empty()) {
        spdlog::info("peer={} {} {} refused: {}", ex.peer, http::to_string(route.verb), route.path,
                     why);
        if (node_.audit) {
            node_.audit->write(
                std::string(route.refusal_event),
                {{"peer", ex.peer},
                 {"token", ex.bearer ? nlohmann::json(ex.bearer->name) : nlohmann::json()},
                 {"reason", why}});
        }
    }
    auto res = plain(status, why + "\n", ex.req.version(), ex.keep);
    if (status == http::status::unauthorized)
        res.set(http::field::www_authenticate, "Bearer realm=\"sandboxd\"");
    return res;
}

awaitable<std::optional<HttpResponse>> HttpRoutes::upgrade(HttpExchange& ex) {
    if (!websocket::is_upgrade(ex.req)) {
        co_return plain(http::status::bad_request, "expected a WebSocket upgrade\n",
                        ex.req.version(), false);
    }
    std::optional<Principal> who;
    if (auto refused = upgrade_refusal(ex, who)) co_return refused;
    ex.slot.authenticated();
    auto session = std::make_shared<Session>(node_, std::move(ex.stream), std::move(*who));
    sessions_.add(session);
    co_await session->run(std::move(ex.req));
    co_return std::nullopt;
}

std::optional<HttpResponse> HttpRoutes::upgrade_refusal(HttpExchange& ex,
                                                        std::optional<Principal>& who) {
    const auto& req = ex.req;
    const auto version = req.version();
    // Logged with the peer's address, and audited as connection.refused.
    const auto refused = [&](const std::string& why, const std::optional<Principal>& token) {
        spdlog::info("peer={} rejected an upgrade: {}", ex.peer, why);
        if (node_.audit) {
            node_.audit->write("connection.refused",
                               {{"peer", ex.peer},
                                {"token", token ? nlohmann::json(token->name) : nlohmann::json()},
                                {"reason", why}});
        }
    };
    who = ex.bearer;
    if (req[http::field::authorization].empty()) {
        // A browser cannot set Authorization: its token comes as the subprotocol
        // sandboxd.bearer.<base64url>, and only from a page of this node's own origin.
        if (auto token = bearer_from_subprotocols(req[http::field::sec_websocket_protocol])) {
            if (!origin_matches_host(req[http::field::origin], req[http::field::host])) {
                refused("a browser upgrade from origin '" +
                            std::string(req[http::field::origin]).substr(0, 200) + "' for host '" +
                            std::string(req[http::field::host]).substr(0, 200) + "'",
                        std::nullopt);
                return plain(http::status::forbidden,
                             "a token in the subprotocol is accepted only from a page of this "
                             "node's origin\n",
                             version, false);
            }
            who = node_.authenticate(*token);
        }
    }
    if (!who) {
        refused("missing or invalid bearer token", std::nullopt);
        auto res =
            plain(http::status::unauthorized, "missing or invalid bearer token\n", version, false);
        res.set(http::field::www_authenticate, "Bearer realm=\"sandboxd\"");
        return res;
    }
    if (!peer_certified(ex.stream, *who)) {
        refused("peer token \"" + who->name +
                    "\": no client certificate that routing.peerTls.caFile verifies",
                who);
        return plain(http::status::forbidden,
                     "a peer token needs a client certificate that the cluster CA verified\n",
                     version, false);
    }
    if (const auto unbound = peer_binding_refusal(ex.stream, *who, req); !unbound.empty()) {
        refused(unbound, who);
        return plain(http::status::forbidden, unbound + "\n", version, false);
    }
    if (who->role == "peer" && req.count("Sandboxd-Forwarded-To") != 0 &&
        req["Sandboxd-Forwarded-To"] != node_.node_id) {
        // A peer link meant for another node (its record's address now reaches this one, e.g.
        // after a restart on another port): what it forwards must never run here, on a node
        // that does not hold the lease.
        const std::string meant(req["Sandboxd-Forwarded-To"]);
        refused("peer link meant for node " + meant + " reached node " + node_.node_id, who);
        return plain(http::status::misdirected_request,
                     "this is node " + node_.node_id + ", not " + meant + "\n", version, false);
    }
    if (node_.stopping) {
        refused("node is stopping", who);
        return plain(http::status::service_unavailable, "node is stopping\n", version, false);
    }
    if (!node_.registered) {
        refused("node is starting: not registered with the registry yet", who);
        return plain(http::status::service_unavailable,
                     "node is starting: not registered with the registry yet\n", version, false);
    }
    if (who->role == "metrics") {
        refused("token \"" + who->name + "\" has role metrics: it may only read GET /metrics", who);
        return plain(http::status::forbidden, "a metrics-role token may only read GET /metrics\n",
                     version, false);
    }
    return std::nullopt;
}

awaitable<std::optional<HttpResponse>> HttpRoutes::admin_drain(HttpExchange& ex) {
    // Only a peer-role token (the table's access column): the operators' and the cluster's
    // credential, never a host's.
    const auto& who = *ex.bearer;
    const bool already = drain_.started();
    spdlog::info("peer={} token \"{}\": POST /admin/drain{}", ex.peer, who.name,
                 already ? " (already draining)" : "");
    if (node_.audit)
        node_.audit->write("drain.requested", {{"peer", ex.peer}, {"token", who.name}});
    drain_.begin();
    const nlohmann::json body = {{"nodeId", node_.node_id},
                                 {"draining", true},
                                 {"channels", node_.channels.size()},
                                 {"relayedChannels", node_.relays_open.load()},
                                 {"drainTimeoutMs", node_.config.limits.drain_timeout_ms}};
    auto res = plain(http::status::accepted, body.dump() + "\n", ex.req.version(), ex.keep);
    res.set(http::field::content_type, "application/json");
    co_return res;
}

awaitable<std::optional<HttpResponse>> HttpRoutes::admin_decommission(HttpExchange& ex) {
    // Retires the node for good (issue 47): unlike a stop, which keeps the sandboxes, the
    // leases and the record for the next process, it ends every sandbox, releases every
    // lease this node owns, removes its record and stops. Peer-role only, like drain.
    const auto& who = *ex.bearer;
    const bool already = node_.decommissioning.exchange(true);
    spdlog::warn("peer={} token \"{}\": POST /admin/decommission{}", ex.peer, who.name,
                 already ? " (already decommissioning)" : "");
    if (node_.audit) {
        node_.audit->write("node.decommissioned", {{"peer", ex.peer}, {"token", who.name}});
    }
    if (!already) {
        drain_.begin();  // no new leases or opens from now on
        net::co_spawn(
            *node_.ioc,
            [&node = node_, &drain = drain_, actor = who.name]() -> awaitable<void> {
                try {
                    const auto released = co_await release_own_leases(node, actor);
                    spdlog::info("node={} decommissioned: released {} lease(s); stopping",
                                 node.node_id, released);
                } catch (const std::exception& e) {
                    spdlog::error("node={} decommission: releasing its leases failed: {}",
                                  node.node_id, e.what());
                }
                drain.then_stop();
            },
            logged_as("decommission"));
    }
    const nlohmann::json body = {{"nodeId", node_.node_id},
                                 {"decommissioning", true},
                                 {"leases", node_.cache.snapshot().size()}};
    auto res = plain(http::status::accepted, body.dump() + "\n", ex.req.version(), ex.keep);
    res.set(http::field::content_type, "application/json");
    co_return res;
}

awaitable<std::optional<HttpResponse>> HttpRoutes::healthz(HttpExchange& ex) {
    co_return plain(http::status::ok, "ok\n", ex.req.version(), ex.keep);
}

awaitable<std::optional<HttpResponse>> HttpRoutes::readyz(HttpExchange& ex) {
    std::string why;
    if (node_.draining) {
        why = "draining";
    } else if (!node_.registered) {
        std::lock_guard lock(node_.startup_mutex);
        why = "not registered with the registry yet" +
              (node_.startup_problem.empty() ? std::string() : ": " + node_.startup_problem);
    }
    if (why.empty() && !co_await membership_.registry_reachable()) why = "registry unreachable";
    if (const auto fenced = why.empty() ? node_.fenced_for_ms() : 0) {
        why = "membership not renewed for " + std::to_string(fenced) + " ms (fenced)";
    }
    std::string notes;
    for (const auto& [key, provider] : node_.providers) {
        if (!provider->ready()) {
            // Why, where the provider knows (the bwrap provider's start-up probe).
            if (why.empty()) {
                const auto note = provider->degraded();
                why = "provider " + key + " not ready" + (note.empty() ? "" : ": " + note);
            }
            continue;
        }
        if (auto note = provider->degraded(); !note.empty()) {
            notes.append("warning: provider ").append(key).append(": ").append(note);
            notes += '\n';
        }
    }
    co_return why.empty() ? plain(http::status::ok, "ready\n" + notes, ex.req.version(), ex.keep)
                          : plain(http::status::service_unavailable, "not ready: " + why + "\n",
                                  ex.req.version(), ex.keep);
}

awaitable<std::optional<HttpResponse>> HttpRoutes::console(HttpExchange& ex) {
    // Off, or a name the page does not have: 404. Enabled without its files: 503.
    const auto version = ex.req.version();
    const bool enabled = node_.config.console_enabled;
    if (enabled && !console_.available()) {
        co_return plain(http::status::service_unavailable,
                        "console not available: " + console_.problem() + "\n", version, ex.keep);
    }
    const auto* file = enabled ? console_.find(std::string(ex.req.target())) : nullptr;
    if (!file) co_return plain(http::status::not_found, "not found\n", version, ex.keep);
    auto res = plain(http::status::ok, file->body, version, ex.keep);
    res.set(http::field::content_type, file->content_type);
    res.set("Content-Security-Policy", std::string(console_csp));
    res.set("X-Content-Type-Options", "nosniff");
    res.set("Referrer-Policy", "no-referrer");
    res.set(http::field::cache_control, "no-store");
    co_return res;
}

awaitable<std::optional<HttpResponse>> HttpRoutes::metrics(HttpExchange& ex) {
    co_await gauges_.refresh_lease_counts();
    auto res = plain(http::status::ok, node_.metrics.registry.render() + process_metrics_text(),
                     ex.req.version(), ex.keep);
    res.set(http::field::content_type, "text/plain; version=0.0.4");
    co_return res;
}

std::string HttpRoutes::peer_binding_refusal(ConnStream& stream, const Principal& who,
                                             const http::request<http::string_body>& req) const {
    if (who.role != "peer") return {};
    const std::string by(req["Sandboxd-Forwarded-By"]);
    const std::string claimed = by.empty() ? std::string("no node") : "node " + by.substr(0, 200);
    if (!who.node_id.empty() && by != who.node_id) {
        return "peer token \"" + who.name + "\" is bound to node " + who.node_id +
               "; this link says it comes from " + claimed;
    }
    auto* t = stream.tls();
    if (t == nullptr || !node_.security()->peer_ca) return {};
    const auto names = peer_certificate_dns_names(t->native_handle());
    if (names.empty() || std::find(names.begin(), names.end(), by) != names.end()) return {};
    return "the peer link's client certificate names DNS " + join_names(names) +
           "; this link says it comes from " + claimed;
}

bool HttpRoutes::peer_certified(ConnStream& stream, const Principal& who) const {
    if (who.role != "peer") return true;
    const auto security = node_.security();
    if (!security->peer_ca) return true;
    auto* t = stream.tls();
    return t != nullptr && security->peer_ca->verifies(t->native_handle());
}

}  // namespace sandboxd
