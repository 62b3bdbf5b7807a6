#pragma once
// The typed params of the host methods (docs/protocol.md sections 2 and 4): one struct per
// method and one parse function per struct. A parse function reads everything the method
// needs from its JSON params exactly once and checks it, in the order the protocol's errors
// are reported; every failure is rpc_error(errc::invalid_params) whose message and
// data.field name the field ("command[0]: must not be empty", field "command[0]").
//
// Pure functions of their arguments: no I/O, safe from any thread.
#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/provider.hpp>
#include <sandboxd/registry/registry.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace sandboxd::methods {

using json = nlohmann::json;

/// `params` of any method: absent (null) is {}; an array or another non-object is
/// INVALID_PARAMS on field "params".
json params_object(const json& raw);

struct InitializeParams {
    std::uint32_t protocol_version = 1;  ///< only 1 is accepted
};
InitializeParams parse_initialize(const json& p);

/// leaseAcquire. Strings are 1..1024 bytes.
struct LeaseAcquireParams {
    std::string company_id;
    std::string environment_id;
    std::string provider;
    json config;                          ///< an object, or null when absent
    std::optional<std::uint64_t> ttl_ms;  ///< ms, 1000..max_ttl_ms; none: limits.defaultTtlMs
    std::optional<std::string> run_id;
    std::optional<std::string> issue_id;
    std::optional<std::string> heartbeat_run_id;
    std::optional<std::string> execution_workspace_id;
    std::optional<std::string> agent_id;
    std::optional<std::string> idempotency_key;
    json host_metadata;  ///< `metadata`: an object of at most 64 KiB as JSON, or null
    /// "ephemeral" (default), "reuse_by_environment", "reuse_by_execution_workspace" (which
    /// requires executionWorkspaceId) or "retain_on_failure".
    std::string lease_policy = "ephemeral";
};
/// `max_ttl_ms` is the node's limits.maxTtlMs.
LeaseAcquireParams parse_lease_acquire(const json& p, std::uint64_t max_ttl_ms);

/// leaseList: the query without `tenants` (the caller's token adds them). `status` is one of
/// the lease statuses, `limit` 1..1000 (default 100).
LeaseQuery parse_lease_list(const json& p);

/// leaseGet and leaseRelease.
struct LeaseIdParams {
    std::string lease_id;  ///< 1..1024 bytes
};
LeaseIdParams parse_lease_id(const json& p);

/// leaseRelease: `disposition` "destroy" or "retain" (absent: the lease policy's default),
/// `failed` (absent: false).
struct LeaseReleaseParams {
    std::string lease_id;  ///< 1..1024 bytes
    std::optional<std::string> disposition;
    bool failed = false;
};
LeaseReleaseParams parse_lease_release(const json& p);

/// providerValidateConfig: `provider` 1..1024 bytes, `config` an object (absent: {}).
struct ValidateConfigParams {
    std::string provider;
    json config = json::object();
};
ValidateConfigParams parse_validate_config(const json& p);

/// leaseExecute: `leaseId` plus the SDK's environmentExecute fields (docs/protocol.md
/// section 2): command 1..4096 bytes, args (at most 4096, each at most 128 KiB), cwd, env
/// (names without '=' or NUL), stdin (a string, at most limits.maxTextMessage), timeoutMs
/// 1..86400000, bypassSession; no NUL bytes in any string.
struct ExecuteParams {
    std::string lease_id;
    ExecuteRequest request;  ///< params (as checked, timeoutMs filled in) and the spec fields
};
/// `default_timeout_ms` fills a missing timeoutMs.
ExecuteParams parse_execute(const json& p, std::uint64_t default_timeout_ms);

/// leaseRealizeWorkspace: `leaseId` and the SDK's `workspace` {remotePath?, mode?,
/// metadata?}. `localPath` is refused: it names a file of the node (see docs/protocol.md).
struct RealizeWorkspaceParams {
    std::string lease_id;
    json workspace = json::object();
};
RealizeWorkspaceParams parse_realize_workspace(const json& p);

struct LeaseRenewParams {
    std::string lease_id;      ///< 1..1024 bytes
    std::uint64_t ttl_ms = 0;  ///< ms, 1000..2^62-1 (the node's maxTtlMs is checked later)
};
LeaseRenewParams parse_lease_renew(const json& p);

/// leaseUpdateNetwork: the lease and its new policy (a boolean or an object; the provider
/// checks the policy itself).
struct LeaseUpdateNetworkParams {
    std::string lease_id;  ///< 1..1024 bytes
    json network;
};
LeaseUpdateNetworkParams parse_lease_update_network(const json& p);

/// The channel id every duplexChannel* method but the open names; the id of a channel of
/// this connection when `p` names one (an unsigned integer "channel"), else none. Used
/// before parsing, to order a connection's requests and frames per channel.
std::optional<std::uint32_t> channel_named(const json& p);

/// duplexChannelCloseStdin, duplexChannelStop, duplexChannelClose.
struct ChannelParams {
    std::uint32_t channel = 0;
};
ChannelParams parse_channel(const json& p);

struct WriteParams {
    std::uint32_t channel = 0;
    std::string data;  ///< decoded from the base64 "data"
};
WriteParams parse_write(const json& p);

