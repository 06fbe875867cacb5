#include "image/registry_client.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/base64.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"

namespace dsec::image {

namespace {

using Json = nlohmann::json;

constexpr std::string_view kDockerHub = "docker.io";
constexpr std::string_view kDockerHubApi = "registry-1.docker.io";

constexpr std::string_view kOciIndex = "application/vnd.oci.image.index.v1+json";
constexpr std::string_view kDockerList =
    "application/vnd.docker.distribution.manifest.list.v2+json";
constexpr std::string_view kOciManifest = "application/vnd.oci.image.manifest.v1+json";
constexpr std::string_view kDockerManifest = "application/vnd.docker.distribution.manifest.v2+json";
constexpr std::string_view kDockerSchema1 = "application/vnd.docker.distribution.manifest.v1+json";
constexpr std::string_view kDockerSchema1Signed =
    "application/vnd.docker.distribution.manifest.v1+prettyjws";
constexpr std::string_view kOciConfig = "application/vnd.oci.image.config.v1+json";
constexpr std::string_view kDockerConfig = "application/vnd.docker.container.image.v1+json";

constexpr size_t kErrorBodyBytes = 64 << 10;

bool isLowerAlnum(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }
bool isAlnum(char c) { return isLowerAlnum(c) || (c >= 'A' && c <= 'Z'); }
bool isDigit(char c) { return c >= '0' && c <= '9'; }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

bool validDigest(std::string_view d) {
  if (d.size() != 7 + 64 || d.substr(0, 7) != "sha256:") return false;
  for (char c : d.substr(7)) {
    if (!(isDigit(c) || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// [a-z0-9]+ ((\.|_|__|-+) [a-z0-9]+)*
bool validPathComponent(std::string_view c) {
  if (c.empty() || !isLowerAlnum(c.front()) || !isLowerAlnum(c.back())) return false;
  size_t i = 0;
  while (i < c.size()) {
    if (isLowerAlnum(c[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < c.size() && !isLowerAlnum(c[j])) ++j;
    std::string_view sep = c.substr(i, j - i);
    if (!(sep == "." || sep == "_" || sep == "__" ||
          sep.find_first_not_of('-') == std::string_view::npos)) {
      return false;
    }
    i = j;
  }
  return true;
}

// [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
bool validTag(std::string_view t) {
  if (t.empty() || t.size() > 128) return false;
  if (!(isAlnum(t[0]) || t[0] == '_')) return false;
  for (char c : t) {
    if (!(isAlnum(c) || c == '_' || c == '.' || c == '-')) return false;
  }
  return true;
}

bool validPort(std::string_view p) {
  if (p.empty() || p.size() > 5) return false;
  for (char c : p) {
    if (!isDigit(c)) return false;
  }
  long v = strtol(std::string(p).c_str(), nullptr, 10);
  return v >= 1 && v <= 65535;
}

// domain-component ('.' domain-component)* [':' port], or '[' IPv6 ']' [':' port].
bool validHost(std::string_view h) {
  std::string_view name = h;
  if (!h.empty() && h[0] == '[') {
    size_t close = h.find(']');
    if (close == std::string_view::npos || close < 3) return false;
    for (char c : h.substr(1, close - 1)) {
      if (!(isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') || c == ':' ||
            c == '.')) {
        return false;
      }
    }
    std::string_view rest = h.substr(close + 1);
    return rest.empty() || (rest[0] == ':' && validPort(rest.substr(1)));
  }
  size_t colon = h.find(':');
  if (colon != std::string_view::npos) {
    if (!validPort(h.substr(colon + 1))) return false;
    name = h.substr(0, colon);
  }
  if (name.empty()) return false;
  for (std::string_view comp : splitString(name, '.')) {
    if (comp.empty() || !isAlnum(comp.front()) || !isAlnum(comp.back())) return false;
    for (char c : comp) {
      if (!(isAlnum(c) || c == '-')) return false;
    }
  }
  return true;
}

// containerd's normalisation of architecture names and arm variants.
void normalisePlatform(ImagePlatform& p) {
  p.os = lower(p.os);
  p.architecture = lower(p.architecture);
  p.variant = lower(p.variant);
  if (p.os == "macos") p.os = "darwin";
  if (p.architecture == "x86_64" || p.architecture == "x86-64") {
    p.architecture = "amd64";
  } else if (p.architecture == "aarch64") {
    p.architecture = "arm64";
  } else if (p.architecture == "armhf") {
    p.architecture = "arm";
    if (p.variant.empty()) p.variant = "v7";
  } else if (p.architecture == "armel") {
    p.architecture = "arm";
    if (p.variant.empty()) p.variant = "v6";
  } else if (p.architecture == "i386") {
    p.architecture = "386";
  }
  if ((p.architecture == "arm" || p.architecture == "arm64") && p.variant.size() == 1 &&
      isDigit(p.variant[0])) {
    p.variant = "v" + p.variant;
  }
  if (p.architecture == "arm" && p.variant.empty()) p.variant = "v7";
}

bool platformMatches(const ImagePlatform& want, const ImagePlatform& have) {
  if (want.os != have.os || want.architecture != have.architecture) return false;
  if (want.architecture == "arm64") {
    auto v = [](const std::string& s) { return s == "v8" ? std::string() : s; };
    return v(want.variant) == v(have.variant);
  }
  if (want.architecture == "amd64" && want.variant.empty()) return true;
  return want.variant == have.variant;
}

// "host[:port]" of a URL, lower-cased ("" if none).
std::string authorityOf(std::string_view url) {
  size_t p = url.find("://");
  if (p == std::string_view::npos) return "";
  std::string_view rest = url.substr(p + 3);
  rest = rest.substr(0, rest.find_first_of("/?#"));
  size_t at = rest.rfind('@');
  if (at != std::string_view::npos) rest = rest.substr(at + 1);
  return lower(rest);
}

// "scheme://host:port" with the default port filled in: what decides whether
// a request may carry the registry's Authorization.
std::string originOf(std::string_view url) {
  size_t p = url.find("://");
  if (p == std::string_view::npos) return "";
  std::string scheme = lower(url.substr(0, p));
  std::string auth = authorityOf(url);
  std::string host = auth, port;
  size_t close = auth.find(']');
  size_t colon = auth.rfind(':');
  if (colon != std::string::npos && (close == std::string::npos || colon > close)) {
    host = auth.substr(0, colon);
    port = auth.substr(colon + 1);
  }
  if (port.empty()) port = scheme == "https" ? "443" : "80";
  return scheme + "://" + host + ":" + port;
}

// A URL fit for a message: presigned blob-storage URLs carry signatures in
// their query, so it is dropped.
std::string redact(std::string_view url) {
  return std::string(url.substr(0, url.find_first_of("?#")));
}

std::string formEncode(std::string_view s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    if (isAlnum(char(c)) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(char(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

bool isTchar(char c) { return isAlnum(c) || (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != nullptr); }
bool isToken68Char(char c) {
  return isAlnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || c == '+' || c == '/';
}

// "CODE: message; CODE: message" from a registry's {"errors":[...]} body, and
// the codes. Only code and message: "detail" may be anything.
std::string registryErrors(const std::string& body, std::vector<std::string>* codes) {
  Json j = Json::parse(body, nullptr, false);
  std::string out;
  if (j.is_object() && j.contains("errors") && j["errors"].is_array()) {
    for (const Json& e : j["errors"]) {
      if (!e.is_object()) continue;
      std::string code = e.contains("code") && e["code"].is_string() ? e["code"].get<std::string>()
                                                                     : std::string();
      std::string msg = e.contains("message") && e["message"].is_string()
                            ? e["message"].get<std::string>()
                            : std::string();
      if (code.empty() && msg.empty()) continue;
      if (codes) codes->push_back(code);
      if (!out.empty()) out += "; ";
      out += code.empty() ? msg : msg.empty() ? code : code + ": " + msg;
    }
  } else if (!body.empty() && body.size() <= 200 && body.find('<') == std::string::npos) {
    // A short plain-text answer (not an HTML page) says something useful.
    out = std::string(trim(body));
    for (char& c : out) {
      if (static_cast<unsigned char>(c) < ' ') c = ' ';
    }
  }
  if (out.size() > 300) out = out.substr(0, 300) + "...";
  return out;
}

bool hasCode(const std::vector<std::string>& codes, std::string_view c) {
  return std::find(codes.begin(), codes.end(), c) != codes.end();
}

void sleepFor(double seconds, const std::atomic<bool>* cancel) {
  double until = monoSeconds() + seconds;
  for (;;) {
    double left = until - monoSeconds();
    if (left <= 0 || (cancel && cancel->load())) return;
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(left, 0.05)));
  }
}

double jitter(double s) {
  uint32_t r = 0;
  (void)::getrandom(&r, sizeof r, 0);
  return s * (0.5 + 0.5 * (r / 4294967296.0));
}

std::once_flag curlInit;

}  // namespace

// ---------------------------------------------------------------------------
// References, platforms, config.json, WWW-Authenticate.

std::string RegistryRef::apiHost() const {
  return host == kDockerHub ? std::string(kDockerHubApi) : host;
}

std::string RegistryRef::str() const {
  std::string out = host + "/" + repository;
  if (!tag.empty()) out += ":" + tag;
  if (!digest.empty()) out += "@" + digest;
  return out;
}

Result<RegistryRef> parseRegistryRef(std::string_view text) {
  if (text.empty()) return invalidArg("ref", "empty image reference");
  for (char c : text) {
    if (static_cast<unsigned char>(c) <= ' ' || static_cast<unsigned char>(c) >= 0x7f) {
      return invalidArg("ref",
                        "invalid image reference: it holds whitespace, a control or a "
                        "non-ASCII character");
    }
  }
  if (text.size() > 1024) return invalidArg("ref", "invalid image reference: over 1024 characters");
  auto bad = [&](const std::string& why) {
    return invalidArg("ref", "invalid image reference \"" + std::string(text) + "\": " + why);
  };
  RegistryRef r;
  std::string_view name = text;
  size_t at = text.find('@');
  if (at != std::string_view::npos) {
    std::string_view d = text.substr(at + 1);
    name = text.substr(0, at);
    size_t colon = d.find(':');
    if (d.empty()) return bad("empty digest after '@'");
    if (colon != std::string_view::npos && d.substr(0, colon) != "sha256") {
      return bad("digest algorithm \"" + std::string(d.substr(0, colon)) +
                 "\" is not supported (only sha256)");
    }
    if (!validDigest(d)) return bad("a digest is sha256:<64 lower-case hex digits>");
    r.digest = std::string(d);
  }
  std::string_view rest = name;
  size_t slash = name.find('/');
  if (slash != std::string_view::npos) {
    std::string_view first = name.substr(0, slash);
    if (first.find_first_of(".:") != std::string_view::npos || first == "localhost") {
      if (!validHost(first)) return bad("invalid registry host \"" + std::string(first) + "\"");
      r.host = lower(first);
      rest = name.substr(slash + 1);
    }
  }
  if (r.host.empty() || r.host == "index.docker.io") r.host = std::string(kDockerHub);
  size_t colon = rest.rfind(':');
  if (colon != std::string_view::npos) {
    std::string_view tag = rest.substr(colon + 1);
    if (tag.empty()) return bad("empty tag after ':'");
    if (!validTag(tag)) {
      return bad("invalid tag \"" + std::string(tag) +
                 "\" (a tag is [A-Za-z0-9_][A-Za-z0-9_.-]{0,127})");
    }
    r.tag = std::string(tag);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return bad("no repository name");
  if (std::any_of(rest.begin(), rest.end(), [](char c) { return c >= 'A' && c <= 'Z'; })) {
    return bad("repository name must be lowercase");
  }
  for (const std::string& comp : splitString(rest, '/')) {
    if (comp.empty()) return bad("empty path component in the repository name");
    if (!validPathComponent(comp)) {
      return bad("invalid repository path component \"" + comp +
                 "\" (lower-case letters and digits, separated by '.', '_', '__' or '-')");
    }
  }
  r.repository = std::string(rest);
  if (r.host == kDockerHub && r.repository.find('/') == std::string::npos) {
    r.repository = "library/" + r.repository;
  }
  if (r.host.size() + 1 + r.repository.size() > 255) {
    return bad("host and repository name longer than 255 characters");
  }
  if (r.tag.empty() && r.digest.empty()) r.tag = "latest";
  return r;
}

std::string ImagePlatform::str() const {
  return os + "/" + architecture + (variant.empty() ? "" : "/" + variant);
}

Result<ImagePlatform> parseImagePlatform(std::string_view text) {
  std::vector<std::string> parts = splitString(text, '/');
  if (parts.size() < 2 || parts.size() > 3) {
    return invalidArg("platform", "invalid platform \"" + std::string(text) +
                                      "\": expected os/architecture[/variant]");
  }
  for (const std::string& p : parts) {
    bool ok = !p.empty() && p.size() <= 64 && std::all_of(p.begin(), p.end(), [](char c) {
      return isAlnum(c) || c == '_' || c == '-' || c == '.';
    });
    if (!ok) {
      return invalidArg("platform", "invalid platform \"" + std::string(text) +
                                        "\": empty or malformed component");
    }
  }
  ImagePlatform p{parts[0], parts[1], parts.size() == 3 ? parts[2] : ""};
  normalisePlatform(p);
  return p;
}

std::optional<std::string> dockerConfigKeyFor(const std::vector<std::string>& keys,
                                              std::string_view host) {
  for (const std::string& k : keys) {
    if (k == host) return k;
  }
  std::string want = lower(host);
  std::vector<std::string> names{want};
  if (want == kDockerHub) {
    names.push_back("index.docker.io");
    names.push_back(std::string(kDockerHubApi));
  }
  // "https://host/v1/" -> "host".
  auto keyHost = [](std::string_view k) {
    std::string l = lower(k);
    for (std::string_view scheme : {"https://", "http://"}) {
      if (startsWith(l, scheme)) l = l.substr(scheme.size());
    }
    return l.substr(0, l.find('/'));
  };
  for (const std::string& n : names) {
    for (const std::string& k : keys) {
      if (keyHost(k) == n) return k;
    }
  }
  return std::nullopt;
}

Result<std::optional<RegistryCredentials>> credentialsFromDockerConfig(std::string_view json,
                                                                       std::string_view host) {
  // nlohmann's parse errors quote the text they choked on, which may be a
  // secret: report the byte offset only.
  Json j;
  try {
    j = Json::parse(json);
  } catch (const Json::parse_error& e) {
    return invalidArg("auth",
                      "docker config is not valid JSON (at byte " + std::to_string(e.byte) + ")");
  } catch (const std::exception&) {
    return invalidArg("auth", "docker config is not valid JSON");
  }
  try {
    if (!j.is_object()) return invalidArg("auth", "docker config is not a JSON object");
    auto auths = j.find("auths");
    if (auths == j.end() || auths->is_null()) return std::optional<RegistryCredentials>();
    if (!auths->is_object()) return invalidArg("auth", "docker config: \"auths\" is not an object");
    std::string want = lower(host);
    std::vector<std::string> keys;
    for (auto it = auths->begin(); it != auths->end(); ++it) keys.push_back(it.key());
    const Json* entry = nullptr;
    if (auto key = dockerConfigKeyFor(keys, host)) entry = &(*auths)[*key];
    if (!entry) return std::optional<RegistryCredentials>();
    if (!entry->is_object()) {
      return invalidArg("auth", "docker config: the auths entry for " + want + " is not an object");
    }
    auto str = [&](const char* k) -> Result<std::string> {
      auto it = entry->find(k);
      if (it == entry->end() || it->is_null()) return std::string();
      if (!it->is_string()) {
        return invalidArg(
            "auth", std::string("docker config: \"") + k + "\" for " + want + " is not a string");
      }
      return it->get<std::string>();
    };
    RegistryCredentials c;
    ASSIGN_OR_RETURN(std::string auth, str("auth"));
    if (!auth.empty()) {
      Result<std::string> dec = base64Decode(trim(auth));
      if (!dec.isOk()) {
        return invalidArg("auth", "docker config: \"auth\" for " + want + " is not valid base64");
      }
      size_t colon = dec->find(':');
      if (colon == std::string::npos) {
        return invalidArg(
            "auth", "docker config: \"auth\" for " + want + " does not decode to user:password");
      }
      c.username = dec->substr(0, colon);
      c.password = dec->substr(colon + 1);
    } else {
      ASSIGN_OR_RETURN(c.username, str("username"));
      ASSIGN_OR_RETURN(c.password, str("password"));
    }
    ASSIGN_OR_RETURN(c.identityToken, str("identitytoken"));
    if (c.username.empty() && c.password.empty() && c.identityToken.empty()) {
      return std::optional<RegistryCredentials>();
    }
    return std::optional<RegistryCredentials>(std::move(c));
  } catch (const std::exception&) {
    return invalidArg("auth", "docker config: unexpected JSON types");
  }
}

std::vector<AuthChallenge> parseWwwAuthenticate(std::string_view h) {
  std::vector<AuthChallenge> out;
  size_t i = 0, n = h.size();
  auto skipWs = [&] {
    while (i < n && (h[i] == ' ' || h[i] == '\t')) ++i;
  };
  auto skipSeps = [&] {
    while (i < n && (h[i] == ' ' || h[i] == '\t' || h[i] == ',')) ++i;
  };
  auto token = [&] {
    size_t s = i;
    while (i < n && isTchar(h[i])) ++i;
    return h.substr(s, i - s);
  };
  while (i < n) {
    skipSeps();
    if (i >= n) break;
    std::string_view scheme = token();
    if (scheme.empty()) {  // garbage: on to the next comma
      while (i < n && h[i] != ',') ++i;
      continue;
    }
    AuthChallenge c;
    c.scheme = lower(scheme);
    skipWs();
    {  // token68 ("Scheme abc==" then the end or a comma); "realm=" with no
       // value is no auth-param, so it is one too
      size_t save = i, s = i;
      while (i < n && isToken68Char(h[i])) ++i;
      size_t bodyEnd = i;
      while (i < n && h[i] == '=') ++i;
      size_t e = i;
      skipWs();
      if (bodyEnd > s && (i >= n || h[i] == ',')) {
        c.token68 = std::string(h.substr(s, e - s));
      } else {
        i = save;
      }
    }
    if (c.token68.empty()) {
      for (;;) {
        size_t save = i;
        skipSeps();
        if (i >= n) break;
        std::string_view name = token();
        skipWs();
        if (name.empty() || i >= n || h[i] != '=') {  // the next challenge, or garbage
          i = save;
          break;
        }
        ++i;
        skipWs();
        std::string value;
        if (i < n && h[i] == '"') {
          ++i;
          while (i < n && h[i] != '"') {
            if (h[i] == '\\' && i + 1 < n) ++i;
            value.push_back(h[i++]);
          }
          if (i < n) ++i;
        } else {  // a token; leniently, anything up to a comma or a space
          size_t s = i;
          while (i < n && h[i] != ',' && h[i] != ' ' && h[i] != '\t') ++i;
          value = std::string(h.substr(s, i - s));
        }
        c.params.emplace(lower(name), std::move(value));
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

// ---------------------------------------------------------------------------
// The client.

namespace {

struct HttpReply {
  long status = 0;
  std::map<std::string, std::string> headers;  // lower-case names, of the final response
  std::string body;                            // buffered (not a streamed 2xx body)
  std::string url;                             // the last URL asked
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct HttpCall {
  std::string method = "GET";  // GET, HEAD or POST
  std::string url;
  std::vector<std::string> headers;  // "Name: value", sent on every hop
  std::string authorization;         // sent only to authOrigin
  std::string authOrigin;
  std::string postBody;  // POST: application/x-www-form-urlencoded
  std::string range;     // "N-" or ""
  bool followRedirects = true;
  size_t maxBody = kErrorBodyBytes;
  bool overflowIsError = false;  // a 2xx body past maxBody: kPayloadTooLarge (else cut)
  // Takes the body of a final 200/206 answer instead of buffering it; false
  // aborts the transfer.
  std::function<bool(const HttpReply& head, const char* p, size_t n)> sink;
  const std::atomic<bool>* cancel = nullptr;
};

bool isRedirect(long s) { return s == 301 || s == 302 || s == 303 || s == 307 || s == 308; }

struct Transfer {
  const HttpCall* call;
  HttpReply* reply;
  bool tooLarge = false;
  bool sinkAborted = false;
  bool cancelled = false;
  // RegistryOptions::allowAddress, and what it refused.
  const std::function<bool(const sockaddr*)>* allow = nullptr;
  std::string refused;

  static curl_socket_t onOpenSocket(void* self, curlsocktype, curl_sockaddr* a) {
    auto* t = static_cast<Transfer*>(self);
    if (t->allow && *t->allow && !(*t->allow)(&a->addr)) {
      char host[INET6_ADDRSTRLEN] = "?";
      if (a->family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a->addr)->sin_addr, host,
                  sizeof host);
      } else if (a->family == AF_INET6) {
        inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a->addr)->sin6_addr, host,
                  sizeof host);
      }
      t->refused = host;
      return CURL_SOCKET_BAD;
    }
    return ::socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
  }

  static size_t onHeader(char* p, size_t sz, size_t n, void* self) {
    auto* t = static_cast<Transfer*>(self);
    std::string_view line = trim(std::string_view(p, sz * n));
    if (startsWith(line, "HTTP/")) {  // a new response (a redirect, 100, the final one)
      t->reply->headers.clear();
      size_t sp = line.find(' ');
      t->reply->status =
          sp == std::string_view::npos ? 0 : atol(std::string(line.substr(sp + 1)).c_str());
      return sz * n;
    }
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) return sz * n;
    std::string name = lower(trim(line.substr(0, colon)));
    std::string value(trim(line.substr(colon + 1)));
    auto [it, fresh] = t->reply->headers.emplace(name, value);
    if (!fresh) it->second += ", " + value;
    return sz * n;
  }

  static size_t onWrite(char* p, size_t sz, size_t n, void* self) {
    auto* t = static_cast<Transfer*>(self);
    size_t bytes = sz * n;
    long st = t->reply->status;
    if (isRedirect(st) && t->call->followRedirects && t->reply->headers.count("location")) {
      return bytes;  // the body of a redirect we follow
    }
    if (t->call->sink && (st == 200 || st == 206)) {
      if (!t->call->sink(*t->reply, p, bytes)) {
        t->sinkAborted = true;
        return 0;
      }
    } else {
      std::string& body = t->reply->body;
      size_t room = t->call->maxBody > body.size() ? t->call->maxBody - body.size() : 0;
      if (bytes > room && st >= 200 && st < 300 && t->call->overflowIsError) {
        t->tooLarge = true;
        return 0;
      }
      body.append(p, std::min(bytes, room));
    }
    if (t->call->cancel && t->call->cancel->load()) {
      t->cancelled = true;
      return 0;
    }
    return bytes;
  }

  static int onProgress(void* self, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    auto* t = static_cast<Transfer*>(self);
    if (t->call->cancel && t->call->cancel->load()) {
      t->cancelled = true;
      return 1;
    }
    return 0;
  }
};

// Errors retrying cannot cure.
bool permanentCurlError(CURLcode rc) {
  switch (rc) {
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_ENGINE_NOTFOUND:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_TOO_MANY_REDIRECTS:
      return true;
    default:
      return false;
  }
}

// One repository on one registry.
struct Target {
  std::string scheme;  // "https" or "http"
  std::string apiHost;
  std::string origin;
  std::string repo;
  std::string name;  // "host/repository", for messages
  std::string base() const { return scheme + "://" + apiHost + "/v2/" + repo; }
};

// What the registry asked of a repository: a bearer token from a realm, or
// basic credentials.
struct KnownAuth {
  std::string scheme;  // "bearer" or "basic"
  std::string realm;
  std::string service;
  std::string scope;  // as the challenge gave it, space-separated; "" = ours
  bool operator==(const KnownAuth&) const = default;
};

struct CachedToken {
  std::string token;
  double expires = 0;  // monoSeconds()
};

struct Manifest {
  std::string bytes;
  std::string digest;
  std::string mediaType;
  bool isIndex = false;
  Json json;
};

}  // namespace

struct RegistryClient::Impl {
  RegistryOptions opts;
  std::mutex mu;  // guards idle, auth, tokens
  std::vector<CURL*> idle;
  std::map<std::string, KnownAuth> auth;      // by origin + " " + repository
  std::map<std::string, CachedToken> tokens;  // by realm, service, scope

  explicit Impl(RegistryOptions o) : opts(std::move(o)) {
    for (std::string& h : opts.insecureHosts) h = lower(h);
    if (opts.attempts < 1) opts.attempts = 1;
  }
  ~Impl() {
    for (CURL* c : idle) curl_easy_cleanup(c);
  }

  bool insecure(const std::string& authority) const {
    return std::find(opts.insecureHosts.begin(), opts.insecureHosts.end(), lower(authority)) !=
           opts.insecureHosts.end();
  }

  Target target(const RegistryRef& ref) const {
    Target t;
    t.apiHost = lower(ref.apiHost());
    t.scheme = insecure(ref.host) || insecure(t.apiHost) ? "http" : "https";
    t.origin = originOf(t.scheme + "://" + t.apiHost + "/");
    t.repo = ref.repository;
    t.name = ref.host + "/" + ref.repository;
    return t;
  }

  bool haveUserPass() const { return opts.credentials && !opts.credentials->username.empty(); }

  // An easy handle borrowed from the pool for one call.
  struct Handle {
    Impl* s;
    CURL* c;
    explicit Handle(Impl* impl) : s(impl), c(impl->take()) {}
    ~Handle() { s->give(c); }
  };
  CURL* take() {
    {
      std::lock_guard lk(mu);
      if (!idle.empty()) {
        CURL* c = idle.back();
        idle.pop_back();
        curl_easy_reset(c);
        return c;
      }
    }
    return curl_easy_init();
  }
  void give(CURL* c) {
    if (!c) return;
    std::lock_guard lk(mu);
    if (idle.size() < 16) {
      idle.push_back(c);
    } else {
      curl_easy_cleanup(c);
    }
  }

  // One HTTP exchange, redirects followed by hand so that the Authorization
  // header goes only to its origin. Any HTTP answer is OK here; errors are
  // transport failures (*retryable says whether another try may help),
  // kPayloadTooLarge, and kUnavailable "cancelled".
  Result<HttpReply> perform(const HttpCall& call, bool* retryable) {
    *retryable = false;
    Handle h(this);
    if (!h.c) return Status(Code::kResourceExhausted, "curl_easy_init failed");
    CURL* c = h.c;
    HttpReply reply;
    Transfer t{&call, &reply};
    char err[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "dsec");
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, long(opts.connectTimeoutS * 1000));
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, std::max(1L, long(opts.stallTimeoutS)));
    if (!opts.caFile.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, opts.caFile.c_str());
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, &Transfer::onHeader);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, &Transfer::onWrite);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, &Transfer::onProgress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &t);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    t.allow = &opts.allowAddress;
    // Checked addresses must be the registry's, not a proxy's: the
    // environment's http_proxy/https_proxy/all_proxy are not used then.
    if (opts.allowAddress) curl_easy_setopt(c, CURLOPT_PROXY, "");
    curl_easy_setopt(c, CURLOPT_OPENSOCKETFUNCTION, &Transfer::onOpenSocket);
    curl_easy_setopt(c, CURLOPT_OPENSOCKETDATA, &t);
    if (!call.range.empty()) curl_easy_setopt(c, CURLOPT_RANGE, call.range.c_str());
    std::string method = call.method;
    if (method == "HEAD") {
      curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    } else if (method == "POST") {
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, long(call.postBody.size()));
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, call.postBody.c_str());
    }
    std::string url = call.url;
    for (int hop = 0;; ++hop) {
      reply = HttpReply();
      reply.url = url;
      t.refused.clear();
      curl_slist* list = nullptr;
      for (const std::string& hd : call.headers) list = curl_slist_append(list, hd.c_str());
      std::string authHeader;
      if (!call.authorization.empty() && originOf(url) == call.authOrigin) {
        authHeader = "Authorization: " + call.authorization;
        list = curl_slist_append(list, authHeader.c_str());
      }
      curl_easy_setopt(c, CURLOPT_URL, url.c_str());
      curl_easy_setopt(c, CURLOPT_HTTPHEADER, list);
      err[0] = 0;
      CURLcode rc = curl_easy_perform(c);
      curl_easy_setopt(c, CURLOPT_HTTPHEADER, nullptr);
      curl_slist_free_all(list);
      std::fill(authHeader.begin(), authHeader.end(), '\0');
      if (t.cancelled) return Status(Code::kUnavailable, "cancelled");
      if (t.tooLarge) {
        return Status(Code::kPayloadTooLarge,
                      "answer larger than " + std::to_string(call.maxBody) + " bytes", 0, "ref");
      }
      if (t.sinkAborted) return Status(Code::kUnavailable, "transfer aborted");
      if (!t.refused.empty() && rc != CURLE_OK) {
        return Status(Code::kPermissionDenied,
                      method + " " + redact(url) + ": address " + t.refused +
                          " is not one this caller may reach (loopback, private and link-local "
                          "addresses need dsec up --registry-allow)",
                      0, "ref");
      }
      if (rc != CURLE_OK) {
        *retryable = !permanentCurlError(rc);
        Code code = rc == CURLE_OPERATION_TIMEDOUT ? Code::kDeadlineExceeded : Code::kUnavailable;
        return Status(code, method + " " + redact(url) + ": " +
                                (err[0] ? std::string(err) : curl_easy_strerror(rc)));
      }
      curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &reply.status);
      if (call.followRedirects && isRedirect(reply.status)) {
        char* loc = nullptr;
        curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &loc);
        if (loc && *loc) {
          std::string next = loc;
          std::string l = lower(next.substr(0, 8));
          if (!startsWith(l, "http://") && !startsWith(l, "https://")) {
            return Status(Code::kUnavailable,
                          method + " " + redact(url) + ": redirect to a URL that is not http(s)");
          }
          if (hop >= 10) {
            return Status(Code::kUnavailable,
                          method + " " + redact(call.url) + ": more than 10 redirects");
          }
          // TLS, once asked for, is not given up on a server's say-so: only
          // a host the caller named insecure is reached over plain http.
          if (startsWith(lower(url.substr(0, 8)), "https://") && startsWith(l, "http://") &&
              !insecure(authorityOf(next))) {
            return Status(Code::kPermissionDenied,
                          method + " " + redact(url) + ": redirect from https to plain http (" +
                              redact(next) + ") refused: " + authorityOf(next) +
                              " is not an insecure registry (--insecure-registry)",
                          0, "ref");
          }
          if (method == "POST" && reply.status <= 303) {
            method = "GET";
            curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
          } else if (method == "POST" && originOf(next) != originOf(url)) {
            // 307/308 would re-send the body (a refresh token) elsewhere.
            return Status(Code::kUnavailable,
                          method + " " + redact(url) + ": redirect of a POST to another origin");
          }
          url = std::move(next);
          continue;
        }
      }
      return reply;
    }
  }

