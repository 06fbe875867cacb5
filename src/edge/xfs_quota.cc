#include "edge/xfs_quota.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/dqblk_xfs.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/quota.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <set>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/btrfs_quota.h"
#include "edge/loop_device.h"
#include "image/layer_builder.h"

// <linux/fs.h> clashes with <sys/mount.h> on glibc 2.36: its FS_IOC_FS[GS]ETXATTR.
namespace {
struct FsXattr {
  uint32_t xflags;
  uint32_t extsize;
  uint32_t nextents;
  uint32_t projid;
  uint32_t cowextsize;
  unsigned char pad[8];
};
}  // namespace
#define DSEC_FS_IOC_FSGETXATTR _IOR('X', 31, FsXattr)
#define DSEC_FS_IOC_FSSETXATTR _IOW('X', 32, FsXattr)
#define DSEC_FS_XFLAG_PROJINHERIT 0x00000200
#ifndef XFS_SUPER_MAGIC
#define XFS_SUPER_MAGIC 0x58465342
#endif
#ifndef PRJQUOTA
#define PRJQUOTA 2
#endif
#ifndef SYS_quotactl_fd
#define SYS_quotactl_fd 443
#endif

namespace dsec::edge {

namespace {

Status unavailable(std::string why) { return Status(Code::kFailedPrecondition, std::move(why)); }

// mkfs.xfs refuses filesystems under 300 MB (xfsprogs 5.19+).
constexpr int64_t kMinXfsPoolBytes = 320ll << 20;

// The source (device) of the topmost mount on `path`, from mountinfo.
std::string mountSourceOf(const std::string& path) {
  auto info = readFile("/proc/self/mountinfo");
  if (!info.isOk()) return {};
  std::string source;
  for (auto& line : splitString(*info, '\n')) {
    auto f = splitString(line, ' ');
    if (f.size() < 10 || f[4] != path) continue;
    for (size_t i = 6; i + 2 < f.size(); ++i) {
      if (f[i] == "-") {
        source = f[i + 2];
        break;
      }
    }
  }
  return source;
}

class XfsQuota : public DiskQuota {
 public:
  XfsQuota(std::string root, std::string image, int64_t poolBytes)
      : root_(std::move(root)), image_(std::move(image)), poolBytes_(poolBytes) {}
  ~XfsQuota() override { close(); }

  DiskQuotaKind kind() const override { return DiskQuotaKind::kXfs; }
  std::string describe() const override {
    return "xfs project quotas on a " + humanBytes(poolBytes_) + " sparse loop image " + image_ +
           " mounted on " + root_;
  }
  // xfs_trans_dqresv: over a project's hard limit is ENOSPC.
  int overLimitErrno() const override { return ENOSPC; }

  Status create(const std::string& name, int64_t bytes) override {
    RETURN_IF_ERROR(checkName(name));
    if (::mkdirat(rootFd_.get(), name.c_str(), 0700) != 0) {
      return sysError("mkdir " + root_ + "/" + name);
    }
    uint32_t id = allocId();
    // The limit first, then the project on the directory: the directory is
    // never in a project without its limit. Nothing runs in it yet.
    Status st = setLimit(id, xfsBasicBlocks(bytes));
    if (st.isOk()) st = setProject(name, id);
    if (!st.isOk()) {
      (void)setLimit(id, 0);
      ::unlinkat(rootFd_.get(), name.c_str(), AT_REMOVEDIR);
      releaseId(id);
      return st;
    }
    return Status::ok();
  }

  std::string dirOf(const std::string& name) const override { return root_ + "/" + name; }

