#include "edge/cgroup.h"

#include <dirent.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "common/log.h"
#include "common/util.h"

namespace dsec::edge {

namespace {

constexpr int64_t kCpuPeriodUs = 100000;
constexpr const char* kV2Controllers[] = {"memory", "cpu", "pids"};
constexpr const char* kV2Enable = "+memory +cpu +pids";

class RealCgroupFs : public CgroupFs {
 public:
  Result<int64_t> fsType(const std::string& path) override {
    struct statfs sfs;
    if (::statfs(path.c_str(), &sfs) != 0) return sysError("statfs " + path);
    return int64_t(sfs.f_type);
  }
  bool isDir(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }
  bool writable(const std::string& path) override { return ::access(path.c_str(), W_OK) == 0; }
  Status mkdir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) != 0) return sysError("mkdir " + path);
    return Status::ok();
  }
  Status rmdir(const std::string& path) override {
    if (::rmdir(path.c_str()) != 0) return sysError("rmdir " + path);
    return Status::ok();
  }
  Result<std::string> read(const std::string& path) override { return readFile(path); }
  Status write(const std::string& path, std::string_view data) override {
    return writeKnob(path, data);
  }
  Status rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return sysError("rename " + from + " to " + to);
    return Status::ok();
  }
  std::vector<std::string> list(const std::string& dir) override {
    std::vector<std::string> out;
    DIR* d = ::opendir(dir.c_str());
    if (!d) return out;
    while (auto* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(std::move(name));
    }
    ::closedir(d);
    return out;
  }
  void killPid(pid_t pid) override { (void)::kill(pid, SIGKILL); }
};

std::vector<std::string> tokens(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string t; in >> t;) out.push_back(t);
  return out;
}

bool hasToken(const std::vector<std::string>& toks, const char* name) {
  return std::find(toks.begin(), toks.end(), name) != toks.end();
}

bool hasAllV2Controllers(const std::vector<std::string>& toks) {
  return std::all_of(std::begin(kV2Controllers), std::end(kV2Controllers),
                     [&](const char* c) { return hasToken(toks, c); });
}

// The positive pids in a cgroup.procs text; anything else (junk, 0, negative:
// kill(2) would read those as process groups or "everyone") is dropped.
std::vector<pid_t> parsePids(const std::string& text) {
  std::vector<pid_t> out;
  for (auto& t : tokens(text)) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(t.c_str(), &end, 10);
    if (errno == 0 && end && *end == '\0' && v > 0 && v <= INT_MAX) out.push_back(pid_t(v));
  }
  return out;
}

// The value of `key` in a flat-keyed file ("oom_kill 3\n..."), 0 if absent.
int64_t keyedValue(const std::string& content, const std::string& key) {
  std::istringstream in(content);
  std::string k;
  int64_t v;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

int64_t readKeyed(CgroupFs& fs, const std::string& path, const std::string& key) {
  auto content = fs.read(path);
  return content.isOk() ? keyedValue(*content, key) : 0;
}

int64_t readInt(CgroupFs& fs, const std::string& path) {
  auto content = fs.read(path);
  if (!content.isOk()) return 0;
  return std::atoll(content->c_str());
}

}  // namespace

std::shared_ptr<CgroupFs> CgroupFs::real() {
  static const std::shared_ptr<CgroupFs> kReal = std::make_shared<RealCgroupFs>();
  return kReal;
}

Status Cgroups::mkdirIfMissing(const std::string& p) const {
  Status st = fs_->mkdir(p);
  if (!st.isOk() && st.sysErrno() != EEXIST) return st;
  return Status::ok();
}

