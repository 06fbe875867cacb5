// /v1/sandboxes: create, list, get, destroy, exec, files.
#include <algorithm>
#include <cmath>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <regex>
#include <set>
#include <tuple>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/cluster.h"
#include "platform/platform.h"
#include "platform/policy.h"

namespace dsec::platform {

namespace {

constexpr int64_t kMaxOutputCap = 64ll << 20;
constexpr size_t kMaxStdin = 16u << 20;

json toApi(const SandboxRecord& r) {
  json j = {{"id", r.id},
            {"backend", proto::backendName(r.backend)},
            {"image", r.image},
            {"workspaces", r.workspaces},
            {"toolkits", r.toolkits},
            {"diffs", r.diffs},
            {"layers", r.layers},
            {"state", proto::stateName(r.state)},
            {"cpu", r.cpu},
            {"memory_mb", r.memoryMb},
            {"disk_mb", r.diskMb},
            {"pids", r.pids},
            {"ttl_s", r.ttlS},
            {"idle_timeout_s", r.idleTimeoutS},
            {"auto_pause_s", r.autoPauseS},
            {"env", r.env},
            {"user", r.user},
            {"working_dir", r.workingDir},
            {"labels", r.labels},
            {"node", r.node},
            {"pool", r.pool},
            {"burstable", r.burstable},
            {"created_at", isoTime(r.createdAt)},
            {"expires_at", r.expiresAt > 0 ? json(isoTime(r.expiresAt)) : json(nullptr)},
            {"stopped_at", r.stoppedAt > 0 && isFinal(r.state) ? json(isoTime(r.stoppedAt))
                                                                : json(nullptr)},
            {"error", r.error.empty() ? json(nullptr) : json(r.error)},
            {"policy", r.policy},
            {"readonly_paths", r.readonlyPaths},
            {"hidden_paths", r.hiddenPaths}};
  json phases = json::array();
  for (auto& p : r.phases) phases.push_back({{"policy", p.policy}, {"at", isoTime(p.at)}});
  j["phases"] = phases;
  j["owner"] = r.owner;
  j["batch"] = r.batch.empty() ? json(nullptr) : json(r.batch);
  // Where a paused sandbox's memory is ("ram", or "disk" when paused to disk).
  j["pause_memory"] = r.state != SandboxState::kPaused ? json(nullptr)
                                          : json(r.pausedTo.empty() ? "ram" : r.pausedTo);
  return j;
}

Status validateLabels(const std::map<std::string, std::string>& labels) {
  static const std::regex kKey("[A-Za-z0-9._/-]{1,63}");
  if (labels.size() > 64) return invalidArg("labels", "at most 64 labels");
  for (auto& [k, v] : labels) {
    if (!std::regex_match(k, kKey)) return invalidArg("labels", "invalid label key '" + k + "'");
    if (v.size() > 255) return invalidArg("labels", "label value of '" + k + "' is too long");
  }
  return Status::ok();
}

// Absolute, NUL-free, bounded. The agent resolves it inside the sandbox's
// root, so ".." cannot leave the sandbox; we still normalise nothing here.
Result<std::string> sandboxPath(const http::Request& req) {
  auto p = req.param("path");
  if (!p || p->empty()) return invalidArg("path", "query parameter 'path' is required");
  if ((*p)[0] != '/') return invalidArg("path", "path must be absolute: '" + *p + "'");
  if (p->find('\0') != std::string::npos) return invalidArg("path", "path contains NUL");
  if (p->size() > 4096) return invalidArg("path", "path longer than 4096 bytes");
  return *p;
}

Result<int> parseMode(const std::optional<std::string>& s, int def) {
  if (!s) return def;
  if (s->empty() || s->size() > 5) return invalidArg("mode", "mode must be octal, e.g. 0644");
  int v = 0;
  for (char c : *s) {
    if (c < '0' || c > '7') return invalidArg("mode", "mode must be octal, e.g. 0644");
    v = v * 8 + (c - '0');
  }
  if (v > 07777) return invalidArg("mode", "mode out of range");
  return v;
}

}  // namespace

namespace {
// The error naming `field` unless it names one already.
Status withField(const Status& st, const char* field) {
  if (!st.field().empty()) return st;
  return Status(st.code(), st.message(), 0, field);
}
}  // namespace

json sandboxToApi(const SandboxRecord& r) { return toApi(r); }

extern const std::initializer_list<const char*> kCreateFields;
const std::initializer_list<const char*> kCreateFields = {
    "image",      "backend",  "cpu",      "memory_mb",      "disk_mb",        "pids",
    "ttl_s",      "idle_timeout_s", "auto_pause_s", "env", "labels",       "workspaces",
    "toolkits",   "diffs",    "snapshot", "policy",         "readonly_paths", "hidden_paths",
    "user",       "pool",     "spread",   "burstable"};

void Platform::createSandbox(http::Request& req, http::Response& res) {
  auto parsed = parseObject(req, kCreateFields);
  if (!parsed.isOk()) return sendError(res, parsed.status());
  auto r = checkCreate(*parsed);
  if (!r.isOk()) return sendError(res, r.status());
  auto made = launch(std::move(*r));
  if (!made.isOk()) return sendError(res, made.status());
  sendJson(res, 201, dumpJson(toApi(*made)));
}

Result<SandboxRecord> Platform::checkCreate(const json& j) {
  SandboxRecord r;
  r.owner = currentCaller().tenant;
  {
    auto image = getString(j, "image", "", 512);
    if (!image.isOk()) return (image.status());
    if (image->empty() && !j.contains("snapshot")) {
      return (invalidArg("image", "image (or snapshot) is required"));
    }
    r.image = *image;
    auto backend = getString(j, "backend", "container", 32);
    if (!backend.isOk()) return (backend.status());
    // microvm is known; whether this node can run it is the edge's to say
    // (409 with the reason when it cannot).
    auto kind = proto::parseBackend(*backend);
    if (!kind) {
      return (invalidArg("backend", "unknown backend '" + *backend +
                                            "' (known: container, fncall, microvm, vm)"));
    }
    r.backend = *kind;
    auto cpu = getNumber(j, "cpu", 1.0, 0.05, 64);
    if (!cpu.isOk()) return (cpu.status());
    r.cpu = *cpu;
    auto mem = getInt(j, "memory_mb", 512, 16, 262144);
    if (!mem.isOk()) return (mem.status());
    r.memoryMb = *mem;
    auto disk = getInt(j, "disk_mb", 1024, 16, 1048576);
    if (!disk.isOk()) return (disk.status());
    r.diskMb = *disk;
    r.diskExplicit = j.contains("disk_mb");
    auto pids = getInt(j, "pids", 1024, 16, 65536);
    if (!pids.isOk()) return (pids.status());
    r.pids = *pids;
    auto ttl = getInt(j, "ttl_s", 3600, 0, 604800);
    if (!ttl.isOk()) return (ttl.status());
    r.ttlS = *ttl;
    auto idle = getInt(j, "idle_timeout_s", 0, 0, 604800);
    if (!idle.isOk()) return (idle.status());
    r.idleTimeoutS = *idle;
    auto autoPause = getInt(j, "auto_pause_s", 0, 0, 604800);
    if (!autoPause.isOk()) return (autoPause.status());
    r.autoPauseS = *autoPause;
    auto env = getStringMap(j, "env");
    if (!env.isOk()) return (env.status());
    if (Status st = validateEnv(*env, "env"); !st.isOk()) return (st);
    r.env = *env;
    auto user = getString(j, "user", "", 64);
    if (!user.isOk()) return (user.status());
    if (Status st = validateUserSpec(*user, "user"); !st.isOk()) return (st);
    r.user = *user;
    auto labels = getStringMap(j, "labels");
    if (!labels.isOk()) return (labels.status());
    if (Status st = validateLabels(*labels); !st.isOk()) return (st);
    r.labels = *labels;
    if (Status st = parsePlacement(j, r); !st.isOk()) return (st);  // platform_nodes.cc
    auto policy = getString(j, "policy", "default", 64);
    if (!policy.isOk()) return (policy.status());
    auto found = policies_->find(*policy, "policy");
    if (!found.isOk()) return (found.status());
    r.policy = *policy;
    for (auto [field, out] : {std::pair{"readonly_paths", &r.readonlyPaths},
                              std::pair{"hidden_paths", &r.hiddenPaths}}) {
      auto paths = getStringList(j, field);
      if (!paths.isOk()) return (paths.status());
      if (Status st = validatePolicyPaths(*paths, field); !st.isOk()) return (st);
      *out = *paths;
    }
  }
  // Resolve the image, then the layers stacked on it at create time:
  // workspaces, toolkits, diffs, each list bottom first.
  // snapshot: a pack_diff image brings its stack; image/workspaces/toolkits
  // must then be left out (they come from the snapshot).
  json stack = j;
  if (auto snap = j.find("snapshot"); snap != j.end() && !snap->is_null()) {
    if (!snap->is_string()) return (invalidArg("snapshot", "snapshot must be an image ref"));
    for (const char* f : {"workspaces", "toolkits"}) {
      if (j.contains(f)) return (invalidArg(f, std::string(f) + " come from the snapshot"));
    }
    std::string sname, stag;
    if (Status st = parseImageRef(snap->get<std::string>(), sname, stag); !st.isOk()) {
      return (invalidArg("snapshot", st.message()));
    }
    auto img = visibleImage(sname, stag);
    if (!img.isOk()) return withField(img.status(), "snapshot");
    json parent = json::parse(img->parent, nullptr, false);
    if (img->kind != "diff" || !parent.is_object()) {
      return (invalidArg("snapshot", sname + ":" + stag + " is not a pack_diff snapshot"));
    }
    if (!r.image.empty() && r.image != parent.value("image", "")) {
      return (invalidArg(
          "image", "the snapshot was made on " + parent.value("image", "") + ", not " + r.image));
    }
    r.image = parent.value("image", "");
    stack["workspaces"] = parent.value("workspaces", json::array());
    stack["toolkits"] = parent.value("toolkits", json::array());
    json diffs = json::array({sname + ":" + stag});
    if (auto d = j.find("diffs"); d != j.end() && d->is_array()) {
      for (auto& x : *d) diffs.push_back(x);
    }
    stack["diffs"] = diffs;
  }
  auto stackOn = [&](const char* field, const std::string& kind,
                     std::vector<std::string>* asked) -> Status {
    auto it = stack.find(field);
    if (it == stack.end() || it->is_null()) return Status::ok();
    if (!it->is_array() || it->size() > 32) {
      return invalidArg(field, std::string(field) + " must be a list of up to 32 references");
    }
    for (auto& ref : *it) {
      if (!ref.is_string() || ref.get<std::string>().empty()) {
        return invalidArg(field, std::string(field) + " items must be image refs or digests");
      }
      ASSIGN_OR_RETURN(auto layers, resolveLayers(ref.get<std::string>(), kind, field));
      asked->push_back(ref.get<std::string>());
      r.layers.insert(r.layers.end(), layers.begin(), layers.end());
    }
    return Status::ok();
  };
  image::ImageConfig imageConfig;  // none for a bare layer digest
  {
    // A vm boots a disk image (kind disk, docs/vm.md); every other backend
    // stacks layers. Each refuses the other's.
    std::string imageKind;
    if (startsWith(r.image, "sha256:")) {
      auto base = resolveLayers(r.image, "", "image");
      if (!base.isOk()) return (base.status());
      r.layers = *base;
      if (auto blob = store_->getBlob(r.image); blob.isOk()) imageKind = blob->kind;
    } else {
      // One read, so layers and config come from the same version of the image.
      std::string name, tag;
      if (Status st = parseImageRef(r.image, name, tag); !st.isOk()) {
        return (invalidArg("image", st.message()));
      }
      auto img = visibleImage(name, tag);
      if (!img.isOk() && img.status().code() == Code::kNotFound) img = pullOnCreate(name, tag);
      if (!img.isOk()) return withField(img.status(), "image");
      r.layers = img->layers;
      imageConfig = img->config;
      r.image = name + ":" + tag;
      imageKind = img->kind;
    }
    if (r.backend == BackendKind::kVm && imageKind != "disk") {
      return (Status(Code::kConflict,
                         "backend vm boots a disk image (dsec image import --kind disk); " +
                             r.image + " is a " + (imageKind.empty() ? "layer" : imageKind) +
                             " image",
                         0, "image"));
    }
    if (r.backend != BackendKind::kVm && imageKind == "disk") {
      return (Status(Code::kConflict,
                         r.image + " is a disk image: it boots only with backend vm", 0,
                         "image"));
    }
    if (r.backend == BackendKind::kVm) {
      for (const char* f : {"workspaces", "toolkits", "diffs", "snapshot"}) {
        if (j.contains(f)) {
          return (invalidArg(f, std::string(f) + " do not apply to backend vm (one disk image)"));
        }
      }
    }
    for (auto [field, kind, asked] :
         {std::tuple{"workspaces", "workspace", &r.workspaces},
          std::tuple{"toolkits", "toolkit", &r.toolkits}, std::tuple{"diffs", "diff", &r.diffs}}) {
      if (Status st = stackOn(field, kind, asked); !st.isOk()) return (st);
    }
    std::set<std::string> seen;
    for (auto& d : r.layers) {
      if (!seen.insert(d).second) {
        return (invalidArg("image", "layer " + d + " appears twice in the stack"));
      }
    }
    if (r.layers.size() > 128) return (invalidArg("image", "more than 128 layers"));
  }
  // The image's config gives the defaults, as a container runtime applies it;
  // what the request says wins.
  {
    std::map<std::string, std::string> env = envMap(imageConfig.env);
    for (auto& [k, v] : r.env) env[k] = v;
    r.env = std::move(env);
    if (r.user.empty()) r.user = imageConfig.user;
    r.workingDir = imageConfig.workingDir;
  }
  return r;
}

// The first phase's policy goes with the create: its limits are the
// cgroups' first, its file rules the agent's init (no round trip), and a new
// sandbox has no egress until rules are set. On error the edge keeps nothing.
proto::SandboxSpec Platform::edgeSpec(const SandboxRecord& r, const PolicyPlan& plan) {
  proto::SandboxSpec spec;
  spec.id = r.id;
  spec.layers = r.layers;
  spec.cpu = plan.limits.cpu;
  spec.memoryBytes = plan.limits.memoryBytes;
  spec.diskBytes = r.diskMb << 20;
  spec.diskExplicit = r.diskExplicit;
  spec.pids = plan.limits.pids;
  spec.initPolicy = plan.agentBody;
  spec.pool = r.pool;
  spec.spread = r.spread;
  spec.burstable = r.burstable;
  spec.tenant = r.owner;
  // As Docker does: a WorkingDir the image lacks is made (root's, 0755), or
  // every exec would fail to chdir into it.
  spec.workingDir = r.workingDir;
  // A VM's NIC exists from boot or never (docs/microvm.md, "Network").
  spec.network = !plan.egress.empty();
  return spec;
}

std::vector<std::optional<Status>> Platform::createManyOnEdge(std::vector<SandboxRecord>& rs) {
  std::vector<std::optional<Status>> out(rs.size());
  auto* cluster = cluster_;
  if (!cluster || rs.size() == 1) {
    for (size_t i = 0; i < rs.size(); ++i) out[i] = createOnEdge(rs[i]);
    return out;
  }
  std::vector<proto::SandboxSpec> specs;
  std::vector<size_t> at;  // specs[k] is rs[at[k]]
  std::vector<std::vector<proto::EgressRule>> egress;
  const BackendKind backend = rs[0].backend;
  for (size_t i = 0; i < rs.size(); ++i) {
    if (rs[i].backend != backend) continue;  // not attempted: queued again
    rs[i].phases.push_back({rs[i].policy, nowSeconds()});
    auto plan = planPolicy(rs[i]);
    if (!plan.isOk()) {
      out[i] = Status(plan.status()).withContext("apply policy " + rs[i].policy);
      continue;
    }
    specs.push_back(edgeSpec(rs[i], *plan));
    egress.push_back(std::move(plan->egress));
    at.push_back(i);
  }
  auto res = cluster->createGroup(backend, specs);
  for (size_t k = 0; k < at.size(); ++k) {
    SandboxRecord& r = rs[at[k]];
    if (!res[k]) {
      r.phases.pop_back();  // not attempted: queued again
      continue;
    }
    Status st = *res[k];
    if (st.isOk() && !egress[k].empty()) {
      st = cluster_->setEgress(r.id, egress[k]);
      if (!st.isOk()) {
        st.withContext("apply policy " + r.policy);
        (void)cluster_->destroy(r.id);
      }
    }
    out[at[k]] = st;
  }
  return out;
}

Status Platform::createOnEdge(SandboxRecord& r) {
  r.phases.push_back({r.policy, nowSeconds()});
  auto plan = planPolicy(r);
  Status st = plan.isOk() ? Status::ok() : Status(plan.status()).withContext("apply policy " + r.policy);
  if (st.isOk()) st = cluster_->create(r.backend, edgeSpec(r, *plan));
  if (st.isOk() && !plan->egress.empty()) {
    st = cluster_->setEgress(r.id, plan->egress);
    if (!st.isOk()) {
      st.withContext("apply policy " + r.policy);
      (void)cluster_->destroy(r.id);
    }
  }
  return st;
}

// From a checked record (layers resolved, env/user/working dir final) to a
// running sandbox, or to nothing at all.
Result<SandboxRecord> Platform::launch(SandboxRecord r) {
  Laps laps;
  r.id = "sb-" + randomHex(8);
  r.state = SandboxState::kCreating;
  r.replica = opts_.replicaId;
  r.createdAt = r.updatedAt = nowSeconds();
  r.expiresAt = r.ttlS > 0 ? r.createdAt + double(r.ttlS) : 0;
  // The owner's quotas are checked against its live records, under the same
  // lock that adds this one: concurrent creates cannot both slip under a limit.
  ASSIGN_OR_RETURN(auto owner, tenants_->tenant(r.owner));
  bool shuttingDown;
  Status admitted;
  {
    std::lock_guard lk(mu_);
    shuttingDown = stopping_;
    if (!shuttingDown) admitted = admitLocked(r, owner);
    if (!shuttingDown && admitted.isOk()) {
      sandboxes_[r.id] = r;
      indexLocked(r);
    }
  }
  if (shuttingDown) return Status(Code::kUnavailable, "platform is shutting down");
  RETURN_IF_ERROR(admitted);
  // Persisted before the edge acts, so a crash mid-create leaves a record that
  // start-up recovery resolves.
  if (Status st = store_->putSandbox(r); !st.isOk()) {
    {
      std::lock_guard lk(mu_);
      sandboxes_.erase(r.id);
    }
    return st;
  }
  laps.lap("put1");
  Status st = createOnEdge(r);
  laps.lap("edge");
  if (!st.isOk()) {
    // Nothing half-made: the edge cleaned up; drop the record too.
    log::warn("create " + r.id + " failed: " + st.toString());
    {
      std::lock_guard lk(mu_);
      sandboxes_.erase(r.id);
      deleteRequested_.erase(r.id);
    }
    stateCv_.notify_all();
    (void)store_->deleteSandbox(r.id);
    return st;
  }
  bool cancelled;
  {
    std::lock_guard lk(mu_);
    cancelled = deleteRequested_.erase(r.id) > 0 || stopping_;
    auto& cur = sandboxes_[r.id];
    cur.phases = r.phases;
    cur.node = cluster_->nodeOf(r.id);
    cur.state = cancelled ? SandboxState::kStopped : SandboxState::kRunning;
    cur.updatedAt = nowSeconds();
    // Idle time counts from when it could first be called, not from the request.
    if (!cancelled) lastCall_[r.id] = cur.updatedAt;
    if (cancelled) {
      cur.stoppedAt = cur.updatedAt;
      cur.error = "deleted while being created";
    }
    r = cur;
  }
  if (cancelled) (void)cluster_->destroy(r.id);
  Status ps = store_->putSandbox(r);
  laps.lap("put2");
  log::debug("launch " + r.id + " ms: " + laps.str());
  stateCv_.notify_all();
  if (cancelled) {
    return Status(Code::kConflict, "sandbox " + r.id + " was deleted while being created");
  }
  if (!ps.isOk()) {
    (void)cluster_->destroy(r.id);
    {
      std::lock_guard lk(mu_);
      sandboxes_.erase(r.id);
    }
    stateCv_.notify_all();
    (void)store_->deleteSandbox(r.id);
    return ps;
  }
  return r;
}

void Platform::listSandboxes(http::Request& req, http::Response& res) {
  if (store_->shared()) syncSandboxes();  // what other replicas made just now
  auto filter = labelFilter(req);
  if (!filter.isOk()) return sendError(res, filter.status());
  const std::map<std::string, std::string>& want = *filter;
  std::optional<SandboxState> state;
  if (auto s = req.param("state")) {
    state = proto::parseState(*s);
    if (!state) {
      return sendError(res, invalidArg("state", "unknown state '" + *s +
                                                    "' (pending, creating, running, paused, lost, "
                                                    "stopping, stopped, failed)"));
    }
  }
  auto batch = req.param("batch");
  // At fleet scale (the console's list): the newest N, and how many match.
  size_t limit = SIZE_MAX;
  if (auto l = req.param("limit")) {
    char* end = nullptr;
    long long v = std::strtoll(l->c_str(), &end, 10);
    if (l->empty() || *end != '\0' || v < 1 || v > 10000) {
      return sendError(res, invalidArg("limit", "limit must be an integer from 1 to 10000"));
    }
    limit = size_t(v);
  }
  int sortBy = 0;  // 0: by id (as ever); 1: oldest first; -1: newest first
  if (auto s = req.param("sort")) {
    if (*s == "created") {
      sortBy = 1;
    } else if (*s == "-created") {
      sortBy = -1;
    } else {
      return sendError(res,
                       invalidArg("sort", "sort must be created or -created, not '" + *s + "'"));
    }
  }
  json arr = json::array();
  size_t total = 0;
  {
    std::lock_guard lk(mu_);
    std::vector<const SandboxRecord*> match;
    for (auto& [id, r] : sandboxes_) {
      if (!mayAccess(currentCaller(), r.owner)) continue;  // another tenant's
      if (state && r.state != *state) continue;
      if (batch && r.batch != *batch) continue;
      bool ok = true;
      for (auto& [k, v] : want) {
        auto it = r.labels.find(k);
        ok = ok && it != r.labels.end() && it->second == v;
      }
      if (ok) match.push_back(&r);
    }
    total = match.size();
    if (sortBy != 0) {
      // Ties (a batch's sandboxes share a second) by id, so pages are stable.
      auto older = [](const SandboxRecord* a, const SandboxRecord* b) {
        return a->createdAt != b->createdAt ? a->createdAt < b->createdAt : a->id < b->id;
      };
      size_t keep = std::min(limit, match.size());
      auto cmp = [&](const SandboxRecord* a, const SandboxRecord* b) {
        return sortBy > 0 ? older(a, b) : older(b, a);
      };
      std::partial_sort(match.begin(), match.begin() + keep, match.end(), cmp);
    }
    if (match.size() > limit) match.resize(limit);
    for (auto* r : match) arr.push_back(toApi(*r));
  }
  sendJson(res, 200, dumpJson(json{{"sandboxes", arr}, {"total", total}}));
}

void Platform::getSandbox(const std::string& id, http::Response& res) {
  SandboxRecord r;
  bool found;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    found = it != sandboxes_.end();
    if (found) r = it->second;
  }
  if (!found) return sendError(res, notFound("sandbox " + id + " not found"));
  json j = toApi(r);
  if (r.state == SandboxState::kRunning) {
    if (auto s = cluster_->stats(id); s.isOk()) {
      j["stats"] = {{"oom_kills", s->oomKills},
                    {"pids_limit_hits", s->pidsLimitHits},
                    {"memory_bytes", s->memoryBytes},
                    {"cpu_usec", s->cpuUsec},
                    {"pids", s->pids}};
    }
  }
  sendJson(res, 200, dumpJson(j));
}

