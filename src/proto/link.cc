#include "proto/link.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <vector>

#include "common/frame.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/util.h"

namespace dsec::proto {

namespace asio = boost::asio;
using json = nlohmann::json;

namespace {

constexpr size_t kFrameData = 64u << 10;    // data bytes per frame (the unit of interleaving)
constexpr size_t kWriteBatch = 256u << 10;  // bytes gathered for one socket write
constexpr size_t kReadBuffer = 256u << 10;
constexpr size_t kMaxUpgradeAnswer = 16u << 10;
// Control frames are not flow controlled (calls, ends, replies, windows,
// pongs); a peer that stops reading while they pile up is dropped here.
constexpr size_t kMaxControlBytes = 256u << 20;
constexpr size_t kMaxMethod = 255;
constexpr double kCloseLingerS = 2;  // after our FIN, how long we wait for the peer's

uint8_t ft(LinkFrame f) { return static_cast<uint8_t>(f); }

void putU32(std::string& out, uint32_t v) {
  char b[4] = {char(v & 0xff), char((v >> 8) & 0xff), char((v >> 16) & 0xff),
               char((v >> 24) & 0xff)};
  out.append(b, 4);
}
uint32_t getU32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return uint32_t(u[0]) | (uint32_t(u[1]) << 8) | (uint32_t(u[2]) << 16) | (uint32_t(u[3]) << 24);
}
std::string u32Payload(uint32_t v) {
  std::string s;
  putU32(s, v);
  return s;
}

double mono() { return monoSeconds(); }

// kError payload: u8 code, i32 errno, u16 field length, field, message.
std::string encodeStatus(const Status& st) {
  std::string out;
  out.push_back(char(static_cast<uint8_t>(st.code())));
  putU32(out, uint32_t(st.sysErrno()));
  size_t fl = std::min<size_t>(st.field().size(), 0xffff);
  out.push_back(char(fl & 0xff));
  out.push_back(char(fl >> 8));
  out.append(st.field().data(), fl);
  out.append(st.message());
  return out;
}

Status decodeStatus(std::string_view p) {
  if (p.size() < 7) return Status(Code::kInternal, "link: malformed error frame");
  int code = static_cast<uint8_t>(p[0]);
  int err = int(getU32(p.data() + 1));
  size_t fl = size_t(static_cast<uint8_t>(p[5])) | (size_t(static_cast<uint8_t>(p[6])) << 8);
  if (p.size() < 7 + fl) return Status(Code::kInternal, "link: malformed error frame");
  if (code <= 0 || code > static_cast<int>(Code::kRateLimited)) code = int(Code::kInternal);
  return Status(static_cast<Code>(code), std::string(p.substr(7 + fl)), err,
                std::string(p.substr(7, fl)));
}

void appendLenPrefixed(std::string& out, std::string_view part) {
  putU32(out, uint32_t(part.size()));
  out.append(part.data(), part.size());
}

// HMAC-SHA256(key, label | helloC | helloS), hex.
std::string proofOf(const std::string& key, std::string_view label, std::string_view helloC,
                    std::string_view helloS) {
  std::string msg;
  appendLenPrefixed(msg, label);
  appendLenPrefixed(msg, helloC);
  appendLenPrefixed(msg, helloS);
  return hmacSha256Hex(key, msg);
}

constexpr std::string_view kClientLabel = "dsec-link/1 client";
constexpr std::string_view kServerLabel = "dsec-link/1 server";

bool proofMatches(const std::string& want, const std::string& got) {
  return !want.empty() && want.size() == got.size() &&
         CRYPTO_memcmp(want.data(), got.data(), want.size()) == 0;
}

Status unavailable(std::string msg) { return Status(Code::kUnavailable, std::move(msg)); }

bool blockingRefused(Runtime& rt, Status* st) {
  if (!rt.onIoThread()) return false;
  // A blocking helper on an io thread would stall every connection it serves.
  log::error("link: a blocking call was made on an io thread (refused)");
  *st = Status(Code::kFailedPrecondition, "link: blocking call on an io thread");
  return true;
}

}  // namespace

std::string linkUpgradeResponse() {
  return "HTTP/1.1 101 Switching Protocols\r\nUpgrade: " + std::string(kLinkProtocol) +
         "\r\nConnection: Upgrade\r\n\r\n";
}

class Conn;

// What a connection reports to the client or server that made it. Called on
// the connection's strand, never with its mutex held.
class ConnOwner {
 public:
  virtual ~ConnOwner() = default;
  virtual void connReady(const std::shared_ptr<Conn>&) {}
  virtual void connClosed(const std::shared_ptr<Conn>&, const Status&, bool /*wasReady*/) {}
  virtual void connDraining(const std::shared_ptr<Conn>&) {}
  virtual Result<std::string> keyFor(const std::string&) {
    return Status(Code::kUnauthenticated, "no keys");
  }
  virtual void dispatch(std::shared_ptr<ServerCall>) {}
  virtual void authFailed() {}
};

// One call, client or server side. Every member below the constants is
// guarded by conn_->mu_ (a call without a connection is immutable).
class Stream final : public ClientCall,
                     public ServerCall,
                     public std::enable_shared_from_this<Stream> {
 public:
  Stream(std::shared_ptr<Conn> conn, bool client) : client_(client), conn_(std::move(conn)) {}
  // A client call that failed before it had a connection.
  explicit Stream(Status failed) : client_(true), done_(true) { end_ = std::move(failed); }

  // ClientCall and ServerCall.
  Status send(std::string_view bytes) override;
  Status end() override;
  void consumed(size_t n) override;
  Status write(std::string_view bytes, double timeoutS) override;
  Result<size_t> read(char* buf, size_t n, double timeoutS) override;
  // ClientCall.
  void cancel(Status why) override;
  bool done() const override;
  Result<std::string> wait(double timeoutS) override;
  // ServerCall.
  const std::string& method() const override { return method_; }
  const std::string& args() const override { return args_; }
  const std::string& peer() const override;
  Status event(std::string_view payload) override;
  Status reply(std::string_view payload) override;
  Status fail(const Status& st) override;
  void onCancel(std::function<void(const Status&)> cb) override;
  void onWritable(std::function<void()> cb) override;
  void onData(std::function<void(std::string_view)> data, std::function<void()> end,
              bool manualCredit) override;
  bool cancelled() const override;
  size_t queuedBytes() const override;
  Status writeEvent(std::string_view payload, double timeoutS) override;

 private:
  friend class Conn;
  friend class LinkClient;
  struct OutItem {
    uint8_t type;
    std::string payload;
  };

  // Why sends fail now, or ok. Locked.
  Status sendRefusalLocked(bool data) const;
  Status queueLocked(uint8_t type, std::string_view payload, std::unique_lock<std::mutex>& lk,
                     bool* refused);
  Status writeBlocking(uint8_t type, std::string_view bytes, double timeoutS);
  bool sendableLocked() const;
  bool hasOutLocked() const { return outHead_ < out_.size(); }
  void dropOutLocked();
  std::condition_variable& cvLocked() {
    if (!cv_) cv_ = std::make_unique<std::condition_variable>();
    return *cv_;
  }
  void notifyLocked() {
    if (cv_) cv_->notify_all();
  }
  Status failedStatusLocked() const {
    if (!end_.isOk()) return end_;
    return Status(Code::kFailedPrecondition, "link: the call is over");
  }

  const bool client_;
  const std::shared_ptr<Conn> conn_;
  uint32_t id_ = 0;
  std::string method_, args_;  // server: immutable after dispatch
  CallHandler handler_;        // client: touched only on the strand after start
  // Outgoing.
  std::vector<OutItem> out_;
  size_t outHead_ = 0, outOff_ = 0;
  size_t outBytes_ = 0;  // data and event bytes in out_
  int64_t sendWindow_ = 0;
  bool inRing_ = false, callSent_ = false, localEnded_ = false, wantWritable_ = false;
  // Incoming.
  int64_t recvAllowed_ = 0;  // bytes the peer may still send
  size_t unacked_ = 0;       // consumed, not yet granted back
  bool manualCredit_ = false;
  std::string inBuf_;
  size_t inOff_ = 0;
  bool peerEnded_ = false, endDelivered_ = false, redelivering_ = false, keptReply_ = false;
  // Over: client: the outcome is known; server: replied, failed or cancelled.
  bool done_ = false;
  bool cancelled_ = false;
  // Client: the failure the call ended with; server: why it was cancelled.
  Status end_;
  std::string reply_;  // client: the reply, kept for wait() when onDone is unset
  std::unique_ptr<std::condition_variable> cv_;  // blocking helpers wait here (with mu_)
  // Server callbacks (shared so they can be called without the lock).
  std::shared_ptr<std::function<void(const Status&)>> onCancel_;
  std::shared_ptr<std::function<void()>> onWritable_;
  std::shared_ptr<std::function<void(std::string_view)>> onData_;
  std::shared_ptr<std::function<void()>> onEnd_;
};

