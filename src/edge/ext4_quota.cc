#include "edge/ext4_quota.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/btrfs_quota.h"
#include "edge/image/layer_cache.h"
#include "edge/loop_device.h"
#include "edge/userns.h"
#include "image/layer_builder.h"

namespace dsec::edge {

namespace {

// The new mount API (<linux/mount.h> clashes with <sys/mount.h> on glibc 2.36).
constexpr unsigned kFsopenCloexec = 1;          // FSOPEN_CLOEXEC
constexpr unsigned kFsconfigSetFlag = 0;        // FSCONFIG_SET_FLAG
constexpr unsigned kFsconfigSetString = 1;      // FSCONFIG_SET_STRING
constexpr unsigned kFsconfigCmdCreate = 6;      // FSCONFIG_CMD_CREATE
constexpr unsigned kFsmountCloexec = 1;         // FSMOUNT_CLOEXEC
constexpr unsigned kMountAttrNoatime = 0x10;    // MOUNT_ATTR_NOATIME
constexpr unsigned kMoveMountFEmptyPath = 0x4;  // MOVE_MOUNT_F_EMPTY_PATH
constexpr int64_t kBlock = 4096;
// EXT4_IOC_SHUTDOWN and its "write nothing more" flag (fs/ext4/ext4.h; not in
// Debian 12's uapi headers).
constexpr unsigned long kExt4IocShutdown = _IOR('X', 125, uint32_t);
constexpr uint32_t kExt4GoingFlagsNoLogFlush = 2;
constexpr long kExt4SuperMagic = 0xEF53;
constexpr int64_t kProbeBytes = 16ll << 20;
// open_tree(2) and mount_setattr(2) (Debian 12's headers lack the wrappers).
constexpr unsigned kOpenTreeClone = 1;            // OPEN_TREE_CLONE
constexpr unsigned kOpenTreeCloexec = O_CLOEXEC;  // OPEN_TREE_CLOEXEC
constexpr unsigned kAtRecursive = 0x8000;         // AT_RECURSIVE
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
struct MountAttr {  // struct mount_attr
  uint64_t attrSet = 0, attrClr = 0, propagation = 0, usernsFd = 0;
};

Status unavailable(std::string why) { return Status(Code::kFailedPrecondition, std::move(why)); }

Status checkName(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name[0] == '.') {
    return invalidArg("id", "bad sandbox directory name '" + name + "'");
  }
  return Status::ok();
}

// `fd` (open on `dir`) is the root of a filesystem of its own (a device other
// than `parent`'s) and that filesystem is ext4: only then is it a sandbox's.
bool isOwnExt4Root(int fd, const std::string& parent) {
  struct stat own, up;
  struct statfs fs;
  return ::fstat(fd, &own) == 0 && ::stat(parent.c_str(), &up) == 0 && own.st_dev != up.st_dev &&
         ::fstatfs(fd, &fs) == 0 && fs.f_type == kExt4SuperMagic;
}

// A removed sandbox's filesystem is thrown away with its image, so nothing
// it still has in memory needs writing: shut it down first, and its final
// unmount (once the last mount namespace holding it is gone) skips the
// writeback. Without this, each teardown wrote its dirty blocks through the
// loop device, one filesystem after another: about 16 released per second
// here, slower than a burst of creates takes new ones. Only ever the
// sandbox's own ext4: `dir` must be a mount root on a device other than its
// parent's (so never the host filesystem beneath an unmounted `dir`).
// `top`: an fd on the filesystem's root (a detached disk's mount fd will do).
void shutDownSandboxFsAt(int top, const std::string& what, const std::string& parent) {
  if (top < 0 || !isOwnExt4Root(top, parent)) return;
  uint32_t flags = kExt4GoingFlagsNoLogFlush;
  // A detached disk's fd (fsmount, open_tree) is an O_PATH one, which
  // refuses ioctls (EBADF): open its root directory for real through it.
  UniqueFd real(::openat(top, ".", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (::ioctl(real ? real.get() : top, kExt4IocShutdown, &flags) != 0) {
    log::debug("disk quota: shut down " + what + ": " + std::strerror(errno));
  }
}
void shutDownSandboxFs(const std::string& dir, const std::string& parent) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  shutDownSandboxFsAt(fd.get(), dir, parent);
}

// Inodes and blocks in use on the filesystem of `fd`.
struct Usage {
  uint64_t inodes = 0;
  uint64_t bytes = 0;
};
std::optional<Usage> usageOf(int fd) {
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) return std::nullopt;
  return Usage{uint64_t(fs.f_files - fs.f_ffree), uint64_t(fs.f_blocks - fs.f_bfree) * fs.f_bsize};
}

// Unmounts (lazily) whatever is mounted on `dir`; fine when nothing is.
Status unmountIfMounted(const std::string& dir) {
  if (::umount2(dir.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) {
    return sysError("umount " + dir);
  }
  return Status::ok();
}

class Ext4Quota : public DiskQuota {
 public:
  Ext4Quota(std::string root, std::string disksDir, std::string mkfs, Ext4QuotaOptions eo,
            bool detach, std::set<std::string> keep, LoopPool* loops,
            std::unique_ptr<LoopPool> ownLoops)
      : root_(std::move(root)),
        disks_(std::move(disksDir)),
        mkfs_(std::move(mkfs)),
        eo_(eo),
        ownLoops_(std::move(ownLoops)),
        loops_(loops ? loops : ownLoops_.get()),
        detach_(detach),
        keep_(std::move(keep)) {
    if (eo_.sparesPerSize > 0 && eo_.sizesKept > 0 && eo_.initialSize > 0) {
      wanted_.push_back(roundBytes(eo_.initialSize));
    }
  }
  ~Ext4Quota() override { close(); }

  DiskQuotaKind kind() const override { return DiskQuotaKind::kExt4; }
  std::string describe() const override {
    return "ext4, one sparse loop-mounted image per sandbox in " + disks_ +
           (detach_ ? ", detached" : "") + " (" +
           std::to_string(eo_.sparesPerSize) + " spares kept per size, up to " +
           std::to_string(eo_.recycledPerSize) + " from removed sandboxes)";
  }
  int overLimitErrno() const override { return ENOSPC; }

  Status create(const std::string& name, int64_t bytes) override {
    RETURN_IF_ERROR(checkName(name));
    if (bytes < kProbeBytes) {
      return invalidArg("disk_mb", "disk_mb must be at least " + humanBytes(kProbeBytes));
    }
    bytes = roundBytes(bytes);
    std::string dir = root_ + "/" + name;
    struct stat st;
    if (::lstat(dir.c_str(), &st) == 0 || table_.has(name)) {
      return Status(Code::kAlreadyExists, dir + " exists");
    }
    std::optional<Spare> spare;
    {
      std::lock_guard lk(mu_);
      noteSize(bytes);
      auto it = spares_.find(bytes);
      if (it != spares_.end()) {
        spare = std::move(it->second);
        spares_.erase(it);
      }
    }
    cv_.notify_all();
    if (!spare) {
      // No spare of this size (yet): format one now, on the create path.
      log::debug("disk quota: no spare of " + humanBytes(bytes) + " for " + name);
      auto made = makeSpare(bytes, imageOf(name));
      if (!made.isOk()) return std::move(made).takeStatus();
      spare = std::move(made).value();
    }
    if (detach_) {
      // Attached nowhere: the sandbox gets it through its overlay, built by
      // the edge from dirOf(name), and no mount namespace copies it.
      renameImage(*spare, name);
      if (spare->loop >= 0) {
        std::lock_guard lk(mu_);
        loopOf_[name] = spare->loop;
      }
      return table_.put(name, std::move(spare->mount), false);
    }
    if (::mkdir(dir.c_str(), 0700) != 0) {
      Status st = sysError("mkdir " + dir);
      destroySpare(*spare);
      return st;
    }
    // One call attaches the ready filesystem; under the shared root_ it
    // propagates to the mount namespaces cloned from ours.
    if (::syscall(SYS_move_mount, spare->mount.get(), "", AT_FDCWD, dir.c_str(),
                  kMoveMountFEmptyPath) != 0) {
      Status st = sysError("move_mount to " + dir);
      ::rmdir(dir.c_str());
      destroySpare(*spare);
      return st;
    }
    spare->mount.reset();
    {
      std::lock_guard lk(mu_);
      if (spare->loop >= 0) loopOf_[name] = spare->loop;
    }
    renameImage(*spare, name);
    return Status::ok();
  }

  std::string dirOf(const std::string& name) const override {
    return table_.dirOf(name, root_ + "/" + name);
  }
  int diskFd(const std::string& name) const override { return table_.fd(name); }
  Status adoptDisk(const std::string& name, UniqueFd mount) override {
    RETURN_IF_ERROR(checkName(name));
    if (!isOwnExt4Root(mount.get(), root_)) {
      return Status(Code::kInvalidArgument, name + ": the adopted disk is not an ext4 root");
    }
    // Its loop device (an earlier edge's): attached until the disk goes.
    struct stat st;
    if (::fstat(mount.get(), &st) == 0) {
      if (int loop = loops_->indexOf(st.st_dev); loop >= 0) {
        loops_->adopt(loop);
        std::lock_guard lk(mu_);
        loopOf_[name] = loop;
      }
    }
    return table_.put(name, std::move(mount), true);
  }
  Result<UniqueFd> lend(const std::string& name) override { return table_.lend(name); }
  Status reclaim(const std::string& name, UniqueFd mount) override {
    return table_.reclaim(name, std::move(mount));
  }

  Status remove(const std::string& name) override {
    RETURN_IF_ERROR(checkName(name));
    if (auto disk = table_.take(name)) {
      // A detached disk: emptied and kept as a spare (never an adopted one:
      // that is the agent's read-only clone), or shut down and let go. The
      // filesystem then dies with the sandbox's overlay, and its loop
      // device (autoclear) with it.
      int loop = takeLoop(name);
      if (!disk->mount) {
        // Lent and never given back (its PID 1 died first): nothing to empty
        // or shut down; the filesystem dies with the sandbox's last
        // reference to it, and the loop device (autoclear) with it.
        if (loop >= 0) loops_->release(loop);
        if (::unlink(imageOf(name).c_str()) != 0 && errno != ENOENT) {
          return sysError("remove " + imageOf(name));
        }
        return Status::ok();
      }
      if (disk->readOnly && !disk->adopted) {
        // Lent and given back: writable again for a spare (the sandbox is
        // gone, so this fd is the mount's one user).
        if (Status w = setMountReadOnly(disk->mount.get(), false); w.isOk()) {
          disk->readOnly = false;
        } else {
          log::debug("disk quota: not recycling " + name + ": " + w.toString());
        }
      }
      int fd = disk->mount.get();
      std::string dir = "/proc/self/fd/" + std::to_string(fd);
      if (!disk->adopted && !disk->readOnly) {
        if (auto spare = recycle(name, dir, &disk->mount)) {
          spare->loop = loop;  // stays bound: the spare holds it
          log::debug("disk quota: " + name + "'s filesystem emptied, a spare again");
          std::lock_guard lk(mu_);
          spares_.emplace(spare->bytes, std::move(*spare));
          cv_.notify_all();
          return Status::ok();
        }
      }
      shutDownSandboxFsAt(fd, name, root_);
      disk->mount.reset();
      // The device unbinds once the sandbox's overlay lets the filesystem go
      // (moments from now); the pool reuses or removes it after that.
      if (loop >= 0) loops_->release(loop);
      if (::unlink(imageOf(name).c_str()) != 0 && errno != ENOENT) {
        return sysError("remove " + imageOf(name));
      }
      return Status::ok();
    }
    std::string dir = root_ + "/" + name;
    // Its loop device: known since create, or (a sandbox of an earlier edge)
    // read off the mounted filesystem.
    int loop = takeLoop(name);
    if (loop < 0) loop = loopOfDir(dir);
    if (auto spare = recycle(name, dir, nullptr)) {
      spare->loop = loop;  // stays bound: the spare holds it
      log::debug("disk quota: " + name + "'s filesystem emptied, a spare again");
      std::lock_guard lk(mu_);
      spares_.emplace(spare->bytes, std::move(*spare));
      cv_.notify_all();  // the filler drops it if its size stays idle
      return Status::ok();
    }
    // The sandbox's processes are gone: this was the filesystem's last use
    // (copies in other mount namespaces go by propagation), so it is shut
    // down now and its loop device (autoclear) detaches.
    shutDownSandboxFs(dir, root_);
    RETURN_IF_ERROR(unmountIfMounted(dir));
    // The device unbinds once the kernel drops the filesystem (moments from
    // now, in the background); the pool reuses or removes it after that.
    if (loop >= 0) loops_->release(loop);
    Status st = removeTree(dir);
    if (::unlink(imageOf(name).c_str()) != 0 && errno != ENOENT && st.isOk()) {
      st = sysError("remove " + imageOf(name));
    }
    return st;
  }

  void close() override {
    stopFiller();
    dropSpares();
    dropTemplates();
    if (bound_) {
      ::umount2(root_.c_str(), MNT_DETACH);
      bound_ = false;
    }
    if (!kept_) ::rmdir(disks_.c_str());  // fails (fine) while images remain
    if (ownLoops_) ownLoops_->close();
  }

  void keepForNextEdge() override {
    stopFiller();
    dropSpares();  // the next edge makes its own
    dropTemplates();
    bound_ = false;
    kept_ = true;
    if (ownLoops_) ownLoops_->close();  // the sandboxes' devices stay attached
  }

  // Takes over root_'s shared bind (adopt) or makes it, removes what an
  // earlier edge left that no running sandbox uses, checks the whole chain
  // works by making the first spare (or a probe disk), and starts the filler.
  Status open(bool adopt) {
    RETURN_IF_ERROR(makeDirs(disks_, 0700));
    if (adopt && isMountPoint(root_)) {
      // An edge that mounted disks on <root>/<name> left its sandboxes
      // there: they keep that place until destroyed.
      bound_ = true;
    } else if (!detach_) {
      RETURN_IF_ERROR(bindShared(root_));
      bound_ = true;
    }
    removeLeftovers();
    // The first spare (or a probe) shows now whether the whole chain works.
    auto sp = makeSpare(wanted_.empty() ? kProbeBytes : wanted_.front(), "");
    if (!sp.isOk()) return std::move(sp).takeStatus();
    if (wanted_.empty()) {
      destroySpare(*sp);
    } else {
      spares_.emplace(sp->bytes, std::move(sp).value());
    }
    filler_ = std::thread([this] { fillLoop(); });
    return Status::ok();
  }

 private:
  struct Spare {
    int64_t bytes = 0;
    std::string image;
    UniqueFd mount;  // fsmount(2): mounted, attached nowhere
    int loop = -1;   // its loop device's index in loops_ (-1: unknown)
  };

  // The loop device recorded for `name` at create or adoption (forgotten
  // here); -1 when none is.
  int takeLoop(const std::string& name) {
    std::lock_guard lk(mu_);
    auto it = loopOf_.find(name);
    if (it == loopOf_.end()) return -1;
    int loop = it->second;
    loopOf_.erase(it);
    return loop;
  }

  // The index of the loop device under the sandbox filesystem mounted on
  // `dir`; -1 when none is (or it is not a sandbox's own ext4).
  int loopOfDir(const std::string& dir) {
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (!fd || !isOwnExt4Root(fd.get(), root_) || ::fstat(fd.get(), &st) != 0) return -1;
    return loops_->indexOf(st.st_dev);
  }

  static int64_t roundBytes(int64_t bytes) { return (bytes + kBlock - 1) / kBlock * kBlock; }

  void renameImage(const Spare& spare, const std::string& name) {
    if (spare.image != imageOf(name) && ::rename(spare.image.c_str(), imageOf(name).c_str()) != 0) {
      // Mounted and usable; only its image keeps the spare's name, which the
      // next start removes as stale.
      log::warn("disk quota: rename " + spare.image + ": " + std::strerror(errno));
    }
  }
  std::string imageOf(const std::string& name) const { return disks_ + "/" + name + ".img"; }

  // Most recently used first; at most sizesKept. Under mu_.
  void noteSize(int64_t bytes) {
    if (eo_.sparesPerSize <= 0 || eo_.sizesKept <= 0) return;
    lastUse_[bytes] = monoSeconds();
    auto it = std::find(wanted_.begin(), wanted_.end(), bytes);
    if (it != wanted_.end()) wanted_.erase(it);
    wanted_.insert(wanted_.begin(), bytes);
    if (int(wanted_.size()) > eo_.sizesKept) wanted_.resize(size_t(eo_.sizesKept));
  }

  // A sparse image of `bytes` formatted as ext4 and attached to a loop
  // device, its filesystem mounted but attached nowhere yet (fsmount): no
  // mount namespace has a copy, and one move_mount puts it in place. Its
  // root is 0700 (only the edge reaches in) without lost+found. `image`
  // empty: a spare's name. On error nothing is left.
  Result<Spare> makeSpare(int64_t bytes, std::string image) {
    Spare s;
    s.bytes = bytes;
    s.image = image.empty() ? disks_ + "/spare-" + std::to_string(nextSpare_.fetch_add(1)) + ".img"
                            : std::move(image);
    auto undo = [&](Status st) {
      s.mount.reset();  // the filesystem goes, and the (autoclear) device with it
      ::unlink(s.image.c_str());
      if (s.loop >= 0) loops_->release(s.loop);
      s.loop = -1;
      return st;
    };
    auto tmpl = templateOf(bytes);
    if (!tmpl.isOk()) return std::move(tmpl).takeStatus();
    {
      // O_EXCL: never reuse (nor, on error, remove) a file we did not make.
      UniqueFd out(::open(s.image.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!out) return sysError("create " + s.image);
      Status cp = copySparse(*tmpl, out.get(), bytes);
      if (!cp.isOk()) return undo(cp.withContext("copy " + *tmpl + " to " + s.image));
    }
    // Direct I/O keeps the host's page cache from holding a second copy of
    // every block, where the backing filesystem allows it.
    auto lease = loops_->attach(s.image, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO);
    if (!lease.isOk() && lease.status().sysErrno() == EINVAL) {
      lease = loops_->attach(s.image, LO_FLAGS_AUTOCLEAR);
    }
    if (!lease.isOk()) return undo(std::move(lease).takeStatus());
    s.loop = lease->index;
    UniqueFd held = std::move(lease->fd);
    const std::string* dev = &lease->path;
    // The filesystem holds the device from here; closing `held` (on return)
    // leaves it as its only user, so the device goes with the filesystem.
    UniqueFd fsfd(int(::syscall(SYS_fsopen, "ext4", kFsopenCloexec)));
    if (!fsfd) return undo(sysError("fsopen ext4"));
    // Online discard: blocks a sandbox frees go back to the host at once (the
    // loop device punches holes in the sparse image), not only at destroy.
    if (::syscall(SYS_fsconfig, fsfd.get(), kFsconfigSetString, "source", dev->c_str(), 0) != 0 ||
        ::syscall(SYS_fsconfig, fsfd.get(), kFsconfigSetFlag, "discard", nullptr, 0) != 0 ||
        ::syscall(SYS_fsconfig, fsfd.get(), kFsconfigCmdCreate, nullptr, nullptr, 0) != 0) {
      return undo(sysError("mount ext4 " + *dev + " (" + s.image + ")"));
    }
    s.mount.reset(int(::syscall(SYS_fsmount, fsfd.get(), kFsmountCloexec, kMountAttrNoatime)));
    if (!s.mount) return undo(sysError("fsmount ext4 " + *dev));
    UniqueFd top(::openat(s.mount.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!top) return undo(sysError("open the root of " + s.image));
    if (::fchmod(top.get(), 0700) != 0) return undo(sysError("chmod the root of " + s.image));
    if (::unlinkat(top.get(), "lost+found", AT_REMOVEDIR) != 0 && errno != ENOENT) {
      return undo(sysError("rmdir lost+found in " + s.image));
    }
    if (auto u = usageOf(top.get())) {
      std::lock_guard lk(mu_);
      fresh_[bytes] = *u;
    }
    return s;
  }

  // The filesystem of the removed sandbox `name`, mounted on `dir`, emptied
  // and detached as a spare of its size; nullopt (nothing changed that
  // matters: the caller throws it away) when it is not worth keeping or
  // anything fails. The sandbox's processes are gone; no one else writes
  // there. What must not outlive the sandbox: its files (every entry
  // removed, or it is not kept: removeTree fails on what it cannot remove,
  // and on a mount it will not cross), the ownership and mode the create
  // gave the root (reset), its mount's place and propagation (a private
  // detached clone, like a new spare's). Inodes that the sandbox's dying
  // mount namespace still holds (its overlay's upper and work dirs) are
  // freed moments later, when that namespace is gone; at most
  // recycleMaxBytes / recycleMaxInodes, checked before emptying.
  //
  // `held`: a detached disk's mount fd (`dir` is /proc/self/fd/N): emptied
  // in place, and on success moved into the spare as it is (no clone, no
  // unmount); on failure left to the caller.
  std::optional<Spare> recycle(const std::string& name, const std::string& dir, UniqueFd* held) {
    if (eo_.recycledPerSize <= 0) return std::nullopt;
    struct stat img;
    if (::stat(imageOf(name).c_str(), &img) != 0) return std::nullopt;
    int64_t bytes = img.st_size;
    Usage fresh;
    {
      std::lock_guard lk(mu_);
      auto f = fresh_.find(bytes);
      if (stop_ || f == fresh_.end() ||
          std::find(wanted_.begin(), wanted_.end(), bytes) == wanted_.end() ||
          int(spares_.count(bytes)) >= eo_.recycledPerSize) {
        return std::nullopt;
      }
      fresh = f->second;
    }
    UniqueFd top(held ? ::openat(held->get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                      : ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!top || !isOwnExt4Root(top.get(), root_)) return std::nullopt;
    auto used = usageOf(top.get());
    if (!used || used->inodes > fresh.inodes + uint64_t(eo_.recycleMaxInodes) ||
        used->bytes > fresh.bytes + uint64_t(eo_.recycleMaxBytes)) {
      return std::nullopt;
    }
    std::vector<std::string> entries;
    int listFd = ::openat(top.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (DIR* d = listFd >= 0 ? ::fdopendir(listFd) : nullptr) {
      while (auto* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") entries.push_back(std::move(n));
      }
      ::closedir(d);
    } else {
      if (listFd >= 0) ::close(listFd);
      return std::nullopt;
    }
    for (auto& n : entries) {
      // removeTree never follows a symlink nor crosses into another mount.
      if (Status st = removeTree(dir + "/" + n); !st.isOk()) {
        log::debug("disk quota: not recycling " + name + ": " + st.toString());
        return std::nullopt;
      }
    }
    if (::fchown(top.get(), 0, 0) != 0 || ::fchmod(top.get(), 0700) != 0) return std::nullopt;
    Spare s;
    s.bytes = bytes;
    if (held) {
      s.mount = std::move(*held);
      s.image = disks_ + "/spare-" + std::to_string(nextSpare_.fetch_add(1)) + ".img";
      if (::rename(imageOf(name).c_str(), s.image.c_str()) != 0) s.image = imageOf(name);
      return s;
    }
    s.mount.reset(
        int(::syscall(SYS_open_tree, AT_FDCWD, dir.c_str(), kOpenTreeClone | kOpenTreeCloexec)));
    if (!s.mount) return std::nullopt;
    MountAttr attr;
    attr.propagation = MS_PRIVATE;
    if (::syscall(SYS_mount_setattr, s.mount.get(), "", AT_EMPTY_PATH | kAtRecursive, &attr,
                  sizeof attr) != 0) {
      return std::nullopt;
    }
    top.reset();
    // The sandbox's place goes (and its copies in other mount namespaces by
    // propagation); the clone keeps the filesystem and its loop device.
    if (::umount2(dir.c_str(), MNT_DETACH) != 0) return std::nullopt;
    ::rmdir(dir.c_str());
    s.image = disks_ + "/spare-" + std::to_string(nextSpare_.fetch_add(1)) + ".img";
    if (::rename(imageOf(name).c_str(), s.image.c_str()) != 0) s.image = imageOf(name);
    return s;
  }

  // The formatted image of `bytes` that disks are copied from: mkfs.ext4
  // runs once per size (~20-40 ms and a process), a copy of its few written
  // blocks (~0.1-0.7 MiB) costs well under a millisecond. Every copy has the
  // template's UUID, which ext4 does not mind (mounts go by device).
  Result<std::string> templateOf(int64_t bytes) {
    std::lock_guard lk(templateMu_);
    std::string path = disks_ + "/template-" + std::to_string(bytes) + ".img";
    if (templates_.count(bytes)) return path;
    std::string tmp = path + ".tmp";
    ::unlink(tmp.c_str());
    {
      UniqueFd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!fd) return sysError("create " + tmp);
      if (::ftruncate(fd.get(), bytes) != 0) {
        Status st = sysError("truncate " + tmp);
        ::unlink(tmp.c_str());
        return st;
      }
    }
    Status mk = image::runCommand(ext4MkfsArgs(mkfs_, tmp, bytes));
    if (!mk.isOk()) {
      ::unlink(tmp.c_str());
      return unavailable("mkfs.ext4 " + tmp + ": " + mk.message());
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      Status st = sysError("rename " + tmp);
      ::unlink(tmp.c_str());
      return st;
    }
    templates_.insert(bytes);
    return path;
  }

  // Makes the empty file `out` a sparse file of `bytes` holding the data
  // extents of `from`.
  static Status copySparse(const std::string& from, int out, int64_t bytes) {
    UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
    if (!in) return sysError("open " + from);
    if (::ftruncate(out, bytes) != 0) return sysError("truncate");
    off_t pos = 0;
    while (pos < bytes) {
      off_t data = ::lseek(in.get(), pos, SEEK_DATA);
      if (data < 0) {
        if (errno == ENXIO) break;  // only a hole is left
        return sysError("seek data in " + from);
      }
      off_t hole = ::lseek(in.get(), data, SEEK_HOLE);
      if (hole < 0) return sysError("seek hole in " + from);
      loff_t src = data, dst = data;
      while (src < hole) {
        ssize_t n = ::copy_file_range(in.get(), &src, out, &dst, size_t(hole - src), 0);
        if (n < 0) return sysError("copy_file_range");
        if (n == 0) return Status(Code::kInternal, from + " shrank while copied");
      }
      pos = hole;
    }
    return Status::ok();
  }

  void destroySpare(Spare& s) {
    s.mount.reset();
    ::unlink(s.image.c_str());
    if (s.loop >= 0) loops_->release(s.loop);
    s.loop = -1;
  }

  // Keeps sparesPerSize spares of each wanted size, and drops spares of sizes
  // no longer wanted. Runs at a lower priority: the request path comes first.
  void fillLoop() {
    ::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), 10);
    std::unique_lock lk(mu_);
    while (!stop_) {
      std::optional<Spare> excess;
      // Past sparesPerSize (recycled ones), a size's spares last only while
      // it is in use: each holds a loop device, a kernel thread and ~135 KiB.
      double now = monoSeconds(), wake = 0;
      for (auto it = spares_.begin(); it != spares_.end(); ++it) {
        bool unwanted = std::find(wanted_.begin(), wanted_.end(), it->first) == wanted_.end();
        bool surplus = false;
        if (!unwanted && int(spares_.count(it->first)) > eo_.sparesPerSize) {
          double idleUntil = lastUse_[it->first] + eo_.recycledIdleS;
          surplus = now >= idleUntil;
          if (!surplus && (wake == 0 || idleUntil < wake)) wake = idleUntil;
        }
        if (unwanted || surplus) {
          excess = std::move(it->second);
          spares_.erase(it);
          break;
        }
      }
      if (excess) {
        lk.unlock();
        destroySpare(*excess);
        lk.lock();
        continue;
      }
      int64_t need = 0;
      for (int64_t bytes : wanted_) {
        if (int(spares_.count(bytes)) < eo_.sparesPerSize) {
          need = bytes;
          break;
        }
      }
      if (need == 0) {
        if (wake > 0) {
          cv_.wait_for(lk, std::chrono::duration<double>(wake - now + 0.01));
        } else {
          cv_.wait(lk);
        }
        continue;
      }
      lk.unlock();
      auto sp = makeSpare(need, "");
      lk.lock();
      if (!sp.isOk()) {
        log::error("disk quota spare: " + sp.status().toString());
        cv_.wait_for(lk, std::chrono::seconds(1));
        continue;
      }
      if (stop_) {
        lk.unlock();
        destroySpare(*sp);
        lk.lock();
        break;
      }
      spares_.emplace(sp->bytes, std::move(sp).value());
    }
  }

  void stopFiller() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (filler_.joinable()) filler_.join();
  }

  void dropTemplates() {
    std::lock_guard lk(templateMu_);
    for (int64_t b : templates_) {
      ::unlink((disks_ + "/template-" + std::to_string(b) + ".img").c_str());
    }
    templates_.clear();
  }

  void dropSpares() {
    std::multimap<int64_t, Spare> spares;
    {
      std::lock_guard lk(mu_);
      spares.swap(spares_);
    }
    for (auto& [bytes, s] : spares) destroySpare(s);
  }

  // A crashed or upgraded edge's spares (their mounts were attached nowhere,
  // so they went with its fds) and images no mounted sandbox uses (their
  // mounts went with the crash cleanup, or the sandbox's removal).
  // Sandboxes being re-adopted keep theirs (keep_; a detached disk is
  // mounted nowhere), as do those still mounted on <root>/<name> (an edge
  // that mounted them there). One read of the mount table, not one per image.
  void removeLeftovers() {
    std::set<std::string> mounted;
    for (auto& mp : mountsUnder(root_)) mounted.insert(mp);
    if (DIR* d = ::opendir(disks_.c_str())) {
      std::vector<std::string> stale;
      while (auto* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n == "." || n == "..") continue;
        std::string id = n.size() > 4 ? n.substr(0, n.size() - 4) : "";
        bool inUse = n.size() > 4 && n.compare(n.size() - 4, 4, ".img") == 0 &&
                     !startsWith(n, "spare-") &&
                     (keep_.count(id) != 0 || mounted.count(root_ + "/" + id) != 0);
        if (!inUse) {
          stale.push_back(disks_ + "/" + n);
          continue;
        }
        // A sandbox being re-adopted on <root>/<name>: its device is attached
        // until removed (a detached one's is adopted with its disk, adoptDisk).
        if (mounted.count(root_ + "/" + id) != 0) {
          if (int loop = loopOfDir(root_ + "/" + id); loop >= 0) {
            loops_->adopt(loop);
            std::lock_guard lk(mu_);
            loopOf_[id] = loop;
          }
        }
      }
      ::closedir(d);
      for (auto& p : stale) {
        if (::unlink(p.c_str()) == 0) log::info("disk quota: removed stale image " + p);
      }
    }
  }

  const std::string root_;
  const std::string disks_;
  const std::string mkfs_;
  const Ext4QuotaOptions eo_;
  // The loop devices: the edge's pool, or (no pool given: tests) our own.
  const std::unique_ptr<LoopPool> ownLoops_;
  LoopPool* const loops_;
  const bool detach_;                 // disks stay detached (table_), see disk_quota.h
  const std::set<std::string> keep_;  // re-adopted sandboxes (their images stay)
  DiskTable table_;                   // detached disks by sandbox name
  bool bound_ = false;  // root_ bound on itself, shared
  bool kept_ = false;   // keepForNextEdge: images stay for the next edge
  std::atomic<uint64_t> nextSpare_{0};
  std::mutex templateMu_;        // guards templates_ (held while one is made)
  std::set<int64_t> templates_;  // sizes with a template image
  std::thread filler_;
  std::mutex mu_;  // guards spares_, wanted_, fresh_, lastUse_, loopOf_, stop_
  std::condition_variable cv_;
  std::multimap<int64_t, Spare> spares_;  // by size in bytes
  std::vector<int64_t> wanted_;           // sizes to keep spares of, newest first
  std::map<int64_t, Usage> fresh_;        // by size: a new spare's usage
  std::map<int64_t, double> lastUse_;     // by size: monoSeconds() of its last create
  std::map<std::string, int> loopOf_;     // by sandbox: its loop device's index
  bool stop_ = false;
};

}  // namespace

