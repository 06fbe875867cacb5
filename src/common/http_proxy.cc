#include "common/http_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstring>
#include <optional>

#include "common/log.h"
#include "common/runtime.h"
#include "common/util.h"

namespace dsec::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using ErrorCode = boost::system::error_code;
using namespace asio::experimental::awaitable_operators;

namespace {

using Strand = asio::strand<asio::io_context::executor_type>;
using Sock = asio::basic_stream_socket<asio::generic::stream_protocol, Strand>;
using Timer = asio::basic_waitable_timer<std::chrono::steady_clock,
                                         asio::wait_traits<std::chrono::steady_clock>, Strand>;
using Clock = std::chrono::steady_clock;
constexpr size_t kBuf = 64 << 10;
constexpr size_t kHeadLimit = 64 << 10;
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);

std::atomic<int64_t> gOpen{0};
std::atomic<uint64_t> gConnections{0}, gRequests{0}, gUp{0}, gDown{0};

// Whether a comma-separated header value holds `token` (case-insensitive).
bool hasToken(std::string_view list, std::string_view token) {
  size_t i = 0;
  while (i <= list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string_view::npos) j = list.size();
    if (asciiIEquals(trimOws(list.substr(i, j - i)), token)) return true;
    i = j + 1;
  }
  return false;
}

std::string hex(size_t n) {
  char b[20];
  snprintf(b, sizeof b, "%zx", n);
  return b;
}

std::string headLine(int status) {
  std::string_view reason = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  if (reason.empty() || reason == "<unknown-status>") reason = "Status";
  return "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason) + "\r\n";
}

bool safeHeaderValue(std::string_view v) {
  for (char c : v) {
    if (c == '\r' || c == '\n' || c == '\0') return false;
  }
  return true;
}

void appendHeader(std::string& head, std::string_view k, std::string_view v) {
  if (!safeHeaderValue(k) || !safeHeaderValue(v)) return;
  head.append(k).append(": ").append(v).append("\r\n");
}

std::string peerOf(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

bool assign(Sock& s, UniqueFd fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
  int proto = ss.ss_family == AF_UNIX ? 0 : IPPROTO_TCP;
  ErrorCode ec;
  s.assign(asio::generic::stream_protocol(ss.ss_family, proto), fd.get(), ec);
  if (ec) return false;
  (void)fd.release();
  return true;
}

// An answer of the proxy's own, in the API's error shape.
ProxyDecision proxyError(int status, std::string_view code, std::string_view message) {
  ProxyDecision d;
  d.status = status;
  d.body = R"({"error":{"code":")" + std::string(code) + R"(","message":")" +
           std::string(message) + R"("}})";
  return d;
}

class ProxyConn : public std::enable_shared_from_this<ProxyConn> {
 public:
  ProxyConn(Runtime& rt, ProxyRouter router, std::shared_ptr<const ProxyOptions> opts)
      : rt_(rt),
        strand_(asio::make_strand(rt.io())),
        client_(strand_),
        up_(strand_),
        timer_(strand_),
        router_(std::move(router)),
        opts_(std::move(opts)),
        buf_(new char[kBuf]) {}

  bool start(UniqueFd sock, std::string bytes) {
    peer_ = peerOf(sock.get());
    if (!assign(client_, std::move(sock))) return false;
    auto dst = cbuf_.prepare(bytes.size());
    std::memcpy(dst.data(), bytes.data(), bytes.size());
    cbuf_.commit(bytes.size());
    ++gOpen;
    ++gConnections;
    auto self = shared_from_this();
    asio::co_spawn(strand_, [self]() -> asio::awaitable<void> { co_await self->run(); },
                   asio::detached);
    return true;
  }

 private:
  // ---- deadlines: one watchdog per connection, re-armed as `deadline_` moves.
  void deadlineIn(double s) {
    deadline_ = s > 0 ? Clock::now() + std::chrono::milliseconds(int64_t(s * 1000))
                      : Clock::time_point::max();
    // An earlier deadline than the armed one: wake the watchdog to re-arm.
    if (deadline_ < armed_) timer_.cancel();
  }
  void touch() { deadlineIn(idle_); }

  asio::awaitable<void> watchdog() {
    while (!closed_) {
      armed_ = deadline_;
      timer_.expires_at(deadline_);
      (void)co_await timer_.async_wait(kTuple);
      if (closed_) co_return;
      if (Clock::now() >= deadline_) {
        closeAll();
        co_return;
      }
    }
  }

