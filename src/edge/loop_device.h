// Loop devices: attaching a file so a block filesystem can be mounted from it.
#pragma once

#include <cstdint>
#include <string>

#include "common/fd.h"
#include "common/status.h"

namespace dsec::edge {

// Attaches `file` to a free loop device with LOOP_CONFIGURE and `loFlags`
// (LO_FLAGS_READ_ONLY, LO_FLAGS_AUTOCLEAR, LO_FLAGS_DIRECT_IO...); returns the
// device path and leaves its open fd in `held`. With LO_FLAGS_AUTOCLEAR the
// kernel detaches the device once its last user (the caller's fd, a mount)
// lets go, so close `held` after mounting. The file is opened read-only when
// loFlags has LO_FLAGS_READ_ONLY, else read-write. Errors: sysError of the
// open/ioctl with its errno and path; kResourceExhausted when 64 tries found
// no device to take. Attaches within one process are serialized; a device
// that refuses (EBUSY: another process took it, or its previous filesystem
// still holds it while unmounting) is passed over for a newly added one.
Result<std::string> attachLoop(const std::string& file, uint32_t loFlags, UniqueFd& held);

}  // namespace dsec::edge
