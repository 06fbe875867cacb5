#include "aether/container_init.h"

#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "aether/json_fields.h"
#include "common/fd.h"

namespace dsec::aether {

// Where a pre-pivoted agent attaches the sandbox's root, in its stage.
constexpr const char* kPivotedRoot = "/root";

namespace {

Status mountOrError(const char* source, const std::string& target, const char* fstype,
                    unsigned long flags, const char* data, const char* step) {
  if (::mount(source, target.c_str(), fstype, flags, data) < 0) {
    return sysError(std::string(step) + " " + target);
  }
  return Status::ok();
}

Status ensureDir(const std::string& path, mode_t mode) {
  if (::mkdir(path.c_str(), mode) == 0 || errno == EEXIST) return Status::ok();
  return sysError("mkdir " + path);
}

Status writeFile(const std::string& path, std::string_view content, mode_t mode) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode));
  if (!fd) return sysError("open " + path);
  while (!content.empty()) {
    ssize_t n = ::write(fd.get(), content.data(), content.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return sysError("write " + path);
    }
    content.remove_prefix(static_cast<size_t>(n));
  }
  return Status::ok();
}

// The longest directory prefix shared by all paths ("/var/lib/dsec/layers").
std::string commonDir(const std::vector<std::string>& paths) {
  std::string prefix = paths.front();
  for (const auto& p : paths) {
    size_t n = 0;
    while (n < prefix.size() && n < p.size() && prefix[n] == p[n]) ++n;
    prefix.resize(n);
  }
  size_t slash = prefix.rfind('/');
  if (slash == std::string::npos) return {};
  return prefix.substr(0, slash == 0 ? 1 : slash);
}

