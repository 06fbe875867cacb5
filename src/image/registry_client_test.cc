#include "image/registry_client.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "common/base64.h"
#include "common/http_server.h"
#include "common/sha256.h"
#include "common/util.h"

namespace dsec::image {
namespace {

using Json = nlohmann::json;

const std::string kOciIndexType = "application/vnd.oci.image.index.v1+json";
const std::string kDockerListType = "application/vnd.docker.distribution.manifest.list.v2+json";
const std::string kOciManifestType = "application/vnd.oci.image.manifest.v1+json";
const std::string kDockerManifestType = "application/vnd.docker.distribution.manifest.v2+json";
const std::string kOciGzip = "application/vnd.oci.image.layer.v1.tar+gzip";

std::string digestOf(std::string_view s) { return "sha256:" + sha256Hex(s); }

std::string pattern(size_t n, int seed = 0) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = char((i * 7 + i / 251 + size_t(seed) * 13) & 0xff);
  return s;
}

// ---------------------------------------------------------------------------
// Parsing.

TEST(RegistryRefTest, ParsesAndNormalises) {
  const std::string hex(64, 'a');
  struct Case {
    std::string in, host, repo, tag, digest, apiHost;
  };
  std::vector<Case> cases = {
      {"debian", "docker.io", "library/debian", "latest", "", "registry-1.docker.io"},
      {"debian:12", "docker.io", "library/debian", "12", "", "registry-1.docker.io"},
      {"docker.io/debian", "docker.io", "library/debian", "latest", "", "registry-1.docker.io"},
      {"index.docker.io/debian:12", "docker.io", "library/debian", "12", "",
       "registry-1.docker.io"},
      {"docker.io/library/debian", "docker.io", "library/debian", "latest", "",
       "registry-1.docker.io"},
      {"user/repo", "docker.io", "user/repo", "latest", "", "registry-1.docker.io"},
      {"ghcr.io/a/b:1", "ghcr.io", "a/b", "1", "", "ghcr.io"},
      {"127.0.0.1:5000/x@sha256:" + hex, "127.0.0.1:5000", "x", "", "sha256:" + hex,
       "127.0.0.1:5000"},
      {"localhost/x", "localhost", "x", "latest", "", "localhost"},
      {"localhost:5000/a/b:v1.2_3-rc", "localhost:5000", "a/b", "v1.2_3-rc", "", "localhost:5000"},
      {"Registry.Example.com:443/team/app", "registry.example.com:443", "team/app", "latest", "",
       "registry.example.com:443"},
      {"a/b/c:t@sha256:" + hex, "docker.io", "a/b/c", "t", "sha256:" + hex, "registry-1.docker.io"},
      {"quay.io/a__b/c.d-e--f_g", "quay.io", "a__b/c.d-e--f_g", "latest", "", "quay.io"},
      {"[::1]:5000/x:_t", "[::1]:5000", "x", "_t", "", "[::1]:5000"},
      // As Docker: no slash, so no host: "localhost" is the name, 5000 the tag.
      {"localhost:5000", "docker.io", "library/localhost", "5000", "", "registry-1.docker.io"},
      {"x:" + std::string(128, 'T'), "docker.io", "library/x", std::string(128, 'T'), "",
       "registry-1.docker.io"},
  };
  for (const Case& c : cases) {
    auto r = parseRegistryRef(c.in);
    ASSERT_TRUE(r.isOk()) << c.in << ": " << r.status().toString();
    EXPECT_EQ(r->host, c.host) << c.in;
    EXPECT_EQ(r->repository, c.repo) << c.in;
    EXPECT_EQ(r->tag, c.tag) << c.in;
    EXPECT_EQ(r->digest, c.digest) << c.in;
    EXPECT_EQ(r->apiHost(), c.apiHost) << c.in;
    // str() round-trips.
    auto again = parseRegistryRef(r->str());
    ASSERT_TRUE(again.isOk()) << r->str();
    EXPECT_EQ(again->str(), r->str());
  }
  EXPECT_EQ(parseRegistryRef("debian")->str(), "docker.io/library/debian:latest");
  EXPECT_EQ(parseRegistryRef("a/b:1@sha256:" + hex)->str(), "docker.io/a/b:1@sha256:" + hex);
}

TEST(RegistryRefTest, RefusesMalformed) {
  const std::string hex(64, 'a');
  std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"Debian", "lowercase"},
      {"a b", "whitespace"},
      {"x:", "empty tag"},
      {"x@", "empty digest"},
      {"x@sha512:" + std::string(128, 'a'), "only sha256"},
      {"x@sha256:" + std::string(64, 'A'), "sha256:<64"},
      {"x@sha256:123", "sha256:<64"},
      {"x@" + hex, "sha256:<64"},
      {"a//b", "empty path component"},
      {"a/", "empty path component"},
      {"/a", "empty path component"},
      {"-a", "invalid repository path component"},
      {"a-", "invalid repository path component"},
      {"a..b", "invalid repository path component"},
      {"a___b", "invalid repository path component"},
      {"a:b:c", "invalid repository path component"},
      {"x:-tag", "invalid tag"},
      {"x:" + std::string(129, 'a'), "invalid tag"},
      {"x:t@g", "sha256:<64"},
      {"exa_mple.com/x", "invalid registry host"},
      {"host:99999/x", "invalid registry host"},
      {"host:/x", "invalid registry host"},
      {"host:12ab/x", "invalid registry host"},
      {"-bad.com/x", "invalid registry host"},
      {"a.b/", "no repository"},
      {"localhost/", "no repository"},
      {"ghcr.io/:tag", "no repository"},
      {"http://ghcr.io/x", "invalid registry host"},
      {"x/" + std::string(260, 'a'), "255"},
  };
  for (const auto& [in, why] : bad) {
    auto r = parseRegistryRef(in);
    ASSERT_FALSE(r.isOk()) << in << " parsed as " << r->str();
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << in;
    EXPECT_EQ(r.status().field(), "ref") << in;
    EXPECT_NE(r.status().message().find(why), std::string::npos)
        << in << ": " << r.status().message();
  }
}

TEST(ImagePlatformTest, ParsesAndNormalises) {
  std::vector<std::pair<std::string, std::string>> good = {
      {"linux/amd64", "linux/amd64"},     {"linux/arm64/v8", "linux/arm64/v8"},
      {"linux/arm64", "linux/arm64"},     {"Linux/X86_64", "linux/amd64"},
      {"linux/x86-64", "linux/amd64"},    {"linux/aarch64", "linux/arm64"},
      {"linux/arm", "linux/arm/v7"},      {"linux/armhf", "linux/arm/v7"},
      {"linux/armel", "linux/arm/v6"},    {"linux/arm/7", "linux/arm/v7"},
      {"windows/amd64", "windows/amd64"}, {"linux/amd64/v3", "linux/amd64/v3"},
      {"linux/riscv64", "linux/riscv64"}, {"linux/386", "linux/386"},
  };
  for (const auto& [in, want] : good) {
    auto p = parseImagePlatform(in);
    ASSERT_TRUE(p.isOk()) << in << ": " << p.status().toString();
    EXPECT_EQ(p->str(), want) << in;
  }
  for (const char* in :
       {"", "linux", "linux/", "/amd64", "linux/amd64/v8/x", "linux/amd 64", "linux//v8"}) {
    auto p = parseImagePlatform(in);
    ASSERT_FALSE(p.isOk()) << in;
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(p.status().field(), "platform");
  }
  EXPECT_EQ(ImagePlatform().str(), "linux/amd64");
}

TEST(DockerConfigTest, FindsCredentials) {
  std::string cfg = R"({
    "auths": {
      "https://index.docker.io/v1/": {"auth": ")" +
                    base64Encode("hub:hubpw") + R"("},
      "ghcr.io": {"username": "gh", "password": "ghpw"},
      "https://quay.io": {"auth": ")" +
                    base64Encode("q:with:colons") + R"("},
      "http://127.0.0.1:5000/v1/": {"identitytoken": "refresh-me"},
      "empty.example.com": {}
    },
    "credsStore": "desktop"
  })";
  auto hub = credentialsFromDockerConfig(cfg, "docker.io");
  ASSERT_TRUE(hub.isOk()) << hub.status().toString();
  ASSERT_TRUE(hub->has_value());
  EXPECT_EQ((*hub)->username, "hub");
  EXPECT_EQ((*hub)->password, "hubpw");
  auto gh = credentialsFromDockerConfig(cfg, "ghcr.io");
  ASSERT_TRUE(gh.isOk() && gh->has_value());
  EXPECT_EQ((*gh)->username, "gh");
  EXPECT_EQ((*gh)->password, "ghpw");
  auto quay = credentialsFromDockerConfig(cfg, "quay.io");
  ASSERT_TRUE(quay.isOk() && quay->has_value());
  EXPECT_EQ((*quay)->username, "q");
  EXPECT_EQ((*quay)->password, "with:colons");
  auto local = credentialsFromDockerConfig(cfg, "127.0.0.1:5000");
  ASSERT_TRUE(local.isOk() && local->has_value());
  EXPECT_EQ((*local)->identityToken, "refresh-me");
  EXPECT_TRUE((*local)->username.empty());
  for (const char* none : {"other.io", "empty.example.com", "127.0.0.1", "ghcr.io:443"}) {
    auto n = credentialsFromDockerConfig(cfg, none);
    ASSERT_TRUE(n.isOk()) << none;
    EXPECT_FALSE(n->has_value()) << none;
  }
  // An exact key wins over one that only normalises to the host.
  std::string two = R"({"auths": {"https://ghcr.io/v1/": {"username": "a", "password": "1"},
                                   "ghcr.io": {"username": "b", "password": "2"}}})";
  auto exact = credentialsFromDockerConfig(two, "ghcr.io");
  ASSERT_TRUE(exact.isOk() && exact->has_value());
  EXPECT_EQ((*exact)->username, "b");
  // No "auths" at all.
  auto noAuths = credentialsFromDockerConfig(R"({"credsStore": "x"})", "ghcr.io");
  ASSERT_TRUE(noAuths.isOk());
  EXPECT_FALSE(noAuths->has_value());
}

