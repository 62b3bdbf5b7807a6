#pragma once
#include "server/net.hpp"

#include <sandboxd/client.hpp>

namespace sandboxd {

struct Client::Impl {
    net::io_context ioc;
    websocket::stream<beast::tcp_stream> ws{ioc};
    std::chrono::milliseconds timeout;
    std::deque<ClientEvent> pending;
    std::int64_t next_id = 1;
    beast::flat_buffer buffer;

    /// Runs one async operation to completion on `ioc` under the timeout.
    template <typename Start>
    void run(Start start);
    ClientEvent read_one();
};

}  // namespace sandboxd
