#pragma once
/// @file metrics.hpp
/// Prometheus metrics: counters, gauges and histograms in families with labels, kept by a
/// MetricRegistry that renders them in the text exposition format 0.0.4 (GET /metrics), and
/// the standard process_* metrics of the calling process.
///
/// Values are doubles in the unit the metric's name says (`_seconds`, `_bytes`).
///
/// Thread-safety: every call may run concurrently with any other, except the use of a child
/// that clear() dropped (see clear()). Updating a child (inc, advance_to, set, add, observe)
/// is lock-free and never blocks. with(), only() and clear() take the family's mutex; the
/// registration calls and on_collect() the registry's. render() holds the registry's mutex
/// while it formats (delaying registrations) and each family's while it formats that family
/// (delaying that family's with(), only() and clear()), but never delays an update. No lock is
/// held while a collector runs.
/// with() looks its label values up in a map under the family's mutex on every call: on a hot
/// path, keep the reference it returns.

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd {

template <class Metric>
class Family;
class MetricRegistry;

/// A value that only goes up (requests served, bytes sent). Starts at 0.
class Counter {
public:
    /// Adds `by`, which must be >= 0; a negative or NaN `by` is ignored (a counter never
    /// decreases).
    void inc(double by = 1.0) noexcept;
    /// Sets the value to `total` if `total` is larger, else leaves it: for a counter mirrored
    /// from another source that keeps its own total. A NaN `total` is ignored.
    void advance_to(double total) noexcept;
    double value() const noexcept;

private:
    std::atomic<double> value_{0.0};
};

/// A value that goes up and down (connections open, queue length). Starts at 0.
class Gauge {
public:
    void set(double v) noexcept;
    void add(double by) noexcept;  ///< `by` may be negative
    double value() const noexcept;

private:
    std::atomic<double> value_{0.0};
};

/// Counts of observations (durations in seconds, typically) in the buckets of its family,
/// with their sum. Made only by its family, which owns the bucket bounds.
class Histogram {
public:
    /// Counts `v` in the first bucket whose upper bound is >= `v` (+Inf for larger values)
    /// and adds it to the sum. A NaN `v` is ignored (it would make the sum NaN forever).
    void observe(double v) noexcept;

private:
    template <class Metric>
    friend class Family;
    /// `upper_bounds` (the family's) outlives the histogram.
    explicit Histogram(std::span<const double> upper_bounds);

    std::span<const double> upper_bounds_;
    std::vector<std::atomic<std::uint64_t>> counts_;  ///< per bucket, not cumulative; last: +Inf
    std::atomic<double> sum_{0.0};
};

namespace detail {
/// What MetricRegistry keeps of each family: the means to render it. Internal.
class FamilyBase {
public:
    virtual ~FamilyBase() = default;
    /// Appends "# HELP", "# TYPE" and the samples (see MetricRegistry::render).
    virtual void render_to(std::string& out) const = 0;
};
}  // namespace detail

/// One metric name with its label names; a child (a Counter, Gauge or Histogram) per
/// distinct list of label values. Made by MetricRegistry; lives as long as the registry.
template <class Metric>
class Family final : public detail::FamilyBase {
public:
    /// The child with these label values, in the order of the family's label names; created
    /// on first use (at 0, or with empty buckets). Any text is a valid label value (it is
    /// escaped on output). The reference stays valid for the registry's lifetime, unless
    /// clear() drops the child. Throws std::invalid_argument when the number of values
    /// differs from the number of label names.
    Metric& with(const std::vector<std::string>& label_values);
    Metric& with(std::initializer_list<std::string_view> label_values);
    /// The one child of a family with no labels (created at registration). Throws
    /// std::invalid_argument when the family has labels.
    Metric& only();
    /// Drops every child, for a family refreshed whole from a snapshot (e.g. per-peer link
    /// state set by a collector): the next render shows only the children made after this.
    /// Every reference to a dropped child becomes invalid at once (using one is undefined
    /// behaviour), so a family that is cleared must have its children looked up with with()
    /// each time, never kept, and never updated by one thread while another clears it. A
    /// family without labels gets a new child at 0 (so it still prints one sample).
    void clear();

private:
    friend class MetricRegistry;
    Family(std::string name, std::string help, std::vector<std::string> label_names,
           std::vector<double> upper_bounds);
    void render_to(std::string& out) const override;
    std::unique_ptr<Metric> make_child() const;

    const std::string name_;
    const std::string help_;
    const std::vector<std::string> label_names_;
    const std::vector<double> upper_bounds_;  ///< histograms only: finite, increasing
    mutable std::mutex mutex_;
    /// Ordered by label values, which is the order of the samples in the output.
    std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_;
};

/// The metric families of one process (one per daemon; tests make their own).
class MetricRegistry {
public:
    MetricRegistry() = default;
    MetricRegistry(const MetricRegistry&) = delete;
    MetricRegistry& operator=(const MetricRegistry&) = delete;
    ~MetricRegistry();

    /// Registers a family. `name` must match [a-zA-Z_:][a-zA-Z0-9_:]*, and a counter's must
    /// end in "_total". Label names must match [a-zA-Z_][a-zA-Z0-9_]*, must not start with
    /// "__" (reserved by Prometheus), must not be "le" (the histograms' bucket label) and
    /// must be distinct. A histogram's `bucket_upper_bounds` must be finite and strictly
    /// increasing (may be empty); the +Inf bucket is implied. Throws std::invalid_argument
    /// naming the problem for any of these, and for a name that is already registered,
    /// including one a histogram's samples use (`<name>_bucket`, `_sum`, `_count`).
    /// `help` may be any text (escaped on output). A family without labels gets its one
    /// child now, so that it prints a sample (0) before its first update.
    Family<Counter>& counter(std::string name, std::string help,
                             std::vector<std::string> label_names = {});
    Family<Gauge>& gauge(std::string name, std::string help,
                         std::vector<std::string> label_names = {});
    Family<Histogram>& histogram(std::string name, std::string help,
                                 std::vector<std::string> label_names,
                                 std::vector<double> bucket_upper_bounds);

    /// Adds `fn`, called at the start of every render(), in the order added and under no lock
    /// of the registry, to refresh gauges from other state. It runs on render()'s thread and
    /// must not call render(); an exception it throws propagates out of render().
    void on_collect(std::function<void()> fn);

    /// The text exposition format 0.0.4 (Content-Type `text/plain; version=0.0.4`): for each
    /// family in registration order "# HELP", "# TYPE", then its samples in the order of
    /// their label values. HELP escapes `\` and newline; label values escape `\`, `"` and
    /// newline. Numbers: integers below 2^63 in full ("3", "10000000000"), others in the
    /// fewest digits that read back to the same double, with an exponent only where %g would
    /// use one, as the Go client writes them ("0.1", "0.0005", "1e-05", "1.2345675e+06");
    /// "+Inf", "-Inf", "NaN". A labelled family with no children prints only HELP and TYPE.
    /// A histogram prints `_bucket` samples with cumulative counts and `le` (its bounds, then
    /// "+Inf"), then `_sum` and `_count` (equal to the +Inf bucket): each child's buckets come
    /// from one pass over its counts, so they never decrease even while observe() runs, though
    /// `_sum` may be off by the observations under way. Runs the collectors first (see
    /// on_collect). Blocks only on the mutexes described at the top of this file. Throws
    /// std::bad_alloc, or what a collector throws.
    std::string render() const;

private:
    template <class Metric>
    Family<Metric>& add(std::string name, std::string help, std::vector<std::string> label_names,
                        std::vector<double> upper_bounds);

    mutable std::mutex mutex_;
    std::vector<std::unique_ptr<detail::FamilyBase>> families_;  ///< in registration order
    std::set<std::string, std::less<>> sample_names_;            ///< every name in use
    std::vector<std::function<void()>> collectors_;
};

/// The standard process_* metrics of the calling process, read from /proc (Linux), each with
/// HELP and TYPE, in the text format of MetricRegistry::render, to append to it:
/// process_cpu_seconds_total (user + system CPU time), process_resident_memory_bytes,
/// process_virtual_memory_bytes, process_open_fds (the entries of /proc/self/fd, counting the
/// one used to list them), process_max_fds (the soft RLIMIT_NOFILE),
/// process_start_time_seconds (since the Unix epoch, to the clock tick) and process_threads.
/// A value that cannot be read is left out; never throws (on std::bad_alloc it returns "").
/// Reads /proc/self/stat, /proc/stat and /proc/self/fd: a few system calls, no disk I/O.
std::string process_metrics_text();

}  // namespace sandboxd
