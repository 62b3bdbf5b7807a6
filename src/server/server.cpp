#include <sandboxd/server/server.hpp>

#include "server/console.hpp"
#include "server/lease_service.hpp"
#include "server/metered.hpp"
#include "server/node.hpp"
#include "server/session.hpp"

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/provider/plugin_provider.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>

#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>
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

std::string read_secret_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw config_error("config: auth: cannot read token file " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) {
        s.pop_back();
    }
    if (s.empty()) throw config_error("config: auth: token file " + path + " is empty");
    return s;
}

std::string host_name() {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "node";
    return buf;
}

std::string format_endpoint(const tcp::endpoint& ep) {
    auto addr = ep.address();
    std::string host = addr.is_v6() ? "[" + addr.to_string() + "]" : addr.to_string();
    return host + ":" + std::to_string(ep.port());
}

http::response<http::string_body> plain(http::status status, std::string body, unsigned version,
                                        bool keep_alive) {
    http::response<http::string_body> res{status, version};
    res.set(http::field::server, std::string("sandboxd/") + version_string);
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.keep_alive(keep_alive);
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
}

/// Registers this node. When the record belongs to another instance whose heartbeat is still
/// fresh, waits one liveness TTL: a live process keeps heartbeating (then this start is
/// refused), a dead one (e.g. killed with SIGKILL) does not, and its record is taken over.
/// Returns the steady-clock time (steady_now_ms) at which the registration that succeeded was
/// sent: the node's first renewal.
awaitable<std::int64_t> register_or_take_over(Registry& registry, NodeRecord record,
                                              std::int64_t ttl_ms, std::int64_t heartbeat_ms) {
    try {
        const auto sent = steady_now_ms();
        co_await registry.register_node(record, ttl_ms);
        co_return sent;
    } catch (const rpc_error& e) {
        if (e.code() != errc::invalid_params) throw;
    }
    const auto seen = co_await registry.get_node(record.node_id);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(ttl_ms + heartbeat_ms);
    spdlog::info("node={} is held by another instance; waiting up to {} ms to see if it is alive",
                 record.node_id, ttl_ms + heartbeat_ms);
    net::steady_timer pause(co_await net::this_coro::executor);
    while (std::chrono::steady_clock::now() < deadline) {
        pause.expires_after(std::chrono::milliseconds(100));
        co_await pause.async_wait(use_awaitable);
        const auto now = co_await registry.get_node(record.node_id);
        if (seen && now && now->instance_id == seen->instance_id &&
            now->heartbeat_at_ms != seen->heartbeat_at_ms) {
            throw rpc_error(errc::invalid_params,
                            "node id " + record.node_id + " is already held by a live process "
                            "(its heartbeat advanced); give this process another --node-id");
        }
        NodeRecord fresh = record;
        fresh.heartbeat_at_ms = now_ms();
        try {
            const auto sent = steady_now_ms();
            co_await registry.register_node(fresh, ttl_ms);
            co_return sent;
        } catch (const rpc_error& e) {
            if (e.code() != errc::invalid_params) throw;
        }
    }
    throw rpc_error(errc::invalid_params,
                    "node id " + record.node_id + " is still held by another process");
}

/// The tokens and the TLS material of `c` (files read now): config_error naming the field and
/// file when one cannot be used. `admin_token_path`: the generated token, when c has none.
Security build_security(const Config& c, const std::string& admin_token_path) {
    Security s;
    for (const auto& t : c.tokens) {
        const std::string secret = t.token.empty() ? read_secret_file(t.token_file) : t.token;
        Principal p{t.name, t.role, t.tenants};
        p.token_sha256 = token_hash(secret);
        p.node_id = t.node_id;
        p.reads_metrics = t.role == "metrics" || t.role == "peer";
        if (t.role == "peer" && s.peer_token.empty()) s.peer_token = secret;
        s.credentials.push_back({std::move(p)});
    }
    if (s.credentials.empty() && !admin_token_path.empty()) {
        Principal p{"admin", "host", {"*"}};
        p.token_sha256 = token_hash(read_secret_file(admin_token_path));
        // The node's only credential when none is configured: the operator's, who may scrape.
        p.reads_metrics = true;
        s.credentials.push_back({std::move(p)});
    }
    if (c.tls.enabled()) {
        TlsServerOptions o;
        o.cert_file = c.tls.cert_file;
        o.key_file = c.tls.key_file;
        o.client_ca_file = c.tls.client_ca_file;
        o.peer_ca_file = c.peer_tls.ca_file;
        o.min_version = c.tls.min_version;
        s.listener_tls = make_server_tls(o, "tls");
    }
    if (!c.peer_tls.empty()) {
        TlsClientOptions o;
        o.ca_file = c.peer_tls.ca_file;
        o.cert_file = c.peer_tls.cert_file;
        o.key_file = c.peer_tls.key_file;
        s.peer_client_tls = make_client_tls(o, "routing.peerTls");
        s.peer_ca = std::make_shared<const ClientCertVerifier>(c.peer_tls.ca_file, "routing.peerTls.caFile");
    }
    const bool https_registry =
        c.registry.kind == "etcd" &&
        std::any_of(c.registry.endpoints.begin(), c.registry.endpoints.end(),
                    [](const std::string& e) { return e.rfind("https://", 0) == 0; });
    if (!c.registry.tls.empty() || https_registry) {
        // Built once here (not per connection): registry.tls, else the system's trust store.
        TlsClientOptions o;
        o.ca_file = c.registry.tls.ca_file;
        o.cert_file = c.registry.tls.cert_file;
        o.key_file = c.registry.tls.key_file;
        s.registry_tls = make_client_tls(o, "registry.tls");
    }
    if (!s.peer_client_tls && c.tls.enabled()) {
        // Peers of a TLS node are reached with wss://: the system's trust store, no client
        // certificate, built once.
        s.peer_client_tls = make_client_tls(TlsClientOptions{}, "routing.peerTls");
    }
    return s;
}

}  // namespace

struct Daemon::Impl {
    Node node;
    net::io_context ioc;
    tcp::acceptor acceptor{ioc};
    /// plainListen: plain text on loopback beside a TLS `listen`; closed when not configured.
    tcp::acceptor plain_acceptor{ioc};
    std::string bound;
    std::string plain_bound;
    std::string token_path;
    net::steady_timer heartbeat_timer{ioc};
    net::steady_timer sweep_timer{ioc};
    net::steady_timer fence_timer{ioc};
    /// Daemon::on_tick's timers: they run until the io_context stops, through the drain.
    std::vector<std::unique_ptr<net::steady_timer>> tick_timers;
    /// sandboxd_leases{status}: when it was last read from the registry (steady ms; 0 never).
    std::atomic<std::int64_t> leases_read_ms{0};
    std::atomic<std::int64_t> active_leases{0};
    std::mutex sessions_mutex;
    std::vector<std::weak_ptr<Session>> sessions;
    /// The connections' event loops beside `ioc` (threads - 1 of them, one thread each,
    /// started by start_connection_loops()). A connection runs on one loop for its whole
    /// life (round robin over `ioc` and these): its socket, its channels' pipes and its
    /// timers are served by one thread, so a stream's handlers never hop between threads.
    /// Declared after `ioc`: destroyed (with the handlers they still hold) before it.
    std::vector<std::unique_ptr<net::io_context>> connection_loops;
    std::vector<net::executor_work_guard<net::io_context::executor_type>> connection_work;
    std::vector<std::thread> connection_threads;
    std::atomic<std::size_t> next_loop{0};
    /// Makes and starts the connection loops (once, from start()).
    void start_connection_loops();
    /// Stops them and joins their threads (idempotent; from run() and the destructor).
    void stop_connection_loops();
    /// The loop of the next accepted connection: `ioc` or one of connection_loops.
    net::io_context& next_connection_loop() {
        const auto i = next_loop.fetch_add(1, std::memory_order_relaxed) % (connection_loops.size() + 1);
        return i == 0 ? ioc : *connection_loops[i - 1];
    }
    /// The browser console's files, read at start when console.enabled (read-only after).
    ConsoleAssets console;

