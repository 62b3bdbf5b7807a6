/// @file plugin_provider.cpp
/// A Provider whose sandboxes live behind a plugin worker that speaks the protocol of
/// @paperclipai/plugin-sdk (docs/plugins.md). Leases map to environmentAcquireLease,
/// environmentResumeLease, environmentReleaseLease and environmentDestroyLease with the SDK's
/// full param shapes; channels to duplexChannelOpen, served by the WorkerManager as channel
/// backends. Every call completes when the worker answers (or its timeout fires); none blocks
/// a thread.

#include "provider/plugin_worker.hpp"

#include <sandboxd/core/errors.hpp>

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <ctime>

namespace sandboxd {
namespace {

using json = nlohmann::json;

constexpr std::size_t max_provider_lease_id = 256;

/// What the plugin provider keeps for one sandbox: what every later call repeats to the
/// worker, and the worker generation whose handle cache holds the sandbox.
class PluginSandbox final : public SandboxState {
public:
    PluginSandbox(json lease_config, std::optional<std::string> lease_issue_id,
                  std::uint64_t worker_generation)
        : config(std::move(lease_config)),
          issue_id(std::move(lease_issue_id)),
          generation(worker_generation) {}
    const json config;
    const std::optional<std::string> issue_id;
    /// The worker generation that acquired or last resumed the sandbox; 0 when none did in
    /// this process (a handle made from the lease's record).
    std::atomic<std::uint64_t> generation;
};

/// An RFC 3339 time of the worker's (e.g. "2030-01-01T00:00:00.000Z" or with an offset) as
/// ms since the epoch; nullopt when it is not one.
std::optional<std::int64_t> parse_time(const std::string& text) {
    std::tm tm{};
    const char* rest = ::strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
    if (!rest) return std::nullopt;
    std::int64_t ms = 0;
    if (*rest == '.') {
        ++rest;
        int digits = 0;
        while (*rest >= '0' && *rest <= '9') {
            if (digits < 3) ms = ms * 10 + (*rest - '0');
            ++digits;
            ++rest;
        }
        if (digits == 0) return std::nullopt;
        for (; digits < 3; ++digits) ms *= 10;
    }
    std::int64_t offset_s = 0;
    if (*rest == 'Z' || *rest == 'z') {
        ++rest;
    } else if (*rest == '+' || *rest == '-') {
        const int sign = *rest == '-' ? -1 : 1;
        int hh = 0;
        int mm = 0;
        if (std::sscanf(rest + 1, "%2d:%2d", &hh, &mm) != 2) return std::nullopt;
        offset_s = sign * (hh * 3600 + mm * 60);
        rest += 6;
    } else {
        return std::nullopt;
    }
    if (*rest != '\0') return std::nullopt;
    const std::time_t t = ::timegm(&tm);
    return (static_cast<std::int64_t>(t) - offset_s) * 1000 + ms;
}

class PluginProvider final : public Provider {
public:
    PluginProvider(PluginConfig config, PluginTuning tuning)
        : key_(config.provider),
          plugin_id_(config.plugin_id),
          cleanup_(config.cleanup),
          manager_(std::move(config), std::move(tuning)) {
        manager_.on_late_acquire([this](json params, json result, json context) {
            late_acquire(params, result, context);
        });
    }

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }
    bool ready() const noexcept override { return manager_.ready(); }
    std::optional<WorkerStatus> worker_status() const noexcept override {
        return WorkerStatus{manager_.ready(), manager_.restarts()};
    }

    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override {
        if (!lease.config.is_null() && !lease.config.is_object()) {
            throw rpc_error(errc::invalid_params, "config: must be an object");
        }
        json params = acquire_params(lease);
        auto answer = co_await manager_.call_answered("environmentAcquireLease", std::move(params),
                                                      lease_context(lease));
        co_return handle_of(lease, answer.result, "environmentAcquireLease", answer.generation);
    }

    awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease) override {
        auto answer = co_await resume_call(lease);
        co_return handle_of(lease, answer.result, "environmentResumeLease", answer.generation);
    }

    bool can_resume() const noexcept override {
        // A worker that is not up yet cannot say: the lease waits for it (it stays active,
        // and expires by its TTL if the worker never comes).
        return !manager_.ready() || manager_.supports("environmentResumeLease");
    }

