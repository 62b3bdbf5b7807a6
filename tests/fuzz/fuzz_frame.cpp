// libFuzzer target: the binary frame decoder (docs/protocol.md section 4). Any input decodes to
// a data frame, a credit frame or a FrameError; what decodes re-encodes to the same bytes.
#include <sandboxd/core/frame.hpp>

#include <cstdlib>
#include <string>
#include <variant>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view message(reinterpret_cast<const char*>(data), size);
    for (const std::size_t max_payload : {std::size_t{262144}, std::size_t{16}}) {
        const auto decoded = sandboxd::decode_frame(message, max_payload);
        if (const auto* d = std::get_if<sandboxd::DataFrame>(&decoded)) {
            if (d->payload.empty() || d->payload.size() > max_payload) std::abort();
            if (sandboxd::encode_data(d->channel, d->stream, d->payload) != message) std::abort();
        } else if (const auto* c = std::get_if<sandboxd::CreditFrame>(&decoded)) {
            if (c->bytes == 0) std::abort();
            if (sandboxd::encode_credit(c->channel, c->stream, c->bytes) != message) std::abort();
        } else if (std::get<sandboxd::FrameError>(decoded).what.empty()) {
            std::abort();  // every rejection says why
        }
    }
    return 0;
}
