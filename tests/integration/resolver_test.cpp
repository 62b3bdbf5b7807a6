// The DNS resolver of an egress lease (src/provider/lease_resolver.hpp, issue 48): a real
// resolver on 127.0.0.1, port 0, in front of fake upstream servers of the test's own (built with
// ldns: A, AAAA, CNAME chains, no answer, NXDOMAIN, silence, held answers, forged replies), and
// clients of the lease's over UDP and TCP. Nothing sleeps: the io_context runs until what a test
// waits for happened, under a deadline. Only 127.0.0.1 is used.
#include "provider/lease_resolver.hpp"

#include <catch2/catch.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

// ldns/common.h defines `bool`, `true` and `false` as macros unless stdbool.h came first.
#include <stdbool.h>  // NOLINT(modernize-deprecated-headers)

#include <ldns/ldns.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

using namespace sandboxd::detail;
using namespace std::chrono_literals;

namespace {

namespace net = boost::asio;
namespace ip = boost::asio::ip;
using udp = ip::udp;
using tcp = ip::tcp;
using error_code = boost::system::error_code;
using Wire = std::vector<std::uint8_t>;

constexpr auto as_tuple_awaitable = net::as_tuple(net::use_awaitable);

const ip::address loopback = ip::make_address("127.0.0.1");

struct PacketFree {
    void operator()(ldns_pkt* p) const noexcept { ldns_pkt_free(p); }
};
using Packet = std::unique_ptr<ldns_pkt, PacketFree>;

Packet parse(const Wire& wire) {
    ldns_pkt* pkt = nullptr;
    if (ldns_wire2pkt(&pkt, wire.data(), wire.size()) != LDNS_STATUS_OK) return {};
    return Packet(pkt);
}

/// Frees what ldns returns from malloc (the bytes of ldns_pkt2wire, the text of ldns_rdf2str).
struct MallocFree {
    void operator()(void* p) const noexcept {
        std::free(p);  // NOLINT(cppcoreguidelines-no-malloc)
    }
};

/// `pkt` in wire format (empty if ldns cannot build it).
Wire to_wire(const ldns_pkt* pkt) {
    std::uint8_t* data = nullptr;
    std::size_t size = 0;
    const ldns_status status = ldns_pkt2wire(&data, pkt, &size);
    const std::unique_ptr<std::uint8_t, MallocFree> owned(data);
    if (status != LDNS_STATUS_OK || data == nullptr) return {};
    return Wire(data, data + size);
}

/// Writes `message` with its length in front (RFC 1035 4.2.2), as it goes over TCP.
void write_framed(tcp::socket& socket, const Wire& message) {
    std::array<std::uint8_t, 2> length{};
    ldns_write_uint16(length.data(), static_cast<std::uint16_t>(message.size()));
    const std::array<net::const_buffer, 2> buffers{net::buffer(length), net::buffer(message)};
    error_code ignored;  // the other side may have closed the connection
    net::write(socket, buffers, ignored);
}

/// A domain name lower-cased, without its trailing dot.
std::string name_text(const ldns_rdf* dname) {
    const std::unique_ptr<char, MallocFree> text(ldns_rdf2str(dname));
    if (!text) return "?";
    std::string out(text.get());
    std::transform(out.begin(), out.end(), out.begin(), [](char c) {
        return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    });
    if (!out.empty() && out.back() == '.') out.pop_back();
    return out;
}

/// The name of the first question of `pkt`, "" if it has none.
std::string question_name(const ldns_pkt* pkt) {
    const ldns_rr_list* questions = ldns_pkt_question(pkt);
    if (ldns_rr_list_rr_count(questions) == 0) return "";
    return name_text(ldns_rr_owner(ldns_rr_list_rr(questions, 0)));
}

/// A query with RD set, as a lease's stub resolver sends it.
Packet make_query(const std::string& name, ldns_rr_type type, std::uint16_t id,
                  ldns_rr_class klass = LDNS_RR_CLASS_IN) {
    // ldns_pkt_query_new takes the name.
    Packet q(ldns_pkt_query_new(ldns_dname_new_frm_str(name.c_str()), type, klass, LDNS_RD));
    ldns_pkt_set_id(q.get(), id);
    return q;
}

Wire query(const std::string& name, ldns_rr_type type, std::uint16_t id) {
    return to_wire(make_query(name, type, id).get());
}

/// The records the fake upstream answers for a name, whatever the type asked.
std::vector<std::string> records_for(const std::string& name) {
    if (name == "a.example.com") {
        return {"a.example.com. 300 IN A 192.0.2.1", "a.example.com. 60 IN A 192.0.2.2"};
    }
    if (name == "v6.example.com") return {"v6.example.com. 120 IN AAAA 2001:db8::1"};
    if (name == "alias.example.com") {
        // A chain of two CNAMEs, in mixed case; records of names outside it (another A, and a
        // CNAME that points to it from outside) are not the question's.
        return {"stray.example.com. 50 IN CNAME other.example.com.",
                "other.example.com. 40 IN A 203.0.113.9",
                "alias.example.com. 10 IN CNAME Mid.Example.NET.",
                "REAL.Example.org. 30 IN A 198.51.100.7",
                "mid.example.net. 20 IN CNAME real.example.org.",
                "real.example.org. 31 IN AAAA 2001:db8::7"};
    }
    return {};  // empty.example.com, nx.example.com and any other: no record
}

/// How a fake answer differs from the true one.
enum class Forgery { none, wrong_id, wrong_question, wrong_address };

/// The fake upstream's answer to `query`, as a real server would build it; empty when `query`
/// is not one it can answer.
Wire fake_answer(const Wire& query, Forgery forgery = Forgery::none) {
    Packet q = parse(query);
    if (!q || ldns_rr_list_rr_count(ldns_pkt_question(q.get())) != 1) return {};
    const ldns_rr* question = ldns_rr_list_rr(ldns_pkt_question(q.get()), 0);
    const std::string name = name_text(ldns_rr_owner(question));
    Packet a(ldns_pkt_new());
    ldns_pkt_set_id(a.get(), static_cast<std::uint16_t>(ldns_pkt_id(q.get()) +
                                                        (forgery == Forgery::wrong_id ? 1 : 0)));
    ldns_pkt_set_qr(a.get(), true);
    ldns_pkt_set_rd(a.get(), ldns_pkt_rd(q.get()));
    ldns_pkt_set_ra(a.get(), true);
    ldns_rr* echoed = nullptr;
    if (forgery == Forgery::wrong_question) {
        if (ldns_rr_new_question_frm_str(&echoed, "forged.example.com. IN A", nullptr, nullptr) !=
            LDNS_STATUS_OK) {
            return {};
        }
    } else {
        echoed = ldns_rr_clone(question);
    }
    ldns_pkt_push_rr(a.get(), LDNS_SECTION_QUESTION, echoed);
    std::vector<std::string> records = records_for(name);
    if (forgery != Forgery::none) records = {name + ". 300 IN A 192.0.2.66"};
    for (const auto& text : records) {
        ldns_rr* rr = nullptr;
        if (ldns_rr_new_frm_str(&rr, text.c_str(), 0, nullptr, nullptr) != LDNS_STATUS_OK) {
            return {};
        }
        ldns_pkt_push_rr(a.get(), LDNS_SECTION_ANSWER, rr);
    }
    if (name == "nx.example.com") ldns_pkt_set_rcode(a.get(), LDNS_RCODE_NXDOMAIN);
    return to_wire(a.get());
}

/// Runs `io` until `done()` holds, `limit` at most: whether it holds.
template <typename Done>
bool run_until(net::io_context& io, Done done, std::chrono::steady_clock::duration limit = 5s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done()) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        if (io.stopped()) io.restart();
        io.run_one_for(10ms);
    }
    return true;
}

