#include "edge/stats_history.h"

#include <algorithm>
#include <cmath>

namespace dsec::edge {

void StatsHistory::record(const std::string& id, const proto::StatsSample& s) {
  Point p;
  p.tMs = std::llround(s.t * 1000);
  p.cpuUsec = s.cpuUsec;
  p.memoryKib = uint32_t(std::clamp<int64_t>((s.memoryBytes + 1023) / 1024, 0, UINT32_MAX));
  p.pids = uint32_t(std::clamp<int64_t>(s.pids, 0, UINT32_MAX));
  std::lock_guard lk(mu_);
  Ring& r = rings_[id];
  if (r.buf.size() < points_) {
    r.buf.push_back(p);
    return;
  }
  r.buf[r.next] = p;
  r.next = (r.next + 1) % points_;
}

void StatsHistory::drop(const std::string& id) {
  std::lock_guard lk(mu_);
  rings_.erase(id);
}

void StatsHistory::retain(const std::set<std::string>& live) {
  std::lock_guard lk(mu_);
  for (auto it = rings_.begin(); it != rings_.end();) {
    it = live.count(it->first) ? std::next(it) : rings_.erase(it);
  }
}

std::vector<proto::StatsSample> StatsHistory::query(const std::string& id, double windowS,
                                                    double now) const {
  std::vector<proto::StatsSample> out;
  const int64_t fromMs = std::llround((now - windowS) * 1000);
  std::lock_guard lk(mu_);
  auto it = rings_.find(id);
  if (it == rings_.end()) return out;
  const Ring& r = it->second;
  // Oldest first: from `next` round once a full ring has wrapped.
  const size_t n = r.buf.size();
  const size_t start = n < points_ ? 0 : r.next;
  out.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const Point& p = r.buf[(start + k) % n];
    if (p.tMs < fromMs) continue;
    out.push_back({double(p.tMs) / 1000, p.cpuUsec, int64_t(p.memoryKib) * 1024, int64_t(p.pids)});
  }
  return out;
}

size_t StatsHistory::size() const {
  std::lock_guard lk(mu_);
  return rings_.size();
}

}  // namespace dsec::edge
