// The last hour of a few of the platform's metrics, for the console's charts
// (GET /v1/metrics/history, docs/console.md). Every interval it renders the
// metrics registry (the same text /metrics serves), keeps the families listed
// in kHistorySeries, and answers queries with counters as rates per second and
// gauges as they were. In memory, per replica, lost on restart: for longer or
// cluster-wide history scrape /metrics with Prometheus.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace dsec::platform {

// One parsed sample of the exposition text.
struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};
// Parses Prometheus text (comments skipped; malformed lines skipped).
std::vector<MetricSample> parseMetricsText(std::string_view text);

class MetricsHistory {
 public:
  // `render` returns the exposition text. `intervalS` <= 0: no thread (tests
  // call sample()).
  MetricsHistory(std::function<std::string()> render, double intervalS, double windowS = 3600);
  ~MetricsHistory();
  MetricsHistory(const MetricsHistory&) = delete;
  MetricsHistory& operator=(const MetricsHistory&) = delete;

  // Takes one sample now, stamped `now` (unix seconds).
  void sample(double now);
  // {"interval_s", "window_s", "t": [unix seconds...], "series": {name: [value
  // or null...]}}: the samples of the last windowS seconds, oldest first.
  // Counters are rates per second over the interval before each point (null
  // for the first, and after a counter reset); gauges are their value.
  nlohmann::json query(double windowS) const;

 private:
  struct Point {
    double t = 0;
    std::map<std::string, double> values;
  };
  void loop();

  const std::function<std::string()> render_;
  const double intervalS_;
  const double windowS_;
  mutable std::mutex mu_;  // guards points_, stop_
  std::condition_variable cv_;
  std::deque<Point> points_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dsec::platform
