// Protocol-level tests: an Agent serves one end of a socketpair in a forked
// child (or the real binary is spawned with the socket as fd 3), and the test
// speaks frames to it.
#include "aether/agent.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/xattr.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "aether/files.h"
#include "aether/json_fields.h"

namespace dsec::aether {
namespace {

using proto::Frame;
using proto::FrameType;
using Clock = std::chrono::steady_clock;

struct ExecOutcome {
  std::string out, err;
  Json exit;    // the exit frame, or null
  Json result;  // a result frame instead of exit, or null
};

class AgentHarness {
 public:
  AgentHarness() = default;
  AgentHarness(const AgentHarness&) = delete;
  AgentHarness& operator=(const AgentHarness&) = delete;
  ~AgentHarness() { stop(); }

  // Runs an Agent in a forked child. The child is single-threaded, owns
  // SIGCHLD, and reaps only its own children.
  void startForked(AgentOptions options = {}) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid_ = ::fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      ::close(sv[0]);
      Agent agent(UniqueFd(sv[1]), std::move(options));
      if (!agent.start().isOk()) ::_exit(3);
      ::_exit(agent.run());
    }
    ::close(sv[1]);
    sock_ = sv[0];
    expectHello();
  }

  // Spawns the real static binary with the socket as fd 3.
  void startBinary(bool no_init) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid_ = ::fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      if (::dup2(sv[1], 3) != 3) ::_exit(120);  // dup2 clears CLOEXEC
      const char* argv[] = {DSEC_AETHER_BIN, no_init ? "--no-init" : nullptr, nullptr};
      ::execv(DSEC_AETHER_BIN, const_cast<char**>(argv));
      ::_exit(121);
    }
    ::close(sv[1]);
    sock_ = sv[0];
    if (no_init) expectHello();
  }

  // Spawns the binary as PID 1 of fresh mount/pid/uts/net/ipc namespaces,
  // the way the edge starts a container. Returns false if unshare() is not
  // allowed here (the intermediate process then exits kNoNamespaces).
  static constexpr int kNoNamespaces = 42;
  void startInNamespaces() {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid_ = ::fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      ::close(sv[0]);  // or aether would never see EOF
      if (::unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWIPC) < 0) {
        ::_exit(kNoNamespaces);
      }
      pid_t init = ::fork();
      if (init < 0) ::_exit(122);
      if (init == 0) {
        if (::dup2(sv[1], 3) != 3) ::_exit(120);  // dup2 clears CLOEXEC
        const char* argv[] = {DSEC_AETHER_BIN, nullptr};
        ::execv(DSEC_AETHER_BIN, const_cast<char**>(argv));
        ::_exit(121);
      }
      ::close(sv[1]);
      int status = 0;
      ::waitpid(init, &status, 0);
      ::_exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    }
    ::close(sv[1]);
    sock_ = sv[0];
  }

  void expectHello() {
    Frame f;
    ASSERT_TRUE(next(0, f));
    ASSERT_EQ(f.type, FrameType::kHello);
    Json j = Json::parse(f.payload);
    EXPECT_EQ(j["version"], 1);
    EXPECT_GT(j["pid"].get<int>(), 0);
    hello_pid_ = j["pid"].get<int>();
  }
  int helloPid() const { return hello_pid_; }

  pid_t pid() const { return pid_; }

  void send(uint32_t stream, FrameType type, std::string_view payload) {
    std::string wire;
    proto::appendFrame(wire, stream, type, payload);
    sendRaw(wire);
  }
  void sendJson(uint32_t stream, FrameType type, const Json& j) { send(stream, type, j.dump()); }
  void sendRaw(std::string_view wire) {
    while (!wire.empty()) {
      ssize_t n = ::send(sock_, wire.data(), wire.size(), MSG_NOSIGNAL);
      ASSERT_GT(n, 0) << std::strerror(errno);
      wire.remove_prefix(static_cast<size_t>(n));
    }
  }
  void closeSocket() {
    if (sock_ >= 0) ::close(sock_);
    sock_ = -1;
  }

  // Next frame of `stream`, buffering other streams' frames.
  bool next(uint32_t stream, Frame& out, int timeout_ms = 10000) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (true) {
      auto& q = inbox_[stream];
      if (!q.empty()) {
        out = std::move(q.front());
        q.pop_front();
        return true;
      }
      Frame f;
      if (!readAny(f, deadline)) return false;
      if (f.type == FrameType::kStarted) {
        // Every exec's first frame: kept aside for startedPid().
        started_[f.stream] = Json::parse(f.payload)["pid"].get<int>();
        continue;
      }
      order_.push_back(f.stream);
      inbox_[f.stream].push_back(std::move(f));
    }
  }

  // The pid an exec's started frame gave (0: none seen yet).
  int startedPid(uint32_t stream) const {
    auto it = started_.find(stream);
    return it == started_.end() ? 0 : it->second;
  }

  // True once the agent closed its end.
  bool waitEof(int timeout_ms) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    Frame f;
    while (readAny(f, deadline)) {
    }
    return eof_;
  }

  ExecOutcome exec(uint32_t stream, const Json& req, std::string_view stdin_data = {},
                   bool send_stdin = false) {
    sendJson(stream, FrameType::kExec, req);
    if (send_stdin) {
      for (size_t off = 0; off < stdin_data.size(); off += proto::kDataChunk) {
        send(stream, FrameType::kStdin, stdin_data.substr(off, proto::kDataChunk));
      }
      send(stream, FrameType::kStdin, {});
    }
    return collect(stream);
  }

  ExecOutcome collect(uint32_t stream, int timeout_ms = 15000) {
    ExecOutcome o;
    Frame f;
    while (next(stream, f, timeout_ms)) {
      if (f.type == FrameType::kStdout) {
        EXPECT_LE(f.payload.size(), proto::kDataChunk);
        o.out += f.payload;
      } else if (f.type == FrameType::kStderr) {
        o.err += f.payload;
      } else if (f.type == FrameType::kExit) {
        o.exit = Json::parse(f.payload);
        return o;
      } else if (f.type == FrameType::kResult) {
        o.result = Json::parse(f.payload);
        return o;
      } else {
        ADD_FAILURE() << "unexpected frame " << int(f.type);
      }
    }
    ADD_FAILURE() << "no exit for stream " << stream;
    return o;
  }

  Json request(uint32_t stream, FrameType type, const Json& req) {
    sendJson(stream, type, req);
    Frame f;
    if (!next(stream, f)) return Json();
    EXPECT_EQ(f.type, FrameType::kResult);
    return Json::parse(f.payload);
  }

  // file_read: the result, then the data.
  Json readFile(uint32_t stream, const Json& req, std::string& data) {
    sendJson(stream, FrameType::kFileRead, req);
    Frame f;
    if (!next(stream, f)) return Json();
    EXPECT_EQ(f.type, FrameType::kResult);
    Json result = Json::parse(f.payload);
    data.clear();
    if (!result.value("ok", false)) return result;
    while (next(stream, f)) {
      EXPECT_EQ(f.type, FrameType::kData);
      if (f.payload.empty()) break;
      EXPECT_LE(f.payload.size(), proto::kDataChunk);
      data += f.payload;
    }
    return result;
  }

  Json writeFile(uint32_t stream, const Json& req, std::string_view data) {
    sendJson(stream, FrameType::kFileWrite, req);
    for (size_t off = 0; off < data.size(); off += proto::kDataChunk) {
      send(stream, FrameType::kData, data.substr(off, proto::kDataChunk));
    }
    send(stream, FrameType::kData, {});
    Frame f;
    if (!next(stream, f)) return Json();
    EXPECT_EQ(f.type, FrameType::kResult);
    return Json::parse(f.payload);
  }

  // Waits for the agent process; returns its exit status (or -1).
  int wait(int timeout_ms = 5000) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (pid_ > 0) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status;
      }
      if (Clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }

  const std::vector<uint32_t>& order() const { return order_; }

  // A new edge's connection (after a reattach): what was buffered goes.
  void useSocket(int fd) {
    closeSocket();
    sock_ = fd;
    eof_ = false;
    decoder_ = proto::FrameDecoder{};
    inbox_.clear();
  }

 private:
  bool readAny(Frame& out, Clock::time_point deadline) {
    while (!decoder_.next(out)) {
      if (sock_ < 0 || eof_) return false;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      struct pollfd p {
        sock_, POLLIN, 0
      };
      int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r <= 0) continue;
      char buf[1 << 16];
      ssize_t n = ::read(sock_, buf, sizeof buf);
      if (n <= 0) {
        eof_ = true;
        return false;
      }
      EXPECT_TRUE(decoder_.feed(buf, static_cast<size_t>(n)).isOk());
    }
    return true;
  }

  void stop() {
    closeSocket();
    if (pid_ > 0) {
      if (wait(3000) == -1 && pid_ > 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
      }
    }
  }

  pid_t pid_ = -1;
  int hello_pid_ = 0;
  int sock_ = -1;
  bool eof_ = false;
  proto::FrameDecoder decoder_;
  std::map<uint32_t, std::deque<Frame>> inbox_;
  std::vector<uint32_t> order_;
  std::map<uint32_t, int> started_;
};