// One link connection, either role. Socket, decoder and handshake state live
// on the strand; what API calls from other threads touch is guarded by mu_.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  static LinkOptions sane(LinkOptions o) {
    // The peer refuses a window that cannot carry one event.
    o.initialWindow = std::clamp<uint32_t>(o.initialWindow, kMaxEventPayload, 1u << 30);
    o.callSendBuffer = std::max<size_t>(o.callSendBuffer, 1);
    o.connSendBuffer = std::max<size_t>(o.connSendBuffer, o.callSendBuffer);
    return o;
  }
  enum class Role { kClient, kServer };
  Conn(Runtime& rt, Role role, const LinkOptions& opts, std::weak_ptr<ConnOwner> owner)
      : rt_(rt),
        role_(role),
        opts_(sane(opts)),
        owner_(std::move(owner)),
        strand_(asio::make_strand(rt.io())),
        sock_(strand_),
        tcp_(strand_),
        resolver_(strand_) {}

  void connect(std::string host, uint16_t port, std::string node, std::string key);
  void adopt(UniqueFd fd, std::string buffered);
  // Opens a client call on this connection (waits in it until ready).
  void attach(const std::shared_ptr<Stream>& s, std::string_view method, std::string_view args);
  // Drops the connection: every call in flight fails (client: kUnavailable
  // with st's message unless the handshake never finished; server: cancelled).
  void fail(Status st);
  void goAway();
  bool closed() const {
    std::lock_guard lk(mu_);
    return closed_;
  }
  bool ready() const {
    std::lock_guard lk(mu_);
    return ready_ && !closed_;
  }
  size_t calls() const {
    std::lock_guard lk(mu_);
    return streams_.size();
  }
  const std::string& peerNode() const { return peerNode_; }

 private:
  friend class Stream;
  enum class Hs { kAwaitHello, kAwaitAuth, kAwaitReady, kReady, kRefused };

  void afterConnect();
  void readUpgradeAnswer();
  void startHandshakeTimer();
  void readLoop();
  void onRead(const boost::system::error_code& ec, size_t n);
  bool feed(const char* data, size_t n);
  // false: the connection failed.
  bool handleFrame(Frame& f);
  bool handshakeFrame(Frame& f);
  void becomeReady();
  void armPing();
  void tick();
  void flush();
  void onWritten(const boost::system::error_code& ec);
  void closeSocket();

  // Locked helpers.
  void ctrlLocked(LinkFrame type, uint32_t stream, std::string_view payload);
  void requestFlushLocked();
  void ringLocked(Stream* s);
  bool canAcceptLocked(const Stream* s) const {
    return s->outBytes_ < opts_.callSendBuffer && queued_ < opts_.connSendBuffer;
  }
  void creditLocked(Stream* s, size_t n);
  void removeLocked(Stream* s);
  bool idleLocked() const {
    return streams_.empty() && ring_.empty() && ctrl_.empty() && !writing_;
  }
  std::shared_ptr<Stream> findLocked(uint32_t id) {
    auto it = streams_.find(id);
    return it == streams_.end() ? nullptr : it->second;
  }
  // Finishes a client call with its outcome; the callback (if any) is
  // returned to be run on the strand without the lock.
  std::function<void()> finishClientLocked(Stream* s, Result<std::string> outcome);
  std::function<void()> cancelServerLocked(Stream* s, const Status& why);
  void runOnStrand(std::function<void()> fn) { asio::dispatch(strand_, std::move(fn)); }
  void closeWhenIdleLocked();

  Runtime& rt_;
  const Role role_;
  const LinkOptions opts_;
  std::weak_ptr<ConnOwner> owner_;
  asio::strand<asio::io_context::executor_type> strand_;

  // Strand only.
  asio::posix::stream_descriptor sock_;
  asio::ip::tcp::socket tcp_;  // client: used to connect, then handed to sock_
  asio::ip::tcp::resolver resolver_;
  std::string host_, key_, node_;
  uint16_t port_ = 0;
  std::string upgradeAnswer_;
  std::vector<char> rbuf_;
  std::string wbuf_;
  FrameDecoder dec_;
  Hs hs_ = Hs::kAwaitHello;
  std::string helloC_, helloS_;
  std::string peerNode_;  // server: the authenticated node (immutable once ready)
  double lastRecv_ = 0;
  double writeStart_ = 0;
  bool halfClosed_ = false;
  std::shared_ptr<Runtime::Timer> hsTimer_, pingTimer_, lingerTimer_;

  mutable std::mutex mu_;  // guards everything below, and every Stream's state
  bool ready_ = false, closed_ = false, wasReady_ = false;
  Status closeStatus_;
  uint32_t peerWindow_ = 0;
  uint32_t nextId_ = 1;      // client: the next stream id
  uint32_t lastPeerId_ = 0;  // server: the highest stream id seen
  std::unordered_map<uint32_t, std::shared_ptr<Stream>> streams_;
  std::deque<std::shared_ptr<Stream>> ring_;      // calls with frames to send, round robin
  std::vector<std::shared_ptr<Stream>> waiters_;  // calls told to wait for room
  std::string ctrl_;                              // encoded frames sent before any call's
  size_t queued_ = 0;                             // data and event bytes queued in all calls
  bool writing_ = false, flushPosted_ = false;
  bool goawaySent_ = false, goawayRecv_ = false;
};

// ---- Conn: setting up --------------------------------------------------------

void Conn::connect(std::string host, uint16_t port, std::string node, std::string key) {
  auto self = shared_from_this();
  asio::dispatch(strand_, [self, host = std::move(host), port, node = std::move(node),
                           key = std::move(key)]() mutable {
    self->host_ = std::move(host);
    self->port_ = port;
    self->node_ = std::move(node);
    self->key_ = std::move(key);
    self->startHandshakeTimer();
    if (self->key_.empty()) {
      self->fail(Status(Code::kUnauthenticated, "link: no key for node " + self->node_));
      return;
    }
    boost::system::error_code aec;
    auto addr = asio::ip::make_address(self->host_, aec);
    if (!aec) {
      // An address: no resolver (whose first use starts a thread of its own).
      self->tcp_.async_connect(
          asio::ip::tcp::endpoint(addr, self->port_), [self](const boost::system::error_code& ec) {
            if (ec) {
              self->fail(unavailable("connect to " + self->host_ + ":" +
                                     std::to_string(self->port_) + ": " + ec.message()));
              return;
            }
            self->afterConnect();
          });
      return;
    }
    self->resolver_.async_resolve(
        self->host_, std::to_string(port),
        [self](const boost::system::error_code& ec,
               const asio::ip::tcp::resolver::results_type& results) {
          if (ec) {
            self->fail(unavailable("resolve " + self->host_ + ": " + ec.message()));
            return;
          }
          asio::async_connect(
              self->tcp_, results,
              [self](const boost::system::error_code& ec2, const asio::ip::tcp::endpoint&) {
                if (ec2) {
                  self->fail(unavailable("connect to " + self->host_ + ":" +
                                         std::to_string(self->port_) + ": " + ec2.message()));
                  return;
                }
                self->afterConnect();
              });
        });
  });
}

