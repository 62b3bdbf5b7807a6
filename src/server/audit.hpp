#pragma once
// The audit trail (config `audit.file`): one JSON object per line, appended, for each channel
// opened and ended on this node. Every line has `time` (RFC 3339, UTC, milliseconds), `event`,
// `node` and `instance` (this daemon process's random id: channel keys restart with it); docs/protocol.md section 7 lists the events and their fields. The fault trials'
// checker (tests/fault/) reads it.
//
// Thread-safety: every member is safe to call from any thread; a line is written with one
// write(2) on a descriptor opened with O_APPEND, so lines of one or several processes never
// interleave. May block: a write to the page cache (no fsync).
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace sandboxd {

class AuditLog {
public:
    /// Opens (creates with mode 0600) `path` for appending. Throws std::system_error naming the
    /// file when it cannot be opened.
    AuditLog(const std::string& path, std::string node_id, std::string instance_id);
    ~AuditLog();
    AuditLog(const AuditLog&) = delete;
    AuditLog& operator=(const AuditLog&) = delete;

    /// Appends `fields` with `time`, `event`, `node` and `instance` set. A failed write is logged (once per
    /// minute at most) and dropped: the audit never stops a channel.
    void write(std::string_view event, nlohmann::json fields) noexcept;

private:
    std::string path_;
    std::string node_id_;
    std::string instance_id_;
    int fd_ = -1;
    std::mutex mutex_;  // guards the fields below
    std::int64_t last_failure_log_ms_ = 0;
};

/// The current time as RFC 3339 in UTC with milliseconds ("2026-12-02T03:04:05.678Z").
std::string rfc3339_now();
/// `t` as RFC 3339 in UTC with milliseconds.
std::string rfc3339_at(std::chrono::system_clock::time_point t);

}  // namespace sandboxd
