#include "edge/disk_quota.h"

#include "edge/image/layer_cache.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/fd.h"
#include "common/log.h"
#include "common/util.h"
#include "edge/btrfs_quota.h"
#include "edge/ext4_quota.h"
#include "edge/userns.h"
#include "edge/xfs_quota.h"

namespace dsec::edge {

const char* diskQuotaKindName(DiskQuotaKind kind) {
  switch (kind) {
    case DiskQuotaKind::kXfs: return "xfs";
    case DiskQuotaKind::kExt4: return "ext4";
    case DiskQuotaKind::kBtrfs: return "btrfs";
    case DiskQuotaKind::kTmpfs: return "tmpfs";
    case DiskQuotaKind::kNone: return "none";
  }
  return "?";
}

Result<std::vector<DiskQuotaKind>> diskQuotaCandidates(std::string_view mode) {
  // Disk-backed first: a tmpfs turns disk_mb into memory, which a sandbox
  // with disk_mb > memory_mb (the defaults: 1024 > 512) hits as an OOM kill.
  // xfs and ext4 before btrfs: a write over their limit fails with ENOSPC
  // (what a full disk says), over a btrfs qgroup's with EDQUOT. xfs before
  // ext4: one filesystem for the node, where ext4 costs a loop device and a
  // mounted filesystem per sandbox (docs/container-backend.md has figures).
  if (mode == "auto") {
    return std::vector{DiskQuotaKind::kXfs, DiskQuotaKind::kExt4, DiskQuotaKind::kBtrfs,
                       DiskQuotaKind::kTmpfs};
  }
  if (mode == "xfs") return std::vector{DiskQuotaKind::kXfs};
  if (mode == "ext4") return std::vector{DiskQuotaKind::kExt4};
  if (mode == "btrfs") return std::vector{DiskQuotaKind::kBtrfs};
  if (mode == "tmpfs") return std::vector{DiskQuotaKind::kTmpfs};
  if (mode == "none") return std::vector{DiskQuotaKind::kNone};
  return invalidArg("disk-quota", "unknown disk quota mode '" + std::string(mode) +
                                      "' (auto, xfs, ext4, btrfs, tmpfs or none)");
}

Result<int64_t> poolImageBytes(int64_t requested, int64_t freeBytes) {
  int64_t bytes = requested > 0 ? requested : freeBytes;
  bytes &= ~((1ll << 20) - 1);
  if (bytes < kMinPoolBytes) {
    return Status(Code::kFailedPrecondition,
                  "the sandbox pool would be " + humanBytes(bytes) + " (" +
                      (requested > 0 ? "as configured" : "the free space") + "), less than " +
                      humanBytes(kMinPoolBytes));
  }
  return bytes;
}

std::string tmpfsMountData(int64_t bytes, int64_t pageSize) {
  int64_t pages = (bytes + pageSize - 1) / pageSize;
  return "size=" + std::to_string(pages * pageSize) + ",mode=0700";
}

std::string humanBytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0 || v >= 100 || v == double(int64_t(v))) {
    std::snprintf(buf, sizeof buf, "%.0f %s", v, kUnits[u]);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[u]);
  }
  return buf;
}

bool isMountPoint(const std::string& path) {
  for (auto& mp : mountsUnder(path)) {
    if (mp == path) return true;
  }
  return false;
}

