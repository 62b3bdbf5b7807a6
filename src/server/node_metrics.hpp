#pragma once
// The metrics of one node (GET /metrics; docs/protocol.md section 7 lists them). Names follow
// the Prometheus conventions (counters end in _total, durations in seconds); every label has
// a bounded set of values: never a lease id, a channel id or a token.
//
// Thread-safety: every family is safe to update from any thread (metrics.hpp).
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/metrics.hpp>

#include <cstddef>
#include <string>

namespace sandboxd {

/// The children of sandboxd_channel_bytes_total, resolved once (a channel counts every chunk).
struct ChannelByteCounters {
    Counter* stdin_in = nullptr;
    Counter* stdout_out = nullptr;
    Counter* stderr_out = nullptr;
    /// sandboxd_output_frames_total: output data frames by how their payload was written.
    Counter* frames_spliced = nullptr;
    Counter* frames_copied = nullptr;
    /// Counts one output frame. Thread-safe; never blocks.
    void count_frame(bool spliced) const noexcept {
        if (Counter* c = spliced ? frames_spliced : frames_copied) c->inc();
    }
    /// Adds `bytes` of `stream`. Thread-safe; never blocks.
    void count(stream_id stream, std::size_t bytes) const noexcept {
        Counter* c = stream == stream_id::stdin_    ? stdin_in
                     : stream == stream_id::stdout_ ? stdout_out
                                                    : stderr_out;
        if (c) c->inc(static_cast<double>(bytes));
    }
};

struct NodeMetrics {
    MetricRegistry registry;

    // Build and connections
    Family<Gauge>& build_info = registry.gauge(
        "sandboxd_build_info", "The running sandboxd's version (value 1).", {"version"});
    Family<Gauge>& connections = registry.gauge(
        "sandboxd_connections", "Open WebSocket connections, by the token's role.", {"role"});
    Family<Gauge>& connections_open =
        registry.gauge("sandboxd_connections_open",
                       "Accepted connections open now on every listener, authenticated or not "
                       "(limits.connections).");
    Family<Gauge>& connections_pending =
        registry.gauge("sandboxd_connections_pending",
                       "Accepted connections not yet authenticated (limits.pendingConnections).");
    Family<Gauge>& send_queue_bytes =
        registry.gauge("sandboxd_send_queue_bytes",
                       "Bytes queued toward hosts and peers that no socket has taken yet "
                       "(limits.sendQueueBytes).");
    Family<Counter>& connections_refused = registry.counter(
        "sandboxd_connections_refused_total",
        "Connections refused at accept, by the limit that refused them (connections, "
        "pendingConnections).",
        {"limit"});

    // Channels
    Family<Counter>& channel_opens = registry.counter(
        "sandboxd_channel_opens_total",
        "duplexChannelOpen requests answered, by result: ok or the error's reason.", {"result"});
    Family<Histogram>& channel_open_seconds = registry.histogram(
        "sandboxd_channel_open_seconds",
        "Time to answer a successful duplexChannelOpen, by route: local (this node owns the "
        "lease) or routed (forwarded to the owner).",
        {"route"},
        {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
    Family<Gauge>& channels_running =
        registry.gauge("sandboxd_channels_running", "Channels whose command runs on this node.");
    Family<Counter>& channel_bytes = registry.counter(
        "sandboxd_channel_bytes_total",
        "Channel payload bytes this node carried (its own channels and those it relays), by "
        "direction (in: from the host, out: to the host) and stream.",
        {"direction", "stream"});

    // Leases
    Family<Gauge>& leases =
        registry.gauge("sandboxd_leases",
                       "Leases this node owns in the registry, by status (active, pending_cleanup, "
                       "retained); read from the registry at most every 10 s.",
                       {"status"});
    Family<Counter>& lease_operations =
        registry.counter("sandboxd_lease_operations_total",
                         "Lease requests answered, by method and result: ok or the error's reason.",
                         {"method", "result"});

    // Registry
    Family<Histogram>& registry_call_seconds = registry.histogram(
        "sandboxd_registry_call_seconds", "Registry calls, by operation.", {"op"},
        {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5});
    Family<Counter>& registry_errors =
        registry.counter("sandboxd_registry_errors_total", "Registry calls that failed.");
    Family<Counter>& registry_bad_records = registry.counter(
        "sandboxd_registry_bad_records_total",
        "Lease and node records in the registry that cannot be read (not JSON, nested too deep, "
        "wrong types), each counted once per version; the leases answer REGISTRY_UNAVAILABLE.");

    // Providers
    Family<Histogram>& provider_operation_seconds = registry.histogram(
        "sandboxd_provider_operation_seconds",
        "Provider operations (create, destroy, open, stop, resume, probe, execute, ...), by "
        "provider key and operation.",
        {"provider", "op"},
        {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});
    Family<Counter>& provider_failures = registry.counter(
        "sandboxd_provider_failures_total",
        "Provider operations that failed (not counting invalid params), by provider and "
        "operation.",
        {"provider", "op"});
    Family<Gauge>& plugin_worker_up =
        registry.gauge("sandboxd_plugin_worker_up",
                       "1 while the plugin's worker is up and initialized.", {"plugin"});
    Family<Counter>& plugin_worker_restarts = registry.counter(
        "sandboxd_plugin_worker_restarts_total",
        "Times the plugin's worker was started again after it exited or was retired.", {"plugin"});

    // Peers and the node
    Family<Gauge>& peer_link_up =
        registry.gauge("sandboxd_peer_link_up",
                       "1 while this node's link to the peer node is connected.", {"peer"});
    Family<Counter>& sweeper_passes = registry.counter(
        "sandboxd_sweeper_passes_total", "Passes of the lease sweeper that completed.");
    Family<Counter>& orphans_found = registry.counter(
        "sandboxd_orphans_found_total",
        "Leases the sweeper recorded as orphaned (their owner dead or without the sandbox).");
    Family<Counter>& teardowns = registry.counter(
        "sandboxd_teardowns_total",
        "Sandbox teardowns this node ran, by outcome: done, failed (to be retried), given_up, "
        "leftover (a sandbox of an ended lease found on disk by the sweeper).",
        {"outcome"});
    Family<Gauge>& fenced = registry.gauge(
        "sandboxd_fenced",
        "1 while this node is fenced: its registry membership was not renewed within 2/3 of "
        "nodeTtlMs, so it serves no open and no lease change.");
    Family<Counter>& limit_events = registry.counter(
        "sandboxd_limit_events_total",
        "Limits that sandboxes hit: channels OOM-killed (memory), forks refused (pids).", {"kind"});
    Family<Counter>& egress_denied = registry.counter(
        "sandboxd_egress_denied_total",
        "Packets the node's network policy refused from its leases, by reason: node (the node's "
        "deny list), lease (another lease), private (a built-in range), host (the node itself), "
        "rule (a lease's deny, or mode none), allow (not in a lease's allow), spoof (not the "
        "lease's own source address).",
        {"reason"});

    Family<Counter>& output_frames = registry.counter(
        "sandboxd_output_frames_total",
        "Output data frames of this node's channels, by how the payload reached the socket: "
        "spliced (from the command's pipe, no copy through the daemon) or copied (TLS, a PTY, "
        "a plugin channel).",
        {"path"});

    /// The byte counters of every channel and relay of this node.
    const ChannelByteCounters channel_byte_counters{
        &channel_bytes.with({"in", "stdin"}), &channel_bytes.with({"out", "stdout"}),
        &channel_bytes.with({"out", "stderr"}), &output_frames.with({"spliced"}),
        &output_frames.with({"copied"})};
};

}  // namespace sandboxd
