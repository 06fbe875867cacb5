#include "aether/container_init.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>

#include "common/fd.h"

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

std::string readFileForTest(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

// Runs `body(mask, stage)` in a child with its own mount and network
// namespaces ("/" private), in a fresh temp dir holding an empty `mask`
// directory (mode `maskMode`; with `maskTmpfs`, a read-only tmpfs as the
// edge mounts one) and `stage`; returns the child's exit code (0: passed).
// The mounts go with the child's namespace; the directories are removed.
int inStagingChild(mode_t maskMode, bool maskTmpfs,
                   const std::function<int(const std::string&, const std::string&)>& body) {
  char dir[] = "/tmp/dsec-mask-XXXXXX";
  if (!::mkdtemp(dir)) return 100;
  std::string base = dir, mask = base + "/mask", stage = base + "/stage";
  pid_t pid = ::fork();
  if (pid < 0) return 101;
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) _exit(10);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(11);
    if (::mkdir(mask.c_str(), maskMode) != 0 || ::mkdir(stage.c_str(), 0700) != 0) _exit(12);
    if (maskTmpfs && ::mount("tmpfs", mask.c_str(), "tmpfs",
                             MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                             "size=0,mode=0555") != 0) {
      _exit(13);
    }
    _exit(body(mask, stage));
  }
  int status = 0;
  pid_t got = ::waitpid(pid, &status, 0);
  ::rmdir(mask.c_str());
  ::rmdir(stage.c_str());
  ::rmdir(base.c_str());
  if (got != pid || !WIFEXITED(status)) return 102;
  return WEXITSTATUS(status);
}

// Superblocks per sandbox (docs/container-backend.md, "Kernel cost per
// sandbox"): with the node's mask directory, masked directories are binds of
// it, and /dev/shm is a directory of the /dev tmpfs with flags of its own.
TEST(Prestage, MasksBindTheNodesMaskAndShmSharesTheDevTmpfs) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  EXPECT_EQ(inStagingChild(0555, true, [](const std::string& mask, const std::string& stage) {
    auto staged = prestage(stage, mask);
    if (!staged.isOk()) return 15;
    struct stat m, st, dev, shm;
    if (::stat(mask.c_str(), &m) != 0) return 16;
    int masked = 0;
    for (const char* p : {"/proc/acpi", "/sys/firmware", "/proc/scsi", "/proc/asound"}) {
      if (::stat((*staged + p).c_str(), &st) != 0) continue;  // not in this kernel
      if (st.st_dev != m.st_dev) return 17;                    // a tmpfs of its own
      struct statvfs vfs;
      if (::statvfs((*staged + p).c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) return 18;
      ++masked;
    }
    if (masked == 0) return 19;  // /sys/firmware exists wherever sysfs does
    if (::stat((*staged + "/dev").c_str(), &dev) != 0) return 20;
    if (::stat((*staged + "/dev/shm").c_str(), &shm) != 0) return 21;
    if (shm.st_dev != dev.st_dev || (shm.st_mode & 07777) != 01777) return 22;
    struct statvfs vfs;
    if (::statvfs((*staged + "/dev/shm").c_str(), &vfs) != 0) return 23;
    if (!(vfs.f_flag & ST_NODEV) || !(vfs.f_flag & ST_NOEXEC) || !(vfs.f_flag & ST_NOSUID)) {
      return 24;
    }
    FILE* f = std::fopen((*staged + "/dev/shm/probe").c_str(), "w");
    if (!f || std::fputs("x", f) < 0) return 25;
    std::fclose(f);
    return 0;
  }), 0);
}

