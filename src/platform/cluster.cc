#include "platform/cluster.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <optional>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "proto/codec.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {

// API errors by code (countApiError), indexed by Code; room for codes added
// after kRateLimited, which writeApiErrorMetrics lists by their names.
std::array<std::atomic<uint64_t>, 32> gApiErrors{};

void sendJsonBody(http::Response& res, int status, const json& j) {
  (void)res.send(status, "application/json",
                 j.dump(-1, ' ', false, json::error_handler_t::replace));
}

void sendErr(http::Response& res, const Status& st) {
  if (res.started()) return;
  countApiError(st.code());
  sendJsonBody(res, httpStatusFor(st.code()), proto::errorJson(st));
}

bool validNodeName(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  for (char c : s) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  }
  return true;
}

std::string bearer(http::Request& req) {
  std::string a = req.header("authorization");
  return startsWith(a, "Bearer ") ? a.substr(7) : "";
}

}  // namespace

void countApiError(Code code) {
  size_t i = static_cast<size_t>(code);
  if (i < gApiErrors.size()) gApiErrors[i].fetch_add(1, std::memory_order_relaxed);
}

void writeApiErrorMetrics(metrics::Writer& w) {
  static constexpr char kHelp[] =
      "API calls answered with an error, by error code (quota_exceeded, rate_limited, ...).";
  for (size_t i = 1; i < gApiErrors.size(); ++i) {
    std::string_view name = codeName(static_cast<Code>(i));
    // Not a code (codeName's fallback): its slot stays at 0.
    if (name == "internal" && i != static_cast<size_t>(Code::kInternal)) continue;
    w.counter("dsec_api_errors_total", kHelp, double(gApiErrors[i].load(std::memory_order_relaxed)),
              {{"code", std::string(name)}});
  }
}

Cluster::Cluster(ClusterOptions opts)
    : opts_(std::move(opts)), sched_(defaultScorers(), opts_.maxInflightPerNode, opts_.burst) {}

Result<std::unique_ptr<Cluster>> Cluster::start(ClusterOptions opts) {
  if (!opts.store) return internalError("cluster: no store");
  if (opts.replicaId.empty()) opts.replicaId = "r-" + randomHex(6);
  std::unique_ptr<Cluster> c(new Cluster(std::move(opts)));
  Store* store = c->opts_.store;
  // Another live process with this replica id would fail this one's creates.
  // The lease of a predecessor killed a moment ago lapses within its TTL.
  // One process owns an unshared store (its data dir is locked): a restart
  // takes its leases over at once.
  c->holder_ = store->shared() ? c->opts_.replicaId + "/" + randomHex(4) : c->opts_.replicaId;
  double deadline = nowSeconds() + c->opts_.leaseTtlS + 1;
  for (;;) {
    ASSIGN_OR_RETURN(bool mine, store->acquireLease("replica:" + c->opts_.replicaId, c->holder_,
                                                    c->opts_.leaseTtlS));
    if (mine) break;
    if (nowSeconds() >= deadline) {
      return Status(Code::kFailedPrecondition, "replica id " + c->opts_.replicaId +
                                                   " is held by a live platform on this store");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  RETURN_IF_ERROR(c->migrateNodesJson());
  RETURN_IF_ERROR(c->syncNodes());
  {
    // Up until they miss heartbeats: their sandboxes stay as recorded meanwhile.
    std::lock_guard lk(c->mu_);
    double now = nowSeconds();
    for (auto& [_, n] : c->nodes_) n->lastHeartbeat = std::max(n->lastHeartbeat, now);
  }
  c->renewLeases();
  c->monitorThread_ = std::thread([raw = c.get()] { raw->monitor(); });
  return c;
}

Cluster::~Cluster() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  monitorCv_.notify_all();
  roomCv_.notify_all();
  if (monitorThread_.joinable()) monitorThread_.join();
  // A clean stop hands leadership over at once instead of after the TTL.
  if (leader_) (void)opts_.store->releaseLease("leader", holder_);
  (void)opts_.store->releaseLease("replica:" + opts_.replicaId, holder_);
}

Status Cluster::migrateNodesJson() {
  std::string path = opts_.dataDir + "/nodes.json";
  auto read = dsec::readFile(path);
  if (!read.isOk() && read.status().code() == Code::kNotFound) return Status::ok();
  ASSIGN_OR_RETURN(std::string text, std::move(read));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("nodes")) {
    return internalError(path + ": not a node list");
  }
  ASSIGN_OR_RETURN(auto have, opts_.store->listNodes());
  std::set<std::string> known;
  for (auto& r : have) known.insert(r.name);
  int moved = 0;
  for (auto& n : j["nodes"]) {
    NodeRecord r;
    r.name = n.value("name", "");
    r.pool = n.value("pool", "default");
    r.url = n.value("url", "");
    std::string edgeKey = n.value("edge_key", "");
    r.platformKey = n.value("platform_key", "");
    if (!validNodeName(r.name) || edgeKey.empty() || known.count(r.name)) continue;
    r.edgeKeyHash = sha256Hex(edgeKey);
    r.lastHeartbeat = r.joinedAt = nowSeconds();
    RETURN_IF_ERROR(opts_.store->putNode(r));
    ++moved;
  }
  // Kept (0600) beside, not deleted: a rollback to the older release finds it.
  if (::rename(path.c_str(), (path + ".migrated").c_str()) != 0) {
    return Status(Code::kInternal, "rename " + path, errno);
  }
  log::info("moved " + std::to_string(moved) + " nodes from " + path + " into the store");
  return Status::ok();
}

NodeRecord Cluster::recordLocked(const Node& n) const {
  NodeRecord r;
  r.name = n.name;
  r.pool = n.pool;
  r.url = n.url;
  r.edgeKeyHash = n.edgeKeyHash;
  r.platformKey = n.platformKey;
  r.cpus = n.cap.cpus;
  r.memoryMb = n.cap.memoryMb;
  r.slots = n.cap.slots;
  r.state = n.up ? "up" : "down";
  r.lastHeartbeat = n.lastHeartbeat;
  r.bootId = n.bootId;
  r.joinedAt = n.joinedAt;
  return r;
}

