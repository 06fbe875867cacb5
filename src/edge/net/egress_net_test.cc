#include "edge/net/egress_net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>

#include "common/util.h"
#include "edge/net/net_test_util.h"

namespace dsec::edge {
namespace {

using testing::ip;
using testing::newNetns;
using testing::runIn;

sockaddr_in sockAddr(uint32_t addr, uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = addr;
  sa.sin_port = htons(port);
  return sa;
}

// A socket that lives in the netns `nsFd` (or here for -1).
UniqueFd socketIn(int nsFd, int domain, int type) {
  UniqueFd s;
  auto make = [&] { s.reset(socket(domain, type | SOCK_CLOEXEC, 0)); };
  if (nsFd < 0) {
    make();
  } else {
    runIn(nsFd, make);
  }
  return s;
}

// A UDP socket on addr:port (port 0: any), in the netns `nsFd`.
UniqueFd udpBound(int nsFd, uint32_t addr, uint16_t port = 0) {
  UniqueFd s = socketIn(nsFd, AF_INET, SOCK_DGRAM);
  sockaddr_in sa = sockAddr(addr, port);
  if (bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) s.reset();
  return s;
}

uint16_t portOf(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.sin_port);
}

// The source address of a datagram that arrives within timeoutMs.
std::optional<uint32_t> receiveFrom(int fd, int timeoutMs) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeoutMs) != 1) return std::nullopt;
  char buf[64];
  sockaddr_in from{};
  socklen_t len = sizeof from;
  if (recvfrom(fd, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &len) < 0) {
    return std::nullopt;
  }
  return from.sin_addr.s_addr;
}

bool sendUdp(int fd, uint32_t addr, uint16_t port) {
  sockaddr_in to = sockAddr(addr, port);
  return sendto(fd, "x", 1, 0, reinterpret_cast<sockaddr*>(&to), sizeof to) == 1;
}

// 0 when a TCP connect from `fd` to addr:port completes within timeoutMs,
// ETIMEDOUT when nothing answers, else the connect error (ECONNREFUSED...).
int tcpConnect(int fd, uint32_t addr, uint16_t port, int timeoutMs) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  sockaddr_in to = sockAddr(addr, port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{fd, POLLOUT, 0};
  if (poll(&p, 1, timeoutMs) != 1) return ETIMEDOUT;
  int err = 0;
  socklen_t len = sizeof err;
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  return err;
}

