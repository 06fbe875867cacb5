#include "edge/edge.h"

#include <sys/mount.h>
#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/runtime.h"
#include "common/sha256.h"
#include "common/util.h"
#include "edge/backends/container/container_backend.h"
#include "edge/backends/fncall/fncall_backend.h"
#include "edge/net/netns_socket.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {
constexpr size_t kReadRange = 4u << 20;  // bytes per file_read request
constexpr double kAgentCallTimeoutS = 60;

// "size" of an agent result; 0 when absent or not a number.
uint64_t sizeOf(const json& j) {
  if (!j.is_object()) return 0;
  auto it = j.find("size");
  return it != j.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

// Closes a request stream when the call ends, however it ends.
struct StreamGuard {
  AgentConn& conn;
  uint32_t id;
  ~StreamGuard() { conn.closeStream(id); }
};
}  // namespace

Result<std::unique_ptr<Edge>> Edge::start(EdgeOptions opts) {
  std::unique_ptr<Edge> e(new Edge());
  e->opts_ = std::move(opts);
  RETURN_IF_ERROR(makeDirs(e->opts_.dataDir, 0700));
  if (e->opts_.cgroupParent.empty()) {
    char real[PATH_MAX];
    std::string dir = ::realpath(e->opts_.dataDir.c_str(), real) ? real : e->opts_.dataDir;
    e->opts_.cgroupParent = "dsec/e-" + sha256Hex(dir).substr(0, 12);
  }
  // The node cache first: a bad blob store or loader option leaves nothing made.
  if (e->opts_.cache.dir.empty()) e->opts_.cache.dir = e->opts_.dataDir + "/cache";
  ASSIGN_OR_RETURN(e->cache_, NodeCache::open(e->opts_.cache, e->opts_.lookup));
  ASSIGN_OR_RETURN(e->cgroups_, Cgroups::detect(e->opts_.cgroupRoot, e->opts_.cgroupParent));
  UsernsOptions uo{e->opts_.userns, e->opts_.usernsFirst, e->opts_.usernsLast,
                   e->opts_.usernsWidth, readSubordinateIds()};
  ASSIGN_OR_RETURN(e->userns_, detectUserns(uo));
  log::info("edge: user namespaces " + e->userns_.reason);
  e->layers_ = std::make_unique<LayerCache>(e->opts_.dataDir + "/layers", e->cache_.get());
  RETURN_IF_ERROR(e->layers_->cleanupStale());
  e->reactor_ = std::make_unique<Reactor>();
  RETURN_IF_ERROR(e->reactor_->start());
  // Sandboxes an earlier edge on this data dir left running (it crashed, or
  // stopped with live restore): those whose PID 1 is still the recorded
  // process are re-adopted below; the rest are orphans.
  {
    // Loop devices: what an earlier edge of this data dir left unbound is
    // trimmed now (loop_device.h says which devices count as ours).
    LoopPoolOptions lo;
    lo.ledger = e->opts_.dataDir + "/loop-devices";
    char real[PATH_MAX];
    if (::realpath(e->opts_.dataDir.c_str(), real)) lo.ownedPrefix = std::string(real) + "/";
    lo.maxFree = e->opts_.loopFreeMax;
    ASSIGN_OR_RETURN(e->loops_, LoopPool::open(lo));
    if (e->opts_.registry) {
      e->metricsId_ = e->opts_.registry->add(
          [raw = e.get()](metrics::Writer& w) {
            raw->loops_->writeMetrics(w);
            if (raw->cgroups_) {
              w.gauge("dsec_edge_memory_cgroup_pool",
                      "Emptied memory cgroups (v1) kept for the next creates, which take one "
                      "instead of making one, sparing its removal (edge/cgroup.h).",
                      double(raw->cgroups_->memoryPoolSize()));
            }
          });
    }
  }
  e->stateDir_ = std::make_unique<SandboxStateDir>(e->opts_.dataDir + "/state");
  RETURN_IF_ERROR(e->stateDir_->open());
  std::vector<SandboxState> live;
  std::set<std::string> keep;
  std::map<std::string, IdRange> keepRanges;
  for (auto& s : e->stateDir_->loadAll()) {
    auto started = processStartTime(s.pid);
    // fncall sandboxes are container sandboxes underneath (backends/fncall).
    bool vm = proto::isVm(s.backend);
    // A hibernated VM has no process: its saved state file is checked on adopt.
    if ((vm && s.hibernated) || (started.isOk() && *started == s.startTime)) {
      if (!vm && e->userns_.enabled) {
        // The ids its processes run as, whatever its record says, are what
        // must not be handed out again while it lives (adopt() compares the
        // two; a sandbox of a --userns off run maps the identity: none). An
        // older edge's record has no range: the kernel's is the truth.
        if (auto r = readIdMap(s.pid); r.isOk() && r->base != 0) {
          keepRanges[s.spec.id] = *r;
          if (s.userns.empty()) s.userns = *r;
        }
      }
      keep.insert(s.spec.id);
      live.push_back(std::move(s));
    } else {
      log::warn("sandbox " + s.spec.id + " of an earlier edge is gone; removing its leftovers");
      e->stateDir_->remove(s.spec.id);
    }
  }
  ContainerOptions co;
  co.aetherPath = e->opts_.aetherPath;
  co.sandboxRoot = e->opts_.dataDir + "/sandboxes";
  co.diskQuota = e->opts_.diskQuota;
  co.diskPoolBytes = e->opts_.diskPoolBytes;
  co.userns = &e->userns_;
  co.keepRanges = std::move(keepRanges);
  co.loops = e->loops_.get();
  ASSIGN_OR_RETURN(auto container, ContainerBackend::make(co, e->cgroups_.get(), e->layers_.get(),
                                                          e->reactor_.get(), keep));
  e->diskQuotaInfo_ = container->diskQuotaInfo();
  e->container_ = container.get();
  if (int orphans = container->cleanupOrphans(); orphans > 0) {
    log::warn("removed leftovers of " + std::to_string(orphans) + " orphan sandboxes");
    e->countOrphans("sandbox", orphans);
  }
  // fncall: a thin layer over the container backend (backends/fncall).
  e->backends_[BackendKind::kFncall] =
      std::make_unique<FncallBackend>(container.get(), e->opts_.fncallLanguages,
                                      e->opts_.fncallZygoteMaxCalls);
  e->backends_[BackendKind::kContainer] = std::move(container);
  std::string microvmGuestDir = e->opts_.microvmGuestDir;
  if (microvmGuestDir.empty()) {
    auto slash = e->opts_.aetherPath.rfind('/');
    microvmGuestDir =
        (slash == std::string::npos ? std::string(".") : e->opts_.aetherPath.substr(0, slash)) +
        "/microvm-guest";
  }
  {
    MicroVmOptions mo;
    mo.guestDir = microvmGuestDir;
    mo.qemuPath = e->opts_.qemuPath;
    mo.vmRoot = e->opts_.dataDir + "/microvm";
    mo.logDir = e->opts_.dataDir + "/microvm-logs";
    mo.bootTimeoutS = e->opts_.microvmBootTimeoutS;
    mo.accel = e->opts_.microvmAccel;
    mo.agentChannel = e->opts_.microvmAgentChannel;
    e->microvm_ = probeMicroVm(mo);
    if (e->microvm_.available) {
      ASSIGN_OR_RETURN(auto vm, MicroVmBackend::make(mo, e->microvm_, e->cgroups_.get(),
                                                     e->layers_.get(), e->reactor_.get(), keep));
      if (int orphans = vm->cleanupOrphans(); orphans > 0) {
        log::warn("removed leftovers of " + std::to_string(orphans) + " orphan microvms");
        e->countOrphans("sandbox", orphans);
      }
      e->backends_[BackendKind::kMicrovm] = std::move(vm);
    }
    log::info(std::string("edge: microvm backend ") +
              (e->microvm_.available ? "on " + e->microvm_.accelerator + " (" +
                                           e->microvm_.reason + ")"
                                     : "unavailable: " + e->microvm_.reason));
  }
  {
    VmOptions vo;
    vo.qemuPath = e->opts_.qemuPath;
    vo.qemuImgPath = e->opts_.qemuImgPath;
    vo.vmRoot = e->opts_.dataDir + "/vm";
    vo.baseDir = e->opts_.dataDir + "/vm-bases";
    vo.logDir = e->opts_.dataDir + "/vm-logs";
    vo.bootTimeoutS = e->opts_.vmBootTimeoutS;
    vo.accel = e->opts_.microvmAccel;
    vo.probeKernel = microvmGuestDir + "/vmlinux";
    e->vm_ = probeVm(vo);
    if (e->vm_.available) {
      ASSIGN_OR_RETURN(auto vm, VmBackend::make(vo, e->vm_, e->cgroups_.get(), e->cache_.get(),
                                                e->reactor_.get(), keep));
      if (int orphans = vm->cleanupOrphans(); orphans > 0) {
        log::warn("removed leftovers of " + std::to_string(orphans) + " orphan vms");
        e->countOrphans("sandbox", orphans);
      }
      e->backends_[BackendKind::kVm] = std::move(vm);
    }
    log::info(std::string("edge: vm backend ") +
              (e->vm_.available ? "on " + e->vm_.accelerator + " (" + e->vm_.reason + ")"
                                : "unavailable: " + e->vm_.reason));
  }
  // The egress filter covers every sandbox of this edge from here on; where
  // it cannot run, no sandbox gets egress (each stays on its own loopback).
  if (std::string dir = e->cgroups_->v2Parent(); dir.empty()) {
    e->egressWhy_ = "no cgroup v2 hierarchy for the eBPF egress filter";
  } else if (auto f = net::EgressFilter::start(dir); !f.isOk()) {
    e->egressWhy_ = f.status().message();
  } else {
    e->filter_ = std::move(*f);
  }
  if (!e->egressWhy_.empty()) log::warn("edge: sandbox egress unavailable: " + e->egressWhy_);
  e->adoptAll(std::move(live));
  // The filter knows the adopted sandboxes' rules now: the earlier edge's
  // programs, which kept them meanwhile, may go.
  if (e->filter_) e->filter_->detachStale();
  // Its loader process kept filling for them meanwhile too.
  if (e->adopted_.empty() || !e->cache_->staleLoaderServesAdopted()) {
    e->cache_->endStaleLoader();
  } else {
    e->staleLoaderHeld_ = true;
  }
  if (e->opts_.statsIntervalS > 0)
    e->sampler_ = std::thread([raw = e.get()] { raw->sampleLoop(); });
  log::info("edge: " + e->describe());
  return e;
}

