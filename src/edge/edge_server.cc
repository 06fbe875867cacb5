#include "edge/edge_server.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/fd.h"

#include "common/base64.h"
#include "common/http_client.h"
#include "common/log.h"
#include "common/mountinfo.h"
#include "common/util.h"
#include "proto/codec.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

void sendJ(http::Response& res, int status, const json& j) {
  (void)res.send(status, "application/json",
                 j.dump(-1, ' ', false, json::error_handler_t::replace));
}

std::string bearerOf(http::Request& req) {
  std::string a = req.header("authorization");
  return startsWith(a, "Bearer ") ? a.substr(7) : "";
}

}  // namespace

EdgeAgent::EdgeAgent(EdgeAgentOptions opts) : opts_(std::move(opts)), bootId_(randomHex(8)) {
  for (auto& u : splitString(opts_.platformUrl, ',')) {
    if (!u.empty()) urls_.push_back(u);
  }
  if (urls_.empty()) urls_.push_back(opts_.platformUrl);
  if (!opts_.registry) ownRegistry_ = std::make_unique<metrics::Registry>();
  registry_ = opts_.registry ? opts_.registry : ownRegistry_.get();
  metricsId_ = registry_->add([this](metrics::Writer& w) { writeMetrics(w); });
}

Result<http::ClientResponse> EdgeAgent::send(const std::string& key, const std::string& method,
                                             const std::string& target, const std::string& body,
                                             double readTimeoutS) {
  http::ClientOptions co;
  co.connectTimeoutS = 3;
  co.readTimeoutS = readTimeoutS;
  size_t start = current_.load();
  std::string errors;
  for (size_t k = 0; k < urls_.size(); ++k) {
    size_t i = (start + k) % urls_.size();
    auto c = http::Client::connect(urls_[i], key, co);
    auto r = c.isOk() ? (*c)->request(method, target, body)
                      : Result<http::ClientResponse>(c.status());
    if (r.isOk()) {
      if (i != start && current_.exchange(i) != i) {
        log::info("platform: now talking to " + urls_[i]);
      }
      return r;
    }
    errors += (errors.empty() ? "" : "; ") + urls_[i] + ": " + r.status().message();
  }
  return Status(Code::kUnavailable, "platform: " + errors);
}

EdgeAgent::~EdgeAgent() {
  registry_->remove(metricsId_);  // first: a scrape under way ends before the agent goes
  stop();
}

void EdgeAgent::writeMetrics(metrics::Writer& w) {
  LinkService* service;
  {
    std::lock_guard lk(mu_);
    service = service_.get();  // ids_ is set with it
  }
  w.gauge("dsec_edge_sandboxes", "Sandboxes this node runs.", service ? double(ids_().size()) : 0);
  w.gauge("dsec_edge_mounts",
          "Mounts in this edge's mount namespace, which every new sandbox's namespace is copied "
          "from: constant as sandboxes are added.",
          double(mountCount()));
  w.gauge("dsec_edge_capacity_slots", "Sandboxes this node offers at most.", double(opts_.slots));
  w.counter("dsec_edge_creates_total", "Creates the platform asked of this node.",
            double(service ? service->creates() : 0));
  w.counter("dsec_edge_destroys_total", "Destroys the platform asked of this node.",
            double(service ? service->destroys() : 0));
  w.counter("dsec_edge_execs_total", "Execs the platform asked of this node.",
            double(service ? service->execs() : 0));
  w.counter("dsec_edge_unauthenticated_total", "Calls refused for a missing or wrong key.",
            double(refused_.load()));
  w.counter("dsec_edge_heartbeat_failures_total", "Heartbeats the platform did not take.",
            double(hbFailures_.load()));
  w.counter("dsec_edge_prestaged_layers_total",
            "Layers pre-staged into the node cache at the platform's asking.",
            double(stagedCount_.load()));
  w.counter("dsec_edge_prestage_failures_total", "Pre-staging attempts that failed.",
            double(stageFailures_.load()));
  const char* help = "Calls answered with an error, by code.";
  w.declare("dsec_edge_errors_total", metrics::Type::kCounter, help);
  if (!service) return;
  for (auto& [code, n] : service->errors().values()) {
    w.counter("dsec_edge_errors_total", help, double(n), {{"code", code}});
  }
  service->writeMetrics(w);
}

