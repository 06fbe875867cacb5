#include "proto/codec.h"

#include <gtest/gtest.h>

namespace dsec::proto {
namespace {

// What a remote node is asked to create must be what the platform planned:
// every SandboxSpec field the node acts on survives the hop.
TEST(EdgeWire, SandboxSpecRoundTrips) {
  SandboxSpec s;
  s.id = "sb-0123456789abcdef";
  s.layers = {"sha256:aa", "sha256:bb"};
  s.cpu = 1.5;
  s.memoryBytes = 256ll << 20;
  s.diskBytes = 2ll << 30;
  s.pids = 77;
  s.fncallInit = R"({"scratch_mb":8})";
  s.initPolicy = R"({"readonly":["/etc"],"syscalls":"strict"})";
  s.workingDir = "/work/dir";
  s.network = true;
  auto back = specFromJson(toJson(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->id, s.id);
  EXPECT_EQ(back->layers, s.layers);
  EXPECT_EQ(back->cpu, s.cpu);
  EXPECT_EQ(back->memoryBytes, s.memoryBytes);
  EXPECT_EQ(back->diskBytes, s.diskBytes);
  EXPECT_EQ(back->pids, s.pids);
  EXPECT_EQ(back->fncallInit, s.fncallInit);
  EXPECT_EQ(back->initPolicy, s.initPolicy);
  EXPECT_EQ(back->workingDir, s.workingDir);
  EXPECT_TRUE(back->network);
}

TEST(EdgeWire, SpecWithoutIdIsRefused) {
  auto bad = specFromJson(json{{"layers", json::array()}});
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "spec");
}

// Computer-use actions reach the node as the platform checked them.
TEST(EdgeWire, InputActionRoundTrips) {
  InputAction a;
  a.kind = "mouse";
  a.x = 640;
  a.y = 480;
  a.button = "wheel-up";
  auto back = inputFromJson(toJson(a));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->kind, "mouse");
  EXPECT_EQ(back->x, 640);
  EXPECT_EQ(back->y, 480);
  EXPECT_EQ(back->button, "wheel-up");
  a = InputAction{};
  a.kind = "type";
  a.text = "h\u00e9llo\n";
  EXPECT_EQ(inputFromJson(toJson(a))->text, a.text);
  auto bad = inputFromJson(json{{"text", "x"}});
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().field(), "input");
  EXPECT_FALSE(inputFromJson(json{{"kind", "mouse"}, {"x", "left"}}).isOk());
}

}  // namespace
}  // namespace dsec::proto
