// QgaBridge against a fake qemu-guest-agent: what agent-protocol requests
// become in qga commands, and how qga's answers come back as frames.
#include "edge/backends/vm/qga.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "common/base64.h"
#include "common/util.h"

namespace dsec::edge {
namespace {

using nlohmann::json;

// Answers qga commands on one end of a socketpair; records what it was asked.
class FakeQga {
 public:
  explicit FakeQga(int fd) : fd_(fd) {
    thread_ = std::thread([this] { loop(); });
  }
  ~FakeQga() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  std::vector<json> asked() {
    std::lock_guard lk(mu_);
    return asked_;
  }
  int exitSignal = 0;  // guest-exec-status reports this signal when set
  std::atomic<bool> holdExit{false};  // guest-exec-status says "running" while set

 private:
  void reply(const std::string& line) { (void)::send(fd_, line.data(), line.size(), MSG_NOSIGNAL); }
  void loop() {
    std::string buf;
    char tmp[65536];
    for (;;) {
      ssize_t n = ::read(fd_, tmp, sizeof tmp);
      if (n <= 0) return;
      for (ssize_t i = 0; i < n; ++i) {
        if (tmp[i] != '\xff') buf += tmp[i];
      }
      size_t nl;
      while ((nl = buf.find('\n')) != std::string::npos) {
        json j = json::parse(buf.substr(0, nl), nullptr, false);
        buf.erase(0, nl + 1);
        if (!j.is_object()) continue;
        std::string cmd = j.value("execute", "");
        json args = j.value("arguments", json::object());
        {
          std::lock_guard lk(mu_);
          asked_.push_back(j);
        }
        if (cmd == "guest-sync-delimited") {
          reply("\xff" + json{{"return", args["id"]}}.dump() + "\n");
        } else if (cmd == "guest-exec") {
          reply(json{{"return", {{"pid", 42}}}}.dump() + "\n");
        } else if (cmd == "guest-exec-status") {
          if (exitSignal) ::usleep(5000);  // a command that ran a while
          if (holdExit) {
            reply(json{{"return", {{"exited", false}}}}.dump() + "\n");
            continue;
          }
          // The command's output is in its files (below); qga captured only
          // the wrapper's, here nothing.
          json st = {{"exited", true}};
          if (exitSignal) {
            st["signal"] = exitSignal;
          } else {
            st["exitcode"] = 3;
          }
          reply(json{{"return", st}}.dump() + "\n");
        } else if (cmd == "guest-file-open") {
          // An exec's output files (qga.cc, runExec) and any other file.
          std::string path = args.value("path", "");
          auto ends = [&](const std::string& x) {
            return path.size() >= x.size() && path.compare(path.size() - x.size(), x.size(), x) == 0;
          };
          std::string content = ends(".out") ? "hi\n" : ends(".err") ? "err\n" : "hello";
          int64_t h = nextHandle_++;
          files_[h] = {content, 0};
          reply(json{{"return", h}}.dump() + "\n");
        } else if (cmd == "guest-file-seek") {
          auto& f = files_[args.value("handle", int64_t(0))];
          std::string whence = args.value("whence", "");
          int64_t off = args.value("offset", int64_t(0));
          f.second = whence == "end" ? int64_t(f.first.size()) + off
                     : whence == "cur" ? f.second + off
                                       : off;
          reply(json{{"return", {{"position", f.second}, {"eof", false}}}}.dump() + "\n");
        } else if (cmd == "guest-file-read") {
          auto& f = files_[args.value("handle", int64_t(0))];
          int64_t count = args.value("count", int64_t(4096));
          std::string part = f.first.substr(std::min<size_t>(size_t(f.second), f.first.size()),
                                            size_t(count));
          f.second += int64_t(part.size());
          reply(json{{"return", {{"count", part.size()}, {"buf-b64", base64Encode(part)},
                                 {"eof", size_t(f.second) >= f.first.size()}}}}
                    .dump() +
                "\n");
        } else {
          reply(R"({"return": {}})"
                "\n");
        }
      }
    }
  }

