#include "aether/container_init.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

namespace dsec::aether {
namespace {

TEST(InitConfig, MountFdRootfsNeedsOnlyATarget) {
  auto c =
      parseInitConfig(R"({"hostname":"sb-1","rootfs":{"mount_fd":true,"target":"sb-1/rootfs"}})");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  ASSERT_TRUE(c->rootfs.has_value());
  EXPECT_TRUE(c->rootfs->mountFd);
  EXPECT_EQ(c->rootfs->target, "sb-1/rootfs");
  EXPECT_TRUE(c->rootfs->lower.empty());
}

TEST(InitConfig, ReattachIsABoolAndOffByDefault) {
  auto off = parseInitConfig(R"({"hostname":"sb-1"})");
  ASSERT_TRUE(off.isOk());
  EXPECT_FALSE(off->reattach);
  auto on = parseInitConfig(R"({"hostname":"sb-1","reattach":true})");
  ASSERT_TRUE(on.isOk());
  EXPECT_TRUE(on->reattach);
  auto bad = parseInitConfig(R"({"hostname":"sb-1","reattach":"yes"})");
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "reattach");
}

TEST(InitConfig, MountFdTargetMustNotClimb) {
  for (const char* t : {"..", "../x", "a/../../x", "a/..", ""}) {
    std::string j = std::string(R"({"rootfs":{"mount_fd":true,"target":")") + t + R"("}})";
    auto c = parseInitConfig(j);
    EXPECT_FALSE(c.isOk()) << t;
  }
}

TEST(InitConfig, PathRootfsStillNeedsLayers) {
  auto c = parseInitConfig(R"({"rootfs":{"upper":"/u","work":"/w","target":"/t"}})");
  EXPECT_FALSE(c.isOk());
}

TEST(InitConfig, MountFdAndDescriptorMustAgree) {
  auto c = parseInitConfig(R"({"rootfs":{"mount_fd":true,"target":"x/rootfs"}})");
  ASSERT_TRUE(c.isOk());
  // No descriptor came with init: refused before anything is mounted.
  Status st = setupContainer(*c, -1);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
}

TEST(InitConfig, PolicyAndWorkingDir) {
  auto c = parseInitConfig(
      R"({"hostname":"sb-1","working_dir":"/w/d","policy":{"readonly":["/etc"],"syscalls":"strict"}})");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->working_dir, "/w/d");
  ASSERT_TRUE(c->policy.has_value());
  EXPECT_EQ((*c->policy)["syscalls"], "strict");
  auto none = parseInitConfig(R"({"hostname":"sb-1"})");
  ASSERT_TRUE(none.isOk());
  EXPECT_FALSE(none->policy.has_value());
  EXPECT_TRUE(none->working_dir.empty());
  auto badPolicy = parseInitConfig(R"({"policy":["x"]})");
  ASSERT_FALSE(badPolicy.isOk());
  EXPECT_EQ(badPolicy.status().field(), "policy");
  auto badDir = parseInitConfig(R"({"working_dir":"relative"})");
  ASSERT_FALSE(badDir.isOk());
  EXPECT_EQ(badDir.status().field(), "working_dir");
}

// prestage() in a child with its own mount and network namespaces: the
// staged /proc, /sys and /dev carry Docker's masks and read-only paths.
TEST(Prestage, StagesKernelFilesystemsWithTheirMasks) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) _exit(10);
    auto staged = prestage();
    if (!staged.isOk()) _exit(11);
    struct stat st;
    if (::stat((*staged + "/proc/self/status").c_str(), &st) != 0) _exit(12);
    if (::stat((*staged + "/dev/null").c_str(), &st) != 0 || !S_ISCHR(st.st_mode)) _exit(13);
    // A masked file is /dev/null bound over it.
    if (::stat((*staged + "/proc/kcore").c_str(), &st) == 0 &&
        (!S_ISCHR(st.st_mode) || st.st_rdev != makedev(1, 3))) {
      _exit(14);
    }
    struct statvfs vfs;
    if (::statvfs((*staged + "/proc/sys").c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) _exit(15);
    if (::statvfs((*staged + "/sys").c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) _exit(16);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace dsec::aether
