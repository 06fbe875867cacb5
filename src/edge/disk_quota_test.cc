#include "edge/disk_quota.h"

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/mountinfo.h"
#include "common/util.h"
#include "edge/btrfs_quota.h"
#include "edge/ext4_quota.h"
#include "edge/userns.h"
#include "edge/image/layer_cache.h"
#include "edge/xfs_quota.h"

namespace dsec::edge {
namespace {

TEST(DiskQuotaCandidates, AutoPrefersDiskOverRam) {
  auto c = diskQuotaCandidates("auto");
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(*c, (std::vector{DiskQuotaKind::kXfs, DiskQuotaKind::kExt4, DiskQuotaKind::kBtrfs,
                             DiskQuotaKind::kTmpfs}));
  EXPECT_EQ(*diskQuotaCandidates("xfs"), std::vector{DiskQuotaKind::kXfs});
  EXPECT_EQ(*diskQuotaCandidates("ext4"), std::vector{DiskQuotaKind::kExt4});
  EXPECT_EQ(*diskQuotaCandidates("btrfs"), std::vector{DiskQuotaKind::kBtrfs});
  EXPECT_EQ(*diskQuotaCandidates("tmpfs"), std::vector{DiskQuotaKind::kTmpfs});
  EXPECT_EQ(*diskQuotaCandidates("none"), std::vector{DiskQuotaKind::kNone});
}

TEST(DiskQuotaCandidates, UnknownModeNamesTheOption) {
  for (const char* bad : {"", "ext3", "XFS", "BTRFS", "auto "}) {
    auto c = diskQuotaCandidates(bad);
    ASSERT_FALSE(c.isOk()) << bad;
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(c.status().field(), "disk-quota");
  }
}

TEST(PoolImageBytes, RequestedWinsOverFreeSpace) {
  EXPECT_EQ(*poolImageBytes(1ll << 30, 80ll << 30), 1ll << 30);
  EXPECT_EQ(*poolImageBytes(0, 80ll << 30), 80ll << 30);
}

TEST(PoolImageBytes, RoundsDownToMiB) {
  EXPECT_EQ(*poolImageBytes(0, (300ll << 20) + 12345), 300ll << 20);
  EXPECT_EQ(*poolImageBytes((1ll << 30) + 1, 0), 1ll << 30);
}

TEST(PoolImageBytes, TooSmallIsAPrecondition) {
  auto r = poolImageBytes(0, 100ll << 20);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("free space"), std::string::npos) << r.status().message();
  r = poolImageBytes(16ll << 20, 80ll << 30);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("as configured"), std::string::npos);
  EXPECT_TRUE(poolImageBytes(kMinPoolBytes, 0).isOk());
}

TEST(TmpfsMountData, RoundsUpToPages) {
  EXPECT_EQ(tmpfsMountData(32ll << 20, 4096), "size=33554432,mode=0700");
  EXPECT_EQ(tmpfsMountData(1, 4096), "size=4096,mode=0700");
  EXPECT_EQ(tmpfsMountData(4097, 4096), "size=8192,mode=0700");
}

TEST(HumanBytes, PicksAUnit) {
  EXPECT_EQ(humanBytes(512), "512 B");
  EXPECT_EQ(humanBytes(256ll << 20), "256 MiB");
  EXPECT_EQ(humanBytes(3ll << 29), "1.5 GiB");
  EXPECT_EQ(humanBytes(80ll << 30), "80 GiB");
}

TEST(KernelHasFilesystem, ReadsProcFilesystems) {
  EXPECT_TRUE(kernelHasFilesystem("proc"));
  EXPECT_FALSE(kernelHasFilesystem("no-such-fs"));
  EXPECT_FALSE(kernelHasFilesystem("nodev"));
}

// ---- against the real kernel (root; skipped with the reason otherwise) ----

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/dsec-quota-test-XXXXXX";
    if (::mkdtemp(tmpl)) path = tmpl;
  }
  ~TempDir() {
    if (!path.empty()) (void)removeTree(path);
  }
};

