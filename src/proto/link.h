// The platform-edge link: one persistent, authenticated, multiplexed
// connection per edge that carries any number of concurrent calls, each with
// its own flow control. Generic: it moves methods, arguments, bodies, events
// and replies, and knows nothing of sandboxes (the mapping of sandbox
// operations onto calls lives with its users).
//
// Wire (docs in this header are the spec):
//
//   The client (platform) opens a TCP connection to the edge's HTTP port and
//   sends `GET /edge/v1/link HTTP/1.1` with `Upgrade: dsec-link/1` and
//   `Connection: Upgrade`; after the server's `101 Switching Protocols` the
//   socket carries frames in the layout of common/frame.h (u32 length, u32
//   stream, u8 type, payload <= 1 MiB), with the types of LinkFrame. The
//   client's hello is sent right behind the request, so the server's HTTP
//   layer may have read it already: LinkServer::adopt takes those bytes.
//
//   Handshake (stream 0), mutual, the shared per-node key never sent:
//     C -> S  hello {"v":1,"node":N,"nonce":Nc,"window":Wc}
//     S -> C  hello {"v":1,"nonce":Ns,"window":Ws}
//     C -> S  auth  {"proof": HMAC-SHA256(K, "dsec-link/1 client" | helloC | helloS)}
//     S -> C  ready {"proof": HMAC-SHA256(K, "dsec-link/1 server" | helloC | helloS)}
//   (| = each part prefixed with its u32 length; nonces are 32 random bytes
//   in hex; helloC, helloS the payloads as sent.) Both proofs cover both
//   fresh nonces, so a recorded handshake does not check on a new connection
//   in either direction, and the labels keep one side's proof from serving as
//   the other's. The server accepts nothing but auth before the client's
//   proof checks; the client sends no call before the server's does. A
//   failure is an error frame on stream 0 (kUnauthenticated), then close.
//
//   Calls: the client opens stream s (1, 2, 3, ... per connection) with a
//   call frame (u8 method length, method, args). Either side then sends data
//   frames (body bytes) and one end frame (end of its body); the server may
//   send event frames (discrete payloads <= kMaxEventPayload, such as exec
//   output) and ends the call with reply (success payload) or error (u8 code,
//   i32 errno, u16 field length, field, message: a Status). The client may
//   cancel. Frames of a stream that is already over are ignored.
//
//   Flow control: data and event payload bytes of a call count against a
//   window the receiver grants (`window` of its hello, 256 KiB by default)
//   and tops up with window frames (u32 increment) as its consumer takes the
//   bytes (a frame once a quarter of the window was taken). A sender never
//   exceeds it; a receiver that sees it exceeded drops the connection.
//   Senders interleave the calls round robin, one frame (<= 64 KiB) at a
//   time, with control frames first, so one big transfer cannot starve the
//   small calls beside it.
//
//   Liveness: each side sends a ping after pingIntervalS without hearing
//   anything and drops the connection after pingTimeoutS of silence (or a
//   write that made no progress for that long): a dead peer or a half-open
//   TCP connection is found within pingTimeoutS + pingIntervalS (20 s by
//   default). Every call in flight on a dropped connection fails (client:
//   kUnavailable; server: cancelled).
//
//   Goaway: no new calls on this connection; those in flight finish, then
//   it closes. A server answers calls that arrive after its goaway with
//   kUnavailable (nothing ran); a client opens a new connection for new
//   calls.
//
// Threads: every callback runs on one of the Runtime's io threads and must
// not block; callbacks of one connection never run concurrently, and those
// of one call run in wire order. Blocking helpers are for worker threads
// (the Runtime's blocking pool, a caller's own thread) and fail with
// kFailedPrecondition on an io thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "common/runtime.h"
#include "common/status.h"