void Conn::afterConnect() {
  if (closed()) return;
  boost::system::error_code ec;
  tcp_.set_option(asio::ip::tcp::no_delay(true), ec);
  int fd = tcp_.release(ec);
  if (ec) {
    fail(unavailable("connect: " + ec.message()));
    return;
  }
  sock_.assign(fd, ec);
  if (ec) {
    ::close(fd);
    fail(unavailable("connect: " + ec.message()));
    return;
  }
  // The hello rides behind the upgrade request: one round trip saved; the
  // server's HTTP layer hands what it read past the request to adopt().
  json hello = {
      {"v", 1}, {"node", node_}, {"nonce", randomHex(32)}, {"window", opts_.initialWindow}};
  helloC_ = hello.dump();
  std::string req = "GET " + std::string(kLinkPath) + " HTTP/1.1\r\nHost: " + host_ + ":" +
                    std::to_string(port_) + "\r\nUpgrade: " + std::string(kLinkProtocol) +
                    "\r\nConnection: Upgrade\r\n\r\n";
  appendFrame(req, 0, ft(LinkFrame::kHello), helloC_);
  wbuf_ = std::move(req);
  {
    std::lock_guard lk(mu_);
    writing_ = true;
    writeStart_ = mono();
  }
  auto self = shared_from_this();
  asio::async_write(sock_, asio::buffer(wbuf_),
                    [self](const boost::system::error_code& ec2, size_t) { self->onWritten(ec2); });
  rbuf_.resize(kReadBuffer);
  readUpgradeAnswer();
}

void Conn::readUpgradeAnswer() {
  auto self = shared_from_this();
  sock_.async_read_some(asio::buffer(rbuf_), [self](const boost::system::error_code& ec, size_t n) {
    if (ec) {
      self->fail(
          unavailable("link upgrade: " +
                      (ec == asio::error::eof ? std::string("connection closed") : ec.message())));
      return;
    }
    self->lastRecv_ = mono();
    self->upgradeAnswer_.append(self->rbuf_.data(), n);
    size_t endHdr = self->upgradeAnswer_.find("\r\n\r\n");
    if (endHdr == std::string::npos) {
      if (self->upgradeAnswer_.size() > kMaxUpgradeAnswer) {
        self->fail(unavailable("link upgrade: answer header too long"));
        return;
      }
      self->readUpgradeAnswer();
      return;
    }
    std::string head = self->upgradeAnswer_.substr(0, endHdr);
    std::string rest = self->upgradeAnswer_.substr(endHdr + 4);
    self->upgradeAnswer_.clear();
    // "HTTP/1.1 101 ..."
    int status = 0;
    size_t sp = head.find(' ');
    if (sp != std::string::npos) status = std::atoi(head.c_str() + sp + 1);
    if (status != 101) {
      std::string line = head.substr(0, head.find("\r\n"));
      Code code = (status == 401 || status == 403) ? Code::kUnauthenticated : Code::kUnavailable;
      self->fail(Status(code, "link upgrade refused: " + line));
      return;
    }
    if (!rest.empty() && !self->feed(rest.data(), rest.size())) return;
    self->flush();
    self->readLoop();
  });
}

void Conn::adopt(UniqueFd fd, std::string buffered) {
  auto self = shared_from_this();
  int raw = fd.release();
  asio::dispatch(strand_, [self, raw, buffered = std::move(buffered)] {
    if (self->closed()) {  // the server closed before this ran
      ::close(raw);
      return;
    }
    int one = 1;
    (void)::setsockopt(raw, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // not TCP: harmless
    boost::system::error_code ec;
    self->sock_.assign(raw, ec);
    if (ec) {
      ::close(raw);
      self->fail(unavailable("adopt: " + ec.message()));
      return;
    }
    self->startHandshakeTimer();
    self->rbuf_.resize(kReadBuffer);
    self->lastRecv_ = mono();
    if (!buffered.empty() && !self->feed(buffered.data(), buffered.size())) return;
    self->flush();
    self->readLoop();
  });
}

void Conn::startHandshakeTimer() {
  std::weak_ptr<Conn> weak = shared_from_this();
  double limit = opts_.handshakeTimeoutS;
  hsTimer_ = rt_.after(limit, [weak, limit] {
    if (auto self = weak.lock()) {
      asio::dispatch(self->strand_, [self, limit] {
        if (self->hs_ != Hs::kReady) {
          self->fail(unavailable("link handshake did not finish within " +
                                 std::to_string(int(limit)) + " s"));
        }
      });
    }
  });
}

// ---- Conn: reading -------------------------------------------------------------

void Conn::readLoop() {
  auto self = shared_from_this();
  sock_.async_read_some(asio::buffer(rbuf_), [self](const boost::system::error_code& ec, size_t n) {
    self->onRead(ec, n);
  });
}

void Conn::onRead(const boost::system::error_code& ec, size_t n) {
  if (ec) {
    if (ec == asio::error::operation_aborted) return;
    Status st;
    {
      std::lock_guard lk(mu_);
      st = closeStatus_;  // a goaway's or handshake failure's close, if any
    }
    if (st.isOk() || !halfClosed_) {
      st = unavailable(ec == asio::error::eof ? "link closed by the peer"
                                              : "link read: " + ec.message());
    }
    fail(st);
    return;
  }
  lastRecv_ = mono();
  if (!feed(rbuf_.data(), n)) return;
  flush();
  if (!closed()) readLoop();
}

bool Conn::feed(const char* data, size_t n) {
  Status st = dec_.feed(data, n);
  if (!st.isOk()) {
    fail(unavailable("link protocol error: " + st.message()));
    return false;
  }
  Frame f;
  while (dec_.next(f)) {
    if (!handleFrame(f)) return false;
  }
  return true;
}

bool Conn::handshakeFrame(Frame& f) {
  auto type = static_cast<LinkFrame>(f.rawType());
  auto refuse = [&](Status st) {
    // Server: tell the client why, then close once that is written.
    if (role_ == Role::kServer) {
      if (auto o = owner_.lock()) o->authFailed();
      {
        std::lock_guard lk(mu_);
        ctrlLocked(LinkFrame::kError, 0, encodeStatus(st));
        closeStatus_ = st;
      }
      hs_ = Hs::kRefused;  // what else comes is dropped unread
      halfClosed_ = true;  // read until the peer closes (or the linger ends)
      std::weak_ptr<Conn> weak = shared_from_this();
      lingerTimer_ = rt_.after(kCloseLingerS, [weak, st] {
        if (auto self = weak.lock()) self->fail(st);
      });
      return true;
    }
    fail(st);
    return false;
  };
  if (hs_ == Hs::kRefused) return true;
  if (f.stream != 0) return refuse(Status(Code::kUnauthenticated, "link: call before handshake"));
  if (role_ == Role::kClient && type == LinkFrame::kError) {
    fail(decodeStatus(f.payload));
    return false;
  }
  switch (hs_) {
    case Hs::kAwaitHello: {
      if (type != LinkFrame::kHello) {
        return refuse(Status(Code::kUnauthenticated, "link: expected hello"));
      }
      json j = json::parse(f.payload, nullptr, false);
      if (j.is_discarded() || !j.is_object() || j.value("v", 0) != 1 || !j.contains("nonce") ||
          !j["nonce"].is_string() || j["nonce"].get<std::string>().size() < 32 ||
          !j.contains("window") || !j["window"].is_number_unsigned()) {
        return refuse(Status(Code::kUnauthenticated, "link: malformed hello"));
      }
      uint64_t w = j["window"].get<uint64_t>();
      if (w < kMaxEventPayload || w > (1u << 30)) {
        return refuse(Status(Code::kUnauthenticated, "link: hello window out of range"));
      }
      {
        std::lock_guard lk(mu_);
        peerWindow_ = uint32_t(w);
      }
      if (role_ == Role::kServer) {
        if (!j.contains("node") || !j["node"].is_string()) {
          return refuse(Status(Code::kUnauthenticated, "link: hello names no node"));
        }
        peerNode_ = j["node"].get<std::string>();
        auto o = owner_.lock();
        Result<std::string> key =
            o ? o->keyFor(peerNode_) : Result<std::string>(unavailable("server closed"));
        if (!key.isOk() || key->empty()) {
          return refuse(
              Status(Code::kUnauthenticated, "link: no key for node '" + peerNode_ + "'"));
        }
        key_ = *key;
        helloC_ = f.payload;
        json hello = {{"v", 1}, {"nonce", randomHex(32)}, {"window", opts_.initialWindow}};
        helloS_ = hello.dump();
        std::lock_guard lk(mu_);
        ctrlLocked(LinkFrame::kHello, 0, helloS_);
        hs_ = Hs::kAwaitAuth;
        return true;
      }
      helloS_ = f.payload;
      json auth = {{"proof", proofOf(key_, kClientLabel, helloC_, helloS_)}};
      std::lock_guard lk(mu_);
      ctrlLocked(LinkFrame::kAuth, 0, auth.dump());
      hs_ = Hs::kAwaitReady;
      return true;
    }
    case Hs::kAwaitAuth: {  // server
      if (type != LinkFrame::kAuth) {
        return refuse(Status(Code::kUnauthenticated, "link: expected auth"));
      }
      json j = json::parse(f.payload, nullptr, false);
      std::string got =
          (!j.is_discarded() && j.is_object() && j.contains("proof") && j["proof"].is_string())
              ? j["proof"].get<std::string>()
              : "";
      if (!proofMatches(proofOf(key_, kClientLabel, helloC_, helloS_), got)) {
        return refuse(Status(Code::kUnauthenticated,
                             "link: the client's proof does not check (wrong key or a replay)"));
      }
      json ready = {{"proof", proofOf(key_, kServerLabel, helloC_, helloS_)}};
      {
        std::lock_guard lk(mu_);
        ctrlLocked(LinkFrame::kReady, 0, ready.dump());
      }
      becomeReady();
      return true;
    }
    case Hs::kAwaitReady: {  // client
      if (type != LinkFrame::kReady) {
        return refuse(Status(Code::kUnauthenticated, "link: expected ready"));
      }
      json j = json::parse(f.payload, nullptr, false);
      std::string got =
          (!j.is_discarded() && j.is_object() && j.contains("proof") && j["proof"].is_string())
              ? j["proof"].get<std::string>()
              : "";
      if (!proofMatches(proofOf(key_, kServerLabel, helloC_, helloS_), got)) {
        return refuse(Status(Code::kUnauthenticated,
                             "link: the node's proof does not check (wrong key or a replay)"));
      }
      becomeReady();
      return true;
    }
    case Hs::kReady:
    case Hs::kRefused:
      break;
  }
  return true;
}

void Conn::becomeReady() {
  hs_ = Hs::kReady;
  key_.clear();
  if (hsTimer_) hsTimer_->cancel();
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
    ready_ = wasReady_ = true;
    // The calls that waited for the handshake, in the order they were made
    // (the server wants stream ids increasing).
    std::vector<Stream*> waiting;
    for (auto& [id, s] : streams_) waiting.push_back(s.get());
    std::sort(waiting.begin(), waiting.end(),
              [](const Stream* a, const Stream* b) { return a->id_ < b->id_; });
    for (Stream* s : waiting) {
      s->sendWindow_ = peerWindow_;
      ringLocked(s);
    }
    requestFlushLocked();
  }
  armPing();
  if (auto o = owner_.lock()) o->connReady(shared_from_this());
}