// Writes `bytes` zeros to a new file; returns the errno that stopped it (0
// when all were written) and the count written in `written`.
int writeZeros(const std::string& path, int64_t bytes, int64_t* written) {
  *written = 0;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno;
  std::string chunk(1 << 20, '\0');
  int err = 0;
  while (*written < bytes) {
    ssize_t n = ::write(fd, chunk.data(), size_t(std::min<int64_t>(bytes - *written, 1 << 20)));
    if (n < 0) {
      err = errno;
      break;
    }
    *written += n;
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  return err;
}

// Loop devices whose backing file is `file`.
std::vector<std::string> loopsBackedBy(const std::string& file) {
  std::vector<std::string> out;
  glob_t g;
  if (::glob("/sys/block/loop*/loop/backing_file", 0, nullptr, &g) != 0) return out;
  for (size_t i = 0; i < g.gl_pathc; ++i) {
    auto b = readFile(g.gl_pathv[i]);
    if (b.isOk() && startsWith(*b, file)) out.push_back(g.gl_pathv[i]);
  }
  globfree(&g);
  return out;
}

bool eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 100; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

std::string btrfsSkipReason() {
  if (::geteuid() != 0) return "needs root (mount, loop devices)";
  if (!kernelHasFilesystem("btrfs")) return "the kernel has no btrfs";
  if (::access("/usr/sbin/mkfs.btrfs", X_OK) != 0 && ::access("/sbin/mkfs.btrfs", X_OK) != 0 &&
      ::access("/usr/bin/mkfs.btrfs", X_OK) != 0) {
    return "mkfs.btrfs not installed (btrfs-progs)";
  }
  if (::access("/dev/loop-control", W_OK) != 0) return "no /dev/loop-control";
  return {};
}

TEST(BtrfsQuota, LimitsEachSandboxAndCleansUp) {
  if (auto why = btrfsSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.poolImage = tmp.path + "/sandboxes.img";
  o.poolBytes = 1ll << 30;
  o.mode = "btrfs";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  EXPECT_EQ(dq.kind(), DiskQuotaKind::kBtrfs);
  EXPECT_EQ(dq.overLimitErrno(), EDQUOT);
  EXPECT_NE(dq.describe().find("1 GiB sparse loop image " + o.poolImage), std::string::npos)
      << dq.describe();
  struct stat st;
  ASSERT_EQ(::stat(o.poolImage.c_str(), &st), 0);
  EXPECT_LT(st.st_blocks * 512, 64ll << 20) << "the pool image should be sparse";

  constexpr int64_t kLimit = 8 << 20;
  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  ASSERT_TRUE(dq.create("sb-b", kLimit).isOk());
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  EXPECT_EQ(dq.create("../x", kLimit).code(), Code::kInvalidArgument);
  ASSERT_EQ(::stat((o.root + "/sb-a").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0700u);

  int64_t written = 0;
  std::string big = o.root + "/sb-a/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), EDQUOT);
  EXPECT_GT(written, kLimit / 2);
  EXPECT_LE(written, kLimit);
  // The other sandbox is not charged for it.
  EXPECT_EQ(writeZeros(o.root + "/sb-b/f", kLimit * 3 / 4, &written), 0);
  // Deleting gives the room back at once.
  ASSERT_EQ(::unlink(big.c_str()), 0);
  EXPECT_EQ(writeZeros(o.root + "/sb-a/again", kLimit * 3 / 4, &written), 0);

  // A btrfs root with quotas already on is used in place (no image of its own).
  ASSERT_EQ(::mkdir((o.root + "/nested").c_str(), 0700), 0);
  DiskQuotaOptions n = o;
  n.root = o.root + "/nested";
  n.poolImage = tmp.path + "/never-made.img";
  auto nq = openDiskQuota(n);
  ASSERT_TRUE(nq.isOk()) << nq.status().toString();
  EXPECT_EQ((*nq)->describe().find("image"), std::string::npos) << (*nq)->describe();
  ASSERT_TRUE((*nq)->create("sb-n", kLimit).isOk());
  EXPECT_EQ(writeZeros(n.root + "/sb-n/big", 2 * kLimit, &written), EDQUOT);
  EXPECT_TRUE((*nq)->remove("sb-n").isOk());
  (*nq)->close();
  EXPECT_NE(::access(n.poolImage.c_str(), F_OK), 0);
  ASSERT_EQ(::rmdir(n.root.c_str()), 0);

  // A plain directory (not a subvolume) is removed too; a missing one is fine.
  ASSERT_EQ(::mkdir((o.root + "/sb-plain").c_str(), 0700), 0);
  EXPECT_TRUE(dq.remove("sb-plain").isOk());
  for (const char* name : {"sb-a", "sb-b", "sb-missing"}) {
    EXPECT_TRUE(dq.remove(name).isOk()) << name;
    EXPECT_NE(::access((o.root + "/" + name).c_str(), F_OK), 0) << name;
  }
  dq.close();
  dq.close();  // idempotent
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_NE(::access(o.poolImage.c_str(), F_OK), 0) << "pool image left";
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(o.poolImage).empty(); }))
      << "loop device left: " << loopsBackedBy(o.poolImage).front();
}