Json shExec(const std::string& script) { return Json{{"argv", {"/bin/sh", "-c", script}}}; }

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/aether_test.XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { (void)removePath(path_, true); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// ---- exec ----

TEST(AgentExecTest, EchoWithExitCode) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, shExec("echo hi; echo oops >&2; exit 3"));
  EXPECT_EQ(o.out, "hi\n");
  EXPECT_EQ(o.err, "oops\n");
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 3);
  EXPECT_EQ(o.exit["signal"], 0);
  EXPECT_EQ(o.exit["timed_out"], false);
  EXPECT_EQ(o.exit["truncated"], false);
  EXPECT_GT(o.exit["duration_us"].get<int64_t>(), 0);
}

// aether ignores SIGPIPE (and may inherit other SIG_IGNs); its children get
// every disposition back at SIG_DFL, which /proc shows as an empty SigIgn.
TEST(AgentExecTest, ChildrenStartWithDefaultSignalDispositions) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, shExec("grep -E '^Sig(Ign|Blk)' /proc/self/status"));
  EXPECT_EQ(o.out, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n") << o.result;
}

TEST(AgentExecTest, PathSearchEnvAndCwd) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(
      1,
      Json{{"argv", {"sh", "-c", "echo $FOO:$HOME; pwd"}}, {"env", {"FOO=bar"}}, {"cwd", "/tmp"}});
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 0) << o.err;
  EXPECT_EQ(o.out, "bar:/root\n/tmp\n");

  // The exec's own PATH is searched, not aether's.
  o = a.exec(2, Json{{"argv", {"sh", "-c", "true"}}, {"env", {"PATH=/nonexistent"}}});
  EXPECT_EQ(o.exit["exit_code"], 127);
}

TEST(AgentExecTest, NotFoundIs127AndNotExecutableIs126) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, Json{{"argv", {"no-such-command-xyz"}}});
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 127);
  EXPECT_EQ(o.err, "dsec: exec no-such-command-xyz: No such file or directory\n");

  TempDir dir;
  std::string plain = dir.path() + "/not-executable";
  ASSERT_EQ(a.writeFile(9, Json{{"path", plain}, {"mode", 0644}}, "echo no")["ok"], true);
  o = a.exec(2, Json{{"argv", {plain}}});
  EXPECT_EQ(o.exit["exit_code"], 126);
  EXPECT_EQ(o.err, "dsec: exec " + plain + ": Permission denied\n");

  // A script without "#!" runs with /bin/sh, as execvp does.
  std::string script = dir.path() + "/script";
  ASSERT_EQ(a.writeFile(10, Json{{"path", script}, {"mode", 0755}}, "echo script $1")["ok"], true);
  o = a.exec(4, Json{{"argv", {script, "arg"}}});
  EXPECT_EQ(o.out, "script arg\n") << o.err;

  o = a.exec(3, Json{{"argv", {"true"}}, {"cwd", "/no/such/dir"}});
  EXPECT_EQ(o.exit["exit_code"], 126);
  EXPECT_EQ(o.err, "dsec: chdir /no/such/dir: No such file or directory\n");
}

TEST(AgentExecTest, StdinRoundTrip) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, Json{{"argv", {"cat"}}, {"stdin", true}}, "hello stdin", true);
  EXPECT_EQ(o.out, "hello stdin");
  EXPECT_EQ(o.exit["exit_code"], 0);

  // More than a pipe holds, so aether must buffer and resume writing.
  std::string big(3 << 20, 'x');
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>('a' + (i / 4096) % 26);
  o = a.exec(2, Json{{"argv", {"cat"}}, {"stdin", true}, {"max_output", 8 << 20}}, big, true);
  EXPECT_EQ(o.out.size(), big.size());
  EXPECT_TRUE(o.out == big);

  // stdin:false reads /dev/null.
  o = a.exec(3, Json{{"argv", {"wc", "-c"}}});
  EXPECT_EQ(o.out, "0\n");
}

TEST(AgentExecTest, TimeoutKillsProcessGroup) {
  AgentHarness a;
  a.startForked();
  auto t0 = Clock::now();
  auto o = a.exec(1, Json{{"argv", {"sh", "-c", "sleep 100 & sleep 100"}}, {"timeout_ms", 200}});
  auto took = Clock::now() - t0;
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["timed_out"], true);
  EXPECT_EQ(o.exit["signal"], 9);
  EXPECT_EQ(o.exit["exit_code"], -1);
  EXPECT_LT(took, std::chrono::seconds(3));
}

TEST(AgentExecTest, OutputCapTruncatesButDrains) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, Json{{"argv", {"yes"}}, {"max_output", 1000}, {"timeout_ms", 1000}});
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.out.size(), 1000u);
  EXPECT_EQ(o.out.substr(0, 4), "y\ny\n");
  EXPECT_EQ(o.exit["truncated"], true);
  EXPECT_EQ(o.exit["timed_out"], true);

  o = a.exec(2, Json{{"argv", {"sh", "-c", "head -c 100000 /dev/zero; echo done >&2"}},
                     {"max_output", 0}});
  EXPECT_EQ(o.out.size(), 0u);
  EXPECT_EQ(o.err, "");
  EXPECT_EQ(o.exit["truncated"], true);
  EXPECT_EQ(o.exit["exit_code"], 0);
}