TEST(DockerConfigTest, RefusesMalformedWithoutQuotingSecrets) {
  std::vector<std::string> bad = {
      R"({"auths": {"ghcr.io": {"auth": "hunter2-not-base64!!"}}})",
      R"({"auths": {"ghcr.io": {"auth": ")" + base64Encode("hunter2-no-colon") + R"("}}})",
      R"({"auths": {"ghcr.io": {"password": 7}}})",
      R"({"auths": {"ghcr.io": "hunter2"}})",
      R"({"auths": ["hunter2"]})",
      R"({"auths": {"ghcr.io": {"auth": "hunter2)",
      R"(["hunter2"])",
  };
  for (const std::string& cfg : bad) {
    auto r = credentialsFromDockerConfig(cfg, "ghcr.io");
    ASSERT_FALSE(r.isOk()) << cfg;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << cfg;
    EXPECT_EQ(r.status().field(), "auth");
    EXPECT_EQ(r.status().message().find("hunter2"), std::string::npos) << r.status().message();
  }
}

TEST(WwwAuthenticateTest, ParsesChallenges) {
  auto c = parseWwwAuthenticate(
      R"(Bearer realm="https://auth.docker.io/token",service="registry.docker.io",)"
      R"(scope="repository:a/b:pull,push")");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].scheme, "bearer");
  EXPECT_EQ(c[0].params["realm"], "https://auth.docker.io/token");
  EXPECT_EQ(c[0].params["service"], "registry.docker.io");
  EXPECT_EQ(c[0].params["scope"], "repository:a/b:pull,push");

  c = parseWwwAuthenticate(R"(Basic realm="Registry Realm")");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].scheme, "basic");
  EXPECT_EQ(c[0].params["realm"], "Registry Realm");

  // Several challenges, unquoted tokens, odd spacing and case, escapes.
  c = parseWwwAuthenticate(R"(Basic realm="a, b" , BEARER Realm=https://x/t ,service = svc,  )"
                           R"(error="insufficient_scope", Digest realm="q\"uo\\te", nonce=abc)");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].scheme, "basic");
  EXPECT_EQ(c[0].params["realm"], "a, b");
  EXPECT_EQ(c[1].scheme, "bearer");
  EXPECT_EQ(c[1].params["realm"], "https://x/t");
  EXPECT_EQ(c[1].params["service"], "svc");
  EXPECT_EQ(c[1].params["error"], "insufficient_scope");
  EXPECT_EQ(c[2].scheme, "digest");
  EXPECT_EQ(c[2].params["realm"], "q\"uo\\te");
  EXPECT_EQ(c[2].params["nonce"], "abc");

  // token68 and bare schemes.
  c = parseWwwAuthenticate("Negotiate abc+/d==, NTLM, Bearer");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].scheme, "negotiate");
  EXPECT_EQ(c[0].token68, "abc+/d==");
  EXPECT_TRUE(c[0].params.empty());
  EXPECT_EQ(c[1].scheme, "ntlm");
  EXPECT_EQ(c[2].scheme, "bearer");

  // An unterminated quote takes the rest; garbage never loops or crashes.
  c = parseWwwAuthenticate(R"(Bearer realm="https://x/t)");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].params["realm"], "https://x/t");
  for (const char* junk : {"", ",,,", "\"", "=", "Bearer =x", "Bearer realm=", "@@@, Basic",
                           "Bearer realm=\"x\" junk \"y\", =, Basic realm=z"}) {
    (void)parseWwwAuthenticate(junk);
  }
  c = parseWwwAuthenticate("@@@, Basic realm=z");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].scheme, "basic");
}

// ---------------------------------------------------------------------------
// A fake registry on the tree's HTTP server.

struct Seen {
  std::string method, path, range, authorization, query, body, accept;
};

class FakeRegistry {
 public:
  enum class Auth { kNone, kBearer, kBasic };

  // Behaviour, set before requests (or under mu).
  Auth auth = Auth::kNone;
  std::string user = "alice", pass = "s3cret-pw";
  std::string identityToken;     // accepted by POST /token when set
  bool tokenNeedsCreds = false;  // the token endpoint wants basic credentials
  double tokenExpiresIn = 300;
  bool deny = false;  // 403 DENIED for /v2/ requests
  int failFirst = 0;  // 503 for this many /v2/ requests
  int cutAfter = -1;  // blob answers cut after this many bytes...
  int cuts = 0;       // ...this many times
  bool ignoreRange = false;
  std::string redirectBase;      // blob GETs redirect to redirectBase + "/storage/<digest>"
  std::string badDigestHeader;   // a Docker-Content-Digest to lie with
  bool slowBlob = false;         // blob bodies trickle out in pieces
  std::string storageChallenge;  // storage only: answer 401 with this WWW-Authenticate
  bool refuseHead = false;       // storage only: HEAD is 403 (a URL presigned for GET)
  bool unknownTotal = false;     // 206 answers say "bytes a-b/*"
  size_t rangeCap = 0;           // a 206 answer carries at most this many bytes (0: the rest)
  std::string realm;             // the Bearer challenge's realm ("" = this server's /token)
  int tokenStatus = 0;           // the token endpoint answers this HTTP status (0: as it should)

  std::mutex mu;
  std::map<std::string, std::pair<std::string, std::string>> manifests;  // "repo@ref"
  std::map<std::string, std::string> blobs;
  std::set<std::string> repos;
  std::set<std::string> validTokens;
  std::vector<Seen> seen;
  int tokensIssued = 0;
  int unauthorized = 0;

  explicit FakeRegistry(bool storageOnly = false)
      : storageOnly_(storageOnly), server_(http::ServerOptions{.port = 0}) {
    EXPECT_TRUE(server_.listen().isOk());
    thread_ = std::thread([this] {
      server_.serve([this](http::Request& req, http::Response& res) { handle(req, res); });
    });
  }
  ~FakeRegistry() {
    server_.stop();
    thread_.join();
  }
  uint16_t port() const { return server_.port(); }
  std::string hostPort() const { return "127.0.0.1:" + std::to_string(port()); }

  void putManifest(const std::string& repo, const std::string& ref, const std::string& type,
                   const std::string& bytes) {
    std::lock_guard lk(mu);
    repos.insert(repo);
    manifests[repo + "@" + ref] = {type, bytes};
    manifests[repo + "@" + digestOf(bytes)] = {type, bytes};
  }
  std::string putBlob(const std::string& bytes) {
    std::lock_guard lk(mu);
    blobs[digestOf(bytes)] = bytes;
    return digestOf(bytes);
  }
  void revokeTokens() {
    std::lock_guard lk(mu);
    validTokens.clear();
  }
  std::vector<Seen> requests() {
    std::lock_guard lk(mu);
    return seen;
  }
  int count(const std::string& pathPrefix) {
    std::lock_guard lk(mu);
    int n = 0;
    for (const Seen& s : seen) n += startsWith(s.path, pathPrefix);
    return n;
  }

 private:
  static void sendError(http::Response& res, int status, const std::string& code,
                        const std::string& msg) {
    Json j = {{"errors", Json::array({{{"code", code}, {"message", msg}}})}};
    (void)res.send(status, "application/json", j.dump());
  }