Status EdgeAgent::loadCredentials() {
  auto text = readFile(opts_.dataDir + "/node.json");
  if (!text.isOk()) return text.status();
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return internalError("node.json: not JSON");
  std::lock_guard lk(mu_);
  node_ = j.value("node", "");
  edgeKey_ = j.value("edge_key", "");
  platformKey_ = j.value("platform_key", "");
  if (node_ != opts_.name || edgeKey_.empty()) {
    return notFound("node.json is for another node or incomplete");
  }
  return Status::ok();
}

Status EdgeAgent::join() {
  if (opts_.joinToken.empty()) {
    return Status(Code::kUnauthenticated, "no join token (--join-token) and no saved credentials");
  }
  json body = {
      {"name", opts_.name},
      {"url", opts_.url},
      {"pool", opts_.pool},
      {"capacity", {{"cpus", opts_.cpus}, {"memory_mb", opts_.memoryMb}, {"slots", opts_.slots}}}};
  auto r = send(opts_.joinToken, "POST", "/internal/v1/join", body.dump(), 10);
  if (!r.isOk()) return r.status();
  if (r->status != 200) return proto::statusFromBody(r->status, r->body);
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("edge_key"))
    return internalError("platform: bad join answer");
  {
    std::lock_guard lk(mu_);
    node_ = j.value("node", opts_.name);
    edgeKey_ = j.value("edge_key", "");
    platformKey_ = j.value("platform_key", "");
  }
  json saved = {{"node", node_},
                {"edge_key", edgeKey_},
                {"platform_key", platformKey_},
                {"platform", opts_.platformUrl}};
  RETURN_IF_ERROR(writeFileAtomic(opts_.dataDir + "/node.json", saved.dump() + "\n", 0600));
  log::info("joined the platform at " + urls_[current_.load()] + " as node " + node_);
  return Status::ok();
}

Status EdgeAgent::start() {
  if (loadCredentials().isOk()) {
    log::info("node " + opts_.name + ": using the credentials in " + opts_.dataDir + "/node.json");
    return Status::ok();
  }
  double deadline = nowSeconds() + opts_.joinWaitS;
  for (;;) {
    Status st = join();
    if (st.isOk() || st.code() != Code::kUnavailable || nowSeconds() >= deadline) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

Result<std::string> EdgeAgent::platformCall(const std::string& method, const std::string& target,
                                            const std::string& body) {
  std::string key, node;
  {
    std::lock_guard lk(mu_);
    key = edgeKey_;
    node = node_;
  }
  auto r = send(key, method, target, body, 30);
  if (!r.isOk()) return r.status();
  if (r->status != 200) return proto::statusFromBody(r->status, r->body);
  return r->body;
}

void EdgeAgent::serveLink(proto::EdgeLink* link, std::function<std::vector<std::string>()> ids,
                          std::function<std::vector<std::string>()> layers) {
  auto service = std::make_unique<LinkService>(
      Runtime::global(), link,
      [this](const std::string& node) {
        std::lock_guard lk(mu_);
        return node == node_ ? platformKey_ : std::string();
      },
      ids, opts_.dataDir + "/packs");
  {
    std::lock_guard lk(mu_);
    link_ = link;
    ids_ = std::move(ids);
    layers_ = std::move(layers);
    service_ = std::move(service);
  }
  hbThread_ = std::thread([this] { heartbeatLoop(); });
}

void EdgeAgent::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (hbThread_.joinable()) hbThread_.join();
  if (stageThread_.joinable()) stageThread_.join();
}

void EdgeAgent::setPrestager(std::function<Status(const std::string&)> stage) {
  std::lock_guard lk(mu_);
  stage_ = std::move(stage);
  if (stage_ && !stageThread_.joinable()) stageThread_ = std::thread([this] { prestageLoop(); });
}

void EdgeAgent::queuePrestage(const std::vector<std::string>& digests) {
  double now = nowSeconds();
  bool added = false;
  {
    std::lock_guard lk(mu_);
    if (!stage_) return;
    for (auto& d : digests) {
      if (staged_.count(d) || stageQueued_.count(d)) continue;
      auto f = stageFailedAt_.find(d);
      if (f != stageFailedAt_.end() && now - f->second < kPrestageRetryS) continue;
      stageQueue_.push_back(d);
      stageQueued_.insert(d);
      added = true;
    }
  }
  if (added) cv_.notify_all();
}

void EdgeAgent::prestageLoop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stopping_ || !stageQueue_.empty(); });
    if (stopping_) return;
    std::string d = stageQueue_.front();
    stageQueue_.pop_front();
    auto stage = stage_;
    lk.unlock();
    double t0 = nowSeconds();
    Status st = stage(d);
    lk.lock();
    stageQueued_.erase(d);
    if (st.isOk()) {
      staged_.insert(d);
      stageFailedAt_.erase(d);
      stagedCount_++;
      log::info("pre-staged layer " + d + " in " + std::to_string(int((nowSeconds() - t0) * 1000)) +
                " ms");
    } else {
      stageFailedAt_[d] = nowSeconds();
      stageFailures_++;
      log::warn("pre-staging layer " + d + ": " + st.toString() + " (retried in " +
                std::to_string(int(kPrestageRetryS)) + " s)");
    }
  }
}

