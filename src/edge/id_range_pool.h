// Host id ranges for container sandboxes' user namespaces (issue 31): each
// sandbox maps its ids 0..width-1 to a range of host ids no other sandbox
// holds, so root in one sandbox is a different unprivileged host uid from
// root in any other, and an escape lands in ids nobody else owns.
//
// The pool hands out slots of `width` ids: slot k = [first + k*width,
// first + (k+1)*width - 1] for every k whose end is at most `last`, except the
// slots that meet an excluded range (the host's /etc/subuid and /etc/subgid
// entries: ids delegated to users, who could map them into namespaces of
// their own). It is pure, like Scheduler::pick: no locks, no clock, no I/O.
// Not thread-safe: one owner (ContainerBackend, under its rangeMu_).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace dsec::edge {

// The defaults (issue 31's survey, §3). A width of 65536 maps every id a
// distro allocates (0-65535, nobody included), and it is the only width that
// fits 10-20k sandboxes into ids no convention claims. The window is the one
// systemd reserves for container ranges (0x80000-0x6FFFFFFF, which nspawn's
// --private-users=pick hands out in 64K chunks): it stays clear of system and
// regular users (< 65536), systemd's foreign image ids at 2147352576, and
// everything >= 2^31, which some user space treats as negative. The subuids
// useradd delegates (Debian: 100000 to 600100000) do reach into it: make()
// skips the slots that /etc/subuid and /etc/subgid name. Unexcluded, the
// window holds 28,664 ranges.
inline constexpr uint32_t kDefaultUsernsWidth = 65536;
inline constexpr uint32_t kDefaultUsernsFirst = 524288;     // 0x80000
inline constexpr uint32_t kDefaultUsernsLast = 1879048191;  // 0x6FFFFFFF

// Host ids base..base+length-1, seen as 0..length-1 inside the sandbox.
struct IdRange {
  uint32_t base = 0;
  uint32_t length = 0;  // 0: none (the sandbox has no user namespace)
  bool empty() const { return length == 0; }
  bool operator==(const IdRange&) const = default;
};

// "0 B L\n": what the edge writes to a sandbox's uid_map and gid_map. "" for
// an empty range (there is nothing to map).
std::string mapLine(IdRange r);
// "B 0 L\n": the inverse, through which pack_diff sees a sandbox's upper dir
// with 0-based owners again. "" for an empty range.
std::string inverseLine(IdRange r);

class IdRangePool {
 public:
  // An empty pool (capacity 0): every allocate fails with kResourceExhausted
  // and reserve counts every valid range as foreign. It exists so an owner can
  // hold a pool by value before make(); build real ones with make().
  IdRangePool() = default;

  // A pool of the slots of `width` ids in first..last that meet none of the
  // `excluded` ranges (empty ones are ignored; one running past 2^32-1 is
  // taken to end there). Errors (kInvalidArgument, the field named):
  //   "userns-width"  width is not a positive multiple of 65536 (every slot
  //                   must map all the ids a distro uses, 0-65535)
  //   "userns-window" first is 0 (host root), last is 0xffffffff ((uid_t)-1),
  //                   last < first, or no slot fits: "no range of W ids fits
  //                   in F-L" when the window is narrower than W, and with
  //                   " outside /etc/subuid and /etc/subgid" appended when
  //                   the exclusions removed every slot
  static Result<IdRangePool> make(uint32_t first, uint32_t last, uint32_t width,
                                  std::vector<IdRange> excluded);

  // A free slot, marked in use. Slots never handed out or reserved since
  // make() come first, lowest first; then the released ones, the one released
  // longest ago first (FIFO), so a range is reused as late as possible.
  // kResourceExhausted "all N user id ranges (W ids in F-L) are in use" when
  // no slot is free.
  Result<IdRange> allocate();

