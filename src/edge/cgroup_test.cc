#include "edge/cgroup.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"

namespace dsec::edge {
namespace {

TEST(CgroupTest, CreateLimitAttachRemove) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to manage cgroups";
  auto cg = Cgroups::detect("/sys/fs/cgroup", "dsec-unittest");
  if (!cg.isOk()) GTEST_SKIP() << "no usable cgroups: " << cg.status().toString();
  std::string id = "sb-test" + randomHex(4);
  ASSERT_TRUE((*cg)->create(id, CgroupLimits{0.5, 64 << 20, 32}).isOk());
  auto dirs = (*cg)->dirsOf(id);
  struct stat st;
  for (auto& d : dirs) ASSERT_EQ(stat(d.c_str(), &st), 0) << d;
  if ((*cg)->mode() == Cgroups::Mode::kV1) {
    EXPECT_EQ(*readFile(dirs[0] + "/memory.limit_in_bytes"), std::to_string(64 << 20) + "\n");
    EXPECT_EQ(*readFile(dirs[2] + "/pids.max"), "32\n");
    EXPECT_EQ(*readFile(dirs[1] + "/cpu.cfs_quota_us"), "50000\n");
  } else {
    EXPECT_EQ(*readFile(dirs[0] + "/pids.max"), "32\n");
  }
  pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_TRUE((*cg)->attach(id, child).isOk());
  auto ids = (*cg)->list();
  EXPECT_NE(std::find(ids.begin(), ids.end(), id), ids.end());
  EXPECT_TRUE((*cg)->stats(id).isOk());
  // remove() must kill what still runs inside.
  ASSERT_TRUE((*cg)->remove(id).isOk());
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  for (auto& d : dirs) EXPECT_NE(stat(d.c_str(), &st), 0) << d;
  EXPECT_EQ((*cg)->stats(id).status().code(), Code::kNotFound);
  for (auto& d : dirs) rmdir(d.substr(0, d.rfind('/')).c_str());
}

}  // namespace
}  // namespace dsec::edge
