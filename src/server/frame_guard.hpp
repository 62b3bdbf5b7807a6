#pragma once
// A stream layer under the server's WebSocket that enforces the one rule of RFC 6455 section
// 5.2 that Boost.Beast 1.81 does not: the most significant bit of a 64-bit payload length
// MUST be 0. Beast compares such a length with read_message_max first and closes with 1009
// (too big); the guard sets RSV2 on that frame's first byte (no extension here gives RSV2 a
// meaning) so that Beast fails the frame as the protocol error it is: close 1002. Every other
// byte passes through untouched, and nothing is allocated for any declared length (acceptance
// case B15).
//
// It follows the frame headers of the incoming byte stream. A header whose first bytes end a
// read before its length can be judged (1 byte, or 2 with the 64-bit length code) is held
// back and delivered with the next read, so that its first byte can still be marked.
//
// On the write side it follows the frame boundaries of what Beast writes, so that a frame can
// be written around Beast (async_write_spliced: a header, then payload spliced from a pipe
// straight into the socket, never copied through user space) without ever landing inside one
// of Beast's frames: it starts only between two of Beast's frames with no Beast write
// outstanding, and a Beast write that comes while it runs (an automatic pong, a ping, a close)
// waits until it is done. This is the documented deviation of issue 19 item 3: data frames
// written beside Beast's writer, never interleaved with them.
//
// Threading: as the stream it wraps: one read and one write at a time, on one strand; a
// spliced write counts as a write (one at a time, on the same strand).
#include <sandboxd/core/net.hpp>

