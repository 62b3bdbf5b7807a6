#include <sandboxd/core/metrics.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <type_traits>
#include <utility>

namespace sandboxd {
namespace {

constexpr auto relaxed = std::memory_order_relaxed;
constexpr double infinity = std::numeric_limits<double>::infinity();

template <class Metric>
constexpr const char* type_name() {
    if constexpr (std::is_same_v<Metric, Counter>) {
        return "counter";
    } else if constexpr (std::is_same_v<Metric, Gauge>) {
        return "gauge";
    } else {
        static_assert(std::is_same_v<Metric, Histogram>);
        return "histogram";
    }
}

void append_number(std::string& out, double v) {
    if (std::isnan(v)) {
        out += "NaN";
        return;
    }
    if (std::isinf(v)) {
        out += v > 0 ? "+Inf" : "-Inf";
        return;
    }
    std::array<char, 32> buf{};
    // An integer in full, not in the exponent form that the shortest text may be ("1e+10");
    // below 2^63, so that the conversion is exact. Other values: the fewest digits that read
    // back to `v`, with an exponent where %g would have one, as the Go client writes them
    // ("0.0005", not "5e-04": an `le` label is matched as text; "1.2345675e+06").
    char* const first = buf.data();
    char* const last = first + buf.size();
    const auto [end, ec] = v == std::trunc(v) && std::fabs(v) < 9.2e18
                               ? std::to_chars(first, last, static_cast<long long>(v))
                               : std::to_chars(first, last, v, std::chars_format::general);
    out.append(first, ec == std::errc{} ? end : first);
}

/// `\` and newline escaped, and `"` too in a label value (`quote`).
void append_escaped(std::string& out, std::string_view text, bool quote) {
    for (const char c : text) {
        if (c == '\\') {
            out += "\\\\";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '"' && quote) {
            out += "\\\"";
        } else {
            out += c;
        }
    }
}

/// One line: name+suffix, the labels (with `le` last when given), the value.
void append_sample(std::string& out, std::string_view name, std::string_view suffix,
                   const std::vector<std::string>& label_names,
                   const std::vector<std::string>& label_values, std::optional<double> le,
                   double value) {
    out.append(name).append(suffix);
    if (!label_names.empty() || le) {
        char sep = '{';
        for (std::size_t i = 0; i < label_names.size(); ++i) {
            out.append(1, sep).append(label_names[i]).append("=\"");
            append_escaped(out, label_values[i], true);
            out += '"';
            sep = ',';
        }
        if (le) {
            out.append(1, sep).append("le=\"");
            append_number(out, *le);
            out += '"';
        }
        out += '}';
    }
    out += ' ';
    append_number(out, value);
    out += '\n';
}

bool is_letter_or_underscore(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

/// [a-zA-Z_:][a-zA-Z0-9_:]* for metric names (`colon`), [a-zA-Z_][a-zA-Z0-9_]* for labels.
bool valid_name(std::string_view s, bool colon) {
    for (std::size_t i = 0; i < s.size(); ++i) {
        const char c = s[i];
        if (!is_letter_or_underscore(c) && !(colon && c == ':') &&
            !(i > 0 && c >= '0' && c <= '9')) {
            return false;
        }
    }
    return !s.empty();
}

template <class... Parts>
[[noreturn]] void reject(const Parts&... parts) {
    std::string what = "metrics: ";
    (what.append(parts), ...);
    throw std::invalid_argument(what);
}

void check_labels(const std::string& metric, const std::vector<std::string>& label_names) {
    for (const auto& label : label_names) {
        if (!valid_name(label, false) || label.starts_with("__") || label == "le") {
            reject("invalid label name \"", label, "\" of ", metric);
        }
        if (std::count(label_names.begin(), label_names.end(), label) > 1) {
            reject("label name \"", label, "\" twice in ", metric);
        }
    }
}

}  // namespace

void Counter::inc(double by) noexcept {
    if (by >= 0) value_.fetch_add(by, relaxed);
}

void Counter::advance_to(double total) noexcept {
    double current = value_.load(relaxed);
    while (total > current && !value_.compare_exchange_weak(current, total, relaxed)) {
    }
}

double Counter::value() const noexcept { return value_.load(relaxed); }

void Gauge::set(double v) noexcept { value_.store(v, relaxed); }

void Gauge::add(double by) noexcept { value_.fetch_add(by, relaxed); }

double Gauge::value() const noexcept { return value_.load(relaxed); }

Histogram::Histogram(std::span<const double> upper_bounds)
    : upper_bounds_(upper_bounds), counts_(upper_bounds.size() + 1) {}

void Histogram::observe(double v) noexcept {
    if (std::isnan(v)) return;
    const auto bucket = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), v);
    counts_[static_cast<std::size_t>(bucket - upper_bounds_.begin())].fetch_add(1, relaxed);
    sum_.fetch_add(v, relaxed);
}

