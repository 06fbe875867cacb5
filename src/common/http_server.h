// A small HTTP/1.1 server over Boost.Beast: one thread per connection, blocking
// handlers, keep-alive, streamed request bodies and streamed (chunked or
// fixed-length) responses. Beast stays inside http_server.cc.
//
// Why threads and not coroutines: handlers block on the sandbox agent (exec can
// take minutes) and stream large files both ways; a thread per connection keeps
// that code straight-line, and connection counts per platform are in the
// hundreds (SDK clients keep connections alive), not the hundred thousands.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec::http {

class Connection;  // private to http_server.cc

// One request. The body is not read until the handler asks for it.
// Not thread-safe; valid only during the handler call.
class Request {
 public:
  explicit Request(Connection* conn) : conn_(conn) {}

  std::string method;  // "GET", "POST", ...
  std::string target;  // raw target, "/v1/x?a=b"
  std::string path;    // percent-decoded path, "/v1/x"
  std::multimap<std::string, std::string> query;  // percent-decoded
  std::map<std::string, std::string> headers;     // lower-case names
  std::optional<uint64_t> contentLength;          // when the client sent one

  std::string header(const std::string& lowerName) const;
  // First value of a query parameter, or nullopt.
  std::optional<std::string> param(const std::string& name) const;

  // Reads the whole body; kPayloadTooLarge past `limit` bytes.
  Result<std::string> readBody(size_t limit);
  // Reads up to n body bytes into buf; 0 at the end of the body.
  Result<size_t> readSome(char* buf, size_t n);
  bool bodyDone() const;

 private:
  Connection* conn_;
};

// The response to one request. Exactly one of send*() or begin*() must be
// called; after begin*() the handler writes the body, then finish().
class Response {
 public:
  explicit Response(Connection* conn) : conn_(conn) {}

  void setHeader(std::string name, std::string value);
  Status send(int status, std::string_view contentType, std::string_view body);
  // Body of known length, written with write().
  Status beginFixed(int status, std::string_view contentType, uint64_t length);
  // Chunked body, each write() one chunk.
  Status beginChunked(int status, std::string_view contentType);
  Status write(std::string_view data);
  Status finish();
  bool started() const { return started_; }

 private:
  friend class Connection;
  Connection* conn_;
  std::map<std::string, std::string> extraHeaders_;
  bool started_ = false;
  bool chunked_ = false;
  bool finished_ = false;
  uint64_t remaining_ = 0;
};

using Handler = std::function<void(Request&, Response&)>;

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 7070;  // 0 picks a free port
  std::string serverName = "dsec";
  // Longest wait for the next byte from a client (SO_RCVTIMEO). Waiting for a
  // request's header, the connection is closed quietly; reading a body, the
  // read fails with kDeadlineExceeded. <= 0: wait forever.
  double idleTimeoutS = 300;
  // Longest wait for a client to accept more response bytes (SO_SNDTIMEO);
  // then the write fails with kUnavailable and the connection is dropped, so a
  // client that stops reading cannot hold a handler forever. <= 0: forever.
  double sendTimeoutS = 300;
  // Open connections at most; past it a new connection gets 503 "unavailable"
  // ("too many connections") and is closed. <= 0: no cap.
  int maxConnections = 4096;
};

class Server {
 public:
  explicit Server(ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and listens; after it, port() is the bound port. kUnavailable if the
  // address cannot be bound, kInvalidArgument for a bad host.
  Status listen();
  uint16_t port() const;
  // Accepts connections until stop(), calling `handler` on connection threads.
  // Returns after stop() once every connection thread has ended and its socket
  // is closed. Sockets (listening and accepted) are close-on-exec.
  void serve(Handler handler);
  // Thread-safe; callable from a signal-handling thread.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Percent-decodes s ("+" stays "+"); false on a malformed escape.
bool percentDecode(std::string_view s, std::string& out);
std::string percentEncode(std::string_view s);

}  // namespace dsec::http
