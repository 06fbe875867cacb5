#include "edge/userns.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>

#include "common/util.h"

// Debian 12's headers predate parts of the mount API.
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef MOUNT_ATTR_NODEV
#define MOUNT_ATTR_NODEV 0x00000004
#endif
#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif

namespace dsec::edge {

namespace {

constexpr unsigned kOpenTreeClone = 1;            // OPEN_TREE_CLONE
constexpr unsigned kOpenTreeCloexec = O_CLOEXEC;  // OPEN_TREE_CLOEXEC
constexpr unsigned kMoveMountFEmptyPath = 0x4;    // MOVE_MOUNT_F_EMPTY_PATH
constexpr unsigned kFsopenCloexec = 1;            // FSOPEN_CLOEXEC
constexpr unsigned kFsconfigSetString = 1;        // FSCONFIG_SET_STRING
constexpr unsigned kFsconfigSetFd = 5;            // FSCONFIG_SET_FD
constexpr unsigned kFsconfigCmdCreate = 6;        // FSCONFIG_CMD_CREATE
constexpr unsigned kFsmountCloexec = 1;           // FSMOUNT_CLOEXEC

struct MountAttr {
  uint64_t attrSet, attrClr, propagation, usernsFd;
};

int mountSetattr(int fd, const char* path, unsigned flags, MountAttr* a) {
  return int(::syscall(SYS_mount_setattr, fd, path, flags, a, sizeof *a));
}

// The kernel's messages about a failed fsconfig/fsmount ("e overlay: ...").
std::string fsLog(int fs) {
  std::string out;
  char buf[512];
  for (;;) {
    ssize_t n = ::read(fs, buf, sizeof buf);
    if (n <= 0) break;
    if (!out.empty()) out += "; ";
    out.append(buf, size_t(n));
  }
  return out;
}

Status fsError(const std::string& what, int fs) {
  int err = errno;
  std::string log = fsLog(fs);
  return sysError(log.empty() ? what : what + " (" + log + ")", err);
}

// The throwaway child only has to exist until its namespace has an fd; it
// waits for EOF on a pipe, so it must close its copy of the write end.
int waitForParent(void* p) {
  auto* fds = static_cast<int*>(p);
  ::close(fds[1]);
  char c;
  while (::read(fds[0], &c, 1) < 0 && errno == EINTR) {
  }
  _exit(0);
}

Status writeMap(pid_t pid, const char* file, const std::string& map) {
  std::string path = "/proc/" + std::to_string(pid) + "/" + file;
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  if (::write(fd.get(), map.data(), map.size()) != ssize_t(map.size())) {
    return sysError("write " + path);
  }
  return Status::ok();
}

}  // namespace

Status writeIdMaps(pid_t pid, const std::string& map) {
  RETURN_IF_ERROR(writeMap(pid, "uid_map", map));
  return writeMap(pid, "gid_map", map);
}

Result<std::pair<uint32_t, uint32_t>> parseIdWindow(const std::string& text) {
  unsigned long long first = 0, last = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%llu-%llu%n", &first, &last, &used) != 2 ||
      size_t(used) != text.size() || !std::isdigit(static_cast<unsigned char>(text[0])) ||
      first > 0xffffffffull || last > 0xffffffffull) {
    return invalidArg("userns-window", "--userns-window must be FIRST-LAST, host ids (e.g. " +
                                           std::to_string(kDefaultUsernsFirst) + "-" +
                                           std::to_string(kDefaultUsernsLast) + "), not '" +
                                           text + "'");
  }
  return std::make_pair(uint32_t(first), uint32_t(last));
}

Result<uint32_t> parseIdWidth(const std::string& text) {
  constexpr unsigned long long kMax = 1ull << 31;
  unsigned long long n = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%llu%n", &n, &used) != 1 || size_t(used) != text.size() ||
      !std::isdigit(static_cast<unsigned char>(text[0])) || n < kDefaultUsernsWidth || n > kMax) {
    return invalidArg("userns-width", "--userns-width must be a number from " +
                                          std::to_string(kDefaultUsernsWidth) + " to " +
                                          std::to_string(kMax) + ", not '" + text + "'");
  }
  return uint32_t(n);
}

std::vector<IdRange> readSubordinateIds() {
  std::vector<IdRange> out;
  for (const char* f : {"/etc/subuid", "/etc/subgid"}) {
    auto text = readFile(f);
    if (!text.isOk()) continue;
    auto ranges = parseSubordinateIds(*text);
    out.insert(out.end(), ranges.begin(), ranges.end());
  }
  return out;
}

