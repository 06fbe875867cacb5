#include "aether/users.h"

#include <gtest/gtest.h>

namespace dsec::aether {
namespace {

constexpr const char* kPasswd =
    "root:x:0:0:root:/root:/bin/bash\n"
    "# a comment\n"
    "\n"
    "daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    "broken line without colons\n"
    "badid:x:12a:1::/:/bin/sh\n"
    "+nisuser::::::\n"
    "alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash\r\n"
    "bob:x:1001:100::/home/bob:/bin/sh";  // no trailing newline

constexpr const char* kGroup =
    "root:x:0:\n"
    "users:x:100:alice,bob\n"
    "alice:x:1000:\n"
    "wheel:x:10:alice\n"
    "bad:x:notanumber:alice\n"
    "docker:x:999:carol,alice,\n";

TEST(UsersTest, ParsesPasswdSkippingJunk) {
  auto users = parsePasswd(kPasswd);
  ASSERT_EQ(users.size(), 4u);
  EXPECT_EQ(users[0].name, "root");
  EXPECT_EQ(users[1].home, "/usr/sbin");
  EXPECT_EQ(users[2].name, "alice");
  EXPECT_EQ(users[2].uid, 1000u);
  EXPECT_EQ(users[2].gid, 1000u);
  EXPECT_EQ(users[2].home, "/home/alice");
  EXPECT_EQ(users[2].shell, "/bin/bash");  // CR stripped
  EXPECT_EQ(users[3].name, "bob");
  EXPECT_EQ(users[3].gid, 100u);
}

TEST(UsersTest, ParsesGroups) {
  auto groups = parseGroup(kGroup);
  ASSERT_EQ(groups.size(), 5u);
  EXPECT_EQ(groups[1].name, "users");
  EXPECT_EQ(groups[1].gid, 100u);
  EXPECT_EQ(groups[1].members, (std::vector<std::string>{"alice", "bob"}));
  EXPECT_TRUE(groups[0].members.empty());
  EXPECT_EQ(groups[4].members, (std::vector<std::string>{"carol", "alice"}));
}

TEST(UsersTest, ResolvesByName) {
  auto c = resolveUser("alice", kPasswd, kGroup);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->uid, 1000u);
  EXPECT_EQ(c->gid, 1000u);
  EXPECT_EQ(c->home, "/home/alice");
  EXPECT_EQ(c->groups, (std::vector<gid_t>{1000, 100, 10, 999}));
}

TEST(UsersTest, ResolvesNumbersAndPairs) {
  auto c = resolveUser("1001", kPasswd, kGroup);
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(c->uid, 1001u);
  EXPECT_EQ(c->gid, 100u);  // from passwd
  EXPECT_EQ(c->home, "/home/bob");

  c = resolveUser("4242", kPasswd, kGroup);
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(c->uid, 4242u);
  EXPECT_EQ(c->gid, 4242u);
  EXPECT_EQ(c->home, "/");
  EXPECT_EQ(c->groups, (std::vector<gid_t>{4242}));

  c = resolveUser("alice:wheel", kPasswd, kGroup);
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(c->gid, 10u);

  c = resolveUser("1000:5", kPasswd, kGroup);
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(c->uid, 1000u);
  EXPECT_EQ(c->gid, 5u);
}

TEST(UsersTest, RootWorksWithoutPasswd) {
  auto c = resolveUser("root", "", "");
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(c->uid, 0u);
  EXPECT_EQ(c->gid, 0u);
  EXPECT_EQ(c->home, "/root");
}

TEST(UsersTest, RejectsUnknownAndMalformed) {
  for (const char* spec :
       {"mallory", "alice:nogroup", "", ":", "alice:", ":10", "4294967295", "99999999999"}) {
    auto c = resolveUser(spec, kPasswd, kGroup);
    ASSERT_FALSE(c.isOk()) << spec;
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << spec;
    EXPECT_EQ(c.status().field(), "user") << spec;
  }
}

TEST(UsersTest, ReadSmallFileTreatsMissingAsEmpty) {
  auto r = readSmallFile("/nonexistent/passwd");
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(r->empty());
  auto d = readSmallFile("/");
  EXPECT_FALSE(d.isOk());  // a directory is not a regular file
}

// Issue 31: an exec as an id the sandbox does not map says so, naming the
// field and the mapping, instead of failing at setgid with a bare EINVAL.
TEST(UsersTest, IdsOutsideTheMappingAreNamed) {
  const char* map = "         0     589824      65536\n";
  Credentials ok{1000, 1000, {1000, 27}, "/"};
  EXPECT_TRUE(checkMapped(ok, map, map).isOk());
  Credentials top{65535, 65534, {65534}, "/"};
  EXPECT_TRUE(checkMapped(top, map, map).isOk());
  Status uid = checkMapped({65536, 0, {0}, "/"}, map, map);
  EXPECT_EQ(uid.code(), Code::kInvalidArgument);
  EXPECT_EQ(uid.field(), "user");
  EXPECT_NE(uid.message().find("uid 65536 is outside this sandbox's id mapping (0-65535)"),
            std::string::npos)
      << uid.message();
  EXPECT_NE(checkMapped({0, 197609, {197609}, "/"}, map, map).message().find("gid 197609"),
            std::string::npos);
  EXPECT_NE(checkMapped({0, 0, {0, 70000}, "/"}, map, map).message().find("supplementary gid"),
            std::string::npos);
  // No user namespace (the identity map, or none read): everything is mapped.
  EXPECT_TRUE(checkMapped({4000000000u, 1, {}, "/"}, "0 0 4294967295\n", "").isOk());
  // Several extents.
  std::string two = "0 589824 1000\n5000 600000 10\n";
  EXPECT_TRUE(checkMapped({5009, 0, {}, "/"}, two, two).isOk());
  EXPECT_FALSE(checkMapped({5010, 0, {}, "/"}, two, two).isOk());
}

}  // namespace
}  // namespace dsec::aether
