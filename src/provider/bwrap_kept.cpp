/// @file bwrap_kept.cpp
/// The bubblewrap provider's kept channels (issue 47; bwrap_provider_impl.hpp): a channel
/// opened with ExecSpec::keep_key has copies of the daemon's ends of it held by its lease's
/// supervisor, so that it outlives the daemon process; the next process takes them back at
/// the adoption and serves the channel again (the protocol is in
/// src/init/supervisor_protocol.hpp, "Kept channels").

#include "provider/bwrap_provider_impl.hpp"

#include <sandboxd/provider/provider.hpp>

#include "init/supervisor_protocol.hpp"
#include "provider/process_backend.hpp"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sandboxd::bwrap {

namespace {

/// The name of the channel cgroup that process `pid` is in: the last component of a path in
/// /proc/<pid>/cgroup whose parent component is the lease's cgroup, `lease`. "" when there is
/// none (the process is gone, or not in a channel's cgroup).
std::string channel_cgroup_of(pid_t pid, const std::string& lease) {
    if (pid <= 0) return {};
    const std::string path = "/proc/" + std::to_string(pid) + "/cgroup";
    unique_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return {};
    std::array<char, 8192> buffer{};
    std::string text;
    for (;;) {
        const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0 || text.size() > 64 * 1024) break;
        text.append(buffer.data(), static_cast<std::size_t>(n));
    }
    const std::string parent = "/" + lease + "/";
    for (std::size_t at = 0; at < text.size();) {
        std::size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        const std::string_view line(text.data() + at, end - at);
        at = end + 1;
        const std::size_t slash = line.rfind('/');
        if (slash == std::string_view::npos || slash + 1 >= line.size()) continue;
        const std::size_t start = line.rfind(parent, slash);
        if (start == std::string_view::npos || start + parent.size() != slash + 1) continue;
        return std::string(line.substr(slash + 1));
    }
    return {};
}

static_assert(proto::held_slots <= 8, "recv_with_fds() takes at most 8 descriptors a packet");

/// One Held packet with the descriptors of its mask, without waiting; false on failure
/// (errno).
bool send_held(int socket, std::uint32_t magic, const std::string& key, std::uint32_t mask,
               const std::vector<int>& fds) {
    proto::Held packet;
    packet.magic = magic;
    packet.mask = mask;
    std::memcpy(packet.key, key.data(), std::min(key.size(), proto::key_size - 1));
    iovec iov{&packet, sizeof packet};
    const ssize_t sent = send_with_fds(socket, &iov, 1, fds);
    if (sent < 0) errno = static_cast<int>(-sent);
    return sent == static_cast<ssize_t>(sizeof packet);
}

/// Sends a Release of `mask` for `key` to the sandbox's supervisor, unless it is gone.
void release_held(BwrapSandbox& sandbox, const std::string& key, std::uint32_t mask) noexcept {
    std::lock_guard lock(sandbox.mutex);
    if (!sandbox.socket || sandbox.broken) return;
    if (!send_held(sandbox.socket.get(), proto::release_magic, key, mask, {})) {
        // The supervisor keeps that end until the lease ends: a stdin that reads no EOF.
        spdlog::warn("kept channel {}: cannot tell its supervisor to let go: {}", key,
                     std::strerror(errno));
    }
}

/// A kept channel's resources: the channel's own (its cgroup), and its supervisor's copies
/// of the daemon's ends, released with it.
class KeptChannelResources final : public detail::ChannelResources {
public:
    KeptChannelResources(std::unique_ptr<detail::ChannelResources> inner,
                         std::shared_ptr<BwrapSandbox> sandbox, std::string key)
        : inner_(std::move(inner)), sandbox_(std::move(sandbox)), key_(std::move(key)) {}
    KeptChannelResources(const KeptChannelResources&) = delete;
    KeptChannelResources& operator=(const KeptChannelResources&) = delete;
    ~KeptChannelResources() override {
        // The daemon stops and keeps the channel: its cgroup stays with its processes.
        if (inner_ && kept_past_daemon()) inner_->keep();
    }

