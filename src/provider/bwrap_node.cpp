/// @file bwrap_node.cpp
/// The bubblewrap provider on the node (bwrap_provider_impl.hpp): what it sets up at start
/// (the sandboxes directory's lock, the runtime directory, the generated /etc, the init's
/// copy, the start-up probe) and removes at stop, and a sandbox's files at its teardown.

#include "provider/bwrap_provider_impl.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/provider/provider.hpp>

#include "provider/bwrap_config.hpp"
#include "provider/cgroups.hpp"
#include "provider/identity_pool.hpp"
#include "provider/lease_disk.hpp"
#include "provider/node_budget.hpp"
#include "provider/seccomp_filter.hpp"
#include "provider/spawn.hpp"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace sandboxd::bwrap {

BwrapProvider::BwrapProvider(BwrapOptions options)
    : options_(std::move(options)),
      init_path_(options_.init_path.empty() ? default_init_path() : options_.init_path),
      pool_(options_.identity.host_id_first, options_.identity.host_id_count,
            options_.identity.lock_file),
      workers_(checked_threads(options_.blocking_threads)) {
    std::error_code ec;
    fs::create_directories(options_.sandboxes_dir, ec);
    ::chmod(options_.sandboxes_dir.c_str(), 0700);
    lock_dir();
    instance_ = "sandboxd-" + short_hash(fs::weakly_canonical(options_.sandboxes_dir, ec).string());
    runtime_dir_ =
        options_.runtime_dir.empty() ? fs::path("/run/sandboxd") / instance_ : options_.runtime_dir;
    // Traversable by the leases' uids (bubblewrap resolves its bind sources by path, as
    // that uid); each sandbox's own directory there is open to its uid's group only.
    fs::create_directories(runtime_dir_, ec);
    if (ec) {
        throw std::runtime_error("cannot create " + runtime_dir_.string() + ": " + ec.message());
    }
    ::chmod(runtime_dir_.c_str(), 0711);
    if (options_.runtime_dir.empty()) ::chmod(runtime_dir_.parent_path().c_str(), 0711);
    // bubblewrap runs as each lease's uid and reaches these by path.
    std::vector<fs::path> reached = {runtime_dir_, options_.bwrap_path};
    reached.insert(reached.end(), options_.ro_binds.begin(), options_.ro_binds.end());
    for (const auto& target : reached) require_reachable(target);
    // Where this directory's mounts live, for an operator (or a test) cleaning up after a
    // daemon that was killed and not restarted.
    const fs::path link = options_.sandboxes_dir / ".runtime";
    fs::remove(link, ec);
    fs::create_symlink(runtime_dir_, link, ec);
    if (options_.limits.enforce) probe_enforcement();
    start_network();
    program_ = make_program_fd();
    try {
        init_path_ = install_init();
        stage_on_tmpfs(runtime_dir_ / ".etc");
        write_etc(runtime_dir_ / ".etc" / "private", false);
        write_etc(runtime_dir_ / ".etc" / "net", true);
        reclaim_identities();
        release_stale_mounts();
    } catch (...) {
        unstage();  // no destructor runs for a failed start
        throw;
    }
    probe_problem_ = probe_sandbox();
    if (!probe_problem_.empty()) {
        spdlog::error(
            "bwrap provider: cannot make a sandbox on this node: {}; /readyz says "
            "not ready and every leaseAcquire fails until the daemon restarts",
            probe_problem_);
    }
}

BwrapProvider::~BwrapProvider() {
    lane_->close();   // a sandbox dropped from now on ends its processes where it is dropped
    workers_.join();  // a create() or destroy() still running finishes first, and every
                      // sandbox dropped before on lane_
    // What only this process used: the generated /etc, the init's copy, and the mount
    // points of sandboxes already unmounted (their records stay in sandboxes_dir for a
    // later teardown). A directory still in use is left alone.
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(runtime_dir_, ec)) {
        const auto name = entry.path().filename().string();
        if (is_sandbox_id(name)) {
            ::rmdir((entry.path() / "workspace").c_str());
            ::rmdir(entry.path().c_str());
        }
    }
    unstage();
    ::rmdir(runtime_dir_.c_str());
}

