#include "registry/cursor.hpp"

#include <sandboxd/errors.hpp>
#include <sandboxd/registry.hpp>

#include <sqlite3.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <string_view>
#include <system_error>
#include <utility>

namespace sandboxd {
namespace {

constexpr int schema_version = 2;
constexpr int busy_timeout_ms = 5000;
constexpr std::size_t max_page = 1000;

[[noreturn]] void throw_unavailable(std::string_view op, std::string_view detail) {
    throw rpc_error(errc::registry_unavailable,
                    "registry: " + std::string(op) + ": " + std::string(detail));
}

[[noreturn]] void throw_sqlite(sqlite3* db, std::string_view op) {
    throw_unavailable(op, db != nullptr ? sqlite3_errmsg(db) : "out of memory");
}

struct db_closer {
    void operator()(sqlite3* db) const noexcept { sqlite3_close_v2(db); }
};
using db_ptr = std::unique_ptr<sqlite3, db_closer>;

struct stmt_finalizer {
    void operator()(sqlite3_stmt* s) const noexcept { sqlite3_finalize(s); }
};
using stmt_ptr = std::unique_ptr<sqlite3_stmt, stmt_finalizer>;

/// A prepared statement; `op` names the registry operation in error messages. Parameters
/// are bound in order with bind(); columns are read by index.
class Statement {
public:
    Statement(sqlite3* db, std::string_view sql, std::string_view op) : db_(db), op_(op) {
        sqlite3_stmt* raw = nullptr;
        if (sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &raw, nullptr) !=
            SQLITE_OK) {
            sqlite3_finalize(raw);
            throw_sqlite(db, op_);
        }
        stmt_.reset(raw);
    }

    Statement& bind(std::string_view text) {
        check(sqlite3_bind_text64(stmt_.get(), next_++, text.data(), text.size(), SQLITE_TRANSIENT,
                                  SQLITE_UTF8));
        return *this;
    }
    Statement& bind(const std::string& text) { return bind(std::string_view(text)); }
    Statement& bind(std::int64_t value) {
        check(sqlite3_bind_int64(stmt_.get(), next_++, value));
        return *this;
    }
    Statement& bind(const std::optional<std::string>& text) {
        return text ? bind(std::string_view(*text)) : bind_null();
    }
    Statement& bind(const std::optional<std::int64_t>& value) {
        return value ? bind(*value) : bind_null();
    }
    Statement& bind_null() {
        check(sqlite3_bind_null(stmt_.get(), next_++));
        return *this;
    }

    /// True when a row is available, false when the statement has finished.
    bool step() {
        int rc = sqlite3_step(stmt_.get());
        if (rc == SQLITE_ROW) return true;
        if (rc == SQLITE_DONE) return false;
        throw_sqlite(db_, op_);
    }
    void run() {
        while (step()) {
        }
    }

    bool is_null(int col) const { return sqlite3_column_type(stmt_.get(), col) == SQLITE_NULL; }
    std::int64_t int64(int col) const { return sqlite3_column_int64(stmt_.get(), col); }
    std::string text(int col) const {
        const auto* p = sqlite3_column_text(stmt_.get(), col);
        if (p == nullptr) return {};
        auto n = static_cast<std::size_t>(sqlite3_column_bytes(stmt_.get(), col));
        return std::string(reinterpret_cast<const char*>(p), n);
    }
    std::optional<std::string> opt_text(int col) const {
        if (is_null(col)) return std::nullopt;
        return text(col);
    }
    std::optional<std::int64_t> opt_int64(int col) const {
        if (is_null(col)) return std::nullopt;
        return int64(col);
    }

private:
    void check(int rc) {
        if (rc != SQLITE_OK) throw_sqlite(db_, op_);
    }