std::string shell(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

// net.ipv4.ip_forward of the calling thread's netns.
std::string ipForward() {
  auto r = readFile("/proc/sys/net/ipv4/ip_forward");
  return r.isOk() ? r->substr(0, 1) : "?";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Each test runs its main thread in a fresh netns standing in for the host:
// the nftables table, ip_forward and the links all live there, nothing the
// test does (or leaks on a crash) reaches the real host, and leaving the
// netns destroys whatever is left at no cost.
class EgressNetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces, links and nftables";
    if (access("/usr/sbin/nft", X_OK) != 0) GTEST_SKIP() << "needs nftables (/usr/sbin/nft)";
    realHost_.reset(open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(realHost_.valid());
    if (unshare(CLONE_NEWNET) != 0) GTEST_SKIP() << "unshare(CLONE_NEWNET): " << strerror(errno);
    Result<Rtnl> r = Rtnl::open();
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    rtnl_ = std::make_unique<Rtnl>(std::move(r).value());
    Status lo = rtnl_->setUp("lo");
    if (lo.code() == Code::kPermissionDenied) GTEST_SKIP() << lo.toString();
    ASSERT_TRUE(lo.isOk()) << lo.toString();
  }
  void TearDown() override {
    net_.reset();
    rtnl_.reset();
    if (realHost_.valid()) {
      ASSERT_EQ(setns(realHost_.get(), CLONE_NEWNET), 0) << strerror(errno);
    }
  }

  void startNet(bool nat = true, const std::string& subnet = "10.88.0.0/16") {
    EgressNetConfig c;
    c.subnet = subnet;
    c.tag = "t-" + randomHex(4);
    c.enableNat = nat;
    auto r = EgressNet::start(c);
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    net_ = std::move(r).value();
  }

  // An "outside world" netns behind a plain veth (xo0 here, eth0 there):
  // 198.18.0.1 here, 198.18.0.2 there, default route back through here.
  UniqueFd makeOutside() {
    UniqueFd ns = newNetns();
    EXPECT_TRUE(rtnl_->createVeth("xo0", "eth0", ns.get()).isOk());
    EXPECT_TRUE(rtnl_->addAddress4("xo0", ip("198.18.0.1"), 30).isOk());
    EXPECT_TRUE(rtnl_->setUp("xo0").isOk());
    Result<Rtnl> out = Rtnl::open(ns.get());
    EXPECT_TRUE(out.isOk());
    EXPECT_TRUE(out->addAddress4("eth0", ip("198.18.0.2"), 30).isOk());
    EXPECT_TRUE(out->setUp("eth0").isOk());
    EXPECT_TRUE(out->addDefaultRoute4(ip("198.18.0.1")).isOk());
    return ns;
  }

  std::unique_ptr<Rtnl> rtnl_;  // in the stand-in host netns
  std::unique_ptr<EgressNet> net_;
  UniqueFd realHost_;
};

TEST(EgressNetConfigTest, RejectsBadSubnetsAndTags) {
  // Each config below also names a missing nft: should validation ever let
  // one through, start() fails before it touches this host.
  for (const char* subnet : {"", "10.88.0.0", "10.88.0.0/7", "10.88.0.0/25", "10.88.0.1/16",
                             "300.1.1.0/24", "10.88.0.0/16x", "10.88.0.0/", "::/64"}) {
    EgressNetConfig c;
    c.subnet = subnet;
    c.tag = "t1";
    c.nftPath = "/nonexistent/nft";
    auto r = EgressNet::start(c);
    ASSERT_FALSE(r.isOk()) << subnet;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << subnet;
    EXPECT_EQ(r.status().field(), "egress_subnet") << subnet;
  }
  for (const char* tag : {"", "a b", "a;b", "012345678901234567890123456789012"}) {
    EgressNetConfig c;
    c.tag = tag;
    c.nftPath = "/nonexistent/nft";
    auto r = EgressNet::start(c);
    ASSERT_FALSE(r.isOk()) << tag;
    EXPECT_EQ(r.status().field(), "egress_tag") << tag;
  }
  EgressNetConfig c;
  c.tag = "t1";
  c.nftPath = "/nonexistent/nft";
  auto r = EgressNet::start(c);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(contains(r.status().message(), "nftables (nft) is needed for egress"))
      << r.status().message();
}

TEST_F(EgressNetTest, StartInstallsTheTableAndStopRemovesIt) {
  // A new netns inherits the real host's IPv4 settings: start from "off".
  ASSERT_TRUE(writeKnob("/proc/sys/net/ipv4/ip_forward", "0").isOk());
  startNet();
  EXPECT_TRUE(net_->enabledIpForward());
  EXPECT_EQ(ipForward(), "1");

  std::string table = shell("/usr/sbin/nft list table inet " + net_->tableName() + " 2>&1");
  for (const char* want : {
           "type nat hook postrouting priority srcnat; policy accept;",
           "ip saddr 10.88.0.0/16 oifname != \"dv*\" masquerade",
           "type filter hook input priority filter; policy accept;",
           "iifname \"dv*\" drop",
           "ip saddr 10.88.0.0/16 drop",
           "type filter hook forward priority filter; policy accept;",
           "iifname \"dv*\" oifname \"dv*\" drop",
           "iifname \"dv*\" fib saddr . iif oif missing drop",
       }) {
    EXPECT_TRUE(contains(table, want)) << want << "\n" << table;
  }

  // A second start of the same tag (a restarted edge) replaces the table.
  EgressNetConfig again;
  again.tag = net_->tableName().substr(5);
  again.enableNat = false;
  auto second = EgressNet::start(again);
  ASSERT_TRUE(second.isOk()) << second.status().toString();
  EXPECT_FALSE((*second)->enabledIpForward());
  table = shell("/usr/sbin/nft list table inet " + net_->tableName() + " 2>&1");
  EXPECT_FALSE(contains(table, "masquerade")) << table;
  EXPECT_TRUE(contains(table, "chain forward")) << table;

  ASSERT_TRUE((*second)->stop().isOk());
  EXPECT_TRUE(net_->stop().isOk()) << "stop after someone else removed the table";
  EXPECT_EQ(shell("/usr/sbin/nft list tables"), "");
  EXPECT_EQ(ipForward(), "1") << "ip_forward stays on";
}

TEST_F(EgressNetTest, AttachGivesTheSandboxAnAddressAndARoute) {
  startNet();
  UniqueFd ns = newNetns();
  auto a = net_->attach("sbx-1", ns.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(ipv4String(a->address), "10.88.0.2");
  EXPECT_EQ(ipv4String(a->gateway), "10.88.0.1");
  EXPECT_EQ(a->prefixLen, 30);
  EXPECT_EQ(a->hostIfname, net_->ifnameFor("sbx-1"));
  EXPECT_EQ(a->hostIfname.size(), 14u);
  EXPECT_EQ(a->hostIfname.substr(0, 2), "dv");

  auto hostLinks = rtnl_->listLinks();
  ASSERT_TRUE(hostLinks.isOk());
  auto it = std::find_if(hostLinks->begin(), hostLinks->end(),
                         [&](const Link& l) { return l.name == a->hostIfname; });
  ASSERT_NE(it, hostLinks->end());
  EXPECT_EQ(it->alias, "dsec " + net_->tableName().substr(5) + " sbx-1");

  Result<Rtnl> in = Rtnl::open(ns.get());
  ASSERT_TRUE(in.isOk());
  auto nsLinks = in->listLinks();
  ASSERT_TRUE(nsLinks.isOk());
  ASSERT_EQ(nsLinks->size(), 2u);
  EXPECT_EQ(nsLinks->at(1).name, "eth0");

  // Host to sandbox: the sandbox's address is reachable from the host.
  UniqueFd rx = udpBound(ns.get(), INADDR_ANY);
  ASSERT_TRUE(rx.valid());
  UniqueFd tx = udpBound(-1, INADDR_ANY);
  ASSERT_TRUE(sendUdp(tx.get(), a->address, portOf(rx.get())));
  EXPECT_EQ(receiveFrom(rx.get(), 2000), std::optional<uint32_t>(a->gateway));

  // The sandbox's default route: a far address goes out from eth0's address.
  UniqueFd probe = socketIn(ns.get(), AF_INET, SOCK_DGRAM);
  sockaddr_in far = sockAddr(ip("203.0.113.9"), 9);
  ASSERT_EQ(connect(probe.get(), reinterpret_cast<sockaddr*>(&far), sizeof far), 0)
      << strerror(errno);
  sockaddr_in src{};
  socklen_t len = sizeof src;
  getsockname(probe.get(), reinterpret_cast<sockaddr*>(&src), &len);
  EXPECT_EQ(src.sin_addr.s_addr, a->address);

  auto dup = net_->attach("sbx-1", ns.get());
  EXPECT_EQ(dup.status().code(), Code::kAlreadyExists);
  EXPECT_EQ(net_->attach("bad id", ns.get()).status().field(), "sandbox_id");

  ASSERT_TRUE(net_->detach("sbx-1").isOk());
  EXPECT_EQ(rtnl_->ifindex(a->hostIfname).status().code(), Code::kNotFound);
  EXPECT_EQ(in->ifindex("eth0").status().code(), Code::kNotFound);
  EXPECT_TRUE(net_->detach("sbx-1").isOk()) << "detach twice";
  EXPECT_TRUE(net_->detach("never-attached").isOk());
}

TEST_F(EgressNetTest, SandboxesCannotReachTheHost) {
  startNet();
  UniqueFd outside = makeOutside();
  // No DAD, so the IPv6 link-local addresses are usable at once.
  ASSERT_TRUE(writeKnob("/proc/sys/net/ipv6/conf/default/accept_dad", "0").isOk());
  UniqueFd ns = newNetns();
  runIn(ns.get(),
        [] { ASSERT_TRUE(writeKnob("/proc/sys/net/ipv6/conf/default/accept_dad", "0").isOk()); });
  auto a = net_->attach("sbx-1", ns.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();

  // Host services on every address, IPv4 and IPv6.
  UniqueFd listener = socketIn(-1, AF_INET, SOCK_STREAM);
  sockaddr_in any = sockAddr(INADDR_ANY, 0);
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&any), sizeof any), 0);
  ASSERT_EQ(listen(listener.get(), 8), 0);
  const uint16_t tcpPort = portOf(listener.get());
  UniqueFd udp = udpBound(-1, INADDR_ANY);
  const uint16_t udpPort = portOf(udp.get());
  UniqueFd udp6 = socketIn(-1, AF_INET6, SOCK_DGRAM);
  sockaddr_in6 any6{};
  any6.sin6_family = AF_INET6;
  ASSERT_EQ(bind(udp6.get(), reinterpret_cast<sockaddr*>(&any6), sizeof any6), 0);
  socklen_t l6 = sizeof any6;
  getsockname(udp6.get(), reinterpret_cast<sockaddr*>(&any6), &l6);

  // The sandbox's ways in: TCP to the gateway and to another host address,
  // UDP from an address it made up, IPv6 to all link-local nodes.
  Result<Rtnl> in = Rtnl::open(ns.get());
  ASSERT_TRUE(in.isOk());
  ASSERT_TRUE(in->addAddress4("eth0", ip("192.0.2.7"), 32).isOk());
  UniqueFd spoofed = udpBound(ns.get(), ip("192.0.2.7"));
  ASSERT_TRUE(spoofed.valid());
  UniqueFd tx6 = socketIn(ns.get(), AF_INET6, SOCK_DGRAM);
  sockaddr_in6 allNodes{};
  allNodes.sin6_family = AF_INET6;
  allNodes.sin6_port = any6.sin6_port;
  inet_pton(AF_INET6, "ff02::1", &allNodes.sin6_addr);
  runIn(ns.get(), [&] { allNodes.sin6_scope_id = if_nametoindex("eth0"); });
  auto send6 = [&] {
    return sendto(tx6.get(), "x", 1, 0, reinterpret_cast<sockaddr*>(&allNodes), sizeof allNodes);
  };
  // Wait until the sandbox has a usable link-local source.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (send6() != 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  auto probe = [&](bool expectReach) {
    for (uint32_t target : {a->gateway, ip("198.18.0.1")}) {
      UniqueFd c = socketIn(ns.get(), AF_INET, SOCK_STREAM);
      int rc = tcpConnect(c.get(), target, tcpPort, expectReach ? 2000 : 300);
      EXPECT_EQ(rc, expectReach ? 0 : ETIMEDOUT) << ipv4String(target) << ": " << strerror(rc);
    }
    EXPECT_TRUE(sendUdp(spoofed.get(), a->gateway, udpPort));
    EXPECT_EQ(receiveFrom(udp.get(), expectReach ? 2000 : 300).has_value(), expectReach)
        << "UDP from a made-up source";
    EXPECT_EQ(send6(), 1) << strerror(errno);
    pollfd p{udp6.get(), POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, expectReach ? 2000 : 300), expectReach ? 1 : 0) << "IPv6 link-local";
  };
  probe(false);
  // The outside world still reaches the host: the drop is for sandboxes only.
  UniqueFd fromOutside = socketIn(outside.get(), AF_INET, SOCK_STREAM);
  EXPECT_EQ(tcpConnect(fromOutside.get(), ip("198.18.0.1"), tcpPort, 2000), 0);

  // Control: without the table every one of those ways gets in.
  ASSERT_TRUE(net_->stop().isOk());
  probe(true);
}

