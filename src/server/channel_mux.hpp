#pragma once
// The channels of one host connection (docs/protocol.md section 4): local channels (this node
// runs the command) and relayed channels (forwarded to the lease's owner over a PeerLink),
// under the ids this connection knows. Routes the connection's binary frames to them and the
// owner's frames and exits back, with the stdin-overrun accounting of relays.
//
// Threading: not thread-safe; every call runs on the connection's strand. Output goes to the
// sink given at construction (the connection's write queue), which must outlive the mux.
#include "server/channel.hpp"
#include "server/detached_output.hpp"
#include "server/peer_link.hpp"

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace sandboxd {

class ChannelMux {
public:
    /// A channel forwarded to its owner: the link and the owner's channel id.
    struct Relayed {
        std::shared_ptr<PeerLink> link;
        std::uint32_t remote_id = 0;
        nlohmann::json forwarded_for;  ///< the host it was opened for, as sent to the owner
        /// The owner's stdin window and the stdin bytes relayed that it has not credited back:
        /// the relay forwards at most the window plus the one frame that overruns it (the
        /// owner then ends the channel with FLOW_CONTROL) and drops the host's stdin after
        /// that, so a host that ignores the window costs this node no more than the window.
        std::uint64_t stdin_window = 0;
        std::uint64_t stdin_outstanding = 0;
        bool stdin_overrun = false;
    };

    /// `bytes` counts the payload of relayed data frames (null: not counted). `relays` (null:
    /// not counted) holds the node-wide number of relayed channels: this mux adds its own
    /// while they are open and takes them back when they end or the mux is destroyed (drain
    /// waits for it to reach 0).
    ChannelMux(ChannelSink& out, std::size_t max_data_payload, std::string peer,
               const ChannelByteCounters* bytes = nullptr,
               std::atomic<std::int64_t>* relays = nullptr);
    ~ChannelMux();
    ChannelMux(const ChannelMux&) = delete;
    ChannelMux& operator=(const ChannelMux&) = delete;

    /// A fresh channel id of this connection (ids are never reused on a connection).
    std::uint32_t next_id() noexcept { return next_id_++; }
    /// The id next_id() will give: every id below it has been given (or is ended).
    std::uint32_t peek_next_id() const noexcept { return next_id_; }

    /// Channels open or being opened (local, relayed and reserved): what
    /// limits.channelsPerConnection bounds.
    std::size_t count() const noexcept {
        return local_.size() + attached_.size() + relayed_.size() + reserved_;
    }
    std::size_t local_count() const noexcept { return local_.size(); }
    /// An open in progress holds a slot until it ends (release()), so that concurrent opens
    /// cannot overshoot the limit.
    void reserve() noexcept { ++reserved_; }
    void release() noexcept { --reserved_; }

    // --- local channels ---
    void add_local(std::uint32_t id, std::shared_ptr<Channel> channel);
    /// The open channel `id`, else CHANNEL_NOT_FOUND ("channel 7 has already ended" or
    /// "channel 7 is not open on this connection", data.channel).
    std::shared_ptr<Channel> local(std::uint32_t id) const;
    /// Removes and returns channel `id` (nullptr when it is not open).
    std::shared_ptr<Channel> take_local(std::uint32_t id);
    /// The channel has sent its exit: forgotten, and remembered as ended (the last 4096).
    void finished(std::uint32_t id);
    /// Whether `id` names a channel of this connection that has already ended.
    bool ended(std::uint32_t id) const { return ended_.count(id) > 0; }
    /// The open local channel `id`, or nullptr.
    std::shared_ptr<Channel> find_local(std::uint32_t id) const {
        auto it = local_.find(id);
        return it == local_.end() ? nullptr : it->second;
    }

    // --- detached channels attached here (issue 46) ---
    /// A detached channel this connection is attached to: it runs on its own strand, to which
    /// the connection's stdin and credit are posted; its output reaches this connection
    /// through its DetachedOutput's attachment.
    struct Attached {
        std::string handle;
        std::shared_ptr<Channel> channel;
        std::shared_ptr<DetachedOutput> output;
        net::any_io_executor strand;   ///< the channel's
        std::uint64_t attachment = 0;  ///< DetachedOutput::attach()'s id
        /// What the output reaches this connection through (a StrandHopSink), held here
        /// alone: the output holds it weakly, so the attachment lasts while this entry does.
        std::shared_ptr<ChannelSink> sink;
        std::string opened_for;  ///< the token name of the host that attached (peer links)
    };
    void add_attached(std::uint32_t id, Attached attached);
    /// Removes and returns the attachment of channel `id`, if any (the caller detaches it).
    std::optional<Attached> take_attached(std::uint32_t id);
    /// The attachment of channel `id`, or nullptr.
    const Attached* attached(std::uint32_t id) const;

    // --- relayed channels ---
    /// A forwarded open of `id` is under way: frames from the owner wait until opened().
    void opening(std::uint32_t id);
    /// The forwarded open failed: the frames that waited are dropped.
    void open_failed(std::uint32_t id);
    /// The forwarded open succeeded and its result is queued: the frames that waited go out
    /// after it, in order (an exit among them ends the route).
    void opened(std::uint32_t id, Relayed route);
    /// The route of relayed channel `id`, or nullptr.
    const Relayed* relayed(std::uint32_t id) const;
    /// Removes and returns the route of relayed channel `id`, if any.
    std::optional<Relayed> take_relayed(std::uint32_t id);

    /// A frame from the owner for relayed channel `id` (already renumbered).
    void relay_binary(std::uint32_t id, std::string frame);
    /// The owner's exit for relayed channel `id` (already renumbered); the route ends.
    void relay_exit(std::uint32_t id, nlohmann::json exit_params);
    /// The owner's duplexChannel.gap for relayed channel `id` (already renumbered).
    void relay_gap(std::uint32_t id, nlohmann::json gap_params);

    // --- the connection's binary frames ---
    /// Whether `message` is a valid frame; the close reason (1002, or 1009 when too big)
    /// and its channel id otherwise: frames are checked on arrival even when queued.
    std::variant<std::uint32_t, websocket::close_reason> check_frame(
        std::string_view message) const;
    /// Applies a checked frame: stdin and credit for a local channel, posted to an attached
    /// one's strand, forwarded for a relayed one; dropped for an unknown channel.
    void apply_frame(std::string_view message);

    /// The connection is gone: local channels are hung up, relayed ones closed on the owner,
    /// attached ones detached (their commands go on).
    void close_all();

private:
    /// Brings *relays_ in line with the relayed and opening channels (after every change).
    void count_relays();

    ChannelSink& out_;
    std::size_t max_data_payload_;
    std::string peer_;
    const ChannelByteCounters* bytes_;
    std::atomic<std::int64_t>* relays_;
    std::int64_t relays_counted_ = 0;
    std::uint32_t next_id_ = 1;
    std::size_t reserved_ = 0;
    std::map<std::uint32_t, std::shared_ptr<Channel>> local_;
    std::map<std::uint32_t, Attached> attached_;
    std::set<std::uint32_t> ended_;
    std::map<std::uint32_t, Relayed> relayed_;
    /// What of the owner's may overtake a forwarded open's result.
    enum class early_kind { binary, notice, exit };
    /// Forwarded opens awaiting their result: the owner's frames and notifications that
    /// overtook it, in order.
    std::map<std::uint32_t, std::vector<std::pair<early_kind, std::string>>> opening_;
};

}  // namespace sandboxd
