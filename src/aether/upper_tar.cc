#include "aether/upper_tar.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace dsec::aether {
namespace {

constexpr size_t kBlock = 512;

void putOctal(char* field, size_t width, uint64_t value) {
  // width - 1 digits and a NUL; the caller checked that it fits.
  std::snprintf(field, width, "%0*llo", int(width - 1), static_cast<unsigned long long>(value));
}

void putString(char* field, size_t width, const std::string& s) {
  std::memcpy(field, s.data(), std::min(width, s.size()));
}

// One pax record: "<len> <key>=<value>\n", len counting itself.
void paxRecord(std::string& out, const std::string& key, const std::string& value) {
  size_t body = 1 + key.size() + 1 + value.size() + 1;  // " key=value\n"
  size_t len = body + 1;
  while (std::to_string(len).size() + body != len) len = std::to_string(len).size() + body;
  out += std::to_string(len) + " " + key + "=" + value + "\n";
}

void ustarBlock(std::string& out, const std::string& name, char type, mode_t mode, uint64_t uid,
                uint64_t gid, uint64_t size, int64_t mtime, const std::string& link,
                unsigned major, unsigned minor) {
  char h[kBlock] = {};
  putString(h, 100, name);
  putOctal(h + 100, 8, mode & 07777);
  putOctal(h + 108, 8, uid <= 07777777 ? uid : 0);
  putOctal(h + 116, 8, gid <= 07777777 ? gid : 0);
  putOctal(h + 124, 12, size <= 077777777777ull ? size : 0);
  putOctal(h + 136, 12, mtime >= 0 && uint64_t(mtime) <= 077777777777ull ? uint64_t(mtime) : 0);
  h[156] = type;
  putString(h + 157, 100, link);
  std::memcpy(h + 257, "ustar", 6);
  std::memcpy(h + 263, "00", 2);
  putOctal(h + 329, 8, major <= 07777777 ? major : 0);
  putOctal(h + 337, 8, minor <= 07777777 ? minor : 0);
  std::memset(h + 148, ' ', 8);
  unsigned sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += static_cast<unsigned char>(h[i]);
  std::snprintf(h + 148, 8, "%06o", sum);
  h[155] = ' ';
  out.append(h, kBlock);
}

void pad(std::string& out) { out.append((kBlock - out.size() % kBlock) % kBlock, '\0'); }

bool keptXattr(const std::string& name) {
  return name.rfind("user.", 0) == 0 || name == "security.capability" ||
         name == "trusted.overlay.opaque";
}

// The xattrs of an open file that a layer keeps.
Result<std::vector<std::pair<std::string, std::string>>> xattrsOf(int fd) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string names(4096, '\0');
  ssize_t n;
  for (;;) {
    n = ::flistxattr(fd, names.data(), names.size());
    if (n >= 0) break;
    if (errno == ENOTSUP) return out;
    if (errno != ERANGE) return sysError("flistxattr");
    names.resize(names.size() * 4);
  }
  names.resize(size_t(n));
  for (size_t pos = 0; pos < names.size();) {
    std::string name(names.c_str() + pos);
    pos += name.size() + 1;
    if (!keptXattr(name)) continue;
    std::string value(256, '\0');
    ssize_t v;
    for (;;) {
      v = ::fgetxattr(fd, name.c_str(), value.data(), value.size());
      if (v >= 0 || errno != ERANGE) break;
      value.resize(value.size() * 4);
    }
    if (v < 0) {
      if (errno == ENODATA) continue;
      return sysError("fgetxattr " + name);
    }
    value.resize(size_t(v));
    out.emplace_back(name, value);
  }
  return out;
}

}  // namespace

