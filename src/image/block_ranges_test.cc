#include "image/block_ranges.h"

#include <gtest/gtest.h>

namespace dsec::image {
namespace {

TEST(BlockRangesTest, AddMergesOverlappingAndTouchingRanges) {
  BlockRanges r;
  r.add(10, 5);   // 10-14
  r.add(30, 2);   // 30-31
  r.add(0, 0);    // nothing
  EXPECT_EQ(r.format(), "10+5,30+2");
  r.add(15, 3);   // touches 10-14 -> 10-17
  EXPECT_EQ(r.format(), "10+8,30+2");
  r.add(20, 10);  // touches 30 -> 20-31
  EXPECT_EQ(r.format(), "10+8,20+12");
  r.add(5, 100);  // swallows both
  EXPECT_EQ(r.format(), "5+100");
  r.add(0, 2);
  EXPECT_EQ(r.format(), "0+2,5+100");
  EXPECT_EQ(r.blocks(), 102u);
  BlockRanges s;
  s.add(2, 3);
  r.add(s);
  EXPECT_EQ(r.format(), "0+105");
}

TEST(BlockRangesTest, IntersectsAndCovers) {
  BlockRanges r;
  r.add(10, 5);  // 10-14
  r.add(32, 32);  // 32-63
  EXPECT_FALSE(r.intersects(0, 10));
  EXPECT_TRUE(r.intersects(0, 11));
  EXPECT_TRUE(r.intersects(14, 1));
  EXPECT_FALSE(r.intersects(15, 17));
  EXPECT_TRUE(r.intersects(15, 18));
  EXPECT_FALSE(r.intersects(64, 100));
  EXPECT_FALSE(r.intersects(12, 0));
  EXPECT_TRUE(r.covers(10, 5));
  EXPECT_TRUE(r.covers(40, 8));
  EXPECT_FALSE(r.covers(9, 2));
  EXPECT_FALSE(r.covers(14, 2));
  EXPECT_FALSE(r.covers(60, 8));
  EXPECT_TRUE(r.covers(100, 0));
  EXPECT_FALSE(BlockRanges().intersects(0, 1u << 31));
}

TEST(BlockRangesTest, ParseTakesWhatFormatWrites) {
  BlockRanges r;
  r.add(0, 1);
  r.add(7, 32);
  r.add(4294967295u, 1);
  auto back = BlockRanges::parse(r.format());
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(*back, r);
  auto none = BlockRanges::parse("");
  ASSERT_TRUE(none.isOk());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(none->format(), "");
}

TEST(BlockRangesTest, ParseRefusesAnythingElse) {
  for (const char* bad : {"1", "1+", "+1", "1+0", "a+1", "1+1,", ",1+1", "1+1,,3+1", "01+1",
                          "1+2,2+1", "1+2,3+1", "5+1,1+1", "4294967296+1", "4294967295+2",
                          "1 +1", "-1+1", "1+1 ", "18446744073709551615+1"}) {
    auto r = BlockRanges::parse(bad);
    EXPECT_FALSE(r.isOk()) << bad;
    if (!r.isOk()) {
      EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
    }
  }
}

}  // namespace
}  // namespace dsec::image