    /// Which listener a connection came in on: `listen` (TLS or not) or plainListen.
    enum class listener_kind { main, plain };
    /// Connections open now, and those not yet authenticated (issue 44, item 3); the caps
    /// in force (limits.connections and limits.pendingConnections, each at most RLIMIT_NOFILE
    /// less the descriptor reserve), set by start().
    std::atomic<std::uint32_t> connections_open{0};
    std::atomic<std::uint32_t> connections_pending{0};
    std::uint32_t connection_cap = 0;
    std::uint32_t pending_cap = 0;
    /// One accepted connection's place under the caps: open (and pending) until destroyed,
    /// pending until authenticated(). Moves with the connection's coroutine.
    class ConnectionSlot {
    public:
        explicit ConnectionSlot(Impl& impl) : impl_(&impl) {}
        ConnectionSlot(ConnectionSlot&& o) noexcept
            : impl_(std::exchange(o.impl_, nullptr)), pending_(o.pending_) {}
        ConnectionSlot& operator=(ConnectionSlot&&) = delete;
        ConnectionSlot(const ConnectionSlot&) = delete;
        ConnectionSlot& operator=(const ConnectionSlot&) = delete;
        ~ConnectionSlot() {
            if (!impl_) return;
            authenticated();
            impl_->connections_open.fetch_sub(1, std::memory_order_acq_rel);
        }
        /// The connection has its WebSocket session: it no longer counts as pending.
        void authenticated() noexcept {
            if (impl_ && std::exchange(pending_, false)) {
                impl_->connections_pending.fetch_sub(1, std::memory_order_acq_rel);
            }
        }

    private:
        Impl* impl_;
        bool pending_ = true;
    };
    /// Takes a slot for a connection just accepted, or says which cap refuses it.
    std::optional<ConnectionSlot> admit_connection(std::string& refused_by);
    /// Answers 503 naming the cap on the accepted socket `fd` and shuts it down, without
    /// waiting for the peer (never blocks); the caller closes it.
    void refuse_connection(int fd, const std::string& refused_by);
    /// Sets connection_cap and pending_cap from the config and RLIMIT_NOFILE; logs them.
    void set_connection_caps();

    /// Accepts on `acc`; `tls`: each connection's TLS handshake first (the listener's
    /// context at the time of the accept).
    awaitable<void> accept_loop(tcp::acceptor& acc, bool tls, listener_kind listener);
    awaitable<void> serve(tcp::socket socket, bool tls, listener_kind listener, ConnectionSlot slot);
    awaitable<void> serve_http(ConnStream stream, listener_kind listener, ConnectionSlot& slot);
    /// GET /metrics: the exposition, or why not (401 without a token it may take, 403 for a
    /// token whose role may not read it).
    awaitable<http::response<http::string_body>> serve_metrics(
        const http::request<http::string_body>& req, listener_kind listener, bool keep);
    /// Binds `acc` to `address` (config field `field`); returns the bound HOST:PORT.
    std::string bind(tcp::acceptor& acc, const std::string& address, const std::string& field);
    awaitable<void> heartbeat_loop();
    awaitable<void> rejoin();
    /// Steady-clock time at which the last heartbeat that succeeded was sent.
    std::atomic<std::int64_t> beat_sent_ms{0};
    /// A rejoin() runs: the node stays fenced until it ended what it lost.
    std::atomic<bool> rejoining{false};
    awaitable<void> sweep_loop();
    void start_lease_watch();
    awaitable<bool> registry_reachable();
    /// register_or_take_over(), retried with backoff while the registry is unreachable, for
    /// at most registry.startupTimeoutMs; every failed attempt is logged and kept as
    /// node.startup_problem. Throws the last error when the time runs out, and at once for
    /// anything but REGISTRY_UNAVAILABLE (a live node with the same id).
    awaitable<std::int64_t> register_at_start(NodeRecord record);
    /// Daemon::stop().
    void stop();
    awaitable<void> finish_stop();
    /// Drain (Daemon::drain): the drain's one run, then stop() when stop_when_drained.
    std::atomic<bool> drain_started{false};
    std::atomic<bool> drain_over{false};
    std::atomic<bool> stop_when_drained{false};
    /// Daemon::drain().
    void begin_drain();
    awaitable<void> drain_loop();
    /// Waits until `done()` or `until`, woken by each channel that ends here and every
    /// 100 ms (relayed channels end on their connections' strands, with no signal).
    awaitable<void> wait_channels(std::function<bool()> done, std::chrono::steady_clock::time_point until);
    /// POST /admin/drain: `who` authenticated; the response.
    http::response<http::string_body> admin_drain(const std::optional<Principal>& who, ConnStream& stream,
                                                  const std::string& peer, unsigned version);
    /// Logs the moment this node fences itself (its membership not renewed within 2/3 of
    /// nodeTtlMs) and the moment it unfences, and keeps sandboxd_fenced.
    awaitable<void> fence_watch();
    awaitable<void> tick_loop(net::steady_timer& timer, std::chrono::milliseconds interval,
                              std::function<void()> fn);
    /// Reads this node's lease counts by status from the registry when the last reading is
    /// older than 10 s (sandboxd_leases); a failure keeps the last values.
    awaitable<void> refresh_lease_counts();
    /// Brings the gauges and mirrored counters up to date (MetricRegistry::on_collect).
    void collect_metrics();
    /// Why a peer link may not say it comes from the node it names (issue 44, item 4), or ""
    /// when it may: a token bound to a node (auth.tokens[].nodeId), or a client certificate
    /// that names DNS names (its subjectAltName), holds Sandboxd-Forwarded-By to that node, or
    /// to one of those names.
    [[nodiscard]] std::string peer_binding_refusal(ConnStream& stream, const Principal& who,
                                                   const http::request<http::string_body>& req) const {
        if (who.role != "peer") return {};
        const std::string by(req["Sandboxd-Forwarded-By"]);
        if (!who.node_id.empty() && by != who.node_id) {
            return "peer token \"" + who.name + "\" is bound to node " + who.node_id +
                   "; this link says it comes from " + (by.empty() ? std::string("no node") : "node " + by.substr(0, 200));
        }
        auto* t = stream.tls();
        if (t == nullptr || !node.security()->peer_ca) return {};
        const auto names = peer_certificate_dns_names(t->native_handle());
        if (names.empty() || std::find(names.begin(), names.end(), by) != names.end()) return {};
        return "the peer link's client certificate names DNS " + join_names(names) +
               "; this link says it comes from " + (by.empty() ? std::string("no node") : "node " + by.substr(0, 200));
    }

    static std::string join_names(const std::vector<std::string>& names) {
        std::string out;
        for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
        return out;
    }

    /// Whether `who` may use this connection: a `peer` token needs, when routing.peerTls is
    /// set, a client certificate that the cluster CA verified (in the TLS handshake).
    bool peer_certified(ConnStream& stream, const Principal& who) const {
        if (who.role != "peer") return true;
        const auto security = node.security();
        if (!security->peer_ca) return true;
        auto* t = stream.tls();
        return t != nullptr && security->peer_ca->verifies(t->native_handle());
    }
};

