#include "common/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
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
  // One write(2) per line keeps lines whole across threads.
  (void)!::write(2, line.data(), line.size());
}

}  // namespace dsec::log
