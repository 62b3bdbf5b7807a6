#include "registry/etcd_client.hpp"

#include "server/net.hpp"

#include <sandboxd/address.hpp>
#include <sandboxd/base64.hpp>
#include <sandboxd/errors.hpp>

#include <atomic>
#include <charconv>
#include <mutex>
#include <utility>

namespace sandboxd::etcd {
namespace {

using json = nlohmann::json;
using request_t = http::request<http::string_body>;
using response_t = http::response<http::string_body>;

constexpr std::size_t max_idle_per_endpoint = 16;
constexpr std::uint64_t max_body_bytes = 256ULL << 20;
constexpr std::int64_t range_page = 500;

[[noreturn]] void throw_unavailable(std::string_view op, std::string_view detail) {
    throw rpc_error(errc::registry_unavailable,
                    "registry: " + std::string(op) + ": " + std::string(detail));
}

struct Endpoint {
    std::string url;   ///< as configured, without a trailing "/"
    std::string host;  ///< without brackets
    std::string port;
    std::string host_header;
};

Endpoint parse_endpoint(const std::string& text) {
    HostPort parsed;
    try {
        parsed = parse_http_endpoint(text);
    } catch (const address_error& e) {
        throw std::invalid_argument("etcd endpoint: " + std::string(e.what()));
    }
    Endpoint ep;
    ep.url = text.back() == '/' ? text.substr(0, text.size() - 1) : text;
    ep.host = parsed.host;
    ep.port = parsed.port_text();
    ep.host_header = parsed.authority();
    return ep;
}

/// One keep-alive HTTP connection with its own io_context, used by one thread at a time.
class Connection {
public:
    Connection() = default;
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    bool is_open() const { return stream_.socket().is_open(); }

    /// Sends `req` and reads the answer, all within `timeout` (connecting first when needed).
    beast::error_code exchange(const Endpoint& ep, request_t& req, response_t& res,
                               std::chrono::milliseconds timeout) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        beast::error_code ec;
        if (!is_open()) {
            buffer_.clear();
            tcp::resolver resolver(ioc_);
            tcp::resolver::results_type results;
            net::steady_timer timer(ioc_, deadline);
            bool resolved = false;
            resolver.async_resolve(ep.host, ep.port,
                                   [&](beast::error_code rec, tcp::resolver::results_type r) {
                                       resolved = true;
                                       ec = rec;
                                       results = std::move(r);
                                       timer.cancel();
                                   });
            timer.async_wait([&](beast::error_code tec) {
                if (!tec && !resolved) resolver.cancel();
            });
            run();
            if (!resolved || ec == net::error::operation_aborted) return net::error::timed_out;
            if (ec) return ec;
            stream_.expires_at(deadline);
            stream_.async_connect(results,
                                  [&](beast::error_code cec, const tcp::endpoint&) { ec = cec; });
            run();
            if (ec) return close(ec);
            stream_.socket().set_option(tcp::no_delay(true), ec);
            ec = {};
        }
        stream_.expires_at(deadline);
        http::response_parser<http::string_body> parser;
        parser.body_limit(max_body_bytes);
        parser.eager(true);
        http::async_write(stream_, req, [&](beast::error_code wec, std::size_t) {
            ec = wec;
            if (wec) return;
            http::async_read(stream_, buffer_, parser,
                             [&](beast::error_code rec, std::size_t) { ec = rec; });
        });
        run();
        if (ec) return close(ec);
        res = parser.release();
        stream_.expires_never();
        if (!res.keep_alive()) close({});
        return {};
    }

private:
    void run() {
        ioc_.restart();
        ioc_.run();
    }
    beast::error_code close(beast::error_code ec) {
        beast::error_code ignored;
        stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
        stream_.socket().close(ignored);
        buffer_.clear();
        if (ec == beast::error::timeout) return net::error::timed_out;
        return ec;
    }

    net::io_context ioc_{1};
    beast::tcp_stream stream_{ioc_};
    beast::flat_buffer buffer_;
};

/// An answer of one endpoint: an HTTP response, or why there was none.
struct Exchange {
    bool ok = false;
    int status = 0;
    std::string body;
    std::string failure;  ///< when !ok
};

json parse_body(const std::string& body) {
    try {
        return json::parse(body);
    } catch (const json::parse_error&) {
        // A streaming answer (lease keepalive) is newline-delimited JSON: take the first one.
        auto nl = body.find('\n');
        if (nl == std::string::npos) throw;
        return json::parse(body.substr(0, nl));
    }
}

std::int64_t parse_int64(std::string_view text) {
    std::int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
        throw std::invalid_argument("not a 64-bit integer: \"" + std::string(text) + "\"");
    }
    return v;
}

