#include "registry/bad_records.hpp"
#include "registry/cursor.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/lease_fields.hpp>
#include <sandboxd/core/offload.hpp>
#include <sandboxd/registry/registry.hpp>

#include <sqlite3.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace sandboxd {
namespace {

constexpr int schema_version = 8;
constexpr int busy_timeout_ms = 5000;
constexpr std::size_t max_page = 1000;

[[noreturn]] void throw_unavailable(std::string_view op, std::string_view detail) {
    throw rpc_error(errc::registry_unavailable,
                    "registry: " + std::string(op) + ": " + std::string(detail));
}

[[noreturn]] void throw_sqlite(sqlite3* db, std::string_view op) {
    throw_unavailable(op, db != nullptr ? sqlite3_errmsg(db) : "out of memory");
}

struct stmt_finalizer {
    void operator()(sqlite3_stmt* s) const noexcept { sqlite3_finalize(s); }
};
using stmt_ptr = std::unique_ptr<sqlite3_stmt, stmt_finalizer>;

/// Prepared statements kept for reuse, per connection and SQL text: preparing parses and
/// plans the SQL again each time (a tenth of the registry's CPU per lease operation, perf of
/// the no-op provider's acquire+release pairs). A statement is taken out while in use, so two
/// uses of one SQL on one connection at once get two statements. At most max_per_db per
/// connection (a listing's SQL varies with its filters and its tenants). Safe from any thread.
class StatementCache {
public:
    static constexpr std::size_t max_per_db = 64;

    /// Looks up a std::string key by a string_view, without making a string.
    struct SqlHash {
        using is_transparent = void;
        std::size_t operator()(std::string_view sql) const noexcept {
            return std::hash<std::string_view>{}(sql);
        }
    };
    using Map = std::unordered_map<std::string, stmt_ptr, SqlHash, std::equal_to<>>;
    using Node = Map::node_type;

