#pragma once
// The detached channels of this node (issue 46), by durable handle and by (lease, name): what
// duplexChannelAttach and duplexChannelList look up on the owner. An entry lives while its
// command runs and, once it has ended, for its retain_ms; then expire() hands it back for its
// kept output to be removed, and its name may be used again.
//
// Thread-safety: every member may be called from any thread (one mutex; no call waits on
// anything else under it). The Channel and DetachedOutput of an entry are used only on the
// entry's strand.
#include "server/channel.hpp"
#include "server/detached_output.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sandboxd {

class DetachedChannels {
public:
    struct Entry {
        std::string handle;    ///< "dch_" and 24 hex digits; made by add()
        std::string lease_id;  ///< the lease the channel runs in
        std::string name;      ///< "" when the open gave none
        std::string argv0;     ///< the command's program, for duplexChannelList
        bool pty = false;
        std::int64_t started_at_ms = 0;  ///< wall clock, ms since the epoch
        std::uint64_t retain_ms = 0;     ///< how long the exit is kept once it ends
        std::uint64_t kept_bytes = 0;    ///< its kept output's size (both streams), bytes
        /// Wall clock ms when its exit was kept (ended() was called); nullopt while it runs.
        std::optional<std::int64_t> ended_at_ms;
        std::optional<strand_t> strand;  ///< the channel's (set for a running channel)
        std::shared_ptr<Channel> channel;
        std::shared_ptr<DetachedOutput> output;
    };

    /// A new handle ("dch_" and 24 random hex digits), for add().
    static std::string make_handle();
    /// Registers `entry` under its handle (made here when empty), which it returns. Throws
    /// rpc_error(errc::invalid_params) with field "name" when the lease already has a
    /// detached channel of that name (running, or ended with its exit still kept), and
    /// rpc_error(errc::channel_limit) with limit "detachKeptBytesPerLease" when the lease's
    /// entries would keep more than `lease_budget` bytes with it.
    std::string add(Entry entry, std::uint64_t lease_budget = UINT64_MAX);
    /// Throws what add() would for an entry of `lease_id` named `name` ("": none) keeping
    /// `bytes`: for failing before any work (add() checks again).
    void check_new(const std::string& lease_id, const std::string& name, std::uint64_t bytes,
                   std::uint64_t lease_budget) const;
    /// The entry of `handle`, or null.
    std::shared_ptr<const Entry> find(const std::string& handle) const;
    /// The entry named `name` in `lease_id`, or null.
    std::shared_ptr<const Entry> find(const std::string& lease_id, const std::string& name) const;
    /// The lease's entries, oldest first.
    std::vector<std::shared_ptr<const Entry>> of_lease(const std::string& lease_id) const;
    /// The channel of `handle` ended at `at_ms` (wall clock): its exit is kept from now. When
    /// its lease then has more than `max_kept_exits` ended entries, the oldest added of them
    /// are removed (their names free again) and returned, for their kept output to go.
    std::vector<std::shared_ptr<const Entry>> ended(const std::string& handle, std::int64_t at_ms,
                                                    std::size_t max_kept_exits = SIZE_MAX);
    /// Removes and returns the entries whose exit has been kept for their retain_ms at
    /// `now_ms`, and those of `lease_id` when given (the lease ended: all of them, running or
    /// not). Their names are free again.
    std::vector<std::shared_ptr<const Entry>> expire(std::int64_t now_ms,
                                                     const std::string& lease_id = "");
    /// Removes every entry (the daemon's end: their channels, strands and timers go before
    /// the io_context they live on).
    void clear();
    /// Entries whose command runs (they count against limits.channelsPerNode).
    [[nodiscard]] std::size_t running() const;
    [[nodiscard]] std::size_t size() const;

private:
    /// Removes the entry at `it` from every index; returns the next.
    std::map<std::string, std::shared_ptr<Entry>>::iterator erase_locked(
        std::map<std::string, std::shared_ptr<Entry>>::iterator it);
    std::uint64_t kept_bytes_locked(const std::string& lease_id) const;
    void check_new_locked(const std::string& lease_id, const std::string& name, std::uint64_t bytes,
                          std::uint64_t lease_budget) const;

    mutable std::mutex mutex_;
    std::map<std::string, std::shared_ptr<Entry>> by_handle_;
    std::map<std::pair<std::string, std::string>, std::string> by_name_;  // (lease, name)
    std::uint64_t order_ = 0;
    std::map<std::string, std::uint64_t> added_order_;  // handle -> order of add()
};

}  // namespace sandboxd
