#include "proto/sim_edge.h"

#include <chrono>
#include <cstdlib>
#include <thread>

#include "common/runtime.h"
#include "common/util.h"

namespace dsec::proto {

SimEdge::SimEdge(SimOptions opts) : opts_(opts) {}

void SimEdge::delay() const {
  if (opts_.latencyMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(opts_.latencyMs));
}

Status SimEdge::check(const std::string& id) const {
  std::lock_guard lk(mu_);
  if (!sandboxes_.count(id)) {
    return Status(Code::kFailedPrecondition, "sandbox " + id + " is not running on this node");
  }
  return Status::ok();
}

Status SimEdge::create(BackendKind, const SandboxSpec& spec) {
  delay();
  std::lock_guard lk(mu_);
  return addLocked(spec);
}

std::vector<Status> SimEdge::createMany(BackendKind, const std::vector<SandboxSpec>& specs) {
  delay();
  std::vector<Status> out;
  out.reserve(specs.size());
  std::lock_guard lk(mu_);
  for (auto& s : specs) out.push_back(addLocked(s));
  return out;
}

Status SimEdge::addLocked(const SandboxSpec& spec) {
  if (sandboxes_.count(spec.id))
    return Status(Code::kAlreadyExists, "sandbox " + spec.id + " exists");
  if (int64_t(sandboxes_.size()) >= opts_.capacity) {
    return Status(Code::kResourceExhausted,
                  "simulated node full (" + std::to_string(opts_.capacity) + " sandboxes)");
  }
  sandboxes_[spec.id];
  return Status::ok();
}

Status SimEdge::destroy(const std::string& id) {
  delay();
  std::lock_guard lk(mu_);
  sandboxes_.erase(id);
  return Status::ok();
}

std::vector<Status> SimEdge::destroyMany(const std::vector<std::string>& ids) {
  delay();
  std::lock_guard lk(mu_);
  for (auto& id : ids) sandboxes_.erase(id);
  return std::vector<Status>(ids.size());
}

namespace {

// The seconds a `sleep N` exec asks for (argv ["sleep", N] or a shell's
// "sleep N"), or 0.
double sleepSeconds(const std::vector<std::string>& argv) {
  std::string n;
  if (argv.size() == 2 && (argv[0] == "sleep" || argv[0] == "/bin/sleep")) {
    n = argv[1];
  } else if (argv.size() == 3 && argv[1] == "-c" && startsWith(argv[2], "sleep ")) {
    n = argv[2].substr(6);
  }
  char* end = nullptr;
  double s = n.empty() ? 0 : std::strtod(n.c_str(), &end);
  return end && *end == '\0' && s > 0 && s < 86400 ? s : 0;
}

class SimExec : public ExecCall, public std::enable_shared_from_this<SimExec> {
 public:
  SimExec(ExecCallbacks cb, std::shared_ptr<std::atomic<int64_t>> inflight)
      : cb_(std::move(cb)), inflight_(std::move(inflight)) {
    ++*inflight_;
  }

  void start(double seconds, ExecResult r) {
    result_ = std::move(r);
    t0_ = std::chrono::steady_clock::now();
    std::weak_ptr<SimExec> weak = shared_from_this();
    self_ = shared_from_this();  // until it ends
    auto t = Runtime::global().after(seconds, [weak] {
      if (auto self = weak.lock()) self->finish(false);
    });
    std::lock_guard lk(mu_);
    if (done_) {
      t->cancel();
    } else {
      timer_ = std::move(t);
    }
  }

  void cancel() override { finish(true); }

 private:
  void finish(bool cancelled) {
    std::shared_ptr<SimExec> keep = shared_from_this();
    std::shared_ptr<Runtime::Timer> t;
    {
      std::lock_guard lk(mu_);
      if (done_) return;
      done_ = true;
      t = std::move(timer_);
      self_.reset();
    }
    --*inflight_;
    if (t) t->cancel();
    if (cancelled) {
      cb_.onDone(Status(Code::kUnavailable, "exec cancelled: client went away"));
    } else {
      result_.durationMs =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_)
              .count();
      if (cb_.onOutput && !result_.out.empty()) {
        cb_.onOutput(false, result_.out);
        result_.out.clear();
      }
      cb_.onDone(std::move(result_));
    }
    cb_ = {};
  }

