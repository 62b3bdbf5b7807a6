#include "provider/worker_line.hpp"

#include <sandboxd/core/json_limits.hpp>

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
    const json& msg = out.message;
    const bool has_method = msg.contains("method") && msg["method"].is_string();
    const bool has_id = msg.contains("id") && !msg["id"].is_null();
    if (!has_method && msg.contains("id") && (msg.contains("result") || msg.contains("error"))) {
        out.kind = worker_line_kind::response;
    } else if (has_method && has_id) {
        out.kind = worker_line_kind::request;
    } else if (has_method && !msg.contains("id")) {
        out.kind = worker_line_kind::notification;
    } else {
        out.kind = worker_line_kind::invalid;
    }
    return out;
}

}  // namespace sandboxd
