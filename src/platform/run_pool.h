// Warm fncall sandboxes for one-shot calls (POST /v1/run, docs/fncall.md).
//
// Pools are keyed by (image, language) and remember the image's layers: a
// call that resolves the same key to other layers (the tag moved) retires
// that pool's sandboxes. A pool grows under demand up to a per-node bound
// shared by all pools (an idle sandbox of another pool is recycled when the
// bound is reached; a caller waits otherwise), and shrinks when its sandboxes
// sit idle. Each sandbox serves one call at a time, in a fresh directory it
// removes afterwards, and kills every process the call left (exclusive), so
// nothing of one call is visible to the next. A sandbox that died, or whose
// agent failed a call, is destroyed and replaced.
//
// A sandbox is not ready for its next call the moment its result is back:
// aether still removes what the call left and its zygote forks the next spare
// (and the spare copies its learnt pages), ~1 ms of CPU. So a call takes the
// most recently used idle sandbox that has settled (idle settleSeconds or
// more), else the one idle longest; and a pool whose calls come back to back
// (a call found no settled sandbox) grows, in the background, to `alternate`
// sandboxes, so that consecutive calls of one client alternate between them
// and each finds its spare made (docs/fncall.md).
//
// Thread-safe: any number of callers run at once; mu_ guards the slots.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "proto/edge_link.h"

namespace dsec::platform {

using proto::ExecResult;
using proto::ExecSpec;

struct RunPoolOptions {
  int maxSandboxes = 16;       // per node, all pools together
  double idleSeconds = 60;     // an idle sandbox older than this is destroyed
  double waitSeconds = 30;     // how long a call waits for a sandbox at the bound
  // A sandbox idle for less than this is still getting ready (its clean-up,
  // its next spare): a call prefers one that has settled.
  double settleSeconds = 0.005;
  // The sandboxes a pool grows to in the background when a call finds none
  // settled (back-to-back calls); more only on demand (concurrent calls).
  int alternate = 2;
  double cpu = 1.0;
  int64_t memoryBytes = 512ll << 20;
  int64_t scratchBytes = 64ll << 20;
  int64_t pids = 256;
};

struct RunPoolStats {
  int idle = 0;
  int busy = 0;  // serving a call or being created (also in the background)
  int maxSandboxes = 0;
  uint64_t created = 0;
  uint64_t grown = 0;  // of created: made in the background for back-to-back calls
  uint64_t destroyed = 0;
  uint64_t replaced = 0;  // destroyed because they failed
  uint64_t calls = 0;
  // Calls that had to start a python zygote (the sandbox's was killed, or
  // retired after zygote_max_calls): aether's "zygote_start" in the exit report.
  uint64_t zygoteRestarts = 0;
  struct PoolCounts {
    int idle = 0;
    int busy = 0;  // serving a call (not counting one being created)
  };
  std::map<std::string, PoolCounts> pools;  // by key (image|language)
  // Finished calls by (result, limit): result "ok" (exit 0), "exit" (another
  // exit code), "signal", "error" (no result: the call failed); limit as in
  // ExecResult::limit, "none" when empty.
  std::map<std::pair<std::string, std::string>, uint64_t> results;
};

class RunPool {
 public:
  RunPool(proto::EdgeLink* edge, RunPoolOptions opts);
  ~RunPool();  // shutdown()
  RunPool(const RunPool&) = delete;
  RunPool& operator=(const RunPool&) = delete;

  // Runs one call (spec.fncallJson holds language and code; the pool adds
  // fresh_dir and exclusive) in a warm sandbox of `key` built from `layers`.
  // Errors: kResourceExhausted when no sandbox frees up within waitSeconds;
  // the sandbox create's or the agent's errors (invalid_argument for a bad
  // call, with its field).
  Result<ExecResult> run(const std::string& key, const std::vector<std::string>& layers,
                         ExecSpec spec);
  // run() whose call holds no thread while it runs: the sandbox is taken on
  // the calling thread (which may wait up to waitSeconds for one, or create
  // it), then `done` runs once with the result, on the blocking pool (or on
  // the calling thread for an error found first). Callers must be on a
  // thread that may block.
  void runAsync(const std::string& key, const std::vector<std::string>& layers, ExecSpec spec,
                std::function<void(Result<ExecResult>)> done);
  RunPoolStats stats() const;
  // The pools' figures (dsec_fncall_*) from stats(); every family is listed,
  // empty or not.
  void writeMetrics(metrics::Writer& w) const;
  // Destroys every sandbox; later calls fail with kUnavailable.
  void shutdown();

 private:
  struct Slot {
    std::string id;
    double lastUsed = 0;
  };
  struct Pool {
    std::vector<std::string> layers;
    std::vector<Slot> idle;  // most recently used last
  };
  Result<Slot> acquire(const std::string& key, const std::vector<std::string>& layers);
  // One try of a call (n: tries so far); retries once on another sandbox.
  void attempt(const std::string& key, const std::vector<std::string>& layers, ExecSpec spec,
               std::function<void(Result<ExecResult>)> done, int n);
  void release(const std::string& key, Slot slot, bool healthy);
  Result<Slot> make(const std::vector<std::string>& layers);
  void destroy(const std::string& id);
  // Sandboxes of `key` idle, busy or being made (mu_ held).
  int sizeOf(const std::string& key) const;
  // Makes one more sandbox for `key` (mu_ held, unlocks around the create).
  void grow(std::unique_lock<std::mutex>& lk, const std::string& key);
  // Destroys idle sandboxes past idleSeconds; grows the pools asked to.
  void janitor();

  proto::EdgeLink* edge_;
  const RunPoolOptions opts_;
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;      // a sandbox came free (callers wait)
  std::condition_variable workCv_;  // work for the janitor: growth, stop
  std::map<std::string, Pool> pools_;
  std::map<std::string, std::vector<std::string>> busyLayers_;  // by sandbox id
  std::map<std::string, std::string> busyKeys_;                 // by sandbox id
  std::map<std::string, int> making_;  // by key: sandboxes being created
  std::vector<std::string> growQueue_;  // keys the janitor should grow
  int total_ = 0;  // idle + busy + being created
  bool stopping_ = false;
  RunPoolStats counters_;
  std::thread janitor_;
};

}  // namespace dsec::platform
