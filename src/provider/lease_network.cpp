/// @file lease_network.cpp
/// Each lease's network namespace, veth pair, nftables policy and resolver
/// (lease_network.hpp). Links, addresses and routes go through libnl-route; the policy is
/// nftables script text given to libnftables, one transaction per change.
#include "provider/lease_network.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <netlink/netlink.h>
#include <netlink/route/addr.h>
#include <netlink/route/link.h>
#include <netlink/route/link/veth.h>
#include <netlink/route/qdisc.h>
#include <netlink/route/qdisc/tbf.h>
#include <netlink/route/route.h>
#include <nftables/libnftables.h>

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

namespace sandboxd::detail {
namespace {

namespace ip = boost::asio::ip;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

std::string errno_text(int err) { return std::strerror(err); }

/// Runs `f` on a thread of its own and waits: the thread may change its network namespace
/// (unshare, setns) without touching any other thread's. Exceptions come back to the caller.
template <typename F>
auto on_own_thread(F&& f) -> decltype(f()) {
    std::packaged_task<decltype(f())()> task(std::forward<F>(f));
    auto result = task.get_future();
    std::thread(std::move(task)).join();
    return result.get();
}

struct NlSock {
    nl_sock* sock;
    NlSock() : sock(nl_socket_alloc()) {
        if (sock == nullptr) fail("netlink: out of memory");
        if (int err = nl_connect(sock, NETLINK_ROUTE); err < 0) {
            nl_socket_free(sock);
            fail(std::string("netlink: cannot connect: ") + nl_geterror(err));
        }
    }
    ~NlSock() { nl_socket_free(sock); }
    NlSock(const NlSock&) = delete;
    NlSock& operator=(const NlSock&) = delete;
};

template <typename T, void (*Put)(T*)>
struct Ref {
    T* p = nullptr;
    explicit Ref(T* q = nullptr) : p(q) {}
    ~Ref() {
        if (p != nullptr) Put(p);
    }
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    T* get() const { return p; }
};
using LinkRef = Ref<rtnl_link, rtnl_link_put>;
using AddrRef = Ref<rtnl_addr, rtnl_addr_put>;
using RouteRef = Ref<rtnl_route, rtnl_route_put>;
using NlAddrRef = Ref<nl_addr, nl_addr_put>;
using CacheRef = Ref<nl_cache, nl_cache_free>;

void check_nl(int err, const std::string& what) {
    if (err < 0) fail(what + ": " + nl_geterror(err));
}

nl_addr* v4_addr(ip::address_v4 a, int prefix) {
    const auto bytes = a.to_bytes();
    nl_addr* out = nl_addr_build(AF_INET, bytes.data(), bytes.size());
    if (out == nullptr) fail("netlink: out of memory");
    nl_addr_set_prefixlen(out, prefix);
    return out;
}

int ifindex_of(nl_sock* s, const std::string& name) {
    rtnl_link* raw = nullptr;
    check_nl(rtnl_link_get_kernel(s, 0, name.c_str(), &raw), "cannot find interface " + name);
    LinkRef link(raw);
    return rtnl_link_get_ifindex(link.get());
}

void link_up(nl_sock* s, const std::string& name) {
    rtnl_link* raw = nullptr;
    check_nl(rtnl_link_get_kernel(s, 0, name.c_str(), &raw), "cannot find interface " + name);
    LinkRef link(raw);
    LinkRef change(rtnl_link_alloc());
    rtnl_link_set_flags(change.get(), IFF_UP);
    check_nl(rtnl_link_change(s, link.get(), change.get(), 0), "cannot bring " + name + " up");
}

/// `local` with `peer` on interface `ifindex`: both /32, so that the peer is on the link.
void add_peer_address(nl_sock* s, int ifindex, ip::address_v4 local, ip::address_v4 peer,
                      const std::string& what) {
    AddrRef addr(rtnl_addr_alloc());
    NlAddrRef l(v4_addr(local, 32));
    NlAddrRef p(v4_addr(peer, 32));
    rtnl_addr_set_ifindex(addr.get(), ifindex);
    rtnl_addr_set_family(addr.get(), AF_INET);
    check_nl(rtnl_addr_set_local(addr.get(), l.get()), what);
    check_nl(rtnl_addr_set_peer(addr.get(), p.get()), what);
    check_nl(rtnl_addr_add(s, addr.get(), 0), what);
}

void add_default_route(nl_sock* s, int ifindex, ip::address_v4 gateway) {
    RouteRef route(rtnl_route_alloc());
    rtnl_route_set_family(route.get(), AF_INET);
    NlAddrRef dst(v4_addr(ip::address_v4::any(), 0));
    check_nl(rtnl_route_set_dst(route.get(), dst.get()), "cannot make the default route");
    rtnl_nexthop* nh = rtnl_route_nh_alloc();
    if (nh == nullptr) fail("netlink: out of memory");
    rtnl_route_nh_set_ifindex(nh, ifindex);
    NlAddrRef gw(v4_addr(gateway, 32));
    rtnl_route_nh_set_gateway(nh, gw.get());
    rtnl_route_add_nexthop(route.get(), nh);  // the route owns it now
    check_nl(rtnl_route_add(s, route.get(), NLM_F_CREATE | NLM_F_EXCL),
             "cannot add the default route");
}

/// A token bucket of `bps` bytes per second on what interface `ifindex` sends. Its bucket
/// holds at least 256 KiB (a veth passes segments of up to 64 KiB, which a smaller bucket
/// would hold back for ever) or 10 ms at the rate; at most 50 ms of packets wait in it.
void limit_rate(nl_sock* s, int ifindex, std::uint64_t bps, const std::string& what) {
    Ref<rtnl_qdisc, rtnl_qdisc_put> qdisc(rtnl_qdisc_alloc());
    if (qdisc.get() == nullptr) fail("netlink: out of memory");
    auto* tc = TC_CAST(qdisc.get());
    rtnl_tc_set_ifindex(tc, ifindex);
    rtnl_tc_set_parent(tc, TC_H_ROOT);
    check_nl(rtnl_tc_set_kind(tc, "tbf"), what);
    const int rate = static_cast<int>(std::min<std::uint64_t>(bps, 2147483647));
    rtnl_qdisc_tbf_set_rate(qdisc.get(), rate, std::max(256 << 10, rate / 100), 0);
    check_nl(rtnl_qdisc_tbf_set_limit_by_latency(qdisc.get(), 50), what);
    check_nl(rtnl_qdisc_add(s, qdisc.get(), NLM_F_CREATE | NLM_F_REPLACE), what);
}

/// Brings the namespace's loopback up (from a thread inside it).
void loopback_up() {
    NlSock s;
    link_up(s.sock, "lo");
}

std::string hex(std::uint32_t n, int width) {
    char text[16];
    std::snprintf(text, sizeof text, "%0*x", width, n);
    return text;
}

std::string cidr_list(const std::vector<ip::network_v4>& nets) {
    std::string out;
    for (const auto& n : nets) {
        if (!out.empty()) out += ", ";
        out += n.prefix_length() == 32 ? n.address().to_string() : n.to_string();
    }
    return out;
}

std::string ports_text(const std::vector<PortRange>& ports) {
    std::string out;
    for (const auto& p : ports) {
        if (!out.empty()) out += ", ";
        out += std::to_string(p.first);
        if (p.last != p.first) out += "-" + std::to_string(p.last);
    }
    return out;
}

/// The transport part of a rule: protocol and ports, "" for any.
std::string transport(const NetworkRule& rule) {
    const std::string proto = rule.protocol == rule_protocol::tcp   ? "tcp"
                              : rule.protocol == rule_protocol::udp ? "udp"
                                                                    : "";
    if (rule.ports.empty()) return proto.empty() ? "" : "meta l4proto " + proto + " ";
    const std::string ports = "{ " + ports_text(rule.ports) + " }";
    if (proto.empty()) return "meta l4proto { tcp, udp } th dport " + ports + " ";
    return proto + " dport " + ports + " ";
}

/// A lease's chain: "lease_<index in hex>". A prefix of its own keeps every name clear of
/// nftables' keywords ("l" and the hex index 14 made "le", the operator).
std::string lease_chain(std::uint32_t index) { return "lease_" + hex(index, 1); }

bool domain_matches(const DomainName& rule, const std::string& name) {
    if (!rule.subdomains) return name == rule.name;
    return name.size() > rule.name.size() + 1 &&
           name.compare(name.size() - rule.name.size(), rule.name.size(), rule.name) == 0 &&
           name[name.size() - rule.name.size() - 1] == '.';
}

bool has_domain_rule(const std::vector<NetworkRule>& rules) {
    return std::any_of(rules.begin(), rules.end(), [](const NetworkRule& r) {
        return std::holds_alternative<DomainName>(r.host);
    });
}

/// The upstream resolvers of /etc/resolv.conf (port 53), in its order.
std::vector<ip::udp::endpoint> host_resolvers() {
    std::vector<ip::udp::endpoint> out;
    std::ifstream in("/etc/resolv.conf");
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream words(line);
        std::string key;
        std::string value;
        if (!(words >> key >> value) || key != "nameserver") continue;
        boost::system::error_code ec;
        auto a = ip::make_address(value, ec);
        if (!ec) out.emplace_back(a, 53);
    }
    return out;
}

}  // namespace