    sqlite3* db_;
    std::string_view op_;
    stmt_ptr stmt_;
    int next_ = 1;
};

void exec(sqlite3* db, const char* sql, std::string_view op) {
    if (sqlite3_exec(db, sql, nullptr, nullptr, nullptr) != SQLITE_OK) throw_sqlite(db, op);
}

/// BEGIN IMMEDIATE ... COMMIT; rolls back unless commit() succeeded.
class Transaction {
public:
    Transaction(sqlite3* db, std::string_view op) : db_(db), op_(op) {
        exec(db_, "BEGIN IMMEDIATE", op_);
    }
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    ~Transaction() {
        if (!done_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    }
    void commit() {
        exec(db_, "COMMIT", op_);
        done_ = true;
    }

private:
    sqlite3* db_;
    std::string_view op_;
    bool done_ = false;
};

constexpr const char* schema_sql = R"sql(
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY NOT NULL,
    company_id TEXT NOT NULL,
    environment_id TEXT NOT NULL,
    run_id TEXT,
    issue_id TEXT,
    heartbeat_run_id TEXT,
    execution_workspace_id TEXT,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    provider_lease_id TEXT NOT NULL,
    owner_node_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    acquired_at_ms INTEGER NOT NULL,
    last_used_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER,
    released_at_ms INTEGER,
    failure_reason TEXT,
    cleanup_status TEXT,
    metadata TEXT NOT NULL,
    idempotency_key TEXT,
    config TEXT NOT NULL,
    cleanup_attempts INTEGER NOT NULL DEFAULT 0,
    limits TEXT NOT NULL DEFAULT 'null'
) STRICT;
CREATE UNIQUE INDEX IF NOT EXISTS leases_idempotency
    ON leases (company_id, environment_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS leases_by_acquired ON leases (acquired_at_ms, id);
CREATE INDEX IF NOT EXISTS leases_by_company ON leases (company_id, acquired_at_ms, id);
CREATE INDEX IF NOT EXISTS leases_by_owner ON leases (owner_node_id, status, expires_at_ms);
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (status, expires_at_ms);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY NOT NULL,
    url TEXT NOT NULL,
    started_at_ms INTEGER NOT NULL,
    heartbeat_at_ms INTEGER NOT NULL,
    instance_id TEXT NOT NULL
) STRICT;
PRAGMA user_version = 2;
)sql";

// Column order of read_lease().
constexpr std::string_view lease_columns =
    "id, company_id, environment_id, run_id, issue_id, heartbeat_run_id, "
    "execution_workspace_id, status, provider, provider_lease_id, owner_node_id, epoch, "
    "acquired_at_ms, last_used_at_ms, expires_at_ms, released_at_ms, failure_reason, "
    "cleanup_status, metadata, idempotency_key, config, cleanup_attempts, limits";

constexpr std::string_view node_columns =
    "node_id, url, started_at_ms, heartbeat_at_ms, instance_id";

std::string select_leases(std::string_view where) {
    std::string sql = "SELECT ";
    sql += lease_columns;
    sql += " FROM leases ";
    sql += where;
    return sql;
}

nlohmann::json parse_json_column(const Statement& s, int col, std::string_view op,
                                 const std::string& lease_id) {
    try {
        return nlohmann::json::parse(s.text(col));
    } catch (const nlohmann::json::exception&) {
        throw_unavailable(op, "corrupt JSON in lease " + lease_id);
    }
}

Lease read_lease(const Statement& s, std::string_view op) {
    Lease l;
    l.id = s.text(0);
    l.company_id = s.text(1);
    l.environment_id = s.text(2);
    l.run_id = s.opt_text(3);
    l.issue_id = s.opt_text(4);
    l.heartbeat_run_id = s.opt_text(5);
    l.execution_workspace_id = s.opt_text(6);
    auto status = parse_lease_status(s.text(7));
    if (!status) throw_unavailable(op, "unknown status in lease " + l.id);
    l.status = *status;
    l.provider = s.text(8);
    l.provider_lease_id = s.text(9);
    l.owner_node_id = s.text(10);
    l.epoch = s.int64(11);
    l.acquired_at_ms = s.int64(12);
    l.last_used_at_ms = s.int64(13);
    l.expires_at_ms = s.opt_int64(14);
    l.released_at_ms = s.opt_int64(15);
    l.failure_reason = s.opt_text(16);
    l.cleanup_status = s.opt_text(17);
    l.metadata = parse_json_column(s, 18, op, l.id);
    l.idempotency_key = s.opt_text(19);
    l.config = parse_json_column(s, 20, op, l.id);
    l.cleanup_attempts = static_cast<int>(s.int64(21));
    l.limits = parse_json_column(s, 22, op, l.id);
    return l;
}

NodeRecord read_node(const Statement& s) {
    NodeRecord n;
    n.node_id = s.text(0);
    n.url = s.text(1);
    n.started_at_ms = s.int64(2);
    n.heartbeat_at_ms = s.int64(3);
    n.instance_id = s.text(4);
    return n;
}