// Enables memory, cpu and pids for the children of `dir`. The kernel's
// no-internal-processes rule refuses that (EBUSY) while a non-root cgroup holds
// processes itself, which is the case of /sys/fs/cgroup in a container with a
// private cgroup namespace, where dsec itself lives in it. With `evacuate`,
// do what container runtimes do then: move those processes into the leaf
// kInitLeaf and try again (a few rounds, as they may fork meanwhile).
Status Cgroups::enableControllers(const std::string& dir, bool evacuate) const {
  const std::string knob = dir + "/cgroup.subtree_control";
  // Already enabled (a host that delegated them, or a previous run): nothing to
  // write and nothing to move.
  if (auto cur = fs_->read(knob); cur.isOk() && hasAllV2Controllers(tokens(*cur))) {
    return Status::ok();
  }
  Status st = fs_->write(knob, kV2Enable);
  if (st.isOk()) return st;
  if (st.sysErrno() != EBUSY || !evacuate) return st.withContext("enable cgroup v2 controllers");
  const std::string leaf = dir + "/" + kInitLeaf;
  RETURN_IF_ERROR(mkdirIfMissing(leaf));
  for (int round = 0; round < 10 && !st.isOk() && st.sysErrno() == EBUSY; ++round) {
    ASSIGN_OR_RETURN(auto procs, fs_->read(dir + "/cgroup.procs"));
    for (pid_t pid : parsePids(procs)) {
      Status mv = fs_->write(leaf + "/cgroup.procs", std::to_string(pid));
      if (!mv.isOk() && mv.sysErrno() != ESRCH) {  // ESRCH: it exited meanwhile
        return mv.withContext("move the processes of " + dir + " into " + leaf);
      }
    }
    st = fs_->write(knob, kV2Enable);
  }
  if (st.isOk()) return st;
  return Status(Code::kFailedPrecondition,
                "cannot enable the memory, cpu and pids controllers for the children of " + dir +
                    " (after moving its processes into " + leaf + "): " + st.message(),
                st.sysErrno());
}

Result<std::unique_ptr<Cgroups>> Cgroups::detect(const std::string& root,
                                                 const std::string& parent) {
  return detectWith(CgroupFs::real(), root, parent);
}

Result<std::unique_ptr<Cgroups>> Cgroups::detectForTest(std::shared_ptr<CgroupFs> fs,
                                                        const std::string& root,
                                                        const std::string& parent) {
  return detectWith(std::move(fs), root, parent);
}

Result<std::unique_ptr<Cgroups>> Cgroups::detectWith(std::shared_ptr<CgroupFs> fs,
                                                     const std::string& root,
                                                     const std::string& parent) {
  std::unique_ptr<Cgroups> cg(new Cgroups());
  cg->fs_ = std::move(fs);
  cg->root_ = root;
  cg->parent_ = parent;
  ASSIGN_OR_RETURN(int64_t fsType, cg->fs_->fsType(root));
  if (fsType == CGROUP2_SUPER_MAGIC) {
    cg->mode_ = Mode::kV2;
    ASSIGN_OR_RETURN(auto ctrls, cg->fs_->read(root + "/cgroup.controllers"));
    // Whole names: "cpuset" is not "cpu".
    auto have = tokens(ctrls);
    for (const char* c : kV2Controllers) {
      if (!hasToken(have, c)) {
        return Status(Code::kFailedPrecondition, std::string("cgroup v2 controller ") + c +
                                                     " not available at " + root +
                                                     " (cgroup.controllers: \"" + ctrls + "\")");
      }
    }
    // Controllers must be delegated down to our parent's children.
    RETURN_IF_ERROR(cg->enableControllers(root, /*evacuate=*/true));
    std::string cur = root;
    for (auto& part : splitString(parent, '/')) {
      cur += "/" + part;
      RETURN_IF_ERROR(cg->mkdirIfMissing(cur));
      RETURN_IF_ERROR(cg->enableControllers(cur, /*evacuate=*/false));
    }
    return cg;
  }
  // v1 or hybrid: one hierarchy per controller (cpu may be co-mounted as cpu,cpuacct).
  cg->mode_ = Mode::kV1;
  auto pick = [&](std::initializer_list<const char*> names) -> std::string {
    for (const char* n : names) {
      std::string p = root + "/" + n;
      if (cg->fs_->isDir(p)) return p;
    }
    return {};
  };
  cg->v1Memory_ = pick({"memory"});
  cg->v1Cpu_ = pick({"cpu", "cpu,cpuacct", "cpuacct,cpu"});
  cg->v1Pids_ = pick({"pids"});
  if (cg->v1Memory_.empty() || cg->v1Cpu_.empty() || cg->v1Pids_.empty()) {
    return Status(Code::kFailedPrecondition,
                  "cgroup v1 needs memory, cpu and pids hierarchies under " + root);
  }
  cg->v1Freezer_ = pick({"freezer"});  // optional: without it, freeze() is unavailable
  // CPU time is cpuacct's: co-mounted with cpu, or a hierarchy of its own
  // (then each sandbox gets a group there too; without it, no CPU figure).
  if (!cg->fs_->writable(cg->v1Cpu_ + "/cpuacct.usage")) cg->v1Cpuacct_ = pick({"cpuacct"});
  // Hybrid hosts mount a controller-less v2 hierarchy beside the v1 ones: a
  // group there is what cgroup eBPF programs (egress filters) attach to.
  if (auto t = cg->fs_->fsType(root + "/unified"); t.isOk() && *t == CGROUP2_SUPER_MAGIC) {
    cg->v1Unified_ = root + "/unified";
  }
  for (auto* base : {&cg->v1Memory_, &cg->v1Cpu_, &cg->v1Pids_, &cg->v1Freezer_, &cg->v1Unified_,
                     &cg->v1Cpuacct_}) {
    if (base->empty()) continue;
    std::string cur = *base;
    for (auto& part : splitString(parent, '/')) {
      cur += "/" + part;
      RETURN_IF_ERROR(cg->mkdirIfMissing(cur));
    }
  }
  cg->adoptMemoryPool();
  return cg;
}

