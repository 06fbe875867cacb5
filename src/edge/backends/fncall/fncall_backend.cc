#include "edge/backends/fncall/fncall_backend.h"

#include "proto/codec.h"

#include <nlohmann/json.hpp>

#include "edge/sandbox_state.h"

namespace dsec::edge {

std::string FncallBackend::initJson(int64_t scratchBytes) const {
  return proto::fncallInitJson(scratchBytes, languages_, zygoteMaxCalls_);
}

Result<std::unique_ptr<Instance>> FncallBackend::create(const SandboxSpec& spec,
                                                        std::function<void()> onDeath) {
  SandboxSpec s = spec;
  if (s.fncallInit.empty()) s.fncallInit = initJson(s.diskBytes);
  s.cpuOverhead = kFncallCpuOverhead;
  return container_->create(s, std::move(onDeath));
}

Result<std::unique_ptr<Instance>> FncallBackend::adopt(const SandboxState& state,
                                                       std::function<void()> onDeath) {
  // Later limit changes (policy phases) keep the headroom.
  SandboxState s = state;
  s.spec.cpuOverhead = kFncallCpuOverhead;
  return container_->adopt(s, std::move(onDeath));
}

}  // namespace dsec::edge
