// The native container backend: clone(2) into new mount, pid, uts, ipc and
// net namespaces (CLONE_VM, so no page tables are copied), with the sealed
// in-memory copy of dsec-aether exec'd as the sandbox's PID 1. aether then
// mounts the sandbox's overlayfs root, pivots into it and enters a new cgroup
// namespace (docs/agent-protocol.md, start-up).
//
// With a user namespace (edge/userns.h) the clone adds CLONE_NEWUSER, the
// edge writes the child's uid/gid maps before it may exec, and the edge
// builds the overlay over idmapped layers itself and passes it to aether as a
// mount fd with the init frame. Without one, aether mounts the overlay over
// the node's shared EROFS layer mounts by path.
// The sandbox's directory (overlay upper and work) is bounded by its disk_mb
// through a DiskQuota (disk_quota.h).
//
// Mounts (issue 30): on kernels that allow it (probeDetachedDisks, Linux >=
// 6.15) nothing per sandbox is attached in the edge's mount namespace, which
// every spare's clone copies: the writable layer (ext4, tmpfs) is a detached
// mount the quota holds by fd, the edge builds the overlay over it in both
// modes and hands it over by fd, and aether attaches it inside its own
// private stage tmpfs (<stage>/root) before it pivots. aether also keeps a
// read-only clone of the disk at fd 10, which a restarted edge takes back
// with pidfd_getfd(2) to reach the upper dir (pack_diff) and know the disk
// (docs/container-backend.md, "Mounts").
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/fd.h"
#include "edge/backend.h"
#include "edge/corpse_cleaner.h"
#include "edge/disk_quota.h"
#include "edge/image/layer_cache.h"
#include "edge/userns.h"

namespace dsec::edge {

struct ContainerOptions {
  std::string aetherPath;     // the static dsec-aether binary
  std::string sandboxRoot;    // node-local dir for upper/work/rootfs of each sandbox
  double startTimeoutS = 10;  // agent hello deadline
  // Agents cloned ahead of demand (fresh namespaces, waiting for their init
  // frame), so a create skips clone and exec. 0 disables the pool.
  size_t spareAgents = 4;
  // While at least spareLowWater spares are left, the next one is cloned
  // only once no spare has been taken for spareSettleS: a new sandbox's
  // first calls usually follow its create at once, and on a small node the
  // clone (namespaces, exec, ~30 mounts) would take the CPU from them.
  size_t spareLowWater = 2;
  double spareSettleS = 0.02;
  // Disk quota mechanism ("auto", "xfs", "ext4", "btrfs", "tmpfs", "none") and, for btrfs
  // on a non-btrfs host, the pool image and its size (0: the free space).
  std::string diskQuota = "auto";
  std::string diskPoolImage;  // empty: <sandboxRoot>.img
  int64_t diskPoolBytes = 0;
  // Sandboxes run in user namespaces when set and enabled, each with a host
  // id range of its own from userns->pool. Not owned; must outlive the
  // backend.
  const Userns* userns = nullptr;
  // The ranges of the sandboxes make()'s `keep` re-adopts (their state
  // files'): reserved before any agent is cloned.
  std::map<std::string, IdRange> keepRanges;
  // The edge's loop devices, for the disk quota (DiskQuotaOptions::loops).
  // Not owned; must outlive the backend. Null: the quota's own.
  LoopPool* loops = nullptr;
};

class ContainerBackend : public Backend {
 public:
  // Also removes a crashed predecessor's sandboxes (cgroups with their
  // processes, mounts, directories) before it sets up the disk quota, which
  // may mount on opts.sandboxRoot; cleanupOrphans reports them and removes
  // what only the quota can.
  // The sandboxes in `keep` are being re-adopted (adopt() follows): their
  // cgroups, directories and mounts, and the disk quota's pool, stay.
  static Result<std::unique_ptr<ContainerBackend>> make(ContainerOptions opts, Cgroups* cgroups,
                                                        LayerCache* layers, Reactor* reactor,
                                                        const std::set<std::string>& keep = {});
  ~ContainerBackend() override;

