// The platform over a simulated node (proto/sim_edge.h), through its real
// HTTP server: execs in flight hold no thread (thousands at once, the
// process's thread count unchanged), each completes when its node says so,
// and a client that goes away cancels its exec on the node.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/http_client.h"
#include "common/http_server.h"
#include "common/runtime.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/cluster.h"
#include "platform/platform.h"
#include "proto/sim_edge.h"

namespace dsec::platform {
namespace {

// A fixed blocking pool (8, as `dsec up` on 2 cores, without the threads it
// adds while starved): what these tests count is that nothing in flight holds
// a thread, which a burst of 2,000 handlers growing the pool would blur.
const bool kFixedPool = Runtime::configureGlobal(RuntimeOptions{0, 8, 8});


using json = nlohmann::json;

int threadCount() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

bool waitFor(const std::function<bool()>& cond, double seconds) {
  for (double t0 = monoSeconds(); monoSeconds() - t0 < seconds;) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

class PlatformOverSim : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dsec-platform-sim-test-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_).isOk());
    auto store = SqliteStore::open(dir_ + "/state.db");
    ASSERT_TRUE(store.isOk()) << store.status().toString();
    store_ = std::move(*store);
    ClusterOptions co;
    co.dataDir = dir_;
    co.store = store_.get();
    co.replicaId = "r-test";
    auto c = Cluster::start(co);
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    cluster_ = std::move(*c);
    node_ = std::make_unique<proto::SimEdge>(proto::SimOptions{0, 100000});
    cluster_->addLocal(node_.get(), nullptr, "sim", NodeCapacity{1e6, int64_t(1) << 40, 100000});
    PlatformOptions po;
    po.dataDir = dir_;
    po.token = token_;
    po.replicaId = "r-test";
    auto p = Platform::start(po, store_.get(), cluster_.get());
    ASSERT_TRUE(p.isOk()) << p.status().toString();
    platform_ = std::move(*p);
    http::ServerOptions so;
    so.port = 0;
    server_ = std::make_unique<http::Server>(so);
    ASSERT_TRUE(server_->listen().isOk());
    server_->start([this](http::Request& req, http::Response& res) { platform_->handle(req, res); });
    auto cl = http::Client::connect("http://127.0.0.1:" + std::to_string(server_->port()), token_);
    ASSERT_TRUE(cl.isOk()) << cl.status().toString();
    client_ = std::move(*cl);
    // An image of one (simulated) layer.
    std::string blob = "simulated layer";
    std::string digest = "sha256:" + sha256Hex(blob);
    auto put = client_->request("PUT", "/v1/blobs/" + digest, blob);
    ASSERT_TRUE(put.isOk() && put->status / 100 == 2) << (put.isOk() ? put->body : "");
    auto img = client_->request(
        "POST", "/v1/images", json{{"name", "sim"}, {"tag", "latest"}, {"layers", {digest}}}.dump());
    ASSERT_TRUE(img.isOk() && img->status / 100 == 2) << (img.isOk() ? img->body : "");
  }

  void TearDown() override {
    client_.reset();
    if (server_) {
      server_->stop();
      server_->wait();
    }
    server_.reset();
    if (platform_) platform_->shutdown();
    platform_.reset();
    cluster_.reset();
    node_.reset();
    store_.reset();
    (void)removeTree(dir_);
  }

  std::string create() {
    auto r = client_->request("POST", "/v1/sandboxes", json{{"image", "sim:latest"}}.dump());
    EXPECT_TRUE(r.isOk() && r->status == 201) << (r.isOk() ? r->body : r.status().toString());
    if (!r.isOk()) return "";
    return json::parse(r->body).value("id", "");
  }

  // A raw connection with one request written on it.
  int sendRequest(const std::string& method, const std::string& path, const std::string& body) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(server_->port());
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << strerror(errno);
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                      token_ + "\r\nContent-Type: application/json\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\n\r\n" + body;
    EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
    return fd;
  }

  // The whole answer on fd (the server keeps the connection: read until the
  // body of Content-Length is in).
  static std::string readAnswer(int fd, double timeoutS) {
    std::string out;
    char buf[4096];
    double t0 = monoSeconds();
    for (;;) {
      size_t he = out.find("\r\n\r\n");
      if (he != std::string::npos) {
        auto cl = out.find("Content-Length: ");
        if (cl != std::string::npos && cl < he) {
          size_t len = std::stoul(out.substr(cl + 16));
          if (out.size() >= he + 4 + len) return out;
        }
      }
      pollfd p{fd, POLLIN, 0};
      int left = int((timeoutS - (monoSeconds() - t0)) * 1000);
      if (left <= 0 || ::poll(&p, 1, left) <= 0) return out;
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return out;
      out.append(buf, size_t(n));
    }
  }

  std::string dir_;
  std::string token_ = "test-token-" + randomHex(8);
  std::unique_ptr<SqliteStore> store_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<proto::SimEdge> node_;
  std::unique_ptr<Platform> platform_;
  std::unique_ptr<http::Server> server_;
  std::unique_ptr<http::Client> client_;
};

