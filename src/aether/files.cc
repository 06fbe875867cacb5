#include "aether/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <vector>

namespace dsec::aether {

namespace {

// More entries than fit in a 1 MiB frame anyway.
constexpr size_t kMaxListEntries = 20000;

const char* typeName(mode_t m) {
  if (S_ISREG(m)) return "file";
  if (S_ISDIR(m)) return "dir";
  if (S_ISLNK(m)) return "symlink";
  if (S_ISCHR(m)) return "char";
  if (S_ISBLK(m)) return "block";
  if (S_ISFIFO(m)) return "fifo";
  if (S_ISSOCK(m)) return "socket";
  return "unknown";
}

Json statJson(const struct stat& st) {
  return Json{{"type", typeName(st.st_mode)},
              {"size", static_cast<uint64_t>(st.st_size)},
              {"mode", static_cast<unsigned>(st.st_mode & 07777)},
              {"mtime", static_cast<double>(st.st_mtim.tv_sec) +
                            static_cast<double>(st.st_mtim.tv_nsec) / 1e9},
              {"uid", static_cast<uint64_t>(st.st_uid)},
              {"gid", static_cast<uint64_t>(st.st_gid)}};
}

std::string baseName(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t start = path.rfind('/', end);
  return path.substr(start + 1, end - start);
}

std::string dirName(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t slash = path.rfind('/', end);
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status writeAll(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return sysError("write " + path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return Status::ok();
}

Status notEmpty(const std::string& path) {
  return Status(Code::kFailedPrecondition, "remove " + path + ": Directory not empty", ENOTEMPTY);
}

// Empties and removes the directory `path` without following symlinks: every
// level is opened with openat(O_NOFOLLOW) from its parent's fd, so a symlink
// swapped in mid-walk is unlinked, never entered. Iterative, so a deep tree
// cannot exhaust the stack; depth is bounded by the open-file limit instead.
Status removeTree(const std::string& path) {
  struct Level {
    DIR* dir;
    std::string path;
    int passes;
  };
  std::vector<Level> stack;
  auto closeAll = [&] {
    for (auto& l : stack) ::closedir(l.dir);
    stack.clear();
  };
  auto push = [&](int parent_fd, const char* name, std::string full) -> Status {
    int fd = ::openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return sysError("open " + full);
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      int err = errno;
      ::close(fd);
      return sysError("opendir " + full, err);
    }
    stack.push_back(Level{d, std::move(full), 0});
    return Status::ok();
  };
  RETURN_IF_ERROR(push(AT_FDCWD, path.c_str(), path));
  while (!stack.empty()) {
    Level& top = stack.back();
    errno = 0;
    struct dirent* e = ::readdir(top.dir);
    if (e == nullptr) {
      if (errno != 0) {
        Status st = sysError("readdir " + top.path);
        closeAll();
        return st;
      }
      // Entries created while we walked (or skipped by readdir because we
      // unlinked during iteration) show up as ENOTEMPTY; look again a few times.
      std::string done = top.path;
      if (stack.size() > 1) {
        int parent = ::dirfd(stack[stack.size() - 2].dir);
        std::string name = baseName(done);
        if (::unlinkat(parent, name.c_str(), AT_REMOVEDIR) < 0) {
          if ((errno == ENOTEMPTY || errno == EEXIST) && ++top.passes < 3) {
            ::rewinddir(top.dir);
            continue;
          }
          Status st =
              errno == ENOTEMPTY || errno == EEXIST ? notEmpty(done) : sysError("remove " + done);
          closeAll();
          return st;
        }
      }
      ::closedir(top.dir);
      stack.pop_back();
      continue;
    }
    std::string_view name = e->d_name;
    if (name == "." || name == "..") continue;
    int dfd = ::dirfd(top.dir);
    if (::unlinkat(dfd, e->d_name, 0) == 0 || errno == ENOENT) continue;
    std::string full =
        top.path == "/" ? "/" + std::string(name) : top.path + "/" + std::string(name);
    // Linux says EISDIR for a directory, POSIX allows EPERM.
    if (errno == EISDIR || errno == EPERM) {
      struct stat st;
      if (::fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
        Status pushed = push(dfd, e->d_name, std::move(full));
        if (!pushed.isOk()) {
          closeAll();
          return pushed;
        }
        continue;
      }
    }
    Status st = sysError("remove " + full);
    closeAll();
    return st;
  }
  if (::rmdir(path.c_str()) < 0) {
    if (errno == ENOTEMPTY || errno == EEXIST) return notEmpty(path);
    return sysError("remove " + path);
  }
  return Status::ok();
}

}  // namespace

namespace {
constexpr std::string_view kMetaPrefix = "user.meta.";
constexpr size_t kMaxMetaValue = 4096;
}  // namespace

Json metaOf(const std::string& path) {
  Json out = Json::object();
  char names[8192];
  ssize_t n = ::llistxattr(path.c_str(), names, sizeof names);
  if (n <= 0) return out;
  for (ssize_t off = 0; off < n;) {
    std::string name(names + off);
    off += static_cast<ssize_t>(name.size()) + 1;
    if (name.compare(0, kMetaPrefix.size(), kMetaPrefix) != 0) continue;
    char value[kMaxMetaValue];
    ssize_t v = ::lgetxattr(path.c_str(), name.c_str(), value, sizeof value);
    if (v >= 0) out[name.substr(kMetaPrefix.size())] = std::string(value, static_cast<size_t>(v));
  }
  return out;
}

Status setMeta(const std::string& path, const std::map<std::string, std::string>& meta) {
  for (const auto& [k, v] : meta) {
    bool keyOk = !k.empty() && k.size() <= 128 &&
                 k.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789._-") == std::string::npos;
    if (!keyOk) return invalidArg("meta", "metadata key '" + k + "': 1-128 of [a-z0-9._-]");
    bool valueOk = v.size() <= kMaxMetaValue;
    for (char c : v) valueOk = valueOk && c >= 0x20 && c < 0x7f;
    if (!valueOk) return invalidArg("meta", "metadata value of '" + k + "': up to 4096 printable ASCII");
  }
  for (const auto& [k, v] : meta) {
    std::string name = std::string(kMetaPrefix) + k;
    int rc = v.empty() ? ::lremovexattr(path.c_str(), name.c_str())
                       : ::lsetxattr(path.c_str(), name.c_str(), v.data(), v.size(), 0);
    if (rc < 0 && !(v.empty() && errno == ENODATA)) {
      if (errno == ENOTSUP) {
        return Status(Code::kFailedPrecondition,
                      "the file system of " + path + " has no user extended attributes", ENOTSUP,
                      "meta");
      }
      return sysError("setxattr " + path);
    }
  }
  return Status::ok();
}

Result<Json> statPath(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) < 0) return sysError("stat " + path);
  Json j = statJson(st);
  j["name"] = baseName(path);
  j["path"] = path;
  if (Json meta = metaOf(path); !meta.empty()) j["meta"] = std::move(meta);
  if (S_ISLNK(st.st_mode)) {
    char buf[PATH_MAX];
    ssize_t n = ::readlink(path.c_str(), buf, sizeof buf);
    if (n >= 0) j["target"] = std::string(buf, static_cast<size_t>(n));
  }
  return j;
}

