/// @file lease_resolver.cpp
/// The DNS resolver of one egress lease (lease_resolver.hpp): Asio coroutines on the executor
/// given, ldns for every message read or built. The only bytes written by hand are a header's
/// id (through ldns's LDNS_ID_SET), so that an upstream's answer goes back to the lease
/// unchanged but for it; the header bits read before a message parses are read through
/// ldns's LDNS_*_WIRE as well.
///
/// Every coroutine holds the shared state; stop() closes the two listening sockets and
/// expires every deadline timer a coroutine waits on (an upstream attempt's, a TCP
/// connection's), so each one ends at its next step and none calls the policy again.
#include "provider/lease_resolver.hpp"

#include <sandboxd/core/async.hpp>
#include <sandboxd/core/scope_exit.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

// ldns/common.h defines `bool`, `true` and `false` as macros unless stdbool.h came first.
#include <stdbool.h>  // NOLINT(modernize-deprecated-headers)

#include <ldns/ldns.h>

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <system_error>
#include <tuple>
#include <utility>

namespace sandboxd::detail {
namespace {

namespace net = boost::asio;
namespace ip = boost::asio::ip;
using namespace boost::asio::experimental::awaitable_operators;
using udp = ip::udp;
using tcp = ip::tcp;
using error_code = boost::system::error_code;
using Wire = std::vector<std::uint8_t>;

inline constexpr auto as_tuple_awaitable = net::as_tuple(net::use_awaitable);

/// The largest UDP message read; one byte more is read, to see that a message was cut.
constexpr std::size_t max_udp_message = 4096;
/// The largest message an upstream sends over UDP (its datagram's limit).
constexpr std::size_t max_upstream_message = 65535;
constexpr std::size_t max_tcp_connections = 16;
constexpr std::chrono::seconds tcp_idle{10};
/// Ports the kernel picks for UDP that are tried for TCP as well, before giving up.
constexpr int bind_tries = 8;
/// After an accept failed (no descriptor left, say): the wait before the next, not to spin.
constexpr std::chrono::milliseconds accept_pause{100};

enum class Transport { datagram, stream };

struct LdnsFree {
    void operator()(ldns_pkt* p) const noexcept { ldns_pkt_free(p); }
};
using Packet = std::unique_ptr<ldns_pkt, LdnsFree>;

/// `wire` parsed by ldns; null when it does not parse.
Packet parse(const Wire& wire) {
    ldns_pkt* pkt = nullptr;
    if (ldns_wire2pkt(&pkt, wire.data(), wire.size()) != LDNS_STATUS_OK) {
        if (pkt != nullptr) ldns_pkt_free(pkt);
        return {};
    }
    return Packet(pkt);
}

/// Frees what ldns returns from malloc (the bytes of ldns_pkt2wire, the text of ldns_rdf2str).
struct MallocFree {
    void operator()(void* p) const noexcept {
        std::free(p);  // NOLINT(cppcoreguidelines-no-malloc)
    }
};

/// `pkt` in wire format; nullopt when ldns cannot build it (out of memory).
std::optional<Wire> to_wire(const ldns_pkt* pkt) {
    std::uint8_t* data = nullptr;
    std::size_t size = 0;
    const ldns_status status = ldns_pkt2wire(&data, pkt, &size);
    const std::unique_ptr<std::uint8_t, MallocFree> owned(data);
    if (status != LDNS_STATUS_OK || data == nullptr) return std::nullopt;
    return Wire(data, data + size);
}

/// A domain name as the policy sees it: lower-case, no trailing dot ("" for the root).
std::optional<std::string> normal_name(const ldns_rdf* dname) {
    if (dname == nullptr || ldns_rdf_get_type(dname) != LDNS_RDF_TYPE_DNAME) return std::nullopt;
    const std::unique_ptr<char, MallocFree> text(ldns_rdf2str(dname));
    if (!text) return std::nullopt;
    std::string out(text.get());
    std::transform(out.begin(), out.end(), out.begin(), [](char c) {
        return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    });
    if (!out.empty() && out.back() == '.') out.pop_back();
    return out;
}

/// The only question of `pkt`, when it has exactly one.
const ldns_rr* only_question(const ldns_pkt* pkt) {
    const ldns_rr_list* questions = ldns_pkt_question(pkt);
    if (ldns_rr_list_rr_count(questions) != 1) return nullptr;
    return ldns_rr_list_rr(questions, 0);
}

/// A response of ours with `rcode`, the query's id, opcode and RD flag, and its question when
/// given; nullopt when ldns cannot build it.
std::optional<Wire> respond(std::uint16_t id, unsigned opcode, bool rd, ldns_pkt_rcode rcode,
                            const ldns_rr* question) {
    Packet pkt(ldns_pkt_new());
    if (!pkt) return std::nullopt;
    ldns_pkt_set_id(pkt.get(), id);
    ldns_pkt_set_qr(pkt.get(), true);
    // An opcode ldns has no name for is answered as QUERY (only FORMERR answers one).
    ldns_pkt_set_opcode(pkt.get(), opcode <= static_cast<unsigned>(LDNS_PACKET_UPDATE)
                                       ? static_cast<ldns_pkt_opcode>(opcode)
                                       : LDNS_PACKET_QUERY);
    ldns_pkt_set_rd(pkt.get(), rd);
    ldns_pkt_set_ra(pkt.get(), true);
    ldns_pkt_set_rcode(pkt.get(), static_cast<std::uint8_t>(rcode));
    if (question != nullptr) {
        ldns_rr* copy = ldns_rr_clone(question);
        if (copy == nullptr) return std::nullopt;
        if (!ldns_pkt_push_rr(pkt.get(), LDNS_SECTION_QUESTION, copy)) {
            ldns_rr_free(copy);
            return std::nullopt;
        }
    }
    return to_wire(pkt.get());
}

/// `wire` parsed, when it is the answer to the query sent with id `id` and `question`.
Packet matching(const Wire& wire, std::uint16_t id, const ldns_rr* question) {
    if (wire.size() < LDNS_HEADER_SIZE || LDNS_ID_WIRE(wire.data()) != id ||
        LDNS_QR_WIRE(wire.data()) == 0) {
        return {};
    }
    Packet pkt = parse(wire);
    if (!pkt) return {};
    const ldns_rr* echoed = only_question(pkt.get());
    if (echoed == nullptr || ldns_rr_get_type(echoed) != ldns_rr_get_type(question) ||
        ldns_rr_get_class(echoed) != ldns_rr_get_class(question) ||
        ldns_dname_compare(ldns_rr_owner(echoed), ldns_rr_owner(question)) != 0) {
        return {};
    }
    return pkt;
}

/// An id for a query to an upstream, from the kernel's random source.
std::uint16_t random_id() {
    std::uint16_t id = 0;
    if (::getrandom(&id, sizeof id, GRND_NONBLOCK) == static_cast<ssize_t>(sizeof id)) return id;
    // Early in boot the pool may not be ready yet; random_device does not wait for it.
    std::random_device device;
    return static_cast<std::uint16_t>(device());
}

/// `op`, or a timed_out error if `deadline` expires first (then `op` is cancelled).
template <typename... T>
awaitable<std::tuple<error_code, T...>> until(net::steady_timer& deadline,
                                              awaitable<std::tuple<error_code, T...>> op) {
    auto done = co_await (std::move(op) || deadline.async_wait(as_tuple_awaitable));
    if (done.index() == 0) co_return std::get<0>(std::move(done));
    std::tuple<error_code, T...> out{};
    std::get<0>(out) = net::error::timed_out;
    co_return out;
}

/// An upstream's answer: its bytes as they came and as ldns read them.
struct Answer {
    Wire wire;
    Packet pkt;
};

/// The resolver's state, shared by its coroutines (LeaseResolver::State is this).
struct Core {
    Core(net::any_io_executor ex, ResolverOptions o, ResolverPolicy p)
        : executor(std::move(ex)),
          options(std::move(o)),
          policy(std::move(p)),
          udp_socket(executor),
          acceptor(executor) {}

