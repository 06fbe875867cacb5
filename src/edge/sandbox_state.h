// What an edge keeps on disk about each sandbox it runs, so that an edge
// restarted after a crash (or an upgrade with live restore) re-adopts its
// sandboxes instead of losing them: which process is the sandbox's PID 1
// (pid plus start time, so a reused pid is never mistaken for it), its
// layers, and what the edge enforces from outside the sandbox that does not
// persist by itself (the egress allow-list in the eBPF maps, paused). Cgroup
// limits, mounts and the agent's file policy outlive the edge on their own.
//
// One small JSON file per sandbox, <dir>/<id>.json, replaced by rename. Not
// fsynced: it has to survive the edge's death, not the machine's (a machine
// that goes down takes its sandboxes with it).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "edge/backend.h"
#include "proto/egress.h"

namespace dsec::edge {

struct SandboxState {
  BackendKind backend = BackendKind::kContainer;
  SandboxSpec spec;
  pid_t pid = -1;
  uint64_t startTime = 0;  // /proc/<pid>/stat field 22: clock ticks after boot
  std::vector<proto::EgressRule> egress;
  bool paused = false;
  // Memory saved to disk, no process (Backend::hibernate); pid is -1 then.
  bool hibernated = false;
  // The host ids its user namespace maps (issue 31): kept on re-adoption.
  // Empty without a user namespace of its own (and in an older edge's file).
  IdRange userns;
};

std::string encodeSandboxState(const SandboxState& s);
// kInvalidArgument for anything malformed.
Result<SandboxState> decodeSandboxState(const std::string& text);

// The start time of a process (field 22 of /proc/<pid>/stat).
Result<uint64_t> processStartTime(pid_t pid);

class SandboxStateDir {
 public:
  explicit SandboxStateDir(std::string dir) : dir_(std::move(dir)) {}
  Status open();  // makes the directory
  Status put(const SandboxState& s);
  // A missing file is fine.
  void remove(const std::string& id);
  // Every record, and the names of files that could not be read (already
  // removed: what they described is an orphan).
  std::vector<SandboxState> loadAll(std::vector<std::string>* bad = nullptr);
  const std::string& dir() const { return dir_; }

 private:
  std::string pathOf(const std::string& id) const { return dir_ + "/" + id + ".json"; }
  std::string dir_;
};

}  // namespace dsec::edge