Status mountOverlay(const RootfsConfig& r) {
  auto options = [&](const std::string& strip) {
    std::string o = "lowerdir=";
    for (size_t i = 0; i < r.lower.size(); ++i) {
      if (i > 0) o += ':';
      o += strip.empty() ? r.lower[i] : r.lower[i].substr(strip.size() == 1 ? 1 : strip.size() + 1);
    }
    // xino=on: inode numbers as on one filesystem (edge/userns.cc, overlayOf).
    o += ",upperdir=" + r.upper + ",workdir=" + r.work +
         ",index=off,metacopy=off,redirect_dir=off,xino=on";
    return o;
  };
  std::string opts = options({});
  // mount(2) takes at most one page of options. Many layers exceed it, so
  // (like Docker) name the lower layers relative to their common directory
  // and mount from inside it.
  // The working directory is given back afterwards: prestage's staged
  // mounts may be named relative to it.
  UniqueFd cwd(::open(".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (opts.size() >= 4000) {
    std::string dir = commonDir(r.lower);
    if (dir.empty() || ::chdir(dir.c_str()) < 0) {
      return Status(Code::kInternal, "mount overlay: too many layers for the mount options");
    }
    opts = options(dir);
    if (opts.size() >= 4000) {
      return Status(Code::kInternal, "mount overlay: too many layers for the mount options");
    }
  }
  // nodev: device nodes in image layers or written by the sandbox are inert;
  // the usable ones live on the separate /dev tmpfs.
  Status st =
      mountOrError("overlay", r.target, "overlay", MS_NODEV, opts.c_str(), "mount overlay");
  if (cwd ? ::fchdir(cwd.get()) < 0 : ::chdir("/") < 0) return sysError("chdir back");
  return st;
}

Status makeDevNode(const std::string& dev, const char* name, unsigned major, unsigned minor) {
  std::string path = dev + "/" + name;
  if (::mknod(path.c_str(), S_IFCHR | 0666, makedev(major, minor)) == 0) {
    // mknod honours the umask; these nodes are world read-write.
    if (::chmod(path.c_str(), 0666) < 0) return sysError("chmod " + path);
    return Status::ok();
  }
  if (errno != EPERM) return sysError("mknod " + path);
  // In a user namespace mknod is refused: bind the host's node instead.
  RETURN_IF_ERROR(writeFile(path, "", 0666));
  std::string host = std::string("/dev/") + name;
  return mountOrError(host.c_str(), path, nullptr, MS_BIND, nullptr, "bind");
}

Status mountDev(const std::string& root) {
  std::string dev = root + "/dev";
  RETURN_IF_ERROR(ensureDir(dev, 0755));
  RETURN_IF_ERROR(mountOrError("tmpfs", dev, "tmpfs", MS_NOSUID | MS_STRICTATIME,
                               "mode=755,size=65536k", "mount"));
  struct Node {
    const char* name;
    unsigned major, minor;
  };
  for (const Node& n : {Node{"null", 1, 3}, Node{"zero", 1, 5}, Node{"full", 1, 7},
                        Node{"random", 1, 8}, Node{"urandom", 1, 9}, Node{"tty", 5, 0}}) {
    RETURN_IF_ERROR(makeDevNode(dev, n.name, n.major, n.minor));
  }
  RETURN_IF_ERROR(ensureDir(dev + "/pts", 0755));
  // gid=5 is "tty" in most images; a user namespace without that gid mapped
  // rejects the option, so retry without it.
  if (::mount("devpts", (dev + "/pts").c_str(), "devpts", MS_NOSUID | MS_NOEXEC,
              "newinstance,ptmxmode=0666,mode=0620,gid=5") < 0) {
    RETURN_IF_ERROR(mountOrError("devpts", dev + "/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                                 "newinstance,ptmxmode=0666,mode=0620", "mount"));
  }
  if (::symlink("pts/ptmx", (dev + "/ptmx").c_str()) < 0)
    return sysError("symlink " + dev + "/ptmx");
  // /dev/shm is a directory of the /dev tmpfs (whose 64 MiB it shares)
  // bound on itself for its own flags, not a tmpfs of its own: every
  // superblock costs each memory cgroup on the host shrinker bookkeeping and
  // each cgroup's removal a walk (docs/container-backend.md, "Kernel cost per
  // sandbox").
  RETURN_IF_ERROR(ensureDir(dev + "/shm", 01777));
  // mkdir honours the umask (and may drop the sticky bit): world-writable
  // and sticky, as the tmpfs's mode=1777 made it.
  if (::chmod((dev + "/shm").c_str(), 01777) < 0) return sysError("chmod " + dev + "/shm");
  RETURN_IF_ERROR(mountOrError((dev + "/shm").c_str(), dev + "/shm", nullptr, MS_BIND, nullptr,
                               "bind"));
  RETURN_IF_ERROR(mountOrError(nullptr, dev + "/shm", nullptr,
                               MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr,
                               "remount"));
  struct Link {
    const char* target;
    const char* name;
  };
  for (const Link& l : {Link{"/proc/self/fd", "fd"}, Link{"/proc/self/fd/0", "stdin"},
                        Link{"/proc/self/fd/1", "stdout"}, Link{"/proc/self/fd/2", "stderr"}}) {
    std::string path = dev + "/" + l.name;
    if (::symlink(l.target, path.c_str()) < 0) return sysError("symlink " + path);
  }
  return Status::ok();
}

// What Docker hides from containers: kernel interfaces that leak host
// information or let a scan crash or reconfigure the host kernel.
constexpr const char* kMaskedPaths[] = {
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
};
constexpr const char* kReadOnlyPaths[] = {
    "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
};

// `dir` when it is an empty directory on a read-only mount (what the edge
// offers as the node's mask), else empty: masks then get a tmpfs each rather
// than a bind of anything a sandbox could write or read.
std::string usableMaskDir(const std::string& dir) {
  if (dir.empty()) return {};
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY)) return {};
  DIR* d = ::opendir(dir.c_str());
  if (!d) return {};
  bool empty = true;
  while (auto* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) empty = false;
  }
  ::closedir(d);
  return empty ? dir : std::string();
}