TEST(BtrfsQuota, TooSmallPoolIsUnavailable) {
  if (auto why = btrfsSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.poolImage = tmp.path + "/sandboxes.img";
  o.poolBytes = 64ll << 20;
  o.mode = "btrfs";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  auto q = openDiskQuota(o);
  ASSERT_FALSE(q.isOk());
  EXPECT_EQ(q.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_NE(::access(o.poolImage.c_str(), F_OK), 0);
}

TEST(XfsBasicBlocks, WholeFsBlocksIn512ByteUnits) {
  EXPECT_EQ(xfsBasicBlocks(0), 0u);
  EXPECT_EQ(xfsBasicBlocks(1), 8u);
  EXPECT_EQ(xfsBasicBlocks(4096), 8u);
  EXPECT_EQ(xfsBasicBlocks(32ll << 20), (32ull << 20) / 512);
}

std::string xfsSkipReason() {
  if (::geteuid() != 0) return "needs root (mount, loop devices)";
  if (auto why = xfsQuotaUnavailableReason(); !why.empty()) return why;
  if (findProgram("mkfs.xfs").empty()) return "mkfs.xfs not installed (xfsprogs)";
  if (::access("/dev/loop-control", W_OK) != 0) return "no /dev/loop-control";
  return {};
}

TEST(XfsQuota, UnavailableLeavesNothingBehind) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount)";
  TempDir tmp;
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.poolImage = tmp.path + "/sandboxes.img";
  o.mode = "xfs";
  // Too small for mkfs.xfs wherever xfs quotas work; the kernel's own reason
  // where they do not.
  o.poolBytes = 300ll << 20;
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  auto q = openDiskQuota(o);
  ASSERT_FALSE(q.isOk());
  EXPECT_EQ(q.status().code(), Code::kFailedPrecondition) << q.status().toString();
  std::cout << "xfs: " << q.status().message() << "\n";
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_NE(::access(o.poolImage.c_str(), F_OK), 0);
  EXPECT_TRUE(loopsBackedBy(o.poolImage).empty());
}

TEST(XfsQuota, GivesEnospcPerSandboxAndCleansUp) {
  if (auto why = xfsSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.poolImage = tmp.path + "/sandboxes.img";
  o.poolBytes = 1ll << 30;
  o.mode = "xfs";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  EXPECT_EQ(dq.kind(), DiskQuotaKind::kXfs);
  EXPECT_EQ(dq.overLimitErrno(), ENOSPC);
  constexpr int64_t kLimit = 8 << 20;
  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  ASSERT_TRUE(dq.create("sb-b", kLimit).isOk());
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  struct stat st;
  ASSERT_EQ(::stat((o.root + "/sb-a").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  int64_t written = 0;
  std::string big = o.root + "/sb-a/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), ENOSPC);
  EXPECT_GT(written, kLimit / 2);
  EXPECT_LE(written, kLimit);
  // Files in subdirectories are charged too (PROJINHERIT).
  ASSERT_EQ(::mkdir((o.root + "/sb-a/d").c_str(), 0700), 0);
  EXPECT_EQ(writeZeros(o.root + "/sb-a/d/more", kLimit, &written), ENOSPC);
  EXPECT_EQ(writeZeros(o.root + "/sb-b/f", kLimit * 3 / 4, &written), 0);
  ASSERT_EQ(::unlink(big.c_str()), 0);
  ASSERT_EQ(::unlink((o.root + "/sb-a/d/more").c_str()), 0);
  EXPECT_EQ(writeZeros(o.root + "/sb-a/again", kLimit * 3 / 4, &written), 0);

  // Keep for the next edge, adopt: the ids in use are not handed out again.
  dq.keepForNextEdge();
  DiskQuotaOptions a = o;
  a.adopt = true;
  auto aq = openDiskQuota(a);
  ASSERT_TRUE(aq.isOk()) << aq.status().toString();
  ASSERT_TRUE((*aq)->create("sb-c", kLimit).isOk());
  EXPECT_EQ(writeZeros(o.root + "/sb-c/big", 2 * kLimit, &written), ENOSPC);
  // Were sb-c in sb-b's project, sb-b (6 of 8 MiB) would be full now.
  EXPECT_EQ(writeZeros(o.root + "/sb-b/g", kLimit / 8, &written), 0)
      << "sb-b shares a project with a new sandbox";
  for (const char* name : {"sb-a", "sb-b", "sb-c", "sb-missing"}) {
    EXPECT_TRUE((*aq)->remove(name).isOk()) << name;
    EXPECT_NE(::access((o.root + "/" + name).c_str(), F_OK), 0) << name;
  }
  (*aq)->close();
  (*aq)->close();
  q->reset();
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_NE(::access(o.poolImage.c_str(), F_OK), 0) << "pool image left";
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(o.poolImage).empty(); }));
}

TEST(TmpfsQuota, GivesEnospcAndCleansUp) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (mount)";
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.mode = "tmpfs";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  EXPECT_EQ(dq.kind(), DiskQuotaKind::kTmpfs);
  EXPECT_EQ(dq.overLimitErrno(), ENOSPC);
  constexpr int64_t kLimit = 2 << 20;
  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  int64_t written = 0;
  std::string big = o.root + "/sb-a/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), ENOSPC);
  EXPECT_EQ(written, kLimit);
  ASSERT_EQ(::unlink(big.c_str()), 0);
  EXPECT_EQ(writeZeros(o.root + "/sb-a/again", kLimit / 2, &written), 0);
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_NE(::access((o.root + "/sb-a").c_str(), F_OK), 0);
  dq.close();
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
}

std::string ext4SkipReason() {
  if (::geteuid() != 0) return "needs root (mount, loop devices)";
  if (!kernelHasFilesystem("ext4")) return "the kernel has no ext4";
  if (findProgram("mkfs.ext4").empty()) return "mkfs.ext4 not installed (e2fsprogs)";
  if (::access("/dev/loop-control", W_OK) != 0) return "no /dev/loop-control";
  return {};
}

