// A small HTTP/1.1 server on Boost.Asio and C++20 coroutines: keep-alive,
// streamed request bodies and streamed (chunked or fixed-length) responses,
// responses completed later from any thread (Deferred), and protocol upgrades.
// Asio and Beast stay inside http_server.cc.
//
// Threads (DESIGN.md section 1, common/runtime.h). A connection is a coroutine
// on the Runtime's io threads, serialised by its own strand; an open
// connection or an in-flight request costs a coroutine and a socket, never a
// thread. The process's thread count does not grow with connections or
// requests: the Runtime's threads are all there is.
//
// How nothing blocks the event loop:
//  - The coroutine only ever waits in Asio: for readability, for a read, for a
//    write, for a timer, or for an event another thread posts to its strand.
//    Sockets are non-blocking; the listener accepts with accept4() on
//    readiness, and a connection refused past maxConnections is answered with
//    one MSG_DONTWAIT send.
//  - The blocking Handler runs on the Runtime's bounded blocking pool. When it
//    reads a body that is not yet in memory or writes a streamed response, its
//    worker hands the socket operation to the connection's strand and sleeps
//    on a condition variable until the strand reports back (bounded by
//    bodyTimeoutS / sendTimeoutS, which the strand's timer enforces). The io
//    thread never waits for a worker.
//  - ServerOptions::inlineHandler and Deferred run on io threads or on any
//    thread and never block: Deferred queues bytes and returns at once.
//  - Every wait on the client has a deadline (header, idle, body, send), so a
//    slow or silent client holds a socket and a coroutine, never a worker,
//    and cannot delay other connections.
//
// Memory: an idle kept-alive connection holds no buffer and no request state,
// about 2.6 KB of heap in all (its object, strand, reactor entry, two small
// coroutine frames, its pending wait and timer); a deferred request adds about
// 0.4 KB. HttpServerMemoryTest prints the figures.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "common/status.h"

namespace dsec {
class Runtime;
}

namespace dsec::http {

class Connection;  // private to http_server.cc
class Deferred;

// One request. Not thread-safe; valid only during the handler call (inline or
// blocking), on the thread that runs it.
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

  // Reads the whole body; kPayloadTooLarge past `limit` bytes (then the
  // connection closes after the response, unless the body was already read
  // off the wire: see ServerOptions::preReadBytes).
  // Errors, from here and readSome(): kDeadlineExceeded when the client sent
  // nothing for bodyTimeoutS; kInvalidArgument for a malformed (chunked) body
  // or a client that went away mid-body; kUnavailable once the server stops;
  // kFailedPrecondition for a body not yet read, asked for on an io thread (an
  // inline handler: it only sees requests whose body has been read). Errors
  // are sticky: every later read returns the same one.
  Result<std::string> readBody(size_t limit);
  // Reads up to n body bytes into buf; 0 at the end of the body. Blocks (on a
  // worker) until at least one byte or the end has arrived.
  Result<size_t> readSome(char* buf, size_t n);
  // Whether the handler has been given every body byte.
  bool bodyDone() const;

 private:
  Connection* conn_;
};

// The response to one request: exactly one of send(), begin*() (then write()
// and finish()), defer() or upgrade(). Not thread-safe; valid only during the
// handler call. Errors: kInternal for misuse (a second send, write outside a
// body, a body longer than its Content-Length); kUnavailable when the client
// went away, a write timed out (sendTimeoutS) or the server stops;
// kFailedPrecondition for a streaming call on an io thread (an inline handler
// answers with send(), defer() or upgrade()).
class Response {
 public:
  explicit Response(Connection* conn) : conn_(conn) {}

  // Adds a header to the response (replacing one of the same name); only
  // before send()/begin*()/defer() (a deferred response takes them over).
  void setHeader(std::string name, std::string value);
  // Stores the whole response; the connection writes it once the handler has
  // returned, so this never waits for the client (and never fails for it).
  Status send(int status, std::string_view contentType, std::string_view body);
  // Body of known length, written with write(). The header is written before
  // this returns.
  Status beginFixed(int status, std::string_view contentType, uint64_t length);
  // Chunked body, each write() one chunk. The header is written before this
  // returns.
  Status beginChunked(int status, std::string_view contentType);
  // Writes data and waits until the socket took it (backpressure), at most
  // sendTimeoutS without progress. Empty data is a no-op.
  Status write(std::string_view data);
  // Ends a begun body (the connection does it if the handler does not). A
  // fixed body shorter than its length closes the connection (kInternal).
  Status finish();
  // Whether the handler has answered or handed the answer on (send, begin*,
  // defer or upgrade).
  bool started() const { return started_; }

