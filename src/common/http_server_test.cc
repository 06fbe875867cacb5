#include "common/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/http_client.h"

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

}  // namespace
}  // namespace dsec::http
