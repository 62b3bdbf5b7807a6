// Detached channels after their open (issue 46, docs/protocol.md section 4.6): attaching a
// connection to one (here on the owner, or forwarded to it like an open), listing a lease's,
// and forgetting them when their exit has been kept long enough or their lease ends.
#include "server/channel_service.hpp"
#include "server/lease_methods.hpp"
#include "server/lease_service.hpp"
#include "server/params.hpp"
#include "server/strand_hop_sink.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/lease.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <spdlog/spdlog.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <system_error>

namespace sandboxd {

std::filesystem::path kept_output_root(const Node& node) {
    return std::filesystem::path(node.config.state_dir) / "kept";
}

namespace {

/// Deletes the kept output of entries that are gone from the table (their files, on the
/// blocking pool: never on an I/O thread; a host still reading one keeps its descriptors
/// until it is done).
void remove_kept(Node& node,
                 const std::vector<std::shared_ptr<const DetachedChannels::Entry>>& gone,
                 const char* why, const std::filesystem::path& then = {}) {
    std::vector<std::filesystem::path> dirs;
    for (const auto& e : gone) {
        dirs.push_back(e->output->kept().dir());
        spdlog::info("lease={} detached channel {} forgotten{}: {}", e->lease_id, e->handle,
                     e->name.empty() ? "" : " (" + e->name + ")", why);
    }
    // One task: the lease's directory (`then`) goes after its channels', never beside them
    // on another thread (two remove_all() of one tree race).
    if (!then.empty()) dirs.push_back(then);
    if (dirs.empty()) return;
    net::post(node.blocking, [dirs = std::move(dirs)] {
        for (const auto& dir : dirs) {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    });
}

}  // namespace

void detached_channel_ended(Node& node, const std::string& handle, std::uint64_t retain_ms,
                            std::int64_t ended_at_ms) {
    const std::int64_t now = now_ms();
    const std::int64_t at = ended_at_ms > 0 ? std::min(ended_at_ms, now) : now;
    remove_kept(node,
                node.detached.ended(handle, at, node.config.limits.detach_kept_exits_per_lease),
                "its lease keeps limits.detachKeptExitsPerLease ended channels");
    const auto kept_for = static_cast<std::uint64_t>(now - at);
    auto timer = std::make_shared<net::steady_timer>(*node.ioc);
    timer->expires_after(
        std::chrono::milliseconds(retain_ms > kept_for ? retain_ms - kept_for : 0));
    timer->async_wait([&node, timer](const boost::system::error_code& ec) {
        if (!ec) remove_kept(node, node.detached.expire(now_ms()), "its retainMs passed");
    });
}

std::uint64_t track_detached(Node& node, const std::shared_ptr<Channel>& channel,
                             const strand_t& strand, const std::string& lease_id,
                             const std::string& handle, std::uint64_t retain_ms, bool kept) {
    const auto key = node.channels.add({channel, strand, lease_id, kept});
    channel->set_on_reaped([&node, key, handle, retain_ms] {
        node.channels.remove(key);
        detached_channel_ended(node, handle, retain_ms);
    });
    channel->set_audit_key(key);
    return key;
}

void forget_detached_channels(Node& node, const std::string& lease_id) {
    remove_kept(node, node.detached.expire(now_ms(), lease_id), "its lease ended",
                kept_output_root(node) / lease_id);
}

}  // namespace sandboxd

namespace sandboxd::handlers {
namespace {

using json = nlohmann::json;
using Entry = DetachedChannels::Entry;

/// What an attach did on the channel's strand.
struct AttachDone {
    DetachedOutput::AttachResult attached;
    std::uint64_t stdin_window = 0;  ///< what the host may send before credit comes back
    bool running = false;
};

/// The attach itself, on the channel's strand: `hop` reaches the host's connection.
awaitable<AttachDone> attach_there(std::shared_ptr<const Entry> entry,
                                   std::shared_ptr<ChannelSink> hop, std::uint32_t id,
                                   std::uint32_t window,
                                   std::optional<DetachedOutput::Offsets> from, bool takeover,
                                   std::optional<std::pair<std::uint16_t, std::uint16_t>> resize) {
    AttachDone done;
    auto& channel = *entry->channel;
    done.attached = entry->output->attach(hop, id, window, from, takeover, true);
    done.running = !channel.finished();
    const auto stdin_window = channel.options().stdin_window;
    done.stdin_window =
        stdin_window - std::min<std::uint64_t>(channel.stdin_pending(), stdin_window);
    if (resize && done.running) {
        try {
            channel.resize(resize->first, resize->second);
        } catch (const rpc_error& e) {
            spdlog::debug("detached channel {}: resize on attach: {}", entry->handle, e.what());
        }
    }
    co_return done;
}

/// The entry of the lease's detached channel that `p` names, else CHANNEL_NOT_FOUND.
std::shared_ptr<const Entry> named_entry(Node& node, const Lease& lease,
                                         const methods::AttachParams& p) {
    auto entry =
        p.handle.empty() ? node.detached.find(lease.id, p.name) : node.detached.find(p.handle);
    if (!entry || entry->lease_id != lease.id) {
        const std::string what =
            p.handle.empty() ? "named \"" + p.name + "\"" : "with handle " + p.handle;
        throw rpc_error(errc::channel_not_found,
                        "lease " + lease.id + " has no detached channel " + what +
                            " (it never was, or its exit is no longer kept)",
                        {{"leaseId", lease.id}});
    }
    return entry;
}

/// Attach on the owner (protocol section 4.6).
awaitable<MethodReply> attach_local(Connection& c, methods::AttachParams p, Lease lease,
                                    Principal caller) {
    auto& node = c.node();
    auto entry = named_entry(node, lease, p);
    if (p.resize && !entry->pty) params::invalid("resize", "the channel has no PTY");
    const auto window = p.output_window.value_or(node.config.limits.output_window);
    std::optional<DetachedOutput::Offsets> from;
    if (p.offsets)
        from = DetachedOutput::Offsets{p.offsets->stdout_offset, p.offsets->stderr_offset};
    const std::uint32_t id = c.mux().next_id();
    auto hop = std::make_shared<StrandHopSink>(c.strand(), c.channel_sink());
    const strand_t strand = *entry->strand;
    // Made in a statement of its own: no temporary with a destructor in a co_await
    // expression (GCC 12, see channel_service.cpp).
    auto attaching = attach_there(entry, hop, id, window, from, p.takeover, p.resize);
    const AttachDone done = co_await net::co_spawn(strand, std::move(attaching), use_awaitable);
    const auto attachment = done.attached.id;
    if (c.closing()) {
        net::post(strand, [out = entry->output, attachment] { out->detach(attachment); });
        co_return MethodReply{json::object(), {}};
    }
    ChannelMux::Attached attached;
    attached.handle = entry->handle;
    attached.channel = entry->channel;
    attached.output = entry->output;
    attached.strand = strand;
    attached.attachment = attachment;
    attached.sink = std::move(hop);
    attached.opened_for = caller.name;
    c.mux().add_attached(id, std::move(attached));
    spdlog::info(
        "lease={} detached channel {} attached as connection channel {} from {}/{} peer={}",
        lease.id, entry->handle, id, done.attached.from.stdout_offset,
        done.attached.from.stderr_offset, c.peer());
    json result = {{"channel", id},
                   {"handle", entry->handle},
                   {"leaseId", lease.id},
                   {"ownerNodeId", node.node_id},
                   {"routed", false},
                   {"pty", entry->pty},
                   {"state", done.running ? "running" : "exited"},
                   {"offsets",
                    {{"stdout", done.attached.from.stdout_offset},
                     {"stderr", done.attached.from.stderr_offset}}},
                   {"stdinWindow", done.stdin_window},
                   {"outputWindow", window}};
    if (!entry->name.empty()) result["name"] = entry->name;
    // The kept bytes follow the result.
    co_return MethodReply{std::move(result), [strand, out = entry->output, attachment] {
                              net::post(strand, [out, attachment] { out->release(attachment); });
                          }};
}

/// One entry of duplexChannelList, read on the channel's strand.
awaitable<json> describe(std::shared_ptr<const Entry> e) {
    const auto& kept = e->output->kept();
    json item = {
        {"handle", e->handle},
        {"name", e->name.empty() ? json() : json(e->name)},
        {"command", e->argv0},
        {"pty", e->pty},
        {"state", e->ended_at_ms ? "exited" : "running"},
        {"attached", e->output->attached()},
        {"startedAt", format_rfc3339(e->started_at_ms)},
        {"offsets",
         {{"stdout", kept.end(output_stream::out)}, {"stderr", kept.end(output_stream::err)}}},
        {"firstKept",
         {{"stdout", kept.first_kept(output_stream::out)},
          {"stderr", kept.first_kept(output_stream::err)}}},
        {"retainBytes", kept.capacity()},
        {"retainMs", e->retain_ms}};
    json exit = e->output->exit();
    if (!exit.is_null()) {
        exit.erase("channel");
        item["exit"] = std::move(exit);
    } else {
        item["exit"] = nullptr;
    }
    item["endedAt"] = e->ended_at_ms ? json(format_rfc3339(*e->ended_at_ms)) : json();
    co_return item;
}

}  // namespace

awaitable<MethodReply> channel_attach(Connection& c, MethodCall& call,
                                      methods::AttachParams params) {
    auto& node = c.node();
    // The tenant check: another tenant's lease is LEASE_NOT_FOUND, like a missing one.
    Lease lease = co_await sandboxd::lease_get(node, call.caller, params.lease_id);
    auto& mux = c.mux();
    const auto limit = node.config.limits.channels_per_connection;
    if (mux.count() >= limit) {
        throw rpc_error(errc::channel_limit, "this connection already has " +
                                                 std::to_string(mux.count()) + " channels (limit " +
                                                 std::to_string(limit) + ")");
    }
    mux.reserve();
    const ScopeExit release([&mux] { mux.release(); });
    if (lease.owner_node_id != node.node_id) {
        co_return co_await open_relayed(c, std::move(call.params), std::move(lease),
                                        std::move(call.caller), "duplexChannelAttach");
    }
    co_return co_await attach_local(c, std::move(params), std::move(lease), std::move(call.caller));
}

awaitable<MethodReply> channel_list(Connection& c, MethodCall& call,
                                    methods::LeaseIdParams params) {
    if (auto owner = co_await at_owner(c, call, params.lease_id)) co_return std::move(*owner);
    auto& node = c.node();
    const Lease lease = co_await sandboxd::lease_get(node, call.caller, params.lease_id);
    json channels = json::array();
    for (auto& e : node.detached.of_lease(lease.id)) {
        auto describing = describe(e);
        json item = co_await net::co_spawn(*e->strand, std::move(describing), use_awaitable);
        channels.push_back(std::move(item));
    }
    json result = {{"leaseId", lease.id}, {"channels", std::move(channels)}};
    co_return MethodReply{std::move(result), {}};
}

}  // namespace sandboxd::handlers
