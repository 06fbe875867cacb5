// The Platform's side of a cluster of nodes (platform/cluster.h): lost and
// found sandboxes, records of remote nodes at start, placement fields, and
// the sandbox-state metrics.
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

using json = nlohmann::json;

void Platform::onSandboxLost(const std::string& id, bool lost, const std::string& why) {
  // The store decides: with replicas, our copy may be behind (another replica
  // created, resumed or destroyed it a moment ago).
  if (store_->shared()) refreshSandbox(id);
  SandboxRecord r;
  SandboxState from = SandboxState::kRunning;
  for (int attempt = 0;; ++attempt) {
    bool wasPaused = false;
    {
      std::lock_guard lk(mu_);
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end()) return;
      r = it->second;
      from = r.state;
      if (lost) {
        if (r.state != SandboxState::kRunning && r.state != SandboxState::kPaused) return;
        r.state = SandboxState::kLost;
        r.error = why;
      } else {
        if (r.state != SandboxState::kLost) return;
        // Found again: it ran on while its node was cut off. A paused one is
        // thawed below, so "running" is true.
        r.state = SandboxState::kRunning;
        r.error.clear();
        wasPaused = true;
      }
      r.updatedAt = nowSeconds();
    }
    // Only over the state we saw: a replica that ended it meanwhile wins.
    auto won = store_->casSandbox(r, from);
    if (!won.isOk()) {
      log::error("recording sandbox " + id + " as " + proto::stateName(r.state) + ": " +
                 won.status().toString());
      return;
    }
    if (!*won) {
      if (attempt > 0) return;
      auto cur = store_->getSandbox(id);
      if (!cur.isOk()) return;
      std::lock_guard lk(mu_);
      applyStoredLocked(*cur);
      continue;
    }
    {
      std::lock_guard lk(mu_);
      auto it = sandboxes_.find(id);
      if (it != sandboxes_.end() && it->second.state == from) it->second = r;
      if (!lost) lastCall_[id] = nowSeconds();
    }
    if (wasPaused) (void)cluster_->pause(id, false);
    break;
  }
  stateCv_.notify_all();
  log::warn("sandbox " + id + " is " + proto::stateName(r.state) + (why.empty() ? "" : ": " + why));
}

void Platform::applyStoredLocked(const SandboxRecord& r) {
  auto it = sandboxes_.find(r.id);
  if (it == sandboxes_.end()) {
    // Not one purged here already (the leader deletes it from the store soon).
    if (isFinal(r.state) && r.stoppedAt + opts_.stoppedRetentionS <= nowSeconds()) return;
    sandboxes_[r.id] = r;
    indexLocked(r);
    // A node's heartbeat may have bound it here already: that ends with it.
    if (isFinal(r.state)) {
      cluster_->unbindSandbox(r.id);
    } else {
      bindRemote(r);
    }
    stateCv_.notify_all();
    return;
  }
  SandboxRecord& cur = it->second;
  // A change this replica is making finishes here, and its result wins.
  if (cur.state == SandboxState::kStopping || (cur.state == SandboxState::kCreating && cur.replica == opts_.replicaId)) {
    return;
  }
  if (cur.updatedAt > r.updatedAt || (cur.updatedAt == r.updatedAt && cur.state == r.state)) {
    return;
  }
  bool ended = !isFinal(cur.state) && isFinal(r.state);
  cur = r;
  if (ended) {
    cluster_->unbindSandbox(r.id);
  } else {
    bindRemote(r);
  }
  stateCv_.notify_all();
}

void Platform::refreshSandbox(const std::string& id, bool missingOnly) {
  if (missingOnly) {
    std::lock_guard lk(mu_);
    if (sandboxes_.count(id)) return;
  }
  auto r = store_->getSandbox(id);
  if (!r.isOk()) {
    if (r.status().code() != Code::kNotFound) log::warn("refresh " + id + ": " + r.status().toString());
    return;
  }
  std::lock_guard lk(mu_);
  applyStoredLocked(*r);
}