void appendTarHeader(std::string& out, const std::string& name, char type, mode_t mode,
                     uid_t uid, gid_t gid, uint64_t size, int64_t mtimeSec, long mtimeNsec,
                     const std::string& linkName, unsigned devMajor, unsigned devMinor,
                     const std::vector<std::pair<std::string, std::string>>& xattrs) {
  std::string pax;
  if (name.size() > 100) paxRecord(pax, "path", name);
  if (linkName.size() > 100) paxRecord(pax, "linkpath", linkName);
  if (uid > 07777777) paxRecord(pax, "uid", std::to_string(uid));
  if (gid > 07777777) paxRecord(pax, "gid", std::to_string(gid));
  if (size > 077777777777ull) paxRecord(pax, "size", std::to_string(size));
  char mt[64];
  std::snprintf(mt, sizeof mt, "%lld.%09ld", static_cast<long long>(mtimeSec), mtimeNsec);
  paxRecord(pax, "mtime", mt);
  for (auto& [k, v] : xattrs) paxRecord(pax, "SCHILY.xattr." + k, v);
  std::string paxName = "./PaxHeaders/" + name.substr(name.rfind('/', name.size() - 2) + 1);
  if (paxName.size() > 100) paxName = paxName.substr(0, 100);
  ustarBlock(out, paxName, 'x', 0644, 0, 0, pax.size(), mtimeSec, "", 0, 0);
  out += pax;
  pad(out);
  ustarBlock(out, name.size() > 100 ? name.substr(0, 100) : name, type, mode, uid, gid, size,
             mtimeSec, linkName.size() > 100 ? linkName.substr(0, 100) : linkName, devMajor,
             devMinor);
}

Result<std::unique_ptr<UpperTar>> UpperTar::open(int root, bool freeze) {
  std::unique_ptr<UpperTar> t(new UpperTar());
  t->root_ = root;
  if (freeze) {
    // Written back and frozen: the disk holds one consistent moment, and
    // writers in the guest wait until the destructor thaws it.
    UniqueFd fs(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fs) return sysError("open upper dir");
    if (::syncfs(fs.get()) != 0) return sysError("syncfs");
    if (::ioctl(fs.get(), FIFREEZE, 0) != 0) return sysError("freeze the writable disk");
    t->frozen_ = std::move(fs);
  }
  UniqueFd dir(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return sysError("open upper dir");
  struct stat st;
  if (::fstat(dir.get(), &st) != 0) return sysError("stat upper dir");
  ASSIGN_OR_RETURN(auto xattrs, xattrsOf(dir.get()));
  appendTarHeader(t->pending_, "./", '5', st.st_mode, st.st_uid, st.st_gid, 0, st.st_mtim.tv_sec,
                  st.st_mtim.tv_nsec, "", 0, 0, xattrs);
  RETURN_IF_ERROR(t->pushDir(std::move(dir), "./"));
  return t;
}

UpperTar::~UpperTar() {
  if (frozen_) ::ioctl(frozen_.get(), FITHAW, 0);
}

Status UpperTar::pushDir(UniqueFd fd, std::string rel) {
  Dir d;
  int copy = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, 3);
  if (copy < 0) return sysError("dup " + rel);
  DIR* dp = ::fdopendir(copy);
  if (!dp) {
    ::close(copy);
    return sysError("opendir " + rel);
  }
  errno = 0;
  while (auto* e = ::readdir(dp)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    d.names.emplace_back(e->d_name);
  }
  int err = errno;
  ::closedir(dp);
  if (err != 0) return sysError("readdir " + rel, err);
  std::sort(d.names.begin(), d.names.end());
  d.fd = std::move(fd);
  d.rel = std::move(rel);
  stack_.push_back(std::move(d));
  return Status::ok();
}