  void closeAll() {
    closed_ = true;
    ErrorCode ec;
    client_.close(ec);
    up_.close(ec);
    timer_.cancel();
  }

  // Not a coroutine (GCC 12 mishandles init-captures of a coroutine's
  // parameters): the awaitable it returns starts the initiation when awaited.
  asio::awaitable<ProxyDecision> route(ProxyRequest pr) {
    auto self = shared_from_this();
    return asio::async_initiate<const asio::use_awaitable_t<>&, void(ProxyDecision)>(
        [self, pr = std::move(pr)](auto handler) mutable {
          using H = decltype(handler);
          auto h = std::make_shared<std::optional<H>>(std::move(handler));
          auto done = [self, h](ProxyDecision d) {
            asio::post(self->strand_, [h, d = std::make_shared<ProxyDecision>(std::move(d))]() {
              auto hh = std::move(**h);
              h->reset();
              std::move(hh)(std::move(*d));
            });
          };
          bool ok = self->rt_.runBlocking([self, pr = std::move(pr), done]() {
            ProxyDecision d;
            try {
              d = self->router_(pr);
            } catch (const std::exception& e) {
              log::error(std::string("http proxy: router threw: ") + e.what());
              d = proxyError(500, "internal", "internal error");
              d.close = true;
            }
            done(std::move(d));
          });
          if (!ok) {
            ProxyDecision d = proxyError(503, "unavailable", "server stopping");
            d.close = true;
            done(std::move(d));
          }
        },
        asio::use_awaitable);
  }

  asio::awaitable<bool> writeAll(Sock& s, std::string_view data) {
    if (data.empty()) co_return true;
    auto [ec, n] = co_await asio::async_write(s, asio::buffer(data.data(), data.size()), kTuple);
    if (ec) co_return false;
    touch();
    co_return true;
  }

  // Writes the first n bytes of buf_ to out, as one chunk if `chunk`.
  asio::awaitable<bool> writeBuf(Sock& out, size_t n, bool chunk) {
    std::string pre = chunk ? hex(n) + "\r\n" : "";
    std::array<asio::const_buffer, 3> bufs{asio::buffer(pre), asio::buffer(buf_.get(), n),
                                           asio::buffer("\r\n", chunk ? 2 : 0)};
    auto [ec, written] = co_await asio::async_write(out, bufs, kTuple);
    if (ec) co_return false;
    touch();
    co_return true;
  }

  // Sends an answer of the proxy's own. Returns whether the connection may
  // go on.
  asio::awaitable<bool> answer(const ProxyDecision& d, bool isHead, bool keep) {
    std::string head = headLine(d.status);
    appendHeader(head, "Content-Type", d.contentType);
    appendHeader(head, "Content-Length", std::to_string(d.body.size()));
    for (auto& [k, v] : d.answerHeaders) appendHeader(head, k, v);
    if (!keep) head += "Connection: close\r\n";
    head += "\r\n";
    if (!isHead) head += d.body;
    status_ = d.status;
    bool ok = co_await writeAll(client_, head);
    co_return ok && keep;
  }

  // Streams one message body from `in` (parsed by `p`) to `out`, chunked or as
  // is. false if either side failed.
  template <class Parser>
  asio::awaitable<bool> pumpBody(Sock& in, beast::flat_buffer& inbuf, Parser& p, Sock& out,
                                 bool chunk, uint64_t& counter, std::atomic<uint64_t>& global) {
    // Beast reads as much as the buffer's spare capacity: grown once, the
    // reads are up to kBuf, not a few hundred bytes each.
    if (inbuf.capacity() < kBuf) inbuf.reserve(kBuf);
    while (!p.is_done()) {
      p.get().body().data = buf_.get();
      p.get().body().size = kBuf;
      auto [ec, n] = co_await bhttp::async_read_some(in, inbuf, p, kTuple);
      if (ec == bhttp::error::need_buffer) ec = {};
      touch();
      // Bytes read before an error still go out (a cut shows where it cut).
      size_t got = kBuf - p.get().body().size;
      if (got == 0) {
        if (ec) co_return false;
        continue;
      }
      counter += got;
      global += got;
      if (!co_await writeBuf(out, got, chunk)) co_return false;
      if (ec) co_return false;
    }
    if (chunk && !co_await writeAll(out, "0\r\n\r\n")) co_return false;
    co_return true;
  }

