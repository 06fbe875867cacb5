// What every sandbox backend provides. A backend builds and tears down the
// isolation (namespaces, cgroups, mounts; later QEMU), and hands back an agent
// connection; exec and file calls then go through the agent protocol, the
// same for all backends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "edge/agent_conn.h"
#include "edge/cgroup.h"
#include "edge/id_range_pool.h"
#include "proto/types.h"

namespace dsec::edge {

using proto::BackendKind;
using proto::ByteSink;
using proto::ByteSource;
using proto::ExecResult;
using proto::ExecSpec;
using proto::InputAction;
using proto::OutputSink;
using proto::SandboxSpec;


// A running sandbox as its backend made it. Owned by the Edge.
class Instance {
 public:
  virtual ~Instance() = default;
  virtual const std::string& id() const = 0;
  virtual std::shared_ptr<AgentConn> agent() const = 0;
  // Resource events so far (OOM kills, pids-limit hits, memory in use).
  virtual Result<CgroupStats> stats() const = 0;
  // Processes of the sandbox the OOM killer has killed so far.
  virtual Result<int64_t> oomKills() const = 0;
  // Stops (or resumes) every process of the sandbox.
  virtual Status freeze(bool frozen) = 0;
  // Changes the sandbox's CPU, memory and pids limits in place.
  virtual Status setLimits(const CgroupLimits& limits) = 0;
  // The node-local directory holding the sandbox's writes in overlayfs form
  // (whiteouts, opaque dirs): `path` is empty when the backend has none, and
  // stays valid while `hold` (a descriptor it goes through, if any) lives.
  struct UpperDir {
    std::string path;
    UniqueFd hold;
  };
  virtual Result<UpperDir> upperDir() const = 0;
  // Backends whose writes the host cannot read in place (a guest's disk:
  // upperDir() has no path) copy them out instead: into `dest` (which must not
  // exist yet) as a directory in the same overlayfs form, one consistent
  // moment of the sandbox (the backend freezes what it must meanwhile).
  // A backend whose sandbox is one whole disk (vm) snapshots that instead:
  // a standalone image (no backing file) at `dest`, one consistent moment.
  virtual bool snapshotsDisk() const { return false; }
  virtual Status snapshotDisk(const std::string& dest) {
    (void)dest;
    return Status(Code::kFailedPrecondition, "this backend has no disk to snapshot");
  }
  virtual bool exportsUpper() const { return false; }
  virtual Status exportUpper(const std::string& dest) {
    (void)dest;
    return Status(Code::kFailedPrecondition, "this backend has no writes to export");
  }
  // An fd of the sandbox's network namespace (to plumb egress into it).
  virtual Result<UniqueFd> openNetns() const = 0;
  // Whether openNetns() leads anywhere: false for a VM booted without a NIC
  // (SandboxSpec::network), whose openNetns() then says why.
  virtual bool hasNetwork() const { return true; }
  // The host pid of the sandbox's PID 1 (recorded so a restarted edge can
  // find it again), -1 when there is none.
  virtual pid_t initPid() const { return -1; }
  // The host ids its user namespace maps (issue 31), recorded for
  // re-adoption; empty when it has none of its own.
  virtual IdRange idRange() const { return {}; }
  // Whether the sandbox is hibernated (Backend::hibernate): its whole state
  // is a file, nothing of it runs, calls on its agent fail until restore().
  virtual bool hibernated() const { return false; }
  // Computer use, where the sandbox has a display (backend vm): the screen
  // as PNG bytes, and keyboard/mouse input. kFailedPrecondition elsewhere.
  virtual Result<std::string> screenshot() {
    return Status(Code::kFailedPrecondition, "this backend has no display (use backend vm)");
  }
  virtual Status input(const InputAction& action) {
    (void)action;
    return Status(Code::kFailedPrecondition, "this backend has no display (use backend vm)");
  }
};

struct SandboxState;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Whether create() applies spec.initPolicy itself (in the agent's init).
  virtual bool takesInitPolicy() const { return false; }
  // Builds the sandbox and waits for its agent's hello. onDeath runs (on some
  // other thread, once) if the sandbox dies on its own. On error nothing of
  // the sandbox is left behind.
  virtual Result<std::unique_ptr<Instance>> create(const SandboxSpec& spec,
                                                   std::function<void()> onDeath) = 0;
  // Kills the sandbox: once this returns its init has been sent SIGKILL and
  // no call reaches it any more; its processes are reaped and its mounts,
  // cgroups and files removed in the background (shutdown() waits for that).
  virtual Status destroy(Instance& inst) = 0;
  // Takes over a sandbox that an earlier edge on this node left running
  // (crashed, or stopped with live restore): reconnects to its agent, takes
  // references on its layers and watches its PID 1 again. The caller checked
  // that state.pid is still that PID 1. On error the sandbox is left as it
  // was, for the caller to remove as an orphan.
  virtual Result<std::unique_ptr<Instance>> adopt(const SandboxState& state,
                                                  std::function<void()> onDeath) = 0;
  // Memory snapshots (docs/microvm.md, "Hibernate"): backends whose sandbox
  // is a VM save its whole state (RAM and devices) to a file in the
  // sandbox's node-local directory, and its process exits: no memory held.
  virtual bool hibernates() const { return false; }
  // `paused`: whether the VM is stopped now. `persist` runs once the state
  // file is in place, before the VM's process goes; its error undoes the
  // save. On error the sandbox runs as before (stopped again if it was).
  // Serialized with restore() per sandbox; a hibernated sandbox is fine.
  virtual Status hibernate(Instance& inst, bool paused, const std::function<Status()>& persist) {
    (void)inst, (void)paused, (void)persist;
    return Status(Code::kFailedPrecondition,
                  "pausing to disk is not supported for backend " + name() +
                      " (backends microvm and vm only)",
                  0, "memory");
  }
  // Starts a hibernated sandbox's VM again from its saved state: running,
  // its agent answering, the state file removed; onDeath as for create. A
  // running sandbox is fine. `beforeRun` runs once the new VM process exists
  // (inst.openNetns() reaches its network namespace) and before its guest
  // runs again: the caller plumbs the sandbox's egress there; its error fails
  // the restore. On error nothing of the new VM runs and the sandbox cannot
  // be resumed: its console log is kept (the path is in the error) and the
  // caller destroys it.
  virtual Status restore(Instance& inst, std::function<void()> onDeath,
                         const std::function<Status()>& beforeRun) {
    (void)inst, (void)onDeath, (void)beforeRun;
    return Status::ok();
  }
  // Removes what is left of a sandbox that could not be adopted: kills its
  // processes, removes its cgroups and directory.
  virtual void removeOrphan(const std::string& id) = 0;
  // Removes leftovers of sandboxes no record owns (after a crash); returns how many.
  virtual int cleanupOrphans() = 0;
  // Stops background work and waits until every destroyed sandbox is fully
  // torn down. With keepSandboxes (live restore) what the sandboxes still
  // running need stays in place for the next edge.
  virtual void shutdown(bool keepSandboxes = false) { (void)keepSandboxes; }
};

}  // namespace dsec::edge
