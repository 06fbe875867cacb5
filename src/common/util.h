// Small helpers shared by the platform, the edge and the CLI.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base64.h"
#include "common/status.h"

namespace dsec {

// n random bytes from getrandom(2), hex-encoded (2n characters).
std::string randomHex(size_t nbytes);
// Seconds since the epoch as a double (CLOCK_REALTIME).
double nowSeconds();
// Monotonic clock in seconds.
double monoSeconds();
// RFC 3339 UTC with milliseconds: "2026-11-30T12:00:00.123Z".
std::string isoTime(double epochSeconds);

Result<std::string> readFile(const std::string& path);
// Writes to a temporary file beside `path`, fsyncs, renames over it.
Status writeFileAtomic(const std::string& path, std::string_view data, int mode = 0644);
// Writes `data` to an existing file (cgroup and proc knobs).
Status writeKnob(const std::string& path, std::string_view data);
// mkdir -p with `mode` for the directories it creates.
Status makeDirs(const std::string& path, int mode = 0755);
// rm -rf through fds and *at() calls: never follows a symlink (a symlinked
// `path` is unlinked, not followed), never descends into another mount (by
// st_dev and mount id), and removes trees of any depth, deeper than PATH_MAX
// included, with at most ~130 fds open. A missing path is ok; a non-directory
// is unlinked. On failure it still removes what it can, keeps what lies above
// the failure, and returns the first error with its errno and path (EXDEV for
// a mount inside the tree). kInvalidArgument for "" and "/".
Status removeTree(const std::string& path);
// The names in directory `dir` ("." and ".." left out), sorted bytewise.
// Errors: sysError("opendir <dir>") (ENOENT for a missing one).
Result<std::vector<std::string>> dirEntries(const std::string& dir);

std::vector<std::string> splitString(std::string_view s, char sep);
bool startsWith(std::string_view s, std::string_view prefix);
// s without HTTP's optional whitespace (spaces and tabs) at either end.
std::string_view trimOws(std::string_view s);
// s with its ASCII letters lower-cased (header and host names, media types).
std::string asciiLower(std::string_view s);
// Whether a and b are equal but for the case of ASCII letters.
bool asciiIEquals(std::string_view a, std::string_view b);

// Constant-time comparison for secrets.
bool secretEquals(std::string_view a, std::string_view b);

// Raises RLIMIT_NOFILE (soft and, where allowed, hard: a root process up to
// fs.nr_open) to at least `want` if it can; returns the soft limit in force
// after. Never lowers it.
uint64_t raiseNofileLimit(uint64_t want);

}  // namespace dsec


namespace dsec {
// Records named laps for debug logs of where time goes ("mkdir 0.12 clone 0.40").
class Laps {
 public:
  Laps() : last_(monoSeconds()) {}
  void lap(const char* name) {
    double now = monoSeconds();
    char buf[64];
    snprintf(buf, sizeof buf, "%s%s %.3f", out_.empty() ? "" : " ", name, (now - last_) * 1e3);
    out_ += buf;
    last_ = now;
  }
  const std::string& str() const { return out_; }

 private:
  double last_;
  std::string out_;
};
}  // namespace dsec
