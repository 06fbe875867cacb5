#include "edge/edge.h"

#include <sys/mount.h>
#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "edge/backends/container/container_backend.h"

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
  UsernsOptions uo{e->opts_.userns, e->opts_.usernsBase, e->opts_.usernsLength};
  ASSIGN_OR_RETURN(e->userns_, detectUserns(uo));
  log::info("edge: user namespaces " + e->userns_.reason);
  e->layers_ = std::make_unique<LayerCache>(e->opts_.dataDir + "/layers", e->cache_.get());
  if (e->userns_.enabled) e->layers_->setIdmap(e->userns_.fd.get());
  RETURN_IF_ERROR(e->layers_->cleanupStale());
  e->reactor_ = std::make_unique<Reactor>();
  RETURN_IF_ERROR(e->reactor_->start());
  ContainerOptions co;
  co.aetherPath = e->opts_.aetherPath;
  co.sandboxRoot = e->opts_.dataDir + "/sandboxes";
  co.diskQuota = e->opts_.diskQuota;
  co.diskPoolBytes = e->opts_.diskPoolBytes;
  co.userns = &e->userns_;
  ASSIGN_OR_RETURN(auto container, ContainerBackend::make(co, e->cgroups_.get(),
                                                          e->layers_.get(), e->reactor_.get()));
  e->diskQuotaInfo_ = container->diskQuotaInfo();
  if (int orphans = container->cleanupOrphans(); orphans > 0) {
    log::warn("removed leftovers of " + std::to_string(orphans) + " orphan sandboxes");
  }
  e->backends_["container"] = std::move(container);
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
  log::info("edge: " + e->describe());
  return e;
}

Edge::~Edge() { shutdown(); }

std::string Edge::describe() const {
  return "cgroups " + cgroups_->describe() + " under " + opts_.cgroupParent +
         ", layers mounted by " + layers_->mountMethod() + ", disk quota by " + diskQuotaInfo_ +
         ", blobs from " + cache_->storeUri() + " by the " + cache_->loaderName() + " loader" +
         ", egress " +
         (filter_ ? "by policy (eBPF filter at " + cgroups_->v2Parent() + ")"
                  : "unavailable: " + egressWhy_) +
         ", user namespaces " + userns_.reason + ", backends: container";
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

Status Edge::create(const std::string& backend, const SandboxSpec& spec) {
  auto bit = backends_.find(backend);
  if (bit == backends_.end()) {
    return invalidArg("backend", "backend '" + backend + "' is not available on this node");
  }
  {
    // A placeholder from here on, so a death during the backend's create is
    // not mistaken for a deliberate destroy.
    std::lock_guard lk(mu_);
    if (sandboxes_.count(spec.id)) return Status(Code::kAlreadyExists, spec.id + " exists");
    sandboxes_[spec.id] = nullptr;
  }
  auto onDeath = [this, id = spec.id] {
    std::function<void(const std::string&, const std::string&)> h;
    {
      std::lock_guard lk(mu_);
      if (!sandboxes_.count(id)) return;  // being destroyed on purpose
      h = onDeath_;
    }
    log::warn("sandbox " + id + ": agent exited unexpectedly");
    if (h) h(id, "sandbox agent (PID 1) exited unexpectedly");
  };
  auto inst = bit->second->create(spec, onDeath);
  std::lock_guard lk(mu_);
  if (!inst.isOk()) {
    sandboxes_.erase(spec.id);
    return inst.status();
  }
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
      (void)b->destroy(*doomed);
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
  }
  // A frozen task takes its SIGKILL only once thawed (cgroup v1 freezer).
  if (wasPaused) (void)inst->freeze(false);
  Status st = backend->destroy(*inst);
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

Status Edge::setEgress(const std::string& id, const std::vector<net::EgressRule>& rules) {
  std::shared_ptr<Instance> inst;
  uint64_t cg = 0;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || !it->second) return notFound("sandbox " + id + " not found");
    inst = it->second;
    if (auto c = egressCg_.find(id); c != egressCg_.end()) cg = c->second;
  }
  if (!filter_ || cg == 0) {
    if (rules.empty()) return Status::ok();  // closed already: nothing to cut
    return Status(Code::kFailedPrecondition,
                  "this node cannot give sandboxes egress: " + egressWhy_, 0, "egress");
  }
  // Cutting needs only the filter; granting first gives the sandbox a path out.
  if (!rules.empty()) {
    std::lock_guard lk(egressMu_);
    if (!egressNet_) {
      EgressNetConfig c;
      c.subnet = opts_.egressSubnet;
      c.enableNat = opts_.egressNat;
      c.tag = egressTag();
      ASSIGN_OR_RETURN(egressNet_, EgressNet::start(c));
      auto live = sandboxIds();
      if (int n = egressNet_->cleanupOrphans({live.begin(), live.end()}); n > 0) {
        log::warn("egress: removed " + std::to_string(n) + " orphan veth links");
      }
    }
    if (!veths_.count(id)) {
      ASSIGN_OR_RETURN(UniqueFd ns, inst->openNetns());
      auto att = egressNet_->attach(id, ns.get());
      if (!att.isOk()) return Status(att.status()).withContext("egress for " + id);
      veths_.insert(id);
    }
  }
  return filter_->setRules(cg, rules);
}

Status Edge::pause(const std::string& id, bool paused) {
  auto inst = find(id);
  if (!inst) return notFound("sandbox " + id + " not found");
  RETURN_IF_ERROR(inst->freeze(paused));
  std::lock_guard lk(mu_);
  if (paused) {
    paused_.insert(id);
  } else {
    paused_.erase(id);
  }
  return Status::ok();
}