Status EdgeAgent::heartbeatOnce() {
  proto::EdgeLink* link;
  std::function<std::vector<std::string>()> layersFn;
  std::string node;
  {
    std::lock_guard lk(mu_);
    link = link_;
    layersFn = layers_;
    node = node_;
  }
  auto ids = ids_();
  double load1 = 0;
  if (auto la = readFile("/proc/loadavg"); la.isOk()) load1 = std::atof(la->c_str());
  json body = {
      {"boot_id", bootId_},
      {"url", opts_.url},
      {"pool", opts_.pool},
      {"capacity", {{"cpus", opts_.cpus}, {"memory_mb", opts_.memoryMb}, {"slots", opts_.slots}}},
      {"layers", layersFn ? layersFn() : std::vector<std::string>{}},
      {"load", {{"sandboxes", ids.size()}, {"loadavg_1m", load1}}}};
  // What changed since the list the platform acknowledged, or all of it when
  // it holds none (it says so by answering without a token).
  if (hbToken_.empty()) {
    body["sandboxes"] = ids;
  } else {
    json added = json::array();
    for (auto& id : ids) {
      if (!hbBase_.count(id)) added.push_back(id);
    }
    body["since"] = hbToken_;
    body["added"] = std::move(added);
    body["count"] = ids.size();
  }
  auto r = platformCall("POST", "/internal/v1/nodes/" + http::percentEncode(node) + "/heartbeat",
                        body.dump());
  if (!r.isOk()) {
    if (r.status().code() == Code::kUnauthenticated && !opts_.joinToken.empty()) {
      log::warn("the platform refused this node's credentials; joining again");
      RETURN_IF_ERROR(join());
    }
    return r.status();
  }
  json j = json::parse(*r, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    hbToken_.clear();
    return Status::ok();
  }
  // A token acknowledges the list this heartbeat described: the next one
  // sends what was added since (an older platform sends none: full lists).
  if (j.contains("token") && j["token"].is_string() && !j.value("full", false)) {
    hbToken_ = j["token"].get<std::string>();
    hbBase_ = std::unordered_set<std::string>(ids.begin(), ids.end());
  } else {
    hbToken_.clear();
    hbBase_.clear();
  }
  std::vector<std::string> stage;
  for (auto& d : j.value("prestage", json::array())) {
    if (d.is_string()) stage.push_back(d.get<std::string>());
  }
  if (!stage.empty()) queuePrestage(stage);
  for (auto& id : j.value("destroy", json::array())) {
    if (!id.is_string()) continue;
    log::info("sandbox " + id.get<std::string>() + ": the platform no longer wants it; destroying");
    Status st = link->destroy(id.get<std::string>());
    if (!st.isOk()) log::warn("destroy " + id.get<std::string>() + ": " + st.toString());
  }
  return Status::ok();
}

void EdgeAgent::heartbeatLoop() {
  bool failing = false;
  for (;;) {
    Status st = heartbeatOnce();
    if (!st.isOk()) {
      hbFailures_++;
      if (!failing) log::warn("heartbeat: " + st.toString());
      failing = true;
    } else if (failing) {
      log::info("heartbeat: the platform answers again");
      failing = false;
    }
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, std::chrono::milliseconds(int64_t(opts_.heartbeatS * 1000)),
                 [&] { return stopping_; });
    if (stopping_) return;
  }
}

Result<LayerDesc> EdgeAgent::lookupLayer(const std::string& digest) {
  std::string node;
  {
    std::lock_guard lk(mu_);
    node = node_;
  }
  // The node's name rides in a header so the platform can check its key.
  std::string key;
  {
    std::lock_guard lk(mu_);
    key = edgeKey_;
  }
  auto r = send(key, "GET",
                "/internal/v1/layers/" + http::percentEncode(digest) +
                    "?node=" + http::percentEncode(node),
                "", 30);
  if (!r.isOk()) return r.status();
  if (r->status != 200) return proto::statusFromBody(r->status, r->body);
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return internalError("platform: bad layer answer");
  auto d = proto::layerDescFromJson(j);
  if (!d.isOk()) return internalError("platform: bad layer answer: " + d.status().message());
  return d;
}