/// An upstream DNS server on 127.0.0.1 (UDP and TCP on one port) that records what it is asked.
class FakeUpstream {
public:
    enum class Mode {
        answer,  ///< answers at once
        silent,  ///< never answers
        hold,    ///< answers when release() is called
        forge,   ///< sends forged replies (another port, another id, another question) first
    };
    struct Seen {
        std::string name;
        bool tcp = false;
    };

    explicit FakeUpstream(net::io_context& io, Mode initial = Mode::answer)
        : mode(initial), io_(io), udp_(io), acceptor_(io), forger_(io, udp::endpoint(loopback, 0)) {
        for (int tried = 0;; ++tried) {
            REQUIRE(tried < 20);
            udp_.open(udp::v4());
            udp_.bind(udp::endpoint(loopback, 0));
            port_ = udp_.local_endpoint().port();
            error_code ec;
            acceptor_.open(tcp::v4());
            acceptor_.bind(tcp::endpoint(loopback, port_), ec);
            if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
            if (!ec) break;
            acceptor_.close();
            udp_.close();
        }
        net::co_spawn(io_, serve_udp(), net::detached);
        net::co_spawn(io_, serve_tcp(), net::detached);
    }
    ~FakeUpstream() { close(); }
    FakeUpstream(const FakeUpstream&) = delete;
    FakeUpstream& operator=(const FakeUpstream&) = delete;

    [[nodiscard]] udp::endpoint endpoint() const { return {loopback, port_}; }
    [[nodiscard]] std::size_t held() const { return held_.size(); }
    /// Answers the queries held so far.
    void release() {
        auto held = std::move(held_);
        held_.clear();
        for (auto& send_answer : held) send_answer();
    }
    void close() {
        error_code ignored;
        udp_.close(ignored);
        acceptor_.close(ignored);
        forger_.close(ignored);
        for (auto& c : connections_) c->close(ignored);
        held_.clear();
    }

    Mode mode;
    std::vector<Seen> seen;
    Wire last_answer;  ///< the last true answer sent, as sent

private:
    using Send = std::function<void(const Wire&)>;

    void on_query(const Wire& query, bool over_tcp, const Send& send,
                  const std::optional<udp::endpoint>& from) {
        Packet q = parse(query);
        seen.emplace_back(Seen{q ? question_name(q.get()) : "?", over_tcp});
        switch (mode) {
            case Mode::silent: return;
            case Mode::hold:
                held_.emplace_back([this, query, send] { answer(query, send); });
                return;
            case Mode::forge:
                if (from) {
                    error_code ignored;
                    forger_.send_to(net::buffer(fake_answer(query, Forgery::wrong_address)), *from,
                                    0, ignored);
                }
                send(fake_answer(query, Forgery::wrong_id));
                send(fake_answer(query, Forgery::wrong_question));
                answer(query, send);
                return;
            case Mode::answer: answer(query, send); return;
        }
    }

