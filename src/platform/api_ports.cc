// Exposed ports (docs/ports.md): POST/GET /v1/sandboxes/{id}/ports,
// DELETE /v1/sandboxes/{id}/ports/{port}, and the reverse proxy that serves
// them (common/http_proxy.h), reached in two forms:
//  - the host form, for browsers: http://{port}-{id}.{expose domain}[:port]/,
//    each exposure its own origin;
//  - the path form, for programs: /ports/{id}/{port}/{rest}.
// Credentials, checked on every request: the exposure's URL token
// (dpt_… = HMAC-SHA256(platform token, "dsec-port/1 id port gen"): the same
// on every replica, nothing stored, void once the port is rotated or
// unexposed) as ?dsec_token=, a cookie (host form), Dsec-Port-Token, or
// Authorization: Bearer; or the API key of the sandbox's tenant or an admin
// in Authorization. Whatever was ours is stripped before the request goes on.
#include <charconv>

#include "common/http_proxy.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

namespace {

constexpr size_t kMaxPortsPerSandbox = 16;
constexpr const char* kCookie = "dsec_port";

bool parsePort(std::string_view s, int& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out >= 1 && out <= 65535;
}

// The target without the dsec_token query parameter; `token` gets its value.
std::string stripToken(const std::string& target, std::string& token) {
  size_t q = target.find('?');
  if (q == std::string::npos) return target;
  std::string path = target.substr(0, q);
  std::string kept;
  for (auto& kv : splitString(target.substr(q + 1), '&')) {
    if (startsWith(kv, "dsec_token=")) {
      std::string v;
      if (http::percentDecode(kv.substr(11), v)) token = v;
      continue;
    }
    if (!kv.empty()) kept += (kept.empty() ? "" : "&") + kv;
  }
  return kept.empty() ? path : path + "?" + kept;
}

// The Cookie header without our cookie; `token` gets its value.
std::string stripCookie(const std::string& header, std::string& token) {
  std::string kept;
  for (auto part : splitString(header, ';')) {
    std::string p(trimOws(part));
    if (startsWith(p, std::string(kCookie) + "=")) {
      token = p.substr(strlen(kCookie) + 1);
      continue;
    }
    if (!p.empty()) kept += (kept.empty() ? "" : "; ") + p;
  }
  return kept;
}

// A Host header's name, lower-cased, without its port.
std::string hostName(std::string_view header) {
  std::string host = asciiLower(header);
  size_t colon = host.rfind(':');
  if (colon != std::string::npos && host.find(']') == std::string::npos) host.resize(colon);
  return host;
}

http::ProxyDecision answer(const Status& st) {
  http::ProxyDecision d;
  d.status = httpStatusFor(st.code());
  d.body = errorBody(st);
  if (st.code() == Code::kUnauthenticated) d.answerHeaders.emplace_back("WWW-Authenticate", "Bearer");
  return d;
}

}  // namespace

std::string Platform::portToken(const std::string& id, int port, uint64_t gen) const {
  return "dpt_" + hmacSha256Hex(opts_.token, "dsec-port/1 " + id + " " + std::to_string(port) +
                                                 " " + std::to_string(gen));
}

void Platform::setListenUrl(std::string url) {
  std::lock_guard lk(mu_);
  listenUrl_ = std::move(url);
}

json Platform::portJson(const SandboxRecord& r, const SandboxRecord::ExposedPort& p) {
  std::string base, listen;
  {
    std::lock_guard lk(mu_);
    listen = listenUrl_;
  }
  base = opts_.publicUrl.empty() ? listen : opts_.publicUrl;
  while (!base.empty() && base.back() == '/') base.pop_back();
  std::string token = portToken(r.id, p.port, p.gen);
  // The host form: the listener's port unless the operator names another.
  std::string hostPort;
  if (opts_.exposePort > 0) {
    hostPort = ":" + std::to_string(opts_.exposePort);
  } else if (opts_.exposePort == 0) {
    size_t colon = listen.rfind(':');
    if (colon != std::string::npos && colon > 6) hostPort = listen.substr(colon);
  }
  std::string url = opts_.exposeScheme + "://" + std::to_string(p.port) + "-" + r.id + "." +
                    opts_.exposeDomain + hostPort + "/";
  std::string pathUrl = base + "/ports/" + r.id + "/" + std::to_string(p.port) + "/";
  return {{"port", p.port},
          {"gen", p.gen},
          {"token", token},
          {"url", url + "?dsec_token=" + token},
          {"path_url", pathUrl},
          {"created_at", p.createdAt},
          {"expires_at", p.expiresAt > 0 ? json(p.expiresAt) : json(nullptr)}};
}