void Edge::sampleLoop() {
  std::unique_lock lk(samplerMu_);
  const auto interval = std::chrono::duration<double>(opts_.statsIntervalS);
  while (!samplerStop_) {
    lk.unlock();
    sampleOnce();
    lk.lock();
    samplerCv_.wait_for(lk, interval, [this] { return samplerStop_; });
  }
}

void Edge::sampleOnce() {
  std::vector<std::pair<std::string, std::shared_ptr<Instance>>> live;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, inst] : sandboxes_) {
      if (inst) live.emplace_back(id, inst);  // not one being created
    }
  }
  std::set<std::string> ids;
  for (auto& [id, inst] : live) {
    ids.insert(id);
    // A VM paused to disk has no process and may have no group: no reading.
    auto s = inst->stats();
    if (s.isOk()) history_.record(id, {nowSeconds(), s->cpuUsec, s->memoryBytes, s->pids});
  }
  // One destroyed while this ran may have been recorded again after its drop.
  history_.retain(ids);
}

void Edge::stopSampler() {
  {
    std::lock_guard lk(samplerMu_);
    samplerStop_ = true;
  }
  samplerCv_.notify_all();
  if (sampler_.joinable()) sampler_.join();
}

std::function<void()> Edge::deathHandlerFor(const std::string& id) {
  return [this, id] {
    std::function<void(const std::string&, const std::string&)> h;
    {
      std::lock_guard lk(mu_);
      if (!sandboxes_.count(id)) return;  // being destroyed on purpose
      h = onDeath_;
    }
    log::warn("sandbox " + id + ": agent exited unexpectedly");
    if (h) h(id, "sandbox agent (PID 1) exited unexpectedly");
  };
}

void Edge::countOrphans(const std::string& kind, int n) {
  if (n > 0) orphans_[kind] += n;
}

std::map<std::string, int> Edge::orphansRemoved() const {
  std::lock_guard lk(mu_);
  return orphans_;
}

std::vector<std::string> Edge::adoptedIds() const {
  std::lock_guard lk(mu_);
  return {adopted_.begin(), adopted_.end()};
}

void Edge::adoptAll(std::vector<SandboxState> live) {
  if (live.empty()) {
    removeEgressLeftovers({});
    return;
  }
  double t0 = monoSeconds();
  bool anyEgress = false;
  for (auto& s : live) {
    const std::string id = s.spec.id;
    auto bit = backends_.find(s.backend);
    if (bit == backends_.end()) {
      // A microvm left by an edge that had the backend, on one that has not.
      log::warn("sandbox " + id + ": backend " + proto::backendName(s.backend) +
                " unavailable; its leftovers stay");
      stateDir_->remove(id);
      countOrphans("sandbox", 1);
      continue;
    }
    Backend* b = bit->second.get();
    {
      std::lock_guard lk(mu_);
      sandboxes_[id] = nullptr;  // as in create: a death meanwhile is not a destroy
    }
    auto inst = b->adopt(s, deathHandlerFor(id));
    if (!inst.isOk()) {
      log::warn("sandbox " + id + " cannot be re-adopted, removing it: " +
                inst.status().toString());
      {
        std::lock_guard lk(mu_);
        sandboxes_.erase(id);
      }
      b->removeOrphan(id);
      stateDir_->remove(id);
      countOrphans("sandbox", 1);
      continue;
    }
    uint64_t cg = 0;
    if (filter_) {
      auto id64 = net::EgressFilter::cgroupId(cgroups_->v2DirOf(id));
      Status st = id64.isOk() ? filter_->addSandbox(*id64) : id64.status();
      if (st.isOk()) st = filter_->setRules(*id64, s.egress);
      if (!st.isOk()) log::error("adopt " + id + ": egress filter: " + st.toString());
      if (id64.isOk()) cg = *id64;
    }
    anyEgress = anyEgress || !s.egress.empty();
    std::lock_guard lk(mu_);
    sandboxes_[id] = std::shared_ptr<Instance>(std::move(inst).value());
    backendOf_[id] = b;
    if (cg != 0) egressCg_[id] = cg;
    if (s.paused) paused_.insert(id);
    adopted_.insert(id);
    states_[id] = std::move(s);
  }
  // The adopted sandboxes that had a path out keep it (their veths outlived
  // the edge, and so did the nftables table, replaced here); every other
  // veth of this edge is an orphan.
  // Without those, what an earlier edge of ours set up for egress goes, as
  // no later stop would remove it (this edge starts the path on demand).
  if (!anyEgress || !filter_) {
    auto ids = adoptedIds();
    anyEgress = !removeEgressLeftovers({ids.begin(), ids.end()});
  }
  if (anyEgress && filter_) {
    std::lock_guard lk(egressMu_);
    EgressNetConfig c = egressConfig();
    auto net = EgressNet::start(c);
    if (!net.isOk()) {
      log::error("adopt: egress path: " + net.status().toString());
      return;
    }
    egressNet_ = std::move(*net);
    auto ids = adoptedIds();
    countOrphans("veth", egressNet_->cleanupOrphans({ids.begin(), ids.end()}));
    for (auto& id : ids) {
      if (egressNet_->hasLink(id)) veths_.insert(id);
    }
  }
  char took[32];
  std::snprintf(took, sizeof took, "%.1f", (monoSeconds() - t0) * 1000);
  log::info("re-adopted " + std::to_string(adopted_.size()) + " sandboxes of an earlier edge in " +
            took + " ms");
}

