// ProcessSession's output window, reads from an offset, watchers and the
// start handshake, over a fake exec call (no node).
#include "platform/processes.h"

#include <gtest/gtest.h>

#include <signal.h>

#include <thread>

namespace dsec::platform {
namespace {

class FakeCall : public proto::ExecCall {
 public:
  void cancel() override { cancelled = true; }
  Status sendInput(std::string_view b) override {
    input.append(b);
    if (b.empty()) closed = true;
    return Status::ok();
  }
  Status resize(proto::TermSize s) override {
    size = s;
    return Status::ok();
  }
  Status signal(int sig) override {
    signals.push_back(sig);
    return Status::ok();
  }
  bool cancelled = false, closed = false;
  std::string input;
  proto::TermSize size;
  std::vector<int> signals;
};

std::shared_ptr<ProcessSession> session(bool pty = true) {
  proto::ExecSpec spec;
  spec.argv = {"/bin/sh"};
  if (pty) spec.pty = proto::TermSize{24, 80};
  spec.interactive = true;
  return std::make_shared<ProcessSession>("sb", spec, "t", 1.0);
}

std::string joined(const ProcessSession::Read& r) {
  std::string s;
  for (auto& c : r.chunks) s += c.data;
  return s;
}

TEST(ProcessSessionTest, ReadsFromAnyOffsetInOrderAcrossStreams) {
  auto s = session(false);
  s->output(false, "out1 ");
  s->output(true, "err1 ");
  s->output(false, "out2");
  auto r = s->read(0, 1 << 20);
  EXPECT_FALSE(r.gap);
  ASSERT_EQ(r.chunks.size(), 3u);
  EXPECT_EQ(r.chunks[1].isErr, true);
  EXPECT_EQ(r.chunks[1].offset, 5u);
  EXPECT_EQ(joined(r), "out1 err1 out2");
  EXPECT_EQ(r.next, 14u);
  EXPECT_FALSE(r.ended);
  // From the middle of a chunk, and in slices.
  r = s->read(7, 4);
  EXPECT_EQ(joined(r), "r1 o");
  EXPECT_EQ(r.chunks[0].offset, 7u);
  EXPECT_EQ(r.next, 11u);
  // Past the end: nothing yet.
  r = s->read(100, 10);
  EXPECT_TRUE(r.chunks.empty());
  EXPECT_EQ(r.next, 14u);
}

TEST(ProcessSessionTest, WindowDropsTheOldestAndReportsAGap) {
  auto s = session();
  std::string block(300u << 10, 'a');
  for (char c : std::string("abcde")) {
    block.assign(300u << 10, c);
    s->output(false, block);
  }
  auto r = s->read(0, 8u << 20);
  ASSERT_TRUE(r.gap);
  // At most the window is kept, and it is the latest bytes.
  std::string got = joined(r);
  EXPECT_LE(got.size(), kProcessOutputKept);
  EXPECT_EQ(*r.gap + got.size(), 5 * (300u << 10));
  EXPECT_EQ(got.back(), 'e');
  // One write larger than the window keeps its tail.
  s->output(false, std::string(kProcessOutputKept + 10, 'z') + "END");
  r = s->read(0, 8u << 20);
  got = joined(r);
  EXPECT_EQ(got.size(), kProcessOutputKept);
  EXPECT_EQ(got.substr(got.size() - 3), "END");
}

TEST(ProcessSessionTest, EndIsReadOnlyAfterEveryByte) {
  auto s = session();
  s->started(42);
  s->output(false, "bye");
  proto::ExecResult res;
  res.exitCode = 3;
  s->done(res);
  EXPECT_FALSE(s->running());
  auto r = s->read(0, 2);
  EXPECT_FALSE(r.ended);
  r = s->read(r.next, 100);
  EXPECT_TRUE(r.ended);
  ASSERT_TRUE(r.result && r.result->isOk());
  EXPECT_EQ((*r.result)->exitCode, 3);
  EXPECT_NE(s->infoJson().find("\"exit_code\":3"), std::string::npos);
  // Input to an ended process is refused.
  EXPECT_EQ(s->sendInput("x").code(), Code::kFailedPrecondition);
}

TEST(ProcessSessionTest, AwaitStartGivesThePidOrTheError) {
  auto s = session();
  std::thread t([s] { s->started(7); });
  auto pid = s->awaitStart(5);
  t.join();
  ASSERT_TRUE(pid.isOk());
  EXPECT_EQ(*pid, 7);

  auto failed = session();
  failed->done(Status(Code::kNotFound, "sandbox x is not running"));
  EXPECT_EQ(failed->awaitStart(5).status().code(), Code::kNotFound);
  // Ended without a pid: a node that cannot run sessions.
  auto old = session();
  old->done(proto::ExecResult{});
  EXPECT_EQ(old->awaitStart(5).status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(session()->awaitStart(0.05).status().code(), Code::kDeadlineExceeded);
}

TEST(ProcessSessionTest, ControlGoesToTheCallAndResizeNeedsATerminal) {
  auto s = session();
  auto call = std::make_shared<FakeCall>();
  s->setCall(call);
  EXPECT_TRUE(s->sendInput("ls\n").isOk());
  EXPECT_TRUE(s->resize({50, 132}).isOk());
  EXPECT_TRUE(s->signal(2).isOk());
  s->kill();
  EXPECT_EQ(call->input, "ls\n");
  EXPECT_EQ(call->size.rows, 50);
  // kill is a SIGKILL (the process then ends with its exit, signal 9)...
  EXPECT_EQ(call->signals, (std::vector<int>{2, SIGKILL}));
  EXPECT_FALSE(call->cancelled);
  // ... or, where no signal can go, a cancel.
  class Unsignallable : public FakeCall {
    Status signal(int) override { return Status(Code::kFailedPrecondition, "no"); }
  };
  auto old = session();
  auto oc = std::make_shared<Unsignallable>();
  old->setCall(oc);
  old->kill();
  EXPECT_TRUE(oc->cancelled);
  auto plain = session(false);
  plain->setCall(std::make_shared<FakeCall>());
  EXPECT_EQ(plain->resize({10, 10}).field(), "pty");
}

TEST(ProcessSessionTest, WatchersSeeEachEventAndStopWhenTheySaySo) {
  auto s = session();
  int calls = 0;
  uint64_t h = s->watch([&] { return ++calls < 3; });
  EXPECT_EQ(calls, 1);  // what is there already
  s->output(false, "a");
  s->output(false, "b");
  EXPECT_EQ(calls, 3);
  s->output(false, "c");  // it said false: gone
  EXPECT_EQ(calls, 3);
  s->unwatch(h);  // harmless again
}

TEST(ProcessTableTest, RoomPidReuseAndSandboxDrop) {
  ProcessTable t;
  std::vector<std::shared_ptr<FakeCall>> calls;
  for (size_t i = 0; i < kMaxProcessesPerSandbox; ++i) {
    auto s = session();
    s->started(int(100 + i));
    calls.push_back(std::make_shared<FakeCall>());
    s->setCall(calls.back());
    ASSERT_TRUE(t.checkRoom("sb").isOk());
    t.add(s);
  }
  Status full = t.checkRoom("sb");
  EXPECT_EQ(full.code(), Code::kResourceExhausted);
  EXPECT_EQ(full.field(), "processes");
  EXPECT_TRUE(t.checkRoom("other").isOk());
  // One ends: room again; a new process with its pid replaces it.
  t.find("sb", 100)->done(proto::ExecResult{});
  EXPECT_TRUE(t.checkRoom("sb").isOk());
  auto again = session();
  again->started(100);
  t.add(again);
  EXPECT_EQ(t.find("sb", 100), again);
  EXPECT_EQ(t.list("sb").size(), kMaxProcessesPerSandbox);
  EXPECT_EQ(t.runningTotal(), kMaxProcessesPerSandbox);
  t.dropSandbox("sb");
  EXPECT_EQ(calls[5]->signals, std::vector<int>{SIGKILL});
  EXPECT_TRUE(t.list("sb").empty());
  EXPECT_EQ(t.find("sb", 101), nullptr);
}

}  // namespace
}  // namespace dsec::platform
