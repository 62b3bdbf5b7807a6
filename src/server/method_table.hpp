#pragma once
// The JSON-RPC methods (docs/protocol.md sections 2-4) as one table: each method's name, the
// flags that tell the session how to admit, order, route and count it, and its handler, which
// parses its typed params (methods.hpp) once and calls the lease or channel service.
//
// To add a method: a params struct and parse function in methods.hpp, a handler in
// lease_methods.cpp or channel_service.cpp, and a row in method_table.cpp (in the order
// initialize lists them). No other code compares method names.
//
// Immutable; safe from any thread.
#include "server/connection.hpp"

#include <sandboxd/core/net.hpp>

#include <span>
#include <string_view>

namespace sandboxd {

/// What the session does with a method beyond calling its handler.
enum method_flag : unsigned {
    /// Refused while this node's membership is stale (self-fencing).
    fenced = 1U << 0,
    /// Names a channel ("channel"): relayed to its owner when the channel is relayed, and
    /// ordered with the channel's other requests and frames.
    on_channel = 1U << 1,
    /// A node forwards it to the lease's or channel's owner, so a peer link may call it (with
    /// forwardedFor); a peer calling any other method gets FORBIDDEN.
    forwarded = 1U << 2,
    /// Opens a channel: requests naming a channel id not seen yet wait for it; audited when
    /// refused; counted in sandboxd_channel_opens_total.
    opens_channel = 1U << 3,
    /// Counted in sandboxd_lease_operations_total.
    lease_operation = 1U << 4,
    /// Writes to the command: answered {} once the command is gone.
    moot_after_exit = 1U << 5,
    /// Ends the connection's channel (a relayed route is forgotten before the owner answers).
    ends_channel = 1U << 6,
};

using MethodHandler = awaitable<MethodReply> (*)(Connection& connection, MethodCall call);

struct MethodSpec {
    std::string_view name;
    unsigned flags;
    MethodHandler handler;
    [[nodiscard]] bool has(method_flag f) const noexcept { return (flags & f) != 0; }
};

/// Every method, in the order initialize's supportedMethods lists them.
std::span<const MethodSpec> method_table();
/// The method named `name`, or nullptr.
const MethodSpec* find_method(std::string_view name);

}  // namespace sandboxd