Status Cluster::syncNodes() {
  lastNodeSync_ = nowSeconds();
  ASSIGN_OR_RETURN(auto recs, opts_.store->listNodes());
  bool changed = false;
  {
    std::lock_guard lk(mu_);
    for (auto& r : recs) {
      if (!validNodeName(r.name)) continue;
      auto& slot = nodes_[r.name];
      if (slot && slot->local) continue;  // a stale row of a name now local here
      if (!slot) {
        slot = std::make_unique<Node>();
        slot->name = r.name;
        slot->url = r.url;
        slot->platformKey = r.platformKey;
        slot->remote = std::make_unique<RemoteEdge>(r.url, r.platformKey, r.name);
        slot->link = slot->remote.get();
        slot->up = r.state != "down";
        slot->reconciled = true;  // whichever replica hears it reconciles
        slot->bootId = r.bootId;
        changed = true;
      }
      Node& n = *slot;
      n.pool = r.pool;
      n.edgeKeyHash = r.edgeKeyHash;
      n.joinedAt = r.joinedAt;
      if (n.cap.cpus == 0 && n.cap.slots == 0) n.cap = {r.cpus, r.memoryMb, r.slots};
      if (r.url != n.url || r.platformKey != n.platformKey) {
        n.url = r.url;
        n.platformKey = r.platformKey;
        n.remote->reset(n.url, n.platformKey);
      }
      if (r.lastHeartbeat > n.lastHeartbeat) {
        // Heard by another replica since we last did: its view is newer.
        n.lastHeartbeat = r.lastHeartbeat;
        n.bootId = r.bootId;
        n.cap = {r.cpus, r.memoryMb, r.slots};
      }
      if (r.state == "down" && n.up) {
        n.up = false;  // the leader marked it (and its sandboxes lost)
        n.reconciled = false;
        changed = true;
      } else if (r.state == "up" && !n.up && r.lastHeartbeat >= n.lastHeartbeat) {
        n.up = true;  // back through another replica, which reconciled
        n.reconciled = true;
        changed = true;
      }
    }
  }
  if (changed) roomCv_.notify_all();
  return Status::ok();
}

void Cluster::syncNodesSoon() {
  if (nowSeconds() - lastNodeSync_.load() < 0.2) return;
  if (Status st = syncNodes(); !st.isOk()) log::warn("node registry: " + st.toString());
}

void Cluster::renewLeases() {
  double ttl = opts_.leaseTtlS;
  auto mine = opts_.store->acquireLease("replica:" + opts_.replicaId, holder_, ttl);
  if (!mine.isOk()) log::warn("replica lease: " + mine.status().toString());
  auto lead = opts_.store->acquireLease("leader", holder_, ttl);
  bool now = lead.isOk() && *lead;
  if (!lead.isOk()) log::warn("leader lease: " + lead.status().toString());
  if (now != leader_.exchange(now)) {
    log::info(std::string("replica ") + opts_.replicaId +
              (now ? " is the leader" : " is no longer the leader"));
  }
}

void Cluster::addLocal(proto::EdgeLink* e, proto::LocalNode* report, const std::string& name,
                       NodeCapacity cap) {
  auto node = std::make_unique<Node>();
  node->name = name;
  node->local = true;
  node->link = e;
  node->cap = cap;
  node->reconciled = true;
  node->lastHeartbeat = nowSeconds();
  std::lock_guard lk(mu_);
  localName_ = name;
  localNode_ = report;
  nodes_[name] = std::move(node);
}

// ------------------------------------------------------------------ routing

proto::EdgeLink* Cluster::localLink() const {
  std::lock_guard lk(mu_);
  if (localName_.empty()) return nullptr;
  return nodes_.at(localName_)->link;
}

Result<proto::EdgeLink*> Cluster::route(const std::string& id) const {
  std::lock_guard lk(mu_);
  auto p = placed_.find(id);
  if (p == placed_.end()) {
    // Not placed by this cluster (a pool sandbox of an older start, a test):
    // the local node, if any, is where it would be.
    if (!localName_.empty()) return nodes_.at(localName_)->link;
    return notFound("sandbox " + id + " is on no known node");
  }
  auto n = nodes_.find(p->second.node);
  if (n == nodes_.end()) {
    return Status(Code::kUnavailable, "sandbox " + id + " is on unknown node " + p->second.node);
  }
  if (!n->second->up) {
    return Status(Code::kUnavailable,
                  "sandbox " + id + " is on node " + p->second.node + ", which is down");
  }
  return n->second->link;
}

std::string Cluster::nodeOf(const std::string& id) const {
  std::lock_guard lk(mu_);
  auto p = placed_.find(id);
  if (p != placed_.end()) return p->second.node;
  return localName_.empty() ? "" : localName_;
}

bool Cluster::isRemoteNode(const std::string& node) const {
  std::lock_guard lk(mu_);
  auto n = nodes_.find(node);
  return n != nodes_.end() && !n->second->local;
}

void Cluster::bindSandbox(const std::string& id, const std::string& node,
                          const proto::SandboxSpec& spec) {
  std::lock_guard lk(mu_);
  if (creating_.count(id)) return;  // our own create: it binds itself
  unplaceLocked(id);
  placeLocked(id, Placed{node, spec.cpu, spec.memoryBytes >> 20, spec.tenant}, false);
}

void Cluster::placeLocked(const std::string& id, Placed p, bool creating) {
  auto n = nodes_.find(p.node);
  if (n != nodes_.end()) {
    Node& x = *n->second;
    x.cpuUsed += p.cpu;
    x.memoryUsedMb += p.memoryMb;
    x.tenants[p.tenant]++;
    if (!creating) x.sandboxes++;
  }
  if (creating) creating_.insert(id);
  placed_[id] = std::move(p);
}

void Cluster::beginCreateLocked(const std::string& id) {
  auto p = placed_.find(id);
  if (p == placed_.end() || !creating_.insert(id).second) return;
  p->second.reserved = false;
  if (auto n = nodes_.find(p->second.node); n != nodes_.end()) n->second->sandboxes--;
}

void Cluster::settleLocked(const std::string& id) {
  if (!creating_.erase(id)) return;
  auto p = placed_.find(id);
  if (p == placed_.end()) return;
  if (auto n = nodes_.find(p->second.node); n != nodes_.end()) n->second->sandboxes++;
}

void Cluster::unplaceLocked(const std::string& id) {
  auto p = placed_.find(id);
  bool creating = creating_.erase(id) > 0;
  if (p == placed_.end()) return;
  if (auto n = nodes_.find(p->second.node); n != nodes_.end()) {
    Node& x = *n->second;
    x.cpuUsed -= p->second.cpu;
    x.memoryUsedMb -= p->second.memoryMb;
    auto t = x.tenants.find(p->second.tenant);
    if (t != x.tenants.end() && --t->second <= 0) x.tenants.erase(t);
    if (!creating) x.sandboxes--;
  }
  placed_.erase(p);
}

void Cluster::release(const std::vector<std::string>& ids) {
  {
    std::lock_guard lk(mu_);
    for (auto& id : ids) {
      auto p = placed_.find(id);
      if (p != placed_.end() && p->second.reserved) unplaceLocked(id);
    }
  }
  roomCv_.notify_all();
}