    std::string limit_hit(int term_signal) noexcept override {
        return inner_ ? inner_->limit_hit(term_signal) : std::string();
    }
    void release(bool processes_gone) noexcept override {
        release_held(*sandbox_, key_, (1U << proto::held_slots) - 1);
        if (inner_) inner_->release(processes_gone);
    }
    void stdin_closed() noexcept override {
        release_held(*sandbox_, key_, 1U << proto::slot_stdin);
    }
    bool kept_past_daemon() const noexcept override {
        return sandbox_->lane && sandbox_->lane->keeping();
    }

private:
    std::unique_ptr<detail::ChannelResources> inner_;
    std::shared_ptr<BwrapSandbox> sandbox_;
    std::string key_;
};

/// The ends of `ends` in slot order (supervisor_protocol.hpp, held_slot); -1 when absent.
std::array<int, proto::held_slots> slots_of(const detail::ProcessEnds& ends) {
    return {ends.pidfd.get(),      ends.stdin_fd.get(),   ends.stdout_fd.get(),
            ends.stderr_fd.get(),  ends.status_fd.get(),  ends.control_fd.get(),
            ends.relay_read.get(), ends.relay_write.get()};
}

}  // namespace

void BwrapProvider::hold_channel(const std::shared_ptr<BwrapSandbox>& state, const std::string& key,
                                 detail::ProcessEnds& ends) const {
    if (key.empty() || key.size() >= proto::key_size) return;
    {
        std::lock_guard lock(state->mutex);
        if (state->supervisor_version < proto::kept_channels_version) return;
    }
    if (ends.pty) {
        // Terminal output goes through a pipe that the supervisor holds too: bytes taken
        // from the terminal wait there, not in this process, until they are kept.
        int relay[2];
        if (::pipe2(relay, O_CLOEXEC | O_NONBLOCK) != 0) {
            spdlog::warn("kept channel {}: no relay pipe ({}): it ends with this process", key,
                         std::strerror(errno));
            return;
        }
        ends.relay_read.reset(relay[0]);
        ends.relay_write.reset(relay[1]);
    }
    std::uint32_t mask = 0;
    std::vector<int> fds;
    const auto slots = slots_of(ends);
    for (std::uint32_t slot = 0; slot < proto::held_slots; ++slot) {
        if (slots[slot] < 0) continue;
        mask |= 1U << slot;
        fds.push_back(slots[slot]);
    }
    bool sent = false;
    {
        std::lock_guard lock(state->mutex);
        sent = state->socket && !state->broken &&
               send_held(state->socket.get(), proto::hold_magic, key, mask, fds);
    }
    if (!sent) {
        spdlog::warn(
            "kept channel {}: cannot give its supervisor its ends ({}): it ends with "
            "this process",
            key, std::strerror(errno));
        return;
    }
    ends.resources = std::make_unique<KeptChannelResources>(std::move(ends.resources), state, key);
}

void BwrapProvider::take_back_kept(BwrapSandbox& state, int socket, const std::string& id) {
    if (!send_held(socket, proto::return_magic, "", 0, {})) {
        spdlog::warn("sandbox {}: cannot ask its supervisor for its kept channels: {}", id,
                     std::strerror(errno));
        return;
    }
    for (std::size_t count = 0; count <= proto::max_held; ++count) {
        proto::Held packet;
        std::vector<unique_fd> fds;
        bool truncated = false;
        const ssize_t got = recv_with_fds(socket, &packet, sizeof packet, fds, truncated, 0);
        if (got != static_cast<ssize_t>(sizeof packet) || packet.magic != proto::hold_magic) {
            spdlog::warn("sandbox {}: its supervisor's list of kept channels broke off ({})", id,
                         got < 0 ? std::strerror(static_cast<int>(-got)) : "a malformed packet");
            return;
        }
        packet.key[proto::key_size - 1] = '\0';
        if (packet.mask == 0 && packet.key[0] == '\0') return;  // the end
        if (static_cast<std::size_t>(__builtin_popcount(packet.mask)) != fds.size() || truncated) {
            spdlog::warn("sandbox {}: kept channel {} came back incomplete: not resumed", id,
                         packet.key);
            continue;
        }
        std::vector<unique_fd> slots(proto::held_slots);
        std::size_t next = 0;
        for (std::uint32_t slot = 0; slot < proto::held_slots; ++slot) {
            if ((packet.mask & (1U << slot)) == 0) continue;
            ::fcntl(fds[next].get(), F_SETFL, O_NONBLOCK);
            slots[slot] = std::move(fds[next++]);
        }
        std::lock_guard lock(state.mutex);
        state.kept_channels[packet.key] = std::move(slots);
    }
}