void Platform::syncSandboxes() {
  std::lock_guard sl(syncMu_);
  // Alone on the store (no other replica's lease live, now or at the last
  // sync), only the watermark moves: there is nothing of others' to read.
  // The clock is read before the leases, so a replica whose lease is taken
  // after the look has its writes after the watermark.
  double before = 0;
  if (auto c = store_->sandboxesChangedSince(1e300, &before); !c.isOk()) {
    log::warn("following other replicas: " + c.status().toString());
    return;
  }
  bool others = true;
  if (auto leases = store_->listLeases(); leases.isOk()) {
    others = false;
    for (auto& l : *leases) {
      if (l.live && startsWith(l.name, "replica:") && l.name.substr(8) != opts_.replicaId) {
        others = true;
      }
    }
  }
  bool wereOthers = othersAlive_.exchange(others);
  if (!others && !wereOthers) {
    syncSince_ = before;
    return;
  }
  double now = 0;
  // A margin behind the last reading: a write stamped before it but
  // committed after it is still read (at worst twice; applying is idempotent).
  auto recs = store_->sandboxesChangedSince(syncSince_ - 2, &now);
  if (!recs.isOk()) {
    log::warn("following other replicas: " + recs.status().toString());
    return;
  }
  {
    std::lock_guard lk(mu_);
    for (auto& r : *recs) applyStoredLocked(r);
  }
  syncSince_ = now;
}

void Platform::reapCreating(const std::vector<std::string>& candidates) {
  if (candidates.empty()) return;
  auto leases = store_->listLeases();
  if (!leases.isOk()) return;
  std::set<std::string> alive;
  for (auto& l : *leases) {
    if (l.live && startsWith(l.name, "replica:")) alive.insert(l.name.substr(8));
  }
  std::vector<std::string> orphans;
  {
    std::lock_guard lk(mu_);
    for (auto& id : candidates) {
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end()) continue;
      const SandboxRecord& r = it->second;
      if (r.state == SandboxState::kCreating && !r.replica.empty() && r.replica != opts_.replicaId &&
          !alive.count(r.replica)) {
        orphans.push_back(id);
      }
    }
  }
  for (auto& id : orphans) {
    SandboxRecord r;
    {
      std::lock_guard lk(mu_);
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end() || it->second.state != SandboxState::kCreating) continue;
      r = it->second;
    }
    std::string replica = r.replica;
    r.state = SandboxState::kFailed;
    r.error = "platform replica " + replica + " died while creating it";
    r.updatedAt = r.stoppedAt = nowSeconds();
    auto won = store_->casSandbox(r, SandboxState::kCreating);
    if (!won.isOk() || !*won) {
      refreshSandbox(id);  // it finished after all, or another leader took it
      continue;
    }
    {
      std::lock_guard lk(mu_);
      sandboxes_[id] = r;
    }
    stateCv_.notify_all();
    // Whatever reached its node is destroyed there: the node's next heartbeat
    // finds no live record for it.
    log::warn("sandbox " + id + ": " + r.error + "; recorded failed");
  }
}

void Platform::shareCalls() {
  std::map<std::string, double> fresh;
  {
    std::lock_guard lk(mu_);
    for (auto it = sharedCalls_.begin(); it != sharedCalls_.end();) {
      it = sandboxes_.count(it->first) ? std::next(it) : sharedCalls_.erase(it);
    }
    for (auto& [id, at] : lastCall_) {
      auto r = sandboxes_.find(id);
      if (r == sandboxes_.end() || (r->second.idleTimeoutS <= 0 && r->second.autoPauseS <= 0)) {
        continue;
      }
      auto s = sharedCalls_.find(id);
      if (s == sharedCalls_.end() || at >= s->second + 1.0) fresh[id] = at;
    }
  }
  if (fresh.empty()) return;
  if (Status st = store_->noteCalls(fresh); !st.isOk()) {
    log::warn("sharing call times: " + st.toString());
    return;
  }
  std::lock_guard lk(mu_);
  for (auto& [id, at] : fresh) sharedCalls_[id] = at;
}