Status bindShared(const std::string& dir) {
  if (::mount(dir.c_str(), dir.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    return sysError("bind " + dir);
  }
  if (::mount(nullptr, dir.c_str(), nullptr, MS_SHARED, nullptr) != 0) {
    Status st = sysError("make-shared " + dir);
    ::umount2(dir.c_str(), MNT_DETACH);
    return st;
  }
  return Status::ok();
}

Status DiskTable::put(const std::string& name, UniqueFd mount, bool adopted) {
  std::lock_guard lk(mu_);
  auto [it, added] = disks_.try_emplace(name);
  if (!added) return Status(Code::kAlreadyExists, name + " has a disk already");
  it->second.mount = std::move(mount);
  it->second.adopted = adopted;
  it->second.readOnly = adopted;  // the sandbox's own (lend's), read-only
  return Status::ok();
}

bool DiskTable::has(const std::string& name) const {
  std::lock_guard lk(mu_);
  return disks_.count(name) != 0;
}

std::optional<DiskTable::Disk> DiskTable::take(const std::string& name) {
  std::lock_guard lk(mu_);
  auto it = disks_.find(name);
  if (it == disks_.end()) return std::nullopt;
  Disk d = std::move(it->second);
  disks_.erase(it);
  return d;
}

Result<UniqueFd> DiskTable::lend(const std::string& name) {
  std::lock_guard lk(mu_);
  auto it = disks_.find(name);
  if (it == disks_.end() || !it->second.mount) {
    return Status(Code::kNotFound, name + " has no detached disk");
  }
  if (!it->second.readOnly) {
    RETURN_IF_ERROR(setMountReadOnly(it->second.mount.get(), true).withContext(name));
    it->second.readOnly = true;
  }
  return std::move(it->second.mount);
}

Status DiskTable::reclaim(const std::string& name, UniqueFd mount) {
  std::lock_guard lk(mu_);
  auto it = disks_.find(name);
  if (it == disks_.end() || it->second.mount) {
    return Status(Code::kNotFound, name + " has no lent disk");
  }
  it->second.mount = std::move(mount);
  it->second.readOnly = true;
  return Status::ok();
}

int DiskTable::fd(const std::string& name) const {
  std::lock_guard lk(mu_);
  auto it = disks_.find(name);
  return it == disks_.end() ? -1 : it->second.mount.get();
}

std::string DiskTable::dirOf(const std::string& name, const std::string& fallback) const {
  int f = fd(name);
  if (f < 0) return fallback;
  // Our pid, not "self": mkfs.erofs (pack_diff) is handed this path too.
  return "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(f);
}

size_t DiskTable::size() const {
  std::lock_guard lk(mu_);
  return disks_.size();
}

namespace {

constexpr unsigned kFsopenCloexec = 1;      // FSOPEN_CLOEXEC
constexpr unsigned kFsconfigSetString = 1;  // FSCONFIG_SET_STRING
constexpr unsigned kFsconfigCmdCreate = 6;  // FSCONFIG_CMD_CREATE
constexpr unsigned kFsmountCloexec = 1;     // FSMOUNT_CLOEXEC

// A detached tmpfs (fsmount): `data` as "key=value,key=value".
Result<UniqueFd> detachedTmpfs(const std::string& data) {
  UniqueFd fs(int(::syscall(SYS_fsopen, "tmpfs", kFsopenCloexec)));
  if (!fs) return sysError("fsopen tmpfs");
  for (const auto& kv : splitString(data, ',')) {
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    if (::syscall(SYS_fsconfig, fs.get(), kFsconfigSetString, key.c_str(), value.c_str(), 0) != 0) {
      return sysError("tmpfs " + kv);
    }
  }
  if (::syscall(SYS_fsconfig, fs.get(), kFsconfigCmdCreate, nullptr, nullptr, 0) != 0) {
    return sysError("create tmpfs");
  }
  UniqueFd m(int(::syscall(SYS_fsmount, fs.get(), kFsmountCloexec, 0)));
  if (!m) return sysError("fsmount tmpfs");
  return m;
}

}  // namespace

Status probeDetachedDisks() {
  ASSIGN_OR_RETURN(UniqueFd tmp, detachedTmpfs("size=1048576,mode=0700"));
  for (const char* d : {"l", "u", "w"}) {
    if (::mkdirat(tmp.get(), d, 0700) != 0) return sysError("mkdir in a detached tmpfs");
  }
  std::string dir = "/proc/self/fd/" + std::to_string(tmp.get());
  auto ov = makeOverlay(std::vector<std::string>{dir + "/l"}, dir + "/u", dir + "/w");
  if (!ov.isOk()) {
    return std::move(ov).takeStatus().withContext("overlay over a detached mount (Linux >= 6.15)");
  }
  return Status::ok();
}

namespace {

Status checkName(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return invalidArg("id", "bad sandbox directory name '" + name + "'");
  }
  return Status::ok();
}

// A tmpfs per sandbox. <root> is bound on itself and made shared, so a tmpfs
// mounted on <root>/<name> after an agent was cloned (the spare pool) still
// appears in that agent's mount namespace (until it makes its tree private).
//
// Detached (DiskQuotaOptions::detach): each tmpfs is made with fsmount(2)
// and held by fd, attached nowhere; <root> is not bound.
class TmpfsQuota : public DiskQuota {
 public:
  TmpfsQuota(std::string root, bool detach) : root_(std::move(root)), detach_(detach) {}
  ~TmpfsQuota() override { close(); }

  Status open(bool adopt) {
    // The earlier edge's shared bind is still there when its sandboxes are
    // (sandboxes of an edge that mounted them on <root>/<name>).
    if (adopt && isMountPoint(root_)) {
      bound_ = true;
      return Status::ok();
    }
    if (detach_) {
      // A kernel refusing size= shows now, not at the first create.
      auto probe = detachedTmpfs(tmpfsMountData(kMinProbeBytes, ::sysconf(_SC_PAGESIZE)));
      return probe.isOk() ? Status::ok() : probe.status();
    }
    RETURN_IF_ERROR(bindShared(root_));
    bound_ = true;
    // A kernel without tmpfs (or one refusing size=) shows now, not at the
    // first create.
    std::string probe = root_ + "/.probe";
    ::rmdir(probe.c_str());
    RETURN_IF_ERROR(mountAt(probe, kMinProbeBytes));
    ::umount2(probe.c_str(), MNT_DETACH);
    ::rmdir(probe.c_str());
    return Status::ok();
  }

  DiskQuotaKind kind() const override { return DiskQuotaKind::kTmpfs; }
  std::string describe() const override {
    if (detach_) return "tmpfs, one per sandbox, detached (RAM, charged to its memory cgroup)";
    return "tmpfs, one per sandbox under " + root_ + " (RAM, charged to its memory cgroup)";
  }
  int overLimitErrno() const override { return ENOSPC; }

  Status create(const std::string& name, int64_t bytes) override {
    RETURN_IF_ERROR(checkName(name));
    if (detach_) {
      if (disks_.has(name)) return Status(Code::kAlreadyExists, name + " has a disk already");
      ASSIGN_OR_RETURN(UniqueFd m,
                       detachedTmpfs(tmpfsMountData(bytes, ::sysconf(_SC_PAGESIZE))));
      return disks_.put(name, std::move(m), false);
    }
    return mountAt(root_ + "/" + name, bytes);
  }

  std::string dirOf(const std::string& name) const override {
    return disks_.dirOf(name, root_ + "/" + name);
  }
  int diskFd(const std::string& name) const override { return disks_.fd(name); }
  Status adoptDisk(const std::string& name, UniqueFd mount) override {
    RETURN_IF_ERROR(checkName(name));
    return disks_.put(name, std::move(mount), true);
  }
  Result<UniqueFd> lend(const std::string& name) override { return disks_.lend(name); }
  Status reclaim(const std::string& name, UniqueFd mount) override {
    return disks_.reclaim(name, std::move(mount));
  }

  Status remove(const std::string& name) override {
    RETURN_IF_ERROR(checkName(name));
    // Its pages go once the sandbox's overlay (its mount namespace) and our fd
    // have let go.
    if (disks_.take(name)) return Status::ok();
    std::string dir = root_ + "/" + name;
    // EINVAL: not a mount point (a failed create's leftover, or none).
    if (::umount2(dir.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) {
      return sysError("umount " + dir);
    }
    return removeTree(dir);
  }

  void close() override {
    if (bound_ && ::umount2(root_.c_str(), MNT_DETACH) == 0) bound_ = false;
  }
  void keepForNextEdge() override { bound_ = false; }

 private:
  static constexpr int64_t kMinProbeBytes = 1 << 20;

  Status mountAt(const std::string& dir, int64_t bytes) {
    if (::mkdir(dir.c_str(), 0700) != 0) return sysError("mkdir " + dir);
    std::string data = tmpfsMountData(bytes, ::sysconf(_SC_PAGESIZE));
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, data.c_str()) != 0) {
      Status st = sysError("mount tmpfs on " + dir);
      ::rmdir(dir.c_str());
      return st;
    }
    return Status::ok();
  }

  const std::string root_;
  const bool detach_;
  bool bound_ = false;
  DiskTable disks_;
};

