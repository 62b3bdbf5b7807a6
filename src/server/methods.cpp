#include "server/methods.hpp"

#include "server/channel.hpp"
#include "server/params.hpp"

#include <algorithm>
#include <cctype>

#include <sandboxd/core/base64.hpp>

namespace sandboxd::methods {

json params_object(const json& raw) {
    if (raw.is_array()) params::invalid("params", "must be an object");
    return params::object_or_empty(raw);
}

InitializeParams parse_initialize(const json& p) {
    params::only_keys(p, {"protocolVersion", "client"});
    auto version = params::req_uint(p, "protocolVersion", 0, UINT32_MAX);
    if (version != 1) params::invalid("protocolVersion", "only version 1 is supported");
    return {static_cast<std::uint32_t>(version)};
}

namespace {

constexpr std::size_t max_host_metadata = 64 * 1024;

/// A string of at most `max` bytes without NUL bytes.
std::string text_field(const json& v, const std::string& field, std::size_t max) {
    if (!v.is_string()) params::invalid(field, "must be a string");
    auto s = v.get<std::string>();
    if (s.size() > max) params::invalid(field, "must be at most " + std::to_string(max) + " bytes");
    if (s.find('\0') != std::string::npos) params::invalid(field, "must not contain NUL bytes");
    return s;
}

/// `env` of an open or an execute: an object of strings (each at most `max_value` bytes)
/// whose names are not empty and hold no '=' or NUL; absent or null is none.
std::map<std::string, std::string> env_field(const json& p, std::size_t max_value) {
    std::map<std::string, std::string> env;
    if (!p.contains("env") || p["env"].is_null()) return env;
    if (!p["env"].is_object()) params::invalid("env", "must be an object of strings");
    for (const auto& [k, v] : p["env"].items()) {
        if (!v.is_string()) params::invalid("env." + k, "must be a string");
        if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos) {
            params::invalid("env." + k, "is not a valid variable name");
        }
        env[k] = text_field(v, "env." + k, max_value);
    }
    return env;
}

}  // namespace

LeaseAcquireParams parse_lease_acquire(const json& p, std::uint64_t max_ttl_ms) {
    params::only_keys(p, {"companyId", "environmentId", "provider", "config", "ttlMs", "runId",
                          "issueId", "heartbeatRunId", "executionWorkspaceId", "agentId",
                          "idempotencyKey", "metadata", "leasePolicy"});
    LeaseAcquireParams out;
    out.company_id = params::req_string(p, "companyId");
    out.environment_id = params::req_string(p, "environmentId");
    out.provider = params::req_string(p, "provider");
    out.run_id = params::opt_string(p, "runId");
    out.issue_id = params::opt_string(p, "issueId");
    out.heartbeat_run_id = params::opt_string(p, "heartbeatRunId");
    out.execution_workspace_id = params::opt_string(p, "executionWorkspaceId");
    out.agent_id = params::opt_string(p, "agentId");
    out.idempotency_key = params::opt_string(p, "idempotencyKey");
    out.ttl_ms = params::opt_uint(p, "ttlMs", 1000, max_ttl_ms);
    if (auto it = p.find("config"); it != p.end() && !it->is_null()) {
        if (!it->is_object()) params::invalid("config", "must be an object");
        out.config = *it;
    }
    if (auto it = p.find("metadata"); it != p.end() && !it->is_null()) {
        if (!it->is_object()) params::invalid("metadata", "must be an object");
        if (it->dump().size() > max_host_metadata) {
            params::invalid("metadata", "must be at most " + std::to_string(max_host_metadata) +
                                            " bytes as JSON");
        }
        out.host_metadata = *it;
    }
    if (auto policy = params::opt_string(p, "leasePolicy")) {
        if (*policy != "ephemeral" && *policy != "reuse_by_environment" &&
            *policy != "reuse_by_execution_workspace" && *policy != "retain_on_failure") {
            params::invalid("leasePolicy",
                            "must be one of ephemeral, reuse_by_environment, "
                            "reuse_by_execution_workspace, retain_on_failure");
        }
        if (*policy == "reuse_by_execution_workspace" && !out.execution_workspace_id) {
            params::invalid("executionWorkspaceId",
                            "is required with leasePolicy reuse_by_execution_workspace");
        }
        out.lease_policy = *policy;
    }
    return out;
}

