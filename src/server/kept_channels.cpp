#include "server/kept_channels.hpp"

#include "server/channel_service.hpp"
#include "server/detached_channels.hpp"
#include "server/detached_output.hpp"
#include "server/kept_output.hpp"
#include "server/lease_ops.hpp"
#include "server/node.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/lease.hpp>

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

namespace sandboxd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* record_name = "channel.json";
constexpr const char* exit_name = "exit.json";
/// A record is a few hundred bytes: a larger file is not one.
constexpr std::uintmax_t max_record = 64 * 1024;

/// The JSON in `path`; null when it is missing; throws std::runtime_error when it is
/// unreadable or malformed.
json read_json(const fs::path& path) {
    std::error_code ec;
    if (!fs::exists(path, ec)) return nullptr;
    const auto size = fs::file_size(path, ec);
    if (ec || size > max_record) throw std::runtime_error(path.string() + ": not a record");
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    json value = json::parse(text.str(), nullptr, false);
    if (!in || value.is_discarded() || !value.is_object()) {
        throw std::runtime_error(path.string() + ": malformed");
    }
    return value;
}

/// What a kept channel is served with again (kept_channel_record's fields).
struct Record {
    std::string handle, name, argv0, argv_sha256, host_route_id, opened_for;
    bool pty = false;
    bool stdin_attached = true;
    std::uint32_t output_window = 0, stdin_window = 0;
    std::int64_t epoch = 0, started_at_ms = 0;
    std::optional<std::int64_t> deadline_ms;  ///< wall clock: timeoutMs from its start
    std::uint64_t retain_ms = 0, retain_bytes = 0;
    std::optional<std::chrono::milliseconds> hangup_after;
};

Record parse_record(const json& j) {
    Record r;
    r.handle = j.at("handle").get<std::string>();
    r.name = j.at("name").get<std::string>();
    r.argv0 = j.at("argv0").get<std::string>();
    r.argv_sha256 = j.at("argvSha256").get<std::string>();
    r.host_route_id = j.at("hostRouteId").get<std::string>();
    r.opened_for = j.at("openedFor").get<std::string>();
    r.pty = j.at("pty").get<bool>();
    r.stdin_attached = j.at("stdinAttached").get<bool>();
    r.output_window = j.at("outputWindow").get<std::uint32_t>();
    r.stdin_window = j.at("stdinWindow").get<std::uint32_t>();
    r.epoch = j.at("epoch").get<std::int64_t>();
    r.started_at_ms = j.at("startedAt").get<std::int64_t>();
    if (!j.at("deadline").is_null()) r.deadline_ms = j.at("deadline").get<std::int64_t>();
    r.retain_ms = j.at("retainMs").get<std::uint64_t>();
    r.retain_bytes = j.at("retainBytes").get<std::uint64_t>();
    if (!j.at("hangupAfterMs").is_null()) {
        r.hangup_after = std::chrono::milliseconds(j.at("hangupAfterMs").get<std::int64_t>());
    }
    if (r.output_window == 0 || r.stdin_window == 0 || r.retain_bytes < KeptOutput::min_capacity ||
        r.retain_bytes > KeptOutput::max_capacity) {
        throw std::runtime_error("a record out of range");
    }
    return r;
}

ChannelOptions options_of(Node& node, const Record& r, const std::string& lease_id) {
    ChannelOptions options;
    options.host_route_id = r.host_route_id;
    options.output_window = r.output_window;
    options.pty = r.pty;
    options.stdin_attached = r.stdin_attached;
    options.stdin_window = r.stdin_window;
    options.hangup_grace = std::chrono::milliseconds(node.config.limits.hangup_grace_ms);
    options.audit = node.audit;
    options.opened_for = r.opened_for;
    options.argv0 = r.argv0;
    options.argv_sha256 = r.argv_sha256;
    options.epoch = r.epoch;
    options.lease_id = lease_id;
    options.unended = &node.channels_unended;
    options.bytes = &node.metrics.channel_byte_counters;
    options.release_backend_at_end = true;
    if (r.deadline_ms) {
        options.timeout =
            std::chrono::milliseconds(std::max<std::int64_t>(1, *r.deadline_ms - now_ms()));
    }
    return options;
}

DetachedChannels::Entry entry_of(const Record& r, const std::string& lease_id,
                                 const strand_t& strand, std::shared_ptr<Channel> channel,
                                 std::shared_ptr<DetachedOutput> output) {
    DetachedChannels::Entry entry;
    entry.handle = r.handle;
    entry.lease_id = lease_id;
    entry.name = r.name;
    entry.argv0 = r.argv0;
    entry.pty = r.pty;
    entry.started_at_ms = r.started_at_ms;
    entry.retain_ms = r.retain_ms;
    entry.kept_bytes = 2 * r.retain_bytes;
    entry.strand = strand;
    entry.channel = std::move(channel);
    entry.output = std::move(output);
    return entry;
}

