/// @file bwrap_supervisor.cpp
/// The bubblewrap provider's link to each sandbox's supervisor (bwrap_provider_impl.hpp):
/// bubblewrap's command line and start, and a channel's request (its descriptors, its
/// cgroup, its payload) sent to the supervisor and answered with the channel init's pidfd.

#include "provider/bwrap_provider_impl.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/net.hpp>
#include <sandboxd/core/scope_exit.hpp>
#include <sandboxd/provider/provider.hpp>

#include "init/supervisor_protocol.hpp"
#include "provider/bwrap_config.hpp"
#include "provider/cgroups.hpp"
#include "provider/process_backend.hpp"
#include "provider/spawn.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace sandboxd::bwrap {

// A supervisor waiting for a channel's terminal answers before the daemon stops waiting for it.
static_assert(proto::terminal_timeout_ms < supervisor_timeout_ms);

awaitable<std::unique_ptr<ChannelBackend>> BwrapProvider::open(
    std::shared_ptr<SandboxHandle> sandbox, ExecSpec spec) {
    validate_spec(spec);
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox->state);
    if (!state) {
        provider_failure("sandbox " + sandbox->scope.provider_lease_id +
                         " has no supervisor in this process");
    }
    // Opens of one sandbox take turns before they take any descriptor, so that many opens
    // in flight at once (a connection's requests run concurrently) hold the descriptors
    // of one channel being set up, not of all of them (CASES.md B12). The turn goes back
    // however this coroutine ends.
    co_await state->turns.enter();
    const ScopeExit turn_back([&turns = state->turns] { turns.leave(); });
    // The socket's copy first, and a spare for each descriptor the reply carries (the pidfd;
    // the master of a terminal made inside the lease): out of descriptors, the open fails
    // before anything starts.
    const std::string& name = sandbox->scope.provider_lease_id;
    unique_fd socket_copy = copy_socket(*state, name);
    std::vector<unique_fd> spares;
    spares.push_back(copy_socket(*state, name));
    PreparedChannel prepared = prepare_channel(*state, spec);
    if (prepared.lease_pty) spares.push_back(copy_socket(*state, name));
    StartedInit started =
        co_await ask_supervisor(state, name, std::move(socket_copy), std::move(spares),
                                prepared.request, prepared.payload, prepared.fds);
    detail::ProcessEnds ends = channel_ends(std::move(prepared), std::move(started), state);
    if (!spec.keep_key.empty() && options_.adopt_timeout_ms > 0) {
        hold_channel(state, spec.keep_key, ends);
    }
    auto executor = co_await net::this_coro::executor;
    co_return std::make_unique<detail::ProcessBackend>(executor, std::move(ends));
}

namespace {

/// A channel's request payload (supervisor_protocol.hpp): cwd, argv, then the environment,
/// NUL-terminated; and how many variables the environment holds. INVALID_PARAMS when it is
/// over max_payload.
std::pair<std::string, std::size_t> channel_payload(const ExecSpec& spec) {
    // The fixed variables first, in this order, then spec.env (sorted); a spec.env entry
    // of a fixed name replaces its value in place, as setenv(3) does.
    std::vector<std::pair<std::string, std::string>> env = {
        {"PATH", std::string(sandbox_path)},
        {"HOME", "/workspace"},
        {"TERM", spec.pty ? "xterm-256color" : "dumb"},
        {"LANG", "C.UTF-8"}};
    for (const auto& entry : spec.env) {
        const auto& [name, value] = entry;
        auto it = std::find_if(env.begin(), env.end(),
                               [&entry](const auto& e) { return e.first == entry.first; });
        if (it != env.end()) {
            it->second = value;
        } else {
            env.emplace_back(name, value);
        }
    }
    std::string payload = sandbox_cwd(spec.cwd);
    payload.push_back('\0');
    for (const auto& arg : spec.argv) {
        payload += arg;
        payload.push_back('\0');
    }
    for (const auto& [name, value] : env) {
        payload += name;
        payload.push_back('=');
        payload += value;
        payload.push_back('\0');
    }
    if (payload.size() > proto::max_payload) {
        throw rpc_error(errc::invalid_params,
                        "argv, env and cwd: " + std::to_string(payload.size()) +
                            " bytes, more than the " + std::to_string(proto::max_payload) +
                            " a command may be given");
    }
    return {std::move(payload), env.size()};
}

}  // namespace