Status Cluster::reserve(const std::vector<std::string>& ids, const PlacementRequest& r) {
  std::lock_guard lk(mu_);
  auto views = viewsLocked();
  // The in-flight bound does not apply to a reservation: it holds room, the
  // creations queue later. What is in flight holds room too.
  for (auto& v : views) {
    v.sandboxes += v.inflight;
    v.inflight = 0;
  }
  std::map<std::string, size_t> at;
  for (size_t i = 0; i < views.size(); ++i) at[views[i].name] = i;
  std::vector<std::string> picked;
  picked.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    auto p = sched_.pick(views, r);
    if (!p.isOk()) {
      if (p.status().code() == Code::kFailedPrecondition) return p.status();
      return Status(Code::kResourceExhausted,
                    "all_or_nothing: only " + std::to_string(i) + " of " +
                        std::to_string(ids.size()) + " sandboxes fit: " + p.status().message(),
                    0, "count");
    }
    NodeView& v = views[at[p->node]];
    v.cpuUsed += r.cpu;
    v.memoryUsedMb += r.memoryMb;
    v.sandboxes++;
    v.tenants[r.tenant]++;
    picked.push_back(p->node);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    Placed pl{picked[i], r.cpu, r.memoryMb, r.tenant};
    pl.reserved = true;
    placeLocked(ids[i], std::move(pl), false);
  }
  return Status::ok();
}

void Cluster::unbindSandbox(const std::string& id) {
  {
    std::lock_guard lk(mu_);
    if (creating_.count(id)) return;
    unplaceLocked(id);
  }
  roomCv_.notify_all();
}

void Cluster::fillView(NodeView& x, const Node& n, bool shallow) const {
  x.name = n.name;
  x.pool = n.pool;
  x.up = n.up && (n.local || n.reconciled);
  x.cpus = n.cap.cpus;
  x.memoryMb = n.cap.memoryMb;
  x.slots = n.cap.slots;
  x.inflight = n.inflight;
  x.cpuUsed = n.cpuUsed;
  x.memoryUsedMb = n.memoryUsedMb;
  x.sandboxes = n.sandboxes;
  if (shallow) {
    x.layersRef = &n.layers;
    x.tenantsRef = &n.tenants;
  } else {
    x.layers = n.layers;
    x.tenants = n.tenants;
    x.layersRef = nullptr;
    x.tenantsRef = nullptr;
  }
}

std::vector<NodeView> Cluster::viewsLocked() const {
  std::vector<NodeView> out;
  out.reserve(nodes_.size());
  for (auto& [name, n] : nodes_) fillView(out.emplace_back(), *n, false);
  return out;
}

const std::vector<NodeView>& Cluster::placementViewsLocked() {
  // Refilled in place: no allocation per placement (names fit the strings'
  // own buffers), the nodes' layer and tenant sets by reference.
  viewBuf_.resize(nodes_.size());
  size_t i = 0;
  for (auto& [name, n] : nodes_) fillView(viewBuf_[i++], *n, true);
  return viewBuf_;
}

PlacementRequest Cluster::requestFor(const proto::SandboxSpec& spec) {
  PlacementRequest pr;
  pr.cpu = spec.cpu;
  pr.memoryMb = spec.memoryBytes >> 20;
  pr.layers = spec.layers;
  pr.pool = spec.pool.empty() ? "default" : spec.pool;
  pr.tenant = spec.tenant;
  pr.spread = spec.spread;
  pr.burstable = spec.burstable;
  return pr;
}

Result<Cluster::Node*> Cluster::admitLocked(std::unique_lock<std::mutex>& lk,
                                            const proto::SandboxSpec& spec,
                                            const PlacementRequest& pr, double t0) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(int64_t(opts_.admissionWaitS * 1000));
  Node* node = nullptr;
  bool burst = false;
  ++queued_;
  Status why;
  // A reservation (reserve()) fixes the node: wait for an in-flight slot there.
  std::string reservedOn;
  if (auto r = placed_.find(spec.id); r != placed_.end() && r->second.reserved) {
    reservedOn = r->second.node;
  }
  for (;;) {
    if (stopping_) {
      why = Status(Code::kUnavailable, "platform is shutting down");
      break;
    }
    if (!reservedOn.empty()) {
      Node* n = nodes_.at(reservedOn).get();
      if (n->up && n->inflight < sched_.maxInflightPerNode()) {
        node = n;
        break;
      }
      why = Status(Code::kUnavailable, "reserved node " + reservedOn +
                                           (n->up ? " has its creations in flight" : " is down"));
      if (roomCv_.wait_until(lk, deadline) == std::cv_status::timeout) break;
      continue;
    }
    auto p = sched_.pick(placementViewsLocked(), pr);
    if (p.isOk()) {
      node = nodes_.at(p->node).get();
      burst = p->burst;
      break;
    }
    why = p.status();
    if (roomCv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      // One last look: the wake-up may have raced the deadline.
      auto last = sched_.pick(placementViewsLocked(), pr);
      if (last.isOk()) {
        node = nodes_.at(last->node).get();
        burst = last->burst;
      } else {
        why = last.status();
      }
      break;
    }
  }
  --queued_;
  if (!node) {
    Status st(Code::kUnavailable, "no node could take the sandbox within " +
                                      std::to_string(int(opts_.admissionWaitS)) +
                                      " s: " + why.message());
    if (why.code() == Code::kFailedPrecondition && why.field() == "pool") {
      st = Status(Code::kUnavailable, st.message(), 0, "pool");
    }
    createErrors_[codeName(st.code())]++;
    return st;
  }
  if (burst) bursts_[pr.pool]++;
  startLocked(*node, spec, t0, !reservedOn.empty());
  return node;
}

void Cluster::startLocked(Node& node, const proto::SandboxSpec& spec, double t0, bool reserved) {
  schedLatency_.observe(nowSeconds() - t0);
  node.inflight++;
  if (reserved) {
    beginCreateLocked(spec.id);
  } else {
    placeLocked(spec.id, Placed{node.name, spec.cpu, spec.memoryBytes >> 20, spec.tenant}, true);
  }
}

void Cluster::finishLocked(Node& node, const std::string& id, const Status& st) {
  node.inflight--;
  node.creates++;
  if (st.isOk()) {
    settleLocked(id);
    creations_++;
  } else {
    node.createErrors++;
    createErrors_[codeName(st.code())]++;
    unplaceLocked(id);
  }
}

proto::SandboxSpec Cluster::withFncallInit(proto::BackendKind backend,
                                           const proto::SandboxSpec& spec) const {
  proto::SandboxSpec s = spec;
  if (backend == proto::BackendKind::kFncall && s.fncallInit.empty()) {
    s.fncallInit =
        proto::fncallInitJson(s.diskBytes, opts_.fncallLanguages, opts_.fncallZygoteMaxCalls);
  }
  return s;
}

Status Cluster::create(proto::BackendKind backend, const proto::SandboxSpec& spec) {
  PlacementRequest pr = requestFor(spec);
  double t0 = nowSeconds();
  Node* node;
  {
    std::unique_lock lk(mu_);
    auto n = admitLocked(lk, spec, pr, t0);
    if (!n.isOk()) return n.status();
    node = *n;
  }
  Status st = node->link->create(backend, withFncallInit(backend, spec));
  {
    std::lock_guard lk(mu_);
    finishLocked(*node, spec.id, st);
  }
  roomCv_.notify_all();
  return st;
}

