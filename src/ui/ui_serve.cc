// Serving the web console (ui_assets.h). The bytes are in the generated table
// (ui_assets.cc in the build dir, written by ui/build.mjs); this is the HTTP
// side: routing under /ui, caching headers, conditional requests, gzip.
#include "ui/ui_assets.h"

#include <string>

#include "common/http_server.h"
#include "common/util.h"

namespace dsec::ui {

namespace {

std::string& uiDir() {
  static std::string dir;
  return dir;
}

// Whether Accept-Encoding admits gzip: "gzip" or "*" listed without q=0.
bool acceptsGzip(std::string_view header) {
  bool gzip = false, star = false, gzipSaid = false;
  while (!header.empty()) {
    size_t comma = header.find(',');
    std::string_view item = header.substr(0, comma);
    header = comma == std::string_view::npos ? std::string_view() : header.substr(comma + 1);
    size_t semi = item.find(';');
    std::string_view coding = trimOws(item.substr(0, semi));
    bool zero = false;
    if (semi != std::string_view::npos) {
      std::string_view params = trimOws(item.substr(semi + 1));
      if (params.size() >= 2 && (params[0] == 'q' || params[0] == 'Q') && params[1] == '=') {
        std::string_view q = trimOws(params.substr(2));
        zero = !q.empty() && q.find_first_not_of("0.") == std::string_view::npos;
      }
    }
    if (asciiIEquals(coding, "gzip") || asciiIEquals(coding, "x-gzip")) {
      gzipSaid = true;
      gzip = !zero;
    } else if (coding == "*") {
      star = !zero;
    }
  }
  return gzipSaid ? gzip : star;
}

// Whether If-None-Match names `etag` (weak comparison) or is "*".
bool matchesEtag(std::string_view header, std::string_view etag) {
  while (!header.empty()) {
    size_t comma = header.find(',');
    std::string_view tag = trimOws(header.substr(0, comma));
    header = comma == std::string_view::npos ? std::string_view() : header.substr(comma + 1);
    if (tag == "*") return true;
    if (tag.size() > 2 && tag.substr(0, 2) == "W/") tag.remove_prefix(2);
    if (tag == etag) return true;
  }
  return false;
}

std::string gzipEtag(std::string_view etag) {
  if (etag.size() < 2) return std::string(etag);
  return std::string(etag.substr(0, etag.size() - 1)) + "-gz\"";
}

void commonHeaders(http::Response& res) {
  res.setHeader("Content-Security-Policy", std::string(kContentSecurityPolicy));
  res.setHeader("X-Content-Type-Options", "nosniff");
  res.setHeader("Referrer-Policy", "no-referrer");
  res.setHeader("X-Frame-Options", "DENY");
}

void sendAsset(const Asset& a, http::Request& req, http::Response& res) {
  commonHeaders(res);
  res.setHeader("Cache-Control", a.immutable ? "public, max-age=31536000, immutable" : "no-cache");
  bool gz = !a.gzip.empty() && acceptsGzip(req.header("accept-encoding"));
  if (!a.gzip.empty()) res.setHeader("Vary", "Accept-Encoding");
  std::string etag = gz ? gzipEtag(a.etag) : std::string(a.etag);
  if (!etag.empty()) res.setHeader("ETag", etag);
  std::string inm = req.header("if-none-match");
  if (!inm.empty() && !a.etag.empty() &&
      (matchesEtag(inm, a.etag) || (!a.gzip.empty() && matchesEtag(inm, gzipEtag(a.etag))))) {
    (void)res.send(304, a.contentType, "");
    return;
  }
  if (gz) res.setHeader("Content-Encoding", "gzip");
  (void)res.send(200, a.contentType, gz ? a.gzip : a.data);
}

std::string_view typeOf(std::string_view name) {
  auto ends = [&](std::string_view ext) {
    return name.size() >= ext.size() && name.substr(name.size() - ext.size()) == ext;
  };
  if (ends(".html")) return "text/html; charset=utf-8";
  if (ends(".js")) return "text/javascript; charset=utf-8";
  if (ends(".css")) return "text/css; charset=utf-8";
  if (ends(".json") || ends(".map")) return "application/json";
  if (ends(".svg")) return "image/svg+xml";
  if (ends(".png")) return "image/png";
  if (ends(".ico")) return "image/x-icon";
  return "application/octet-stream";
}

void notFound(http::Response& res, std::string_view name) {
  commonHeaders(res);
  res.setHeader("Cache-Control", "no-cache");
  (void)res.send(404, "text/plain; charset=utf-8",
                 "no such console file: " + std::string(name) + "\n");
}

// A file name the console may ask for: flat, no dot files, no "..".
bool plainName(std::string_view n) {
  if (n.empty() || n[0] == '.') return false;
  for (char c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') {
      return false;
    }
  }
  return true;
}

// --ui-dir: files read on each request, never cached by the browser.
void serveFromDir(const std::string& dir, std::string name, http::Response& res) {
  bool index = name.empty() || name.find('.') == std::string::npos;
  if (index) name = "index.html";
  if (!plainName(name)) return notFound(res, name);
  auto data = readFile(dir + "/" + name);
  if (!data.isOk()) {
    if (!index) return notFound(res, name);
    commonHeaders(res);
    (void)res.send(503, "text/plain; charset=utf-8",
                   "--ui-dir " + dir + ": no index.html yet (run node ui/build.mjs --out " + dir +
                       ")\n");
    return;
  }
  commonHeaders(res);
  res.setHeader("Cache-Control", "no-cache");
  (void)res.send(200, typeOf(name), *data);
}

void sendNotBuilt(const Bundle& b, http::Response& res) {
  // Plain text: nothing in it is markup, whatever the reason says.
  commonHeaders(res);
  res.setHeader("Cache-Control", "no-cache");
  (void)res.send(200, "text/plain; charset=utf-8",
                 "dsec: console not built (" + std::string(b.notBuilt) +
                     ").\nRebuild with node and npm installed and -DDSEC_UI=ON (docs/console.md).\n"
                     "The REST API is at /v1 (docs/rest-api.md).\n");
}

bool serve(const Bundle* b, http::Request& req, http::Response& res) {
  const std::string& p = req.path;
  bool root = p == "/";
  if (!root && p != "/ui" && !startsWith(p, "/ui/")) return false;
  if (req.method != "GET" && req.method != "HEAD") {
    if (root) return false;  // the API's own 404/405 for anything else on "/"
    commonHeaders(res);
    res.setHeader("Allow", "GET, HEAD");
    (void)res.send(405, "application/json",
                   R"({"error":{"code":"invalid_argument","message":"the console's files take GET and HEAD only"}})");
    return true;
  }
  if (root || p == "/ui") {
    res.setHeader("Location", "/ui/");
    res.setHeader("Cache-Control", "no-cache");
    (void)res.send(302, "text/plain; charset=utf-8", "/ui/\n");
    return true;
  }
  std::string name = p.substr(4);
  if (!b) {
    serveFromDir(uiDir(), name, res);
    return true;
  }
  if (!b->notBuilt.empty() || b->count == 0) {
    sendNotBuilt(*b, res);
    return true;
  }
  const Asset* index = nullptr;
  for (size_t i = 0; i < b->count; ++i) {
    const Asset& a = b->assets[i];
    if (a.name == "index.html") index = &a;
    if (!name.empty() && a.name == name) {
      sendAsset(a, req, res);
      return true;
    }
  }
  // Any other path (/ui/sandboxes/x) gets the app; a missing file (an old
  // hashed bundle, a typo: a dot in its last segment) is a 404, not HTML
  // where a script was expected.
  std::string_view last = std::string_view(name).substr(name.rfind('/') + 1);
  if (last.find('.') != std::string_view::npos || !index) {
    notFound(res, name);
    return true;
  }
  sendAsset(*index, req, res);
  return true;
}

}  // namespace

bool serveBundle(const Bundle& b, http::Request& req, http::Response& res) {
  return serve(&b, req, res);
}

bool serveUi(http::Request& req, http::Response& res) {
  if (!uiDir().empty()) return serve(nullptr, req, res);
  return serve(&builtBundle(), req, res);
}

void setUiDir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  uiDir() = std::move(dir);
}

}  // namespace dsec::ui
