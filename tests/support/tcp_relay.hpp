#pragma once
// A TCP relay that a test can cut: it listens on 127.0.0.1:0 and relays every connection to
// one target, on a thread of its own. cut() closes every relayed connection and closes each
// new one at once until resume(), so a client sees its connection break and its reconnects
// fail while the target itself keeps running (unlike stopping or pausing the target).
#include <cstdint>
#include <memory>
#include <string>

namespace sandboxd::test {

class TcpRelay {
public:
    /// Relays to `target_host` (an IPv4 address) : `target_port`. Throws std::system_error
    /// when it cannot listen.
    TcpRelay(const std::string& target_host, std::uint16_t target_port);
    /// Closes the listener and every connection, and joins the relay's thread.
    ~TcpRelay();
    TcpRelay(const TcpRelay&) = delete;
    TcpRelay& operator=(const TcpRelay&) = delete;

    /// "http://127.0.0.1:PORT": the relay's own address.
    std::string endpoint() const;
    /// Closes every relayed connection and refuses (accepts and closes at once) new ones.
    /// Returns once the connections are closed. Thread-safe.
    void cut();
    /// Relays new connections again. Thread-safe.
    void resume();
    /// Connections accepted and relayed so far (not those closed while cut). Thread-safe.
    std::size_t relayed() const;
    /// Bytes that the target has sent through the relay so far, over every connection.
    /// Thread-safe.
    std::size_t bytes_from_target() const;

    struct Impl;  ///< tcp_relay.cpp's own

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace sandboxd::test
