// GET /v1/node and GET /v1/metrics: what the node's layer cache and loader
// did, per layer and in total.
#include <nlohmann/json.hpp>
#include <string_view>

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
// A Prometheus label value: backslash, quote and newline escaped.
std::string labelValue(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// The fncall one-shot pools (docs/fncall.md, POST /v1/run).
void appendRunPoolMetrics(const RunPoolStats& s, std::string& out) {
  auto family = [&out](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  family("dsec_fncall_pools", "gauge", "fncall one-shot pools (one per image and language).");
  out += "dsec_fncall_pools " + std::to_string(s.pools.size()) + "\n";
  family("dsec_fncall_pool_max_sandboxes", "gauge",
         "Bound on the node's fncall pool sandboxes, all pools together (--fncall-pool-max).");
  out += "dsec_fncall_pool_max_sandboxes " + std::to_string(s.maxSandboxes) + "\n";
  family("dsec_fncall_pool_sandboxes", "gauge",
         "fncall pool sandboxes (warm workers) by pool and state: idle, or busy serving a call.");
  for (auto& [key, c] : s.pools) {
    std::string pool = labelValue(key);
    out += "dsec_fncall_pool_sandboxes{pool=\"" + pool + "\",state=\"idle\"} " +
           std::to_string(c.idle) + "\n";
    out += "dsec_fncall_pool_sandboxes{pool=\"" + pool + "\",state=\"busy\"} " +
           std::to_string(c.busy) + "\n";
  }
  family("dsec_fncall_node_sandboxes", "gauge",
         "fncall pool sandboxes of the node by state (busy includes ones being created).");
  out += "dsec_fncall_node_sandboxes{state=\"idle\"} " + std::to_string(s.idle) + "\n";
  out += "dsec_fncall_node_sandboxes{state=\"busy\"} " + std::to_string(s.busy) + "\n";
  family("dsec_fncall_pool_sandboxes_created_total", "counter", "fncall pool sandboxes created.");
  out += "dsec_fncall_pool_sandboxes_created_total " + std::to_string(s.created) + "\n";
  family("dsec_fncall_pool_sandboxes_grown_total", "counter",
         "fncall pool sandboxes created ahead of demand: a pool whose calls came back to back "
         "grew to two, so that each call finds a sandbox ready.");
  out += "dsec_fncall_pool_sandboxes_grown_total " + std::to_string(s.grown) + "\n";
  family("dsec_fncall_pool_sandboxes_destroyed_total", "counter",
         "fncall pool sandboxes destroyed (idle, recycled, retired, failed).");
  out += "dsec_fncall_pool_sandboxes_destroyed_total " + std::to_string(s.destroyed) + "\n";
  family("dsec_fncall_pool_sandboxes_replaced_total", "counter",
         "fncall pool sandboxes destroyed because a call failed on them.");
  out += "dsec_fncall_pool_sandboxes_replaced_total " + std::to_string(s.replaced) + "\n";
  family("dsec_fncall_zygote_restarts_total", "counter",
         "One-shot calls that started a python zygote first (the previous one died, was "
         "killed, or was retired after zygote_max_calls).");
  out += "dsec_fncall_zygote_restarts_total " + std::to_string(s.zygoteRestarts) + "\n";
  family("dsec_fncall_calls_total", "counter",
         "One-shot calls by result (ok: exit 0, exit: another exit code, signal, error: no "
         "result) and the limit that stopped them (none, timeout, cpu, memory, file_size, "
         "output).");
  for (auto& [k, n] : s.results) {
    out += "dsec_fncall_calls_total{result=\"" + labelValue(k.first) + "\",limit=\"" +
           labelValue(k.second) + "\"} " + std::to_string(n) + "\n";
  }
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
                 {"base", node.userns.base},
                 {"length", node.userns.length},
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
               {"egress",
                {{"available", node.egressUnavailable.empty()},
                 {"unavailable_reason", node.egressUnavailable},
                 {"tag", node.egressTag}}}};
  sendJson(res, 200, body.dump());
}

void Platform::getMetrics(http::Response& res) {
  // The cluster's (platform/cluster.cc) and the records' (platform_nodes.cc).
  std::string out = cluster_->extraMetrics() + sandboxStateMetrics();
  auto* local = cluster_->localNode();
  if (!local) return (void)res.send(200, "text/plain; version=0.0.4", out);
  const proto::NodeReport node = local->report();
  auto family = [&out](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  const auto& layers = node.layers;
  struct Metric {
    const char* name;
    const char* help;
    int64_t (*get)(const proto::LayerReport&);
  };
  const Metric metrics[] = {
      {"dsec_layer_bytes_fetched_total", "Bytes of layer data fetched from the blob store.",
       [](const proto::LayerReport& l) { return l.stats.bytesFetched; }},
      {"dsec_layer_chunks_fetched_total", "Chunks of layer data fetched from the blob store.",
       [](const proto::LayerReport& l) { return l.stats.chunksFetched; }},
      {"dsec_layer_cache_hits_total", "Reads served from chunks already in the node cache.",
       [](const proto::LayerReport& l) { return l.stats.cacheHits; }},
      {"dsec_layer_read_requests_total", "Reads of layer data that reached the loader.",
       [](const proto::LayerReport& l) { return l.stats.readRequests; }},
      {"dsec_layer_bytes_read", "Distinct bytes of layer data read (chunk granular).",
       [](const proto::LayerReport& l) { return l.stats.bytesRead; }},
      {"dsec_layer_chunks_prefetched_total", "Chunks fetched ahead by prefetch.",
       [](const proto::LayerReport& l) { return l.chunksPrefetched; }},
  };
  for (const Metric& m : metrics) {
    std::string_view name(m.name);
    bool counter = name.size() > 6 && name.substr(name.size() - 6) == "_total";
    family(m.name, counter ? "counter" : "gauge", m.help);
    for (auto& l : layers) {
      out += std::string(m.name) + "{layer=\"" + l.digest + "\"} " + std::to_string(m.get(l)) + "\n";
    }
  }
  family("dsec_node_cache_bytes", "gauge", "Bytes the node cache holds on disk.");
  out += "dsec_node_cache_bytes " + std::to_string(node.cacheUsedBytes) + "\n";
  family("dsec_node_cache_limit_bytes", "gauge", "Node cache size limit (0: none).");
  out += "dsec_node_cache_limit_bytes " + std::to_string(node.cacheLimitBytes) + "\n";
  // Only sandboxes that tried something: a scrape stays small on a node of
  // thousands of well-behaved ones.
  family("dsec_sandbox_egress_denied_total", "counter",
         "Connects and sends of a sandbox that its policy's egress filter refused.");
  for (auto& [id, n] : node.egressDenials) {
    out += "dsec_sandbox_egress_denied_total{sandbox=\"" + id + "\"} " + std::to_string(n) + "\n";
  }
  family("dsec_sandbox_syscalls_denied_total", "counter",
         "Syscalls of a sandbox that its seccomp profile refused (as of the agent's last report, "
         "at most 100 ms old).");
  for (auto& [id, n] : node.syscallDenials) {
    out += "dsec_sandbox_syscalls_denied_total{sandbox=\"" + id + "\"} " + std::to_string(n) + "\n";
  }
  family("dsec_orphans_removed_total", "counter",
         "Leftovers of earlier runs that no record owned, removed at start, by kind "
         "(sandbox: its processes, cgroups, mounts and directory; veth; loader process).");
  auto orphans = node.orphansRemoved;
  orphans["sandbox"] += orphanSandboxes_;
  for (const char* kind : {"sandbox", "veth"}) orphans[kind] += 0;  // always listed
  for (auto& [kind, n] : orphans) {
    out += "dsec_orphans_removed_total{kind=\"" + kind + "\"} " + std::to_string(n) + "\n";
  }
  family("dsec_sandboxes_readopted", "gauge",
         "Sandboxes of an earlier run (crashed or stopped with live restore) re-adopted at "
         "start and still running.");
  out += "dsec_sandboxes_readopted " + std::to_string(node.adopted.size()) + "\n";
  family("dsec_api_errors_total", "counter",
         "API calls answered with an error, by error code (quota_exceeded, rate_limited, ...).");
  for (auto& [code, n] : apiErrorCounts()) {
    out += "dsec_api_errors_total{code=\"" + code + "\"} " + std::to_string(n) + "\n";
  }
  if (runPool_) appendRunPoolMetrics(runPool_->stats(), out);
  (void)res.send(200, "text/plain; version=0.0.4", out);
}

}  // namespace dsec::platform
