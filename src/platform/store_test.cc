#include "platform/store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <cstdio>
#include <thread>

#include "common/util.h"
#include "platform/pg_store.h"
#include "platform/store_test_util.h"

namespace dsec::platform {
namespace {

// Tests every store must pass (TEST_P: run on SQLite and on PostgreSQL).
class StoreTest : public ::testing::TestWithParam<StoreKind> {
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
DSEC_INSTANTIATE_FOR_BOTH_STORES(StoreTest);

TEST_P(StoreTest, TenantsAndKeysSurviveReopen) {
  {
    auto s = open();
    ASSERT_TRUE(s);
    TenantRecord t;
    t.id = "acme";
    t.name = "Acme";
    t.quota.maxSandboxes = 3;
    t.quota.maxCpu = 2.5;
    t.quota.maxMemoryMb = 1024;
    t.quota.createsPerS = 0.5;
    t.quota.createBurst = 2;
    t.createdAt = 7;
    ASSERT_TRUE(s->putTenant(t).isOk());
    TenantRecord u;
    u.id = "beta";
    u.role = "admin";
    ASSERT_TRUE(s->putTenant(u).isOk());
    ASSERT_TRUE(s->putApiKey(ApiKeyRecord{"k1", "acme", "h1", "ci", 1, 0}).isOk());
    ASSERT_TRUE(s->putApiKey(ApiKeyRecord{"k2", "acme", "h2", "", 2, 0}).isOk());
    ASSERT_TRUE(s->putApiKey(ApiKeyRecord{"k3", "beta", "h3", "", 3, 0}).isOk());
    ASSERT_TRUE(s->putApiKey(ApiKeyRecord{"k2", "acme", "h2", "", 2, 9}).isOk());  // revoke
    ImageRecord img{"acme/x", "latest", {"sha256:aa"}, 1, 1};
    img.owner = "acme";
    img.visibility = "private";
    ASSERT_TRUE(s->putImage(img).isOk());
  }
  auto s = open();
  ASSERT_TRUE(s);
  auto t = s->getTenant("acme");
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  EXPECT_EQ(t->name, "Acme");
  EXPECT_EQ(t->role, "user");
  EXPECT_EQ(t->quota.maxSandboxes, 3);
  EXPECT_DOUBLE_EQ(t->quota.maxCpu, 2.5);
  EXPECT_EQ(t->quota.maxMemoryMb, 1024);
  EXPECT_DOUBLE_EQ(t->quota.createsPerS, 0.5);
  EXPECT_EQ(t->quota.createBurst, 2);
  EXPECT_EQ(s->getTenant("nope").status().code(), Code::kNotFound);
  auto all = s->listTenants();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[1].role, "admin");
  auto k2 = s->getApiKey("k2");
  ASSERT_TRUE(k2.isOk());
  EXPECT_EQ(k2->hash, "h2");
  EXPECT_DOUBLE_EQ(k2->revokedAt, 9);
  EXPECT_EQ(s->listApiKeys("acme")->size(), 2u);
  EXPECT_EQ(s->listApiKeys("")->size(), 3u);
  auto img = s->getImage("acme/x", "latest");
  ASSERT_TRUE(img.isOk());
  EXPECT_EQ(img->owner, "acme");
  EXPECT_EQ(img->visibility, "private");
  // A tenant goes with its keys; others stay.
  ASSERT_TRUE(s->deleteTenant("acme").isOk());
  EXPECT_EQ(s->deleteTenant("acme").code(), Code::kNotFound);
  EXPECT_EQ(s->getApiKey("k1").status().code(), Code::kNotFound);
  EXPECT_EQ(s->listApiKeys("")->size(), 1u);
  EXPECT_TRUE(s->getTenant("beta").isOk());
}

TEST_P(StoreTest, ImagesDefaultToPublicAndSandboxesToAdmin) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putImage(ImageRecord{"old", "latest", {"sha256:aa"}, 1, 1}).isOk());
  auto img = s->getImage("old", "latest");
  ASSERT_TRUE(img.isOk());
  EXPECT_EQ(img->owner, "");
  EXPECT_EQ(img->visibility, "public");
  auto sb = sandboxFromJson(
      R"({"id":"sb-1","backend":"container","image":"x","layers":[],"state":"running","cpu":1,)"
      R"("memory_mb":1,"disk_mb":1,"pids":1,"ttl_s":1,"env":{},"labels":{},"created_at":1,)"
      R"("updated_at":1,"expires_at":0,"stopped_at":0})");
  ASSERT_TRUE(sb.isOk()) << sb.status().toString();
  EXPECT_EQ(sb->owner, "admin");
}

TEST_P(StoreTest, SandboxesSurviveReopen) {
  {
    auto s = env_->open();
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    SandboxRecord r;
    r.id = "sb-1";
    r.backend = BackendKind::kContainer;
    r.image = "busybox:latest";
    r.layers = {"sha256:aa"};
    r.state = SandboxState::kRunning;
    r.labels = {{"job", "x"}};
    ASSERT_TRUE((*s)->putSandbox(r).isOk());
    r.state = SandboxState::kStopped;
    ASSERT_TRUE((*s)->putSandbox(r).isOk());
    ASSERT_TRUE((*s)->putBlob("sha256:aa", 10).isOk());
    ASSERT_TRUE((*s)->putImage(ImageRecord{"busybox", "latest", {"sha256:aa"}, 10, 1}).isOk());
  }
  auto s = env_->open();
  ASSERT_TRUE(s.isOk());
  auto all = (*s)->loadSandboxes();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].state, SandboxState::kStopped);
  EXPECT_EQ((*all)[0].labels.at("job"), "x");
  EXPECT_EQ(*(*s)->blobSize("sha256:aa"), 10);
  EXPECT_EQ((*s)->blobSize("sha256:bb").status().code(), Code::kNotFound);
  auto img = (*s)->getImage("busybox", "latest");
  ASSERT_TRUE(img.isOk());
  EXPECT_EQ(img->layers, std::vector<std::string>{"sha256:aa"});
  EXPECT_EQ((*s)->getImage("busybox", "nope").status().code(), Code::kNotFound);
  EXPECT_TRUE((*s)->deleteImage("busybox", "latest").isOk());
  EXPECT_EQ((*s)->deleteImage("busybox", "latest").code(), Code::kNotFound);
}

