/// @file bwrap_sandbox.cpp
/// A bubblewrap sandbox's teardown (bwrap_sandbox.hpp): ending its supervisor and bubblewrap,
/// its cgroups and its workspace mount.

#include "provider/bwrap_sandbox.hpp"

#include "provider/cgroups.hpp"

#include <poll.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <memory>
#include <mutex>
#include <utility>

namespace sandboxd::bwrap {

void BwrapSandbox::shutdown(bool unmount) noexcept {
    std::lock_guard lock(mutex);
    socket.reset();  // the supervisor exits, and with it the lease's PID namespace
    if (pid > 0) {
        // The supervisor dies first, so that bubblewrap (its parent, which exits once it
        // has reaped it) is never killed under it: a supervisor that outlived bubblewrap
        // would be re-parented out of the daemon's tree (to the host's init) as an orphan.
        if (supervisor_pidfd) {
            ::syscall(SYS_pidfd_send_signal, supervisor_pidfd.get(), SIGKILL, nullptr, 0);
            supervisor_pidfd.reset();
        }
        pollfd p{pidfd.get(), POLLIN, 0};
        if (::poll(&p, 1, bwrap_exit_grace_ms) != 1) {
            ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
        }
        while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
        }
        pid = -1;
    } else if (supervisor_pidfd) {
        // Adopted: bubblewrap is another process's child now (it exits once the supervisor
        // has); the supervisor's exit ends every process of the sandbox.
        ::syscall(SYS_pidfd_send_signal, supervisor_pidfd.get(), SIGKILL, nullptr, 0);
        pollfd p{supervisor_pidfd.get(), POLLIN, 0};
        ::poll(&p, 1, bwrap_exit_grace_ms);
        supervisor_pidfd.reset();
    }
    workspace_root.reset();      // holds the workspace's filesystem busy
    spare_cgroups.clear();       // emptied ones: removed, not killed
    if (cgroup) cgroup->kill();  // whatever is left (a sandbox whose bubblewrap is gone)
    network.reset();             // its veth, policy and resolver
    // A sandbox dropped without a teardown (the daemon stops): nothing can use it again
    // in this process, so its loop device and mount go now; a later teardown removes
    // the rest.
    if (unmount && !workspace.empty()) ::umount2(workspace.c_str(), MNT_DETACH);
}

BwrapSandbox::~BwrapSandbox() {
    if (lane && lane->keeping()) {
        // Kept for the next process: nothing is killed or unmounted; the members' own
        // destructors close the descriptors (the socket's close tells the supervisor).
        std::lock_guard lock(mutex);
        if (cgroup) cgroup->keep();
        if (network) network->keep();
        return;
    }
    if (!lane) {
        shutdown(true);
        return;
    }
    auto rest = std::make_shared<BwrapSandbox>();  // no lane: ends them where it is dropped
    {
        std::lock_guard lock(mutex);
        rest->workspace = std::move(workspace);
        rest->workspace_root = std::move(workspace_root);
        rest->pid = std::exchange(pid, -1);
        rest->pidfd = std::move(pidfd);
        rest->socket = std::move(socket);
        rest->supervisor_pidfd = std::move(supervisor_pidfd);
        rest->cgroup = std::move(cgroup);
        rest->spare_cgroups = std::move(spare_cgroups);
        rest->network = std::move(network);
    }
    lane->run([rest = std::move(rest)]() mutable { rest.reset(); });
}

}  // namespace sandboxd::bwrap