void Conn::armPing() {
  std::weak_ptr<Conn> weak = shared_from_this();
  pingTimer_ = rt_.after(opts_.pingIntervalS, [weak] {
    if (auto self = weak.lock()) {
      asio::dispatch(self->strand_, [self] {
        if (self->closed()) return;
        self->tick();
        self->armPing();
      });
    }
  });
}

void Conn::tick() {
  double now = mono();
  std::unique_lock lk(mu_);
  if (closed_) return;
  if (now - lastRecv_ > opts_.pingTimeoutS) {
    lk.unlock();
    fail(unavailable("link: no word from the peer for " + std::to_string(int(now - lastRecv_)) +
                     " s"));
    return;
  }
  if (writing_ && now - writeStart_ > opts_.pingTimeoutS) {
    lk.unlock();
    fail(unavailable("link: a write made no progress for " +
                     std::to_string(int(now - writeStart_)) + " s"));
    return;
  }
  if (now - lastRecv_ >= opts_.pingIntervalS) {
    std::string p;
    putU32(p, uint32_t(now * 1000));
    ctrlLocked(LinkFrame::kPing, 0, p);
  }
}

bool Conn::handleFrame(Frame& f) {
  if (hs_ != Hs::kReady) return !closed() && handshakeFrame(f);
  auto type = static_cast<LinkFrame>(f.rawType());
  const bool server = role_ == Role::kServer;
  std::unique_lock lk(mu_);
  if (closed_) return false;
  auto protocolError = [&](const std::string& what) {
    lk.unlock();
    fail(unavailable("link protocol error: " + what));
    return false;
  };
  switch (type) {
    case LinkFrame::kPing:
      ctrlLocked(LinkFrame::kPong, 0, f.payload);
      return true;
    case LinkFrame::kPong:
      return true;
    case LinkFrame::kGoaway: {
      goawayRecv_ = true;
      closeWhenIdleLocked();
      lk.unlock();
      if (!server) {
        if (auto o = owner_.lock()) o->connDraining(shared_from_this());
      }
      return true;
    }
    case LinkFrame::kWindow: {
      if (f.payload.size() != 4) return protocolError("window frame size");
      auto s = findLocked(f.stream);
      if (!s) return true;
      s->sendWindow_ += getU32(f.payload.data());
      if (s->sendWindow_ > (int64_t(1) << 31)) return protocolError("window overflow");
      ringLocked(s.get());
      return true;
    }
    case LinkFrame::kCall: {
      if (!server) return protocolError("call frame from the server");
      if (f.stream <= lastPeerId_) return protocolError("stream id reused");
      lastPeerId_ = f.stream;
      if (f.payload.empty() || size_t(uint8_t(f.payload[0])) + 1 > f.payload.size()) {
        return protocolError("malformed call");
      }
      if (goawaySent_) {
        ctrlLocked(LinkFrame::kError, f.stream,
                   encodeStatus(unavailable("the node is going away; the call did not run")));
        return true;
      }
      if (streams_.size() >= opts_.maxCalls) {
        ctrlLocked(LinkFrame::kError, f.stream,
                   encodeStatus(Status(Code::kResourceExhausted,
                                       "link: too many calls in flight on one connection")));
        return true;
      }
      auto s = std::make_shared<Stream>(shared_from_this(), false);
      s->id_ = f.stream;
      size_t ml = uint8_t(f.payload[0]);
      s->method_.assign(f.payload, 1, ml);
      s->args_.assign(f.payload, 1 + ml);
      s->sendWindow_ = peerWindow_;
      s->recvAllowed_ = opts_.initialWindow;
      streams_.emplace(s->id_, s);
      lk.unlock();
      if (auto o = owner_.lock()) o->dispatch(s);
      return true;
    }
    case LinkFrame::kData:
    case LinkFrame::kEvent: {
      if (type == LinkFrame::kEvent && server) return protocolError("event from the client");
      auto s = findLocked(f.stream);
      if (!s || (server && s->done_)) return true;
      int64_t n = int64_t(f.payload.size());
      if (n > s->recvAllowed_) return protocolError("window exceeded");
      s->recvAllowed_ -= n;
      if (type == LinkFrame::kData && s->peerEnded_) return protocolError("data after end");
      if (type == LinkFrame::kEvent) {
        if (!s->handler_.onEvent) {
          creditLocked(s.get(), size_t(n));
          return true;
        }
        bool manual = s->manualCredit_;
        lk.unlock();
        s->handler_.onEvent(f.payload);
        if (!manual) {
          lk.lock();
          creditLocked(s.get(), size_t(n));
        }
        return true;
      }
      std::shared_ptr<std::function<void(std::string_view)>> cb;
      bool haveCb = server ? (s->onData_ != nullptr) : bool(s->handler_.onData);
      if (!haveCb || s->redelivering_) {
        s->inBuf_.append(f.payload);
        s->notifyLocked();
        return true;
      }
      if (server) cb = s->onData_;
      bool manual = s->manualCredit_;
      lk.unlock();
      if (server) {
        (*cb)(f.payload);
      } else {
        s->handler_.onData(f.payload);
      }
      if (!manual) {
        lk.lock();
        creditLocked(s.get(), size_t(n));
      }
      return true;
    }
    case LinkFrame::kEnd: {
      auto s = findLocked(f.stream);
      if (!s || (server && s->done_)) return true;
      if (s->peerEnded_) return protocolError("end twice");
      s->peerEnded_ = true;
      s->notifyLocked();
      bool haveCb = server ? (s->onData_ != nullptr) : bool(s->handler_.onData);
      if (!haveCb || s->redelivering_) return true;
      s->endDelivered_ = true;
      if (server) {
        auto cb = s->onEnd_;
        lk.unlock();
        if (cb) (*cb)();
      } else if (s->handler_.onEnd) {
        lk.unlock();
        s->handler_.onEnd();
      }
      return true;
    }
    case LinkFrame::kReply:
    case LinkFrame::kError: {
      if (server) return protocolError("reply from the client");
      auto s = findLocked(f.stream);
      if (!s) return true;
      Result<std::string> outcome = type == LinkFrame::kReply
                                        ? Result<std::string>(std::move(f.payload))
                                        : Result<std::string>(decodeStatus(f.payload));
      auto cb = finishClientLocked(s.get(), std::move(outcome));
      lk.unlock();
      if (cb) cb();
      return true;
    }
    case LinkFrame::kCancel: {
      if (!server) return protocolError("cancel from the server");
      auto s = findLocked(f.stream);
      if (!s) return true;
      auto cb = cancelServerLocked(s.get(), unavailable("the client cancelled the call"));
      lk.unlock();
      if (cb) cb();
      return true;
    }
    default:
      return protocolError("unknown frame type " + std::to_string(f.rawType()));
  }
}