std::vector<std::string> ext4MkfsArgs(const std::string& mkfs, const std::string& image,
                                      int64_t bytes) {
  // -T default: 4 KiB blocks and one inode per 16 KiB even below 512 MiB
  // (where mke2fs would pick 1 KiB blocks). mke2fs discards (punches) the
  // fresh file, so it knows the inode tables read as zeros and marks them
  // so: no lazy zeroing of them after mount, and the image stays sparse.
  return {mkfs,           "-q",   "-F",      "-T",  "default",
          "-b",           "4096", "-m",      "0",   "-O",
          "^has_journal", "-L",   "dsec-sb", image, std::to_string(bytes / 1024) + "k"};
}

Result<std::unique_ptr<DiskQuota>> openExt4Quota(const DiskQuotaOptions& opts,
                                                 const std::string& disksDir,
                                                 const Ext4QuotaOptions& eo) {
  if (!kernelHasFilesystem("ext4")) return unavailable("the kernel has no ext4");
  if (::access("/dev/loop-control", R_OK | W_OK) != 0) {
    return unavailable("no loop devices (/dev/loop-control: " + std::string(std::strerror(errno)) +
                       ")");
  }
  std::string mkfs = findProgram("mkfs.ext4");
  if (mkfs.empty()) return unavailable("mkfs.ext4 not found (package e2fsprogs)");
  if (disksDir.empty()) return unavailable("no directory for the images configured");
  std::unique_ptr<LoopPool> own;
  if (!opts.loops) {
    // No edge pool (tests): one of our own. With no ledger, it attributes
    // the devices found bound to images in disksDir (an adopted sandbox's),
    // so they are removed once let go.
    LoopPoolOptions lo;
    if (char* real = ::realpath(disksDir.c_str(), nullptr)) {
      lo.ownedPrefix = std::string(real) + "/";
      ::free(real);
    }
    ASSIGN_OR_RETURN(own, LoopPool::open(lo));
  }
  auto q = std::make_unique<Ext4Quota>(opts.root, disksDir, std::move(mkfs), eo, opts.detach,
                                       opts.keep, opts.loops, std::move(own));
  RETURN_IF_ERROR(q->open(opts.adopt));  // on error q's destructor undoes it
  return std::unique_ptr<DiskQuota>(std::move(q));
}

}  // namespace dsec::edge