Result<IdRange> readIdMap(pid_t pid) {
  IdRange got[2];
  const char* files[2] = {"uid_map", "gid_map"};
  for (int i = 0; i < 2; ++i) {
    std::string path = "/proc/" + std::to_string(pid) + "/" + files[i];
    ASSIGN_OR_RETURN(std::string text, readFile(path));
    unsigned long inside = 0, base = 0, length = 0;
    int used = 0;
    if (std::sscanf(text.c_str(), " %lu %lu %lu %n", &inside, &base, &length, &used) != 3 ||
        size_t(used) != text.size() || inside != 0 || length == 0 || base > UINT32_MAX ||
        length > UINT32_MAX) {
      return Status(Code::kFailedPrecondition,
                    path + " is not one extent from 0: '" + text + "'");
    }
    got[i] = IdRange{uint32_t(base), uint32_t(length)};
  }
  if (!(got[0] == got[1])) {
    return Status(Code::kFailedPrecondition,
                  "uid_map and gid_map of " + std::to_string(pid) + " differ");
  }
  return got[0];
}

Result<UniqueFd> makeUsernsFd(const std::string& map) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd rd(p[0]), wr(p[1]);
  // No CLONE_VM: the child gets a copy of this stack and of `fds`.
  alignas(16) char stack[16 * 1024];
  int fds[2] = {rd.get(), wr.get()};
  pid_t pid = ::clone(waitForParent, stack + sizeof stack, CLONE_NEWUSER | SIGCHLD, fds);
  if (pid < 0) return sysError("clone(CLONE_NEWUSER)");
  Status st = writeIdMaps(pid, map);
  UniqueFd ns;
  if (st.isOk()) {
    std::string path = "/proc/" + std::to_string(pid) + "/ns/user";
    ns.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!ns) st = sysError("open " + path);
  }
  wr.reset();  // EOF: the child exits
  while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  if (!st.isOk()) return st;
  return ns;
}

Result<UniqueFd> idmappedClone(const std::string& dir, int usernsFd, bool readOnly) {
  UniqueFd m(
      int(::syscall(SYS_open_tree, AT_FDCWD, dir.c_str(), kOpenTreeClone | kOpenTreeCloexec)));
  if (!m) return sysError("open_tree " + dir);
  MountAttr a{};
  a.attrSet = (usernsFd >= 0 ? MOUNT_ATTR_IDMAP : 0) | (readOnly ? MOUNT_ATTR_RDONLY : 0);
  a.usernsFd = usernsFd >= 0 ? uint64_t(usernsFd) : 0;
  if (a.attrSet != 0 && mountSetattr(m.get(), "", AT_EMPTY_PATH, &a) != 0) {
    return sysError((usernsFd >= 0 ? "idmap mount of " : "read-only clone of ") + dir);
  }
  return m;
}

Status setMountReadOnly(int mountFd, bool readOnly) {
  MountAttr a{};
  (readOnly ? a.attrSet : a.attrClr) = MOUNT_ATTR_RDONLY;
  if (mountSetattr(mountFd, "", AT_EMPTY_PATH, &a) != 0) {
    return sysError(readOnly ? "make the mount read-only" : "make the mount writable");
  }
  return Status::ok();
}

namespace {

// One of the two: lower layers by mount fd or by path.
Result<UniqueFd> overlayOf(const std::vector<int>& lowerFds,
                           const std::vector<std::string>& lowerPaths, const std::string& upper,
                           const std::string& work) {
  UniqueFd fs(int(::syscall(SYS_fsopen, "overlay", kFsopenCloexec)));
  if (!fs) return sysError("fsopen overlay");
  auto config = [&](unsigned cmd, const char* key, const char* value, int aux) {
    return ::syscall(SYS_fsconfig, fs.get(), cmd, key, value, aux) == 0;
  };
  for (int fd : lowerFds) {
    if (!config(kFsconfigSetFd, "lowerdir+", nullptr, fd))
      return fsError("overlay lowerdir+", fs.get());
  }
  // One fsconfig per layer: no page-sized limit on the options, however many.
  for (const auto& p : lowerPaths) {
    if (!config(kFsconfigSetString, "lowerdir+", p.c_str(), 0))
      return fsError("overlay lowerdir+ " + p, fs.get());
  }
  // The options the sandbox's own mount(2) used before user namespaces:
  // without index, metacopy and redirect_dir the upper dir is a plain tree of
  // the sandbox's writes that pack_diff can turn into a layer.
  // xino=on (issue 31): every layer is a filesystem of its own (an EROFS
  // each, the upper on ext4 or tmpfs), and without xino readdir's d_ino is
  // the layer's inode number while stat's st_ino is overlayfs' own (or the
  // lower file's, for a copied-up one), so tools matching the two
  // (find -inum, rsync, backup and build tools) misbehave. xino puts the
  // layer's index in the inode number's high bits: d_ino == st_ino, one
  // st_dev, unique pairs across layers. "auto" would turn itself off here:
  // the layers share mkfs.erofs' fixed UUID. Costs: no measurable mount time
  // (1.0-1.3 ms either way); listing a big directory merged from several
  // layers looks each entry up (4,000 entries: 22-52 ms the first time
  // against 3-4 ms); inode numbers of lower files are >= 2^62
  // (docs/container-backend.md, "Inode numbers").
  const std::pair<const char*, const char*> opts[] = {{"upperdir", upper.c_str()},
                                                      {"workdir", work.c_str()},
                                                      {"index", "off"},
                                                      {"metacopy", "off"},
                                                      {"redirect_dir", "off"},
                                                      {"xino", "on"}};
  for (auto [key, value] : opts) {
    if (!config(kFsconfigSetString, key, value, 0)) {
      return fsError(std::string("overlay ") + key, fs.get());
    }
  }
  if (!config(kFsconfigCmdCreate, nullptr, nullptr, 0)) return fsError("overlay create", fs.get());
  // nodev: device nodes in image layers or written by the sandbox are inert;
  // the usable ones live on the sandbox's separate /dev tmpfs.
  UniqueFd m(int(::syscall(SYS_fsmount, fs.get(), kFsmountCloexec, MOUNT_ATTR_NODEV)));
  if (!m) return fsError("fsmount overlay", fs.get());
  return m;
}

}  // namespace

