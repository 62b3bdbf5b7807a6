#include "server/method_table.hpp"

#include "server/channel_service.hpp"
#include "server/lease_methods.hpp"
#include "server/methods.hpp"

#include <array>
#include <map>

namespace sandboxd {
namespace {

using json = nlohmann::json;

/// A handler of typed params: `Parse` reads and checks the JSON params once (INVALID_PARAMS
/// naming the field), then `Run` gets the typed value.
template <typename Params, Params (*Parse)(const Node&, const json&),
          awaitable<MethodReply> (*Run)(Connection&, MethodCall&, Params)>
awaitable<MethodReply> typed(Connection& c, MethodCall call) {
    Params params = Parse(c.node(), call.params);
    co_return co_await Run(c, call, std::move(params));
}

// The parse functions of methods.hpp, given what of the node's config they need.
methods::InitializeParams parse_initialize(const Node&, const json& p) {
    return methods::parse_initialize(p);
}
methods::LeaseAcquireParams parse_acquire(const Node& n, const json& p) {
    return methods::parse_lease_acquire(p, n.config.limits.max_ttl_ms);
}
LeaseQuery parse_list(const Node&, const json& p) { return methods::parse_lease_list(p); }
methods::LeaseIdParams parse_lease_id(const Node&, const json& p) {
    return methods::parse_lease_id(p);
}
methods::LeaseRenewParams parse_renew(const Node&, const json& p) {
    return methods::parse_lease_renew(p);
}
methods::LeaseReleaseParams parse_release(const Node&, const json& p) {
    return methods::parse_lease_release(p);
}
methods::LeaseUpdateNetworkParams parse_update_network(const Node&, const json& p) {
    return methods::parse_lease_update_network(p);
}
methods::ExecuteParams parse_execute(const Node& n, const json& p) {
    return methods::parse_execute(p, n.config.limits.execute_timeout_ms);
}
methods::RealizeWorkspaceParams parse_workspace(const Node&, const json& p) {
    return methods::parse_realize_workspace(p);
}
methods::ValidateConfigParams parse_validate(const Node&, const json& p) {
    return methods::parse_validate_config(p);
}
handlers::NoParams parse_none(const Node&, const json&) { return {}; }
methods::OpenParams parse_open(const Node& n, const json& p) {
    const auto& l = n.config.limits;
    return methods::parse_open(p, l.max_output_window, l.max_stdin_window,
                               {l.detach_retain_ms, l.max_detach_retain_ms, l.detach_retain_bytes,
                                l.max_detach_retain_bytes});
}
methods::AttachParams parse_attach(const Node& n, const json& p) {
    return methods::parse_attach(p, n.config.limits.max_output_window);
}
methods::WriteParams parse_write(const Node&, const json& p) { return methods::parse_write(p); }
methods::ChannelParams parse_channel(const Node&, const json& p) {
    return methods::parse_channel(p);
}
methods::ResizeParams parse_resize(const Node&, const json& p) { return methods::parse_resize(p); }
methods::SignalParams parse_signal(const Node&, const json& p) { return methods::parse_signal(p); }

constexpr unsigned lease_change = fenced | forwarded | lease_operation;
constexpr unsigned channel_call = on_channel | forwarded;

// In the protocol's order (initialize lists them so).
const std::array<MethodSpec, 21> table{{
    {"initialize", 0, typed<methods::InitializeParams, parse_initialize, handlers::initialize>},
    {"leaseAcquire", fenced | lease_operation,
     typed<methods::LeaseAcquireParams, parse_acquire, handlers::lease_acquire>},
    {"leaseGet", forwarded | lease_operation,
     typed<methods::LeaseIdParams, parse_lease_id, handlers::lease_get>},
    {"leaseList", lease_operation, typed<LeaseQuery, parse_list, handlers::lease_list>},
    {"leaseRenew", lease_change,
     typed<methods::LeaseRenewParams, parse_renew, handlers::lease_renew>},
    {"leaseRelease", lease_change,
     typed<methods::LeaseReleaseParams, parse_release, handlers::lease_release>},
    {"leaseProbe", lease_change,
     typed<methods::LeaseIdParams, parse_lease_id, handlers::lease_probe>},
    {"leaseExecute", lease_change,
     typed<methods::ExecuteParams, parse_execute, handlers::lease_execute>},
    {"leaseRealizeWorkspace", lease_change,
     typed<methods::RealizeWorkspaceParams, parse_workspace, handlers::lease_realize_workspace>},
    {"leaseUpdateNetwork", lease_change,
     typed<methods::LeaseUpdateNetworkParams, parse_update_network,
           handlers::lease_update_network>},
    {"providerValidateConfig", 0,
     typed<methods::ValidateConfigParams, parse_validate, handlers::provider_validate_config>},
    {"nodeList", 0, typed<handlers::NoParams, parse_none, handlers::node_list>},
    {"duplexChannelOpen", fenced | forwarded | opens_channel,
     typed<methods::OpenParams, parse_open, handlers::channel_open>},
    {"duplexChannelWrite", channel_call | moot_after_exit,
     typed<methods::WriteParams, parse_write, handlers::channel_write>},
    {"duplexChannelCloseStdin", channel_call | moot_after_exit,
     typed<methods::ChannelParams, parse_channel, handlers::channel_close_stdin>},
    {"duplexChannelResize", channel_call,
     typed<methods::ResizeParams, parse_resize, handlers::channel_resize>},
    {"duplexChannelSignal", channel_call,
     typed<methods::SignalParams, parse_signal, handlers::channel_signal>},
    {"duplexChannelStop", channel_call,
     typed<methods::ChannelParams, parse_channel, handlers::channel_stop>},
    {"duplexChannelClose", channel_call | ends_channel,
     typed<methods::ChannelParams, parse_channel, handlers::channel_close>},
    {"duplexChannelAttach", forwarded | opens_channel,
     typed<methods::AttachParams, parse_attach, handlers::channel_attach>},
    {"duplexChannelList", forwarded,
     typed<methods::LeaseIdParams, parse_lease_id, handlers::channel_list>},
}};

}  // namespace

std::span<const MethodSpec> method_table() { return table; }

const MethodSpec* find_method(std::string_view name) {
    static const auto by_name = [] {
        std::map<std::string_view, const MethodSpec*> m;
        for (const auto& spec : table) m.emplace(spec.name, &spec);
        return m;
    }();
    const auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
}

}  // namespace sandboxd