  // Runs op until its answer is not transient (a transport failure that may
  // pass, 408, 429, 5xx) or the attempts are spent.
  Result<HttpReply> retrying(const std::string& what,
                             const std::function<Result<HttpReply>(bool*)>& op,
                             const std::atomic<bool>* cancel) {
    double backoff = opts.backoffS;
    for (int attempt = 1;; ++attempt) {
      bool retryable = false;
      Result<HttpReply> r = op(&retryable);
      double wait = backoff;
      std::string why;
      if (r.isOk()) {
        long s = r->status;
        if (!(s == 408 || s == 429 || s >= 500)) return r;
        if (attempt >= opts.attempts) return r;
        std::string ra = r->header("retry-after");
        if (!ra.empty() && std::all_of(ra.begin(), ra.end(), isDigit)) {
          wait = std::max(wait, std::min(30.0, atof(ra.c_str())));
        }
        why = what + ": HTTP " + std::to_string(s);
      } else {
        if (!retryable) return r;
        if (attempt >= opts.attempts) {
          Status st = std::move(r).takeStatus();
          return Status(Code::kUnavailable,
                        st.message() + " (after " + std::to_string(attempt) + " attempts)");
        }
        why = r.status().message();
      }
      double sleepS = jitter(wait);
      // (a transport error's message names method and URL already)
      log::warn(why + "; retry " + std::to_string(attempt) + " in " +
                std::to_string(int(sleepS * 1000)) + " ms");
      sleepFor(sleepS, cancel);
      if (cancel && cancel->load()) return Status(Code::kUnavailable, "cancelled");
      backoff = std::min(backoff * 2, 5.0);
    }
  }

