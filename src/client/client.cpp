#include <sandboxd/client/client.hpp>

#include <sandboxd/client/client_impl.hpp>

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include <algorithm>

namespace sandboxd {

using json = nlohmann::json;

namespace {

client_error timed_out(std::chrono::milliseconds timeout) {
    return client_error("timed out after " + std::to_string(timeout.count()) + " ms");
}

}  // namespace

template <typename Done>
void Client::Impl::close_and_drain(Done done) {
    beast::error_code ignored;
    beast::get_lowest_layer(ws).socket().close(ignored);
    ioc.restart();
    while (!done() && ioc.run_one() > 0) {
    }
}

template <typename Start>
void Client::Impl::run(Start start) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    beast::error_code result = net::error::would_block;
    start([&result](beast::error_code ec, auto&&...) { result = ec; });
    ioc.restart();
    while (result == net::error::would_block && ioc.run_one_until(deadline) > 0) {
    }
    if (result == net::error::would_block) {
        if (std::chrono::steady_clock::now() < deadline) {
            throw client_error("the connection's I/O stopped");
        }
        // The operation's handler still refers to `result`: let it finish first.
        close_and_drain([&result] { return result != net::error::would_block; });
        throw timed_out(timeout);
    }
    if (result) throw client_error(result.message());
}

void Client::Impl::start_read() {
    if (read_in_flight) return;
    buffer.clear();
    read_in_flight = true;
    read_done = false;
    ws.async_read(buffer, [this](beast::error_code ec, std::size_t) {
        read_error = ec;
        read_done = true;
    });
}

bool Client::Impl::wait_read(std::chrono::steady_clock::time_point deadline) {
    ioc.restart();
    while (!read_done && ioc.run_one_until(deadline) > 0) {
    }
    return read_done;
}

namespace {

/// Connects `impl`'s socket to `parsed`'s endpoint; with `receive_buffer` > 0, SO_RCVBUF is
/// set on each socket before its connect.
void connect_tcp(Client::Impl& impl, const WsUrl& parsed, int receive_buffer) {
    const std::string authority = parsed.endpoint.authority();
    tcp::resolver resolver(impl.ioc);
    beast::error_code ec;
    auto endpoints = resolver.resolve(parsed.endpoint.host, parsed.endpoint.port_text(), ec);
    if (ec) throw client_error("cannot resolve " + parsed.endpoint.host + ": " + ec.message());
    auto& lowest = beast::get_lowest_layer(impl.ws);
    if (receive_buffer > 0) {
        // SO_RCVBUF must be set before connect() to bound the window the kernel advertises.
        beast::error_code last = net::error::host_not_found;
        for (const auto& entry : endpoints) {
            auto& socket = lowest.socket();
            socket.close(ec);
            socket.open(entry.endpoint().protocol(), ec);
            if (ec) throw client_error("cannot open a socket: " + ec.message());
            socket.set_option(net::socket_base::receive_buffer_size(receive_buffer), ec);
            if (ec) throw client_error("cannot set SO_RCVBUF: " + ec.message());
            try {
                impl.run([&](auto handler) { lowest.async_connect(entry.endpoint(), handler); });
                last = {};
                break;
            } catch (const client_error&) {
                last = net::error::connection_refused;
            }
        }
        if (last) throw client_error("cannot connect to " + authority);
    } else {
        impl.run([&](auto handler) { lowest.async_connect(endpoints, handler); });
    }
}

/// The WebSocket upgrade of `impl`'s connection; a refusal names the node's HTTP status.
void upgrade(Client::Impl& impl, const std::string& authority, const std::string& target) {
    websocket::response_type response;
    // Only Beast's upgrade_declined means an HTTP answer was read: after any other failure
    // (a dropped connection, a TLS alert) the response holds no status of the node's.
    beast::error_code handshake_ec;
    try {
        impl.run([&](auto handler) {
            impl.ws.async_handshake(response, authority, target,
                                    [&handshake_ec, handler](beast::error_code result) mutable {
                                        handshake_ec = result;
                                        handler(result);
                                    });
        });
    } catch (const client_error& e) {
        const int status = static_cast<int>(response.result_int());
        if (handshake_ec == websocket::error::upgrade_declined && status != 101) {
            throw client_error("upgrade refused: HTTP " + std::to_string(status) + " " +
                                   std::string(response.reason()),
                               status);
        }
        throw;
    }
}

}  // namespace