  // Raw bytes from a to b until EOF (then a half-close of b) or an error.
  asio::awaitable<void> relay(Sock& a, Sock& b, std::atomic<uint64_t>& global) {
    std::unique_ptr<char[]> buf(new char[kBuf]);
    for (;;) {
      auto [ec, n] = co_await a.async_read_some(asio::buffer(buf.get(), kBuf), kTuple);
      if (n > 0) {
        touch();
        global += n;
        auto [wec, wn] = co_await asio::async_write(b, asio::buffer(buf.get(), n), kTuple);
        if (wec) break;
        touch();
      }
      if (ec == asio::error::eof) {
        ErrorCode e2;
        b.shutdown(asio::socket_base::shutdown_send, e2);
        co_return;
      }
      if (ec) break;
    }
    // An error (a reset, a cut): the whole connection goes.
    closeAll();
  }

  asio::awaitable<void> run() {
    auto self = shared_from_this();
    idle_ = opts_->idleTimeoutS;
    deadlineIn(opts_->headerTimeoutS);
    asio::co_spawn(strand_, [self]() -> asio::awaitable<void> { co_await self->watchdog(); },
                   asio::detached);
    bool first = true;
    while (!closed_ && co_await exchange(first)) {
      if (opts_->onExchange) opts_->onExchange(status_, upBytes_, downBytes_);
      first = false;
    }
    if (opts_->onExchange && status_ != 0) opts_->onExchange(status_, upBytes_, downBytes_);
    if (!closed_) {
      // Let the client read what was sent before the close.
      ErrorCode ec;
      client_.shutdown(asio::socket_base::shutdown_send, ec);
    }
    closeAll();
    --gOpen;
  }

