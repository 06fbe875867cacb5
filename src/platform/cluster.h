// The platform's view of its nodes: a registry of edges (the in-process one of
// `dsec up`, and remote ones that joined), the scheduler that places each new
// sandbox on one of them, and the router that sends every later call on a
// sandbox to the node that holds it. The Platform drives it as one EdgeLink.
//
// Joining (docs/cluster.md): an edge presents the join token once
// (POST /internal/v1/join) and receives two per-node keys: the edge key, which
// authenticates its calls to the platform (heartbeats, events, layer lookups),
// and the platform key, which the platform's calls to the edge carry. Nodes
// persist in the Store (NodeRecord: the edge key only as its SHA-256, the
// platform key as is, since every replica must present it); a <data>/nodes.json
// of an older release is moved into the store once.
//
// Replicas: several platforms on one shared store (PostgreSQL) serve one
// cluster. Each follows the node registry in the store (a node that joined
// or heartbeats through another replica is known here within a monitor tick),
// and writes its heartbeats' times there. One replica at a time holds the
// store's "leader" lease; only the leader marks nodes down (a compare-and-set
// on the node's state, so no two replicas act on one silence), and a dead
// leader's lease expires after leaseTtlS so another takes over. Each replica
// also holds "replica:<id>", by which the leader knows it is alive.
//
// Liveness: an edge heartbeats its capacity, load, cached layers and running
// sandboxes. A remote node silent for heartbeatTimeoutS is marked down and its
// sandboxes are reported lost (setLostHandler); when it heartbeats again (or
// restarted: a new boot id), the two reconcile: sandboxes it still runs are
// reported found, ones it no longer has stay lost, and ones the platform no
// longer wants are destroyed by the edge (the heartbeat's answer lists them).
// A sandbox this replica has no placement for is looked up in the store
// before it is condemned: another replica may have just created it.
//
// Admission: each node takes at most maxInflightPerNode creations at a time;
// a create that finds no room waits (queued) up to admissionWaitS, then fails
// with kUnavailable (503) saying why.
//
// Thread-safety: all public methods are thread-safe; mu_ guards the registry
// and placements; node calls are made without it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/http_server.h"
#include "common/metrics.h"
#include "common/util.h"
#include "platform/remote_edge.h"
#include "proto/edge_link.h"
#include "platform/scheduler.h"
#include "platform/store.h"

namespace dsec::platform {

struct ClusterOptions {
  std::string dataDir;    // a nodes.json of an older release is migrated from here
  Store* store = nullptr; // required; not owned
  std::string replicaId;  // unique among the replicas on the store
  double leaseTtlS = 3;   // the leader and replica leases
  std::string joinTokenHash;  // hex SHA-256 of the join token; empty: no edge may join
  double heartbeatTimeoutS = 5;
  int maxInflightPerNode = 16;
  double admissionWaitS = 30;
  proto::LayerLookup lookup;  // answers the edges' layer lookups
  // Where burstable sandboxes go when their pool is busy (scheduler.h).
  BurstPolicy burst;
  // Layers the nodes of a pool pre-stage (docs/cluster.md): pool -> image
  // refs or layer digests, resolved to layer digests by resolveLayers. A
  // node's heartbeat answer lists those it does not report cached yet.
  std::map<std::string, std::vector<std::string>> prestage;
  std::function<Result<std::vector<std::string>>(const std::string& ref)> resolveLayers;
  // fncall sandboxes (docs/fncall.md): the languages calls may name besides
  // python and bash, and the calls a python zygote forks (0: aether's
  // default). Sent to whichever node a sandbox goes to, in its spec's
  // fncallInit, so that joined edges run calls as the platform's own node does.
  std::map<std::string, std::vector<std::string>> fncallLanguages;
  int64_t fncallZygoteMaxCalls = 0;
};

struct NodeCapacity {
  double cpus = 0;
  int64_t memoryMb = 0;
  int64_t slots = 0;
};

class Cluster : public proto::EdgeLink {
 public:
  // Moves an old <dataDir>/nodes.json into the store, loads the store's nodes
  // (those up await their first heartbeat) and starts the liveness monitor.
  // kFailedPrecondition when a live replica already holds opts.replicaId.
  static Result<std::unique_ptr<Cluster>> start(ClusterOptions opts);
  ~Cluster() override;

