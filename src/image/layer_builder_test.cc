#include "image/layer_builder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/sha256.h"
#include "common/util.h"

namespace dsec::image {
namespace {

TEST(LayerBuilderTest, BuildsFromDirectoryAndTarball) {
  if (access("/usr/bin/mkfs.erofs", X_OK) != 0) GTEST_SKIP() << "mkfs.erofs not installed";
  std::string dir = "/tmp/dsec-layer-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/src/etc").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/src/etc/hello", "hi\n").isOk());
  ASSERT_EQ(symlink("hello", (dir + "/src/etc/link").c_str()), 0);
  auto a = buildLayer(dir + "/src", dir + "/work-a");
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(a->digest.rfind("sha256:", 0), 0u);
  EXPECT_GT(a->size, 0);
  ASSERT_TRUE(runCommand({"tar", "-C", dir + "/src", "-cf", dir + "/src.tar", "."}).isOk());
  auto b = buildLayer(dir + "/src.tar", dir + "/work-b");
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(b->digest, "sha256:" + *sha256File(b->path));
  EXPECT_EQ(b->dataDigest, "sha256:" + *sha256File(b->dataPath));
  EXPECT_NE(b->dataDigest, b->digest);
  auto bad = buildLayer(dir + "/nope.tar", dir + "/work-c");
  EXPECT_EQ(bad.status().code(), Code::kNotFound);
  ASSERT_TRUE(writeFileAtomic(dir + "/junk.tar", "not a tar").isOk());
  EXPECT_EQ(buildLayer(dir + "/junk.tar", dir + "/work-d").status().code(),
            Code::kInvalidArgument);
  ASSERT_TRUE(removeTree(dir).isOk());
}

}  // namespace
}  // namespace dsec::image
