#pragma once
/// @file config_keys.hpp
/// The config's key table (config_keys.cpp): one descriptor per key, with its JSON name, type,
/// range or allowed values, whether a reload (SIGHUP) applies it and one line of doc, reaching
/// its field through a member pointer. Parsing, printing, the reload diff and the reference
/// table (docs/config.md) are all walks of that table. A key's default is the in-class
/// initializer of its field in `Config`, read from a default-constructed value. Private to
/// src/core (and the unit tests); value types and pure functions, no shared state.

#include <sandboxd/core/config.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace sandboxd::config_keys {

/// Throws config_error "config: PATH: WHY".
[[noreturn]] void fail(const std::string& path, const std::string& why);

/// Reads every key of DOCUMENT into OUT, in table order, without the cross-field rules
/// (validate_config). The first wrong type, value out of range or value not allowed throws
/// config_error naming its path; an object's unknown key throws once that object's known keys
/// are read.
void read(const nlohmann::json& document, Config& out);

/// Every key's effective value; a token's secret as "<redacted>".
nlohmann::json write(const Config& config);

/// The dotted paths of the keys a reload does not apply whose values differ between RUNNING
/// and NEXT, in table order; an array of objects (providers.plugins) counts as one key.
std::vector<std::string> restart_changes(const Config& running, const Config& next);

/// One row of the reference table: a key, or an object or array holding keys.
struct Row {
    std::string key;            ///< dotted path; an array's elements as `name[]`
    std::string type;           ///< "string", "integer", "object", "array of objects", ...
    std::string default_value;  ///< JSON text; "" for an object and a key printed only when set
    std::string range;          ///< "lo..hi", the allowed values, or ""
    bool reloadable = false;    ///< a reload (SIGHUP) applies a change of it
    std::string doc;
};

/// Every key in table order, each object and array before its keys.
std::vector<Row> reference_rows();

}  // namespace sandboxd::config_keys
