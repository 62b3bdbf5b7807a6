// libFuzzer target: the config parser and its cross-field checks (src/core/config.cpp). Any
// text either gives a Config or throws config_error naming the field; and what parses prints
// (config_to_json) and parses again to the same effective config.
#include <sandboxd/core/config.hpp>

#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    sandboxd::Config config;
    try {
        config = sandboxd::parse_config(text);
        sandboxd::validate_config(config);
    } catch (const sandboxd::config_error& e) {
        if (std::string(e.what()).rfind("config: ", 0) != 0) std::abort();  // names the field
        return 0;
    }
    const auto printed = sandboxd::config_to_json(config);
    // Tokens are printed redacted; everything else must read back the same.
    if (!config.tokens.empty()) return 0;
    const auto again = sandboxd::parse_config(printed.dump());
    if (sandboxd::config_to_json(again) != printed) std::abort();
    return 0;
}
