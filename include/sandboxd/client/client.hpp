#pragma once
/// @file client.hpp
/// A blocking WebSocket client of the sandboxd protocol (docs/protocol.md), used by
/// `sandboxctl` and the integration tests. One thread at a time: a Client is not thread-safe.
///
/// Errors: connection and transport failures throw client_error (with the HTTP status for a
/// refused upgrade); a JSON-RPC error response throws rpc_error carrying the daemon's code,
/// message and data (reason included).

#include <sandboxd/core/frame.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd {

class client_error : public std::runtime_error {
public:
    explicit client_error(const std::string& what, int http_status = 0)
        : std::runtime_error(what), http_status_(http_status) {}
    /// The HTTP status of a refused upgrade (401 for a bad token), else 0.
    int http_status() const noexcept { return http_status_; }

private:
    int http_status_;
};

/// One message from the daemon.
struct ClientEvent {
    enum class kind { data, credit, notification, response } type = kind::notification;
    std::uint32_t channel = 0;
    stream_id stream = stream_id::stdout_;
    std::string bytes;  ///< data payload
    std::uint32_t credit = 0;
    nlohmann::json message;  ///< notification or response object
};

/// What a channel produced, for run_channel().
struct ChannelRun {
    std::uint32_t channel = 0;
    nlohmann::json open_result;
    std::string out, err;
    nlohmann::json exit;  ///< the duplexChannel.exit params
    std::size_t messages_after_exit = 0;
};

/// How a wss:// connection verifies the node (and, for mutual TLS, presents itself).
struct ClientTls {
    std::string ca_file;    ///< PEM CAs (sandboxctl --cacert); "" = the system's trust store
    std::string cert_file;  ///< PEM client certificate; "" = none
    std::string key_file;   ///< its key
    /// No verification of the node's certificate or name (sandboxctl
    /// --insecure-skip-tls-verify, which warns on every use).
    bool insecure_skip_verify = false;
};

class Client {
public:
    /// Connects to `url` (ws://host:port/path, or wss:// with TLS verified as `tls` says: the
    /// certificate must chain to a trusted CA and name the URL's host) with
    /// `Authorization: Bearer <token>`, offering the subprotocol sandboxd.v1. `timeout`
    /// bounds every later blocking call (and the connect, TLS and WebSocket handshakes).
    /// Throws client_error (a TLS failure says so, e.g. "TLS handshake failed: certificate
    /// verify failed"), config_error for unusable `tls` files.
    /// `receive_buffer` > 0 sets SO_RCVBUF (bytes) on the socket before it connects (a small
    /// TCP window, e.g. to model a slow link); 0 keeps the system's default.
    Client(const std::string& url, const std::string& token,
           std::chrono::milliseconds timeout = std::chrono::seconds(30), int receive_buffer = 0,
           const std::vector<std::pair<std::string, std::string>>& extra_headers = {},
           const ClientTls& tls = {});
    ~Client();
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;

    /// Sends a request and waits for its response; other messages that arrive meanwhile are
    /// kept for next_event(). Returns `result`; throws rpc_error for an `error` response.
    nlohmann::json call(const std::string& method, const nlohmann::json& params);
    /// Sends a request without waiting; returns its id.
    std::int64_t send_request(const std::string& method, const nlohmann::json& params);
    /// Waits for the response of `id` (throws rpc_error for an error response).
    nlohmann::json wait_response(std::int64_t id);

    /// The next message (queued first). Throws client_error on timeout or a closed connection.
    ClientEvent next_event();
    /// Like next_event() but returns nullopt when nothing arrives within `wait`.
    std::optional<ClientEvent> poll_event(std::chrono::milliseconds wait);
    /// Removes and returns the messages kept back so far (those that arrived while call() or
    /// run_channel() waited for something else), without reading the socket.
    std::deque<ClientEvent> take_queued();
    /// Puts `events` back at the front of the queue, in their order (after take_queued()).
    void requeue(std::deque<ClientEvent> events);

    void send_text(const std::string& text);
    void send_binary(const std::string& bytes);
    void send_stdin(std::uint32_t channel, std::string_view bytes);
    void send_credit(std::uint32_t channel, stream_id stream, std::uint32_t bytes);

    /// Opens a channel with `open_params`, writes `stdin_data` within the stdin window, then
    /// (if `close_stdin`) half-closes stdin, crediting output as it arrives, until the exit.
    /// Messages of other channels are kept back for next_event() / take_queued(). A
    /// CHANNEL_NOT_FOUND answer to the half-close is not an error once the channel's exit has
    /// arrived (the command ended first).
    ChannelRun run_channel(const nlohmann::json& open_params, const std::string& stdin_data = {},
                           bool close_stdin = true);

    /// Sends a close frame (1000) and waits for the daemon's close.
    void close();

    /// The raw parts, for callers that drive the stream with Asio themselves (sandboxctl exec).
    struct Impl;
    Impl& impl() noexcept { return *impl_; }

private:
    std::unique_ptr<Impl> impl_;
};

/// One message from the daemon as an event: a text frame is a response or a notification
/// (throws nlohmann::json::parse_error for malformed JSON); a binary frame is data or credit
/// (throws client_error for a malformed frame). Pure; thread-safe.
ClientEvent decode_event(bool text, std::string_view message);

}  // namespace sandboxd