BwrapProvider::PreparedChannel BwrapProvider::prepare_channel(BwrapSandbox& state,
                                                              const ExecSpec& spec) {
    PreparedChannel out;
    proto::Request& request = out.request;
    std::string& payload = out.payload;
    std::size_t envc = 0;
    std::tie(payload, envc) = channel_payload(spec);
    request.argc = static_cast<std::uint32_t>(spec.argv.size());
    request.envc = static_cast<std::uint32_t>(envc);
    request.payload_size = static_cast<std::uint32_t>(payload.size());
    request.grace_ms =
        spec.drain_grace_ms
            ? static_cast<std::int32_t>(std::min<std::uint32_t>(*spec.drain_grace_ms, INT32_MAX))
            : -1;
    request.open_files = state.limits.open_files;
    request.start_deadline_ms = spec.start_deadline_ms.value_or(0);

    std::vector<int>& fds = out.fds;
    out.pty = spec.pty.has_value();
    out.lease_pty = out.pty && state.supervisor_version >= proto::lease_pty_version;
    if (out.lease_pty) {
        // The channel's init makes the terminal in a devpts instance of its own: these are
        // placeholders for fds 0-2, which it replaces with the slave.
        out.dev_null.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        if (!out.dev_null) {
            provider_failure(std::string("cannot open /dev/null: ") + std::strerror(errno));
        }
        fds = {out.dev_null.get(), out.dev_null.get(), out.dev_null.get()};
        request.flags |= proto::flag_pty | proto::flag_pty_lease;
        request.reserved = static_cast<std::uint32_t>(spec.pty->rows) << 16 | spec.pty->cols;
    } else if (spec.pty) {
        out.pty_ends = detail::open_pty(*spec.pty);
        fds = {out.pty_ends.slave.get(), out.pty_ends.slave.get(), out.pty_ends.slave.get()};
        request.flags |= proto::flag_pty;
    } else {
        if (spec.stdin_attached) {
            out.stdin_pipe = detail::make_pipe(detail::daemon_end::write);
            fds.push_back(out.stdin_pipe.read_end.get());
        } else {
            out.dev_null.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
            if (!out.dev_null) {
                provider_failure(std::string("cannot open /dev/null: ") + std::strerror(errno));
            }
            fds.push_back(out.dev_null.get());
        }
        out.stdout_pipe = detail::make_pipe(detail::daemon_end::read);
        out.stderr_pipe = detail::make_pipe(detail::daemon_end::read);
        // The pipes keep their default size: ProcessBackend grows one once it streams.
        fds.push_back(out.stdout_pipe.write_end.get());
        fds.push_back(out.stderr_pipe.write_end.get());
    }
    out.status_pipe = detail::make_pipe(detail::daemon_end::read);
    out.control_pipe = detail::make_pipe(detail::daemon_end::write);
    fds.push_back(out.status_pipe.write_end.get());
    fds.push_back(out.control_pipe.read_end.get());

    if (state.cgroup) {
        out.cgroup = take_channel_cgroup(state);
        out.procs = out.cgroup.cgroup->open_procs();
        for (const auto& fd : out.procs) fds.push_back(fd.get());
    }
    request.cgroup_fds = static_cast<std::uint32_t>(out.procs.size());
    if (payload.size() > proto::max_inline_payload) {
        out.payload_memfd = payload_in_memfd(payload);
        fds.push_back(out.payload_memfd.get());
        request.flags |= proto::flag_payload_memfd;
        payload.clear();
    }
    return out;
}

