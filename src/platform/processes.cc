#include "platform/processes.h"

#include <signal.h>

#include <algorithm>
#include <chrono>

#include <nlohmann/json.hpp>

#include "common/util.h"

namespace dsec::platform {

using json = nlohmann::json;

ProcessSession::ProcessSession(std::string sandbox, proto::ExecSpec spec, std::string tag,
                               double now)
    : sandbox_(std::move(sandbox)), spec_(std::move(spec)), tag_(std::move(tag)), startedAt_(now) {}

void ProcessSession::setCall(std::shared_ptr<proto::ExecCall> call) {
  std::lock_guard lk(mu_);
  if (!result_) call_ = std::move(call);  // not one that already ended
}

void ProcessSession::started(int pid) {
  {
    std::lock_guard lk(mu_);
    pid_ = pid;
  }
  cv_.notify_all();
}

void ProcessSession::output(bool isErr, std::string_view data) {
  if (data.empty()) return;
  {
    std::lock_guard lk(mu_);
    // Appends to the last chunk of the same stream while it is small, so a
    // terminal's byte-at-a-time echo does not cost a chunk per byte.
    if (!kept_.empty() && kept_.back().isErr == isErr && kept_.back().data.size() < 4096) {
      kept_.back().data.append(data);
    } else {
      kept_.push_back(Chunk{end_, isErr, std::string(data)});
    }
    end_ += data.size();
    keptBytes_ += data.size();
    while (keptBytes_ > kProcessOutputKept && kept_.size() > 1) {
      keptBytes_ -= kept_.front().data.size();
      kept_.pop_front();
    }
    // One chunk larger than the window: keep its tail.
    if (keptBytes_ > kProcessOutputKept) {
      Chunk& c = kept_.front();
      size_t drop = keptBytes_ - kProcessOutputKept;
      c.data.erase(0, drop);
      c.offset += drop;
      keptBytes_ -= drop;
    }
  }
  notify();
}

void ProcessSession::done(Result<proto::ExecResult> r) {
  {
    std::lock_guard lk(mu_);
    if (r.isOk()) {
      r->out.clear();  // the output went through output()
      r->err.clear();
    }
    result_.emplace(std::move(r));
    endedAt_ = nowSeconds();
    call_.reset();
  }
  cv_.notify_all();
  notify();
}

Result<int> ProcessSession::awaitStart(double timeoutS) {
  std::unique_lock lk(mu_);
  bool ready = cv_.wait_for(lk, std::chrono::duration<double>(timeoutS),
                            [&] { return pid_ != 0 || result_.has_value(); });
  if (pid_ != 0) return pid_;
  if (!ready) return Status(Code::kDeadlineExceeded, "the process did not start in time");
  if (!result_->isOk()) return result_->status();
  return Status(Code::kFailedPrecondition,
                "the sandbox's node cannot run process sessions (it never told the pid)");
}

ProcessSession::Read ProcessSession::read(uint64_t from, size_t maxBytes) const {
  std::lock_guard lk(mu_);
  Read r;
  uint64_t first = kept_.empty() ? end_ : kept_.front().offset;
  if (from < first) {
    r.gap = first;
    from = first;
  }
  from = std::min(from, end_);
  size_t taken = 0;
  for (const Chunk& c : kept_) {
    uint64_t cend = c.offset + c.data.size();
    if (cend <= from) continue;
    if (taken >= maxBytes) break;
    size_t skip = from > c.offset ? static_cast<size_t>(from - c.offset) : 0;
    size_t n = std::min(c.data.size() - skip, maxBytes - taken);
    r.chunks.push_back(Chunk{c.offset + skip, c.isErr, c.data.substr(skip, n)});
    taken += n;
    from = c.offset + skip + n;
  }
  r.next = from;
  if (result_ && from == end_) {
    r.ended = true;
    r.result = *result_;
  }
  return r;
}

uint64_t ProcessSession::watch(std::function<bool()> fn) {
  uint64_t h;
  {
    std::lock_guard lk(mu_);
    h = nextWatcher_++;
    watchers_[h] = fn;
  }
  // What is there already.
  if (!fn()) unwatch(h);
  return h;
}

void ProcessSession::unwatch(uint64_t handle) {
  std::lock_guard lk(mu_);
  watchers_.erase(handle);
}

void ProcessSession::notify() {
  std::vector<std::pair<uint64_t, std::function<bool()>>> ws;
  {
    std::lock_guard lk(mu_);
    ws.assign(watchers_.begin(), watchers_.end());
  }
  for (auto& [h, fn] : ws) {
    if (!fn()) unwatch(h);
  }
}

namespace {
Status ended() {
  return Status(Code::kFailedPrecondition, "the process has ended", 0, "pid");
}
}  // namespace

Status ProcessSession::sendInput(std::string_view bytes) {
  std::shared_ptr<proto::ExecCall> c;
  {
    std::lock_guard lk(mu_);
    c = call_;
  }
  if (!c) return ended();
  return c->sendInput(bytes);
}

Status ProcessSession::resize(proto::TermSize size) {
  std::shared_ptr<proto::ExecCall> c;
  {
    std::lock_guard lk(mu_);
    if (!spec_.pty) return invalidArg("pty", "the process has no terminal");
    c = call_;
  }
  if (!c) return ended();
  return c->resize(size);
}

Status ProcessSession::signal(int sig) {
  std::shared_ptr<proto::ExecCall> c;
  {
    std::lock_guard lk(mu_);
    c = call_;
  }
  if (!c) return ended();
  return c->signal(sig);
}

void ProcessSession::kill() {
  std::shared_ptr<proto::ExecCall> c;
  {
    std::lock_guard lk(mu_);
    c = call_;
  }
  // A SIGKILL ends it with its exit (signal 9) as any death would; cancel
  // (which ends the call with an error) only where a signal cannot go.
  if (c && !c->signal(SIGKILL).isOk()) c->cancel();
}

uint64_t ProcessSession::outputEnd() const {
  std::lock_guard lk(mu_);
  return end_;
}

int ProcessSession::pid() const {
  std::lock_guard lk(mu_);
  return pid_;
}

bool ProcessSession::running() const {
  std::lock_guard lk(mu_);
  return !result_.has_value();
}

std::string ProcessSession::infoJson() const {
  std::lock_guard lk(mu_);
  json j = {{"pid", pid_},
            {"cmd", spec_.argv},
            {"cwd", spec_.cwd},
            {"user", spec_.user.empty() ? "root" : spec_.user},
            {"tag", tag_},
            {"pty", spec_.pty ? json{{"rows", spec_.pty->rows}, {"cols", spec_.pty->cols}}
                              : json(nullptr)},
            {"stdin", spec_.interactive || spec_.pty.has_value()},
            {"started_at", startedAt_},
            {"running", !result_.has_value()},
            {"output_start", kept_.empty() ? end_ : kept_.front().offset},
            {"output_end", end_}};
  if (result_) {
    j["ended_at"] = endedAt_;
    if (result_->isOk()) {
      const proto::ExecResult& r = **result_;
      j["exit_code"] = r.exitCode;
      j["signal"] = r.signal;
      j["timed_out"] = r.timedOut;
      j["oom_killed"] = r.oomKilled;
      j["duration_ms"] = r.durationMs;
    } else {
      j["error"] = {{"code", codeName(result_->status().code())},
                    {"message", result_->status().message()}};
    }
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Status ProcessTable::checkRoom(const std::string& sandbox) const {
  std::lock_guard lk(mu_);
  auto it = bySandbox_.find(sandbox);
  if (it == bySandbox_.end()) return Status::ok();
  size_t running = 0;
  for (auto& s : it->second) running += s->running() ? 1 : 0;
  if (running >= kMaxProcessesPerSandbox) {
    return Status(Code::kResourceExhausted,
                  "the sandbox already has " + std::to_string(running) +
                      " running processes (the limit); kill one first",
                  0, "processes");
  }
  return Status::ok();
}

void ProcessTable::add(std::shared_ptr<ProcessSession> s) {
  std::lock_guard lk(mu_);
  auto& v = bySandbox_[s->sandbox()];
  int pid = s->pid();
  v.erase(std::remove_if(v.begin(), v.end(), [&](auto& o) { return o->pid() == pid; }), v.end());
  v.push_back(std::move(s));
  for (auto it = v.begin(); v.size() > kMaxProcessesPerSandbox && it != v.end();) {
    if ((*it)->running()) {
      ++it;
    } else {
      it = v.erase(it);
    }
  }
}

std::shared_ptr<ProcessSession> ProcessTable::find(const std::string& sandbox, int pid) const {
  std::lock_guard lk(mu_);
  auto it = bySandbox_.find(sandbox);
  if (it == bySandbox_.end()) return nullptr;
  for (auto& s : it->second) {
    if (s->pid() == pid) return s;
  }
  return nullptr;
}

std::vector<std::shared_ptr<ProcessSession>> ProcessTable::list(const std::string& sandbox) const {
  std::lock_guard lk(mu_);
  auto it = bySandbox_.find(sandbox);
  if (it == bySandbox_.end()) return {};
  return it->second;
}

void ProcessTable::dropSandbox(const std::string& sandbox) {
  std::vector<std::shared_ptr<ProcessSession>> gone;
  {
    std::lock_guard lk(mu_);
    auto it = bySandbox_.find(sandbox);
    if (it == bySandbox_.end()) return;
    gone = std::move(it->second);
    bySandbox_.erase(it);
  }
  for (auto& s : gone) s->kill();
}

size_t ProcessTable::runningTotal() const {
  std::lock_guard lk(mu_);
  size_t n = 0;
  for (auto& [sb, v] : bySandbox_) {
    for (auto& s : v) n += s->running() ? 1 : 0;
  }
  return n;
}

}  // namespace dsec::platform
