#include "image/layer_builder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "common/util.h"
#include "image/layer_converter.h"

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

// Makes `path` (a file, or a directory when it ends in '/') owned by uid:gid.
void makeOwned(const std::string& path, uid_t uid, gid_t gid) {
  if (path.back() == '/') {
    ASSERT_TRUE(makeDirs(path, 0755).isOk()) << path;
  } else {
    ASSERT_TRUE(writeFileAtomic(path, "x\n").isOk()) << path;
  }
  ASSERT_EQ(::lchown(path.c_str(), uid, gid), 0) << path << ": " << strerror(errno);
}

TEST(LayerBuilderTest, ALayersDigestNamesItsFilesBytes) {
  // Same names, sizes, modes and mtimes, different bytes: the metadata images
  // alone would be identical; the data blob's digest bound into each
  // (setErofsDeviceTag) tells the layers apart, by mkfs and by the converter.
  if (access("/usr/bin/mkfs.erofs", X_OK) != 0) GTEST_SKIP() << "mkfs.erofs not installed";
  std::string dir = "/tmp/dsec-layer-test-" + randomHex(4);
  std::vector<std::string> digests;
  for (const char* content : {"amd64", "arm64"}) {
    std::string src = dir + "/" + content;
    ASSERT_TRUE(makeDirs(src).isOk());
    ASSERT_TRUE(writeFileAtomic(src + "/marker", content).isOk());
    ASSERT_TRUE(runCommand({"touch", "-d", "@1700000000", src + "/marker", src}).isOk());
    auto l = buildLayer(src, dir + "/work-" + content);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    EXPECT_EQ(l->digest, "sha256:" + *sha256File(l->path));
    digests.push_back(l->digest);
    ASSERT_TRUE(runCommand({"tar", "--mtime=@1700000000", "-C", src, "-cf", src + ".tar", "."}).isOk());
    auto c = convertTarFile(src + ".tar", std::nullopt, dir + "/conv-" + content);
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    EXPECT_EQ(c->layer.digest, "sha256:" + *sha256File(c->layer.path));
    digests.push_back(c->layer.digest);
  }
  EXPECT_NE(digests[0], digests[2]);
  EXPECT_NE(digests[1], digests[3]);
  // The converter is deterministic: the same tar again is the same layer
  // (mkfs.erofs 1.5 stamps its build time into the superblock, so its layers
  // of one tree differ from run to run).
  auto again = convertTarFile(dir + "/amd64.tar", std::nullopt, dir + "/conv-again");
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(again->layer.digest, digests[1]);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(LayerBuilderTest, ScanOwnersCountsEntriesOutsideTheWidth) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown the test tree to ids up to 1000000";
  std::string dir = "/tmp/dsec-owners-test-" + randomHex(4);
  std::string t = dir + "/tree";
  ASSERT_TRUE(makeDirs(t, 0755).isOk());
  makeOwned(t + "/root.txt", 0, 0);
  makeOwned(t + "/edge.txt", 65535, 65535);  // the last id inside
  makeOwned(t + "/dir/", 0, 0);
  makeOwned(t + "/dir/low.txt", 65536, 0);       // the first id outside, uid only
  makeOwned(t + "/dir/gidonly.txt", 0, 197609);  // gid only
  makeOwned(t + "/win.txt", 197609, 197609);     // Git for Windows
  makeOwned(t + "/big/", 1000000, 1000000);      // AD/sssd, a directory
  makeOwned(t + "/big/inner.txt", 0, 0);
  // A symlink to a host directory: judged by its own owner, never entered.
  ASSERT_EQ(symlink("/etc", (t + "/link").c_str()), 0);
  ASSERT_EQ(::lchown((t + "/link").c_str(), 0, 0), 0);

  auto r = scanOwners(t, kDefaultOwnerWidth);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->width, 65536u);
  EXPECT_EQ(r->entries, 10);  // the root and 9 entries; nothing under /etc
  EXPECT_EQ(r->outside, 4);
  EXPECT_EQ(r->maxUid, 1000000u);
  EXPECT_EQ(r->maxGid, 1000000u);
  // Breadth first, names sorted in each directory.
  std::vector<OwnerExample> want = {{"big", 1000000, 1000000},
                                    {"win.txt", 197609, 197609},
                                    {"dir/gidonly.txt", 0, 197609},
                                    {"dir/low.txt", 65536, 0}};
  EXPECT_EQ(r->examples, want);

  // A wider mapping keeps all but 1000000.
  auto wide = scanOwners(t, 262144);
  ASSERT_TRUE(wide.isOk()) << wide.status().toString();
  EXPECT_EQ(wide->outside, 1);
  EXPECT_EQ(wide->examples, (std::vector<OwnerExample>{{"big", 1000000, 1000000}}));

  // An owner outside on the root itself is named ".".
  ASSERT_EQ(::chown(t.c_str(), 70000, 0), 0);
  auto rooted = scanOwners(t, kDefaultOwnerWidth);
  ASSERT_TRUE(rooted.isOk());
  ASSERT_FALSE(rooted->examples.empty());
  EXPECT_EQ(rooted->examples[0], (OwnerExample{".", 70000, 0}));
  ASSERT_EQ(::chown(t.c_str(), 0, 0), 0);

  // Only the first kOwnerExamples are named; all are counted.
  for (int i = 0; i < 12; ++i) makeOwned(t + "/dir/many" + std::to_string(10 + i), 300000 + i, 0);
  auto many = scanOwners(t, kDefaultOwnerWidth);
  ASSERT_TRUE(many.isOk());
  EXPECT_EQ(many->outside, 16);
  EXPECT_EQ(many->examples.size(), kOwnerExamples);

  EXPECT_EQ(scanOwners(t, 0).status().field(), "owner-width");
  EXPECT_EQ(scanOwners(dir + "/nope", kDefaultOwnerWidth).status().code(), Code::kNotFound);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(LayerBuilderTest, BuildLayerScansOwnersOnlyWhenAsked) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown the test tree and extract its owners";
  if (access("/usr/bin/mkfs.erofs", X_OK) != 0) GTEST_SKIP() << "mkfs.erofs not installed";
  std::string dir = "/tmp/dsec-owners-layer-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/src/opt", 0755).isOk());
  makeOwned(dir + "/src/opt/win.txt", 197609, 197609);
  ASSERT_TRUE(
      runCommand({"tar", "--numeric-owner", "-C", dir + "/src", "-cf", dir + "/src.tar", "."})
          .isOk());
  // From a tarball: the scan sees the owners tar extracted.
  auto b = buildLayer(dir + "/src.tar", dir + "/work-a", kDefaultOwnerWidth);
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(b->owners.outside, 1);
  EXPECT_EQ(b->owners.examples, (std::vector<OwnerExample>{{"opt/win.txt", 197609, 197609}}));
  auto none = buildLayer(dir + "/src", dir + "/work-b");
  ASSERT_TRUE(none.isOk()) << none.status().toString();
  EXPECT_EQ(none->owners.width, 0u);
  EXPECT_EQ(none->owners.entries, 0);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(LayerBuilderTest, OwnerReportsAddUp) {
  OwnerReport a{65536, 5, 2, 197609, 70000, {{"opt/a", 197609, 0}, {"opt/b", 0, 70000}}};
  OwnerReport b{65536, 3, 2, 100, 1000000, {{"opt/a", 197609, 0}, {"opt/c", 0, 1000000}}};
  OwnerReport sum;
  sum.add(a);
  sum.add(b);
  EXPECT_EQ(sum.width, 65536u);
  EXPECT_EQ(sum.entries, 8);
  EXPECT_EQ(sum.outside, 4);  // opt/a counted in both layers...
  EXPECT_EQ(sum.maxUid, 197609u);
  EXPECT_EQ(sum.maxGid, 1000000u);
  std::vector<OwnerExample> want = {
      {"opt/a", 197609, 0}, {"opt/b", 0, 70000}, {"opt/c", 0, 1000000}};
  EXPECT_EQ(sum.examples, want);  // ...and named once
  OwnerReport full;
  for (int i = 0; i < 12; ++i) full.examples.push_back({"f" + std::to_string(i), 70000, 0});
  sum.add(full);
  EXPECT_EQ(sum.examples.size(), kOwnerExamples);
  EXPECT_EQ(sum.examples.back().path, "f6");
}

}  // namespace
}  // namespace dsec::image
