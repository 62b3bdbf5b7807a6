#pragma once
// One host-server WebSocket connection (docs/protocol.md section 1), in three parts:
//  - the transport (server/transport.hpp): the upgrade, reads, one write queue, pings and the
//    idle drop; it hands each message to the session (its Receiver);
//  - the method table (server/method_table.hpp): each JSON-RPC method's flags and handler
//    (typed params parsed once; the handlers are in lease_methods.cpp and
//    channel_service.cpp and see the session as a Connection);
//  - the channel multiplexer (server/channel_mux.hpp): local and relayed channels.
//
// Requests run concurrently (docs/protocol.md, "Concurrency"): each one is its own coroutine
// on the connection's strand, at most limits.requestsPerConnection at once. Requests and
// binary frames that name the same channel are applied in arrival order: while a request on
// a channel runs, later requests and frames for that channel wait in the channel's lane.
//
// Threading: everything runs on the session's strand; the session is kept alive by its
// coroutines (enable_shared_from_this); channels hold it by weak_ptr.
#include "server/channel.hpp"
#include "server/channel_mux.hpp"
#include "server/connection.hpp"
#include "server/method_table.hpp"
#include "server/methods.hpp"
#include "server/node.hpp"
#include "server/transport.hpp"

#include <sandboxd/core/jsonrpc.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <variant>

namespace sandboxd {

class Session final : public Connection,
                      public ChannelSink,
                      public RelayTarget,
                      public Transport::Receiver,
                      public std::enable_shared_from_this<Session> {
public:
    /// `stream`: the connection, its upgrade request read (by the server) and not answered.
    Session(Node& node, ConnStream stream, Principal who);
    ~Session() override;
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    /// Accepts the upgrade `request` and serves the connection until it closes.
    awaitable<void> run(http::request<http::string_body> request);

    /// Closes the connection (1001 going away) from any thread; channels are hung up.
    void shutdown();
    /// True once the connection has written everything queued before shutdown() and started
    /// its close handshake, or has ended. Thread-safe.
    [[nodiscard]] bool close_written() const noexcept { return transport_.close_written(); }
    /// Closes the connection with 1008 (policy violation) from any thread, its channels hung
    /// up: its token was revoked (a reload no longer has it).
    void revoke();
    // Connection (connection.hpp)
    Node& node() override { return node_; }
    /// The token the connection authenticated with. Immutable.
    const Principal& principal() const noexcept override { return who_; }
    ChannelMux& mux() override { return mux_; }
    const strand_t& strand() const noexcept override { return strand_; }
    const std::string& peer() const noexcept override { return peer_; }
    const std::string& forwarded_by() const noexcept override { return forwarded_by_; }
    bool closing() const noexcept override { return transport_.closing(); }
    std::weak_ptr<ChannelSink> channel_sink() override { return weak_from_this(); }
    std::weak_ptr<RelayTarget> relay_target() override { return weak_from_this(); }

    void send_binary(std::string frame) override;
    std::string frame_buffer() override;
    bool can_splice() override;
    void send_spliced(std::string head, int pipe_fd, std::size_t count,
                      std::function<void(bool written)> done) override;
    void send_text(std::string text) override;
    bool has_send_room() override { return transport_.has_room(); }
    void when_send_room(std::function<void()> resume) override;
    void channel_finished(std::uint32_t channel) override;
    /// Completes once this connection has send room (at once when it has), or is closing.
    /// On the strand.
    awaitable<void> wait_send_room() override;

    void relay_binary(std::uint32_t local_channel, std::string frame) override;
    void relay_exit(std::uint32_t local_channel, nlohmann::json exit_params) override;
    void relay_gap(std::uint32_t local_channel, nlohmann::json gap_params) override;
    net::any_io_executor relay_executor() override;

private:
    /// What waits in a channel's lane: a request or a binary frame.
    using Queued = std::variant<jsonrpc::Request, std::string>;
    struct Lane {
        std::deque<Queued> waiting;
    };

    void respond(const nlohmann::json& id, nlohmann::json result);
    void respond_error(const nlohmann::json& id, const nlohmann::json& error);

    // admission and ordering (Transport::Receiver)
    /// A request; on a peer link it waits while limits.requestsPerConnection are in flight.
    awaitable<void> on_text(std::string_view text) override;
    /// A close reason when the frame breaks the protocol.
    std::optional<websocket::close_reason> on_binary(std::string_view message) override;
    void admit(jsonrpc::Request request);
    /// Runs an admitted request, or queues it behind its channel's lane or behind the opens
    /// in flight (see after_opens_).
    void route(jsonrpc::Request request);
    /// Applies a checked binary frame, or queues it likewise.
    void route_frame(std::string_view message, std::uint32_t channel);
    /// Whether `channel` may still be the id of an open in flight: no channel has had it yet
    /// and an open is running.
    bool may_be_opening(std::uint32_t channel) const noexcept;
    /// An open ended: what waited is routed again, in arrival order (what still names an id
    /// that no channel has had waits on while another open runs).
    void replay_after_opens();
    void start(jsonrpc::Request request, std::optional<std::uint32_t> lane);
    awaitable<void> serve(std::shared_ptr<Session> self, jsonrpc::Request request,
                          std::optional<std::uint32_t> lane);
    awaitable<MethodReply> call(const MethodSpec* method, MethodCall call);
    /// Whom `request` acts for (see Call::caller). Throws rpc_error(errc::forbidden) when a
    /// peer link calls a method that is never forwarded or gives no valid forwardedFor, and
    /// when a host connection gives forwardedFor.
    Principal caller_of(const jsonrpc::Request& request, const MethodSpec* method) const;
    /// The request on `lane` is done: applies what waited behind it, up to the next request.
    void release(std::uint32_t lane);
    /// Counts an answered request in the node's metrics (opens by result and route, lease
    /// methods by result).
    void count_request(const MethodSpec* method, const std::string& name, std::string_view result,
                       bool routed, std::chrono::steady_clock::duration took);

    Node& node_;
    Transport transport_;
    Principal who_;
    strand_t strand_;
    net::steady_timer slot_free_;  // woken (cancelled) when a request ends
    std::string peer_;
    ChannelMux mux_;
    std::size_t in_flight_ = 0;  // requests running or waiting in a lane
    /// Opens running. While one runs, requests and frames naming a channel id that no channel
    /// has had yet wait in after_opens_ (in arrival order): they may name the channel it is
    /// opening (a resize sent in the same write as the open, acceptance case B18).
    std::size_t opens_in_flight_ = 0;
    std::deque<Queued> after_opens_;
    std::map<std::uint32_t, Lane> lanes_;  // channels with a request running
    /// The node that forwarded this connection's opens (peer tokens only), else "".
    std::string forwarded_by_;
    /// Feeders parked until the connection has send room (when_send_room), and whether a
    /// wake from the node's budget is armed.
    std::vector<std::function<void()>> room_waiters_;
    bool node_wake_armed_ = false;
    /// Runs the parked feeders once the connection has room; else arms the node's wake.
    void check_send_room();
};

}  // namespace sandboxd
