#include "edge/btrfs_quota.h"

#include <fcntl.h>
#include <linux/btrfs.h>
#include <linux/loop.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/loop_device.h"
#include "image/layer_builder.h"

// Linux 6.7 (simple quotas); Debian 12's 6.1 headers lack it.
#ifndef BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA
#define BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA 4
#endif
// <linux/fs.h> clashes with <sys/mount.h> on glibc 2.36.
#ifndef FS_IOC_SETFLAGS
#define FS_IOC_SETFLAGS _IOW('f', 2, long)
#endif
#ifndef FS_NOCOW_FL
#define FS_NOCOW_FL 0x00800000
#endif

namespace dsec::edge {

namespace {

Status unavailable(std::string why) { return Status(Code::kFailedPrecondition, std::move(why)); }

}  // namespace

std::string findProgram(const std::string& name) {
  const char* env = ::getenv("PATH");
  std::string path = env ? env : "";
  path += ":/usr/local/sbin:/usr/sbin:/sbin";
  for (auto& dir : splitString(path, ':')) {
    if (dir.empty()) continue;
    std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

namespace {

// The sysfs directory of the btrfs holding `fd`.
Result<std::string> sysfsDirOf(int fd) {
  btrfs_ioctl_fs_info_args info{};
  if (::ioctl(fd, BTRFS_IOC_FS_INFO, &info) != 0) return sysError("BTRFS_IOC_FS_INFO");
  char uuid[37];
  const uint8_t* u = info.fsid;
  std::snprintf(uuid, sizeof uuid,
                "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
                u[15]);
  return std::string("/sys/fs/btrfs/") + uuid;
}

// "simple quotas" or "qgroups" when quotas are enabled on the btrfs holding
// `fd`, empty when they are not.
std::string quotaModeOf(int fd) {
  auto dir = sysfsDirOf(fd);
  if (!dir.isOk()) return {};
  struct stat st;
  if (::stat((*dir + "/qgroups").c_str(), &st) != 0) return {};
  auto mode = readFile(*dir + "/qgroups/mode");  // Linux 6.7+
  return mode.isOk() && startsWith(*mode, "squota") ? "simple quotas" : "qgroups";
}

class BtrfsQuota : public DiskQuota {
 public:
  BtrfsQuota(std::string root, UniqueFd rootFd, std::string image, int64_t poolBytes,
             std::string mode)
      : root_(std::move(root)),
        rootFd_(std::move(rootFd)),
        image_(std::move(image)),
        poolBytes_(poolBytes),
        mode_(std::move(mode)) {}
  ~BtrfsQuota() override { close(); }

  DiskQuotaKind kind() const override { return DiskQuotaKind::kBtrfs; }
  std::string describe() const override {
    if (image_.empty()) return "btrfs " + mode_ + " on " + root_;
    return "btrfs " + mode_ + " on a " + humanBytes(poolBytes_) + " sparse loop image " + image_ +
           " mounted on " + root_;
  }
  // btrfs_qgroup_reserve_data and friends fail with EDQUOT.
  int overLimitErrno() const override { return EDQUOT; }

  Status create(const std::string& name, int64_t bytes) override {
    RETURN_IF_ERROR(checkName(name));
    // One ioctl makes the subvolume and its qgroup with the limit: no window
    // in which the sandbox's directory exists unlimited.
    btrfs_qgroup_inherit inherit{};
    inherit.flags = BTRFS_QGROUP_INHERIT_SET_LIMITS;
    inherit.lim.flags = BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL;
    inherit.lim.max_rfer = uint64_t(bytes);
    inherit.lim.max_excl = uint64_t(bytes);
    btrfs_ioctl_vol_args_v2 args{};
    args.flags = BTRFS_SUBVOL_QGROUP_INHERIT;
    args.size = sizeof inherit;
    args.qgroup_inherit = &inherit;
    std::memcpy(args.name, name.data(), name.size());
    if (::ioctl(rootFd_.get(), BTRFS_IOC_SUBVOL_CREATE_V2, &args) != 0) {
      return sysError("create subvolume " + root_ + "/" + name);
    }
    // A new subvolume's root is 0755.
    if (::fchmodat(rootFd_.get(), name.c_str(), 0700, 0) != 0) {
      Status st = sysError("chmod " + root_ + "/" + name);
      (void)remove(name);
      return st;
    }
    return Status::ok();
  }

  std::string dirOf(const std::string& name) const override { return root_ + "/" + name; }

  Status remove(const std::string& name) override {
    RETURN_IF_ERROR(checkName(name));
    btrfs_ioctl_vol_args args{};
    std::memcpy(args.name, name.data(), name.size());
    // Unlinks the subvolume at once (as root, however full); the cleaner
    // thread frees its extents, and, on recent kernels, its qgroup, later.
    if (::ioctl(rootFd_.get(), BTRFS_IOC_SNAP_DESTROY, &args) == 0) return Status::ok();
    if (errno == ENOENT) return Status::ok();
    // Not a subvolume: a plain directory (an older edge's, on a btrfs root).
    if (errno == EINVAL || errno == ENOTDIR) return removeTree(root_ + "/" + name);
    return sysError("delete subvolume " + root_ + "/" + name);
  }

  void close() override {
    rootFd_.reset();  // an open directory would keep the pool busy
    if (mounted_) {
      // Sandboxes are gone by now, so a plain unmount releases the pool (and
      // with it the autoclear loop device) at once; lazily if something
      // still holds it.
      if (::umount2(root_.c_str(), 0) != 0) {
        log::warn("unmount sandbox pool " + root_ + ": " + std::strerror(errno) + "; detaching it");
        ::umount2(root_.c_str(), MNT_DETACH);
      }
      mounted_ = false;
    }
    if (bound_) {
      ::umount2(root_.c_str(), MNT_DETACH);
      bound_ = false;
    }
    if (!image_.empty() && ::unlink(image_.c_str()) != 0 && errno != ENOENT) {
      log::warn("remove sandbox pool image " + image_ + ": " + std::strerror(errno));
    }
    image_.clear();
  }

  void keepForNextEdge() override {
    mounted_ = false;
    bound_ = false;
    image_.clear();
  }

  void setBound() { bound_ = true; }
  void setMounted() { mounted_ = true; }

  // On a pool just mounted on root_: opens it, closes it to others, enables
  // quotas.
  Status initPool() {
    rootFd_.reset(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!rootFd_) return sysError("open " + root_);
    // mkfs makes the top directory 0755; sandboxRoot is 0700 (only the edge
    // reaches into sandboxes' files).
    if (::fchmod(rootFd_.get(), 0700) != 0) return sysError("chmod " + root_);
    btrfs_ioctl_quota_ctl_args ctl{};
    ctl.cmd = BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA;
    mode_ = "simple quotas";
    if (::ioctl(rootFd_.get(), BTRFS_IOC_QUOTA_CTL, &ctl) == 0) return Status::ok();
    // Before 6.7 the command is unknown (EINVAL): full qgroups, which also
    // track shared extents and cost more, but limit the same way.
    ctl = {};
    ctl.cmd = BTRFS_QUOTA_CTL_ENABLE;
    mode_ = "qgroups";
    if (::ioctl(rootFd_.get(), BTRFS_IOC_QUOTA_CTL, &ctl) == 0) return Status::ok();
    return sysError("enable btrfs quotas on " + root_);
  }

 private:
  Status checkName(const std::string& name) const {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.size() > BTRFS_SUBVOL_NAME_MAX) {
      return invalidArg("id", "bad sandbox directory name '" + name + "'");
    }
    return Status::ok();
  }

  const std::string root_;
  UniqueFd rootFd_;    // the directory subvolumes are made in
  std::string image_;  // the pool image we made, empty for a native btrfs
  int64_t poolBytes_;
  std::string mode_;      // "simple quotas" or "qgroups"
  bool bound_ = false;    // root_ bound on itself, shared (under the pool)
  bool mounted_ = false;  // the pool mounted on root_
};

// Makes the pool image file: sparse, `bytes` long, formatted.
Status makePoolImage(const std::string& mkfs, const std::string& image, int64_t bytes) {
  if (::unlink(image.c_str()) != 0 && errno != ENOENT) return sysError("remove old " + image);
  {
    UniqueFd fd(::open(image.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return sysError("create " + image);
    // On a btrfs host, copy-on-write under copy-on-write only fragments the
    // image; the flag takes only while the file is empty. Best effort.
    struct statfs sf;
    if (::fstatfs(fd.get(), &sf) == 0 && sf.f_type == BTRFS_SUPER_MAGIC) {
      long flags = FS_NOCOW_FL;
      (void)::ioctl(fd.get(), FS_IOC_SETFLAGS, &flags);
    }
    if (::ftruncate(fd.get(), bytes) != 0) {
      Status st = sysError("truncate " + image);
      ::unlink(image.c_str());
      return st;
    }
  }
  // One device: single data and metadata profiles (DUP metadata would only
  // double the writes of a scratch pool that is remade at every start).
  Status mk = image::runCommand(
      {mkfs, "-q", "-f", "-L", "dsec-sandboxes", "-d", "single", "-m", "single", image});
  if (!mk.isOk()) {
    ::unlink(image.c_str());
    return unavailable("mkfs.btrfs " + image + ": " + mk.message());
  }
  return Status::ok();
}

// Attaches and mounts the image on root. Direct I/O keeps the host's page
// cache from holding a second copy of every block, where the backing
// filesystem allows it.
Status mountPool(const std::string& image, const std::string& root) {
  UniqueFd held;
  auto dev = attachLoop(image, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, held);
  if (!dev.isOk() && dev.status().sysErrno() == EINVAL) {
    dev = attachLoop(image, LO_FLAGS_AUTOCLEAR, held);
  }
  if (!dev.isOk()) return std::move(dev).takeStatus();
  // discard=async: freed blocks are punched out of the sparse image, so it
  // takes only what sandboxes hold now, not the most they ever held.
  bool mounted = false;
  for (const char* data : {"discard=async", ""}) {
    if (::mount(dev->c_str(), root.c_str(), "btrfs", MS_NOATIME, data) == 0) {
      mounted = true;
      break;
    }
    if (errno != EINVAL) break;
  }
  if (!mounted) return sysError("mount btrfs " + *dev + " on " + root);  // `held` lets it go
  return Status::ok();
}

}  // namespace

bool kernelHasFilesystem(std::string_view fs) {
  auto list = readFile("/proc/filesystems");
  if (!list.isOk()) return false;
  for (auto& line : splitString(*list, '\n')) {
    auto tab = line.rfind('\t');
    if ((tab == std::string::npos ? line : line.substr(tab + 1)) == fs) return true;
  }
  return false;
}

Result<std::unique_ptr<DiskQuota>> openBtrfsQuota(const DiskQuotaOptions& opts) {
  if (!kernelHasFilesystem("btrfs")) return unavailable("the kernel has no btrfs");
  UniqueFd rootFd(::open(opts.root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!rootFd) return sysError("open " + opts.root);
  struct statfs sf;
  if (::fstatfs(rootFd.get(), &sf) != 0) return sysError("statfs " + opts.root);
  if (sf.f_type == BTRFS_SUPER_MAGIC) {
    std::string mode = quotaModeOf(rootFd.get());
    if (!mode.empty() && opts.adopt && !opts.poolImage.empty() && isMountPoint(opts.root) &&
        ::access(opts.poolImage.c_str(), F_OK) == 0) {
      // Our own pool, left mounted by the edge before us for the sandboxes
      // it left running: ours again, to tear down when we are done.
      struct stat img;
      int64_t size = ::stat(opts.poolImage.c_str(), &img) == 0 ? int64_t(img.st_size) : 0;
      auto q = std::make_unique<BtrfsQuota>(opts.root, std::move(rootFd), opts.poolImage, size,
                                            std::move(mode));
      q->setBound();
      q->setMounted();
      return std::unique_ptr<DiskQuota>(std::move(q));
    }
    if (!mode.empty()) {
      return std::unique_ptr<DiskQuota>(
          new BtrfsQuota(opts.root, std::move(rootFd), "", 0, std::move(mode)));
    }
    // Enabling quotas changes a filesystem for good (simple quotas set an
    // incompat flag) and slows it down: not ours to decide for the host's.
    log::info(opts.root + " is on a btrfs without quotas; using a pool image instead");
  }
  rootFd.reset();

  if (opts.poolImage.empty()) return unavailable("no pool image path configured");
  std::string mkfs = findProgram("mkfs.btrfs");
  if (mkfs.empty()) return unavailable("mkfs.btrfs not found (package btrfs-progs)");
  std::string imageDir = opts.poolImage.substr(0, opts.poolImage.rfind('/') + 1);
  struct statvfs vf;
  if (::statvfs(imageDir.empty() ? "." : imageDir.c_str(), &vf) != 0) {
    return sysError("statvfs " + imageDir);
  }
  auto bytes = poolImageBytes(opts.poolBytes, int64_t(vf.f_bavail) * int64_t(vf.f_frsize));
  if (!bytes.isOk()) return std::move(bytes).takeStatus();
  RETURN_IF_ERROR(makePoolImage(mkfs, opts.poolImage, *bytes));
  // From here on `q` owns the mounts and the image: an error return undoes them.
  auto q = std::make_unique<BtrfsQuota>(opts.root, UniqueFd(), opts.poolImage, *bytes, "");
  // Every mount namespace cloned from ours while we run (our spare agents,
  // other processes') holds a copy of the pool. Mounted on a shared bind, the
  // pool's unmount at close reaches those copies too (where they are still
  // peers), so the pool and its loop device go then, not when the last such
  // namespace does.
  RETURN_IF_ERROR(bindShared(opts.root));
  q->setBound();
  RETURN_IF_ERROR(mountPool(opts.poolImage, opts.root));
  q->setMounted();
  RETURN_IF_ERROR(q->initPool());
  return std::unique_ptr<DiskQuota>(std::move(q));
}

}  // namespace dsec::edge
