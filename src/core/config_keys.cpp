#include "core/config_keys.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <utility>

namespace sandboxd {

const std::vector<std::string>& plugin_timeout_methods() {
    static const std::vector<std::string> methods = {"initialize",
                                                     "health",
                                                     "shutdown",
                                                     "environmentAcquireLease",
                                                     "environmentResumeLease",
                                                     "environmentReleaseLease",
                                                     "environmentDestroyLease",
                                                     "duplexChannelOpen",
                                                     "duplexChannelWrite",
                                                     "duplexChannelStop",
                                                     "duplexChannelClose",
                                                     "duplexChannelCloseStdin",
                                                     "duplexChannelSignal",
                                                     "duplexChannelResize"};
    return methods;
}

namespace config_keys {

void fail(const std::string& path, const std::string& why) {
    throw config_error("config: " + path + ": " + why);
}

namespace {

using json = nlohmann::json;

/// Walks one JSON object, remembering which keys were read, so that unknown ones can be
/// reported by their full path.
class Obj {
public:
    Obj(const json& j, std::string path) : j_(j), path_(std::move(path)) {
        if (!j_.is_object()) fail(path_.empty() ? "(top level)" : path_, "must be an object");
    }
    ~Obj() = default;
    Obj(const Obj&) = delete;
    Obj& operator=(const Obj&) = delete;

