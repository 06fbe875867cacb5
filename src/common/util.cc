#include "common/util.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

#include "common/fd.h"

namespace dsec {

std::string randomHex(size_t nbytes) {
  std::string raw(nbytes, '\0');
  size_t got = 0;
  while (got < nbytes) {
    ssize_t n = getrandom(raw.data() + got, nbytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      abort();  // getrandom cannot fail once the pool is initialised
    }
    got += size_t(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(nbytes * 2);
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

double nowSeconds() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) / 1e9;
}

double monoSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) / 1e9;
}

std::string isoTime(double t) {
  time_t secs = time_t(t);
  int ms = int((t - double(secs)) * 1000);
  if (ms < 0) ms = 0;
  if (ms > 999) ms = 999;
  tm tmv;
  gmtime_r(&secs, &tmv);
  char buf[80];
  snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tmv.tm_year + 1900,
           tmv.tm_mon + 1, tmv.tm_mday, tmv.tm_hour, tmv.tm_min, tmv.tm_sec, ms);
  return buf;
}

Result<std::string> readFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return sysError("read " + path);
    }
    if (n == 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

Status writeFileAtomic(const std::string& path, std::string_view data, int mode) {
  std::string tmp = path + ".tmp." + randomHex(4);
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  if (!fd) return sysError("create " + tmp);
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd.get(), data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      Status st = sysError("write " + tmp);
      ::unlink(tmp.c_str());
      return st;
    }
    off += size_t(n);
  }
  if (::fchmod(fd.get(), mode) != 0 || ::fsync(fd.get()) != 0) {
    Status st = sysError("fsync " + tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status st = sysError("rename " + tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  return Status::ok();
}

Status writeKnob(const std::string& path, std::string_view data) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  if (::write(fd.get(), data.data(), data.size()) != ssize_t(data.size())) {
    return sysError("write " + path + " <- " + std::string(data));
  }
  return Status::ok();
}

Status makeDirs(const std::string& path, int mode) {
  if (path.empty()) return invalidArg("path", "empty path");
  std::string cur;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!cur.empty() && ::mkdir(cur.c_str(), mode) != 0 && errno != EEXIST) {
        return sysError("mkdir " + cur);
      }
    }
    if (i < path.size()) cur.push_back(path[i]);
  }
  return Status::ok();
}

namespace {
int removeEntry(const char* p, const struct stat*, int type, struct FTW*) {
  int rc = (type == FTW_DP) ? ::rmdir(p) : ::unlink(p);
  if (rc != 0 && errno != ENOENT) return -1;
  return 0;
}
}  // namespace

Status removeTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::ok();
    return sysError("lstat " + path);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return sysError("unlink " + path);
    return Status::ok();
  }
  // overlayfs work dirs hold a mode-000 "work" dir; we are root, so that is fine.
  if (nftw(path.c_str(), removeEntry, 64, FTW_DEPTH | FTW_PHYS | FTW_MOUNT) != 0) {
    return sysError("remove " + path);
  }
  return Status::ok();
}

std::vector<std::string> splitString(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == sep) {
      out.emplace_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

bool startsWith(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

bool secretEquals(std::string_view a, std::string_view b) {
  // The length of a token is not secret (always 64 hex digits); its bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace dsec

namespace dsec {

static const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64Encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out.push_back(kB64[v >> 18]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(kB64[(v >> 6) & 63]);
    out.push_back(kB64[v & 63]);
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out.push_back(kB64[v >> 18]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

Result<std::string> base64Decode(std::string_view in) {
  if (in.size() % 4 != 0) return invalidArg("", "base64 length is not a multiple of 4");
  std::string out;
  out.reserve(in.size() / 4 * 3);
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  for (size_t i = 0; i < in.size(); i += 4) {
    int pad = 0;
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = in[i + k];
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      int d = val(c);
      if (d < 0 || pad) return invalidArg("", "invalid base64");
      v = (v << 6) | uint32_t(d);
    }
    out.push_back(char(v >> 16));
    if (pad < 2) out.push_back(char((v >> 8) & 255));
    if (pad < 1) out.push_back(char(v & 255));
  }
  return out;
}

}  // namespace dsec
