#pragma once
// Interim bridge (branch i12-etcd only, replaced by the awaiting callers of Deliver 1): lets the
// blocking-pool lambdas of lease_service.cpp and server.cpp keep calling the now awaitable
// Registry. Never call it on an I/O thread.
#include "server/net.hpp"
#include "server/node.hpp"

#include <utility>

namespace sandboxd {

/// Runs `a` to completion and returns its result, blocking this (blocking-pool) thread. etcd
/// runs on the daemon's io_context (whose threads must be running); SQLite, whose awaitables do
/// their work inline, on a private io_context in this thread as before.
template <typename T>
T block_on(Node& node, awaitable<T> a) {
    if (node.config.registry.kind == "etcd") {
        return net::co_spawn(node.ioc->get_executor(), std::move(a), net::use_future).get();
    }
    net::io_context local;
    auto done = net::co_spawn(local, std::move(a), net::use_future);
    local.run();
    return done.get();
}

}  // namespace sandboxd