void BwrapProvider::start_network() {
    const auto& n = options_.network;
    net_defaults_.egress = n.egress;
    json defaults = {{"mode", "egress"}};
    for (const char* key : {"allow", "deny"}) {
        if (n.defaults.contains(key)) defaults[key] = n.defaults.at(key);
    }
    try {
        net_defaults_.egress_default =
            detail::parse_network_policy(defaults, "providers.bwrap.network.defaults");
    } catch (const std::exception& e) {
        throw std::runtime_error(std::string("config: ") + e.what());
    }
    detail::NodeNetworkOptions o;
    o.egress = n.egress;
    o.pool = boost::asio::ip::make_network_v4(n.pool);
    o.uplink = n.uplink;
    auto cidr = [](const std::string& text) {
        return text.find('/') == std::string::npos
                   ? boost::asio::ip::make_network_v4(boost::asio::ip::make_address_v4(text), 32)
                   : boost::asio::ip::make_network_v4(text);
    };
    for (const auto& text : n.deny) o.deny.push_back(cidr(text));
    for (const auto& text : n.open) o.open.push_back(cidr(text));
    for (const auto& text : n.dns) {
        if (auto endpoint = parse_dns_server(text)) o.dns.push_back(*endpoint);
    }
    o.tag = instance_.substr(instance_.size() - 6);  // of the sandboxes directory's hash
    // The veths of the stored leases stay for their re-adoption (or their teardown).
    std::vector<std::uint32_t> kept;
    std::error_code ec;
    if (n.egress) {
        for (const auto& entry : fs::directory_iterator(options_.sandboxes_dir, ec)) {
            const auto id = entry.path().filename().string();
            if (!is_sandbox_id(id)) continue;
            if (auto record = read_network_record(id); record && record->info.index != 0) {
                kept.push_back(record->info.index);
            }
        }
    }
    network_ = detail::NodeNetwork::start(std::move(o), kept);
}

void BwrapProvider::write_network_record(const std::string& id,
                                         const detail::LeaseNetwork& network) const {
    const json record = {{"index", network.info().index},
                         {"address", network.info().address.to_string()},
                         {"interface", network.info().host_interface},
                         {"policy", detail::to_json(network.policy())}};
    const fs::path path = options_.sandboxes_dir / id / "network";
    const fs::path temporary = options_.sandboxes_dir / id / "network.new";
    write_file(temporary, record.dump() + "\n");
    fs::rename(temporary, path);
}

std::optional<BwrapProvider::NetworkRecord> BwrapProvider::read_network_record(
    const std::string& id) const {
    std::ifstream in(options_.sandboxes_dir / id / "network", std::ios::binary);
    if (!in) return std::nullopt;
    try {
        const json record = json::parse(in);
        NetworkRecord out;
        out.info.index = record.at("index").get<std::uint32_t>();
        out.info.address =
            boost::asio::ip::make_address_v4(record.at("address").get<std::string>());
        out.info.host_interface = record.at("interface").get<std::string>();
        out.policy = detail::parse_network_policy(record.at("policy"), "network");
        return out;
    } catch (const std::exception& e) {
        spdlog::warn(
            "sandbox {}: its network record cannot be read ({}): it is treated as "
            "having none",
            id, e.what());
        return std::nullopt;
    }
}

void BwrapProvider::lock_dir() {
    const fs::path lock_path = options_.sandboxes_dir / ".lock";
    dir_lock_.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!dir_lock_) {
        throw std::runtime_error("cannot open " + lock_path.string() + ": " + std::strerror(errno));
    }
    if (::flock(dir_lock_.get(), LOCK_EX | LOCK_NB) < 0) {
        throw std::runtime_error("another live sandboxd process uses " +
                                 options_.sandboxes_dir.string());
    }
}

