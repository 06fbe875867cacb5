#include "edge/port_registry.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "common/fd.h"

namespace dsec::edge {
namespace {

// A connected TCP pair on this netns's loopback: the "caller's" end (what
// openPort returned) and the "sandbox's" end.
struct TcpPair {
  UniqueFd caller, sandbox;
};

TcpPair tcpPair() {
  TcpPair p;
  UniqueFd l(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l.get(), 4) != 0 ||
      getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ADD_FAILURE() << "listen: " << strerror(errno);
    return p;
  }
  p.caller.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (connect(p.caller.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ADD_FAILURE() << "connect: " << strerror(errno);
  }
  p.sandbox.reset(accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
  return p;
}

// What a blocking read of up to 16 bytes gets within 2 s: -2 for nothing.
ssize_t readWithin(int fd, std::string* got = nullptr) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 2000) != 1) return -2;
  char buf[16];
  ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n > 0 && got) got->assign(buf, size_t(n));
  return n;
}

TEST(PortRegistry, UntilToldItTrustsTheCallersGeneration) {
  PortRegistry r;
  EXPECT_TRUE(r.check("sb", 8080, 7).isOk());
  auto p = tcpPair();
  ASSERT_TRUE(r.add("sb", 8080, 7, p.caller.get()).isOk());
  EXPECT_EQ(r.connections("sb"), 1u);
}

TEST(PortRegistry, ASetRefusesPairsOutsideIt) {
  PortRegistry r;
  EXPECT_EQ(r.set("sb", {{8080, 2}, {9000, 1}}), 0u);
  EXPECT_TRUE(r.check("sb", 8080, 2).isOk());
  EXPECT_TRUE(r.check("sb", 9000, 1).isOk());
  for (auto [port, gen] : {std::pair{8080, uint64_t(1)}, {8081, uint64_t(2)}}) {
    Status st = r.check("sb", port, gen);
    EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
    EXPECT_EQ(st.field(), "port");
  }
  // add() checks too (a set given while the connect ran).
  auto p = tcpPair();
  Status st = r.add("sb", 8080, 1, p.caller.get());
  EXPECT_EQ(st.code(), Code::kPermissionDenied);
  EXPECT_EQ(r.connections("sb"), 0u);
  // Other sandboxes are not concerned; the empty set exposes nothing.
  EXPECT_TRUE(r.check("other", 8080, 1).isOk());
  r.set("sb", {});
  EXPECT_EQ(r.check("sb", 8080, 2).code(), Code::kPermissionDenied);
}

TEST(PortRegistry, DroppingAPairCutsItsConnectionsForTheHolderToo) {
  PortRegistry r;
  r.set("sb", {{8080, 1}, {9000, 1}});
  auto kept = tcpPair();
  auto cutOff = tcpPair();
  ASSERT_TRUE(r.add("sb", 9000, 1, kept.caller.get()).isOk());
  ASSERT_TRUE(r.add("sb", 8080, 1, cutOff.caller.get()).isOk());
  // Rotating 8080 (gen 2) cuts the gen-1 connection only.
  EXPECT_EQ(r.set("sb", {{8080, 2}, {9000, 1}}), 1u);
  // The holder of the cut socket reads EOF and cannot write; the sandbox's
  // end reads EOF.
  EXPECT_EQ(readWithin(cutOff.caller.get()), 0);
  EXPECT_EQ(send(cutOff.caller.get(), "x", 1, MSG_NOSIGNAL), -1);
  EXPECT_EQ(errno, EPIPE);
  EXPECT_EQ(readWithin(cutOff.sandbox.get()), 0);
  // The other one carries bytes as before.
  ASSERT_EQ(send(kept.caller.get(), "hi", 2, MSG_NOSIGNAL), 2);
  std::string got;
  EXPECT_EQ(readWithin(kept.sandbox.get(), &got), 2);
  EXPECT_EQ(got, "hi");
  EXPECT_EQ(r.connections("sb"), 1u);
}

TEST(PortRegistry, TheHoldersCloseIsNotHeldOpenByTheBook) {
  PortRegistry r;
  auto p = tcpPair();
  ASSERT_TRUE(r.add("sb", 8080, 1, p.caller.get()).isOk());
  p.caller.reset();
  // The sandbox sees the connection end: nothing kept the socket open.
  EXPECT_EQ(readWithin(p.sandbox.get()), 0);
  EXPECT_EQ(r.connections("sb"), 0u);
}

TEST(PortRegistry, ANumberReusedBySomeOtherSocketIsNotCut) {
  PortRegistry r;
  auto p = tcpPair();
  int number = p.caller.get();
  ASSERT_TRUE(r.add("sb", 8080, 1, number).isOk());
  auto q = tcpPair();
  p.caller.reset();
  // The number now holds another connection's socket.
  ASSERT_EQ(dup3(q.caller.get(), number, O_CLOEXEC), number);
  UniqueFd reused(number);
  EXPECT_EQ(r.forget("sb"), 0u);
  ASSERT_EQ(send(q.caller.get(), "ok", 2, MSG_NOSIGNAL), 2);
  EXPECT_EQ(readWithin(q.sandbox.get()), 2);
}

TEST(PortRegistry, ForgetCutsEverythingAndForgetsTheSet) {
  PortRegistry r;
  r.set("sb", {{80, 1}});
  auto a = tcpPair();
  auto b = tcpPair();
  ASSERT_TRUE(r.add("sb", 80, 1, a.caller.get()).isOk());
  ASSERT_TRUE(r.add("sb", 80, 1, b.caller.get()).isOk());
  EXPECT_EQ(r.forget("sb"), 2u);
  EXPECT_EQ(readWithin(a.caller.get()), 0);
  EXPECT_EQ(readWithin(b.sandbox.get()), 0);
  EXPECT_EQ(r.connections("sb"), 0u);
  // A sandbox of the same id made later starts untold.
  EXPECT_TRUE(r.check("sb", 81, 9).isOk());
  EXPECT_EQ(r.forget("never-seen"), 0u);
}

TEST(PortRegistry, LiveConnectionsPerSandboxAreBounded) {
  PortRegistry r;
  auto p = tcpPair();
  // One socket recorded many times counts as that many live entries.
  for (size_t i = 0; i < PortRegistry::kMaxPerSandbox; ++i) {
    ASSERT_TRUE(r.add("sb", 80, 1, p.caller.get()).isOk()) << i;
  }
  Status st = r.add("sb", 80, 1, p.caller.get());
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.toString();
  EXPECT_EQ(st.field(), "port");
  EXPECT_TRUE(r.add("other", 80, 1, p.caller.get()).isOk());
  // Once they are gone there is room again.
  p.caller.reset();
  auto q = tcpPair();
  EXPECT_TRUE(r.add("sb", 80, 1, q.caller.get()).isOk());
  EXPECT_EQ(r.connections("sb"), 1u);
}

}  // namespace
}  // namespace dsec::edge