Client::Client(const std::string& url, const std::string& token, std::chrono::milliseconds timeout,
               int receive_buffer,
               const std::vector<std::pair<std::string, std::string>>& extra_headers,
               const ClientTls& tls) {
    WsUrl parsed;
    try {
        parsed = parse_ws_url(url);
    } catch (const address_error& e) {
        throw client_error(std::string("url ") + e.what());
    }
    std::shared_ptr<ssl::context> context;
    if (parsed.tls) {
        TlsClientOptions o;
        o.ca_file = tls.ca_file;
        o.cert_file = tls.cert_file;
        o.key_file = tls.key_file;
        o.insecure_skip_verify = tls.insecure_skip_verify;
        context = make_client_tls(o, "client.tls");
    }
    impl_ = std::make_unique<Impl>(context);
    impl_->timeout = timeout;
    const std::string authority = parsed.endpoint.authority();
    const std::string& target = parsed.target;
    connect_tcp(*impl_, parsed, receive_buffer);
    if (auto* t = impl_->ws.next_layer().tls()) {
        expect_server_name(t->native_handle(), parsed.endpoint.host, !tls.insecure_skip_verify);
        try {
            impl_->run(
                [&](auto handler) { t->async_handshake(ssl::stream_base::client, handler); });
        } catch (const client_error& e) {
            throw client_error(std::string("TLS handshake with ") + authority +
                               " failed: " + e.what());
        }
    }
    impl_->ws.set_option(
        websocket::stream_base::decorator([token, extra_headers](websocket::request_type& req) {
            if (!token.empty()) req.set(http::field::authorization, "Bearer " + token);
            for (const auto& [name, value] : extra_headers) req.set(name, value);
            req.set(http::field::sec_websocket_protocol, "sandboxd.v1");
            req.set(http::field::user_agent, "sandboxctl");
        }));
    impl_->ws.read_message_max(64ULL << 20);
    upgrade(*impl_, authority, target);
    beast::get_lowest_layer(impl_->ws).expires_never();
}

Client::~Client() {
    beast::error_code ec;
    beast::get_lowest_layer(impl_->ws).socket().close(ec);
}

ClientEvent decode_event(bool text, std::string_view message) {
    ClientEvent ev;
    if (text) {
        ev.message = parse_json(message);
        // What the daemon sends on its own (a notification, or a request) has a method; the
        // rest answers a request of ours, malformed or not (the caller matches its id).
        const auto kind = jsonrpc::classify(ev.message);
        const bool from_daemon =
            kind == jsonrpc::message_kind::notification || kind == jsonrpc::message_kind::request ||
            (kind == jsonrpc::message_kind::invalid && ev.message.contains("method"));
        ev.type = from_daemon ? ClientEvent::kind::notification : ClientEvent::kind::response;
        return ev;
    }
    auto decoded = decode_frame(message, SIZE_MAX);
    if (auto* d = std::get_if<DataFrame>(&decoded)) {
        ev.type = ClientEvent::kind::data;
        ev.channel = d->channel;
        ev.stream = d->stream;
        ev.bytes.assign(d->payload);
    } else if (auto* c = std::get_if<CreditFrame>(&decoded)) {
        ev.type = ClientEvent::kind::credit;
        ev.channel = c->channel;
        ev.stream = c->stream;
        ev.credit = c->bytes;
    } else {
        throw client_error("daemon sent a malformed binary frame: " +
                           std::get<FrameError>(decoded).what);
    }
    return ev;
}

ClientEvent Client::Impl::take_read() {
    read_in_flight = false;
    if (read_error) throw client_error(read_error.message());
    const auto data = buffer.data();
    return decode_event(ws.got_text(),
                        std::string_view(static_cast<const char*>(data.data()), data.size()));
}

ClientEvent Client::Impl::read_one() {
    start_read();
    if (!wait_read(std::chrono::steady_clock::now() + timeout)) {
        close_and_drain([this] { return read_done; });
        read_in_flight = false;
        throw timed_out(timeout);
    }
    return take_read();
}

std::int64_t Client::send_request(const std::string& method, const json& params) {
    const auto id = impl_->next_id++;
    send_text(jsonrpc::request(id, method, params));
    return id;
}

namespace {

/// A response's result, or its error as rpc_error with the code of its reason (so that
/// callers can compare codes).
json result_of(json message) {
    jsonrpc::Response response;
    response.id = message.value("id", json());
    if (message.contains("error")) {
        response.error = std::move(message["error"]);
    } else {
        response.result = std::move(message["result"]);
    }
    return jsonrpc::result_or_throw(std::move(response));
}

}  // namespace

json Client::wait_response(std::int64_t id) {
    for (auto it = impl_->pending.begin(); it != impl_->pending.end(); ++it) {
        if (it->type == ClientEvent::kind::response && it->message.value("id", json()) == id) {
            auto msg = std::move(it->message);
            impl_->pending.erase(it);
            return result_of(std::move(msg));
        }
    }
    for (;;) {
        auto ev = impl_->read_one();
        if (ev.type == ClientEvent::kind::response && ev.message.value("id", json()) == id) {
            return result_of(std::move(ev.message));
        }
        impl_->pending.push_back(std::move(ev));
    }
}

json Client::call(const std::string& method, const json& params) {
    return wait_response(send_request(method, params));
}

ClientEvent Client::next_event() {
    if (!impl_->pending.empty()) {
        auto ev = std::move(impl_->pending.front());
        impl_->pending.pop_front();
        return ev;
    }
    return impl_->read_one();
}