struct ResizeParams {
    std::uint32_t channel = 0;
    std::uint16_t cols = 0;  ///< 1..4096
    std::uint16_t rows = 0;  ///< 1..4096
};
ResizeParams parse_resize(const json& p);

struct SignalParams {
    std::uint32_t channel = 0;
    int signal = 0;  ///< one of SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGKILL, SIGUSR1/2, SIGWINCH
};
SignalParams parse_signal(const json& p);

/// The lease an open names (docs/protocol.md section 3, steps 2-4), as the host holds it.
struct LeaseRef {
    std::string plugin_id;          ///< metadata.pluginId
    std::string provider;           ///< metadata.provider
    std::string provider_lease_id;  ///< providerLeaseId
    std::string company_id;
    std::string environment_id;
    std::optional<std::string> id;  ///< the lease id; none: found by (provider, providerLeaseId)
    std::optional<std::uint64_t> epoch;  ///< the epoch the caller holds; none: any
    /// What is wrong with the reference (LEASE_INCOMPLETE, or INVALID_PARAMS naming a lease
    /// field), kept to be thrown at step 2 by resolve_lease: the protocol reports it after the
    /// open's other params and after a draining node's refusal. Null when it is whole.
    std::exception_ptr problem;
};
/// `lease` as a reference; never throws (see LeaseRef::problem).
LeaseRef parse_lease_ref(const json& lease);

struct OpenParams {
    std::string host_route_id;
    LeaseRef lease;  ///< read once here; checked against the registry by resolve_lease
    ExecSpec spec;   ///< argv, cwd, env, pty, stdin (drain_grace_ms left for the node to set)
    std::optional<std::chrono::milliseconds> timeout;  ///< 1 ms .. 30 days
    std::optional<std::uint32_t>
        output_window;  ///< bytes, 1 KiB .. max_output_window; none = the node's
    std::optional<std::uint32_t>
        stdin_window;     ///< bytes, 1 KiB .. max_stdin_window; none = the node's
    bool base64 = false;  ///< dataEncoding "base64"
    /// `detach` (issue 46): the channel outlives its connection; its exit is kept for
    /// retain_ms after it ends and the last retain_bytes of each output stream are kept.
    struct Detach {
        std::uint64_t retain_ms = 0;
        std::uint64_t retain_bytes = 0;
        /// hangupAfterMs, 1000 .. 30 days: the command is hung up (SIGHUP, then SIGKILL after
        /// the hangup grace) once no host has been attached for this long; none = never.
        std::optional<std::chrono::milliseconds> hangup_after;
    };
    std::optional<Detach> detach;
    /// `name` (only with detach): 1..128 of [A-Za-z0-9._-], unique among the lease's detached
    /// channels (checked by the node, not here); "" when none.
    std::string name;
};
/// The node's bounds for `detach` (limits.detachRetainMs, maxDetachRetainMs,
/// detachRetainBytes, maxDetachRetainBytes).
struct DetachLimits {
    std::uint64_t retain_ms = 600000;
    std::uint64_t max_retain_ms = 86400000;
    std::uint64_t retain_bytes = 8ULL << 20;
    std::uint64_t max_retain_bytes = 256ULL << 20;
};
/// `max_output_window` and `max_stdin_window`: the largest windows an open may ask for
/// (limits.maxOutputWindow, limits.maxStdinWindow), bytes. INVALID_PARAMS naming the field:
/// `detach` not an object or with other keys than retainMs (1000..max_retain_ms),
/// retainBytes (4096..max_retain_bytes) and hangupAfterMs (1000..2592000000); `name` without detach
/// or not 1..128 of [A-Za-z0-9._-]; `dataEncoding: "base64"` with detach (kept output is binary
/// frames).
OpenParams parse_open(const json& p, std::uint64_t max_output_window = 1ULL << 30,
                      std::uint64_t max_stdin_window = 1ULL << 30,
                      const DetachLimits& detach_limits = {});

/// duplexChannelAttach (issue 46): a detached channel of the lease, by handle or by name.
struct AttachParams {
    std::string lease_id;  ///< 1..1024 bytes
    std::string handle;    ///< "dch_" and 24 hex digits; "" when named
    std::string name;      ///< 1..128 of [A-Za-z0-9._-]; "" when by handle
    struct Offsets {
        std::uint64_t stdout_offset = 0;
        std::uint64_t stderr_offset = 0;
    };
    /// Where to resume each stream (absolute byte offsets); none: from the oldest kept byte.
    std::optional<Offsets> offsets;
    bool takeover = false;  ///< end another host's attachment instead of CHANNEL_ATTACHED
    std::optional<std::uint32_t> output_window;  ///< bytes, 1 KiB .. max; none = the node's
    std::optional<std::pair<std::uint16_t, std::uint16_t>> resize;  ///< (cols, rows) 1..4096
};
/// INVALID_PARAMS naming the field: unknown keys, both or neither of handle and name, a
/// malformed handle or name, offsets other than {stdout?, stderr?} of 0..2^62-1, an
/// outputWindow outside 1 KiB..`max_output_window`, resize without both cols and rows.
AttachParams parse_attach(const json& p, std::uint64_t max_output_window = 1ULL << 30);

/// Decodes standard base64 (with padding); INVALID_PARAMS on `field` when it is not.
std::string decode_base64(const std::string& field, std::string_view text);

}  // namespace sandboxd::methods
