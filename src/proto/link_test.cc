#include "proto/link.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "common/frame.h"
#include "common/sha256.h"

namespace dsec::proto {
namespace {

constexpr char kKey[] = "the-shared-node-key";
constexpr char kNode[] = "node-1";
constexpr double kGuardS = 60;  // generous: the host is shared

bool waitFor(const std::function<bool()>& pred, double seconds = kGuardS) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(seconds * 1e3));
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

int threadCount() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

// Deterministic bytes: the byte at offset i of a body.
void fillPattern(char* buf, size_t n, uint64_t offset) {
  for (size_t i = 0; i < n; ++i) {
    uint64_t x = (offset + i) * 0x9E3779B97F4A7C15ull;
    buf[i] = char(x >> 56);
  }
}

// A listening socket on 127.0.0.1:0.
int listenLoopback(uint16_t* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

int connectLoopback(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n <= 0) return false;
    data.remove_prefix(size_t(n));
  }
  return true;
}

// Reads one HTTP head (blocking): the head, and whatever came after it.
bool readHead(int fd, std::string* head, std::string* rest) {
  std::string buf;
  char tmp[4096];
  for (;;) {
    size_t e = buf.find("\r\n\r\n");
    if (e != std::string::npos) {
      *head = buf.substr(0, e);
      *rest = buf.substr(e + 4);
      return true;
    }
    ssize_t n = ::read(fd, tmp, sizeof tmp);
    if (n <= 0 || buf.size() > 65536) return false;
    buf.append(tmp, size_t(n));
  }
}

// The edge side of a test: accepts on loopback, does the HTTP upgrade the
// way the real HTTP server will (the 101, then the socket and the bytes read
// past the request to LinkServer::adopt), and answers a few methods.
class Edge {
 public:
  explicit Edge(Runtime& rt, LinkOptions opts = {}, std::string key = kKey)
      : rt_(rt), opts_(opts), key_(std::move(key)) {
    listenFd_ = listenLoopback(&port_);
    newServer();
    acceptor_ = std::thread([this] { acceptLoop(); });
  }
  ~Edge() {
    ::shutdown(listenFd_, SHUT_RDWR);
    acceptor_.join();
    ::close(listenFd_);
    std::lock_guard lk(mu_);
    server_.reset();
  }

  uint16_t port() const { return port_; }
  LinkServer& server() {
    std::lock_guard lk(mu_);
    return *server_;
  }
  // Drops the server and its connections, and serves with a new one (an
  // edge restart).
  void restart() {
    std::shared_ptr<LinkServer> old;
    {
      std::lock_guard lk(mu_);
      old = std::move(server_);
    }
    old->close();
    old.reset();
    newServer();
  }
  void setKey(std::string key) {
    std::lock_guard lk(mu_);
    key_ = std::move(key);
  }

  std::vector<std::shared_ptr<ServerCall>> takeHeld() {
    std::lock_guard lk(mu_);
    return std::move(held_);
  }
  size_t heldCount() {
    std::lock_guard lk(mu_);
    return held_.size();
  }
  std::atomic<int> cancels{0};
  std::atomic<size_t> produceMaxQueued{0};
  std::atomic<bool> produceRefused{false};
  std::atomic<size_t> uploadStallReceived{0};
  std::shared_ptr<ServerCall> stalled;  // guarded by mu_

  std::mutex mu_;  // guards server_, key_, held_, stalled

 private:
  void newServer() {
    auto keys = [this](const std::string& node) -> Result<std::string> {
      if (node != kNode) return Status(Code::kNotFound, "unknown node");
      std::lock_guard lk(mu_);
      return key_;
    };
    auto s = std::make_shared<LinkServer>(
        rt_, keys, [this](std::shared_ptr<ServerCall> c) { dispatch(std::move(c)); }, opts_);
    std::lock_guard lk(mu_);
    server_ = std::move(s);
  }

