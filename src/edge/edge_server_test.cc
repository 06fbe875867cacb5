// EdgeAgent's GET /metrics: each agent renders its own node's figures, so the
// K simulated nodes of one process (`dsec edge --sim-nodes K`) each have a
// /metrics of their own; an agent given a registry writes into that one.
#include "edge/edge_server.h"

#include <gtest/gtest.h>

#include <thread>

#include "common/http_client.h"

namespace dsec::edge {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// An agent (never started: no platform) served on a port of its own.
class ServedAgent {
 public:
  explicit ServedAgent(EdgeAgentOptions o) : agent_(std::move(o)), server_(serverOptions()) {
    EXPECT_TRUE(server_.listen().isOk());
    thread_ = std::thread([this] {
      server_.serve([this](http::Request& req, http::Response& res) { agent_.handle(req, res); });
    });
  }
  ~ServedAgent() {
    server_.stop();
    thread_.join();
  }
  // GET `path` without a key: its status and body.
  std::pair<int, std::string> get(const std::string& path) {
    auto c = http::Client::connect("http://127.0.0.1:" + std::to_string(server_.port()), "");
    if (!c.isOk()) return {0, c.status().toString()};
    auto r = (*c)->request("GET", path);
    if (!r.isOk()) return {0, r.status().toString()};
    return {r->status, r->body};
  }

 private:
  static http::ServerOptions serverOptions() {
    http::ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    return o;
  }
  EdgeAgent agent_;
  http::Server server_;
  std::thread thread_;
};

EdgeAgentOptions options(int64_t slots) {
  EdgeAgentOptions o;
  o.platformUrl = "http://127.0.0.1:1";
  o.name = "n" + std::to_string(slots);
  o.slots = slots;
  return o;
}

TEST(EdgeAgentMetrics, EachAgentOfAProcessShowsItsOwnNode) {
  ServedAgent a(options(3)), b(options(5));
  // Two calls without the platform key, both to a.
  EXPECT_EQ(a.get("/edge/v1/sandboxes").first, 401);
  EXPECT_EQ(a.get("/edge/v1/sandboxes").first, 401);
  auto [sa, ma] = a.get("/metrics");
  auto [sb, mb] = b.get("/metrics");
  ASSERT_EQ(sa, 200) << ma;
  ASSERT_EQ(sb, 200) << mb;
  for (const std::string* m : {&ma, &mb}) {
    EXPECT_EQ(count(*m, "# TYPE dsec_edge_capacity_slots gauge\n"), 1u) << *m;
    EXPECT_EQ(count(*m, "\ndsec_edge_capacity_slots "), 1u) << *m;
    EXPECT_EQ(count(*m, "# TYPE dsec_edge_errors_total counter\n"), 1u) << *m;  // listed empty
    EXPECT_NE(m->find("\ndsec_edge_sandboxes 0\n"), std::string::npos) << *m;
  }
  EXPECT_NE(ma.find("\ndsec_edge_capacity_slots 3\n"), std::string::npos) << ma;
  EXPECT_NE(mb.find("\ndsec_edge_capacity_slots 5\n"), std::string::npos) << mb;
  EXPECT_NE(ma.find("\ndsec_edge_unauthenticated_total 2\n"), std::string::npos) << ma;
  EXPECT_NE(mb.find("\ndsec_edge_unauthenticated_total 0\n"), std::string::npos) << mb;
}

TEST(EdgeAgentMetrics, AGivenRegistryHoldsTheAgentWhileItLives) {
  metrics::Registry r;
  r.add([](metrics::Writer& w) { w.gauge("dsec_other", "Another part of the process.", 1); });
  {
    EdgeAgentOptions o = options(7);
    o.registry = &r;
    EdgeAgent agent(o);
    std::string text = r.render();
    EXPECT_NE(text.find("\ndsec_edge_capacity_slots 7\n"), std::string::npos) << text;
    EXPECT_NE(text.find("dsec_other 1\n"), std::string::npos) << text;
  }
  EXPECT_EQ(r.render().find("dsec_edge_"), std::string::npos);
}

}  // namespace
}  // namespace dsec::edge