void ResolvedNames::add(const std::string& name, ip::address_v4 address,
                        std::chrono::steady_clock::time_point until) {
    if (names.size() >= max_names && !names.count(name)) {
        const auto now = std::chrono::steady_clock::now();
        for (auto it = names.begin(); it != names.end();) {
            auto& addresses = it->second;
            std::erase_if(addresses, [&](const auto& entry) { return entry.second <= now; });
            it = addresses.empty() ? names.erase(it) : std::next(it);
        }
        if (names.size() >= max_names) names.erase(names.begin());
    }
    auto& addresses = names[name];
    if (addresses.size() >= max_addresses && !addresses.count(address)) {
        addresses.erase(
            std::min_element(addresses.begin(), addresses.end(),
                             [](const auto& a, const auto& b) { return a.second < b.second; }));
    }
    auto& kept = addresses[address];
    kept = std::max(kept, until);
}

const std::vector<ip::network_v4>& builtin_deny_v4() {
    static const std::vector<ip::network_v4> nets = [] {
        std::vector<ip::network_v4> out;
        for (const char* text :
             {"0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
              "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4"}) {
            out.push_back(ip::make_network_v4(text));
        }
        return out;
    }();
    return nets;
}

struct NodeNetwork::Impl {
    std::mutex mutex;  // guards everything below but `denied`
    std::mutex denied_mutex;
    std::map<std::string, std::uint64_t> denied;  // what denied() read last
    // Made by enable(), with egress only: a node without egress holds no descriptor for it.
    std::unique_ptr<NlSock> host;
    nft_ctx* nft = nullptr;
    std::set<std::uint32_t> used;
    std::uint32_t cursor = 1;  // the last index given; the next search starts after it
    std::string table;         // "inet sandboxd_<tag>"
    std::string prefix;        // "sx<tag>"
    // The resolvers' own thread: they answer while the provider's threads block.
    boost::asio::io_context io;
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work{
        io.get_executor()};
    std::thread io_thread;