LeaseReleaseParams parse_lease_release(const json& p) {
    params::only_keys(p, {"leaseId", "disposition", "failed"});
    LeaseReleaseParams out;
    out.lease_id = params::req_string(p, "leaseId");
    out.disposition = params::opt_string(p, "disposition");
    if (out.disposition && *out.disposition != "destroy" && *out.disposition != "retain") {
        params::invalid("disposition", "must be \"destroy\" or \"retain\"");
    }
    out.failed = params::opt_bool(p, "failed").value_or(false);
    return out;
}

LeaseQuery parse_lease_list(const json& p) {
    params::only_keys(p,
                      {"companyId", "environmentId", "status", "ownerNodeId", "limit", "cursor"});
    LeaseQuery q;
    q.company_id = params::opt_string(p, "companyId");
    q.environment_id = params::opt_string(p, "environmentId");
    q.owner_node_id = params::opt_string(p, "ownerNodeId");
    if (auto st = params::opt_string(p, "status")) {
        q.status = parse_lease_status(*st);
        if (!q.status) {
            params::invalid("status",
                            "must be one of active, released, expired, failed, pending_cleanup, "
                            "retained");
        }
    }
    q.limit = params::opt_uint(p, "limit", 1, 1000).value_or(100);
    q.cursor = params::opt_string(p, "cursor").value_or("");
    return q;
}

LeaseUpdateNetworkParams parse_lease_update_network(const json& p) {
    params::only_keys(p, {"leaseId", "network"});
    LeaseUpdateNetworkParams out;
    out.lease_id = params::req_string(p, "leaseId");
    const auto it = p.find("network");
    if (it == p.end()) params::invalid("network", "is required");
    if (!it->is_boolean() && !it->is_object()) {
        params::invalid("network", "must be a policy object or a boolean");
    }
    out.network = *it;
    return out;
}

LeaseIdParams parse_lease_id(const json& p) {
    params::only_keys(p, {"leaseId"});
    return {params::req_string(p, "leaseId")};
}

ValidateConfigParams parse_validate_config(const json& p) {
    params::only_keys(p, {"provider", "config"});
    ValidateConfigParams out;
    out.provider = params::req_string(p, "provider");
    if (auto it = p.find("config"); it != p.end() && !it->is_null()) {
        if (!it->is_object()) params::invalid("config", "must be an object");
        out.config = *it;
    }
    return out;
}

ExecuteParams parse_execute(const json& p, std::uint64_t default_timeout_ms) {
    params::only_keys(
        p, {"leaseId", "command", "args", "cwd", "env", "stdin", "timeoutMs", "bypassSession"});
    ExecuteParams out;
    ExecuteRequest& r = out.request;
    out.lease_id = params::req_string(p, "leaseId");
    if (!p.contains("command")) params::invalid("command", "is required");
    const std::string command = text_field(p["command"], "command", 4096);
    if (command.empty()) params::invalid("command", "must not be empty");
    r.argv.push_back(command);
    r.params["command"] = command;
    if (p.contains("args") && !p["args"].is_null()) {
        if (!p["args"].is_array()) params::invalid("args", "must be an array of strings");
        if (p["args"].size() > 4096) params::invalid("args", "must have at most 4096 items");
        for (std::size_t i = 0; i < p["args"].size(); ++i) {
            r.argv.push_back(
                text_field(p["args"][i], "args[" + std::to_string(i) + "]", 128 * 1024));
        }
        r.params["args"] = p["args"];
    }
    if (p.contains("cwd") && !p["cwd"].is_null()) {
        r.cwd = text_field(p["cwd"], "cwd", 4096);
        r.params["cwd"] = r.cwd;
    }
    r.env = env_field(p, 128 * 1024);
    if (p.contains("env") && !p["env"].is_null()) r.params["env"] = p["env"];
    if (p.contains("stdin") && !p["stdin"].is_null()) {
        if (!p["stdin"].is_string()) params::invalid("stdin", "must be a string");
        r.stdin_data = p["stdin"].get<std::string>();
        r.params["stdin"] = r.stdin_data;
    }
    r.timeout_ms = params::opt_uint(p, "timeoutMs", 1, 86400000).value_or(default_timeout_ms);
    r.params["timeoutMs"] = r.timeout_ms;
    if (auto bypass = params::opt_bool(p, "bypassSession")) r.params["bypassSession"] = *bypass;
    return out;
}

