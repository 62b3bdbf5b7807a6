#include "server/lease_methods.hpp"

#include "server/lease_service.hpp"
#include "server/method_table.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/utf8.hpp>

#include <chrono>
#include <optional>

namespace sandboxd::handlers {
namespace {

using json = nlohmann::json;

// No handler here co_awaits inside MethodReply{...}: GCC 12 frees a co_await result in an
// aggregate's braced initializer too early (heap-use-after-free under ASan), so each result
// is awaited into a local first.

/// leaseExecute's sink: leaseExecute.log {requestId: id, stream, chunk} to this host, at most
/// limits.executeOutputBytes per stream (none when the request has no id).
ExecuteLog execute_log(Connection& c, const json& id) {
    if (id.is_null()) return {};
    struct Sent {
        std::size_t bytes[2] = {0, 0};
    };
    auto sent = std::make_shared<Sent>();
    const std::size_t limit = c.node().config.limits.execute_output_bytes;
    // Called on the connection's strand (the provider's contract, and the peer link posts
    // there).
    return [weak = c.channel_sink(), id, sent, limit](std::string stream, std::string chunk) {
        auto sink = weak.lock();
        if (!sink || chunk.empty()) return;
        auto& bytes = sent->bytes[stream == "stderr" ? 1 : 0];
        if (bytes >= limit) return;  // over limits.executeOutputBytes: dropped
        if (chunk.size() > limit - bytes) {
            chunk.resize(limit - bytes);
            chunk = Utf8Text().feed(chunk);  // a character cut in two is left out
            bytes = limit;
        } else {
            bytes += chunk.size();
        }
        std::string text = jsonrpc::notification(
            "leaseExecute.log",
            {{"requestId", id}, {"stream", stream}, {"chunk", std::move(chunk)}});
        sink->send_text(std::move(text));
    };
}

}  // namespace

awaitable<std::optional<MethodReply>> at_owner(Connection& c, const MethodCall& call,
                                               const std::string& lease_id,
                                               bool orphan_if_owner_dead,
                                               std::optional<PeerLink::Notify> notify,
                                               std::chrono::milliseconds answer_within) {
    auto& node = c.node();
    Lease lease = co_await sandboxd::lease_get(node, call.caller, lease_id);
    // A retained lease is held by no node: any node serves it (and answers that it is not
    // active to everything but a release).
    const bool settled = lease.status == lease_status::released ||
                         lease.status == lease_status::failed ||
                         lease.status == lease_status::retained;
    if (lease.owner_node_id == node.node_id || settled || !c.forwarded_by().empty()) {
        co_return std::nullopt;
    }
    const std::string method(call.method);
    std::string unavailable;
    try {
        auto link = co_await owner_link(node, lease);
        json result;
        if (notify) {
            result = co_await link->call(method, call.params, forwarded_for(call.caller),
                                         std::move(*notify), answer_within);
        } else {
            result = co_await link->call(method, call.params, forwarded_for(call.caller));
        }
        co_return MethodReply{std::move(result), {}};
    } catch (const rpc_error& e) {
        if (e.code() != errc::owner_unavailable || !orphan_if_owner_dead) throw;
        unavailable = e.what();
    }
    // A dead owner cannot tear down: the lease waits for cleanup instead.
    json result = to_json(
        co_await lease_orphan(node, std::move(lease), std::move(unavailable), call.caller.name));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> initialize(Connection& c, MethodCall& /*call*/,
                                  methods::InitializeParams /*params*/) {
    auto& node = c.node();
    const auto& l = node.config.limits;
    std::vector<std::string> supported;
    for (const auto& m : method_table()) supported.emplace_back(m.name);
    co_return MethodReply{json{{"protocolVersion", 1},
                               {"nodeId", node.node_id},
                               {"supportedMethods", std::move(supported)},
                               {"limits",
                                {{"maxTextMessage", l.max_text_message},
                                 {"maxDataPayload", l.max_data_payload},
                                 {"channelsPerConnection", l.channels_per_connection},
                                 {"channelsPerNode", l.channels_per_node},
                                 {"outputWindow", l.output_window},
                                 {"stdinWindow", l.stdin_window},
                                 {"maxOutputWindow", l.max_output_window},
                                 {"maxStdinWindow", l.max_stdin_window},
                                 {"sendQueueBytesPerConnection", l.send_queue_bytes_per_connection},
                                 {"requestsPerConnection", l.requests_per_connection}}},
                               {"providers", provider_list(node)}},
                          {}};
}

awaitable<MethodReply> lease_acquire(Connection& c, MethodCall& call,
                                     methods::LeaseAcquireParams params) {
    json result =
        to_json(co_await sandboxd::lease_acquire(c.node(), call.caller, std::move(params)));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_list(Connection& c, MethodCall& call, LeaseQuery params) {
    json result = co_await sandboxd::lease_list(c.node(), call.caller, std::move(params));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> node_list(Connection& c, MethodCall& /*call*/, NoParams /*params*/) {
    json result = co_await sandboxd::node_list(c.node());
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_get(Connection& c, MethodCall& call, methods::LeaseIdParams params) {
    auto& node = c.node();
    Lease lease = co_await sandboxd::lease_get(node, call.caller, params.lease_id);
    if (lease.owner_node_id != node.node_id && lease.status == lease_status::active &&
        c.forwarded_by().empty()) {
        // The owner answers, so that `usage` is current; without it, usage is null.
        try {
            auto link = co_await owner_link(node, lease);
            json result = co_await link->call(std::string(call.method), std::move(call.params),
                                              forwarded_for(call.caller));
            co_return MethodReply{std::move(result), {}};
        } catch (const rpc_error& e) {
            if (e.code() != errc::owner_unavailable && e.code() != errc::owner_elsewhere) throw;
        }
    }
    // usage() reads the sandbox's cgroup files and statvfs: off the connection's strand.
    co_await offload(node.blocking, [&node, &lease] { attach_usage(node, lease); });
    co_return MethodReply{to_json(lease), {}};
}

awaitable<MethodReply> lease_renew(Connection& c, MethodCall& call,
                                   methods::LeaseRenewParams params) {
    if (auto owner = co_await at_owner(c, call, params.lease_id)) co_return std::move(*owner);
    json result = to_json(
        co_await sandboxd::lease_renew(c.node(), call.caller, params.lease_id, params.ttl_ms));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_release(Connection& c, MethodCall& call,
                                     methods::LeaseReleaseParams params) {
    if (auto owner = co_await at_owner(c, call, params.lease_id, true)) co_return std::move(*owner);
    json result =
        to_json(co_await sandboxd::lease_release(c.node(), call.caller, std::move(params)));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_probe(Connection& c, MethodCall& call, methods::LeaseIdParams params) {
    // The owner's provider holds the sandbox: forwarded there like a release.
    if (auto owner = co_await at_owner(c, call, params.lease_id)) co_return std::move(*owner);
    json result = co_await sandboxd::lease_probe(c.node(), call.caller, params.lease_id);
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_update_network(Connection& c, MethodCall& call,
                                            methods::LeaseUpdateNetworkParams params) {
    // The owner's provider holds the lease's network: forwarded there like a release.
    if (auto owner = co_await at_owner(c, call, params.lease_id)) co_return std::move(*owner);
    json result =
        to_json(co_await sandboxd::lease_update_network(c.node(), call.caller, std::move(params)));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_execute(Connection& c, MethodCall& call,
                                     methods::ExecuteParams params) {
    ExecuteLog log = execute_log(c, call.id);
    // The output is read only while this connection can take its log (issue 44, item 2);
    // the connection outlives the request (its session holds it while it runs).
    params.request.wait_for_room = [&c] { return c.wait_send_room(); };
    // The owner's provider holds the sandbox: forwarded there, its logs relayed back.
    PeerLink::Notify notify;
    notify.executor = c.strand();
    notify.fn = [log](json n) {
        if (!log || !n.is_object()) return;
        const json stream = n.value("stream", json());
        const json chunk = n.value("chunk", json());
        if ((stream == "stdout" || stream == "stderr") && chunk.is_string()) {
            log(stream.get<std::string>(), chunk.get<std::string>());
        }
    };
    const auto answer_within =
        std::chrono::milliseconds(params.request.timeout_ms) + std::chrono::seconds(60);
    if (auto owner =
            co_await at_owner(c, call, params.lease_id, false, std::move(notify), answer_within)) {
        co_await c.wait_send_room();
        co_return std::move(*owner);
    }
    json result =
        co_await sandboxd::lease_execute(c.node(), call.caller, std::move(params), std::move(log));
    // The result (up to limits.executeOutputBytes of each stream, 6 bytes per escaped byte
    // once serialised) is queued only when the connection has room: results of pipelined
    // executes wait here, as JSON values, not as serialised text in the queue.
    co_await c.wait_send_room();
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> lease_realize_workspace(Connection& c, MethodCall& call,
                                               methods::RealizeWorkspaceParams params) {
    if (auto owner = co_await at_owner(c, call, params.lease_id)) co_return std::move(*owner);
    json result =
        co_await sandboxd::lease_realize_workspace(c.node(), call.caller, std::move(params));
    co_return MethodReply{std::move(result), {}};
}

awaitable<MethodReply> provider_validate_config(Connection& c, MethodCall& call,
                                                methods::ValidateConfigParams params) {
    json result =
        co_await sandboxd::provider_validate_config(c.node(), call.caller, std::move(params));
    co_return MethodReply{std::move(result), {}};
}

}  // namespace sandboxd::handlers
