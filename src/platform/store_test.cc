#include "platform/store.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dsec::platform