  void acceptLoop() {
    for (;;) {
      int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      std::string head, rest;
      if (!readHead(fd, &head, &rest) ||
          head.rfind("GET " + std::string(kLinkPath) + " HTTP/1.1", 0) != 0 ||
          head.find("Upgrade: " + std::string(kLinkProtocol)) == std::string::npos) {
        writeAll(fd, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        ::close(fd);
        continue;
      }
      writeAll(fd, linkUpgradeResponse());
      std::shared_ptr<LinkServer> s;
      {
        std::lock_guard lk(mu_);
        s = server_;
      }
      if (s) s->adopt(UniqueFd(fd), std::move(rest));
    }
  }

  void dispatch(std::shared_ptr<ServerCall> c) {
    const std::string& m = c->method();
    if (m == "echo") {
      (void)c->reply(c->args());
    } else if (m == "fail") {
      (void)c->fail(Status(Code::kNotFound, "no such thing", ENOENT, "path"));
    } else if (m == "hold") {
      c->onCancel([this](const Status&) { ++cancels; });
      (void)c->event("started");
      std::lock_guard lk(mu_);
      held_.push_back(std::move(c));
    } else if (m == "events") {
      int n = std::stoi(c->args());
      for (int i = 0; i < n; ++i) {
        Status st = c->event("event " + std::to_string(i));
        if (!st.isOk()) {
          (void)c->fail(st);
          return;
        }
      }
      (void)c->reply("done");
    } else if (m == "download") {
      // Blocking work goes to the pool.
      rt_.runBlocking([c] {
        uint64_t size = std::stoull(c->args());
        Sha256 sum;
        std::vector<char> buf(100000);
        for (uint64_t off = 0; off < size;) {
          size_t n = size_t(std::min<uint64_t>(buf.size(), size - off));
          fillPattern(buf.data(), n, off);
          sum.update(buf.data(), n);
          Status st = c->write(std::string_view(buf.data(), n), kGuardS);
          if (!st.isOk()) {
            (void)c->fail(st);
            return;
          }
          off += n;
        }
        (void)c->end();
        (void)c->reply(sum.hexDigest());
      });
    } else if (m == "upload") {
      rt_.runBlocking([c] {
        Sha256 sum;
        uint64_t total = 0;
        std::vector<char> buf(77777);
        for (;;) {
          auto n = c->read(buf.data(), buf.size(), kGuardS);
          if (!n.isOk()) {
            (void)c->fail(n.status());
            return;
          }
          if (*n == 0) break;
          sum.update(buf.data(), *n);
          total += *n;
        }
        (void)c->reply(std::to_string(total) + " " + sum.hexDigest());
      });
    } else if (m == "produce") {
      // Non-blocking sends until refused, more on writable: how much the
      // link lets pile up here while the client takes nothing.
      struct Producer : std::enable_shared_from_this<Producer> {
        std::shared_ptr<ServerCall> c;
        Edge* edge;
        uint64_t total, sent = 0;
        void pump() {
          std::string chunk(16384, 'p');
          while (sent < total) {
            size_t n = size_t(std::min<uint64_t>(chunk.size(), total - sent));
            Status st = c->send(std::string_view(chunk.data(), n));
            size_t q = c->queuedBytes();
            size_t seen = edge->produceMaxQueued.load();
            while (q > seen && !edge->produceMaxQueued.compare_exchange_weak(seen, q)) {
            }
            if (st.code() == Code::kResourceExhausted) {
              edge->produceRefused = true;
              return;  // onWritable calls again
            }
            if (!st.isOk()) return;
            sent += n;
          }
          (void)c->end();
          (void)c->reply("produced");
          c->onWritable(nullptr);
        }
      };
      auto p = std::make_shared<Producer>();
      p->c = c;
      p->edge = this;
      p->total = std::stoull(c->args());
      c->onWritable([weak = std::weak_ptr<Producer>(p), keep = p] {
        if (auto self = weak.lock()) self->pump();
      });
      p->pump();
    } else if (m == "late-reader") {
      // The body callback is set on a worker, after the body arrived: what
      // came before is delivered first, in order, then the end.
      rt_.runBlocking([c] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        auto sum = std::make_shared<Sha256>();
        auto total = std::make_shared<uint64_t>(0);
        c->onData(
            [sum, total](std::string_view b) {
              sum->update(b.data(), b.size());
              *total += b.size();
            },
            [c, sum, total] { (void)c->reply(std::to_string(*total) + " " + sum->hexDigest()); });
      });
    } else if (m == "upload-stall") {
      // Takes nothing of the body (until the test reads it).
      std::lock_guard lk(mu_);
      stalled = c;
    } else {
      (void)c->fail(Status(Code::kNotFound, "no method " + m));
    }
  }

