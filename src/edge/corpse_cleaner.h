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
  // Sandboxes queued or being cleaned up right now.
  size_t backlog();

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

// Removes destroyed sandboxes' cgroups on a thread of its own, after their
// teardown, and in a mass destroy only once the teardown has caught up.
//
// Why (docs/container-backend.md, "Kernel cost per sandbox"): removing a
// memory cgroup walks every memory-cgroup-aware LRU on the host, two per
// live superblock, under cgroup_mutex. A sandbox's superblocks go when its
// PID 1 is reaped. When thousands are destroyed at once, removing each
// one's cgroups as soon as it is reaped makes the early removals walk the
// LRUs of all the sandboxes still dying (~15 ms each at 3,000 live here,
// against ~1 ms on an empty node). So while more than `batchAbove` sandboxes
// wait for the cleaner (`backlog`), removals wait too, up to `maxDelayS`
// after the oldest arrived; with fewer (a steady stream of destroys) they
// run at once, and the memory cgroup pool (edge/cgroup.h) keeps working.
class CgroupReaper {
 public:
  CgroupReaper(std::function<void(const std::string& id)> remove,
               std::function<size_t()> backlog, size_t batchAbove = kBatchAbove,
               double maxDelayS = kMaxDelayS);
  static constexpr size_t kBatchAbove = 32;
  static constexpr double kMaxDelayS = 20;
  // Drains, then stops the thread.
  ~CgroupReaper();
  CgroupReaper(const CgroupReaper&) = delete;
  CgroupReaper& operator=(const CgroupReaper&) = delete;

  void add(std::string id);
  // Removes everything queued now, whatever the backlog, and returns once done.
  void drain();
  size_t pending();

 private:
  void loop();

  std::function<void(const std::string&)> remove_;
  std::function<size_t()> backlog_;
  const size_t batchAbove_;
  const double maxDelayS_;
  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<std::pair<std::string, double>> queue_;  // id, when added (monoSeconds)
  bool busy_ = false;
  int draining_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// Closes descriptors on a thread of its own. Closing the last fd of a
// detached mount (a sandbox's idmapped layer clones, which its overlay no
// longer needs once made: it holds private clones of its own) unmounts it,
// and that waits out an RCU grace period (`dissolve_on_fput` ->
// `namespace_unlock`): milliseconds per mount on a busy node, which do not
// belong on the create path. The thread starts at the first drop.
class FdDropper {
 public:
  FdDropper() = default;
  // Closes what is queued, then stops the thread.
  ~FdDropper();
  FdDropper(const FdDropper&) = delete;
  FdDropper& operator=(const FdDropper&) = delete;
  void drop(std::vector<UniqueFd> fds);
  // Returns once everything dropped so far is closed.
  void drain();

 private:
  void loop();
  std::mutex mu_;  // guards queue_, closing_, stop_, thread_
  std::condition_variable cv_;
  std::vector<UniqueFd> queue_;
  size_t closing_ = 0;  // taken off queue_, not yet closed
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dsec::edge
