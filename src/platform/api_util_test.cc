#include "platform/api_util.h"
#include "platform/platform.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/un.h>

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

// Each address as the registry client's socket callback would see it.
bool publicText(const std::string& text) {
  sockaddr_storage ss{};
  if (text.find(':') == std::string::npos) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    EXPECT_EQ(inet_pton(AF_INET, text.c_str(), &a->sin_addr), 1) << text;
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    EXPECT_EQ(inet_pton(AF_INET6, text.c_str(), &a->sin6_addr), 1) << text;
  }
  return publicAddress(reinterpret_cast<const sockaddr*>(&ss));
}

TEST(ApiUtilTest, PublicAddressRefusesEveryNonPublicRange) {
  struct Case {
    const char* addr;
    bool isPublic;
  };
  const Case cases[] = {
      // IPv4.
      {"8.8.8.8", true},
      {"1.1.1.1", true},
      {"100.63.255.255", true},
      {"100.128.0.0", true},
      {"172.32.0.1", true},
      {"192.0.1.1", true},
      {"198.17.255.255", true},
      {"198.20.0.0", true},
      {"223.255.255.255", true},
      {"0.0.0.0", false},  // 0/8
      {"0.1.2.3", false},
      {"10.1.2.3", false},    // RFC 1918
      {"100.64.0.1", false},  // CGNAT 100.64/10
      {"100.127.255.255", false},
      {"127.0.0.1", false},  // loopback
      {"127.255.255.254", false},
      {"169.254.169.254", false},  // link-local (cloud metadata)
      {"172.16.0.1", false},
      {"172.31.255.255", false},
      {"192.0.0.1", false},   // 192.0.0/24 IETF protocol assignments
      {"192.0.2.10", false},  // TEST-NET-1
      {"192.168.1.1", false},
      {"198.18.0.1", false},  // 198.18/15 benchmarking
      {"198.19.255.255", false},
      {"198.51.100.7", false},  // TEST-NET-2
      {"203.0.113.9", false},   // TEST-NET-3
      {"224.0.0.1", false},     // multicast
      {"239.255.255.250", false},
      {"240.0.0.1", false},  // 240/4 reserved
      {"250.1.2.3", false},
      {"255.255.255.255", false},
      // IPv6.
      {"2606:4700:4700::1111", true},
      {"2a00:1450:4001:80b::200e", true},
      {"2001:4860:4860::8888", true},
      {"::", false},
      {"::1", false},
      {"fe80::1", false},  // link-local fe80::/10
      {"febf::1", false},
      {"fec0::1", false},  // site-local (deprecated)
      {"fc00::1", false},  // ULA fc00::/7
      {"fd12:3456::1", false},
      {"ff02::1", false},  // multicast ff00::/8
      {"ff0e::1", false},
      {"100::1", false},       // discard-only 100::/64
      {"2001::1", false},      // Teredo (2001::/32)
      {"2001:1ff::1", false},  // the rest of 2001::/23
      {"2001:200::1", true},
      {"2001:db8::1", false},  // documentation
      {"3fff::1", false},
      {"64:ff9b:1::a00:1", false},  // local-use NAT64 (64:ff9b:1::/48)
      // IPv6 carrying IPv4, judged by the IPv4.
      {"::ffff:8.8.8.8", true},  // mapped
      {"::ffff:127.0.0.1", false},
      {"::ffff:10.0.0.1", false},
      {"::ffff:169.254.169.254", false},
      {"::ffff:240.0.0.1", false},
      {"::8.8.8.8", true},  // IPv4-compatible ::/96
      {"::127.0.0.1", false},
      {"::10.0.0.1", false},
      {"::192.168.0.1", false},
      {"64:ff9b::8.8.8.8", true},  // NAT64 64:ff9b::/96
      {"64:ff9b::127.0.0.1", false},
      {"64:ff9b::a9fe:a9fe", false},
      {"64:ff9b::192.168.1.1", false},
      {"64:ff9b::198.18.0.1", false},
      {"2002:808:808::1", true},    // 6to4 2002::/16: 8.8.8.8
      {"2002:7f00:1::1", false},    // 127.0.0.1
      {"2002:a00:1::", false},      // 10.0.0.1
      {"2002:c0a8:101::1", false},  // 192.168.1.1
      {"2002:a9fe:a9fe::", false},  // 169.254.169.254
      {"2002:e000:1::", false},     // 224.0.0.1
  };
  for (const Case& c : cases) EXPECT_EQ(publicText(c.addr), c.isPublic) << c.addr;
  sockaddr_un un{};
  un.sun_family = AF_UNIX;
  EXPECT_FALSE(publicAddress(reinterpret_cast<const sockaddr*>(&un)));
}

}  // namespace
}  // namespace dsec::platform
