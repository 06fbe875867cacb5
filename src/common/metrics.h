// One metrics registry per process: the Prometheus text exposition (format
// 0.0.4) of /metrics on the platform and the edge is rendered here, family by
// family, so a family is announced once (HELP, TYPE) with all its samples
// whoever contributes to it, and label values are escaped in one place.
//
// Collectors are functions that write their current figures into a Writer at
// each scrape; they run in the order they were added. Counters and gauges
// that code bumps as it goes are plain atomics (or Counter/CounterVec below)
// read by a collector.
//
// Thread-safety: Registry is thread-safe; a Writer belongs to one render.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dsec::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

enum class Type { kCounter, kGauge, kHistogram };

// Collects one exposition. A family's HELP and TYPE come from its first
// mention; a later mention with another type is a bug and its samples are
// dropped (never a second family of one name, which scrapers reject).
class Writer {
 public:
  void counter(std::string_view name, std::string_view help, double value,
               const Labels& labels = {});
  void gauge(std::string_view name, std::string_view help, double value,
             const Labels& labels = {});
  // `bounds` are the upper bounds of the buckets (ascending, without +Inf);
  // `counts[i]` the observations <= bounds[i] (not cumulative: the writer
  // sums them); counts.size() == bounds.size() + 1, the last for +Inf.
  void histogram(std::string_view name, std::string_view help, const std::vector<double>& bounds,
                 const std::vector<uint64_t>& counts, double sum, const Labels& labels = {});
  // Declares a family with no samples yet (so it is listed even when empty).
  void declare(std::string_view name, Type type, std::string_view help);
  // The exposition text: families in order of first mention.
  std::string text() const;

 private:
  struct Family {
    Type type;
    std::string help;
    std::string samples;
  };
  Family* family(std::string_view name, Type type, std::string_view help);
  std::vector<std::string> order_;
  std::map<std::string, Family, std::less<>> families_;
};

// A Prometheus label value: backslash, double quote and newline escaped.
std::string escapeLabel(std::string_view v);
// A HELP text: backslash and newline escaped (the format leaves quotes as they are).
std::string escapeHelp(std::string_view v);
// A sample value as the format spells it (integers without a fraction).
std::string formatValue(double v);

class Registry {
 public:
  using Collector = std::function<void(Writer&)>;
  // Adds a collector; the id removes it.
  uint64_t add(Collector c);
  void remove(uint64_t id);
  // Runs every collector into one Writer: the exposition text.
  std::string render() const;
  // The process's registry.
  static Registry& global();

 private:
  mutable std::mutex mu_;  // guards collectors_, next_; held while rendering
  std::map<uint64_t, Collector> collectors_;
  uint64_t next_ = 1;
};

// A counter by one label (an error code, a result): a map under a mutex, for
// keys not known up front (a fixed set of keys is cheaper as atomics).
class CounterVec {
 public:
  void inc(const std::string& key, uint64_t n = 1);
  std::map<std::string, uint64_t> values() const;

 private:
  mutable std::mutex mu_;  // guards values_
  std::map<std::string, uint64_t> values_;
};

// Fixed-bucket histogram of durations (seconds) or sizes. Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  void writeTo(Writer& w, std::string_view name, std::string_view help,
               const Labels& labels = {}) const;
  uint64_t count() const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mu_;  // guards counts_, sum_
  std::vector<uint64_t> counts_;
  double sum_ = 0;
};

}  // namespace dsec::metrics
