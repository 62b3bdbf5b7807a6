/// @file bwrap_provider.cpp
/// The built-in bubblewrap provider: a lease is one long-lived sandbox (docs/security.md).
///
/// create() gives the lease a host uid of its own (IdentityPool), a workspace disk
/// (lease_disk.hpp), a cgroup with its limits (cgroups.hpp) and starts bubblewrap as that uid:
/// new user (uid mapped to the configured inside uid), mount, PID, IPC, UTS, cgroup and
/// (unless allowed) network namespaces over a minimal root (read-only /usr, a generated /etc,
/// private /tmp, /run and /dev/shm, the workspace at /workspace), with `sandboxd-init --lease`
/// as PID 1: the supervisor (src/init/supervisor_protocol.hpp). open() asks the supervisor
/// for a channel, asynchronously, and serves it through a ProcessBackend; destroy() kills the
/// cgroup, unmounts the disk and returns the uid. create() and destroy() block (mkfs, mount,
/// cgroups, bubblewrap's start): they run on the provider's own bounded pool.
///
/// This file holds the Provider calls and a lease's create and destroy; the rest is in the
/// files bwrap_provider_impl.hpp names.

#include "provider/bwrap_provider_impl.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/provider/provider.hpp>

#include "provider/bwrap_config.hpp"
#include "provider/cgroups.hpp"
#include "provider/identity_pool.hpp"
#include "provider/lease_disk.hpp"
#include "provider/node_budget.hpp"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#ifndef SANDBOXD_LIBEXECDIR
#define SANDBOXD_LIBEXECDIR "/usr/libexec/sandboxd"  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd::bwrap {

[[noreturn]] void provider_failure(std::string message) {
    throw rpc_error(errc::provider_error, std::move(message));
}

/// The default init: next to the running executable, else the install location.
fs::path default_init_path() {
    std::error_code ec;
    fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) {
        fs::path candidate = self.parent_path() / "sandboxd-init";
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return fs::path(SANDBOXD_LIBEXECDIR) / "sandboxd-init";
}

namespace {
bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

}  // namespace

void validate_spec(const ExecSpec& spec) {
    if (spec.argv.empty()) throw rpc_error(errc::invalid_params, "argv: must not be empty");
    for (const auto& arg : spec.argv) {
        if (has_nul(arg)) throw rpc_error(errc::invalid_params, "argv: contains a NUL byte");
    }
    if (has_nul(spec.cwd)) throw rpc_error(errc::invalid_params, "cwd: contains a NUL byte");
    for (const auto& [name, value] : spec.env) {
        if (name.empty() || name.find('=') != std::string::npos || has_nul(name)) {
            throw rpc_error(errc::invalid_params, "env: invalid variable name \"" + name + "\"");
        }
        if (has_nul(value)) {
            throw rpc_error(errc::invalid_params, "env." + name + ": contains a NUL byte");
        }
    }
}

std::string sandbox_cwd(const std::string& cwd) {
    if (cwd.empty()) return "/workspace";
    if (cwd.front() == '/') return cwd;
    return "/workspace/" + cwd;
}

unique_fd open_path(const fs::path& path, const char* what) {
    unique_fd fd(::open(path.c_str(), O_PATH | O_CLOEXEC));
    if (!fd)
        provider_failure(std::string("cannot open ") + what + " " + path.string() + ": " +
                         std::strerror(errno));
    return fd;
}

void write_file(const fs::path& path, std::string_view text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + path.string());
}

/// FNV-1a, for a stable short name of the sandboxes directory.
std::string short_hash(std::string_view text) {
    std::uint64_t h = 1469598103934665603ULL;
    for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
    return std::string(out, 8);
}

awaitable<std::shared_ptr<SandboxHandle>> BwrapProvider::create(Lease lease) {
    if (!probe_problem_.empty()) {
        throw rpc_error(
            errc::provider_not_ready,
            "provider " + key_ + " cannot make a sandbox on this node: " + probe_problem_);
    }
    auto work = [this, lease = std::move(lease)] {
        return create_now(scope_of(lease), lease.id, lease.config);
    };
    co_return co_await offload(workers_, std::move(work));
}

