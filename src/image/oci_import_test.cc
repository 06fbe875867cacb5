#include "image/oci_import.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/util.h"

namespace dsec::image {
namespace {

TEST(OciImportTest, TranslatesWhiteoutsAndOpaqueDirs) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for mknod and trusted.* xattrs";
  std::string dir = "/tmp/dsec-wh-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/a/opq").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/.wh.gone", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/.wh.kept", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/kept", "same layer\n").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/opq/.wh..wh..opq", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/opq/new", "n").isOk());
  ASSERT_TRUE(translateWhiteouts(dir).isOk());
  struct stat st;
  ASSERT_EQ(lstat((dir + "/a/gone").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(major(st.st_rdev), 0u);
  EXPECT_EQ(minor(st.st_rdev), 0u);
  EXPECT_NE(lstat((dir + "/a/.wh.gone").c_str(), &st), 0);
  ASSERT_EQ(lstat((dir + "/a/kept").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "a whiteout hides only lower layers' files";
  char v[8] = {};
  ASSERT_EQ(lgetxattr((dir + "/a/opq").c_str(), "trusted.overlay.opaque", v, sizeof v), 1);
  EXPECT_EQ(v[0], 'y');
  EXPECT_NE(lstat((dir + "/a/opq/.wh..wh..opq").c_str(), &st), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(OciImportTest, DetectsFormatsOfDirectories) {
  std::string dir = "/tmp/dsec-fmt-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/oci").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/oci/oci-layout", "{}").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/oci/index.json", "{}").isOk());
  ASSERT_TRUE(makeDirs(dir + "/docker").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/docker/manifest.json", "[]").isOk());
  ASSERT_TRUE(makeDirs(dir + "/rootfs/etc").isOk());
  EXPECT_EQ(*detectFormat(dir + "/oci"), ArchiveFormat::kOciLayout);
  EXPECT_EQ(*detectFormat(dir + "/docker"), ArchiveFormat::kDockerSave);
  EXPECT_EQ(*detectFormat(dir + "/rootfs"), ArchiveFormat::kRootfs);
  EXPECT_EQ(detectFormat(dir + "/nope").status().code(), Code::kNotFound);
  ASSERT_TRUE(removeTree(dir).isOk());
}

}  // namespace
}  // namespace dsec::image
