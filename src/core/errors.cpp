#include <sandboxd/core/errors.hpp>

#include <array>

namespace sandboxd {
namespace {

struct ErrorInfo {
    int code;
    std::string_view reason;
};

constexpr std::array<ErrorInfo, 21> error_table = {{
    {0, "UNKNOWN"},
    {-32700, "PARSE_ERROR"},
    {-32600, "INVALID_REQUEST"},
    {-32601, "METHOD_NOT_FOUND"},
    {-32602, "INVALID_PARAMS"},
    {-32603, "INTERNAL_ERROR"},
    {-32010, "LEASE_INCOMPLETE"},
    {-32011, "SANDBOX_NOT_CACHED"},
    {-32012, "LEASE_NOT_FOUND"},
    {-32013, "LEASE_NOT_ACTIVE"},
    {-32014, "OWNER_UNAVAILABLE"},
    {-32015, "OWNER_ELSEWHERE"},
    {-32016, "CHANNEL_LIMIT"},
    {-32017, "PROVIDER_ERROR"},
    {-32018, "PROVIDER_NOT_READY"},
    {-32019, "CHANNEL_NOT_FOUND"},
    {-32020, "FLOW_CONTROL"},
    {-32021, "REGISTRY_UNAVAILABLE"},
    {-32022, "ROUTING_LOOP"},
    {-32023, "FORBIDDEN"},
    {-32024, "CHANNEL_ATTACHED"},
}};

const ErrorInfo& info(errc e) noexcept {
    auto i = static_cast<std::size_t>(e);
    return i < error_table.size() ? error_table[i] : error_table[0];
}

class category final : public std::error_category {
public:
    const char* name() const noexcept override { return "sandboxd"; }
    std::string message(int ev) const override {
        return std::string(info(static_cast<errc>(ev)).reason);
    }
};

}  // namespace

const std::error_category& sandboxd_category() noexcept {
    static const category instance;
    return instance;
}

std::error_code make_error_code(errc e) noexcept {
    return {static_cast<int>(e), sandboxd_category()};
}

int rpc_code(errc e) noexcept { return info(e).code; }
std::string_view reason(errc e) noexcept { return info(e).reason; }

std::string lease_not_active_message(std::string_view lease_id) {
    return "Sandbox lease " + std::string(lease_id) + " is no longer active.";
}

rpc_error::rpc_error(errc code, std::string message, nlohmann::json data)
    : std::runtime_error(message), code_(code), data_(std::move(data)) {
    if (!data_.is_object()) data_ = nlohmann::json::object();
}

nlohmann::json rpc_error::to_json() const {
    nlohmann::json data = data_;
    data["reason"] = std::string(reason(code_));
    return {{"code", rpc_code(code_)}, {"message", what()}, {"data", std::move(data)}};
}

}  // namespace sandboxd