  Status remove(const std::string& name) override {
    RETURN_IF_ERROR(checkName(name));
    uint32_t id = 0;
    {
      UniqueFd dir(::openat(rootFd_.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!dir) {
        if (errno == ENOENT) return Status::ok();
        return sysError("open " + root_ + "/" + name);
      }
      FsXattr fx{};
      if (::ioctl(dir.get(), DSEC_FS_IOC_FSGETXATTR, &fx) == 0) id = fx.projid;
    }
    RETURN_IF_ERROR(removeTree(root_ + "/" + name));
    if (id != 0) {
      // The project's blocks are freed with its files; its limit goes now so
      // the id can be reused without inheriting it.
      if (Status st = setLimit(id, 0); !st.isOk()) {
        log::warn("clear xfs project " + std::to_string(id) + " limit: " + st.toString());
      }
      releaseId(id);
    }
    return Status::ok();
  }

  void close() override {
    rootFd_.reset();  // an open directory would keep the pool busy
    if (mounted_) {
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
    if (ownsImage_ && !image_.empty() && ::unlink(image_.c_str()) != 0 && errno != ENOENT) {
      log::warn("remove sandbox pool image " + image_ + ": " + std::strerror(errno));
    }
    ownsImage_ = false;
  }

  void keepForNextEdge() override {
    mounted_ = false;
    bound_ = false;
    ownsImage_ = false;
  }

  void setBound() { bound_ = true; }
  void setMounted() {
    mounted_ = true;
    ownsImage_ = true;
  }
  void setDevice(std::string dev) { device_ = std::move(dev); }

  // On a pool mounted on root_: opens it, closes it to others, and (adopting)
  // learns which project ids the sandbox directories already hold.
  Status initPool(bool adopting) {
    rootFd_.reset(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!rootFd_) return sysError("open " + root_);
    if (::fchmod(rootFd_.get(), 0700) != 0) return sysError("chmod " + root_);
    if (device_.empty()) device_ = mountSourceOf(root_);
    if (adopting) {
      for (auto& name : sandboxDirsOf(root_)) {
        UniqueFd dir(::openat(rootFd_.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
        FsXattr fx{};
        if (dir && ::ioctl(dir.get(), DSEC_FS_IOC_FSGETXATTR, &fx) == 0 && fx.projid != 0) {
          used_.insert(fx.projid);
        }
      }
    }
    // Quotas must be on and enforced (a kernel may mount prjquota without
    // enforcing it when quota support is half there): ask.
    fs_quota_stat qs{};
    if (quotactlCall(QCMD(Q_XGETQSTAT, PRJQUOTA), 0, &qs) != 0) {
      return sysError("xfs quota state of " + root_);
    }
    if (!(qs.qs_flags & FS_QUOTA_PDQ_ENFD)) {
      return unavailable("project quotas are not enforced on " + root_);
    }
    return Status::ok();
  }

 private:
  static std::vector<std::string> sandboxDirsOf(const std::string& root) {
    std::vector<std::string> out;
    DIR* d = ::opendir(root.c_str());
    if (d == nullptr) return out;
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != ".." && e->d_type == DT_DIR) out.push_back(n);
    }
    ::closedir(d);
    return out;
  }

  Status checkName(const std::string& name) const {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return invalidArg("id", "bad sandbox directory name '" + name + "'");
    }
    return Status::ok();
  }

  // quotactl_fd (Linux 5.14+) on the pool's root, else quotactl on its device.
  int quotactlCall(int cmd, uint32_t id, void* addr) {
    long r = ::syscall(SYS_quotactl_fd, rootFd_.get(), cmd, id, addr);
    if (r == 0 || errno != ENOSYS) return int(r);
    return ::quotactl(cmd, device_.c_str(), int(id), static_cast<caddr_t>(addr));
  }

  // A hard block limit of `blocks` (512 B each) on project `id`; 0 removes it.
  Status setLimit(uint32_t id, uint64_t blocks) {
    fs_disk_quota d{};
    d.d_version = FS_DQUOT_VERSION;
    d.d_flags = FS_PROJ_QUOTA;
    d.d_id = id;
    d.d_fieldmask = FS_DQ_BHARD | FS_DQ_BSOFT;
    d.d_blk_hardlimit = blocks;
    d.d_blk_softlimit = 0;
    if (quotactlCall(QCMD(Q_XSETQLIM, PRJQUOTA), id, &d) != 0) {
      return sysError("set xfs project " + std::to_string(id) + " limit on " + root_);
    }
    return Status::ok();
  }

  // Puts the directory in project `id`, inherited by what is made in it.
  Status setProject(const std::string& name, uint32_t id) {
    UniqueFd dir(::openat(rootFd_.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!dir) return sysError("open " + root_ + "/" + name);
    FsXattr fx{};
    if (::ioctl(dir.get(), DSEC_FS_IOC_FSGETXATTR, &fx) != 0) {
      return sysError("FS_IOC_FSGETXATTR " + root_ + "/" + name);
    }
    fx.projid = id;
    fx.xflags |= DSEC_FS_XFLAG_PROJINHERIT;
    if (::ioctl(dir.get(), DSEC_FS_IOC_FSSETXATTR, &fx) != 0) {
      return sysError("FS_IOC_FSSETXATTR " + root_ + "/" + name);
    }
    return Status::ok();
  }

  uint32_t allocId() {
    std::lock_guard lk(mu_);
    // Project 0 is the default of every inode: never a sandbox's.
    uint32_t id = next_;
    while (id == 0 || used_.count(id)) ++id;
    used_.insert(id);
    next_ = id + 1;
    return id;
  }
  void releaseId(uint32_t id) {
    std::lock_guard lk(mu_);
    used_.erase(id);
    if (id < next_) next_ = id;
  }

  const std::string root_;
  UniqueFd rootFd_;
  std::string image_;
  std::string device_;  // the loop device, for quotactl before Linux 5.14
  int64_t poolBytes_;
  bool bound_ = false;
  bool mounted_ = false;
  bool ownsImage_ = false;
  std::mutex mu_;  // guards used_, next_
  std::set<uint32_t> used_;
  uint32_t next_ = 1;
};

Status makeXfsImage(const std::string& mkfs, const std::string& image, int64_t bytes) {
  if (::unlink(image.c_str()) != 0 && errno != ENOENT) return sysError("remove old " + image);
  {
    UniqueFd fd(::open(image.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return sysError("create " + image);
    if (::ftruncate(fd.get(), bytes) != 0) {
      Status st = sysError("truncate " + image);
      ::unlink(image.c_str());
      return st;
    }
  }
  // The label is at most 12 bytes on XFS.
  Status mk = image::runCommand({mkfs, "-q", "-f", "-L", "dsec-sbx", image});
  if (!mk.isOk()) {
    ::unlink(image.c_str());
    return unavailable("mkfs.xfs " + image + ": " + mk.message());
  }
  return Status::ok();
}

}  // namespace

uint64_t xfsBasicBlocks(int64_t bytes) {
  if (bytes <= 0) return 0;
  uint64_t fsBlocks = (uint64_t(bytes) + 4095) / 4096;
  return fsBlocks * 8;
}

std::string xfsQuotaUnavailableReason() {
  if (!kernelHasFilesystem("xfs")) return "the kernel has no xfs";
  struct stat st;
  if (::stat("/proc/fs/xfs", &st) == 0 && ::stat("/proc/fs/xfs/xqmstat", &st) != 0) {
    return "the kernel's xfs has no quota support (built without CONFIG_XFS_QUOTA: no "
           "/proc/fs/xfs/xqmstat)";
  }
  return {};
}

Result<std::unique_ptr<DiskQuota>> openXfsQuota(const DiskQuotaOptions& opts) {
  if (auto why = xfsQuotaUnavailableReason(); !why.empty()) return unavailable(why);
  if (opts.poolImage.empty()) return unavailable("no pool image path configured");
  struct statfs sf;
  if (opts.adopt && ::statfs(opts.root.c_str(), &sf) == 0 && sf.f_type == XFS_SUPER_MAGIC &&
      isMountPoint(opts.root) && ::access(opts.poolImage.c_str(), F_OK) == 0) {
    // Our own pool, left mounted by the edge before us for the sandboxes it
    // left running: ours again, to tear down when we are done.
    struct stat img;
    int64_t size = ::stat(opts.poolImage.c_str(), &img) == 0 ? int64_t(img.st_size) : 0;
    auto q = std::make_unique<XfsQuota>(opts.root, opts.poolImage, size);
    q->setBound();
    q->setMounted();
    if (Status st = q->initPool(true); !st.isOk()) {
      q->keepForNextEdge();  // its sandboxes still run on it
      return st;
    }
    return std::unique_ptr<DiskQuota>(std::move(q));
  }
  std::string mkfs = findProgram("mkfs.xfs");
  if (mkfs.empty()) return unavailable("mkfs.xfs not found (package xfsprogs)");
  std::string imageDir = opts.poolImage.substr(0, opts.poolImage.rfind('/') + 1);
  struct statvfs vf;
  if (::statvfs(imageDir.empty() ? "." : imageDir.c_str(), &vf) != 0) {
    return sysError("statvfs " + imageDir);
  }
  ASSIGN_OR_RETURN(int64_t bytes,
                   poolImageBytes(opts.poolBytes, int64_t(vf.f_bavail) * int64_t(vf.f_frsize)));
  if (bytes < kMinXfsPoolBytes) {
    return unavailable("an xfs pool needs at least " + humanBytes(kMinXfsPoolBytes) + ", not " +
                       humanBytes(bytes));
  }
  RETURN_IF_ERROR(makeXfsImage(mkfs, opts.poolImage, bytes));
  auto q = std::make_unique<XfsQuota>(opts.root, opts.poolImage, bytes);
  // See openBtrfsQuota: on a shared bind, the pool's unmount reaches the
  // mount namespaces cloned from ours meanwhile.
  Status bs = bindShared(opts.root);
  if (!bs.isOk()) {
    ::unlink(opts.poolImage.c_str());
    return bs;
  }
  q->setBound();
  UniqueFd held;
  auto dev = attachLoop(opts.poolImage, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, held);
  if (!dev.isOk() && dev.status().sysErrno() == EINVAL) {
    dev = attachLoop(opts.poolImage, LO_FLAGS_AUTOCLEAR, held);
  }
  if (!dev.isOk()) {
    q->close();
    ::unlink(opts.poolImage.c_str());
    return std::move(dev).takeStatus();
  }
  bool mounted = false;
  int err = 0;
  // discard: freed blocks are punched out of the sparse image.
  for (const char* data : {"prjquota,discard", "prjquota"}) {
    if (::mount(dev->c_str(), opts.root.c_str(), "xfs", MS_NOATIME, data) == 0) {
      mounted = true;
      break;
    }
    err = errno;
    if (errno != EINVAL) break;
  }
  if (!mounted) {
    q->close();
    ::unlink(opts.poolImage.c_str());
    // EINVAL here is mostly a kernel without XFS quota support.
    return Status(Code::kFailedPrecondition,
                  "mount xfs -o prjquota " + *dev + " on " + opts.root + ": " + std::strerror(err));
  }
  q->setMounted();
  q->setDevice(*dev);
  RETURN_IF_ERROR(q->initPool(false));
  return std::unique_ptr<DiskQuota>(std::move(q));
}

}  // namespace dsec::edge
