#include "common/http_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/any_completion_handler.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <span>
#include <vector>

#include "common/log.h"
#include "common/runtime.h"
#include "common/util.h"

namespace dsec::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using ErrorCode = boost::system::error_code;

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

using Strand = asio::strand<asio::io_context::executor_type>;
using Socket = asio::basic_stream_socket<tcp, Strand>;
using Acceptor = asio::basic_socket_acceptor<tcp, Strand>;
using SteadyTimer =
    asio::basic_waitable_timer<std::chrono::steady_clock,
                               asio::wait_traits<std::chrono::steady_clock>, Strand>;
using Parser = bhttp::request_parser<bhttp::buffer_body>;
using Clock = std::chrono::steady_clock;

constexpr size_t kHeaderLimit = 64 << 10;
// First read of a request: most request heads fit; the buffer grows past it
// only for big heads or bodies, and is freed once the connection is idle.
constexpr size_t kHeadReadBytes = 2048;
constexpr size_t kBodyReadBytes = 32 << 10;
// Bytes a client may send while its response is deferred (a pipelined next
// request); past it the rest is dropped and the connection closes after the
// response, so a client cannot make us buffer without bound.
constexpr size_t kMaxKeptWhileDeferred = 64 << 10;
constexpr int kAcceptBurst = 64;
// The lingering close: how much of a refused body we read and drop, and for
// how long, so the client sees our response rather than a reset.
constexpr size_t kLingerMaxBytes = 64 << 20;
constexpr double kLingerTotalS = 2.0;
constexpr double kLingerSilenceS = 0.2;

Clock::duration toDuration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

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
      for (auto& c : rawV)
        if (c == '+') c = ' ';
      if (!percentDecode(kv.substr(0, eq), k) || !percentDecode(rawV, v)) return false;
      out.emplace(std::move(k), std::move(v));
    }
    start = amp + 1;
  }
  return true;
}

std::string jsonError(std::string_view code, std::string_view msg) {
  return std::string(R"({"error":{"code":")") + std::string(code) + R"(","message":")" +
         std::string(msg) + "\"}}";
}

// A response head. Header semantics are Beast's: a header set later replaces
// one of the same name, whatever its case.
std::string formatHead(const std::string& serverName, int status, std::string_view contentType,
                       const std::map<std::string, std::string>& extra, bool keepAlive,
                       std::optional<uint64_t> length /* nullopt: chunked */) {
  bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(status), 11};
  res.set(bhttp::field::server, serverName);
  res.set(bhttp::field::content_type, contentType);
  for (auto& [k, v] : extra) res.set(k, v);
  res.keep_alive(keepAlive);
  if (length) {
    res.content_length(*length);
  } else {
    res.chunked(true);
  }
  std::string out;
  out.reserve(160);
  out += "HTTP/1.1 ";
  out += std::to_string(status);
  out += ' ';
  out += res.reason();
  out += "\r\n";
  for (auto& f : res) {
    out += f.name_string();
    out += ": ";
    out += f.value();
    out += "\r\n";
  }
  out += "\r\n";
  return out;
}

std::string chunkOf(std::string_view data) {
  char size[24];
  int n = snprintf(size, sizeof size, "%zx\r\n", data.size());
  std::string out;
  out.reserve(size_t(n) + data.size() + 2);
  out.append(size, size_t(n));
  out.append(data);
  out.append("\r\n");
  return out;
}

constexpr std::string_view kLastChunk = "0\r\n\r\n";

// An Upgrade protocol: a token, optionally "/version" ("websocket",
// "dsec-link/1").
bool isProtocol(std::string_view s) {
  if (s.empty()) return false;
  for (unsigned char c : s) {
    if (c <= 32 || c >= 127) return false;
    if (c != '/' && strchr("()<>@,;:\\\"[]?={}", c)) return false;
  }
  return true;
}

// Answers a connection we will not serve with 503 and closes it, without
// blocking: the socket is non-blocking, a fresh socket's send buffer is empty,
// and we drain only what has already arrived. A request arriving after the
// close may earn the client a reset instead of the 503; either way it fails
// fast and the server stays up.
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

// What a server's connections share with it. Held by shared_ptr so that a
// connection kept alive by a Deferred (or a queued completion) after serve()
// returned still finds it.
struct ServerCore {
  ServerCore(ServerOptions o, Runtime* r)
      : opts(std::move(o)),
        rt(r),
        acceptStrand(asio::make_strand(rt->io())),
        acceptor(acceptStrand) {}

  const ServerOptions opts;
  Runtime* const rt;
  Strand acceptStrand;
  Acceptor acceptor;  // on acceptStrand once serve() runs
  tcp protocol = tcp::v4();
  // Set by serve() before any connection runs, cleared after the last ended.
  Handler handler;
  std::atomic<bool> stopping{false};

  std::atomic<int64_t> open{0}, inFlight{0}, peakInFlight{0}, deferred{0};
  std::atomic<uint64_t> accepted{0}, refused{0}, timedOut{0};

  std::mutex mu;  // guards head, live, serving
  std::condition_variable cv;
  Connection* head = nullptr;  // connections not yet finalized (intrusive list)
  int live = 0;                // running connection coroutines + the accept loop
  bool serving = false;        // serve() started the accept loop

  void requestStarted() {
    int64_t now = ++inFlight;
    int64_t peak = peakInFlight.load();
    while (now > peak && !peakInFlight.compare_exchange_weak(peak, now)) {
    }
  }
  void leave() {
    std::lock_guard lk(mu);
    if (--live == 0) cv.notify_all();
  }
};

// The per-request state: created when a request's first byte arrives, gone
// when its response is complete (or, deferred, when its handler returned).
struct Exchange {
  explicit Exchange(Connection* c) : req(c), res(c) {
    parser.body_limit(boost::none);  // handlers enforce their own limits
    parser.header_limit(kHeaderLimit);
  }
  Parser parser;
  Request req;
  Response res;
  std::string body;  // the pre-read body
  std::string rawHead;  // the head's bytes as read (only with ServerOptions::divert)
  size_t bodyOff = 0;
  bool preRead = false;
  std::optional<Status> readErr;  // sticky
  bool isHead = false;
  bool keepAlive = true;
  bool broken = false;
  bool inlineCall = false;  // the inline handler is running, on the io thread
  // What the handler answered with.
  bool stored = false;  // send(): written after the handler returns
  int status = 0;
  std::string contentType;
  std::string storedBody;
  bool streaming = false;  // begin*() from a worker
  std::string upgradeProtocol;
  std::function<void(UniqueFd, std::string)> take;
  std::shared_ptr<Deferred::State> deferred;
};

// A deferred response's state; guarded by its connection's mu_.
struct Deferred::State {
  std::map<std::string, std::string> headers;
  std::function<void()> onGone;
  std::string contentType;
  uint64_t length = 0;
  int status = 0;
  bool isHead = false;
  bool active = false;    // bytes may be written (see Connection::defer)
  bool keepAlive = true;  // decided when it became active
  bool headSet = false;   // send() or beginChunked() called
  bool headEmitted = false;
  bool chunked = false;
  bool finished = false;   // send() or finish() called
  bool abandoned = false;  // the last Deferred went before finishing
  bool gone = false;       // the client went away before the response was written
  bool goneNotified = false;
  bool closed = false;  // the exchange is over
};

