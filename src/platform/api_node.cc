// GET /v1/node: what the node's layer cache and loader did, per layer and in
// total. GET /v1/metrics: the registry holding the platform's collector,
// which writes the cluster's figures, the node's and the run pool's.
#include <nlohmann/json.hpp>
#include <string_view>

#include "common/mountinfo.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {
json layerJson(const proto::LayerReport& l) {
  const auto& s = l.stats;
  return {{"digest", l.digest},
          {"data_digest", l.dataDigest.empty() ? json(nullptr) : json(l.dataDigest)},
          {"data_size", l.dataSize},
          {"attached", l.attached},
          {"chunks", s.chunks},
          {"chunks_cached", s.chunksCached},
          {"chunks_fetched", s.chunksFetched},
          {"chunks_prefetched", l.chunksPrefetched},
          {"bytes_fetched", s.bytesFetched},
          {"cache_hits", s.cacheHits},
          {"read_requests", s.readRequests},
          {"bytes_read", s.bytesRead}};
}
}  // namespace

void Platform::getNode(http::Response& res) {
  auto* local = cluster_->localNode();
  if (!local) {  // a platform without an in-process node
    return sendError(res, notFound("this platform runs no node of its own; see GET /v1/nodes"));
  }
  const proto::NodeReport node = local->report();
  json layers = json::array();
  json totals = {{"chunks_fetched", 0}, {"bytes_fetched", 0}, {"cache_hits", 0},
                 {"read_requests", 0}, {"bytes_read", 0}, {"chunks_prefetched", 0}};
  for (auto& l : node.layers) {
    json j = layerJson(l);
    for (auto& [k, v] : totals.items()) v = v.get<int64_t>() + j[k].get<int64_t>();
    layers.push_back(std::move(j));
  }
  json body = {{"loader", node.loader},
               {"blob_store", node.blobStore},
               {"loader_pids", node.loaderPids},
               {"cache", {{"used_bytes", node.cacheUsedBytes}, {"limit_bytes", node.cacheLimitBytes}}},
               {"totals", totals},
               {"layers", layers},
               {"userns",
                {{"enabled", node.userns.enabled},
                 {"length", node.userns.length},
                 {"window", {{"first", node.userns.windowFirst}, {"last", node.userns.windowLast}}},
                 {"ranges",
                  {{"capacity", node.userns.capacity},
                   {"in_use", node.userns.inUse},
                   {"sandboxes", node.userns.sandboxes},
                   {"spares", node.userns.spares},
                   {"free", node.userns.capacity - node.userns.inUse}}},
                 {"reason", node.userns.reason}}},
               {"backends",
                {{"container", {{"available", true}, {"accelerator", nullptr}, {"reason", ""}}},
                 {"microvm",
                  {{"available", node.microvm.available},
                   {"accelerator", node.microvm.accelerator.empty()
                                       ? json(nullptr)
                                       : json(node.microvm.accelerator)},
                   {"reason", node.microvm.reason},
                   {"agent_channel", node.microvm.agentChannel.empty()
                                         ? json(nullptr)
                                         : json(node.microvm.agentChannel)},
                   {"vhost_vsock", node.microvm.vhostVsock}}},
                 {"vm",
                  {{"available", node.vm.available},
                   {"accelerator", node.vm.accelerator.empty() ? json(nullptr)
                                                                   : json(node.vm.accelerator)},
                   {"reason", node.vm.reason}}}}},
               // The node runs in this process: its mount namespace is ours. It
               // holds O(1) mounts per node (host, layers, pools), never one
               // per sandbox (issue 30; docs/container-backend.md).
               {"edge_mounts", mountCount()},
               {"egress",
                {{"available", node.egressUnavailable.empty()},
                 {"unavailable_reason", node.egressUnavailable},
                 {"tag", node.egressTag}}}};
  sendJson(res, 200, body.dump());
}

void Platform::getMetrics(http::Response& res) {
  (void)res.send(200, "text/plain; version=0.0.4", opts_.registry->render());
}

void Platform::writeMetrics(metrics::Writer& w) {
  cluster_->writeMetrics(w);
  writeApiErrorMetrics(w);
  writeSandboxStateMetrics(w);
  if (auto* local = cluster_->localNode()) writeNodeMetrics(local->report(), orphanSandboxes_, w);
  if (runPool_) runPool_->writeMetrics(w);
  writeImageMetrics(w);
  writePortMetrics(w);
}

