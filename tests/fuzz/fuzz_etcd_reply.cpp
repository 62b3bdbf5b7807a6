// libFuzzer target: the etcd gateway reply decoders (src/registry/etcd_client.cpp): the body
// parser, range kvs (base64 keys and values, int64 fields as decimal strings) and txn
// responses. On malformed input each throws a std::exception that the client turns into
// REGISTRY_UNAVAILABLE; a crash or a non-std exception is a finding.
#include "registry/etcd_client.hpp"

#include <stdexcept>
#include <string>

namespace etcd = sandboxd::etcd;
using json = nlohmann::json;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string body(reinterpret_cast<const char*>(data), size);
    try {
        const json answer = etcd::parse_reply_body(body);
        if (!answer.is_object()) return 0;
        if (auto h = answer.find("header"); h != answer.end() && h->is_object()) {
            (void)etcd::int64_field(*h, "revision");
        }
        (void)etcd::int64_field(answer, "count");
        if (auto kvs = answer.find("kvs"); kvs != answer.end() && kvs->is_array()) {
            for (const auto& kv : *kvs) (void)etcd::decode_kv(kv);
        }
        if (auto rs = answer.find("responses"); rs != answer.end() && rs->is_array()) {
            for (const auto& r : *rs) (void)etcd::txn_range_kvs(r);
        }
    } catch (const std::exception&) {
        // json::exception, std::invalid_argument, std::out_of_range: the documented failures.
    }
    return 0;
}
