#include "common/runtime.h"

#include <unistd.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <condition_variable>
#include <deque>
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

  mutable std::mutex mu;  // guards queue, stopping, busy
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stopping = false;
  int busy = 0;
  std::vector<std::thread> pool;
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
  for (int i = 0; i < blockingThreads_; ++i) {
    impl_->pool.emplace_back([this] {
      std::unique_lock lk(impl_->mu);
      for (;;) {
        impl_->cv.wait(lk, [&] { return impl_->stopping || !impl_->queue.empty(); });
        if (impl_->stopping) return;
        auto fn = std::move(impl_->queue.front());
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
  {
    std::lock_guard lk(impl_->mu);
    if (impl_->stopping) return false;
    impl_->queue.push_back(std::move(fn));
  }
  impl_->cv.notify_one();
  return true;
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

int Runtime::blockingBusy() const {
  std::lock_guard lk(impl_->mu);
  return impl_->busy;
}

bool Runtime::onIoThread() const { return tIoRuntime == this; }

void Runtime::stop() {
  std::call_once(impl_->stopOnce, [this] {
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard lk(impl_->mu);
      impl_->stopping = true;
      dropped.swap(impl_->queue);
    }
    impl_->cv.notify_all();
    impl_->guard.reset();
    impl_->io.stop();
    for (auto& t : impl_->ioThreads) t.join();
    for (auto& t : impl_->pool) t.join();
  });
}

}  // namespace dsec
