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

#include "common/fd.h"
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

  // Non-blocking and thread-safe: each is queued, in call order, for the
  // process. kFailedPrecondition once the exec has ended, and for input or
  // a resize of an exec that is not interactive (ExecSpec::interactive, pty).
  //
  // Bytes for its stdin (a terminal's input); empty closes stdin (on a
  // terminal: no more input, the terminal stays).
  virtual Status sendInput(std::string_view bytes);
  // A terminal's new window size (SIGWINCH to its foreground job).
  virtual Status resize(TermSize size);
  // A signal (1..64) for the exec's process group; on a terminal, for its
  // foreground process group instead (as a typed ^C).
  virtual Status signal(int sig);
};

// An interactive exec's control on the platform-edge link: the exec call's
// body is a sequence of records, u8 kind ('i' input bytes, empty closing
// stdin; 'r' resize {"rows","cols"}; 's' signal {"signal"}), u32 little-endian
// payload length (at most 1 MiB), payload.
std::string execInputRecord(std::string_view bytes);
std::string execResizeRecord(TermSize size);
std::string execSignalRecord(int sig);
// The receiving side: turns the body's bytes, however split, back into
// calls on `to`. kInvalidArgument for an unknown kind, an oversized record
// or a malformed payload (the stream cannot be trusted after it).
class ExecControlDecoder {
 public:
  Status feed(std::string_view bytes, ExecCall& to);

 private:
  std::string buf_;
};

struct ExecCallbacks {
  // Output as it arrives, in order. Null: the output is collected into the
  // result's out and err instead (up to the spec's maxOutput per stream).
  std::function<void(bool isStderr, std::string_view data)> onOutput;
  // The process started, with this pid (in the sandbox's pid namespace),
  // before any output. Optional: nodes that cannot tell never call it.
  std::function<void(int pid)> onStarted;
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
  // The sandbox's resource readings of the last windowS seconds, oldest
  // first, the last one taken now: what its node sampled every intervalS
  // (edge: EdgeOptions::statsIntervalS) while it lived. By default (a node
  // that keeps no history, SimEdge) one reading now, intervalS 0. Errors as
  // stats().
  virtual Result<StatsSeries> statsHistory(const std::string& id, double windowS);
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
  // Exposed ports (docs/ports.md). Opens a TCP connection from the node to
  // 127.0.0.1:port (then [::1]:port) inside the sandbox's own network
  // namespace: only its loopback, so no egress rule is involved and nothing
  // else of the sandbox, the node or the network becomes reachable. Returns a
  // connected stream socket, close-on-exec, non-blocking: on the platform's
  // own node the sandbox's socket itself; through a remote node one end of a
  // socketpair the link relays (flow-controlled both ways; a half-close
  // passes as a half-close). `gen` is the exposure's generation: the node
  // keeps every connection it opened under (id, port, gen) and cuts it
  // (shutdown both ways, so the caller reads EOF) when setPorts() drops that
  // pair or the sandbox goes. Blocking (worker threads): at most
  // connectTimeoutS for the connect.
  // Errors: kNotFound (no such sandbox on the node); kFailedPrecondition
  // field "backend" (a backend that cannot: fncall, and for now microvm and
  // vm); kInvalidArgument field "port" (not 1..65535); kPermissionDenied
  // field "port" (setPorts() was told of this sandbox and (port, gen) is not
  // in it); kUnavailable "nothing listens on port P" (refused);
  // kDeadlineExceeded (connect took longer than connectTimeoutS).
  virtual Result<UniqueFd> openPort(const std::string& id, int port, uint64_t gen,
                                    double connectTimeoutS = 10);
  // The sandbox's exposed ports now (empty: none). Cuts every connection
  // opened under a (port, gen) not in the list; later openPort() calls for
  // such a pair are refused. Idempotent; an unknown sandbox is fine.
  virtual Status setPorts(const std::string& id, const std::vector<PortGen>& ports);

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
