#include "server/session.hpp"

#include "server/audit.hpp"
#include "server/lease_service.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/core/utf8.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>
#include <boost/asio/experimental/awaitable_operators.hpp>

namespace sandboxd {
namespace {

using json = nlohmann::json;
using namespace net::experimental::awaitable_operators;

// No co_await inside MethodReply{...} (lease_methods.cpp says why).

}  // namespace

Session::Session(Node& node, ConnStream stream, Principal who)
    : node_(node),
      transport_(std::move(stream), node.config.limits, node.send_budget.get(), who.role == "peer"),
      who_(std::move(who)),
      strand_(transport_.strand()),
      slot_free_(strand_),
      peer_(transport_.peer()),
      mux_(*this, node.config.limits.max_data_payload, peer_, &node.metrics.channel_byte_counters,
           &node.relays_open) {
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
        auto woken =
            std::make_shared<net::steady_timer>(strand_, net::steady_timer::time_point::max());
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
        spdlog::info("peer={} token \"{}\" revoked: closing the connection (1008)", self->peer_,
                     self->who_.name);
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

void Session::relay_gap(std::uint32_t local_channel, json gap_params) {
    mux_.relay_gap(local_channel, std::move(gap_params));
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
    const auto* method = find_method(request.method);
    if (method && method->has(on_channel)) lane = methods::channel_named(request.params);
    if (lane && may_be_opening(*lane)) {
        after_opens_.emplace_back(std::move(request));
        return;
    }
    if (method && method->has(opens_channel)) ++opens_in_flight_;
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
                  [peer = peer_](const std::exception_ptr& e) {
                      if (e) log_task_failure("peer=" + peer + " session task", e);
                  });
}

awaitable<void> Session::serve(std::shared_ptr<Session> self, jsonrpc::Request request,
                               std::optional<std::uint32_t> lane) {
    const json id = request.id.value_or(json());
    const auto* method = find_method(request.method);
    const bool open = method && method->has(opens_channel);
    const auto started = std::chrono::steady_clock::now();
    std::string_view result = "ok";
    // The lease an open names, for open.refused (null when the params do not name one).
    json open_lease;
    if (open && request.params.is_object()) {
        if (const auto l = request.params.find("lease");
            l != request.params.end() && l->is_object()) {
            if (const auto named = l->find("id"); named != l->end() && named->is_string())
                open_lease = *named;
        }
    }
    bool routed = false;
    try {
        MethodCall c{method ? method->name : std::string_view(request.method),
                     std::move(request.params), id, caller_of(request, method)};
        auto reply = co_await call(method, std::move(c));
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
    count_request(method, request.method, result, routed,
                  std::chrono::steady_clock::now() - started);
    if (open && result != "ok" && node_.audit) {
        node_.audit->write("open.refused",
                           {{"peer", peer_},
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

void Session::count_request(const MethodSpec* method, const std::string& name,
                            std::string_view result, bool routed,
                            std::chrono::steady_clock::duration took) {
    auto& m = node_.metrics;
    if (!method) return;
    if (method->has(opens_channel)) {
        m.channel_opens.with({result}).inc();
        if (result == "ok") {
            m.channel_open_seconds.with({routed ? "routed" : "local"})
                .observe(std::chrono::duration<double>(took).count());
        }
    } else if (method->has(lease_operation)) {
        m.lease_operations.with({name, result}).inc();
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

Principal Session::caller_of(const jsonrpc::Request& request, const MethodSpec* method) const {
    if (who_.role != "peer") {
        if (request.forwarded_for) {
            throw rpc_error(errc::forbidden,
                            "forwardedFor is accepted only on a peer link (a peer-role token)");
        }
        return who_;
    }
    // A peer link acts only for the host it forwards for, and only in the methods that a
    // node forwards (docs/protocol.md section 6, "Peer tokens").
    if (!method || !method->has(forwarded)) {
        throw rpc_error(errc::forbidden,
                        "a peer link may not call " + request.method + ": a node never forwards it",
                        {{"method", request.method}});
    }
    const json* f = request.forwarded_for ? &*request.forwarded_for : nullptr;
    const bool valid =
        f && f->is_object() && f->size() == 2 && f->contains("tokenName") &&
        (*f)["tokenName"].is_string() && !(*f)["tokenName"].get<std::string>().empty() &&
        f->contains("tenants") && (*f)["tenants"].is_array() &&
        std::all_of((*f)["tenants"].begin(), (*f)["tenants"].end(),
                    [](const json& t) { return t.is_string() && !t.get<std::string>().empty(); });
    if (!valid) {
        throw rpc_error(
            errc::forbidden,
            "a peer link's " + request.method +
                " needs forwardedFor: {tokenName: non-empty string, tenants: [non-empty "
                "strings]}, naming the host it acts for",
            {{"method", request.method}});
    }
    // The host's tenants as the forwarding node states them, held to the peer token's own:
    // a peer link acts only within the tenants its token was given (issue 44, item 4).
    return Principal{
        (*f)["tokenName"].get<std::string>(), "host",
        intersect_tenants((*f)["tenants"].get<std::vector<std::string>>(), who_.tenants)};
}

awaitable<MethodReply> Session::call(const MethodSpec* method, MethodCall c) {
    json p = methods::params_object(c.params);
    if (!method) {
        const std::string name(c.method);
        throw rpc_error(errc::method_not_found, "Method not found: " + name, {{"method", name}});
    }
    // Self-fencing: no opens or lease changes on stale membership.
    if (method->has(fenced)) node_.require_membership();
    if (method->has(on_channel)) {
        auto channel = methods::channel_named(p);
        if (const auto* route = channel ? mux_.relayed(*channel) : nullptr) {
            // A relayed channel: the owner checks and answers, under its own channel id.
            auto link = route->link;
            const auto remote_id = route->remote_id;
            if (method->has(ends_channel)) {
                mux_.take_relayed(*channel);
                link->forget(remote_id);
            }
            p["channel"] = remote_id;
            json result = co_await link->call(std::string(method->name), std::move(p),
                                              forwarded_for(c.caller));
            co_return MethodReply{std::move(result), {}};
        }
        if (method->has(moot_after_exit) && channel && mux_.ended(*channel)) {
            co_return MethodReply{json::object(),
                                  {}};  // the command is gone: nothing left to write to
        }
    }
    c.params = std::move(p);
    co_return co_await method->handler(*this, std::move(c));
}

}  // namespace sandboxd
