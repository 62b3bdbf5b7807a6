#include <sandboxd/core/frame.hpp>

namespace sandboxd {
namespace {

void put_u32(char* out, std::uint32_t v) noexcept {
    out[0] = static_cast<char>((v >> 24) & 0xff);
    out[1] = static_cast<char>((v >> 16) & 0xff);
    out[2] = static_cast<char>((v >> 8) & 0xff);
    out[3] = static_cast<char>(v & 0xff);
}

std::uint32_t get_u32(const char* in) noexcept {
    auto b = [in](int i) { return static_cast<std::uint32_t>(static_cast<unsigned char>(in[i])); };
    return (b(0) << 24) | (b(1) << 16) | (b(2) << 8) | b(3);
}

}  // namespace

DecodedFrame decode_frame(std::string_view m, std::size_t max_payload) {
    if (m.size() < frame_header_size) {
        return FrameError{"binary frame shorter than its 6-byte header"};
    }
    auto kind = static_cast<std::uint8_t>(m[0]);
    auto stream = static_cast<std::uint8_t>(m[5]);
    std::uint32_t channel = get_u32(m.data() + 1);
    if (stream > 2)
        return FrameError{"binary frame names unknown stream " + std::to_string(stream)};
    if (kind == static_cast<std::uint8_t>(frame_kind::data)) {
        auto payload = m.substr(frame_header_size);
        if (payload.empty()) return FrameError{"data frame with an empty payload"};
        if (payload.size() > max_payload) {
            return FrameError{"data frame payload of " + std::to_string(payload.size()) +
                                  " bytes is over the limit of " + std::to_string(max_payload),
                              true};
        }
        return DataFrame{channel, static_cast<stream_id>(stream), payload};
    }
    if (kind == static_cast<std::uint8_t>(frame_kind::credit)) {
        if (m.size() != frame_header_size + 4) return FrameError{"credit frame is not 10 bytes"};
        std::uint32_t bytes = get_u32(m.data() + frame_header_size);
        if (bytes == 0) return FrameError{"credit frame grants 0 bytes"};
        return CreditFrame{channel, static_cast<stream_id>(stream), bytes};
    }
    return FrameError{"binary frame of unknown kind " + std::to_string(kind)};
}

void write_data_header(char* out, std::uint32_t channel, stream_id stream) noexcept {
    out[0] = static_cast<char>(frame_kind::data);
    put_u32(out + 1, channel);
    out[5] = static_cast<char>(stream);
}

void set_frame_channel(std::string& frame, std::uint32_t channel) noexcept {
    put_u32(frame.data() + 1, channel);
}

std::string encode_data(std::uint32_t channel, stream_id stream, std::string_view payload) {
    std::string out(frame_header_size + payload.size(), '\0');
    write_data_header(out.data(), channel, stream);
    out.replace(frame_header_size, payload.size(), payload);
    return out;
}

std::string encode_credit(std::uint32_t channel, stream_id stream, std::uint32_t bytes) {
    std::string out(frame_header_size + 4, '\0');
    out[0] = static_cast<char>(frame_kind::credit);
    put_u32(out.data() + 1, channel);
    out[5] = static_cast<char>(stream);
    put_u32(out.data() + frame_header_size, bytes);
    return out;
}

}  // namespace sandboxd