    /// The cached statement of `sql` on `db`, taken out of the cache; empty when none.
    Node take(sqlite3* db, std::string_view sql) {
        std::lock_guard lock(mutex_);
        auto per_db = by_db_.find(db);
        if (per_db == by_db_.end()) return {};
        auto it = per_db->second.find(sql);
        if (it == per_db->second.end()) return {};
        return per_db->second.extract(it);
    }
    /// Keeps `node` (reset, bindings cleared) for the next use on `db`; finalizes it when
    /// another statement of that SQL is kept already, or max_per_db are.
    void give_back(sqlite3* db, Node node) {
        std::lock_guard lock(mutex_);
        auto& kept = by_db_[db];
        if (kept.size() < max_per_db) kept.insert(std::move(node));
    }
    /// Finalizes the statements of `db`; before it is closed.
    void forget(sqlite3* db) noexcept {
        Map doomed;
        {
            std::lock_guard lock(mutex_);
            auto it = by_db_.find(db);
            if (it == by_db_.end()) return;
            doomed = std::move(it->second);
            by_db_.erase(it);
        }
    }
    /// A node that holds `stmt` under `sql`, for a statement prepared now.
    static Node make_node(std::string_view sql, stmt_ptr stmt) {
        Map one;
        one.emplace(std::string(sql), std::move(stmt));
        return one.extract(one.begin());
    }

private:
    std::mutex mutex_;
    std::unordered_map<sqlite3*, Map> by_db_;
};

StatementCache& statement_cache() {
    // Never destroyed: a registry closed during static destruction still finds it.
    static auto* cache = new StatementCache;
    return *cache;
}

struct db_closer {
    void operator()(sqlite3* db) const noexcept {
        statement_cache().forget(db);
        sqlite3_close_v2(db);
    }
};
using db_ptr = std::unique_ptr<sqlite3, db_closer>;

/// A prepared statement (from statement_cache(), else prepared now, and given back to it
/// when destroyed); `op` names the registry operation in error messages. Parameters are bound
/// in order with bind(); columns are read by index.
class Statement {
public:
    Statement(sqlite3* db, std::string_view sql, std::string_view op)
        : db_(db), op_(op), node_(statement_cache().take(db, sql)) {
        if (node_) return;
        sqlite3_stmt* raw = nullptr;
        if (sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()),
                               SQLITE_PREPARE_PERSISTENT, &raw, nullptr) != SQLITE_OK) {
            sqlite3_finalize(raw);
            throw_sqlite(db, op_);
        }
        node_ = StatementCache::make_node(sql, stmt_ptr(raw));
    }
    Statement(const Statement&) = delete;
    Statement& operator=(const Statement&) = delete;
    Statement(Statement&&) = delete;
    Statement& operator=(Statement&&) = delete;
    ~Statement() {
        // Ends the statement's read (a reader's snapshot) and drops its values either way.
        sqlite3_reset(stmt());
        sqlite3_clear_bindings(stmt());
        try {
            statement_cache().give_back(db_, std::move(node_));
        } catch (...) {  // no memory for the cache's map: finalized with the node
        }
    }

    Statement& bind(std::string_view text) {
        check(sqlite3_bind_text64(stmt(), next_++, text.data(), text.size(), SQLITE_TRANSIENT,
                                  SQLITE_UTF8));
        return *this;
    }
    Statement& bind(const std::string& text) { return bind(std::string_view(text)); }
    Statement& bind(std::int64_t value) {
        check(sqlite3_bind_int64(stmt(), next_++, value));
        return *this;
    }
    Statement& bind(const std::optional<std::string>& text) {
        return text ? bind(std::string_view(*text)) : bind_null();
    }
    Statement& bind(const std::optional<std::int64_t>& value) {
        return value ? bind(*value) : bind_null();
    }
    Statement& bind_null() {
        check(sqlite3_bind_null(stmt(), next_++));
        return *this;
    }

    /// True when a row is available, false when the statement has finished.
    bool step() {
        int rc = sqlite3_step(stmt());
        if (rc == SQLITE_ROW) return true;
        if (rc == SQLITE_DONE) return false;
        throw_sqlite(db_, op_);
    }
    void run() {
        while (step()) {
        }
    }

    bool is_null(int col) const { return sqlite3_column_type(stmt(), col) == SQLITE_NULL; }
    std::int64_t int64(int col) const { return sqlite3_column_int64(stmt(), col); }
    std::string text(int col) const {
        const auto* p = sqlite3_column_text(stmt(), col);
        if (p == nullptr) return {};
        auto n = static_cast<std::size_t>(sqlite3_column_bytes(stmt(), col));
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
    sqlite3_stmt* stmt() const noexcept { return node_.mapped().get(); }
    void check(int rc) {
        if (rc != SQLITE_OK) throw_sqlite(db_, op_);
    }

    sqlite3* db_;
    std::string_view op_;
    StatementCache::Node node_;
    int next_ = 1;
};

void exec(sqlite3* db, const char* sql, std::string_view op) {
    if (sqlite3_exec(db, sql, nullptr, nullptr, nullptr) != SQLITE_OK) throw_sqlite(db, op);
}

/// BEGIN IMMEDIATE ... COMMIT; rolls back unless commit() succeeded.
class Transaction {
public:
    Transaction(sqlite3* db, std::string_view op) : db_(db), op_(op) {
        Statement(db_, "BEGIN IMMEDIATE", op_).run();
    }
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    ~Transaction() {
        if (!done_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    }
    void commit() {
        Statement(db_, "COMMIT", op_).run();
        done_ = true;
    }

private:
    sqlite3* db_;
    std::string_view op_;
    bool done_ = false;
};

/// CREATE TABLE leases, its columns from lease_fields (sandboxd/core/lease_fields.hpp).
const std::string& leases_table_sql() {
    static const std::string sql =
        "CREATE TABLE IF NOT EXISTS leases (\n    " + lease_column_definitions() + "\n) STRICT;";
    return sql;
}

// The rest of the schema, run after leases_table_sql().
constexpr const char* schema_sql = R"sql(
CREATE UNIQUE INDEX IF NOT EXISTS leases_idempotency
    ON leases (company_id, environment_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS leases_by_acquired ON leases (acquired_at_ms, id);
CREATE INDEX IF NOT EXISTS leases_by_company ON leases (company_id, acquired_at_ms, id);
CREATE UNIQUE INDEX IF NOT EXISTS leases_by_provider_lease ON leases (provider, provider_lease_id);
CREATE INDEX IF NOT EXISTS leases_by_status_owner
    ON leases (status, owner_node_id, expires_at_ms);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY NOT NULL,
    url TEXT NOT NULL,
    started_at_ms INTEGER NOT NULL,
    heartbeat_at_ms INTEGER NOT NULL,
    instance_id TEXT NOT NULL
) STRICT;
PRAGMA user_version = 8;
)sql";

