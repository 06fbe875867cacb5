// Batch creation (docs/batches.md): POST /v1/batches creates `count`
// sandboxes of one spec. The batch and all its sandbox records (state
// `pending`) are stored in one transaction before the 202 answer; worker
// threads then create them on nodes, and one committer stores their outcomes
// in groups (one transaction per group, however many finished meanwhile), so
// a batch costs two commits per group instead of two per sandbox.
//
// A record is `running` in memory only once its outcome is stored: what the
// API shows is durable. A platform restart gives every still-pending record a
// fresh id (in one transaction with dropping the old one) and creates it
// again; a copy the node may have made under the old id before the crash is
// wanted by no record, so the node's reconcile destroys it: no duplicates.
#include <algorithm>
#include <atomic>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/cluster.h"
#include "platform/platform.h"

namespace dsec::platform {

extern const std::initializer_list<const char*> kCreateFields;  // api_sandboxes.cc

namespace {

constexpr int64_t kMaxBatch = 32768;

Status specError(const Status& st) {
  std::string f = st.field().empty() ? "spec" : "spec." + st.field();
  if (st.field() == "body") f = "spec";
  return Status(st.code(), st.message(), 0, f);
}

std::string errorCode(const std::string& error) {
  size_t c = error.find(':');
  return c == std::string::npos ? "unknown" : error.substr(0, c);
}

}  // namespace

void Platform::createBatch(http::Request& req, http::Response& res) {
  auto parsed = parseObject(req, {"count", "spec", "all_or_nothing"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  const json& j = *parsed;
  if (!j.contains("count")) return sendError(res, invalidArg("count", "count is required"));
  auto count = getInt(j, "count", 0, 1, kMaxBatch);
  if (!count.isOk()) return sendError(res, count.status());
  auto aon = getBool(j, "all_or_nothing", false);
  if (!aon.isOk()) return sendError(res, aon.status());
  auto spec = j.find("spec");
  if (spec == j.end() || !spec->is_object()) {
    return sendError(res, invalidArg("spec", "spec must be a sandbox create body (an object)"));
  }
  for (auto& [k, v] : spec->items()) {
    bool known = false;
    for (const char* a : kCreateFields) known = known || k == a;
    if (!known) return sendError(res, invalidArg("spec." + k, "unknown field '" + k + "' in spec"));
  }
  auto base = checkCreate(*spec);
  if (!base.isOk()) return sendError(res, specError(base.status()));
  auto owner = tenants_->tenant(base->owner);
  if (!owner.isOk()) return sendError(res, owner.status());

  double now = nowSeconds();
  BatchRecord b;
  b.id = "bt-" + randomHex(8);
  b.owner = base->owner;
  b.count = *count;
  b.allOrNothing = *aon;
  b.spec = spec->dump();
  b.createdAt = b.updatedAt = now;
  // The batch's records are this one under `count` ids.
  SandboxRecord pending = *base;
  pending.state = SandboxState::kPending;
  pending.batch = b.id;
  pending.createdAt = pending.updatedAt = now;
  pending.expiresAt = pending.ttlS > 0 ? now + double(pending.ttlS) : 0;
  std::vector<std::string> ids;
  ids.reserve(size_t(b.count));
  // Quotas for the whole batch at once, under the lock that adds its records:
  // a batch that would pass a limit is refused whole.
  {
    std::lock_guard lk(mu_);
    if (stopping_) return sendError(res, Status(Code::kUnavailable, "platform is shutting down"));
    const TenantQuota& q = owner->quota;
    if (q.maxSandboxes > 0 || q.maxCpu > 0 || q.maxMemoryMb > 0) {
      Usage u = usageLocked(owner->id);
      u.sandboxes += u.runs;  // runs under way count as sandboxes (docs/tenants.md)
      auto refuse = [&](const char* field, const std::string& what) {
        sendError(res, Status(Code::kQuotaExceeded,
                              "quota exceeded: a batch of " + std::to_string(b.count) + " " +
                                  what + "; tenant " + owner->id + "'s " + field + " is exceeded",
                              0, field));
      };
      if (q.maxSandboxes > 0 && u.sandboxes + b.count > q.maxSandboxes) {
        return refuse("max_sandboxes", "sandboxes next to " + std::to_string(u.sandboxes) +
                                           " live ones would make " +
                                           std::to_string(u.sandboxes + b.count) + " (max " +
                                           std::to_string(q.maxSandboxes) + ")");
      }
      if (q.maxCpu > 0 && u.cpu + base->cpu * double(b.count) > q.maxCpu + 1e-9) {
        return refuse("max_cpu", "asks " + std::to_string(base->cpu * double(b.count)) +
                                     " cpu next to " + std::to_string(u.cpu) + " in use (max " +
                                     std::to_string(q.maxCpu) + ")");
      }
      if (q.maxMemoryMb > 0 && u.memoryMb + base->memoryMb * b.count > q.maxMemoryMb) {
        return refuse("max_memory_mb", "asks " + std::to_string(base->memoryMb * b.count) +
                                           " MB next to " + std::to_string(u.memoryMb) +
                                           " in use (max " + std::to_string(q.maxMemoryMb) + ")");
      }
    }
    while (int64_t(ids.size()) < b.count) {
      // 64 random bits: a clash is as good as impossible, but would take
      // another sandbox's record.
      std::string id = "sb-" + randomHex(8);
      auto [it, fresh] = sandboxes_.try_emplace(id, pending);
      if (!fresh) continue;
      it->second.id = id;
      indexLocked(it->second);
      ids.push_back(std::move(id));
    }
  }
  auto undo = [&] {
    std::lock_guard lk(mu_);
    for (auto& id : ids) sandboxes_.erase(id);
  };
  auto* cluster = cluster_;
  if (b.allOrNothing && cluster) {
    PlacementRequest pr;
    auto plan = planPolicy(*base);
    if (!plan.isOk()) {
      undo();
      return sendError(res, specError(plan.status()));
    }
    pr.cpu = plan->limits.cpu;
    pr.memoryMb = plan->limits.memoryBytes >> 20;
    pr.layers = base->layers;
    pr.pool = base->pool;
    pr.tenant = base->owner;
    pr.spread = base->spread;
    if (Status st = cluster->reserve(ids, pr); !st.isOk()) {
      undo();
      return sendError(res, st);
    }
  }
  // With replicas, this one claims the batch before any record of it is
  // visible: a replica starting meanwhile leaves its pending records alone.
  bool claimed = false;
  if (store_->shared()) {
    auto won = claimBatch(b.id);
    if (!won.isOk() || !*won) {
      undo();
      if (cluster) cluster->release(ids);
      return sendError(res, won.isOk() ? internalError("batch id " + b.id + " is claimed")
                                       : won.status());
    }
    claimed = true;
  }
  // Persisted, batch and records in one transaction, before the answer.
  if (Status st = store_->putBatch(b, ids, pending); !st.isOk()) {
    undo();
    if (cluster) cluster->release(ids);
    return sendError(res, st);
  }
  {
    std::lock_guard lk(batchMu_);
    Batch& bt = batches_[b.id];
    bt.rec = b;
    bt.ids = ids;
    bt.outstanding = b.count;
    bt.claimed = claimed;
    for (auto& id : ids) batchQueue_.push_back(id);
    growBatchWorkersLocked();
  }
  batchCv_.notify_all();
  log::info("batch " + b.id + ": " + std::to_string(b.count) + " sandboxes of tenant " + b.owner +
            (b.allOrNothing ? " (all or nothing)" : ""));
  sendJson(res, 202, dumpJson(batchToApi(b.id)));
}

json Platform::batchToApi(const std::string& id) {
  BatchRecord rec;
  std::vector<std::string> ids;
  std::map<std::string, int64_t> errors;
  int64_t pending = 0, running = 0, failed = 0, stopped = 0, lost = 0;
  {
    std::lock_guard lk(batchMu_);
    auto it = batches_.find(id);
    if (it == batches_.end()) return nullptr;
    const Batch& b = it->second;
    rec = b.rec;
    errors = b.errors;
    // While it runs, its counters (a poll must not walk 32,768 records under
    // the lock every create takes); once it is over, its records' states.
    if (rec.state == BatchState::kRunning) {
      pending = b.outstanding;
      running = b.created;
      failed = b.failed;
    } else {
      ids = b.ids;
    }
  }
  if (!ids.empty()) {
    std::lock_guard lk(mu_);
    for (auto& sid : ids) {
      auto it = sandboxes_.find(sid);
      SandboxState s = it == sandboxes_.end() ? SandboxState::kStopped : it->second.state;
      if (s == SandboxState::kPending || s == SandboxState::kCreating) {
        ++pending;
      } else if (proto::isUp(s)) {
        ++running;
      } else if (s == SandboxState::kFailed) {
        ++failed;
      } else if (s == SandboxState::kLost) {
        ++lost;
      } else {
        ++stopped;  // stopping, stopped, or purged after the retention
      }
    }
  }
  json j = {{"id", rec.id},
            {"owner", rec.owner},
            {"state", batchStateName(rec.state)},
            {"requested", rec.count},
            {"all_or_nothing", rec.allOrNothing},
            {"pending", pending},
            {"running", running},
            {"created", rec.count - pending - failed},
            {"failed", failed},
            {"stopped", stopped},
            {"lost", lost},
            {"errors", errors},
            {"error", rec.error.empty() ? json(nullptr) : json(rec.error)},
            {"created_at", isoTime(rec.createdAt)},
            {"updated_at", isoTime(rec.updatedAt)}};
  j["spec"] = json::parse(rec.spec, nullptr, false);
  return j;
}

void Platform::batchesApi(const std::vector<std::string>& parts, http::Request& req,
                          http::Response& res) {
  const std::string& m = req.method;
  size_t n = parts.size();
  auto methodNotAllowed = [&] { sendError(res, platform::methodNotAllowed(req)); };
  if (n == 3) {
    if (m == "POST") return createBatch(req, res);
    if (m != "GET") return methodNotAllowed();
    std::vector<std::string> mine;
    {
      std::lock_guard lk(batchMu_);
      for (auto& [id, b] : batches_) {
        if (mayAccess(currentCaller(), b.rec.owner)) mine.push_back(id);
      }
    }
    json arr = json::array();
    for (auto& id : mine) {
      json j = batchToApi(id);
      if (!j.is_null()) arr.push_back(std::move(j));
    }
    return sendJson(res, 200, dumpJson(json{{"batches", arr}}));
  }
  if (n != 4) return sendError(res, notFound("no such endpoint: " + req.path));
  const std::string& id = parts[3];
  std::vector<std::string> ids;
  {
    std::lock_guard lk(batchMu_);
    auto it = batches_.find(id);
    // Another tenant's batch is not found, as if it did not exist.
    if (it == batches_.end() || !mayAccess(currentCaller(), it->second.rec.owner)) {
      return sendError(res, notFound("batch " + id + " not found"));
    }
    if (m == "DELETE") ids = it->second.ids;  // not for a poll: 32,768 of them
  }
  if (m == "GET") return sendJson(res, 200, dumpJson(batchToApi(id)));
  if (m != "DELETE") return methodNotAllowed();
  auto n2 = destroyMany(ids, "batch " + id + " deleted");
  if (!n2.isOk()) return sendError(res, n2.status());
  BatchRecord rec;
  {
    std::lock_guard lk(batchMu_);
    auto it = batches_.find(id);
    if (it != batches_.end()) {
      it->second.rec.state = BatchState::kDeleted;
      it->second.rec.updatedAt = nowSeconds();
      rec = it->second.rec;
    }
  }
  if (!rec.id.empty()) {
    if (Status st = store_->putBatch(rec, {}); !st.isOk()) return sendError(res, st);
  }
  json j = batchToApi(id);
  j["destroyed"] = *n2;
  sendJson(res, 200, dumpJson(j));
}

void Platform::destroyMatching(http::Request& req, http::Response& res) {
  auto filter = labelFilter(req);
  if (!filter.isOk()) return sendError(res, filter.status());
  const std::map<std::string, std::string>& want = *filter;
  auto batch = req.param("batch");
  if (want.empty() && (!batch || batch->empty())) {
    return sendError(res, invalidArg("label", "DELETE /v1/sandboxes needs a filter: label=k=v "
                                              "(repeatable) or batch=ID"));
  }
  std::vector<std::string> ids;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, r] : sandboxes_) {
      if (!mayAccess(currentCaller(), r.owner) || isFinal(r.state)) continue;
      if (batch && r.batch != *batch) continue;
      bool match = true;
      for (auto& [k, v] : want) {
        auto it = r.labels.find(k);
        match = match && it != r.labels.end() && it->second == v;
      }
      if (match) ids.push_back(id);
    }
  }
  auto n = destroyMany(ids, "");
  if (!n.isOk()) return sendError(res, n.status());
  sendJson(res, 200, dumpJson(json{{"destroyed", *n}, {"ids", ids}}));
}

