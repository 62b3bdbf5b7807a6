#pragma once
/// @file config.hpp
/// The daemon's configuration (docs/protocol.md section 7): one JSON file (comments allowed),
/// every key optional with the in-class default below, command-line flags applied on top.
/// config/sandboxd.jsonc documents every key. Value types; no shared state.

#include <nlohmann/json.hpp>

#include <boost/asio/ip/udp.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace sandboxd {

/// Thrown for an invalid config: the message names the field path, e.g.
/// "config: limits.outputWindow: must be an integer in 1024..1073741824".
class config_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

struct TokenConfig {
    std::string name;
    std::string token;                         ///< the secret itself, or
    std::string token_file;                    ///< a file holding it (trailing whitespace trimmed)
    std::string role = "host";                 ///< "host", "peer" or "metrics" (GET /metrics only)
    std::vector<std::string> tenants = {"*"};  ///< companyIds, or "*" for every tenant
    /// A peer token bound to one node: its links must say they come from this node
    /// (Sandboxd-Forwarded-By), or the upgrade is refused (403). "" = not bound. Peer only.
    std::string node_id;
};

/// PEM files of one side of a TLS connection (docs/protocol.md section 7). Empty strings: not
/// given.
struct TlsFilesConfig {
    std::string ca_file;    ///< CAs that verify the other side
    std::string cert_file;  ///< this side's certificate chain
    std::string key_file;   ///< its private key
    [[nodiscard]] bool empty() const {
        return ca_file.empty() && cert_file.empty() && key_file.empty();
    }
};

/// `tls`: the listener serves TLS (wss://, https://) when cert_file is set.
struct ListenerTlsConfig {
    std::string cert_file;
    std::string key_file;
    /// CAs every client certificate must verify against; "" = no client certificate required.
    std::string client_ca_file;
    std::string min_version = "1.2";  ///< "1.2" or "1.3"
    [[nodiscard]] bool enabled() const { return !cert_file.empty(); }
};

struct RegistryConfig {
    std::string kind = "sqlite";         ///< "sqlite" or "etcd"
    std::string path;                    ///< sqlite file; "" = <stateDir>/registry.db
    std::vector<std::string> endpoints;  ///< etcd gateway URLs, http://host:port or https://
    /// registry.tls: for https:// endpoints, as etcd's --cacert/--cert/--key ("" ca: the
    /// system's trust store).
    TlsFilesConfig tls;
    std::string prefix = "/sandboxd/v1/";
    std::string username;  ///< etcd auth user; "" = no auth
    std::string
        password_file;  ///< file holding the etcd user's password (trailing whitespace trimmed)
    /// How long the daemon keeps trying to register at start while the registry cannot be
    /// reached (listening meanwhile, /readyz 503), ms, 0..3600000; then it exits 1.
    std::uint32_t startup_timeout_ms = 60000;
};

/// Per-lease limits of the built-in provider (leaseAcquire's `config.limits`, and the node's
/// `providers.bwrap.limits.defaults` and `.max`). Absent means "not given" (defaults) or "no
/// cap" (max). docs/security.md says how each is enforced.
struct LeaseLimits {
    std::optional<std::uint64_t> memory_bytes;       ///< bytes, 16 MiB..2^50, tmpfs included
    std::optional<std::uint32_t> pids;               ///< processes and threads, 8..4194304
    std::optional<std::uint32_t> cpu_weight;         ///< 1..10000 (100: an equal share)
    std::optional<std::uint32_t> cpu_quota_percent;  ///< of one core, 1..100000; absent: none
    std::optional<std::uint64_t> disk_bytes;         ///< workspace bytes, 8 MiB..1 TiB
    std::optional<std::uint32_t> open_files;         ///< RLIMIT_NOFILE per process, 16..1048576
    /// Disk I/O on the lease's own workspace device (v1 blkio.throttle.*_device, v2 io.max);
    /// absent: none. Bytes per second 65536..2^40; operations per second 16..10000000.
    std::optional<std::uint64_t> io_read_bps;
    std::optional<std::uint64_t> io_write_bps;
    std::optional<std::uint32_t> io_read_iops;
    std::optional<std::uint32_t> io_write_iops;
    /// v2 io.weight "default N", 1..10000 (100: an equal share); cgroup v2 only.
    std::optional<std::uint32_t> io_weight;
    /// Network bytes per second of a lease with egress, each way (a token bucket on both ends
    /// of its veth pair), 65536..2147483647 (2 GiB/s, tbf's 32-bit rate); absent: none.
    std::optional<std::uint64_t> egress_bps;
};