void Edge::updateState(const std::string& id, const std::function<void(SandboxState&)>& change) {
  SandboxState copy;
  {
    std::lock_guard lk(mu_);
    auto it = states_.find(id);
    if (it == states_.end()) return;
    change(it->second);
    copy = it->second;
  }
  // A sandbox destroyed meanwhile has its file removed after this put at
  // worst; the next start then finds its PID 1 gone and drops the record.
  if (Status st = stateDir_->put(copy); !st.isOk()) {
    log::error("sandbox " + id + ": state: " + st.toString());
  }
}

Edge::~Edge() {
  // First: a scrape under way ends before the pool goes.
  if (metricsId_) opts_.registry->remove(metricsId_);
  shutdown();
}

std::string Edge::describe() const {
  return "cgroups " + cgroups_->describe() + " under " + opts_.cgroupParent +
         ", layers mounted by " + layers_->mountMethod() + ", disk quota by " + diskQuotaInfo_ +
         ", blobs from " + cache_->storeUri() + " by the " + cache_->loaderName() + " loader" +
         ", egress " +
         (filter_ ? "by policy (eBPF filter at " + cgroups_->v2Parent() + ")"
                  : "unavailable: " + egressWhy_) +
         ", user namespaces " + userns_.reason + ", backends: container" +
         (microvm_.available ? ", microvm (" + microvm_.accelerator + ")" : "") +
         (vm_.available ? ", vm (" + vm_.accelerator + ")" : "");
}

void Edge::setDeathHandler(std::function<void(const std::string&, const std::string&)> h) {
  std::lock_guard lk(mu_);
  onDeath_ = std::move(h);
}

std::shared_ptr<Instance> Edge::find(const std::string& id) const {
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  return it == sandboxes_.end() ? nullptr : it->second;
}

namespace {
// The platform routes calls only to sandboxes it records as running; one the
// edge no longer has was destroyed (or died) in the meantime.
Status notRunning(const std::string& id) {
  return Status(Code::kFailedPrecondition, "sandbox " + id + " is no longer running");
}
}  // namespace

Status Edge::create(BackendKind backend, const SandboxSpec& spec) {
  auto bit = backends_.find(backend);
  if (bit == backends_.end()) {
    if (backend == BackendKind::kMicrovm) {
      return Status(Code::kFailedPrecondition,
                    "backend microvm is not available on this node: " + microvm_.reason);
    }
    if (backend == BackendKind::kVm) {
      return Status(Code::kFailedPrecondition,
                    "backend vm is not available on this node: " + vm_.reason);
    }
    return invalidArg("backend", std::string("backend '") + proto::backendName(backend) +
                                     "' is not available on this node");
  }
  // A VM's NIC is for egress only: refused before a boot that would be undone.
  if (spec.network && !filter_ && proto::isVm(backend)) {
    return Status(Code::kFailedPrecondition, "this node cannot give sandboxes egress: " + egressWhy_,
                  0, "policy");
  }
  {
    // A placeholder from here on, so a death during the backend's create is
    // not mistaken for a deliberate destroy.
    std::lock_guard lk(mu_);
    if (stopping_) return Status(Code::kUnavailable, "the node is shutting down");
    if (sandboxes_.count(spec.id)) return Status(Code::kAlreadyExists, spec.id + " exists");
    sandboxes_[spec.id] = nullptr;
  }
  auto inst = bit->second->create(spec, deathHandlerFor(spec.id));
  if (inst.isOk() && !bit->second->takesInitPolicy()) {
    // What the others' agents take with init, in calls.
    Result<std::string> done = std::string();
    if (!spec.workingDir.empty()) {
      json mk = {{"path", spec.workingDir}, {"parents", true}, {"mode", 0755}};
      done = agentCall(*(*inst)->agent(), proto::FrameType::kMkdir, mk.dump(), kAgentCallTimeoutS);
      if (!done.isOk()) done = Status(done.status()).withContext("working_dir " + spec.workingDir);
    }
    if (done.isOk() && !spec.initPolicy.empty()) {
      done = agentCall(*(*inst)->agent(), proto::FrameType::kPolicy, spec.initPolicy,
                       kAgentCallTimeoutS);
    }
    if (!done.isOk()) {
      (void)bit->second->destroy(**inst);
      inst = done.status();
    }
  }
  // Recorded before the create is acknowledged, so that an edge restarted
  // from here on re-adopts the sandbox.
  SandboxState state;
  if (inst.isOk()) {
    state.backend = backend;
    state.spec = spec;
    state.pid = (*inst)->initPid();
    state.userns = (*inst)->idRange();
    auto started = processStartTime(state.pid);
    Status st = started.isOk() ? Status::ok() : started.status();
    if (st.isOk()) {
      state.startTime = *started;
      st = stateDir_->put(state);
    }
    if (!st.isOk()) {
      (void)bit->second->destroy(**inst);
      inst = st.withContext("record " + spec.id);
    }
  }
  std::unique_lock lk(mu_);
  if (inst.isOk() && stopping_) {
    // The node began to shut down while this create ran (a VM boot can take
    // minutes): undo it rather than leave it to nobody.
    lk.unlock();
    (void)bit->second->destroy(**inst);
    stateDir_->remove(spec.id);
    inst = Status(Code::kUnavailable, "the node shut down while " + spec.id + " was created");
    lk.lock();
  }
  if (!inst.isOk()) {
    sandboxes_.erase(spec.id);
    creatingCv_.notify_all();
    return inst.status();
  }
  states_[spec.id] = std::move(state);
  sandboxes_[spec.id] = std::shared_ptr<Instance>(std::move(inst).value());
  backendOf_[spec.id] = bit->second.get();
  if (filter_) {
    // Until this entry exists the filter denies the group everything but
    // loopback; with it, the sandbox is known (and its denials counted).
    auto cg = net::EgressFilter::cgroupId(cgroups_->v2DirOf(spec.id));
    Status st = cg.isOk() ? filter_->addSandbox(*cg) : cg.status();
    if (!st.isOk()) {
      auto doomed = sandboxes_[spec.id];
      Backend* b = backendOf_[spec.id];
      sandboxes_.erase(spec.id);
      backendOf_.erase(spec.id);
      states_.erase(spec.id);
      (void)b->destroy(*doomed);
      stateDir_->remove(spec.id);
      return st.withContext("egress filter");
    }
    egressCg_[spec.id] = *cg;
  }
  return Status::ok();
}

