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
  SandboxRecord r;
  bool wasPaused = false;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return;
    auto& cur = it->second;
    if (lost) {
      if (cur.state != "running" && cur.state != "paused") return;
      cur.state = "lost";
      cur.error = why;
    } else {
      if (cur.state != "lost") return;
      // Found again: it ran on while its node was cut off. A paused one is
      // thawed below, so "running" is true.
      cur.state = "running";
      cur.error.clear();
      wasPaused = true;
      lastCall_[id] = nowSeconds();
    }
    cur.updatedAt = nowSeconds();
    r = cur;
  }
  if (wasPaused) (void)edge_->pause(id, false);
  if (Status st = store_->putSandbox(r); !st.isOk()) {
    log::error("recording sandbox " + id + " as " + r.state + ": " + st.toString());
  }
  stateCv_.notify_all();
  log::warn("sandbox " + id + " is " + r.state + (why.empty() ? "" : ": " + why));
}

bool Platform::bindRemote(const SandboxRecord& r) {
  bool keep = r.state == "running" || r.state == "paused" || r.state == "lost";
  if (!keep || !edge_->isRemoteNode(r.node)) return false;
  edge::SandboxSpec spec;
  spec.id = r.id;
  spec.cpu = r.cpu;
  spec.memoryBytes = r.memoryMb << 20;
  spec.pool = r.pool;
  edge_->bindSandbox(r.id, r.node, spec);
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

std::string Platform::sandboxStateMetrics() {
  std::map<std::string, int64_t> byState;
  for (const char* s : {"creating", "running", "paused", "lost", "stopping", "stopped", "failed"}) {
    byState[s] = 0;
  }
  {
    std::lock_guard lk(mu_);
    for (auto& [_, r] : sandboxes_) byState[r.state]++;
  }
  std::string out =
      "# HELP dsec_sandboxes Sandboxes this platform holds records of, by state.\n"
      "# TYPE dsec_sandboxes gauge\n";
  for (auto& [s, n] : byState) {
    out += "dsec_sandboxes{state=\"" + s + "\"} " + std::to_string(n) + "\n";
  }
  return out;
}

}  // namespace dsec::platform
