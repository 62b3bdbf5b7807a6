// Daemon::reload (SIGHUP; docs/protocol.md section 7): reopens the audit file, reads the
// tokens and TLS files again, closes the connections of tokens that are gone, and says which
// other changes wait for a restart.
#include "server/daemon_impl.hpp"
#include "server/security_setup.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace sandboxd {
namespace {

/// Logs the changes of `next` over `running` that a reload does not apply: everything but the
/// tokens and the TLS files (config_restart_sections: the config's key table says which keys
/// a reload applies).
void warn_restart_changes(const std::string& node_id, const Config& running, const Config& next) {
    std::string keys;
    for (const auto& k : config_restart_sections(running, next))
        keys += (keys.empty() ? "" : ", ") + k;
    if (!keys.empty()) {
        spdlog::warn("node={} reload: changes to {} are not applied until a restart", node_id,
                     keys);
    }
}

}  // namespace

bool Daemon::reload(const Config& next) {
    auto& node = impl_->node;
    // The audit file first, whatever becomes of the rest: logrotate moved it away.
    if (node.audit) {
        if (auto problem = node.audit->reopen(); !problem.empty()) {
            spdlog::error(
                "node={} reload: cannot reopen the audit file, lines go to the old one: {}",
                node.node_id, problem);
        }
    }
    std::shared_ptr<const Security> fresh;
    try {
        validate_config(next);
        fresh = std::make_shared<const Security>(build_security(next, impl_->token_path));
    } catch (const std::exception& e) {
        spdlog::error("node={} reload failed, keeping the tokens and certificates in use: {}",
                      node.node_id, e.what());
        return false;
    }
    warn_restart_changes(node.node_id, node.config, next);
    if ((fresh->listener_tls != nullptr) != (node.security()->listener_tls != nullptr)) {
        // A listener cannot turn TLS on or off under its connections.
        spdlog::error("node={} reload failed: tls cannot be turned {} without a restart",
                      node.node_id, fresh->listener_tls ? "on" : "off");
        return false;
    }
    const auto old = node.security();
    node.set_security(fresh);
    const auto granted = [](const Security& s, const Principal& p) {
        return std::any_of(s.credentials.begin(), s.credentials.end(),
                           [&](const Credential& c) { return same_grant(c.principal, p); });
    };
    std::size_t added = 0;
    std::size_t revoked = 0;
    for (const auto& c : fresh->credentials) added += granted(*old, c.principal) ? 0 : 1;
    for (const auto& c : old->credentials) revoked += granted(*fresh, c.principal) ? 0 : 1;
    std::size_t closed = 0;
    impl_->sessions.for_each([&](Session& session) {
        if (granted(*fresh, session.principal())) return;
        session.revoke();
        ++closed;
    });
    spdlog::info(
        "node={} reloaded: {} tokens ({} added, {} revoked; {} connections closed), TLS {}",
        node.node_id, fresh->credentials.size(), added, revoked, closed,
        fresh->listener_tls ? "certificate and key read again" : "off");
    return true;
}

}  // namespace sandboxd
