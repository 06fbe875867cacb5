#include "common/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "common/http_client.h"
#include "common/runtime.h"

namespace dsec::http {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Raw sockets, for what the Client cannot do: send malformed or stalled
// requests and see the exact bytes and the close.
int rawSocket() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{3, 0};  // a broken server fails the test instead of hanging it
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

bool rawConnect(int fd, uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
}

int rawConnect(uint16_t port) {
  int fd = rawSocket();
  EXPECT_TRUE(rawConnect(fd, port)) << strerror(errno);
  return fd;
}

void sendAll(int fd, std::string_view s) {
  ASSERT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size()));
}

// Everything until the server closes; `eof` tells whether it did (rather than
// the 3 s guard timing out).
std::string readToEof(int fd, bool* eof = nullptr) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      if (eof) *eof = n == 0;
      return out;
    }
    out.append(buf, size_t(n));
  }
}

uint16_t localPort(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return 0;
  return sa.sin_family == AF_INET ? ntohs(sa.sin_port) : 0;
}

// What the /big handler saw when its response stalled.
struct BigResult {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

class TestServer {
 public:
  explicit TestServer(ServerOptions o, BigResult* big = nullptr) : server_(o) {
    EXPECT_TRUE(server_.listen().isOk());
    thread_ = std::thread([this, big] {
      server_.serve([big](Request& req, Response& res) {
        if (req.path == "/echo") {
          auto body = req.readBody(1 << 20);
          if (!body.isOk()) {
            (void)res.send(httpStatusFor(body.status().code()), "text/plain",
                           body.status().message());
            return;
          }
          (void)res.send(200, "text/plain",
                         req.method + " " + req.param("q").value_or("-") + " " + *body);
        } else if (req.path == "/ignore") {  // never reads the request body
          (void)res.send(200, "text/plain", "ignored");
        } else if (req.path == "/chunks") {
          (void)res.beginChunked(200, "application/x-ndjson");
          for (int i = 0; i < 3; ++i) (void)res.write("line" + std::to_string(i) + "\n");
          (void)res.finish();
        } else if (req.path == "/big" && big) {  // far more than socket buffers hold
          const uint64_t kTotal = 256ull << 20;
          std::string piece(64 << 10, 'x');
          Status st = res.beginFixed(200, "application/octet-stream", kTotal);
          for (uint64_t sent = 0; st.isOk() && sent < kTotal; sent += piece.size()) {
            st = res.write(piece);
          }
          std::lock_guard lk(big->mu);
          big->done = true;
          big->status = st;
          big->cv.notify_all();
        } else {
          (void)res.send(404, "text/plain", "nope " + req.path);
        }
      });
    });
  }
  ~TestServer() {
    server_.stop();
    thread_.join();
  }
  uint16_t port() { return server_.port(); }
  std::string url() { return "http://127.0.0.1:" + std::to_string(port()); }
  ServerStats stats() { return server_.stats(); }

 private:
  Server server_;
  std::thread thread_;
};

ServerOptions fastOptions() {
  ServerOptions o;
  o.port = 0;
  o.idleTimeoutS = 0.3;
  o.bodyTimeoutS = 0.3;
  o.sendTimeoutS = 0.3;
  return o;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<TestServer>(fastOptions(), &big_);
    ClientOptions co;
    co.readTimeoutS = 3;  // a regression fails the test rather than hanging it
    auto c = Client::connect(server_->url(), "t", co);
    ASSERT_TRUE(c.isOk());
    client_ = std::move(c).value();
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
  }
  BigResult big_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(HttpServerTest, KeepAliveRequestsWithQueryAndBody) {
  for (int i = 0; i < 3; ++i) {
    auto r = client_->request("POST", "/echo?q=a%20b", "payload");
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "POST a b payload");
  }
  auto r = client_->request("GET", "/x%2Fy");
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(r->body, "nope /x/y");
}

TEST_F(HttpServerTest, ChunkedStream) {
  std::string got;
  auto r = client_->requestStreaming("GET", "/chunks", "", [&](std::string_view d) { got += d; });
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(got, "line0\nline1\nline2\n");
}

TEST_F(HttpServerTest, OversizeBodyRejected) {
  auto r = client_->request("POST", "/echo", std::string((1 << 20) + 10, 'x'));
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status, 413);
}

// The client must not wait for the body a HEAD response only announces, and
// the connection stays usable, bodies included, afterwards.
TEST_F(HttpServerTest, HeadThenGetOnOneConnection) {
  auto h = client_->request("HEAD", "/echo?q=z");
  ASSERT_TRUE(h.isOk()) << h.status().toString();
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(h->body, "");
  auto g = client_->request("GET", "/echo?q=z");
  ASSERT_TRUE(g.isOk()) << g.status().toString();
  EXPECT_EQ(g->body, "GET z ");
}

TEST_F(HttpServerTest, MalformedRequestAfterHeadGets400WithBody) {
  int fd = rawConnect(server_->port());
  sendAll(fd, "HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n\x01 nonsense\r\n\r\n");
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  size_t second = got.find("HTTP/1.1 400");
  ASSERT_NE(second, std::string::npos) << got;
  std::string bad = got.substr(second);
  EXPECT_NE(bad.find("Connection: close\r\n"), std::string::npos) << bad;
  EXPECT_TRUE(
      bad.ends_with(R"({"error":{"code":"invalid_argument","message":"malformed HTTP request"}})"))
      << bad;
}

