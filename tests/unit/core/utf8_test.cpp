// Unit tests of sandboxd/core/utf8.hpp: output bytes as JSON text for leaseExecute.
#include <sandboxd/core/utf8.hpp>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <string>

using namespace sandboxd;

namespace {
const std::string fffd = "\xEF\xBF\xBD";
}

TEST_CASE("valid UTF-8 passes through unchanged", "[utf8]") {
    const std::string text = "plain ascii, caf\xC3\xA9, \xE2\x82\xAC, \xF0\x9F\x98\x80\n";
    CHECK(to_utf8_text(text) == text);
    CHECK(to_utf8_text("").empty());
}

TEST_CASE("bytes that are not UTF-8 become U+FFFD, one per byte", "[utf8]") {
    CHECK(to_utf8_text("a\xFF"
                       "b") == "a" + fffd + "b");
    CHECK(to_utf8_text("\xC0\xAF") == fffd + fffd);                        // overlong '/'
    CHECK(to_utf8_text("\xED\xA0\x80") == fffd + fffd + fffd);             // a surrogate
    CHECK(to_utf8_text("\xF4\x90\x80\x80") == fffd + fffd + fffd + fffd);  // > U+10FFFF
    CHECK(to_utf8_text("\x80") == fffd);                                   // a lone continuation
    // Every result is something nlohmann::json can serialise (it throws on invalid UTF-8).
    CHECK_NOTHROW(nlohmann::json(to_utf8_text("\xFE\xC3\x28\xE2\x28\xA1")).dump());
}

TEST_CASE("a sequence split across reads is kept whole", "[utf8]") {
    Utf8Text t;
    CHECK(t.feed("x\xF0\x9F") == "x");
    CHECK(t.feed("\x98").empty());
    CHECK(t.feed("\x80y") == "\xF0\x9F\x98\x80y");
    CHECK(t.finish().empty());
}

TEST_CASE("an incomplete sequence at the end becomes U+FFFD at finish", "[utf8]") {
    Utf8Text t;
    CHECK(t.feed("ok\xE2\x82") == "ok");
    CHECK(t.finish() == fffd + fffd);
    // A held prefix that the next read does not complete is replaced, the rest kept.
    Utf8Text u;
    CHECK(u.feed("\xE2").empty());
    CHECK(u.feed("A") == fffd + "A");
}