  // One request and its response. Returns whether the connection goes on.
  asio::awaitable<bool> exchange(bool first) {
    status_ = 0;
    upBytes_ = downBytes_ = 0;
    bhttp::request_parser<bhttp::buffer_body> rp;
    rp.header_limit(kHeadLimit);
    rp.body_limit(boost::none);
    if (!first) {
      // Idle until the next request's first byte, then headerTimeoutS for the head.
      deadlineIn(opts_->idleTimeoutS);
      if (cbuf_.size() == 0) {
        auto [ec] = co_await client_.async_wait(asio::socket_base::wait_read, kTuple);
        if (ec) co_return false;
      }
      deadlineIn(opts_->headerTimeoutS);
    }
    {
      auto [ec, n] = co_await bhttp::async_read_header(client_, cbuf_, rp, kTuple);
      if (ec) {
        if (ec == bhttp::error::end_of_stream || ec == asio::error::eof || closed_) {
          co_return false;
        }
        co_await answer(proxyError(ec == bhttp::error::header_limit ? 431 : 400,
                                   "invalid_argument", "malformed HTTP request"),
                        false, false);
        co_return false;
      }
    }
    touch();
    ++gRequests;
    auto& req = rp.get();
    ProxyRequest pr;
    pr.method = std::string(req.method_string());
    pr.target = std::string(req.target());
    pr.version = req.version();
    for (auto& f : req) pr.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    pr.upgrade = rp.upgrade();
    pr.peer = peer_;
    pr.currentKey = upOpen_ ? upKey_ : "";
    pr.first = first;
    const bool isHead = req.method() == bhttp::verb::head;
    const bool upgrade = pr.upgrade;
    const int version = pr.version;
    const bool clientKeep = rp.keep_alive();
    const bool hasBody = rp.chunked() || (rp.content_length() && *rp.content_length() > 0);
    const bool expect100 = hasToken(pr.header("expect"), "100-continue");
    std::string connHeader = pr.header("connection");
    std::string upgradeProto = pr.header("upgrade");

    ProxyDecision d = co_await route(std::move(pr));
    // Held by this frame until the exchange (or the upgraded relay) is over.
    std::shared_ptr<void> hold = std::move(d.hold);
    if (closed_) co_return false;
    if (!d.forward) {
      // A body we will not read closes the connection.
      co_return co_await answer(d, isHead, clientKeep && !d.close && !hasBody);
    }
    if (d.upstream) {
      ErrorCode ec;
      up_.close(ec);
      ubuf_.clear();
      upOpen_ = assign(up_, std::move(d.upstream));
      upKey_ = d.key;
    }
    if (!upOpen_ || upKey_ != d.key) {
      co_return co_await answer(proxyError(502, "unavailable", "upstream connection lost"), isHead,
                                false);
    }

    // The request head, re-framed.
    std::string head = std::string(req.method_string()) + " " + d.target + " HTTP/1.1\r\n";
    for (auto& [k, v] : d.requestHeaders) {
      if (isHopByHop(k, connHeader) || asciiIEquals(k, "content-length")) continue;
      appendHeader(head, k, v);
    }
    bool chunkUp = false;
    if (rp.chunked()) {
      head += "Transfer-Encoding: chunked\r\n";
      chunkUp = true;
    } else if (rp.content_length()) {
      head += "Content-Length: " + std::to_string(*rp.content_length()) + "\r\n";
    }
    if (upgrade && !upgradeProto.empty()) {
      head += "Connection: Upgrade\r\n";
      appendHeader(head, "Upgrade", upgradeProto);
    }
    head += "\r\n";
    if (expect100 && hasBody && !co_await writeAll(client_, "HTTP/1.1 100 Continue\r\n\r\n")) {
      co_return false;
    }
    bool upOk = co_await writeAll(up_, head);
    if (upOk && hasBody) {
      // A client that fails mid-body ends the connection; an upstream that
      // fails mid-body may still have answered (413, say): read on.
      bool clientOk = true;
      if (cbuf_.capacity() < kBuf) cbuf_.reserve(kBuf);
      while (!rp.is_done()) {
        rp.get().body().data = buf_.get();
        rp.get().body().size = kBuf;
        auto [ec, n] = co_await bhttp::async_read_some(client_, cbuf_, rp, kTuple);
        if (ec == bhttp::error::need_buffer) ec = {};
        if (ec) {
          clientOk = false;
          break;
        }
        touch();
        size_t got = kBuf - rp.get().body().size;
        if (got == 0) continue;
        upBytes_ += got;
        gUp += got;
        if (!upOk) continue;  // drain the client's body
        upOk = co_await writeBuf(up_, got, chunkUp);
      }
      if (!clientOk) co_return false;
      if (upOk && chunkUp) upOk = co_await writeAll(up_, "0\r\n\r\n");
    }

    // The response head, skipping interim 1xx answers other than 101.
    std::optional<bhttp::response_parser<bhttp::buffer_body>> up;
    int status = 0;
    for (;;) {
      up.emplace();
      up->header_limit(kHeadLimit);
      up->body_limit(boost::none);
      if (isHead) up->skip(true);
      auto [ec, n] = co_await bhttp::async_read_header(up_, ubuf_, *up, kTuple);
      if (ec) {
        upOpen_ = false;
        if (closed_) co_return false;
        co_return co_await answer(
            proxyError(502, "unavailable",
                       "the sandbox's server closed the connection without answering"),
            isHead, false);
      }
      touch();
      status = up->get().result_int();
      if (status >= 100 && status < 200 && status != 101) {
        // Its body-less message is parsed; drop it and read the real one.
        continue;
      }
      break;
    }
    status_ = status;
    auto& res = up->get();
    std::string upConn;
    for (auto& f : res) {
      if (asciiIEquals(f.name_string(), "connection")) upConn += std::string(f.value()) + ",";
    }
    std::string out = headLine(status);
    auto replaced = [&](std::string_view k) {
      for (auto& [rk, rv] : d.responseHeaders) {
        if (asciiIEquals(rk, k)) return true;
      }
      return false;
    };

    if (status == 101) {
      if (!upgrade) {
        co_return co_await answer(
            proxyError(502, "unavailable", "the sandbox's server switched protocols unasked"),
            isHead, false);
      }
      for (auto& f : res) {
        std::string_view k = f.name_string();
        if (replaced(k)) continue;
        if (isHopByHop(k, upConn) && !asciiIEquals(k, "upgrade")) continue;
        appendHeader(out, k, f.value());
      }
      for (auto& [k, v] : d.responseHeaders) appendHeader(out, k, v);
      out += "Connection: Upgrade\r\n\r\n";
      if (!co_await writeAll(client_, out)) co_return false;
      // What each parser read past the heads belongs to the other side.
      if (ubuf_.size() > 0) {
        std::string rest(static_cast<const char*>(ubuf_.data().data()), ubuf_.size());
        ubuf_.consume(ubuf_.size());
        if (!co_await writeAll(client_, rest)) co_return false;
      }
      if (cbuf_.size() > 0) {
        std::string rest(static_cast<const char*>(cbuf_.data().data()), cbuf_.size());
        cbuf_.consume(cbuf_.size());
        if (!co_await writeAll(up_, rest)) co_return false;
      }
      idle_ = opts_->upgradedIdleTimeoutS;
      touch();
      co_await (relay(client_, up_, gUp) && relay(up_, client_, gDown));
      co_return false;
    }

    const bool noBody = isHead || status == 204 || status == 304 || (status >= 100 && status < 200);
    const bool closeDelimited = !noBody && !up->chunked() && !up->content_length();
    bool keep = clientKeep && !d.close && version >= 11;
    bool chunkDown = false;
    for (auto& f : res) {
      std::string_view k = f.name_string();
      if (replaced(k) || isHopByHop(k, upConn)) continue;
      if (asciiIEquals(k, "content-length") && !noBody) continue;
      appendHeader(out, k, f.value());
    }
    for (auto& [k, v] : d.responseHeaders) appendHeader(out, k, v);
    if (!noBody) {
      if (up->content_length()) {
        out += "Content-Length: " + std::to_string(*up->content_length()) + "\r\n";
      } else if (version >= 11) {
        out += "Transfer-Encoding: chunked\r\n";
        chunkDown = true;
      } else {
        keep = false;
      }
    }
    if (!keep) out += "Connection: close\r\n";
    out += "\r\n";
    if (!co_await writeAll(client_, out)) co_return false;
    if (!noBody) {
      bool ok = co_await pumpBody(up_, ubuf_, *up, client_, chunkDown, downBytes_, gDown);
      if (!ok) {
        // Cut mid-body: the client must not take a truncated body for whole.
        upOpen_ = false;
        closeAll();
        co_return false;
      }
    }
    // An idle kept-alive connection holds no big buffer.
    if (cbuf_.size() == 0) cbuf_.shrink_to_fit();
    if (ubuf_.size() == 0) ubuf_.shrink_to_fit();
    if (closeDelimited || !up->keep_alive() || !upOk) {
      ErrorCode ec;
      up_.close(ec);
      ubuf_.clear();
      upOpen_ = false;
    }
    co_return keep;
  }