  void serveBlob(http::Request& req, http::Response& res, const std::string& bytes) {
    int status = 200;
    size_t start = 0, end = bytes.size();
    std::string range = req.header("range");
    bool cut = false;
    size_t cutAt = 0;
    bool slow;
    {
      std::lock_guard lk(mu);
      if (!range.empty() && !ignoreRange) {
        long long a = 0;
        if (sscanf(range.c_str(), "bytes=%lld-", &a) == 1) {
          if (a >= (long long)bytes.size()) {
            (void)res.send(416, "text/plain", "");
            return;
          }
          start = size_t(a);
          status = 206;
          if (rangeCap > 0) end = std::min(end, start + rangeCap);
          res.setHeader("Content-Range", "bytes " + std::to_string(a) + "-" +
                                             std::to_string(end - 1) + "/" +
                                             (unknownTotal ? "*" : std::to_string(bytes.size())));
        }
      }
      if (cuts > 0 && cutAfter >= 0) {
        --cuts;
        cut = true;
        cutAt = size_t(cutAfter);
      }
      slow = slowBlob;
    }
    std::string body = bytes.substr(start, end - start);
    if (req.method == "HEAD") {
      (void)res.send(status, "application/octet-stream", "");
      return;
    }
    if (cut || slow) {
      if (!res.beginFixed(status, "application/octet-stream", body.size()).isOk()) return;
      size_t upTo = cut ? std::min(cutAt, body.size()) : body.size();
      for (size_t off = 0; off < upTo;) {
        size_t n = std::min<size_t>(slow ? 4096 : upTo, upTo - off);
        if (!res.write(body.substr(off, n)).isOk()) return;
        off += n;
        if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      (void)res.finish();  // short of its length: the connection closes
      return;
    }
    (void)res.send(status, "application/octet-stream", body);
  }

  void handle(http::Request& req, http::Response& res) {
    {
      std::lock_guard lk(mu);
      std::string q = req.target.find('?') == std::string::npos
                          ? ""
                          : req.target.substr(req.target.find('?') + 1);
      seen.push_back({req.method, req.path, req.header("range"), req.header("authorization"), q, "",
                      req.header("accept")});
    }
    if (storageOnly_) {
      std::string digest = req.path.substr(req.path.rfind('/') + 1);
      std::string bytes;
      {
        std::lock_guard lk(mu);
        if (!storageChallenge.empty()) {
          res.setHeader("WWW-Authenticate", storageChallenge);
          (void)res.send(401, "text/plain", "unauthorized");
          return;
        }
        if (refuseHead && req.method == "HEAD") {
          (void)res.send(403, "application/xml", "<Error>SignatureDoesNotMatch</Error>");
          return;
        }
        if (!startsWith(req.path, "/storage/") || !blobs.count(digest)) {
          (void)res.send(404, "text/plain", "no such object");
          return;
        }
        bytes = blobs[digest];
      }
      serveBlob(req, res, bytes);
      return;
    }
    if (req.path == "/token") {
      handleToken(req, res);
      return;
    }
    if (!startsWith(req.path, "/v2/")) {
      (void)res.send(404, "text/plain", "nope");
      return;
    }
    std::unique_lock lk(mu);
    std::string repo;
    size_t m = req.path.rfind("/manifests/");
    size_t b = req.path.rfind("/blobs/");
    size_t cut = m != std::string::npos ? m : b;
    if (cut != std::string::npos && cut > 4) repo = req.path.substr(4, cut - 4);
    // Authentication.
    std::string authz = req.header("authorization");
    if (auth == Auth::kBearer) {
      bool ok = startsWith(authz, "Bearer ") && validTokens.count(authz.substr(7));
      if (!ok) {
        ++unauthorized;
        res.setHeader("WWW-Authenticate",
                      "Bearer realm=\"" +
                          (realm.empty() ? "http://" + hostPort() + "/token" : realm) +
                          "\",service=\"fake-registry\",scope=\"repository:" + repo + ":pull\"");
        lk.unlock();
        sendError(res, 401, "UNAUTHORIZED", "authentication required");
        return;
      }
    } else if (auth == Auth::kBasic) {
      if (authz != "Basic " + base64Encode(user + ":" + pass)) {
        ++unauthorized;
        res.setHeader("WWW-Authenticate", "Basic realm=\"fake\"");
        lk.unlock();
        sendError(res, 401, "UNAUTHORIZED", "authentication required");
        return;
      }
    }
    if (deny) {
      lk.unlock();
      sendError(res, 403, "DENIED", "requested access to the resource is denied");
      return;
    }
    if (failFirst > 0) {
      --failFirst;
      lk.unlock();
      (void)res.send(503, "text/plain", "busy");
      return;
    }
    if (!repos.count(repo)) {
      lk.unlock();
      sendError(res, 404, "NAME_UNKNOWN", "repository name not known to registry");
      return;
    }
    if (m != std::string::npos) {
      std::string ref = req.path.substr(m + 11);
      auto it = manifests.find(repo + "@" + ref);
      if (it == manifests.end()) {
        lk.unlock();
        sendError(res, 404, "MANIFEST_UNKNOWN", "manifest unknown");
        return;
      }
      auto [type, bytes] = it->second;
      res.setHeader("Docker-Content-Digest",
                    badDigestHeader.empty() ? digestOf(bytes) : badDigestHeader);
      lk.unlock();
      (void)res.send(200, type, req.method == "HEAD" ? "" : bytes);
      return;
    }
    std::string digest = req.path.substr(b + 7);
    auto it = blobs.find(digest);
    if (it == blobs.end()) {
      lk.unlock();
      sendError(res, 404, "BLOB_UNKNOWN", "blob unknown to registry");
      return;
    }
    std::string bytes = it->second;
    if (!redirectBase.empty()) {
      res.setHeader("Location", redirectBase + "/storage/" + digest + "?X-Signature=secret");
      lk.unlock();
      (void)res.send(307, "text/plain", "");
      return;
    }
    lk.unlock();
    serveBlob(req, res, bytes);
  }

  void handleToken(http::Request& req, http::Response& res) {
    std::lock_guard lk(mu);
    if (tokenStatus != 0) {
      sendError(res, tokenStatus, tokenStatus == 403 ? "DENIED" : "UNAVAILABLE",
                "no token for you");
      return;
    }
    bool ok = true;
    bool post = req.method == "POST";
    if (post) {
      // The form body; the server read it before the handler (small).
      auto body = req.readBody(1 << 16);
      std::string form = body.isOk() ? *body : "";
      seen.back().body = form;
      ok = !identityToken.empty() && form.find("grant_type=refresh_token") != std::string::npos &&
           form.find("refresh_token=" + identityToken) != std::string::npos &&
           form.find("client_id=dsec") != std::string::npos;
    } else if (tokenNeedsCreds) {
      ok = req.header("authorization") == "Basic " + base64Encode(user + ":" + pass);
    }
    if (!ok) {
      Json j = {{"errors", Json::array({{{"code", "UNAUTHORIZED"}, {"message", "bad creds"}}})}};
      (void)res.send(401, "application/json", j.dump());
      return;
    }
    std::string tok = "tok-" + std::to_string(++tokensIssued);
    validTokens.insert(tok);
    Json j = {{post ? "access_token" : "token", tok}, {"expires_in", tokenExpiresIn}};
    (void)res.send(200, "application/json", j.dump());
  }

  bool storageOnly_;
  http::Server server_;
  std::thread thread_;
};

// An image of `layers` layers in `repo`, pushed to the fake.
struct TestImage {
  std::string config, configDigest, manifest, manifestDigest;
  std::vector<std::string> layerBytes;
  Json layers = Json::array();
};

TestImage makeImage(FakeRegistry& reg, const std::string& arch, int nLayers,
                    const std::string& manifestType = kOciManifestType, int seed = 0) {
  TestImage img;
  bool docker = manifestType == kDockerManifestType;
  img.config = Json({{"architecture", arch},
                     {"os", "linux"},
                     {"rootfs", {{"type", "layers"}, {"diff_ids", Json::array()}}},
                     {"config", {{"Env", {"SEED=" + std::to_string(seed)}}}}})
                   .dump();
  img.configDigest = reg.putBlob(img.config);
  for (int i = 0; i < nLayers; ++i) {
    std::string bytes = pattern(1000 + size_t(i) * 37, seed * 10 + i);
    img.layerBytes.push_back(bytes);
    img.layers.push_back(
        {{"mediaType", docker ? "application/vnd.docker.image.rootfs.diff.tar.gzip" : kOciGzip},
         {"digest", reg.putBlob(bytes)},
         {"size", bytes.size()}});
  }
  Json m = {{"schemaVersion", 2},
            {"mediaType", manifestType},
            {"config",
             {{"mediaType", docker ? "application/vnd.docker.container.image.v1+json"
                                   : "application/vnd.oci.image.config.v1+json"},
              {"digest", img.configDigest},
              {"size", img.config.size()}}},
            {"layers", img.layers}};
  img.manifest = m.dump();
  img.manifestDigest = digestOf(img.manifest);
  return img;
}

Json indexEntry(const TestImage& img, const std::string& os, const std::string& arch,
                const std::string& variant = "") {
  Json p = {{"os", os}, {"architecture", arch}};
  if (!variant.empty()) p["variant"] = variant;
  return {{"mediaType", kOciManifestType},
          {"digest", img.manifestDigest},
          {"size", img.manifest.size()},
          {"platform", p}};
}

RegistryOptions fastOpts(const FakeRegistry& reg) {
  RegistryOptions o;
  o.insecureHosts = {reg.hostPort()};
  o.attempts = 3;
  o.backoffS = 0.001;
  o.stallTimeoutS = 5;
  return o;
}

RegistryRef refFor(const FakeRegistry& reg, const std::string& repoAndTag) {
  auto r = parseRegistryRef(reg.hostPort() + "/" + repoAndTag);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  return *r;
}

ImagePlatform plat(const std::string& s) { return *parseImagePlatform(s); }

std::string tempPath() { return "/tmp/dsec-registry-test-" + randomHex(6); }

int64_t fileSize(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 ? int64_t(st.st_size) : -1;
}

// An https server that answers every GET and HEAD with a 307 to the same
// path under `target`: Python's http.server behind its ssl module, with a
// self-signed certificate for 127.0.0.1 that openssl makes. The tree's HTTP
// server has no TLS, and the test links no libssl. skipReason says why it
// could not start.
class TlsRedirector {
 public:
  explicit TlsRedirector(const std::string& target) : dir_(tempPath()) {
    if (std::system("command -v openssl >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1") !=
        0) {
      skipReason = "no openssl and python3 to serve https";
      return;
    }
    if (!makeDirs(dir_, 0700).isOk()) {
      skipReason = "cannot make " + dir_;
      return;
    }
    std::string gen =
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
        "-days 1 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -keyout " +
        dir_ + "/key.pem -out " + dir_ + "/cert.pem >/dev/null 2>&1";
    if (std::system(gen.c_str()) != 0) {
      skipReason = "openssl req could not make a certificate";
      return;
    }
    const std::string script = R"(
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(307)
        self.send_header("Location", sys.argv[3] + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()
    do_HEAD = do_GET
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
s.socket = ctx.wrap_socket(s.socket, server_side=True)
print(s.server_address[1], flush=True)
s.serve_forever()
)";
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) {
      skipReason = "pipe failed";
      return;
    }
    std::string cert = caFile(), key = dir_ + "/key.pem";
    const char* argv[] = {"python3",   "-c",           script.c_str(), cert.c_str(),
                          key.c_str(), target.c_str(), nullptr};
    pid_ = ::fork();
    if (pid_ == 0) {
      int null = ::open("/dev/null", O_RDWR);
      ::dup2(null, 0);
      ::dup2(out[1], 1);
      ::dup2(null, 2);
      ::execvp("python3", const_cast<char**>(argv));
      ::_exit(127);
    }
    ::close(out[1]);
    out_ = out[0];
    std::string got;  // the port, on a line of its own once it listens
    while (got.find('\n') == std::string::npos) {
      pollfd p{out_, POLLIN, 0};
      char buf[64];
      ssize_t n = ::poll(&p, 1, 10000) == 1 ? ::read(out_, buf, sizeof buf) : 0;
      if (n <= 0) {
        skipReason = "the python3 https server did not start";
        return;
      }
      got.append(buf, size_t(n));
    }
    port_ = got.substr(0, got.find('\n'));
  }
  ~TlsRedirector() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
    (void)removeTree(dir_);
  }
  std::string hostPort() const { return "127.0.0.1:" + port_; }
  std::string caFile() const { return dir_ + "/cert.pem"; }
  std::string skipReason;

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int out_ = -1;
  std::string port_;
};

