// The seam between the platform and a node: every sandbox operation the
// platform makes goes through an EdgeLink. Implementations: the in-process
// edge::Edge of `dsec up`, platform::RemoteEdge (an edge in another process,
// over the multiplexed link of docs/cluster.md), edge::SimEdge (a simulated
// node), and platform::Cluster, which routes each call to the node holding
// the sandbox.
//
// Thread-safety: implementations are thread-safe. Blocking methods may take
// as long as the node's work takes (a VM boot, a file transfer) and must be
// called from worker threads, never from an io thread (common/runtime.h).
// startExec never blocks on the exec: an exec in flight is a state object
// the agent's frames complete, and costs no thread while it runs.
//
// Errors: kNotFound or kFailedPrecondition for a sandbox the node does not
// run; kUnavailable when the node cannot be reached (or the link to it
// dropped mid-call); the operation's own errors otherwise (each naming the
// request field at fault where there is one).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "image/layer_builder.h"
#include "proto/types.h"

namespace dsec::proto {

// An exec in flight, as startExec returned it.
class ExecCall {
 public:
  virtual ~ExecCall() = default;
  // The caller went away: the node kills the exec's process group (SIGKILL
  // to all of it) and the exec ends with kUnavailable "exec cancelled".
  // Thread-safe, non-blocking, idempotent; after the end it does nothing.
  virtual void cancel() = 0;
};

struct ExecCallbacks {
  // Output as it arrives, in order. Null: the output is collected into the
  // result's out and err instead (up to the spec's maxOutput per stream).
  std::function<void(bool isStderr, std::string_view data)> onOutput;
  // Called exactly once with the result or the error.
  std::function<void(Result<ExecResult>)> onDone;
};

class EdgeLink {
 public:
  virtual ~EdgeLink() = default;

  // Called (on another thread) when a sandbox dies on its own.
  virtual void setDeathHandler(
      std::function<void(const std::string& id, const std::string& why)> h) = 0;

  // Builds a sandbox and waits until its agent answers. On error nothing of
  // it is left on the node.
  virtual Status create(BackendKind backend, const SandboxSpec& spec) = 0;
  // Creates several sandboxes (a batch's bulk call to one node): one status
  // per spec, in order. By default create() for each, concurrently (as that
  // many separate calls would run).
  virtual std::vector<Status> createMany(BackendKind backend,
                                         const std::vector<SandboxSpec>& specs);
  // Idempotent: an unknown id is fine.
  virtual Status destroy(const std::string& id) = 0;
  // Destroys several sandboxes of one node: one status per id, in order. By
  // default destroy() for each, a few at a time.
  virtual std::vector<Status> destroyMany(const std::vector<std::string>& ids);

  // Starts an exec. The callbacks run on the link's threads (io threads or
  // the agent reactor), never concurrently for one call, and must not block;
  // onDone may run before startExec returns (an unknown sandbox, a dead
  // link), so the caller must not hold a lock its callbacks take. Never null.
  virtual std::shared_ptr<ExecCall> startExec(const std::string& id, const ExecSpec& spec,
                                              ExecCallbacks cb) = 0;
  // startExec, waited for (worker threads only). A sink that returns an error
  // cancels the exec (the caller went away); the exec's error is then that.
  Result<ExecResult> exec(const std::string& id, const ExecSpec& spec, const OutputSink& sink);

  virtual Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                                     const ByteSource& src) = 0;
  // Calls onSize before the first byte with the file's size, so an HTTP
  // response can be started with a Content-Length; nullopt when the size is
  // not known up front (pseudo-files of /proc and /sys report 0).
  virtual Status readFile(const std::string& id, const std::string& path,
                          const std::function<Status(std::optional<uint64_t> size)>& onSize,
                          const ByteSink& sink) = 0;
  // One small agent request (AgentOp): its JSON result.
  virtual Result<std::string> agentOp(const std::string& id, AgentOp op,
                                      const std::string& json) = 0;
  virtual Result<CgroupStats> stats(const std::string& id) = 0;
  // Freezes (no CPU used, memory kept) or thaws every process of a sandbox.
  virtual Status pause(const std::string& id, bool paused) = 0;
  // Pause to disk (VM backends); pause(id, false) resumes. Nodes or backends
  // that cannot: kFailedPrecondition (field "memory").
  virtual Status hibernate(const std::string& id) = 0;
  virtual Status setLimits(const std::string& id, const CgroupLimits& limits) = 0;
  // Replaces the sandbox's egress allow-list (empty: no egress).
  virtual Status setEgress(const std::string& id, const std::vector<EgressRule>& rules) = 0;
  virtual Result<EgressDenials> egressDenials(const std::string& id) = 0;
  // pack_diff: the sandbox's writes as a diff layer whose files are under
  // workDir on the caller's machine when this returns.
  virtual Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) = 0;
  // Drops the node's mount of a layer no sandbox uses (before its blob goes).
  virtual Status evictLayer(const std::string& digest) = 0;
  // Computer use (backend vm): the screen as PNG, one input action.
  virtual Result<std::string> screenshot(const std::string& id) = 0;
  virtual Status input(const std::string& id, const InputAction& action) = 0;
};

// A node in the platform's own process (`dsec up`): what it reports of
// itself. Thread-safe.
class LocalNode {
 public:
  virtual ~LocalNode() = default;
  virtual NodeReport report() = 0;
  // Ids of the sandboxes it runs now.
  virtual std::vector<std::string> sandboxIds() const = 0;
};

}  // namespace dsec::proto
