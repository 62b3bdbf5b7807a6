// The etcd v3 JSON gateway's message shapes (etcd_client.hpp): encoding the requests' parts and
// decoding the answers. Pure functions, no I/O and no coroutines: the fuzz target
// tests/fuzz/fuzz_etcd_reply.cpp builds this file alone.
#include "registry/etcd_client.hpp"

#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/json_limits.hpp>

#include <charconv>
#include <stdexcept>

namespace sandboxd::etcd {
namespace {

using json = nlohmann::json;

std::int64_t parse_int64(std::string_view text) {
    std::int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
        throw std::invalid_argument("not a 64-bit integer: \"" + std::string(text) + "\"");
    }
    return v;
}

std::string b64(std::string_view raw) { return base64_encode(raw); }

}  // namespace

json parse_reply_body(const std::string& body) {
    try {
        return parse_json(body);
    } catch (const json::parse_error&) {  // too deep is a parse_error too: refused below
        // A streaming answer (lease keepalive) is newline-delimited JSON: take the first one.
        auto nl = body.find('\n');
        if (nl == std::string::npos) throw;
        return parse_json(std::string_view(body).substr(0, nl));
    }
}

// --- JSON helpers ------------------------------------------------------------------------

json compare_create_revision(std::string_view key, std::int64_t revision) {
    return {{"key", b64(key)},
            {"result", "EQUAL"},
            {"target", "CREATE"},
            {"create_revision", std::to_string(revision)}};
}

json compare_mod_revision(std::string_view key, std::int64_t revision) {
    return {{"key", b64(key)},
            {"result", "EQUAL"},
            {"target", "MOD"},
            {"mod_revision", std::to_string(revision)}};
}

json request_put(std::string_view key, std::string_view value, std::int64_t lease) {
    json put = {{"key", b64(key)}, {"value", b64(value)}};
    if (lease != 0) put["lease"] = std::to_string(lease);
    return {{"request_put", std::move(put)}};
}

json request_range(std::string_view key) { return {{"request_range", {{"key", b64(key)}}}}; }

json request_delete(std::string_view key) {
    return {{"request_delete_range", {{"key", b64(key)}}}};
}

std::string prefix_end(std::string_view prefix) {
    std::string end(prefix);
    while (!end.empty()) {
        auto& c = reinterpret_cast<unsigned char&>(end.back());
        if (c < 0xff) {
            ++c;
            return end;
        }
        end.pop_back();
    }
    return std::string(1, '\0');  // every key
}

std::int64_t int64_field(const json& j, std::string_view name) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return 0;
    if (it->is_string()) return parse_int64(it->get_ref<const std::string&>());
    if (it->is_number_integer()) return it->get<std::int64_t>();
    throw std::invalid_argument("field " + std::string(name) + " is not an integer");
}

KeyValue decode_kv(const json& kv) {
    if (!kv.is_object()) throw std::invalid_argument("kvs element is not an object");
    KeyValue out;
    auto text = [&](const char* name) -> std::string {
        auto it = kv.find(name);
        if (it == kv.end() || it->is_null()) return {};
        if (!it->is_string()) throw std::invalid_argument(std::string(name) + " is not a string");
        return base64_decode(it->get_ref<const std::string&>());
    };
    out.key = text("key");
    out.value = text("value");
    out.create_revision = int64_field(kv, "create_revision");
    out.mod_revision = int64_field(kv, "mod_revision");
    out.version = int64_field(kv, "version");
    out.lease = int64_field(kv, "lease");
    return out;
}

std::vector<KeyValue> txn_range_kvs(const json& response) {
    std::vector<KeyValue> out;
    const auto& rr = response.at("response_range");
    if (auto kvs = rr.find("kvs"); kvs != rr.end() && !kvs->is_null()) {
        if (!kvs->is_array()) throw std::invalid_argument("kvs is not an array");
        for (const auto& kv : *kvs) out.push_back(decode_kv(kv));
    }
    return out;
}

}  // namespace sandboxd::etcd
