#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/log.h"

namespace dsec::metrics {

std::string escapeLabel(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string escapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string formatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    return std::to_string(int64_t(v));
  }
  // The shortest of %.15g and %.17g that reads back as v.
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

namespace {

const char* typeName(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void appendSample(std::string& out, std::string_view name, const Labels& labels,
                  const std::string& value, const std::pair<std::string, std::string>* extra) {
  out.append(name);
  if (!labels.empty() || extra) {
    out += '{';
    bool first = true;
    auto one = [&](const std::string& k, const std::string& v) {
      if (!first) out += ',';
      first = false;
      out += k;
      out += "=\"";
      out += escapeLabel(v);
      out += '"';
    };
    for (auto& [k, v] : labels) one(k, v);
    if (extra) one(extra->first, extra->second);
    out += '}';
  }
  out += ' ';
  out += value;
  out += '\n';
}

}  // namespace

Writer::Family* Writer::family(std::string_view name, Type type, std::string_view help) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    order_.emplace_back(name);
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}}).first;
  } else if (it->second.type != type) {
    log::error("metrics: family " + std::string(name) + " written as " + typeName(type) +
               ", declared " + typeName(it->second.type) + "; samples dropped");
    return nullptr;
  }
  return &it->second;
}

void Writer::declare(std::string_view name, Type type, std::string_view help) {
  (void)family(name, type, help);
}

void Writer::counter(std::string_view name, std::string_view help, double value,
                     const Labels& labels) {
  if (Family* f = family(name, Type::kCounter, help)) {
    appendSample(f->samples, name, labels, formatValue(value), nullptr);
  }
}

void Writer::gauge(std::string_view name, std::string_view help, double value,
                   const Labels& labels) {
  if (Family* f = family(name, Type::kGauge, help)) {
    appendSample(f->samples, name, labels, formatValue(value), nullptr);
  }
}

void Writer::histogram(std::string_view name, std::string_view help,
                       const std::vector<double>& bounds, const std::vector<uint64_t>& counts,
                       double sum, const Labels& labels) {
  Family* f = family(name, Type::kHistogram, help);
  if (!f) return;
  std::string bucket = std::string(name) + "_bucket";
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    cum += i < counts.size() ? counts[i] : 0;
    std::pair<std::string, std::string> le{"le",
                                           i < bounds.size() ? formatValue(bounds[i]) : "+Inf"};
    appendSample(f->samples, bucket, labels, std::to_string(cum), &le);
  }
  appendSample(f->samples, std::string(name) + "_sum", labels, formatValue(sum), nullptr);
  appendSample(f->samples, std::string(name) + "_count", labels, std::to_string(cum), nullptr);
}

std::string Writer::text() const {
  std::string out;
  for (auto& name : order_) {
    const Family& f = families_.find(name)->second;
    out += "# HELP " + name + " " + escapeHelp(f.help) + "\n";
    out += "# TYPE " + name + " " + typeName(f.type) + "\n";
    out += f.samples;
  }
  return out;
}

uint64_t Registry::add(Collector c) {
  std::lock_guard lk(mu_);
  uint64_t id = next_++;
  collectors_[id] = std::move(c);
  return id;
}

void Registry::remove(uint64_t id) {
  std::lock_guard lk(mu_);
  collectors_.erase(id);
}

std::string Registry::render() const {
  Writer w;
  std::lock_guard lk(mu_);
  for (auto& [_, c] : collectors_) c(w);
  return w.text();
}

Registry& Registry::global() {
  static Registry* r = new Registry();  // never destroyed: collectors outlive statics
  return *r;
}

void CounterVec::inc(const std::string& key, uint64_t n) {
  std::lock_guard lk(mu_);
  values_[key] += n;
}

std::map<std::string, uint64_t> CounterVec::values() const {
  std::lock_guard lk(mu_);
  return values_;
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard lk(mu_);
  ++counts_[i];
  sum_ += v;
}

void Histogram::writeTo(Writer& w, std::string_view name, std::string_view help,
                        const Labels& labels) const {
  std::vector<uint64_t> counts;
  double sum;
  {
    std::lock_guard lk(mu_);
    counts = counts_;
    sum = sum_;
  }
  w.histogram(name, help, bounds_, counts, sum, labels);
}

uint64_t Histogram::count() const {
  std::lock_guard lk(mu_);
  uint64_t n = 0;
  for (auto c : counts_) n += c;
  return n;
}

}  // namespace dsec::metrics
