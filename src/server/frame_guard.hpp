#pragma once
// A stream layer under the server's WebSocket that enforces the one rule of RFC 6455 section
// 5.2 that Boost.Beast 1.81 does not: the most significant bit of a 64-bit payload length
// MUST be 0. Beast compares such a length with read_message_max first and closes with 1009
// (too big); the guard sets RSV2 on that frame's first byte (no extension here gives RSV2 a
// meaning) so that Beast fails the frame as the protocol error it is: close 1002. Every other
// byte passes through untouched, and nothing is allocated for any declared length (CASES.md
// B15).
//
// It follows the frame headers of the incoming byte stream. A header whose first bytes end a
// read before its length can be judged (1 byte, or 2 with the 64-bit length code) is held
// back and delivered with the next read, so that its first byte can still be marked.
//
// Threading: as the stream it wraps: one read and one write at a time, on one strand.
#include <sandboxd/core/net.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace sandboxd {

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
        return next_.async_write_some(buffers, std::forward<WriteHandler>(handler));
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

private:
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
