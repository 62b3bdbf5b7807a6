#pragma once
// What a Daemon (include/sandboxd/server/server.hpp) is made of, in the order it is built:
//   - node (node.hpp): the state every part shares: config, registry, providers, the
//     sandbox cache, channels, peers, metrics;
//   - ioc: the node's own event loop (membership, drain, accepts, its share of connections);
//   - listeners (listeners.hpp): the acceptors and the connection loops;
//   - routes (http_routes.hpp): the HTTP table; its upgrade route makes a Session;
//   - membership (membership.hpp): registration, heartbeat, fencing, sweeper, change feed;
//   - drain (drain.hpp); the gauges read on a scrape (node_gauges.hpp).
// server.cpp wires them (construction, start, stop); reload.cpp is Daemon::reload.
// Members are destroyed in reverse: everything that lives on `ioc` before it, the node last.
#include <sandboxd/server/server.hpp>

#include "server/console.hpp"
#include "server/drain.hpp"
#include "server/http_routes.hpp"
#include "server/listeners.hpp"
#include "server/membership.hpp"
#include "server/node.hpp"
#include "server/node_gauges.hpp"
#include "server/session_set.hpp"

#include <sandboxd/core/net.hpp>

#include <memory>
#include <string>
#include <vector>

namespace sandboxd {

struct Daemon::Impl {
    Node node;
    net::io_context ioc;
    /// The generated admin token's file, when the config names no token ("" otherwise).
    std::string token_path;
    /// The browser console's files, read at start when console.enabled (read-only after).
    ConsoleAssets console;
    SessionSet sessions;
    ConnectionCounts connections;
    Membership membership{node, ioc};
    Drain drain{node, ioc, [this] { stop(); }};
    NodeGauges gauges{node, connections};
    HttpRoutes routes{node, console, sessions, drain, membership, gauges};
    Listeners listeners{node, ioc, routes, connections};
    /// Daemon::on_tick's timers: they run until the io_context stops, through the drain.
    std::vector<std::unique_ptr<net::steady_timer>> tick_timers;

    /// Daemon::stop(): from any thread, once.
    void stop();
    /// The stop's second half, on `ioc`: every channel reaped and ended, every connection's
    /// close written, then `ioc` stops.
    awaitable<void> finish_stop();
    /// Sets up the registry, the providers and the rest of the node from node.config
    /// (Daemon's constructor).
    void build_node();
};

}  // namespace sandboxd
