/// @file bwrap_adopt.cpp
/// The bubblewrap provider's sandboxes outliving their daemon (issue 47;
/// bwrap_provider_impl.hpp): the adoption socket and secret a supervisor is started with, and
/// the next process's re-adoption of a running sandbox through them (the protocol is in
/// src/init/supervisor_protocol.hpp, "Adoption").

#include "provider/bwrap_provider_impl.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/provider.hpp>

#include "init/supervisor_protocol.hpp"
#include "provider/cgroups.hpp"
#include "provider/node_budget.hpp"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

namespace sandboxd::bwrap {

namespace {

constexpr const char* socket_name = "supervisor.sock";
constexpr const char* secret_name = "secret";
/// How long a supervisor has to answer an adoption, ms (it answers at once unless it is busy
/// starting a channel).
constexpr int adopt_answer_ms = 5000;

sockaddr_un socket_address(const fs::path& path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string text = path.string();
    if (text.size() >= sizeof addr.sun_path) {
        provider_failure("the adoption socket's path is too long for AF_UNIX (" +
                         std::to_string(text.size()) + " bytes, at most " +
                         std::to_string(sizeof addr.sun_path - 1) + "): " + text +
                         " (shorten providers.bwrap's runtime directory)");
    }
    std::memcpy(addr.sun_path, text.c_str(), text.size() + 1);
    return addr;
}

}  // namespace

BwrapProvider::AdoptionEnds BwrapProvider::prepare_adoption(const std::string& id) const {
    AdoptionEnds out;
    std::string secret(proto::secret_size, '\0');
    std::size_t done = 0;
    while (done < secret.size()) {
        const ssize_t n = ::getrandom(secret.data() + done, secret.size() - done, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) provider_failure(std::string("cannot make a secret: ") + std::strerror(errno));
        done += static_cast<std::size_t>(n);
    }
    // The daemon's copy, root's alone, where no sandbox reaches.
    const fs::path file = options_.sandboxes_dir / id / secret_name;
    {
        unique_fd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
        if (!fd || ::write(fd.get(), secret.data(), secret.size()) !=
                       static_cast<ssize_t>(secret.size())) {
            provider_failure("cannot write " + file.string() + ": " + std::strerror(errno));
        }
    }
    out.secret = sealed_memfd("sandboxd-secret", secret);
    if (!out.secret) {
        provider_failure(std::string("cannot pass the secret to the sandbox: ") +
                         std::strerror(errno));
    }
    const fs::path path = runtime_dir_ / id / socket_name;
    const sockaddr_un addr = socket_address(path);
    out.listen.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!out.listen) {
        provider_failure(std::string("cannot make the adoption socket: ") + std::strerror(errno));
    }
    ::unlink(path.c_str());
    if (::bind(out.listen.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
        ::chmod(path.c_str(), 0600) != 0) {
        provider_failure("cannot bind the adoption socket " + path.string() + ": " +
                         std::strerror(errno));
    }
    return out;
}

BwrapProvider::Reached BwrapProvider::reach_supervisor(const std::string& id,
                                                       std::uint32_t flags) const {
    const fs::path dir = options_.sandboxes_dir / id;
    const auto uid = read_identity(dir);
    if (!uid) provider_failure("sandbox " + id + " has no identity record");
    proto::Adopt adopt;
    adopt.flags = flags;
    adopt.min_version = proto::oldest_adoptable;
    adopt.max_version = proto::version;
    {
        std::ifstream in(dir / secret_name, std::ios::binary);
        in.read(reinterpret_cast<char*>(adopt.secret), sizeof adopt.secret);
        if (in.gcount() != static_cast<std::streamsize>(sizeof adopt.secret)) {
            provider_failure("sandbox " + id +
                             " has no adoption secret (made by a daemon whose sandboxes did "
                             "not outlive it)");
        }
    }
    const fs::path path = runtime_dir_ / id / socket_name;
    const sockaddr_un addr = socket_address(path);
    Reached out;
    out.socket.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!out.socket) provider_failure(std::string("socket: ") + std::strerror(errno));
    const timeval tv{adopt_answer_ms / 1000, (adopt_answer_ms % 1000) * 1000};
    ::setsockopt(out.socket.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(out.socket.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(out.socket.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
        provider_failure("sandbox " + id + ": no supervisor answers at " + path.string() + " (" +
                         std::strerror(errno) + ")");
    }
    // The listener is the supervisor itself (it called listen()): its uid must be the lease's.
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(out.socket.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        cred.uid != *uid) {
        provider_failure("sandbox " + id + ": the process at " + path.string() +
                         " is not the lease's supervisor (uid " + std::to_string(cred.uid) +
                         ", the lease's is " + std::to_string(*uid) + ")");
    }
    if (::send(out.socket.get(), &adopt, sizeof adopt, MSG_NOSIGNAL) !=
        static_cast<ssize_t>(sizeof adopt)) {
        provider_failure("sandbox " + id +
                         ": cannot reach its supervisor: " + std::strerror(errno));
    }
    std::vector<unique_fd> fds;
    bool truncated = false;
    const ssize_t got =
        recv_with_fds(out.socket.get(), &out.welcome, sizeof out.welcome, fds, truncated, 0);
    if (!fds.empty()) out.pidfd = std::move(fds[0]);
    if (fds.size() > 1 && out.welcome.version >= proto::workspace_welcome_version) {
        out.workspace = std::move(fds[1]);
    }
    if (got != static_cast<ssize_t>(sizeof out.welcome) ||
        out.welcome.magic != proto::welcome_magic) {
        provider_failure("sandbox " + id + ": its supervisor did not welcome this daemon (" +
                         (got < 0 ? std::string(std::strerror(static_cast<int>(-got)))
                                  : "a reply of " + std::to_string(got) + " bytes") +
                         "; a wrong secret gets no answer)");
    }
    if (out.welcome.error == 0 &&
        (!out.pidfd || detail::pid_of_pidfd(out.pidfd.get()) != cred.pid)) {
        provider_failure("sandbox " + id +
                         ": the welcome's pidfd does not name the process that listens");
    }
    return out;
}

std::unique_ptr<detail::LeaseNetwork> BwrapProvider::readopt_network(
    const std::string& id, const std::string& lease_id, const std::optional<NetworkRecord>& record,
    const detail::NetworkPolicy& policy) noexcept {
    try {
        return network_->readopt(record ? record->info : detail::LeaseNetworkInfo{}, policy);
    } catch (const std::exception& e) {
        // Its policy cannot be applied again: it fails closed (the chains went with the table
        // at start, so nothing it sends is forwarded), and the log says so.
        spdlog::error(
            "sandbox {} (lease {}): its network cannot be restored: {}; its veth is "
            "removed (it keeps loopback only)",
            id, lease_id, e.what());
        if (record) network_->forget(record->info);
        return nullptr;
    }
}

std::shared_ptr<SandboxHandle> BwrapProvider::adopt_now(const Lease& lease) {
    const std::string& id = lease.provider_lease_id;
    if (!is_sandbox_id(id)) {
        throw rpc_error(errc::sandbox_not_cached,
                        "lease " + lease.id + ": " + id + " is not a sandbox of this provider");
    }
    Reached reached;
    try {
        reached = reach_supervisor(id, 0);
    } catch (const rpc_error& e) {
        throw rpc_error(errc::sandbox_not_cached, std::string("cannot re-adopt: ") + e.what());
    }
    if (reached.welcome.error != 0) {
        // An incompatible supervisor: it cannot be served, so it is ended (the lease is
        // orphaned by the caller and torn down).
        spdlog::error(
            "sandbox {} (lease {}): its supervisor speaks version {}, and this daemon serves "
            "{}..{}: the sandbox is torn down",
            id, lease.id, reached.welcome.version, proto::oldest_adoptable, proto::version);
        end_stored_supervisor(id);
        throw rpc_error(errc::sandbox_not_cached,
                        "sandbox " + id + ": its supervisor speaks version " +
                            std::to_string(reached.welcome.version) +
                            ", which this daemon cannot serve; it was torn down");
    }
    const LeaseConfig cfg = parse_config(lease.config);
    auto handle = std::make_shared<SandboxHandle>();
    handle->scope = scope_of(lease);
    handle->lease_id = lease.id;
    const fs::path run_dir = runtime_dir_ / id;
    handle->workspace = run_dir / "workspace";
    // The policy as it last was (leaseUpdateNetwork changes it), else as the lease asked.
    auto record = read_network_record(id);
    const detail::NetworkPolicy policy = record && record->policy ? *record->policy : cfg.network;
    handle->network = detail::to_json(policy);
    handle->limits = options_.limits.enforce ? cfg.limits.to_json() : json(nullptr);

    std::unique_ptr<detail::LeaseCgroup> cgroup;
    if (options_.limits.enforce) {
        cgroup = cgroups_ ? cgroups_->find_lease(id) : nullptr;
        if (!cgroup) {
            throw rpc_error(errc::sandbox_not_cached,
                            "sandbox " + id + ": its cgroup is gone; it cannot be re-adopted");
        }
        cgroup->keep();  // a failure below must not kill it from here
    }
    // What the lease takes from the node's budgets, as when it was made.
    const detail::BudgetShare share{cfg.limits.pids, cfg.limits.open_files_total()};
    if (budget_) budget_->take(share);
    // Nothing below throws: from here the sandbox is this process's, to end like one it made.
    auto sandbox = std::make_shared<BwrapSandbox>();
    sandbox->limits = cfg.limits;
    if (options_.limits.enforce) {
        sandbox->workspace = handle->workspace;
        sandbox->cgroup = cgroups_->find_lease(id);
        sandbox->workspace_root = std::move(reached.workspace);
    }
    cgroup.reset();  // kept: the handle found again above is the one that ends it
    sandbox->network = readopt_network(id, lease.id, record, policy);
    const timeval tv{supervisor_timeout_ms / 1000, 0};
    ::setsockopt(reached.socket.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(reached.socket.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    ::fcntl(reached.pidfd.get(), F_SETFL, O_NONBLOCK);
    sandbox->socket = std::move(reached.socket);
    sandbox->supervisor_pidfd = std::move(reached.pidfd);
    sandbox->channel_prefix = "ch-" + random_hex(3) + "-";
    sandbox->supervisor_version = reached.welcome.version;
    if (reached.welcome.version >= proto::kept_channels_version) {
        take_back_kept(*sandbox, sandbox->socket.get(), id);
    }
    if (budget_) {
        sandbox->budget = budget_;
        sandbox->budget_share = share;
        sandbox->budget_held = true;
    }
    sandbox->lane = lane_;
    handle->state = std::move(sandbox);
    spdlog::info("sandbox {} (lease {}) re-adopted: its supervisor outlived the last daemon", id,
                 lease.id);
    return handle;
}

bool BwrapProvider::end_stored_supervisor(const std::string& id) const noexcept {
    try {
        Reached reached = reach_supervisor(id, proto::adopt_end);
        if (reached.pidfd) {
            // It exits after its answer; wait (bounded) so that its processes are gone.
            pollfd p{reached.pidfd.get(), POLLIN, 0};
            ::poll(&p, 1, BwrapSandbox::bwrap_exit_grace_ms);
        }
        return true;
    } catch (const std::exception& e) {
        spdlog::debug("sandbox {}: no supervisor to end: {}", id, e.what());
        return false;
    }
}

}  // namespace sandboxd::bwrap