Status Platform::pushPorts(const SandboxRecord& r) {
  std::vector<proto::PortGen> ports;
  double now = nowSeconds();
  for (auto& p : r.ports) {
    if (p.liveAt(now)) ports.push_back({p.port, p.gen});
  }
  return cluster_->setPorts(r.id, ports);
}

void Platform::portsApi(const std::string& id, const std::vector<std::string>& parts,
                        http::Request& req, http::Response& res) {
  const std::string& m = req.method;
  const size_t n = parts.size();
  SandboxRecord r;
  {
    std::lock_guard lk(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return sendError(res, notFound("sandbox " + id + " not found"));
    r = it->second;
  }
  if (n == 5 && m == "GET") {
    json list = json::array();
    double now = nowSeconds();
    for (auto& p : r.ports) {
      if (p.liveAt(now)) list.push_back(portJson(r, p));
    }
    return sendJson(res, 200, dumpJson(json{{"ports", list}}));
  }
  if (n == 5 && m == "POST") {
    auto j = parseObject(req, {"port", "ttl_s", "rotate"});
    if (!j.isOk()) return sendError(res, j.status());
    if (!j->contains("port")) return sendError(res, invalidArg("port", "port is required"));
    auto port = getInt(*j, "port", 0, 1, 65535);
    if (!port.isOk()) return sendError(res, port.status());
    auto ttl = getNumber(*j, "ttl_s", 0, 0, 365.0 * 86400);
    if (!ttl.isOk()) return sendError(res, ttl.status());
    auto rotate = getBool(*j, "rotate", false);
    if (!rotate.isOk()) return sendError(res, rotate.status());
    if (r.backend == BackendKind::kFncall) {
      return sendError(res, Status(Code::kFailedPrecondition,
                                   "fncall sandboxes keep no servers: nothing to expose", 0,
                                   "backend"));
    }
    if (r.backend != BackendKind::kContainer) {
      return sendError(res, Status(Code::kFailedPrecondition,
                                   std::string("exposing ports of a ") + proto::backendName(r.backend) +
                                       " sandbox is not supported yet (container only)",
                                   0, "backend"));
    }
    if (isFinal(r.state) || r.state == SandboxState::kCreating) {
      return sendError(res, Status(Code::kFailedPrecondition,
                                   "sandbox " + id + " is " + proto::stateName(r.state)));
    }
    int status = 201;
    SandboxRecord::ExposedPort result;
    {
      std::lock_guard lk(mu_);
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end()) return sendError(res, notFound("sandbox " + id + " not found"));
      SandboxRecord& rec = it->second;
      double now = nowSeconds();
      // Expired exposures go first: they no longer count.
      std::erase_if(rec.ports, [&](auto& p) { return !p.liveAt(now); });
      auto p = std::find_if(rec.ports.begin(), rec.ports.end(),
                            [&](auto& x) { return x.port == int(*port); });
      if (p == rec.ports.end()) {
        if (rec.ports.size() >= kMaxPortsPerSandbox) {
          return sendError(res, Status(Code::kResourceExhausted,
                                       "a sandbox exposes at most " +
                                           std::to_string(kMaxPortsPerSandbox) + " ports",
                                       0, "port"));
        }
        rec.ports.push_back({int(*port), 1, now, *ttl > 0 ? now + *ttl : 0});
        p = rec.ports.end() - 1;
      } else {
        status = 200;
        if (*rotate) {
          ++p->gen;
          p->createdAt = now;
        }
        if (j->contains("ttl_s")) p->expiresAt = *ttl > 0 ? now + *ttl : 0;
      }
      if (p->expiresAt > 0) nextPortExpiry_ = std::min(nextPortExpiry_, p->expiresAt);
      result = *p;
      rec.updatedAt = now;
      r = rec;
    }
    if (Status st = store_->putSandbox(r); !st.isOk()) return sendError(res, st);
    // A rotation cuts the connections made with the old token.
    if (Status st = pushPorts(r); !st.isOk()) {
      log::warn("sandbox " + id + ": set ports: " + st.toString());
    }
    return sendJson(res, status, dumpJson(portJson(r, result)));
  }
  if (n == 6) {
    int port = 0;
    if (!parsePort(parts[5], port)) {
      return sendError(res, invalidArg("port", "port must be an integer from 1 to 65535"));
    }
    if (m != "DELETE" && m != "GET") return sendError(res, methodNotAllowed(req));
    if (m == "GET") {
      for (auto& p : r.ports) {
        if (p.port == port && p.liveAt(nowSeconds())) {
          return sendJson(res, 200, dumpJson(portJson(r, p)));
        }
      }
      return sendError(res, Status(Code::kNotFound, "port " + parts[5] + " is not exposed", 0,
                                   "port"));
    }
    {
      std::lock_guard lk(mu_);
      auto it = sandboxes_.find(id);
      if (it == sandboxes_.end()) return sendError(res, notFound("sandbox " + id + " not found"));
      auto& ports = it->second.ports;
      auto before = ports.size();
      std::erase_if(ports, [&](auto& p) { return p.port == port; });
      if (ports.size() == before) {
        return sendError(res, Status(Code::kNotFound, "port " + parts[5] + " is not exposed", 0,
                                     "port"));
      }
      it->second.updatedAt = nowSeconds();
      r = it->second;
    }
    if (Status st = store_->putSandbox(r); !st.isOk()) return sendError(res, st);
    if (Status st = pushPorts(r); !st.isOk()) {
      log::warn("sandbox " + id + ": set ports: " + st.toString());
    }
    return (void)res.send(204, "", "");
  }
  sendError(res, methodNotAllowed(req));
}