struct BwrapLimitsConfig {
    /// true: the node refuses to start unless cgroups (v2, else v1) and loop-mounted disks
    /// can enforce the limits. false (only when set explicitly): no memory, pids, CPU or disk
    /// limit is enforced; /readyz and the log say so.
    bool enforce = true;
    /// 32 leases of these defaults fit the budgets (below) of a host with pid_max 32,768 and
    /// fs.file-max 2.4 M: each lease's open-file cap is min(512 x 512, 1 GiB / 512) = 262,144.
    LeaseLimits defaults{1ULL << 30,   512,          100,          std::nullopt,
                         1ULL << 30,   512,          std::nullopt, std::nullopt,
                         std::nullopt, std::nullopt, std::nullopt, std::nullopt};
    LeaseLimits max{16ULL << 30,  4096,         10000,        std::nullopt,
                    64ULL << 30,  65536,        std::nullopt, std::nullopt,
                    std::nullopt, std::nullopt, std::nullopt, std::nullopt};
    /// The node's budgets (pids: kernel.pid_max, open files: fs.file-max, each less an eighth
    /// kept for the host) times this, 1..1000, bound the sum of its leases' caps (pids, and
    /// each lease's open-file cap: min(openFiles x pids, memoryBytes / 512)); an acquire
    /// beyond it is refused (CHANNEL_LIMIT, docs/protocol.md).
    std::uint32_t overcommit = 4;
};

struct BwrapIdentityConfig {
    /// Host uids (and gids) [hostIdFirst, hostIdFirst + hostIdCount): one per lease.
    std::uint32_t host_id_first = 1500000000;
    std::uint32_t host_id_count = 1000000;
    std::uint32_t inside_uid = 0;  ///< the uid the command sees (no capability outside)
    std::uint32_t inside_gid = 0;
    /// Claims shared by every daemon on the host (byte-range locks).
    std::string lock_file = "/run/sandboxd/identities.lock";
};

/// A lease's network, node side (issue 48; docs/security.md, "Network"). Every lease has a
/// network namespace of its own; these say whether and how it may reach out.
struct BwrapNetworkConfig {
    /// Whether a lease may have egress at all (a policy of mode "egress", or `true`).
    bool egress = false;
    /// The leases' IPv4 addresses, a /8../28; its first address is every lease's gateway and
    /// resolver. Must not overlap a route of the host (another node's pool, a LAN).
    std::string pool = "10.200.0.0/16";
    /// The interface NAT sends egress out of; "": the host's routes choose.
    std::string uplink;
    /// IPv4 addresses and CIDRs no lease ever reaches, before anything else (peers, etcd).
    std::vector<std::string> deny;
    /// IPv4 addresses and CIDRs every egress lease reaches though the built-in ranges (private,
    /// link-local, ...) would refuse them, and whatever the lease's own `deny` says (a mirror).
    std::vector<std::string> open;
    /// Upstream resolvers of the leases' resolvers, "ADDRESS" or "ADDRESS:PORT" (IPv4, or
    /// "[IPv6]:PORT"); empty: the nameservers of the host's /etc/resolv.conf.
    std::vector<std::string> dns;
    /// The rules that `network: true` stands for: {allow?, deny?} as in a lease's policy.
    nlohmann::json defaults = nlohmann::json::object();
};