TEST_F(HttpServerTest, MalformedUrlGets400AndClose) {
  int fd = rawConnect(server_->port());
  sendAll(fd, "GET /a%zz HTTP/1.1\r\nHost: x\r\n\r\n");
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 400")) << got;
  EXPECT_NE(got.find("Connection: close\r\n"), std::string::npos) << got;
  EXPECT_NE(got.find("malformed percent-encoding in URL"), std::string::npos) << got;
}

// A body the handler never read, and too big to have been read before it
// ran (past preReadBytes), ends the connection; the response says so.
TEST_F(HttpServerTest, UnreadBodySaysConnectionClose) {
  int fd = rawConnect(server_->port());
  const size_t kBig = (64 << 10) + 1000;
  sendAll(fd, "POST /ignore HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(kBig) +
                  "\r\n\r\n" + std::string(kBig, 'b'));
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 200")) << got;
  EXPECT_NE(got.find("Connection: close\r\n"), std::string::npos) << got;
  EXPECT_TRUE(got.ends_with("ignored")) << got;
  // Without a body there is nothing left unread: the connection is kept.
  for (int i = 0; i < 2; ++i) {
    auto r = client_->request("GET", "/ignore");
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_EQ(r->body, "ignored");
  }
}

// A small body is read before the handler runs: left unread, it costs
// nothing, and the connection carries the next request.
TEST_F(HttpServerTest, SmallUnreadBodyKeepsConnection) {
  int fd = rawConnect(server_->port());
  sendAll(fd,
          "POST /ignore HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789"
          "GET /echo?q=2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  size_t second = got.find("HTTP/1.1 200", 1);
  ASSERT_NE(second, std::string::npos) << got;
  std::string first = got.substr(0, second);
  EXPECT_EQ(first.find("Connection: close"), std::string::npos) << first;
  EXPECT_TRUE(first.ends_with("ignored")) << first;
  EXPECT_TRUE(got.ends_with("GET 2 ")) << got;
}

TEST_F(HttpServerTest, IdleConnectionClosedQuietly) {
  int fd = rawConnect(server_->port());
  auto t0 = Clock::now();
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof) << "server kept an idle connection past idleTimeoutS";
  EXPECT_EQ(got, "");
  EXPECT_GE(secondsSince(t0), 0.25);
}

