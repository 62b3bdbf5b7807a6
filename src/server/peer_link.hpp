#pragma once
// One WebSocket from this node to a peer node (docs/protocol.md section 6), multiplexing every
// channel forwarded to that peer plus forwarded lease calls. Opened with a `peer` token and the
// header `Sandboxd-Forwarded-By: <this node>`, so the peer never forwards again.
//
// Threading: a PeerLink runs on its own strand. Its public coroutines may be awaited from any
// strand (they hop to the link's strand and back); send_frame() may be called from any thread.
// Frames for a forwarded channel are delivered to the host session's strand.
#include <sandboxd/core/net.hpp>

#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/tls.hpp>
#include <sandboxd/registry/registry.hpp>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace sandboxd {

struct Node;
struct WsUrl;

/// How a peer link reaches its peer (Node::peer_dialer): a connected stream to `url` on
/// `strand` (under TLS for wss://, its handshake done), ready for the WebSocket upgrade; throws
/// rpc_error(errc::owner_unavailable) when it cannot. The daemon leaves it unset (the link
/// dials over TCP itself); tests give an in-process connection.
using PeerDialer =
    std::function<awaitable<ConnStream>(const WsUrl& url, const net::any_io_executor& strand)>;

/// Where a forwarded channel's frames go on this node: the host's session, under the channel
/// id the host knows.
class RelayTarget {
public:
    virtual ~RelayTarget() = default;
    /// A frame from the owner, channel id already rewritten to `local_channel`. Called on the
    /// target's strand.
    virtual void relay_binary(std::uint32_t local_channel, std::string frame) = 0;
    /// The owner's duplexChannel.exit (channel rewritten), or a made-up transportClosed exit
    /// when the link died. Called on the target's strand; the route is gone afterwards.
    virtual void relay_exit(std::uint32_t local_channel, nlohmann::json exit_params) = 0;
    /// The owner's duplexChannel.gap (channel rewritten): a detached channel's output that
    /// is no longer kept. Called on the target's strand.
    virtual void relay_gap(std::uint32_t local_channel, nlohmann::json gap_params) = 0;
    virtual net::any_io_executor relay_executor() = 0;
};

class PeerLink : public std::enable_shared_from_this<PeerLink> {
public:
    PeerLink(Node& node, NodeRecord peer, std::string peer_token, net::any_io_executor strand);
    ~PeerLink();
    PeerLink(const PeerLink&) = delete;
    PeerLink& operator=(const PeerLink&) = delete;

    const std::string& peer_id() const noexcept { return peer_.node_id; }
    bool broken() const noexcept { return broken_; }
    /// True while the link is connected (sandboxd_peer_link_up). Thread-safe.
    bool up() const noexcept { return up_.load(std::memory_order_relaxed); }

    /// How many liveness TTLs (routing.nodeTtlMs) a call waits at most for a peer whose
    /// membership stays live; one TTL for a peer whose membership lapsed.
    static constexpr int max_answer_ttls = 4;

    /// Sends a JSON-RPC request to the peer and returns its result; the peer's error is
    /// rethrown as rpc_error with the same reason. Connects first if needed. Throws
    /// rpc_error(errc::owner_unavailable) when the peer cannot be reached within the connect
    /// timeout, the link drops before the response, or no answer came within one nodeTtlMs
    /// after which the peer's membership had lapsed (or could not be read), or within
    /// max_answer_ttls nodeTtlMs. May block on the registry (get_node) once per TTL waited.
    /// `forwarded_for` ({tokenName, tenants} of the host the call acts for, see
    /// forwarded_for()) goes in the request's forwardedFor: the peer acts for that host only.
    awaitable<nlohmann::json> call(std::string method, nlohmann::json params,
                                   nlohmann::json forwarded_for);

    /// Where a forwarded call's notifications go: the peer's `<method>.log` notifications
    /// whose `requestId` is this call's id (leaseExecute.log), posted to `executor` in order,
    /// before the call completes and never after.
    struct Notify {
        net::any_io_executor executor;
        std::function<void(nlohmann::json params)> fn;
    };
    /// Like call(), with the call's notifications to `notify`, and the peer given
    /// `answer_within` (instead of the liveness TTL) to answer: a call that runs for long by
    /// design (leaseExecute).
    awaitable<nlohmann::json> call(std::string method, nlohmann::json params,
                                   nlohmann::json forwarded_for, Notify notify,
                                   std::chrono::milliseconds answer_within);