namespace {
enum class Wait : uint8_t { kNone, kIdle, kHeader, kBody, kSend, kLinger };
// What a step of the coroutine leaves the connection to do.
enum class Next : uint8_t {
  kRespond,    // write the handler's response
  kDeferred,   // wait for a Deferred to complete
  kUpgrade,    // write 101 and hand the socket over
  kKeepAlive,  // read the next request
  kClose,      // shut down our side, drain briefly, close
  kDrop,       // close at once (gone, timed out, stopped)
  kHandedOff,  // upgraded: the socket is someone else's
};
}  // namespace

// One accepted connection. Its coroutine (run()) and every callback below
// marked "strand" run on strand_; the methods marked "worker" run on the
// handler's thread; the rest say what they need.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(std::shared_ptr<ServerCore> core, Strand strand)
      : core_(std::move(core)), strand_(std::move(strand)), sock_(strand_), timer_(strand_) {}

  // Any thread, before run(): takes the accepted fd (closed on failure).
  bool adopt(int fd) {
    ErrorCode ec;
    sock_.assign(core_->protocol, fd, ec);
    if (ec) {
      ::close(fd);
      return false;
    }
    sock_.set_option(tcp::no_delay(true), ec);
    // Synchronous reads (the deferred watch) must fail with would_block
    // rather than let Asio poll() on an io thread.
    sock_.non_blocking(true, ec);
    return !ec;
  }

  asio::awaitable<void> run();
  void finalize();
  void closeForStop();
  void start() {
    asio::co_spawn(strand_, run(), [self = shared_from_this()](std::exception_ptr e) {
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          log::error(std::string("http connection: ") + ex.what());
        }
      }
      self->finalize();
    });
  }
  void postCloseForStop() {
    asio::post(strand_, [self = shared_from_this()] { self->closeForStop(); });
  }

  // --- For Request and Response: the thread running the handler. ---
  Result<size_t> readBody(char* buf, size_t n);
  bool bodyDone() const {
    if (ex_->preRead) return ex_->bodyOff >= ex_->body.size();
    return ex_->parser.is_done();
  }
  // Whether the whole body is off the wire (so the connection can carry the
  // next request however much of it the handler took).
  bool bodyReceived() const { return ex_->preRead ? !ex_->readErr : ex_->parser.is_done(); }
  void markBroken() { ex_->broken = true; }
  Exchange& exchange() { return *ex_; }
  Status streamHead(Response& r, int status, std::string_view contentType,
                    std::optional<uint64_t> length);
  Status streamBody(std::string bytes);
  std::shared_ptr<Deferred> defer(Response& r);

  // --- For Deferred: any thread. ---
  std::mutex& mu() { return mu_; }
  Status deferredSend(Deferred::State& d, int status, std::string_view ctype,
                      std::string_view body);
  Status deferredBegin(Deferred::State& d, int status, std::string_view ctype);
  Status deferredWrite(Deferred::State& d, std::string_view data);
  Status deferredFinish(Deferred::State& d);
  void deferredOnGone(Deferred::State& d, std::function<void()> fn);
  size_t deferredQueued(const Deferred::State& d) const;
  void deferredDropped(Deferred::State& d);

  // ServerCore::mu.
  Connection* prev_ = nullptr;
  Connection* next_ = nullptr;

 private:
  // Coroutine steps (strand).
  asio::awaitable<Next> readRequest();
  asio::awaitable<Next> completeResponse();
  asio::awaitable<Next> completeDeferred();
  asio::awaitable<Next> completeUpgrade();
  asio::awaitable<Next> lingerClose();
  asio::awaitable<Next> step(Next next);
  asio::awaitable<void> waitOutput();
  Next answerAndClose(int status, std::string_view code, std::string_view msg);
  void endExchange();
  void shrinkBuffers();
  // Size-bounded body parsing from rbuf_ into [buf, buf+n): bytes produced;
  // needRead when it stopped for want of input. Whoever owns rbuf_.
  size_t parseBody(char* buf, size_t n, ErrorCode& ec, bool& needRead);

  // Deadlines (strand): one at a time, for the operation in progress.
  void arm(double seconds, Wait kind);
  Wait disarm();
  void countTimeout() { ++core_->timedOut; }

  // Events for the coroutine (strand): spurious wakeups are fine, every
  // waiter re-checks its condition.
  auto waitEvent() {
    return asio::async_initiate<const asio::use_awaitable_t<>&, void()>(
        [this](auto handler) {
          if (eventPending_) {
            eventPending_ = false;
            asio::post(strand_, std::move(handler));
          } else {
            waiter_.emplace(std::move(handler));
          }
        },
        asio::use_awaitable);
  }
  void notify() {
    if (waiter_) {
      auto h = std::move(*waiter_);
      waiter_.reset();
      asio::post(strand_, std::move(h));
    } else {
      eventPending_ = true;
    }
  }

  // Output (strand): moves pending_ to the socket.
  void flush();
  void writeSome();
  void onWrote(ErrorCode ec, size_t n);
  void failOutput(const std::string& why);
  void kick() {
    {
      std::lock_guard lk(mu_);
      kickPosted_ = false;
    }
    flush();
    notify();
  }
  // mu_ held: queues bytes for flush().
  void queueLocked(std::string bytes, bool front = false) {
    if (bytes.empty()) return;
    queued_ += bytes.size();
    if (front) {
      pending_.insert(pending_.begin(), std::move(bytes));
    } else {
      pending_.push_back(std::move(bytes));
    }
  }
  // mu_ held, off the strand: whether the caller must postKick() (one kick in
  // flight at a time covers every byte queued before it runs).
  bool wantKickLocked() { return !std::exchange(kickPosted_, true); }
  void postKick() {
    asio::post(strand_, [self = shared_from_this()] { self->kick(); });
  }
  void emitHeadLocked(Deferred::State& d);
  bool outputSettled() {
    std::lock_guard lk(mu_);
    return outFailed_ || written_ == queued_;
  }
  bool outputFailed() {
    std::lock_guard lk(mu_);
    return outFailed_;
  }

  // Deferred: the disconnect watch (strand).
  void startWatch();
  void onWatch(ErrorCode ec);

  // Worker side: runs the handler; asks the strand for a read and waits.
  void runHandler();
  ErrorCode workerRead();
  void startWorkerRead();
  void finishWorkerOp(ErrorCode ec);
  template <class Pred>
  bool waitWorker(std::unique_lock<std::mutex>& lk, Pred pred);
  Status unavailableLocked() const {
    return Status(Code::kUnavailable, "client went away: " + failMsg_);
  }
  // mu_ held: what a Deferred hears once its exchange is over.
  Status closedLocked(const Deferred::State& d) const {
    if (d.gone) return unavailableLocked();
    return Status(Code::kFailedPrecondition, "response already complete");
  }

  // Fixed for the connection's life.
  const std::shared_ptr<ServerCore> core_;
  Strand strand_;
  Socket sock_;
  SteadyTimer timer_;

  // The strand owns these, except while a blocking handler runs: then its
  // worker does, and the strand touches rbuf_ only for a read the worker
  // asked for and waits on.
  beast::flat_buffer rbuf_;  // read, not yet parsed
  std::unique_ptr<Exchange> ex_;

  // Strand only.
  std::optional<asio::any_completion_handler<void()>> waiter_;
  std::vector<std::string> sending_;  // being written
  // The buffers of the write in flight (writeSome): they live here, not on
  // the stack, for as long as the operation may read them.
  std::array<asio::const_buffer, 16> writeBufs_;
  size_t sendIdx_ = 0, sendOff_ = 0;
  uint32_t timerGen_ = 0;
  Wait armed_ = Wait::kNone;
  Wait fired_ = Wait::kNone;
  bool eventPending_ = false;
  bool stopped_ = false;  // closeForStop() ran
  bool handlerRunning_ = false;
  bool finalizePending_ = false;  // finalize() waits for the handler
  bool finalized_ = false;
  bool writing_ = false;
  bool watching_ = false;
  bool watchStop_ = false;
  bool discardInput_ = false;
  bool handedOff_ = false;
  bool deferredCounted_ = false;  // in ServerCore::deferred
  bool inFlightCounted_ = false;  // in ServerCore::inFlight

  // Shared with workers and Deferred holders.
  mutable std::mutex mu_;              // guards everything below
  std::condition_variable cv_;         // workers wait on it
  std::vector<std::string> pending_;   // queued, not yet handed to the socket
  uint64_t queued_ = 0, written_ = 0;  // bytes, since the connection began
  bool kickPosted_ = false;
  bool outFailed_ = false;  // nothing more will be written
  std::string failMsg_;
  bool opDone_ = false;  // the worker's read
  ErrorCode opEc_;
  std::shared_ptr<Deferred::State> d_;
};