Status maskPaths(const std::string& root, const std::string& maskDir) {
  std::string null = root + "/dev/null";
  constexpr unsigned long kMaskFlags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC;
  for (const char* p : kMaskedPaths) {
    std::string path = root + p;
    struct stat st;
    if (::stat(path.c_str(), &st) < 0) continue;  // this kernel has no such file
    if (S_ISDIR(st.st_mode) && !maskDir.empty()) {
      // The node's one empty read-only tmpfs, bound: no superblock per mask.
      RETURN_IF_ERROR(mountOrError(maskDir.c_str(), path, nullptr, MS_BIND, nullptr, "mask"));
      RETURN_IF_ERROR(mountOrError(nullptr, path, nullptr, MS_BIND | MS_REMOUNT | kMaskFlags,
                                   nullptr, "mask read-only"));
    } else if (S_ISDIR(st.st_mode)) {
      RETURN_IF_ERROR(mountOrError("tmpfs", path, "tmpfs", kMaskFlags, "size=0", "mask"));
    } else {
      RETURN_IF_ERROR(mountOrError(null.c_str(), path, nullptr, MS_BIND, nullptr, "mask"));
    }
  }
  for (const char* p : kReadOnlyPaths) {
    std::string path = root + p;
    if (::access(path.c_str(), F_OK) < 0) continue;
    RETURN_IF_ERROR(mountOrError(path.c_str(), path, nullptr, MS_BIND | MS_REC, nullptr, "bind"));
    // A remount must repeat proc's nosuid/nodev/noexec: in a user namespace
    // those flags are locked and dropping them is EPERM.
    RETURN_IF_ERROR(mountOrError(
        nullptr, path, nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
        nullptr, "remount read-only"));
  }
  return Status::ok();
}

