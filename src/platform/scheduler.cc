#include "platform/scheduler.h"

#include <algorithm>

namespace dsec::platform {

namespace {

double fraction(double free, double cap) { return cap > 0 ? std::clamp(free / cap, 0.0, 1.0) : 0; }

class FreeResources : public Scorer {
 public:
  const char* name() const override { return "free_resources"; }
  double score(const NodeView& n, const PlacementRequest& r) const override {
    double cpu = fraction(n.cpus - n.cpuUsed - r.cpu, n.cpus);
    double mem = fraction(double(n.memoryMb - n.memoryUsedMb - r.memoryMb), double(n.memoryMb));
    double slots = fraction(double(n.slots - n.sandboxes - n.inflight - 1), double(n.slots));
    return (cpu + mem + slots) / 3;
  }
};

class LayerLocality : public Scorer {
 public:
  const char* name() const override { return "layer_locality"; }
  double score(const NodeView& n, const PlacementRequest& r) const override {
    if (r.layers.empty()) return 0;
    size_t have = 0;
    for (auto& l : r.layers) have += n.layerSet().count(l);
    return double(have) / double(r.layers.size());
  }
};

class TenantSpread : public Scorer {
 public:
  const char* name() const override { return "tenant_spread"; }
  double score(const NodeView& n, const PlacementRequest& r) const override {
    if (!r.spread) return 1;
    auto& t = n.tenantMap();
    auto it = t.find(r.tenant);
    return 1.0 / (1.0 + double(it == t.end() ? 0 : it->second));
  }
};

}  // namespace

std::unique_ptr<Scorer> freeResourcesScorer() { return std::make_unique<FreeResources>(); }
std::unique_ptr<Scorer> layerLocalityScorer() { return std::make_unique<LayerLocality>(); }
std::unique_ptr<Scorer> tenantSpreadScorer() { return std::make_unique<TenantSpread>(); }

std::vector<WeightedScorer> defaultScorers() {
  return {{freeResourcesScorer(), 1.0}, {layerLocalityScorer(), 0.5}, {tenantSpreadScorer(), 1.0}};
}

bool Scheduler::fits(const NodeView& n, const PlacementRequest& r) {
  return n.cpus - n.cpuUsed + 1e-9 >= r.cpu && n.memoryMb - n.memoryUsedMb >= r.memoryMb &&
         n.sandboxes + n.inflight < n.slots;
}

double Scheduler::score(const NodeView& n, const PlacementRequest& r) const {
  double s = 0;
  for (auto& w : scorers_) s += w.weight * w.scorer->score(n, r);
  return s;
}

double poolUtilization(const std::vector<NodeView>& nodes, const std::string& pool) {
  double cpus = 0, cpuUsed = 0, mem = 0, memUsed = 0, slots = 0, slotsUsed = 0;
  int up = 0;
  for (auto& n : nodes) {
    if (!n.up || n.pool != pool) continue;
    ++up;
    cpus += n.cpus;
    cpuUsed += n.cpuUsed;
    mem += double(n.memoryMb);
    memUsed += double(n.memoryUsedMb);
    slots += double(n.slots);
    slotsUsed += double(n.sandboxes + n.inflight);
  }
  if (up == 0) return 1;
  // A resource the pool offers none of is full as soon as anything wants it.
  auto use = [](double used, double cap) { return cap > 0 ? used / cap : 1.0; };
  return std::max({use(cpuUsed, cpus), use(memUsed, mem), use(slotsUsed, slots)});
}

Result<Placement> Scheduler::pick(const std::vector<NodeView>& nodes,
                                  const PlacementRequest& r) const {
  if (!r.burstable || burst_.pool.empty() || burst_.pool == r.pool) {
    return pickIn(nodes, r, r.pool);
  }
  auto own = [&]() -> Result<Placement> { return pickIn(nodes, r, r.pool); };
  double u = poolUtilization(nodes, r.pool);
  Result<Placement> home = Status(Code::kInternal, "not tried");
  if (u < burst_.threshold) {
    home = own();
    // Below the threshold, a pool that is merely at its in-flight bound is
    // waited for (the request queues), not burst out of.
    if (home.isOk() || home.status().code() == Code::kUnavailable) return home;
  }
  auto burst = pickIn(nodes, r, burst_.pool);
  if (burst.isOk()) {
    burst->burst = true;
    return burst;
  }
  if (u >= burst_.threshold) home = own();
  if (home.isOk()) return home;
  Code code = home.status().code() == Code::kUnavailable ||
                      burst.status().code() == Code::kUnavailable
                  ? Code::kUnavailable
                  : home.status().code();
  return Status(code, home.status().message() + "; burst pool: " + burst.status().message(), 0,
                home.status().field());
}

Result<Placement> Scheduler::pickIn(const std::vector<NodeView>& nodes, const PlacementRequest& r,
                                    const std::string& pool) const {
  int up = 0, roomy = 0;
  const NodeView* best = nullptr;
  double bestScore = 0;
  for (auto& n : nodes) {
    if (!n.up || n.pool != pool) continue;
    ++up;
    if (!fits(n, r)) continue;
    ++roomy;
    if (n.inflight >= maxInflight_) continue;
    double s = score(n, r);
    if (!best || s > bestScore + 1e-12 ||
        (std::abs(s - bestScore) <= 1e-12 && n.name < best->name)) {
      best = &n;
      bestScore = s;
    }
  }
  if (best) return Placement{best->name, bestScore, pool, false};
  if (up == 0) {
    return Status(Code::kFailedPrecondition, "no node of pool '" + pool + "' is up", 0, "pool");
  }
  if (roomy == 0) {
    return Status(Code::kResourceExhausted, "no node of pool '" + pool + "' has room for " +
                                                std::to_string(r.cpu) + " cpu and " +
                                                std::to_string(r.memoryMb) + " MiB (" +
                                                std::to_string(up) + " nodes up)");
  }
  return Status(Code::kUnavailable, "every node of pool '" + pool + "' with room has " +
                                        std::to_string(maxInflight_) + " creations in flight");
}

}  // namespace dsec::platform
