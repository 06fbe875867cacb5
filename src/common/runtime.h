// The process's event loop and its bounded pool for blocking work.
//
// Concurrency model (DESIGN.md section 1): an RL job is tens of thousands of
// long calls in flight at once, so nothing in flight may hold a thread. Work
// that reacts to I/O (HTTP connections, the platform-edge link, timers) runs
// as callbacks and coroutines on a few io threads and must never block them:
// no store access, no mount/clone/cgroup writes, no fsync, no waiting on a
// mutex held across any of those. Work that blocks goes to the blocking pool,
// threads fed from one FIFO queue: `blockingThreads` that live as long as the
// runtime, and one more each kGrowAfterS while the oldest queued task has
// waited that long with no thread free, up to `maxBlockingThreads`; a thread
// beyond `blockingThreads` ends after `blockingKeepAliveS` without work (the
// shape of tokio's spawn_blocking pool, with .NET's starvation delay so that a
// burst of short tasks adds none). Past the cap the queue, not the thread count, grows with load.
// The extra threads are for work that mostly waits (a create on a remote
// node, a VM's boot): such work must not hold the whole pool, and a long call
// that waits on I/O only should free its thread instead (an exec defers).
//
// One Runtime serves a whole process (global()); tests may make their own.
// Boost.Asio stays out of this header: code that needs the io_context
// includes <boost/asio.hpp> itself and calls io().
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>

namespace boost::asio {
class io_context;
}

namespace dsec {

struct RuntimeOptions {
  // Event loop threads; 0: 1 on up to 4 cores, else cores / 4 (at most 4).
  int ioThreads = 0;
  // Blocking pool threads always there; 0: 4 per core, at least 8 and at most 32.
  int blockingThreads = 0;
  // Blocking pool threads at most (at least blockingThreads); 0: blockingThreads,
  // a fixed pool.
  int maxBlockingThreads = 0;
  // How long a thread beyond blockingThreads waits for work before it ends.
  double blockingKeepAliveS = 10;
};

class Runtime {
 public:
  // Starts the threads.
  explicit Runtime(RuntimeOptions opts = {});
  // stop(), then joins.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The process's runtime, started on first use with the options given to
  // configureGlobal() (or the defaults). Never destroyed: threads of a
  // process-wide loop must not be joined from a static destructor.
  static Runtime& global();
  // Options for global(); false (and ignored) once global() has started.
  static bool configureGlobal(RuntimeOptions opts);

  boost::asio::io_context& io();

  // Runs fn on an io thread soon. fn must not block.
  void post(std::function<void()> fn);
  // Runs fn on the blocking pool, in the order queued. Never runs fn inline.
  // After stop() the call is dropped (false).
  bool runBlocking(std::function<void()> fn);

  // A one-shot timer: fn runs on an io thread after `seconds` unless
  // cancelled first. cancel() after fn ran is a no-op; after cancel() returns
  // fn has not started and never will unless it was already running.
  class Timer {
   public:
    virtual ~Timer() = default;
    virtual void cancel() = 0;
  };
  std::shared_ptr<Timer> after(double seconds, std::function<void()> fn);

  int ioThreadCount() const { return ioThreads_; }
  // Blocking pool threads now, and at most.
  int blockingThreadCount() const;
  int blockingMaxThreads() const { return maxBlockingThreads_; }
  // Queued blocking work not yet started, and work running now.
  size_t blockingQueued() const;
  int blockingBusy() const;

  // Stops the io threads (pending handlers are dropped) and the pool (queued
  // work is dropped; running work finishes), and joins them. Idempotent; must
  // not be called from one of the runtime's own threads.
  void stop();
  // Whether the calling thread is one of this runtime's io threads.
  bool onIoThread() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  static constexpr double kGrowAfterS = 0.005;
  void spawnWorkerLocked();
  void growCheck();
  void reapWorkers();
  int ioThreads_ = 0;
  int blockingThreads_ = 0;
  int maxBlockingThreads_ = 0;
  double keepAliveS_ = 10;
};

}  // namespace dsec
