#include "aether/exec.h"

#include <fcntl.h>
#include <sched.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "aether/json_fields.h"
#include "aether/users.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#include "aether/seccomp.h"

namespace dsec::aether {

namespace {

// Docker's default capability set less CAP_NET_RAW (no raw or packet
// sockets: spoofing and sniffing) and CAP_MKNOD (no device nodes: a block
// node made in /dev would reach the host's disks); everything else leaves
// the bounding set.
constexpr int kKeptCaps[] = {
    CAP_CHOWN,  CAP_DAC_OVERRIDE,     CAP_FOWNER,     CAP_FSETID,      CAP_KILL,
    CAP_SETGID, CAP_SETUID,           CAP_SETPCAP,    CAP_NET_BIND_SERVICE,
    CAP_SYS_CHROOT, CAP_AUDIT_WRITE,  CAP_SETFCAP,
};
constexpr int kMaxCap = 63;

// The highest capability this kernel knows (beyond it PR_CAPBSET_DROP is
// EINVAL anyway): /proc/sys/kernel/cap_last_cap, read once.
int lastCap() {
  static const int last = [] {
    int v = kMaxCap;
    if (FILE* f = std::fopen("/proc/sys/kernel/cap_last_cap", "re")) {
      int n;
      if (std::fscanf(f, "%d", &n) == 1 && n >= 0 && n <= kMaxCap) v = n;
      std::fclose(f);
    }
    return v;
  }();
  return last;
}

// Where the child stopped, reported through the status pipe.
enum ChildStage : int32_t {
  kStageSetsid = 1,
  kStageStdio,
  kStageCaps,
  kStageSetgroups,
  kStageSetgid,
  kStageSetuid,
  kStageChdir,
  kStageLandlock,
  kStageSeccomp,
  kStageExec,
  kStageRlimit,
  kStageTty,
};

struct ChildReport {
  int32_t stage;
  int32_t err;
};

// Everything the child needs, prepared before fork so that the child itself
// never allocates (fork in a possibly multi-threaded test process, and malloc
// is not async-signal-safe).
struct ChildPlan {
  std::vector<std::string> candidates;  // execve targets in PATH order
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::vector<char*> sh_argv;  // {"/bin/sh", <candidate>, argv[1..]} for ENOEXEC
  const char* cwd = "/";
  bool switch_user = false;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
  bool drop_caps = false;
  uint64_t keep_mask = 0;
  int last_cap = kMaxCap;
  uint64_t reset_signals = ~uint64_t{0};
  bool set_nofile = false;
  struct rlimit nofile;
  bool seccomp = false;
  bool seccomp_notify = false;
  bool self_only = false;
  struct sock_fprog self_filter;
  int landlock_fd = -1;
  int base_landlock_fd = -1;
  std::vector<std::pair<int, struct rlimit>> rlimits;
  struct sock_fprog filter;
  int stdin_fd = -1, stdout_fd = -1, stderr_fd = -1, status_fd = -1;
  bool controlling_tty = false;  // stdin is a PTY slave to make the session's terminal
  sigset_t empty_mask;
};

[[noreturn]] void childFail(const ChildPlan& p, ChildStage stage, int err) {
  ChildReport r{stage, err};
  // Nothing to do if this fails; the exit code still tells the story.
  [[maybe_unused]] ssize_t n = ::write(p.status_fd, &r, sizeof r);
  ::_exit(stage == kStageExec && err == ENOENT ? 127 : 126);
}

bool moveFd(int from, int to) {
  if (from == to) return ::fcntl(to, F_SETFD, 0) == 0;  // dup2 would keep CLOEXEC
  return ::dup2(from, to) == to;
}

// rt_sigaction(2) itself: glibc's sigaction() refuses the two real-time
// signals it keeps for itself (32 and 33), which a parent may still have left
// at SIG_IGN for us and our children to inherit.
struct KernelSigaction {
  void (*handler)(int);
  unsigned long flags;
  void (*restorer)();
  uint64_t mask;
};

bool hasDefaultDisposition(int sig) {
  KernelSigaction old{};
  if (::syscall(SYS_rt_sigaction, sig, nullptr, &old, sizeof old.mask) != 0) return true;
  return old.handler == SIG_DFL;
}

void setDefaultDisposition(int sig) {
  KernelSigaction dfl{};
  dfl.handler = SIG_DFL;
  ::syscall(SYS_rt_sigaction, sig, &dfl, nullptr, sizeof dfl.mask);
}

// Only async-signal-safe calls from here on.
[[noreturn]] void runChild(ChildPlan& p) {
  // aether blocks SIGCHLD and ignores SIGPIPE; programs expect the defaults.
  // (Handlers would be reset by execve; SIG_IGN is not.)
  for (int sig = 1; sig <= 64; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP || !(p.reset_signals >> (sig - 1) & 1)) continue;
    setDefaultDisposition(sig);
  }
  ::sigprocmask(SIG_SETMASK, &p.empty_mask, nullptr);

