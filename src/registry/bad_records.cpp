#include "registry/bad_records.hpp"

#include <spdlog/spdlog.h>

namespace sandboxd {

unreadable_lease::unreadable_lease(std::string_view op, std::string lease_id, std::string detail,
                                   std::int64_t version)
    : rpc_error(
          errc::registry_unavailable,
          "registry: " + std::string(op) + ": the record of lease " + lease_id + " cannot be read",
          nlohmann::json{{"leaseId", lease_id}}),
      lease_id_(std::move(lease_id)),
      detail_(std::move(detail)),
      version_(version) {}

void BadRecordLog::note(std::string_view key, std::int64_t version, std::string_view why) {
    {
        std::lock_guard lock(mutex_);
        if (seen_.size() >= max_remembered) seen_.clear();
        if (!seen_.emplace(std::string(key), version).second) return;
    }
    spdlog::warn("registry: the record of {} (version {}) cannot be read, skipped: {}", key,
                 version, why);
    if (counter_ != nullptr) counter_->inc();
}

}  // namespace sandboxd