void Platform::getStats(const std::string& id, http::Request& req, http::Response& res) {
  double window = 3600;
  if (auto w = req.param("window_s")) {
    char* end = nullptr;
    window = std::strtod(w->c_str(), &end);
    if (w->empty() || *end != '\0' || !(window >= 1 && window <= 3600)) {
      return sendError(res, invalidArg("window_s", "window_s must be a number from 1 to 3600"));
    }
  }
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return sendError(res, notFound("sandbox " + id + " not found"));
    r = it->second;
  }
  // The limits in force: the sandbox's own under its policy's ceilings.
  proto::CgroupLimits lim{r.cpu, r.memoryMb << 20, r.pids};
  if (auto plan = planPolicy(r); plan.isOk()) lim = plan->limits;
  proto::StatsSeries series;
  series.intervalS = 0;
  // Only a live sandbox's node has readings (looking does not resume a
  // paused one); the rest answer empty series.
  if (r.state == SandboxState::kRunning || r.state == SandboxState::kPaused) {
    auto h = cluster_->statsHistory(id, window);
    if (h.isOk()) {
      series = std::move(*h);
    } else if (r.state == SandboxState::kRunning) {
      return sendError(res, h.status());
    }  // else a VM paused to disk: no figures now, and none kept (an older node)
  }
  json t = json::array(), cpu = json::array(), mem = json::array(), pids = json::array();
  auto cores = proto::cpuCores(series.samples);
  for (size_t i = 0; i < series.samples.size(); ++i) {
    const auto& s = series.samples[i];
    t.push_back(std::round(s.t * 1000) / 1000);
    cpu.push_back(cores[i] ? json(std::round(*cores[i] * 10000) / 10000) : json(nullptr));
    mem.push_back(s.memoryBytes);
    pids.push_back(s.pids);
  }
  json j = {{"id", id},
            {"state", proto::stateName(r.state)},
            {"window_s", window},
            {"interval_s", series.intervalS},
            {"t", std::move(t)},
            {"cpu", std::move(cpu)},
            {"memory_bytes", std::move(mem)},
            {"pids", std::move(pids)},
            {"cpu_limit", lim.cpu},
            {"memory_limit_bytes", lim.memoryBytes},
            {"pids_limit", lim.pids}};
  sendJson(res, 200, dumpJson(j));
}

