#include "ui/ui_assets.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/http_server.h"

namespace dsec::ui {
namespace {

struct Reply {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string header(const std::string& k) const {
    auto it = headers.find(k);
    return it == headers.end() ? "" : it->second;
  }
};

// One request on a new connection ("Connection: close"), read to EOF.
Reply fetch(uint16_t port, const std::string& method, const std::string& target,
            const std::string& extraHeaders = "") {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" +
                    extraHeaders + "\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  std::string raw;
  char buf[8192];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    raw.append(buf, size_t(n));
  }
  ::close(fd);
  Reply r;
  size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return r;
  std::string head = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  r.status = std::atoi(head.substr(9, 3).c_str());
  size_t pos = head.find("\r\n");
  while (pos != std::string::npos) {
    size_t next = head.find("\r\n", pos + 2);
    std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos
                                                                       : next - pos - 2);
    size_t colon = line.find(':');
    if (colon != std::string::npos) {
      std::string k = line.substr(0, colon);
      for (auto& c : k) c = char(std::tolower(static_cast<unsigned char>(c)));
      std::string v = line.substr(colon + 1);
      while (!v.empty() && v[0] == ' ') v.erase(0, 1);
      r.headers[k] = v;
    }
    pos = next;
  }
  return r;
}

const char kIndex[] = "<!doctype html><title>t</title><script src=/ui/app.0123.js></script>";
const char kJs[] = "console.log('the app, uncompressed');";
const char kJsGz[] = "GZIPPED-BYTES";
const Asset kAssets[] = {
    {"index.html", "text/html; charset=utf-8", {kIndex, sizeof kIndex - 1}, {}, "\"idx1\"", false},
    {"app.0123.js", "text/javascript; charset=utf-8", {kJs, sizeof kJs - 1},
     {kJsGz, sizeof kJsGz - 1}, "\"js1\"", true},
};
const Bundle kBundle{kAssets, 2, {}};
const Bundle kNotBuilt{nullptr, 0, "configured with -DDSEC_UI=OFF"};

// A server whose inline handler is the console's, over `bundle` (null: the
// built one), and whose blocking handler answers everything else "api".
class UiServer {
 public:
  explicit UiServer(const Bundle* bundle) {
    http::ServerOptions o;
    o.port = 0;
    o.inlineHandler = [bundle](http::Request& req, http::Response& res) {
      return bundle ? serveBundle(*bundle, req, res) : serveUi(req, res);
    };
    server_ = std::make_unique<http::Server>(o);
    EXPECT_TRUE(server_->listen().isOk());
    thread_ = std::thread([this] {
      server_->serve([](http::Request&, http::Response& res) {
        (void)res.send(404, "application/json", "api");
      });
    });
  }
  ~UiServer() {
    server_->stop();
    thread_.join();
  }
  uint16_t port() const { return server_->port(); }

 private:
  std::unique_ptr<http::Server> server_;
  std::thread thread_;
};

void expectSecurityHeaders(const Reply& r) {
  EXPECT_EQ(r.header("content-security-policy"), std::string(kContentSecurityPolicy));
  EXPECT_EQ(r.header("x-content-type-options"), "nosniff");
  EXPECT_EQ(r.header("referrer-policy"), "no-referrer");
}

TEST(UiAssets, IndexIsNoCacheWithSecurityHeaders) {
  UiServer s(&kBundle);
  Reply r = fetch(s.port(), "GET", "/ui/");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, kIndex);
  EXPECT_EQ(r.header("content-type"), "text/html; charset=utf-8");
  EXPECT_EQ(r.header("cache-control"), "no-cache");
  EXPECT_EQ(r.header("etag"), "\"idx1\"");
  EXPECT_EQ(r.header("content-encoding"), "");
  expectSecurityHeaders(r);
}

TEST(UiAssets, HashedAssetIsImmutable) {
  UiServer s(&kBundle);
  Reply r = fetch(s.port(), "GET", "/ui/app.0123.js");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, kJs);
  EXPECT_EQ(r.header("cache-control"), "public, max-age=31536000, immutable");
  EXPECT_EQ(r.header("content-type"), "text/javascript; charset=utf-8");
  EXPECT_EQ(r.header("vary"), "Accept-Encoding");
  EXPECT_EQ(r.header("etag"), "\"js1\"");
  expectSecurityHeaders(r);
}