std::string Cgroups::describe() const {
  return mode_ == Mode::kV2 ? "v2 at " + root_ : "v1 at " + root_;
}

std::vector<std::string> Cgroups::dirsOf(const std::string& id) const {
  if (mode_ == Mode::kV2) return {root_ + "/" + parent_ + "/" + id};
  std::vector<std::string> dirs = {memoryGroup(id),
                                   v1Cpu_ + "/" + parent_ + "/" + id,
                                   v1Pids_ + "/" + parent_ + "/" + id};
  if (!v1Freezer_.empty()) dirs.push_back(v1Freezer_ + "/" + parent_ + "/" + id);
  if (!v1Unified_.empty()) dirs.push_back(v1Unified_ + "/" + parent_ + "/" + id);
  if (!v1Cpuacct_.empty()) dirs.push_back(v1Cpuacct_ + "/" + parent_ + "/" + id);
  return dirs;
}

std::string Cgroups::memoryGroup(const std::string& name) const {
  return v1Memory_ + "/" + parent_ + "/" + name;
}

std::string Cgroups::v2Parent() const {
  if (mode_ == Mode::kV2) return root_ + "/" + parent_;
  return v1Unified_.empty() ? std::string() : v1Unified_ + "/" + parent_;
}

std::string Cgroups::v2DirOf(const std::string& id) const {
  std::string p = v2Parent();
  return p.empty() ? p : p + "/" + id;
}

