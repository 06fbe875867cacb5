// The scheduler on recorded cluster states: each testdata/cluster_*.json holds
// nodes as the platform saw them and placement cases with their expected
// outcome (a node, an error code, or how a run of placements distributes).
#include "platform/scheduler.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace dsec::platform {
namespace {

using json = nlohmann::json;

std::vector<NodeView> nodesFrom(const json& j) {
  std::vector<NodeView> out;
  for (auto& n : j) {
    NodeView v;
    v.name = n.at("name");
    v.pool = n.value("pool", "default");
    v.up = n.value("up", true);
    v.cpus = n.at("cpus");
    v.memoryMb = n.at("memory_mb");
    v.slots = n.at("slots");
    v.cpuUsed = n.value("cpu_used", 0.0);
    v.memoryUsedMb = n.value("memory_used_mb", int64_t(0));
    v.sandboxes = n.value("sandboxes", int64_t(0));
    v.inflight = n.value("inflight", 0);
    for (auto& l : n.value("layers", json::array())) v.layers.insert(l.get<std::string>());
    json tenants = n.value("tenants", json::object());
    for (auto& [t, k] : tenants.items()) v.tenants[t] = k.get<int64_t>();
    out.push_back(v);
  }
  return out;
}

PlacementRequest requestFrom(const json& j) {
  PlacementRequest r;
  r.cpu = j.value("cpu", 1.0);
  r.memoryMb = j.value("memory_mb", int64_t(512));
  r.layers = j.value("layers", std::vector<std::string>{});
  r.pool = j.value("pool", "default");
  r.tenant = j.value("tenant", "");
  r.spread = j.value("spread", true);
  r.burstable = j.value("burstable", false);
  return r;
}

void apply(std::vector<NodeView>& nodes, const std::string& name, const PlacementRequest& r,
           bool inflight) {
  for (auto& n : nodes) {
    if (n.name != name) continue;
    n.cpuUsed += r.cpu;
    n.memoryUsedMb += r.memoryMb;
    if (inflight) {
      n.inflight++;
    } else {
      n.sandboxes++;
    }
    n.tenants[r.tenant]++;
  }
}

TEST(Scheduler, RecordedClusterStates) {
  int files = 0, cases = 0;
  for (auto& entry : std::filesystem::directory_iterator(DSEC_SCHEDULER_TESTDATA)) {
    std::string name = entry.path().filename();
    if (name.rfind("cluster_", 0) != 0) continue;
    ++files;
    std::ifstream f(entry.path());
    json fx = json::parse(f);
    int i = 0;
    for (auto& c : fx.at("cases")) {
      SCOPED_TRACE(name + " case " + std::to_string(i++));
      ++cases;
      // The burst policy: the file's, a case may change the threshold.
      BurstPolicy burst{fx.value("burst_pool", ""), fx.value("burst_threshold", 0.8)};
      burst.threshold = c.value("burst_threshold", burst.threshold);
      Scheduler sched(defaultScorers(), fx.value("max_inflight", 8), burst);
      auto nodes = nodesFrom(fx.at("nodes"));
      PlacementRequest r = requestFrom(c.at("request"));
      if (c.contains("expect")) {
        auto p = sched.pick(nodes, r);
        ASSERT_TRUE(p.isOk()) << p.status().toString();
        EXPECT_EQ(p->node, c["expect"].get<std::string>());
        if (c.contains("expect_burst")) {
          EXPECT_EQ(p->burst, c["expect_burst"].get<bool>());
        }
      }
      if (c.contains("expect_utilization")) {
        EXPECT_NEAR(poolUtilization(nodes, r.pool), c["expect_utilization"].get<double>(), 1e-9);
      }
      if (c.contains("expect_error")) {
        auto p = sched.pick(nodes, r);
        ASSERT_FALSE(p.isOk()) << "placed on " << p->node;
        EXPECT_EQ(codeName(p.status().code()), c["expect_error"].get<std::string>());
        EXPECT_FALSE(p.status().message().empty());
      }
      int n = c.value("place", c.value("place_inflight", 0));
      bool inflight = c.contains("place_inflight");
      if (n > 0) {
        std::map<std::string, int> counts;
        for (int k = 0; k < n; ++k) {
          auto p = sched.pick(nodes, r);
          ASSERT_TRUE(p.isOk()) << "placement " << k << ": " << p.status().toString();
          counts[p->node]++;
          apply(nodes, p->node, r, inflight);
        }
        std::map<std::string, int> want;
        for (auto& [k, v] : c.at("expect_counts").items()) want[k] = v.get<int>();
        EXPECT_EQ(counts, want);
        if (c.contains("then_error")) {
          auto p = sched.pick(nodes, r);
          ASSERT_FALSE(p.isOk());
          EXPECT_EQ(codeName(p.status().code()), c["then_error"].get<std::string>());
        }
      }
    }
  }
  EXPECT_GE(files, 9);
  EXPECT_GE(cases, 30);
}

// A custom scorer plugs in beside (or instead of) the defaults.
class PreferName : public Scorer {
 public:
  explicit PreferName(std::string n) : n_(std::move(n)) {}
  const char* name() const override { return "prefer_name"; }
  double score(const NodeView& v, const PlacementRequest&) const override { return v.name == n_; }