std::vector<std::optional<Status>> Cluster::createGroup(proto::BackendKind backend,
                                                       const std::vector<proto::SandboxSpec>& specs) {
  std::vector<std::optional<Status>> out(specs.size());
  if (specs.empty()) return out;
  double t0 = nowSeconds();
  PlacementRequest pr = requestFor(specs[0]);
  Node* node;
  std::vector<proto::SandboxSpec> group;  // the specs going to `node`, in one call
  std::vector<size_t> at;
  {
    std::unique_lock lk(mu_);
    // A reservation (all or nothing) fixes each one's node: one by one.
    bool reserved = false;
    for (auto& sp : specs) {
      auto r = placed_.find(sp.id);
      reserved = reserved || (r != placed_.end() && r->second.reserved);
    }
    if (reserved || specs.size() == 1) {
      lk.unlock();
      out[0] = create(backend, specs[0]);
      return out;  // the others: not attempted
    }
    // The first waits for room like any create; the scheduler picks its node.
    auto n = admitLocked(lk, specs[0], pr, t0);
    if (!n.isOk()) {
      // No node took it within the admission wait: the others of the same
      // request needing at least as much fail with it now, as they would
      // have had each waited beside it, instead of queueing again to wait
      // one after another.
      out[0] = n.status();
      for (size_t i = 1; i < specs.size(); ++i) {
        PlacementRequest ri = requestFor(specs[i]);
        if (ri.pool == pr.pool && ri.burstable == pr.burstable && ri.tenant == pr.tenant &&
            ri.layers == pr.layers && ri.spread == pr.spread && ri.cpu >= pr.cpu &&
            ri.memoryMb >= pr.memoryMb) {
          out[i] = n.status();
        }
      }
      return out;
    }
    node = *n;
    group.push_back(withFncallInit(backend, specs[0]));
    at.push_back(0);
    // The others of the same request join it while the node has room and
    // in-flight slots: one call to one node instead of one per sandbox. The
    // tenant-spread score still spreads a batch over the pool, in groups.
    for (size_t i = 1; i < specs.size(); ++i) {
      PlacementRequest ri = requestFor(specs[i]);
      if (ri.pool != pr.pool || ri.burstable != pr.burstable || ri.tenant != pr.tenant ||
          ri.layers != pr.layers || ri.spread != pr.spread) {
        continue;
      }
      if (!node->up || node->inflight >= sched_.maxInflightPerNode()) break;
      NodeView v;
      fillView(v, *node, true);
      if (!Scheduler::fits(v, ri)) break;
      startLocked(*node, specs[i], t0, false);
      group.push_back(withFncallInit(backend, specs[i]));
      at.push_back(i);
    }
  }
  auto sts = node->link->createMany(backend, group);
  sts.resize(group.size(), Status(Code::kInternal, "node answered no result"));
  {
    std::lock_guard lk(mu_);
    for (size_t k = 0; k < group.size(); ++k) {
      finishLocked(*node, group[k].id, sts[k]);
      out[at[k]] = sts[k];
    }
  }
  roomCv_.notify_all();
  return out;
}

Status Cluster::destroy(const std::string& id) {
  proto::EdgeLink* link = nullptr;
  bool down = false;
  {
    std::lock_guard lk(mu_);
    auto p = placed_.find(id);
    if (p == placed_.end()) {
      if (!localName_.empty()) link = nodes_.at(localName_)->link;
    } else {
      auto n = nodes_.find(p->second.node);
      if (n != nodes_.end() && n->second->up) link = n->second->link;
      down = n == nodes_.end() || !n->second->up;
    }
  }
  Status st = link ? link->destroy(id) : Status::ok();
  {
    std::lock_guard lk(mu_);
    unplaceLocked(id);
  }
  roomCv_.notify_all();
  if (down) return Status::ok();  // the node destroys it when it returns
  return st;
}

std::vector<Status> Cluster::destroyMany(const std::vector<std::string>& ids) {
  std::vector<Status> out(ids.size());
  // Each node's ids (by the same rule as destroy()), in chunks.
  std::map<proto::EdgeLink*, std::vector<size_t>> byLink;
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < ids.size(); ++i) {
      proto::EdgeLink* link = nullptr;
      auto p = placed_.find(ids[i]);
      if (p == placed_.end()) {
        if (!localName_.empty()) link = nodes_.at(localName_)->link;
      } else if (auto n = nodes_.find(p->second.node); n != nodes_.end() && n->second->up) {
        link = n->second->link;
      }
      if (link) byLink[link].push_back(i);  // else: a down node destroys it when it returns
    }
  }
  std::vector<std::pair<proto::EdgeLink*, std::vector<size_t>>> chunks;
  for (auto& [link, at] : byLink) {
    for (size_t from = 0; from < at.size(); from += kDestroyChunk) {
      chunks.emplace_back(
          link, std::vector<size_t>(at.begin() + from,
                                    at.begin() + std::min(at.size(), from + kDestroyChunk)));
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t c; (c = next++) < chunks.size();) {
      auto& [link, at] = chunks[c];
      std::vector<std::string> part;
      for (size_t i : at) part.push_back(ids[i]);
      auto sts = link->destroyMany(part);
      for (size_t k = 0; k < at.size(); ++k) {
        out[at[k]] = k < sts.size() ? sts[k] : internalError("node answered no result");
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min<size_t>(32, chunks.size()); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  {
    std::lock_guard lk(mu_);
    for (auto& id : ids) unplaceLocked(id);
  }
  roomCv_.notify_all();
  return out;
}

#define ROUTE(id) ASSIGN_OR_RETURN(proto::EdgeLink* link, route(id))

namespace {
class EndedExec : public proto::ExecCall {
 public:
  void cancel() override {}
};
}  // namespace

std::shared_ptr<proto::ExecCall> Cluster::startExec(const std::string& id,
                                                    const proto::ExecSpec& spec,
                                                    proto::ExecCallbacks cb) {
  auto link = route(id);
  if (!link.isOk()) {
    cb.onDone(link.status());
    return std::make_shared<EndedExec>();
  }
  return (*link)->startExec(id, spec, std::move(cb));
}
Result<uint64_t> Cluster::writeFile(const std::string& id, const std::string& path, int mode,
                                    const proto::ByteSource& src) {
  ROUTE(id);
  return link->writeFile(id, path, mode, src);
}
Status Cluster::readFile(const std::string& id, const std::string& path,
                         const std::function<Status(std::optional<uint64_t>)>& onSize,
                         const proto::ByteSink& sink) {
  ROUTE(id);
  return link->readFile(id, path, onSize, sink);
}
Result<std::string> Cluster::agentOp(const std::string& id, proto::AgentOp op,
                                     const std::string& json) {
  ROUTE(id);
  return link->agentOp(id, op, json);
}
Result<proto::CgroupStats> Cluster::stats(const std::string& id) {
  ROUTE(id);
  return link->stats(id);
}
Result<proto::StatsSeries> Cluster::statsHistory(const std::string& id, double windowS) {
  ROUTE(id);
  return link->statsHistory(id, windowS);
}
Status Cluster::pause(const std::string& id, bool paused) {
  ROUTE(id);
  return link->pause(id, paused);
}
Status Cluster::hibernate(const std::string& id) {
  ROUTE(id);
  return link->hibernate(id);
}
Status Cluster::setLimits(const std::string& id, const proto::CgroupLimits& limits) {
  ROUTE(id);
  return link->setLimits(id, limits);
}
Status Cluster::setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) {
  ROUTE(id);
  return link->setEgress(id, rules);
}
Result<proto::EgressDenials> Cluster::egressDenials(const std::string& id) {
  ROUTE(id);
  return link->egressDenials(id);
}
Result<image::BuiltLayer> Cluster::packDiff(const std::string& id, const std::string& workDir) {
  ROUTE(id);
  return link->packDiff(id, workDir);
}
Result<UniqueFd> Cluster::openPort(const std::string& id, int port, uint64_t gen,
                                   double connectTimeoutS) {
  ROUTE(id);
  return link->openPort(id, port, gen, connectTimeoutS);
}
Status Cluster::setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) {
  auto link = route(id);
  if (!link.isOk()) return link.status().code() == Code::kNotFound ? Status::ok() : link.status();
  return (*link)->setPorts(id, ports);
}