  Runtime& rt_;
  LinkOptions opts_;
  std::string key_;
  int listenFd_ = -1;
  uint16_t port_ = 0;
  std::thread acceptor_;
  std::shared_ptr<LinkServer> server_;
  std::vector<std::shared_ptr<ServerCall>> held_;
};

// A loopback TCP proxy: records what passes each way, and can stop passing
// anything while keeping the connections open (a peer that went silent: a
// half-open connection).
class Proxy {
 public:
  explicit Proxy(uint16_t target) : target_(target) {
    listenFd_ = listenLoopback(&port_);
    ::pipe(wake_);
    thread_ = std::thread([this] { loop(); });
  }
  ~Proxy() {
    stop_ = true;
    char c = 0;
    (void)::write(wake_[1], &c, 1);
    thread_.join();
    for (auto& [a, b] : pairs_) {
      ::close(a);
      ::close(b);
    }
    ::close(listenFd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  uint16_t port() const { return port_; }
  void blackhole() { blackhole_ = true; }
  std::string clientToServer() {
    std::lock_guard lk(mu_);
    return c2s_;
  }
  std::string serverToClient() {
    std::lock_guard lk(mu_);
    return s2c_;
  }

 private:
  void loop() {
    char buf[65536];
    while (!stop_) {
      std::vector<pollfd> fds{{listenFd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      if (!blackhole_) {
        for (auto& [a, b] : pairs_) {
          fds.push_back({a, POLLIN, 0});
          fds.push_back({b, POLLIN, 0});
        }
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        int a = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
        int b = a >= 0 ? connectLoopback(target_) : -1;
        if (b >= 0) {
          pairs_.push_back({a, b});
        } else if (a >= 0) {
          ::close(a);
        }
        continue;
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        size_t pair = (i - 2) / 2;
        bool fromClient = (i - 2) % 2 == 0;
        int from = fromClient ? pairs_[pair].first : pairs_[pair].second;
        int to = fromClient ? pairs_[pair].second : pairs_[pair].first;
        ssize_t n = ::read(from, buf, sizeof buf);
        if (n <= 0) {
          ::shutdown(to, SHUT_WR);
          continue;
        }
        {
          std::lock_guard lk(mu_);
          (fromClient ? c2s_ : s2c_).append(buf, size_t(n));
        }
        writeAll(to, std::string_view(buf, size_t(n)));
      }
    }
  }

  uint16_t target_, port_ = 0;
  int listenFd_ = -1;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false}, blackhole_{false};
  std::thread thread_;
  std::vector<std::pair<int, int>> pairs_;  // loop thread only
  std::mutex mu_;                           // guards c2s_, s2c_
  std::string c2s_, s2c_;
};

LinkClientOptions clientOpts(uint16_t port, std::string key = kKey) {
  LinkClientOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.key = std::move(key);
  o.node = kNode;
  return o;
}

class LinkTest : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{2, 8}};
};

TEST_F(LinkTest, UnaryCallsAndErrorsKeepTheirStatus) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  auto r = client.unary("echo", "hello", kGuardS);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, "hello");
  std::string big(1000000, 'b');
  r = client.unary("echo", big, kGuardS);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, big);

  r = client.unary("fail", "", kGuardS);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_EQ(r.status().message(), "no such thing");
  EXPECT_EQ(r.status().sysErrno(), ENOENT);
  EXPECT_EQ(r.status().field(), "path");

  r = client.unary("events", "100", kGuardS);  // events nobody listens to are credited
  ASSERT_TRUE(r.isOk()) << r.status().toString();

  r = client.unary(std::string(256, 'm'), "", kGuardS);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "method");
  r = client.unary("echo", std::string(kMaxPayload, 'x'), kGuardS);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(client.connects(), 1u);
}

