#include "registry/etcd_client.hpp"

#include <sandboxd/core/net.hpp>

#include <sandboxd/core/address.hpp>
#include <sandboxd/core/base64.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/json_limits.hpp>
#include <sandboxd/core/tls.hpp>

#include <atomic>
#include <charconv>
#include <mutex>
#include <utility>
#include <variant>

namespace sandboxd::etcd {
namespace {

using json = nlohmann::json;
using request_t = http::request<http::string_body>;
using response_t = http::response<http::string_body>;

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
    bool https = false;
};

Endpoint parse_endpoint(const std::string& text) {
    HostPort parsed;
    bool https = false;
    try {
        parsed = parse_http_endpoint(text, &https);
    } catch (const address_error& e) {
        throw std::invalid_argument("etcd endpoint: " + std::string(e.what()));
    }
    Endpoint ep;
    ep.https = https;
    ep.url = text.back() == '/' ? text.substr(0, text.size() - 1) : text;
    ep.host = parsed.host;
    ep.port = parsed.port_text();
    ep.host_header = parsed.authority();
    return ep;
}

/// Connects `stream` (made here: plain, or TLS with `tls` for an https:// endpoint) to `ep`,
/// with the TLS handshake (the certificate must name ep.host). Throws system_error.
awaitable<void> connect_to(std::optional<ConnStream>& stream, const Endpoint& ep,
                           std::shared_ptr<ssl::context> tls) {
    auto ex = co_await net::this_coro::executor;
    if (ep.https) {
        if (!tls) tls = make_client_tls(TlsClientOptions{}, "registry.tls");
        stream.emplace(beast::tcp_stream(ex), std::move(tls));
    } else {
        stream.emplace(beast::tcp_stream(ex));
    }
    tcp::resolver resolver(ex);
    auto results = co_await resolver.async_resolve(ep.host, ep.port, use_awaitable);
    co_await beast::get_lowest_layer(*stream).async_connect(results, use_awaitable);
    beast::error_code ignored;
    beast::get_lowest_layer(*stream).socket().set_option(tcp::no_delay(true), ignored);
    if (auto* t = stream->tls()) {
        expect_server_name(t->native_handle(), ep.host, true);
        co_await t->async_handshake(ssl::stream_base::client, use_awaitable);
    }
}

/// One keep-alive HTTP connection, used by one call at a time (taken from the pool).
struct Connection {
    explicit Connection(net::any_io_executor ex) : executor(std::move(ex)) {}
    net::any_io_executor executor;
    std::optional<ConnStream> stream;  ///< made by each connect
    beast::flat_buffer buffer;

    bool is_open() { return stream && beast::get_lowest_layer(*stream).socket().is_open(); }
    void close() {
        if (!stream) return;
        beast::error_code ignored;
        beast::get_lowest_layer(*stream).socket().shutdown(tcp::socket::shutdown_both, ignored);
        beast::get_lowest_layer(*stream).socket().close(ignored);
        buffer.clear();
    }
};

std::string b64(std::string_view raw) { return base64_encode(raw); }

}  // namespace

// --- Client --------------------------------------------------------------------------------

struct Client::Impl {
    net::any_io_executor ex;
    std::vector<Endpoint> endpoints;  // immutable after construction
    std::string username;
    std::string password;
    std::chrono::milliseconds timeout{0};
    TlsSource tls;  // immutable after construction
    std::atomic<std::size_t> preferred{0};

    std::mutex mutex;  // guards idle and token; never held across a co_await
    std::vector<std::vector<std::shared_ptr<Connection>>> idle;  // per endpoint
    std::string token;

    std::shared_ptr<Connection> take(std::size_t idx) {
        std::lock_guard lock(mutex);
        auto& list = idle[idx];
        if (list.empty()) return std::make_shared<Connection>(ex);
        auto conn = std::move(list.back());
        list.pop_back();
        return conn;
    }
    void give_back(std::size_t idx, std::shared_ptr<Connection> conn) {
        if (!conn->is_open()) return;
        std::lock_guard lock(mutex);
        if (idle[idx].size() < max_idle_per_endpoint) idle[idx].push_back(std::move(conn));
    }
    void clear_idle(std::size_t idx) {
        std::vector<std::shared_ptr<Connection>> dropped;
        {
            std::lock_guard lock(mutex);
            dropped.swap(idle[idx]);
        }
        for (auto& c : dropped) c->close();
    }
    std::string current_token() {
        std::lock_guard lock(mutex);
        return token;
    }
    void set_token(std::string t) {
        std::lock_guard lock(mutex);
        token = std::move(t);
    }
};

