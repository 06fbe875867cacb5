#include "aether/fncall.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/msg.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "aether/files.h"
#include "aether/landlock.h"
#include "common/base64.h"

namespace dsec::aether {

const char* const kPythonZygote =
#include "aether/fncall_zygote.py.inc"
    ;

namespace {

// How long a zygote may take to answer a call.
constexpr int kZygoteAnswerMs = 10000;
// Requests up to this size go inline; larger ones in a memfd (a seqpacket
// message must fit the socket buffer).
constexpr size_t kInlineRequest = 60000;

bool validLanguage(const std::string& s) {
  if (s.empty() || s.size() > 32) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) {
      return false;
    }
  }
  return true;
}

Status readLimits(const Json& j, const char* field, CallLimits& out) {
  if (!j.is_object()) return invalidArg(field, std::string(field) + " must be an object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* kKeys[] = {"cpu_s", "memory_mb", "processes", "file_size_mb", "open_files"};
    bool known = false;
    for (const char* k : kKeys) known = known || it.key() == k;
    if (!known) return invalidArg(std::string(field) + "." + it.key(), "unknown limit");
  }
  RETURN_IF_ERROR(readInt(j, "cpu_s", 0, 86400, out.cpu_s));
  RETURN_IF_ERROR(readInt(j, "memory_mb", 0, 1 << 20, out.memory_mb));
  RETURN_IF_ERROR(readInt(j, "processes", 0, 1 << 20, out.processes));
  RETURN_IF_ERROR(readInt(j, "file_size_mb", 0, 1 << 20, out.file_size_mb));
  RETURN_IF_ERROR(readInt(j, "open_files", 0, 1 << 20, out.open_files));
  return Status::ok();
}

Json limitsJson(const CallLimits& l) {
  return Json{{"cpu_s", l.cpu_s},
              {"memory_mb", l.memory_mb},
              {"processes", l.processes},
              {"file_size_mb", l.file_size_mb},
              {"open_files", l.open_files}};
}

// A relative path of a file a one-shot call brings: no "..", no empty or
// "." components, no NUL.
bool validRelPath(const std::string& p) {
  if (p.empty() || p.size() > 1024 || p[0] == '/' || p.find('\0') != std::string::npos) {
    return false;
  }
  size_t start = 0;
  while (start <= p.size()) {
    size_t slash = p.find('/', start);
    std::string part = p.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return true;
}

struct ProcInfo {
  pid_t ppid = 0, pgid = 0, sid = 0;
  // In exit(2), its only thread: it runs no more user code, the kernel is
  // freeing its memory.
  bool exiting = false;
  // Clock ticks after boot: with the pid, names one process (pids are reused).
  unsigned long long start = 0;
};

constexpr unsigned kPfExiting = 0x4;  // PF_EXITING, include/linux/sched.h

std::map<pid_t, ProcInfo> scanProc() {
  std::map<pid_t, ProcInfo> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  char buf[512];
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    std::snprintf(buf, sizeof buf, "/proc/%ld/stat", pid);
    int fd = ::open(buf, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t n = ::read(fd, buf, sizeof buf - 1);
    ::close(fd);
    if (n <= 0) continue;
    buf[n] = '\0';
    // "pid (comm) state ppid pgrp session ...": comm may hold anything, so
    // parse from its last ')'.
    char* rp = std::strrchr(buf, ')');
    if (!rp) continue;
    // Fields 3-6, 9 (flags), 20 (num_threads) and 22 (starttime) of
    // proc_pid_stat(5).
    char state;
    int ppid, pgid, sid;
    unsigned flags = 0;
    long threads = 1;
    unsigned long long start = 0;
    if (std::sscanf(rp + 1,
                    " %c %d %d %d %*d %*d %u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %ld %*d %llu",
                    &state, &ppid, &pgid, &sid, &flags, &threads, &start) < 4) {
      continue;
    }
    // Dead, waiting to be reaped. Not so a zombie leader whose other threads
    // still run (its main thread called exit(2) alone): it is killed too.
    if (state == 'Z' && threads <= 1) continue;
    out[pid_t(pid)] = ProcInfo{ppid, pgid, sid, (flags & kPfExiting) != 0 && threads <= 1, start};
  }
  ::closedir(d);
  return out;
}

}  // namespace

