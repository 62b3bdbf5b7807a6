#pragma once
// An in-memory Provider and ChannelBackend for unit tests of the code above the sandbox side
// (LeaseService, the sweeper, the channel): fakes of a dependency, never of the thing under
// test.
//
// FakeProvider follows include/sandboxd/provider/provider.hpp: create() mints a providerLeaseId
// ("fake-<n>") and records a live sandbox, destroy() removes it (idempotent), and every call
// completes at once on the awaiting coroutine's executor. Tests read what it was asked to do
// (`creates`, `destroys`, `live()`, the last config) and can make create() or destroy() throw
// the errors its contract names. Thread-safe (one mutex; nothing awaits under it).
//
// FakeChannelBackend follows include/sandboxd/provider/channel_backend.hpp for a command that has
// already written `out`/`err` and ended with `exit`: its output streams hold those bytes
// and then end, stdin is collected in `stdin_bytes` until close_stdin(), and signals are
// recorded. Single-threaded like every backend (the executor of the open()).
#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/provider.hpp>

#include <boost/asio/post.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace sandboxd::test {

class FakeChannelBackend final : public ChannelBackend {
public:
    FakeChannelBackend(std::string out, std::string err, ChannelExit exit, bool stdin_open = true)
        : out_(std::move(out)),
          err_(std::move(err)),
          exit_(std::move(exit)),
          stdin_open_(stdin_open) {}

    std::string stdin_bytes;    ///< every byte written to stdin, in order
    bool stdin_closed = false;  ///< close_stdin() was called
    std::vector<int> signals;   ///< signal() and signal_all() arguments, in order
    bool killed = false;        ///< kill() was called

    bool has_output(output_stream) const noexcept override { return true; }
    bool has_stdin() const noexcept override { return true; }

    void notify_output_ready(output_stream stream, std::shared_ptr<ChannelEvents> to) override {
        auto executor = to->events_executor();
        boost::asio::post(executor, [this, stream, to = std::move(to)] {
            to->output_ready(stream, pending(stream).size());
        });
    }
    std::optional<std::size_t> read_output(output_stream stream, std::span<char> into) override {
        auto& bytes = pending(stream);
        if (bytes.empty()) return std::nullopt;
        const auto n = std::min(bytes.size(), into.size());
        std::memcpy(into.data(), bytes.data(), n);
        bytes.erase(0, n);
        return n;
    }
    awaitable<bool> write_stdin(std::string data) override {
        if (!stdin_open_ || stdin_closed || killed) co_return false;
        stdin_bytes += data;
        co_return true;
    }
    void close_stdin() noexcept override { stdin_closed = true; }
    void signal(int sig) noexcept override { signals.push_back(sig); }
    void signal_all(int sig) noexcept override { signals.push_back(sig); }
    void kill() noexcept override { killed = true; }
    void resize(std::uint16_t cols, std::uint16_t rows) override { size_ = PtySize{cols, rows}; }
    void notify_exit(std::shared_ptr<ChannelEvents> to) override {
        auto executor = to->events_executor();
        boost::asio::post(executor, [this, to = std::move(to)] { to->exited(exit_); });
    }
    void notify_gone(std::shared_ptr<ChannelEvents> to) override {
        auto executor = to->events_executor();
        boost::asio::post(executor, [to = std::move(to)] { to->gone(); });
    }

    std::optional<PtySize> size_for_test() const { return size_; }

private:
    std::string& pending(output_stream s) { return s == output_stream::out ? out_ : err_; }

    std::string out_;
    std::string err_;
    ChannelExit exit_;
    bool stdin_open_;
    std::optional<PtySize> size_;
};

class FakeProvider final : public Provider {
public:
    explicit FakeProvider(std::string key = "fake", std::string plugin_id = "builtin")
        : key_(std::move(key)), plugin_id_(std::move(plugin_id)) {}

    /// Counters of calls made (whatever their outcome).
    std::atomic<int> creates{0};
    std::atomic<int> destroys{0};
    std::atomic<int> opens{0};
    std::atomic<int> stops{0};
    std::atomic<int> resumes{0};
    /// can_retain(): stop() keeps the sandbox, resume() brings back one that is still live.
    bool retainable = false;

    /// When set, create() throws rpc_error with this code (and makes nothing).
    std::optional<errc> create_error;
    /// When set, destroy() throws rpc_error with this code (and removes nothing).
    std::optional<errc> destroy_error;
    /// handle_for_teardown() returns a handle for any scope (a provider that can tear down
    /// by scope, like bwrap after a restart) rather than nullptr.
    bool teardown_by_scope = true;
    /// The limits create() reports on each handle.
    nlohmann::json limits = {{"memoryBytes", 268435456}, {"pids", 128}};

