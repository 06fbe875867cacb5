#include "edge/corpse_cleaner.h"

#include <algorithm>

#include "common/util.h"
#include "edge/agent_conn.h"

namespace dsec::edge {

CorpseCleaner::CorpseCleaner(std::function<void(const std::string& id)> cleanup, int workers)
    : cleanup_(std::move(cleanup)), maxWorkers_(std::max(1, workers)) {}

CorpseCleaner::~CorpseCleaner() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CorpseCleaner::add(std::string id, UniqueFd pidfd) {
  {
    std::lock_guard lk(mu_);
    queue_.emplace_back(std::move(id), std::move(pidfd));
    // A worker more while every one is busy (up to the bound): a backend
    // that never destroys anything holds no thread for it.
    if (idle_ + starting_ < int(queue_.size()) && int(threads_.size()) < maxWorkers_) {
      ++starting_;
      threads_.emplace_back([this] { loop(); });
    }
  }
  cv_.notify_all();
}

void CorpseCleaner::drain() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return queue_.empty() && busy_ == 0; });
}

size_t CorpseCleaner::backlog() {
  std::lock_guard lk(mu_);
  return queue_.size() + size_t(busy_);
}

void CorpseCleaner::loop() {
  std::unique_lock lk(mu_);
  --starting_;
  for (;;) {
    ++idle_;
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping and drained
    auto [id, pidfd] = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lk.unlock();
    // A PID 1 is reaped only after every process of its namespace is gone.
    killAndWait(pidfd.get());
    pidfd.reset();
    cleanup_(id);
    lk.lock();
    --busy_;
    cv_.notify_all();
  }
}

CgroupReaper::CgroupReaper(std::function<void(const std::string&)> remove,
                           std::function<size_t()> backlog, size_t batchAbove, double maxDelayS)
    : remove_(std::move(remove)),
      backlog_(std::move(backlog)),
      batchAbove_(batchAbove),
      maxDelayS_(maxDelayS),
      thread_([this] { loop(); }) {}

CgroupReaper::~CgroupReaper() {
  drain();
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CgroupReaper::add(std::string id) {
  {
    std::lock_guard lk(mu_);
    queue_.emplace_back(std::move(id), monoSeconds());
  }
  cv_.notify_all();
}

size_t CgroupReaper::pending() {
  std::lock_guard lk(mu_);
  return queue_.size() + size_t(busy_);
}

void CgroupReaper::drain() {
  std::unique_lock lk(mu_);
  ++draining_;
  cv_.notify_all();
  cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  --draining_;
}

void CgroupReaper::loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    // A mass destroy: wait (polling the cleaner) until it has caught up.
    if (!draining_ && monoSeconds() - queue_.front().second < maxDelayS_) {
      lk.unlock();
      bool wait = backlog_() > batchAbove_;
      lk.lock();
      if (wait) {
        cv_.wait_for(lk, std::chrono::milliseconds(50));
        continue;
      }
    }
    std::string id = std::move(queue_.front().first);
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    remove_(id);
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

FdDropper::~FdDropper() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void FdDropper::drop(std::vector<UniqueFd> fds) {
  if (fds.empty()) return;
  {
    std::lock_guard lk(mu_);
    for (auto& f : fds) queue_.push_back(std::move(f));
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_all();
}

void FdDropper::drain() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return queue_.empty() && closing_ == 0; });
}

void FdDropper::loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    std::vector<UniqueFd> batch = std::move(queue_);
    queue_.clear();
    closing_ = batch.size();
    lk.unlock();
    batch.clear();  // the closes (and unmounts) happen here
    lk.lock();
    closing_ = 0;
    cv_.notify_all();
  }
}

}  // namespace dsec::edge