TEST_F(LinkTest, EventsArriveInOrderBeforeTheReply) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::vector<std::string> events;  // io thread, then read after done
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onEvent = [&](std::string_view p) { events.emplace_back(p); };
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  client.start("events", "5000", std::move(h));
  auto r = done.get_future().get();
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, "done");
  ASSERT_EQ(events.size(), 5000u);
  for (int i = 0; i < 5000; ++i) EXPECT_EQ(events[size_t(i)], "event " + std::to_string(i));
}

TEST_F(LinkTest, TenThousandConcurrentCallsShareOneConnection) {
  constexpr int kCalls = 10000;
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::atomic<int> started{0}, ok{0}, bad{0};
  std::vector<std::shared_ptr<ClientCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    CallHandler h;
    h.onEvent = [&](std::string_view p) {
      if (p == "started") ++started;
    };
    h.onDone = [&, i](Result<std::string> r) {
      if (r.isOk() && *r == "held " + std::to_string(i)) {
        ++ok;
      } else {
        ++bad;
      }
    };
    calls.push_back(client.start("hold", std::to_string(i), std::move(h)));
  }
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == size_t(kCalls); }, 5))
      << edge.heldCount() << " started " << started.load();
  ASSERT_TRUE(waitFor([&] { return started.load() == kCalls; }));
  EXPECT_EQ(client.connects(), 1u);
  EXPECT_EQ(edge.server().connections(), 1u);
  EXPECT_EQ(edge.server().callsInFlight(), size_t(kCalls));
  EXPECT_EQ(client.callsInFlight(), size_t(kCalls));
  for (auto& c : edge.takeHeld()) ASSERT_TRUE(c->reply("held " + c->args()).isOk());
  ASSERT_TRUE(waitFor([&] { return ok.load() + bad.load() == kCalls; }));
  EXPECT_EQ(ok.load(), kCalls);
  EXPECT_EQ(client.callsInFlight(), 0u);
  EXPECT_TRUE(waitFor([&] { return edge.server().callsInFlight() == 0; }));
}

TEST_F(LinkTest, CancelReachesTheServer) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  auto call = client.start("hold", "", std::move(h));
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == 1; }));
  call->cancel(Status(Code::kDeadlineExceeded, "gave up"));
  auto r = done.get_future().get();
  EXPECT_EQ(r.status().code(), Code::kDeadlineExceeded);
  EXPECT_EQ(r.status().message(), "gave up");
  ASSERT_TRUE(waitFor([&] { return edge.cancels.load() == 1; }));
  auto held = edge.takeHeld();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_TRUE(held[0]->cancelled());
  EXPECT_EQ(held[0]->reply("late").code(), Code::kUnavailable);
  EXPECT_EQ(edge.server().callsInFlight(), 0u);

  // A unary call that times out is cancelled on the server too.
  auto u = client.unary("hold", "", 0.2);
  EXPECT_EQ(u.status().code(), Code::kDeadlineExceeded);
  ASSERT_TRUE(waitFor([&] { return edge.cancels.load() == 2; }));
}

