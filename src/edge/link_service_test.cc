// Exposed ports over the link, whole: platform::RemoteEdge::openPort /
// setPorts -> the link (a real LinkClient and LinkServer) -> LinkService's
// port_open / set_ports -> a node whose openPort is the real one minus the
// sandbox (net/netns_socket.h's connectLoopback in this netns, recorded in a
// real PortRegistry) -> loopback servers run by the test.
#include "edge/link_service.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/util.h"
#include "edge/net/netns_socket.h"
#include "edge/port_registry.h"
#include "platform/remote_edge.h"
#include "proto/sim_edge.h"

namespace dsec::edge {
namespace {

constexpr char kKey[] = "link-service-test-key";
constexpr char kNode[] = "node-1";
constexpr int kGuardMs = 30000;

// The node: a simulated one whose ports are real loopback connections.
class PortNode : public proto::SimEdge {
 public:
  PortNode() : SimEdge(proto::SimOptions{}) {}
  Result<UniqueFd> openPort(const std::string& id, int port, uint64_t gen,
                            double connectTimeoutS) override {
    if (id == "fncall-sb") {
      return Status(Code::kFailedPrecondition,
                    "backend fncall keeps no long-lived processes: it cannot expose ports", 0,
                    "backend");
    }
    if (id != "sb") return notFound("sandbox " + id + " not found");
    RETURN_IF_ERROR(ports.check(id, port, gen));
    ASSIGN_OR_RETURN(UniqueFd fd, connectLoopback(-1, port, connectTimeoutS));
    RETURN_IF_ERROR(ports.add(id, port, gen, fd.get()));
    return fd;
  }
  Status setPorts(const std::string& id, const std::vector<proto::PortGen>& p) override {
    ports.set(id, p);
    return Status::ok();
  }
  // "sb" has figures; with `history` a series of three readings as well.
  Result<proto::CgroupStats> stats(const std::string& id) override {
    if (id != "sb") return notFound("sandbox " + id + " not found");
    proto::CgroupStats s;
    s.memoryBytes = 1 << 20;
    s.cpuUsec = 7'000'000;
    s.pids = 4;
    return s;
  }
  Result<proto::StatsSeries> statsHistory(const std::string& id, double windowS) override {
    if (!history) return SimEdge::statsHistory(id, windowS);
    if (id != "sb") return notFound("sandbox " + id + " not found");
    lastWindowS = windowS;
    return proto::StatsSeries{
        15,
        {{1000.5, 0, 4096, 1}, {1015.5, 15'000'000, 8192, 2}, {1020.25, 17'000'000, 1ll << 33, 3}}};
  }
  PortRegistry ports;
  std::atomic<bool> history{true};
  std::atomic<double> lastWindowS{0};
};

UniqueFd listenLoopback(uint16_t* port) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(listen(fd.get(), 128), 0);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

// A port nothing listens on (bound, then closed).
int freePort() {
  uint16_t p = 0;
  listenLoopback(&p);
  return p;
}

// Accepts on loopback and does, per connection, `serve(fd)` on a thread.
class Server {
 public:
  explicit Server(std::function<void(int fd)> serve) : serve_(std::move(serve)) {
    fd_ = listenLoopback(&port_);
    thread_ = std::thread([this] {
      for (;;) {
        int c = accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) return;
        std::lock_guard lk(mu_);
        conns_.emplace_back([this, c] {
          serve_(c);
          close(c);
        });
      }
    });
  }
  ~Server() {
    shutdown(fd_.get(), SHUT_RDWR);
    thread_.join();
    std::lock_guard lk(mu_);
    for (auto& t : conns_) t.join();
  }
  int port() const { return port_; }

 private:
  std::function<void(int)> serve_;
  UniqueFd fd_;
  uint16_t port_ = 0;
  std::thread thread_;
  std::mutex mu_;  // guards conns_
  std::vector<std::thread> conns_;
};

void echo(int fd) {
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      ssize_t w = send(fd, buf + off, size_t(n - off), MSG_NOSIGNAL);
      if (w <= 0) return;
      off += w;
    }
  }
  shutdown(fd, SHUT_WR);
}