Result<Platform::PolicyPlan> Platform::planPolicy(const SandboxRecord& r) {
  ASSIGN_OR_RETURN(Policy p, policies_->find(r.policy, "policy"));
  PolicyPlan plan;
  ASSIGN_OR_RETURN(plan.egress, egressRules(p));
  // The lower of the sandbox's own limits and the policy's ceilings, every
  // switch (so leaving a tighter policy lifts its ceilings again).
  proto::CgroupLimits& lim = plan.limits;
  lim.cpu = p.limits.cpu > 0 ? std::min(r.cpu, p.limits.cpu) : r.cpu;
  int64_t memMb = p.limits.memoryMb > 0 ? std::min(r.memoryMb, p.limits.memoryMb) : r.memoryMb;
  lim.memoryBytes = memMb << 20;
  lim.pids = p.limits.pids > 0 ? std::min(r.pids, p.limits.pids) : r.pids;
  json body = {{"readonly", p.readonlyPaths}, {"hidden", p.hiddenPaths}};
  for (auto& x : r.readonlyPaths) body["readonly"].push_back(x);
  for (auto& x : r.hiddenPaths) body["hidden"].push_back(x);
  if (!p.dns.empty()) body["dns"] = p.dns;
  body["syscalls"] = p.syscalls;
  plan.agentBody = body.dump();
  return plan;
}