// ---- Conn: locked helpers ------------------------------------------------------

void Conn::ctrlLocked(LinkFrame type, uint32_t stream, std::string_view payload) {
  appendFrame(ctrl_, stream, ft(type), payload);
  requestFlushLocked();
}

void Conn::requestFlushLocked() {
  if (writing_ || flushPosted_ || closed_) return;
  flushPosted_ = true;
  asio::post(strand_, [self = shared_from_this()] { self->flush(); });
}

void Conn::ringLocked(Stream* s) {
  if (!ready_ || s->inRing_ || !s->sendableLocked()) return;
  s->inRing_ = true;
  ring_.push_back(s->shared_from_this());
  requestFlushLocked();
}

void Conn::creditLocked(Stream* s, size_t n) {
  if (s->done_ || s->peerEnded_) return;
  s->unacked_ += n;
  if (s->unacked_ >= opts_.initialWindow / 4) {
    ctrlLocked(LinkFrame::kWindow, s->id_, u32Payload(uint32_t(s->unacked_)));
    s->recvAllowed_ += int64_t(s->unacked_);
    s->unacked_ = 0;
  }
}

void Conn::removeLocked(Stream* s) {
  auto it = streams_.find(s->id_);
  if (it != streams_.end() && it->second.get() == s) streams_.erase(it);
  closeWhenIdleLocked();
}

void Conn::closeWhenIdleLocked() {
  if ((goawaySent_ || goawayRecv_) && streams_.empty()) requestFlushLocked();
}

std::function<void()> Conn::finishClientLocked(Stream* s, Result<std::string> outcome) {
  if (s->done_) return nullptr;
  s->done_ = true;
  if (!outcome.isOk()) s->end_ = outcome.status();
  s->dropOutLocked();
  removeLocked(s);
  s->notifyLocked();
  if (!s->handler_.onDone) {
    if (outcome.isOk()) s->reply_ = std::move(*outcome);
    s->keptReply_ = true;
    return nullptr;
  }
  auto keep = s->shared_from_this();
  return [keep, outcome = std::move(outcome)]() mutable {
    auto done = std::move(keep->handler_.onDone);
    keep->handler_ = CallHandler{};  // the call's captures go now
    done(std::move(outcome));
  };
}

std::function<void()> Conn::cancelServerLocked(Stream* s, const Status& why) {
  if (s->done_) {
    // Replied or failed, not all sent yet: the rest is dropped.
    s->dropOutLocked();
    removeLocked(s);
    return nullptr;
  }
  s->done_ = true;
  s->cancelled_ = true;
  s->end_ = why;
  s->dropOutLocked();
  s->inBuf_.clear();
  s->inOff_ = 0;
  removeLocked(s);
  s->notifyLocked();
  auto cb = std::move(s->onCancel_);
  s->onData_ = nullptr;
  s->onEnd_ = nullptr;
  s->onWritable_ = nullptr;
  if (!cb) return nullptr;
  return [cb, why] { (*cb)(why); };
}

// ---- Conn: writing -------------------------------------------------------------

void Conn::flush() {
  std::vector<std::function<void()>> writable;
  {
    std::unique_lock lk(mu_);
    flushPosted_ = false;
    if (closed_ || writing_ || !sock_.is_open()) return;
    if (ctrl_.size() > kMaxControlBytes) {
      lk.unlock();
      fail(Status(Code::kUnavailable, "link: the peer does not read (control frames piled up)"));
      return;
    }
    wbuf_.clear();
    wbuf_.swap(ctrl_);
    if (hs_ == Hs::kReady) {
      while (wbuf_.size() < kWriteBatch && !ring_.empty()) {
        auto s = std::move(ring_.front());
        ring_.pop_front();
        s->inRing_ = false;
        if (s->hasOutLocked() && s->sendableLocked()) {
          auto& it = s->out_[s->outHead_];
          bool pop = true;
          auto type = static_cast<LinkFrame>(it.type);
          if (type == LinkFrame::kData) {
            size_t n = std::min({it.payload.size() - s->outOff_, kFrameData,
                                 size_t(std::max<int64_t>(s->sendWindow_, 0))});
            appendFrame(wbuf_, s->id_, it.type, std::string_view(it.payload).substr(s->outOff_, n));
            s->outOff_ += n;
            s->sendWindow_ -= int64_t(n);
            s->outBytes_ -= n;
            queued_ -= n;
            pop = s->outOff_ == it.payload.size();
          } else {
            appendFrame(wbuf_, s->id_, it.type, it.payload);
            if (type == LinkFrame::kEvent) {
              s->sendWindow_ -= int64_t(it.payload.size());
              s->outBytes_ -= it.payload.size();
              queued_ -= it.payload.size();
            } else if (type == LinkFrame::kCall) {
              s->callSent_ = true;
            } else if (type == LinkFrame::kReply || type == LinkFrame::kError) {
              removeLocked(s.get());  // the server's call is over
            }
          }
          if (pop) {
            std::string().swap(it.payload);
            s->outOff_ = 0;
            if (++s->outHead_ == s->out_.size()) {
              s->out_.clear();
              s->outHead_ = 0;
            }
          }
        }
        ringLocked(s.get());
      }
    }
    // Calls that waited for room and have it now.
    if (!waiters_.empty()) {
      std::vector<std::shared_ptr<Stream>> still;
      for (auto& s : waiters_) {
        if (s->done_ || !s->wantWritable_) continue;
        if (!canAcceptLocked(s.get())) {
          still.push_back(s);
          continue;
        }
        s->wantWritable_ = false;
        s->notifyLocked();
        if (s->client_) {
          if (s->handler_.onWritable)
            writable.push_back([s] {
              if (s->handler_.onWritable) s->handler_.onWritable();
            });
        } else if (s->onWritable_) {
          auto cb = s->onWritable_;
          writable.push_back([cb] { (*cb)(); });
        }
      }
      waiters_.swap(still);
    }
    if (wbuf_.empty()) {
      if ((goawaySent_ || goawayRecv_) && idleLocked() && !halfClosed_) {
        // Drained after a goaway: FIN, then close when the peer's comes.
        halfClosed_ = true;
        if (closeStatus_.isOk()) closeStatus_ = unavailable("link closed after goaway");
        boost::system::error_code ec;
        (void)::shutdown(sock_.native_handle(), SHUT_WR);
        (void)ec;
        std::weak_ptr<Conn> weak = shared_from_this();
        Status st = closeStatus_;
        lingerTimer_ = rt_.after(kCloseLingerS, [weak, st] {
          if (auto self = weak.lock()) self->fail(st);
        });
      }
    } else {
      writing_ = true;
      writeStart_ = mono();
    }
  }
  for (auto& cb : writable) cb();
  std::lock_guard lk(mu_);
  if (!writing_ || wbuf_.empty() || closed_) return;
  // (wbuf_ is only touched on the strand, and writing_ keeps other flushes out.)
  auto self = shared_from_this();
  asio::async_write(sock_, asio::buffer(wbuf_),
                    [self](const boost::system::error_code& ec, size_t) { self->onWritten(ec); });
}

