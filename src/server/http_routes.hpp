#pragma once
// The node's HTTP surface (docs/protocol.md sections 1, 6 and 8) as one table: each route is
// a verb, a path, who may use it and one handler. To add a route: write its handler (a member
// below) and add its row to routes() in http_routes.cpp; the table's access column does the
// authentication and the refusals, so a handler sees only requests it may answer.
//
// Threading: serve() runs on the connection's strand (its connection loop); handlers may
// co_await. The tables are immutable.
#include "server/console.hpp"
#include "server/listeners.hpp"
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace sandboxd {

class Drain;
class Membership;
class NodeGauges;
class SessionSet;

/// One HTTP request being answered: what every handler gets.
struct HttpExchange {
    http::request<http::string_body>& req;  ///< the upgrade moves it into its session
    ConnStream& stream;
    listener_kind listener;
    ConnectionSlot& slot;
    std::string_view path;  ///< the target without its query
    std::string peer;       ///< the remote address, HOST:PORT
    bool keep = false;      ///< the client asked to keep the connection
    /// The `Authorization: Bearer` token's principal, read once per request; nullopt when
    /// there is none or the node does not know it.
    std::optional<Principal> bearer;
};

using HttpResponse = http::response<http::string_body>;

/// Who may use a route.
enum class route_access {
    open,     ///< anyone (health, readiness, the console's static files)
    session,  ///< the WebSocket upgrade: a host or peer token (its handler checks the rest)
    peer,     ///< a peer-role token, with its client certificate where routing.peerTls asks
    metrics,  ///< a token that reads metrics (roles metrics and peer); metrics.public opens
              ///< plainListen to anyone
};

class HttpRoutes;

struct HttpRoute {
    /// The verb it answers (405 to others); http::verb::unknown: every verb.
    http::verb verb;
    /// The path; with `subtree`, also every path below it ("/console/app.js").
    std::string_view path;
    bool subtree;
    route_access access;
    /// peer and metrics routes: the 401 text without a token, what the 403 says it takes
    /// ("a peer-role token"), and the audit event of a refusal ("" none, and not logged).
    std::string_view unauthenticated;
    std::string_view takes;
    std::string_view refusal_event;
    /// The answer; nullopt when the handler took the connection over (the upgrade).
    awaitable<std::optional<HttpResponse>> (HttpRoutes::*handler)(HttpExchange&);
};

class HttpRoutes {
public:
    HttpRoutes(Node& node, const ConsoleAssets& console, SessionSet& sessions, Drain& drain,
               Membership& membership, NodeGauges& gauges)
        : node_(node),
          console_(console),
          sessions_(sessions),
          drain_(drain),
          membership_(membership),
          gauges_(gauges) {}
    HttpRoutes(const HttpRoutes&) = delete;
    HttpRoutes& operator=(const HttpRoutes&) = delete;

    /// Reads and answers the requests of one connection until it closes, is upgraded or
    /// times out (limits.authTimeoutMs per request; the first one's from the accept).
    awaitable<void> serve(ConnStream stream, listener_kind listener, ConnectionSlot& slot);

    /// The table (immutable; docs/architecture.md lists it).
    static std::span<const HttpRoute> routes();

private:
    awaitable<std::optional<HttpResponse>> dispatch(HttpExchange& ex);
    /// The table's access check: a refusal to send, or nullopt when the request may go on.
    std::optional<HttpResponse> authorize(const HttpRoute& route, HttpExchange& ex);
    HttpResponse refuse(const HttpRoute& route, HttpExchange& ex, http::status status,
                        const std::string& why);

    awaitable<std::optional<HttpResponse>> upgrade(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> admin_drain(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> admin_decommission(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> healthz(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> readyz(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> console(HttpExchange& ex);
    awaitable<std::optional<HttpResponse>> metrics(HttpExchange& ex);

    /// Why the upgrade may not become a session (the response), or nullopt; `who` is the
    /// principal it authenticated as.
    std::optional<HttpResponse> upgrade_refusal(HttpExchange& ex, std::optional<Principal>& who);
    /// Why a peer link may not say it comes from the node it names (issue 44, item 4), or ""
    /// when it may: a token bound to a node (auth.tokens[].nodeId), or a client certificate
    /// that names DNS names (its subjectAltName), holds Sandboxd-Forwarded-By to that node, or
    /// to one of those names.
    [[nodiscard]] std::string peer_binding_refusal(
        ConnStream& stream, const Principal& who,
        const http::request<http::string_body>& req) const;
    /// Whether `who` may use this connection: a `peer` token needs, when routing.peerTls is
    /// set, a client certificate that the cluster CA verified (in the TLS handshake).
    bool peer_certified(ConnStream& stream, const Principal& who) const;

    Node& node_;
    const ConsoleAssets& console_;
    SessionSet& sessions_;
    Drain& drain_;
    Membership& membership_;
    NodeGauges& gauges_;
};

}  // namespace sandboxd
