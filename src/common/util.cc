#include "common/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <memory>

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

// Most directory levels removeTree keeps open at once (each holds two fds: one
// for the *at() calls, one owned by the readdir stream). Shallower levels are
// closed and later reopened through "..", so any depth goes in bounded fds.
constexpr size_t kRemoveTreeMaxOpenLevels = 64;

struct DirIdentity {
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t mntId = 0;
  bool hasMntId = false;
};

int identityOf(int fd, DirIdentity* out) {
  struct statx sx;
  if (::statx(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_INO | STATX_MNT_ID,
              &sx) != 0) {
    return -1;
  }
  out->dev = makedev(sx.stx_dev_major, sx.stx_dev_minor);
  out->ino = sx.stx_ino;
  out->hasMntId = (sx.stx_mask & STATX_MNT_ID) != 0;
  out->mntId = sx.stx_mnt_id;
  return 0;
}

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};

// One directory on the walk's path from the root.
struct RemoveFrame {
  std::string name;  // entry name in the parent; empty for the root
  DirIdentity id;
  UniqueFd fd;                             // invalid while closed for the fd budget
  std::unique_ptr<DIR, DirCloser> stream;  // over a dup of fd
  std::vector<std::string> failed;         // entries that could not go; not retried
  bool incomplete = false;                 // something below stays, so rmdir would fail

  bool skips(const char* n) const {
    return std::find(failed.begin(), failed.end(), n) != failed.end();
  }
};

// Iterative rm -rf over fds: an explicit stack, and no path handed to the
// kernel longer than one name, so a tree deeper than PATH_MAX goes like a flat one.
class TreeRemover {
 public:
  explicit TreeRemover(std::string root) : root_(std::move(root)) {}

  Status run(UniqueFd rootFd) {
    RemoveFrame top;
    if (identityOf(rootFd.get(), &top.id) != 0) return sysError("statx " + root_);
    rootId_ = top.id;
    top.fd = std::move(rootFd);
    frames_.push_back(std::move(top));
    while (!frames_.empty()) {
      size_t at = frames_.size() - 1;
      RemoveFrame& f = frames_[at];
      if (!f.stream) {
        UniqueFd dup(::fcntl(f.fd.get(), F_DUPFD_CLOEXEC, 0));
        DIR* d = dup ? ::fdopendir(dup.get()) : nullptr;
        if (!d) {
          fail(at, sysError("opendir " + pathOf(at)));
          RETURN_IF_ERROR(pop());
          continue;
        }
        (void)dup.release();
        f.stream.reset(d);
      }
      errno = 0;
      struct dirent* e = ::readdir(f.stream.get());
      if (!e) {
        if (errno != 0) fail(at, sysError("readdir " + pathOf(at)));
        RETURN_IF_ERROR(pop());
        continue;
      }
      const char* n = e->d_name;
      if (n[0] == '.' && (n[1] == '\0' || (n[1] == '.' && n[2] == '\0'))) continue;
      if (f.skips(n)) continue;
      handleEntry(n, e->d_type);
    }
    if (!first_.isOk()) return first_;
    if (::rmdir(root_.c_str()) != 0 && errno != ENOENT) return sysError("rmdir " + root_);
    return Status::ok();
  }

