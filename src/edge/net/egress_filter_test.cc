// Runs the real eBPF filter on a real cgroup v2 group: needs root, a v2
// hierarchy (/sys/fs/cgroup or, on hybrid hosts, /sys/fs/cgroup/unified) and
// a kernel that takes cgroup sock_addr programs; skips with the reason if not.
#include "edge/net/egress_filter.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>

namespace dsec::edge::net {
namespace {

using proto::compileEgress;
using proto::EgressEntry;
using proto::parseEgressEntry;

std::string v2Root() {
  for (const char* p : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
    struct statfs s {};
    if (statfs(p, &s) == 0 && s.f_type == CGROUP2_SUPER_MAGIC) return p;
  }
  return {};
}

// Runs `fn` in a child process placed in cgroup `dir`; returns its result
// (an errno, 0 for success) or -1 if the child failed otherwise.
int inGroup(const std::string& dir, const std::function<int()>& fn) {
  pid_t pid = fork();
  if (pid == 0) {
    std::ofstream(dir + "/cgroup.procs") << getpid() << std::flush;
    _exit(fn());
  }
  int ws = 0;
  waitpid(pid, &ws, 0);
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

int udpConnect(int family, const char* ip, int port) {
  int s = socket(family, SOCK_DGRAM, 0);
  if (s < 0) return 100;
  int rc;
  if (family == AF_INET) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, ip, &a.sin_addr);
    rc = connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(port);
    inet_pton(AF_INET6, ip, &a.sin6_addr);
    rc = connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  int err = rc == 0 ? 0 : errno;
  close(s);
  return err;
}

int udpSendTo(const char* ip, int port) {
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  int rc = int(sendto(s, "x", 1, 0, reinterpret_cast<sockaddr*>(&a), sizeof a));
  int err = rc >= 0 ? 0 : errno;
  close(s);
  return err;
}

class EgressFilterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for cgroups and eBPF";
    std::string root = v2Root();
    if (root.empty()) GTEST_SKIP() << "no cgroup v2 hierarchy mounted";
    parent_ = root + "/dsec-egress-test-" + std::to_string(getpid());
    ASSERT_EQ(mkdir(parent_.c_str(), 0755), 0) << parent_;
    sb_ = parent_ + "/sb-1";
    other_ = parent_ + "/sb-2";
    ASSERT_EQ(mkdir(sb_.c_str(), 0755), 0);
    ASSERT_EQ(mkdir(other_.c_str(), 0755), 0);
    auto f = EgressFilter::start(parent_);
    if (!f.isOk()) GTEST_SKIP() << "eBPF egress filter unavailable: " << f.status().toString();
    filter_ = std::move(*f);
    cg_ = *EgressFilter::cgroupId(sb_);
  }
  void TearDown() override {
    filter_.reset();
    for (auto& d : {sb_, other_, parent_}) {
      if (!d.empty()) rmdir(d.c_str());
    }
  }
  std::string parent_, sb_, other_;
  std::unique_ptr<EgressFilter> filter_;
  uint64_t cg_ = 0;
};

EgressEntry entry(const std::string& s) { return *parseEgressEntry(s, "egress"); }

TEST_F(EgressFilterTest, ClosedUntilRulesAllowAndSwitchesLive) {
  // Not a known sandbox: only loopback.
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "127.0.0.1", 53); }), 0);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET6, "::1", 53); }), 0);

  ASSERT_TRUE(filter_->addSandbox(cg_).isOk());
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);
  auto d = filter_->denials(cg_);
  ASSERT_TRUE(d.isOk());
  EXPECT_EQ(d->count, 1u);
  EXPECT_EQ(d->last, "198.51.100.7:53");

  auto rules = compileEgress({entry("198.51.100.0/24:53")}, "egress");
  ASSERT_TRUE(rules.isOk());
  ASSERT_TRUE(filter_->setRules(cg_, *rules).isOk());
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), 0);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 54); }), EPERM);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.101.7", 53); }), EPERM);
  EXPECT_EQ(inGroup(sb_, [] { return udpSendTo("198.51.100.9", 53); }), 0);
  EXPECT_EQ(inGroup(sb_, [] { return udpSendTo("198.51.100.9", 80); }), EPERM);
  // An IPv4-mapped IPv6 address is checked as the IPv4 address it is.
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET6, "::ffff:198.51.100.7", 53); }), 0);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET6, "::ffff:198.51.100.7", 80); }), EPERM);
  // Another sandbox's rules are its own.
  EXPECT_EQ(inGroup(other_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);
  // A group made below the sandbox's own is still the sandbox.
  std::string sub = sb_ + "/inner";
  ASSERT_EQ(mkdir(sub.c_str(), 0755), 0);
  EXPECT_EQ(inGroup(sub, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), 0);
  EXPECT_EQ(inGroup(sub, [] { return udpConnect(AF_INET, "198.51.100.7", 80); }), EPERM);
  rmdir(sub.c_str());
  EXPECT_EQ(filter_->denials(cg_)->count, 6u);  // 1 before the rules, 5 after

  // The switch back to no egress applies to the next connect.
  ASSERT_TRUE(filter_->setRules(cg_, {}).isOk());
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);

  filter_->removeSandbox(cg_);
  EXPECT_FALSE(filter_->denials(cg_).isOk());
}

TEST_F(EgressFilterTest, IPv6RulesAndPortRanges) {
  ASSERT_TRUE(filter_->addSandbox(cg_).isOk());
  auto rules = compileEgress({entry("[2001:db8::/32]:443,8000-8100")}, "egress");
  ASSERT_TRUE(filter_->setRules(cg_, *rules).isOk());
  // No IPv6 route may exist here: what matters is EPERM or not.
  EXPECT_NE(inGroup(sb_, [] { return udpConnect(AF_INET6, "2001:db8::5", 8050); }), EPERM);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET6, "2001:db8::5", 8101); }), EPERM);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET6, "2001:db9::5", 443); }), EPERM);
  EXPECT_EQ(filter_->denials(cg_)->last, "[2001:db9::5]:443");
}

TEST_F(EgressFilterTest, ASecondStartReplacesTheFirstsPrograms) {
  // A crashed edge's programs stay attached; the next start detaches them
  // once it knows the sandboxes it re-adopts.
  auto rules = compileEgress({entry("198.51.100.7:53")}, "egress");
  ASSERT_TRUE(filter_->addSandbox(cg_).isOk());
  ASSERT_TRUE(filter_->setRules(cg_, *rules).isOk());
  filter_->keepAttachedForNextEdge();  // as if it had crashed
  auto second = EgressFilter::start(parent_);
  ASSERT_TRUE(second.isOk()) << second.status().toString();
  // Both attached: the new one does not know the group yet, so it is closed.
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);
  ASSERT_TRUE((*second)->addSandbox(cg_).isOk());
  ASSERT_TRUE((*second)->setRules(cg_, *rules).isOk());
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), 0);
  // The old programs, with their rules, go; the new ones alone decide.
  (*second)->detachStale();
  auto narrower = compileEgress({entry("198.51.100.8:53")}, "egress");
  ASSERT_TRUE((*second)->setRules(cg_, *narrower).isOk());
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.8", 53); }), 0);
  EXPECT_EQ(inGroup(sb_, [] { return udpConnect(AF_INET, "198.51.100.7", 53); }), EPERM);
}

}  // namespace
}  // namespace dsec::edge::net
