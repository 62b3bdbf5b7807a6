#include "server/peer_link.hpp"

#include "server/node.hpp"
#include "server/task_failure.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

namespace sandboxd {
namespace {

using json = nlohmann::json;

constexpr auto connect_timeout = std::chrono::seconds(3);

rpc_error unavailable(const std::string& peer, const std::string& why) {
    return rpc_error(errc::owner_unavailable,
                     "Owner node " + peer + " is unavailable: " + why + ".",
                     {{"ownerNodeId", peer}});
}

std::uint32_t frame_channel(std::string_view f) {
    auto b = [&](int i) { return static_cast<std::uint32_t>(static_cast<unsigned char>(f[i])); };
    return (b(1) << 24) | (b(2) << 16) | (b(3) << 8) | b(4);
}

}  // namespace

PeerLink::PeerLink(Node& node, NodeRecord peer, std::string peer_token, net::any_io_executor strand)
    : node_(node),
      peer_(std::move(peer)),
      token_(std::move(peer_token)),
      strand_(strand),
      connect_wait_(strand),
      out_wake_(strand) {
    connect_wait_.expires_at(net::steady_timer::time_point::max());
    out_wake_.expires_at(net::steady_timer::time_point::max());
}

PeerLink::~PeerLink() = default;

awaitable<json> PeerLink::call(std::string method, json params, json forwarded_for) {
    co_return co_await net::co_spawn(
        strand_, do_call(std::move(method), std::move(params), std::move(forwarded_for), {}, 0),
        use_awaitable);
}

awaitable<json> PeerLink::call(std::string method, json params, json forwarded_for, Notify notify,
                               std::chrono::milliseconds answer_within) {
    co_return co_await net::co_spawn(
        strand_,
        do_call(std::move(method), std::move(params), std::move(forwarded_for), {}, 0,
                std::move(notify), answer_within),
        use_awaitable);
}

awaitable<json> PeerLink::open(std::string method, json params, json forwarded_for,
                               std::weak_ptr<RelayTarget> target, std::uint32_t local_channel) {
    co_return co_await net::co_spawn(
        strand_,
        do_call(std::move(method), std::move(params), std::move(forwarded_for), std::move(target),
                local_channel),
        use_awaitable);
}

awaitable<void> PeerLink::ensure_connected() {
    while (connecting_) co_await connect_wait_.async_wait(as_tuple_awaitable);
    if (broken_) throw unavailable(peer_.node_id, broken_reason_);
    if (connected_) co_return;
    connecting_ = true;
    try {
        co_await connect();
    } catch (const rpc_error& e) {
        connecting_ = false;
        broken_ = true;
        abandoned_opens_.clear();
        broken_reason_ = e.what();
        connect_wait_.cancel();
        throw;
    }
}

awaitable<void> PeerLink::connect() {
    WsUrl url;
    try {
        url = parse_ws_url(peer_.url);
    } catch (const address_error& e) {
        throw unavailable(peer_.node_id, "its url " + std::string(e.what()));
    }
    if (node_.peer_dialer) {
        ConnStream stream = co_await node_.peer_dialer(url, strand_);
        ws_.emplace(std::move(stream));
    } else {
        ConnStream stream = co_await dial(url);
        ws_.emplace(std::move(stream));
    }
    auto& lowest = beast::get_lowest_layer(*ws_);
    set_upgrade_options();
    auto [hec] =
        co_await ws_->async_handshake(url.endpoint.authority(), url.target, as_tuple_awaitable);
    if (hec)
        throw unavailable(peer_.node_id,
                          "handshake with " + peer_.url + " failed: " + hec.message());
    lowest.expires_never();
    websocket::stream_base::timeout timeouts{};
    timeouts.handshake_timeout = std::chrono::seconds(10);
    timeouts.idle_timeout = std::chrono::milliseconds(node_.config.limits.idle_timeout_ms);
    timeouts.keep_alive_pings = true;
    ws_->set_option(timeouts);
    connected_ = true;
    up_ = true;
    connecting_ = false;
    connect_wait_.cancel();
    auto self = shared_from_this();
    auto log = [self](const std::exception_ptr& e) {
        if (e)
            log_task_failure("peer=" + self->peer_.node_id + " link task", e, spdlog::level::warn);
    };
    net::co_spawn(strand_, read_loop(), log);
    net::co_spawn(strand_, write_loop(), log);
    spdlog::info("peer={} link up ({})", peer_.node_id, peer_.url);
}

awaitable<ConnStream> PeerLink::dial(const WsUrl& url) {
    const std::string& host = url.endpoint.host;
    std::optional<ConnStream> stream;
    if (url.tls) {
        // routing.peerTls: the cluster CA and this node's certificate; without it, the
        // system's trust store and no client certificate.
        auto tls = node_.security()->peer_client_tls;
        if (!tls) tls = make_client_tls(TlsClientOptions{}, "routing.peerTls");
        stream.emplace(beast::tcp_stream(strand_), tls);
    } else {
        stream.emplace(beast::tcp_stream(strand_));
    }
    tcp::resolver resolver(strand_);
    auto [rec, endpoints] =
        co_await resolver.async_resolve(host, url.endpoint.port_text(), as_tuple_awaitable);
    if (rec) throw unavailable(peer_.node_id, "cannot resolve " + host + ": " + rec.message());
    // One deadline for the connect, the TLS handshake and the upgrade (connect() clears it).
    auto& lowest = stream->next_layer();
    lowest.expires_after(connect_timeout);
    auto [cec, ep] = co_await lowest.async_connect(endpoints, as_tuple_awaitable);
    if (cec)
        throw unavailable(peer_.node_id, "cannot connect to " + peer_.url + ": " + cec.message());
    if (auto* t = stream->tls()) {
        expect_server_name(t->native_handle(), host, true);
        auto [tec] = co_await t->async_handshake(ssl::stream_base::client, as_tuple_awaitable);
        if (tec)
            throw unavailable(peer_.node_id,
                              "TLS handshake with " + peer_.url + " failed: " + tec.message());
    }
    co_return std::move(*stream);
}

void PeerLink::set_upgrade_options() {
    ws_->set_option(websocket::stream_base::decorator(
        [token = token_, me = node_.node_id, to = peer_.node_id](websocket::request_type& req) {
            req.set(http::field::authorization, "Bearer " + token);
            req.set(http::field::sec_websocket_protocol, "sandboxd.v1");
            req.set(http::field::user_agent, std::string("sandboxd-peer/") + version_string);
            req.set("Sandboxd-Forwarded-By", me);
            // The node meant: another node that answers at its address refuses (421).
            req.set("Sandboxd-Forwarded-To", to);
        }));
    ws_->read_message_max(64ULL << 20);
    ws_->auto_fragment(false);
    ws_->write_buffer_bytes(512 * 1024);  // masking buffer: one write per relayed frame
    beast::error_code nodelay_ec;
    beast::get_lowest_layer(*ws_).socket().set_option(tcp::no_delay(true), nodelay_ec);
}

awaitable<json> PeerLink::do_call(std::string method, json params, json forwarded_for,
                                  std::weak_ptr<RelayTarget> target, std::uint32_t local_channel,
                                  Notify notify,
                                  std::optional<std::chrono::milliseconds> answer_within_override) {
    auto self = shared_from_this();
    co_await ensure_connected();
    if (broken_) throw unavailable(peer_.node_id, broken_reason_);
    const auto id = next_id_++;
    // A peer that does not answer within its liveness TTL (frozen, partitioned after the
    // handshake) is unavailable: the caller fails closed instead of waiting forever. A peer
    // whose membership stays live (renewed within the TTL: overloaded, or slow to tear a
    // sandbox down) is given another TTL each time, up to max_answer_ttls TTLs in all: its
    // answer, not a timeout here, says what happened to the lease.
    const auto ttl = std::chrono::milliseconds(node_.config.node_ttl_ms);
    const auto started = std::chrono::steady_clock::now();
    const auto limit =
        started + (answer_within_override ? *answer_within_override : ttl * max_answer_ttls);
    auto deadline = answer_within_override ? limit : started + ttl;
    auto& slot = pending_[id];
    slot.wake = std::make_unique<net::steady_timer>(strand_);
    slot.wake->expires_at(deadline);
    slot.target = std::move(target);
    slot.local_channel = local_channel;
    slot.notify = std::move(notify);
    const bool open = !slot.target.expired();  // an open or an attach: a channel to close if late
    json for_close = open ? forwarded_for : json();
    queue(false,
          jsonrpc::forwarded_request(id, method, std::move(params), std::move(forwarded_for)));
    bool live = false;  // the peer's membership was live when its last TTL ran out
    for (;;) {
        while (!pending_[id].response && !broken_ && std::chrono::steady_clock::now() < deadline) {
            co_await pending_[id].wake->async_wait(as_tuple_awaitable);
        }
        if (pending_[id].response || broken_ || deadline >= limit) break;
        live = co_await peer_membership_live();
        if (!live || pending_[id].response || broken_) break;
        deadline = std::min(limit, std::chrono::steady_clock::now() + ttl);
        pending_[id].wake->expires_at(deadline);
    }
    auto node = pending_.extract(id);
    if (!node.mapped().response && open && !broken_) {
        abandoned_opens_[id] = std::move(for_close);  // closed on the owner if it answers late
    }
    if (!node.mapped().response) {
        if (broken_) throw unavailable(peer_.node_id, broken_reason_);
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - started);
        throw unavailable(peer_.node_id, "it did not answer " + method + " within " +
                                             std::to_string(waited.count()) + " ms" +
                                             (answer_within_override ? ""
                                              : live ? " (its membership stayed live)"
                                                     : " and its membership lapsed"));
    }
    co_return jsonrpc::result_or_throw(std::move(*node.mapped().response));
}