TEST(AgentExecTest, ExitBySignalAndSignalFrames) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, shExec("kill -TERM $$"));
  EXPECT_EQ(o.exit["signal"], 15);
  EXPECT_EQ(o.exit["exit_code"], -1);

  a.sendJson(2, FrameType::kExec, shExec("echo started; exec sleep 100"));
  Frame f;
  ASSERT_TRUE(a.next(2, f));
  EXPECT_EQ(f.payload, "started\n");
  a.sendJson(2, FrameType::kSignal, Json{{"signal", 2}});
  o = a.collect(2);
  EXPECT_EQ(o.exit["signal"], 2);

  a.sendJson(3, FrameType::kExec, shExec("echo started; exec sleep 100"));
  ASSERT_TRUE(a.next(3, f));
  a.send(3, FrameType::kCancel, {});
  o = a.collect(3);
  EXPECT_EQ(o.exit["signal"], 9);
  EXPECT_EQ(o.exit["timed_out"], false);
}

// Children of `pid` (by /proc/*/stat), with their state letters.
std::vector<std::pair<pid_t, char>> childrenOf(pid_t pid) {
  std::vector<std::pair<pid_t, char>> out;
  DIR* d = ::opendir("/proc");
  while (struct dirent* e = ::readdir(d)) {
    pid_t p = std::atoi(e->d_name);
    if (p <= 0) continue;
    std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
    std::string s;
    std::getline(stat, s);
    size_t paren = s.rfind(')');
    if (paren == std::string::npos) continue;
    char state = s[paren + 2];
    pid_t ppid = std::atoi(s.c_str() + paren + 4);
    if (ppid == pid) out.emplace_back(p, state);
  }
  ::closedir(d);
  return out;
}

// Reads stream's stdout until `want` appears in it (or the exec ends).
std::string readUntil(AgentHarness& a, uint32_t stream, std::string_view want,
                      int timeout_ms = 10000) {
  std::string got;
  Frame f;
  while (got.find(want) == std::string::npos && a.next(stream, f, timeout_ms)) {
    if (f.type != FrameType::kStdout) {
      ADD_FAILURE() << "frame " << int(f.type) << " before " << want << ": " << f.payload;
      break;
    }
    got += f.payload;
  }
  return got;
}

TEST(AgentExecTest, StartedFrameGivesThePid) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, shExec("echo $$"));
  EXPECT_EQ(o.exit["exit_code"], 0);
  EXPECT_EQ(o.out, std::to_string(a.startedPid(1)) + "\n");
}

TEST(AgentPtyTest, TerminalSizeResizeAndControllingTty) {
  AgentHarness a;
  a.startForked();
  // stdin, stdout and stderr are one terminal, the session's controlling one.
  auto o = a.exec(1, Json{{"argv", {"sh", "-c",
                                    "tty; stty size; echo err >&2; "
                                    "test -t 0 && test -t 2 && echo all-tty; "
                                    "ps -o tty= -p $$ >/dev/null 2>&1; cat /proc/self/stat"}},
                          {"pty", {{"rows", 33}, {"cols", 101}}}});
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 0);
  EXPECT_EQ(o.err, "");  // stderr arrives on the terminal, as stdout
  EXPECT_NE(o.out.find("/dev/pts/"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("33 101\r\n"), std::string::npos) << o.out;  // onlcr: \n becomes \r\n
  EXPECT_NE(o.out.find("err\r\n"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("all-tty"), std::string::npos) << o.out;
  // /proc/self/stat field 7 (tty_nr) is nonzero: cat has a controlling terminal.
  size_t paren = o.out.rfind(')');
  ASSERT_NE(paren, std::string::npos);
  std::istringstream fields(o.out.substr(paren + 2));
  std::string state, ppid, pgrp, session, tty_nr;
  fields >> state >> ppid >> pgrp >> session >> tty_nr;
  EXPECT_NE(tty_nr, "0") << o.out;

  // Resize: the shell's foreground job sees SIGWINCH and the new size.
  a.sendJson(2, FrameType::kExec,
             Json{{"argv", {"sh", "-c",
                            "trap 'stty size; exit 0' WINCH; echo ready; "
                            "while :; do sleep 0.05; done"}},
                  {"pty", {{"rows", 24}, {"cols", 80}}}});
  EXPECT_NE(readUntil(a, 2, "ready").find("ready"), std::string::npos);
  a.sendJson(2, FrameType::kResize, Json{{"rows", 50}, {"cols", 132}});
  o = a.collect(2);
  EXPECT_NE(o.out.find("50 132"), std::string::npos) << o.out;
  EXPECT_EQ(o.exit["exit_code"], 0);

  // A resize of an exec without a terminal, or a malformed one, is dropped
  // (the exec goes on and ends as usual).
  a.sendJson(3, FrameType::kExec, shExec("read x; echo got $x"));
  // stdin is /dev/null here: read fails at once; the frames race the exit.
  a.sendJson(3, FrameType::kResize, Json{{"rows", 0}, {"cols", 10}});
  o = a.collect(3);
  EXPECT_TRUE(o.exit.is_object()) << o.result;
}

TEST(AgentPtyTest, InputEchoAndInterruptReachTheForegroundJob) {
  AgentHarness a;
  a.startForked();
  a.sendJson(1, FrameType::kExec,
             Json{{"argv", {"sh", "-i"}}, {"env", {"PS1=$ ", "PATH=/usr/bin:/bin"}},
                  {"pty", {{"rows", 24}, {"cols", 80}}}});
  readUntil(a, 1, "$ ");
  // Typed input is echoed by the terminal and runs.
  a.send(1, FrameType::kStdin, "echo hel''lo\n");
  EXPECT_NE(readUntil(a, 1, "hello\r\n").find("hello\r\n"), std::string::npos);
  readUntil(a, 1, "$ ");
  // ^C (the terminal's VINTR) interrupts the foreground job, not the shell.
  a.send(1, FrameType::kStdin, "sleep 100\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  a.send(1, FrameType::kStdin, "\x03");
  a.send(1, FrameType::kStdin, "echo after $?\n");
  EXPECT_NE(readUntil(a, 1, "after 130").find("after 130"), std::string::npos);
  // A signal frame goes to the foreground job too.
  readUntil(a, 1, "$ ");
  a.send(1, FrameType::kStdin, "sleep 100; echo rc=$?\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  a.sendJson(1, FrameType::kSignal, Json{{"signal", SIGTERM}});
  EXPECT_NE(readUntil(a, 1, "rc=143").find("rc=143"), std::string::npos);
  // exit ends the exec with the shell's status.
  a.send(1, FrameType::kStdin, "exit 7\n");
  auto o = a.collect(1);
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 7);
}

TEST(AgentPtyTest, CancelKillsTheShellAndItsForegroundJob) {
  AgentHarness a;
  a.startForked();
  a.sendJson(1, FrameType::kExec,
             Json{{"argv", {"sh", "-i"}}, {"env", {"PS1=$ ", "PATH=/usr/bin:/bin"}},
                  {"pty", {{"rows", 24}, {"cols", 80}}}});
  readUntil(a, 1, "$ ");
  a.send(1, FrameType::kStdin, "sleep 1000\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  a.send(1, FrameType::kCancel, {});
  auto t0 = Clock::now();
  auto o = a.collect(1);
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["signal"], 9);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (auto [pid, state] : childrenOf(a.pid())) {
    ADD_FAILURE() << "left behind: " << pid << " " << state;
  }
}

TEST(AgentPtyTest, BadPtyFieldsAreInvalidArgument) {
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, Json{{"argv", {"true"}}, {"pty", {{"rows", 0}, {"cols", 80}}}});
  EXPECT_EQ(o.result["code"], "invalid_argument");
  EXPECT_EQ(o.result["field"], "rows");
  o = a.exec(2, Json{{"argv", {"true"}}, {"pty", 5}});
  EXPECT_EQ(o.result["field"], "pty");
  o = a.exec(3, Json{{"argv", {"true"}}, {"pty", {{"rows", 10}, {"cols", 70000}}}});
  EXPECT_EQ(o.result["field"], "cols");
}


TEST(AgentExecTest, BackgroundProcessesNeitherHoldTheExecNorLinger) {
  AgentHarness a;
  a.startForked();
  // The background sleep keeps stdout open; the exec still ends with its shell.
  auto t0 = Clock::now();
  auto o = a.exec(1, shExec("sleep 2 & echo fg"));
  EXPECT_EQ(o.out, "fg\n");
  EXPECT_EQ(o.exit["exit_code"], 0);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1500));
  // Orphans come to the agent, which reaps them though it never tracked them.
  o = a.exec(2, shExec("(sleep 0.1; true) & exit 0"));
  EXPECT_EQ(o.exit["exit_code"], 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  for (auto [pid, state] : childrenOf(a.pid())) {
    EXPECT_NE(state, 'Z') << "unreaped child " << pid;
  }
}

