#include "edge/loop_device.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/loop.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <map>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "common/util.h"

namespace dsec::edge {
namespace {

// The loop driver as LoopPool sees it: LOOP_CTL_ADD takes the lowest unused
// index; LOOP_CTL_REMOVE and LOOP_CONFIGURE refuse (EBUSY) a device that is
// bound, or still tearing down after autoclear (for `rundown` ticks of the
// fake's clock); configure binds. A test plays the kernel's part of
// autoclear with unbind() and moves the clock with tick().
class FakeLoopSys : public LoopSys {
 public:
  struct Dev {
    std::string backing;  // "" unbound
    int readyAt = 0;      // busy until the clock reaches this after unbind()
  };

  Result<int> add() override {
    std::lock_guard lk(mu_);
    ++adds;
    int n = 0;
    while (devs.count(n)) ++n;
    devs[n] = Dev{};
    return n;
  }
  Status remove(int index) override {
    if (holdUntil > 1) {
      // Each removal waits (up to 1 s) until holdUntil are in at once, as
      // the kernel's wait for a grace period would let them be.
      std::unique_lock g(gateMu_);
      maxInside = std::max(maxInside, ++inside);
      if (inside >= holdUntil) gateOpen_ = true;
      gateCv_.notify_all();
      gateCv_.wait_for(g, std::chrono::seconds(1), [&] { return gateOpen_; });
      --inside;
    }
    std::lock_guard lk(mu_);
    ++removes;
    auto it = devs.find(index);
    if (it == devs.end()) return sysError("LOOP_CTL_REMOVE", ENODEV);
    if (busyLocked(it->second)) return sysError("LOOP_CTL_REMOVE", EBUSY);
    devs.erase(it);
    return Status::ok();
  }
  Result<UniqueFd> configure(int index, int fileFd, uint32_t loFlags) override {
    std::lock_guard lk(mu_);
    auto it = devs.find(index);
    if (it == devs.end()) return sysError("open /dev/loop" + std::to_string(index), ENOENT);
    if (busyLocked(it->second)) return sysError("LOOP_CONFIGURE", EBUSY);
    if ((loFlags & LO_FLAGS_DIRECT_IO) && refuseDirectIo) return sysError("LOOP_CONFIGURE", EINVAL);
    char buf[256];
    ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fileFd)).c_str(), buf, sizeof buf);
    it->second.backing = n > 0 ? std::string(buf, size_t(n)) : "?";
    return UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
  bool bound(int index) override {
    std::lock_guard lk(mu_);
    auto it = devs.find(index);
    return it != devs.end() && busyLocked(it->second);
  }
  std::map<int, std::string> list() override {
    std::lock_guard lk(mu_);
    std::map<int, std::string> out;
    for (auto& [n, d] : devs) out[n] = d.backing;
    return out;
  }
  int indexOf(dev_t dev) override { return major(dev) == 7 ? int(minor(dev)) : -1; }
  std::string bootId() override { return boot; }

  // --- the test's side ---
  // The device's filesystem went: it unbinds, busy for `rundown` more ticks.
  void unbind(int index, int rundown = 0) {
    std::lock_guard lk(mu_);
    auto it = devs.find(index);
    if (it == devs.end()) return;
    it->second.backing.clear();
    it->second.readyAt = now_ + rundown;
  }
  void tick() {
    std::lock_guard lk(mu_);
    ++now_;
  }
  void hostDevice(int index, std::string backing = "") {
    std::lock_guard lk(mu_);
    devs[index] = Dev{std::move(backing), 0};
  }
  size_t count() {
    std::lock_guard lk(mu_);
    return devs.size();
  }
  bool exists(int index) {
    std::lock_guard lk(mu_);
    return devs.count(index) > 0;
  }

  std::map<int, Dev> devs;
  int holdUntil = 0;  // > 1: remove() waits for that many at once (see there)
  int inside = 0, maxInside = 0;  // removals under way now, most at once
  std::string boot = "boot-1";
  bool refuseDirectIo = false;
  int adds = 0, removes = 0;

