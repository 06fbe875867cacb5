#include "platform/run_pool.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <future>

#include "common/log.h"
#include "common/runtime.h"
#include "common/util.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

RunPool::RunPool(proto::EdgeLink* edge, RunPoolOptions opts) : edge_(edge), opts_(opts) {
  janitor_ = std::thread([this] { janitor(); });
}

RunPool::~RunPool() { shutdown(); }

void RunPool::shutdown() {
  std::vector<std::string> doomed;
  {
    std::unique_lock lk(mu_);
    if (stopping_ && !janitor_.joinable()) return;
    stopping_ = true;
    for (auto& [key, pool] : pools_) {
      for (auto& s : pool.idle) doomed.push_back(s.id);
    }
    pools_.clear();
  }
  cv_.notify_all();
  workCv_.notify_all();
  if (janitor_.joinable()) janitor_.join();
  for (auto& id : doomed) destroy(id);
  // Busy ones are destroyed by their callers' release().
}

RunPoolStats RunPool::stats() const {
  std::lock_guard lk(mu_);
  RunPoolStats s = counters_;
  for (auto& [key, pool] : pools_) {
    s.idle += int(pool.idle.size());
    s.pools[key].idle = int(pool.idle.size());
  }
  for (auto& [id, key] : busyKeys_) ++s.pools[key].busy;
  s.busy = total_ - s.idle;
  s.maxSandboxes = opts_.maxSandboxes;
  return s;
}

void RunPool::writeMetrics(metrics::Writer& w) const {
  using metrics::Type;
  const RunPoolStats s = stats();
  w.gauge("dsec_fncall_pools", "fncall one-shot pools (one per image and language).",
          double(s.pools.size()));
  w.gauge("dsec_fncall_pool_max_sandboxes",
          "Bound on the node's fncall pool sandboxes, all pools together (--fncall-pool-max).",
          s.maxSandboxes);
  const char* help =
      "fncall pool sandboxes (warm workers) by pool and state: idle, or busy serving a call.";
  w.declare("dsec_fncall_pool_sandboxes", Type::kGauge, help);
  for (auto& [key, c] : s.pools) {
    w.gauge("dsec_fncall_pool_sandboxes", help, c.idle, {{"pool", key}, {"state", "idle"}});
    w.gauge("dsec_fncall_pool_sandboxes", help, c.busy, {{"pool", key}, {"state", "busy"}});
  }
  help = "fncall pool sandboxes of the node by state (busy includes ones being created).";
  w.gauge("dsec_fncall_node_sandboxes", help, s.idle, {{"state", "idle"}});
  w.gauge("dsec_fncall_node_sandboxes", help, s.busy, {{"state", "busy"}});
  w.counter("dsec_fncall_pool_sandboxes_created_total", "fncall pool sandboxes created.",
            double(s.created));
  w.counter("dsec_fncall_pool_sandboxes_grown_total",
            "fncall pool sandboxes created ahead of demand: a pool whose calls came back to back "
            "grew to two, so that each call finds a sandbox ready.",
            double(s.grown));
  w.counter("dsec_fncall_pool_sandboxes_destroyed_total",
            "fncall pool sandboxes destroyed (idle, recycled, retired, failed).",
            double(s.destroyed));
  w.counter("dsec_fncall_pool_sandboxes_replaced_total",
            "fncall pool sandboxes destroyed because a call failed on them.", double(s.replaced));
  w.counter("dsec_fncall_zygote_restarts_total",
            "One-shot calls that started a python zygote first (the previous one died, was "
            "killed, or was retired after zygote_max_calls).",
            double(s.zygoteRestarts));
  help =
      "One-shot calls by result (ok: exit 0, exit: another exit code, signal, error: no "
      "result) and the limit that stopped them (none, timeout, cpu, memory, file_size, "
      "output).";
  w.declare("dsec_fncall_calls_total", Type::kCounter, help);
  for (auto& [k, n] : s.results) {
    w.counter("dsec_fncall_calls_total", help, double(n),
              {{"result", k.first}, {"limit", k.second}});
  }
}

Result<RunPool::Slot> RunPool::make(const std::vector<std::string>& layers) {
  proto::SandboxSpec spec;
  spec.id = "sb-" + randomHex(8);
  spec.layers = layers;
  spec.cpu = opts_.cpu;
  spec.memoryBytes = opts_.memoryBytes;
  spec.diskBytes = opts_.scratchBytes;
  spec.pids = opts_.pids;
  RETURN_IF_ERROR(edge_->create(proto::BackendKind::kFncall, spec));
  {
    std::lock_guard lk(mu_);
    ++counters_.created;
  }
  return Slot{spec.id, now()};
}

