// libFuzzer target: the plugin worker's stdout line parser (src/provider/plugin_worker.cpp):
// any line is blank, text, a response, a request, a notification or invalid; never a crash or
// an exception. The kinds agree with the message's shape.
#include "provider/plugin_worker.hpp"

#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view line(reinterpret_cast<const char*>(data), size);
    const auto parsed = sandboxd::parse_worker_line(line);
    using k = sandboxd::worker_line_kind;
    switch (parsed.kind) {
        case k::blank:
        case k::text:
            if (!parsed.message.is_null()) std::abort();
            break;
        case k::request:
        case k::notification:
            if (!parsed.message.is_object() || !parsed.message["method"].is_string()) std::abort();
            break;
        case k::response:
            if (!parsed.message.is_object() || !parsed.message.contains("id")) std::abort();
            break;
        case k::invalid:
            if (!parsed.message.is_object()) std::abort();
            break;
    }
    return 0;
}
