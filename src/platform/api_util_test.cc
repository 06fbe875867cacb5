#include "platform/api_util.h"
#include "platform/platform.h"

#include <gtest/gtest.h>

namespace dsec::platform {
namespace {

TEST(ApiUtilTest, UserSpecs) {
  for (const char* ok : {"", "root", "0", "1000", "app", "1000:1000", "app:staff", "a-b_c.d"}) {
    EXPECT_TRUE(validateUserSpec(ok, "user").isOk()) << ok;
  }
  for (std::string bad : {std::string("a b"), std::string("a\tb"), std::string("a\nb"),
                          std::string(":1"), std::string("1:"), std::string(":"),
                          std::string("1:2:3"), std::string(65, 'a'), std::string("a\0b", 3)}) {
    Status st = validateUserSpec(bad, "user");
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(st.field(), "user") << bad;
  }
  EXPECT_TRUE(validateUserSpec(std::string(64, 'a'), "user").isOk());
}

TEST(ApiUtilTest, ImageRefsMayNameARegistryHostWithAPort) {
  struct Case {
    const char* ref;
    const char* name;
    const char* tag;
  };
  for (auto c : {Case{"debian", "debian", "latest"}, Case{"debian:12", "debian", "12"},
                 Case{"a/b/c:v1.2", "a/b/c", "v1.2"},
                 Case{"127.0.0.1:5000/app", "127.0.0.1:5000/app", "latest"},
                 Case{"127.0.0.1:5000/app:1", "127.0.0.1:5000/app", "1"},
                 Case{"localhost:80/x/y:t", "localhost:80/x/y", "t"},
                 Case{"ghcr.io/org/img:2", "ghcr.io/org/img", "2"}}) {
    std::string name, tag;
    ASSERT_TRUE(parseImageRef(c.ref, name, tag).isOk()) << c.ref;
    EXPECT_EQ(name, c.name) << c.ref;
    EXPECT_EQ(tag, c.tag) << c.ref;
  }
  for (const char* bad : {"", ":1", "host:port/x", "a:b:c", ":5000/x", "h:123456/x",
                          "h:50:00/x", "a/h:5000/x", "x@sha256:ab", ".x", "x:", "a b"}) {
    std::string name, tag;
    Status st = parseImageRef(bad, name, tag);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
  }
}

TEST(ApiUtilTest, ImageConfigs) {
  auto c = parseImageConfig(
      json{{"user", "1000:1000"}, {"env", {"FOO=bar", "EMPTY=", "A=b=c"}}, {"working_dir", "/w"}});
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->user, "1000:1000");
  EXPECT_EQ(c->env.size(), 3u);
  EXPECT_EQ(c->workingDir, "/w");
  EXPECT_EQ(imageConfigToApi(*c)["working_dir"], "/w");
  EXPECT_TRUE(parseImageConfig(json::object())->empty());
  EXPECT_TRUE(parseImageConfig(json(nullptr))->empty());
  EXPECT_TRUE(parseImageConfig(json{{"working_dir", "/"}}).isOk());

  json tooMany = json::array();
  for (int i = 0; i < 257; ++i) tooMany.push_back("K" + std::to_string(i) + "=v");
  const std::pair<json, const char*> bad[] = {
      {json::array(), "config"},
      {json{{"cmd", "sh"}}, "config.cmd"},
      {json{{"user", 1000}}, "config.user"},
      {json{{"user", "a b"}}, "config.user"},
      {json{{"user", std::string(65, 'u')}}, "config.user"},
      {json{{"env", "FOO=bar"}}, "config.env"},
      {json{{"env", {1}}}, "config.env"},
      {json{{"env", {"NOEQUALS"}}}, "config.env"},
      {json{{"env", {"=v"}}}, "config.env"},
      {json{{"env", tooMany}}, "config.env"},
      {json{{"working_dir", "rel"}}, "config.working_dir"},
      {json{{"working_dir", "/a/../b"}}, "config.working_dir"},
      {json{{"working_dir", "/a/"}}, "config.working_dir"},
      {json{{"working_dir", "/a//b"}}, "config.working_dir"},
      {json{{"working_dir", "/" + std::string(1024, 'd')}}, "config.working_dir"},
      {json{{"working_dir", 7}}, "config.working_dir"},
  };
  for (auto& [j, field] : bad) {
    auto r = parseImageConfig(j);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << j.dump();
    EXPECT_EQ(r.status().field(), field) << j.dump() << ": " << r.status().message();
  }
}

TEST(ApiUtilTest, EnvMapLetsTheLastEntryOfAKeyWin) {
  auto m = envMap({"A=1", "B=x=y", "A=2", "C="});
  EXPECT_EQ(m.at("A"), "2");
  EXPECT_EQ(m.at("B"), "x=y");
  EXPECT_EQ(m.at("C"), "");
}

}  // namespace
}  // namespace dsec::platform
