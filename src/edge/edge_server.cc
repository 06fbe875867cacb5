#include "edge/edge_server.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/fd.h"

#include "common/base64.h"
#include "common/http_client.h"
#include "common/log.h"
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
  proto::EdgeLink* link;
  {
    std::lock_guard lk(mu_);
    link = link_;  // ids_ is set with it
  }
  w.gauge("dsec_edge_sandboxes", "Sandboxes this node runs.", link ? double(ids_().size()) : 0);
  w.gauge("dsec_edge_capacity_slots", "Sandboxes this node offers at most.", double(opts_.slots));
  w.counter("dsec_edge_creates_total", "Creates the platform asked of this node.",
            double(creates_.load()));
  w.counter("dsec_edge_destroys_total", "Destroys the platform asked of this node.",
            double(destroys_.load()));
  w.counter("dsec_edge_execs_total", "Execs the platform asked of this node.",
            double(execs_.load()));
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
  std::lock_guard lk(errMu_);
  for (auto& [code, n] : errors_) {
    w.counter("dsec_edge_errors_total", help, double(n), {{"code", code}});
  }
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
  // Packs of an earlier process: the platform's fetch of them failed with it.
  (void)removeTree(opts_.dataDir + "/packs");
  {
    std::lock_guard lk(mu_);
    link_ = link;
    ids_ = std::move(ids);
    layers_ = std::move(layers);
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
  LayerDesc d;
  d.digest = j.value("digest", "");
  d.size = j.value("size", int64_t(0));
  d.dataDigest = j.value("data_digest", "");
  d.dataSize = j.value("data_size", int64_t(0));
  d.chunksDigest = j.value("chunks_digest", "");
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
  std::string key = bearerOf(req);
  proto::EdgeLink* link;
  std::string want;
  {
    std::lock_guard lk(mu_);
    link = link_;
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
  if (!link) {
    sendJ(res, 503, proto::errorJson(Status(Code::kUnavailable, "node is starting")));
    return;
  }
  route(req, res, link);
}

void EdgeAgent::route(http::Request& req, http::Response& res, proto::EdgeLink* link) {
  auto fail = [&](const Status& st) {
    {
      std::lock_guard lk(errMu_);
      errors_[codeName(st.code())]++;
    }
    if (!res.started()) sendJ(res, httpStatusFor(st.code()), proto::errorJson(st));
  };
  auto parts = splitString(req.path, '/');  // "", "edge", "v1", coll, id, op
  size_t n = parts.size();
  const std::string& m = req.method;
  if (n < 4 || parts[1] != "edge" || parts[2] != "v1")
    return fail(notFound("no such endpoint: " + req.path));
  auto body = [&]() -> Result<json> {
    ASSIGN_OR_RETURN(std::string b, req.readBody(256 << 20));
    json j = json::parse(b.empty() ? "{}" : b, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return invalidArg("body", "body must be a JSON object");
    return j;
  };
  if (parts[3] == "packs") return servePack(parts, req, res);
  if (parts[3] == "layers" && n == 6 && parts[5] == "evict" && m == "POST") {
    Status st = link->evictLayer(parts[4]);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  // A bulk call's answer: {results: [{id} or {id, error}]}, one per id in
  // order; each error counted as a call's would be.
  auto bulkAnswer = [&](const std::vector<std::string>& ids, const std::vector<Status>& sts) {
    json results = json::array();
    for (size_t i = 0; i < ids.size(); ++i) {
      json one = {{"id", ids[i]}};
      if (i >= sts.size() || !sts[i].isOk()) {
        Status st = i < sts.size() ? sts[i] : internalError("no result");
        {
          std::lock_guard lk(errMu_);
          errors_[codeName(st.code())]++;
        }
        one["error"] = proto::errorJson(st)["error"];
      }
      results.push_back(std::move(one));
    }
    sendJ(res, 200, {{"results", results}});
  };
  if (parts[3] == "bulk" && n == 5 && parts[4] == "sandboxes" && m == "POST") {
    // A batch's creations on this node in one call: {backend, specs: [...]}
    // -> {results: [{id} or {id, error}]}, one per spec, in order. A bad spec
    // refuses the whole call before anything is made.
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto specsJ = (*j).find("specs");
    if (specsJ == (*j).end() || !specsJ->is_array() || specsJ->empty() || specsJ->size() > 4096) {
      return fail(invalidArg("specs", "specs must be a list of 1 to 4096 sandbox specs"));
    }
    std::vector<proto::SandboxSpec> specs;
    specs.reserve(specsJ->size());
    for (auto& sj : *specsJ) {
      auto spec = proto::specFromJson(sj);
      if (!spec.isOk()) return fail(spec.status());
      specs.push_back(std::move(*spec));
    }
    creates_ += specs.size();
    std::vector<std::string> ids;
    for (auto& sp : specs) ids.push_back(sp.id);
    auto backend = proto::parseBackend((*j).value("backend", "container"));
    if (!backend) return fail(invalidArg("backend", "unknown backend"));
    return bulkAnswer(ids, link->createMany(*backend, specs));
  }
  if (parts[3] == "bulk" && n == 5 && parts[4] == "destroy" && m == "POST") {
    // Destroys on this node in one call (a bulk destroy's share of it):
    // {ids: [...]} -> {results: [{id} or {id, error}]}, one per id, in order.
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto idsJ = (*j).find("ids");
    if (idsJ == (*j).end() || !idsJ->is_array() || idsJ->empty() || idsJ->size() > 4096) {
      return fail(invalidArg("ids", "ids must be a list of 1 to 4096 sandbox ids"));
    }
    std::vector<std::string> ids;
    ids.reserve(idsJ->size());
    for (auto& i : *idsJ) {
      if (!i.is_string()) return fail(invalidArg("ids", "ids must be strings"));
      ids.push_back(i.get<std::string>());
    }
    destroys_ += ids.size();
    return bulkAnswer(ids, link->destroyMany(ids));
  }
  if (parts[3] != "sandboxes") return fail(notFound("no such endpoint: " + req.path));
  if (n == 4) {
    if (m == "GET") return sendJ(res, 200, {{"sandboxes", ids_()}});
    if (m != "POST") return fail(invalidArg("method", "method " + m + " not allowed"));
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto spec = proto::specFromJson((*j).value("spec", json::object()));
    if (!spec.isOk()) return fail(spec.status());
    auto backend = proto::parseBackend((*j).value("backend", "container"));
    if (!backend) return fail(invalidArg("backend", "unknown backend"));
    creates_++;
    Status st = link->create(*backend, *spec);
    return st.isOk() ? sendJ(res, 200, {{"id", spec->id}}) : fail(st);
  }
  const std::string& id = parts[4];
  if (n == 5) {
    if (m != "DELETE") return fail(invalidArg("method", "method " + m + " not allowed"));
    destroys_++;
    Status st = link->destroy(id);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  const std::string& op = parts[5];
  if (op == "exec" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto spec = proto::execFromJson(*j);
    if (!spec.isOk()) return fail(spec.status());
    execs_++;
    bool stream = req.param("stream").value_or("") == "1";
    if (Status st = res.beginChunked(200, "application/x-ndjson"); !st.isOk()) return;
    std::mutex wmu;
    proto::OutputSink sink;
    if (stream) {
      sink = [&](bool isErr, std::string_view data) -> Status {
        json ev = {{isErr ? "e" : "o", base64Encode(data)}};
        std::lock_guard lk(wmu);
        return res.write(ev.dump() + "\n");
      };
    }
    auto r = link->exec(id, *spec, sink);
    json last = r.isOk() ? json{{"result", proto::toJson(*r)}} : proto::errorJson(r.status());
    if (!r.isOk()) {
      std::lock_guard lk(errMu_);
      errors_[codeName(r.status().code())]++;
    }
    std::lock_guard lk(wmu);
    (void)res.write(last.dump() + "\n");
    (void)res.finish();
    return;
  }
  if (op == "file" && m == "PUT") {
    auto path = req.param("path");
    if (!path) return fail(invalidArg("path", "path is required"));
    int mode = std::atoi(req.param("mode").value_or("420").c_str());
    proto::ByteSource src = [&](char* buf, size_t len) { return req.readSome(buf, len); };
    auto w = link->writeFile(id, *path, mode, src);
    return w.isOk() ? sendJ(res, 200, {{"written", *w}}) : fail(w.status());
  }
  if (op == "file" && m == "GET") {
    auto path = req.param("path");
    if (!path) return fail(invalidArg("path", "path is required"));
    std::optional<uint64_t> size;
    Status st = link->readFile(
        id, *path,
        [&](std::optional<uint64_t> s) -> Status {
          size = s;
          return s ? res.beginFixed(200, "application/octet-stream", *s)
                   : res.beginChunked(200, "application/octet-stream");
        },
        [&](std::string_view data) { return res.write(data); });
    if (!st.isOk()) return fail(st);
    if (!size) (void)res.finish();
    return;
  }
  if (op == "filecall" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto op = proto::parseAgentOp((*j).value("op", ""));
    if (!op) return fail(invalidArg("op", "unknown agent op"));
    auto r = link->agentOp(id, *op, (*j).value("json", "{}"));
    return r.isOk() ? (void)res.send(200, "application/json", *r) : fail(r.status());
  }
  if (op == "stats" && m == "GET") {
    auto s = link->stats(id);
    if (!s.isOk()) return fail(s.status());
    return sendJ(res, 200, proto::toJson(*s));
  }
  if (op == "pause" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    // {"paused": true, "memory": "disk"}: to disk (VM backends).
    bool toDisk = (*j).value("memory", std::string()) == "disk";
    bool paused = (*j).value("paused", true);
    Status st = paused && toDisk ? link->hibernate(id) : link->pause(id, paused);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  if (op == "limits" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto l = proto::limitsFromJson(*j);
    if (!l.isOk()) return fail(l.status());
    Status st = link->setLimits(id, *l);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  if (op == "egress" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    std::vector<proto::EgressRule> rules;
    for (auto& x : (*j).value("rules", json::array())) {
      auto r = proto::ruleFromJson(x);
      if (!r.isOk()) return fail(r.status());
      rules.push_back(*r);
    }
    Status st = link->setEgress(id, rules);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  if (op == "pack_diff" && m == "POST") return packDiff(id, res, link);
  if (op == "screenshot" && m == "GET") {
    auto png = link->screenshot(id);
    if (!png.isOk()) return fail(png.status());
    (void)res.send(200, "image/png", *png);
    return;
  }
  if (op == "input" && m == "POST") {
    auto j = body();
    if (!j.isOk()) return fail(j.status());
    auto a = proto::inputFromJson(*j);
    if (!a.isOk()) return fail(a.status());
    Status st = link->input(id, *a);
    return st.isOk() ? sendJ(res, 200, json::object()) : fail(st);
  }
  if (op == "egress_denials" && m == "GET") {
    auto d = link->egressDenials(id);
    if (!d.isOk()) return fail(d.status());
    return sendJ(res, 200, proto::toJson(*d));
  }
  fail(notFound("no such endpoint: " + m + " " + req.path));
}

void EdgeAgent::countError(const Status& st) {
  std::lock_guard lk(errMu_);
  errors_[codeName(st.code())]++;
}

void EdgeAgent::packDiff(const std::string& id, http::Response& res, proto::EdgeLink* link) {
  auto fail = [&](const Status& st) {
    countError(st);
    if (!res.started()) sendJ(res, httpStatusFor(st.code()), proto::errorJson(st));
  };
  std::string root = opts_.dataDir + "/packs";
  if (Status st = makeDirs(root, 0700); !st.isOk()) return fail(st);
  // Packs the platform never fetched (it died meanwhile) go first.
  std::vector<std::string> stale;
  {
    std::lock_guard lk(mu_);
    double now = nowSeconds();
    for (auto it = packs_.begin(); it != packs_.end();) {
      if (now - it->second.second > kPackKeepS) {
        stale.push_back(it->first);
        it = packs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : stale) (void)removeTree(root + "/" + p);
  std::string pack = randomHex(8);
  std::string dir = root + "/" + pack;
  auto layer = link->packDiff(id, dir);
  if (!layer.isOk()) {
    (void)removeTree(dir);
    return fail(layer.status());
  }
  {
    std::lock_guard lk(mu_);
    packs_[pack] = {*layer, nowSeconds()};
  }
  sendJ(res, 200,
        {{"pack", pack},
         {"digest", layer->digest},
         {"size", layer->size},
         {"data_digest", layer->dataDigest},
         {"data_size", layer->dataSize}});
}

void EdgeAgent::servePack(const std::vector<std::string>& parts, http::Request& req,
                          http::Response& res) {
  auto fail = [&](const Status& st) {
    countError(st);
    if (!res.started()) sendJ(res, httpStatusFor(st.code()), proto::errorJson(st));
  };
  // "", "edge", "v1", "packs", pack, [meta|data]
  if (parts.size() < 5) return fail(notFound("no such endpoint: " + req.path));
  const std::string& pack = parts[4];
  image::BuiltLayer layer;
  {
    std::lock_guard lk(mu_);
    auto it = packs_.find(pack);
    if (it == packs_.end()) return fail(notFound("no pack " + pack + " on this node"));
    layer = it->second.first;
    if (parts.size() == 5 && req.method == "DELETE") packs_.erase(it);
  }
  if (parts.size() == 5 && req.method == "DELETE") {
    (void)removeTree(opts_.dataDir + "/packs/" + pack);
    return sendJ(res, 200, json::object());
  }
  if (parts.size() != 6 || req.method != "GET" || (parts[5] != "meta" && parts[5] != "data")) {
    return fail(notFound("no such endpoint: " + req.method + " " + req.path));
  }
  const std::string& path = parts[5] == "meta" ? layer.path : layer.dataPath;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return fail(sysError("open " + path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return fail(sysError("stat " + path));
  if (Status s = res.beginFixed(200, "application/octet-stream", uint64_t(st.st_size)); !s.isOk()) {
    return;
  }
  std::string buf(1 << 20, '\0');
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // a short body tells the platform (it checks size and digest)
    if (!res.write(std::string_view(buf.data(), size_t(n))).isOk()) break;
  }
}

}  // namespace dsec::edge