TEST_P(StoreTest, BatchesAndGroupWritesSurviveReopen) {
  SandboxRecord tmpl;
  tmpl.backend = BackendKind::kContainer;
  tmpl.image = "busybox:latest";
  tmpl.state = SandboxState::kPending;
  tmpl.batch = "bt-1";
  tmpl.error = "quote \" and \\ and {json}";
  tmpl.labels = {{"job", "rl-42"}};
  std::vector<std::string> ids;
  std::vector<SandboxRecord> recs;
  for (int i = 0; i < 300; ++i) {
    ids.push_back("sb-" + std::to_string(1000 + i));
    recs.push_back(tmpl);
    recs.back().id = ids.back();
  }
  BatchRecord b;
  b.id = "bt-1";
  b.owner = "team-a";
  b.count = 300;
  b.allOrNothing = true;
  b.spec = R"({"image":"busybox:latest"})";
  b.createdAt = b.updatedAt = 5;
  {
    auto s = env_->open();
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    ASSERT_TRUE((*s)->putBatch(b, ids, tmpl).isOk());
    // A group of outcomes, and a rename (drop one id, add another) in one write.
    std::vector<SandboxRecord> done(recs.begin(), recs.begin() + 100);
    for (auto& r : done) r.state = SandboxState::kRunning;
    SandboxRecord renamed = recs[299];
    renamed.id = "sb-new";
    done.push_back(renamed);
    ASSERT_TRUE((*s)->putSandboxes(done, {"sb-1299"}).isOk());
    b.state = BatchState::kDone;
    ASSERT_TRUE((*s)->putBatch(b, {}).isOk());
    EXPECT_TRUE((*s)->putSandboxes({}).isOk());
  }
  auto s = env_->open();
  ASSERT_TRUE(s.isOk());
  auto all = (*s)->loadSandboxes();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 300u);
  int running = 0, pending = 0;
  bool sawNew = false, sawOld = false;
  for (auto& r : *all) {
    EXPECT_EQ(r.batch, "bt-1");
    running += r.state == SandboxState::kRunning;
    pending += r.state == SandboxState::kPending;
    sawNew = sawNew || r.id == "sb-new";
    sawOld = sawOld || r.id == "sb-1299";
    // Each record under its own id, the rest as written.
    EXPECT_TRUE(r.id == "sb-new" || (r.id >= "sb-1000" && r.id <= "sb-1298")) << r.id;
    EXPECT_EQ(r.error, "quote \" and \\ and {json}");
    EXPECT_EQ(r.labels.at("job"), "rl-42");
  }
  EXPECT_EQ(running, 100);
  EXPECT_EQ(pending, 200);
  EXPECT_TRUE(sawNew);
  EXPECT_FALSE(sawOld);
  auto batches = (*s)->loadBatches();
  ASSERT_TRUE(batches.isOk());
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].state, BatchState::kDone);
  EXPECT_EQ((*batches)[0].owner, "team-a");
  EXPECT_EQ((*batches)[0].count, 300);
  EXPECT_TRUE((*batches)[0].allOrNothing);
  EXPECT_EQ((*batches)[0].spec, b.spec);
  EXPECT_TRUE((*s)->deleteBatch("bt-1").isOk());
  EXPECT_EQ((*s)->deleteBatch("bt-1").code(), Code::kNotFound);
}

TEST_P(StoreTest, ImageConfigsPersist) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putImage(ImageRecord{"old", "latest", {"sha256:aa"}, 1, 2}).isOk());
  ImageRecord r{"app", "1", {"sha256:aa"}, 10, 1};
  r.config = {"1000:1000", {"FOO=bar", "PATH=/bin"}, "/work"};
  r.kind = "toolkit";
  r.parent = R"({"image":"x"})";
  ASSERT_TRUE(s->putImage(r).isOk());
  auto back = s->getImage("app", "1");
  ASSERT_TRUE(back.isOk());
  EXPECT_EQ(back->config, r.config);
  EXPECT_EQ(back->kind, "toolkit");
  EXPECT_EQ(back->parent, r.parent);
  EXPECT_EQ(back->createdAt, 1);
  EXPECT_TRUE(s->getImage("old", "latest")->config.empty());
  auto all = s->listImages();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].config, r.config);  // "app" sorts before "old"
  // Put again: replaced.
  r.layers = {"sha256:bb", "sha256:cc"};
  ASSERT_TRUE(s->putImage(r).isOk());
  EXPECT_EQ(s->getImage("app", "1")->layers, r.layers);
  EXPECT_EQ(s->listImages()->size(), 2u);
  // A built image's entrypoint, cmd and labels go in the same column.
  r.config.entrypoint = {"/bin/app", "--serve"};
  r.config.cmd = {"x"};
  r.config.labels = {{"org.opencontainers.image.title", "app"}, {"k", ""}};
  ASSERT_TRUE(s->putImage(r).isOk());
  EXPECT_EQ(s->getImage("app", "1")->config, r.config);
}

TEST_P(StoreTest, BuildCacheEntriesAreFoundTouchedAndPruned) {
  {
    auto s = open();
    ASSERT_TRUE(s);
    EXPECT_EQ(s->getBuildCache("sha256:k1").status().code(), Code::kNotFound);
    ASSERT_TRUE(s->putBuildCache({"sha256:k1", "sha256:l1", R"({"line":3})", 10, 10}).isOk());
    ASSERT_TRUE(s->putBuildCache({"sha256:k2", "sha256:l2", "", 20, 20}).isOk());
    ASSERT_TRUE(s->putBuildCache({"sha256:k3", "sha256:l1", "", 5, 5}).isOk());
  }
  auto s = open();  // they survive a reopen
  ASSERT_TRUE(s);
  auto e = s->getBuildCache("sha256:k1");
  ASSERT_TRUE(e.isOk());
  EXPECT_EQ(e->layer, "sha256:l1");
  EXPECT_EQ(e->config, R"({"line":3})");
  EXPECT_EQ(e->createdAt, 10);
  EXPECT_EQ(e->usedAt, 10);
  ASSERT_TRUE(s->touchBuildCache("sha256:k1", 30).isOk());
  ASSERT_TRUE(s->touchBuildCache("sha256:k1", 25).isOk());  // never back in time
  ASSERT_TRUE(s->touchBuildCache("sha256:none", 30).isOk());
  EXPECT_EQ(s->getBuildCache("sha256:k1")->usedAt, 30);
  EXPECT_EQ(s->getBuildCache("sha256:k1")->createdAt, 10);
  EXPECT_EQ(*s->buildCacheLayers(15), (std::set<std::string>{"sha256:l1", "sha256:l2"}));
  EXPECT_EQ(*s->buildCacheLayers(21), (std::set<std::string>{"sha256:l1"}));
  EXPECT_EQ(*s->buildCacheLayers(0), (std::set<std::string>{"sha256:l1", "sha256:l2"}));
  // Replaced whole by a put of the same key.
  ASSERT_TRUE(s->putBuildCache({"sha256:k2", "sha256:l9", "", 40, 40}).isOk());
  EXPECT_EQ(s->getBuildCache("sha256:k2")->layer, "sha256:l9");
  auto gone = s->deleteBuildCacheBefore(30);
  ASSERT_TRUE(gone.isOk());
  EXPECT_EQ(*gone, 1);  // k3
  EXPECT_EQ(s->getBuildCache("sha256:k3").status().code(), Code::kNotFound);
  EXPECT_TRUE(s->getBuildCache("sha256:k1").isOk());
  EXPECT_EQ(*s->deleteBuildCacheBefore(100), 2);
  EXPECT_TRUE(s->buildCacheLayers(0)->empty());
}