 private:
  bool busyLocked(const Dev& d) const { return !d.backing.empty() || now_ < d.readyAt; }
  std::mutex gateMu_;  // guards inside, maxInside, gateOpen_
  std::condition_variable gateCv_;
  bool gateOpen_ = false;
  std::mutex mu_;
  int now_ = 0;
};

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/dsec-loop-test-XXXXXX";
    if (::mkdtemp(tmpl)) path = tmpl;
  }
  ~TempDir() {
    if (!path.empty()) (void)removeTree(path);
  }
};

class LoopPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp.path.empty());
    file = tmp.path + "/disk.img";
    UniqueFd f(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(f.valid());
    opts.ledger = tmp.path + "/loop-devices";
    opts.thread = false;
    opts.retryMinS = 0;
    opts.retryMaxS = 0;
  }
  std::unique_ptr<LoopPool> open() {
    auto p = LoopPool::open(opts, sys);
    EXPECT_TRUE(p.isOk()) << p.status().toString();
    if (!p.isOk()) return nullptr;
    return std::move(p).value();
  }
  // attach + the kernel's autoclear + release, as a sandbox's life does.
  int cycle(LoopPool& pool, int rundown = 0) {
    auto l = pool.attach(file, LO_FLAGS_AUTOCLEAR);
    EXPECT_TRUE(l.isOk()) << l.status().toString();
    if (!l.isOk()) return -1;
    sys->unbind(l->index, rundown);
    pool.release(l->index);
    return l->index;
  }
  std::string ledgerText() {
    auto t = readFile(opts.ledger);
    return t.isOk() ? *t : "";
  }

  TempDir tmp;
  std::string file;
  LoopPoolOptions opts;
  std::shared_ptr<FakeLoopSys> sys = std::make_shared<FakeLoopSys>();
};

TEST_F(LoopPoolTest, ReusesItsFreeDevicesBeforeAddingNew) {
  auto pool = open();
  ASSERT_TRUE(pool);
  std::vector<LoopLease> held;
  for (int i = 0; i < 3; ++i) {
    auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    EXPECT_EQ(l->path, "/dev/loop" + std::to_string(l->index));
    held.push_back(std::move(l).value());
  }
  EXPECT_EQ(sys->adds, 3);
  for (auto& l : held) {
    sys->unbind(l.index);
    pool->release(l.index);
  }
  EXPECT_EQ(pool->stats().free, 3u);
  for (int i = 0; i < 3; ++i) {
    auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
    ASSERT_TRUE(l.isOk());
  }
  EXPECT_EQ(sys->adds, 3) << "a free device was passed over for a new one";
  auto s = pool->stats();
  EXPECT_EQ(s.attached, 3u);
  EXPECT_EQ(s.free, 0u);
  EXPECT_EQ(s.reused, 3u);
  EXPECT_EQ(s.created, 3u);
}

TEST_F(LoopPoolTest, KeepsAtMostMaxFreeAndRemovesTheRest) {
  opts.maxFree = 16;
  auto pool = open();
  ASSERT_TRUE(pool);
  std::vector<int> idx;
  for (int i = 0; i < 40; ++i) {
    auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
    ASSERT_TRUE(l.isOk());
    idx.push_back(l->index);
  }
  EXPECT_EQ(sys->count(), 40u);
  for (int n : idx) {
    sys->unbind(n);
    pool->release(n);
  }
  EXPECT_EQ(pool->removeExcess(true), 0u);
  auto s = pool->stats();
  EXPECT_EQ(s.free, 16u);
  EXPECT_EQ(s.attached, 0u);
  EXPECT_EQ(s.removed, 24u);
  EXPECT_EQ(sys->count(), 16u);
  // The newest released stay (the oldest went first).
  for (int i = 24; i < 40; ++i) EXPECT_TRUE(sys->exists(idx[size_t(i)])) << idx[size_t(i)];
}

// LOOP_CTL_REMOVE waits for RCU grace periods (~50 ms here), so a mass
// destroy's devices are removed by several threads at once: the fake lets
// no removal finish before four are under way.
TEST_F(LoopPoolTest, RemovesManyDevicesInParallel) {
  opts.maxFree = 0;
  auto pool = open();
  ASSERT_TRUE(pool);
  std::vector<int> idx;
  for (int i = 0; i < 64; ++i) {
    auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
    ASSERT_TRUE(l.isOk());
    idx.push_back(l->index);
  }
  sys->holdUntil = 4;
  for (int n : idx) {
    sys->unbind(n);
    pool->release(n);
  }
  EXPECT_EQ(pool->removeExcess(true), 0u);
  EXPECT_GE(sys->maxInside, 4);
  EXPECT_LE(sys->maxInside, int(LoopPool::kRemoveThreads));
  EXPECT_EQ(sys->count(), 0u);
  EXPECT_EQ(pool->stats().removed, 64u);
}