std::string b64(std::string_view raw) { return base64_encode(raw); }

}  // namespace

// --- JSON helpers ------------------------------------------------------------------------

json compare_create_revision(std::string_view key, std::int64_t revision) {
    return {{"key", b64(key)},
            {"result", "EQUAL"},
            {"target", "CREATE"},
            {"create_revision", std::to_string(revision)}};
}

json compare_mod_revision(std::string_view key, std::int64_t revision) {
    return {{"key", b64(key)},
            {"result", "EQUAL"},
            {"target", "MOD"},
            {"mod_revision", std::to_string(revision)}};
}

json request_put(std::string_view key, std::string_view value, std::int64_t lease) {
    json put = {{"key", b64(key)}, {"value", b64(value)}};
    if (lease != 0) put["lease"] = std::to_string(lease);
    return {{"request_put", std::move(put)}};
}

json request_range(std::string_view key) { return {{"request_range", {{"key", b64(key)}}}}; }

json request_delete(std::string_view key) {
    return {{"request_delete_range", {{"key", b64(key)}}}};
}

std::string prefix_end(std::string_view prefix) {
    std::string end(prefix);
    while (!end.empty()) {
        auto& c = reinterpret_cast<unsigned char&>(end.back());
        if (c < 0xff) {
            ++c;
            return end;
        }
        end.pop_back();
    }
    return std::string(1, '\0');  // every key
}

std::int64_t int64_field(const json& j, std::string_view name) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return 0;
    if (it->is_string()) return parse_int64(it->get_ref<const std::string&>());
    if (it->is_number_integer()) return it->get<std::int64_t>();
    throw std::invalid_argument("field " + std::string(name) + " is not an integer");
}

KeyValue decode_kv(const json& kv) {
    if (!kv.is_object()) throw std::invalid_argument("kvs element is not an object");
    KeyValue out;
    auto text = [&](const char* name) -> std::string {
        auto it = kv.find(name);
        if (it == kv.end() || it->is_null()) return {};
        if (!it->is_string()) throw std::invalid_argument(std::string(name) + " is not a string");
        return base64_decode(it->get_ref<const std::string&>());
    };
    out.key = text("key");
    out.value = text("value");
    out.create_revision = int64_field(kv, "create_revision");
    out.mod_revision = int64_field(kv, "mod_revision");
    out.version = int64_field(kv, "version");
    out.lease = int64_field(kv, "lease");
    return out;
}

// --- Client --------------------------------------------------------------------------------

struct Client::Impl {
    std::vector<Endpoint> endpoints;
    std::string username;
    std::string password;
    std::chrono::milliseconds timeout;

    std::mutex pool_mutex;
    std::vector<std::vector<std::unique_ptr<Connection>>> idle;  // per endpoint
    std::atomic<std::size_t> preferred{0};

    std::mutex auth_mutex;  // held while authenticating; guards token
    std::string token;

    std::unique_ptr<Connection> take(std::size_t idx) {
        std::lock_guard lock(pool_mutex);
        auto& list = idle[idx];
        if (list.empty()) return std::make_unique<Connection>();
        auto conn = std::move(list.back());
        list.pop_back();
        return conn;
    }
    void give_back(std::size_t idx, std::unique_ptr<Connection> conn) {
        if (!conn->is_open()) return;
        std::lock_guard lock(pool_mutex);
        if (idle[idx].size() < max_idle_per_endpoint) idle[idx].push_back(std::move(conn));
    }

