// `dsec edge`: a node daemon in its own process. EdgeAgent joins the
// platform, heartbeats, reports deaths and looks layers up through it, and
// serves the edge's internal API (docs/cluster.md) on behalf of an EdgeLink
// (the real Edge, or a SimEdge).
//
// Credentials: the join token is presented once, to POST /internal/v1/join;
// the per-node keys it returns are kept in <dataDir>/node.json (0600). Every
// call of the platform must carry the platform key (401 otherwise); every
// call to the platform carries the edge key. When the platform no longer
// knows the keys (401), the agent joins again if it has a join token.
//
// Thread-safety: handle() runs on many connection threads; the heartbeat
// runs on its own thread; mu_ guards the credentials and link_.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/http_client.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "edge/image/loader.h"
#include "edge/link_service.h"
#include "proto/edge_link.h"

namespace dsec::edge {

struct EdgeAgentOptions {
  // http://HOST:PORT, or several, comma-separated: the replicas of one
  // platform. Calls go to the one that last answered; one that cannot be
  // reached (connect or transport error) is skipped for the next.
  std::string platformUrl;
  std::string joinToken;    // needed for the first join (and a re-join)
  std::string dataDir;      // node.json lives here
  std::string name;         // node name, unique in the cluster
  std::string pool = "default";
  std::string url;  // where the platform reaches this edge
  double cpus = 0;
  int64_t memoryMb = 0;
  int64_t slots = 0;
  double heartbeatS = 1;
  double joinWaitS = 30;  // how long start() retries an unreachable platform
  // What GET /metrics renders: the agent adds its collector (this node's
  // figures only) when made and removes it when destroyed. Not owned; must
  // outlive the agent. Null: a registry of the agent's own, for several
  // agents in one process (`dsec edge --sim-nodes K`), each its own node.
  metrics::Registry* registry = nullptr;
};

class EdgeAgent {
 public:
  explicit EdgeAgent(EdgeAgentOptions opts);
  ~EdgeAgent();

  // Loads saved credentials, or joins. kUnauthenticated for a refused join
  // token; kUnavailable when the platform stays unreachable for joinWaitS.
  Status start();
  // The node the API serves; heartbeats begin. `ids` lists the sandboxes it
  // runs, `layers` its cached layers (null: none).
  void serveLink(proto::EdgeLink* link, std::function<std::vector<std::string>()> ids,
                 std::function<std::vector<std::string>()> layers);
  // Pre-staging (docs/cluster.md, node pools): the layers a heartbeat's
  // answer lists under "prestage" are handed to `stage` one at a time on a
  // thread of their own (NodeCache::prestage), each once per process unless
  // it failed (retried after kPrestageRetryS). Call before serveLink; none:
  // the list is ignored (a simulated node).
  void setPrestager(std::function<Status(const std::string& digest)> stage);
  // The edge's data dir (packs of pack_diff live under it).
  const std::string& dataDir() const { return opts_.dataDir; }
  static constexpr double kPrestageRetryS = 30;
  void stop();

  // GET /edge/v1/link (the platform's link, upgraded and handed to the
  // LinkService), the JSON calls of /edge/v1/... on HTTP (platform-key
  // authenticated: list, create, destroy, bulk create and destroy), and GET
  // /metrics.
  void handle(http::Request& req, http::Response& res);
  // This node's figures (dsec_edge_*): its collector in the registry.
  void writeMetrics(metrics::Writer& w);
  // For EdgeOptions::lookup: asks the platform what layer `digest` is.
  Result<LayerDesc> lookupLayer(const std::string& digest);
  // Tells the platform a sandbox died on its own (best effort, retried once).
  void reportDeath(const std::string& id, const std::string& why);

 private:
  Status join();
  Status loadCredentials();
  // A call to the platform with the edge key; kUnauthenticated on 401.
  Result<std::string> platformCall(const std::string& method, const std::string& target,
                                   const std::string& body);
  // One request to the platform with `key`, failing over between the
  // replicas' URLs; kUnavailable when none can be reached.
  Result<http::ClientResponse> send(const std::string& key, const std::string& method,
                                    const std::string& target, const std::string& body,
                                    double readTimeoutS);
  void heartbeatLoop();
  Status heartbeatOnce();
  void route(http::Request& req, http::Response& res, LinkService* service);
  // Queues what a heartbeat answer asks to pre-stage.
  void queuePrestage(const std::vector<std::string>& digests);
  void prestageLoop();

  EdgeAgentOptions opts_;
  std::string bootId_;
  // Heartbeat deltas (docs/cluster.md): the token of the platform's last
  // answer (empty: send the full list) and the ids that heartbeat carried,
  // against which the next one sends only what was added. Heartbeat thread only.
  std::string hbToken_;
  std::unordered_set<std::string> hbBase_;
  std::vector<std::string> urls_;  // the platform's replicas
  std::atomic<size_t> current_{0};  // index into urls_ of the one that last answered
  mutable std::mutex mu_;  // guards node_, edgeKey_, platformKey_, link_, layers_, stopping_
  std::string node_, edgeKey_, platformKey_;
  proto::EdgeLink* link_ = nullptr;
  std::function<std::vector<std::string>()> ids_;  // set before the heartbeats start
  std::function<std::vector<std::string>()> layers_;
  bool stopping_ = false;
  std::condition_variable cv_;
  std::thread hbThread_;
  // Pre-staging; guarded by mu_.
  std::function<Status(const std::string&)> stage_;
  std::deque<std::string> stageQueue_;
  std::set<std::string> staged_, stageQueued_;
  std::map<std::string, double> stageFailedAt_;
  std::thread stageThread_;
  std::atomic<uint64_t> stagedCount_{0}, stageFailures_{0};
  // Metrics.
  std::atomic<uint64_t> refused_{0}, hbFailures_{0};
  // The platform's link and the node's calls; set by serveLink (mu_).
  std::unique_ptr<LinkService> service_;
  std::unique_ptr<metrics::Registry> ownRegistry_;  // when opts_.registry is null
  metrics::Registry* registry_;                     // opts_.registry or ownRegistry_
  uint64_t metricsId_;                              // the collector in registry_
};

}  // namespace dsec::edge
