#pragma once
// Lease and node records that a registry cannot decode (bad JSON, nested deeper than
// max_json_depth, wrong types, an unknown status): docs/protocol.md section 8, "Records that
// cannot be read". Private to the registry layer; both backends use it.
//
// A bad record is skipped wherever records are listed (leaseList, the sweeper's scans, the
// change feed, start-up indexing) and fails closed where one lease is asked for: its calls
// answer REGISTRY_UNAVAILABLE with data.leaseId. Each bad record is logged and counted once
// per version (etcd: its mod revision; SQLite: a hash of the bad column), not per read.
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/metrics.hpp>

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>

namespace sandboxd {

/// Thrown by a backend's lease decoder: rpc_error(registry_unavailable) whose message is
/// "registry: <op>: the record of lease <id> cannot be read" and whose data is {leaseId}.
/// `detail()` (why, for the log) and `version()` identify the bad record.
class unreadable_lease : public rpc_error {
public:
    unreadable_lease(std::string_view op, std::string lease_id, std::string detail,
                     std::int64_t version);
    const std::string& lease_id() const noexcept { return lease_id_; }
    const std::string& detail() const noexcept { return detail_; }
    std::int64_t version() const noexcept { return version_; }

private:
    std::string lease_id_;
    std::string detail_;
    std::int64_t version_;
};

/// Logs and counts each bad record once per version. Thread-safe (a mutex held only around
/// the set of records seen); never blocks beyond that; never throws but std::bad_alloc.
class BadRecordLog {
public:
    /// `counter` (sandboxd_registry_bad_records_total) may be null (tests, tools); it must
    /// outlive this log.
    explicit BadRecordLog(Counter* counter = nullptr) : counter_(counter) {}

    /// A bad record `key` ("lease <id>", "node <id>") at `version`: the first time, a warning
    /// naming the key and `why`, and the counter goes up by one.
    void note(std::string_view key, std::int64_t version, std::string_view why);
    void note(const unreadable_lease& e) { note("lease " + e.lease_id(), e.version(), e.detail()); }

private:
    /// At most this many (key, version) pairs are remembered; beyond it the set starts over
    /// (a store with that many bad records logs some twice rather than growing without end).
    static constexpr std::size_t max_remembered = 4096;
    Counter* counter_;
    std::mutex mutex_;
    std::set<std::pair<std::string, std::int64_t>> seen_;
};

}  // namespace sandboxd