TEST(Ext4MkfsArgs, FourKBlocksNoJournalNoReserve) {
  auto a = ext4MkfsArgs("/sbin/mkfs.ext4", "/x/sb-a.img", (32ll << 20) + 100);
  std::string joined;
  for (auto& s : a) joined += s + " ";
  EXPECT_EQ(joined,
            "/sbin/mkfs.ext4 -q -F -T default -b 4096 -m 0 -O ^has_journal -L dsec-sb "
            "/x/sb-a.img 32768k ");
}

// Spares of the size asked for are moved into place; another size is
// formatted inline; over its size a write fails with ENOSPC in that sandbox
// only; deleting frees room; nothing (mounts, loop devices, images) is left.
TEST(Ext4Quota, GivesEnospcPerSandboxAndCleansUp) {
  if (auto why = ext4SkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  std::string disks = tmp.path + "/disks";
  constexpr int64_t kLimit = 32ll << 20;
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 1;
  eo.initialSize = kLimit;
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  EXPECT_EQ(dq.kind(), DiskQuotaKind::kExt4);
  EXPECT_EQ(dq.overLimitErrno(), ENOSPC);
  EXPECT_EQ(loopsBackedBy(disks + "/spare-0.img").size(), 1u) << "no spare made at open";
  EXPECT_TRUE(mountsUnder(o.root).size() == 1) << "a spare is attached nowhere";

  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());  // the spare
  EXPECT_NE(::access((disks + "/spare-0.img").c_str(), F_OK), 0) << "the spare is sb-a's now";
  ASSERT_TRUE(dq.create("sb-b", 2 * kLimit).isOk());  // formatted inline
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  EXPECT_EQ(dq.create("sb-c", 1 << 20).code(), Code::kInvalidArgument);
  EXPECT_EQ(dq.create("../x", kLimit).code(), Code::kInvalidArgument);
  for (const char* n : {"sb-a", "sb-b"}) {
    std::string d = o.root + "/" + n;
    EXPECT_TRUE(isMountPoint(d)) << d;
    struct stat st;
    ASSERT_EQ(::stat(d.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_NE(::access((d + "/lost+found").c_str(), F_OK), 0);
    EXPECT_EQ(loopsBackedBy(disks + "/" + n + ".img").size(), 1u) << n;
  }
  int64_t written = 0;
  std::string big = o.root + "/sb-a/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), ENOSPC);
  EXPECT_GT(written, kLimit * 3 / 4);
  EXPECT_LE(written, kLimit);
  // The other sandbox is not charged for it.
  EXPECT_EQ(writeZeros(o.root + "/sb-b/f", kLimit, &written), 0);
  ASSERT_EQ(::unlink(big.c_str()), 0);
  EXPECT_EQ(writeZeros(o.root + "/sb-a/again", kLimit / 2, &written), 0);

  // The filler makes a new spare of the size in use.
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks + "/spare-").size() >= 1; }));
  for (const char* n : {"sb-a", "sb-b"}) {
    EXPECT_TRUE(dq.remove(n).isOk());
    EXPECT_TRUE(dq.remove(n).isOk());  // a missing one is fine
    EXPECT_NE(::access((o.root + "/" + n).c_str(), F_OK), 0);
    EXPECT_NE(::access((disks + "/" + n + ".img").c_str(), F_OK), 0);
    EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks + "/" + n).empty(); })) << n;
  }
  dq.close();
  dq.close();
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_NE(::access(disks.c_str(), F_OK), 0) << "images left";
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

std::string detachedSkipReason() {
  if (::geteuid() != 0) return "needs root (mount)";
  if (Status st = probeDetachedDisks(); !st.isOk()) {
    return "this kernel cannot keep disks detached: " + st.toString();
  }
  return {};
}

// An overlay whose upper and work dirs lie in a detached tmpfs (reached by
// /proc/self/fd/N) takes writes into that upper dir, and nothing of it is
// mounted anywhere: the layout the container backend uses on such kernels.
TEST(DetachedDisks, OverlayWritesIntoADetachedUpper) {
  if (auto why = detachedSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  size_t before = mountsUnder(tmp.path).size();
  DiskQuotaOptions o;
  o.root = tmp.path;
  o.mode = "tmpfs";
  o.detach = true;
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  ASSERT_TRUE((*q)->create("sb-a", 1 << 20).isOk());
  std::string d = (*q)->dirOf("sb-a");
  for (const char* sub : {"/lower", "/upper", "/work"}) {
    ASSERT_EQ(::mkdir((d + sub).c_str(), 0755), 0) << d << sub;
  }
  ASSERT_TRUE(writeFileAtomic(d + "/lower/base", "lower").isOk());
  {
    auto ov = makeOverlay(std::vector<std::string>{d + "/lower"}, d + "/upper", d + "/work");
    ASSERT_TRUE(ov.isOk()) << ov.status().toString();
    {
      UniqueFd f(::openat(ov->get(), "new", O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
      ASSERT_TRUE(f) << std::strerror(errno);
      ASSERT_EQ(::write(f.get(), "x", 1), 1);
    }
    struct stat st;
    EXPECT_EQ(::fstatat(ov->get(), "base", &st, 0), 0);
    EXPECT_EQ(::stat((d + "/upper/new").c_str(), &st), 0) << "the write is not in the upper dir";
    EXPECT_EQ(mountsUnder(tmp.path).size(), before);
  }
  EXPECT_TRUE((*q)->remove("sb-a").isOk());
}

// The detached layout's ext4 quota (issue 30): sandboxes' root and disks'
// directory in a temp dir of their own. Skips where the kernel or the host
// cannot (ext4, loop devices, detached overlays).
class Ext4QuotaDetached : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = ext4SkipReason(); !why.empty()) GTEST_SKIP() << why;
    if (auto why = detachedSkipReason(); !why.empty()) GTEST_SKIP() << why;
    ASSERT_FALSE(tmp.path.empty());
    o.root = tmp.path + "/sandboxes";
    o.detach = true;
    ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
    disks = tmp.path + "/disks";
  }
  TempDir tmp;
  DiskQuotaOptions o;
  std::string disks;
};