int RunPool::sizeOf(const std::string& key) const {
  int n = 0;
  if (auto it = pools_.find(key); it != pools_.end()) n += int(it->second.idle.size());
  for (auto& [id, k] : busyKeys_) n += k == key;
  if (auto it = making_.find(key); it != making_.end()) n += it->second;
  return n;
}

void RunPool::grow(std::unique_lock<std::mutex>& lk, const std::string& key) {
  auto it = pools_.find(key);
  if (stopping_ || it == pools_.end() || sizeOf(key) >= opts_.alternate ||
      total_ >= opts_.maxSandboxes) {
    return;
  }
  std::vector<std::string> layers = it->second.layers;
  ++total_;
  ++making_[key];
  lk.unlock();
  auto slot = make(layers);
  lk.lock();
  if (--making_[key] == 0) making_.erase(key);
  if (!slot.isOk()) {
    --total_;
    log::warn("fncall pool: a second sandbox for back-to-back calls: " + slot.status().toString());
    return;
  }
  it = pools_.find(key);
  if (stopping_ || it == pools_.end() || it->second.layers != layers) {
    --total_;  // the node stops, or the image's tag moved meanwhile
    lk.unlock();
    destroy(slot->id);
    lk.lock();
    return;
  }
  ++counters_.grown;
  it->second.idle.push_back(*slot);  // made now: the most recently used
  cv_.notify_all();
}

void RunPool::destroy(const std::string& id) {
  Status st = edge_->destroy(id);
  if (!st.isOk()) log::warn("fncall pool: destroy " + id + ": " + st.toString());
  std::lock_guard lk(mu_);
  ++counters_.destroyed;
}

Result<RunPool::Slot> RunPool::acquire(const std::string& key,
                                       const std::vector<std::string>& layers) {
  std::vector<std::string> retired;
  std::string recycled;
  {
    std::unique_lock lk(mu_);
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(int64_t(opts_.waitSeconds * 1000));
    for (;;) {
      if (stopping_) return Status(Code::kUnavailable, "the node is shutting down");
      Pool& pool = pools_[key];
      if (pool.layers != layers) {
        // The image's tag moved: its old sandboxes go.
        for (auto& s : pool.idle) retired.push_back(s.id);
        total_ -= int(pool.idle.size());
        pool.idle.clear();
        pool.layers = layers;
      }
      if (!pool.idle.empty()) {
        // The most recently used sandbox that has settled (its clean-up
        // and next spare done), else the one idle longest, which is the
        // nearest to it; with none settled, the pool grows to `alternate`.
        double t = now();
        size_t pick = 0;
        bool settled = false;
        for (size_t i = pool.idle.size(); i-- > 0;) {
          if (t - pool.idle[i].lastUsed >= opts_.settleSeconds) {
            pick = i;
            settled = true;
            break;
          }
        }
        if (!settled && sizeOf(key) < opts_.alternate && total_ < opts_.maxSandboxes &&
            std::find(growQueue_.begin(), growQueue_.end(), key) == growQueue_.end()) {
          growQueue_.push_back(key);
          workCv_.notify_all();
        }
        Slot s = pool.idle[pick];
        pool.idle.erase(pool.idle.begin() + ptrdiff_t(pick));
        busyLayers_[s.id] = layers;
        busyKeys_[s.id] = key;
        lk.unlock();
        for (auto& id : retired) destroy(id);
        return s;
      }
      if (total_ < opts_.maxSandboxes) {
        ++total_;
        ++making_[key];
        break;
      }
      // At the bound: recycle the least recently used idle sandbox of
      // another pool, if there is one.
      Pool* victimPool = nullptr;
      for (auto& [k, p] : pools_) {
        if (k == key || p.idle.empty()) continue;
        if (!victimPool || p.idle.front().lastUsed < victimPool->idle.front().lastUsed) {
          victimPool = &p;
        }
      }
      if (victimPool) {
        recycled = victimPool->idle.front().id;
        victimPool->idle.erase(victimPool->idle.begin());
        ++making_[key];
        break;  // total_ unchanged: one goes, one comes
      }
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
        lk.unlock();
        for (auto& id : retired) destroy(id);
        return Status(Code::kResourceExhausted,
                      "all " + std::to_string(opts_.maxSandboxes) +
                          " fncall sandboxes of this node are busy; try again");
      }
    }
  }
  for (auto& id : retired) destroy(id);
  if (!recycled.empty()) destroy(recycled);
  auto slot = make(layers);
  std::lock_guard lk(mu_);
  if (--making_[key] == 0) making_.erase(key);
  if (!slot.isOk()) {
    --total_;
    cv_.notify_all();
    return slot.status();
  }
  busyLayers_[slot->id] = layers;
  busyKeys_[slot->id] = key;
  return slot;
}

