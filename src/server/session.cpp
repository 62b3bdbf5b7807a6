#include "server/session.hpp"

#include "server/audit.hpp"
#include "server/lease_service.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/core/utf8.hpp>
#include <sandboxd/version.hpp>

#include <boost/asio/experimental/awaitable_operators.hpp>
#include <spdlog/spdlog.h>

namespace sandboxd {
namespace {

using json = nlohmann::json;
using namespace net::experimental::awaitable_operators;

Session::Reply empty_result() { return {json::object(), {}}; }

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

// Handlers below never co_await inside Reply{...}: GCC 12 frees a co_await result in an
// aggregate's braced initializer too early (heap-use-after-free under ASan), so each result
// is awaited into a local first.

void log_task_failure(const std::string& peer, const std::exception_ptr& e) {
    if (!e) return;
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& ex) {
        spdlog::error("peer={} session task failed: {}", peer, ex.what());
    }
}

}  // namespace

Session::Session(Node& node, ConnStream stream, Principal who)
    : node_(node),
      transport_(std::move(stream), node.config.limits, node.send_budget.get(), who.role == "peer"),
      who_(std::move(who)),
      strand_(transport_.strand()),
      slot_free_(strand_),
      peer_(transport_.peer()),
      mux_(*this, node.config.limits.max_data_payload, peer_,
           &node.metrics.channel_byte_counters, &node.relays_open) {
    slot_free_.expires_at(net::steady_timer::time_point::max());
    transport_.on_written([this] {
        if (!room_waiters_.empty()) check_send_room();
    });
}

void Session::when_send_room(std::function<void()> resume) {
    room_waiters_.push_back(std::move(resume));
    check_send_room();
}

void Session::check_send_room() {
    if (room_waiters_.empty()) return;
    if (transport_.has_room()) {
        auto woken = std::exchange(room_waiters_, {});
        for (auto& w : woken) net::post(strand_, std::move(w));
        return;
    }
    // Held by the node's budget (other connections' queues), not its own: woken when any
    // connection's writes bring the node under it. Its own writes wake it through on_written.
    if (transport_.held_by_node() && !node_wake_armed_) {
        node_wake_armed_ = true;
        node_.send_budget->when_node_has_room([weak = weak_from_this(), strand = strand_] {
            net::post(strand, [weak] {
                if (auto self = weak.lock()) {
                    self->node_wake_armed_ = false;
                    self->check_send_room();
                }
            });
        });
    }
}

awaitable<void> Session::wait_send_room() {
    while (!transport_.has_room()) {
        // The timer is shared with the wake, which may come after this frame is gone (the
        // request cancelled): it then finds nothing to cancel.
        auto woken = std::make_shared<net::steady_timer>(strand_, net::steady_timer::time_point::max());
        when_send_room([weak = std::weak_ptr<net::steady_timer>(woken)] {
            if (auto t = weak.lock()) t->cancel();
        });
        co_await woken->async_wait(as_tuple_awaitable);
        auto cs = co_await net::this_coro::cancellation_state;
        if (cs.cancelled() != net::cancellation_type::none) co_return;
    }
}

Session::~Session() = default;

awaitable<void> Session::run(http::request<http::string_body> request) {
    auto self = shared_from_this();
    if (who_.role == "peer") forwarded_by_ = std::string(request["Sandboxd-Forwarded-By"]);
    if (!co_await transport_.accept(request)) co_return;
    auto& connections = node_.metrics.connections.with({who_.role});
    connections.add(1);
    const ScopeExit counted([&connections] { connections.add(-1); });
    spdlog::info("peer={} connected as token \"{}\"", peer_, who_.name);
    if (node_.audit) {
        node_.audit->write("connection.accepted",
                           {{"peer", peer_}, {"token", who_.name}, {"role", who_.role}});
    }
    co_await transport_.serve(*this);
    mux_.close_all();
    spdlog::info("peer={} disconnected", peer_);
}

awaitable<void> Session::on_text(std::string_view text) {
    // A peer node's link carries every channel it forwards here: it waits for a free slot
    // rather than have its hosts' requests refused for each other's.
    while (who_.role == "peer" && in_flight_ >= node_.config.limits.requests_per_connection) {
        co_await slot_free_.async_wait(as_tuple_awaitable);  // woken by a cancel
        auto cs = co_await net::this_coro::cancellation_state;
        if (cs.cancelled() != net::cancellation_type::none) co_return;  // the connection ends
    }
    auto parsed = jsonrpc::parse_request(text, node_.config.limits.max_text_message);
    if (auto* bad = std::get_if<jsonrpc::Invalid>(&parsed)) {
        respond_error(bad->id, bad->error.to_json());
        co_return;
    }
    admit(std::move(std::get<jsonrpc::Request>(parsed)));
}