  // Answers later: the handler returns without answering, its thread is free,
  // and the connection waits for the returned Deferred to be completed from
  // any thread. nullptr if the response was already started. Also the way to
  // answer before returning (send() holds the answer until the handler
  // returns): defer(), then send() on the Deferred, then work on. The request
  // (headers, body) is gone once the handler returns: read what is needed
  // first; a body still on the wire (past preReadBytes) is discarded and the
  // connection closes after the response.
  std::shared_ptr<Deferred> defer();

  // Switches protocols: once the handler returns, the connection writes
  // "101 Switching Protocols" with "Upgrade: <protocol>", "Connection:
  // Upgrade" and the headers set with setHeader(), then calls
  // take(sock, buffered) and forgets the connection: it no longer counts as
  // open and is never closed by the server (stop() included).
  //  - `take` runs once, on one of the Runtime's io threads, and must not
  //    block (hand the fd to Runtime::runBlocking or to an Asio socket).
  //  - `sock` is the connected TCP socket in blocking mode (O_NONBLOCK
  //    cleared), close-on-exec, TCP_NODELAY on; `take` owns it.
  //  - `buffered` holds the bytes the client sent after the request, already
  //    read off the socket: they come before anything still to be read.
  // If the 101 cannot be written (the client went away, the server stops)
  // `take` is never called and the socket is closed.
  // Errors: kInternal if the response was already started; kInvalidArgument
  // for an empty or non-token protocol or an empty `take`;
  // kFailedPrecondition if the request body has not been read to its end.
  Status upgrade(std::string protocol,
                 std::function<void(UniqueFd sock, std::string buffered)> take);

 private:
  friend class Connection;
  Connection* conn_;
  std::map<std::string, std::string> extraHeaders_;
  bool started_ = false;
  bool chunked_ = false;
  bool finished_ = false;
  uint64_t remaining_ = 0;
};

// A response answered apart from its handler (Response::defer()): later, from
// any thread, or at once while the handler works on. Thread-safe: every method
// may be called from any thread, io threads included, and none blocks or waits
// for the client. Bytes are queued and written in order by the connection:
// at once if the request body was all read when defer() was called, else once
// the handler has returned. A client that takes nothing for sendTimeoutS is
// dropped.
//
// Errors: kInternal for misuse (send or beginChunked twice, write before
// beginChunked, write after finish); kUnavailable once the client is gone (or
// the server stopped); kFailedPrecondition once the response is complete.
//
// The last reference going without a finish() (or a send()) answers 500 if
// nothing was sent yet, else closes the connection (the client sees a
// truncated body).
class Deferred {
 public:
  ~Deferred();
  Deferred(const Deferred&) = delete;
  Deferred& operator=(const Deferred&) = delete;

  // Only before send()/beginChunked(); ignored after.
  void setHeader(std::string name, std::string value);
  // The whole response; the response is complete (no finish() needed).
  Status send(int status, std::string_view contentType, std::string_view body);
  // Starts a chunked body; each write() is one chunk, finish() ends it.
  Status beginChunked(int status, std::string_view contentType);
  Status write(std::string_view data);
  Status finish();

  // fn runs once, on an io thread, if the client closes (a half-close counts)
  // or resets the connection, a write times out, or the server stops, before
  // send() or finish(); if that has already happened, soon after this call. A
  // later call replaces an fn not yet run. fn must not block; it may call this
  // Deferred's methods and drop it.
  void onClientGone(std::function<void()> fn);
  // Whether the client went away before the response was written.
  bool gone() const;
  // Bytes queued for the client and not yet taken by its socket: a producer
  // that streams should stop queueing past some bound and resume later.
  size_t queuedBytes() const;

  struct State;  // private to http_server.cc

 private:
  friend class Connection;
  Deferred(std::shared_ptr<Connection> conn, std::shared_ptr<State> st);
  std::shared_ptr<Connection> conn_;
  std::shared_ptr<State> st_;
};

