#pragma once
/// @file logging.hpp
/// Logging to stderr (journald and container runtimes collect it) with spdlog.

#include <string>

namespace sandboxd {

/// Installs the default logger: `level` is trace|debug|info|warn|error|critical|off;
/// `format` "text" (time, level, message) or "json" (one object per line: time, level, msg).
/// Call once at start, before other threads log. Never logs tokens or payload bytes itself.
void setup_logging(const std::string& level, const std::string& format);

}  // namespace sandboxd
