#include "server/session.hpp"

#include "server/lease_service.hpp"
#include "server/params.hpp"

#include <sandboxd/base64.hpp>
#include <sandboxd/errors.hpp>
#include <sandboxd/frame.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

namespace sandboxd {
namespace {

using json = nlohmann::json;

constexpr std::string_view subprotocol = "sandboxd.v1";

const std::vector<std::string>& supported_methods() {
    static const std::vector<std::string> methods = {
        "initialize",           "leaseAcquire",        "leaseGet",
        "leaseList",            "leaseRenew",          "leaseRelease",
        "nodeList",             "duplexChannelOpen",   "duplexChannelWrite",
        "duplexChannelCloseStdin", "duplexChannelResize", "duplexChannelSignal",
        "duplexChannelStop",    "duplexChannelClose"};
    return methods;
}

bool offers_subprotocol(std::string_view header) {
    // Sec-WebSocket-Protocol: a comma-separated list of tokens.
    std::size_t pos = 0;
    while (pos <= header.size()) {
        auto comma = header.find(',', pos);
        auto item = header.substr(pos, comma == std::string_view::npos ? header.npos : comma - pos);
        while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
        while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
        if (item == subprotocol) return true;
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
    }
    return false;
}

std::string decode_base64(const std::string& field, std::string_view text) {
    try {
        return base64_decode(text);
    } catch (const base64_error&) {
        params::invalid(field, "is not valid base64");
    }
}

}  // namespace

Session::Session(Node& node, websocket::stream<beast::tcp_stream> ws, const Principal& who)
    : node_(node),
      ws_(std::move(ws.next_layer())),  // not yet upgraded: only the TCP stream matters
      who_(who),
      strand_(ws_.get_executor()),
      queue_timer_(strand_),
      ping_timer_(strand_),
      idle_timer_(strand_) {
    queue_timer_.expires_at(net::steady_timer::time_point::max());
    beast::error_code ec;
    auto ep = beast::get_lowest_layer(ws_).socket().remote_endpoint(ec);
    peer_ = ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
}

Session::~Session() = default;

awaitable<void> Session::run(http::request<http::string_body> request) {
    auto self = shared_from_this();
    const auto& limits = node_.config.limits;
    beast::get_lowest_layer(ws_).expires_never();
    websocket::stream_base::timeout timeouts{};
    timeouts.handshake_timeout = std::chrono::seconds(30);
    // Not Beast's idle_timeout: without its own keep-alive pings it counts from the start of
    // each read, and the pongs that answer ping_loop's pings arrive inside a read without
    // re-arming it, so a silent but healthy peer would be dropped. idle_loop counts from the
    // last frame heard, pongs included.
    timeouts.idle_timeout = websocket::stream_base::none();
    timeouts.keep_alive_pings = false;  // ping_loop pings every pingIntervalMs instead
    ws_.set_option(timeouts);
    ws_.control_callback([this](websocket::frame_type, beast::string_view) {
        last_heard_ = std::chrono::steady_clock::now();  // a ping, pong or close (on the strand)
    });
    // No permessage-deflate: Beast leaves it off unless asked, so an offer is answered
    // without the extension and a frame with RSV1 set is a protocol error (1002).
    ws_.auto_fragment(false);  // Beast's default splits every message into 4 KiB frames
    ws_.read_message_max(std::max<std::size_t>(limits.max_text_message,
                                               limits.max_data_payload + frame_header_size));
    const bool echo_subprotocol = offers_subprotocol(request[http::field::sec_websocket_protocol]);
    if (who_.role == "peer") forwarded_by_ = std::string(request["Sandboxd-Forwarded-By"]);
    ws_.set_option(websocket::stream_base::decorator([echo_subprotocol](websocket::response_type& res) {
        res.set(http::field::server, std::string("sandboxd/") + version_string);
        if (echo_subprotocol) res.set(http::field::sec_websocket_protocol, subprotocol);
    }));
    auto [ec] = co_await ws_.async_accept(request, as_tuple_awaitable);
    if (ec) {
        spdlog::debug("peer={} websocket handshake failed: {}", peer_, ec.message());
        co_return;
    }
    spdlog::info("peer={} connected as token \"{}\"", peer_, who_.name);
    auto log_failure = [peer = peer_](const std::exception_ptr& e) {
        if (!e) return;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("peer={} session task failed: {}", peer, ex.what());
        }
    };
    last_heard_ = std::chrono::steady_clock::now();
    net::co_spawn(strand_, write_loop(), log_failure);
    net::co_spawn(strand_, ping_loop(), log_failure);
    net::co_spawn(strand_, idle_loop(), log_failure);
    try {
        co_await read_loop();
    } catch (const std::exception& e) {
        spdlog::error("peer={} read loop failed: {}", peer_, e.what());
    }
    closing_ = true;
    queue_timer_.cancel();
    // The ping and idle loops hold the session: end them now, so that the socket and the
    // session's memory go at once, not a ping interval or an idle timeout later.
    ping_timer_.cancel();
    idle_timer_.cancel();
    close_all_channels();
    spdlog::info("peer={} disconnected", peer_);
}

