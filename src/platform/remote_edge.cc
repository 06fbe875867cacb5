#include "platform/remote_edge.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>

#include <atomic>
#include <thread>
#include <unistd.h>

#include "common/base64.h"
#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"
#include "common/http_server.h"
#include "proto/codec.h"

namespace dsec::platform {

using json = nlohmann::json;
namespace wire = proto;

namespace {
std::string sbPath(const std::string& id, const std::string& rest = "") {
  return "/edge/v1/sandboxes/" + http::percentEncode(id) + rest;
}
constexpr size_t kMaxPooled = 32;
// The longest a node may stay silent within one answer. Creates of vm
// sandboxes wait for a boot (--vm-boot-timeout-s, 300 s, retried once) and an
// exec may run for long without output: the node's own bounds apply, this
// only keeps a hung node from holding a platform thread forever (a dead one
// is found by its heartbeats).
constexpr double kReadTimeoutS = 3600;
}  // namespace

RemoteEdge::RemoteEdge(std::string url, std::string key)
    : url_(std::move(url)), key_(std::move(key)) {}

RemoteEdge::~RemoteEdge() = default;

void RemoteEdge::reset(std::string url, std::string key) {
  std::lock_guard lk(mu_);
  url_ = std::move(url);
  key_ = std::move(key);
  ++epoch_;
  idle_.clear();
  noBulk_ = false;  // maybe another edge now
  noBulkDestroy_ = false;
}

Result<http::ClientResponse> RemoteEdge::call(std::string_view method, const std::string& target,
                                              std::string_view body,
                                              const std::function<void(std::string_view)>* onData) {
  std::unique_ptr<http::Client> c;
  uint64_t epoch;
  std::string url, key;
  {
    std::lock_guard lk(mu_);
    epoch = epoch_;
    url = url_;
    key = key_;
    if (!idle_.empty()) {
      c = std::move(idle_.back().second);
      idle_.pop_back();
    }
  }
  bool fresh = false;
  if (!c) {
    http::ClientOptions co;
    co.connectTimeoutS = 3;
    co.readTimeoutS = kReadTimeoutS;
    auto nc = http::Client::connect(url, key, co);
    if (!nc.isOk()) {
      Status st = nc.status();
      return Status(Code::kUnavailable, "node at " + url + " unreachable: " + st.message());
    }
    c = std::move(*nc);
    fresh = true;
  }
  bool gotData = false;
  std::function<void(std::string_view)> counted;
  if (onData) {
    counted = [&](std::string_view d) {
      gotData = true;
      (*onData)(d);
    };
  }
  auto r = onData ? c->requestStreaming(method, target, body, counted)
                  : c->request(method, target, body);
  if (!r.isOk() && !fresh && !gotData) {
    // A pooled keep-alive connection the edge closed meanwhile (nothing came
    // back, so nothing ran): once more on a fresh one.
    http::ClientOptions co;
    co.connectTimeoutS = 3;
    co.readTimeoutS = kReadTimeoutS;
    auto nc = http::Client::connect(url, key, co);
    if (nc.isOk()) {
      c = std::move(*nc);
      r = onData ? c->requestStreaming(method, target, body, counted)
                 : c->request(method, target, body);
    }
  }
  if (!r.isOk()) {
    return Status(Code::kUnavailable, "node at " + url + ": " + r.status().message());
  }
  {
    std::lock_guard lk(mu_);
    if (epoch == epoch_ && idle_.size() < kMaxPooled) idle_.emplace_back(epoch, std::move(c));
  }
  if (r->status / 100 != 2) return wire::statusFromBody(r->status, r->body);
  return r;
}

Status RemoteEdge::create(proto::BackendKind backend, const proto::SandboxSpec& spec) {
  json body = {{"backend", proto::backendName(backend)}, {"spec", wire::toJson(spec)}};
  return call("POST", "/edge/v1/sandboxes", body.dump()).status();
}

namespace {

// The statuses a bulk call's answer ({results: [{id} or {id, error}]}, one
// per id in order) gives for `ids`; an entry the answer lacks is an error.
std::vector<Status> bulkResults(const std::string& body, const std::vector<std::string>& ids) {
  std::vector<Status> out(ids.size(),
                          Status(Code::kInternal, "node answered no result for the sandbox"));
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("results") || !j["results"].is_array()) {
    return out;
  }
  auto& res = j["results"];
  for (size_t i = 0; i < ids.size() && i < res.size(); ++i) {
    if (!res[i].is_object() || res[i].value("id", "") != ids[i]) continue;
    if (res[i].contains("error") && res[i]["error"].is_object()) {
      out[i] = wire::statusFromBody(500, json{{"error", res[i]["error"]}}.dump());
    } else {
      out[i] = Status::ok();
    }
  }
  return out;
}

bool noSuchEndpoint(const Status& st) {
  return st.code() == Code::kNotFound && st.message().find("no such endpoint") != std::string::npos;
}

}  // namespace

