// One reader of a process session's output (processes.h) into an HTTP
// response: pulled from the session's window from an offset on, at the
// client's pace, in the response's own encoding (the REST API's NDJSON,
// E2B's Connect envelopes). A client that does not read is not written to
// past kReaderQueueBound; it catches up from the window (or is told of a
// gap) once it reads again.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "common/http_server.h"
#include "common/util.h"
#include "platform/processes.h"

namespace dsec::platform {

inline constexpr size_t kReaderQueueBound = 1u << 20;

class SessionReader : public std::enable_shared_from_this<SessionReader> {
 public:
  // The response must have begun its body. follow: until the process ends
  // (else: until caught up); keepaliveS > 0: a keepalive while quiet.
  SessionReader(std::shared_ptr<ProcessSession> s, std::shared_ptr<http::Deferred> d,
                uint64_t from, bool follow, double keepaliveS);
  virtual ~SessionReader() = default;

  // Starts reading: watches the session until the response is over or the
  // client goes away (the process goes on either way).
  static void start(const std::shared_ptr<SessionReader>& r);

 protected:
  // The response's bytes for each event. end() is the last write (the
  // response then finishes); caughtUp() ends a reader that does not follow.
  virtual std::string gap(uint64_t from, uint64_t next) = 0;
  virtual std::string chunk(const ProcessSession::Chunk& c) = 0;
  virtual std::string end(const Result<proto::ExecResult>& r, uint64_t offset) = 0;
  virtual std::string keepalive(uint64_t offset) = 0;
  virtual std::string caughtUp() { return {}; }

 private:
  // Sends what there is; false once the response is over.
  bool pump();
  void retryLater();
  void keepaliveLater();

  const std::shared_ptr<ProcessSession> s_;
  const std::shared_ptr<http::Deferred> d_;
  const bool follow_;
  const double keepaliveS_;
  std::mutex mu_;  // guards the rest
  uint64_t next_;
  bool closed_ = false;
  bool retryPending_ = false;
  double lastWrite_ = monoSeconds();
};

}  // namespace dsec::platform