  // The registry's answer as an error (for anything but the success codes).
  // It names the server that answered: the registry, or the blob storage it
  // redirected to.
  Status errorFor(const HttpReply& r, const Target& t, const std::string& what) const {
    std::vector<std::string> codes;
    std::string msg = registryErrors(r.body, &codes);
    std::string detail = "HTTP " + std::to_string(r.status) + (msg.empty() ? "" : ": " + msg);
    const std::string server =
        r.url.empty() || originOf(r.url) == t.origin ? t.apiHost : authorityOf(r.url);
    if (r.status == 403 || hasCode(codes, "DENIED")) {
      return Status(Code::kPermissionDenied,
                    what + ": access denied by " + server + " (" + detail + ")", 0, "auth");
    }
    if (r.status == 401) {
      return Status(
          Code::kUnauthenticated,
          what + ": " + server + " requires credentials or refused those given (" + detail + ")", 0,
          "auth");
    }
    if (r.status == 404 || r.status == 410) {
      std::string subject = hasCode(codes, "NAME_UNKNOWN") ? "repository " + t.name : what;
      return Status(Code::kNotFound, subject + " not found (" + detail + ")", 0, "ref");
    }
    if (r.status == 408 || r.status == 429 || r.status >= 500) {
      return Status(Code::kUnavailable, what + ": " + server + " unavailable (" + detail +
                                            ", after " + std::to_string(opts.attempts) +
                                            " attempts)");
    }
    if (r.status == 400 && (hasCode(codes, "NAME_INVALID") || hasCode(codes, "TAG_INVALID") ||
                            hasCode(codes, "DIGEST_INVALID"))) {
      return invalidArg("ref", what + ": " + detail);
    }
    return Status(Code::kFailedPrecondition,
                  what + ": unexpected answer from " + server + " (" + detail + ")");
  }

