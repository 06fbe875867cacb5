// The store's replica and node methods (store.h), on SQLite and PostgreSQL.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>

#include "common/util.h"
#include "platform/store.h"
#include "platform/store_test_util.h"

namespace dsec::platform {
namespace {

class StoreNodesTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override { DSEC_MAKE_TEST_STORE_ENV(env_, GetParam()); }
  void TearDown() override { env_.reset(); }
  std::unique_ptr<Store> open() {
    auto s = env_->open();
    EXPECT_TRUE(s.isOk()) << s.status().toString();
    return s.isOk() ? std::move(*s) : nullptr;
  }
  std::unique_ptr<TestStoreEnv> env_;
};
DSEC_INSTANTIATE_FOR_BOTH_STORES(StoreNodesTest);

NodeRecord node(const std::string& name) {
  NodeRecord r;
  r.name = name;
  r.pool = "default";
  r.url = "http://127.0.0.1:1";
  r.edgeKeyHash = "aa";
  r.platformKey = "pk-" + name;
  r.cpus = 4;
  r.memoryMb = 1024;
  r.slots = 16;
  r.lastHeartbeat = r.joinedAt = 100;
  r.bootId = "b1";
  return r;
}

TEST_P(StoreNodesTest, NodesPutTouchAndStateChangesSurviveReopen) {
  {
    auto s = open();
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->putNode(node("n1")).isOk());
    ASSERT_TRUE(s->putNode(node("n2")).isOk());
    NodeRecord hb = node("n1");
    hb.url = "http://127.0.0.1:2";
    hb.lastHeartbeat = 150;
    hb.bootId = "b2";
    hb.edgeKeyHash = "ignored";  // a heartbeat never changes keys
    ASSERT_TRUE(s->touchNode(hb).isOk());
    hb.lastHeartbeat = 120;  // an older heartbeat (another replica's) does not go back
    ASSERT_TRUE(s->touchNode(hb).isOk());
    EXPECT_EQ(s->touchNode(node("nope")).code(), Code::kNotFound);
    auto won = s->setNodeState("n2", "up", "down");
    ASSERT_TRUE(won.isOk());
    EXPECT_TRUE(*won);
    won = s->setNodeState("n2", "up", "down");  // the second replica to try loses
    ASSERT_TRUE(won.isOk());
    EXPECT_FALSE(*won);
    won = s->setNodeState("nope", "up", "down");
    ASSERT_TRUE(won.isOk());
    EXPECT_FALSE(*won);
  }
  auto s = open();
  ASSERT_TRUE(s);
  auto nodes = s->listNodes();
  ASSERT_TRUE(nodes.isOk()) << nodes.status().toString();
  ASSERT_EQ(nodes->size(), 2u);
  auto& n1 = (*nodes)[0];
  EXPECT_EQ(n1.name, "n1");
  EXPECT_EQ(n1.url, "http://127.0.0.1:2");
  EXPECT_DOUBLE_EQ(n1.lastHeartbeat, 150);
  EXPECT_EQ(n1.bootId, "b2");
  EXPECT_EQ(n1.edgeKeyHash, "aa");
  EXPECT_EQ(n1.platformKey, "pk-n1");
  EXPECT_EQ(n1.state, "up");
  EXPECT_EQ(n1.slots, 16);
  EXPECT_EQ((*nodes)[1].state, "down");
  // A re-join replaces the keys.
  NodeRecord again = node("n1");
  again.edgeKeyHash = "bb";
  again.platformKey = "pk2";
  ASSERT_TRUE(s->putNode(again).isOk());
  nodes = s->listNodes();
  ASSERT_TRUE(nodes.isOk());
  EXPECT_EQ((*nodes)[0].edgeKeyHash, "bb");
  EXPECT_EQ((*nodes)[0].platformKey, "pk2");
}

TEST_P(StoreNodesTest, LeasesGoToOneHolderUntilTheyExpireOrAreReleased) {
  auto s = open();
  ASSERT_TRUE(s);
  auto a = s->acquireLease("leader", "A", 0.5);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_TRUE(*a);
  auto b = s->acquireLease("leader", "B", 0.5);
  ASSERT_TRUE(b.isOk());
  EXPECT_FALSE(*b);
  a = s->acquireLease("leader", "A", 0.5);  // renewal
  ASSERT_TRUE(a.isOk());
  EXPECT_TRUE(*a);
  auto leases = s->listLeases();
  ASSERT_TRUE(leases.isOk());
  ASSERT_EQ(leases->size(), 1u);
  EXPECT_EQ((*leases)[0].holder, "A");
  EXPECT_TRUE((*leases)[0].live);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  leases = s->listLeases();
  ASSERT_TRUE(leases.isOk());
  EXPECT_FALSE((*leases)[0].live);
  b = s->acquireLease("leader", "B", 5);  // A's lapsed
  ASSERT_TRUE(b.isOk());
  EXPECT_TRUE(*b);
  ASSERT_TRUE(s->releaseLease("leader", "A").isOk());  // not A's: nothing happens
  a = s->acquireLease("leader", "A", 5);
  ASSERT_TRUE(a.isOk());
  EXPECT_FALSE(*a);
  ASSERT_TRUE(s->releaseLease("leader", "B").isOk());
  a = s->acquireLease("leader", "A", 5);
  ASSERT_TRUE(a.isOk());
  EXPECT_TRUE(*a);
}

