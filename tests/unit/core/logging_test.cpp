// The log formats (logging.hpp): JSON lines with node, lease, channel and peer as fields of
// their own, and `<N>` priority prefixes when stderr is the journal stream systemd named.
#include <sandboxd/core/logging.hpp>

#include <spdlog/spdlog.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

/// Runs `log` with stderr sent to a temporary file (and JOURNAL_STREAM naming that file when
/// `as_journal`), under setup_logging("info", format); returns the lines written.
template <class F>
std::vector<std::string> captured(const std::string& format, bool as_journal, F log) {
    char path[] = "/tmp/sandboxd-logging-XXXXXX";
    const int fd = ::mkstemp(path);
    REQUIRE(fd >= 0);
    const int saved = ::dup(STDERR_FILENO);
    REQUIRE(::dup2(fd, STDERR_FILENO) == STDERR_FILENO);
    struct stat st {};
    REQUIRE(::fstat(fd, &st) == 0);
    if (as_journal) {
        ::setenv("JOURNAL_STREAM",
                 (std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino)).c_str(), 1);
    } else {
        ::unsetenv("JOURNAL_STREAM");
    }
    sandboxd::setup_logging("info", format);
    log();
    spdlog::default_logger()->flush();
    ::dup2(saved, STDERR_FILENO);
    ::close(saved);
    ::close(fd);
    ::unsetenv("JOURNAL_STREAM");
    sandboxd::setup_logging("info", "text");
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    ::unlink(path);
    return lines;
}

}  // namespace

TEST_CASE("JSON logs take node, lease, channel and peer out of msg", "[logging]") {
    const auto lines = captured("json", false, [] {
        spdlog::info(
            "channel=7 lease=lse_abc opened: sh pty=false peer=127.0.0.1:5 (connection channel 2)");
        spdlog::warn("node=n1 fenced: membership not renewed for 2100 ms");
        spdlog::info("plain \"quoted\" text with a=b and node= empty");
    });
    REQUIRE(lines.size() == 3);
    const auto a = nlohmann::json::parse(lines[0]);
    CHECK(a["level"] == "info");
    CHECK(a["channel"] == "7");
    CHECK(a["lease"] == "lse_abc");
    CHECK(a["peer"] == "127.0.0.1:5");
    CHECK(a["msg"] == "opened: sh pty=false (connection channel 2)");
    CHECK(a.contains("time"));
    CHECK_FALSE(a.contains("node"));
    const auto b = nlohmann::json::parse(lines[1]);
    CHECK(b["level"] == "warning");
    CHECK(b["node"] == "n1");
    CHECK(b["msg"] == "fenced: membership not renewed for 2100 ms");
    const auto c = nlohmann::json::parse(lines[2]);
    CHECK(c["msg"] == "plain \"quoted\" text with a=b and node= empty");
    CHECK_FALSE(c.contains("node"));
}

TEST_CASE("Text logs under journald start with a syslog priority", "[logging]") {
    const auto journal = captured("text", true, [] {
        spdlog::info("one");
        spdlog::warn("two");
        spdlog::error("three");
    });
    REQUIRE(journal.size() == 3);
    CHECK(journal[0] == "<6>info one");
    CHECK(journal[1] == "<4>warning two");
    CHECK(journal[2] == "<3>error three");
    // Elsewhere (a file, a terminal, a container's log): the time first, no prefix.
    const auto plain = captured("text", false, [] { spdlog::info("one"); });
    REQUIRE(plain.size() == 1);
    CHECK(plain[0].find("Z info one") != std::string::npos);
    CHECK(plain[0][0] != '<');
}