Result<int64_t> Platform::destroyMany(const std::vector<std::string>& ids, const std::string& why) {
  double now = nowSeconds();
  std::vector<SandboxRecord> finals;
  std::vector<std::string> toNode, neverCreated;
  int64_t n = 0;
  {
    std::lock_guard lk(mu_);
    for (auto& id : ids) {
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end()) continue;
      SandboxRecord& r = it->second;
      if (r.state == SandboxState::kPending) {
        r.state = SandboxState::kStopped;
        r.error = why.empty() ? "deleted before it was created" : why;
        r.updatedAt = r.stoppedAt = now;
        finals.push_back(r);
        neverCreated.push_back(id);
        ++n;
      } else if (r.state == SandboxState::kCreating) {
        // Its worker or the committer finishes it, then destroys it.
        deleteRequested_.insert(id);
        ++n;
      } else if (!isFinal(r.state) && r.state != SandboxState::kStopping) {
        r.state = SandboxState::kStopping;
        toNode.push_back(id);
      }
    }
  }
  if (auto* cluster = cluster_) cluster->release(neverCreated);
  if (!neverCreated.empty()) {
    // Never created: no worker will report them, so their batches count them here.
    std::lock_guard lk(batchMu_);
    std::set<std::string> touched;
    for (auto& r : finals) {
      auto b = batches_.find(r.batch);
      if (b == batches_.end()) continue;
      b->second.outstanding--;
      touched.insert(r.batch);
    }
    for (auto& id : touched) settleBatchLocked(id);
  }
  // Each node's share in bulk calls, nodes concurrently (Cluster::destroyMany).
  std::vector<Status> results = cluster_->destroyMany(toNode);
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < toNode.size(); ++i) {
      auto it = sandboxes_.find(toNode[i]);
      if (it == sandboxes_.end()) continue;
      SandboxRecord& r = it->second;
      r.state = SandboxState::kStopped;
      if (!why.empty()) r.error = why;
      if (!results[i].isOk()) {
        log::error("destroy " + r.id + ": " + results[i].toString());
        if (r.error.empty()) r.error = "cleanup: " + results[i].message();
      }
      r.updatedAt = r.stoppedAt = nowSeconds();
      finals.push_back(r);
      ++n;
    }
  }
  stateCv_.notify_all();
  RETURN_IF_ERROR(store_->putSandboxes(finals));
  return n;
}