Result<UniqueFd> makeOverlay(const std::vector<int>& lowerFds, const std::string& upper,
                             const std::string& work) {
  return overlayOf(lowerFds, {}, upper, work);
}

Result<UniqueFd> makeOverlay(const std::vector<std::string>& lowerPaths, const std::string& upper,
                             const std::string& work) {
  return overlayOf({}, lowerPaths, upper, work);
}

Status attachMount(int mountFd, const std::string& target) {
  if (::syscall(SYS_move_mount, mountFd, "", AT_FDCWD, target.c_str(), kMoveMountFEmptyPath) != 0) {
    return sysError("move_mount to " + target);
  }
  return Status::ok();
}

Result<Userns> detectUserns(const UsernsOptions& opts) {
  Userns u;
  if (opts.mode != "auto" && opts.mode != "off") {
    return invalidArg("userns", "userns must be auto or off, not '" + opts.mode + "'");
  }
  ASSIGN_OR_RETURN(IdRangePool pool, IdRangePool::make(opts.windowFirst, opts.windowLast,
                                                       opts.width, opts.excluded));
  if (opts.mode == "off") {
    u.reason = "off (--userns off)";
    return u;
  }
  auto off = [&](const Status& why) -> Userns {
    u.reason = "off: unsupported here: " + why.toString();
    return std::move(u);
  };
  // Probed with the first range the pool would hand out (not taken).
  IdRange probe{opts.windowFirst, opts.width};
  if (auto first = IdRangePool(pool).allocate(); first.isOk()) probe = *first;
  auto ns = makeUsernsFd(mapLine(probe));
  if (!ns.isOk()) return off(ns.status());
  // Idmapped mounts and overlay layers by fd, tried on a throwaway tmpfs: a
  // kernel lacking either is found now, not at the first create.
  UniqueFd fs(int(::syscall(SYS_fsopen, "tmpfs", kFsopenCloexec)));
  if (!fs || ::syscall(SYS_fsconfig, fs.get(), kFsconfigCmdCreate, nullptr, nullptr, 0) != 0) {
    return off(sysError("fsopen tmpfs"));
  }
  UniqueFd tmp(int(::syscall(SYS_fsmount, fs.get(), kFsmountCloexec, 0)));
  if (!tmp) return off(sysError("fsmount tmpfs"));
  UniqueFd clone(int(
      ::syscall(SYS_open_tree, tmp.get(), "", kOpenTreeClone | kOpenTreeCloexec | AT_EMPTY_PATH)));
  if (!clone) return off(sysError("open_tree(OPEN_TREE_CLONE)"));
  MountAttr a{};
  a.attrSet = MOUNT_ATTR_IDMAP;
  a.usernsFd = uint64_t(ns->get());
  if (mountSetattr(clone.get(), "", AT_EMPTY_PATH, &a) != 0) {
    return off(sysError("idmapped mount (mount_setattr MOUNT_ATTR_IDMAP)"));
  }
  UniqueFd ov(int(::syscall(SYS_fsopen, "overlay", kFsopenCloexec)));
  if (!ov) return off(sysError("fsopen overlay"));
  if (::syscall(SYS_fsconfig, ov.get(), kFsconfigSetFd, "lowerdir+", nullptr, clone.get()) != 0) {
    return off(sysError("overlay lowerdir+ by fd (Linux >= 6.8)"));
  }
  u.enabled = true;
  u.windowFirst = opts.windowFirst;
  u.windowLast = opts.windowLast;
  u.width = opts.width;
  u.reason = "on: each sandbox maps ids 0-" + std::to_string(opts.width - 1) +
             " to host ids of its own, from " + std::to_string(opts.windowFirst) + "-" +
             std::to_string(opts.windowLast) + " (" + std::to_string(pool.capacity()) +
             " ranges)";
  u.pool = std::move(pool);
  return u;
}

}  // namespace dsec::edge