TEST_F(HttpServerTest, StalledBodyFailsRequest) {
  int fd = rawConnect(server_->port());
  sendAll(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc");
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 504")) << got;  // kDeadlineExceeded
  EXPECT_NE(got.find("Connection: close\r\n"), std::string::npos) << got;
  EXPECT_TRUE(got.ends_with("reading request body: timed out")) << got;
}

// A client that stops reading must not hold the handler: its write fails.
TEST_F(HttpServerTest, StalledReaderFailsWrite) {
  int fd = rawSocket();
  int small = 4096;  // before connect, so the window stays small
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  ASSERT_TRUE(rawConnect(fd, server_->port()));
  sendAll(fd, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n");
  std::unique_lock lk(big_.mu);
  bool done = big_.cv.wait_for(lk, std::chrono::seconds(4), [&] { return big_.done; });
  ::close(fd);
  ASSERT_TRUE(done) << "handler still blocked writing to a client that never reads";
  EXPECT_EQ(big_.status.code(), Code::kUnavailable) << big_.status.toString();
}

TEST_F(HttpServerTest, SocketsAreCloseOnExec) {
  ASSERT_TRUE(client_->request("GET", "/x").isOk());  // the server has accepted it
  // Bound to the server's port: the listener and the accepted connection.
  int serverSide = 0;
  DIR* d = opendir("/proc/self/fd");
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) {
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
    if (localPort(fd) != server_->port()) continue;
    ++serverSide;
    EXPECT_TRUE(fcntl(fd, F_GETFD) & FD_CLOEXEC) << "fd " << fd << " is inherited by children";
  }
  closedir(d);
  EXPECT_GE(serverSide, 2);
}

TEST(HttpServerCapTest, OverCapGets503) {
  ServerOptions o = fastOptions();
  o.maxConnections = 1;
  TestServer server(o);
  auto first = Client::connect(server.url(), "");
  ASSERT_TRUE(first.isOk());
  ASSERT_TRUE((*first)->request("GET", "/x").isOk());  // accepted: the one slot is taken

  int fd = rawConnect(server.port());
  bool eof = false;
  std::string got = readToEof(fd, &eof);
  ::close(fd);
  EXPECT_TRUE(eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 503")) << got;
  EXPECT_NE(got.find("Connection: close\r\n"), std::string::npos) << got;
  EXPECT_TRUE(got.ends_with(R"({"error":{"code":"unavailable","message":"too many connections"}})"))
      << got;
  EXPECT_EQ(server.stats().refusedTotal, 1u);
  EXPECT_EQ(server.stats().openConnections, 1);

  // Once the first connection ends its slot is free again.
  first->reset();
  auto t0 = Clock::now();
  int status = 0;
  while (status != 200 && secondsSince(t0) < 2) {
    auto c = Client::connect(server.url(), "");
    ASSERT_TRUE(c.isOk());
    auto r = (*c)->request("GET", "/echo");
    status = r.isOk() ? r->status : 0;
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(status, 200);
}

// A listening socket nobody accepts on: connects complete, nothing answers.
TEST(HttpClientTest, ReadTimesOut) {
  int lfd = rawSocket();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(lfd, 8), 0);
  ClientOptions co;
  co.readTimeoutS = 0.3;
  auto c = Client::connect("http://127.0.0.1:" + std::to_string(localPort(lfd)), "", co);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto t0 = Clock::now();
  auto r = (*c)->request("GET", "/x");
  ::close(lfd);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDeadlineExceeded) << r.status().toString();
  EXPECT_LT(secondsSince(t0), 2.0);
}

// A full accept queue makes Linux drop SYNs, so a connect hangs in retries.
TEST(HttpClientTest, ConnectTimesOut) {
  int lfd = rawSocket();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(lfd, 0), 0);
  uint16_t port = localPort(lfd);
  std::vector<int> fillers;
  for (int i = 0; i < 2; ++i) {
    int f = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in to = sa;
    to.sin_port = htons(port);
    (void)::connect(f, reinterpret_cast<sockaddr*>(&to), sizeof to);
    fillers.push_back(f);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ClientOptions co;
  co.connectTimeoutS = 0.3;
  auto t0 = Clock::now();
  auto c = Client::connect("http://127.0.0.1:" + std::to_string(port), "", co);
  double took = secondsSince(t0);
  for (int f : fillers) ::close(f);
  ::close(lfd);
  if (c.isOk()) GTEST_SKIP() << "this kernel completed a connect past a full accept queue";
  EXPECT_EQ(c.status().code(), Code::kDeadlineExceeded) << c.status().toString();
  EXPECT_LT(took, 2.0);
}

TEST(PercentTest, DecodeEncode) {
  std::string out;
  EXPECT_TRUE(percentDecode("a%2fb", out));
  EXPECT_EQ(out, "a/b");
  EXPECT_FALSE(percentDecode("a%2", out));
  EXPECT_FALSE(percentDecode("a%zz", out));
  EXPECT_EQ(percentEncode("a b/c"), "a%20b/c");
}

// ---------------------------------------------------------------- the coroutine server

// A server with any handler, on its own Runtime (so threads and inline calls
// can be checked), serving on a thread of its own. The Runtime goes last, as
// Deferreds of the server must (http_server.h).
class AnyServer {
 public:
  AnyServer(ServerOptions o, Handler h, RuntimeOptions ro = {1, 4, 4})
      : rt_(std::make_unique<Runtime>(ro)) {
    o.runtime = rt_.get();
    server_ = std::make_unique<Server>(std::move(o));
    EXPECT_TRUE(server_->listen().isOk());
    thread_ = std::thread([this, h = std::move(h)] { server_->serve(h); });
  }
  ~AnyServer() {
    stop();
    server_.reset();
  }
  // stop(), and serve() has returned.
  void stop() {
    server_->stop();
    if (thread_.joinable()) thread_.join();
  }
  Server& server() { return *server_; }
  Runtime& runtime() { return *rt_; }
  uint16_t port() { return server_->port(); }
  std::string url() { return "http://127.0.0.1:" + std::to_string(port()); }

  // Polls stats() until pred holds; false after `guardS` (a guard against a
  // hang, not a timing assertion).
  bool waitStats(const std::function<bool(const ServerStats&)>& pred, double guardS = 20) {
    auto t0 = Clock::now();
    while (!pred(server_->stats())) {
      if (secondsSince(t0) > guardS) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

 private:
  std::unique_ptr<Runtime> rt_;
  std::unique_ptr<Server> server_;
  std::thread thread_;
};

// Deferred responses parked by handlers, for the test (or a completer
// thread) to finish.
struct Parked {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Deferred>> list;
  void add(std::shared_ptr<Deferred> d) {
    std::lock_guard lk(mu);
    list.push_back(std::move(d));
    cv.notify_all();
  }
  std::shared_ptr<Deferred> take() {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, std::chrono::seconds(10), [&] { return !list.empty(); })) return nullptr;
    auto d = std::move(list.front());
    list.erase(list.begin());
    return d;
  }
};

int threadCount() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// Raises the open-file limit to at least `want`; false if it cannot.
bool raiseFdLimit(rlim_t want) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return false;
  if (rl.rlim_cur >= want) return true;
  if (rl.rlim_max < want) rl.rlim_max = want;  // root only (CAP_SYS_RESOURCE)
  rl.rlim_cur = want;
  return setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

// One response, read to the end of its Content-Length body.
std::string readResponse(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    size_t end = out.find("\r\n\r\n");
    if (end != std::string::npos) {
      size_t cl = out.find("Content-Length: ");
      size_t len = cl == std::string::npos ? 0 : std::stoul(out.substr(cl + 16));
      if (out.size() >= end + 4 + len) return out;
    }
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return out;
    out.append(buf, size_t(n));
  }
}

