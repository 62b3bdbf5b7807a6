#pragma once
// What a method handler (method_table.hpp) may use of the connection it was called on: the
// node, the connection's channels and strand, whom it acts for, and its send room. Session
// implements it; the handlers (lease_methods.cpp, channel_service.cpp) see only this.
//
// Threading: every call on the connection's strand.
#include "server/channel_mux.hpp"
#include "server/node.hpp"

#include <sandboxd/core/net.hpp>

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace sandboxd {

class ChannelSink;
class RelayTarget;

/// A method's answer: its result, and what must happen right after the result is queued
/// (a channel starts only then, so its first frames follow its open's result).
struct MethodReply {
    nlohmann::json result;
    std::function<void()> after;
};

/// One request as a handler sees it.
struct MethodCall {
    std::string_view method;  ///< its name, as the method table spells it (static storage)
    nlohmann::json params;    ///< an object
    nlohmann::json id;        ///< the JSON-RPC id; null for a notification
    /// Whom it acts for: this connection's token, or on a peer link the host that the
    /// forwarding node names in the request's forwardedFor (docs/protocol.md section 6).
    Principal caller;
};

class Connection {
public:
    virtual ~Connection() = default;
    virtual Node& node() = 0;
    /// The token the connection authenticated with.
    virtual const Principal& principal() const noexcept = 0;
    /// The connection's channels, local and relayed.
    virtual ChannelMux& mux() = 0;
    virtual const strand_t& strand() const noexcept = 0;
    /// The remote address, for logs.
    virtual const std::string& peer() const noexcept = 0;
    /// The node that forwarded this connection's requests (a peer link), else "".
    virtual const std::string& forwarded_by() const noexcept = 0;
    /// True once the connection is closing: nothing more will be read or answered.
    virtual bool closing() const noexcept = 0;
    /// Where a local channel sends its frames (held weakly by the channel).
    virtual std::weak_ptr<ChannelSink> channel_sink() = 0;
    /// Where a relayed channel's frames arrive.
    virtual std::weak_ptr<RelayTarget> relay_target() = 0;
    /// Completes once the connection has send room (at once when it has), or is closing.
    virtual awaitable<void> wait_send_room() = 0;
};

}  // namespace sandboxd
