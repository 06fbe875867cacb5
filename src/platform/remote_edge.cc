#include "platform/remote_edge.h"

#include <nlohmann/json.hpp>

#include "common/base64.h"
#include "common/http_server.h"
#include "edge/edge_wire.h"

namespace dsec::platform {

using json = nlohmann::json;
namespace wire = edge::wire;

namespace {
std::string sbPath(const std::string& id, const std::string& rest = "") {
  return "/edge/v1/sandboxes/" + http::percentEncode(id) + rest;
}
constexpr size_t kMaxPooled = 32;
}  // namespace

RemoteEdge::RemoteEdge(std::string url, std::string key)
    : url_(std::move(url)), key_(std::move(key)) {
  userns_.reason = "remote node";
  microvm_.reason = "remote node";
  vm_.reason = "remote node";
}

RemoteEdge::~RemoteEdge() = default;

void RemoteEdge::reset(std::string url, std::string key) {
  std::lock_guard lk(mu_);
  url_ = std::move(url);
  key_ = std::move(key);
  ++epoch_;
  idle_.clear();
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

Status RemoteEdge::create(const std::string& backend, const edge::SandboxSpec& spec) {
  json body = {{"backend", backend}, {"spec", wire::toJson(spec)}};
  return call("POST", "/edge/v1/sandboxes", body.dump()).status();
}

Status RemoteEdge::destroy(const std::string& id) { return call("DELETE", sbPath(id)).status(); }

Result<edge::ExecResult> RemoteEdge::exec(const std::string& id, const edge::ExecSpec& spec,
                                          const edge::OutputSink& sink) {
  std::string pending;
  std::optional<edge::ExecResult> result;
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
        result = wire::resultFromJson(ev["result"]);
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
                                       const edge::ByteSource& src) {
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
                            const edge::ByteSink& sink) {
  auto r = call("GET", sbPath(id, "/file?path=" + http::percentEncode(path)));
  if (!r.isOk()) return r.status();
  RETURN_IF_ERROR(onSize(uint64_t(r->body.size())));
  if (!r->body.empty()) RETURN_IF_ERROR(sink(r->body));
  return Status::ok();
}

Result<std::string> RemoteEdge::fileCall(const std::string& id, proto::FrameType type,
                                         const std::string& body) {
  json j = {{"type", int(type)}, {"json", body}};
  auto r = call("POST", sbPath(id, "/filecall"), j.dump());
  if (!r.isOk()) return r.status();
  return r->body;
}

Result<edge::CgroupStats> RemoteEdge::stats(const std::string& id) {
  auto r = call("GET", sbPath(id, "/stats"));
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad stats answer");
  edge::CgroupStats s;
  s.oomKills = j.value("oom_kills", int64_t(0));
  s.pidsLimitHits = j.value("pids_limit_hits", int64_t(0));
  s.memoryBytes = j.value("memory_bytes", int64_t(0));
  return s;
}

Status RemoteEdge::pause(const std::string& id, bool paused) {
  return call("POST", sbPath(id, "/pause"), json{{"paused", paused}}.dump()).status();
}

Status RemoteEdge::setLimits(const std::string& id, const edge::CgroupLimits& l) {
  json j = {{"cpu", l.cpu}, {"memory_bytes", l.memoryBytes}, {"pids", l.pids}};
  return call("POST", sbPath(id, "/limits"), j.dump()).status();
}

Status RemoteEdge::setEgress(const std::string& id,
                             const std::vector<edge::net::EgressRule>& rules) {
  json rs = json::array();
  for (auto& r : rules) rs.push_back(wire::toJson(r));
  return call("POST", sbPath(id, "/egress"), json{{"rules", rs}}.dump()).status();
}

Result<edge::net::EgressDenials> RemoteEdge::egressDenials(const std::string& id) {
  auto r = call("GET", sbPath(id, "/egress_denials"));
  if (!r.isOk()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad egress answer");
  edge::net::EgressDenials d;
  d.count = j.value("count", uint64_t(0));
  d.last = j.value("last", "");
  return d;
}

Result<image::BuiltLayer> RemoteEdge::packDiff(const std::string& id, const std::string&) {
  return Status(Code::kFailedPrecondition,
                "pack_diff of sandbox " + id + " on a remote node is not supported yet");
}

Status RemoteEdge::evictLayer(const std::string& digest) {
  return call("POST", "/edge/v1/layers/" + http::percentEncode(digest) + "/evict").status();
}

Result<std::string> RemoteEdge::screenshot(const std::string& id) {
  return Status(Code::kFailedPrecondition,
                "computer use is not carried to remote nodes yet (sandbox " + id + ")");
}

Status RemoteEdge::input(const std::string& id, const edge::InputAction&) {
  return Status(Code::kFailedPrecondition,
                "computer use is not carried to remote nodes yet (sandbox " + id + ")");
}

}  // namespace dsec::platform
