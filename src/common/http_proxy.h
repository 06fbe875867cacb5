// An HTTP/1.1 reverse proxy for one client connection, on the Runtime's io
// threads: the engine behind exposed ports (docs/ports.md). A server hands it
// a connection with ServerOptions::divert (common/http_server.h); for every
// request on it, a router (which may block: it runs on the blocking pool)
// decides whether to answer at once (401, 404, a redirect) or to forward the
// request to an upstream stream socket, and how to rewrite its head.
//
// Why a proxy and not a byte relay after the first request line: clients send
// credentials on every request of a kept-alive connection, so each request's
// head must be read, checked and rewritten before it may reach untrusted code.
// Parsing every message also re-frames bodies (a request with both
// Content-Length and Transfer-Encoding is refused by Beast's strict parser),
// so no request can be smuggled past the router.
//
// What it does with a message:
//  - Hop-by-hop headers are dropped both ways (Connection, Keep-Alive,
//    Proxy-Connection, TE, Trailer, Transfer-Encoding, Upgrade, Expect and
//    every header named in Connection); bodies are re-framed: the same
//    Content-Length, or chunked (a close-delimited response goes to an
//    HTTP/1.1 client chunked). Expect: 100-continue is answered by the proxy.
//  - A 101 answer to a request that asked to upgrade (a WebSocket) turns the
//    connection into a raw relay in both directions, half-closes passed on.
//  - Bodies are streamed through one 64 KiB buffer per direction, each write
//    waited for: a connection holds at most that much whatever the body's
//    size, and a slow reader on either side slows the other.
//  - The upstream is kept between requests while the router names the same
//    key; a new key (or an upstream that closed) opens another.
//  - Upstream EOF or error mid-response closes the client (it sees a
//    truncated body, a WebSocket sees 1006): that is how a cut reaches it.
//
// Deadlines: a request head must arrive within headerTimeoutS of its first
// byte, a kept-alive connection may wait idleTimeoutS for the next, a body or
// response may be silent idleTimeoutS, an upgraded relay upgradedIdleTimeoutS.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/fd.h"

namespace dsec {
class Runtime;
}

namespace dsec::http {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

// One request's head as the client sent it.
struct ProxyRequest {
  std::string method;
  std::string target;  // raw, "/a/b?c=d"
  int version = 11;    // 10 or 11
  HeaderList headers;  // in order, names as sent, duplicates kept
  bool upgrade = false;     // Connection: upgrade with an Upgrade header
  std::string peer;         // the client's address, "127.0.0.1"
  std::string currentKey;   // the upstream this connection holds ("" if none)
  bool first = false;       // the connection's first request
  // First value of a header (case-insensitive name), "" if absent.
  std::string header(std::string_view name) const;
};

// What the router decided for one request.
struct ProxyDecision {
  bool forward = false;
  // forward == false: this answer (a HEAD request gets its head only).
  int status = 502;
  std::string contentType = "application/json";
  std::string body;
  HeaderList answerHeaders;
  // forward == true:
  std::string key;          // the upstream's identity (sandbox, port, generation)
  UniqueFd upstream;        // a new connected stream socket; empty to keep the current one
  std::string target;       // the target the upstream sees
  HeaderList requestHeaders;   // end-to-end headers to send (hop-by-hop ones are dropped anyway)
  HeaderList responseHeaders;  // set on the response, replacing the upstream's of the same name
  // Both: close the client connection once this exchange is over.
  bool close = false;
  // Kept until this exchange is over, an upgraded relay's end included
  // (a sandbox's activity, say).
  std::shared_ptr<void> hold;
};

// Runs on the Runtime's blocking pool: may block (a store lookup, a connect).
// Must not throw (a throw answers 500).
using ProxyRouter = std::function<ProxyDecision(const ProxyRequest&)>;

struct ProxyOptions {
  Runtime* runtime = nullptr;  // nullptr: Runtime::global()
  double headerTimeoutS = 30;
  double idleTimeoutS = 300;
  double upgradedIdleTimeoutS = 3600;
  // Called on the io thread when an exchange is over: the status sent to the
  // client (0 if none was) and the body bytes relayed each way.
  std::function<void(int status, uint64_t up, uint64_t down)> onExchange;
};

// Takes over a connection a Server diverted: `sock` (connected, non-blocking)
// and the bytes already read from it. Returns at once; the connection lives
// on the io threads until either side closes or a deadline passes.
void serveProxy(UniqueFd sock, std::string bytes, ProxyRouter router,
                std::shared_ptr<const ProxyOptions> opts);

// Counters over every proxied connection of the process.
struct ProxyStats {
  int64_t open = 0;             // client connections now
  uint64_t connections = 0;     // taken in all
  uint64_t requests = 0;        // requests read
  uint64_t bytesUp = 0;         // body and relay bytes client -> upstream
  uint64_t bytesDown = 0;       // upstream -> client
};
ProxyStats proxyStats();

// True for the headers a proxy must not forward (RFC 9110 7.6.1), given the
// message's Connection header value.
bool isHopByHop(std::string_view name, std::string_view connectionHeader);

}  // namespace dsec::http
