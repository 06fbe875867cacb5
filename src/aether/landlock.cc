#include "aether/landlock.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#ifndef LANDLOCK_ACCESS_FS_REFER
#define LANDLOCK_ACCESS_FS_REFER (1ULL << 13)
#endif
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif

namespace dsec::aether {

namespace {

// LANDLOCK_SCOPE_* (ABI 6).
constexpr uint64_t kScopeAbstractUnixSocket = 1u << 0;
constexpr uint64_t kScopeSignal = 1u << 1;

bool isOrUnder(const std::string& path, const std::string& dir) {
  return path == dir || (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
                         (dir == "/" || path[dir.size()] == '/'));
}

struct Walker {
  int ruleset;
  int abi;
  const std::vector<std::string>& readonly;

  Status allow(const std::string& path, bool dir) {
    return allowBeneath(ruleset, path, dir ? writeRights(abi) : fileRights(abi), true);
  }

  // Grants the rights beneath every entry of `dir` outside the read-only set.
  Status walk(const std::string& dir) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return sysError("opendir " + dir);
    Status st;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string path = (dir == "/" ? "" : dir) + "/" + name;
      struct stat sb;
      if (::lstat(path.c_str(), &sb) != 0 || S_ISLNK(sb.st_mode)) continue;  // a symlink's target has its own rule
      bool readOnly = false, ancestor = false;
      for (const auto& ro : readonly) {
        readOnly = readOnly || isOrUnder(path, ro);
        ancestor = ancestor || (ro != path && isOrUnder(ro, path));
      }
      if (readOnly) continue;
      st = ancestor && S_ISDIR(sb.st_mode) ? walk(path) : allow(path, S_ISDIR(sb.st_mode));
      if (!st.isOk()) break;
    }
    ::closedir(d);
    return st;
  }
};

}  // namespace

int landlockAbi() {
  long v = ::syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  return v < 0 ? 0 : int(v);
}

uint64_t writeRights(int abi) {
  uint64_t r = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |
               LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR |
               LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
               LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
               LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
  if (abi >= 2) r |= LANDLOCK_ACCESS_FS_REFER;
  if (abi >= 3) r |= LANDLOCK_ACCESS_FS_TRUNCATE;
  return r;
}

uint64_t fileRights(int abi) {
  return LANDLOCK_ACCESS_FS_WRITE_FILE | (abi >= 3 ? LANDLOCK_ACCESS_FS_TRUNCATE : 0);
}

Result<UniqueFd> createRuleset(int abi, uint64_t handledFs, bool scope) {
  // ABI 6 added handled_access_net (ABI 4) and scoped to the struct; the
  // kernel's header here may predate both, and an older kernel refuses a
  // larger struct with fields it does not know set.
  struct {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
  } attr{handledFs, 0, 0};
  size_t size = sizeof attr.handled_access_fs;
  if (scope && abi >= 6) {
    attr.scoped = kScopeAbstractUnixSocket | kScopeSignal;
    size = sizeof attr;
  }
  UniqueFd rs(int(::syscall(SYS_landlock_create_ruleset, &attr, size, 0)));
  if (!rs) return sysError("landlock_create_ruleset");
  ::fcntl(rs.get(), F_SETFD, FD_CLOEXEC);
  return rs;
}

Status allowBeneath(int ruleset, const std::string& path, uint64_t access, bool noFollow) {
  UniqueFd fd(::open(path.c_str(), O_PATH | O_CLOEXEC | (noFollow ? O_NOFOLLOW : 0)));
  if (!fd) return errno == ENOENT ? Status::ok() : sysError("open " + path);
  landlock_path_beneath_attr attr{};
  attr.allowed_access = access;
  attr.parent_fd = fd.get();
  if (::syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &attr, 0) != 0) {
    return sysError("landlock_add_rule " + path);
  }
  return Status::ok();
}

Result<UniqueFd> buildWriteRuleset(const std::vector<std::string>& readonly,
                                   const std::string& root) {
  int abi = landlockAbi();
  if (abi <= 0) return Status(Code::kFailedPrecondition, "Landlock is not available");
  ASSIGN_OR_RETURN(UniqueFd rs, createRuleset(abi, writeRights(abi), false));
  Walker w{rs.get(), abi, readonly};
  RETURN_IF_ERROR(w.walk(root));
  return rs;
}

}  // namespace dsec::aether
