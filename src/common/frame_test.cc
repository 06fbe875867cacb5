#include "common/frame.h"

#include <gtest/gtest.h>

namespace dsec::proto {
namespace {

TEST(FrameTest, RoundTripsByteByByte) {
  std::string wire;
  appendFrame(wire, 7, FrameType::kExec, R"({"argv":["true"]})");
  appendFrame(wire, 0, FrameType::kHello, "");
  appendFrame(wire, 9, FrameType::kData, std::string(70000, 'x'));
  FrameDecoder dec;
  std::vector<Frame> got;
  for (char c : wire) {
    ASSERT_TRUE(dec.feed(&c, 1).isOk());
    Frame f;
    while (dec.next(f)) got.push_back(f);
  }
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].stream, 7u);
  EXPECT_EQ(got[0].type, FrameType::kExec);
  EXPECT_EQ(got[0].payload, R"({"argv":["true"]})");
  EXPECT_EQ(got[1].type, FrameType::kHello);
  EXPECT_TRUE(got[1].payload.empty());
  EXPECT_EQ(got[2].payload.size(), 70000u);
  EXPECT_EQ(dec.pending(), 0u);
}

TEST(FrameTest, RejectsOversizeAndUndersizeFrames) {
  for (uint32_t len : {0u, 4u, uint32_t(kMaxPayload + 6)}) {
    FrameDecoder dec;
    char hdr[4] = {char(len & 0xff), char((len >> 8) & 0xff), char((len >> 16) & 0xff),
                   char(len >> 24)};
    EXPECT_FALSE(dec.feed(hdr, 4).isOk()) << len;
    EXPECT_FALSE(dec.feed("x", 1).isOk()) << "stays failed";
  }
}

}  // namespace
}  // namespace dsec::proto
