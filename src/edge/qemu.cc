#include "edge/qemu.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/kvm.h>
#include <linux/sched.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "edge/sandbox_state.h"

namespace dsec::edge::qemu {

using json = nlohmann::json;

std::string which(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return ::access(prog.c_str(), X_OK) == 0 ? prog : "";
  const char* path = ::getenv("PATH");
  for (auto& dir : splitString(path ? path : "/usr/bin:/bin", ':')) {
    std::string p = dir + "/" + prog;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

namespace {

// Runs a real-mode guest of five bytes through /dev/kvm: `mov al, 0x42; out
// 0x10, al; hlt`. Where KVM works the vCPU exits with that port write, then
// the halt. Runs in a child process the caller bounds in time, since a broken
// KVM may hang KVM_RUN. Exit code 0 means KVM works.
int kvmProbeChild() {
  int kvm = ::open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (kvm < 0) return 10;
  if (::ioctl(kvm, KVM_GET_API_VERSION, 0) != 12) return 11;
  int vm = ::ioctl(kvm, KVM_CREATE_VM, 0);
  if (vm < 0) return 12;
  void* mem = ::mmap(nullptr, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 13;
  const unsigned char code[] = {0xb0, 0x42, 0xe6, 0x10, 0xf4};
  std::memcpy(mem, code, sizeof code);
  struct kvm_userspace_memory_region region = {};
  region.slot = 0;
  region.guest_phys_addr = 0x1000;
  region.memory_size = 0x1000;
  region.userspace_addr = reinterpret_cast<uint64_t>(mem);
  if (::ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0) return 14;
  int vcpu = ::ioctl(vm, KVM_CREATE_VCPU, 0);
  if (vcpu < 0) return 15;
  int runSize = ::ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
  if (runSize <= 0) return 16;
  auto* run = static_cast<struct kvm_run*>(
      ::mmap(nullptr, size_t(runSize), PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0));
  if (run == MAP_FAILED) return 17;
  struct kvm_sregs sregs;
  if (::ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0) return 18;
  sregs.cs.base = 0;
  sregs.cs.selector = 0;
  if (::ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0) return 19;
  struct kvm_regs regs = {};
  regs.rip = 0x1000;
  regs.rax = 0;
  regs.rflags = 0x2;
  if (::ioctl(vcpu, KVM_SET_REGS, &regs) < 0) return 20;
  bool sawOut = false;
  for (int i = 0; i < 16; ++i) {
    if (::ioctl(vcpu, KVM_RUN, 0) < 0) return 21;
    if (run->exit_reason == KVM_EXIT_IO) {
      auto* data = reinterpret_cast<unsigned char*>(run) + run->io.data_offset;
      if (run->io.direction != KVM_EXIT_IO_OUT || run->io.port != 0x10 || *data != 0x42) return 22;
      sawOut = true;
      continue;
    }
    if (run->exit_reason == KVM_EXIT_HLT) return sawOut ? 0 : 23;
    return 24;  // an emulation failure, shutdown, internal error...
  }
  return 25;
}

}  // namespace

std::string probeKvm() {
  if (::access("/dev/kvm", R_OK | W_OK) != 0) return "no usable /dev/kvm";
  pid_t pid = ::fork();
  if (pid < 0) return std::string("fork: ") + std::strerror(errno);
  if (pid == 0) ::_exit(kvmProbeChild());
  int status = 0;
  double deadline = monoSeconds() + 3;
  for (;;) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (monoSeconds() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return "/dev/kvm hung running a probe guest";
    }
    ::usleep(2000);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return "/dev/kvm could not run a real-mode probe guest (step " + std::to_string(code) +
         "; paravirtual or nested KVM?)";
}

Result<RunResult> run(const std::vector<std::string>& args, const std::string& input,
                      double timeoutS, const std::function<bool(const RunResult&)>& stopWhen) {
  int in[2], out[2], err[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd inRd(in[0]), inWr(in[1]);
  if (::pipe2(out, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd outRd(out[0]), outWr(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd errRd(err[0]), errWr(err[1]);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return sysError("fork");
  if (pid == 0) {
    if (::dup2(inRd.get(), 0) < 0 || ::dup2(outWr.get(), 1) < 0 || ::dup2(errWr.get(), 2) < 0) {
      ::_exit(127);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  inRd.reset();
  outWr.reset();
  errWr.reset();
  // The pipe holds it whatever the program does with it; a program that has
  // already exited makes the write fail with EPIPE, and the SIGPIPE that
  // comes with it is taken here (blocked, then consumed) rather than left
  // to kill a caller that does not ignore it (a test binary).
  if (!input.empty()) {
    sigset_t pipeSet, old;
    sigemptyset(&pipeSet);
    sigaddset(&pipeSet, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &pipeSet, &old);
    sigset_t pending;
    sigpending(&pending);
    bool wasPending = sigismember(&pending, SIGPIPE) == 1;
    (void)!::write(inWr.get(), input.data(), input.size());
    sigpending(&pending);
    if (!wasPending && sigismember(&pending, SIGPIPE) == 1) {
      struct timespec zero {};
      while (::sigtimedwait(&pipeSet, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  inWr.reset();
  RunResult r;
  double deadline = timeoutS > 0 ? monoSeconds() + timeoutS : 0;
  auto left = [&] {
    return deadline == 0 ? -1 : std::max(0, int((deadline - monoSeconds()) * 1000));
  };
  struct pollfd p[2] = {{outRd.get(), POLLIN, 0}, {errRd.get(), POLLIN, 0}};
  int open = 2;
  while (open > 0 && !r.timedOut && !r.stopped) {
    int n = ::poll(p, 2, left());
    if (n < 0 && errno != EINTR) break;
    if (n == 0) r.timedOut = true;
    for (int i = 0; i < 2 && n > 0; ++i) {
      if (p[i].fd < 0 || !p[i].revents) continue;
      char buf[8192];
      ssize_t got = ::read(p[i].fd, buf, sizeof buf);
      if (got > 0) {
        (i == 0 ? r.out : r.err).append(buf, size_t(got));
        if (stopWhen && stopWhen(r)) r.stopped = true;
      } else if (got == 0 || errno != EINTR) {
        p[i].fd = -1;
        --open;
      }
    }
  }
  if (r.stopped) {
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
    }
    return r;
  }
  // Its output ended (or the deadline passed): wait for it within the deadline.
  for (;;) {
    pid_t w = ::waitpid(pid, &r.status, deadline == 0 ? 0 : WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) break;
    if (w == 0 && (r.timedOut || left() == 0)) {
      r.timedOut = true;
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    if (w == 0) ::usleep(5000);
  }
  return r;
}

Result<std::string> runCapture(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(RunResult r, run(args));
  if (!WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0) {
    while (!r.err.empty() && r.err.back() == '\n') r.err.pop_back();
    return internalError(
        args[0] + " failed: " + (r.err.empty() ? "status " + std::to_string(r.status) : r.err));
  }
  return std::move(r.out);
}

namespace {

// Why a program run() ran failed: the first line of its stderr, else how it
// ended ("killed by ...", "exit N").
std::string failureOf(const RunResult& r) {
  std::string first = r.err.substr(0, r.err.find('\n'));
  if (!first.empty()) return first;
  return WIFSIGNALED(r.status) ? std::string("killed by ") + ::strsignal(WTERMSIG(r.status))
                               : "exit " + std::to_string(WEXITSTATUS(r.status));
}

}  // namespace

std::string probeQemuKvm(const std::string& qemu, const std::string& machine) {
  // Stopped (-S), the guest never runs: QEMU's set-up is all that is tried.
  auto r = run({qemu, "-M", machine, "-accel", "kvm", "-cpu", "host", "-m", "64", "-nodefaults",
                "-no-user-config", "-display", "none", "-S", "-monitor", "stdio"},
               "quit\n", 10);
  if (!r.isOk()) return r.status().toString();
  if (r->timedOut) return "QEMU under KVM did not start and quit within 10 s";
  int st = r->status;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return "";
  return "QEMU under KVM failed to start: " + failureOf(*r);
}

std::string probeQemuKvmBoot(const std::string& qemu, const std::string& machine,
                             const std::string& kernel, double timeoutS) {
  auto r = run({qemu, "-M", machine, "-accel", "kvm", "-cpu", "host", "-smp", "1", "-m", "128",
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-kernel",
                kernel, "-append", "console=ttyS0 panic=-1 reboot=t quiet", "-serial", "stdio"},
               "", timeoutS, [](const RunResult& so) {
                 return so.err.find("KVM internal error") != std::string::npos ||
                        so.err.find("emulation failure") != std::string::npos;
               });
  if (!r.isOk()) return r.status().toString();
  if (r->stopped) return "the guest kernel failed under KVM: " + failureOf(*r);
  if (r->timedOut) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", timeoutS);
    return std::string("the guest kernel did not boot to its end under KVM within ") + secs +
           " s";
  }
  int st = r->status;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    return "QEMU booting the guest kernel under KVM failed: " + failureOf(*r);
  }
  if (r->out.find("Kernel panic") == std::string::npos) {
    return "the guest kernel under KVM ended without reaching its root-filesystem panic";
  }
  return "";
}

namespace {

// probeQemuKvmBoot's verdict, cached in /run/dsec (a tmpfs: gone at reboot)
// for this boot, QEMU binary, machine and kernel: a node's edges start
// often (every `dsec up`, every test server) and a broken KVM can take the
// whole timeout to show it. Without a writable /run, no cache.
std::string cachedBootProbe(const std::string& qemu, const std::string& machine,
                            const std::string& kernel) {
  auto identity = [](const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return path;
    return path + ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) +
           "." + std::to_string(st.st_mtim.tv_nsec);
  };
  auto bootId = readFile("/proc/sys/kernel/random/boot_id");
  const std::string dir = "/run/dsec";
  const std::string path =
      dir + "/kvm-boot-probe-" +
      sha256Hex((bootId.isOk() ? *bootId : "") + "\n" + identity(qemu) + "\n" + machine + "\n" +
                identity(kernel))
          .substr(0, 16);
  if (auto v = readFile(path); v.isOk()) {
    if (*v == "ok") return "";
    if (v->starts_with("bad:")) return v->substr(4);
  }
  std::string bad = probeQemuKvmBoot(qemu, machine, kernel, 5);
  if (makeDirs(dir, 0700).isOk()) (void)writeFileAtomic(path, bad.empty() ? "ok" : "bad:" + bad);
  return bad;
}

}  // namespace

std::string chooseAccel(const std::string& want, const std::string& qemu,
                        const std::string& machine, std::string* why, const std::string& kernel) {
  if (want == "tcg") {
    *why = "TCG as configured";
    return "tcg";
  }
  std::string bad = probeKvm();
  if (bad.empty()) bad = probeQemuKvm(qemu, machine);
  bool booted = false;
  if (bad.empty() && !kernel.empty() && ::access(kernel.c_str(), R_OK) == 0) {
    bad = cachedBootProbe(qemu, machine, kernel);
    booted = bad.empty();
  }
  if (bad.empty()) {
    *why = booted ? "KVM ran a probe guest, and QEMU booted a Linux kernel under it"
                  : "KVM ran a probe guest, and QEMU started under it";
    return "kvm";
  }
  if (want == "kvm") {
    *why = "KVM required but unusable: " + bad;
    return "";
  }
  *why = "TCG emulation: " + bad;
  return "tcg";
}

// The address of unix socket `name` in the directory of dirFd, through
// /proc/self/fd (a VM directory's path may be longer than sun_path).
static sockaddr_un unixAddrIn(int dirFd, const std::string& name) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::string path = "/proc/self/fd/" + std::to_string(dirFd) + "/" + name;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  return addr;
}

Result<UniqueFd> connectUnix(int dirFd, const std::string& name) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return sysError("socket");
  struct sockaddr_un addr = unixAddrIn(dirFd, name);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return sysError("connect " + name);
  }
  return fd;
}

Result<json> qmp(const std::string& dir, const std::string& command, const json& args,
                 double timeoutS) {
  UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!d) return sysError("open " + dir);
  ASSIGN_OR_RETURN(UniqueFd fd, connectUnix(d.get(), "qmp.sock"));
  struct timeval tv = {long(timeoutS), long((timeoutS - double(long(timeoutS))) * 1e6)};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string buf;
  auto nextMessage = [&]() -> Result<json> {
    for (;;) {
      size_t nl = buf.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        json j = json::parse(line, nullptr, false);
        if (j.is_discarded()) return internalError("QMP: unparsable reply " + line);
        if (j.contains("event")) continue;
        return j;
      }
      char tmp[4096];
      ssize_t n = ::read(fd.get(), tmp, sizeof tmp);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return Status(Code::kDeadlineExceeded, "QMP: no reply in time");
      }
      if (n <= 0) return Status(Code::kUnavailable, "QMP: connection closed");
      buf.append(tmp, size_t(n));
    }
  };
  auto call = [&](const std::string& cmd, const json& a) -> Result<json> {
    json req = {{"execute", cmd}};
    if (!a.is_null()) req["arguments"] = a;
    std::string line = req.dump() + "\n";
    if (::send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL) != ssize_t(line.size())) {
      return sysError("QMP write");
    }
    ASSIGN_OR_RETURN(json r, nextMessage());
    if (r.contains("error")) {
      return internalError("QMP " + cmd + ": " + r["error"].value("desc", r.dump()));
    }
    return r.contains("return") ? r["return"] : json::object();
  };
  ASSIGN_OR_RETURN(json greeting, nextMessage());
  (void)greeting;
  RETURN_IF_ERROR(call("qmp_capabilities", nullptr).status());
  return call(command, args);
}

bool exited(int pidfd) {
  struct pollfd p = {pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
}

std::vector<std::string> nicArgs(const std::string& device) {
  return {"-netdev", std::string("user,id=net0,ipv6=off,net=10.0.2.0/24,host=") + kGuestGateway,
          "-device", device + ",netdev=net0,mac=" + kGuestMac};
}

Result<UniqueFd> openNetns(pid_t pid, int pidfd, bool network, const std::string& kind) {
  if (!network) {
    return Status(Code::kFailedPrecondition,
                  "this " + kind +
                      " was booted without a network device (its first policy granted no "
                      "egress); create it under a policy that grants egress",
                  0, "egress");
  }
  if (pid <= 0 || pidfd < 0) return Status(Code::kFailedPrecondition, "the " + kind + " is gone");
  std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return sysError("open " + path);
  UniqueFd ns(fd);
  if (exited(pidfd)) return Status(Code::kFailedPrecondition, "the " + kind + " is gone");
  return ns;
}

std::string tailFile(const std::string& path, size_t max) {
  auto text = readFile(path);
  if (!text.isOk()) return "";
  std::string s = *text;
  if (s.size() > max) s = s.substr(s.size() - max);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

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

Result<Process> spawnConfined(const std::vector<std::string>& args, const std::string& dir,
                              Cgroups* cgroups, const std::string& cgroupId) {
  // argv, all of it made before fork.
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  UniqueFd logFd(
      ::open((dir + "/qemu.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!logFd) return sysError("open qemu.log");
  // Empty until QEMU opens it (-serial file:console.log): a boot that fails
  // before that still leaves a console log to keep.
  UniqueFd console(
      ::open((dir + "/console.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!console) return sysError("create console.log");
  console.reset();
  int go[2];
  if (::pipe2(go, O_CLOEXEC) != 0) return sysError("pipe");
  UniqueFd goRd(go[0]), goWr(go[1]);
  // clone3 rather than fork + unshare: QEMU itself is PID 1 of a new pid
  // namespace (it sees no host process; with spawn=deny it has no children),
  // and it comes with a pidfd. No host network (a fresh, empty netns), nor the
  // host's IPC or hostname; mounts it makes stay its own.
  int pidfd = -1;
  struct clone_args ca = {};
  ca.flags = CLONE_PIDFD | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS;
  ca.pidfd = reinterpret_cast<uint64_t>(&pidfd);
  ca.exit_signal = SIGCHLD;
  pid_t pid = pid_t(syscall(SYS_clone3, &ca, sizeof ca));
  if (pid < 0) return sysError("clone3");
  if (pid == 0) {
    // Only async-signal-safe calls from here on: the edge has threads.
    ::setsid();
    int null = ::open("/dev/null", O_RDWR);
    if (null < 0 || ::dup2(null, 0) < 0 || ::dup2(logFd.get(), 1) < 0 ||
        ::dup2(logFd.get(), 2) < 0) {
      ::_exit(120);
    }
    char c;
    if (::read(goRd.get(), &c, 1) != 1) ::_exit(122);  // in its cgroup by now
    if (::chdir(dir.c_str()) != 0) ::_exit(123);
    if (syscall(SYS_close_range, 3, ~0U, 0) != 0) ::_exit(124);
    ::execv(argv[0], argv.data());
    ::_exit(125);
  }
  goRd.reset();
  logFd.reset();
  Process p;
  p.pid = pid;
  p.pidfd.reset(pidfd);
  auto kill = [&](Status st) -> Status {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return st;
  };
  if (!p.pidfd) return kill(internalError("clone3 gave no pidfd"));
  if (Status st = cgroups->attach(cgroupId, pid); !st.isOk()) return kill(st);
  if (::write(goWr.get(), "g", 1) != 1) return kill(sysError("write go pipe"));
  return p;
}

Status bootWithRetry(const std::string& kind, const std::string& id, const std::string& dir,
                     double timeoutS, const std::string& consoleLog,
                     const std::function<Status(bool* hung)>& once) {
  bool hung = false;
  Status st = once(&hung);
  if (!st.isOk() && hung) {
    log::warn(kind + " " + id + " did not answer at boot, retrying: " + st.toString() +
              "; console: " + tailFile(dir + "/console.log", 300));
    st = once(&hung);
  }
  if (!st.isOk() && hung) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.0f", timeoutS);
    st = Status(Code::kUnavailable, "the " + kind + " did not boot within " + secs + " s (" +
                                        st.message() + "), twice (console log: " + consoleLog +
                                        ")");
  }
  return st;
}

Status recordAndWatch(const std::string& dir, pid_t pid, int pidfd, Reactor* reactor,
                      std::function<void()> onDeath) {
  RETURN_IF_ERROR(writeFileAtomic(dir + "/qemu.pid", std::to_string(pid) + "\n"));
  return reactor->watchExit(pidfd, std::move(onDeath));
}

Result<UniqueFd> adoptQemu(const SandboxState& state, const std::string& dir,
                           const std::function<Status(int pidfd)>& reconnect) {
  UniqueFd pidfd(int(syscall(SYS_pidfd_open, state.pid, 0)));
  if (!pidfd) return sysError("pidfd_open");
  // The pid may have been reused since: only the same process counts.
  auto started = processStartTime(state.pid);
  if (!started.isOk() || *started != state.startTime) {
    return Status(Code::kNotFound, "its QEMU is gone");
  }
  if (state.paused) RETURN_IF_ERROR(qmp(dir, "cont").status());
  RETURN_IF_ERROR(reconnect(pidfd.get()));
  if (state.paused) RETURN_IF_ERROR(qmp(dir, "stop").status());
  return pidfd;
}

namespace {

// A listening unix socket `name` in the directory of dirFd (bound through
// /proc/self/fd, as connectUnix connects).
Result<UniqueFd> listenUnix(int dirFd, const std::string& name) {
  ::unlinkat(dirFd, name.c_str(), 0);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return sysError("socket");
  struct sockaddr_un addr = unixAddrIn(dirFd, name);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return sysError("bind " + name);
  }
  if (::listen(fd.get(), 1) != 0) return sysError("listen " + name);
  return fd;
}

// query-migrate's status ("active", "completed", "failed", ...), with
// QEMU's error description after a ": " when it failed.
Result<std::string> migrationStatus(const std::string& dir) {
  ASSIGN_OR_RETURN(json r, qmp(dir, "query-migrate"));
  std::string st = r.value("status", "none");
  if (r.contains("error-desc")) st += ": " + r["error-desc"].get<std::string>();
  return st;
}

// Polls query-migrate until the migration completed; kInternal when QEMU
// says it failed, kDeadlineExceeded past the deadline.
Status awaitMigration(const std::string& dir, double deadline, const std::string& what) {
  for (;;) {
    ASSIGN_OR_RETURN(std::string st, migrationStatus(dir));
    if (st == "completed") return Status::ok();
    if (startsWith(st, "failed") || startsWith(st, "cancelled")) {
      return internalError(what + ": QEMU's migration " + st);
    }
    if (monoSeconds() > deadline) {
      return Status(Code::kDeadlineExceeded, what + ": not done in time (migration " + st + ")");
    }
    ::usleep(20000);
  }
}

}  // namespace

Result<uint64_t> saveState(const std::string& dir, const std::string& statePath,
                           double timeoutS) {
  const double deadline = monoSeconds() + timeoutS;
  UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!d) return sysError("open " + dir);
  ASSIGN_OR_RETURN(UniqueFd lfd, listenUnix(d.get(), "mig.sock"));
  bool started = false;
  auto saved = [&]() -> Result<uint64_t> {
    UniqueFd out(::open(statePath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!out) return sysError("create " + statePath);
    // Stopped first: one pass over RAM, one consistent moment.
    RETURN_IF_ERROR(qmp(dir, "stop").status());
    // QEMU caps migration at 32 MiB/s by default; the peer is a local file.
    RETURN_IF_ERROR(
        qmp(dir, "migrate-set-parameters", json{{"max-bandwidth", int64_t(1) << 40}}).status());
    RETURN_IF_ERROR(qmp(dir, "migrate", json{{"uri", "unix:mig.sock"}}).status());
    started = true;
    UniqueFd c;
    while (!c) {
      struct pollfd p = {lfd.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, 200);
      if (rc < 0 && errno != EINTR) return sysError("poll mig.sock");
      if (rc == 1) {
        c.reset(::accept4(lfd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c && errno != EINTR && errno != EAGAIN) return sysError("accept mig.sock");
        continue;
      }
      ASSIGN_OR_RETURN(std::string st, migrationStatus(dir));
      if (startsWith(st, "failed") || startsWith(st, "cancelled")) {
        return internalError("save: QEMU's migration " + st);
      }
      if (monoSeconds() > deadline) {
        return Status(Code::kDeadlineExceeded, "save: QEMU did not connect to mig.sock");
      }
    }
    std::vector<char> buf(1 << 20);
    uint64_t total = 0;
    for (;;) {
      struct pollfd p = {c.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, 500);
      if (rc < 0 && errno != EINTR) return sysError("poll mig.sock");
      if (monoSeconds() > deadline) {
        return Status(Code::kDeadlineExceeded, "save: the state was not written in time (" +
                                                   std::to_string(total) + " bytes so far)");
      }
      if (rc <= 0) continue;
      ssize_t n = ::read(c.get(), buf.data(), buf.size());
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) return sysError("read mig.sock");
      if (n == 0) break;
      for (ssize_t off = 0; off < n;) {
        ssize_t w = ::write(out.get(), buf.data() + off, size_t(n - off));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return sysError("write " + statePath);
        off += w;
      }
      total += uint64_t(n);
    }
    RETURN_IF_ERROR(awaitMigration(dir, deadline, "save"));
    if (::fsync(out.get()) != 0) return sysError("fsync " + statePath);
    if (total == 0) return internalError("save: QEMU sent no state");
    return total;
  }();
  ::unlinkat(d.get(), "mig.sock", 0);
  if (!saved.isOk()) {
    if (started) (void)qmp(dir, "migrate_cancel");
    ::unlink(statePath.c_str());
  }
  return saved;
}

Status loadState(const std::string& dir, const std::string& statePath, double timeoutS) {
  const double deadline = monoSeconds() + timeoutS;
  UniqueFd in(::open(statePath.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return sysError("open " + statePath);
  struct stat sb;
  if (::fstat(in.get(), &sb) != 0) return sysError("stat " + statePath);
  UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!d) return sysError("open " + dir);
  ::unlinkat(d.get(), "in.sock", 0);
  RETURN_IF_ERROR(qmp(dir, "migrate-incoming", json{{"uri", "unix:in.sock"}}).status());
  UniqueFd c;
  for (;;) {
    auto s = connectUnix(d.get(), "in.sock");
    if (s.isOk()) {
      c = std::move(*s);
      break;
    }
    if (monoSeconds() > deadline) return Status(s.status()).withContext("restore");
    ::usleep(10000);
  }
  ::unlinkat(d.get(), "in.sock", 0);  // QEMU has it open; nobody else needs the name
  // A send that blocks (QEMU not reading) is bounded so the deadline holds.
  struct timeval tv = {1, 0};
  ::setsockopt(c.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  off_t off = 0;
  while (off < sb.st_size) {
    ssize_t n = ::sendfile(c.get(), in.get(), &off, size_t(sb.st_size - off));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
      if (monoSeconds() > deadline) {
        return Status(Code::kDeadlineExceeded, "restore: QEMU did not take the state in time");
      }
      continue;
    }
    if (n < 0) {
      // QEMU closes the socket when it refuses the stream: say why.
      auto st = migrationStatus(dir);
      return Status(Code::kInternal, "restore: sending the state: " +
                                         std::string(std::strerror(errno)) +
                                         (st.isOk() ? " (migration " + *st + ")" : ""));
    }
    if (n == 0) break;
  }
  ::shutdown(c.get(), SHUT_WR);
  return awaitMigration(dir, deadline, "restore");
}

Status awaitQmp(const std::string& dir, int pidfd, double deadline) {
  UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!d) return sysError("open " + dir);
  for (;;) {
    if (connectUnix(d.get(), "qmp.sock").isOk()) return Status::ok();
    if (exited(pidfd)) return Status(Code::kInternal, "QEMU exited");
    if (monoSeconds() > deadline) return Status(Code::kDeadlineExceeded, "QEMU did not open QMP");
    ::usleep(10000);
  }
}

namespace {
constexpr double kSaveTimeoutS = 600;  // a save or a load of guest RAM (TCG, loaded host)
}  // namespace

Result<uint64_t> saveToStateFile(const std::string& dir, const std::function<Status()>& persist) {
  const std::string saved = dir + "/" + kStateFile;
  const std::string tmp = saved + ".tmp";
  auto bytes = saveState(dir, tmp, kSaveTimeoutS);
  if (!bytes.isOk()) return bytes;
  Status st = Status::ok();
  if (::rename(tmp.c_str(), saved.c_str()) != 0) st = sysError("rename " + tmp);
  if (st.isOk()) {
    if (UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); d) ::fsync(d.get());
    st = persist();
  }
  if (!st.isOk()) {
    ::unlink(tmp.c_str());
    ::unlink(saved.c_str());
    return st;
  }
  return bytes;
}

void endSavedQemu(const std::string& dir, UniqueFd* pidfd, Reactor* reactor,
                  const std::vector<std::string>& gone) {
  reactor->unwatchExit(pidfd->get());
  (void)qmp(dir, "quit");
  struct pollfd p = {pidfd->get(), POLLIN, 0};
  ::poll(&p, 1, 5000);
  killAndWait(pidfd->get());  // reaps it
  pidfd->reset();
  for (auto& f : gone) ::unlink((dir + "/" + f).c_str());
  ::unlink((dir + "/qemu.pid").c_str());
  appendAndRemove(dir + "/console.log", dir + "/" + kPrevConsole);
}

Status startFromStateFile(const std::vector<std::string>& args, const std::string& dir,
                          Cgroups* cgroups, const std::string& id,
                          const std::vector<std::string>& gone, pid_t* pid, UniqueFd* pidfd,
                          const std::function<Status()>& beforeRun) {
  std::vector<std::string> argv = args;
  argv.push_back("-incoming");
  argv.push_back("defer");
  for (auto& f : gone) ::unlink((dir + "/" + f).c_str());
  ::unlink((dir + "/in.sock").c_str());
  ASSIGN_OR_RETURN(Process proc, spawnConfined(argv, dir, cgroups, id));
  *pid = proc.pid;
  *pidfd = std::move(proc.pidfd);
  Status st = awaitQmp(dir, pidfd->get(), monoSeconds() + 60);
  if (st.isOk()) st = loadState(dir, dir + "/" + kStateFile, kSaveTimeoutS);
  // The guest is loaded and stopped: what it reaches once it runs is set up now.
  if (st.isOk()) st = beforeRun();
  if (st.isOk()) st = qmp(dir, "cont").status();
  if (!st.isOk()) {
    killAndWait(pidfd->get());
    pidfd->reset();
    *pid = -1;
  }
  return st;
}

Status failedRestore(const std::string& id, const std::string& dir, const std::string& kept,
                     pid_t* pid, UniqueFd* pidfd, const Status& why) {
  killAndWait(pidfd->get());
  pidfd->reset();
  *pid = -1;
  std::string said = tailFile(dir + "/qemu.log", 400);
  // Every run's console, in order, is kept for diagnosis.
  ::unlink(kept.c_str());
  appendAndRemove(dir + "/" + kPrevConsole, kept);
  appendAndRemove(dir + "/console.log", kept);
  return Status(nodeFailure(why.code()),
                "restore " + id + " from its saved memory failed: " + why.message() +
                    (said.empty() ? "" : " (QEMU: " + said + ")") + " (console log: " + kept + ")");
}

Code nodeFailure(Code c) {
  switch (c) {
    case Code::kResourceExhausted:
    case Code::kDeadlineExceeded:
    case Code::kUnavailable:
      return c;
    default:
      return Code::kInternal;
  }
}

std::shared_ptr<AgentConn> hibernatedConn(const std::string& id) {
  auto c = std::make_shared<AgentConn>(UniqueFd(), "vm-" + id);
  c->fail(Status(Code::kUnavailable, "sandbox " + id + " is hibernated"));
  return c;
}

size_t countInFile(const std::string& path, const std::string& needle) {
  auto text = readFile(path);
  if (!text.isOk() || needle.empty()) return 0;
  size_t n = 0;
  for (size_t at = text->find(needle); at != std::string::npos; at = text->find(needle, at + 1)) {
    ++n;
  }
  return n;
}

void appendAndRemove(const std::string& from, const std::string& to) {
  auto text = readFile(from);
  if (!text.isOk()) return;
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  if (out) {
    const char* p = text->data();
    size_t n = text->size();
    while (n > 0) {
      ssize_t w = ::write(out.get(), p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      p += w;
      n -= size_t(w);
    }
  }
  ::unlink(from.c_str());
}

void removeLeftovers(Cgroups* cgroups, const std::string& id, const std::string& dir) {
  // Its cgroup holds its QEMU: removing it kills that. A QEMU outside it (it
  // died before being attached, or the cgroup is gone) by its recorded pid.
  if (Status st = cgroups->remove(id); !st.isOk()) log::error("orphan " + id + ": " + st.toString());
  if (auto pid = readFile(dir + "/qemu.pid"); pid.isOk()) {
    pid_t p = pid_t(std::atoi(pid->c_str()));
    int fd = p > 0 ? int(syscall(SYS_pidfd_open, p, 0)) : -1;
    if (fd >= 0) {
      // Only if it still is a QEMU of this VM directory.
      auto cwd = std::string(PATH_MAX, '\0');
      ssize_t n = ::readlink(("/proc/" + std::to_string(p) + "/cwd").c_str(), cwd.data(), cwd.size());
      if (n > 0 && cwd.substr(0, size_t(n)) == dir) {
        syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0);
        struct pollfd pf = {fd, POLLIN, 0};
        ::poll(&pf, 1, 5000);
      }
      ::close(fd);
    }
  }
  if (Status st = removeTree(dir); !st.isOk()) log::error("orphan " + id + ": " + st.toString());
}

}  // namespace dsec::edge::qemu
