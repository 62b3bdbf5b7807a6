#include <sandboxd/lease.hpp>

#include <chrono>
#include <cerrno>
#include <ctime>

#include <sys/random.h>

namespace sandboxd {

std::string_view to_string(lease_status s) noexcept {
    switch (s) {
        case lease_status::active: return "active";
        case lease_status::released: return "released";
        case lease_status::expired: return "expired";
        case lease_status::failed: return "failed";
        case lease_status::pending_cleanup: return "pending_cleanup";
    }
    return "failed";
}

std::optional<lease_status> parse_lease_status(std::string_view s) noexcept {
    for (auto st : {lease_status::active, lease_status::released, lease_status::expired,
                    lease_status::failed, lease_status::pending_cleanup}) {
        if (to_string(st) == s) return st;
    }
    return std::nullopt;
}

std::int64_t now_ms() noexcept {
    using namespace std::chrono;
    return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

std::string format_rfc3339(std::int64_t ms) {
    std::time_t secs = static_cast<std::time_t>(ms / 1000);
    auto millis = static_cast<int>(ms % 1000);
    if (millis < 0) {
        millis += 1000;
        --secs;
    }
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[80];
    std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, millis);
    return buf;
}

std::string random_hex(std::size_t bytes) {
    std::string raw(bytes, '\0');
    std::size_t done = 0;
    while (done < bytes) {
        auto n = ::getrandom(raw.data() + done, bytes - done, 0);
        if (n > 0) done += static_cast<std::size_t>(n);  // EINTR: try again
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    out.reserve(bytes * 2);
    for (char c : raw) {
        const auto b = static_cast<unsigned char>(c);
        out.push_back(digits[b >> 4]);
        out.push_back(digits[b & 0xf]);
    }
    return out;
}

bool Lease::is_live(std::int64_t at_ms) const noexcept {
    return status == lease_status::active && (!expires_at_ms || *expires_at_ms > at_ms);
}

nlohmann::json to_json(const Lease& l) {
    auto opt_time = [](const std::optional<std::int64_t>& t) -> nlohmann::json {
        return t ? nlohmann::json(format_rfc3339(*t)) : nlohmann::json(nullptr);
    };
    auto opt_str = [](const std::optional<std::string>& s) -> nlohmann::json {
        return s ? nlohmann::json(*s) : nlohmann::json(nullptr);
    };
    nlohmann::json j = {
        {"id", l.id},
        {"companyId", l.company_id},
        {"environmentId", l.environment_id},
        {"status", std::string(to_string(l.status))},
        {"provider", l.provider},
        {"providerLeaseId", l.provider_lease_id},
        {"ownerNodeId", l.owner_node_id},
        {"epoch", l.epoch},
        {"acquiredAt", format_rfc3339(l.acquired_at_ms)},
        {"lastUsedAt", format_rfc3339(l.last_used_at_ms)},
        {"expiresAt", opt_time(l.expires_at_ms)},
        {"releasedAt", opt_time(l.released_at_ms)},
        {"failureReason", opt_str(l.failure_reason)},
        {"cleanupStatus", opt_str(l.cleanup_status)},
        {"metadata", l.metadata},
        {"limits", l.limits},
        {"usage", l.usage},
    };
    if (l.run_id) j["runId"] = *l.run_id;
    if (l.issue_id) j["issueId"] = *l.issue_id;
    if (l.heartbeat_run_id) j["heartbeatRunId"] = *l.heartbeat_run_id;
    if (l.execution_workspace_id) j["executionWorkspaceId"] = *l.execution_workspace_id;
    return j;
}

}  // namespace sandboxd
