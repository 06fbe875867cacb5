// E2B compatibility, the control API (docs/e2b.md): what E2B's SDK calls
// under E2B_API_URL = <dsec>/e2b/api, translated to dsec's own operations.
// A template is a dsec image; the API key (X-API-KEY) is a dsec key, so
// tenants, quotas and policies apply as to any call. Errors are E2B's
// {"code": <HTTP status>, "message": ...}: its SDK reads the JSON code.
#include <cmath>

#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

namespace {

// The envd version dsec's envd surface answers as: the SDK's feature gates
// (docs/e2b.md, "Versions") turn on what dsec serves.
constexpr const char* kEnvdVersion = "0.6.4";
// E2B's default sandbox timeout when create names none.
constexpr int64_t kDefaultTimeoutS = 300;
constexpr int64_t kMaxListLimit = 1000;

void e2bError(http::Response& res, const Status& st) {
  std::string msg = st.message();
  if (!st.field().empty()) msg += " (field " + st.field() + ")";
  int status = httpStatusFor(st.code());
  if (status == 401) res.setHeader("WWW-Authenticate", "ApiKey");
  (void)res.send(status, "application/json",
                 dumpJson(json{{"code", status}, {"message", msg}}));
}

std::string e2bState(SandboxState s) {
  return s == SandboxState::kPaused ? "paused" : "running";
}

// E2B's `metadata` query: "k=v&k2=v2", each key and value URL-encoded again
// (the SDK encodes it three times in all; the server's own decoding took one).
Result<std::map<std::string, std::string>> metadataQuery(const std::string& q) {
  std::map<std::string, std::string> out;
  for (const std::string& pair : splitString(q, '&')) {
    if (pair.empty()) continue;
    size_t eq = pair.find('=');
    std::string k, v;
    auto plus = [](std::string s) {
      for (char& c : s) {
        if (c == '+') c = ' ';
      }
      return s;
    };
    if (!http::percentDecode(plus(pair.substr(0, eq)), k) ||
        (eq != std::string::npos && !http::percentDecode(plus(pair.substr(eq + 1)), v))) {
      return invalidArg("metadata", "metadata is not URL-encoded");
    }
    // One more level: the SDK encodes each key and value before joining.
    std::string k2, v2;
    if (!http::percentDecode(k, k2) || !http::percentDecode(v, v2)) {
      return invalidArg("metadata", "metadata is not URL-encoded");
    }
    out[k2] = v2;
  }
  return out;
}

}  // namespace

std::string Platform::envdToken(const std::string& sandboxId) const {
  // HMAC-SHA256(the platform's token, sandbox id): the same on every replica
  // of one platform, nothing to store, and worth nothing for another sandbox.
  return "ea_" + hmacSha256Hex(opts_.token, "dsec-e2b-envd/1 " + sandboxId);
}

json Platform::e2bSandbox(const SandboxRecord& r) const {
  return {{"sandboxID", r.id},
          {"templateID", r.image},
          {"alias", r.image},
          {"clientID", r.node},
          {"envdVersion", kEnvdVersion},
          {"envdAccessToken", envdToken(r.id)},
          {"trafficAccessToken", nullptr},
          {"domain", nullptr}};
}

json Platform::e2bListed(const SandboxRecord& r) const {
  return {{"sandboxID", r.id},
          {"templateID", r.image},
          {"alias", r.image},
          {"clientID", r.node},
          {"metadata", r.labels},
          {"startedAt", isoTime(r.createdAt)},
          {"endAt", isoTime(r.expiresAt > 0 ? r.expiresAt : r.createdAt + 86400 * 365)},
          {"state", e2bState(r.state)},
          {"cpuCount", std::max<int64_t>(1, int64_t(std::ceil(r.cpu)))},
          {"memoryMB", r.memoryMb},
          {"diskSizeMB", r.diskMb},
          {"envdVersion", kEnvdVersion},
          {"volumeMounts", json::array()}};
}

Result<SandboxRecord> Platform::visibleSandbox(const std::string& id) {
  if (store_->shared()) refreshSandbox(id, !othersAlive_);
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || !mayAccess(currentCaller(), it->second.owner) ||
      !proto::isUp(it->second.state)) {
    return Status(Code::kNotFound, "sandbox " + id + " not found", 0, "sandboxID");
  }
  return it->second;
}