  // Its own session and process group, so signals and timeouts reach helpers too.
  if (::setsid() < 0) childFail(p, kStageSetsid, errno);

  if (!moveFd(p.stdin_fd, 0) || !moveFd(p.stdout_fd, 1) || !moveFd(p.stderr_fd, 2)) {
    childFail(p, kStageStdio, errno);
  }
  // A session leader's first terminal would become its controlling one on
  // open; a slave opened before setsid() must be made so explicitly.
  if (p.controlling_tty && ::ioctl(0, TIOCSCTTY, 0) < 0) childFail(p, kStageTty, errno);
  // Anything aether (or a test harness) left without CLOEXEC stays out of the
  // sandboxed program. The status pipe stays usable until execve closes it.
  ::syscall(SYS_close_range, 3u, ~0u, CLOSE_RANGE_CLOEXEC);

  // aether itself runs at -1000; its children must be killable first.
  int oom = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (oom >= 0) {
    [[maybe_unused]] ssize_t n = ::write(oom, "0", 1);
    ::close(oom);
  }

  if (p.drop_caps) {
    ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    for (int cap = 0; cap <= p.last_cap; ++cap) {
      if (p.keep_mask & (uint64_t{1} << cap)) continue;
      // EINVAL: this kernel does not know the capability.
      if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) {
        childFail(p, kStageCaps, errno);
      }
    }
    // A root process gains its inheritable set on execve too.
    __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2];
    if (::syscall(SYS_capget, &hdr, data) < 0) childFail(p, kStageCaps, errno);
    data[0].inheritable &= static_cast<uint32_t>(p.keep_mask);
    data[1].inheritable &= static_cast<uint32_t>(p.keep_mask >> 32);
    if (::syscall(SYS_capset, &hdr, data) < 0) childFail(p, kStageCaps, errno);
  }

  if (p.set_nofile) ::setrlimit(RLIMIT_NOFILE, &p.nofile);
  for (const auto& [resource, limit] : p.rlimits) {
    if (::setrlimit(resource, &limit) < 0) childFail(p, kStageRlimit, errno);
  }

  if (p.switch_user) {
    if (::setgroups(p.groups.size(), p.groups.data()) < 0) childFail(p, kStageSetgroups, errno);
    if (::setgid(p.gid) < 0) childFail(p, kStageSetgid, errno);
    if (::setuid(p.uid) < 0) childFail(p, kStageSetuid, errno);
  }
  if (::chdir(p.cwd) < 0) childFail(p, kStageChdir, errno);
  ::umask(022);
  if (p.seccomp || p.landlock_fd >= 0 || p.base_landlock_fd >= 0) {
    // no_new_privs: setuid binaries cannot raise privileges, and an
    // unprivileged process may restrict itself.
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) childFail(p, kStageSeccomp, errno);
  }
  if (p.landlock_fd >= 0 && ::syscall(SYS_landlock_restrict_self, p.landlock_fd, 0) != 0) {
    childFail(p, kStageLandlock, errno);
  }
  if (p.base_landlock_fd >= 0 &&
      ::syscall(SYS_landlock_restrict_self, p.base_landlock_fd, 0) != 0) {
    childFail(p, kStageLandlock, errno);
  }
  if (p.seccomp) {
    long listener = ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                              p.seccomp_notify ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0, &p.filter);
    if (listener < 0) childFail(p, kStageSeccomp, errno);
    if (p.seccomp_notify) {
      // Hand the listener to the agent over the status socket.
      ChildReport r{0, 0};
      iovec iov{&r, sizeof r};
      alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
      std::memset(ctl, 0, sizeof ctl);
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = ctl;
      m.msg_controllen = sizeof ctl;
      cmsghdr* c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      int lfd = static_cast<int>(listener);
      std::memcpy(CMSG_DATA(c), &lfd, sizeof lfd);
      if (::sendmsg(p.status_fd, &m, MSG_NOSIGNAL) < 0) childFail(p, kStageSeccomp, errno);
      ::close(lfd);
    }
    if (p.self_only && ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &p.self_filter) < 0) {
      childFail(p, kStageSeccomp, errno);
    }
  }

  // execvpe() would search the PATH of aether's own environment; the exec's
  // PATH was resolved into candidates before fork. Error handling follows
  // execvp: skip missing entries, remember EACCES, stop on anything else.
  int err = ENOENT;
  bool saw_eacces = false;
  for (const std::string& cand : p.candidates) {
    ::execve(cand.c_str(), p.argv.data(), p.envp.data());
    err = errno;
    if (err == ENOEXEC) {
      // A script without "#!": run it with the shell, as execvp does.
      p.sh_argv[1] = const_cast<char*>(cand.c_str());
      ::execve("/bin/sh", p.sh_argv.data(), p.envp.data());
      err = errno;
      break;
    }
    if (err == EACCES) {
      saw_eacces = true;
      continue;
    }
    if (err == ENOENT || err == ENOTDIR || err == ESTALE || err == ENODEV || err == ETIMEDOUT) {
      continue;
    }
    break;
  }
  if (saw_eacces && (err == ENOENT || err == ENOTDIR)) err = EACCES;
  childFail(p, kStageExec, err);
}