Status Platform::applyPolicy(const SandboxRecord& r) {
  auto plan = planPolicy(r);
  if (!plan.isOk()) return Status(plan.status()).withContext("apply policy " + r.policy);
  if (Status st = cluster_->setLimits(r.id, plan->limits); !st.isOk()) {
    return st.withContext("apply policy " + r.policy);
  }
  auto applyFiles = [&]() -> Status {
    auto res = cluster_->agentOp(r.id, proto::AgentOp::kPolicy, plan->agentBody);
    return res.isOk() ? Status::ok() : res.status();
  };
  // Closing goes first and opening last, so a switch is never more open
  // than either policy, even for a moment.
  Status st;
  if (plan->egress.empty()) {
    st = cluster_->setEgress(r.id, {});
    if (st.isOk()) st = applyFiles();
  } else {
    st = applyFiles();
    if (st.isOk()) st = cluster_->setEgress(r.id, plan->egress);
  }
  if (!st.isOk()) return st.withContext("apply policy " + r.policy);
  return Status::ok();
}

void Platform::setPhase(const std::string& id, http::Request& req, http::Response& res) {
  auto j = parseObject(req, {"policy", "readonly_paths", "hidden_paths"});
  if (!j.isOk()) return sendError(res, j.status());
  auto name = getString(*j, "policy", "", 64);
  if (!name.isOk()) return sendError(res, name.status());
  if (name->empty()) return sendError(res, invalidArg("policy", "policy is required"));
  if (auto p = policies_->find(*name, "policy"); !p.isOk()) return sendError(res, p.status());
  std::vector<std::string> extra[2];
  const char* fields[2] = {"readonly_paths", "hidden_paths"};
  for (int k = 0; k < 2; ++k) {
    auto paths = getStringList(*j, fields[k]);
    if (!paths.isOk()) return sendError(res, paths.status());
    if (Status st = validatePolicyPaths(*paths, fields[k]); !st.isOk()) return sendError(res, st);
    extra[k] = *paths;
  }
  auto rec = runningSandbox(id);
  if (!rec.isOk()) return sendError(res, rec.status());
  SandboxRecord r = *rec;
  r.policy = *name;
  r.readonlyPaths = extra[0];
  r.hiddenPaths = extra[1];
  r.phases.push_back({r.policy, nowSeconds()});
  r.updatedAt = nowSeconds();
  if (Status st = applyPolicy(r); !st.isOk()) {
    // A grant refused after the files part applied (a VM booted without a
    // NIC, a node without egress) must not leave the new policy's file rules
    // under the old record (eval's hidden paths unhidden): back to the old.
    if (Status back = applyPolicy(*rec); !back.isOk()) {
      log::error("sandbox " + id + ": restoring policy " + rec->policy + ": " + back.toString());
    }
    return sendError(res, st);
  }
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || it->second.state != SandboxState::kRunning) {
      return sendError(res, Status(Code::kFailedPrecondition, "sandbox " + id + " stopped"));
    }
    it->second.policy = r.policy;
    it->second.readonlyPaths = r.readonlyPaths;
    it->second.hiddenPaths = r.hiddenPaths;
    it->second.phases = r.phases;
    it->second.updatedAt = r.updatedAt;
    r = it->second;
  }
  // Recorded before it is acknowledged.
  if (Status st = store_->putSandbox(r); !st.isOk()) return sendError(res, st);
  sendJson(res, 200, dumpJson(toApi(r)));
}