// ---------------------------------------------------------------- deadlines

void Connection::arm(double seconds, Wait kind) {
  ++timerGen_;
  armed_ = kind;
  fired_ = Wait::kNone;
  if (seconds <= 0) return;
  timer_.expires_after(toDuration(seconds));
  timer_.async_wait([self = shared_from_this(), gen = timerGen_](const ErrorCode& ec) {
    if (ec || gen != self->timerGen_) return;
    self->fired_ = self->armed_;
    // Ends whatever is pending on the socket: the operation's owner sees
    // operation_aborted and asks disarm() why.
    ErrorCode ignored;
    self->sock_.cancel(ignored);
  });
}

Wait Connection::disarm() {
  Wait fired = fired_;
  if (armed_ != Wait::kNone) {
    ++timerGen_;
    if (fired == Wait::kNone) timer_.cancel();
  }
  armed_ = fired_ = Wait::kNone;
  return fired;
}

// ---------------------------------------------------------------- the coroutine

// The frames are kept small where connections spend their time: an idle one
// waits here (this frame only, no buffer), a deferred one in
// completeDeferred(); the bigger frame of readRequest() lives only while a
// request's head and body are read and its handler runs.
asio::awaitable<void> Connection::run() {
  ErrorCode ec;
  for (;;) {
    if (rbuf_.size() == 0) {
      shrinkBuffers();
      if (stopped_) co_return;
      arm(core_->opts.idleTimeoutS, Wait::kIdle);
      co_await sock_.async_wait(tcp::socket::wait_read,
                                asio::redirect_error(asio::use_awaitable, ec));
      Wait fired = disarm();
      if (stopped_) co_return;
      if (ec) {
        if (fired == Wait::kIdle) countTimeout();
        co_return;
      }
    }
    Next next = co_await readRequest();
    while (next != Next::kKeepAlive && next != Next::kDrop && next != Next::kHandedOff) {
      next = co_await step(next);
    }
    if (next != Next::kKeepAlive) co_return;
  }
}

// One co_await site in run() for every later step: each co_await costs its
// frame a slot.
asio::awaitable<Next> Connection::step(Next next) {
  switch (next) {
    case Next::kRespond:
      return completeResponse();
    case Next::kDeferred:
      return completeDeferred();
    case Next::kUpgrade:
      return completeUpgrade();
    default:
      return lingerClose();
  }
}

asio::awaitable<Next> Connection::readRequest() {
  const ServerOptions& o = core_->opts;
  ErrorCode ec;
  size_t n = 0;
  ex_ = std::make_unique<Exchange>(this);
  Exchange& x = *ex_;
  arm(o.headerTimeoutS, Wait::kHeader);
  for (;;) {
    if (rbuf_.size() > 0) {
      size_t used = x.parser.put(rbuf_.data(), ec);
      if (o.divert) x.rawHead.append(static_cast<const char*>(rbuf_.data().data()), used);
      rbuf_.consume(used);
      if (x.parser.is_header_done()) break;
      if (ec && ec != bhttp::error::need_more) {
        disarm();
        co_return answerAndClose(400, "invalid_argument", "malformed HTTP request");
      }
    }
    n = co_await sock_.async_read_some(rbuf_.prepare(kHeadReadBytes),
                                       asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      // Gone, stopped, or too slow with its head (slowloris): close quietly.
      if (disarm() == Wait::kHeader) countTimeout();
      co_return Next::kDrop;
    }
    rbuf_.commit(n);
  }
  disarm();

  inFlightCounted_ = true;
  core_->requestStarted();
  {
    auto& msg = x.parser.get();
    x.keepAlive = msg.keep_alive();
    x.isHead = msg.method() == bhttp::verb::head;
    Request& req = x.req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (auto& f : msg) {
      req.headers[asciiLower(f.name_string())] = std::string(f.value());
    }
    if (auto len = x.parser.content_length()) req.contentLength = *len;
    std::string_view tgt = req.target;
    size_t q = tgt.find('?');
    bool ok = percentDecode(tgt.substr(0, q), req.path);
    if (ok && q != std::string_view::npos) ok = parseQuery(tgt.substr(q + 1), req.query);
    if (!ok) {
      // The body, if any, is unread: close through the lingering close.
      co_return answerAndClose(400, "invalid_argument", "malformed percent-encoding in URL");
    }
  }

  if (o.divert) {
    ServerOptions::Taker take;
    try {
      take = o.divert(x.req);
    } catch (const std::exception& e) {
      log::error(std::string("http divert threw: ") + e.what());
      co_return answerAndClose(500, "internal", "internal error");
    }
    if (take) {
      std::string bytes = std::move(x.rawHead);
      bytes.append(static_cast<const char*>(rbuf_.data().data()), rbuf_.size());
      endExchange();
      rbuf_ = beast::flat_buffer();
      int fd = sock_.release(ec);
      if (ec || fd < 0) co_return Next::kDrop;
      handedOff_ = true;
      --core_->open;
      try {
        take(UniqueFd(fd), std::move(bytes));
      } catch (const std::exception& e) {
        log::error(std::string("http divert: take threw: ") + e.what());
      }
      co_return Next::kHandedOff;
    }
  }

  // A small body is read here, so the handler's worker never waits for it.
  if (!x.parser.is_done()) {
    auto len = x.parser.content_length();
    if (len && *len <= o.preReadBytes) {
      x.preRead = true;
      x.body.resize(size_t(*len));
      size_t off = 0;
      while (!x.parser.is_done()) {
        bool needRead = false;
        off += parseBody(x.body.data() + off, x.body.size() - off, ec, needRead);
        if (ec) {
          x.readErr = Status(Code::kInvalidArgument, "reading request body: " + ec.message());
          break;
        }
        if (!needRead) continue;
        arm(o.bodyTimeoutS, Wait::kBody);
        n = co_await sock_.async_read_some(rbuf_.prepare(kBodyReadBytes),
                                           asio::redirect_error(asio::use_awaitable, ec));
        Wait fired = disarm();
        if (stopped_) co_return Next::kDrop;
        if (ec && fired == Wait::kBody) {
          // The handler answers (504, typically): a client that is merely
          // slow hears why.
          countTimeout();
          x.readErr = Status(Code::kDeadlineExceeded, "reading request body: timed out");
          break;
        }
        if (ec) co_return Next::kDrop;  // gone mid-body: nobody to answer
        rbuf_.commit(n);
      }
      if (x.readErr) {
        x.broken = true;
        x.body.resize(off);
      }
    }
  }
  shrinkBuffers();

  bool answered = false;
  if (o.inlineHandler && bodyReceived()) {
    x.inlineCall = true;
    try {
      answered = o.inlineHandler(x.req, x.res);
    } catch (const std::exception& e) {
      log::error(std::string("http inline handler threw: ") + e.what());
      x.broken = true;
    }
    x.inlineCall = false;
    answered = answered || x.res.started_;
  }
  if (!answered) {
    handlerRunning_ = true;
    if (!core_->rt->runBlocking([self = shared_from_this()] { self->runHandler(); })) {
      handlerRunning_ = false;
      co_return answerAndClose(503, "unavailable", "server stopping");
    }
    while (handlerRunning_) co_await waitEvent();
  }
  if (stopped_) co_return Next::kDrop;
  if (ex_->deferred) co_return Next::kDeferred;
  if (ex_->take) co_return Next::kUpgrade;
  co_return Next::kRespond;
}