constexpr size_t kChildStackSize = 64u << 10;

int childTrampoline(void* plan) { runChild(*static_cast<ChildPlan*>(plan)); }

bool hasVar(const std::vector<std::string>& env, std::string_view name) {
  for (const auto& e : env) {
    if (e.size() > name.size() && e.compare(0, name.size(), name) == 0 && e[name.size()] == '=') {
      return true;
    }
  }
  return false;
}

std::string varValue(const std::vector<std::string>& env, std::string_view name) {
  // The last definition wins, as with putenv.
  std::string value;
  for (const auto& e : env) {
    if (e.size() > name.size() && e.compare(0, name.size(), name) == 0 && e[name.size()] == '=') {
      value = e.substr(name.size() + 1);
    }
  }
  return value;
}

std::vector<std::string> pathCandidates(const std::string& file, const std::string& path) {
  if (file.find('/') != std::string::npos || file.empty()) return {file};
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t colon = path.find(':', start);
    std::string dir =
        path.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (dir.empty()) dir = ".";  // an empty PATH entry means the current directory
    if (dir.size() + file.size() + 2 <= 4096) out.push_back(dir + "/" + file);
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return out;
}

Status makePipe(UniqueFd& read_end, UniqueFd& write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) < 0) return sysError("pipe");
  read_end.reset(fds[0]);
  write_end.reset(fds[1]);
  return Status::ok();
}

Status setNonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return sysError("fcntl");
  return Status::ok();
}

const char* stageName(int32_t stage) {
  switch (stage) {
    case kStageSetsid:
      return "setsid";
    case kStageStdio:
      return "dup2";
    case kStageCaps:
      return "drop capabilities";
    case kStageSeccomp:
      return "install the seccomp filter";
    case kStageLandlock:
      return "enter the Landlock domain";
    case kStageSetgroups:
      return "setgroups";
    case kStageSetgid:
      return "setgid";
    case kStageSetuid:
      return "setuid";
    case kStageChdir:
      return "chdir";
    case kStageExec:
      return "exec";
    case kStageRlimit:
      return "setrlimit";
    case kStageTty:
      return "set controlling terminal";
  }
  return "start";
}

}  // namespace