Status Cgroups::freeze(const std::string& id, bool frozen) {
  auto dirs = dirsOf(id);
  std::string knob, want, done;
  if (mode_ == Mode::kV2) {
    knob = dirs[0] + "/cgroup.freeze";
    want = frozen ? "1" : "0";
  } else {
    if (v1Freezer_.empty()) {
      return Status(Code::kFailedPrecondition, "no freezer cgroup hierarchy on this host");
    }
    knob = v1Freezer_ + "/" + parent_ + "/" + id + "/freezer.state";
    want = frozen ? "FROZEN" : "THAWED";
  }
  RETURN_IF_ERROR(fs_->write(knob, want));
  // Freezing completes asynchronously; wait until every task has stopped.
  for (int i = 0; i < 500; ++i) {
    if (mode_ == Mode::kV2) {
      auto ev = fs_->read(dirs[0] + "/cgroup.events");
      if (!ev.isOk()) return std::move(ev).takeStatus();
      if (ev->find(frozen ? "frozen 1" : "frozen 0") != std::string::npos) return Status::ok();
    } else {
      auto st = fs_->read(knob);
      if (!st.isOk()) return std::move(st).takeStatus();
      if (st->rfind(want, 0) == 0) return Status::ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return Status(Code::kDeadlineExceeded, "cgroup of " + id + " did not reach " + want);
}

Status Cgroups::create(const std::string& id, const CgroupLimits& limits) {
  auto dirs = dirsOf(id);
  // v1: the memory group (dirs[0]) may come from the pool.
  bool pooled = takePooledMemory(id);
  for (size_t i = pooled ? 1 : 0; i < dirs.size(); ++i) {
    if (Status st = fs_->mkdir(dirs[i]); !st.isOk()) {
      (void)remove(id);
      return st;
    }
  }
  if (pooled) {
    // What the last sandbox left in the counters a reader might see.
    for (const char* k : {"memory.max_usage_in_bytes", "memory.failcnt",
                          "memory.memsw.max_usage_in_bytes", "memory.memsw.failcnt"}) {
      if (fs_->writable(dirs[0] + "/" + k)) (void)fs_->write(dirs[0] + "/" + k, "0");
    }
  }
  if (Status st = setLimits(id, limits); !st.isOk()) {
    (void)remove(id);
    return st;
  }
  return Status::ok();
}

Status Cgroups::setLimits(const std::string& id, const CgroupLimits& limits) {
  auto dirs = dirsOf(id);
  int64_t quota = std::llround(limits.cpu * double(kCpuPeriodUs));
  if (quota < 1000) quota = 1000;
  Status st;
  if (mode_ == Mode::kV2) {
    const std::string& d = dirs[0];
    st = fs_->write(d + "/memory.max",
                    limits.memoryBytes > 0 ? std::to_string(limits.memoryBytes) : "max");
    // Without swap accounting the knob is absent; that is fine.
    if (st.isOk() && limits.memoryBytes > 0) (void)fs_->write(d + "/memory.swap.max", "0");
    if (st.isOk()) {
      st = fs_->write(d + "/cpu.max", std::to_string(quota) + " " + std::to_string(kCpuPeriodUs));
    }
    if (st.isOk()) {
      st = fs_->write(d + "/pids.max", limits.pids > 0 ? std::to_string(limits.pids) : "max");
    }
  } else {
    std::string mem = limits.memoryBytes > 0 ? std::to_string(limits.memoryBytes) : "-1";
    bool memsw = fs_->writable(dirs[0] + "/memory.memsw.limit_in_bytes");
    // v1 refuses a memory.limit_in_bytes above memsw's limit (EINVAL): when
    // raising, memsw goes first; when lowering, last.
    st = fs_->write(dirs[0] + "/memory.limit_in_bytes", mem);
    if (!st.isOk() && st.sysErrno() == EINVAL && memsw) {
      st = fs_->write(dirs[0] + "/memory.memsw.limit_in_bytes", mem);
      if (st.isOk()) st = fs_->write(dirs[0] + "/memory.limit_in_bytes", mem);
    }
    if (st.isOk() && memsw) (void)fs_->write(dirs[0] + "/memory.memsw.limit_in_bytes", mem);
    if (st.isOk()) st = fs_->write(dirs[1] + "/cpu.cfs_period_us", std::to_string(kCpuPeriodUs));
    if (st.isOk()) st = fs_->write(dirs[1] + "/cpu.cfs_quota_us", std::to_string(quota));
    if (st.isOk()) {
      st = fs_->write(dirs[2] + "/pids.max", limits.pids > 0 ? std::to_string(limits.pids) : "max");
    }
  }
  if (!st.isOk()) return st.withContext("cgroup limits");
  return Status::ok();
}

Status Cgroups::attach(const std::string& id, pid_t pid) {
  std::string p = std::to_string(pid);
  for (auto& d : dirsOf(id)) RETURN_IF_ERROR(fs_->write(d + "/cgroup.procs", p));
  return Status::ok();
}

Result<int64_t> Cgroups::oomKills(const std::string& id) const {
  std::string memDir = dirsOf(id)[0];
  auto text = fs_->read(memDir + (mode_ == Mode::kV2 ? "/memory.events" : "/memory.oom_control"));
  if (!text.isOk()) return notFound("cgroup of " + id);
  return keyedValue(*text, "oom_kill");
}

Result<CgroupStats> Cgroups::stats(const std::string& id) const {
  auto dirs = dirsOf(id);
  CgroupStats s;
  ASSIGN_OR_RETURN(s.oomKills, oomKills(id));
  if (mode_ == Mode::kV2) {
    s.pidsLimitHits = readKeyed(*fs_, dirs[0] + "/pids.events", "max");
    s.memoryBytes = readInt(*fs_, dirs[0] + "/memory.current");
    s.cpuUsec = readKeyed(*fs_, dirs[0] + "/cpu.stat", "usage_usec");
    s.pids = readInt(*fs_, dirs[0] + "/pids.current");
  } else {
    s.pidsLimitHits = readKeyed(*fs_, dirs[2] + "/pids.events", "max");
    s.memoryBytes = readInt(*fs_, dirs[0] + "/memory.usage_in_bytes");
    std::string acct = v1Cpuacct_.empty() ? dirs[1] : v1Cpuacct_ + "/" + parent_ + "/" + id;
    s.cpuUsec = readInt(*fs_, acct + "/cpuacct.usage") / 1000;  // ns
    s.pids = readInt(*fs_, dirs[2] + "/pids.current");
  }
  return s;
}

// SIGKILLs the processes `dir`'s own cgroup.procs lists: never a pid from
// anywhere else, never ourselves. On v2 the group is frozen first, so a listed
// process cannot exit by itself and have its pid reused before the kill.
void Cgroups::killListed(const std::string& dir) const {
  if (mode_ == Mode::kV2 && fs_->writable(dir + "/cgroup.freeze")) {
    (void)fs_->write(dir + "/cgroup.freeze", "1");
  }
  auto procs = fs_->read(dir + "/cgroup.procs");
  if (!procs.isOk()) return;
  const pid_t self = ::getpid();
  for (pid_t pid : parsePids(*procs)) {
    if (pid != self) fs_->killPid(pid);
  }
}

// Kills what runs in `dir` until it is empty, then rmdirs it.
Status Cgroups::killAndRemove(const std::string& dir) const {
  if (!fs_->isDir(dir)) return Status::ok();
  // cgroup.kill (v2 only; Linux 5.14+) kills the whole group at once, forks
  // racing with it included, and names no pid that could have been reused.
  bool useKill = mode_ == Mode::kV2 && fs_->writable(dir + "/cgroup.kill");
  Status st;
  for (int attempt = 0; attempt < 200; ++attempt) {
    st = fs_->rmdir(dir);
    if (st.isOk() || st.sysErrno() == ENOENT) return Status::ok();
    if (st.sysErrno() != EBUSY) return st;
    if (useKill && !fs_->write(dir + "/cgroup.kill", "1").isOk()) useKill = false;
    if (!useKill) killListed(dir);
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 10 ? 1 : 10));
  }
  return Status(Code::kInternal, "cgroup " + dir + " still busy after 2 s: " + st.message(),
                st.sysErrno());
}