void Platform::getAudit(const std::string& id, http::Response& res) {
  auto rec = runningSandbox(id);
  if (!rec.isOk()) return sendError(res, rec.status());
  auto r = cluster_->agentOp(id, proto::AgentOp::kAudit, "{}");
  if (!r.isOk()) return sendError(res, r.status());
  json j = json::parse(*r, nullptr, false);
  if (!j.is_object()) return sendError(res, Status(Code::kInternal, "agent sent a bad audit"));
  j.erase("ok");
  j["id"] = id;
  auto eg = cluster_->egressDenials(id);
  if (!eg.isOk()) return sendError(res, eg.status());
  j["egress_denied"] = eg->count;
  j["egress_last_denied"] = eg->last;
  sendJson(res, 200, dumpJson(j));
}

void Platform::deleteSandbox(const std::string& id, http::Response& res) {
  auto rec = destroy(id, SandboxState::kStopped, "");
  if (!rec.isOk()) return sendError(res, rec.status());
  sendJson(res, 200, dumpJson(toApi(*rec)));
}

Result<Platform::ExecPlan> Platform::planExec(const std::string& id, const json& j,
                                              http::Request& req) {
  auto sb = runningSandbox(id);
  if (!sb.isOk()) return sb.status();

  ExecPlan plan;
  proto::ExecSpec& spec = plan.spec;
  auto cmd = j.find("cmd");
  if (cmd == j.end() || cmd->is_null()) return invalidArg("cmd", "cmd is required");
  if (cmd->is_string()) {
    std::string s = cmd->get<std::string>();
    if (s.empty()) return invalidArg("cmd", "cmd is empty");
    spec.argv = {"/bin/sh", "-c", s};
  } else if (cmd->is_array() && !cmd->empty()) {
    for (auto& a : *cmd) {
      if (!a.is_string()) return invalidArg("cmd", "cmd items must be strings");
      spec.argv.push_back(a.get<std::string>());
    }
  } else {
    return invalidArg("cmd", "cmd must be a non-empty list or a string");
  }
  size_t argBytes = 0;
  for (auto& a : spec.argv) {
    if (a.find('\0') != std::string::npos) {
      return invalidArg("cmd", "cmd must not contain NUL");
    }
    argBytes += a.size();
  }
  if (argBytes > (512u << 10)) return invalidArg("cmd", "cmd longer than 512 KiB");
  auto env = getStringMap(j, "env");
  if (!env.isOk()) return env.status();
  if (Status st = validateEnv(*env, "env"); !st.isOk()) return st;
  std::map<std::string, std::string> merged = sb->env;
  for (auto& [k, v] : *env) merged[k] = v;
  for (auto& [k, v] : merged) spec.env.push_back(k + "=" + v);
  auto cwd = getString(j, "cwd", "", 4096);
  if (!cwd.isOk()) return cwd.status();
  if (!cwd->empty() && (*cwd)[0] != '/') {
    return invalidArg("cwd", "cwd must be an absolute path");
  }
  // Unset cwd and user fall back to the sandbox's (from its image config).
  spec.cwd = cwd->empty() ? sb->workingDir : *cwd;
  auto user = getString(j, "user", "", 64);
  if (!user.isOk()) return user.status();
  if (Status st = validateUserSpec(*user, "user"); !st.isOk()) return st;
  spec.user = user->empty() ? sb->user : *user;
  auto timeout = getNumber(j, "timeout_s", 60, 0.001, 86400);
  if (!timeout.isOk()) return timeout.status();
  spec.timeoutMs = std::max<int64_t>(1, int64_t(*timeout * 1000));
  // The policy in force caps time and output (PolicyLimits); a caller that
  // asks for more gets the policy's figure.
  const PolicyLimits caps = policies_->limitsOf(sb->policy);
  if (caps.maxExecTimeoutS > 0) {
    spec.timeoutMs = std::min<int64_t>(spec.timeoutMs,
                                       std::max<int64_t>(1, int64_t(caps.maxExecTimeoutS * 1000)));
  }
  auto cap = getInt(j, "max_output_bytes", 1 << 20, 0, kMaxOutputCap);
  if (!cap.isOk()) return cap.status();
  spec.maxOutput = *cap;
  if (caps.maxOutputBytes > 0)
    spec.maxOutput = std::min<int64_t>(spec.maxOutput, caps.maxOutputBytes);
  auto encoding = getString(j, "encoding", "utf-8", 16);
  if (!encoding.isOk()) return encoding.status();
  if (*encoding != "utf-8" && *encoding != "base64") {
    return invalidArg("encoding", "encoding must be utf-8 or base64");
  }
  plan.b64 = *encoding == "base64";
  if (j.contains("stdin") && j.contains("stdin_b64")) {
    return invalidArg("stdin", "give stdin or stdin_b64, not both");
  }
  auto stdinText = getString(j, "stdin", "", kMaxStdin);
  if (!stdinText.isOk()) {
    // NUL is fine in stdin; only the type and size matter here.
    auto it = j.find("stdin");
    if (!it->is_string() || it->get<std::string>().size() > kMaxStdin) {
      return stdinText.status();
    }
    spec.stdinData = it->get<std::string>();
  } else if (j.contains("stdin")) {
    spec.stdinData = *stdinText;
  }
  if (j.contains("stdin_b64")) {
    auto raw = getString(j, "stdin_b64", "", kMaxStdin * 4 / 3 + 4);
    if (!raw.isOk()) return raw.status();
    auto dec = base64Decode(*raw);
    if (!dec.isOk()) return invalidArg("stdin_b64", "stdin_b64 is not base64");
    spec.stdinData = std::move(*dec);
  }
  auto stream = getBool(j, "stream", false);
  if (!stream.isOk()) return stream.status();
  plan.streaming =
      *stream || req.header("accept").find("application/x-ndjson") != std::string::npos;
  return plan;


}

