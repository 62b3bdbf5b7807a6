#include <sandboxd/core/logging.hpp>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <string>
#include <string_view>

namespace sandboxd {
namespace {

void append_json_escaped(std::string_view text, spdlog::memory_buf_t& dest) {
    static constexpr char hex[] = "0123456789abcdef";
    for (char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            dest.push_back('\\');
            dest.push_back(ch);
        } else if (c < 0x20) {
            const char esc[] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 0xf]};
            dest.append(esc, esc + sizeof esc);
        } else {
            dest.push_back(ch);
        }
    }
}

/// The words of a message that become fields of their own in JSON mode: `node=`, `lease=`,
/// `channel=` and `peer=` at the start or after a space, up to the next space.
constexpr std::array<std::string_view, 4> field_names = {"node", "lease", "channel", "peer"};

/// %* in the JSON pattern: `"msg":"<the message without those words>"`, then one
/// `,"<name>":"<value>"` per word (the first of each name), all JSON-escaped.
class json_message_and_fields final : public spdlog::custom_flag_formatter {
public:
    void format(const spdlog::details::log_msg& msg, const std::tm&,
                spdlog::memory_buf_t& dest) override {
        const std::string_view text(msg.payload.data(), msg.payload.size());
        std::array<std::string_view, field_names.size()> values{};
        std::string rest;
        rest.reserve(text.size());
        std::size_t pos = 0;
        while (pos <= text.size()) {
            const auto end = std::min(text.find(' ', pos), text.size());
            const std::string_view word = text.substr(pos, end - pos);
            bool taken = false;
            const auto eq = word.find('=');
            if (eq != std::string_view::npos && eq + 1 < word.size()) {
                for (std::size_t i = 0; i < field_names.size(); ++i) {
                    if (word.substr(0, eq) == field_names[i] && values[i].empty()) {
                        values[i] = word.substr(eq + 1);
                        taken = true;
                    }
                }
            }
            if (!taken) {
                if (!rest.empty()) rest.push_back(' ');
                rest.append(word);
            }
            pos = end + 1;
        }
        dest.append(std::string_view(R"("msg":")"));
        append_json_escaped(rest, dest);
        dest.push_back('"');
        for (std::size_t i = 0; i < field_names.size(); ++i) {
            if (values[i].empty()) continue;
            dest.append(std::string_view(R"(,")"));
            dest.append(field_names[i]);
            dest.append(std::string_view(R"(":")"));
            append_json_escaped(values[i], dest);
            dest.push_back('"');
        }
    }
    std::unique_ptr<custom_flag_formatter> clone() const override {
        return std::make_unique<json_message_and_fields>();
    }
};

/// %& in the text pattern under journald: the level as a syslog priority prefix ("<6>"), which
/// journald reads from a stream (sd-daemon(3)).
class syslog_priority final : public spdlog::custom_flag_formatter {
public:
    void format(const spdlog::details::log_msg& msg, const std::tm&,
                spdlog::memory_buf_t& dest) override {
        char prefix[] = "<6>";
        switch (msg.level) {
            case spdlog::level::trace:
            case spdlog::level::debug: prefix[1] = '7'; break;
            case spdlog::level::info: prefix[1] = '6'; break;
            case spdlog::level::warn: prefix[1] = '4'; break;
            case spdlog::level::err: prefix[1] = '3'; break;
            default: prefix[1] = '2'; break;
        }
        dest.append(prefix, prefix + 3);
    }
    std::unique_ptr<custom_flag_formatter> clone() const override {
        return std::make_unique<syslog_priority>();
    }
};

/// Whether stderr is the journald stream that systemd connected (JOURNAL_STREAM names its
/// device and inode, systemd.exec(5)).
bool stderr_is_journal() {
    const char* stream = std::getenv("JOURNAL_STREAM");
    if (stream == nullptr) return false;
    struct stat st {};
    if (::fstat(STDERR_FILENO, &st) != 0) return false;
    return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) == stream;
}

}  // namespace

void setup_logging(const std::string& level, const std::string& format) {
    auto logger = std::make_shared<spdlog::logger>(
        "sandboxd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    if (format == "json") {
        formatter->add_flag<json_message_and_fields>('*').set_pattern(
            R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l",%*})");
    } else if (stderr_is_journal()) {
        // journald keeps the time itself.
        formatter->add_flag<syslog_priority>('&').set_pattern("%&%l %v");
    } else {
        formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %l %v");
    }
    logger->set_formatter(std::move(formatter));
    logger->set_level(spdlog::level::from_str(level));
    logger->flush_on(spdlog::level::info);
    spdlog::set_default_logger(std::move(logger));
}

}  // namespace sandboxd
