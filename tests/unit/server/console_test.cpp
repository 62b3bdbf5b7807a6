// Unit tests of server/console.hpp: the browser's subprotocol token, the Origin check, and which
// names under /console are served.
#include "server/console.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>

using namespace sandboxd;
namespace fs = std::filesystem;

TEST_CASE("console: the token of a sandboxd.bearer subprotocol", "[unit][console]") {
    // "s3cret/+?" in base64url without padding is czNjcmV0Lys_ .
    CHECK(bearer_from_subprotocols("sandboxd.v1, sandboxd.bearer.czNjcmV0Lys_") == "s3cret/+?");
    CHECK(bearer_from_subprotocols("sandboxd.bearer.czNjcmV0Lys_,sandboxd.v1") == "s3cret/+?");
    CHECK(bearer_from_subprotocols("sandboxd.bearer.YQ") == "a");
    CHECK_FALSE(bearer_from_subprotocols("sandboxd.v1").has_value());
    CHECK_FALSE(bearer_from_subprotocols("").has_value());
    CHECK_FALSE(bearer_from_subprotocols("sandboxd.bearer.").has_value());
    // Standard base64's alphabet and padding are not base64url.
    CHECK_FALSE(bearer_from_subprotocols("sandboxd.bearer.czNjcmV0Lys/").has_value());
    CHECK_FALSE(bearer_from_subprotocols("sandboxd.bearer.YQ==").has_value());
    CHECK_FALSE(bearer_from_subprotocols("sandboxd.bearer.!!!!").has_value());
}

TEST_CASE("console: the Origin must name the Host", "[unit][console]") {
    CHECK(origin_matches_host("http://127.0.0.1:7800", "127.0.0.1:7800"));
    CHECK(origin_matches_host("https://Sandbox.Example:443", "sandbox.example:443"));
    CHECK(origin_matches_host("http://[::1]:7800", "[::1]:7800"));
    CHECK_FALSE(origin_matches_host("http://127.0.0.1:7801", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("http://evil.example", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("null", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("file://127.0.0.1:7800", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("http://127.0.0.1:7800/x", "127.0.0.1:7800"));
    CHECK_FALSE(origin_matches_host("http://127.0.0.1:7800", ""));
}

TEST_CASE("console: only the page's own files are served", "[unit][console]") {
    const fs::path dir =
        fs::temp_directory_path() / ("sandboxd-console-unit-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    for (const char* name : {"index.html", "console.js", "console.css", "xterm.js", "xterm.css"}) {
        std::ofstream(dir / name) << name;
    }
    // One file missing: the console is not available, and says which.
    auto missing = ConsoleAssets::load(dir.string());
    CHECK_FALSE(missing.available());
    CHECK(missing.problem().find("addon-fit.js") != std::string::npos);
    CHECK(missing.find("/console") == nullptr);

    std::ofstream(dir / "addon-fit.js") << "fit";
    std::ofstream(dir / "secret.txt") << "secret";
    auto assets = ConsoleAssets::load(dir.string());
    REQUIRE(assets.available());
    REQUIRE(assets.find("/console") != nullptr);
    CHECK(assets.find("/console")->body == "index.html");
    CHECK(assets.find("/console/")->content_type == "text/html; charset=utf-8");
    CHECK(assets.find("/console?x=1")->body == "index.html");
    CHECK(assets.find("/console/xterm.js")->content_type == "text/javascript; charset=utf-8");
    CHECK(assets.find("/console/addon-fit.js")->body == "fit");
    CHECK(assets.find("/console/secret.txt") == nullptr);
    CHECK(assets.find("/console/../secret.txt") == nullptr);
    CHECK(assets.find("/console/sub/xterm.js") == nullptr);
    CHECK(assets.find("/consolex") == nullptr);
    fs::remove_all(dir);
}
