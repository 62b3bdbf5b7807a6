#pragma once
/// @file etcd_client.hpp
/// A small blocking client of etcd's v3 JSON gateway (HTTP POST to /v3/...), for the etcd
/// registry. It speaks HTTP/1.1 with keep-alive over a pool of Beast connections, fails over
/// across endpoints, and handles the gateway's habits: keys and values in base64, 64-bit
/// integers as strings, default fields omitted, and token auth (`Authorization: <token>`,
/// no "Bearer", re-authenticating when the token is refused).
///
/// Every call blocks the calling thread for at most `timeout` per endpoint tried.
/// Thread-safe: any method may be called from several threads at once.
///
/// Errors: a transport failure (refused, reset, timeout), an HTTP 5xx, or a malformed answer on
/// every endpoint throws rpc_error(errc::registry_unavailable, "registry: <op>: <detail>"). An
/// answer that is an etcd error (HTTP 4xx with a gRPC code, e.g. 5 NotFound for an unknown
/// lease) throws etcd::status_error, which the caller maps.

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd::etcd {

/// gRPC status codes the registry tells apart.
inline constexpr int code_invalid_argument = 3;
inline constexpr int code_not_found = 5;
inline constexpr int code_out_of_range = 11;  ///< e.g. "required revision has been compacted"
inline constexpr int code_unauthenticated = 16;

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

/// Stops a Client::watch() blocked in another thread. Thread-safe; stop() is idempotent and
/// also refuses watches started after it.
class WatchStop {
public:
    void stop();
    bool stopped() const;

private:
    friend class Client;
    /// Registers how to interrupt the running watch; false when already stopped.
    bool attach(std::function<void()> interrupt);
    void detach();
    mutable std::mutex mutex_;
    bool stopped_ = false;
    std::function<void()> interrupt_;
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

/// Decodes one `kvs` element of a range answer.
KeyValue decode_kv(const nlohmann::json& kv);

class Client {
public:
    /// `endpoints` are "http://HOST:PORT" (a trailing "/" is allowed); throws
    /// std::invalid_argument for anything else. No network I/O happens here.
    Client(std::vector<std::string> endpoints, std::string username, std::string password,
           std::chrono::milliseconds timeout);
    ~Client();
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;

    /// POSTs `body` to `path` (e.g. "/v3/kv/range") and returns the answer's JSON object (a
    /// streaming answer's "result" unwrapped). `op` names the registry operation in errors.
    nlohmann::json call(std::string_view op, std::string_view path, const nlohmann::json& body);

    /// /v3/kv/range of one key, or of [key, range_end) when range_end is not empty.
    /// `limit` 0 = no limit; `revision` 0 = the newest.
    RangeResult range(std::string_view op, std::string_view key, std::string_view range_end = {},
                      std::int64_t limit = 0, std::int64_t revision = 0);
    /// The one key, or std::nullopt.
    std::optional<KeyValue> get(std::string_view op, std::string_view key);
    /// Every key starting with `prefix`, read in pages at one revision (stored in
    /// `*revision` when not null).
    std::vector<KeyValue> get_prefix(std::string_view op, std::string_view prefix,
                                     std::int64_t* revision = nullptr);

    struct TxnResult {
        bool succeeded = false;
        std::int64_t revision = 0;  ///< header.revision: of this txn's writes when it wrote
        nlohmann::json responses = nlohmann::json::array();
    };
    TxnResult txn(std::string_view op, nlohmann::json compare, nlohmann::json success,
                  nlohmann::json failure = nlohmann::json::array());

    /// /v3/lease/grant; returns the lease id. `ttl_s` in seconds.
    std::int64_t lease_grant(std::string_view op, std::int64_t ttl_s);
    /// /v3/lease/keepalive once; returns the remaining TTL in seconds, 0 when the lease has
    /// expired or never existed.
    std::int64_t lease_keepalive(std::string_view op, std::int64_t id);
    /// /v3/lease/revoke; an unknown (already expired) lease is not an error.
    void lease_revoke(std::string_view op, std::int64_t id);

    /// Watches every key starting with `prefix` from `start_revision` (0 = from now) on a
    /// connection of its own, calling `on_message` (in this thread) for each message of the
    /// stream, the create answer included. Blocks until the stream ends: returns when the
    /// server ends or cancels it (after passing the cancel message on), when the connection
    /// breaks, or when `stop` is stopped. Connecting and the answer's header each take at
    /// most the client's timeout; the stream itself has none (stop() interrupts it).
    /// Throws rpc_error(errc::registry_unavailable) when no endpoint accepts the watch, and
    /// etcd::status_error when the stream carries an error.
    void watch(std::string_view op, std::string_view prefix, std::int64_t start_revision,
               WatchStop& stop, const std::function<void(const WatchMessage&)>& on_message);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace sandboxd::etcd
