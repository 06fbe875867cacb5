#include "edge/backends/container/container_backend.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <cstdlib>
#include <string_view>
#include <dirent.h>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/util.h"
#include "edge/sandbox_state.h"

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U
#endif

namespace dsec::edge {

using json = nlohmann::json;

namespace {

constexpr int kChildStackSize = 64 * 1024;
constexpr unsigned kMfdExec = MFD_EXEC;
constexpr int kAgentFd = 3;
constexpr int kExecFd = 4;
// Exit codes of a child that failed before it became the agent.
constexpr int kExitStdio = 120;
constexpr int kExitAgentFd = 121;
constexpr int kExitExecFd = 122;
constexpr int kExitCloseRange = 123;
constexpr int kExitExec = 124;
constexpr int kExitUserns = 125;
constexpr int kExitChdir = 126;
// In user namespace mode: the close-on-exec status pipe's write end in the
// child; EOF on it tells the edge the child exec'd.
constexpr int kStatusFd = 5;

const char* childFailure(int code) {
  switch (code) {
    case kExitStdio: return "could not set up stdio";
    case kExitAgentFd: return "could not pass the agent socket";
    case kExitExecFd: return "could not pass the agent binary";
    case kExitCloseRange: return "close_range(2) failed (kernel < 5.9?)";
    case kExitExec: return "execveat of the sealed agent binary failed (vm.memfd_noexec?)";
    case kExitUserns:
      return "could not become root of its user namespace";
    case kExitChdir:
      return "could not enter the sandbox root";
  }
  return "exited early";
}

// The sandbox agent's reattach descriptor (aether/main.cc).
constexpr int kAgentReattachFd = 9;
// Where the agent keeps the read-only clone of its sandbox's disk (detached
// layout; /dev/null otherwise): the edge takes it from there whenever it
// needs the disk (DiskQuota::lend), and so does a restarted edge.
constexpr int kAgentDiskFd = 10;

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

// The sandbox's disk, from its PID 1 (kAgentDiskFd): a read-only clone. An
// empty fd when that is gone or is not a directory (/dev/null: no disk).
UniqueFd sandboxDisk(int pidfd) {
  UniqueFd disk(int(::syscall(SYS_pidfd_getfd, pidfd, kAgentDiskFd, 0)));
  struct stat st;
  if (!disk || ::fstat(disk.get(), &st) != 0 || !S_ISDIR(st.st_mode)) return UniqueFd();
  ::fcntl(disk.get(), F_SETFD, FD_CLOEXEC);
  return disk;
}

class ContainerInstance : public Instance {
 public:
  const std::string& id() const override { return id_; }
  std::shared_ptr<AgentConn> agent() const override { return conn_; }
  Result<CgroupStats> stats() const override { return cgroups_->stats(id_); }
  Result<int64_t> oomKills() const override { return cgroups_->oomKills(id_); }
  Status freeze(bool frozen) override { return cgroups_->freeze(id_, frozen); }
  Status setLimits(const CgroupLimits& limits) override {
    CgroupLimits l = limits;
    l.cpu += cpuOverhead_;
    return cgroups_->setLimits(id_, l);
  }
  Result<UpperDir> upperDir() const override {
    if (!diskLent_) return UpperDir{dir_ + "/upper", UniqueFd()};
    UniqueFd disk = sandboxDisk(pidfd_.get());
    if (!disk) return Status(Code::kFailedPrecondition, id_ + ": its disk is gone");
    // Our pid, not "self": mkfs.erofs may be handed this path.
    std::string path = "/proc/" + std::to_string(::getpid()) + "/fd/" +
                       std::to_string(disk.get()) + "/upper";
    return UpperDir{std::move(path), std::move(disk)};
  }
  pid_t initPid() const override { return pid_; }
  IdRange idRange() const override { return range_; }
  Result<UniqueFd> openNetns() const override {
    // pid_ is our child and not reaped while the instance lives: no reuse.
    std::string path = "/proc/" + std::to_string(pid_) + "/ns/net";
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return sysError("open " + path);
    return UniqueFd(fd);
  }

