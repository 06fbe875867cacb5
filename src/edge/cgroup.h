// Per-sandbox cgroups on cgroup v2 (unified) or v1 (legacy and hybrid hosts).
// Detects the layout once; creates <root>/<ctrl>/dsec/<id> (v1) or
// <root>/dsec/<id> (v2) with limits, attaches a process, reads events, and
// removes them. Thread-safe: it holds no mutable state after detect().
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "proto/types.h"

namespace dsec::edge {

using proto::CgroupLimits;
using proto::CgroupStats;


// The filesystem and process calls Cgroups makes: a seam so that tests run the
// cgroup v2 logic against a fake tree (hosts like the dev machines have no v2
// controllers). real() is the kernel; implementations must be thread-safe.
// Failures are sysError()s carrying the errno (EEXIST, EBUSY, ESRCH, ENOENT...)
// and the path.
class CgroupFs {
 public:
  virtual ~CgroupFs() = default;
  static std::shared_ptr<CgroupFs> real();

  // statfs(2)'s f_type of `path` (CGROUP2_SUPER_MAGIC for a unified hierarchy).
  virtual Result<int64_t> fsType(const std::string& path) = 0;
  virtual bool isDir(const std::string& path) = 0;
  // The file exists and we may write it (access(2) W_OK).
  virtual bool writable(const std::string& path) = 0;
  virtual Status mkdir(const std::string& path) = 0;
  virtual Status rmdir(const std::string& path) = 0;
  virtual Result<std::string> read(const std::string& path) = 0;
  // One write(2) of `data` to an existing file (a knob).
  virtual Status write(const std::string& path, std::string_view data) = 0;
  // Entry names in `dir` without "." and ".."; empty when it cannot be read.
  virtual std::vector<std::string> list(const std::string& dir) = 0;
  // kill(pid, SIGKILL), errors ignored (the process may be gone).
  virtual void killPid(pid_t pid) = 0;
};

class Cgroups {
 public:
  enum class Mode { kV2, kV1 };

  // v2: the leaf that detect() moves the processes of `root` into when `root`
  // holds processes itself (dsec in a container with a private cgroup
  // namespace), so that controllers can be enabled for its children.
  static constexpr const char* kInitLeaf = "dsec-init";

  // Inspects `root` (normally /sys/fs/cgroup) and prepares the `parent`
  // group ("dsec/<edge>": each edge on a host owns its own subtree, so one
  // edge's orphan cleanup never touches another's sandboxes).
  // kFailedPrecondition when a needed controller (memory, cpu, pids) is missing
  // or cannot be enabled for the children of `root` (v2: after moving the
  // processes of `root` into `root`/kInitLeaf, see there); other errors of the
  // mkdir/write calls as they come.
  static Result<std::unique_ptr<Cgroups>> detect(const std::string& root = "/sys/fs/cgroup",
                                                 const std::string& parent = "dsec");
  // detect() through `fs` instead of the kernel: for tests on a fake tree.
  static Result<std::unique_ptr<Cgroups>> detectForTest(std::shared_ptr<CgroupFs> fs,
                                                        const std::string& root,
                                                        const std::string& parent);

  Mode mode() const { return mode_; }
  std::string describe() const;

  // Creates the sandbox's groups and writes limits. On failure removes what it made.
  Status create(const std::string& id, const CgroupLimits& limits);
  // Rewrites the limits of existing groups (0 memory or pids: unlimited).
  // Lowering memory below what the sandbox uses makes the kernel reclaim,
  // then OOM-kill inside the sandbox.
  Status setLimits(const std::string& id, const CgroupLimits& limits);
  // Moves pid into every group of the sandbox.
  Status attach(const std::string& id, pid_t pid);
  Result<CgroupStats> stats(const std::string& id) const;
  // Just the OOM-kill count (one file read): what every exec compares.
  Result<int64_t> oomKills(const std::string& id) const;
  // Freezes (stops every task of) or thaws the sandbox; returns once done.
  Status freeze(const std::string& id, bool frozen);
  // Kills whatever still runs in the groups, then removes them: on v2 through
  // cgroup.kill (Linux 5.14+; no pid that could be reused by then); elsewhere
  // by SIGKILLing the pids each group's own cgroup.procs lists (v2 freezes the
  // group first). Missing groups are fine; kInternal when a group stays busy
  // for 2 s.
  Status remove(const std::string& id);
  // Removes the (empty) parent groups made by detect(); shared levels stay
  // while other edges use them.
  void removeParent();
  // Ids of sandbox groups that exist now (for orphan cleanup at start).
  std::vector<std::string> list() const;
  // Directories that make up the sandbox's cgroups.
  std::vector<std::string> dirsOf(const std::string& id) const;
  // The parent group in a cgroup v2 hierarchy (v2: the parent itself; hybrid:
  // its twin in the controller-less unified hierarchy), where cgroup eBPF
  // programs for all of this edge's sandboxes attach; empty on pure v1.
  std::string v2Parent() const;
  // The sandbox's group under v2Parent(), or empty.
  std::string v2DirOf(const std::string& id) const;

 private:
  Cgroups() = default;
  static Result<std::unique_ptr<Cgroups>> detectWith(std::shared_ptr<CgroupFs> fs,
                                                     const std::string& root,
                                                     const std::string& parent);
  Status mkdirIfMissing(const std::string& p) const;
  Status enableControllers(const std::string& dir, bool evacuate) const;
  Status killAndRemove(const std::string& dir) const;
  void killListed(const std::string& dir) const;

  std::shared_ptr<CgroupFs> fs_;
  Mode mode_ = Mode::kV2;
  std::string root_;
  std::string parent_;
  // v1: controller mount points, e.g. {"memory", "/sys/fs/cgroup/memory"}.
  std::string v1Memory_, v1Cpu_, v1Pids_, v1Freezer_;
  // Hybrid: the v2 hierarchy without controllers (root/unified), or empty.
  std::string v1Unified_;
  // The hierarchy roots a sandbox has a group in (v2: one).
  std::vector<std::string> hierarchies() const;
};

}  // namespace dsec::edge