void Conn::onWritten(const boost::system::error_code& ec) {
  if (ec) {
    if (ec != asio::error::operation_aborted) fail(unavailable("link write: " + ec.message()));
    return;
  }
  {
    std::lock_guard lk(mu_);
    writing_ = false;
    if (!closeStatus_.isOk() && role_ == Role::kServer && hs_ != Hs::kReady && ctrl_.empty()) {
      // The refusal is written: FIN, and close once the client has read it.
      (void)::shutdown(sock_.native_handle(), SHUT_WR);
      return;
    }
  }
  flush();
}

// ---- Conn: ending ----------------------------------------------------------------

void Conn::fail(Status st) {
  std::vector<std::function<void()>> callbacks;
  bool wasReady;
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
    closed_ = true;
    wasReady = wasReady_;
    if (closeStatus_.isOk() || wasReady) closeStatus_ = st;
    // Calls learn kUnavailable once the link was up; before, the reason as is
    // (kUnauthenticated for a refused handshake).
    Status forCalls = wasReady && st.code() != Code::kUnavailable ? unavailable(st.message()) : st;
    auto streams = std::move(streams_);
    streams_.clear();
    for (auto& [id, s] : streams) {
      std::function<void()> cb = role_ == Role::kClient ? finishClientLocked(s.get(), forCalls)
                                                        : cancelServerLocked(s.get(), forCalls);
      if (cb) callbacks.push_back(std::move(cb));
    }
    ring_.clear();
    waiters_.clear();
    ctrl_.clear();
    queued_ = 0;
  }
  auto self = shared_from_this();
  asio::post(strand_, [self, st, wasReady, callbacks = std::move(callbacks)] {
    self->closeSocket();
    if (auto o = self->owner_.lock()) o->connClosed(self, st, wasReady);
    for (auto& cb : callbacks) cb();
  });
}

void Conn::closeSocket() {
  if (hsTimer_) hsTimer_->cancel();
  if (pingTimer_) pingTimer_->cancel();
  if (lingerTimer_) lingerTimer_->cancel();
  boost::system::error_code ec;
  resolver_.cancel();
  tcp_.close(ec);
  sock_.close(ec);
}

void Conn::goAway() {
  std::lock_guard lk(mu_);
  if (closed_ || goawaySent_) return;
  goawaySent_ = true;
  if (ready_) ctrlLocked(LinkFrame::kGoaway, 0, "");
  closeWhenIdleLocked();
}

void Conn::attach(const std::shared_ptr<Stream>& s, std::string_view method,
                  std::string_view args) {
  std::function<void()> cb;
  {
    std::lock_guard lk(mu_);
    if (closed_) {
      cb = finishClientLocked(s.get(),
                              closeStatus_.isOk() ? unavailable("link closed") : closeStatus_);
    } else if (goawaySent_ || goawayRecv_ || nextId_ == UINT32_MAX) {
      cb = finishClientLocked(s.get(), unavailable("link draining; the call did not start"));
    } else {
      s->id_ = nextId_++;
      s->recvAllowed_ = opts_.initialWindow;
      s->sendWindow_ = peerWindow_;
      std::string p;
      p.push_back(char(method.size()));
      p.append(method);
      p.append(args);
      s->out_.push_back({ft(LinkFrame::kCall), std::move(p)});
      streams_.emplace(s->id_, s);
      ringLocked(s.get());
    }
  }
  if (cb) asio::post(strand_, std::move(cb));
}

// ---- Stream ----------------------------------------------------------------------

bool Stream::sendableLocked() const {
  if (!hasOutLocked()) return false;
  const auto& it = out_[outHead_];
  auto type = static_cast<LinkFrame>(it.type);
  if (type == LinkFrame::kData) return sendWindow_ > 0;
  if (type == LinkFrame::kEvent) return sendWindow_ >= int64_t(it.payload.size());
  return true;
}

void Stream::dropOutLocked() {
  if (conn_) conn_->queued_ -= outBytes_;
  outBytes_ = 0;
  out_.clear();
  outHead_ = outOff_ = 0;
}

const std::string& Stream::peer() const { return conn_->peerNode(); }

Status Stream::sendRefusalLocked(bool data) const {
  if (cancelled_) return end_.isOk() ? unavailable("call cancelled") : end_;
  if (done_) return failedStatusLocked();
  if (data && localEnded_) return Status(Code::kFailedPrecondition, "link: body already ended");
  return Status::ok();
}

Status Stream::queueLocked(uint8_t type, std::string_view payload,
                           std::unique_lock<std::mutex>& /*lk*/, bool* refused) {
  *refused = false;
  auto t = static_cast<LinkFrame>(type);
  bool flow = t == LinkFrame::kData || t == LinkFrame::kEvent;
  RETURN_IF_ERROR(sendRefusalLocked(t == LinkFrame::kData));
  if (flow) {
    if (payload.empty()) return Status::ok();
    if (!conn_->canAcceptLocked(this)) {
      *refused = true;
      if (!wantWritable_) {
        wantWritable_ = true;
        conn_->waiters_.push_back(shared_from_this());
      }
      return Status(Code::kResourceExhausted, "link: send buffer full; wait for writable");
    }
    outBytes_ += payload.size();
    conn_->queued_ += payload.size();
  }
  out_.push_back({type, std::string(payload)});
  conn_->ringLocked(this);
  return Status::ok();
}

Status Stream::send(std::string_view bytes) {
  if (!conn_) return end_;
  std::unique_lock lk(conn_->mu_);
  bool refused;
  return queueLocked(static_cast<uint8_t>(LinkFrame::kData), bytes, lk, &refused);
}

Status Stream::event(std::string_view payload) {
  if (client_) return Status(Code::kFailedPrecondition, "link: events go server to client");
  if (payload.size() > kMaxEventPayload) {
    return invalidArg("event", "link: event of " + std::to_string(payload.size()) +
                                   " bytes (at most " + std::to_string(kMaxEventPayload) + ")");
  }
  std::unique_lock lk(conn_->mu_);
  bool refused;
  return queueLocked(static_cast<uint8_t>(LinkFrame::kEvent), payload, lk, &refused);
}

Status Stream::end() {
  if (!conn_) return end_;
  std::unique_lock lk(conn_->mu_);
  RETURN_IF_ERROR(sendRefusalLocked(true));
  localEnded_ = true;
  out_.push_back({static_cast<uint8_t>(LinkFrame::kEnd), std::string()});
  conn_->ringLocked(this);
  return Status::ok();
}