    Impl() = default;
    void enable() {
        host = std::make_unique<NlSock>();
        nft = nft_ctx_new(NFT_CTX_DEFAULT);
        if (nft == nullptr) fail("nftables: out of memory");
        nft_ctx_buffer_output(nft);
        nft_ctx_buffer_error(nft);
        io_thread = std::thread([this] { io.run(); });
    }
    ~Impl() {
        work.reset();
        io.stop();
        if (io_thread.joinable()) io_thread.join();
        if (nft != nullptr) nft_ctx_free(nft);
    }
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;

    /// Runs one nftables transaction; throws with nftables' own words. Lock held.
    void run_nft(const std::string& script, const std::string& what) {
        if (nft_run_cmd_from_buffer(nft, script.c_str()) != 0) {
            std::string why = nft_ctx_get_error_buffer(nft);
            while (!why.empty() && why.back() == '\n') why.pop_back();
            fail("nftables: cannot " + what + ": " + why);
        }
        nft_ctx_get_output_buffer(nft);  // drop what it printed
    }
};

// ---- the node -------------------------------------------------------------------------

NodeNetwork::NodeNetwork(NodeNetworkOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
    gateway_ = ip::address_v4(options_.pool.network().to_uint() + 1);
    impl_->table = "inet sandboxd_" + options_.tag;
    impl_->prefix = "sx" + options_.tag;
}

// The table stays: the policy of the leases kept for the next process must hold while no
// daemon runs (the next start rebuilds it). Every lease's own objects went with it.
NodeNetwork::~NodeNetwork() = default;

std::map<std::string, std::uint64_t> NodeNetwork::denied() const {
    if (!options_.egress) return {};
    std::unique_lock lock(impl_->mutex, std::try_to_lock);
    if (!lock.owns_lock()) {
        std::lock_guard last(impl_->denied_mutex);
        return impl_->denied;
    }
    std::map<std::string, std::uint64_t> out;
    if (nft_run_cmd_from_buffer(impl_->nft,
                                ("list counters table " + impl_->table + "\n").c_str()) != 0) {
        nft_ctx_get_error_buffer(impl_->nft);
        std::lock_guard last(impl_->denied_mutex);
        return impl_->denied;
    }
    // "counter denied_<reason> { packets N bytes M }", as nft lists it.
    std::istringstream in(nft_ctx_get_output_buffer(impl_->nft));
    std::string word;
    std::string reason;
    while (in >> word) {
        if (word == "counter" && in >> word && word.rfind("denied_", 0) == 0) {
            reason = word.substr(7);
        } else if (word == "packets" && !reason.empty()) {
            std::uint64_t packets = 0;
            if (in >> packets) out[reason] = packets;
            reason.clear();
        }
    }
    std::lock_guard last(impl_->denied_mutex);
    impl_->denied = out;
    return out;
}

std::string NodeNetwork::resolv_conf() const {
    return "nameserver " + gateway_.to_string() + "\noptions edns0 trust-ad\n";
}

