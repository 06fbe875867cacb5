#include "edge/sandbox_state.h"

#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "common/util.h"

namespace dsec::edge {
namespace {

SandboxState sample() {
  SandboxState s;
  s.backend = BackendKind::kContainer;
  s.spec.id = "sb-0123456789abcdef";
  s.spec.layers = {"sha256:aa", "sha256:bb"};
  s.spec.cpu = 1.5;
  s.spec.memoryBytes = 256 << 20;
  s.spec.diskBytes = 1 << 30;
  s.spec.pids = 99;
  s.pid = 4242;
  s.startTime = 123456789;
  proto::EgressRule r4;
  r4.family = AF_INET;
  r4.addr = {10, 1, 0, 0};
  r4.prefixLen = 16;
  r4.ports = {{80, 80}, {8000, 8100}};
  proto::EgressRule r6;
  r6.family = AF_INET6;
  r6.addr = {0x20, 0x01, 0x0d, 0xb8};
  r6.prefixLen = 32;
  r6.ports = {{0, 65535}};
  s.egress = {r4, r6};
  s.paused = true;
  s.spec.network = true;
  return s;
}

TEST(SandboxStateTest, RoundTrips) {
  SandboxState s = sample();
  auto back = decodeSandboxState(encodeSandboxState(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->backend, s.backend);
  EXPECT_EQ(back->spec.id, s.spec.id);
  EXPECT_EQ(back->spec.layers, s.spec.layers);
  EXPECT_EQ(back->spec.cpu, s.spec.cpu);
  EXPECT_EQ(back->spec.memoryBytes, s.spec.memoryBytes);
  EXPECT_EQ(back->spec.diskBytes, s.spec.diskBytes);
  EXPECT_EQ(back->spec.pids, s.spec.pids);
  EXPECT_EQ(back->pid, s.pid);
  EXPECT_EQ(back->startTime, s.startTime);
  EXPECT_EQ(back->egress, s.egress);
  EXPECT_TRUE(back->paused);
  EXPECT_TRUE(back->spec.network);
}

TEST(SandboxStateTest, HibernatedRoundTripsWithoutAProcess) {
  SandboxState s = sample();
  EXPECT_EQ(encodeSandboxState(s).find("hibernated"), std::string::npos);
  s.hibernated = true;
  s.pid = -1;
  s.startTime = 0;
  auto back = decodeSandboxState(encodeSandboxState(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_TRUE(back->hibernated);
  EXPECT_EQ(back->pid, -1);
  // A hibernated record with a pid, or a live one without, is malformed.
  s.pid = 4242;
  EXPECT_FALSE(decodeSandboxState(encodeSandboxState(s)).isOk());
  s.hibernated = false;
  s.pid = -1;
  EXPECT_FALSE(decodeSandboxState(encodeSandboxState(s)).isOk());
  // Records written before the field existed read as not hibernated.
  auto old = decodeSandboxState(encodeSandboxState(sample()));
  ASSERT_TRUE(old.isOk());
  EXPECT_FALSE(old->hibernated);
}

// Issue 31: a sandbox's host id range is kept for re-adoption; a record of an
// older edge has none, and a range including host root or (uid_t)-1 is refused.
TEST(SandboxStateTest, IdRangeRoundTripsAndIsChecked) {
  SandboxState s = sample();
  EXPECT_EQ(encodeSandboxState(s).find("userns"), std::string::npos);
  auto old = decodeSandboxState(encodeSandboxState(s));
  ASSERT_TRUE(old.isOk());
  EXPECT_TRUE(old->userns.empty());
  s.userns = IdRange{589824, 65536};
  auto back = decodeSandboxState(encodeSandboxState(s));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->userns, (IdRange{589824, 65536}));
  for (auto [base, length] : {std::pair<uint64_t, uint64_t>{0, 65536}, {589824, 0},
                              {0xffff0000ull, 0x10000}}) {
    std::string text = encodeSandboxState(s);
    std::string want = "\"userns\":{\"base\":589824,\"length\":65536}";
    size_t at = text.find(want);
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, want.size(), "\"userns\":{\"base\":" + std::to_string(base) +
                                      ",\"length\":" + std::to_string(length) + "}");
    auto bad = decodeSandboxState(text);
    EXPECT_FALSE(bad.isOk()) << text;
  }
}

TEST(SandboxStateTest, RefusesMalformed) {
  EXPECT_FALSE(decodeSandboxState("").isOk());
  EXPECT_FALSE(decodeSandboxState("[]").isOk());
  EXPECT_FALSE(decodeSandboxState(R"({"version":1})").isOk());
  std::string text = encodeSandboxState(sample());
  auto bad = text;
  bad.replace(bad.find("\"pid\":4242"), 10, "\"pid\":1");
  EXPECT_FALSE(decodeSandboxState(bad).isOk());
  bad = text;
  bad.replace(bad.find("\"prefix\":16"), 11, "\"prefix\":99");
  EXPECT_FALSE(decodeSandboxState(bad).isOk());
}

TEST(SandboxStateTest, DirectoryKeepsOneRecordPerSandbox) {
  std::string dir = "/tmp/dsec-state-test-" + randomHex(4);
  SandboxStateDir d(dir);
  ASSERT_TRUE(d.open().isOk());
  SandboxState s = sample();
  ASSERT_TRUE(d.put(s).isOk());
  s.paused = false;
  ASSERT_TRUE(d.put(s).isOk());  // replaced, not added
  ASSERT_TRUE(writeFileAtomic(dir + "/sb-ffffffffffffffff.json", "{torn").isOk());
  std::vector<std::string> bad;
  auto all = d.loadAll(&bad);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_FALSE(all[0].paused);
  EXPECT_EQ(bad, std::vector<std::string>{"sb-ffffffffffffffff.json"});
  d.remove(s.spec.id);
  d.remove(s.spec.id);  // missing is fine
  EXPECT_TRUE(d.loadAll().empty());
  EXPECT_TRUE(removeTree(dir).isOk());
}

TEST(SandboxStateTest, StartTimeOfThisProcess) {
  auto a = processStartTime(::getpid());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_GT(*a, 0u);
  EXPECT_EQ(*a, *processStartTime(::getpid()));
  EXPECT_FALSE(processStartTime(0x3fffffff).isOk());
}

}  // namespace
}  // namespace dsec::edge