// Column order of read_lease() and bind_lease(): lease_fields order.
const std::string lease_columns = lease_column_list();

constexpr std::string_view node_columns =
    "node_id, url, started_at_ms, heartbeat_at_ms, instance_id";

std::string select_leases(std::string_view where) {
    std::string sql = "SELECT ";
    sql += lease_columns;
    sql += " FROM leases ";
    sql += where;
    return sql;
}

// --- a lease row, generated from lease_fields ---------------------------------------------

/// The stored fields, all of them or only those update_lease sets.
enum class lease_columns_of { all, updatable };

bool selected(const LeaseField& f, lease_columns_of which) {
    return f.stored() && (which == lease_columns_of::all || f.has(lease_field_flags::updatable));
}

/// "INSERT INTO leases (<every column>) VALUES (?, ..., ?)"; bind with bind_lease(all).
std::string insert_lease_sql() {
    std::string marks;
    for (const auto& f : lease_fields) {
        if (selected(f, lease_columns_of::all)) marks += marks.empty() ? "?" : ", ?";
    }
    return "INSERT INTO leases (" + lease_columns + ") VALUES (" + marks + ")";
}

/// "status = ?, owner_node_id = ?, ..." for UPDATE; bind with bind_lease(updatable).
std::string update_lease_set_sql() {
    std::string out;
    for (const auto& f : lease_fields) {
        if (!selected(f, lease_columns_of::updatable)) continue;
        if (!out.empty()) out += ", ";
        out += std::string(f.column) + " = ?";
    }
    return out;
}

void bind_value(Statement& s, const std::string& v) { s.bind(v); }
void bind_value(Statement& s, const std::optional<std::string>& v) { s.bind(v); }
void bind_value(Statement& s, lease_status v) { s.bind(to_string(v)); }
void bind_value(Statement& s, std::int64_t v) { s.bind(v); }
void bind_value(Statement& s, const std::optional<std::int64_t>& v) { s.bind(v); }
void bind_value(Statement& s, int v) { s.bind(std::int64_t{v}); }
void bind_value(Statement& s, const nlohmann::json& v) { s.bind(v.dump()); }

/// Binds the selected fields of `l` as the next parameters, in lease_fields order.
void bind_lease(Statement& s, const Lease& l, lease_columns_of which) {
    for (const auto& f : lease_fields) {
        if (!selected(f, which)) continue;
        std::visit([&](auto member) { bind_value(s, l.*member); }, f.member);
    }
}

/// The version of a bad column, for BadRecordLog: a hash of its text (rows have no revision).
std::int64_t text_version(const std::string& text) {
    return static_cast<std::int64_t>(std::hash<std::string>{}(text));
}

nlohmann::json parse_json_column(const Statement& s, int col, std::string_view op,
                                 const std::string& lease_id) {
    std::string text = s.text(col);
    auto parsed = try_parse_json(text);
    if (!parsed.ok()) {
        throw unreadable_lease(op, lease_id, "column " + std::to_string(col) + ": " + parsed.error,
                               text_version(text));
    }
    return std::move(parsed.value);
}

/// Reads one column into a member; `l.id` (column 0) is read first, for error messages.
struct ColumnReader {
    const Statement& s;
    std::string_view op;
    Lease& l;
    int col;

