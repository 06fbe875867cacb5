// The edge's end of the platform-edge link (docs/cluster.md, "The link"):
// serves the calls the platform makes over its one multiplexed connection
// (proto/link.h) on a node's EdgeLink (the real Edge, or a SimEdge).
//
// Calls (method, JSON args -> reply; "body" = link data frames):
//   create {backend, spec} -> {}            create_many {backend, specs} -> {results}
//   destroy {id} -> {}                      destroy_many {ids} -> {results}
//   list {} -> {sandboxes}                  agent_op {id, op, json} -> the agent's JSON
//   stats {id} -> stats                     pause {id, paused, memory?} -> {}
//   set_limits {id, limits} -> {}           set_egress {id, rules} -> {}
//   egress_denials {id} -> denials          evict_layer {digest} -> {}
//   input {id, action} -> {}                set_ports {id, ports: [{port, gen}]} -> {}
//   exec {id, spec}: events, each a tag byte ('o' stdout, 'e' stderr) and the
//     bytes, then the result without its output; cancel kills the process group
//   write_file {id, path, mode} + body -> {written}
//   read_file {id, path} -> body: a JSON line {"size": N or null}, then the bytes
//   screenshot {id} -> body: the PNG
//   pack_diff {id} -> body: a JSON line (digest, size, data_digest, data_size,
//     kind), then the metadata image's bytes, then the data blob's
//   port_open {id, port, gen, timeout_s?}: the node connects to the sandbox's
//     port (EdgeLink::openPort), sends one event 'o', then the call's body
//     carries the connection both ways (proto/port_relay.h: flow-controlled,
//     an end frame is a half-close); {} once both directions ended, or the
//     socket's error; cancel closes the socket
// A bulk call's {results} holds one entry per id in order: {id} or {id, error}.
// Errors come back as the link's error frame (a Status: code, message, field).
//
// Threads: calls arrive on io threads and are handed to the Runtime's
// blocking pool (the node's operations block); an exec then holds no thread:
// its output and exit come back through the agent reactor's callbacks, and
// a port_open holds none once connected (its relay runs on io threads).
// Thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/fd.h"
#include "common/metrics.h"
#include "common/runtime.h"
#include "common/status.h"
#include "proto/edge_link.h"
#include "proto/link.h"

namespace dsec::edge {

class LinkService {
 public:
  // `key` gives the shared key of the node the platform names (empty: none,
  // the handshake is refused). `ids` lists the sandboxes the node runs.
  // pack_diff builds its layers under `packDir` (removed once sent).
  LinkService(Runtime& rt, proto::EdgeLink* link,
              std::function<std::string(const std::string& node)> key,
              std::function<std::vector<std::string>()> ids, std::string packDir);
  // Drops every connection (calls in flight are cancelled).
  ~LinkService();

  // A socket the HTTP server upgraded on GET /edge/v1/link.
  void adopt(UniqueFd fd, std::string buffered);
  // A call without bodies or events: its reply (also the edge's HTTP routes
  // for these methods). kNotFound for a method it does not know.
  Result<nlohmann::json> runJson(const std::string& method, const nlohmann::json& args);

  void writeMetrics(metrics::Writer& w);
  // Calls answered with an error, by code.
  const metrics::CounterVec& errors() const { return errors_; }
  void countError(const Status& st) { errors_.inc(codeName(st.code())); }
  uint64_t creates() const { return creates_.load(); }
  uint64_t destroys() const { return destroys_.load(); }
  uint64_t execs() const { return execs_.load(); }

 private:
  // On a blocking-pool thread.
  void serve(const std::shared_ptr<proto::ServerCall>& call);
  void serveExec(const std::shared_ptr<proto::ServerCall>& call, const nlohmann::json& args);
  Status serveWriteFile(proto::ServerCall& call, const nlohmann::json& args);
  Status serveReadFile(proto::ServerCall& call, const nlohmann::json& args);
  Status servePackDiff(proto::ServerCall& call, const nlohmann::json& args);
  Status serveScreenshot(proto::ServerCall& call, const nlohmann::json& args);
  void servePortOpen(const std::shared_ptr<proto::ServerCall>& call, const nlohmann::json& args);

  Runtime& rt_;
  proto::EdgeLink* link_;
  std::function<std::vector<std::string>()> ids_;
  std::string packDir_;
  metrics::CounterVec errors_;
  std::atomic<uint64_t> creates_{0}, destroys_{0}, execs_{0};
  std::unique_ptr<proto::LinkServer> server_;  // last: its callbacks use the rest
};

}  // namespace dsec::edge