Status Cgroups::remove(const std::string& id) {
  // A frozen task takes its SIGKILL only once thawed (the v1 freezer; v2's
  // cgroup.kill would not care, but the group may be an earlier run's).
  (void)freeze(id, false);
  Status first;
  auto dirs = dirsOf(id);
  // v1: the memory group (dirs[0]) last, so that it is empty when it may
  // go to the pool: every task is in one group of each hierarchy, and the
  // others could be removed only once theirs had no task left.
  bool v1 = mode_ == Mode::kV1;
  for (size_t i = v1 ? 1 : 0; i < dirs.size(); ++i) {
    Status st = killAndRemove(dirs[i]);
    if (!st.isOk() && first.isOk()) first = st;
  }
  if (v1 && !(first.isOk() && poolMemory(id))) {
    Status st = killAndRemove(dirs[0]);
    if (!st.isOk() && first.isOk()) first = st;
  }
  return first;
}

void Cgroups::setMemoryPoolMax(size_t max) {
  std::vector<std::string> extra;
  {
    std::lock_guard lk(poolMu_);
    poolMax_ = max;
    while (pool_.size() > poolMax_) {
      extra.push_back(std::move(pool_.back()));
      pool_.pop_back();
    }
  }
  for (auto& name : extra) (void)killAndRemove(memoryGroup(name));
}

size_t Cgroups::memoryPoolSize() const {
  std::lock_guard lk(poolMu_);
  return pool_.size();
}

