#pragma once
// One host-server WebSocket connection (docs/protocol.md section 1): reads JSON-RPC text
// frames and binary data frames, owns the channels opened on it, and writes through a single
// queue so that writes never overlap (Beast allows one outstanding async_write).
//
// Threading: everything runs on the session's strand; the session is kept alive by its
// coroutines (enable_shared_from_this); channels hold it by weak_ptr.
#include "server/channel.hpp"
#include "server/frame_guard.hpp"
#include "server/node.hpp"

#include <nlohmann/json.hpp>

#include <deque>
#include <map>
#include <set>

namespace sandboxd {

class Session final : public ChannelSink,
                      public RelayTarget,
                      public std::enable_shared_from_this<Session> {
public:
    Session(Node& node, websocket::stream<beast::tcp_stream> ws, const Principal& who);
    ~Session() override;
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    /// Accepts the upgrade `request` and serves the connection until it closes.
    awaitable<void> run(http::request<http::string_body> request);

    /// Closes the connection (1001 going away) from any thread; channels are hung up.
    void shutdown();

    void send_binary(std::string frame) override;
    void send_text(std::string text) override;
    void channel_finished(std::uint32_t channel) override;

    void relay_binary(std::uint32_t local_channel, std::string frame) override;
    void relay_exit(std::uint32_t local_channel, nlohmann::json exit_params) override;
    net::any_io_executor relay_executor() override;

private:
    struct Outgoing {
        bool binary;
        std::string bytes;
    };

    awaitable<void> read_loop();
    awaitable<void> write_loop();
    awaitable<void> ping_loop();
    /// Drops the connection once nothing (no message, ping or pong) has been heard from the
    /// peer for limits.idleTimeoutMs while reading.
    awaitable<void> idle_loop();
    awaitable<void> handle_text(std::string text);
    /// Applies one binary frame; a close reason when the frame breaks the protocol.
    std::optional<websocket::close_reason> handle_binary(std::string_view message);
    awaitable<std::optional<nlohmann::json>> dispatch(const std::string& method,
                                                       const nlohmann::json& params,
                                                       const nlohmann::json& id);
    awaitable<nlohmann::json> open_channel(nlohmann::json params, const nlohmann::json& id,
                                           bool& responded);
    std::shared_ptr<Channel> find_channel(const nlohmann::json& params);
    /// Whether params.channel names a channel of this connection that has already ended.
    bool ended(const nlohmann::json& params) const;
    void respond(const nlohmann::json& id, nlohmann::json result);
    void respond_error(const nlohmann::json& id, const nlohmann::json& error);
    void close_all_channels();

    Node& node_;
    websocket::stream<frame_guard<beast::tcp_stream>> ws_;  // see frame_guard.hpp
    Principal who_;
    strand_t strand_;
    std::deque<Outgoing> queue_;
    net::steady_timer queue_timer_;  // woken (cancelled) when the queue gets work
    net::steady_timer ping_timer_;   // ping_loop's; cancelled when the session ends
    net::steady_timer idle_timer_;   // idle_loop's; cancelled when the session ends
    std::chrono::steady_clock::time_point last_heard_;  // last frame read from the peer
    bool reading_ = false;  // a read is outstanding (idle_loop counts silence only then)
    bool closing_ = false;
    std::map<std::uint32_t, std::shared_ptr<Channel>> channels_;
    std::set<std::uint32_t> ended_;  // the last 4096 ended channels' ids
    /// Channels forwarded to their owner: local id -> the link and the owner's channel id.
    struct RemoteChannel {
        std::shared_ptr<PeerLink> link;
        std::uint32_t remote_id = 0;
        /// The owner's stdin window and the stdin bytes relayed that it has not credited back:
        /// this relay forwards at most the window plus the one frame that overruns it (the
        /// owner then ends the channel with FLOW_CONTROL) and drops the host's stdin after
        /// that, so a host that ignores the window costs this node no more than the window.
        std::uint64_t stdin_window = 0;
        std::uint64_t stdin_outstanding = 0;
        bool stdin_overrun = false;
    };
    std::map<std::uint32_t, RemoteChannel> remote_;
    /// Forwarded opens awaiting their result: frames that overtake it, in order.
    std::map<std::uint32_t, std::vector<std::pair<bool, std::string>>> opening_;
    /// The node that forwarded this connection's opens (peer tokens only), else "".
    std::string forwarded_by_;
    std::uint32_t next_channel_ = 1;
    std::string peer_;
};

}  // namespace sandboxd
