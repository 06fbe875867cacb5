// The ext4 mechanism of DiskQuota (disk_quota.h): a small filesystem of its
// own per sandbox. Each sandbox directory <root>/<name> is the mount point of
// an ext4 (no journal, no reserved blocks) on a sparse image file
// <disks>/<name>.img attached to a loop device: its size is the limit, so a
// write past it fails with ENOSPC ("No space left on device"), exactly what a
// full disk says, and no other sandbox, nor the host, is touched.
//
// Formatting (mkfs.ext4, ~20-40 ms), attaching and mounting (~2-20 ms here)
// are far too slow for the create path, so a background thread keeps a few
// *spares* of each recently used size formatted, attached and mounted with
// fsmount(2) but attached nowhere (no mount namespace holds a copy); a
// create puts one on <root>/<name> with one move_mount (~0.03 ms). A size
// with no spare is formatted inline once, and spares of it are kept from
// then on. Spares die with the edge's fds: a crash leaves only image files,
// which the next start removes.
// A removed sandbox's filesystem that holds little (a few thousand inodes,
// tens of MiB) is emptied and kept as a spare of its size instead of thrown
// away: emptying it costs far less than making a new one (copy, a loop
// device that syncs the image, a mount that reads it back), and a steady
// create/destroy churn then needs no new filesystem at all. Only what mkfs
// left may remain: the usage must fall back to a fresh spare's, or it goes.
// Online growth (EXT4_IOC_RESIZE_FS) would serve every size from one kind of
// spare but needs CAP_SYS_RESOURCE, which the edge may lack (this dev host
// does), so spares are per size.
//
// Detached (DiskQuotaOptions::detach, the default where the kernel allows):
// a create hands the spare over as it is, attached nowhere, held by fd in
// the quota (dirOf: /proc/<pid>/fd/N); nothing is mounted on <root>/<name>
// and <root> is not bound, so the edge's mount table does not grow with its
// sandboxes. A removed sandbox's filesystem is emptied through the fd and
// kept as it is, or shut down and let go; it goes with the last of the fd
// and the sandbox's overlay, and its loop device (autoclear) with it.
//
// Otherwise <root> is bound on itself as a shared mount, and a create puts
// the spare on <root>/<name> with one move_mount, so the move and the
// unmounts reach the mount namespaces cloned from ours in the meantime
// (spare agents, VM processes); a removed sandbox's filesystem then goes
// with its last mount, and its loop device (autoclear) with it.
//
// The loop devices come from the edge's LoopPool (DiskQuotaOptions::loops)
// and go back to it when a disk is thrown away: reused, or removed beyond its
// free list (loop_device.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "edge/disk_quota.h"

namespace dsec::edge {

struct Ext4QuotaOptions {
  // Spares kept per size; 0: none (every create formats inline: tests).
  int sparesPerSize = 2;
  // How many distinct sizes keep spares (the most recently used ones).
  int sizesKept = 3;
  // A size that has spares from the start (the API's default disk_mb).
  int64_t initialSize = 1024ll << 20;
  // Spares per size that removed sandboxes' filesystems may become (0: none,
  // every removal throws its filesystem away). See Ext4Quota::recycle.
  int recycledPerSize = 16;
  // ... and only while it holds at most this much more than a fresh one:
  // emptying more costs more than a new spare.
  int64_t recycleMaxInodes = 4096;
  int64_t recycleMaxBytes = 64ll << 20;
  // Spares beyond sparesPerSize go once their size has had no create for
  // this long.
  double recycledIdleS = 10;
};

// Needs ext4 in the kernel, mkfs.ext4 (e2fsprogs) and /dev/loop-control;
// kFailedPrecondition with the reason otherwise, or when the probe (one
// spare formatted and mounted at start) fails. Images live in `disksDir`
// (made if missing; must not be under opts.root). With opts.adopt, takes over
// the shared bind and the sandboxes' mounts an earlier edge left (older
// layout); either way stale spares and images of no sandbox in opts.keep nor
// mounted are removed. Re-adopted detached disks come back by adoptDisk. On error nothing
// is left mounted or attached.
Result<std::unique_ptr<DiskQuota>> openExt4Quota(const DiskQuotaOptions& opts,
                                                 const std::string& disksDir,
                                                 const Ext4QuotaOptions& eo = {});

// The mkfs.ext4 command line for an image of `bytes` (rounded down to 4 KiB
// blocks): 4 KiB blocks, no journal (a crash of the host takes the sandbox
// with it), no blocks reserved for root, a volume label.
std::vector<std::string> ext4MkfsArgs(const std::string& mkfs, const std::string& image,
                                      int64_t bytes);

}  // namespace dsec::edge