    void answer(const Wire& query, const Send& send) {
        Wire wire = fake_answer(query);
        if (wire.empty()) return;
        last_answer = wire;
        send(wire);
    }

    net::awaitable<void> serve_udp() {
        Wire buffer(65536);
        udp::endpoint from;
        for (;;) {
            auto [ec, size] =
                co_await udp_.async_receive_from(net::buffer(buffer), from, as_tuple_awaitable);
            if (ec) co_return;  // closed
            const Wire message(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(size));
            on_query(
                message, false,
                [this, from](const Wire& wire) {
                    error_code ignored;
                    udp_.send_to(net::buffer(wire), from, 0, ignored);
                },
                from);
        }
    }

    net::awaitable<void> serve_tcp() {
        for (;;) {
            auto [ec, socket] = co_await acceptor_.async_accept(as_tuple_awaitable);
            if (ec) co_return;  // closed
            auto connection = std::make_shared<tcp::socket>(std::move(socket));
            connections_.push_back(connection);
            net::co_spawn(io_, serve_connection(connection), net::detached);
        }
    }

    net::awaitable<void> serve_connection(std::shared_ptr<tcp::socket> socket) {
        for (;;) {
            std::array<std::uint8_t, 2> length{};
            auto [ec, n] =
                co_await net::async_read(*socket, net::buffer(length), as_tuple_awaitable);
            if (ec) co_return;
            Wire message(ldns_read_uint16(length.data()));
            auto [ec2, n2] =
                co_await net::async_read(*socket, net::buffer(message), as_tuple_awaitable);
            if (ec2) co_return;
            on_query(
                message, true, [socket](const Wire& wire) { write_framed(*socket, wire); },
                std::nullopt);
        }
    }

    net::io_context& io_;
    udp::socket udp_;
    tcp::acceptor acceptor_;
    udp::socket forger_;
    std::uint16_t port_ = 0;
    std::vector<std::shared_ptr<tcp::socket>> connections_;
    std::vector<std::function<void()>> held_;
};

/// A UDP socket of the lease's: sends messages to the resolver, keeps what comes back.
class UdpClient {
public:
    UdpClient(net::io_context& io, std::uint16_t port)
        : box_(std::make_shared<Box>(io)), to_(loopback, port) {
        receive(box_);
    }
    ~UdpClient() { close(); }
    UdpClient(const UdpClient&) = delete;
    UdpClient& operator=(const UdpClient&) = delete;

    void send(const Wire& message) { box_->socket.send_to(net::buffer(message), to_); }
    [[nodiscard]] const std::vector<Wire>& replies() const { return box_->replies; }
    void close() {
        error_code ignored;
        box_->socket.close(ignored);
    }

private:
    struct Box {
        explicit Box(net::io_context& io) : socket(io, udp::endpoint(loopback, 0)) {}
        udp::socket socket;
        Wire buffer = Wire(65536);
        udp::endpoint from;
        std::vector<Wire> replies;
    };

    static void receive(std::shared_ptr<Box> box) {
        Box& b = *box;
        b.socket.async_receive_from(
            net::buffer(b.buffer), b.from, [box = std::move(box)](error_code ec, std::size_t n) {
                if (ec) return;
                box->replies.emplace_back(box->buffer.begin(),
                                          box->buffer.begin() + static_cast<std::ptrdiff_t>(n));
                receive(box);
            });
    }

    std::shared_ptr<Box> box_;
    udp::endpoint to_;
};

/// A TCP connection of the lease's to the resolver: sends framed messages, keeps the replies.
class TcpClient {
public:
    TcpClient(net::io_context& io, std::uint16_t port) : box_(std::make_shared<Box>(io)) {
        box_->socket.connect(tcp::endpoint(loopback, port));
        receive(box_);
    }
    ~TcpClient() { close(); }
    TcpClient(const TcpClient&) = delete;
    TcpClient& operator=(const TcpClient&) = delete;

    void send(const Wire& message) { write_framed(box_->socket, message); }
    [[nodiscard]] const std::vector<Wire>& replies() const { return box_->replies; }
    /// Whether the resolver closed the connection.
    [[nodiscard]] bool closed() const { return box_->closed; }
    void close() {
        error_code ignored;
        box_->socket.close(ignored);
    }

private:
    struct Box {
        explicit Box(net::io_context& io) : socket(io) {}
        tcp::socket socket;
        std::array<std::uint8_t, 2> length{};
        Wire message;
        std::vector<Wire> replies;
        bool closed = false;
    };

    static void receive(std::shared_ptr<Box> box) {
        Box& b = *box;
        net::async_read(b.socket, net::buffer(b.length),
                        [box = std::move(box)](error_code ec, std::size_t) {
                            if (ec) {
                                box->closed = true;
                                return;
                            }
                            box->message.assign(ldns_read_uint16(box->length.data()), 0);
                            receive_body(box);
                        });
    }

    static void receive_body(std::shared_ptr<Box> box) {
        Box& b = *box;
        net::async_read(b.socket, net::buffer(b.message),
                        [box = std::move(box)](error_code ec, std::size_t) {
                            if (ec) {
                                box->closed = true;
                                return;
                            }
                            box->replies.push_back(box->message);
                            receive(box);
                        });
    }

    std::shared_ptr<Box> box_;
};

