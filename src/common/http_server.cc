#include "common/http_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/core/stream_traits.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/timed_stream.h"

namespace dsec::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

bool percentDecode(std::string_view s, std::string& out) {
  out.clear();
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) return false;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    int hi = hex(s[i + 1]), lo = hex(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    out.push_back(char(hi * 16 + lo));
    i += 2;
  }
  return true;
}

std::string percentEncode(std::string_view s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') {
      out.push_back(char(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

namespace {
bool parseQuery(std::string_view qs, std::multimap<std::string, std::string>& out) {
  size_t start = 0;
  while (start <= qs.size()) {
    size_t amp = qs.find('&', start);
    if (amp == std::string_view::npos) amp = qs.size();
    std::string_view kv = qs.substr(start, amp - start);
    if (!kv.empty()) {
      size_t eq = kv.find('=');
      std::string k, v;
      std::string rawV(eq == std::string_view::npos ? "" : kv.substr(eq + 1));
      for (auto& c : rawV) if (c == '+') c = ' ';
      if (!percentDecode(kv.substr(0, eq), k) || !percentDecode(rawV, v)) return false;
      out.emplace(std::move(k), std::move(v));
    }
    start = amp + 1;
  }
  return true;
}

using internal::setSocketTimeout;
using internal::TimedStream;

std::string jsonError(std::string_view code, std::string_view msg) {
  return std::string(R"({"error":{"code":")") + std::string(code) + R"(","message":")" +
         std::string(msg) + "\"}}";
}

// Answers a connection we will not serve with 503 and closes it, without
// blocking the accept loop: the send cannot block (MSG_DONTWAIT; a fresh
// socket's buffer is empty) and we drain only what has already arrived. A
// request arriving after the close may earn the client a reset instead of the
// 503; either way it fails fast and the server stays up.
void rejectConnection(int fd, const std::string& serverName, std::string_view msg) {
  std::string body = jsonError("unavailable", msg);
  std::string res =
      "HTTP/1.1 503 Service Unavailable\r\nServer: " + serverName +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  (void)::send(fd, res.data(), res.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  char junk[4096];
  while (::recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
  }
  ::close(fd);
}
}  // namespace

// One accepted connection; owned by its thread.
class Connection {
 public:
  // Takes a socket that is already close-on-exec (accept4(SOCK_CLOEXEC)).
  Connection(tcp::socket sock, const ServerOptions& opts)
      : sock_(std::move(sock)), stream_(sock_.native_handle()), serverName_(opts.serverName) {
    setSocketTimeout(sock_.native_handle(), SO_RCVTIMEO, opts.idleTimeoutS);
    setSocketTimeout(sock_.native_handle(), SO_SNDTIMEO, opts.sendTimeoutS);
  }

  void run(const Handler& handler);
  void shutdown() {
    beast::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
  }

  // Request body access.
  Result<size_t> readSome(char* buf, size_t n) {
    if (!parser_ || parser_->is_done()) return size_t(0);
    auto& body = parser_->get().body();
    body.data = buf;
    body.size = n;
    beast::error_code ec;
    bhttp::read(stream_, buf_, *parser_, ec);
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) {
      broken_ = true;
      if (ec == bhttp::error::body_limit) return Status(Code::kPayloadTooLarge, "body too large");
      if (ec == asio::error::timed_out) {
        return Status(Code::kDeadlineExceeded, "reading request body: timed out");
      }
      return Status(Code::kInvalidArgument, "reading request body: " + ec.message());
    }
    return n - body.size;
  }
  bool bodyDone() const { return !parser_ || parser_->is_done(); }

  // Response writing.
  Status writeHead(Response& r, int status, std::string_view ctype, std::optional<uint64_t> len,
                   bool chunked) {
    bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(status), 11};
    res.set(bhttp::field::server, serverName_);
    res.set(bhttp::field::content_type, ctype);
    for (auto& [k, v] : r.extraHeaders_) res.set(k, v);
    // The connection can carry another request only if this one's body was
    // consumed (unread bytes would parse as the next request) and nothing broke.
    // Decide now, while the header can still say so: the client must see
    // "Connection: close" rather than a silent close, and run() obeys keepAlive_.
    if (broken_ || !bodyDone()) keepAlive_ = false;
    res.keep_alive(keepAlive_);
    if (chunked) {
      res.chunked(true);
    } else {
      res.content_length(len.value_or(0));
    }
    bhttp::response_serializer<bhttp::empty_body> sr{res};
    beast::error_code ec;
    bhttp::write_header(stream_, sr, ec);
    if (ec) {
      broken_ = true;
      return Status(Code::kUnavailable, "client went away: " + ec.message());
    }
    return Status::ok();
  }
  Status writeRaw(std::string_view data, bool chunk) {
    if (isHead_) return Status::ok();  // HEAD: headers only, body never sent
    beast::error_code ec;
    if (chunk) {
      if (data.empty()) return Status::ok();  // an empty chunk would end the body
      asio::write(stream_, bhttp::make_chunk(asio::const_buffer(data.data(), data.size())), ec);
    } else {
      asio::write(stream_, asio::const_buffer(data.data(), data.size()), ec);
    }
    if (ec) {
      broken_ = true;
      return Status(Code::kUnavailable, "client went away: " + ec.message());
    }
    return Status::ok();
  }
  Status writeLastChunk() {
    if (isHead_) return Status::ok();
    beast::error_code ec;
    asio::write(stream_, bhttp::make_chunk_last(), ec);
    if (ec) {
      broken_ = true;
      return Status(Code::kUnavailable, "client went away: " + ec.message());
    }
    return Status::ok();
  }
  void markBroken() { broken_ = true; }
  void lingerDrain();

 private:
  void sendSimpleError(int status, std::string_view code, std::string_view msg) {
    Response r(this);
    (void)r.send(status, "application/json", jsonError(code, msg));
  }

  tcp::socket sock_;    // owns the fd; shutdown() from other threads
  TimedStream stream_;  // all request/response I/O, so the socket timeouts fire
  const std::string& serverName_;
  beast::flat_buffer buf_;
  std::optional<bhttp::request_parser<bhttp::buffer_body>> parser_;
  bool keepAlive_ = true;
  bool broken_ = false;
  bool isHead_ = false;
};

void Connection::run(const Handler& handler) {
  beast::error_code ec;
  sock_.set_option(tcp::no_delay(true), ec);
  for (;;) {
    parser_.emplace();
    parser_->body_limit(boost::none);  // handlers enforce their own limits
    parser_->header_limit(64 * 1024);
    isHead_ = false;  // a previous HEAD must not strip this response's body
    bhttp::read_header(stream_, buf_, *parser_, ec);
    if (ec) {
      // Gone, shut down by stop(), or idle past idleTimeoutS: close quietly.
      if (ec == bhttp::error::end_of_stream || ec == asio::error::connection_reset ||
          ec == asio::error::eof || ec == asio::error::operation_aborted ||
          ec == asio::error::bad_descriptor || ec == asio::error::shut_down ||
          ec == asio::error::not_connected || ec == asio::error::timed_out) {
        return;
      }
      keepAlive_ = false;
      sendSimpleError(400, "invalid_argument", "malformed HTTP request");
      break;  // through the lingering close, so a reset does not eat the 400
    }
    auto& msg = parser_->get();
    keepAlive_ = msg.keep_alive();
    Request req(this);
    req.method = std::string(msg.method_string());
    isHead_ = msg.method() == bhttp::verb::head;
    req.target = std::string(msg.target());
    for (auto& f : msg) {
      std::string name(f.name_string());
      for (auto& c : name) c = char(tolower(static_cast<unsigned char>(c)));
      req.headers[name] = std::string(f.value());
    }
    if (auto len = parser_->content_length()) req.contentLength = *len;
    std::string_view tgt = req.target;
    size_t q = tgt.find('?');
    bool ok = percentDecode(tgt.substr(0, q), req.path);
    if (ok && q != std::string_view::npos) ok = parseQuery(tgt.substr(q + 1), req.query);
    if (!ok) {
      keepAlive_ = false;
      sendSimpleError(400, "invalid_argument", "malformed percent-encoding in URL");
      break;  // the body, if any, is unread: close through the lingering close
    }
    Response res(this);
    handler(req, res);
    if (!res.started_) {
      (void)res.send(500, "application/json",
                     R"({"error":{"code":"internal","message":"handler sent no response"}})");
    } else if (!res.finished_) {
      (void)res.finish();
    }
    if (broken_ || !keepAlive_) break;
    if (!parser_->is_done()) break;  // body unread: writeHead already said close
  }
  sock_.shutdown(tcp::socket::shutdown_send, ec);
  lingerDrain();
}

void Connection::lingerDrain() {
  // A client still sending a body we refused would get a reset instead of our
  // error response if we closed now; read and drop a bounded amount first,
  // for a bounded time, so a trickling client cannot hold the thread.
  timeval tv{0, 200 * 1000};
  setsockopt(sock_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char junk[65536];
  size_t total = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (total < (64u << 20) && std::chrono::steady_clock::now() < deadline) {
    ssize_t n = ::recv(sock_.native_handle(), junk, sizeof junk, 0);
    if (n <= 0) break;
    total += size_t(n);
  }
}

}  // namespace dsec::http

namespace dsec::http {

std::string Request::header(const std::string& lowerName) const {
  auto it = headers.find(lowerName);
  return it == headers.end() ? std::string() : it->second;
}

std::optional<std::string> Request::param(const std::string& name) const {
  auto it = query.find(name);
  if (it == query.end()) return std::nullopt;
  return it->second;
}

Result<std::string> Request::readBody(size_t limit) {
  if (contentLength && *contentLength > limit) {
    conn_->markBroken();
    return Status(Code::kPayloadTooLarge,
                  "request body of " + std::to_string(*contentLength) + " bytes exceeds " +
                      std::to_string(limit));
  }
  std::string out;
  char buf[16384];
  for (;;) {
    ASSIGN_OR_RETURN(size_t n, conn_->readSome(buf, sizeof buf));
    if (n == 0 && conn_->bodyDone()) break;
    out.append(buf, n);
    if (out.size() > limit) {
      conn_->markBroken();
      return Status(Code::kPayloadTooLarge,
                    "request body exceeds " + std::to_string(limit) + " bytes");
    }
  }
  return out;
}

Result<size_t> Request::readSome(char* buf, size_t n) {
  for (;;) {
    ASSIGN_OR_RETURN(size_t got, conn_->readSome(buf, n));
    if (got > 0 || conn_->bodyDone()) return got;
  }
}

bool Request::bodyDone() const { return conn_->bodyDone(); }

void Response::setHeader(std::string name, std::string value) {
  extraHeaders_[std::move(name)] = std::move(value);
}

Status Response::send(int status, std::string_view contentType, std::string_view body) {
  RETURN_IF_ERROR(beginFixed(status, contentType, body.size()));
  RETURN_IF_ERROR(write(body));
  return finish();
}

Status Response::beginFixed(int status, std::string_view contentType, uint64_t length) {
  if (started_) return internalError("response already started");
  started_ = true;
  remaining_ = length;
  return conn_->writeHead(*this, status, contentType, length, false);
}

Status Response::beginChunked(int status, std::string_view contentType) {
  if (started_) return internalError("response already started");
  started_ = true;
  chunked_ = true;
  return conn_->writeHead(*this, status, contentType, std::nullopt, true);
}

Status Response::write(std::string_view data) {
  if (!started_ || finished_) return internalError("write outside a response body");
  if (!chunked_) {
    if (data.size() > remaining_) {
      conn_->markBroken();
      return internalError("response body longer than its Content-Length");
    }
    remaining_ -= data.size();
  }
  return conn_->writeRaw(data, chunked_);
}

Status Response::finish() {
  if (finished_) return Status::ok();
  finished_ = true;
  if (chunked_) return conn_->writeLastChunk();
  if (remaining_ != 0) {
    // We promised more bytes than we have: the only honest thing is to drop
    // the connection so the client sees a truncated body, not a short one.
    conn_->markBroken();
    conn_->shutdown();
    return Status(Code::kInternal, "response body shorter than its Content-Length");
  }
  return Status::ok();
}

struct Server::Impl {
  ServerOptions opts;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  tcp protocol = tcp::v4();  // of the listening address; accepted sockets share it
  std::atomic<bool> stopping{false};
  std::mutex mu;  // guards conns, active
  std::condition_variable cv;
  std::set<Connection*> conns;
  int active = 0;
};

Server::Server(ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
}

Server::~Server() { stop(); }

Status Server::listen() {
  beast::error_code ec;
  auto addr = asio::ip::make_address(impl_->opts.host, ec);
  if (ec) return invalidArg("listen", "bad listen address " + impl_->opts.host);
  tcp::endpoint ep(addr, impl_->opts.port);
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  // Asio opens sockets without SOCK_CLOEXEC; every child (sandbox, helper)
  // would inherit the listening socket and keep the port bound after we exit.
  if (!ec && ::fcntl(a.native_handle(), F_SETFD, FD_CLOEXEC) != 0) {
    ec.assign(errno, boost::system::system_category());
  }
  if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(1024, ec);
  if (ec) {
    return Status(Code::kUnavailable, "listen on " + impl_->opts.host + ":" +
                                          std::to_string(impl_->opts.port) + ": " + ec.message());
  }
  impl_->protocol = ep.protocol();
  return Status::ok();
}

uint16_t Server::port() const {
  beast::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void Server::serve(Handler handler) {
  auto shared = std::make_shared<Handler>(std::move(handler));
  const int listenFd = impl_->acceptor.native_handle();
  while (!impl_->stopping) {
    // accept4(SOCK_CLOEXEC) rather than Asio's accept + fcntl: handlers fork
    // sandboxes on other threads at any moment, and a child forked between
    // accept and fcntl would inherit the connection and hold it open.
    int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (impl_->stopping) break;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        log::warn(std::string("accept: ") + std::strerror(err));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    {
      std::unique_lock lk(impl_->mu);
      if (impl_->opts.maxConnections > 0 && impl_->active >= impl_->opts.maxConnections) {
        lk.unlock();
        rejectConnection(fd, impl_->opts.serverName, "too many connections");
        continue;
      }
      ++impl_->active;
    }
    try {
      std::thread([this, shared, fd]() mutable {
        // Everything touching the socket or the io_context is destroyed in
        // this scope: once `active` drops, serve() may return and the Server
        // and its io_context go away under us.
        {
          tcp::socket sock(impl_->ioc);
          beast::error_code ec;
          sock.assign(impl_->protocol, fd, ec);
          if (ec) {
            ::close(fd);
          } else {
            Connection conn(std::move(sock), impl_->opts);
            {
              std::lock_guard lk(impl_->mu);
              impl_->conns.insert(&conn);
              if (impl_->stopping) conn.shutdown();
            }
            conn.run(*shared);
            std::lock_guard lk(impl_->mu);
            impl_->conns.erase(&conn);
          }
        }
        shared.reset();  // the handler's last reference dies in serve(), not here
        std::lock_guard lk(impl_->mu);
        --impl_->active;
        impl_->cv.notify_all();
      }).detach();
    } catch (const std::exception& e) {
      // Out of threads or memory: std::thread throws. Undo the bookkeeping and
      // turn the client away instead of letting the exception end the process.
      log::warn(std::string("starting a connection thread: ") + e.what());
      {
        std::lock_guard lk(impl_->mu);
        --impl_->active;
      }
      rejectConnection(fd, impl_->opts.serverName, "server overloaded");
    }
  }
  std::unique_lock lk(impl_->mu);
  for (auto* c : impl_->conns) c->shutdown();
  impl_->cv.wait(lk, [&] { return impl_->active == 0; });
}

void Server::stop() {
  if (impl_->stopping.exchange(true)) return;
  // shutdown(2) wakes a thread blocked in accept(2); close() alone would not.
  ::shutdown(impl_->acceptor.native_handle(), SHUT_RDWR);
  std::lock_guard lk(impl_->mu);
  for (auto* c : impl_->conns) c->shutdown();
}

}  // namespace dsec::http