TEST(SqliteStoreTest, OldDatabasesUpgrade) {
  std::string dir = "/tmp/dsec-store-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  {
    // The images table as first released: no kind, parent or config.
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open((dir + "/state.db").c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db,
                           "CREATE TABLE images(name TEXT NOT NULL, tag TEXT NOT NULL, "
                           "layers TEXT NOT NULL, size INTEGER NOT NULL, created_at REAL NOT NULL, "
                           "PRIMARY KEY(name, tag));"
                           "INSERT INTO images VALUES('old', 'latest', '[\"sha256:aa\"]', 1, 2);",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  auto s = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  auto old = (*s)->getImage("old", "latest");
  ASSERT_TRUE(old.isOk()) << old.status().toString();
  EXPECT_TRUE(old->config.empty());
  EXPECT_EQ(old->kind, "base");

  ImageRecord r{"app", "1", {"sha256:aa"}, 10, 1};
  r.config = {"1000:1000", {"FOO=bar", "PATH=/bin"}, "/work"};
  ASSERT_TRUE((*s)->putImage(r).isOk());
  auto back = (*s)->getImage("app", "1");
  ASSERT_TRUE(back.isOk());
  EXPECT_EQ(back->config, r.config);
  auto all = (*s)->listImages();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].config, r.config);  // "app" sorts before "old"
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(StoreCodecTest, SandboxUserAndWorkingDirRoundTripAndOldRecordsRead) {
  SandboxRecord r;
  r.id = "sb-2";
  r.backend = BackendKind::kContainer;
  r.image = "app:1";
  r.state = SandboxState::kRunning;
  r.user = "1000:1000";
  r.workingDir = "/work";
  auto back = sandboxFromJson(sandboxToJson(r));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->user, "1000:1000");
  EXPECT_EQ(back->workingDir, "/work");
  // A record written before sandboxes had a user.
  auto old = sandboxFromJson(
      R"({"id":"sb-3","backend":"container","image":"x:1","layers":[],"state":"stopped",)"
      R"("cpu":1,"memory_mb":512,"disk_mb":1024,"pids":1024,"ttl_s":0,"env":{},"labels":{},)"
      R"("created_at":1,"updated_at":1,"expires_at":0,"stopped_at":2})");
  ASSERT_TRUE(old.isOk()) << old.status().toString();
  EXPECT_EQ(old->user, "");
  EXPECT_EQ(old->workingDir, "");
}

}  // namespace
}  // namespace dsec::platform

namespace dsec::platform {
namespace {

TrajectoryStep stepOf(const std::string& t, int64_t n, const std::string& content) {
  TrajectoryStep s;
  s.trajectory = t;
  s.step = n;
  s.digest = "sha256:d" + std::to_string(n);
  s.kind = content.empty() ? "exec" : "write";
  s.sandbox = "sb-1";
  s.request = "{}";
  s.contentType = "application/json";
  s.body = "{}";
  s.startedAt = s.finishedAt = 100 + double(n);
  s.content = content;
  return s;
}

// A database made before steps kept their content digest gets the column.
TEST(SqliteStoreTest, OldStepTablesUpgrade) {
  std::string dir = "/tmp/dsec-store-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open((dir + "/state.db").c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db,
                           "CREATE TABLE trajectory_steps(trajectory TEXT NOT NULL, step INTEGER "
                           "NOT NULL, digest TEXT NOT NULL, kind TEXT NOT NULL, sandbox TEXT NOT "
                           "NULL, request TEXT NOT NULL, status INTEGER NOT NULL, content_type "
                           "TEXT NOT NULL, body BLOB NOT NULL, started_at REAL NOT NULL, "
                           "finished_at REAL NOT NULL, PRIMARY KEY(trajectory, step));"
                           "INSERT INTO trajectory_steps VALUES('a', 0, 'sha256:d0', 'exec', "
                           "'sb-1', '{}', 200, 'application/json', X'7b7d', 1, 2);",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  auto s = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  auto old = (*s)->getStep("a", 0);
  ASSERT_TRUE(old.isOk()) << old.status().toString();
  EXPECT_EQ(old->content, "");
  EXPECT_EQ(old->body, "{}");
  ASSERT_TRUE((*s)->putStep(stepOf("a", 1, "sha256:c1")).isOk());
  EXPECT_EQ(*(*s)->stepContents(), (std::set<std::string>{"sha256:c1"}));
  ASSERT_TRUE(removeTree(dir).isOk());
}

// Steps keep the digest of their bytes, the trajectory's record comes and
// goes with its steps.
TEST_P(StoreTest, StepContentsAndTrajectoryRecords) {
  auto s = open();
  ASSERT_TRUE(s);
  Store& st = *s;
  ASSERT_TRUE(st.putStep(stepOf("a", 0, "")).isOk());
  ASSERT_TRUE(st.putStep(stepOf("a", 1, "sha256:c1")).isOk());
  ASSERT_TRUE(st.putStep(stepOf("b", 0, "sha256:c1")).isOk());
  ASSERT_TRUE(st.putStep(stepOf("b", 1, "sha256:c2")).isOk());
  EXPECT_EQ(st.getStep("a", 1)->content, "sha256:c1");
  EXPECT_EQ(*st.stepContents(), (std::set<std::string>{"sha256:c1", "sha256:c2"}));
  EXPECT_EQ(st.getTrajectory("a").status().code(), Code::kNotFound);
  TrajectoryRecord r;
  r.id = "a";
  r.sandbox = "sb-2";
  r.sandboxDoc = "{\"id\":\"sb-2\"}";
  r.replaced = {"sb-1"};
  r.recoveries = "[{\"sandbox\":\"sb-2\"}]";
  ASSERT_TRUE(st.putTrajectory(r).isOk());
  auto got = st.getTrajectory("a");
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(got->sandbox, "sb-2");
  EXPECT_EQ(got->sandboxDoc, r.sandboxDoc);
  EXPECT_EQ(got->replaced, r.replaced);
  EXPECT_EQ(got->recoveries, r.recoveries);
  // Deleting `b` leaves c1 kept by `a`; deleting `a` takes its record.
  EXPECT_EQ(*st.deleteTrajectory("b"), 2);
  EXPECT_TRUE(*st.stepContentUsed("sha256:c1"));
  EXPECT_FALSE(*st.stepContentUsed("sha256:c2"));
  r.id = "b";
  ASSERT_TRUE(st.putTrajectory(r).isOk());  // a record without steps: retention drops it
  EXPECT_EQ(*st.deleteTrajectoriesBefore(0), 0);
  EXPECT_EQ(st.getTrajectory("b").status().code(), Code::kNotFound);
  EXPECT_EQ(*st.deleteTrajectory("a"), 2);
  EXPECT_EQ(st.getTrajectory("a").status().code(), Code::kNotFound);
  EXPECT_TRUE(st.stepContents()->empty());
}

}  // namespace
}  // namespace dsec::platform