std::vector<std::string> BwrapProvider::kept_channels(const SandboxHandle& sandbox) const {
    std::vector<std::string> keys;
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
    if (!state) return keys;
    std::lock_guard lock(state->mutex);
    for (const auto& [key, ends] : state->kept_channels) keys.push_back(key);
    return keys;
}

std::unique_ptr<ChannelBackend> BwrapProvider::take_kept_channel(SandboxHandle& sandbox,
                                                                 const std::string& key,
                                                                 net::any_io_executor executor) {
    auto state = std::static_pointer_cast<BwrapSandbox>(sandbox.state);
    if (!state) return nullptr;
    std::vector<unique_fd> slots;
    {
        std::lock_guard lock(state->mutex);
        auto it = state->kept_channels.find(key);
        if (it == state->kept_channels.end()) return nullptr;
        slots = std::move(it->second);
        state->kept_channels.erase(it);
    }
    detail::ProcessEnds ends;
    ends.pidfd = std::move(slots[proto::slot_pidfd]);
    ends.stdin_fd = std::move(slots[proto::slot_stdin]);
    ends.stdout_fd = std::move(slots[proto::slot_stdout]);
    ends.stderr_fd = std::move(slots[proto::slot_stderr]);
    ends.status_fd = std::move(slots[proto::slot_status]);
    ends.control_fd = std::move(slots[proto::slot_control]);
    ends.relay_read = std::move(slots[proto::slot_relay_read]);
    ends.relay_write = std::move(slots[proto::slot_relay_write]);
    // Only a PTY channel has a relay (hold_channel).
    ends.pty = static_cast<bool>(ends.relay_read);
    if (!ends.pidfd || !ends.status_fd || !ends.control_fd || !ends.stdout_fd) {
        spdlog::warn("sandbox {}: kept channel {} lacks a required end: not resumed",
                     sandbox.scope.provider_lease_id, key);
        release_held(*state, key, (1U << proto::held_slots) - 1);
        return nullptr;
    }
    // Its cgroup, found again by its init's: limit events from now on are the channel's, and
    // it goes when the channel ends (or stays, kept, through another restart). One that cannot
    // be found (its init has ended) is emptied with the lease's.
    TakenCgroup cgroup;
    if (state->cgroup) {
        std::string name = channel_cgroup_of(detail::pid_of_pidfd(ends.pidfd.get()),
                                             sandbox.scope.provider_lease_id);
        // Read by pid: only if the init still lives now was that pid not reused meanwhile
        // (by another channel's init, whose cgroup this one must never take).
        if (::syscall(SYS_pidfd_send_signal, ends.pidfd.get(), 0, nullptr, 0) != 0) name.clear();
        if (!name.empty()) cgroup.cgroup = state->cgroup->find_channel(name);
        if (cgroup.cgroup) {
            // What it counted before this process is not known to be this channel's.
            cgroup.oom_kills_before = cgroup.cgroup->oom_kills();
            cgroup.pids_hits_before = cgroup.cgroup->own_pids_limit_hits().value_or(0);
        }
    }
    ends.resources = std::make_unique<KeptChannelResources>(
        std::make_unique<BwrapChannelResources>(std::move(cgroup), state, counters_), state, key);
    return std::make_unique<detail::ProcessBackend>(std::move(executor), std::move(ends));
}

}  // namespace sandboxd::bwrap
