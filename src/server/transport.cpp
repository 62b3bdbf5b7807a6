#include "server/transport.hpp"

#include <sandboxd/core/frame.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>
#include <boost/asio/experimental/awaitable_operators.hpp>

#include <algorithm>

namespace sandboxd {
namespace {

using namespace net::experimental::awaitable_operators;

constexpr std::string_view subprotocol = "sandboxd.v1";

bool offers_subprotocol(std::string_view header) {
    // Sec-WebSocket-Protocol: a comma-separated list of tokens.
    std::size_t pos = 0;
    while (pos <= header.size()) {
        auto comma = header.find(',', pos);
        auto item = header.substr(pos, comma == std::string_view::npos ? header.npos : comma - pos);
        while (!item.empty() && (item.front() == ' ' || item.front() == '\t'))
            item.remove_prefix(1);
        while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
        if (item == subprotocol) return true;
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
    }
    return false;
}

std::string remote_of(const tcp::socket& socket) {
    beast::error_code ec;
    auto ep = socket.remote_endpoint(ec);
    return ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
}

}  // namespace

Transport::Transport(ConnStream stream, const LimitsConfig& limits, SendBudget* budget, bool exempt)
    : ws_(std::move(stream)),
      limits_(limits),
      strand_(ws_.get_executor()),
      peer_(remote_of(beast::get_lowest_layer(ws_).socket())),
      queue_timer_(strand_) {
    queue_timer_.expires_at(net::steady_timer::time_point::max());
    if (budget) account_.emplace(*budget, exempt);
}

void Transport::written(std::size_t bytes) {
    if (account_) account_->sub(bytes);
    send_progress_ = std::chrono::steady_clock::now();
    if (on_written_) on_written_();
}

awaitable<bool> Transport::accept(const http::request<http::string_body>& request) {
    beast::get_lowest_layer(ws_).expires_never();
    websocket::stream_base::timeout timeouts{};
    timeouts.handshake_timeout = std::chrono::seconds(30);
    // Not Beast's idle_timeout: without its own keep-alive pings it counts from the start of
    // each read, and the pongs that answer ping_loop's pings arrive inside a read without
    // re-arming it, so a silent but healthy peer would be dropped. idle_loop counts from the
    // last frame heard, pongs included.
    timeouts.idle_timeout = websocket::stream_base::none();
    timeouts.keep_alive_pings = false;  // ping_loop pings every pingIntervalMs instead
    ws_.set_option(timeouts);
    ws_.control_callback([this](websocket::frame_type, beast::string_view) {
        last_heard_ = std::chrono::steady_clock::now();  // a ping, pong or close (on the strand)
    });
    // No permessage-deflate: Beast leaves it off unless asked, so an offer is answered
    // without the extension and a frame with RSV1 set is a protocol error (1002).
    ws_.auto_fragment(false);  // Beast's default splits every message into 4 KiB frames
    ws_.read_message_max(std::max<std::size_t>(limits_.max_text_message,
                                               limits_.max_data_payload + frame_header_size));
    const bool echo_subprotocol = offers_subprotocol(request[http::field::sec_websocket_protocol]);
    ws_.set_option(
        websocket::stream_base::decorator([echo_subprotocol](websocket::response_type& res) {
            res.set(http::field::server, std::string("sandboxd/") + version_string);
            if (echo_subprotocol) res.set(http::field::sec_websocket_protocol, subprotocol);
        }));
    auto [ec] = co_await ws_.async_accept(request, as_tuple_awaitable);
    if (ec) {
        spdlog::debug("peer={} websocket handshake failed: {}", peer_, ec.message());
        co_return false;
    }
    // From here on every byte written is a frame (frame_guard follows them).
    ws_.next_layer().begin_frames();
    last_heard_ = std::chrono::steady_clock::now();
    co_return true;
}

awaitable<void> Transport::serve(Receiver& receiver) {
    try {
        // Whichever loop ends first ends the connection; the others are cancelled with it.
        co_await (read_loop(receiver) || write_loop() || ping_loop() || idle_loop() ||
                  stall_loop());
    } catch (const std::exception& e) {
        spdlog::error("peer={} connection loop failed: {}", peer_, e.what());
    }
    closing_ = true;
    close_written_ = true;
    // Spliced frames never written: their channels read their pipes again.
    for (auto& out : queue_) {
        if (out.spliced) complete_spliced(std::move(out.spliced), false);
    }
    queue_.clear();
    if (account_) account_->sub(account_->queued());
    // Whoever waited for room drains and stops now (has_room() is true once closing).
    if (on_written_) on_written_();
}

void Transport::complete_spliced(std::function<void(bool)> done, bool written) {
    net::post(strand_, [done = std::move(done), written] { done(written); });
}

awaitable<void> Transport::read_loop(Receiver& receiver) {
    beast::flat_buffer buffer;
    for (;;) {
        auto [ec, n] = co_await ws_.async_read(buffer, as_tuple_awaitable);
        if (ec) {
            if (ec != websocket::error::closed && ec != net::error::operation_aborted &&
                ec != net::error::eof) {
                spdlog::info("peer={} connection ended: {}", peer_, ec.message());
            }
            co_return;
        }
        last_heard_ = std::chrono::steady_clock::now();
        const auto data = buffer.data();
        const std::string_view message(static_cast<const char*>(data.data()), data.size());
        if (ws_.got_text()) {
            co_await receiver.on_text(message);
            auto cs = co_await net::this_coro::cancellation_state;
            if (cs.cancelled() != net::cancellation_type::none) co_return;
        } else if (auto reason = receiver.on_binary(message)) {
            closing_ = true;
            co_await ws_.async_close(*reason, as_tuple_awaitable);
            co_return;
        }
        buffer.consume(buffer.size());
        if (closing_) co_return;
    }
}

awaitable<void> Transport::write_loop() {
    for (;;) {
        if (queue_.empty()) {
            if (close_code_) {
                // close(): everything queued before it is written; now the close handshake.
                // The read loop ends when the peer answers it (or the socket fails).
                close_written_ = true;
                co_await ws_.async_close(*close_code_, as_tuple_awaitable);
                co_return;
            }
            // Woken by a cancel. Spare buffers are kept only while the connection writes.
            if (!spare_.empty()) queue_timer_.expires_after(spare_buffer_idle);
            auto [idle] = co_await queue_timer_.async_wait(as_tuple_awaitable);
            if (!idle) spare_.clear();  // the timer expired: nothing was sent for a while
            queue_timer_.expires_at(net::steady_timer::time_point::max());
            auto cs = co_await net::this_coro::cancellation_state;
            if (cs.cancelled() != net::cancellation_type::none || (closing_ && !close_code_))
                co_return;
            continue;
        }
        Outgoing out = std::move(queue_.front());
        queue_.pop_front();
        const std::size_t size = out.bytes.size();
        writing_ = true;
        if (out.spliced) {
            auto [ec, n] = co_await ws_.next_layer().async_write_spliced(
                std::move(out.bytes), out.splice_fd, out.splice_count, as_tuple_awaitable);
            writing_ = false;
            written(size);
            complete_spliced(std::move(out.spliced), !ec);
            if (ec) {
                closing_ = true;  // the peer may hold part of a frame: nothing more is written
                beast::get_lowest_layer(ws_).socket().close(ec);
                co_return;
            }
            continue;
        }
        ws_.binary(out.binary);
        auto [ec, n] = co_await ws_.async_write(net::buffer(out.bytes), as_tuple_awaitable);
        writing_ = false;
        written(size);
        if (ec) {
            // The read then fails too; closing here makes sure it does at once.
            beast::get_lowest_layer(ws_).socket().close(ec);
            co_return;
        }
        if (out.binary && out.bytes.capacity() >= min_spare_capacity &&
            spare_.size() < max_spare_buffers) {
            spare_.push_back(std::move(out.bytes));  // size and bytes kept: see take_buffer()
        }
    }
}

awaitable<void> Transport::ping_loop() {
    net::steady_timer timer(strand_);
    for (;;) {
        timer.expires_after(std::chrono::milliseconds(limits_.ping_interval_ms));
        auto [ec] = co_await timer.async_wait(as_tuple_awaitable);
        if (ec) co_return;  // cancelled: the connection ends
        auto [pec] = co_await ws_.async_ping({}, as_tuple_awaitable);
        if (pec) {
            beast::get_lowest_layer(ws_).socket().close(pec);
            co_return;
        }
    }
}

awaitable<void> Transport::idle_loop() {
    const auto idle = std::chrono::milliseconds(limits_.idle_timeout_ms);
    net::steady_timer timer(strand_);
    for (;;) {
        // A read is always outstanding (requests run beside it), so silence is the time since
        // the last frame heard.
        timer.expires_at(last_heard_ + idle);
        auto [ec] = co_await timer.async_wait(as_tuple_awaitable);
        if (ec) co_return;  // cancelled: the connection ends
        const auto silent = std::chrono::steady_clock::now() - last_heard_;
        if (silent < idle) continue;  // heard from it meanwhile
        spdlog::info("peer={} silent for {} ms (limit {} ms): dropping the connection", peer_,
                     std::chrono::duration_cast<std::chrono::milliseconds>(silent).count(),
                     idle.count());
        // The read fails, and the connection ends as any dropped connection does.
        beast::error_code ignored;
        beast::get_lowest_layer(ws_).socket().close(ignored);
        co_return;
    }
}

awaitable<void> Transport::stall_loop() {
    const auto stall = std::chrono::milliseconds(limits_.send_stall_timeout_ms);
    net::steady_timer timer(strand_);
    for (;;) {
        const bool backlog = writing_ || !queue_.empty();
        const auto now = std::chrono::steady_clock::now();
        timer.expires_at(backlog ? send_progress_ + stall : now + stall);
        auto [ec] = co_await timer.async_wait(as_tuple_awaitable);
        if (ec) co_return;  // cancelled: the connection ends
        if (!(writing_ || !queue_.empty())) continue;
        const auto stalled = std::chrono::steady_clock::now() - send_progress_;
        if (stalled < stall) continue;
        spdlog::info(
            "peer={} took no message for {} ms with {} bytes queued (limits.sendStallTimeoutMs "
            "{}): dropping the connection",
            peer_, std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count(),
            queued_bytes(), stall.count());
        beast::error_code ignored;
        beast::get_lowest_layer(ws_).socket().close(ignored);
        co_return;
    }
}

void Transport::send(bool binary, std::string bytes) {
    if (closing_) return;
    if (queue_.empty() && !writing_) send_progress_ = std::chrono::steady_clock::now();
    if (account_) account_->add(bytes.size());
    queue_.push_back({binary, std::move(bytes), -1, 0, {}});
    queue_timer_.cancel();
}

void Transport::send_spliced(std::string head, int pipe_fd, std::size_t count,
                             std::function<void(bool written)> done) {
    if (!can_splice()) return complete_spliced(std::move(done), false);
    if (queue_.empty() && !writing_) send_progress_ = std::chrono::steady_clock::now();
    // Only the head is held here: the payload waits in the pipe (the lease's, not ours).
    if (account_) account_->add(head.size());
    queue_.push_back({true, std::move(head), pipe_fd, count, std::move(done)});
    queue_timer_.cancel();
}

std::string Transport::take_buffer() {
    if (spare_.empty()) return {};
    std::string out = std::move(spare_.back());
    spare_.pop_back();
    return out;
}

void Transport::close(websocket::close_code code, std::shared_ptr<void> keep_alive) {
    net::post(strand_, [this, code, keep_alive = std::move(keep_alive)] {
        (void)keep_alive;
        if (closing_) return;
        closing_ = true;  // what opens from now on is hung up at once (Session::open_local)
        close_code_ = code;
        queue_timer_.cancel();  // the write loop flushes the queue, then closes
    });
}

}  // namespace sandboxd
