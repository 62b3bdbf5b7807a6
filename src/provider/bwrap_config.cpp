/// @file bwrap_config.cpp
#include "provider/bwrap_config.hpp"

#include <sandboxd/core/errors.hpp>

#include "provider/lease_disk.hpp"

#include <unistd.h>

#include <algorithm>
#include <string>

namespace sandboxd::detail {
namespace {

using json = nlohmann::json;

[[noreturn]] void invalid_field(const std::string& field, const std::string& why) {
    throw rpc_error(errc::invalid_params, field + ": " + why, {{"field", field}});
}

struct LimitField {
    const char* name;
    std::uint64_t min;
    std::uint64_t max;
};
constexpr LimitField memory_field{"memoryBytes", 16ULL << 20, 1ULL << 50};
constexpr LimitField pids_field{"pids", 8, 4194304};
constexpr LimitField cpu_weight_field{"cpuWeight", 1, 10000};
constexpr LimitField cpu_quota_field{"cpuQuotaPercent", 1, 100000};
constexpr LimitField disk_field{"diskBytes", detail::min_disk_bytes, detail::max_disk_bytes};
constexpr LimitField open_files_field{"openFiles", 16, 1048576};
constexpr LimitField io_read_bps_field{"ioReadBps", 65536, 1ULL << 40};
constexpr LimitField io_write_bps_field{"ioWriteBps", 65536, 1ULL << 40};
constexpr LimitField io_read_iops_field{"ioReadIops", 16, 10000000};
constexpr LimitField io_write_iops_field{"ioWriteIops", 16, 10000000};
constexpr LimitField io_weight_field{"ioWeight", 1, 10000};
constexpr LimitField egress_bps_field{"egressBps", 65536, 2147483647};

template <class T>
std::uint64_t limit_value(const json& value, const LimitField& field,
                          const std::optional<T>& node_max) {
    const std::string path = std::string("config.limits.") + field.name;
    if (!value.is_number_unsigned() &&
        !(value.is_number_integer() && value.get<std::int64_t>() >= 0)) {
        invalid_field(path, "must be an integer in " + std::to_string(field.min) + ".." +
                                std::to_string(field.max));
    }
    const auto v = value.get<std::uint64_t>();
    if (v < field.min || v > field.max) {
        invalid_field(path, "must be an integer in " + std::to_string(field.min) + ".." +
                                std::to_string(field.max));
    }
    if (node_max && v > static_cast<std::uint64_t>(*node_max)) {
        invalid_field(path, std::to_string(v) + " is above this node's maximum of " +
                                std::to_string(*node_max));
    }
    return v;
}

/// An optional limit: null clears it (no limit), unless the node has a maximum for it.
template <class T>
void optional_limit(const json& value, const LimitField& field, const std::optional<T>& node_max,
                    std::optional<T>& out) {
    if (value.is_null()) {
        if (node_max) {
            invalid_field(std::string("config.limits.") + field.name,
                          "must be set on this node (at most " + std::to_string(*node_max) + ")");
        }
        out.reset();
        return;
    }
    out = static_cast<T>(limit_value(value, field, node_max));
}

void parse_limits(const json& limits, const BwrapLimitsConfig& node, EffectiveLimits& out) {
    if (!limits.is_object()) invalid_field("config.limits", "must be an object");
    const auto& max = node.max;
    for (const auto& [name, value] : limits.items()) {
        if (name == memory_field.name) {
            out.memory_bytes = limit_value(value, memory_field, max.memory_bytes);
        } else if (name == pids_field.name) {
            out.pids = static_cast<std::uint32_t>(limit_value(value, pids_field, max.pids));
        } else if (name == cpu_weight_field.name) {
            out.cpu_weight =
                static_cast<std::uint32_t>(limit_value(value, cpu_weight_field, max.cpu_weight));
        } else if (name == cpu_quota_field.name) {
            if (value.is_null()) {
                if (max.cpu_quota_percent) {
                    invalid_field("config.limits.cpuQuotaPercent",
                                  "must be set on this node (at most " +
                                      std::to_string(*max.cpu_quota_percent) + ")");
                }
                out.cpu_quota_percent.reset();
            } else {
                out.cpu_quota_percent = static_cast<std::uint32_t>(
                    limit_value(value, cpu_quota_field, max.cpu_quota_percent));
                const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
                if (cores > 0 && *out.cpu_quota_percent > 100 * cores) {
                    invalid_field("config.limits.cpuQuotaPercent",
                                  std::to_string(*out.cpu_quota_percent) +
                                      " is more than this node's " + std::to_string(cores) +
                                      " cores (at most " + std::to_string(100 * cores) + ")");
                }
            }
        } else if (name == disk_field.name) {
            out.disk_bytes = limit_value(value, disk_field, max.disk_bytes);
        } else if (name == open_files_field.name) {
            out.open_files =
                static_cast<std::uint32_t>(limit_value(value, open_files_field, max.open_files));
        } else if (name == io_read_bps_field.name) {
            optional_limit(value, io_read_bps_field, max.io_read_bps, out.io_read_bps);
        } else if (name == io_write_bps_field.name) {
            optional_limit(value, io_write_bps_field, max.io_write_bps, out.io_write_bps);
        } else if (name == io_read_iops_field.name) {
            optional_limit(value, io_read_iops_field, max.io_read_iops, out.io_read_iops);
        } else if (name == io_write_iops_field.name) {
            optional_limit(value, io_write_iops_field, max.io_write_iops, out.io_write_iops);
        } else if (name == io_weight_field.name) {
            optional_limit(value, io_weight_field, max.io_weight, out.io_weight);
        } else if (name == egress_bps_field.name) {
            optional_limit(value, egress_bps_field, max.egress_bps, out.egress_bps);
        } else {
            invalid_field("config.limits." + name, "unknown key");
        }
    }
}

}  // namespace

std::uint64_t EffectiveLimits::open_files_total() const noexcept {
    return std::min(std::uint64_t{open_files} * pids, memory_bytes / 512);
}

json EffectiveLimits::to_json() const {
    auto v = [](const auto& opt) { return opt ? json(*opt) : json(nullptr); };
    return {{"memoryBytes", memory_bytes},
            {"pids", pids},
            {"cpuWeight", cpu_weight},
            {"cpuQuotaPercent", cpu_quota_percent ? json(*cpu_quota_percent) : json(nullptr)},
            {"diskBytes", disk_bytes},
            {"openFiles", open_files},
            {"openFilesTotal", open_files_total()},
            {"ioReadBps", v(io_read_bps)},
            {"ioWriteBps", v(io_write_bps)},
            {"ioReadIops", v(io_read_iops)},
            {"ioWriteIops", v(io_write_iops)},
            {"ioWeight", v(io_weight)},
            {"egressBps", v(egress_bps)}};
}

LeaseConfig parse_lease_config(const json& config, const BwrapLimitsConfig& node,
                               const NetworkDefaults& network) {
    LeaseConfig out;
    const auto& defaults = node.defaults;
    out.limits.memory_bytes = defaults.memory_bytes.value_or(1ULL << 30);
    out.limits.pids = defaults.pids.value_or(512);
    out.limits.cpu_weight = defaults.cpu_weight.value_or(100);
    out.limits.cpu_quota_percent = defaults.cpu_quota_percent;
    out.limits.disk_bytes = defaults.disk_bytes.value_or(1ULL << 30);
    out.limits.open_files = defaults.open_files.value_or(512);
    out.limits.io_read_bps = defaults.io_read_bps;
    out.limits.io_write_bps = defaults.io_write_bps;
    out.limits.io_read_iops = defaults.io_read_iops;
    out.limits.io_write_iops = defaults.io_write_iops;
    out.limits.io_weight = defaults.io_weight;
    out.limits.egress_bps = defaults.egress_bps;
    if (config.is_null()) return out;
    if (!config.is_object()) invalid_field("config", "must be an object");
    for (const auto& [name, value] : config.items()) {
        if (name == "network") {
            out.network = value.is_boolean() && value.get<bool>()
                              ? network.egress_default
                              : parse_network_policy(value, "config.network");
            if (out.network.mode == network_mode::egress && !network.egress) {
                invalid_field("config.network",
                              "egress is not allowed on this node "
                              "(providers.bwrap.network.egress is false)");
            }
        } else if (name == "limits") {
            parse_limits(value, node, out.limits);
        } else {
            invalid_field("config." + name, "unknown key");
        }
    }
    return out;
}

}  // namespace sandboxd::detail