Status Edge::destroy(const std::string& id) {
  std::shared_ptr<Instance> inst;
  Backend* backend = nullptr;
  uint64_t cg = 0;
  bool wasPaused = false;
  bool endStale = false;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    // Unknown, or still being created (the platform never destroys those).
    if (it == sandboxes_.end() || !it->second) return Status::ok();
    inst = it->second;
    backend = backendOf_[id];
    sandboxes_.erase(it);
    backendOf_.erase(id);
    if (auto c = egressCg_.find(id); c != egressCg_.end()) {
      cg = c->second;
      egressCg_.erase(c);
    }
    wasPaused = paused_.erase(id) > 0;
    states_.erase(id);
    if (adopted_.erase(id) && adopted_.empty() && staleLoaderHeld_) {
      endStale = true;
      staleLoaderHeld_ = false;
    }
  }
  // Its port connections end now, not when its processes' sockets go.
  ports_.forget(id);
  history_.drop(id);
  // A frozen task takes its SIGKILL only once thawed (cgroup v1 freezer).
  if (wasPaused) (void)inst->freeze(false);
  Status st = backend->destroy(*inst);
  stateDir_->remove(id);
  // The last sandbox that read through the earlier edge's loader is gone.
  if (endStale) cache_->endStaleLoader();
  if (cg != 0) filter_->removeSandbox(cg);
  std::lock_guard lk(egressMu_);
  if (veths_.erase(id) && egressNet_) {
    // Deleted now rather than left to go with the netns: a socket the
    // sandbox left behind (a peer that stopped answering a FIN) can keep a
    // netns alive for minutes, and its veth and /30 with it.
    if (Status d = egressNet_->detach(id); !d.isOk()) log::warn("egress: " + d.toString());
  }
  return st;
}

Status Edge::setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) {
  std::shared_ptr<Instance> inst;
  uint64_t cg = 0;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || !it->second) return notFound("sandbox " + id + " not found");
    inst = it->second;
    if (auto c = egressCg_.find(id); c != egressCg_.end()) cg = c->second;
  }
  // A VM booted without a NIC cannot be given one (microvm has no hotplug):
  // refused before anything changes. Its openNetns() says why.
  if (!rules.empty() && !inst->hasNetwork()) {
    auto ns = inst->openNetns();
    return ns.isOk() ? Status(Code::kFailedPrecondition, "sandbox " + id + " has no network", 0,
                              "egress")
                     : ns.status();
  }
  if (!filter_ || cg == 0) {
    if (rules.empty()) return Status::ok();  // closed already: nothing to cut
    return Status(Code::kFailedPrecondition,
                  "this node cannot give sandboxes egress: " + egressWhy_, 0, "egress");
  }
  // Cutting needs only the filter; granting first gives the sandbox a path out.
  // A VM paused to disk has no netns now: its restore plumbs one
  // (plumbEgress) with the rules recorded below.
  if (!rules.empty() && !inst->hibernated()) {
    std::lock_guard lk(egressMu_);
    RETURN_IF_ERROR(startEgressNetLocked());
    // A sandbox re-adopted with no egress at that moment may still have the
    // veth an earlier edge gave it.
    if (!veths_.count(id) && egressNet_->hasLink(id)) veths_.insert(id);
    if (!veths_.count(id)) {
      ASSIGN_OR_RETURN(UniqueFd ns, inst->openNetns());
      auto att = egressNet_->attach(id, ns.get());
      if (!att.isOk()) return Status(att.status()).withContext("egress for " + id);
      veths_.insert(id);
    }
  }
  RETURN_IF_ERROR(filter_->setRules(cg, rules));
  updateState(id, [&](SandboxState& s) { s.egress = rules; });
  return Status::ok();
}

Status Edge::startEgressNetLocked() {
  if (egressNet_) return Status::ok();
  ASSIGN_OR_RETURN(egressNet_, EgressNet::start(egressConfig()));
  auto live = sandboxIds();
  if (int n = egressNet_->cleanupOrphans({live.begin(), live.end()}); n > 0) {
    log::warn("egress: removed " + std::to_string(n) + " orphan veth links");
  }
  return Status::ok();
}

Status Edge::plumbEgress(const std::string& id, Instance& inst) {
  bool granted = false;
  {
    std::lock_guard lk(mu_);
    if (auto it = states_.find(id); it != states_.end()) granted = !it->second.egress.empty();
  }
  if (!granted || !inst.hasNetwork() || !filter_) return Status::ok();
  std::lock_guard lk(egressMu_);
  RETURN_IF_ERROR(startEgressNetLocked());
  // The veth of the netns before (one that outlived its QEMU, or that an
  // earlier edge saw) would hold the name and the /30.
  if (veths_.erase(id) > 0 || egressNet_->hasLink(id)) {
    if (Status d = egressNet_->detach(id); !d.isOk()) return d.withContext("egress for " + id);
  }
  ASSIGN_OR_RETURN(UniqueFd ns, inst.openNetns());
  auto att = egressNet_->attach(id, ns.get());
  if (!att.isOk()) return Status(att.status()).withContext("egress for " + id);
  veths_.insert(id);
  return Status::ok();
}

Status Edge::hibernate(const std::string& id) {
  std::shared_ptr<Instance> inst;
  Backend* backend = nullptr;
  bool wasPaused = false;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || !it->second) return notFound("sandbox " + id + " not found");
    inst = it->second;
    backend = backendOf_[id];
    wasPaused = paused_.count(id) > 0;
  }
  RETURN_IF_ERROR(backend->hibernate(*inst, wasPaused, [&]() -> Status {
    // Recorded before the VM's process goes: a restarted edge then restores
    // the sandbox from its state file rather than finding its QEMU gone.
    SandboxState before, copy;
    {
      std::lock_guard lk(mu_);
      auto it = states_.find(id);
      if (it == states_.end()) return notRunning(id);
      before = it->second;
      it->second.paused = true;
      it->second.hibernated = true;
      it->second.pid = -1;
      it->second.startTime = 0;
      copy = it->second;
    }
    Status st = stateDir_->put(copy);
    if (!st.isOk()) {
      std::lock_guard lk(mu_);
      if (auto it = states_.find(id); it != states_.end()) it->second = before;
    }
    return st;
  }));
  {
    std::lock_guard lk(mu_);
    if (sandboxes_.count(id)) paused_.insert(id);
  }
  // Nothing of it runs: its port connections are cut, its set forgotten.
  ports_.forget(id);
  // Its netns went with its QEMU; so goes its veth, now rather than with
  // the netns (a lingering socket can keep that alive). A restore plumbs a
  // new one.
  std::lock_guard lk(egressMu_);
  if (veths_.erase(id) && egressNet_) {
    if (Status d = egressNet_->detach(id); !d.isOk()) log::warn("egress: " + d.toString());
  }
  return Status::ok();
}