TEST_P(StoreNodesTest, ConcurrentLeaseTakersHaveOneWinner) {
  auto s = open();
  ASSERT_TRUE(s);
  std::atomic<int> wins{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i) {
    ts.emplace_back([&, i] {
      auto r = s->acquireLease("race", "h" + std::to_string(i), 30);
      if (r.isOk() && *r) ++wins;
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(wins.load(), 1);
}

TEST_P(StoreNodesTest, SandboxChangesAreFollowedAndCasRefusesStaleStates) {
  auto s = open();
  ASSERT_TRUE(s);
  double t0 = 0;
  auto none = s->sandboxesChangedSince(1e300, &t0);
  ASSERT_TRUE(none.isOk()) << none.status().toString();
  EXPECT_TRUE(none->empty());
  EXPECT_GT(t0, 1e9);
  SandboxRecord r;
  r.id = "sb-1";
  r.backend = BackendKind::kContainer;
  r.image = "x";
  r.state = SandboxState::kCreating;
  r.replica = "r-a";
  ASSERT_TRUE(s->putSandbox(r).isOk());
  auto got = s->getSandbox("sb-1");
  ASSERT_TRUE(got.isOk());
  EXPECT_EQ(got->replica, "r-a");
  EXPECT_EQ(s->getSandbox("sb-none").status().code(), Code::kNotFound);
  double t1 = 0;
  auto changed = s->sandboxesChangedSince(t0, &t1);
  ASSERT_TRUE(changed.isOk());
  ASSERT_EQ(changed->size(), 1u);
  EXPECT_GE(t1, t0);
  // Nothing since t1 ...
  changed = s->sandboxesChangedSince(t1 + 0.001, nullptr);
  ASSERT_TRUE(changed.isOk());
  EXPECT_TRUE(changed->empty());
  // ... until a compare-and-set from the right state.
  r.state = SandboxState::kFailed;
  auto won = s->casSandbox(r, SandboxState::kRunning);
  ASSERT_TRUE(won.isOk());
  EXPECT_FALSE(*won);
  EXPECT_EQ(s->getSandbox("sb-1")->state, SandboxState::kCreating);
  won = s->casSandbox(r, SandboxState::kCreating);
  ASSERT_TRUE(won.isOk());
  EXPECT_TRUE(*won);
  EXPECT_EQ(s->getSandbox("sb-1")->state, SandboxState::kFailed);
  changed = s->sandboxesChangedSince(t1, nullptr);
  ASSERT_TRUE(changed.isOk());
  ASSERT_EQ(changed->size(), 1u);
  EXPECT_EQ((*changed)[0].state, SandboxState::kFailed);
  // Every writer stamps the change: many at once, and a batch's records.
  double t2 = 0;
  ASSERT_TRUE(s->sandboxesChangedSince(1e300, &t2).isOk());
  SandboxRecord r2 = r, r3 = r;
  r2.id = "sb-2";
  r3.id = "sb-3";
  r3.state = SandboxState::kPending;
  r3.batch = "bt-1";
  ASSERT_TRUE(s->putSandboxes({r2}).isOk());
  BatchRecord b;
  b.id = "bt-1";
  b.count = 1;
  ASSERT_TRUE(s->putBatch(b, {r3.id}, r3).isOk());
  changed = s->sandboxesChangedSince(t2, nullptr);
  ASSERT_TRUE(changed.isOk());
  std::set<std::string> ids;
  for (auto& c : *changed) ids.insert(c.id);
  // (sb-1, changed just before t2, may be there too: the clock is coarse.)
  EXPECT_TRUE(ids.count("sb-2") && ids.count("sb-3")) << ids.size();
  SandboxRecord ghost = r;
  ghost.id = "sb-ghost";
  won = s->casSandbox(ghost, SandboxState::kCreating);
  ASSERT_TRUE(won.isOk());
  EXPECT_FALSE(*won);
}

TEST_P(StoreNodesTest, TheFirstSettingWins) {
  auto s = open();
  ASSERT_TRUE(s);
  auto v = s->settingOrPut("join_token_sha256", "one");
  ASSERT_TRUE(v.isOk()) << v.status().toString();
  EXPECT_EQ(*v, "one");
  v = s->settingOrPut("join_token_sha256", "two");
  ASSERT_TRUE(v.isOk());
  EXPECT_EQ(*v, "one");
}

}  // namespace
}  // namespace dsec::platform
