#include "proto/types.h"

namespace dsec::proto {

const char* backendName(BackendKind b) {
  switch (b) {
    case BackendKind::kFncall:
      return "fncall";
    case BackendKind::kContainer:
      return "container";
    case BackendKind::kMicrovm:
      return "microvm";
    case BackendKind::kVm:
      return "vm";
  }
  return "container";
}

std::optional<BackendKind> parseBackend(std::string_view name) {
  for (BackendKind b : kAllBackends) {
    if (name == backendName(b)) return b;
  }
  return std::nullopt;
}

std::vector<std::optional<double>> cpuCores(const std::vector<StatsSample>& samples) {
  std::vector<std::optional<double>> out;
  out.reserve(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    if (i == 0) {
      out.push_back(std::nullopt);
      continue;
    }
    const StatsSample& a = samples[i - 1];
    const StatsSample& b = samples[i];
    double dt = b.t - a.t;
    if (!(dt > 0) || b.cpuUsec < a.cpuUsec) {
      out.push_back(std::nullopt);
      continue;
    }
    out.push_back(double(b.cpuUsec - a.cpuUsec) / 1e6 / dt);
  }
  return out;
}

const char* stateName(SandboxState s) {
  switch (s) {
    case SandboxState::kPending:
      return "pending";
    case SandboxState::kCreating:
      return "creating";
    case SandboxState::kRunning:
      return "running";
    case SandboxState::kPaused:
      return "paused";
    case SandboxState::kLost:
      return "lost";
    case SandboxState::kStopping:
      return "stopping";
    case SandboxState::kStopped:
      return "stopped";
    case SandboxState::kFailed:
      return "failed";
  }
  return "failed";
}

std::optional<SandboxState> parseState(std::string_view name) {
  for (SandboxState s : kAllStates) {
    if (name == stateName(s)) return s;
  }
  return std::nullopt;
}

const char* agentOpName(AgentOp op) {
  switch (op) {
    case AgentOp::kList:
      return "list";
    case AgentOp::kStat:
      return "stat";
    case AgentOp::kMkdir:
      return "mkdir";
    case AgentOp::kRemove:
      return "remove";
    case AgentOp::kPolicy:
      return "policy";
    case AgentOp::kSetMeta:
      return "set_meta";
    case AgentOp::kAudit:
      return "audit";
  }
  return "stat";
}

std::optional<AgentOp> parseAgentOp(std::string_view name) {
  for (AgentOp op : {AgentOp::kList, AgentOp::kStat, AgentOp::kMkdir, AgentOp::kRemove,
                     AgentOp::kPolicy, AgentOp::kAudit, AgentOp::kSetMeta}) {
    if (name == agentOpName(op)) return op;
  }
  return std::nullopt;
}

}  // namespace dsec::proto