    /// One HTTP POST to one endpoint. A pooled connection the server has closed meanwhile is
    /// retried once on a fresh one.
    Exchange post(std::size_t idx, std::string_view path, const std::string& payload,
                  const std::string& auth) {
        const auto& ep = endpoints[idx];
        request_t req{http::verb::post, path, 11};
        req.set(http::field::host, ep.host_header);
        req.set(http::field::user_agent, "sandboxd");
        req.set(http::field::content_type, "application/json");
        if (!auth.empty()) req.set(http::field::authorization, auth);
        req.keep_alive(true);
        req.body() = payload;
        req.prepare_payload();

        Exchange out;
        for (int attempt = 0; attempt < 2; ++attempt) {
            auto conn = attempt == 0 ? take(idx) : std::make_unique<Connection>();
            const bool reused = conn->is_open();
            response_t res;
            auto ec = conn->exchange(ep, req, res, timeout);
            if (!ec) {
                out.ok = true;
                out.status = static_cast<int>(res.result_int());
                out.body = std::move(res.body());
                give_back(idx, std::move(conn));
                return out;
            }
            if (ec == net::error::timed_out) {
                out.failure = ep.url + std::string(path) + ": timed out after " +
                              std::to_string(timeout.count()) + " ms";
                return out;
            }
            out.failure = ep.url + std::string(path) + ": " + ec.message();
            if (!reused) return out;
            // The server closed a pooled connection (e.g. it restarted): so it did the others.
            std::lock_guard lock(pool_mutex);
            idle[idx].clear();
        }
        return out;
    }

    /// The token to send: empty without a username; authenticates when there is none or
    /// when `refused` is the one in use.
    std::string auth_token(std::size_t idx, std::string_view op, const std::string* refused) {
        if (username.empty()) return {};
        std::lock_guard lock(auth_mutex);
        if (!token.empty() && (refused == nullptr || token != *refused)) return token;
        token.clear();
        json body = {{"name", username}, {"password", password}};
        auto ex = post(idx, "/v3/auth/authenticate", body.dump(), "");
        if (!ex.ok) throw endpoint_failure{ex.failure};
        json answer;
        try {
            answer = parse_body(ex.body);
        } catch (const json::exception&) {
            throw endpoint_failure{endpoints[idx].url + "/v3/auth/authenticate: malformed answer"};
        }
        if (ex.status != 200) {
            if (ex.status >= 500) {
                throw endpoint_failure{endpoints[idx].url + "/v3/auth/authenticate: HTTP " +
                                       std::to_string(ex.status)};
            }
            throw_status(ex.status, answer, "authenticate as " + username);
        }
        auto it = answer.find("token");
        if (it == answer.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
            throw_unavailable(op, "authenticate as " + username + ": no token in the answer");
        }
        token = it->get<std::string>();
        return token;
    }

    struct endpoint_failure {
        std::string detail;
    };

    [[noreturn]] static void throw_status(int http_status, const json& answer,
                                          const std::string& context) {
        int code = 0;
        std::string message;
        if (answer.is_object()) {
            auto c = answer.find("code");
            if (c != answer.end() && c->is_number_integer()) code = c->get<int>();
            for (const char* key : {"message", "error"}) {
                auto m = answer.find(key);
                if (m != answer.end() && m->is_string()) {
                    message = m->get<std::string>();
                    break;
                }
            }
        }
        if (message.empty()) message = "HTTP " + std::to_string(http_status);
        if (!context.empty()) message = context + ": " + message;
        throw status_error(code, http_status, message);
    }

    static bool is_auth_error(int http_status, const json& answer) {
        if (http_status == 401) return true;
        if (!answer.is_object()) return false;
        auto c = answer.find("code");
        if (c != answer.end() && c->is_number_integer() && c->get<int>() == code_unauthenticated) {
            return true;
        }
        // etcd answers InvalidArgument "user name is empty" when auth is on and no (or an
        // unknown) token is sent; a fresh token cures it.
        auto m = answer.find("message");
        return m != answer.end() && m->is_string() &&
               m->get_ref<const std::string&>().find("user name is empty") != std::string::npos;
    }

