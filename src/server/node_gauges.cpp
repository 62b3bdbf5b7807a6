#include "server/node_gauges.hpp"

#include <spdlog/spdlog.h>

namespace sandboxd {

void NodeGauges::collect() {
    auto& m = node_.metrics;
    m.channels_running.only().set(static_cast<double>(node_.channels.size()));
    m.send_queue_bytes.only().set(static_cast<double>(node_.send_budget->queued()));
    m.connections_open.only().set(static_cast<double>(connections_.open.load()));
    m.connections_pending.only().set(static_cast<double>(connections_.pending.load()));
    LimitEvents limit_events;
    for (const auto& [key, provider] : node_.providers) {
        const auto e = provider->limit_events();
        limit_events.memory += e.memory;
        limit_events.pids += e.pids;
        for (const auto& [reason, packets] : provider->egress_denied()) {
            m.egress_denied.with({reason}).advance_to(static_cast<double>(packets));
        }
        if (const auto worker = provider->worker_status()) {
            const auto& plugin = provider->plugin_id();
            m.plugin_worker_up.with({plugin}).set(worker->up ? 1 : 0);
            m.plugin_worker_restarts.with({plugin}).advance_to(
                static_cast<double>(worker->restarts));
        }
    }
    m.limit_events.with({"memory"}).advance_to(static_cast<double>(limit_events.memory));
    m.limit_events.with({"pids"}).advance_to(static_cast<double>(limit_events.pids));
    for (const auto& [peer, up] : node_.peers.states()) m.peer_link_up.with({peer}).set(up ? 1 : 0);
    m.fenced.only().set(node_.fenced_for_ms() != 0 ? 1 : 0);
}

awaitable<void> NodeGauges::refresh_lease_counts() {
    const auto now = steady_now_ms();
    const auto last = leases_read_ms_.load();
    if (last != 0 && now - last < 10000) co_return;
    leases_read_ms_ = now;
    try {
        for (const auto status :
             {lease_status::active, lease_status::pending_cleanup, lease_status::retained}) {
            LeaseQuery q;
            q.owner_node_id = node_.node_id;
            q.status = status;
            q.limit = 1000;
            std::int64_t count = 0;
            for (;;) {
                auto page = co_await node_.registry->list_leases(q);
                count += static_cast<std::int64_t>(page.leases.size());
                if (page.next_cursor.empty()) break;
                q.cursor = std::move(page.next_cursor);
            }
            node_.metrics.leases.with({to_string(status)}).set(static_cast<double>(count));
            if (status == lease_status::active) active_leases_ = count;
        }
    } catch (const std::exception& e) {
        spdlog::warn("node={} metrics: cannot read the lease counts: {}", node_.node_id, e.what());
    }
}

}  // namespace sandboxd