TakenCgroup BwrapProvider::take_channel_cgroup(BwrapSandbox& state) {
    TakenCgroup out;
    {
        std::lock_guard lock(state.mutex);
        if (!state.spare_cgroups.empty()) {
            out = std::move(state.spare_cgroups.back());
            state.spare_cgroups.pop_back();
            return out;
        }
    }
    out.cgroup =
        state.cgroup->create_channel(state.channel_prefix + std::to_string(++state.channels));
    return out;
}

unique_fd BwrapProvider::sealed_memfd(const char* name, const std::string& bytes) {
    unique_fd fd(
        static_cast<int>(::syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING)));
    std::size_t done = 0;
    while (fd && done < bytes.size()) {
        const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            if (n == 0) errno = EIO;
            return {};
        }
        done += static_cast<std::size_t>(n);
    }
    if (!fd || ::fcntl(fd.get(), F_ADD_SEALS,
                       F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) != 0) {
        return {};
    }
    return fd;
}

detail::ProcessEnds BwrapProvider::channel_ends(PreparedChannel prepared, StartedInit started,
                                                const std::shared_ptr<BwrapSandbox>& state) {
    detail::ProcessEnds out;
    out.pidfd = std::move(started.pidfd);  // out.pid stays -1: ProcessBackend reads it if asked
    out.pty = prepared.pty;
    if (prepared.lease_pty) {
        prepared.pty_ends.master = std::move(started.master);
        ::fcntl(prepared.pty_ends.master.get(), F_SETFL, O_NONBLOCK);
    }
    if (prepared.pty) {
        int dup = ::fcntl(prepared.pty_ends.master.get(), F_DUPFD_CLOEXEC, 0);
        if (dup < 0) {
            int err = errno;
            // Nothing may be left running: the caller never sees this channel.
            ::syscall(SYS_pidfd_send_signal, out.pidfd.get(), SIGKILL, nullptr, 0);
            provider_failure(std::string("cannot set up a pty: ") + std::strerror(err));
        }
        out.stdout_fd.reset(dup);
        out.stdin_fd = std::move(prepared.pty_ends.master);
    } else {
        out.stdin_fd = std::move(prepared.stdin_pipe.write_end);
        out.stdout_fd = std::move(prepared.stdout_pipe.read_end);
        out.stderr_fd = std::move(prepared.stderr_pipe.read_end);
    }
    out.status_fd = std::move(prepared.status_pipe.read_end);
    out.control_fd = std::move(prepared.control_pipe.write_end);
    out.resources =
        std::make_unique<BwrapChannelResources>(std::move(prepared.cgroup), state, counters_);
    return out;
}