awaitable<bool> PeerLink::peer_membership_live() {
    try {
        auto record = co_await node_.registry->get_node(peer_.node_id);
        co_return record &&
            record->instance_id == peer_.instance_id&& node_.member_alive(*record, now_ms());
    } catch (const std::exception& e) {
        // Unknown is not live: the call fails closed as it would have without the check.
        spdlog::warn("peer={}: cannot read its membership: {}", peer_.node_id, e.what());
        co_return false;
    }
}

void PeerLink::queue(bool binary, std::string bytes) {
    out_.emplace_back(binary, std::move(bytes));
    out_wake_.cancel();
}

void PeerLink::send_frame(std::string frame) {
    net::post(strand_, [self = shared_from_this(), frame = std::move(frame)]() mutable {
        if (self->connected_ && !self->broken_) self->queue(true, std::move(frame));
    });
}

void PeerLink::close_channel(std::uint32_t remote_channel, json forwarded_for) {
    net::post(strand_, [self = shared_from_this(), remote_channel,
                        forwarded_for = std::move(forwarded_for)]() mutable {
        if (!self->connected_ || self->broken_) return;
        self->queue(false, jsonrpc::forwarded_request(nullptr, "duplexChannelClose",
                                                      {{"channel", remote_channel}},
                                                      std::move(forwarded_for)));
    });
}