namespace dsec::platform {
namespace {

TEST_P(StoreTest, StepsAreBytesRefuseRepeatsAndListInOrder) {
  auto s = open();
  ASSERT_TRUE(s);
  TrajectoryStep a = stepOf("t", 1, "");
  a.body = std::string("\0\x01\xff\n{\"x\":1}\0", 12);  // bytes, NULs included
  a.contentType = "application/octet-stream";
  a.status = 201;
  a.startedAt = 1700000000.123456;
  a.finishedAt = 1700000000.654321;
  ASSERT_TRUE(s->putStep(a).isOk());
  ASSERT_TRUE(s->putStep(stepOf("t", 0, "")).isOk());
  ASSERT_TRUE(s->putStep(stepOf("u", 0, "")).isOk());
  // The same key again: refused, whatever it holds (Chronus relies on this).
  TrajectoryStep other = a;
  other.digest = "sha256:other";
  Status again = s->putStep(other);
  EXPECT_EQ(again.code(), Code::kAlreadyExists) << again.toString();
  EXPECT_EQ(s->putStep(a).code(), Code::kAlreadyExists);
  auto back = s->getStep("t", 1);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->body, a.body);
  EXPECT_EQ(back->digest, a.digest);
  EXPECT_EQ(back->status, 201);
  EXPECT_EQ(back->contentType, a.contentType);
  EXPECT_EQ(back->startedAt, a.startedAt);  // exact: doubles round-trip
  EXPECT_EQ(back->finishedAt, a.finishedAt);
  EXPECT_EQ(s->getStep("t", 2).status().code(), Code::kNotFound);
  auto steps = s->loadTrajectory("t");
  ASSERT_TRUE(steps.isOk());
  ASSERT_EQ(steps->size(), 2u);
  EXPECT_EQ((*steps)[0].step, 0);
  EXPECT_EQ((*steps)[1].step, 1);
  auto list = s->listTrajectories();
  ASSERT_TRUE(list.isOk());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].id, "t");
  EXPECT_EQ((*list)[0].steps, 2);
  EXPECT_EQ((*list)[0].firstAt, 100);
  EXPECT_EQ((*list)[0].lastAt, a.finishedAt);
  // Retention: `u` (finished at 100) goes, `t` (last step later) stays whole.
  EXPECT_EQ(*s->deleteTrajectoriesBefore(200), 1);
  EXPECT_EQ(s->listTrajectories()->size(), 1u);
  EXPECT_EQ(*s->deleteTrajectory("nope"), 0);
}

// Many threads on one store: every call works, and of racing putSteps on one
// key exactly one wins.
TEST_P(StoreTest, ConcurrentCallsFromManyThreads) {
  auto s = open();
  ASSERT_TRUE(s);
  constexpr int kThreads = 8, kKeys = 20;
  std::atomic<int> wins{0}, conflicts{0}, errors{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int k = 0; k < kKeys; ++k) {
        TrajectoryStep st = stepOf("race", k, "");
        st.sandbox = "sb-" + std::to_string(t);
        Status r = s->putStep(st);
        if (r.isOk()) {
          ++wins;
        } else if (r.code() == Code::kAlreadyExists) {
          ++conflicts;
        } else {
          ++errors;
        }
        SandboxRecord sb;
        sb.id = "sb-" + std::to_string(t) + "-" + std::to_string(k);
        sb.backend = BackendKind::kContainer;
        sb.state = SandboxState::kRunning;
        if (!s->putSandbox(sb).isOk() || !s->loadSandboxes().isOk()) ++errors;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors, 0);
  EXPECT_EQ(wins, kKeys);
  EXPECT_EQ(conflicts, kKeys * (kThreads - 1));
  EXPECT_EQ(s->loadTrajectory("race")->size(), size_t(kKeys));
  EXPECT_EQ(s->loadSandboxes()->size(), size_t(kThreads * kKeys));
}

TEST_P(StoreTest, BlobsKindsAndDeletes) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putBlob("sha256:m", 10).isOk());
  ASSERT_TRUE(s->putBlob("sha256:d", 1 << 30).isOk());
  EXPECT_TRUE(*s->hasBlob("sha256:m"));
  EXPECT_FALSE(*s->hasBlob("sha256:x"));
  ASSERT_TRUE(s->setBlobKind("sha256:m", "base").isOk());
  ASSERT_TRUE(s->setBlobData("sha256:m", "sha256:d").isOk());
  ASSERT_TRUE(s->setBlobKind("sha256:d", "data").isOk());
  ASSERT_TRUE(s->setBlobChunks("sha256:d", "sha256:idx").isOk());
  auto m = s->getBlob("sha256:m");
  ASSERT_TRUE(m.isOk());
  EXPECT_EQ(m->kind, "base");
  EXPECT_EQ(m->data, "sha256:d");
  EXPECT_GT(m->createdAt, 1.6e9);  // seconds since the epoch
  double created = m->createdAt;
  // A re-upload keeps the kind and refreshes created_at.
  ASSERT_TRUE(s->putBlob("sha256:m", 10).isOk());
  EXPECT_EQ(s->getBlob("sha256:m")->kind, "base");
  EXPECT_GE(s->getBlob("sha256:m")->createdAt, created);
  auto all = s->listBlobs();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].digest, "sha256:d");
  EXPECT_EQ((*all)[0].size, 1 << 30);
  EXPECT_EQ((*all)[0].chunks, "sha256:idx");
  ASSERT_TRUE(s->deleteBlob("sha256:m").isOk());
  EXPECT_EQ(s->getBlob("sha256:m").status().code(), Code::kNotFound);
  EXPECT_EQ(s->blobSize("sha256:m").status().code(), Code::kNotFound);
  ASSERT_TRUE(s->deleteSandbox("never-there").isOk());
}