RealizeWorkspaceParams parse_realize_workspace(const json& p) {
    params::only_keys(p, {"leaseId", "workspace"});
    RealizeWorkspaceParams out;
    out.lease_id = params::req_string(p, "leaseId");
    if (!p.contains("workspace") || !p["workspace"].is_object()) {
        params::invalid("workspace", "must be an object {remotePath?, mode?, metadata?}");
    }
    const json& w = p["workspace"];
    for (const auto& [key, value] : w.items()) {
        const std::string field = "workspace." + key;
        if (key == "localPath") {
            // A path of the machine that runs the worker: this node. A tenant must not name
            // the node's own files (the reason environmentSyncIn is not served either).
            params::invalid(field, "is not accepted: it names a path on the sandboxd node");
        }
        if (key == "remotePath" || key == "mode") {
            if (!value.is_null()) out.workspace[key] = text_field(value, field, 4096);
        } else if (key == "metadata") {
            if (!value.is_null() && !value.is_object()) params::invalid(field, "must be an object");
            if (!value.is_null()) out.workspace[key] = value;
        } else {
            params::invalid(field, "unknown parameter");
        }
    }
    return out;
}

LeaseRenewParams parse_lease_renew(const json& p) {
    params::only_keys(p, {"leaseId", "ttlMs"});
    LeaseRenewParams out;
    out.lease_id = params::req_string(p, "leaseId");
    out.ttl_ms = params::req_uint(p, "ttlMs", 1000, UINT64_MAX >> 2);
    return out;
}

std::optional<std::uint32_t> channel_named(const json& p) {
    if (!p.is_object()) return std::nullopt;
    auto it = p.find("channel");
    // Parsed text holds a non-negative integer as unsigned; a built one may hold it signed.
    if (it == p.end() || !it->is_number_integer()) return std::nullopt;
    if (!it->is_number_unsigned() && it->get<std::int64_t>() < 0) return std::nullopt;
    const auto v = it->get<std::uint64_t>();
    if (v > UINT32_MAX) return std::nullopt;
    return static_cast<std::uint32_t>(v);
}

namespace {

std::uint32_t channel_of(const json& p) {
    return static_cast<std::uint32_t>(params::req_uint(p, "channel", 0, UINT32_MAX));
}

}  // namespace

ChannelParams parse_channel(const json& p) {
    params::only_keys(p, {"channel"});
    return {channel_of(p)};
}

WriteParams parse_write(const json& p) {
    params::only_keys(p, {"channel", "data"});
    WriteParams out;
    out.channel = channel_of(p);
    auto data = params::opt_string(p, "data");
    if (!data) params::invalid("data", "is required (base64)");
    out.data = decode_base64("data", *data);
    return out;
}

ResizeParams parse_resize(const json& p) {
    params::only_keys(p, {"channel", "cols", "rows"});
    ResizeParams out;
    out.channel = channel_of(p);
    out.cols = static_cast<std::uint16_t>(params::req_uint(p, "cols", 1, 4096));
    out.rows = static_cast<std::uint16_t>(params::req_uint(p, "rows", 1, 4096));
    return out;
}

SignalParams parse_signal(const json& p) {
    params::only_keys(p, {"channel", "signal"});
    SignalParams out;
    out.channel = channel_of(p);
    out.signal = parse_signal_name(params::req_string(p, "signal"));
    if (out.signal == 0) {
        params::invalid("signal", "must be one of INT, TERM, HUP, QUIT, KILL, USR1, USR2, WINCH");
    }
    return out;
}

LeaseRef parse_lease_ref(const json& lp) {
    LeaseRef ref;
    try {
        if (!lp.is_object()) params::invalid("lease", "must be an object");
        const json* metadata =
            lp.contains("metadata") && lp["metadata"].is_object() ? &lp["metadata"] : nullptr;
        auto is_str = [](const json* o, const char* k) {
            return o && o->contains(k) && (*o)[k].is_string() &&
                   !(*o)[k].get<std::string>().empty();
        };
        if (!is_str(metadata, "pluginId") || !is_str(metadata, "provider") ||
            !is_str(&lp, "providerLeaseId")) {
            throw rpc_error(errc::lease_incomplete, std::string(lease_incomplete_message));
        }
        ref.provider = (*metadata)["provider"].get<std::string>();
        ref.plugin_id = (*metadata)["pluginId"].get<std::string>();
        ref.provider_lease_id = lp["providerLeaseId"].get<std::string>();
        ref.company_id = params::req_string(lp, "companyId");
        ref.environment_id = params::req_string(lp, "environmentId");
        ref.id = params::opt_string(lp, "id");
        ref.epoch = params::opt_uint(lp, "epoch", 0, INT64_MAX);
    } catch (const rpc_error&) {
        ref.problem = std::current_exception();
    }
    return ref;
}