TEST(UiAssets, GzipWhenAccepted) {
  UiServer s(&kBundle);
  Reply r = fetch(s.port(), "GET", "/ui/app.0123.js", "Accept-Encoding: br, gzip, deflate\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, kJsGz);
  EXPECT_EQ(r.header("content-encoding"), "gzip");
  EXPECT_EQ(r.header("etag"), "\"js1-gz\"");
  EXPECT_EQ(r.header("content-length"), std::to_string(sizeof kJsGz - 1));
  // Refused with q=0, or not offered: the plain bytes.
  for (const char* ae : {"Accept-Encoding: gzip;q=0, deflate\r\n", "Accept-Encoding: br\r\n", ""}) {
    Reply p = fetch(s.port(), "GET", "/ui/app.0123.js", ae);
    EXPECT_EQ(p.body, kJs) << ae;
    EXPECT_EQ(p.header("content-encoding"), "") << ae;
  }
  EXPECT_EQ(fetch(s.port(), "GET", "/ui/app.0123.js", "Accept-Encoding: *\r\n").body, kJsGz);
  // index.html has no gzip copy: plain whatever is accepted.
  EXPECT_EQ(fetch(s.port(), "GET", "/ui/", "Accept-Encoding: gzip\r\n").body, kIndex);
}

TEST(UiAssets, IfNoneMatchAnswers304) {
  UiServer s(&kBundle);
  Reply r = fetch(s.port(), "GET", "/ui/app.0123.js", "If-None-Match: \"js1\"\r\n");
  EXPECT_EQ(r.status, 304);
  EXPECT_EQ(r.body, "");
  EXPECT_EQ(r.header("etag"), "\"js1\"");
  expectSecurityHeaders(r);
  // The gzip copy's tag, a list, a weak tag, "*".
  EXPECT_EQ(fetch(s.port(), "GET", "/ui/app.0123.js",
                  "Accept-Encoding: gzip\r\nIf-None-Match: \"js1-gz\"\r\n")
                .status,
            304);
  EXPECT_EQ(fetch(s.port(), "GET", "/ui/app.0123.js", "If-None-Match: \"x\", W/\"js1\"\r\n").status,
            304);
  EXPECT_EQ(fetch(s.port(), "GET", "/ui/", "If-None-Match: *\r\n").status, 304);
  // A stale tag: the whole file.
  Reply stale = fetch(s.port(), "GET", "/ui/", "If-None-Match: \"old\"\r\n");
  EXPECT_EQ(stale.status, 200);
  EXPECT_EQ(stale.body, kIndex);
}

TEST(UiAssets, HeadHasLengthAndNoBody) {
  UiServer s(&kBundle);
  Reply r = fetch(s.port(), "HEAD", "/ui/app.0123.js");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "");
  EXPECT_EQ(r.header("content-length"), std::to_string(sizeof kJs - 1));
  EXPECT_EQ(r.header("etag"), "\"js1\"");
  expectSecurityHeaders(r);
}

TEST(UiAssets, UnknownPathsGetTheAppUnknownFiles404) {
  UiServer s(&kBundle);
  for (const char* p : {"/ui/sandboxes", "/ui/sandboxes/sb-1/files", "/ui/x?y=z"}) {
    Reply r = fetch(s.port(), "GET", p);
    EXPECT_EQ(r.status, 200) << p;
    EXPECT_EQ(r.body, kIndex) << p;
    EXPECT_EQ(r.header("cache-control"), "no-cache") << p;
  }
  for (const char* p : {"/ui/app.old.js", "/ui/favicon.ico", "/ui/a/b.css"}) {
    Reply r = fetch(s.port(), "GET", p);
    EXPECT_EQ(r.status, 404) << p;
    expectSecurityHeaders(r);
  }
}