TEST_P(StoreTest, PulledImagesAndLayersRecordTheirSource) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putBlob("sha256:m1", 10).isOk());
  ASSERT_TRUE(s->putBlob("sha256:m2", 10).isOk());
  EXPECT_EQ(s->findLayerBySource("sha256:gz").status().code(), Code::kNotFound);
  ASSERT_TRUE(s->setBlobSource("sha256:m1", "sha256:gz").isOk());
  EXPECT_EQ(*s->findLayerBySource("sha256:gz"), "sha256:m1");
  EXPECT_EQ(s->getBlob("sha256:m1")->source, "sha256:gz");
  EXPECT_EQ(s->getBlob("sha256:m2")->source, "");
  EXPECT_EQ((*s->listBlobs())[0].source, "sha256:gz");
  // Gone with its blob.
  ASSERT_TRUE(s->deleteBlob("sha256:m1").isOk());
  EXPECT_EQ(s->findLayerBySource("sha256:gz").status().code(), Code::kNotFound);

  ImageRecord r{"127.0.0.1:5000/app", "1", {"sha256:m2"}, 10, 1};
  r.source = R"({"manifest_digest":"sha256:mm"})";
  ASSERT_TRUE(s->putImage(r).isOk());
  ASSERT_TRUE(s->putImage(ImageRecord{"local", "latest", {"sha256:m2"}, 10, 1}).isOk());
  EXPECT_EQ(s->getImage("127.0.0.1:5000/app", "1")->source, r.source);
  EXPECT_EQ(s->getImage("local", "latest")->source, "");
  EXPECT_EQ((*s->listImages())[0].source, r.source);
}

TEST_P(StoreTest, LayersRecordWhatTheyReadOfExtraBlobsAndDataBlobsWhatGcReclaimed) {
  auto s = open();
  ASSERT_TRUE(s);
  for (const char* d : {"sha256:m", "sha256:d", "sha256:x1"}) ASSERT_TRUE(s->putBlob(d, 10).isOk());
  ASSERT_TRUE(s->setBlobExtraData("sha256:m", {"sha256:x1"}).isOk());
  EXPECT_EQ(s->getBlob("sha256:m")->extraReads, "");
  EXPECT_EQ(s->getBlob("sha256:x1")->reclaimed, "");
  ASSERT_TRUE(s->setBlobExtraReads("sha256:m", "0+32,96+64").isOk());
  ASSERT_TRUE(s->setBlobReclaimed("sha256:x1", "32+64").isOk());
  EXPECT_EQ(s->getBlob("sha256:m")->extraReads, "0+32,96+64");
  EXPECT_EQ(s->getBlob("sha256:m")->reclaimed, "");
  EXPECT_EQ(s->getBlob("sha256:x1")->reclaimed, "32+64");
  EXPECT_EQ(s->getBlob("sha256:x1")->extraReads, "");
  auto all = s->listBlobs();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[1].digest, "sha256:m");
  EXPECT_EQ((*all)[1].extraReads, "0+32,96+64");
  EXPECT_EQ((*all)[2].reclaimed, "32+64");
  // Other updates leave them alone, a re-upload too; then they survive a reopen.
  ASSERT_TRUE(s->setBlobKind("sha256:x1", "data").isOk());
  ASSERT_TRUE(s->putBlob("sha256:x1", 10).isOk());
  s.reset();
  s = open();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->getBlob("sha256:x1")->reclaimed, "32+64");
  EXPECT_EQ(s->getBlob("sha256:m")->extraReads, "0+32,96+64");
  ASSERT_TRUE(s->setBlobReclaimed("sha256:x1", "").isOk());
  EXPECT_EQ(s->getBlob("sha256:x1")->reclaimed, "");
}

// A list a store answered, sorted; empty (and a failure) on an error.
std::vector<std::string> sortedOk(Result<std::vector<std::string>> r) {
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  std::vector<std::string> v = r.isOk() ? *r : std::vector<std::string>{};
  std::sort(v.begin(), v.end());
  return v;
}

TEST_P(StoreTest, ImagesNamingALayer) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putImage(ImageRecord{"a", "1", {"sha256:l1", "sha256:l22"}, 1, 1}).isOk());
  ASSERT_TRUE(s->putImage(ImageRecord{"b", "2", {"sha256:l2"}, 1, 1}).isOk());
  auto names = [&](const std::string& l) { return sortedOk(s->imagesNaming(l)); };
  EXPECT_EQ(names("sha256:l1"), std::vector<std::string>{"a:1"});
  EXPECT_EQ(names("sha256:l2"), std::vector<std::string>{"b:2"});  // not a prefix of l22
  EXPECT_EQ(names("sha256:l22"), std::vector<std::string>{"a:1"});
  EXPECT_TRUE(names("sha256:l").empty());
  ASSERT_TRUE(s->deleteImage("b", "2").isOk());
  EXPECT_TRUE(names("sha256:l2").empty());
}

TEST_P(StoreTest, LayersNamingADataBlobAsDataOrExtra) {
  auto s = open();
  ASSERT_TRUE(s);
  for (const char* d : {"sha256:m1", "sha256:m2", "sha256:m3", "sha256:d1", "sha256:d2",
                        "sha256:d11"}) {
    ASSERT_TRUE(s->putBlob(d, 10).isOk());
  }
  ASSERT_TRUE(s->setBlobData("sha256:m1", "sha256:d1").isOk());
  ASSERT_TRUE(s->setBlobData("sha256:m2", "sha256:d2").isOk());
  ASSERT_TRUE(s->setBlobExtraData("sha256:m2", {"sha256:d11", "sha256:d1"}).isOk());
  ASSERT_TRUE(s->setBlobData("sha256:m3", "sha256:d11").isOk());
  auto sorted = [&](const std::string& d) { return sortedOk(s->layersNaming(d)); };
  EXPECT_EQ(sorted("sha256:d1"), (std::vector<std::string>{"sha256:m1", "sha256:m2"}));
  EXPECT_EQ(sorted("sha256:d11"), (std::vector<std::string>{"sha256:m2", "sha256:m3"}));
  EXPECT_EQ(sorted("sha256:d2"), (std::vector<std::string>{"sha256:m2"}));
  EXPECT_TRUE(sorted("sha256:d").empty());  // a prefix of d1 and d11 names nothing
  EXPECT_TRUE(sorted("sha256:m1").empty());
}