    void operator()(std::string Lease::*m) const { l.*m = s.text(col); }
    void operator()(std::optional<std::string> Lease::*m) const { l.*m = s.opt_text(col); }
    void operator()(lease_status Lease::*m) const {
        std::string text = s.text(col);
        auto status = parse_lease_status(text);
        if (!status) throw unreadable_lease(op, l.id, "unknown status", text_version(text));
        l.*m = *status;
    }
    void operator()(std::int64_t Lease::*m) const { l.*m = s.int64(col); }
    void operator()(std::optional<std::int64_t> Lease::*m) const { l.*m = s.opt_int64(col); }
    void operator()(int Lease::*m) const { l.*m = static_cast<int>(s.int64(col)); }
    void operator()(nlohmann::json Lease::*m) const { l.*m = parse_json_column(s, col, op, l.id); }
};

/// A row selected with lease_columns. Throws unreadable_lease for a row that cannot be decoded.
Lease read_lease(const Statement& s, std::string_view op) {
    Lease l;
    int col = 0;
    for (const auto& f : lease_fields) {
        if (!f.stored()) continue;
        std::visit(ColumnReader{s, op, l, col++}, f.member);
    }
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

/// Opens one connection to `path` with the pragmas every connection needs.
db_ptr open_connection(const std::string& path) {
    constexpr std::string_view op = "open";
    sqlite3* raw = nullptr;
    // NOMUTEX: SQLite takes no lock of its own per call. Each connection is used by one
    // thread at a time (SqliteRegistry: one thread per write and membership lane, reader
    // connections lent per call), which is all that the multi-thread mode asks.
    int rc =
        sqlite3_open_v2(path.c_str(), &raw,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    db_ptr db(raw);
    if (rc != SQLITE_OK) {
        throw_unavailable(
            op, path + ": " + (raw != nullptr ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)));
    }
    sqlite3_busy_timeout(db.get(), busy_timeout_ms);
    // journal_mode answers with a row (the resulting mode), so it is stepped, not exec'd.
    Statement(db.get(), "PRAGMA journal_mode=WAL", op).run();
    exec(db.get(), "PRAGMA synchronous=NORMAL", op);
    exec(db.get(), "PRAGMA foreign_keys=ON", op);
    return db;
}

/// Creates the schema, or migrates an older one in place (version 1 lacked `limits`;
/// version 2 lacked the provider and status-owner indexes, which CREATE ... IF NOT EXISTS
/// adds; version 3 lacked agent_id and provider_metadata; version 4 host_metadata and
/// capabilities; version 5 lease_policy; version 6 had three indexes where version 7 has
/// one; version 7 lacked network).
void create_schema(sqlite3* db) {
    constexpr std::string_view op = "create schema";
    Transaction tx(db, op);
    std::int64_t found = 0;
    {
        // Done with before the changes below: DROP INDEX fails while a statement is active.
        Statement version(db, "PRAGMA user_version", op);
        if (version.step()) found = version.int64(0);
    }
    if (found > schema_version) {
        throw_unavailable(op, "schema version " + std::to_string(found) + " is newer than " +
                                  std::to_string(schema_version));
    }
    if (found == 1) {
        // Version 1 had no limits column (issue 11 added it).
        exec(db, "ALTER TABLE leases ADD COLUMN limits TEXT NOT NULL DEFAULT 'null'", op);
    }
    if (found >= 1 && found <= 3) {
        // Issue 13: the agent id of the acquire, and what the provider said about its sandbox.
        exec(db, "ALTER TABLE leases ADD COLUMN agent_id TEXT", op);
        exec(db, "ALTER TABLE leases ADD COLUMN provider_metadata TEXT NOT NULL DEFAULT 'null'",
             op);
    }
    if (found >= 1 && found <= 4) {
        // Issue 14: the host's metadata, and what the provider serves.
        exec(db, "ALTER TABLE leases ADD COLUMN host_metadata TEXT NOT NULL DEFAULT 'null'", op);
        exec(db, "ALTER TABLE leases ADD COLUMN capabilities TEXT NOT NULL DEFAULT 'null'", op);
    }
    if (found >= 1 && found <= 5) {
        // Issue 14: paperclip's lease policy.
        exec(db, "ALTER TABLE leases ADD COLUMN lease_policy TEXT NOT NULL DEFAULT 'ephemeral'",
             op);
    }
    if (found >= 1 && found <= 7) {
        // Issue 48: the lease's network policy.
        exec(db, "ALTER TABLE leases ADD COLUMN network TEXT NOT NULL DEFAULT 'null'", op);
    }
    if (found >= 1 && found <= 6) {
        // Issue 19: leases_by_status_owner (status, owner_node_id) grew expires_at_ms and
        // serves the owner's expired leases, which leases_by_owner (owner_node_id, status,
        // expires_at_ms) served; leases_by_expiry (status, expires_at_ms) served no query.
        // Every lease write updated all three (a release changes status): two fewer pages to
        // write per transaction.
        exec(db,
             "DROP INDEX IF EXISTS leases_by_owner; DROP INDEX IF EXISTS leases_by_expiry; "
             "DROP INDEX IF EXISTS leases_by_status_owner;",
             op);
    }
    exec(db, leases_table_sql().c_str(), op);
    exec(db, schema_sql, op);
    tx.commit();
}

/// Reader connections, each lent to one reader thread at a time.
class ReaderConnections {
public:
    /// A connection lent for one call; returned when destroyed.
    class Lent {
    public:
        Lent(ReaderConnections& owner, db_ptr db) : owner_(owner), db_(std::move(db)) {}
        Lent(const Lent&) = delete;
        Lent& operator=(const Lent&) = delete;
        ~Lent() { owner_.give_back(std::move(db_)); }
        sqlite3* get() const noexcept { return db_.get(); }

    private:
        ReaderConnections& owner_;
        db_ptr db_;
    };

    void add(db_ptr db) {
        std::lock_guard lock(mutex_);
        free_.push_back(std::move(db));
    }

    /// Blocks until a connection is free: there are as many as reader threads, so only a
    /// moment at most.
    Lent lend() {
        std::unique_lock lock(mutex_);
        returned_.wait(lock, [this] { return !free_.empty(); });
        db_ptr db = std::move(free_.back());
        free_.pop_back();
        return Lent(*this, std::move(db));
    }

private:
    void give_back(db_ptr db) {
        {
            std::lock_guard lock(mutex_);
            free_.push_back(std::move(db));
        }
        returned_.notify_one();
    }

    std::mutex mutex_;
    std::condition_variable returned_;
    std::vector<db_ptr> free_;
};

// The blocking bodies of the registry calls, each on the connection it is given.

std::optional<Lease> find_by_key(sqlite3* db, const std::string& company_id,
                                 const std::string& environment_id, const std::string& key,
                                 std::string_view op) {
    Statement s(db,
                select_leases("WHERE company_id = ? AND environment_id = ? "
                              "AND idempotency_key = ?"),
                op);
    s.bind(company_id).bind(environment_id).bind(key);
    if (!s.step()) return std::nullopt;
    return read_lease(s, op);
}

Lease create_lease_on(sqlite3* db, const Lease& lease) {
    constexpr std::string_view op = "create lease";
    Transaction tx(db, op);
    Statement insert(db,
                     insert_lease_sql() +
                         " ON CONFLICT (company_id, environment_id, idempotency_key) "
                         "WHERE idempotency_key IS NOT NULL DO NOTHING",
                     op);
    bind_lease(insert, lease, lease_columns_of::all);
    insert.run();
    if (sqlite3_changes(db) == 1) {
        tx.commit();
        return lease;
    }
    // Only the idempotency index has DO NOTHING, so the key is set and its lease exists.
    auto existing =
        find_by_key(db, lease.company_id, lease.environment_id, *lease.idempotency_key, op);
    if (!existing) throw_unavailable(op, "idempotency clash without a lease");
    tx.commit();
    return std::move(*existing);
}

std::optional<Lease> get_lease_on(sqlite3* db, const std::string& id) {
    constexpr std::string_view op = "get lease";
    Statement s(db, select_leases("WHERE id = ?"), op);
    s.bind(id);
    if (!s.step()) return std::nullopt;
    return read_lease(s, op);
}

std::optional<Lease> find_by_provider_lease_on(sqlite3* db, const std::string& provider,
                                               const std::string& provider_lease_id) {
    constexpr std::string_view op = "find lease by provider lease id";
    Statement s(db, select_leases("WHERE provider = ? AND provider_lease_id = ?"), op);
    s.bind(provider).bind(provider_lease_id);
    if (!s.step()) return std::nullopt;
    return read_lease(s, op);
}

LeasePage list_leases_on(sqlite3* db, const LeaseQuery& query, BadRecordLog& bad) {
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

    Statement s(db, select_leases(where), op);
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
        try {
            page.leases.push_back(read_lease(s, op));
        } catch (const unreadable_lease& e) {
            bad.note(e);  // skipped: listing serves every other lease
        }
    }
    return page;
}