/// An address given to on_address, as text.
struct Resolved {
    std::string name;
    std::string address;
    std::uint32_t ttl = 0;
    bool operator==(const Resolved&) const = default;
};

std::ostream& operator<<(std::ostream& out, const Resolved& r) {
    return out << r.name << " " << r.address << " ttl " << r.ttl;
}

/// The io_context, a fake upstream, and a resolver in front of it whose policy refuses the
/// names in `refused` and records the names checked and the addresses reported.
struct Rig {
    explicit Rig(FakeUpstream::Mode mode = FakeUpstream::Mode::answer) : upstream(io, mode) {}

    ResolverOptions options() const {
        ResolverOptions o;
        o.listen = loopback;
        o.upstreams = {upstream.endpoint()};
        // Short where a test waits for it to pass, long enough elsewhere for a busy machine.
        o.upstream_timeout = upstream.mode == FakeUpstream::Mode::silent ? 200ms : 2000ms;
        return o;
    }

    ResolverPolicy policy(std::vector<Resolved>& into) {
        ResolverPolicy p;
        p.check_name = [this](const std::string& name) {
            checked.push_back(name);
            return refused.count(name) == 0;
        };
        p.on_address = [&into](const std::string& name, const ip::address& address,
                               std::uint32_t ttl) {
            into.push_back({name, address.to_string(), ttl});
        };
        return p;
    }

    void start(const ResolverOptions& o) {
        resolver = std::make_unique<LeaseResolver>(io.get_executor(), o, policy(resolved));
    }
    void start() { start(options()); }

    /// The resolver's reply to `message` sent from a UDP socket of its own (5 s at most).
    std::optional<Wire> ask(const Wire& message) {
        UdpClient client(io, resolver->port());
        client.send(message);
        if (!run_until(io, [&] { return !client.replies().empty(); })) return std::nullopt;
        return client.replies().front();
    }

    /// Runs until the resolver's stats satisfy `done`.
    template <typename Done>
    bool stats_until(Done done) {
        return run_until(io, [&] { return done(resolver->stats()); });
    }

    net::io_context io;
    FakeUpstream upstream;
    std::set<std::string> refused{"blocked.example.com"};
    std::vector<std::string> checked;
    std::vector<Resolved> resolved;
    std::unique_ptr<LeaseResolver> resolver;
};

/// `reply` parsed, checked to be a response to the query `id` with `rcode`.
Packet expect_reply(const std::optional<Wire>& reply, std::uint16_t id, ldns_pkt_rcode rcode) {
    REQUIRE(reply.has_value());
    Packet pkt = parse(*reply);
    REQUIRE(pkt != nullptr);
    CHECK(ldns_pkt_qr(pkt.get()));
    CHECK(ldns_pkt_id(pkt.get()) == id);
    CHECK(ldns_pkt_get_rcode(pkt.get()) == rcode);
    return pkt;
}

/// `wire` with its id replaced by `id`.
Wire with_id(Wire wire, std::uint16_t id) {
    if (wire.size() >= 2) ldns_write_uint16(wire.data(), id);
    return wire;
}

/// A UDP port of 127.0.0.1 that nothing listens on (closed again at once).
std::uint16_t closed_port(net::io_context& io) {
    udp::socket probe(io, udp::endpoint(loopback, 0));
    return probe.local_endpoint().port();
}

}  // namespace

TEST_CASE("A refused name is answered REFUSED at once and never reaches the upstream",
          "[resolver]") {
    Rig rig;
    rig.start();
    const auto pkt = expect_reply(rig.ask(query("Blocked.Example.COM.", LDNS_RR_TYPE_A, 0x1234)),
                                  0x1234, LDNS_RCODE_REFUSED);
    CHECK(ldns_pkt_qdcount(pkt.get()) == 1);
    CHECK(question_name(pkt.get()) == "blocked.example.com");
    CHECK(ldns_pkt_ancount(pkt.get()) == 0);
    // The policy saw the name lower-cased, without its trailing dot.
    CHECK(rig.checked == std::vector<std::string>{"blocked.example.com"});

    // A later allowed query reaches the upstream: the refused one, sent before, did not.
    expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 7)), 7, LDNS_RCODE_NOERROR);
    REQUIRE(rig.upstream.seen.size() == 1);
    CHECK(rig.upstream.seen[0].name == "a.example.com");
    CHECK(rig.resolver->stats().refused == 1);
    CHECK(rig.resolver->stats().queries == 2);
}

TEST_CASE("An allowed name gets the upstream's answer with the lease's id, and its addresses",
          "[resolver]") {
    Rig rig;
    rig.start();
    const auto reply = rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 0xbeef));
    const auto pkt = expect_reply(reply, 0xbeef, LDNS_RCODE_NOERROR);
    CHECK(ldns_pkt_ancount(pkt.get()) == 2);
    // Passed on unchanged but for the id.
    CHECK(*reply == with_id(rig.upstream.last_answer, 0xbeef));
    CHECK(rig.resolved == std::vector<Resolved>{{"a.example.com", "192.0.2.1", 300},
                                                {"a.example.com", "192.0.2.2", 60}});
    CHECK(rig.upstream.seen.size() == 1);
    CHECK_FALSE(rig.upstream.seen[0].tcp);
}