#include <boost/asio/any_completion_handler.hpp>

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd {

/// The header of one unmasked binary WebSocket frame (FIN set, opcode 2) whose payload is
/// `length` bytes (RFC 6455 section 5.2: 7-bit, 16-bit or 64-bit length): what a server
/// writes before a frame's payload in async_write_spliced. `length` < 2^63.
inline std::string websocket_binary_header(std::uint64_t length) {
    std::string h(1, static_cast<char>(0x82));
    if (length < 126) {
        h.push_back(static_cast<char>(length));
    } else if (length <= 0xffff) {
        h.push_back(static_cast<char>(126));
        h.push_back(static_cast<char>(length >> 8));
        h.push_back(static_cast<char>(length & 0xff));
    } else {
        h.push_back(static_cast<char>(127));
        for (int b = 7; b >= 0; --b) h.push_back(static_cast<char>((length >> (8 * b)) & 0xff));
    }
    return h;
}

template <typename NextLayer>
class frame_guard {
public:
    using executor_type = typename NextLayer::executor_type;

    explicit frame_guard(NextLayer next) : next_(std::move(next)) {}

    executor_type get_executor() noexcept { return next_.get_executor(); }
    NextLayer& next_layer() noexcept { return next_; }
    const NextLayer& next_layer() const noexcept { return next_; }

    template <typename ConstBufferSequence, typename WriteHandler>
    auto async_write_some(const ConstBufferSequence& buffers, WriteHandler&& handler) {
        return net::async_compose<WriteHandler, void(beast::error_code, std::size_t)>(
            write_op<ConstBufferSequence>{this, buffers}, handler, next_);
    }

    /// Starts following the outgoing frames: call once the WebSocket handshake is done, with
    /// no write outstanding (the HTTP response written before is no frame). Before it,
    /// async_write_spliced() fails with operation_not_supported.
    void begin_frames() noexcept {
        following_ = true;
        out_header_len_ = 0;
        out_left_ = 0;
    }

    /// Whether async_write_spliced() can write to this stream: plain TCP (a TLS stream must
    /// encrypt every byte in user space).
    bool can_splice() noexcept {
        if constexpr (requires { next_.is_tls(); }) {
            return !next_.is_tls();
        } else {
            return true;
        }
    }

    /// Writes one whole WebSocket frame around Beast: `head` (the frame's header and the
    /// first bytes of its payload, which the caller built: an unmasked server frame), then
    /// `count` bytes spliced from the pipe `pipe_fd` into the socket. The pipe must hold at
    /// least `count` bytes that nobody else reads meanwhile (else the frame could not be
    /// finished: error::message_size, and the connection must be dropped, since the peer has
    /// a partial frame). Starts between two of Beast's frames (see above); completes with the
    /// bytes written (head + count) or the error that ended it (a failed socket: drop the
    /// connection). Only when can_splice(). `pipe_fd` must stay open until completion.
    /// Once a write failed part-way (this kind or Beast's), every later spliced frame fails at
    /// once with that error and writes nothing. Cancelling it while it waits for the end of
    /// Beast's frame completes it with operation_aborted, having written nothing; once it has
    /// started, cancellation reaches its wait for room in the socket.
    /// splice(2) has no MSG_NOSIGNAL: on a socket whose peer is gone it raises SIGPIPE, so
    /// the process must ignore SIGPIPE (sandboxd does, src/app/daemon_main.cpp); then it is
    /// EPIPE.
    template <typename WriteHandler>
    auto async_write_spliced(std::string head, int pipe_fd, std::size_t count,
                             WriteHandler&& handler) {
        return net::async_compose<WriteHandler, void(beast::error_code, std::size_t)>(
            spliced_op{this, std::move(head), pipe_fd, count}, handler, next_);
    }

    template <typename MutableBufferSequence, typename ReadHandler>
    auto async_read_some(const MutableBufferSequence& buffers, ReadHandler&& handler) {
        net::mutable_buffer target;
        for (auto it = net::buffer_sequence_begin(buffers); it != net::buffer_sequence_end(buffers);
             ++it) {
            net::mutable_buffer b(*it);
            if (b.size() > 0) {
                target = b;
                break;
            }
        }
        return net::async_compose<ReadHandler, void(beast::error_code, std::size_t)>(
            read_op{this, target}, handler, next_);
    }

    /// How often the write side took its slower paths (diagnostics and tests).
    struct WriteStats {
        std::uint64_t splice_waits = 0;     ///< a spliced frame waited for room in the socket
        std::uint64_t splices_parked = 0;   ///< a spliced frame waited for Beast's frame to end
        std::uint64_t writes_deferred = 0;  ///< a Beast write waited for a spliced frame
    };
    const WriteStats& write_stats() const noexcept { return stats_; }

    /// The write side's state in a few words, for a test's failure message.
    std::string write_state() const {
        return "beast_writing=" + std::to_string(beast_writing_) +
               " splicing=" + std::to_string(splicing_) + " out_left=" + std::to_string(out_left_) +
               " out_header_len=" + std::to_string(out_header_len_) +
               " parked_splice=" + std::to_string(parked_splice_.has_value()) +
               " deferred_write=" + std::to_string(deferred_write_.has_value()) +
               " splice_waits=" + std::to_string(stats_.splice_waits);
    }

private:
    /// One of Beast's writes: waits while a spliced frame is being written, then writes and
    /// follows the frame boundaries of what was written.
    template <typename Buffers>
    struct write_op {
        frame_guard* guard;
        Buffers buffers;
        enum class state { start, writing } at = state::start;

        template <typename Self>
        void operator()(Self& self, beast::error_code ec = {}, std::size_t n = 0) {
            if (at == state::start) {
                if (guard->splicing_) {
                    ++guard->stats_.writes_deferred;
                    guard->deferred_write_ = std::move(self);  // resumed by the spliced frame's end
                    return;
                }
                at = state::writing;
                guard->beast_writing_ = true;
                guard->next_.async_write_some(buffers, std::move(self));
                return;
            }
            guard->beast_writing_ = false;
            if (ec) {
                // Beast's frame may be cut short: no frame can follow it on this stream, and
                // a spliced frame waiting for its end fails with this error.
                if (!guard->write_error_) guard->write_error_ = ec;
            } else if (guard->following_) {
                guard->follow_written(buffers, n);
            }
            // A spliced frame waiting for a boundary goes first, before Beast writes again.
            if (guard->parked_splice_ &&
                (guard->write_error_ || (guard->out_left_ == 0 && guard->out_header_len_ == 0))) {
                guard->resume_parked();
            }
            self.complete(ec, n);
        }
    };

    /// A frame written around Beast (async_write_spliced).
    struct spliced_op {
        frame_guard* guard = nullptr;
        std::string head;
        int pipe_fd = -1;
        std::size_t count = 0;
        std::size_t head_done = 0;
        std::size_t spliced = 0;
        bool started = false;

        template <typename Self>
        void operator()(Self& self, beast::error_code ec = {}) {
            if (!started) {
                // Between frames, with no Beast write outstanding; else after the one that
                // ends Beast's frame (write_op). `splicing_` already set when resumed from there.
                const bool resumed = guard->splicing_;
                if (!guard->following_)
                    return self.complete(net::error::operation_not_supported, 0);
                if (!resumed && !guard->write_error_ &&
                    (guard->beast_writing_ || guard->out_left_ != 0 ||
                     guard->out_header_len_ != 0)) {
                    ++guard->stats_.splices_parked;
                    guard->parked_splice_ = std::move(self);
                    // A cancellation (the connection ending) resumes it, to fail. On the slot
                    // of the type-erased handler: it takes over the operation's slot.
                    auto slot = guard->parked_splice_->get_cancellation_slot();
                    if (slot.is_connected()) {
                        slot.assign([g = guard](net::cancellation_type) {
                            if (!g->parked_splice_) return;
                            g->parked_cancelled_ = true;
                            g->resume_parked();
                        });
                    }
                    return;
                }
                started = true;
                guard->splicing_ = true;
                if (std::exchange(guard->parked_cancelled_, false)) {
                    return finish(self, net::error::operation_aborted);  // nothing written
                }
                // After a failed write the peer may hold part of a frame: nothing may follow.
                if (guard->write_error_) return finish(self, guard->write_error_);
            }
            if (ec) return finish(self, ec);
            auto& socket = beast::get_lowest_layer(guard->next_).socket();
            if (!socket.native_non_blocking()) {
                // Asio makes the descriptor non-blocking lazily: the calls below never block.
                beast::error_code nb;
                socket.native_non_blocking(true, nb);
                if (nb) return finish(self, nb);
            }
            const int fd = socket.native_handle();
            while (head_done < head.size()) {
                const ssize_t n = ::send(fd, head.data() + head_done, head.size() - head_done,
                                         MSG_NOSIGNAL | (count > 0 ? MSG_MORE : 0));
                if (n < 0 && errno == EINTR) continue;
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                    ++guard->stats_.splice_waits;
                    return socket.async_wait(net::socket_base::wait_write, std::move(self));
                }
                if (n < 0) return finish(self, beast::error_code(errno, beast::system_category()));
                head_done += static_cast<std::size_t>(n);
            }
            while (spliced < count) {
                const ssize_t n = ::splice(pipe_fd, nullptr, fd, nullptr, count - spliced,
                                           SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
                if (n < 0 && errno == EINTR) continue;
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                    // The socket is full, or the pipe is empty: only the first may be waited for.
                    int queued = 0;
                    if (::ioctl(pipe_fd, FIONREAD, &queued) == 0 && queued == 0) {
                        return finish(self, net::error::message_size);
                    }
                    ++guard->stats_.splice_waits;
                    return socket.async_wait(net::socket_base::wait_write, std::move(self));
                }
                if (n == 0) return finish(self, net::error::message_size);  // the pipe ended
                if (n < 0) return finish(self, beast::error_code(errno, beast::system_category()));
                spliced += static_cast<std::size_t>(n);
            }
            finish(self, {});
        }

        template <typename Self>
        void finish(Self& self, beast::error_code ec) {
            guard->splicing_ = false;
            // Part of this frame on the wire: the peer would take what follows as its rest.
            if (ec && head_done + spliced > 0 && !guard->write_error_) guard->write_error_ = ec;
            if (guard->deferred_write_) {
                net::post(guard->next_.get_executor(), std::move(*guard->deferred_write_));
                guard->deferred_write_.reset();
            }
            self.complete(ec, head_done + spliced);
        }
    };

    /// Resumes the spliced frame parked for a frame boundary (or to fail), on the executor.
    void resume_parked() {
        splicing_ = true;
        net::post(next_.get_executor(), std::move(*parked_splice_));
        parked_splice_.reset();
    }

    /// Follows the outgoing frames through the first `n` bytes of `buffers` (just written).
    template <typename Buffers>
    void follow_written(const Buffers& buffers, std::size_t n) {
        for (auto it = net::buffer_sequence_begin(buffers);
             n > 0 && it != net::buffer_sequence_end(buffers); ++it) {
            net::const_buffer b(*it);
            const auto* p = static_cast<const unsigned char*>(b.data());
            std::size_t len = std::min(b.size(), n);
            n -= len;
            for (std::size_t i = 0; i < len;) {
                if (out_left_ > 0) {
                    const auto k =
                        static_cast<std::size_t>(std::min<std::uint64_t>(out_left_, len - i));
                    out_left_ -= k;
                    i += k;
                    continue;
                }
                out_header_[out_header_len_++] = p[i++];
                if (out_header_len_ < 2) continue;
                const unsigned code = out_header_[1] & 0x7f;
                const std::size_t need = 2 +
                                         (code == 126   ? 2
                                          : code == 127 ? 8
                                                        : 0) +
                                         ((out_header_[1] & 0x80) != 0 ? 4 : 0);
                if (out_header_len_ < need) continue;
                std::uint64_t length = code;
                if (code == 126) length = std::uint64_t{out_header_[2]} << 8 | out_header_[3];
                if (code == 127) {
                    length = 0;
                    for (int k = 2; k < 10; ++k) length = length << 8 | out_header_[k];
                }
                out_left_ = length;
                out_header_len_ = 0;
            }
        }
    }

    struct read_op {
        frame_guard* guard;
        net::mutable_buffer target;
        std::size_t prefilled = 0;
        bool reading = false;

        template <typename Self>
        void operator()(Self& self, beast::error_code ec = {}, std::size_t n = 0) {
            auto* bytes = static_cast<unsigned char*>(target.data());
            if (!reading) {
                // Bytes held back by the last read go first.
                prefilled = std::min(guard->held_.size(), target.size());
                std::memcpy(bytes, guard->held_.data(), prefilled);
                guard->held_.erase(0, prefilled);
                reading = true;
                if (prefilled == target.size()) {
                    net::post(guard->next_.get_executor(), std::move(self));  // no room to read
                    return;
                }
                guard->next_.async_read_some(
                    net::buffer(bytes + prefilled, target.size() - prefilled), std::move(self));
                return;
            }
            if (ec) {
                self.complete(ec, 0);
                return;
            }
            const std::size_t total = prefilled + n;
            // Holding back needs room for the held bytes and one more in the next read.
            const std::size_t hold = guard->scan(bytes, total, target.size() > 2);
            if (hold == total) {
                // Everything read is an undecided header start: read on.
                guard->held_.assign(reinterpret_cast<const char*>(bytes), hold);
                reading = false;
                (*this)(self);
                return;
            }
            guard->held_.assign(reinterpret_cast<const char*>(bytes) + total - hold, hold);
            self.complete(ec, total - hold);
        }
    };

    /// Follows the frames in `p[0..n)` (the bytes after those already seen), marking a frame
    /// whose 64-bit length has its top bit set. Returns how many trailing bytes (a header
    /// start that cannot be judged yet, at most 2) must be held back for the next read; none
    /// unless `may_hold`.
    std::size_t scan(unsigned char* p, std::size_t n, bool may_hold) {
        std::size_t start = header_len_ == 0 ? 0 : SIZE_MAX;  // where the current header began
        for (std::size_t i = 0; i < n;) {
            if (payload_left_ > 0) {
                const auto k =
                    static_cast<std::size_t>(std::min<std::uint64_t>(payload_left_, n - i));
                payload_left_ -= k;
                i += k;
                continue;
            }
            if (header_len_ == 0) start = i;
            header_[header_len_++] = p[i++];
            if (header_len_ == 2) {
                const unsigned code = header_[1] & 0x7f;
                header_need_ = 2 +
                               (code == 126   ? 2
                                : code == 127 ? 8
                                              : 0) +
                               ((header_[1] & 0x80) != 0 ? 4 : 0);
            }
            if (header_len_ == 3 && (header_[1] & 0x7f) == 127 && (header_[2] & 0x80) != 0 &&
                start != SIZE_MAX) {
                p[start] |= 0x20;  // RSV2: Beast refuses the frame with 1002
            }
            if (header_len_ >= 2 && header_len_ == header_need_) {
                const unsigned code = header_[1] & 0x7f;
                std::uint64_t length = code;
                if (code == 126) length = std::uint64_t{header_[2]} << 8 | header_[3];
                if (code == 127) {
                    length = 0;
                    for (int b = 2; b < 10; ++b) length = length << 8 | header_[b];
                }
                payload_left_ = (length >> 63) != 0 ? 0 : length;  // a marked frame ends here
                header_len_ = 0;
            }
        }
        const bool undecided = header_len_ == 1 || (header_len_ == 2 && (header_[1] & 0x7f) == 127);
        if (undecided && start != SIZE_MAX && may_hold) {
            const std::size_t hold = header_len_;
            header_len_ = 0;  // seen again, from the start, with the next read
            return hold;
        }
        return 0;
    }

    NextLayer next_;
    // Write side (see async_write_spliced).
    bool beast_writing_ = false;  ///< one of Beast's async_write_some is outstanding
    bool splicing_ = false;       ///< a spliced frame is being written (or about to resume)
    /// The first write that failed part-way (Beast's, or a spliced frame's): the peer may
    /// hold part of a frame, so no spliced frame starts any more; they fail with this error.
    beast::error_code write_error_;
    bool parked_cancelled_ = false;  ///< the parked spliced frame was cancelled: it fails
    bool following_ = false;         ///< begin_frames() was called: the handshake is done
    WriteStats stats_;
    unsigned char out_header_[14] = {};
    std::size_t out_header_len_ = 0;  ///< bytes of an outgoing header seen so far
    std::uint64_t out_left_ = 0;      ///< payload bytes of Beast's current frame still to go
    std::optional<net::any_completion_handler<void()>> parked_splice_;
    std::optional<net::any_completion_handler<void()>> deferred_write_;
    // Read side.
    std::string held_;
    unsigned char header_[14] = {};
    std::size_t header_len_ = 0;
    std::size_t header_need_ = 2;
    std::uint64_t payload_left_ = 0;
};

/// Beast's WebSocket closing handshake tears down the layer below the guard.
template <typename NextLayer, typename TeardownHandler>
void async_teardown(beast::role_type role, frame_guard<NextLayer>& stream,
                    TeardownHandler&& handler) {
    using beast::websocket::async_teardown;
    async_teardown(role, stream.next_layer(), std::forward<TeardownHandler>(handler));
}

template <typename NextLayer>
void teardown(beast::role_type role, frame_guard<NextLayer>& stream, beast::error_code& ec) {
    using beast::websocket::teardown;
    teardown(role, stream.next_layer(), ec);
}

}  // namespace sandboxd