namespace {

using Impl = Client::Impl;

struct endpoint_failure {
    std::string detail;
};

[[noreturn]] void throw_status(int http_status, const json& answer, const std::string& context) {
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

bool is_auth_error(int http_status, const json& answer) {
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

request_t make_request(const Endpoint& ep, const std::string& path, std::string payload,
                       const std::string& auth) {
    request_t req{http::verb::post, path, 11};
    req.set(http::field::host, ep.host_header);
    req.set(http::field::user_agent, "sandboxd");
    req.set(http::field::content_type, "application/json");
    if (!auth.empty()) req.set(http::field::authorization, auth);
    req.keep_alive(true);
    req.body() = std::move(payload);
    req.prepare_payload();
    return req;
}

/// The outcome of one exchange: an error, or the response.
struct Attempt {
    beast::error_code ec;
    response_t res;
};

/// Connects `conn` when it is closed, writes `req` and reads the answer. Errors come back in
/// the result, not as exceptions: `exchange || timer` completes on the first operation that
/// succeeds (wait_for_one_success), so a throwing exchange would wait out the timer.
awaitable<Attempt> exchange(std::shared_ptr<Connection> conn, Endpoint ep, request_t req,
                            std::shared_ptr<ssl::context> tls) {
    Attempt out;
    try {
        if (!conn->is_open()) {
            conn->buffer.clear();
            co_await connect_to(conn->stream, ep, std::move(tls));
        }
        co_await http::async_write(*conn->stream, req, use_awaitable);
        http::response_parser<http::string_body> parser;
        parser.body_limit(max_body_bytes);
        parser.eager(true);
        co_await http::async_read(*conn->stream, conn->buffer, parser, use_awaitable);
        out.res = parser.release();
    } catch (const boost::system::system_error& e) {
        out.ec = e.code();
    }
    co_return out;
}

/// An answer of one endpoint: an HTTP response, or why there was none.
struct Exchange {
    bool ok = false;
    int status = 0;
    std::string body;
    std::string failure;  ///< when !ok
};

/// One HTTP POST to endpoint `idx`, within the client's timeout (`exchange || timer`). A
/// pooled connection that the server closed meanwhile (it restarted) is retried once on a
/// fresh one, and the endpoint's other idle connections are dropped with it.
awaitable<Exchange> post(std::shared_ptr<Impl> impl, std::size_t idx, std::string path,
                         std::string payload, std::string auth) {
    const Endpoint& ep = impl->endpoints[idx];
    const request_t req = make_request(ep, path, std::move(payload), auth);
    Exchange out;
    for (int attempt = 0; attempt < 2; ++attempt) {
        auto conn = attempt == 0 ? impl->take(idx) : std::make_shared<Connection>(impl->ex);
        const bool reused = conn->is_open();
        net::steady_timer timer(co_await net::this_coro::executor, impl->timeout);
        beast::error_code ec;
        std::optional<response_t> res;
        using namespace net::experimental::awaitable_operators;
        // A named local: GCC 12 destroys a temporary of a conditional inside co_await twice.
        std::shared_ptr<ssl::context> tls;
        if (ep.https && impl->tls) tls = impl->tls();
        auto won = co_await (exchange(conn, ep, req, std::move(tls)) ||
                             timer.async_wait(as_tuple_awaitable));
        if (won.index() == 0) {
            ec = std::get<0>(won).ec;
            if (!ec) res.emplace(std::move(std::get<0>(won).res));
        } else {
            ec = net::error::timed_out;
        }
        if (!ec) {
            out.ok = true;
            out.status = static_cast<int>(res->result_int());
            out.body = std::move(res->body());
            if (res->keep_alive()) {
                impl->give_back(idx, std::move(conn));
            } else {
                conn->close();
            }
            co_return out;
        }
        conn->close();
        if (ec == net::error::timed_out) {
            out.failure = ep.url + path + ": timed out after " +
                          std::to_string(impl->timeout.count()) + " ms";
            co_return out;
        }
        out.failure = ep.url + path + ": " + ec.message();
        if (!reused) co_return out;
        impl->clear_idle(idx);
    }
    co_return out;
}

/// The token to send: empty without a username; authenticates when there is none or when
/// `refused` is the one in use. Calls that find no token at once may each authenticate (the
/// last token stored wins; etcd keeps the others valid until their TTL).
awaitable<std::string> auth_token(std::shared_ptr<Impl> impl, std::size_t idx, std::string op,
                                  std::optional<std::string> refused) {
    if (impl->username.empty()) co_return std::string();
    if (auto t = impl->current_token(); !t.empty() && (!refused || t != *refused)) co_return t;
    json body = {{"name", impl->username}, {"password", impl->password}};
    auto ex = co_await post(impl, idx, "/v3/auth/authenticate", body.dump(), "");
    if (!ex.ok) throw endpoint_failure{ex.failure};
    json answer;
    try {
        answer = parse_reply_body(ex.body);
    } catch (const json::exception&) {
        throw endpoint_failure{impl->endpoints[idx].url +
                               "/v3/auth/authenticate: malformed answer"};
    }
    if (ex.status != 200) {
        if (ex.status >= 500) {
            throw endpoint_failure{impl->endpoints[idx].url + "/v3/auth/authenticate: HTTP " +
                                   std::to_string(ex.status)};
        }
        throw_status(ex.status, answer, "authenticate as " + impl->username);
    }
    auto it = answer.find("token");
    if (it == answer.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
        throw_unavailable(op, "authenticate as " + impl->username + ": no token in the answer");
    }
    impl->set_token(it->get<std::string>());
    co_return it->get<std::string>();
}

/// POST to one endpoint with auth; returns the answer or throws endpoint_failure (try the
/// next endpoint) or status_error (etcd's answer).
awaitable<json> call_endpoint(std::shared_ptr<Impl> impl, std::size_t idx, std::string op,
                              std::string path, std::string payload) {
    const auto& url = impl->endpoints[idx].url;
    std::string used = co_await auth_token(impl, idx, op, std::nullopt);
    for (int attempt = 0;; ++attempt) {
        auto ex = co_await post(impl, idx, path, payload, used);
        if (!ex.ok) throw endpoint_failure{ex.failure};
        json answer;
        try {
            answer = parse_reply_body(ex.body);
        } catch (const json::exception&) {
            if (ex.status >= 500) {
                throw endpoint_failure{url + path + ": HTTP " + std::to_string(ex.status)};
            }
            throw endpoint_failure{url + path + ": malformed answer (HTTP " +
                                   std::to_string(ex.status) + ")"};
        }
        if (ex.status == 200 && answer.is_object()) {
            // A streaming answer wraps the message in "result", or an error in "error".
            if (auto r = answer.find("result"); r != answer.end() && r->is_object()) {
                co_return std::move(*r);
            }
            if (auto e = answer.find("error"); e != answer.end() && e->is_object()) {
                json flat = {{"code", e->value("grpc_code", 0)},
                             {"message", e->value("message", std::string())}};
                int http_status = e->value("http_code", 500);
                if (http_status >= 500) {
                    throw endpoint_failure{url + path + ": " + flat["message"].get<std::string>()};
                }
                throw_status(http_status, flat, "");
            }
            co_return answer;
        }
        if (ex.status == 200) throw endpoint_failure{url + path + ": malformed answer"};
        if (attempt == 0 && !impl->username.empty() && is_auth_error(ex.status, answer)) {
            used = co_await auth_token(impl, idx, op, used);
            continue;
        }
        if (ex.status >= 500) {
            std::string message;
            if (answer.is_object() && answer.contains("message") && answer["message"].is_string()) {
                message = answer["message"].get<std::string>();
            }
            throw endpoint_failure{url + path + ": HTTP " + std::to_string(ex.status) +
                                   (message.empty() ? "" : ": " + message)};
        }
        throw_status(ex.status, answer, "");
    }
}

/// Tries every endpoint in turn, from the one that last answered.
awaitable<json> call_any(std::shared_ptr<Impl> impl, std::string op, std::string path,
                         std::string payload) {
    const std::size_t n = impl->endpoints.size();
    const std::size_t start = impl->preferred.load(std::memory_order_relaxed) % n;
    std::string failures;
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t idx = (start + i) % n;
        try {
            json answer = co_await call_endpoint(impl, idx, op, path, payload);
            if (idx != start) impl->preferred.store(idx, std::memory_order_relaxed);
            co_return answer;
        } catch (const endpoint_failure& f) {
            if (!failures.empty()) failures += "; ";
            failures += f.detail;
        }
    }
    throw_unavailable(op, failures);
}

}  // namespace

Client::Client(net::any_io_executor ex, std::vector<std::string> endpoints, std::string username,
               std::string password, std::chrono::milliseconds timeout, TlsSource tls)
    : impl_(std::make_shared<Impl>()) {
    impl_->tls = std::move(tls);
    if (endpoints.empty()) throw std::invalid_argument("etcd: no endpoints");
    for (const auto& e : endpoints) impl_->endpoints.push_back(parse_endpoint(e));
    impl_->ex = std::move(ex);
    impl_->username = std::move(username);
    impl_->password = std::move(password);
    impl_->timeout = timeout;
    impl_->idle.resize(impl_->endpoints.size());
}

Client::~Client() {
    // Idle connections close now; calls still in flight hold their own and the Impl.
    for (std::size_t i = 0; i < impl_->idle.size(); ++i) impl_->clear_idle(i);
}

awaitable<json> Client::call(std::string op, std::string path, json body) {
    // On a strand of its own: the attempt's `exchange || timer` and the socket's handlers
    // never run at once on two threads of a multi-threaded io_context.
    co_return co_await net::co_spawn(net::make_strand(impl_->ex),
                                     call_any(impl_, std::move(op), std::move(path), body.dump()),
                                     use_awaitable);
}

awaitable<RangeResult> Client::range(std::string op, std::string key, std::string range_end,
                                     std::int64_t limit, std::int64_t revision, bool keys_only) {
    json body = {{"key", b64(key)}};
    if (!range_end.empty()) body["range_end"] = b64(range_end);
    if (limit > 0) body["limit"] = std::to_string(limit);
    if (revision > 0) body["revision"] = std::to_string(revision);
    if (keys_only) body["keys_only"] = true;
    json answer = co_await call(op, "/v3/kv/range", std::move(body));
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
    co_return out;
}

awaitable<std::optional<KeyValue>> Client::get(std::string op, std::string key) {
    auto r = co_await range(op, key);
    for (auto& kv : r.kvs) {
        if (kv.key == key) co_return std::move(kv);
    }
    co_return std::nullopt;
}

awaitable<PrefixResult> Client::get_prefix(std::string op, std::string prefix) {
    const std::string end = prefix_end(prefix);
    for (int attempt = 0;; ++attempt) {
        PrefixResult out;
        std::string from(prefix);
        try {
            for (;;) {
                auto page = co_await range(op, from, end, range_page, out.revision);
                if (out.revision == 0) out.revision = page.revision;
                for (auto& kv : page.kvs) out.kvs.push_back(std::move(kv));
                if (!page.more || out.kvs.empty()) co_return out;
                from = out.kvs.back().key;
                from.push_back('\0');
            }
        } catch (const status_error& e) {
            // The pinned revision was compacted between two pages: read again from the top.
            if (e.code() != code_out_of_range || attempt >= 3) throw;
        }
    }
}

awaitable<Client::TxnResult> Client::txn(std::string op, json compare, json success, json failure) {
    json body = {{"compare", std::move(compare)}, {"success", std::move(success)}};
    if (!failure.empty()) body["failure"] = std::move(failure);
    json answer = co_await call(op, "/v3/kv/txn", std::move(body));
    TxnResult out;
    out.succeeded = answer.value("succeeded", false);
    if (auto h = answer.find("header"); h != answer.end() && h->is_object()) {
        out.revision = int64_field(*h, "revision");
    }
    if (auto r = answer.find("responses"); r != answer.end() && r->is_array()) {
        out.responses = std::move(*r);
    }
    co_return out;
}

awaitable<std::int64_t> Client::lease_grant(std::string op, std::int64_t ttl_s) {
    json body = {{"TTL", std::to_string(ttl_s)}, {"ID", "0"}};
    json answer = co_await call(op, "/v3/lease/grant", std::move(body));
    if (auto e = answer.find("error");
        e != answer.end() && e->is_string() && !e->get<std::string>().empty()) {
        throw_unavailable(op, "lease grant: " + e->get<std::string>());
    }
    auto id = int64_field(answer, "ID");
    if (id == 0) throw std::invalid_argument("lease grant answer has no ID");
    co_return id;
}

awaitable<std::int64_t> Client::lease_keepalive(std::string op, std::int64_t id) {
    json body = {{"ID", std::to_string(id)}};
    json answer = co_await call(op, "/v3/lease/keepalive", std::move(body));
    co_return int64_field(answer, "TTL");
}

awaitable<void> Client::lease_revoke(std::string op, std::int64_t id) {
    json body = {{"ID", std::to_string(id)}};
    try {
        co_await call(op, "/v3/lease/revoke", std::move(body));
    } catch (const status_error& e) {
        if (e.code() != code_not_found) throw;
    }
}

// --- watch ---------------------------------------------------------------------------------

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

/// Connects, sends the create request and reads the answer's header. The references are to
/// the awaiting frame of Client::watch, which outlives this call (it awaits it directly).
/// Errors come back in the result (see exchange()).
awaitable<beast::error_code> open_stream(std::optional<ConnStream>& stream, Endpoint ep,
                                         const request_t& req, beast::flat_buffer& buffer,
                                         http::response_parser<http::empty_body>& parser,
                                         std::shared_ptr<ssl::context> tls) {
    try {
        co_await connect_to(stream, ep, std::move(tls));
        co_await http::async_write(*stream, req, use_awaitable);
        co_await http::async_read_header(*stream, buffer, parser, use_awaitable);
    } catch (const boost::system::system_error& e) {
        co_return e.code();
    }
    co_return beast::error_code{};
}

}  // namespace