namespace {

/// Removes the interfaces of ours (`prefix` and a hex index) whose index is not in `kept`: an
/// earlier process's. Returns every interface's name by index.
std::map<int, std::string> remove_stale_links(nl_sock* sock, const std::string& prefix,
                                              const std::vector<std::uint32_t>& kept) {
    nl_cache* raw = nullptr;
    check_nl(rtnl_link_alloc_cache(sock, AF_UNSPEC, &raw), "cannot list interfaces");
    CacheRef links(raw);
    std::map<int, std::string> names;
    std::vector<std::string> stale;
    for (nl_object* obj = nl_cache_get_first(links.get()); obj != nullptr;
         obj = nl_cache_get_next(obj)) {
        auto* link = reinterpret_cast<rtnl_link*>(obj);
        const std::string name = rtnl_link_get_name(link);
        names[rtnl_link_get_ifindex(link)] = name;
        if (name.rfind(prefix, 0) != 0) continue;
        const std::string rest = name.substr(prefix.size());
        const auto index = static_cast<std::uint32_t>(std::strtoul(rest.c_str(), nullptr, 16));
        if (std::find(kept.begin(), kept.end(), index) == kept.end()) stale.push_back(name);
    }
    for (const auto& name : stale) {
        LinkRef link(rtnl_link_alloc());
        rtnl_link_set_name(link.get(), name.c_str());
        if (int err = rtnl_link_delete(sock, link.get()); err < 0) {
            spdlog::warn("network: cannot remove {}, left by an earlier process: {}", name,
                         nl_geterror(err));
        } else {
            spdlog::info("network: removed {}, left by an earlier process", name);
        }
    }
    return names;
}

/// Throws when a route of the main table on an interface not ours overlaps `pool`.
void check_pool(nl_sock* sock, const ip::network_v4& pool, const std::string& prefix,
                const std::map<int, std::string>& names) {
    nl_cache* raw = nullptr;
    check_nl(rtnl_route_alloc_cache(sock, AF_INET, 0, &raw), "cannot list routes");
    CacheRef routes(raw);
    const auto pool_first = pool.network().to_uint();
    const auto pool_last = pool.broadcast().to_uint();
    for (nl_object* obj = nl_cache_get_first(routes.get()); obj != nullptr;
         obj = nl_cache_get_next(obj)) {
        auto* route = reinterpret_cast<rtnl_route*>(obj);
        if (rtnl_route_get_table(route) != RT_TABLE_MAIN) continue;
        nl_addr* dst = rtnl_route_get_dst(route);
        if (dst == nullptr || nl_addr_get_family(dst) != AF_INET) continue;
        const unsigned length = nl_addr_get_prefixlen(dst);
        if (length == 0) continue;  // a default route overlaps everything
        std::uint32_t first = 0;
        std::memcpy(&first, nl_addr_get_binary_addr(dst), 4);
        first = ntohl(first);
        const std::uint32_t mask = length >= 32 ? 0xffffffffU : ~(0xffffffffU >> length);
        first &= mask;
        const std::uint32_t last = first | ~mask;
        if (last < pool_first || first > pool_last) continue;
        std::string dev = "?";
        if (rtnl_route_get_nnexthops(route) > 0) {
            const auto it = names.find(rtnl_route_nh_get_ifindex(rtnl_route_nexthop_n(route, 0)));
            if (it != names.end()) dev = it->second;
        }
        if (dev.rfind(prefix, 0) == 0) continue;  // a kept lease of ours
        fail("network: the lease pool " + pool.to_string() + " overlaps the route to " +
             ip::address_v4(first).to_string() + "/" + std::to_string(length) + " on " + dev +
             " (another node's pool, or a network of this host): give "
             "providers.bwrap.network.pool a range of its own");
    }
}

/// net.ipv4.ip_forward in this process's network namespace: egress needs it.
void turn_on_forwarding() {
    std::ifstream in("/proc/sys/net/ipv4/ip_forward");
    int value = 0;
    in >> value;
    if (value == 1) return;
    std::ofstream out("/proc/sys/net/ipv4/ip_forward");
    out << "1\n";
    out.close();
    if (!out) fail("network: cannot turn on net.ipv4.ip_forward (egress needs it)");
    spdlog::info("network: turned on net.ipv4.ip_forward for the leases' egress");
}

/// The node's table `t`, made anew: its sets, verdict maps, refusals and base chains (a kept
/// lease's chain is made again by readopt()).
std::string table_script(const std::string& t, const std::string& prefix,
                         const NodeNetworkOptions& o) {
    const std::string lease_if = "\"" + prefix + "*\"";
    std::ostringstream s;
    s << "table " << t << " {}\ndelete table " << t << "\n";
    s << "table " << t << " {\n";
    s << "  set node_deny { type ipv4_addr; flags interval; auto-merge; "
      << (o.deny.empty() ? "" : "elements = { " + cidr_list(o.deny) + " }; ") << "}\n";
    s << "  set node_open { type ipv4_addr; flags interval; auto-merge; "
      << (o.open.empty() ? "" : "elements = { " + cidr_list(o.open) + " }; ") << "}\n";
    s << "  set builtin_deny { type ipv4_addr; flags interval; auto-merge; elements = { "
      << cidr_list(builtin_deny_v4()) << " }; }\n";
    s << "  map lease_fwd { type ifname : verdict; }\n";
    s << "  map lease_in { type ifname : verdict; }\n";
    s << "  map lease_dns { type ifname : verdict; }\n";
    for (const char* reason : {"node", "private", "host", "lease", "rule", "allow", "spoof"}) {
        s << "  counter denied_" << reason << " {}\n";
        s << "  chain deny_" << reason << " { counter name \"denied_" << reason
          << "\"; meta l4proto tcp reject with tcp reset; reject with icmpx type "
             "admin-prohibited; }\n";
    }
    s << "  chain forward { type filter hook forward priority filter; policy accept;\n"
      << "    iifname " << lease_if << " iifname vmap @lease_fwd\n"
      << "    iifname " << lease_if << " drop\n"
      << "    oifname " << lease_if << " ct state established,related accept\n"
      << "    oifname " << lease_if << " drop\n  }\n";
    s << "  chain input { type filter hook input priority filter; policy accept;\n"
      << "    iifname " << lease_if << " ct state established,related accept\n"
      << "    iifname " << lease_if << " iifname vmap @lease_in\n"
      << "    iifname " << lease_if << " goto deny_host\n  }\n";
    s << "  chain prerouting { type nat hook prerouting priority dstnat; policy accept;\n"
      << "    iifname " << lease_if << " iifname vmap @lease_dns\n  }\n";
    s << "  chain postrouting { type nat hook postrouting priority srcnat; policy accept;\n"
      << "    ip saddr " << o.pool.to_string() << " oifname != " << lease_if;
    if (!o.uplink.empty()) s << " oifname \"" << o.uplink << "\"";
    s << " masquerade\n  }\n}\n";
    return s.str();
}

}  // namespace