Next Connection::answerAndClose(int status, std::string_view code, std::string_view msg) {
  Exchange& x = *ex_;
  x.keepAlive = false;
  std::string body = jsonError(code, msg);
  {
    std::lock_guard lk(mu_);
    queueLocked(
        formatHead(core_->opts.serverName, status, "application/json", {}, false, body.size()));
    queueLocked(std::move(body));
  }
  flush();
  endExchange();
  return Next::kClose;
}

asio::awaitable<Next> Connection::completeResponse() {
  Exchange& x = *ex_;
  Response& r = x.res;
  if (!r.started_) {
    x.stored = true;
    x.status = 500;
    x.contentType = "application/json";
    x.storedBody = R"({"error":{"code":"internal","message":"handler sent no response"}})";
    r.started_ = r.finished_ = true;
  }
  if (x.stored) {
    if (!bodyReceived()) x.keepAlive = false;
    if (x.broken) x.keepAlive = false;
    std::string head = formatHead(core_->opts.serverName, x.status, x.contentType, r.extraHeaders_,
                                  x.keepAlive, x.storedBody.size());
    std::lock_guard lk(mu_);
    queueLocked(std::move(head));
    if (!x.isHead) queueLocked(std::move(x.storedBody));
  } else if (x.streaming && !r.finished_) {
    r.finished_ = true;
    if (r.chunked_) {
      std::lock_guard lk(mu_);
      if (!x.isHead) queueLocked(std::string(kLastChunk));
    } else if (r.remaining_ != 0) {
      x.broken = true;  // promised more than we have: only a close is honest
    }
  }
  flush();
  co_await waitOutput();
  bool failed = outputFailed();
  bool keep = x.keepAlive && !x.broken && bodyReceived();
  endExchange();
  if (failed || stopped_) co_return Next::kDrop;
  co_return keep ? Next::kKeepAlive : Next::kClose;
}

asio::awaitable<void> Connection::waitOutput() {
  while (!outputSettled()) co_await waitEvent();
}

asio::awaitable<Next> Connection::completeDeferred() {
  std::shared_ptr<Deferred::State> d = std::move(ex_->deferred);
  const bool keep = ex_->keepAlive && !ex_->broken && bodyReceived();
  // The request is done with: a deferred response costs no parser, no
  // request and no buffer while it waits.
  ex_.reset();
  {
    std::lock_guard lk(mu_);
    if (!d->active) {
      d->active = true;
      d->keepAlive = keep;
      if (d->headSet && !d->headEmitted) emitHeadLocked(*d);
    }
  }
  deferredCounted_ = true;
  ++core_->deferred;
  shrinkBuffers();
  startWatch();
  flush();
  bool closeNow = false;
  for (;;) {
    bool failed, done, abandoned, emitted;
    {
      std::lock_guard lk(mu_);
      failed = outFailed_;
      done = d->finished && written_ == queued_;
      abandoned = d->abandoned && !d->finished;
      emitted = d->headEmitted;
    }
    if (failed || done) break;
    if (abandoned) {
      if (emitted) {
        // Half sent: close, so the client sees a truncated body. The client
        // is not gone, we are: no onClientGone.
        closeNow = true;
        std::lock_guard lk(mu_);
        d->goneNotified = true;
        break;
      }
      std::string body =
          R"({"error":{"code":"internal","message":"deferred response dropped unanswered"}})";
      {
        std::lock_guard lk(mu_);
        d->headSet = d->finished = true;
        d->status = 500;
        d->contentType = "application/json";
        d->chunked = false;
        d->length = body.size();
        emitHeadLocked(*d);
        if (!d->isHead) queueLocked(std::move(body));
      }
      flush();
      continue;
    }
    co_await waitEvent();
  }
  deferredCounted_ = false;
  --core_->deferred;
  watchStop_ = true;
  if (closeNow || outputFailed()) {
    ErrorCode ignored;
    sock_.cancel(ignored);
  } else if (watching_) {
    ErrorCode ignored;
    sock_.cancel(ignored);  // nothing else is pending: the response is written
  }
  while (watching_ || writing_) co_await waitEvent();
  watchStop_ = false;
  std::function<void()> dropGone;  // destroyed unlocked: it may hold a Deferred
  {
    std::lock_guard lk(mu_);
    d->closed = true;
    dropGone = std::move(d->onGone);
    d_.reset();
  }
  dropGone = nullptr;
  bool failed = outputFailed();
  endExchange();
  if (failed || closeNow || stopped_) co_return Next::kDrop;
  co_return keep && !discardInput_ ? Next::kKeepAlive : Next::kClose;
}

asio::awaitable<Next> Connection::completeUpgrade() {
  Exchange& x = *ex_;
  std::string head = "HTTP/1.1 101 Switching Protocols\r\nServer: " + core_->opts.serverName +
                     "\r\nUpgrade: " + x.upgradeProtocol + "\r\nConnection: Upgrade\r\n";
  for (auto& [k, v] : x.res.extraHeaders_) head += k + ": " + v + "\r\n";
  head += "\r\n";
  {
    std::lock_guard lk(mu_);
    queueLocked(std::move(head));
  }
  flush();
  co_await waitOutput();
  if (outputFailed() || stopped_) {
    endExchange();
    co_return Next::kDrop;
  }
  std::string buffered(static_cast<const char*>(rbuf_.data().data()), rbuf_.size());
  auto take = std::move(x.take);
  endExchange();
  rbuf_ = beast::flat_buffer();
  ErrorCode ec;
  int fd = sock_.release(ec);
  if (ec || fd < 0) co_return Next::kDrop;
  int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) (void)::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  handedOff_ = true;
  --core_->open;
  try {
    take(UniqueFd(fd), std::move(buffered));
  } catch (const std::exception& e) {
    log::error(std::string("http upgrade: take threw: ") + e.what());
  }
  co_return Next::kHandedOff;
}

