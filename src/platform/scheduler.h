// Placement: which node of a cluster takes a new sandbox. Pure functions of a
// cluster snapshot (no locks, no clock), so they are unit-tested on recorded
// cluster states (scheduler_test.cc, testdata/cluster_*.json).
//
// A node is eligible when it is up, in the request's pool, has the free CPU,
// memory and a sandbox slot the request needs, and fewer creations in flight
// than the admission bound. Among eligible nodes the highest weighted sum of
// the scorers' scores wins (ties: the node name, so placement is
// deterministic). Scorers are pluggable: any Scorer with a weight.
//
// Bursting (docs/cluster.md): a request marked burstable goes to the burst
// pool (BurstPolicy) while its own pool's utilization is at or above the
// threshold, or when its own pool cannot take it at all (no node up, none with
// room). Utilization of a pool is the largest of its CPU, memory and slot use,
// each summed over the pool's up nodes (placed and in-flight sandboxes over
// capacity); a pool with no up node counts as full (1). A burstable request the
// burst pool cannot take (down, full, or at the in-flight bound) falls back to
// its own pool. A request that is not burstable only ever goes to its own pool.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::platform {

// One node as the scheduler sees it: capacity from its heartbeats, use from
// the sandboxes placed on it (counted when placed, before the node confirms).
struct NodeView {
  std::string name;
  std::string pool = "default";
  bool up = true;
  double cpus = 0;  // capacity (cores the node offers sandboxes)
  int64_t memoryMb = 0;
  int64_t slots = 0;   // sandboxes at most
  double cpuUsed = 0;  // requested by the sandboxes placed on it
  int64_t memoryUsedMb = 0;
  int64_t sandboxes = 0;
  int inflight = 0;                        // creations under way
  std::set<std::string> layers;            // layer digests the node holds
  std::map<std::string, int64_t> tenants;  // sandboxes per tenant
  // When set, these stand for `layers` and `tenants` (the cluster's own
  // sets, read under its lock): a view per placement then copies no sets.
  const std::set<std::string>* layersRef = nullptr;
  const std::map<std::string, int64_t>* tenantsRef = nullptr;
  const std::set<std::string>& layerSet() const { return layersRef ? *layersRef : layers; }
  const std::map<std::string, int64_t>& tenantMap() const {
    return tenantsRef ? *tenantsRef : tenants;
  }
};

struct PlacementRequest {
  double cpu = 1.0;
  int64_t memoryMb = 512;
  std::vector<std::string> layers;
  std::string pool = "default";
  std::string tenant;  // empty: the anonymous tenant
  bool spread = true;  // spread the tenant's sandboxes over nodes
  bool burstable = false;  // may go to the burst pool (BurstPolicy)
};

// Where burstable sandboxes go when their pool is busy. Empty pool: none.
struct BurstPolicy {
  std::string pool;
  double threshold = 0.8;  // utilization in [0, 1] at or above which they burst
};

// The utilization of `pool` (see above): in [0, 1] (above 1 only when
// capacity shrank under its sandboxes); 1 when no node of the pool is up.
double poolUtilization(const std::vector<NodeView>& nodes, const std::string& pool);

// Scores an eligible node for a request, in [0, 1]; higher is better.
class Scorer {
 public:
  virtual ~Scorer() = default;
  virtual const char* name() const = 0;
  virtual double score(const NodeView& n, const PlacementRequest& r) const = 0;
};

// Free CPU, memory and slots left after the placement (their mean fraction):
// balances load.
std::unique_ptr<Scorer> freeResourcesScorer();
// Fraction of the request's layers the node already holds.
std::unique_ptr<Scorer> layerLocalityScorer();
// 1 / (1 + the tenant's sandboxes on the node); 1 when the request does not
// spread. The empty tenant is one tenant too (all sandboxes before tenants).
std::unique_ptr<Scorer> tenantSpreadScorer();

struct WeightedScorer {
  std::shared_ptr<Scorer> scorer;
  double weight = 1.0;
};

// The default scoring: free resources 1, layer locality 0.5, tenant spread 1:
// locality picks among equally loaded nodes and breaks near-ties, but does not
// pile a tenant's sandboxes onto the nodes that have its image.
std::vector<WeightedScorer> defaultScorers();

struct Placement {
  std::string node;
  double score = 0;
  std::string pool;    // the node's pool
  bool burst = false;  // placed in the burst pool, not the request's own
};

class Scheduler {
 public:
  explicit Scheduler(std::vector<WeightedScorer> scorers, int maxInflightPerNode = 8,
                     BurstPolicy burst = {})
      : scorers_(std::move(scorers)), maxInflight_(maxInflightPerNode), burst_(std::move(burst)) {}

  // The best node for `r` (in the burst pool when r is burstable and its pool
  // is busy, see above). Errors (the message says why, for the client; for a
  // burstable request that neither pool can take, the own pool's error, the
  // burst pool's reason appended, and kUnavailable if either pool is only at
  // its in-flight bound):
  //   kUnavailable       nodes fit but all are at the in-flight bound (wait and retry)
  //   kResourceExhausted no up node of the pool has room (retrying may help
  //                      once sandboxes go away or nodes join)
  //   kFailedPrecondition no node of the pool is up at all
  Result<Placement> pick(const std::vector<NodeView>& nodes, const PlacementRequest& r) const;
  // The weighted score of an eligible node (for tests and explanations).
  double score(const NodeView& n, const PlacementRequest& r) const;
  // Whether `n` has room for `r` (ignoring the in-flight bound).
  static bool fits(const NodeView& n, const PlacementRequest& r);
  int maxInflightPerNode() const { return maxInflight_; }
  const BurstPolicy& burstPolicy() const { return burst_; }

 private:
  // The best node of `pool` alone.
  Result<Placement> pickIn(const std::vector<NodeView>& nodes, const PlacementRequest& r,
                           const std::string& pool) const;

  std::vector<WeightedScorer> scorers_;
  int maxInflight_;
  BurstPolicy burst_;
};

}  // namespace dsec::platform