std::vector<Status> RemoteEdge::createMany(proto::BackendKind backend,
                                           const std::vector<proto::SandboxSpec>& specs) {
  if (specs.size() <= 1 || noBulk_.load()) return EdgeLink::createMany(backend, specs);
  json arr = json::array();
  std::vector<std::string> ids;
  for (auto& sp : specs) {
    arr.push_back(wire::toJson(sp));
    ids.push_back(sp.id);
  }
  json body = {{"backend", proto::backendName(backend)}, {"specs", std::move(arr)}};
  auto r = call("POST", "/edge/v1/bulk/sandboxes", body.dump());
  if (!r.isOk()) {
    if (noSuchEndpoint(r.status())) {
      noBulk_ = true;  // an edge of an older release: one call per sandbox
      return EdgeLink::createMany(backend, specs);
    }
    // Nothing is known of any of them: each failed (anything the node made
    // anyway is wanted by no record, and its reconcile destroys it).
    return std::vector<Status>(specs.size(), r.status());
  }
  return bulkResults(r->body, ids);
}

std::vector<Status> RemoteEdge::destroyMany(const std::vector<std::string>& ids) {
  constexpr size_t kMaxPerCall = 4096;  // the edge's bound
  if (ids.size() <= 1 || noBulkDestroy_.load()) return EdgeLink::destroyMany(ids);
  std::vector<Status> out;
  out.reserve(ids.size());
  for (size_t from = 0; from < ids.size(); from += kMaxPerCall) {
    std::vector<std::string> part(ids.begin() + from,
                                  ids.begin() + std::min(ids.size(), from + kMaxPerCall));
    auto r = call("POST", "/edge/v1/bulk/destroy", json{{"ids", part}}.dump());
    if (!r.isOk() && noSuchEndpoint(r.status())) {
      noBulkDestroy_ = true;  // an edge of an older release: one call per sandbox
      auto rest = EdgeLink::destroyMany(std::vector<std::string>(ids.begin() + from, ids.end()));
      out.insert(out.end(), rest.begin(), rest.end());
      return out;
    }
    auto sts = r.isOk() ? bulkResults(r->body, part) : std::vector<Status>(part.size(), r.status());
    out.insert(out.end(), sts.begin(), sts.end());
  }
  return out;
}

Status RemoteEdge::destroy(const std::string& id) { return call("DELETE", sbPath(id)).status(); }

namespace {
// An exec on the node, streamed back over one blocking HTTP request on a
// thread of its own (until the multiplexed link replaces this hop).
class HttpExec : public proto::ExecCall {
 public:
  void cancel() override { cancelled = true; }
  std::atomic<bool> cancelled{false};
};
}  // namespace

std::shared_ptr<proto::ExecCall> RemoteEdge::startExec(const std::string& id,
                                                       const proto::ExecSpec& spec,
                                                       proto::ExecCallbacks cb) {
  auto call = std::make_shared<HttpExec>();
  std::thread([this, call, id, spec, cb = std::move(cb)] {
    proto::OutputSink sink;
    if (cb.onOutput) {
      sink = [&](bool isErr, std::string_view d) -> Status {
        if (call->cancelled) return Status(Code::kUnavailable, "exec cancelled: client went away");
        cb.onOutput(isErr, d);
        return Status::ok();
      };
    }
    cb.onDone(httpExec(id, spec, sink));
  }).detach();
  return call;
}

