// The in-memory implementation of EdgeLink: a simulated node (`dsec edge
// --simulate`, and the platform's unit tests). It answers creates, execs,
// destroys and file calls like an edge, after a configured latency, without
// running anything, so one machine can load the control plane with many nodes.
// Capacity bounds how many sandboxes it holds (kResourceExhausted past it).
// Exec runs nothing: `echo ARGS` prints ARGS, `sleep N` takes N seconds,
// anything else prints nothing; all exit 0. Files are kept in memory per
// sandbox. Thread-safe.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "proto/edge_link.h"

namespace dsec::proto {

struct SimOptions {
  int latencyMs = 0;        // each create, exec, destroy and file call
  int64_t capacity = 1000;  // sandboxes at most
};

class SimEdge : public EdgeLink {
 public:
  explicit SimEdge(SimOptions opts);
  void setDeathHandler(std::function<void(const std::string&, const std::string&)>) override {}
  Status create(BackendKind backend, const SandboxSpec& spec) override;
  // One latency for the whole call, as concurrent creates would take.
  std::vector<Status> createMany(BackendKind backend,
                                 const std::vector<SandboxSpec>& specs) override;
  Status destroy(const std::string& id) override;
  // One latency for the whole call, as for createMany.
  std::vector<Status> destroyMany(const std::vector<std::string>& ids) override;
  // Runs nothing and holds no thread: the latency and, for `sleep N` (argv
  // ["sleep", N], or a shell's "sleep N"), N seconds more pass on a timer.
  // cancel() ends it at once (kUnavailable, as a real node's cancel).
  std::shared_ptr<ExecCall> startExec(const std::string& id, const ExecSpec& spec,
                                             ExecCallbacks cb) override;
  Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                             const ByteSource& src) override;
  Status readFile(const std::string& id, const std::string& path,
                  const std::function<Status(std::optional<uint64_t>)>& onSize,
                  const ByteSink& sink) override;
  Result<std::string> agentOp(const std::string& id, AgentOp op,
                              const std::string& json) override;
  Result<CgroupStats> stats(const std::string& id) override;
  Status pause(const std::string& id, bool paused) override;
  Status hibernate(const std::string& id) override;
  Status setLimits(const std::string& id, const CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<EgressRule>& rules) override;
  Result<EgressDenials> egressDenials(const std::string& id) override;
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  Status evictLayer(const std::string&) override { return Status::ok(); }
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const InputAction& action) override;
  std::vector<std::string> sandboxIds() const;
  // Execs in flight now (started, not ended).
  int64_t execsInFlight() const { return inflight_->load(); }

  int64_t capacity() const { return opts_.capacity; }

 private:
  void delay() const;
  Status addLocked(const SandboxSpec& spec);  // mu_ held
  Status check(const std::string& id) const;

  SimOptions opts_;
  mutable std::mutex mu_;                                                // guards sandboxes_
  std::map<std::string, std::map<std::string, std::string>> sandboxes_;  // id -> path -> bytes
  // Execs in flight; shared with their timers, which may outlive this.
  std::shared_ptr<std::atomic<int64_t>> inflight_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace dsec::proto