Daemon::Daemon(Config config) : impl_(std::make_unique<Impl>()) {
    validate_config(config);
    auto& node = impl_->node;
    node.config = std::move(config);
    auto& c = node.config;
    node.send_budget = std::make_unique<SendBudget>(c.limits.send_queue_bytes,
                                                    c.limits.send_queue_bytes_per_connection);
    std::error_code ec;
    fs::create_directories(c.state_dir, ec);
    if (ec) throw config_error("config: stateDir: cannot create " + c.state_dir + ": " + ec.message());
    ::chmod(c.state_dir.c_str(), 0700);
    node.node_id = c.node_id.empty() ? host_name() : c.node_id;
    node.instance_id = random_hex(8);
    if (c.console_enabled) {
        impl_->console = ConsoleAssets::load(c.console_assets_dir);
        if (impl_->console.available()) {
            spdlog::info("console: serving GET /console from {}", impl_->console.dir());
        } else {
            spdlog::error("console: enabled but not available: {}", impl_->console.problem());
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

    node.ioc = &impl_->ioc;
    if (c.tokens.empty()) {
        impl_->token_path = (fs::path(c.state_dir) / "admin.token").string();
        if (!fs::exists(impl_->token_path)) {
            const auto tmp = impl_->token_path + ".tmp";
            {
                std::ofstream out(tmp, std::ios::trunc);
                out << random_hex(24) << "\n";
                if (!out) throw config_error("config: stateDir: cannot write " + tmp);
            }
            ::chmod(tmp.c_str(), 0600);
            fs::rename(tmp, impl_->token_path);
        }
    }
    node.set_security(std::make_shared<const Security>(build_security(c, impl_->token_path)));
    for (const auto& t : c.tokens) {
        if (t.role == "peer" && t.node_id.empty() && c.peer_tls.empty()) {
            spdlog::warn("auth.tokens: peer token \"{}\" names no node: a link with it may say it "
                         "comes from any node (it acts only within its own tenants); binding it to "
                         "its node with nodeId, or routing.peerTls certificates that name the node, "
                         "is safer",
                         t.name);
        }
    }

    if (c.registry.kind == "etcd") {
        std::string password;
        if (!c.registry.password_file.empty()) {
            try {
                password = read_secret_file(c.registry.password_file);
            } catch (const config_error&) {
                throw config_error("config: registry.passwordFile: cannot read " +
                                   c.registry.password_file + ", or it is empty");
            }
        }
        node.registry = metered_registry(
            make_etcd_registry(impl_->ioc.get_executor(), c.registry.endpoints, c.registry.prefix,
                               c.node_ttl_ms, c.registry.username, password,
                               [n = &node] { return n->security()->registry_tls; },
                               &node.metrics.registry_bad_records.only()),
            node.metrics);
    } else {
        const auto db = c.registry.path.empty()
                            ? (fs::path(c.state_dir) / "registry.db").string()
                            : c.registry.path;
        node.registry = metered_registry(
            make_sqlite_registry(db, 2, &node.metrics.registry_bad_records.only()), node.metrics);
    }

    if (c.bwrap.enabled) {
        BwrapOptions opts;
        opts.bwrap_path = c.bwrap.path;
        opts.init_path = c.bwrap.init_path;
        opts.sandboxes_dir = fs::path(c.state_dir) / "sandboxes";
        opts.allow_network = c.bwrap.allow_network;
        opts.limits = c.bwrap.limits;
        opts.identity = c.bwrap.identity;
        opts.etc_files = c.bwrap.etc_files;
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
        if (auto note = provider->degraded(); !note.empty()) {
            spdlog::warn("provider bwrap: {}", note);
        }
        auto key = provider->key();
        node.providers.emplace(key, metered_provider(std::move(provider), node.metrics));
    }
    if (c.noop_provider) {
        auto provider = make_noop_provider();
        auto key = provider->key();
        node.providers.emplace(key, metered_provider(std::move(provider), node.metrics));
    }
    for (std::size_t i = 0; i < c.plugins.size(); ++i) {
        if (node.providers.count(c.plugins[i].provider)) {
            throw config_error("config: providers.plugins[" + std::to_string(i) +
                               "].provider: \"" + c.plugins[i].provider + "\" is already taken");
        }
        auto key = c.plugins[i].provider;
        PluginTuning tuning;
        tuning.instance_id = node.node_id;
        auto provider = make_plugin_provider(c.plugins[i], std::move(tuning));
        provider->on_late_sandbox([&node](Lease lease) { record_late_sandbox(node, std::move(lease)); });
        node.providers.emplace(key, metered_provider(std::move(provider), node.metrics));
    }
    node.metrics.build_info.with({version_string}).set(1);
    node.metrics.registry.on_collect([impl = impl_.get()] { impl->collect_metrics(); });
}

Daemon::~Daemon() {
    impl_->stop_connection_loops();
    impl_->node.lease_watch.reset();
    impl_->node.blocking.join();
    impl_->node.registry.reset();  // its lanes finish while the io_context still exists
    // Impl destroys its io_context before the Node: what the Node holds that lives on that
    // io_context (the peer links' sockets and timers) goes first.
    impl_->node.peers.clear();
}

const std::string& Daemon::node_id() const noexcept { return impl_->node.node_id; }
const std::string& Daemon::plain_address() const noexcept { return impl_->plain_bound; }
const std::string& Daemon::generated_token_path() const noexcept { return impl_->token_path; }

std::string Daemon::start() {
    auto& node = impl_->node;
    const bool tls = node.security()->listener_tls != nullptr;
    impl_->bound = impl_->bind(impl_->acceptor, node.config.listen, "listen");
    if (!node.config.plain_listen.empty()) {
        impl_->plain_bound = impl_->bind(impl_->plain_acceptor, node.config.plain_listen, "plainListen");
    }
    node.advertise_url = node.config.advertise_url.empty()
                             ? std::string(tls ? "wss://" : "ws://") + impl_->bound + "/v1/ws"
                             : node.config.advertise_url;
    node.started_at_ms = now_ms();
    NodeRecord record{node.node_id, node.advertise_url, node.started_at_ms, node.started_at_ms,
                      node.instance_id};
    auto log_failure = [](const std::exception_ptr& e) {
        if (!e) return;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("daemon task failed: {}", ex.what());
        }
    };
    // Listening at once: /healthz and /readyz answer while the registration runs (and is
    // retried while the registry cannot be reached); upgrades wait for it (503).
    impl_->start_connection_loops();
    impl_->set_connection_caps();
    net::co_spawn(impl_->ioc, impl_->accept_loop(impl_->acceptor, tls, Impl::listener_kind::main),
                  log_failure);
    if (impl_->plain_acceptor.is_open()) {
        net::co_spawn(impl_->ioc,
                      impl_->accept_loop(impl_->plain_acceptor, false, Impl::listener_kind::plain),
                      log_failure);
    }
    spdlog::info("node={} bound {} ({}){}; registering with the {} registry", node.node_id,
                 impl_->bound, tls ? "TLS" : "plain",
                 impl_->plain_bound.empty() ? std::string() : ", and " + impl_->plain_bound + " (plain)",
                 node.config.registry.kind);
    {
        // The io_context does not run yet: drive it here until the registration finished.
        node.renewed_at_ms = run_until_done(
            impl_->ioc, net::co_spawn(impl_->ioc, impl_->register_at_start(record), net::use_future));
    }
    {
        // Before any acquire can run (upgrades wait for node.registered): sandboxes that an
        // earlier process made and was killed before recording are destroyed.
        try {
            run_until_done(impl_->ioc, net::co_spawn(impl_->ioc, destroy_unrecorded_sandboxes(node),
                                                     net::use_future));
        } catch (const std::exception& e) {
            spdlog::warn("node={} could not check its sandboxes against the registry (left for "
                         "the next start): {}",
                         node.node_id, e.what());
        }
    }
    impl_->start_lease_watch();
    net::co_spawn(impl_->ioc, impl_->heartbeat_loop(), log_failure);
    net::co_spawn(impl_->ioc, impl_->sweep_loop(), log_failure);
    net::co_spawn(impl_->ioc, impl_->fence_watch(), log_failure);
    node.registered = true;
    spdlog::info("node={} version={} registry={} providers={} instance={}", node.node_id,
                 version_string, node.config.registry.kind, node.providers.size(),
                 node.instance_id);
    return impl_->bound;
}

bool Daemon::reload(const Config& next) {
    auto& node = impl_->node;
    // The audit file first, whatever becomes of the rest: logrotate moved it away.
    if (node.audit) {
        if (auto problem = node.audit->reopen(); !problem.empty()) {
            spdlog::error("node={} reload: cannot reopen the audit file, lines go to the old one: {}",
                          node.node_id, problem);
        }
    }
    std::shared_ptr<const Security> fresh;
    try {
        validate_config(next);
        fresh = std::make_shared<const Security>(build_security(next, impl_->token_path));
    } catch (const std::exception& e) {
        spdlog::error("node={} reload failed, keeping the tokens and certificates in use: {}", node.node_id,
                      e.what());
        return false;
    }
    // What a reload does not apply: everything but the tokens and the TLS files.
    const auto without_reloaded = [](const Config& c) {
        auto j = config_to_json(c);
        j["auth"].erase("tokens");
        j.erase("tls");
        j["routing"].erase("peerTls");
        j["registry"].erase("tls");
        return j;
    };
    const auto before = without_reloaded(node.config);
    const auto after = without_reloaded(next);
    std::vector<std::string> ignored;
    for (const auto& [key, value] : after.items()) {
        if (!before.contains(key) || before[key] != value) ignored.push_back(key);
    }
    if (!ignored.empty()) {
        std::string keys;
        for (const auto& k : ignored) keys += (keys.empty() ? "" : ", ") + k;
        spdlog::warn("node={} reload: changes to {} are not applied until a restart", node.node_id, keys);
    }
    if ((fresh->listener_tls != nullptr) != (node.security()->listener_tls != nullptr)) {
        // A listener cannot turn TLS on or off under its connections.
        spdlog::error("node={} reload failed: tls cannot be turned {} without a restart", node.node_id,
                      fresh->listener_tls ? "on" : "off");
        return false;
    }
    const auto old = node.security();
    node.set_security(fresh);
    const auto same = [](const Principal& a, const Principal& b) {
        return a.token_sha256 == b.token_sha256 && a.name == b.name && a.role == b.role &&
               a.tenants == b.tenants && a.node_id == b.node_id && a.reads_metrics == b.reads_metrics;
    };
    const auto kept = [&](const Principal& p) {
        return std::any_of(fresh->credentials.begin(), fresh->credentials.end(),
                           [&](const Credential& c) { return same(c.principal, p); });
    };
    std::size_t added = 0;
    std::size_t revoked = 0;
    for (const auto& c : fresh->credentials) {
        if (std::none_of(old->credentials.begin(), old->credentials.end(),
                         [&](const Credential& o) { return same(o.principal, c.principal); })) {
            ++added;
        }
    }
    for (const auto& c : old->credentials) revoked += kept(c.principal) ? 0 : 1;
    std::size_t closed = 0;
    {
        std::lock_guard lock(impl_->sessions_mutex);
        for (auto& weak : impl_->sessions) {
            auto session = weak.lock();
            if (!session || kept(session->principal())) continue;
            session->revoke();
            ++closed;
        }
    }
    spdlog::info("node={} reloaded: {} tokens ({} added, {} revoked; {} connections closed), TLS {}",
                 node.node_id, fresh->credentials.size(), added, revoked, closed,
                 fresh->listener_tls ? "certificate and key read again" : "off");
    return true;
}

std::string Daemon::Impl::bind(tcp::acceptor& acc, const std::string& address, const std::string& field) {
    const auto listen = parse_host_port(address);  // validate_config checked it
    tcp::resolver resolver(ioc);
    beast::error_code ec;
    auto results = resolver.resolve(listen.host, listen.port_text(),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
    if (ec || results.empty()) {
        throw config_error("config: " + field + ": cannot resolve " + address + ": " + ec.message());
    }
    tcp::endpoint endpoint = results.begin()->endpoint();
    acc.open(endpoint.protocol());
    acc.set_option(net::socket_base::reuse_address(true));
    acc.bind(endpoint, ec);
    if (ec) throw config_error("config: " + field + ": cannot bind " + address + ": " + ec.message());
    acc.listen(net::socket_base::max_listen_connections);
    return format_endpoint(acc.local_endpoint());
}

void Daemon::run() {
    // This thread runs `ioc` (the node's own work and its share of the connections); the
    // other connection loops run on theirs since start(). Once `ioc` stopped (finish_stop:
    // every channel reaped, every connection closed), the other loops are stopped too.
    impl_->ioc.run();
    impl_->stop_connection_loops();
}

void Daemon::Impl::start_connection_loops() {
    if (!connection_loops.empty()) return;
    const unsigned n = node.config.threads ? node.config.threads
                                           : std::max(1U, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < n; ++i) {
        connection_loops.push_back(std::make_unique<net::io_context>(1));
        connection_work.push_back(net::make_work_guard(*connection_loops.back()));
    }
    for (auto& loop : connection_loops) {
        connection_threads.emplace_back([&ctx = *loop] { ctx.run(); });
    }
}

void Daemon::Impl::stop_connection_loops() {
    connection_work.clear();
    for (auto& loop : connection_loops) loop->stop();
    for (auto& t : connection_threads) {
        if (t.joinable()) t.join();
    }
    connection_threads.clear();
}

void Daemon::stop() { impl_->stop(); }

void Daemon::Impl::stop() {
    if (node.stopping.exchange(true)) return;
    net::post(ioc, [impl = this] {
        impl->node.draining = true;
        spdlog::info("node={} stopping: closing connections and channels", impl->node.node_id);
        beast::error_code ec;
        impl->acceptor.close(ec);
        impl->plain_acceptor.close(ec);
        impl->heartbeat_timer.cancel();
        impl->sweep_timer.cancel();
        impl->fence_timer.cancel();
        {
            std::lock_guard lock(impl->sessions_mutex);
            for (auto& weak : impl->sessions) {
                if (auto s = weak.lock()) s->shutdown();
            }
        }
        // Channels get SIGHUP now and SIGKILL after the hangup grace; the io_context runs
        // until every one is reaped, then run() returns.
        net::co_spawn(impl->ioc, impl->finish_stop(), net::detached);
    });
}

void Daemon::drain() { impl_->begin_drain(); }

void Daemon::Impl::begin_drain() {
    if (drain_started.exchange(true)) return;
    node.draining = true;  // from this moment: no opens, no leases, /readyz draining
    net::co_spawn(ioc, drain_loop(), net::detached);
}

void Daemon::drain_then_stop() {
    // Either this sees the drain over, or the drain's end sees the flag (both sequentially
    // consistent): stop() runs at least once, and it is idempotent.
    impl_->stop_when_drained = true;
    if (impl_->drain_over) {
        impl_->stop();
    } else {
        impl_->begin_drain();
    }
}

awaitable<void> Daemon::Impl::wait_channels(std::function<bool()> done,
                                            std::chrono::steady_clock::time_point until) {
    using namespace net::experimental::awaitable_operators;
    auto ex = co_await net::this_coro::executor;
    auto removed = std::make_shared<ChannelTable::RemovalSignal>(ex, 1);
    node.channels.watch_removals(removed);
    net::steady_timer timer(ex);
    while (!done() && !node.stopping && std::chrono::steady_clock::now() < until) {
        timer.expires_at(std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)));
        co_await (removed->async_receive(as_tuple_awaitable) || timer.async_wait(as_tuple_awaitable));
    }
}

