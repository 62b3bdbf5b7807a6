#pragma once
/// @file logging.hpp
/// Logging to stderr (journald and container runtimes collect it) with spdlog.

#include <string>

namespace sandboxd {

/// Installs the default logger: `level` is trace|debug|info|warn|error|critical|off;
/// `format` "text" (time, level, message; under systemd, when stderr is the journal stream
/// named by JOURNAL_STREAM, a `<N>` syslog priority prefix and no time) or "json" (one object
/// per line: time, level, msg, and the message's `node=`, `lease=`, `channel=` and `peer=`
/// words as fields of their own, taken out of msg).
/// Call once at start, before other threads log. Never logs tokens or payload bytes itself.
void setup_logging(const std::string& level, const std::string& format);

}  // namespace sandboxd