template <class Metric>
Family<Metric>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                       std::vector<double> upper_bounds)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      upper_bounds_(std::move(upper_bounds)) {
    if (label_names_.empty()) children_.emplace(std::vector<std::string>{}, make_child());
}

template <class Metric>
std::unique_ptr<Metric> Family<Metric>::make_child() const {
    if constexpr (std::is_same_v<Metric, Histogram>) {
        return std::unique_ptr<Histogram>(new Histogram(upper_bounds_));
    } else {
        return std::make_unique<Metric>();
    }
}

template <class Metric>
Metric& Family<Metric>::with(const std::vector<std::string>& label_values) {
    if (label_values.size() != label_names_.size()) {
        reject(name_, " has ", std::to_string(label_names_.size()), " label names, given ",
               std::to_string(label_values.size()), " values");
    }
    const std::lock_guard lock(mutex_);
    auto it = children_.find(label_values);
    if (it == children_.end()) it = children_.emplace(label_values, make_child()).first;
    return *it->second;
}

template <class Metric>
Metric& Family<Metric>::with(std::initializer_list<std::string_view> label_values) {
    return with(std::vector<std::string>(label_values.begin(), label_values.end()));
}

template <class Metric>
Metric& Family<Metric>::only() {
    return with(std::vector<std::string>{});
}

template <class Metric>
void Family<Metric>::clear() {
    auto fresh = label_names_.empty() ? make_child() : nullptr;
    decltype(children_) dropped;
    {
        const std::lock_guard lock(mutex_);
        dropped.swap(children_);
        if (fresh) children_.emplace(std::vector<std::string>{}, std::move(fresh));
    }
}