namespace {

/// `obj[key]` of the object param `prefix`, an integer in lo..hi (INVALID_PARAMS naming
/// "prefix.key"); `fallback` when absent or null.
std::optional<std::uint64_t> nested_uint(const json& obj, const std::string& prefix,
                                         const char* key, std::uint64_t lo, std::uint64_t hi) {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return std::nullopt;
    const std::string field = prefix + "." + key;
    const std::string range = std::to_string(lo) + ".." + std::to_string(hi);
    if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<std::int64_t>() < 0)) {
        params::invalid(field, "must be an integer in " + range);
    }
    const auto v = it->get<std::uint64_t>();
    if (v < lo || v > hi) params::invalid(field, "must be an integer in " + range);
    return v;
}

/// The object param `key` with only the fields `allowed` (null when absent).
const json* nested_object(const json& p, const char* key,
                          std::initializer_list<const char*> allowed, const char* shape) {
    const auto it = p.find(key);
    if (it == p.end() || it->is_null()) return nullptr;
    if (!it->is_object()) params::invalid(key, std::string("must be an object ") + shape);
    for (const auto& item : it->items()) {
        const std::string& field = item.key();  // not a structured binding: clang captures none
        if (std::find_if(allowed.begin(), allowed.end(),
                         [&field](const char* a) { return field == a; }) == allowed.end()) {
            params::invalid(std::string(key) + "." + field,
                            std::string("is not a field of ") + key);
        }
    }
    return &*it;
}

/// A detached channel's `name`: 1..128 of [A-Za-z0-9._-].
std::string channel_name(std::string name) {
    const bool valid =
        !name.empty() && name.size() <= 128 && std::all_of(name.begin(), name.end(), [](char c) {
            return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
        });
    if (!valid) params::invalid("name", "must be 1 to 128 of A-Z, a-z, 0-9, '.', '_', '-'");
    return name;
}

/// The open's `detach` and `name` (see parse_open).
/// The longest a detached channel may wait for a host before it is hung up: 30 days.
constexpr std::uint64_t max_hangup_after_ms = 30ULL * 24 * 3600 * 1000;

void parse_detach(const json& p, const DetachLimits& limits, OpenParams& out) {
    if (const json* d = nested_object(p, "detach", {"retainMs", "retainBytes", "hangupAfterMs"},
                                      "{retainMs?, retainBytes?, hangupAfterMs?}")) {
        OpenParams::Detach detach;
        detach.retain_ms = nested_uint(*d, "detach", "retainMs", 1000, limits.max_retain_ms)
                               .value_or(limits.retain_ms);
        detach.retain_bytes =
            nested_uint(*d, "detach", "retainBytes", 4096, limits.max_retain_bytes)
                .value_or(limits.retain_bytes);
        if (auto after = nested_uint(*d, "detach", "hangupAfterMs", 1000, max_hangup_after_ms)) {
            detach.hangup_after = std::chrono::milliseconds(*after);
        }
        out.detach = detach;
    }
    if (auto name = params::opt_string(p, "name")) {
        if (!out.detach) params::invalid("name", "names a detached channel: give detach too");
        out.name = channel_name(std::move(*name));
    }
    if (out.detach && out.base64) {
        params::invalid("dataEncoding",
                        "must be \"binary\" with detach: kept output is sent as binary frames");
    }
}

}  // namespace