TEST_CASE("AAAA records are reported as addresses too", "[resolver]") {
    Rig rig;
    rig.start();
    expect_reply(rig.ask(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 11)), 11, LDNS_RCODE_NOERROR);
    CHECK(rig.resolved == std::vector<Resolved>{{"v6.example.com", "2001:db8::1", 120}});
}

TEST_CASE("Addresses reached through a CNAME chain are the question's, others are not reported",
          "[resolver]") {
    Rig rig;
    rig.start();
    const auto reply = rig.ask(query("alias.example.com.", LDNS_RR_TYPE_A, 12));
    const auto pkt = expect_reply(reply, 12, LDNS_RCODE_NOERROR);
    CHECK(ldns_pkt_ancount(pkt.get()) == 6);  // the whole answer goes back to the lease
    CHECK(*reply == with_id(rig.upstream.last_answer, 12));
    CHECK(rig.resolved == std::vector<Resolved>{{"alias.example.com", "198.51.100.7", 30},
                                                {"alias.example.com", "2001:db8::7", 31}});
}

TEST_CASE("An empty answer and NXDOMAIN are passed on, with no address", "[resolver]") {
    Rig rig;
    rig.start();
    const auto empty = expect_reply(rig.ask(query("empty.example.com.", LDNS_RR_TYPE_A, 13)), 13,
                                    LDNS_RCODE_NOERROR);
    CHECK(ldns_pkt_ancount(empty.get()) == 0);
    expect_reply(rig.ask(query("nx.example.com.", LDNS_RR_TYPE_A, 14)), 14, LDNS_RCODE_NXDOMAIN);
    CHECK(rig.resolved.empty());
    CHECK(rig.resolver->stats().failed == 0);
}

TEST_CASE("A TCP query is forwarded over TCP, a query at a time on one connection", "[resolver]") {
    Rig rig;
    rig.start();
    TcpClient client(rig.io, rig.resolver->port());
    client.send(query("a.example.com.", LDNS_RR_TYPE_A, 21));
    REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 1; }));
    CHECK(client.replies()[0] == with_id(rig.upstream.last_answer, 21));
    expect_reply(client.replies()[0], 21, LDNS_RCODE_NOERROR);
    REQUIRE(rig.upstream.seen.size() == 1);
    CHECK(rig.upstream.seen[0].tcp);

    // Two more on the same connection, sent back to back: a refused one and an AAAA.
    client.send(query("blocked.example.com.", LDNS_RR_TYPE_A, 22));
    client.send(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 23));
    REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 3; }));
    expect_reply(client.replies()[1], 22, LDNS_RCODE_REFUSED);
    expect_reply(client.replies()[2], 23, LDNS_RCODE_NOERROR);
    CHECK(rig.upstream.seen.size() == 2);
    CHECK(rig.resolved == std::vector<Resolved>{{"a.example.com", "192.0.2.1", 300},
                                                {"a.example.com", "192.0.2.2", 60},
                                                {"v6.example.com", "2001:db8::1", 120}});
    CHECK_FALSE(client.closed());
}