std::string BwrapProvider::probe_sandbox() {
    uid_t uid = 0;
    try {
        uid = pool_.acquire();
    } catch (const std::exception& e) {
        return e.what();
    }
    const ScopeExit release([&] { pool_.release(uid); });
    std::unique_ptr<detail::LeaseNetwork> network;
    try {
        network = network_->attach(detail::NetworkPolicy{});
    } catch (const std::exception& e) {
        return e.what();
    }
    auto argv = bwrap_argv(parse_config(json::object()), 0, network->netns() < 0);
    // The lease's command line up to "--", then true instead of the supervisor.
    argv.erase(std::find(argv.rbegin(), argv.rend(), std::string("--")).base(), argv.end());
    argv.emplace_back("/usr/bin/true");
    try {
        unique_fd workspace = open_path(runtime_dir_ / ".etc" / "private", "the probe's workspace");
        unique_fd etc = open_path(runtime_dir_ / ".etc" / "private", "the sandbox /etc");
        unique_fd init = open_path(init_path_, "sandboxd-init");
        detail::Pipe errors = detail::make_pipe(detail::daemon_end::read);
        detail::SpawnRequest request;
        request.argv = std::move(argv);
        request.envp = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"};
        request.fds = {-1,        -1,        errors.write_end.get(), -1, -1, workspace.get(),
                       etc.get(), init.get()};
        request.run_as = std::make_pair(uid, static_cast<gid_t>(uid));
        request.netns = network->netns();
        auto child = detail::spawn_process(request, "bubblewrap");
        errors.write_end.reset();
        pollfd p{child.pidfd.get(), POLLIN, 0};
        if (::poll(&p, 1, 10000) != 1) {
            ::kill(child.pid, SIGKILL);
            ::waitpid(child.pid, nullptr, 0);
            return "bubblewrap did not exit within 10 s";
        }
        int status = 0;
        ::waitpid(child.pid, &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {};
        char text[2048];
        const ssize_t got = ::read(errors.read_end.get(), text, sizeof text - 1);
        std::string why = got > 0 ? std::string(text, static_cast<std::size_t>(got)) : "";
        while (!why.empty() && (why.back() == '\n' || why.back() == '\r')) why.pop_back();
        return "bubblewrap " +
               (WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                  : "died of signal " + std::to_string(WTERMSIG(status))) +
               (why.empty() ? std::string() : ": " + why);
    } catch (const std::exception& e) {
        return e.what();
    }
}

void BwrapProvider::probe_enforcement() {
    std::error_code ec;
    cgroups_ = detail::probe_cgroups(instance_, options_.cgroup_root);
    if (cgroups_->mode() == detail::cgroup_mode::none) {
        throw std::runtime_error(
            "providers.bwrap.limits.enforce: no cgroup mechanism can enforce the limits (" +
            cgroups_->describe() +
            "); on a systemd host give the unit Delegate=yes, or set "
            "providers.bwrap.limits.enforce: false to run without limits");
    }
    if (::access("/dev/loop-control", R_OK | W_OK) != 0) {
        throw std::runtime_error(
            "providers.bwrap.limits.enforce: workspace disks need loop devices, and "
            "/dev/loop-control is not usable: " +
            std::string(std::strerror(errno)) + " (or set providers.bwrap.limits.enforce: false)");
    }
    if (::access("/usr/sbin/mkfs.ext4", X_OK) != 0 && ::access("/sbin/mkfs.ext4", X_OK) != 0) {
        throw std::runtime_error(
            "providers.bwrap.limits.enforce: workspace disks need mkfs.ext4 (Debian "
            "package e2fsprogs)");
    }
    // The node's defaults must be usable by a lease that asks for nothing.
    try {
        check_io_limits(parse_config(nullptr).limits);
    } catch (const rpc_error& e) {
        throw std::runtime_error("providers.bwrap.limits.defaults: " + std::string(e.what()));
    }
    budget_ = detail::NodeBudget::read_host(options_.proc_sys, options_.limits.overcommit);
    spdlog::info("bwrap provider: node budgets: {}", budget_->describe());
    // A sandbox with a record is the registry's to judge: re-adopted (resume) or destroyed.
    // With adoption off, whatever an earlier process left is killed, as before issue 47.
    const auto removed = cgroups_->remove_orphans([this](const std::string& name) {
        std::error_code ignored;
        return options_.adopt_timeout_ms > 0 && is_sandbox_id(name) &&
               fs::is_directory(options_.sandboxes_dir / name, ignored);
    });
    spdlog::info(
        "bwrap provider: limits enforced with {}; workspace disks: loop-mounted "
        "ext4{}",
        cgroups_->describe(),
        removed > 0 ? "; killed and removed " + std::to_string(removed) +
                          " orphaned sandbox cgroup(s) of an earlier process"
                    : std::string());
}

void BwrapProvider::require_reachable(const fs::path& target) {
    for (fs::path p = target.parent_path();; p = p.parent_path()) {
        struct stat st {};
        if (::stat(p.c_str(), &st) == 0 && (st.st_mode & S_IXOTH) == 0) {
            char mode[8];
            std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
            throw std::runtime_error("providers.bwrap: the sandboxes' uids cannot reach " +
                                     target.string() + ": " + p.string() +
                                     " is not searchable by others (mode " + mode +
                                     "; every directory above it needs o+x)");
        }
        if (p == p.root_path() || p.empty()) break;
    }
}

fs::path BwrapProvider::install_init() const {
    bool reachable = true;
    for (fs::path p = init_path_; reachable && !p.empty(); p = p.parent_path()) {
        struct stat st {};
        reachable = ::stat(p.c_str(), &st) == 0 && st.st_uid == 0 && (st.st_mode & S_IXOTH) != 0 &&
                    (st.st_mode & S_IWOTH) == 0;
        if (p == p.root_path()) break;
    }
    if (reachable) return init_path_;
    const fs::path dir = runtime_dir_ / ".init";
    fs::path target = dir / "sandboxd-init";
    std::error_code ec;
    stage_on_tmpfs(dir);
    const fs::path tmp = dir / "sandboxd-init.tmp";
    fs::copy_file(init_path_, tmp, fs::copy_options::overwrite_existing, ec);
    if (ec) {
        throw std::runtime_error("cannot copy sandboxd-init from " + init_path_.string() + ": " +
                                 ec.message());
    }
    ::chmod(tmp.c_str(), 0755);
    fs::rename(tmp, target);
    return target;
}

void BwrapProvider::stage_on_tmpfs(const fs::path& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    while (::umount2(dir.c_str(), MNT_DETACH) == 0) {
    }
    fs::remove_all(dir, ec);
    fs::create_directories(dir, ec);
    if (::mount("sandboxd", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=256m") !=
        0) {
        throw std::runtime_error("cannot mount a tmpfs at " + dir.string() + ": " +
                                 std::strerror(errno));
    }
}

unique_fd BwrapProvider::make_program_fd() {
    // Sealed: nothing may change the filter that every later sandbox reads.
    unique_fd fd = sealed_memfd("sandboxd-seccomp", detail::build_seccomp_filter());
    if (!fd) {
        throw std::runtime_error(std::string("cannot hold the syscall filter: ") +
                                 std::strerror(errno));
    }
    return fd;
}

void BwrapProvider::write_etc(const fs::path& dir, bool network) const {
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir);
    fs::permissions(dir.parent_path(),
                    fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
    fs::permissions(dir, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec);
    for (const auto& entry : options_.etc_files) {
        const fs::path source = options_.etc_source / entry;
        if (!fs::exists(fs::symlink_status(source, ec))) continue;
        fs::create_directories((dir / entry).parent_path(), ec);
        fs::copy(source, dir / entry,
                 fs::copy_options::recursive | fs::copy_options::copy_symlinks |
                     fs::copy_options::overwrite_existing,
                 ec);
        if (ec)
            spdlog::warn("bwrap provider: cannot copy {} into the sandbox /etc: {}",
                         source.string(), ec.message());
    }
    const auto uid = options_.identity.inside_uid;
    const auto gid = options_.identity.inside_gid;
    std::string passwd = "root:x:0:0:root:/workspace:/bin/sh\n";
    std::string group = "root:x:0:\n";
    if (uid != 0)
        passwd += "sandbox:x:" + std::to_string(uid) + ":" + std::to_string(gid) +
                  ":sandbox:/workspace:/bin/sh\n";
    if (gid != 0) group += "sandbox:x:" + std::to_string(gid) + ":\n";
    passwd += "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
    group += "nogroup:x:65534:\n";
    write_file(dir / "passwd", passwd);
    write_file(dir / "group", group);
    write_file(dir / "hostname", "sandbox\n");
    write_file(dir / "hosts",
               "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost "
               "ip6-loopback\n");
    write_file(dir / "nsswitch.conf",
               "passwd: files\ngroup: files\nshadow: files\n"
               "hosts: files dns\nnetworks: files\nprotocols: files\n"
               "services: files\n");
    // Every lease's resolver is its gateway (lease_network.hpp).
    if (network && network_) write_file(dir / "resolv.conf", network_->resolv_conf());
    // Readable by the sandbox's uid: world-readable files, traversable directories.
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        std::error_code ignored;
        if (it->is_symlink(ignored)) continue;
        fs::permissions(it->path(), it->is_directory(ignored) ? fs::perms(0755) : fs::perms(0644),
                        ignored);
    }
}

void BwrapProvider::reclaim_identities() {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(options_.sandboxes_dir, ec)) {
        const auto name = entry.path().filename().string();
        if (!is_sandbox_id(name)) continue;
        const auto uid = read_identity(entry.path());
        if (uid && !pool_.claim_existing(*uid)) {
            spdlog::warn(
                "sandbox {}: its uid {} is held by another process or outside the "
                "configured range",
                name, *uid);
        }
    }
}