void EdgeAgent::reportDeath(const std::string& id, const std::string& why) {
  std::string node;
  {
    std::lock_guard lk(mu_);
    node = node_;
  }
  json body = {{"sandbox", id}, {"why", why}};
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto r = platformCall("POST", "/internal/v1/nodes/" + http::percentEncode(node) + "/events",
                          body.dump());
    if (r.isOk()) return;
    log::warn("reporting the death of " + id + ": " + r.status().toString());
  }
}

void EdgeAgent::handle(http::Request& req, http::Response& res) {
  if (req.path == "/metrics" && req.method == "GET") {
    (void)res.send(200, "text/plain; version=0.0.4", registry_->render());
    return;
  }
  LinkService* service;
  {
    std::lock_guard lk(mu_);
    service = service_.get();
  }
  if (req.path == proto::kLinkPath && req.method == "GET") {
    // The platform's link (docs/cluster.md): its handshake authenticates both
    // ends with the platform key, never sent.
    if (!service) {
      sendJ(res, 503, proto::errorJson(Status(Code::kUnavailable, "node is starting")));
      return;
    }
    Status st = res.upgrade(std::string(proto::kLinkProtocol),
                            [service](UniqueFd fd, std::string buffered) {
                              service->adopt(std::move(fd), std::move(buffered));
                            });
    if (!st.isOk()) sendJ(res, httpStatusFor(st.code()), proto::errorJson(st));
    return;
  }
  std::string key = bearerOf(req);
  std::string want;
  {
    std::lock_guard lk(mu_);
    want = platformKey_;
  }
  if (key.empty() || want.empty() || !secretEquals(key, want)) {
    refused_++;
    res.setHeader("WWW-Authenticate", "Bearer");
    sendJ(res, 401,
          proto::errorJson(Status(Code::kUnauthenticated, key.empty()
                                                             ? "missing platform credential"
                                                             : "invalid platform credential")));
    return;
  }
  if (!service) {
    sendJ(res, 503, proto::errorJson(Status(Code::kUnavailable, "node is starting")));
    return;
  }
  route(req, res, service);
}

void EdgeAgent::route(http::Request& req, http::Response& res, LinkService* service) {
  // The node's calls for an operator or a script, with the platform key: the
  // link's JSON calls (link_service.h) on HTTP. The platform itself uses the
  // link.
  auto parts = splitString(req.path, '/');  // "", "edge", "v1", coll, id
  size_t n = parts.size();
  const std::string& m = req.method;
  std::string method;
  json args = json::object();
  if (n < 4 || parts[1] != "edge" || parts[2] != "v1") {
    method = "";
  } else if (parts[3] == "sandboxes" && n == 4 && m == "GET") {
    method = "list";
  } else if (parts[3] == "sandboxes" && n == 4 && m == "POST") {
    method = "create";
  } else if (parts[3] == "sandboxes" && n == 5 && m == "DELETE") {
    method = "destroy";
    args["id"] = parts[4];
  } else if (parts[3] == "bulk" && n == 5 && parts[4] == "sandboxes" && m == "POST") {
    method = "create_many";
  } else if (parts[3] == "bulk" && n == 5 && parts[4] == "destroy" && m == "POST") {
    method = "destroy_many";
  }
  Result<json> out = notFound("no such endpoint: " + m + " " + req.path);
  if (!method.empty()) {
    if (m == "POST") {
      auto body = req.readBody(256 << 20);
      json j = body.isOk() ? json::parse(body->empty() ? "{}" : *body, nullptr, false) : json();
      if (!body.isOk()) {
        out = body.status();
      } else if (j.is_discarded() || !j.is_object()) {
        out = invalidArg("body", "body must be a JSON object");
      } else {
        args.update(j);
        if (method != "destroy_many" && !args.contains("backend")) args["backend"] = "container";
        out = service->runJson(method, args);
      }
    } else {
      out = service->runJson(method, args);
    }
  }
  if (!out.isOk()) {
    service->countError(out.status());
    return sendJ(res, httpStatusFor(out.status().code()), proto::errorJson(out.status()));
  }
  sendJ(res, 200, *out);
}

}  // namespace dsec::edge
