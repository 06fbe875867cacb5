// The process's event loop and its bounded pool for blocking work.
//
// Concurrency model (DESIGN.md section 1): an RL job is tens of thousands of
// long calls in flight at once, so nothing in flight may hold a thread. Work
// that reacts to I/O (HTTP connections, the platform-edge link, timers) runs
// as callbacks and coroutines on a few io threads and must never block them:
// no store access, no mount/clone/cgroup writes, no fsync, no waiting on a
// mutex held across any of those. Work that blocks goes to the blocking pool,
// a fixed number of threads fed from one FIFO queue: the queue, not the
// thread count, grows with load.
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
  // Blocking pool threads; 0: 4 per core, at least 8 and at most 32.
  int blockingThreads = 0;
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
  int blockingThreadCount() const { return blockingThreads_; }
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
  int ioThreads_ = 0;
  int blockingThreads_ = 0;
};

}  // namespace dsec