std::shared_ptr<NodeNetwork> NodeNetwork::start(NodeNetworkOptions options,
                                                const std::vector<std::uint32_t>& kept) {
    if (options.tag.size() != 6) fail("network: the node's tag must be 6 hex digits");
    if (options.pool.prefix_length() < 8 || options.pool.prefix_length() > 28) {
        fail("network: the pool " + options.pool.to_string() + " must be a /8 to a /28");
    }
    if (options.dns.empty()) options.dns = host_resolvers();
    std::shared_ptr<NodeNetwork> node(new NodeNetwork(std::move(options)));
    auto& impl = *node->impl_;
    const auto& o = node->options_;
    std::lock_guard lock(impl.mutex);

    // Interfaces and routes: ours (an earlier process's) and everybody else's.
    std::optional<NlSock> scratch;  // without egress, for the clean-up below only
    if (o.egress) {
        impl.enable();
    } else {
        scratch.emplace();
    }
    nl_sock* sock = o.egress ? impl.host->sock : scratch->sock;
    const auto names = remove_stale_links(sock, impl.prefix, kept);
    if (!o.egress) {
        // Nothing of the host's network changes: no table, no forwarding, no routes.
        spdlog::info(
            "network: each lease has a network namespace of its own; egress is off "
            "(providers.bwrap.network.egress)");
        return node;
    }
    check_pool(sock, o.pool, impl.prefix, names);
    turn_on_forwarding();
    const std::string t = impl.table;
    impl.run_nft(table_script(t, impl.prefix, o), "make the node's table " + t);
    for (auto index : kept) impl.used.insert(index);
    spdlog::info(
        "network: leases get their own network namespace; egress {} (pool {}, "
        "gateway and resolver {}, table {})",
        o.egress ? "allowed by policy" : "off", o.pool.to_string(), node->gateway_.to_string(), t);
    return node;
}

void NodeNetwork::stop_resolver(LeaseNetwork& lease) noexcept {
    if (!lease.resolver_) return;
    // Stopped and destroyed on its own thread, where it runs.
    try {
        std::promise<void> done;
        boost::asio::post(impl_->io, [&] {
            lease.resolver_->stop();
            lease.resolver_.reset();
            done.set_value();
        });
        done.get_future().wait();
    } catch (...) {
    }
}

void NodeNetwork::delete_link(const std::string& name) noexcept {
    if (!impl_->host) return;  // no egress: start() removed every interface of ours
    LinkRef link(rtnl_link_alloc());
    if (link.get() == nullptr) return;
    rtnl_link_set_name(link.get(), name.c_str());
    if (int err = rtnl_link_delete(impl_->host->sock, link.get());
        err < 0 && err != -NLE_OBJ_NOTFOUND && err != -NLE_NODEV) {
        spdlog::warn("network: cannot remove {}: {}", name, nl_geterror(err));
    }
}

void NodeNetwork::forget(const LeaseNetworkInfo& info) noexcept {
    if (info.index == 0) return;
    std::lock_guard lock(impl_->mutex);
    delete_link(info.host_interface);
    impl_->used.erase(info.index);
}

void LeaseNetwork::keep() noexcept {
    if (!node_) return;
    node_->stop_resolver(*this);
    node_.reset();
}

void NodeNetwork::detach(LeaseNetwork& lease) noexcept {
    stop_resolver(lease);
    if (lease.info_.index == 0) return;
    std::lock_guard lock(impl_->mutex);
    const std::string c = lease_chain(lease.info_.index);
    std::ostringstream s;
    s << "delete element " << impl_->table << " lease_fwd { \"" << lease.info_.host_interface
      << "\" }\n"
      << "delete element " << impl_->table << " lease_in { \"" << lease.info_.host_interface
      << "\" }\n"
      << "delete element " << impl_->table << " lease_dns { \"" << lease.info_.host_interface
      << "\" }\n";
    for (const char* suffix : {"", "_in", "_dns"}) {
        s << "flush chain " << impl_->table << " " << c << suffix << "\n"
          << "delete chain " << impl_->table << " " << c << suffix << "\n";
    }
    try {
        impl_->run_nft(s.str(), "remove the policy of " + lease.info_.host_interface);
    } catch (const std::exception& e) {
        spdlog::warn("network: {}", e.what());
    }
    // The domain sets, after the rules that named them.
    for (const auto& set : lease.sets_) {
        try {
            impl_->run_nft("delete set " + impl_->table + " " + set + "\n", "remove set " + set);
        } catch (const std::exception& e) {
            spdlog::warn("network: {}", e.what());
        }
    }
    delete_link(lease.info_.host_interface);
    impl_->used.erase(lease.info_.index);
}

LeaseNetwork::~LeaseNetwork() {
    if (node_) node_->detach(*this);
}