Status Stream::reply(std::string_view payload) {
  if (client_) return Status(Code::kFailedPrecondition, "link: only the server replies");
  if (payload.size() > kMaxPayload) {
    return invalidArg("reply", "link: reply of " + std::to_string(payload.size()) +
                                   " bytes (at most 1 MiB; send a body instead)");
  }
  std::unique_lock lk(conn_->mu_);
  RETURN_IF_ERROR(sendRefusalLocked(false));
  done_ = true;
  localEnded_ = true;
  // Stays on the connection (windows still come for it) until the reply is sent.
  out_.push_back({static_cast<uint8_t>(LinkFrame::kReply), std::string(payload)});
  conn_->ringLocked(this);
  onCancel_ = nullptr;
  onData_ = nullptr;
  onEnd_ = nullptr;
  onWritable_ = nullptr;
  inBuf_.clear();
  notifyLocked();
  return Status::ok();
}

Status Stream::fail(const Status& st) {
  if (client_) return Status(Code::kFailedPrecondition, "link: only the server fails a call");
  Status sent = st.isOk() ? internalError("call failed without a reason") : st;
  std::string p = encodeStatus(sent);
  if (p.size() > kMaxPayload) return invalidArg("status", "link: error message over 1 MiB");
  std::unique_lock lk(conn_->mu_);
  RETURN_IF_ERROR(sendRefusalLocked(false));
  done_ = true;
  localEnded_ = true;
  out_.push_back({static_cast<uint8_t>(LinkFrame::kError), std::move(p)});
  conn_->ringLocked(this);
  onCancel_ = nullptr;
  onData_ = nullptr;
  onEnd_ = nullptr;
  onWritable_ = nullptr;
  inBuf_.clear();
  notifyLocked();
  return Status::ok();
}

void Stream::cancel(Status why) {
  if (!conn_ || !client_) return;
  if (why.isOk()) why = Status(Code::kDeadlineExceeded, "call cancelled");
  std::function<void()> cb;
  {
    std::lock_guard lk(conn_->mu_);
    if (done_) return;
    if (callSent_) conn_->ctrlLocked(LinkFrame::kCancel, id_, "");
    cb = conn_->finishClientLocked(this, why);
  }
  if (cb) asio::post(conn_->strand_, std::move(cb));
}

bool Stream::done() const {
  if (!conn_) return true;
  std::lock_guard lk(conn_->mu_);
  return done_;
}

bool Stream::cancelled() const {
  std::lock_guard lk(conn_->mu_);
  return cancelled_;
}

size_t Stream::queuedBytes() const {
  if (!conn_) return 0;
  std::lock_guard lk(conn_->mu_);
  return outBytes_;
}

void Stream::consumed(size_t n) {
  if (!conn_) return;
  std::lock_guard lk(conn_->mu_);
  conn_->creditLocked(this, n);
}

void Stream::onCancel(std::function<void(const Status&)> cb) {
  std::unique_lock lk(conn_->mu_);
  if (cancelled_) {
    Status why = end_;
    lk.unlock();
    cb(why);
    return;
  }
  if (done_) return;
  onCancel_ = std::make_shared<std::function<void(const Status&)>>(std::move(cb));
}

void Stream::onWritable(std::function<void()> cb) {
  std::lock_guard lk(conn_->mu_);
  if (done_) return;
  onWritable_ = std::make_shared<std::function<void()>>(std::move(cb));
}

void Stream::onData(std::function<void(std::string_view)> data, std::function<void()> end,
                    bool manualCredit) {
  std::lock_guard lk(conn_->mu_);
  if (done_) return;
  onData_ =
      data ? std::make_shared<std::function<void(std::string_view)>>(std::move(data)) : nullptr;
  onEnd_ = end ? std::make_shared<std::function<void()>>(std::move(end)) : nullptr;
  manualCredit_ = manualCredit;
  if (!onData_ || redelivering_ || (inBuf_.size() == inOff_ && !peerEnded_)) return;
  // Hand over what arrived before, on the strand, ahead of anything newer.
  redelivering_ = true;
  auto self = shared_from_this();
  asio::post(conn_->strand_, [self] {
    auto& mu = self->conn_->mu_;
    for (;;) {
      std::unique_lock lk(mu);
      if (self->done_ || !self->onData_) {
        self->redelivering_ = false;
        return;
      }
      std::string chunk = self->inBuf_.substr(self->inOff_);
      self->inBuf_.clear();
      self->inOff_ = 0;
      auto cb = self->onData_;
      bool manual = self->manualCredit_;
      if (chunk.empty()) {
        self->redelivering_ = false;
        if (self->peerEnded_ && !self->endDelivered_) {
          self->endDelivered_ = true;
          auto endCb = self->onEnd_;
          lk.unlock();
          if (endCb) (*endCb)();
        }
        return;
      }
      lk.unlock();
      (*cb)(chunk);
      if (!manual) {
        lk.lock();
        self->conn_->creditLocked(self.get(), chunk.size());
      }
    }
  });
}

Status Stream::writeBlocking(uint8_t type, std::string_view bytes, double timeoutS) {
  if (!conn_) return end_;
  Status st;
  if (blockingRefused(conn_->rt_, &st)) return st;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::microseconds(int64_t(std::max(0.0, timeoutS) * 1e6));
  std::unique_lock lk(conn_->mu_);
  size_t off = 0;
  bool event = static_cast<LinkFrame>(type) == LinkFrame::kEvent;
  while (off < bytes.size()) {
    size_t n = event ? bytes.size() : std::min(bytes.size() - off, conn_->opts_.callSendBuffer);
    bool refused;
    Status q = queueLocked(type, bytes.substr(off, n), lk, &refused);
    if (q.isOk()) {
      off += n;
      continue;
    }
    if (!refused) return q;
    if (cvLocked().wait_until(lk, deadline) == std::cv_status::timeout &&
        !conn_->canAcceptLocked(this)) {
      return Status(Code::kDeadlineExceeded, "link: no room to send within the timeout");
    }
  }
  return Status::ok();
}

Status Stream::write(std::string_view bytes, double timeoutS) {
  return writeBlocking(static_cast<uint8_t>(LinkFrame::kData), bytes, timeoutS);
}

Status Stream::writeEvent(std::string_view payload, double timeoutS) {
  if (client_) return Status(Code::kFailedPrecondition, "link: events go server to client");
  if (payload.size() > kMaxEventPayload) {
    return invalidArg("event", "link: event over " + std::to_string(kMaxEventPayload) + " bytes");
  }
  return writeBlocking(static_cast<uint8_t>(LinkFrame::kEvent), payload, timeoutS);
}

Result<size_t> Stream::read(char* buf, size_t n, double timeoutS) {
  if (!conn_) return end_;
  Status st;
  if (blockingRefused(conn_->rt_, &st)) return st;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::microseconds(int64_t(std::max(0.0, timeoutS) * 1e6));
  std::unique_lock lk(conn_->mu_);
  for (;;) {
    if (inBuf_.size() > inOff_) {
      size_t k = std::min(n, inBuf_.size() - inOff_);
      std::memcpy(buf, inBuf_.data() + inOff_, k);
      inOff_ += k;
      if (inOff_ == inBuf_.size()) {
        inBuf_.clear();
        inOff_ = 0;
      } else if (inOff_ > (64u << 10) && inOff_ * 2 > inBuf_.size()) {
        inBuf_.erase(0, inOff_);
        inOff_ = 0;
      }
      conn_->creditLocked(this, k);
      return k;
    }
    if (peerEnded_) return size_t(0);
    if (cancelled_) return end_;
    if (done_) {
      if (client_ && !end_.isOk()) return end_;
      return size_t(0);
    }
    if (cvLocked().wait_until(lk, deadline) == std::cv_status::timeout && inBuf_.size() == inOff_ &&
        !peerEnded_ && !done_) {
      return Status(Code::kDeadlineExceeded, "link: nothing to read within the timeout");
    }
  }
}

