#include <sandboxd/core/lease.hpp>
#include <sandboxd/core/lease_fields.hpp>

#include <cerrno>
#include <chrono>
#include <ctime>

#include <sys/random.h>

namespace sandboxd {

std::string_view to_string(lease_status s) noexcept {
    switch (s) {
        case lease_status::active: return "active";
        case lease_status::released: return "released";
        case lease_status::expired: return "expired";
        case lease_status::failed: return "failed";
        case lease_status::pending_cleanup: return "pending_cleanup";
        case lease_status::retained: return "retained";
    }
    return "failed";
}

std::optional<lease_status> parse_lease_status(std::string_view s) noexcept {
    for (auto st : {lease_status::active, lease_status::released, lease_status::expired,
                    lease_status::failed, lease_status::pending_cleanup, lease_status::retained}) {
        if (to_string(st) == s) return st;
    }
    return std::nullopt;
}

std::int64_t now_ms() noexcept {
    using namespace std::chrono;
    return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

std::string format_rfc3339(std::int64_t ms) {
    std::time_t secs = static_cast<std::time_t>(ms / 1000);
    auto millis = static_cast<int>(ms % 1000);
    if (millis < 0) {
        millis += 1000;
        --secs;
    }
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[80];
    std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, millis);
    return buf;
}

std::string random_hex(std::size_t bytes) {
    std::string raw(bytes, '\0');
    std::size_t done = 0;
    while (done < bytes) {
        auto n = ::getrandom(raw.data() + done, bytes - done, 0);
        if (n > 0) done += static_cast<std::size_t>(n);  // EINTR: try again
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    out.reserve(bytes * 2);
    for (char c : raw) {
        const auto b = static_cast<unsigned char>(c);
        out.push_back(digits[b >> 4]);
        out.push_back(digits[b & 0xf]);
    }
    return out;
}

bool Lease::is_live(std::int64_t at_ms) const noexcept {
    return status == lease_status::active && (!expires_at_ms || *expires_at_ms > at_ms);
}

namespace {

using json = nlohmann::json;

// The wire value of one member; std::nullopt for an absent optional.
std::optional<json> wire_value(const std::string& v, const LeaseField&) { return json(v); }
std::optional<json> wire_value(const lease_status& v, const LeaseField&) {
    return json(std::string(to_string(v)));
}
std::optional<json> wire_value(std::int64_t v, const LeaseField& f) {
    return f.has(lease_field_flags::wire_time) ? json(format_rfc3339(v)) : json(v);
}
std::optional<json> wire_value(int v, const LeaseField&) { return json(v); }
std::optional<json> wire_value(const json& v, const LeaseField&) { return v; }
template <typename T>
std::optional<json> wire_value(const std::optional<T>& v, const LeaseField& f) {
    if (!v) return std::nullopt;
    return wire_value(*v, f);
}

std::string_view sql_type(const LeaseMember& m) {
    struct {
        std::string_view operator()(std::string Lease::*) const { return "TEXT NOT NULL"; }
        std::string_view operator()(std::optional<std::string> Lease::*) const { return "TEXT"; }
        std::string_view operator()(lease_status Lease::*) const { return "TEXT NOT NULL"; }
        std::string_view operator()(std::int64_t Lease::*) const { return "INTEGER NOT NULL"; }
        std::string_view operator()(std::optional<std::int64_t> Lease::*) const {
            return "INTEGER";
        }
        std::string_view operator()(int Lease::*) const { return "INTEGER NOT NULL"; }
        std::string_view operator()(json Lease::*) const { return "TEXT NOT NULL"; }
    } visitor;
    return std::visit(visitor, m);
}

}  // namespace

json to_json(const Lease& l) {
    json j = json::object();
    for (const auto& f : lease_fields) {
        if (!f.on_wire()) continue;
        auto value = std::visit([&](auto member) { return wire_value(l.*member, f); }, f.member);
        if (value) {
            j[std::string(f.wire)] = std::move(*value);
        } else if (!f.has(lease_field_flags::omit_if_absent)) {
            j[std::string(f.wire)] = nullptr;
        }
    }
    return j;
}

const std::string& lease_column_list() {
    static const std::string list = [] {
        std::string out;
        for (const auto& f : lease_fields) {
            if (!f.stored()) continue;
            if (!out.empty()) out += ", ";
            out += f.column;
        }
        return out;
    }();
    return list;
}

const std::string& lease_column_definitions() {
    static const std::string definitions = [] {
        std::string out;
        for (const auto& f : lease_fields) {
            if (!f.stored()) continue;
            if (!out.empty()) out += ",\n    ";
            out += std::string(f.column) + " " + std::string(sql_type(f.member));
            if (!f.sql_extra.empty()) out += " " + std::string(f.sql_extra);
        }
        return out;
    }();
    return definitions;
}

}  // namespace sandboxd
