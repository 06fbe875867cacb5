// backend="fncall" (docs/fncall.md): a container sandbox whose root is the
// image's layers read-only plus a bounded tmpfs at /scratch, in which aether
// runs every exec as a call and keeps warm zygotes (src/aether/fncall.h).
// Built on the container backend, so namespaces, cgroups, user namespaces,
// the agent channel, policies and restart re-adoption all carry over: this
// backend only adds the init frame's "fncall" object and the CPU its own
// machinery needs (kFncallCpuOverhead).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "edge/backend.h"

namespace dsec::edge {

// Cores added to a fncall sandbox's CPU quota beyond its `cpu`
// (SandboxSpec::cpuOverhead): the zygote's spare forks, their page copies
// and exits, the clean-up after each call and a successor zygote's start
// (~85 ms of CPU every zygote_max_calls calls) run in the sandbox's cgroup
// beside the calls. Back to back, `print(1)` calls kept a 1-CPU sandbox
// at ~1.3-1.5 CPUs: throttled ~20 times in 600 calls (27% of the wall
// time, each stall ~30 ms; docs/fncall.md). With 0.5 more: none.
inline constexpr double kFncallCpuOverhead = 0.5;

class FncallBackend : public Backend {
 public:
  // `container` must outlive this backend (the Edge owns both).
  // zygoteMaxCalls: the init frame's fncall.zygote_max_calls (0: aether's).
  FncallBackend(Backend* container, std::map<std::string, std::vector<std::string>> languages,
                int64_t zygoteMaxCalls = 0)
      : container_(container), languages_(std::move(languages)), zygoteMaxCalls_(zygoteMaxCalls) {}

  std::string name() const override { return "fncall"; }
  bool takesInitPolicy() const override { return true; }
  // The spec's diskBytes sizes /scratch (a tmpfs: charged to the sandbox's
  // memory); its fncallInit, when set, is sent as is (the platform's
  // Cluster sets it: ClusterOptions::fncallLanguages), else initJson's.
  Result<std::unique_ptr<Instance>> create(const SandboxSpec& spec,
                                           std::function<void()> onDeath) override;
  Status destroy(Instance& inst) override { return container_->destroy(inst); }
  Result<std::unique_ptr<Instance>> adopt(const SandboxState& state,
                                          std::function<void()> onDeath) override;
  void removeOrphan(const std::string& id) override { container_->removeOrphan(id); }
  // The container backend cleans up the leftovers of both.
  int cleanupOrphans() override { return 0; }

  // The init frame's "fncall" object for a sandbox of `scratchBytes`.
  std::string initJson(int64_t scratchBytes) const;

 private:
  Backend* container_;
  std::map<std::string, std::vector<std::string>> languages_;
  int64_t zygoteMaxCalls_;
};

}  // namespace dsec::edge