Result<ExecRequest> parseExecRequest(std::string_view payload) {
  ASSIGN_OR_RETURN(Json j, parseObject(payload));
  ExecRequest r;
  RETURN_IF_ERROR(readStringList(j, "argv", true, r.argv));
  if (r.argv.empty()) return invalidArg("argv", "argv must not be empty");
  if (j.contains("env") && !j["env"].is_null()) {
    std::vector<std::string> env;
    RETURN_IF_ERROR(readStringList(j, "env", false, env));
    r.env = std::move(env);
  }
  if (j.contains("cwd") && !j["cwd"].is_null()) {
    std::string cwd;
    RETURN_IF_ERROR(readPath(j, "cwd", cwd));
    r.cwd = std::move(cwd);
  }
  RETURN_IF_ERROR(readString(j, "user", false, r.user));
  // A day is the API's limit; allow far more, but keep timerfd arithmetic sane.
  RETURN_IF_ERROR(readInt(j, "timeout_ms", 0, int64_t{1} << 40, r.timeout_ms));
  int64_t max_output = static_cast<int64_t>(r.max_output);
  RETURN_IF_ERROR(readInt(j, "max_output", 0, INT64_MAX, max_output));
  r.max_output = static_cast<uint64_t>(max_output);
  RETURN_IF_ERROR(readBool(j, "stdin", r.stdin_pipe));
  if (j.contains("pty") && !j["pty"].is_null()) {
    const Json& pty = j["pty"];
    if (!pty.is_object()) return invalidArg("pty", "pty must be an object {rows, cols}");
    PtySize size;
    int64_t rows = size.rows, cols = size.cols;
    RETURN_IF_ERROR(readInt(pty, "rows", 1, 65535, rows));
    RETURN_IF_ERROR(readInt(pty, "cols", 1, 65535, cols));
    size.rows = static_cast<uint16_t>(rows);
    size.cols = static_cast<uint16_t>(cols);
    r.pty = size;
    r.stdin_pipe = true;
  }
  return r;
}

Result<PtySize> parsePtySize(std::string_view payload) {
  ASSIGN_OR_RETURN(Json j, parseObject(payload));
  int64_t rows = 0, cols = 0;
  RETURN_IF_ERROR(readInt(j, "rows", 1, 65535, rows));
  RETURN_IF_ERROR(readInt(j, "cols", 1, 65535, cols));
  if (rows == 0) return invalidArg("rows", "rows is required");
  if (cols == 0) return invalidArg("cols", "cols is required");
  return PtySize{static_cast<uint16_t>(rows), static_cast<uint16_t>(cols)};
}

Status setWindowSize(int master, PtySize size) {
  struct winsize ws {};
  ws.ws_row = size.rows;
  ws.ws_col = size.cols;
  if (::ioctl(master, TIOCSWINSZ, &ws) < 0) return sysError("TIOCSWINSZ");
  return Status::ok();
}

namespace {

// The credentials of `user` from the sandbox's own user database, read
// fresh: programs in it may add users.
Result<Credentials> execCredentials(const std::string& user, const ExecSettings& settings) {
  Result<std::string> passwd = readSmallFile(settings.passwd_path);
  Result<std::string> group = readSmallFile(settings.group_path);
  if (passwd.isOk() && group.isOk()) return resolveUser(user, *passwd, *group);
  // A user that is root without the files needs neither: an unreadable one
  // (a layer whose loader died fails with EIO) must not stop root's execs,
  // which is how such a sandbox is inspected. Anyone else gets the read's error.
  Result<Credentials> root = resolveUser(user, "", "");
  if (root.isOk() && root->uid == 0 && root->gid == 0) return root;
  return passwd.isOk() ? group.status() : passwd.status();
}

}  // namespace