namespace dsec::proto {

// The link's frame types (the type byte of common/frame.h's layout).
enum class LinkFrame : uint8_t {
  kHello = 0x01,   // both ways, stream 0: handshake (JSON)
  kAuth = 0x02,    // client -> server, stream 0: the client's proof (JSON)
  kReady = 0x03,   // server -> client, stream 0: the server's proof (JSON)
  kCall = 0x10,    // client -> server: opens the stream (u8 len, method, args)
  kData = 0x11,    // body bytes, either way (flow controlled)
  kEnd = 0x12,     // end of the sender's body
  kEvent = 0x13,   // server -> client: one streamed payload (flow controlled)
  kReply = 0x14,   // server -> client: success, ends the call
  kError = 0x15,   // server -> client: failure (a Status), ends the call; stream 0: refusal
  kCancel = 0x16,  // client -> server: the client abandoned the call
  kWindow = 0x17,  // flow-control credit for the stream (u32 increment)
  kPing = 0x20,    // stream 0, either way; answered by pong with the same payload
  kPong = 0x21,
  kGoaway = 0x22,  // stream 0, either way: no new calls on this connection
};

// The HTTP side of the upgrade, for the edge's HTTP server.
inline constexpr std::string_view kLinkPath = "/edge/v1/link";
inline constexpr std::string_view kLinkProtocol = "dsec-link/1";
// The complete `101 Switching Protocols` answer the HTTP server writes before
// handing the socket to LinkServer::adopt.
std::string linkUpgradeResponse();

// The largest event payload; larger ones fail with kInvalidArgument.
inline constexpr size_t kMaxEventPayload = 64u << 10;

struct LinkOptions {
  // The window this side grants the peer per call, in bytes (64 KiB to
  // 1 GiB; clamped). The receiving side of a call holds at most this much
  // that its consumer has not taken.
  uint32_t initialWindow = 256u << 10;
  // Data and event bytes a call may have queued for sending (beyond it,
  // non-blocking sends fail with kResourceExhausted until onWritable), and
  // the same for all calls of a connection together. Control frames (calls,
  // ends, replies, windows) are not held back: the connection is dropped
  // when 256 MiB of them wait for a peer that does not read.
  size_t callSendBuffer = 256u << 10;
  size_t connSendBuffer = 16u << 20;
  // A peer that sends nothing else is pinged after pingIntervalS and given up
  // after pingTimeoutS of silence.
  double pingIntervalS = 5;
  double pingTimeoutS = 15;
  // Upgrade + handshake (client: connect included) must finish within this.
  double handshakeTimeoutS = 10;
  // Calls in flight on one connection; the server refuses more with
  // kResourceExhausted.
  uint32_t maxCalls = 1u << 20;
};

// ---------------------------------------------------------------------------
// Client side (the platform).

// What a client call reports. Every member may be empty. All run on an io
// thread, never concurrently for one connection, and must not block.
struct CallHandler {
  // Each event of the server, in order.
  std::function<void(std::string_view payload)> onEvent;
  // The server's body bytes, in order. Unset: they are buffered (up to the
  // window) for ClientCall::read.
  std::function<void(std::string_view bytes)> onData;
  // The server ended its body.
  std::function<void()> onEnd;
  // A send that failed with kResourceExhausted may be retried now.
  std::function<void()> onWritable;
  // The outcome, exactly once and last: the reply's payload; the server's
  // error; kUnavailable when the connection was lost or could not be made
  // (kUnauthenticated when the handshake failed); the status given to
  // cancel(). Unset: kept for ClientCall::wait.
  std::function<void(Result<std::string> outcome)> onDone;
  // false: bytes given to onEvent/onData count as consumed when the callback
  // returns. true: only once ClientCall::consumed says so (the window is not
  // topped up before), so a slow consumer holds the server back.
  bool manualCredit = false;
};

// One call, as the client holds it. Thread-safe; owned by shared_ptr (the
// link keeps its own reference while the call is in flight, so dropping the
// handle does not cancel the call).
class ClientCall {
 public:
  virtual ~ClientCall() = default;

