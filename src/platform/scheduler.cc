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
    for (auto& l : r.layers) have += n.layers.count(l);
    return double(have) / double(r.layers.size());
  }
};

class TenantSpread : public Scorer {
 public:
  const char* name() const override { return "tenant_spread"; }
  double score(const NodeView& n, const PlacementRequest& r) const override {
    if (!r.spread) return 1;
    auto it = n.tenants.find(r.tenant);
    return 1.0 / (1.0 + double(it == n.tenants.end() ? 0 : it->second));
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

Result<Placement> Scheduler::pick(const std::vector<NodeView>& nodes,
                                  const PlacementRequest& r) const {
  int up = 0, roomy = 0;
  const NodeView* best = nullptr;
  double bestScore = 0;
  for (auto& n : nodes) {
    if (!n.up || n.pool != r.pool) continue;
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
  if (best) return Placement{best->name, bestScore};
  if (up == 0) {
    return Status(Code::kFailedPrecondition, "no node of pool '" + r.pool + "' is up", 0, "pool");
  }
  if (roomy == 0) {
    return Status(Code::kResourceExhausted, "no node of pool '" + r.pool + "' has room for " +
                                                std::to_string(r.cpu) + " cpu and " +
                                                std::to_string(r.memoryMb) + " MiB (" +
                                                std::to_string(up) + " nodes up)");
  }
  return Status(Code::kUnavailable, "every node of pool '" + r.pool + "' with room has " +
                                        std::to_string(maxInflight_) + " creations in flight");
}

}  // namespace dsec::platform