Status Cluster::evictLayer(const std::string& digest) {
  std::vector<proto::EdgeLink*> links;
  {
    std::lock_guard lk(mu_);
    for (auto& [_, n] : nodes_) {
      if (n->up) links.push_back(n->link);
    }
  }
  Status first;
  for (auto* l : links) {
    Status st = l->evictLayer(digest);
    if (!st.isOk() && first.isOk()) first = st;
  }
  return first;
}

void Cluster::setDeathHandler(std::function<void(const std::string&, const std::string&)> h) {
  {
    std::lock_guard lk(mu_);
    onDeath_ = h;
  }
  if (auto* l = localLink()) l->setDeathHandler(std::move(h));
}

void Cluster::setLostHandler(std::function<void(const std::string&, bool, const std::string&)> h) {
  std::lock_guard lk(mu_);
  onLost_ = std::move(h);
}

proto::LocalNode* Cluster::localNode() const {
  std::lock_guard lk(mu_);
  return localNode_;
}

Result<std::string> Cluster::screenshot(const std::string& id) {
  ROUTE(id);
  return link->screenshot(id);
}
Status Cluster::input(const std::string& id, const proto::InputAction& action) {
  ROUTE(id);
  return link->input(id, action);
}

// ------------------------------------------------------------------ liveness

void Cluster::monitor() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      monitorCv_.wait_for(lk, std::chrono::milliseconds(250));
      if (stopping_) break;
    }
    double now = nowSeconds();
    if (now - lastLease_ >= opts_.leaseTtlS / 4) {
      lastLease_ = now;
      renewLeases();
    }
    if (Status st = syncNodes(); !st.isOk()) {
      log::warn("node registry: " + st.toString());
      continue;  // without the store's view, marking anything down would be a guess
    }
    if (!leader_) continue;
    std::vector<std::pair<std::string, double>> silent;  // name, seconds
    {
      std::lock_guard lk(mu_);
      for (auto& [name, n] : nodes_) {
        if (n->local || !n->up || now - n->lastHeartbeat <= opts_.heartbeatTimeoutS) continue;
        silent.emplace_back(name, now - n->lastHeartbeat);
      }
    }
    for (auto& [name, age] : silent) {
      // The compare-and-set makes one replica the one that acts.
      auto won = opts_.store->setNodeState(name, "up", "down");
      if (!won.isOk()) {
        log::warn("marking node " + name + " down: " + won.status().toString());
        continue;
      }
      std::vector<std::pair<std::string, std::string>> lost;  // sandbox, why
      std::string why = "node " + name + " missed heartbeats for " + std::to_string(int(age)) + " s";
      {
        std::lock_guard lk(mu_);
        Node& n = *nodes_.at(name);
        if (!n.up) continue;
        n.up = false;
        n.reconciled = false;
        if (!*won) continue;  // another replica marked it
        log::warn(why + ": marked down");
        for (auto& [id, p] : placed_) {
          if (p.node == name && !creating_.count(id)) lost.emplace_back(id, why);
        }
      }
      roomCv_.notify_all();
      std::function<void(const std::string&, bool, const std::string&)> h;
      {
        std::lock_guard lk(mu_);
        h = onLost_;
      }
      for (auto& [id, w] : lost) {
        if (h) h(id, true, w);
      }
    }
  }
}

// ------------------------------------------------------------------ edges' calls

bool Cluster::authNode(const std::string& name, http::Request& req, http::Response& res) {
  auto known = [&] {
    std::lock_guard lk(mu_);
    auto it = nodes_.find(name);
    std::string key = bearer(req);
    return it != nodes_.end() && !it->second->local && !key.empty() &&
           secretEquals(sha256Hex(key), it->second->edgeKeyHash);
  };
  // Joined (or re-joined) through another replica since our last sync?
  if (!known()) syncNodesSoon();
  std::lock_guard lk(mu_);
  return authNodeLocked(name, req, res) != nullptr;
}

Cluster::Node* Cluster::authNodeLocked(const std::string& name, http::Request& req,
                                       http::Response& res) {
  auto it = nodes_.find(name);
  std::string key = bearer(req);
  // One answer for an unknown node and a wrong key: no probing of names.
  if (it == nodes_.end() || it->second->local || key.empty() ||
      !secretEquals(sha256Hex(key), it->second->edgeKeyHash)) {
    res.setHeader("WWW-Authenticate", "Bearer");
    sendErr(res, Status(Code::kUnauthenticated,
                        key.empty() ? "missing node credential" : "invalid node credential"));
    return nullptr;
  }
  return it->second.get();
}

void Cluster::handleInternal(http::Request& req, http::Response& res) {
  auto parts = splitString(req.path, '/');  // "", "internal", "v1", ...
  size_t n = parts.size();
  if (n == 4 && parts[3] == "join" && req.method == "POST") return join(req, res);
  if (n == 6 && parts[3] == "nodes" && req.method == "POST") {
    if (parts[5] == "heartbeat") return heartbeat(parts[4], req, res);
    if (parts[5] == "events") return event(parts[4], req, res);
  }
  if (n == 5 && parts[3] == "layers" && req.method == "GET") {
    // Any joined node may look layers up: their bytes are in the blob store.
    std::string node = req.param("node").value_or("");
    if (!authNode(node, req, res)) return;
    if (!opts_.lookup) return sendErr(res, notFound("no layer lookup here"));
    auto d = opts_.lookup(parts[4]);
    if (!d.isOk()) return sendErr(res, d.status());
    return sendJsonBody(res, 200, proto::toJson(*d));
  }
  sendErr(res, notFound("no such endpoint: " + req.method + " " + req.path));
}

