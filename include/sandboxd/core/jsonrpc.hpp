#pragma once
/// @file jsonrpc.hpp
/// JSON-RPC 2.0 as sandboxd speaks it (docs/protocol.md section 1): the envelopes of requests,
/// notifications, results and errors, and the classification of one received text message.
/// Every peer (host session, peer link, client) builds and reads its envelopes here, so the
/// wire shape is written once.
///
/// Ids: sandboxd's own callers use integer ids; a server echoes whatever valid id (string,
/// integer or null) it was given.
///
/// Thread-safety: pure functions of their arguments, safe from any thread; nothing blocks.
#include <sandboxd/core/errors.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace sandboxd::jsonrpc {

using json = nlohmann::json;

/// `{"jsonrpc":"2.0","id":id,"method":method,"params":params}`, serialized.
std::string request(const json& id, std::string_view method, json params);
/// request() with one member more at the top level, `name`: `value` (a plugin worker's
/// `paperclipInvocation`, docs/plugins.md).
std::string request(const json& id, std::string_view method, json params, std::string_view name,
                    json value);
/// A request a node forwards to the lease's owner for a host (docs/protocol.md section 6):
/// request() plus `"forwardedFor": forwarded_for`; a notification when `id` is null.
std::string forwarded_request(const json& id, std::string_view method, json params,
                              json forwarded_for);
/// `{"jsonrpc":"2.0","method":method,"params":params}`, serialized (no id: no answer).
std::string notification(std::string_view method, json params);
/// `{"jsonrpc":"2.0","id":id,"result":result}`, serialized.
std::string result(const json& id, json result);
/// `{"jsonrpc":"2.0","id":id,"error":error}`, serialized; `error` is an rpc_error::to_json().
/// Invalid UTF-8 inside (an error quoting bad input) is replaced by U+FFFD instead of throwing.
std::string error(const json& id, const json& error);

/// A request, or a notification when `id` is empty.
struct Request {
    std::optional<json> id;
    std::string method;
    json params;  ///< an object, an array or null (absent)
    /// The request's `forwardedFor` member as sent (any JSON; checked by the session).
    std::optional<json> forwarded_for;
};

/// A response to one of our requests: exactly one of result and error is set.
struct Response {
    json id;
    std::optional<json> result;
    std::optional<json> error;  ///< {code, message, data}
};

/// A text message a server cannot serve: the error to answer, and the id to answer it under
/// (null when the message had no usable id).
struct Invalid {
    json id;
    rpc_error error;
};

/// What a received JSON-RPC message is, by its members.
enum class message_kind : std::uint8_t { request, notification, response, invalid };

/// The rule for a message from a server (a peer link's, the client's; parse_message()): not an
/// object, or a non-string `method`: invalid; no `method`: a response when it has an `id`
/// (whatever else it holds), else invalid; a string `method`: a request when it has an `id`
/// (null too), else a notification.
message_kind classify(const json& message);

/// The strict rule, for a peer that must follow JSON-RPC 2.0 to the letter (a plugin worker's
/// line, docs/plugins.md): a response has no string `method`, an `id` and a `result` or an
/// `error`; a request has a string `method` and a non-null `id`; a notification has a string
/// `method` and no `id`; anything else (not an object too) is invalid.
message_kind classify_strict(const json& message);

/// Classifies a text message received by a server. Returns the Request, or Invalid with the
/// protocol's error: INVALID_REQUEST when the text is over `max_size` bytes, a batch, not an
/// object, or not a 2.0 request (string method, string/integer/null id, object or array
/// params); PARSE_ERROR when it is not JSON, or is nested deeper than max_json_depth
/// (json_limits.hpp; "Parse error: the text frame is nested deeper than 64 levels"). The
/// messages are part of the wire contract.
std::variant<Request, Invalid> parse_request(std::string_view text, std::size_t max_size);

/// Classifies a text message received by a client of a server (peer link, client): a
/// Response (has an id and no method), a Request or notification from the server, or
/// monostate when the text is not a JSON-RPC object (ignored by the callers), including a
/// text nested deeper than max_json_depth.
std::variant<std::monostate, Request, Response> parse_message(std::string_view text);

/// The errc whose protocol reason is `reason` ("CHANNEL_LIMIT" -> errc::channel_limit);
/// internal_error for an unknown reason.
errc errc_of_reason(std::string_view reason) noexcept;

/// The response's result (an empty object when it has none); its error rethrown as rpc_error
/// with the code of its data.reason, its message and its data.
json result_or_throw(Response response);

}  // namespace sandboxd::jsonrpc