Status UpperTar::addEntry(int parent, const std::string& name, const std::string& rel) {
  struct stat st;
  if (::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return Status::ok();  // gone meanwhile (not frozen)
    return sysError("stat " + rel);
  }
  int64_t sec = st.st_mtim.tv_sec;
  long nsec = st.st_mtim.tv_nsec;
  if (S_ISDIR(st.st_mode)) {
    UniqueFd fd(::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) return sysError("open " + rel);
    ASSIGN_OR_RETURN(auto xattrs, xattrsOf(fd.get()));
    appendTarHeader(pending_, rel + "/", '5', st.st_mode, st.st_uid, st.st_gid, 0, sec, nsec, "",
                    0, 0, xattrs);
    return pushDir(std::move(fd), rel + "/");
  }
  if (S_ISREG(st.st_mode)) {
    if (st.st_nlink > 1) {
      auto key = std::make_pair(st.st_dev, st.st_ino);
      if (auto it = links_.find(key); it != links_.end()) {
        appendTarHeader(pending_, rel, '1', st.st_mode, st.st_uid, st.st_gid, 0, sec, nsec,
                        it->second, 0, 0, {});
        return Status::ok();
      }
      links_[key] = rel;
    }
    UniqueFd fd(::openat(parent, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) return sysError("open " + rel);
    struct stat fst;
    if (::fstat(fd.get(), &fst) != 0) return sysError("stat " + rel);
    ASSIGN_OR_RETURN(auto xattrs, xattrsOf(fd.get()));
    uint64_t size = uint64_t(fst.st_size);
    appendTarHeader(pending_, rel, '0', fst.st_mode, fst.st_uid, fst.st_gid, size, sec, nsec, "",
                    0, 0, xattrs);
    file_ = std::move(fd);
    fileLeft_ = size;
    padLeft_ = (kBlock - size % kBlock) % kBlock;
    return Status::ok();
  }
  if (S_ISLNK(st.st_mode)) {
    std::string target(size_t(st.st_size) + 1, '\0');
    ssize_t n = ::readlinkat(parent, name.c_str(), target.data(), target.size());
    if (n < 0) return sysError("readlink " + rel);
    target.resize(size_t(n));
    appendTarHeader(pending_, rel, '2', st.st_mode, st.st_uid, st.st_gid, 0, sec, nsec, target, 0,
                    0, {});
    return Status::ok();
  }
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISFIFO(st.st_mode)) {
    char type = S_ISCHR(st.st_mode) ? '3' : S_ISBLK(st.st_mode) ? '4' : '6';
    appendTarHeader(pending_, rel, type, st.st_mode, st.st_uid, st.st_gid, 0, sec, nsec, "",
                    major(st.st_rdev), minor(st.st_rdev), {});
  }
  return Status::ok();  // a socket: tar has no such entry
}

Status UpperTar::nextEntry() {
  while (!stack_.empty()) {
    Dir& d = stack_.back();
    if (d.next >= d.names.size()) {
      stack_.pop_back();
      continue;
    }
    std::string name = d.names[d.next++];
    size_t before = pending_.size() - pendingOff_;
    int parent = d.fd.get();
    std::string rel = d.rel + name;
    // (addEntry may push a Dir, invalidating d.)
    RETURN_IF_ERROR(addEntry(parent, name, rel));
    if (pending_.size() - pendingOff_ > before || file_) return Status::ok();
  }
  // Two zero blocks end the archive.
  pending_.append(2 * kBlock, '\0');
  ended_ = true;
  return Status::ok();
}

Status UpperTar::readChunk(std::string& out, size_t max) {
  out.clear();
  while (out.size() < max) {
    if (pendingOff_ < pending_.size()) {
      size_t n = std::min(max - out.size(), pending_.size() - pendingOff_);
      out.append(pending_, pendingOff_, n);
      pendingOff_ += n;
      if (pendingOff_ == pending_.size()) {
        pending_.clear();
        pendingOff_ = 0;
      }
      continue;
    }
    if (file_) {
      if (fileLeft_ > 0) {
        size_t want = size_t(std::min<uint64_t>(fileLeft_, max - out.size()));
        size_t at = out.size();
        out.resize(at + want);
        ssize_t n = ::read(file_.get(), out.data() + at, want);
        if (n < 0 && errno == EINTR) {
          out.resize(at);
          continue;
        }
        if (n < 0) return sysError("read");
        if (n == 0) {
          // Shorter than its header said (only when not frozen): zeros keep
          // the archive well-formed.
          std::memset(out.data() + at, 0, want);
          n = ssize_t(want);
        }
        out.resize(at + size_t(n));
        fileLeft_ -= uint64_t(n);
        continue;
      }
      file_.reset();
      pending_.append(padLeft_, '\0');
      padLeft_ = 0;
      continue;
    }
    if (ended_) break;
    RETURN_IF_ERROR(nextEntry());
  }
  return Status::ok();
}

}  // namespace dsec::aether