TEST_F(LinkTest, AConsumerThatTakesNothingBoundsWhatTheSenderBuffers) {
  LinkOptions lo;  // defaults: 256 KiB window, 256 KiB send buffer per call
  Edge edge(rt_, lo);
  LinkClient client(rt_, clientOpts(edge.port()));
  constexpr uint64_t kTotal = 8u << 20;
  std::atomic<uint64_t> received{0};
  std::atomic<bool> consume{false};
  std::shared_ptr<ClientCall> call;
  std::promise<Result<std::string>> done;
  std::mutex callMu;
  CallHandler h;
  h.manualCredit = true;
  h.onData = [&](std::string_view b) {
    received += b.size();
    if (consume) {
      std::lock_guard lk(callMu);
      call->consumed(b.size());
    }
  };
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  {
    std::lock_guard lk(callMu);
    call = client.start("produce", std::to_string(kTotal), std::move(h));
  }
  ASSERT_TRUE(waitFor([&] { return edge.produceRefused.load(); }));
  // The window's worth arrives (16 KiB sends fill it exactly), then nothing
  // more moves while nobody consumes.
  ASSERT_TRUE(waitFor([&] { return received.load() >= lo.initialWindow; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  uint64_t got = received.load();
  EXPECT_EQ(got, uint64_t(lo.initialWindow));
  EXPECT_LE(edge.produceMaxQueued.load(), lo.callSendBuffer + 16384);

  // Taking what arrived lets the rest flow.
  consume = true;
  call->consumed(got);
  auto r = done.get_future().get();
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(received.load(), kTotal);

  // The other way: a server that reads nothing; the client's sends are
  // refused once the window and its send buffer are full.
  CallHandler h2;
  auto up = client.start("upload-stall", "", std::move(h2));
  ASSERT_TRUE(waitFor([&] {
    std::lock_guard lk(edge.mu_);
    return edge.stalled != nullptr;
  }));
  std::string chunk(16384, 'u');
  uint64_t accepted = 0;
  for (int i = 0; i < 10000; ++i) {
    Status st = up->send(chunk);
    if (st.code() == Code::kResourceExhausted) {
      // Maybe only the send buffer is full and the window still open: give
      // the link a moment to move bytes, then try again.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (up->send(chunk).code() == Code::kResourceExhausted) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        st = up->send(chunk);
        if (st.code() == Code::kResourceExhausted) break;
      }
      accepted += chunk.size();
      continue;
    }
    ASSERT_TRUE(st.isOk()) << st.toString();
    accepted += chunk.size();
  }
  EXPECT_LE(accepted, uint64_t(lo.initialWindow) + lo.callSendBuffer + 3 * chunk.size());
  std::shared_ptr<ServerCall> stalled;
  {
    std::lock_guard lk(edge.mu_);
    stalled = edge.stalled;
  }
  // The server holds at most a window of it.
  std::vector<char> buf(1 << 20);
  auto n = stalled->read(buf.data(), buf.size(), kGuardS);
  ASSERT_TRUE(n.isOk());
  EXPECT_LE(*n, size_t(lo.initialWindow));
  up->cancel(Status(Code::kDeadlineExceeded, "done"));
}

TEST_F(LinkTest, BigTransfersBothWaysLeaveRoomForSmallCalls) {
  constexpr uint64_t kSize = 64u << 20;
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  ASSERT_TRUE(client.unary("echo", "", kGuardS).isOk());

  std::string expect;
  {
    Sha256 sum;
    std::vector<char> buf(1 << 20);
    for (uint64_t off = 0; off < kSize; off += buf.size()) {
      fillPattern(buf.data(), buf.size(), off);
      sum.update(buf.data(), buf.size());
    }
    expect = sum.hexDigest();
  }
  std::atomic<bool> bigDone{false};
  std::string downSum, upReply;
  uint64_t downBytes = 0;
  Status downSt, upSt;
  std::thread down([&] {
    auto call = client.start("download", std::to_string(kSize), CallHandler{});
    Sha256 sum;
    std::vector<char> buf(123456);
    for (;;) {
      auto n = call->read(buf.data(), buf.size(), kGuardS);
      if (!n.isOk()) {
        downSt = n.status();
        return;
      }
      if (*n == 0) break;
      sum.update(buf.data(), *n);
      downBytes += *n;
    }
    downSum = sum.hexDigest();
    auto r = call->wait(kGuardS);
    downSt = r.status();
    if (r.isOk() && *r != downSum) downSt = Status(Code::kDataLoss, "server sum " + *r);
  });
  std::thread up([&] {
    auto call = client.start("upload", "", CallHandler{});
    std::vector<char> buf(1 << 20);
    for (uint64_t off = 0; off < kSize; off += buf.size()) {
      fillPattern(buf.data(), buf.size(), off);
      Status st = call->write(std::string_view(buf.data(), buf.size()), kGuardS);
      if (!st.isOk()) {
        upSt = st;
        return;
      }
    }
    upSt = call->end();
    auto r = call->wait(kGuardS);
    upSt = r.status();
    if (r.isOk()) upReply = *r;
  });
  int small = 0, smallDuring = 0;
  std::thread watcher([&] {
    down.join();
    up.join();
    bigDone = true;
  });
  while (!bigDone) {
    auto r = client.unary("echo", "small " + std::to_string(small), kGuardS);
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    ASSERT_EQ(*r, "small " + std::to_string(small));
    ++small;
    if (!bigDone) ++smallDuring;
  }
  watcher.join();
  ASSERT_TRUE(downSt.isOk()) << downSt.toString();
  ASSERT_TRUE(upSt.isOk()) << upSt.toString();
  EXPECT_EQ(downBytes, kSize);
  EXPECT_EQ(downSum, expect);
  EXPECT_EQ(upReply, std::to_string(kSize) + " " + expect);
  // Small calls completed while both big ones were on the wire.
  EXPECT_GT(smallDuring, 0);
  EXPECT_EQ(client.connects(), 1u);
}

TEST_F(LinkTest, AWrongKeyOnEitherSideFailsUnauthenticated) {
  {
    Edge edge(rt_);
    LinkClient client(rt_, clientOpts(edge.port(), "not-the-key"));
    auto r = client.unary("echo", "x", kGuardS);
    EXPECT_EQ(r.status().code(), Code::kUnauthenticated) << r.status().toString();
    EXPECT_EQ(edge.server().authFailures(), 1u);
    EXPECT_FALSE(client.connected());
    ASSERT_TRUE(waitFor([&] { return edge.server().connections() == 0; }));
  }
  {
    Edge edge(rt_, LinkOptions{}, "the-edge-has-another-key");
    LinkClient client(rt_, clientOpts(edge.port()));
    auto r = client.unary("echo", "x", kGuardS);
    EXPECT_EQ(r.status().code(), Code::kUnauthenticated) << r.status().toString();
    EXPECT_EQ(edge.server().authFailures(), 1u);
    // The right key, and the next attempt (after the backoff) gets in.
    edge.setKey(kKey);
    ASSERT_TRUE(waitFor([&] { return client.unary("echo", "y", kGuardS).isOk(); }));
  }
  {
    Edge edge(rt_);
    auto o = clientOpts(edge.port());
    o.node = "node-unknown";
    LinkClient client(rt_, o);
    EXPECT_EQ(client.unary("echo", "x", kGuardS).status().code(), Code::kUnauthenticated);
  }
}

// The handshake frames (stream 0) of one direction of a recorded connection.
std::string handshakeFrames(const std::string& wire, bool skipHttpHead) {
  std::string body = wire;
  if (skipHttpHead) body = body.substr(body.find("\r\n\r\n") + 4);
  FrameDecoder dec;
  EXPECT_TRUE(dec.feed(body.data(), body.size()).isOk());
  std::string out;
  Frame f;
  while (dec.next(f)) {
    auto t = static_cast<LinkFrame>(f.rawType());
    if (f.stream == 0 &&
        (t == LinkFrame::kHello || t == LinkFrame::kAuth || t == LinkFrame::kReady)) {
      appendFrame(out, 0, f.rawType(), f.payload);
    }
  }
  return out;
}

TEST_F(LinkTest, AReplayedHandshakeFailsBothWays) {
  Edge edge(rt_);
  std::string c2s, s2c;
  {
    Proxy proxy(edge.port());
    LinkClient client(rt_, clientOpts(proxy.port()));
    ASSERT_TRUE(client.unary("echo", "x", kGuardS).isOk());
    client.close();
    c2s = proxy.clientToServer();
    s2c = proxy.serverToClient();
  }
  std::string clientHs = handshakeFrames(c2s, true);
  std::string serverHs = handshakeFrames(s2c, true);
  ASSERT_FALSE(clientHs.empty());
  ASSERT_FALSE(serverHs.empty());

  // The client's old hello + auth, replayed to the edge.
  uint64_t failuresBefore = edge.server().authFailures();
  int fd = connectLoopback(edge.port());
  ASSERT_GE(fd, 0);
  std::string req = c2s.substr(0, c2s.find("\r\n\r\n") + 4) + clientHs;
  ASSERT_TRUE(writeAll(fd, req));
  std::string head, rest;
  ASSERT_TRUE(readHead(fd, &head, &rest));
  EXPECT_EQ(head.rfind("HTTP/1.1 101", 0), 0u);
  FrameDecoder dec;
  ASSERT_TRUE(dec.feed(rest.data(), rest.size()).isOk());
  char buf[4096];
  for (;;) {  // until the edge closes
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    ASSERT_TRUE(dec.feed(buf, size_t(n)).isOk());
  }
  ::close(fd);
  std::vector<Frame> got;
  Frame f;
  while (dec.next(f)) got.push_back(f);
  ASSERT_EQ(got.size(), 2u);  // its fresh hello, then the refusal
  EXPECT_EQ(static_cast<LinkFrame>(got[0].rawType()), LinkFrame::kHello);
  EXPECT_EQ(static_cast<LinkFrame>(got[1].rawType()), LinkFrame::kError);
  EXPECT_EQ(edge.server().authFailures(), failuresBefore + 1);

  // The edge's old hello + ready, replayed to a client by an impostor.
  uint16_t port;
  int lfd = listenLoopback(&port);
  std::thread impostor([&] {
    int c = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    std::string h, r;
    if (readHead(c, &h, &r)) {
      writeAll(c, linkUpgradeResponse() + serverHs);
      char b[4096];
      while (::read(c, b, sizeof b) > 0) {
      }
    }
    ::close(c);
  });
  {
    LinkClient client(rt_, clientOpts(port));
    auto r = client.unary("echo", "x", kGuardS);
    EXPECT_EQ(r.status().code(), Code::kUnauthenticated) << r.status().toString();
  }
  impostor.join();
  ::close(lfd);
}

TEST_F(LinkTest, ReconnectsAfterTheServerDropsTheConnection) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  client.start("hold", "", std::move(h));
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == 1; }));
  edge.takeHeld();
  edge.restart();
  auto r = done.get_future().get();
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  // Back, on a new connection (a call may land in the backoff of a failed
  // attempt: it fails at once, and the next one goes through).
  ASSERT_TRUE(waitFor([&] { return client.unary("echo", "again", kGuardS).isOk(); }));
  EXPECT_EQ(client.connects(), 2u);
}