TEST_F(LoopPoolTest, RetriesARemovalTheKernelRefusesWhileTearingDown) {
  opts.maxFree = 0;
  auto pool = open();
  ASSERT_TRUE(pool);
  int n = cycle(*pool, /*rundown=*/3);  // busy for three more ticks
  ASSERT_GE(n, 0);
  EXPECT_EQ(pool->stats().removing, 1u);
  size_t left = 1;
  for (int i = 0; i < 10 && left > 0; ++i) {
    left = pool->removeExcess(true);
    EXPECT_TRUE(left == 0 || sys->exists(n));
    sys->tick();
  }
  EXPECT_EQ(left, 0u);
  EXPECT_FALSE(sys->exists(n));
  EXPECT_EQ(pool->stats().removed, 1u);
}

TEST_F(LoopPoolTest, ChurnDoesNotGrowTheDevices) {
  // Every released device stays busy for a while (autoclear tearing the
  // filesystem down): attaches pass over it and may add, but the total
  // stays bounded by the free list plus what is still tearing down.
  opts.maxFree = 16;
  auto pool = open();
  ASSERT_TRUE(pool);
  size_t peak = 0;
  // Four sandboxes live at a time; each device takes 3 ticks to unbind.
  std::deque<int> live;
  for (int i = 0; i < 500; ++i) {
    auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    live.push_back(l->index);
    if (live.size() > 4) {
      sys->unbind(live.front(), /*rundown=*/3);
      pool->release(live.front());
      live.pop_front();
    }
    pool->removeExcess(false);
    sys->tick();
    peak = std::max(peak, sys->count());
  }
  for (int i = 0; i < 10 && pool->removeExcess(true) > 0; ++i) sys->tick();
  EXPECT_LE(peak, 4u + 16u) << "devices grew under churn";
  EXPECT_LE(sys->count(), 4u + 16u);
  // Live + what is still unbinding: no add while a free device is ready.
  EXPECT_LE(pool->stats().created, 4u + 4u) << "added devices while free ones were ready";
  EXPECT_GE(pool->stats().reused, 490u);
  for (int i = 0; i < 5; ++i) sys->tick();  // so close() finds the free ones unbound
}

TEST_F(LoopPoolTest, NeverTakesDevicesItDidNotMake) {
  for (int n = 0; n < 8; ++n) sys->hostDevice(n);  // boot's loop0..7, unbound
  sys->hostDevice(8, "/var/lib/other/disk.img");   // another program's
  auto pool = open();
  ASSERT_TRUE(pool);
  auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
  ASSERT_TRUE(l.isOk());
  EXPECT_EQ(l->index, 9) << "bound a device the host had";
  sys->unbind(l->index);
  pool->release(l->index);
  pool->close(0.1);
  for (int n = 0; n < 9; ++n) EXPECT_TRUE(sys->exists(n)) << n;
  EXPECT_FALSE(sys->exists(9)) << "its own free device stays after close";
}

