// Chronus: calls keyed by (trajectory, step) run once. The first call with a
// key runs and its result is stored durably (before it is returned) with a
// digest of the request; a repeat with the same request gets the stored
// result, marked replayed, without running anything; the same key with a
// different request is a conflict naming both digests. Steps of a trajectory
// may run concurrently; a repeat of a step still in flight waits for it.
//
// The digest covers the kind and the request, never the sandbox: a step may
// be replayed through another sandbox (one a recover made) without conflict.
//
// Only successful results are stored: a call that failed (the sandbox was
// gone, a bad path) is not a step, and its repeat runs again.
//
// A step in flight holds no thread (onceAsync): its work completes it, the
// store write runs on the blocking pool, and a repeat waiting for it is a
// queued callback. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "platform/store.h"

namespace dsec::platform {

struct StepKey {
  std::string trajectory;
  int64_t step = 0;
};

// What a step returns over HTTP.
struct StepOutcome {
  int status = 200;
  std::string contentType;
  std::string body;
  bool replayed = false;
  std::string digest;
  // Set by a live write: the digest of the bytes it kept for re-execution
  // (stored with the step as TrajectoryStep::content).
  std::string content;
};

class Chronus {
 public:
  explicit Chronus(Store* store) : store_(store) {}

  // `trajectory_id` and `step` of a request: both or neither. A trajectory id
  // is 1-128 of [A-Za-z0-9._:-]; a step is an integer >= 0. kInvalidArgument
  // naming the field. The key's trajectory is the id as stored: scoped to
  // the current caller's tenant (scopeTrajectory, platform/tenants.h).
  static Result<std::optional<StepKey>> parseKey(const nlohmann::json* trajectory,
                                                 const nlohmann::json* step);
  // "sha256:<hex>" of the kind and the request (canonical JSON).
  static std::string digestOf(const std::string& kind, const nlohmann::json& request);

  // A step's outcome, delivered once.
  using StepDone = std::function<void(Result<StepOutcome>)>;
  // A step's work: starts it and calls its argument exactly once, from any
  // thread, with the outcome.
  using StepWork = std::function<void(StepDone finish)>;

  // Runs `work` for `key` unless it ran before (see the header comment), and
  // gives `done` the outcome: the stored result (replayed), the live one once
  // it is stored, or the error. kConflict (field "step") when the key is
  // stored or in flight with another digest; the store's errors as they
  // come. `work` starts on the calling thread; `done` runs on the calling
  // thread (a replay, an error found first) or on a blocking-pool thread. The
  // caller must be on a thread that may block (a store read comes first).
  void onceAsync(const StepKey& key, const std::string& kind, const std::string& sandbox,
                 const nlohmann::json& request, StepWork work, StepDone done);
  // onceAsync with `run` as the work, waited for (worker threads only).
  Result<StepOutcome> once(const StepKey& key, const std::string& kind, const std::string& sandbox,
                           const nlohmann::json& request,
                           const std::function<Result<StepOutcome>()>& run);

 private:
  Status conflict(const StepKey& key, const std::string& stored, const std::string& asked) const;
  // onceAsync; with finishInline the outcome is stored on the thread that
  // completes the work (once(): the caller's), else on the blocking pool.
  void start(const StepKey& key, const std::string& kind, const std::string& sandbox,
             const nlohmann::json& request, StepWork work, StepDone done, bool finishInline);
  // Stores a live outcome (blocking pool), then answers `done` and wakes
  // the repeats that waited for the key.
  void finishStep(const StepKey& key, const std::string& kind, const std::string& sandbox,
                  const nlohmann::json& request, const std::string& digest, double started,
                  Result<StepOutcome> out, const StepDone& done);

  struct Inflight {
    std::string digest;
    std::vector<std::function<void()>> waiters;  // repeats, run again once it ends
  };
  Store* store_;
  std::mutex mu_;  // guards inflight_
  std::map<std::pair<std::string, int64_t>, Inflight> inflight_;
};

}  // namespace dsec::platform