void writeNodeMetrics(const proto::NodeReport& node, int orphanSandboxes, metrics::Writer& w) {
  using metrics::Type;
  struct PerLayer {
    const char* name;
    Type type;
    const char* help;
    int64_t (*get)(const proto::LayerReport&);
  };
  const PerLayer perLayer[] = {
      {"dsec_layer_bytes_fetched_total", Type::kCounter,
       "Bytes of layer data fetched from the blob store.",
       [](const proto::LayerReport& l) { return l.stats.bytesFetched; }},
      {"dsec_layer_chunks_fetched_total", Type::kCounter,
       "Chunks of layer data fetched from the blob store.",
       [](const proto::LayerReport& l) { return l.stats.chunksFetched; }},
      {"dsec_layer_cache_hits_total", Type::kCounter,
       "Reads served from chunks already in the node cache.",
       [](const proto::LayerReport& l) { return l.stats.cacheHits; }},
      {"dsec_layer_read_requests_total", Type::kCounter,
       "Reads of layer data that reached the loader.",
       [](const proto::LayerReport& l) { return l.stats.readRequests; }},
      {"dsec_layer_bytes_read", Type::kGauge, "Distinct bytes of layer data read (chunk granular).",
       [](const proto::LayerReport& l) { return l.stats.bytesRead; }},
      {"dsec_layer_chunks_prefetched_total", Type::kCounter, "Chunks fetched ahead by prefetch.",
       [](const proto::LayerReport& l) { return l.chunksPrefetched; }},
  };
  for (const PerLayer& m : perLayer) {
    w.declare(m.name, m.type, m.help);
    for (auto& l : node.layers) {
      metrics::Labels labels = {{"layer", l.digest}};
      if (m.type == Type::kCounter) {
        w.counter(m.name, m.help, double(m.get(l)), labels);
      } else {
        w.gauge(m.name, m.help, double(m.get(l)), labels);
      }
    }
  }
  w.gauge("dsec_edge_mounts",
          "Mounts in the node's (this process's) mount namespace, which every new sandbox's "
          "namespace is copied from: constant as sandboxes are added.",
          double(mountCount()));
  if (node.userns.enabled) {
    const char* rh =
        "Host id ranges for container sandboxes' user namespaces (one per sandbox, issue 31), "
        "by state: capacity of the node's window, in use (sandboxes live or being torn down, "
        "and spare agents), free.";
    w.declare("dsec_userns_ranges", Type::kGauge, rh);
    w.gauge("dsec_userns_ranges", rh, double(node.userns.capacity), {{"state", "capacity"}});
    w.gauge("dsec_userns_ranges", rh, double(node.userns.inUse), {{"state", "in_use"}});
    w.gauge("dsec_userns_ranges", rh, double(node.userns.capacity - node.userns.inUse),
            {{"state", "free"}});
  }
  w.gauge("dsec_node_cache_bytes", "Bytes the node cache holds on disk.",
          double(node.cacheUsedBytes));
  w.gauge("dsec_node_cache_limit_bytes", "Node cache size limit (0: none).",
          double(node.cacheLimitBytes));
  // Only sandboxes that tried something: a scrape stays small on a node of
  // thousands of well-behaved ones.
  const char* help = "Connects and sends of a sandbox that its policy's egress filter refused.";
  w.declare("dsec_sandbox_egress_denied_total", Type::kCounter, help);
  for (auto& [id, n] : node.egressDenials) {
    w.counter("dsec_sandbox_egress_denied_total", help, double(n), {{"sandbox", id}});
  }
  help =
      "Syscalls of a sandbox that its seccomp profile refused (as of the agent's last report, "
      "at most 100 ms old).";
  w.declare("dsec_sandbox_syscalls_denied_total", Type::kCounter, help);
  for (auto& [id, n] : node.syscallDenials) {
    w.counter("dsec_sandbox_syscalls_denied_total", help, double(n), {{"sandbox", id}});
  }
  auto orphans = node.orphansRemoved;
  orphans["sandbox"] += orphanSandboxes;
  for (const char* kind : {"sandbox", "veth"}) orphans[kind] += 0;  // always listed
  for (auto& [kind, n] : orphans) {
    w.counter("dsec_orphans_removed_total",
              "Leftovers of earlier runs that no record owned, removed at start, by kind "
              "(sandbox: its processes, cgroups, mounts and directory; veth; loader process).",
              double(n), {{"kind", kind}});
  }
  w.gauge("dsec_sandboxes_readopted",
          "Sandboxes of an earlier run (crashed or stopped with live restore) re-adopted at "
          "start and still running.",
          double(node.adopted.size()));
}

}  // namespace dsec::platform