    std::string sub(const std::string& key) const {
        return path_.empty() ? key : path_ + "." + key;
    }
    const json* get(const std::string& key) {
        seen_.insert(key);
        auto it = j_.find(key);
        return it == j_.end() ? nullptr : &*it;
    }
    void str(const std::string& key, std::string& out) {
        if (const auto* v = get(key)) {
            if (!v->is_string()) fail(sub(key), "must be a string");
            out = v->get<std::string>();
        }
    }
    void boolean(const std::string& key, bool& out) {
        if (const auto* v = get(key)) {
            if (!v->is_boolean()) fail(sub(key), "must be true or false");
            out = v->get<bool>();
        }
    }
    template <typename T>
    void integer(const std::string& key, T& out, std::uint64_t lo, std::uint64_t hi) {
        if (const auto* v = get(key)) {
            if (!v->is_number_integer() || (v->is_number_integer() && !v->is_number_unsigned() &&
                                            v->get<std::int64_t>() < 0)) {
                fail(sub(key),
                     "must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
            }
            auto n = v->get<std::uint64_t>();
            if (n < lo || n > hi) {
                fail(sub(key), "must be an integer in " + std::to_string(lo) + ".." +
                                   std::to_string(hi) + ", got " + std::to_string(n));
            }
            out = static_cast<T>(n);
        }
    }
    void strings(const std::string& key, std::vector<std::string>& out) {
        if (const auto* v = get(key)) {
            if (!v->is_array()) fail(sub(key), "must be an array of strings");
            out.clear();
            for (std::size_t i = 0; i < v->size(); ++i) {
                if (!(*v)[i].is_string()) {
                    fail(sub(key) + "[" + std::to_string(i) + "]", "must be a string");
                }
                out.push_back((*v)[i].get<std::string>());
            }
        }
    }
    void one_of(const std::string& key, std::string& out, const std::vector<std::string>& allowed) {
        str(key, out);
        if (j_.contains(key)) {
            for (const auto& a : allowed) {
                if (out == a) return;
            }
            std::string list;
            for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
            fail(sub(key), "must be one of " + list + ", got \"" + out + "\"");
        }
    }
    /// Throws for the first key that no reader asked for.
    void done() const {
        for (const auto& [key, value] : j_.items()) {
            if (!seen_.count(key)) fail(sub(key), "unknown key");
        }
    }

private:
    const json& j_;
    std::string path_;
    std::set<std::string> seen_;
};

/// A leaf holds a value; an object's keys are a table of their own (over a member struct,
/// or over the same struct when the JSON groups fields that `Config` keeps flat); an array
/// holds objects of one table.
enum class Kind { leaf, object, array };

/// When a changed value takes effect: at the next start, or at a reload (SIGHUP) too. A key
/// inside an object or array that a reload applies is applied with it.
enum class Reload { restart, sighup };

/// How a string key is printed: always, only when set, or only when set and then as
/// "<redacted>" (a secret).
enum class Print { always, unless_empty, redacted };

/// The descriptor of one key of the struct S. The functions are made by the factories below
/// from a member pointer; a table is a vector of these, in the order keys are read.
template <typename S>
struct Key {
    const char* name = "";
    Kind kind = Kind::leaf;
    std::string type{};
    std::string range{};
    bool reloadable = false;
    const char* doc = "";
    /// Reads the key from its object into S, checking type, range and allowed values.
    std::function<void(Obj&, S&)> read{};
    /// Sets the key's effective value in its object.
    std::function<void(const S&, json&)> write{};
    /// Objects only: the restart diff of their keys.
    std::function<void(const S&, const S&, const std::string&, std::vector<std::string>&)>
        inner_diff{};
    /// Objects and arrays: the reference rows of their keys (arrays with an element's
    /// defaults); the flag says whether a reload applies the enclosing key.
    std::function<void(const S&, const std::string&, bool, std::vector<Row>&)> inner_rows{};
};

template <typename S>
using Keys = std::vector<Key<S>>;

std::string join(const std::string& prefix, const char* name) {
    return prefix.empty() ? std::string(name) : prefix + "." + name;
}

template <typename S>
void read_keys(Obj& o, const Keys<S>& keys, S& s) {
    for (const auto& k : keys) k.read(o, s);
    o.done();
}

template <typename S>
json write_keys(const Keys<S>& keys, const S& s) {
    json j = json::object();
    for (const auto& k : keys) k.write(s, j);
    return j;
}

template <typename S>
void diff_keys(const Keys<S>& keys, const S& a, const S& b, const std::string& prefix,
               std::vector<std::string>& out) {
    for (const auto& k : keys) {
        if (k.reloadable) continue;
        const auto path = join(prefix, k.name);
        if (k.inner_diff) {
            k.inner_diff(a, b, path, out);
            continue;
        }
        json ja = json::object();
        json jb = json::object();
        k.write(a, ja);
        k.write(b, jb);
        if (ja != jb) out.push_back(path);
    }
}

template <typename S>
void keys_rows(const Keys<S>& keys, const S& defaults, const std::string& prefix, bool reloadable,
               std::vector<Row>& out) {
    for (const auto& k : keys) {
        Row row{join(prefix, k.name), k.type, "", k.range, reloadable || k.reloadable, k.doc};
        if (k.kind != Kind::object) {
            json j = json::object();
            k.write(defaults, j);
            if (j.contains(k.name)) row.default_value = j[k.name].dump();
        }
        out.push_back(row);
        if (k.inner_rows) k.inner_rows(defaults, row.key, row.reloadable, out);
    }
}

// The factories: one per kind of value, each taking the key's name, its field and its doc.

template <typename S>
Key<S> str(const char* name, std::string S::*field, const char* doc, Print print = Print::always) {
    return {.name = name,
            .type = "string",
            .doc = doc,
            .read = [name, field](Obj& o, S& s) { o.str(name, s.*field); },
            .write =
                [name, field, print](const S& s, json& j) {
                    const auto& v = s.*field;
                    if (print == Print::always) {
                        j[name] = v;
                    } else if (!v.empty()) {
                        j[name] = print == Print::redacted ? std::string("<redacted>") : v;
                    }
                }};
}

template <typename S>
Key<S> one_of(const char* name, std::string S::*field, std::vector<std::string> allowed,
              const char* doc) {
    std::string range;
    for (const auto& a : allowed) range += (range.empty() ? "\"" : ", \"") + a + "\"";
    return {.name = name,
            .type = "string",
            .range = range,
            .doc = doc,
            .read = [name, field, allowed = std::move(allowed)](
                        Obj& o, S& s) { o.one_of(name, s.*field, allowed); },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

template <typename S>
Key<S> boolean(const char* name, bool S::*field, const char* doc) {
    return {.name = name,
            .type = "boolean",
            .doc = doc,
            .read = [name, field](Obj& o, S& s) { o.boolean(name, s.*field); },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

std::string range_text(std::uint64_t lo, std::uint64_t hi) {
    return std::to_string(lo) + ".." + std::to_string(hi);
}

template <typename S, typename T>
Key<S> integer(const char* name, T S::*field, std::uint64_t lo, std::uint64_t hi, const char* doc) {
    return {.name = name,
            .type = "integer",
            .range = range_text(lo, hi),
            .doc = doc,
            .read = [name, field, lo, hi](Obj& o, S& s) { o.integer(name, s.*field, lo, hi); },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

/// An integer that may be absent; null clears it (no default, or no cap).
template <typename S, typename T>
Key<S> optional_integer(const char* name, std::optional<T> S::*field, std::uint64_t lo,
                        std::uint64_t hi, const char* doc) {
    return {.name = name,
            .type = "integer or null",
            .range = range_text(lo, hi),
            .doc = doc,
            .read =
                [name, field, lo, hi](Obj& o, S& s) {
                    const auto* v = o.get(name);
                    if (v == nullptr) return;
                    if (v->is_null()) {
                        (s.*field).reset();
                        return;
                    }
                    T value{};
                    o.integer(name, value, lo, hi);
                    s.*field = value;
                },
            .write =
                [name, field](const S& s, json& j) {
                    const auto& v = s.*field;
                    j[name] = v ? json(*v) : json(nullptr);
                }};
}

template <typename S>
Key<S> strings(const char* name, std::vector<std::string> S::*field, const char* doc) {
    return {.name = name,
            .type = "array of strings",
            .doc = doc,
            .read = [name, field](Obj& o, S& s) { o.strings(name, s.*field); },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

template <typename S>
Key<S> string_map(const char* name, std::map<std::string, std::string> S::*field, const char* doc) {
    return {.name = name,
            .type = "object of strings",
            .doc = doc,
            .read =
                [name, field](Obj& o, S& s) {
                    const auto* v = o.get(name);
                    if (v == nullptr) return;
                    if (!v->is_object()) fail(o.sub(name), "must be an object of strings");
                    for (const auto& [k, item] : v->items()) {
                        if (!item.is_string()) fail(o.sub(name) + "." + k, "must be a string");
                        (s.*field)[k] = item.template get<std::string>();
                    }
                },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

/// Any JSON object, kept as it is.
template <typename S>
Key<S> json_object(const char* name, json S::*field, const char* doc) {
    return {.name = name,
            .type = "object (any JSON)",
            .doc = doc,
            .read =
                [name, field](Obj& o, S& s) {
                    const auto* v = o.get(name);
                    if (v == nullptr) return;
                    if (!v->is_object()) fail(o.sub(name), "must be an object");
                    s.*field = *v;
                },
            .write = [name, field](const S& s, json& j) { j[name] = s.*field; }};
}

/// An object whose keys are some of NAMES(), each an integer in lo..hi; a name not given is
/// absent from the map.
template <typename S>
Key<S> integer_map(const char* name, std::map<std::string, std::uint64_t> S::*field,
                   const std::vector<std::string>& (*names)(), std::uint64_t lo, std::uint64_t hi,
                   const char* doc) {
    std::string range = range_text(lo, hi) + "; keys:";
    for (const auto& n : names()) range += " " + n;
    return {.name = name,
            .type = "object of integers",
            .range = range,
            .doc = doc,
            .read =
                [name, field, names, lo, hi](Obj& o, S& s) {
                    const auto* v = o.get(name);
                    if (v == nullptr) return;
                    Obj inner(*v, o.sub(name));
                    for (const auto& n : names()) {
                        if (!v->contains(n)) continue;
                        std::uint64_t value = 0;
                        inner.integer(n, value, lo, hi);
                        (s.*field)[n] = value;
                    }
                    inner.done();
                },
            .write =
                [name, field](const S& s, json& j) {
                    json m = json::object();
                    for (const auto& [k, value] : s.*field) m[k] = value;
                    j[name] = std::move(m);
                }};
}

/// An object whose keys are KEYS over the T that GET gives of S (a member, or S itself).
template <typename S, typename T, typename Get>
Key<S> nested(const char* name, Get get, const Keys<T>& keys, const char* doc, Reload reload) {
    const Keys<T>* k = &keys;  // the tables are function statics: they outlive every Key
    return {
        .name = name,
        .kind = Kind::object,
        .type = "object",
        .reloadable = reload == Reload::sighup,
        .doc = doc,
        .read =
            [name, get, k](Obj& o, S& s) {
                if (const auto* v = o.get(name)) {
                    Obj inner(*v, o.sub(name));
                    read_keys(inner, *k, get(s));
                }
            },
        .write = [name, get, k](const S& s, json& j) { j[name] = write_keys(*k, get(s)); },
        .inner_diff =
            [get, k](const S& a, const S& b, const std::string& path,
                     std::vector<std::string>& out) { diff_keys(*k, get(a), get(b), path, out); },
        .inner_rows = [get, k](
                          const S& d, const std::string& path, bool reloadable,
                          std::vector<Row>& out) { keys_rows(*k, get(d), path, reloadable, out); }};
}

/// An object held in the member FIELD of S.
template <typename S, typename T>
Key<S> object(const char* name, T S::*field, const Keys<T>& keys, const char* doc,
              Reload reload = Reload::restart) {
    return nested<S, T>(
        name, [field](auto& s) -> auto& { return s.*field; }, keys, doc, reload);
}

/// An object in the JSON whose keys are fields of S itself.
template <typename S>
Key<S> group(const char* name, const Keys<S>& keys, const char* doc) {
    return nested<S, S>(
        name, [](auto& s) -> auto& { return s; }, keys, doc, Reload::restart);
}

/// An array of objects, each read by KEYS; compared as a whole by the restart diff.
template <typename S, typename T>
Key<S> array(const char* name, std::vector<T> S::*field, const Keys<T>& keys, const char* doc,
             Reload reload = Reload::restart) {
    const Keys<T>* k = &keys;
    return {.name = name,
            .kind = Kind::array,
            .type = "array of objects",
            .reloadable = reload == Reload::sighup,
            .doc = doc,
            .read =
                [name, field, k](Obj& o, S& s) {
                    const auto* v = o.get(name);
                    if (v == nullptr) return;
                    if (!v->is_array()) fail(o.sub(name), "must be an array");
                    for (std::size_t i = 0; i < v->size(); ++i) {
                        Obj element((*v)[i], o.sub(name) + "[" + std::to_string(i) + "]");
                        (s.*field).emplace_back();
                        read_keys(element, *k, (s.*field).back());
                    }
                },
            .write =
                [name, field, k](const S& s, json& j) {
                    json a = json::array();
                    for (const auto& element : s.*field) a.push_back(write_keys(*k, element));
                    j[name] = std::move(a);
                },
            .inner_rows =
                [k](const S&, const std::string& path, bool reloadable, std::vector<Row>& out) {
                    keys_rows(*k, T{}, path + "[]", reloadable, out);
                }};
}

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = 1024 * kib;
constexpr std::uint64_t gib = 1024 * mib;
constexpr std::uint64_t day_ms = 24 * 3600000ULL;
constexpr std::uint64_t max_id = 0xFFFFFFFEULL;

// The tables, one per struct (and per JSON object that `Config` keeps flat), in the order the
// keys are read: that order decides which of two errors a config gets.

const Keys<TlsFilesConfig>& tls_files_keys() {
    using T = TlsFilesConfig;
    static const Keys<T> keys = {
        str("caFile", &T::ca_file, "CAs that verify the other side (PEM)."),
        str("certFile", &T::cert_file, "This side's certificate chain (PEM)."),
        str("keyFile", &T::key_file, "Its private key (PEM)."),
    };
    return keys;
}

const Keys<ListenerTlsConfig>& listener_tls_keys() {
    using T = ListenerTlsConfig;
    static const Keys<T> keys = {
        str("certFile", &T::cert_file,
            "The node's certificate, then its chain (PEM); \"\" = no TLS."),
        str("keyFile", &T::key_file, "Its private key (PEM); with certFile."),
        str("clientCaFile", &T::client_ca_file,
            "CAs every client certificate must verify against; \"\" = none required."),
        one_of("minVersion", &T::min_version, {"1.2", "1.3"}, "The lowest TLS version accepted."),
    };
    return keys;
}

const Keys<RegistryConfig>& registry_keys() {
    using T = RegistryConfig;
    static const Keys<T> keys = {
        one_of("kind", &T::kind, {"sqlite", "etcd"},
               "sqlite: one file shared by the nodes of one host; etcd: its v3 JSON gateway."),
        str("path", &T::path, "sqlite only: the database file; \"\" = <stateDir>/registry.db."),
        strings("endpoints", &T::endpoints,
                "etcd only: gateway URLs, http:// or https://; at least one for etcd."),
        str("prefix", &T::prefix, "etcd only: the prefix of every key of this cluster."),
        str("username", &T::username, "etcd only: the user to authenticate as; \"\" = no auth."),
        str("passwordFile", &T::password_file,
            "etcd only: a file holding that user's password; with username."),
        integer("startupTimeoutMs", &T::startup_timeout_ms, 0, 3600000,
                "How long a start retries an unreachable registry before exiting 1, ms."),
        object("tls", &T::tls, tls_files_keys(),
               "etcd only, for https:// endpoints: as etcdctl's --cacert, --cert and --key.",
               Reload::sighup),
    };
    return keys;
}

const Keys<TokenConfig>& token_keys() {
    using T = TokenConfig;
    static const Keys<T> keys = {
        str("name", &T::name, "Label for logs; not \"\"."),
        str("token", &T::token, "The secret itself (printed as <redacted>); or tokenFile.",
            Print::redacted),
        str("tokenFile", &T::token_file,
            "A file holding the secret (trailing whitespace trimmed); or token.",
            Print::unless_empty),
        one_of("role", &T::role, {"host", "peer", "metrics"},
               "host: a host server; peer: another node; metrics: GET /metrics only."),
        strings("tenants", &T::tenants, "companyIds it may act for; \"*\" = every tenant."),
        str("nodeId", &T::node_id,
            "Peer only: the one node its links must come from; \"\" = any node.",
            Print::unless_empty),
    };
    return keys;
}

const Keys<Config>& auth_keys() {
    static const Keys<Config> keys = {
        array("tokens", &Config::tokens, token_keys(),
              "Bearer tokens accepted; none: one is made in <stateDir>/admin.token.",
              Reload::sighup),
    };
    return keys;
}

const Keys<Config>& routing_keys() {
    static const Keys<Config> keys = {
        one_of("mode", &Config::routing_mode, {"proxy", "redirect"},
               "proxy: relay through the owner node; redirect: OWNER_ELSEWHERE naming it."),
        integer("nodeTtlMs", &Config::node_ttl_ms, 1000, 600000,
                "A node is alive while its heartbeat is younger than this, ms."),
        integer("heartbeatMs", &Config::heartbeat_ms, 100, 60000,
                "Period of the heartbeat and the sweeper, ms; at most nodeTtlMs / 3."),
        integer("adoptGraceMs", &Config::adopt_grace_ms, 0, 3600000,
                "How long beyond nodeTtlMs a dead owner's bwrap leases are left to its "
                "restart, ms."),
        object("peerTls", &Config::peer_tls, tls_files_keys(),
               "Mutual TLS between nodes (needs tls): all three files or none.", Reload::sighup),
    };
    return keys;
}

const Keys<LeaseLimits>& lease_limits_keys() {
    using T = LeaseLimits;
    static const Keys<T> keys = {
        optional_integer("memoryBytes", &T::memory_bytes, 16 * mib, 1ULL << 50,
                         "Memory of all the lease's processes, tmpfs included, bytes."),
        optional_integer("pids", &T::pids, 8, 4194304, "Processes and threads."),
        optional_integer("cpuWeight", &T::cpu_weight, 1, 10000,
                         "CPU share against other leases; 100 = an equal share."),
        optional_integer("cpuQuotaPercent", &T::cpu_quota_percent, 1, 100000,
                         "Hard CPU cap, percent of one core."),
        optional_integer("diskBytes", &T::disk_bytes, 8 * mib, 1ULL << 40,
                         "Size of the workspace filesystem, bytes."),
        optional_integer("openFiles", &T::open_files, 16, 1048576,
                         "RLIMIT_NOFILE of every process."),
        optional_integer("ioReadBps", &T::io_read_bps, 65536, 1ULL << 40,
                         "Bytes per second read from the workspace disk."),
        optional_integer("ioWriteBps", &T::io_write_bps, 65536, 1ULL << 40,
                         "Bytes per second written to the workspace disk."),
        optional_integer("ioReadIops", &T::io_read_iops, 16, 10000000,
                         "Read operations per second on the workspace disk."),
        optional_integer("ioWriteIops", &T::io_write_iops, 16, 10000000,
                         "Write operations per second on the workspace disk."),
        optional_integer("ioWeight", &T::io_weight, 1, 10000,
                         "Disk time share against other leases (cgroup v2 only)."),
        optional_integer("egressBps", &T::egress_bps, 65536, 2147483647,
                         "Network bytes per second of a lease with egress, each way."),
    };
    return keys;
}

const Keys<BwrapLimitsConfig>& bwrap_limits_keys() {
    using T = BwrapLimitsConfig;
    static const Keys<T> keys = {
        boolean("enforce", &T::enforce,
                "Refuse to start unless cgroups and loop devices can enforce the limits."),
        integer("overcommit", &T::overcommit, 1, 1000,
                "The node's pid and open-file budgets times this bound its leases' caps."),
        object("defaults", &T::defaults, lease_limits_keys(),
               "Limits of a lease that asks for none; a key with a max needs one."),
        object("max", &T::max, lease_limits_keys(), "The most a lease may ask for; null = no cap."),
    };
    return keys;
}

const Keys<BwrapIdentityConfig>& identity_keys() {
    using T = BwrapIdentityConfig;
    static const Keys<T> keys = {
        integer("hostIdFirst", &T::host_id_first, 1, max_id,
                "The first host uid (and gid) given to a lease."),
        integer("hostIdCount", &T::host_id_count, 1, max_id,
                "How many, one per lease; the range ends below 4294967295."),
        integer("insideUid", &T::inside_uid, 0, max_id, "The uid the command sees."),
        integer("insideGid", &T::inside_gid, 0, max_id, "The gid the command sees."),
        str("lockFile", &T::lock_file,
            "Byte-range locks by which every sandboxd on the host claims its uids."),
    };
    return keys;
}

const Keys<BwrapNetworkConfig>& bwrap_network_keys() {
    using T = BwrapNetworkConfig;
    static const Keys<T> keys = {
        boolean("egress", &T::egress,
                "Whether a lease may have egress (a policy of mode \"egress\", or true)."),
        str("pool", &T::pool,
            "Lease addresses, an IPv4 /8../28; its first is every lease's gateway."),
        str("uplink", &T::uplink, "The interface NAT uses; \"\" = the host's routes choose."),
        strings("deny", &T::deny, "IPv4 addresses and CIDRs no lease ever reaches."),
        strings("open", &T::open, "IPv4 addresses and CIDRs reachable though private (a mirror)."),
        strings("dns", &T::dns, "Upstream resolvers, ADDRESS[:PORT]; empty = /etc/resolv.conf's."),
        json_object("defaults", &T::defaults,
                    "{allow?, deny?}: the rules that a lease's network: true stands for."),
    };
    return keys;
}

const Keys<BwrapConfig>& bwrap_keys() {
    using T = BwrapConfig;
    static const Keys<T> keys = {
        boolean("enabled", &T::enabled, "Offer the bwrap provider."),
        str("path", &T::path, "The bubblewrap executable."),
        str("initPath", &T::init_path,
            "sandboxd-init; \"\" = next to sandboxd, then <libexecdir>/sandboxd."),
        boolean("allowNetwork", &T::allow_network,
                "Deprecated: network.egress. true turns egress on."),
        object("network", &T::network, bwrap_network_keys(),
               "Each lease's network namespace: egress, pool, policy defaults."),
        object("limits", &T::limits, bwrap_limits_keys(), "Per-lease limits."),
        object("identity", &T::identity, identity_keys(),
               "The host uids (and gids) of the leases' processes."),
        integer("adoptTimeoutMs", &T::adopt_timeout_ms, 0, 86400000,
                "How long a sandbox outlives its daemon waiting to be re-adopted, ms; 0: it "
                "ends with its daemon."),
        strings("etcFiles", &T::etc_files,
                "Entries of the host's /etc copied into the sandbox's (relative paths)."),
    };
    return keys;
}

const Keys<PluginCleanupConfig>& cleanup_keys() {
    using T = PluginCleanupConfig;
    static const Keys<T> keys = {
        integer("attempts", &T::attempts, 1, 1000, "Quick attempts, then the slow retry."),
        integer("backoffMs", &T::backoff_ms, 1, day_ms,
                "Wait after the first failed attempt, ms; doubles per attempt."),
        integer("slowRetryMs", &T::slow_retry_ms, 1, day_ms,
                "The retry period after the quick attempts, ms."),
    };
    return keys;
}

const Keys<PluginConfig>& plugin_keys() {
    using T = PluginConfig;
    static const Keys<T> keys = {
        str("pluginId", &T::plugin_id, "Unique id of this worker; not \"\"."),
        str("provider", &T::provider, "The provider name leaseAcquire asks for; not \"\"."),
        strings("command", &T::command, "The worker's argv; not empty."),
        string_map("env", &T::env, "Extra environment of the worker."),
        str("manifest", &T::manifest,
            "The plugin's manifest JSON file, sent in initialize; \"\" = a minimal one."),
        json_object("config", &T::config,
                    "The instance config, sent in initialize and served to config.get."),
        integer_map("timeoutsMs", &T::timeouts_ms, &plugin_timeout_methods, 1, day_ms,
                    "Per SDK method, ms; else 300000 (environment*Lease) or 30000."),
        object("cleanup", &T::cleanup, cleanup_keys(),
               "How the sweeper retries a lease whose teardown failed."),
        integer("maxBufferedBytes", &T::max_buffered_bytes, 64 * kib, gib,
                "Output bytes of one channel not yet credited; over it: FLOW_CONTROL."),
    };
    return keys;
}

const Keys<Config>& noop_keys() {
    static const Keys<Config> keys = {
        boolean("enabled", &Config::noop_provider, "Offer the no-op provider (benchmarks only)."),
    };
    return keys;
}

const Keys<Config>& providers_keys() {
    static const Keys<Config> keys = {
        object("bwrap", &Config::bwrap, bwrap_keys(), "The built-in bubblewrap provider."),
        group("noop", noop_keys(), "The no-op provider: leases with no sandbox."),
        array("plugins", &Config::plugins, plugin_keys(),
              "Plugin providers: workers speaking JSON-RPC over stdio."),
    };
    return keys;
}

const Keys<LimitsConfig>& limits_keys() {
    using T = LimitsConfig;
    static const Keys<T> keys = {
        integer("maxTextMessage", &T::max_text_message, kib, 64 * mib,
                "Largest text (JSON-RPC) message, bytes."),
        integer("maxDataPayload", &T::max_data_payload, kib, 16 * mib,
                "Largest data frame payload, bytes; at most 16 x maxTextMessage."),
        integer("channelsPerConnection", &T::channels_per_connection, 1, 1 << 20,
                "Channels open at once on one connection."),
        integer("channelsPerNode", &T::channels_per_node, 1, 1 << 20,
                "Channels open at once on this node."),
        integer("requestsPerConnection", &T::requests_per_connection, 1, 1 << 16,
                "Requests of one connection served at once."),
        integer("outputWindow", &T::output_window, kib, gib,
                "Default outputWindow of a channel, bytes."),
        integer("stdinWindow", &T::stdin_window, kib, gib,
                "Default stdinWindow of a channel, bytes."),
        integer("maxOutputWindow", &T::max_output_window, kib, gib,
                "Largest outputWindow an open may ask for, bytes; at least outputWindow."),
        integer("maxStdinWindow", &T::max_stdin_window, kib, gib,
                "Largest stdinWindow an open may ask for, bytes; at least stdinWindow."),
        integer("detachRetainMs", &T::detach_retain_ms, 1000, 30 * day_ms,
                "Default detach.retainMs: how long a detached channel's exit is kept, ms."),
        integer("maxDetachRetainMs", &T::max_detach_retain_ms, 1000, 30 * day_ms,
                "Largest detach.retainMs an open may ask for, ms; at least detachRetainMs."),
        integer("detachRetainBytes", &T::detach_retain_bytes, 4 * kib, gib,
                "Default detach.retainBytes: the last bytes kept of each output stream of a "
                "detached channel."),
        integer("maxDetachRetainBytes", &T::max_detach_retain_bytes, 4 * kib, gib,
                "Largest detach.retainBytes an open may ask for; at least detachRetainBytes."),
        integer("detachKeptBytesPerLease", &T::detach_kept_bytes_per_lease, 8 * kib, 1024 * gib,
                "Kept output of one lease's detached channels together (2 x retainBytes each, "
                "running or with the exit kept); at least 2 x detachRetainBytes."),
        integer("detachKeptExitsPerLease", &T::detach_kept_exits_per_lease, 1, 65536,
                "Ended detached channels of one lease whose exit and output are kept; past it "
                "the oldest opened is forgotten first, whatever its retainMs."),
        integer("sendQueueBytes", &T::send_queue_bytes, 64 * kib, 64 * gib,
                "Bytes queued toward hosts on the whole node."),
        integer("sendQueueBytesPerConnection", &T::send_queue_bytes_per_connection, 64 * kib,
                64 * gib, "Bytes queued toward one host; at most sendQueueBytes."),
        integer("sendStallTimeoutMs", &T::send_stall_timeout_ms, 1000, day_ms,
                "A connection whose socket takes no queued byte this long is closed, ms."),
        integer("connections", &T::connections, 1, 1 << 20, "Connections open at once."),
        integer("pendingConnections", &T::pending_connections, 1, 1 << 20,
                "Connections not yet authenticated; at most connections."),
        integer("authTimeoutMs", &T::auth_timeout_ms, 100, 600000,
                "From accept to the TLS handshake and the first request, ms."),
        integer("pingIntervalMs", &T::ping_interval_ms, 100, 3600000,
                "Interval between WebSocket pings, ms."),
        integer("idleTimeoutMs", &T::idle_timeout_ms, 300, 3 * 3600000,
                "A connection silent this long is dropped, ms."),
        integer("drainGraceMs", &T::drain_grace_ms, 0, 60000,
                "Output drain after a command's main process ends, ms."),
        integer("hangupGraceMs", &T::hangup_grace_ms, 0, 5000,
                "SIGHUP to SIGKILL of a dropped connection's processes, ms."),
        integer("drainTimeoutMs", &T::drain_timeout_ms, 0, 3600000,
                "How long a drain lets running channels finish, ms."),
        integer("defaultTtlMs", &T::default_ttl_ms, 1000, 365 * day_ms,
                "Lease TTL when leaseAcquire gives none, ms; at most maxTtlMs."),
        integer("maxTtlMs", &T::max_ttl_ms, 1000, 365 * day_ms, "Largest ttlMs accepted, ms."),
        integer("executeOutputBytes", &T::execute_output_bytes, kib, 64 * mib,
                "leaseExecute: bytes of each output stream kept, bytes."),
        integer("executeTimeoutMs", &T::execute_timeout_ms, 1, day_ms,
                "leaseExecute's timeoutMs when the host gives none, ms."),
        integer("retainedTtlMs", &T::retained_ttl_ms, 1000, 365 * day_ms,
                "How long a retained lease waits for a reuse, ms."),
    };
    return keys;
}

const Keys<Config>& log_keys() {
    static const Keys<Config> keys = {
        one_of("level", &Config::log_level,
               {"trace", "debug", "info", "warn", "error", "critical", "off"},
               "The least severe level logged."),
        one_of("format", &Config::log_format, {"text", "json"},
               "text: lines for people; json: one JSON object per line."),
    };
    return keys;
}

const Keys<Config>& audit_keys() {
    static const Keys<Config> keys = {
        str("file", &Config::audit_file,
            "Audit lines appended here (mode 0600, reopened on SIGHUP); \"\" = none."),
        boolean("journald", &Config::audit_journald,
                "Audit lines to journald too (identifier sandboxd-audit)."),
    };
    return keys;
}

const Keys<Config>& metrics_keys() {
    static const Keys<Config> keys = {
        boolean("public", &Config::metrics_public,
                "GET /metrics without a token, on plainListen only (which must be set)."),
    };
    return keys;
}

const Keys<Config>& console_keys() {
    static const Keys<Config> keys = {
        boolean("enabled", &Config::console_enabled, "Serve the browser console at GET /console."),
        str("assetsDir", &Config::console_assets_dir,
            "The console's files; \"\" = those installed beside sandboxd."),
    };
    return keys;
}

const Keys<Config>& config_keys() {
    using C = Config;
    static const Keys<C> keys = {
        str("nodeId", &C::node_id, "This node's id in the registry; \"\" = the host name."),
        str("listen", &C::listen, "HOST:PORT of the WebSocket endpoint; port 0 picks a free one."),
        str("advertiseUrl", &C::advertise_url,
            "The ws:// or wss:// URL other nodes reach this one at; \"\" = the bound address."),
        object("tls", &C::tls, listener_tls_keys(), "TLS on listen when certFile is set.",
               Reload::sighup),
        str("plainListen", &C::plain_listen,
            "Loopback HOST:PORT served in plain text beside a TLS listen; \"\" = none."),
        str("stateDir", &C::state_dir,
            "The node's working data: sqlite registry, admin.token, workspaces; not \"\"."),
        integer("threads", &C::threads, 0, 256, "I/O threads; 0 = the number of CPU cores."),
        object("registry", &C::registry, registry_keys(),
               "Where leases and nodes are recorded, shared by every node."),
        group("auth", auth_keys(), "Who may connect."),
        group("routing", routing_keys(), "How a lease owned by another node is served."),
        group("providers", providers_keys(), "Sandbox providers."),
        object("limits", &C::limits, limits_keys(), "Resource limits."),
        group("log", log_keys(), "Logging, to stderr."),
        group("audit", audit_keys(), "The audit trail: one JSON line per security event."),
        group("metrics", metrics_keys(), "GET /metrics (Prometheus text)."),
        group("console", console_keys(), "The browser console (docs/protocol.md section 8)."),
    };
    return keys;
}

}  // namespace

void read(const nlohmann::json& document, Config& out) {
    Obj top(document, "");
    read_keys(top, config_keys(), out);
}

nlohmann::json write(const Config& config) { return write_keys(config_keys(), config); }

std::vector<std::string> restart_changes(const Config& running, const Config& next) {
    std::vector<std::string> out;
    diff_keys(config_keys(), running, next, "", out);
    return out;
}

std::vector<Row> reference_rows() {
    std::vector<Row> out;
    keys_rows(config_keys(), Config{}, "", false, out);
    return out;
}

}  // namespace config_keys
}  // namespace sandboxd