awaitable<void> Session::read_loop() {
    beast::flat_buffer buffer;
    for (;;) {
        reading_ = true;
        auto [ec, n] = co_await ws_.async_read(buffer, as_tuple_awaitable);
        reading_ = false;
        if (ec) {
            if (ec != websocket::error::closed && ec != net::error::operation_aborted &&
                ec != net::error::eof) {
                spdlog::info("peer={} connection ended: {}", peer_, ec.message());
            }
            co_return;
        }
        const auto data = buffer.data();
        std::string_view message(static_cast<const char*>(data.data()), data.size());
        if (ws_.got_text()) {
            std::string text(message);
            co_await handle_text(std::move(text));
        } else if (auto reason = handle_binary(message)) {
            closing_ = true;
            co_await ws_.async_close(*reason, as_tuple_awaitable);
            co_return;
        }
        buffer.consume(buffer.size());
        last_heard_ = std::chrono::steady_clock::now();  // silence counts from here again
        if (closing_) co_return;
    }
}

awaitable<void> Session::write_loop() {
    auto self = shared_from_this();
    while (!closing_) {
        if (queue_.empty()) {
            co_await queue_timer_.async_wait(as_tuple_awaitable);
            continue;
        }
        Outgoing out = std::move(queue_.front());
        queue_.pop_front();
        ws_.binary(out.binary);
        auto [ec, n] = co_await ws_.async_write(net::buffer(out.bytes), as_tuple_awaitable);
        if (ec) {
            closing_ = true;
            beast::get_lowest_layer(ws_).socket().close(ec);
            co_return;
        }
    }
}

awaitable<void> Session::ping_loop() {
    auto self = shared_from_this();
    while (!closing_) {
        ping_timer_.expires_after(std::chrono::milliseconds(node_.config.limits.ping_interval_ms));
        auto [ec] = co_await ping_timer_.async_wait(as_tuple_awaitable);
        if (ec || closing_) co_return;
        auto [pec] = co_await ws_.async_ping({}, as_tuple_awaitable);
        if (pec) co_return;
    }
}

awaitable<void> Session::idle_loop() {
    auto self = shared_from_this();
    const auto idle = std::chrono::milliseconds(node_.config.limits.idle_timeout_ms);
    while (!closing_) {
        // While a message is being handled nothing is read: that is not the peer's silence.
        idle_timer_.expires_at(reading_ ? last_heard_ + idle
                                        : std::chrono::steady_clock::now() + idle);
        auto [ec] = co_await idle_timer_.async_wait(as_tuple_awaitable);
        if (ec || closing_) co_return;
        const auto silent = std::chrono::steady_clock::now() - last_heard_;
        if (!reading_ || silent < idle) continue;  // heard from it meanwhile
        spdlog::info("peer={} silent for {} ms (limit {} ms): dropping the connection", peer_,
                     std::chrono::duration_cast<std::chrono::milliseconds>(silent).count(),
                     idle.count());
        // The read fails, and the session ends as for any dropped connection.
        beast::error_code ignored;
        beast::get_lowest_layer(ws_).socket().close(ignored);
        co_return;
    }
}