Result<FncallConfig> parseFncallConfig(const Json& j) {
  if (!j.is_object()) return invalidArg("fncall", "fncall must be an object");
  FncallConfig c;
  RETURN_IF_ERROR(readInt(j, "scratch_mb", 1, 1 << 20, c.scratch_mb));
  if (auto it = j.find("languages"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArg("fncall.languages", "must be an object");
    for (auto l = it->begin(); l != it->end(); ++l) {
      if (!validLanguage(l.key()) || l.key() == "python" || l.key() == "bash") {
        return invalidArg("fncall.languages", "bad language name '" + l.key() + "'");
      }
      std::vector<std::string> argv;
      if (!l.value().is_array() || l.value().empty()) {
        return invalidArg("fncall.languages", "a language maps to a non-empty argv");
      }
      for (auto& a : l.value()) {
        if (!a.is_string()) return invalidArg("fncall.languages", "argv items must be strings");
        argv.push_back(a.get<std::string>());
      }
      c.languages[l.key()] = std::move(argv);
    }
  }
  RETURN_IF_ERROR(readStringList(j, "prestart", false, c.prestart));
  if (auto it = j.find("zygote_max_calls"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 1) {
      return invalidArg("fncall.zygote_max_calls", "must be a positive integer");
    }
    c.zygote_max_calls = it->get<int64_t>();
  }
  for (const auto& p : c.prestart) {
    if (p != "python") return invalidArg("fncall.prestart", "only python has a zygote");
  }
  if (auto it = j.find("limits"); it != j.end() && !it->is_null()) {
    RETURN_IF_ERROR(readLimits(*it, "fncall.limits", c.defaults));
  }
  return c;
}

Status setupFncallRoot(const FncallConfig& config) {
  // The overlay is still writable here: make the mount point, then mount
  // the scratch tmpfs and turn the root read-only beneath it.
  if (::mkdir(kScratchDir, 0755) < 0 && errno != EEXIST) return sysError("mkdir /scratch");
  std::string opts = "size=" + std::to_string(config.scratch_mb) + "m,mode=1777";
  if (::mount("tmpfs", kScratchDir, "tmpfs", MS_NOSUID | MS_NODEV, opts.c_str()) < 0) {
    return sysError("mount tmpfs on /scratch");
  }
  if (::mkdir(kRunDir, 0711) < 0 && errno != EEXIST) return sysError("mkdir /scratch/.run");
  if (::mount(nullptr, "/", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) < 0) {
    return sysError("remount / read-only");
  }
  return Status::ok();
}

Result<UniqueFd> buildScratchRuleset() {
  int abi = landlockAbi();
  if (abi <= 0) return Status(Code::kFailedPrecondition, "Landlock is not available");
  const uint64_t rights = writeRights(abi);
  // Scoped (Landlock ABI 6): each exec entering this ruleset is a domain of
  // its own for signals and abstract unix sockets, so a call cannot signal
  // (stop, kill) its zygote, a held spare or another exec (docs/fncall.md).
  ASSIGN_OR_RETURN(UniqueFd rs, createRuleset(abi, rights, true));
  RETURN_IF_ERROR(allowBeneath(rs.get(), kScratchDir, rights, false));
  for (const char* dev : {"/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/pts"}) {
    RETURN_IF_ERROR(allowBeneath(rs.get(), dev, fileRights(abi), false));
  }
  return rs;
}

Result<CallRequest> parseCallRequest(const Json& j, const FncallConfig& config) {
  if (!j.is_object()) return invalidArg("fncall", "fncall must be an object");
  CallRequest r;
  RETURN_IF_ERROR(readString(j, "language", false, r.language));
  if (!r.language.empty() && r.language != "python" && r.language != "bash" &&
      !config.languages.count(r.language)) {
    std::string known = "python, bash";
    for (auto& [name, argv] : config.languages) known += ", " + name;
    return invalidArg("language", "unknown language '" + r.language + "' (known: " + known + ")");
  }
  RETURN_IF_ERROR(readString(j, "code", !r.language.empty(), r.code));
  if (r.code.find('\0') != std::string::npos) return invalidArg("code", "code must not hold NUL");
  RETURN_IF_ERROR(readBool(j, "fresh_dir", r.fresh_dir));
  RETURN_IF_ERROR(readBool(j, "exclusive", r.exclusive));
  if (auto it = j.find("files"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArg("files", "files must be an object");
    if (!r.fresh_dir) return invalidArg("files", "files need fresh_dir");
    for (auto f = it->begin(); f != it->end(); ++f) {
      if (!validRelPath(f.key())) {
        return invalidArg("files", "'" + f.key() + "' is not a relative path without '..'");
      }
      if (!f.value().is_string()) return invalidArg("files", "file contents are base64 strings");
      auto data = base64Decode(f.value().get<std::string>());
      if (!data.isOk()) return invalidArg("files", "'" + f.key() + "' is not base64");
      r.files.emplace_back(f.key(), std::move(*data));
    }
  }
  if (auto it = j.find("limits"); it != j.end() && !it->is_null()) {
    CallLimits l;
    RETURN_IF_ERROR(readLimits(*it, "limits", l));
    r.limits = l;
  }
  return r;
}

std::vector<std::pair<int, struct rlimit>> callRlimits(const CallLimits& l) {
  std::vector<std::pair<int, struct rlimit>> out;
  auto add = [&](int res, int64_t v, int64_t mul, bool cpu) {
    if (v <= 0) return;
    struct rlimit r;
    r.rlim_cur = rlim_t(v) * rlim_t(mul);
    // CPU: SIGXCPU at the soft limit, SIGKILL a second later if caught.
    r.rlim_max = cpu ? r.rlim_cur + 1 : r.rlim_cur;
    out.emplace_back(res, r);
  };
  add(RLIMIT_CPU, l.cpu_s, 1, true);
  add(RLIMIT_AS, l.memory_mb, 1 << 20, false);
  add(RLIMIT_NPROC, l.processes, 1, false);
  add(RLIMIT_FSIZE, l.file_size_mb, 1 << 20, false);
  add(RLIMIT_NOFILE, l.open_files, 1, false);
  return out;
}

void killCallProcesses(pid_t pid, bool everything, const std::set<pid_t>& keep) {
  const pid_t self = ::getpid();
  // Those killed in an earlier round (pid -> start time) are not waited for:
  // SIGKILL cannot be caught, and a process with one pending can no longer
  // fork (copy_process fails), so each round only looks for processes that
  // were forked before their parent's kill. Waiting for the killed to leave
  // /proc instead spun here while each freed its copy of the zygote's
  // memory, often on the CPU this loop held.
  std::map<pid_t, unsigned long long> killed;
  for (int round = 0; round < 200; ++round) {
    auto procs = scanProc();
    std::set<pid_t> doomed;
    for (auto& [p, info] : procs) {
      if (p == self || keep.count(p)) continue;
      // The call itself, reported ended by its zygote before the kernel has
      // finished freeing it (docs/fncall.md): nothing left to stop.
      if (p == pid && info.exiting) continue;
      // A zygote's spare (forked ahead, still in the zygote's session: a
      // call's process always has a session of its own) stays too.
      if (keep.count(info.ppid) && info.sid == info.ppid) continue;
      if (everything || info.sid == pid || info.pgid == pid) doomed.insert(p);
    }
    if (!everything) {
      // Descendants of those, whatever session they moved to.
      bool grew = true;
      while (grew) {
        grew = false;
        for (auto& [p, info] : procs) {
          if (p == self || keep.count(p) || doomed.count(p)) continue;
          if (doomed.count(info.ppid)) {
            doomed.insert(p);
            grew = true;
          }
        }
      }
    }
    bool fresh = false;
    for (pid_t p : doomed) {
      const unsigned long long start = procs[p].start;
      if (auto k = killed.find(p); k != killed.end() && k->second == start) continue;
      ::kill(p, SIGKILL);
      killed[p] = start;
      fresh = true;
    }
    if (!fresh) return;
  }
}

void wipeSandboxState() {
  if (DIR* d = ::opendir(kScratchDir)) {
    std::vector<std::string> names;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != ".." && name != ".run") names.push_back(name);
    }
    ::closedir(d);
    for (const auto& n : names) (void)removePath(std::string(kScratchDir) + "/" + n, true);
  }
  // /proc/sysvipc/{shm,msg,sem}: a header line, then "key id ...".
  for (const char* kind : {"shm", "msg", "sem"}) {
    FILE* f = std::fopen((std::string("/proc/sysvipc/") + kind).c_str(), "re");
    if (!f) continue;
    char line[512];
    bool header = true;
    while (std::fgets(line, sizeof line, f)) {
      if (header) {
        header = false;
        continue;
      }
      long long key;
      int id;
      if (std::sscanf(line, "%lld %d", &key, &id) != 2) continue;
      if (kind[1] == 'h') {
        ::shmctl(id, IPC_RMID, nullptr);
      } else if (kind[0] == 'm') {
        ::msgctl(id, IPC_RMID, nullptr);
      } else {
        ::semctl(id, 0, IPC_RMID);
      }
    }
    std::fclose(f);
  }
}

