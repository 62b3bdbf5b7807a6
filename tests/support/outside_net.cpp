/// @file outside_net.cpp
/// The network tests' node and outside namespaces and their test hosts (outside_net.hpp).
/// The servers run on an io_context of their own; their sockets are made by a thread that
/// entered the outside namespace (a socket stays in the namespace it was made in). DNS
/// messages are read and written with ldns.
#include "support/outside_net.hpp"

#include <boost/asio/buffer.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>

// ldns/common.h defines `bool`, `true` and `false` as macros unless stdbool.h came first.
#include <stdbool.h>  // NOLINT(modernize-deprecated-headers)

#include <ldns/ldns.h>

#include <fcntl.h>
#include <sched.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

extern char** environ;

namespace sandboxd::test {
namespace {

namespace ip = boost::asio::ip;
using tcp = ip::tcp;
using udp = ip::udp;

[[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("outside net: " + what);
}

std::string sh_output(const std::string& command) {
    std::string out;
    FILE* p = ::popen((command + " 2>&1").c_str(), "r");
    if (p == nullptr) fail("cannot run " + command);
    char buffer[4096];
    std::size_t got = 0;
    while ((got = std::fread(buffer, 1, sizeof buffer, p)) > 0) out.append(buffer, got);
    const int status = ::pclose(p);
    if (status != 0) fail("`" + command + "` failed: " + out);
    return out;
}

/// The DNS zone of the outside's server.
const std::map<std::string, std::vector<std::string>>& zone() {
    static const std::map<std::string, std::vector<std::string>> records = {
        {"allowed.test.", {"allowed.test. 60 IN A 198.51.100.3"}},
        {"www.allowed.test.", {"www.allowed.test. 60 IN A 198.51.100.3"}},
        {"other.test.", {"other.test. 60 IN A 198.51.100.4"}},
        {"private.test.", {"private.test. 60 IN A 10.77.0.2"}},
        {"metadata.test.", {"metadata.test. 60 IN A 169.254.169.254"}},
        {"alias.test.",
         {"alias.test. 60 IN CNAME allowed.test.", "allowed.test. 60 IN A 198.51.100.3"}},
    };
    return records;
}

/// The answer to one DNS query, or "" for bytes that are no query.
std::string answer(const std::uint8_t* data, std::size_t size) {
    ldns_pkt* query = nullptr;
    if (ldns_wire2pkt(&query, data, size) != LDNS_STATUS_OK) return {};
    std::string out;
    if (ldns_pkt_qdcount(query) == 1) {
        ldns_rr* question = ldns_rr_list_rr(ldns_pkt_question(query), 0);
        char* owner = ldns_rdf2str(ldns_rr_owner(question));
        std::string name = owner != nullptr ? owner : "";
        std::free(owner);  // NOLINT(cppcoreguidelines-no-malloc): ldns's own allocation
        for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        ldns_pkt* reply = ldns_pkt_new();
        ldns_pkt_set_id(reply, ldns_pkt_id(query));
        ldns_pkt_set_qr(reply, true);
        ldns_pkt_set_aa(reply, true);
        ldns_pkt_set_rd(reply, ldns_pkt_rd(query));
        ldns_pkt_set_ra(reply, true);
        ldns_pkt_push_rr(reply, LDNS_SECTION_QUESTION, ldns_rr_clone(question));
        const auto found = zone().find(name);
        if (found == zone().end()) {
            ldns_pkt_set_rcode(reply, LDNS_RCODE_NXDOMAIN);
        } else if (ldns_rr_get_type(question) == LDNS_RR_TYPE_A) {
            for (const auto& text : found->second) {
                ldns_rr* rr = nullptr;
                if (ldns_rr_new_frm_str(&rr, text.c_str(), 0, nullptr, nullptr) == LDNS_STATUS_OK) {
                    ldns_pkt_push_rr(reply, LDNS_SECTION_ANSWER, rr);
                }
            }
        }  // other types: no data
        std::uint8_t* wire = nullptr;
        std::size_t wire_size = 0;
        if (ldns_pkt2wire(&wire, reply, &wire_size) == LDNS_STATUS_OK) {
            out.assign(reinterpret_cast<const char*>(wire), wire_size);
        }
        std::free(wire);  // NOLINT(cppcoreguidelines-no-malloc): ldns's own allocation
        ldns_pkt_free(reply);
    }
    ldns_pkt_free(query);
    return out;
}

}  // namespace

/// Sends `left` bytes of 'x' on `socket`, then half-closes it.
void send_bulk(const std::shared_ptr<tcp::socket>& socket, std::uint64_t left) {
    static const std::string chunk(1 << 20, 'x');
    if (left == 0) {
        boost::system::error_code ignored;
        socket->shutdown(tcp::socket::shutdown_send, ignored);
        return;
    }
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, chunk.size()));
    boost::asio::async_write(*socket, boost::asio::buffer(chunk.data(), n),
                             [socket, left, n](boost::system::error_code ec, std::size_t) {
                                 if (!ec) send_bulk(socket, left - n);
                             });
}