awaitable<void> Daemon::Impl::drain_loop() {
    const auto timeout = std::chrono::milliseconds(node.config.limits.drain_timeout_ms);
    // A channel is over once its exit is queued on its connection (channels_unended), which
    // follows its removal from the table (the reap).
    const auto ended_here = [this] {
        return node.channels.size() == 0 && node.channels_unended.load() == 0;
    };
    const auto running = [&] {
        return !ended_here() || node.relays_open.load() > 0 || node.opens_in_flight.load() > 0;
    };
    spdlog::info("node={} draining: new opens and leases are refused; {} channels and {} relayed "
                 "channels running get up to {} ms to finish",
                 node.node_id, node.channels.size(), node.relays_open.load(), timeout.count());
    if (node.audit) {
        node.audit->write("node.draining", {{"channels", node.channels.size()},
                                            {"relayedChannels", node.relays_open.load()},
                                            {"drainTimeoutMs", timeout.count()}});
    }
    co_await wait_channels([&] { return !running(); }, std::chrono::steady_clock::now() + timeout);
    if (node.stopping) co_return;
    if (const auto left = node.channels.all(); !left.empty()) {
        // The time is over: the channels still running here are stopped (their exits say
        // "stopped"); relayed ones are closed with the connections when the node stops.
        spdlog::info("node={} drain timeout of {} ms over: stopping {} channels", node.node_id,
                     timeout.count(), left.size());
        for (const auto& e : left) {
            net::post(e.strand, [weak = e.channel] {
                if (auto ch = weak.lock()) ch->stop(channel_outcome::stopped);
            });
        }
        co_await wait_channels(ended_here,
                               std::chrono::steady_clock::now() +
                                   std::chrono::milliseconds(node.config.limits.hangup_grace_ms) +
                                   std::chrono::seconds(5));
    } else {
        spdlog::info("node={} drained: no channel runs here", node.node_id);
    }
    drain_over = true;
    if (stop_when_drained) {
        stop();
    }
}