  // Queues body bytes for the server (any size; sent as the window allows).
  // Non-blocking. kResourceExhausted (nothing queued) while the call's or the
  // connection's send buffer is full: retry after onWritable.
  // kFailedPrecondition after end(); the call's outcome once it is done.
  virtual Status send(std::string_view bytes) = 0;
  // Ends the request body. kFailedPrecondition when already ended; the
  // call's outcome once it is done.
  virtual Status end() = 0;
  // Abandons the call: the server is told (its onCancel runs) and onDone
  // runs with `why` (unless the call was already done). Idempotent.
  virtual void cancel(Status why) = 0;
  // With manualCredit: the consumer took n more bytes of events and data.
  virtual void consumed(size_t n) = 0;
  // Whether the outcome is known.
  virtual bool done() const = 0;

  // Blocking helpers (not on an io thread: kFailedPrecondition there).
  // send() that waits for room; kDeadlineExceeded after timeoutS.
  virtual Status write(std::string_view bytes, double timeoutS) = 0;
  // Reads the server's body (only when onData is unset): up to n bytes, 0 at
  // its end (an end frame, or the outcome). kDeadlineExceeded after
  // timeoutS; the call's failure when it failed before its body ended.
  virtual Result<size_t> read(char* buf, size_t n, double timeoutS) = 0;
  // Waits for the outcome (only when onDone is unset). kDeadlineExceeded
  // after timeoutS; the call goes on.
  virtual Result<std::string> wait(double timeoutS) = 0;
};

struct LinkClientOptions {
  std::string host;  // the edge's HTTP host (name or address) and port
  uint16_t port = 0;
  std::string key;   // the per-node shared key
  std::string node;  // the node's name, sent in the hello
  LinkOptions link;
  // Backoff between connection attempts after a failure: doubles from min
  // to max; a successful handshake resets it.
  double backoffMinS = 0.05;
  double backoffMaxS = 5;
};

// The platform's end of the link to one edge. Connects on the first call;
// after a loss it reconnects at once, then with backoff while attempts fail
// (in the background, until close(), so the link is up again before the
// next call needs it).
// While an attempt is under way, new calls wait for it; while the client
// waits out a backoff after a failed attempt, new calls fail at once with
// that attempt's status (kUnavailable, or kUnauthenticated for a refused
// handshake).
//
// Thread-safe. The Runtime must outlive the client. Callbacks that are
// already running may still finish after close() or the destructor returns.
class LinkClient {
 public:
  LinkClient(Runtime& rt, LinkClientOptions opts);
  // close().
  ~LinkClient();
  LinkClient(const LinkClient&) = delete;
  LinkClient& operator=(const LinkClient&) = delete;

  // Starts a call. Never blocks and never fails here: a failure (no
  // connection, a method longer than 255 bytes or args over 1 MiB as
  // kInvalidArgument, a closed client) arrives through onDone, never inline.
  std::shared_ptr<ClientCall> start(std::string_view method, std::string_view args,
                                    CallHandler handler);
  // Blocking: one call without bodies; its reply or error. On timeout the
  // call is cancelled and kDeadlineExceeded returned. Not on an io thread.
  Result<std::string> unary(std::string_view method, std::string_view args, double timeoutS);

  // No new calls (they fail with kUnavailable); those in flight finish, then
  // the connection closes.
  void drain();
  // Drops the connection now: calls in flight fail with kUnavailable.
  void close();

  bool connected() const;
  // Successful handshakes so far, and calls in flight.
  uint64_t connects() const;
  size_t callsInFlight() const;

  struct Core;

 private:
  std::shared_ptr<Core> core_;
};

// ---------------------------------------------------------------------------
// Server side (the edge).

// One call, as the server holds it. Thread-safe; owned by shared_ptr.
// After the call is cancelled (by the client, or because the connection
// dropped) every send fails with kUnavailable and does nothing.
class ServerCall {
 public:
  virtual ~ServerCall() = default;