    CleanupPolicy cleanup_policy(std::int64_t) const override {
        return {static_cast<int>(cleanup_.attempts), static_cast<std::int64_t>(cleanup_.backoff_ms),
                static_cast<std::int64_t>(cleanup_.slow_retry_ms)};
    }

    void on_late_sandbox(LateSandboxSink sink) override { late_sink_ = std::move(sink); }

    std::vector<std::string> capabilities() const override {
        // What the worker's supportedMethods make possible (docs/plugins.md section 3).
        static const std::pair<const char*, const char*> map[] = {
            {"duplexChannelOpen", "channels"},
            {"duplexChannelCloseStdin", "closeStdin"},
            {"duplexChannelSignal", "signals"},
            {"duplexChannelResize", "resize"},
            {"environmentProbe", "probe"},
            {"environmentValidateConfig", "validateConfig"},
            {"environmentResumeLease", "resume"},
            {"environmentExecute", "execute"},
            {"environmentRealizeWorkspace", "realizeWorkspace"}};
        std::vector<std::string> out;
        for (const auto& [method, capability] : map) {
            if (manager_.supports(method)) out.emplace_back(capability);
        }
        if (can_retain()) out.emplace_back("retain");
        return out;
    }

    bool can_retain() const noexcept override {
        return manager_.supports("environmentReleaseLease") &&
               manager_.supports("environmentResumeLease");
    }

    awaitable<void> stop(std::shared_ptr<SandboxHandle> sandbox) override {
        if (!can_retain()) {
            throw rpc_error(errc::invalid_params,
                            "disposition: plugin " + plugin_id_ + " (provider " + key_ +
                                ") cannot retain a sandbox (its worker does not serve both "
                                "environmentReleaseLease and environmentResumeLease)",
                            {{"field", "disposition"}});
        }
        // Stopped, not destroyed: a later reuse resumes it (environmentResumeLease).
        co_await manager_.call("environmentReleaseLease", teardown_params(*sandbox));
    }

    awaitable<json> execute(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                            ExecuteRequest request, ExecuteLog log) override {
        (void)co_await holding_worker(*sandbox);
        json params = lease_call_params(*sandbox, lease, request.params);
        WorkerManager::Invocation invocation;
        invocation.company_id = lease.company_id;
        invocation.timeout = std::chrono::milliseconds(request.timeout_ms) + execute_answer_grace;
        invocation.on_notification = [log = std::move(log)](const std::string& method, json p) {
            if (method != "execute.log" || !log || !p.is_object()) return;
            const json stream = p.value("stream", json());
            const json chunk = p.value("chunk", json());
            if ((stream != "stdout" && stream != "stderr") || !chunk.is_string() ||
                chunk.get<std::string>().empty()) {
                return;  // not the SDK's shape: nothing a host could use
            }
            log(stream.get<std::string>(), chunk.get<std::string>());
        };
        auto result = co_await manager_.call_in_invocation("environmentExecute", std::move(params),
                                                           std::move(invocation));
        if (!result) unsupported("leaseExecute", "environmentExecute");
        co_return *result;
    }

    awaitable<json> realize_workspace(std::shared_ptr<SandboxHandle> sandbox, Lease lease,
                                      json workspace) override {
        (void)co_await holding_worker(*sandbox);
        json params = lease_call_params(*sandbox, lease, json{{"workspace", std::move(workspace)}});
        auto result = co_await manager_.call_if_supported("environmentRealizeWorkspace", params);
        if (!result) unsupported("leaseRealizeWorkspace", "environmentRealizeWorkspace");
        co_return *result;
    }

    awaitable<json> validate_config(std::string company_id, json config) override {
        (void)company_id;
        json params = validate_params(config);
        auto result = co_await manager_.call_if_supported("environmentValidateConfig", params);
        if (!result) unsupported("providerValidateConfig", "environmentValidateConfig");
        co_return *result;
    }