std::shared_ptr<SandboxHandle> BwrapProvider::handle_for_teardown(const Lease& lease) {
    // Only ids this provider mints ("bw-" and 16 hex digits) name a sandbox: anything
    // else (a path, "..") is refused rather than trusted.
    const auto& id = lease.provider_lease_id;
    if (!is_sandbox_id(id)) return nullptr;
    auto handle = std::make_shared<SandboxHandle>();
    handle->scope = scope_of(lease);
    handle->lease_id = lease.id;
    handle->workspace = runtime_dir_ / id / "workspace";
    return handle;
}

awaitable<std::vector<std::string>> BwrapProvider::stored_sandboxes() {
    auto work = [this] {
        std::vector<std::string> ids;
        std::error_code ec;
        try {  // an entry that cannot be read ends the listing, as its contract says
            for (const auto& entry : fs::directory_iterator(options_.sandboxes_dir, ec)) {
                auto name = entry.path().filename().string();
                if (is_sandbox_id(name)) ids.push_back(std::move(name));
            }
        } catch (const fs::filesystem_error& e) {
            spdlog::warn("listing {}: {}", options_.sandboxes_dir.string(), e.what());
        }
        return ids;
    };
    co_return co_await offload(workers_, std::move(work));
}

std::string BwrapProvider::describe_stored_now(const std::string& provider_lease_id) const {
    if (!is_sandbox_id(provider_lease_id)) return "not a sandbox id";
    const auto list = [](const fs::path& d) {
        std::error_code ec;
        if (!fs::exists(fs::symlink_status(d, ec))) return std::string("absent");
        std::string names;
        for (const auto& e : fs::directory_iterator(d, ec)) {
            names += (names.empty() ? "" : ", ") + e.path().filename().string();
        }
        return names.empty() ? std::string("empty") : names;
    };
    return "directory: " + list(options_.sandboxes_dir / provider_lease_id) +
           "; runtime directory: " + list(runtime_dir_ / provider_lease_id);
}

json BwrapProvider::usage(const SandboxHandle& sandbox) const {
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
    if (!state || !state->cgroup) return nullptr;
    const auto u = state->cgroup->usage();
    std::uint64_t disk = 0;
    detail::LeaseNetwork::Counts net;
    {
        std::lock_guard lock(state->mutex);  // shutdown() closes workspace_root
        disk = state->workspace_root ? detail::disk_used_bytes(state->workspace_root.get())
                                     : detail::disk_used_bytes(sandbox.workspace);
        if (state->network) net = state->network->counts();
    }
    return {{"memoryBytes", u.memory_bytes},
            {"pids", u.pids},
            {"diskBytes", disk},
            {"cpuMs", u.cpu_ms},
            {"netRxBytes", net.rx_bytes},
            {"netTxBytes", net.tx_bytes}};
}

namespace {

/// The lease's cgroup limits, as its config gives them.
detail::CgroupLimits cgroup_limits_of(const EffectiveLimits& limits) {
    detail::CgroupLimits cl;
    cl.memory_bytes = limits.memory_bytes;
    cl.pids = limits.pids;
    cl.cpu_weight = limits.cpu_weight;
    cl.cpu_quota_percent = limits.cpu_quota_percent;
    cl.io_read_bps = limits.io_read_bps;
    cl.io_write_bps = limits.io_write_bps;
    cl.io_read_iops = limits.io_read_iops;
    cl.io_write_iops = limits.io_write_iops;
    cl.io_weight = limits.io_weight;
    return cl;
}

}  // namespace

std::string BwrapProvider::make_sandbox_dir() const {
    for (int attempt = 0;; ++attempt) {
        std::string id = "bw-" + random_hex(8);
        const fs::path dir = options_.sandboxes_dir / id;
        if (::mkdir(dir.c_str(), 0700) == 0) return id;  // root's until the uid is known
        if (errno != EEXIST || attempt >= 8) {
            provider_failure("cannot create sandbox directory " + dir.string() + ": " +
                             std::strerror(errno));
        }
    }
}

