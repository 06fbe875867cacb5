#include "edge/net/netns_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "edge/net/net_test_util.h"
#include "edge/net/rtnl.h"

namespace dsec::edge {
namespace {

using testing::newNetns;

// A listening TCP socket on the loopback of `family` in the netns `ns`
// (here when < 0); its port in *port (0: any).
UniqueFd listenIn(int ns, int family, int* port, int backlog = 16) {
  auto s = socketInNetns(ns, family);
  if (!s.isOk()) return UniqueFd();
  UniqueFd fd = std::move(*s);
  int one = 1;
  (void)setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    in->sin_port = htons(uint16_t(*port));
    len = sizeof *in;
  } else {
    (void)setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_loopback;
    in6->sin6_port = htons(uint16_t(*port));
    len = sizeof *in6;
  }
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0 ||
      listen(fd.get(), backlog) != 0) {
    ADD_FAILURE() << "bind/listen: " << strerror(errno);
    return UniqueFd();
  }
  len = sizeof ss;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  *port = ntohs(family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                  : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return fd;
}

// accept() with a wait of up to `ms` (the listener is non-blocking).
UniqueFd acceptWithin(int listener, int ms) {
  pollfd p{listener, POLLIN, 0};
  if (poll(&p, 1, ms) != 1) return UniqueFd();
  return UniqueFd(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
}

// Each test's main thread runs in a fresh netns standing in for the host
// (so a listener "on the host" is on nothing real), and `sandbox_` is
// another fresh netns with its loopback up.
class NetnsSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root (CAP_SYS_ADMIN) for network namespaces";
    hostNs_.reset(open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(hostNs_.valid());
    if (unshare(CLONE_NEWNET) != 0) GTEST_SKIP() << "unshare(CLONE_NEWNET): " << strerror(errno);
    auto host = Rtnl::open();
    ASSERT_TRUE(host.isOk()) << host.status().toString();
    Status up = host->setUp("lo");
    if (up.code() == Code::kPermissionDenied) GTEST_SKIP() << up.toString();
    ASSERT_TRUE(up.isOk()) << up.toString();
    sandbox_ = newNetns();
    ASSERT_TRUE(sandbox_.valid()) << "a new netns: " << strerror(errno);
    auto r = Rtnl::open(sandbox_.get());
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    ASSERT_TRUE(r->setUp("lo").isOk());
  }
  void TearDown() override {
    if (hostNs_.valid()) {
      ASSERT_EQ(setns(hostNs_.get(), CLONE_NEWNET), 0) << strerror(errno);
    }
  }

  UniqueFd hostNs_, sandbox_;
};

TEST_F(NetnsSocketTest, ConnectsToTheSandboxsOwnLoopbackAndCarriesBytes) {
  int port = 0;
  UniqueFd l = listenIn(sandbox_.get(), AF_INET, &port);
  ASSERT_TRUE(l.valid());
  auto c = connectLoopback(sandbox_.get(), port, 5);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  UniqueFd server = acceptWithin(l.get(), 5000);
  ASSERT_TRUE(server.valid());
  // Non-blocking and close-on-exec, as the contract says.
  EXPECT_TRUE(fcntl(c->get(), F_GETFL) & O_NONBLOCK);
  EXPECT_TRUE(fcntl(c->get(), F_GETFD) & FD_CLOEXEC);
  ASSERT_EQ(send(c->get(), "ping", 4, MSG_NOSIGNAL), 4);
  char buf[8] = {};
  ASSERT_EQ(recv(server.get(), buf, sizeof buf, 0), 4);
  EXPECT_EQ(std::string(buf, 4), "ping");
  ASSERT_EQ(send(server.get(), "pong", 4, MSG_NOSIGNAL), 4);
  pollfd p{c->get(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1);
  ASSERT_EQ(recv(c->get(), buf, sizeof buf, 0), 4);
  EXPECT_EQ(std::string(buf, 4), "pong");
}

TEST_F(NetnsSocketTest, AListenerOfTheHostOnTheSamePortIsNotReached) {
  // Free the port in the sandbox, then listen on it on the "host" only.
  int port = 0;
  { UniqueFd probe = listenIn(sandbox_.get(), AF_INET, &port); }
  int hostPort = port;
  UniqueFd host4 = listenIn(-1, AF_INET, &hostPort);
  ASSERT_TRUE(host4.valid());
  ASSERT_EQ(hostPort, port);
  int hostPort6 = port;
  UniqueFd host6 = listenIn(-1, AF_INET6, &hostPort6);  // where the host has IPv6

  auto c = connectLoopback(sandbox_.get(), port, 2);
  ASSERT_FALSE(c.isOk());
  EXPECT_EQ(c.status().code(), Code::kUnavailable) << c.status().toString();
  EXPECT_EQ(c.status().message(), "nothing listens on port " + std::to_string(port));
  EXPECT_EQ(c.status().field(), "port");
  EXPECT_EQ(c.status().sysErrno(), ECONNREFUSED);
  EXPECT_FALSE(acceptWithin(host4.get(), 100).valid()) << "the host's listener was reached";
  if (host6) {
    EXPECT_FALSE(acceptWithin(host6.get(), 100).valid());
  }
  // And the host's own connect does reach it (the listener works).
  auto mine = connectLoopback(-1, port, 2);
  ASSERT_TRUE(mine.isOk()) << mine.status().toString();
  EXPECT_TRUE(acceptWithin(host4.get(), 5000).valid());
}

TEST_F(NetnsSocketTest, FallsBackToIpv6Loopback) {
  int port = 0;
  UniqueFd l = listenIn(sandbox_.get(), AF_INET6, &port);
  if (!l) GTEST_SKIP() << "the netns has no IPv6";
  auto c = connectLoopback(sandbox_.get(), port, 5);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  sockaddr_storage peer{};
  socklen_t len = sizeof peer;
  ASSERT_EQ(getpeername(c->get(), reinterpret_cast<sockaddr*>(&peer), &len), 0);
  EXPECT_EQ(peer.ss_family, AF_INET6);
  EXPECT_TRUE(acceptWithin(l.get(), 5000).valid());
}

TEST_F(NetnsSocketTest, ALoopbackThatIsDownIsNothingListening) {
  UniqueFd bare = newNetns();  // lo down
  ASSERT_TRUE(bare.valid());
  auto c = connectLoopback(bare.get(), 80, 2);
  ASSERT_FALSE(c.isOk());
  EXPECT_EQ(c.status().code(), Code::kUnavailable) << c.status().toString();
  EXPECT_EQ(c.status().field(), "port");
}

TEST_F(NetnsSocketTest, AFullAcceptQueueRunsIntoTheDeadline) {
  int port = 0;
  UniqueFd l = listenIn(sandbox_.get(), AF_INET, &port, 0);  // never accepted
  ASSERT_TRUE(l.valid());
  std::vector<UniqueFd> held;
  Status last;
  for (int i = 0; i < 8; ++i) {
    auto c = connectLoopback(sandbox_.get(), port, 0.3);
    if (!c.isOk()) {
      last = c.status();
      break;
    }
    held.push_back(std::move(*c));
  }
  EXPECT_EQ(last.code(), Code::kDeadlineExceeded) << last.toString();
  EXPECT_EQ(last.field(), "port");
}

TEST_F(NetnsSocketTest, BadArgumentsAreRefusedClearly) {
  auto c = connectLoopback(sandbox_.get(), 0, 1);
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(c.status().field(), "port");
  c = connectLoopback(sandbox_.get(), 65536, 1);
  EXPECT_EQ(c.status().field(), "port");
  UniqueFd notNs(open("/dev/null", O_RDONLY | O_CLOEXEC));
  auto s = socketInNetns(notNs.get(), AF_INET);
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.status().sysErrno(), EINVAL) << s.status().toString();
}

}  // namespace
}  // namespace dsec::edge