void Session::shutdown() {
    net::post(strand_, [self = shared_from_this()] {
        if (self->closing_) return;
        // A plain completion handler: no capturing coroutine lambda (CP.51).
        self->ws_.async_close(websocket::close_code::going_away,
                              [self](beast::error_code) {});
    });
}

void Session::send_binary(std::string frame) {
    if (closing_) return;
    queue_.push_back({true, std::move(frame)});
    queue_timer_.cancel();
}

void Session::send_text(std::string text) {
    if (closing_) return;
    queue_.push_back({false, std::move(text)});
    queue_timer_.cancel();
}

void Session::channel_finished(std::uint32_t channel) {
    channels_.erase(channel);
    // Remembered so that a write or half-close racing the exit is a harmless no-op.
    ended_.insert(channel);
    if (ended_.size() > 4096) ended_.erase(ended_.begin());
}

bool Session::ended(const json& p) const {
    return p.contains("channel") && p["channel"].is_number_unsigned() &&
           ended_.count(p["channel"].get<std::uint32_t>()) > 0;
}

void Session::respond(const json& id, json result) {
    send_text(json{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}}.dump());
}

void Session::respond_error(const json& id, const json& error) {
    node_.rpc_errors.fetch_add(1, std::memory_order_relaxed);
    send_text(json{{"jsonrpc", "2.0"}, {"id", id}, {"error", error}}.dump(
        -1, ' ', false, json::error_handler_t::replace));
}

void Session::close_all_channels() {
    for (auto& [id, channel] : channels_) channel->hangup();
    channels_.clear();
    for (auto& [id, remote] : remote_) {
        remote.link->close_channel(remote.remote_id);
        remote.link->forget(remote.remote_id);
    }
    remote_.clear();
}

void Session::relay_binary(std::uint32_t local_channel, std::string frame) {
    if (auto it = opening_.find(local_channel); it != opening_.end()) {
        it->second.emplace_back(true, std::move(frame));
        return;
    }
    auto it = remote_.find(local_channel);
    if (it == remote_.end()) return;
    // Only stdin credits change the relay's count; data frames pass without being parsed.
    if (!frame.empty() && frame[0] == static_cast<char>(frame_kind::credit)) {
        auto decoded = decode_frame(frame, node_.config.limits.max_data_payload);
        if (auto* credit = std::get_if<CreditFrame>(&decoded); credit && credit->stream == stream_id::stdin_) {
            auto& r = it->second;
            r.stdin_outstanding -= std::min<std::uint64_t>(credit->bytes, r.stdin_outstanding);
        }
    }
    send_binary(std::move(frame));
}

void Session::relay_exit(std::uint32_t local_channel, json exit_params) {
    auto text = json{{"jsonrpc", "2.0"}, {"method", "duplexChannel.exit"}, {"params", std::move(exit_params)}}.dump();
    if (auto it = opening_.find(local_channel); it != opening_.end()) {
        it->second.emplace_back(false, std::move(text));
        return;
    }
    if (remote_.erase(local_channel)) send_text(std::move(text));
}

net::any_io_executor Session::relay_executor() { return strand_; }