  static std::string tokenKey(const KnownAuth& a, const std::string& scope) {
    return a.realm + "\n" + a.service + "\n" + scope;
  }
  static std::string scopeOf(const KnownAuth& a, const Target& t) {
    return a.scope.empty() ? "repository:" + t.repo + ":pull" : a.scope;
  }

  // A bearer token from the challenge's realm.
  Result<CachedToken> fetchToken(const KnownAuth& a, const Target& t,
                                 const std::atomic<bool>* cancel) {
    std::string realm = a.realm;
    std::string l = lower(realm.substr(0, 8));
    if (!startsWith(l, "http://") && !startsWith(l, "https://")) {
      return Status(Code::kUnauthenticated,
                    t.name + ": the registry's token realm is not an http(s) URL", 0, "auth");
    }
    std::string scope = scopeOf(a, t);
    // Credentials only over https, or plain http to a host the caller named
    // insecure (any port of it: a registry's token service often listens
    // beside it, as Harbor's and the CNCF distribution's setups do).
    auto hostOnly = [](const std::string& authority) {
      if (!authority.empty() && authority[0] == '[') return authority.substr(0, authority.find(']') + 1);
      return authority.substr(0, authority.find(':'));
    };
    const std::string realmAuthority = authorityOf(realm);
    bool credsOk = startsWith(l, "https://") || insecure(realmAuthority) ||
                   (insecure(t.apiHost) && hostOnly(realmAuthority) == hostOnly(lower(t.apiHost)));
    const RegistryCredentials* cr = opts.credentials ? &*opts.credentials : nullptr;
    if (cr && !credsOk) {
      log::warn(t.name + ": token realm " + redact(realm) +
                " is plain http; asking for an anonymous token");
      cr = nullptr;
    }
    std::vector<std::string> scopes;
    for (const std::string& s : splitString(scope, ' ')) {
      if (!s.empty()) scopes.push_back(s);
    }
    auto tokenOp = [&](HttpCall call) {
      return retrying(
          call.method + " " + redact(call.url),
          [&](bool* retryable) { return perform(call, retryable); }, cancel);
    };
    Result<HttpReply> r = Status(Code::kInternal, "no token request");
    bool done = false;
    if (cr && !cr->identityToken.empty()) {
      HttpCall call;
      call.method = "POST";
      call.url = realm;
      call.headers = {"Content-Type: application/x-www-form-urlencoded"};
      call.postBody = "grant_type=refresh_token&refresh_token=" + formEncode(cr->identityToken) +
                      "&service=" + formEncode(a.service) + "&client_id=dsec";
      for (const std::string& s : scopes) call.postBody += "&scope=" + formEncode(s);
      call.cancel = cancel;
      r = tokenOp(call);
      std::fill(call.postBody.begin(), call.postBody.end(), '\0');
      // Registries without the OAuth2 POST fall back to basic below, if
      // there is a password.
      done = !(r.isOk() && (r->status == 404 || r->status == 405) && !cr->username.empty());
    }
    if (!done) {
      HttpCall call;
      call.url = realm + (realm.find('?') == std::string::npos ? "?" : "&") +
                 "service=" + formEncode(a.service);
      for (const std::string& s : scopes) call.url += "&scope=" + formEncode(s);
      if (cr && !cr->username.empty()) {
        call.url += "&account=" + formEncode(cr->username);
        call.authorization = "Basic " + base64Encode(cr->username + ":" + cr->password);
        call.authOrigin = originOf(realm);
      }
      call.cancel = cancel;
      r = tokenOp(call);
      std::fill(call.authorization.begin(), call.authorization.end(), '\0');
    }
    if (!r.isOk()) return std::move(r).takeStatus();
    const HttpReply& rep = *r;
    std::string what = "token for " + t.name + " from " + redact(realm);
    if (rep.status == 401) {
      std::string msg = registryErrors(rep.body, nullptr);
      return Status(Code::kUnauthenticated,
                    what + ": " + (cr ? "credentials refused" : "credentials required") +
                        " (HTTP 401" + (msg.empty() ? "" : ": " + msg) + ")",
                    0, "auth");
    }
    if (rep.status != 200) {
      // The token service's answer, not the registry's: named as such, and
      // never "not found" (that would blame the reference).
      std::string msg = registryErrors(rep.body, nullptr);
      std::string server = "token service " + authorityOf(rep.url.empty() ? realm : rep.url);
      std::string detail = "HTTP " + std::to_string(rep.status) + (msg.empty() ? "" : ": " + msg);
      if (rep.status == 403) {
        return Status(Code::kPermissionDenied,
                      what + ": access denied by " + server + " (" + detail + ")", 0, "auth");
      }
      if (rep.status == 408 || rep.status == 429 || rep.status >= 500) {
        return Status(Code::kUnavailable, what + ": " + server + " unavailable (" + detail +
                                              ", after " + std::to_string(opts.attempts) +
                                              " attempts)");
      }
      return Status(Code::kUnauthenticated,
                    what + ": no token from " + server + " (" + detail + ")", 0, "auth");
    }
    Json j = Json::parse(rep.body, nullptr, false);
    CachedToken out;
    double expiresIn = 60;
    if (j.is_object()) {
      for (const char* k : {"token", "access_token"}) {
        if (out.token.empty() && j.contains(k) && j[k].is_string())
          out.token = j[k].get<std::string>();
      }
      if (j.contains("expires_in") && j["expires_in"].is_number() &&
          j["expires_in"].get<double>() > 0) {
        expiresIn = j["expires_in"].get<double>();
      }
    }
    if (out.token.empty()) {
      return Status(Code::kUnauthenticated, what + ": the answer holds no token", 0, "auth");
    }
    // Renew a little early, so a token does not expire between the check
    // and its use.
    out.expires = monoSeconds() + expiresIn - std::min(30.0, expiresIn * 0.1);
    return out;
  }

