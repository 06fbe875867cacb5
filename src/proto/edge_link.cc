#include "proto/edge_link.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

namespace dsec::proto {

std::vector<Status> EdgeLink::createMany(BackendKind backend,
                                         const std::vector<SandboxSpec>& specs) {
  // The node's in-flight bound (platform/cluster.h, maxInflightPerNode)
  // bounds how many specs one call carries, and so these threads.
  std::vector<Status> out(specs.size());
  std::vector<std::thread> threads;
  for (size_t i = 1; i < specs.size(); ++i) {
    threads.emplace_back([&, i] { out[i] = create(backend, specs[i]); });
  }
  if (!specs.empty()) out[0] = create(backend, specs[0]);
  for (auto& t : threads) t.join();
  return out;
}

std::vector<Status> EdgeLink::destroyMany(const std::vector<std::string>& ids) {
  std::vector<Status> out(ids.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < ids.size();) out[i] = destroy(ids[i]);
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min<size_t>(16, ids.size()); ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return out;
}

Result<ExecResult> EdgeLink::exec(const std::string& id, const ExecSpec& spec,
                                  const OutputSink& sink) {
  // The callbacks run on the link's threads, which must not block; the sink
  // may (it writes to an HTTP client), so output is queued there and handed
  // to the sink here, on the caller's thread, in order.
  struct Wait {
    std::mutex mu;  // guards everything below
    std::condition_variable cv;
    std::deque<std::pair<bool, std::string>> output;
    std::optional<Result<ExecResult>> result;
  };
  auto w = std::make_shared<Wait>();
  ExecCallbacks cb;
  if (sink) {
    cb.onOutput = [w](bool isErr, std::string_view data) {
      std::lock_guard lk(w->mu);
      w->output.emplace_back(isErr, std::string(data));
      w->cv.notify_all();
    };
  }
  cb.onDone = [w](Result<ExecResult> r) {
    std::lock_guard lk(w->mu);
    w->result.emplace(std::move(r));
    w->cv.notify_all();
  };
  auto call = startExec(id, spec, std::move(cb));
  Status sinkError;
  std::unique_lock lk(w->mu);
  for (;;) {
    w->cv.wait(lk, [&] { return w->result.has_value() || !w->output.empty(); });
    while (!w->output.empty()) {
      auto [isErr, data] = std::move(w->output.front());
      w->output.pop_front();
      if (!sinkError.isOk()) continue;  // cancelled: the rest is dropped
      lk.unlock();
      sinkError = sink(isErr, data);
      if (!sinkError.isOk()) call->cancel();
      lk.lock();
    }
    if (w->result) break;
  }
  if (!sinkError.isOk()) return sinkError;
  return std::move(*w->result);
}

}  // namespace dsec::proto