std::vector<std::string> BwrapProvider::bwrap_argv(const LeaseConfig& cfg, std::size_t cgroup_fds,
                                                   bool own_netns) const {
    const auto& id = options_.identity;
    std::vector<std::string> a = {options_.bwrap_path.string()};
    // A sandbox that the next daemon may adopt outlives this process (issue 47).
    if (options_.adopt_timeout_ms <= 0) a.emplace_back("--die-with-parent");
    a.insert(a.end(), {
                          "--unshare-user",
                          "--uid",
                          std::to_string(id.inside_uid),
                          "--gid",
                          std::to_string(id.inside_gid),
                          "--unshare-pid",
                          "--unshare-ipc",
                          "--unshare-uts",
                          "--unshare-cgroup-try",
                      });
    // Otherwise bubblewrap starts in the lease's own network namespace, which the daemon made
    // (lease_network.hpp) and which nothing inside may change.
    if (own_netns) a.emplace_back("--unshare-net");
    // The supervisor needs these two inside the lease's user namespace only: to make each
    // channel's PID and mount namespaces and mount its /proc, and to empty the bounding
    // set of every command (which then runs with no capability at all).
    a.insert(a.end(), {"--as-pid-1", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
                       "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"});
    std::error_code ec;
    for (const auto& dir : options_.ro_binds) {
        if (fs::exists(dir, ec)) a.insert(a.end(), {"--ro-bind", dir, dir});
    }
    // The merged-/usr links of the host, or the real directories where there are some.
    for (const char* dir : {"/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}) {
        auto status = fs::symlink_status(dir, ec);
        if (fs::is_symlink(status)) {
            fs::path target = fs::read_symlink(dir, ec);
            if (!ec) a.insert(a.end(), {"--symlink", target.string(), dir});
        } else if (fs::is_directory(status)) {
            a.insert(a.end(), {"--ro-bind", dir, dir});
        }
    }
    // tmpfs pages are charged to the lease's memory; the size makes a full one ENOSPC.
    const std::string tmpfs_size = std::to_string(cfg.limits.memory_bytes);
    a.insert(a.end(), {"--ro-bind-fd", "6", "/etc", "--proc", "/proc", "--dev", "/dev"});
    for (const char* dir : {"/tmp", "/run", "/dev/shm"}) {
        if (options_.limits.enforce) a.insert(a.end(), {"--size", tmpfs_size});
        a.insert(a.end(), {"--tmpfs", dir});
    }
    a.insert(a.end(),
             {"--bind-fd", "5", "/workspace", "--ro-bind-fd", "7", init_in_sandbox, "--chdir",
              "/workspace", "--hostname", "sandbox", "--", init_in_sandbox, "--lease"});
    if (cgroup_fds > 0) a.insert(a.end(), {"--cgroup-fds", std::to_string(cgroup_fds)});
    if (options_.adopt_timeout_ms > 0) {
        a.insert(a.end(), {"--adopt-timeout-ms", std::to_string(options_.adopt_timeout_ms)});
    }
    return a;
}

void BwrapProvider::start_supervisor(BwrapSandbox& sandbox, const std::string& id,
                                     const fs::path& workspace, uid_t uid, const LeaseConfig& cfg) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        provider_failure(std::string("cannot create the supervisor's socket: ") +
                         std::strerror(errno));
    }
    unique_fd ours(sv[0]);
    unique_fd theirs(sv[1]);
    const timeval tv{supervisor_timeout_ms / 1000, 0};
    ::setsockopt(ours.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(ours.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);

    unique_fd workspace_fd = open_path(workspace, "the workspace");
    unique_fd etc = open_path(runtime_dir_ / ".etc" / "net", "the sandbox /etc");
    unique_fd init = open_path(init_path_, "sandboxd-init");
    detail::Pipe errors = detail::make_pipe(detail::daemon_end::read);

    detail::SpawnRequest request;
    // The lease's cgroup is joined by the supervisor itself, through these join files
    // (fds 8, 9, ... of bubblewrap and of the supervisor), before it serves: bubblewrap
    // stays in the daemon's cgroup, so that the lease's cgroup holds the sandbox's own
    // processes only (its supervisor, a channel init made ahead, its channels).
    std::vector<unique_fd> procs;
    if (sandbox.cgroup) procs = sandbox.cgroup->open_procs();
    for (const auto& fd : procs) request.extra_fds.push_back(fd.get());
    // Then, when the sandbox may outlive this process, its adoption socket and secret.
    AdoptionEnds adoption;
    if (options_.adopt_timeout_ms > 0) {
        adoption = prepare_adoption(id);
        request.extra_fds.push_back(adoption.listen.get());
        request.extra_fds.push_back(adoption.secret.get());
    }
    request.netns = sandbox.network ? sandbox.network->netns() : -1;
    request.argv = bwrap_argv(cfg, procs.size(), request.netns < 0);
    request.envp = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"};
    request.fds = {-1,
                   -1,
                   errors.write_end.get(),
                   theirs.get(),
                   program_.get(),
                   workspace_fd.get(),
                   etc.get(),
                   init.get()};
    request.run_as = std::make_pair(uid, static_cast<gid_t>(uid));
    auto child = detail::spawn_process(request, "bubblewrap");
    sandbox.pid = child.pid;
    sandbox.pidfd = std::move(child.pidfd);
    errors.write_end.reset();
    theirs.reset();

    // The supervisor says hello (a reply with id 0) once it serves; EOF means bubblewrap
    // failed, and its stderr says why.
    // The hello carries the supervisor's pidfd.
    proto::Reply hello{};
    unique_fd supervisor;
    const ssize_t n = recv_reply(ours.get(), hello, supervisor, 0);
    if (n != static_cast<ssize_t>(sizeof hello) || hello.magic != proto::reply_magic ||
        hello.id != 0 || hello.error != 0 || !supervisor) {
        const int err = n < 0 ? static_cast<int>(-n) : 0;
        char text[2048];
        ssize_t got = ::read(errors.read_end.get(), text, sizeof text - 1);
        std::string why = got > 0 ? std::string(text, static_cast<std::size_t>(got)) : "";
        while (!why.empty() && (why.back() == '\n' || why.back() == '\r')) why.pop_back();
        if (why.empty()) why = err != 0 ? std::strerror(err) : "no answer from its supervisor";
        sandbox.shutdown();
        provider_failure("cannot start the sandbox: " + why);
    }
    sandbox.socket = std::move(ours);
    sandbox.supervisor_pidfd = std::move(supervisor);
    sandbox.supervisor_version = proto::version;
}