Result<std::string> listDir(const std::string& path, size_t max_payload) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return sysError("open " + path);
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    int err = errno;
    ::close(fd);
    return sysError("opendir " + path, err);
  }
  // Only the first kMaxListEntries names (in sort order) can ever be sent, so
  // keep no more than about twice that: a directory of millions of files
  // costs time, not memory.
  std::vector<std::string> names;
  bool dropped = false;
  auto trim = [&] {
    std::nth_element(names.begin(), names.begin() + kMaxListEntries, names.end());
    names.resize(kMaxListEntries);
    dropped = true;
  };
  while (true) {
    errno = 0;
    struct dirent* e = ::readdir(dir);
    if (e == nullptr) {
      if (errno != 0) {
        int err = errno;
        ::closedir(dir);
        return sysError("readdir " + path, err);
      }
      break;
    }
    std::string_view name = e->d_name;
    if (name == "." || name == "..") continue;
    names.emplace_back(name);
    if (names.size() >= 2 * kMaxListEntries) trim();
  }
  if (names.size() > kMaxListEntries) trim();
  std::sort(names.begin(), names.end());
  std::vector<std::pair<std::string, struct stat>> entries;
  entries.reserve(names.size());
  for (auto& name : names) {
    struct stat st;
    // An entry removed since readdir() is simply no longer listed.
    if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
    entries.emplace_back(std::move(name), st);
  }
  ::closedir(dir);

  // Built by hand so the list can stop before the payload outgrows a frame.
  const std::string tail_truncated = "],\"truncated\":true}";
  std::string out = "{\"ok\":true,\"entries\":[";
  bool first = true;
  for (const auto& [name, st] : entries) {
    Json j = statJson(st);
    j["name"] = name;
    if (Json meta = metaOf(path + "/" + name); !meta.empty()) j["meta"] = std::move(meta);
    std::string item = dumpJson(j);
    if (out.size() + item.size() + 1 + tail_truncated.size() > max_payload) {
      out += tail_truncated;
      return out;
    }
    if (!first) out += ',';
    first = false;
    out += item;
  }
  if (dropped) {
    out += tail_truncated;
    return out;
  }
  out += "]}";
  return out;
}

