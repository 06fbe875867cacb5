#include "aether/container_init.h"

#include <gtest/gtest.h>

namespace dsec::aether {
namespace {

TEST(InitConfig, MountFdRootfsNeedsOnlyATarget) {
  auto c =
      parseInitConfig(R"({"hostname":"sb-1","rootfs":{"mount_fd":true,"target":"sb-1/rootfs"}})");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  ASSERT_TRUE(c->rootfs.has_value());
  EXPECT_TRUE(c->rootfs->mountFd);
  EXPECT_EQ(c->rootfs->target, "sb-1/rootfs");
  EXPECT_TRUE(c->rootfs->lower.empty());
}

TEST(InitConfig, ReattachIsABoolAndOffByDefault) {
  auto off = parseInitConfig(R"({"hostname":"sb-1"})");
  ASSERT_TRUE(off.isOk());
  EXPECT_FALSE(off->reattach);
  auto on = parseInitConfig(R"({"hostname":"sb-1","reattach":true})");
  ASSERT_TRUE(on.isOk());
  EXPECT_TRUE(on->reattach);
  auto bad = parseInitConfig(R"({"hostname":"sb-1","reattach":"yes"})");
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "reattach");
}

TEST(InitConfig, MountFdTargetMustNotClimb) {
  for (const char* t : {"..", "../x", "a/../../x", "a/..", ""}) {
    std::string j = std::string(R"({"rootfs":{"mount_fd":true,"target":")") + t + R"("}})";
    auto c = parseInitConfig(j);
    EXPECT_FALSE(c.isOk()) << t;
  }
}

TEST(InitConfig, PathRootfsStillNeedsLayers) {
  auto c = parseInitConfig(R"({"rootfs":{"upper":"/u","work":"/w","target":"/t"}})");
  EXPECT_FALSE(c.isOk());
}

TEST(InitConfig, MountFdAndDescriptorMustAgree) {
  auto c = parseInitConfig(R"({"rootfs":{"mount_fd":true,"target":"x/rootfs"}})");
  ASSERT_TRUE(c.isOk());
  // No descriptor came with init: refused before anything is mounted.
  Status st = setupContainer(*c, -1);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::aether
