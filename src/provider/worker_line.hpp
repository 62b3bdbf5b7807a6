#pragma once
// One line of a plugin worker's stdout, classified (docs/plugins.md, "The protocol"). Pure; no
// I/O: the fuzz target tests/fuzz/fuzz_worker_line.cpp builds worker_line.cpp alone.
#include <nlohmann/json.hpp>

#include <string_view>

namespace sandboxd {

/// What one line of a plugin worker's stdout is (docs/plugins.md): a JSON-RPC response, a
/// request to the host, a notification; `text` (not a JSON object, or JSON nested deeper than
/// max_json_depth: a console.log, logged and dropped); `blank`; or `invalid` (an object that is
/// none of the three, dropped). A trailing
/// "\r" is ignored. Pure; never throws for any input but std::bad_alloc.
enum class worker_line_kind { blank, text, response, request, notification, invalid };
struct WorkerLine {
    worker_line_kind kind = worker_line_kind::blank;
    nlohmann::json message;  ///< the object, for response, request, notification and invalid
};
WorkerLine parse_worker_line(std::string_view line);

}  // namespace sandboxd
