#include "common/runtime.h"

#include <unistd.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/log.h"

namespace dsec {

namespace asio = boost::asio;

namespace {

int cores() {
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

thread_local const void* tIoRuntime = nullptr;

std::mutex gGlobalMu;  // guards gGlobal, gGlobalOpts
Runtime* gGlobal = nullptr;
RuntimeOptions gGlobalOpts;

}  // namespace

struct Runtime::Impl {
  asio::io_context io{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
  std::vector<std::thread> ioThreads;

  struct Worker {
    std::thread thread;
    bool done = false;  // its loop ended; join it
  };
  mutable std::mutex mu;  // guards everything below
  std::condition_variable cv;
  struct Task {
    std::function<void()> fn;
    std::chrono::steady_clock::time_point queuedAt;
  };
  std::deque<Task> queue;
  bool growArmed = false;  // a grow check is scheduled
  bool stopping = false;
  int busy = 0;     // running a task
  int threads = 0;  // workers whose loop has not ended
  int waiting = 0;  // workers waiting for a task (not yet woken)
  std::list<Worker> pool;
  std::once_flag stopOnce;
};

Runtime::Runtime(RuntimeOptions opts) : impl_(std::make_unique<Impl>()) {
  int c = cores();
  ioThreads_ = opts.ioThreads > 0 ? opts.ioThreads : std::clamp(c / 4, 1, 4);
  blockingThreads_ = opts.blockingThreads > 0 ? opts.blockingThreads : std::clamp(4 * c, 8, 32);
  impl_->guard.emplace(impl_->io.get_executor());
  for (int i = 0; i < ioThreads_; ++i) {
    impl_->ioThreads.emplace_back([this] {
      tIoRuntime = this;
      for (;;) {
        try {
          impl_->io.run();
          return;
        } catch (const std::exception& e) {
          // A handler must not throw; one that does is a bug, but the loop
          // carries on for everything else in flight.
          log::error(std::string("io thread: handler threw: ") + e.what());
        }
      }
    });
  }
  maxBlockingThreads_ =
      std::max(blockingThreads_, opts.maxBlockingThreads > 0 ? opts.maxBlockingThreads : 0);
  keepAliveS_ = opts.blockingKeepAliveS;
  std::lock_guard lk(impl_->mu);
  for (int i = 0; i < blockingThreads_; ++i) spawnWorkerLocked();
}

void Runtime::spawnWorkerLocked() {
  auto& w = impl_->pool.emplace_back();
  ++impl_->threads;
  w.thread = std::thread([this, &w] {
    reapWorkers();  // threads that ended before this one started: joined here, not on an io thread
    const auto keepAlive = std::chrono::duration<double>(keepAliveS_);
    std::unique_lock lk(impl_->mu);
    for (;;) {
      ++impl_->waiting;
      bool ready = true;
      auto wake = [&] { return impl_->stopping || !impl_->queue.empty(); };
      if (impl_->threads > blockingThreads_) {
        ready = impl_->cv.wait_for(lk, keepAlive, wake);
      } else {
        impl_->cv.wait(lk, wake);
      }
      --impl_->waiting;
      // Stopping, or a thread beyond the core ones idle for keepAlive: ends
      // (the runtime joins it later; it touches nothing once done is set).
      if (impl_->stopping || (!ready && impl_->threads > blockingThreads_)) {
        --impl_->threads;
        w.done = true;
        return;
      }
      if (impl_->queue.empty()) continue;
      auto fn = std::move(impl_->queue.front().fn);
      impl_->queue.pop_front();
      ++impl_->busy;
      lk.unlock();
      try {
        fn();
      } catch (const std::exception& e) {
        log::error(std::string("blocking pool: task threw: ") + e.what());
      }
      fn = nullptr;  // its captures go before the next task
      lk.lock();
      --impl_->busy;
    }
  });
}

void Runtime::reapWorkers() {
  std::list<Impl::Worker> done;
  {
    std::lock_guard lk(impl_->mu);
    for (auto it = impl_->pool.begin(); it != impl_->pool.end();) {
      auto next = std::next(it);
      if (it->done) done.splice(done.end(), impl_->pool, it);
      it = next;
    }
  }
  for (auto& w : done) w.thread.join();
}

Runtime::~Runtime() { stop(); }

Runtime& Runtime::global() {
  std::lock_guard lk(gGlobalMu);
  if (!gGlobal) gGlobal = new Runtime(gGlobalOpts);  // never deleted (see the header)
  return *gGlobal;
}

bool Runtime::configureGlobal(RuntimeOptions opts) {
  std::lock_guard lk(gGlobalMu);
  if (gGlobal) return false;
  gGlobalOpts = opts;
  return true;
}

asio::io_context& Runtime::io() { return impl_->io; }

void Runtime::post(std::function<void()> fn) { asio::post(impl_->io, std::move(fn)); }

bool Runtime::runBlocking(std::function<void()> fn) {
  bool arm = false;
  {
    std::lock_guard lk(impl_->mu);
    if (impl_->stopping) return false;
    impl_->queue.push_back({std::move(fn), std::chrono::steady_clock::now()});
    // No waiting worker left for it: if it still waits kGrowAfter from now,
    // one more thread (growCheck). A burst of short tasks drains before then
    // and adds none.
    if (size_t(impl_->waiting) < impl_->queue.size() && impl_->threads < maxBlockingThreads_ &&
        !impl_->growArmed) {
      impl_->growArmed = arm = true;
    }
  }
  impl_->cv.notify_one();
  if (arm) (void)after(kGrowAfterS, [this] { growCheck(); });
  return true;
}

void Runtime::growCheck() {
  bool again = false;
  {
    std::lock_guard lk(impl_->mu);
    impl_->growArmed = false;
    if (impl_->stopping) return;
    auto waitedSince = std::chrono::steady_clock::now() -
                       std::chrono::microseconds(int64_t(kGrowAfterS * 1e6));
    bool starved = size_t(impl_->waiting) < impl_->queue.size();
    if (starved && impl_->threads < maxBlockingThreads_ &&
        impl_->queue.front().queuedAt <= waitedSince) {
      spawnWorkerLocked();
    }
    again = starved && impl_->threads < maxBlockingThreads_;
    impl_->growArmed = again;
  }
  if (again) (void)after(kGrowAfterS, [this] { growCheck(); });
}

namespace {

class AsioTimer : public Runtime::Timer, public std::enable_shared_from_this<AsioTimer> {
 public:
  AsioTimer(asio::io_context& io, std::function<void()> fn)
      : strand_(asio::make_strand(io)), timer_(strand_), fn_(std::move(fn)) {}