// ---------------------------------------------------------------------------
// resolve()

TEST(RegistryClientTest, ResolvesOciManifest) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "amd64", 3);
  reg.putManifest("team/app", "v1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "team/app:v1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->indexDigest, "");
  EXPECT_EQ(r->manifestDigest, img.manifestDigest);
  EXPECT_EQ(r->manifestMediaType, kOciManifestType);
  EXPECT_EQ(r->manifest, img.manifest);
  EXPECT_EQ(r->configDigest, img.configDigest);
  EXPECT_EQ(r->config, img.config);
  EXPECT_EQ(r->platform, "linux/amd64");
  ASSERT_EQ(r->layers.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r->layers[i].digest, digestOf(img.layerBytes[i]));
    EXPECT_EQ(r->layers[i].size, int64_t(img.layerBytes[i].size()));
    EXPECT_EQ(r->layers[i].compression, LayerCompression::kGzip);
  }
  // Manifest requests accept the four types.
  for (const Seen& s : reg.requests()) {
    EXPECT_TRUE(s.authorization.empty());
    if (s.path.find("/manifests/") == std::string::npos) continue;
    for (const std::string& t :
         {kOciIndexType, kDockerListType, kOciManifestType, kDockerManifestType}) {
      EXPECT_NE(s.accept.find(t), std::string::npos) << s.accept;
    }
  }
  // By digest too.
  auto byDigest =
      client.resolve(refFor(reg, "team/app@" + img.manifestDigest), plat("linux/amd64"));
  ASSERT_TRUE(byDigest.isOk()) << byDigest.status().toString();
  EXPECT_EQ(byDigest->manifestDigest, img.manifestDigest);
}

TEST(RegistryClientTest, ResolvesDockerV2Schema2AndLayerTypes) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "arm64", 1, kDockerManifestType);
  Json m = Json::parse(img.manifest);
  std::string plain = pattern(10, 1), zstd = pattern(11, 2), oci = pattern(12, 3);
  m["layers"].push_back({{"mediaType", "application/vnd.docker.image.rootfs.diff.tar"},
                         {"digest", reg.putBlob(plain)},
                         {"size", plain.size()}});
  m["layers"].push_back({{"mediaType", "application/vnd.oci.image.layer.v1.tar+zstd"},
                         {"digest", reg.putBlob(zstd)},
                         {"size", zstd.size()}});
  m["layers"].push_back({{"mediaType", "application/vnd.oci.image.layer.v1.tar"},
                         {"digest", reg.putBlob(oci)},
                         {"size", oci.size()}});
  reg.putManifest("app", "latest", kDockerManifestType, m.dump());
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "app"), plat("linux/arm64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->manifestMediaType, kDockerManifestType);
  EXPECT_EQ(r->platform, "linux/arm64");  // from the config
  ASSERT_EQ(r->layers.size(), 4u);
  EXPECT_EQ(r->layers[0].compression, LayerCompression::kGzip);
  EXPECT_EQ(r->layers[1].compression, LayerCompression::kNone);
  EXPECT_EQ(r->layers[2].compression, LayerCompression::kZstd);
  EXPECT_EQ(r->layers[3].compression, LayerCompression::kNone);
}