asio::awaitable<Next> Connection::lingerClose() {
  // A client still sending a body we refused would get a reset instead of our
  // response if we closed now: read and drop a bounded amount, for a bounded
  // time, first.
  co_await waitOutput();
  ErrorCode ec;
  sock_.shutdown(tcp::socket::shutdown_send, ec);
  if (ec || stopped_ || outputFailed()) co_return Next::kDrop;
  rbuf_.consume(rbuf_.size());
  const auto end = Clock::now() + toDuration(kLingerTotalS);
  size_t total = 0;
  while (total < kLingerMaxBytes && !stopped_) {
    double left = std::chrono::duration<double>(end - Clock::now()).count();
    if (left <= 0) break;
    arm(std::min(left, kLingerSilenceS), Wait::kLinger);
    size_t n = co_await sock_.async_read_some(rbuf_.prepare(16 << 10),
                                              asio::redirect_error(asio::use_awaitable, ec));
    disarm();
    if (ec || n == 0) break;
    total += n;
  }
  rbuf_ = beast::flat_buffer();
  co_return Next::kDrop;
}

void Connection::endExchange() {
  if (std::exchange(inFlightCounted_, false)) --core_->inFlight;
  ex_.reset();
  shrinkBuffers();
}

void Connection::shrinkBuffers() {
  // Keep a buffer only while it holds bytes; a big one goes back to its size.
  if (rbuf_.size() == 0 || rbuf_.capacity() > 4 * kBodyReadBytes) rbuf_.shrink_to_fit();
}

size_t Connection::parseBody(char* buf, size_t n, ErrorCode& ec, bool& needRead) {
  Parser& p = ex_->parser;
  auto& body = p.get().body();
  body.data = buf;
  body.size = n;
  needRead = false;
  ec = {};
  while (!p.is_done() && body.size > 0) {
    if (rbuf_.size() == 0) {
      needRead = true;
      break;
    }
    size_t used = p.put(rbuf_.data(), ec);
    rbuf_.consume(used);
    if (ec == bhttp::error::need_buffer) {
      ec = {};
      break;
    }
    if (ec == bhttp::error::need_more) {
      ec = {};
      if (used == 0) {
        needRead = true;
        break;
      }
      continue;
    }
    if (ec) break;
  }
  size_t got = n - body.size;
  body.data = nullptr;
  body.size = 0;
  return got;
}

// ---------------------------------------------------------------- output

void Connection::flush() {
  if (writing_ || handedOff_) return;
  {
    std::lock_guard lk(mu_);
    if (outFailed_ || pending_.empty()) return;
    if (d_ && !d_->active) return;  // a deferred response waits for its handler's return
    sending_.swap(pending_);
  }
  sendIdx_ = sendOff_ = 0;
  writing_ = true;
  writeSome();
}

void Connection::writeSome() {
  // The buffer sequence is a view of writeBufs_, which must outlive the
  // operation: a write the socket cannot take at once is performed later, by
  // the reactor, from the copy of the view the operation holds (a view of a
  // local array would then point into a dead stack frame).
  size_t nb = 0;
  for (size_t i = sendIdx_; i < sending_.size() && nb < writeBufs_.size(); ++i) {
    size_t off = i == sendIdx_ ? sendOff_ : 0;
    writeBufs_[nb++] = asio::buffer(sending_[i].data() + off, sending_[i].size() - off);
  }
  arm(core_->opts.sendTimeoutS, Wait::kSend);
  sock_.async_write_some(
      std::span<const asio::const_buffer>(writeBufs_.data(), nb),
      [self = shared_from_this()](ErrorCode ec, size_t n) { self->onWrote(ec, n); });
}

void Connection::onWrote(ErrorCode ec, size_t n) {
  Wait fired = disarm();
  if (ec) {
    writing_ = false;
    sending_ = {};
    if (fired == Wait::kSend) countTimeout();
    failOutput(fired == Wait::kSend ? "send timed out" : ec.message());
    return;
  }
  for (size_t left = n; left > 0 && sendIdx_ < sending_.size();) {
    size_t avail = sending_[sendIdx_].size() - sendOff_;
    if (left >= avail) {
      left -= avail;
      ++sendIdx_;
      sendOff_ = 0;
    } else {
      sendOff_ += left;
      left = 0;
    }
  }
  {
    std::lock_guard lk(mu_);
    written_ += n;
  }
  cv_.notify_all();
  if (sendIdx_ < sending_.size()) {
    writeSome();
    return;
  }
  sending_ = {};
  writing_ = false;
  flush();
  if (!writing_) notify();
}

void Connection::failOutput(const std::string& why) {
  std::function<void()> gone;
  {
    std::lock_guard lk(mu_);
    if (!outFailed_) {
      outFailed_ = true;
      failMsg_ = why;
    }
    pending_ = {};
    if (d_ && !d_->closed) {
      d_->gone = true;
      if (!d_->finished && !d_->goneNotified && d_->onGone) {
        d_->goneNotified = true;
        gone = std::move(d_->onGone);
      }
    }
  }
  cv_.notify_all();
  ErrorCode ignored;
  sock_.cancel(ignored);
  if (gone) {
    try {
      gone();
    } catch (const std::exception& e) {
      log::error(std::string("http onClientGone threw: ") + e.what());
    }
  }
  notify();
}

// ---------------------------------------------------------------- the deferred watch

void Connection::startWatch() {
  watching_ = true;
  sock_.async_wait(tcp::socket::wait_read,
                   [self = shared_from_this()](ErrorCode ec) { self->onWatch(ec); });
}

void Connection::onWatch(ErrorCode ec) {
  watching_ = false;
  if (watchStop_ || stopped_ || outputFailed()) {
    notify();
    return;
  }
  if (ec == asio::error::operation_aborted) {  // a send deadline's cancel that raced its write
    startWatch();
    return;
  }
  if (ec) {
    failOutput("client went away: " + ec.message());
    return;
  }
  // Readable: take what has arrived without blocking (the socket is
  // non-blocking). Bytes are the client's next request; past a bound they are
  // dropped and the connection will close after this response.
  for (;;) {
    size_t n;
    if (discardInput_ || rbuf_.size() >= kMaxKeptWhileDeferred) {
      discardInput_ = true;
      char junk[4096];
      n = sock_.read_some(asio::buffer(junk), ec);
    } else {
      n = sock_.read_some(rbuf_.prepare(4096), ec);
      if (!ec) rbuf_.commit(n);
    }
    if (ec == asio::error::would_block || ec == asio::error::try_again) break;
    if (ec == asio::error::interrupted) continue;
    if (ec) {
      failOutput(ec == asio::error::eof ? std::string("client closed the connection")
                                        : "client went away: " + ec.message());
      return;
    }
  }
  startWatch();
}

// ---------------------------------------------------------------- stop and end

void Connection::closeForStop() {
  stopped_ = true;
  failOutput("server stopping");
  ErrorCode ignored;
  sock_.shutdown(tcp::socket::shutdown_both, ignored);
  sock_.cancel(ignored);
  notify();
}

