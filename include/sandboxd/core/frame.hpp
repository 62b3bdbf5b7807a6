#pragma once
/// @file frame.hpp
/// Binary data frames of docs/protocol.md section 4:
///   byte 0 kind (0x01 data, 0x02 credit); bytes 1-4 channel (u32 big-endian);
///   byte 5 stream (0 stdin, 1 stdout, 2 stderr);
///   data: bytes 6.. payload (1..max payload bytes); credit: bytes 6-9 u32 big-endian count.
/// Pure functions; thread-safe.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>

namespace sandboxd {

enum class frame_kind : std::uint8_t { data = 0x01, credit = 0x02 };
enum class stream_id : std::uint8_t { stdin_ = 0, stdout_ = 1, stderr_ = 2 };

inline constexpr std::size_t frame_header_size = 6;

struct DataFrame {
    std::uint32_t channel = 0;
    stream_id stream = stream_id::stdout_;
    std::string_view payload;  ///< views the decoded buffer
};

struct CreditFrame {
    std::uint32_t channel = 0;
    stream_id stream = stream_id::stdout_;
    std::uint32_t bytes = 0;
};

/// Why a frame was rejected; `what` is a human sentence for the error or close reason.
struct FrameError {
    std::string what;
    bool too_big = false;  ///< over the payload limit: close 1009 rather than 1002
};

using DecodedFrame = std::variant<DataFrame, CreditFrame, FrameError>;

/// Decodes one binary WebSocket message. Rejects: fewer than 6 bytes, an unknown kind or
/// stream, an empty data payload or one over `max_payload`, a credit frame that is not exactly
/// 10 bytes or credits 0 bytes.
DecodedFrame decode_frame(std::string_view message, std::size_t max_payload);

/// Writes the 6-byte data header into `out` (which must hold frame_header_size bytes).
void write_data_header(char* out, std::uint32_t channel, stream_id stream) noexcept;
/// Rewrites the channel id of an encoded frame of either kind (bytes 1..4, big-endian), as a
/// relay does when it renumbers a channel. `frame` must hold at least frame_header_size bytes.
void set_frame_channel(std::string& frame, std::uint32_t channel) noexcept;
/// A whole data frame (header + payload).
std::string encode_data(std::uint32_t channel, stream_id stream, std::string_view payload);
/// A whole credit frame (10 bytes).
std::string encode_credit(std::uint32_t channel, stream_id stream, std::uint32_t bytes);

}  // namespace sandboxd
