#include "platform/policy.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace dsec::platform {
namespace {

TEST(PolicyTest, BuiltinsAreClosedAndEvalLocksSystemPaths) {
  for (const char* name : {"default", "rollout", "eval"}) {
    auto p = findPolicy(name, "policy");
    ASSERT_TRUE(p.isOk()) << name;
    EXPECT_TRUE(p->egress.empty()) << name;
  }
  auto eval = findPolicy("eval", "policy");
  for (const char* path : {"/usr", "/bin", "/lib", "/etc"}) {
    EXPECT_NE(std::find(eval->readonlyPaths.begin(), eval->readonlyPaths.end(), path),
              eval->readonlyPaths.end())
        << path;
  }
  auto bad = findPolicy("setup-ish", "phase.policy");
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.status().field(), "phase.policy");
  EXPECT_NE(bad.status().message().find("default, rollout, eval"), std::string::npos);
}

TEST(PolicyTest, PathsMustBeAbsoluteNormalisedAndOutsideProcSysDev) {
  EXPECT_TRUE(validatePolicyPaths({"/srv/answers", "/opt", "/a/b.c/d-e"}, "f").isOk());
  for (const char* bad : {"", "/", "relative", "/a//b", "/a/./b", "/a/../b", "/a/", "/proc",
                          "/proc/self", "/sys/fs", "/dev", "/dev/null"}) {
    Status st = validatePolicyPaths({bad}, "hidden_paths");
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(st.field(), "hidden_paths") << bad;
  }
  EXPECT_TRUE(validatePolicyPaths({"/devices", "/process"}, "f").isOk());  // only whole names
  std::vector<std::string> many(65, "/x");
  EXPECT_EQ(validatePolicyPaths(many, "f").code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::platform
