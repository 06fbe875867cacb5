// The trajectories resource (Chronus, platform/chronus.h): list, export as
// JSON lines, delete, recover; and what the platform keeps of a trajectory
// beyond its steps (its sandbox, the bytes of its writes).
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

void Platform::listTrajectories(http::Response& res) {
  auto list = store_->listTrajectories();
  if (!list.isOk()) return sendError(res, list.status());
  json arr = json::array();
  for (auto& t : *list) {
    auto seen = trajectoryAsSeenBy(currentCaller(), t.id);
    if (!seen) continue;  // another tenant's
    arr.push_back({{"id", *seen},
                   {"steps", t.steps},
                   {"first_at", isoTime(t.firstAt)},
                   {"last_at", isoTime(t.lastAt)}});
  }
  sendJson(res, 200, dumpJson(json{{"trajectories", arr}}));
}

// One JSON object per step, in step order: the request as it was made, the
// result as it was returned (JSON, or base64 for file bytes), and timings:
// training data.
void Platform::exportTrajectory(const std::string& id, http::Response& res) {
  auto steps = store_->loadTrajectory(id);
  if (!steps.isOk()) return sendError(res, steps.status());
  if (steps->empty()) return sendError(res, notFound("trajectory " + id + " not found"));
  std::string out;
  for (auto& s : *steps) {
    json line = {{"trajectory_id", trajectoryAsSeenBy(currentCaller(), s.trajectory).value_or("")},
                 {"step", s.step},
                 {"kind", s.kind},
                 {"sandbox", s.sandbox},
                 {"digest", s.digest},
                 {"request", json::parse(s.request, nullptr, false)},
                 {"status", s.status},
                 {"started_at", isoTime(s.startedAt)},
                 {"duration_ms", (s.finishedAt - s.startedAt) * 1000}};
    json result =
        s.contentType == "application/json" ? json::parse(s.body, nullptr, false) : json(nullptr);
    if (result.is_discarded() || result.is_null()) {
      line["result_b64"] = base64Encode(s.body);
    } else {
      line["result"] = result;
    }
    out += dumpJson(line) + "\n";
  }
  (void)res.send(200, "application/x-ndjson", out);
}

// What the console shows of a trajectory beside its steps: its sandbox now
// and the ones it replaced, its recoveries, its checkpoints, and how often
// each step's answer was replayed from the log (since this replica started).
void Platform::trajectoryInfo(const std::string& id, http::Response& res) {
  auto steps = store_->loadTrajectory(id);
  if (!steps.isOk()) return sendError(res, steps.status());
  if (steps->empty()) return sendError(res, notFound("trajectory " + id + " not found"));
  auto rec = store_->getTrajectory(id);
  json out = {{"trajectory_id", trajectoryAsSeenBy(currentCaller(), id).value_or("")},
              {"steps", steps->size()},
              {"first_at", isoTime(steps->front().startedAt)},
              {"last_at", isoTime(steps->back().finishedAt)}};
  // The sandbox of the newest step, unless a recovery moved it on.
  out["sandbox"] = steps->back().sandbox;
  out["replaced"] = json::array();
  out["recoveries"] = json::array();
  if (rec.isOk()) {
    if (!rec->sandbox.empty()) out["sandbox"] = rec->sandbox;
    out["replaced"] = rec->replaced;
    json r = json::parse(rec->recoveries, nullptr, false);
    if (r.is_array()) out["recoveries"] = r;
  }
  json ckpts = json::array();
  std::map<std::string, int64_t> kinds;
  for (auto& s : *steps) {
    ++kinds[s.kind];
    if (s.kind != "checkpoint") continue;
    json c = {{"step", s.step}, {"sandbox", s.sandbox}, {"status", s.status}};
    json body = json::parse(s.body, nullptr, false);
    if (body.is_object()) {
      for (const char* k : {"image", "name", "tag", "ref"}) {
        if (body.contains(k)) c[k] = body[k];
      }
    }
    ckpts.push_back(c);
  }
  out["checkpoints"] = ckpts;
  out["kinds"] = kinds;
  json replays = json::object();
  {
    std::lock_guard lk(trajMu_);
    if (auto it = replays_.find(id); it != replays_.end()) {
      for (auto& [step, n] : it->second) replays[std::to_string(step)] = n;
    }
  }
  out["replays"] = replays;
  sendJson(res, 200, dumpJson(out));
}