TEST_F(EgressNetTest, NatOutAndNoWayToOtherSandboxes) {
  startNet();
  UniqueFd outside = makeOutside();
  UniqueFd nsA = newNetns(), nsB = newNetns();
  auto a = net_->attach("sbx-a", nsA.get());
  auto b = net_->attach("sbx-b", nsB.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(ipv4String(b->address), "10.88.0.6");

  UniqueFd world = udpBound(outside.get(), INADDR_ANY);
  const uint16_t worldPort = portOf(world.get());
  UniqueFd txA = udpBound(nsA.get(), INADDR_ANY);
  UniqueFd rxB = udpBound(nsB.get(), INADDR_ANY);
  const uint16_t portB = portOf(rxB.get());

  // Out to the world, masqueraded as the host's address on that link.
  ASSERT_TRUE(sendUdp(txA.get(), ip("198.18.0.2"), worldPort));
  EXPECT_EQ(receiveFrom(world.get(), 2000), std::optional<uint32_t>(ip("198.18.0.1")));

  // Sandbox to sandbox: dropped, while the world reaches B fine.
  ASSERT_TRUE(sendUdp(txA.get(), b->address, portB));
  EXPECT_EQ(receiveFrom(rxB.get(), 300), std::nullopt) << "A reached B";
  UniqueFd txWorld = udpBound(outside.get(), INADDR_ANY);
  ASSERT_TRUE(sendUdp(txWorld.get(), b->address, portB));
  EXPECT_EQ(receiveFrom(rxB.get(), 2000), std::optional<uint32_t>(ip("198.18.0.2")));

  // A posing as B (B's address put on A's eth0) gets nowhere.
  Result<Rtnl> inA = Rtnl::open(nsA.get());
  ASSERT_TRUE(inA.isOk());
  ASSERT_TRUE(inA->addAddress4("eth0", b->address, 32).isOk());
  UniqueFd posing = udpBound(nsA.get(), b->address);
  ASSERT_TRUE(posing.valid());
  ASSERT_TRUE(sendUdp(posing.get(), ip("198.18.0.2"), worldPort));
  EXPECT_EQ(receiveFrom(world.get(), 300), std::nullopt) << "spoofed source forwarded";
}

TEST_F(EgressNetTest, WithoutNatTheSandboxAddressShows) {
  startNet(/*nat=*/false);
  UniqueFd outside = makeOutside();
  UniqueFd ns = newNetns();
  auto a = net_->attach("sbx-1", ns.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  UniqueFd world = udpBound(outside.get(), INADDR_ANY);
  UniqueFd tx = udpBound(ns.get(), INADDR_ANY);
  ASSERT_TRUE(sendUdp(tx.get(), ip("198.18.0.2"), portOf(world.get())));
  EXPECT_EQ(receiveFrom(world.get(), 2000), std::optional<uint32_t>(a->address));
}

TEST_F(EgressNetTest, DetachFreesTheSlotForReuse) {
  startNet(true, "10.77.1.0/24");
  UniqueFd ns1 = newNetns(), ns2 = newNetns(), ns3 = newNetns();
  auto a = net_->attach("a", ns1.get());
  auto b = net_->attach("b", ns2.get());
  ASSERT_TRUE(a.isOk() && b.isOk());
  EXPECT_EQ(ipv4String(a->address), "10.77.1.2");
  EXPECT_EQ(ipv4String(b->address), "10.77.1.6");
  ASSERT_TRUE(net_->detach("a").isOk());
  auto c = net_->attach("c", ns3.get());
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(ipv4String(c->address), "10.77.1.2");
  EXPECT_EQ(ipv4String(c->gateway), "10.77.1.1");
}

TEST_F(EgressNetTest, SkipsASlotWhoseHostAddressAnotherLinkHas) {
  // Another edge (or a crashed one's leftover) on the same subnet holds 10.77.2.1.
  startNet(true, "10.77.2.0/24");
  UniqueFd other = newNetns(), ns1 = newNetns();
  ASSERT_TRUE(rtnl_->createVeth("dvforeign", "eth0", other.get()).isOk());
  ASSERT_TRUE(rtnl_->addAddress4("dvforeign", ip("10.77.2.1"), 30).isOk());
  auto a = net_->attach("a", ns1.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(ipv4String(a->gateway), "10.77.2.5");
  EXPECT_TRUE(rtnl_->deleteLink("dvforeign").isOk());
}

TEST_F(EgressNetTest, ForgottenSlotWaitsForItsLinkToGo) {
  startNet();
  UniqueFd ns1 = newNetns(), ns2 = newNetns(), ns3 = newNetns();
  auto a = net_->attach("a", ns1.get());
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  net_->forget("a");
  // ns1 still lives, so does A's link: its /30 stays taken.
  auto b = net_->attach("b", ns2.get());
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(ipv4String(b->address), "10.88.0.6");

  ns1.reset();  // the kernel removes the pair with the netns, a little later
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (rtnl_->ifindex(a->hostIfname).isOk() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(rtnl_->ifindex(a->hostIfname).status().code(), Code::kNotFound);
  auto c = net_->attach("c", ns3.get());
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(ipv4String(c->address), "10.88.0.2");
}

TEST_F(EgressNetTest, FailedAttachLeavesNothing) {
  startNet();
  // A netns that already has an eth0: the veth cannot be made.
  UniqueFd taken = newNetns();
  Result<Rtnl> inTaken = Rtnl::open(taken.get());
  ASSERT_TRUE(inTaken.isOk());
  ASSERT_TRUE(inTaken->createVeth("eth0", "x0", -1).isOk());
  auto r = net_->attach("a", taken.get());
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kAlreadyExists) << r.status().toString();
  EXPECT_TRUE(contains(r.status().message(), "eth0")) << r.status().message();
  EXPECT_EQ(rtnl_->ifindex(net_->ifnameFor("a")).status().code(), Code::kNotFound);

  // A netns with a default route already: fails at the last step, after the
  // veth exists; the veth goes again.
  UniqueFd routed = newNetns();
  Result<Rtnl> inRouted = Rtnl::open(routed.get());
  ASSERT_TRUE(inRouted.isOk());
  ASSERT_TRUE(inRouted->createVeth("x0", "x1", -1).isOk());
  ASSERT_TRUE(inRouted->addAddress4("x0", ip("192.0.2.1"), 24).isOk());
  ASSERT_TRUE(inRouted->setUp("x0").isOk());
  ASSERT_TRUE(inRouted->addDefaultRoute4(ip("192.0.2.254")).isOk());
  r = net_->attach("b", routed.get());
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().sysErrno(), EEXIST) << r.status().toString();
  EXPECT_EQ(rtnl_->ifindex(net_->ifnameFor("b")).status().code(), Code::kNotFound);
  EXPECT_EQ(inRouted->ifindex("eth0").status().code(), Code::kNotFound);

  // Not a netns at all.
  UniqueFd notNs(open("/dev/null", O_RDONLY | O_CLOEXEC));
  r = net_->attach("c", notNs.get());
  EXPECT_EQ(r.status().sysErrno(), EINVAL) << r.status().toString();

  // None of that used up a /30.
  UniqueFd ns = newNetns();
  auto ok = net_->attach("d", ns.get());
  ASSERT_TRUE(ok.isOk()) << ok.status().toString();
  EXPECT_EQ(ipv4String(ok->address), "10.88.0.2");
}

TEST_F(EgressNetTest, CleanupOrphansDeletesOnlyThisEdgesDeadOnes) {
  startNet();
  UniqueFd ns1 = newNetns(), ns2 = newNetns(), ns3 = newNetns(), ns4 = newNetns();
  ASSERT_TRUE(net_->attach("a", ns1.get()).isOk());
  ASSERT_TRUE(net_->attach("b", ns2.get()).isOk());
  ASSERT_TRUE(net_->attach("c", ns3.get()).isOk());
  // Another edge's link, and one of this edge's from a crashed run.
  ASSERT_TRUE(rtnl_->createVeth("dvother", "dvother-p", -1).isOk());
  ASSERT_TRUE(rtnl_->setAlias("dvother", "dsec other-edge a").isOk());
  ASSERT_TRUE(rtnl_->createVeth("dvold", "dvold-p", -1).isOk());
  ASSERT_TRUE(rtnl_->setAlias("dvold", "dsec " + net_->tableName().substr(5) + " gone").isOk());

  EXPECT_EQ(net_->cleanupOrphans({"b"}), 3);
  EXPECT_FALSE(rtnl_->ifindex(net_->ifnameFor("a")).isOk());
  EXPECT_TRUE(rtnl_->ifindex(net_->ifnameFor("b")).isOk());
  EXPECT_FALSE(rtnl_->ifindex(net_->ifnameFor("c")).isOk());
  EXPECT_FALSE(rtnl_->ifindex("dvold").isOk());
  EXPECT_TRUE(rtnl_->ifindex("dvother").isOk());
  EXPECT_EQ(net_->cleanupOrphans({"b"}), 0);

  // a's and c's /30s are free again.
  auto d = net_->attach("d", ns4.get());
  ASSERT_TRUE(d.isOk()) << d.status().toString();
  EXPECT_EQ(ipv4String(d->address), "10.88.0.2");
}

// Not a test: timings for the report. Run with
// --gtest_also_run_disabled_tests --gtest_filter='*Timing*'.
TEST_F(EgressNetTest, DISABLED_Timing) {
  startNet();
  auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  constexpr int kRounds = 50;
  std::vector<double> attachDetach, detachOnly, attachForget, linkGone;
  for (int i = 0; i < kRounds; ++i) {
    UniqueFd ns = newNetns();
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(net_->attach("s", ns.get()).isOk());
    auto t1 = std::chrono::steady_clock::now();
    ASSERT_TRUE(net_->detach("s").isOk());
    auto t2 = std::chrono::steady_clock::now();
    attachDetach.push_back(ms(t1 - t0));
    detachOnly.push_back(ms(t2 - t1));
  }
  for (int i = 0; i < kRounds; ++i) {
    UniqueFd ns = newNetns();
    std::string id = "f" + std::to_string(i);
    auto t0 = std::chrono::steady_clock::now();
    auto a = net_->attach(id, ns.get());
    ASSERT_TRUE(a.isOk()) << a.status().toString();
    auto t1 = std::chrono::steady_clock::now();
    net_->forget(id);
    ns.reset();
    auto t2 = std::chrono::steady_clock::now();
    while (rtnl_->ifindex(a->hostIfname).isOk())
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    auto t3 = std::chrono::steady_clock::now();
    attachForget.push_back(ms(t1 - t0));
    linkGone.push_back(ms(t3 - t2));
  }
  printf("attach (then detach): median %.2f ms; detach median %.2f ms\n", median(attachDetach),
         median(detachOnly));
  printf("attach (then forget + netns close): median %.2f ms; link gone after median %.2f ms\n",
         median(attachForget), median(linkGone));
}

}  // namespace
}  // namespace dsec::edge