namespace {

json execResultJson(const proto::ExecResult& r, bool b64) {
  json out = {{"exit_code", r.exitCode},   {"signal", r.signal},
              {"truncated", r.truncated},  {"timed_out", r.timedOut},
              {"oom_killed", r.oomKilled}, {"duration_ms", r.durationMs}};
  // fncall sandboxes: which limit stopped the call (docs/fncall.md).
  if (r.call) out["limit"] = r.limit.empty() ? json(nullptr) : json(r.limit);
  if (b64) {
    out["stdout"] = base64Encode(r.out);
    out["stderr"] = base64Encode(r.err);
    out["encoding"] = "base64";
  } else {
    out["stdout"] = r.out;
    out["stderr"] = r.err;
  }
  return out;
}

}  // namespace

Platform::StepAnswer Platform::stepAnswer(const StepKey& key, const StepOutcome& o) {
  if (o.replayed) {
    std::lock_guard lk(trajMu_);
    ++replays_[key.trajectory][key.step];
  }
  StepAnswer a;
  a.headers = {{"Dsec-Replayed", o.replayed ? "true" : "false"}, {"Dsec-Step-Digest", o.digest}};
  a.status = o.status;
  a.contentType = o.contentType;
  a.body = o.body;
  if (o.contentType == "application/json") {
    json j = json::parse(o.body, nullptr, false);
    if (j.is_object()) {
      j["replayed"] = o.replayed;
      j["trajectory_id"] = trajectoryAsSeenBy(currentCaller(), key.trajectory).value_or("");
      j["step"] = key.step;
      a.body = dumpJson(j);
    }
  }
  return a;
}

void Platform::sendStep(http::Response& res, const StepKey& key, const StepOutcome& o) {
  StepAnswer a = stepAnswer(key, o);
  for (auto& [k, v] : a.headers) res.setHeader(k, v);
  (void)res.send(a.status, a.contentType, a.body);
}

void Platform::sendStep(http::Deferred& d, const StepKey& key, const StepOutcome& o) {
  StepAnswer a = stepAnswer(key, o);
  for (auto& [k, v] : a.headers) d.setHeader(k, v);
  (void)d.send(a.status, a.contentType, a.body);
}