Status Edge::pause(const std::string& id, bool paused) {
  auto inst = find(id);
  if (!inst) return notFound("sandbox " + id + " not found");
  if (inst->hibernated()) {
    if (paused) return Status::ok();  // paused already, to disk
    Backend* backend = nullptr;
    {
      std::lock_guard lk(mu_);
      backend = backendOf_[id];
    }
    Status st =
        backend->restore(*inst, deathHandlerFor(id), [&] { return plumbEgress(id, *inst); });
    if (!st.isOk()) {
      // Its saved state would not run again: the sandbox is gone (console
      // log kept, its path in the error), and its owner is told so.
      log::error(st.toString());
      std::function<void(const std::string&, const std::string&)> h;
      {
        std::lock_guard lk(mu_);
        h = onDeath_;
      }
      (void)destroy(id);
      if (h) h(id, st.message());
      return st;
    }
    pid_t pid = inst->initPid();
    auto started = processStartTime(pid);
    {
      std::lock_guard lk(mu_);
      paused_.erase(id);
    }
    updateState(id, [&](SandboxState& s) {
      s.paused = false;
      s.hibernated = false;
      s.pid = pid;
      s.startTime = started.isOk() ? *started : 0;
    });
    return Status::ok();
  }
  RETURN_IF_ERROR(inst->freeze(paused));
  {
    std::lock_guard lk(mu_);
    if (paused) {
      paused_.insert(id);
    } else {
      paused_.erase(id);
    }
  }
  updateState(id, [&](SandboxState& s) { s.paused = paused; });
  return Status::ok();
}

Status Edge::setLimits(const std::string& id, const CgroupLimits& limits) {
  auto inst = find(id);
  if (!inst) return notFound("sandbox " + id + " not found");
  return inst->setLimits(limits);
}

std::string Edge::egressTag() const { return "e" + sha256Hex(opts_.cgroupParent).substr(0, 12); }

EgressNetConfig Edge::egressConfig() const {
  EgressNetConfig c;
  c.subnet = opts_.egressSubnet;
  c.enableNat = opts_.egressNat;
  c.tag = egressTag();
  return c;
}

bool Edge::removeEgressLeftovers(const std::set<std::string>& live) {
  return EgressNet::removeLeftovers(egressConfig(), live);
}

std::map<std::string, uint64_t> Edge::egressDenialCounts() {
  std::map<std::string, uint64_t> cgs;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, cg] : egressCg_) cgs[id] = cg;
  }
  std::map<std::string, uint64_t> out;
  for (auto& [id, cg] : cgs) {
    if (auto d = filter_->denials(cg); d.isOk() && d->count > 0) out[id] = d->count;
  }
  return out;
}

std::map<std::string, uint64_t> Edge::syscallDenialCounts() const {
  std::map<std::string, uint64_t> out;
  std::lock_guard lk(mu_);
  for (auto& [id, inst] : sandboxes_) {
    if (!inst) continue;
    if (auto conn = inst->agent(); conn && conn->deniedSyscalls() > 0) {
      out[id] = conn->deniedSyscalls();
    }
  }
  return out;
}

Result<net::EgressDenials> Edge::egressDenials(const std::string& id) {
  uint64_t cg = 0;
  {
    std::lock_guard lk(mu_);
    if (auto c = egressCg_.find(id); c != egressCg_.end()) cg = c->second;
  }
  if (cg == 0) return net::EgressDenials{};
  return filter_->denials(cg);
}

namespace {

// An exec in flight: its agent stream's frames complete it on the reactor
// thread. Callbacks run with deliverMu_ held, so they never overlap for one
// call (frames, the guard timer and a cancel's fallback all end here);
// cancel() takes only mu_, so a callback may call it.
class AgentExec : public proto::ExecCall, public std::enable_shared_from_this<AgentExec> {
 public:
  AgentExec(std::shared_ptr<Instance> inst, proto::ExecCallbacks cb)
      : inst_(std::move(inst)), conn_(inst_->agent()), cb_(std::move(cb)) {}

  // Sends the exec (and its stdin) on a new stream. On error the call is done.
  void start(const ExecSpec& spec) {
    oomBefore_ = inst_->oomKills();
    json req = {{"argv", spec.argv},
                {"env", spec.env},
                {"timeout_ms", spec.timeoutMs},
                {"max_output", spec.maxOutput},
                {"stdin", spec.stdinData.has_value() || spec.interactive}};
    if (spec.pty) req["pty"] = {{"rows", spec.pty->rows}, {"cols", spec.pty->cols}};
    {
      std::lock_guard lk(mu_);
      interactive_ = spec.interactive || spec.pty.has_value();
    }
    if (!spec.cwd.empty()) req["cwd"] = spec.cwd;
    if (!spec.user.empty()) req["user"] = spec.user;
    if (!spec.fncallJson.empty()) req["fncall"] = json::parse(spec.fncallJson, nullptr, false);
    std::weak_ptr<AgentExec> weak = shared_from_this();
    StreamHandler h;
    h.onFrame = [weak](proto::Frame& f) {
      if (auto self = weak.lock()) self->onFrame(f);
    };
    h.onFail = [weak](const Status& why) {
      if (auto self = weak.lock()) self->finish(why);
    };
    // Until the exit frame, the stream (through the connection) keeps this
    // call alive; the caller's handle may go at any time.
    {
      std::lock_guard lk(mu_);
      self_ = shared_from_this();
    }
    auto stream = conn_->openStream(std::move(h));
    uint32_t sid = stream->id();
    {
      std::lock_guard lk(mu_);
      stream_ = sid;
    }
    Status st = conn_->send(sid, proto::FrameType::kExec, req.dump());
    if (st.isOk() && spec.stdinData) {
      std::string_view in = *spec.stdinData;
      for (size_t off = 0; off < in.size() && st.isOk(); off += proto::kDataChunk) {
        st = conn_->send(sid, proto::FrameType::kStdin, in.substr(off, proto::kDataChunk));
      }
      if (st.isOk()) st = conn_->send(sid, proto::FrameType::kStdin, "");
    }
    if (!st.isOk()) return finish(st);
    {
      // Input queued before the exec frame went out follows it now.
      std::lock_guard lk(mu_);
      started_ = true;
    }
    pumpInput();
    // The agent enforces the timeout; this only guards against a wedged agent.
    if (spec.timeoutMs > 0) {
      auto g = Runtime::global().after(double(spec.timeoutMs) / 1000 + 30, [weak] {
        if (auto self = weak.lock()) {
          self->finish(Status(Code::kDeadlineExceeded, "agent did not answer in time"));
        }
      });
      std::lock_guard lk(mu_);
      if (done_) {
        g->cancel();
      } else {
        guard_ = std::move(g);
      }
    }
  }

  Status sendInput(std::string_view bytes) override {
    return queue(proto::FrameType::kStdin, std::string(bytes));
  }
  Status resize(proto::TermSize size) override {
    return queue(proto::FrameType::kResize,
                 json{{"rows", size.rows}, {"cols", size.cols}}.dump());
  }
  Status signal(int sig) override {
    if (sig < 1 || sig > 64) return invalidArg("signal", "signal must be from 1 to 64");
    return queue(proto::FrameType::kSignal, json{{"signal", sig}}.dump());
  }

  void cancel() override {
    uint32_t id;
    {
      std::lock_guard lk(mu_);
      if (done_ || cancelled_) return;
      cancelled_ = true;
      id = stream_;
    }
    // The send may block on a full agent socket: not on the caller's thread.
    auto conn = conn_;
    Runtime::global().runBlocking([conn, id] {
      if (id != 0) (void)conn->send(id, proto::FrameType::kCancel, "");
    });
    // The agent still reports the exit; if it does not within 5 s, give up.
    std::weak_ptr<AgentExec> weak = shared_from_this();
    auto t = Runtime::global().after(5, [weak] {
      if (auto self = weak.lock()) self->finish(cancelledStatus());
    });
    std::lock_guard lk(mu_);
    if (done_) {
      t->cancel();
    } else {
      cancelGuard_ = std::move(t);
    }
  }

 private:
  static Status cancelledStatus() {
    return Status(Code::kUnavailable, "exec cancelled: client went away");
  }

