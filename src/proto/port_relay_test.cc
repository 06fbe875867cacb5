// PortRelay over a real LinkServer/LinkClient pair: the edge's relay on a
// "sandbox" socket, the platform's on one end of a socketpair whose other
// end the test holds as the caller would (RemoteEdge::openPort does the same;
// edge/link_service_test.cc runs that path whole).
#include "proto/port_relay.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "common/sha256.h"

namespace dsec::proto {
namespace {

constexpr char kKey[] = "port-relay-test-key";
constexpr char kNode[] = "node-1";
constexpr double kGuardS = 60;

bool waitFor(const std::function<bool()>& pred, double seconds = kGuardS) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(seconds * 1e3));
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

std::pair<UniqueFd, UniqueFd> socketPair() {
  int sp[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sp), 0);
  return {UniqueFd(sp[0]), UniqueFd(sp[1])};
}

// A connected loopback TCP pair (blocking).
std::pair<UniqueFd, UniqueFd> tcpPair() {
  UniqueFd l(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  EXPECT_EQ(bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(listen(l.get(), 4), 0);
  getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len);
  UniqueFd c(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return {std::move(c), UniqueFd(accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC))};
}

// Blocking helpers on a possibly non-blocking socket (poll, then the call).
bool waitIo(int fd, short ev, int ms = int(kGuardS * 1000)) {
  pollfd p{fd, ev, 0};
  return poll(&p, 1, ms) == 1;
}
bool writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    if (!waitIo(fd, POLLOUT)) return false;
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return false;
    data.remove_prefix(size_t(n));
  }
  return true;
}
// Up to n bytes: >0 data, 0 EOF, -1 error, -2 nothing within ms.
ssize_t readSome(int fd, char* buf, size_t n, int ms = int(kGuardS * 1000)) {
  for (;;) {
    if (!waitIo(fd, POLLIN, ms)) return -2;
    ssize_t r = recv(fd, buf, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    return r;
  }
}
// Everything until EOF (or an error/timeout: then what came).
std::string readToEof(int fd) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = readSome(fd, buf, sizeof buf);
    if (n <= 0) return out;
    out.append(buf, size_t(n));
  }
}

// Deterministic bytes: the byte at offset i of stream `seed`.
void fillPattern(char* buf, size_t n, uint64_t offset, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) {
    uint64_t x = (offset + i + seed * 0x1000193) * 0x9E3779B97F4A7C15ull;
    buf[i] = char(x >> 56);
  }
}

// The edge end: serves `port_open` calls by relaying the next socket the
// test queued (args "fail" answers with an error instead).
class Node {
 public:
  explicit Node(Runtime& rt) : rt_(rt) {
    listen_.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(bind(listen_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listen_.get(), 16), 0);
    getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    server_ = std::make_unique<LinkServer>(
        rt_, [](const std::string&) -> Result<std::string> { return std::string(kKey); },
        [this](std::shared_ptr<ServerCall> c) { dispatch(std::move(c)); });
    acceptor_ = std::thread([this] { acceptLoop(); });
  }
  ~Node() {
    shutdown(listen_.get(), SHUT_RDWR);
    acceptor_.join();
    server_->close();
  }
  uint16_t port() const { return port_; }
  void queue(UniqueFd sandboxEnd) {
    std::lock_guard lk(mu_);
    ends_.push_back(std::move(sandboxEnd));
  }
  std::shared_ptr<PortRelay> lastRelay() {
    std::lock_guard lk(mu_);
    return last_;
  }

 private:
  void acceptLoop() {
    for (;;) {
      int fd = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      // The upgrade request, then the hello right behind it.
      std::string buf;
      char tmp[4096];
      size_t end;
      while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
        ssize_t n = read(fd, tmp, sizeof tmp);
        if (n <= 0) break;
        buf.append(tmp, size_t(n));
      }
      if (end == std::string::npos) {
        close(fd);
        continue;
      }
      std::string ans = linkUpgradeResponse();
      EXPECT_EQ(write(fd, ans.data(), ans.size()), ssize_t(ans.size()));
      server_->adopt(UniqueFd(fd), buf.substr(end + 4));
    }
  }
  void dispatch(std::shared_ptr<ServerCall> c) {
    if (c->method() != "port_open") {
      (void)c->fail(Status(Code::kNotFound, "no method " + c->method()));
      return;
    }
    if (c->args() == "fail") {
      (void)c->fail(Status(Code::kUnavailable, "nothing listens on port 9", ECONNREFUSED, "port"));
      return;
    }
    UniqueFd fd;
    {
      std::lock_guard lk(mu_);
      if (!ends_.empty()) {
        fd = std::move(ends_.front());
        ends_.pop_front();
      }
    }
    if (!fd) {
      (void)c->fail(Status(Code::kInternal, "the test queued no socket"));
      return;
    }
    (void)c->event("o");
    auto r = PortRelay::serve(rt_, std::move(fd), c, "test port");
    std::lock_guard lk(mu_);
    last_ = r;
  }

  Runtime& rt_;
  UniqueFd listen_;
  uint16_t port_ = 0;
  std::unique_ptr<LinkServer> server_;
  std::thread acceptor_;
  std::mutex mu_;  // guards ends_, last_
  std::deque<UniqueFd> ends_;
  std::shared_ptr<PortRelay> last_;
};