    /// POST to one endpoint with auth; returns the answer or throws endpoint_failure (try the
    /// next endpoint) or status_error (etcd's answer).
    json call_endpoint(std::size_t idx, std::string_view op, std::string_view path,
                       const std::string& payload) {
        const auto& url = endpoints[idx].url;
        std::string used = auth_token(idx, op, nullptr);
        for (int attempt = 0;; ++attempt) {
            auto ex = post(idx, path, payload, used);
            if (!ex.ok) throw endpoint_failure{ex.failure};
            json answer;
            try {
                answer = parse_body(ex.body);
            } catch (const json::exception&) {
                if (ex.status >= 500) {
                    throw endpoint_failure{url + std::string(path) + ": HTTP " +
                                           std::to_string(ex.status)};
                }
                throw endpoint_failure{url + std::string(path) + ": malformed answer (HTTP " +
                                       std::to_string(ex.status) + ")"};
            }
            if (ex.status == 200 && answer.is_object()) {
                // A streaming answer wraps the message in "result", or an error in "error".
                if (auto r = answer.find("result"); r != answer.end() && r->is_object()) {
                    return std::move(*r);
                }
                if (auto e = answer.find("error"); e != answer.end() && e->is_object()) {
                    json flat = {{"code", e->value("grpc_code", 0)},
                                 {"message", e->value("message", std::string())}};
                    int http_status = e->value("http_code", 500);
                    if (http_status >= 500) {
                        throw endpoint_failure{url + std::string(path) + ": " +
                                               flat["message"].get<std::string>()};
                    }
                    throw_status(http_status, flat, "");
                }
                return answer;
            }
            if (ex.status == 200) {
                throw endpoint_failure{url + std::string(path) + ": malformed answer"};
            }
            if (attempt == 0 && !username.empty() && is_auth_error(ex.status, answer)) {
                used = auth_token(idx, op, &used);
                continue;
            }
            if (ex.status >= 500) {
                std::string message;
                if (answer.is_object() && answer.contains("message") &&
                    answer["message"].is_string()) {
                    message = answer["message"].get<std::string>();
                }
                throw endpoint_failure{url + std::string(path) + ": HTTP " +
                                       std::to_string(ex.status) +
                                       (message.empty() ? "" : ": " + message)};
            }
            throw_status(ex.status, answer, "");
        }
    }
};

Client::Client(std::vector<std::string> endpoints, std::string username, std::string password,
               std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
    if (endpoints.empty()) throw std::invalid_argument("etcd: no endpoints");
    for (const auto& e : endpoints) impl_->endpoints.push_back(parse_endpoint(e));
    impl_->username = std::move(username);
    impl_->password = std::move(password);
    impl_->timeout = timeout;
    impl_->idle.resize(impl_->endpoints.size());
}

Client::~Client() = default;

json Client::call(std::string_view op, std::string_view path, const json& body) {
    const std::string payload = body.dump();
    const std::size_t n = impl_->endpoints.size();
    const std::size_t start = impl_->preferred.load(std::memory_order_relaxed) % n;
    std::string failures;
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t idx = (start + i) % n;
        try {
            json answer = impl_->call_endpoint(idx, op, path, payload);
            if (idx != start) impl_->preferred.store(idx, std::memory_order_relaxed);
            return answer;
        } catch (const Impl::endpoint_failure& f) {
            if (!failures.empty()) failures += "; ";
            failures += f.detail;
        }
    }
    throw_unavailable(op, failures);
}

RangeResult Client::range(std::string_view op, std::string_view key, std::string_view range_end,
                          std::int64_t limit, std::int64_t revision) {
    json body = {{"key", b64(key)}};
    if (!range_end.empty()) body["range_end"] = b64(range_end);
    if (limit > 0) body["limit"] = std::to_string(limit);
    if (revision > 0) body["revision"] = std::to_string(revision);
    json answer = call(op, "/v3/kv/range", body);
    RangeResult out;
    if (auto h = answer.find("header"); h != answer.end() && h->is_object()) {
        out.revision = int64_field(*h, "revision");
    }
    if (auto kvs = answer.find("kvs"); kvs != answer.end() && !kvs->is_null()) {
        if (!kvs->is_array()) throw std::invalid_argument("kvs is not an array");
        for (const auto& kv : *kvs) out.kvs.push_back(decode_kv(kv));
    }
    out.count = int64_field(answer, "count");
    out.more = answer.value("more", false);
    return out;
}

std::optional<KeyValue> Client::get(std::string_view op, std::string_view key) {
    auto r = range(op, key);
    for (auto& kv : r.kvs) {
        if (kv.key == key) return std::move(kv);
    }
    return std::nullopt;
}

std::vector<KeyValue> Client::get_prefix(std::string_view op, std::string_view prefix,
                                         std::int64_t* revision_out) {
    const std::string end = prefix_end(prefix);
    for (int attempt = 0;; ++attempt) {
        std::vector<KeyValue> out;
        std::string from(prefix);
        std::int64_t revision = 0;
        try {
            for (;;) {
                auto page = range(op, from, end, range_page, revision);
                if (revision == 0) revision = page.revision;
                for (auto& kv : page.kvs) out.push_back(std::move(kv));
                if (!page.more || out.empty()) {
                    if (revision_out) *revision_out = revision;
                    return out;
                }
                from = out.back().key;
                from.push_back('\0');
            }
        } catch (const status_error& e) {
            // The pinned revision was compacted between two pages: read again from the top.
            if (e.code() != code_out_of_range || attempt >= 3) throw;
        }
    }
}