TEST_F(LinkTest, PingFindsAPeerThatStoppedAnswering) {
  LinkOptions lo;
  lo.pingIntervalS = 0.2;
  lo.pingTimeoutS = 1.5;
  Edge edge(rt_, lo);
  Proxy proxy(edge.port());
  auto o = clientOpts(proxy.port());
  o.link = lo;
  LinkClient client(rt_, o);
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  client.start("hold", "", std::move(h));
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == 1; }));
  // Idle but alive: pings keep it up well past the timeout.
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  EXPECT_EQ(edge.cancels.load(), 0);
  EXPECT_EQ(client.callsInFlight(), 1u);
  proxy.blackhole();
  auto fut = done.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(int(kGuardS))), std::future_status::ready);
  auto r = fut.get();
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  // The edge gives up on its side too: the call is cancelled.
  ASSERT_TRUE(waitFor([&] { return edge.cancels.load() == 1; }));
  EXPECT_TRUE(edge.takeHeld()[0]->cancelled());
}

TEST_F(LinkTest, GoawayLetsCallsInFlightFinishAndMovesNewOnes) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  client.start("hold", "", std::move(h));
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == 1; }));
  edge.server().goAway();
  // New calls take a new connection; the old one stays for its call.
  ASSERT_TRUE(waitFor([&] { return client.unary("echo", "new", kGuardS).isOk(); }));
  EXPECT_EQ(client.connects(), 2u);
  EXPECT_EQ(edge.server().connections(), 2u);
  auto held = edge.takeHeld();
  ASSERT_EQ(held.size(), 1u);
  ASSERT_TRUE(held[0]->reply("finished").isOk());
  auto r = done.get_future().get();
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, "finished");
  // The drained connection closes.
  EXPECT_TRUE(waitFor([&] { return edge.server().connections() == 1; }));
  EXPECT_EQ(edge.cancels.load(), 0);
}

