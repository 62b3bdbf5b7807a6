#include "server/detached_output.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/frame.hpp>
#include <sandboxd/core/jsonrpc.hpp>
#include <sandboxd/core/lease.hpp>

#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <limits>
#include <utility>

namespace sandboxd {
namespace {

using json = nlohmann::json;

/// The largest data frame sent to an attachment (the Channel's own read size).
constexpr std::size_t max_frame_payload = 256 * 1024;

constexpr std::size_t index(output_stream s) noexcept { return s == output_stream::err ? 1 : 0; }

stream_id wire(output_stream s) noexcept {
    return s == output_stream::err ? stream_id::stderr_ : stream_id::stdout_;
}

}  // namespace

DetachedOutput::DetachedOutput(strand_t strand, std::unique_ptr<KeptOutput> kept)
    : strand_(std::move(strand)), kept_(std::move(kept)) {}

DetachedOutput::AttachResult DetachedOutput::attach(std::weak_ptr<ChannelSink> sink,
                                                    std::uint32_t channel_id,
                                                    std::uint32_t output_window,
                                                    std::optional<Offsets> from, bool takeover,
                                                    bool hold) {
    if (attachment_ && !takeover) {
        throw rpc_error(errc::channel_attached,
                        "another connection is attached to this detached channel; attach "
                        "with takeover: true to take it over",
                        {{"takeover", false}});
    }
    // An ended channel that nobody read holds no descriptor: its files are opened again for
    // this attachment (a failure changes nothing).
    kept_->reopen();
    if (attachment_) end_taken_over();
    if (idle_timer_) idle_timer_->cancel();
    ++generation_;
    Attachment a;
    a.sink = std::move(sink);
    a.channel_id = channel_id;
    a.window = output_window;
    a.held = hold;
    const std::array<std::uint64_t, 2> asked =
        from ? std::array<std::uint64_t, 2>{from->stdout_offset, from->stderr_offset}
             : std::array<std::uint64_t, 2>{kept_->first_kept(output_stream::out),
                                            kept_->first_kept(output_stream::err)};
    for (auto s : {output_stream::out, output_stream::err}) {
        a.cursor[index(s)] = std::min(asked[index(s)], kept_->end(s));
    }
    attachment_ = std::move(a);
    schedule();
    return {{attachment_->cursor[0], attachment_->cursor[1]}, generation_};
}

void DetachedOutput::release(std::uint64_t id) {
    if (id != generation_ || !attachment_) return;
    attachment_->held = false;
    schedule();
}

void DetachedOutput::end_attachment(const char* outcome, json error) {
    if (auto sink = attachment_->sink.lock()) {
        const auto id = attachment_->channel_id;
        json params = {{"channel", id},      {"exitCode", nullptr},    {"signal", nullptr},
                       {"outcome", outcome}, {"stdoutBytes", nullptr}, {"stderrBytes", nullptr}};
        if (!error.is_null()) params["error"] = std::move(error);
        sink->send_text(jsonrpc::notification("duplexChannel.exit", std::move(params)));
        sink->channel_finished(id);
    }
}

void DetachedOutput::end_taken_over() {
    end_attachment("takenOver");
    drop_attachment();
}

void DetachedOutput::detach(std::uint64_t id) noexcept {
    if (id == generation_) let_go();
}

void DetachedOutput::let_go() noexcept {
    drop_attachment();
    if (finished_) {
        kept_->close_files();  // nothing more is written or read until an attach
    } else {
        arm_idle_hangup();
    }
}

void DetachedOutput::arm_idle_hangup() noexcept try {
    if (!idle_after_) return;
    if (!idle_timer_) idle_timer_ = std::make_unique<net::steady_timer>(strand_);
    idle_timer_->expires_after(*idle_after_);  // cancels a wait still pending
    idle_timer_->async_wait([weak = weak_from_this()](beast::error_code ec) {
        auto self = weak.lock();
        if (ec || !self || self->attachment_ || self->finished_) return;
        if (auto channel = self->channel_.lock()) {
            spdlog::info("detached channel: no host attached for {} ms: hanging it up",
                         self->idle_after_->count());
            channel->hangup(channel_outcome::transport_closed, /*keep_sink=*/true);
        }
    });
} catch (const std::exception& e) {
    // Out of memory: the channel runs on without the hangupAfterMs rule.
    spdlog::error("detached channel: cannot start its hangupAfterMs timer: {}", e.what());
}

void DetachedOutput::drop_attachment() noexcept {
    ++generation_;
    attachment_.reset();
    // Nobody is attached: the command is held back by no one.
    if (withheld_ > 0) {
        const auto n = std::exchange(withheld_, 0);
        try {
            net::post(strand_, [weak = channel_, n] {
                if (auto channel = weak.lock()) channel->add_credit(static_cast<std::uint32_t>(n));
            });
        } catch (const std::exception& e) {
            // Out of memory: the command stays held back until the next host's credit.
            spdlog::error("detached channel: crediting {} bytes back: {}", n, e.what());
        }
    }
}

void DetachedOutput::add_credit(std::uint32_t bytes) {
    if (!attachment_) return;
    auto& a = *attachment_;
    a.unacked = bytes >= a.unacked ? 0 : a.unacked - bytes;
    schedule();
}

void DetachedOutput::send_binary(std::string frame) {
    auto decoded = decode_frame(frame, std::numeric_limits<std::uint32_t>::max());
    if (const auto* credit = std::get_if<CreditFrame>(&decoded)) {
        // Stdin credit: the host attached now is the one writing.
        if (auto sink = attachment_ ? attachment_->sink.lock() : nullptr) {
            sink->send_binary(
                encode_credit(attachment_->channel_id, stream_id::stdin_, credit->bytes));
        }
        return;
    }
    const auto* data = std::get_if<DataFrame>(&decoded);
    if (!data || data->stream == stream_id::stdin_) return;
    const auto stream =
        data->stream == stream_id::stderr_ ? output_stream::err : output_stream::out;
    const auto at = kept_->end(stream);
    kept_->append(stream, data->payload);
    const auto n = static_cast<std::uint32_t>(data->payload.size());
    kept_bytes(n);
    if (!forward_live(stream, at, frame, n)) schedule();
}

void DetachedOutput::send_spliced(std::string head, int pipe_fd, std::size_t count,
                                  std::function<void(bool written)> done) {
    // The stream is in the data header, the last bytes of `head`.
    const auto header = std::string_view(head).substr(head.size() - frame_header_size);
    const auto stream = static_cast<stream_id>(header[5]) == stream_id::stderr_
                            ? output_stream::err
                            : output_stream::out;
    const auto before = kept_->end(stream);
    try {
        kept_->splice_in(stream, pipe_fd, count);
    } catch (const std::exception& e) {
        // Not kept (an I/O error on the state directory): what is left of the frame is read
        // and dropped, so that the command goes on; those bytes are lost to every host.
        std::size_t left = count - static_cast<std::size_t>(kept_->end(stream) - before);
        spdlog::error("detached channel: {}: {} bytes of output dropped", e.what(), left);
        char sink[4096];
        while (left > 0) {
            const ssize_t n = ::read(pipe_fd, sink, std::min(left, sizeof sink));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            left -= static_cast<std::size_t>(n);
        }
    }
    kept_bytes(static_cast<std::uint32_t>(count));
    schedule();
    net::post(strand_, [done = std::move(done)] { done(true); });
}

void DetachedOutput::kept_bytes(std::uint32_t n) {
    if (attachment_) {
        // A host is attached: the command goes at its pace, its credit coming back as the
        // host is sent bytes (sent()), as an undetached channel's would.
        withheld_ += n;
    } else {
        // Read, as far as the command is concerned: its credit comes back at once.
        net::post(strand_, [weak = channel_, n] {
            if (auto channel = weak.lock()) channel->add_credit(n);
        });
    }
}

void DetachedOutput::sent(std::uint64_t n) {
    const auto back = std::min(n, withheld_);
    if (back == 0) return;
    withheld_ -= back;
    net::post(strand_, [weak = channel_, back] {
        if (auto channel = weak.lock()) channel->add_credit(static_cast<std::uint32_t>(back));
    });
}

bool DetachedOutput::forward_live(output_stream stream, std::uint64_t at, std::string& frame,
                                  std::uint32_t n) {
    if (!attachment_) return false;
    auto& a = *attachment_;
    auto& cursor = a.cursor[index(stream)];
    // Only an attachment that has everything before these bytes, with room for all of them.
    if (a.held || a.waiting_room || cursor != at || a.unacked + n > a.window) return false;
    auto sink = a.sink.lock();
    if (!sink || !sink->has_send_room()) return false;
    set_frame_channel(frame, a.channel_id);
    sink->send_binary(std::move(frame));
    cursor += n;
    a.unacked += n;
    sent(n);
    return true;
}

void DetachedOutput::send_text(std::string text) {
    // The only text a binary-mode channel sends is its exit.
    auto message = json::parse(text, nullptr, false);
    if (message.is_discarded() || message.value("method", "") != "duplexChannel.exit") return;
    exit_ = std::move(message["params"]);
    if (persist_exit_) {
        // One small write, on the strand as the kept output's are: a later process finds the
        // channel ended, with this exit (kept_channels.cpp).
        json record = exit_;
        record["endedAt"] = now_ms();
        const auto path = kept_->dir() / "exit.json";
        std::ofstream out(path, std::ios::trunc);
        out << record.dump();
        if (!out) spdlog::warn("detached channel: cannot write {}", path.string());
    }
    schedule();
}

void DetachedOutput::restore_exit(json exit) {
    exit_ = std::move(exit);
    finished_ = true;
    kept_->close_files();
}

void DetachedOutput::channel_finished(std::uint32_t /*channel*/) {
    finished_ = true;
    if (idle_timer_) idle_timer_->cancel();
    if (!attachment_) kept_->close_files();
}

void DetachedOutput::schedule() {
    if (!attachment_ || attachment_->scheduled || attachment_->held) return;
    attachment_->scheduled = true;
    net::post(strand_, [self = shared_from_this(), generation = generation_] {
        if (generation != self->generation_ || !self->attachment_) return;
        self->attachment_->scheduled = false;
        try {
            self->send_to_attachment();
        } catch (const std::exception& e) {
            // The kept files failed (an I/O error): this attachment ends with the error, the
            // command goes on; another attach may try again.
            spdlog::warn("detached channel: sending kept output to an attachment: {}", e.what());
            if (!self->attachment_) return;
            self->end_attachment(
                "error",
                rpc_error(errc::provider_error, std::string("kept output: ") + e.what()).to_json());
            self->let_go();
        }
    });
}

void DetachedOutput::send_to_attachment() {
    auto& a = *attachment_;
    auto sink = a.sink.lock();
    if (!sink) return let_go();  // its connection is gone
    while (a.unacked < a.window) {
        if (!sink->has_send_room()) {
            if (!a.waiting_room) {
                a.waiting_room = true;
                sink->when_send_room([weak = weak_from_this(), generation = generation_] {
                    auto self = weak.lock();
                    if (!self || generation != self->generation_ || !self->attachment_) return;
                    self->attachment_->waiting_room = false;
                    self->schedule();
                });
            }
            return;
        }
        const bool sent_out = send_kept(a, *sink, output_stream::out);
        const bool sent_err = send_kept(a, *sink, output_stream::err);
        if (!sent_out && !sent_err) break;
    }
    const bool caught_up = a.cursor[0] == kept_->end(output_stream::out) &&
                           a.cursor[1] == kept_->end(output_stream::err);
    if (caught_up && !exit_.is_null() && !a.exit_sent) {
        a.exit_sent = true;
        auto params = exit_;
        params["channel"] = a.channel_id;
        sink->send_text(jsonrpc::notification("duplexChannel.exit", std::move(params)));
        sink->channel_finished(a.channel_id);
        let_go();  // it has everything: the next host may attach without a takeover
    }
}

bool DetachedOutput::send_kept(Attachment& a, ChannelSink& sink, output_stream stream) {
    auto& cursor = a.cursor[index(stream)];
    if (const auto first = kept_->first_kept(stream); cursor < first) {
        // Bytes it has not read are no longer kept: it is told where the kept ones begin.
        sink.send_text(jsonrpc::notification(
            "duplexChannel.gap", {{"channel", a.channel_id},
                                  {"stream", stream == output_stream::err ? "stderr" : "stdout"},
                                  {"firstKept", first}}));
        cursor = first;
    }
    const auto left = kept_->end(stream) - cursor;
    const auto room = a.window - a.unacked;
    const auto n = static_cast<std::size_t>(
        std::min<std::uint64_t>({left, room, static_cast<std::uint64_t>(max_frame_payload)}));
    if (n == 0) return false;
    std::string frame = sink.frame_buffer();
    frame.resize(frame_header_size + n);
    kept_->read(stream, cursor, std::span<char>(frame.data() + frame_header_size, n));
    write_data_header(frame.data(), a.channel_id, wire(stream));
    sink.send_binary(std::move(frame));
    cursor += n;
    a.unacked += n;
    sent(n);
    return true;
}

}  // namespace sandboxd