Result<proto::ExecResult> RemoteEdge::httpExec(const std::string& id, const proto::ExecSpec& spec,
                                               const proto::OutputSink& sink) {
  std::string pending;
  std::optional<proto::ExecResult> result;
  Status failure;
  Status sinkError;
  std::function<void(std::string_view)> onData = [&](std::string_view data) {
    pending.append(data);
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      json ev = json::parse(std::string_view(pending).substr(0, nl), nullptr, false);
      pending.erase(0, nl + 1);
      if (ev.is_discarded() || !ev.is_object()) continue;
      if (ev.contains("result")) {
        auto r = wire::resultFromJson(ev["result"]);
        if (r.isOk()) {
          result = std::move(*r);
        } else {
          failure = r.status();
        }
      } else if (ev.contains("error")) {
        failure = wire::statusFromBody(500, ev.dump());
      } else if (ev.contains("o") || ev.contains("e")) {
        bool isErr = ev.contains("e");
        auto d = base64Decode(ev[isErr ? "e" : "o"].get<std::string>());
        if (!d.isOk()) continue;
        if (sink) {
          // A sink that fails (the client went away) drops the rest; the exec
          // runs to its own end on the node.
          if (sinkError.isOk()) sinkError = sink(isErr, *d);
        }
      }
    }
  };
  auto r = call("POST", sbPath(id, sink ? "/exec?stream=1" : "/exec"), wire::toJson(spec).dump(),
                &onData);
  if (!r.isOk()) return r.status();
  if (!failure.isOk()) return failure;
  if (!sinkError.isOk()) return sinkError;
  if (!result) return Status(Code::kUnavailable, "node ended the exec stream without a result");
  return *result;
}

Result<uint64_t> RemoteEdge::writeFile(const std::string& id, const std::string& path, int mode,
                                       const proto::ByteSource& src) {
  std::string data;
  char buf[65536];
  for (;;) {
    ASSIGN_OR_RETURN(size_t n, src(buf, sizeof buf));
    if (n == 0) break;
    data.append(buf, n);
  }
  auto r =
      call("PUT",
           sbPath(id, "/file?path=" + http::percentEncode(path) + "&mode=" + std::to_string(mode)),
           data);
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad write answer");
  return j.value("written", uint64_t(0));
}

Status RemoteEdge::readFile(const std::string& id, const std::string& path,
                            const std::function<Status(std::optional<uint64_t>)>& onSize,
                            const proto::ByteSink& sink) {
  auto r = call("GET", sbPath(id, "/file?path=" + http::percentEncode(path)));
  if (!r.isOk()) return r.status();
  RETURN_IF_ERROR(onSize(uint64_t(r->body.size())));
  if (!r->body.empty()) RETURN_IF_ERROR(sink(r->body));
  return Status::ok();
}

Result<std::string> RemoteEdge::agentOp(const std::string& id, proto::AgentOp op,
                                        const std::string& body) {
  json j = {{"op", proto::agentOpName(op)}, {"json", body}};
  auto r = call("POST", sbPath(id, "/filecall"), j.dump());
  if (!r.isOk()) return r.status();
  return r->body;
}

Result<proto::CgroupStats> RemoteEdge::stats(const std::string& id) {
  auto r = call("GET", sbPath(id, "/stats"));
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad stats answer");
  return wire::statsFromJson(j);
}

Status RemoteEdge::pause(const std::string& id, bool paused) {
  return call("POST", sbPath(id, "/pause"), json{{"paused", paused}}.dump()).status();
}

Status RemoteEdge::hibernate(const std::string& id) {
  return call("POST", sbPath(id, "/pause"), json{{"paused", true}, {"memory", "disk"}}.dump())
      .status();
}