// The blocking handler: runs on a worker of the Runtime's blocking pool and
// may block (on the sandbox agent, on disk, on the client through Request and
// Response). Called from many workers at once. The pool is bounded and shared
// by every Server (and everything else) on the Runtime: at most
// Runtime::blockingMaxThreads() handlers run at once and later requests wait
// in its queue, so a call that waits long (an exec) should defer() and free
// its worker, and a handler must never wait for another request of a server
// on the same Runtime.
using Handler = std::function<void(Request&, Response&)>;

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 7070;  // 0 picks a free port
  std::string serverName = "dsec";
  // The event loop and pool the server runs on; nullptr: Runtime::global().
  // Must outlive the Server and every Deferred of it. Many Servers may share
  // one Runtime.
  Runtime* runtime = nullptr;
  // A request's line and headers must all arrive within this many seconds of
  // its first byte; else the connection is closed quietly. <= 0: no bound.
  double headerTimeoutS = 30;
  // The wait for the first byte of a request, on a new or a kept-alive
  // connection; then the connection is closed quietly. <= 0: no bound.
  double idleTimeoutS = 300;
  // The longest silence while a request body is read; the handler's read then
  // fails with kDeadlineExceeded (and the connection closes after the
  // response). <= 0: no bound.
  double bodyTimeoutS = 60;
  // The longest a client may take no response bytes at all; then the write
  // fails with kUnavailable (a Deferred sees onClientGone) and the connection
  // is dropped, so a client that stops reading holds no worker. <= 0: forever.
  double sendTimeoutS = 300;
  // Open connections at most; past it a new connection gets 503 "unavailable"
  // ("too many connections") and is closed. <= 0: no cap.
  int maxConnections = 100000;
  // A body with a Content-Length up to this is read into memory before the
  // handler runs (so the handler's worker never waits on the client for it,
  // and an unread body does not cost the connection). Larger and chunked
  // bodies are read when the handler asks.
  size_t preReadBytes = 64 << 10;
  // Tried first, on the io thread, for every request whose body has been read;
  // true if it answered (it must have called send(), defer() or upgrade()),
  // false to hand the request to the blocking Handler. Must not block: for
  // /v1/health, cheap metrics, and calls that defer at once.
  std::function<bool(Request&, Response&)> inlineHandler;
  // Tried first of all, on the io thread, for every request as soon as its
  // head is parsed (before its body is read): an empty function to serve the
  // request as usual, else a taker to which the connection is handed over
  // (a reverse proxy, common/http_proxy.h). The server then writes nothing,
  // forgets the connection as after an upgrade (it no longer counts as open,
  // and stop() does not close it) and calls take(sock, bytes) on the io
  // thread, which must not block:
  //  - `sock` is the connected TCP socket, still non-blocking, close-on-exec,
  //    TCP_NODELAY on; `take` owns it.
  //  - `bytes` holds every byte read off the socket since this request's
  //    first byte: its raw head, then whatever followed (body, pipelined
  //    requests), in order, before anything still to be read.
  // The Request is valid only during the call. Must not block.
  using Taker = std::function<void(UniqueFd sock, std::string bytes)>;
  std::function<Taker(const Request&)> divert;
};

// A snapshot of a server's counters. Requests are in flight from their last
// header byte until their response is written (or the connection dies).
struct ServerStats {
  int64_t openConnections = 0;   // accepted, not yet closed (upgraded ones leave)
  int64_t inFlight = 0;          // requests in flight now
  int64_t peakInFlight = 0;      // the most at once since the server started
  int64_t deferredInFlight = 0;  // deferred responses whose handler returned, not yet complete
  uint64_t acceptedTotal = 0;    // connections taken into service
  uint64_t refusedTotal = 0;     // connections turned away past maxConnections
  uint64_t timedOutTotal = 0;    // header, idle, body and send timeouts
  int64_t maxConnections = 0;    // ServerOptions::maxConnections (<= 0: no cap)
};

class Server {
 public:
  // Starts opts.runtime (Runtime::global() if null) if it was not running.
  explicit Server(ServerOptions opts);
  // stop(); must not run while serve() is running on another thread.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and listens; after it, port() is the bound port. kUnavailable if the
  // address cannot be bound, kInvalidArgument for a bad host.
  Status listen();
  uint16_t port() const;
  // Accepts connections until stop(), running `handler` on the Runtime's
  // blocking pool. Call once, after listen(). Returns after stop() once no
  // handler of this server is running and every socket it accepted is closed
  // (deferred responses got onClientGone; upgraded sockets are not its own).
  // Sockets (listening and accepted) are close-on-exec. Returns at once if
  // stop() came first.
  void serve(Handler handler);
  // serve() in two halves: start() begins accepting and returns at once (a
  // process serving many servers parks no thread per server); wait() blocks
  // as serve() does after it.
  void start(Handler handler);
  void wait();
  // Thread-safe; callable from a signal-handling thread (not from an
  // async-signal handler). Closes every connection: reads and writes of
  // running handlers fail with kUnavailable, handlers blocked elsewhere run
  // on until they return.
  void stop();
  // Thread-safe.
  ServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Percent-decodes s ("+" stays "+"); false on a malformed escape.
bool percentDecode(std::string_view s, std::string& out);
std::string percentEncode(std::string_view s);

}  // namespace dsec::http