// 2,000 execs of `sleep 3` on one connection each: all in flight on the node
// at once, the process's threads as before, every one answered with exit 0.
TEST_F(PlatformOverSim, ThousandsOfExecsInFlightHoldNoThread) {
  std::vector<std::string> ids;
  for (int i = 0; i < 20; ++i) ids.push_back(create());
  ASSERT_FALSE(ids[0].empty());
  int threadsBefore = threadCount();
  constexpr int kN = 2000;
  std::vector<int> fds;
  for (int i = 0; i < kN; ++i) {
    fds.push_back(sendRequest("POST", "/v1/sandboxes/" + ids[i % ids.size()] + "/exec",
                              json{{"cmd", {"sleep", "3"}}}.dump()));
  }
  ASSERT_TRUE(waitFor([&] { return node_->execsInFlight() == kN; }, 20))
      << node_->execsInFlight() << " in flight";
  // A little slack: the pool's threads, and a batch or teardown worker, are
  // started on demand; nothing grows with the execs.
  EXPECT_LE(threadCount(), threadsBefore + 2) << "threads grew with the execs in flight";
  EXPECT_GE(server_->stats().deferredInFlight, kN);
  int ok = 0;
  for (int fd : fds) {
    std::string a = readAnswer(fd, 30);
    ok += a.find("HTTP/1.1 200") == 0 && a.find("\"exit_code\":0") != std::string::npos;
    ::close(fd);
  }
  EXPECT_EQ(ok, kN);
  EXPECT_EQ(node_->execsInFlight(), 0);
}

// A client that goes away cancels its exec on the node, streamed or not; a
// trajectory step runs on and its logged result answers the retry.
TEST_F(PlatformOverSim, AClientThatGoesAwayCancelsItsExec) {
  std::string id = create();
  ASSERT_FALSE(id.empty());
  for (bool stream : {false, true}) {
    int fd = sendRequest("POST", "/v1/sandboxes/" + id + "/exec",
                         json{{"cmd", {"sleep", "30"}}, {"stream", stream}}.dump());
    ASSERT_TRUE(waitFor([&] { return node_->execsInFlight() == 1; }, 10)) << stream;
    ::close(fd);
    EXPECT_TRUE(waitFor([&] { return node_->execsInFlight() == 0; }, 10))
        << "the exec outlived its client (stream " << stream << ")";
  }
  json step = {{"cmd", {"sleep", "1"}}, {"trajectory_id", "t-gone"}, {"step", 0}};
  int fd = sendRequest("POST", "/v1/sandboxes/" + id + "/exec", step.dump());
  ASSERT_TRUE(waitFor([&] { return node_->execsInFlight() == 1; }, 10));
  ::close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(node_->execsInFlight(), 1) << "a step must run to its end";
  ASSERT_TRUE(waitFor([&] { return node_->execsInFlight() == 0; }, 10));
  auto again = client_->request("POST", "/v1/sandboxes/" + id + "/exec", step.dump());
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(again->status, 200) << again->body;
  EXPECT_TRUE(json::parse(again->body).value("replayed", false)) << again->body;
}

}  // namespace
}  // namespace dsec::platform
