// Per-sandbox disk quota on the writable layer. Each sandbox's directory
// <root>/<name> (its overlay upper, work and mount-point dirs) is made in a
// place whose size is bounded by the sandbox's disk_mb, so writes past it fail
// inside that sandbox only, and deleting files frees room again.
//
// Mechanisms, chosen once per edge (openDiskQuota) in this order for "auto":
//   xfs    one XFS for the node (a sparse image file, loop-mounted on <root>
//          with prjquota, made fresh at every start). A directory per sandbox
//          in a project of its own (FS_XFLAG_PROJINHERIT) with a hard block
//          limit (quotactl Q_XSETQLIM). Disk-backed; over the limit a write
//          fails with ENOSPC ("No space left on device"), as the issue asks.
//          Needs a kernel built with CONFIG_XFS_QUOTA.
//   ext4   an ext4 of its own per sandbox (a sparse image file on a loop
//          device, mounted on <root>/<name>), formatted and mounted ahead of
//          demand by a background thread (ext4_quota.h). Disk-backed, exact
//          ENOSPC, on kernels without quota support; costs a loop device and
//          a superblock per sandbox.
//   btrfs  one btrfs for the node: <root> itself when it is already a btrfs
//          with quotas enabled, else a sparse image file mounted on <root>
//          through a loop device, made fresh at every start. A subvolume per
//          sandbox, created with its qgroup limit in the same ioctl (simple
//          quotas on Linux 6.7+, full qgroups before). Disk-backed; over the
//          limit a write fails with EDQUOT ("Disk quota exceeded").
//   tmpfs  a tmpfs of size=disk_mb per sandbox mounted on <root>/<name> (and
//          <root> a shared mount, so agents cloned earlier see it). Exact
//          ENOSPC, but RAM-backed: the pages are charged to the sandbox's
//          memory cgroup. Needs only tmpfs, so it is the fallback.
//   none   plain directories: disk_mb is not enforced (only when asked for).
//
// Where the kernel allows it (probeDetachedDisks: Linux >= 6.15), the ext4
// and tmpfs mechanisms keep each sandbox's filesystem a *detached* mount held
// by an fd (fsmount(2)), attached in no mount namespace: the edge's mount
// table, which every new sandbox's namespace is copied from, then holds no
// mount per sandbox (issue 30). The edge reaches the filesystem through
// dirOf() (/proc/<edge pid>/fd/N), builds the overlay over it and hands that
// to the sandbox by fd. Elsewhere (the fallback) they are mounted on
// <root>/<name> under a shared bind of <root>, as before.
// ext4 project quotas are not implemented (EDQUOT, like btrfs): see
// docs/container-backend.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <optional>
#include <string_view>
#include <vector>

#include "common/fd.h"
#include "common/status.h"