void Platform::deleteTrajectory(const std::string& id, http::Response& res) {
  // The bytes its writes kept go with it, unless another step keeps them too.
  auto steps = store_->loadTrajectory(id);
  if (!steps.isOk()) return sendError(res, steps.status());
  std::set<std::string> contents;
  for (auto& s : *steps) {
    if (!s.content.empty()) contents.insert(s.content);
  }
  auto n = store_->deleteTrajectory(id);
  {
    std::lock_guard lk(trajMu_);
    trajectories_.erase(id);
    replays_.erase(id);
  }
  if (!n.isOk()) return sendError(res, n.status());
  if (*n == 0) return sendError(res, notFound("trajectory " + id + " not found"));
  releaseStepBytes(contents);
  log::info("trajectory " + id + " deleted (" + std::to_string(*n) + " steps)");
  sendJson(res, 200, dumpJson(json{{"deleted_steps", *n}}));
}

// ----- the trajectory's sandbox -------------------------------------------------

Result<TrajectoryRecord> Platform::trajectoryRecord(const std::string& trajectory) {
  auto none = [&] { return notFound("trajectory " + trajectory + " has no record"); };
  {
    std::lock_guard lk(trajMu_);
    auto it = trajectories_.find(trajectory);
    if (it != trajectories_.end()) {
      if (it->second.sandbox.empty()) return none();
      return it->second;
    }
  }
  auto r = store_->getTrajectory(trajectory);
  if (!r.isOk() && r.status().code() != Code::kNotFound) return r.status();
  // Absence is cached too (an empty sandbox): only this process writes
  // records, and it updates the cache when it does.
  TrajectoryRecord cached = r.isOk() ? *r : TrajectoryRecord{};
  cached.sandboxDoc.clear();  // only a recover needs it; it reads the store
  {
    std::lock_guard lk(trajMu_);
    // A cache, not a registry: bounded by dropping it all now and then.
    if (trajectories_.size() >= 4096) trajectories_.clear();
    trajectories_[trajectory] = cached;
  }
  if (!r.isOk()) return none();
  return cached;
}

std::string Platform::routeStep(const std::string& id, const std::string& trajectory) {
  auto r = trajectoryRecord(trajectory);
  if (!r.isOk() || r->sandbox == id) return id;
  if (std::find(r->replaced.begin(), r->replaced.end(), id) == r->replaced.end()) return id;
  return r->sandbox;
}

void Platform::noteStepSandbox(const std::string& trajectory, const std::string& sandbox) {
  auto cur = trajectoryRecord(trajectory);
  if (cur.isOk() && cur->sandbox == sandbox) return;
  if (!cur.isOk() && cur.status().code() != Code::kNotFound) {
    log::warn("trajectory " + trajectory + ": " + cur.status().toString());
    return;
  }
  TrajectoryRecord r = cur.isOk() ? *cur : TrajectoryRecord{};
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(sandbox);
    if (it == sandboxes_.end()) return;
    r.sandboxDoc = sandboxToJson(it->second);
  }
  r.id = trajectory;
  r.sandbox = sandbox;
  r.updatedAt = nowSeconds();
  // Best effort: without it a recover falls back to the sandbox of the last
  // step, as long as that sandbox's record is still kept.
  if (Status st = store_->putTrajectory(r); !st.isOk()) {
    log::warn("trajectory " + trajectory + ": record its sandbox: " + st.toString());
    return;
  }
  r.sandboxDoc.clear();
  std::lock_guard lk(trajMu_);
  trajectories_[trajectory] = r;
}

// ----- bytes of write steps -------------------------------------------------------