void Session::shutdown() {
    // The daemon stops: channels are hung up now, not once the host answers the close (a host
    // that does not read would hold them, and the daemon's exit, for the close timeout).
    net::post(strand_, [self = shared_from_this()] {
        self->mux_.close_all();
        self->transport_.close(websocket::close_code::going_away, self);
    });
}

void Session::revoke() {
    net::post(strand_, [self = shared_from_this()] {
        spdlog::info("peer={} token \"{}\" revoked: closing the connection (1008)", self->peer_, self->who_.name);
        self->mux_.close_all();
        self->transport_.close(websocket::close_code::policy_error, self);
    });
}

void Session::send_binary(std::string frame) { transport_.send(true, std::move(frame)); }
std::string Session::frame_buffer() { return transport_.take_buffer(); }
bool Session::can_splice() { return transport_.can_splice(); }
void Session::send_spliced(std::string head, int pipe_fd, std::size_t count,
                           std::function<void(bool written)> done) {
    transport_.send_spliced(std::move(head), pipe_fd, count, std::move(done));
}

void Session::send_text(std::string text) { transport_.send(false, std::move(text)); }

void Session::respond(const json& id, json result) {
    send_text(jsonrpc::result(id, std::move(result)));
}

void Session::respond_error(const json& id, const json& error) {
    send_text(jsonrpc::error(id, error));
}

// ---------------------------------------------------------------------------------------------
// Channel sink and relay target: the multiplexer's

void Session::channel_finished(std::uint32_t channel) { mux_.finished(channel); }

void Session::relay_binary(std::uint32_t local_channel, std::string frame) {
    mux_.relay_binary(local_channel, std::move(frame));
}

void Session::relay_exit(std::uint32_t local_channel, json exit_params) {
    mux_.relay_exit(local_channel, std::move(exit_params));
}

net::any_io_executor Session::relay_executor() { return strand_; }

// ---------------------------------------------------------------------------------------------
// Admission: requests run concurrently, ordered per channel

std::optional<websocket::close_reason> Session::on_binary(std::string_view message) {
    auto checked = mux_.check_frame(message);
    if (auto* reason = std::get_if<websocket::close_reason>(&checked)) return *reason;
    route_frame(message, std::get<std::uint32_t>(checked));
    return std::nullopt;
}

bool Session::may_be_opening(std::uint32_t channel) const noexcept {
    return opens_in_flight_ > 0 && channel >= mux_.peek_next_id();
}

void Session::route_frame(std::string_view message, std::uint32_t channel) {
    if (may_be_opening(channel)) {
        after_opens_.emplace_back(std::string(message));
        return;
    }
    if (auto lane = lanes_.find(channel); lane != lanes_.end()) {
        lane->second.waiting.emplace_back(std::string(message));  // after the running request
        return;
    }
    mux_.apply_frame(message);
}

void Session::replay_after_opens() {
    if (transport_.closing()) {  // nothing waiting will be answered or applied
        after_opens_.clear();
        return;
    }
    auto waiting = std::move(after_opens_);
    after_opens_.clear();
    for (auto& next : waiting) {
        if (auto* request = std::get_if<jsonrpc::Request>(&next)) {
            route(std::move(*request));
        } else {
            const auto& frame = std::get<std::string>(next);
            route_frame(frame, std::get<std::uint32_t>(mux_.check_frame(frame)));
        }
    }
}

void Session::admit(jsonrpc::Request request) {
    const auto limit = node_.config.limits.requests_per_connection;
    if (in_flight_ >= limit) {
        const rpc_error error(errc::channel_limit,
                              "this connection already has " + std::to_string(in_flight_) +
                                  " requests in flight (limit " + std::to_string(limit) + ")",
                              {{"limit", "requestsPerConnection"}});
        if (request.id) {
            respond_error(*request.id, error.to_json());
        } else {
            spdlog::info("peer={} method={} notification dropped: {}", peer_, request.method,
                         error.what());
        }
        return;
    }
    ++in_flight_;
    route(std::move(request));
}