void Connection::finalize() {
  if (handlerRunning_) {
    // Only if the coroutine died of an exception while its handler runs: the
    // server must not forget a connection whose handler still runs.
    finalizePending_ = true;
    return;
  }
  if (finalized_) return;
  finalized_ = true;
  failOutput("connection closed");
  if (!handedOff_) {
    ErrorCode ignored;
    sock_.close(ignored);
    --core_->open;
  }
  timer_.cancel();
  if (deferredCounted_) --core_->deferred;
  std::shared_ptr<Deferred::State> d;
  {
    std::lock_guard lk(mu_);
    if (d_) d_->closed = true;
    d = std::move(d_);
  }
  endExchange();
  rbuf_ = beast::flat_buffer();
  {
    std::lock_guard lk(core_->mu);
    if (prev_)
      prev_->next_ = next_;
    else
      core_->head = next_;
    if (next_) next_->prev_ = prev_;
    prev_ = next_ = nullptr;
  }
  core_->leave();
}

// ---------------------------------------------------------------- worker side

void Connection::runHandler() {
  bool closed;
  {
    std::lock_guard lk(mu_);
    closed = outFailed_;  // stopped while queued for a worker: nobody to answer
  }
  try {
    if (!closed) core_->handler(ex_->req, ex_->res);
  } catch (const std::exception& e) {
    log::error(std::string("http handler threw: ") + e.what());
    ex_->broken = true;
  }
  asio::post(strand_, [self = shared_from_this()] {
    self->handlerRunning_ = false;
    if (self->finalizePending_) {
      self->finalize();
      return;
    }
    self->notify();
  });
}

template <class Pred>
bool Connection::waitWorker(std::unique_lock<std::mutex>& lk, Pred pred) {
  // The strand's deadlines end every operation a worker waits on; the only
  // wait they cannot end is one on a runtime whose io threads have stopped.
  while (!pred()) {
    if (cv_.wait_for(lk, std::chrono::seconds(1), pred)) return true;
    if (core_->rt->io().stopped()) return false;
  }
  return true;
}

ErrorCode Connection::workerRead() {
  {
    std::lock_guard lk(mu_);
    opDone_ = false;
  }
  asio::post(strand_, [self = shared_from_this()] { self->startWorkerRead(); });
  std::unique_lock lk(mu_);
  if (!waitWorker(lk, [&] { return opDone_; })) return asio::error::shut_down;
  return opEc_;
}

void Connection::startWorkerRead() {
  if (stopped_) {
    finishWorkerOp(asio::error::shut_down);
    return;
  }
  arm(core_->opts.bodyTimeoutS, Wait::kBody);
  sock_.async_read_some(rbuf_.prepare(kBodyReadBytes),
                        [self = shared_from_this()](ErrorCode ec, size_t n) {
                          Wait fired = self->disarm();
                          if (!ec) {
                            self->rbuf_.commit(n);
                          } else if (self->stopped_) {
                            ec = asio::error::shut_down;
                          } else if (fired == Wait::kBody) {
                            self->countTimeout();
                            ec = asio::error::timed_out;
                          }
                          self->finishWorkerOp(ec);
                        });
}

void Connection::finishWorkerOp(ErrorCode ec) {
  {
    std::lock_guard lk(mu_);
    opDone_ = true;
    opEc_ = ec;
  }
  cv_.notify_all();
}

Result<size_t> Connection::readBody(char* buf, size_t n) {
  Exchange& x = *ex_;
  if (x.preRead) {
    size_t got = std::min(n, x.body.size() - x.bodyOff);
    memcpy(buf, x.body.data() + x.bodyOff, got);
    x.bodyOff += got;
    if (got == 0 && x.readErr) return *x.readErr;
    return got;
  }
  if (x.readErr) return *x.readErr;
  if (n == 0) return size_t(0);
  for (;;) {
    if (x.parser.is_done()) return size_t(0);
    ErrorCode ec;
    bool needRead = false;
    size_t got = parseBody(buf, n, ec, needRead);
    if (ec) {
      x.broken = true;
      x.readErr = Status(Code::kInvalidArgument, "reading request body: " + ec.message());
      return *x.readErr;
    }
    if (got > 0 || x.parser.is_done()) return got;
    if (!needRead) continue;
    if (x.inlineCall || core_->rt->onIoThread()) {
      return Status(Code::kFailedPrecondition, "reading a request body on an io thread");
    }
    ec = workerRead();
    if (ec) {
      x.broken = true;
      if (ec == asio::error::timed_out) {
        x.readErr = Status(Code::kDeadlineExceeded, "reading request body: timed out");
      } else if (ec == asio::error::shut_down) {
        x.readErr = Status(Code::kUnavailable, "reading request body: server stopping");
      } else {
        x.readErr = Status(Code::kInvalidArgument, "reading request body: " + ec.message());
      }
      return *x.readErr;
    }
  }
}

Status Connection::streamHead(Response& r, int status, std::string_view contentType,
                              std::optional<uint64_t> length) {
  Exchange& x = *ex_;
  // The connection can carry another request only if this one's body is off
  // the wire (unread bytes would parse as the next request) and nothing broke.
  // Decide now, while the head can still say so.
  if (x.broken || !bodyReceived()) x.keepAlive = false;
  x.streaming = true;
  return streamBody(formatHead(core_->opts.serverName, status, contentType, r.extraHeaders_,
                               x.keepAlive, length));
}

Status Connection::streamBody(std::string bytes) {
  if (ex_->inlineCall || core_->rt->onIoThread()) {
    return Status(Code::kFailedPrecondition, "streaming a response on an io thread");
  }
  uint64_t mark;
  bool kick;
  {
    std::lock_guard lk(mu_);
    if (outFailed_) {
      ex_->broken = true;
      return unavailableLocked();
    }
    queueLocked(std::move(bytes));
    kick = wantKickLocked();
    mark = queued_;
  }
  if (kick) postKick();
  std::unique_lock lk(mu_);
  if (!waitWorker(lk, [&] { return written_ >= mark || outFailed_; })) {
    ex_->broken = true;
    return Status(Code::kUnavailable, "writing the response: the event loop stopped");
  }
  if (written_ < mark) {
    ex_->broken = true;
    return unavailableLocked();
  }
  return Status::ok();
}

std::shared_ptr<Deferred> Connection::defer(Response& r) {
  auto st = std::make_shared<Deferred::State>();
  st->headers = std::move(r.extraHeaders_);
  st->isHead = ex_->isHead;
  // With the whole body off the wire the handler cannot touch the socket any
  // more (its Response is spent, its reads come from memory): the answer may
  // go out at once, even while the handler runs on ("answer, then work").
  // Else it waits for the handler's return, which settles the body.
  if (bodyReceived()) {
    st->active = true;
    st->keepAlive = ex_->keepAlive && !ex_->broken;
  }
  {
    std::lock_guard lk(mu_);
    d_ = st;
  }
  ex_->deferred = st;
  return std::shared_ptr<Deferred>(new Deferred(shared_from_this(), std::move(st)));
}

// ---------------------------------------------------------------- deferred (any thread)

void Connection::emitHeadLocked(Deferred::State& d) {
  std::optional<uint64_t> len;
  if (!d.chunked) len = d.length;
  queueLocked(
      formatHead(core_->opts.serverName, d.status, d.contentType, d.headers, d.keepAlive, len),
      /*front=*/true);
  d.headEmitted = true;
}

Status Connection::deferredSend(Deferred::State& d, int status, std::string_view ctype,
                                std::string_view body) {
  bool kick;
  {
    std::lock_guard lk(mu_);
    if (d.headSet) return internalError("response already started");
    if (d.closed) return closedLocked(d);
    if (outFailed_) return unavailableLocked();
    d.headSet = d.finished = true;
    d.status = status;
    d.contentType = std::string(ctype);
    d.chunked = false;
    d.length = body.size();
    if (d.active) emitHeadLocked(d);
    if (!d.isHead) queueLocked(std::string(body));
    kick = wantKickLocked();
  }
  if (kick) postKick();
  return Status::ok();
}

