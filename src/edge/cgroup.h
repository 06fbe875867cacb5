// Per-sandbox cgroups on cgroup v2 (unified) or v1 (legacy and hybrid hosts).
// Detects the layout once; creates <root>/<ctrl>/dsec/<id> (v1) or
// <root>/dsec/<id> (v2) with limits, attaches a process, reads events, and
// removes them. Thread-safe: after detect() its only mutable state is the
// memory cgroup pool, under its own mutex.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
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
  // rename(2) of a group within its parent (cgroup v1 only; v2 refuses).
  virtual Status rename(const std::string& from, const std::string& to) = 0;
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
  // Its figures now: OOM kills, pids-limit hits, memory, CPU time, tasks.
  // kNotFound when its memory group is gone; a figure whose file cannot be
  // read is 0 (a sandbox adopted from an edge that made no cpuacct group).
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
  // Removes the (empty) parent groups made by detect(), and the memory pool;
  // shared levels stay while other edges use them.
  void removeParent();

  // The memory cgroup pool (cgroup v1; docs/container-backend.md, "Kernel
  // cost per sandbox"). Removing a memory cgroup makes the kernel walk every
  // memory-cgroup-aware LRU on the host (two per superblock) under
  // cgroup_mutex, which mkdir and attach need too: at 3,000 live sandboxes
  // that is ~15 ms of one CPU per removal, and creates queue behind it.
  // Creating one allocates shrinker maps sized by the most superblocks the
  // host ever had at once (~660 KB each here). So remove() keeps up to
  // `max` emptied memory groups of sandboxes that never hit an OOM kill and
  // hold at most kPoolMaxBytes of leftover charges (page cache they read,
  // which stays cached), renamed "pool-<n>", and create() renames one to the
  // new id instead of a mkdir, and resets its peak and failure counters.
  // Pool groups left by an earlier edge are taken over at detect(). v2 groups
  // cannot be renamed: there the pool stays off. 0 turns it off.
  static constexpr size_t kDefaultMemoryPool = 64;
  static constexpr int64_t kPoolMaxBytes = 64ll << 20;
  void setMemoryPoolMax(size_t max);
  size_t memoryPoolSize() const;
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
  // The pool (see setMemoryPoolMax): a pooled group renamed to `id`, if any.
  bool takePooledMemory(const std::string& id);
  // Puts `id`'s (empty) memory group in the pool; false when it does not fit
  // or qualify (the caller removes it then).
  bool poolMemory(const std::string& id);
  void adoptMemoryPool();
  // v1: the group `name` (a sandbox id or a pool name) in the memory hierarchy.
  std::string memoryGroup(const std::string& name) const;

  std::shared_ptr<CgroupFs> fs_;
  Mode mode_ = Mode::kV2;
  std::string root_;
  std::string parent_;
  // v1: controller mount points, e.g. {"memory", "/sys/fs/cgroup/memory"}.
  std::string v1Memory_, v1Cpu_, v1Pids_, v1Freezer_;
  // Hybrid: the v2 hierarchy without controllers (root/unified), or empty.
  std::string v1Unified_;
  // cpuacct when it is not co-mounted with cpu (where cpuacct.usage is), or empty.
  std::string v1Cpuacct_;
  // The hierarchy roots a sandbox has a group in (v2: one).
  std::vector<std::string> hierarchies() const;

  mutable std::mutex poolMu_;  // guards pool_, poolMax_, poolNext_
  std::vector<std::string> pool_;  // names under v1Memory_/parent_
  size_t poolMax_ = kDefaultMemoryPool;
  size_t poolReserved_ = 0;  // poolMemory() calls under way
  uint64_t poolNext_ = 0;
};

}  // namespace dsec::edge