  // Whether this replica holds the leader lease (it runs the sweeps that must
  // run once per cluster: down-marking here, the janitor in Platform).
  bool isLeader() const { return leader_.load(); }
  const std::string& replicaId() const { return opts_.replicaId; }

  // The in-process node of `dsec up`: always up, reached directly; `report`
  // is what GET /v1/node shows of it.
  void addLocal(proto::EdgeLink* e, proto::LocalNode* report, const std::string& name,
                NodeCapacity cap);

  // POST /internal/v1/join, /internal/v1/nodes/{n}/heartbeat and /events,
  // GET /internal/v1/layers/{digest}: the edges' calls.
  void handleInternal(http::Request& req, http::Response& res);
  // GET /v1/nodes and /v1/nodes/{name} (the caller checked the API token).
  void handleNodes(http::Request& req, http::Response& res);

  // EdgeLink: each call goes to the sandbox's node (a sandbox this cluster
  // never placed: the local node, if any); the node's errors come back as
  // they are, kUnavailable when the node is down.
  void setDeathHandler(std::function<void(const std::string&, const std::string&)> h) override;
  // Called when the sandboxes of a node that stopped answering are lost
  // (lost = true), or found again when it returns (lost = false).
  void setLostHandler(std::function<void(const std::string&, bool, const std::string&)> h);
  // Places the sandbox (waiting for room, see above), then creates it there.
  Status create(proto::BackendKind backend, const proto::SandboxSpec& spec) override;
  // A batch worker's group: the first spec is placed as by create() (waiting
  // for room); the following ones of the same placement request go to the
  // same node while it has room and in-flight slots left, and all of those
  // are created with one call to that node (EdgeLink::createMany). An entry
  // left empty was not attempted (the caller queues it again). Reserved
  // specs (all or nothing) go one at a time: only the first is attempted.
  std::vector<std::optional<Status>> createGroup(proto::BackendKind backend,
                                                 const std::vector<proto::SandboxSpec>& specs);
  // Forgets the placement whatever the node says; a down node's copy is
  // destroyed when it returns. OK for a sandbox on a down node.
  Status destroy(const std::string& id) override;
  // destroy() of many: each node's share goes in calls of up to
  // kDestroyChunk ids (EdgeLink::destroyMany, one call to a remote node),
  // several nodes and chunks at once.
  std::vector<Status> destroyMany(const std::vector<std::string>& ids) override;
  static constexpr size_t kDestroyChunk = 256;
  std::shared_ptr<proto::ExecCall> startExec(const std::string& id, const proto::ExecSpec& spec,
                                             proto::ExecCallbacks cb) override;
  Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                             const proto::ByteSource& src) override;
  Status readFile(const std::string& id, const std::string& path,
                  const std::function<Status(std::optional<uint64_t>)>& onSize,
                  const proto::ByteSink& sink) override;
  Result<std::string> agentOp(const std::string& id, proto::AgentOp op,
                              const std::string& json) override;
  Result<proto::CgroupStats> stats(const std::string& id) override;
  Result<proto::StatsSeries> statsHistory(const std::string& id, double windowS) override;
  Status pause(const std::string& id, bool paused) override;
  Status hibernate(const std::string& id) override;
  Status setLimits(const std::string& id, const proto::CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) override;
  Result<proto::EgressDenials> egressDenials(const std::string& id) override;
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  // To the node that holds the sandbox (kUnavailable when it is down).
  // setPorts of a sandbox on no known node is fine (nothing to cut).
  Result<UniqueFd> openPort(const std::string& id, int port, uint64_t gen,
                            double connectTimeoutS = 10) override;
  Status setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) override;
  // Every node that is up drops its mount of the layer.
  Status evictLayer(const std::string& digest) override;
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const proto::InputAction& action) override;

  // The in-process node's report, if this process runs one (null otherwise).
  proto::LocalNode* localNode() const;
  // The fncall languages calls may name besides python and bash.
  const std::map<std::string, std::vector<std::string>>& fncallLanguages() const {
    return opts_.fncallLanguages;
  }
  // The node that holds sandbox `id` (the local node's name for one never
  // placed here; empty when there is none).
  std::string nodeOf(const std::string& id) const;
  // Tells the router that sandbox `id` (a record loaded at start) lives on
  // `node`, so its calls go there.
  void bindSandbox(const std::string& id, const std::string& node,
                   const proto::SandboxSpec& spec);
  // Forgets that placement (another platform replica ended the sandbox).
  void unbindSandbox(const std::string& id);
  // Whether `node` is another process's (its sandboxes outlive this one).
  bool isRemoteNode(const std::string& node) const;
  // Its figures for the platform's /metrics: nodes, pools, the scheduling
  // queue, creations and their latency. Every family is listed, empty or not.
  // Takes mu_.
  void writeMetrics(metrics::Writer& w);
  // All-or-nothing placement (POST /v1/batches): places every id of `ids`
  // with `r` now, ignoring the in-flight bound, and holds the room for them
  // until each is created (create() then uses that node) or destroyed. If
  // not all fit, reserves nothing: kResourceExhausted saying how many fit, or
  // kFailedPrecondition (field pool) when no node of the pool is up.
  Status reserve(const std::vector<std::string>& ids, const PlacementRequest& r);
  // Gives back the reservations of `ids` whose creation never started.
  void release(const std::vector<std::string>& ids);

 private:
  struct Node {
    std::string name;
    std::string pool = "default";
    bool local = false;
    proto::EdgeLink* link = nullptr;     // local_ or remote->get()
    std::unique_ptr<RemoteEdge> remote;  // remote nodes
    std::string url, edgeKeyHash, platformKey;
    double joinedAt = 0;
    double lastStored = 0;  // when this replica last wrote its heartbeat to the store
    std::string bootId;  // of the edge process last heard
    bool up = true;
    bool reconciled = false;  // since it (re)appeared
    double lastHeartbeat = 0;
    NodeCapacity cap;
    std::set<std::string> layers;
    int inflight = 0;
    double loadavg = 0;    // its host's 1-minute load average (last heartbeat)
    int64_t reported = 0;  // sandboxes it said it runs
    // Heartbeat deltas (heartbeat()): the token of the list this replica
    // last acknowledged (empty: the next heartbeat must carry a full list),
    // and when the last full list came.
    std::string hbToken;
    double lastFull = 0;
    std::set<std::string> recheck;  // ids it runs that no heartbeat could decide on yet
    uint64_t creates = 0, createErrors = 0;
    // What the placements on it hold, kept as they change so a placement
    // costs O(nodes), not O(sandboxes): cpu, memory, tenants (placed and
    // creating) and sandboxes (placed, not creating: those are `inflight`).
    double cpuUsed = 0;
    int64_t memoryUsedMb = 0;
    int64_t sandboxes = 0;
    std::map<std::string, int64_t> tenants;
  };
  struct Placed {
    std::string node;
    double cpu = 0;
    int64_t memoryMb = 0;
    std::string tenant;
    bool reserved = false;  // by reserve(), not yet being created
  };
  // placed_/creating_ changes that keep the nodes' sums above; mu_ held.
  void placeLocked(const std::string& id, Placed p, bool creating);
  void beginCreateLocked(const std::string& id);
  void settleLocked(const std::string& id);
  void unplaceLocked(const std::string& id);

  explicit Cluster(ClusterOptions opts);
  static PlacementRequest requestFor(const proto::SandboxSpec& spec);
  // Waits (up to admissionWaitS) for a node with room for `spec` and starts
  // its creation there (startLocked); kUnavailable saying why when none.
  Result<Node*> admitLocked(std::unique_lock<std::mutex>& lk, const proto::SandboxSpec& spec,
                            const PlacementRequest& pr, double t0);
  // A creation placed on `node` begins (in flight, latency counted) / ended.
  void startLocked(Node& node, const proto::SandboxSpec& spec, double t0, bool reserved);
  void finishLocked(Node& node, const std::string& id, const Status& st);
  // The node of sandbox `id`, or kNotFound / kUnavailable (down) for calls.
  Result<proto::EdgeLink*> route(const std::string& id) const;
  proto::EdgeLink* localLink() const;
  // The scheduler's views of the nodes: copies (for reserve(), which changes
  // them, and the API), or placementViewsLocked(): viewBuf_ refilled in place
  // with the sets by reference, for one pick under mu_.
  std::vector<NodeView> viewsLocked() const;
  const std::vector<NodeView>& placementViewsLocked();
  void fillView(NodeView& x, const Node& n, bool shallow) const;
  NodeRecord recordLocked(const Node& n) const;
  Status migrateNodesJson();
  // Follows the store's node registry (nodes that joined, re-joined, went
  // down or came back through other replicas). Called without mu_.
  Status syncNodes();
  // syncNodes() unless one ran within the last 200 ms (an unknown node or key).
  void syncNodesSoon();
  // `spec` with, for a fncall sandbox, the init frame's "fncall" object of
  // this platform's configuration (ClusterOptions::fncallLanguages...).
  proto::SandboxSpec withFncallInit(proto::BackendKind backend,
                                    const proto::SandboxSpec& spec) const;
  void renewLeases();
  void monitor();
  void join(http::Request& req, http::Response& res);
  void heartbeat(const std::string& name, http::Request& req, http::Response& res);
  void event(const std::string& name, http::Request& req, http::Response& res);
  // The node `name` if the request carries its edge key; else answers 401/404.
  Node* authNodeLocked(const std::string& name, http::Request& req, http::Response& res);
  // authNodeLocked after a registry sync when the node or key is not known yet
  // (it joined through another replica); true when authenticated.
  bool authNode(const std::string& name, http::Request& req, http::Response& res);

  ClusterOptions opts_;
  Scheduler sched_;
  mutable std::mutex mu_;           // guards nodes_, placed_, creating_, stopping_, counters below
  std::condition_variable roomCv_;  // a creation ended or a node changed: room may be free
  std::map<std::string, std::unique_ptr<Node>> nodes_;  // never erased: pointers stay valid
  std::unordered_map<std::string, Placed> placed_;  // hashed: looked up per heartbeat id
  std::vector<NodeView> viewBuf_;  // placementViewsLocked()
  // Heartbeat tokens: this process's random prefix and a serial (mu_).
  std::string hbPrefix_ = randomHex(4) + "-";
  uint64_t hbSerial_ = 0;
  static constexpr double kFullListEveryS = 15;
  std::unordered_set<std::string> creating_;
  std::string localName_;
  proto::LocalNode* localNode_ = nullptr;  // set by addLocal, before any call
  bool stopping_ = false;
  int queued_ = 0;
  uint64_t creations_ = 0;
  std::map<std::string, uint64_t> createErrors_;  // by code
  std::map<std::string, uint64_t> bursts_;        // by the pool asked for
  // The layers nodes of `pool` pre-stage (opts_.prestage, resolved; cached
  // for kPrestageRefreshS). Takes prestageMu_, not mu_ (it reads the store).
  std::vector<std::string> prestageFor(const std::string& pool);
  static constexpr double kPrestageRefreshS = 5;
  std::mutex prestageMu_;  // guards prestageCache_
  std::map<std::string, std::pair<std::vector<std::string>, double>> prestageCache_;
  // From a create's arrival to its placement, in seconds.
  metrics::Histogram schedLatency_{
      {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  std::function<void(const std::string&, const std::string&)> onDeath_;
  std::function<void(const std::string&, bool, const std::string&)> onLost_;
  std::condition_variable monitorCv_;
  std::thread monitorThread_;
  std::string holder_;  // "<replica id>/<random>": this process, in the leases
  std::atomic<bool> leader_{false};
  std::atomic<double> lastNodeSync_{0};
  double lastLease_ = 0;  // monitor thread only
};

// Counts an API error by code (for dsec_api_errors_total); cheap, lock-free.
// One counter for the whole process: every path that answers an API call
// with an error (the Platform's sendError, the cluster's own routes) counts
// here, once.
void countApiError(Code code);
// dsec_api_errors_total, every code listed. The process's counter: written
// by one collector of a registry (the Platform's), or its samples repeat.
void writeApiErrorMetrics(metrics::Writer& w);

}  // namespace dsec::platform
