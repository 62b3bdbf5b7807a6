#pragma once
/// @file app.hpp
/// Entry points of the two executables (docs/protocol.md section 7), kept in the library so
/// that tests can link them.

namespace sandboxd {

/// `sandboxd [--config FILE] [--listen HOST:PORT] [--state-dir DIR] [--node-id ID]
/// [--ready-file FILE] [--log-level LEVEL]`, `--version`, `--help`, `--check-config`,
/// `--print-default-config`. Returns 0 on a clean stop, 2 for a bad command line or config,
/// 1 for a start-up failure. Blocks until SIGTERM or SIGINT.
int daemon_main(int argc, char** argv);

/// `sandboxctl [--url URL] [--token TOKEN | --token-file FILE] COMMAND ...`. Returns the
/// command's status for `exec` (128+N for signal N), 0 for other successes, 255 for errors.
int ctl_main(int argc, char** argv);

}  // namespace sandboxd
