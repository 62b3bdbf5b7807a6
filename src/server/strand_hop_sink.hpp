#pragma once
// A ChannelSink on one strand that forwards to a sink on another (issue 46): a detached
// channel runs on a strand of its own, and the host connection attached to it now runs on its
// connection's strand. Each call is posted to the target's strand, in order, and dropped once
// the target is gone.
//
// It never splices (can_splice() is false: the bytes are in a frame already) and always has
// room: what it forwards is bounded by the attachment's credit window (DetachedOutput), as a
// peer link's relayed frames are by their channels' windows.
//
// Threading: called on the source strand; the target's methods run on the target strand.
#include "server/channel.hpp"

#include <boost/asio/post.hpp>

#include <memory>
#include <string>
#include <utility>

namespace sandboxd {

class StrandHopSink final : public ChannelSink {
public:
    StrandHopSink(net::any_io_executor target_strand, std::weak_ptr<ChannelSink> target)
        : strand_(std::move(target_strand)), target_(std::move(target)) {}

    void send_binary(std::string frame) override {
        hop([frame = std::move(frame)](ChannelSink& t) mutable {
            t.send_binary(std::move(frame));
        });
    }
    void send_text(std::string text) override {
        hop([text = std::move(text)](ChannelSink& t) mutable { t.send_text(std::move(text)); });
    }
    void channel_finished(std::uint32_t channel) override {
        hop([channel](ChannelSink& t) { t.channel_finished(channel); });
    }

private:
    template <typename F>
    void hop(F f) {
        net::post(strand_, [target = target_, f = std::move(f)]() mutable {
            if (auto t = target.lock()) f(*t);
        });
    }

    net::any_io_executor strand_;
    std::weak_ptr<ChannelSink> target_;
};

}  // namespace sandboxd