void Platform::growBatchWorkersLocked() {
  // A worker more for each kBulkCreate queued beyond what the idle ones
  // take, up to batchWorkers; they stay once started. A new worker counts as
  // idle from here (batchWorker).
  while (size_t(batchIdle_) * kBulkCreate < batchQueue_.size() &&
         batchWorkersStarted_ < std::max(1, opts_.batchWorkers) && !batchStop_) {
    ++batchWorkersStarted_;
    ++batchIdle_;
    batchThreads_.emplace_back([this] { batchWorker(); });
  }
}

void Platform::batchWorker() {
  for (;;) {
    // Up to kBulkCreate at once: the cluster places them together and makes
    // one call per node (Cluster::createGroup) instead of one per sandbox.
    std::vector<std::string> ids;
    {
      std::unique_lock lk(batchMu_);
      batchCv_.wait(lk, [&] { return batchStop_ || !batchQueue_.empty(); });
      if (batchStop_) return;
      --batchIdle_;  // idle again when this round ends (below)
      while (!batchQueue_.empty() && ids.size() < kBulkCreate) {
        ids.push_back(std::move(batchQueue_.front()));
        batchQueue_.pop_front();
      }
    }
    // However the round ends, this worker is idle again after it.
    struct IdleAfter {
      Platform* p;
      ~IdleAfter() {
        std::lock_guard lk(p->batchMu_);
        ++p->batchIdle_;
      }
    } idleAfter{this};
    std::vector<SandboxRecord> rs;
    {
      std::lock_guard lk(mu_);
      for (auto& id : ids) {
        auto it = sandboxes_.find(id);
        if (it == sandboxes_.end() || it->second.state != SandboxState::kPending || stopping_) continue;
        it->second.state = SandboxState::kCreating;
        rs.push_back(it->second);
      }
    }
    if (rs.empty()) continue;
    // The tenant's creations-per-second quota paces its batches.
    for (auto& r : rs) {
      for (;;) {
        auto t = tenants_->tenant(r.owner);
        if (!t.isOk() || tenants_->takeCreate(*t, nowSeconds()).isOk()) break;
        std::unique_lock lk(batchMu_);
        if (batchCv_.wait_for(lk, std::chrono::milliseconds(20), [&] { return batchStop_; })) break;
      }
    }
    auto outcomes = createManyOnEdge(rs);
    std::vector<SandboxRecord> done;
    std::vector<std::string> again;  // not attempted: back to the queue's front
    for (size_t i = 0; i < rs.size(); ++i) {
      SandboxRecord& r = rs[i];
      if (!outcomes[i]) {
        again.push_back(r.id);
        continue;
      }
      const Status& st = *outcomes[i];
      r.updatedAt = nowSeconds();
      if (st.isOk()) {
        r.state = SandboxState::kRunning;
        r.node = cluster_->nodeOf(r.id);
      } else {
        r.state = SandboxState::kFailed;
        r.error = std::string(codeName(st.code())) + ": " + st.message();
        r.stoppedAt = r.updatedAt;
      }
      done.push_back(std::move(r));
    }
    if (!again.empty()) {
      {
        std::lock_guard lk(mu_);
        for (auto& id : again) {
          auto it = sandboxes_.find(id);
          if (it != sandboxes_.end() && it->second.state == SandboxState::kCreating) it->second.state = SandboxState::kPending;
        }
      }
      std::lock_guard lk(batchMu_);
      for (auto it = again.rbegin(); it != again.rend(); ++it) batchQueue_.push_front(*it);
    }
    if (!again.empty()) batchCv_.notify_all();
    if (!done.empty()) {
      {
        std::lock_guard lk(batchMu_);
        for (auto& r : done) batchDone_.push_back(std::move(r));
      }
      commitCv_.notify_one();
    }
  }
}