void Platform::e2bControl(const std::vector<std::string>& p, http::Request& req,
                          http::Response& res) {
  // p: the path after /e2b/api, split ("v2", "sandboxes", ...).
  std::string key = req.header("x-api-key");
  if (key.empty() && startsWith(req.header("authorization"), "Bearer ")) {
    key = req.header("authorization").substr(7);
  }
  auto caller = key.empty() ? Result<Caller>(Status(Code::kUnauthenticated, "missing X-API-Key"))
                            : tenants_->authenticate(key);
  if (!caller.isOk()) return e2bError(res, caller.status());
  CallerScope scope(*caller);
  const std::string& m = req.method;
  size_t off = !p.empty() && p[0] == "v2" ? 1 : 0;  // v1 and v2 paths are served alike
  if (p.size() <= off || p[off] != "sandboxes") {
    return e2bError(res, notFound("no such E2B endpoint: " + m + " " + req.path));
  }
  const size_t n = p.size() - off;  // "sandboxes", id, op
  if (n == 1) {
    if (m == "POST") return e2bCreate(req, res);
    if (m == "GET") return e2bList(req, res);
    return e2bError(res, methodNotAllowed(req));
  }
  const std::string& id = p[off + 1];
  auto rec = visibleSandbox(id);
  if (!rec.isOk()) return e2bError(res, rec.status());
  if (n == 2) {
    if (m == "GET") {
      json j = e2bListed(*rec);
      j["domain"] = nullptr;
      j["envdAccessToken"] = envdToken(id);
      j["allowInternetAccess"] = nullptr;
      j["lifecycle"] = {{"onTimeout", "kill"}, {"autoResume", false}};
      return sendJson(res, 200, dumpJson(j));
    }
    if (m == "DELETE") {
      auto d = destroy(id, SandboxState::kStopped, "");
      if (!d.isOk()) return e2bError(res, d.status());
      return (void)res.send(204, "", "");
    }
    return e2bError(res, methodNotAllowed(req));
  }
  const std::string& op = p[off + 2];
  if (n == 3 && op == "timeout" && m == "POST") {
    auto body = parseObject(req, {"timeout"});
    if (!body.isOk()) return e2bError(res, body.status());
    auto t = getInt(*body, "timeout", -1, 0, 604800);
    if (!t.isOk()) return e2bError(res, t.status());
    if (*t < 0) return e2bError(res, invalidArg("timeout", "timeout (seconds) is required"));
    auto r = expireIn(id, double(*t));
    if (!r.isOk()) return e2bError(res, r.status());
    return (void)res.send(204, "", "");
  }
  if (n == 3 && op == "pause" && m == "POST") {
    auto body = parseObject(req, {"memory"}, true);
    if (!body.isOk()) return e2bError(res, body.status());
    if (rec->state == SandboxState::kPaused) {
      return e2bError(res, Status(Code::kConflict, "sandbox " + id + " is already paused"));
    }
    auto r = pauseOrResume(id, true, false);
    if (!r.isOk()) return e2bError(res, r.status());
    return (void)res.send(204, "", "");
  }
  if (n == 3 && (op == "connect" || op == "resume") && m == "POST") {
    // Resumes a paused sandbox; a timeout only ever lengthens its life.
    auto body = parseObject(req, {"timeout", "memory", "autoPause"}, true);
    if (!body.isOk()) return e2bError(res, body.status());
    auto t = getInt(*body, "timeout", -1, 0, 604800);
    if (!t.isOk()) return e2bError(res, t.status());
    bool wasPaused = rec->state == SandboxState::kPaused;
    SandboxRecord r = *rec;
    if (wasPaused) {
      auto resumed = pauseOrResume(id, false, false);
      if (!resumed.isOk()) return e2bError(res, resumed.status());
      r = *resumed;
    }
    if (*t >= 0 && (r.expiresAt == 0 || nowSeconds() + double(*t) > r.expiresAt)) {
      if (r.expiresAt != 0) {
        auto longer = expireIn(id, double(*t));
        if (!longer.isOk()) return e2bError(res, longer.status());
        r = *longer;
      }
    }
    return sendJson(res, wasPaused ? 201 : 200, dumpJson(e2bSandbox(r)));
  }
  if (n == 3 && op == "metrics" && m == "GET") {
    json arr = json::array();
    if (auto s = cluster_->stats(id); s.isOk() && rec->state == SandboxState::kRunning) {
      double now = nowSeconds();
      arr.push_back({{"timestamp", isoTime(now)},
                     {"timestampUnix", int64_t(now)},
                     {"cpuUsedPct", 0},
                     {"cpuCount", std::max<int64_t>(1, int64_t(std::ceil(rec->cpu)))},
                     {"memUsed", s->memoryBytes},
                     {"memTotal", rec->memoryMb << 20},
                     {"memCache", 0},
                     {"diskUsed", 0},
                     {"diskTotal", rec->diskMb << 20}});
    }
    return sendJson(res, 200, dumpJson(arr));
  }
  e2bError(res, notFound("no such E2B endpoint: " + m + " " + req.path));
}