namespace dsec::edge {

class LoopPool;

enum class DiskQuotaKind { kXfs, kExt4, kBtrfs, kTmpfs, kNone };

const char* diskQuotaKindName(DiskQuotaKind kind);

struct DiskQuotaOptions {
  std::string root;  // sandbox directories are <root>/<name>; must exist
  // The xfs or btrfs pool image (btrfs: used when <root> is not on a btrfs
  // with quotas on).
  // Replaced at every start; must not be under <root>.
  std::string poolImage;
  // Nominal size of the (sparse) pool image; 0: the free space of the
  // filesystem holding it at start.
  int64_t poolBytes = 0;
  std::string mode = "auto";  // "auto", "xfs", "ext4", "btrfs", "tmpfs" or "none"
  // Sandboxes of an earlier edge live on under <root>: take over the pool (or
  // shared bind) it left mounted there instead of making a fresh one.
  bool adopt = false;
  // The edge's loop devices (loop_device.h), which the ext4 mechanism takes
  // its per-sandbox devices from and gives back to. Not owned; must outlive
  // the quota. Null: the ext4 mechanism makes a pool of its own that
  // attributes nothing across runs.
  LoopPool* loops = nullptr;
  // The sandboxes being re-adopted (with adopt): their images stay.
  std::set<std::string> keep;
  // ext4 and tmpfs: keep disks detached (see above). The caller sets it from
  // probeDetachedDisks(); false: mounted on <root>/<name>.
  bool detach = false;
};

// Where sandboxes' writable layers live and what bounds them. Thread-safe:
// create and remove of different names may run in parallel.
class DiskQuota {
 public:
  virtual ~DiskQuota() = default;
  virtual DiskQuotaKind kind() const = 0;
  // For logs: mechanism and where ("btrfs simple quotas on a 80 GiB sparse
  // loop image /var/lib/dsec/edge/sandboxes.img").
  virtual std::string describe() const = 0;
  // The errno a write over the limit fails with inside the sandbox (EDQUOT,
  // ENOSPC), 0 when nothing is enforced.
  virtual int overLimitErrno() const = 0;
  // Makes the empty directory <root>/<name> (mode 0700) holding at most
  // `bytes` of files. kAlreadyExists when it exists; other errors are the
  // failed call's sysError. On error nothing is left behind.
  virtual Status create(const std::string& name, int64_t bytes) = 0;
  // Removes <root>/<name> and everything in it; a missing one is fine. The
  // sandbox's processes must be gone. Space may return to the pool a little
  // later (btrfs drops a subvolume in the background).
  virtual Status remove(const std::string& name) = 0;
  // The sandbox's directory as a path that this process and the host-root
  // processes it starts (mkfs.erofs) can use until remove(name): <root>/<name>,
  // or for a detached disk /proc/<edge pid>/fd/N, the magic link to its root.
  virtual std::string dirOf(const std::string& name) const = 0;
  // The detached disk's mount fd (borrowed: valid until remove(name)), -1
  // when `name` has none (not detached, or not created).
  virtual int diskFd(const std::string& /*name*/) const { return -1; }
  // Crash adoption: `mount` (a detached mount of a live sandbox's disk: the
  // read-only clone its agent holds) becomes name's disk; it is never
  // recycled, and remove(name) drops it and the image. kAlreadyExists when
  // name has one; kFailedPrecondition for mechanisms without detached disks.
  virtual Status adoptDisk(const std::string& name, UniqueFd /*mount*/) {
    return Status(Code::kFailedPrecondition, name + ": this disk quota has no detached disks");
  }
  // A detached disk goes to its sandbox (issue 30): the quota's mount is
  // made read-only (MOUNT_ATTR_RDONLY on that mount only: the sandbox's
  // overlay, built before, holds its own writable clone) and its fd returned,
  // for the caller to hand to the sandbox's PID 1 (aether's fd 10), which
  // then holds the one reference. The quota keeps no descriptor, so a held
  // sandbox costs the edge none for its disk; diskFd() is then -1 and dirOf()
  // unusable, and the caller reaches the disk through PID 1 (pidfd_getfd).
  // The mount itself goes, not a clone: closing the caller's fd then
  // unmounts nothing (a dissolved detached mount waits out an RCU grace
  // period, on the create path). kNotFound when name has no detached disk
  // held here; sysError of mount_setattr.
  virtual Result<UniqueFd> lend(const std::string& name) {
    return Status(Code::kNotFound, name + " has no detached disk");
  }
  // Before the sandbox dies: gives a lent disk back (`mount`: what lend
  // returned, taken from PID 1), so remove() can empty it for reuse (made
  // writable again once the sandbox is gone) or shut it down. A disk never
  // given back (its PID 1 died first) is let go by remove(): the filesystem
  // dies with the sandbox's last reference to it. kNotFound when name has no
  // lent disk.
  virtual Status reclaim(const std::string& name, UniqueFd /*mount*/) {
    return Status(Code::kNotFound, name + " has no lent disk");
  }
  // Tears down what open made (unmounts the pool, lets its loop device go,
  // deletes its image). Sandboxes must have been removed. Idempotent.
  virtual void close() = 0;
  // Live restore: leaves the pool and every directory as they are for the
  // next edge (which opens them with DiskQuotaOptions::adopt); close() and
  // the destructor then do nothing.
  virtual void keepForNextEdge() = 0;
};

// The detached disks of a mechanism, by sandbox name. Thread-safe.
class DiskTable {
 public:
  struct Disk {
    UniqueFd mount;  // fsmount(2) or a clone: attached nowhere; empty while lent
    bool adopted = false;
    bool readOnly = false;  // mount was lent (made read-only) or adopted
  };
  // kAlreadyExists when name has one.
  Status put(const std::string& name, UniqueFd mount, bool adopted);
  bool has(const std::string& name) const;
  // Removes and returns name's disk; nullopt when it has none.
  std::optional<Disk> take(const std::string& name);
  // DiskQuota::lend and reclaim: the entry stays, its fd goes and comes back.
  Result<UniqueFd> lend(const std::string& name);
  Status reclaim(const std::string& name, UniqueFd mount);
  int fd(const std::string& name) const;  // -1: none, or lent
  // /proc/<our pid>/fd/N for name's disk, else `fallback`.
  std::string dirOf(const std::string& name, const std::string& fallback) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;  // guards disks_
  std::map<std::string, Disk> disks_;
};

// Whether this kernel lets the edge build an overlay whose upper and work
// dirs lie in a detached mount (fsmount), reached by /proc/self/fd/N: tried on
// a throwaway tmpfs. Needs Linux >= 6.15 (clone_private_mount of detached
// mounts). The error names the step that failed.
Status probeDetachedDisks();

// Parses a mode into the mechanisms to try, in order. kInvalidArgument
// (field "disk-quota") for an unknown mode.
Result<std::vector<DiskQuotaKind>> diskQuotaCandidates(std::string_view mode);

// Opens the first mechanism of opts.mode that works here, logging why each
// earlier one did not. Mounts made earlier under opts.root (a crashed edge's)
// must have been removed by the caller. kFailedPrecondition with every
// reason when none works.
Result<std::unique_ptr<DiskQuota>> openDiskQuota(const DiskQuotaOptions& opts);

// Size of the btrfs pool image: `requested` when set, else the free space of
// its filesystem, rounded down to MiB; kFailedPrecondition below kMinPoolBytes.
constexpr int64_t kMinPoolBytes = 256ll << 20;
Result<int64_t> poolImageBytes(int64_t requested, int64_t freeBytes);

// mount(2) data for a sandbox's tmpfs of `bytes` (rounded up to whole pages).
std::string tmpfsMountData(int64_t bytes, int64_t pageSize);

// Binds `dir` on itself as a shared mount. Mounts made on or under it later,
// and their unmounts, then reach the mount namespaces cloned from ours in the
// meantime (spare agents, other processes') where the copy is still a peer.
Status bindShared(const std::string& dir);
// Whether something is mounted on `path` itself (in our mount namespace).
bool isMountPoint(const std::string& path);

// "80 GiB", "512 MiB", "1.5 GiB": for logs.
std::string humanBytes(int64_t bytes);

}  // namespace dsec::edge
