// The web console's assets (ui/, docs/console.md), built at make time by
// `node ui/build.mjs` into a generated table (ui_assets.cc in the build dir)
// and served from inside the binary at /ui.
//
// serveUi() is meant for ServerOptions::inlineHandler: it runs on an io
// thread and never blocks (the assets are in memory; --ui-dir, a development
// aid, reads small files from local disk). The assets are unauthenticated:
// they hold no data, and every /v1 call of the console carries the key the
// user typed.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dsec::http {
class Request;
class Response;
}  // namespace dsec::http

namespace dsec::ui {

struct Asset {
  std::string_view name;         // "index.html", "app.3f2a9c0b1d2e.js": no directory
  std::string_view contentType;  // "text/javascript; charset=utf-8"
  std::string_view data;
  std::string_view gzip;         // a gzip copy for large ones; empty: none
  std::string_view etag;         // quoted, of `data` ("\"<sha256 prefix>\""); the gzip copy
                                 // is served as etag + "-gz" inside the quotes
  bool immutable = false;        // a content-hashed name: cached for a year
};

struct Bundle {
  const Asset* assets = nullptr;
  size_t count = 0;
  // Non-empty when the console was not built (-DDSEC_UI=OFF, no node or npm
  // at configure time): why, shown on the page /ui answers instead.
  std::string_view notBuilt;
};

// The table the build generated (or the empty one of a build without it).
const Bundle& builtBundle();

// Answers GET and HEAD of "/" (302 to /ui/), "/ui" (302 to /ui/) and "/ui/..."
// from builtBundle(), or from the directory given to setUiDir(); false for any
// other path (and for other methods on "/"), so the caller hands the request
// on. Under /ui/: a known asset by name; index.html for "/ui/" and any other
// path whose last segment has no dot (the console routes by URL fragment, so
// any such path is the app); 404 for an unknown file name (a dot in its last
// segment); other methods 405. Every answer carries the console's
// Content-Security-Policy, nosniff and no-referrer; index.html is no-cache,
// hashed assets immutable; If-None-Match answers 304; a client that accepts
// gzip gets the precompressed copy.
bool serveUi(http::Request& req, http::Response& res);
// serveUi() over a given bundle (tests).
bool serveBundle(const Bundle& b, http::Request& req, http::Response& res);

// Development: serve /ui/* from files in `dir` (the output of
// `node ui/build.mjs --out DIR --watch`), read on each request, no-cache.
// Call before the server starts; "" goes back to the built-in bundle.
void setUiDir(std::string dir);

// The headers every console answer carries (exposed for tests).
inline constexpr std::string_view kContentSecurityPolicy =
    "default-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
    "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'";

}  // namespace dsec::ui
