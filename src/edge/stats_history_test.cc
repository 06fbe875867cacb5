#include "edge/stats_history.h"

#include <gtest/gtest.h>

#include <thread>

namespace dsec::edge {
namespace {

proto::StatsSample at(double t, int64_t cpuUsec = 0, int64_t mem = 0, int64_t pids = 0) {
  return {t, cpuUsec, mem, pids};
}

TEST(StatsHistoryTest, KeepsTheLastPointsOldestFirst) {
  StatsHistory h(3);
  EXPECT_TRUE(h.query("sb-1", 3600, 100).empty()) << "unknown id";
  for (int i = 0; i < 5; ++i) h.record("sb-1", at(10 + i, i * 1000, i * 4096, i));
  auto s = h.query("sb-1", 3600, 100);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[0].t, 12);
  EXPECT_DOUBLE_EQ(s[2].t, 14);
  EXPECT_EQ(s[2].cpuUsec, 4000);
  EXPECT_EQ(s[2].memoryBytes, 4 * 4096);
  EXPECT_EQ(s[2].pids, 4);
  // Keeps wrapping in order.
  h.record("sb-1", at(15));
  s = h.query("sb-1", 3600, 100);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[0].t, 13);
  EXPECT_DOUBLE_EQ(s[2].t, 15);
}

TEST(StatsHistoryTest, WindowCountsBackFromNow) {
  StatsHistory h;
  for (int i = 0; i < 10; ++i) h.record("sb-1", at(1000 + 15 * i));
  EXPECT_EQ(h.query("sb-1", 3600, 1135).size(), 10u);
  EXPECT_EQ(h.query("sb-1", 30, 1135).size(), 3u) << "1105, 1120, 1135";
  EXPECT_EQ(h.query("sb-1", 1, 2000).size(), 0u);
  // Times keep their milliseconds; memory its KiB; huge figures are clamped.
  h.record("sb-2", at(1.234, 5, (int64_t(1) << 50), -3));
  auto s = h.query("sb-2", 10, 2);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_DOUBLE_EQ(s[0].t, 1.234);
  EXPECT_EQ(s[0].memoryBytes, int64_t(UINT32_MAX) * 1024);
  EXPECT_EQ(s[0].pids, 0);
}

TEST(StatsHistoryTest, DropAndRetain) {
  StatsHistory h;
  for (const char* id : {"sb-1", "sb-2", "sb-3"}) h.record(id, at(1));
  EXPECT_EQ(h.size(), 3u);
  h.drop("sb-2");
  h.drop("sb-unknown");
  EXPECT_EQ(h.size(), 2u);
  EXPECT_TRUE(h.query("sb-2", 3600, 2).empty());
  h.retain({"sb-3", "sb-9"});
  EXPECT_EQ(h.size(), 1u);
  EXPECT_EQ(h.query("sb-3", 3600, 2).size(), 1u);
}

TEST(StatsHistoryTest, ConcurrentRecordAndQuery) {
  StatsHistory h(16);
  std::thread w([&] {
    for (int i = 0; i < 20000; ++i) h.record("sb-" + std::to_string(i % 8), at(i, i));
  });
  for (int i = 0; i < 2000; ++i) {
    auto s = h.query("sb-" + std::to_string(i % 8), 1e9, 1e6);
    for (size_t k = 1; k < s.size(); ++k) ASSERT_LT(s[k - 1].t, s[k].t);
  }
  w.join();
  EXPECT_EQ(h.query("sb-0", 1e9, 1e6).size(), 16u);
}

TEST(CpuCoresTest, RatesBetweenReadings) {
  EXPECT_TRUE(proto::cpuCores({}).empty());
  auto c = proto::cpuCores(
      {at(0, 0), at(10, 5'000'000), at(10, 6'000'000), at(20, 26'000'000), at(25, 1'000)});
  ASSERT_EQ(c.size(), 5u);
  EXPECT_FALSE(c[0]);
  EXPECT_DOUBLE_EQ(c[1].value_or(-1), 0.5);
  EXPECT_FALSE(c[2]) << "no time passed";
  EXPECT_DOUBLE_EQ(c[3].value_or(-1), 2.0);
  EXPECT_FALSE(c[4]) << "the counter went back";
}

}  // namespace
}  // namespace dsec::edge
