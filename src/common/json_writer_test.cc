#include "common/json_writer.h"

#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

namespace dsec {
namespace {

using json = nlohmann::json;

// What nlohmann makes of the same value, invalid UTF-8 replaced as ours is.
json reference(const json& j) {
  return json::parse(j.dump(-1, ' ', false, json::error_handler_t::replace));
}

TEST(JsonWriterTest, StringsReadBackAsNlohmannWritesThem) {
  const std::string cases[] = {
      "",
      "plain",
      "quote \" backslash \\ slash /",
      std::string("controls \b\f\n\r\t \x01\x1f\x7f and a nul ") + '\0' + " inside",
      "utf-8: caf\xC3\xA9, \xE2\x82\xAC, \xF0\x9F\x98\x80",
      "invalid: \xFF \xC0\xAF \xED\xA0\x80 \xF4\x90\x80\x80 cut \xE2\x82 mid \xF0\x9F\x98",
      "cut at the end \xE2\x82",
      "\xC3",
  };
  for (const std::string& s : cases) {
    std::string out;
    appendJsonString(out, s);
    json back = json::parse(out, nullptr, false);
    ASSERT_FALSE(back.is_discarded()) << out;
    EXPECT_EQ(back, reference(json(s))) << out;
  }
}

TEST(JsonWriterTest, NumbersKeepTheirValueAndKind) {
  const double doubles[] = {0.0, -0.0, 0.1, 1.0, 1.7e9, 1764547200.123456, 1e300, 5e-324, -2.5};
  for (double d : doubles) {
    std::string out;
    JsonWriter(out).value(d);
    json back = json::parse(out);
    EXPECT_TRUE(back.is_number_float()) << out;
    EXPECT_EQ(back.get<double>(), d) << out;
  }
  for (double d :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    std::string out;
    JsonWriter(out).value(d);
    EXPECT_EQ(out, "null");
  }
  for (int64_t v : {int64_t(0), int64_t(-1), std::numeric_limits<int64_t>::min(),
                    std::numeric_limits<int64_t>::max()}) {
    std::string out;
    JsonWriter(out).value(v);
    EXPECT_EQ(json::parse(out).get<int64_t>(), v);
  }
}

TEST(JsonWriterTest, NestingPlacesCommasAndKeys) {
  std::string out;
  JsonWriter w(out);
  w.beginObject()
      .member("a", int64_t(1))
      .member("list", std::vector<std::string>{"x", "y"})
      .member("empty", std::vector<std::string>{})
      .member("map", std::map<std::string, std::string>{{"k\"", "v"}, {"z", ""}})
      .key("objs")
      .beginArray();
  for (int i = 0; i < 2; ++i) w.beginObject().member("i", i).member("t", true).endObject();
  w.endArray().key("none").null().endObject();
  json want = {{"a", 1},
               {"list", {"x", "y"}},
               {"empty", json::array()},
               {"map", {{"k\"", "v"}, {"z", ""}}},
               {"objs", {{{"i", 0}, {"t", true}}, {{"i", 1}, {"t", true}}}},
               {"none", nullptr}};
  EXPECT_EQ(json::parse(out), want) << out;
}

}  // namespace
}  // namespace dsec