TEST_F(LinkTest, ABodyThatArrivesBeforeItsCallbackIsDeliveredInOrder) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  constexpr size_t kSize = 200000;  // within the window: all of it waits
  std::string body(kSize, '\0');
  fillPattern(body.data(), body.size(), 0);
  auto call = client.start("late-reader", "", CallHandler{});
  for (size_t off = 0; off < kSize; off += 10000) {
    ASSERT_TRUE(call->write(std::string_view(body).substr(off, 10000), kGuardS).isOk());
  }
  ASSERT_TRUE(call->end().isOk());
  auto r = call->wait(kGuardS);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, std::to_string(kSize) + " " + sha256Hex(body));
}

TEST_F(LinkTest, DrainLetsCallsFinishAndRefusesNewOnes) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::promise<Result<std::string>> done;
  CallHandler h;
  h.onDone = [&](Result<std::string> r) { done.set_value(std::move(r)); };
  client.start("hold", "", std::move(h));
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == 1; }));
  client.drain();
  EXPECT_EQ(client.unary("echo", "x", kGuardS).status().code(), Code::kUnavailable);
  auto held = edge.takeHeld();
  ASSERT_EQ(held.size(), 1u);
  ASSERT_TRUE(held[0]->reply("finished").isOk());
  auto r = done.get_future().get();
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(*r, "finished");
  EXPECT_TRUE(waitFor([&] { return edge.server().connections() == 0; }));
  EXPECT_EQ(edge.cancels.load(), 0);
}

