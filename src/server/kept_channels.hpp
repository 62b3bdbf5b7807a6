#pragma once
// Detached channels that outlive their daemon process (issue 47; docs/protocol.md section 7,
// "Restart"). A detached channel opened in a sandbox whose provider outlives the daemon
// (Provider::outlives_daemon) is kept: its provider holds its ends for the next process
// (ExecSpec::keep_key = its handle), and its record goes beside its kept output, in
// <stateDir>/kept/<lease>/<handle>/:
//  - channel.json: what the next process needs to serve it again (kept_channel_record);
//  - exit.json: its exit, once it has ended (DetachedOutput::persist_exit);
//  - stdout, stderr: its kept output (KeptOutput; their sizes are the offsets).
// At start, after the re-adoption of the sandboxes, restore_kept_channels() serves each of
// them again: a running one from the backend its provider hands back (its command goes on;
// what it wrote meanwhile waited in its pipes and is kept now; a host reattaches from its
// offsets), an ended one from its exit, until its retainMs. Everything else under
// <stateDir>/kept is removed: a channel whose command did not outlive the last process (a
// provider that keeps nothing, or a lease that was not re-adopted) has nothing to resume.
//
// Threading: restore_kept_channels() runs on the node's io_context before the node serves
// (Daemon::start); it reads and removes files there (nothing else runs yet).
#include "server/channel.hpp"
#include "server/methods.hpp"

#include <sandboxd/core/async.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <string>

namespace sandboxd {

struct Node;

/// The record of kept detached channel `handle`, opened with `params` and `options`.
nlohmann::json kept_channel_record(const std::string& handle, const methods::OpenParams& params,
                                   const ChannelOptions& options);
/// Writes `record` to `dir`/channel.json, whole (a temporary file renamed), 0600. Throws
/// rpc_error(errc::provider_error) naming the file when it cannot.
void write_kept_record(const std::filesystem::path& dir, const nlohmann::json& record);

/// Serves again the kept detached channels of the sandboxes this process re-adopted, and
/// removes what is left under <stateDir>/kept. Returns how many channels it restored. Never
/// throws for one channel: a record that cannot be read is logged and removed, and its
/// command (if it runs) is ended.
awaitable<std::size_t> restore_kept_channels(Node& node);

}  // namespace sandboxd