    /// Like call(method) for a method that opens a channel (duplexChannelOpen,
    /// duplexChannelAttach), and on success routes the remote channel's frames and
    /// notifications to `target` under `local_channel` before any of them is read.
    awaitable<nlohmann::json> open(std::string method, nlohmann::json params,
                                   nlohmann::json forwarded_for, std::weak_ptr<RelayTarget> target,
                                   std::uint32_t local_channel);

    /// Queues a binary frame (already rewritten to the remote channel id) for the peer.
    void send_frame(std::string frame);
    /// Asks the peer to close a remote channel (a notification: no response awaited).
    void close_channel(std::uint32_t remote_channel, nlohmann::json forwarded_for);
    /// Forgets the route of a remote channel (after its exit or a close).
    void forget(std::uint32_t remote_channel);

private:
    struct Pending {
        std::optional<jsonrpc::Response> response;
        std::unique_ptr<net::steady_timer> wake;
        std::weak_ptr<RelayTarget> target;  // for opens
        std::uint32_t local_channel = 0;
        Notify notify;  // for calls that stream notifications
    };
    /// Opens whose caller gave up before the answer, by request id: the forwardedFor to close
    /// the channel with if the answer comes after all. Cleared when the link breaks.
    std::map<std::int64_t, nlohmann::json> abandoned_opens_;
    struct Route {
        std::weak_ptr<RelayTarget> target;
        std::uint32_t local_channel = 0;
    };

    awaitable<nlohmann::json> do_call(std::string method, nlohmann::json params,
                                      nlohmann::json forwarded_for,
                                      std::weak_ptr<RelayTarget> target,
                                      std::uint32_t local_channel, Notify notify = {},
                                      std::optional<std::chrono::milliseconds> answer_within = {});
    /// Whether the peer's registry record is this link's process, renewed within nodeTtlMs
    /// (false when the registry cannot say). Runs on the link's strand.
    awaitable<bool> peer_membership_live();
    awaitable<void> ensure_connected();
    /// Connects (Node::peer_dialer, else dial()), upgrades and starts the read and write
    /// loops (ensure_connected's one try).
    awaitable<void> connect();
    /// A TCP connection to `url`, under TLS (handshake done) for wss://, on the link's strand,
    /// its deadline (connect_timeout) still running. Throws rpc_error(owner_unavailable).
    awaitable<ConnStream> dial(const WsUrl& url);
    /// The upgrade's headers (token, Sandboxd-Forwarded-By/To) and the stream's options.
    void set_upgrade_options();
    awaitable<void> read_loop();
    awaitable<void> write_loop();
    void on_text(const std::string& text);
    void on_binary(std::string_view frame);
    void fail_all(const std::string& why);
    void queue(bool binary, std::string bytes);

    Node& node_;
    NodeRecord peer_;
    std::string token_;
    net::any_io_executor strand_;
    /// Made at connect: plain or TLS, by the peer's URL (ws:// or wss://).
    std::optional<websocket::stream<ConnStream>> ws_;
    bool connected_ = false;
    bool connecting_ = false;
    bool broken_ = false;
    std::atomic<bool> up_{false};
    std::string broken_reason_;
    net::steady_timer connect_wait_;
    std::deque<std::pair<bool, std::string>> out_;
    net::steady_timer out_wake_;
    std::int64_t next_id_ = 1;
    std::map<std::int64_t, Pending> pending_;
    std::map<std::uint32_t, Route> routes_;
};

/// The links of one node, one per peer. Thread-safe.
class PeerLinks {
public:
    /// The live link to `peer` (made if absent or broken).
    std::shared_ptr<PeerLink> get(Node& node, const NodeRecord& peer, const std::string& token,
                                  net::io_context& ioc);
    /// Whether each peer's link is up, by peer node id. Thread-safe.
    std::map<std::string, bool> states();
    /// Drops every link; called while their io_context still exists (their timers and
    /// sockets must be destroyed before it is).
    void clear();

private:
    std::mutex mutex_;
    std::map<std::string, std::shared_ptr<PeerLink>> links_;
};

}  // namespace sandboxd