// ---- Zygote ----

Result<std::unique_ptr<Zygote>> Zygote::begin(const std::string& language,
                                              const ExecSettings& settings, UniqueFd& listener) {
  if (language != "python") {
    return invalidArg("language", "no zygote for language '" + language + "'");
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
    return sysError("socketpair");
  }
  UniqueFd mine(sv[0]), theirs(sv[1]);
  ExecRequest req;
  req.argv = {"python3", "-c", kPythonZygote};
  req.cwd = "/";
  // A hash secret of its own (whatever the image's env says): its calls
  // share it (a fork cannot re-seed str hashing: the zygote's interned
  // strings and dicts keep hashes made with it), the next zygote's differs.
  std::vector<std::string> env;
  for (const auto& kv : settings.default_env) {
    if (!kv.starts_with("PYTHONHASHSEED=")) env.push_back(kv);
  }
  uint32_t seed = 0;
  if (::getrandom(&seed, sizeof seed, 0) != ssize_t(sizeof seed)) seed = uint32_t(::getpid());
  env.push_back("PYTHONHASHSEED=" + std::to_string(seed));
  req.env = std::move(env);
  req.stdin_fd = theirs.get();
  ASSIGN_OR_RETURN(SpawnedExec spawned, spawnExec(req, settings));
  theirs.reset();
  listener = std::move(spawned.seccomp_listener);
  auto z = std::unique_ptr<Zygote>(new Zygote());
  z->pid_ = spawned.pid;
  z->ctl_ = std::move(mine);
  z->stderr_ = std::move(spawned.stderr_r);
  if (spawned.fail_stage != 0) {
    std::string why = spawnFailureMessage(spawned);
    z->pid_ = -1;  // it exited; the agent reaps it
    return Status(Code::kFailedPrecondition,
                  "python zygote did not start: " + (why.empty() ? "exec failed" : why));
  }
  return z;
}

