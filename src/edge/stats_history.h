// The last hour of each sandbox's resource figures, kept on its node: the
// edge's sampler (Edge, every EdgeOptions::statsIntervalS) records one reading
// per live sandbox into a ring of its own, dropped with the sandbox;
// EdgeLink::statsHistory reads it back. In memory only: an edge restart starts
// every ring again. Thread-safe (one mutex over the rings).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "proto/types.h"

namespace dsec::edge {

class StatsHistory {
 public:
  // 240 points: an hour at the default interval of 15 s.
  static constexpr size_t kDefaultPoints = 240;
  static constexpr double kDefaultIntervalS = 15;

  explicit StatsHistory(size_t points = kDefaultPoints) : points_(points < 1 ? 1 : points) {}

  // Appends a reading of `id`, making its ring on the first; past `points`
  // readings the oldest goes. Readings are expected in time order.
  void record(const std::string& id, const proto::StatsSample& s);
  // Forgets `id` (destroyed); unknown ids are fine.
  void drop(const std::string& id);
  // Forgets every ring whose id is not in `live` (a sandbox gone some other way).
  void retain(const std::set<std::string>& live);
  // The readings of `id` taken at or after now - windowS, oldest first; empty
  // for an unknown id.
  std::vector<proto::StatsSample> query(const std::string& id, double windowS, double now) const;
  size_t size() const;  // sandboxes with a ring

 private:
  // 24 bytes a reading (an hour ≈ 5.6 KiB a sandbox): time in ms, memory in
  // KiB (up to 16 TiB), tasks.
  struct Point {
    int64_t tMs;
    int64_t cpuUsec;
    uint32_t memoryKib;
    uint32_t pids;
  };
  struct Ring {
    std::vector<Point> buf;  // grows to points_, then wraps
    size_t next = 0;         // where the next reading goes once full
  };

  const size_t points_;
  mutable std::mutex mu_;  // guards rings_
  std::map<std::string, Ring> rings_;
};

}  // namespace dsec::edge