// Many client connections held by a child process, so they do not count
// against this process's open-file limit (the server's side does). The child
// only makes system calls and talks to us through two pipes.
class ClientFleet {
 public:
  // Opens n connections to port, sends `first` on each and, if readReply,
  // reads one response on each.
  ClientFleet(uint16_t port, int n, std::string first, bool readReply) {
    int cmd[2], ack[2];
    if (::pipe2(cmd, O_CLOEXEC) != 0 || ::pipe2(ack, O_CLOEXEC) != 0) return;
    fds_.reserve(size_t(n));
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(cmd[1]);
      ::close(ack[0]);
      child(port, n, first, readReply, cmd[0], ack[1]);
    }
    ::close(cmd[0]);
    ::close(ack[1]);
    cmd_ = cmd[1];
    ack_ = ack[0];
  }
  ~ClientFleet() {
    if (pid_ <= 0) return;
    (void)!::write(cmd_, "q", 1);
    ::close(cmd_);
    ::close(ack_);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  }
  // Waits for the child to finish its step; false if it failed.
  bool done() {
    char c = 0;
    return pid_ > 0 && ::read(ack_, &c, 1) == 1 && c == 'k';
  }
  // Sends `second` on every connection (done() says when). The child has its
  // own copy of our memory: the bytes go down the pipe.
  void sendOnAll(const std::string& second) {
    uint32_t len = uint32_t(second.size());
    (void)!::write(cmd_, "s", 1);
    (void)!::write(cmd_, &len, sizeof len);
    (void)!::write(cmd_, second.data(), second.size());
  }

 private:
  [[noreturn]] void child(uint16_t port, int n, const std::string& first, bool readReply, int cmd,
                          int ack) {
    auto fail = [&] {
      (void)!::write(ack, "e", 1);
      _exit(1);
    };
    for (int i = 0; i < n; ++i) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0 || !rawConnect(fd, port)) fail();
      if (::send(fd, first.data(), first.size(), MSG_NOSIGNAL) != ssize_t(first.size())) fail();
      if (readReply && readResponse(fd).find("\r\n\r\n") == std::string::npos) fail();
      fds_.push_back(fd);
    }
    (void)!::write(ack, "k", 1);
    for (;;) {
      char c = 0;
      if (::read(cmd, &c, 1) != 1 || c == 'q') _exit(0);  // closes every socket
      uint32_t len = 0;
      if (::read(cmd, &len, sizeof len) != sizeof len) fail();
      std::string msg(len, 0);
      for (size_t got = 0; got < len;) {
        ssize_t r = ::read(cmd, msg.data() + got, len - got);
        if (r <= 0) fail();
        got += size_t(r);
      }
      for (int fd : fds_) {
        if (::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL) != ssize_t(msg.size())) fail();
      }
      (void)!::write(ack, "k", 1);
    }
  }

  pid_t pid_ = -1;
  int cmd_ = -1, ack_ = -1;
  std::vector<int> fds_;
};

TEST(HttpServerDeferredTest, CompletedFromAnotherThreadPlainAndChunked) {
  Parked parked;
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [&](Request& req, Response& res) {
    if (req.path == "/defer" || req.path == "/defer-chunks") {
      auto d = res.defer();
      ASSERT_NE(d, nullptr);
      EXPECT_EQ(res.defer(), nullptr);  // once
      EXPECT_TRUE(res.started());
      parked.add(std::move(d));
      return;  // the worker is free; the connection waits
    }
    (void)res.send(404, "text/plain", "nope");
  });
  std::thread completer([&] {
    for (int i = 0; i < 4; ++i) {
      auto d = parked.take();
      if (!d) return;
      if (i % 2 == 0) {
        d->setHeader("X-Deferred", "yes");
        EXPECT_TRUE(d->send(200, "text/plain", "late " + std::to_string(i)).isOk());
        EXPECT_EQ(d->send(200, "text/plain", "again").code(), Code::kInternal);
      } else {
        EXPECT_EQ(d->write("too soon").code(), Code::kInternal);
        EXPECT_TRUE(d->beginChunked(200, "application/x-ndjson").isOk());
        for (int k = 0; k < 3; ++k) EXPECT_TRUE(d->write("c" + std::to_string(k) + "\n").isOk());
        EXPECT_TRUE(d->finish().isOk());
        EXPECT_EQ(d->write("after").code(), Code::kInternal);
      }
      EXPECT_FALSE(d->gone());
    }
  });
  ClientOptions co;
  co.readTimeoutS = 10;
  auto c = Client::connect(s.url(), "", co);
  ASSERT_TRUE(c.isOk());
  // Twice each on one kept-alive connection.
  for (int round = 0; round < 2; ++round) {
    auto r = (*c)->request("GET", "/defer");
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "late " + std::to_string(2 * round));
    std::string got;
    auto st =
        (*c)->requestStreaming("GET", "/defer-chunks", "", [&](std::string_view d) { got += d; });
    ASSERT_TRUE(st.isOk()) << st.status().toString();
    EXPECT_EQ(got, "c0\nc1\nc2\n");
  }
  completer.join();
  // The server counts a request done after its last byte is written, which
  // may be just after the client has read it.
  EXPECT_TRUE(s.waitStats(
      [](const ServerStats& st) { return st.deferredInFlight == 0 && st.inFlight == 0; }));
  ServerStats st = s.server().stats();
  EXPECT_EQ(st.inFlight, 0);
  EXPECT_GE(st.peakInFlight, 1);
  EXPECT_EQ(st.acceptedTotal, 1u);
}

// "Answer, then work": a response deferred and sent while the handler runs
// on reaches the client before the handler returns (the platform answers a
// node's death report before it calls back into the node).
TEST(HttpServerDeferredTest, AnswerGoesOutWhileTheHandlerWorksOn) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> returned{false};
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [&](Request& req, Response& res) {
    auto body = req.readBody(100);
    (void)res.defer()->send(200, "text/plain", "got " + body.value());
    released.wait_for(std::chrono::seconds(10));  // the work after the answer
    returned = true;
  });
  ClientOptions co;
  co.readTimeoutS = 10;
  auto c = Client::connect(s.url(), "", co);
  ASSERT_TRUE(c.isOk());
  auto r = (*c)->request("POST", "/report", "death");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->body, "got death");
  EXPECT_FALSE(returned.load()) << "the answer waited for the handler";
  release.set_value();
  // The connection carries on once the handler is done.
  r = (*c)->request("POST", "/report", "again");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->body, "got again");
}

