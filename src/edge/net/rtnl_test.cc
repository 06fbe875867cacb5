#include "edge/net/rtnl.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <set>
#include <thread>

#include "edge/net/net_test_util.h"

namespace dsec::edge {
namespace {

using testing::ip;
using testing::newNetns;
using testing::runIn;

// Every test runs its main thread in a fresh netns standing in for the host,
// so nothing it makes (or leaks on a crash) reaches the real host; TearDown
// puts the thread back.
class RtnlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces and links";
    hostNs_.reset(open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(hostNs_.valid());
    if (unshare(CLONE_NEWNET) != 0) GTEST_SKIP() << "unshare(CLONE_NEWNET): " << strerror(errno);
    Result<Rtnl> r = Rtnl::open();
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    host_ = std::make_unique<Rtnl>(std::move(r).value());
    Status probe = host_->setUp("lo");
    if (probe.code() == Code::kPermissionDenied) GTEST_SKIP() << probe.toString();
    ASSERT_TRUE(probe.isOk()) << probe.toString();
  }
  void TearDown() override {
    host_.reset();
    if (hostNs_.valid()) {
      ASSERT_EQ(setns(hostNs_.get(), CLONE_NEWNET), 0) << strerror(errno);
    }
  }

  std::unique_ptr<Rtnl> host_;
  UniqueFd hostNs_;
};

std::vector<std::string> names(const std::vector<Link>& links) {
  std::vector<std::string> out;
  for (const auto& l : links) out.push_back(l.name);
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(RtnlTest, OpensInAnotherNetns) {
  UniqueFd ns = newNetns();
  ASSERT_TRUE(ns.valid());
  Result<Rtnl> r = Rtnl::open(ns.get());
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  auto links = r->listLinks();
  ASSERT_TRUE(links.isOk()) << links.status().toString();
  ASSERT_EQ(links->size(), 1u);
  EXPECT_EQ(links->at(0).name, "lo");
  EXPECT_EQ(links->at(0).ifindex, 1);

  UniqueFd notNs(open("/dev/null", O_RDONLY | O_CLOEXEC));
  Result<Rtnl> bad = Rtnl::open(notNs.get());
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().sysErrno(), EINVAL);
}

TEST_F(RtnlTest, VethPeerGoesStraightIntoTheNetns) {
  // The host has an eth0 of its own: the peer's name must not collide.
  ASSERT_TRUE(host_->createVeth("eth0", "other0", -1).isOk());
  UniqueFd ns = newNetns();
  Status st = host_->createVeth("dvtest0", "eth0", ns.get());
  ASSERT_TRUE(st.isOk()) << st.toString();

  auto hostLinks = host_->listLinks();
  ASSERT_TRUE(hostLinks.isOk());
  EXPECT_EQ(names(*hostLinks), (std::vector<std::string>{"dvtest0", "eth0", "lo", "other0"}));
  Result<Rtnl> in = Rtnl::open(ns.get());
  ASSERT_TRUE(in.isOk());
  auto nsLinks = in->listLinks();
  ASSERT_TRUE(nsLinks.isOk());
  EXPECT_EQ(names(*nsLinks), (std::vector<std::string>{"eth0", "lo"}));

  // Deleting the host side takes the peer along.
  ASSERT_TRUE(host_->deleteLink("dvtest0").isOk());
  EXPECT_EQ(in->ifindex("eth0").status().code(), Code::kNotFound);
  EXPECT_TRUE(host_->deleteLink("dvtest0").isOk()) << "a missing link is ok";
}

TEST_F(RtnlTest, AliasAndIfindexMatchTheDump) {
  ASSERT_TRUE(host_->createVeth("va0", "vb0", -1).isOk());
  ASSERT_TRUE(host_->setAlias("va0", "dsec t1 sandbox-1").isOk());
  auto links = host_->listLinks();
  ASSERT_TRUE(links.isOk());
  auto it = std::find_if(links->begin(), links->end(), [](auto& l) { return l.name == "va0"; });
  ASSERT_NE(it, links->end());
  EXPECT_EQ(it->alias, "dsec t1 sandbox-1");
  Result<int> index = host_->ifindex("va0");
  ASSERT_TRUE(index.isOk());
  EXPECT_EQ(*index, it->ifindex);
  for (const auto& l : *links) {
    if (l.name != "va0") {
      EXPECT_EQ(l.alias, "") << l.name;
    }
  }
}

TEST_F(RtnlTest, AddressesAndDefaultRouteCarryTraffic) {
  UniqueFd ns = newNetns();
  ASSERT_TRUE(host_->createVeth("dvtest1", "eth0", ns.get()).isOk());
  ASSERT_TRUE(host_->addAddress4("dvtest1", ip("10.99.0.1"), 30).isOk());
  ASSERT_TRUE(host_->setUp("dvtest1").isOk());
  Result<Rtnl> in = Rtnl::open(ns.get());
  ASSERT_TRUE(in.isOk());
  ASSERT_TRUE(in->addAddress4("eth0", ip("10.99.0.2"), 30).isOk());
  ASSERT_TRUE(in->setUp("eth0").isOk());
  Status st = in->addDefaultRoute4(ip("10.99.0.1"));
  ASSERT_TRUE(st.isOk()) << st.toString();

  Status again = in->addDefaultRoute4(ip("10.99.0.1"));
  EXPECT_EQ(again.sysErrno(), EEXIST) << again.toString();
  Status dupAddr = in->addAddress4("eth0", ip("10.99.0.2"), 30);
  EXPECT_EQ(dupAddr.code(), Code::kAlreadyExists) << dupAddr.toString();

  // A host socket on the host side's address gets a datagram the netns sends.
  UniqueFd rx(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = ip("10.99.0.1");
  ASSERT_EQ(bind(rx.get(), reinterpret_cast<sockaddr*>(&to), sizeof to), 0) << strerror(errno);
  socklen_t len = sizeof to;
  ASSERT_EQ(getsockname(rx.get(), reinterpret_cast<sockaddr*>(&to), &len), 0);

  sockaddr_in viaDefault{};
  runIn(ns.get(), [&] {
    UniqueFd tx(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    ASSERT_EQ(sendto(tx.get(), "hi", 2, 0, reinterpret_cast<sockaddr*>(&to), sizeof to), 2)
        << strerror(errno);
    // The default route: a far address resolves through eth0's address.
    UniqueFd probe(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_in far{};
    far.sin_family = AF_INET;
    far.sin_port = htons(9);
    far.sin_addr.s_addr = ip("203.0.113.9");
    ASSERT_EQ(connect(probe.get(), reinterpret_cast<sockaddr*>(&far), sizeof far), 0)
        << strerror(errno);
    socklen_t l = sizeof viaDefault;
    getsockname(probe.get(), reinterpret_cast<sockaddr*>(&viaDefault), &l);
  });
  EXPECT_EQ(viaDefault.sin_addr.s_addr, ip("10.99.0.2"));

  pollfd p{rx.get(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 2000), 1) << "no datagram from the netns";
  char buf[8];
  sockaddr_in from{};
  socklen_t fl = sizeof from;
  ASSERT_EQ(recvfrom(rx.get(), buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &fl), 2);
  EXPECT_EQ(from.sin_addr.s_addr, ip("10.99.0.2"));
}

TEST_F(RtnlTest, ErrorsNameTheLinkAndKeepErrno) {
  ASSERT_TRUE(host_->createVeth("dvdup0", "dvdup1", -1).isOk());
  Status dup = host_->createVeth("dvdup0", "other1", -1);
  EXPECT_EQ(dup.code(), Code::kAlreadyExists);
  EXPECT_EQ(dup.sysErrno(), EEXIST);
  EXPECT_NE(dup.message().find("dvdup0"), std::string::npos) << dup.message();

  Status missing = host_->setUp("nosuch0");
  EXPECT_EQ(missing.code(), Code::kNotFound);
  EXPECT_EQ(missing.sysErrno(), ENODEV);
  EXPECT_NE(missing.message().find("nosuch0"), std::string::npos) << missing.message();
  EXPECT_EQ(host_->ifindex("nosuch0").status().code(), Code::kNotFound);
  EXPECT_EQ(host_->addAddress4("nosuch0", ip("10.1.1.1"), 24).code(), Code::kNotFound);
  EXPECT_TRUE(host_->deleteLink("nosuch0").isOk());

  Status longName = host_->createVeth("a-name-too-long0", "x", -1);
  EXPECT_EQ(longName.code(), Code::kInvalidArgument);
  EXPECT_EQ(longName.field(), "ifname");
  EXPECT_EQ(host_->setUp("a/b").code(), Code::kInvalidArgument);

  Status noRoute = host_->addDefaultRoute4(ip("192.0.2.1"));  // gateway on no link
  EXPECT_FALSE(noRoute.isOk());
  EXPECT_EQ(noRoute.sysErrno(), ENETUNREACH) << noRoute.toString();
}

TEST_F(RtnlTest, DumpSpansManyReads) {
  // ~1 KB per link and at most 32 KB per dump batch: 150 links take several.
  std::set<std::string> want{"lo"};
  for (int i = 0; i < 75; ++i) {
    std::string a = "va" + std::to_string(i), b = "vb" + std::to_string(i);
    ASSERT_TRUE(host_->createVeth(a, b, -1).isOk());
    want.insert(a);
    want.insert(b);
  }
  auto links = host_->listLinks();
  ASSERT_TRUE(links.isOk()) << links.status().toString();
  std::set<std::string> got;
  for (const auto& l : *links) got.insert(l.name);
  EXPECT_EQ(got, want);
  EXPECT_EQ(links->size(), want.size());
  // The fake host netns goes away at TearDown and takes the links with it.
}

}  // namespace
}  // namespace dsec::edge
