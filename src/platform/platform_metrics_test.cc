// What the platform's collector writes (GET /v1/metrics): the cluster's
// figures over a simulated node, the API error counter, the in-process
// node's. Each family is announced once, and those listed when empty stay so.
#include <gtest/gtest.h>

#include <regex>
#include <set>

#include "common/util.h"
#include "platform/cluster.h"
#include "platform/platform.h"
#include "proto/sim_edge.h"

namespace dsec::platform {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

bool has(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

// Every "# TYPE" line names a family of its own.
void expectFamiliesOnce(const std::string& text) {
  std::set<std::string> seen;
  std::regex type("^# TYPE (\\S+) ", std::regex::multiline);
  for (std::sregex_iterator it(text.begin(), text.end(), type), end; it != end; ++it) {
    EXPECT_TRUE(seen.insert((*it)[1]).second) << "announced twice: " << (*it)[1] << "\n" << text;
  }
  EXPECT_EQ(count(text, "# HELP "), seen.size()) << text;
}

class ClusterMetrics : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dsec-metrics-test-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_).isOk());
    auto store = SqliteStore::open(dir_ + "/state.db");
    ASSERT_TRUE(store.isOk()) << store.status().toString();
    store_ = std::move(*store);
    ClusterOptions o;
    o.dataDir = dir_;
    o.store = store_.get();
    o.replicaId = "r-test";
    o.admissionWaitS = 1;
    auto c = Cluster::start(o);
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    cluster_ = std::move(*c);
  }
  void TearDown() override {
    cluster_.reset();
    store_.reset();
    (void)removeTree(dir_);
  }
  std::string render() {
    metrics::Writer w;
    cluster_->writeMetrics(w);
    return w.text();
  }

  std::string dir_;
  std::unique_ptr<SqliteStore> store_;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(ClusterMetrics, FamiliesAreListedWithoutNodes) {
  std::string text = render();
  expectFamiliesOnce(text);
  for (const char* family :
       {"dsec_node_up gauge", "dsec_node_sandboxes gauge", "dsec_node_loadavg_1m gauge",
        "dsec_pool_utilization gauge", "dsec_sandbox_bursts_total counter",
        "dsec_sandbox_create_errors_total counter", "dsec_schedule_latency_seconds histogram"}) {
    EXPECT_TRUE(has(text, std::string("# TYPE ") + family)) << family << "\n" << text;
  }
  EXPECT_TRUE(has(text, "dsec_schedule_queue_depth 0")) << text;
  EXPECT_TRUE(has(text, "dsec_sandbox_creations_total 0")) << text;
  EXPECT_TRUE(has(text, "dsec_schedule_latency_seconds_bucket{le=\"+Inf\"} 0")) << text;
}

TEST_F(ClusterMetrics, ACreationIsCountedPlacedAndTimed) {
  proto::SimEdge sim(proto::SimOptions{});
  cluster_->addLocal(&sim, nullptr, "n0", NodeCapacity{4, 4096, 10});
  proto::SandboxSpec spec;
  spec.id = "sb-" + randomHex(8);
  spec.cpu = 1.5;
  ASSERT_TRUE(cluster_->create(proto::BackendKind::kContainer, spec).isOk());
  proto::SandboxSpec big = spec;
  big.id = "sb-" + randomHex(8);
  big.cpu = 100;  // more than any node offers: refused after admissionWaitS
  EXPECT_EQ(cluster_->create(proto::BackendKind::kContainer, big).code(), Code::kUnavailable);

  std::string text = render();
  expectFamiliesOnce(text);
  EXPECT_TRUE(has(text, "dsec_node_up{node=\"n0\",pool=\"default\"} 1")) << text;
  EXPECT_TRUE(has(text, "dsec_node_sandboxes{node=\"n0\"} 1")) << text;
  EXPECT_TRUE(has(text, "dsec_node_cpu_allocated{node=\"n0\"} 1.5")) << text;
  EXPECT_TRUE(has(text, "dsec_node_memory_allocated_bytes{node=\"n0\"} 536870912")) << text;
  EXPECT_TRUE(has(text, "dsec_pool_utilization{pool=\"default\"} 0.375")) << text;
  EXPECT_TRUE(has(text, "dsec_sandbox_creations_total 1")) << text;
  EXPECT_TRUE(has(text, "dsec_sandbox_create_errors_total{code=\"unavailable\"} 1")) << text;
  // The local node sends no heartbeats: no load average of it.
  EXPECT_EQ(count(text, "dsec_node_loadavg_1m{"), 0u) << text;
  // One placement timed (the refused create was never placed).
  EXPECT_TRUE(has(text, "dsec_schedule_latency_seconds_bucket{le=\"+Inf\"} 1")) << text;
  EXPECT_TRUE(has(text, "dsec_schedule_latency_seconds_bucket{le=\"30\"} 1")) << text;
  EXPECT_TRUE(has(text, "dsec_schedule_latency_seconds_count 1")) << text;
  (void)cluster_->destroy(spec.id);
}

