#pragma once
// The WebSocket transport of one accepted connection (docs/protocol.md section 1): the upgrade,
// the read loop, one write queue (Beast allows one outstanding async_write), keepalive pings
// and the idle drop. The four loops are joined with awaitable operators: when one ends (the
// peer closed, a write failed, the peer fell silent) the others are cancelled with it, and
// serve() returns. What a message means is the Receiver's business (the session).
//
// Threading: every member runs on the connection's strand (strand()), except close(), which
// may be called from any thread. The owner keeps the Transport alive until serve() returns.
#include "server/frame_guard.hpp"
#include "server/send_budget.hpp"

#include <sandboxd/core/config.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/tls.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd {

class Transport {
public:
    /// What the transport hands its owner, on the strand, in the order the peer sent it.
    class Receiver {
    public:
        /// A text message. The next read waits until this returns: a receiver that cannot take
        /// more work yet (a peer link whose requests are all in flight) waits here. The view is
        /// valid until then.
        virtual awaitable<void> on_text(std::string_view text) = 0;
        /// A binary message; a close reason ends the connection with that close frame.
        virtual std::optional<websocket::close_reason> on_binary(std::string_view message) = 0;

    protected:
        Receiver() = default;
        ~Receiver() = default;
        Receiver(const Receiver&) = default;
        Receiver& operator=(const Receiver&) = default;
        Receiver(Receiver&&) = default;
        Receiver& operator=(Receiver&&) = default;
    };

    /// Takes the stream (plain TCP, or TLS after its handshake) of a connection whose HTTP
    /// upgrade request has been read. `limits` (message sizes, ping interval, idle and send
    /// stall timeouts) must outlive the transport. `budget` (null: none) counts the bytes
    /// queued here toward the node's send budgets; `exempt` (a peer link): counted, never
    /// refused room (send_budget.hpp).
    Transport(ConnStream stream, const LimitsConfig& limits, SendBudget* budget = nullptr,
              bool exempt = false);
    ~Transport() = default;
    Transport(const Transport&) = delete;
    Transport& operator=(const Transport&) = delete;

    /// The connection's strand: everything of this connection runs on it.
    [[nodiscard]] const strand_t& strand() const noexcept { return strand_; }
    /// "address:port" of the peer, for logs.
    [[nodiscard]] const std::string& peer() const noexcept { return peer_; }

    /// Completes the upgrade: our options (no permessage-deflate, no auto-fragmenting, the
    /// message size limit, the `sandboxd.v1` subprotocol echoed when offered). False (logged at
    /// debug) when the handshake failed.
    awaitable<bool> accept(const http::request<http::string_body>& request);

    /// Reads and writes until the connection ends, however it ends (never throws for the
    /// peer's errors). Afterwards closing() is true and the queue is empty.
    awaitable<void> serve(Receiver& receiver);

    /// Queues a message for the write loop; dropped once the connection is closing. The queue
    /// is bounded by its feeders, not here: they ask has_room() first (channel output,
    /// leaseExecute output), and the rest is bounded by the protocol (responses by
    /// limits.requestsPerConnection, credits and exits by the channels).
    void send(bool binary, std::string bytes);

    /// Whether this connection may be fed more (its queue is under its send budgets), or is
    /// closing (feeders then drain and stop). Without a budget: always.
    [[nodiscard]] bool has_room() const noexcept {
        return closing_ || !account_ || account_->has_room();
    }
    /// Whether the node's budget, not this connection's own, keeps it from room.
    [[nodiscard]] bool held_by_node() const noexcept {
        return !closing_ && account_ && account_->held_by_node();
    }
    /// Bytes queued here and not yet written (the message being written included).
    [[nodiscard]] std::uint64_t queued_bytes() const noexcept {
        return account_ ? account_->queued() : 0;
    }
    /// Called on the strand after each message is written or dropped, and once when the
    /// connection has ended: where the owner wakes the feeders that waited for room.
    void on_written(std::function<void()> fn) { on_written_ = std::move(fn); }

    /// Whether send_spliced() may be used: a plain TCP connection (TLS encrypts every byte
    /// in user space) that has not begun to close.
    [[nodiscard]] bool can_splice() noexcept { return !closing_ && ws_.next_layer().can_splice(); }

