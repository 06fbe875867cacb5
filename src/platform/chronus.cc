#include "platform/chronus.h"

#include <future>
#include <memory>
#include <mutex>

#include "common/runtime.h"
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

void Chronus::onceAsync(const StepKey& key, const std::string& kind, const std::string& sandbox,
                        const json& request, StepWork work, StepDone done) {
  start(key, kind, sandbox, request, std::move(work), std::move(done), false);
}

void Chronus::start(const StepKey& key, const std::string& kind, const std::string& sandbox,
                    const json& request, StepWork work, StepDone done, bool finishInline) {
  const std::string digest = digestOf(kind, request);
  const auto k = std::make_pair(key.trajectory, key.step);
  {
    std::lock_guard lk(mu_);
    auto it = inflight_.find(k);
    if (it != inflight_.end()) {
      if (it->second.digest != digest) return done(conflict(key, it->second.digest, digest));
      // The first call is running: once it ends this one looks again (its
      // stored result, or its turn to run when the first one failed).
      it->second.waiters.push_back([this, key, kind, sandbox, request, work = std::move(work),
                                    done = std::move(done), finishInline]() mutable {
        start(key, kind, sandbox, request, std::move(work), std::move(done), finishInline);
      });
      return;
    }
    auto stored = store_->getStep(key.trajectory, key.step);
    if (stored.isOk()) {
      if (stored->digest != digest) return done(conflict(key, stored->digest, digest));
      return done(StepOutcome{stored->status, stored->contentType, stored->body, true, digest});
    }
    if (stored.status().code() != Code::kNotFound) return done(stored.status());
    inflight_[k].digest = digest;
  }
  double started = nowSeconds();
  auto once = std::make_shared<std::once_flag>();
  work([this, key, kind, sandbox, request, digest, started, done = std::move(done), once,
        finishInline](Result<StepOutcome> out) mutable {
    std::call_once(*once, [&] {
      auto shared = std::make_shared<Result<StepOutcome>>(std::move(out));
      auto finish = [this, key, kind, sandbox, request, digest, started, done, shared] {
        finishStep(key, kind, sandbox, request, digest, started, std::move(*shared), done);
      };
      // Storing blocks (fsync, a PostgreSQL round trip): not on the thread
      // that completed an async work, which may be an io thread.
      if (finishInline || !Runtime::global().runBlocking(finish)) finish();
    });
  });
}

void Chronus::finishStep(const StepKey& key, const std::string& kind, const std::string& sandbox,
                         const json& request, const std::string& digest, double started,
                         Result<StepOutcome> out, const StepDone& done) {
  Status stored;
  if (out.isOk() && out->status >= 200 && out->status < 300) {
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
    stored = store_->putStep(s);
    out->digest = digest;
    out->replayed = false;
  }
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard lk(mu_);
    auto it = inflight_.find(std::make_pair(key.trajectory, key.step));
    if (it != inflight_.end()) {
      waiters = std::move(it->second.waiters);
      inflight_.erase(it);
    }
  }
  if (!stored.isOk()) {
    done(stored.withContext("record the step"));
  } else {
    done(std::move(out));
  }
  for (auto& w : waiters) w();
}

Result<StepOutcome> Chronus::once(const StepKey& key, const std::string& kind,
                                  const std::string& sandbox, const json& request,
                                  const std::function<Result<StepOutcome>()>& run) {
  // The work runs here and the step is stored here: a caller on the
  // blocking pool never waits for another pool thread. A repeat of a step in
  // flight waits for it (its retry runs on the thread that ends the first).
  std::promise<Result<StepOutcome>> p;
  auto f = p.get_future();
  start(
      key, kind, sandbox, request, [&run](StepDone finish) { finish(run()); },
      [&p](Result<StepOutcome> out) { p.set_value(std::move(out)); }, true);
  return f.get();
}

}  // namespace dsec::platform
