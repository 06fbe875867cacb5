#include "edge/id_range_pool.h"

#include <algorithm>

namespace dsec::edge {

namespace {

// Widths come in whole 64K blocks: each slot then maps every id a distro
// allocates (0-65535), and slots line up with nspawn's 64K chunks.
constexpr uint32_t kWidthUnit = 65536;
constexpr uint64_t kNoId = 0xffffffffu;  // (uid_t)-1: never a real id

// The last id of r, in 64 bits so that a range running past 2^32-1 shows.
uint64_t lastId(IdRange r) { return uint64_t(r.base) + r.length - 1; }

std::string ids(uint64_t lo, uint64_t hi) { return std::to_string(lo) + "-" + std::to_string(hi); }

std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r";
  size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  size_t e = s.find_last_not_of(kSpace);
  return s.substr(b, e - b + 1);
}

// A decimal number (digits only), saturated above 2^33 so that nothing
// overflows: callers only need to tell "too big" apart. False if not one.
bool parseDecimal(std::string_view s, uint64_t* out) {
  constexpr uint64_t kCap = uint64_t(1) << 33;
  if (s.empty()) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = std::min(v * 10 + uint64_t(c - '0'), kCap);
  }
  *out = v;
  return true;
}

}  // namespace

std::string mapLine(IdRange r) {
  if (r.empty()) return "";
  return "0 " + std::to_string(r.base) + " " + std::to_string(r.length) + "\n";
}

std::string inverseLine(IdRange r) {
  if (r.empty()) return "";
  return std::to_string(r.base) + " 0 " + std::to_string(r.length) + "\n";
}

Result<IdRangePool> IdRangePool::make(uint32_t first, uint32_t last, uint32_t width,
                                      std::vector<IdRange> excluded) {
  if (width == 0 || width % kWidthUnit != 0) {
    return invalidArg(
        "userns-width",
        "the userns width must be a positive multiple of 65536, not " + std::to_string(width));
  }
  if (first == 0) {
    return invalidArg("userns-window",
                      "the userns window " + ids(first, last) + " must not hold host id 0 (root)");
  }
  if (last == kNoId) {
    return invalidArg("userns-window", "the userns window " + ids(first, last) +
                                           " must end below 4294967295 ((uid_t)-1)");
  }
  if (last < first) {
    return invalidArg("userns-window",
                      "the userns window " + ids(first, last) + " ends before it starts");
  }
  IdRangePool p;
  p.first_ = first;
  p.last_ = last;
  p.width_ = width;
  // At most (2^32 - 2) / 65536 < 65536 slots.
  p.slots_.assign((uint64_t(last) - first + 1) / width, Slot::kFresh);

  for (IdRange r : excluded) {
    if (!r.empty()) p.excluded_.emplace_back(r.base, std::min(lastId(r), kNoId));
  }
  std::sort(p.excluded_.begin(), p.excluded_.end());
  // Merged, so that meetsExcluded is one binary search and marking the slots
  // below visits each at most a few times however the exclusions overlap.
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (auto [lo, hi] : p.excluded_) {
    if (!merged.empty() && lo <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, hi);
    } else {
      merged.emplace_back(lo, hi);
    }
  }
  p.excluded_ = std::move(merged);
  for (auto [lo, hi] : p.excluded_) {
    auto [b, e] = p.slotsMet(lo, hi);
    for (size_t k = b; k < e; ++k) p.slots_[k] = Slot::kExcluded;
  }
  p.capacity_ = size_t(std::count(p.slots_.begin(), p.slots_.end(), Slot::kFresh));
  if (p.capacity_ == 0) {
    std::string why = "no range of " + std::to_string(width) + " ids fits in " + ids(first, last);
    if (!p.slots_.empty()) why += " outside /etc/subuid and /etc/subgid";
    return invalidArg("userns-window", why);
  }
  return p;
}

bool IdRangePool::meetsExcluded(uint64_t lo, uint64_t hi) const {
  // The first merged range that ends at or after lo is the only candidate.
  auto it = std::lower_bound(excluded_.begin(), excluded_.end(), lo,
                             [](const auto& ex, uint64_t id) { return ex.second < id; });
  return it != excluded_.end() && it->first <= hi;
}

bool IdRangePool::meetsReserved(uint64_t lo, uint64_t hi) const {
  // reserved_ is disjoint, so the last range starting at or before hi is
  // the one that reaches furthest up among those that could meet lo..hi.
  auto it = reserved_.upper_bound(uint32_t(std::min(hi, kNoId)));
  if (it == reserved_.begin()) return false;
  --it;
  return lastId({it->first, it->second}) >= lo;
}

std::pair<size_t, size_t> IdRangePool::slotsMet(uint64_t lo, uint64_t hi) const {
  if (slots_.empty()) return {0, 0};
  uint64_t end = slotBase(slots_.size()) - 1;  // the last id of the last slot
  if (hi < first_ || lo > end) return {0, 0};
  size_t b = size_t((std::max<uint64_t>(lo, first_) - first_) / width_);
  size_t e = size_t((std::min(hi, end) - first_) / width_) + 1;
  return {b, e};
}