void PeerLink::forget(std::uint32_t remote_channel) {
    net::post(strand_,
              [self = shared_from_this(), remote_channel] { self->routes_.erase(remote_channel); });
}

awaitable<void> PeerLink::write_loop() {
    auto self = shared_from_this();
    while (!broken_) {
        if (out_.empty()) {
            co_await out_wake_.async_wait(as_tuple_awaitable);
            continue;
        }
        auto item = std::move(out_.front());
        out_.pop_front();
        ws_->binary(item.first);
        auto [ec, n] = co_await ws_->async_write(net::buffer(item.second), as_tuple_awaitable);
        if (ec) {
            fail_all("write failed: " + ec.message());
            co_return;
        }
    }
}

awaitable<void> PeerLink::read_loop() {
    auto self = shared_from_this();
    beast::flat_buffer buffer;
    for (;;) {
        auto [ec, n] = co_await ws_->async_read(buffer, as_tuple_awaitable);
        if (ec) {
            fail_all("the link closed: " + ec.message());
            co_return;
        }
        const auto data = buffer.data();
        std::string_view message(static_cast<const char*>(data.data()), data.size());
        if (ws_->got_text()) {
            on_text(std::string(message));
        } else {
            on_binary(message);
        }
        buffer.consume(buffer.size());
    }
}