void Platform::batchCommitter() {
  for (;;) {
    std::vector<SandboxRecord> done;
    {
      std::unique_lock lk(batchMu_);
      commitCv_.wait(lk, [&] { return batchStop_ || !batchDone_.empty(); });
      if (batchDone_.empty()) return;  // stopping, all stored
      done.swap(batchDone_);
    }
    // One transaction for every outcome gathered while the last one committed.
    if (Status st = store_->putSandboxes(done); !st.isOk()) {
      log::error("batch: storing " + std::to_string(done.size()) + " outcomes: " + st.toString());
      {
        std::lock_guard lk(batchMu_);
        batchDone_.insert(batchDone_.begin(), done.begin(), done.end());
        if (batchStop_) return;  // they stay pending in the store: resumed at the next start
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    // Deleted while being created: destroyed now, and that recorded, before
    // the deleter (waiting in destroy()) sees the final state.
    std::vector<SandboxRecord> cancelled;
    {
      std::lock_guard lk(mu_);
      for (auto& r : done) {
        auto it = sandboxes_.find(r.id);
        if (it == sandboxes_.end()) continue;
        if (deleteRequested_.count(r.id) && r.state == SandboxState::kRunning) {
          cancelled.push_back(r);
          continue;
        }
        deleteRequested_.erase(r.id);
        it->second = r;
      }
    }
    for (auto& r : cancelled) {
      (void)cluster_->destroy(r.id);
      r.state = SandboxState::kStopped;
      r.error = "deleted while being created";
      r.updatedAt = r.stoppedAt = nowSeconds();
    }
    if (!cancelled.empty()) {
      if (Status st = store_->putSandboxes(cancelled); !st.isOk()) {
        log::error("batch: storing deletions: " + st.toString());
      }
      std::lock_guard lk(mu_);
      for (auto& r : cancelled) {
        deleteRequested_.erase(r.id);
        if (auto it = sandboxes_.find(r.id); it != sandboxes_.end()) it->second = r;
      }
    }
    stateCv_.notify_all();
    std::vector<std::pair<std::string, std::string>> aonFailed;  // batch, why
    {
      std::lock_guard lk(batchMu_);
      std::set<std::string> touched;
      for (auto& r : done) {
        auto b = batches_.find(r.batch);
        if (b == batches_.end()) continue;
        b->second.outstanding--;
        (r.state == SandboxState::kFailed ? b->second.failed : b->second.created)++;
        if (r.state == SandboxState::kFailed) {
          b->second.errors[errorCode(r.error)]++;
          if (b->second.rec.allOrNothing && b->second.rec.state == BatchState::kRunning) {
            b->second.rec.state = BatchState::kFailed;
            b->second.rec.error = "all_or_nothing: sandbox " + r.id + " failed (" + r.error +
                                  "); the batch's sandboxes are destroyed";
            aonFailed.emplace_back(r.batch, b->second.rec.error);
          }
        }
        touched.insert(r.batch);
      }
      for (auto& id : touched) settleBatchLocked(id);
    }
    for (auto& [id, why] : aonFailed) {
      std::vector<std::string> ids;
      BatchRecord rec;
      {
        std::lock_guard lk(batchMu_);
        ids = batches_[id].ids;
        rec = batches_[id].rec;
      }
      log::warn("batch " + id + ": " + why);
      if (Status st = store_->putBatch(rec, {}); !st.isOk()) log::error("batch " + id + ": " + st.toString());
      auto n = destroyMany(ids, why);
      if (!n.isOk()) log::error("batch " + id + ": " + n.status().toString());
    }
  }
}

Result<bool> Platform::claimBatch(const std::string& id) {
  return store_->acquireLease("batch:" + id, opts_.replicaId, kBatchClaimTtlS);
}

void Platform::renewBatchClaims() {
  std::vector<std::string> renew, drop;
  {
    std::lock_guard lk(batchMu_);
    for (auto& [id, b] : batches_) {
      if (!b.claimed) continue;
      if (b.rec.state == BatchState::kRunning && b.outstanding > 0) {
        renew.push_back(id);
      } else {
        b.claimed = false;
        drop.push_back(id);
      }
    }
  }
  for (auto& id : renew) {
    auto won = claimBatch(id);
    if (!won.isOk()) {
      log::warn("batch " + id + ": renewing its claim: " + won.status().toString());
    } else if (!*won) {
      log::error("batch " + id + ": its claim was taken by another replica");
    }
  }
  for (auto& id : drop) (void)store_->releaseLease("batch:" + id, opts_.replicaId);
}

void Platform::settleBatchLocked(const std::string& id) {
  auto it = batches_.find(id);
  if (it == batches_.end() || it->second.outstanding > 0) return;
  if (!it->second.mine) return;  // another replica's: it settles it
  BatchRecord& rec = it->second.rec;
  if (rec.state != BatchState::kRunning) return;
  rec.state = BatchState::kDone;
  rec.updatedAt = nowSeconds();
  if (Status st = store_->putBatch(rec, {}); !st.isOk()) {
    log::error("batch " + id + ": " + st.toString());
  }
  log::info("batch " + id + " done: " + std::to_string(rec.count) + " sandboxes, " +
            std::to_string(it->second.errors.empty() ? 0 : [&] {
              int64_t n = 0;
              for (auto& [_, k] : it->second.errors) n += k;
              return n;
            }()) +
            " failed");
}

Status Platform::resumeBatches(std::vector<SandboxRecord>& records) {
  ASSIGN_OR_RETURN(auto batches, store_->loadBatches());
  // With replicas, only the batches this replica wins the claim of: another
  // live replica may be creating the rest right now.
  std::set<std::string> unfinished, foreign;
  for (auto& r : records) {
    if (!r.batch.empty() && (r.state == SandboxState::kPending || r.state == SandboxState::kCreating)) {
      unfinished.insert(r.batch);
    }
  }
  std::set<std::string> claimed;
  if (store_->shared()) {
    for (auto& id : unfinished) {
      ASSIGN_OR_RETURN(bool won, claimBatch(id));
      if (won) {
        claimed.insert(id);
      } else {
        foreign.insert(id);
        log::info("batch " + id + ": claimed by another live replica; left to it");
      }
    }
  }
  std::vector<SandboxRecord> renamed;
  std::vector<std::string> dropped;
  for (auto& r : records) {
    if (r.batch.empty() || (r.state != SandboxState::kPending && r.state != SandboxState::kCreating)) continue;
    if (foreign.count(r.batch)) continue;
    dropped.push_back(r.id);
    r.id = "sb-" + randomHex(8);
    r.state = SandboxState::kPending;
    renamed.push_back(r);
  }
  // The new ids replace the old in one transaction: never both, never neither.
  RETURN_IF_ERROR(store_->putSandboxes(renamed, dropped));
  std::lock_guard lk(batchMu_);
  for (auto& b : batches) {
    Batch& bt = batches_[b.id];
    bt.rec = b;
    bt.mine = !foreign.count(b.id);
    bt.claimed = claimed.count(b.id) > 0;
  }
  for (auto& r : records) {
    auto it = batches_.find(r.batch);
    if (r.batch.empty() || it == batches_.end()) continue;
    if (!it->second.mine) {
      it->second.ids.push_back(r.id);  // listed; its counters are its creator's
      continue;
    }
    it->second.ids.push_back(r.id);
    if (r.state == SandboxState::kFailed) it->second.errors[errorCode(r.error)]++;
    if (r.state == SandboxState::kFailed) {
      it->second.failed++;
    } else if (r.state != SandboxState::kPending) {
      it->second.created++;
    }
    if (r.state == SandboxState::kPending) {
      it->second.outstanding++;
      batchQueue_.push_back(r.id);
    }
  }
  // Workers start once the records are loaded (Platform::start).
  for (auto& [id, b] : batches_) settleBatchLocked(id);
  if (!renamed.empty()) {
    log::info("resuming batches: " + std::to_string(renamed.size()) + " sandboxes to create");
  }
  return Status::ok();
}

}  // namespace dsec::platform