    net::any_io_executor executor;
    ResolverOptions options;
    ResolverPolicy policy;
    udp::socket udp_socket;
    tcp::acceptor acceptor;
    std::uint16_t port = 0;
    ResolverStats stats;
    std::size_t in_flight = 0;
    std::size_t connections = 0;
    bool stopped = false;
    /// The timers the coroutines wait on, with their work: stop() expires them all.
    std::set<net::steady_timer*> deadlines;

    /// Binds UDP and TCP on one port (lease_resolver.hpp's constructor).
    void bind();
};

/// A deadline timer known to stop() while it lives.
class Deadline {
public:
    Deadline(Core& core, std::chrono::steady_clock::duration after)
        : core_(core), timer_(core.executor, after) {
        if (core_.stopped) timer_.expires_at(net::steady_timer::time_point::min());
        core_.deadlines.insert(&timer_);
    }
    ~Deadline() { core_.deadlines.erase(&timer_); }
    Deadline(const Deadline&) = delete;
    Deadline& operator=(const Deadline&) = delete;

    net::steady_timer& timer() noexcept { return timer_; }
    /// Moves the deadline to `after` from now, unless the resolver stopped.
    void reset(std::chrono::steady_clock::duration after) {
        if (!core_.stopped) timer_.expires_after(after);
    }

private:
    Core& core_;
    net::steady_timer timer_;
};

[[noreturn]] void bind_failed(const error_code& ec, const ip::address& address, std::uint16_t port,
                              const char* transport) {
    throw std::system_error(ec, "the lease resolver cannot serve on " + address.to_string() + ":" +
                                    std::to_string(port) + "/" + transport);
}

void Core::bind() {
    const ip::address& address = options.listen;
    for (int tried = 1;; ++tried) {
        error_code ec;
        const udp::endpoint at(address, options.port);
        udp_socket.open(at.protocol(), ec);
        if (!ec) udp_socket.bind(at, ec);
        if (ec) bind_failed(ec, address, options.port, "udp");
        port = udp_socket.local_endpoint(ec).port();
        if (ec) bind_failed(ec, address, options.port, "udp");
        const tcp::endpoint tcp_at(address, port);
        acceptor.open(tcp_at.protocol(), ec);
        if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
        if (!ec) acceptor.bind(tcp_at, ec);
        if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
        if (!ec) return;
        error_code ignored;
        acceptor.close(ignored);
        udp_socket.close(ignored);
        if (options.port != 0 || ec != net::error::address_in_use || tried >= bind_tries) {
            bind_failed(ec, address, port, "tcp");
        }
    }
}

/// Gives `on_address` each A and AAAA record of `answer` whose owner is `name` or a name
/// reached from it through the answer's CNAME records. False when a call threw.
bool report_addresses(Core& core, const std::string& name, const ldns_pkt* answer) {
    const auto on_address = core.policy.on_address;  // a copy: the policy may be replaced
    if (!on_address) return true;
    const ldns_rr_list* records = ldns_pkt_answer(answer);
    const std::size_t count = ldns_rr_list_rr_count(records);
    std::multimap<std::string, std::string> aliases;  // owner -> CNAME target
    for (std::size_t i = 0; i < count; ++i) {
        const ldns_rr* rr = ldns_rr_list_rr(records, i);
        if (ldns_rr_get_type(rr) != LDNS_RR_TYPE_CNAME ||
            ldns_rr_get_class(rr) != LDNS_RR_CLASS_IN || ldns_rr_rd_count(rr) != 1) {
            continue;
        }
        auto owner = normal_name(ldns_rr_owner(rr));
        auto target = normal_name(ldns_rr_rdf(rr, 0));
        if (owner && target) aliases.emplace(std::move(*owner), std::move(*target));
    }
    std::set<std::string> names{name};
    std::deque<std::string> next{name};
    while (!next.empty()) {
        const auto [first, last] = aliases.equal_range(next.front());
        next.pop_front();
        for (auto it = first; it != last; ++it) {
            if (names.insert(it->second).second) next.push_back(it->second);
        }
    }
    for (std::size_t i = 0; i < count; ++i) {
        const ldns_rr* rr = ldns_rr_list_rr(records, i);
        const ldns_rr_type type = ldns_rr_get_type(rr);
        if ((type != LDNS_RR_TYPE_A && type != LDNS_RR_TYPE_AAAA) ||
            ldns_rr_get_class(rr) != LDNS_RR_CLASS_IN || ldns_rr_rd_count(rr) != 1) {
            continue;
        }
        const auto owner = normal_name(ldns_rr_owner(rr));
        if (!owner || names.count(*owner) == 0) continue;
        const ldns_rdf* rdf = ldns_rr_rdf(rr, 0);
        const std::size_t size = ldns_rdf_size(rdf);
        ip::address address;
        if (ldns_rdf_get_type(rdf) == LDNS_RDF_TYPE_A && size == 4) {
            ip::address_v4::bytes_type bytes;
            std::memcpy(bytes.data(), ldns_rdf_data(rdf), bytes.size());
            address = ip::address_v4(bytes);
        } else if (ldns_rdf_get_type(rdf) == LDNS_RDF_TYPE_AAAA && size == 16) {
            ip::address_v6::bytes_type bytes;
            std::memcpy(bytes.data(), ldns_rdf_data(rdf), bytes.size());
            address = ip::address_v6(bytes);
        } else {
            continue;
        }
        if (core.stopped) return false;  // stopped by a previous call
        try {
            on_address(name, address, ldns_rr_ttl(rr));
        } catch (...) {
            return false;
        }
    }
    return true;
}

/// One attempt at `upstream` over UDP: a fresh socket connected to it (so only its datagrams
/// are read), the query with an id of ours, the first reply that matches it.
awaitable<std::optional<Answer>> ask_udp(std::shared_ptr<Core> core, udp::endpoint upstream,
                                         Wire query, const ldns_rr* question) {
    Deadline deadline(*core, core->options.upstream_timeout);
    udp::socket socket(core->executor);
    error_code ec;
    socket.open(upstream.protocol(), ec);
    if (!ec) socket.connect(upstream, ec);
    if (ec) co_return std::nullopt;
    const std::uint16_t id = random_id();
    LDNS_ID_SET(query.data(), id);
    auto [sent, sent_size] =
        co_await until(deadline.timer(), socket.async_send(net::buffer(query), as_tuple_awaitable));
    if (sent || core->stopped) co_return std::nullopt;
    Wire buffer(max_upstream_message);
    for (;;) {
        auto [got, size] = co_await until(
            deadline.timer(), socket.async_receive(net::buffer(buffer), as_tuple_awaitable));
        // An error is the deadline, stop(), or the upstream's port closed (ICMP).
        if (got || core->stopped) co_return std::nullopt;
        Wire reply(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(size));
        if (Packet pkt = matching(reply, id, question)) {
            co_return Answer{std::move(reply), std::move(pkt)};
        }
    }
}

/// One attempt at `upstream` over TCP (RFC 1035 4.2.2 framing), one query on the connection.
awaitable<std::optional<Answer>> ask_tcp(std::shared_ptr<Core> core, tcp::endpoint upstream,
                                         Wire query, const ldns_rr* question) {
    Deadline deadline(*core, core->options.upstream_timeout);
    tcp::socket socket(core->executor);
    auto [connected] =
        co_await until(deadline.timer(), socket.async_connect(upstream, as_tuple_awaitable));
    if (connected || core->stopped) co_return std::nullopt;
    const std::uint16_t id = random_id();
    Wire framed(2 + query.size());
    ldns_write_uint16(framed.data(), static_cast<std::uint16_t>(query.size()));
    std::copy(query.begin(), query.end(), framed.begin() + 2);
    LDNS_ID_SET(framed.data() + 2, id);
    auto [written, written_size] = co_await until(
        deadline.timer(), net::async_write(socket, net::buffer(framed), as_tuple_awaitable));
    if (written || core->stopped) co_return std::nullopt;
    std::array<std::uint8_t, 2> length{};
    auto [head, head_size] = co_await until(
        deadline.timer(), net::async_read(socket, net::buffer(length), as_tuple_awaitable));
    if (head || core->stopped) co_return std::nullopt;
    Wire reply(ldns_read_uint16(length.data()));
    auto [body, body_size] = co_await until(
        deadline.timer(), net::async_read(socket, net::buffer(reply), as_tuple_awaitable));
    if (body || core->stopped) co_return std::nullopt;
    Packet pkt = matching(reply, id, question);
    if (!pkt) co_return std::nullopt;
    co_return Answer{std::move(reply), std::move(pkt)};
}

/// What the lease gets back for `query`, a message it sent: a response, or nothing (dropped,
/// or the resolver stopped meanwhile).
awaitable<std::optional<Wire>> answer(std::shared_ptr<Core> core, Wire query, Transport transport) {
    ++core->stats.queries;
    // A message too short for a header is dropped, and so is a response: answering it could
    // start two resolvers (or one, its own address given as the sender) answering each other's
    // FORMERR for ever.
    if (query.size() < LDNS_HEADER_SIZE || LDNS_QR_WIRE(query.data()) != 0) {
        ++core->stats.malformed;
        co_return std::nullopt;
    }
    const std::uint16_t id = LDNS_ID_WIRE(query.data());
    const unsigned opcode = LDNS_OPCODE_WIRE(query.data());
    const bool rd = LDNS_RD_WIRE(query.data()) != 0;
    const bool cut = transport == Transport::datagram && query.size() > max_udp_message;
    const Packet pkt = cut ? Packet{} : parse(query);
    const ldns_rr* question = pkt ? only_question(pkt.get()) : nullptr;
    if (question == nullptr || opcode != static_cast<unsigned>(LDNS_PACKET_QUERY) ||
        ldns_rr_get_class(question) != LDNS_RR_CLASS_IN) {
        ++core->stats.malformed;
        co_return respond(id, opcode, rd, LDNS_RCODE_FORMERR, nullptr);
    }

    const auto name = normal_name(ldns_rr_owner(question));
    bool allowed = false;
    if (const auto check = core->policy.check_name; name && check) {  // a copy, as above
        try {
            allowed = check(*name);
        } catch (...) {
            allowed = false;  // refused: a policy that cannot say is no permission
        }
    }
    if (core->stopped) co_return std::nullopt;
    if (!allowed) {
        ++core->stats.refused;
        co_return respond(id, opcode, rd, LDNS_RCODE_REFUSED, question);
    }
    if (core->in_flight >= core->options.max_in_flight) {
        ++core->stats.failed;
        co_return respond(id, opcode, rd, LDNS_RCODE_SERVFAIL, question);
    }

    ++core->in_flight;
    const ScopeExit landed([&core] { --core->in_flight; });
    std::optional<Answer> got;
    for (udp::endpoint upstream : core->options.upstreams) {
        if (upstream.port() == 0) upstream.port(53);
        if (transport == Transport::datagram) {
            got = co_await ask_udp(core, upstream, query, question);
        } else {
            got = co_await ask_tcp(core, tcp::endpoint(upstream.address(), upstream.port()), query,
                                   question);
        }
        if (got || core->stopped) break;
    }
    if (core->stopped) co_return std::nullopt;
    if (!got || !report_addresses(*core, *name, got->pkt.get())) {
        if (core->stopped) co_return std::nullopt;
        ++core->stats.failed;
        co_return respond(id, opcode, rd, LDNS_RCODE_SERVFAIL, question);
    }
    LDNS_ID_SET(got->wire.data(), id);
    co_return std::move(got->wire);
}

awaitable<void> answer_udp(std::shared_ptr<Core> core, Wire query, udp::endpoint from) {
    auto reply = co_await answer(core, std::move(query), Transport::datagram);
    if (!reply || core->stopped) co_return;
    co_await core->udp_socket.async_send_to(net::buffer(*reply), from, as_tuple_awaitable);
}

awaitable<void> serve_udp(std::shared_ptr<Core> core) {
    Wire buffer(max_udp_message + 1);
    udp::endpoint from;
    while (!core->stopped) {
        auto [ec, size] = co_await core->udp_socket.async_receive_from(net::buffer(buffer), from,
                                                                       as_tuple_awaitable);
        if (core->stopped || ec == net::error::operation_aborted ||
            ec == net::error::bad_descriptor) {
            co_return;
        }
        if (ec) continue;
        Wire query(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(size));
        net::co_spawn(core->executor, answer_udp(core, std::move(query), from), net::detached);
    }
}

/// One TCP connection of the lease: a query at a time, closed after tcp_idle without one.
awaitable<void> serve_tcp_connection(std::shared_ptr<Core> core, tcp::socket socket) {
    const ScopeExit gone([&core] { --core->connections; });
    Deadline idle(*core, tcp_idle);
    while (!core->stopped) {
        idle.reset(tcp_idle);
        std::array<std::uint8_t, 2> length{};
        auto [head, head_size] = co_await until(
            idle.timer(), net::async_read(socket, net::buffer(length), as_tuple_awaitable));
        if (head || core->stopped) break;
        Wire query(ldns_read_uint16(length.data()));
        auto [body, body_size] = co_await until(
            idle.timer(), net::async_read(socket, net::buffer(query), as_tuple_awaitable));
        if (body || core->stopped) break;
        auto reply = co_await answer(core, std::move(query), Transport::stream);
        if (core->stopped) break;
        if (!reply) continue;
        Wire framed(2 + reply->size());
        ldns_write_uint16(framed.data(), static_cast<std::uint16_t>(reply->size()));
        std::copy(reply->begin(), reply->end(), framed.begin() + 2);
        idle.reset(tcp_idle);
        auto [written, written_size] = co_await until(
            idle.timer(), net::async_write(socket, net::buffer(framed), as_tuple_awaitable));
        if (written) break;
    }
}

awaitable<void> serve_tcp(std::shared_ptr<Core> core) {
    while (!core->stopped) {
        auto [ec, socket] = co_await core->acceptor.async_accept(as_tuple_awaitable);
        if (core->stopped || ec == net::error::operation_aborted ||
            ec == net::error::bad_descriptor) {
            co_return;
        }
        if (ec) {
            Deadline pause(*core, accept_pause);
            co_await pause.timer().async_wait(as_tuple_awaitable);
            continue;
        }
        if (core->connections >= max_tcp_connections) continue;  // `socket` closes
        ++core->connections;
        net::co_spawn(core->executor, serve_tcp_connection(core, std::move(socket)), net::detached);
    }
}

}  // namespace

struct LeaseResolver::State : Core {
    using Core::Core;
};

LeaseResolver::LeaseResolver(boost::asio::any_io_executor executor, ResolverOptions options,
                             ResolverPolicy policy) {
    if (options.upstreams.empty()) {
        throw std::invalid_argument("the lease resolver needs an upstream server");
    }
    auto state = std::make_shared<State>(executor, std::move(options), std::move(policy));
    state->bind();
    state_ = std::move(state);
    std::shared_ptr<Core> core = state_;
    net::co_spawn(executor, serve_udp(core), net::detached);
    net::co_spawn(executor, serve_tcp(core), net::detached);
}

LeaseResolver::~LeaseResolver() {
    try {
        stop();
    } catch (...) {  // a timer that cannot be cancelled: nothing a destructor can do about it
    }
}

std::uint16_t LeaseResolver::port() const noexcept { return state_->port; }

void LeaseResolver::set_policy(ResolverPolicy policy) {
    if (state_->stopped) return;
    state_->policy = std::move(policy);
}

ResolverStats LeaseResolver::stats() const noexcept { return state_->stats; }

void LeaseResolver::stop() {
    Core& core = *state_;
    if (core.stopped) return;
    core.stopped = true;
    core.policy = {};
    error_code ignored;
    core.udp_socket.close(ignored);
    core.acceptor.close(ignored);
    for (auto* timer : core.deadlines) timer->expires_at(net::steady_timer::time_point::min());
}

}  // namespace sandboxd::detail
