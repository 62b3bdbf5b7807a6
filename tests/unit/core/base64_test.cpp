// Unit tests of sandboxd/core/base64.hpp: RFC 4648 section 10 vectors and malformed input.
#include <sandboxd/core/base64.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace sandboxd;

TEST_CASE("base64 encodes and decodes the RFC 4648 test vectors", "[base64]") {
    const std::vector<std::pair<std::string, std::string>> vectors = {
        {"", ""},
        {"f", "Zg=="},
        {"fo", "Zm8="},
        {"foo", "Zm9v"},
        {"foob", "Zm9vYg=="},
        {"fooba", "Zm9vYmE="},
        {"foobar", "Zm9vYmFy"},
    };
    for (const auto& [plain, encoded] : vectors) {
        CAPTURE(plain);
        CHECK(base64_encode(plain) == encoded);
        CHECK(base64_decode(encoded) == plain);
    }
}

TEST_CASE("base64 round-trips every byte value and both alphabet ends", "[base64]") {
    std::string all;
    for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
    for (std::size_t n = 0; n <= all.size(); n += 37) {
        const auto part = all.substr(all.size() - n);
        CHECK(base64_decode(base64_encode(part)) == part);
    }
    CHECK(base64_encode(std::string("\xfb\xff\xbf", 3)) == "+/+/");
    CHECK(base64_decode("+/+/") == std::string("\xfb\xff\xbf", 3));
    CHECK(base64_encode(std::string("\0\xff\n\r", 4)) == "AP8KDQ==");
}

TEST_CASE("base64 decoding rejects malformed text with the reason", "[base64]") {
    auto error_of = [](const std::string& text) -> std::string {
        try {
            base64_decode(text);
        } catch (const base64_error& e) {
            return e.what();
        }
        return "accepted";
    };
    SECTION("a length that is not a multiple of 4") {
        CHECK(error_of("Zg") == "base64: length 2 is not a multiple of 4");
        CHECK(error_of("Zm9vY") == "base64: length 5 is not a multiple of 4");
        CHECK(error_of("Zg=") == "base64: length 3 is not a multiple of 4");
    }
    SECTION("characters outside the alphabet") {
        CHECK(error_of("Zm9v!mFy") == "base64: invalid character at offset 4");
        CHECK(error_of("Zm-v") == "base64: invalid character at offset 2");  // base64url
        CHECK(error_of("Zm_v") == "base64: invalid character at offset 2");
        CHECK(error_of(std::string("Zm\0v", 4)) == "base64: invalid character at offset 2");
    }
    SECTION("whitespace and line breaks, which OpenSSL alone would skip") {
        CHECK(error_of("Zm9v    ") == "base64: invalid character at offset 4");
        CHECK(error_of("    Zm9v") == "base64: invalid character at offset 0");
        CHECK(error_of("Zm9\nvYmFy") != "accepted");
        CHECK(error_of("Zm9v\r\nYmFy") != "accepted");
        CHECK(error_of("Zm9vYmF\n") == "base64: invalid character at offset 7");
    }
    SECTION("padding anywhere but at the end, or too much of it") {
        CHECK(error_of("Zg==Zg==") == "base64: padding '=' before the end, at offset 2");
        CHECK(error_of("Z=9v") == "base64: padding '=' before the end, at offset 1");
        CHECK(error_of("Zm=v") == "base64: padding '=' before the end, at offset 2");
        CHECK(error_of("Z===") == "base64: padding '=' before the end, at offset 1");
        CHECK(error_of("====") == "base64: padding '=' before the end, at offset 0");
    }
    SECTION("and is an std::invalid_argument, as before") {
        CHECK_THROWS_AS(base64_decode("!!!!"), std::invalid_argument);
    }
}
