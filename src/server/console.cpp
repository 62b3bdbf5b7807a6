#include "server/console.hpp"

#include <sandboxd/core/base64.hpp>

#include <boost/beast/core/string.hpp>

#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace sandboxd {
namespace fs = std::filesystem;

namespace {

struct Known {
    const char* name;
    const char* content_type;
};

// Every file the page needs; nothing else under /console is served.
constexpr std::array<Known, 6> known_files = {{
    {"index.html", "text/html; charset=utf-8"},
    {"console.js", "text/javascript; charset=utf-8"},
    {"console.css", "text/css; charset=utf-8"},
    {"xterm.js", "text/javascript; charset=utf-8"},
    {"xterm.css", "text/css; charset=utf-8"},
    {"addon-fit.js", "text/javascript; charset=utf-8"},
}};

fs::path default_dir() {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) return {};
    fs::path build = self.parent_path() / "console";
    if (fs::exists(build / "index.html", ec)) return build;
    return self.parent_path().parent_path() / "share" / "sandboxd" / "console";
}

}  // namespace

ConsoleAssets ConsoleAssets::load(const std::string& dir) {
    ConsoleAssets a;
    const fs::path root = dir.empty() ? default_dir() : fs::path(dir);
    a.dir_ = root.string();
    for (const auto& k : known_files) {
        const fs::path path = root / k.name;
        std::ifstream in(path, std::ios::binary);
        if (!in) {
            a.problem_ = "cannot read " + path.string() + " (build the console: it needs npm)";
            a.files_.clear();
            return a;
        }
        std::ostringstream body;
        body << in.rdbuf();
        a.files_.emplace(k.name, File{k.content_type, body.str()});
    }
    a.problem_.clear();
    return a;
}

const ConsoleAssets::File* ConsoleAssets::find(std::string_view target) const {
    if (const auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
    std::string_view name;
    if (target == "/console" || target == "/console/") {
        name = "index.html";
    } else if (target.starts_with("/console/")) {
        name = target.substr(9);
    } else {
        return nullptr;
    }
    const auto it = files_.find(name);
    return it == files_.end() ? nullptr : &it->second;
}

std::optional<std::string> bearer_from_subprotocols(std::string_view header) {
    std::size_t pos = 0;
    while (pos <= header.size()) {
        const auto comma = header.find(',', pos);
        auto item = header.substr(pos, comma == std::string_view::npos ? header.npos : comma - pos);
        while (!item.empty() && (item.front() == ' ' || item.front() == '\t'))
            item.remove_prefix(1);
        while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
        if (item.starts_with(bearer_subprotocol_prefix)) {
            std::string b64(item.substr(bearer_subprotocol_prefix.size()));
            if (b64.empty()) return std::nullopt;
            for (char& c : b64) {
                if (c == '-') {
                    c = '+';
                } else if (c == '_') {
                    c = '/';
                } else if (c == '+' || c == '/' || c == '=') {
                    return std::nullopt;  // base64url only, unpadded
                }
            }
            while (b64.size() % 4 != 0) b64.push_back('=');
            try {
                return base64_decode(b64);
            } catch (const base64_error&) {
                return std::nullopt;
            }
        }
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
    }
    return std::nullopt;
}

bool origin_matches_host(std::string_view origin, std::string_view host) {
    const auto scheme_end = origin.find("://");
    if (scheme_end == std::string_view::npos || host.empty()) return false;
    const auto scheme = origin.substr(0, scheme_end);
    if (!boost::beast::iequals(scheme, "http") && !boost::beast::iequals(scheme, "https"))
        return false;
    auto authority = origin.substr(scheme_end + 3);
    if (authority.find('/') != std::string_view::npos) return false;  // an Origin has no path
    return boost::beast::iequals(authority, host);
}

}  // namespace sandboxd