Status Connection::deferredBegin(Deferred::State& d, int status, std::string_view ctype) {
  bool kick;
  {
    std::lock_guard lk(mu_);
    if (d.headSet) return internalError("response already started");
    if (d.closed) return closedLocked(d);
    if (outFailed_) return unavailableLocked();
    d.headSet = true;
    d.status = status;
    d.contentType = std::string(ctype);
    d.chunked = true;
    if (d.active) emitHeadLocked(d);
    kick = wantKickLocked();
  }
  if (kick) postKick();
  return Status::ok();
}

Status Connection::deferredWrite(Deferred::State& d, std::string_view data) {
  bool kick;
  {
    std::lock_guard lk(mu_);
    if (!d.headSet || !d.chunked || d.finished) {
      return internalError("write outside a chunked response body");
    }
    if (d.closed) return closedLocked(d);
    if (outFailed_) return unavailableLocked();
    // An empty chunk would end the body; HEAD sends no body.
    if (data.empty() || d.isHead) return Status::ok();
    queueLocked(chunkOf(data));
    kick = wantKickLocked();
  }
  if (kick) postKick();
  return Status::ok();
}

Status Connection::deferredFinish(Deferred::State& d) {
  bool kick;
  {
    std::lock_guard lk(mu_);
    if (d.finished) return Status::ok();
    if (!d.headSet) return internalError("finish before send or beginChunked");
    if (d.closed) return closedLocked(d);
    if (outFailed_) return unavailableLocked();
    d.finished = true;
    if (!d.isHead) queueLocked(std::string(kLastChunk));
    kick = wantKickLocked();
  }
  if (kick) postKick();
  return Status::ok();
}

void Connection::deferredOnGone(Deferred::State& d, std::function<void()> fn) {
  std::function<void()> old;
  bool runSoon = false;
  {
    std::lock_guard lk(mu_);
    if (d.finished) {
      old = std::move(fn);  // never runs
    } else if (d.gone) {
      runSoon = true;
    } else {
      old = std::exchange(d.onGone, std::move(fn));
    }
  }
  if (runSoon) {
    asio::post(strand_, [fn = std::move(fn)] {
      try {
        fn();
      } catch (const std::exception& e) {
        log::error(std::string("http onClientGone threw: ") + e.what());
      }
    });
  }
}

size_t Connection::deferredQueued(const Deferred::State& d) const {
  std::lock_guard lk(mu_);
  if (d.closed || outFailed_) return 0;
  return size_t(queued_ - written_);
}

void Connection::deferredDropped(Deferred::State& d) {
  bool kick = false;
  {
    std::lock_guard lk(mu_);
    if (!d.finished && !d.closed) {
      d.abandoned = true;
      kick = wantKickLocked();
    }
  }
  if (kick) postKick();
}

// ---------------------------------------------------------------- Request, Response, Deferred

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
  Exchange& x = conn_->exchange();
  if (contentLength && *contentLength > limit) {
    if (!conn_->bodyReceived()) conn_->markBroken();
    return Status(Code::kPayloadTooLarge, "request body of " + std::to_string(*contentLength) +
                                              " bytes exceeds " + std::to_string(limit));
  }
  if (x.preRead && !x.readErr) {
    // Already in memory: hand it over without a copy.
    std::string out = x.bodyOff == 0 ? std::move(x.body) : x.body.substr(x.bodyOff);
    x.body.clear();
    x.bodyOff = 0;
    return out;
  }
  std::string out;
  char buf[16384];
  for (;;) {
    ASSIGN_OR_RETURN(size_t n, conn_->readBody(buf, sizeof buf));
    if (n == 0) break;
    out.append(buf, n);
    if (out.size() > limit) {
      if (!conn_->bodyReceived()) conn_->markBroken();
      return Status(Code::kPayloadTooLarge,
                    "request body exceeds " + std::to_string(limit) + " bytes");
    }
  }
  return out;
}

Result<size_t> Request::readSome(char* buf, size_t n) { return conn_->readBody(buf, n); }

bool Request::bodyDone() const { return conn_->bodyDone(); }

void Response::setHeader(std::string name, std::string value) {
  extraHeaders_[std::move(name)] = std::move(value);
}

Status Response::send(int status, std::string_view contentType, std::string_view body) {
  if (started_) return internalError("response already started");
  started_ = finished_ = true;
  Exchange& x = conn_->exchange();
  x.stored = true;
  x.status = status;
  x.contentType = std::string(contentType);
  x.storedBody = std::string(body);
  return Status::ok();
}

Status Response::beginFixed(int status, std::string_view contentType, uint64_t length) {
  if (started_) return internalError("response already started");
  if (conn_->exchange().inlineCall) {
    return Status(Code::kFailedPrecondition, "streaming a response on an io thread");
  }
  started_ = true;
  remaining_ = length;
  return conn_->streamHead(*this, status, contentType, length);
}

Status Response::beginChunked(int status, std::string_view contentType) {
  if (started_) return internalError("response already started");
  if (conn_->exchange().inlineCall) {
    return Status(Code::kFailedPrecondition, "streaming a response on an io thread");
  }
  started_ = true;
  chunked_ = true;
  return conn_->streamHead(*this, status, contentType, std::nullopt);
}

Status Response::write(std::string_view data) {
  Exchange& x = conn_->exchange();
  if (!started_ || finished_ || !x.streaming) return internalError("write outside a response body");
  if (!chunked_) {
    if (data.size() > remaining_) {
      conn_->markBroken();
      return internalError("response body longer than its Content-Length");
    }
    remaining_ -= data.size();
  }
  if (x.isHead || data.empty()) return Status::ok();  // HEAD: headers only
  return conn_->streamBody(chunked_ ? chunkOf(data) : std::string(data));
}

Status Response::finish() {
  if (finished_) return Status::ok();
  Exchange& x = conn_->exchange();
  if (!started_ || !x.streaming) return internalError("finish before a response body");
  finished_ = true;
  if (chunked_) {
    if (x.isHead) return Status::ok();
    return conn_->streamBody(std::string(kLastChunk));
  }
  if (remaining_ != 0) {
    // We promised more bytes than we have: the only honest thing is to drop
    // the connection so the client sees a truncated body, not a short one.
    conn_->markBroken();
    return Status(Code::kInternal, "response body shorter than its Content-Length");
  }
  return Status::ok();
}

std::shared_ptr<Deferred> Response::defer() {
  if (started_) return nullptr;
  started_ = finished_ = true;
  return conn_->defer(*this);
}

Status Response::upgrade(std::string protocol,
                         std::function<void(UniqueFd sock, std::string buffered)> take) {
  if (started_) return internalError("response already started");
  if (!isProtocol(protocol))
    return invalidArg("protocol", "upgrade: bad protocol \"" + protocol + "\"");
  if (!take) return invalidArg("take", "upgrade: no taker for the socket");
  if (!conn_->bodyReceived()) {
    return Status(Code::kFailedPrecondition, "upgrade: the request body has not been read");
  }
  started_ = finished_ = true;
  Exchange& x = conn_->exchange();
  x.upgradeProtocol = std::move(protocol);
  x.take = std::move(take);
  return Status::ok();
}