void Platform::expirePorts() {
  double now = nowSeconds();
  std::vector<SandboxRecord> changed;
  {
    std::lock_guard lk(mu_);
    if (now < nextPortExpiry_) return;
    nextPortExpiry_ = std::numeric_limits<double>::infinity();
    for (auto& [id, r] : sandboxes_) {
      bool any = false;
      for (auto& p : r.ports) {
        if (!p.liveAt(now)) {
          any = true;
        } else if (p.expiresAt > 0) {
          nextPortExpiry_ = std::min(nextPortExpiry_, p.expiresAt);
        }
      }
      if (!any) continue;
      std::erase_if(r.ports, [&](auto& p) { return !p.liveAt(now); });
      r.updatedAt = now;
      changed.push_back(r);
    }
  }
  for (auto& r : changed) {
    log::info("sandbox " + r.id + ": an exposed port's ttl ran out");
    if (Status st = store_->putSandbox(r); !st.isOk()) log::warn(st.toString());
    if (!isFinal(r.state)) (void)pushPorts(r);
  }
}

void Platform::writePortMetrics(metrics::Writer& w) {
  auto st = http::proxyStats();
  w.gauge("dsec_port_connections", "Client connections open to exposed ports", double(st.open));
  w.counter("dsec_port_connections_total", "Client connections taken to exposed ports",
            double(st.connections));
  w.counter("dsec_port_bytes_total", "Bytes relayed to and from exposed ports",
            double(st.bytesUp), {{"dir", "in"}});
  w.counter("dsec_port_bytes_total", "Bytes relayed to and from exposed ports",
            double(st.bytesDown), {{"dir", "out"}});
  w.declare("dsec_port_responses_total", metrics::Type::kCounter,
            "Responses of exposed ports by status (the proxy's own answers included)");
  for (auto& [code, n] : portResponses_.values()) {
    w.counter("dsec_port_responses_total", "", double(n), {{"code", code}});
  }
}

// ---------------------------------------------------------------- the proxy

http::ServerOptions::Taker Platform::divertPort(const http::Request& req) {
  // The host form names its sandbox and port once, in the connection's first
  // Host; the path form in each request's target, which routePort reads.
  std::string id;
  int port = 0;
  const bool hostForm = !startsWith(req.path, "/ports/");
  if (!hostForm) {
    // /ports/{id}/{port}[/...]: anything shorter is the API's 404.
    if (splitString(req.path, '/').size() < 4) return {};
  } else {
    if (opts_.exposeDomain.empty()) return {};
    std::string host = hostName(req.header("host"));
    std::string suffix = "." + asciiLower(opts_.exposeDomain);
    if (host.size() <= suffix.size() || host.compare(host.size() - suffix.size(), suffix.size(), suffix) != 0) {
      return {};
    }
    std::string label = host.substr(0, host.size() - suffix.size());
    size_t dash = label.find('-');
    if (dash == std::string::npos || label.find('.') != std::string::npos) return {};
    if (!parsePort(label.substr(0, dash), port)) return {};
    id = label.substr(dash + 1);
  }
  return [this, id, port, hostForm](UniqueFd sock, std::string bytes) {
    http::serveProxy(
        std::move(sock), std::move(bytes),
        [this, id, port, hostForm](const http::ProxyRequest& r) {
          auto d = routePort(r, id, port, hostForm);
          // The path form shares the API's origin and a client's connection
          // pool: one exchange per connection, whatever the answer.
          if (!hostForm) d.close = true;
          return d;
        },
        proxyOpts_);
  };
}

