#pragma once
// Reading JSON-RPC params: every failure is rpc_error(errc::invalid_params) naming the field.
#include <sandboxd/core/errors.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace sandboxd::params {

using json = nlohmann::json;

[[noreturn]] inline void invalid(const std::string& field, const std::string& why) {
    throw rpc_error(errc::invalid_params, field + ": " + why, {{"field", field}});
}

/// `params` itself: absent (null) is treated as {}; anything but an object is an error.
inline json object_or_empty(const json& p) {
    if (p.is_null()) return json::object();
    if (!p.is_object()) invalid("params", "must be an object");
    return p;
}

inline void only_keys(const json& p, std::initializer_list<const char*> allowed) {
    for (const auto& [key, value] : p.items()) {
        bool known = false;
        for (const char* a : allowed) known = known || key == a;
        if (!known) invalid(key, "unknown parameter");
    }
}

inline std::optional<std::string> opt_string(const json& p, const char* key) {
    auto it = p.find(key);
    if (it == p.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) invalid(key, "must be a string");
    return it->get<std::string>();
}

inline std::string req_string(const json& p, const char* key) {
    auto v = opt_string(p, key);
    if (!v) invalid(key, "is required");
    if (v->empty()) invalid(key, "must not be empty");
    if (v->size() > 1024) invalid(key, "must be at most 1024 bytes");
    return *v;
}

inline std::optional<std::uint64_t> opt_uint(const json& p, const char* key, std::uint64_t lo,
                                             std::uint64_t hi) {
    auto it = p.find(key);
    if (it == p.end() || it->is_null()) return std::nullopt;
    const std::string range = std::to_string(lo) + ".." + std::to_string(hi);
    if (!it->is_number_integer()) invalid(key, "must be an integer in " + range);
    if (!it->is_number_unsigned() && it->get<std::int64_t>() < 0) {
        invalid(key, "must be an integer in " + range);
    }
    auto v = it->get<std::uint64_t>();
    if (v < lo || v > hi) invalid(key, "must be an integer in " + range);
    return v;
}

inline std::uint64_t req_uint(const json& p, const char* key, std::uint64_t lo, std::uint64_t hi) {
    auto v = opt_uint(p, key, lo, hi);
    if (!v) invalid(key, "is required");
    return *v;
}

inline std::optional<bool> opt_bool(const json& p, const char* key) {
    auto it = p.find(key);
    if (it == p.end() || it->is_null()) return std::nullopt;
    if (!it->is_boolean()) invalid(key, "must be true or false");
    return it->get<bool>();
}

}  // namespace sandboxd::params