// Issue 30: detached disks are mounted nowhere (our mount table does not
// change), reached through dirOf (/proc/PID/fd/N), bounded as before, and a
// removed one is recycled in place or let go with its loop device and image.
TEST_F(Ext4QuotaDetached, DetachedDisksAreMountedNowhere) {
  constexpr int64_t kLimit = 32ll << 20;
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 1;
  eo.initialSize = kLimit;
  size_t mountsBefore = mountsUnder(tmp.path).size();
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore) << "no shared bind of the root";
  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  ASSERT_TRUE(dq.create("sb-b", 2 * kLimit).isOk());
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore) << "a sandbox's disk is mounted somewhere";
  EXPECT_NE(::access((o.root + "/sb-a").c_str(), F_OK), 0);
  for (const char* n : {"sb-a", "sb-b"}) {
    std::string d = dq.dirOf(n);
    EXPECT_TRUE(startsWith(d, "/proc/")) << d;
    EXPECT_GE(dq.diskFd(n), 0);
    struct stat st;
    ASSERT_EQ(::stat(d.c_str(), &st), 0) << d;
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(loopsBackedBy(disks + "/" + n + ".img").size(), 1u) << n;
    EXPECT_EQ(::mkdir((d + "/upper").c_str(), 0755), 0) << d;
  }
  EXPECT_EQ(dq.dirOf("sb-zz"), o.root + "/sb-zz");
  EXPECT_EQ(dq.diskFd("sb-zz"), -1);
  int64_t written = 0;
  std::string big = dq.dirOf("sb-a") + "/upper/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), ENOSPC);
  EXPECT_GT(written, kLimit * 3 / 4);
  EXPECT_EQ(writeZeros(dq.dirOf("sb-b") + "/upper/f", kLimit, &written), 0);
  // Both hold little once big is gone: emptied in place and kept as spares
  // (their images renamed), or thrown away; either way nothing is mounted.
  ASSERT_EQ(::unlink(big.c_str()), 0);
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_TRUE(dq.remove("sb-b").isOk());
  EXPECT_EQ(dq.diskFd("sb-a"), -1);
  EXPECT_NE(::access((disks + "/sb-a.img").c_str(), F_OK), 0);
  EXPECT_NE(::access((disks + "/sb-b.img").c_str(), F_OK), 0);
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore);
  dq.close();
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore);
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
  EXPECT_NE(::access(disks.c_str(), F_OK), 0) << "images left";
}

