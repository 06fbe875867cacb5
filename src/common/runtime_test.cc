#include "common/runtime.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

namespace dsec {
namespace {

TEST(Runtime, PostRunsOnAnIoThread) {
  Runtime rt(RuntimeOptions{1, 2});
  std::promise<bool> onIo;
  rt.post([&] { onIo.set_value(rt.onIoThread()); });
  EXPECT_TRUE(onIo.get_future().get());
  EXPECT_FALSE(rt.onIoThread());
}

TEST(Runtime, BlockingPoolIsBoundedAndRunsEverythingInOrderOfQueueing) {
  Runtime rt(RuntimeOptions{1, 2, 2});
  EXPECT_EQ(rt.blockingThreadCount(), 2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> running{0}, maxRunning{0}, done{0};
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(rt.runBlocking([&] {
      int now = ++running;
      int seen = maxRunning.load();
      while (now > seen && !maxRunning.compare_exchange_weak(seen, now)) {
      }
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return release; });
      --running;
      ++done;
    }));
  }
  // Two run, eight wait in the queue.
  for (int i = 0; i < 200 && rt.blockingBusy() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rt.blockingBusy(), 2);
  EXPECT_EQ(rt.blockingQueued(), 8u);
  {
    std::lock_guard lk(mu);
    release = true;
  }
  cv.notify_all();
  for (int i = 0; i < 400 && done.load() < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(done.load(), 10);
  EXPECT_EQ(maxRunning.load(), 2);
}

// Work that waits does not hold the whole pool: with every thread busy, a
// new task gets a thread of its own up to the cap, the rest queue, and the
// extra threads end after the keep-alive.
TEST(Runtime, BlockingPoolGrowsToItsCapWhenBusyAndShrinksWhenIdle) {
  Runtime rt(RuntimeOptions{1, 1, 4, 0.2});
  EXPECT_EQ(rt.blockingThreadCount(), 1);
  EXPECT_EQ(rt.blockingMaxThreads(), 4);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> done{0};
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(rt.runBlocking([&] {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return release; });
      ++done;
    }));
  }
  for (int i = 0; i < 200 && rt.blockingBusy() < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rt.blockingBusy(), 4);
  EXPECT_EQ(rt.blockingThreadCount(), 4);
  EXPECT_EQ(rt.blockingQueued(), 2u);
  {
    std::lock_guard lk(mu);
    release = true;
  }
  cv.notify_all();
  for (int i = 0; i < 400 && done.load() < 6; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(done.load(), 6);
  for (int i = 0; i < 400 && rt.blockingThreadCount() > 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rt.blockingThreadCount(), 1);
  // And it grows again (the ended threads are joined on the way).
  std::promise<void> a, b;
  std::promise<void> go;
  auto goF = go.get_future().share();
  rt.runBlocking([&] { a.set_value(); goF.wait(); });
  rt.runBlocking([&] { b.set_value(); goF.wait(); });
  a.get_future().wait();
  b.get_future().wait();
  EXPECT_EQ(rt.blockingThreadCount(), 2);
  go.set_value();
}

TEST(Runtime, TimerFiresOnceAndCancelStopsIt) {
  Runtime rt(RuntimeOptions{2, 1});
  std::promise<void> fired;
  std::atomic<int> count{0};
  auto t0 = std::chrono::steady_clock::now();
  auto t = rt.after(0.05, [&] {
    ++count;
    fired.set_value();
  });
  fired.get_future().wait();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(45));
  t->cancel();  // after it ran: nothing happens
  EXPECT_EQ(count.load(), 1);

  std::atomic<int> cancelled{0};
  auto c = rt.after(0.05, [&] { ++cancelled; });
  c->cancel();
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_EQ(cancelled.load(), 0);
}

TEST(Runtime, StopDropsQueuedWorkAndRefusesMore) {
  auto rt = std::make_unique<Runtime>(RuntimeOptions{1, 1, 1});
  std::promise<void> started;
  std::atomic<bool> ranSecond{false};
  std::promise<void> go;
  auto goF = go.get_future().share();
  rt->runBlocking([&] {
    started.set_value();
    goF.wait();
  });
  rt->runBlocking([&] { ranSecond = true; });
  started.get_future().wait();
  std::thread stopper([&] { rt->stop(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  go.set_value();
  stopper.join();
  EXPECT_FALSE(ranSecond.load());
  EXPECT_FALSE(rt->runBlocking([] {}));
}

}  // namespace
}  // namespace dsec