Status makeDir(const std::string& path, bool parents, mode_t mode) {
  auto mkOne = [](const std::string& p, mode_t m, bool exist_ok) -> Status {
    if (::mkdir(p.c_str(), m) == 0) {
      // mkdir() applies the umask; the request's mode is what was asked for.
      if (::chmod(p.c_str(), m) < 0) return sysError("chmod " + p);
      return Status::ok();
    }
    int err = errno;
    if (err == EEXIST && exist_ok) {
      struct stat st;
      if (::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return Status::ok();
    }
    return sysError("mkdir " + p, err);
  };
  if (!parents) return mkOne(path, mode, false);

  std::vector<std::string> parts;
  size_t pos = 0;
  while (pos < path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string::npos) slash = path.size();
    std::string part = path.substr(pos, slash - pos);
    if (!part.empty() && part != ".") parts.push_back(std::move(part));
    pos = slash + 1;
  }
  std::string cur;
  for (size_t i = 0; i < parts.size(); ++i) {
    cur += "/" + parts[i];
    bool last = i + 1 == parts.size();
    RETURN_IF_ERROR(mkOne(cur, last ? mode : 0755, true));
  }
  return Status::ok();
}

Status removePath(const std::string& path, bool recursive) {
  if (path.find_first_not_of('/') == std::string::npos) {
    return invalidArg("path", "refusing to remove /");
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) < 0) return sysError("remove " + path);
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) < 0) return sysError("remove " + path);
    return Status::ok();
  }
  if (!recursive) {
    if (::rmdir(path.c_str()) < 0) {
      if (errno == ENOTEMPTY || errno == EEXIST) return notEmpty(path);
      return sysError("remove " + path);
    }
    return Status::ok();
  }
  return removeTree(path);
}

FileWriter& FileWriter::operator=(FileWriter&& o) noexcept {
  if (this != &o) {
    abort();
    fd_ = std::move(o.fd_);
    path_ = std::exchange(o.path_, {});
    tmp_path_ = std::exchange(o.tmp_path_, {});
    written_ = std::exchange(o.written_, 0);
  }
  return *this;
}

