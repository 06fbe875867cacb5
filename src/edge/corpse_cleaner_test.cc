#include "edge/corpse_cleaner.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dsec::edge {
namespace {

// A killed child is reaped before its cleanup runs, and drain() waits for all
// of it.
TEST(CorpseCleaner, ReapsThenCleansUp) {
  std::mutex mu;
  std::vector<std::string> done;
  std::vector<pid_t> pids;
  {
    CorpseCleaner cleaner([&](const std::string& id) {
      std::lock_guard lk(mu);
      done.push_back(id);
    });
    for (int i = 0; i < 3; ++i) {
      pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        ::pause();
        _exit(0);
      }
      pids.push_back(pid);
      int pidfd = int(::syscall(SYS_pidfd_open, pid, 0));
      ASSERT_GE(pidfd, 0);
      ::kill(pid, SIGKILL);
      cleaner.add("sb-" + std::to_string(i), UniqueFd(pidfd));
    }
    cleaner.drain();
    std::lock_guard lk(mu);
    std::sort(done.begin(), done.end());
    EXPECT_EQ(done, (std::vector<std::string>{"sb-0", "sb-1", "sb-2"}));
  }
  // Reaped by the cleaner: nothing left for us to wait for.
  for (pid_t pid : pids) EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
}

// One slow teardown does not hold up the others queued behind it.
TEST(CorpseCleaner, ASlowCleanupDoesNotBlockTheRest) {
  std::mutex mu;
  std::condition_variable cv;
  bool fastDone = false;
  bool slowSawFast = false;
  {
    CorpseCleaner cleaner([&](const std::string& id) {
      std::unique_lock lk(mu);
      if (id == "sb-slow") {
        slowSawFast = cv.wait_for(lk, std::chrono::seconds(10), [&] { return fastDone; });
      } else {
        fastDone = true;
        cv.notify_all();
      }
    });
    cleaner.add("sb-slow", UniqueFd());
    cleaner.add("sb-fast", UniqueFd());
    cleaner.drain();
  }
  EXPECT_TRUE(slowSawFast);
}

// Teardowns are mostly waiting: as many as there are workers wait at once
// (each here waits until all of them have started), so a stream of destroys
// is not cleaned up one wait at a time.
TEST(CorpseCleaner, AsManyTeardownsWaitAtOnceAsThereAreWorkers) {
  constexpr int kN = CorpseCleaner::kDefaultWorkers;
  std::mutex mu;
  std::condition_variable cv;
  int started = 0, sawAll = 0;
  {
    CorpseCleaner cleaner([&](const std::string&) {
      std::unique_lock lk(mu);
      ++started;
      cv.notify_all();
      if (cv.wait_for(lk, std::chrono::seconds(10), [&] { return started == kN; })) ++sawAll;
    });
    for (int i = 0; i < kN; ++i) cleaner.add("sb-" + std::to_string(i), UniqueFd());
    cleaner.drain();
  }
  EXPECT_EQ(sawAll, kN);
}

TEST(CorpseCleaner, DestructorDrainsWhatIsQueued) {
  int calls = 0;
  {
    CorpseCleaner cleaner([&](const std::string&) { ++calls; });
    cleaner.add("sb-x", UniqueFd());  // no process: cleaned up at once
  }
  EXPECT_EQ(calls, 1);
}

// Removals wait while the cleaner has a mass destroy's backlog (over the
// threshold), and run once it has caught up.
TEST(CgroupReaper, WaitsForAMassDestroysTeardownToCatchUp) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> removed;
  std::atomic<size_t> backlog{100};
  CgroupReaper reaper(
      [&](const std::string& id) {
        std::lock_guard lk(mu);
        removed.push_back(id);
        cv.notify_all();
      },
      [&] { return backlog.load(); }, /*batchAbove=*/32, /*maxDelayS=*/600);
  reaper.add("sb-1");
  reaper.add("sb-2");
  // Nothing happens while the backlog stays above the threshold (the reaper
  // polls every 50 ms: give it several rounds).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  {
    std::lock_guard lk(mu);
    EXPECT_TRUE(removed.empty());
  }
  EXPECT_EQ(reaper.pending(), 2u);
  backlog = 3;
  std::unique_lock lk(mu);
  ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(10), [&] { return removed.size() == 2; }));
  EXPECT_EQ(removed, (std::vector<std::string>{"sb-1", "sb-2"}));
}

// A small backlog (a steady stream of destroys) does not hold removals up.
TEST(CgroupReaper, RemovesAtOnceWithASmallBacklog) {
  std::mutex mu;
  std::condition_variable cv;
  int n = 0;
  CgroupReaper reaper(
      [&](const std::string&) {
        std::lock_guard lk(mu);
        ++n;
        cv.notify_all();
      },
      [] { return size_t(5); }, 32, 600);
  for (int i = 0; i < 10; ++i) reaper.add("sb-" + std::to_string(i));
  std::unique_lock lk(mu);
  ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(10), [&] { return n == 10; }));
}

// The wait is bounded (maxDelayS), and drain() removes everything at once.
TEST(CgroupReaper, TheWaitIsBoundedAndDrainDoesNotWait) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> removed;
  {
    CgroupReaper reaper(
        [&](const std::string& id) {
          std::lock_guard lk(mu);
          removed.push_back(id);
          cv.notify_all();
        },
        [] { return size_t(1000); }, 32, /*maxDelayS=*/0.2);
    reaper.add("sb-late");
    {
      std::unique_lock lk(mu);
      ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(10), [&] { return removed.size() == 1; }));
    }
  }
  CgroupReaper stuck(
      [&](const std::string& id) {
        std::lock_guard lk(mu);
        removed.push_back(id);
      },
      [] { return size_t(1000); }, 32, /*maxDelayS=*/600);
  stuck.add("sb-drained");
  stuck.drain();
  EXPECT_EQ(stuck.pending(), 0u);
  std::lock_guard lk(mu);
  EXPECT_EQ(removed, (std::vector<std::string>{"sb-late", "sb-drained"}));
}

}  // namespace
}  // namespace dsec::edge
