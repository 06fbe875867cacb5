#include "edge/cgroup.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <dirent.h>
#include <linux/magic.h>
#include <sstream>
#include <thread>

#include "common/util.h"

namespace dsec::edge {

namespace {

constexpr int64_t kCpuPeriodUs = 100000;

bool isDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int64_t readKeyed(const std::string& path, const std::string& key) {
  auto content = readFile(path);
  if (!content.isOk()) return 0;
  std::istringstream in(*content);
  std::string k;
  int64_t v;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

int64_t readInt(const std::string& path) {
  auto content = readFile(path);
  if (!content.isOk()) return 0;
  return std::atoll(content->c_str());
}

Status mkdirIfMissing(const std::string& p) {
  if (::mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) return sysError("mkdir " + p);
  return Status::ok();
}

// Kills every process listed in `procsFile` until it is empty, then rmdirs.
Status killAndRemove(const std::string& dir) {
  if (!isDir(dir)) return Status::ok();
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return Status::ok();
    if (errno != EBUSY) return sysError("rmdir " + dir);
    auto procs = readFile(dir + "/cgroup.procs");
    if (procs.isOk()) {
      std::istringstream in(*procs);
      pid_t pid;
      while (in >> pid) ::kill(pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 10 ? 1 : 10));
  }
  return Status(Code::kInternal, "cgroup " + dir + " still busy after 2 s");
}

}  // namespace

Result<std::unique_ptr<Cgroups>> Cgroups::detect(const std::string& root,
                                                 const std::string& parent) {
  std::unique_ptr<Cgroups> cg(new Cgroups());
  cg->root_ = root;
  cg->parent_ = parent;
  struct statfs sfs;
  if (::statfs(root.c_str(), &sfs) != 0) return sysError("statfs " + root);
  if (sfs.f_type == CGROUP2_SUPER_MAGIC) {
    cg->mode_ = Mode::kV2;
    auto ctrls = readFile(root + "/cgroup.controllers");
    if (!ctrls.isOk()) return std::move(ctrls).takeStatus();
    for (const char* c : {"memory", "cpu", "pids"}) {
      if (ctrls->find(c) == std::string::npos) {
        return Status(Code::kFailedPrecondition,
                      std::string("cgroup v2 controller ") + c + " not available at " + root);
      }
    }
    // Controllers must be delegated down to our parent's children.
    (void)writeKnob(root + "/cgroup.subtree_control", "+memory +cpu +pids");
    std::string cur = root;
    for (auto& part : splitString(parent, '/')) {
      cur += "/" + part;
      RETURN_IF_ERROR(mkdirIfMissing(cur));
      RETURN_IF_ERROR(writeKnob(cur + "/cgroup.subtree_control", "+memory +cpu +pids"));
    }
    return cg;
  }
  // v1 or hybrid: one hierarchy per controller (cpu may be co-mounted as cpu,cpuacct).
  cg->mode_ = Mode::kV1;
  auto pick = [&](std::initializer_list<const char*> names) -> std::string {
    for (const char* n : names) {
      std::string p = root + "/" + n;
      if (isDir(p)) return p;
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
  for (auto* base : {&cg->v1Memory_, &cg->v1Cpu_, &cg->v1Pids_}) {
    std::string cur = *base;
    for (auto& part : splitString(parent, '/')) {
      cur += "/" + part;
      RETURN_IF_ERROR(mkdirIfMissing(cur));
    }
  }
  return cg;
}

std::string Cgroups::describe() const {
  return mode_ == Mode::kV2 ? "v2 at " + root_ : "v1 at " + root_;
}

std::vector<std::string> Cgroups::dirsOf(const std::string& id) const {
  if (mode_ == Mode::kV2) return {root_ + "/" + parent_ + "/" + id};
  return {v1Memory_ + "/" + parent_ + "/" + id, v1Cpu_ + "/" + parent_ + "/" + id,
          v1Pids_ + "/" + parent_ + "/" + id};
}

Status Cgroups::create(const std::string& id, const CgroupLimits& limits) {
  auto dirs = dirsOf(id);
  for (auto& d : dirs) {
    if (::mkdir(d.c_str(), 0755) != 0) {
      Status st = sysError("mkdir " + d);
      (void)remove(id);
      return st;
    }
  }
  int64_t quota = std::llround(limits.cpu * double(kCpuPeriodUs));
  if (quota < 1000) quota = 1000;
  Status st;
  if (mode_ == Mode::kV2) {
    const std::string& d = dirs[0];
    if (limits.memoryBytes > 0) {
      st = writeKnob(d + "/memory.max", std::to_string(limits.memoryBytes));
      // Without swap accounting the knob is absent; that is fine.
      if (st.isOk()) (void)writeKnob(d + "/memory.swap.max", "0");
    }
    if (st.isOk()) {
      st = writeKnob(d + "/cpu.max",
                     std::to_string(quota) + " " + std::to_string(kCpuPeriodUs));
    }
    if (st.isOk() && limits.pids > 0) st = writeKnob(d + "/pids.max", std::to_string(limits.pids));
  } else {
    if (limits.memoryBytes > 0) {
      st = writeKnob(dirs[0] + "/memory.limit_in_bytes", std::to_string(limits.memoryBytes));
      if (st.isOk() && ::access((dirs[0] + "/memory.memsw.limit_in_bytes").c_str(), W_OK) == 0) {
        (void)writeKnob(dirs[0] + "/memory.memsw.limit_in_bytes",
                        std::to_string(limits.memoryBytes));
      }
    }
    if (st.isOk()) {
      st = writeKnob(dirs[1] + "/cpu.cfs_period_us", std::to_string(kCpuPeriodUs));
    }
    if (st.isOk()) st = writeKnob(dirs[1] + "/cpu.cfs_quota_us", std::to_string(quota));
    if (st.isOk() && limits.pids > 0) {
      st = writeKnob(dirs[2] + "/pids.max", std::to_string(limits.pids));
    }
  }
  if (!st.isOk()) {
    (void)remove(id);
    return st.withContext("cgroup limits");
  }
  return Status::ok();
}

Status Cgroups::attach(const std::string& id, pid_t pid) {
  std::string p = std::to_string(pid);
  for (auto& d : dirsOf(id)) RETURN_IF_ERROR(writeKnob(d + "/cgroup.procs", p));
  return Status::ok();
}

Result<CgroupStats> Cgroups::stats(const std::string& id) const {
  auto dirs = dirsOf(id);
  if (!isDir(dirs[0])) return notFound("cgroup of " + id);
  CgroupStats s;
  if (mode_ == Mode::kV2) {
    s.oomKills = readKeyed(dirs[0] + "/memory.events", "oom_kill");
    s.pidsLimitHits = readKeyed(dirs[0] + "/pids.events", "max");
    s.memoryBytes = readInt(dirs[0] + "/memory.current");
  } else {
    s.oomKills = readKeyed(dirs[0] + "/memory.oom_control", "oom_kill");
    s.pidsLimitHits = readKeyed(dirs[2] + "/pids.events", "max");
    s.memoryBytes = readInt(dirs[0] + "/memory.usage_in_bytes");
  }
  return s;
}

Status Cgroups::remove(const std::string& id) {
  Status first;
  for (auto& d : dirsOf(id)) {
    Status st = killAndRemove(d);
    if (!st.isOk() && first.isOk()) first = st;
  }
  return first;
}

void Cgroups::removeParent() {
  std::vector<std::string> bases;
  if (mode_ == Mode::kV2) {
    bases = {root_};
  } else {
    bases = {v1Memory_, v1Cpu_, v1Pids_};
  }
  // Only the innermost level is ours alone; shared levels go only when empty.
  auto parts = splitString(parent_, '/');
  for (auto& b : bases) {
    for (size_t n = parts.size(); n > 0; --n) {
      std::string dir = b;
      for (size_t i = 0; i < n; ++i) dir += "/" + parts[i];
      if (::rmdir(dir.c_str()) != 0) break;
    }
  }
}

std::vector<std::string> Cgroups::list() const {
  std::vector<std::string> out;
  std::vector<std::string> bases;
  if (mode_ == Mode::kV2) {
    bases = {root_};
  } else {
    bases = {v1Memory_, v1Cpu_, v1Pids_};
  }
  for (auto& b : bases) {
    std::string base = b + "/" + parent_;
    DIR* d = ::opendir(base.c_str());
    if (!d) continue;
    while (auto* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (startsWith(name, "sb-") && std::find(out.begin(), out.end(), name) == out.end()) {
        out.push_back(name);
      }
    }
    ::closedir(d);
  }
  return out;
}

}  // namespace dsec::edge