OpenParams parse_open(const json& p, std::uint64_t max_output_window,
                      std::uint64_t max_stdin_window, const DetachLimits& detach_limits) {
    params::only_keys(p,
                      {"hostRouteId", "lease", "command", "cwd", "env", "pty", "stdin", "timeoutMs",
                       "outputWindow", "stdinWindow", "dataEncoding", "detach", "name"});
    OpenParams out;
    ExecSpec& spec = out.spec;
    out.host_route_id = params::opt_string(p, "hostRouteId").value_or("");
    if (!p.contains("lease") || !p["lease"].is_object())
        params::invalid("lease", "must be an object");
    out.lease = parse_lease_ref(p["lease"]);
    if (!p.contains("command") || !p["command"].is_array() || p["command"].empty()) {
        params::invalid("command", "must be an array of at least one string");
    }
    for (std::size_t i = 0; i < p["command"].size(); ++i) {
        const auto& arg = p["command"][i];
        const std::string field = "command[" + std::to_string(i) + "]";
        if (!arg.is_string()) params::invalid(field, "must be a string");
        auto s = arg.get<std::string>();
        if (s.find('\0') != std::string::npos) params::invalid(field, "must not contain NUL bytes");
        if (i == 0 && s.empty()) params::invalid(field, "must not be empty");
        spec.argv.push_back(std::move(s));
    }
    spec.cwd = params::opt_string(p, "cwd").value_or("");
    if (spec.cwd.find('\0') != std::string::npos)
        params::invalid("cwd", "must not contain NUL bytes");
    spec.env = env_field(p, SIZE_MAX);  // bounded by limits.maxTextMessage
    if (p.contains("pty") && !p["pty"].is_null()) {
        const auto& pty = p["pty"];
        if (!pty.is_object()) params::invalid("pty", "must be an object {cols, rows}");
        PtySize size;
        size.cols = static_cast<std::uint16_t>(params::req_uint(pty, "cols", 1, 4096));
        size.rows = static_cast<std::uint16_t>(params::req_uint(pty, "rows", 1, 4096));
        spec.pty = size;
    }
    spec.stdin_attached = params::opt_bool(p, "stdin").value_or(true);
    if (auto t = params::opt_uint(p, "timeoutMs", 1, 30ULL * 24 * 3600000)) {
        out.timeout = std::chrono::milliseconds(*t);
    }
    if (auto w = params::opt_uint(p, "outputWindow", 1024, max_output_window)) {
        out.output_window = static_cast<std::uint32_t>(*w);
    }
    if (auto w = params::opt_uint(p, "stdinWindow", 1024, max_stdin_window)) {
        out.stdin_window = static_cast<std::uint32_t>(*w);
    }
    if (auto enc = params::opt_string(p, "dataEncoding")) {
        if (*enc != "binary" && *enc != "base64") {
            params::invalid("dataEncoding", "must be \"binary\" or \"base64\"");
        }
        out.base64 = *enc == "base64";
    }
    parse_detach(p, detach_limits, out);
    return out;
}

std::string decode_base64(const std::string& field, std::string_view text) {
    try {
        return base64_decode(text);
    } catch (const base64_error&) {
        params::invalid(field, "is not valid base64");
    }
}

AttachParams parse_attach(const json& p, std::uint64_t max_output_window) {
    params::only_keys(
        p, {"leaseId", "handle", "name", "offsets", "takeover", "outputWindow", "resize"});
    AttachParams out;
    out.lease_id = params::req_string(p, "leaseId");
    auto handle = params::opt_string(p, "handle");
    auto name = params::opt_string(p, "name");
    if (handle.has_value() == name.has_value()) {
        params::invalid(handle ? "name" : "handle",
                        "give exactly one of handle and name (the detached channel to attach to)");
    }
    if (handle) {
        const bool valid =
            handle->size() == 28 && handle->rfind("dch_", 0) == 0 &&
            std::all_of(handle->begin() + 4, handle->end(), [](char c) {
                return std::isdigit(static_cast<unsigned char>(c)) || (c >= 'a' && c <= 'f');
            });
        if (!valid) params::invalid("handle", "must be \"dch_\" and 24 lowercase hex digits");
        out.handle = std::move(*handle);
    } else {
        out.name = channel_name(std::move(*name));
    }
    if (const json* o = nested_object(p, "offsets", {"stdout", "stderr"}, "{stdout?, stderr?}")) {
        constexpr std::uint64_t max_offset = (1ULL << 62) - 1;
        AttachParams::Offsets offsets;
        offsets.stdout_offset = nested_uint(*o, "offsets", "stdout", 0, max_offset).value_or(0);
        offsets.stderr_offset = nested_uint(*o, "offsets", "stderr", 0, max_offset).value_or(0);
        out.offsets = offsets;
    }
    out.takeover = params::opt_bool(p, "takeover").value_or(false);
    if (auto w = params::opt_uint(p, "outputWindow", 1024, max_output_window)) {
        out.output_window = static_cast<std::uint32_t>(*w);
    }
    if (const json* r = nested_object(p, "resize", {"cols", "rows"}, "{cols, rows}")) {
        const auto cols = nested_uint(*r, "resize", "cols", 1, 4096);
        const auto rows = nested_uint(*r, "resize", "rows", 1, 4096);
        if (!cols || !rows) params::invalid("resize", "needs both cols and rows (1..4096)");
        out.resize =
            std::make_pair(static_cast<std::uint16_t>(*cols), static_cast<std::uint16_t>(*rows));
    }
    return out;
}

}  // namespace sandboxd::methods