// The deferred response's header carries what the handler set before
// deferring; a deferred response dropped unanswered is a 500, and the
// connection carries on.
TEST(HttpServerDeferredTest, DroppedUnansweredIs500) {
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [&](Request& req, Response& res) {
    res.setHeader("X-Before", "1");
    auto d = res.defer();
    if (req.path == "/answer") (void)d->send(201, "text/plain", "ok");
    // else: dropped here, unanswered
  });
  int fd = rawConnect(s.port());
  sendAll(fd, "GET /drop HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string got = readResponse(fd);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 500")) << got;
  EXPECT_NE(got.find("X-Before: 1\r\n"), std::string::npos) << got;
  EXPECT_NE(got.find("deferred response dropped unanswered"), std::string::npos) << got;
  sendAll(fd, "GET /answer HTTP/1.1\r\nHost: x\r\n\r\n");
  got = readResponse(fd);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 201")) << got;
  EXPECT_TRUE(got.ends_with("ok")) << got;
  ::close(fd);
}

TEST(HttpServerDeferredTest, ClientGoneIsNoticedAndCleanedUp) {
  Parked parked;
  std::mutex mu;
  std::condition_variable cv;
  int goneCalls = 0;
  bool goneOnIo = false;
  ServerOptions o;
  o.port = 0;
  std::unique_ptr<AnyServer> s;
  s = std::make_unique<AnyServer>(o, [&](Request&, Response& res) {
    auto d = res.defer();
    d->onClientGone([&] {
      std::lock_guard lk(mu);
      ++goneCalls;
      goneOnIo = s->runtime().onIoThread();
      cv.notify_all();
    });
    parked.add(std::move(d));
  });
  int fd = rawConnect(s->port());
  sendAll(fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  auto d = parked.take();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(s->waitStats([](const ServerStats& st) { return st.deferredInFlight == 1; }));
  EXPECT_FALSE(d->gone());
  ::close(fd);  // the client gives up
  {
    std::unique_lock lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(10), [&] { return goneCalls > 0; }))
        << "no onClientGone after the client closed";
  }
  EXPECT_TRUE(goneOnIo);
  EXPECT_TRUE(d->gone());
  EXPECT_EQ(d->send(200, "text/plain", "too late").code(), Code::kUnavailable);
  EXPECT_TRUE(s->waitStats([](const ServerStats& st) {
    return st.openConnections == 0 && st.deferredInFlight == 0 && st.inFlight == 0;
  }));
  // Registered after the fact: called soon, once.
  std::promise<void> late;
  d->onClientGone([&] { late.set_value(); });
  EXPECT_EQ(late.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  d.reset();
  s.reset();
  EXPECT_EQ(goneCalls, 1);
}