void Platform::e2bCreate(http::Request& req, http::Response& res) {
  auto body = parseObject(req, {"templateID", "timeout", "metadata", "envVars", "autoPause",
                                "autoPauseMemory", "autoResume", "allow_internet_access",
                                "network", "secure", "mcp", "volumeMounts", "iam"});
  if (!body.isOk()) return e2bError(res, body.status());
  const json& b = *body;
  auto tmpl = getString(b, "templateID", "", 512);
  if (!tmpl.isOk()) return e2bError(res, tmpl.status());
  if (tmpl->empty()) return e2bError(res, invalidArg("templateID", "templateID is required"));
  auto timeout = getInt(b, "timeout", kDefaultTimeoutS, 0, 604800);
  if (!timeout.isOk()) return e2bError(res, timeout.status());
  // What dsec cannot do as E2B does is refused, not ignored.
  for (const char* unsupported : {"mcp", "volumeMounts", "iam", "network"}) {
    if (b.contains(unsupported) && !b[unsupported].is_null()) {
      return e2bError(res, invalidArg(unsupported, std::string(unsupported) +
                                                       " is not supported by dsec (docs/e2b.md)"));
    }
  }
  if (b.value("allow_internet_access", false) == true) {
    return e2bError(res, invalidArg("allow_internet_access",
                                    "egress follows the sandbox's dsec policy (none by default); "
                                    "see docs/e2b.md"));
  }
  json spec = {{"image", *tmpl}, {"ttl_s", *timeout}};
  if (b.contains("metadata") && !b["metadata"].is_null()) spec["labels"] = b["metadata"];
  if (b.contains("envVars") && !b["envVars"].is_null()) spec["env"] = b["envVars"];
  auto r = checkCreate(spec);
  if (!r.isOk()) {
    Status st = r.status();
    // The SDK's names for what dsec calls image, labels and env.
    if (st.field() == "image") st = Status(st.code(), st.message(), st.sysErrno(), "templateID");
    if (st.field() == "labels") st = Status(st.code(), st.message(), st.sysErrno(), "metadata");
    if (st.field() == "env") st = Status(st.code(), st.message(), st.sysErrno(), "envVars");
    return e2bError(res, st);
  }
  auto made = launch(std::move(*r));
  if (!made.isOk()) return e2bError(res, made.status());
  sendJson(res, 201, dumpJson(e2bSandbox(*made)));
}

void Platform::e2bList(http::Request& req, http::Response& res) {
  if (store_->shared()) syncSandboxes();
  std::set<SandboxState> states = {SandboxState::kRunning, SandboxState::kPaused};
  if (auto s = req.param("state"); s && !s->empty()) {
    states.clear();
    for (const std::string& one : splitString(*s, ',')) {
      if (one == "running") {
        states.insert(SandboxState::kRunning);
      } else if (one == "paused") {
        states.insert(SandboxState::kPaused);
      } else {
        return e2bError(res, invalidArg("state", "state is running and/or paused"));
      }
    }
  }
  std::map<std::string, std::string> want;
  if (auto q = req.param("metadata"); q && !q->empty()) {
    auto md = metadataQuery(*q);
    if (!md.isOk()) return e2bError(res, md.status());
    want = *md;
  }
  int64_t limit = 100;
  if (auto l = req.param("limit")) {
    char* end = nullptr;
    limit = std::strtoll(l->c_str(), &end, 10);
    if (l->empty() || *end != '\0' || limit < 1 || limit > kMaxListLimit) {
      return e2bError(res, invalidArg("limit", "limit is 1 to 1000"));
    }
  }
  // Pages in id order: the next token is the last id of a page.
  std::string after = req.param("nextToken").value_or("");
  json arr = json::array();
  std::string next;
  {
    std::lock_guard lk(mu_);
    for (auto it = sandboxes_.upper_bound(after); it != sandboxes_.end(); ++it) {
      const SandboxRecord& r = it->second;
      if (!mayAccess(currentCaller(), r.owner) || !states.count(r.state)) continue;
      bool match = true;
      for (auto& [k, v] : want) {
        auto l = r.labels.find(k);
        match = match && l != r.labels.end() && l->second == v;
      }
      if (!match) continue;
      if (int64_t(arr.size()) == limit) {
        next = arr.back()["sandboxID"].get<std::string>();
        break;
      }
      arr.push_back(e2bListed(r));
    }
  }
  if (!next.empty()) res.setHeader("X-Next-Token", next);
  sendJson(res, 200, dumpJson(arr));
}

}  // namespace dsec::platform