  std::string id_;
  std::string dir_;        // the disk's root; unusable once lent
  bool diskLent_ = false;  // the disk is its PID 1's (DiskQuota::lend)
  IdRange range_;          // its user namespace's host ids (empty without userns)
  std::vector<std::string> layers_;  // acquired from the layer cache
  pid_t pid_ = -1;  // our child, or an adopted PID 1 pinned by pidfd_
  UniqueFd pidfd_;
  std::shared_ptr<AgentConn> conn_;
  Cgroups* cgroups_ = nullptr;
  double cpuOverhead_ = 0;  // SandboxSpec::cpuOverhead
};

// Everything the child needs, prepared before clone: between clone and exec
// the child shares our memory and may only make raw system calls.
struct ChildArgs {
  int agentFd;
  int execFd;
  int devNull;
  char* const* argv;
  char* const* envp;
  // User namespace mode only (else -1/null). goFd: read end of a pipe the
  // edge writes a byte to once the child's uid/gid maps are in place.
  // statusFd (high, close-on-exec): write end the child reports a failure's
  // exit code on; EOF without a byte means it exec'd.
  int goFd = -1;
  int goWriteFd = -1;  // the edge's end, closed first so the edge's death is EOF
  int statusFd = -1;
  // The sandbox root, the child's working directory: its stage directory
  // lies in it, and in user namespace mode it is entered while the child
  // still has host root's file access (the path is 0700 root), so aether
  // reaches its sandbox's dir relative to it.
  const char* workDir = nullptr;
};

// The child in user namespace mode does not run under CLONE_VFORK, so its
// failure must be told through the status pipe before it exits. (errno is
// shared with the parent thread under CLONE_VM: it is never read here.)
[[noreturn]] void childFail(int statusFd, int code) {
  if (statusFd >= 0) {
    char c = char(code);
    (void)!write(statusFd, &c, 1);
  }
  _exit(code);
}

int childMain(void* p) {
  auto* a = static_cast<ChildArgs*>(p);
  int status = a->statusFd;
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Spares are spawned by a low-priority thread; the sandbox must not inherit
  // that. (In a new user namespace this fails: takeAgent does it.)
  setpriority(PRIO_PROCESS, 0, 0);
  if (a->goFd >= 0) {
    // Until the edge has written our maps we are an unmapped id; afterwards
    // we must become the namespace's root by setresuid/setresgid: until then
    // our credentials keep host uid 0 and with it host root's file access.
    // Raw syscalls: glibc's set*id wrappers would signal the edge's threads,
    // with which we share memory.
    char c;
    close(a->goWriteFd);
    if (read(a->goFd, &c, 1) != 1) childFail(status, kExitUserns);
    if (chdir(a->workDir) != 0) childFail(status, kExitUserns);
    if (syscall(SYS_setgroups, 0, nullptr) != 0 || syscall(SYS_setresgid, 0, 0, 0) != 0 ||
        syscall(SYS_setresuid, 0, 0, 0) != 0) {
      childFail(status, kExitUserns);
    }
  } else if (chdir(a->workDir) != 0) {
    childFail(status, kExitChdir);
  }
  if (dup2(a->devNull, 0) < 0 || dup2(a->devNull, 1) < 0) childFail(status, kExitStdio);
  // dup2 onto itself would keep CLOEXEC; the agent must inherit fd 3.
  if (a->agentFd == kAgentFd ? fcntl(kAgentFd, F_SETFD, 0) < 0
                             : dup2(a->agentFd, kAgentFd) < 0) {
    childFail(status, kExitAgentFd);
  }
  if (dup2(a->execFd, kExecFd) < 0) childFail(status, kExitExecFd);
  if (fcntl(kExecFd, F_SETFD, FD_CLOEXEC) < 0) childFail(status, kExitExecFd);
  int keep = kExecFd;
  if (status >= 0) {
    // statusFd is high (>= 100), so the dup2s above left it alone.
    if (dup2(status, kStatusFd) < 0 || fcntl(kStatusFd, F_SETFD, FD_CLOEXEC) < 0) {
      childFail(status, kExitUserns);
    }
    status = kStatusFd;
    keep = kStatusFd;
  }
  // Nothing of the edge (API sockets, other sandboxes' agents) may reach the
  // sandbox: without close_range, refuse to start rather than leak.
  if (syscall(SYS_close_range, keep + 1, ~0U, 0) != 0) childFail(status, kExitCloseRange);
  syscall(SYS_execveat, kExecFd, "", a->argv, a->envp, AT_EMPTY_PATH);
  childFail(status, kExitExec);
}

Result<UniqueFd> sealedCopy(const std::string& path) {
  UniqueFd src(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!src) return sysError("open " + path);
  // Kernels with vm.memfd_noexec make memfds non-executable unless asked.
  UniqueFd mfd(::memfd_create("dsec-aether", MFD_CLOEXEC | MFD_ALLOW_SEALING | kMfdExec));
  if (!mfd && errno == EINVAL) {
    mfd.reset(::memfd_create("dsec-aether", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  }
  if (!mfd) return sysError("memfd_create");
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(src.get(), buf, sizeof buf);
    if (n < 0) return sysError("read " + path);
    if (n == 0) break;
    if (::write(mfd.get(), buf, size_t(n)) != n) return sysError("write memfd");
  }
  // Sealed: a sandbox that reaches its PID 1's executable (/proc/1/exe) can
  // neither change it for other sandboxes nor for later ones.
  if (::fcntl(mfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0) {
    return sysError("seal memfd");
  }
  // Keep it far from the low fds the child rearranges.
  int high = ::fcntl(mfd.get(), F_DUPFD_CLOEXEC, 100);
  if (high < 0) return sysError("dup memfd");
  return UniqueFd(high);
}

// Names of the sandbox directories ("sb-...") in `root`.
std::vector<std::string> sandboxDirs(const std::string& root) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(root.c_str())) {
    while (auto* e = ::readdir(d)) {
      if (startsWith(e->d_name, "sb-")) names.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return names;
}

// Where spare agents stage /proc, /sys and /dev: a directory in the sandbox
// root that no sandbox is named after (ids start with "sb-").
#define DSEC_STAGE_DIR ".stage"

// Where aether attaches the edge's overlay: in its private stage tmpfs,
// relative to its working directory (the sandbox root), so no directory of
// the edge's namespace is needed.
#define DSEC_ROOT_IN_STAGE DSEC_STAGE_DIR "/root"
// The node's empty read-only tmpfs for masked directories (aether --mask).
#define DSEC_MASK_DIR ".mask"


}  // namespace

Result<std::unique_ptr<ContainerBackend>> ContainerBackend::make(ContainerOptions opts,
                                                                  Cgroups* cgroups,
                                                                  LayerCache* layers,
                                                                  Reactor* reactor,
                                                                  const std::set<std::string>& keep) {
  std::unique_ptr<ContainerBackend> b(new ContainerBackend(opts, cgroups, layers, reactor));
  b->userns_ = opts.userns != nullptr && opts.userns->enabled;
  b->keep_ = keep;
  if (b->userns_) {
    // The re-adopted sandboxes keep their ranges; a range that cannot be
    // reserved (taken twice, or delegated to a host user since) makes its
    // sandbox fail adopt() and become an orphan.
    b->ranges_ = opts.userns->pool;
    for (auto& [id, r] : opts.keepRanges) {
      if (!keep.count(id)) continue;
      if (Status st = b->ranges_.reserve(r); st.isOk()) {
        b->rangeOf_[id] = r;
      } else {
        log::warn("sandbox " + id + ": its host id range: " + st.toString());
      }
    }
  }
  ASSIGN_OR_RETURN(b->aetherMemfd_, sealedCopy(opts.aetherPath));
  RETURN_IF_ERROR(makeDirs(opts.sandboxRoot, 0700));
  // A crashed predecessor's leftovers go before the disk quota may mount on
  // sandboxRoot itself: its sandboxes' processes (with their cgroups), then
  // its mounts (its sandbox pool, its sandboxes' tmpfs), then directories.
  // Sandboxes being re-adopted keep all of that, and the quota's pool too.
  for (auto& id : cgroups->list()) {
    if (keep.count(id)) continue;
    (void)cgroups->remove(id);
    b->orphans_.insert(id);
  }
  if (keep.empty()) {
    for (auto& mp : mountsUnder(opts.sandboxRoot)) {
      if (::umount2(mp.c_str(), MNT_DETACH) == 0) log::info("removed stale mount " + mp);
    }
    // Directories a run with another mechanism left (tmpfs mount points, plain
    // upper dirs) would be hidden under a pool mounted here. Subvolumes of a
    // btrfs root are refused (EXDEV) and left to cleanupOrphans.
    for (auto& name : sandboxDirs(opts.sandboxRoot)) {
      if (removeTree(opts.sandboxRoot + "/" + name).isOk()) b->orphans_.insert(name);
    }
  }
  // Issue 30: where the kernel allows, nothing per sandbox is mounted in our
  // namespace (container_backend.h).
  // DSEC_ATTACHED_DISKS=1 forces the older layout (tests of the fallback).
  const char* forced = ::getenv("DSEC_ATTACHED_DISKS");
  if (Status probe = forced && std::string_view(forced) == "1"
                         ? Status(Code::kFailedPrecondition, "DSEC_ATTACHED_DISKS=1")
                         : probeDetachedDisks();
      probe.isOk()) {
    b->detached_ = true;
  } else {
    log::warn("sandbox disks are mounted in the edge's namespace, so each create copies one "
              "mount per live sandbox (" + probe.toString() + ")");
  }
  // Before any agent is cloned, so that every agent's mount namespace has it.
  DiskQuotaOptions qo;
  qo.detach = b->detached_;
  qo.keep = keep;
  qo.root = opts.sandboxRoot;
  qo.poolImage = opts.diskPoolImage.empty() ? opts.sandboxRoot + ".img" : opts.diskPoolImage;
  qo.poolBytes = opts.diskPoolBytes;
  qo.mode = opts.diskQuota;
  qo.adopt = !keep.empty();
  qo.loops = opts.loops;
  ASSIGN_OR_RETURN(b->quota_, openDiskQuota(qo));
  if (!keep.empty()) {
    // The other sandboxes' directories go through the quota (a tmpfs or a
    // subvolume each); cleanupOrphans counts them.
    for (auto& name : sandboxDirs(opts.sandboxRoot)) {
      if (keep.count(name)) continue;
      if (Status st = b->quota_->remove(name); !st.isOk()) {
        log::error("cleanup orphan " + name + ": " + st.toString());
      }
      b->orphans_.insert(name);
    }
  }
  // With user namespaces, agents start with their working directory here and
  // look up their own sandbox's directory in it as host uid `base`: that
  // needs search (only) permission. Its parents stay 0700, and each sandbox's
  // directory is 0700 and owned by `base`, so no other host user gains
  // anything. Without, back to 0700 (a plain directory keeps its mode
  // across runs).
  mode_t rootMode = b->userns_ ? 0711 : 0700;
  if (::chmod(opts.sandboxRoot.c_str(), rootMode) != 0)
    return sysError("chmod " + opts.sandboxRoot);
  // The spares' stage (prestage), in the quota's root when it mounts one.
  std::string stage = opts.sandboxRoot + "/" DSEC_STAGE_DIR;
  if (::mkdir(stage.c_str(), 0700) != 0 && errno != EEXIST) return sysError("mkdir " + stage);
  // The node's one mask: an empty read-only tmpfs that aether binds over the
  // directories Docker masks, instead of a tmpfs (a superblock) per mask per
  // sandbox. A predecessor's goes first (its sandboxes keep their binds).
  std::string mask = opts.sandboxRoot + "/" DSEC_MASK_DIR;
  if (::mkdir(mask.c_str(), 0555) != 0 && errno != EEXIST) return sysError("mkdir " + mask);
  while (::umount2(mask.c_str(), MNT_DETACH) == 0) {
  }
  // Host root's: with a range per sandbox it can be no sandbox's own, so it
  // shows as nobody (65534) inside, empty and read-only either way.
  std::string maskOpts = "size=0,mode=0555";
  if (::mount("tmpfs", mask.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
              maskOpts.c_str()) != 0) {
    return sysError("mount the mask tmpfs on " + mask);
  }
  b->maskMount_ = std::move(mask);
  // One spawn up front, so a broken aether fails start-up, not the first create.
  ASSIGN_OR_RETURN(Agent probe, b->spawnAgent());
  b->spares_.push_back(std::move(probe));
  // The cgroups go last, on the reaper, which batches them in a mass
  // destroy (corpse_cleaner.h).
  b->cgroupReaper_ = std::make_unique<CgroupReaper>(
      [raw = b.get()](const std::string& id) {
        Status st = raw->cgroups_->remove(id);
        if (!st.isOk()) log::error("cleanup " + id + ": " + st.toString());
      },
      [raw = b.get()] { return raw->cleaner_ ? raw->cleaner_->backlog() : 0; });
  b->cleaner_ = std::make_unique<CorpseCleaner>(
      [raw = b.get()](const std::string& id) {
        // The disk first: emptied for reuse, its page cache (charged to the
        // sandbox's memory group) goes, so the group fits the pool.
        Status rm = raw->quota_->remove(id);
        if (!rm.isOk()) log::error("cleanup " + id + ": " + rm.toString());
        // Its processes are reaped and its files gone: its ids may serve
        // another sandbox.
        raw->releaseRangeOf(id);
        raw->cgroupReaper_->add(id);
      });
  b->spareThread_ = std::thread([raw = b.get()] { raw->spareLoop(); });
  return b;
}

Result<ContainerBackend::Agent> ContainerBackend::spawnAgent() {
  // Its host ids, taken now (a uid_map is written once, before the agent
  // runs) and given back on every way out but success.
  IdRange range;
  if (userns_) {
    ASSIGN_OR_RETURN(range, allocateRange());
  }
  struct Lease {
    ContainerBackend* b;
    IdRange r;
    ~Lease() {
      if (!r.empty()) b->releaseRange(r);
    }
  } lease{this, range};
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return sysError("socketpair");
  UniqueFd ours(sv[0]), theirs(sv[1]);
  UniqueFd devNull(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!devNull) return sysError("open /dev/null");
  static char arg0[] = "dsec-aether";
  // The agent mounts its sandbox's /proc, /sys and /dev while it waits to be
  // taken (aether/container_init.h: prestage), on a tmpfs over the empty
  // kStageDir in its working directory, the sandbox root: a directory of
  // ours, so the tmpfs hides nothing the agent needs (over /tmp it hid a
  // data directory under /tmp).
  static char arg1[] = "--prestage=" DSEC_STAGE_DIR;
  static char arg2[] = "--mask=" DSEC_MASK_DIR;
  // The detached layout brings the rootfs as a mount fd, so the agent can
  // pivot into its stage now, off the create path (container_init.h).
  static char arg3[] = "--pivot";
  char* argv[] = {arg0, arg1, arg2, detached_ ? arg3 : nullptr, nullptr};
  static char env0[] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  char* envp[] = {env0, nullptr};
  ChildArgs args{theirs.get(), aetherMemfd_.get(), devNull.get(), argv, envp};
  args.workDir = opts_.sandboxRoot.c_str();
  // User namespace mode: the go pipe (edge -> child) and the status pipe
  // (child -> edge), see ChildArgs.
  UniqueFd goRd, goWr, statusRd, statusWr;
  if (userns_) {
    int go[2], status[2];
    if (::pipe2(go, O_CLOEXEC) != 0) return sysError("pipe");
    goRd.reset(go[0]);
    goWr.reset(go[1]);
    if (::pipe2(status, O_CLOEXEC) != 0) return sysError("pipe");
    statusRd.reset(status[0]);
    UniqueFd low(status[1]);
    statusWr.reset(::fcntl(low.get(), F_DUPFD_CLOEXEC, 100));
    if (!statusWr) return sysError("dup status pipe");
    args.goFd = goRd.get();
    args.goWriteFd = goWr.get();
    args.statusFd = statusWr.get();
  }
  alignas(16) static thread_local char stack[kChildStackSize];
  int pidfd = -1;
  int flags = CLONE_VM | CLONE_PIDFD | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC |
              CLONE_NEWNET | SIGCHLD;
  // CLONE_VFORK would suspend us until the exec, but a child in a new user
  // namespace must wait for us to write its maps first. Either way the child
  // uses `stack` (ours, thread-local) until it execs or exits, so we return
  // only after one of those.
  flags |= userns_ ? CLONE_NEWUSER : CLONE_VFORK;
  pid_t pid = ::clone(childMain, stack + sizeof stack, flags, &args, &pidfd);
  if (pid < 0) return sysError("clone");
  Agent a;
  a.pid = pid;
  a.pidfd.reset(pidfd);
  if (userns_) {
    statusWr.reset();
    goRd.reset();
    Status st = writeIdMaps(pid, mapLine(range));
    if (!st.isOk()) {
      killAndWait(pidfd);  // the child is blocked on the go pipe: safe to kill
      return st.withContext("sandbox agent's user namespace");
    }
    if (::write(goWr.get(), "g", 1) != 1) {
      st = sysError("write go pipe");
      killAndWait(pidfd);
      return st;
    }
    char code = 0;
    ssize_t n;
    while ((n = ::read(statusRd.get(), &code, 1)) < 0 && errno == EINTR) {
    }
    if (n != 0) {
      // The child failed before exec; reaping it also means it left `stack`.
      killAndWait(pidfd);
      return Status(Code::kInternal, std::string("sandbox agent did not start: ") +
                                         childFailure(n == 1 ? code : -1));
    }
  } else {
    // CLONE_VFORK: by now the child has exec'd the agent or exited. Catch the
    // latter here instead of as a start-up timeout later.
    siginfo_t info{};
    if (waitid(idtype_t(P_PIDFD), id_t(pidfd), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid != 0) {
      int code = info.si_code == CLD_EXITED ? info.si_status : -1;
      killAndWait(pidfd);
      return Status(Code::kInternal,
                    std::string("sandbox agent did not start: ") + childFailure(code));
    }
  }
  a.conn = std::make_shared<AgentConn>(std::move(ours), "agent-" + std::to_string(pid));
  if (Status st = reactor_->add(a.conn); !st.isOk()) {
    killAndWait(a.pidfd.get());
    return st;
  }
  a.range = std::exchange(lease.r, IdRange{});
  return a;
}

Result<ContainerBackend::Agent> ContainerBackend::takeAgent() {
  for (;;) {
    Agent a;
    {
      std::lock_guard lk(spareMu_);
      if (spares_.empty()) break;
      a = std::move(spares_.front());
      spares_.pop_front();
      lastTake_ = monoSeconds();
    }
    spareCv_.notify_one();
    if (!a.conn->dead()) {
      // A spare starts and waits at its thread's nice 10 (its start-up
      // yields to requests); the sandbox it now becomes runs at 0. In a new
      // user namespace the agent cannot raise its own priority (childMain's
      // setpriority needs CAP_SYS_NICE of the host's): we do. It is our
      // unreaped child, so the pid is still its own.
      if (::setpriority(PRIO_PROCESS, a.pid, 0) < 0) {
        log::warn("spare agent " + std::to_string(a.pid) + ": setpriority: " + std::strerror(errno));
      }
      return a;
    }
    reactor_->remove(a.conn);
    killAndWait(a.pidfd.get());
    if (!a.range.empty()) releaseRange(a.range);
  }
  return spawnAgent();
}

// Background work yields to the request path (creates and execs waiting on it)
// but still runs under load.
static void lowerThreadPriority() { setpriority(PRIO_PROCESS, pid_t(syscall(SYS_gettid)), 10); }

void ContainerBackend::spareLoop() {
  lowerThreadPriority();
  std::unique_lock lk(spareMu_);
  while (!stopSpares_) {
    if (spares_.size() >= opts_.spareAgents) {
      spareCv_.wait(lk);
      continue;
    }
    if (spares_.size() >= opts_.spareLowWater) {
      double settled = lastTake_ + opts_.spareSettleS, now = monoSeconds();
      if (now < settled) {
        spareCv_.wait_for(lk, std::chrono::duration<double>(settled - now));
        continue;
      }
    }
    lk.unlock();
    auto a = spawnAgent();
    lk.lock();
    if (!a.isOk()) {
      // Every range in use (by sandboxes and spares) is no fault: a destroy
      // gives one back (releaseRange notifies).
      if (a.status().code() == Code::kResourceExhausted) {
        log::debug("spare agent: " + a.status().toString());
      } else {
        log::error("spare agent: " + a.status().toString());
      }
      spareCv_.wait_for(lk, std::chrono::seconds(1));
      continue;
    }
    spares_.push_back(std::move(a).value());
  }
}

Result<std::unique_ptr<Instance>> ContainerBackend::create(const SandboxSpec& spec,
                                                           std::function<void()> onDeath) {
  Laps laps;
  auto inst = std::make_unique<ContainerInstance>();
  inst->id_ = spec.id;
  inst->cgroups_ = cgroups_;
  bool dirMade = false;
  bool cgroupMade = false;

  // Undo whatever was done if any step fails.
  auto fail = [&](Status st) -> Status {
    if (inst->conn_) reactor_->remove(inst->conn_);
    killAndWait(inst->pidfd_.get());
    if (cgroupMade) (void)cgroups_->remove(spec.id);
    for (auto& d : inst->layers_) layers_->release(d);
    if (dirMade) (void)quota_->remove(spec.id);
    // Its PID 1 is reaped and its disk gone: nothing holds its ids.
    if (!inst->range_.empty()) releaseRangeOf(spec.id);
    return st.withContext("create " + spec.id);
  };

  if (spec.diskBytes <= 0) return invalidArg("disk_mb", "disk_mb must be positive");
  // The agent first: its user namespace's range owns the disk and maps the
  // layers.
  auto agent = takeAgent();
  if (!agent.isOk()) return fail(agent.status());
  inst->pid_ = agent->pid;
  inst->pidfd_ = std::move(agent->pidfd);
  inst->conn_ = std::move(agent->conn);
  if (!agent->range.empty()) {
    inst->range_ = agent->range;
    std::lock_guard lk(rangeMu_);
    rangeOf_[spec.id] = agent->range;
  }
  laps.lap("agent");
  // The sandbox's directory, bounded by disk_mb: upper and work live in it.
  if (Status st = quota_->create(spec.id, spec.diskBytes); !st.isOk()) return fail(st);
  dirMade = true;
  // <sandboxRoot>/<id>, or a detached disk's /proc/<pid>/fd/N.
  inst->dir_ = quota_->dirOf(spec.id);
  laps.lap("disk");
  for (const char* sub : {"/upper", "/work", "/rootfs"}) {
    if (detached_ && sub[1] == 'r') continue;  // aether's target is in its stage
    std::string d = inst->dir_ + sub;
    if (::mkdir(d.c_str(), 0755) != 0) return fail(sysError("mkdir " + d));
  }
  if (userns_) {
    // Root inside is its range's base: it owns its directory (which stays
    // 0700, closed to every other host user) and its writable layer.
    uid_t id = inst->range_.base;
    for (const char* sub : {"", "/upper", "/work"}) {
      std::string d = inst->dir_ + sub;
      if (::chown(d.c_str(), id, id) != 0) return fail(sysError("chown " + d));
    }
  }
  laps.lap("mkdir");
  json lower = json::array();
  // User namespace mode: each layer through the sandbox's own mapping, an
  // idmapped clone of the node's mount (files owned by 0 appear as host
  // `base`), held until the overlay is made.
  std::vector<UniqueFd> idmapped;
  UniqueFd nsFd;
  if (userns_) {
    // Our unreaped child: the pid is still its own.
    std::string ns = "/proc/" + std::to_string(inst->pid_) + "/ns/user";
    nsFd.reset(::open(ns.c_str(), O_RDONLY | O_CLOEXEC));
    if (!nsFd) return fail(sysError("open " + ns));
  }
  for (auto it = spec.layers.rbegin(); it != spec.layers.rend(); ++it) {
    auto mp = layers_->acquireMount(*it);
    if (!mp.isOk()) return fail(std::move(mp).takeStatus());
    inst->layers_.push_back(*it);
    lower.push_back(mp->path);  // overlayfs wants the top layer first
    if (userns_) {
      auto m = idmappedClone(mp->path, nsFd.get(), /*readOnly=*/true);
      if (!m.isOk()) {
        Status st = m.status();
        if (st.sysErrno() == EINVAL) {
          // The start-up check idmaps a tmpfs; a kernel that can do that but
          // not EROFS ends here, at every create.
          st = Status(st.code(),
                      "layer " + *it + ": " + st.message() +
                          " (EROFS on this kernel cannot be idmapped: run `dsec up --userns off`)",
                      EINVAL);
        }
        return fail(st);
      }
      idmapped.push_back(std::move(*m));
    }
  }
  nsFd.reset();
  laps.lap("layers");
  // User namespace mode: the edge makes the overlay (see edge/userns.h for
  // why the sandbox cannot); aether attaches it where it used to mount it.
  // Detached layout: in both modes, over the disk reached through dirOf.
  UniqueFd rootfsMount;
  if (userns_ || detached_) {
    Result<UniqueFd> m = internalError("no overlay");
    if (userns_) {
      std::vector<int> fds;
      for (auto& f : idmapped) fds.push_back(f.get());
      m = makeOverlay(fds, inst->dir_ + "/upper", inst->dir_ + "/work");
    } else {
      m = makeOverlay(lower.get<std::vector<std::string>>(), inst->dir_ + "/upper",
                      inst->dir_ + "/work");
    }
    if (!m.isOk()) return fail(m.status());
    rootfsMount = std::move(*m);
    // The overlay holds private clones: ours go, unmounted off this path.
    dropper_.drop(std::move(idmapped));
    laps.lap("overlay");
  }
  // A detached disk goes to the agent, read-only (its overlay has its own
  // writable clone now): it holds the one reference (DiskQuota::lend), so
  // the edge keeps no descriptor for it, and reaches it (pack_diff,
  // destroy, a restarted edge) through the agent's fd 10.
  UniqueFd disk;
  if (quota_->diskFd(spec.id) >= 0) {
    auto d = quota_->lend(spec.id);
    if (!d.isOk()) return fail(d.status());
    disk = std::move(*d);
    inst->diskLent_ = true;
  }
  inst->cpuOverhead_ = spec.cpuOverhead;
  CgroupLimits limits{spec.cpu + spec.cpuOverhead, spec.memoryBytes, spec.pids};
  if (Status st = cgroups_->create(spec.id, limits); !st.isOk()) return fail(st);
  cgroupMade = true;
  laps.lap("cgroup");

  // aether blocks on its init frame, so it cannot fork before it is in the
  // sandbox's cgroups.
  if (Status st = cgroups_->attach(spec.id, inst->pid_); !st.isOk()) return fail(st);
  // PID 1 must be the last thing the OOM killer picks; its children reset to
  // 0. Needs CAP_SYS_RESOURCE, which some hosts withhold: best effort.
  (void)writeKnob("/proc/" + std::to_string(inst->pid_) + "/oom_score_adj", "-1000");
  laps.lap("attach");
  // The sandbox outlives this edge: the next one reattaches to its agent.
  json init = {{"hostname", spec.id}, {"reattach", true}};
  // fncall (backends/fncall): read-only root, /scratch, zygotes.
  if (!spec.fncallInit.empty()) init["fncall"] = json::parse(spec.fncallInit, nullptr, false);
  if (!spec.workingDir.empty()) init["working_dir"] = spec.workingDir;
  if (!spec.initPolicy.empty()) {
    init["policy"] = json::parse(spec.initPolicy, nullptr, false);
    if (!init["policy"].is_object()) return fail(invalidArg("policy", "initial policy is not an object"));
  }
  if (detached_) {
    init["rootfs"] = {{"mount_fd", true}, {"target", DSEC_ROOT_IN_STAGE}};
    if (disk) init["rootfs"]["disk_fd"] = true;
  } else if (userns_) {
    // Relative to aether's working directory, the sandbox root (ChildArgs):
    // the absolute path crosses 0700 directories of host root.
    init["rootfs"] = {{"mount_fd", true}, {"target", spec.id + "/rootfs"}};
  } else {
    init["rootfs"] = {{"lower", lower},
                      {"upper", inst->dir_ + "/upper"},
                      {"work", inst->dir_ + "/work"},
                      {"target", inst->dir_ + "/rootfs"}};
  }
  std::vector<int> passed;
  if (rootfsMount) passed.push_back(rootfsMount.get());
  if (disk) passed.push_back(disk.get());
  if (Status st = inst->conn_->send(0, proto::FrameType::kInit, init.dump(), passed);
      !st.isOk()) {
    return fail(st);
  }
  rootfsMount.reset();  // aether has its own references now
  disk.reset();
  if (Status st = awaitHello(*inst->conn_, monoSeconds() + opts_.startTimeoutS, Code::kInternal,
                             "sandbox agent did not start");
      !st.isOk()) {
    return fail(st);
  }
  laps.lap("init");
  if (Status st = reactor_->watchExit(inst->pidfd_.get(), std::move(onDeath)); !st.isOk()) {
    return fail(st);
  }
  log::debug("create " + spec.id + " ms: " + laps.str());
  return std::unique_ptr<Instance>(std::move(inst));
}

Result<std::unique_ptr<Instance>> ContainerBackend::adopt(const SandboxState& state,
                                                          std::function<void()> onDeath) {
  auto inst = std::make_unique<ContainerInstance>();
  inst->id_ = state.spec.id;
  inst->cgroups_ = cgroups_;
  inst->cpuOverhead_ = state.spec.cpuOverhead;
  inst->pid_ = state.pid;
  auto fail = [&](Status st) -> Status {
    if (inst->conn_) reactor_->remove(inst->conn_);
    for (auto& d : inst->layers_) layers_->release(d);
    return st.withContext("adopt " + state.spec.id);
  };
  int pidfd = int(syscall(SYS_pidfd_open, state.pid, 0));
  if (pidfd < 0) return fail(sysError("pidfd_open"));
  inst->pidfd_.reset(pidfd);
  // With the pid pinned, make sure it is still the PID 1 we recorded.
  auto started = processStartTime(state.pid);
  if (!started.isOk() || *started != state.startTime) {
    return fail(Status(Code::kNotFound, "its PID 1 is gone"));
  }
  if (userns_) {
    // make() reserved the range the kernel has for it (keepRanges); its
    // record must name the same. None at all: a sandbox of a --userns off
    // run (identity map), which keeps running as it was.
    auto has = readIdMap(state.pid);
    if (!has.isOk()) return fail(has.status());
    if (has->base != 0) {
      bool reserved;
      {
        std::lock_guard lk(rangeMu_);
        auto it = rangeOf_.find(state.spec.id);
        reserved = it != rangeOf_.end() && it->second == *has;
      }
      if (!reserved) {
        return fail(Status(Code::kFailedPrecondition, "its host id range could not be reserved"));
      }
      if (!(state.userns == *has)) {
        return fail(Status(Code::kFailedPrecondition,
                           "its uid_map (base " + std::to_string(has->base) + ", " +
                               std::to_string(has->length) + " ids) is not its recorded range"));
      }
      inst->range_ = *has;
    }
  }
  // A paused sandbox's agent is frozen too, and cannot notice the old edge
  // go: it runs just long enough to reattach.
  if (state.paused) {
    if (Status st = cgroups_->freeze(state.spec.id, false); !st.isOk()) return fail(st);
  }
  // The agent noticed the old edge's end close and left the end of a fresh
  // connection on its reattach descriptor (aether/agent.h); until it has,
  // that holds /dev/null.
  UniqueFd sock;
  double deadline = monoSeconds() + opts_.startTimeoutS;
  for (;;) {
    UniqueFd fd(int(syscall(SYS_pidfd_getfd, pidfd, kAgentReattachFd, 0)));
    if (!fd) return fail(sysError("pidfd_getfd"));
    struct stat st;
    if (::fstat(fd.get(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      sock = std::move(fd);
      break;
    }
    if (monoSeconds() > deadline) {
      return fail(Status(Code::kUnavailable, "its agent offers no connection to reattach"));
    }
    ::usleep(5000);
  }
  ::fcntl(sock.get(), F_SETFD, FD_CLOEXEC);
  // A detached disk is reachable only through the agent's read-only clone
  // (/dev/null there in the older layout, whose disk is still mounted on
  // <sandboxRoot>/<id>): pack_diff reads its upper dir through it, and
  // destroy knows its disk.
  inst->dir_ = quota_->dirOf(state.spec.id);
  if (UniqueFd disk = sandboxDisk(pidfd)) {
    // Known to the quota (its loop device), then left to its sandbox: our
    // fd is a second reference to the agent's, so closing it unmounts
    // nothing.
    if (Status ad = quota_->adoptDisk(state.spec.id, std::move(disk)); !ad.isOk()) {
      log::warn("adopt " + state.spec.id + ": its disk: " + ad.toString());
    } else if (auto lent = quota_->lend(state.spec.id); lent.isOk()) {
      inst->diskLent_ = true;
    }
  }
  inst->conn_ = std::make_shared<AgentConn>(std::move(sock), "agent-" + std::to_string(state.pid));
  if (Status st = reactor_->add(inst->conn_); !st.isOk()) {
    inst->conn_.reset();
    return fail(st);
  }
  if (Status st = inst->conn_->send(0, proto::FrameType::kReattach, "{}"); !st.isOk()) {
    return fail(st);
  }
  if (Status st = awaitHello(*inst->conn_, monoSeconds() + opts_.startTimeoutS,
                             Code::kUnavailable,
                             "its agent did not answer");
      !st.isOk()) {
    return fail(st);
  }
  if (state.paused) {
    if (Status st = cgroups_->freeze(state.spec.id, true); !st.isOk()) return fail(st);
  }
  // The layers stay mounted inside the sandbox whatever happens here; the
  // references keep the node from evicting what it still uses.
  for (auto& d : state.spec.layers) {
    if (auto m = layers_->acquire(d); m.isOk()) {
      inst->layers_.push_back(d);
    } else {
      log::warn("adopt " + state.spec.id + ": layer " + d + ": " + m.status().toString());
    }
  }
  if (Status st = reactor_->watchExit(inst->pidfd_.get(), std::move(onDeath)); !st.isOk()) {
    return fail(st);
  }
  return std::unique_ptr<Instance>(std::move(inst));
}

Status ContainerBackend::destroy(Instance& base) {
  auto& inst = static_cast<ContainerInstance&>(base);
  reactor_->unwatchExit(inst.pidfd_.get());
  if (inst.conn_) {
    reactor_->remove(inst.conn_);
    inst.conn_->fail(Status(Code::kUnavailable, "sandbox destroyed"));
  }
  // The disk back from PID 1 while it lives, so the cleaner can empty it
  // for reuse (or else let it go with the sandbox).
  if (inst.diskLent_ && inst.pidfd_) {
    if (UniqueFd disk = sandboxDisk(inst.pidfd_.get())) {
      (void)quota_->reclaim(inst.id_, std::move(disk));
    }
    inst.diskLent_ = false;
  }
  // SIGKILL to a PID 1 takes the whole pid namespace with it; waiting for
  // that (and for the mount and net namespaces to go) is the cleaner's job.
  if (inst.pidfd_) syscall(SYS_pidfd_send_signal, inst.pidfd_.get(), SIGKILL, nullptr, 0);
  for (auto& d : inst.layers_) layers_->release(d);
  inst.layers_.clear();
  cleaner_->add(inst.id_, std::move(inst.pidfd_));
  return Status::ok();
}

void ContainerBackend::shutdown(bool keepSandboxes) {
  {
    std::lock_guard lk(spareMu_);
    stopSpares_ = true;
  }
  spareCv_.notify_all();
  if (spareThread_.joinable()) spareThread_.join();
  for (auto& a : spares_) {
    reactor_->remove(a.conn);
    killAndWait(a.pidfd.get());
    if (!a.range.empty()) releaseRange(a.range);
  }
  spares_.clear();
  dropper_.drain();
  if (cleaner_) cleaner_->drain();
  if (cgroupReaper_) cgroupReaper_->drain();
  if (std::string mask = std::exchange(maskMount_, {}); !mask.empty()) {
    if (::umount2(mask.c_str(), MNT_DETACH) != 0) log::warn(sysError("unmount " + mask).toString());
  }
  // Every sandbox directory is gone: the pool (mount, loop device, image) may
  // go, unless sandboxes live on for the next edge.
  if (quota_) {
    if (keepSandboxes) {
      quota_->keepForNextEdge();
    } else {
      quota_->close();
    }
  }
}

ContainerBackend::~ContainerBackend() {
  shutdown();
  cleaner_.reset();
  cgroupReaper_.reset();
}

void ContainerBackend::removeOrphan(const std::string& id) {
  // Removing the cgroups kills (and waits for) every process in them.
  if (Status st = cgroups_->remove(id); !st.isOk()) log::error("orphan " + id + ": " + st.toString());
  if (Status st = quota_->remove(id); !st.isOk()) log::error("orphan " + id + ": " + st.toString());
  releaseRangeOf(id);
}

Result<IdRange> ContainerBackend::allocateRange() {
  std::lock_guard lk(rangeMu_);
  return ranges_.allocate();
}

void ContainerBackend::releaseRange(IdRange r) {
  {
    std::lock_guard lk(rangeMu_);
    if (Status st = ranges_.release(r); !st.isOk()) log::error("id range: " + st.toString());
  }
  spareCv_.notify_all();  // a spare may have waited for one
}

void ContainerBackend::releaseRangeOf(const std::string& id) {
  IdRange r;
  {
    std::lock_guard lk(rangeMu_);
    auto it = rangeOf_.find(id);
    if (it == rangeOf_.end()) return;
    r = it->second;
    rangeOf_.erase(it);
  }
  releaseRange(r);
}

ContainerBackend::RangeStats ContainerBackend::rangeStats() {
  RangeStats s;
  {
    std::lock_guard lk(rangeMu_);
    s.capacity = ranges_.capacity();
    s.inUse = ranges_.inUse();
    s.sandboxes = rangeOf_.size();
  }
  std::lock_guard lk(spareMu_);
  for (auto& a : spares_) s.spares += !a.range.empty();
  return s;
}

int ContainerBackend::cleanupOrphans() {
  std::set<std::string> ids = std::exchange(orphans_, {});
  // Processes, mounts and plain directories went in make(); what is left are
  // subvolumes of a btrfs root, which only the quota can remove.
  for (auto& name : sandboxDirs(opts_.sandboxRoot)) {
    if (keep_.count(name)) continue;
    if (Status st = quota_->remove(name); !st.isOk()) {
      log::error("cleanup orphan " + name + ": " + st.toString());
    }
    ids.insert(name);
  }
  return int(ids.size());
}

}  // namespace dsec::edge