awaitable<void> Daemon::Impl::finish_stop() {
    auto work_unwatch = [this] { node.lease_watch.reset(); };  // joins its thread: not here
    co_await offload(node.blocking, std::move(work_unwatch));
    try {
        co_await node.registry->remove_node(node.node_id, node.instance_id);
    } catch (const std::exception& e) {
        spdlog::warn("node={} could not remove its node record: {}", node.node_id, e.what());
    }
    net::steady_timer t(ioc);
    // Every process reaped, then every channel's end recorded (its output flushed, its
    // channel.ended written), which follows the reap on the channel's strand.
    // The reaping is bounded by the hangup grace (then SIGKILL); an end that still does not
    // come within 5 s more is logged and left.
    const auto give_up = std::chrono::steady_clock::now() +
                         std::chrono::milliseconds(node.config.limits.hangup_grace_ms) +
                         std::chrono::seconds(5);
    while (node.channels.size() > 0 || node.channels_unended.load(std::memory_order_acquire) > 0) {
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
    const auto sessions_left = [this] {
        std::lock_guard lock(sessions_mutex);
        return std::count_if(sessions.begin(), sessions.end(), [](const auto& w) {
            auto s = w.lock();
            return s && !s->close_written();
        });
    };
    while (sessions_left() > 0 && std::chrono::steady_clock::now() < closed_by) {
        t.expires_after(std::chrono::milliseconds(20));
        co_await t.async_wait(use_awaitable);
    }
    // The close frames just started go out on the next turns of the loop.
    t.expires_after(std::chrono::milliseconds(20));
    co_await t.async_wait(use_awaitable);
    ioc.stop();
}

void Daemon::Impl::set_connection_caps() {
    const auto& l = node.config.limits;
    rlimit lim{};
    std::uint64_t nofile = 1024;
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) nofile = lim.rlim_cur;
    // The greater of 256 and a tenth, but never more than half: a node run with a tiny limit
    // (a test of descriptor exhaustion) still takes connections.
    const std::uint64_t reserve = std::min<std::uint64_t>(std::max<std::uint64_t>(256, nofile / 10), nofile / 2);
    const std::uint64_t room = nofile > reserve ? nofile - reserve : 0;
    connection_cap = static_cast<std::uint32_t>(std::min<std::uint64_t>(l.connections, room));
    pending_cap = static_cast<std::uint32_t>(std::min<std::uint64_t>(l.pending_connections, connection_cap));
    spdlog::info("node={} connections: at most {} open and {} not yet authenticated (limits.connections "
                 "{}, limits.pendingConnections {}; {} of RLIMIT_NOFILE {} kept for the node's own work)",
                 node.node_id, connection_cap, pending_cap, l.connections, l.pending_connections,
                 reserve, nofile);
    if (connection_cap == 0) {
        spdlog::error("node={} RLIMIT_NOFILE {} leaves no descriptor for connections beyond the "
                      "reserve of {}: every connection is refused", node.node_id, nofile, reserve);
    }
}

std::optional<Daemon::Impl::ConnectionSlot> Daemon::Impl::admit_connection(std::string& refused_by) {
    // Counted first, then checked: two accepts on two listeners never both take the last place.
    const auto open = connections_open.fetch_add(1, std::memory_order_acq_rel);
    const auto pending = connections_pending.fetch_add(1, std::memory_order_acq_rel);
    if (open >= connection_cap || pending >= pending_cap) {
        connections_open.fetch_sub(1, std::memory_order_acq_rel);
        connections_pending.fetch_sub(1, std::memory_order_acq_rel);
        refused_by = open >= connection_cap ? "connections" : "pendingConnections";
        return std::nullopt;
    }
    return std::optional<ConnectionSlot>(std::in_place, *this);
}

void Daemon::Impl::refuse_connection(int fd, const std::string& refused_by) {
    node.metrics.connections_refused.with({refused_by}).inc();
    const auto cap = refused_by == "connections" ? connection_cap : pending_cap;
    const std::string body = "node at its connection limit (limits." + refused_by + ", " +
                             std::to_string(cap) + "); try again later\n";
    const std::string res = "HTTP/1.1 503 Service Unavailable\r\nServer: sandboxd/" +
                            std::string(version_string) +
                            "\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
                            "Connection: close\r\nContent-Length: " + std::to_string(body.size()) +
                            "\r\n\r\n" + body;
    // One non-blocking send into an empty socket buffer: it takes the whole answer or the
    // peer gets the close alone. Over TLS the peer sees a failed handshake (closed).
    (void)::send(fd, res.data(), res.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_RDWR);
}

awaitable<void> Daemon::Impl::accept_loop(tcp::acceptor& acc, bool tls, listener_kind listener) {
    // A failed accept (EMFILE, ENFILE, ENOBUFS) leaves the connection in the backlog: retrying
    // at once would spin. Back off 10 ms, doubling to 1 s, and log once per streak.
    // (The wait sits outside the scope of the accept's structured binding: GCC 12 corrupts a
    // binding that lives across a second suspension in a nested scope.)
    net::steady_timer backoff(ioc);
    std::chrono::milliseconds delay{0};
    for (;;) {
        if (delay.count() != 0) {
            backoff.expires_after(delay);
            auto waited = co_await backoff.async_wait(as_tuple_awaitable);
            if (std::get<0>(waited) || !acc.is_open()) co_return;
        }
        auto [ec, socket] = co_await acc.async_accept(net::make_strand(next_connection_loop()),
                                                      as_tuple_awaitable);
        if (ec) {
            if (ec == net::error::operation_aborted || !acc.is_open()) co_return;
            if (delay.count() == 0) spdlog::warn("accept failed: {}; backing off", ec.message());
            delay = std::min<std::chrono::milliseconds>(
                delay.count() == 0 ? std::chrono::milliseconds(10) : delay * 2,
                std::chrono::milliseconds(1000));
            continue;
        }
        if (delay.count() != 0) spdlog::info("accepting connections again");
        delay = std::chrono::milliseconds(0);
        std::string refused_by;
        auto slot = admit_connection(refused_by);
        if (!slot) {
            // At a cap: refused at once, the accepts go on (the reserve keeps descriptors for
            // this and for the node's own work).
            refuse_connection(socket.native_handle(), refused_by);
            beast::error_code ignored;
            socket.close(ignored);
            continue;
        }
        beast::error_code nodelay_ec;
        socket.set_option(tcp::no_delay(true), nodelay_ec);  // no Nagle wait behind an unacked frame
        auto ex = socket.get_executor();
        net::co_spawn(ex, serve(std::move(socket), tls, listener, std::move(*slot)),
                      [](const std::exception_ptr& e) {
            if (!e) return;
            try {
                std::rethrow_exception(e);
            } catch (const std::exception& ex2) {
                spdlog::error("connection failed: {}", ex2.what());
            }
        });
    }
}

awaitable<std::int64_t> Daemon::Impl::register_at_start(NodeRecord record) {
    const auto& c = node.config;
    const auto limit = std::chrono::milliseconds(c.registry.startup_timeout_ms);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    auto backoff = std::chrono::milliseconds(200);
    net::steady_timer pause(co_await net::this_coro::executor);
    for (int attempt = 1;; ++attempt) {
        std::string problem;
        try {
            record.heartbeat_at_ms = now_ms();
            const auto sent = co_await register_or_take_over(*node.registry, record, c.node_ttl_ms,
                                                             c.heartbeat_ms);
            if (attempt > 1) {
                spdlog::info("node={} registered at attempt {}", node.node_id, attempt);
            }
            co_return sent;
        } catch (const rpc_error& e) {
            if (e.code() != errc::registry_unavailable) throw;
            problem = e.what();
        }
        {
            std::lock_guard lock(node.startup_mutex);
            node.startup_problem = problem;
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            throw rpc_error(errc::registry_unavailable,
                            "register node: the registry could not be reached for " +
                                std::to_string(limit.count()) +
                                " ms (registry.startupTimeoutMs), " + std::to_string(attempt) +
                                " attempts; the last: " + problem);
        }
        const auto wait = std::min(backoff, left);
        spdlog::warn("node={} register attempt {} failed: {}; retrying in {} ms ({} ms left)",
                     node.node_id, attempt, problem, wait.count(), left.count());
        pause.expires_after(wait);
        co_await pause.async_wait(use_awaitable);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
    }
}

awaitable<bool> Daemon::Impl::registry_reachable() {
    try {
        co_await node.registry->get_node(node.node_id);
        co_return true;
    } catch (const std::exception&) {
        co_return false;
    }
}