  ExecCallbacks cb_;
  std::shared_ptr<std::atomic<int64_t>> inflight_;
  ExecResult result_;
  std::chrono::steady_clock::time_point t0_;
  std::mutex mu_;  // guards done_, timer_, self_
  bool done_ = false;
  std::shared_ptr<Runtime::Timer> timer_;
  std::shared_ptr<SimExec> self_;
};

class EndedExec : public ExecCall {
 public:
  void cancel() override {}
};

}  // namespace

std::shared_ptr<ExecCall> SimEdge::startExec(const std::string& id, const ExecSpec& spec,
                                                    ExecCallbacks cb) {
  if (Status st = check(id); !st.isOk()) {
    cb.onDone(st);
    return std::make_shared<EndedExec>();
  }
  ExecResult r;
  if (!spec.argv.empty() && spec.argv[0] == "echo") {
    for (size_t i = 1; i < spec.argv.size(); ++i) r.out += (i > 1 ? " " : "") + spec.argv[i];
    r.out += "\n";
  }
  auto call = std::make_shared<SimExec>(std::move(cb), inflight_);
  call->start(opts_.latencyMs / 1000.0 + sleepSeconds(spec.argv), std::move(r));
  return call;
}

Result<uint64_t> SimEdge::writeFile(const std::string& id, const std::string& path, int,
                                    const ByteSource& src) {
  RETURN_IF_ERROR(check(id));
  delay();
  std::string data;
  char buf[65536];
  for (;;) {
    ASSIGN_OR_RETURN(size_t n, src(buf, sizeof buf));
    if (n == 0) break;
    data.append(buf, n);
  }
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end())
    return Status(Code::kFailedPrecondition, "sandbox " + id + " is gone");
  uint64_t n = data.size();
  it->second[path] = std::move(data);
  return n;
}

Status SimEdge::readFile(const std::string& id, const std::string& path,
                         const std::function<Status(std::optional<uint64_t>)>& onSize,
                         const ByteSink& sink) {
  delay();
  std::string data;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) {
      return Status(Code::kFailedPrecondition, "sandbox " + id + " is not running on this node");
    }
    auto f = it->second.find(path);
    if (f == it->second.end()) return notFound("no such file: " + path);
    data = f->second;
  }
  RETURN_IF_ERROR(onSize(uint64_t(data.size())));
  if (!data.empty()) RETURN_IF_ERROR(sink(data));
  return Status::ok();
}

Result<std::string> SimEdge::agentOp(const std::string& id, AgentOp, const std::string&) {
  RETURN_IF_ERROR(check(id));
  delay();
  return std::string("{}");
}

Result<CgroupStats> SimEdge::stats(const std::string& id) {
  RETURN_IF_ERROR(check(id));
  return CgroupStats{};
}

Status SimEdge::pause(const std::string& id, bool) { return check(id); }
Status SimEdge::hibernate(const std::string& id) {
  return Status(Code::kFailedPrecondition,
                "pausing " + id + " to disk: simulated node (backends microvm and vm only)", 0,
                "memory");
}
Status SimEdge::setLimits(const std::string& id, const CgroupLimits&) { return check(id); }
Status SimEdge::setEgress(const std::string& id, const std::vector<EgressRule>&) {
  return check(id);
}
Result<EgressDenials> SimEdge::egressDenials(const std::string& id) {
  RETURN_IF_ERROR(check(id));
  return EgressDenials{};
}
Result<image::BuiltLayer> SimEdge::packDiff(const std::string& id, const std::string&) {
  return Status(Code::kFailedPrecondition, "pack_diff of " + id + ": simulated node");
}

std::vector<std::string> SimEdge::sandboxIds() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> ids;
  for (auto& [id, _] : sandboxes_) ids.push_back(id);
  return ids;
}

Result<std::string> SimEdge::screenshot(const std::string& id) {
  return Status(Code::kFailedPrecondition, "sandbox " + id + " has no display (simulated node)");
}

Status SimEdge::input(const std::string& id, const InputAction&) {
  return Status(Code::kFailedPrecondition, "sandbox " + id + " has no display (simulated node)");
}

}  // namespace dsec::proto
