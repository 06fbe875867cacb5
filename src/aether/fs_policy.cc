#include "aether/fs_policy.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace dsec::aether {

namespace {
// An empty, unreadable regular file to cover hidden files with; on /dev, a
// tmpfs private to the sandbox.
constexpr const char* kEmptyFile = "/dev/.dsec-hidden";

Status ensureEmptyFile() {
  int fd = ::open(kEmptyFile, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) return sysError(std::string("create ") + kEmptyFile);
  ::close(fd);
  return Status::ok();
}
}  // namespace

void FsPolicy::clear() {
  for (auto it = mounts_.rbegin(); it != mounts_.rend(); ++it) ::umount2(it->c_str(), MNT_DETACH);
  mounts_.clear();
}

Status FsPolicy::apply(const std::vector<std::string>& readonly,
                       const std::vector<std::string>& hidden, const std::string& resolvConf) {
  clear();
  auto fail = [this](Status st) {
    clear();
    return st;
  };
  if (!resolvConf.empty()) {
    // Beside it, then renamed over it: a symlink (systemd-resolved images)
    // is replaced, never followed.
    const char* tmp = "/etc/.resolv.conf.dsec";
    int fd = ::open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return fail(sysError("write /etc/resolv.conf"));
    bool ok = ::write(fd, resolvConf.data(), resolvConf.size()) == ssize_t(resolvConf.size());
    ::fchmod(fd, 0644);
    ::close(fd);
    if (!ok || ::rename(tmp, "/etc/resolv.conf") != 0) {
      Status st = sysError("write /etc/resolv.conf");
      ::unlink(tmp);
      return fail(st);
    }
  }
  for (const auto& p : readonly) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) continue;
    if (::mount(p.c_str(), p.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
      return fail(sysError("bind " + p));
    }
    mounts_.push_back(p);
    if (::mount(nullptr, p.c_str(), nullptr,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) != 0) {
      return fail(sysError("make " + p + " read-only"));
    }
  }
  for (const auto& p : hidden) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) continue;
    if (S_ISDIR(st.st_mode)) {
      if (::mount("hidden", p.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=0,mode=000") != 0) {
        return fail(sysError("hide " + p));
      }
    } else {
      if (Status e = ensureEmptyFile(); !e.isOk()) return fail(e);
      if (::mount(kEmptyFile, p.c_str(), nullptr, MS_BIND, nullptr) != 0) {
        return fail(sysError("hide " + p));
      }
      mounts_.push_back(p);
      if (::mount(nullptr, p.c_str(), nullptr,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  nullptr) != 0) {
        return fail(sysError("hide " + p));
      }
      continue;
    }
    mounts_.push_back(p);
  }
  return Status::ok();
}

}  // namespace dsec::aether
