#pragma once
// One host-server WebSocket connection (docs/protocol.md section 1), in three parts:
//  - the transport (server/transport.hpp): the upgrade, reads, one write queue, pings and the
//    idle drop; it hands each message to the session (its Receiver);
//  - the method table: each JSON-RPC method has a typed param struct (server/methods.hpp),
//    parsed once, and a handler returning its result;
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

class Session final : public ChannelSink,
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
    /// The token the connection authenticated with. Immutable.
    const Principal& principal() const noexcept { return who_; }

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
    awaitable<void> wait_send_room();

    void relay_binary(std::uint32_t local_channel, std::string frame) override;
    void relay_exit(std::uint32_t local_channel, nlohmann::json exit_params) override;
    net::any_io_executor relay_executor() override;

    /// A method's answer: its result, and what must happen right after the result is queued
    /// (a channel starts only then, so its first frames follow its open's result).
    struct Reply {
        nlohmann::json result;
        std::function<void()> after;
    };

private:
    /// What waits in a channel's lane: a request or a binary frame.
    using Queued = std::variant<jsonrpc::Request, std::string>;
    struct Lane {
        std::deque<Queued> waiting;
    };
    /// One request as a handler sees it.
    struct Call {
        nlohmann::json params;  ///< an object
        nlohmann::json id;      ///< the JSON-RPC id; null for a notification
        /// Whom it acts for: this connection's token, or on a peer link the host that the
        /// forwarding node names in the request's forwardedFor (docs/protocol.md section 6).
        Principal caller;
    };
    using Handler = awaitable<Reply> (Session::*)(Call call);
    struct Method {
        Handler handler;
        bool fenced = false;       ///< refused while this node's membership is stale
        bool on_channel = false;   ///< names a channel: relayed to its owner, ordered per channel
        /// A node forwards it to the lease's or channel's owner, so a peer link may call it
        /// (with forwardedFor); a peer calling any other method gets FORBIDDEN.
        bool forwarded = false;
    };
    static const std::map<std::string_view, Method>& method_table();

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
    awaitable<Reply> call(const std::string& method, Call call);
    /// Whom `request` acts for (see Call::caller). Throws rpc_error(errc::forbidden) when a
    /// peer link calls a method that is never forwarded or gives no valid forwardedFor, and
    /// when a host connection gives forwardedFor.
    Principal caller_of(const jsonrpc::Request& request, const Method* method) const;
    /// The request on `lane` is done: applies what waited behind it, up to the next request.
    void release(std::uint32_t lane);
    /// Counts an answered request in the node's metrics (opens by result and route, lease
    /// methods by result).
    void count_request(const std::string& method, std::string_view result, bool routed,
                       std::chrono::steady_clock::duration took);

    // methods
    awaitable<Reply> initialize(Call c);
    awaitable<Reply> lease_acquire(Call c);
    awaitable<Reply> lease_get(Call c);
    awaitable<Reply> lease_list(Call c);
    awaitable<Reply> lease_renew(Call c);
    awaitable<Reply> lease_release(Call c);
    awaitable<Reply> lease_probe(Call c);
    awaitable<Reply> provider_validate_config(Call c);
    awaitable<Reply> lease_execute(Call c);
    awaitable<Reply> lease_realize_workspace(Call c);
    /// leaseExecute's sink: leaseExecute.log {requestId: id, stream, chunk} to this host,
    /// at most limits.executeOutputBytes per stream (none when the request has no id).
    ExecuteLog execute_log(const nlohmann::json& id);
    awaitable<Reply> node_list(Call c);
    awaitable<Reply> channel_open(Call c);
    awaitable<Reply> channel_write(Call c);
    awaitable<Reply> channel_close_stdin(Call c);
    awaitable<Reply> channel_resize(Call c);
    awaitable<Reply> channel_signal(Call c);
    awaitable<Reply> channel_stop(Call c);
    awaitable<Reply> channel_close(Call c);
    /// Renewals and releases of a lease owned by another node are answered by the owner.
    /// `notify` and `answer_within` as PeerLink::call's, for a call that streams.
    awaitable<std::optional<Reply>> lease_change_at_owner(
        std::string method, nlohmann::json params, std::string lease_id, Principal caller,
        std::optional<PeerLink::Notify> notify = std::nullopt,
        std::chrono::milliseconds answer_within = std::chrono::milliseconds(0));
    awaitable<Reply> open_relayed(nlohmann::json params, Lease lease, Principal caller);
    awaitable<Reply> open_local(methods::OpenParams params, Lease lease, Principal caller);
    /// The local channel `id` of this connection, when `caller` opened it (on a peer link,
    /// one connection carries the channels of many hosts), else CHANNEL_NOT_FOUND.
    std::shared_ptr<Channel> local_channel(std::uint32_t id, const Principal& caller);

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
    /// opening (a resize sent in the same write as the open, CASES.md B18).
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