Status Zygote::awaitReady(int timeoutMs) {
  if (ready_) return Status::ok();
  pollfd p{ctl_.get(), POLLIN, 0};
  int n;
  do {
    n = ::poll(&p, 1, timeoutMs);
  } while (n < 0 && errno == EINTR);
  if (n > 0 && pollReady() == kReady) return Status::ok();
  std::string err;
  char eb[4096];
  ssize_t m = ::read(stderr_.get(), eb, sizeof eb);
  if (m > 0) err.assign(eb, size_t(m));
  if (pid_ > 0) ::kill(pid_, SIGKILL);
  pid_ = -1;  // the agent reaps it
  if (n == 0) return Status(Code::kUnavailable, "python zygote did not start in time");
  return Status(Code::kFailedPrecondition,
                "python zygote did not start" + (err.empty() ? std::string() : ": " + err));
}

Zygote::ReadyState Zygote::pollReady() {
  if (ready_) return kReady;
  char buf[256];
  ssize_t got = ::recv(ctl_.get(), buf, sizeof buf, MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return kStarting;
  if (got <= 0 || std::string_view(buf, size_t(got)).find("ready") == std::string_view::npos) {
    return kFailed;
  }
  ready_ = true;
  return kReady;
}

Zygote::~Zygote() {
  // The agent reaps it (it is aether's child).
  if (pid_ > 0) ::kill(pid_, SIGKILL);
}

ssize_t Zygote::recvControl(std::string& msg, UniqueFd& fd, bool dontwait) {
  char buf[4096];
  iovec iov{buf, sizeof buf};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 4)];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t got;
  do {
    got = ::recvmsg(ctl_.get(), &m, MSG_CMSG_CLOEXEC | (dontwait ? MSG_DONTWAIT : 0));
  } while (got < 0 && errno == EINTR);
  if (got < 0) return got;
  fd.reset();
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
      if (!fd) {
        fd.reset(f);
      } else {
        ::close(f);  // one fd per message: more is not ours to keep
      }
    }
  }
  msg.assign(buf, size_t(got));
  return got;
}

bool Zygote::handleMessage(const std::string& msg, UniqueFd fd,
                           std::vector<std::pair<pid_t, int>>& exits) {
  Json j = Json::parse(msg, nullptr, false);
  if (!j.is_object()) return false;
  if (auto it = j.find("exit"); it != j.end() && it->is_number_integer()) {
    pid_t pid = pid_t(it->get<int64_t>());
    // Only the end of a call still running counts: a call that said its
    // own status is done, and a spare that died unused is just dropped.
    if (live_.erase(pid)) {
      exits.emplace_back(pid, int(j.value("status", 0)));
    } else {
      for (auto s = spares_.begin(); s != spares_.end(); ++s) {
        if (s->pid == pid) {
          spares_.erase(s);
          break;
        }
      }
    }
    return true;
  }
  if (auto it = j.find("spare"); it != j.end() && it->is_number_integer()) {
    spareAsked_ = false;
    if (fd) spares_.push_back(Spare{pid_t(it->get<int64_t>()), std::move(fd)});
    return true;
  }
  if (j.contains("error")) spareAsked_ = false;  // it could not fork one
  return false;
}

