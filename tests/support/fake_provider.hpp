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
// recorded. A test that drives a channel step by step makes it running() instead, and plays
// the command with write(), end_output() and finish(); the callback forms (notify_*()) report
// on the ChannelEvents' executor, never inside the call, as the contract says. Single-threaded
// like every backend (the executor of the open()).
#include <sandboxd/core/errors.hpp>
#include <sandboxd/provider/provider.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd::test {

class FakeChannelBackend final : public ChannelBackend {
public:
    FakeChannelBackend(std::string out, std::string err, ChannelExit exit, bool stdin_open = true)
        : out_(std::move(out)),
          err_(std::move(err)),
          exit_(std::move(exit)),
          stdin_open_(stdin_open) {}

    /// A command still running: nothing written yet, both streams open, no exit until
    /// finish().
    static std::unique_ptr<FakeChannelBackend> running() {
        auto b = std::make_unique<FakeChannelBackend>("", "", ChannelExit{});
        b->open_[0] = b->open_[1] = true;
        b->exited_ = false;
        return b;
    }

    std::string stdin_bytes;    ///< every byte written to stdin, in order
    bool stdin_closed = false;  ///< close_stdin() was called
    std::vector<int> signals;   ///< signal() and signal_all() arguments, in order
    bool killed = false;        ///< kill() was called

    bool has_output(output_stream) const noexcept override { return true; }
    bool has_stdin() const noexcept override { return true; }

    std::optional<std::size_t> read_output(output_stream stream, std::span<char> into) override {
        auto& bytes = pending(stream);
        if (bytes.empty()) {
            if (open(stream)) return 0;
            return std::nullopt;
        }
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
    void notify_output_ready(output_stream stream, std::shared_ptr<ChannelEvents> to) override {
        waiter(stream) = std::move(to);
        report_output(stream);
    }
    void notify_exit(std::shared_ptr<ChannelEvents> to) override {
        exit_waiter_ = std::move(to);
        report_end();
    }
    void notify_gone(std::shared_ptr<ChannelEvents> to) override {
        gone_waiter_ = std::move(to);
        report_end();
    }

    std::optional<PtySize> size_for_test() const { return size_; }

    // ---- playing a running() command (not part of ChannelBackend) ----

    /// When set, notify_gone() reports ended() before gone() (the early notice).
    bool report_ended = false;
    /// The command wrote `bytes` to `stream` (still open).
    void write(output_stream stream, std::string_view bytes) {
        pending(stream).append(bytes);
        report_output(stream);
    }
    /// The command closed `stream`: once its bytes are read, the stream has ended.
    void end_output(output_stream stream) {
        open(stream) = false;
        report_output(stream);
    }
    /// The command's main process ended with `exit`, and every process of it is gone.
    void finish(ChannelExit exit) {
        exit_ = std::move(exit);
        exited_ = true;
        report_end();
    }
    /// Bytes the command wrote to `stream` that nobody has read yet.
    std::size_t unread(output_stream stream) { return pending(stream).size(); }
    /// Whether a notify_output_ready() of `stream` waits for bytes or the stream's end.
    bool output_awaited(output_stream stream) { return waiter(stream) != nullptr; }
    /// Drops the ChannelEvents still waiting for a report (a test's teardown: the channel
    /// owns this backend, and a waiting report would keep it alive).
    void forget_events() {
        output_waiters_[0].reset();
        output_waiters_[1].reset();
        exit_waiter_.reset();
        gone_waiter_.reset();
    }

private:
    std::string& pending(output_stream s) { return s == output_stream::out ? out_ : err_; }
    bool& open(output_stream s) { return open_[s == output_stream::out ? 0 : 1]; }
    std::shared_ptr<ChannelEvents>& waiter(output_stream s) {
        return output_waiters_[s == output_stream::out ? 0 : 1];
    }

    void report_output(output_stream stream) {
        auto& to = waiter(stream);
        if (!to || (pending(stream).empty() && open(stream))) return;
        const std::size_t bytes = pending(stream).size();
        auto executor = to->events_executor();
        boost::asio::post(executor,
                          [to = std::move(to), stream, bytes] { to->output_ready(stream, bytes); });
    }
    void report_end() {
        if (!exited_) return;
        if (exit_waiter_) {
            auto executor = exit_waiter_->events_executor();
            boost::asio::post(executor,
                              [to = std::move(exit_waiter_), exit = exit_] { to->exited(exit); });
        }
        if (gone_waiter_) {
            auto executor = gone_waiter_->events_executor();
            boost::asio::post(executor, [to = std::move(gone_waiter_), ended = report_ended] {
                if (ended) to->ended();
                to->gone();
            });
        }
    }

    std::string out_;
    std::string err_;
    ChannelExit exit_;
    bool stdin_open_;
    std::optional<PtySize> size_;
    bool open_[2] = {false, false};  ///< more bytes may come (running())
    bool exited_ = true;             ///< the main process has ended (exit_ is its report)
    std::shared_ptr<ChannelEvents> output_waiters_[2];
    std::shared_ptr<ChannelEvents> exit_waiter_;
    std::shared_ptr<ChannelEvents> gone_waiter_;
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
    /// outlives_daemon(): its sandboxes outlive their node's process (like bwrap's with
    /// adoptTimeoutMs), so a dead owner's leases get routing.adoptGraceMs.
    bool outlives = false;
    bool outlives_daemon() const noexcept override { return outlives; }

    /// When set, create() throws rpc_error with this code (and makes nothing).
    std::optional<errc> create_error;
    /// When set, destroy() throws rpc_error with this code (and removes nothing).
    std::optional<errc> destroy_error;
    /// handle_for_teardown() returns a handle for any scope (a provider that can tear down
    /// by scope, like bwrap after a restart) rather than nullptr.
    bool teardown_by_scope = true;
    /// The limits create() reports on each handle.
    nlohmann::json limits = {{"memoryBytes", 268435456}, {"pids", 128}};
    /// When set, open() waits for this timer (expiring at time_point::max()) to be cancelled
    /// before it opens: a test holds an open in flight and lets it go with cancel().
    std::shared_ptr<boost::asio::steady_timer> open_gate;
    /// When set, open() gives a command still running (FakeChannelBackend::running()) and
    /// keeps a pointer to it (the channel owns it), for the test to play: running_backends().
    bool open_running = false;
    std::vector<FakeChannelBackend*> running_backends() const {
        std::lock_guard lock(mutex_);
        return running_;
    }

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
        if (open_gate) {
            auto gate = open_gate;  // the test may reset open_gate meanwhile
            co_await gate->async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
        }
        {
            std::lock_guard lock(mutex_);
            if (!live_.count(sandbox->scope.provider_lease_id)) {
                throw rpc_error(errc::provider_error, "fake provider: the sandbox is gone");
            }
        }
        if (open_running) {
            auto backend = FakeChannelBackend::running();
            std::lock_guard lock(mutex_);
            running_.push_back(backend.get());
            co_return std::unique_ptr<ChannelBackend>(std::move(backend));
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
    std::vector<FakeChannelBackend*> running_;
    nlohmann::json last_config_;
    std::string last_lease_id_;
};

}  // namespace sandboxd::test
