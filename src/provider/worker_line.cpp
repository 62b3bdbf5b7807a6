#include "provider/worker_line.hpp"

namespace sandboxd {

using json = nlohmann::json;

WorkerLine parse_worker_line(std::string_view line) {
    WorkerLine out;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) return out;
    out.message = json::parse(line, nullptr, false);
    if (out.message.is_discarded() || !out.message.is_object()) {
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