awaitable<void> Session::handle_text(std::string text) {
    json request;
    json id = nullptr;
    if (text.size() > node_.config.limits.max_text_message) {
        respond_error(id, rpc_error(errc::invalid_request,
                                    "text message of " + std::to_string(text.size()) +
                                        " bytes is over the limit of " +
                                        std::to_string(node_.config.limits.max_text_message))
                              .to_json());
        co_return;
    }
    try {
        request = json::parse(text);
    } catch (const json::parse_error&) {
        respond_error(id, rpc_error(errc::parse_error, "Parse error: the text frame is not JSON")
                              .to_json());
        co_return;
    }
    if (request.is_array()) {
        respond_error(id, rpc_error(errc::invalid_request, "Batch requests are not supported")
                              .to_json());
        co_return;
    }
    if (!request.is_object()) {
        respond_error(id, rpc_error(errc::invalid_request, "A request must be a JSON object")
                              .to_json());
        co_return;
    }
    const bool has_id = request.contains("id");
    if (has_id) {
        const auto& rid = request["id"];
        if (rid.is_string() || rid.is_number_integer() || rid.is_null()) id = rid;
    }
    if (request.value("jsonrpc", json()) != "2.0" || !request.contains("method") ||
        !request["method"].is_string() ||
        (has_id && !(request["id"].is_string() || request["id"].is_number_integer() ||
                     request["id"].is_null())) ||
        (request.contains("params") && !request["params"].is_object() &&
         !request["params"].is_array())) {
        respond_error(id, rpc_error(errc::invalid_request,
                                    "Invalid Request: needs jsonrpc \"2.0\", a string method, "
                                    "an optional string or integer id and object params")
                              .to_json());
        co_return;
    }
    const std::string method = request["method"].get<std::string>();
    const json params = request.contains("params") ? request["params"] : json::object();
    try {
        auto result = co_await dispatch(method, params, id);
        if (has_id && result) respond(id, std::move(*result));
    } catch (const rpc_error& e) {
        if (has_id) respond_error(id, e.to_json());
        spdlog::debug("peer={} method={} failed: {} ({})", peer_, method, e.what(),
                      reason(e.code()));
    } catch (const std::exception& e) {
        spdlog::error("peer={} method={} internal error: {}", peer_, method, e.what());
        if (has_id) respond_error(id, rpc_error(errc::internal_error, "Internal error").to_json());
    }
}

std::optional<websocket::close_reason> Session::handle_binary(std::string_view message) {
    auto decoded = decode_frame(message, node_.config.limits.max_data_payload);
    if (auto* err = std::get_if<FrameError>(&decoded)) {
        spdlog::info("peer={} bad binary frame: {}", peer_, err->what);
        return websocket::close_reason(
            err->too_big ? websocket::close_code::too_big : websocket::close_code::protocol_error,
            err->what);
    }
    const std::uint32_t frame_channel = std::visit(
        [](const auto& f) -> std::uint32_t {
            if constexpr (std::is_same_v<std::decay_t<decltype(f)>, FrameError>) {
                return 0;
            } else {
                return f.channel;
            }
        },
        decoded);
    if (auto it = remote_.find(frame_channel); it != remote_.end()) {
        if (auto* data = std::get_if<DataFrame>(&decoded); data && data->stream == stream_id::stdin_) {
            auto& r = it->second;
            if (r.stdin_overrun) return std::nullopt;  // the owner is ending the channel
            r.stdin_outstanding += data->payload.size();
            if (r.stdin_window != 0 && r.stdin_outstanding > r.stdin_window) {
                r.stdin_overrun = true;  // this frame still goes: the owner reports FLOW_CONTROL
                spdlog::info("peer={} channel={} overran the stdin window of its owner", peer_,
                             frame_channel);
            }
        }
        std::string copy(message);
        const auto r = it->second.remote_id;
        copy[1] = static_cast<char>((r >> 24) & 0xff);
        copy[2] = static_cast<char>((r >> 16) & 0xff);
        copy[3] = static_cast<char>((r >> 8) & 0xff);
        copy[4] = static_cast<char>(r & 0xff);
        it->second.link->send_frame(std::move(copy));
        return std::nullopt;
    }
    try {
        if (auto* data = std::get_if<DataFrame>(&decoded)) {
            auto it = channels_.find(data->channel);
            if (it == channels_.end() || data->stream != stream_id::stdin_) {
                spdlog::debug("peer={} data frame for unknown channel {} dropped", peer_,
                              data->channel);
                return std::nullopt;
            }
            it->second->write_stdin(data->payload);
        } else if (auto* credit = std::get_if<CreditFrame>(&decoded)) {
            auto it = channels_.find(credit->channel);
            if (it == channels_.end() || credit->stream == stream_id::stdin_) return std::nullopt;
            it->second->add_credit(credit->bytes);
        }
    } catch (const rpc_error& e) {
        spdlog::info("peer={} frame rejected: {}", peer_, e.what());
    }
    return std::nullopt;
}