TEST(AgentExecTest, ConcurrentExecsInterleave) {
  AgentHarness a;
  a.startForked();
  std::string loop = "for i in 1 2 3 4 5; do echo $i; sleep 0.05; done";
  a.sendJson(7, FrameType::kExec, shExec("echo a; " + loop));
  a.sendJson(9, FrameType::kExec, shExec("echo b; " + loop));
  auto o7 = a.collect(7);
  auto o9 = a.collect(9);
  EXPECT_EQ(o7.out, "a\n1\n2\n3\n4\n5\n");
  EXPECT_EQ(o9.out, "b\n1\n2\n3\n4\n5\n");
  // The streams' frames arrived mixed, not one exec after the other.
  const auto& order = a.order();
  size_t switches = 0;
  for (size_t i = 1; i < order.size(); ++i) switches += order[i] != order[i - 1];
  EXPECT_GE(switches, 4u);
}

TEST(AgentExecTest, UserSwitching) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to switch users";
  AgentHarness a;
  a.startForked();
  auto o = a.exec(1, Json{{"argv", {"id", "-u"}}, {"user", "nobody"}});
  EXPECT_EQ(o.out, "65534\n") << o.err;
  o = a.exec(2, Json{{"argv", {"sh", "-c", "id -u; id -g"}}, {"user", "1234:4321"}});
  EXPECT_EQ(o.out, "1234\n4321\n") << o.err;
  o = a.exec(3, Json{{"argv", {"id"}}, {"user", "no-such-user"}});
  ASSERT_TRUE(o.result.is_object());
  EXPECT_EQ(o.result["ok"], false);
  EXPECT_EQ(o.result["code"], "invalid_argument");
  EXPECT_EQ(o.result["field"], "user");
  // Capabilities outside Docker's default set, and CAP_NET_RAW (bit 13) and
  // CAP_MKNOD (bit 27), are gone from the bounding set (CAP_SYS_ADMIN is bit 21).
  o = a.exec(4, shExec("grep CapBnd /proc/self/status"));
  ASSERT_EQ(o.out.size(), std::string("CapBnd:\t00000000a00405fb\n").size()) << o.out;
  EXPECT_EQ(o.out, "CapBnd:\t00000000a00405fb\n");
  // Under the syscall profile, with no_new_privs.
  o = a.exec(5, shExec("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status"));
  EXPECT_EQ(o.out, "NoNewPrivs:\t1\nSeccomp:\t2\n");
}

TEST(AgentExecTest, FlowControlBoundsMemory) {
  AgentHarness a;
  a.startBinary(true);  // a fresh process: a forked one shares the test's pages
  constexpr size_t kSize = 32u << 20;
  a.sendJson(
      1, FrameType::kExec,
      Json{{"argv", {"head", "-c", std::to_string(kSize), "/dev/zero"}}, {"max_output", 64 << 20}});
  // Not reading: the agent must stop pulling from the pipe instead of queueing 32 MiB.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  std::ifstream status("/proc/" + std::to_string(a.pid()) + "/status");
  std::string line;
  long rss_kb = -1;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss_kb = std::strtol(line.c_str() + 6, nullptr, 10);
  }
  EXPECT_GT(rss_kb, 0);
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine keeps freed memory resident
  EXPECT_LT(rss_kb, 20 * 1024) << "agent RSS while the edge is not reading";
#endif
  auto o = a.collect(1);
  EXPECT_EQ(o.out.size(), kSize);
  EXPECT_EQ(o.exit["exit_code"], 0);
  EXPECT_EQ(o.exit["truncated"], false);
}

TEST(AgentExecTest, ConnectionEofKillsExecs) {
  AgentHarness a;
  a.startForked();
  a.sendJson(1, FrameType::kExec, shExec("echo $$; exec sleep 100"));
  Frame f;
  ASSERT_TRUE(a.next(1, f));
  pid_t child = std::atoi(f.payload.c_str());
  ASSERT_GT(child, 0);
  a.closeSocket();
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The sleep was SIGKILLed: gone, or a zombie awaiting its new parent.
  auto deadline = Clock::now() + std::chrono::seconds(2);
  bool dead = false;
  while (!dead && Clock::now() < deadline) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string s;
    std::getline(stat, s);
    size_t paren = s.rfind(')');
    dead = !stat || paren == std::string::npos || s.substr(paren + 2, 1) == "Z";
    if (!dead) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(dead);
}

// ---- reattach (docs/agent-protocol.md) ----

bool processGone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  std::getline(stat, s);
  size_t paren = s.rfind(')');
  return !stat || paren == std::string::npos || s.substr(paren + 2, 1) == "Z";
}