void BwrapProvider::release_stale_mounts() const {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(runtime_dir_, ec)) {
        const auto name = entry.path().filename().string();
        if (!is_sandbox_id(name)) continue;
        // A recorded sandbox's mount stays: it is re-adopted, or its teardown unmounts it.
        if (options_.adopt_timeout_ms > 0 && fs::is_directory(options_.sandboxes_dir / name, ec)) {
            continue;
        }
        const fs::path ws = entry.path() / "workspace";
        if (::umount2(ws.c_str(), MNT_DETACH) == 0) {
            spdlog::info("sandbox {}: unmounted the workspace an earlier process left",
                         entry.path().filename().string());
        }
    }
}

void BwrapProvider::teardown_files(const SandboxHandle& sandbox) {
    const fs::path dir = options_.sandboxes_dir / sandbox.scope.provider_lease_id;
    const fs::path run_dir = runtime_dir_ / sandbox.scope.provider_lease_id;
    const fs::path workspace = run_dir / "workspace";
    std::error_code ec;
    const bool have_dir = fs::exists(fs::symlink_status(dir, ec));
    const bool have_run_dir = fs::exists(fs::symlink_status(run_dir, ec));
    spdlog::debug("sandbox {} teardown: directory {}, runtime directory {}",
                  sandbox.scope.provider_lease_id, have_dir ? "present" : "absent",
                  have_run_dir ? "present" : "absent");
    if (!have_dir && !have_run_dir) return;
    const auto uid = have_dir ? read_identity(dir) : std::nullopt;
    detail::destroy_lease_disk(dir / "disk.img", workspace);
    if (fs::exists(fs::symlink_status(workspace, ec))) {
        // No disk of its own (limits not enforced): a bounded walk, off this process.
        detail::remove_tree_bounded(workspace);
    }
    for (const auto& d : {run_dir, dir}) {
        // identity, secret and network record (sandboxes_dir), the adoption socket (runtime
        // directory).
        for (const char* file :
             {"identity", "secret", "network", "network.new", "supervisor.sock"}) {
            fs::remove(d / file, ec);
        }
        if (::rmdir(d.c_str()) < 0 && errno != ENOENT) {
            provider_failure("cannot remove sandbox " + sandbox.scope.provider_lease_id + ": " +
                             d.string() + ": " + std::strerror(errno));
        }
    }
    if (uid) pool_.release(*uid);
    spdlog::debug("sandbox {} teardown: files removed", sandbox.scope.provider_lease_id);
}

}  // namespace sandboxd::bwrap