TEST(RegistryClientTest, PicksThePlatformFromAnIndex) {
  FakeRegistry reg;
  TestImage amd = makeImage(reg, "amd64", 1, kOciManifestType, 1);
  TestImage arm64 = makeImage(reg, "arm64", 1, kOciManifestType, 2);
  TestImage armv7 = makeImage(reg, "arm", 1, kOciManifestType, 3);
  TestImage att = makeImage(reg, "unknown", 1, kOciManifestType, 4);
  for (const TestImage* i : {&amd, &arm64, &armv7, &att}) {
    reg.putManifest("multi", i->manifestDigest, kOciManifestType, i->manifest);
  }
  Json index = {{"schemaVersion", 2},
                {"mediaType", kOciIndexType},
                {"manifests",
                 {indexEntry(amd, "linux", "amd64"), indexEntry(arm64, "linux", "arm64", "v8"),
                  indexEntry(armv7, "linux", "arm", "v7"), indexEntry(att, "unknown", "unknown")}}};
  reg.putManifest("multi", "1", kOciIndexType, index.dump());
  // The same as a Docker manifest list.
  Json list = index;
  list["mediaType"] = kDockerListType;
  reg.putManifest("multi", "list", kDockerListType, list.dump());
  RegistryClient client(fastOpts(reg));

  struct Case {
    std::string platform;
    const TestImage* want;
    std::string chosen;
  };
  for (const Case& c : std::vector<Case>{{"linux/amd64", &amd, "linux/amd64"},
                                         {"linux/x86_64", &amd, "linux/amd64"},
                                         {"linux/arm64", &arm64, "linux/arm64/v8"},
                                         {"linux/arm64/v8", &arm64, "linux/arm64/v8"},
                                         {"linux/aarch64", &arm64, "linux/arm64/v8"},
                                         {"linux/arm", &armv7, "linux/arm/v7"},
                                         {"linux/arm/v7", &armv7, "linux/arm/v7"}}) {
    for (const char* tag : {"1", "list"}) {
      auto r = client.resolve(refFor(reg, std::string("multi:") + tag), plat(c.platform));
      ASSERT_TRUE(r.isOk()) << c.platform << ": " << r.status().toString();
      EXPECT_EQ(r->manifestDigest, c.want->manifestDigest) << c.platform;
      EXPECT_EQ(r->configDigest, c.want->configDigest) << c.platform;
      EXPECT_EQ(r->platform, c.chosen) << c.platform;
      EXPECT_EQ(r->indexDigest, digestOf(std::string(tag) == "1" ? index.dump() : list.dump()));
    }
  }
  // amd64 asked with no variant takes any; one asked with a variant does not.
  Json v3 = {{"schemaVersion", 2},
             {"mediaType", kOciIndexType},
             {"manifests", {indexEntry(amd, "linux", "amd64", "v3")}}};
  reg.putManifest("multi", "v3", kOciIndexType, v3.dump());
  EXPECT_TRUE(client.resolve(refFor(reg, "multi:v3"), plat("linux/amd64")).isOk());
  EXPECT_TRUE(client.resolve(refFor(reg, "multi:v3"), plat("linux/amd64/v3")).isOk());
  EXPECT_EQ(client.resolve(refFor(reg, "multi:v3"), plat("linux/amd64/v2")).status().code(),
            Code::kNotFound);

  auto none = client.resolve(refFor(reg, "multi:1"), plat("linux/s390x"));
  ASSERT_FALSE(none.isOk());
  EXPECT_EQ(none.status().code(), Code::kNotFound);
  EXPECT_EQ(none.status().field(), "platform");
  const std::string& msg = none.status().message();
  EXPECT_NE(msg.find("linux/s390x"), std::string::npos) << msg;
  EXPECT_NE(msg.find("linux/amd64, linux/arm64/v8, linux/arm/v7"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("unknown"), std::string::npos) << msg;
}

TEST(RegistryClientTest, RefusesSchema1ForeignLayersAndOddTypes) {
  FakeRegistry reg;
  RegistryClient client(fastOpts(reg));
  Json s1 = {{"schemaVersion", 1}, {"name", "x"}, {"tag", "old"}, {"fsLayers", Json::array()}};
  reg.putManifest("x", "old", "application/vnd.docker.distribution.manifest.v1+prettyjws",
                  s1.dump());
  reg.putManifest("x", "old-json", "application/json", s1.dump());
  for (const char* tag : {"old", "old-json"}) {
    auto r = client.resolve(refFor(reg, std::string("x:") + tag), plat("linux/amd64"));
    ASSERT_FALSE(r.isOk()) << tag;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(r.status().field(), "ref");
    EXPECT_NE(r.status().message().find("schema 1"), std::string::npos) << r.status().message();
  }

  TestImage img = makeImage(reg, "amd64", 1);
  auto withLayer = [&](const Json& layer) {
    Json m = Json::parse(img.manifest);
    m["layers"].push_back(layer);
    return m.dump();
  };
  std::string d = digestOf("foreign");
  reg.putManifest(
      "x", "foreign", kOciManifestType,
      withLayer({{"mediaType", "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"},
                 {"digest", d},
                 {"size", 7}}));
  reg.putManifest(
      "x", "nondist", kOciManifestType,
      withLayer({{"mediaType", "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"},
                 {"digest", d},
                 {"size", 7}}));
  reg.putManifest("x", "urls", kOciManifestType,
                  withLayer({{"mediaType", kOciGzip},
                             {"digest", d},
                             {"size", 7},
                             {"urls", {"https://example.com/blob"}}}));
  reg.putManifest(
      "x", "weird", kOciManifestType,
      withLayer({{"mediaType", "application/x-something"}, {"digest", d}, {"size", 7}}));
  reg.putManifest(
      "x", "baddigest", kOciManifestType,
      withLayer({{"mediaType", kOciGzip}, {"digest", "sha256:../../etc"}, {"size", 7}}));
  Json art = Json::parse(img.manifest);
  art["config"]["mediaType"] = "application/vnd.cncf.helm.config.v1+json";
  reg.putManifest("x", "helm", kOciManifestType, art.dump());
  reg.putManifest(
      "x", "artifact", "application/vnd.oci.artifact.manifest.v1+json",
      Json({{"schemaVersion", 2}, {"mediaType", "application/vnd.oci.artifact.manifest.v1+json"}})
          .dump());
  reg.putManifest("x", "notjson", kOciManifestType, "this is not json");
  for (const char* tag :
       {"foreign", "nondist", "urls", "weird", "baddigest", "helm", "artifact", "notjson"}) {
    auto r = client.resolve(refFor(reg, std::string("x:") + tag), plat("linux/amd64"));
    ASSERT_FALSE(r.isOk()) << tag;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << tag << ": " << r.status().toString();
    EXPECT_EQ(r.status().field(), "ref") << tag;
  }
}

TEST(RegistryClientTest, DigestMismatchesAreDataLoss) {
  FakeRegistry reg;
  RegistryClient client(fastOpts(reg));
  TestImage img = makeImage(reg, "amd64", 1);
  TestImage other = makeImage(reg, "amd64", 1, kOciManifestType, 9);
  // Asked by digest, served other bytes.
  {
    std::lock_guard lk(reg.mu);
    reg.repos.insert("x");
    reg.manifests["x@" + img.manifestDigest] = {kOciManifestType, other.manifest};
  }
  auto r = client.resolve(refFor(reg, "x@" + img.manifestDigest), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();

  // Docker-Content-Digest disagrees.
  reg.putManifest("y", "1", kOciManifestType, img.manifest);
  reg.badDigestHeader = other.manifestDigest;
  r = client.resolve(refFor(reg, "y:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
  EXPECT_NE(r.status().message().find("Docker-Content-Digest"), std::string::npos);
  reg.badDigestHeader.clear();
  EXPECT_TRUE(client.resolve(refFor(reg, "y:1"), plat("linux/amd64")).isOk());

  // The index names a digest, the registry serves other bytes under it.
  Json index = {{"schemaVersion", 2},
                {"mediaType", kOciIndexType},
                {"manifests", {indexEntry(img, "linux", "amd64")}}};
  reg.putManifest("z", "1", kOciIndexType, index.dump());
  {
    std::lock_guard lk(reg.mu);
    reg.manifests["z@" + img.manifestDigest] = {kOciManifestType, other.manifest};
  }
  r = client.resolve(refFor(reg, "z:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();

  // The config blob's bytes are not its digest.
  reg.putManifest("w", "1", kOciManifestType, img.manifest);
  {
    std::lock_guard lk(reg.mu);
    reg.blobs[img.configDigest] = img.config + " ";
  }
  r = client.resolve(refFor(reg, "w:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
}

TEST(RegistryClientTest, CapsManifestAndConfigSizes) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "amd64", 2);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryOptions o = fastOpts(reg);
  o.maxManifestBytes = int64_t(img.manifest.size()) - 1;
  auto r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kPayloadTooLarge) << r.status().toString();
  o = fastOpts(reg);
  o.maxConfigBytes = int64_t(img.config.size()) - 1;
  r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kPayloadTooLarge) << r.status().toString();
  EXPECT_EQ(reg.count("/v2/x/blobs/"), 0);  // refused from the manifest's size, not fetched
}

TEST(RegistryClientTest, ConfigAndManifestAreCutAtTheirDeclaredSize) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "amd64", 1);
  // The config is read no further than the manifest says it goes.
  Json m = Json::parse(img.manifest);
  m["config"]["size"] = 10;
  reg.putManifest("x", "1", kOciManifestType, m.dump());
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
  EXPECT_NE(r.status().message().find(img.configDigest), std::string::npos);
  EXPECT_NE(r.status().message().find("more than the 10 bytes"), std::string::npos)
      << r.status().message();
  // The manifest an index points at, no further than the index says.
  reg.putManifest("x", "2", kOciManifestType, img.manifest);
  Json entry = indexEntry(img, "linux", "amd64");
  entry["size"] = 20;
  reg.putManifest(
      "x", "i", kOciIndexType,
      Json(
          {{"schemaVersion", 2}, {"mediaType", kOciIndexType}, {"manifests", Json::array({entry})}})
          .dump());
  r = client.resolve(refFor(reg, "x:i"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
  EXPECT_NE(r.status().message().find(img.manifestDigest), std::string::npos);
  EXPECT_NE(r.status().message().find("more than the 20 bytes"), std::string::npos)
      << r.status().message();
}

TEST(RegistryClientTest, MissingThingsAreNotFound) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "x:2"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_EQ(r.status().field(), "ref");
  EXPECT_NE(r.status().message().find("tag \"2\""), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("MANIFEST_UNKNOWN"), std::string::npos);
  r = client.resolve(refFor(reg, "nosuch:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_NE(r.status().message().find("repository"), std::string::npos) << r.status().message();
  Status st = client.checkBlob(refFor(reg, "x:1"), digestOf("absent"));
  EXPECT_EQ(st.code(), Code::kNotFound) << st.toString();
  EXPECT_TRUE(client.checkBlob(refFor(reg, "x:1"), img.configDigest).isOk());
  EXPECT_EQ(client.checkBlob(refFor(reg, "x:1"), "sha256:nope").code(), Code::kInvalidArgument);
}

TEST(RegistryClientTest, RetriesServerErrorsThenGivesUp) {
  FakeRegistry reg;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  reg.failFirst = 2;
  auto r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  reg.failFirst = 100;
  r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  EXPECT_EQ(reg.failFirst, 97);  // three attempts

  // Nobody listening.
  RegistryOptions o;
  o.insecureHosts = {"127.0.0.1:1"};
  o.attempts = 2;
  o.backoffS = 0.001;
  auto down = RegistryClient(o).resolve(*parseRegistryRef("127.0.0.1:1/x:1"), plat("linux/amd64"));
  ASSERT_FALSE(down.isOk());
  EXPECT_EQ(down.status().code(), Code::kUnavailable) << down.status().toString();
  EXPECT_NE(down.status().message().find("127.0.0.1:1"), std::string::npos);
}

// ---------------------------------------------------------------------------
// Authentication.

TEST(RegistryClientTest, BearerTokenFlowAndCache) {
  FakeRegistry reg;
  reg.auth = FakeRegistry::Auth::kBearer;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("team/app", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "team/app:1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(reg.tokensIssued, 1);
  EXPECT_EQ(reg.unauthorized, 1);  // only the first request went without a token
  bool sawToken = false;
  for (const Seen& s : reg.requests()) {
    if (s.path == "/token") {
      sawToken = true;
      EXPECT_NE(s.query.find("service=fake-registry"), std::string::npos) << s.query;
      EXPECT_NE(s.query.find("scope=repository%3Ateam%2Fapp%3Apull"), std::string::npos) << s.query;
      EXPECT_TRUE(s.authorization.empty());  // anonymous
    }
  }
  EXPECT_TRUE(sawToken);
  // The token is cached: a second resolve and a blob fetch ask for none.
  ASSERT_TRUE(client.resolve(refFor(reg, "team/app:1"), plat("linux/amd64")).isOk());
  std::string spool = tempPath();
  ASSERT_TRUE(client.fetchBlob(refFor(reg, "team/app:1"), r->layers[0], spool).isOk());
  ::unlink(spool.c_str());
  EXPECT_EQ(reg.tokensIssued, 1);
  EXPECT_EQ(reg.unauthorized, 1);

  // The registry forgets its tokens: one 401, one new token, success.
  reg.revokeTokens();
  ASSERT_TRUE(client.resolve(refFor(reg, "team/app:1"), plat("linux/amd64")).isOk());
  EXPECT_EQ(reg.tokensIssued, 2);
  EXPECT_EQ(reg.unauthorized, 2);
}

TEST(RegistryClientTest, BearerTokenRenewedOnExpiry) {
  FakeRegistry reg;
  reg.auth = FakeRegistry::Auth::kBearer;
  reg.tokenExpiresIn = 1;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  ASSERT_TRUE(client.resolve(refFor(reg, "x:1"), plat("linux/amd64")).isOk());
  EXPECT_EQ(reg.tokensIssued, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_TRUE(client.resolve(refFor(reg, "x:1"), plat("linux/amd64")).isOk());
  EXPECT_EQ(reg.tokensIssued, 2);  // fetched again before use...
  EXPECT_EQ(reg.unauthorized, 1);  // ...without a 401 first
}

TEST(RegistryClientTest, BearerWithCredentials) {
  FakeRegistry reg;
  reg.auth = FakeRegistry::Auth::kBearer;
  reg.tokenNeedsCreds = true;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryOptions o = fastOpts(reg);
  o.credentials = RegistryCredentials{"alice", "s3cret-pw", ""};
  auto r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  // The credentials went to the token endpoint only; the registry saw tokens.
  for (const Seen& s : reg.requests()) {
    if (s.path == "/token") {
      EXPECT_EQ(s.authorization, "Basic " + base64Encode("alice:s3cret-pw"));
    } else {
      EXPECT_FALSE(startsWith(s.authorization, "Basic")) << s.path;
    }
  }
  // Wrong password: kUnauthenticated, and the password is nowhere in it.
  o.credentials = RegistryCredentials{"alice", "wrong-pw", ""};
  r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated);
  EXPECT_EQ(r.status().field(), "auth");
  EXPECT_EQ(r.status().message().find("wrong-pw"), std::string::npos);
  // No credentials at all.
  r = RegistryClient(fastOpts(reg)).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated);
}

TEST(RegistryClientTest, IdentityTokenIsPostedAsRefreshToken) {
  FakeRegistry reg;
  reg.auth = FakeRegistry::Auth::kBearer;
  reg.identityToken = "refresh-abc";
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryOptions o = fastOpts(reg);
  o.credentials = RegistryCredentials{"", "", "refresh-abc"};
  auto r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  bool posted = false;
  for (const Seen& s : reg.requests()) {
    if (s.path == "/token") {
      EXPECT_EQ(s.method, "POST");
      EXPECT_NE(s.body.find("scope=repository%3Ax%3Apull"), std::string::npos) << s.body;
      EXPECT_NE(s.body.find("service=fake-registry"), std::string::npos) << s.body;
      posted = true;
    }
  }
  EXPECT_TRUE(posted);
  o.credentials = RegistryCredentials{"", "", "refresh-stale"};
  r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated);
  EXPECT_EQ(r.status().message().find("refresh-stale"), std::string::npos);
}

TEST(RegistryClientTest, TokenServiceErrorsNameTheTokenService) {
  FakeRegistry reg, tokens;
  reg.auth = FakeRegistry::Auth::kBearer;
  reg.realm = "http://" + tokens.hostPort() + "/token";
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  tokens.tokenStatus = 403;
  auto r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().toString();
  EXPECT_EQ(r.status().field(), "auth");
  EXPECT_NE(r.status().message().find("denied by token service " + tokens.hostPort()),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(r.status().message().find("by " + reg.hostPort()), std::string::npos)
      << r.status().message();
  tokens.tokenStatus = 503;
  r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  EXPECT_NE(r.status().message().find("token service " + tokens.hostPort() + " unavailable"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(r.status().message().find(reg.hostPort() + " unavailable"), std::string::npos)
      << r.status().message();
  // A token endpoint that is not there is no missing image.
  tokens.tokenStatus = 404;
  r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated) << r.status().toString();
  EXPECT_EQ(r.status().field(), "auth");
  EXPECT_NE(r.status().message().find("token service " + tokens.hostPort()), std::string::npos)
      << r.status().message();
}

TEST(RegistryClientTest, BasicAuth) {
  FakeRegistry reg;
  reg.auth = FakeRegistry::Auth::kBasic;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryOptions o = fastOpts(reg);
  o.credentials = RegistryCredentials{"alice", "s3cret-pw", ""};
  RegistryClient client(o);
  auto r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_TRUE(client.resolve(refFor(reg, "x:1"), plat("linux/amd64")).isOk());
  EXPECT_EQ(reg.unauthorized, 1);  // known afterwards: sent up front

  o.credentials = RegistryCredentials{"alice", "wrong-pw", ""};
  r = RegistryClient(o).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated);
  EXPECT_EQ(r.status().field(), "auth");
  EXPECT_EQ(r.status().message().find("wrong-pw"), std::string::npos);
  r = RegistryClient(fastOpts(reg)).resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kUnauthenticated);
}

TEST(RegistryClientTest, ForbiddenIsPermissionDenied) {
  FakeRegistry reg;
  reg.deny = true;
  TestImage img = makeImage(reg, "amd64", 1);
  reg.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryClient client(fastOpts(reg));
  auto r = client.resolve(refFor(reg, "x:1"), plat("linux/amd64"));
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  EXPECT_EQ(r.status().field(), "auth");
  EXPECT_NE(r.status().message().find("DENIED"), std::string::npos) << r.status().message();
  RegistryLayer l{img.configDigest, int64_t(img.config.size()), kOciGzip, LayerCompression::kGzip};
  std::string spool = tempPath();
  EXPECT_EQ(client.fetchBlob(refFor(reg, "x:1"), l, spool).code(), Code::kPermissionDenied);
  ::unlink(spool.c_str());
}

// ---------------------------------------------------------------------------
// fetchBlob()

struct BlobFixture {
  FakeRegistry reg;
  std::string data = pattern(300000, 5);
  RegistryLayer layer;
  RegistryRef ref;
  std::string spool = tempPath();
  BlobFixture() {
    layer = {reg.putBlob(data), int64_t(data.size()), kOciGzip, LayerCompression::kGzip};
    reg.putManifest("blobs", "1", kOciManifestType, "{}");
    ref = refFor(reg, "blobs:1");
  }
  ~BlobFixture() { ::unlink(spool.c_str()); }
  std::string spooled() { return readFile(spool).isOk() ? *readFile(spool) : "<none>"; }
};

TEST(RegistryClientTest, FetchesBlobWithProgress) {
  BlobFixture f;
  RegistryClient client(fastOpts(f.reg));
  std::vector<int64_t> seen;
  Status st = client.fetchBlob(f.ref, f.layer, f.spool, [&](int64_t n) { seen.push_back(n); });
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), int64_t(f.data.size()));
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  // Already complete: verified without another transfer.
  int before = f.reg.count("/v2/blobs/blobs/");
  ASSERT_TRUE(client.fetchBlob(f.ref, f.layer, f.spool).isOk());
  EXPECT_EQ(f.reg.count("/v2/blobs/blobs/"), before);
}

TEST(RegistryClientTest, ResumesWithRangeAfterCuts) {
  BlobFixture f;
  f.reg.cutAfter = 50000;
  f.reg.cuts = 4;  // more than the attempts: each cut made progress
  RegistryClient client(fastOpts(f.reg));
  Status st = client.fetchBlob(f.ref, f.layer, f.spool);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  std::vector<std::string> ranges;
  for (const Seen& s : f.reg.requests()) {
    if (startsWith(s.path, "/v2/blobs/blobs/")) ranges.push_back(s.range);
  }
  EXPECT_EQ(ranges, (std::vector<std::string>{"", "bytes=50000-", "bytes=100000-", "bytes=150000-",
                                              "bytes=200000-"}));
}

TEST(RegistryClientTest, ResumesAnExistingSpoolAndRestartsOn200) {
  BlobFixture f;
  RegistryClient client(fastOpts(f.reg));
  // A spool holding the right prefix: only the rest is asked for.
  ASSERT_TRUE(writeFileAtomic(f.spool, f.data.substr(0, 123456)).isOk());
  ASSERT_TRUE(client.fetchBlob(f.ref, f.layer, f.spool).isOk());
  EXPECT_TRUE(f.spooled() == f.data);
  EXPECT_EQ(f.reg.requests().back().range, "bytes=123456-");

  // A spool of garbage and a server that ignores Range: the 200 starts over.
  ASSERT_TRUE(writeFileAtomic(f.spool, std::string(1000, 'x')).isOk());
  f.reg.ignoreRange = true;
  Status st = client.fetchBlob(f.ref, f.layer, f.spool);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  EXPECT_EQ(f.reg.requests().back().range, "bytes=1000-");

  // A spool longer than the blob starts over too.
  f.reg.ignoreRange = false;
  ASSERT_TRUE(writeFileAtomic(f.spool, f.data + "extra").isOk());
  ASSERT_TRUE(client.fetchBlob(f.ref, f.layer, f.spool).isOk());
  EXPECT_TRUE(f.spooled() == f.data);
}

TEST(RegistryClientTest, DigestOrLengthMismatchDeletesSpool) {
  BlobFixture f;
  RegistryClient client(fastOpts(f.reg));
  RegistryLayer wrong = f.layer;
  {
    std::lock_guard lk(f.reg.mu);
    f.reg.blobs[digestOf("something else")] = f.data;
  }
  wrong.digest = digestOf("something else");
  Status st = client.fetchBlob(f.ref, wrong, f.spool);
  EXPECT_EQ(st.code(), Code::kDataLoss) << st.toString();
  EXPECT_EQ(fileSize(f.spool), -1);

  RegistryLayer shortLayer = f.layer;
  shortLayer.size -= 10;  // the registry sends more than the manifest said
  st = client.fetchBlob(f.ref, shortLayer, f.spool);
  EXPECT_EQ(st.code(), Code::kDataLoss) << st.toString();
  EXPECT_EQ(fileSize(f.spool), -1);

  RegistryLayer longLayer = f.layer;
  longLayer.size += 10;  // the registry's blob is shorter than the manifest said
  st = client.fetchBlob(f.ref, longLayer, f.spool);
  EXPECT_EQ(st.code(), Code::kDataLoss) << st.toString();
  EXPECT_EQ(fileSize(f.spool), -1);

  RegistryLayer missing = f.layer;
  missing.digest = digestOf("absent");
  st = client.fetchBlob(f.ref, missing, f.spool);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.toString();
  EXPECT_NE(st.message().find("BLOB_UNKNOWN"), std::string::npos) << st.message();
  ::unlink(f.spool.c_str());
  RegistryLayer bad = f.layer;
  bad.digest = "sha256:../x";
  EXPECT_EQ(client.fetchBlob(f.ref, bad, f.spool).code(), Code::kInvalidArgument);
}

TEST(RegistryClientTest, BlobLargerThanDeclaredIsCutAtItsSize) {
  BlobFixture f;
  RegistryClient client(fastOpts(f.reg));
  RegistryLayer small = f.layer;
  small.size = 1000;  // the registry sends 300000
  int64_t most = 0;
  Status st = client.fetchBlob(f.ref, small, f.spool, [&](int64_t n) { most = std::max(most, n); });
  EXPECT_EQ(st.code(), Code::kDataLoss) << st.toString();
  EXPECT_NE(st.message().find(small.digest), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("more bytes than the 1000"), std::string::npos) << st.message();
  EXPECT_LE(most, 1000);
  EXPECT_EQ(fileSize(f.spool), -1);
}

TEST(RegistryClientTest, ResumesAfter206OfUnknownTotal) {
  // "bytes a-b/*" is a legal Content-Range; a server may also answer a range
  // in parts.
  BlobFixture f;
  f.reg.unknownTotal = true;
  f.reg.rangeCap = 100000;
  ASSERT_TRUE(writeFileAtomic(f.spool, f.data.substr(0, 1000)).isOk());
  RegistryClient client(fastOpts(f.reg));
  Status st = client.fetchBlob(f.ref, f.layer, f.spool);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  std::vector<std::string> ranges;
  for (const Seen& s : f.reg.requests()) {
    if (startsWith(s.path, "/v2/blobs/blobs/")) ranges.push_back(s.range);
  }
  EXPECT_EQ(ranges, (std::vector<std::string>{"bytes=1000-", "bytes=101000-", "bytes=201000-"}));
  // A known total that disagrees with the manifest is still data loss.
  f.reg.unknownTotal = false;
  RegistryLayer longer = f.layer;
  longer.size += 100;
  ASSERT_TRUE(writeFileAtomic(f.spool, f.data.substr(0, 1000)).isOk());
  st = client.fetchBlob(f.ref, longer, f.spool);
  EXPECT_EQ(st.code(), Code::kDataLoss) << st.toString();
}

TEST(RegistryClientTest, HttpsRedirectToPlainHttpIsRefused) {
  // The https registry sends each request to the same path on a plain http one.
  FakeRegistry plain;
  TlsRedirector tls("http://" + plain.hostPort());
  if (!tls.skipReason.empty()) GTEST_SKIP() << tls.skipReason;
  TestImage img = makeImage(plain, "amd64", 1);
  plain.putManifest("x", "1", kOciManifestType, img.manifest);
  RegistryLayer layer{img.layers[0]["digest"].get<std::string>(), int64_t(img.layerBytes[0].size()),
                      kOciGzip, LayerCompression::kGzip};
  RegistryOptions o;
  o.caFile = tls.caFile();
  o.attempts = 2;
  o.backoffS = 0.001;
  RegistryRef ref = *parseRegistryRef(tls.hostPort() + "/x:1");
  std::string spool = tempPath();
  {
    RegistryClient client(o);
    auto r = client.resolve(ref, plat("linux/amd64"));
    ASSERT_FALSE(r.isOk()) << "a manifest came over plain http";
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().toString();
    EXPECT_NE(r.status().message().find("plain http"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(plain.hostPort()), std::string::npos);
    Status st = client.fetchBlob(ref, layer, spool);
    EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
    EXPECT_NE(st.message().find("plain http"), std::string::npos) << st.message();
    EXPECT_EQ(plain.count("/v2/"), 0);
  }
  // Unless the caller named that host insecure.
  o.insecureHosts = {plain.hostPort()};
  RegistryClient client(o);
  auto r = client.resolve(ref, plat("linux/amd64"));
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  Status st = client.fetchBlob(ref, layer, spool);
  EXPECT_TRUE(st.isOk()) << st.toString();
  ::unlink(spool.c_str());
}

TEST(RegistryClientTest, CheckBlobFollowsRedirects) {
  BlobFixture f;
  FakeRegistry storage(/*storageOnly=*/true);
  f.reg.redirectBase = "http://" + storage.hostPort();
  RegistryClient client(fastOpts(f.reg));
  // A redirect alone says nothing: storage without the blob is "not found".
  Status st = client.checkBlob(f.ref, f.layer.digest);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.toString();
  storage.putBlob(f.data);
  st = client.checkBlob(f.ref, f.layer.digest);
  EXPECT_TRUE(st.isOk()) << st.toString();
  ASSERT_FALSE(storage.requests().empty());
  EXPECT_EQ(storage.requests().back().method, "HEAD");
  // Storage that refuses HEAD (a URL presigned for GET): its first byte is
  // read instead.
  storage.refuseHead = true;
  st = client.checkBlob(f.ref, f.layer.digest);
  EXPECT_TRUE(st.isOk()) << st.toString();
  EXPECT_EQ(storage.requests().back().method, "GET");
  EXPECT_EQ(storage.requests().back().range, "bytes=0-0");
  {
    std::lock_guard lk(f.reg.mu);
    f.reg.blobs[digestOf("absent")] = "x";  // the registry has it, storage not
  }
  st = client.checkBlob(f.ref, digestOf("absent"));
  EXPECT_EQ(st.code(), Code::kNotFound) << st.toString();
}

TEST(RegistryClientTest, CancelKeepsSpoolForResume) {
  BlobFixture f;
  f.reg.slowBlob = true;
  RegistryClient client(fastOpts(f.reg));
  std::atomic<bool> cancel{false};
  int64_t last = 0;
  Status st = client.fetchBlob(
      f.ref, f.layer, f.spool,
      [&](int64_t n) {
        last = n;
        if (n >= 20000) cancel = true;
      },
      &cancel);
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.toString();
  EXPECT_NE(st.message().find("cancelled"), std::string::npos);
  int64_t kept = fileSize(f.spool);
  EXPECT_EQ(kept, last);
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, int64_t(f.data.size()));
  // Cancelled before it starts: nothing asked.
  int before = f.reg.count("/v2/");
  EXPECT_EQ(client.fetchBlob(f.ref, f.layer, f.spool, {}, &cancel).code(), Code::kUnavailable);
  EXPECT_EQ(f.reg.count("/v2/"), before);
  // Resumed later.
  cancel = false;
  f.reg.slowBlob = false;
  st = client.fetchBlob(f.ref, f.layer, f.spool, {}, &cancel);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  EXPECT_EQ(f.reg.requests().back().range, "bytes=" + std::to_string(kept) + "-");
}

TEST(RegistryClientTest, RedirectToStorageDropsAuthorization) {
  BlobFixture f;
  FakeRegistry storage(/*storageOnly=*/true);
  storage.putBlob(f.data);
  f.reg.auth = FakeRegistry::Auth::kBearer;
  f.reg.redirectBase = "http://" + storage.hostPort();
  RegistryClient client(fastOpts(f.reg));
  Status st = client.fetchBlob(f.ref, f.layer, f.spool);
  ASSERT_TRUE(st.isOk()) << st.toString();
  EXPECT_TRUE(f.spooled() == f.data);
  bool registrySawToken = false;
  for (const Seen& s : f.reg.requests()) {
    if (startsWith(s.path, "/v2/") && startsWith(s.authorization, "Bearer ")) {
      registrySawToken = true;
    }
  }
  EXPECT_TRUE(registrySawToken);
  auto got = storage.requests();
  ASSERT_FALSE(got.empty());
  for (const Seen& s : got) {
    EXPECT_EQ(s.authorization, "") << "Authorization leaked to " << s.path;
    EXPECT_EQ(s.query, "X-Signature=secret");
  }
  // Resume through the redirect: Range goes along, Authorization does not.
  ASSERT_TRUE(writeFileAtomic(f.spool, f.data.substr(0, 777)).isOk());
  ASSERT_TRUE(client.fetchBlob(f.ref, f.layer, f.spool).isOk());
  EXPECT_TRUE(f.spooled() == f.data);
  EXPECT_EQ(storage.requests().back().range, "bytes=777-");
  EXPECT_EQ(storage.requests().back().authorization, "");
  // checkBlob follows the redirect as a GET does, without Authorization.
  EXPECT_TRUE(client.checkBlob(f.ref, f.layer.digest).isOk());
  EXPECT_EQ(storage.requests().back().method, "HEAD");
  EXPECT_EQ(storage.requests().back().authorization, "");
}

TEST(RegistryClientTest, AChallengeFromWhereABlobRedirectsGetsNoCredentials) {
  // Storage answering the redirect with a 401 naming a realm of its own must
  // not get the registry's credentials sent there.
  BlobFixture f;
  FakeRegistry attacker;
  FakeRegistry storage(/*storageOnly=*/true);
  storage.putBlob(f.data);
  storage.storageChallenge = "Bearer realm=\"http://" + attacker.hostPort() + "/token\",service=x";
  f.reg.auth = FakeRegistry::Auth::kBasic;
  f.reg.redirectBase = "http://" + storage.hostPort();
  RegistryOptions o = fastOpts(f.reg);
  o.credentials = RegistryCredentials{"alice", "s3cret-pw", ""};
  o.insecureHosts.push_back(attacker.hostPort());
  RegistryClient client(o);
  Status st = client.fetchBlob(f.ref, f.layer, f.spool);
  EXPECT_FALSE(st.isOk());
  bool registryAuthed = false;
  for (const Seen& s : f.reg.requests()) registryAuthed |= startsWith(s.authorization, "Basic ");
  EXPECT_TRUE(registryAuthed);  // the redirect was reached with credentials in hand
  EXPECT_TRUE(attacker.requests().empty()) << "credentials went to the storage's realm";
  for (const Seen& s : storage.requests()) EXPECT_EQ(s.authorization, "");
}

TEST(RegistryClientTest, ConcurrentFetchesShareOneToken) {
  BlobFixture f;
  f.reg.auth = FakeRegistry::Auth::kBearer;
  RegistryClient client(fastOpts(f.reg));
  ASSERT_TRUE(client.checkBlob(f.ref, f.layer.digest).isOk());
  std::vector<std::thread> ts;
  std::atomic<int> ok{0};
  for (int i = 0; i < 4; ++i) {
    ts.emplace_back([&, i] {
      std::string spool = f.spool + "-" + std::to_string(i);
      if (client.fetchBlob(f.ref, f.layer, spool).isOk() && *readFile(spool) == f.data) ++ok;
      ::unlink(spool.c_str());
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(f.reg.tokensIssued, 1);
}

// ---------------------------------------------------------------------------
// Against a real registry: DSEC_TEST_REGISTRY_REF="127.0.0.1:5000/repo:tag"
// (reached over plain http), optionally DSEC_TEST_REGISTRY_PLATFORM and
// DSEC_TEST_REGISTRY_CREDS ("user:password").

TEST(RegistryClientRealTest, ResolvesAndFetchesFromARealRegistry) {
  const char* refText = getenv("DSEC_TEST_REGISTRY_REF");
  if (!refText || !*refText) {
    GTEST_SKIP() << "set DSEC_TEST_REGISTRY_REF=host:port/repo:tag to run against a registry";
  }
  auto ref = parseRegistryRef(refText);
  ASSERT_TRUE(ref.isOk()) << ref.status().toString();
  const char* platText = getenv("DSEC_TEST_REGISTRY_PLATFORM");
  auto platform = parseImagePlatform(platText && *platText ? platText : "linux/amd64");
  ASSERT_TRUE(platform.isOk());
  RegistryOptions o;
  o.insecureHosts = {ref->host};
  if (const char* creds = getenv("DSEC_TEST_REGISTRY_CREDS"); creds && strchr(creds, ':')) {
    std::string c = creds;
    o.credentials = RegistryCredentials{c.substr(0, c.find(':')), c.substr(c.find(':') + 1), ""};
  }
  RegistryClient client(o);
  auto img = client.resolve(*ref, *platform);
  ASSERT_TRUE(img.isOk()) << img.status().toString();
  std::cout << "resolved " << ref->str() << ": manifest " << img->manifestDigest << " ("
            << img->manifestMediaType << "), index " << img->indexDigest << ", platform "
            << img->platform << ", config " << img->configDigest << ", " << img->layers.size()
            << " layers\n";
  for (const RegistryLayer& l : img->layers) {
    EXPECT_TRUE(client.checkBlob(*ref, l.digest).isOk());
    std::string spool = tempPath();
    Status st = client.fetchBlob(*ref, l, spool);
    EXPECT_TRUE(st.isOk()) << st.toString();
    EXPECT_EQ(fileSize(spool), l.size);
    std::cout << "  fetched " << l.digest << " " << l.size << " bytes (" << l.mediaType << ")\n";
    // Resumed from half way: a Range request the registry must honour.
    ASSERT_EQ(::truncate(spool.c_str(), l.size / 2), 0);
    st = client.fetchBlob(*ref, l, spool);
    EXPECT_TRUE(st.isOk()) << st.toString();
    EXPECT_EQ(fileSize(spool), l.size);
    ::unlink(spool.c_str());
  }
}

}  // namespace
}  // namespace dsec::image