    const std::string& key() const noexcept override { return key_; }
    const std::string& plugin_id() const noexcept override { return plugin_id_; }

    awaitable<std::shared_ptr<SandboxHandle>> create(Lease lease) override {
        SandboxScope scope{lease.provider, lease.company_id, lease.environment_id, ""};
        std::string lease_id = std::move(lease.id);
        nlohmann::json config = std::move(lease.config);
        ++creates;
        if (create_error) throw rpc_error(*create_error, "fake provider: create refused");
        auto handle = std::make_shared<SandboxHandle>();
        {
            std::lock_guard lock(mutex_);
            scope.provider_lease_id = "fake-" + std::to_string(++minted_);
            live_.insert(scope.provider_lease_id);
            last_config_ = config;
            last_lease_id_ = lease_id;
        }
        handle->scope = std::move(scope);
        handle->lease_id = std::move(lease_id);
        handle->workspace = "/nonexistent/fake-workspace";
        handle->limits = limits;
        co_return handle;
    }

    awaitable<void> destroy(std::shared_ptr<SandboxHandle> sandbox) override {
        ++destroys;
        if (destroy_error) throw rpc_error(*destroy_error, "fake provider: destroy failed");
        std::lock_guard lock(mutex_);
        live_.erase(sandbox->scope.provider_lease_id);
        destroyed_.push_back(sandbox->scope.provider_lease_id);
        co_return;
    }

    awaitable<std::unique_ptr<ChannelBackend>> open(std::shared_ptr<SandboxHandle> sandbox,
                                                    ExecSpec spec) override {
        ++opens;
        {
            std::lock_guard lock(mutex_);
            if (!live_.count(sandbox->scope.provider_lease_id)) {
                throw rpc_error(errc::provider_error, "fake provider: the sandbox is gone");
            }
        }
        ChannelExit exit;
        exit.exit_code = 0;
        co_return std::make_unique<FakeChannelBackend>(spec.argv.empty() ? "" : spec.argv[0], "",
                                                       exit);
    }

    bool can_retain() const noexcept override { return retainable; }

    awaitable<void> stop(std::shared_ptr<SandboxHandle> sandbox) override {
        if (!retainable) co_await Provider::stop(std::move(sandbox));
        ++stops;
        co_return;
    }

    awaitable<std::shared_ptr<SandboxHandle>> resume(Lease lease) override {
        ++resumes;
        {
            std::lock_guard lock(mutex_);
            if (!retainable || !live_.count(lease.provider_lease_id)) {
                throw rpc_error(errc::sandbox_not_cached, "fake provider: nothing to resume");
            }
        }
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = scope_of(lease);
        handle->lease_id = lease.id;
        handle->limits = limits;
        co_return handle;
    }

    std::shared_ptr<SandboxHandle> handle_for_teardown(const Lease& lease) override {
        if (!teardown_by_scope) return nullptr;
        auto handle = std::make_shared<SandboxHandle>();
        handle->scope = {lease.provider, lease.company_id, lease.environment_id,
                         lease.provider_lease_id};
        handle->lease_id = lease.id;
        return handle;
    }

    // ---- test helpers (not part of Provider) ----

    /// The sandbox `provider_lease_id` vanished (resume() fails for it from now on).
    void lose(const std::string& provider_lease_id) {
        std::lock_guard lock(mutex_);
        live_.erase(provider_lease_id);
    }
    /// providerLeaseIds of sandboxes created and not destroyed.
    std::set<std::string> live() const {
        std::lock_guard lock(mutex_);
        return live_;
    }
    /// providerLeaseIds passed to a destroy() that succeeded, in order (repeats included).
    std::vector<std::string> destroyed() const {
        std::lock_guard lock(mutex_);
        return destroyed_;
    }
    nlohmann::json last_config() const {
        std::lock_guard lock(mutex_);
        return last_config_;
    }
    std::string last_lease_id() const {
        std::lock_guard lock(mutex_);
        return last_lease_id_;
    }

private:
    std::string key_;
    std::string plugin_id_;
    mutable std::mutex mutex_;
    int minted_ = 0;
    std::set<std::string> live_;
    std::vector<std::string> destroyed_;
    nlohmann::json last_config_;
    std::string last_lease_id_;
};

}  // namespace sandboxd::test