// /proc, /sys and /dev of a sandbox whose root is `root`, with Docker's masks.
Status mountKernelFs(const std::string& root, const std::string& maskDir) {
  RETURN_IF_ERROR(ensureDir(root + "/proc", 0555));
  RETURN_IF_ERROR(mountOrError("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                               nullptr, "mount"));
  RETURN_IF_ERROR(ensureDir(root + "/sys", 0555));
  RETURN_IF_ERROR(mountOrError("sysfs", root + "/sys", "sysfs",
                               MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr, "mount"));
  RETURN_IF_ERROR(mountDev(root));
  return maskPaths(root, maskDir);
}

Status pivotInto(const std::string& root) {
  // pivot_root(".", ".") stacks the old root on top of the new one; detaching
  // "." afterwards drops the old root without needing a directory for it.
  if (::chdir(root.c_str()) < 0) return sysError("chdir " + root);
  if (::syscall(SYS_pivot_root, ".", ".") < 0) return sysError("pivot_root " + root);
  if (::umount2(".", MNT_DETACH) < 0) return sysError("umount old root");
  if (::chdir("/") < 0) return sysError("chdir /");
  return Status::ok();
}

// Pre-pivoted agents (prestage with pivot): the root is the stage tmpfs, and
// the sandbox's root is mounted on top of it and entered with chroot. No
// pivot_root (which walks every task on the host, chroot_fs_refs) and no
// unmount (which waits for an RCU grace period) on the create path: prestage
// paid both. What lies beneath, should a process leave the chroot, is the
// stage: empty directories (docs/container-backend.md).
Status enterRoot(const std::string& root) {
  if (::chdir(root.c_str()) < 0) return sysError("chdir " + root);
  RETURN_IF_ERROR(mountOrError(".", "/", nullptr, MS_MOVE, nullptr, "move root"));
  if (::chroot(".") < 0) return sysError("chroot " + root);
  if (::chdir("/") < 0) return sysError("chdir /");
  return Status::ok();
}

Status setHostname(const std::string& hostname) {
  if (::sethostname(hostname.data(), hostname.size()) < 0) return sysError("sethostname");
  struct stat st;
  // An image without /etc gets none: the sandbox's files are the image's.
  if (::stat("/etc", &st) < 0 || !S_ISDIR(st.st_mode)) return Status::ok();
  RETURN_IF_ERROR(writeFile("/etc/hostname", hostname + "\n", 0644));
  std::string hosts =
      "127.0.0.1\tlocalhost\n"
      "::1\tlocalhost ip6-localhost ip6-loopback\n"
      "127.0.1.1\t" +
      hostname + "\n";
  return writeFile("/etc/hosts", hosts, 0644);
}

void setOwnOomScore() {
  UniqueFd fd(::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC));
  if ((!fd || ::write(fd.get(), "-1000", 5) < 0) && errno != EACCES && errno != EPERM) {
    // Needs CAP_SYS_RESOURCE in the initial user namespace (the edge sets it
    // from outside too); without it the sandbox still works, aether is just
    // not spared by the OOM killer, so only unexpected errors are worth a line.
    std::fprintf(stderr, "dsec-aether: oom_score_adj -1000: %s\n", std::strerror(errno));
  }
}

bool validHostname(const std::string& h) {
  if (h.size() > 64) return false;
  for (char c : h) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

Result<InitConfig> parseInitConfig(std::string_view payload) {
  ASSIGN_OR_RETURN(Json j, parseObject(payload));
  InitConfig c;
  RETURN_IF_ERROR(readString(j, "hostname", false, c.hostname));
  if (!validHostname(c.hostname)) {
    return invalidArg("hostname", "hostname must be at most 64 of [A-Za-z0-9.-]");
  }
  RETURN_IF_ERROR(readStringList(j, "env", false, c.env));
  RETURN_IF_ERROR(readBool(j, "reattach", c.reattach));
  if (auto fc = j.find("fncall"); fc != j.end() && !fc->is_null()) {
    ASSIGN_OR_RETURN(FncallConfig f, parseFncallConfig(*fc));
    c.fncall = std::move(f);
  }
  RETURN_IF_ERROR(readString(j, "working_dir", false, c.working_dir));
  if (!c.working_dir.empty() && (c.working_dir[0] != '/' || c.working_dir.size() >= 4096)) {
    return invalidArg("working_dir", "working_dir must be an absolute path");
  }
  if (auto pol = j.find("policy"); pol != j.end() && !pol->is_null()) {
    if (!pol->is_object()) return invalidArg("policy", "policy must be an object");
    c.policy = *pol;
  }
  auto it = j.find("rootfs");
  if (it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArg("rootfs", "rootfs must be an object");
    RootfsConfig r;
    RETURN_IF_ERROR(readBool(*it, "mount_fd", r.mountFd));
    RETURN_IF_ERROR(readBool(*it, "disk_fd", r.diskFd));
    if (r.diskFd && !r.mountFd) return invalidArg("rootfs.disk_fd", "disk_fd needs mount_fd");
    if (r.mountFd) {
      RETURN_IF_ERROR(readString(*it, "target", true, r.target));
      bool dotdot = r.target == ".." || r.target.rfind("../", 0) == 0 ||
                    r.target.find("/../") != std::string::npos ||
                    (r.target.size() >= 3 && r.target.compare(r.target.size() - 3, 3, "/..") == 0);
      if (r.target.empty() || r.target.find('\0') != std::string::npos || dotdot ||
          r.target.size() >= 4096) {
        return invalidArg("rootfs.target", "rootfs.target must be a path without '..'");
      }
      c.rootfs = std::move(r);
      return c;
    }
    RETURN_IF_ERROR(readStringList(*it, "lower", true, r.lower));
    if (r.lower.empty()) return invalidArg("rootfs.lower", "rootfs.lower must not be empty");
    RETURN_IF_ERROR(readPath(*it, "upper", r.upper));
    RETURN_IF_ERROR(readPath(*it, "work", r.work));
    RETURN_IF_ERROR(readPath(*it, "target", r.target));
    for (const auto& l : r.lower) {
      if (l.empty() || l[0] != '/')
        return invalidArg("rootfs.lower", "layer paths must be absolute");
    }
    // overlayfs splits its options at ',' and lowerdir at ':'.
    auto bad = [](const std::string& p) { return p.find_first_of(",:") != std::string::npos; };
    for (const auto& l : r.lower) {
      if (bad(l)) return invalidArg("rootfs.lower", "layer paths must not contain ',' or ':'");
    }
    if (bad(r.upper) || bad(r.work)) {
      return invalidArg("rootfs", "upper and work must not contain ',' or ':'");
    }
    c.rootfs = std::move(r);
  }
  return c;
}

Status bringUpInterface(const char* name) {
  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock) return sysError("socket");
  struct ifreq ifr;
  std::memset(&ifr, 0, sizeof ifr);
  std::strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
  if (::ioctl(sock.get(), SIOCGIFFLAGS, &ifr) < 0)
    return sysError(std::string("get flags of ") + name);
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &ifr) < 0) return sysError(std::string("bring up ") + name);
  return Status::ok();
}