namespace {
Status parseCapacity(const json& j, NodeCapacity& cap) {
  if (!j.contains("capacity") || !j["capacity"].is_object()) {
    return invalidArg("capacity", "capacity must be an object {cpus, memory_mb, slots}");
  }
  auto& c = j["capacity"];
  try {
    cap.cpus = c.at("cpus").get<double>();
    cap.memoryMb = c.at("memory_mb").get<int64_t>();
    cap.slots = c.at("slots").get<int64_t>();
  } catch (const std::exception&) {
    return invalidArg("capacity", "capacity needs numbers cpus, memory_mb and slots");
  }
  if (cap.cpus < 0 || cap.memoryMb < 0 || cap.slots < 0) {
    return invalidArg("capacity", "capacity must not be negative");
  }
  return Status::ok();
}
}  // namespace

void Cluster::join(http::Request& req, http::Response& res) {
  std::string key = bearer(req);
  if (opts_.joinTokenHash.empty() || key.empty() ||
      !secretEquals(sha256Hex(key), opts_.joinTokenHash)) {
    res.setHeader("WWW-Authenticate", "Bearer");
    return sendErr(res, Status(Code::kUnauthenticated,
                               key.empty() ? "missing join token" : "invalid join token"));
  }
  auto body = req.readBody(1 << 20);
  if (!body.isOk()) return sendErr(res, body.status());
  json j = json::parse(*body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return sendErr(res, invalidArg("body", "body must be a JSON object"));
  }
  std::string name = j.value("name", "");
  std::string url = j.value("url", "");
  std::string pool = j.value("pool", "default");
  if (!validNodeName(name)) {
    return sendErr(res, invalidArg("name", "node name must be 1-63 of [A-Za-z0-9._-]"));
  }
  if (!startsWith(url, "http://"))
    return sendErr(res, invalidArg("url", "url must be http://HOST:PORT"));
  if (!validNodeName(pool))
    return sendErr(res, invalidArg("pool", "pool must be 1-63 of [A-Za-z0-9._-]"));
  NodeCapacity cap;
  if (Status st = parseCapacity(j, cap); !st.isOk()) return sendErr(res, st);
  {
    std::lock_guard lk(mu_);
    auto it = nodes_.find(name);
    if (it != nodes_.end() && it->second->local) {
      return sendErr(res,
                     Status(Code::kAlreadyExists, "node name " + name + " is taken", 0, "name"));
    }
  }
  // Fresh keys: a re-join (new data dir, lost credentials) shuts the old ones out.
  std::string edgeKey = randomHex(32);
  NodeRecord rec;
  rec.name = name;
  rec.pool = pool;
  rec.url = url;
  rec.edgeKeyHash = sha256Hex(edgeKey);
  rec.platformKey = randomHex(32);
  rec.cpus = cap.cpus;
  rec.memoryMb = cap.memoryMb;
  rec.slots = cap.slots;
  rec.lastHeartbeat = rec.joinedAt = nowSeconds();
  // In the store before the answer: any replica then accepts the edge key.
  if (Status st = opts_.store->putNode(rec); !st.isOk()) return sendErr(res, st);
  {
    std::lock_guard lk(mu_);
    auto& slot = nodes_[name];
    if (!slot) slot = std::make_unique<Node>();
    Node& n = *slot;
    n.name = name;
    n.pool = pool;
    n.url = url;
    n.cap = cap;
    n.edgeKeyHash = rec.edgeKeyHash;
    n.platformKey = rec.platformKey;
    n.joinedAt = rec.joinedAt;
    if (n.remote) {
      n.remote->reset(url, n.platformKey);
    } else {
      n.remote = std::make_unique<RemoteEdge>(url, n.platformKey, n.name);
    }
    n.link = n.remote.get();
    n.lastHeartbeat = n.lastStored = rec.lastHeartbeat;
    n.up = true;
    n.reconciled = false;  // its first heartbeat reconciles
  }
  json reply = {{"node", name},
                {"edge_key", edgeKey},
                {"platform_key", rec.platformKey},
                {"heartbeat_timeout_s", opts_.heartbeatTimeoutS}};
  log::info("node " + name + " joined from " + url + " (pool " + pool + ")");
  sendJsonBody(res, 200, reply);
}