/// The membership record that an update requires of the lease's owner (std::nullopt: none).
struct OwnerFence {
    std::optional<NodeRecord> seen;
};

/// `fence`, when given, makes the update conditional on the owner's membership record (one
/// statement: the condition and the write are one transaction).
std::optional<Lease> update_lease_on(sqlite3* db, const Lease& next, std::int64_t expected_epoch,
                                     const OwnerFence* fence = nullptr) {
    constexpr std::string_view op = "update lease";
    std::string where = " WHERE id = ? AND epoch = ?";
    if (fence) {
        where += fence->seen ? " AND EXISTS (SELECT 1 FROM nodes WHERE node_id = ? AND "
                               "instance_id = ? AND heartbeat_at_ms = ?)"
                             : " AND NOT EXISTS (SELECT 1 FROM nodes WHERE node_id = ?)";
    }
    Statement s(
        db, "UPDATE leases SET " + update_lease_set_sql() + where + " RETURNING " + lease_columns,
        op);
    bind_lease(s, next, lease_columns_of::updatable);
    s.bind(next.id).bind(expected_epoch);
    if (fence) {
        s.bind(next.owner_node_id);
        if (fence->seen) s.bind(fence->seen->instance_id).bind(fence->seen->heartbeat_at_ms);
    }
    if (!s.step()) return std::nullopt;  // the epoch differs, no such lease, or the owner moved
    auto stored = read_lease(s, op);
    while (s.step()) {  // RETURNING: the statement completes when stepped to its end
    }
    return stored;
}