/// One kept channel of `sandbox` in `dir`, served again; throws std::exception saying why it
/// cannot be (the caller removes it).
void restore_one(Node& node, const std::shared_ptr<SandboxHandle>& sandbox, const fs::path& dir,
                 std::unique_ptr<ChannelBackend> backend, const strand_t& strand) {
    const std::string& lease_id = sandbox->lease_id;
    const Record r = parse_record(read_json(dir / record_name));
    if (r.handle != dir.filename().string()) throw std::runtime_error("a record of another name");
    json exit = read_json(dir / exit_name);
    auto kept = KeptOutput::open(dir, r.retain_bytes);
    auto output = std::make_shared<DetachedOutput>(strand, std::move(kept));
    if (!exit.is_null()) {
        // It ended under the last process, which kept its exit: nothing of it runs (a backend
        // handed back for it only holds ends; destroying it lets the supervisor's go).
        backend.reset();
        const std::int64_t ended_at = exit.value("endedAt", now_ms());
        exit.erase("endedAt");
        output->restore_exit(std::move(exit));
        auto channel = Channel::make_ended(strand, options_of(node, r, lease_id), sandbox);
        output->bind(channel);
        node.detached.add(entry_of(r, lease_id, strand, channel, output));
        detached_channel_ended(node, r.handle, r.retain_ms, ended_at);
        spdlog::info("lease={} detached channel {} kept across the restart (ended)", lease_id,
                     r.handle);
        return;
    }
    if (!backend) {
        // Its command did not outlive the last process (its provider kept nothing of it).
        throw std::runtime_error("its command did not outlive the last daemon process");
    }
    output->persist_exit();
    auto options = options_of(node, r, lease_id);
    auto channel =
        std::make_shared<Channel>(strand, std::move(options), std::move(backend), sandbox, output);
    output->bind(channel);
    if (r.hangup_after) output->hang_up_when_idle(*r.hangup_after);
    node.detached.add(entry_of(r, lease_id, strand, channel, output));
    // Counted as running whatever the limit: it ran before the restart.
    (void)node.channels.try_reserve(SIZE_MAX);
    const auto key =
        track_detached(node, channel, strand, lease_id, r.handle, r.retain_ms, /*kept=*/true);
    net::post(strand, [channel, output] {
        channel->start();
        output->start_unattached();
    });
    spdlog::info("channel={} lease={} detached channel {} kept across the restart: {} pty={}", key,
                 lease_id, r.handle, r.argv0, r.pty);
}

}  // namespace

json kept_channel_record(const std::string& handle, const methods::OpenParams& params,
                         const ChannelOptions& options) {
    const auto& detach = *params.detach;
    const std::int64_t started = now_ms();
    return {{"handle", handle},
            {"name", params.name},
            {"argv0", options.argv0},
            {"argvSha256", options.argv_sha256},
            {"hostRouteId", options.host_route_id},
            {"openedFor", options.opened_for},
            {"pty", options.pty},
            {"stdinAttached", options.stdin_attached},
            {"outputWindow", options.output_window},
            {"stdinWindow", options.stdin_window},
            {"epoch", options.epoch},
            {"startedAt", started},
            {"deadline", options.timeout ? json(started + options.timeout->count()) : json()},
            {"retainMs", detach.retain_ms},
            {"retainBytes", detach.retain_bytes},
            {"hangupAfterMs", detach.hangup_after ? json(detach.hangup_after->count()) : json()}};
}

void write_kept_record(const fs::path& dir, const json& record) {
    const fs::path temp = dir / (std::string(record_name) + ".new");
    const std::string text = record.dump();
    {
        std::ofstream out(temp, std::ios::trunc);
        out << text;
        if (!out) {
            throw rpc_error(errc::provider_error, "kept output: cannot write " + temp.string() +
                                                      ": " + std::strerror(errno));
        }
    }
    std::error_code ec;
    fs::permissions(temp, fs::perms::owner_read | fs::perms::owner_write, ec);
    fs::rename(temp, dir / record_name, ec);
    if (ec) {
        throw rpc_error(
            errc::provider_error,
            "kept output: cannot write " + (dir / record_name).string() + ": " + ec.message());
    }
}

awaitable<std::size_t> restore_kept_channels(Node& node) {
    const fs::path root = kept_output_root(node);
    std::size_t restored = 0;
    std::set<std::string> leases;  // whose kept channels were looked at
    for (const auto& sandbox : node.cache.snapshot()) {
        Provider* provider = lease_ops::provider_of(node, sandbox->scope.provider);
        if (provider == nullptr || !provider->outlives_daemon()) continue;
        leases.insert(sandbox->lease_id);
        std::set<std::string> keys;
        for (auto& key : provider->kept_channels(*sandbox)) keys.insert(std::move(key));
        std::error_code ec;
        std::vector<fs::path> dirs;
        for (const auto& item : fs::directory_iterator(root / sandbox->lease_id, ec)) {
            dirs.push_back(item.path());
        }
        for (const auto& dir : dirs) {
            const std::string handle = dir.filename().string();
            const strand_t strand = net::make_strand(*node.ioc);
            std::unique_ptr<ChannelBackend> backend;
            if (keys.erase(handle) > 0)
                backend = provider->take_kept_channel(*sandbox, handle, strand);
            try {
                restore_one(node, sandbox, dir, std::move(backend), strand);
                ++restored;
            } catch (const std::exception& e) {
                spdlog::warn("lease={} detached channel {} not kept across the restart: {}",
                             sandbox->lease_id, handle, e.what());
                fs::remove_all(dir, ec);
            }
        }
        // Ends that no record goes with (its open failed after the hand-over): the command is
        // ended and the ends let go, by the backend's destructor.
        for (const auto& key : keys) {
            spdlog::warn("lease={} kept channel {} has no record: ended", sandbox->lease_id, key);
            (void)provider->take_kept_channel(*sandbox, key, net::make_strand(*node.ioc));
        }
    }
    std::error_code ec;
    std::vector<fs::path> stale;
    for (const auto& item : fs::directory_iterator(root, ec)) {
        if (leases.count(item.path().filename().string()) == 0) stale.push_back(item.path());
    }
    for (const auto& dir : stale) fs::remove_all(dir, ec);
    if (restored > 0) {
        spdlog::info("node={} serves {} detached channel(s) kept across its restart", node.node_id,
                     restored);
    }
    co_return restored;
}

}  // namespace sandboxd
