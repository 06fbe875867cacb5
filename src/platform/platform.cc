#include "platform/platform.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/cluster.h"

namespace dsec::platform {

using json = nlohmann::json;

void sendJson(http::Response& res, int status, const std::string& body) {
  (void)res.send(status, "application/json", body);
}

std::string errorBody(const Status& st) {
  json e = {{"code", codeName(st.code())}, {"message", st.message()}};
  if (!st.field().empty()) e["field"] = st.field();
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::pair<int, std::string> errorAnswer(const Status& st) {
  countApiError(st.code());  // dsec_api_errors_total (platform/cluster.h)
  return {httpStatusFor(st.code()), errorBody(st)};
}

void sendError(http::Response& res, const Status& st) {
  auto [status, body] = errorAnswer(st);
  if (res.started()) return;  // mid-stream: nothing sensible can be added
  sendJson(res, status, body);
}

void sendError(http::Deferred& d, const Status& st) {
  auto [status, body] = errorAnswer(st);
  sendJson(d, status, body);
}

void sendJson(http::Deferred& d, int status, const std::string& body) {
  (void)d.send(status, "application/json", body);
}

Status parseImageRef(const std::string& ref, std::string& name, std::string& tag) {
  size_t colon = ref.rfind(':');
  size_t slash = ref.rfind('/');
  if (colon != std::string::npos && (slash == std::string::npos || colon > slash)) {
    name = ref.substr(0, colon);
    tag = ref.substr(colon + 1);
  } else {
    name = ref;
    tag = "latest";
  }
  auto validPart = [](const std::string& s, size_t max) {
    if (s.empty() || s.size() > max) return false;
    for (char c : s) {
      if (!(isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
            c == '/')) {
        return false;
      }
    }
    return s.front() != '.' && s.front() != '-' && s.front() != '/';
  };
  // A name pulled from a registry starts with its host, which may carry a
  // port ("127.0.0.1:5000/app"): the one ':' a name may hold.
  std::string checked = name;
  if (size_t slash = name.find('/'), colon = name.find(':');
      colon != std::string::npos && slash != std::string::npos && colon < slash) {
    std::string port = name.substr(colon + 1, slash - colon - 1);
    bool digits = !port.empty() && port.size() <= 5 &&
                  std::all_of(port.begin(), port.end(), [](char c) { return isdigit(c) != 0; });
    if (digits && colon > 0) checked = name.substr(0, colon) + name.substr(slash);
  }
  if (!validPart(checked, 200) || name.size() > 200) {
    return invalidArg("image", "invalid image name '" + ref + "'");
  }
  if (!validPart(tag, 128) || tag.find('/') != std::string::npos) {
    return invalidArg("image", "invalid image tag in '" + ref + "'");
  }
  return Status::ok();
}

std::string Platform::blobPath(const std::string& dataDir, const std::string& digest) {
  return dataDir + "/blobs/sha256/" + (startsWith(digest, "sha256:") ? digest.substr(7) : digest);
}

Result<std::unique_ptr<Platform>> Platform::start(PlatformOptions opts, Store* store,
                                                  Cluster* cluster) {
  std::unique_ptr<Platform> p(new Platform());
  p->opts_ = std::move(opts);
  p->store_ = store;
  p->cluster_ = cluster;
  Cluster* edge = cluster;
  RETURN_IF_ERROR(makeDirs(p->opts_.dataDir + "/blobs/sha256", 0700));
  RETURN_IF_ERROR(validateEgress(p->opts_.setupEgress, "setup_egress"));
  RETURN_IF_ERROR(validateDns(p->opts_.setupDns, "setup_dns"));
  ASSIGN_OR_RETURN(p->policies_,
                   Policies::open(store, builtinPolicies(p->opts_.setupEgress, p->opts_.setupDns)));
  p->chronus_ = std::make_unique<Chronus>(store);
  ASSIGN_OR_RETURN(p->tenants_, Tenants::open(store, p->opts_.token));
  ASSIGN_OR_RETURN(auto records, store->loadSandboxes());
  // Batches carry on: their pending sandboxes are created (under fresh ids).
  RETURN_IF_ERROR(p->resumeBatches(records));
  double now = nowSeconds();
  int lost = 0, kept = 0;
  // What the edge re-adopted from its predecessor (this process restarted:
  // crashed, or stopped with live restore) carries on as recorded.
  std::vector<std::string> adoptedList;
  if (auto* local = cluster->localNode()) adoptedList = local->report().adopted;
  std::set<std::string> adopted(adoptedList.begin(), adoptedList.end());
  for (auto& r : records) {
    // A batch's, resumed above; or another live replica's create in flight
    // (docs/cluster.md): it finishes it, or the leader fails it if that
    // replica dies.
    if (r.state == SandboxState::kPending ||
        (store->shared() && r.state == SandboxState::kCreating && r.replica != p->opts_.replicaId)) {
      p->sandboxes_[r.id] = r;
      continue;
    }
    if (p->bindRemote(r)) {
      p->lastCall_[r.id] = now;
      p->sandboxes_[r.id] = r;
      ++kept;
      continue;
    }
    bool live = r.state == SandboxState::kRunning || r.state == SandboxState::kPaused;
    if (live && adopted.erase(r.id)) {
      // The record decides: a pause or resume the crash cut short is redone.
      if (Status st = edge->pause(r.id, r.state == SandboxState::kPaused); !st.isOk()) {
        log::warn("sandbox " + r.id + ": " + st.toString());
      }
      p->lastCall_[r.id] = now;  // idle time counts from the restart
      ++kept;
    } else if (r.state != SandboxState::kStopped && r.state != SandboxState::kFailed) {
      // The edge came up without it, or it was half made or half destroyed
      // (never acknowledged as running): it is gone.
      if (adopted.erase(r.id)) (void)edge->destroy(r.id);
      r.error = "lost: the node restarted while the sandbox was " + std::string(proto::stateName(r.state));
      r.state = SandboxState::kFailed;
      r.updatedAt = r.stoppedAt = now;
      RETURN_IF_ERROR(store->putSandbox(r));
      ++lost;
    }
    p->sandboxes_[r.id] = r;
  }
  for (auto& [_, r] : p->sandboxes_) p->indexLocked(r);  // no other thread yet
  // Sandboxes the edge still ran that no record owns as live.
  for (auto& id : adopted) {
    log::warn("sandbox " + id + " has no record here; destroying it");
    (void)edge->destroy(id);
    ++p->orphanSandboxes_;
  }
  if (kept) log::info("carrying on with " + std::to_string(kept) + " sandboxes of an earlier run");
  if (lost) log::warn("marked " + std::to_string(lost) + " sandboxes of an earlier run as lost");
  edge->setDeathHandler([raw = p.get()](const std::string& id, const std::string& why) {
    raw->onSandboxDeath(id, why);
  });
  edge->setLostHandler([raw = p.get()](const std::string& id, bool lost, const std::string& why) {
    raw->onSandboxLost(id, lost, why);
  });
  if (store->shared()) {
    // Where following other replicas' writes starts: the store's clock now.
    ASSIGN_OR_RETURN(auto none, store->sandboxesChangedSince(1e300, &p->syncSince_));
    (void)none;
  }
  p->janitorThread_ = std::thread([raw = p.get()] { raw->janitor(); });
  p->batchThreads_.emplace_back([raw = p.get()] { raw->batchCommitter(); });
  {
    // Workers start as batches come (growBatchWorkersLocked).
    std::lock_guard lk(p->batchMu_);
    p->growBatchWorkersLocked();
  }
  p->runPool_ = std::make_unique<RunPool>(cluster, p->opts_.runPool);
  // Conversions may start before the chunk keys are in: until then every
  // lookup asks the store, as with no set at all.
  p->chunkKeys_.startLoading(store);
  p->startPulls();
  {
    auto po = std::make_shared<http::ProxyOptions>();
    po->onExchange = [raw = p.get()](int status, uint64_t, uint64_t) {
      if (status > 0) raw->portResponses_.inc(std::to_string(status));
    };
    p->proxyOpts_ = std::move(po);
  }
  if (!p->opts_.registry) p->opts_.registry = &metrics::Registry::global();
  p->metricsId_ =
      p->opts_.registry->add([raw = p.get()](metrics::Writer& w) { raw->writeMetrics(w); });
  p->history_ = std::make_unique<MetricsHistory>(
      [reg = p->opts_.registry] { return reg->render(); }, p->opts_.metricsHistoryIntervalS);
  return p;
}

void Platform::stopBatches() {
  {
    std::lock_guard lk(batchMu_);
    batchStop_ = true;
  }
  batchCv_.notify_all();
  commitCv_.notify_all();
  // Workers finish the create they are in; the committer stores every outcome.
  for (auto& t : batchThreads_) t.join();
  batchThreads_.clear();
}

Platform::~Platform() {
  // First: a scrape under way ends before anything it reads goes.
  history_.reset();
  if (metricsId_) opts_.registry->remove(metricsId_);
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  janitorCv_.notify_all();
  if (janitorThread_.joinable()) janitorThread_.join();
  stopBatches();
  pulls_.reset();  // its workers call back into the platform
}

void Platform::shutdown() {
  // The signal thread and the main thread may both get here.
  std::lock_guard once(shutdownMu_);
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  janitorCv_.notify_all();
  if (janitorThread_.joinable()) janitorThread_.join();
  stopBatches();
  // Pool sandboxes have no records: they never outlive the platform.
  if (runPool_) runPool_->shutdown();
  if (opts_.liveRestore) return;  // they carry on; the next start re-adopts them
  std::vector<std::string> live;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, r] : sandboxes_) {
      // Remote nodes' sandboxes outlive a platform restart (docs/cluster.md).
      if ((r.state == SandboxState::kRunning || r.state == SandboxState::kPaused) && !cluster_->isRemoteNode(r.node)) {
        live.push_back(id);
      }
    }
    // Creates in flight see stopping_ and undo themselves.
  }
  for (auto& id : live) {
    auto st = destroy(id, SandboxState::kStopped, "");
    if (!st.isOk()) log::error("shutdown: destroy " + id + ": " + st.status().toString());
  }
}

