// Per-sandbox cgroups on cgroup v2 (unified) or v1 (legacy and hybrid hosts).
// Detects the layout once; creates <root>/<ctrl>/dsec/<id> (v1) or
// <root>/dsec/<id> (v2) with limits, attaches a process, reads events, and
// removes them. Thread-safe: it holds no mutable state after detect().
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::edge {

struct CgroupLimits {
  double cpu = 1.0;            // cores; quota = cpu * period
  int64_t memoryBytes = 0;     // 0 = unlimited
  int64_t pids = 0;            // 0 = unlimited
};

struct CgroupStats {
  int64_t oomKills = 0;        // processes killed by the OOM killer in this cgroup
  int64_t pidsLimitHits = 0;   // fork/clone refused by pids.max
  int64_t memoryBytes = 0;     // current usage
};

class Cgroups {
 public:
  enum class Mode { kV2, kV1 };

  // Inspects `root` (normally /sys/fs/cgroup) and prepares the `parent`
  // group ("dsec/<edge>": each edge on a host owns its own subtree, so one
  // edge's orphan cleanup never touches another's sandboxes). kFailedPrecondition when a needed controller (memory, cpu, pids) is
  // missing.
  static Result<std::unique_ptr<Cgroups>> detect(const std::string& root = "/sys/fs/cgroup",
                                                 const std::string& parent = "dsec");

  Mode mode() const { return mode_; }
  std::string describe() const;

  // Creates the sandbox's groups and writes limits. On failure removes what it made.
  Status create(const std::string& id, const CgroupLimits& limits);
  // Moves pid into every group of the sandbox.
  Status attach(const std::string& id, pid_t pid);
  Result<CgroupStats> stats(const std::string& id) const;
  // SIGKILLs whatever still runs in the groups, then removes them. Missing
  // groups are fine.
  Status remove(const std::string& id);
  // Removes the (empty) parent groups made by detect(); shared levels stay
  // while other edges use them.
  void removeParent();
  // Ids of sandbox groups that exist now (for orphan cleanup at start).
  std::vector<std::string> list() const;
  // Directories that make up the sandbox's cgroups.
  std::vector<std::string> dirsOf(const std::string& id) const;

 private:
  Cgroups() = default;
  Mode mode_ = Mode::kV2;
  std::string root_;
  std::string parent_;
  // v1: controller mount points, e.g. {"memory", "/sys/fs/cgroup/memory"}.
  std::string v1Memory_, v1Cpu_, v1Pids_;
};

}  // namespace dsec::edge
