// An edge in another process (`dsec edge`), driven over its internal HTTP API
// (docs/cluster.md). Every call carries the platform's credential for that
// node (`Authorization: Bearer <platform key>`), which the edge checks.
//
// Thread-safe: calls take a keep-alive connection from a small pool (a new
// one when none is idle); a connection that failed is dropped. Exec output is
// streamed back as NDJSON and handed to the sink as it arrives. File bodies
// are buffered in memory on this hop (bounded by the API's own limits).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/http_client.h"
#include "proto/edge_link.h"

namespace dsec::platform {

class RemoteEdge : public proto::EdgeLink {
 public:
  RemoteEdge(std::string url, std::string key);
  ~RemoteEdge() override;
  // Changes where and with what the node is reached (on re-join).
  void reset(std::string url, std::string key);
  const std::string& url() const { return url_; }

  // Deaths come through the node's events (Cluster::handleInternal).
  void setDeathHandler(std::function<void(const std::string&, const std::string&)>) override {}
  Status create(proto::BackendKind backend, const proto::SandboxSpec& spec) override;
  // One POST /edge/v1/bulk/sandboxes (docs/cluster.md); an edge without it
  // (older release, 404) gets one call per sandbox from then on.
  std::vector<Status> createMany(proto::BackendKind backend,
                                 const std::vector<proto::SandboxSpec>& specs) override;
  Status destroy(const std::string& id) override;
  // One POST /edge/v1/bulk/destroy per 4,096 ids; an edge without it (older
  // release, 404) gets one call per sandbox from then on.
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
  Status pause(const std::string& id, bool paused) override;
  Status hibernate(const std::string& id) override;
  Status setLimits(const std::string& id, const proto::CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) override;
  Result<proto::EgressDenials> egressDenials(const std::string& id) override;
  // Builds the diff layer on the node and fetches its two files into workDir
  // (verified against the digests the node gives; kDataLoss otherwise).
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  Status evictLayer(const std::string& digest) override;
  // Computer use (backend vm) is forwarded as is: the node's errors come back.
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const proto::InputAction& action) override;

 private:
  Result<proto::ExecResult> httpExec(const std::string& id, const proto::ExecSpec& spec,
                                     const proto::OutputSink& sink);
  // One request with a pooled connection; a non-2xx answer becomes its Status.
  Result<http::ClientResponse> call(std::string_view method, const std::string& target,
                                    std::string_view body = {},
                                    const std::function<void(std::string_view)>* onData = nullptr);
  // One file of a pack (pack_diff) into dest, checked against size and digest.
  Status fetchPackFile(const std::string& pack, const std::string& which, const std::string& dest,
                       const std::string& digest, int64_t size);

  mutable std::mutex mu_;  // guards url_, key_, idle_, epoch_
  std::atomic<bool> noBulk_{false};
  std::atomic<bool> noBulkDestroy_{false};
  std::string url_, key_;
  uint64_t epoch_ = 0;  // bumped by reset(): older connections are not reused
  std::vector<std::pair<uint64_t, std::unique_ptr<http::Client>>> idle_;
};

}  // namespace dsec::platform