TEST_F(LoopPoolTest, StartTrimsWhatAnEarlierEdgeOfThisDataDirLeft) {
  opts.maxFree = 4;
  opts.ownedPrefix = tmp.path + "/";
  for (int n = 0; n < 8; ++n) sys->hostDevice(n);  // the host's, unbound
  std::string ledger = "boot boot-1\n";
  for (int n = 8; n < 30; ++n) {
    sys->hostDevice(n);
    ledger += "+" + std::to_string(n) + "\n";
  }
  ledger += "-12\n";                                          // removed by it: another's now
  sys->hostDevice(40, tmp.path + "/sandbox-disks/sb-1.img");  // a sandbox still running
  sys->hostDevice(41, "/elsewhere/x.img");                    // bound, not ours
  ASSERT_TRUE(writeFileAtomic(opts.ledger, ledger, 0600).isOk());
  auto pool = open();
  ASSERT_TRUE(pool);
  for (int n = 0; n < 8; ++n) EXPECT_TRUE(sys->exists(n)) << n;
  EXPECT_TRUE(sys->exists(12)) << "a device the ledger struck off was removed";
  EXPECT_TRUE(sys->exists(40));
  EXPECT_TRUE(sys->exists(41));
  auto s = pool->stats();
  EXPECT_EQ(s.free, 4u);
  EXPECT_EQ(s.removing, 1u);  // 40, bound: removed once it is unbound
  EXPECT_EQ(sys->count(), 8u + 1u + 4u + 2u);
  // The sandbox of device 40 is re-adopted, then destroyed.
  pool->adopt(40);
  EXPECT_EQ(pool->stats().attached, 1u);
  sys->unbind(40);
  pool->release(40);
  pool->removeExcess(true);
  EXPECT_EQ(pool->stats().free, 4u);
  EXPECT_EQ(sys->count(), 8u + 1u + 4u + 1u);
  // The ledger now lists exactly what the pool owns.
  pool->close(0.1);
  EXPECT_EQ(sys->count(), 8u + 1u + 1u) << "close keeps only the host's and the foreign";
  auto text = ledgerText();
  EXPECT_EQ(text.rfind("boot boot-1\n", 0), 0u) << text;
}

TEST_F(LoopPoolTest, ALedgerOfAnotherBootAttributesNothing) {
  for (int n = 0; n < 10; ++n) sys->hostDevice(n);
  ASSERT_TRUE(writeFileAtomic(opts.ledger, "boot boot-0\n+3\n+4\n+5\n", 0600).isOk());
  auto pool = open();
  ASSERT_TRUE(pool);
  EXPECT_EQ(sys->count(), 10u);
  EXPECT_EQ(pool->stats().free, 0u);
  EXPECT_EQ(ledgerText(), "boot boot-1\n");
}

TEST_F(LoopPoolTest, AttachedDevicesOutliveCloseForTheNextEdge) {
  auto pool = open();
  ASSERT_TRUE(pool);
  auto kept = pool->attach(file, LO_FLAGS_AUTOCLEAR);  // a sandbox left running
  ASSERT_TRUE(kept.isOk());
  int freed = cycle(*pool);
  pool->close(0.1);
  EXPECT_TRUE(sys->exists(kept->index));
  EXPECT_FALSE(sys->exists(freed));
  // The next edge on this data dir finds it bound (so it waits) and, once
  // the sandbox is gone, may reuse or remove it.
  opts.maxFree = 0;
  auto next = open();
  ASSERT_TRUE(next);
  EXPECT_EQ(next->stats().removing, 1u);
  EXPECT_TRUE(sys->exists(kept->index));
  sys->unbind(kept->index);
  next->removeExcess(true);
  EXPECT_FALSE(sys->exists(kept->index));
}

TEST_F(LoopPoolTest, AFlagTheDeviceRefusesLeavesItFreeForTheRetry) {
  sys->refuseDirectIo = true;
  auto pool = open();
  ASSERT_TRUE(pool);
  auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO);
  ASSERT_FALSE(l.isOk());
  EXPECT_EQ(l.status().sysErrno(), EINVAL);
  EXPECT_EQ(pool->stats().free, 1u);
  auto again = pool->attach(file, LO_FLAGS_AUTOCLEAR);
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_EQ(sys->adds, 1);
}

TEST_F(LoopPoolTest, ADeviceRemovedBehindItsBackIsForgotten) {
  auto pool = open();
  ASSERT_TRUE(pool);
  int n = cycle(*pool);
  ASSERT_TRUE(sys->remove(n).isOk());  // losetup -d by someone else
  auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
  ASSERT_TRUE(l.isOk());
  EXPECT_EQ(pool->stats().free, 0u);
  EXPECT_EQ(pool->stats().attached, 1u);
}