    awaitable<json> probe(std::shared_ptr<SandboxHandle> sandbox, Lease lease) override {
        json params = probe_params(*sandbox, lease);
        auto result = co_await manager_.call_if_supported("environmentProbe", params);
        if (!result) unsupported("leaseProbe", "environmentProbe");
        co_return *result;
    }

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        const json params = teardown_params(*sandbox);
        // Either call throws PROVIDER_NOT_READY while the worker is down: the sweeper then
        // retries without spending an attempt. The SDK's teardown params carry the
        // providerLeaseId, config and leaseMetadata: a plugin tears down without its cache,
        // so no resume comes first.
        co_await manager_.call_if_supported("environmentReleaseLease", params);
        co_await manager_.call_if_supported("environmentDestroyLease", params);
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        refuse_unsupported(spec);
        const std::uint64_t generation = co_await holding_worker(*sandbox);
        json params = open_params(*sandbox, spec);
        co_return co_await manager_.open_channel(std::move(params), generation);
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override {
        // The worker tears down from the lease's record: any node's daemon can release
        // through it.
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope_of(lease);
        handle->lease_id = lease.id;
        handle->provider_metadata = lease.provider_metadata;
        handle->state = std::make_shared<PluginSandbox>(lease.config, lease.issue_id, 0);
        return handle;
    }

private:
    /// environmentExecute's answer may come this long after its timeoutMs.
    static constexpr std::chrono::milliseconds execute_answer_grace{30000};

    /// The generation of the ready worker, whose handle cache holds `sandbox`: after a
    /// worker restart its cache is empty, so the sandbox is resumed first, and the call that
    /// follows goes to that same worker (a restart in between: PROVIDER_NOT_READY).
    awaitable<std::uint64_t> holding_worker(SandboxHandle& sandbox) {
        auto* state = dynamic_cast<PluginSandbox*>(sandbox.state.get());
        const std::uint64_t generation = manager_.generation();
        if (generation == 0) {
            throw rpc_error(errc::provider_not_ready,
                            "plugin " + plugin_id_ + " (provider " + key_ +
                                ") is not ready: its worker is down or starting");
        }
        if (state && state->generation != generation) {
            co_return co_await resume_cached(sandbox, *state);
        }
        co_return generation;
    }

    /// The SDK's params of a call about one lease's sandbox: the base params, `lease`
    /// (PluginEnvironmentLease) and the host's own fields.
    json lease_call_params(const SandboxHandle& sandbox, const Lease& lease,
                           const json& host_fields) const {
        json p = base_params(sandbox.scope, lease.config, lease.issue_id);
        json ref = {{"providerLeaseId", sandbox.scope.provider_lease_id}};
        if (sandbox.provider_metadata.is_object()) ref["metadata"] = sandbox.provider_metadata;
        ref["expiresAt"] =
            sandbox.expires_at_ms ? json(format_rfc3339(*sandbox.expires_at_ms)) : json(nullptr);
        p["lease"] = std::move(ref);
        for (const auto& [k, v] : host_fields.items()) p[k] = v;
        return p;
    }

    void refuse_unsupported(const ExecSpec& spec) const {
        auto refuse = [this](const char* field, const char* what) {
            throw rpc_error(errc::invalid_params,
                            std::string(field) + ": plugin " + plugin_id_ + " (provider " + key_ +
                                ") cannot " + what +
                                ": the paperclip plugin protocol's duplexChannelOpen has no such "
                                "field",
                            {{"field", field}});
        };
        if (spec.pty) refuse("pty", "run a channel under a PTY");
        if (!spec.cwd.empty()) refuse("cwd", "set a channel's working directory");
        if (!spec.env.empty()) refuse("env", "set a channel's environment");
        if (!spec.stdin_attached) refuse("stdin", "open a channel without stdin");
    }

    awaitable<WorkerManager::Answer> resume_call(Lease lease) {
        co_return co_await manager_.call_answered("environmentResumeLease", resume_params(lease));
    }

