#pragma once
// The node's credentials and TLS material (docs/protocol.md section 7, docs/security.md),
// built from the config at start and again at each reload: the tokens (auth.tokens, or the
// generated admin token), the listener's TLS context, the peers' and the registry's client
// contexts. Reads files; no shared state.
#include "server/node.hpp"

#include <sandboxd/core/config.hpp>

#include <string>

namespace sandboxd {

/// The secret in `path`, trailing whitespace trimmed. config_error when it cannot be read or
/// is empty.
std::string read_secret_file(const std::string& path);

/// The tokens and the TLS material of `c` (files read now): config_error naming the field and
/// file when one cannot be used. `admin_token_path`: the generated token, when c has none.
Security build_security(const Config& c, const std::string& admin_token_path);

/// Whether two credentials are the same grant (secret, name, role, tenants, node, metrics):
/// a reload keeps the connections of a token whose grant did not change.
bool same_grant(const Principal& a, const Principal& b);

}  // namespace sandboxd