std::shared_ptr<Channel> Session::find_channel(const json& p) {
    auto id = params::req_uint(p, "channel", 0, UINT32_MAX);
    auto it = channels_.find(static_cast<std::uint32_t>(id));
    if (it == channels_.end()) {
        throw rpc_error(errc::channel_not_found,
                        "channel " + std::to_string(id) +
                            (ended_.count(static_cast<std::uint32_t>(id))
                                 ? " has already ended"
                                 : " is not open on this connection"),
                        {{"channel", id}});
    }
    return it->second;
}

awaitable<std::optional<json>> Session::dispatch(const std::string& method, const json& raw,
                                                 const json& id) {
    if (raw.is_array()) params::invalid("params", "must be an object");
    const json p = params::object_or_empty(raw);
    if (method == "initialize") {
        params::only_keys(p, {"protocolVersion", "client"});
        auto version = params::req_uint(p, "protocolVersion", 0, UINT32_MAX);
        if (version != 1) params::invalid("protocolVersion", "only version 1 is supported");
        const auto& l = node_.config.limits;
        co_return json{{"protocolVersion", 1},
                       {"nodeId", node_.node_id},
                       {"supportedMethods", supported_methods()},
                       {"limits",
                        {{"maxTextMessage", l.max_text_message},
                         {"maxDataPayload", l.max_data_payload},
                         {"channelsPerConnection", l.channels_per_connection},
                         {"channelsPerNode", l.channels_per_node},
                         {"outputWindow", l.output_window},
                         {"stdinWindow", l.stdin_window}}}};
    }
    if (method == "leaseAcquire" || method == "leaseRenew" || method == "leaseRelease" ||
        method == "duplexChannelOpen") {
        node_.require_membership();  // self-fencing: no opens or lease changes on stale membership
    }
    if (method == "leaseAcquire") co_return to_json(co_await lease_acquire(node_, who_, p));
    if (method == "leaseGet") {
        params::only_keys(p, {"leaseId"});
        auto lease_id = params::req_string(p, "leaseId");
        Lease lease = co_await lease_get(node_, who_, std::move(lease_id));
        if (lease.owner_node_id != node_.node_id && lease.status == lease_status::active &&
            forwarded_by_.empty()) {
            // The owner answers, so that `usage` is current; without it, usage is null.
            try {
                auto link = co_await owner_link(node_, lease);
                co_return co_await link->call(method, p);
            } catch (const rpc_error& e) {
                if (e.code() != errc::owner_unavailable && e.code() != errc::owner_elsewhere) {
                    throw;
                }
            }
        }
        attach_usage(node_, lease);
        co_return to_json(lease);
    }
    if (method == "leaseList") co_return co_await lease_list(node_, who_, p);
    if (method == "leaseRenew") {
        params::only_keys(p, {"leaseId", "ttlMs"});
        params::req_string(p, "leaseId");
        params::req_uint(p, "ttlMs", 1000, UINT64_MAX >> 2);
    } else if (method == "leaseRelease") {
        params::only_keys(p, {"leaseId"});
    }
    if (method == "leaseRelease" || method == "leaseRenew") {
        // The owner releases or renews, so that its cache and channels follow.
        auto lease_id = params::req_string(p, "leaseId");
        Lease lease = co_await lease_get(node_, who_, lease_id);
        const bool settled = lease.status == lease_status::released ||
                             lease.status == lease_status::failed;
        if (lease.owner_node_id != node_.node_id && !settled && forwarded_by_.empty()) {
            std::string unavailable;
            try {
                auto link = co_await owner_link(node_, lease);
                co_return co_await link->call(method, p);
            } catch (const rpc_error& e) {
                if (e.code() != errc::owner_unavailable || method != "leaseRelease") throw;
                unavailable = e.what();
            }
            // A dead owner cannot tear down: the lease waits for cleanup instead.
            co_return to_json(co_await lease_orphan(node_, std::move(lease), std::move(unavailable)));
        }
    }
    if (method == "leaseRenew") {
        auto lease_id = params::req_string(p, "leaseId");
        auto ttl = params::req_uint(p, "ttlMs", 1000, UINT64_MAX >> 2);
        co_return to_json(co_await lease_renew(node_, who_, lease_id, ttl));
    }
    if (method == "leaseRelease") {
        auto lease_id = params::req_string(p, "leaseId");
        co_return to_json(co_await lease_release(node_, who_, std::move(lease_id)));
    }
    if (method == "nodeList") co_return co_await node_list(node_);
    if (method == "duplexChannelOpen") {
        bool responded = false;
        auto result = co_await open_channel(p, id, responded);
        if (responded) co_return std::nullopt;
        co_return result;
    }
    if (method.rfind("duplexChannel", 0) == 0 && method != "duplexChannelOpen" &&
        p.contains("channel") && p["channel"].is_number_unsigned()) {
        auto it = remote_.find(p["channel"].get<std::uint32_t>());
        if (it != remote_.end()) {
            auto remote = it->second;
            json forwarded = p;
            forwarded["channel"] = remote.remote_id;
            if (method == "duplexChannelClose") {
                remote_.erase(it);
                remote.link->forget(remote.remote_id);
            }
            co_return co_await remote.link->call(method, std::move(forwarded));
        }
    }
    if ((method == "duplexChannelWrite" || method == "duplexChannelCloseStdin") && ended(p)) {
        co_return json::object();  // the command is gone: nothing left to write to
    }
    if (method == "duplexChannelWrite") {
        params::only_keys(p, {"channel", "data"});
        auto channel = find_channel(p);
        auto data = params::opt_string(p, "data");
        if (!data) params::invalid("data", "is required (base64)");
        channel->write_stdin(decode_base64("data", *data));
        co_return json::object();
    }
    if (method == "duplexChannelCloseStdin") {
        params::only_keys(p, {"channel"});
        find_channel(p)->close_stdin();
        co_return json::object();
    }
    if (method == "duplexChannelResize") {
        params::only_keys(p, {"channel", "cols", "rows"});
        auto channel = find_channel(p);
        auto cols = params::req_uint(p, "cols", 1, 4096);
        auto rows = params::req_uint(p, "rows", 1, 4096);
        channel->resize(static_cast<std::uint16_t>(cols), static_cast<std::uint16_t>(rows));
        co_return json::object();
    }
    if (method == "duplexChannelSignal") {
        params::only_keys(p, {"channel", "signal"});
        auto channel = find_channel(p);
        auto name = params::req_string(p, "signal");
        int sig = parse_signal_name(name);
        if (sig == 0) {
            params::invalid("signal",
                            "must be one of INT, TERM, HUP, QUIT, KILL, USR1, USR2, WINCH");
        }
        channel->send_signal(sig);
        co_return json::object();
    }
    if (method == "duplexChannelStop") {
        params::only_keys(p, {"channel"});
        find_channel(p)->stop(channel_outcome::stopped);
        co_return json::object();
    }
    if (method == "duplexChannelClose") {
        params::only_keys(p, {"channel"});
        auto cid = static_cast<std::uint32_t>(params::req_uint(p, "channel", 0, UINT32_MAX));
        if (auto it = channels_.find(cid); it != channels_.end()) {
            auto channel = it->second;
            channels_.erase(it);
            channel->hangup(channel_outcome::stopped);  // stop and forget: no exit follows
        }
        co_return json::object();
    }
    throw rpc_error(errc::method_not_found, "Method not found: " + method, {{"method", method}});
}

