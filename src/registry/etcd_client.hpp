#pragma once
/// @file etcd_client.hpp
/// An asynchronous client of etcd's v3 JSON gateway (HTTP POST to /v3/...), for the etcd
/// registry. It speaks HTTP/1.1 with keep-alive through Beast on the executor it is given
/// (the daemon's io_context): no thread, no io_context and no blocking call of its own. It
/// fails over across endpoints, and handles the gateway's habits: keys and values in base64,
/// 64-bit integers as strings, default fields omitted, a streaming answer wrapped in
/// "result", and token auth (`Authorization: <token>`, no "Bearer", re-authenticating when
/// the token is refused).
///
/// Connections: a call takes an idle keep-alive connection to its endpoint or, when every one
/// is busy, opens another, so calls in flight never queue behind each other; at most
/// `max_idle_per_endpoint` idle connections are kept per endpoint afterwards. A watch has a
/// connection of its own for as long as it runs. A caller that needs traffic of its own kind
/// never to wait behind another's (the registry's membership lane) uses a second Client.
///
/// Every call is an awaitable that runs on a strand of the client's executor and resumes the
/// caller on its own executor. Each attempt on one endpoint (connect, write, read) takes at
/// most `timeout`; a failed attempt tries the next endpoint, starting from the one that last
/// answered. Cancelling the awaiting coroutine (e.g. `call || timer`) abandons the call; a
/// request already written may still take effect in etcd.
///
/// Thread-safety: any method may be awaited from several coroutines and threads at once. The
/// Client must outlive no io_context it runs on: destroy it before its executor's io_context
/// (calls still in flight keep what they use alive until they end).
///
/// Errors: a transport failure (refused, reset, timeout), an HTTP 5xx, or a malformed answer on
/// every endpoint throws rpc_error(errc::registry_unavailable, "registry: <op>: <detail>"). An
/// answer that is an etcd error (HTTP 4xx with a gRPC code, e.g. 5 NotFound for an unknown
/// lease) throws etcd::status_error, which the caller maps.

#include <sandboxd/core/async.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace boost::asio::ssl {
class context;
}  // namespace boost::asio::ssl

namespace sandboxd::etcd {

/// gRPC status codes the registry tells apart.
inline constexpr int code_invalid_argument = 3;
inline constexpr int code_not_found = 5;
inline constexpr int code_out_of_range = 11;  ///< e.g. "required revision has been compacted"
inline constexpr int code_unauthenticated = 16;

/// Idle keep-alive connections kept per endpoint (busy ones are not limited).
inline constexpr std::size_t max_idle_per_endpoint = 16;

/// etcd answered with an error status (not a transport failure).
class status_error : public std::runtime_error {
public:
    status_error(int code, int http_status, const std::string& message)
        : std::runtime_error(message), code_(code), http_status_(http_status) {}
    int code() const noexcept { return code_; }
    int http_status() const noexcept { return http_status_; }

private:
    int code_;
    int http_status_;
};

/// One key-value of a range answer, decoded.
struct KeyValue {
    std::string key;
    std::string value;
    std::int64_t create_revision = 0;
    std::int64_t mod_revision = 0;
    std::int64_t version = 0;
    std::int64_t lease = 0;  ///< 0 = no lease
};

struct RangeResult {
    std::vector<KeyValue> kvs;
    bool more = false;
    std::int64_t count = 0;
    std::int64_t revision = 0;  ///< the store revision of the answer (header.revision)
};

/// Every key of a prefix, read at one revision.
struct PrefixResult {
    std::vector<KeyValue> kvs;
    std::int64_t revision = 0;
};

/// One event of a watch message.
struct WatchEvent {
    bool deleted = false;  ///< DELETE; otherwise PUT (the gateway omits the default type)
    KeyValue kv;           ///< for a DELETE, only key and mod_revision are set
};

/// One message of a watch stream (/v3/watch).
struct WatchMessage {
    std::int64_t revision = 0;          ///< header.revision
    bool created = false;               ///< the answer to the create request
    bool canceled = false;              ///< the server ended the watch
    std::int64_t compact_revision = 0;  ///< > 0: the start revision was compacted
    std::string cancel_reason;
    std::vector<WatchEvent> events;
};

/// Builders of the JSON pieces of a txn (/v3/kv/txn), keys and values raw (encoded here).
nlohmann::json compare_create_revision(std::string_view key, std::int64_t revision);
nlohmann::json compare_mod_revision(std::string_view key, std::int64_t revision);
nlohmann::json request_put(std::string_view key, std::string_view value, std::int64_t lease = 0);
nlohmann::json request_range(std::string_view key);
nlohmann::json request_delete(std::string_view key);

/// The smallest key greater than every key starting with `prefix` (etcd's range_end for a
/// prefix scan); "\0" when there is none.
std::string prefix_end(std::string_view prefix);

/// Reads the int64 member `name` of `j`, a decimal string (or a number); 0 when absent.
/// Throws std::invalid_argument when it is present and malformed.
std::int64_t int64_field(const nlohmann::json& j, std::string_view name);

/// The JSON of an etcd gateway answer's body; of a streaming answer (newline-delimited JSON,
/// a lease keepalive), the first object. Throws nlohmann::json::exception when it is not JSON.
nlohmann::json parse_reply_body(const std::string& body);

/// Decodes one `kvs` element of a range answer.
KeyValue decode_kv(const nlohmann::json& kv);

/// The `kvs` of a `response_range` inside a txn's responses (an element of TxnResult
/// ::responses), decoded; empty when the range found nothing.
std::vector<KeyValue> txn_range_kvs(const nlohmann::json& response);

/// The TLS client context for https:// endpoints, asked for each new connection (null or
/// empty: the system's trust store, no client certificate).
using TlsSource = std::function<std::shared_ptr<boost::asio::ssl::context>()>;

class Client {
public:
    /// `endpoints` are "http://HOST:PORT" or "https://HOST:PORT" (a trailing "/" is
    /// allowed); throws std::invalid_argument for anything else or for none. No network I/O
    /// happens here. `timeout` bounds each attempt on one endpoint (TLS handshake included).
    Client(boost::asio::any_io_executor ex, std::vector<std::string> endpoints,
           std::string username, std::string password, std::chrono::milliseconds timeout,
           TlsSource tls = {});
    ~Client();
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;