Status setupContainer(const InitConfig& config, int rootfsFd, const std::string& staged,
                      const std::string& maskDir) {
  if (config.rootfs && config.rootfs->mountFd != (rootfsFd >= 0)) {
    return invalidArg("rootfs.mount_fd", config.rootfs->mountFd
                                             ? "mount_fd is set but no mount fd came with init"
                                             : "a mount fd came with init without mount_fd");
  }
  // prestage(..., pivot = true) left us in the stage ("/").
  const bool prePivoted = staged == "/";
  if (config.rootfs) {
    const RootfsConfig& r = *config.rootfs;
    const std::string root = prePivoted ? std::string(kPivotedRoot) : r.target;
    // Nothing mounted from here on may propagate back to the host.
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) < 0) {
      return sysError("make / private");
    }
    if (r.mountFd) {
      // The edge's overlay (host user namespace, nodev) joins our mount
      // namespace. Its flags are not locked for us, which is why seccomp
      // denies mount calls to everything that runs after this setup.
      // The target may be in our private stage (the edge's detached layout),
      // where nothing made it yet.
      RETURN_IF_ERROR(ensureDir(root, 0755));
      if (::syscall(SYS_move_mount, rootfsFd, "", AT_FDCWD, root.c_str(),
                    0x4 /*MOVE_MOUNT_F_EMPTY_PATH*/) < 0) {
        return sysError("attach rootfs " + root);
      }
    } else if (prePivoted) {
      return invalidArg("rootfs.mount_fd",
                        "an agent staged with --pivot needs its rootfs as a mount fd");
    } else {
      RETURN_IF_ERROR(mountOverlay(r));
    }
    if (staged.empty()) {
      RETURN_IF_ERROR(mountKernelFs(root, usableMaskDir(maskDir)));
    } else {
      // Moved with whatever is mounted beneath them (the masks).
      for (const char* sub : {"/proc", "/sys", "/dev"}) {
        RETURN_IF_ERROR(ensureDir(root + sub, sub[1] == 'd' ? 0755 : 0555));
        RETURN_IF_ERROR(mountOrError((staged + sub).c_str(), root + sub, nullptr, MS_MOVE,
                                     nullptr, "move staged"));
      }
    }
    RETURN_IF_ERROR(prePivoted ? enterRoot(root) : pivotInto(root));
    if (!config.hostname.empty()) RETURN_IF_ERROR(setHostname(config.hostname));
    if (config.fncall) RETURN_IF_ERROR(setupFncallRoot(*config.fncall));
    if (staged.empty()) RETURN_IF_ERROR(bringUpInterface("lo"));
    if (::unshare(CLONE_NEWCGROUP) < 0) return sysError("unshare cgroup namespace");
  }
  setOwnOomScore();
  return Status::ok();
}

Result<std::string> prestage(const std::string& stageDir, const std::string& maskDir,
                             bool pivot) {
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr) < 0) {
    return sysError("make / slave");
  }
  // Private (its parent is a slave): nothing mounted beneath it propagates.
  RETURN_IF_ERROR(mountOrError("tmpfs", stageDir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                               "mode=700,size=64k", "mount stage"));
  Status st = mountKernelFs(stageDir, usableMaskDir(maskDir));
  if (st.isOk()) st = bringUpInterface("lo");  // the sandbox's own network namespace
  if (!st.isOk()) {
    // Half-staged mounts go with the stage; init mounts them afresh.
    (void)::umount2(stageDir.c_str(), MNT_DETACH);
    return st;
  }
  if (pivot) {
    // Into the stage now, off the create path; the host's tree goes. A
    // failure here leaves no usable agent: the edge sees it exit.
    RETURN_IF_ERROR(pivotInto(stageDir).withContext("pivot into the stage"));
    return std::string("/");
  }
  return stageDir;
}

}  // namespace dsec::aether