Client::TxnResult Client::txn(std::string_view op, json compare, json success, json failure) {
    json body = {{"compare", std::move(compare)}, {"success", std::move(success)}};
    if (!failure.empty()) body["failure"] = std::move(failure);
    json answer = call(op, "/v3/kv/txn", body);
    TxnResult out;
    out.succeeded = answer.value("succeeded", false);
    if (auto h = answer.find("header"); h != answer.end() && h->is_object()) {
        out.revision = int64_field(*h, "revision");
    }
    if (auto r = answer.find("responses"); r != answer.end() && r->is_array()) {
        out.responses = std::move(*r);
    }
    return out;
}

std::int64_t Client::lease_grant(std::string_view op, std::int64_t ttl_s) {
    json answer = call(op, "/v3/lease/grant", {{"TTL", std::to_string(ttl_s)}, {"ID", "0"}});
    if (auto e = answer.find("error");
        e != answer.end() && e->is_string() && !e->get<std::string>().empty()) {
        throw_unavailable(op, "lease grant: " + e->get<std::string>());
    }
    auto id = int64_field(answer, "ID");
    if (id == 0) throw std::invalid_argument("lease grant answer has no ID");
    return id;
}

std::int64_t Client::lease_keepalive(std::string_view op, std::int64_t id) {
    json answer = call(op, "/v3/lease/keepalive", {{"ID", std::to_string(id)}});
    return int64_field(answer, "TTL");
}

void Client::lease_revoke(std::string_view op, std::int64_t id) {
    try {
        call(op, "/v3/lease/revoke", {{"ID", std::to_string(id)}});
    } catch (const status_error& e) {
        if (e.code() != code_not_found) throw;
    }
}

// --- watch ---------------------------------------------------------------------------------

void WatchStop::stop() {
    // Under the lock: detach() waits, so the watch's io_context outlives the interrupt.
    std::lock_guard lock(mutex_);
    stopped_ = true;
    if (interrupt_) interrupt_();
}

bool WatchStop::stopped() const {
    std::lock_guard lock(mutex_);
    return stopped_;
}

bool WatchStop::attach(std::function<void()> interrupt) {
    std::lock_guard lock(mutex_);
    if (stopped_) return false;
    interrupt_ = std::move(interrupt);
    return true;
}

void WatchStop::detach() {
    std::lock_guard lock(mutex_);
    interrupt_ = nullptr;
}

namespace {

WatchMessage decode_watch_message(const json& result) {
    WatchMessage m;
    if (auto h = result.find("header"); h != result.end() && h->is_object()) {
        m.revision = int64_field(*h, "revision");
    }
    m.created = result.value("created", false);
    m.canceled = result.value("canceled", false);
    m.compact_revision = int64_field(result, "compact_revision");
    if (auto r = result.find("cancel_reason"); r != result.end() && r->is_string()) {
        m.cancel_reason = r->get<std::string>();
    }
    if (auto events = result.find("events"); events != result.end() && !events->is_null()) {
        if (!events->is_array()) throw std::invalid_argument("events is not an array");
        for (const auto& e : *events) {
            WatchEvent ev;
            auto type = e.find("type");
            ev.deleted = type != e.end() && type->is_string() && *type == "DELETE";
            if (auto kv = e.find("kv"); kv != e.end()) ev.kv = decode_kv(*kv);
            m.events.push_back(std::move(ev));
        }
    }
    return m;
}

}  // namespace

