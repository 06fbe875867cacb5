#include "edge/loop_device.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <unistd.h>

namespace dsec::edge {

Result<std::string> attachLoop(const std::string& file, uint32_t loFlags, UniqueFd& held) {
  UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl) return sysError("open /dev/loop-control");
  bool ro = (loFlags & LO_FLAGS_READ_ONLY) != 0;
  UniqueFd f(::open(file.c_str(), (ro ? O_RDONLY : O_RDWR) | O_CLOEXEC));
  if (!f) return sysError("open " + file);
  for (int attempt = 0; attempt < 16; ++attempt) {
    int n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
    if (n < 0) return sysError("LOOP_CTL_GET_FREE");
    std::string dev = "/dev/loop" + std::to_string(n);
    UniqueFd loop(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
    if (!loop) return sysError("open " + dev);
    loop_config cfg{};
    cfg.fd = uint32_t(f.get());
    cfg.info.lo_flags = loFlags;
    if (::ioctl(loop.get(), LOOP_CONFIGURE, &cfg) != 0) {
      if (errno == EBUSY) continue;  // raced with another user of that device
      return sysError("LOOP_CONFIGURE " + dev);
    }
    held = std::move(loop);
    return dev;
  }
  return Status(Code::kResourceExhausted, "no free loop device");
}

}  // namespace dsec::edge
