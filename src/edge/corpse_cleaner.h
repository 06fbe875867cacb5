// Killed sandboxes are reaped, and what they leave (cgroups, directories,
// disks) removed, on a thread of their own, off the API path: destroy() only
// sends SIGKILL and hands the pidfd over. Shared by the container, microvm
// and vm backends.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "common/fd.h"

namespace dsec::edge {

class CorpseCleaner {
 public:
  // `cleanup(id)` runs on the cleaner's thread once the sandbox's process
  // (its PID 1 or QEMU) is reaped. With `background`, the thread runs at a
  // lower priority than the request path, but still runs under load.
  explicit CorpseCleaner(std::function<void(const std::string& id)> cleanup,
                         bool background = false);
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
  void loop(bool background);

  std::function<void(const std::string&)> cleanup_;
  std::mutex mu_;  // guards queue_, busy_, stop_
  std::condition_variable cv_;
  std::deque<std::pair<std::string, UniqueFd>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dsec::edge