Result<SandboxRecord> Platform::destroy(const std::string& id, SandboxState finalState,
                                        const std::string& why) {
  {
    std::unique_lock lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    if (it->second.state == SandboxState::kCreating) deleteRequested_.insert(id);
    if (it->second.state == SandboxState::kCreating || it->second.state == SandboxState::kStopping) {
      // Someone else finishes it; wait for the outcome. (Another replica's
      // create ends in a live record here, which is then ours to destroy.)
      stateCv_.wait(lk, [&] {
        auto cur = sandboxes_.find(id);
        return cur == sandboxes_.end() || (cur->second.state != SandboxState::kCreating &&
                                           cur->second.state != SandboxState::kStopping);
      });
      it = sandboxes_.find(id);
      if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
      if (isFinal(it->second.state)) return it->second;
    }
    if (isFinal(it->second.state)) return it->second;
    it->second.state = SandboxState::kStopping;
  }
  Status edgeSt = cluster_->destroy(id);
  if (!edgeSt.isOk()) log::error("destroy " + id + ": " + edgeSt.toString());
  processes_->dropSandbox(id);
  SandboxRecord rec;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    auto& r = it->second;
    r.state = finalState;
    if (!why.empty()) r.error = why;
    if (!edgeSt.isOk() && r.error.empty()) r.error = "cleanup: " + edgeSt.message();
    r.updatedAt = r.stoppedAt = nowSeconds();
    rec = r;
  }
  stateCv_.notify_all();
  RETURN_IF_ERROR(store_->putSandbox(rec));
  return rec;
}