// Plain directories: nothing enforced.
class NoQuota : public DiskQuota {
 public:
  explicit NoQuota(std::string root) : root_(std::move(root)) {}
  DiskQuotaKind kind() const override { return DiskQuotaKind::kNone; }
  std::string describe() const override { return "none (disk_mb is not enforced)"; }
  int overLimitErrno() const override { return 0; }
  Status create(const std::string& name, int64_t) override {
    RETURN_IF_ERROR(checkName(name));
    std::string dir = root_ + "/" + name;
    if (::mkdir(dir.c_str(), 0700) != 0) return sysError("mkdir " + dir);
    return Status::ok();
  }
  Status remove(const std::string& name) override {
    RETURN_IF_ERROR(checkName(name));
    return removeTree(root_ + "/" + name);
  }
  std::string dirOf(const std::string& name) const override { return root_ + "/" + name; }
  void close() override {}
  void keepForNextEdge() override {}

 private:
  const std::string root_;
};

// Where the ext4 mechanism keeps its images: beside the pool image of the
// other mechanisms (<data>/edge/sandbox-disks by default).
std::string ext4DisksDir(const DiskQuotaOptions& opts) {
  if (opts.poolImage.empty()) return opts.root + ".disks";
  auto slash = opts.poolImage.rfind('/');
  return (slash == std::string::npos ? std::string(".") : opts.poolImage.substr(0, slash)) +
         "/sandbox-disks";
}

