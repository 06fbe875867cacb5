// Loop devices: attaching a file so a block filesystem can be mounted from it,
// and the bounded lifecycle of the devices an edge makes (LoopPool).
//
// Why a pool: LO_FLAGS_AUTOCLEAR only *unbinds* a device when its filesystem
// goes; the /dev/loopN itself (gendisk, queue, sysfs objects, a kernel
// worker) stays until someone calls LOOP_CTL_REMOVE. A node that held 8,000
// sandboxes kept 8,000 devices forever, and create/destroy churn grew them
// further (a just-released device still tearing down refuses a new bind, so
// another was added). The pool reuses the devices it made, keeps at most
// maxFree unbound ones, and removes the rest.
//
// Which devices the pool may remove (the rule): only devices it can
// attribute to this edge's data dir, and only while they are unbound and
// unopened. Attributed are (1) devices made with LOOP_CTL_ADD by an edge of
// this data dir in this boot, recorded in a ledger file in the data dir
// before any is handed out, and (2) devices found bound at start to a file
// under the data dir (an earlier edge's, or a sandbox being re-adopted).
// Devices that existed before (loop0..7 that boot makes, another program's)
// are never taken, bound nor removed: the pool never uses LOOP_CTL_GET_FREE.
// LOOP_CTL_REMOVE itself refuses (EBUSY) a device that is bound or open, so
// even an attributed device that another program bound meanwhile is safe;
// it is retried later. A ledger of another boot (boot_id differs) is void.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/metrics.h"
#include "common/status.h"

namespace dsec::edge {

// Attaches `file` to a free loop device with LOOP_CONFIGURE and `loFlags`
// (LO_FLAGS_READ_ONLY, LO_FLAGS_AUTOCLEAR, LO_FLAGS_DIRECT_IO...); returns the
// device path and leaves its open fd in `held`. With LO_FLAGS_AUTOCLEAR the
// kernel detaches the device once its last user (the caller's fd, a mount)
// lets go, so close `held` after mounting. The file is opened read-only when
// loFlags has LO_FLAGS_READ_ONLY, else read-write. Errors: sysError of the
// open/ioctl with its errno and path; kResourceExhausted when 64 tries found
// no device to take. Attaches within one process are serialized; a device
// that refuses (EBUSY: another process took it, or its previous filesystem
// still holds it while unmounting) is passed over for a newly added one.
// For node-wide devices only (an xfs or btrfs pool, layers where file-backed
// EROFS is refused): O(1) per node. Per-sandbox devices go through LoopPool.
Result<std::string> attachLoop(const std::string& file, uint32_t loFlags, UniqueFd& held);

// The kernel calls LoopPool makes: a seam so that tests run the pool's policy
// against a fake (like CgroupFs). real() is the kernel; implementations must be
// thread-safe. Failures are sysError()s carrying the errno.
class LoopSys {
 public:
  virtual ~LoopSys() = default;
  static std::shared_ptr<LoopSys> real();

  // LOOP_CTL_ADD of the lowest unused index: a new, unbound device.
  virtual Result<int> add() = 0;
  // LOOP_CTL_REMOVE: EBUSY while the device is bound, tearing down or open;
  // ENODEV when there is no such device.
  virtual Status remove(int index) = 0;
  // Opens /dev/loop<index> and binds `fileFd` to it (LOOP_CONFIGURE with
  // loFlags); the open device. EBUSY when it is bound (or still unbinding);
  // ENOENT or ENXIO when the device is gone.
  virtual Result<UniqueFd> configure(int index, int fileFd, uint32_t loFlags) = 0;
  // Whether the device is bound to a file now (false when gone).
  virtual bool bound(int index) = 0;
  // Every loop device that exists: index -> its backing file, "" when unbound.
  virtual std::map<int, std::string> list() = 0;
  // The loop index of block device `dev`; -1 when it is not a loop device.
  virtual int indexOf(dev_t dev) = 0;
  // This boot's id (/proc/sys/kernel/random/boot_id).
  virtual std::string bootId() = 0;
};

struct LoopPoolOptions {
  // The ledger of the devices this edge made (LOOP_CTL_ADD), in the data dir;
  // empty: none, so nothing made by an earlier run is attributed to us.
  std::string ledger;
  // Devices found bound at start to a file whose path starts with this (the
  // data dir, real path, with a trailing '/') are attributed too; empty: none.
  std::string ownedPrefix;
  // Unbound devices kept for reuse after a release; beyond, they are removed.
  size_t maxFree = 16;
  // A thread retries refused removals (EBUSY) in the background; tests turn
  // it off and call removeExcess() themselves.
  bool thread = true;
  // Backoff between removal attempts of one device (doubling).
  double retryMinS = 0.02;
  double retryMaxS = 5;
};

// A device bound for a caller: its index, path and open fd (close the fd
// once the filesystem is mounted: with autoclear the device then goes with
// the filesystem).
struct LoopLease {
  int index = -1;
  std::string path;
  UniqueFd fd;
};

// The loop devices one edge makes, reuses and removes. States of a device
// the pool owns: attached (bound for a caller, from attach() to release()),
// free (released, kept for reuse; may still be unbinding) and removing (over
// maxFree, or found at start: LOOP_CTL_REMOVE pending). Bound: owned devices
// <= attached + maxFree + removing, and removing drains to 0 once the kernel
// has let go of the released filesystems. Thread-safe: mu_ guards the state;
// attaches are serialized.
class LoopPool {
 public:
  // Loads the ledger (void when of another boot), attributes what options
  // allow, keeps up to maxFree unbound devices and queues the rest for
  // removal (removed before open returns when no thread is asked for, else
  // by the thread), and rewrites the ledger. Errors: the ledger cannot be
  // written (sysError with its path).
  static Result<std::unique_ptr<LoopPool>> open(LoopPoolOptions opts,
                                                std::shared_ptr<LoopSys> sys = LoopSys::real());
  ~LoopPool();