bool Zygote::hungUp() const {
  pollfd p{ctl_.get(), POLLIN, 0};
  return !ctl_ || (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)));
}

void Zygote::requestSpare() {
  if (!spares_.empty() || spareAsked_ || !ctl_) return;
  if (::send(ctl_.get(), "spare", 5, MSG_DONTWAIT | MSG_NOSIGNAL) == 5) spareAsked_ = true;
}

Result<std::pair<pid_t, UniqueFd>> Zygote::spawn(const std::string& code, const std::string& cwd,
                                                 const std::vector<std::string>& env,
                                                 const CallLimits& limits, int in, int out, int err,
                                                 std::vector<std::pair<pid_t, int>>& exits) {
  std::string body = dumpJson(Json{{"code", code}, {"cwd", cwd}, {"env", env},
                                   {"limits", limitsJson(limits)}});
  int fds[4] = {in, out, err, -1};
  int nfds = 3;
  UniqueFd memfd;
  if (body.size() > kInlineRequest) {
    memfd.reset(int(::syscall(SYS_memfd_create, "dsec-call", MFD_CLOEXEC)));
    if (!memfd) return sysError("memfd_create");
    size_t off = 0;
    while (off < body.size()) {
      ssize_t w = ::write(memfd.get(), body.data() + off, body.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return sysError("write call request");
      off += size_t(w);
    }
    fds[3] = memfd.get();
    nfds = 4;
    body = "{}";
  }
  // A spare killed before its request (a call may kill any process of its
  // uid) fails the send: the next one is taken.
  for (int attempt = 0; attempt < 4; ++attempt) {
    int64_t deadline = 0;
    while (spares_.empty()) {
      requestSpare();
      if (!spareAsked_) return Status(Code::kUnavailable, "python zygote is gone");
      struct timespec now;
      ::clock_gettime(CLOCK_MONOTONIC, &now);
      int64_t nowMs = int64_t(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
      if (deadline == 0) deadline = nowMs + kZygoteAnswerMs;
      if (nowMs >= deadline) return Status(Code::kUnavailable, "python zygote did not answer");
      pollfd p{ctl_.get(), POLLIN, 0};
      int n = ::poll(&p, 1, int(deadline - nowMs));
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) return Status(Code::kUnavailable, "python zygote did not answer");
      std::string msg;
      UniqueFd fd;
      ssize_t got = recvControl(msg, fd, false);
      if (got <= 0) return Status(Code::kUnavailable, "python zygote is gone");
      if (!handleMessage(msg, std::move(fd), exits)) {
        Json j = Json::parse(msg, nullptr, false);
        std::string why = j.is_object() ? j.value("error", msg) : msg;
        return Status(Code::kInternal, "python zygote: " + why);
      }
    }
    Spare s = std::move(spares_.front());
    spares_.pop_front();
    iovec iov{body.data(), body.size()};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 4)];
    std::memset(ctl, 0, sizeof ctl);
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    ssize_t sent;
    do {
      sent = ::sendmsg(s.sock.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) continue;  // it died: its exit report is dropped, as a spare's
    ++calls_;
    live_.insert(s.pid);
    return std::make_pair(s.pid, std::move(s.sock));
  }
  return Status(Code::kUnavailable, "python zygote's spares died before their requests");
}

std::string shellLimitOf(int waitStatus, const CallLimits& limits) {
  if (!WIFEXITED(waitStatus)) return {};
  int code = WEXITSTATUS(waitStatus);
  if (code == 128 + SIGXFSZ && limits.file_size_mb > 0) return "file_size";
  if (code == 128 + SIGXCPU && limits.cpu_s > 0) return "cpu";
  return {};
}

bool Zygote::readExits(std::vector<std::pair<pid_t, int>>& exits) {
  for (;;) {
    std::string msg;
    UniqueFd fd;
    ssize_t got = recvControl(msg, fd, true);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (got <= 0) return false;
    (void)handleMessage(msg, std::move(fd), exits);
  }
}

}  // namespace dsec::aether
