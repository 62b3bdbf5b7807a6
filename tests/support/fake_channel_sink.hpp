#pragma once
// A ChannelSink (src/server/channel.hpp) that records what a channel or a ChannelMux sends, in
// order, for unit tests of the data plane: no connection behind it. Its send room is the
// test's to give (`room`, then give_room()); it never splices (can_splice() is false, as on a
// TLS connection). Single-threaded: used on the test's io_context.
#include "server/channel.hpp"

#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/json_limits.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/post.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd::test {

class FakeChannelSink final : public ChannelSink {
public:
    /// One message queued, in order: a binary frame (encoded) or a text message.
    struct Sent {
        bool binary = false;
        std::string bytes;
    };

    /// `executor`: where when_send_room()'s resume runs (the channel's strand).
    explicit FakeChannelSink(boost::asio::any_io_executor executor)
        : executor_(std::move(executor)) {}

    std::vector<Sent> sent;
    std::vector<std::uint32_t> finished;  ///< channel_finished() arguments, in order
    /// has_send_room()'s answer.
    bool room = true;
    /// when_send_room() calls made (each while `room` was false).
    int room_waits = 0;

    void send_binary(std::string frame) override { sent.push_back({true, std::move(frame)}); }
    void send_text(std::string text) override { sent.push_back({false, std::move(text)}); }
    bool has_send_room() override { return room; }
    void when_send_room(std::function<void()> resume) override {
        ++room_waits;
        resumes_.push_back(std::move(resume));
    }
    void channel_finished(std::uint32_t channel) override { finished.push_back(channel); }

    /// Gives room again and runs the parked resumes on the executor (never inside this call).
    void give_room() {
        room = true;
        for (auto& resume : std::exchange(resumes_, {}))
            boost::asio::post(executor_, std::move(resume));
    }

    // ---- reading what was sent ----

    /// The payload bytes of every data frame of `channel` on `stream`, concatenated in order.
    std::string data(std::uint32_t channel, stream_id stream) const {
        std::string out;
        for (const auto& f : frames()) {
            if (const auto* d = std::get_if<DataFrame>(&f.decoded);
                d && d->channel == channel && d->stream == stream) {
                out.append(d->payload);
            }
        }
        return out;
    }
    /// The sum of the stdin credit frames of `channel`.
    std::uint64_t stdin_credit(std::uint32_t channel) const {
        std::uint64_t n = 0;
        for (const auto& f : frames()) {
            if (const auto* c = std::get_if<CreditFrame>(&f.decoded);
                c && c->channel == channel && c->stream == stream_id::stdin_) {
                n += c->bytes;
            }
        }
        return n;
    }
    /// The text messages that are notifications of `method`, their params, in order.
    std::vector<nlohmann::json> notifications(const std::string& method) const {
        std::vector<nlohmann::json> out;
        for (const auto& s : sent) {
            if (s.binary) continue;
            auto j = parse_json(s.bytes);
            if (j.value("method", "") == method) out.push_back(j["params"]);
        }
        return out;
    }
    /// The index in `sent` of the last binary message, or -1.
    int last_binary() const {
        for (int i = static_cast<int>(sent.size()) - 1; i >= 0; --i) {
            if (sent[static_cast<std::size_t>(i)].binary) return i;
        }
        return -1;
    }
    /// The index in `sent` of the first text message, or -1.
    int first_text() const {
        for (std::size_t i = 0; i < sent.size(); ++i) {
            if (!sent[i].binary) return static_cast<int>(i);
        }
        return -1;
    }

private:
    struct Frame {
        std::string bytes;  ///< owns what `decoded` views
        DecodedFrame decoded;
    };
    std::vector<Frame> frames() const {
        std::vector<Frame> out;
        out.reserve(sent.size());
        for (const auto& s : sent) {
            if (!s.binary) continue;
            out.push_back({s.bytes, FrameError{}});
        }
        // Decoded once the strings stop moving: a DataFrame's payload views its Frame's bytes.
        for (auto& f : out) f.decoded = decode_frame(f.bytes, 1 << 24);
        return out;
    }

    boost::asio::any_io_executor executor_;
    std::vector<std::function<void()>> resumes_;
};

}  // namespace sandboxd::test
