#include "common/mountinfo.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "common/fd.h"

namespace dsec {

int64_t mountCount(int pid) {
  std::string path =
      pid > 0 ? "/proc/" + std::to_string(pid) + "/mountinfo" : "/proc/self/mountinfo";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return -1;
  int64_t lines = 0;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    lines += std::count(buf, buf + n, '\n');
  }
  return lines;
}

}  // namespace dsec