  // Interactive frames go out in call order from one blocking-pool task at
  // a time (a send may block on a full agent socket; callers must not).
  Status queue(proto::FrameType type, std::string payload) {
    {
      std::lock_guard lk(mu_);
      // Signals serve every exec; input and resizes interactive ones.
      if ((!interactive_ && type != proto::FrameType::kSignal) || done_ || cancelled_) {
        return Status(Code::kFailedPrecondition, "the exec is not interactive, or has ended", 0,
                      "interactive");
      }
      // Frames hold at most kDataChunk; an empty stdin frame closes stdin.
      size_t off = 0;
      do {
        outq_.emplace_back(type, payload.substr(off, proto::kDataChunk));
        off += proto::kDataChunk;
      } while (off < payload.size());
    }
    pumpInput();
    return Status::ok();
  }

  void pumpInput() {
    {
      std::lock_guard lk(mu_);
      if (!started_ || pumping_ || outq_.empty()) return;
      pumping_ = true;
    }
    std::weak_ptr<AgentExec> weak = shared_from_this();
    Runtime::global().runBlocking([weak] {
      auto self = weak.lock();
      if (!self) return;
      for (;;) {
        std::pair<proto::FrameType, std::string> f;
        uint32_t sid;
        {
          std::lock_guard lk(self->mu_);
          if (self->outq_.empty() || self->done_) {
            self->outq_.clear();
            self->pumping_ = false;
            return;
          }
          f = std::move(self->outq_.front());
          self->outq_.pop_front();
          sid = self->stream_;
        }
        // A failure here is the connection's: the exec ends with it.
        (void)self->conn_->send(sid, f.first, f.second);
      }
    });
  }

  void onFrame(proto::Frame& f) {
    switch (f.type) {
      case proto::FrameType::kStdout:
      case proto::FrameType::kStderr: {
        bool isErr = f.type == proto::FrameType::kStderr;
        std::lock_guard dl(deliverMu_);
        if (isDone()) return;
        if (cb_.onOutput) {
          if (!isCancelled()) cb_.onOutput(isErr, f.payload);
        } else {
          (isErr ? res_.err : res_.out).append(f.payload);
        }
        return;
      }
      case proto::FrameType::kStarted: {
        json j = json::parse(f.payload, nullptr, false);
        auto pid = j.is_object() ? j.find("pid") : j.end();
        if (j.is_object() && pid != j.end() && pid->is_number_integer()) {
          std::lock_guard dl(deliverMu_);
          if (!isDone() && cb_.onStarted) cb_.onStarted(pid->get<int>());
        }
        return;
      }
      case proto::FrameType::kExit:
        return onExit(f.payload);
      case proto::FrameType::kResult: {
        Status st = resultStatus(f.payload);
        if (!st.isOk()) finish(st);
        return;
      }
      default:
        return;
    }
  }

  void onExit(const std::string& payload) {
    json j = json::parse(payload, nullptr, false);
    if (j.is_discarded()) return finish(internalError("agent sent a malformed exit report"));
    ExecResult r;
    // A compromised agent must not take the edge down: json's typed getters
    // throw on a wrong type.
    try {
      r.exitCode = j.value("exit_code", -1);
      r.signal = j.value("signal", 0);
      r.timedOut = j.value("timed_out", false);
      r.truncated = j.value("truncated", false);
      r.durationMs = double(j.value("duration_us", int64_t(0))) / 1000.0;
      if (auto l = j.find("limit"); l != j.end()) {
        r.call = true;
        if (l->is_string()) r.limit = l->get<std::string>();
      }
      r.zygoteStarted = j.value("zygote_start", false);
    } catch (const json::exception&) {
      return finish(internalError("agent sent a malformed exit report"));
    }
    auto after = inst_->oomKills();
    if (oomBefore_.isOk() && after.isOk()) r.oomKilled = *after > *oomBefore_;
    if (r.call && r.oomKilled && r.limit.empty()) r.limit = "memory";
    if (isCancelled()) return finish(cancelledStatus());
    {
      std::lock_guard dl(deliverMu_);
      r.out = std::move(res_.out);
      r.err = std::move(res_.err);
    }
    finish(std::move(r));
  }

  void finish(Result<ExecResult> r) {
    // self_ may hold the last reference: this one outlives the lock below.
    std::shared_ptr<AgentExec> keep = shared_from_this();
    std::lock_guard dl(deliverMu_);
    std::shared_ptr<Runtime::Timer> guard, cancelGuard;
    uint32_t sid;
    {
      std::lock_guard lk(mu_);
      if (done_) return;
      done_ = true;
      guard = std::move(guard_);
      cancelGuard = std::move(cancelGuard_);
      self_.reset();
      sid = stream_;
    }
    if (guard) guard->cancel();
    if (cancelGuard) cancelGuard->cancel();
    if (sid != 0) conn_->closeStream(sid);
    if (cb_.onDone) cb_.onDone(std::move(r));
    cb_ = {};
  }

  bool isDone() {
    std::lock_guard lk(mu_);
    return done_;
  }
  bool isCancelled() {
    std::lock_guard lk(mu_);
    return cancelled_;
  }

  const std::shared_ptr<Instance> inst_;
  const std::shared_ptr<AgentConn> conn_;
  Result<int64_t> oomBefore_ = int64_t(0);
  std::mutex deliverMu_;  // held while a callback runs; guards cb_, res_
  proto::ExecCallbacks cb_;
  ExecResult res_;  // output collected when there is no onOutput
  std::mutex mu_;   // guards stream_, done_, cancelled_, the input queue, guards, self_
  uint32_t stream_ = 0;  // the agent stream, once opened
  bool done_ = false;
  bool cancelled_ = false;
  bool interactive_ = false;  // sendInput, resize and signal are served
  bool started_ = false;      // the exec frame was sent: queued frames may follow
  bool pumping_ = false;      // a pool task is sending outq_
  std::deque<std::pair<proto::FrameType, std::string>> outq_;
  std::shared_ptr<Runtime::Timer> guard_, cancelGuard_;
  std::shared_ptr<AgentExec> self_;
};

// A call that ended before it started (no such sandbox).
class EndedExec : public proto::ExecCall {
 public:
  void cancel() override {}
};

}  // namespace

std::shared_ptr<proto::ExecCall> Edge::startExec(const std::string& id, const ExecSpec& spec,
                                                 proto::ExecCallbacks cb) {
  auto inst = find(id);
  if (!inst) {
    if (cb.onDone) cb.onDone(notRunning(id));
    return std::make_shared<EndedExec>();
  }
  auto call = std::make_shared<AgentExec>(std::move(inst), std::move(cb));
  call->start(spec);
  return call;
}

Result<uint64_t> Edge::writeFile(const std::string& id, const std::string& path, int mode,
                                 const ByteSource& src) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  auto conn = inst->agent();
  auto stream = conn->openStream();
  StreamGuard guard{*conn, stream->id()};
  json req = {{"path", path}, {"mode", mode}, {"append", false}};
  RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kFileWrite, req.dump()));
  std::string buf(proto::kDataChunk, '\0');
  for (;;) {
    // An early result means the agent refused the write (bad path, no space).
    auto early = stream->next(0);
    if (early.isOk() && early->type == proto::FrameType::kResult) {
      RETURN_IF_ERROR(resultStatus(early->payload));
    }
    auto n = src(buf.data(), buf.size());
    if (!n.isOk()) {
      (void)conn->send(stream->id(), proto::FrameType::kCancel, "");
      return std::move(n).takeStatus();
    }
    if (*n == 0) break;
    RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kData,
                               std::string_view(buf.data(), *n)));
  }
  RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kData, ""));
  double deadline = monoSeconds() + kAgentCallTimeoutS;
  for (;;) {
    ASSIGN_OR_RETURN(proto::Frame f, stream->next(deadline));
    if (f.type != proto::FrameType::kResult) continue;
    RETURN_IF_ERROR(resultStatus(f.payload));
    json j = json::parse(f.payload, nullptr, false);
    return sizeOf(j);
  }
}

