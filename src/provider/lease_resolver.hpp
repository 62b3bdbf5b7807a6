#pragma once
/// @file lease_resolver.hpp
/// The DNS resolver of one egress lease (issue 48): the only resolver the lease can reach, so
/// that domain rules are enforced on what it resolves. It runs in the daemon, on the daemon's
/// io_context; DNS messages are parsed and built with ldns (NLnet Labs), never by hand.
///
/// What it does with a query (UDP, or TCP with RFC 1035 4.2.2 length framing):
///  - A message that is not one query with exactly one question of class IN gets FORMERR
///    (when its header can be read and it is not a response; otherwise it is dropped: never
///    answering a response keeps two resolvers from answering each other's FORMERR for ever).
///  - The question's name (lower-cased, no trailing dot) goes to `ResolverPolicy::check_name`.
///    A refused name is answered REFUSED at once and is never sent upstream.
///  - An allowed query is sent to the upstream servers in turn (UDP, or TCP for a TCP query),
///    each given `upstream_timeout`; no answer from any: SERVFAIL.
///  - From an upstream answer to an allowed name, every A and AAAA record whose owner is the
///    question's name or a name reached from it through the answer's CNAME chain is given to
///    `ResolverPolicy::on_address` with its TTL, before the answer goes back to the lease. The
///    answer is passed on unchanged but for its id (the lease's own).
///  - At most `max_in_flight` queries wait for an upstream at once; more are answered SERVFAIL.
///
/// Bounds: a UDP message of at most 4096 bytes is read (a larger one is cut and so malformed);
/// a TCP connection carries one query at a time, at most 16 connections at once (more are
/// closed), each closed after 10 s idle.
///
/// Thread-safety: construct, call and destroy on one strand (the executor given). The policy's
/// callbacks run on it. No call blocks.

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/udp.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sandboxd::detail {

struct ResolverPolicy {
    /// Whether the lease may resolve `name` (lower-case, no trailing dot, e.g. "example.com").
    std::function<bool(const std::string& name)> check_name;
    /// An address that an upstream answered for an allowed `name` (the question's name), and
    /// its TTL in seconds as the answer gave it.
    std::function<void(const std::string& name, const boost::asio::ip::address& address,
                       std::uint32_t ttl_seconds)>
        on_address;
};

struct ResolverOptions {
    /// The address to serve on (the lease's gateway); port 0: the kernel picks one, the same
    /// for UDP and TCP.
    boost::asio::ip::address listen;
    std::uint16_t port = 0;
    /// Tried in order; at least one. Port 53 unless given.
    std::vector<boost::asio::ip::udp::endpoint> upstreams;
    std::chrono::milliseconds upstream_timeout{2000};
    std::size_t max_in_flight = 64;
};

struct ResolverStats {
    std::uint64_t queries = 0;    ///< every query read, well-formed or not
    std::uint64_t refused = 0;    ///< answered REFUSED (a name the policy refused)
    std::uint64_t failed = 0;     ///< answered SERVFAIL (no upstream answered, or too many)
    std::uint64_t malformed = 0;  ///< answered FORMERR or dropped
};

class LeaseResolver {
public:
    /// Binds UDP and TCP on options.listen:options.port and starts serving. Throws
    /// std::system_error when it cannot bind (with port 0, after trying a few ports that UDP
    /// had free but TCP had not), std::invalid_argument when `upstreams` is empty.
    LeaseResolver(boost::asio::any_io_executor executor, ResolverOptions options,
                  ResolverPolicy policy);
    ~LeaseResolver();
    LeaseResolver(const LeaseResolver&) = delete;
    LeaseResolver& operator=(const LeaseResolver&) = delete;

    /// The port it serves on (UDP and TCP).
    [[nodiscard]] std::uint16_t port() const noexcept;
    /// Replaces the policy (leaseUpdateNetwork): queries read from now on are checked by it;
    /// answers of queries already sent upstream go to the new `on_address`.
    void set_policy(ResolverPolicy policy);
    [[nodiscard]] ResolverStats stats() const noexcept;
    /// Closes its sockets and drops what is in flight; no callback runs after it returns.
    /// Also done by the destructor.
    void stop();

private:
    struct State;
    std::shared_ptr<State> state_;
};

}  // namespace sandboxd::detail
