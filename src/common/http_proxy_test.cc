#include "common/http_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <numeric>
#include <strings.h>
#include <thread>
#include <vector>

#include "common/http_server.h"
#include "common/runtime.h"

namespace dsec::http {
namespace {

int rawSocket() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{5, 0};  // a broken proxy fails the test instead of hanging it
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

int connectTo(uint16_t port) {
  int fd = rawSocket();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << strerror(errno);
  return fd;
}

void sendAll(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    s.remove_prefix(size_t(n));
  }
}

// Reads until `stop` is in what was read (or EOF / the 5 s guard).
std::string readUntil(int fd, std::string_view stop, std::string& carry) {
  for (;;) {
    size_t at = carry.find(stop);
    if (at != std::string::npos) {
      std::string out = carry.substr(0, at + stop.size());
      carry.erase(0, at + stop.size());
      return out;
    }
    char buf[65536];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      std::string out = std::move(carry);
      carry.clear();
      return out;
    }
    carry.append(buf, size_t(n));
  }
}

std::string readN(int fd, size_t n, std::string& carry) {
  while (carry.size() < n) {
    char buf[65536];
    ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r <= 0) break;
    carry.append(buf, size_t(r));
  }
  std::string out = carry.substr(0, std::min(n, carry.size()));
  carry.erase(0, out.size());
  return out;
}

std::string readToEof(int fd, std::string& carry, bool* eof = nullptr) {
  for (;;) {
    char buf[65536];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      if (eof) *eof = n == 0;
      std::string out = std::move(carry);
      carry.clear();
      return out;
    }
    carry.append(buf, size_t(n));
  }
}

std::string headerOf(const std::string& head, const std::string& name) {
  std::string low = head;
  for (auto& c : low) c = char(tolower(static_cast<unsigned char>(c)));
  size_t at = low.find("\r\n" + name + ":");
  if (at == std::string::npos) return "";
  size_t v = at + 2 + name.size() + 1;
  size_t end = head.find("\r\n", v);
  std::string out = head.substr(v, end - v);
  while (!out.empty() && out.front() == ' ') out.erase(0, 1);
  return out;
}

// Reads a chunked body (after its head) from fd.
std::string readChunked(int fd, std::string& carry) {
  std::string body;
  for (;;) {
    std::string line = readUntil(fd, "\r\n", carry);
    if (line.size() < 2) return body;
    size_t n = std::stoul(line, nullptr, 16);
    if (n == 0) {
      readUntil(fd, "\r\n", carry);
      return body;
    }
    body += readN(fd, n, carry);
    readN(fd, 2, carry);
  }
}

// A scripted upstream: each accepted connection runs `serve(fd)` on its own
// thread; `conns` counts connections.
class Upstream {
 public:
  explicit Upstream(std::function<void(int fd)> serve) : serve_(std::move(serve)) {
    lfd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(lfd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(lfd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    EXPECT_EQ(::listen(lfd_, 64), 0);
    socklen_t len = sizeof sa;
    ::getsockname(lfd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        int fd = ::accept4(lfd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) return;
        ++conns;
        std::lock_guard lk(mu_);
        workers_.emplace_back([this, fd] {
          timeval tv{5, 0};
          ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
          serve_(fd);
          ::close(fd);
        });
      }
    });
  }
  ~Upstream() {
    ::shutdown(lfd_, SHUT_RDWR);
    ::close(lfd_);
    thread_.join();
    std::lock_guard lk(mu_);
    for (auto& w : workers_) w.join();
  }
  uint16_t port() const { return port_; }
  std::atomic<int> conns{0};

 private:
  std::function<void(int)> serve_;
  int lfd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::thread> workers_;
};

