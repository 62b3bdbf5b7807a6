#include "provider/worker_line.hpp"

#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/jsonrpc.hpp>

namespace sandboxd {

using json = nlohmann::json;

WorkerLine parse_worker_line(std::string_view line) {
    WorkerLine out;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) return out;
    auto parsed = try_parse_json(line);  // nested deeper than max_json_depth: text, dropped
    out.message = parsed.ok() ? std::move(parsed.value) : json();
    if (!out.message.is_object()) {
        out.kind = worker_line_kind::text;
        out.message = nullptr;
        return out;
    }
    switch (jsonrpc::classify_strict(out.message)) {
        case jsonrpc::message_kind::response: out.kind = worker_line_kind::response; break;
        case jsonrpc::message_kind::request: out.kind = worker_line_kind::request; break;
        case jsonrpc::message_kind::notification: out.kind = worker_line_kind::notification; break;
        case jsonrpc::message_kind::invalid: out.kind = worker_line_kind::invalid; break;
    }
    return out;
}

}  // namespace sandboxd
