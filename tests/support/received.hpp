#pragma once
// What one test connection received per channel id while it reads events: output (credited
// back as it is read, so that no window stalls), gaps and exits. For the tests of detached
// channels, which read many channels at once across drops and restarts.
#include <sandboxd/client/client.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sandboxd::test {

struct Received {
    std::map<std::uint32_t, std::string> out, err;
    std::map<std::uint32_t, std::vector<nlohmann::json>> exits, gaps;

    /// Reads events until `done()` holds; false when `timeout` passed first.
    template <typename Pred>
    bool until(Client& c, Pred done, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (!done()) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left <= std::chrono::milliseconds(0)) return false;
            auto got = c.poll_event(left);
            if (!got) return false;
            take(c, *got);
        }
        return true;
    }

    void take(Client& c, const ClientEvent& e) {
        if (e.type == ClientEvent::kind::data) {
            (e.stream == stream_id::stderr_ ? err : out)[e.channel] += e.bytes;
            c.send_credit(e.channel, e.stream, static_cast<std::uint32_t>(e.bytes.size()));
            return;
        }
        if (e.type != ClientEvent::kind::notification) return;
        const auto method = e.message.value("method", "");
        const auto& p = e.message["params"];
        if (method == "duplexChannel.exit") exits[p["channel"].get<std::uint32_t>()].push_back(p);
        if (method == "duplexChannel.gap") gaps[p["channel"].get<std::uint32_t>()].push_back(p);
    }
};

}  // namespace sandboxd::test