template <class Metric>
void Family<Metric>::render_to(std::string& out) const {
    out.append("# HELP ").append(name_).append(" ");
    append_escaped(out, help_, false);
    out.append("\n# TYPE ").append(name_).append(" ").append(type_name<Metric>()).append("\n");
    const std::lock_guard lock(mutex_);
    for (const auto& [values, child] : children_) {
        if constexpr (std::is_same_v<Metric, Histogram>) {
            // One pass over the counts, summed as it goes: cumulative, so never decreasing
            // from one bucket to the next, and `_count` is the +Inf bucket.
            std::uint64_t cumulative = 0;
            for (std::size_t i = 0; i < child->counts_.size(); ++i) {
                cumulative += child->counts_[i].load(relaxed);
                const double le = i < upper_bounds_.size() ? upper_bounds_[i] : infinity;
                append_sample(out, name_, "_bucket", label_names_, values, le,
                              static_cast<double>(cumulative));
            }
            append_sample(out, name_, "_sum", label_names_, values, {}, child->sum_.load(relaxed));
            append_sample(out, name_, "_count", label_names_, values, {},
                          static_cast<double>(cumulative));
        } else {
            append_sample(out, name_, "", label_names_, values, {}, child->value());
        }
    }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

MetricRegistry::~MetricRegistry() = default;

template <class Metric>
Family<Metric>& MetricRegistry::add(std::string name, std::string help,
                                    std::vector<std::string> label_names,
                                    std::vector<double> upper_bounds) {
    if (!valid_name(name, true)) reject("invalid metric name \"", name, "\"");
    if constexpr (std::is_same_v<Metric, Counter>) {
        if (!name.ends_with("_total")) reject("counter ", name, " does not end in _total");
    }
    check_labels(name, label_names);
    for (std::size_t i = 0; i < upper_bounds.size(); ++i) {
        if (!std::isfinite(upper_bounds[i]) ||
            (i > 0 && !(upper_bounds[i - 1] < upper_bounds[i]))) {
            reject("bucket bounds of ", name, " are not finite and strictly increasing");
        }
    }
    std::vector<std::string> taken{name};
    if constexpr (std::is_same_v<Metric, Histogram>) {
        for (const char* suffix : {"_bucket", "_sum", "_count"}) taken.push_back(name + suffix);
    }
    auto family = std::unique_ptr<Family<Metric>>(new Family<Metric>(
        std::move(name), std::move(help), std::move(label_names), std::move(upper_bounds)));
    const std::lock_guard lock(mutex_);
    for (const auto& sample_name : taken) {
        if (sample_names_.contains(sample_name)) reject("metric name ", sample_name, " taken");
    }
    sample_names_.insert(taken.begin(), taken.end());
    families_.push_back(std::move(family));
    return static_cast<Family<Metric>&>(*families_.back());
}

Family<Counter>& MetricRegistry::counter(std::string name, std::string help,
                                         std::vector<std::string> label_names) {
    return add<Counter>(std::move(name), std::move(help), std::move(label_names), {});
}

Family<Gauge>& MetricRegistry::gauge(std::string name, std::string help,
                                     std::vector<std::string> label_names) {
    return add<Gauge>(std::move(name), std::move(help), std::move(label_names), {});
}

Family<Histogram>& MetricRegistry::histogram(std::string name, std::string help,
                                             std::vector<std::string> label_names,
                                             std::vector<double> bucket_upper_bounds) {
    return add<Histogram>(std::move(name), std::move(help), std::move(label_names),
                          std::move(bucket_upper_bounds));
}

void MetricRegistry::on_collect(std::function<void()> fn) {
    const std::lock_guard lock(mutex_);
    collectors_.push_back(std::move(fn));
}

std::string MetricRegistry::render() const {
    std::vector<std::function<void()>> collectors;
    {
        const std::lock_guard lock(mutex_);
        collectors = collectors_;
    }
    for (const auto& collect : collectors) collect();
    std::string out;
    const std::lock_guard lock(mutex_);
    for (const auto& family : families_) family->render_to(out);
    return out;
}

namespace {

std::string read_file(const char* path) {
    const std::ifstream in(path);
    std::ostringstream text;
    text << in.rdbuf();
    return std::move(text).str();
}

std::optional<double> parse_number(std::string_view text) {
    unsigned long long n = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    if (ec != std::errc{} || end == text.data()) return std::nullopt;
    return static_cast<double>(n);
}

/// The fields of /proc/self/stat, indexed from 1 as in proc(5); the command name (field 2)
/// may hold spaces and parentheses, so the fields are split after its last ')'.
std::vector<std::string> self_stat_fields() {
    const std::string stat = read_file("/proc/self/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) return {};
    std::vector<std::string> fields(3);  // [0] unused, [1] pid, [2] command name
    std::istringstream rest(stat.substr(close + 1));
    for (std::string field; rest >> field;) fields.push_back(std::move(field));
    return fields;
}

}  // namespace

std::string process_metrics_text() try {
    MetricRegistry registry;
    const auto gauge = [&registry](const char* name, const char* help, std::optional<double> v) {
        if (v) registry.gauge(name, help).only().set(*v);
    };
    const auto fields = self_stat_fields();
    const auto stat_field = [&fields](std::size_t n) {
        return n < fields.size() ? parse_number(fields[n]) : std::nullopt;
    };
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const auto utime = stat_field(14);
    const auto stime = stat_field(15);
    if (utime && stime && ticks > 0) {
        registry
            .counter("process_cpu_seconds_total",
                     "Total user and system CPU time spent in seconds.")
            .only()
            .advance_to((*utime + *stime) / ticks);
    }
    const auto rss_pages = stat_field(24);
    const double page_size = static_cast<double>(sysconf(_SC_PAGESIZE));
    gauge("process_resident_memory_bytes", "Resident memory size in bytes.",
          rss_pages && page_size > 0 ? std::optional(*rss_pages * page_size) : std::nullopt);
    gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", stat_field(23));

    std::error_code ec;
    std::filesystem::directory_iterator fds("/proc/self/fd", ec);
    double n = 0;
    for (; !ec && fds != std::filesystem::directory_iterator(); fds.increment(ec)) ++n;
    const auto open_fds = ec ? std::nullopt : std::optional(n);
    gauge("process_open_fds", "Number of open file descriptors.", open_fds);
    rlimit nofile{};
    gauge("process_max_fds", "Maximum number of open file descriptors.",
          getrlimit(RLIMIT_NOFILE, &nofile) == 0
              ? std::optional(static_cast<double>(nofile.rlim_cur))
              : std::nullopt);

    const std::string proc_stat = read_file("/proc/stat");
    const auto btime_at = proc_stat.find("\nbtime ");
    const auto btime = btime_at == std::string::npos
                           ? std::nullopt
                           : parse_number(std::string_view(proc_stat).substr(btime_at + 7));
    const auto start_ticks = stat_field(22);
    gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
          btime && start_ticks && ticks > 0 ? std::optional(*btime + *start_ticks / ticks)
                                            : std::nullopt);
    gauge("process_threads", "Number of OS threads in the process.", stat_field(20));
    return registry.render();
} catch (...) {
    return {};
}

}  // namespace sandboxd