TEST_CASE("Malformed messages get FORMERR or are dropped, and the resolver keeps serving",
          "[resolver]") {
    Rig rig;
    rig.start();
    std::uint64_t malformed = 0;
    /// Sends `message`, which is counted malformed: what comes back, when `answered` within
    /// 5 s, else within 100 ms (nothing, if it is dropped).
    auto send_bad = [&](const Wire& message, bool answered) -> std::optional<Wire> {
        UdpClient client(rig.io, rig.resolver->port());
        client.send(message);
        ++malformed;
        REQUIRE(rig.stats_until([&](const ResolverStats& s) { return s.malformed == malformed; }));
        run_until(
            rig.io, [&] { return !client.replies().empty(); }, answered ? 5000ms : 100ms);
        if (client.replies().empty()) return std::nullopt;
        return client.replies().front();
    };
    auto formerr = [&](const Wire& message) { return send_bad(message, true); };
    auto dropped = [&](const Wire& message) { return !send_bad(message, false).has_value(); };

    SECTION("a header cut short is dropped") {
        CHECK(dropped(Wire{0x12, 0x34, 0x01, 0x00, 0x00}));
        CHECK(dropped(Wire{}));
    }
    SECTION("two questions") {
        Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 31);
        ldns_rr* second = nullptr;
        REQUIRE(ldns_rr_new_question_frm_str(&second, "b.example.com. IN A", nullptr, nullptr) ==
                LDNS_STATUS_OK);
        ldns_pkt_push_rr(q.get(), LDNS_SECTION_QUESTION, second);
        const auto pkt = expect_reply(formerr(to_wire(q.get())), 31, LDNS_RCODE_FORMERR);
        CHECK(ldns_pkt_qdcount(pkt.get()) == 0);
    }
    SECTION("no question") {
        Packet q(ldns_pkt_new());
        ldns_pkt_set_id(q.get(), 32);
        expect_reply(formerr(to_wire(q.get())), 32, LDNS_RCODE_FORMERR);
    }
    SECTION("class CH") {
        Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 33, LDNS_RR_CLASS_CH);
        expect_reply(formerr(to_wire(q.get())), 33, LDNS_RCODE_FORMERR);
    }
    SECTION("opcode STATUS, and an opcode ldns has no name for") {
        Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 34);
        ldns_pkt_set_opcode(q.get(), LDNS_PACKET_STATUS);
        expect_reply(formerr(to_wire(q.get())), 34, LDNS_RCODE_FORMERR);
        Wire odd = query("a.example.com.", LDNS_RR_TYPE_A, 35);
        odd[2] = static_cast<std::uint8_t>((odd[2] & ~0x78U) | (15U << 3));  // opcode 15
        expect_reply(formerr(odd), 35, LDNS_RCODE_FORMERR);
    }
    SECTION("a response instead of a query is dropped (never answered: no FORMERR ping-pong)") {
        Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 36);
        ldns_pkt_set_qr(q.get(), true);
        CHECK(dropped(to_wire(q.get())));
    }
    SECTION("a UDP message over 4096 bytes is cut, so malformed") {
        Wire big = query("a.example.com.", LDNS_RR_TYPE_A, 37);
        big.resize(5000, 0);
        expect_reply(formerr(big), 37, LDNS_RCODE_FORMERR);
    }
    SECTION("a header and junk") {
        Wire junk{0x00, 38,   0x01, 0x00, 0x00, 0x01, 0x00, 0x00,
                  0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff};
        expect_reply(formerr(junk), 38, LDNS_RCODE_FORMERR);
    }
    SECTION("over TCP, a malformed message and an empty one on a connection that goes on") {
        TcpClient client(rig.io, rig.resolver->port());
        Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 39, LDNS_RR_CLASS_CH);
        client.send(to_wire(q.get()));
        client.send(Wire{});
        client.send(query("a.example.com.", LDNS_RR_TYPE_A, 40));
        REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 2; }));
        expect_reply(client.replies()[0], 39, LDNS_RCODE_FORMERR);
        expect_reply(client.replies()[1], 40, LDNS_RCODE_NOERROR);
        CHECK(rig.resolver->stats().malformed == 2);
        malformed = 2;
    }
    SECTION("random junk and damaged queries") {
        std::mt19937 random(48);
        const Wire good = query("a.example.com.", LDNS_RR_TYPE_A, 41);
        UdpClient client(rig.io, rig.resolver->port());
        constexpr int messages = 400;
        for (int i = 0; i < messages; ++i) {
            Wire message;
            if (i % 2 == 0) {
                message.resize(std::uniform_int_distribution<std::size_t>(0, 300)(random));
                for (auto& b : message) b = static_cast<std::uint8_t>(random());
            } else {
                message = good;
                const int flips = std::uniform_int_distribution<int>(1, 4)(random);
                for (int f = 0; f < flips; ++f) {
                    message[random() % message.size()] = static_cast<std::uint8_t>(random());
                }
            }
            client.send(message);
            // Not all at once, or the socket's receive buffer would drop some.
            if (i % 20 == 19) {
                REQUIRE(rig.stats_until([&](const ResolverStats& s) {
                    return s.queries == static_cast<std::uint64_t>(i + 1);
                }));
            }
        }
        CHECK(rig.resolver->stats().malformed > 0);
        // Whatever came back is a response.
        for (const auto& reply : client.replies()) {
            REQUIRE(reply.size() >= LDNS_HEADER_SIZE);
            CHECK(LDNS_QR_WIRE(reply.data()) != 0);
        }
        malformed = rig.resolver->stats().malformed;
    }

    // Served as before.
    expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 99)), 99, LDNS_RCODE_NOERROR);
    CHECK(rig.resolver->stats().malformed == malformed);
}

TEST_CASE("An upstream that never answers gives SERVFAIL after its timeout", "[resolver]") {
    Rig rig(FakeUpstream::Mode::silent);
    rig.start();
    SECTION("over UDP") {
        const auto start = std::chrono::steady_clock::now();
        const auto pkt = expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 51)), 51,
                                      LDNS_RCODE_SERVFAIL);
        CHECK(std::chrono::steady_clock::now() - start >= 150ms);
        CHECK(question_name(pkt.get()) == "a.example.com");
    }
    SECTION("over TCP") {
        TcpClient client(rig.io, rig.resolver->port());
        const auto start = std::chrono::steady_clock::now();
        client.send(query("a.example.com.", LDNS_RR_TYPE_A, 52));
        REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 1; }));
        CHECK(std::chrono::steady_clock::now() - start >= 150ms);
        expect_reply(client.replies()[0], 52, LDNS_RCODE_SERVFAIL);
        CHECK(rig.upstream.seen.size() == 1);
        CHECK(rig.upstream.seen[0].tcp);
    }
    CHECK(rig.resolved.empty());
    CHECK(rig.resolver->stats().failed == 1);
}