 private:
  std::string n_;
};

TEST(Scheduler, PluggableScorer) {
  std::vector<NodeView> nodes(2);
  nodes[0].name = "a";
  nodes[1].name = "b";
  for (auto& n : nodes) {
    n.cpus = 4;
    n.memoryMb = 4096;
    n.slots = 10;
  }
  nodes[1].cpuUsed = 3;  // busier: the defaults prefer a
  PlacementRequest r;
  EXPECT_EQ(Scheduler(defaultScorers()).pick(nodes, r)->node, "a");
  auto scorers = defaultScorers();
  scorers.push_back({std::make_shared<PreferName>("b"), 10});
  EXPECT_EQ(Scheduler(scorers).pick(nodes, r)->node, "b");
}

NodeView node(const std::string& name, const std::string& pool, double cpus, int64_t mem,
              int64_t slots) {
  NodeView n;
  n.name = name;
  n.pool = pool;
  n.cpus = cpus;
  n.memoryMb = mem;
  n.slots = slots;
  return n;
}

// Utilization is the largest of CPU, memory and slot use, each summed over
// the pool's up nodes; in-flight creations take slots; down nodes and other
// pools do not count; a pool with no node up is full.
TEST(Scheduler, PoolUtilization) {
  std::vector<NodeView> nodes = {node("a", "default", 8, 8192, 10),
                                 node("b", "default", 8, 8192, 10),
                                 node("c", "default", 100, 100000, 100),
                                 node("x", "cloud", 4, 4096, 4)};
  nodes[2].up = false;  // would dilute everything if it counted
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "default"), 0);
  nodes[0].cpuUsed = 4;  // cpu 4/16
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "default"), 0.25);
  nodes[1].memoryUsedMb = 8192;  // memory 8192/16384
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "default"), 0.5);
  nodes[0].sandboxes = 10;
  nodes[1].inflight = 6;  // slots 16/20
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "default"), 0.8);
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "cloud"), 0);
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "gpu"), 1);  // no node at all
  nodes[3].up = false;
  EXPECT_DOUBLE_EQ(poolUtilization(nodes, "cloud"), 1);  // no node up
}

// Placing burstable sandboxes one by one: the own pool takes them until its
// utilization reaches the threshold, the burst pool until it is full, then
// the own pool again until it is full too. Non-burstable ones never burst.
TEST(Scheduler, BurstRun) {
  std::vector<NodeView> nodes = {node("d1", "default", 64, 65536, 5),
                                 node("d2", "default", 64, 65536, 5),
                                 node("c1", "cloud", 64, 65536, 3)};
  Scheduler sched(defaultScorers(), 8, BurstPolicy{"cloud", 0.8});
  PlacementRequest r;
  r.burstable = true;
  std::vector<std::string> pools;
  for (;;) {
    auto p = sched.pick(nodes, r);
    if (!p.isOk()) {
      EXPECT_EQ(p.status().code(), Code::kResourceExhausted) << p.status().toString();
      EXPECT_NE(p.status().message().find("burst pool"), std::string::npos);
      break;
    }
    pools.push_back(p->pool + (p->burst ? "*" : ""));
    for (auto& n : nodes) {
      if (n.name == p->node) n.sandboxes++;
    }
  }
  // 8 of 10 default slots (0.8), then 3 cloud ones, then the last 2 default.
  std::vector<std::string> want(8, "default");
  want.insert(want.end(), 3, "cloud*");
  want.insert(want.end(), 2, "default");
  EXPECT_EQ(pools, want);
  // Not burstable: the own pool only, whatever its load.
  for (auto& n : nodes) n.sandboxes = n.pool == "default" ? 4 : 0;
  r.burstable = false;
  auto p = sched.pick(nodes, r);
  ASSERT_TRUE(p.isOk());
  EXPECT_EQ(p->pool, "default");
  EXPECT_FALSE(p->burst);
  nodes[0].sandboxes = nodes[1].sandboxes = 5;
  EXPECT_EQ(sched.pick(nodes, r).status().code(), Code::kResourceExhausted);
  // No burst pool configured: burstable is just a hint.
  r.burstable = true;
  EXPECT_EQ(Scheduler(defaultScorers(), 8).pick(nodes, r).status().code(),
            Code::kResourceExhausted);
}

TEST(Scheduler, TiesGoToTheFirstName) {
  std::vector<NodeView> nodes(3);
  nodes[0].name = "c";
  nodes[1].name = "a";
  nodes[2].name = "b";
  for (auto& n : nodes) {
    n.cpus = 4;
    n.memoryMb = 4096;
    n.slots = 10;
  }
  EXPECT_EQ(Scheduler(defaultScorers()).pick(nodes, PlacementRequest{})->node, "a");
}

}  // namespace
}  // namespace dsec::platform