// The front: a Server that diverts /p/... to the proxy, whose router sends it
// to the upstream with the prefix and Authorization stripped, unless the
// request carries X-Deny.
class Front {
 public:
  explicit Front(uint16_t upstreamPort) : upstreamPort_(upstreamPort) {
    ServerOptions o;
    o.port = 0;
    auto popts = std::make_shared<ProxyOptions>();
    popts->onExchange = [this](int status, uint64_t, uint64_t) {
      std::lock_guard lk(mu);
      statuses.push_back(status);
    };
    o.divert = [this, popts](const Request& req) -> ServerOptions::Taker {
      if (req.path.rfind("/p/", 0) != 0) return {};
      return [this, popts](UniqueFd sock, std::string bytes) {
        serveProxy(std::move(sock), std::move(bytes),
                   [this](const ProxyRequest& r) { return route(r); }, popts);
      };
    };
    server_ = std::make_unique<Server>(o);
    EXPECT_TRUE(server_->listen().isOk());
    server_->start([](Request&, Response& res) { (void)res.send(200, "text/plain", "plain"); });
  }
  ~Front() {
    server_->stop();
    server_->wait();
  }
  uint16_t port() const { return server_->port(); }

  ProxyDecision route(const ProxyRequest& r) {
    ProxyDecision d;
    if (!r.header("x-deny").empty()) {
      d.status = 401;
      d.body = "{\"error\":{\"code\":\"unauthenticated\",\"message\":\"no\"}}";
      return d;
    }
    d.forward = true;
    d.key = "u";
    if (r.currentKey != "u") {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(upstreamPort_);
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      d.upstream = UniqueFd(fd);
    }
    d.target = r.target.substr(2);
    for (auto& [k, v] : r.headers) {
      if (strcasecmp(k.c_str(), "authorization") != 0) d.requestHeaders.emplace_back(k, v);
    }
    d.requestHeaders.emplace_back("X-Forwarded-For", r.peer);
    d.responseHeaders.emplace_back("X-Proxied", "1");
    return d;
  }

  std::mutex mu;
  std::vector<int> statuses;

 private:
  uint16_t upstreamPort_;
  std::unique_ptr<Server> server_;
};

// Upstream that answers each request with its own head (as the body),
// reading Content-Length or chunked bodies and reporting their size.
void echoHeads(int fd) {
  std::string carry;
  for (;;) {
    std::string head = readUntil(fd, "\r\n\r\n", carry);
    if (head.find("\r\n\r\n") == std::string::npos) return;
    std::string body;
    if (auto cl = headerOf(head, "content-length"); !cl.empty()) {
      body = readN(fd, std::stoul(cl), carry);
    } else if (headerOf(head, "transfer-encoding") == "chunked") {
      body = readChunked(fd, carry);
    }
    std::string out = head + "body-bytes=" + std::to_string(body.size()) + " sum=" +
                      std::to_string(std::accumulate(body.begin(), body.end(), 0u,
                                                     [](unsigned a, char c) {
                                                       return a + static_cast<unsigned char>(c);
                                                     }));
    sendAll(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nSet-Cookie: a=1\r\n"
                "Set-Cookie: b=2\r\nContent-Length: " +
                    std::to_string(out.size()) + "\r\n\r\n" + out);
  }
}

TEST(HttpProxyTest, ForwardsRewritesAndKeepsTheUpstream) {
  Upstream up(echoHeads);
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  for (int i = 0; i < 3; ++i) {
    sendAll(fd, "GET /p/hello?x=" + std::to_string(i) +
                    " HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer secret\r\n"
                    "Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Keep: 2\r\n\r\n");
    std::string head = readUntil(fd, "\r\n\r\n", carry);
    ASSERT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
    EXPECT_EQ(headerOf(head, "x-proxied"), "1");
    EXPECT_NE(head.find("Set-Cookie: a=1\r\nSet-Cookie: b=2\r\n"), std::string::npos) << head;
    std::string body = readN(fd, std::stoul(headerOf(head, "content-length")), carry);
    EXPECT_EQ(body.rfind("GET /hello?x=" + std::to_string(i) + " HTTP/1.1\r\n", 0), 0u) << body;
    EXPECT_EQ(body.find("uthorization"), std::string::npos) << body;
    EXPECT_EQ(body.find("X-Hop"), std::string::npos) << body;
    EXPECT_NE(body.find("X-Keep: 2"), std::string::npos) << body;
    EXPECT_NE(body.find("X-Forwarded-For: 127.0.0.1"), std::string::npos) << body;
  }
  EXPECT_EQ(up.conns.load(), 1);
  // A request the server itself serves is untouched by the divert.
  int fd2 = connectTo(front.port());
  sendAll(fd2, "GET /v1/x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n");
  std::string c2;
  EXPECT_NE(readToEof(fd2, c2).find("plain"), std::string::npos);
  ::close(fd2);
  ::close(fd);
}