  // The Authorization value for a repository: what its last challenge asked
  // for, "" if none is known yet. fresh: a new token, not the cached one.
  // *fetched: whether the token came from the token server in this call.
  Result<std::string> authorization(const Target& t, bool fresh, bool* fetched,
                                    const std::atomic<bool>* cancel) {
    *fetched = false;
    KnownAuth a;
    std::string key;
    {
      std::lock_guard lk(mu);
      auto it = auth.find(t.origin + " " + t.repo);
      if (it == auth.end()) return std::string();
      a = it->second;
      if (a.scheme == "basic") {
        if (!haveUserPass()) return std::string();
        return "Basic " +
               base64Encode(opts.credentials->username + ":" + opts.credentials->password);
      }
      key = tokenKey(a, scopeOf(a, t));
      auto tk = tokens.find(key);
      if (tk != tokens.end()) {
        if (!fresh && tk->second.expires > monoSeconds()) return "Bearer " + tk->second.token;
        tokens.erase(tk);
      }
    }
    ASSIGN_OR_RETURN(CachedToken tok, fetchToken(a, t, cancel));
    *fetched = true;
    std::string value = "Bearer " + tok.token;
    {
      std::lock_guard lk(mu);
      tokens[key] = std::move(tok);
    }
    return value;
  }

