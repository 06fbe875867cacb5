#include "edge/userns.h"

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "common/util.h"

namespace dsec::edge {
namespace {

TEST(Userns, BadOptionsNameTheField) {
  auto bad = detectUserns({"maybe", 100000, 65536});
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto or off"), std::string::npos);
  // Host id 0 in the range would make root inside host root again.
  EXPECT_FALSE(detectUserns({"auto", 0, 65536}).isOk());
  EXPECT_FALSE(detectUserns({"auto", 100000, 0}).isOk());
  EXPECT_FALSE(detectUserns({"auto", 0xffff0000u, 0x20000}).isOk());
}

TEST(Userns, OffIsOffWithTheReason) {
  auto u = detectUserns({"off", 100000, 65536});
  ASSERT_TRUE(u.isOk());
  EXPECT_FALSE(u->enabled);
  EXPECT_EQ(u->reason, "off (--userns off)");
  EXPECT_FALSE(u->fd.valid());
}

// Needs root and a kernel with user namespaces and idmapped mounts: skips
// with the reason detectUserns gives otherwise.
TEST(Userns, IdmappedCloneShowsHostIdsThroughTheMapping) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  auto u = detectUserns({"auto", 100000, 65536});
  ASSERT_TRUE(u.isOk());
  if (!u->enabled) GTEST_SKIP() << u->reason;
  EXPECT_EQ(u->mapLine(), "0 100000 65536\n");
  char tmpl[] = "/tmp/dsec-userns-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  // A private tmpfs (idmappable) holding files owned by 0 and 1000.
  ASSERT_EQ(::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m"), 0);
  std::string f0 = dir + "/f0", f1000 = dir + "/f1000";
  ASSERT_TRUE(writeFileAtomic(f0, "x", 0644).isOk());
  ASSERT_TRUE(writeFileAtomic(f1000, "x", 0644).isOk());
  ASSERT_EQ(::chown(f1000.c_str(), 1000, 1000), 0);
  auto m = idmappedClone(dir, u->fd.get(), true);
  ASSERT_TRUE(m.isOk()) << m.status().toString();
  std::string view = "/proc/self/fd/" + std::to_string(m->get());
  struct stat st;
  ASSERT_EQ(::stat((view + "/f0").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 100000u);
  ASSERT_EQ(::stat((view + "/f1000").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 101000u);
  // And back: the inverse mapping shows host 101000 as 1000 (pack_diff).
  ASSERT_EQ(::chown(f1000.c_str(), 101000, 101000), 0);
  auto inv = idmappedClone(dir, u->inverseFd.get(), true);
  ASSERT_TRUE(inv.isOk()) << inv.status().toString();
  ASSERT_EQ(::stat(("/proc/self/fd/" + std::to_string(inv->get()) + "/f1000").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 1000u);
  m->reset();
  inv->reset();
  ::umount2(dir.c_str(), MNT_DETACH);
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace dsec::edge