struct BwrapConfig {
    bool enabled = true;
    std::string path = "/usr/bin/bwrap";
    std::string init_path;  ///< sandboxd-init; "" = next to the sandboxd executable, then libexec
    /// Deprecated for network.egress (a warning at start); true turns egress on.
    bool allow_network = false;
    BwrapNetworkConfig network;
    BwrapLimitsConfig limits;
    BwrapIdentityConfig identity;
    /// How long a lease's supervisor waits for a daemon once its own stopped or died, ms
    /// (0..86400000), before it ends its sandbox; the next daemon on the same state directory
    /// re-adopts it within that time. 0 (for now the default: issue 47 is not finished): a
    /// sandbox ends with its daemon.
    std::uint32_t adopt_timeout_ms = 300000;
    /// Entries of the host's /etc copied into the sandbox's generated /etc (relative paths;
    /// missing ones skipped). passwd, group, hosts, hostname, nsswitch.conf and (with network)
    /// resolv.conf are always generated.
    std::vector<std::string> etc_files = {"alternatives",   "ld.so.cache", "ld.so.conf",
                                          "ld.so.conf.d",   "ssl/certs",   "ca-certificates.conf",
                                          "localtime",      "timezone",    "os-release",
                                          "debian_version", "profile",     "bash.bashrc",
                                          "inputrc",        "protocols",   "services",
                                          "mime.types",     "terminfo"};
};

/// How the sweeper retries a plugin lease whose teardown failed (docs/plugins.md).
struct PluginCleanupConfig {
    std::uint32_t attempts = 5;            ///< 1..1000 quick attempts, then the slow retry
    std::uint64_t backoff_ms = 1000;       ///< 1..86400000; doubles per failed attempt
    std::uint64_t slow_retry_ms = 300000;  ///< 1..86400000; the retry period after that
};

/// One entry of providers.plugins (docs/plugins.md, "The config entry").
struct PluginConfig {
    std::string plugin_id;
    std::string provider;
    std::vector<std::string> command;
    std::map<std::string, std::string> env;
    /// The plugin's manifest JSON file, sent in `initialize`; "" = a minimal manifest built
    /// from plugin_id and provider. Read when the provider starts.
    std::string manifest;
    /// The instance config: sent in `initialize` and served to the worker's `config.get`.
    nlohmann::json config = nlohmann::json::object();
    /// Per SDK method, ms (1..86400000); a method not named takes the default (300,000 for
    /// the environment*Lease methods, 30,000 for the others).
    std::map<std::string, std::uint64_t> timeouts_ms;
    PluginCleanupConfig cleanup;
    /// Output bytes one channel may hold that the host has not credited yet (the SDK has no
    /// credit of its own), 64 KiB..1 GiB; over it the channel ends with FLOW_CONTROL.
    std::uint64_t max_buffered_bytes = 16ULL << 20;
};

/// The SDK methods whose timeout providers.plugins[].timeoutsMs may set.
const std::vector<std::string>& plugin_timeout_methods();

