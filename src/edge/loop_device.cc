#include "edge/loop_device.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

namespace dsec::edge {

namespace {

// This process's attaches go one at a time: without it, N threads asking
// LOOP_CTL_GET_FREE together all get the same device and N-1 lose the race.
std::mutex attachMu;

constexpr int kAttempts = 64;

}  // namespace

Result<std::string> attachLoop(const std::string& file, uint32_t loFlags, UniqueFd& held) {
  UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl) return sysError("open /dev/loop-control");
  bool ro = (loFlags & LO_FLAGS_READ_ONLY) != 0;
  UniqueFd f(::open(file.c_str(), (ro ? O_RDONLY : O_RDWR) | O_CLOEXEC));
  if (!f) return sysError("open " + file);
  std::lock_guard lk(attachMu);
  bool refused = false;  // a device refused us: take new ones from here on
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    // A device that was just auto-cleared is "free" while its last holder
    // (an unmounting filesystem) still has it claimed, and the kernel hands
    // out the lowest free number: asking again would give that same device.
    // After a refusal, take a brand-new device instead.
    int n = refused ? ::ioctl(ctl.get(), LOOP_CTL_ADD, -1)
                    : ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
    if (n < 0 && refused && errno != EBUSY && errno != EEXIST) {
      n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);  // no more minors: back to reuse
    }
    if (n < 0) {
      if (errno == EBUSY || errno == EEXIST) continue;
      return sysError("LOOP_CTL_GET_FREE");
    }
    std::string dev = "/dev/loop" + std::to_string(n);
    UniqueFd loop(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
    if (!loop) {
      // Removed by another process between its number and our open.
      if (errno == ENOENT || errno == ENXIO) continue;
      return sysError("open " + dev);
    }
    loop_config cfg{};
    cfg.fd = uint32_t(f.get());
    cfg.info.lo_flags = loFlags;
    if (::ioctl(loop.get(), LOOP_CONFIGURE, &cfg) != 0) {
      if (errno != EBUSY) return sysError("LOOP_CONFIGURE " + dev);
      // Raced with another process, or the device is still being let go.
      refused = true;
      if (attempt >= 8) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    held = std::move(loop);
    return dev;
  }
  return Status(Code::kResourceExhausted, "no free loop device");
}

}  // namespace dsec::edge