  // Re-adoption: marks the ids of a sandbox that already runs (its state file
  // holds `r`) as in use, so that they are never handed out to another one.
  // - An exact slot is the normal case: that slot is in use.
  // - Any other range that meets the window (one from an edge run with
  //   another width or window) marks every slot it meets in use, so none of
  //   them is allocated until it is released. Several such ranges may share a
  //   slot as long as their ids are disjoint: after a width change, the old
  //   ranges of two sandboxes often fall into one new slot.
  // - A range wholly outside first..last is foreign (an older edge's
  //   node-wide 100000/65536, which all its sandboxes shared): it may be
  //   reserved any number of times, is never allocatable anyway, and is not
  //   counted in inUse(); its reservations are counted for release().
  // Errors (on error nothing is marked):
  //   kInvalidArgument r is empty, has base 0 (host root), reaches 2^32-1
  //                    ((uid_t)-1: base + length > 2^32-1), or, in the
  //                    window, meets an excluded range (the ids were
  //                    delegated to a host user since the sandbox started).
  //                    A foreign range may meet one: it is never handed out
  //                    here (an older edge's 100000/65536 on Debian, whose
  //                    first subuid range it is).
  //   kAlreadyExists   some of r's ids are already in use: the slot was
  //                    allocated or reserved, or r overlaps another reserved
  //                    range that is not a slot. Never for a foreign range.
  Status reserve(IdRange r);

  // Frees what allocate() returned or reserve() marked, given the same range:
  // the slots go to the back of the FIFO. A foreign range drops one of its
  // reservations. kNotFound when r is not in use as such (a double release,
  // or a range that was never handed out in that shape): the caller logs it,
  // and nothing changes.
  Status release(IdRange r);

  size_t capacity() const { return capacity_; }  // slots clear of the exclusions
  size_t inUse() const { return inUse_; }        // allocated or reserved slots (not foreign)
  uint32_t width() const { return width_; }
  uint32_t first() const { return first_; }
  uint32_t last() const { return last_; }

 private:
  // One byte per slot: at most 65535 slots (2^32 / 65536), so at most 64 KiB.
  enum class Slot : uint8_t {
    kFresh,      // free, never used: nextFresh_ hands it out
    kQueued,     // free, in released_
    kAllocated,  // in use as a whole: allocate(), or reserve() of exactly it
    kPartial,    // in use: met by one or more ranges in reserved_
    kExcluded,   // meets an excluded range: never used
  };

  uint64_t slotBase(size_t k) const { return uint64_t(first_) + uint64_t(k) * width_; }
  // Whether host ids lo..hi (inclusive) meet an excluded range.
  bool meetsExcluded(uint64_t lo, uint64_t hi) const;
  // Whether lo..hi meets a range in reserved_.
  bool meetsReserved(uint64_t lo, uint64_t hi) const;
  // The slots lo..hi meets, as [begin, end) indices (empty if none).
  std::pair<size_t, size_t> slotsMet(uint64_t lo, uint64_t hi) const;
  // Marks the free slots among [b, e) `to` (in use), taking queued ones out of
  // released_; slots in use or excluded stay as they are.
  void takeSlots(size_t b, size_t e, Slot to);
  // Frees an in-use slot: to the back of released_.
  void freeSlot(size_t k);

  uint32_t first_ = 0;
  uint32_t last_ = 0;
  uint32_t width_ = 0;
  std::vector<Slot> slots_;
  size_t capacity_ = 0;
  size_t inUse_ = 0;
  size_t nextFresh_ = 0;           // no kFresh slot lies below it
  std::deque<uint32_t> released_;  // kQueued slots, released longest ago first
  // The excluded ids, merged and sorted: [lo, hi] inclusive.
  std::vector<std::pair<uint64_t, uint64_t>> excluded_;
  // Reserved ranges that meet the window but are not one slot: base -> length.
  // Disjoint, so a lookup by base finds any overlap.
  std::map<uint32_t, uint32_t> reserved_;
  // Foreign ranges: (base, length) -> reservations.
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> foreign_;
};

// The "user:first:count" lines of /etc/subuid or /etc/subgid as ranges (the
// user may be a name or a numeric uid). Pure; the caller reads the files (a
// missing file: no ranges). Skipped: blank lines, '#' comments, lines without
// exactly three fields, an empty user, a first or count that is not a
// decimal number, a count of 0, and a first beyond 2^32-1 (no such host id).
// A range that runs past 2^32-1 is cut there rather than dropped: newuidmap
// would still let its user map the ids below, so they stay excluded.
// Spaces and tabs around the fields and a trailing '\r' are ignored.
std::vector<IdRange> parseSubordinateIds(std::string_view text);

}  // namespace dsec::edge
