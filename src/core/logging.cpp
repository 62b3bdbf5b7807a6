#include <sandboxd/core/logging.hpp>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace sandboxd {
namespace {

/// %* in the JSON pattern: the message, escaped as a JSON string body.
class json_escaped_message final : public spdlog::custom_flag_formatter {
public:
    void format(const spdlog::details::log_msg& msg, const std::tm&,
                spdlog::memory_buf_t& dest) override {
        static constexpr char hex[] = "0123456789abcdef";
        for (char ch : std::string_view(msg.payload.data(), msg.payload.size())) {
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
    std::unique_ptr<custom_flag_formatter> clone() const override {
        return std::make_unique<json_escaped_message>();
    }
};

}  // namespace

void setup_logging(const std::string& level, const std::string& format) {
    auto logger = std::make_shared<spdlog::logger>(
        "sandboxd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    if (format == "json") {
        formatter->add_flag<json_escaped_message>('*').set_pattern(
            R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","msg":"%*"})");
    } else {
        formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %l %v");
    }
    logger->set_formatter(std::move(formatter));
    logger->set_level(spdlog::level::from_str(level));
    logger->flush_on(spdlog::level::info);
    spdlog::set_default_logger(std::move(logger));
}

}  // namespace sandboxd
