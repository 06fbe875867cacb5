#include "common/http_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "common/log.h"

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
}  // namespace

// One accepted connection; owned by its thread.
class Connection {
 public:
  Connection(tcp::socket sock, const std::string& serverName)
      : sock_(std::move(sock)), serverName_(serverName) {}

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
    bhttp::read(sock_, buf_, *parser_, ec);
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) {
      broken_ = true;
      if (ec == bhttp::error::body_limit) return Status(Code::kPayloadTooLarge, "body too large");
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
    res.keep_alive(keepAlive_);
    if (chunked) {
      res.chunked(true);
    } else {
      res.content_length(len.value_or(0));
    }
    bhttp::response_serializer<bhttp::empty_body> sr{res};
    beast::error_code ec;
    bhttp::write_header(sock_, sr, ec);
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
      asio::write(sock_, bhttp::make_chunk(asio::const_buffer(data.data(), data.size())), ec);
    } else {
      asio::write(sock_, asio::const_buffer(data.data(), data.size()), ec);
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
    asio::write(sock_, bhttp::make_chunk_last(), ec);
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
    std::string body = std::string(R"({"error":{"code":")") + std::string(code) +
                       R"(","message":")" + std::string(msg) + "\"}}";
    (void)r.send(status, "application/json", body);
  }

  tcp::socket sock_;
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
    bhttp::read_header(sock_, buf_, *parser_, ec);
    if (ec) {
      if (ec != bhttp::error::end_of_stream && ec != asio::error::connection_reset &&
          ec != asio::error::eof && ec != asio::error::operation_aborted &&
          ec != asio::error::bad_descriptor && ec != asio::error::shut_down &&
          ec != asio::error::not_connected) {
        keepAlive_ = false;
        sendSimpleError(400, "invalid_argument", "malformed HTTP request");
      }
      return;
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
      return;
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
    if (!parser_->is_done()) break;  // handler left body unread: cannot reuse the stream
  }
  sock_.shutdown(tcp::socket::shutdown_send, ec);
  lingerDrain();
}

void Connection::lingerDrain() {
  // A client still sending a body we refused would get a reset instead of our
  // error response if we closed now; read and drop a bounded amount first.
  timeval tv{0, 200 * 1000};
  setsockopt(sock_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char junk[65536];
  size_t total = 0;
  while (total < (64u << 20)) {
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
  if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(1024, ec);
  if (ec) {
    return Status(Code::kUnavailable, "listen on " + impl_->opts.host + ":" +
                                          std::to_string(impl_->opts.port) + ": " + ec.message());
  }
  return Status::ok();
}

uint16_t Server::port() const {
  beast::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void Server::serve(Handler handler) {
  auto shared = std::make_shared<Handler>(std::move(handler));
  while (!impl_->stopping) {
    beast::error_code ec;
    tcp::socket sock(impl_->ioc);
    impl_->acceptor.accept(sock, ec);
    if (ec) {
      if (impl_->stopping) break;
      if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space) {
        log::warn("accept: " + ec.message());
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    {
      std::lock_guard lk(impl_->mu);
      ++impl_->active;
    }
    std::thread([this, shared, s = std::move(sock)]() mutable {
      Connection conn(std::move(s), impl_->opts.serverName);
      {
        std::lock_guard lk(impl_->mu);
        impl_->conns.insert(&conn);
        if (impl_->stopping) conn.shutdown();
      }
      conn.run(*shared);
      std::lock_guard lk(impl_->mu);
      impl_->conns.erase(&conn);
      --impl_->active;
      impl_->cv.notify_all();
    }).detach();
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