Result<SpawnedExec> spawnExec(const ExecRequest& req, const ExecSettings& settings) {
  ASSIGN_OR_RETURN(Credentials creds,
                   execCredentials(req.user.empty() ? "root" : req.user, settings));
  // An id the sandbox's user namespace does not map would fail at setgid
  // with a bare EINVAL: say which, and why.
  if (creds.uid != 0 || creds.gid != 0 || creds.groups.size() > 1) {
    auto uidMap = readSmallFile("/proc/self/uid_map");
    auto gidMap = readSmallFile("/proc/self/gid_map");
    if (uidMap.isOk() && gidMap.isOk()) RETURN_IF_ERROR(checkMapped(creds, *uidMap, *gidMap));
  }

  ChildPlan plan;
  plan.switch_user = ::geteuid() == 0;
  if (!plan.switch_user && creds.uid != ::getuid()) {
    return Status(Code::kPermissionDenied, "aether is not root and cannot switch user", EPERM,
                  "user");
  }
  plan.uid = creds.uid;
  plan.gid = creds.gid;
  plan.groups = creds.groups;
  plan.drop_caps = settings.drop_caps;
  if (settings.child_nofile) {
    plan.set_nofile = true;
    plan.nofile = *settings.child_nofile;
  }
  for (int cap : kKeptCaps) plan.keep_mask |= uint64_t{1} << cap;
  plan.last_cap = lastCap();
  plan.reset_signals = settings.reset_signals;
  static const std::vector<sock_filter> kFilter = defaultSyscallFilter(false);
  static const std::vector<sock_filter> kNotifyFilter = defaultSyscallFilter(true);
  static const std::vector<sock_filter> kStrictFilter =
      syscallFilter(SyscallProfile::kStrict, false);
  static const std::vector<sock_filter> kStrictNotifyFilter =
      syscallFilter(SyscallProfile::kStrict, true);
  plan.seccomp = settings.seccomp;
  plan.seccomp_notify = settings.seccomp && settings.seccomp_notify;
  static const std::vector<sock_filter> kSelfOnlyFilter = selfOnlyFilter();
  plan.self_only = settings.seccomp && settings.self_only;
  plan.self_filter = sock_fprog{static_cast<unsigned short>(kSelfOnlyFilter.size()),
                                const_cast<sock_filter*>(kSelfOnlyFilter.data())};
  plan.landlock_fd = settings.landlock_ruleset;
  plan.base_landlock_fd = settings.base_landlock_ruleset;
  plan.rlimits = req.rlimits;
  const bool strict = settings.syscall_profile == SyscallProfile::kStrict;
  const auto& filter = strict ? (plan.seccomp_notify ? kStrictNotifyFilter : kStrictFilter)
                              : (plan.seccomp_notify ? kNotifyFilter : kFilter);
  plan.filter = sock_fprog{static_cast<unsigned short>(filter.size()),
                           const_cast<sock_filter*>(filter.data())};
  sigemptyset(&plan.empty_mask);

  std::vector<std::string> env = req.env ? *req.env : settings.default_env;
  if (!hasVar(env, "PATH")) {
    std::string path = varValue(settings.default_env, "PATH");
    env.push_back("PATH=" + (path.empty() ? std::string(kDefaultPath) : path));
  }
  if (!hasVar(env, "HOME")) env.push_back("HOME=" + creds.home);

  std::string cwd = "/";
  if (req.cwd) {
    cwd = *req.cwd;
  } else {
    struct stat st;
    if (::stat(creds.home.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) cwd = creds.home;
  }
  plan.cwd = cwd.c_str();

  plan.candidates = pathCandidates(req.argv[0], varValue(env, "PATH"));
  for (const auto& a : req.argv) plan.argv.push_back(const_cast<char*>(a.c_str()));
  plan.argv.push_back(nullptr);
  for (const auto& e : env) plan.envp.push_back(const_cast<char*>(e.c_str()));
  plan.envp.push_back(nullptr);
  plan.sh_argv.push_back(const_cast<char*>("/bin/sh"));
  plan.sh_argv.push_back(nullptr);  // the candidate, filled in by the child
  for (size_t i = 1; i < req.argv.size(); ++i) {
    plan.sh_argv.push_back(const_cast<char*>(req.argv[i].c_str()));
  }
  plan.sh_argv.push_back(nullptr);

  SpawnedExec out;
  UniqueFd child_in, child_out, child_err, child_status;
  int given_stdin = -1;
  UniqueFd slave;
  if (req.pty) {
    // The sandbox's own devpts instance (container_init, guest_init).
    out.pty_master.reset(::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!out.pty_master) return sysError("posix_openpt");
    if (::grantpt(out.pty_master.get()) < 0) return sysError("grantpt");
    if (::unlockpt(out.pty_master.get()) < 0) return sysError("unlockpt");
    RETURN_IF_ERROR(setWindowSize(out.pty_master.get(), *req.pty));
    // TIOCGPTPEER opens the slave through the master itself: no path lookup
    // in a /dev the sandbox may have changed.
    slave.reset(::ioctl(out.pty_master.get(), TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!slave) return sysError("TIOCGPTPEER");
    out.stdout_r.reset(::fcntl(out.pty_master.get(), F_DUPFD_CLOEXEC, 0));
    out.stdin_w.reset(::fcntl(out.pty_master.get(), F_DUPFD_CLOEXEC, 0));
    if (!out.stdout_r || !out.stdin_w) return sysError("dup");
    // One open file description: O_NONBLOCK on one is on all of them.
    RETURN_IF_ERROR(setNonblocking(out.pty_master.get()));
    plan.stdin_fd = plan.stdout_fd = plan.stderr_fd = slave.get();
    plan.controlling_tty = true;
  } else if (req.stdin_fd >= 0) {
    given_stdin = req.stdin_fd;
  } else if (req.stdin_pipe) {
    RETURN_IF_ERROR(makePipe(child_in, out.stdin_w));
    RETURN_IF_ERROR(setNonblocking(out.stdin_w.get()));
  } else {
    child_in.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!child_in) {
      // No /dev/null (an odd image without rootfs setup): an empty pipe reads EOF too.
      UniqueFd unused;
      RETURN_IF_ERROR(makePipe(child_in, unused));
    }
  }
  if (!req.pty) {
    RETURN_IF_ERROR(makePipe(out.stdout_r, child_out));
    RETURN_IF_ERROR(makePipe(out.stderr_r, child_err));
    RETURN_IF_ERROR(setNonblocking(out.stdout_r.get()));
    RETURN_IF_ERROR(setNonblocking(out.stderr_r.get()));
    plan.stdin_fd = given_stdin >= 0 ? given_stdin : child_in.get();
    plan.stdout_fd = child_out.get();
    plan.stderr_fd = child_err.get();
  }
  {
    // A socket, not a pipe: the child may pass its seccomp listener over it.
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
      return sysError("socketpair");
    }
    out.status_r.reset(sv[0]);
    child_status.reset(sv[1]);
  }
  RETURN_IF_ERROR(setNonblocking(out.status_r.get()));
  plan.status_fd = child_status.get();

  ::clock_gettime(CLOCK_MONOTONIC, &out.started);
  // vfork semantics: the child borrows our memory until it execs, so no page
  // tables are copied (a fork costs far more where page faults are expensive).
  // runChild makes only system calls; aether is single-threaded and has no
  // asynchronous signal handlers, and this loop pauses until the exec.
  alignas(16) static char stack[kChildStackSize];
  pid_t pid = ::clone(childTrampoline, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD,
                      &plan);
  if (pid < 0) return sysError("clone");
  out.pid = pid;
  // vfork: the child has exec'd or exited by now, so everything it reported
  // is waiting: its seccomp listener, or why it failed.
  for (;;) {
    ChildReport r{};
    iovec iov{&r, sizeof r};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    ssize_t n = ::recvmsg(out.status_r.get(), &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
        out.seccomp_listener.reset(fd);
        (void)setNonblocking(fd);
      }
    }
    if (n == static_cast<ssize_t>(sizeof r) && r.stage != 0) {
      out.fail_stage = r.stage;
      out.fail_errno = r.err;
    }
  }
  out.argv0 = req.argv[0];
  out.cwd = std::move(cwd);
  return out;
}

std::string spawnFailureMessage(const SpawnedExec& spawned) {
  ChildReport r{spawned.fail_stage, spawned.fail_errno};
  if (r.stage == 0) {
    if (!spawned.status_r) return {};
    ssize_t n;
    do {
      n = ::read(spawned.status_r.get(), &r, sizeof r);
    } while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(sizeof r) || r.stage == 0) return {};
  }
  std::string msg = "dsec: ";
  msg += stageName(r.stage);
  if (r.stage == kStageExec) msg += " " + spawned.argv0;
  if (r.stage == kStageChdir) msg += " " + spawned.cwd;
  msg += ": ";
  msg += std::strerror(r.err);
  msg += "\n";
  return msg;
}

uint64_t nonDefaultSignals() {
  uint64_t mask = 0;
  for (int sig = 1; sig <= 64; ++sig) {
    if (!hasDefaultDisposition(sig)) mask |= uint64_t{1} << (sig - 1);
  }
  return mask;
}

}  // namespace dsec::aether
