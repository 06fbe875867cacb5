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
#include "edge/backends/microvm/microvm_backend.h"
#include "edge/backends/vm/vm_backend.h"
#include "edge/edge_link.h"

namespace dsec::platform {

class RemoteEdge : public edge::EdgeLink {
 public:
  RemoteEdge(std::string url, std::string key);
  ~RemoteEdge() override;
  // Changes where and with what the node is reached (on re-join).
  void reset(std::string url, std::string key);
  const std::string& url() const { return url_; }

  void setDeathHandler(std::function<void(const std::string&, const std::string&)>) override {}
  Status create(const std::string& backend, const edge::SandboxSpec& spec) override;
  // One POST /edge/v1/bulk/sandboxes (docs/cluster.md); an edge without it
  // (older release, 404) gets one call per sandbox from then on.
  std::vector<Status> createMany(const std::string& backend,
                                 const std::vector<edge::SandboxSpec>& specs) override;
  Status destroy(const std::string& id) override;
  // One POST /edge/v1/bulk/destroy per 4,096 ids; an edge without it (older
  // release, 404) gets one call per sandbox from then on.
  std::vector<Status> destroyMany(const std::vector<std::string>& ids) override;
  Result<edge::ExecResult> exec(const std::string& id, const edge::ExecSpec& spec,
                                const edge::OutputSink& sink) override;
  Result<uint64_t> writeFile(const std::string& id, const std::string& path, int mode,
                             const edge::ByteSource& src) override;
  Status readFile(const std::string& id, const std::string& path,
                  const std::function<Status(std::optional<uint64_t>)>& onSize,
                  const edge::ByteSink& sink) override;
  Result<std::string> fileCall(const std::string& id, proto::FrameType type,
                               const std::string& json) override;
  Result<edge::CgroupStats> stats(const std::string& id) override;
  Status pause(const std::string& id, bool paused) override;
  Status hibernate(const std::string& id) override;
  Status setLimits(const std::string& id, const edge::CgroupLimits& limits) override;
  Status setEgress(const std::string& id, const std::vector<edge::net::EgressRule>& rules) override;
  Result<edge::net::EgressDenials> egressDenials(const std::string& id) override;
  std::string egressUnavailable() const override { return ""; }
  std::string egressTag() const override { return ""; }
  std::map<std::string, uint64_t> egressDenialCounts() override { return {}; }
  std::map<std::string, uint64_t> syscallDenialCounts() const override { return {}; }
  Result<image::BuiltLayer> packDiff(const std::string& id, const std::string& workDir) override;
  Status evictLayer(const std::string& digest) override;
  std::vector<std::string> sandboxIds() const override { return {}; }
  std::vector<std::string> adoptedIds() const override { return {}; }
  std::map<std::string, int> orphansRemoved() const override { return {}; }
  // Nobody asks a node: the platform's Cluster answers with its own
  // configuration, which it sends with each fncall spec (fncall_init).
  const std::map<std::string, std::vector<std::string>>& fncallLanguages() const override {
    static const std::map<std::string, std::vector<std::string>> kNone;
    return kNone;
  }
  const edge::Userns& userns() const override { return userns_; }
  const edge::MicroVmProbe& microvm() const override { return microvm_; }
  const edge::VmProbe& vm() const override { return vm_; }
  // Builds the diff layer on the node and fetches its two files into workDir
  // (verified against the digests the node gives; kDataLoss otherwise).
  // Computer use (backend vm) is forwarded as is: the node's errors come back.
  Result<std::string> screenshot(const std::string& id) override;
  Status input(const std::string& id, const edge::InputAction& action) override;
  edge::NodeCache* localNodeCache() override { return nullptr; }

 private:
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
  edge::Userns userns_;
  edge::MicroVmProbe microvm_;
  edge::VmProbe vm_;
};

}  // namespace dsec::platform