void Client::watch(std::string_view op, std::string_view prefix, std::int64_t start_revision,
                   WatchStop& stop, const std::function<void(const WatchMessage&)>& on_message) {
    json create = {{"key", b64(prefix)}, {"range_end", b64(prefix_end(prefix))}};
    if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
    const std::string payload = json{{"create_request", std::move(create)}}.dump();
    const std::size_t n = impl_->endpoints.size();
    const std::size_t start = impl_->preferred.load(std::memory_order_relaxed) % n;
    std::string failures;
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t idx = (start + i) % n;
        const auto& ep = impl_->endpoints[idx];
        std::string auth;
        try {
            auth = impl_->auth_token(idx, op, nullptr);
        } catch (const Impl::endpoint_failure& f) {
            failures += (failures.empty() ? "" : "; ") + f.detail;
            continue;
        }
        net::io_context ioc{1};
        beast::tcp_stream stream(ioc);
        auto run = [&ioc] {
            ioc.restart();
            ioc.run();
        };
        if (!stop.attach([&ioc, &stream] {
                net::post(ioc, [&stream] {
                    beast::error_code ignored;
                    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
                    stream.socket().close(ignored);
                });
            })) {
            return;
        }
        struct Detach {
            WatchStop& s;
            ~Detach() { s.detach(); }
        } detach{stop};

        // Connect, send the create request and read the answer's header, within the timeout.
        beast::error_code ec;
        tcp::resolver resolver(ioc);
        tcp::resolver::results_type results;
        resolver.async_resolve(ep.host, ep.port,
                               [&](beast::error_code rec, tcp::resolver::results_type r) {
                                   ec = rec;
                                   results = std::move(r);
                               });
        run();
        request_t req{http::verb::post, "/v3/watch", 11};
        req.set(http::field::host, ep.host_header);
        req.set(http::field::user_agent, "sandboxd");
        req.set(http::field::content_type, "application/json");
        if (!auth.empty()) req.set(http::field::authorization, auth);
        req.body() = payload;
        req.prepare_payload();
        beast::flat_buffer buffer;
        std::string pending;  // body bytes not yet split into messages
        auto on_body = [&pending](std::uint64_t, std::string_view body,
                                  beast::error_code&) -> std::size_t {
            pending.append(body);
            return body.size();
        };
        http::response_parser<http::empty_body> parser;
        parser.body_limit(boost::none);
        parser.on_chunk_body(on_body);  // kept by reference: declared before the parser
        if (!ec) {
            stream.expires_after(impl_->timeout);
            stream.async_connect(results, [&](beast::error_code cec, const tcp::endpoint&) {
                ec = cec;
                if (cec) return;
                http::async_write(stream, req, [&](beast::error_code wec, std::size_t) {
                    ec = wec;
                    if (wec) return;
                    http::async_read_header(stream, buffer, parser,
                                            [&](beast::error_code hec, std::size_t) { ec = hec; });
                });
            });
            run();
        }
        if (stop.stopped()) return;
        if (ec) {
            failures += (failures.empty() ? "" : "; ") + ep.url + "/v3/watch: " +
                        (ec == beast::error::timeout ? std::string("timed out") : ec.message());
            continue;
        }
        if (parser.get().result() != http::status::ok || !parser.chunked()) {
            failures += (failures.empty() ? "" : "; ") + ep.url + "/v3/watch: HTTP " +
                        std::to_string(parser.get().result_int()) +
                        (parser.chunked() ? "" : ", not a stream");
            continue;
        }
        impl_->preferred.store(idx, std::memory_order_relaxed);
        stream.expires_never();

        // The stream: newline-delimited JSON messages inside chunks, until it ends.
        for (;;) {
            for (auto nl = pending.find('\n'); nl != std::string::npos; nl = pending.find('\n')) {
                const std::string line = pending.substr(0, nl);
                pending.erase(0, nl + 1);
                if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
                json message;
                try {
                    message = json::parse(line);
                } catch (const json::exception&) {
                    throw_unavailable(op, ep.url + "/v3/watch: malformed message");
                }
                if (auto e = message.find("error"); e != message.end() && e->is_object()) {
                    Impl::throw_status(e->value("http_code", 500),
                                       json{{"code", e->value("grpc_code", 0)},
                                            {"message", e->value("message", std::string())}},
                                       "watch");
                }
                auto r = message.find("result");
                if (r == message.end() || !r->is_object()) {
                    throw_unavailable(op, ep.url + "/v3/watch: message without a result");
                }
                WatchMessage decoded;
                try {
                    decoded = decode_watch_message(*r);
                } catch (const std::invalid_argument& e) {
                    throw_unavailable(op, ep.url + "/v3/watch: " + e.what());
                }
                on_message(decoded);
                if (decoded.canceled) return;
            }
            if (parser.is_done() || stop.stopped()) return;
            http::async_read_some(stream, buffer, parser,
                                  [&](beast::error_code rec, std::size_t) { ec = rec; });
            run();
            if (ec) return;  // broken, closed or stopped: the caller lists and watches again
        }
    }
    throw_unavailable(op, failures);
}

}  // namespace sandboxd::etcd