  Runtime& rt_;
  Strand strand_;
  Sock client_;
  Sock up_;
  Timer timer_;
  ProxyRouter router_;
  std::shared_ptr<const ProxyOptions> opts_;
  std::unique_ptr<char[]> buf_;
  beast::flat_buffer cbuf_;
  beast::flat_buffer ubuf_;
  std::string peer_;
  std::string upKey_;
  bool upOpen_ = false;
  bool closed_ = false;
  double idle_ = 300;
  Clock::time_point deadline_ = Clock::time_point::max();
  Clock::time_point armed_ = Clock::time_point::max();
  int status_ = 0;
  uint64_t upBytes_ = 0;
  uint64_t downBytes_ = 0;
};

}  // namespace

std::string ProxyRequest::header(std::string_view name) const {
  for (auto& [k, v] : headers) {
    if (asciiIEquals(k, name)) return v;
  }
  return "";
}

bool isHopByHop(std::string_view name, std::string_view connectionHeader) {
  static constexpr std::string_view kHop[] = {
      "connection", "keep-alive", "proxy-connection", "te",     "trailer",
      "transfer-encoding", "upgrade", "expect", "proxy-authenticate", "proxy-authorization"};
  for (auto h : kHop) {
    if (asciiIEquals(name, h)) return true;
  }
  return !connectionHeader.empty() && hasToken(connectionHeader, name);
}

void serveProxy(UniqueFd sock, std::string bytes, ProxyRouter router,
                std::shared_ptr<const ProxyOptions> opts) {
  Runtime& rt = opts->runtime ? *opts->runtime : Runtime::global();
  auto c = std::make_shared<ProxyConn>(rt, std::move(router), std::move(opts));
  if (!c->start(std::move(sock), std::move(bytes))) log::warn("http proxy: cannot take a socket");
}

ProxyStats proxyStats() {
  return ProxyStats{gOpen.load(), gConnections.load(), gRequests.load(), gUp.load(), gDown.load()};
}

}  // namespace dsec::http