void Daemon::Impl::collect_metrics() {
    auto& m = node.metrics;
    m.channels_running.only().set(static_cast<double>(node.channels.size()));
    m.send_queue_bytes.only().set(static_cast<double>(node.send_budget->queued()));
    m.connections_open.only().set(static_cast<double>(connections_open.load()));
    m.connections_pending.only().set(static_cast<double>(connections_pending.load()));
    LimitEvents limit_events;
    for (const auto& [key, provider] : node.providers) {
        const auto e = provider->limit_events();
        limit_events.memory += e.memory;
        limit_events.pids += e.pids;
        if (const auto worker = provider->worker_status()) {
            const auto& plugin = provider->plugin_id();
            m.plugin_worker_up.with({plugin}).set(worker->up ? 1 : 0);
            m.plugin_worker_restarts.with({plugin}).advance_to(static_cast<double>(worker->restarts));
        }
    }
    m.limit_events.with({"memory"}).advance_to(static_cast<double>(limit_events.memory));
    m.limit_events.with({"pids"}).advance_to(static_cast<double>(limit_events.pids));
    for (const auto& [peer, up] : node.peers.states()) m.peer_link_up.with({peer}).set(up ? 1 : 0);
    m.fenced.only().set(node.fenced_for_ms() != 0 ? 1 : 0);
}

awaitable<void> Daemon::Impl::refresh_lease_counts() {
    const auto now = steady_now_ms();
    const auto last = leases_read_ms.load();
    if (last != 0 && now - last < 10000) co_return;
    leases_read_ms = now;
    try {
        for (const auto status :
             {lease_status::active, lease_status::pending_cleanup, lease_status::retained}) {
            LeaseQuery q;
            q.owner_node_id = node.node_id;
            q.status = status;
            q.limit = 1000;
            std::int64_t count = 0;
            for (;;) {
                auto page = co_await node.registry->list_leases(q);
                count += static_cast<std::int64_t>(page.leases.size());
                if (page.next_cursor.empty()) break;
                q.cursor = std::move(page.next_cursor);
            }
            node.metrics.leases.with({to_string(status)}).set(static_cast<double>(count));
            if (status == lease_status::active) active_leases = count;
        }
    } catch (const std::exception& e) {
        spdlog::warn("node={} metrics: cannot read the lease counts: {}", node.node_id, e.what());
    }
}

awaitable<void> Daemon::Impl::fence_watch() {
    bool fenced = false;
    for (;;) {
        const auto fenced_for = node.fenced_for_ms();
        if ((fenced_for != 0) != fenced) {
            fenced = !fenced;
            node.metrics.fenced.only().set(fenced ? 1 : 0);
            if (fenced) {
                spdlog::warn("node={} fenced: membership not renewed for {} ms (limit {} ms): no "
                             "opens and no lease changes until it renews",
                             node.node_id, fenced_for, node.config.node_ttl_ms * 2 / 3);
            } else {
                spdlog::info("node={} unfenced: membership renewed", node.node_id);
            }
        }
        // Awake at the fencing deadline; while fenced, often enough to see the renewal.
        const auto wait = fenced ? std::int64_t{50}
                                 : std::clamp<std::int64_t>(
                                       node.fence_deadline_ms() - steady_now_ms() + 1, 1,
                                       static_cast<std::int64_t>(node.config.heartbeat_ms));
        fence_timer.expires_after(std::chrono::milliseconds(wait));
        auto [ec] = co_await fence_timer.async_wait(as_tuple_awaitable);
        if (ec || node.stopping) co_return;
    }
}

awaitable<void> Daemon::Impl::tick_loop(net::steady_timer& timer, std::chrono::milliseconds interval,
                                        std::function<void()> fn) {
    for (;;) {
        fn();
        timer.expires_after(interval);
        auto [ec] = co_await timer.async_wait(as_tuple_awaitable);
        if (ec) co_return;
    }
}

void Daemon::on_tick(std::chrono::milliseconds interval, std::function<void()> fn) {
    auto& timer = *impl_->tick_timers.emplace_back(std::make_unique<net::steady_timer>(impl_->ioc));
    net::co_spawn(impl_->ioc, impl_->tick_loop(timer, interval, std::move(fn)), net::detached);
}

std::string Daemon::status() const {
    // The lease count comes from the registry, read at most every 10 s, in the background.
    net::co_spawn(impl_->ioc, impl_->refresh_lease_counts(), net::detached);
    const auto& node = impl_->node;
    const char* state = node.draining ? "draining" : node.fenced_for_ms() != 0 ? "fenced" : "serving";
    return std::to_string(node.channels.size()) + " channels, " +
           std::to_string(impl_->active_leases.load()) + " leases, " + state;
}

awaitable<void> Daemon::Impl::serve(tcp::socket socket, bool tls, listener_kind listener,
                                    ConnectionSlot slot) {
    if (!tls) {
        co_await serve_http(ConnStream(beast::tcp_stream(std::move(socket))), listener, slot);
        co_return;
    }
    // The listener's context as of now: a reload (SIGHUP) changes what later connections get.
    ConnStream stream(beast::tcp_stream(std::move(socket)), node.security()->listener_tls);
    // The handshake and the first request share one deadline from the accept (authTimeoutMs).
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(node.config.limits.auth_timeout_ms);
    beast::get_lowest_layer(stream).expires_at(deadline);
    auto [ec] = co_await stream.tls()->async_handshake(ssl::stream_base::server, as_tuple_awaitable);
    if (ec) {
        // Plain HTTP to the TLS port, an untrusted or missing client certificate, an old
        // protocol version: the handshake fails and the connection is dropped.
        beast::error_code ignored;
        const auto remote = beast::get_lowest_layer(stream).socket().remote_endpoint(ignored);
        spdlog::info("peer={} TLS handshake failed: {}", format_endpoint(remote), ec.message());
        if (node.audit) {
            node.audit->write("connection.refused", {{"peer", format_endpoint(remote)},
                                                     {"token", nullptr},
                                                     {"reason", "TLS handshake failed: " + ec.message()}});
        }
        co_return;
    }
    co_await serve_http(std::move(stream), listener, slot);
}