void Platform::autoPause(const std::string& id) {
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || it->second.state != SandboxState::kRunning) return;
  }
  if (Status st = cluster_->pause(id, true); !st.isOk()) {
    log::error("auto-pause " + id + ": " + st.toString());
    return;
  }
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return;
    if (it->second.state != SandboxState::kRunning) {
      // Destroyed or resumed meanwhile: a call won; thaw if it still exists.
      lastCall_[id] = nowSeconds();
      if (it->second.state == SandboxState::kPaused) return;
      (void)cluster_->pause(id, false);
      return;
    }
    it->second.state = SandboxState::kPaused;
    it->second.updatedAt = nowSeconds();
    r = it->second;
  }
  if (Status st = store_->putSandbox(r); !st.isOk())
    log::error("auto-pause " + id + ": " + st.toString());
  log::info("sandbox " + id + ": paused after " + std::to_string(r.autoPauseS) + " s idle");
}

void Platform::onSandboxDeath(const std::string& id, const std::string& why) {
  if (store_->shared()) refreshSandbox(id);  // placed through another replica?
  auto st = destroy(id, SandboxState::kFailed, why);
  if (!st.isOk()) log::error("recording death of " + id + ": " + st.status().toString());
}

void Platform::janitor() {
  double lastGc = nowSeconds();
  double lastFullWalk = 0;
  std::unique_lock lk(mu_);
  while (!stopping_) {
    janitorCv_.wait_for(lk, std::chrono::seconds(1));
    if (stopping_) break;
    if (nowSeconds() >= nextPortExpiry_) {
      lk.unlock();
      expirePorts();
      lk.lock();
    }
    double now = nowSeconds();
    // A call under way is activity right now (and is shared as such with the
    // other replicas by shareCalls below).
    for (auto& [id, n] : callsInFlight_) lastCall_[id] = now;
    std::vector<std::string> expired, purge, idle, toPause, othersCreating;
    // Each second, the TTLs that ended (expiry_) and the records with an idle
    // timeout or auto-pause (timed_); every kFullWalkS, all records, in
    // slices of kJanitorSlice letting go of mu_ between them (at 380,000 live
    // sandboxes one pass under the lock would stall every create and call for
    // a good part of a second): retention purges, other replicas' creates for
    // reapCreating, and any timer not indexed. Each decision is re-checked by
    // the destroy or pause that acts on it.
    // A lost sandbox (its node is down) keeps its TTL and idle timeout.
    auto live = [](const SandboxRecord& r) {
      return r.state == SandboxState::kRunning || r.state == SandboxState::kPaused || r.state == SandboxState::kLost;
    };
    auto idleTimers = [&](const std::string& id, const SandboxRecord& r) {
      auto lc = lastCall_.find(id);
      double last = lc == lastCall_.end() ? r.createdAt : std::max(r.createdAt, lc->second);
      if (live(r) && r.idleTimeoutS > 0 && now - last >= double(r.idleTimeoutS)) {
        idle.push_back(id);
      } else if (r.state == SandboxState::kRunning && r.autoPauseS > 0 && now - last >= double(r.autoPauseS)) {
        toPause.push_back(id);
      }
    };
    std::vector<std::string> again;  // TTL over, not final yet: looked at again in a second
    while (!expiry_.empty() && expiry_.top().first <= now) {
      std::string id = expiry_.top().second;
      expiry_.pop();
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end() || isFinal(it->second.state)) continue;
      const SandboxRecord& r = it->second;
      if (r.expiresAt > now) {
        expiry_.emplace(r.expiresAt, id);
        continue;
      }
      // Not yet created, or being destroyed: its turn comes; a destroy that
      // failed is tried again.
      if (live(r)) expired.push_back(id);
      again.push_back(std::move(id));
    }
    for (auto& id : again) expiry_.emplace(now + 1, std::move(id));
    // Entries of records destroyed before their TTL stay until it ends (up to
    // a week); when they outnumber the records, the heap is built afresh.
    if (expiry_.size() > 2 * sandboxes_.size() + 4096) {
      std::vector<Deadline> keep;
      for (auto& [id, r] : sandboxes_) {
        if (r.expiresAt > 0 && !isFinal(r.state)) keep.emplace_back(r.expiresAt, id);
      }
      expiry_ = decltype(expiry_)(std::greater<Deadline>(), std::move(keep));
    }
    for (auto t = timed_.begin(); t != timed_.end();) {
      auto it = sandboxes_.find(*t);
      if (it == sandboxes_.end() || isFinal(it->second.state)) {
        t = timed_.erase(t);  // over: no timer applies any more
        continue;
      }
      idleTimers(*t, it->second);
      ++t;
    }
    if (now - lastFullWalk >= kFullWalkS) {
      lastFullWalk = now;
      std::string from;
      bool first = true;
      std::vector<std::pair<double, std::string>> stopped;  // kept by time: for the count bound
      // A stopped record past retention goes from memory now, from the
      // store below (purge).
      auto forget = [&](std::map<std::string, SandboxRecord>::iterator it) {
        purge.push_back(it->first);
        lastCall_.erase(it->first);
        timed_.erase(it->first);
        return sandboxes_.erase(it);
      };
      for (;;) {
        auto it = first ? sandboxes_.begin() : sandboxes_.lower_bound(from);
        first = false;
        size_t k = 0;
        for (; it != sandboxes_.end() && k < kJanitorSlice; ++k) {
          const std::string& id = it->first;
          SandboxRecord& r = it->second;
          if (r.state == SandboxState::kCreating && !r.replica.empty() && r.replica != opts_.replicaId) {
            othersCreating.push_back(id);  // for reapCreating (leader, replicas)
          }
          bool fin = isFinal(r.state);
          if (fin && r.stoppedAt + opts_.stoppedRetentionS <= now) {
            it = forget(it);
            continue;
          }
          if (fin) stopped.emplace_back(r.stoppedAt, id);
          if (live(r) && r.expiresAt > 0 && r.expiresAt <= now) expired.push_back(id);
          if (!fin && !timed_.count(id) && (r.idleTimeoutS > 0 || r.autoPauseS > 0)) {
            timed_.insert(id);
            idleTimers(id, r);
          }
          ++it;
        }
        if (it == sandboxes_.end() || stopping_) break;
        from = it->first;  // the next one to look at (or what follows it, if it goes)
        lk.unlock();
        lk.lock();
      }
      // Past the count bound, the longest stopped go (re-checked: a record
      // may have gone or changed while the lock was let go).
      if (stopped.size() > opts_.stoppedRetentionMax) {
        size_t over = stopped.size() - opts_.stoppedRetentionMax;
        std::nth_element(stopped.begin(), stopped.begin() + long(over - 1), stopped.end());
        for (size_t i = 0; i < over; ++i) {
          auto it = sandboxes_.find(stopped[i].second);
          if (it != sandboxes_.end() && isFinal(it->second.state)) forget(it);
        }
      }
    }
    // Found by expiry_ and by the walk alike: destroyed once.
    std::sort(expired.begin(), expired.end());
    expired.erase(std::unique(expired.begin(), expired.end()), expired.end());
    lk.unlock();
    if (store_->shared()) {
      syncSandboxes();
      shareCalls();
    }
    // With replicas only the leader sweeps (the others' lists are cleared).
    bool leader = isLeader();
    if (leader && store_->shared()) reapCreating(othersCreating);
    if (store_->shared()) renewBatchClaims();
    lk.lock();
    if (!leader) expired.clear(), idle.clear(), toPause.clear();
    bool gcDue = leader && now - lastGc >= opts_.gcIntervalS;
    if (gcDue) lastGc = now;
    lk.unlock();
    if (gcDue) {
      auto removed = collectGarbage(opts_.gcGraceS);
      if (!removed.isOk()) log::error("gc: " + removed.status().toString());
      if (opts_.trajectoryRetentionS > 0) {
        auto n = store_->deleteTrajectoriesBefore(now - opts_.trajectoryRetentionS);
        if (!n.isOk()) log::error("trajectory retention: " + n.status().toString());
        if (n.isOk() && *n > 0) log::info("retention: deleted " + std::to_string(*n) + " steps");
      }
    }
    if (leader) {
      for (auto& id : purge) (void)store_->deleteSandbox(id);
    }
    if (leader && store_->shared()) dropCalledElsewhere(idle, toPause);
    for (auto& id : expired) {
      log::info("sandbox " + id + ": TTL expired");
      auto st = destroy(id, SandboxState::kStopped, "ttl expired");
      if (!st.isOk()) log::error("ttl destroy " + id + ": " + st.status().toString());
    }
    for (auto& id : idle) {
      log::info("sandbox " + id + ": idle timeout");
      auto st = destroy(id, SandboxState::kStopped, "idle timeout");
      if (!st.isOk()) log::error("idle destroy " + id + ": " + st.status().toString());
    }
    for (auto& id : toPause) autoPause(id);
    lk.lock();
  }
}