ssize_t BwrapProvider::send_request(int socket, const proto::Request& request,
                                    const std::string& payload, const std::vector<int>& fds) {
    iovec iov[2] = {{const_cast<proto::Request*>(&request), sizeof request},
                    {const_cast<char*>(payload.data()), payload.size()}};
    return send_with_fds(socket, iov, 2, fds);
}

ssize_t send_with_fds(int socket, iovec* iov, std::size_t count, const std::vector<int>& fds) {
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()), '\0');
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    if (!fds.empty()) {
        msg.msg_control = control.data();
        msg.msg_controllen = control.size();
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t sent = 0;
    do {
        sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (sent < 0 && errno == EINTR);
    return sent < 0 ? -errno : sent;
}

ssize_t BwrapProvider::recv_reply(int socket, proto::Reply& reply, unique_fd& pidfd, int flags,
                                  unique_fd* master) {
    std::vector<unique_fd> fds;
    bool truncated = false;
    const ssize_t got = recv_with_fds(socket, &reply, sizeof reply, fds, truncated, flags);
    // Any other descriptor closes here.
    if (!fds.empty()) pidfd = std::move(fds[0]);
    if (master != nullptr && fds.size() > 1) *master = std::move(fds[1]);
    return got;
}

ssize_t recv_with_fds(int socket, void* data, std::size_t size, std::vector<unique_fd>& fds,
                      bool& truncated, int flags) {
    constexpr std::size_t most = 8;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * most)];
    iovec iov{data, size};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t got = 0;
    do {
        got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | flags);
    } while (got < 0 && errno == EINTR);
    if (got < 0) return -errno;
    truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < n; ++i) {
            int fd = -1;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            fds.emplace_back(fd);
        }
    }
    return got;
}

awaitable<BwrapProvider::Exchanged> BwrapProvider::exchange(
    std::shared_ptr<net::posix::stream_descriptor> socket, std::vector<unique_fd> spares,
    proto::Request request, std::string payload, std::vector<int> fds) {
    Exchanged out;
    const int fd = socket->native_handle();
    const ssize_t sent = co_await when_ready(*socket, net::posix::descriptor_base::wait_write, [&] {
        return send_request(fd, request, payload, fds);
    });
    if (sent < 0) {
        out.error = static_cast<int>(-sent);
        co_return out;
    }
    spares.clear();  // the reply's descriptors take their places
    out.got = co_await when_ready(*socket, net::posix::descriptor_base::wait_read, [&] {
        return recv_reply(fd, out.reply, out.pidfd, MSG_DONTWAIT, &out.master);
    });
    if (out.got < 0) out.error = static_cast<int>(-out.got);
    if (out.got == 0) out.error = EPIPE;
    co_return out;
}

