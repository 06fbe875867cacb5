#include "common/http_client.h"

#include "common/timed_stream.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/core/stream_traits.hpp>
#include <boost/beast/http.hpp>
#include <cstring>

namespace dsec::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {

using internal::setSocketTimeout;
using internal::TimedStream;

Status ioError(std::string_view what, const beast::error_code& ec) {
  if (ec == asio::error::timed_out) {
    return Status(Code::kDeadlineExceeded, std::string(what) + ": timed out");
  }
  return Status(Code::kUnavailable, std::string(what) + ": " + ec.message());
}

// A close-on-exec TCP socket connected to ep within timeoutS (connect(2) on a
// non-blocking socket, bounded by poll(2)), then blocking with I/O timeouts.
Result<int> connectTo(const tcp::endpoint& ep, const ClientOptions& o) {
  int fd =
      ::socket(ep.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
  if (fd < 0) return Status(Code::kUnavailable, std::string("socket: ") + strerror(errno), errno);
  auto fail = [fd](Code code, std::string msg, int err) {
    ::close(fd);
    return Status(code, std::move(msg), err);
  };
  if (::connect(fd, ep.data(), ep.size()) != 0) {
    if (errno != EINPROGRESS) return fail(Code::kUnavailable, strerror(errno), errno);
    pollfd p{fd, POLLOUT, 0};
    int ms = o.connectTimeoutS > 0 ? std::max(1, int(o.connectTimeoutS * 1000)) : -1;
    int rc;
    while ((rc = ::poll(&p, 1, ms)) < 0 && errno == EINTR) {
    }
    if (rc == 0) return fail(Code::kDeadlineExceeded, "timed out", ETIMEDOUT);
    if (rc < 0) return fail(Code::kUnavailable, strerror(errno), errno);
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return fail(Code::kUnavailable, strerror(err), err);
  }
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return fail(Code::kUnavailable, std::string("fcntl: ") + strerror(errno), errno);
  }
  setSocketTimeout(fd, SO_RCVTIMEO, o.readTimeoutS);
  setSocketTimeout(fd, SO_SNDTIMEO, o.writeTimeoutS);
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

}  // namespace

struct Client::Impl {
  asio::io_context ioc;
  tcp::socket sock{ioc};  // owns the fd
  TimedStream stream;     // all I/O, so the timeouts fire
  beast::flat_buffer buf;
  std::string host, port, token;

  template <class Req>
  void prepare(Req& req) {
    req.set(bhttp::field::host, host + ":" + port);
    req.set(bhttp::field::user_agent, "dsec-cli");
    if (!token.empty()) req.set(bhttp::field::authorization, "Bearer " + token);
    req.keep_alive(true);
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::connect(const std::string& url, std::string token,
                                                ClientOptions opts) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.find("://") != std::string::npos) {
    return invalidArg("url", "only http:// URLs are supported: " + url);
  }
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  auto impl = std::make_unique<Impl>();
  size_t colon = rest.rfind(':');
  impl->host = colon == std::string::npos ? rest : rest.substr(0, colon);
  impl->port = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  impl->token = std::move(token);
  beast::error_code ec;
  tcp::resolver resolver(impl->ioc);
  auto eps = resolver.resolve(impl->host, impl->port, ec);
  if (ec) return Status(Code::kUnavailable, "connect to " + url + ": " + ec.message());
  // Not asio::connect: it cannot bound the connect, and its sockets are not
  // close-on-exec.
  Status last(Code::kUnavailable, "no address");
  for (const auto& e : eps) {
    auto fd = connectTo(e.endpoint(), opts);
    if (!fd.isOk()) {
      last = std::move(fd).takeStatus();
      continue;
    }
    impl->sock.assign(e.endpoint().protocol(), *fd, ec);
    if (ec) {
      ::close(*fd);
      last = Status(Code::kUnavailable, ec.message());
      continue;
    }
    impl->stream = TimedStream(*fd);
    return std::unique_ptr<Client>(new Client(std::move(impl)));
  }
  return last.withContext("connect to " + url);
}

Result<ClientResponse> Client::request(std::string_view method, std::string_view target,
                                       std::string_view body) {
  return requestStreaming(method, target, body, nullptr);
}

namespace {
template <class Parser>
ClientResponse headOf(Parser& p) {
  ClientResponse r;
  r.status = int(p.get().result_int());
  r.contentType = std::string(p.get()[bhttp::field::content_type]);
  return r;
}
}  // namespace

Result<ClientResponse> Client::requestStreaming(
    std::string_view method, std::string_view target, std::string_view body,
    const std::function<void(std::string_view)>& onData) {
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), target, 11};
  impl_->prepare(req);
  if (!body.empty() || method == "POST" || method == "PUT") {
    req.set(bhttp::field::content_type, "application/json");
    req.body() = std::string(body);
    req.prepare_payload();
  }
  beast::error_code ec;
  bhttp::write(impl_->stream, req, ec);
  if (ec) return ioError("send request", ec);
  bhttp::response_parser<bhttp::buffer_body> parser;
  parser.body_limit(boost::none);
  // A HEAD response announces a Content-Length but carries no body; without
  // skip() the parser would wait for those bytes forever.
  if (req.method() == bhttp::verb::head) parser.skip(true);
  bhttp::read_header(impl_->stream, impl_->buf, parser, ec);
  if (ec) return ioError("read response", ec);
  ClientResponse out = headOf(parser);
  char chunk[65536];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof chunk;
    bhttp::read(impl_->stream, impl_->buf, parser, ec);
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) return ioError("read response body", ec);
    size_t n = sizeof chunk - parser.get().body().size;
    if (onData && n > 0) {
      onData(std::string_view(chunk, n));
    } else {
      out.body.append(chunk, n);
    }
  }
  return out;
}

Result<ClientResponse> Client::uploadFile(std::string_view method, std::string_view target,
                                          const std::string& path) {
  bhttp::request<bhttp::file_body> req{bhttp::string_to_verb(method), target, 11};
  impl_->prepare(req);
  beast::error_code ec;
  req.body().open(path.c_str(), beast::file_mode::scan, ec);
  if (ec) return Status(Code::kNotFound, "open " + path + ": " + ec.message());
  req.set(bhttp::field::content_type, "application/octet-stream");
  req.prepare_payload();
  bhttp::write(impl_->stream, req, ec);
  if (ec) return ioError("upload " + path, ec);
  bhttp::response<bhttp::string_body> res;
  bhttp::read(impl_->stream, impl_->buf, res, ec);
  if (ec) return ioError("read response", ec);
  ClientResponse out;
  out.status = int(res.result_int());
  out.contentType = std::string(res[bhttp::field::content_type]);
  out.body = std::move(res.body());
  return out;
}

}  // namespace dsec::http