Result<std::unique_ptr<DiskQuota>> openKind(DiskQuotaKind kind, const DiskQuotaOptions& opts) {
  switch (kind) {
    case DiskQuotaKind::kXfs: return openXfsQuota(opts);
    case DiskQuotaKind::kExt4: return openExt4Quota(opts, ext4DisksDir(opts));
    case DiskQuotaKind::kBtrfs: return openBtrfsQuota(opts);
    case DiskQuotaKind::kTmpfs: {
      auto q = std::make_unique<TmpfsQuota>(opts.root, opts.detach);
      RETURN_IF_ERROR(q->open(opts.adopt));
      return std::unique_ptr<DiskQuota>(std::move(q));
    }
    case DiskQuotaKind::kNone: return std::unique_ptr<DiskQuota>(new NoQuota(opts.root));
  }
  return internalError("unknown disk quota kind");
}

}  // namespace

Result<std::unique_ptr<DiskQuota>> openDiskQuota(const DiskQuotaOptions& opts) {
  ASSIGN_OR_RETURN(auto kinds, diskQuotaCandidates(opts.mode));
  std::string reasons;
  for (DiskQuotaKind kind : kinds) {
    auto q = openKind(kind, opts);
    if (q.isOk()) {
      if (kind == DiskQuotaKind::kNone) log::warn("disk quota off: disk_mb is not enforced");
      if (kind == DiskQuotaKind::kTmpfs && opts.mode == "auto") {
        log::warn("disk quota falls back to tmpfs: sandbox files take RAM (" + reasons + ")");
      }
      return q;
    }
    std::string why = std::string(diskQuotaKindName(kind)) + ": " + q.status().message();
    log::info("disk quota: " + why);
    reasons += (reasons.empty() ? "" : "; ") + why;
  }
  return Status(Code::kFailedPrecondition, "no disk quota mechanism works here (" + reasons + ")");
}

}  // namespace dsec::edge