Result<std::string> Stream::wait(double timeoutS) {
  if (!conn_) return end_;
  Status st;
  if (blockingRefused(conn_->rt_, &st)) return st;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::microseconds(int64_t(std::max(0.0, timeoutS) * 1e6));
  std::unique_lock lk(conn_->mu_);
  while (!done_) {
    if (cvLocked().wait_until(lk, deadline) == std::cv_status::timeout && !done_) {
      return Status(Code::kDeadlineExceeded, "link: no outcome within the timeout");
    }
  }
  if (!end_.isOk()) return end_;
  if (keptReply_) return reply_;
  return Status(Code::kFailedPrecondition, "link: the outcome went to onDone");
}

// ---- LinkClient --------------------------------------------------------------------

struct LinkClient::Core : ConnOwner, std::enable_shared_from_this<LinkClient::Core> {
  Core(Runtime& r, LinkClientOptions o) : rt(r), opts(std::move(o)), backoff(opts.backoffMinS) {}

  void connReady(const std::shared_ptr<Conn>& c) override {
    std::lock_guard lk(mu);
    if (c != conn) return;
    ++connects;
    backoff = opts.backoffMinS;
    retryAt = 0;
    lastError = Status::ok();
  }

  void connDraining(const std::shared_ptr<Conn>& c) override {
    std::lock_guard lk(mu);
    if (c == conn) conn = nullptr;  // new calls take a new connection
  }

  void connClosed(const std::shared_ptr<Conn>& c, const Status& st, bool wasReady) override {
    std::lock_guard lk(mu);
    if (c != conn) return;
    conn = nullptr;
    lastError = st.code() == Code::kUnauthenticated
                    ? st
                    : unavailable("node " + opts.node + " at " + opts.host + ":" +
                                  std::to_string(opts.port) + ": " + st.message());
    if (closed) return;
    if (wasReady) {
      connectLocked();  // lost: try again at once
      return;
    }
    retryAt = mono() + backoff;
    double wait = backoff;
    backoff = std::min(backoff * 2, opts.backoffMaxS);
    std::weak_ptr<Core> weak = shared_from_this();
    if (retryTimer) retryTimer->cancel();
    retryTimer = rt.after(wait, [weak] {
      auto self = weak.lock();
      if (!self) return;
      std::lock_guard lk2(self->mu);
      if (!self->closed && !self->conn) self->connectLocked();
    });
  }

  void connectLocked() {
    conn = std::make_shared<Conn>(rt, Conn::Role::kClient, opts.link, weak_from_this());
    conn->connect(opts.host, opts.port, opts.node, opts.key);
  }

  Runtime& rt;
  const LinkClientOptions opts;
  mutable std::mutex mu;       // guards everything below
  std::shared_ptr<Conn> conn;  // connecting or ready; null: none (or draining)
  bool closed = false;
  double backoff;
  double retryAt = 0;
  Status lastError;
  uint64_t connects = 0;
  std::shared_ptr<Runtime::Timer> retryTimer;
};

LinkClient::LinkClient(Runtime& rt, LinkClientOptions opts)
    : core_(std::make_shared<Core>(rt, std::move(opts))) {}

LinkClient::~LinkClient() { close(); }

std::shared_ptr<ClientCall> LinkClient::start(std::string_view method, std::string_view args,
                                              CallHandler handler) {
  auto failNow = [&](Status st) -> std::shared_ptr<ClientCall> {
    auto s = std::make_shared<Stream>(st);
    if (handler.onDone) {
      core_->rt.post([done = std::move(handler.onDone), st]() mutable { done(st); });
    }
    return s;
  };
  if (method.size() > kMaxMethod)
    return failNow(invalidArg("method", "link: method over 255 bytes"));
  if (args.size() + method.size() + 1 > kMaxPayload) {
    return failNow(invalidArg("args", "link: args over 1 MiB (send a body instead)"));
  }
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(core_->mu);
    if (core_->closed) return failNow(unavailable("link client closed"));
    if (core_->conn && core_->conn->closed()) core_->conn = nullptr;
    if (!core_->conn) {
      if (mono() < core_->retryAt) return failNow(core_->lastError);
      core_->connectLocked();
    }
    c = core_->conn;
  }
  auto s = std::make_shared<Stream>(c, true);
  s->manualCredit_ = handler.manualCredit;
  s->handler_ = std::move(handler);
  c->attach(s, method, args);
  return s;
}

Result<std::string> LinkClient::unary(std::string_view method, std::string_view args,
                                      double timeoutS) {
  Status st;
  if (blockingRefused(core_->rt, &st)) return st;
  auto call = start(method, args, CallHandler{});
  auto r = call->wait(timeoutS);
  if (!r.isOk() && r.status().code() == Code::kDeadlineExceeded && !call->done()) {
    call->cancel(r.status());
  }
  return r;
}

void LinkClient::drain() {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(core_->mu);
    core_->closed = true;
    c = std::move(core_->conn);
    if (core_->retryTimer) core_->retryTimer->cancel();
  }
  if (c) c->goAway();
}

void LinkClient::close() {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(core_->mu);
    core_->closed = true;
    c = std::move(core_->conn);
    if (core_->retryTimer) core_->retryTimer->cancel();
  }
  if (c) c->fail(unavailable("link client closed"));
}

bool LinkClient::connected() const {
  std::lock_guard lk(core_->mu);
  return core_->conn && core_->conn->ready();
}

uint64_t LinkClient::connects() const {
  std::lock_guard lk(core_->mu);
  return core_->connects;
}

size_t LinkClient::callsInFlight() const {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(core_->mu);
    c = core_->conn;
  }
  return c ? c->calls() : 0;
}

// ---- LinkServer --------------------------------------------------------------------

struct LinkServer::Core : ConnOwner, std::enable_shared_from_this<LinkServer::Core> {
  Core(Runtime& r, LinkKeySource k, LinkDispatcher d, LinkOptions o)
      : rt(r), keys(std::move(k)), dispatcher(std::move(d)), opts(o) {}

  Result<std::string> keyFor(const std::string& node) override { return keys(node); }
  void dispatch(std::shared_ptr<ServerCall> call) override { dispatcher(std::move(call)); }
  void authFailed() override { ++authFailures; }
  void connClosed(const std::shared_ptr<Conn>& c, const Status&, bool) override {
    std::lock_guard lk(mu);
    conns.erase(c);
  }

  Runtime& rt;
  LinkKeySource keys;
  LinkDispatcher dispatcher;
  const LinkOptions opts;
  std::atomic<uint64_t> authFailures{0};
  mutable std::mutex mu;  // guards conns, closed
  std::set<std::shared_ptr<Conn>> conns;
  bool closed = false;
};

LinkServer::LinkServer(Runtime& rt, LinkKeySource keys, LinkDispatcher dispatch, LinkOptions opts)
    : core_(std::make_shared<Core>(rt, std::move(keys), std::move(dispatch), opts)) {}

LinkServer::~LinkServer() { close(); }

void LinkServer::adopt(UniqueFd fd, std::string buffered) {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(core_->mu);
    if (core_->closed) return;  // fd closes here
    c = std::make_shared<Conn>(core_->rt, Conn::Role::kServer, core_->opts, core_);
    core_->conns.insert(c);
  }
  c->adopt(std::move(fd), std::move(buffered));
}

void LinkServer::goAway() {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lk(core_->mu);
    conns.assign(core_->conns.begin(), core_->conns.end());
  }
  for (auto& c : conns) c->goAway();
}

void LinkServer::close() {
  std::set<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lk(core_->mu);
    core_->closed = true;
    conns.swap(core_->conns);
  }
  for (auto& c : conns) c->fail(unavailable("link server closed"));
}

size_t LinkServer::connections() const {
  std::lock_guard lk(core_->mu);
  return core_->conns.size();
}

size_t LinkServer::callsInFlight() const {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lk(core_->mu);
    conns.assign(core_->conns.begin(), core_->conns.end());
  }
  size_t n = 0;
  for (auto& c : conns) n += c->calls();
  return n;
}

uint64_t LinkServer::authFailures() const { return core_->authFailures.load(); }

}  // namespace dsec::proto