  // Binds `file` (opened read-only with LO_FLAGS_READ_ONLY, else read-write)
  // with `loFlags` to a device: a free one first (oldest released first),
  // then one queued for removal, then a new one (LOOP_CTL_ADD, recorded in
  // the ledger before use). Errors: sysError of open/add/configure with its
  // errno (EINVAL for flags the device refuses, such as LO_FLAGS_DIRECT_IO on
  // a file system without O_DIRECT: the caller may retry without); a device
  // tried and found gone is forgotten.
  Result<LoopLease> attach(const std::string& file, uint32_t loFlags);
  // The device's user is gone (or going: its filesystem may still be
  // unmounting). It becomes free, and the oldest free beyond maxFree is
  // queued for removal. A device the pool does not own is left alone.
  void release(int index);
  // A device an earlier edge bound that a live sandbox still uses: attached
  // from now on (released with release()). Ignored for devices not owned.
  void adopt(int index);
  // The loop index of block device `dev` (LoopSys::indexOf).
  int indexOf(dev_t dev) { return sys_->indexOf(dev); }
  // One pass over the devices queued for removal whose retry is due (all of
  // them with force): removes the unbound ones; the rest wait (backoff).
  // Returns how many remain queued. The thread calls this on its own.
  // Removals run on up to kRemoveThreads threads at once.
  size_t removeExcess(bool force = false);
  static constexpr size_t kRemoveThreads = 16;
  // Stops the thread and removes every device that is not attached (free
  // and queued), retrying refusals for up to waitS; attached ones (live
  // restore) stay in the ledger for the next edge. Idempotent.
  void close(double waitS = 3);

  struct Stats {
    size_t attached = 0, free = 0, removing = 0;
    uint64_t created = 0, removed = 0, reused = 0;
  };
  Stats stats() const;
  // dsec_edge_loop_devices{state}, dsec_edge_loop_free_max and the counters.
  void writeMetrics(metrics::Writer& w) const;

 private:
  LoopPool(LoopPoolOptions opts, std::shared_ptr<LoopSys> sys);
  Status load();
  // The *Locked helpers and appendLedger run under mu_.
  void queueRemoveLocked(int index, double due);
  void trimFreeLocked();
  void forgetLocked(int index);
  // One line ("+N" made, "-N" removed) to the ledger; compacts it now and then.
  void appendLedger(char op, int index);
  void threadLoop();

  struct Pending {
    double due = 0;
    double backoff = 0;
  };

  const LoopPoolOptions opts_;
  const std::shared_ptr<LoopSys> sys_;
  std::mutex attachMu_;    // serializes attach() (held across its kernel calls)
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::set<int> attached_;
  std::deque<int> free_;             // oldest released first
  std::map<int, Pending> removing_;  // by index
  std::set<int> inFlight_;           // being removed right now (outside mu_)
  UniqueFd ledger_;                  // O_APPEND
  uint64_t ledgerLines_ = 0;         // appended since the ledger was last written whole
  uint64_t created_ = 0, removed_ = 0, reused_ = 0;
  bool stop_ = false;
  bool closed_ = false;
  std::thread thread_;
};

}  // namespace dsec::edge