awaitable<json> Session::open_channel(json p, const json& id, bool& responded) {
    // Step 1: the shape of the params.
    params::only_keys(p, {"hostRouteId", "lease", "command", "cwd", "env", "pty", "stdin",
                          "timeoutMs", "outputWindow", "dataEncoding"});
    ExecSpec spec;
    ChannelOptions options;
    options.host_route_id = params::opt_string(p, "hostRouteId").value_or("");
    if (!p.contains("lease") || !p["lease"].is_object()) params::invalid("lease", "must be an object");
    if (!p.contains("command") || !p["command"].is_array() || p["command"].empty()) {
        params::invalid("command", "must be an array of at least one string");
    }
    for (std::size_t i = 0; i < p["command"].size(); ++i) {
        const auto& arg = p["command"][i];
        const std::string field = "command[" + std::to_string(i) + "]";
        if (!arg.is_string()) params::invalid(field, "must be a string");
        auto s = arg.get<std::string>();
        if (s.find('\0') != std::string::npos) params::invalid(field, "must not contain NUL bytes");
        if (i == 0 && s.empty()) params::invalid(field, "must not be empty");
        spec.argv.push_back(std::move(s));
    }
    spec.cwd = params::opt_string(p, "cwd").value_or("");
    if (spec.cwd.find('\0') != std::string::npos) params::invalid("cwd", "must not contain NUL bytes");
    if (p.contains("env") && !p["env"].is_null()) {
        if (!p["env"].is_object()) params::invalid("env", "must be an object of strings");
        for (const auto& [k, v] : p["env"].items()) {
            if (!v.is_string()) params::invalid("env." + k, "must be a string");
            if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos) {
                params::invalid("env." + k, "is not a valid variable name");
            }
            auto value = v.get<std::string>();
            if (value.find('\0') != std::string::npos) params::invalid("env." + k, "must not contain NUL bytes");
            spec.env[k] = std::move(value);
        }
    }
    if (p.contains("pty") && !p["pty"].is_null()) {
        const auto& pty = p["pty"];
        if (!pty.is_object()) params::invalid("pty", "must be an object {cols, rows}");
        PtySize size;
        size.cols = static_cast<std::uint16_t>(params::req_uint(pty, "cols", 1, 4096));
        size.rows = static_cast<std::uint16_t>(params::req_uint(pty, "rows", 1, 4096));
        spec.pty = size;
    }
    spec.stdin_attached = params::opt_bool(p, "stdin").value_or(true);
    spec.drain_grace_ms = node_.config.limits.drain_grace_ms;
    if (auto t = params::opt_uint(p, "timeoutMs", 1, 30ULL * 24 * 3600000)) {
        options.timeout = std::chrono::milliseconds(*t);
    }
    options.output_window = static_cast<std::uint32_t>(
        params::opt_uint(p, "outputWindow", 1024, 1ULL << 30).value_or(node_.config.limits.output_window));
    if (auto enc = params::opt_string(p, "dataEncoding")) {
        if (*enc != "binary" && *enc != "base64") params::invalid("dataEncoding", "must be \"binary\" or \"base64\"");
        options.base64 = *enc == "base64";
    }
    options.pty = spec.pty.has_value();
    options.stdin_attached = spec.stdin_attached;
    options.stdin_window = node_.config.limits.stdin_window;
    options.hangup_grace = std::chrono::milliseconds(node_.config.limits.hangup_grace_ms);

    // Steps 2-4: the lease, its scope and status.
    json lease_param = p["lease"];
    Lease lease = co_await resolve_lease(node_, who_, std::move(lease_param));
    if (channels_.size() + remote_.size() >= node_.config.limits.channels_per_connection) {
        throw rpc_error(errc::channel_limit,
                        "this connection already has " + std::to_string(channels_.size()) +
                            " channels (limit " +
                            std::to_string(node_.config.limits.channels_per_connection) + ")");
    }
    // Step 5: another owner. A forwarded open is never forwarded again.
    if (lease.owner_node_id != node_.node_id) {
        if (!forwarded_by_.empty()) {
            throw rpc_error(errc::routing_loop,
                            "Sandbox lease " + lease.id + " is owned by node " +
                                lease.owner_node_id + ", not by node " + node_.node_id +
                                ", and this open was already forwarded by node " + forwarded_by_ + ".",
                            {{"ownerNodeId", lease.owner_node_id}, {"forwardedBy", forwarded_by_}});
        }
        auto link = co_await owner_link(node_, lease);
        // The owner compares the epoch this node routed on with its own reading (fencing).
        if (!p["lease"].contains("epoch")) p["lease"]["epoch"] = lease.epoch;
        const std::uint32_t local = next_channel_++;
        opening_[local];  // frames that overtake the open's result wait here
        json result;
        try {
            result = co_await link->open(p, std::weak_ptr<RelayTarget>(shared_from_this()), local);
        } catch (...) {
            opening_.erase(local);
            throw;
        }
        RemoteChannel route;
        route.link = link;
        route.remote_id = result.value("channel", 0U);
        route.stdin_window = result.value("stdinWindow", std::uint64_t{0});
        remote_[local] = std::move(route);
        result["channel"] = local;
        result["routed"] = true;
        spdlog::info("channel={} lease={} forwarded to node={} as channel {} peer={}", local,
                     lease.id, lease.owner_node_id, remote_[local].remote_id, peer_);
        respond(id, std::move(result));
        responded = true;
        auto early = std::move(opening_[local]);
        opening_.erase(local);
        for (auto& [binary, bytes] : early) (binary ? send_binary(std::move(bytes)) : send_text(std::move(bytes)));
        if (!early.empty() && !early.back().first) remote_.erase(local);  // its exit came early
        co_return json();
    }
    // Step 6: this node owns it; its cache must hold the sandbox.
    struct {
        Lease lease;
        std::shared_ptr<SandboxHandle> sandbox;
    } resolved;
    resolved.sandbox = cached_sandbox(node_, lease);
    resolved.lease = std::move(lease);

    if (channels_.size() >= node_.config.limits.channels_per_connection) {
        throw rpc_error(errc::channel_limit,
                        "this connection already has " + std::to_string(channels_.size()) +
                            " channels (limit " +
                            std::to_string(node_.config.limits.channels_per_connection) + ")");
    }
    if (!node_.channels.try_reserve(node_.config.limits.channels_per_node)) {
        throw rpc_error(errc::channel_limit,
                        "this node already runs its limit of " +
                            std::to_string(node_.config.limits.channels_per_node) + " channels");
    }
    std::unique_ptr<ChannelBackend> backend;
    try {
        backend = co_await node_.providers.at(resolved.lease.provider)->open(resolved.sandbox, spec);
    } catch (...) {
        node_.channels.unreserve();
        throw;
    }
    options.id = next_channel_++;
    options.lease_id = resolved.lease.id;
    auto channel = std::make_shared<Channel>(strand_, options, std::move(backend),
                                             resolved.sandbox, weak_from_this());
    ChannelTable::Entry entry;
    entry.channel = channel;
    entry.strand = strand_;
    entry.lease_id = resolved.lease.id;
    auto key = node_.channels.add(std::move(entry));
    // on_reaped is set after add() so the key is known; it runs on this strand.
    channel->set_on_reaped([&node = node_, key] { node.channels.remove(key); });
    channels_.emplace(options.id, channel);
    node_.channels_opened.fetch_add(1, std::memory_order_relaxed);
    spdlog::info("channel={} lease={} opened: {} pty={} peer={}", options.id, options.lease_id,
                 spec.argv.front(), options.pty, peer_);
    // The result goes out before the first data frame of the channel.
    respond(id, json{{"channel", options.id},
                     {"hostRouteId", options.host_route_id},
                     {"workerSessionId", node_.node_id + "/" + std::to_string(options.id)},
                     {"ownerNodeId", node_.node_id},
                     {"routed", false},
                     {"stdinWindow", options.stdin_window},
                     {"outputWindow", options.output_window}});
    responded = true;
    channel->start();
    co_return json();
}

}  // namespace sandboxd
