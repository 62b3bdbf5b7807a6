#pragma once
// A WebSocket client on a plain TCP socket that does the upgrade by hand and sends whatever
// bytes a test crafts: frames that a conforming client library refuses to send (huge
// declared lengths, endless fragments, reserved bits). Blocking, every wait bounded. Not
// thread-safe; one per test.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd::test {

/// One frame as the daemon sent it (servers do not mask).
struct RawFrame {
    bool fin = true;
    bool rsv1 = false;
    int opcode = 0;
    std::string payload;
};

/// A masked client frame: `opcode` (0 continuation, 1 text, 2 binary, 8 close, 9 ping).
std::string client_frame(int opcode, std::string_view payload, bool fin = true,
                         std::uint32_t mask = 0x5a17c3e9, bool rsv1 = false);

/// A plain TCP connection to "IPV4:PORT" (blocking, close-on-exec); the caller closes the fd.
/// Throws std::runtime_error when the address is not IPv4 or the connect fails.
int connect_tcp(const std::string& address);

class RawWebSocket {
public:
    /// Connects to `address` (HOST:PORT) and sends `GET /v1/ws` with the upgrade headers, the
    /// bearer token and `extra_headers` ("Name: value" each). Reads the response head
    /// (bounded by 10 s); status() and headers() give it.
    RawWebSocket(const std::string& address, const std::string& token,
                 const std::vector<std::string>& extra_headers = {});
    ~RawWebSocket();
    RawWebSocket(const RawWebSocket&) = delete;
    RawWebSocket& operator=(const RawWebSocket&) = delete;

    int status() const { return status_; }
    /// The response head, header names lower-cased ("sec-websocket-extensions: ...").
    const std::string& headers() const { return headers_; }
    /// Writes every byte (MSG_NOSIGNAL); false once the daemon has closed or reset.
    bool send_raw(std::string_view bytes);
    /// The next frame, or nullopt when the connection ends first; throws std::runtime_error
    /// when nothing completes within `timeout`.
    std::optional<RawFrame> read_frame(std::chrono::milliseconds timeout);
    /// Reads frames until a close frame and returns its status code (0 for a close frame
    /// without one), or -1 when the connection ends without a close frame. Throws after
    /// `timeout`.
    int read_close_code(std::chrono::milliseconds timeout);
    /// True when bytes from the daemon (or its EOF) are ready within `wait`.
    bool readable(std::chrono::milliseconds wait);
    /// Resets the connection (SO_LINGER 0) and closes the socket.
    void reset();

private:
    bool fill(std::chrono::steady_clock::time_point deadline);
    int fd_ = -1;
    int status_ = 0;
    std::string headers_;
    std::string buffer_;  // received and not yet parsed
};

}  // namespace sandboxd::test
