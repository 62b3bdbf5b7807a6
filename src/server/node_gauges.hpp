#pragma once
// The node's gauges that are read rather than kept (docs/protocol.md section 8): running
// channels, queued bytes, connections, providers' limit events and workers, peer links,
// fencing (collect(), on every scrape), and the lease counts by status, read from the
// registry at most every 10 s.
//
// Threading: collect() from the scrape's thread; refresh_lease_counts() on any executor; the
// lease counts are atomics.
#include "server/listeners.hpp"
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <atomic>
#include <cstdint>

namespace sandboxd {

class NodeGauges {
public:
    NodeGauges(Node& node, const ConnectionCounts& connections)
        : node_(node), connections_(connections) {}
    NodeGauges(const NodeGauges&) = delete;
    NodeGauges& operator=(const NodeGauges&) = delete;

    /// Brings the gauges and mirrored counters up to date (MetricRegistry::on_collect).
    void collect();
    /// Reads this node's lease counts by status from the registry when the last reading is
    /// older than 10 s (sandboxd_leases); a failure keeps the last values.
    awaitable<void> refresh_lease_counts();
    /// Active leases owned here, as last read.
    [[nodiscard]] std::int64_t active_leases() const noexcept { return active_leases_.load(); }

private:
    Node& node_;
    const ConnectionCounts& connections_;
    /// When the lease counts were last read (steady ms; 0 never).
    std::atomic<std::int64_t> leases_read_ms_{0};
    std::atomic<std::int64_t> active_leases_{0};
};

}  // namespace sandboxd
