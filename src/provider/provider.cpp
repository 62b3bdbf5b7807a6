/// @file provider.cpp
/// The Provider interface's defaults that are coroutines.

#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/provider.hpp>

namespace sandboxd {

awaitable<std::shared_ptr<SandboxHandle>> Provider::resume(Lease lease) {
    // Built-in providers keep nothing outside the process that made the sandbox: fail closed.
    throw rpc_error(errc::sandbox_not_cached, std::string(sandbox_not_cached_message),
                    {{"leaseId", lease.id}});
    co_return nullptr;
}

}  // namespace sandboxd