LeaseNetwork::Counts LeaseNetwork::counts() const {
    if (info_.index == 0 || !node_) return {};
    std::lock_guard lock(node_->impl_->mutex);
    rtnl_link* raw = nullptr;
    if (rtnl_link_get_kernel(node_->impl_->host->sock, 0, info_.host_interface.c_str(), &raw) < 0) {
        return {};
    }
    LinkRef link(raw);
    // The host side's receive is what the lease sent.
    return {rtnl_link_get_stat(link.get(), RTNL_LINK_TX_BYTES),
            rtnl_link_get_stat(link.get(), RTNL_LINK_RX_BYTES)};
}

namespace {

/// The commands that make a domain allow rule's set `set` empty, then put in it what the lease
/// resolved already that the rule still allows (its live connections go on), for what is left
/// of their time.
std::string domain_set_script(const std::string& table, const std::string& set,
                              const DomainName& domain, const ResolvedNames& resolved) {
    const auto now = std::chrono::steady_clock::now();
    std::ostringstream s;
    s << "add set " << table << " " << set << " { type ipv4_addr; flags timeout; size "
      << ResolvedNames::max_set_elements << "; }\n"
      << "flush set " << table << " " << set << "\n";
    for (const auto& [name, addresses] : resolved.names) {
        if (!domain_matches(domain, name)) continue;
        for (const auto& [address, until] : addresses) {
            if (until <= now) continue;
            const auto left = std::chrono::duration_cast<std::chrono::seconds>(until - now).count();
            s << "add element " << table << " " << set << " { " << address.to_string()
              << " timeout " << std::max<long long>(left, 1) << "s }\n";
        }
    }
    return s.str();
}

/// The nftables commands that (re)make a lease's chains from its policy. `resolved`: the
/// addresses each domain allow rule's set starts with.
std::string lease_script(const std::string& table, const NodeNetworkOptions& o,
                         ip::address_v4 gateway, const LeaseNetworkInfo& info,
                         const NetworkPolicy& policy, std::uint32_t generation,
                         std::uint16_t resolver_port, const ResolvedNames& resolved) {
    const std::string c = lease_chain(info.index);
    const std::string addr = info.address.to_string();
    const std::string gw = gateway.to_string();
    std::ostringstream s;
    // Made empty, whatever was there (an update replaces the rules in the same transaction).
    for (const char* suffix : {"", "_in", "_dns"}) {
        s << "add chain " << table << " " << c << suffix << "\n"
          << "flush chain " << table << " " << c << suffix << "\n";
    }
    const std::string mark = std::to_string(generation);
    // From the lease, forwarded: the order of lease_network.hpp.
    auto rule = [&](const std::string& text) {
        s << "add rule " << table << " " << c << " " << text << "\n";
    };
    rule("meta nfproto ipv6 drop");
    rule("ip saddr != " + addr + " goto deny_spoof");
    rule("ct state established,related ct mark " + mark + " accept");
    rule("ip daddr @node_deny goto deny_node");
    rule("ip daddr " + o.pool.to_string() + " goto deny_lease");
    rule("ip daddr @node_open ct mark set " + mark + " accept");
    rule("ip daddr @builtin_deny goto deny_private");
    if (policy.mode == network_mode::none) {
        rule("goto deny_rule");
    } else {
        for (const auto& r : policy.deny) {
            if (const auto* n = std::get_if<ip::network_v4>(&r.host)) {
                rule("ip daddr " +
                     (n->prefix_length() == 32 ? n->address().to_string() : n->to_string()) + " " +
                     transport(r) + "goto deny_rule");
            }
        }
        std::size_t k = 0;
        for (const auto& r : policy.allow) {
            if (const auto* n = std::get_if<ip::network_v4>(&r.host)) {
                rule("ip daddr " +
                     (n->prefix_length() == 32 ? n->address().to_string() : n->to_string()) + " " +
                     transport(r) + "ct mark set " + mark + " accept");
            } else if (std::holds_alternative<DomainName>(r.host)) {
                const std::string set = c + "_r" + std::to_string(k);
                s << domain_set_script(table, set, std::get<DomainName>(r.host), resolved);
                std::string text = "ip daddr @";
                text += set;
                text += ' ';
                text += transport(r);
                text += "ct mark set ";
                text += mark;
                text += " accept";
                rule(text);
            }
            ++k;
        }
        if (policy.allow.empty()) {
            rule("ct mark set " + mark + " accept");
        } else {
            rule("goto deny_allow");
        }
    }
    // To the host: the lease's resolver only.
    s << "add rule " << table << " " << c << "_in ip saddr " << addr << " ip daddr " << gw
      << " meta l4proto { tcp, udp } th dport " << resolver_port << " accept\n";
    s << "add rule " << table << " " << c << "_dns ip daddr " << gw << " udp dport 53 dnat ip to "
      << gw << ":" << resolver_port << "\n";
    s << "add rule " << table << " " << c << "_dns ip daddr " << gw << " tcp dport 53 dnat ip to "
      << gw << ":" << resolver_port << "\n";
    // The input chain is jumped to, not gone to: what it does not accept returns to the base
    // chain's deny_host (a chain gone to would end in the base chain's policy, accept).
    const std::string i = "\"" + info.host_interface + "\"";
    s << "add element " << table << " lease_fwd { " << i << " : goto " << c << " }\n"
      << "add element " << table << " lease_in { " << i << " : jump " << c << "_in }\n"
      << "add element " << table << " lease_dns { " << i << " : goto " << c << "_dns }\n";
    return s.str();
}

}  // namespace