void PeerLink::on_text(const std::string& text) {
    auto message = jsonrpc::parse_message(text);
    if (auto* response = std::get_if<jsonrpc::Response>(&message)) {
        auto it =
            pending_.find(response->id.is_number_integer() ? response->id.get<std::int64_t>() : -1);
        const auto& r = response->result;
        const bool opened =
            r && r->is_object() && r->contains("channel") && (*r)["channel"].is_number_unsigned();
        if (it == pending_.end()) {
            // An open answered after its caller gave up (timeout): nobody will read that
            // channel, so it is closed on the owner rather than left running.
            auto abandoned = abandoned_opens_.find(
                response->id.is_number_integer() ? response->id.get<std::int64_t>() : -1);
            if (abandoned == abandoned_opens_.end()) return;
            if (opened) {
                close_channel((*r)["channel"].get<std::uint32_t>(), std::move(abandoned->second));
            }
            abandoned_opens_.erase(abandoned);
            return;
        }
        // An open's route exists before the next frame is read: no data is ever unrouted.
        if (opened && !it->second.target.expired()) {
            routes_[(*r)["channel"].get<std::uint32_t>()] = {it->second.target,
                                                             it->second.local_channel};
        }
        it->second.response = std::move(*response);
        it->second.wake->cancel();
        return;
    }
    auto* notification = std::get_if<jsonrpc::Request>(&message);
    if (notification && notification->method == "leaseExecute.log") {
        // A forwarded call's output, for the call waiting under that id (none: dropped).
        const auto& p = notification->params;
        const json* id = p.is_object() && p.contains("requestId") ? &p["requestId"] : nullptr;
        auto it =
            id && id->is_number_integer() ? pending_.find(id->get<std::int64_t>()) : pending_.end();
        if (it == pending_.end() || !it->second.notify.fn || it->second.response) return;
        net::post(it->second.notify.executor,
                  [fn = it->second.notify.fn, params = std::move(notification->params)]() mutable {
                      fn(std::move(params));
                  });
        return;
    }
    if (!notification) return;
    const bool exit = notification->method == "duplexChannel.exit";
    if (!exit && notification->method != "duplexChannel.gap") return;
    auto params = std::move(notification->params);
    if (!params.is_object()) return;
    const auto remote = params.value("channel", 0U);
    auto it = routes_.find(remote);
    if (it == routes_.end()) return;
    auto route = it->second;
    if (!exit) {
        if (auto target = route.target.lock()) {
            params["channel"] = route.local_channel;
            net::post(target->relay_executor(),
                      [target, local = route.local_channel, params = std::move(params)]() mutable {
                          target->relay_gap(local, std::move(params));
                      });
        }
        return;
    }
    routes_.erase(it);
    if (auto target = route.target.lock()) {
        params["channel"] = route.local_channel;
        net::post(target->relay_executor(),
                  [target, local = route.local_channel, params = std::move(params)]() mutable {
                      target->relay_exit(local, std::move(params));
                  });
    }
}

void PeerLink::on_binary(std::string_view frame) {
    if (frame.size() < frame_header_size) return;
    auto it = routes_.find(frame_channel(frame));
    if (it == routes_.end()) return;
    auto target = it->second.target.lock();
    if (!target) return;
    std::string copy(frame);
    set_frame_channel(copy, it->second.local_channel);
    net::post(target->relay_executor(),
              [target, local = it->second.local_channel, copy = std::move(copy)]() mutable {
                  target->relay_binary(local, std::move(copy));
              });
}

void PeerLink::fail_all(const std::string& why) {
    if (broken_) return;
    broken_ = true;
    abandoned_opens_.clear();
    broken_reason_ = why;
    connected_ = false;
    up_ = false;
    spdlog::warn("peer={} link down: {}", peer_.node_id, why);
    for (auto& [id, p] : pending_) p.wake->cancel();
    for (auto& [remote, route] : routes_) {
        if (auto target = route.target.lock()) {
            json params = {{"channel", route.local_channel},
                           {"exitCode", nullptr},
                           {"signal", nullptr},
                           {"outcome", "transportClosed"},
                           {"stdoutBytes", nullptr},
                           {"stderrBytes", nullptr},
                           {"stdinBytes", nullptr},
                           {"durationMs", nullptr}};
            net::post(target->relay_executor(),
                      [target, local = route.local_channel, params = std::move(params)]() mutable {
                          target->relay_exit(local, std::move(params));
                      });
        }
    }
    routes_.clear();
    out_wake_.cancel();
    beast::error_code ec;
    if (ws_) beast::get_lowest_layer(*ws_).socket().close(ec);
}

std::shared_ptr<PeerLink> PeerLinks::get(Node& node, const NodeRecord& peer,
                                         const std::string& token, net::io_context& ioc) {
    std::lock_guard lock(mutex_);
    auto& link = links_[peer.node_id];
    if (!link || link->broken()) {
        link = std::make_shared<PeerLink>(node, peer, token, net::make_strand(ioc));
    }
    return link;
}

std::map<std::string, bool> PeerLinks::states() {
    std::lock_guard lock(mutex_);
    std::map<std::string, bool> up;
    for (const auto& [id, link] : links_) up.emplace(id, link->up());
    return up;
}

void PeerLinks::clear() {
    std::map<std::string, std::shared_ptr<PeerLink>> links;
    {
        std::lock_guard lock(mutex_);
        links.swap(links_);
    }
}  // the links die here, outside the lock

}  // namespace sandboxd
