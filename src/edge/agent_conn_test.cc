#include "edge/agent_conn.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <thread>

#include "common/util.h"

namespace dsec::edge {
namespace {

// The test plays the agent on the other end of a socketpair.
class AgentConnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    conn_ = std::make_shared<AgentConn>(UniqueFd(sv[0]), "test");
    peer_.reset(sv[1]);
    ASSERT_TRUE(reactor_.start().isOk());
    ASSERT_TRUE(reactor_.add(conn_).isOk());
  }
  void peerSend(uint32_t stream, proto::FrameType t, const std::string& payload) {
    std::string wire;
    proto::appendFrame(wire, stream, t, payload);
    ASSERT_EQ(write(peer_.get(), wire.data(), wire.size()), ssize_t(wire.size()));
  }
  proto::Frame peerRecv() {
    proto::Frame f;
    while (!dec_.next(f)) {
      char buf[4096];
      ssize_t n = read(peer_.get(), buf, sizeof buf);
      EXPECT_GT(n, 0);
      if (n <= 0) return f;
      EXPECT_TRUE(dec_.feed(buf, size_t(n)).isOk());
    }
    return f;
  }
  Reactor reactor_;
  std::shared_ptr<AgentConn> conn_;
  UniqueFd peer_;
  proto::FrameDecoder dec_;
};

TEST_F(AgentConnTest, RoutesInterleavedStreams) {
  auto a = conn_->openStream();
  auto b = conn_->openStream();
  ASSERT_NE(a->id(), b->id());
  peerSend(b->id(), proto::FrameType::kStdout, "to-b");
  peerSend(a->id(), proto::FrameType::kStdout, "to-a");
  peerSend(999, proto::FrameType::kStdout, "nobody");  // dropped
  auto fa = a->next(monoSeconds() + 5);
  auto fb = b->next(monoSeconds() + 5);
  ASSERT_TRUE(fa.isOk() && fb.isOk());
  EXPECT_EQ(fa->payload, "to-a");
  EXPECT_EQ(fb->payload, "to-b");
  auto none = a->next(monoSeconds() + 0.05);
  EXPECT_EQ(none.status().code(), Code::kDeadlineExceeded);
}

TEST_F(AgentConnTest, AgentCallMapsErrors) {
  std::thread peer([&] {
    auto req = peerRecv();
    EXPECT_EQ(req.type, proto::FrameType::kStat);
    peerSend(req.stream, proto::FrameType::kResult,
             R"({"ok":false,"code":"not_found","message":"stat /x: No such file","errno":2})");
  });
  auto r = agentCall(*conn_, proto::FrameType::kStat, R"({"path":"/x"})", 5);
  peer.join();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_EQ(r.status().sysErrno(), 2);
}

TEST_F(AgentConnTest, MistypedResultIsAnErrorNotACrash) {
  std::thread peer([&] {
    auto req = peerRecv();
    peerSend(req.stream, proto::FrameType::kResult, R"({"ok":"yes","code":5,"errno":"x"})");
  });
  auto r = agentCall(*conn_, proto::FrameType::kStat, R"({"path":"/x"})", 5);
  peer.join();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kInternal);
}

TEST_F(AgentConnTest, DeathFailsWaitersAndSends) {
  auto a = conn_->openStream();
  peer_.reset();  // the agent dies
  auto f = a->next(monoSeconds() + 5);
  EXPECT_EQ(f.status().code(), Code::kUnavailable);
  EXPECT_TRUE(conn_->dead());
  EXPECT_FALSE(conn_->send(1, proto::FrameType::kExec, "{}").isOk());
  auto late = conn_->openStream();
  EXPECT_EQ(late->next(monoSeconds() + 1).status().code(), Code::kUnavailable);
}

TEST_F(AgentConnTest, GarbageFromAgentKillsConnection) {
  auto a = conn_->openStream();
  const char junk[8] = {char(0xff), char(0xff), char(0xff), char(0x7f), 0, 0, 0, 0};
  ASSERT_EQ(write(peer_.get(), junk, sizeof junk), 8);
  EXPECT_EQ(a->next(monoSeconds() + 5).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::edge