void Platform::dropCalledElsewhere(std::vector<std::string>& idle,
                                   std::vector<std::string>& toPause) {
  std::vector<std::string> ids = idle;
  ids.insert(ids.end(), toPause.begin(), toPause.end());
  if (ids.empty()) return;
  auto calls = store_->lastCalls(ids);
  if (!calls.isOk()) {
    // Not on a guess: the next sweep asks again.
    log::warn("idle timers: " + calls.status().toString());
    idle.clear();
    toPause.clear();
    return;
  }
  double now = nowSeconds();
  std::lock_guard lk(mu_);
  for (auto& [id, at] : *calls) {
    if (at > lastCall_[id]) lastCall_[id] = at;
  }
  auto still = [&](const std::string& id, bool forIdle) {
    auto r = sandboxes_.find(id);
    if (r == sandboxes_.end()) return false;
    double last = std::max(r->second.createdAt, lastCall_[id]);
    int64_t limit = forIdle ? r->second.idleTimeoutS : r->second.autoPauseS;
    return now - last >= double(limit);
  };
  std::erase_if(idle, [&](const std::string& id) { return !still(id, true); });
  std::erase_if(toPause, [&](const std::string& id) { return !still(id, false); });
}

bool Platform::bindRemote(const SandboxRecord& r) {
  bool keep = r.state == SandboxState::kRunning || r.state == SandboxState::kPaused || r.state == SandboxState::kLost;
  if (!keep || !cluster_->isRemoteNode(r.node)) return false;
  proto::SandboxSpec spec;
  spec.id = r.id;
  spec.cpu = r.cpu;
  spec.memoryBytes = r.memoryMb << 20;
  spec.pool = r.pool;
  cluster_->bindSandbox(r.id, r.node, spec);
  return true;
}

Status Platform::parsePlacement(const json& j, SandboxRecord& r) {
  auto pool = getString(j, "pool", "default", 63);
  if (!pool.isOk()) return pool.status();
  if (pool->empty()) return invalidArg("pool", "pool must not be empty");
  for (char c : *pool) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return invalidArg("pool", "pool must be of [A-Za-z0-9._-]: '" + *pool + "'");
    }
  }
  r.pool = *pool;
  if (auto s = j.find("spread"); s != j.end() && !s->is_null()) {
    if (!s->is_boolean()) return invalidArg("spread", "spread must be true or false");
    r.spread = s->get<bool>();
  }
  if (auto b = j.find("burstable"); b != j.end() && !b->is_null()) {
    if (!b->is_boolean()) return invalidArg("burstable", "burstable must be true or false");
    r.burstable = b->get<bool>();
  }
  return Status::ok();
}

void Platform::writeSandboxStateMetrics(metrics::Writer& w) {
  std::map<std::string, int64_t> byState;
  int64_t calls = 0;
  {
    std::lock_guard lk(mu_);
    for (auto& [_, n] : callsInFlight_) calls += n;
  }
  w.gauge("dsec_sandbox_calls_in_flight",
          "Calls on sandboxes under way: execs, process sessions' calls, file transfers.",
          double(calls));
  for (SandboxState s : proto::kAllStates) {
    if (s != SandboxState::kPending) byState[proto::stateName(s)] = 0;
  }
  {
    std::lock_guard lk(mu_);
    for (auto& [_, r] : sandboxes_) byState[proto::stateName(r.state)]++;
  }
  for (auto& [s, n] : byState) {
    w.gauge("dsec_sandboxes", "Sandboxes this platform holds records of, by state.", double(n),
            {{"state", s}});
  }
}

}  // namespace dsec::platform
