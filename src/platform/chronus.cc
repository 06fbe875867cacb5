#include "platform/chronus.h"

#include "common/sha256.h"
#include "common/util.h"
#include "platform/tenants.h"

namespace dsec::platform {

using json = nlohmann::json;

Result<std::optional<StepKey>> Chronus::parseKey(const json* trajectory, const json* step) {
  bool hasT = trajectory && !trajectory->is_null();
  bool hasS = step && !step->is_null();
  if (!hasT && !hasS) return std::optional<StepKey>();
  if (!hasT) return invalidArg("trajectory_id", "step needs a trajectory_id");
  if (!hasS) return invalidArg("step", "trajectory_id needs a step");
  if (!trajectory->is_string())
    return invalidArg("trajectory_id", "trajectory_id must be a string");
  std::string t = trajectory->get<std::string>();
  if (t.empty() || t.size() > 128 ||
      t.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-") !=
          std::string::npos) {
    return invalidArg("trajectory_id", "trajectory_id must be 1-128 of A-Z a-z 0-9 . _ : -");
  }
  if (!step->is_number_integer() || step->get<int64_t>() < 0) {
    return invalidArg("step", "step must be an integer >= 0");
  }
  // Ids are per tenant: the key is the caller's (platform/tenants.h).
  return std::optional<StepKey>(StepKey{scopeTrajectory(currentCaller(), t), step->get<int64_t>()});
}

std::string Chronus::digestOf(const std::string& kind, const json& request) {
  // nlohmann's objects are ordered maps: dump() is canonical.
  return "sha256:" + sha256Hex(kind + "\n" + request.dump());
}

Status Chronus::conflict(const StepKey& key, const std::string& stored,
                         const std::string& asked) const {
  return Status(Code::kConflict,
                "step " + std::to_string(key.step) + " of trajectory " + key.trajectory + " was " +
                    stored + "; this request is " + asked +
                    " (a different call under the same key is never run)",
                0, "step");
}

Result<StepOutcome> Chronus::once(const StepKey& key, const std::string& kind,
                                  const std::string& sandbox, const json& request,
                                  const std::function<Result<StepOutcome>()>& run) {
  const std::string digest = digestOf(kind, request);
  const auto k = std::make_pair(key.trajectory, key.step);
  {
    std::unique_lock lk(mu_);
    for (;;) {
      auto it = inflight_.find(k);
      if (it == inflight_.end()) break;
      if (it->second != digest) return conflict(key, it->second, digest);
      cv_.wait(lk);  // the first call is running: its result is ours
    }
    auto stored = store_->getStep(key.trajectory, key.step);
    if (stored.isOk()) {
      if (stored->digest != digest) return conflict(key, stored->digest, digest);
      return StepOutcome{stored->status, stored->contentType, stored->body, true, digest};
    }
    if (stored.status().code() != Code::kNotFound) return stored.status();
    inflight_[k] = digest;
  }
  auto done = [&] {
    std::lock_guard lk(mu_);
    inflight_.erase(k);
    cv_.notify_all();
  };
  double started = nowSeconds();
  auto out = run();
  if (!out.isOk() || out->status < 200 || out->status >= 300) {
    done();
    return out;
  }
  TrajectoryStep s;
  s.trajectory = key.trajectory;
  s.step = key.step;
  s.digest = digest;
  s.kind = kind;
  s.sandbox = sandbox;
  s.request = request.dump();
  s.status = out->status;
  s.contentType = out->contentType;
  s.body = out->body;
  s.startedAt = started;
  s.finishedAt = nowSeconds();
  s.content = out->content;
  // Durable before it is acknowledged: a repeat after a crash replays it.
  Status st = store_->putStep(s);
  done();
  if (!st.isOk()) return st.withContext("record the step");
  out->digest = digest;
  out->replayed = false;
  return out;
}

}  // namespace dsec::platform
