// The daemon's wiring (docs/architecture.md): builds the node from its config (registry,
// providers, audit, console, credentials), starts its parts in order and stops them. The
// parts live in their own files: listeners.cpp, http_routes.cpp, membership.cpp, drain.cpp,
// node_gauges.cpp, reload.cpp (daemon_impl.hpp lists them).
#include "server/channel_service.hpp"
#include "server/daemon_impl.hpp"
#include "server/kept_channels.hpp"

#include "server/lease_service.hpp"
#include "server/metered.hpp"
#include "server/security_setup.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/provider/plugin_provider.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <utility>

namespace sandboxd {
namespace {

namespace fs = std::filesystem;

/// Runs `ioc`, which no thread runs yet, until `done` is ready (start-up steps that must end
/// before the daemon serves); returns its value or rethrows its exception.
template <typename T>
T run_until_done(net::io_context& ioc, std::future<T> done) {
    {
        auto busy = net::make_work_guard(ioc);
        while (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
            ioc.run_one_for(std::chrono::milliseconds(100));
        }
    }
    ioc.restart();
    return done.get();
}

std::string host_name() {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "node";
    return buf;
}

/// The generated admin token's file in `state_dir` (made once, mode 0600), for a config that
/// names no token.
std::string ensure_admin_token(const std::string& state_dir) {
    auto path = (fs::path(state_dir) / "admin.token").string();
    if (!fs::exists(path)) {
        const auto tmp = path + ".tmp";
        {
            std::ofstream out(tmp, std::ios::trunc);
            out << random_hex(24) << "\n";
            if (!out) throw config_error("config: stateDir: cannot write " + tmp);
        }
        ::chmod(tmp.c_str(), 0600);
        fs::rename(tmp, path);
    }
    return path;
}

void warn_unbound_peer_tokens(const Config& c) {
    for (const auto& t : c.tokens) {
        if (t.role == "peer" && t.node_id.empty() && c.peer_tls.empty()) {
            spdlog::warn(
                "auth.tokens: peer token \"{}\" names no node: a link with it may say it "
                "comes from any node (it acts only within its own tenants); binding it to "
                "its node with nodeId, or routing.peerTls certificates that name the node, "
                "is safer",
                t.name);
        }
    }
}

std::unique_ptr<Registry> make_registry(Node& node, net::io_context& ioc) {
    const auto& c = node.config;
    auto* bad_records = &node.metrics.registry_bad_records.only();
    if (c.registry.kind != "etcd") {
        const auto db = c.registry.path.empty() ? (fs::path(c.state_dir) / "registry.db").string()
                                                : c.registry.path;
        return metered_registry(make_sqlite_registry(db, 2, bad_records), node.metrics);
    }
    std::string password;
    if (!c.registry.password_file.empty()) {
        try {
            password = read_secret_file(c.registry.password_file);
        } catch (const config_error&) {
            throw config_error("config: registry.passwordFile: cannot read " +
                               c.registry.password_file + ", or it is empty");
        }
    }
    // How long the node's record outlives its last heartbeat in etcd (liveness is judged by
    // the heartbeat's age, never by the record's presence): through routing.adoptGraceMs too
    // when its sandboxes outlive it, so that other nodes still see when it was last alive and
    // give its leases the grace (issue 47).
    const std::int64_t record_ttl_ms =
        static_cast<std::int64_t>(c.node_ttl_ms) +
        (c.bwrap.enabled && c.bwrap.adopt_timeout_ms > 0 ? c.adopt_grace_ms : 0);
    return metered_registry(make_etcd_registry(
                                ioc.get_executor(), c.registry.endpoints, c.registry.prefix,
                                record_ttl_ms, c.registry.username, password,
                                [n = &node] { return n->security()->registry_tls; }, bad_records),
                            node.metrics);
}

std::unique_ptr<Provider> make_bwrap(const Config& c) {
    BwrapOptions opts;
    opts.bwrap_path = c.bwrap.path;
    opts.init_path = c.bwrap.init_path;
    opts.sandboxes_dir = fs::path(c.state_dir) / "sandboxes";
    opts.network = c.bwrap.network;
    if (c.bwrap.allow_network) {
        spdlog::warn(
            "config: providers.bwrap.allowNetwork is deprecated: use "
            "providers.bwrap.network.egress (each lease now has a network of its own "
            "and egress by its policy; the host's own network is never shared)");
        opts.network.egress = true;
    }
    opts.limits = c.bwrap.limits;
    opts.identity = c.bwrap.identity;
    opts.etc_files = c.bwrap.etc_files;
    opts.adopt_timeout_ms = c.bwrap.adopt_timeout_ms;
    std::error_code ec;
    fs::create_directories(opts.sandboxes_dir, ec);
    if (ec) throw config_error("config: stateDir: cannot create " + opts.sandboxes_dir.string());
    std::unique_ptr<Provider> provider;
    try {
        provider = make_bwrap_provider(opts);
    } catch (const rpc_error& e) {
        throw config_error(std::string("providers.bwrap: ") + e.what());
    } catch (const std::invalid_argument& e) {
        throw config_error(std::string("config: providers.bwrap.identity: ") + e.what());
    } catch (const std::runtime_error& e) {
        throw config_error(e.what());
    }
    if (auto note = provider->degraded(); !note.empty()) spdlog::warn("provider bwrap: {}", note);
    return provider;
}

void add_providers(Node& node) {
    const auto& c = node.config;
    const auto add = [&node](std::unique_ptr<Provider> provider) {
        auto key = provider->key();
        node.providers.emplace(key, metered_provider(std::move(provider), node.metrics));
    };
    if (c.bwrap.enabled) add(make_bwrap(c));
    if (c.noop_provider) add(make_noop_provider());
    for (std::size_t i = 0; i < c.plugins.size(); ++i) {
        if (node.providers.count(c.plugins[i].provider)) {
            throw config_error("config: providers.plugins[" + std::to_string(i) + "].provider: \"" +
                               c.plugins[i].provider + "\" is already taken");
        }
        PluginTuning tuning;
        tuning.instance_id = node.node_id;
        auto provider = make_plugin_provider(c.plugins[i], std::move(tuning));
        provider->on_late_sandbox(
            [&node](Lease lease) { record_late_sandbox(node, std::move(lease)); });
        add(std::move(provider));
    }
}

}  // namespace

Daemon::Daemon(Config config) : impl_(std::make_unique<Impl>()) {
    validate_config(config);
    impl_->node.config = std::move(config);
    impl_->build_node();
}

namespace {

/// When a provider's sandboxes outlive their daemon: reads which instance ran this node on
/// this state directory before (Node::predecessor_instance), and records this one. The
/// provider holds the state's lock (bwrap: <stateDir>/sandboxes/.lock), so the instance read
/// is gone. A file that cannot be read or written only costs the fast takeover.
void note_instance(Node& node) {
    bool outlives = false;
    for (const auto& [key, provider] : node.providers) outlives |= provider->outlives_daemon();
    if (!outlives) return;
    const fs::path file = fs::path(node.config.state_dir) / "node-instance";
    {
        std::ifstream in(file);
        std::string node_id;
        std::string instance;
        if (in >> node_id >> instance && node_id == node.node_id) {
            node.predecessor_instance = instance;
        }
    }
    std::ofstream out(file, std::ios::trunc);
    out << node.node_id << " " << node.instance_id << "\n";
    if (!out) spdlog::warn("node={}: cannot write {}", node.node_id, file.string());
}

}  // namespace

void Daemon::Impl::build_node() {
    auto& c = node.config;
    node.send_budget = std::make_unique<SendBudget>(c.limits.send_queue_bytes,
                                                    c.limits.send_queue_bytes_per_connection);
    std::error_code ec;
    fs::create_directories(c.state_dir, ec);
    if (ec)
        throw config_error("config: stateDir: cannot create " + c.state_dir + ": " + ec.message());
    ::chmod(c.state_dir.c_str(), 0700);
    node.node_id = c.node_id.empty() ? host_name() : c.node_id;
    node.instance_id = random_hex(8);
    if (c.console_enabled) {
        console = ConsoleAssets::load(c.console_assets_dir);
        if (console.available()) {
            spdlog::info("console: serving GET /console from {}", console.dir());
        } else {
            spdlog::error("console: enabled but not available: {}", console.problem());
        }
    }
    if (!c.audit_file.empty() || c.audit_journald) {
        try {
            node.audit = std::make_shared<AuditLog>(c.audit_file, c.audit_journald, node.node_id,
                                                    node.instance_id);
        } catch (const std::system_error& e) {
            throw config_error(std::string("config: audit.file: ") + e.what());
        }
    }
    node.ioc = &ioc;
    if (c.tokens.empty()) token_path = ensure_admin_token(c.state_dir);
    node.set_security(std::make_shared<const Security>(build_security(c, token_path)));
    warn_unbound_peer_tokens(c);
    node.registry = make_registry(node, ioc);
    add_providers(node);
    note_instance(node);
    node.metrics.build_info.with({version_string}).set(1);
    node.metrics.registry.on_collect([g = &gauges] { g->collect(); });
}

Daemon::~Daemon() {
    impl_->listeners.stop_loops();
    impl_->node.lease_watch.reset();
    impl_->node.blocking.join();
    impl_->node.registry.reset();  // its lanes finish while the io_context still exists
    // Impl destroys its io_context before the Node: what the Node holds that lives on that
    // io_context (the peer links' sockets and timers) goes first.
    impl_->node.peers.clear();
    impl_->node.detached.clear();
    impl_->node.channels.clear();
}

const std::string& Daemon::node_id() const noexcept { return impl_->node.node_id; }
const std::string& Daemon::plain_address() const noexcept { return impl_->listeners.plain_bound(); }
const std::string& Daemon::generated_token_path() const noexcept { return impl_->token_path; }

std::string Daemon::start() {
    auto& node = impl_->node;
    auto& listeners = impl_->listeners;
    const bool tls = node.security()->listener_tls != nullptr;
    listeners.bind();
    node.advertise_url = node.config.advertise_url.empty()
                             ? std::string(tls ? "wss://" : "ws://") + listeners.bound() + "/v1/ws"
                             : node.config.advertise_url;
    node.started_at_ms = now_ms();
    NodeRecord record{node.node_id, node.advertise_url, node.started_at_ms, node.started_at_ms,
                      node.instance_id};
    // Listening at once: /healthz and /readyz answer while the registration runs (and is
    // retried while the registry cannot be reached); upgrades wait for it (503).
    listeners.start();
    spdlog::info("node={} bound {} ({}){}; registering with the {} registry", node.node_id,
                 listeners.bound(), tls ? "TLS" : "plain",
                 listeners.plain_bound().empty() ? std::string()
                                                 : ", and " + listeners.plain_bound() + " (plain)",
                 node.config.registry.kind);
    // The io_context does not run yet: drive it here until the registration finished.
    node.renewed_at_ms = run_until_done(
        impl_->ioc,
        net::co_spawn(impl_->ioc, impl_->membership.register_at_start(record), net::use_future));
    // Before any request is served: the sandboxes an earlier process of this node left
    // running for it are re-adopted (issue 47).
    try {
        run_until_done(impl_->ioc,
                       net::co_spawn(impl_->ioc, adopt_own_sandboxes(node), net::use_future));
    } catch (const std::exception& e) {
        spdlog::warn("node={} could not list its leases to re-adopt their sandboxes: {}",
                     node.node_id, e.what());
    }
    // Then their detached channels, and the kept output of those that did not outlive the
    // last process goes.
    try {
        run_until_done(impl_->ioc,
                       net::co_spawn(impl_->ioc, restore_kept_channels(node), net::use_future));
    } catch (const std::exception& e) {
        spdlog::warn("node={} could not restore its kept detached channels: {}", node.node_id,
                     e.what());
    }
    // Before any acquire can run (upgrades wait for node.registered): sandboxes that an
    // earlier process made and was killed before recording are destroyed.
    try {
        run_until_done(impl_->ioc, net::co_spawn(impl_->ioc, destroy_unrecorded_sandboxes(node),
                                                 net::use_future));
    } catch (const std::exception& e) {
        spdlog::warn(
            "node={} could not check its sandboxes against the registry (left for "
            "the next start): {}",
            node.node_id, e.what());
    }
    impl_->membership.start();
    node.registered = true;
    spdlog::info("node={} version={} registry={} providers={} instance={}", node.node_id,
                 version_string, node.config.registry.kind, node.providers.size(),
                 node.instance_id);
    return listeners.bound();
}

void Daemon::run() {
    // This thread runs `ioc` (the node's own work and its share of the connections); the
    // other connection loops run on theirs since start(). Once `ioc` stopped (finish_stop:
    // every channel reaped, every connection closed), the other loops are stopped too.
    impl_->ioc.run();
    impl_->listeners.stop_loops();
}

void Daemon::stop() { impl_->stop(); }

void Daemon::Impl::stop() {
    if (node.stopping.exchange(true)) return;
    net::post(ioc, [impl = this] {
        impl->node.draining = true;
        spdlog::info("node={} stopping: closing connections and channels", impl->node.node_id);
        impl->listeners.close();
        impl->membership.cancel();
        impl->sessions.for_each([](Session& s) { s.shutdown(); });
        // Channels get SIGHUP now and SIGKILL after the hangup grace; the io_context runs
        // until every one is reaped, then run() returns.
        net::co_spawn(impl->ioc, impl->finish_stop(), net::detached);
    });
}

void Daemon::drain() { impl_->drain.begin(); }

void Daemon::drain_then_stop() { impl_->drain.then_stop(); }

awaitable<void> Daemon::Impl::finish_stop() {
    auto work_unwatch = [this] { node.lease_watch.reset(); };  // joins its thread: not here
    co_await offload(node.blocking, std::move(work_unwatch));
    // A node whose sandboxes outlive it keeps them, its leases and its record for its next
    // process (issue 47), unless it was decommissioned.
    bool keep = false;
    if (!node.decommissioning.load()) {
        for (const auto& [key, provider] : node.providers) {
            if (!provider->outlives_daemon()) continue;
            provider->keep_at_stop();
            keep = true;
        }
    }
    if (keep) {
        spdlog::info(
            "node={} stopping: keeping {} sandbox(es), their leases and this node's "
            "record for the next process",
            node.node_id, node.cache.snapshot().size());
    } else {
        try {
            co_await node.registry->remove_node(node.node_id, node.instance_id);
        } catch (const std::exception& e) {
            spdlog::warn("node={} could not remove its node record: {}", node.node_id, e.what());
        }
    }
    net::steady_timer t(ioc);
    // Every process reaped, then every channel's end recorded (its output flushed, its
    // channel.ended written), which follows the reap on the channel's strand.
    // The reaping is bounded by the hangup grace (then SIGKILL); an end that still does not
    // come within 5 s more is logged and left.
    const auto give_up = std::chrono::steady_clock::now() +
                         std::chrono::milliseconds(node.config.limits.hangup_grace_ms) +
                         std::chrono::seconds(5);
    // Kept detached channels go on without this process (kept_channels.hpp): not waited for.
    const auto busy = [this, keep] {
        const std::size_t kept_running = keep ? node.channels.kept() : 0;
        return node.channels.size() > kept_running ||
               node.channels_unended.load(std::memory_order_acquire) >
                   static_cast<std::int64_t>(kept_running);
    };
    while (busy()) {
        if (std::chrono::steady_clock::now() > give_up) {
            spdlog::warn("node={} stopping with {} channels not reaped and {} not ended",
                         node.node_id, node.channels.size(), node.channels_unended.load());
            break;
        }
        t.expires_after(std::chrono::milliseconds(20));
        co_await t.async_wait(use_awaitable);
    }
    // Every connection writes what it has queued (an exit just sent among it), then its close
    // (Session::shutdown): at most 3 s more for hosts that do not read.
    const auto closed_by = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (sessions.not_closed() > 0 && std::chrono::steady_clock::now() < closed_by) {
        t.expires_after(std::chrono::milliseconds(20));
        co_await t.async_wait(use_awaitable);
    }
    // The close frames just started go out on the next turns of the loop.
    t.expires_after(std::chrono::milliseconds(20));
    co_await t.async_wait(use_awaitable);
    ioc.stop();
}

namespace {

awaitable<void> tick_loop(net::steady_timer& timer, std::chrono::milliseconds interval,
                          std::function<void()> fn) {
    for (;;) {
        fn();
        timer.expires_after(interval);
        auto [ec] = co_await timer.async_wait(as_tuple_awaitable);
        if (ec) co_return;
    }
}

}  // namespace

void Daemon::on_tick(std::chrono::milliseconds interval, std::function<void()> fn) {
    auto& timer = *impl_->tick_timers.emplace_back(std::make_unique<net::steady_timer>(impl_->ioc));
    net::co_spawn(impl_->ioc, tick_loop(timer, interval, std::move(fn)), net::detached);
}

std::string Daemon::status() const {
    // The lease count comes from the registry, read at most every 10 s, in the background.
    net::co_spawn(impl_->ioc, impl_->gauges.refresh_lease_counts(), net::detached);
    const auto& node = impl_->node;
    const char* state = node.draining               ? "draining"
                        : node.fenced_for_ms() != 0 ? "fenced"
                                                    : "serving";
    return std::to_string(node.channels.size()) + " channels, " +
           std::to_string(impl_->gauges.active_leases()) + " leases, " + state;
}

}  // namespace sandboxd
