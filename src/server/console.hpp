#pragma once
/// @file console.hpp
/// The browser console (docs/protocol.md section 8): its static files, served at GET /console
/// when `console.enabled`, and what a browser's WebSocket needs that a host's does not: the
/// bearer token carried in the subprotocol list (browsers cannot set Authorization on a
/// WebSocket) and the Origin check that goes with it.
/// Loading reads files (call it before serving); everything else is pure, never blocks, and is
/// safe from any thread once loaded.

#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace sandboxd {

/// The subprotocol prefix of a browser's token: `sandboxd.bearer.<base64url token, no padding>`.
inline constexpr std::string_view bearer_subprotocol_prefix = "sandboxd.bearer.";

class ConsoleAssets {
public:
    struct File {
        std::string content_type;
        std::string body;
    };

    /// Reads the console's files from `dir`, or when it is empty from <dir of the running
    /// executable>/console, else <that>/../share/sandboxd/console. A missing file leaves the
    /// console unavailable: problem() says which (the daemon still starts).
    static ConsoleAssets load(const std::string& dir);

    /// The file for a request path under /console ("/console" and "/console/" are
    /// index.html); nullptr for any other name.
    const File* find(std::string_view target) const;
    bool available() const { return problem_.empty(); }
    const std::string& problem() const { return problem_; }
    const std::string& dir() const { return dir_; }

private:
    std::map<std::string, File, std::less<>> files_;
    std::string problem_ = "not loaded";
    std::string dir_;
};

/// The Content-Security-Policy of the console's responses: its own origin only (scripts,
/// styles, connections); inline styles are allowed because xterm.js's renderer writes its own
/// <style> elements, no inline script is.
inline constexpr std::string_view console_csp =
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; font-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'";

/// The token of a `sandboxd.bearer.<base64url>` item of a Sec-WebSocket-Protocol header, or
/// nullopt when there is none or it does not decode (unpadded base64url, RFC 4648 section 5).
std::optional<std::string> bearer_from_subprotocols(std::string_view header);

/// Whether `origin` (an Origin header: scheme://host[:port]) names the same host and port as
/// `host` (the request's Host header), compared without case: the check of a browser's
/// connection, so that another site's page cannot use a token it was given.
bool origin_matches_host(std::string_view origin, std::string_view host);

}  // namespace sandboxd
