// A simulated node (`dsec edge --simulate`): answers creates, execs, destroys
// and file calls like an edge, after a configured latency, without running
// anything, so one machine can load the control plane with many nodes.
// Capacity bounds how many sandboxes it holds (kResourceExhausted past it).
// Exec runs nothing: `echo ARGS` prints ARGS, anything else prints nothing
// and exits 0. Files are kept in memory per sandbox. Thread-safe.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "edge/backends/microvm/microvm_backend.h"
#include "edge/backends/vm/vm_backend.h"
#include "edge/edge_link.h"

namespace dsec::edge {

struct SimOptions {
  int latencyMs = 0;        // each create, exec, destroy and file call
  int64_t capacity = 1000;  // sandboxes at most
};

class SimEdge : public EdgeLink {
 public:
  explicit SimEdge(SimOptions opts);
  void setDeathHandler(std::function<void(const std::string&, const std::string&)>) override {}
  Status create(const std::string& backend, const SandboxSpec& spec) override;
  // One latency for the whole call, as concurrent creates would take.
  std::vector<Status> createMany(const std::string& backend,
                                 const std::vector<SandboxSpec>& specs) override;
  Status destroy(const std::string& id) override;
  // One latency for the whole call, as for createMany.
  std::vector<Status> destroyMany(const std::vector<std::string>& ids) override;
  Result<ExecResult> exec(const std::string& id, const ExecSpec& spec,
                          const OutputSink& sink) override;
  Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                             const ByteSource& src) override;
  Status readFile(const std::string& id, const std::string& path,
                  const std::function<Status(std::optional<uint64_t>)>& onSize,
                  const ByteSink& sink) override;
  Result<std::string> fileCall(const std::string& id, proto::FrameType type,
                               const std::string& json) override;
  Result<CgroupStats> stats(const std::string& id) override;
  Status pause(const std::string& id, bool paused) override;
  Status setLimits(const std::string& id, const CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<net::EgressRule>& rules) override;
  Result<net::EgressDenials> egressDenials(const std::string& id) override;
  std::string egressUnavailable() const override { return "simulated node"; }
  std::string egressTag() const override { return "sim"; }
  std::map<std::string, uint64_t> egressDenialCounts() override { return {}; }
  std::map<std::string, uint64_t> syscallDenialCounts() const override { return {}; }
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  Status evictLayer(const std::string&) override { return Status::ok(); }
  std::vector<std::string> sandboxIds() const override;
  std::vector<std::string> adoptedIds() const override { return {}; }
  std::map<std::string, int> orphansRemoved() const override { return {}; }
  const std::map<std::string, std::vector<std::string>>& fncallLanguages() const override {
    return languages_;
  }
  const Userns& userns() const override { return userns_; }
  const MicroVmProbe& microvm() const override { return microvm_; }
  const VmProbe& vm() const override { return vm_; }
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const InputAction& action) override;
  NodeCache* localNodeCache() override { return nullptr; }

  int64_t capacity() const { return opts_.capacity; }

 private:
  void delay() const;
  Status addLocked(const SandboxSpec& spec);  // mu_ held
  Status check(const std::string& id) const;

  SimOptions opts_;
  mutable std::mutex mu_;                                                // guards sandboxes_
  std::map<std::string, std::map<std::string, std::string>> sandboxes_;  // id -> path -> bytes
  std::map<std::string, std::vector<std::string>> languages_;
  Userns userns_;
  MicroVmProbe microvm_;
  VmProbe vm_;
};

}  // namespace dsec::edge