void RunPool::release(const std::string& key, Slot slot, bool healthy) {
  bool keep;
  {
    std::lock_guard lk(mu_);
    auto layers = busyLayers_[slot.id];
    busyLayers_.erase(slot.id);
    busyKeys_.erase(slot.id);
    auto it = pools_.find(key);
    keep = healthy && !stopping_ && it != pools_.end() && it->second.layers == layers;
    if (keep) {
      slot.lastUsed = now();
      it->second.idle.push_back(slot);
    } else {
      --total_;
      if (!healthy) ++counters_.replaced;
    }
  }
  cv_.notify_all();  // (waiters are few: callers at the bound)
  if (!keep) destroy(slot.id);
}

void RunPool::runAsync(const std::string& key, const std::vector<std::string>& layers,
                       ExecSpec spec, std::function<void(Result<ExecResult>)> done) {
  json call = json::parse(spec.fncallJson.empty() ? "{}" : spec.fncallJson, nullptr, false);
  if (!call.is_object()) return done(invalidArg("fncall", "malformed call"));
  call["fresh_dir"] = true;
  call["exclusive"] = true;
  spec.fncallJson = call.dump();
  {
    std::lock_guard lk(mu_);
    ++counters_.calls;
  }
  attempt(key, layers, std::move(spec), std::move(done), 0);
}

void RunPool::attempt(const std::string& key, const std::vector<std::string>& layers,
                      ExecSpec spec, std::function<void(Result<ExecResult>)> done, int n) {
  auto slot = acquire(key, layers);
  if (!slot.isOk()) return done(slot.status());
  std::string id = slot->id;
  proto::ExecCallbacks cb;
  cb.onDone = [this, key, layers, spec, done, n, slot = *slot](Result<ExecResult> r) mutable {
    // Releasing may destroy the sandbox, and a retry acquires another: both
    // block, and this runs on the link's or the reactor's thread.
    auto finish = [this, key, layers, spec = std::move(spec), done = std::move(done), n,
                   slot = std::move(slot), r = std::move(r)]() mutable {
      // One retry, on another sandbox, when the one we got was gone before
      // the call started (died, or its agent could not take the call).
      bool healthy = r.isOk() || r.status().code() == Code::kInvalidArgument ||
                     r.status().code() == Code::kNotFound;
      bool retry = !r.isOk() && !healthy && n == 0 &&
                   (r.status().code() == Code::kFailedPrecondition ||
                    r.status().code() == Code::kUnavailable);
      release(key, std::move(slot), healthy);
      if (retry) {
        log::warn("fncall pool: replacing a sandbox after: " + r.status().toString());
        return attempt(key, layers, std::move(spec), std::move(done), n + 1);
      }
      {
        std::lock_guard lk(mu_);
        if (r.isOk()) {
          const char* result = r->signal != 0 ? "signal" : r->exitCode == 0 ? "ok" : "exit";
          ++counters_.results[{result, r->limit.empty() ? "none" : r->limit}];
          if (r->zygoteStarted) ++counters_.zygoteRestarts;
        } else {
          ++counters_.results[{"error", "none"}];
        }
      }
      done(std::move(r));
    };
    if (!Runtime::global().runBlocking(finish)) finish();
  };
  edge_->startExec(id, spec, std::move(cb));
}

Result<ExecResult> RunPool::run(const std::string& key, const std::vector<std::string>& layers,
                                ExecSpec spec) {
  std::promise<Result<ExecResult>> p;
  auto f = p.get_future();
  runAsync(key, layers, std::move(spec),
           [&p](Result<ExecResult> r) { p.set_value(std::move(r)); });
  return f.get();
}

void RunPool::janitor() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    workCv_.wait_for(lk, std::chrono::seconds(1),
                     [this] { return stopping_ || !growQueue_.empty(); });
    if (stopping_) break;
    while (!growQueue_.empty() && !stopping_) {
      std::string key = growQueue_.front();
      growQueue_.erase(growQueue_.begin());
      grow(lk, key);
    }
    if (stopping_) break;
    std::vector<std::string> doomed;
    double cutoff = now() - opts_.idleSeconds;
    for (auto it = pools_.begin(); it != pools_.end();) {
      auto& idle = it->second.idle;
      while (!idle.empty() && idle.front().lastUsed < cutoff) {
        doomed.push_back(idle.front().id);
        idle.erase(idle.begin());
        --total_;
      }
      ++it;
    }
    if (doomed.empty()) continue;
    lk.unlock();
    for (auto& id : doomed) destroy(id);
    cv_.notify_all();
    lk.lock();
  }
}

}  // namespace dsec::platform
