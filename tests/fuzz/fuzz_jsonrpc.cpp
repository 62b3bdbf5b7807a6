// libFuzzer target: the JSON-RPC request parser (src/core/jsonrpc.cpp) and every host method's
// params parser (src/server/methods.hpp). The contract: any text frame is a Request or an
// Invalid with an error; any params either parse or throw rpc_error (INVALID_PARAMS naming a
// field). Any other exception, or a crash, is a finding.
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/jsonrpc.hpp>

#include "server/methods.hpp"

#include <cstdlib>
#include <string>

namespace {

using sandboxd::rpc_error;
using json = nlohmann::json;
namespace m = sandboxd::methods;

template <typename F>
void expect_rpc_error_or_success(F parse) {
    try {
        parse();
    } catch (const rpc_error& e) {
        if (std::string(e.what()).empty()) std::abort();
    }
    // Anything else propagates: libFuzzer reports the uncaught exception as a crash.
}

void every_method(const json& raw) {
    json p;
    try {
        p = m::params_object(raw);
    } catch (const rpc_error&) {
        return;
    }
    expect_rpc_error_or_success([&] { m::parse_initialize(p); });
    expect_rpc_error_or_success([&] { m::parse_lease_acquire(p, 86400000); });
    expect_rpc_error_or_success([&] { m::parse_lease_list(p); });
    expect_rpc_error_or_success([&] { m::parse_lease_id(p); });
    expect_rpc_error_or_success([&] { m::parse_lease_release(p); });
    expect_rpc_error_or_success([&] { m::parse_validate_config(p); });
    expect_rpc_error_or_success([&] { m::parse_execute(p, 300000); });
    expect_rpc_error_or_success([&] { m::parse_realize_workspace(p); });
    expect_rpc_error_or_success([&] { m::parse_lease_renew(p); });
    expect_rpc_error_or_success([&] { m::parse_channel(p); });
    expect_rpc_error_or_success([&] { m::parse_write(p); });
    expect_rpc_error_or_success([&] { m::parse_resize(p); });
    expect_rpc_error_or_success([&] { m::parse_signal(p); });
    expect_rpc_error_or_success([&] { m::parse_open(p); });
    expect_rpc_error_or_success([&] { (void)m::channel_named(p); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    auto parsed = sandboxd::jsonrpc::parse_request(text, 1 << 20);
    if (auto* bad = std::get_if<sandboxd::jsonrpc::Invalid>(&parsed)) {
        // Every invalid request has an answer that serializes, whatever bytes it quoted.
        if (sandboxd::jsonrpc::error(bad->id, bad->error.to_json()).empty()) std::abort();
        return 0;
    }
    every_method(std::get<sandboxd::jsonrpc::Request>(parsed).params);
    return 0;
}