std::vector<Lease> expired_leases_on(sqlite3* db, const std::string& owner_node_id,
                                     std::int64_t at_ms, BadRecordLog& bad) {
    constexpr std::string_view op = "expired leases";
    Statement s(db,
                select_leases("WHERE owner_node_id = ? AND status = 'active' "
                              "AND expires_at_ms IS NOT NULL AND expires_at_ms <= ? "
                              "ORDER BY expires_at_ms, id"),
                op);
    s.bind(owner_node_id).bind(at_ms);
    std::vector<Lease> out;
    while (s.step()) {
        try {
            out.push_back(read_lease(s, op));
        } catch (const unreadable_lease& e) {
            bad.note(e);  // skipped: the sweeper carries on with the others
        }
    }
    return out;
}

std::vector<std::string> active_owner_nodes_on(sqlite3* db) {
    constexpr std::string_view op = "active owner nodes";
    // A skip scan of leases_by_status_owner: one index seek per distinct owner, however many
    // active leases each one holds.
    Statement first(db,
                    "SELECT owner_node_id FROM leases WHERE status = 'active' "
                    "ORDER BY owner_node_id LIMIT 1",
                    op);
    std::vector<std::string> out;
    if (!first.step()) return out;
    out.push_back(first.text(0));
    for (;;) {
        Statement next(db,
                       "SELECT owner_node_id FROM leases WHERE status = 'active' "
                       "AND owner_node_id > ? ORDER BY owner_node_id LIMIT 1",
                       op);
        next.bind(out.back());
        if (!next.step()) return out;
        out.push_back(next.text(0));
    }
}