TEST_CASE("The next upstream is tried when one does not answer", "[resolver]") {
    Rig rig;
    FakeUpstream silent(rig.io, FakeUpstream::Mode::silent);
    SECTION("one that is silent, over UDP and TCP") {
        auto o = rig.options();
        o.upstream_timeout = 300ms;
        o.upstreams = {silent.endpoint(), rig.upstream.endpoint()};
        rig.start(o);
        const auto start = std::chrono::steady_clock::now();
        expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 61)), 61, LDNS_RCODE_NOERROR);
        CHECK(std::chrono::steady_clock::now() - start >= 150ms);
        CHECK(silent.seen.size() == 1);
        CHECK(rig.upstream.seen.size() == 1);
        CHECK(rig.resolved.size() == 2);

        TcpClient client(rig.io, rig.resolver->port());
        client.send(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 62));
        REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 1; }));
        expect_reply(client.replies()[0], 62, LDNS_RCODE_NOERROR);
        CHECK(silent.seen.size() == 2);
        CHECK(silent.seen[1].tcp);
        CHECK(rig.upstream.seen.size() == 2);
    }
    SECTION("one whose port is closed") {
        auto o = rig.options();
        o.upstreams = {udp::endpoint(loopback, closed_port(rig.io)), rig.upstream.endpoint()};
        rig.start(o);
        expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 63)), 63, LDNS_RCODE_NOERROR);
        TcpClient client(rig.io, rig.resolver->port());
        client.send(query("a.example.com.", LDNS_RR_TYPE_A, 64));
        REQUIRE(run_until(rig.io, [&] { return client.replies().size() == 1; }));
        expect_reply(client.replies()[0], 64, LDNS_RCODE_NOERROR);
    }
    CHECK(rig.resolver->stats().failed == 0);
}

TEST_CASE("Only the upstream's reply with the query's id and question is taken", "[resolver]") {
    Rig rig(FakeUpstream::Mode::forge);
    rig.start();
    // Forged first: the same answer from another port, then with another id, then with another
    // question; all give 192.0.2.66.
    const auto reply = rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 71));
    expect_reply(reply, 71, LDNS_RCODE_NOERROR);
    CHECK(*reply == with_id(rig.upstream.last_answer, 71));
    CHECK(rig.resolved == std::vector<Resolved>{{"a.example.com", "192.0.2.1", 300},
                                                {"a.example.com", "192.0.2.2", 60}});
}

TEST_CASE("Queries over max_in_flight waiting for an upstream are answered SERVFAIL",
          "[resolver]") {
    Rig rig(FakeUpstream::Mode::hold);
    auto o = rig.options();
    o.max_in_flight = 1;
    o.upstream_timeout = 10s;
    rig.start(o);
    UdpClient first(rig.io, rig.resolver->port());
    first.send(query("a.example.com.", LDNS_RR_TYPE_A, 81));
    REQUIRE(run_until(rig.io, [&] { return rig.upstream.held() == 1; }));

    // The first waits for the upstream: the second is answered at once.
    expect_reply(rig.ask(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 82)), 82, LDNS_RCODE_SERVFAIL);
    CHECK(rig.upstream.seen.size() == 1);
    CHECK(rig.resolver->stats().failed == 1);

    rig.upstream.release();
    REQUIRE(run_until(rig.io, [&] { return first.replies().size() == 1; }));
    expect_reply(first.replies()[0], 81, LDNS_RCODE_NOERROR);

    // Its slot is free again.
    rig.upstream.mode = FakeUpstream::Mode::answer;
    expect_reply(rig.ask(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 83)), 83, LDNS_RCODE_NOERROR);
    CHECK(rig.resolver->stats().failed == 1);
}

TEST_CASE("set_policy decides the queries read after it, and takes the answers still awaited",
          "[resolver]") {
    Rig rig(FakeUpstream::Mode::hold);
    rig.refused.insert("a.example.com");
    auto o = rig.options();
    o.upstream_timeout = 10s;
    rig.start(o);
    expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 91)), 91, LDNS_RCODE_REFUSED);

    // v6.example.com goes upstream under the first policy; its answer comes under the second.
    UdpClient waiting(rig.io, rig.resolver->port());
    waiting.send(query("v6.example.com.", LDNS_RR_TYPE_AAAA, 92));
    REQUIRE(run_until(rig.io, [&] { return rig.upstream.held() == 1; }));

    std::vector<std::string> checked_after;
    std::vector<Resolved> resolved_after;
    ResolverPolicy next;
    next.check_name = [&](const std::string& name) {
        checked_after.push_back(name);
        return true;
    };
    next.on_address = [&](const std::string& name, const ip::address& address, std::uint32_t ttl) {
        resolved_after.push_back({name, address.to_string(), ttl});
    };
    rig.resolver->set_policy(std::move(next));

    rig.upstream.release();
    REQUIRE(run_until(rig.io, [&] { return waiting.replies().size() == 1; }));
    expect_reply(waiting.replies()[0], 92, LDNS_RCODE_NOERROR);
    CHECK(resolved_after == std::vector<Resolved>{{"v6.example.com", "2001:db8::1", 120}});

    rig.upstream.mode = FakeUpstream::Mode::answer;
    expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 93)), 93, LDNS_RCODE_NOERROR);
    CHECK(checked_after == std::vector<std::string>{"a.example.com"});
    CHECK(resolved_after.size() == 3);
    CHECK(rig.resolved.empty());  // the first policy's on_address was never called
    CHECK(rig.checked == std::vector<std::string>{"a.example.com", "v6.example.com"});
}

