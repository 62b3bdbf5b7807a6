#include "server/channel_service.hpp"
#include "server/kept_channels.hpp"

#include "server/audit.hpp"
#include "server/channel.hpp"
#include "server/lease_service.hpp"
#include "server/strand_hop_sink.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <spdlog/spdlog.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <exception>
#include <filesystem>
#include <utility>

namespace sandboxd::handlers {
namespace {

using json = nlohmann::json;

MethodReply empty_result() { return {json::object(), {}}; }

/// SHA-256 (hex) of the JSON array of `argv`: the audit names a command without its arguments.
std::string argv_digest(const std::vector<std::string>& argv) {
    const auto digest = token_hash(json(argv).dump());
    static constexpr char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(digest.size() * 2);
    for (const unsigned char b : digest) {
        out.push_back(hex[b >> 4]);
        out.push_back(hex[b & 15]);
    }
    return out;
}

/// The local channel `id` of this connection, when `caller` opened it (on a peer link, one
/// connection carries the channels of many hosts), else CHANNEL_NOT_FOUND.
std::shared_ptr<Channel> local_channel(Connection& c, std::uint32_t id, const Principal& caller) {
    auto channel = c.mux().local(id);
    if (c.principal().role == "peer" && channel->options().opened_for != caller.name) {
        throw rpc_error(errc::channel_not_found,
                        "channel " + std::to_string(id) + " is not open on this connection",
                        {{"channel", id}});
    }
    return channel;
}

/// The channel's options from the open's params, the node's limits and the lease.
ChannelOptions channel_options(Node& node, const methods::OpenParams& params, const Lease& lease,
                               const Principal& caller) {
    const auto& limits = node.config.limits;
    ChannelOptions options;
    options.host_route_id = params.host_route_id;
    options.timeout = params.timeout;
    options.output_window = params.output_window.value_or(limits.output_window);
    options.base64 = params.base64;
    options.pty = params.spec.pty.has_value();
    options.stdin_attached = params.spec.stdin_attached;
    options.stdin_window = params.stdin_window.value_or(limits.stdin_window);
    options.hangup_grace = std::chrono::milliseconds(limits.hangup_grace_ms);
    options.audit = node.audit;
    options.opened_for = caller.name;
    options.argv0 = params.spec.argv.front();
    options.argv_sha256 = argv_digest(params.spec.argv);
    options.epoch = lease.epoch;
    options.lease_id = lease.id;
    options.unended = &node.channels_unended;
    options.bytes = &node.metrics.channel_byte_counters;
    return options;
}

/// The command, started by the lease's provider before this node may fence itself, or not at
/// all: a node frozen from here on (SIGSTOP, a stalled VM) cannot start a command once another
/// node may take the lease. A start refused for its deadline is tried again (at most twice)
/// with the later deadline of a renewal since, when the membership held without a break: a
/// long queue of opens at one sandbox under load is not a fenced node. Sets `start_deadline`
/// to the deadline it started under; on failure the node's channel slot is given back.
awaitable<std::unique_ptr<ChannelBackend>> start_command(Node& node, const Lease& lease,
                                                         std::shared_ptr<SandboxHandle> sandbox,
                                                         const ExecSpec& base,
                                                         std::int64_t& start_deadline) {
    const std::uint64_t breaks = node.membership_breaks.load(std::memory_order_acquire);
    start_deadline = node.fence_deadline_ms();
    std::exception_ptr failed;
    std::string unresumable;  // the provider lost the sandbox and could not resume it
    for (int attempt = 1;; ++attempt) {
        ExecSpec spec = base;
        spec.start_deadline_ms = start_deadline;
        try {
            co_return co_await node.providers.at(lease.provider)->open(sandbox, std::move(spec));
        } catch (const start_deadline_passed&) {
            if (attempt < 3 && node.may_retry_start(start_deadline, breaks)) {
                spdlog::info(
                    "lease={} open: its start deadline passed in the sandbox's queue; "
                    "again with the renewed one (attempt {})",
                    lease.id, attempt + 1);
                start_deadline = node.fence_deadline_ms();
                continue;
            }
            failed = std::current_exception();
        } catch (const rpc_error& e) {
            failed = std::current_exception();
            if (e.code() == errc::sandbox_not_cached) unresumable = e.what();
        } catch (...) {
            failed = std::current_exception();
        }
        break;
    }
    node.channels.unreserve();
    if (!unresumable.empty()) co_await forget_unresumable(node, lease, unresumable);
    std::rethrow_exception(failed);
}

/// The node's record of a detached channel about to start.
DetachedChannels::Entry detached_entry(const std::string& handle, const Lease& lease,
                                       const methods::OpenParams& params,
                                       const ChannelOptions& options, const strand_t& strand,
                                       std::shared_ptr<Channel> channel,
                                       std::shared_ptr<DetachedOutput> output) {
    DetachedChannels::Entry entry;
    entry.handle = handle;
    entry.lease_id = lease.id;
    entry.name = params.name;
    entry.argv0 = options.argv0;
    entry.pty = options.pty;
    entry.started_at_ms = now_ms();
    entry.retain_ms = params.detach->retain_ms;
    entry.kept_bytes = 2 * params.detach->retain_bytes;
    entry.strand = strand;
    entry.channel = std::move(channel);
    entry.output = std::move(output);
    return entry;
}

/// The audit line of a channel that started (`handle`: a detached channel's, else "").
void audit_opened(Node& node, const Lease& lease, std::uint64_t key, const Principal& caller,
                  const ChannelOptions& options, std::int64_t start_deadline,
                  const std::string& handle) {
    if (!node.audit) return;
    json line = {
        {"lease", lease.id},
        {"epoch", lease.epoch},
        {"channel", key},
        {"token", caller.name},
        {"argv0", options.argv0},
        {"argvSha256", options.argv_sha256},
        {"pty", options.pty},
        {"startDeadline", rfc3339_at(std::chrono::system_clock::now() +
                                     std::chrono::milliseconds(start_deadline - steady_now_ms()))}};
    if (!handle.empty()) line["detached"] = handle;
    node.audit->write("channel.opened", std::move(line));
}

/// A detached channel's kept output, made before its command starts (its files on the
/// blocking pool, never on an I/O thread): a full disk or a lease over its budget refuses the
/// open before anything runs (the channel slot is given back).
awaitable<std::shared_ptr<DetachedOutput>> kept_output_for(Node& node, const Lease& lease,
                                                           const methods::OpenParams& params,
                                                           const std::string& handle,
                                                           const strand_t& strand, json record) {
    bool made = false;
    const ScopeExit unreserve([&node, &made] {
        if (!made) node.channels.unreserve();
    });
    node.detached.check_new(lease.id, params.name, 2 * params.detach->retain_bytes,
                            node.config.limits.detach_kept_bytes_per_lease);
    // Named first: no closure with a destructor inside a co_await expression (GCC 12).
    auto make_files = [dir = kept_output_root(node) / lease.id / handle,
                       capacity = params.detach->retain_bytes, record = std::move(record)] {
        std::error_code ec;
        std::filesystem::create_directories(dir.parent_path(), ec);
        auto kept = KeptOutput::create(dir, capacity);
        if (!record.is_null()) {
            try {
                write_kept_record(dir, record);
            } catch (...) {
                kept->remove();
                throw;
            }
        }
        return kept;
    };
    auto kept = co_await offload(node.blocking, std::move(make_files));
    made = true;
    co_return std::make_shared<DetachedOutput>(strand, std::move(kept));
}

/// A detached channel (issue 46): on a strand of its own, its output kept by a DetachedOutput
/// in <stateDir>/kept/<lease>/<handle>, this connection its first attachment (from offset 0).
/// Its command outlives the connection; the node's table keeps it.
awaitable<MethodReply> open_detached(Connection& c, methods::OpenParams params, Lease lease,
                                     Principal caller, std::shared_ptr<SandboxHandle> sandbox) {
    auto& node = c.node();
    auto options = channel_options(node, params, lease, caller);
    params.spec.drain_grace_ms = node.config.limits.drain_grace_ms;
    options.release_backend_at_end = true;  // its Channel is kept with its exit
    const strand_t strand = net::make_strand(*node.ioc);
    const std::string handle = DetachedChannels::make_handle();
    // A provider whose sandboxes outlive this process keeps the channel too (issue 47): its
    // record goes beside its kept output, for the next process.
    const bool kept = node.providers.at(lease.provider)->outlives_daemon();
    json record;
    if (kept) {
        params.spec.keep_key = handle;
        record = kept_channel_record(handle, params, options);
    }
    auto making = kept_output_for(node, lease, params, handle, strand, std::move(record));
    auto output = co_await std::move(making);
    if (kept) output->persist_exit();
    ScopeExit forget_output([&output] {
        if (output) output->remove_kept();  // the open failed: nothing is kept
    });
    std::int64_t start_deadline = 0;
    // The backend is bound to the strand it is opened on: the channel's. The coroutine is made
    // in a statement of its own: no temporary with a destructor in a co_await expression (a
    // capturing coroutine lambda under co_await co_spawn lost a shared_ptr under GCC 12).
    auto starting = start_command(node, lease, sandbox, params.spec, start_deadline);
    auto backend = co_await net::co_spawn(strand, std::move(starting), use_awaitable);
    options.id = c.mux().next_id();
    auto channel = std::make_shared<Channel>(strand, options, std::move(backend), sandbox, output);
    output->bind(channel);
    if (params.detach->hangup_after) output->hang_up_when_idle(*params.detach->hangup_after);
    try {
        // Refuses a name taken meanwhile (or a budget spent meanwhile).
        node.detached.add(detached_entry(handle, lease, params, options, strand, channel, output),
                          node.config.limits.detach_kept_bytes_per_lease);
    } catch (...) {
        node.channels.unreserve();  // the channel, destroyed unstarted, ends the command
        throw;
    }
    const auto key =
        track_detached(node, channel, strand, lease.id, handle, params.detach->retain_ms, kept);
    audit_opened(node, lease, key, caller, options, start_deadline, handle);
    // This connection is the first attachment, made here off the channel's strand: nothing
    // else uses the output before the channel starts (after the result).
    auto hop = std::make_shared<StrandHopSink>(c.strand(), c.channel_sink());
    ChannelMux::Attached attachment;
    attachment.attachment =
        output->attach(hop, options.id, options.output_window, DetachedOutput::Offsets{0, 0}).id;
    attachment.handle = handle;
    attachment.channel = channel;
    attachment.output = std::exchange(output, nullptr);  // kept from here on
    attachment.strand = strand;
    attachment.sink = std::move(hop);
    attachment.opened_for = caller.name;
    c.mux().add_attached(options.id, std::move(attachment));
    spdlog::info(
        "channel={} lease={} opened detached as {}: {} pty={} peer={} (connection channel {})", key,
        lease.id, handle, options.argv0, options.pty, c.peer(), options.id);
    json result = {{"channel", options.id},
                   {"handle", handle},
                   {"hostRouteId", options.host_route_id},
                   {"ownerNodeId", node.node_id},
                   {"routed", false},
                   {"stdinWindow", options.stdin_window},
                   {"outputWindow", options.output_window}};
    if (!params.name.empty()) result["name"] = params.name;
    co_return MethodReply{std::move(result), [channel, strand] {
                              net::post(strand, [channel] { channel->start(); });
                          }};
}

/// Step 6: this node owns the lease; its cache must hold the sandbox (or its provider resume
/// it). The channel starts right after the open's result is queued.
awaitable<MethodReply> open_local(Connection& c, methods::OpenParams params, Lease lease,
                                  Principal caller) {
    auto& node = c.node();
    auto sandbox = co_await sandbox_for(node, lease);
    const auto& limits = node.config.limits;
    if (!node.channels.try_reserve(limits.channels_per_node)) {
        throw rpc_error(errc::channel_limit, "this node already runs its limit of " +
                                                 std::to_string(limits.channels_per_node) +
                                                 " channels");
    }
    if (params.detach) {
        co_return co_await open_detached(c, std::move(params), std::move(lease), std::move(caller),
                                         std::move(sandbox));
    }
    auto options = channel_options(node, params, lease, caller);
    params.spec.drain_grace_ms = limits.drain_grace_ms;
    std::int64_t start_deadline = 0;
    auto backend = co_await start_command(node, lease, sandbox, params.spec, start_deadline);
    options.id = c.mux().next_id();
    auto channel = std::make_shared<Channel>(c.strand(), options, std::move(backend), sandbox,
                                             c.channel_sink());
    ChannelTable::Entry entry;
    entry.channel = channel;
    entry.strand = c.strand();
    entry.lease_id = lease.id;
    auto key = node.channels.add(std::move(entry));
    // on_reaped is set after add() so the key is known; it runs on this strand.
    channel->set_on_reaped([&node, key] { node.channels.remove(key); });
    channel->set_audit_key(key);
    audit_opened(node, lease, key, caller, options, start_deadline, "");
    if (c.closing()) {
        // The host left while the command started: it is hung up at once, as on a drop.
        channel->start();
        channel->hangup();
        co_return MethodReply{json::object(), {}};
    }
    c.mux().add_local(options.id, channel);
    spdlog::info("channel={} lease={} opened: {} pty={} peer={} (connection channel {})", key,
                 options.lease_id, options.argv0, options.pty, c.peer(), options.id);
    // The result goes out before the first data frame of the channel.
    co_return MethodReply{json{{"channel", options.id},
                               {"hostRouteId", options.host_route_id},
                               {"workerSessionId", node.node_id + "/" + std::to_string(options.id)},
                               {"ownerNodeId", node.node_id},
                               {"routed", false},
                               {"stdinWindow", options.stdin_window},
                               {"outputWindow", options.output_window}},
                          [channel] { channel->start(); }};
}

}  // namespace

awaitable<MethodReply> open_relayed(Connection& c, json p, Lease lease, Principal caller,
                                    std::string method) {
    auto& node = c.node();
    auto& mux = c.mux();
    if (!c.forwarded_by().empty()) {
        throw rpc_error(errc::routing_loop,
                        "Sandbox lease " + lease.id + " is owned by node " + lease.owner_node_id +
                            ", not by node " + node.node_id +
                            ", and this open was already forwarded by node " + c.forwarded_by() +
                            ".",
                        {{"ownerNodeId", lease.owner_node_id}, {"forwardedBy", c.forwarded_by()}});
    }
    auto link = co_await owner_link(node, lease);
    const std::uint32_t local = mux.next_id();
    mux.opening(local);  // frames that overtake the open's result wait there
    json result;
    try {
        result = co_await link->open(std::move(method), std::move(p), forwarded_for(caller),
                                     c.relay_target(), local);
    } catch (...) {
        mux.open_failed(local);
        throw;
    }
    ChannelMux::Relayed route;
    route.link = link;
    route.remote_id = result.value("channel", 0U);
    route.forwarded_for = forwarded_for(caller);
    route.stdin_window = result.value("stdinWindow", std::uint64_t{0});
    if (c.closing()) {
        // The host left while the owner opened: nobody will read it.
        mux.open_failed(local);
        link->close_channel(route.remote_id, route.forwarded_for);
        link->forget(route.remote_id);
        co_return MethodReply{json::object(), {}};
    }
    spdlog::info("channel={}/{} lease={} forwarded to node={} (connection channel {}) peer={}",
                 lease.owner_node_id, route.remote_id, lease.id, lease.owner_node_id, local,
                 c.peer());
    result["channel"] = local;
    result["routed"] = true;
    // The frames that overtook the result go out right after it.
    co_return MethodReply{std::move(result), [&mux, local, route = std::move(route)]() mutable {
                              mux.opened(local, std::move(route));
                          }};
}

// docs/protocol.md section 3: the fail-closed checks, in order. Step 1 (the shape of the
// params) was the method table's parse.
awaitable<MethodReply> channel_open(Connection& c, MethodCall& call, methods::OpenParams params) {
    auto& node = c.node();
    // A draining node opens nothing, here or relayed: its connections end with the drain.
    // Counted first, then checked: a drain that begins meanwhile waits for this open.
    node.opens_in_flight.fetch_add(1);
    const ScopeExit counted([&node] { node.opens_in_flight.fetch_sub(1); });
    if (node.draining) {
        throw rpc_error(errc::owner_unavailable,
                        "node " + node.node_id + " is draining: it opens no new channels",
                        {{"nodeId", node.node_id}, {"draining", true}});
    }
    // Steps 2-4: the lease, its scope and status.
    Lease lease = co_await resolve_lease(node, call.caller, std::move(params.lease));
    auto& mux = c.mux();
    const auto limit = node.config.limits.channels_per_connection;
    if (mux.count() >= limit) {
        throw rpc_error(errc::channel_limit, "this connection already has " +
                                                 std::to_string(mux.local_count()) +
                                                 " channels (limit " + std::to_string(limit) + ")");
    }
    // The slot is held while the open runs, so concurrent opens cannot overshoot the limit.
    mux.reserve();
    const ScopeExit release([&mux] { mux.release(); });
    // Step 5: another owner. A forwarded open is never forwarded again.
    if (lease.owner_node_id != node.node_id) {
        // The owner compares the epoch this node routed on with its own reading (fencing).
        auto& lease_param = call.params["lease"];
        if (!lease_param.contains("epoch")) lease_param["epoch"] = lease.epoch;
        co_return co_await open_relayed(c, std::move(call.params), std::move(lease),
                                        std::move(call.caller), "duplexChannelOpen");
    }
    co_return co_await open_local(c, std::move(params), std::move(lease), std::move(call.caller));
}

namespace {

/// Runs `fn` on `channel` (a coroutine of its own, spawned on the channel's strand).
template <typename F>
awaitable<void> run_on_channel(std::shared_ptr<Channel> channel, F fn) {
    fn(*channel);
    co_return;
}

/// Runs `fn(channel)` on channel `id` of this connection: here for a local channel, on its
/// strand for a detached channel attached here (its errors come back to the caller).
template <typename F>
awaitable<void> with_channel(Connection& c, std::uint32_t id, const Principal& caller, F fn) {
    if (const auto* a = c.mux().attached(id)) {
        if (c.principal().role == "peer" && a->opened_for != caller.name) {
            throw rpc_error(errc::channel_not_found,
                            "channel " + std::to_string(id) + " is not open on this connection",
                            {{"channel", id}});
        }
        auto task = run_on_channel(a->channel, std::move(fn));
        co_await net::co_spawn(a->strand, std::move(task), use_awaitable);
        co_return;
    }
    fn(*local_channel(c, id, caller));
}

}  // namespace

awaitable<MethodReply> channel_write(Connection& c, MethodCall& call, methods::WriteParams params) {
    // Named, not a temporary of the co_await expression (GCC 12, see open_detached).
    auto write = [data = std::move(params.data)](Channel& ch) { ch.write_stdin(data); };
    co_await with_channel(c, params.channel, call.caller, std::move(write));
    co_return empty_result();
}

awaitable<MethodReply> channel_close_stdin(Connection& c, MethodCall& call,
                                           methods::ChannelParams params) {
    auto close = [](Channel& ch) { ch.close_stdin(); };
    co_await with_channel(c, params.channel, call.caller, close);
    co_return empty_result();
}

awaitable<MethodReply> channel_resize(Connection& c, MethodCall& call,
                                      methods::ResizeParams params) {
    auto resize = [cols = params.cols, rows = params.rows](Channel& ch) { ch.resize(cols, rows); };
    co_await with_channel(c, params.channel, call.caller, resize);
    co_return empty_result();
}

awaitable<MethodReply> channel_signal(Connection& c, MethodCall& call,
                                      methods::SignalParams params) {
    auto signal = [sig = params.signal](Channel& ch) { ch.send_signal(sig); };
    co_await with_channel(c, params.channel, call.caller, signal);
    co_return empty_result();
}

awaitable<MethodReply> channel_stop(Connection& c, MethodCall& call,
                                    methods::ChannelParams params) {
    auto stop = [](Channel& ch) { ch.stop(channel_outcome::stopped); };
    co_await with_channel(c, params.channel, call.caller, stop);
    co_return empty_result();
}

awaitable<MethodReply> channel_close(Connection& c, MethodCall& call,
                                     methods::ChannelParams params) {
    auto& mux = c.mux();
    if (mux.attached(params.channel) != nullptr) {
        // A detached channel: this connection lets go of it; the command goes on.
        auto check = [](Channel&) {};  // only the peer-link check of with_channel
        co_await with_channel(c, params.channel, call.caller, check);
        if (auto gone = mux.take_attached(params.channel)) {
            net::post(gone->strand,
                      [out = gone->output, id = gone->attachment] { out->detach(id); });
        }
        co_return empty_result();
    }
    // On a peer link, another host's channel is refused (local_channel() says why).
    if (mux.find_local(params.channel)) local_channel(c, params.channel, call.caller);
    if (auto channel = mux.take_local(params.channel)) {
        channel->hangup(channel_outcome::stopped);  // stop and forget: no exit follows
    }
    co_return empty_result();
}

}  // namespace sandboxd::handlers
