#include "server/audit.hpp"

#include <spdlog/spdlog.h>
#include <systemd/sd-journal.h>

#include <fcntl.h>
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <system_error>

namespace sandboxd {

namespace {

int open_append(const std::string& path) {
    return ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
}

}  // namespace

AuditLog::AuditLog(const std::string& path, bool journald, std::string node_id,
                   std::string instance_id)
    : path_(path),
      journald_(journald),
      node_id_(std::move(node_id)),
      instance_id_(std::move(instance_id)),
      fd_(path.empty() ? -1 : open_append(path)) {
    if (!path.empty() && fd_ < 0) {
        throw std::system_error(errno, std::generic_category(), "audit.file " + path);
    }
}

AuditLog::~AuditLog() {
    if (fd_ >= 0) ::close(fd_);
}

std::string AuditLog::reopen() {
    if (path_.empty()) return {};
    const int fd = open_append(path_);
    if (fd < 0) return "audit.file " + path_ + ": " + std::generic_category().message(errno);
    std::lock_guard lock(mutex_);
    ::close(fd_);
    fd_ = fd;
    return {};
}

std::string rfc3339_now() { return rfc3339_at(std::chrono::system_clock::now()); }

std::string rfc3339_at(std::chrono::system_clock::time_point now) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch());
    const std::time_t secs = static_cast<std::time_t>(ms.count() / 1000);
    std::tm tm{};
    ::gmtime_r(&secs, &tm);
    char buf[40];
    const std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
    char frac[8];
    std::snprintf(frac, sizeof frac, ".%03dZ", static_cast<int>(ms.count() % 1000));
    return std::string(buf, n) + frac;
}

void AuditLog::write(std::string_view event, nlohmann::json fields) noexcept {
    try {
        nlohmann::json line = {{"time", rfc3339_now()},
                               {"event", event},
                               {"node", node_id_},
                               {"instance", instance_id_}};
        for (auto& [key, value] : fields.items()) line[key] = std::move(value);
        std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        if (journald_) {
            const std::string event_field = "SANDBOXD_EVENT=" + std::string(event);
            sd_journal_send("MESSAGE=%s", text.c_str(), "SYSLOG_IDENTIFIER=sandboxd-audit",
                            "PRIORITY=6", event_field.c_str(), nullptr);
        }
        if (path_.empty()) return;
        text.push_back('\n');
        std::lock_guard lock(mutex_);
        const ssize_t n = ::write(fd_, text.data(), text.size());
        if (n == static_cast<ssize_t>(text.size())) return;
        const int err = n < 0 ? errno : ENOSPC;
        const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
        if (last_failure_log_ms_ == 0 || now - last_failure_log_ms_ >= 60000) {
            last_failure_log_ms_ = now;
            spdlog::error("audit.file {}: a line could not be written: {}", path_,
                          std::generic_category().message(err));
        }
    } catch (const std::exception& e) {
        spdlog::error("audit: {}", e.what());
    }
}

}  // namespace sandboxd
