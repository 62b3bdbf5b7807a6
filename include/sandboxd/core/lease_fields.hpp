#pragma once
/// @file lease_fields.hpp
/// The one list of Lease fields. The wire JSON (to_json in lease.hpp), the SQLite schema and
/// row mapping (sqlite_registry.cpp) and the etcd record (etcd_registry.cpp) are all generated
/// from lease_fields: adding a field here adds it everywhere; a field's names, nullability
/// and SQL type cannot disagree between the places.
///
/// The C++ type of a member decides its storage: std::string and lease_status are TEXT NOT
/// NULL, std::optional<std::string> is TEXT, std::int64_t and int are INTEGER NOT NULL,
/// std::optional<std::int64_t> is INTEGER, nlohmann::json is TEXT NOT NULL holding the JSON
/// text (SQLite) or the JSON value itself (etcd). On the wire an absent optional is null,
/// or left out with omit_if_absent.
/// Constant data; thread-safe.

#include <sandboxd/core/lease.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace sandboxd {

/// A pointer to one Lease member, of one of the types a field may have.
using LeaseMember =
    std::variant<std::string Lease::*, std::optional<std::string> Lease::*, lease_status Lease::*,
                 std::int64_t Lease::*, std::optional<std::int64_t> Lease::*, int Lease::*,
                 nlohmann::json Lease::*>;

namespace lease_field_flags {
inline constexpr unsigned none = 0;
/// On the wire: an RFC 3339 string (format_rfc3339) rather than the integer milliseconds.
inline constexpr unsigned wire_time = 1U << 0;
/// On the wire: left out when absent, rather than null (the optional ids).
inline constexpr unsigned omit_if_absent = 1U << 1;
/// Changed by Registry::update_lease (the SQLite UPDATE sets exactly these columns).
inline constexpr unsigned updatable = 1U << 2;
/// Records written before the field existed lack it: an absent etcd key reads as null (the
/// SQLite column has a DEFAULT for the same reason).
inline constexpr unsigned added_later = 1U << 3;
}  // namespace lease_field_flags

struct LeaseField {
    std::string_view wire;    ///< camelCase name in protocol section 2; "" when not on the wire
    std::string_view column;  ///< SQLite column and etcd record key; "" when not stored
    LeaseMember member;
    unsigned flags = lease_field_flags::none;
    /// SQL after the column's type and NOT NULL in CREATE TABLE (PRIMARY KEY, DEFAULT).
    std::string_view sql_extra = {};

    constexpr bool on_wire() const noexcept { return !wire.empty(); }
    constexpr bool stored() const noexcept { return !column.empty(); }
    constexpr bool has(unsigned flag) const noexcept { return (flags & flag) != 0; }
};

// In the SQLite column order of schema version 2 (new columns go last, and only with a
// DEFAULT, so that ALTER TABLE ... ADD COLUMN can upgrade an existing database).
inline constexpr std::array<LeaseField, 30> lease_fields = {{
    {"id", "id", &Lease::id, lease_field_flags::none, "PRIMARY KEY"},
    {"companyId", "company_id", &Lease::company_id},
    {"environmentId", "environment_id", &Lease::environment_id},
    {"runId", "run_id", &Lease::run_id, lease_field_flags::omit_if_absent},
    {"issueId", "issue_id", &Lease::issue_id, lease_field_flags::omit_if_absent},
    {"heartbeatRunId", "heartbeat_run_id", &Lease::heartbeat_run_id,
     lease_field_flags::omit_if_absent},
    {"executionWorkspaceId", "execution_workspace_id", &Lease::execution_workspace_id,
     lease_field_flags::omit_if_absent},
    {"status", "status", &Lease::status, lease_field_flags::updatable},
    {"provider", "provider", &Lease::provider},
    {"providerLeaseId", "provider_lease_id", &Lease::provider_lease_id},
    {"ownerNodeId", "owner_node_id", &Lease::owner_node_id, lease_field_flags::updatable},
    {"epoch", "epoch", &Lease::epoch, lease_field_flags::updatable},
    {"acquiredAt", "acquired_at_ms", &Lease::acquired_at_ms, lease_field_flags::wire_time},
    {"lastUsedAt", "last_used_at_ms", &Lease::last_used_at_ms,
     lease_field_flags::wire_time | lease_field_flags::updatable},
    {"expiresAt", "expires_at_ms", &Lease::expires_at_ms,
     lease_field_flags::wire_time | lease_field_flags::updatable},
    {"releasedAt", "released_at_ms", &Lease::released_at_ms,
     lease_field_flags::wire_time | lease_field_flags::updatable},
    {"failureReason", "failure_reason", &Lease::failure_reason, lease_field_flags::updatable},
    {"cleanupStatus", "cleanup_status", &Lease::cleanup_status, lease_field_flags::updatable},
    {"metadata", "metadata", &Lease::metadata, lease_field_flags::updatable},
    {"", "idempotency_key", &Lease::idempotency_key},
    {"", "config", &Lease::config},
    {"", "cleanup_attempts", &Lease::cleanup_attempts, lease_field_flags::updatable, "DEFAULT 0"},
    {"limits", "limits", &Lease::limits, lease_field_flags::added_later, "DEFAULT 'null'"},
    {"usage", "", &Lease::usage},
    // Schema version 4 (issue 13).
    {"agentId", "agent_id", &Lease::agent_id,
     lease_field_flags::omit_if_absent | lease_field_flags::added_later},
    {"providerMetadata", "provider_metadata", &Lease::provider_metadata,
     lease_field_flags::updatable | lease_field_flags::added_later, "DEFAULT 'null'"},
    // Schema version 5 (issue 14).
    {"hostMetadata", "host_metadata", &Lease::host_metadata, lease_field_flags::added_later,
     "DEFAULT 'null'"},
    {"capabilities", "capabilities", &Lease::capabilities, lease_field_flags::added_later,
     "DEFAULT 'null'"},
    // Schema version 6 (issue 14).
    {"leasePolicy", "lease_policy", &Lease::lease_policy, lease_field_flags::added_later,
     "DEFAULT 'ephemeral'"},
    // Schema version 8 (issue 48).
    {"network", "network", &Lease::network,
     lease_field_flags::updatable | lease_field_flags::added_later, "DEFAULT 'null'"},
}};

/// The stored fields' columns in table order, comma-separated: "id, company_id, ..., limits".
const std::string& lease_column_list();

/// The column definitions of CREATE TABLE leases, one per stored field in table order, e.g.
/// "id TEXT NOT NULL PRIMARY KEY", "run_id TEXT", "limits TEXT NOT NULL DEFAULT 'null'",
/// joined with ",\n    ".
const std::string& lease_column_definitions();

}  // namespace sandboxd
