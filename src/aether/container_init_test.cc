#include "aether/container_init.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
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

// Superblocks per sandbox (docs/container-backend.md, "Kernel cost per
// sandbox"): with the node's mask directory, masked directories are binds of
// it, and /dev/shm is a directory of the /dev tmpfs with flags of its own.
TEST(Prestage, MasksBindTheNodesMaskAndShmSharesTheDevTmpfs) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  char dir[] = "/tmp/dsec-mask-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  std::string base = dir, mask = base + "/mask", stage = base + "/stage";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) _exit(10);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(11);
    if (::mkdir(mask.c_str(), 0555) != 0 || ::mkdir(stage.c_str(), 0700) != 0) _exit(13);
    if (::mount("tmpfs", mask.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "size=0,mode=0555") != 0) {
      _exit(14);
    }
    auto staged = prestage(stage, mask);
    if (!staged.isOk()) _exit(15);
    struct stat m, st, dev, shm;
    if (::stat(mask.c_str(), &m) != 0) _exit(16);
    int masked = 0;
    for (const char* p : {"/proc/acpi", "/sys/firmware", "/proc/scsi", "/proc/asound"}) {
      if (::stat((*staged + p).c_str(), &st) != 0) continue;  // not in this kernel
      if (st.st_dev != m.st_dev) _exit(17);                    // a tmpfs of its own
      struct statvfs vfs;
      if (::statvfs((*staged + p).c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) _exit(18);
      ++masked;
    }
    if (masked == 0) _exit(19);  // /sys/firmware exists wherever sysfs does
    if (::stat((*staged + "/dev").c_str(), &dev) != 0) _exit(20);
    if (::stat((*staged + "/dev/shm").c_str(), &shm) != 0) _exit(21);
    if (shm.st_dev != dev.st_dev || (shm.st_mode & 07777) != 01777) _exit(22);
    struct statvfs vfs;
    if (::statvfs((*staged + "/dev/shm").c_str(), &vfs) != 0) _exit(23);
    if (!(vfs.f_flag & ST_NODEV) || !(vfs.f_flag & ST_NOEXEC) || !(vfs.f_flag & ST_NOSUID)) {
      _exit(24);
    }
    std::string probe = *staged + "/dev/shm/probe";
    FILE* f = std::fopen(probe.c_str(), "w");
    if (!f || std::fputs("x", f) < 0) _exit(25);
    std::fclose(f);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  // The mounts went with the child's namespace: only the directories remain.
  ::rmdir(mask.c_str());
  ::rmdir(stage.c_str());
  ::rmdir(base.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A mask directory that is writable (or not empty) is not bound over masks:
// each gets its own read-only tmpfs as without one.
TEST(Prestage, AWritableMaskDirIsNotUsed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  char dir[] = "/tmp/dsec-mask-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  std::string base = dir, mask = base + "/mask", stage = base + "/stage";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) _exit(10);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(11);
    if (::mkdir(mask.c_str(), 0755) != 0 || ::mkdir(stage.c_str(), 0700) != 0) _exit(13);
    auto staged = prestage(stage, mask);
    if (!staged.isOk()) _exit(15);
    struct stat m, st;
    if (::stat(mask.c_str(), &m) != 0) _exit(16);
    if (::stat((*staged + "/sys/firmware").c_str(), &st) != 0) _exit(17);
    if (st.st_dev == m.st_dev) _exit(18);
    struct statvfs vfs;
    if (::statvfs((*staged + "/sys/firmware").c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) {
      _exit(19);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  // The mounts went with the child's namespace: only the directories remain.
  ::rmdir(mask.c_str());
  ::rmdir(stage.c_str());
  ::rmdir(base.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace dsec::aether
