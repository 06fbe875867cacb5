#include "edge/sim_edge.h"

#include <chrono>
#include <thread>

namespace dsec::edge {

SimEdge::SimEdge(SimOptions opts) : opts_(opts) {
  userns_.reason = "simulated node";
  microvm_.reason = "simulated node";
  vm_.reason = "simulated node";
}

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

Status SimEdge::create(const std::string&, const SandboxSpec& spec) {
  delay();
  std::lock_guard lk(mu_);
  return addLocked(spec);
}

std::vector<Status> SimEdge::createMany(const std::string&, const std::vector<SandboxSpec>& specs) {
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

Result<ExecResult> SimEdge::exec(const std::string& id, const ExecSpec& spec,
                                 const OutputSink& sink) {
  RETURN_IF_ERROR(check(id));
  auto t0 = std::chrono::steady_clock::now();
  delay();
  ExecResult r;
  std::string out;
  if (!spec.argv.empty() && spec.argv[0] == "echo") {
    for (size_t i = 1; i < spec.argv.size(); ++i) out += (i > 1 ? " " : "") + spec.argv[i];
    out += "\n";
  }
  if (sink) {
    if (!out.empty()) RETURN_IF_ERROR(sink(false, out));
  } else {
    r.out = out;
  }
  r.durationMs =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return r;
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

Result<std::string> SimEdge::fileCall(const std::string& id, proto::FrameType, const std::string&) {
  RETURN_IF_ERROR(check(id));
  delay();
  return std::string("{}");
}

Result<CgroupStats> SimEdge::stats(const std::string& id) {
  RETURN_IF_ERROR(check(id));
  return CgroupStats{};
}

Status SimEdge::pause(const std::string& id, bool) { return check(id); }
Status SimEdge::setLimits(const std::string& id, const CgroupLimits&) { return check(id); }
Status SimEdge::setEgress(const std::string& id, const std::vector<net::EgressRule>&) {
  return check(id);
}
Result<net::EgressDenials> SimEdge::egressDenials(const std::string& id) {
  RETURN_IF_ERROR(check(id));
  return net::EgressDenials{};
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

}  // namespace dsec::edge
