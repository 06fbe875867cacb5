#include "proto/egress.h"

#include <sys/socket.h>

#include <gtest/gtest.h>

namespace dsec::proto {
namespace {

EgressEntry parse(const std::string& s) {
  auto e = parseEgressEntry(s, "egress");
  EXPECT_TRUE(e.isOk()) << s << ": " << e.status().toString();
  return e.isOk() ? *e : EgressEntry{};
}

TEST(EgressRules, ParsesAddressesPrefixesAndPorts) {
  EXPECT_EQ(formatEgressEntry(parse("10.1.2.3")), "10.1.2.3/32");
  EXPECT_EQ(formatEgressEntry(parse("10.1.2.3/8")), "10.0.0.0/8");  // masked
  EXPECT_EQ(formatEgressEntry(parse("10.0.0.0/8:80")), "10.0.0.0/8:80");
  EXPECT_EQ(formatEgressEntry(parse("10.1.2.3:80,443,8000-8100")), "10.1.2.3/32:80,443,8000-8100");
  EXPECT_EQ(formatEgressEntry(parse("2001:db8::1")), "2001:db8::1/128");
  EXPECT_EQ(formatEgressEntry(parse("2001:db8::/32")), "2001:db8::/32");
  EXPECT_EQ(formatEgressEntry(parse("[2001:db8::1]:443")), "[2001:db8::1/128]:443");
  EXPECT_EQ(formatEgressEntry(parse("[2001:db8::/48]:1-1024")), "[2001:db8::/48]:1-1024");
  auto h = parse("Deb.Debian.org:80");
  EXPECT_EQ(h.host, "deb.debian.org");
  EXPECT_EQ(formatEgressEntry(h), "deb.debian.org:80");
  EXPECT_EQ(parse("mirror").host, "mirror");
}

TEST(EgressRules, RefusesMalformedEntriesNamingTheField) {
  for (const char* bad :
       {"", "10.0.0.0/33", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:90-80", "10.0.0.1:",
        "10.0.0.1:http", "1.2.3", "999.1.1.1", "host/8", "-bad-.example", "[::1", "[::1]x",
        "[::1]:", "2001:db8::/129", "a..b", "10.0.0.1:1,2,3,4,5,6,7,8,9", "10.0.0.0/x"}) {
    auto e = parseEgressEntry(bad, "egress[3]");
    ASSERT_FALSE(e.isOk()) << bad;
    EXPECT_EQ(e.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(e.status().field(), "egress[3]") << bad;
  }
}

TEST(EgressRules, CompileMergesPortsAndPushesBroaderPrefixesDown) {
  auto rules = compileEgress({parse("10.0.0.0/8:80"), parse("10.1.0.0/16:443"),
                              parse("10.1.0.0/16:444"), parse("192.0.2.1")},
                             "egress");
  ASSERT_TRUE(rules.isOk()) << rules.status().toString();
  ASSERT_EQ(rules->size(), 3u);
  for (auto& r : *rules) {
    if (r.prefixLen == 8) {
      EXPECT_EQ(r.ports, (std::vector<PortRange>{{80, 80}}));
    }
    // 10.1/16 also allows the /8's port 80: the filter takes the longest match only.
    if (r.prefixLen == 16) {
      EXPECT_EQ(r.ports, (std::vector<PortRange>{{80, 80}, {443, 444}}));
    }
    if (r.prefixLen == 32) {
      EXPECT_EQ(r.ports, (std::vector<PortRange>{{1, 65535}}));
    }
  }
}

TEST(EgressRules, CompileRefusesUnresolvedNamesAndTooManyRanges) {
  EXPECT_FALSE(compileEgress({parse("mirror:80")}, "egress").isOk());
  auto r = compileEgress({parse("10.0.0.0/8:1,3,5,7,9"), parse("10.1.0.0/16:11,13,15,17")},
                         "egress");
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().field(), "egress");
}

}  // namespace
}  // namespace dsec::proto