  std::string name() const override { return "container"; }
  bool takesInitPolicy() const override { return true; }
  Result<std::unique_ptr<Instance>> create(const SandboxSpec& spec,
                                           std::function<void()> onDeath) override;
  Result<std::unique_ptr<Instance>> adopt(const SandboxState& state,
                                          std::function<void()> onDeath) override;
  Status destroy(Instance& inst) override;
  void removeOrphan(const std::string& id) override;
  int cleanupOrphans() override;
  void shutdown(bool keepSandboxes = false) override;
  // The mechanism bounding each sandbox's writable layer, for logs.
  std::string diskQuotaInfo() const { return quota_->describe(); }
  // The node's host id ranges (issue 31): capacity, in use (sandboxes, live
  // or being torn down, and spares), live sandboxes' and spares'.
  struct RangeStats {
    size_t capacity = 0, inUse = 0, sandboxes = 0, spares = 0;
  };
  RangeStats rangeStats();

 private:
  ContainerBackend(ContainerOptions opts, Cgroups* cgroups, LayerCache* layers, Reactor* reactor)
      : opts_(std::move(opts)), cgroups_(cgroups), layers_(layers), reactor_(reactor) {}

  const ContainerOptions opts_;
  Cgroups* cgroups_;     // not owned
  LayerCache* layers_;   // not owned
  Reactor* reactor_;     // not owned
  UniqueFd aetherMemfd_;  // sealed copy of dsec-aether, exec'd by every sandbox
  std::unique_ptr<DiskQuota> quota_;  // set up before the first agent is cloned
  bool userns_ = false;               // opts_.userns is set and enabled
  // probeDetachedDisks() passed: the edge builds every overlay (upper and
  // work through the disk's dirOf) and aether attaches it in its private
  // stage; ext4 and tmpfs disks stay detached. Else the layout before issue
  // 30: disks mounted on <sandboxRoot>/<id>, which every later clone copies.
  bool detached_ = false;
  std::string maskMount_;  // <sandboxRoot>/.mask while mounted (make(); shutdown() unmounts it)
  std::set<std::string> orphans_;  // sandboxes whose leftovers make() removed, for cleanupOrphans
  std::set<std::string> keep_;  // make()'s: being re-adopted, never orphans

  // An agent in fresh namespaces that has not been sent its init frame yet.
  struct Agent {
    pid_t pid = -1;
    UniqueFd pidfd;
    std::shared_ptr<AgentConn> conn;
    IdRange range;  // its user namespace's host ids (empty without userns)
  };
  Result<Agent> spawnAgent();
  // A spare if one is ready and alive, else a freshly spawned agent.
  Result<Agent> takeAgent();
  void spareLoop();

  // Host id ranges (issue 31). A range is taken when an agent is cloned and
  // given back once nothing of its sandbox is left (its processes reaped and
  // its disk removed), or when a spare or a failed create is killed.
  Result<IdRange> allocateRange();
  void releaseRange(IdRange r);
  // The range of sandbox `id` goes back (destroyed, orphaned, failed).
  void releaseRangeOf(const std::string& id);
  std::mutex rangeMu_;  // guards ranges_, rangeOf_
  IdRangePool ranges_;
  std::map<std::string, IdRange> rangeOf_;  // sandboxes holding a range
  // Closes the per-sandbox idmapped layer clones off the create path.
  FdDropper dropper_;

  std::mutex spareMu_;  // guards spares_, lastTake_, stopSpares_
  std::condition_variable spareCv_;
  std::deque<Agent> spares_;
  double lastTake_ = 0;  // monoSeconds() of the last take
  bool stopSpares_ = false;
  std::thread spareThread_;

  // Reaps killed sandboxes and removes what they leave (edge/corpse_cleaner.h).
  // Last, so it goes first: its work uses the members above.
  std::unique_ptr<CorpseCleaner> cleaner_;
  std::unique_ptr<CgroupReaper> cgroupReaper_;  // fed by cleaner_ (made first, reset last)
};

}  // namespace dsec::edge
