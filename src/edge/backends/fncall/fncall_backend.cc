#include "edge/backends/fncall/fncall_backend.h"

#include <nlohmann/json.hpp>

namespace dsec::edge {

std::string FncallBackend::initJson(int64_t scratchBytes) const {
  nlohmann::json j = {{"scratch_mb", std::max<int64_t>(1, scratchBytes >> 20)},
                      {"prestart", {"python"}}};
  if (!languages_.empty()) j["languages"] = languages_;
  return j.dump();
}

Result<std::unique_ptr<Instance>> FncallBackend::create(const SandboxSpec& spec,
                                                        std::function<void()> onDeath) {
  SandboxSpec s = spec;
  if (s.fncallInit.empty()) s.fncallInit = initJson(s.diskBytes);
  return container_->create(s, std::move(onDeath));
}

}  // namespace dsec::edge