  // One exchange with the registry, answering its 401 challenges: with the
  // credentials or a token it asks for, and once more with a fresh token if a
  // cached one was refused. A 401 that remains is returned as an answer.
  Result<HttpReply> authed(const Target& t, HttpCall call, bool* retryable) {
    bool fetched = false;
    std::string authz;
    { ASSIGN_OR_RETURN(authz, authorization(t, false, &fetched, call.cancel)); }
    for (int round = 0;; ++round) {
      call.authorization = authz;
      call.authOrigin = t.origin;
      ASSIGN_OR_RETURN(HttpReply r, perform(call, retryable));
      if (r.status != 401 || round >= 2) return r;
      // Only the registry's own challenge is answered: a 401 from where it
      // redirected to (storage) must not steer credentials to its realm.
      if (originOf(r.url) != t.origin) return r;
      std::vector<AuthChallenge> chs = parseWwwAuthenticate(r.header("www-authenticate"));
      const AuthChallenge* pick = nullptr;
      for (const char* want : {"bearer", "basic"}) {
        for (const AuthChallenge& ch : chs) {
          if (!pick && ch.scheme == want) pick = &ch;
        }
      }
      if (!pick) return r;
      KnownAuth k;
      k.scheme = pick->scheme;
      if (k.scheme == "bearer") {
        auto get = [&](const char* n) {
          auto it = pick->params.find(n);
          return it == pick->params.end() ? std::string() : it->second;
        };
        k.realm = get("realm");
        k.service = get("service");
        k.scope = get("scope");
        if (k.realm.empty()) return r;
      } else if (!haveUserPass()) {
        return r;
      }
      bool changed;
      {
        std::lock_guard lk(mu);
        KnownAuth& cur = auth[t.origin + " " + t.repo];
        changed = !(cur == k);
        cur = k;
      }
      // Credentials just fetched or sent as they are, and refused for the
      // same challenge: final.
      if (!authz.empty() && (fetched || k.scheme == "basic") && !changed) return r;
      { ASSIGN_OR_RETURN(authz, authorization(t, true, &fetched, call.cancel)); }
      if (authz.empty()) return r;
    }
  }

  Result<HttpReply> request(const Target& t, const HttpCall& call) {
    return retrying(
        call.method + " " + redact(call.url),
        [&](bool* retryable) { return authed(t, call, retryable); }, call.cancel);
  }