void Session::route(jsonrpc::Request request) {
    std::optional<std::uint32_t> lane;
    auto entry = method_table().find(request.method);
    if (entry != method_table().end() && entry->second.on_channel) {
        lane = methods::channel_named(request.params);
    }
    if (lane && may_be_opening(*lane)) {
        after_opens_.emplace_back(std::move(request));
        return;
    }
    if (request.method == "duplexChannelOpen") ++opens_in_flight_;
    if (lane) {
        auto [it, idle] = lanes_.try_emplace(*lane);
        if (!idle) {
            it->second.waiting.emplace_back(std::move(request));
            return;
        }
    }
    start(std::move(request), lane);
}

void Session::start(jsonrpc::Request request, std::optional<std::uint32_t> lane) {
    net::co_spawn(strand_, serve(shared_from_this(), std::move(request), lane),
                  [peer = peer_](const std::exception_ptr& e) { log_task_failure(peer, e); });
}

awaitable<void> Session::serve(std::shared_ptr<Session> self, jsonrpc::Request request,
                               std::optional<std::uint32_t> lane) {
    const json id = request.id.value_or(json());
    const bool open = request.method == "duplexChannelOpen";
    const auto started = std::chrono::steady_clock::now();
    std::string_view result = "ok";
    // The lease an open names, for open.refused (null when the params do not name one).
    json open_lease;
    if (open && request.params.is_object()) {
        if (const auto l = request.params.find("lease"); l != request.params.end() && l->is_object()) {
            if (const auto named = l->find("id"); named != l->end() && named->is_string()) open_lease = *named;
        }
    }
    bool routed = false;
    try {
        auto entry = method_table().find(request.method);
        Call c{std::move(request.params), id,
               caller_of(request, entry == method_table().end() ? nullptr : &entry->second)};
        auto reply = co_await call(request.method, std::move(c));
        routed = open && reply.result.is_object() && reply.result.value("routed", false);
        if (request.id) respond(id, std::move(reply.result));
        if (reply.after) reply.after();
    } catch (const rpc_error& e) {
        result = reason(e.code());
        if (request.id) respond_error(id, e.to_json());
        spdlog::debug("peer={} method={} failed: {} ({})", peer_, request.method, e.what(),
                      reason(e.code()));
    } catch (const std::exception& e) {
        result = reason(errc::internal_error);
        spdlog::error("peer={} method={} internal error: {}", peer_, request.method, e.what());
        if (request.id) {
            respond_error(id, rpc_error(errc::internal_error, "Internal error").to_json());
        }
    }
    count_request(request.method, result, routed, std::chrono::steady_clock::now() - started);
    if (open && result != "ok" && node_.audit) {
        node_.audit->write("open.refused", {{"peer", peer_},
                                            {"token", who_.name},
                                            {"forwardedBy", forwarded_by_.empty() ? json() : json(forwarded_by_)},
                                            {"lease", open_lease},
                                            {"reason", result}});
    }
    --in_flight_;
    slot_free_.cancel();
    if (lane) self->release(*lane);
    if (open) {
        --opens_in_flight_;
        self->replay_after_opens();  // what names its channel goes now; the rest waits on
    }
}

void Session::count_request(const std::string& method, std::string_view result, bool routed,
                            std::chrono::steady_clock::duration took) {
    auto& m = node_.metrics;
    if (method == "duplexChannelOpen") {
        m.channel_opens.with({result}).inc();
        if (result == "ok") {
            m.channel_open_seconds.with({routed ? "routed" : "local"})
                .observe(std::chrono::duration<double>(took).count());
        }
    } else if (method.rfind("lease", 0) == 0 && method_table().count(method) != 0) {
        m.lease_operations.with({method, result}).inc();
    }
}

void Session::release(std::uint32_t lane) {
    auto it = lanes_.find(lane);
    if (it == lanes_.end()) return;
    if (transport_.closing()) {  // nothing waiting will be answered or applied
        lanes_.erase(it);
        return;
    }
    auto& waiting = it->second.waiting;
    while (!waiting.empty()) {
        Queued next = std::move(waiting.front());
        waiting.pop_front();
        if (auto* request = std::get_if<jsonrpc::Request>(&next)) {
            start(std::move(*request), lane);  // the lane stays taken until it is done
            return;
        }
        mux_.apply_frame(std::get<std::string>(next));
    }
    lanes_.erase(it);
}

// ---------------------------------------------------------------------------------------------
// The method table

