#include "platform/metrics_history.h"

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "common/util.h"

namespace dsec::platform {

namespace {

enum class Kind { kRate, kGauge };

// What is kept: a series named `out`, the sum of family `family` over every
// label set (or, with `byLabel`, one series per value of that label, named
// out + "." + value).
struct Spec {
  const char* out;
  const char* family;
  Kind kind;
  const char* byLabel = nullptr;
};

constexpr Spec kHistorySeries[] = {
    {"creates_per_s", "dsec_sandbox_creations_total", Kind::kRate},
    {"create_errors_per_s", "dsec_sandbox_create_errors_total", Kind::kRate},
    {"api_errors_per_s", "dsec_api_errors_total", Kind::kRate},
    {"calls_in_flight", "dsec_sandbox_calls_in_flight", Kind::kGauge},
    {"http_requests_in_flight", "dsec_http_requests_in_flight", Kind::kGauge},
    {"http_connections", "dsec_http_connections", Kind::kGauge},
    {"sandboxes", "dsec_sandboxes", Kind::kGauge, "state"},
    {"nodes_up", "dsec_node_up", Kind::kGauge},
    {"cpu_allocated", "dsec_node_cpu_allocated", Kind::kGauge},
    {"cpu_capacity", "dsec_node_cpu_capacity", Kind::kGauge},
    {"memory_allocated_bytes", "dsec_node_memory_allocated_bytes", Kind::kGauge},
    {"blocking_busy", "dsec_runtime_blocking_busy", Kind::kGauge},
    {"blocking_queued", "dsec_runtime_blocking_queued", Kind::kGauge},
    {"port_connections", "dsec_port_connections", Kind::kGauge},
    {"port_bytes_per_s", "dsec_port_bytes_total", Kind::kRate},
    {"pull_bytes_per_s", "dsec_pull_bytes_total", Kind::kRate},
    {"layer_bytes_fetched_per_s", "dsec_layer_bytes_fetched_total", Kind::kRate},
    {"syscalls_denied_per_s", "dsec_sandbox_syscalls_denied_total", Kind::kRate},
    {"egress_denied_per_s", "dsec_sandbox_egress_denied_total", Kind::kRate},
};

const Spec* specFor(const std::string& series) {
  for (auto& s : kHistorySeries) {
    std::string out = s.out;
    if (series == out || (s.byLabel && startsWith(series, out + "."))) return &s;
  }
  return nullptr;
}

}  // namespace

std::vector<MetricSample> parseMetricsText(std::string_view text) {
  std::vector<MetricSample> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty() || line[0] == '#') continue;
    MetricSample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{') {
      ++i;
      bool ok = true;
      while (i < line.size() && line[i] != '}') {
        size_t eq = line.find('=', i);
        if (eq == std::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          ok = false;
          break;
        }
        std::string key(line.substr(i, eq - i));
        std::string val;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            val.push_back(line[j] == 'n' ? '\n' : line[j]);
          } else {
            val.push_back(line[j]);
          }
        }
        if (j >= line.size()) {
          ok = false;
          break;
        }
        s.labels[key] = val;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (!ok || i >= line.size()) continue;
      ++i;  // '}'
    }
    while (i < line.size() && line[i] == ' ') ++i;
    std::string num(line.substr(i));
    if (size_t sp = num.find(' '); sp != std::string::npos) num.resize(sp);  // a timestamp
    if (num.empty()) continue;
    char* end = nullptr;
    s.value = std::strtod(num.c_str(), &end);
    if (end == num.c_str()) continue;
    out.push_back(std::move(s));
  }
  return out;
}

MetricsHistory::MetricsHistory(std::function<std::string()> render, double intervalS,
                               double windowS)
    : render_(std::move(render)), intervalS_(intervalS), windowS_(windowS) {
  if (intervalS_ > 0) thread_ = std::thread([this] { loop(); });
}

MetricsHistory::~MetricsHistory() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MetricsHistory::loop() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    lk.unlock();
    sample(nowSeconds());
    lk.lock();
    cv_.wait_for(lk, std::chrono::milliseconds(int64_t(intervalS_ * 1000)),
                 [this] { return stop_; });
  }
}

void MetricsHistory::sample(double now) {
  std::string text = render_();
  Point p;
  p.t = now;
  for (auto& s : parseMetricsText(text)) {
    for (auto& spec : kHistorySeries) {
      if (s.name != spec.family) continue;
      std::string key = spec.out;
      if (spec.byLabel) {
        auto it = s.labels.find(spec.byLabel);
        if (it == s.labels.end()) continue;
        key += "." + it->second;
      }
      p.values[key] += s.value;
    }
  }
  std::lock_guard lk(mu_);
  points_.push_back(std::move(p));
  while (!points_.empty() && points_.front().t < now - windowS_ - 1e-6) points_.pop_front();
}

nlohmann::json MetricsHistory::query(double windowS) const {
  std::lock_guard lk(mu_);
  nlohmann::json t = nlohmann::json::array();
  std::map<std::string, nlohmann::json> series;
  for (auto& spec : kHistorySeries) {
    if (!spec.byLabel) series[spec.out] = nlohmann::json::array();
  }
  double from = points_.empty() ? 0 : points_.back().t - windowS;
  size_t first = 0;
  while (first < points_.size() && points_[first].t < from - 1e-6) ++first;
  // Every labelled series any kept point has.
  for (size_t i = first; i < points_.size(); ++i) {
    for (auto& [k, v] : points_[i].values) {
      if (!series.count(k)) series[k] = nlohmann::json::array();
    }
  }
  for (size_t i = first; i < points_.size(); ++i) {
    const Point& p = points_[i];
    t.push_back(std::round(p.t * 1000) / 1000);
    for (auto& [k, arr] : series) {
      const Spec* spec = specFor(k);
      auto it = p.values.find(k);
      if (!spec || it == p.values.end()) {
        arr.push_back(nullptr);
        continue;
      }
      if (spec->kind == Kind::kGauge) {
        arr.push_back(it->second);
        continue;
      }
      // A rate over the interval before this point.
      if (i == 0) {
        arr.push_back(nullptr);
        continue;
      }
      const Point& prev = points_[i - 1];
      auto pv = prev.values.find(k);
      double dt = p.t - prev.t;
      double dv = it->second - (pv == prev.values.end() ? 0 : pv->second);
      if (dt <= 0 || dv < 0) {
        arr.push_back(nullptr);
      } else {
        arr.push_back(std::round(dv / dt * 1000) / 1000);
      }
    }
  }
  nlohmann::json out = {{"interval_s", intervalS_}, {"window_s", windowS}, {"t", t}};
  out["series"] = nlohmann::json::object();
  for (auto& [k, v] : series) out["series"][k] = std::move(v);
  return out;
}

}  // namespace dsec::platform