TEST_CASE("stop() drops what is in flight: no callback after it, and it can be destroyed",
          "[resolver]") {
    const bool tcp_query = GENERATE(false, true);
    const bool explicit_stop = GENERATE(true, false);
    const bool answered_after = GENERATE(false, true);
    CAPTURE(tcp_query, explicit_stop, answered_after);
    net::io_context io;
    FakeUpstream upstream(io, FakeUpstream::Mode::hold);
    auto token = std::make_shared<int>(0);
    int calls = 0;
    ResolverPolicy policy;
    policy.check_name = [token, &calls](const std::string&) {
        ++calls;
        return true;
    };
    policy.on_address = [token, &calls](const std::string&, const ip::address&, std::uint32_t) {
        ++calls;
    };
    ResolverOptions o;
    o.listen = loopback;
    o.upstreams = {upstream.endpoint()};
    o.upstream_timeout = 10s;
    auto resolver = std::make_unique<LeaseResolver>(io.get_executor(), o, std::move(policy));
    UdpClient udp_client(io, resolver->port());
    TcpClient tcp_client(io, resolver->port());
    const Wire message = query("a.example.com.", LDNS_RR_TYPE_A, 101);
    if (tcp_query) {
        tcp_client.send(message);
    } else {
        udp_client.send(message);
    }
    REQUIRE(run_until(io, [&] { return upstream.held() == 1; }));
    CHECK(calls == 1);

    if (explicit_stop) {
        resolver->stop();
        CHECK(token.use_count() == 1);  // the policy is let go
        resolver->stop();               // twice is harmless
    }
    resolver.reset();
    CHECK(token.use_count() == 1);

    // The upstream's answer, if it comes after, is taken by nobody. Without it, nothing waits
    // for the upstream's 10 s either: the lease's TCP connection ends at once, or once its
    // query was dropped.
    if (answered_after) upstream.release();
    REQUIRE(run_until(
        io, [&] { return tcp_client.closed(); }, 3s));
    upstream.close();
    udp_client.close();
    tcp_client.close();
    // Every coroutine of the resolver ends (the UDP query's too): the io_context runs out of
    // work well before the upstream timeout.
    io.restart();
    io.run_for(5s);
    CHECK(io.stopped());
    CHECK(calls == 1);
    CHECK(udp_client.replies().empty());
    CHECK(tcp_client.replies().empty());
}

TEST_CASE("stats() counts the queries read, refused, failed and malformed", "[resolver]") {
    Rig rig(FakeUpstream::Mode::silent);
    rig.start();
    CHECK(rig.resolver->stats().queries == 0);
    expect_reply(rig.ask(query("blocked.example.com.", LDNS_RR_TYPE_A, 111)), 111,
                 LDNS_RCODE_REFUSED);
    expect_reply(rig.ask(query("a.example.com.", LDNS_RR_TYPE_A, 112)), 112, LDNS_RCODE_SERVFAIL);
    Packet q = make_query("a.example.com.", LDNS_RR_TYPE_A, 113, LDNS_RR_CLASS_CH);
    expect_reply(rig.ask(to_wire(q.get())), 113, LDNS_RCODE_FORMERR);
    const ResolverStats s = rig.resolver->stats();
    CHECK(s.queries == 3);
    CHECK(s.refused == 1);
    CHECK(s.failed == 1);
    CHECK(s.malformed == 1);
}

TEST_CASE("At most 16 TCP connections at once: more are closed", "[resolver]") {
    Rig rig;
    rig.start();
    std::vector<std::unique_ptr<TcpClient>> clients;
    for (int i = 0; i < 16; ++i) {
        clients.push_back(std::make_unique<TcpClient>(rig.io, rig.resolver->port()));
        clients.back()->send(
            query("a.example.com.", LDNS_RR_TYPE_A, static_cast<std::uint16_t>(i)));
    }
    REQUIRE(run_until(rig.io, [&] {
        return std::all_of(clients.begin(), clients.end(),
                           [](const auto& c) { return c->replies().size() == 1; });
    }));
    TcpClient extra(rig.io, rig.resolver->port());
    REQUIRE(run_until(rig.io, [&] { return extra.closed(); }));

    // One of them goes: a new connection is served (once the resolver saw it go).
    clients.front()->close();
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    bool served = false;
    while (!served && std::chrono::steady_clock::now() < deadline) {
        TcpClient next(rig.io, rig.resolver->port());
        next.send(query("a.example.com.", LDNS_RR_TYPE_A, 200));
        REQUIRE(run_until(rig.io, [&] { return !next.replies().empty() || next.closed(); }));
        served = !next.replies().empty();
    }
    CHECK(served);
}

TEST_CASE("Construction: an upstream is needed, and a port taken is an error", "[resolver]") {
    net::io_context io;
    ResolverOptions o;
    o.listen = loopback;
    ResolverPolicy policy;
    CHECK_THROWS_AS(LeaseResolver(io.get_executor(), o, policy), std::invalid_argument);

    o.upstreams = {udp::endpoint(loopback, closed_port(io))};
    SECTION("UDP taken") {
        udp::socket taken(io, udp::endpoint(loopback, 0));
        o.port = taken.local_endpoint().port();
        CHECK_THROWS_AS(LeaseResolver(io.get_executor(), o, policy), std::system_error);
    }
    SECTION("TCP taken") {
        tcp::acceptor taken(io, tcp::endpoint(loopback, 0));
        o.port = taken.local_endpoint().port();
        CHECK_THROWS_AS(LeaseResolver(io.get_executor(), o, policy), std::system_error);
    }
    SECTION("a port given is the port served") {
        std::uint16_t port = 0;
        {
            LeaseResolver first(io.get_executor(), o, policy);
            port = first.port();
            CHECK(port != 0);
        }
        o.port = port;  // let go by the first: served again
        LeaseResolver again(io.get_executor(), o, policy);
        CHECK(again.port() == port);
    }
}