const std::map<std::string_view, Session::Method>& Session::method_table() {
    static const std::map<std::string_view, Method> table = {
        // handler, fenced, on_channel, forwarded
        {"initialize", {&Session::initialize}},
        {"leaseAcquire", {&Session::lease_acquire, true}},
        {"leaseGet", {&Session::lease_get, false, false, true}},
        {"leaseList", {&Session::lease_list}},
        {"leaseRenew", {&Session::lease_renew, true, false, true}},
        {"leaseRelease", {&Session::lease_release, true, false, true}},
        {"leaseProbe", {&Session::lease_probe, true, false, true}},
        {"providerValidateConfig", {&Session::provider_validate_config}},
        {"leaseExecute", {&Session::lease_execute, true, false, true}},
        {"leaseRealizeWorkspace", {&Session::lease_realize_workspace, true, false, true}},
        {"nodeList", {&Session::node_list}},
        {"duplexChannelOpen", {&Session::channel_open, true, false, true}},
        {"duplexChannelWrite", {&Session::channel_write, false, true, true}},
        {"duplexChannelCloseStdin", {&Session::channel_close_stdin, false, true, true}},
        {"duplexChannelResize", {&Session::channel_resize, false, true, true}},
        {"duplexChannelSignal", {&Session::channel_signal, false, true, true}},
        {"duplexChannelStop", {&Session::channel_stop, false, true, true}},
        {"duplexChannelClose", {&Session::channel_close, false, true, true}},
    };
    return table;
}

Principal Session::caller_of(const jsonrpc::Request& request, const Method* method) const {
    if (who_.role != "peer") {
        if (request.forwarded_for) {
            throw rpc_error(errc::forbidden,
                            "forwardedFor is accepted only on a peer link (a peer-role token)");
        }
        return who_;
    }
    // A peer link acts only for the host it forwards for, and only in the methods that a
    // node forwards (docs/protocol.md section 6, "Peer tokens").
    if (!method || !method->forwarded) {
        throw rpc_error(errc::forbidden, "a peer link may not call " + request.method +
                                             ": a node never forwards it",
                        {{"method", request.method}});
    }
    const json* f = request.forwarded_for ? &*request.forwarded_for : nullptr;
    const bool valid = f && f->is_object() && f->size() == 2 && f->contains("tokenName") &&
                       (*f)["tokenName"].is_string() && !(*f)["tokenName"].get<std::string>().empty() &&
                       f->contains("tenants") && (*f)["tenants"].is_array() &&
                       std::all_of((*f)["tenants"].begin(), (*f)["tenants"].end(),
                                   [](const json& t) { return t.is_string() && !t.get<std::string>().empty(); });
    if (!valid) {
        throw rpc_error(errc::forbidden,
                        "a peer link's " + request.method +
                            " needs forwardedFor: {tokenName: non-empty string, tenants: [non-empty "
                            "strings]}, naming the host it acts for",
                        {{"method", request.method}});
    }
    // The host's tenants as the forwarding node states them, held to the peer token's own:
    // a peer link acts only within the tenants its token was given (issue 44, item 4).
    return Principal{(*f)["tokenName"].get<std::string>(), "host",
                     intersect_tenants((*f)["tenants"].get<std::vector<std::string>>(), who_.tenants)};
}

std::shared_ptr<Channel> Session::local_channel(std::uint32_t id, const Principal& caller) {
    auto channel = mux_.local(id);
    if (who_.role == "peer" && channel->options().opened_for != caller.name) {
        throw rpc_error(errc::channel_not_found,
                        "channel " + std::to_string(id) + " is not open on this connection",
                        {{"channel", id}});
    }
    return channel;
}

awaitable<Session::Reply> Session::call(const std::string& method, Call c) {
    json p = methods::params_object(c.params);
    auto it = method_table().find(method);
    if (it == method_table().end()) {
        throw rpc_error(errc::method_not_found, "Method not found: " + method, {{"method", method}});
    }
    const Method& m = it->second;
    // Self-fencing: no opens or lease changes on stale membership.
    if (m.fenced) node_.require_membership();
    if (m.on_channel) {
        auto channel = methods::channel_named(p);
        if (const auto* route = channel ? mux_.relayed(*channel) : nullptr) {
            // A relayed channel: the owner checks and answers, under its own channel id.
            auto link = route->link;
            const auto remote_id = route->remote_id;
            if (method == "duplexChannelClose") {
                mux_.take_relayed(*channel);
                link->forget(remote_id);
            }
            p["channel"] = remote_id;
            json result = co_await link->call(method, std::move(p), forwarded_for(c.caller));
            co_return Reply{std::move(result), {}};
        }
        if ((method == "duplexChannelWrite" || method == "duplexChannelCloseStdin") && channel &&
            mux_.ended(*channel)) {
            co_return empty_result();  // the command is gone: nothing left to write to
        }
    }
    c.params = std::move(p);
    co_return co_await (this->*m.handler)(std::move(c));
}