struct LimitsConfig {
    std::uint32_t max_text_message = 1 << 20;     ///< bytes, 1 KiB..64 MiB
    std::uint32_t max_data_payload = 256 << 10;   ///< bytes, 1 KiB..16 MiB
    std::uint32_t channels_per_connection = 256;  ///< 1..1048576
    std::uint32_t channels_per_node = 4096;       ///< 1..1048576
    /// Requests of one connection running at once (their responses not yet sent), 1..65536;
    /// over it a request gets CHANNEL_LIMIT with data.limit "requestsPerConnection".
    std::uint32_t requests_per_connection = 64;
    std::uint32_t output_window = 1 << 20;  ///< default outputWindow, bytes, 1 KiB..1 GiB
    std::uint32_t stdin_window = 1 << 20;   ///< default stdinWindow, bytes, 1 KiB..1 GiB
    /// The largest outputWindow and stdinWindow an open may ask for, bytes, 1 KiB..1 GiB (at
    /// least outputWindow and stdinWindow).
    std::uint32_t max_output_window = 64 << 20;
    std::uint32_t max_stdin_window = 16 << 20;
    /// A detached channel (duplexChannelOpen `detach`): how long its exit is kept after it
    /// ends, ms, 1000..2592000000 (30 days), and how many of the last bytes of each of its
    /// output streams are kept, 4 KiB..1 GiB; the defaults and the largest an open may ask for
    /// (each default at most its maximum).
    std::uint64_t detach_retain_ms = 600000;
    std::uint64_t max_detach_retain_ms = 86400000;
    std::uint64_t detach_retain_bytes = 8ULL << 20;
    std::uint64_t max_detach_retain_bytes = 256ULL << 20;
    /// The kept output of one lease's detached channels (2 x retainBytes each, while it runs
    /// and while its exit is kept), bytes, 8 KiB..1 TiB, at least 2 x detachRetainBytes: what
    /// one tenant can make this node keep for it (an open beyond is CHANNEL_LIMIT).
    std::uint64_t detach_kept_bytes_per_lease = 1ULL << 30;
    /// How many ended detached channels of one lease have their exit (and kept output) kept,
    /// 1..65536: past it the oldest opened is forgotten first, whatever its retainMs (so the
    /// node's memory for ended channels is bounded per lease).
    std::uint64_t detach_kept_exits_per_lease = 64;
    /// Bytes queued toward hosts (WebSocket messages written by no socket yet) on the whole
    /// node and on one connection, 64 KiB..64 GiB. A connection over its own budget, or over
    /// its fair share (sendQueueBytes divided by the connections that have bytes queued) while
    /// the node's is spent, is no longer fed: its channels' pipes and PTYs are not read and
    /// its leaseExecute output waits in its pipes until the socket takes bytes again.
    std::uint64_t send_queue_bytes = 64ULL << 20;
    std::uint64_t send_queue_bytes_per_connection = 8ULL << 20;
    /// A connection with bytes queued whose socket has taken none for this long is closed,
    /// ms, 1000..86400000. (A host that only gives no credit is never closed for it.)
    std::uint32_t send_stall_timeout_ms = 60000;
    /// Open connections on all listeners, 1..1048576, and those not yet authenticated (no
    /// WebSocket session yet), 1..1048576; both also at most RLIMIT_NOFILE less the node's
    /// descriptor reserve (the greater of 256 and a tenth of RLIMIT_NOFILE, at most half of
    /// it). Over a cap a new
    /// connection is refused at once.
    std::uint32_t connections = 4096;
    std::uint32_t pending_connections = 512;
    /// How long a connection has from its accept to its TLS handshake and authenticated
    /// request (and a plain HTTP connection for each request), ms, 100..600000.
    std::uint32_t auth_timeout_ms = 5000;
    std::uint32_t ping_interval_ms = 20000;  ///< 100..3600000
    std::uint32_t idle_timeout_ms = 60000;   ///< peer silent this long is dropped
    std::uint32_t drain_grace_ms = 250;      ///< output drain after the main process ends
    std::uint32_t hangup_grace_ms = 5000;    ///< SIGHUP to SIGKILL on a dropped connection
    /// Drain (SIGTERM, POST /admin/drain): how long running channels may go on finishing
    /// once new opens are refused, before they are stopped; ms, 0..3600000.
    std::uint32_t drain_timeout_ms = 30000;
    std::uint64_t default_ttl_ms = 3600000;          ///< lease TTL when leaseAcquire gives none
    std::uint64_t max_ttl_ms = 7 * 24 * 3600000ULL;  ///< largest ttlMs accepted
    /// leaseExecute: bytes of each stream (stdout, stderr) kept in its result and streamed
    /// as leaseExecute.log, 1 KiB..64 MiB; the rest is read and dropped.
    std::uint32_t execute_output_bytes = 1 << 20;
    /// leaseExecute's timeoutMs when the host gives none, 1..86400000.
    std::uint64_t execute_timeout_ms = 300000;
    /// How long a retained lease is kept for a reuse before the sweeper destroys its sandbox
    /// (status expired), ms, 1000..365 days.
    std::uint64_t retained_ttl_ms = 24 * 3600000ULL;
};