TEST_P(StoreTest, LayersRecordTheExtraDataBlobsTheirChunksPointInto) {
  auto s = open();
  ASSERT_TRUE(s);
  for (const char* d : {"sha256:m", "sha256:d", "sha256:x1", "sha256:x2"}) {
    ASSERT_TRUE(s->putBlob(d, 10).isOk());
  }
  ASSERT_TRUE(s->setBlobData("sha256:m", "sha256:d").isOk());
  EXPECT_TRUE(s->getBlob("sha256:m")->extraData.empty());
  // Device order is kept (x2 before x1), not sorted.
  ASSERT_TRUE(s->setBlobExtraData("sha256:m", {"sha256:x2", "sha256:x1"}).isOk());
  EXPECT_EQ(s->getBlob("sha256:m")->extraData,
            (std::vector<std::string>{"sha256:x2", "sha256:x1"}));
  EXPECT_EQ(s->getBlob("sha256:m")->data, "sha256:d");
  EXPECT_TRUE(s->getBlob("sha256:d")->extraData.empty());
  auto all = s->listBlobs();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 4u);
  EXPECT_EQ((*all)[1].digest, "sha256:m");
  EXPECT_EQ((*all)[1].extraData, (std::vector<std::string>{"sha256:x2", "sha256:x1"}));
  // Replaced, then cleared.
  ASSERT_TRUE(s->setBlobExtraData("sha256:m", {"sha256:x1"}).isOk());
  EXPECT_EQ(s->getBlob("sha256:m")->extraData, (std::vector<std::string>{"sha256:x1"}));
  ASSERT_TRUE(s->setBlobExtraData("sha256:m", {}).isOk());
  EXPECT_TRUE(s->getBlob("sha256:m")->extraData.empty());
  // A digest that would not survive the column's encoding is refused.
  EXPECT_EQ(s->setBlobExtraData("sha256:m", {"sha256:a b"}).code(), Code::kInvalidArgument);
  EXPECT_EQ(s->setBlobExtraData("sha256:m", {""}).code(), Code::kInvalidArgument);
  EXPECT_TRUE(s->getBlob("sha256:m")->extraData.empty());
  // And it survives a reopen.
  ASSERT_TRUE(s->setBlobExtraData("sha256:m", {"sha256:x1", "sha256:x2"}).isOk());
  s.reset();
  s = open();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->getBlob("sha256:m")->extraData,
            (std::vector<std::string>{"sha256:x1", "sha256:x2"}));
}

std::string shaOf(int i) {
  char buf[65];
  snprintf(buf, sizeof buf, "%064x", i);
  return buf;
}