class SqliteStore {
public:
    explicit SqliteStore(const std::string& path) {
        constexpr std::string_view op = "open";
        if (path.empty()) throw_unavailable(op, "empty path");
        auto parent = std::filesystem::path(path).parent_path();
        if (!parent.empty()) {
            std::error_code ec;
            std::filesystem::create_directories(parent, ec);
            if (ec) {
                throw_unavailable(
                    op, "cannot create directory " + parent.string() + ": " + ec.message());
            }
        }

        sqlite3* raw = nullptr;
        int rc = sqlite3_open_v2(path.c_str(), &raw,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                                 nullptr);
        db_.reset(raw);
        if (rc != SQLITE_OK) {
            throw_unavailable(
                op, path + ": " + (raw != nullptr ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)));
        }
        sqlite3_busy_timeout(db(), busy_timeout_ms);
        // journal_mode answers with a row (the resulting mode), so it is stepped, not exec'd.
        Statement(db(), "PRAGMA journal_mode=WAL", op).run();
        exec(db(), "PRAGMA synchronous=NORMAL", op);
        exec(db(), "PRAGMA foreign_keys=ON", op);

        constexpr std::string_view schema_op = "create schema";
        Transaction tx(db(), schema_op);
        Statement version(db(), "PRAGMA user_version", schema_op);
        std::int64_t found = version.step() ? version.int64(0) : 0;
        if (found > schema_version) {
            throw_unavailable(schema_op, "schema version " + std::to_string(found) +
                                             " is newer than " + std::to_string(schema_version));
        }
        if (found == 1) {
            // Version 1 had no limits column (issue 11 added it).
            exec(db(), "ALTER TABLE leases ADD COLUMN limits TEXT NOT NULL DEFAULT 'null'",
                 schema_op);
        }
        exec(db(), schema_sql, schema_op);
        tx.commit();
    }

    Lease create_lease(const Lease& lease) {
        constexpr std::string_view op = "create lease";
        std::lock_guard lock(mutex_);
        Transaction tx(db(), op);
        Statement insert(db(),
                         "INSERT INTO leases (id, company_id, environment_id, run_id, issue_id, "
                         "heartbeat_run_id, execution_workspace_id, status, provider, "
                         "provider_lease_id, owner_node_id, epoch, acquired_at_ms, "
                         "last_used_at_ms, expires_at_ms, released_at_ms, failure_reason, "
                         "cleanup_status, metadata, idempotency_key, config, cleanup_attempts, "
                         "limits) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                         "?, ?) ON CONFLICT (company_id, environment_id, idempotency_key) "
                         "WHERE idempotency_key IS NOT NULL DO NOTHING",
                         op);
        insert.bind(lease.id)
            .bind(lease.company_id)
            .bind(lease.environment_id)
            .bind(lease.run_id)
            .bind(lease.issue_id)
            .bind(lease.heartbeat_run_id)
            .bind(lease.execution_workspace_id)
            .bind(to_string(lease.status))
            .bind(lease.provider)
            .bind(lease.provider_lease_id)
            .bind(lease.owner_node_id)
            .bind(lease.epoch)
            .bind(lease.acquired_at_ms)
            .bind(lease.last_used_at_ms)
            .bind(lease.expires_at_ms)
            .bind(lease.released_at_ms)
            .bind(lease.failure_reason)
            .bind(lease.cleanup_status)
            .bind(lease.metadata.dump())
            .bind(lease.idempotency_key)
            .bind(lease.config.dump())
            .bind(std::int64_t{lease.cleanup_attempts})
            .bind(lease.limits.dump());
        insert.run();
        if (sqlite3_changes(db()) == 1) {
            tx.commit();
            return lease;
        }
        // Only the idempotency index has DO NOTHING, so the key is set and its lease exists.
        auto existing =
            find_by_key(lease.company_id, lease.environment_id, *lease.idempotency_key, op);
        if (!existing) throw_unavailable(op, "idempotency clash without a lease");
        tx.commit();
        return std::move(*existing);
    }

    std::optional<Lease> get_lease(const std::string& id) {
        constexpr std::string_view op = "get lease";
        std::lock_guard lock(mutex_);
        Statement s(db(), select_leases("WHERE id = ?"), op);
        s.bind(id);
        if (!s.step()) return std::nullopt;
        return read_lease(s, op);
    }

    std::optional<Lease> find_by_idempotency_key(const std::string& company_id,
                                                 const std::string& environment_id,
                                                 const std::string& key) {
        std::lock_guard lock(mutex_);
        return find_by_key(company_id, environment_id, key, "find lease by idempotency key");
    }

    LeasePage list_leases(const LeaseQuery& query) {
        constexpr std::string_view op = "list leases";
        std::optional<std::pair<std::int64_t, std::string>> after;
        if (!query.cursor.empty()) after = decode_cursor(query.cursor);
        auto limit = std::clamp<std::size_t>(query.limit, 1, max_page);

        // Only placeholders are appended; every value is bound below in the same order.
        std::string where = "WHERE 1";
        if (query.company_id) where += " AND company_id = ?";
        if (query.environment_id) where += " AND environment_id = ?";
        if (query.status) where += " AND status = ?";
        if (query.owner_node_id) where += " AND owner_node_id = ?";
        if (!query.tenants.empty()) {
            where += " AND company_id IN (?";
            for (std::size_t i = 1; i < query.tenants.size(); ++i) where += ", ?";
            where += ")";
        }
        if (after) where += " AND (acquired_at_ms, id) > (?, ?)";
        where += " ORDER BY acquired_at_ms, id LIMIT ?";

        std::lock_guard lock(mutex_);
        Statement s(db(), select_leases(where), op);
        if (query.company_id) s.bind(*query.company_id);
        if (query.environment_id) s.bind(*query.environment_id);
        if (query.status) s.bind(to_string(*query.status));
        if (query.owner_node_id) s.bind(*query.owner_node_id);
        for (const auto& tenant : query.tenants) s.bind(tenant);
        if (after) s.bind(after->first).bind(after->second);
        s.bind(static_cast<std::int64_t>(limit + 1));

        LeasePage page;
        while (s.step()) {
            if (page.leases.size() == limit) {
                page.next_cursor = encode_cursor(page.leases.back());
                break;
            }
            page.leases.push_back(read_lease(s, op));
        }
        return page;
    }

    std::optional<Lease> update_lease(const Lease& next, std::int64_t expected_epoch) {
        constexpr std::string_view op = "update lease";
        std::lock_guard lock(mutex_);
        Statement s(db(),
                    "UPDATE leases SET status = ?, owner_node_id = ?, epoch = ?, "
                    "last_used_at_ms = ?, expires_at_ms = ?, released_at_ms = ?, "
                    "failure_reason = ?, cleanup_status = ?, cleanup_attempts = ?, "
                    "metadata = ? WHERE id = ? AND epoch = ? RETURNING " +
                        std::string(lease_columns),
                    op);
        s.bind(to_string(next.status))
            .bind(next.owner_node_id)
            .bind(next.epoch)
            .bind(next.last_used_at_ms)
            .bind(next.expires_at_ms)
            .bind(next.released_at_ms)
            .bind(next.failure_reason)
            .bind(next.cleanup_status)
            .bind(std::int64_t{next.cleanup_attempts})
            .bind(next.metadata.dump())
            .bind(next.id)
            .bind(expected_epoch);
        if (!s.step()) return std::nullopt;  // the epoch differs, or no such lease
        auto stored = read_lease(s, op);
        while (s.step()) {  // RETURNING: the statement completes when stepped to its end
        }
        return stored;
    }

    std::vector<Lease> expired_leases(const std::string& owner_node_id, std::int64_t at_ms) {
        constexpr std::string_view op = "expired leases";
        std::lock_guard lock(mutex_);
        Statement s(db(),
                    select_leases("WHERE owner_node_id = ? AND status = 'active' "
                                  "AND expires_at_ms IS NOT NULL AND expires_at_ms <= ? "
                                  "ORDER BY expires_at_ms, id"),
                    op);
        s.bind(owner_node_id).bind(at_ms);
        std::vector<Lease> out;
        while (s.step()) out.push_back(read_lease(s, op));
        return out;
    }

    void register_node(const NodeRecord& node, std::int64_t liveness_ttl_ms) {
        constexpr std::string_view op = "register node";
        std::lock_guard lock(mutex_);
        Transaction tx(db(), op);
        {
            Statement s(db(), "SELECT instance_id, heartbeat_at_ms FROM nodes WHERE node_id = ?",
                        op);
            s.bind(node.node_id);
            if (s.step()) {
                auto instance = s.text(0);
                auto heartbeat = s.int64(1);
                if (instance != node.instance_id &&
                    heartbeat > node.heartbeat_at_ms - liveness_ttl_ms) {
                    throw rpc_error(errc::invalid_params,
                                    "node id " + node.node_id +
                                        " is already held by a live process (last heartbeat " +
                                        std::to_string(node.heartbeat_at_ms - heartbeat) +
                                        " ms ago)");
                }
            }
        }
        Statement upsert(db(),
                         "INSERT INTO nodes (node_id, url, started_at_ms, heartbeat_at_ms, "
                         "instance_id) VALUES (?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE "
                         "SET url = excluded.url, started_at_ms = excluded.started_at_ms, "
                         "heartbeat_at_ms = excluded.heartbeat_at_ms, "
                         "instance_id = excluded.instance_id",
                         op);
        upsert.bind(node.node_id)
            .bind(node.url)
            .bind(node.started_at_ms)
            .bind(node.heartbeat_at_ms)
            .bind(node.instance_id);
        upsert.run();
        tx.commit();
    }

    bool heartbeat_node(const std::string& node_id, const std::string& instance_id,
                        std::int64_t at_ms) {
        std::lock_guard lock(mutex_);
        Statement s(db(),
                    "UPDATE nodes SET heartbeat_at_ms = ? WHERE node_id = ? AND instance_id = ?",
                    "heartbeat node");
        s.bind(at_ms).bind(node_id).bind(instance_id);
        s.run();
        return sqlite3_changes(db()) == 1;
    }

    void remove_node(const std::string& node_id, const std::string& instance_id) {
        std::lock_guard lock(mutex_);
        Statement s(db(), "DELETE FROM nodes WHERE node_id = ? AND instance_id = ?", "remove node");
        s.bind(node_id).bind(instance_id);
        s.run();
    }

    std::vector<NodeRecord> list_nodes() {
        std::lock_guard lock(mutex_);
        Statement s(db(), "SELECT " + std::string(node_columns) + " FROM nodes ORDER BY node_id",
                    "list nodes");
        std::vector<NodeRecord> out;
        while (s.step()) out.push_back(read_node(s));
        return out;
    }

    std::optional<NodeRecord> get_node(const std::string& node_id) {
        std::lock_guard lock(mutex_);
        Statement s(db(), "SELECT " + std::string(node_columns) + " FROM nodes WHERE node_id = ?",
                    "get node");
        s.bind(node_id);
        if (!s.step()) return std::nullopt;
        return read_node(s);
    }

    std::optional<Lease> find_by_provider_lease(const std::string& provider,
                                                const std::string& provider_lease_id) {
        constexpr std::string_view op = "find lease by provider lease id";
        std::lock_guard lock(mutex_);
        Statement s(db(), select_leases("WHERE provider = ? AND provider_lease_id = ?"), op);
        s.bind(provider).bind(provider_lease_id);
        if (!s.step()) return std::nullopt;
        return read_lease(s, op);
    }

    std::vector<std::string> active_owner_nodes() {
        constexpr std::string_view op = "active owner nodes";
        std::lock_guard lock(mutex_);
        Statement s(db(),
                    "SELECT DISTINCT owner_node_id FROM leases WHERE status = 'active' "
                    "ORDER BY owner_node_id",
                    op);
        std::vector<std::string> out;
        while (s.step()) out.push_back(s.text(0));
        return out;
    }