Result<SandboxRecord> Platform::runningSandbox(const std::string& id) {
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    if (it->second.state == SandboxState::kRunning) {
      lastCall_[id] = nowSeconds();
      return it->second;
    }
    if (it->second.state != SandboxState::kPaused) {
      return Status(Code::kFailedPrecondition,
                    "sandbox " + id + " is " + proto::stateName(it->second.state) + ", not running");
    }
  }
  // A call to a paused sandbox resumes it first.
  RETURN_IF_ERROR(cluster_->pause(id, false).withContext("resume " + id));
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    if (it->second.state == SandboxState::kPaused) {
      it->second.state = SandboxState::kRunning;
      it->second.pausedTo.clear();
    }
    if (it->second.state != SandboxState::kRunning) {
      return Status(Code::kFailedPrecondition,
                    "sandbox " + id + " is " + proto::stateName(it->second.state) + ", not running");
    }
    it->second.updatedAt = nowSeconds();
    lastCall_[id] = nowSeconds();
    r = it->second;
  }
  RETURN_IF_ERROR(store_->putSandbox(r));
  log::info("sandbox " + id + " resumed by a call");
  return r;
}

std::shared_ptr<void> Platform::holdActivity(const std::string& id) {
  struct Activity {
    Platform* p;
    std::string id;
    Activity(Platform* p, std::string i) : p(p), id(std::move(i)) {
      std::lock_guard lk(p->mu_);
      ++p->callsInFlight_[id];
    }
    ~Activity() {
      std::lock_guard lk(p->mu_);
      if (--p->callsInFlight_[id] <= 0) p->callsInFlight_.erase(id);
      if (p->sandboxes_.count(id)) p->lastCall_[id] = nowSeconds();  // not for a purged one
    }
  };
  return std::make_shared<Activity>(this, id);
}