void BwrapProvider::make_workspace(BwrapSandbox& sandbox, const SandboxHandle& handle, uid_t uid,
                                   const LeaseConfig& cfg) {
    if (options_.limits.enforce) {
        const fs::path image = options_.sandboxes_dir / handle.scope.provider_lease_id / "disk.img";
        detail::create_lease_disk(image, handle.workspace, cfg.limits.disk_bytes, uid, uid);
        detail::CgroupLimits cl = cgroup_limits_of(cfg.limits);
        // The lease's own loop device, which its workspace is mounted from.
        struct stat st {};
        if (::stat(handle.workspace.c_str(), &st) != 0) {
            provider_failure("cannot stat " + handle.workspace.string() + ": " +
                             std::strerror(errno));
        }
        cl.io_device = st.st_dev;
        sandbox.cgroup = cgroups_->create_lease(handle.scope.provider_lease_id, cl);
        return;
    }
    fs::create_directory(handle.workspace);
    if (::chown(handle.workspace.c_str(), uid, uid) < 0) {
        provider_failure("cannot give the workspace to uid " + std::to_string(uid) + ": " +
                         std::strerror(errno));
    }
    ::chmod(handle.workspace.c_str(), 0755);
}

std::shared_ptr<SandboxHandle> BwrapProvider::create_now(SandboxScope scope,
                                                         const std::string& lease_id,
                                                         const json& config) {
    const LeaseConfig cfg = parse_config(config);
    check_io_limits(cfg.limits);
    // Taken before anything is made, given back unless the sandbox is made.
    const detail::BudgetShare share{cfg.limits.pids, cfg.limits.open_files_total()};
    if (budget_) budget_->take(share);
    bool budget_kept = false;
    ScopeExit give_back([&] {
        if (budget_ && !budget_kept) budget_->give_back(share);
    });
    if (::access(init_path_.c_str(), X_OK) != 0) {
        provider_failure("sandboxd-init is missing: " + init_path_.string() + ": " +
                         std::strerror(errno));
    }
    const std::string id = make_sandbox_dir();
    const fs::path dir = options_.sandboxes_dir / id;
    auto handle = std::make_shared<SandboxHandle>();
    scope.provider_lease_id = id;
    handle->scope = std::move(scope);
    handle->lease_id = lease_id;
    const fs::path run_dir = runtime_dir_ / id;
    handle->workspace = run_dir / "workspace";
    handle->network = detail::to_json(cfg.network);
    handle->limits = options_.limits.enforce ? cfg.limits.to_json() : json(nullptr);

    uid_t uid = 0;
    try {
        uid = pool_.acquire();
        write_file(dir / "identity", std::to_string(uid) + "\n");
        ::chmod((dir / "identity").c_str(), 0600);
        // root:<the lease's gid> 0750: the lease's bubblewrap may enter, no other uid may.
        if (::mkdir(run_dir.c_str(), 0700) < 0 || ::chown(run_dir.c_str(), 0, uid) < 0 ||
            ::chmod(run_dir.c_str(), 0750) < 0) {
            provider_failure("cannot make " + run_dir.string() +
                             " for its lease: " + std::strerror(errno));
        }
        auto sandbox = std::make_shared<BwrapSandbox>();
        sandbox->limits = cfg.limits;
        if (budget_) {
            sandbox->budget = budget_;
            sandbox->budget_share = share;
        }
        if (options_.limits.enforce) sandbox->workspace = handle->workspace;
        make_workspace(*sandbox, *handle, uid, cfg);
        try {
            sandbox->network = network_->attach(cfg.network, cfg.limits.egress_bps);
        } catch (const std::runtime_error& e) {
            provider_failure(std::string("cannot make the lease's network: ") + e.what());
        }
        write_network_record(id, *sandbox->network);
        start_supervisor(*sandbox, id, handle->workspace, uid, cfg);
        if (budget_) sandbox->budget_held = true;
        budget_kept = true;
        // Only a sandbox that was made ends on the lane: a failed one ends here, before its
        // files are removed below.
        sandbox->lane = lane_;
        handle->state = std::move(sandbox);
    } catch (...) {
        // Nothing may be left: no process, no mount, no cgroup, no claimed id.
        if (handle->state) std::static_pointer_cast<BwrapSandbox>(handle->state)->shutdown();
        try {
            teardown_files(*handle);
        } catch (const std::exception& e) {
            spdlog::warn("sandbox {}: cleanup after a failed create: {}", id, e.what());
        }
        throw;
    }
    spdlog::debug("sandbox {} created uid={} lease={}", id, uid, lease_id);
    return handle;
}

