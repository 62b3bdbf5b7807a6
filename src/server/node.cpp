#include "server/node.hpp"

#include <sandboxd/core/errors.hpp>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <chrono>

namespace sandboxd {

nlohmann::json forwarded_for(const Principal& who) {
    return {{"tokenName", who.name}, {"tenants", who.tenants}};
}

bool Principal::allows(const std::string& company_id) const {
    return std::any_of(tenants.begin(), tenants.end(),
                       [&](const std::string& t) { return t == "*" || t == company_id; });
}

std::vector<std::string> Principal::query_tenants() const {
    if (std::find(tenants.begin(), tenants.end(), "*") != tenants.end()) return {};
    return tenants;
}

std::vector<std::string> intersect_tenants(const std::vector<std::string>& forwarded,
                                           const std::vector<std::string>& own) {
    const auto has_star = [](const std::vector<std::string>& v) {
        return std::find(v.begin(), v.end(), "*") != v.end();
    };
    const auto unique = [](const std::vector<std::string>& v) {
        std::vector<std::string> out;
        for (const auto& t : v) {
            if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
        }
        return out;
    };
    if (has_star(own)) return unique(forwarded);
    if (has_star(forwarded)) return unique(own);
    std::vector<std::string> out;
    for (const auto& t : forwarded) {
        if (std::find(own.begin(), own.end(), t) != own.end() &&
            std::find(out.begin(), out.end(), t) == out.end()) {
            out.push_back(t);
        }
    }
    return out;
}

std::array<unsigned char, 32> token_hash(std::string_view secret) {
    std::array<unsigned char, 32> out{};
    unsigned int n = 0;
    if (EVP_Digest(secret.data(), secret.size(), out.data(), &n, EVP_sha256(), nullptr) != 1 ||
        n != out.size()) {
        throw std::runtime_error("SHA-256 failed");
    }
    return out;
}

std::shared_ptr<const Security> Node::security() const {
    std::lock_guard lock(security_mutex_);
    return security_;
}

void Node::set_security(std::shared_ptr<const Security> next) {
    std::lock_guard lock(security_mutex_);
    security_ = std::move(next);
}

std::optional<Principal> Node::authenticate(std::string_view bearer_token) const {
    // Hashing first makes every comparison the same length; CRYPTO_memcmp takes the same
    // time wherever the bytes differ, and every credential is compared.
    const auto presented = token_hash(bearer_token);
    const auto current = security();
    const Principal* found = nullptr;
    for (const auto& c : current->credentials) {
        const bool same =
            CRYPTO_memcmp(c.principal.token_sha256.data(), presented.data(), presented.size()) == 0;
        if (same && !found) found = &c.principal;
    }
    if (!found) return std::nullopt;
    return *found;
}

bool ChannelTable::try_reserve(std::size_t limit) {
    std::lock_guard lock(mutex_);
    if (entries_.size() + reserved_ >= limit) return false;
    ++reserved_;
    return true;
}

void ChannelTable::unreserve() {
    std::lock_guard lock(mutex_);
    if (reserved_ > 0) --reserved_;
}

std::uint64_t ChannelTable::add(Entry entry) {
    std::lock_guard lock(mutex_);
    if (reserved_ > 0) --reserved_;
    auto key = next_key_++;
    entries_.emplace(key, std::move(entry));
    return key;
}

void ChannelTable::remove(std::uint64_t key) {
    std::vector<std::shared_ptr<RemovalSignal>> wake;
    {
        std::lock_guard lock(mutex_);
        entries_.erase(key);
        std::erase_if(removal_watchers_, [&](const std::weak_ptr<RemovalSignal>& w) {
            auto signal = w.lock();
            if (!signal) return true;
            wake.push_back(std::move(signal));
            return false;
        });
    }
    for (auto& signal : wake) signal->try_send(boost::system::error_code{});  // full: coalesced
}

void ChannelTable::watch_removals(const std::shared_ptr<RemovalSignal>& signal) {
    std::lock_guard lock(mutex_);
    std::erase_if(removal_watchers_, [](const auto& w) { return w.expired(); });
    removal_watchers_.push_back(signal);
}

std::size_t ChannelTable::size() const {
    std::lock_guard lock(mutex_);
    return entries_.size();
}

std::size_t ChannelTable::kept() const {
    std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(std::count_if(entries_.begin(), entries_.end(),
                                                  [](const auto& e) { return e.second.kept; }));
}

void ChannelTable::clear() {
    std::map<std::uint64_t, Entry> gone;
    std::lock_guard lock(mutex_);
    gone.swap(entries_);
}

bool Node::keeps_across_restart() const {
    if (decommissioning.load()) return false;
    return std::any_of(providers.begin(), providers.end(),
                       [](const auto& p) { return p.second->outlives_daemon(); });
}

std::vector<ChannelTable::Entry> ChannelTable::all() const {
    std::lock_guard lock(mutex_);
    std::vector<Entry> out;
    out.reserve(entries_.size());
    for (const auto& [key, e] : entries_) out.push_back(e);
    return out;
}

std::vector<ChannelTable::Entry> ChannelTable::of_lease(const std::string& lease_id) const {
    std::lock_guard lock(mutex_);
    std::vector<Entry> out;
    for (const auto& [key, e] : entries_) {
        if (e.lease_id == lease_id) out.push_back(e);
    }
    return out;
}

std::int64_t steady_now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

std::int64_t Node::fenced_for_ms() const {
    const auto now = steady_now_ms();
    return now > fence_deadline_ms() ? now - renewed_at_ms.load(std::memory_order_acquire) : 0;
}

std::int64_t Node::fence_deadline_ms() const {
    return renewed_at_ms.load(std::memory_order_acquire) +
           static_cast<std::int64_t>(config.node_ttl_ms) * 2 / 3;
}

bool Node::may_retry_start(std::int64_t deadline, std::uint64_t breaks) const {
    const std::int64_t now = steady_now_ms();
    const std::int64_t next = fence_deadline_ms();
    return membership_breaks.load(std::memory_order_acquire) == breaks && next > deadline &&
           next > now;
}

void Node::require_membership() const {
    if (const auto age = fenced_for_ms()) {
        throw rpc_error(errc::registry_unavailable,
                        "Node " + node_id + " has not renewed its registry membership for " +
                            std::to_string(age) + " ms (fencing after 2/3 of nodeTtlMs " +
                            std::to_string(config.node_ttl_ms) +
                            " ms): it serves no opens and no lease changes until it renews.",
                        {{"nodeId", node_id}});
    }
}

void Node::claim(const std::string& lease_id, std::int64_t epoch) {
    std::lock_guard lock(claims_mutex_);
    claims_[lease_id] = epoch;
}

std::optional<std::int64_t> Node::claim_of(const std::string& lease_id) const {
    std::lock_guard lock(claims_mutex_);
    auto it = claims_.find(lease_id);
    if (it == claims_.end()) return std::nullopt;
    return it->second;
}

void Node::unclaim(const std::string& lease_id) {
    std::lock_guard lock(claims_mutex_);
    claims_.erase(lease_id);
}

awaitable<KeyedLocks::Guard> KeyedLocks::lock(std::string key) {
    auto executor = co_await net::this_coro::executor;
    std::shared_ptr<Gate> gate;
    bool waited = false;
    {
        std::lock_guard lock(mutex_);
        std::erase_if(gates_, [](const auto& entry) { return entry.second.expired(); });
        auto& slot = gates_[key];
        gate = slot.lock();
        waited = gate != nullptr;  // a guard, or a waiter holding the gate, is alive
        if (!gate) {
            gate = std::make_shared<Gate>(executor, 1);
            slot = gate;
        }
    }
    co_await gate->async_send(boost::system::error_code{}, use_awaitable);  // waits while held
    /// Frees the gate for the next waiter when the last copy of the guard goes.
    struct Held {
        explicit Held(std::shared_ptr<Gate> g) : gate(std::move(g)) {}
        Held(const Held&) = delete;
        Held& operator=(const Held&) = delete;
        ~Held() {
            gate->try_receive([](boost::system::error_code) {});
        }
        std::shared_ptr<Gate> gate;
    };
    co_return Guard{std::make_shared<Held>(std::move(gate)), waited};
}

}  // namespace sandboxd
