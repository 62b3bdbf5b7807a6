#include "support/raw_ws.hpp"

#include <sandboxd/core/address.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace sandboxd::test {

std::string client_frame(int opcode, std::string_view payload, bool fin, std::uint32_t mask,
                         bool rsv1) {
    std::string out;
    out.reserve(payload.size() + 14);
    out.push_back(static_cast<char>((fin ? 0x80 : 0) | (rsv1 ? 0x40 : 0) | (opcode & 0x0f)));
    const std::uint64_t size = payload.size();
    if (size < 126) {
        out.push_back(static_cast<char>(0x80 | size));
    } else if (size <= 0xffff) {
        out.push_back(static_cast<char>(0x80 | 126));
        out.push_back(static_cast<char>(size >> 8));
        out.push_back(static_cast<char>(size & 0xff));
    } else {
        out.push_back(static_cast<char>(0x80 | 127));
        for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((size >> (8 * i)) & 0xff));
    }
    const unsigned char key[4] = {
        static_cast<unsigned char>(mask >> 24), static_cast<unsigned char>(mask >> 16),
        static_cast<unsigned char>(mask >> 8), static_cast<unsigned char>(mask)};
    out.append(reinterpret_cast<const char*>(key), 4);
    const std::size_t start = out.size();
    out.append(payload);
    for (std::size_t i = 0; i < payload.size(); ++i)
        out[start + i] = static_cast<char>(static_cast<unsigned char>(out[start + i]) ^ key[i % 4]);
    return out;
}

int connect_tcp(const std::string& address) {
    const auto parsed = parse_host_port(address);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(parsed.port);
    if (::inet_pton(AF_INET, parsed.host.c_str(), &sa.sin_addr) != 1) {
        throw std::runtime_error("connect_tcp: not an IPv4 address: " + address);
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        throw std::runtime_error(std::string("connect_tcp: socket: ") + std::strerror(errno));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
        const int err = errno;
        ::close(fd);
        throw std::runtime_error(std::string("connect_tcp: connect: ") + std::strerror(err));
    }
    return fd;
}

RawWebSocket::RawWebSocket(const std::string& address, const std::string& token,
                           const std::vector<std::string>& extra_headers)
    : fd_(connect_tcp(address)) {
    // Every send is bounded: a daemon that stops reading makes send_raw() fail, not hang.
    timeval send_timeout{10, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout);
    std::string request = "GET /v1/ws HTTP/1.1\r\nHost: " + address +
                          "\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                          "Sec-WebSocket-Version: 13\r\nAuthorization: Bearer " +
                          token + "\r\n";
    for (const auto& h : extra_headers) request += h + "\r\n";
    request += "\r\n";
    if (!send_raw(request)) throw std::runtime_error("raw websocket: cannot send the upgrade");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    std::size_t end = std::string::npos;
    while ((end = buffer_.find("\r\n\r\n")) == std::string::npos) {
        if (!fill(deadline)) throw std::runtime_error("raw websocket: no upgrade response");
    }
    std::string head = buffer_.substr(0, end + 2);
    buffer_.erase(0, end + 4);
    // "HTTP/1.1 101 Switching Protocols"
    status_ = std::stoi(head.substr(head.find(' ') + 1, 3));
    for (auto& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    headers_ = std::move(head);
}

RawWebSocket::~RawWebSocket() {
    if (fd_ >= 0) ::close(fd_);
}

bool RawWebSocket::send_raw(std::string_view bytes) {
    while (!bytes.empty()) {
        ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
}

bool RawWebSocket::fill(std::chrono::steady_clock::time_point deadline) {
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) throw std::runtime_error("raw websocket: timed out");
        pollfd p{fd_, POLLIN, 0};
        int r = ::poll(&p, 1, static_cast<int>(left.count()));
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) continue;  // the deadline check above throws
        char chunk[65536];
        ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;  // EOF or reset
        buffer_.append(chunk, static_cast<std::size_t>(n));
        return true;
    }
}

std::optional<RawFrame> RawWebSocket::read_frame(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        if (buffer_.size() >= 2) {
            const auto b0 = static_cast<unsigned char>(buffer_[0]);
            const auto b1 = static_cast<unsigned char>(buffer_[1]);
            std::size_t header = 2;
            std::uint64_t size = b1 & 0x7f;
            if (size == 126) header = 4;
            if (size == 127) header = 10;
            if (buffer_.size() >= header) {
                if (header == 4) {
                    size = static_cast<unsigned char>(buffer_[2]) << 8 |
                           static_cast<unsigned char>(buffer_[3]);
                } else if (header == 10) {
                    size = 0;
                    for (int i = 2; i < 10; ++i)
                        size = size << 8 | static_cast<unsigned char>(buffer_[i]);
                }
                if (buffer_.size() >= header + size) {
                    RawFrame f;
                    f.fin = (b0 & 0x80) != 0;
                    f.rsv1 = (b0 & 0x40) != 0;
                    f.opcode = b0 & 0x0f;
                    f.payload = buffer_.substr(header, size);
                    buffer_.erase(0, header + size);
                    return f;
                }
            }
        }
        if (!fill(deadline)) return std::nullopt;
    }
}

int RawWebSocket::read_close_code(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        auto frame = read_frame(std::max(left, std::chrono::milliseconds(1)));
        if (!frame) return -1;
        if (frame->opcode != 8) continue;
        if (frame->payload.size() < 2) return 0;
        return static_cast<unsigned char>(frame->payload[0]) << 8 |
               static_cast<unsigned char>(frame->payload[1]);
    }
}

bool RawWebSocket::readable(std::chrono::milliseconds wait) {
    if (!buffer_.empty()) return true;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(wait.count())) > 0;
}

void RawWebSocket::reset() {
    if (fd_ < 0) return;
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd_);
    fd_ = -1;
}

}  // namespace sandboxd::test