TEST_F(LinkTest, BlockingHelpersRefuseIoThreads) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  std::promise<Status> got;
  rt_.post([&] { got.set_value(client.unary("echo", "x", 1).status()); });
  EXPECT_EQ(got.get_future().get().code(), Code::kFailedPrecondition);
}

TEST_F(LinkTest, ThreadCountDoesNotGrowWithCalls) {
  Edge edge(rt_);
  LinkClient client(rt_, clientOpts(edge.port()));
  ASSERT_TRUE(client.unary("echo", "warm", kGuardS).isOk());
  int before = threadCount();
  std::atomic<int> done{0};
  constexpr int kCalls = 20000;
  for (int i = 0; i < kCalls; ++i) {
    CallHandler h;
    h.onDone = [&](Result<std::string> r) {
      if (r.isOk()) ++done;
    };
    client.start(i % 2 ? "echo" : "hold", "x", std::move(h));
  }
  ASSERT_TRUE(waitFor([&] { return edge.heldCount() == kCalls / 2; }));
  int during = threadCount();
  for (auto& c : edge.takeHeld()) (void)c->reply("ok");
  ASSERT_TRUE(waitFor([&] { return done.load() == kCalls; }));
  EXPECT_EQ(during, before);
  EXPECT_EQ(threadCount(), before);
}

}  // namespace
}  // namespace dsec::proto
