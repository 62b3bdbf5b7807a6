#pragma once
/// @file errors.hpp
/// Domain errors of sandboxd and their one-to-one mapping to the wire protocol's
/// JSON-RPC error objects (docs/protocol.md section 5).
///
/// Thread-safety: everything here is immutable or value-typed and safe from any thread.

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

namespace sandboxd {

/// One value per protocol error `reason`, plus the JSON-RPC 2.0 base errors.
enum class errc {
    parse_error = 1,       ///< -32700: the text frame is not JSON
    invalid_request,       ///< -32600: not a JSON-RPC 2.0 request object (batches included)
    method_not_found,      ///< -32601: unknown method
    invalid_params,        ///< -32602 INVALID_PARAMS
    internal_error,        ///< -32603: a bug; the message never carries internal detail
    lease_incomplete,      ///< -32010 LEASE_INCOMPLETE
    sandbox_not_cached,    ///< -32011 SANDBOX_NOT_CACHED
    lease_not_found,       ///< -32012 LEASE_NOT_FOUND
    lease_not_active,      ///< -32013 LEASE_NOT_ACTIVE
    owner_unavailable,     ///< -32014 OWNER_UNAVAILABLE
    owner_elsewhere,       ///< -32015 OWNER_ELSEWHERE
    channel_limit,         ///< -32016 CHANNEL_LIMIT
    provider_error,        ///< -32017 PROVIDER_ERROR
    provider_not_ready,    ///< -32018 PROVIDER_NOT_READY
    channel_not_found,     ///< -32019 CHANNEL_NOT_FOUND
    flow_control,          ///< -32020 FLOW_CONTROL
    registry_unavailable,  ///< -32021 REGISTRY_UNAVAILABLE
    routing_loop,          ///< -32022 ROUTING_LOOP
    forbidden,             ///< -32023 FORBIDDEN: a peer link calls what it may not
    channel_attached,      ///< -32024 CHANNEL_ATTACHED: a detached channel has a host attached
    // Keep channel_attached last, or move errc_of_reason's bound (jsonrpc.cpp) with it.
};

/// The category of sandboxd::errc (name "sandboxd"); message() gives the reason string.
const std::error_category& sandboxd_category() noexcept;
std::error_code make_error_code(errc e) noexcept;

/// JSON-RPC `code` of an error (protocol section 5), e.g. -32011 for sandbox_not_cached.
int rpc_code(errc e) noexcept;
/// Stable machine-read `data.reason`, e.g. "SANDBOX_NOT_CACHED"; "PARSE_ERROR" etc. for the
/// JSON-RPC base errors.
std::string_view reason(errc e) noexcept;

/// The fixed messages that protocol section 5 prescribes.
inline constexpr std::string_view lease_incomplete_message =
    "Sandbox duplex channel needs a plugin id, a provider key, and a provider lease id on the "
    "lease.";
inline constexpr std::string_view sandbox_not_cached_message =
    "Sandbox duplex channel: no cached sandbox resolves the provider lease.";
/// "Sandbox lease <id> is no longer active."
std::string lease_not_active_message(std::string_view lease_id);

/// An error that crosses the wire: a code, a human message and extra `data` fields (the
/// `reason` is added by to_json). Thrown by services, caught by the dispatcher.
class rpc_error : public std::runtime_error {
public:
    rpc_error(errc code, std::string message, nlohmann::json data = nlohmann::json::object());
    errc code() const noexcept { return code_; }
    const nlohmann::json& data() const noexcept { return data_; }
    /// `{code, message, data: {reason, ...data}}` as in protocol section 5.
    nlohmann::json to_json() const;

private:
    errc code_;
    nlohmann::json data_;
};

}  // namespace sandboxd

template <>
struct std::is_error_code_enum<sandboxd::errc> : std::true_type {};
