#include "common/metrics.h"

#include <gtest/gtest.h>

namespace dsec::metrics {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// Two parts of the process writing one family: it is announced once, with
// both parts' samples (a scraper rejects a family named twice).
TEST(Metrics, AFamilyWrittenTwiceIsAnnouncedOnce) {
  Registry r;
  r.add([](Writer& w) { w.counter("dsec_api_errors_total", "API errors.", 3, {{"code", "a"}}); });
  r.add([](Writer& w) { w.gauge("dsec_other", "Other.", 1.5); });
  r.add([](Writer& w) { w.counter("dsec_api_errors_total", "ignored", 4, {{"code", "b"}}); });
  std::string text = r.render();
  EXPECT_EQ(count(text, "# TYPE dsec_api_errors_total counter\n"), 1u);
  EXPECT_EQ(count(text, "# HELP dsec_api_errors_total API errors.\n"), 1u);
  EXPECT_NE(text.find("dsec_api_errors_total{code=\"a\"} 3\ndsec_api_errors_total{code=\"b\"} 4\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("dsec_other 1.5\n"), std::string::npos);
}

TEST(Metrics, ATypeClashDropsTheLaterSamples) {
  Writer w;
  w.counter("x_total", "X.", 1);
  w.gauge("x_total", "X.", 2);
  EXPECT_EQ(w.text(), "# HELP x_total X.\n# TYPE x_total counter\nx_total 1\n");
}

TEST(Metrics, LabelValuesAreEscaped) {
  Writer w;
  w.gauge("g", "G.", 7, {{"path", "a\"b\\c\nd"}});
  EXPECT_NE(w.text().find("g{path=\"a\\\"b\\\\c\\nd\"} 7\n"), std::string::npos) << w.text();
}

TEST(Metrics, HelpIsEscaped) {
  Writer w;
  w.counter("c_total", "Back\\slash and\nnewline, \"quotes\" kept.", 1);
  EXPECT_EQ(w.text(),
            "# HELP c_total Back\\\\slash and\\nnewline, \"quotes\" kept.\n"
            "# TYPE c_total counter\nc_total 1\n");
}

// A family with nothing to count yet is still listed (scrapers and
// dashboards see it exists).
TEST(Metrics, ADeclaredFamilyIsListedEmptyAndKeepsItsPlace) {
  Writer w;
  w.declare("a_total", Type::kCounter, "A.");
  w.gauge("b", "B.", 2);
  w.counter("a_total", "A.", 1, {{"k", "v"}});
  EXPECT_EQ(w.text(),
            "# HELP a_total A.\n# TYPE a_total counter\na_total{k=\"v\"} 1\n"
            "# HELP b B.\n# TYPE b gauge\nb 2\n");
  Writer empty;
  empty.declare("e_total", Type::kCounter, "E.");
  EXPECT_EQ(empty.text(), "# HELP e_total E.\n# TYPE e_total counter\n");
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(0.5);
  h.observe(5);
  Writer w;
  h.writeTo(w, "lat_seconds", "Latency.", {{"op", "x"}});
  std::string t = w.text();
  EXPECT_NE(t.find("lat_seconds_bucket{op=\"x\",le=\"0.1\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("lat_seconds_bucket{op=\"x\",le=\"1\"} 3\n"), std::string::npos) << t;
  EXPECT_NE(t.find("lat_seconds_bucket{op=\"x\",le=\"+Inf\"} 4\n"), std::string::npos) << t;
  EXPECT_NE(t.find("lat_seconds_count{op=\"x\"} 4\n"), std::string::npos) << t;
  EXPECT_EQ(h.count(), 4u);
}

TEST(Metrics, RemovedCollectorsNoLongerWrite) {
  Registry r;
  uint64_t id = r.add([](Writer& w) { w.gauge("gone", "Gone.", 1); });
  r.remove(id);
  EXPECT_EQ(r.render(), "");
}

}  // namespace
}  // namespace dsec::metrics
