#include <sandboxd/core/json_limits.hpp>

#include <utility>

namespace sandboxd {
namespace {

using json = nlohmann::json;
using dom_parser = nlohmann::detail::json_sax_dom_parser<json>;

/// nlohmann's own DOM builder with a depth count in front of it. The parser calls these
/// members statically (sax_parse is a template over the SAX type), so the wrapper costs one
/// increment and compare per container. Returning false from start_* stops the parser at
/// once: nothing deeper than the limit is ever built.
class bounded_dom_parser : public dom_parser {
public:
    explicit bounded_dom_parser(json& result) : dom_parser(result, /*allow_exceptions_=*/false) {}

    bool start_object(std::size_t len) { return enter() && dom_parser::start_object(len); }
    bool end_object() {
        --depth_;
        return dom_parser::end_object();
    }
    bool start_array(std::size_t len) { return enter() && dom_parser::start_array(len); }
    bool end_array() {
        --depth_;
        return dom_parser::end_array();
    }
    template <class Exception>
    bool parse_error(std::size_t position, const std::string& last_token, const Exception& ex) {
        if (!exception_) {
            error_ = ex.what();
            exception_ = std::make_exception_ptr(ex);
        }
        return dom_parser::parse_error(position, last_token, ex);
    }

    bool too_deep() const noexcept { return too_deep_; }
    std::string take_error() { return std::move(error_); }
    std::exception_ptr take_exception() { return std::move(exception_); }

private:
    bool enter() {
        if (++depth_ <= max_json_depth) return true;
        too_deep_ = true;
        return false;
    }

    std::size_t depth_ = 0;
    bool too_deep_ = false;
    std::string error_;
    std::exception_ptr exception_;
};

}  // namespace

std::string json_too_deep_message() {
    return "nested deeper than " + std::to_string(max_json_depth) + " levels";
}

json_parse_result try_parse_json(std::string_view text, json_parse_options options) {
    json_parse_result out;
    json root;
    bounded_dom_parser sax(root);
    const bool ok = json::sax_parse(text, &sax, json::input_format_t::json, /*strict=*/true,
                                    options.ignore_comments);
    if (ok && !sax.is_errored()) {
        out.status = json_parse_status::ok;
        out.value = std::move(root);
        return out;
    }
    // root holds at most max_json_depth levels here; its destructor is iterative anyway.
    if (sax.too_deep()) {
        out.status = json_parse_status::too_deep;
        out.error = json_too_deep_message();
        out.exception =
            std::make_exception_ptr(json::parse_error::create(101, 0, out.error, nullptr));
        return out;
    }
    out.status = json_parse_status::malformed;
    out.error = sax.take_error();
    out.exception = sax.take_exception();
    if (!out.exception) {  // not reached: the parser reports every failure through parse_error
        out.error = "not JSON";
        out.exception =
            std::make_exception_ptr(json::parse_error::create(101, 0, out.error, nullptr));
    }
    return out;
}

json parse_json(std::string_view text, json_parse_options options) {
    auto r = try_parse_json(text, options);
    if (!r.ok()) std::rethrow_exception(r.exception);
    return std::move(r.value);
}

}  // namespace sandboxd
