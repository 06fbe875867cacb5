#include "common/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>

namespace dsec::log {

namespace {
std::atomic<Level> g_level{Level::kInfo};
const char* levelName(Level l) {
  switch (l) {
    case Level::kDebug: return "D";
    case Level::kInfo: return "I";
    case Level::kWarn: return "W";
    case Level::kError: return "E";
  }
  return "?";
}
}  // namespace

namespace {
struct Sink {
  std::mutex mu;  // guards everything below
  int fd = 2;
  std::string path;
  long long maxBytes = 0;
  long long size = 0;
  time_t second = 0;
  int linesThisSecond = 0;
  long long dropped = 0;
};
Sink& sink() {
  static Sink* s = new Sink();  // never destroyed: threads may log during exit
  return *s;
}

void emit(Sink& s, const std::string& line) {
  (void)!::write(s.fd, line.data(), line.size());
  if (s.path.empty()) return;
  s.size += static_cast<long long>(line.size());
  if (s.size < s.maxBytes) return;
  // Rotate: the current file becomes <path>.1 (replacing the older one).
  ::rename(s.path.c_str(), (s.path + ".1").c_str());
  int fd = ::open(s.path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ::close(s.fd);
    s.fd = fd;
    s.size = 0;
  }
}
}  // namespace

bool setFile(const std::string& path, long long maxBytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  struct stat st;
  Sink& s = sink();
  std::lock_guard lk(s.mu);
  if (s.fd != 2) ::close(s.fd);
  s.fd = fd;
  s.path = path;
  s.maxBytes = maxBytes > 0 ? maxBytes : 64ll << 20;
  s.size = ::fstat(fd, &st) == 0 ? st.st_size : 0;
  return true;
}

void setLevel(Level level) { g_level = level; }
Level level() { return g_level; }

void write(Level lvl, std::string_view msg) {
  if (lvl < g_level) return;
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm t;
  gmtime_r(&tv.tv_sec, &t);
  char head[64];
  int n = snprintf(head, sizeof head, "%s %02d:%02d:%02d.%03ld ", levelName(lvl), t.tm_hour,
                   t.tm_min, t.tm_sec, long(tv.tv_usec / 1000));
  std::string line(head, n);
  line.append(msg);
  line.push_back('\n');
  Sink& s = sink();
  std::lock_guard lk(s.mu);
  if (tv.tv_sec != s.second) {
    if (s.dropped > 0) {
      emit(s, std::string(head, n) + "log: dropped " + std::to_string(s.dropped) +
                  " lines past " + std::to_string(kMaxLinesPerSecond) + " a second\n");
    }
    s.second = tv.tv_sec;
    s.linesThisSecond = 0;
    s.dropped = 0;
  }
  if (++s.linesThisSecond > kMaxLinesPerSecond && lvl < Level::kError) {
    ++s.dropped;
    return;
  }
  emit(s, line);
}

}  // namespace dsec::log