awaitable<Session::Reply> Session::initialize(Call c) {
    json p = std::move(c.params);
    methods::parse_initialize(p);
    const auto& l = node_.config.limits;
    std::vector<std::string> supported;
    // The protocol's order, not the table's (alphabetical).
    for (const char* m : {"initialize", "leaseAcquire", "leaseGet", "leaseList", "leaseRenew",
                          "leaseRelease", "leaseProbe", "leaseExecute", "leaseRealizeWorkspace",
                          "providerValidateConfig", "nodeList",
                          "duplexChannelOpen", "duplexChannelWrite",
                          "duplexChannelCloseStdin", "duplexChannelResize", "duplexChannelSignal",
                          "duplexChannelStop", "duplexChannelClose"}) {
        supported.emplace_back(m);
    }
    co_return Reply{json{{"protocolVersion", 1},
                         {"nodeId", node_.node_id},
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
                         {"providers", provider_list(node_)}},
                    {}};
}

awaitable<Session::Reply> Session::lease_acquire(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_lease_acquire(p, node_.config.limits.max_ttl_ms);
    json result = to_json(co_await sandboxd::lease_acquire(node_, c.caller, std::move(params)));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_list(Call c) {
    json p = std::move(c.params);
    json result = co_await sandboxd::lease_list(node_, c.caller, methods::parse_lease_list(p));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::node_list(Call /*c*/) {
    json result = co_await sandboxd::node_list(node_);
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_get(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_lease_id(p);
    Lease lease = co_await sandboxd::lease_get(node_, c.caller, params.lease_id);
    if (lease.owner_node_id != node_.node_id && lease.status == lease_status::active &&
        forwarded_by_.empty()) {
        // The owner answers, so that `usage` is current; without it, usage is null.
        try {
            auto link = co_await owner_link(node_, lease);
            json result = co_await link->call("leaseGet", std::move(p), forwarded_for(c.caller));
            co_return Reply{std::move(result), {}};
        } catch (const rpc_error& e) {
            if (e.code() != errc::owner_unavailable && e.code() != errc::owner_elsewhere) throw;
        }
    }
    // The provider reads the sandbox's cgroup files and statvfs: not on this strand.
    co_await offload(node_.blocking, [this, &lease] { attach_usage(node_, lease); });
    co_return Reply{to_json(lease), {}};
}

awaitable<std::optional<Session::Reply>> Session::lease_change_at_owner(
    std::string method, json p, std::string lease_id, Principal caller,
    std::optional<PeerLink::Notify> notify,
    std::chrono::milliseconds answer_within) {
    // The owner releases or renews, so that its cache and channels follow.
    Lease lease = co_await sandboxd::lease_get(node_, caller, lease_id);
    // A retained lease is held by no node: any node serves it (and answers that it is not
    // active to everything but a release).
    const bool settled = lease.status == lease_status::released ||
                         lease.status == lease_status::failed ||
                         lease.status == lease_status::retained;
    if (lease.owner_node_id == node_.node_id || settled || !forwarded_by_.empty()) {
        co_return std::nullopt;
    }
    std::string unavailable;
    try {
        auto link = co_await owner_link(node_, lease);
        json result;
        if (notify) {
            result = co_await link->call(method, std::move(p), forwarded_for(caller),
                                         std::move(*notify), answer_within);
        } else {
            result = co_await link->call(method, std::move(p), forwarded_for(caller));
        }
        co_return Reply{std::move(result), {}};
    } catch (const rpc_error& e) {
        if (e.code() != errc::owner_unavailable || method != "leaseRelease") throw;
        unavailable = e.what();
    }
    // A dead owner cannot tear down: the lease waits for cleanup instead.
    json result = to_json(
        co_await lease_orphan(node_, std::move(lease), std::move(unavailable), caller.name));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_renew(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_lease_renew(p);
    if (auto at_owner = co_await lease_change_at_owner("leaseRenew", p, params.lease_id, c.caller)) {
        co_return std::move(*at_owner);
    }
    json result =
        to_json(co_await sandboxd::lease_renew(node_, c.caller, params.lease_id, params.ttl_ms));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_release(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_lease_release(p);
    if (auto at_owner = co_await lease_change_at_owner("leaseRelease", p, params.lease_id, c.caller)) {
        co_return std::move(*at_owner);
    }
    json result = to_json(co_await sandboxd::lease_release(node_, c.caller, std::move(params)));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_probe(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_lease_id(p);
    // The owner's provider holds the sandbox: forwarded there like a release.
    if (auto at_owner = co_await lease_change_at_owner("leaseProbe", p, params.lease_id, c.caller)) {
        co_return std::move(*at_owner);
    }
    json result = co_await sandboxd::lease_probe(node_, c.caller, params.lease_id);
    co_return Reply{std::move(result), {}};
}

ExecuteLog Session::execute_log(const json& id) {
    if (id.is_null()) return {};
    struct Sent {
        std::size_t bytes[2] = {0, 0};
    };
    auto sent = std::make_shared<Sent>();
    const std::size_t limit = node_.config.limits.execute_output_bytes;
    // Called on this strand (the provider's contract, and the peer link posts here).
    return [weak = weak_from_this(), id, sent, limit](std::string stream, std::string chunk) {
        auto self = weak.lock();
        if (!self || chunk.empty()) return;
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
            "leaseExecute.log", {{"requestId", id}, {"stream", stream}, {"chunk", std::move(chunk)}});
        self->send_text(std::move(text));
    };
}

awaitable<Session::Reply> Session::lease_execute(Call c) {
    json p = std::move(c.params);
    const json& id = c.id;
    const auto& limits = node_.config.limits;
    auto params = methods::parse_execute(p, limits.execute_timeout_ms);
    ExecuteLog log = execute_log(id);
    // The output is read only while this connection can take its log (issue 44, item 2);
    // the Session outlives the request (serve() holds it).
    params.request.wait_for_room = [this] { return wait_send_room(); };
    // The owner's provider holds the sandbox: forwarded there, its logs relayed back.
    PeerLink::Notify notify;
    notify.executor = strand_;
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
    if (auto at_owner = co_await lease_change_at_owner("leaseExecute", p, params.lease_id, c.caller,
                                                       std::move(notify), answer_within)) {
        co_await wait_send_room();
        co_return std::move(*at_owner);
    }
    json result = co_await sandboxd::lease_execute(node_, c.caller, std::move(params), std::move(log));
    // The result (up to limits.executeOutputBytes of each stream, 6 bytes per escaped byte
    // once serialised) is queued only when the connection has room: results of pipelined
    // executes wait here, as JSON values, not as serialised text in the queue.
    co_await wait_send_room();
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::lease_realize_workspace(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_realize_workspace(p);
    if (auto at_owner = co_await lease_change_at_owner("leaseRealizeWorkspace", p, params.lease_id, c.caller)) {
        co_return std::move(*at_owner);
    }
    json result = co_await sandboxd::lease_realize_workspace(node_, c.caller, std::move(params));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::provider_validate_config(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_validate_config(p);
    json result = co_await sandboxd::provider_validate_config(node_, c.caller, std::move(params));
    co_return Reply{std::move(result), {}};
}

awaitable<Session::Reply> Session::channel_write(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_write(p);
    local_channel(params.channel, c.caller)->write_stdin(params.data);
    co_return empty_result();
}

awaitable<Session::Reply> Session::channel_close_stdin(Call c) {
    json p = std::move(c.params);
    local_channel(methods::parse_channel(p).channel, c.caller)->close_stdin();
    co_return empty_result();
}

awaitable<Session::Reply> Session::channel_resize(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_resize(p);
    local_channel(params.channel, c.caller)->resize(params.cols, params.rows);
    co_return empty_result();
}

awaitable<Session::Reply> Session::channel_signal(Call c) {
    json p = std::move(c.params);
    auto params = methods::parse_signal(p);
    local_channel(params.channel, c.caller)->send_signal(params.signal);
    co_return empty_result();
}

awaitable<Session::Reply> Session::channel_stop(Call c) {
    json p = std::move(c.params);
    local_channel(methods::parse_channel(p).channel, c.caller)->stop(channel_outcome::stopped);
    co_return empty_result();
}

awaitable<Session::Reply> Session::channel_close(Call c) {
    json p = std::move(c.params);
    const auto id = methods::parse_channel(p).channel;
    // On a peer link, another host's channel is refused (local_channel() says why).
    if (mux_.find_local(id)) local_channel(id, c.caller);
    if (auto channel = mux_.take_local(id)) {
        channel->hangup(channel_outcome::stopped);  // stop and forget: no exit follows
    }
    co_return empty_result();
}

// ---------------------------------------------------------------------------------------------
// Opening a channel (docs/protocol.md section 3: the fail-closed checks, in order)

awaitable<Session::Reply> Session::channel_open(Call c) {
    json p = std::move(c.params);
    // Step 1: the shape of the params.
    auto params = methods::parse_open(p, node_.config.limits.max_output_window,
                                      node_.config.limits.max_stdin_window);
    // A draining node opens nothing, here or relayed: its connections end with the drain.
    // Counted first, then checked: a drain that begins meanwhile waits for this open.
    node_.opens_in_flight.fetch_add(1);
    const ScopeExit counted([this] { node_.opens_in_flight.fetch_sub(1); });
    if (node_.draining) {
        throw rpc_error(errc::owner_unavailable, "node " + node_.node_id + " is draining: it opens no new channels",
                        {{"nodeId", node_.node_id}, {"draining", true}});
    }
    // Steps 2-4: the lease, its scope and status.
    Lease lease = co_await resolve_lease(node_, c.caller, params.lease);
    const auto limit = node_.config.limits.channels_per_connection;
    if (mux_.count() >= limit) {
        throw rpc_error(errc::channel_limit,
                        "this connection already has " + std::to_string(mux_.local_count()) +
                            " channels (limit " + std::to_string(limit) + ")");
    }
    // The slot is held while the open runs, so concurrent opens cannot overshoot the limit.
    mux_.reserve();
    const ScopeExit release([this] { mux_.release(); });
    // Step 5: another owner. A forwarded open is never forwarded again.
    if (lease.owner_node_id != node_.node_id) {
        co_return co_await open_relayed(std::move(p), std::move(lease), std::move(c.caller));
    }
    co_return co_await open_local(std::move(params), std::move(lease), std::move(c.caller));
}

awaitable<Session::Reply> Session::open_relayed(json p, Lease lease, Principal caller) {
    if (!forwarded_by_.empty()) {
        throw rpc_error(errc::routing_loop,
                        "Sandbox lease " + lease.id + " is owned by node " + lease.owner_node_id +
                            ", not by node " + node_.node_id +
                            ", and this open was already forwarded by node " + forwarded_by_ + ".",
                        {{"ownerNodeId", lease.owner_node_id}, {"forwardedBy", forwarded_by_}});
    }
    auto link = co_await owner_link(node_, lease);
    // The owner compares the epoch this node routed on with its own reading (fencing).
    if (!p["lease"].contains("epoch")) p["lease"]["epoch"] = lease.epoch;
    const std::uint32_t local = mux_.next_id();
    mux_.opening(local);  // frames that overtake the open's result wait there
    json result;
    try {
        result = co_await link->open(p, forwarded_for(caller),
                                     std::weak_ptr<RelayTarget>(shared_from_this()), local);
    } catch (...) {
        mux_.open_failed(local);
        throw;
    }
    ChannelMux::Relayed route;
    route.link = link;
    route.remote_id = result.value("channel", 0U);
    route.forwarded_for = forwarded_for(caller);
    route.stdin_window = result.value("stdinWindow", std::uint64_t{0});
    if (transport_.closing()) {
        // The host left while the owner opened: nobody will read it.
        mux_.open_failed(local);
        link->close_channel(route.remote_id, route.forwarded_for);
        link->forget(route.remote_id);
        co_return Reply{json::object(), {}};
    }
    spdlog::info("channel={}/{} lease={} forwarded to node={} (connection channel {}) peer={}",
                 lease.owner_node_id, route.remote_id, lease.id, lease.owner_node_id, local, peer_);
    result["channel"] = local;
    result["routed"] = true;
    // The frames that overtook the result go out right after it.
    co_return Reply{std::move(result),
                    [this, local, route = std::move(route)]() mutable {
                        mux_.opened(local, std::move(route));
                    }};
}

awaitable<Session::Reply> Session::open_local(methods::OpenParams params, Lease lease,
                                              Principal caller) {
    // Step 6: this node owns it; its cache must hold the sandbox (or its provider resume it).
    auto sandbox = co_await sandbox_for(node_, lease);
    const auto& limits = node_.config.limits;
    if (!node_.channels.try_reserve(limits.channels_per_node)) {
        throw rpc_error(errc::channel_limit, "this node already runs its limit of " +
                                                 std::to_string(limits.channels_per_node) +
                                                 " channels");
    }
    ChannelOptions options;
    options.host_route_id = std::move(params.host_route_id);
    options.timeout = params.timeout;
    options.output_window = params.output_window.value_or(limits.output_window);
    options.base64 = params.base64;
    options.pty = params.spec.pty.has_value();
    options.stdin_attached = params.spec.stdin_attached;
    options.stdin_window = params.stdin_window.value_or(limits.stdin_window);
    options.hangup_grace = std::chrono::milliseconds(limits.hangup_grace_ms);
    options.audit = node_.audit;
    options.opened_for = caller.name;
    options.argv0 = params.spec.argv.front();
    options.argv_sha256 = argv_digest(params.spec.argv);
    options.epoch = lease.epoch;
    options.unended = &node_.channels_unended;
    options.bytes = &node_.metrics.channel_byte_counters;
    params.spec.drain_grace_ms = limits.drain_grace_ms;
    // Started before this node may fence itself, or not at all: a node frozen from here on
    // (SIGSTOP, a stalled VM) cannot start a command once another node may take the lease.
    // A start refused for its deadline is tried again (at most twice) with the later deadline
    // of a renewal since, when the membership held without a break: a long queue of opens at
    // one sandbox under load is not a fenced node.
    const std::uint64_t breaks = node_.membership_breaks.load(std::memory_order_acquire);
    std::int64_t start_deadline = node_.fence_deadline_ms();
    const std::string program = params.spec.argv.front();
    std::unique_ptr<ChannelBackend> backend;
    std::exception_ptr failed;
    std::string unresumable;  // the provider lost the sandbox and could not resume it
    for (int attempt = 1;; ++attempt) {
        ExecSpec spec = params.spec;
        spec.start_deadline_ms = start_deadline;
        try {
            backend = co_await node_.providers.at(lease.provider)->open(sandbox, std::move(spec));
        } catch (const start_deadline_passed&) {
            if (attempt < 3 && node_.may_retry_start(start_deadline, breaks)) {
                spdlog::info("lease={} open: its start deadline passed in the sandbox's queue; "
                             "again with the renewed one (attempt {})",
                             lease.id, attempt + 1);
                start_deadline = node_.fence_deadline_ms();
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
    const std::string start_deadline_text =
        rfc3339_at(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(start_deadline - steady_now_ms()));
    if (failed) {
        node_.channels.unreserve();
        if (!unresumable.empty()) co_await forget_unresumable(node_, lease, unresumable);
        std::rethrow_exception(failed);
    }
    options.id = mux_.next_id();
    options.lease_id = lease.id;
    auto channel = std::make_shared<Channel>(strand_, options, std::move(backend), sandbox,
                                             weak_from_this());
    ChannelTable::Entry entry;
    entry.channel = channel;
    entry.strand = strand_;
    entry.lease_id = lease.id;
    auto key = node_.channels.add(std::move(entry));
    // on_reaped is set after add() so the key is known; it runs on this strand.
    channel->set_on_reaped([&node = node_, key] { node.channels.remove(key); });
    channel->set_audit_key(key);
    if (node_.audit) {
        node_.audit->write("channel.opened", {{"lease", lease.id},
                                              {"epoch", lease.epoch},
                                              {"channel", key},
                                              {"token", caller.name},
                                              {"argv0", options.argv0},
                                              {"argvSha256", options.argv_sha256},
                                              {"pty", options.pty},
                                              {"startDeadline", start_deadline_text}});
    }
    if (transport_.closing()) {
        // The host left while the command started: it is hung up at once, as on a drop.
        channel->start();
        channel->hangup();
        co_return Reply{json::object(), {}};
    }
    mux_.add_local(options.id, channel);
    spdlog::info("channel={} lease={} opened: {} pty={} peer={} (connection channel {})", key,
                 options.lease_id, program, options.pty, peer_, options.id);
    // The result goes out before the first data frame of the channel.
    co_return Reply{json{{"channel", options.id},
                         {"hostRouteId", options.host_route_id},
                         {"workerSessionId", node_.node_id + "/" + std::to_string(options.id)},
                         {"ownerNodeId", node_.node_id},
                         {"routed", false},
                         {"stdinWindow", options.stdin_window},
                         {"outputWindow", options.output_window}},
                    [channel] { channel->start(); }};
}

}  // namespace sandboxd