void IdRangePool::takeSlots(size_t b, size_t e, Slot to) {
  bool queued = false;
  for (size_t k = b; k < e; ++k) {
    if (slots_[k] != Slot::kFresh && slots_[k] != Slot::kQueued) continue;
    queued = queued || slots_[k] == Slot::kQueued;
    slots_[k] = to;
    ++inUse_;
  }
  // One pass however many slots left the queue. Only adoption gets here, and
  // edges adopt before they release anything, so it is rare anyway.
  if (queued) std::erase_if(released_, [&](uint32_t k) { return slots_[k] != Slot::kQueued; });
}

void IdRangePool::freeSlot(size_t k) {
  slots_[k] = Slot::kQueued;
  released_.push_back(uint32_t(k));
  --inUse_;
}

Result<IdRange> IdRangePool::allocate() {
  while (nextFresh_ < slots_.size() && slots_[nextFresh_] != Slot::kFresh) ++nextFresh_;
  size_t k;
  if (nextFresh_ < slots_.size()) {
    k = nextFresh_++;
  } else if (!released_.empty()) {
    k = released_.front();
    released_.pop_front();
  } else {
    return Status(Code::kResourceExhausted, "all " + std::to_string(capacity_) +
                                                " user id ranges (" + std::to_string(width_) +
                                                " ids in " + ids(first_, last_) + ") are in use");
  }
  slots_[k] = Slot::kAllocated;
  ++inUse_;
  return IdRange{uint32_t(slotBase(k)), width_};
}

Status IdRangePool::reserve(IdRange r) {
  if (r.empty()) return Status(Code::kInvalidArgument, "empty user id range");
  uint64_t lo = r.base;
  uint64_t hi = lastId(r);
  if (lo == 0) {
    return Status(Code::kInvalidArgument, "host ids " + ids(lo, hi) + " hold host root (0)");
  }
  if (hi >= kNoId) {
    return Status(Code::kInvalidArgument,
                  "host ids " + ids(lo, hi) + " reach 4294967295 ((uid_t)-1)");
  }
  if (hi < first_ || lo > last_) {
    // Never handed out here, so an exclusion does not matter: an older
    // edge's sandboxes on Debian's first subuid range (100000) live on.
    ++foreign_[{r.base, r.length}];
    return Status::ok();
  }
  if (meetsExcluded(lo, hi)) {
    return Status(Code::kInvalidArgument,
                  "host ids " + ids(lo, hi) + " meet /etc/subuid or /etc/subgid");
  }
  Status taken(Code::kAlreadyExists, "host ids " + ids(lo, hi) + " are already in use");
  auto [b, e] = slotsMet(lo, hi);
  if (r.length == width_ && e == b + 1 && slotBase(b) == lo) {
    if (slots_[b] != Slot::kFresh && slots_[b] != Slot::kQueued) return taken;
    takeSlots(b, e, Slot::kAllocated);
    return Status::ok();
  }
  // Not one slot: a range from a run with another width or window. Only ids
  // that really overlap conflict; the slots it meets just stop being free.
  if (meetsReserved(lo, hi)) return taken;
  for (size_t k = b; k < e; ++k) {
    if (slots_[k] == Slot::kAllocated) return taken;
  }
  reserved_.emplace(r.base, r.length);
  takeSlots(b, e, Slot::kPartial);
  return Status::ok();
}

Status IdRangePool::release(IdRange r) {
  uint64_t lo = r.base;
  uint64_t hi = lastId(r);
  Status unknown(Code::kNotFound,
                 r.empty() ? "empty user id range" : "host ids " + ids(lo, hi) + " are not in use");
  if (r.empty()) return unknown;
  if (hi < first_ || lo > last_) {
    auto it = foreign_.find({r.base, r.length});
    if (it == foreign_.end()) return unknown;
    if (--it->second == 0) foreign_.erase(it);
    return Status::ok();
  }
  auto [b, e] = slotsMet(lo, hi);
  if (r.length == width_ && e == b + 1 && slotBase(b) == lo) {
    if (slots_[b] != Slot::kAllocated) return unknown;
    freeSlot(b);
    return Status::ok();
  }
  auto it = reserved_.find(r.base);
  if (it == reserved_.end() || it->second != r.length) return unknown;
  reserved_.erase(it);
  for (size_t k = b; k < e; ++k) {
    if (slots_[k] != Slot::kPartial) continue;
    uint64_t base = slotBase(k);
    if (!meetsReserved(base, base + width_ - 1)) freeSlot(k);
  }
  return Status::ok();
}

std::vector<IdRange> parseSubordinateIds(std::string_view text) {
  std::vector<IdRange> out;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = trim(text.substr(0, nl));
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (line.empty() || line.front() == '#') continue;
    size_t c1 = line.find(':');
    size_t c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos || line.find(':', c2 + 1) != std::string_view::npos) {
      continue;
    }
    uint64_t first = 0;
    uint64_t count = 0;
    if (trim(line.substr(0, c1)).empty() ||
        !parseDecimal(trim(line.substr(c1 + 1, c2 - c1 - 1)), &first) ||
        !parseDecimal(trim(line.substr(c2 + 1)), &count)) {
      continue;
    }
    if (count == 0 || first > kNoId) continue;
    // Cut at 2^32: a range from 0 would be 2^32 ids long, one more than a
    // length holds, and that last one is (uid_t)-1, which no slot holds.
    uint64_t length = std::min({count, (kNoId + 1) - first, kNoId});
    out.push_back({uint32_t(first), uint32_t(length)});
  }
  return out;
}

}  // namespace dsec::edge