Status Edge::readFile(const std::string& id, const std::string& path,
                      const std::function<Status(std::optional<uint64_t>)>& onSize,
                      const ByteSink& sink) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  auto conn = inst->agent();
  // A size of 0 may be an empty file or a pseudo-file (/proc, /sys) whose
  // bytes exist only when read: then read ranges until one comes back empty.
  std::optional<uint64_t> size;
  uint64_t offset = 0;
  bool first = true;
  for (;;) {
    auto stream = conn->openStream();
    StreamGuard guard{*conn, stream->id()};
    uint64_t want = size ? std::min<uint64_t>(kReadRange, *size - offset) : kReadRange;
    json req = {{"path", path}, {"offset", offset}, {"length", want}};
    RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kFileRead, req.dump()));
    double deadline = monoSeconds() + kAgentCallTimeoutS;
    uint64_t got = 0;
    bool headerSeen = false;
    for (;;) {
      ASSIGN_OR_RETURN(proto::Frame f, stream->next(deadline));
      if (f.type == proto::FrameType::kResult) {
        RETURN_IF_ERROR(resultStatus(f.payload));
        if (first) {
          json j = json::parse(f.payload, nullptr, false);
          uint64_t announced = sizeOf(j);
          if (announced > 0) size = announced;
          RETURN_IF_ERROR(onSize(size));
          first = false;
        }
        headerSeen = true;
      } else if (f.type == proto::FrameType::kData && headerSeen) {
        if (f.payload.empty()) break;
        // Never pass on more than the size we announced.
        uint64_t room = size ? *size - std::min(*size, offset + got) : f.payload.size();
        std::string_view piece(f.payload.data(), std::min<uint64_t>(room, f.payload.size()));
        if (!piece.empty()) RETURN_IF_ERROR(sink(piece));
        got += piece.size();
      }
    }
    offset += got;
    if (got == 0 || (size && offset >= *size)) break;
  }
  if (size && offset < *size) {
    return Status(Code::kFailedPrecondition, "file " + path + " shrank while being read");
  }
  return Status::ok();
}

Result<std::string> Edge::agentOp(const std::string& id, proto::AgentOp op,
                                  const std::string& body) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  proto::FrameType type = proto::FrameType::kStat;
  switch (op) {
    case proto::AgentOp::kList:
      type = proto::FrameType::kList;
      break;
    case proto::AgentOp::kStat:
      type = proto::FrameType::kStat;
      break;
    case proto::AgentOp::kMkdir:
      type = proto::FrameType::kMkdir;
      break;
    case proto::AgentOp::kRemove:
      type = proto::FrameType::kRemove;
      break;
    case proto::AgentOp::kPolicy:
      type = proto::FrameType::kPolicy;
      break;
    case proto::AgentOp::kAudit:
      type = proto::FrameType::kAudit;
      break;
    case proto::AgentOp::kSetMeta:
      type = proto::FrameType::kSetMeta;
      break;
  }
  return agentCall(*inst->agent(), type, body, kAgentCallTimeoutS);
}

Result<image::BuiltLayer> Edge::packDiff(const std::string& id, const std::string& workDir) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  ASSIGN_OR_RETURN(Instance::UpperDir upperDir, inst->upperDir());
  const std::string& upper = upperDir.path;
  if (upper.empty() && inst->snapshotsDisk()) {
    // A vm: the snapshot is its whole disk (docs/vm.md), not a diff layer.
    RETURN_IF_ERROR(makeDirs(workDir, 0700));
    image::BuiltLayer disk;
    disk.kind = "disk";
    disk.path = workDir + "/disk.qcow2";
    RETURN_IF_ERROR(inst->snapshotDisk(disk.path).withContext("pack_diff " + id));
    ASSIGN_OR_RETURN(std::string hex, sha256File(disk.path));
    disk.digest = "sha256:" + hex;
    struct stat st;
    if (::stat(disk.path.c_str(), &st) != 0) return sysError("stat " + disk.path);
    disk.size = st.st_size;
    return disk;
  }
  if (upper.empty() && inst->exportsUpper()) {
    // A guest's writes (microvm): copied out, frozen inside the guest
    // meanwhile; ids are the guest's own, 0-based already.
    RETURN_IF_ERROR(makeDirs(workDir, 0700));
    std::string copy = workDir + "/upper";
    Status st = inst->exportUpper(copy);
    Result<image::BuiltLayer> layer = internalError("pack_diff: not built");
    if (st.isOk()) layer = image::buildLayer(copy, workDir);
    (void)removeTree(copy);
    if (!st.isOk()) return st.withContext("pack_diff " + id);
    return layer;
  }
  if (upper.empty()) {
    std::string name;
    {
      std::lock_guard lk(mu_);
      if (auto b = backendOf_.find(id); b != backendOf_.end()) name = " " + b->second->name();
    }
    return Status(Code::kFailedPrecondition, "backend" + name + " cannot pack_diff (snapshots)");
  }
  // In a user namespace the upper dir holds host ids of the sandbox's own
  // range (root inside = its base); the layer is built from a read-only view
  // that maps them back to 0-based ones, so snapshots stay portable between
  // sandboxes, ranges, nodes and modes. The overlay's
  // own whiteouts belong to host 0 and show as the overflow id there: only
  // their 0:0 device number makes them whiteouts.
  // A detached disk's upper (/proc/<pid>/fd/N/upper: docs/container-backend.md,
  // Mounts) gets a read-only view too: mkfs.erofs resolves its source with
  // realpath(3), which a path through a detached mount does not survive.
  // The view is one mount for the length of the pack.
  std::string view;
  IdRange range = inst->idRange();
  if (!range.empty() || startsWith(upper, "/proc/")) {
    RETURN_IF_ERROR(makeDirs(workDir, 0700));
    view = workDir + "/upper-view";
    if (::mkdir(view.c_str(), 0700) != 0 && errno != EEXIST) return sysError("mkdir " + view);
    // This sandbox's inverse mapping, made for this pack (a child for a
    // moment: small beside mkfs.erofs).
    UniqueFd inverse;
    if (!range.empty()) {
      auto inv = makeUsernsFd(inverseLine(range));
      if (!inv.isOk()) return std::move(inv).takeStatus().withContext("pack_diff " + id);
      inverse = std::move(*inv);
    }
    auto m = idmappedClone(upper, inverse ? inverse.get() : -1, true);
    if (!m.isOk()) return std::move(m).takeStatus().withContext("pack_diff " + id);
    RETURN_IF_ERROR(attachMount(m->get(), view));
  }
  // Frozen, so the layer is one consistent moment of the sandbox's files.
  Status frozen = inst->freeze(true);
  Result<image::BuiltLayer> layer = internalError("pack_diff: not built");
  if (frozen.isOk()) layer = image::buildLayer(view.empty() ? upper : view, workDir);
  if (!view.empty()) {
    if (::umount2(view.c_str(), MNT_DETACH) != 0) log::error("pack_diff: umount " + view);
    ::rmdir(view.c_str());
  }
  if (!frozen.isOk()) return frozen;
  Status thaw = inst->freeze(false);
  if (!thaw.isOk()) log::error("pack_diff " + id + ": thaw: " + thaw.toString());
  return layer;
}