// The process's one API error counter: every code listed, counted once.
TEST(ApiErrorMetrics, EveryCodeIsListedInOneFamily) {
  auto value = [](const std::string& code) {
    metrics::Writer w;
    writeApiErrorMetrics(w);
    std::smatch m;
    std::string text = w.text();
    std::regex re("dsec_api_errors_total\\{code=\"" + code + "\"\\} (\\d+)\n");
    return std::regex_search(text, m, re) ? std::stoll(m[1]) : -1;
  };
  int64_t limited = value("rate_limited"), missing = value("not_found");
  ASSERT_GE(limited, 0);
  countApiError(Code::kRateLimited);
  countApiError(Code::kRateLimited);
  countApiError(Code::kNotFound);
  EXPECT_EQ(value("rate_limited"), limited + 2);
  EXPECT_EQ(value("not_found"), missing + 1);

  metrics::Writer w;
  writeApiErrorMetrics(w);
  std::string text = w.text();
  expectFamiliesOnce(text);
  EXPECT_EQ(count(text, "dsec_api_errors_total{"), size_t(Code::kRateLimited)) << text;
  EXPECT_EQ(count(text, "code=\"ok\""), 0u);
  EXPECT_EQ(count(text, "code=\"internal\""), 1u);
}

TEST(NodeMetrics, LayersCacheDenialsAndLeftovers) {
  proto::NodeReport node;
  proto::LayerReport l;
  l.digest = "sha256:aa";
  l.stats.bytesFetched = 4096;
  l.stats.bytesRead = 8192;
  l.chunksPrefetched = 3;
  node.layers.push_back(l);
  node.cacheUsedBytes = 1 << 20;
  node.syscallDenials["sb-1"] = 7;
  node.orphansRemoved["loader"] = 1;
  node.adopted = {"sb-2", "sb-3"};
  metrics::Writer w;
  writeNodeMetrics(node, 2, w);
  std::string text = w.text();
  expectFamiliesOnce(text);
  EXPECT_TRUE(has(text, "# TYPE dsec_layer_bytes_fetched_total counter")) << text;
  EXPECT_TRUE(has(text, "# TYPE dsec_layer_bytes_read gauge")) << text;
  EXPECT_TRUE(has(text, "dsec_layer_bytes_fetched_total{layer=\"sha256:aa\"} 4096")) << text;
  EXPECT_TRUE(has(text, "dsec_layer_bytes_read{layer=\"sha256:aa\"} 8192")) << text;
  EXPECT_TRUE(has(text, "dsec_layer_chunks_prefetched_total{layer=\"sha256:aa\"} 3")) << text;
  EXPECT_TRUE(has(text, "dsec_node_cache_bytes 1048576")) << text;
  EXPECT_TRUE(has(text, "dsec_node_cache_limit_bytes 0")) << text;
  // Listed though no sandbox was refused a connect.
  EXPECT_TRUE(has(text, "# TYPE dsec_sandbox_egress_denied_total counter")) << text;
  EXPECT_EQ(count(text, "dsec_sandbox_egress_denied_total{"), 0u) << text;
  EXPECT_TRUE(has(text, "dsec_sandbox_syscalls_denied_total{sandbox=\"sb-1\"} 7")) << text;
  // The platform's own count of orphan sandboxes adds to the node's; sandbox
  // and veth are always listed.
  EXPECT_TRUE(has(text, "dsec_orphans_removed_total{kind=\"loader\"} 1")) << text;
  EXPECT_TRUE(has(text, "dsec_orphans_removed_total{kind=\"sandbox\"} 2")) << text;
  EXPECT_TRUE(has(text, "dsec_orphans_removed_total{kind=\"veth\"} 0")) << text;
  EXPECT_TRUE(has(text, "dsec_sandboxes_readopted 2")) << text;
}

}  // namespace
}  // namespace dsec::platform