http::ProxyDecision Platform::routePort(const http::ProxyRequest& r, const std::string& id,
                                        int port, bool hostForm) {
  // Every request of a kept-alive connection is routed again: a request for
  // another sandbox or port on a host-form connection is refused.
  std::string rid = id;
  int rport = port;
  std::string rest = r.target;
  if (!hostForm) {
    // /ports/{id}/{port}/{rest}
    if (!startsWith(r.target, "/ports/")) {
      return answer(Status(Code::kNotFound, "this connection serves only /ports/ URLs"));
    }
    size_t a = r.target.find('/', 7);
    std::string tid = r.target.substr(7, a == std::string::npos ? std::string::npos : a - 7);
    size_t b = a == std::string::npos ? std::string::npos : r.target.find_first_of("/?", a + 1);
    std::string tport = a == std::string::npos
                            ? ""
                            : r.target.substr(a + 1, b == std::string::npos ? std::string::npos
                                                                          : b - a - 1);
    std::string decoded;
    if (!http::percentDecode(tid, decoded)) decoded.clear();
    rid = decoded;
    if (!parsePort(tport, rport)) {
      return answer(invalidArg("port", "port must be an integer from 1 to 65535"));
    }
    rest = b == std::string::npos ? "/" : r.target.substr(b);
    if (!rest.empty() && rest[0] == '?') rest = "/" + rest;
  } else if (hostName(r.header("host")) !=
             std::to_string(port) + "-" + id + "." + asciiLower(opts_.exposeDomain)) {
    return answer(Status(Code::kNotFound, "this connection serves " + std::to_string(port) +
                                              "-" + id + " only"));
  }

  // The credential: a URL token in the query, a cookie, a header, or a key.
  std::string token, queryToken, cookieToken;
  std::string target = stripToken(rest, queryToken);
  std::string cookies;
  bool hadCookie = false;
  for (auto& [k, v] : r.headers) {
    if (strcasecmp(k.c_str(), "cookie") == 0) {
      std::string t;
      std::string kept = stripCookie(v, t);
      if (!t.empty()) cookieToken = t;
      if (!kept.empty()) cookies += (cookies.empty() ? "" : "; ") + kept;
      hadCookie = true;
    }
  }
  std::string headerToken = r.header("dsec-port-token");
  std::string auth = r.header("authorization");
  std::string bearer = startsWith(auth, "Bearer ") ? auth.substr(7) : "";
  if (!queryToken.empty()) {
    token = queryToken;
  } else if (!headerToken.empty()) {
    token = headerToken;
  } else if (startsWith(bearer, "dpt_")) {
    token = bearer;
  } else if (!cookieToken.empty() && hostForm) {
    token = cookieToken;
  }

  if (store_->shared()) refreshSandbox(rid, !othersAlive_);
  SandboxRecord rec;
  bool found = false;
  {
    std::lock_guard lk(mu_);
    if (auto it = sandboxes_.find(rid); it != sandboxes_.end()) {
      rec = it->second;
      found = true;
    }
  }
  const SandboxRecord::ExposedPort* exp = nullptr;
  double now = nowSeconds();
  bool expired = false;
  if (found) {
    for (auto& p : rec.ports) {
      if (p.port == rport) {
        exp = &p;
        expired = !p.liveAt(now);
      }
    }
  }
  bool usedBearer = false;
  if (!token.empty()) {
    bool match = exp && secretEquals(token, portToken(rid, rport, exp->gen));
    if (!match) return answer(Status(Code::kUnauthenticated, "invalid url token"));
    if (expired) return answer(Status(Code::kUnauthenticated, "url token expired"));
    usedBearer = token == bearer;
  } else if (!bearer.empty()) {
    auto caller = tenants_->authenticate(bearer);
    if (!caller.isOk()) return answer(Status(Code::kUnauthenticated, "invalid bearer token"));
    if (!found || (!caller->admin && caller->tenant != rec.owner)) {
      return answer(notFound("sandbox " + rid + " not found"));
    }
    if (!exp || expired) {
      return answer(Status(Code::kNotFound, "port " + std::to_string(rport) + " is not exposed",
                           0, "port"));
    }
    usedBearer = true;
  } else {
    return answer(Status(Code::kUnauthenticated,
                         "an exposed port needs its url token or an API key"));
  }

  // A browser that brought the token in the URL gets it as a cookie of this
  // origin and the URL without it.
  if (hostForm && !queryToken.empty()) {
    http::ProxyDecision d;
    d.status = 302;
    d.body = "";
    d.contentType = "text/plain";
    d.answerHeaders.emplace_back("Location", target);
    d.answerHeaders.emplace_back(
        "Set-Cookie", std::string(kCookie) + "=" + token + "; Path=/; HttpOnly; SameSite=Lax" +
                          (opts_.exposeScheme == "https" ? "; Secure" : ""));
    d.answerHeaders.emplace_back("Cache-Control", "no-store");
    return d;
  }

  // A paused sandbox resumes; a stopped one cannot answer.
  {
    CallerScope scope(Caller{});
    auto sb = runningSandbox(rid);
    if (!sb.isOk()) {
      if (sb.status().code() == Code::kNotFound) return answer(sb.status());
      return answer(Status(Code::kFailedPrecondition, sb.status().message()));
    }
  }

  http::ProxyDecision d;
  d.forward = true;
  d.key = rid + ":" + std::to_string(rport) + ":" + std::to_string(exp->gen);
  if (r.currentKey != d.key) {
    auto fd = cluster_->openPort(rid, rport, exp->gen);
    if (!fd.isOk()) {
      Status st = fd.status();
      if (st.code() == Code::kUnavailable) {
        http::ProxyDecision bad = answer(st);
        bad.status = 502;
        return bad;
      }
      if (st.code() == Code::kDeadlineExceeded) {
        http::ProxyDecision bad = answer(st);
        bad.status = 504;
        return bad;
      }
      return answer(st);
    }
    d.upstream = std::move(*fd);
  }
  d.target = target.empty() ? "/" : target;
  std::string fwdFor;
  std::string host = r.header("host");
  for (auto& [k, v] : r.headers) {
    if (strcasecmp(k.c_str(), "cookie") == 0 || strcasecmp(k.c_str(), "dsec-port-token") == 0) {
      continue;
    }
    if (strcasecmp(k.c_str(), "authorization") == 0 && usedBearer) continue;
    if (strcasecmp(k.c_str(), "x-forwarded-for") == 0) {
      fwdFor = v;
      continue;
    }
    if (strcasecmp(k.c_str(), "x-forwarded-proto") == 0 ||
        strcasecmp(k.c_str(), "x-forwarded-host") == 0 ||
        strcasecmp(k.c_str(), "x-forwarded-prefix") == 0) {
      continue;
    }
    d.requestHeaders.emplace_back(k, v);
  }
  if (hadCookie && !cookies.empty()) d.requestHeaders.emplace_back("Cookie", cookies);
  d.requestHeaders.emplace_back("X-Forwarded-For", fwdFor.empty() ? r.peer : fwdFor + ", " + r.peer);
  d.requestHeaders.emplace_back("X-Forwarded-Proto", hostForm ? opts_.exposeScheme : "http");
  if (!host.empty()) d.requestHeaders.emplace_back("X-Forwarded-Host", host);
  if (!hostForm) {
    d.requestHeaders.emplace_back("X-Forwarded-Prefix", "/ports/" + rid + "/" + std::to_string(rport));
    // A page served on the platform's own origin runs in an opaque one, so
    // it can neither read the console's storage nor call the API as it.
    d.responseHeaders.emplace_back("Content-Security-Policy",
                                   "sandbox allow-scripts allow-forms allow-popups allow-downloads");
    // A client's pooled connection must not stay diverted for its next API call.
    d.close = true;
  }
  // The sandbox is in use while the exchange lasts: a long download, a
  // WebSocket, an event stream hold off its idle timeout and auto-pause.
  d.hold = holdActivity(rid);
  return d;
}

}  // namespace dsec::platform