void register_node_on(sqlite3* db, const NodeRecord& node, std::int64_t liveness_ttl_ms) {
    constexpr std::string_view op = "register node";
    Transaction tx(db, op);
    {
        Statement s(db, "SELECT instance_id, heartbeat_at_ms FROM nodes WHERE node_id = ?", op);
        s.bind(node.node_id);
        if (s.step()) {
            auto instance = s.text(0);
            auto heartbeat = s.int64(1);
            if (instance != node.instance_id &&
                heartbeat > node.heartbeat_at_ms - liveness_ttl_ms) {
                throw rpc_error(errc::invalid_params,
                                "node id " + node.node_id +
                                    " is already held by a live process (last heartbeat " +
                                    std::to_string(node.heartbeat_at_ms - heartbeat) + " ms ago)");
            }
        }
    }
    Statement upsert(db,
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

bool heartbeat_node_on(sqlite3* db, const std::string& node_id, const std::string& instance_id,
                       std::int64_t at_ms) {
    Statement s(db, "UPDATE nodes SET heartbeat_at_ms = ? WHERE node_id = ? AND instance_id = ?",
                "heartbeat node");
    s.bind(at_ms).bind(node_id).bind(instance_id);
    s.run();
    return sqlite3_changes(db) == 1;
}

void remove_node_on(sqlite3* db, const std::string& node_id, const std::string& instance_id) {
    Statement s(db, "DELETE FROM nodes WHERE node_id = ? AND instance_id = ?", "remove node");
    s.bind(node_id).bind(instance_id);
    s.run();
}

std::vector<NodeRecord> list_nodes_on(sqlite3* db) {
    Statement s(db, "SELECT " + std::string(node_columns) + " FROM nodes ORDER BY node_id",
                "list nodes");
    std::vector<NodeRecord> out;
    while (s.step()) out.push_back(read_node(s));
    return out;
}

std::optional<NodeRecord> get_node_on(sqlite3* db, const std::string& node_id) {
    Statement s(db, "SELECT " + std::string(node_columns) + " FROM nodes WHERE node_id = ?",
                "get node");
    s.bind(node_id);
    if (!s.step()) return std::nullopt;
    return read_node(s);
}

/// Three lanes, each with threads and connections of its own (registry.hpp): reads in
/// parallel on `readers` connections (WAL lets them run beside a writer), lease writes on one
/// writer connection, and membership on one more. SQLite serialises writers per file, so a
/// heartbeat may wait for one lease write transaction in progress (a few milliseconds), but
/// never for the lease writes queued behind it.
class SqliteRegistry final : public Registry {
public:
    SqliteRegistry(const std::string& path, int readers, Counter* bad_records) : bad_(bad_records) {
        constexpr std::string_view op = "open";
        if (path.empty()) throw_unavailable(op, "empty path");
        if (readers < 1 || readers > 16) throw_unavailable(op, "readers must be in 1..16");
        auto parent = std::filesystem::path(path).parent_path();
        if (!parent.empty()) {
            std::error_code ec;
            std::filesystem::create_directories(parent, ec);
            if (ec) {
                throw_unavailable(
                    op, "cannot create directory " + parent.string() + ": " + ec.message());
            }
        }
        writer_ = open_connection(path);
        create_schema(writer_.get());
        membership_db_ = open_connection(path);
        for (int i = 0; i < readers; ++i) reader_dbs_.add(open_connection(path));
        reads_.emplace(static_cast<std::size_t>(readers));
    }

    awaitable<Lease> create_lease(Lease lease) override {
        auto work = [this, lease = std::move(lease)] {
            return noting([&] { return create_lease_on(writer_.get(), lease); });
        };
        co_return co_await writes_.run(std::move(work));
    }

    awaitable<std::optional<Lease>> get_lease(std::string id) override {
        auto work = [this, id = std::move(id)] {
            auto db = reader_dbs_.lend();
            return noting([&] { return get_lease_on(db.get(), id); });
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<std::optional<Lease>> find_by_idempotency_key(std::string company_id,
                                                            std::string environment_id,
                                                            std::string key) override {
        auto work = [this, company_id = std::move(company_id),
                     environment_id = std::move(environment_id), key = std::move(key)] {
            auto db = reader_dbs_.lend();
            return noting([&] {
                return find_by_key(db.get(), company_id, environment_id, key,
                                   "find lease by idempotency key");
            });
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<std::optional<Lease>> find_by_provider_lease(std::string provider,
                                                           std::string provider_lease_id) override {
        auto work = [this, provider = std::move(provider),
                     provider_lease_id = std::move(provider_lease_id)] {
            auto db = reader_dbs_.lend();
            return noting(
                [&] { return find_by_provider_lease_on(db.get(), provider, provider_lease_id); });
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<LeasePage> list_leases(LeaseQuery query) override {
        auto work = [this, query = std::move(query)] {
            auto db = reader_dbs_.lend();
            return list_leases_on(db.get(), query, bad_);
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<std::optional<Lease>> update_lease(Lease next, std::int64_t expected_epoch) override {
        auto work = [this, next = std::move(next), expected_epoch] {
            return noting([&] { return update_lease_on(writer_.get(), next, expected_epoch); });
        };
        co_return co_await writes_.run(std::move(work));
    }

    awaitable<std::optional<Lease>> update_lease_if_owner_unchanged(
        Lease next, std::int64_t expected_epoch, std::optional<NodeRecord> owner_seen) override {
        auto work = [this, next = std::move(next), expected_epoch,
                     fence = OwnerFence{std::move(owner_seen)}] {
            return noting(
                [&] { return update_lease_on(writer_.get(), next, expected_epoch, &fence); });
        };
        co_return co_await writes_.run(std::move(work));
    }

    awaitable<std::vector<Lease>> expired_leases(std::string owner_node_id,
                                                 std::int64_t at_ms) override {
        auto work = [this, owner_node_id = std::move(owner_node_id), at_ms] {
            auto db = reader_dbs_.lend();
            return expired_leases_on(db.get(), owner_node_id, at_ms, bad_);
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<std::vector<std::string>> active_owner_nodes() override {
        auto work = [this] {
            auto db = reader_dbs_.lend();
            return active_owner_nodes_on(db.get());
        };
        co_return co_await reads_->run(std::move(work));
    }

    awaitable<void> register_node(NodeRecord node, std::int64_t liveness_ttl_ms) override {
        auto work = [this, node = std::move(node), liveness_ttl_ms] {
            register_node_on(membership_db_.get(), node, liveness_ttl_ms);
        };
        co_await membership_.run(std::move(work));
    }

    awaitable<bool> heartbeat_node(std::string node_id, std::string instance_id,
                                   std::int64_t at_ms) override {
        auto work = [this, node_id = std::move(node_id), instance_id = std::move(instance_id),
                     at_ms] {
            return heartbeat_node_on(membership_db_.get(), node_id, instance_id, at_ms);
        };
        co_return co_await membership_.run(std::move(work));
    }

    awaitable<void> remove_node(std::string node_id, std::string instance_id) override {
        auto work = [this, node_id = std::move(node_id), instance_id = std::move(instance_id)] {
            remove_node_on(membership_db_.get(), node_id, instance_id);
        };
        co_await membership_.run(std::move(work));
    }

    awaitable<std::vector<NodeRecord>> list_nodes() override {
        auto work = [this] { return list_nodes_on(membership_db_.get()); };
        co_return co_await membership_.run(std::move(work));
    }

    awaitable<std::optional<NodeRecord>> get_node(std::string node_id) override {
        auto work = [this, node_id = std::move(node_id)] {
            return get_node_on(membership_db_.get(), node_id);
        };
        co_return co_await membership_.run(std::move(work));
    }

private:
    /// Runs `f`, logging and counting a bad record it meets before passing the error on.
    template <typename F>
    auto noting(F f) -> decltype(f()) {
        try {
            return f();
        } catch (const unreadable_lease& e) {
            bad_.note(e);
            throw;
        }
    }

    BadRecordLog bad_;
    // Connections first, lanes last: the lanes are joined before a connection closes. Each
    // connection is used by one thread at a time: the writer and membership lanes have one
    // thread each, and reader connections are lent per call.
    db_ptr writer_;
    db_ptr membership_db_;
    ReaderConnections reader_dbs_;
    WorkLane writes_{1};
    WorkLane membership_{1};
    std::optional<WorkLane> reads_;  // sized at construction
};

}  // namespace

std::unique_ptr<Registry> make_sqlite_registry(const std::string& path, int readers,
                                               Counter* bad_records) {
    return std::make_unique<SqliteRegistry>(path, readers, bad_records);
}

}  // namespace sandboxd
