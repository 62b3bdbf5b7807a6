#include <sandboxd/core/jsonrpc.hpp>

#include <sandboxd/core/json_limits.hpp>

namespace sandboxd::jsonrpc {

std::string request(const json& id, std::string_view method, json params) {
    return json{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", std::move(params)}}
        .dump();
}

std::string request(const json& id, std::string_view method, json params, std::string_view name,
                    json value) {
    json message = {
        {"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", std::move(params)}};
    message[std::string(name)] = std::move(value);
    return message.dump();
}

std::string forwarded_request(const json& id, std::string_view method, json params,
                              json forwarded_for) {
    json message = {{"jsonrpc", "2.0"},
                    {"method", method},
                    {"params", std::move(params)},
                    {"forwardedFor", std::move(forwarded_for)}};
    if (!id.is_null()) message["id"] = id;
    return message.dump();
}

std::string notification(std::string_view method, json params) {
    return json{{"jsonrpc", "2.0"}, {"method", method}, {"params", std::move(params)}}.dump();
}

std::string result(const json& id, json result) {
    return json{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}}.dump();
}

std::string error(const json& id, const json& error) {
    return json{{"jsonrpc", "2.0"}, {"id", id}, {"error", error}}.dump(
        -1, ' ', false, json::error_handler_t::replace);
}

namespace {

bool valid_id(const json& id) { return id.is_string() || id.is_number_integer() || id.is_null(); }

Invalid invalid(json id, errc code, std::string message) {
    return Invalid{std::move(id), rpc_error(code, std::move(message))};
}

}  // namespace

std::variant<Request, Invalid> parse_request(std::string_view text, std::size_t max_size) {
    if (text.size() > max_size) {
        return invalid(nullptr, errc::invalid_request,
                       "text message of " + std::to_string(text.size()) +
                           " bytes is over the limit of " + std::to_string(max_size));
    }
    // Malformed covers a number beyond a double ("2E802") too: before tests/fuzz/fuzz_jsonrpc.cpp
    // found it, that escaped and ended the connection unanswered. Too deep is refused here, in
    // the parser, because everything after (moving params into handlers, copying, dumping
    // errors) may recurse once per level.
    auto parsed = try_parse_json(text);
    if (parsed.status == json_parse_status::too_deep) {
        return invalid(nullptr, errc::parse_error,
                       "Parse error: the text frame is " + json_too_deep_message());
    }
    if (!parsed.ok()) {
        return invalid(nullptr, errc::parse_error, "Parse error: the text frame is not JSON");
    }
    json message = std::move(parsed.value);
    if (message.is_array()) {
        return invalid(nullptr, errc::invalid_request, "Batch requests are not supported");
    }
    if (!message.is_object()) {
        return invalid(nullptr, errc::invalid_request, "A request must be a JSON object");
    }
    auto id_it = message.find("id");
    const bool has_id = id_it != message.end();
    // A usable id is echoed even when the rest of the request is invalid.
    json id = has_id && valid_id(*id_it) ? *id_it : json(nullptr);
    auto method_it = message.find("method");
    auto params_it = message.find("params");
    if (message.value("jsonrpc", json()) != "2.0" || method_it == message.end() ||
        !method_it->is_string() || (has_id && !valid_id(*id_it)) ||
        (params_it != message.end() && !params_it->is_object() && !params_it->is_array())) {
        return invalid(std::move(id), errc::invalid_request,
                       "Invalid Request: needs jsonrpc \"2.0\", a string method, an optional "
                       "string or integer id and object params");
    }
    Request request;
    if (has_id) request.id = std::move(id);
    request.method = method_it->get<std::string>();
    request.params = params_it != message.end() ? std::move(*params_it) : json::object();
    if (auto f = message.find("forwardedFor"); f != message.end()) {
        request.forwarded_for = std::move(*f);
    }
    return request;
}

message_kind classify(const json& message) {
    if (!message.is_object()) return message_kind::invalid;
    auto method = message.find("method");
    if (method == message.end()) {
        return message.contains("id") ? message_kind::response : message_kind::invalid;
    }
    if (!method->is_string()) return message_kind::invalid;
    return message.contains("id") ? message_kind::request : message_kind::notification;
}

message_kind classify_strict(const json& message) {
    if (!message.is_object()) return message_kind::invalid;
    const bool has_method = message.contains("method") && message["method"].is_string();
    const bool has_id = message.contains("id") && !message["id"].is_null();
    if (!has_method && message.contains("id") &&
        (message.contains("result") || message.contains("error"))) {
        return message_kind::response;
    }
    if (has_method && has_id) return message_kind::request;
    if (has_method && !message.contains("id")) return message_kind::notification;
    return message_kind::invalid;
}

std::variant<std::monostate, Request, Response> parse_message(std::string_view text) {
    auto parsed = try_parse_json(text);  // malformed or too deep: not a JSON-RPC object
    if (!parsed.ok()) return std::monostate{};
    json message = std::move(parsed.value);
    switch (classify(message)) {
        case message_kind::invalid: return std::monostate{};
        case message_kind::response: {
            Response response;
            response.id = message["id"];
            if (auto e = message.find("error"); e != message.end()) {
                response.error = std::move(*e);
            } else {
                auto r = message.find("result");
                response.result = r != message.end() ? std::move(*r) : json::object();
            }
            return response;
        }
        case message_kind::request:
        case message_kind::notification: break;
    }
    Request request;
    request.method = message["method"].get<std::string>();
    if (auto id = message.find("id"); id != message.end()) request.id = std::move(*id);
    auto params = message.find("params");
    request.params = params != message.end() ? std::move(*params) : json::object();
    return request;
}

errc errc_of_reason(std::string_view r) noexcept {
    for (int i = 1; i <= static_cast<int>(errc::channel_attached); ++i) {
        if (reason(static_cast<errc>(i)) == r) return static_cast<errc>(i);
    }
    return errc::internal_error;
}

json result_or_throw(Response response) {
    if (response.error) {
        const json& e = *response.error;
        json data = e.is_object() ? e.value("data", json::object()) : json::object();
        if (!data.is_object()) data = json::object();
        const std::string message = e.is_object() ? e.value("message", "") : "";
        const errc code = errc_of_reason(data.value("reason", ""));  // before data moves
        throw rpc_error(code, message, std::move(data));
    }
    return response.result ? std::move(*response.result) : json::object();
}

}  // namespace sandboxd::jsonrpc