std::optional<ClientEvent> Client::poll_event(std::chrono::milliseconds wait) {
    if (!impl_->pending.empty()) return next_event();
    impl_->start_read();
    if (!impl_->wait_read(std::chrono::steady_clock::now() + wait)) return std::nullopt;
    return impl_->take_read();
}

std::deque<ClientEvent> Client::take_queued() {
    std::deque<ClientEvent> out;
    out.swap(impl_->pending);
    return out;
}

void Client::requeue(std::deque<ClientEvent> events) {
    for (auto& ev : impl_->pending) events.push_back(std::move(ev));
    impl_->pending.swap(events);
}

void Client::send_text(const std::string& text) {
    impl_->ws.text(true);
    impl_->run([&](auto handler) { impl_->ws.async_write(net::buffer(text), handler); });
}

void Client::send_binary(const std::string& bytes) {
    impl_->ws.binary(true);
    impl_->run([&](auto handler) { impl_->ws.async_write(net::buffer(bytes), handler); });
}

void Client::send_stdin(std::uint32_t channel, std::string_view bytes) {
    send_binary(encode_data(channel, stream_id::stdin_, bytes));
}

void Client::send_credit(std::uint32_t channel, stream_id stream, std::uint32_t bytes) {
    send_binary(encode_credit(channel, stream, bytes));
}

ChannelRun Client::run_channel(const json& open_params, const std::string& stdin_data,
                               bool close_stdin) {
    ChannelRun run;
    run.open_result = call("duplexChannelOpen", open_params);
    run.channel = run.open_result["channel"].get<std::uint32_t>();
    const std::uint64_t window = run.open_result.value("stdinWindow", 1U << 20);
    const bool base64 = open_params.value("dataEncoding", "binary") == "base64";
    std::size_t sent = 0;
    std::uint64_t unacked = 0;
    bool closed = !close_stdin;
    std::deque<ClientEvent> others;  // other channels' messages, handed back at the end
    auto handle = [&](ClientEvent& ev) {
        const bool mine = ev.type == ClientEvent::kind::notification
                              ? ev.message["params"].value("channel", 0U) == run.channel
                              : ev.type != ClientEvent::kind::response && ev.channel == run.channel;
        if (!mine) {
            others.push_back(std::move(ev));
            return;
        }
        if (!run.exit.is_null()) {
            ++run.messages_after_exit;
            return;
        }
        if (ev.type == ClientEvent::kind::data && ev.channel == run.channel) {
            (ev.stream == stream_id::stderr_ ? run.err : run.out) += ev.bytes;
            send_credit(run.channel, ev.stream, static_cast<std::uint32_t>(ev.bytes.size()));
        } else if (ev.type == ClientEvent::kind::credit && ev.channel == run.channel) {
            unacked -= std::min<std::uint64_t>(unacked, ev.credit);
        } else if (ev.type == ClientEvent::kind::notification) {
            const auto& p = ev.message["params"];
            const auto method = ev.message.value("method", "");
            if (method == "duplexChannel.exit") {
                run.exit = p;
            } else if (method == "duplexChannel.data" && base64) {
                auto bytes = base64_decode(p["chunk"].get<std::string>());
                (p["stream"] == "stderr" ? run.err : run.out) += bytes;
                send_credit(run.channel,
                            p["stream"] == "stderr" ? stream_id::stderr_ : stream_id::stdout_,
                            static_cast<std::uint32_t>(bytes.size()));
            }
        }
    };
    // Events that arrived before the open's response.
    std::deque<ClientEvent> early;
    early.swap(impl_->pending);
    for (auto& ev : early) handle(ev);
    while (run.exit.is_null()) {
        while (sent < stdin_data.size() && unacked < window) {
            const std::size_t n =
                std::min<std::size_t>({stdin_data.size() - sent, 65536, window - unacked});
            send_stdin(run.channel, std::string_view(stdin_data).substr(sent, n));
            sent += n;
            unacked += n;
        }
        if (sent == stdin_data.size() && !closed) {
            closed = true;
            try {
                call("duplexChannelCloseStdin", {{"channel", run.channel}});
            } catch (const rpc_error& e) {
                // The command may have ended (and its exit be queued) before the half-close.
                const bool exit_queued = std::any_of(
                    impl_->pending.begin(), impl_->pending.end(), [&](const ClientEvent& q) {
                        return q.type == ClientEvent::kind::notification &&
                               q.message.value("method", "") == "duplexChannel.exit" &&
                               q.message["params"].value("channel", 0U) == run.channel;
                    });
                if (e.data().value("reason", "") != "CHANNEL_NOT_FOUND" || !exit_queued) throw;
            }
            std::deque<ClientEvent> got;
            got.swap(impl_->pending);
            for (auto& ev : got) handle(ev);
            continue;
        }
        auto ev = next_event();
        handle(ev);
    }
    for (auto& ev : others) impl_->pending.push_back(std::move(ev));
    return run;
}

void Client::close() {
    beast::error_code ec;
    try {
        impl_->run(
            [&](auto handler) { impl_->ws.async_close(websocket::close_code::normal, handler); });
    } catch (const client_error&) {
    }
}

}  // namespace sandboxd