// stop() ends deferred responses too: they hear onClientGone, and serve()
// returns.
TEST(HttpServerDeferredTest, StopTellsDeferredResponses) {
  Parked parked;
  std::promise<void> gone;
  ServerOptions o;
  o.port = 0;
  auto s = std::make_unique<AnyServer>(o, [&](Request&, Response& res) {
    auto d = res.defer();
    d->onClientGone([&] { gone.set_value(); });
    parked.add(std::move(d));
  });
  int fd = rawConnect(s->port());
  sendAll(fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  auto d = parked.take();
  ASSERT_NE(d, nullptr);
  s->stop();
  EXPECT_EQ(gone.get_future().wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_TRUE(d->gone());
  EXPECT_EQ(d->send(200, "text/plain", "too late").code(), Code::kUnavailable);
  bool eof = false;
  readToEof(fd, &eof);
  EXPECT_TRUE(eof);
  ::close(fd);
  d.reset();  // before the Runtime goes
}

TEST(HttpServerUpgradeTest, HandsOverTheSocketWithBufferedBytes) {
  struct Taken {
    std::mutex mu;
    std::condition_variable cv;
    UniqueFd fd;
    std::string buffered;
    bool onIo = false;
  } taken;
  ServerOptions o;
  o.port = 0;
  std::unique_ptr<AnyServer> s;
  s = std::make_unique<AnyServer>(o, [&](Request& req, Response& res) {
    if (req.header("upgrade") != "dsec-test") {
      (void)res.send(426, "text/plain", "upgrade required");
      return;
    }
    EXPECT_EQ(res.upgrade("bad token", [](UniqueFd, std::string) {}).code(),
              Code::kInvalidArgument);
    res.setHeader("X-Link", "1");
    Status st = res.upgrade("dsec-test", [&](UniqueFd fd, std::string buffered) {
      std::lock_guard lk(taken.mu);
      taken.fd = std::move(fd);
      taken.buffered = std::move(buffered);
      taken.onIo = s->runtime().onIoThread();
      taken.cv.notify_all();
    });
    EXPECT_TRUE(st.isOk()) << st.toString();
  });
  int fd = rawConnect(s->port());
  // The client speaks the new protocol right after its request, in the same
  // segment: those bytes are read with the request and must be handed over.
  sendAll(fd,
          "GET /edge/v1/link HTTP/1.1\r\nHost: x\r\nUpgrade: dsec-test\r\n"
          "Connection: Upgrade\r\n\r\nHELLO");
  {
    std::unique_lock lk(taken.mu);
    ASSERT_TRUE(taken.cv.wait_for(lk, std::chrono::seconds(10), [&] { return taken.fd.valid(); }));
  }
  EXPECT_TRUE(taken.onIo);
  int sfd = taken.fd.get();
  EXPECT_FALSE(fcntl(sfd, F_GETFL) & O_NONBLOCK) << "the fd is said to be blocking";
  EXPECT_TRUE(fcntl(sfd, F_GETFD) & FD_CLOEXEC);
  // The buffered bytes, then whatever was not read with the request.
  std::string hello = taken.buffered;
  char buf[64];
  while (hello.size() < 5) {
    ssize_t n = ::recv(sfd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    hello.append(buf, size_t(n));
  }
  EXPECT_EQ(hello, "HELLO");
  // The socket works both ways and the server has let go of it.
  ASSERT_EQ(::send(sfd, "WORLD", 5, MSG_NOSIGNAL), 5);
  std::string got;
  while (got.find("WORLD") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, size_t(n));
  }
  EXPECT_TRUE(got.starts_with("HTTP/1.1 101 Switching Protocols\r\n")) << got;
  EXPECT_NE(got.find("Upgrade: dsec-test\r\n"), std::string::npos) << got;
  EXPECT_NE(got.find("Connection: Upgrade\r\n"), std::string::npos) << got;
  EXPECT_NE(got.find("X-Link: 1\r\n"), std::string::npos) << got;
  EXPECT_TRUE(got.ends_with("\r\n\r\nWORLD")) << got;
  EXPECT_TRUE(s->waitStats([](const ServerStats& st) { return st.openConnections == 0; }));
  s.reset();  // stop() does not touch a handed-over socket
  ASSERT_EQ(::send(sfd, "AGAIN", 5, MSG_NOSIGNAL), 5);
  got.clear();
  while (got.size() < 5) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  EXPECT_EQ(got, "AGAIN");
  ::close(fd);
}

// Slowloris: a head trickled a byte at a time is cut at headerTimeoutS, though
// every byte comes well within idleTimeoutS.
TEST(HttpServerTimeoutTest, SlowHeaderIsCut) {
  ServerOptions o;
  o.port = 0;
  o.headerTimeoutS = 0.5;
  o.idleTimeoutS = 30;
  AnyServer s(o, [](Request&, Response& res) { (void)res.send(200, "text/plain", "hi"); });
  int fd = rawConnect(s.port());
  std::string head = "GET /slow HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(200, 'p');
  auto t0 = Clock::now();
  bool cut = false;
  for (char c : head) {
    if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1) {
      cut = true;
      break;
    }
    char b;
    if (::recv(fd, &b, 1, MSG_DONTWAIT) == 0) {
      cut = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::close(fd);
  EXPECT_TRUE(cut) << "a head trickled over " << secondsSince(t0) << " s was not cut";
  EXPECT_GE(secondsSince(t0), 0.4);
  EXPECT_GE(s.server().stats().timedOutTotal, 1u);
}

// 10,000 connections that each sent part of a request line hold sockets and
// coroutines, nothing else: a request on a new connection is answered.
TEST(HttpServerScaleTest, HalfOpenConnectionsDoNotStopNewRequests) {
  const int kIdle = 10000;
  if (!raiseFdLimit(kIdle + 1000)) GTEST_SKIP() << "cannot raise RLIMIT_NOFILE to " << kIdle + 1000;
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [](Request& req, Response& res) {
    (void)res.send(200, "text/plain", "answered " + req.path);
  });
  ClientFleet fleet(s.port(), kIdle, "GET /slo", false);
  ASSERT_TRUE(fleet.done()) << "the client process could not open its connections";
  ASSERT_TRUE(s.waitStats([&](const ServerStats& st) { return st.openConnections >= kIdle; }))
      << s.server().stats().openConnections;
  ClientOptions co;
  co.readTimeoutS = 10;
  auto c = Client::connect(s.url(), "", co);
  ASSERT_TRUE(c.isOk());
  auto r = (*c)->request("GET", "/fresh");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->body, "answered /fresh");
  ServerStats st = s.server().stats();
  EXPECT_EQ(st.refusedTotal, 0u);
  EXPECT_EQ(st.timedOutTotal, 0u);
  EXPECT_EQ(st.openConnections, kIdle + 1);
}

TEST(HttpServerScaleTest, ThreadCountStaysWithDeferredRequests) {
  const int kDeferred = 2000;
  if (!raiseFdLimit(2 * kDeferred + 1000)) GTEST_SKIP() << "cannot raise RLIMIT_NOFILE";
  Parked parked;
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [&](Request& req, Response& res) {
    if (req.path == "/warm") {
      (void)res.send(200, "text/plain", "warm");
      return;
    }
    parked.add(res.defer());
  });
  {  // every thread the server will ever have has started
    auto c = Client::connect(s.url(), "");
    ASSERT_TRUE(c.isOk());
    ASSERT_TRUE((*c)->request("GET", "/warm").isOk());
  }
  const int before = threadCount();
  std::vector<int> fds;
  for (int i = 0; i < kDeferred; ++i) {
    fds.push_back(rawConnect(s.port()));
    sendAll(fds.back(), "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  ASSERT_TRUE(s.waitStats([&](const ServerStats& st) { return st.deferredInFlight == kDeferred; }))
      << s.server().stats().deferredInFlight;
  EXPECT_EQ(threadCount(), before);
  ServerStats st = s.server().stats();
  EXPECT_EQ(st.inFlight, kDeferred);
  EXPECT_GE(st.peakInFlight, kDeferred);
  // Answer them all from here; every client hears.
  std::vector<std::shared_ptr<Deferred>> ds;
  {
    std::lock_guard lk(parked.mu);
    ds.swap(parked.list);
  }
  ASSERT_EQ(ds.size(), size_t(kDeferred));
  for (auto& d : ds) EXPECT_TRUE(d->send(200, "text/plain", "done").isOk());
  for (int fd : fds) {
    std::string got = readResponse(fd);
    EXPECT_TRUE(got.ends_with("done")) << got;
    ::close(fd);
  }
  EXPECT_EQ(threadCount(), before);
}

// The inline handler answers on the io thread, without the pool; a request it
// passes on (false) reaches the blocking handler on a worker.
TEST(HttpServerInlineTest, InlineHandlerRunsOnTheIoThread) {
  std::atomic<bool> inlineOnIo{false}, blockingOnIo{true};
  Runtime* rt = nullptr;
  ServerOptions o;
  o.port = 0;
  o.inlineHandler = [&](Request& req, Response& res) {
    if (req.path != "/v1/health") return false;
    inlineOnIo = rt->onIoThread();
    EXPECT_EQ(res.beginChunked(200, "text/plain").code(), Code::kFailedPrecondition);
    auto body = req.readBody(100);  // pre-read: no waiting
    EXPECT_TRUE(body.isOk());
    (void)res.send(200, "application/json",
                   R"({"ok":true,"body":")" + (body.isOk() ? *body : "") + "\"}");
    return true;
  };
  AnyServer s(o, [&](Request&, Response& res) {
    blockingOnIo = rt->onIoThread();
    (void)res.send(200, "text/plain", "blocking");
  });
  rt = &s.runtime();
  auto c = Client::connect(s.url(), "");
  ASSERT_TRUE(c.isOk());
  auto r = (*c)->request("POST", "/v1/health", "x");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->body, R"({"ok":true,"body":"x"})");
  EXPECT_TRUE(inlineOnIo.load());
  r = (*c)->request("GET", "/other");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->body, "blocking");
  EXPECT_FALSE(blockingOnIo.load());
}

