// The seam between the platform and the nodes it drives. The platform calls
// every sandbox operation through an EdgeLink: the in-process edge::Edge of
// `dsec up`, a RemoteEdge speaking the edge's internal HTTP API
// (docs/cluster.md), a simulated edge, or the platform's Cluster, which routes
// each call to the node that holds the sandbox.
//
// Contracts are those of edge::Edge (edge/edge.h), whose methods these are.
// Implementations are thread-safe. A call on a node that cannot be reached
// fails with kUnavailable.
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/frame.h"
#include "common/status.h"
#include "edge/backend.h"
#include "edge/cgroup.h"
#include "edge/net/egress_filter.h"
#include "edge/net/egress_rules.h"
#include "edge/userns.h"
#include "image/layer_builder.h"

namespace dsec::edge {

class NodeCache;
struct MicroVmProbe;
struct VmProbe;

struct ExecSpec {
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "K=V", the whole environment
  std::string cwd;               // empty: agent default
  std::string user;              // empty: root
  int64_t timeoutMs = 60000;     // 0 = none
  int64_t maxOutput = 1 << 20;   // per stream
  std::optional<std::string> stdinData;
  // fncall sandboxes: the exec frame's "fncall" object (language, code,
  // fresh_dir, files, limits; docs/fncall.md); empty: run argv as the call.
  std::string fncallJson;
};

struct ExecResult {
  int exitCode = 0;
  int signal = 0;
  bool timedOut = false;
  bool truncated = false;
  bool oomKilled = false;
  double durationMs = 0;
  // fncall: the agent reported the exec as a call; `limit` names the limit
  // that stopped it ("timeout", "cpu", "memory", "file_size", "output"), or
  // is empty.
  bool call = false;
  std::string limit;
  bool zygoteStarted = false;  // fncall: the call had to start a zygote first
  std::string out;  // left empty when streamed to a sink
  std::string err;
};

// Receives exec output as it arrives. An error return cancels the exec.
using OutputSink = std::function<Status(bool isStderr, std::string_view data)>;
// Supplies file bytes: fills buf, returns the count, 0 at the end.
using ByteSource = std::function<Result<size_t>(char* buf, size_t n)>;
// Receives file bytes in order.
using ByteSink = std::function<Status(std::string_view data)>;

class EdgeLink {
 public:
  virtual ~EdgeLink() = default;

  // Called (on another thread) when a sandbox dies on its own.
  virtual void setDeathHandler(
      std::function<void(const std::string& id, const std::string& why)> h) = 0;

  virtual Status create(const std::string& backend, const SandboxSpec& spec) = 0;
  // Creates several sandboxes (a batch's bulk call to one node): one status
  // per spec, in order. By default create() for each, concurrently (as that
  // many separate calls would run).
  virtual std::vector<Status> createMany(const std::string& backend,
                                         const std::vector<SandboxSpec>& specs);
  virtual Status destroy(const std::string& id) = 0;
  // Destroys several sandboxes of one node (a bulk destroy's share of it):
  // one status per id, in order. By default destroy() for each, a few at a
  // time (as separate calls would run).
  virtual std::vector<Status> destroyMany(const std::vector<std::string>& ids);
  virtual Result<ExecResult> exec(const std::string& id, const ExecSpec& spec,
                                  const OutputSink& sink) = 0;
  virtual Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                                     const ByteSource& src) = 0;
  virtual Status readFile(const std::string& id, const std::string& path,
                          const std::function<Status(std::optional<uint64_t> size)>& onSize,
                          const ByteSink& sink) = 0;
  virtual Result<std::string> fileCall(const std::string& id, proto::FrameType type,
                                       const std::string& json) = 0;
  virtual Result<CgroupStats> stats(const std::string& id) = 0;
  virtual Status pause(const std::string& id, bool paused) = 0;
  // Pause to disk (VM backends; edge::Edge::hibernate); pause(id, false)
  // resumes. Nodes that cannot: kFailedPrecondition.
  virtual Status hibernate(const std::string& id) {
    return Status(Code::kFailedPrecondition, "this node cannot pause sandbox " + id + " to disk",
                  0, "memory");
  }
  virtual Status setLimits(const std::string& id, const CgroupLimits& limits) = 0;
  virtual Status setEgress(const std::string& id, const std::vector<net::EgressRule>& rules) = 0;
  virtual Result<net::EgressDenials> egressDenials(const std::string& id) = 0;
  virtual std::string egressUnavailable() const = 0;
  virtual std::string egressTag() const = 0;
  virtual std::map<std::string, uint64_t> egressDenialCounts() = 0;
  virtual std::map<std::string, uint64_t> syscallDenialCounts() const = 0;
  virtual Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) = 0;
  virtual Status evictLayer(const std::string& digest) = 0;
  virtual std::vector<std::string> sandboxIds() const = 0;
  virtual std::vector<std::string> adoptedIds() const = 0;
  virtual std::map<std::string, int> orphansRemoved() const = 0;
  virtual const std::map<std::string, std::vector<std::string>>& fncallLanguages() const = 0;
  virtual const Userns& userns() const = 0;
  virtual const MicroVmProbe& microvm() const = 0;
  virtual const VmProbe& vm() const = 0;
  // Computer use (backend vm): the screen as PNG, one input action.
  virtual Result<std::string> screenshot(const std::string& id) = 0;
  virtual Status input(const std::string& id, const InputAction& action) = 0;
  // The node cache of an in-process edge; null for a remote or simulated one.
  virtual NodeCache* localNodeCache() = 0;

  // Cluster hooks (platform/cluster.h); a single node answers trivially.
  // The node that holds sandbox `id`.
  virtual std::string nodeOf(const std::string& /*id*/) const { return "local"; }
  // Tells the router that sandbox `id` (a record loaded at start) lives on
  // `node`, so its calls go there.
  virtual void bindSandbox(const std::string& /*id*/, const std::string& /*node*/,
                           const SandboxSpec& /*spec*/) {}
  // Forgets that placement (another platform replica ended the sandbox).
  virtual void unbindSandbox(const std::string& /*id*/) {}
  // Whether `node` is another process's (its sandboxes outlive this one).
  virtual bool isRemoteNode(const std::string& /*node*/) const { return false; }
  // Called when the sandboxes of a node that stopped answering are lost
  // (lost = true), or found again when it returns (lost = false).
  virtual void setLostHandler(
      std::function<void(const std::string& id, bool lost, const std::string& why)> /*h*/) {}
  // Prometheus text appended to the platform's /metrics.
  virtual std::string extraMetrics() { return ""; }
};

inline std::vector<Status> EdgeLink::createMany(const std::string& backend,
                                                const std::vector<SandboxSpec>& specs) {
  std::vector<Status> out(specs.size());
  std::vector<std::thread> threads;
  for (size_t i = 1; i < specs.size(); ++i) {
    threads.emplace_back([&, i] { out[i] = create(backend, specs[i]); });
  }
  if (!specs.empty()) out[0] = create(backend, specs[0]);
  for (auto& t : threads) t.join();
  return out;
}

inline std::vector<Status> EdgeLink::destroyMany(const std::vector<std::string>& ids) {
  std::vector<Status> out(ids.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < ids.size();) out[i] = destroy(ids[i]);
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min<size_t>(16, ids.size()); ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace dsec::edge