struct OutsideNet::State {
    pid_t holder = -1;  // `sleep infinity` in the outside namespace: its pid names it
    boost::asio::io_context io;
    std::vector<std::unique_ptr<tcp::acceptor>> acceptors;
    std::vector<std::unique_ptr<udp::socket>> udp_sockets;
    std::thread thread;
    std::atomic<std::uint64_t> dns_queries{0};
    std::atomic<int> echo_connections{0};

    void serve_http(tcp::acceptor& acceptor) {
        acceptor.async_accept([this, &acceptor](boost::system::error_code ec, tcp::socket s) {
            if (ec) return;
            auto socket = std::make_shared<tcp::socket>(std::move(s));
            auto request = std::make_shared<boost::asio::streambuf>();
            boost::asio::async_read_until(
                *socket, *request, "\r\n\r\n",
                [socket, request](boost::system::error_code rec, std::size_t) {
                    if (rec) return;
                    std::istream in(request.get());
                    std::string method;
                    std::string target;
                    in >> method >> target;
                    const auto local = socket->local_endpoint(rec);
                    std::string body = "hello from " + local.address().to_string() + ":" +
                                       std::to_string(local.port()) + "\n";
                    std::uint64_t bulk = 0;  // /bulk/N: N bytes of 'x', sent 1 MiB at a time
                    if (target.rfind("/bulk/", 0) == 0) {
                        bulk = std::stoull(target.substr(6));
                        body.clear();
                    }
                    auto text = std::make_shared<std::string>(
                        "HTTP/1.1 200 OK\r\nContent-Length: " +
                        std::to_string(bulk > 0 ? bulk : body.size()) +
                        "\r\nConnection: close\r\n\r\n" + body);
                    boost::asio::async_write(
                        *socket, boost::asio::buffer(*text),
                        [socket, text, bulk](boost::system::error_code wec, std::size_t) {
                            if (wec) return;
                            send_bulk(socket, bulk);
                        });
                });
            serve_http(acceptor);
        });
    }

    void echo_tcp(std::shared_ptr<tcp::socket> socket) {
        auto buffer = std::make_shared<std::array<char, 4096>>();
        socket->async_read_some(
            boost::asio::buffer(*buffer),
            [this, socket, buffer](boost::system::error_code ec, std::size_t n) {
                if (ec) {
                    --echo_connections;
                    return;
                }
                boost::asio::async_write(
                    *socket, boost::asio::buffer(buffer->data(), n),
                    [this, socket, buffer](boost::system::error_code wec, std::size_t) {
                        if (wec) {
                            --echo_connections;
                            return;
                        }
                        echo_tcp(socket);
                    });
            });
    }

    void serve_echo(tcp::acceptor& acceptor) {
        acceptor.async_accept([this, &acceptor](boost::system::error_code ec, tcp::socket s) {
            if (ec) return;
            ++echo_connections;
            echo_tcp(std::make_shared<tcp::socket>(std::move(s)));
            serve_echo(acceptor);
        });
    }

    /// A UDP socket answering each datagram with `reply(datagram)` ("" answers nothing).
    void serve_udp(udp::socket& socket, std::function<std::string(const std::string&)> reply) {
        auto buffer = std::make_shared<std::array<char, 4096>>();
        auto from = std::make_shared<udp::endpoint>();
        socket.async_receive_from(
            boost::asio::buffer(*buffer), *from,
            [this, &socket, buffer, from, reply](boost::system::error_code ec, std::size_t n) {
                if (ec) return;
                auto out = std::make_shared<std::string>(reply(std::string(buffer->data(), n)));
                if (!out->empty()) {
                    socket.async_send_to(boost::asio::buffer(*out), *from,
                                         [out](boost::system::error_code, std::size_t) {});
                }
                serve_udp(socket, reply);
            });
    }