// A response bigger than the socket buffers, to a client slower than the
// server: most writes find the socket full and are finished later by the
// reactor, from the buffer sequence the operation kept. Those buffers must
// still be alive then (they once lived in writeSome()'s stack frame: the body
// stalled or came out garbled). Both a streamed Response (one buffer per
// write, big and small pieces as the files route sends) and a Deferred that
// queues many pieces at once (many buffers per write).
TEST(HttpServerBodyTest, SlowReaderGetsEveryByteOfABigResponse) {
  static constexpr size_t kPieces = 160;
  auto pieceOf = [](size_t i) {
    // 64 KiB pieces with a short one now and then; every byte tells where it is.
    std::string p(i % 3 == 2 ? 106 : 64 << 10, '\0');
    for (size_t k = 0; k < p.size(); ++k) p[k] = char('a' + (i * 7 + k) % 26);
    return p;
  };
  std::string want;
  for (size_t i = 0; i < kPieces; ++i) want += pieceOf(i);
  ServerOptions o;
  o.port = 0;
  std::vector<std::thread> producers;
  std::mutex producersMu;
  AnyServer s(o, [&](Request& req, Response& res) {
    if (req.path == "/stream") {
      Status st = res.beginFixed(200, "application/octet-stream", want.size());
      for (size_t i = 0; st.isOk() && i < kPieces; ++i) st = res.write(pieceOf(i));
      EXPECT_TRUE(st.isOk()) << st.toString();
      (void)res.finish();
      return;
    }
    std::shared_ptr<Deferred> d = res.defer();
    std::lock_guard lk(producersMu);
    producers.emplace_back([d, &pieceOf] {
      EXPECT_TRUE(d->beginChunked(200, "application/octet-stream").isOk());
      for (size_t i = 0; i < kPieces; ++i) EXPECT_TRUE(d->write(pieceOf(i)).isOk());
      EXPECT_TRUE(d->finish().isOk());
    });
  });
  struct JoinProducers {
    std::vector<std::thread>& ts;
    std::mutex& mu;
    ~JoinProducers() {
      std::lock_guard lk(mu);
      for (auto& t : ts) t.join();
    }
  } joinProducers{producers, producersMu};
  ClientOptions co;
  co.readTimeoutS = 5;  // a stalled body fails the test instead of hanging it
  auto c = Client::connect(s.url(), "", co);
  ASSERT_TRUE(c.isOk());
  for (int round = 0; round < 3; ++round) {
    for (const char* path : {"/stream", "/deferred"}) {
      std::string got;
      size_t sinceNap = 0;
      auto r = (*c)->requestStreaming("GET", path, "", [&](std::string_view d) {
        got += d;
        sinceNap += d.size();
        if (sinceNap >= (256 << 10)) {  // slower than the server: its writes back up
          sinceNap = 0;
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      });
      ASSERT_TRUE(r.isOk()) << path << " round " << round << ": " << r.status().toString()
                            << " after " << got.size() << " of " << want.size() << " bytes";
      EXPECT_EQ(r->status, 200);
      ASSERT_EQ(got.size(), want.size()) << path << " round " << round;
      EXPECT_TRUE(got == want) << path << " round " << round << ": body garbled";
    }
  }
}

// Bodies past preReadBytes, fixed and chunked, are read on demand by the
// handler's worker through the connection's strand.
TEST(HttpServerBodyTest, LargeAndChunkedBodiesStreamThroughTheWorker) {
  ServerOptions o;
  o.port = 0;
  o.preReadBytes = 1024;
  AnyServer s(o, [](Request& req, Response& res) {
    size_t total = 0;
    uint32_t sum = 0;
    char buf[7000];
    for (;;) {
      auto n = req.readSome(buf, sizeof buf);
      if (!n.isOk()) {
        (void)res.send(httpStatusFor(n.status().code()), "text/plain", n.status().message());
        return;
      }
      if (*n == 0) break;
      for (size_t i = 0; i < *n; ++i) sum = sum * 31 + uint8_t(buf[i]);
      total += *n;
    }
    EXPECT_TRUE(req.bodyDone());
    (void)res.beginChunked(200, "text/plain");
    (void)res.write(std::to_string(total) + " " + std::to_string(sum));
  });
  std::string big(3 << 20, 0);
  uint32_t want = 0;
  for (size_t i = 0; i < big.size(); ++i) {
    big[i] = char('a' + i % 23);
    want = want * 31 + uint8_t(big[i]);
  }
  auto c = Client::connect(s.url(), "");
  ASSERT_TRUE(c.isOk());
  std::string got;
  auto r = (*c)->requestStreaming("POST", "/sum", big, [&](std::string_view d) { got += d; });
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(got, std::to_string(big.size()) + " " + std::to_string(want));

  int fd = rawConnect(s.port());
  std::thread sender([&] {
    sendAll(fd, "POST /sum HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 5; ++i) {
      sendAll(fd, "3\r\nabc\r\n");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    sendAll(fd, "0\r\n\r\n");
  });
  std::string raw;
  char buf[4096];
  while (raw.find("0\r\n\r\n") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    raw.append(buf, size_t(n));
  }
  sender.join();
  ::close(fd);
  uint32_t sum = 0;
  for (int i = 0; i < 5; ++i) {
    for (char ch : std::string("abc")) sum = sum * 31 + uint8_t(ch);
  }
  EXPECT_NE(raw.find("15 " + std::to_string(sum)), std::string::npos) << raw;
}

// What an idle kept-alive connection and a deferred request cost the process
// (heap in use and RSS), printed for the record. The bound is a guard only.
TEST(HttpServerMemoryTest, BytesPerIdleConnectionAndPerDeferredRequest) {
  const int kConns = 10000;
  if (!raiseFdLimit(kConns + 1000)) GTEST_SKIP() << "cannot raise RLIMIT_NOFILE";
  Parked parked;
  ServerOptions o;
  o.port = 0;
  AnyServer s(o, [&](Request& req, Response& res) {
    if (req.path == "/hold") {
      parked.add(res.defer());
    } else {
      (void)res.send(200, "text/plain", "ok");
    }
  });
  auto heap = [] {
    struct mallinfo2 mi = mallinfo2();
    return double(mi.uordblks + mi.hblkhd);
  };
  auto rss = [] {
    long pages = 0, resident = 0;
    FILE* f = fopen("/proc/self/statm", "r");
    if (f && fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    if (f) fclose(f);
    return double(resident) * double(sysconf(_SC_PAGESIZE));
  };
  parked.list.reserve(kConns);
  // Warm up: the first connections grow pools and caches once.
  for (int i = 0; i < 100; ++i) {
    int fd = rawConnect(s.port());
    sendAll(fd, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n");
    readResponse(fd);
    ::close(fd);
  }
  ASSERT_TRUE(s.waitStats([](const ServerStats& st) { return st.openConnections == 0; }));
  malloc_trim(0);
  const double heap0 = heap(), rss0 = rss();
  ClientFleet fleet(s.port(), kConns, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n", true);
  ASSERT_TRUE(fleet.done()) << "the client process could not open its connections";
  ASSERT_TRUE(s.waitStats(
      [&](const ServerStats& st) { return st.openConnections == kConns && st.inFlight == 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double heap1 = heap(), rss1 = rss();
  fleet.sendOnAll("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(fleet.done());
  ASSERT_TRUE(s.waitStats([&](const ServerStats& st) { return st.deferredInFlight == kConns; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double heap2 = heap(), rss2 = rss();
  double idleHeap = (heap1 - heap0) / kConns, idleRss = (rss1 - rss0) / kConns;
  double defHeap = (heap2 - heap1) / kConns, defRss = (rss2 - rss1) / kConns;
  printf("[ memory   ] idle kept-alive connection: %.0f B heap, %.0f B RSS\n", idleHeap, idleRss);
  printf(
      "[ memory   ] deferred request (on top):  %.0f B heap, %.0f B RSS (Deferred held by the "
      "test)\n",
      defHeap, defRss);
  printf("[ memory   ] so 131072 deferred requests: %.0f MiB heap\n",
         (idleHeap + defHeap) * 131072 / (1 << 20));
  EXPECT_LT(idleHeap, 16 << 10);
  EXPECT_LT(defHeap, 16 << 10);
  {
    std::lock_guard lk(parked.mu);
    for (auto& d : parked.list) (void)d->send(200, "text/plain", "done");
    parked.list.clear();
  }
}

}  // namespace
}  // namespace dsec::http