struct Config {
    std::string node_id;                    ///< "" = the host name
    std::string listen = "127.0.0.1:7800";  ///< HOST:PORT; port 0 picks a free port
    std::string advertise_url;              ///< "" = ws[s]://<listen address>/v1/ws once bound
    ListenerTlsConfig tls;                  ///< `tls`: TLS on `listen`
    /// plainListen: HOST:PORT (loopback only) served in plain text beside a TLS `listen`; "" =
    /// none.
    std::string plain_listen;
    std::string state_dir = "/var/lib/sandboxd";
    unsigned threads = 0;  ///< I/O threads; 0 = number of cores
    RegistryConfig registry;
    /// No tokens configured: the daemon makes one (role host, tenants *) and writes it to
    /// <stateDir>/admin.token (mode 0600) on first start.
    std::vector<TokenConfig> tokens;
    std::string routing_mode = "proxy";  ///< "proxy" or "redirect"
    /// A node is alive while its heartbeat is fresher (1000..600000 ms); a node that has not
    /// renewed its membership for 2/3 of it fences itself (REGISTRY_UNAVAILABLE).
    std::uint32_t node_ttl_ms = 10000;
    /// Heartbeat (membership renewal) and sweep period, 100..60000 ms, at most nodeTtlMs / 3.
    std::uint32_t heartbeat_ms = 2000;
    /// How long beyond nodeTtlMs other nodes' sweepers leave a dead owner's built-in (bwrap)
    /// leases alone (0..3600000 ms): its sandboxes outlive it, and a restart within this
    /// time re-adopts them (issue 47).
    std::uint32_t adopt_grace_ms = 60000;
    /// routing.peerTls: peer links use wss:// verified against ca_file and present
    /// cert_file; a `peer` token is then accepted only with a client certificate that
    /// ca_file verified. Empty: peer links follow the peers' URLs without a client certificate.
    TlsFilesConfig peer_tls;
    BwrapConfig bwrap;
    /// providers.noop.enabled: the no-op provider (make_noop_provider), for benchmarks only.
    bool noop_provider = false;
    std::vector<PluginConfig> plugins;
    LimitsConfig limits;
    std::string log_level = "info";   ///< trace, debug, info, warn, error, critical, off
    std::string log_format = "text";  ///< "text" or "json"
    /// audit.file: one JSON line per security-relevant event is appended here (created with
    /// mode 0600; reopened on SIGHUP); "" = no audit file.
    std::string audit_file;
    /// audit.journald: the same lines go to journald (identifier sandboxd-audit).
    bool audit_journald = false;
    /// metrics.public: GET /metrics answers without a token, on plainListen only (which must
    /// then be set). false: it takes a token with role metrics or peer (or the generated admin
    /// token when no token is configured).
    bool metrics_public = false;
    /// console.enabled: serve the browser console at GET /console (docs/protocol.md section 8).
    bool console_enabled = false;
    /// console.assetsDir: the console's files (index.html, console.js, xterm.js, ...); "" = the
    /// build's: <dir of sandboxd>/console, else <dir of sandboxd>/../share/sandboxd/console.
    std::string console_assets_dir;
};

/// An upstream resolver of providers.bwrap.network.dns: "ADDRESS" (port 53), "IPv4:PORT" or
/// "[IPv6]:PORT"; nullopt when it is none of these.
std::optional<boost::asio::ip::udp::endpoint> parse_dns_server(const std::string& text);

/// Parses a config document (JSON with // and /* */ comments). Rejects unknown keys, wrong
/// types and out-of-range values with config_error naming the field path.
Config parse_config(std::string_view text);
/// Reads and parses FILE; config_error when it cannot be read or is invalid.
Config load_config_file(const std::string& path);
/// Checks cross-field rules (e.g. tokens need a token or tokenFile, roles are host|peer).
void validate_config(const Config& config);
/// The effective config as JSON, with every key (tokens redacted as "<redacted>").
nlohmann::json config_to_json(const Config& config);
/// The documented default config (config/sandboxd.jsonc without comments).
std::string default_config_text();

/// What a reload (SIGHUP) of NEXT over RUNNING leaves for a restart: the dotted paths of the
/// changed keys that a reload does not apply (every key but auth.tokens, tls, routing.peerTls
/// and registry.tls), e.g. "limits.sendQueueBytes", in the order of the config's key table;
/// providers.plugins, an array, counts as one key. Empty: nothing waits for a restart.
std::vector<std::string> config_restart_changes(const Config& running, const Config& next);
/// The top-level keys of config_restart_changes (e.g. "limits"), sorted and without repeats:
/// what the reload's warning lists.
std::vector<std::string> config_restart_sections(const Config& running, const Config& next);
/// Every key with its type, default, range, whether a reload applies it and one line of doc,
/// as a Markdown document (docs/config.md, `sandboxd --print-config-reference`).
std::string config_reference_markdown();

}  // namespace sandboxd
