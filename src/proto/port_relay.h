// A TCP connection carried by one link call (exposed ports, the link's
// `port_open`: edge/link_service.h): relays a connected stream socket and the
// call both ways, the same on both ends. On the edge the socket is the
// sandbox's connection and the call a ServerCall; on the platform the socket
// is one end of a socketpair whose other end the caller of
// RemoteEdge::openPort holds, and the call a ClientCall.
//
//   socket bytes  -> the call's body (data frames)
//   socket EOF    -> the call's end frame (a half-close)
//   call's body   -> written to the socket
//   call's end    -> shutdown(SHUT_WR) once everything before it is written
//
// Backpressure: the socket is read only while the link takes the bytes (a
// send refused with kResourceExhausted waits for onWritable), and the call's
// body is credited back to the sender (manual credit) only once written to
// the socket. So a connection holds at most the link's window (256 KiB) plus
// one read (64 KiB) each way, however slowly either side reads.
//
// Ending:
//  - Both directions ended (and all written): the edge replies {} and closes
//    its socket; the platform closes its socket (the reply that follows
//    changes nothing).
//  - A socket error (a reset, a write to a closed peer): the edge fails the
//    call with kUnavailable (the errno kept); the platform cancels the call.
//  - A socket shut down both ways by someone else while its write side was
//    still open (the node's cut, PortRegistry; the caller's close of its
//    socketpair end): as an error ("the connection was closed"), also when
//    its other direction had ended already (a hang-up is watched for).
//  - The call ended first (cancelled by the client on the edge; an error
//    outcome on the platform): the socket is closed at once.
//  - A successful outcome on the platform: the socket is closed once what
//    came before it is written.
//
// Threads: no thread per connection. Socket calls are non-blocking
// (MSG_NOSIGNAL: no SIGPIPE) and run on a strand of the Runtime's io
// threads; the link's callbacks post onto it. Thread-safe; owned by
// shared_ptr (the link's callbacks and the pending socket waits hold it
// while it runs). The Runtime must outlive it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "common/runtime.h"
#include "common/status.h"
#include "proto/link.h"

namespace dsec::proto {

class PortRelay {
 public:
  // The edge's end: relays `fd` (connected, non-blocking) and `call`, whose
  // body callbacks, onCancel and onWritable it takes over. `label` names the
  // connection in error messages ("port 8080 of sb-1").
  static std::shared_ptr<PortRelay> serve(Runtime& rt, UniqueFd fd,
                                          std::shared_ptr<ServerCall> call, std::string label);

  // The platform's end, in three steps, as a client call takes its handler
  // when it starts: make the relay, start the call with handler(), attach()
  // the call. The socket is read only once attached.
  static std::shared_ptr<PortRelay> client(Runtime& rt, UniqueFd fd, std::string label);
  // The call's handler (manual credit): body, end, writable and outcome go
  // to the relay; onEvent and onDone (either may be empty) are the caller's,
  // run first on the link's io thread (they must not block).
  CallHandler handler(std::function<void(std::string_view)> onEvent,
                      std::function<void(const Result<std::string>&)> onDone);
  void attach(std::shared_ptr<ClientCall> call);

  // Ends the relay now: closes the socket; the edge fails its call with
  // `why`, the platform cancels its call with it. Idempotent; nothing after
  // the relay ended.
  void abort(Status why);

  // Whether it ended (any way), and the bytes relayed so far each way.
  bool ended() const;
  uint64_t bytesToCall() const;
  uint64_t bytesToSocket() const;

  struct Impl;
  explicit PortRelay(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  // The state lives in Impl, which the link's callbacks and the socket's
  // waits hold: dropping this handle does not end the relay.
  std::shared_ptr<Impl> impl_;
};

}  // namespace dsec::proto
