#include "proto/edge_link.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/util.h"
#include "proto/codec.h"

namespace dsec::proto {

namespace {
Status notInteractive() {
  return Status(Code::kFailedPrecondition, "the exec is not interactive, or has ended", 0,
                "interactive");
}
}  // namespace

namespace {
constexpr size_t kMaxControlRecord = 1u << 20;

std::string record(char kind, std::string_view payload) {
  std::string r(1, kind);
  uint32_t n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) r.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  r.append(payload);
  return r;
}
}  // namespace

std::string execInputRecord(std::string_view bytes) { return record('i', bytes); }
std::string execResizeRecord(TermSize size) {
  return record('r', "{\"rows\":" + std::to_string(size.rows) +
                         ",\"cols\":" + std::to_string(size.cols) + "}");
}
std::string execSignalRecord(int sig) {
  return record('s', "{\"signal\":" + std::to_string(sig) + "}");
}

Status ExecControlDecoder::feed(std::string_view bytes, ExecCall& to) {
  buf_.append(bytes);
  size_t off = 0;
  while (buf_.size() - off >= 5) {
    const auto* u = reinterpret_cast<const unsigned char*>(buf_.data() + off + 1);
    uint32_t n = uint32_t(u[0]) | uint32_t(u[1]) << 8 | uint32_t(u[2]) << 16 | uint32_t(u[3]) << 24;
    if (n > kMaxControlRecord) return invalidArg("body", "exec control record too large");
    if (buf_.size() - off - 5 < n) break;
    char kind = buf_[off];
    std::string_view payload(buf_.data() + off + 5, n);
    off += 5 + n;
    Status st;
    if (kind == 'i') {
      st = to.sendInput(payload);
    } else if (kind == 'r' || kind == 's') {
      auto j = nlohmann::json::parse(payload, nullptr, false);
      if (!j.is_object()) return invalidArg("body", "exec control record is not a JSON object");
      if (kind == 'r') {
        auto size = termSizeFromJson(j, "pty");
        if (!size.isOk()) return size.status();
        st = to.resize(*size);
      } else {
        auto sig = j.find("signal");
        if (sig == j.end() || !sig->is_number_integer()) return invalidArg("signal", "bad signal");
        st = to.signal(sig->get<int>());
      }
    } else {
      return invalidArg("body", "unknown exec control record");
    }
    // An exec that ended meanwhile refuses: not the stream's fault.
    (void)st;
  }
  buf_.erase(0, off);
  return Status::ok();
}

Status ExecCall::sendInput(std::string_view) { return notInteractive(); }
Status ExecCall::resize(TermSize) { return notInteractive(); }
Status ExecCall::signal(int) { return notInteractive(); }

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

Result<UniqueFd> EdgeLink::openPort(const std::string&, int, uint64_t, double) {
  return Status(Code::kFailedPrecondition, "this node cannot open a sandbox's ports", 0, "backend");
}

Status EdgeLink::setPorts(const std::string&, const std::vector<PortGen>&) { return Status::ok(); }

Result<StatsSeries> EdgeLink::statsHistory(const std::string& id, double) {
  ASSIGN_OR_RETURN(CgroupStats now, stats(id));
  StatsSeries s;
  s.samples.push_back({nowSeconds(), now.cpuUsec, now.memoryBytes, now.pids});
  return s;
}

}  // namespace dsec::proto