awaitable<void> Daemon::Impl::serve_http(ConnStream stream, listener_kind listener, ConnectionSlot& slot) {
    beast::flat_buffer buffer;
    // The first request's deadline runs from the accept (the TLS handshake's, when there was
    // one); each later request on a kept-alive connection gets authTimeoutMs of its own.
    const auto auth_timeout = std::chrono::milliseconds(node.config.limits.auth_timeout_ms);
    bool first = true;
    for (;;) {
        http::request_parser<http::string_body> parser;
        parser.header_limit(16 * 1024);
        parser.body_limit(64 * 1024);
        if (!first || !stream.tls()) beast::get_lowest_layer(stream).expires_after(auth_timeout);
        first = false;
        auto [ec, n] = co_await http::async_read(stream, buffer, parser, as_tuple_awaitable);
        if (ec == http::error::header_limit || ec == http::error::body_limit) {
            // Too large to read: answered with its status, then closed (the rest is unread).
            const bool header = ec == http::error::header_limit;
            auto res = plain(header ? http::status::request_header_fields_too_large
                                    : http::status::payload_too_large,
                             header ? "request header fields over 16 KiB\n"
                                    : "request body over 64 KiB\n",
                             11, false);
            spdlog::info("rejected an HTTP request: {}", header ? "headers over 16 KiB" : "body over 64 KiB");
            co_await http::async_write(stream, res, as_tuple_awaitable);
            // A lingering close: what the client still sends is read and dropped (at most
            // 1 MiB or 2 s), so that closing with unread bytes does not reset the connection
            // and lose the status on the client's side.
            beast::error_code ignored;
            beast::get_lowest_layer(stream).socket().shutdown(tcp::socket::shutdown_send, ignored);
            beast::get_lowest_layer(stream).expires_after(std::chrono::seconds(2));
            std::array<char, 16384> sink{};
            for (std::size_t drained = 0; drained < (1U << 20);) {
                auto [rec, got] = co_await stream.async_read_some(net::buffer(sink), as_tuple_awaitable);
                if (rec) break;
                drained += got;
            }
            co_return;
        }
        if (ec) co_return;
        auto req = parser.release();
        const std::string target(req.target());
        const bool keep = req.keep_alive();
        http::response<http::string_body> res;
        if (target == "/v1/ws" || target.rfind("/v1/ws?", 0) == 0) {
            if (!websocket::is_upgrade(req)) {
                res = plain(http::status::bad_request, "expected a WebSocket upgrade\n", req.version(), false);
            } else {
                beast::error_code ignored;
                const std::string peer =
                    format_endpoint(beast::get_lowest_layer(stream).socket().remote_endpoint(ignored));
                // Logged with the peer's address, and audited as connection.refused.
                const auto refused = [&](const std::string& why, const std::optional<Principal>& token) {
                    spdlog::info("peer={} rejected an upgrade: {}", peer, why);
                    if (node.audit) {
                        node.audit->write("connection.refused",
                                          {{"peer", peer},
                                           {"token", token ? nlohmann::json(token->name) : nlohmann::json()},
                                           {"reason", why}});
                    }
                };
                std::string_view auth = req[http::field::authorization];
                std::optional<Principal> who;
                bool foreign_origin = false;
                if (auth.size() > 7 && beast::iequals(auth.substr(0, 7), "Bearer ")) {
                    who = node.authenticate(auth.substr(7));
                } else if (auth.empty()) {
                    // A browser cannot set Authorization: its token comes as the subprotocol
                    // sandboxd.bearer.<base64url>, and only from a page of this node's own origin.
                    if (auto token = bearer_from_subprotocols(req[http::field::sec_websocket_protocol])) {
                        if (origin_matches_host(req[http::field::origin], req[http::field::host])) {
                            who = node.authenticate(*token);
                        } else {
                            foreign_origin = true;
                        }
                    }
                }
                if (foreign_origin) {
                    refused("a browser upgrade from origin '" +
                                std::string(req[http::field::origin]).substr(0, 200) + "' for host '" +
                                std::string(req[http::field::host]).substr(0, 200) + "'",
                            std::nullopt);
                    res = plain(http::status::forbidden,
                                "a token in the subprotocol is accepted only from a page of this node's origin\n",
                                req.version(), false);
                } else if (!who) {
                    refused("missing or invalid bearer token", std::nullopt);
                    res = plain(http::status::unauthorized, "missing or invalid bearer token\n", req.version(), false);
                    res.set(http::field::www_authenticate, "Bearer realm=\"sandboxd\"");
                } else if (!peer_certified(stream, *who)) {
                    refused("peer token \"" + who->name +
                                "\": no client certificate that routing.peerTls.caFile verifies",
                            who);
                    res = plain(http::status::forbidden,
                                "a peer token needs a client certificate that the cluster CA verified\n",
                                req.version(), false);
                } else if (const auto unbound = peer_binding_refusal(stream, *who, req); !unbound.empty()) {
                    refused(unbound, who);
                    res = plain(http::status::forbidden, unbound + "\n", req.version(), false);
                } else if (who->role == "peer" && req.count("Sandboxd-Forwarded-To") != 0 &&
                           req["Sandboxd-Forwarded-To"] != node.node_id) {
                    // A peer link meant for another node (its record's address now reaches
                    // this one, e.g. after a restart on another port): what it forwards must
                    // never run here, on a node that does not hold the lease.
                    const std::string meant(req["Sandboxd-Forwarded-To"]);
                    refused("peer link meant for node " + meant + " reached node " + node.node_id, who);
                    res = plain(http::status::misdirected_request,
                                "this is node " + node.node_id + ", not " + meant + "\n",
                                req.version(), false);
                } else if (node.stopping) {
                    refused("node is stopping", who);
                    res = plain(http::status::service_unavailable, "node is stopping\n", req.version(), false);
                } else if (!node.registered) {
                    refused("node is starting: not registered with the registry yet", who);
                    res = plain(http::status::service_unavailable,
                                "node is starting: not registered with the registry yet\n",
                                req.version(), false);
                } else if (who->role == "metrics") {
                    refused("token \"" + who->name + "\" has role metrics: it may only read GET /metrics", who);
                    res = plain(http::status::forbidden,
                                "a metrics-role token may only read GET /metrics\n", req.version(), false);
                } else {
                    slot.authenticated();
                    auto session = std::make_shared<Session>(node, std::move(stream), std::move(*who));
                    {
                        std::lock_guard lock(sessions_mutex);
                        std::erase_if(sessions, [](const auto& w) { return w.expired(); });
                        sessions.push_back(session);
                    }
                    co_await session->run(std::move(req));
                    co_return;
                }
            }
        } else if (target == "/admin/drain") {
            beast::error_code ignored;
            const std::string peer =
                format_endpoint(beast::get_lowest_layer(stream).socket().remote_endpoint(ignored));
            std::string_view auth = req[http::field::authorization];
            std::optional<Principal> who;
            if (auth.size() > 7 && beast::iequals(auth.substr(0, 7), "Bearer ")) {
                who = node.authenticate(auth.substr(7));
            }
            if (req.method() != http::verb::post) {
                res = plain(http::status::method_not_allowed, "POST /admin/drain\n", req.version(), keep);
                res.set(http::field::allow, "POST");
            } else {
                res = admin_drain(who, stream, peer, req.version());
            }
            res.keep_alive(keep);
        } else if (req.method() != http::verb::get) {
            res = plain(http::status::method_not_allowed, "method not allowed\n", req.version(), keep);
        } else if (target == "/healthz") {
            res = plain(http::status::ok, "ok\n", req.version(), keep);
        } else if (target == "/readyz") {
            std::string why;
            if (node.draining) {
                why = "draining";
            } else if (!node.registered) {
                std::lock_guard lock(node.startup_mutex);
                why = "not registered with the registry yet" +
                      (node.startup_problem.empty() ? std::string()
                                                    : ": " + node.startup_problem);
            }
            if (why.empty() && !co_await registry_reachable()) why = "registry unreachable";
            if (const auto fenced = why.empty() ? node.fenced_for_ms() : 0) {
                why = "membership not renewed for " + std::to_string(fenced) + " ms (fenced)";
            }
            std::string notes;
            for (const auto& [key, provider] : node.providers) {
                if (!provider->ready()) {
                    // Why, where the provider knows (the bwrap provider's start-up probe).
                    if (why.empty()) {
                        const auto note = provider->degraded();
                        why = "provider " + key + " not ready" + (note.empty() ? "" : ": " + note);
                    }
                    continue;
                }
                if (auto note = provider->degraded(); !note.empty()) {
                    notes.append("warning: provider ").append(key).append(": ").append(note);
                    notes += '\n';
                }
            }
            res = why.empty() ? plain(http::status::ok, "ready\n" + notes, req.version(), keep)
                              : plain(http::status::service_unavailable, "not ready: " + why + "\n",
                                      req.version(), keep);
        } else if (target == "/console" || target.rfind("/console/", 0) == 0 ||
                   target.rfind("/console?", 0) == 0) {
            // Off, or a name the page does not have: 404 (below). Enabled without its files: 503.
            const auto* file = node.config.console_enabled ? console.find(target) : nullptr;
            if (node.config.console_enabled && !console.available()) {
                res = plain(http::status::service_unavailable, "console not available: " + console.problem() + "\n",
                            req.version(), keep);
            } else if (file) {
                res = plain(http::status::ok, file->body, req.version(), keep);
                res.set(http::field::content_type, file->content_type);
                res.set("Content-Security-Policy", std::string(console_csp));
                res.set("X-Content-Type-Options", "nosniff");
                res.set("Referrer-Policy", "no-referrer");
                res.set(http::field::cache_control, "no-store");
            } else {
                res = plain(http::status::not_found, "not found\n", req.version(), keep);
            }
        } else if (target == "/metrics") {
            res = co_await serve_metrics(req, listener, keep);
        } else {
            res = plain(http::status::not_found, "not found\n", req.version(), keep);
        }
        auto [wec, wn] = co_await http::async_write(stream, res, as_tuple_awaitable);
        if (wec || !res.keep_alive()) {
            beast::get_lowest_layer(stream).socket().shutdown(tcp::socket::shutdown_send, wec);
            co_return;
        }
    }
}

