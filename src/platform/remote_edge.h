// An edge in another process (`dsec edge`), driven over the platform-edge
// link (proto/link.h, docs/cluster.md): one persistent, multiplexed
// connection to the node carrying every call, authenticated both ways with
// the node's platform key (never sent). The calls and their encodings are
// listed in edge/link_service.h.
//
// An exec in flight is one call on the link and holds no thread here: its
// output arrives as events, its result as the reply, and cancel() tells the
// node to kill it. The other operations block their caller (a worker thread)
// until the node answers; file bodies stream both ways with the link's flow
// control.
//
// Thread-safe. A call on a node that cannot be reached, or whose connection
// drops mid-call, fails with kUnavailable.
#pragma once

#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/runtime.h"
#include "proto/edge_link.h"
#include "proto/link.h"

namespace dsec::platform {

class RemoteEdge : public proto::EdgeLink {
 public:
  // url: http://HOST:PORT of the node's HTTP port; key: its platform key;
  // node: its name (said in the link's hello).
  RemoteEdge(std::string url, std::string key, std::string node,
             Runtime& rt = Runtime::global());
  ~RemoteEdge() override;
  // Changes where and with what the node is reached (on re-join): calls in
  // flight on the old connection fail, new ones go to the new address.
  void reset(std::string url, std::string key);
  std::string url() const;

  // Deaths come through the node's events (Cluster::handleInternal).
  void setDeathHandler(std::function<void(const std::string&, const std::string&)>) override {}
  Status create(proto::BackendKind backend, const proto::SandboxSpec& spec) override;
  // One call for all of them.
  std::vector<Status> createMany(proto::BackendKind backend,
                                 const std::vector<proto::SandboxSpec>& specs) override;
  Status destroy(const std::string& id) override;
  // One call per 4,096 ids.
  std::vector<Status> destroyMany(const std::vector<std::string>& ids) override;
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
  // Link "stats" with history: an edge older than the history answers its
  // current figures only, taken as one reading now.
  Result<proto::StatsSeries> statsHistory(const std::string& id, double windowS) override;
  Status pause(const std::string& id, bool paused) override;
  Status hibernate(const std::string& id) override;
  Status setLimits(const std::string& id, const proto::CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) override;
  Result<proto::EgressDenials> egressDenials(const std::string& id) override;
  // Builds the diff layer on the node and streams its two files into workDir
  // (verified against the sizes and digests the node gives; kDataLoss
  // otherwise).
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  Status evictLayer(const std::string& digest) override;
  // Exposed ports: a `port_open` call carries the connection. The node
  // connects (its errors come back as they are: kUnavailable "nothing
  // listens on port P", kPermissionDenied field "port", ...); then one end of
  // a socketpair is returned and the other relayed with the call on the
  // Runtime's io threads (proto/port_relay.h: no thread per connection,
  // flow-controlled both ways, half-closes pass). The caller closing its end
  // (or shutting it down both ways) cancels the call, which closes the
  // sandbox's socket; the node ending the call (a cut by setPorts, the
  // sandbox's reset) closes the relayed end: the caller reads EOF. Waits
  // connectTimeoutS plus 10 s for the node's answer (kDeadlineExceeded).
  Result<UniqueFd> openPort(const std::string& id, int port, uint64_t gen,
                            double connectTimeoutS = 10) override;
  Status setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) override;
  // Computer use (backend vm) is forwarded as is: the node's errors come back.
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const proto::InputAction& action) override;

  // The link's state, for metrics: connected, handshakes so far, calls in flight.
  bool connected() const;
  uint64_t connects() const;
  size_t callsInFlight() const;

 private:
  std::shared_ptr<proto::LinkClient> client() const;
  // One call without bodies: its reply as JSON.
  Result<nlohmann::json> unary(const std::string& method, const nlohmann::json& args);

  Runtime& rt_;
  const std::string node_;
  mutable std::mutex mu_;  // guards url_, key_, client_
  std::string url_, key_;
  mutable std::shared_ptr<proto::LinkClient> client_;  // made on first use
};

}  // namespace dsec::platform