TEST(HttpProxyTest, BodiesAreReframed) {
  Upstream up(echoHeads);
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  std::string big(3 << 20, '\0');
  unsigned sum = 0;
  for (size_t i = 0; i < big.size(); ++i) {
    big[i] = char(i * 7);
    sum += static_cast<unsigned char>(big[i]);
  }
  sendAll(fd, "POST /p/up HTTP/1.1\r\nHost: h\r\nContent-Length: " + std::to_string(big.size()) +
                  "\r\n\r\n");
  sendAll(fd, big);
  std::string head = readUntil(fd, "\r\n\r\n", carry);
  std::string body = readN(fd, std::stoul(headerOf(head, "content-length")), carry);
  EXPECT_NE(body.find("body-bytes=" + std::to_string(big.size()) + " sum=" + std::to_string(sum)),
            std::string::npos)
      << body.substr(body.size() > 200 ? body.size() - 200 : 0);
  // Chunked in, chunked out (with Expect: 100-continue answered by the proxy).
  sendAll(fd, "POST /p/up HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n"
              "Expect: 100-continue\r\n\r\n");
  EXPECT_EQ(readUntil(fd, "\r\n\r\n", carry), "HTTP/1.1 100 Continue\r\n\r\n");
  sendAll(fd, "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
  head = readUntil(fd, "\r\n\r\n", carry);
  body = readN(fd, std::stoul(headerOf(head, "content-length")), carry);
  EXPECT_NE(body.find("Transfer-Encoding: chunked"), std::string::npos) << body;
  EXPECT_EQ(body.find("Expect"), std::string::npos) << body;
  EXPECT_NE(body.find("body-bytes=5 sum=" + std::to_string('a' + 'b' + 'c' + 'd' + 'e')),
            std::string::npos)
      << body;
  ::close(fd);
}

TEST(HttpProxyTest, SmugglingShapesAreRefused) {
  Upstream up(echoHeads);
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  sendAll(fd, "POST /p/x HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n"
              "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /p/admin HTTP/1.1\r\nHost: h\r\n\r\n");
  bool eof = false;
  std::string all = readToEof(fd, carry, &eof);
  EXPECT_EQ(all.rfind("HTTP/1.1 400", 0), 0u) << all;
  EXPECT_TRUE(eof);
  EXPECT_EQ(up.conns.load(), 0);
  ::close(fd);
}

TEST(HttpProxyTest, RouterAnswersAndCloseDelimitedBecomesChunked) {
  Upstream up([](int fd) {
    std::string carry;
    readUntil(fd, "\r\n\r\n", carry);
    sendAll(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-the-end");
  });
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  sendAll(fd, "GET /p/a HTTP/1.1\r\nHost: h\r\nX-Deny: 1\r\n\r\n");
  std::string head = readUntil(fd, "\r\n\r\n", carry);
  EXPECT_EQ(head.rfind("HTTP/1.1 401", 0), 0u) << head;
  readN(fd, std::stoul(headerOf(head, "content-length")), carry);
  sendAll(fd, "GET /p/a HTTP/1.1\r\nHost: h\r\n\r\n");
  head = readUntil(fd, "\r\n\r\n", carry);
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(headerOf(head, "transfer-encoding"), "chunked") << head;
  EXPECT_EQ(readChunked(fd, carry), "until-the-end");
  // The connection goes on, on a new upstream.
  sendAll(fd, "GET /p/a HTTP/1.1\r\nHost: h\r\n\r\n");
  head = readUntil(fd, "\r\n\r\n", carry);
  EXPECT_EQ(readChunked(fd, carry), "until-the-end");
  EXPECT_EQ(up.conns.load(), 2);
  ::close(fd);
  std::lock_guard lk(front.mu);
  EXPECT_GE(front.statuses.size(), 2u);
}

TEST(HttpProxyTest, UpgradeRelaysRawBytesBothWays) {
  Upstream up([](int fd) {
    std::string carry;
    std::string head = readUntil(fd, "\r\n\r\n", carry);
    if (headerOf(head, "upgrade") != "websocket") return;
    sendAll(fd, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Accept: abc\r\n\r\nhello-from-up;");
    // Echo until the client half-closes, then say goodbye and close.
    for (;;) {
      std::string got = carry;
      carry.clear();
      if (got.empty()) {
        char buf[4096];
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        got.assign(buf, size_t(n));
      }
      sendAll(fd, got);
    }
    sendAll(fd, "bye");
  });
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  // The head and the first frame bytes in one write: the divert must hand both over.
  sendAll(fd, "GET /p/ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
              "Sec-WebSocket-Key: k\r\n\r\nearly;");
  std::string head = readUntil(fd, "\r\n\r\n", carry);
  ASSERT_EQ(head.rfind("HTTP/1.1 101", 0), 0u) << head;
  EXPECT_EQ(headerOf(head, "sec-websocket-accept"), "abc");
  EXPECT_EQ(headerOf(head, "upgrade"), "websocket");
  EXPECT_EQ(readN(fd, strlen("hello-from-up;early;"), carry), "hello-from-up;early;");
  sendAll(fd, "ping");
  EXPECT_EQ(readN(fd, 4, carry), "ping");
  ::shutdown(fd, SHUT_WR);
  bool eof = false;
  EXPECT_EQ(readToEof(fd, carry, &eof), "bye");
  EXPECT_TRUE(eof);
  ::close(fd);
}

TEST(HttpProxyTest, UpstreamAbortMidBodyClosesTheClient) {
  Upstream up([](int fd) {
    std::string carry;
    readUntil(fd, "\r\n\r\n", carry);
    sendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\npartial");
    ::shutdown(fd, SHUT_RDWR);
  });
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  sendAll(fd, "GET /p/a HTTP/1.1\r\nHost: h\r\n\r\n");
  bool eof = false;
  std::string all = readToEof(fd, carry, &eof);
  EXPECT_EQ(all.rfind("HTTP/1.1 200", 0), 0u) << all;
  EXPECT_NE(all.find("partial"), std::string::npos);
  EXPECT_TRUE(eof);  // closed, not left waiting for the rest
  ::close(fd);
}

TEST(HttpProxyTest, NoAnswerIs502AndHeadHasNoBody) {
  Upstream up([](int fd) {
    std::string carry;
    std::string head = readUntil(fd, "\r\n\r\n", carry);
    if (head.rfind("HEAD", 0) == 0) {
      sendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 12345\r\n\r\n");
      head = readUntil(fd, "\r\n\r\n", carry);
    }
    // Then hang up without answering.
  });
  Front front(up.port());
  int fd = connectTo(front.port());
  std::string carry;
  sendAll(fd, "HEAD /p/a HTTP/1.1\r\nHost: h\r\n\r\n");
  std::string head = readUntil(fd, "\r\n\r\n", carry);
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(headerOf(head, "content-length"), "12345");
  sendAll(fd, "GET /p/a HTTP/1.1\r\nHost: h\r\n\r\n");
  bool eof = false;
  std::string all = readToEof(fd, carry, &eof);
  EXPECT_EQ(all.rfind("HTTP/1.1 502", 0), 0u) << all;
  ::close(fd);
}

TEST(HttpProxyTest, LargeResponseThroughASlowReader) {
  const size_t kTotal = 64 << 20;
  Upstream up([kTotal](int fd) {
    std::string carry;
    readUntil(fd, "\r\n\r\n", carry);
    sendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(kTotal) + "\r\n\r\n");
    std::string piece(1 << 20, 'z');
    for (size_t s = 0; s < kTotal; s += piece.size()) sendAll(fd, piece);
  });
  Front front(up.port());
  auto before = proxyStats();
  int fd = connectTo(front.port());
  std::string carry;
  sendAll(fd, "GET /p/big HTTP/1.1\r\nHost: h\r\n\r\n");
  std::string head = readUntil(fd, "\r\n\r\n", carry);
  ASSERT_EQ(headerOf(head, "content-length"), std::to_string(kTotal));
  // Stall a while: the proxy must wait, not buffer the rest.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto mid = proxyStats();
  EXPECT_LT(mid.bytesDown - before.bytesDown, 16u << 20) << "the proxy read ahead of its client";
  size_t got = carry.size();
  carry.clear();
  char buf[1 << 16];
  while (got < kTotal) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got += size_t(n);
  }
  EXPECT_EQ(got, kTotal);
  ::close(fd);
}

}  // namespace
}  // namespace dsec::http