// Takes the edge's end of the agent's fresh connection the way a restarted
// edge does: pidfd_getfd of the reattach descriptor, once it is a socket.
int takeReattachEnd(pid_t agent, int fd) {
  int pidfd = int(::syscall(SYS_pidfd_open, agent, 0));
  if (pidfd < 0) return -1;
  int got = -1;
  auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    got = int(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    struct stat st;
    if (got >= 0 && ::fstat(got, &st) == 0 && S_ISSOCK(st.st_mode)) break;
    if (got >= 0) ::close(got);
    got = -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::close(pidfd);
  return got;
}

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

TEST(AgentReattachTest, OutlivesTheEdgeAndServesTheNextOne) {
  if (::syscall(SYS_pidfd_open, ::getpid(), 0) < 0) GTEST_SKIP() << "no pidfd_open";
  constexpr int kReattach = 40;
  int null = ::open("/dev/null", O_RDWR);
  ASSERT_EQ(::dup2(null, kReattach), kReattach);
  ::close(null);
  AgentHarness a;
  AgentOptions options;
  options.reattach_fd = kReattach;
  a.startForked(options);
  ::close(kReattach);  // the child has its own
  ExecOutcome bg = a.exec(1, shExec("sleep 100 >/dev/null 2>&1 </dev/null & echo $!"));
  pid_t background = std::atoi(bg.out.c_str());
  ASSERT_GT(background, 0);
  a.sendJson(2, FrameType::kExec, shExec("echo $$; exec sleep 100"));
  Frame f;
  ASSERT_TRUE(a.next(2, f));
  pid_t inflight = std::atoi(f.payload.c_str());
  ASSERT_GT(inflight, 0);

  for (int edge = 0; edge < 2; ++edge) {
    a.closeSocket();  // the edge dies
    int sock = takeReattachEnd(a.pid(), kReattach);
    ASSERT_GE(sock, 0) << "no connection offered on the reattach descriptor";
    // Nothing is said until the new edge asks.
    a.useSocket(sock);
    EXPECT_FALSE(a.next(0, f, 200));
    a.sendJson(0, FrameType::kReattach, Json::object());
    ASSERT_TRUE(a.next(0, f));
    ASSERT_EQ(f.type, FrameType::kHello);
    EXPECT_TRUE(Json::parse(f.payload).value("reattached", false));
    // The agent lives; the exec nobody could hear the end of was killed; the
    // background process was not.
    EXPECT_EQ(::waitpid(a.pid(), nullptr, WNOHANG), 0);
    auto deadline = Clock::now() + std::chrono::seconds(2);
    while (!processGone(inflight) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(processGone(inflight));
    EXPECT_FALSE(processGone(background));
    ExecOutcome again = a.exec(3 + uint32_t(edge), shExec("echo served"));
    EXPECT_EQ(again.out, "served\n");
    // The descriptor holds /dev/null again: taking it yields no socket.
    int pidfd = int(::syscall(SYS_pidfd_open, a.pid(), 0));
    int held = int(::syscall(SYS_pidfd_getfd, pidfd, kReattach, 0));
    struct stat st;
    ASSERT_GE(held, 0);
    ASSERT_EQ(::fstat(held, &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode));
    ::close(held);
    ::close(pidfd);
  }
  ::kill(background, SIGKILL);
  ::kill(a.pid(), SIGKILL);  // it would wait for an edge forever
}

// ---- malformed input ----

TEST(AgentProtocolTest, BadRequestsGetInvalidArgument) {
  AgentHarness a;
  a.startForked();
  uint32_t stream = 10;
  for (const char* bad :
       {"{", "[]", "{\"argv\":[]}", "{\"argv\":\"ls\"}", "{\"argv\":[1]}",
        "{\"argv\":[\"ls\"],\"timeout_ms\":-1}", "{\"argv\":[\"ls\"],\"max_output\":1.5}",
        "\xff\xfe", "{\"argv\":[\"a\\u0000b\"]}"}) {
    a.send(++stream, FrameType::kExec, bad);
    Frame f;
    ASSERT_TRUE(a.next(stream, f)) << bad;
    ASSERT_EQ(f.type, FrameType::kResult) << bad;
    Json r = Json::parse(f.payload);
    EXPECT_EQ(r["ok"], false) << bad;
    EXPECT_EQ(r["code"], "invalid_argument") << bad;
  }
  for (FrameType t : {FrameType::kFileRead, FrameType::kStat, FrameType::kList, FrameType::kMkdir,
                      FrameType::kRemove, FrameType::kFileWrite}) {
    for (const char* bad : {"", "{}", "{\"path\":\"relative\"}", "{\"path\":5}"}) {
      Json r = [&] {
        a.send(++stream, t, bad);
        Frame f;
        EXPECT_TRUE(a.next(stream, f));
        return Json::parse(f.payload);
      }();
      EXPECT_EQ(r["code"], "invalid_argument") << int(t) << " " << bad;
    }
  }
  // Requests on stream 0, frame types aether never receives.
  a.send(0, FrameType::kStat, R"({"path":"/"})");
  Frame f;
  ASSERT_TRUE(a.next(0, f));
  EXPECT_EQ(Json::parse(f.payload)["code"], "invalid_argument");
  a.send(99, static_cast<FrameType>(0x7f), "x");
  ASSERT_TRUE(a.next(99, f));
  EXPECT_EQ(Json::parse(f.payload)["code"], "invalid_argument");
  // Stray stdin/signal/data/cancel for unknown streams are ignored; the agent
  // still answers afterwards.
  a.send(100, FrameType::kStdin, "x");
  a.send(100, FrameType::kSignal, "garbage");
  a.send(100, FrameType::kData, "x");
  a.send(100, FrameType::kCancel, "");
  auto o = a.exec(100, Json{{"argv", {"true"}}});
  EXPECT_EQ(o.exit["exit_code"], 0);
}

TEST(AgentProtocolTest, SurvivesGarbage) {
  AgentHarness a;
  a.startForked();
  std::mt19937 rng(7);
  const std::vector<std::string> exec_templates = {
      R"({"argv":["true"],"stdin":true,"timeout_ms":50})",
      R"({"argv":["/bin/echo","x"],"max_output":3})",
      R"({"argv":["sleep","0.01"],"user":"0:0","env":["A=B"]})",
  };
  static constexpr char kAlphabet[] = "{}[]\",:0-9\x00\xff";
  auto mutate = [&](std::string s) {
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < edits && !s.empty(); ++i) {
      size_t pos = rng() % s.size();
      switch (rng() % 3) {
        case 0:
          s[pos] = static_cast<char>(rng());
          break;
        case 1:
          s.erase(pos, 1 + rng() % 5);
          break;
        default:
          s.insert(pos, 1, kAlphabet[rng() % (sizeof kAlphabet - 1)]);
          break;
      }
    }
    return s;
  };
  const FrameType request_types[] = {FrameType::kFileWrite, FrameType::kFileRead,
                                     FrameType::kList,      FrameType::kStat,
                                     FrameType::kMkdir,     FrameType::kRemove};
  for (int i = 0; i < 3000; ++i) {
    uint32_t stream = 1 + rng() % 20;
    switch (rng() % 6) {
      case 0:
      case 1:
        a.send(stream, FrameType::kExec, mutate(exec_templates[rng() % exec_templates.size()]));
        break;
      case 2: {
        // Random bytes that are never a JSON object, so no file is ever touched.
        std::string junk(rng() % 40, '\0');
        for (auto& c : junk) c = static_cast<char>(rng());
        if (!junk.empty() && junk[0] == '{') junk[0] = '[';
        a.send(stream, request_types[rng() % 6], junk);
        break;
      }
      case 3:
        a.send(stream, FrameType::kStdin, std::string(rng() % 100, 'i'));
        break;
      case 4:
        a.send(stream, FrameType::kSignal,
               mutate(R"({"signal":)" + std::to_string(rng() % 70) + "}"));
        break;
      default:
        a.send(stream, static_cast<FrameType>(rng() % 256), std::string(rng() % 10, 'z'));
        break;
    }
  }
  // Still serving: an exec on a fresh stream completes.
  auto o = a.exec(1000, Json{{"argv", {"echo", "alive"}}});
  EXPECT_EQ(o.out, "alive\n");
}

TEST(AgentProtocolTest, BusyStreamIsRefused) {
  AgentHarness a;
  a.startForked();
  a.sendJson(1, FrameType::kExec, shExec("sleep 0.3"));
  a.sendJson(1, FrameType::kStat, Json{{"path", "/"}});
  Frame f;
  ASSERT_TRUE(a.next(1, f));
  ASSERT_EQ(f.type, FrameType::kResult);
  EXPECT_EQ(Json::parse(f.payload)["code"], "failed_precondition");
  auto o = a.collect(1);
  EXPECT_EQ(o.exit["exit_code"], 0);
}

TEST(AgentProtocolTest, BadFramingClosesConnection) {
  AgentHarness a;
  a.startForked();
  a.sendRaw(std::string("\x02\x00\x00\x00\x01\x00\x00\x00\x10", 9));  // length 2 < 5
  EXPECT_TRUE(a.waitEof(3000));
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

// ---- files ----

TEST(AgentFilesTest, WriteReadRoundTrip) {
  TempDir dir;
  AgentHarness a;
  a.startForked();
  std::string data(3u << 20, '\0');
  std::mt19937 rng(42);
  for (auto& c : data) c = static_cast<char>(rng());
  std::string path = dir.path() + "/blob.bin";
  Json r = a.writeFile(1, Json{{"path", path}, {"mode", 0600}}, data);
  ASSERT_EQ(r["ok"], true) << r;
  EXPECT_EQ(r["size"], data.size());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);

  std::string got;
  r = a.readFile(2, Json{{"path", path}}, got);
  ASSERT_EQ(r["ok"], true) << r;
  EXPECT_EQ(r["size"], data.size());
  EXPECT_EQ(r["mode"], 0600);
  EXPECT_EQ(got.size(), data.size());
  EXPECT_TRUE(got == data);

  r = a.readFile(3, Json{{"path", path}, {"offset", 1000}, {"length", 70000}}, got);
  ASSERT_EQ(r["ok"], true);
  EXPECT_TRUE(got == data.substr(1000, 70000));
  r = a.readFile(4, Json{{"path", path}, {"offset", data.size() - 10}, {"length", 100}}, got);
  EXPECT_EQ(got, data.substr(data.size() - 10));
  r = a.readFile(5, Json{{"path", path}, {"offset", data.size() + 10}}, got);
  EXPECT_EQ(r["ok"], true);
  EXPECT_TRUE(got.empty());

  // Overwrite (rename over the old file) and append; no temp files left.
  r = a.writeFile(6, Json{{"path", path}}, "abc");
  EXPECT_EQ(r["size"], 3);
  r = a.writeFile(7, Json{{"path", path}, {"append", true}}, "def");
  EXPECT_EQ(r["ok"], true);
  r = a.readFile(8, Json{{"path", path}}, got);
  EXPECT_EQ(got, "abcdef");
  EXPECT_EQ(r["mode"], 0644);
  Json list = a.request(9, FrameType::kList, Json{{"path", dir.path()}});
  EXPECT_EQ(list["entries"].size(), 1u) << list;
}

TEST(AgentFilesTest, ConcurrentReadsAndExecShareTheConnection) {
  TempDir dir;
  AgentHarness a;
  a.startForked();
  std::string data(1u << 20, 'q');
  ASSERT_EQ(a.writeFile(1, Json{{"path", dir.path() + "/f"}}, data)["ok"], true);
  a.sendJson(2, FrameType::kFileRead, Json{{"path", dir.path() + "/f"}});
  a.sendJson(3, FrameType::kFileRead, Json{{"path", dir.path() + "/f"}});
  a.sendJson(4, FrameType::kExec, shExec("echo x"));
  for (uint32_t s : {2u, 3u}) {
    Frame f;
    ASSERT_TRUE(a.next(s, f));
    ASSERT_EQ(f.type, FrameType::kResult);
    std::string got;
    while (a.next(s, f) && !f.payload.empty()) got += f.payload;
    EXPECT_EQ(got.size(), data.size());
  }
  EXPECT_EQ(a.collect(4).out, "x\n");
}

TEST(AgentFilesTest, ListStatMkdirRemove) {
  TempDir dir;
  AgentHarness a;
  a.startForked();
  const std::string& d = dir.path();
  Json r = a.request(1, FrameType::kMkdir, Json{{"path", d + "/a/b/c"}, {"parents", true}});
  EXPECT_EQ(r["ok"], true) << r;
  r = a.request(2, FrameType::kMkdir, Json{{"path", d + "/a/b/c"}, {"parents", true}});
  EXPECT_EQ(r["ok"], true) << "existing dir with parents";
  r = a.request(3, FrameType::kMkdir, Json{{"path", d + "/a/b/c"}, {"parents", false}});
  EXPECT_EQ(r["code"], "already_exists");
  r = a.request(4, FrameType::kMkdir,
                Json{{"path", d + "/x/y"}, {"parents", false}, {"mode", 0700}});
  EXPECT_EQ(r["code"], "not_found");
  r = a.request(5, FrameType::kMkdir, Json{{"path", d + "/m"}, {"parents", false}, {"mode", 0700}});
  EXPECT_EQ(r["ok"], true);

  ASSERT_EQ(a.writeFile(6, Json{{"path", d + "/a/file"}}, "12345")["ok"], true);
  ASSERT_EQ(::symlink("file", (d + "/a/link").c_str()), 0);

  Json list = a.request(7, FrameType::kList, Json{{"path", d + "/a"}});
  ASSERT_EQ(list["ok"], true) << list;
  ASSERT_EQ(list["entries"].size(), 3u);
  EXPECT_EQ(list["entries"][0]["name"], "b");
  EXPECT_EQ(list["entries"][0]["type"], "dir");
  EXPECT_EQ(list["entries"][1]["name"], "file");
  EXPECT_EQ(list["entries"][1]["type"], "file");
  EXPECT_EQ(list["entries"][1]["size"], 5);
  EXPECT_EQ(list["entries"][1]["mode"], 0644);
  EXPECT_TRUE(list["entries"][1]["mtime"].is_number_float());
  EXPECT_EQ(list["entries"][2]["type"], "symlink");

  Json st = a.request(8, FrameType::kStat, Json{{"path", d + "/a/link"}});
  EXPECT_EQ(st["ok"], true);
  EXPECT_EQ(st["name"], "link");
  EXPECT_EQ(st["path"], d + "/a/link");
  EXPECT_EQ(st["type"], "symlink");
  EXPECT_EQ(st["target"], "file");
  st = a.request(9, FrameType::kStat, Json{{"path", d + "/m"}});
  EXPECT_EQ(st["type"], "dir");
  EXPECT_EQ(st["mode"], 0700);
  st = a.request(10, FrameType::kStat, Json{{"path", d + "/nope"}});
  EXPECT_EQ(st["ok"], false);
  EXPECT_EQ(st["code"], "not_found");
  EXPECT_EQ(st["errno"], ENOENT);
  EXPECT_EQ(st["message"], "stat " + d + "/nope: No such file or directory");

  // A symlink to a directory outside the tree: recursive remove unlinks it
  // and leaves the target alone.
  TempDir outside;
  ASSERT_EQ(a.writeFile(11, Json{{"path", outside.path() + "/keep"}}, "k")["ok"], true);
  ASSERT_EQ(::symlink(outside.path().c_str(), (d + "/a/b/c/out").c_str()), 0);

  r = a.request(12, FrameType::kRemove, Json{{"path", d + "/a"}});
  EXPECT_EQ(r["code"], "failed_precondition") << r;
  r = a.request(13, FrameType::kRemove, Json{{"path", d + "/a"}, {"recursive", true}});
  EXPECT_EQ(r["ok"], true) << r;
  EXPECT_NE(::access((d + "/a").c_str(), F_OK), 0);
  EXPECT_EQ(::access((outside.path() + "/keep").c_str(), F_OK), 0);
  r = a.request(14, FrameType::kRemove, Json{{"path", d + "/a"}});
  EXPECT_EQ(r["code"], "not_found");
  r = a.request(15, FrameType::kRemove, Json{{"path", d + "/m"}});
  EXPECT_EQ(r["ok"], true);
  r = a.request(16, FrameType::kRemove, Json{{"path", "/"}, {"recursive", true}});
  EXPECT_EQ(r["code"], "invalid_argument");
}

TEST(AgentFilesTest, MetadataIsKeptAsUserXattrsAndListed) {
  TempDir dir;
  AgentHarness a;
  a.startForked();
  const std::string f = dir.path() + "/f";
  ASSERT_EQ(a.writeFile(1, Json{{"path", f}}, "x")["ok"], true);
  Json r = a.request(2, FrameType::kSetMeta, Json{{"path", f}, {"meta", {{"owner", "agent-7"}, {"k.v-1_", "a b"}}}});
  if (r["code"] == "failed_precondition") GTEST_SKIP() << "no user xattrs here: " << r;
  ASSERT_EQ(r["ok"], true) << r;
  Json st = a.request(3, FrameType::kStat, Json{{"path", f}});
  EXPECT_EQ(st["meta"], (Json{{"owner", "agent-7"}, {"k.v-1_", "a b"}})) << st;
  Json list = a.request(4, FrameType::kList, Json{{"path", dir.path()}});
  ASSERT_EQ(list["entries"].size(), 1u);
  EXPECT_EQ(list["entries"][0]["meta"]["owner"], "agent-7");
  // An empty value removes a key; other xattrs are not metadata.
  ASSERT_EQ(::setxattr(f.c_str(), "user.other", "1", 1, 0), 0);
  r = a.request(5, FrameType::kSetMeta, Json{{"path", f}, {"meta", {{"owner", ""}}}});
  ASSERT_EQ(r["ok"], true) << r;
  st = a.request(6, FrameType::kStat, Json{{"path", f}});
  EXPECT_EQ(st["meta"], (Json{{"k.v-1_", "a b"}})) << st;
  // Bad keys and values name the field; nothing is set.
  for (const Json& bad : {Json{{"Upper", "v"}}, Json{{"", "v"}}, Json{{"k", "\n"}},
                          Json{{"k", std::string(4097, 'v')}}}) {
    r = a.request(7, FrameType::kSetMeta, Json{{"path", f}, {"meta", bad}});
    EXPECT_EQ(r["code"], "invalid_argument") << bad;
    EXPECT_EQ(r["field"], "meta") << bad;
  }
  r = a.request(8, FrameType::kSetMeta, Json{{"path", f}, {"meta", "x"}});
  EXPECT_EQ(r["field"], "meta");
  r = a.request(9, FrameType::kSetMeta, Json{{"path", dir.path() + "/none"}, {"meta", {{"k", "v"}}}});
  EXPECT_EQ(r["code"], "not_found");
}

TEST(AgentFilesTest, Errors) {
  TempDir dir;
  AgentHarness a;
  a.startForked();
  std::string got;
  Json r = a.readFile(1, Json{{"path", dir.path() + "/missing"}}, got);
  EXPECT_EQ(r["code"], "not_found");
  r = a.readFile(2, Json{{"path", dir.path()}}, got);
  EXPECT_EQ(r["code"], "invalid_argument");
  EXPECT_EQ(r["errno"], EISDIR);
  r = a.readFile(3, Json{{"path", "/dev/zero"}}, got);
  EXPECT_EQ(r["code"], "invalid_argument");
  r = a.request(4, FrameType::kList, Json{{"path", dir.path() + "/missing"}});
  EXPECT_EQ(r["code"], "not_found");

  // An early write error is answered at once; the stream's data is ignored.
  a.sendJson(5, FrameType::kFileWrite, Json{{"path", dir.path() + "/no/dir/f"}});
  Frame f;
  ASSERT_TRUE(a.next(5, f));
  EXPECT_EQ(Json::parse(f.payload)["code"], "not_found");
  a.send(5, FrameType::kData, "ignored");
  a.send(5, FrameType::kData, {});
  r = a.writeFile(6, Json{{"path", dir.path()}}, "x");
  EXPECT_EQ(r["code"], "invalid_argument");

  // A cancelled write leaves nothing behind.
  a.sendJson(7, FrameType::kFileWrite, Json{{"path", dir.path() + "/partial"}});
  a.send(7, FrameType::kData, "half");
  a.send(7, FrameType::kCancel, {});
  r = a.request(8, FrameType::kList, Json{{"path", dir.path()}});
  EXPECT_EQ(r["entries"].size(), 0u) << r;
}

TEST(AgentPackUpperTest, StreamsTheTreeAndRefusesWritesMeanwhile) {
  TempDir dir;
  {
    AgentHarness plain;
    plain.startForked();
    Json r = plain.request(1, FrameType::kPackUpper, Json::object());
    EXPECT_EQ(r["code"], "failed_precondition") << r;
  }
  std::string big(6u << 20, 'b');  // more than the queue's high water
  std::ofstream(dir.path() + "/big", std::ios::binary) << big;
  UniqueFd upper(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(upper);
  AgentOptions options;
  options.upper_fd = upper.get();
  options.upper_freeze = false;  // a host file system: never freeze it
  AgentHarness a;
  a.startForked(std::move(options));
  a.sendJson(1, FrameType::kPackUpper, Json::object());
  Frame f;
  ASSERT_TRUE(a.next(1, f));
  ASSERT_EQ(f.type, FrameType::kResult);
  EXPECT_EQ(Json::parse(f.payload)["ok"], true) << f.payload;
  // Unread, the tar stalls at the high water: the pack is still going.
  Json r = a.request(2, FrameType::kMkdir, Json{{"path", dir.path() + "/m"}});
  EXPECT_EQ(r["code"], "unavailable") << r;
  r = a.request(3, FrameType::kStat, Json{{"path", dir.path() + "/big"}});
  EXPECT_EQ(r["ok"], true) << r;
  std::string tar;
  for (;;) {
    ASSERT_TRUE(a.next(1, f, 30000));
    ASSERT_EQ(f.type, FrameType::kData);
    if (f.payload.empty()) break;
    tar += f.payload;
  }
  EXPECT_EQ(tar.size() % 512, 0u);
  EXPECT_NE(tar.find("./big"), std::string::npos);
  EXPECT_NE(tar.find(big.substr(0, 4096)), std::string::npos);
  // Over: writes go again.
  r = a.request(4, FrameType::kMkdir, Json{{"path", dir.path() + "/m"}});
  EXPECT_EQ(r["ok"], true) << r;
}

TEST(FilesTest, ListIsCutToFitAFrame) {
  TempDir dir;
  for (int i = 0; i < 50; ++i) {
    std::ofstream(dir.path() + "/f" + std::to_string(100 + i)) << "x";
  }
  auto full = listDir(dir.path(), proto::kMaxPayload);
  ASSERT_TRUE(full.isOk());
  Json j = Json::parse(*full);
  EXPECT_EQ(j["entries"].size(), 50u);
  EXPECT_FALSE(j.contains("truncated"));
  auto cut = listDir(dir.path(), 1000);
  ASSERT_TRUE(cut.isOk());
  EXPECT_LE(cut->size(), 1000u);
  j = Json::parse(*cut);
  EXPECT_EQ(j["truncated"], true);
  ASSERT_GT(j["entries"].size(), 0u);
  EXPECT_LT(j["entries"].size(), 50u);
  EXPECT_EQ(j["entries"][0]["name"], "f100");  // the first ones by name
}

// ---- the binary ----

TEST(AetherBinaryTest, NoInitServesExecs) {
  AgentHarness a;
  a.startBinary(true);
  auto o = a.exec(1, shExec("echo static"));
  EXPECT_EQ(o.out, "static\n");
  EXPECT_EQ(o.exit["exit_code"], 0);
  a.closeSocket();
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(AetherBinaryTest, InitWithoutRootfs) {
  AgentHarness a;
  a.startBinary(false);
  // The exec is sent right behind init, before hello: it must not be lost.
  a.sendJson(0, FrameType::kInit, Json{{"hostname", "sb-test"}, {"env", {"FOO=from-init"}}});
  a.sendJson(1, FrameType::kExec, shExec("echo $FOO"));
  a.expectHello();
  auto o = a.collect(1);
  EXPECT_EQ(o.out, "from-init\n");
}

TEST(AetherBinaryTest, BadInitIsReported) {
  AgentHarness a;
  a.startBinary(false);
  a.sendJson(0, FrameType::kInit, Json{{"rootfs", {{"lower", Json::array()}}}});
  Frame f;
  ASSERT_TRUE(a.next(0, f));
  EXPECT_EQ(f.type, FrameType::kResult);
  EXPECT_EQ(Json::parse(f.payload)["code"], "invalid_argument");
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

// ---- container start-up ----

bool haveOverlay() {
  std::ifstream fs("/proc/filesystems");
  std::string line;
  while (std::getline(fs, line)) {
    if (line.find("\toverlay") != std::string::npos) return true;
  }
  return false;
}

// A two-layer image: busybox below, /etc above.
struct TestImage {
  TempDir base;
  std::string lower_bottom, lower_top, upper, work, target;

  TestImage() {
    const std::string& b = base.path();
    lower_bottom = b + "/l1";
    lower_top = b + "/l2";
    upper = b + "/upper";
    work = b + "/work";
    target = b + "/rootfs";
    for (const auto& d : {lower_bottom, lower_bottom + "/bin", lower_top, lower_top + "/etc", upper,
                          work, target}) {
      ::mkdir(d.c_str(), 0755);
    }
    std::ifstream src("/usr/bin/busybox", std::ios::binary);
    std::ofstream dst(lower_bottom + "/bin/busybox", std::ios::binary);
    dst << src.rdbuf();
    dst.close();
    ::chmod((lower_bottom + "/bin/busybox").c_str(), 0755);
    for (const char* tool : {"sh", "cat", "ls", "id", "hostname", "echo", "sleep", "grep"}) {
      (void)!::symlink("busybox", (lower_bottom + "/bin/" + tool).c_str());
    }
    std::ofstream(lower_top + "/etc/passwd") << "root:x:0:0:root:/root:/bin/sh\n"
                                             << "app:x:1000:1000::/home/app:/bin/sh\n";
    std::ofstream(lower_top + "/etc/group") << "root:x:0:\napp:x:1000:\n";
  }

  Json init(const std::string& hostname) const {
    return Json{{"hostname", hostname},
                {"rootfs",
                 {{"lower", {lower_top, lower_bottom}},
                  {"upper", upper},
                  {"work", work},
                  {"target", target}}},
                {"env", {"PATH=/bin"}}};
  }
};

TEST(ContainerInitTest, BuildsTheSandboxRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for namespaces and mounts";
  if (!haveOverlay()) GTEST_SKIP() << "kernel has no overlayfs";
  if (::access("/usr/bin/busybox", X_OK) != 0) GTEST_SKIP() << "needs /usr/bin/busybox (static)";
  TestImage image;
  AgentHarness a;
  a.startInNamespaces();
  a.sendJson(0, FrameType::kInit, image.init("sb-init-test"));
  Frame f;
  if (!a.next(0, f, 5000)) {
    int status = a.wait();
    if (WIFEXITED(status) && WEXITSTATUS(status) == AgentHarness::kNoNamespaces) {
      GTEST_SKIP() << "unshare() of namespaces is not permitted here";
    }
    FAIL() << "no reply to init; status " << status;
  }
  ASSERT_EQ(f.type, FrameType::kHello) << f.payload;
  EXPECT_EQ(Json::parse(f.payload)["pid"], 1);

  auto o = a.exec(1, shExec("hostname; cat /etc/hostname; grep sb-init-test /etc/hosts; "
                            "cat /sys/class/net/lo/flags; ls /dev; ls /dev/pts; "
                            "grep -c ' / overlay ' /proc/mounts; echo $PATH $HOME"));
  ASSERT_TRUE(o.exit.is_object()) << o.result;
  EXPECT_EQ(o.exit["exit_code"], 0) << o.err;
  EXPECT_EQ(o.out,
            "sb-init-test\nsb-init-test\n127.0.1.1\tsb-init-test\n"
            "0x9\n"  // IFF_UP | IFF_LOOPBACK
            "fd\nfull\nnull\nptmx\npts\nrandom\nshm\nstderr\nstdin\nstdout\ntty\nurandom\nzero\n"
            "ptmx\n"
            "1\n/bin /root\n");

  // The old root is gone; sysfs and /proc/sys are read-only; /proc/kcore is masked.
  o = a.exec(2, shExec("ls " + image.base.path() +
                       " >/dev/null 2>&1 || echo gone; "
                       "echo x > /sys/kernel/x 2>/dev/null || echo sys-ro; "
                       "echo x > /proc/sys/kernel/domainname 2>/dev/null || echo proc-sys-ro; "
                       "cat /proc/kcore | grep -c . ; ls /sys/firmware | grep -c ."));
  EXPECT_EQ(o.out, "gone\nsys-ro\nproc-sys-ro\n0\n0\n") << o.err;

  // Users come from the image's /etc/passwd.
  o = a.exec(3, Json{{"argv", {"id", "-u"}}, {"user", "app"}});
  EXPECT_EQ(o.out, "1000\n") << o.err;

  // Writes land in the upper layer.
  EXPECT_EQ(a.writeFile(4, Json{{"path", "/hello.txt"}}, "hi")["ok"], true);
  std::ifstream written(image.upper + "/hello.txt");
  std::string content;
  std::getline(written, content);
  EXPECT_EQ(content, "hi");

  a.closeSocket();
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ContainerInitTest, MountFailureIsReported) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for namespaces and mounts";
  if (!haveOverlay()) GTEST_SKIP() << "kernel has no overlayfs";
  TestImage image;
  Json init = image.init("sb-x");
  init["rootfs"]["lower"] = {image.base.path() + "/missing-layer"};
  AgentHarness a;
  a.startInNamespaces();
  a.sendJson(0, FrameType::kInit, init);
  Frame f;
  if (!a.next(0, f, 5000)) {
    int status = a.wait();
    if (WIFEXITED(status) && WEXITSTATUS(status) == AgentHarness::kNoNamespaces) {
      GTEST_SKIP() << "unshare() of namespaces is not permitted here";
    }
    FAIL() << "no reply to init; status " << status;
  }
  ASSERT_EQ(f.type, FrameType::kResult);
  Json r = Json::parse(f.payload);
  EXPECT_EQ(r["ok"], false);
  EXPECT_EQ(r["code"], "not_found");
  EXPECT_EQ(r["errno"], ENOENT);
  EXPECT_EQ(r["message"].get<std::string>().rfind("mount overlay ", 0), 0u) << r;
  int status = a.wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

}  // namespace
}  // namespace dsec::aether