  int fd_;
  std::map<int64_t, std::pair<std::string, int64_t>> files_;  // handle: content, position
  int64_t nextHandle_ = 7;
  std::mutex mu_;  // guards asked_
  std::vector<json> asked_;
  std::thread thread_;
};

class QgaBridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int q[2], a[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, q), 0);
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
    fake_ = std::make_unique<FakeQga>(q[1]);
    auto client = std::make_shared<QgaClient>(UniqueFd(q[0]));
    ASSERT_TRUE(client->sync(monoSeconds() + 5).isOk());
    edge_.reset(a[0]);
    bridge_ = std::make_unique<QgaBridge>(UniqueFd(a[1]), client);
    ASSERT_TRUE(bridge_->start().isOk());
    auto hello = next();
    ASSERT_EQ(hello.type, proto::FrameType::kHello);
  }
  void TearDown() override {
    bridge_->stop();
    bridge_.reset();
    fake_.reset();
  }
  void send(uint32_t stream, proto::FrameType type, const std::string& payload) {
    std::string out;
    proto::appendFrame(out, stream, type, payload);
    ASSERT_EQ(::write(edge_.get(), out.data(), out.size()), ssize_t(out.size()));
  }
  proto::Frame next() {
    proto::Frame f;
    while (!dec_.next(f)) {
      char tmp[65536];
      ssize_t n = ::read(edge_.get(), tmp, sizeof tmp);
      if (n <= 0) return proto::Frame{0, proto::FrameType::kCancel, "eof"};
      EXPECT_TRUE(dec_.feed(tmp, size_t(n)).isOk());
    }
    return f;
  }
  json lastExec() {
    for (auto& j : fake_->asked()) {
      if (j.value("execute", "") == "guest-exec") return j["arguments"];
    }
    return nullptr;
  }

  std::unique_ptr<FakeQga> fake_;
  UniqueFd edge_;
  std::unique_ptr<QgaBridge> bridge_;
  proto::FrameDecoder dec_;
};

TEST_F(QgaBridgeTest, ExecWrapsTimeoutAndCwdAndReportsOutputThenExit) {
  send(1, proto::FrameType::kExec,
       json{{"argv", {"ls", "-l"}}, {"timeout_ms", 2500}, {"cwd", "/tmp"}}.dump());
  auto out = next();
  ASSERT_EQ(out.type, proto::FrameType::kStdout);
  EXPECT_EQ(out.payload, "hi\n");
  auto err = next();
  ASSERT_EQ(err.type, proto::FrameType::kStderr);
  EXPECT_EQ(err.payload, "err\n");
  auto exit = next();
  ASSERT_EQ(exit.type, proto::FrameType::kExit);
  json e = json::parse(exit.payload);
  EXPECT_EQ(e["exit_code"], 3);
  EXPECT_FALSE(e["timed_out"].get<bool>());
  json args = lastExec();
  ASSERT_TRUE(args.is_object());
  // Outermost, the wrapper that sends the output through FIFOs to readers
  // that keep at most the cap (plus one byte) in files read as they grow,
  // and execs the command.
  EXPECT_EQ(args["path"], "/bin/sh");
  auto a = args["arg"].get<std::vector<std::string>>();
  ASSERT_GE(a.size(), 4u);
  EXPECT_EQ(a[0], "-c");
  EXPECT_NE(a[1].find("mkfifo -m 600 \"$d/$t.o\" \"$d/$t.e\""), std::string::npos) << a[1];
  EXPECT_NE(a[1].find("keep() { stdbuf -o0 head -c \"$n\" 2>/dev/null || head -c \"$n\"; "
                      "cat >/dev/null; : >\"$1\"; }"),
            std::string::npos)
      << a[1];
  EXPECT_NE(a[1].find("keep \"$d/$t.od\" <\"$d/$t.o\" >\"$d/$t.out\" 2>/dev/null &"),
            std::string::npos)
      << a[1];
  EXPECT_TRUE(a[1].ends_with("\nexec \"$@\" >\"$d/$t.o\" 2>\"$d/$t.e\"")) << a[1];
  EXPECT_EQ(a[2].size(), 16u);  // the exec's tag: its files' names
  EXPECT_EQ(a[3], "1048577");   // the default cap (1 MiB) and one byte more
  a.erase(a.begin(), a.begin() + 4);
  std::vector<std::string> want = {"timeout", "-s", "KILL", "2.500", "/bin/sh", "-c",
                                   "cd \"$0\" || exit 126; exec \"$@\"", "/tmp", "ls", "-l"};
  EXPECT_EQ(a, want);
  bool hasPath = false;
  for (auto& v : args["env"]) hasPath = hasPath || startsWith(v.get<std::string>(), "PATH=");
  EXPECT_TRUE(hasPath);
}

