// Killed sandboxes are reaped, and what they leave (cgroups, directories,
// disks) removed, on threads of their own, off the API path: destroy() only
// sends SIGKILL and hands the pidfd over. Shared by the container, microvm
// and vm backends.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"

namespace dsec::edge {

class CorpseCleaner {
 public:
  // `cleanup(id)` runs on one of `workers` threads once the sandbox's process
  // (its PID 1 or QEMU) is reaped, so must be safe to call for different ids
  // at once. Many workers because most of a teardown is waiting (a PID 1
  // reaped only after all its namespace, an unmount's RCU grace period, a
  // cgroup's removal): one slow death must not hold up the rest, and a
  // sustained stream of destroys must be cleaned up as fast as creates make
  // sandboxes. The threads run at the request path's priority: a teardown
  // left behind is not free, each one still mounted in the edge's namespace
  // is copied by every later clone (CLONE_NEWNS) and holds a loop device.
  // Workers start as destroys come (one more while all are busy, up to
  // `workers`) and stay: a node with nothing to clean up holds no thread.
  explicit CorpseCleaner(std::function<void(const std::string& id)> cleanup,
                         int workers = kDefaultWorkers);
  static constexpr int kDefaultWorkers = 16;
  // Drains the queue, then stops the thread.
  ~CorpseCleaner();
  CorpseCleaner(const CorpseCleaner&) = delete;
  CorpseCleaner& operator=(const CorpseCleaner&) = delete;

  // Queues sandbox `id`, whose process was sent SIGKILL: reaped through
  // `pidfd` (waited on if not our child), then cleaned up.
  void add(std::string id, UniqueFd pidfd);
  // Returns once everything queued so far is cleaned up.
  void drain();

 private:
  void loop();

  std::function<void(const std::string&)> cleanup_;
  std::mutex mu_;  // guards queue_, busy_, stop_
  std::condition_variable cv_;
  std::deque<std::pair<std::string, UniqueFd>> queue_;
  int busy_ = 0;  // workers cleaning up right now
  int idle_ = 0;      // workers waiting for work
  int starting_ = 0;  // workers started, not yet waiting
  bool stop_ = false;
  const int maxWorkers_;
  std::vector<std::thread> threads_;  // guarded by mu_ (grows in add())
};

}  // namespace dsec::edge
