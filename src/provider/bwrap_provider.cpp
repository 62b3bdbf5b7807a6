/// @file bwrap_provider.cpp
/// The built-in bubblewrap provider: a sandbox is a workspace directory on the host; every
/// process runs in fresh namespaces under sandboxd-init (see provider.hpp for the fds).

#include <sandboxd/errors.hpp>
#include <sandboxd/provider.hpp>

#include "provider/spawn.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string_view>
#include <system_error>

#ifndef SANDBOXD_LIBEXECDIR
#define SANDBOXD_LIBEXECDIR "/usr/libexec/sandboxd"  // NOLINT(cppcoreguidelines-macro-usage)
#endif

namespace sandboxd {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view sandbox_path =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
constexpr const char* init_in_sandbox = "/.sandboxd/init";

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

bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

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

class BwrapProvider final : public Provider {
public:
    explicit BwrapProvider(BwrapOptions options)
        : options_(std::move(options)),
          init_path_(options_.init_path.empty() ? default_init_path() : options_.init_path) {}

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }

    std::shared_ptr<SandboxHandle> create(SandboxScope scope, const std::string& lease_id,
                                          const nlohmann::json& config) override {
        bool network = check_network(parse_config(config));

        std::error_code ec;
        fs::create_directories(options_.sandboxes_dir, ec);
        if (ec) {
            provider_failure("cannot create " + options_.sandboxes_dir.string() + ": " +
                             ec.message());
        }
        for (int attempt = 0;; ++attempt) {
            std::string id = "bw-" + random_hex(8);
            fs::path workspace = options_.sandboxes_dir / id;
            if (::mkdir(workspace.c_str(), 0700) == 0) {
                auto handle = std::make_shared<SandboxHandle>();
                scope.provider_lease_id = id;
                handle->scope = std::move(scope);
                handle->lease_id = lease_id;
                handle->workspace = std::move(workspace);
                handle->network = network;
                return handle;
            }
            if (errno != EEXIST || attempt >= 8) {
                provider_failure("cannot create workspace " + workspace.string() + ": " +
                                 std::strerror(errno));
            }
        }
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const SandboxScope& scope,
                                                       const std::string& lease_id) override {
        // Only ids this provider mints ("bw-" and 16 hex digits) name a workspace: anything
        // else (a path, "..") is refused rather than trusted.
        const auto& id = scope.provider_lease_id;
        if (id.size() != 19 || id.rfind("bw-", 0) != 0 ||
            id.find_first_not_of("0123456789abcdef", 3) != std::string::npos) {
            return nullptr;
        }
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope;
        handle->lease_id = lease_id;
        handle->workspace = options_.sandboxes_dir / id;
        return handle;
    }

    void destroy(const SandboxHandle& sandbox) override {
        if (sandbox.workspace.empty()) return;
        std::error_code ec;
        fs::remove_all(sandbox.workspace, ec);
        if (ec && ec != std::errc::no_such_file_or_directory) {
            // A sandbox may leave directories without write permission: open them up, retry.
            make_writable(sandbox.workspace);
            ec.clear();
            fs::remove_all(sandbox.workspace, ec);
        }
        if (ec && ec != std::errc::no_such_file_or_directory) {
            provider_failure("cannot remove sandbox " + sandbox.scope.provider_lease_id + ": " +
                             ec.message());
        }
    }

    SpawnedProcess spawn(const SandboxHandle& sandbox, const ExecSpec& spec) override {
        validate_spec(spec);
        std::error_code ec;
        if (!fs::is_directory(sandbox.workspace, ec)) {
            provider_failure("sandbox " + sandbox.scope.provider_lease_id +
                             " is gone: its workspace no longer exists");
        }
        if (::access(init_path_.c_str(), X_OK) != 0) {
            provider_failure("sandboxd-init is missing: " + init_path_.string() + ": " +
                             std::strerror(errno));
        }

        detail::SpawnRequest request;
        request.argv = bwrap_argv(sandbox, spec);
        request.envp = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"};

        SpawnedProcess out;
        detail::Pty pty;
        detail::Pipe stdin_pipe, stdout_pipe, stderr_pipe;
        if (spec.pty) {
            pty = detail::open_pty(*spec.pty);
            request.fds[0] = request.fds[1] = request.fds[2] = pty.slave.get();
            request.controlling_tty = pty.slave.get();
        } else {
            if (spec.stdin_attached) {
                stdin_pipe = detail::make_pipe(detail::daemon_end::write);
                request.fds[0] = stdin_pipe.read_end.get();
            }
            stdout_pipe = detail::make_pipe(detail::daemon_end::read);
            stderr_pipe = detail::make_pipe(detail::daemon_end::read);
            ::fcntl(stdout_pipe.read_end.get(), F_SETPIPE_SZ, 1 << 20);  // fewer, larger reads
            request.fds[1] = stdout_pipe.write_end.get();
            request.fds[2] = stderr_pipe.write_end.get();
        }
        detail::Pipe status_pipe = detail::make_pipe(detail::daemon_end::read);
        detail::Pipe control_pipe = detail::make_pipe(detail::daemon_end::write);
        request.fds[3] = status_pipe.write_end.get();
        request.fds[4] = control_pipe.read_end.get();

        detail::SpawnResult child = detail::spawn_process(request, "bubblewrap");
        out.pid = child.pid;
        out.pidfd = std::move(child.pidfd);
        if (spec.pty) {
            int dup = ::fcntl(pty.master.get(), F_DUPFD_CLOEXEC, 0);
            if (dup < 0) {
                // Nothing may be left running: the caller never sees this pid.
                int err = errno;
                ::kill(out.pid, SIGKILL);
                while (::waitpid(out.pid, nullptr, 0) < 0 && errno == EINTR) {
                }
                provider_failure(std::string("cannot set up a pty: ") + std::strerror(err));
            }
            out.stdout_fd.reset(dup);
            out.stdin_fd = std::move(pty.master);
        } else {
            out.stdin_fd = std::move(stdin_pipe.write_end);
            out.stdout_fd = std::move(stdout_pipe.read_end);
            out.stderr_fd = std::move(stderr_pipe.read_end);
        }
        out.status_fd = std::move(status_pipe.read_end);
        out.control_fd = std::move(control_pipe.write_end);
        return out;  // the child's ends are closed with their holders here
    }

private:
    static bool parse_config(const nlohmann::json& config) {
        if (config.is_null()) return false;
        if (!config.is_object()) {
            throw rpc_error(errc::invalid_params, "config: must be an object");
        }
        bool network = false;
        for (const auto& [name, value] : config.items()) {
            if (name != "network") {
                throw rpc_error(errc::invalid_params, "config." + name + ": unknown key");
            }
            if (!value.is_boolean()) {
                throw rpc_error(errc::invalid_params, "config.network: must be a boolean");
            }
            network = value.get<bool>();
        }
        return network;
    }