// Apart from the layer blobs (blobPath): layer GC and step bytes never see
// each other's files, so neither can remove what the other needs.
std::string Platform::stepBytesPath(const std::string& digest) const {
  return opts_.dataDir + "/steps/" + (startsWith(digest, "sha256:") ? digest.substr(7) : digest);
}

Result<std::string> Platform::keepStepBytes(std::string_view data) {
  std::string digest = "sha256:" + sha256Hex(data);
  {
    std::lock_guard lk(trajMu_);
    stepBytesPinned_.insert(digest);
  }
  std::string path = stepBytesPath(digest);
  struct stat st;
  Status s;
  // Content-addressed: bytes already kept (by another step) are these bytes.
  if (::stat(path.c_str(), &st) != 0 || st.st_size != off_t(data.size())) {
    s = makeDirs(opts_.dataDir + "/steps", 0700);
    // Synced like the step log it belongs to (store.h: survives a crash of
    // the process).
    if (s.isOk()) s = writeFileAtomic(path, data, 0600);
  }
  if (!s.isOk()) {
    unpinStepBytes(digest);
    return s.withContext("keep the bytes of a write step");
  }
  return digest;
}

void Platform::unpinStepBytes(const std::string& digest) {
  std::lock_guard lk(trajMu_);
  auto it = stepBytesPinned_.find(digest);
  if (it != stepBytesPinned_.end()) stepBytesPinned_.erase(it);
}

void Platform::releaseStepBytes(const std::set<std::string>& digests) {
  // Under trajMu_, so a write step between keeping its bytes and storing
  // itself (pinned) is seen either way.
  std::lock_guard lk(trajMu_);
  for (auto& d : digests) {
    if (stepBytesPinned_.count(d)) continue;
    auto used = store_->stepContentUsed(d);
    if (!used.isOk()) {
      log::warn("release step bytes " + d + ": " + used.status().toString());
      continue;
    }
    if (*used) continue;
    std::string path = stepBytesPath(d);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) log::warn("unlink " + path);
  }
}

Status Platform::sweepStepBytes() {
  std::string dir = opts_.dataDir + "/steps";
  std::lock_guard lk(trajMu_);
  // Retention deletes trajectories behind the cache's back; forgetting it
  // every GC pass bounds how long it can be stale.
  trajectories_.clear();
  DIR* d = ::opendir(dir.c_str());
  if (!d) return errno == ENOENT ? Status::ok() : sysError("open " + dir);
  ASSIGN_OR_RETURN(std::set<std::string> used, store_->stepContents());
  std::vector<std::string> gone;
  double now = nowSeconds();
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    std::string path = dir + "/" + name;
    if (name.find(".tmp.") != std::string::npos) {
      // A write interrupted by a crash; a live one is seconds old.
      struct stat st;
      if (::stat(path.c_str(), &st) == 0 && st.st_mtime + 3600 < now) gone.push_back(path);
      continue;
    }
    std::string digest = "sha256:" + name;
    if (!used.count(digest) && !stepBytesPinned_.count(digest)) gone.push_back(path);
  }
  ::closedir(d);
  for (auto& p : gone) {
    if (::unlink(p.c_str()) != 0 && errno != ENOENT) log::warn("unlink " + p);
  }
  if (!gone.empty()) log::info("gc: removed the bytes of " + std::to_string(gone.size()) + " writes");
  return Status::ok();
}

// ----- recover ------------------------------------------------------------------

void Platform::recoverTrajectory(const std::string& id, http::Request& req, http::Response& res) {
  auto body = parseObject(req, {"force"}, true);
  if (!body.isOk()) return sendError(res, body.status());
  auto force = getBool(*body, "force", false);
  if (!force.isOk()) return sendError(res, force.status());
  // The id as the client named it (an admin may name another tenant's
  // "<id>@<tenant>").
  json tj = id.substr(0, id.find('@')), zero = 0;
  if (auto k = Chronus::parseKey(&tj, &zero); !k.isOk()) return sendError(res, k.status());
  {
    std::lock_guard lk(trajMu_);
    if (!recovering_.insert(id).second) {
      return sendError(res, Status(Code::kConflict, "trajectory " + id + " is being recovered",
                                   0, "trajectory_id"));
    }
  }
  auto report = runRecover(id, *force, req);
  {
    std::lock_guard lk(trajMu_);
    recovering_.erase(id);
  }
  if (!report.isOk()) return sendError(res, report.status());
  sendJson(res, 201, dumpJson(*report));
}