awaitable<http::response<http::string_body>> Daemon::Impl::serve_metrics(
    const http::request<http::string_body>& req, listener_kind listener, bool keep) {
    // issue 44, item 7: a credential by default; metrics.public opens plainListen alone.
    if (!(node.config.metrics_public && listener == listener_kind::plain)) {
        std::string_view auth = req[http::field::authorization];
        std::optional<Principal> who;
        if (auth.size() > 7 && beast::iequals(auth.substr(0, 7), "Bearer ")) {
            who = node.authenticate(auth.substr(7));
        }
        if (!who) {
            auto res = plain(http::status::unauthorized,
                             "GET /metrics takes a bearer token with role metrics or peer\n",
                             req.version(), keep);
            res.set(http::field::www_authenticate, "Bearer realm=\"sandboxd\"");
            co_return res;
        }
        if (!who->reads_metrics) {
            co_return plain(http::status::forbidden,
                            "token \"" + who->name + "\" has role " + who->role +
                                "; GET /metrics takes a token with role metrics or peer\n",
                            req.version(), keep);
        }
    }
    co_await refresh_lease_counts();
    auto res = plain(http::status::ok, node.metrics.registry.render() + process_metrics_text(),
                     req.version(), keep);
    res.set(http::field::content_type, "text/plain; version=0.0.4");
    co_return res;
}

http::response<http::string_body> Daemon::Impl::admin_drain(const std::optional<Principal>& who,
                                                            ConnStream& stream, const std::string& peer,
                                                            unsigned version) {
    // Only a peer-role token (with its client certificate, where routing.peerTls asks for one):
    // the operators' and the cluster's credential, never a host's.
    const auto refuse = [&](http::status status, const std::string& why) {
        spdlog::info("peer={} POST /admin/drain refused: {}", peer, why);
        if (node.audit) {
            node.audit->write("drain.refused", {{"peer", peer},
                                                {"token", who ? nlohmann::json(who->name) : nlohmann::json()},
                                                {"reason", why}});
        }
        auto res = plain(status, why + "\n", version, false);
        if (status == http::status::unauthorized) res.set(http::field::www_authenticate, "Bearer realm=\"sandboxd\"");
        return res;
    };
    if (!who) return refuse(http::status::unauthorized, "missing or invalid bearer token");
    if (who->role != "peer") {
        return refuse(http::status::forbidden, "token \"" + who->name + "\" has role " + who->role +
                                                   "; POST /admin/drain takes a peer-role token");
    }
    if (!peer_certified(stream, *who)) {
        return refuse(http::status::forbidden,
                      "peer token \"" + who->name +
                          "\": no client certificate that routing.peerTls.caFile verifies");
    }
    const bool already = drain_started.load();
    spdlog::info("peer={} token \"{}\": POST /admin/drain{}", peer, who->name,
                 already ? " (already draining)" : "");
    if (node.audit) node.audit->write("drain.requested", {{"peer", peer}, {"token", who->name}});
    begin_drain();
    const nlohmann::json body = {{"nodeId", node.node_id},
                                 {"draining", true},
                                 {"channels", node.channels.size()},
                                 {"relayedChannels", node.relays_open.load()},
                                 {"drainTimeoutMs", node.config.limits.drain_timeout_ms}};
    auto res = plain(http::status::accepted, body.dump() + "\n", version, false);
    res.set(http::field::content_type, "application/json");
    return res;
}

void Daemon::Impl::start_lease_watch() {
    // Events arrive on an I/O thread; only those that concern this node's cache or channels
    // start a reconciliation.
    auto on_change = [this](const Lease& lease) {
        if (!needs_reconcile(node, lease)) return;
        net::co_spawn(ioc, reconcile_lease(node, lease), net::detached);
    };
    // The feed (re)started at the registry's current revision (at start, after a compaction):
    // what changed before is not delivered, so every cached lease is checked against its
    // record. At start the cache is empty (a fresh process holds no sandbox).
    // A registry that fails meanwhile leaves it to the sweeper's next pass.
    auto on_resync = [this] {
        net::co_spawn(
            ioc,
            [this]() -> awaitable<void> {
                try {
                    co_await reconcile_cached(node);
                } catch (const std::exception& e) {
                    spdlog::warn("node={} change feed resync: could not reconcile its sandboxes: {}",
                                 node.node_id, e.what());
                }
            },
            net::detached);
    };
    node.lease_watch = node.registry->watch_leases(ioc.get_executor(), std::move(on_change),
                                                   std::move(on_resync),
                                                   std::max<std::int64_t>(node.config.heartbeat_ms / 2, 100));
}

awaitable<void> Daemon::Impl::heartbeat_loop() {
    // Renews this node's membership every heartbeatMs. `renewed_at_ms` is the time a renewal
    // that succeeded was sent: the node fences itself (Node::require_membership) when it is
    // older than 2/3 of nodeTtlMs. The membership lane: this loop awaits only the registry's
    // membership calls (registry.hpp), never lease work or a provider, so no backlog there
    // can delay a renewal. Ending what the node lost runs beside it, in rejoin().
    for (;;) {
        heartbeat_timer.expires_after(std::chrono::milliseconds(node.config.heartbeat_ms));
        auto [ec] = co_await heartbeat_timer.async_wait(as_tuple_awaitable);
        if (ec || node.stopping) co_return;
        const auto sent = steady_now_ms();
        const auto fenced = node.fenced_for_ms();
        try {
            bool mine = co_await node.registry->heartbeat_node(node.node_id, node.instance_id,
                                                                now_ms());
            if (const auto took = steady_now_ms() - sent; took > node.config.heartbeat_ms) {
                // A renewal that takes longer than the period eats into the fencing margin
                // (2/3 of nodeTtlMs): said, so that a slow registry shows in the log.
                spdlog::warn("node={} heartbeat took {} ms (heartbeatMs {})", node.node_id, took,
                             node.config.heartbeat_ms);
            }
            if (!mine) {
                // The record expired (the process was stopped, or the registry unreachable,
                // past the TTL) or another process took the node id. Other nodes may have
                // orphaned this node's leases meanwhile: register again, end what it lost,
                // and only then serve again.
                spdlog::warn("node={} lost its membership (not renewed for {} ms); registering again",
                             node.node_id, steady_now_ms() - node.renewed_at_ms.load());
                NodeRecord record;
                record.node_id = node.node_id;
                record.url = node.advertise_url;
                record.started_at_ms = node.started_at_ms;
                record.heartbeat_at_ms = now_ms();
                record.instance_id = node.instance_id;
                co_await node.registry->register_node(record, node.config.node_ttl_ms);
                spdlog::info("node={} registered again", node.node_id);
            }
            beat_sent_ms.store(sent, std::memory_order_release);
            if (!mine || fenced != 0 || rejoining.load()) {
                node.membership_breaks.fetch_add(1, std::memory_order_acq_rel);
                if (!rejoining.exchange(true)) net::co_spawn(ioc, rejoin(), net::detached);
            } else {
                node.renewed_at_ms.store(sent, std::memory_order_release);
            }
        } catch (const std::exception& e) {
            spdlog::warn("node={} heartbeat failed: {}", node.node_id, e.what());
        }
    }
}

awaitable<void> Daemon::Impl::rejoin() {
    // Ends the channels and sandboxes of leases this node lost while fenced, then lets it
    // serve again from the last renewal that succeeded (the heartbeat loop keeps renewing).
    const auto since = steady_now_ms() - node.renewed_at_ms.load();
    try {
        co_await reconcile_cached(node);
        node.renewed_at_ms.store(beat_sent_ms.load(std::memory_order_acquire),
                                 std::memory_order_release);
        spdlog::info("node={} unfenced after {} ms", node.node_id, since);
    } catch (const std::exception& e) {
        spdlog::warn("node={} could not reconcile its sandboxes: {}", node.node_id, e.what());
    }
    rejoining.store(false);
}

awaitable<void> Daemon::Impl::sweep_loop() {
    for (;;) {
        sweep_timer.expires_after(std::chrono::milliseconds(node.config.heartbeat_ms));
        auto [ec] = co_await sweep_timer.async_wait(as_tuple_awaitable);
        if (ec || node.stopping) co_return;
        try {
            co_await sweep(node);
        } catch (const std::exception& e) {
            spdlog::warn("node={} sweep failed: {}", node.node_id, e.what());
        }
    }
}

}  // namespace sandboxd