TEST_P(StoreTest, ChunkTableFirstLocationWinsAndGoesWithItsBlob) {
  auto s = open();
  ASSERT_TRUE(s);
  auto none = s->findChunk(shaOf(1), 4096);
  ASSERT_TRUE(none.isOk()) << none.status().toString();
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE(s->putChunks("sha256:d1", {}).isOk());
  // `data` of each ChunkLoc is ignored: the argument names the blob. A chunk
  // repeated within one call keeps its first location.
  ASSERT_TRUE(s->putChunks("sha256:d1", {{shaOf(1), 4096, "ignored", 0},
                                         {shaOf(2), 131072, "", 1},
                                         {shaOf(2), 131072, "", 33},
                                         {shaOf(3), 100, "", 0xfffffffe}})
                  .isOk());
  auto c1 = s->findChunk(shaOf(1), 4096);
  ASSERT_TRUE(c1.isOk());
  ASSERT_TRUE(c1->has_value());
  EXPECT_EQ((*c1)->sha, shaOf(1));
  EXPECT_EQ((*c1)->length, 4096);
  EXPECT_EQ((*c1)->data, "sha256:d1");
  EXPECT_EQ((*c1)->block, 0u);
  EXPECT_EQ((*s->findChunk(shaOf(2), 131072))->block, 1u);
  EXPECT_EQ((*s->findChunk(shaOf(3), 100))->block, 0xfffffffeu);  // the whole uint32_t range
  // The same bytes at another length are another chunk.
  EXPECT_FALSE(s->findChunk(shaOf(1), 4095)->has_value());
  // The first location recorded wins; new chunks of a later call are added.
  ASSERT_TRUE(s->putChunks("sha256:d2", {{shaOf(1), 4096, "", 7}, {shaOf(4), 4096, "", 8}}).isOk());
  EXPECT_EQ((*s->findChunk(shaOf(1), 4096))->data, "sha256:d1");
  EXPECT_EQ((*s->findChunk(shaOf(4), 4096))->data, "sha256:d2");
  EXPECT_EQ((*s->findChunk(shaOf(4), 4096))->block, 8u);
  // Bad rows are refused, and nothing of the call is kept.
  EXPECT_EQ(s->putChunks("sha256:d3", {{shaOf(5), 10, "", 0}, {"ABC", 10, "", 0}}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(s->putChunks("sha256:d3", {{shaOf(5), 0, "", 0}}).code(), Code::kInvalidArgument);
  EXPECT_EQ(s->putChunks("", {{shaOf(5), 10, "", 0}}).code(), Code::kInvalidArgument);
  EXPECT_FALSE(s->findChunk(shaOf(5), 10)->has_value());
  // deleteChunksIn removes the rows of that blob's chunks overlapping the
  // ranges: chunk 6 spans blocks 1-2 (4097 bytes), 7 is block 3, 8 is 10-41.
  ASSERT_TRUE(s->putChunks("sha256:d3", {{shaOf(6), 4097, "", 1},
                                         {shaOf(7), 4096, "", 3},
                                         {shaOf(8), 131072, "", 10}})
                  .isOk());
  ASSERT_TRUE(s->deleteChunksIn("sha256:d3", {}).isOk());
  ASSERT_TRUE(s->deleteChunksIn("sha256:d3", {{0, 1}, {4, 6}, {42, 100}}).isOk());  // touches none
  for (int i : {6, 7}) EXPECT_TRUE(s->findChunk(shaOf(i), i == 6 ? 4097 : 4096)->has_value()) << i;
  EXPECT_TRUE(s->findChunk(shaOf(8), 131072)->has_value());
  ASSERT_TRUE(s->deleteChunksIn("sha256:d3", {{2, 1}, {41, 1}, {0xfffffffe, 1}}).isOk());
  EXPECT_FALSE(s->findChunk(shaOf(6), 4097)->has_value());  // its second block
  EXPECT_TRUE(s->findChunk(shaOf(7), 4096)->has_value());
  EXPECT_FALSE(s->findChunk(shaOf(8), 131072)->has_value());  // its last block
  EXPECT_EQ((*s->findChunk(shaOf(3), 100))->block, 0xfffffffeu);  // another blob's row
  // deleteChunksOf removes that blob's rows only; the chunks can then be
  // recorded elsewhere.
  ASSERT_TRUE(s->deleteChunksOf("sha256:d1").isOk());
  ASSERT_TRUE(s->deleteChunksOf("sha256:never").isOk());
  EXPECT_FALSE(s->findChunk(shaOf(1), 4096)->has_value());
  EXPECT_FALSE(s->findChunk(shaOf(2), 131072)->has_value());
  EXPECT_TRUE(s->findChunk(shaOf(4), 4096)->has_value());
  ASSERT_TRUE(s->putChunks("sha256:d2", {{shaOf(1), 4096, "", 9}}).isOk());
  EXPECT_EQ((*s->findChunk(shaOf(1), 4096))->data, "sha256:d2");
  // deleteBlob of a data blob takes its rows with it.
  ASSERT_TRUE(s->putBlob("sha256:d2", 10).isOk());
  ASSERT_TRUE(s->deleteBlob("sha256:d2").isOk());
  EXPECT_FALSE(s->findChunk(shaOf(1), 4096)->has_value());
  EXPECT_FALSE(s->findChunk(shaOf(4), 4096)->has_value());
  EXPECT_EQ(s->getBlob("sha256:d2").status().code(), Code::kNotFound);
}

// A layer's worth of chunks (8,192: 1 GiB of 128 KiB chunks) goes in one
// call, twice (the second all conflicts), and survives a reopen.
TEST_P(StoreTest, ChunkTableTakesAGigabyteOfChunksInOneCall) {
  auto s = open();
  ASSERT_TRUE(s);
  std::vector<ChunkLoc> chunks;
  for (int i = 0; i < 8192; ++i) chunks.push_back({shaOf(i), 131072, "", uint32_t(i * 32)});
  auto t0 = std::chrono::steady_clock::now();
  Status st = s->putChunks("sha256:big", chunks);
  ASSERT_TRUE(st.isOk()) << st.toString();
  auto t1 = std::chrono::steady_clock::now();
  st = s->putChunks("sha256:other", chunks);
  ASSERT_TRUE(st.isOk()) << st.toString();
  auto t2 = std::chrono::steady_clock::now();
  auto ms = [](auto d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  std::printf("putChunks of 8192 rows: %lld ms new, %lld ms all known\n", (long long)ms(t1 - t0),
              (long long)ms(t2 - t1));
  s.reset();
  s = open();
  ASSERT_TRUE(s);
  for (int i : {0, 4095, 8191}) {
    auto c = s->findChunk(shaOf(i), 131072);
    ASSERT_TRUE(c.isOk() && c->has_value()) << i;
    EXPECT_EQ((*c)->data, "sha256:big");
    EXPECT_EQ((*c)->block, uint32_t(i * 32));
  }
  ASSERT_TRUE(s->deleteChunksOf("sha256:big").isOk());
  EXPECT_FALSE(s->findChunk(shaOf(8191), 131072)->has_value());
}

// listChunkKeys: every row once, page by page, whatever the page size.
TEST_P(StoreTest, ChunkKeysPageThroughEveryRowOnce) {
  auto s = open();
  ASSERT_TRUE(s);
  auto empty = s->listChunkKeys({}, 10);
  ASSERT_TRUE(empty.isOk()) << empty.status().toString();
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(s->listChunkKeys({}, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(s->listChunkKeys({}, 0).status().field(), "limit");
  // 20 chunks in one blob, 5 in another; the same bytes at two lengths are
  // two keys.
  std::set<std::pair<std::string, int64_t>> want;
  std::vector<ChunkLoc> d1, d2;
  for (int i = 0; i < 20; ++i) d1.push_back({shaOf(i * 7919), 4096 + i, "", uint32_t(i)});
  d1.push_back({shaOf(0), 100, "", 99});
  for (int i = 0; i < 4; ++i) d2.push_back({shaOf(1000000 + i), 131072, "", uint32_t(i)});
  ASSERT_TRUE(s->putChunks("sha256:d1", d1).isOk());
  ASSERT_TRUE(s->putChunks("sha256:d2", d2).isOk());
  for (auto* cs : {&d1, &d2}) {
    for (auto& c : *cs) want.insert({c.sha, c.length});
  }
  ASSERT_EQ(want.size(), 25u);
  auto all = [&](size_t limit, std::vector<size_t>* pages) {
    std::set<std::pair<std::string, int64_t>> got;
    ChunkKey after;
    for (int guard = 0; guard < 100; ++guard) {
      auto page = s->listChunkKeys(after, limit);
      EXPECT_TRUE(page.isOk()) << page.status().toString();
      if (!page.isOk()) break;
      pages->push_back(page->size());
      for (auto& k : *page) {
        EXPECT_TRUE(got.insert({k.sha, k.length}).second) << "repeated " << k.sha;
      }
      if (page->size() < limit) break;
      after = page->back();
    }
    return got;
  };
  std::vector<size_t> pages;
  EXPECT_EQ(all(7, &pages), want);
  EXPECT_EQ(pages, (std::vector<size_t>{7, 7, 7, 4}));
  // A last page exactly full: the next one is empty.
  pages.clear();
  EXPECT_EQ(all(25, &pages), want);
  EXPECT_EQ(pages, (std::vector<size_t>{25, 0}));
  pages.clear();
  EXPECT_EQ(all(1, &pages), want);
  EXPECT_EQ(pages.size(), 26u);
  // The rows of a blob deleteChunksOf removed are gone from the listing.
  ASSERT_TRUE(s->deleteChunksOf("sha256:d1").isOk());
  pages.clear();
  std::set<std::pair<std::string, int64_t>> left;
  for (auto& c : d2) left.insert({c.sha, c.length});
  EXPECT_EQ(all(3, &pages), left);
}

TEST_P(StoreTest, PoliciesPutReplaceDelete) {
  auto s = open();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->putPolicy("b", R"({"name":"b"})").isOk());
  ASSERT_TRUE(s->putPolicy("a", R"({"name":"a"})").isOk());
  ASSERT_TRUE(s->putPolicy("b", R"({"name":"b","v":2})").isOk());
  EXPECT_EQ(*s->loadPolicies(),
            (std::vector<std::string>{R"({"name":"a"})", R"({"name":"b","v":2})"}));
  EXPECT_TRUE(s->deletePolicy("a").isOk());
  EXPECT_EQ(s->deletePolicy("a").code(), Code::kNotFound);
  EXPECT_EQ(s->loadPolicies()->size(), 1u);
}

// ---------------------------------------------------------------- PostgreSQL only

class PostgresStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { DSEC_MAKE_TEST_STORE_ENV(env_, StoreKind::kPostgres); }
  void TearDown() override { env_.reset(); }
  std::unique_ptr<TestStoreEnv> env_;
};

// Several processes opening a new database at once: the advisory lock makes
// one create the schema, the others find it done; opening again changes nothing.
TEST_F(PostgresStoreTest, MigrationsAreIdempotentAndSafeWhenOpenedConcurrently) {
  constexpr int kOpeners = 6;
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int i = 0; i < kOpeners; ++i) {
    ts.emplace_back([&] {
      auto s = PostgresStore::open(env_->uri);
      if (!s.isOk()) {
        ADD_FAILURE() << s.status().toString();
        ++failures;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures, 0);
  auto s = PostgresStore::open(env_->uri);
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  // One row per migration, however many opened it.
  ASSERT_TRUE(env_->cluster
                  ->exec("DO $$ BEGIN IF (SELECT COUNT(*) FROM " + env_->schema +
                         ".dsec_schema) <> " + std::to_string(PostgresStore::schemaVersion()) +
                         " THEN RAISE EXCEPTION 'wrong number of schema rows'; END IF; END $$")
                  .isOk());
}

TEST_F(PostgresStoreTest, ANewerSchemaIsRefused) {
  ASSERT_TRUE(PostgresStore::open(env_->uri).isOk());
  ASSERT_TRUE(env_->cluster
                  ->exec("INSERT INTO " + env_->schema + ".dsec_schema VALUES(" +
                         std::to_string(PostgresStore::schemaVersion() + 1) + ", 0)")
                  .isOk());
  auto s = PostgresStore::open(env_->uri);
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("newer"), std::string::npos) << s.status().message();
}

// Backends killed under the store (a server restart, a network cut): the next
// calls reconnect; reads and putStep are retried, so they just work.
TEST_F(PostgresStoreTest, ReconnectsAfterItsConnectionsAreKilled) {
  // Its own application_name: other tests share the cluster.
  std::string app = "dsec-reconnect-" + randomHex(4);
  auto s = PostgresStore::open(env_->uri + "&application_name=" + app, PostgresOptions{4});
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  ASSERT_TRUE((*s)->putStep(stepOf("k", 0, "")).isOk());
  // Several pool connections open (the pool opens them under concurrent
  // calls), then all of them killed (waiting until they are gone).
  auto severalOpen = [&] {
    return env_->cluster
        ->exec("DO $$ BEGIN IF (SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = '" +
               app + "') < 2 THEN RAISE EXCEPTION 'fewer than 2 connections'; END IF; END $$")
        .isOk();
  };
  for (int round = 0; round < 50 && !severalOpen(); ++round) {
    std::vector<std::thread> ts;
    for (int i = 0; i < 4; ++i) ts.emplace_back([&] { (void)(*s)->loadTrajectory("k"); });
    for (auto& t : ts) t.join();
  }
  ASSERT_TRUE(severalOpen());
  ASSERT_TRUE(env_->cluster
                  ->exec("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE "
                         "application_name = '" + app + "'")
                  .isOk());
  auto steps = (*s)->loadTrajectory("k");
  ASSERT_TRUE(steps.isOk()) << steps.status().toString();
  EXPECT_EQ(steps->size(), 1u);
  Status put = (*s)->putStep(stepOf("k", 1, ""));
  EXPECT_TRUE(put.isOk()) << put.toString();
  EXPECT_EQ((*s)->putStep(stepOf("k", 1, "")).code(), Code::kAlreadyExists);
  EXPECT_EQ((*s)->loadTrajectory("k")->size(), 2u);
}

TEST_F(PostgresStoreTest, OpenStoreSelectsAndRefusesWithClearErrors) {
  std::string where;
  auto pg = openStore(env_->uri, env_->dir, &where);
  ASSERT_TRUE(pg.isOk()) << pg.status().toString();
  EXPECT_EQ(where.rfind("postgresql postgresql://dsec@/dsec?", 0), 0u) << where;
  auto sq = openStore("sqlite", env_->dir, &where);
  ASSERT_TRUE(sq.isOk()) << sq.status().toString();
  EXPECT_EQ(where, "sqlite " + env_->dir + "/state.db");

  auto bad = openStore("mysql://root:hunter2@db/x", env_->dir);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.status().field(), "store");
  EXPECT_EQ(bad.status().message().find("hunter2"), std::string::npos) << bad.status().message();
  auto unparsable = openStore("postgres://u:hunter2@h/db?nosuchoption=1", env_->dir);
  EXPECT_EQ(unparsable.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(unparsable.status().message().find("hunter2"), std::string::npos);
  EXPECT_NE(unparsable.status().message().find("nosuchoption"), std::string::npos)
      << unparsable.status().message();
  // Nothing listens on port 1: a clear error at once, no hang.
  auto t0 = std::chrono::steady_clock::now();
  auto down = openStore("postgresql://u:hunter2@127.0.0.1:1/db?connect_timeout=3", env_->dir);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(down.status().code(), Code::kUnavailable);
  EXPECT_NE(down.status().message().find("127.0.0.1"), std::string::npos)
      << down.status().message();
  EXPECT_EQ(down.status().message().find("hunter2"), std::string::npos) << down.status().message();
}

TEST(PostgresUriTest, RedactsPasswords) {
  EXPECT_EQ(redactPostgresUri("postgres://u:secret@h:5432/db?sslmode=require"),
            "postgres://u:***@h:5432/db?sslmode=require");
  EXPECT_EQ(redactPostgresUri("postgresql://u@h/db?password=secret&x=1"),
            "postgresql://u@h/db?password=***&x=1");
  EXPECT_EQ(redactPostgresUri("postgresql://h"), "postgresql://h");
  EXPECT_EQ(redactPostgresUri("host=h password=secret"), "host=h password=***");
}

}  // namespace
}  // namespace dsec::platform