namespace {

bool mutates(const std::string& kind) {
  return kind == "exec" || kind == "write" || kind == "mkdir" || kind == "remove";
}

}  // namespace

Result<json> Platform::runRecover(const std::string& id, bool force, http::Request& req) {
  ASSIGN_OR_RETURN(std::vector<TrajectoryStep> steps, store_->loadTrajectory(id));
  if (steps.empty()) {
    return Status(Code::kNotFound, "trajectory " + id + " not found", 0, "trajectory_id");
  }
  auto rec = store_->getTrajectory(id);
  if (!rec.isOk() && rec.status().code() != Code::kNotFound) return rec.status();
  // The trajectory's sandbox: as recorded, else (a log older than records)
  // the one that ran its latest step.
  std::string oldId = rec.isOk() ? rec->sandbox : "";
  if (oldId.empty()) {
    double last = -1;
    for (auto& s : steps) {
      if (s.finishedAt > last) {
        last = s.finishedAt;
        oldId = s.sandbox;
      }
    }
  }
  SandboxRecord old;
  bool known = false, live = false;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(oldId);
    if (it != sandboxes_.end()) {
      old = it->second;
      known = true;
      live = !isFinal(old.state);
    }
  }
  if (!known && rec.isOk() && rec->sandbox == oldId && !rec->sandboxDoc.empty()) {
    // Its record was purged (stoppedRetentionS): it is gone, and how it was
    // made is in the trajectory's record.
    ASSIGN_OR_RETURN(old, sandboxFromJson(rec->sandboxDoc));
    known = true;
  }
  if (!known) {
    return Status(Code::kFailedPrecondition,
                  "how sandbox " + oldId + " of trajectory " + id +
                      " was made is no longer known: it cannot be recovered",
                  0, "trajectory_id");
  }
  if (live && !force) {
    return Status(Code::kConflict,
                  "sandbox " + oldId + " of trajectory " + id + " is still " + proto::stateName(old.state) +
                      "; recover with force to replace it anyway",
                  0, "force");
  }
  // The latest checkpoint whose image still holds the layers it was made
  // with; a deleted or re-tagged one is skipped (and reported).
  const TrajectoryStep* ckpt = nullptr;
  ImageRecord ckptImg;
  json skipped = json::array();
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->kind != "checkpoint") continue;
    json made = json::parse(it->body, nullptr, false);
    if (!made.is_object()) continue;
    std::string name = made.value("name", ""), tag = made.value("tag", "");
    std::vector<std::string> layers;
    if (auto l = made.find("layers"); l != made.end() && l->is_array()) {
      for (auto& x : *l) {
        if (x.is_string()) layers.push_back(x.get<std::string>());
      }
    }
    auto img = store_->getImage(name, tag);
    if (img.isOk() && img->kind == "diff" && img->layers == layers && !layers.empty()) {
      ckpt = &*it;
      ckptImg = *img;
      break;
    }
    skipped.push_back({{"step", it->step},
                       {"image", name + ":" + tag},
                       {"reason", img.isOk() ? "the image now names other layers"
                                             : "the image is gone"}});
  }
  // Made as the lost one was (its record keeps the create request, resolved),
  // under the policy it was in when lost.
  SandboxRecord r = old;
  r.id.clear();
  r.error.clear();
  r.phases.clear();
  r.stoppedAt = 0;
  if (ckpt) {
    // The stack below the lost sandbox's diffs, then the checkpoint's layers
    // (the diffs of the sandbox it was taken in and its own).
    std::vector<std::string> base = old.layers;
    while (!base.empty()) {
      auto b = store_->getBlob(base.back());
      if (!b.isOk() || b->kind != "diff") break;
      base.pop_back();
    }
    r.layers = base;
    r.layers.insert(r.layers.end(), ckptImg.layers.begin(), ckptImg.layers.end());
    r.diffs = {ckptImg.name + ":" + ckptImg.tag};
  }
  for (auto& d : r.layers) {
    if (!store_->getBlob(d).isOk()) {
      return Status(Code::kFailedPrecondition,
                    "layer " + d + " of the stack to recover on is gone", 0, "trajectory_id");
    }
  }
  ASSIGN_OR_RETURN(SandboxRecord made, launch(r));
  // A failed recover leaves nothing: the new sandbox and its record go.
  auto abandon = [&](Status st) -> Status {
    (void)destroy(made.id, SandboxState::kStopped, "recover failed");
    {
      std::lock_guard lk(mu_);
      sandboxes_.erase(made.id);
      lastCall_.erase(made.id);
    }
    stateCv_.notify_all();
    (void)store_->deleteSandbox(made.id);
    log::warn("recover of trajectory " + id + " failed: " + st.toString());
    return st.withContext("recover trajectory " + id);
  };
  const int64_t from = ckpt ? ckpt->step : -1;
  int64_t reexecuted = 0;
  json diverged = json::array();
  for (auto& s : steps) {
    if (s.step <= from || !mutates(s.kind)) continue;
    auto d = reexecStep(made.id, s, req);
    if (!d.isOk()) return abandon(d.status());
    ++reexecuted;
    if (!d->is_null()) diverged.push_back(*d);
  }
  {
    std::lock_guard lk(mu_);
    if (auto it = sandboxes_.find(made.id); it != sandboxes_.end()) made = it->second;
  }
  json summary = {{"at", isoTime(nowSeconds())},
                  {"previous_sandbox", oldId},
                  {"sandbox", made.id},
                  {"checkpoint_step", ckpt ? json(ckpt->step) : json(nullptr)},
                  {"reexecuted_steps", reexecuted},
                  {"diverged", diverged}};
  TrajectoryRecord nr = rec.isOk() ? *rec : TrajectoryRecord{};
  nr.id = id;
  nr.sandbox = made.id;
  nr.sandboxDoc = sandboxToJson(made);
  if (std::find(nr.replaced.begin(), nr.replaced.end(), oldId) == nr.replaced.end()) {
    nr.replaced.push_back(oldId);
  }
  json history = json::parse(nr.recoveries, nullptr, false);
  if (!history.is_array()) history = json::array();
  history.push_back(summary);
  nr.recoveries = history.dump();
  nr.updatedAt = nowSeconds();
  // From here later steps run in the new sandbox, also those sent to the old.
  if (Status st = store_->putTrajectory(nr); !st.isOk()) return abandon(st);
  nr.sandboxDoc.clear();
  {
    std::lock_guard lk(trajMu_);
    trajectories_[id] = nr;
  }
  log::info("trajectory " + id + " recovered into " + made.id + " from " +
            (ckpt ? "checkpoint step " + std::to_string(ckpt->step) : std::string("its image")) +
            ": " + std::to_string(reexecuted) + " steps re-executed, " +
            std::to_string(diverged.size()) + " diverged");
  return json{{"trajectory_id", trajectoryAsSeenBy(currentCaller(), id).value_or(id)},
              {"sandbox", sandboxToApi(made)},
              {"previous_sandbox", oldId},
              {"checkpoint_step", ckpt ? json(ckpt->step) : json(nullptr)},
              {"checkpoint_image", ckpt ? json(ckptImg.name + ":" + ckptImg.tag) : json(nullptr)},
              {"skipped_checkpoints", skipped},
              {"reexecuted_steps", reexecuted},
              {"diverged", diverged},
              {"last_step", steps.back().step}};
}

}  // namespace dsec::platform