namespace {

/// Hands each whole line of `pending` (a watch stream's newline-delimited messages) to
/// `on_message`, leaving a partial line in `pending`. True once a message says the watch was
/// canceled (the watch ends); throws as the stream's failures do (ETCD_UNAVAILABLE, the
/// status of an error message).
bool deliver_watch_lines(std::string& pending, const std::string& op, const std::string& url,
                         const std::function<void(const WatchMessage&)>& on_message) {
    for (auto nl = pending.find('\n'); nl != std::string::npos; nl = pending.find('\n')) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
        json message;
        try {
            message = parse_json(line);
        } catch (const json::exception&) {
            throw_unavailable(op, url + "/v3/watch: malformed message");
        }
        if (auto e = message.find("error"); e != message.end() && e->is_object()) {
            throw_status(e->value("http_code", 500),
                         json{{"code", e->value("grpc_code", 0)},
                              {"message", e->value("message", std::string())}},
                         "watch");
        }
        auto r = message.find("result");
        if (r == message.end() || !r->is_object()) {
            throw_unavailable(op, url + "/v3/watch: message without a result");
        }
        WatchMessage decoded;
        try {
            decoded = decode_watch_message(*r);
        } catch (const std::invalid_argument& e) {
            throw_unavailable(op, url + "/v3/watch: " + e.what());
        }
        on_message(decoded);
        if (decoded.canceled) return true;
    }
    return false;
}

}  // namespace

