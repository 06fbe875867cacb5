// The xfs mechanism of DiskQuota (disk_quota.h): one XFS for the node,
// mounted with project quotas; each sandbox's directory is a project of its
// own with a hard block limit. XFS fails a write over a project's limit with
// ENOSPC (as Docker's overlay2 on xfs with pquota does), where btrfs qgroups
// give EDQUOT.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "edge/disk_quota.h"

namespace dsec::edge {

// Replaces opts.poolImage with a fresh sparse image (mkfs.xfs), attaches it to
// a loop device (autoclear) and mounts it on opts.root with `prjquota` (on a
// shared bind of opts.root, like the btrfs pool). With opts.adopt and an XFS
// with project quotas already mounted there (the previous edge's pool), takes
// it over and learns the project ids in use from the sandbox directories.
// kFailedPrecondition with the reason when this host cannot have it (no xfs
// in the kernel, a kernel without XFS quota support, no mkfs.xfs, too little
// free space); other errors as they come. On error nothing is left mounted or
// attached.
Result<std::unique_ptr<DiskQuota>> openXfsQuota(const DiskQuotaOptions& opts);

// Why this kernel cannot enforce XFS project quotas, empty when it can (as
// far as /proc tells before a mount: xfs registered, and /proc/fs/xfs/xqmstat,
// which only a kernel built with CONFIG_XFS_QUOTA has, once xfs is loaded).
std::string xfsQuotaUnavailableReason();

// The quotactl block limit for `bytes`: 512-byte basic blocks, rounded up to
// whole 4 KiB filesystem blocks.
uint64_t xfsBasicBlocks(int64_t bytes);

}  // namespace dsec::edge
