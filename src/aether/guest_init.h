// dsec-aether as the init of a microvm guest (docs/microvm.md): started by
// the kernel as /init of the project's initramfs, it loads the guest's
// modules, mounts the image's EROFS layers (read-only virtio-blk disks) under
// an overlayfs whose upper layer is the writable ext4 disk, switches root into
// it and serves the agent protocol over the virtio-serial port "dsec.agent".
#pragma once

namespace dsec::aether {

// Never returns while the guest runs (PID 1); returns an exit code only when
// the agent ends, after which the caller powers the guest off.
int guestMain();

}  // namespace dsec::aether
