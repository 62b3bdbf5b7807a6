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

#include <filesystem>
#include <string>

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

// --- detached channels (issue 46; detached_service.cpp) ---
/// duplexChannelAttach: on the owner, attaches this connection to a detached channel of the
/// lease; on another node, forwarded to the owner like an open.
awaitable<MethodReply> channel_attach(Connection& c, MethodCall& call,
                                      methods::AttachParams params);
/// duplexChannelList: the lease's detached channels, running and recently ended (the owner
/// answers).
awaitable<MethodReply> channel_list(Connection& c, MethodCall& call, methods::LeaseIdParams params);

/// Step 5 of an open (and an attach): `method` with params `p` goes to the lease's owner over
/// a peer link, and the channel is relayed (its frames, gaps and exit come back under a new
/// id of this connection). ROUTING_LOOP when this request was itself forwarded.
awaitable<MethodReply> open_relayed(Connection& c, nlohmann::json p, Lease lease, Principal caller,
                                    std::string method);

}  // namespace sandboxd::handlers

namespace sandboxd {

/// The detached channel `handle` ended (at wall clock `ended_at_ms`; 0: now): its entry and
/// kept output go once its retain_ms has passed since (a timer on the node's io_context).
/// Thread-safe.
void detached_channel_ended(Node& node, const std::string& handle, std::uint64_t retain_ms,
                            std::int64_t ended_at_ms = 0);
/// Counts the started detached channel `handle` of `lease_id` as running on this node
/// (ChannelTable, in a slot reserved before) until its command is reaped, then keeps its exit
/// for `retain_ms` (detached_channel_ended); `kept`: its provider keeps it across a restart
/// (ChannelTable::Entry::kept). Returns its node-wide key, which it also gives the
/// channel for its audit lines. Before the channel starts.
std::uint64_t track_detached(Node& node, const std::shared_ptr<Channel>& channel,
                             const strand_t& strand, const std::string& lease_id,
                             const std::string& handle, std::uint64_t retain_ms, bool kept);
/// The lease `lease_id` ended: its detached channels' entries and kept output go now (their
/// commands were ended with the lease's channels). Thread-safe; removes files (blocks briefly).
void forget_detached_channels(Node& node, const std::string& lease_id);
/// Where this node keeps detached channels' output: <stateDir>/kept.
std::filesystem::path kept_output_root(const Node& node);

}  // namespace sandboxd