Result<UniqueFd> Edge::openPort(const std::string& id, int port, uint64_t gen,
                                double connectTimeoutS) {
  if (port < 1 || port > 65535) return invalidArg("port", "port must be from 1 to 65535");
  std::shared_ptr<Instance> inst;
  BackendKind backend = BackendKind::kContainer;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || !it->second) return notFound("sandbox " + id + " not found");
    inst = it->second;
    if (auto st = states_.find(id); st != states_.end()) backend = st->second.backend;
  }
  if (backend == BackendKind::kFncall) {
    return Status(Code::kFailedPrecondition,
                  "backend fncall keeps no long-lived processes: it cannot expose ports", 0,
                  "backend");
  }
  if (backend != BackendKind::kContainer) {
    return Status(Code::kFailedPrecondition,
                  std::string("exposing ports of backend ") + proto::backendName(backend) +
                      " is not supported yet (container only; microvm and vm come later)",
                  0, "backend");
  }
  RETURN_IF_ERROR(ports_.check(id, port, gen));
  ASSIGN_OR_RETURN(UniqueFd ns, inst->openNetns());
  ASSIGN_OR_RETURN(UniqueFd fd, connectLoopback(ns.get(), port, connectTimeoutS));
  // Recorded (and checked against a set given while it connected) before
  // anyone else sees it; a destroy meanwhile cuts it: either the destroy's
  // forget() comes after this add(), or find() below sees it gone.
  RETURN_IF_ERROR(ports_.add(id, port, gen, fd.get()));
  if (find(id) != inst) {
    ports_.forget(id);
    return notFound("sandbox " + id + " not found");
  }
  return fd;
}

Status Edge::setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) {
  for (auto& p : ports) {
    if (p.port < 1 || p.port > 65535) {
      return invalidArg("ports", "port " + std::to_string(p.port) + " is not from 1 to 65535");
    }
  }
  if (!find(id)) return Status::ok();
  size_t cut = ports_.set(id, ports);
  if (cut > 0) log::info("sandbox " + id + ": cut " + std::to_string(cut) + " port connections");
  return Status::ok();
}

Result<std::string> Edge::screenshot(const std::string& id) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  return inst->screenshot();
}

Status Edge::input(const std::string& id, const InputAction& action) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  return inst->input(action);
}

Result<CgroupStats> Edge::stats(const std::string& id) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  return inst->stats();
}

Result<proto::StatsSeries> Edge::statsHistory(const std::string& id, double windowS) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  proto::StatsSeries out;
  out.intervalS = opts_.statsIntervalS;
  double now = nowSeconds();
  out.samples = history_.query(id, windowS, now);
  auto s = inst->stats();
  if (s.isOk()) {
    out.samples.push_back({now, s->cpuUsec, s->memoryBytes, s->pids});
  } else if (out.samples.empty()) {
    return s.status();
  }
  return out;
}

std::vector<std::string> Edge::sandboxIds() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> out;
  for (auto& [id, inst] : sandboxes_) {
    if (inst) out.push_back(id);
  }
  return out;
}

proto::NodeReport Edge::report() {
  proto::NodeReport r;
  r.loader = cache_->loaderName();
  r.blobStore = cache_->storeUri();
  r.loaderPids = cache_->loaderPids();
  r.cacheUsedBytes = cache_->usedBytes();
  r.cacheLimitBytes = cache_->limitBytes();
  for (auto& l : cache_->layers()) {
    proto::LayerReport lr;
    lr.digest = l.digest;
    lr.dataDigest = l.dataDigest;
    lr.dataSize = l.dataSize;
    lr.attached = l.attached;
    lr.chunksPrefetched = l.chunksPrefetched;
    lr.stats = {l.stats.chunks,       l.stats.chunksCached, l.stats.chunksFetched,
                l.stats.bytesFetched, l.stats.cacheHits,    l.stats.readRequests,
                l.stats.bytesRead};
    r.layers.push_back(std::move(lr));
  }
  r.userns.enabled = userns_.enabled;
  r.userns.reason = userns_.reason;
  if (userns_.enabled && container_) {
    r.userns.length = userns_.width;
    r.userns.windowFirst = userns_.windowFirst;
    r.userns.windowLast = userns_.windowLast;
    auto rs = container_->rangeStats();
    r.userns.capacity = rs.capacity;
    r.userns.inUse = rs.inUse;
    r.userns.sandboxes = rs.sandboxes;
    r.userns.spares = rs.spares;
  }
  r.microvm = microvm_;
  r.vm = vm_;
  r.egressUnavailable = egressWhy_;
  r.egressTag = egressTag();
  r.egressDenials = egressDenialCounts();
  r.syscallDenials = syscallDenialCounts();
  r.orphansRemoved = orphansRemoved();
  r.adopted = adoptedIds();
  return r;
}

void Edge::shutdown() {
  stopSampler();
  if (!reactor_) return;
  // Creates still in flight (placeholders) are stopped first: their groups'
  // processes are killed (a booting VM's QEMU with them), so the backend's
  // create fails and cleans up, or, done already, is undone by create().
  {
    std::unique_lock lk(mu_);
    stopping_ = true;
    auto inFlight = [&] {
      std::vector<std::string> ids;
      for (auto& [id, inst] : sandboxes_) {
        if (!inst) ids.push_back(id);
      }
      return ids;
    };
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (auto ids = inFlight(); !ids.empty(); ids = inFlight()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        log::error("shutdown: " + std::to_string(ids.size()) +
                   " creates still in flight after 60 s; leaving them");
        break;
      }
      log::info("shutdown: stopping " + std::to_string(ids.size()) + " creates in flight");
      lk.unlock();
      for (auto& id : ids) (void)cgroups_->remove(id);
      lk.lock();
      creatingCv_.wait_for(lk, std::chrono::seconds(1));
    }
  }
  // Live restore: running sandboxes stay, with their cgroups, directories
  // and state files, the disk quota's pool, the egress filter's programs and
  // path, and the loader process; the next edge re-adopts them.
  const bool keep = opts_.liveRestore && !sandboxIds().empty();
  if (keep) {
    log::info("live restore: leaving " + std::to_string(sandboxIds().size()) +
              " sandboxes running for the next edge");
  } else {
    for (auto& id : sandboxIds()) {
      if (Status st = destroy(id); !st.isOk()) log::error("shutdown: " + st.toString());
    }
  }
  for (auto& [name, b] : backends_) b->shutdown(keep);
  {
    std::lock_guard lk(egressMu_);
    if (egressNet_) {
      if (keep) {
        egressNet_->keepForNextEdge();
      } else {
        (void)egressNet_->stop();
      }
    }
    egressNet_.reset();
  }
  if (filter_ && keep) filter_->keepAttachedForNextEdge();
  filter_.reset();
  if (layers_) layers_->close();
  if (cache_ && keep) cache_->keepLoaderForNextEdge();
  cache_.reset();
  if (cgroups_ && !keep) cgroups_->removeParent();
  // After the disks and layers let go of their devices: the free ones are
  // removed, the attached ones (live restore) stay for the next edge.
  if (loops_) loops_->close();
  reactor_->stop();
  reactor_.reset();
}

}  // namespace dsec::edge