void Platform::execSandbox(const std::string& id, http::Request& req, http::Response& res,
                           std::shared_ptr<void> activity) {
  auto parsed = parseObject(req, {"cmd", "env", "cwd", "user", "timeout_s", "stdin", "stdin_b64",
                                  "max_output_bytes", "encoding", "stream", "trajectory_id",
                                  "step"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  json j = *parsed;
  auto key = Chronus::parseKey(j.contains("trajectory_id") ? &j["trajectory_id"] : nullptr,
                               j.contains("step") ? &j["step"] : nullptr);
  if (!key.isOk()) return sendError(res, key.status());
  j.erase("trajectory_id");
  j.erase("step");
  if (*key) {
    // A step is replayed whole, so it runs whole: no streaming. It runs to
    // its end even if its client goes away: the log keeps its result for the
    // client's retry.
    bool streamAsked = j.value("stream", false) ||
                       req.header("accept").find("application/x-ndjson") != std::string::npos;
    if (streamAsked) {
      return sendError(res, invalidArg("stream", "a trajectory step cannot be streamed"));
    }
    const StepKey k = **key;
    const std::string sid = routeStep(id, k.trajectory);
    auto d = res.defer();
    chronus_->onceAsync(
        k, "exec", sid, j,
        [&, sid, activity](Chronus::StepDone finish) {
          // Runs here, during the handler (req is valid).
          auto plan = planExec(sid, j, req);
          if (!plan.isOk()) return finish(plan.status());
          bool b64 = plan->b64;
          proto::ExecCallbacks cb;
          cb.onDone = [finish, b64, activity](Result<proto::ExecResult> r) {
            if (!r.isOk()) return finish(r.status());
            finish(StepOutcome{200, "application/json", dumpJson(execResultJson(*r, b64))});
          };
          (void)cluster_->startExec(sid, plan->spec, std::move(cb));
        },
        [this, d, k, sid, caller = currentCaller()](Result<StepOutcome> out) {
          CallerScope scope(caller);  // may run on another thread
          if (!out.isOk()) return sendError(*d, out.status());
          if (!out->replayed) noteStepSandbox(k.trajectory, sid);
          sendStep(*d, k, *out);
        });
    return;
  }
  auto planned = planExec(id, j, req);
  if (!planned.isOk()) return sendError(res, planned.status());
  const bool b64 = planned->b64;
  auto d = res.defer();
  proto::ExecCallbacks cb;
  if (!planned->streaming) {
    cb.onDone = [d, b64, activity](Result<proto::ExecResult> r) {
      if (!r.isOk()) return sendError(*d, r.status());
      sendJson(*d, 200, dumpJson(execResultJson(*r, b64)));
    };
  } else {
    (void)d->beginChunked(200, "application/x-ndjson");
    // Output goes out as it comes; what the client has not taken yet queues
    // in memory, bounded by the exec's output caps.
    cb.onOutput = [d, b64](bool isErr, std::string_view data) {
      json ev = {{"type", isErr ? "stderr" : "stdout"}};
      if (b64) {
        ev["data_b64"] = base64Encode(data);
      } else {
        ev["data"] = std::string(data);
      }
      (void)d->write(dumpJson(ev) + "\n");
    };
    cb.onDone = [d, activity](Result<proto::ExecResult> r) {
      json last;
      if (r.isOk()) {
        last = execResultJson(*r, false);
        last.erase("stdout");
        last.erase("stderr");
        last.erase("encoding");
        last["type"] = "exit";
      } else {
        last = {{"type", "error"},
                {"error",
                 {{"code", codeName(r.status().code())}, {"message", r.status().message()}}}};
      }
      (void)d->write(dumpJson(last) + "\n");
      (void)d->finish();
    };
  }
  auto call = cluster_->startExec(id, planned->spec, std::move(cb));
  // The client went away: its exec's process group is killed.
  d->onClientGone([call] { call->cancel(); });
}

namespace {

// The agent's kMkdir arguments from a mkdir request body.
Result<json> mkdirArgs(const json& body) {
  ASSIGN_OR_RETURN(std::string path, getString(body, "path", "", 4096));
  if (path.empty() || path[0] != '/') return invalidArg("path", "path must be absolute");
  ASSIGN_OR_RETURN(bool parents, getBool(body, "parents", true));
  ASSIGN_OR_RETURN(int64_t mode, getInt(body, "mode", 0755, 0, 07777));
  return json{{"path", path}, {"parents", parents}, {"mode", mode}};
}

// The `recursive` query parameter of a remove: "true" or "false" (default).
Result<bool> recursiveParam(const http::Request& req) {
  std::string rec = req.param("recursive").value_or("false");
  if (rec != "true" && rec != "false") {
    return invalidArg("recursive", "recursive must be true or false");
  }
  return rec == "true";
}

}  // namespace

// A file call as a trajectory step (?trajectory_id=&step=): writes, reads,
// removes and mkdirs run once; the request digest covers the path, the mode
// and the content written.
void Platform::fileStep(const std::string& asked, const std::string& op, const StepKey& key,
                        http::Request& req, http::Response& res) {
  const std::string id = routeStep(asked, key.trajectory);
  const std::string& m = req.method;
  std::string pinned;  // bytes kept for this write, pinned until the step is stored
  constexpr size_t kMaxStepBytes = 64u << 20;  // a step's result is kept whole
  json request;
  std::string kind;
  std::function<Result<StepOutcome>()> run;
  std::string content;
  if (op == "mkdir") {
    if (m != "POST") return sendError(res, invalidArg("method", "use POST for mkdir"));
    auto j = parseObject(req, {"path", "parents", "mode"});
    if (!j.isOk()) return sendError(res, j.status());
    kind = "mkdir";
    request = *j;
    run = [&, body = *j]() -> Result<StepOutcome> {
      RETURN_IF_ERROR(runningSandbox(id).status());
      ASSIGN_OR_RETURN(json args, mkdirArgs(body));
      RETURN_IF_ERROR(cluster_->agentOp(id, proto::AgentOp::kMkdir, args.dump()).status());
      return StepOutcome{200, "application/json", "{}"};
    };
  } else if (op.empty()) {
    auto path = sandboxPath(req);
    if (!path.isOk()) return sendError(res, path.status());
    request = {{"path", *path}};
    if (m == "PUT") {
      auto mode = parseMode(req.param("mode"), 0644);
      if (!mode.isOk()) return sendError(res, mode.status());
      auto body = req.readBody(kMaxStepBytes);
      if (!body.isOk()) return sendError(res, body.status());
      content = std::move(*body);
      kind = "write";
      request["mode"] = *mode;
      request["sha256"] = sha256Hex(content);
      request["size"] = content.size();
      run = [&, p = *path, md = *mode]() -> Result<StepOutcome> {
        RETURN_IF_ERROR(runningSandbox(id).status());
        // Kept durably before the step can be acknowledged, so a recover can
        // write them again (the request holds only their digest).
        ASSIGN_OR_RETURN(pinned, keepStepBytes(content));
        size_t off = 0;
        auto src = [&](char* buf, size_t n) -> Result<size_t> {
          size_t k = std::min(n, content.size() - off);
          std::memcpy(buf, content.data() + off, k);
          off += k;
          return k;
        };
        ASSIGN_OR_RETURN(uint64_t size, cluster_->writeFile(id, p, md, src));
        StepOutcome o{200, "application/json", dumpJson(json{{"path", p}, {"size", size}})};
        o.content = pinned;
        return o;
      };
    } else if (m == "GET") {
      kind = "read";
      run = [&, p = *path]() -> Result<StepOutcome> {
        RETURN_IF_ERROR(runningSandbox(id).status());
        std::string data;
        auto onSize = [](std::optional<uint64_t>) { return Status::ok(); };
        auto sink = [&](std::string_view d) -> Status {
          if (data.size() + d.size() > kMaxStepBytes) {
            return Status(Code::kPayloadTooLarge, "a trajectory step reads at most 64 MiB");
          }
          data.append(d);
          return Status::ok();
        };
        RETURN_IF_ERROR(cluster_->readFile(id, p, onSize, sink));
        return StepOutcome{200, "application/octet-stream", std::move(data)};
      };
    } else if (m == "DELETE") {
      auto recursive = recursiveParam(req);
      if (!recursive.isOk()) return sendError(res, recursive.status());
      kind = "remove";
      request["recursive"] = *recursive;
      run = [&, p = *path, r = *recursive]() -> Result<StepOutcome> {
        RETURN_IF_ERROR(runningSandbox(id).status());
        json args = {{"path", p}, {"recursive", r}};
        RETURN_IF_ERROR(cluster_->agentOp(id, proto::AgentOp::kRemove, args.dump()).status());
        return StepOutcome{200, "application/json", "{}"};
      };
    }
  }
  if (!run) {
    return sendError(res, invalidArg("trajectory_id",
                                     "only file writes, reads, removes and mkdirs are steps"));
  }
  auto out = chronus_->once(key, kind, id, request, run);
  if (!pinned.empty()) unpinStepBytes(pinned);
  if (!out.isOk()) return sendError(res, out.status());
  if (!out->replayed) noteStepSandbox(key.trajectory, id);
  sendStep(res, key, *out);
}

// Re-executes logged step `s` in sandbox `id` for a recover (the request as
// stored; a write's kept bytes). A result that differs from the logged one is
// a divergence, returned as an object; null when it matched. An error means
// the step could not be attempted (the sandbox is gone, bytes are missing)
// and the recover must stop.
Result<json> Platform::reexecStep(const std::string& id, const TrajectoryStep& s,
                                  http::Request& req) {
  const std::string where = "step " + std::to_string(s.step) + " (" + s.kind + ")";
  json q = json::parse(s.request, nullptr, false);
  if (!q.is_object()) return internalError(where + ": the stored request is not a JSON object");
  json logged = json::parse(s.body, nullptr, false);
  auto diverged = [&](const std::string& reason, json extra = json::object()) -> json {
    extra["step"] = s.step;
    extra["kind"] = s.kind;
    extra["reason"] = reason;
    return extra;
  };
  // A call that fails while the sandbox still runs is the step behaving
  // differently now; one that fails because the sandbox went stops it all.
  auto failed = [&](const Status& st) -> Result<json> {
    RETURN_IF_ERROR(runningSandbox(id).status());
    return diverged("failed: " + st.toString());
  };
  if (s.kind == "exec") {
    auto plan = planExec(id, q, req);
    if (!plan.isOk()) return failed(plan.status());
    auto r = cluster_->exec(id, plan->spec, nullptr);
    if (!r.isOk()) return failed(r.status());
    json now = {{"exit_code", r->exitCode},
                {"signal", r->signal},
                {"timed_out", r->timedOut},
                {"oom_killed", r->oomKilled}};
    json was = json::object();
    for (auto& [k, v] : now.items()) was[k] = logged.is_object() ? logged.value(k, json()) : json();
    if (now != was) {
      return diverged("exit status differs: now " + now.dump() + ", logged " + was.dump(),
                      {{"logged", was}, {"now", now}});
    }
    return json();
  }
  if (s.kind == "write") {
    if (s.content.empty()) {
      return Status(Code::kFailedPrecondition,
                    where + " was logged before the bytes of writes were kept: it cannot be "
                            "re-executed",
                    0, "trajectory_id");
    }
    auto data = readFile(stepBytesPath(s.content));
    if (!data.isOk()) {
      return Status(Code::kFailedPrecondition,
                    where + ": its kept bytes " + s.content +
                        " cannot be read: " + data.status().message(),
                    0, "trajectory_id");
    }
    if ("sha256:" + sha256Hex(*data) != s.content) {
      return internalError(where + ": its kept bytes do not match " + s.content);
    }
    size_t off = 0;
    auto src = [&](char* buf, size_t n) -> Result<size_t> {
      size_t k = std::min(n, data->size() - off);
      std::memcpy(buf, data->data() + off, k);
      off += k;
      return k;
    };
    int mode = q.value("mode", 0644);
    auto w = cluster_->writeFile(id, q.value("path", ""), mode, src);
    if (!w.isOk()) return failed(w.status());
    return json();
  }
  if (s.kind == "mkdir") {
    auto args = mkdirArgs(q);
    if (!args.isOk()) return failed(args.status());
    auto r = cluster_->agentOp(id, proto::AgentOp::kMkdir, args->dump());
    if (!r.isOk()) return failed(r.status());
    return json();
  }
  if (s.kind == "remove") {
    json args = {{"path", q.value("path", "")}, {"recursive", q.value("recursive", false)}};
    auto r = cluster_->agentOp(id, proto::AgentOp::kRemove, args.dump());
    if (!r.isOk()) return failed(r.status());
    return json();
  }
  return json();  // reads and checkpoints change nothing
}

void Platform::files(const std::string& id, const std::string& op, http::Request& req,
                     http::Response& res) {
  const std::string& m = req.method;
  {
    auto t = req.param("trajectory_id");
    auto s = req.param("step");
    json tj = t ? json(*t) : json(nullptr);
    json sj = nullptr;
    if (s) {
      int64_t v = -1;
      auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
      sj = (ec == std::errc() && end == s->data() + s->size()) ? json(v) : json(*s);
    }
    auto key = Chronus::parseKey(t ? &tj : nullptr, s ? &sj : nullptr);
    if (!key.isOk()) return sendError(res, key.status());
    if (*key) return fileStep(id, op, **key, req, res);
  }
  auto sb = runningSandbox(id);
  if (!sb.isOk()) return sendError(res, sb.status());
  if (op == "mkdir") {
    if (m != "POST") return sendError(res, invalidArg("method", "use POST for mkdir"));
    auto j = parseObject(req, {"path", "parents", "mode"});
    if (!j.isOk()) return sendError(res, j.status());
    auto args = mkdirArgs(*j);
    if (!args.isOk()) return sendError(res, args.status());
    auto r = cluster_->agentOp(id, proto::AgentOp::kMkdir, args->dump());
    if (!r.isOk()) return sendError(res, r.status());
    return sendJson(res, 200, "{}");
  }
  auto path = sandboxPath(req);
  if (!path.isOk()) return sendError(res, path.status());
  if (op == "list" || op == "stat") {
    if (m != "GET") return sendError(res, invalidArg("method", "use GET for " + op));
    auto r = cluster_->agentOp(id, op == "list" ? proto::AgentOp::kList : proto::AgentOp::kStat,
                               json{{"path", *path}}.dump());
    if (!r.isOk()) return sendError(res, r.status());
    json j = json::parse(*r, nullptr, false);
    if (j.is_discarded()) return sendError(res, internalError("agent sent malformed JSON"));
    j.erase("ok");
    return sendJson(res, 200, dumpJson(j));
  }
  if (!op.empty()) return sendError(res, notFound("no such endpoint: " + req.path));
  if (m == "DELETE") {
    auto recursive = recursiveParam(req);
    if (!recursive.isOk()) return sendError(res, recursive.status());
    auto r = cluster_->agentOp(id, proto::AgentOp::kRemove,
                             json{{"path", *path}, {"recursive", *recursive}}.dump());
    if (!r.isOk()) return sendError(res, r.status());
    return sendJson(res, 200, "{}");
  }
  if (m == "PUT") {
    auto mode = parseMode(req.param("mode"), 0644);
    if (!mode.isOk()) return sendError(res, mode.status());
    constexpr uint64_t kMaxFile = 4ull << 30;
    if (req.contentLength && *req.contentLength > kMaxFile) {
      return sendError(res, Status(Code::kPayloadTooLarge, "file larger than 4 GiB"));
    }
    uint64_t total = 0;
    auto src = [&](char* buf, size_t n) -> Result<size_t> {
      ASSIGN_OR_RETURN(size_t got, req.readSome(buf, n));
      total += got;
      if (total > kMaxFile) return Status(Code::kPayloadTooLarge, "file larger than 4 GiB");
      return got;
    };
    auto r = cluster_->writeFile(id, *path, *mode, src);
    if (!r.isOk()) return sendError(res, r.status());
    return sendJson(res, 200, dumpJson(json{{"path", *path}, {"size", *r}}));
  }
  if (m == "GET") {
    Status st = sendSandboxFile(id, *path, res);
    if (!st.isOk()) sendError(res, st);
    return;
  }
  sendError(res, invalidArg("method", "method " + m + " not allowed on files"));
}

void Platform::pauseSandbox(const std::string& id, bool pause, http::Request& req,
                            http::Response& res) {
  // pause: {"memory": "ram"} (the default: frozen, memory kept) or "disk"
  // (VM backends: saved to a file, the VM's process gone). resume: no body.
  bool toDisk = false;
  if (pause) {
    auto body = parseObject(req, {"memory"}, true);
    if (!body.isOk()) return sendError(res, body.status());
    auto memory = getString(*body, "memory", "ram", 16);
    if (!memory.isOk()) return sendError(res, memory.status());
    if (*memory != "ram" && *memory != "disk") {
      return sendError(res, invalidArg("memory", "memory must be \"ram\" or \"disk\""));
    }
    toDisk = *memory == "disk";
  }
  auto r = pauseOrResume(id, pause, toDisk);
  if (!r.isOk()) return sendError(res, r.status());
  sendJson(res, 200, dumpJson(toApi(*r)));
}

Status Platform::sendSandboxFile(const std::string& id, const std::string& path,
                                 http::Response& res) {
  auto onSize = [&](std::optional<uint64_t> size) {
    return size ? res.beginFixed(200, "application/octet-stream", *size)
                : res.beginChunked(200, "application/octet-stream");
  };
  auto sink = [&](std::string_view d) { return res.write(d); };
  Status st = cluster_->readFile(id, path, onSize, sink);
  if (!st.isOk() && res.started()) {
    (void)res.finish();  // drops the connection: the body is short
    return Status::ok();
  }
  return st;
}

Result<SandboxRecord> Platform::pauseOrResume(const std::string& id, bool pause, bool toDisk) {
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    const SandboxState st = it->second.state;
    // The VM backends, whose whole state can go to a file.
    if (toDisk && !proto::isVm(it->second.backend)) {
      return Status(Code::kFailedPrecondition,
                    "memory \"disk\" needs a VM sandbox (backend microvm or vm); sandbox " + id +
                        " is backend " + proto::backendName(it->second.backend),
                    0, "memory");
    }
    // Paused to disk already, or paused and asked for RAM: nothing to do. A
    // sandbox paused in RAM may still go to disk.
    bool done = pause ? st == SandboxState::kPaused && (!toDisk || it->second.pausedTo == "disk")
                      : st == SandboxState::kRunning;
    if (done) return it->second;
    if (!proto::isUp(st)) {
      return Status(Code::kFailedPrecondition,
                    "sandbox " + id + " is " + proto::stateName(st) + ", not running");
    }
  }
  // A resume of a sandbox paused to disk restores its VM; if that fails the
  // edge reports the sandbox dead (recorded failed, onSandboxDeath).
  Status edgeSt = toDisk ? cluster_->hibernate(id) : cluster_->pause(id, pause);
  if (!edgeSt.isOk()) return edgeSt;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return notFound("sandbox " + id + " not found");
    if (it->second.state == SandboxState::kRunning || it->second.state == SandboxState::kPaused) {
      it->second.state = pause ? SandboxState::kPaused : SandboxState::kRunning;
      it->second.pausedTo = toDisk ? "disk" : "";
    }
    it->second.updatedAt = nowSeconds();
    lastCall_[id] = nowSeconds();
    r = it->second;
  }
  // Recorded before it is acknowledged.
  RETURN_IF_ERROR(store_->putSandbox(r));
  log::info("sandbox " + id + (pause ? (toDisk ? " paused to disk" : " paused") : " resumed"));
  return r;
}

Result<SandboxRecord> Platform::expireIn(const std::string& id, double seconds) {
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || isFinal(it->second.state)) {
      return notFound("sandbox " + id + " not found");
    }
    SandboxRecord& rec = it->second;
    rec.expiresAt = nowSeconds() + seconds;
    rec.ttlS = std::max<int64_t>(0, int64_t(std::ceil(rec.expiresAt - rec.createdAt)));
    rec.updatedAt = nowSeconds();
    indexLocked(rec);
    r = rec;
  }
  // Recorded before it is acknowledged.
  RETURN_IF_ERROR(store_->putSandbox(r));
  return r;
}

}  // namespace dsec::platform