  void start(double seconds) {
    timer_.expires_after(std::chrono::microseconds(int64_t(std::max(0.0, seconds) * 1e6)));
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
      int want = kPending;
      if (self->state_.compare_exchange_strong(want, kFired)) {
        auto fn = std::move(self->fn_);
        fn();
      }
    });
  }

  void cancel() override {
    int want = kPending;
    if (!state_.compare_exchange_strong(want, kCancelled)) return;
    // The timer object is touched only on its strand.
    asio::post(strand_, [self = shared_from_this()] {
      self->timer_.cancel();
      self->fn_ = nullptr;
    });
  }

 private:
  static constexpr int kPending = 0, kFired = 1, kCancelled = 2;
  asio::strand<asio::io_context::executor_type> strand_;
  asio::steady_timer timer_;
  std::function<void()> fn_;
  std::atomic<int> state_{kPending};
};

}  // namespace

std::shared_ptr<Runtime::Timer> Runtime::after(double seconds, std::function<void()> fn) {
  auto t = std::make_shared<AsioTimer>(impl_->io, std::move(fn));
  t->start(seconds);
  return t;
}

size_t Runtime::blockingQueued() const {
  std::lock_guard lk(impl_->mu);
  return impl_->queue.size();
}

int Runtime::blockingThreadCount() const {
  std::lock_guard lk(impl_->mu);
  return impl_->threads;
}

int Runtime::blockingBusy() const {
  std::lock_guard lk(impl_->mu);
  return impl_->busy;
}

bool Runtime::onIoThread() const { return tIoRuntime == this; }

void Runtime::stop() {
  std::call_once(impl_->stopOnce, [this] {
    std::deque<Impl::Task> dropped;
    {
      std::lock_guard lk(impl_->mu);
      impl_->stopping = true;
      dropped.swap(impl_->queue);
    }
    impl_->cv.notify_all();
    impl_->guard.reset();
    impl_->io.stop();
    for (auto& t : impl_->ioThreads) t.join();
    // No worker is added once stopping is set; a starting one may be
    // reaping others (it joins those), so the list is taken under the lock.
    std::list<Impl::Worker> all;
    {
      std::lock_guard lk(impl_->mu);
      all.swap(impl_->pool);
    }
    for (auto& w : all) w.thread.join();
  });
}

}  // namespace dsec