bool Cgroups::takePooledMemory(const std::string& id) {
  if (mode_ != Mode::kV1) return false;
  for (;;) {
    std::string name;
    {
      std::lock_guard lk(poolMu_);
      if (pool_.empty()) return false;
      name = std::move(pool_.back());
      pool_.pop_back();
    }
    Status st = fs_->rename(memoryGroup(name), memoryGroup(id));
    if (st.isOk()) return true;
    log::warn("memory cgroup pool: " + st.toString() + "; removing it");
    (void)killAndRemove(memoryGroup(name));
  }
}

bool Cgroups::poolMemory(const std::string& id) {
  if (mode_ != Mode::kV1) return false;
  const std::string dir = memoryGroup(id);
  std::string name;
  {
    std::lock_guard lk(poolMu_);
    if (pool_.size() + poolReserved_ >= poolMax_) return false;
    ++poolReserved_;
    name = "pool-" + std::to_string(poolNext_++);
  }
  bool pooled = false;
  auto procs = fs_->read(dir + "/cgroup.procs");
  auto oom = fs_->read(dir + "/memory.oom_control");
  // Only a group that is empty, never saw an OOM kill (its count cannot be
  // reset) and holds little (reclaimable) leftover: the next sandbox's
  // limit and usage then start where a new group's would, near enough.
  if (procs.isOk() && tokens(*procs).empty() && oom.isOk() &&
      keyedValue(*oom, "oom_kill") == 0 &&
      readInt(*fs_, dir + "/memory.usage_in_bytes") <= kPoolMaxBytes) {
    pooled = fs_->rename(dir, memoryGroup(name)).isOk();
  }
  std::lock_guard lk(poolMu_);
  --poolReserved_;
  if (pooled) pool_.push_back(name);
  return pooled;
}

// v1: pool groups an earlier edge left (empty, as it put them there) become
// ours, up to the bound; the rest go.
void Cgroups::adoptMemoryPool() {
  if (mode_ != Mode::kV1) return;
  std::vector<std::string> drop;
  {
    std::lock_guard lk(poolMu_);
    for (auto& name : fs_->list(v1Memory_ + "/" + parent_)) {
      if (!startsWith(name, "pool-")) continue;
      uint64_t n = std::strtoull(name.c_str() + 5, nullptr, 10);
      poolNext_ = std::max(poolNext_, n + 1);
      auto procs = fs_->read(memoryGroup(name) + "/cgroup.procs");
      if (pool_.size() < poolMax_ && procs.isOk() && tokens(*procs).empty()) {
        pool_.push_back(name);
      } else {
        drop.push_back(name);
      }
    }
  }
  for (auto& name : drop) (void)killAndRemove(memoryGroup(name));
}

std::vector<std::string> Cgroups::hierarchies() const {
  if (mode_ == Mode::kV2) return {root_};
  std::vector<std::string> out = {v1Memory_, v1Cpu_, v1Pids_};
  if (!v1Freezer_.empty()) out.push_back(v1Freezer_);
  if (!v1Unified_.empty()) out.push_back(v1Unified_);
  if (!v1Cpuacct_.empty()) out.push_back(v1Cpuacct_);
  return out;
}

void Cgroups::removeParent() {
  setMemoryPoolMax(0);
  std::vector<std::string> bases = hierarchies();
  // Only the innermost level is ours alone; shared levels go only when empty.
  auto parts = splitString(parent_, '/');
  for (auto& b : bases) {
    for (size_t n = parts.size(); n > 0; --n) {
      std::string dir = b;
      for (size_t i = 0; i < n; ++i) dir += "/" + parts[i];
      if (!fs_->rmdir(dir).isOk()) break;
    }
  }
}

std::vector<std::string> Cgroups::list() const {
  std::vector<std::string> out;
  std::vector<std::string> bases = hierarchies();
  for (auto& b : bases) {
    for (auto& name : fs_->list(b + "/" + parent_)) {
      if (startsWith(name, "sb-") && std::find(out.begin(), out.end(), name) == out.end()) {
        out.push_back(name);
      }
    }
  }
  return out;
}

}  // namespace dsec::edge