unique_fd BwrapProvider::copy_socket(BwrapSandbox& sandbox, const std::string& name) {
    std::lock_guard lock(sandbox.mutex);
    if (!sandbox.socket || sandbox.broken) {
        provider_failure("sandbox " + name + " is gone: its supervisor has exited");
    }
    unique_fd copy(::fcntl(sandbox.socket.get(), F_DUPFD_CLOEXEC, 0));
    if (!copy) {
        const int err = errno;
        if (err == EMFILE || err == ENFILE) {
            throw rpc_error(errc::channel_limit,
                            "cannot start a channel: this node has no file descriptor left "
                            "for another channel (" +
                                std::string(err == EMFILE ? "RLIMIT_NOFILE" : "system file table") +
                                ")");
        }
        provider_failure(std::string("cannot start a channel: ") + std::strerror(err));
    }
    return copy;
}

awaitable<BwrapProvider::StartedInit> BwrapProvider::ask_supervisor(
    std::shared_ptr<BwrapSandbox> sandbox, std::string name, unique_fd socket_copy,
    std::vector<unique_fd> spares, proto::Request request, std::string payload,
    std::vector<int> fds) {
    using namespace net::experimental::awaitable_operators;
    // The caller (open) holds the sandbox's turn: one request in flight on the socket.
    {
        std::lock_guard lock(sandbox->mutex);
        if (sandbox->broken) {
            provider_failure("sandbox " + name + " is gone: its supervisor has exited");
        }
        request.id = sandbox->next_request++;
    }
    auto executor = co_await net::this_coro::executor;
    auto socket = std::make_shared<net::posix::stream_descriptor>(executor, socket_copy.release());
    net::steady_timer timer(executor);
    timer.expires_after(std::chrono::milliseconds(supervisor_timeout_ms));
    auto outcome = co_await (
        exchange(socket, std::move(spares), request, std::move(payload), std::move(fds)) ||
        timer.async_wait(as_tuple_awaitable));
    if (outcome.index() == 1) fail_supervisor(*sandbox, name, ETIMEDOUT);
    Exchanged got = std::get<0>(std::move(outcome));
    if (got.error != 0) fail_supervisor(*sandbox, name, got.error);
    const proto::Reply& reply = got.reply;
    if (got.got != static_cast<ssize_t>(sizeof reply) || reply.magic != proto::reply_magic ||
        reply.id != request.id || (reply.error == 0) != static_cast<bool>(got.pidfd) ||
        ((request.flags & proto::flag_pty_lease) != 0 &&
         (reply.error == 0) != static_cast<bool>(got.master))) {
        fail_supervisor(*sandbox, name, EPROTO);
    }
    if (reply.error != 0) {
        if (reply.error == ETIMEDOUT) {
            throw start_deadline_passed("sandbox " + name +
                                        ": the channel was not started: its node's "
                                        "fencing deadline passed before it could start");
        }
        if (reply.error == EMFILE || reply.error == ENFILE || reply.error == EAGAIN) {
            throw rpc_error(
                errc::channel_limit,
                "sandbox " + name + " cannot start another process: " + std::strerror(reply.error));
        }
        provider_failure("sandbox " + name +
                         " could not start the channel: " + std::strerror(reply.error));
    }
    ::fcntl(got.pidfd.get(), F_SETFL, O_NONBLOCK);
    co_return StartedInit{std::move(got.pidfd), std::move(got.master)};
}

void BwrapProvider::fail_supervisor(BwrapSandbox& sandbox, const std::string& name, int err) {
    // The supervisor is gone or out of step: no later request could be trusted.
    {
        std::lock_guard lock(sandbox.mutex);
        sandbox.broken = true;
    }
    if (err == ETIMEDOUT) {
        provider_failure("the supervisor of sandbox " + name + " did not answer within " +
                         std::to_string(supervisor_timeout_ms) + " ms");
    }
    provider_failure("sandbox " + name + " is gone: its supervisor has exited (" +
                     std::strerror(err) + ")");
}

}  // namespace sandboxd::bwrap