void Cluster::heartbeat(const std::string& name, http::Request& req, http::Response& res) {
  if (!authNode(name, req, res)) return;  // nothing of an unauthenticated caller is read
  auto body = req.readBody(64 << 20);
  if (!body.isOk()) return sendErr(res, body.status());
  json j = json::parse(*body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return sendErr(res, invalidArg("body", "body must be a JSON object"));
  }
  NodeCapacity cap;
  if (Status st = parseCapacity(j, cap); !st.isOk()) return sendErr(res, st);
  // The node's sandboxes: the full list ("sandboxes"), or what changed since
  // the heartbeat this replica answered with token "since": the ids "added"
  // since then and the "count" now (removals need no word: a sandbox that
  // died is reported by an event, and a reconcile takes a full list): at 380,000 sandboxes on 160 nodes full lists
  // every second or two were most of the platform's work. The answer asks
  // for a full list ("full": true) when it cannot use a delta (no such token
  // here: another replica, a restart, a lost answer), when the node must be
  // reconciled, and every kFullListEveryS, so the orphan check below still
  // sees everything the node runs.
  std::unordered_set<std::string> running;  // full: all; delta: added
  std::set<std::string> layers;
  bool full = j.contains("sandboxes");
  std::string since = j.value("since", "");
  int64_t count = 0;
  auto isList = [&](const char* k) { return !j.contains(k) || j[k].is_array(); };
  if (!isList("sandboxes") || !isList("added") || !isList("layers")) {
    return sendErr(res, invalidArg("sandboxes", "sandboxes, added and layers must be lists of "
                                                "strings, count a number"));
  }
  try {
    if (full) {
      running.reserve(j["sandboxes"].size());
      for (auto& s : j.at("sandboxes")) running.insert(s.get<std::string>());
      count = int64_t(running.size());
    } else if (j.contains("added") && !since.empty()) {
      for (auto& s : j.at("added")) running.insert(s.get<std::string>());
      count = j.at("count").get<int64_t>();
    } else {
      return sendErr(res, invalidArg("sandboxes", "sandboxes (a list) or since, added and count "
                                                  "are required"));
    }
    for (auto& l : j.value("layers", json::array())) layers.insert(l.get<std::string>());
  } catch (const std::exception&) {
    return sendErr(res, invalidArg("sandboxes", "sandboxes, added and layers must be lists of "
                                                "strings, count a number"));
  }
  std::string bootId = j.value("boot_id", "");
  std::set<std::string> cached = layers;  // for the prestage answer
  std::string pool;
  std::vector<std::string> unknown;  // runs there, no placement here: ask the store
  std::vector<std::pair<std::string, bool>> changes;  // sandbox, lost
  std::string why;
  bool returned = false;
  std::optional<NodeRecord> store;  // the heartbeat, to write through
  double now = nowSeconds();
  bool wantFull = false;
  std::string token;
  {
    std::lock_guard lk(mu_);
    Node* n = authNodeLocked(name, req, res);
    if (!n) return;
    if (!n->up || n->bootId != bootId) n->reconciled = false;
    // A delta counts only against the list this replica last acknowledged.
    bool deltaOk = !full && !n->hbToken.empty() && since == n->hbToken;
    if (full) n->lastFull = now;
    returned = !n->up;
    bool rebooted = n->bootId != bootId;
    n->up = true;
    n->lastHeartbeat = now;
    n->bootId = bootId;
    pool = n->pool;
    n->cap = cap;
    n->layers = std::move(layers);
    n->reported = count;
    if (j.contains("load") && j["load"].is_object()) {
      n->loadavg = j["load"].value("loadavg_1m", 0.0);
    }
    std::string url = j.value("url", n->url);
    bool moved = url != n->url && startsWith(url, "http://");
    if (moved) {
      n->url = url;
      n->remote->reset(url, n->platformKey);
    }
    // Written through at a quarter of the timeout: enough for the leader
    // (maybe another replica) to see the node alive, few writes per node.
    if (returned || rebooted || moved ||
        now - n->lastStored >= std::max(0.2, opts_.heartbeatTimeoutS / 4)) {
      n->lastStored = now;
      store = recordLocked(*n);
    }
    for (auto& id : running) {
      auto p = placed_.find(id);
      if (p == placed_.end() || p->second.node != name) unknown.push_back(id);
    }
    // Ids left undecided by an earlier heartbeat (being created by another
    // replica, or the store did not answer): a delta will not name them
    // again, so they are looked at until decided (a full list without them:
    // the node no longer has them).
    for (auto& id : n->recheck) {
      if (full || running.count(id)) continue;
      auto p = placed_.find(id);
      if (p == placed_.end() || p->second.node != name) unknown.push_back(id);
    }
    n->recheck.clear();
    if (!n->reconciled && full) {
      why = "node " + name + " came back without it";
      for (auto& [id, p] : placed_) {
        if (p.node != name || creating_.count(id)) continue;
        changes.emplace_back(id, running.count(id) == 0);
      }
      n->reconciled = true;
    }
    // Reconciling needs the whole list; so does a delta against a list this
    // replica does not hold; and now and then the orphan check.
    wantFull = !n->reconciled || (!full && !deltaOk) || now - n->lastFull >= kFullListEveryS;
    n->hbToken = wantFull ? "" : hbPrefix_ + std::to_string(++hbSerial_);
    token = n->hbToken;
  }
  if (store) {
    if (Status st = opts_.store->touchNode(*store); !st.isOk()) {
      log::warn("recording the heartbeat of node " + name + ": " + st.toString());
    }
    if (returned) (void)opts_.store->setNodeState(name, "down", "up");
  }
  // What the node runs that no placement here wants: the store decides (another
  // replica may have created it a moment ago, or be creating it now).
  std::vector<std::string> destroy, undecided;
  for (auto& id : unknown) {
    auto r = opts_.store->getSandbox(id);
    if (!r.isOk()) {
      if (r.status().code() != Code::kNotFound) {
        log::warn("heartbeat of " + name + ": looking up " + id + ": " + r.status().toString());
        undecided.push_back(id);  // unknown is not unwanted: ask again next heartbeat
        continue;
      }
      destroy.push_back(id);
      continue;
    }
    // Being created: by its replica (which finishes it, or the leader fails
    // it), or a batch's, stored `pending` until its creation is (docs/batches.md).
    if (r->state == SandboxState::kCreating || r->state == SandboxState::kPending) {
      undecided.push_back(id);
      continue;
    }
    bool live = r->state == SandboxState::kRunning || r->state == SandboxState::kPaused || r->state == SandboxState::kLost;
    if (!live || r->node != name) {
      destroy.push_back(id);
      continue;
    }
    proto::SandboxSpec spec;
    spec.cpu = r->cpu;
    spec.memoryBytes = r->memoryMb << 20;
    spec.tenant = r->owner;
    bindSandbox(id, name, spec);
    if (r->state == SandboxState::kLost) changes.emplace_back(id, false);  // found
  }
  if (!undecided.empty()) {
    std::lock_guard lk(mu_);
    auto it = nodes_.find(name);
    if (it != nodes_.end()) it->second->recheck.insert(undecided.begin(), undecided.end());
  }
  if (returned) log::info("node " + name + " is back");
  roomCv_.notify_all();
  std::function<void(const std::string&, bool, const std::string&)> h;
  {
    std::lock_guard lk(mu_);
    h = onLost_;
  }
  for (auto& [id, lost] : changes) {
    if (h) h(id, lost, lost ? why : "");
  }
  json prestage = json::array();
  for (auto& d : prestageFor(pool)) {
    if (!cached.count(d)) prestage.push_back(d);
  }
  json answer = {{"destroy", destroy}, {"prestage", prestage}};
  if (wantFull) {
    answer["full"] = true;
  } else {
    answer["token"] = token;
  }
  sendJsonBody(res, 200, answer);
}

std::vector<std::string> Cluster::prestageFor(const std::string& pool) {
  auto refs = opts_.prestage.find(pool);
  if (refs == opts_.prestage.end() || !opts_.resolveLayers) return {};
  double now = nowSeconds();
  std::lock_guard lk(prestageMu_);
  auto& slot = prestageCache_[pool];
  // Resolved at most every few seconds: a re-tagged image is picked up soon,
  // and 160 nodes' heartbeats do not each read the store.
  if (slot.second > 0 && now - slot.second < kPrestageRefreshS) return slot.first;
  std::vector<std::string> digests;
  std::set<std::string> seen;  // a layer shared by several images is staged once
  for (auto& ref : refs->second) {
    auto layers = opts_.resolveLayers(ref);
    if (!layers.isOk()) {
      log::warn("prestage for pool " + pool + ": " + ref + ": " + layers.status().toString());
      continue;
    }
    for (auto& d : *layers) {
      if (seen.insert(d).second) digests.push_back(d);
    }
  }
  slot = {digests, now};
  return digests;
}

void Cluster::event(const std::string& name, http::Request& req, http::Response& res) {
  if (!authNode(name, req, res)) return;
  auto body = req.readBody(1 << 20);
  if (!body.isOk()) return sendErr(res, body.status());
  json j = json::parse(*body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("sandbox") || !j["sandbox"].is_string()) {
    return sendErr(res, invalidArg("sandbox", "body must be {\"sandbox\": ID, \"why\": TEXT}"));
  }
  std::string id = j["sandbox"];
  std::function<void(const std::string&, const std::string&)> h;
  bool placedHere;
  {
    std::lock_guard lk(mu_);
    if (!authNodeLocked(name, req, res)) return;
    auto p = placed_.find(id);
    placedHere = p != placed_.end() && p->second.node == name;
    h = onDeath_;
  }
  if (!placedHere) {
    // Maybe placed through another replica and not yet followed here.
    auto r = opts_.store->getSandbox(id);
    bool live = r.isOk() && (r->state == SandboxState::kRunning || r->state == SandboxState::kPaused || r->state == SandboxState::kLost);
    if (!live || r->node != name) return sendJsonBody(res, 200, {{"ignored", true}});
  }
  // After the answer: recording the death calls back into the node, whose
  // report waits for this answer. Deferred, it goes out now; res.send() would
  // hold it until this handler returns.
  (void)res.defer()->send(200, "application/json", R"({"ignored":false})");
  if (h) h(id, j.value("why", "died"));
}

