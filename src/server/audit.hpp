#pragma once
// The audit trail (config `audit`): one JSON object per security-relevant event, appended to
// `audit.file` (one line each) and/or sent to journald (`audit.journald`, identifier
// sandboxd-audit, the JSON as MESSAGE, the event as SANDBOXD_EVENT). Every line has `time`
// (RFC 3339, UTC, milliseconds), `event`, `node` and `instance` (this daemon process's random
// id: channel keys restart with it); docs/protocol.md section 7 lists the events and their
// fields. Never a token value, never payload bytes. The fault trials' checker (tests/fault/)
// reads the file.
//
// Thread-safety: every member is safe to call from any thread; a line is written with one
// write(2) on a descriptor opened with O_APPEND, so lines of one or several processes never
// interleave. May block: a write to the page cache (no fsync), or to journald's socket.
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace sandboxd {

class AuditLog {
public:
    /// Opens (creates with mode 0600) `path` for appending ("" = no file), and sends each line
    /// to journald too when `journald`. Throws std::system_error naming the file when it
    /// cannot be opened.
    AuditLog(const std::string& path, bool journald, std::string node_id, std::string instance_id);
    ~AuditLog();
    AuditLog(const AuditLog&) = delete;
    AuditLog& operator=(const AuditLog&) = delete;

    /// Appends `fields` with `time`, `event`, `node` and `instance` set. A failed write is
    /// logged (once per minute at most) and dropped: the audit never stops a channel.
    void write(std::string_view event, nlohmann::json fields) noexcept;

    /// Opens the file again by its path (SIGHUP, after a rotation moved it away): later lines
    /// go to the new file. When it cannot be opened, the old descriptor is kept and the
    /// reason is returned; "" on success or without a file.
    std::string reopen();

private:
    std::string path_;
    bool journald_;
    std::string node_id_;
    std::string instance_id_;
    std::mutex mutex_;  // guards the fields below
    int fd_ = -1;
    std::int64_t last_failure_log_ms_ = 0;
};

/// The current time as RFC 3339 in UTC with milliseconds ("2026-12-02T03:04:05.678Z").
std::string rfc3339_now();
/// `t` as RFC 3339 in UTC with milliseconds.
std::string rfc3339_at(std::chrono::system_clock::time_point t);

}  // namespace sandboxd