TEST_F(LoopPoolTest, MetricsNameTheStates) {
  auto pool = open();
  ASSERT_TRUE(pool);
  auto l = pool->attach(file, LO_FLAGS_AUTOCLEAR);
  ASSERT_TRUE(l.isOk());
  cycle(*pool);
  metrics::Writer w;
  pool->writeMetrics(w);
  std::string text = w.text();
  EXPECT_NE(text.find("dsec_edge_loop_devices{state=\"attached\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("dsec_edge_loop_devices{state=\"free\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("dsec_edge_loop_devices{state=\"removing\"} 0"), std::string::npos) << text;
  EXPECT_NE(text.find("dsec_edge_loop_free_max 16"), std::string::npos) << text;
  EXPECT_NE(text.find("dsec_edge_loop_devices_created_total 2"), std::string::npos) << text;
}

TEST_F(LoopPoolTest, TheThreadRemovesRefusedDevicesOnItsOwn) {
  opts.thread = true;
  opts.maxFree = 0;
  opts.retryMinS = 0.005;
  opts.retryMaxS = 0.05;
  auto pool = open();
  ASSERT_TRUE(pool);
  int n = cycle(*pool, /*rundown=*/5);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (sys->exists(n) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    sys->tick();
  }
  EXPECT_FALSE(sys->exists(n));
  EXPECT_EQ(pool->stats().removing, 0u);
}

// ---------------------------------------------------------------------------
// The real kernel.

std::string realSkipReason() {
  if (::geteuid() != 0) return "needs root (loop devices)";
  if (::access("/dev/loop-control", W_OK) != 0) return "no /dev/loop-control";
  return {};
}

size_t hostLoopDevices() { return LoopSys::real()->list().size(); }

TEST(LoopPoolKernel, ChurnEndsWithNoMoreDevicesThanTheFreeList) {
  if (auto why = realSkipReason(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_FALSE(tmp.path.empty());
  std::string file = tmp.path + "/disk.img";
  {
    UniqueFd f(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(f.valid());
    ASSERT_EQ(::ftruncate(f.get(), 1 << 20), 0);
  }
  LoopPoolOptions o;
  o.ledger = tmp.path + "/loop-devices";
  o.maxFree = 8;
  size_t before = hostLoopDevices();
  std::set<int> used;
  {
    auto pool = LoopPool::open(o);
    ASSERT_TRUE(pool.isOk()) << pool.status().toString();
    // Waves of 12 held at once: more than the free list keeps.
    for (int wave = 0; wave < 20; ++wave) {
      std::vector<LoopLease> held;
      for (int i = 0; i < 12; ++i) {
        auto l = (*pool)->attach(file, LO_FLAGS_AUTOCLEAR | LO_FLAGS_READ_ONLY);
        ASSERT_TRUE(l.isOk()) << l.status().toString();
        used.insert(l->index);
        held.push_back(std::move(l).value());
      }
      for (auto& l : held) {
        int n = l.index;
        l.fd.reset();  // the last opener: autoclear unbinds it
        (*pool)->release(n);
      }
    }
    auto s = (*pool)->stats();
    std::printf("loop devices: host had %zu; the pool made %llu, reused %llu; %zu distinct used\n",
                before, (unsigned long long)s.created, (unsigned long long)s.reused, used.size());
    // 12 held at once, 8 kept between waves: each later wave reuses those 8.
    EXPECT_GE(s.reused, 19u * 6u) << "free devices were passed over";
    EXPECT_LE(s.created, 12u + 19u * 4u + 12u);
    // The thread removes what is over the free list once the kernel lets go.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*pool)->stats().removing > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ((*pool)->stats().removing, 0u);
    EXPECT_LE((*pool)->stats().free, 8u);
    (*pool)->close();
  }
  // Every device the pool made is gone (others on the host may come and go).
  auto now = LoopSys::real()->list();
  std::string leftover;
  for (int n : used) {
    auto it = now.find(n);
    if (it != now.end() && it->second.find(tmp.path) != std::string::npos) {
      leftover += " loop" + std::to_string(n);
    }
  }
  EXPECT_TRUE(leftover.empty()) << "still bound to our file:" << leftover;
  auto ledger = readFile(o.ledger);
  ASSERT_TRUE(ledger.isOk());
  size_t stillOwned = 0;
  {
    std::set<int> owned;
    for (auto& l : splitString(*ledger, '\n')) {
      if (l.size() > 1 && l[0] == '+') owned.insert(std::atoi(l.c_str() + 1));
      if (l.size() > 1 && l[0] == '-') owned.erase(std::atoi(l.c_str() + 1));
    }
    for (int n : owned) stillOwned += now.count(n);
  }
  EXPECT_EQ(stillOwned, 0u) << *ledger;
  std::printf("loop devices: host has %zu after close (had %zu)\n", now.size(), before);
}

}  // namespace
}  // namespace dsec::edge