// ------------------------------------------------------------------ API

void Cluster::handleNodes(http::Request& req, http::Response& res) {
  auto parts = splitString(req.path, '/');  // "", "v1", "nodes", [name]
  if (req.method != "GET") {
    return sendErr(
        res, Status(Code::kInvalidArgument, "method " + req.method + " not allowed on " + req.path,
                    0, "method"));
  }
  double now = nowSeconds();
  json list = json::array();
  json pools = json::array();
  {
    std::lock_guard lk(mu_);
    auto views = viewsLocked();
    // Per pool what the scheduler's bursting looks at (scheduler.h).
    std::map<std::string, std::pair<int, int>> counts;  // pool -> nodes, up
    for (auto& v : views) {
      auto& c = counts[v.pool];
      ++c.first;
      if (nodes_.at(v.name)->up) ++c.second;
    }
    for (auto& [p, c] : counts) {
      auto b = bursts_.find(p);
      pools.push_back({{"name", p},
                       {"nodes", c.first},
                       {"up", c.second},
                       {"utilization", poolUtilization(views, p)},
                       {"burst_pool", p == opts_.burst.pool},
                       {"bursts", b == bursts_.end() ? 0 : b->second}});
    }
    for (auto& v : views) {
      auto& n = *nodes_.at(v.name);
      if (parts.size() == 4 && parts[3] != v.name) continue;
      list.push_back(
          {{"name", v.name},
           {"pool", v.pool},
           {"state", n.up ? "up" : "down"},
           {"local", n.local},
           {"url", n.local ? json(nullptr) : json(n.url)},
           {"capacity", {{"cpus", v.cpus}, {"memory_mb", v.memoryMb}, {"slots", v.slots}}},
           {"allocated",
            {{"cpus", v.cpuUsed}, {"memory_mb", v.memoryUsedMb}, {"sandboxes", v.sandboxes}}},
           {"inflight", v.inflight},
           {"reported_sandboxes", n.local ? json(nullptr) : json(n.reported)},
           {"layers", n.layers.size()},
           {"loadavg_1m", n.local ? json(nullptr) : json(n.loadavg)},
           {"last_heartbeat_age_s", n.local ? 0.0 : now - n.lastHeartbeat}});
    }
  }
  if (parts.size() == 4) {
    if (list.empty()) return sendErr(res, notFound("node " + parts[3] + " not found"));
    return sendJsonBody(res, 200, list[0]);
  }
  if (parts.size() != 3) return sendErr(res, notFound("no such endpoint: " + req.path));
  json burst = {{"pool", opts_.burst.pool.empty() ? json(nullptr) : json(opts_.burst.pool)},
                {"threshold", opts_.burst.threshold}};
  sendJsonBody(res, 200, {{"nodes", list}, {"pools", pools}, {"burst", burst}});
}

void Cluster::writeMetrics(metrics::Writer& w) {
  using metrics::Type;
  std::lock_guard lk(mu_);
  auto views = viewsLocked();
  // A gauge of every node, labelled by its name.
  auto perNode = [&](const char* name, const char* help, auto value) {
    w.declare(name, Type::kGauge, help);
    for (auto& v : views) w.gauge(name, help, double(value(v)), {{"node", v.name}});
  };
  {
    const char* help = "1 while the node heartbeats (the local node always).";
    w.declare("dsec_node_up", Type::kGauge, help);
    for (auto& v : views) {
      w.gauge("dsec_node_up", help, nodes_.at(v.name)->up ? 1 : 0,
              {{"node", v.name}, {"pool", v.pool}});
    }
  }
  perNode("dsec_node_sandboxes", "Sandboxes placed on the node.",
          [](const NodeView& v) { return v.sandboxes; });
  perNode("dsec_node_cpu_allocated", "CPU cores requested by the node's sandboxes.",
          [](const NodeView& v) { return v.cpuUsed; });
  perNode("dsec_node_cpu_capacity", "CPU cores the node offers.",
          [](const NodeView& v) { return v.cpus; });
  perNode("dsec_node_memory_allocated_bytes", "Memory requested by the node's sandboxes.",
          [](const NodeView& v) { return v.memoryUsedMb << 20; });
  {
    // Heartbeats carry it: none for the local node.
    const char* help = "The node host's 1-minute load average (last heartbeat).";
    w.declare("dsec_node_loadavg_1m", Type::kGauge, help);
    for (auto& v : views) {
      auto& n = *nodes_.at(v.name);
      if (!n.local) w.gauge("dsec_node_loadavg_1m", help, n.loadavg, {{"node", v.name}});
    }
  }
  perNode("dsec_node_inflight_creates", "Creations under way on the node.",
          [](const NodeView& v) { return v.inflight; });
  {
    // Bursting (scheduler.h): each pool's utilization, and the sandboxes that
    // went to the burst pool because their own pool was busy.
    std::set<std::string> pools;
    for (auto& v : views) pools.insert(v.pool);
    const char* help = "Largest of CPU, memory and slot use over the pool's up nodes (1: none up).";
    w.declare("dsec_pool_utilization", Type::kGauge, help);
    for (auto& p : pools) {
      w.gauge("dsec_pool_utilization", help, poolUtilization(views, p), {{"pool", p}});
    }
    help = "Burstable sandboxes placed in the burst pool, by the pool they asked for.";
    w.declare("dsec_sandbox_bursts_total", Type::kCounter, help);
    if (!opts_.burst.pool.empty() && !bursts_.count("default")) {
      w.counter("dsec_sandbox_bursts_total", help, 0,
                {{"pool", "default"}, {"burst_pool", opts_.burst.pool}});
    }
    for (auto& [p, k] : bursts_) {
      w.counter("dsec_sandbox_bursts_total", help, double(k),
                {{"pool", p}, {"burst_pool", opts_.burst.pool}});
    }
  }
  w.gauge("dsec_schedule_queue_depth", "Creates waiting for a node with room.", queued_);
  w.counter("dsec_sandbox_creations_total", "Sandboxes created on a node.", double(creations_));
  {
    const char* help = "Creates that failed, by code.";
    w.declare("dsec_sandbox_create_errors_total", Type::kCounter, help);
    for (auto& [code, k] : createErrors_) {
      w.counter("dsec_sandbox_create_errors_total", help, double(k), {{"code", code}});
    }
  }
  schedLatency_.writeTo(w, "dsec_schedule_latency_seconds",
                        "From a create's arrival to its placement (queueing included).");
}

}  // namespace dsec::platform