awaitable<void> Client::watch(std::string op, std::string prefix, std::int64_t start_revision,
                              std::function<void(const WatchMessage&)> on_message) {
    using namespace net::experimental::awaitable_operators;
    auto impl = impl_;  // the stream may outlive nothing, but keep what it reads alive
    json create = {{"key", b64(prefix)}, {"range_end", b64(prefix_end(prefix))}};
    if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
    const std::string payload = json{{"create_request", std::move(create)}}.dump();
    const std::size_t n = impl->endpoints.size();
    const std::size_t start = impl->preferred.load(std::memory_order_relaxed) % n;
    std::string failures;
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t idx = (start + i) % n;
        const Endpoint& ep = impl->endpoints[idx];
        std::string auth;
        try {
            auth = co_await net::co_spawn(net::make_strand(impl->ex),
                                          auth_token(impl, idx, op, std::nullopt), use_awaitable);
        } catch (const endpoint_failure& f) {
            failures += (failures.empty() ? "" : "; ") + f.detail;
            continue;
        }
        std::optional<ConnStream> stream;
        const request_t req = make_request(ep, "/v3/watch", payload, auth);
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

        std::string failure;
        net::steady_timer timer(co_await net::this_coro::executor, impl->timeout);
        std::shared_ptr<ssl::context> tls;  // a named local: see post()
        if (ep.https && impl->tls) tls = impl->tls();
        auto won = co_await (open_stream(stream, ep, req, buffer, parser, std::move(tls)) ||
                             timer.async_wait(as_tuple_awaitable));
        if (won.index() == 1) {
            failure = "timed out";
        } else if (auto ec = std::get<0>(won)) {
            failure = ec.message();
        }
        if (!failure.empty()) {
            failures += (failures.empty() ? "" : "; ") + ep.url + "/v3/watch: " + failure;
            continue;
        }
        if (parser.get().result() != http::status::ok || !parser.chunked()) {
            failures += (failures.empty() ? "" : "; ") + ep.url + "/v3/watch: HTTP " +
                        std::to_string(parser.get().result_int()) +
                        (parser.chunked() ? "" : ", not a stream");
            continue;
        }
        impl->preferred.store(idx, std::memory_order_relaxed);

        // The stream: newline-delimited JSON messages inside chunks, until it ends.
        for (;;) {
            if (deliver_watch_lines(pending, op, ep.url, on_message)) co_return;
            if (parser.is_done()) co_return;
            auto [ec, bytes] =
                co_await http::async_read_some(*stream, buffer, parser, as_tuple_awaitable);
            (void)bytes;
            if (ec) co_return;  // broken, closed or cancelled: the caller lists and watches again
        }
    }
    throw_unavailable(op, failures);
}

}  // namespace sandboxd::etcd
