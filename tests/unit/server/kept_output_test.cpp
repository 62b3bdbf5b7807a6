// KeptOutput (src/server/kept_output.hpp): the last `capacity` bytes of each stream at their
// absolute offsets, past the capacity, checked against the whole output kept in the test's
// memory; the files it makes, punches and removes; its open by a later process; the errors
// that change nothing.
#include "server/kept_output.hpp"
#include "support/temp_dir.hpp"

#include <sandboxd/core/errors.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

using namespace sandboxd;
using namespace sandboxd::test;
namespace fs = std::filesystem;

namespace {

/// What `kept` holds of `stream` from `offset` to its end.
std::string read_from(const KeptOutput& kept, output_stream stream, std::uint64_t offset) {
    std::string out(kept.end(stream) - offset, '\0');
    REQUIRE(kept.read(stream, offset, out) == out.size());
    return out;
}

/// `n` bytes that tell their offset apart (a counter, not a repeated byte).
std::string pattern(std::uint64_t from, std::size_t n) {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((from + i) * 131 % 251);
    return s;
}

}  // namespace

TEST_CASE("Kept output below its capacity keeps every byte at its offset", "[kept_output]") {
    TempDir tmp;
    auto kept = KeptOutput::create(tmp.path() / "ch", 8192);
    struct stat st {};
    REQUIRE(::stat((tmp.path() / "ch").c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    // The size is the offset; the capacity is reserved at the open.
    CHECK(fs::file_size(tmp.path() / "ch" / "stdout") == 0);
    REQUIRE(::stat((tmp.path() / "ch" / "stdout").c_str(), &st) == 0);
    CHECK(st.st_blocks * 512 >= 8192);
    kept->append(output_stream::out, "hello ");
    kept->append(output_stream::err, "oops");
    kept->append(output_stream::out, "world");
    CHECK(kept->end(output_stream::out) == 11);
    CHECK(kept->end(output_stream::err) == 4);
    CHECK(kept->first_kept(output_stream::out) == 0);
    CHECK(read_from(*kept, output_stream::out, 0) == "hello world");
    CHECK(read_from(*kept, output_stream::out, 6) == "world");
    CHECK(read_from(*kept, output_stream::err, 0) == "oops");
    char none[4];
    CHECK(kept->read(output_stream::out, 11, none) == 0);  // at the end: nothing yet
    CHECK_THROWS_AS(kept->read(output_stream::out, 12, none), std::out_of_range);
}

TEST_CASE("Kept output past its capacity keeps the last capacity bytes across the wrap",
          "[kept_output]") {
    TempDir tmp;
    auto kept = KeptOutput::create(tmp.path() / "ch", 4096);
    kept->append(output_stream::out, pattern(0, 3000));
    kept->append(output_stream::out, pattern(3000, 3000));  // wraps at 4096
    CHECK(kept->end(output_stream::out) == 6000);
    CHECK(kept->first_kept(output_stream::out) == 6000 - 4096);
    CHECK(read_from(*kept, output_stream::out, 6000 - 4096) == pattern(6000 - 4096, 4096));
    CHECK(read_from(*kept, output_stream::out, 5000) == pattern(5000, 1000));
    char one[1];
    CHECK_THROWS_AS(kept->read(output_stream::out, 6000 - 4097, one), std::out_of_range);
    // One append larger than the ring keeps its last 4096 bytes.
    kept->append(output_stream::out, pattern(6000, 10000));
    CHECK(kept->end(output_stream::out) == 16000);
    CHECK(read_from(*kept, output_stream::out, 16000 - 4096) == pattern(16000 - 4096, 4096));
    CHECK(kept->end(output_stream::err) == 0);  // the other stream is its own
}

TEST_CASE("Kept output matches the whole output at every offset, whatever the appends",
          "[kept_output]") {
    TempDir tmp;
    constexpr std::uint64_t capacity = 3 * 4096;
    auto kept = KeptOutput::create(tmp.path() / "ch", capacity);
    std::mt19937 rng(46);
    std::string whole[2];
    for (int i = 0; i < 400; ++i) {
        const auto s = rng() % 2 ? output_stream::out : output_stream::err;
        auto& w = whole[s == output_stream::err ? 1 : 0];
        const auto n = static_cast<std::size_t>(rng() % 5000);
        const auto bytes = pattern(w.size() + (s == output_stream::err ? 7 : 0), n);
        kept->append(s, bytes);
        w += bytes;
        REQUIRE(kept->end(s) == w.size());
        const auto first = kept->first_kept(s);
        REQUIRE(first == (w.size() > capacity ? w.size() - capacity : 0));
        const auto from = first + rng() % (w.size() - first + 1);
        REQUIRE(read_from(*kept, s, from) == w.substr(from));
    }
}

TEST_CASE("Kept output refuses what it cannot keep and leaves nothing behind", "[kept_output]") {
    TempDir tmp;
    CHECK_THROWS_AS(KeptOutput::create(tmp.path() / "small", 4095), std::invalid_argument);
    CHECK_THROWS_AS(KeptOutput::create(tmp.path() / "big", (1ULL << 30) + 1),
                    std::invalid_argument);
    CHECK_FALSE(fs::exists(tmp.path() / "small"));
    CHECK_FALSE(fs::exists(tmp.path() / "big"));
    fs::create_directory(tmp.path() / "taken");
    CHECK_THROWS_AS(KeptOutput::create(tmp.path() / "taken", 4096), rpc_error);
    CHECK(fs::is_empty(tmp.path() / "taken"));  // what was there is left as it was
    CHECK_THROWS_AS(KeptOutput::create(tmp.path() / "no" / "parent", 4096), rpc_error);

    auto kept = KeptOutput::create(tmp.path() / "ch", 4096);
    kept->append(output_stream::out, "x");
    kept->remove();
    CHECK_FALSE(fs::exists(tmp.path() / "ch"));
    CHECK(read_from(*kept, output_stream::out, 0) == "x");  // its descriptors outlive the files
}

TEST_CASE("Kept output closes its files and opens them again by path to read", "[kept_output]") {
    TempDir tmp;
    auto kept = KeptOutput::create(tmp.path() / "ch", 4096);
    kept->append(output_stream::out, pattern(0, 6000));  // wrapped
    kept->append(output_stream::err, "e");
    kept->close_files();
    CHECK_FALSE(kept->files_open());
    char buf[4];
    CHECK_THROWS_AS(kept->read(output_stream::out, 5000, buf), std::logic_error);
    kept->reopen();
    CHECK(kept->files_open());
    CHECK(read_from(*kept, output_stream::out, kept->first_kept(output_stream::out)) ==
          pattern(6000 - 4096, 4096));
    CHECK(read_from(*kept, output_stream::err, 0) == "e");
    // Gone from under it: the reopen says which file, and leaves it closed.
    kept->close_files();
    kept->remove();
    try {
        kept->reopen();
        FAIL("reopened removed files");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::provider_error);
        CHECK(std::string(e.what()).find("stdout") != std::string::npos);
    }
    CHECK_FALSE(kept->files_open());
}

TEST_CASE("Kept output moves bytes in from a pipe, and a later process opens it at its offsets",
          "[kept_output]") {
    TempDir tmp;
    constexpr std::uint64_t capacity = 4 * 4096;
    std::string whole;
    {
        auto kept = KeptOutput::create(tmp.path() / "ch", capacity);
        int p[2];
        REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
        for (int i = 0; i < 12; ++i) {
            const auto bytes = pattern(whole.size(), 3000 + 17 * static_cast<std::size_t>(i));
            REQUIRE(::write(p[1], bytes.data(), bytes.size()) ==
                    static_cast<ssize_t>(bytes.size()));
            kept->splice_in(output_stream::out, p[0], bytes.size());
            whole += bytes;
            REQUIRE(kept->end(output_stream::out) == whole.size());
        }
        int left = -1;
        REQUIRE(::ioctl(p[0], FIONREAD, &left) == 0);
        CHECK(left == 0);  // exactly what was asked for, nothing more
        kept->append(output_stream::err, "e1");
        ::close(p[0]);
        ::close(p[1]);
    }  // the process that kept it is gone: only the files are left
    auto again = KeptOutput::open(tmp.path() / "ch", capacity);
    CHECK(again->end(output_stream::out) == whole.size());
    CHECK(again->end(output_stream::err) == 2);
    const auto first = again->first_kept(output_stream::out);
    CHECK(first == whole.size() - capacity);
    CHECK(read_from(*again, output_stream::out, first) == whole.substr(first));
    again->append(output_stream::out, "more");
    whole += "more";
    CHECK(read_from(*again, output_stream::out, whole.size() - 10) ==
          whole.substr(whole.size() - 10));
    CHECK_THROWS_AS(KeptOutput::open(tmp.path() / "missing", capacity), rpc_error);
}

TEST_CASE("Kept output holds about its capacity on disk however much passes through",
          "[kept_output]") {
    TempDir tmp;
    constexpr std::uint64_t capacity = 64 * 1024;
    auto kept = KeptOutput::create(tmp.path() / "ch", capacity);
    const std::string chunk = pattern(0, 60000);
    for (int i = 0; i < 200; ++i) kept->append(output_stream::out, chunk);  // 12 MB
    struct stat st {};
    REQUIRE(::stat((tmp.path() / "ch" / "stdout").c_str(), &st) == 0);
    CHECK(static_cast<std::uint64_t>(st.st_size) == 200 * chunk.size());
    // The capacity, a punch step (an eighth) and the pages at either edge.
    CHECK(static_cast<std::uint64_t>(st.st_blocks) * 512 <= capacity + capacity / 8 + 3 * 4096);
    const auto first = kept->first_kept(output_stream::out);
    std::string tail(kept->end(output_stream::out) - first, '\0');
    REQUIRE(kept->read(output_stream::out, first, tail) == tail.size());
    CHECK(tail.substr(tail.size() - 100) == chunk.substr(chunk.size() - 100));
}