// Helpers on the caller's (non-blocking) end.
bool waitIo(int fd, short ev, int ms = kGuardMs) {
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
// Everything until EOF; nullopt-like "<timeout>" when none came in time.
std::string readToEof(int fd, int ms = kGuardMs) {
  std::string out;
  char buf[65536];
  for (;;) {
    if (!waitIo(fd, POLLIN, ms)) return out + "<timeout>";
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return out;
    out.append(buf, size_t(n));
  }
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

// The node's HTTP side as far as the link goes: the upgrade, then
// LinkService::adopt (as edge_server.cc does).
class LinkServiceTest : public ::testing::Test {
 protected:
  LinkServiceTest() {
    packDir_ = "/tmp/dsec-link-service-test-" + randomHex(6);
    service_ = std::make_unique<LinkService>(
        rt_, &node_, [](const std::string& n) { return n == kNode ? kKey : std::string(); },
        [] { return std::vector<std::string>{"sb"}; }, packDir_);
    listen_ = listenLoopback(&port_);
    acceptor_ = std::thread([this] {
      for (;;) {
        int fd = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) return;
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
        std::string ans = proto::linkUpgradeResponse();
        EXPECT_EQ(write(fd, ans.data(), ans.size()), ssize_t(ans.size()));
        service_->adopt(UniqueFd(fd), buf.substr(end + 4));
      }
    });
    remote_ = std::make_unique<platform::RemoteEdge>("http://127.0.0.1:" + std::to_string(port_),
                                                     kKey, kNode, rt_);
  }
  ~LinkServiceTest() override {
    remote_.reset();
    shutdown(listen_.get(), SHUT_RDWR);
    acceptor_.join();
    service_.reset();
    (void)removeTree(packDir_);
  }

  Runtime rt_{RuntimeOptions{2, 8}};
  PortNode node_;
  std::string packDir_;
  std::unique_ptr<LinkService> service_;
  UniqueFd listen_;
  uint16_t port_ = 0;
  std::thread acceptor_;
  std::unique_ptr<platform::RemoteEdge> remote_;
};

TEST_F(LinkServiceTest, OpenPortCarriesAConnectionBothWays) {
  Server server(echo);
  auto fd = remote_->openPort("sb", server.port(), 1);
  ASSERT_TRUE(fd.isOk()) << fd.status().toString();
  // As the contract says: a stream socket, non-blocking, close-on-exec.
  EXPECT_TRUE(fcntl(fd->get(), F_GETFL) & O_NONBLOCK);
  EXPECT_TRUE(fcntl(fd->get(), F_GETFD) & FD_CLOEXEC);
  int type = 0;
  socklen_t len = sizeof type;
  ASSERT_EQ(getsockopt(fd->get(), SOL_SOCKET, SO_TYPE, &type, &len), 0);
  EXPECT_EQ(type, SOCK_STREAM);
  std::string body;
  for (int i = 0; i < (1 << 20) / 16; ++i) body += "0123456789abcde\n";
  std::thread writer([&] {
    EXPECT_TRUE(writeAll(fd->get(), body));
    shutdown(fd->get(), SHUT_WR);
  });
  EXPECT_EQ(readToEof(fd->get()), body);
  writer.join();
  // The node's book drops the connection once the relay closed it.
  EXPECT_TRUE([&] {
    for (int i = 0; i < 500; ++i) {
      if (node_.ports.connections("sb") == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }());
}

// link "stats": the figures now (cpu_usec and pids too) and, with history,
// the node's readings; a node without history answers one reading now.
TEST_F(LinkServiceTest, StatsAndTheirHistoryCross) {
  auto now = remote_->stats("sb");
  ASSERT_TRUE(now.isOk()) << now.status().toString();
  EXPECT_EQ(now->cpuUsec, 7'000'000);
  EXPECT_EQ(now->pids, 4);
  EXPECT_EQ(now->memoryBytes, 1 << 20);

  auto h = remote_->statsHistory("sb", 600);
  ASSERT_TRUE(h.isOk()) << h.status().toString();
  EXPECT_EQ(node_.lastWindowS.load(), 600);
  EXPECT_EQ(h->intervalS, 15);
  ASSERT_EQ(h->samples.size(), 3u);
  EXPECT_DOUBLE_EQ(h->samples[2].t, 1020.25);
  EXPECT_EQ(h->samples[2].memoryBytes, 1ll << 33);
  EXPECT_EQ(h->samples[1].cpuUsec, 15'000'000);
  EXPECT_EQ(h->samples[2].pids, 3);
  auto cores = proto::cpuCores(h->samples);
  EXPECT_DOUBLE_EQ(cores[1].value_or(-1), 1.0);

  auto gone = remote_->statsHistory("sb-gone", 60);
  ASSERT_FALSE(gone.isOk());
  EXPECT_EQ(gone.status().code(), Code::kNotFound);

  node_.history = false;
  h = remote_->statsHistory("sb", 60);
  ASSERT_TRUE(h.isOk()) << h.status().toString();
  EXPECT_EQ(h->intervalS, 0);
  ASSERT_EQ(h->samples.size(), 1u);
  EXPECT_EQ(h->samples[0].cpuUsec, 7'000'000);
  EXPECT_GT(h->samples[0].t, 1e9);
}

TEST_F(LinkServiceTest, TheNodesErrorsComeBackWithTheirCodeMessageAndField) {
  int nobody = freePort();
  auto r = remote_->openPort("sb", nobody, 1);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_EQ(r.status().message(), "nothing listens on port " + std::to_string(nobody));
  EXPECT_EQ(r.status().field(), "port");
  EXPECT_EQ(r.status().sysErrno(), ECONNREFUSED);

  Server server(echo);
  ASSERT_TRUE(remote_->setPorts("sb", {{server.port(), 2}}).isOk());
  r = remote_->openPort("sb", server.port(), 1);
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().toString();
  EXPECT_EQ(r.status().field(), "port");
  r = remote_->openPort("sb", server.port(), 2);
  EXPECT_TRUE(r.isOk()) << r.status().toString();

  r = remote_->openPort("fncall-sb", 80, 1);
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(r.status().field(), "backend");
  r = remote_->openPort("nope", 80, 1);
  EXPECT_EQ(r.status().code(), Code::kNotFound) << r.status().toString();
  r = remote_->openPort("sb", 0, 1);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "port");

  // What the node checks itself, for a platform that did not.
  proto::LinkClientOptions o;
  o.host = "127.0.0.1";
  o.port = port_;
  o.key = kKey;
  o.node = kNode;
  proto::LinkClient raw(rt_, o);
  struct Case {
    const char* method;
    const char* args;
    const char* field;
  };
  for (const Case& c : {Case{"port_open", R"({"id":"sb","port":70000,"gen":1})", "port"},
                        Case{"port_open", R"({"id":"sb","port":"80","gen":1})", "port"},
                        Case{"port_open", R"({"id":"sb","port":80})", "gen"},
                        Case{"port_open", R"({"port":80,"gen":1})", "id"},
                        Case{"set_ports", R"({"id":"sb","ports":[{"port":80}]})", "ports"},
                        Case{"set_ports", R"({"id":"sb"})", "ports"}}) {
    auto out = raw.unary(c.method, c.args, 30);
    ASSERT_FALSE(out.isOk()) << c.args;
    EXPECT_EQ(out.status().code(), Code::kInvalidArgument) << c.args;
    EXPECT_EQ(out.status().field(), c.field) << c.args << ": " << out.status().toString();
  }
  raw.close();
}

TEST_F(LinkServiceTest, SetPortsCutsTheConnectionsOfDroppedPairs) {
  // A server that holds each connection until the client ends it, noting
  // what it read and whether it saw the end (by accept order).
  struct Seen {
    std::string bytes;
    bool ended = false;
  };
  std::mutex mu;  // guards seen
  std::vector<Seen> seen;
  Server server([&](int fd) {
    size_t me;
    {
      std::lock_guard lk(mu);
      me = seen.size();
      seen.emplace_back();
    }
    char buf[4096];
    for (;;) {
      ssize_t n = read(fd, buf, sizeof buf);
      std::lock_guard lk(mu);
      if (n <= 0) {
        seen[me].ended = true;
        return;
      }
      seen[me].bytes.append(buf, size_t(n));
    }
  });
  auto until = [&](const std::function<bool(const std::vector<Seen>&)>& pred) {
    for (int i = 0; i < kGuardMs / 10; ++i) {
      {
        std::lock_guard lk(mu);
        if (pred(seen)) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  ASSERT_TRUE(remote_->setPorts("sb", {{server.port(), 1}}).isOk());
  auto old = remote_->openPort("sb", server.port(), 1);
  ASSERT_TRUE(old.isOk()) << old.status().toString();
  ASSERT_TRUE(writeAll(old->get(), "old"));
  ASSERT_TRUE(until([](auto& s) { return s.size() == 1 && s[0].bytes == "old"; }));
  // Rotation: gen 2 exposed beside gen 1 a moment, then gen 1 dropped.
  ASSERT_TRUE(remote_->setPorts("sb", {{server.port(), 1}, {server.port(), 2}}).isOk());
  auto kept = remote_->openPort("sb", server.port(), 2);
  ASSERT_TRUE(kept.isOk()) << kept.status().toString();
  ASSERT_TRUE(writeAll(kept->get(), "kept"));
  ASSERT_TRUE(until([](auto& s) { return s.size() == 2 && s[1].bytes == "kept"; }));
  ASSERT_TRUE(remote_->setPorts("sb", {{server.port(), 2}}).isOk());
  // The caller of the cut one reads EOF at once (nothing was sent to it),
  // and the sandbox's side sees the connection end.
  EXPECT_EQ(readToEof(old->get(), 5000), "");
  EXPECT_TRUE(until([](auto& s) { return s[0].ended; }));
  // The other goes on.
  ASSERT_TRUE(writeAll(kept->get(), " still"));
  shutdown(kept->get(), SHUT_WR);
  EXPECT_EQ(readToEof(kept->get()), "");
  EXPECT_TRUE(until([](auto& s) { return s[1].ended && s[1].bytes == "kept still"; }));
  // A gen no longer exposed is refused from now on.
  EXPECT_EQ(remote_->openPort("sb", server.port(), 1).status().code(), Code::kPermissionDenied);
}

TEST_F(LinkServiceTest, OpenConnectionsHoldNoThreads) {
  Server server([](int fd) {
    char c;
    while (read(fd, &c, 1) > 0) {
    }
  });
  // Warm up: the link and the pool are there.
  { auto first = remote_->openPort("sb", server.port(), 1); }
  int before = threadCount();
  std::vector<UniqueFd> open;
  for (int i = 0; i < 64; ++i) {
    auto fd = remote_->openPort("sb", server.port(), 1);
    ASSERT_TRUE(fd.isOk()) << fd.status().toString();
    open.push_back(std::move(*fd));
  }
  // The test's server holds a thread per connection (64); the relays none.
  EXPECT_LE(threadCount() - before, 64 + 4);
  open.clear();
}

}  // namespace
}  // namespace dsec::edge