    /// Queues a binary frame written around Beast (frame_guard::async_write_spliced): `head`
    /// (the frame's WebSocket header and its first payload bytes), then `count` bytes spliced
    /// from `pipe_fd`, in queue order with the other messages. The caller keeps the pipe open
    /// and unread until `done` runs. `done(written)` runs once on the strand, never inside
    /// this call: true once the frame is written, false when the connection ended first (or
    /// is closing now). Only when can_splice() (else done(false)).
    void send_spliced(std::string head, int pipe_fd, std::size_t count,
                      std::function<void(bool written)> done);

    /// A binary message written before, to resize, overwrite and send() (none: an empty
    /// string). It keeps its size and old bytes, so that resizing it to a frame of the same
    /// size or less writes nothing (std::string has no uninitialised resize in C++20): the
    /// caller must overwrite every byte it sends. At most `max_spare_buffers` are kept, and only
    /// while the connection writes: they are freed once it has been idle for
    /// `spare_buffer_idle`.
    std::string take_buffer();

    /// Closes with `code`, from any thread: from now on nothing more is queued (closing() is
    /// true), what was queued before is written, and then the close handshake starts (so an
    /// exit sent just before a stop is not lost). `keep_alive` (the owner) is held until the
    /// request reaches the strand; the serving coroutine holds it after that.
    /// Nothing happens when the connection is already closing.
    void close(websocket::close_code code, std::shared_ptr<void> keep_alive);

    /// True once the connection has ended (or is ending): nothing sent will be written.
    [[nodiscard]] bool closing() const noexcept { return closing_; }
    /// True once close() has written everything queued before it and started the close
    /// handshake (its frame goes out at once; the peer's answer may take long), or the
    /// connection has ended. Thread-safe.
    [[nodiscard]] bool close_written() const noexcept {
        return close_written_.load(std::memory_order_acquire);
    }

private:
    struct Outgoing {
        bool binary;
        std::string bytes;  ///< the message; for a spliced frame, its head
        /// A spliced frame (send_spliced): its pipe, payload bytes and completion.
        int splice_fd = -1;
        std::size_t splice_count = 0;
        std::function<void(bool)> spliced;
    };
    /// Runs a spliced frame's completion on the next turn of the strand.
    void complete_spliced(std::function<void(bool)> done, bool written);
    awaitable<void> read_loop(Receiver& receiver);
    awaitable<void> write_loop();
    awaitable<void> ping_loop();
    /// Drops the connection once nothing (no message, ping or pong) has been heard from the
    /// peer for limits.idleTimeoutMs.
    awaitable<void> idle_loop();
    /// Drops the connection once it has had bytes queued and its socket has taken no message
    /// for limits.sendStallTimeoutMs.
    awaitable<void> stall_loop();
    /// `bytes` of the queue were written or dropped.
    void written(std::size_t bytes);

    websocket::stream<frame_guard<ConnStream>> ws_;  // see frame_guard.hpp
    const LimitsConfig& limits_;
    strand_t strand_;
    std::string peer_;
    std::deque<Outgoing> queue_;
    static constexpr std::size_t max_spare_buffers = 4;
    static constexpr std::size_t min_spare_capacity = 64 * 1024;
    static constexpr auto spare_buffer_idle = std::chrono::milliseconds(50);
    std::vector<std::string> spare_;  // written binary messages' buffers, for take_buffer()
    net::steady_timer queue_timer_;   // woken (cancelled) when the queue gets work
    std::chrono::steady_clock::time_point last_heard_;  // last frame read from the peer
    /// The last message written, or the moment the queue last became non-empty.
    std::chrono::steady_clock::time_point send_progress_;
    bool writing_ = false;  // a message is being written (popped from the queue)
    std::optional<SendBudget::Account> account_;
    std::function<void()> on_written_;
    bool closing_ = false;
    /// Set by close(): the write loop sends it once the queue is empty.
    std::optional<websocket::close_code> close_code_;
    std::atomic<bool> close_written_{false};
};

}  // namespace sandboxd