Status Edge::setLimits(const std::string& id, const CgroupLimits& limits) {
  auto inst = find(id);
  if (!inst) return notFound("sandbox " + id + " not found");
  return inst->setLimits(limits);
}

std::string Edge::egressTag() const { return "e" + sha256Hex(opts_.cgroupParent).substr(0, 12); }

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

Result<ExecResult> Edge::exec(const std::string& id, const ExecSpec& spec,
                              const OutputSink& sink) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  auto conn = inst->agent();
  auto before = inst->oomKills();
  json req = {{"argv", spec.argv},
              {"env", spec.env},
              {"timeout_ms", spec.timeoutMs},
              {"max_output", spec.maxOutput},
              {"stdin", spec.stdinData.has_value()}};
  if (!spec.cwd.empty()) req["cwd"] = spec.cwd;
  if (!spec.user.empty()) req["user"] = spec.user;
  auto stream = conn->openStream();
  StreamGuard guard{*conn, stream->id()};
  RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kExec, req.dump()));
  if (spec.stdinData) {
    std::string_view in = *spec.stdinData;
    for (size_t off = 0; off < in.size(); off += proto::kDataChunk) {
      RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kStdin,
                                 in.substr(off, proto::kDataChunk)));
    }
    RETURN_IF_ERROR(conn->send(stream->id(), proto::FrameType::kStdin, ""));
  }
  // The agent enforces the timeout; ours only guards against a wedged agent.
  double deadline = spec.timeoutMs > 0 ? monoSeconds() + double(spec.timeoutMs) / 1000 + 30 : 1e18;
  ExecResult res;
  bool cancelled = false;
  for (;;) {
    ASSIGN_OR_RETURN(proto::Frame f, stream->next(deadline));
    switch (f.type) {
      case proto::FrameType::kStdout:
      case proto::FrameType::kStderr: {
        bool isErr = f.type == proto::FrameType::kStderr;
        if (cancelled) break;
        if (sink) {
          if (Status st = sink(isErr, f.payload); !st.isOk()) {
            // The caller is gone: kill the command rather than run it unseen.
            (void)conn->send(stream->id(), proto::FrameType::kCancel, "");
            cancelled = true;
            deadline = monoSeconds() + 5;
          }
        } else {
          (isErr ? res.err : res.out).append(f.payload);
        }
        break;
      }
      case proto::FrameType::kExit: {
        json j = json::parse(f.payload, nullptr, false);
        if (j.is_discarded()) return internalError("agent sent a malformed exit report");
        // A compromised agent must not take the edge down: json's typed
        // getters throw on a wrong type.
        try {
          res.exitCode = j.value("exit_code", -1);
          res.signal = j.value("signal", 0);
          res.timedOut = j.value("timed_out", false);
          res.truncated = j.value("truncated", false);
          res.durationMs = double(j.value("duration_us", int64_t(0))) / 1000.0;
        } catch (const json::exception&) {
          return internalError("agent sent a malformed exit report");
        }
        auto after = inst->oomKills();
        if (before.isOk() && after.isOk()) res.oomKilled = *after > *before;
        if (cancelled) return Status(Code::kUnavailable, "exec cancelled: client went away");
        return res;
      }
      case proto::FrameType::kResult:
        RETURN_IF_ERROR(resultStatus(f.payload));
        break;
      default:
        break;
    }
  }
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

Result<std::string> Edge::fileCall(const std::string& id, proto::FrameType type,
                                   const std::string& body) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  return agentCall(*inst->agent(), type, body, kAgentCallTimeoutS);
}

Result<image::BuiltLayer> Edge::packDiff(const std::string& id, const std::string& workDir) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  std::string upper = inst->upperDir();
  if (upper.empty()) return Status(Code::kFailedPrecondition, "this backend cannot pack_diff");
  // In a user namespace the upper dir holds host ids (root inside = base);
  // the layer is built from a read-only view that maps them back to 0-based
  // ones, so snapshots stay portable between nodes and modes. The overlay's
  // own whiteouts belong to host 0 and show as the overflow id there: only
  // their 0:0 device number makes them whiteouts.
  std::string view;
  if (userns_.enabled) {
    RETURN_IF_ERROR(makeDirs(workDir, 0700));
    view = workDir + "/upper-view";
    if (::mkdir(view.c_str(), 0700) != 0 && errno != EEXIST) return sysError("mkdir " + view);
    auto m = idmappedClone(upper, userns_.inverseFd.get(), true);
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

Result<CgroupStats> Edge::stats(const std::string& id) {
  auto inst = find(id);
  if (!inst) return notRunning(id);
  return inst->stats();
}

std::vector<std::string> Edge::sandboxIds() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> out;
  for (auto& [id, inst] : sandboxes_) {
    if (inst) out.push_back(id);
  }
  return out;
}

void Edge::shutdown() {
  if (!reactor_) return;
  for (auto& id : sandboxIds()) {
    if (Status st = destroy(id); !st.isOk()) log::error("shutdown: " + st.toString());
  }
  for (auto& [name, b] : backends_) b->shutdown();
  {
    std::lock_guard lk(egressMu_);
    if (egressNet_) (void)egressNet_->stop();
    egressNet_.reset();
  }
  filter_.reset();
  if (layers_) layers_->close();
  cache_.reset();
  if (cgroups_) cgroups_->removeParent();
  reactor_->stop();
  reactor_.reset();
}

}  // namespace dsec::edge