    bool check_network(bool network) const {
        if (network && !options_.allow_network) {
            throw rpc_error(errc::invalid_params, "config.network: not allowed on this node");
        }
        return network;
    }

    static void make_writable(const fs::path& root) {
        std::error_code ec;
        fs::permissions(root, fs::perms::owner_all, fs::perm_options::add, ec);
        for (fs::recursive_directory_iterator it(root, ec), end; !ec && it != end;
             it.increment(ec)) {
            std::error_code ignored;
            if (it->is_directory(ignored) && !it->is_symlink(ignored)) {
                fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add, ignored);
            }
        }
    }

    std::vector<std::string> bwrap_argv(const SandboxHandle& sandbox, const ExecSpec& spec) const {
        std::vector<std::string> a = {
            options_.bwrap_path.string(),
            "--die-with-parent",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
        };
        if (!sandbox.network) a.emplace_back("--unshare-net");
        for (const char* arg : {"--as-pid-1", "--cap-drop", "ALL", "--clearenv"}) {
            a.emplace_back(arg);
        }
        auto setenv = [&a](const std::string& name, const std::string& value) {
            a.insert(a.end(), {"--setenv", name, value});
        };
        setenv("PATH", std::string(sandbox_path));
        setenv("HOME", "/workspace");
        setenv("TERM", spec.pty ? "xterm-256color" : "dumb");
        setenv("LANG", "C.UTF-8");
        for (const auto& [name, value] : spec.env) setenv(name, value);

        std::error_code ec;
        for (const auto& dir : options_.ro_binds) {
            if (fs::exists(dir, ec)) a.insert(a.end(), {"--ro-bind", dir, dir});
        }
        // The merged-/usr links of the host, or the real directories where there are some.
        for (const char* dir : {"/bin", "/sbin", "/lib", "/lib64"}) {
            auto status = fs::symlink_status(dir, ec);
            if (fs::is_symlink(status)) {
                fs::path target = fs::read_symlink(dir, ec);
                if (!ec) a.insert(a.end(), {"--symlink", target.string(), dir});
            } else if (fs::is_directory(status)) {
                a.insert(a.end(), {"--ro-bind", dir, dir});
            }
        }
        // bwrap covers /proc/sys only when access(W_OK) says it is writable, which it never
        // says for that directory; yet the command, uid 0 without a user namespace, could
        // write most host sysctls (e.g. kernel.core_pattern: root on the host). Cover it.
        a.insert(a.end(), {"--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev",
                           "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"});
        a.insert(a.end(), {"--bind", sandbox.workspace.string(), "/workspace"});
        a.insert(a.end(), {"--ro-bind", init_path_.string(), init_in_sandbox});
        a.insert(a.end(), {"--chdir", sandbox_cwd(spec.cwd), "--hostname", "sandbox"});
        a.insert(a.end(), {"--", init_in_sandbox});
        if (spec.pty) a.emplace_back("--pty");
        if (spec.drain_grace_ms) {
            a.emplace_back("--grace-ms");
            a.emplace_back(std::to_string(*spec.drain_grace_ms));
        }
        a.emplace_back("--");
        a.insert(a.end(), spec.argv.begin(), spec.argv.end());
        return a;
    }

    const std::string key_ = "bwrap";
    const std::string plugin_id_ = "builtin";
    const BwrapOptions options_;
    const fs::path init_path_;
};

}  // namespace

std::unique_ptr<Provider> make_bwrap_provider(BwrapOptions options) {
    return std::make_unique<BwrapProvider>(std::move(options));
}

}  // namespace sandboxd