// The platform end of one connection, as RemoteEdge::openPort makes it.
struct Opened {
  UniqueFd caller;                   // what the caller of openPort holds
  std::shared_ptr<PortRelay> relay;  // the platform's relay
  std::shared_ptr<PortRelay> edge;   // the node's relay
  std::shared_ptr<ClientCall> call;
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    bool opened = false;
    std::optional<Result<std::string>> done;
  };
  std::shared_ptr<Outcome> out = std::make_shared<Outcome>();
  // The call's outcome (waits for it).
  Result<std::string> outcome() {
    std::unique_lock lk(out->mu);
    if (!out->cv.wait_for(lk, std::chrono::seconds(int(kGuardS)),
                          [&] { return out->done.has_value(); })) {
      return Status(Code::kDeadlineExceeded, "no outcome");
    }
    return *out->done;
  }
};

class PortRelayTest : public ::testing::Test {
 protected:
  PortRelayTest() : node_(rt_) {
    LinkClientOptions o;
    o.host = "127.0.0.1";
    o.port = node_.port();
    o.key = kKey;
    o.node = kNode;
    client_ = std::make_unique<LinkClient>(rt_, o);
  }
  ~PortRelayTest() override { client_->close(); }

  // Opens a connection relayed to `sandboxEnd` (or answered "fail").
  Opened open(UniqueFd sandboxEnd, const std::string& args = "") {
    Opened o;
    if (sandboxEnd) node_.queue(std::move(sandboxEnd));
    auto [mine, theirs] = socketPair();
    o.caller = std::move(theirs);
    o.relay = PortRelay::client(rt_, std::move(mine), "test caller");
    auto out = o.out;
    auto h = o.relay->handler(
        [out](std::string_view ev) {
          std::lock_guard lk(out->mu);
          if (ev == "o") out->opened = true;
          out->cv.notify_all();
        },
        [out](const Result<std::string>& r) {
          std::lock_guard lk(out->mu);
          out->done = r;
          out->cv.notify_all();
        });
    o.call = client_->start("port_open", args, std::move(h));
    o.relay->attach(o.call);
    std::unique_lock lk(out->mu);
    out->cv.wait_for(lk, std::chrono::seconds(int(kGuardS)),
                     [&] { return out->opened || out->done.has_value(); });
    if (out->opened) o.edge = node_.lastRelay();
    return o;
  }

  Runtime rt_{RuntimeOptions{2, 8}};
  Node node_;
  std::unique_ptr<LinkClient> client_;
};

