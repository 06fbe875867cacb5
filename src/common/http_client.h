// A blocking HTTP/1.1 client for the CLI (the SDK is the Python one). One
// keep-alive connection; not thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec::http {

struct ClientResponse {
  int status = 0;
  std::string contentType;
  std::string body;
};

struct ClientOptions {
  // Each bound is per system call, so the CLI never hangs forever on a dead or
  // stuck server; a long streamed response is fine as long as bytes keep coming.
  double connectTimeoutS = 300;  // TCP connect; then kDeadlineExceeded
  double readTimeoutS = 300;     // longest silence from the server (SO_RCVTIMEO)
  double writeTimeoutS = 300;    // longest stall sending a request (SO_SNDTIMEO)
};

class Client {
 public:
  // url: "http://host:port" (no TLS in the CLI yet). kUnavailable if the server
  // cannot be reached, kDeadlineExceeded if connecting takes connectTimeoutS.
  // Requests fail with kDeadlineExceeded when a read or write times out; the
  // connection is then unusable.
  static Result<std::unique_ptr<Client>> connect(const std::string& url, std::string token,
                                                 ClientOptions opts = {});
  ~Client();

  Result<ClientResponse> request(std::string_view method, std::string_view target,
                                 std::string_view body = {});
  // Streams the file at `path` as the body.
  Result<ClientResponse> uploadFile(std::string_view method, std::string_view target,
                                    const std::string& path);
  // Calls onData for each piece of the response body as it arrives (body is
  // left empty in the returned response).
  Result<ClientResponse> requestStreaming(std::string_view method, std::string_view target,
                                          std::string_view body,
                                          const std::function<void(std::string_view)>& onData);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec::http
