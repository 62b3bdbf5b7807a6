#pragma once
// Channels (docs/protocol.md section 3), beside the lease service: opening one (the
// fail-closed checks in their order, then a local channel on this node's sandbox or a relayed
// one at the lease's owner), and the handlers of the methods that name a channel of the
// connection (write, close stdin, resize, signal, stop, close). The connection keeps its
// channel table (ChannelMux); the node its channel table and limits.
//
// Threading: on the connection's strand.
#include "server/connection.hpp"
#include "server/methods.hpp"

#include <sandboxd/core/net.hpp>

namespace sandboxd::handlers {

/// duplexChannelOpen.
awaitable<MethodReply> channel_open(Connection& c, MethodCall& call, methods::OpenParams params);
awaitable<MethodReply> channel_write(Connection& c, MethodCall& call, methods::WriteParams params);
awaitable<MethodReply> channel_close_stdin(Connection& c, MethodCall& call,
                                           methods::ChannelParams params);
awaitable<MethodReply> channel_resize(Connection& c, MethodCall& call,
                                      methods::ResizeParams params);
awaitable<MethodReply> channel_signal(Connection& c, MethodCall& call,
                                      methods::SignalParams params);
awaitable<MethodReply> channel_stop(Connection& c, MethodCall& call, methods::ChannelParams params);
awaitable<MethodReply> channel_close(Connection& c, MethodCall& call,
                                     methods::ChannelParams params);

}  // namespace sandboxd::handlers
