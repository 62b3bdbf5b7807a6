#pragma once
// The leaseList cursor that both registry backends hand out and accept (registry.hpp,
// LeaseQuery::cursor): "<acquiredAt ms>:<lease id>" of the last lease of a page, so that a
// page continues after exactly that (acquiredAt, id) whatever the backend.
#include <sandboxd/core/lease.hpp>

#include <cstdint>
#include <string>
#include <utility>

namespace sandboxd {

/// The cursor that continues after `last`.
std::string encode_cursor(const Lease& last);

/// (acquiredAt ms, id) of a cursor. Throws rpc_error(errc::invalid_params, "cursor: malformed")
/// for anything encode_cursor() did not make. Pure; thread-safe.
std::pair<std::int64_t, std::string> decode_cursor(const std::string& cursor);

}  // namespace sandboxd