// A mask directory that is writable (or not empty) is not bound over masks:
// each gets its own read-only tmpfs as without one.
TEST(Prestage, AWritableMaskDirIsNotUsed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  EXPECT_EQ(inStagingChild(0755, false, [](const std::string& mask, const std::string& stage) {
    auto staged = prestage(stage, mask);
    if (!staged.isOk()) return 15;
    struct stat m, st;
    if (::stat(mask.c_str(), &m) != 0) return 16;
    if (::stat((*staged + "/sys/firmware").c_str(), &st) != 0) return 17;
    if (st.st_dev == m.st_dev) return 18;
    struct statvfs vfs;
    if (::statvfs((*staged + "/sys/firmware").c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) {
      return 19;
    }
    return 0;
  }), 0);
}

// `--pivot`: prestage pivots into the stage (the host's tree is gone from
// the agent's namespace before any sandbox is known), and init attaches the
// rootfs mount fd on the stage and enters it without pivot_root: the
// sandbox then sees its rootfs as "/", with /proc, /sys and /dev, and
// nothing of the host or the stage in its mountinfo.
TEST(Prestage, PivotsEarlyAndInitEntersTheRootfsFromTheStage) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount namespaces)";
  EXPECT_EQ(inStagingChild(0555, true, [](const std::string& mask, const std::string& stage) {
    if (::unshare(CLONE_NEWUTS | CLONE_NEWPID) != 0) return 30;
    // The rootfs the edge would send: a detached tree with a marker.
    std::string src = stage + "-rootfs";
    if (::mkdir(src.c_str(), 0755) != 0) return 31;
    if (::mount("tmpfs", src.c_str(), "tmpfs", 0, "mode=0755") != 0) return 32;
    for (const char* d : {"/etc", "/proc", "/sys", "/dev"}) {
      if (::mkdir((src + d).c_str(), 0755) != 0) return 33;
    }
    FILE* f = std::fopen((src + "/marker").c_str(), "w");
    if (!f) return 34;
    std::fclose(f);
    UniqueFd rootfs(int(::syscall(SYS_open_tree, AT_FDCWD, src.c_str(),
                                  1 /*OPEN_TREE_CLONE*/ | O_CLOEXEC)));
    if (!rootfs) return 35;
    if (::umount2(src.c_str(), MNT_DETACH) != 0) return 36;
    // A new pid namespace's first child: proc needs one.
    pid_t child = ::fork();
    if (child < 0) return 37;
    if (child == 0) {
      // A mount namespace of its own (as the edge's clone gives an agent):
      // the pivot must not move this test's root too.
      if (::unshare(CLONE_NEWNS) != 0) _exit(38);
      if (::chdir(std::filesystem::path(stage).parent_path().c_str()) != 0) _exit(38);
      auto staged = prestage("stage", mask, /*pivot=*/true);
      if (!staged.isOk() || *staged != "/") _exit(39);
      if (::access(src.c_str(), F_OK) == 0) _exit(40);  // the host's tree is gone
      auto c = parseInitConfig(
          R"({"hostname":"sb-early","rootfs":{"mount_fd":true,"target":".stage/root"}})");
      if (!c.isOk()) _exit(41);
      Status st = setupContainer(*c, rootfs.get(), *staged, mask);
      if (!st.isOk()) {
        std::fprintf(stderr, "%s\n", st.toString().c_str());
        _exit(42);
      }
      if (::access("/marker", F_OK) != 0) _exit(43);
      struct stat null;
      if (::stat("/dev/null", &null) != 0 || !S_ISCHR(null.st_mode)) _exit(44);
      if (::access("/proc/self/status", F_OK) != 0) _exit(45);
      auto hostname = readFileForTest("/etc/hostname");
      if (hostname != "sb-early\n") _exit(46);
      // Only the rootfs and what is mounted under it: no stage, no host.
      std::string info = readFileForTest("/proc/self/mountinfo");
      if (info.find(" / / ") == std::string::npos) _exit(47);
      if (info.find("stage") != std::string::npos) _exit(48);
      _exit(0);
    }
    int status = 0;
    pid_t got = ::waitpid(child, &status, 0);
    ::rmdir(src.c_str());
    if (got != child || !WIFEXITED(status)) return 49;
    return WEXITSTATUS(status);
  }), 0);
}

}  // namespace
}  // namespace dsec::aether