Status RemoteEdge::setLimits(const std::string& id, const proto::CgroupLimits& l) {
  return call("POST", sbPath(id, "/limits"), wire::toJson(l).dump()).status();
}

Status RemoteEdge::setEgress(const std::string& id,
                             const std::vector<proto::EgressRule>& rules) {
  json rs = json::array();
  for (auto& r : rules) rs.push_back(wire::toJson(r));
  return call("POST", sbPath(id, "/egress"), json{{"rules", rs}}.dump()).status();
}

Result<proto::EgressDenials> RemoteEdge::egressDenials(const std::string& id) {
  auto r = call("GET", sbPath(id, "/egress_denials"));
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad egress answer");
  return wire::denialsFromJson(j);
}

Result<image::BuiltLayer> RemoteEdge::packDiff(const std::string& id, const std::string& workDir) {
  // The node builds the layer; its two files come back over the hop into
  // workDir, each checked against the size and digest the node announced
  // (the caller moves them into the blob store, where every node reads them).
  auto r = call("POST", sbPath(id, "/pack_diff"));
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("pack")) {
    return internalError("node: bad pack_diff answer");
  }
  std::string pack = j.value("pack", "");
  image::BuiltLayer layer;
  layer.digest = j.value("digest", "");
  layer.size = j.value("size", int64_t(0));
  layer.dataDigest = j.value("data_digest", "");
  layer.dataSize = j.value("data_size", int64_t(0));
  layer.path = workDir + "/meta";
  layer.dataPath = workDir + "/data";
  Status st = makeDirs(workDir, 0700);
  if (st.isOk()) st = fetchPackFile(pack, "meta", layer.path, layer.digest, layer.size);
  if (st.isOk()) st = fetchPackFile(pack, "data", layer.dataPath, layer.dataDigest, layer.dataSize);
  // The node's copy goes either way (it also drops packs nobody fetched).
  (void)call("DELETE", "/edge/v1/packs/" + http::percentEncode(pack));
  if (!st.isOk()) return st.withContext("pack_diff " + id + ": fetching the layer from the node");
  return layer;
}

Status RemoteEdge::fetchPackFile(const std::string& pack, const std::string& which,
                                 const std::string& dest, const std::string& digest,
                                 int64_t size) {
  UniqueFd fd(::open(dest.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return sysError("create " + dest);
  Sha256 h;
  int64_t got = 0;
  Status wrote;
  std::function<void(std::string_view)> onData = [&](std::string_view d) {
    if (!wrote.isOk()) return;
    h.update(d.data(), d.size());
    got += int64_t(d.size());
    if (::write(fd.get(), d.data(), d.size()) != ssize_t(d.size())) wrote = sysError("write " + dest);
  };
  auto r = call("GET", "/edge/v1/packs/" + http::percentEncode(pack) + "/" + which, {}, &onData);
  if (!r.isOk()) return r.status();
  RETURN_IF_ERROR(wrote);
  if (::fsync(fd.get()) != 0) return sysError("fsync " + dest);
  std::string sum = "sha256:" + h.hexDigest();
  if (got != size || sum != digest) {
    return Status(Code::kDataLoss, "the node's " + which + " file is " + std::to_string(got) +
                                       " bytes hashing to " + sum + ", it announced " +
                                       std::to_string(size) + " bytes of " + digest);
  }
  return Status::ok();
}

Status RemoteEdge::evictLayer(const std::string& digest) {
  return call("POST", "/edge/v1/layers/" + http::percentEncode(digest) + "/evict").status();
}

Result<std::string> RemoteEdge::screenshot(const std::string& id) {
  auto r = call("GET", sbPath(id, "/screenshot"));
  if (!r.isOk()) return r.status();
  return std::move(r->body);
}

Status RemoteEdge::input(const std::string& id, const proto::InputAction& action) {
  return call("POST", sbPath(id, "/input"), wire::toJson(action).dump()).status();
}

}  // namespace dsec::platform