std::unique_ptr<LeaseNetwork> NodeNetwork::attach(const NetworkPolicy& policy,
                                                  std::optional<std::uint64_t> egress_bps) {
    if (policy.mode == network_mode::egress && !options_.egress) {
        throw rpc_error(errc::invalid_params,
                        "config.network: egress is not allowed on this node "
                        "(providers.bwrap.network.egress)",
                        {{"field", "config.network"}});
    }
    std::unique_ptr<LeaseNetwork> lease(new LeaseNetwork());
    lease->policy_ = policy;
    lease->egress_bps_ = egress_bps;
    lease->node_ = shared_from_this();
    // Without egress the daemon may lack CAP_NET_ADMIN (its unit's default): bubblewrap makes
    // the namespace, loopback only, inside the lease's user namespace.
    if (!options_.egress) return lease;
    // The namespace: made on a thread of its own, which leaves it behind when it ends.
    lease->netns_ = on_own_thread([] {
        if (::unshare(CLONE_NEWNET) != 0) {
            fail("cannot make a network namespace: " + errno_text(errno));
        }
        unique_fd fd(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
        if (!fd) fail("cannot hold the network namespace: " + errno_text(errno));
        loopback_up();
        return fd;
    });
    if (policy.mode == network_mode::egress) add_veth(*lease);
    return lease;
}

ResolverPolicy NodeNetwork::resolver_policy(const LeaseNetwork& lease,
                                            const NetworkPolicy& policy) {
    const auto& info = lease.info_;
    std::shared_ptr<ResolvedNames> resolved = lease.resolved_;
    ResolverPolicy out;
    out.check_name = [policy](const std::string& name) {
        if (policy.mode == network_mode::none) return false;
        for (const auto& r : policy.deny) {
            const auto* d = std::get_if<DomainName>(&r.host);
            if (d != nullptr && domain_matches(*d, name)) return false;
        }
        if (!has_domain_rule(policy.allow)) return true;
        return std::any_of(policy.allow.begin(), policy.allow.end(), [&](const NetworkRule& r) {
            const auto* d = std::get_if<DomainName>(&r.host);
            return d != nullptr && domain_matches(*d, name);
        });
    };
    std::weak_ptr<NodeNetwork> weak = weak_from_this();
    const std::string prefix = lease_chain(info.index) + "_r";
    out.on_address = [weak, policy, prefix, resolved](
                         const std::string& name, const ip::address& address, std::uint32_t ttl) {
        auto node = weak.lock();
        if (!node || !address.is_v4()) return;
        // Long enough for the connection the lookup is for; a live one is kept by its mark.
        const std::uint32_t timeout = std::max<std::uint32_t>(ttl, 60);
        std::string script;
        for (std::size_t k = 0; k < policy.allow.size(); ++k) {
            const auto* d = std::get_if<DomainName>(&policy.allow[k].host);
            if (d == nullptr || !domain_matches(*d, name)) continue;
            script += "add element " + node->impl_->table + " " + prefix + std::to_string(k) +
                      " { " + address.to_v4().to_string() + " timeout " + std::to_string(timeout) +
                      "s }\n";
        }
        if (script.empty()) return;
        std::lock_guard lock(node->impl_->mutex);
        resolved->add(name, address.to_v4(),
                      std::chrono::steady_clock::now() + std::chrono::seconds(timeout));
        try {
            node->impl_->run_nft(script, "allow an address resolved for " + name);
        } catch (const std::exception& e) {
            spdlog::warn("network: {}", e.what());
        }
    };
    return out;
}

void NodeNetwork::start_resolver(LeaseNetwork& lease) {
    ResolverOptions ro;
    ro.listen = gateway_;
    ro.upstreams = options_.dns;
    if (ro.upstreams.empty()) fail("no upstream resolver (providers.bwrap.network.dns)");
    auto policy = resolver_policy(lease, lease.policy_);
    std::packaged_task<std::unique_ptr<LeaseResolver>()> make([&] {
        return std::make_unique<LeaseResolver>(impl_->io.get_executor(), ro, std::move(policy));
    });
    auto made = make.get_future();
    boost::asio::post(impl_->io, [&] { make(); });
    lease.resolver_ = made.get();
}

void NodeNetwork::apply(LeaseNetwork& lease, const NetworkPolicy& policy) {
    std::lock_guard lock(impl_->mutex);
    std::vector<std::string> sets;
    for (std::size_t k = 0; k < policy.allow.size(); ++k) {
        if (std::holds_alternative<DomainName>(policy.allow[k].host)) {
            sets.push_back(lease_chain(lease.info_.index) + "_r" + std::to_string(k));
        }
    }
    std::string script = lease_script(impl_->table, options_, gateway_, lease.info_, policy,
                                      lease.generation_, lease.resolver_->port(), *lease.resolved_);
    // Sets of the previous policy that this one does not use, after the rules that named them.
    for (const auto& set : lease.sets_) {
        if (std::find(sets.begin(), sets.end(), set) == sets.end()) {
            script += "delete set " + impl_->table + " " + set + "\n";
        }
    }
    impl_->run_nft(script, "apply the policy of " + lease.info_.host_interface);
    lease.sets_ = std::move(sets);
}

void NodeNetwork::add_veth(LeaseNetwork& lease) {
    auto& info = lease.info_;
    {
        std::lock_guard lock(impl_->mutex);
        const std::uint32_t size = ~options_.pool.netmask().to_uint() + 1;
        // Index 0 is the network, 1 the gateway, size - 1 the broadcast address.
        for (std::uint32_t tried = 0; tried < size; ++tried) {
            impl_->cursor = impl_->cursor + 1 >= size - 1 ? 2 : impl_->cursor + 1;
            if (!impl_->used.count(impl_->cursor)) {
                info.index = impl_->cursor;
                break;
            }
        }
        if (info.index == 0) {
            throw rpc_error(errc::provider_error, "the node's lease address pool " +
                                                      options_.pool.to_string() + " is exhausted");
        }
        impl_->used.insert(info.index);
    }
    info.address = ip::address_v4(options_.pool.network().to_uint() + info.index);
    info.host_interface = impl_->prefix + hex(info.index, 1);
    bool made = false;
    ScopeExit undo([&] {
        if (made) return;
        std::lock_guard lock(impl_->mutex);
        delete_link(info.host_interface);
        impl_->used.erase(info.index);
        info = {};
    });
    {
        std::lock_guard lock(impl_->mutex);
        nl_sock* s = impl_->host->sock;
        LinkRef veth(rtnl_link_veth_alloc());
        if (veth.get() == nullptr) fail("netlink: out of memory");
        rtnl_link_set_name(veth.get(), info.host_interface.c_str());
        LinkRef peer(rtnl_link_veth_get_peer(veth.get()));
        rtnl_link_set_name(peer.get(), "eth0");
        rtnl_link_set_ns_fd(peer.get(), lease.netns_.get());
        check_nl(rtnl_link_add(s, veth.get(), NLM_F_CREATE | NLM_F_EXCL),
                 "cannot make the veth pair " + info.host_interface);
        const int host_index = ifindex_of(s, info.host_interface);
        add_peer_address(s, host_index, gateway_, info.address,
                         "cannot address " + info.host_interface);
        link_up(s, info.host_interface);
        // What the host side sends is what the lease receives.
        if (lease.egress_bps_) {
            limit_rate(s, host_index, *lease.egress_bps_,
                       "cannot limit the rate of " + info.host_interface);
        }
    }
    const int netns = lease.netns_.get();
    const auto address = info.address;
    const auto gateway = gateway_;
    const auto bps = lease.egress_bps_;
    on_own_thread([netns, address, gateway, bps] {
        if (::setns(netns, CLONE_NEWNET) != 0) {
            fail("cannot enter the lease's network namespace: " + errno_text(errno));
        }
        NlSock inside;
        const int eth0 = ifindex_of(inside.sock, "eth0");
        add_peer_address(inside.sock, eth0, address, gateway, "cannot address the lease's eth0");
        link_up(inside.sock, "eth0");
        add_default_route(inside.sock, eth0, gateway);
        if (bps) limit_rate(inside.sock, eth0, *bps, "cannot limit the rate of the lease's eth0");
    });
    start_resolver(lease);
    apply(lease, lease.policy_);
    made = true;
}

std::unique_ptr<LeaseNetwork> NodeNetwork::readopt(const LeaseNetworkInfo& info,
                                                   const NetworkPolicy& policy) {
    std::unique_ptr<LeaseNetwork> lease(new LeaseNetwork());
    lease->policy_ = policy;
    // Without egress on this node now, its veth went at start: it has no network but loopback.
    lease->info_ = options_.egress ? info : LeaseNetworkInfo{};
    if (!options_.egress) lease->policy_ = NetworkPolicy{};
    {
        std::lock_guard lock(impl_->mutex);
        impl_->used.insert(info.index);
    }
    lease->node_ = shared_from_this();
    if (lease->info_.index != 0) {
        start_resolver(*lease);
        apply(*lease, policy);
    }
    return lease;
}

void NodeNetwork::update(LeaseNetwork& lease, const NetworkPolicy& policy) {
    if (policy.mode == network_mode::egress && !options_.egress) {
        throw rpc_error(errc::invalid_params,
                        "network: egress is not allowed on this node "
                        "(providers.bwrap.network.egress)",
                        {{"field", "network"}});
    }
    if (lease.info_.index == 0) {
        if (policy.mode == network_mode::none) {
            lease.policy_ = policy;
            return;
        }
        if (!lease.netns_) {
            throw rpc_error(errc::invalid_params,
                            "network: this lease was re-adopted after a daemon restart without "
                            "a network; it cannot gain one (acquire a new lease)",
                            {{"field", "network"}});
        }
        lease.policy_ = policy;
        add_veth(lease);
        return;
    }
    ++lease.generation_;  // every live connection is checked again at its next packet
    apply(lease, policy);
    auto next = resolver_policy(lease, policy);
    auto* resolver = lease.resolver_.get();
    std::promise<void> done;
    boost::asio::post(impl_->io, [&] {
        resolver->set_policy(std::move(next));
        done.set_value();
    });
    done.get_future().wait();
    lease.policy_ = policy;
}

}  // namespace sandboxd::detail