Deferred::Deferred(std::shared_ptr<Connection> conn, std::shared_ptr<State> st)
    : conn_(std::move(conn)), st_(std::move(st)) {}

Deferred::~Deferred() { conn_->deferredDropped(*st_); }

void Deferred::setHeader(std::string name, std::string value) {
  std::lock_guard lk(conn_->mu());
  if (!st_->headSet) st_->headers[std::move(name)] = std::move(value);
}

Status Deferred::send(int status, std::string_view contentType, std::string_view body) {
  return conn_->deferredSend(*st_, status, contentType, body);
}

Status Deferred::beginChunked(int status, std::string_view contentType) {
  return conn_->deferredBegin(*st_, status, contentType);
}

Status Deferred::write(std::string_view data) { return conn_->deferredWrite(*st_, data); }

Status Deferred::finish() { return conn_->deferredFinish(*st_); }

void Deferred::onClientGone(std::function<void()> fn) {
  conn_->deferredOnGone(*st_, std::move(fn));
}

bool Deferred::gone() const {
  std::lock_guard lk(conn_->mu());
  return st_->gone;
}

size_t Deferred::queuedBytes() const { return conn_->deferredQueued(*st_); }

// ---------------------------------------------------------------- Server

namespace {

void admit(const std::shared_ptr<ServerCore>& core, int fd) {
  const ServerOptions& o = core->opts;
  if (o.maxConnections > 0 && core->open.load() >= o.maxConnections) {
    ++core->refused;
    rejectConnection(fd, o.serverName, "too many connections");
    return;
  }
  auto conn = std::make_shared<Connection>(core, asio::make_strand(core->rt->io()));
  if (!conn->adopt(fd)) return;
  {
    std::lock_guard lk(core->mu);
    if (core->stopping) return;  // conn closes its socket as it goes
    conn->next_ = core->head;
    if (core->head) core->head->prev_ = conn.get();
    core->head = conn.get();
    ++core->live;
  }
  ++core->open;
  ++core->accepted;
  conn->start();
}

asio::awaitable<void> acceptLoop(std::shared_ptr<ServerCore> core) {
  Acceptor& a = core->acceptor;
  SteadyTimer backoff(core->acceptStrand);
  ErrorCode ec;
  auto lastWarn = Clock::time_point();
  auto pause = [&](std::string_view why) -> asio::awaitable<void> {
    if (Clock::now() - lastWarn > std::chrono::seconds(1)) {
      log::warn("accept: " + std::string(why));
      lastWarn = Clock::now();
    }
    backoff.expires_after(std::chrono::milliseconds(50));
    ErrorCode ignored;
    co_await backoff.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  };
  while (!core->stopping) {
    co_await a.async_wait(tcp::acceptor::wait_read, asio::redirect_error(asio::use_awaitable, ec));
    if (core->stopping) break;
    if (ec) {
      co_await pause(ec.message());
      continue;
    }
    int accepted = 0;
    while (accepted < kAcceptBurst && !core->stopping) {
      // accept4(SOCK_CLOEXEC) rather than Asio's accept + fcntl: handlers fork
      // sandboxes on other threads at any moment, and a child forked between
      // accept and fcntl would inherit the connection and hold it open.
      int fd = ::accept4(a.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err != EAGAIN && err != EWOULDBLOCK) co_await pause(std::strerror(err));
        break;
      }
      ++accepted;
      admit(core, fd);
    }
    // A burst's worth: let the connections just admitted (and everything else
    // on this io thread) run before accepting more.
    if (accepted == kAcceptBurst) co_await asio::post(core->acceptStrand, asio::use_awaitable);
  }
  ErrorCode ignored;
  a.close(ignored);
}

}  // namespace

struct Server::Impl {
  std::shared_ptr<ServerCore> core;
};

Server::Server(ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  Runtime* rt = opts.runtime ? opts.runtime : &Runtime::global();
  impl_->core = std::make_shared<ServerCore>(std::move(opts), rt);
}

Server::~Server() { stop(); }

Status Server::listen() {
  ServerCore& c = *impl_->core;
  ErrorCode ec;
  auto addr = asio::ip::make_address(c.opts.host, ec);
  if (ec) return invalidArg("listen", "bad listen address " + c.opts.host);
  tcp::endpoint ep(addr, c.opts.port);
  auto& a = c.acceptor;
  a.open(ep.protocol(), ec);
  // Asio opens sockets without SOCK_CLOEXEC; every child (sandbox, helper)
  // would inherit the listening socket and keep the port bound after we exit.
  if (!ec && ::fcntl(a.native_handle(), F_SETFD, FD_CLOEXEC) != 0) {
    ec.assign(errno, boost::system::system_category());
  }
  if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) a.non_blocking(true, ec);  // accept4() on readiness must not block
  if (ec) {
    ErrorCode ignored;
    a.close(ignored);
    return Status(Code::kUnavailable, "listen on " + c.opts.host + ":" +
                                          std::to_string(c.opts.port) + ": " + ec.message());
  }
  c.protocol = ep.protocol();
  return Status::ok();
}

uint16_t Server::port() const {
  ErrorCode ec;
  return impl_->core->acceptor.local_endpoint(ec).port();
}

void Server::serve(Handler handler) {
  start(std::move(handler));
  wait();
}

void Server::start(Handler handler) {
  std::shared_ptr<ServerCore> core = impl_->core;
  {
    std::lock_guard lk(core->mu);
    if (core->stopping) return;
    core->handler = std::move(handler);
    core->serving = true;
    ++core->live;
  }
  asio::co_spawn(core->acceptStrand, acceptLoop(core), [core](std::exception_ptr e) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        log::error(std::string("http accept loop: ") + ex.what());
      }
    }
    core->leave();
  });
}

void Server::wait() {
  std::shared_ptr<ServerCore> core = impl_->core;
  Handler gone;
  {
    std::unique_lock lk(core->mu);
    core->cv.wait(lk, [&] { return core->live == 0; });
    // The handler's last reference dies here, not on some io thread later.
    gone = std::move(core->handler);
    core->handler = nullptr;
  }
}

void Server::stop() {
  std::shared_ptr<ServerCore> core = impl_->core;
  if (core->stopping.exchange(true)) return;
  std::lock_guard lk(core->mu);
  if (core->serving) {
    // The accept loop owns the acceptor: close it on its strand.
    asio::post(core->acceptStrand, [core] {
      ErrorCode ignored;
      core->acceptor.cancel(ignored);
      core->acceptor.close(ignored);
    });
  } else {
    // No loop will ever run (serve() checks stopping under mu): free the port now.
    ErrorCode ignored;
    core->acceptor.close(ignored);
  }
  for (Connection* c = core->head; c; c = c->next_) c->postCloseForStop();
}

ServerStats Server::stats() const {
  const ServerCore& c = *impl_->core;
  ServerStats s;
  s.openConnections = c.open.load();
  s.inFlight = c.inFlight.load();
  s.peakInFlight = c.peakInFlight.load();
  s.deferredInFlight = c.deferred.load();
  s.acceptedTotal = c.accepted.load();
  s.refusedTotal = c.refused.load();
  s.timedOutTotal = c.timedOut.load();
  s.maxConnections = c.opts.maxConnections;
  return s;
}

}  // namespace dsec::http