    /// Resumes `sandbox` in the ready worker; returns the generation of the worker that
    /// answered the resume (the one whose cache now holds it).
    awaitable<std::uint64_t> resume_cached(SandboxHandle& sandbox, PluginSandbox& state) {
        Lease lease;
        lease.id = sandbox.lease_id;
        lease.provider = sandbox.scope.provider;
        lease.company_id = sandbox.scope.company_id;
        lease.environment_id = sandbox.scope.environment_id;
        lease.provider_lease_id = sandbox.scope.provider_lease_id;
        lease.config = state.config;
        lease.issue_id = state.issue_id;
        lease.provider_metadata = sandbox.provider_metadata;
        if (!manager_.supports("environmentResumeLease")) {
            throw rpc_error(errc::sandbox_not_cached,
                            std::string(sandbox_not_cached_message) + " (plugin " + plugin_id_ +
                                " restarted and cannot resume leases)",
                            {{"leaseId", lease.id}});
        }
        std::uint64_t generation = 0;
        try {
            auto answer = co_await resume_call(lease);
            (void)handle_of(lease, answer.result, "environmentResumeLease", answer.generation);
            generation = answer.generation;
        } catch (const rpc_error& e) {
            if (e.code() == errc::provider_not_ready) throw;
            throw rpc_error(errc::sandbox_not_cached,
                            std::string(sandbox_not_cached_message) + " (plugin " + plugin_id_ +
                                " could not resume it: " + e.what() + ")",
                            {{"leaseId", lease.id}});
        }
        state.generation = generation;
        spdlog::info("lease={} resumed by plugin={} after a worker restart", lease.id, plugin_id_);
        co_return generation;
    }

    /// The handle of what acquire or resume answered; PROVIDER_ERROR for an unusable answer.
    std::shared_ptr<SandboxHandle> handle_of(const Lease& lease, const json& result,
                                             const char* method, std::uint64_t generation) const {
        const json* id = result.is_object() && result.contains("providerLeaseId")
                             ? &result["providerLeaseId"]
                             : nullptr;
        if (!id || !id->is_string() || id->get<std::string>().empty() ||
            id->get<std::string>().size() > max_provider_lease_id ||
            id->get<std::string>().find_first_of(std::string("\0\n\r", 3)) != std::string::npos ||
            (!lease.provider_lease_id.empty() && *id != lease.provider_lease_id)) {
            spdlog::error("plugin={} {} returned no usable providerLeaseId: {}", plugin_id_, method,
                          result.dump().substr(0, 1000));
            throw rpc_error(errc::provider_error, "plugin " + plugin_id_ + ": " + method +
                                                      " returned no usable providerLeaseId");
        }
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope_of(lease);
        handle->scope.provider_lease_id = id->get<std::string>();
        handle->lease_id = lease.id;
        if (result.contains("metadata") && result["metadata"].is_object()) {
            handle->provider_metadata = result["metadata"];
        } else {
            handle->provider_metadata = lease.provider_metadata;
        }
        if (result.contains("expiresAt") && result["expiresAt"].is_string()) {
            handle->expires_at_ms = parse_time(result["expiresAt"].get<std::string>());
            if (!handle->expires_at_ms) {
                spdlog::warn("plugin={} {}: expiresAt {} is not an RFC 3339 time; ignored",
                             plugin_id_, method, result["expiresAt"].dump());
            }
        }
        handle->state = std::make_shared<PluginSandbox>(lease.config, lease.issue_id, generation);
        return handle;
    }

    /// An acquire answered after its timeout: a lease record for it, for the node to tear
    /// down. Runs on the worker manager's thread.
    void late_acquire(const json& params, const json& result, const json& context) {
        const json* id = result.is_object() && result.contains("providerLeaseId")
                             ? &result["providerLeaseId"]
                             : nullptr;
        if (!id || !id->is_string() || id->get<std::string>().empty() ||
            id->get<std::string>().size() > max_provider_lease_id) {
            spdlog::error("plugin={}: a late environmentAcquireLease answer names no sandbox: {}",
                          plugin_id_, result.dump().substr(0, 1000));
            return;
        }
        Lease lease = lease_of_context(context);
        lease.provider = key_;
        lease.company_id = params.value("companyId", "");
        lease.environment_id = params.value("environmentId", "");
        lease.provider_lease_id = id->get<std::string>();
        lease.config = params.value("config", json::object());
        lease.provider_metadata = result.contains("metadata") && result["metadata"].is_object()
                                      ? result["metadata"]
                                      : json();
        spdlog::warn(
            "plugin={}: environmentAcquireLease for lease {} answered after its timeout "
            "(providerLeaseId {}): recorded for cleanup",
            plugin_id_, lease.id, lease.provider_lease_id);
        if (late_sink_) late_sink_(std::move(lease));
    }

    [[noreturn]] void unsupported(const char* host_method, const char* sdk_method) const {
        throw rpc_error(errc::invalid_params,
                        std::string(host_method) + ": plugin " + plugin_id_ + " (provider " + key_ +
                            ") does not implement it (" + sdk_method +
                            " is not in its worker's supportedMethods)",
                        {{"field", host_method}});
    }