 private:
  // Unlinks a non-directory, or pushes a directory to empty next.
  void handleEntry(const std::string& name, unsigned char type) {
    size_t at = frames_.size() - 1;
    int dfd = frames_[at].fd.get();
    bool isDir = type == DT_DIR;
    if (type == DT_UNKNOWN) {
      struct stat st;
      if (::fstatat(dfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno != ENOENT) fail(at, sysError("lstat " + pathOf(at, name)), name);
        return;
      }
      isDir = S_ISDIR(st.st_mode);
    }
    if (!isDir) {
      if (::unlinkat(dfd, name.c_str(), 0) == 0 || errno == ENOENT) return;
      if (errno != EISDIR) {
        fail(at, sysError("unlink " + pathOf(at, name)), name);
        return;
      }
    }
    // O_NOFOLLOW: a symlink swapped in for the directory is refused (ELOOP),
    // never followed.
    UniqueFd cfd(::openat(dfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!cfd) {
      if (errno == ENOENT) return;
      if (errno == ENOTDIR || errno == ELOOP) {  // replaced by a non-directory meanwhile
        if (::unlinkat(dfd, name.c_str(), 0) == 0 || errno == ENOENT) return;
        fail(at, sysError("unlink " + pathOf(at, name)), name);
        return;
      }
      fail(at, sysError("open " + pathOf(at, name)), name);
      return;
    }
    RemoveFrame child;
    child.name = name;
    if (identityOf(cfd.get(), &child.id) != 0) {
      fail(at, sysError("statx " + pathOf(at, name)), name);
      return;
    }
    // st_dev catches other filesystems; the mount id also catches bind mounts
    // of the same one.
    if (child.id.dev != rootId_.dev ||
        (child.id.hasMntId && rootId_.hasMntId && child.id.mntId != rootId_.mntId)) {
      fail(at, sysError("remove " + pathOf(at, name) + ": another mount, not descending", EXDEV),
           name);
      return;
    }
    child.fd = std::move(cfd);
    // Keep at most kRemoveTreeMaxOpenLevels levels open: close the shallowest.
    if (frames_.size() - firstOpen_ >= kRemoveTreeMaxOpenLevels) {
      frames_[firstOpen_].stream.reset();
      frames_[firstOpen_].fd.reset();
      ++firstOpen_;
    }
    frames_.push_back(std::move(child));
  }

  // The top directory is exhausted: remove it from its parent and resume there.
  // Fails only when the walk cannot go on safely.
  Status pop() {
    size_t at = frames_.size() - 1;
    if (at == 0) {
      frames_.clear();
      return Status::ok();
    }
    RemoveFrame& parent = frames_[at - 1];
    if (!parent.fd) {
      // Closed for the fd budget. Reopen through ".." and check it is the same
      // directory (the tree may have been renamed meanwhile). Its stream starts
      // over, which is fine: what was removed is gone, what failed is skipped.
      UniqueFd pfd(
          ::openat(frames_[at].fd.get(), "..", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!pfd) return sysError("open " + pathOf(at - 1));
      DirIdentity id;
      if (identityOf(pfd.get(), &id) != 0) return sysError("statx " + pathOf(at - 1));
      if (id.dev != parent.id.dev || id.ino != parent.id.ino) {
        return sysError("remove " + pathOf(at - 1) + ": directory moved during removal", ESTALE);
      }
      parent.fd = std::move(pfd);
      firstOpen_ = at - 1;
    }
    RemoveFrame child = std::move(frames_[at]);
    frames_.pop_back();
    child.stream.reset();
    child.fd.reset();
    if (child.incomplete) {
      parent.failed.push_back(child.name);
      return Status::ok();
    }
    if (::unlinkat(parent.fd.get(), child.name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      fail(at - 1, sysError("rmdir " + pathOf(at - 1, child.name)), child.name);
    }
    return Status::ok();
  }

  // Records the first error. The walk goes on to free what it can; the entry
  // and every directory above it stay.
  void fail(size_t at, Status st, const std::string& name = {}) {
    if (first_.isOk()) first_ = std::move(st);
    if (!name.empty()) frames_[at].failed.push_back(name);
    for (size_t i = 0; i <= at; ++i) frames_[i].incomplete = true;
  }

  // The path of frames_[at] (and `name` in it) for messages, the middle of a
  // very deep one elided.
  std::string pathOf(size_t at, const std::string& name = {}) const {
    constexpr size_t kHead = 8, kTail = 8;
    std::string p = root_;
    for (size_t i = 1; i <= at; ++i) {
      if (at > kHead + kTail && i == kHead + 1) {
        p += "/...(" + std::to_string(at - kHead - kTail - 1) + " levels)...";
        i = at - kTail;
      }
      p += "/" + frames_[i].name;
    }
    if (!name.empty()) p += "/" + name;
    return p;
  }

  std::string root_;
  DirIdentity rootId_;
  std::vector<RemoveFrame> frames_;  // root first; the top is being emptied
  size_t firstOpen_ = 0;             // frames_[firstOpen_..] hold open fds
  Status first_;
};

}  // namespace

Result<std::vector<std::string>> dirEntries(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return sysError("opendir " + dir);
  std::vector<std::string> out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(std::move(n));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

Status removeTree(const std::string& path) {
  // A trailing slash would make the kernel follow a final symlink.
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  if (p.empty()) return invalidArg("path", "removeTree: empty path");
  if (p == "/") return invalidArg("path", "removeTree: refusing to remove /");
  UniqueFd fd(::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return Status::ok();
    if (errno != ENOTDIR && errno != ELOOP) return sysError("open " + p);
    // A file or a symlink (never followed): unlink just that.
    if (::unlink(p.c_str()) != 0 && errno != ENOENT) return sysError("unlink " + p);
    return Status::ok();
  }
  // overlayfs work dirs hold a mode-000 "work" dir; as root that is fine.
  return TreeRemover(p).run(std::move(fd));
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

std::string_view trimOws(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string asciiLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

bool asciiIEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
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

uint64_t raiseNofileLimit(uint64_t want) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur >= want) return rl.rlim_cur;
  uint64_t cap = want;
  if (auto nr = readFile("/proc/sys/fs/nr_open"); nr.isOk()) {
    cap = std::min<uint64_t>(cap, std::strtoull(nr->c_str(), nullptr, 10));
  }
  rlimit up = rl;
  up.rlim_max = std::max<uint64_t>(rl.rlim_max, cap);
  up.rlim_cur = up.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &up) != 0) {
    // Not allowed to raise the hard limit: as far as it goes.
    up = rl;
    up.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &up);
  }
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  return rl.rlim_cur;
}

}  // namespace dsec