  virtual const std::string& method() const = 0;
  virtual const std::string& args() const = 0;
  // The node name the client authenticated with.
  virtual const std::string& peer() const = 0;

  // Non-blocking sends, any thread. kResourceExhausted (nothing queued)
  // while the send buffer is full: retry after onWritable. kUnavailable once
  // cancelled; kFailedPrecondition after end() (data) or after the call
  // ended (all); kInvalidArgument for an event over kMaxEventPayload.
  virtual Status event(std::string_view payload) = 0;
  virtual Status send(std::string_view bytes) = 0;
  // Ends the response body (reply and fail end it too).
  virtual Status end() = 0;
  // Ends the call (sent after everything queued before it). payload and
  // the status's message + field must fit in 1 MiB (kInvalidArgument).
  virtual Status reply(std::string_view payload) = 0;
  virtual Status fail(const Status& st) = 0;

  // Runs once, on an io thread, when the client cancels or the connection
  // drops before the call ended; at once (inline) if that already happened.
  virtual void onCancel(std::function<void(const Status& why)> cb) = 0;
  // Runs (io thread) when a send refused with kResourceExhausted may be retried.
  virtual void onWritable(std::function<void()> cb) = 0;
  // The client's body: bytes in order, then end. Bytes that arrived before
  // this is set are delivered first (on an io thread). Unset: buffered (up
  // to the window) for read(). manualCredit as in CallHandler.
  virtual void onData(std::function<void(std::string_view bytes)> data, std::function<void()> end,
                      bool manualCredit = false) = 0;
  virtual void consumed(size_t n) = 0;
  virtual bool cancelled() const = 0;
  // Data and event bytes queued here, not yet sent.
  virtual size_t queuedBytes() const = 0;

  // Blocking helpers (not on an io thread: kFailedPrecondition there);
  // kDeadlineExceeded after timeoutS.
  virtual Status write(std::string_view bytes, double timeoutS) = 0;
  virtual Status writeEvent(std::string_view payload, double timeoutS) = 0;
  // Up to n bytes of the client's body, 0 at its end; kUnavailable once cancelled.
  virtual Result<size_t> read(char* buf, size_t n, double timeoutS) = 0;
};

// Looks up the shared key of the node a client names in its hello. Runs on an
// io thread: must not block. An error (or an empty key) refuses the
// handshake with kUnauthenticated.
using LinkKeySource = std::function<Result<std::string>(const std::string& node)>;
// Receives each new call on an io thread: answer inline, or hand blocking
// work to the Runtime's pool (keeping the shared_ptr).
using LinkDispatcher = std::function<void(std::shared_ptr<ServerCall>)>;

// The edge's end: serves the connections its HTTP server upgraded.
// Thread-safe. The Runtime must outlive it.
class LinkServer {
 public:
  LinkServer(Runtime& rt, LinkKeySource keys, LinkDispatcher dispatch, LinkOptions opts = {});
  // close().
  ~LinkServer();
  LinkServer(const LinkServer&) = delete;
  LinkServer& operator=(const LinkServer&) = delete;

  // Takes over a socket whose `101 Switching Protocols` was already written;
  // `buffered` holds the bytes the HTTP server read past the request. After
  // close(), the socket is closed at once.
  void adopt(UniqueFd fd, std::string buffered);
  // Goaway on every connection: calls in flight finish, new ones are refused
  // (kUnavailable), each connection closes once idle. Connections adopted
  // later are served as usual.
  void goAway();
  // Drops every connection now: calls in flight are cancelled.
  void close();

  size_t connections() const;
  size_t callsInFlight() const;
  // Handshakes refused so far (wrong key, unknown node, replay, garbage).
  uint64_t authFailures() const;

  struct Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace dsec::proto
