#include "platform/metrics_history.h"

#include <gtest/gtest.h>

namespace dsec::platform {
namespace {

TEST(MetricsHistoryTest, ParsesTheExpositionText) {
  auto s = parseMetricsText(
      "# HELP x y\n# TYPE x counter\nx 3\ny{a=\"1\",b=\"q\\\"z\"} 2.5\nbad{a=1} 4\n"
      "z{} 7 1700000000\n\n");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].name, "x");
  EXPECT_EQ(s[0].value, 3);
  EXPECT_EQ(s[1].labels.at("b"), "q\"z");
  EXPECT_EQ(s[1].value, 2.5);
  EXPECT_EQ(s[2].name, "z");
  EXPECT_EQ(s[2].value, 7);
}

TEST(MetricsHistoryTest, CountersBecomeRatesAndGaugesStay) {
  int creations = 0;
  int running = 0;
  MetricsHistory h(
      [&] {
        return "dsec_sandbox_creations_total{backend=\"container\"} " +
               std::to_string(creations) + "\ndsec_sandbox_creations_total{backend=\"vm\"} 1\n" +
               "dsec_sandboxes{state=\"running\"} " + std::to_string(running) +
               "\ndsec_sandboxes{state=\"paused\"} 0\n";
      },
      0, 60);
  for (int i = 0; i < 5; ++i) {
    creations += 10 * i;
    running = i;
    h.sample(1000 + 10 * i);
  }
  auto j = h.query(3600);
  ASSERT_EQ(j["t"].size(), 5u);
  auto& rate = j["series"]["creates_per_s"];
  EXPECT_TRUE(rate[0].is_null());
  EXPECT_DOUBLE_EQ(rate[1].get<double>(), 1.0);  // +10 over 10 s
  EXPECT_DOUBLE_EQ(rate[4].get<double>(), 4.0);
  EXPECT_EQ(j["series"]["sandboxes.running"][3], 3);
  EXPECT_EQ(j["series"]["sandboxes.paused"][3], 0);
  // A counter that went back (a restart) is no rate.
  creations = 0;
  h.sample(1050);
  EXPECT_TRUE(h.query(3600)["series"]["creates_per_s"].back().is_null());
  // The window: only the last 20 s.
  EXPECT_EQ(h.query(20)["t"].size(), 3u);
  // Older than the kept window goes.
  h.sample(1200);
  EXPECT_EQ(h.query(3600)["t"].size(), 1u);
}

}  // namespace
}  // namespace dsec::platform