Result<FileWriter> FileWriter::open(const std::string& path, mode_t mode, bool mode_given,
                                    bool append) {
  FileWriter w;
  w.path_ = path;
  if (append) {
    // O_NONBLOCK: opening a FIFO must not wait for a reader; writes to a
    // regular file ignore it.
    int flags = O_WRONLY | O_APPEND | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
    bool created = true;
    int fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL, mode & 07777);
    if (fd < 0 && errno == EEXIST) {
      created = false;
      fd = ::open(path.c_str(), flags);
    }
    if (fd < 0) return sysError("open " + path);
    w.fd_.reset(fd);
    struct stat st;
    if (::fstat(fd, &st) < 0) return sysError("stat " + path);
    if (!S_ISREG(st.st_mode)) {
      return Status(Code::kInvalidArgument, "open " + path + ": not a regular file", 0, "path");
    }
    if ((created || mode_given) && ::fchmod(fd, mode & 07777) < 0) {
      return sysError("chmod " + path);
    }
    return w;
  }

  struct stat st;
  bool exists = ::lstat(path.c_str(), &st) == 0;
  if (exists && S_ISLNK(st.st_mode)) {
    // Write through a symlink, as `cat > link` would. realpath() resolves
    // inside the sandbox's root: aether has pivoted into it.
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) != nullptr) {
      w.path_ = resolved;
      exists = ::lstat(w.path_.c_str(), &st) == 0;
    }
  }
  if (exists && S_ISDIR(st.st_mode)) return sysError("open " + path, EISDIR);

  std::string tmpl = dirName(w.path_) + "/.dsec-write-XXXXXX";
  int fd = ::mkostemp(tmpl.data(), O_CLOEXEC);
  if (fd < 0) return sysError("open " + path);
  w.fd_.reset(fd);
  w.tmp_path_ = tmpl;
  // Replacing someone's file keeps it theirs (best effort: failing is
  // harmless). Before fchmod, since chown clears set-id bits.
  if (exists && S_ISREG(st.st_mode)) (void)!::fchown(fd, st.st_uid, st.st_gid);
  if (::fchmod(fd, mode & 07777) < 0) return sysError("chmod " + path);
  return w;
}

Status FileWriter::write(std::string_view data) {
  if (!fd_) return internalError("write " + path_ + ": writer is closed");
  Status st = writeAll(fd_.get(), data, path_);
  if (!st.isOk()) {
    abort();
    return st;
  }
  written_ += data.size();
  return Status::ok();
}

Result<uint64_t> FileWriter::commit() {
  if (!fd_) return internalError("write " + path_ + ": writer is closed");
  if (::close(fd_.release()) < 0) {
    Status st = sysError("close " + path_);
    abort();
    return st;
  }
  if (!tmp_path_.empty()) {
    if (::rename(tmp_path_.c_str(), path_.c_str()) < 0) {
      Status st = sysError("rename " + path_);
      abort();
      return st;
    }
    tmp_path_.clear();
  }
  return written_;
}

void FileWriter::abort() {
  fd_.reset();
  if (!tmp_path_.empty()) {
    ::unlink(tmp_path_.c_str());
    tmp_path_.clear();
  }
}

Result<FileReader> FileReader::open(const std::string& path, uint64_t offset, int64_t length) {
  FileReader r;
  r.path_ = path;
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  r.fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (!r.fd_) return sysError("open " + path);
  struct stat st;
  if (::fstat(r.fd_.get(), &st) < 0) return sysError("stat " + path);
  if (S_ISDIR(st.st_mode)) return sysError("read " + path, EISDIR);
  if (!S_ISREG(st.st_mode)) {
    return Status(Code::kInvalidArgument, "read " + path + ": not a regular file", 0, "path");
  }
  r.size_ = static_cast<uint64_t>(st.st_size);
  r.mode_ = st.st_mode & 07777;
  r.pos_ = offset;
  r.remaining_ = length < 0 ? UINT64_MAX : static_cast<uint64_t>(length);
  return r;
}

Status FileReader::readChunk(std::string& out, size_t max) {
  out.clear();
  if (remaining_ == 0 || !fd_) return Status::ok();
  size_t want = static_cast<size_t>(std::min<uint64_t>(max, remaining_));
  out.resize(want);
  while (true) {
    // pread's offset is off_t; past that the file simply ends.
    if (pos_ > static_cast<uint64_t>(INT64_MAX) - want) {
      out.clear();
      remaining_ = 0;
      return Status::ok();
    }
    ssize_t n = ::pread(fd_.get(), out.data(), want, static_cast<off_t>(pos_));
    if (n < 0) {
      if (errno == EINTR) continue;
      out.clear();
      return sysError("read " + path_);
    }
    out.resize(static_cast<size_t>(n));
    pos_ += static_cast<uint64_t>(n);
    if (remaining_ != UINT64_MAX) remaining_ -= static_cast<uint64_t>(n);
    if (n == 0) remaining_ = 0;
    return Status::ok();
  }
}

}  // namespace dsec::aether