    /// POSTs `body` to `path` (e.g. "/v3/kv/range") and returns the answer's JSON object (a
    /// streaming answer's "result" unwrapped). `op` names the registry operation in errors.
    awaitable<nlohmann::json> call(std::string op, std::string path, nlohmann::json body);

    /// /v3/kv/range of one key, or of [key, range_end) when range_end is not empty.
    /// `limit` 0 = no limit; `revision` 0 = the newest; `keys_only` leaves values empty.
    awaitable<RangeResult> range(std::string op, std::string key, std::string range_end = {},
                                 std::int64_t limit = 0, std::int64_t revision = 0,
                                 bool keys_only = false);
    /// The one key, or std::nullopt.
    awaitable<std::optional<KeyValue>> get(std::string op, std::string key);
    /// Every key starting with `prefix`, read in pages at one revision.
    awaitable<PrefixResult> get_prefix(std::string op, std::string prefix);

    struct TxnResult {
        bool succeeded = false;
        std::int64_t revision = 0;  ///< header.revision: of this txn's writes when it wrote
        nlohmann::json responses = nlohmann::json::array();
    };
    awaitable<TxnResult> txn(std::string op, nlohmann::json compare, nlohmann::json success,
                             nlohmann::json failure = nlohmann::json::array());

    /// /v3/lease/grant; returns the lease id. `ttl_s` in seconds.
    awaitable<std::int64_t> lease_grant(std::string op, std::int64_t ttl_s);
    /// /v3/lease/keepalive once; returns the remaining TTL in seconds, 0 when the lease has
    /// expired or never existed.
    awaitable<std::int64_t> lease_keepalive(std::string op, std::int64_t id);
    /// /v3/lease/revoke; an unknown (already expired) lease is not an error.
    awaitable<void> lease_revoke(std::string op, std::int64_t id);

    /// Watches every key starting with `prefix` from `start_revision` (0 = from now) on a
    /// connection of its own, calling `on_message` (on the awaiting coroutine's executor,
    /// one at a time) for each message of the stream, the create answer included. Returns
    /// when the server ends or cancels the stream (after passing the cancel message on) or
    /// the connection breaks; cancelling the awaiting coroutine (`watch || stop`) ends it
    /// too. Connecting and the answer's header each take at most the client's timeout; the
    /// stream itself has none. Throws rpc_error(errc::registry_unavailable) when no endpoint
    /// accepts the watch, and etcd::status_error when the stream carries an error.
    awaitable<void> watch(std::string op, std::string prefix, std::int64_t start_revision,
                          std::function<void(const WatchMessage&)> on_message);

    struct Impl;

private:
    std::shared_ptr<Impl> impl_;
};

}  // namespace sandboxd::etcd