private:
    sqlite3* db() const noexcept { return db_.get(); }

    // Caller holds mutex_.
    std::optional<Lease> find_by_key(const std::string& company_id,
                                     const std::string& environment_id, const std::string& key,
                                     std::string_view op) {
        Statement s(db(),
                    select_leases("WHERE company_id = ? AND environment_id = ? "
                                  "AND idempotency_key = ?"),
                    op);
        s.bind(company_id).bind(environment_id).bind(key);
        if (!s.step()) return std::nullopt;
        return read_lease(s, op);
    }

    std::mutex mutex_;
    db_ptr db_;
};

/// The interface over SqliteStore. Interim (branch i12-etcd only): each call still runs the
/// blocking SQLite work on the awaiting thread; the SQLite pool of Deliver 1 replaces this.
class SqliteRegistry final : public Registry {
public:
    explicit SqliteRegistry(const std::string& path) : store_(path) {}
    awaitable<Lease> create_lease(Lease lease) override { co_return store_.create_lease(lease); }
    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        co_return store_.get_lease(id);
    }
    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        co_return store_.find_by_idempotency_key(company_id, environment_id, key);
    }
    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        co_return store_.find_by_provider_lease(provider, provider_lease_id);
    }
    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        co_return store_.list_leases(query);
    }
    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        co_return store_.update_lease(next, expected_epoch);
    }
    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        co_return store_.expired_leases(owner_node_id, at_ms);
    }
    awaitable<std::vector<std::string>> active_owner_nodes() override {
        co_return store_.active_owner_nodes();
    }
    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        store_.register_node(node, liveness_ttl_ms);
        co_return;
    }
    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        co_return store_.heartbeat_node(node_id, instance_id, at_ms);
    }
    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        store_.remove_node(node_id, instance_id);
        co_return;
    }
    awaitable<std::vector<NodeRecord>> list_nodes() override { co_return store_.list_nodes(); }
    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        co_return store_.get_node(node_id);
    }

private:
    SqliteStore store_;
};

}  // namespace

std::unique_ptr<Registry> make_sqlite_registry(const std::string& path, int /*readers*/) {
    return std::make_unique<SqliteRegistry>(path);
}

}  // namespace sandboxd