// A restarted edge takes a live sandbox's disk back from a read-only clone
// (the one its agent holds); remove lets it go and deletes the image, and
// keeps (by opts.keep) the images of sandboxes being re-adopted at open.
TEST_F(Ext4QuotaDetached, DetachedDiskIsAdoptedFromAClone) {
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 0;
  eo.recycledPerSize = 0;
  UniqueFd clone;
  {
    auto q = openExt4Quota(o, disks, eo);
    ASSERT_TRUE(q.isOk()) << q.status().toString();
    ASSERT_TRUE((*q)->create("sb-a", 32ll << 20).isOk());
    ASSERT_TRUE(writeFileAtomic((*q)->dirOf("sb-a") + "/f", "hi").isOk());
    clone.reset(int(::syscall(SYS_open_tree, (*q)->diskFd("sb-a"), "",
                              1 /*OPEN_TREE_CLONE*/ | O_CLOEXEC | AT_EMPTY_PATH)));
    ASSERT_TRUE(clone) << std::strerror(errno);
    (*q)->keepForNextEdge();
  }
  EXPECT_EQ(::access((disks + "/sb-a.img").c_str(), F_OK), 0);
  o.adopt = true;
  o.keep = {"sb-a"};
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  EXPECT_EQ(::access((disks + "/sb-a.img").c_str(), F_OK), 0) << "a kept image was removed";
  ASSERT_TRUE((*q)->adoptDisk("sb-a", std::move(clone)).isOk());
  auto f = readFile((*q)->dirOf("sb-a") + "/f");
  ASSERT_TRUE(f.isOk()) << f.status().toString();
  EXPECT_EQ(*f, "hi");
  EXPECT_TRUE((*q)->remove("sb-a").isOk());
  EXPECT_NE(::access((disks + "/sb-a.img").c_str(), F_OK), 0);
  (*q)->close();
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

// A removed disk that is not kept as a spare is shut down first, so that
// its last unmount writes nothing back (its image is deleted anyway): a
// detached disk's fd is an O_PATH one, on which the ioctl alone fails.
TEST_F(Ext4QuotaDetached, ARemovedDetachedDiskIsShutDown) {
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 0;
  eo.recycledPerSize = 0;  // never kept: removed disks are let go
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  ASSERT_TRUE((*q)->create("sb-a", 32ll << 20).isOk());
  ASSERT_TRUE(writeFileAtomic((*q)->dirOf("sb-a") + "/f", "hi").isOk());
  // What the sandbox's overlay would hold on to: a clone of the disk.
  UniqueFd clone(int(::syscall(SYS_open_tree, (*q)->diskFd("sb-a"), "",
                               1 /*OPEN_TREE_CLONE*/ | O_CLOEXEC | AT_EMPTY_PATH)));
  ASSERT_TRUE(clone) << std::strerror(errno);
  ASSERT_TRUE((*q)->remove("sb-a").isOk());
  // A shut-down ext4 answers EIO to everything.
  std::string f = "/proc/self/fd/" + std::to_string(clone.get()) + "/g";
  int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  int err = errno;
  if (fd >= 0) ::close(fd);
  EXPECT_LT(fd, 0);
  EXPECT_EQ(err, EIO) << std::strerror(err);
  clone.reset();
  (*q)->close();
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

TEST(TmpfsQuota, DetachedDisksAreMountedNowhere) {
  if (auto why = detachedSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  o.mode = "tmpfs";
  o.detach = true;
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  size_t mountsBefore = mountsUnder(tmp.path).size();
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  constexpr int64_t kLimit = 2 << 20;
  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  EXPECT_EQ(dq.create("sb-a", kLimit).code(), Code::kAlreadyExists);
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore);
  int64_t written = 0;
  std::string big = dq.dirOf("sb-a") + "/big";
  EXPECT_EQ(writeZeros(big, 2 * kLimit, &written), ENOSPC);
  EXPECT_EQ(written, kLimit);
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_EQ(dq.diskFd("sb-a"), -1);
  dq.close();
  EXPECT_EQ(mountsUnder(tmp.path).size(), mountsBefore);
}

// The loop device behind a sandbox's image, or "" (the sysfs entry's path).
std::string loopOf(const std::string& image) {
  auto l = loopsBackedBy(image);
  return l.size() == 1 ? l.front() : "";
}

// Creates sb-n0, sb-n1, ... (at most 3: the spares of a size) until one gets
// the filesystem on loop device `loop` back, recycled: its name, or "" when
// none did (or a create failed, a test failure of its own).
std::string createUntilReused(DiskQuota& dq, const std::string& disks, const std::string& loop,
                              int64_t bytes) {
  for (int i = 0; i < 3; ++i) {
    std::string n = "sb-n" + std::to_string(i);
    if (Status st = dq.create(n, bytes); !st.isOk()) {
      ADD_FAILURE() << "create " << n << ": " << st.toString();
      return "";
    }
    if (loopOf(disks + "/" + n + ".img") == loop) return n;
  }
  return "";
}

// Issue 30: a lent disk (its sandbox's PID 1 holds it, read-only) costs the
// quota no descriptor. Given back, it is emptied and kept as a spare all the
// same, writable again; never given back (the sandbox died first), it is let
// go with its image.
TEST_F(Ext4QuotaDetached, ALentDiskIsRecycledOrLetGo) {
  constexpr int64_t kLimit = 32ll << 20;
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 1;
  eo.initialSize = kLimit;
  eo.recycledPerSize = 8;
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;
  std::map<std::string, UniqueFd> lent;
  for (const char* n : {"sb-a", "sb-b"}) {
    ASSERT_TRUE(dq.create(n, kLimit).isOk());
    ASSERT_TRUE(writeFileAtomic(dq.dirOf(n) + "/f", "hi").isOk());
    auto m = dq.lend(n);
    ASSERT_TRUE(m.isOk()) << m.status().toString();
    lent[n] = std::move(*m);
    EXPECT_EQ(dq.diskFd(n), -1) << n << ": still held after lend";
    EXPECT_EQ(dq.lend(n).status().code(), Code::kNotFound) << n << ": lent twice";
  }
  EXPECT_EQ(dq.lend("sb-zz").status().code(), Code::kNotFound);
  std::string a = "/proc/self/fd/" + std::to_string(lent["sb-a"].get());
  auto f = readFile(a + "/f");
  ASSERT_TRUE(f.isOk()) << f.status().toString();
  EXPECT_EQ(*f, "hi");
  int fd = ::open((a + "/g").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  int err = errno;
  if (fd >= 0) ::close(fd);
  EXPECT_EQ(fd, -1) << "a lent disk is writable";
  EXPECT_EQ(err, EROFS) << std::strerror(err);
  std::string loopA = loopOf(disks + "/sb-a.img");
  ASSERT_FALSE(loopA.empty());
  EXPECT_EQ(dq.reclaim("sb-zz", UniqueFd()).code(), Code::kNotFound);
  ASSERT_TRUE(dq.reclaim("sb-a", std::move(lent["sb-a"])).isOk());
  EXPECT_EQ(dq.reclaim("sb-a", UniqueFd(::open("/", O_PATH | O_CLOEXEC))).code(), Code::kNotFound)
      << "reclaimed twice";
  ASSERT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_NE(::access((disks + "/sb-a.img").c_str(), F_OK), 0);
  auto spares = loopsBackedBy(disks + "/spare-");
  EXPECT_NE(std::find(spares.begin(), spares.end(), loopA), spares.end())
      << loopA << ": the reclaimed disk was not kept as a spare";
  // It comes back empty and writable.
  std::string n = createUntilReused(dq, disks, loopA, kLimit);
  ASSERT_FALSE(n.empty()) << "the reclaimed disk was not reused";
  EXPECT_NE(::access((dq.dirOf(n) + "/f").c_str(), F_OK), 0) << "left in the recycled disk";
  EXPECT_TRUE(writeFileAtomic(dq.dirOf(n) + "/g", "ok").isOk()) << "the spare is read-only";
  // sb-b's sandbox died holding its disk: let go, image and all.
  lent["sb-b"].reset();
  ASSERT_TRUE(dq.remove("sb-b").isOk());
  EXPECT_NE(::access((disks + "/sb-b.img").c_str(), F_OK), 0);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(dq.remove("sb-n" + std::to_string(i)).isOk());
  dq.close();
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

// A removed sandbox that wrote little becomes an emptied spare of its size
// (same filesystem, same loop device, nothing of it left); one that wrote
// much, or left what cannot be removed, is thrown away as before.
TEST(Ext4Quota, RecyclesALightlyUsedFilesystemEmptied) {
  if (auto why = ext4SkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  std::string disks = tmp.path + "/disks";
  constexpr int64_t kLimit = 32ll << 20;
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 1;
  eo.initialSize = kLimit;
  eo.recycledPerSize = 8;
  eo.recycleMaxBytes = 8 << 20;
  eo.recycleMaxInodes = 100;
  eo.recycledIdleS = 2;
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  DiskQuota& dq = **q;

  ASSERT_TRUE(dq.create("sb-a", kLimit).isOk());
  std::string a = o.root + "/sb-a";
  std::string loopA = loopOf(disks + "/sb-a.img");
  ASSERT_FALSE(loopA.empty());
  // What a sandbox leaves: a tree, a symlink out, odd modes, an owner.
  ASSERT_TRUE(makeDirs(a + "/upper/etc/deep/er", 0755).isOk());
  int64_t written = 0;
  ASSERT_EQ(writeZeros(a + "/upper/etc/deep/er/f", 3 << 20, &written), 0);
  ASSERT_EQ(::symlink("/etc/passwd", (a + "/upper/link").c_str()), 0);
  ASSERT_EQ(::chmod((a + "/upper/etc").c_str(), 0), 0);
  ASSERT_EQ(::chown(a.c_str(), 100000, 100000), 0);

  ASSERT_TRUE(dq.remove("sb-a").isOk());
  EXPECT_NE(::access(a.c_str(), F_OK), 0);
  EXPECT_NE(::access((disks + "/sb-a.img").c_str(), F_OK), 0);
  // Still attached: it is a spare now, behind a spare's image.
  auto spares = loopsBackedBy(disks + "/spare-");
  EXPECT_NE(std::find(spares.begin(), spares.end(), loopA), spares.end()) << loopA;

  // Taking every spare of the size reaches it: it comes back empty, 0700, root's.
  {
    std::string n = createUntilReused(dq, disks, loopA, kLimit);
    ASSERT_FALSE(n.empty()) << "the removed sandbox's filesystem was not reused";
    std::string d = o.root + "/" + n;
    struct stat st;
    ASSERT_EQ(::stat(d.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(st.st_uid, 0u);
    DIR* dir = ::opendir(d.c_str());
    ASSERT_NE(dir, nullptr);
    int entries = 0;
    while (auto* e = ::readdir(dir)) entries += e->d_name[0] != '.';
    ::closedir(dir);
    EXPECT_EQ(entries, 0) << "left in the recycled filesystem";
    // The whole limit is there again.
    EXPECT_EQ(writeZeros(d + "/big", 2 * kLimit, &written), ENOSPC);
    EXPECT_GT(written, kLimit * 3 / 4);
  }

  // Too many files, or too many bytes, to be worth emptying: thrown away
  // with its device.
  ASSERT_TRUE(dq.create("sb-many", kLimit).isOk());
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(writeFileAtomic(o.root + "/sb-many/f" + std::to_string(i), "").isOk());
  }
  ASSERT_TRUE(dq.create("sb-big", kLimit).isOk());
  ASSERT_EQ(writeZeros(o.root + "/sb-big/f", 10 << 20, &written), 0);
  // The filler tops up to one spare, then rests; removals that were recycled
  // would add spares beyond it.
  auto spareImages = [&] {
    int n = 0;
    if (DIR* d = ::opendir(disks.c_str())) {
      while (auto* e = ::readdir(d)) n += startsWith(e->d_name, "spare-");
      ::closedir(d);
    }
    return n;
  };
  ASSERT_TRUE(eventually([&] { return spareImages() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int before = spareImages();
  ASSERT_TRUE(dq.remove("sb-many").isOk());
  ASSERT_TRUE(dq.remove("sb-big").isOk());
  EXPECT_EQ(spareImages(), before) << "an over-used filesystem was kept";
  EXPECT_TRUE(eventually([&] {
    return loopOf(disks + "/sb-many.img").empty() && loopOf(disks + "/sb-big.img").empty();
  }));

  // A file that cannot be removed (immutable): thrown away, nothing left.
  ASSERT_TRUE(dq.create("sb-imm", kLimit).isOk());
  std::string imm = o.root + "/sb-imm/f";
  ASSERT_TRUE(writeFileAtomic(imm, "x").isOk());
  {
    UniqueFd fd(::open(imm.c_str(), O_RDONLY | O_CLOEXEC));
    int flags = FS_IMMUTABLE_FL;
    ASSERT_EQ(::ioctl(fd.get(), FS_IOC_SETFLAGS, &flags), 0);
  }
  ASSERT_TRUE(dq.remove("sb-imm").isOk());
  EXPECT_NE(::access((o.root + "/sb-imm").c_str(), F_OK), 0);
  EXPECT_TRUE(eventually([&] { return loopOf(disks + "/sb-imm.img").empty(); }));

  for (int i = 0; i < 3; ++i) (void)dq.remove("sb-n" + std::to_string(i));
  // Spares past sparesPerSize go once the size has been idle a while.
  for (const char* n : {"sb-x1", "sb-x2", "sb-x3"}) ASSERT_TRUE(dq.create(n, kLimit).isOk());
  for (const char* n : {"sb-x1", "sb-x2", "sb-x3"}) ASSERT_TRUE(dq.remove(n).isOk());
  EXPECT_GT(spareImages(), 1);
  for (int i = 0; i < 300 && spareImages() > 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(spareImages(), 1) << "recycled spares outlived their size's use";
  dq.close();
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

// An edge restarted with live sandboxes keeps theirs and drops the rest.
TEST(Ext4Quota, AdoptKeepsMountedSandboxesAndDropsLeftovers) {
  if (auto why = ext4SkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path + "/sandboxes";
  ASSERT_TRUE(makeDirs(o.root, 0700).isOk());
  std::string disks = tmp.path + "/disks";
  Ext4QuotaOptions eo;
  eo.sparesPerSize = 1;
  eo.initialSize = 16 << 20;
  auto q = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(q.isOk()) << q.status().toString();
  ASSERT_TRUE((*q)->create("sb-live", 16 << 20).isOk());
  int64_t written = 0;
  ASSERT_EQ(writeZeros(o.root + "/sb-live/f", 1 << 20, &written), 0);
  (*q)->keepForNextEdge();
  q->reset();
  EXPECT_TRUE(isMountPoint(o.root + "/sb-live"));
  EXPECT_TRUE(isMountPoint(o.root));
  // A crashed edge's leftover image.
  ASSERT_TRUE(writeFileAtomic(disks + "/sb-gone.img", "x").isOk());

  o.adopt = true;
  auto aq = openExt4Quota(o, disks, eo);
  ASSERT_TRUE(aq.isOk()) << aq.status().toString();
  EXPECT_TRUE(isMountPoint(o.root + "/sb-live"));
  EXPECT_EQ(::access((o.root + "/sb-live/f").c_str(), F_OK), 0);
  EXPECT_EQ(::access((disks + "/sb-live.img").c_str(), F_OK), 0);
  EXPECT_NE(::access((disks + "/sb-gone.img").c_str(), F_OK), 0);
  EXPECT_TRUE((*aq)->remove("sb-live").isOk());
  (*aq)->close();
  EXPECT_TRUE(mountsUnder(tmp.path).empty());
  EXPECT_TRUE(eventually([&] { return loopsBackedBy(disks).empty(); }));
}

TEST(NoQuota, PlainDirectories) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  DiskQuotaOptions o;
  o.root = tmp.path;
  o.mode = "none";
  auto q = openDiskQuota(o);
  ASSERT_TRUE(q.isOk());
  EXPECT_EQ((*q)->overLimitErrno(), 0);
  ASSERT_TRUE((*q)->create("sb-a", 1).isOk());
  int64_t written = 0;
  EXPECT_EQ(writeZeros(tmp.path + "/sb-a/f", 1 << 20, &written), 0);
  EXPECT_TRUE((*q)->remove("sb-a").isOk());
  EXPECT_NE(::access((tmp.path + "/sb-a").c_str(), F_OK), 0);
}

}  // namespace
}  // namespace dsec::edge