TEST_F(QgaBridgeTest, ExecOutputArrivesWhileTheCommandRuns) {
  // Not waiting for the exit: without streaming no frame would come before
  // holdExit is cleared, and next() would give up after the receive timeout.
  struct timeval tv = {10, 0};
  ASSERT_EQ(::setsockopt(edge_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
  fake_->holdExit = true;
  send(1, proto::FrameType::kExec, json{{"argv", {"sh", "-c", "echo hi; sleep 60"}}}.dump());
  auto out = next();
  ASSERT_EQ(out.type, proto::FrameType::kStdout);
  EXPECT_EQ(out.payload, "hi\n");
  auto err = next();
  ASSERT_EQ(err.type, proto::FrameType::kStderr);
  EXPECT_EQ(err.payload, "err\n");
  fake_->holdExit = false;
  auto exit = next();
  ASSERT_EQ(exit.type, proto::FrameType::kExit);
  EXPECT_EQ(json::parse(exit.payload)["exit_code"], 3);
  // After the exit the bridge waited for the readers, then read the rest;
  // the files were closed and removed in the guest, FIFOs and marks too.
  bool closed = false, removed = false, awaited = false, readAfter = false;
  std::string tag;
  for (auto& j : fake_->asked()) {
    std::string cmd = j.value("execute", "");
    json args = j.value("arguments", json::object());
    closed = closed || cmd == "guest-file-close";
    if (cmd != "guest-exec") {
      readAfter = readAfter || (awaited && cmd == "guest-file-read");
      continue;
    }
    auto a = args.value("arg", std::vector<std::string>{});
    if (tag.empty() && a.size() > 2) tag = a[2];
    if (args["path"] == "/bin/sh" && a.size() == 3 && a[2] == tag &&
        a[1].find("$t.od") != std::string::npos) {
      awaited = true;
    }
    if (args["path"] == "rm") {
      removed = true;
      for (const char* ext : {".out", ".err", ".o", ".e", ".od", ".ed"}) {
        EXPECT_NE(std::find(a.begin(), a.end(), "/run/dsec-exec/" + tag + ext), a.end()) << ext;
      }
    }
  }
  EXPECT_TRUE(awaited);
  EXPECT_TRUE(readAfter);
  EXPECT_TRUE(closed);
  EXPECT_TRUE(removed);
}

TEST_F(QgaBridgeTest, TheGuestKeepsAtMostTheCapAndOneByteMore) {
  send(1, proto::FrameType::kExec, json{{"argv", {"yes"}}, {"max_output", 2}}.dump());
  // "hi\n" (3 bytes) past a cap of 2: what was sent is cut, and flagged
  auto out = next();
  ASSERT_EQ(out.type, proto::FrameType::kStdout);
  EXPECT_EQ(out.payload, "hi");
  auto err = next();
  ASSERT_EQ(err.type, proto::FrameType::kStderr);
  EXPECT_EQ(err.payload, "er");
  auto exit = next();
  ASSERT_EQ(exit.type, proto::FrameType::kExit);
  EXPECT_TRUE(json::parse(exit.payload)["truncated"].get<bool>());
  auto a = lastExec()["arg"].get<std::vector<std::string>>();
  ASSERT_GE(a.size(), 5u);
  EXPECT_EQ(a[3], "3");
  EXPECT_EQ(a[4], "yes");
}

TEST_F(QgaBridgeTest, AKilledTimeoutWrapperIsATimeout) {
  fake_->exitSignal = 9;
  send(1, proto::FrameType::kExec, json{{"argv", {"sleep", "9"}}, {"timeout_ms", 1}}.dump());
  proto::Frame f;
  do {
    f = next();
  } while (f.type == proto::FrameType::kStdout || f.type == proto::FrameType::kStderr);
  ASSERT_EQ(f.type, proto::FrameType::kExit);
  json e = json::parse(f.payload);
  EXPECT_TRUE(e["timed_out"].get<bool>());
  EXPECT_EQ(e["exit_code"], -1);
  EXPECT_EQ(e["signal"], 9);
}

TEST_F(QgaBridgeTest, FileReadAnswersSizeThenDataThenEnd) {
  send(3, proto::FrameType::kFileRead, json{{"path", "/etc/x"}, {"offset", 0}, {"length", 5}}.dump());
  auto r = next();
  ASSERT_EQ(r.type, proto::FrameType::kResult);
  json j = json::parse(r.payload);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_EQ(j["size"], 5);
  auto d = next();
  ASSERT_EQ(d.type, proto::FrameType::kData);
  EXPECT_EQ(d.payload, "hello");
  auto end = next();
  ASSERT_EQ(end.type, proto::FrameType::kData);
  EXPECT_TRUE(end.payload.empty());
}

TEST_F(QgaBridgeTest, PolicyWithFileRulesIsRefused) {
  send(5, proto::FrameType::kPolicy, json{{"readonly", {"/etc"}}, {"hidden", json::array()}}.dump());
  auto r = next();
  ASSERT_EQ(r.type, proto::FrameType::kResult);
  json j = json::parse(r.payload);
  EXPECT_FALSE(j["ok"].get<bool>());
  EXPECT_EQ(j["code"], "failed_precondition");
  send(6, proto::FrameType::kPolicy, json{{"readonly", json::array()}}.dump());
  EXPECT_TRUE(json::parse(next().payload)["ok"].get<bool>());
}

}  // namespace
}  // namespace dsec::edge
