#include "image/block_ranges.h"

#include <algorithm>
#include <charconv>

namespace dsec::image {

namespace {
constexpr uint64_t kMaxBlocks = uint64_t(1) << 32;
}  // namespace

void BlockRanges::add(uint64_t start, uint64_t count) {
  if (count == 0) return;
  uint64_t end = start + count;
  // The first range that ends at or after `start` (touching counts).
  auto first = std::lower_bound(ranges_.begin(), ranges_.end(), start,
                                [](const Range& r, uint64_t s) { return r.first + r.second < s; });
  auto last = first;
  while (last != ranges_.end() && last->first <= end) {
    start = std::min(start, last->first);
    end = std::max(end, last->first + last->second);
    ++last;
  }
  first = ranges_.erase(first, last);
  ranges_.insert(first, Range{start, end - start});
}

void BlockRanges::add(const BlockRanges& other) {
  for (auto& r : other.ranges_) add(r.first, r.second);
}

bool BlockRanges::intersects(uint64_t start, uint64_t count) const {
  if (count == 0) return false;
  // The first range ending after `start`.
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), start,
                             [](uint64_t s, const Range& r) { return s < r.first + r.second; });
  return it != ranges_.end() && it->first < start + count;
}

bool BlockRanges::covers(uint64_t start, uint64_t count) const {
  if (count == 0) return true;
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), start,
                             [](uint64_t s, const Range& r) { return s < r.first + r.second; });
  return it != ranges_.end() && it->first <= start && start + count <= it->first + it->second;
}

uint64_t BlockRanges::blocks() const {
  uint64_t n = 0;
  for (auto& r : ranges_) n += r.second;
  return n;
}

std::string BlockRanges::format() const {
  std::string out;
  for (auto& r : ranges_) {
    if (!out.empty()) out += ',';
    out += std::to_string(r.first) + '+' + std::to_string(r.second);
  }
  return out;
}

Result<BlockRanges> BlockRanges::parse(std::string_view text) {
  BlockRanges out;
  if (text.empty()) return out;
  auto bad = [&](const std::string& why) {
    return invalidArg("ranges", "block ranges \"" + std::string(text.substr(0, 64)) + "\": " + why);
  };
  auto number = [](std::string_view s, uint64_t& v) {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    return ec == std::errc() && p == s.data() + s.size() && !s.empty() &&
           (s.size() == 1 || s[0] != '0');
  };
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string_view item = text.substr(pos, comma == std::string_view::npos ? text.size() - pos
                                                                              : comma - pos);
    size_t plus = item.find('+');
    uint64_t start = 0, count = 0;
    if (plus == std::string_view::npos || !number(item.substr(0, plus), start) ||
        !number(item.substr(plus + 1), count)) {
      return bad("\"" + std::string(item.substr(0, 32)) + "\" is not start+count");
    }
    if (count == 0) return bad("a range of no blocks");
    if (start >= kMaxBlocks || count > kMaxBlocks - start) return bad("past 2^32 blocks");
    if (!out.ranges_.empty()) {
      const Range& prev = out.ranges_.back();
      if (start <= prev.first + prev.second) return bad("ranges out of order or touching");
    }
    out.ranges_.push_back({start, count});
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace dsec::image