  // declaredSize: what the index pointing here says (-1: unknown); no more
  // is read.
  Result<Manifest> getManifest(const Target& t, const RegistryRef& ref,
                               const std::string& reference, int64_t declaredSize = -1) {
    bool byDigest = startsWith(reference, "sha256:");
    std::string what =
        (byDigest ? "manifest " + reference : "tag \"" + reference + "\"") + " of " + t.name;
    HttpCall call;
    call.url = t.base() + "/manifests/" + reference;
    call.headers = {"Accept: " + std::string(kOciIndex) + ", " + std::string(kDockerList) + ", " +
                    std::string(kOciManifest) + ", " + std::string(kDockerManifest)};
    const bool capIsDeclared = declaredSize >= 0 && declaredSize < opts.maxManifestBytes;
    call.maxBody =
        size_t(std::max<int64_t>(capIsDeclared ? declaredSize : opts.maxManifestBytes, 0));
    call.overflowIsError = true;
    Result<HttpReply> rr = request(t, call);
    if (!rr.isOk()) {
      Status st = std::move(rr).takeStatus();
      if (st.code() == Code::kPayloadTooLarge && capIsDeclared) {
        return Status(
            Code::kDataLoss,
            what + ": more than the " + std::to_string(declaredSize) + " bytes the index declares",
            0, "ref");
      }
      if (st.code() == Code::kPayloadTooLarge) {
        return Status(
            Code::kPayloadTooLarge,
            what + ": manifest larger than " + std::to_string(opts.maxManifestBytes) + " bytes", 0,
            "ref");
      }
      return st.withContext(what);
    }
    HttpReply& r = *rr;
    if (r.status != 200) return errorFor(r, t, what);
    Manifest m;
    m.bytes = std::move(r.body);
    m.digest = "sha256:" + sha256Hex(m.bytes);
    std::string dcd = lower(trim(r.header("docker-content-digest")));
    if (startsWith(dcd, "sha256:") && dcd != m.digest) {
      return Status(Code::kDataLoss,
                    what + ": the manifest's sha256 is " + m.digest +
                        ", the registry's Docker-Content-Digest " + dcd,
                    0, "ref");
    }
    if (byDigest && reference != m.digest) {
      return Status(Code::kDataLoss, what + ": the manifest's bytes have sha256 " + m.digest, 0,
                    "ref");
    }
    m.json = Json::parse(m.bytes, nullptr, false);
    if (!m.json.is_object()) return invalidArg("ref", what + ": the manifest is not a JSON object");
    std::string contentType =
        lower(trim(r.header("content-type").substr(0, r.header("content-type").find(';'))));
    if (m.json.contains("mediaType") && m.json["mediaType"].is_string()) {
      m.mediaType = m.json["mediaType"].get<std::string>();
    } else {
      m.mediaType = contentType;
    }
    int schemaVersion = m.json.contains("schemaVersion") && m.json["schemaVersion"].is_number()
                            ? m.json["schemaVersion"].get<int>()
                            : 0;
    if (m.mediaType == kDockerSchema1 || m.mediaType == kDockerSchema1Signed ||
        contentType == kDockerSchema1 || contentType == kDockerSchema1Signed ||
        schemaVersion == 1) {
      return invalidArg("ref", ref.str() +
                                   " is a Docker image manifest schema 1, which is "
                                   "deprecated and not supported: push the image again "
                                   "with a current Docker, buildah or skopeo");
    }
    if (m.mediaType == kOciIndex || m.mediaType == kDockerList) {
      m.isIndex = true;
    } else if (m.mediaType == kOciManifest || m.mediaType == kDockerManifest) {
      m.isIndex = false;
    } else if (m.mediaType.empty() || m.mediaType == "application/json" ||
               m.mediaType == "text/plain" || m.mediaType == "application/octet-stream") {
      // Early OCI manifests carry no mediaType: judge by their shape.
      if (m.json.contains("manifests") && m.json["manifests"].is_array()) {
        m.isIndex = true;
        m.mediaType = std::string(kOciIndex);
      } else if (m.json.contains("config") && m.json.contains("layers")) {
        m.mediaType = std::string(kOciManifest);
      } else {
        return invalidArg("ref", what + ": not an image manifest or index");
      }
    } else {
      return invalidArg("ref", what + ": manifest media type \"" + m.mediaType +
                                   "\" is not an image manifest or index");
    }
    if (schemaVersion != 2) {
      return invalidArg("ref",
                        what + ": schemaVersion " + std::to_string(schemaVersion) + ", expected 2");
    }
    return m;
  }
};

namespace {

struct Descriptor {
  std::string mediaType;
  std::string digest;
  int64_t size = -1;
  bool hasUrls = false;
};

Result<Descriptor> descriptorOf(const Json& j, const std::string& what) {
  if (!j.is_object()) return invalidArg("ref", what + " is not a JSON object");
  Descriptor d;
  if (j.contains("mediaType") && j["mediaType"].is_string()) {
    d.mediaType = j["mediaType"].get<std::string>();
  }
  if (!j.contains("digest") || !j["digest"].is_string() ||
      !validDigest(j["digest"].get<std::string>())) {
    return invalidArg("ref", what + " has no sha256:<64 hex> digest");
  }
  d.digest = j["digest"].get<std::string>();
  if (j.contains("size")) {
    if (!j["size"].is_number_integer() || j["size"].get<int64_t>() < 0) {
      return invalidArg("ref", what + " has a size that is not a non-negative integer");
    }
    d.size = j["size"].get<int64_t>();
  }
  d.hasUrls = j.contains("urls") && j["urls"].is_array() && !j["urls"].empty();
  return d;
}

Result<LayerCompression> layerCompression(const std::string& mt) {
  if (mt == "application/vnd.oci.image.layer.v1.tar" ||
      mt == "application/vnd.docker.image.rootfs.diff.tar") {
    return LayerCompression::kNone;
  }
  if (mt == "application/vnd.oci.image.layer.v1.tar+gzip" ||
      mt == "application/vnd.docker.image.rootfs.diff.tar.gzip") {
    return LayerCompression::kGzip;
  }
  if (mt == "application/vnd.oci.image.layer.v1.tar+zstd") return LayerCompression::kZstd;
  return invalidArg("ref", "layer media type \"" + mt + "\" is not understood");
}

}  // namespace

RegistryClient::RegistryClient(RegistryOptions opts)
    : impl_(std::make_unique<Impl>(std::move(opts))) {
  std::call_once(curlInit, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

RegistryClient::~RegistryClient() = default;

Result<ResolvedImage> RegistryClient::resolve(const RegistryRef& ref,
                                              const ImagePlatform& platform) {
  if (ref.repository.empty() || ref.host.empty()) return invalidArg("ref", "empty reference");
  if (!ref.digest.empty() && !validDigest(ref.digest)) {
    return invalidArg("ref", "digest must be sha256:<64 lower-case hex digits>");
  }
  std::string reference = ref.digest.empty() ? ref.tag : ref.digest;
  if (reference.empty()) return invalidArg("ref", ref.str() + " has neither tag nor digest");
  try {
    Impl& im = *impl_;
    Target t = im.target(ref);
    ResolvedImage out;
    out.ref = ref;
    ASSIGN_OR_RETURN(Manifest m, im.getManifest(t, ref, reference));
    if (m.isIndex) {
      ImagePlatform want = platform;
      normalisePlatform(want);
      out.indexDigest = m.digest;
      if (!m.json.contains("manifests") || !m.json["manifests"].is_array()) {
        return invalidArg("ref", ref.str() + ": the index has no \"manifests\" list");
      }
      std::vector<std::string> available;
      std::optional<Descriptor> chosen;
      for (const Json& e : m.json["manifests"]) {
        if (!e.is_object() || !e.contains("platform") || !e["platform"].is_object()) continue;
        const Json& p = e["platform"];
        auto field = [&](const char* k) {
          return p.contains(k) && p[k].is_string() ? p[k].get<std::string>() : std::string();
        };
        ImagePlatform have{field("os"), field("architecture"), field("variant")};
        normalisePlatform(have);
        if (have.os == "unknown" || have.os.empty()) continue;  // attestations and the like
        available.push_back(have.str());
        if (!chosen && platformMatches(want, have)) {
          ASSIGN_OR_RETURN(Descriptor d,
                           descriptorOf(e, ref.str() + ": index entry " + have.str()));
          chosen = d;
          out.platform = have.str();
        }
      }
      if (!chosen) {
        std::string list;
        for (const std::string& a : available) list += (list.empty() ? "" : ", ") + a;
        return Status(Code::kNotFound,
                      ref.str() + " has no manifest for platform " + want.str() +
                          "; it has: " + (list.empty() ? "none" : list),
                      0, "platform");
      }
      ASSIGN_OR_RETURN(Manifest child, im.getManifest(t, ref, chosen->digest, chosen->size));
      if (child.digest != chosen->digest) {
        return Status(Code::kDataLoss,
                      ref.str() + ": manifest " + chosen->digest + " has sha256 " + child.digest, 0,
                      "ref");
      }
      if (chosen->size >= 0 && int64_t(child.bytes.size()) != chosen->size) {
        return Status(Code::kDataLoss,
                      ref.str() + ": manifest " + chosen->digest + " is " +
                          std::to_string(child.bytes.size()) + " bytes, the index says " +
                          std::to_string(chosen->size),
                      0, "ref");
      }
      if (child.isIndex) {
        return invalidArg("ref", ref.str() + ": the index entry for " + out.platform +
                                     " is itself an index, which is not supported");
      }
      m = std::move(child);
    }
    out.manifestDigest = m.digest;
    out.manifestMediaType = m.mediaType;

    const Json& mj = m.json;
    if (!mj.contains("config"))
      return invalidArg("ref", ref.str() + ": the manifest has no config");
    ASSIGN_OR_RETURN(Descriptor cfg, descriptorOf(mj["config"], ref.str() + ": the config"));
    if (!cfg.mediaType.empty() && cfg.mediaType != kOciConfig && cfg.mediaType != kDockerConfig) {
      return invalidArg("ref", ref.str() + " is not a container image (config media type \"" +
                                   cfg.mediaType + "\")");
    }
    if (mj.contains("layers") && !mj["layers"].is_null()) {
      if (!mj["layers"].is_array()) {
        return invalidArg("ref", ref.str() + ": the manifest's \"layers\" is not a list");
      }
      size_t i = 0;
      for (const Json& lj : mj["layers"]) {
        std::string what = ref.str() + ": layer " + std::to_string(i++);
        ASSIGN_OR_RETURN(Descriptor d, descriptorOf(lj, what));
        if (d.mediaType.find("nondistributable") != std::string::npos ||
            d.mediaType.find("foreign") != std::string::npos || d.hasUrls) {
          return invalidArg("ref", what + " (" + d.digest +
                                       ") is a foreign or non-distributable layer, to be fetched "
                                       "from elsewhere than the registry: not supported");
        }
        Result<LayerCompression> comp = layerCompression(d.mediaType);
        if (!comp.isOk()) {
          return invalidArg("ref", what + ": media type \"" + d.mediaType +
                                       "\" is not an image layer this can unpack");
        }
        if (d.size < 0) return invalidArg("ref", what + " has no size");
        out.layers.push_back(RegistryLayer{d.digest, d.size, d.mediaType, *comp});
      }
    }

    // The config blob.
    out.configDigest = cfg.digest;
    std::string what = "config " + cfg.digest + " of " + t.name;
    if (cfg.size > im.opts.maxConfigBytes) {
      return Status(Code::kPayloadTooLarge,
                    what + ": " + std::to_string(cfg.size) + " bytes, over the cap of " +
                        std::to_string(im.opts.maxConfigBytes),
                    0, "ref");
    }
    HttpCall call;
    call.url = t.base() + "/blobs/" + cfg.digest;
    // No further than the manifest says it goes.
    call.maxBody = size_t(std::max<int64_t>(cfg.size >= 0 ? cfg.size : im.opts.maxConfigBytes, 0));
    call.overflowIsError = true;
    Result<HttpReply> cr = im.request(t, call);
    if (!cr.isOk()) {
      Status st = std::move(cr).takeStatus();
      if (st.code() == Code::kPayloadTooLarge && cfg.size >= 0) {
        return Status(
            Code::kDataLoss,
            what + ": more than the " + std::to_string(cfg.size) + " bytes the manifest declares",
            0, "ref");
      }
      if (st.code() == Code::kPayloadTooLarge) {
        return Status(Code::kPayloadTooLarge,
                      what + ": larger than " + std::to_string(im.opts.maxConfigBytes) + " bytes",
                      0, "ref");
      }
      return st.withContext(what);
    }
    if (cr->status != 200) return im.errorFor(*cr, t, what);
    std::string got = "sha256:" + sha256Hex(cr->body);
    if (got != cfg.digest) {
      return Status(Code::kDataLoss, what + ": the bytes have sha256 " + got, 0, "ref");
    }
    if (cfg.size >= 0 && int64_t(cr->body.size()) != cfg.size) {
      return Status(Code::kDataLoss,
                    what + ": " + std::to_string(cr->body.size()) + " bytes, the manifest says " +
                        std::to_string(cfg.size),
                    0, "ref");
    }
    out.config = std::move(cr->body);
    if (out.platform.empty()) {
      Json cj = Json::parse(out.config, nullptr, false);
      if (cj.is_object() && cj.contains("os") && cj["os"].is_string() &&
          cj.contains("architecture") && cj["architecture"].is_string()) {
        ImagePlatform p{cj["os"].get<std::string>(), cj["architecture"].get<std::string>(),
                        cj.contains("variant") && cj["variant"].is_string()
                            ? cj["variant"].get<std::string>()
                            : std::string()};
        normalisePlatform(p);
        out.platform = p.str();
      }
    }
    out.manifest = std::move(m.bytes);
    return out;
  } catch (const std::exception& e) {
    // nlohmann on a JSON value of an unexpected type.
    return invalidArg("ref", ref.str() + ": malformed manifest or index (" + e.what() + ")");
  }
}

Status RegistryClient::checkBlob(const RegistryRef& ref, const std::string& digest) {
  if (!validDigest(digest)) {
    return invalidArg("ref", "blob digest must be sha256:<64 lower-case hex digits>");
  }
  Target t = impl_->target(ref);
  std::string what = "blob " + digest + " of " + t.name;
  HttpCall call;
  call.method = "HEAD";
  call.url = t.base() + "/blobs/" + digest;
  // Redirects are followed as a blob GET's are: a 3xx alone says nothing
  // (it may lead to storage without the blob, or to a login page).
  Result<HttpReply> r = impl_->request(t, call);
  if (!r.isOk()) return std::move(r).takeStatus().withContext(what);
  if (r->status >= 200 && r->status < 300) return Status::ok();
  const long s = r->status;
  if (originOf(r->url) == t.origin || s < 400 || s >= 500 || s == 404 || s == 410) {
    return impl_->errorFor(*r, t, what);
  }
  // Storage the registry redirected to refused HEAD (a URL presigned for
  // GET only): read the blob's first byte instead.
  HttpCall get;
  get.url = call.url;
  get.range = "0-0";
  bool there = false;
  get.sink = [&](const HttpReply&, const char*, size_t) {
    there = true;
    return false;  // one chunk is proof enough
  };
  Result<HttpReply> g = impl_->request(t, get);
  if (there) return Status::ok();
  if (!g.isOk()) return std::move(g).takeStatus().withContext(what);
  if (g->status == 200 || g->status == 206) return Status::ok();  // an empty blob
  return impl_->errorFor(*g, t, what);
}

Status RegistryClient::fetchBlob(const RegistryRef& ref, const RegistryLayer& layer,
                                 const std::string& spoolPath,
                                 const std::function<void(int64_t)>& progress,
                                 const std::atomic<bool>* cancel) {
  if (!validDigest(layer.digest)) {
    return invalidArg("ref", "blob digest must be sha256:<64 lower-case hex digits>");
  }
  if (layer.size < 0) return invalidArg("ref", "blob " + layer.digest + ": negative size");
  Impl& im = *impl_;
  Target t = im.target(ref);
  std::string what = "blob " + layer.digest + " of " + t.name;
  auto cancelled = [&] { return cancel && cancel->load(); };
  auto cancelledStatus = [&] { return Status(Code::kUnavailable, what + ": cancelled"); };
  UniqueFd fd(::open(spoolPath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd) return sysError("open " + spoolPath);
  struct stat sb;
  if (::fstat(fd.get(), &sb) != 0) return sysError("stat " + spoolPath);
  int64_t off = sb.st_size;
  auto hash = std::make_unique<Sha256>();
  auto restart = [&]() -> Status {
    if (::ftruncate(fd.get(), 0) != 0) return sysError("truncate " + spoolPath);
    off = 0;
    hash = std::make_unique<Sha256>();
    return Status::ok();
  };
  auto dataLoss = [&](const std::string& msg) {
    ::unlink(spoolPath.c_str());
    return Status(Code::kDataLoss, what + ": " + msg);
  };
  if (off > layer.size) {
    RETURN_IF_ERROR(restart());
  } else if (off > 0) {  // hash what an earlier call left, to resume after it
    std::string buf(1 << 20, '\0');
    for (int64_t pos = 0; pos < off;) {
      ssize_t n = ::pread(fd.get(), buf.data(),
                          size_t(std::min<int64_t>(off - pos, int64_t(buf.size()))), pos);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sysError("read " + spoolPath);
      if (n == 0) {
        off = pos;  // shrank under us
        if (::ftruncate(fd.get(), off) != 0) return sysError("truncate " + spoolPath);
        break;
      }
      hash->update(buf.data(), size_t(n));
      pos += n;
    }
    if (progress) progress(off);
  }

  int failures = 0;
  double backoff = im.opts.backoffS;
  while (off < layer.size) {
    if (cancelled()) return cancelledStatus();
    int64_t startOff = off;
    bool first = true, restartAsked = false, tooLong = false;
    Status writeErr;
    HttpCall call;
    call.url = t.base() + "/blobs/" + layer.digest;
    if (off > 0) call.range = std::to_string(off) + "-";
    call.cancel = cancel;
    call.sink = [&](const HttpReply& head, const char* p, size_t n) -> bool {
      if (first) {
        first = false;
        if (head.status == 200 && off > 0) {
          // The server ignored Range: it sends the whole blob.
          writeErr = restart();
          if (!writeErr.isOk()) return false;
        } else if (head.status == 206) {
          long long a = -1;
          std::string cr = head.header("content-range");
          if (sscanf(cr.c_str(), "bytes %lld-", &a) != 1 || a != off) {
            restartAsked = true;
            return false;
          }
        }
      }
      // Never past the declared size: a registry must not fill the disk
      // before the digest can be checked.
      if (off + int64_t(n) > layer.size) {
        tooLong = true;
        return false;
      }
      for (size_t done = 0; done < n;) {
        ssize_t w = ::pwrite(fd.get(), p + done, n - done, off + int64_t(done));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
          writeErr = sysError("write " + spoolPath);
          return false;
        }
        done += size_t(w);
      }
      hash->update(p, n);
      off += int64_t(n);
      if (progress) progress(off);
      return true;
    };
    bool retryable = false;
    Result<HttpReply> r = im.authed(t, call, &retryable);
    if (!writeErr.isOk()) return writeErr;
    if (tooLong) {
      return dataLoss("the registry sent more bytes than the " + std::to_string(layer.size) +
                      " the manifest declares; transfer cut");
    }
    if (cancelled()) return cancelledStatus();
    std::string why;
    if (restartAsked) {
      RETURN_IF_ERROR(restart());
      why = "GET " + redact(call.url) + ": answer for another range than asked; starting over";
    } else if (!r.isOk()) {
      if (!retryable) return std::move(r).takeStatus().withContext(what);
      why = r.status().message();
    } else if (r->status == 200 || r->status == 206) {
      if (off == layer.size) break;
      // The answer ended cleanly, short: the blob is shorter than the manifest
      // says, unless it was a 206, which may hold a part only, and whose total
      // is as long or unknown ("bytes a-b/*").
      long long total = -1;
      std::string cr = r->header("content-range");
      size_t slash = cr.rfind('/');
      if (slash != std::string::npos && slash + 1 < cr.size() && isDigit(cr[slash + 1])) {
        total = atoll(cr.c_str() + slash + 1);
      }
      if (r->status == 200 || (total >= 0 && total != layer.size)) {
        return dataLoss("the registry has " + std::to_string(r->status == 200 ? off : total) +
                        " bytes, the manifest says " + std::to_string(layer.size));
      }
      // A part that brought bytes: ask for the rest at once.
      if (off > startOff) {
        failures = 0;
        backoff = im.opts.backoffS;
        continue;
      }
      why = "GET " + redact(call.url) + ": short read";
    } else if (r->status == 416) {
      RETURN_IF_ERROR(restart());
      why = "GET " + redact(call.url) + ": HTTP 416 for the range asked; starting over";
    } else if (r->status == 408 || r->status == 429 || r->status >= 500) {
      why = "GET " + redact(call.url) + ": HTTP " + std::to_string(r->status);
    } else {
      return im.errorFor(*r, t, what);
    }
    // Transient: retry from what the spool holds. An attempt that added bytes
    // does not count against the limit.
    if (off > startOff) {
      failures = 0;
      backoff = im.opts.backoffS;
    }
    if (++failures >= im.opts.attempts) {
      return Status(Code::kUnavailable, what + ": " + why + " (" + std::to_string(failures) +
                                            " attempts without progress)");
    }
    double sleepS = jitter(backoff);
    log::warn(why + " (at byte " + std::to_string(off) + " of " + std::to_string(layer.size) +
              "); retry in " + std::to_string(int(sleepS * 1000)) + " ms");
    sleepFor(sleepS, cancel);
    backoff = std::min(backoff * 2, 5.0);
  }
  std::string got = "sha256:" + hash->hexDigest();
  if (got != layer.digest) return dataLoss("the bytes have sha256 " + got);
  if (::fsync(fd.get()) != 0) return sysError("fsync " + spoolPath);
  return Status::ok();
}

}  // namespace dsec::image
