#include "image/credential_helper.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <string>

#include "common/util.h"

namespace dsec::image {
namespace {

TEST(CredentialHelperTest, PicksTheHelperAsTheDockerCliDoes) {
  auto pick = [](const char* json, const char* host) {
    auto r = credentialHelperFor(json, host);
    EXPECT_TRUE(r.isOk()) << r.status().toString();
    return r.isOk() && *r ? **r : std::string("-");
  };
  const char* both = R"({"credsStore": "desktop",
                         "credHelpers": {"https://ghcr.io": "gh", "index.docker.io": "hub"}})";
  EXPECT_EQ(pick(both, "ghcr.io"), "gh");
  EXPECT_EQ(pick(both, "docker.io"), "hub");
  EXPECT_EQ(pick(both, "quay.io"), "desktop");
  EXPECT_EQ(pick(R"({"auths": {}})", "quay.io"), "-");
  EXPECT_EQ(pick(R"({"credsStore": ""})", "quay.io"), "-");
  for (const char* bad : {R"({"credsStore": "../x"})", R"({"credHelpers": {"q.io": 7}})",
                          R"({"credHelpers": []})", "[", "[]"}) {
    auto r = credentialHelperFor(bad, "q.io");
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(r.status().field(), "auth") << bad;
  }
}

class HelperRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dsec-credhelper-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_, 0755).isOk());
    const char* path = getenv("PATH");
    oldPath_ = path ? path : "";
    setenv("PATH", (dir_ + ":" + oldPath_).c_str(), 1);
  }
  void TearDown() override {
    setenv("PATH", oldPath_.c_str(), 1);
    (void)removeTree(dir_);
  }
  // docker-credential-<name>: a shell script.
  void helper(const std::string& name, const std::string& body) {
    std::string p = dir_ + "/docker-credential-" + name;
    ASSERT_TRUE(writeFileAtomic(p, "#!/bin/sh\n" + body, 0755).isOk());
  }
  std::string dir_, oldPath_;
};

TEST_F(HelperRunTest, ReadsTheAnswerForTheServerOnStdin) {
  // Echoes what it was asked for as the user name, so the test sees it.
  helper("t", "[ \"$1\" = get ] || exit 3\nread s\n"
              "printf '{\"ServerURL\":\"%s\",\"Username\":\"u-%s\",\"Secret\":\"p\"}' \"$s\" \"$s\"\n");
  auto c = runCredentialHelper("t", "ghcr.io");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  ASSERT_TRUE(*c);
  EXPECT_EQ((*c)->username, "u-ghcr.io");
  EXPECT_EQ((*c)->password, "p");
  c = runCredentialHelper("t", "docker.io");
  ASSERT_TRUE(c.isOk() && *c);
  EXPECT_EQ((*c)->username, "u-https://index.docker.io/v1/");

  helper("tok", "cat >/dev/null\necho '{\"Username\":\"<token>\",\"Secret\":\"refresh\"}'\n");
  c = runCredentialHelper("tok", "quay.io");
  ASSERT_TRUE(c.isOk() && *c);
  EXPECT_EQ((*c)->identityToken, "refresh");
  EXPECT_TRUE((*c)->username.empty());
}

TEST_F(HelperRunTest, NotFoundIsNoneAndFailuresAreClearErrors) {
  helper("none", "echo 'credentials not found in native keychain'\nexit 1\n");
  auto c = runCredentialHelper("none", "quay.io");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_FALSE(*c);

  c = runCredentialHelper("missing-helper-xyz", "quay.io");
  EXPECT_EQ(c.status().code(), Code::kNotFound);
  EXPECT_EQ(c.status().field(), "auth");

  helper("broken", "echo 'keychain locked'\nexit 2\n");
  c = runCredentialHelper("broken", "quay.io");
  EXPECT_EQ(c.status().code(), Code::kUnavailable);
  EXPECT_NE(c.status().message().find("keychain locked"), std::string::npos);

  // Its answer holds a secret: never quoted.
  helper("garbled", "echo 'hunter2 {'\n");
  c = runCredentialHelper("garbled", "quay.io");
  EXPECT_EQ(c.status().code(), Code::kUnavailable);
  EXPECT_EQ(c.status().message().find("hunter2"), std::string::npos);

  helper("slow", "exec sleep 30\n");
  c = runCredentialHelper("slow", "quay.io", 0.3);
  EXPECT_EQ(c.status().code(), Code::kUnavailable);

  // Exits at once without reading stdin: no SIGPIPE kills the caller.
  helper("early", "exec echo '{\"Username\":\"a\",\"Secret\":\"b\"}'\n");
  c = runCredentialHelper("early", "quay.io");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_TRUE(*c);
}

}  // namespace
}  // namespace dsec::image