    void serve_dns_tcp(tcp::acceptor& acceptor) {
        acceptor.async_accept([this, &acceptor](boost::system::error_code ec, tcp::socket s) {
            if (ec) return;
            auto socket = std::make_shared<tcp::socket>(std::move(s));
            auto length = std::make_shared<std::array<std::uint8_t, 2>>();
            boost::asio::async_read(
                *socket, boost::asio::buffer(*length),
                [this, socket, length](boost::system::error_code rec, std::size_t) {
                    if (rec) return;
                    const std::size_t size = (std::size_t{(*length)[0]} << 8) | (*length)[1];
                    auto message = std::make_shared<std::vector<std::uint8_t>>(size);
                    boost::asio::async_read(
                        *socket, boost::asio::buffer(*message),
                        [this, socket, message](boost::system::error_code mec, std::size_t) {
                            if (mec) return;
                            ++dns_queries;
                            const std::string reply = answer(message->data(), message->size());
                            auto framed = std::make_shared<std::string>();
                            framed->push_back(static_cast<char>(reply.size() >> 8));
                            framed->push_back(static_cast<char>(reply.size() & 0xff));
                            *framed += reply;
                            boost::asio::async_write(
                                *socket, boost::asio::buffer(*framed),
                                [socket, framed](boost::system::error_code, std::size_t) {});
                        });
                });
            serve_dns_tcp(acceptor);
        });
    }
};

OutsideNet::OutsideNet() : state_(std::make_unique<State>()) {
    ::signal(SIGPIPE, SIG_IGN);
    if (::unshare(CLONE_NEWNET) != 0) fail(std::string("unshare: ") + std::strerror(errno));
    sh_output("ip link set lo up");
    // The outside: a namespace made by a thread of its own, held by a child started there.
    int outside_fd = -1;
    std::string error;
    std::thread([&] {
        if (::unshare(CLONE_NEWNET) != 0) {
            error = std::string("unshare (outside): ") + std::strerror(errno);
            return;
        }
        outside_fd = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
        const char* argv[] = {"/bin/sleep", "infinity", nullptr};
        if (::posix_spawn(&state_->holder, "/bin/sleep", nullptr, nullptr,
                          const_cast<char* const*>(argv), environ) != 0) {
            error = "cannot start the outside's holder";
        }
    }).join();
    if (!error.empty()) fail(error);
    const std::string holder = std::to_string(state_->holder);
    const std::string in_outside = "nsenter --net=/proc/" + holder + "/ns/net ";
    sh_output("ip link add up0 type veth peer name out0 && ip link set out0 netns " + holder);
    sh_output(
        "ip addr add 198.51.100.1/24 dev up0 && ip link set up0 up && "
        "ip route add default via 198.51.100.2");
    sh_output(in_outside +
              "sh -c 'ip link set lo up && ip link set out0 up && "
              "ip addr add 198.51.100.2/24 dev out0 && "
              "ip addr add 198.51.100.3/24 dev out0 && "
              "ip addr add 198.51.100.4/24 dev out0 && "
              "ip addr add 10.77.0.2/16 dev out0 && "
              "ip addr add 169.254.169.254/16 dev out0'");

    // The test hosts' sockets, made inside the outside namespace.
    std::thread([&] {
        try {
            if (::setns(outside_fd, CLONE_NEWNET) != 0) {
                fail(std::string("setns: ") + std::strerror(errno));
            }
            auto listen = [&](const char* address, unsigned short port) {
                auto a = std::make_unique<tcp::acceptor>(
                    state_->io, tcp::endpoint(ip::make_address(address), port));
                state_->acceptors.push_back(std::move(a));
                return state_->acceptors.back().get();
            };
            for (const char* address : {public_host, other_host, private_host, metadata_host}) {
                state_->serve_http(*listen(address, 80));
            }
            state_->serve_http(*listen(public_host, 8080));
            state_->serve_echo(*listen(public_host, 7000));
            state_->serve_dns_tcp(*listen(public_host, 53));
            auto udp_at = [&](unsigned short port) {
                state_->udp_sockets.push_back(std::make_unique<udp::socket>(
                    state_->io, udp::endpoint(ip::make_address(public_host), port)));
                return state_->udp_sockets.back().get();
            };
            state_->serve_udp(*udp_at(7001), [](const std::string& d) { return d; });
            state_->serve_udp(*udp_at(53), [this](const std::string& d) {
                ++state_->dns_queries;
                return answer(reinterpret_cast<const std::uint8_t*>(d.data()), d.size());
            });
        } catch (const std::exception& e) {
            error = e.what();
        }
    }).join();
    ::close(outside_fd);
    if (!error.empty()) fail(error);
    state_->thread = std::thread([this] { state_->io.run(); });
}

OutsideNet::~OutsideNet() {
    state_->io.stop();
    if (state_->thread.joinable()) state_->thread.join();
    if (state_->holder > 0) {
        ::kill(state_->holder, SIGKILL);
        ::waitpid(state_->holder, nullptr, 0);
    }
    // The veth pair goes with the outside namespace; the node's namespace with this process.
}

std::string OutsideNet::node_sh(const std::string& command) const { return sh_output(command); }

std::uint64_t OutsideNet::dns_queries() const { return state_->dns_queries.load(); }

int OutsideNet::echo_connections() const { return state_->echo_connections.load(); }

}  // namespace sandboxd::test
