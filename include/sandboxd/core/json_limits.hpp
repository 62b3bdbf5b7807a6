#pragma once
/// @file json_limits.hpp
/// The one way sandboxd turns text into JSON (docs/protocol.md section 1, "Limits"): every
/// JSON text the daemon, its client and sandboxctl read (WebSocket messages, etcd replies,
/// records and watch events, SQLite lease columns, plugin worker lines and manifests, the
/// config file) goes through parse_json() or try_parse_json(), never json::parse.
///
/// Why: copying, comparing and serialising a nlohmann::json recurse once per nesting level, so
/// a text nested a few hundred thousand levels deep (under 1 MiB of `[`) ends the process at
/// the stack guard page as soon as anything copies or dumps it. nlohmann's parser and (since
/// 3.10) its destructor are iterative; these functions count the depth inside the parser (a
/// SAX wrapper around nlohmann's own DOM builder) and stop at the first level beyond
/// max_json_depth, before any value deeper than that exists. A rejected text leaves nothing
/// behind. The cost on the common path is one increment and one compare per array or object.
///
/// Thread-safety: pure functions of their arguments, safe from any thread; nothing blocks.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <exception>
#include <string>
#include <string_view>

namespace sandboxd {

/// The deepest nesting any JSON text read by sandboxd may have: an array or object at the top
/// is level 1, `[[1]]` is 2. A text with an array or object at level max_json_depth + 1 is
/// rejected. The protocol's own messages nest at most 8 levels; tenants' free-form values
/// (workspace metadata, plugin config) get the rest.
inline constexpr std::size_t max_json_depth = 64;

/// The message of a rejection for depth, "nested deeper than 64 levels", part of the wire
/// contract (docs/protocol.md section 1): it is quoted in the -32700 error.
std::string json_too_deep_message();

/// Options of a parse; the defaults are strict RFC 8259 JSON.
struct json_parse_options {
    /// Accept `//` and `/* */` comments (the config file and plugin manifests).
    bool ignore_comments = false;
};

/// What try_parse_json found.
enum class json_parse_status {
    ok,         ///< `value` holds the text's JSON
    malformed,  ///< not JSON (syntax, trailing input, a number beyond a double, bad UTF-8)
    too_deep,   ///< well-formed as far as read, but nested deeper than max_json_depth
};

struct json_parse_result {
    json_parse_status status = json_parse_status::malformed;
    /// The text's JSON when status is ok; null otherwise (never a partial value).
    nlohmann::json value;
    /// Why not, when status is not ok: nlohmann's message for malformed text (it names the
    /// byte), json_too_deep_message() for too_deep. Empty when ok.
    std::string error;
    /// The exception json::parse would have thrown (json::parse_error or json::out_of_range;
    /// for too_deep a json::parse_error, id 101, whose what() ends with
    /// json_too_deep_message()); null when ok.
    std::exception_ptr exception;

    bool ok() const noexcept { return status == json_parse_status::ok; }
};

/// Parses `text` as one JSON value, rejecting nesting deeper than max_json_depth.
/// Never throws for any input; std::bad_alloc only when memory runs out.
json_parse_result try_parse_json(std::string_view text, json_parse_options options = {});

/// As try_parse_json, but returns the value and throws what json::parse throws:
/// nlohmann::json::parse_error for malformed text and for a text nested too deep (its what()
/// names the depth), nlohmann::json::out_of_range for a number beyond a double. Existing
/// `catch (const json::exception&)` handlers therefore cover depth too.
nlohmann::json parse_json(std::string_view text, json_parse_options options = {});

}  // namespace sandboxd