void Platform::handle(http::Request& req, http::Response& res) {
  if (req.path == "/v1/health" && req.method == "GET") {
    sendJson(res, 200, R"({"status":"ok","version":"0.1.0"})");
    return;
  }
  // E2B's SDKs (docs/e2b.md): their own credentials and error shapes.
  if (startsWith(req.path, "/e2b/api/") || startsWith(req.path, "/e2b/envd/")) {
    auto parts = splitString(req.path, '/');  // "", "e2b", "api"|"envd", ...
    std::vector<std::string> rest(parts.begin() + 3, parts.end());
    if (parts[2] == "api") return e2bControl(rest, req, res);
    return e2bEnvd(rest, req, res);
  }
  std::string auth = req.header("authorization");
  auto caller =
      startsWith(auth, "Bearer ")
          ? tenants_->authenticate(std::string_view(auth).substr(7))
          : Result<Caller>(Status(Code::kUnauthenticated,
                                  auth.empty() ? "missing bearer token" : "invalid bearer token"));
  if (!caller.isOk()) {
    if (caller.status().code() == Code::kUnauthenticated) {
      res.setHeader("WWW-Authenticate", "Bearer");
    }
    sendError(res, caller.status());
    return;
  }
  CallerScope scope(*caller);
  auto parts = splitString(req.path, '/');  // "", "v1", ...
  if (parts.size() < 3 || parts[1] != "v1") {
    sendError(res, notFound("no such endpoint: " + req.path));
    return;
  }
  // Another replica may have made or changed it (docs/cluster.md).
  if (store_->shared() && parts[2] == "sandboxes" && parts.size() >= 4) {
    refreshSandbox(parts[3], !othersAlive_);
  }
  if (Status st = authorize(parts, req.method); !st.isOk()) return sendError(res, st);
  // Trajectory ids are per tenant (platform/tenants.h).
  if (parts[2] == "trajectories" && parts.size() >= 4) {
    parts[3] = scopeTrajectory(*caller, parts[3]);
  }
  const std::string& m = req.method;
  const std::string& coll = parts[2];
  size_t n = parts.size();
  auto methodNotAllowed = [&] { sendError(res, platform::methodNotAllowed(req)); };
  if (coll == "sandboxes") {
    if (n == 3) {
      if (m == "POST") return createSandbox(req, res);
      if (m == "GET") return listSandboxes(req, res);
      if (m == "DELETE") return destroyMatching(req, res);  // api_batches.cc
      return methodNotAllowed();
    }
    const std::string& id = parts[3];
    // Every call on a sandbox's sub-resources is activity, from its first byte
    // to its last (idle timeout and auto-pause, platform.h callsInFlight_).
    // Shared: an exec answered later holds it until it ends.
    std::shared_ptr<void> activity;
    // Reading its figures (a console page open on it) is not using it.
    if (n >= 5 && !(n == 5 && parts[4] == "stats")) activity = holdActivity(id);
    if (n == 4) {
      if (m == "GET") return getSandbox(id, res);
      if (m == "DELETE") return deleteSandbox(id, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "run") {  // fncall (api_run.cc)
      if (m == "POST") return runInSandbox(id, req, res, std::move(activity));
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "exec") {
      if (m == "POST") return execSandbox(id, req, res, std::move(activity));
      return methodNotAllowed();
    }
    if (parts[4] == "processes" && n <= 7) {  // api_processes.cc
      return processesApi(id, parts, req, res, std::move(activity));
    }
    if (n == 5 && (parts[4] == "pause" || parts[4] == "resume")) {
      if (m == "POST") return pauseSandbox(id, parts[4] == "pause", req, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "phase") {
      if (m == "POST") return setPhase(id, req, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "audit") {
      if (m == "GET") return getAudit(id, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "stats") {
      if (m == "GET") return getStats(id, req, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "screenshot") {  // backend vm (api_computer.cc)
      if (m == "GET") return screenshot(id, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "input") {
      if (m == "POST") return sendInput(id, req, res);
      return methodNotAllowed();
    }
    if (n == 5 && parts[4] == "pack_diff") {
      if (m == "POST") return packDiff(id, req, res);
      return methodNotAllowed();
    }
    if (parts[4] == "files" && n <= 6) return files(id, n == 6 ? parts[5] : "", req, res);
    if (parts[4] == "ports" && n <= 6) return portsApi(id, parts, req, res);  // api_ports.cc
  } else if (coll == "batches") {  // api_batches.cc
    return batchesApi(parts, req, res);
  } else if (coll == "run" && n == 3) {  // fncall one-shot calls (api_run.cc)
    if (m == "POST") return runCode(req, res);
    return methodNotAllowed();
  } else if (coll == "blobs" && n == 4) {
    if (m == "PUT") return putBlob(parts[3], req, res);
    if (m == "HEAD" || m == "GET") return headBlob(parts[3], res);
    return methodNotAllowed();
  } else if (coll == "layers") {
    if (n == 3 && m == "GET") return listLayers(res);
    if (n == 4 && m == "GET") return getLayer(parts[3], res);
    if (n == 4 && m == "DELETE") return deleteLayer(parts[3], res);
    return methodNotAllowed();
  } else if (coll == "trajectories" && n == 3) {
    if (m == "GET") return listTrajectories(res);
    return methodNotAllowed();
  } else if (coll == "trajectories" && n == 4) {
    if (m == "GET") return exportTrajectory(parts[3], res);
    if (m == "DELETE") return deleteTrajectory(parts[3], res);
    return methodNotAllowed();
  } else if (coll == "trajectories" && n == 5 && parts[4] == "info") {
    if (m == "GET") return trajectoryInfo(parts[3], res);
    return methodNotAllowed();
  } else if (coll == "trajectories" && n == 5 && parts[4] == "recover") {
    if (m == "POST") return recoverTrajectory(parts[3], req, res);
    return methodNotAllowed();
  } else if (coll == "policies" && n == 3) {
    if (m == "GET") return listPolicies(res);
    if (m == "POST") return createPolicy(req, res);
    return methodNotAllowed();
  } else if (coll == "policies" && n == 4) {
    if (m == "GET") return getPolicy(parts[3], res);
    if (m == "DELETE") return deletePolicy(parts[3], res);
    return methodNotAllowed();
  } else if (coll == "node" && n == 3) {
    if (m == "GET") return getNode(res);
    return methodNotAllowed();
  } else if (coll == "metrics" && n == 3) {
    if (m == "GET") return getMetrics(res);
    return methodNotAllowed();
  } else if (coll == "metrics" && n == 4 && parts[3] == "history") {
    if (m != "GET") return methodNotAllowed();
    double window = 3600;
    if (auto w = req.param("window_s")) {
      char* end = nullptr;
      window = std::strtod(w->c_str(), &end);
      if (w->empty() || *end != '\0' || !(window > 0 && window <= 3600)) {
        return sendError(res, invalidArg("window_s", "window_s must be a number in (0, 3600]"));
      }
    }
    return sendJson(res, 200, dumpJson(history_->query(window)));
  } else if (coll == "tenants") {
    return tenantsApi(parts, req, res);
  } else if (coll == "whoami" && n == 3) {
    if (m == "GET") return whoami(res);
    return methodNotAllowed();
  } else if (coll == "gc" && n == 3) {
    if (m == "POST") return runGc(req, res);
    return methodNotAllowed();
  } else if (coll == "images") {
    if (n == 4 && parts[3] == "pull" && m == "POST") return pullImage(req, res);  // api_pull.cc
    if (n == 4 && parts[3] == "build" && m == "POST") return buildImage(req, res);  // api_build.cc
    if (n == 3) {
      if (m == "POST") return createImage(req, res);
      if (m == "GET") return listImages(res);
      return methodNotAllowed();
    }
    // Image names may contain '/', so the ref is the rest of the path.
    std::string ref = req.path.substr(std::string("/v1/images/").size());
    if (m == "GET") return getImage(ref, res);
    if (m == "DELETE") return deleteImage(ref, res);
    return methodNotAllowed();
  }
  sendError(res, notFound("no such endpoint: " + m + " " + req.path));
}

}  // namespace dsec::platform