TEST(UiAssets, RootRedirectsOtherPathsAndMethodsPassOn) {
  UiServer s(&kBundle);
  for (const char* p : {"/", "/ui"}) {
    Reply r = fetch(s.port(), "GET", p);
    EXPECT_EQ(r.status, 302) << p;
    EXPECT_EQ(r.header("location"), "/ui/") << p;
  }
  EXPECT_EQ(fetch(s.port(), "POST", "/ui/", "Content-Length: 0\r\n").status, 405);
  // Not the console's: the API's handler answers.
  EXPECT_EQ(fetch(s.port(), "GET", "/v1/sandboxes").body, "api");
  EXPECT_EQ(fetch(s.port(), "GET", "/uix").body, "api");
  EXPECT_EQ(fetch(s.port(), "POST", "/", "Content-Length: 0\r\n").body, "api");
}

TEST(UiAssets, NotBuiltSaysSo) {
  UiServer s(&kNotBuilt);
  Reply r = fetch(s.port(), "GET", "/ui/");
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("console not built"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("-DDSEC_UI=OFF"), std::string::npos) << r.body;
  EXPECT_EQ(r.header("content-type"), "text/plain; charset=utf-8");
  expectSecurityHeaders(r);
}

TEST(UiAssets, BuiltBundleIsWellFormed) {
  const Bundle& b = builtBundle();
  if (!b.notBuilt.empty()) GTEST_SKIP() << "console not built: " << b.notBuilt;
  bool index = false, js = false, css = false;
  for (size_t i = 0; i < b.count; ++i) {
    const Asset& a = b.assets[i];
    EXPECT_FALSE(a.data.empty()) << a.name;
    EXPECT_GE(a.etag.size(), 3u) << a.name;
    EXPECT_EQ(a.etag.front(), '"') << a.name;
    if (a.name == "index.html") {
      index = true;
      EXPECT_FALSE(a.immutable);
      EXPECT_NE(a.data.find("/ui/app."), std::string_view::npos);
    }
    if (a.name.substr(a.name.size() - 3) == ".js") js = a.immutable && !a.gzip.empty();
    if (a.name.size() > 4 && a.name.substr(a.name.size() - 4) == ".css") css = a.immutable;
    // A gzip copy starts with the gzip magic.
    if (!a.gzip.empty()) {
      EXPECT_EQ(uint8_t(a.gzip[0]), 0x1f) << a.name;
      EXPECT_EQ(uint8_t(a.gzip[1]), 0x8b) << a.name;
    }
  }
  EXPECT_TRUE(index && js && css);
  UiServer s(nullptr);
  Reply r = fetch(s.port(), "GET", "/ui/");
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("<div id=\"app\">"), std::string::npos);
}

TEST(UiAssets, UiDirServesFromDisk) {
  char tmpl[] = "/tmp/ui-dir-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  std::ofstream(dir + "/index.html") << "<p>dev</p>";
  std::ofstream(dir + "/app.1.js") << "dev();";
  setUiDir(dir + "/");
  {
    UiServer s(nullptr);
    Reply r = fetch(s.port(), "GET", "/ui/");
    EXPECT_EQ(r.body, "<p>dev</p>");
    EXPECT_EQ(r.header("cache-control"), "no-cache");
    expectSecurityHeaders(r);
    Reply js = fetch(s.port(), "GET", "/ui/app.1.js");
    EXPECT_EQ(js.body, "dev();");
    EXPECT_EQ(js.header("content-type"), "text/javascript; charset=utf-8");
    EXPECT_EQ(fetch(s.port(), "GET", "/ui/deep/link").body, "<p>dev</p>");
    EXPECT_EQ(fetch(s.port(), "GET", "/ui/nope.js").status, 404);
    EXPECT_EQ(fetch(s.port(), "GET", "/ui/../../etc/passwd").status, 404);
    EXPECT_EQ(fetch(s.port(), "GET", "/ui/%2e%2e%2fetc%2fpasswd").status, 404);
    EXPECT_EQ(fetch(s.port(), "GET", "/ui/.hidden.js").status, 404);
  }
  setUiDir("");
  ::unlink((dir + "/index.html").c_str());
  ::unlink((dir + "/app.1.js").c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace dsec::ui
