#pragma once
// Namespace aliases and Asio/Beast includes, once, for every networking source file.
#include <sandboxd/core/async.hpp>  // awaitable<T>

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>

namespace sandboxd {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace websocket = boost::beast::websocket;
using tcp = boost::asio::ip::tcp;
/// An executor that is a strand (sessions get one per connection at accept).
using strand_t = net::any_io_executor;
inline constexpr auto use_awaitable = net::use_awaitable;
inline constexpr auto as_tuple_awaitable = net::as_tuple(net::use_awaitable);
}  // namespace sandboxd
