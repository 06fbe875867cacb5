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

UsernsOptions opts(std::string mode, uint32_t first = kDefaultUsernsFirst,
                   uint32_t last = kDefaultUsernsLast, uint32_t width = kDefaultUsernsWidth) {
  return UsernsOptions{std::move(mode), first, last, width, {}};
}

TEST(Userns, BadOptionsNameTheField) {
  auto bad = detectUserns(opts("maybe"));
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto or off"), std::string::npos);
  // Host id 0 in the window would make root inside host root again.
  auto zero = detectUserns(opts("auto", 0));
  ASSERT_FALSE(zero.isOk());
  EXPECT_EQ(zero.status().field(), "userns-window");
  auto narrow = detectUserns(opts("auto", 524288, 524288 + 1000));
  ASSERT_FALSE(narrow.isOk());
  EXPECT_EQ(narrow.status().field(), "userns-window");
  auto width = detectUserns(opts("auto", kDefaultUsernsFirst, kDefaultUsernsLast, 100000));
  ASSERT_FALSE(width.isOk());
  EXPECT_EQ(width.status().field(), "userns-width");
  // Checked with --userns off too: a bad flag is a bad flag.
  EXPECT_FALSE(detectUserns(opts("off", 0)).isOk());
}

// The flags of dsec up and dsec edge, parsed by one pair of helpers.
TEST(Userns, ParsesWidthAndWindowFlags) {
  EXPECT_EQ(*parseIdWidth("262144"), 262144u);
  for (const char* bad : {"", "x", "-65536", "65535", "2147483649", "65536k", " 65536"}) {
    auto w = parseIdWidth(bad);
    ASSERT_FALSE(w.isOk()) << bad;
    EXPECT_EQ(w.status().field(), "userns-width") << bad;
  }
  auto win = parseIdWindow("524288-1879048191");
  ASSERT_TRUE(win.isOk());
  EXPECT_EQ(win->first, 524288u);
  EXPECT_EQ(win->second, 1879048191u);
  for (const char* bad : {"", "1-", "-5", "a-b", "1-2-3", "1-4294967296", " 1-2"}) {
    auto w = parseIdWindow(bad);
    ASSERT_FALSE(w.isOk()) << bad;
    EXPECT_EQ(w.status().field(), "userns-window") << bad;
  }
}

TEST(Userns, OffIsOffWithTheReason) {
  auto u = detectUserns(opts("off"));
  ASSERT_TRUE(u.isOk());
  EXPECT_FALSE(u->enabled);
  EXPECT_EQ(u->reason, "off (--userns off)");
  EXPECT_EQ(u->pool.capacity(), 0u);
}

// Needs root and a kernel with user namespaces and idmapped mounts: skips
// with the reason detectUserns gives otherwise. Two ranges from the node's
// pool: a layer's files owned by 0 and 1000 appear as each range's own host
// ids, and the inverse view maps a range's host ids back (pack_diff).
TEST(Userns, IdmappedClonesShowEachRangesHostIds) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  auto u = detectUserns(opts("auto"));
  ASSERT_TRUE(u.isOk());
  if (!u->enabled) GTEST_SKIP() << u->reason;
  IdRangePool pool = u->pool;
  auto a = pool.allocate(), b = pool.allocate();
  ASSERT_TRUE(a.isOk() && b.isOk());
  EXPECT_NE(a->base, b->base);
  EXPECT_EQ(mapLine(*a), "0 " + std::to_string(a->base) + " 65536\n");
  char tmpl[] = "/tmp/dsec-userns-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  // A private tmpfs (idmappable) holding files owned by 0 and 1000.
  ASSERT_EQ(::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m"), 0);
  std::string f0 = dir + "/f0", f1000 = dir + "/f1000";
  ASSERT_TRUE(writeFileAtomic(f0, "x", 0644).isOk());
  ASSERT_TRUE(writeFileAtomic(f1000, "x", 0644).isOk());
  ASSERT_EQ(::chown(f1000.c_str(), 1000, 1000), 0);
  for (IdRange r : {*a, *b}) {
    auto ns = makeUsernsFd(mapLine(r));
    ASSERT_TRUE(ns.isOk()) << ns.status().toString();
    auto m = idmappedClone(dir, ns->get(), true);
    ASSERT_TRUE(m.isOk()) << m.status().toString();
    std::string view = "/proc/self/fd/" + std::to_string(m->get());
    struct stat st;
    ASSERT_EQ(::stat((view + "/f0").c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, r.base);
    ASSERT_EQ(::stat((view + "/f1000").c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, r.base + 1000);
  }
  // And back: a's inverse shows a's host base+1000 as 1000, and b's ids,
  // which a's mapping does not cover, as the overflow id.
  ASSERT_EQ(::chown(f1000.c_str(), a->base + 1000, a->base + 1000), 0);
  ASSERT_EQ(::chown(f0.c_str(), b->base, b->base), 0);
  auto inv = makeUsernsFd(inverseLine(*a));
  ASSERT_TRUE(inv.isOk()) << inv.status().toString();
  auto back = idmappedClone(dir, inv->get(), true);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  std::string view = "/proc/self/fd/" + std::to_string(back->get());
  struct stat st;
  ASSERT_EQ(::stat((view + "/f1000").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 1000u);
  ASSERT_EQ(::stat((view + "/f0").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);
  back->reset();
  ::umount2(dir.c_str(), MNT_DETACH);
  ::rmdir(dir.c_str());
}

// The initial namespace's map ("0 0 4294967295") is one extent from 0, so it
// reads back as base 0; a process that does not exist is an error. (A
// sandbox's own is checked end to end: tests/test_restart.py.)
TEST(Userns, ReadIdMapGivesTheKernelsRange) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  auto mine = readIdMap(::getpid());
  ASSERT_TRUE(mine.isOk()) << mine.status().toString();
  EXPECT_EQ(mine->base, 0u);
  EXPECT_FALSE(readIdMap(999999999).isOk());
}

}  // namespace
}  // namespace dsec::edge