TEST_F(PortRelayTest, BytesBothWaysWithSlowReadersStayBounded) {
  constexpr size_t kTotal = 8u << 20;
  auto [edgeEnd, sandbox] = socketPair();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge) << "not opened";

  // Each side writes 8 MiB as fast as the relay takes it and reads the
  // other's 8 MiB slowly (64 KiB per 5 ms); both at once.
  auto pump = [](int fd, uint64_t seed, std::string* sumOut, bool* ok) {
    std::thread writer([&] {
      std::vector<char> buf(100000);
      for (size_t off = 0; off < kTotal;) {
        size_t n = std::min(buf.size(), kTotal - off);
        fillPattern(buf.data(), n, off, seed);
        if (!writeAll(fd, std::string_view(buf.data(), n))) {
          *ok = false;
          return;
        }
        off += n;
      }
      shutdown(fd, SHUT_WR);
    });
    Sha256 sum;
    std::vector<char> buf(65536);
    size_t got = 0;
    for (;;) {
      ssize_t n = readSome(fd, buf.data(), buf.size());
      if (n <= 0) break;
      sum.update(buf.data(), size_t(n));
      got += size_t(n);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    writer.join();
    if (got != kTotal) *ok = false;
    *sumOut = sum.hexDigest();
  };
  std::atomic<bool> running{true};
  std::atomic<uint64_t> maxHeldDown{0}, maxHeldUp{0};
  std::thread watch([&] {
    // Bytes the relays took from one socket but have not yet written to
    // the other: what the link and the relays hold in memory.
    while (running) {
      uint64_t down =
          c.edge->bytesToCall() - std::min(c.edge->bytesToCall(), c.relay->bytesToSocket());
      uint64_t up =
          c.relay->bytesToCall() - std::min(c.relay->bytesToCall(), c.edge->bytesToSocket());
      maxHeldDown = std::max<uint64_t>(maxHeldDown, down);
      maxHeldUp = std::max<uint64_t>(maxHeldUp, up);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::string sumAtCaller, sumAtSandbox;
  bool okCaller = true, okSandbox = true;
  int callerFd = c.caller.get(), sandboxFd = sandbox.get();
  std::thread a([&] { pump(callerFd, 1, &sumAtCaller, &okCaller); });
  std::thread b([&] { pump(sandboxFd, 2, &sumAtSandbox, &okSandbox); });
  a.join();
  b.join();
  running = false;
  watch.join();
  EXPECT_TRUE(okCaller && okSandbox);
  auto expected = [](uint64_t seed) {
    Sha256 s;
    std::vector<char> buf(100000);
    for (size_t off = 0; off < kTotal;) {
      size_t n = std::min(buf.size(), kTotal - off);
      fillPattern(buf.data(), n, off, seed);
      s.update(buf.data(), n);
      off += n;
    }
    return s.hexDigest();
  };
  EXPECT_EQ(sumAtCaller, expected(2));   // the sandbox's bytes
  EXPECT_EQ(sumAtSandbox, expected(1));  // the caller's bytes
  // Window (256 KiB) + the link's send buffer (256 KiB) + one read (64 KiB)
  // + frames in flight: well under 1 MiB each way.
  EXPECT_LT(maxHeldDown.load(), 1u << 20);
  EXPECT_LT(maxHeldUp.load(), 1u << 20);
  EXPECT_GT(maxHeldDown.load(), 0u);
  auto r = c.outcome();
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_TRUE(waitFor([&] { return c.relay->ended() && c.edge->ended(); }));
}

TEST_F(PortRelayTest, HalfClosesPassBothWays) {
  // The caller ends first, then reads what the sandbox still sends.
  {
    auto [edgeEnd, sandbox] = socketPair();
    Opened c = open(std::move(edgeEnd));
    ASSERT_TRUE(c.edge);
    ASSERT_TRUE(writeAll(c.caller.get(), "request"));
    ASSERT_EQ(shutdown(c.caller.get(), SHUT_WR), 0);
    EXPECT_EQ(readToEof(sandbox.get()), "request");
    ASSERT_TRUE(writeAll(sandbox.get(), "answer after the caller's EOF"));
    ASSERT_EQ(shutdown(sandbox.get(), SHUT_WR), 0);
    EXPECT_EQ(readToEof(c.caller.get()), "answer after the caller's EOF");
    auto r = c.outcome();
    EXPECT_TRUE(r.isOk()) << r.status().toString();
  }
  // The sandbox ends first, then reads what the caller still sends.
  {
    auto [edgeEnd, sandbox] = socketPair();
    Opened c = open(std::move(edgeEnd));
    ASSERT_TRUE(c.edge);
    ASSERT_TRUE(writeAll(sandbox.get(), "banner"));
    ASSERT_EQ(shutdown(sandbox.get(), SHUT_WR), 0);
    EXPECT_EQ(readToEof(c.caller.get()), "banner");
    ASSERT_TRUE(writeAll(c.caller.get(), "still talking"));
    ASSERT_EQ(shutdown(c.caller.get(), SHUT_WR), 0);
    EXPECT_EQ(readToEof(sandbox.get()), "still talking");
    auto r = c.outcome();
    EXPECT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_TRUE(waitFor([&] { return c.relay->ended() && c.edge->ended(); }));
  }
}

TEST_F(PortRelayTest, TheCallersCloseCancelsTheCallAndClosesTheSandboxSocket) {
  auto [edgeEnd, sandbox] = socketPair();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  ASSERT_TRUE(writeAll(c.caller.get(), "x"));
  char ch;
  ASSERT_EQ(readSome(sandbox.get(), &ch, 1), 1);
  c.caller.reset();
  // The node's socket is closed: the sandbox reads EOF.
  EXPECT_EQ(readToEof(sandbox.get()), "");
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  EXPECT_TRUE(waitFor([&] { return c.edge->ended(); }));
}

TEST_F(PortRelayTest, ACancelClosesTheSandboxSocket) {
  auto [edgeEnd, sandbox] = socketPair();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  c.relay->abort(Status(Code::kUnavailable, "the caller went away"));
  EXPECT_EQ(readToEof(sandbox.get()), "");
  EXPECT_TRUE(waitFor([&] { return c.edge->ended(); }));
  auto r = c.outcome();
  EXPECT_EQ(r.status().message(), "the caller went away");
  // The caller's end is closed with it.
  EXPECT_EQ(readToEof(c.caller.get()), "");
}

TEST_F(PortRelayTest, ASandboxResetFailsTheCallAndTheCallerReadsEof) {
  auto [edgeEnd, sandbox] = tcpPair();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  linger lg{1, 0};  // close with RST
  ASSERT_EQ(setsockopt(sandbox.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg), 0);
  sandbox.reset();
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  EXPECT_EQ(r.status().sysErrno(), ECONNRESET) << r.status().toString();
  EXPECT_EQ(readToEof(c.caller.get()), "");
}

TEST_F(PortRelayTest, ASocketShutDownByTheNodeEndsTheCall) {
  // What PortRegistry's cut does to the edge's socket.
  auto [edgeEnd, sandbox] = socketPair();
  int edgeFd = edgeEnd.get();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  ASSERT_EQ(shutdown(edgeFd, SHUT_RDWR), 0);
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_NE(r.status().message().find("the connection was closed"), std::string::npos)
      << r.status().toString();
  EXPECT_EQ(readToEof(c.caller.get()), "");
  EXPECT_EQ(readToEof(sandbox.get()), "");
}

// poll() revents of fd now.
short revents(int fd) {
  pollfd p{fd, POLLIN, 0};
  (void)poll(&p, 1, 0);
  return p.revents;
}

TEST_F(PortRelayTest, AHalfClosedCallerThatThenClosesCancelsTheCall) {
  auto [edgeEnd, sandbox] = socketPair();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  ASSERT_EQ(shutdown(c.caller.get(), SHUT_WR), 0);
  EXPECT_EQ(readToEof(sandbox.get()), "");  // passed on as a half-close
  EXPECT_FALSE(revents(sandbox.get()) & POLLHUP);
  c.caller.reset();
  // Noticed without a byte moving: the call ends, the node's socket closes.
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("the connection was closed"), std::string::npos)
      << r.status().toString();
  EXPECT_TRUE(waitFor([&] { return (revents(sandbox.get()) & POLLHUP) != 0; }));
}

TEST_F(PortRelayTest, ACutAfterTheSandboxHalfClosedStillEndsTheCall) {
  auto [edgeEnd, sandbox] = socketPair();
  int edgeFd = edgeEnd.get();
  Opened c = open(std::move(edgeEnd));
  ASSERT_TRUE(c.edge);
  ASSERT_EQ(shutdown(sandbox.get(), SHUT_WR), 0);
  EXPECT_EQ(readToEof(c.caller.get()), "");  // the caller reads the half-close
  EXPECT_FALSE(revents(c.caller.get()) & POLLHUP);
  ASSERT_EQ(shutdown(edgeFd, SHUT_RDWR), 0);  // the node's cut
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  // The caller's end is closed: it hangs up.
  EXPECT_TRUE(waitFor([&] { return (revents(c.caller.get()) & POLLHUP) != 0; }));
}

TEST_F(PortRelayTest, AnErrorBeforeTheOpenKeepsItsStatusAndClosesTheCallersEnd) {
  Opened c = open(UniqueFd(), "fail");
  auto r = c.outcome();
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_EQ(r.status().message(), "nothing listens on port 9");
  EXPECT_EQ(r.status().field(), "port");
  EXPECT_EQ(r.status().sysErrno(), ECONNREFUSED);
  EXPECT_EQ(readToEof(c.caller.get()), "");
  EXPECT_TRUE(waitFor([&] { return c.relay->ended(); }));
}

}  // namespace
}  // namespace dsec::proto
