#include "edge/loop_device.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/util.h"

namespace dsec::edge {

namespace {

// This process's attaches go one at a time: without it, N threads asking
// LOOP_CTL_GET_FREE together all get the same device and N-1 lose the race.
std::mutex attachMu;

constexpr int kAttempts = 64;

// attach(): devices queued for removal tried at most (each costs an open
// and an ioctl) before a new one is added.
constexpr size_t kRemovingTries = 8;
// attach(): new devices tried at most when other processes keep binding
// the ones we add before we do.
constexpr int kAddTries = 8;
// How long attach waits for a device released moments ago to unbind
// before it adds one.
constexpr double kWaitForUnbindS = 0.2;
// The ledger is rewritten (compacted) once this many lines were appended.
constexpr uint64_t kLedgerCompactLines = 1 << 16;

// "loop12" -> 12; -1 for anything else ("loop12p1", "loopx", "sda").
int parseLoopName(std::string_view name) {
  if (name.substr(0, 4) != "loop" || name.size() == 4 || name.size() > 14) return -1;
  long n = 0;
  for (char c : name.substr(4)) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n > INT_MAX ? -1 : int(n);
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

class RealLoopSys : public LoopSys {
 public:
  Result<int> add() override {
    UniqueFd ctl;
    RETURN_IF_ERROR(control(ctl));
    int n = ::ioctl(ctl.get(), LOOP_CTL_ADD, -1);
    if (n < 0) return sysError("LOOP_CTL_ADD");
    return n;
  }
  Status remove(int index) override {
    UniqueFd ctl;
    RETURN_IF_ERROR(control(ctl));
    if (::ioctl(ctl.get(), LOOP_CTL_REMOVE, index) < 0) {
      return sysError("LOOP_CTL_REMOVE loop" + std::to_string(index));
    }
    return Status::ok();
  }
  Result<UniqueFd> configure(int index, int fileFd, uint32_t loFlags) override {
    std::string dev = "/dev/loop" + std::to_string(index);
    UniqueFd loop(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
    if (!loop) return sysError("open " + dev);
    loop_config cfg{};
    cfg.fd = uint32_t(fileFd);
    cfg.info.lo_flags = loFlags;
    if (::ioctl(loop.get(), LOOP_CONFIGURE, &cfg) != 0) return sysError("LOOP_CONFIGURE " + dev);
    return loop;
  }
  bool bound(int index) override {
    // The "loop" attributes exist from LOOP_CONFIGURE until the device is
    // unbound again (also while autoclear tears it down).
    struct stat st;
    std::string p = "/sys/block/loop" + std::to_string(index) + "/loop/backing_file";
    return ::stat(p.c_str(), &st) == 0;
  }
  std::map<int, std::string> list() override {
    std::map<int, std::string> out;
    DIR* d = ::opendir("/sys/block");
    if (!d) return out;
    while (auto* e = ::readdir(d)) {
      int n = parseLoopName(e->d_name);
      if (n < 0) continue;
      auto backing = readFile(std::string("/sys/block/") + e->d_name + "/loop/backing_file");
      out[n] = backing.isOk() ? trimmed(*backing) : "";
    }
    ::closedir(d);
    return out;
  }
  int indexOf(dev_t dev) override {
    // /sys/dev/block/MAJ:MIN -> ../../devices/virtual/block/loopN; by name,
    // so the loop driver's minors per device (max_part) do not matter.
    std::string link =
        "/sys/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
    char buf[PATH_MAX];
    ssize_t n = ::readlink(link.c_str(), buf, sizeof buf - 1);
    if (n <= 0) return -1;
    std::string_view target(buf, size_t(n));
    auto slash = target.rfind('/');
    return parseLoopName(slash == std::string_view::npos ? target : target.substr(slash + 1));
  }
  std::string bootId() override {
    auto id = readFile("/proc/sys/kernel/random/boot_id");
    return id.isOk() ? trimmed(*id) : "";
  }

 private:
  static Status control(UniqueFd& ctl) {
    ctl.reset(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
    if (!ctl) return sysError("open /dev/loop-control");
    return Status::ok();
  }
};

}  // namespace

std::shared_ptr<LoopSys> LoopSys::real() {
  static auto sys = std::make_shared<RealLoopSys>();
  return sys;
}

Result<std::string> attachLoop(const std::string& file, uint32_t loFlags, UniqueFd& held) {
  UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl) return sysError("open /dev/loop-control");
  bool ro = (loFlags & LO_FLAGS_READ_ONLY) != 0;
  UniqueFd f(::open(file.c_str(), (ro ? O_RDONLY : O_RDWR) | O_CLOEXEC));
  if (!f) return sysError("open " + file);
  std::lock_guard lk(attachMu);
  bool refused = false;  // a device refused us: take new ones from here on
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    // A device that was just auto-cleared is "free" while its last holder
    // (an unmounting filesystem) still has it claimed, and the kernel hands
    // out the lowest free number: asking again would give that same device.
    // After a refusal, take a brand-new device instead.
    int n = refused ? ::ioctl(ctl.get(), LOOP_CTL_ADD, -1) : ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
    if (n < 0 && refused && errno != EBUSY && errno != EEXIST) {
      n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);  // no more minors: back to reuse
    }
    if (n < 0) {
      if (errno == EBUSY || errno == EEXIST) continue;
      return sysError("LOOP_CTL_GET_FREE");
    }
    std::string dev = "/dev/loop" + std::to_string(n);
    UniqueFd loop(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
    if (!loop) {
      // Removed by another process between its number and our open.
      if (errno == ENOENT || errno == ENXIO) continue;
      return sysError("open " + dev);
    }
    loop_config cfg{};
    cfg.fd = uint32_t(f.get());
    cfg.info.lo_flags = loFlags;
    if (::ioctl(loop.get(), LOOP_CONFIGURE, &cfg) != 0) {
      if (errno != EBUSY) return sysError("LOOP_CONFIGURE " + dev);
      // Raced with another process, or the device is still being let go.
      refused = true;
      if (attempt >= 8) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    held = std::move(loop);
    return dev;
  }
  return Status(Code::kResourceExhausted, "no free loop device");
}

// ---------------------------------------------------------------------------
// LoopPool

LoopPool::LoopPool(LoopPoolOptions opts, std::shared_ptr<LoopSys> sys)
    : opts_(std::move(opts)), sys_(std::move(sys)) {}

Result<std::unique_ptr<LoopPool>> LoopPool::open(LoopPoolOptions opts,
                                                 std::shared_ptr<LoopSys> sys) {
  std::unique_ptr<LoopPool> p(new LoopPool(std::move(opts), std::move(sys)));
  RETURN_IF_ERROR(p->load());
  if (p->opts_.thread) {
    p->thread_ = std::thread([raw = p.get()] { raw->threadLoop(); });
  } else {
    p->removeExcess(true);
  }
  return p;
}

LoopPool::~LoopPool() { close(); }

Status LoopPool::load() {
  const std::string boot = sys_->bootId();
  std::set<int> owned;
  if (!opts_.ledger.empty()) {
    auto text = readFile(opts_.ledger);
    if (text.isOk()) {
      auto lines = splitString(*text, '\n');
      // The first line names the boot: devices of another boot are gone (or
      // are someone else's now that the numbers were handed out again).
      if (!lines.empty() && lines[0] == "boot " + boot && !boot.empty()) {
        for (size_t i = 1; i < lines.size(); ++i) {
          const std::string& l = lines[i];
          if (l.size() < 2 || (l[0] != '+' && l[0] != '-')) continue;
          int n = parseLoopName("loop" + l.substr(1));
          if (n < 0) continue;
          if (l[0] == '+') {
            owned.insert(n);
          } else {
            owned.erase(n);
          }
        }
      } else if (!lines.empty() && !lines[0].empty()) {
        log::info("loop devices: " + opts_.ledger + " is of another boot; nothing to trim");
      }
    }
  }
  auto devices = sys_->list();
  for (auto it = owned.begin(); it != owned.end();) {
    it = devices.count(*it) ? std::next(it) : owned.erase(it);
  }
  if (!opts_.ownedPrefix.empty()) {
    for (auto& [n, backing] : devices) {
      if (!backing.empty() && startsWith(backing, opts_.ownedPrefix)) owned.insert(n);
    }
  }
  size_t unbound = 0, bound = 0, kept = 0;
  {
    std::lock_guard lk(mu_);
    for (int n : owned) {
      if (devices[n].empty() && free_.size() < opts_.maxFree) {
        free_.push_back(n);
        ++unbound;
        continue;
      }
      // Beyond the free list, or bound (a re-adopted sandbox's: adopt() takes
      // it; else its filesystem is going away): removed once unbound.
      if (devices[n].empty()) {
        ++unbound;
      } else {
        ++bound;
      }
      removing_[n] = Pending{0, opts_.retryMinS};
    }
    kept = free_.size();
  }
  if (!owned.empty()) {
    log::info("loop devices: " + std::to_string(owned.size()) + " of an earlier edge here (" +
              std::to_string(unbound) + " unbound, " + std::to_string(bound) + " bound); keeping " +
              std::to_string(kept) + " for reuse, removing the rest once unbound");
  }
  if (opts_.ledger.empty()) return Status::ok();
  std::string text = "boot " + boot + "\n";
  for (int n : owned) text += "+" + std::to_string(n) + "\n";
  RETURN_IF_ERROR(writeFileAtomic(opts_.ledger, text, 0600));
  ledger_.reset(::open(opts_.ledger.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
  if (!ledger_) return sysError("open " + opts_.ledger);
  return Status::ok();
}

void LoopPool::appendLedger(char op, int index) {
  if (!ledger_) return;
  std::string line = op + std::to_string(index) + "\n";
  if (::write(ledger_.get(), line.data(), line.size()) != ssize_t(line.size())) {
    log::warn("loop devices: append to " + opts_.ledger + ": " + std::strerror(errno));
  }
  if (++ledgerLines_ < kLedgerCompactLines) return;
  // Compact: what we own now (attached, free, queued) under this boot.
  std::set<int> owned(attached_.begin(), attached_.end());
  owned.insert(free_.begin(), free_.end());
  for (auto& [n, p] : removing_) owned.insert(n);
  owned.insert(inFlight_.begin(), inFlight_.end());
  if (op == '-') owned.erase(index);  // being removed right now
  std::string text = "boot " + sys_->bootId() + "\n";
  for (int n : owned) text += "+" + std::to_string(n) + "\n";
  if (Status st = writeFileAtomic(opts_.ledger, text, 0600); !st.isOk()) {
    log::warn("loop devices: compact " + opts_.ledger + ": " + st.toString());
    return;
  }
  ledger_.reset(::open(opts_.ledger.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
  ledgerLines_ = 0;
}

void LoopPool::forgetLocked(int index) {
  attached_.erase(index);
  removing_.erase(index);
  free_.erase(std::remove(free_.begin(), free_.end(), index), free_.end());
  appendLedger('-', index);
}

void LoopPool::queueRemoveLocked(int index, double due) {
  removing_[index] = Pending{due, opts_.retryMinS};
  cv_.notify_all();
}

void LoopPool::trimFreeLocked() {
  // The oldest released goes first: it is the most likely to be unbound by now.
  while (free_.size() > opts_.maxFree) {
    int n = free_.front();
    free_.pop_front();
    queueRemoveLocked(n, monoSeconds());
  }
}

Result<LoopLease> LoopPool::attach(const std::string& file, uint32_t loFlags) {
  bool ro = (loFlags & LO_FLAGS_READ_ONLY) != 0;
  UniqueFd f(::open(file.c_str(), (ro ? O_RDONLY : O_RDWR) | O_CLOEXEC));
  if (!f) return sysError("open " + file);
  std::lock_guard serial(attachMu_);
  auto lease = [&](int n, UniqueFd fd) {
    LoopLease l;
    l.index = n;
    l.path = "/dev/loop" + std::to_string(n);
    l.fd = std::move(fd);
    return l;
  };
  // Reuse first: free devices (oldest released first), then a few queued
  // for removal. A device still unbinding refuses (EBUSY) and is passed over.
  std::set<int> tried;
  size_t fromRemoving = 0;
  // A device released moments ago may still be unbinding (a detached disk's
  // filesystem goes only when the dead sandbox's overlay does): rather than
  // add a device for every create of a burst, wait a little for one.
  const double waitUntil = monoSeconds() + kWaitForUnbindS;
  bool busySeen = false;
  for (;;) {
    int n = -1;
    bool wasRemoving = false;
    {
      std::lock_guard lk(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (!tried.count(*it)) {
          n = *it;
          free_.erase(it);
          break;
        }
      }
      if (n < 0 && fromRemoving < kRemovingTries) {
        for (auto it = removing_.begin(); it != removing_.end(); ++it) {
          if (!tried.count(it->first) && !inFlight_.count(it->first)) {
            n = it->first;
            removing_.erase(it);
            wasRemoving = true;
            ++fromRemoving;
            break;
          }
        }
      }
    }
    if (n < 0) {
      if (busySeen && monoSeconds() < waitUntil) {
        busySeen = false;
        tried.clear();
        fromRemoving = 0;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      break;
    }
    tried.insert(n);
    auto dev = sys_->configure(n, f.get(), loFlags);
    std::lock_guard lk(mu_);
    if (dev.isOk()) {
      attached_.insert(n);
      ++reused_;
      return lease(n, std::move(dev).value());
    }
    int err = dev.status().sysErrno();
    if (err == ENOENT || err == ENXIO || err == ENODEV) {
      forgetLocked(n);  // removed by someone else meanwhile
      continue;
    }
    if (wasRemoving) {
      queueRemoveLocked(n, monoSeconds() + opts_.retryMinS);
    } else {
      free_.push_back(n);
    }
    if (err != EBUSY) return std::move(dev).takeStatus();
    busySeen = true;
  }
  // None to reuse: a new device, recorded before it is used.
  for (int attempt = 0; attempt < kAddTries; ++attempt) {
    auto n = sys_->add();
    if (!n.isOk()) return std::move(n).takeStatus();
    {
      std::lock_guard lk(mu_);
      appendLedger('+', *n);
      ++created_;
    }
    auto dev = sys_->configure(*n, f.get(), loFlags);
    std::lock_guard lk(mu_);
    if (dev.isOk()) {
      attached_.insert(*n);
      return lease(*n, std::move(dev).value());
    }
    int err = dev.status().sysErrno();
    if (err == ENOENT || err == ENXIO || err == ENODEV) {
      forgetLocked(*n);  // removed by another process before we bound it
      continue;
    }
    free_.push_back(*n);  // ours and unbound: reused or trimmed later
    trimFreeLocked();
    // EBUSY: another process bound the new device before we did.
    if (err != EBUSY) return std::move(dev).takeStatus();
    busySeen = true;
  }
  return Status(Code::kResourceExhausted, "no loop device could be bound to " + file);
}

void LoopPool::release(int index) {
  std::lock_guard lk(mu_);
  if (attached_.erase(index)) {
    free_.push_back(index);
    trimFreeLocked();
    return;
  }
  // Found at start (an earlier edge's sandbox): try its removal now.
  if (auto it = removing_.find(index); it != removing_.end()) {
    it->second.due = 0;
    cv_.notify_all();
  }
}

void LoopPool::adopt(int index) {
  std::lock_guard lk(mu_);
  if (removing_.erase(index)) {
    attached_.insert(index);
    return;
  }
  auto it = std::find(free_.begin(), free_.end(), index);
  if (it != free_.end()) {
    free_.erase(it);
    attached_.insert(index);
  }
}

size_t LoopPool::removeExcess(bool force) {
  std::vector<int> due;
  {
    std::lock_guard lk(mu_);
    double now = monoSeconds();
    for (auto& [n, p] : removing_) {
      if (!inFlight_.count(n) && (force || p.due <= now)) {
        due.push_back(n);
        inFlight_.insert(n);
      }
    }
  }
  // LOOP_CTL_REMOVE waits for RCU grace periods (~50 ms each here), outside
  // the kernel's loop_ctl_mutex: one thread removes ~20 devices a second,
  // sixteen ~400 (64: ~1,400), which is what a mass destroy needs.
  auto removeOne = [this](int n) {
    bool gone = false, removed = false;
    // A bound device (still unbinding, or re-adopted) waits: no ledger churn.
    if (!sys_->bound(n)) {
      // Struck from the ledger first: a crash between the two leaves the
      // device unattributed (kept), never a foreign one attributed.
      {
        std::lock_guard lk(mu_);
        appendLedger('-', n);
      }
      Status st = sys_->remove(n);
      int err = st.sysErrno();
      gone = st.isOk() || err == ENODEV || err == ENOENT;
      removed = st.isOk();
      if (!gone) {
        if (err != EBUSY) log::warn("loop devices: " + st.toString());
        std::lock_guard lk(mu_);
        appendLedger('+', n);
      }
    }
    std::lock_guard lk(mu_);
    inFlight_.erase(n);
    auto it = removing_.find(n);
    if (gone) {
      if (removed) ++removed_;
      if (it != removing_.end()) removing_.erase(it);
      return;
    }
    if (it == removing_.end()) return;  // adopted meanwhile
    Pending& p = it->second;
    p.backoff = std::min(opts_.retryMaxS, std::max(opts_.retryMinS, p.backoff * 2));
    p.due = monoSeconds() + p.backoff;
  };
  size_t workers = std::min(due.size(), kRemoveThreads);
  if (workers <= 1) {
    for (int n : due) removeOne(n);
  } else {
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (size_t i = 0; i < workers; ++i) {
      threads.emplace_back([&] {
        for (size_t k; (k = next.fetch_add(1)) < due.size();) removeOne(due[k]);
      });
    }
    for (auto& t : threads) t.join();
  }
  std::lock_guard lk(mu_);
  return removing_.size();
}

void LoopPool::threadLoop() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    double next = -1;
    for (auto& [n, p] : removing_) {
      if (!inFlight_.count(n) && (next < 0 || p.due < next)) next = p.due;
    }
    if (next < 0) {
      cv_.wait(lk);
      continue;
    }
    double now = monoSeconds();
    if (next > now) {
      cv_.wait_for(lk, std::chrono::duration<double>(next - now));
      continue;
    }
    lk.unlock();
    removeExcess(false);
    lk.lock();
  }
}

void LoopPool::close(double waitS) {
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard lk(mu_);
    for (int n : free_) removing_[n] = Pending{0, opts_.retryMinS};
    free_.clear();
  }
  // Released filesystems may still be letting go of their devices: a short
  // wait (longer after a mass destroy: a second per 500 queued, up to 30 s),
  // then what remains stays in the ledger for the next edge of this data dir.
  size_t queued;
  {
    std::lock_guard lk(mu_);
    queued = removing_.size();
  }
  double deadline = monoSeconds() + std::min(30.0, waitS + double(queued) / 500);
  while (removeExcess(true) > 0 && monoSeconds() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::lock_guard lk(mu_);
  if (!removing_.empty() || !attached_.empty()) {
    log::info("loop devices: " + std::to_string(attached_.size()) + " attached and " +
              std::to_string(removing_.size()) + " not yet removable left for the next edge");
  }
  ledger_.reset();
}

LoopPool::Stats LoopPool::stats() const {
  std::lock_guard lk(mu_);
  Stats s;
  s.attached = attached_.size();
  s.free = free_.size();
  s.removing = removing_.size();
  s.created = created_;
  s.removed = removed_;
  s.reused = reused_;
  return s;
}

void LoopPool::writeMetrics(metrics::Writer& w) const {
  Stats s = stats();
  const char* help =
      "Loop devices this edge made and holds, by state (attached: bound for a sandbox's disk or "
      "a spare; free: unbound, kept for reuse; removing: beyond the free list, waiting for "
      "LOOP_CTL_REMOVE).";
  w.gauge("dsec_edge_loop_devices", help, double(s.attached), {{"state", "attached"}});
  w.gauge("dsec_edge_loop_devices", help, double(s.free), {{"state", "free"}});
  w.gauge("dsec_edge_loop_devices", help, double(s.removing), {{"state", "removing"}});
  w.gauge("dsec_edge_loop_free_max", "Unbound loop devices the edge keeps for reuse at most.",
          double(opts_.maxFree));
  w.counter("dsec_edge_loop_devices_created_total", "Loop devices the edge added (LOOP_CTL_ADD).",
            double(s.created));
  w.counter("dsec_edge_loop_devices_removed_total",
            "Loop devices the edge removed (LOOP_CTL_REMOVE).", double(s.removed));
  w.counter("dsec_edge_loop_devices_reused_total",
            "Binds that reused a device the edge had made instead of adding one.",
            double(s.reused));
}

}  // namespace dsec::edge
