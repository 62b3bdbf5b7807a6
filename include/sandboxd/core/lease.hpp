#pragma once
/// @file lease.hpp
/// The Lease record of docs/protocol.md section 2 and its JSON form.
///
/// Times are milliseconds since the Unix epoch (UTC) in memory and RFC 3339 strings with
/// millisecond precision and a `Z` suffix on the wire. Value types; no shared state.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace sandboxd {

/// `retained`: stopped but kept for a reuse (leaseRelease with disposition "retain"); no
/// node holds its sandbox, and a reuse acquire on any node resumes it.
enum class lease_status { active, released, expired, failed, pending_cleanup, retained };

/// "active", "released", "expired", "failed", "pending_cleanup", "retained".
std::string_view to_string(lease_status s) noexcept;
/// Inverse of to_string; std::nullopt for any other text.
std::optional<lease_status> parse_lease_status(std::string_view s) noexcept;

/// Milliseconds since the Unix epoch, from the system clock.
std::int64_t now_ms() noexcept;
/// `bytes` random bytes from getrandom(2) as 2*bytes lowercase hex digits: the random part of
/// lease ids, sandbox ids, node instance ids and generated tokens. Blocks only until the
/// kernel's entropy pool is initialised (once, at boot). Thread-safe.
std::string random_hex(std::size_t bytes);
/// RFC 3339 UTC with milliseconds, e.g. "2026-11-30T23:49:29.123Z".
std::string format_rfc3339(std::int64_t ms);

struct Lease {
    std::string id;
    std::string company_id;
    std::string environment_id;
    std::optional<std::string> run_id, issue_id, heartbeat_run_id, execution_workspace_id;
    std::optional<std::string> agent_id;
    lease_status status = lease_status::active;
    std::string provider;           ///< driver key, e.g. "bwrap"
    std::string provider_lease_id;  ///< the provider's own id of the sandbox
    std::string owner_node_id;
    /// Fencing token: grows on every owner or status change (+1 on SQLite; the revision of
    /// the changing write on etcd; see Registry::update_lease).
    std::int64_t epoch = 1;
    std::int64_t acquired_at_ms = 0;
    std::int64_t last_used_at_ms = 0;
    std::optional<std::int64_t> expires_at_ms;
    std::optional<std::int64_t> released_at_ms;
    std::optional<std::string> failure_reason;
    std::optional<std::string> cleanup_status;
    /// Trusted: always exactly the string members `pluginId` and `provider`, set by the
    /// daemon from the provider that made the sandbox.
    nlohmann::json metadata = nlohmann::json::object();
    /// Untrusted: what the provider returned about its sandbox (a plugin's `metadata` from
    /// environmentAcquireLease or environmentResumeLease), an object or null. Sent back to a
    /// plugin worker as `leaseMetadata` on every later call; never read by the daemon.
    nlohmann::json provider_metadata = nullptr;
    /// The host's own: leaseAcquire's `metadata` object, stored verbatim and returned; never
    /// merged into `metadata` or `provider_metadata`. null when the host gave none.
    nlohmann::json host_metadata = nullptr;
    /// What the lease's provider serves (Provider::capabilities() at acquire), a string
    /// array; null for leases made before the field existed.
    nlohmann::json capabilities = nullptr;
    /// leaseAcquire's leasePolicy: "ephemeral", "reuse_by_environment",
    /// "reuse_by_execution_workspace" or "retain_on_failure" (docs/protocol.md section 2).
    std::string lease_policy = "ephemeral";
    /// The limits the provider enforces on the sandbox ({memoryBytes, pids, cpuWeight,
    /// cpuQuotaPercent, diskBytes, openFiles}); null when it enforces none (plugin leases).
    /// Set at creation, never changed.
    nlohmann::json limits = nullptr;
    /// The lease's network policy ({mode, allow, deny}; issue 48) as the provider applies it;
    /// null for a provider without one (plugin leases). leaseUpdateNetwork changes it.
    nlohmann::json network = nullptr;
    /// Not stored: the sandbox's usage ({memoryBytes, pids, diskBytes, cpuMs}) as its owner
    /// measured it for this answer; null when not measured (plugins, an unavailable owner).
    nlohmann::json usage = nullptr;
    /// Not on the wire: the acquire's idempotency key and the provider config it was made with.
    std::optional<std::string> idempotency_key;
    nlohmann::json config = nlohmann::json::object();
    /// Not on the wire: teardown attempts spent by the sweeper.
    int cleanup_attempts = 0;

    /// True when status is active and expires_at (if any) is after `at_ms`.
    bool is_live(std::int64_t at_ms) const noexcept;
};

/// The wire form of protocol section 2 (camelCase, RFC 3339 times, nulls for absent
/// nullable fields; optional ids omitted when absent). Internal fields are not included.
nlohmann::json to_json(const Lease& lease);

}  // namespace sandboxd
