#include "platform/store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include "common/util.h"

namespace dsec::platform {
namespace {

TEST(StoreTest, SandboxesSurviveReopen) {
  std::string dir = "/tmp/dsec-store-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  {
    auto s = SqliteStore::open(dir + "/state.db");
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    SandboxRecord r;
    r.id = "sb-1";
    r.backend = "container";
    r.image = "busybox:latest";
    r.layers = {"sha256:aa"};
    r.state = "running";
    r.labels = {{"job", "x"}};
    ASSERT_TRUE((*s)->putSandbox(r).isOk());
    r.state = "stopped";
    ASSERT_TRUE((*s)->putSandbox(r).isOk());
    ASSERT_TRUE((*s)->putBlob("sha256:aa", 10).isOk());
    ASSERT_TRUE((*s)->putImage(ImageRecord{"busybox", "latest", {"sha256:aa"}, 10, 1}).isOk());
  }
  auto s = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(s.isOk());
  auto all = (*s)->loadSandboxes();
  ASSERT_TRUE(all.isOk());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].state, "stopped");
  EXPECT_EQ((*all)[0].labels.at("job"), "x");
  EXPECT_EQ(*(*s)->blobSize("sha256:aa"), 10);
  EXPECT_EQ((*s)->blobSize("sha256:bb").status().code(), Code::kNotFound);
  auto img = (*s)->getImage("busybox", "latest");
  ASSERT_TRUE(img.isOk());
  EXPECT_EQ(img->layers, std::vector<std::string>{"sha256:aa"});
  EXPECT_EQ((*s)->getImage("busybox", "nope").status().code(), Code::kNotFound);
  EXPECT_TRUE((*s)->deleteImage("busybox", "latest").isOk());
  EXPECT_EQ((*s)->deleteImage("busybox", "latest").code(), Code::kNotFound);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(StoreTest, ImageConfigsPersistAndOldDatabasesUpgrade) {
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

TEST(StoreTest, SandboxUserAndWorkingDirRoundTripAndOldRecordsRead) {
  SandboxRecord r;
  r.id = "sb-2";
  r.backend = "container";
  r.image = "app:1";
  r.state = "running";
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

// Steps keep the digest of their bytes (also in a database made before the
// column), the trajectory's record comes and goes with its steps.
TEST(StoreTest, StepContentsAndTrajectoryRecords) {
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
                           "finished_at REAL NOT NULL, PRIMARY KEY(trajectory, step));",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  auto s = SqliteStore::open(dir + "/state.db");
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  Store& st = **s;
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
  ASSERT_TRUE(removeTree(dir).isOk());
}

}  // namespace
}  // namespace dsec::platform
