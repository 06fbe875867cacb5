// RunPool on a simulated node: which sandbox serves each call, and when a
// pool grows.
#include "platform/run_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "proto/sim_edge.h"

namespace dsec::platform {
namespace {

// A SimEdge that remembers which sandbox each exec ran in.
class RecordingEdge : public proto::SimEdge {
 public:
  RecordingEdge() : SimEdge(proto::SimOptions{}) {}
  std::shared_ptr<proto::ExecCall> startExec(const std::string& id, const ExecSpec& spec,
                                             proto::ExecCallbacks cb) override {
    {
      std::lock_guard lk(mu_);
      served_.push_back(id);
    }
    return SimEdge::startExec(id, spec, std::move(cb));
  }
  std::vector<std::string> served() {
    std::lock_guard lk(mu_);
    return served_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> served_;
};

const std::vector<std::string> kLayers = {"sha256:aa"};

ExecSpec call() {
  ExecSpec spec;
  spec.argv = {"echo", "1"};
  spec.fncallJson = R"J({"language":"python","code":"print(1)"})J";
  return spec;
}

// Waits (up to 5 s) until the pool holds `n` sandboxes.
bool waitForSandboxes(RunPool& pool, int n) {
  for (int i = 0; i < 500; ++i) {
    auto s = pool.stats();
    if (s.idle + s.busy == n && s.busy == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Two calls of pool "k" back to back (the second finds the first's sandbox
// unsettled), then the wait for the second sandbox made in the background.
bool twoCallsGrowToTwo(RunPool& pool) {
  return pool.run("k", kLayers, call()).isOk() && pool.run("k", kLayers, call()).isOk() &&
         waitForSandboxes(pool, 2);
}

TEST(RunPool, BackToBackCallsGrowThePoolToTwoAndAlternate) {
  RecordingEdge edge;
  RunPoolOptions opts;
  opts.settleSeconds = 0.2;  // every call below follows the last within it
  RunPool pool(&edge, opts);
  ASSERT_TRUE(pool.run("img|python", kLayers, call()).isOk());
  EXPECT_EQ(pool.stats().grown, 0u);  // a first call creates its sandbox; no growth yet
  ASSERT_TRUE(pool.run("img|python", kLayers, call()).isOk());  // found it unsettled
  ASSERT_TRUE(waitForSandboxes(pool, 2));
  EXPECT_EQ(pool.stats().grown, 1u);
  EXPECT_EQ(pool.stats().created, 2u);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(pool.run("img|python", kLayers, call()).isOk());
  auto served = edge.served();
  ASSERT_EQ(served.size(), 8u);
  // From the third call on, each goes to the sandbox the previous one did not use.
  for (size_t i = 3; i < served.size(); ++i) EXPECT_NE(served[i], served[i - 1]) << i;
  EXPECT_EQ(std::set<std::string>(served.begin(), served.end()).size(), 2u);
  EXPECT_EQ(pool.stats().created, 2u);  // it grows to two, no further
  EXPECT_EQ(edge.sandboxIds().size(), 2u);
  pool.shutdown();
  EXPECT_TRUE(edge.sandboxIds().empty());
}

TEST(RunPool, ACallTakesTheMostRecentlyUsedSettledSandbox) {
  RecordingEdge edge;
  RunPoolOptions opts;
  opts.settleSeconds = 0.05;
  RunPool pool(&edge, opts);
  ASSERT_TRUE(twoCallsGrowToTwo(pool));
  // With time to settle between calls, the same sandbox serves them all
  // (the other stays idle and can expire).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(pool.run("k", kLayers, call()).isOk());
  std::string last = edge.served().back();
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(pool.run("k", kLayers, call()).isOk());
    EXPECT_EQ(edge.served().back(), last) << i;
  }
  EXPECT_EQ(pool.stats().created, 2u);
}

TEST(RunPool, NoGrowthAtTheNodesBound) {
  RecordingEdge edge;
  RunPoolOptions opts;
  opts.maxSandboxes = 1;
  opts.settleSeconds = 10;
  RunPool pool(&edge, opts);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(pool.run("k", kLayers, call()).isOk());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto s = pool.stats();
  EXPECT_EQ(s.created, 1u);
  EXPECT_EQ(s.grown, 0u);
  EXPECT_EQ(s.idle, 1);
  auto served = edge.served();
  EXPECT_EQ(std::set<std::string>(served.begin(), served.end()).size(), 1u);
}

TEST(RunPool, AGrownSandboxOfAMovedTagIsDestroyed) {
  RecordingEdge edge;
  RunPoolOptions opts;
  opts.settleSeconds = 10;
  RunPool pool(&edge, opts);
  ASSERT_TRUE(twoCallsGrowToTwo(pool));
  // The tag moves: both old sandboxes go, the call runs in a new one.
  ASSERT_TRUE(pool.run("k", {"sha256:bb"}, call()).isOk());
  ASSERT_TRUE(waitForSandboxes(pool, 1));
  EXPECT_EQ(edge.sandboxIds().size(), 1u);
  EXPECT_EQ(pool.stats().destroyed, 2u);
}

// The pools' figures in a scrape: families listed before any call, then the
// pool, its sandboxes and the call by result.
TEST(RunPool, MetricsListEveryFamilyAndCountCalls) {
  RecordingEdge edge;
  RunPoolOptions opts;
  opts.maxSandboxes = 3;
  RunPool pool(&edge, opts);
  auto render = [&pool] {
    metrics::Writer w;
    pool.writeMetrics(w);
    return w.text();
  };
  std::string empty = render();
  for (const char* line :
       {"# TYPE dsec_fncall_pools gauge\ndsec_fncall_pools 0\n",
        "dsec_fncall_pool_max_sandboxes 3\n", "# TYPE dsec_fncall_pool_sandboxes gauge\n# HELP",
        "dsec_fncall_node_sandboxes{state=\"idle\"} 0\n",
        "dsec_fncall_pool_sandboxes_created_total 0\n", "dsec_fncall_zygote_restarts_total 0\n",
        "# TYPE dsec_fncall_calls_total counter\n"}) {
    EXPECT_NE(empty.find(line), std::string::npos) << line << "\n" << empty;
  }
  ASSERT_TRUE(pool.run("img|python", kLayers, call()).isOk());
  ASSERT_TRUE(waitForSandboxes(pool, 1));
  std::string text = render();
  for (const char* line : {"dsec_fncall_pools 1\n",
                           "dsec_fncall_pool_sandboxes{pool=\"img|python\",state=\"idle\"} 1\n",
                           "dsec_fncall_pool_sandboxes{pool=\"img|python\",state=\"busy\"} 0\n",
                           "dsec_fncall_pool_sandboxes_created_total 1\n",
                           "dsec_fncall_calls_total{result=\"ok\",limit=\"none\"} 1\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
}

}  // namespace
}  // namespace dsec::platform
