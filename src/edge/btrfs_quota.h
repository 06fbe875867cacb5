// The btrfs mechanism of DiskQuota (disk_quota.h): one btrfs per node, a
// subvolume per sandbox created with its qgroup limit by one ioctl.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "edge/disk_quota.h"

namespace dsec::edge {

// Uses opts.root directly when it is on a btrfs whose quotas are enabled
// (never enables them on a filesystem it did not make); otherwise replaces
// opts.poolImage with a fresh sparse image (mkfs.btrfs, once), attaches it to
// a loop device (autoclear) and mounts it on opts.root, then enables simple
// quotas (Linux 6.7+) or, where the kernel lacks them, qgroups.
// kFailedPrecondition with the reason when this host cannot have it (no btrfs
// in the kernel, no mkfs.btrfs, too little free space, mkfs failed); other
// errors as they come. On error nothing is left mounted or attached.
Result<std::unique_ptr<DiskQuota>> openBtrfsQuota(const DiskQuotaOptions& opts);

// Whether /proc/filesystems lists `fs`.
bool kernelHasFilesystem(std::string_view fs);

// An executable named `name` in $PATH or the sbin directories (which a
// service's PATH may lack); empty if none.
std::string findProgram(const std::string& name);

}  // namespace dsec::edge