void BwrapProvider::destroy_now(const SandboxHandle& sandbox) {
    if (!is_sandbox_id(sandbox.scope.provider_lease_id)) return;
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
    std::unique_ptr<detail::LeaseCgroup> left_behind;
    if (state) {
        state->shutdown();
    } else {
        // A sandbox of an earlier process: its supervisor may still wait for a daemon (it
        // outlives its own), and its cgroup may still hold processes.
        end_stored_supervisor(sandbox.scope.provider_lease_id);
        if (auto record = read_network_record(sandbox.scope.provider_lease_id)) {
            network_->forget(record->info);
        }
        if (cgroups_) {
            left_behind = cgroups_->find_lease(sandbox.scope.provider_lease_id);
            if (left_behind) left_behind->kill();
        }
    }
    teardown_files(sandbox);
    left_behind.reset();
    if (state) {
        state->cgroup.reset();
        state->release_budget();
    }
}

void BwrapProvider::check_io_limits(const EffectiveLimits& limits) const {
    if (!cgroups_) return;  // limits not enforced
    const std::string mode =
        cgroups_->mode() == detail::cgroup_mode::v2 ? "cgroup v2" : "cgroup v1";
    auto refuse = [](const char* key, const std::string& why) {
        const std::string field = std::string("config.limits.") + key;
        throw rpc_error(errc::invalid_params, field + ": " + why, {{"field", field}});
    };
    if (limits.io_weight && !cgroups_->io_weight()) {
        refuse("ioWeight",
               "needs cgroup v2 with the io controller (cgroup v1 has no io "
               "weight without BFQ); this node uses " +
                   mode);
    }
    const std::pair<const char*, bool> throttles[] = {
        {"ioReadBps", limits.io_read_bps.has_value()},
        {"ioWriteBps", limits.io_write_bps.has_value()},
        {"ioReadIops", limits.io_read_iops.has_value()},
        {"ioWriteIops", limits.io_write_iops.has_value()}};
    for (const auto& [key, set] : throttles) {
        if (set && !cgroups_->io_throttle()) {
            refuse(key,
                   "needs the cgroup v1 blkio hierarchy or the v2 io controller, which "
                   "this node (" +
                       mode + ") does not have");
        }
    }
}

json BwrapProvider::update_network_now(const SandboxHandle& sandbox, const json& network) {
    const detail::NetworkPolicy policy = network.is_boolean() && network.get<bool>()
                                             ? net_defaults_.egress_default
                                             : detail::parse_network_policy(network, "network");
    if (policy.mode == detail::network_mode::egress && !net_defaults_.egress) {
        throw rpc_error(errc::invalid_params,
                        "network: egress is not allowed on this node "
                        "(providers.bwrap.network.egress is false)",
                        {{"field", "network"}});
    }
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
    // Held across the change: a teardown (shutdown) waits for it, and two updates take turns.
    std::lock_guard lock(state->mutex);
    if (!state->network) {
        provider_failure("sandbox " + sandbox.scope.provider_lease_id +
                         " has no network to change (it is being torn down)");
    }
    network_->update(*state->network, policy);
    write_network_record(sandbox.scope.provider_lease_id, *state->network);
    return detail::to_json(policy);
}

json BwrapProvider::validation_of(const json& config) const {
    try {
        const LeaseConfig cfg = parse_config(config);
        return {{"ok", true},
                {"normalizedConfig",
                 {{"network", detail::to_json(cfg.network)}, {"limits", cfg.limits.to_json()}}}};
    } catch (const rpc_error& e) {
        return {{"ok", false}, {"errors", {e.what()}}};
    }
}

}  // namespace sandboxd::bwrap

namespace sandboxd {

std::unique_ptr<Provider> make_bwrap_provider(BwrapOptions options) {
    return std::make_unique<bwrap::BwrapProvider>(std::move(options));
}

}  // namespace sandboxd
