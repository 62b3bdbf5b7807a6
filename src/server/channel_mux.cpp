#include "server/channel_mux.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include <spdlog/spdlog.h>

namespace sandboxd {

ChannelMux::ChannelMux(ChannelSink& out, std::size_t max_data_payload, std::string peer,
                       const ChannelByteCounters* bytes, std::atomic<std::int64_t>* relays)
    : out_(out),
      max_data_payload_(max_data_payload),
      peer_(std::move(peer)),
      bytes_(bytes),
      relays_(relays) {}

void ChannelMux::opening(std::uint32_t id) {
    opening_[id];
    count_relays();
}

void ChannelMux::open_failed(std::uint32_t id) {
    opening_.erase(id);
    count_relays();
}

ChannelMux::~ChannelMux() {
    if (relays_ && relays_counted_ != 0)
        relays_->fetch_sub(relays_counted_, std::memory_order_acq_rel);
}

void ChannelMux::count_relays() {
    const auto now = static_cast<std::int64_t>(relayed_.size() + opening_.size());
    if (relays_ && now != relays_counted_)
        relays_->fetch_add(now - relays_counted_, std::memory_order_acq_rel);
    relays_counted_ = now;
}

void ChannelMux::add_local(std::uint32_t id, std::shared_ptr<Channel> channel) {
    local_.emplace(id, std::move(channel));
}

std::shared_ptr<Channel> ChannelMux::local(std::uint32_t id) const {
    auto it = local_.find(id);
    if (it == local_.end()) {
        throw rpc_error(
            errc::channel_not_found,
            "channel " + std::to_string(id) +
                (ended_.count(id) ? " has already ended" : " is not open on this connection"),
            {{"channel", id}});
    }
    return it->second;
}

std::shared_ptr<Channel> ChannelMux::take_local(std::uint32_t id) {
    auto node = local_.extract(id);
    return node ? std::move(node.mapped()) : nullptr;
}

void ChannelMux::add_attached(std::uint32_t id, Attached attached) {
    attached_[id] = std::move(attached);
}

std::optional<ChannelMux::Attached> ChannelMux::take_attached(std::uint32_t id) {
    auto node = attached_.extract(id);
    if (!node) return std::nullopt;
    return std::move(node.mapped());
}

const ChannelMux::Attached* ChannelMux::attached(std::uint32_t id) const {
    auto it = attached_.find(id);
    return it == attached_.end() ? nullptr : &it->second;
}

void ChannelMux::finished(std::uint32_t id) {
    local_.erase(id);
    attached_.erase(id);
    // Remembered so that a write or half-close racing the exit is a harmless no-op.
    ended_.insert(id);
    if (ended_.size() > 4096) ended_.erase(ended_.begin());
}

void ChannelMux::opened(std::uint32_t id, Relayed route) {
    relayed_[id] = std::move(route);
    auto early = std::move(opening_[id]);
    opening_.erase(id);
    for (auto& [kind, bytes] : early) {
        if (kind == early_kind::binary) {
            out_.send_binary(std::move(bytes));
        } else {
            out_.send_text(std::move(bytes));
        }
    }
    if (!early.empty() && early.back().first == early_kind::exit) {
        relayed_.erase(id);  // its exit came early
    }
    count_relays();
}

const ChannelMux::Relayed* ChannelMux::relayed(std::uint32_t id) const {
    auto it = relayed_.find(id);
    return it == relayed_.end() ? nullptr : &it->second;
}

std::optional<ChannelMux::Relayed> ChannelMux::take_relayed(std::uint32_t id) {
    auto node = relayed_.extract(id);
    if (!node) return std::nullopt;
    count_relays();
    return std::move(node.mapped());
}

void ChannelMux::relay_binary(std::uint32_t id, std::string frame) {
    if (auto it = opening_.find(id); it != opening_.end()) {
        it->second.emplace_back(early_kind::binary, std::move(frame));
        return;
    }
    auto it = relayed_.find(id);
    if (it == relayed_.end()) return;
    // Only stdin credits change the relay's count; data frames pass without being parsed
    // (the stream byte of their checked header is counted).
    if (bytes_ && frame.size() > frame_header_size &&
        frame[0] == static_cast<char>(frame_kind::data)) {
        bytes_->count(static_cast<stream_id>(frame[5]), frame.size() - frame_header_size);
    }
    if (!frame.empty() && frame[0] == static_cast<char>(frame_kind::credit)) {
        auto decoded = decode_frame(frame, max_data_payload_);
        if (auto* credit = std::get_if<CreditFrame>(&decoded);
            credit && credit->stream == stream_id::stdin_) {
            auto& r = it->second;
            r.stdin_outstanding -= std::min<std::uint64_t>(credit->bytes, r.stdin_outstanding);
        }
    }
    out_.send_binary(std::move(frame));
}

void ChannelMux::relay_exit(std::uint32_t id, nlohmann::json exit_params) {
    auto text = jsonrpc::notification("duplexChannel.exit", std::move(exit_params));
    if (auto it = opening_.find(id); it != opening_.end()) {
        it->second.emplace_back(early_kind::exit, std::move(text));
        return;
    }
    if (relayed_.erase(id)) {
        count_relays();
        out_.send_text(std::move(text));
    }
}

void ChannelMux::relay_gap(std::uint32_t id, nlohmann::json gap_params) {
    auto text = jsonrpc::notification("duplexChannel.gap", std::move(gap_params));
    if (auto it = opening_.find(id); it != opening_.end()) {
        it->second.emplace_back(early_kind::notice, std::move(text));
        return;
    }
    if (relayed_.count(id)) out_.send_text(std::move(text));
}

std::variant<std::uint32_t, websocket::close_reason> ChannelMux::check_frame(
    std::string_view message) const {
    auto decoded = decode_frame(message, max_data_payload_);
    if (auto* err = std::get_if<FrameError>(&decoded)) {
        spdlog::info("peer={} bad binary frame: {}", peer_, err->what);
        return websocket::close_reason(
            err->too_big ? websocket::close_code::too_big : websocket::close_code::protocol_error,
            err->what);
    }
    if (auto* data = std::get_if<DataFrame>(&decoded)) return data->channel;
    return std::get<CreditFrame>(decoded).channel;
}

void ChannelMux::apply_frame(std::string_view message) {
    auto decoded = decode_frame(message, max_data_payload_);
    const auto* data = std::get_if<DataFrame>(&decoded);
    const auto* credit = std::get_if<CreditFrame>(&decoded);
    if (!data && !credit) return;  // checked on arrival: cannot happen
    const std::uint32_t channel = data ? data->channel : credit->channel;
    if (auto it = relayed_.find(channel); it != relayed_.end()) {
        auto& r = it->second;
        if (data && data->stream == stream_id::stdin_) {
            if (r.stdin_overrun) return;  // the owner is ending the channel
            if (bytes_) bytes_->count(stream_id::stdin_, data->payload.size());
            r.stdin_outstanding += data->payload.size();
            if (r.stdin_window != 0 && r.stdin_outstanding > r.stdin_window) {
                r.stdin_overrun = true;  // this frame still goes: the owner reports FLOW_CONTROL
                spdlog::info(
                    "peer={} channel={}/{} (connection channel {}) overran the stdin "
                    "window of its owner",
                    peer_, r.link->peer_id(), r.remote_id, channel);
            }
        }
        std::string copy(message);
        set_frame_channel(copy, r.remote_id);
        r.link->send_frame(std::move(copy));
        return;
    }
    if (auto it = attached_.find(channel); it != attached_.end()) {
        const auto& a = it->second;
        if (data && data->stream == stream_id::stdin_) {
            net::post(a.strand, [ch = a.channel, bytes = std::string(data->payload), peer = peer_] {
                try {
                    ch->write_stdin(bytes);
                } catch (const rpc_error& e) {
                    spdlog::info("peer={} frame rejected: {}", peer, e.what());
                }
            });
        } else if (credit && credit->stream != stream_id::stdin_) {
            net::post(a.strand, [out = a.output, n = credit->bytes] { out->add_credit(n); });
        }
        return;
    }
    try {
        auto it = local_.find(channel);
        if (data) {
            if (it == local_.end() || data->stream != stream_id::stdin_) {
                spdlog::debug("peer={} data frame for unknown channel {} dropped", peer_, channel);
                return;
            }
            it->second->write_stdin(data->payload);
        } else {
            if (it == local_.end() || credit->stream == stream_id::stdin_) return;
            it->second->add_credit(credit->bytes);
        }
    } catch (const rpc_error& e) {
        spdlog::info("peer={} frame rejected: {}", peer_, e.what());
    }
}

void ChannelMux::close_all() {
    for (auto& [id, channel] : local_) channel->hangup();
    local_.clear();
    for (auto& [id, a] : attached_) {
        net::post(a.strand, [out = a.output, id = a.attachment] { out->detach(id); });
    }
    attached_.clear();
    for (auto& [id, route] : relayed_) {
        route.link->close_channel(route.remote_id, route.forwarded_for);
        route.link->forget(route.remote_id);
    }
    relayed_.clear();
    count_relays();
}

}  // namespace sandboxd