    json validate_params(const json& config) const {
        return {{"driverKey", key_}, {"config", config.is_object() ? config : json::object()}};
    }

    json probe_params(const SandboxHandle& sandbox, const Lease& lease) const {
        return base_params(sandbox.scope, lease.config, lease.issue_id);
    }

    /// What a late acquire answer needs to record the lease (kept with the call).
    static json lease_context(const Lease& lease) {
        json c = {{"leaseId", lease.id}};
        if (lease.run_id) c["runId"] = *lease.run_id;
        if (lease.issue_id) c["issueId"] = *lease.issue_id;
        if (lease.heartbeat_run_id) c["heartbeatRunId"] = *lease.heartbeat_run_id;
        if (lease.execution_workspace_id) c["executionWorkspaceId"] = *lease.execution_workspace_id;
        if (lease.agent_id) c["agentId"] = *lease.agent_id;
        return c;
    }
    static Lease lease_of_context(const json& c) {
        Lease lease;
        auto opt = [&c](const char* key) -> std::optional<std::string> {
            if (c.contains(key) && c[key].is_string()) return c[key].get<std::string>();
            return std::nullopt;
        };
        lease.id = opt("leaseId").value_or("");
        lease.run_id = opt("runId");
        lease.issue_id = opt("issueId");
        lease.heartbeat_run_id = opt("heartbeatRunId");
        lease.execution_workspace_id = opt("executionWorkspaceId");
        lease.agent_id = opt("agentId");
        return lease;
    }

    // The params are built in plain functions: GCC 12 miscompiles brace-initialised
    // aggregates of strings inside coroutine bodies.
    json base_params(const SandboxScope& scope, const json& config,
                     const std::optional<std::string>& issue_id) const {
        return {{"driverKey", key_},
                {"companyId", scope.company_id},
                {"environmentId", scope.environment_id},
                {"issueId", issue_id ? json(*issue_id) : json(nullptr)},
                {"config", config.is_object() ? config : json::object()}};
    }

    json acquire_params(const Lease& lease) const {
        json p = base_params(scope_of(lease), lease.config, lease.issue_id);
        // The SDK requires a runId: the host's, else the lease id.
        p["runId"] = lease.run_id.value_or(lease.id);
        if (lease.agent_id) p["agentId"] = *lease.agent_id;
        p["executionWorkspaceId"] =
            lease.execution_workspace_id ? json(*lease.execution_workspace_id) : json(nullptr);
        if (lease.expires_at_ms) p["requestedExpiresAt"] = format_rfc3339(*lease.expires_at_ms);
        return p;
    }

    json resume_params(const Lease& lease) const {
        json p = base_params(scope_of(lease), lease.config, lease.issue_id);
        p["providerLeaseId"] = lease.provider_lease_id;
        if (lease.provider_metadata.is_object()) p["leaseMetadata"] = lease.provider_metadata;
        return p;
    }

    json teardown_params(const SandboxHandle& sandbox) const {
        const auto* state = dynamic_cast<const PluginSandbox*>(sandbox.state.get());
        json p = base_params(sandbox.scope, state ? state->config : json::object(),
                             state ? state->issue_id : std::nullopt);
        p["providerLeaseId"] = sandbox.scope.provider_lease_id;
        if (sandbox.provider_metadata.is_object()) p["leaseMetadata"] = sandbox.provider_metadata;
        p["cancelActiveWork"] = false;
        return p;
    }

    json open_params(const SandboxHandle& sandbox, const ExecSpec& spec) const {
        return {{"driverKey", key_},
                {"companyId", sandbox.scope.company_id},
                {"environmentId", sandbox.scope.environment_id},
                {"providerLeaseId", sandbox.scope.provider_lease_id},
                {"command", spec.argv}};
    }

    const std::string key_;
    const std::string plugin_id_;
    const PluginCleanupConfig cleanup_;
    LateSandboxSink late_sink_;  // set before the node serves
    WorkerManager manager_;
};

}  // namespace

std::unique_ptr<Provider> make_plugin_provider(PluginConfig config, PluginTuning tuning) {
    return std::make_unique<PluginProvider>(std::move(config), std::move(tuning));
}

}  // namespace sandboxd
