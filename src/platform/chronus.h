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
// gone, a bad path) is not a step, and its repeat runs again. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

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

  // Runs `run` for `key` unless it ran before (see the header comment).
  // kConflict (field "step") when the key is stored or in flight with another
  // digest; the store's errors as they come.
  Result<StepOutcome> once(const StepKey& key, const std::string& kind, const std::string& sandbox,
                           const nlohmann::json& request,
                           const std::function<Result<StepOutcome>()>& run);

 private:
  Status conflict(const StepKey& key, const std::string& stored, const std::string& asked) const;

  Store* store_;
  std::mutex mu_;  // guards inflight_
  std::condition_variable cv_;
  std::map<std::pair<std::string, int64_t>, std::string> inflight_;  // key -> digest
};

}  // namespace dsec::platform
