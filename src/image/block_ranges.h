// A set of 4 KiB block ranges of one data blob (kFsBlockSize units): which
// parts of another layer's data blob a layer reads (its chunks deduplicated
// into that blob), and which parts of a data blob garbage collection has
// reclaimed (docs/images.md, "Deduplication across layers and images").
//
// Text form: "start+count" ranges, ascending, separated by ",", each range
// neither overlapping nor touching the next (add() merges them); "" is the
// empty set. Blocks are counted in uint64_t: a blob's addresses are uint32_t
// blocks (EROFS), so start + count never overflows.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace dsec::image {

class BlockRanges {
 public:
  using Range = std::pair<uint64_t, uint64_t>;  // start, count (> 0)

  // Adds [start, start + count); count 0 adds nothing.
  void add(uint64_t start, uint64_t count);
  void add(const BlockRanges& other);

  // Whether any block of [start, start + count) is in the set.
  bool intersects(uint64_t start, uint64_t count) const;
  // Whether every block of [start, start + count) is (count 0: true).
  bool covers(uint64_t start, uint64_t count) const;

  bool empty() const { return ranges_.empty(); }
  uint64_t blocks() const;  // the set's size in blocks
  const std::vector<Range>& ranges() const { return ranges_; }

  std::string format() const;
  // kInvalidArgument for anything but format()'s output: a bad number, a
  // count of 0, ranges out of order, overlapping or touching, or past 2^32
  // blocks.
  static Result<BlockRanges> parse(std::string_view text);

  friend bool operator==(const BlockRanges&, const BlockRanges&) = default;

 private:
  std::vector<Range> ranges_;  // ascending, disjoint, not adjacent
};

}  // namespace dsec::image
