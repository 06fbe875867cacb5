// dsec-link-bench: the platform-edge link's protocol, chosen by measurement.
// The same call semantics over (a) our framed link (proto/link.h) and (b)
// HTTP/2 with nghttp2 (method in :path, args as the request body; the
// response body carries events, data and the reply as messages of
// [u8 type][u32 length][payload]), each between this process (the client,
// the platform's side) and a server child process (the edge's side), on the
// same Asio Runtime (1 io thread each side) and plain loopback TCP. The
// framed link does its upgrade and handshake once per connection, before
// anything is measured; HTTP/2 starts with prior knowledge (h2c).
//
// Measures, per protocol: unary calls/s and latency p50/p99 at 1, 64 and
// 1,024 calls in flight (closed loop); 32,768 held calls (each answered with
// one event, then held until released): memory per call on each end (RSS)
// and CPU per call on each end to open and complete them; a 64 MiB stream
// from the server while 16 small calls at a time run beside it.
//
// Prints JSON lines as it goes, then one summary line
// {"bench":"link",...} with ratios framed / h2.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/runtime.h"
#include "proto/link.h"

namespace asio = boost::asio;
using json = nlohmann::json;
using dsec::Code;
using dsec::Result;
using dsec::Runtime;
using dsec::RuntimeOptions;
using dsec::Status;

namespace {

constexpr char kKey[] = "bench-key";
constexpr char kNode[] = "bench-node";
constexpr size_t kChunk = 64u << 10;  // data per send / per HTTP/2 DATA frame
constexpr size_t kEchoArgs = 100;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void emit(const json& j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "dsec-link-bench: %s\n", msg.c_str());
  std::exit(1);
}

const std::string& pattern() {
  static const std::string p = [] {
    std::string s(kChunk, '\0');
    for (size_t i = 0; i < s.size(); ++i) s[i] = char((i * 131) >> 3);
    return s;
  }();
  return p;
}

// ---- process figures ----------------------------------------------------------

int64_t rssBytes(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "r");
  if (!f) return 0;
  char line[256];
  int64_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) kb = std::atoll(line + 6);
  }
  std::fclose(f);
  return kb * 1024;
}

// CPU time of all threads of pid, in seconds (schedstat: nanoseconds).
double cpuSeconds(pid_t pid) {
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (!d) return 0;
  double total = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    FILE* f = std::fopen((dir + "/" + e->d_name + "/schedstat").c_str(), "r");
    if (!f) continue;
    unsigned long long ns = 0;
    if (std::fscanf(f, "%llu", &ns) == 1) total += double(ns) / 1e9;
    std::fclose(f);
  }
  closedir(d);
  return total;
}

double loadavg1() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  double l = 0;
  if (f) {
    if (std::fscanf(f, "%lf", &l) != 1) l = 0;
    std::fclose(f);
  }
  return l;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double k = (double(v.size()) - 1) * p / 100.0;
  size_t lo = size_t(k);
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (k - double(lo));
}

// ---- the common client interface -------------------------------------------------

struct Handler {
  std::function<void(std::string_view)> onEvent;
  std::function<void(std::string_view)> onData;
  std::function<void(bool ok, std::string_view reply)> onDone;
};

class BenchClient {
 public:
  virtual ~BenchClient() = default;
  virtual void start(const std::string& method, const std::string& args, Handler h) = 0;
};

class FramedClient : public BenchClient {
 public:
  FramedClient(Runtime& rt, uint16_t port) {
    dsec::proto::LinkClientOptions o;
    o.host = "127.0.0.1";
    o.port = port;
    o.key = kKey;
    o.node = kNode;
    client_ = std::make_unique<dsec::proto::LinkClient>(rt, o);
    auto r = client_->unary("echo", "hello", 30);
    if (!r.isOk()) die("framed link: " + r.status().toString());
  }
  void start(const std::string& method, const std::string& args, Handler h) override {
    dsec::proto::CallHandler ch;
    if (h.onEvent) ch.onEvent = std::move(h.onEvent);
    if (h.onData) ch.onData = std::move(h.onData);
    ch.onDone = [done = std::move(h.onDone)](Result<std::string> r) {
      if (r.isOk()) {
        done(true, *r);
      } else {
        done(false, r.status().message());
      }
    };
    client_->start(method, args, std::move(ch));
  }

 private:
  std::unique_ptr<dsec::proto::LinkClient> client_;
};

// Body messages of the HTTP/2 side: [u8 type][u32 length][payload].
void appendMsg(std::string& out, char type, std::string_view payload) {
  out.push_back(type);
  uint32_t n = uint32_t(payload.size());
  char b[4] = {char(n & 0xff), char((n >> 8) & 0xff), char((n >> 16) & 0xff),
               char((n >> 24) & 0xff)};
  out.append(b, 4);
  out.append(payload);
}
std::string msgHeader(char type, uint64_t len) {
  std::string out;
  out.push_back(type);
  uint32_t n = uint32_t(len);
  char b[4] = {char(n & 0xff), char((n >> 8) & 0xff), char((n >> 16) & 0xff),
               char((n >> 24) & 0xff)};
  out.append(b, 4);
  return out;
}

// One HTTP/2 connection driven through nghttp2 on a strand: the socket I/O
// loop both roles share.
class H2Conn : public std::enable_shared_from_this<H2Conn> {
 public:
  H2Conn(Runtime& rt, int fd) : strand_(asio::make_strand(rt.io())), sock_(strand_) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    sock_.assign(fd);
    rbuf_.resize(256u << 10);
  }
  virtual ~H2Conn() {
    if (session_) nghttp2_session_del(session_);
  }

  void begin() {
    auto self = shared_from_this();
    asio::dispatch(strand_, [self] {
      self->flush();
      self->readLoop();
    });
  }
  // Runs fn on the strand (inline when already there), then flushes.
  void run(std::function<void()> fn) {
    auto self = shared_from_this();
    asio::dispatch(strand_, [self, fn = std::move(fn)] {
      fn();
      self->flush();
    });
  }

 protected:
  static void settings(nghttp2_session* s) {
    nghttp2_settings_entry iv[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 1u << 20},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 256u << 10},  // as the link's
        {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, uint32_t(kChunk)},
    };
    nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, iv, 3);
    // The link has no connection window; give HTTP/2 one that never binds.
    nghttp2_session_set_local_window_size(s, NGHTTP2_FLAG_NONE, 0, (1u << 31) - 1);
  }
  static void commonCallbacks(nghttp2_session_callbacks* cbs) {
    nghttp2_session_callbacks_set_data_source_read_length_callback(
        cbs,
        [](nghttp2_session*, uint8_t, int32_t, int32_t sessionWindow, int32_t streamWindow,
           uint32_t peerMax, void*) -> ssize_t {
          return std::min<ssize_t>({ssize_t(kChunk), sessionWindow, streamWindow, peerMax});
        });
  }

  void flush() {
    if (writing_ || dead_) return;
    wbuf_.clear();
    while (wbuf_.size() < (256u << 10)) {
      const uint8_t* data;
      ssize_t n = nghttp2_session_mem_send(session_, &data);
      if (n < 0) {
        std::fprintf(stderr, "h2 send: %s\n", nghttp2_strerror(int(n)));
        dead_ = true;
        return;
      }
      if (n == 0) break;
      wbuf_.append(reinterpret_cast<const char*>(data), size_t(n));
    }
    if (wbuf_.empty()) return;
    writing_ = true;
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(wbuf_),
                      [self](const boost::system::error_code& ec, size_t) {
                        self->writing_ = false;
                        if (ec) {
                          self->dead_ = true;
                          return;
                        }
                        self->flush();
                      });
  }

  void readLoop() {
    auto self = shared_from_this();
    sock_.async_read_some(
        asio::buffer(rbuf_), [self](const boost::system::error_code& ec, size_t n) {
          if (ec) {
            self->dead_ = true;
            self->closed();
            return;
          }
          ssize_t r = nghttp2_session_mem_recv(
              self->session_, reinterpret_cast<const uint8_t*>(self->rbuf_.data()), n);
          if (r < 0) {
            std::fprintf(stderr, "h2 recv: %s\n", nghttp2_strerror(int(r)));
            self->dead_ = true;
            return;
          }
          self->flush();
          self->readLoop();
        });
  }
  virtual void closed() {}

  asio::strand<asio::io_context::executor_type> strand_;
  asio::posix::stream_descriptor sock_;
  nghttp2_session* session_ = nullptr;
  std::vector<char> rbuf_;
  std::string wbuf_;
  bool writing_ = false, dead_ = false;
};

class H2Client : public H2Conn, public BenchClient {
 public:
  static std::shared_ptr<H2Client> connect(Runtime& rt, uint16_t port) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("h2 connect");
    auto c = std::make_shared<H2Client>(rt, fd);
    nghttp2_session_callbacks* cbs;
    nghttp2_session_callbacks_new(&cbs);
    commonCallbacks(cbs);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, onChunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, onClose);
    nghttp2_session_callbacks_set_on_header_callback(cbs, onHeader);
    nghttp2_session_client_new(&c->session_, cbs, c.get());
    nghttp2_session_callbacks_del(cbs);
    settings(c->session_);
    c->begin();
    return c;
  }
  H2Client(Runtime& rt, int fd) : H2Conn(rt, fd) {}

  void start(const std::string& method, const std::string& args, Handler h) override {
    auto* c = new Call;  // owned by the stream: deleted when it closes
    c->h = std::move(h);
    c->args = args;
    std::string path = "/" + method;
    run([this, c, path] {
      nghttp2_nv nva[] = {
          nv(":method", "POST"),
          nv(":scheme", "http"),
          nv(":authority", "edge"),
          nv(":path", path),
      };
      nghttp2_data_provider prd;
      prd.source.ptr = c;
      prd.read_callback = readArgs;
      int32_t id = nghttp2_submit_request(session_, nullptr, nva, 4, &prd, c);
      if (id < 0) {
        c->h.onDone(false, nghttp2_strerror(id));
        delete c;
      }
    });
  }

 private:
  struct Call {
    Handler h;
    std::string args;
    size_t argsOff = 0;
    std::string hdr, msg, reply;
    char type = 0;
    uint32_t len = 0, got = 0;
    bool inMsg = false, gotReply = false, ok200 = false;
  };
  static nghttp2_nv nv(const char* name, const std::string& value) {
    return {reinterpret_cast<uint8_t*>(const_cast<char*>(name)),
            reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), std::strlen(name),
            value.size(), NGHTTP2_NV_FLAG_NO_COPY_NAME};
  }
  static ssize_t readArgs(nghttp2_session*, int32_t, uint8_t* buf, size_t length, uint32_t* flags,
                          nghttp2_data_source* src, void*) {
    auto* c = static_cast<Call*>(src->ptr);
    size_t n = std::min(length, c->args.size() - c->argsOff);
    std::memcpy(buf, c->args.data() + c->argsOff, n);
    c->argsOff += n;
    if (c->argsOff == c->args.size()) *flags |= NGHTTP2_DATA_FLAG_EOF;
    return ssize_t(n);
  }
  static int onHeader(nghttp2_session* s, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t, void*) {
    if (frame->hd.type != NGHTTP2_HEADERS) return 0;
    auto* c = static_cast<Call*>(nghttp2_session_get_stream_user_data(s, frame->hd.stream_id));
    if (c && std::string_view(reinterpret_cast<const char*>(name), namelen) == ":status" &&
        std::string_view(reinterpret_cast<const char*>(value), valuelen) == "200") {
      c->ok200 = true;
    }
    return 0;
  }
  static int onChunk(nghttp2_session* s, uint8_t, int32_t id, const uint8_t* data, size_t len,
                     void*) {
    auto* c = static_cast<Call*>(nghttp2_session_get_stream_user_data(s, id));
    if (!c) return 0;
    const char* p = reinterpret_cast<const char*>(data);
    while (len > 0) {
      if (!c->inMsg) {
        size_t take = std::min(len, 5 - c->hdr.size());
        c->hdr.append(p, take);
        p += take;
        len -= take;
        if (c->hdr.size() == 5) {
          c->type = c->hdr[0];
          const auto* u = reinterpret_cast<const unsigned char*>(c->hdr.data() + 1);
          c->len = uint32_t(u[0]) | (uint32_t(u[1]) << 8) | (uint32_t(u[2]) << 16) |
                   (uint32_t(u[3]) << 24);
          c->got = 0;
          c->inMsg = true;
          c->hdr.clear();
        } else {
          continue;
        }
      }
      size_t take = std::min<size_t>(len, c->len - c->got);
      if (c->type == 'D') {
        if (c->h.onData && take) c->h.onData(std::string_view(p, take));
      } else {
        c->msg.append(p, take);
      }
      p += take;
      len -= take;
      c->got += uint32_t(take);
      if (c->got == c->len) {
        if (c->type == 'E') {
          if (c->h.onEvent) c->h.onEvent(c->msg);
        } else if (c->type == 'R') {
          c->reply = std::move(c->msg);
          c->gotReply = true;
        }
        c->msg.clear();
        c->inMsg = false;
      }
    }
    return 0;
  }
  static int onClose(nghttp2_session* s, int32_t id, uint32_t err, void*) {
    auto* c = static_cast<Call*>(nghttp2_session_get_stream_user_data(s, id));
    if (!c) return 0;
    bool ok = err == 0 && c->ok200 && c->gotReply;
    if (c->h.onDone) c->h.onDone(ok, ok ? std::string_view(c->reply) : "stream failed");
    delete c;
    return 0;
  }
};

// ---- servers -----------------------------------------------------------------------

int listenLoopback(uint16_t* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 16) != 0) {
    die("listen");
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

// The edge's side over the framed link.
class FramedServer {
 public:
  explicit FramedServer(Runtime& rt)
      : rt_(rt),
        server_(
            rt, [](const std::string&) -> Result<std::string> { return std::string(kKey); },
            [this](std::shared_ptr<dsec::proto::ServerCall> c) { dispatch(std::move(c)); }) {}

  void accept(int fd) {
    // The HTTP side of the upgrade, as the edge's HTTP server does it.
    std::string buf;
    char tmp[4096];
    size_t e;
    while ((e = buf.find("\r\n\r\n")) == std::string::npos) {
      ssize_t n = ::read(fd, tmp, sizeof tmp);
      if (n <= 0) {
        ::close(fd);
        return;
      }
      buf.append(tmp, size_t(n));
    }
    std::string answer = dsec::proto::linkUpgradeResponse();
    if (::write(fd, answer.data(), answer.size()) != ssize_t(answer.size())) die("write 101");
    server_.adopt(dsec::UniqueFd(fd), buf.substr(e + 4));
  }

 private:
  struct Producer : std::enable_shared_from_this<Producer> {
    std::shared_ptr<dsec::proto::ServerCall> c;
    uint64_t left = 0;
    void pump() {
      while (left > 0) {
        size_t n = size_t(std::min<uint64_t>(kChunk, left));
        Status st = c->send(std::string_view(pattern().data(), n));
        if (st.code() == Code::kResourceExhausted) return;
        if (!st.isOk()) return;
        left -= n;
      }
      (void)c->end();
      (void)c->reply("done");
      c->onWritable(nullptr);
    }
  };

  void dispatch(std::shared_ptr<dsec::proto::ServerCall> c) {
    const std::string& m = c->method();
    if (m == "echo") {
      (void)c->reply(c->args());
    } else if (m == "hold") {
      (void)c->event("started");
      std::lock_guard lk(mu_);
      held_.push_back(std::move(c));
    } else if (m == "release") {
      std::vector<std::shared_ptr<dsec::proto::ServerCall>> held;
      {
        std::lock_guard lk(mu_);
        held.swap(held_);
      }
      for (auto& h : held) (void)h->reply("released");
      (void)c->reply(std::to_string(held.size()));
    } else if (m == "download") {
      auto p = std::make_shared<Producer>();
      p->c = c;
      p->left = std::stoull(c->args());
      c->onWritable([p] { p->pump(); });
      p->pump();
    } else {
      (void)c->fail(Status(Code::kNotFound, "no method " + m));
    }
  }

  Runtime& rt_;
  dsec::proto::LinkServer server_;
  std::mutex mu_;  // guards held_
  std::vector<std::shared_ptr<dsec::proto::ServerCall>> held_;
};

// The edge's side over HTTP/2.
class H2ServerConn : public H2Conn {
 public:
  static std::shared_ptr<H2ServerConn> make(Runtime& rt, int fd) {
    auto c = std::make_shared<H2ServerConn>(rt, fd);
    nghttp2_session_callbacks* cbs;
    nghttp2_session_callbacks_new(&cbs);
    commonCallbacks(cbs);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, onBeginHeaders);
    nghttp2_session_callbacks_set_on_header_callback(cbs, onHeader);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, onChunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, onFrame);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, onClose);
    nghttp2_session_server_new(&c->session_, cbs, c.get());
    nghttp2_session_callbacks_del(cbs);
    settings(c->session_);
    c->begin();
    return c;
  }
  H2ServerConn(Runtime& rt, int fd) : H2Conn(rt, fd) {}

 private:
  struct Req {
    int32_t id = 0;
    std::string path, body;
    std::string out;  // bytes to send first
    size_t outOff = 0;
    uint64_t dl = 0;   // then this many pattern bytes
    std::string tail;  // then this
    size_t tailOff = 0;
    bool finished = false;  // EOF after all of it
    bool deferred = false;
  };

  static int onBeginHeaders(nghttp2_session* s, const nghttp2_frame* frame, void*) {
    if (frame->hd.type != NGHTTP2_HEADERS) return 0;
    auto* r = new Req;
    r->id = frame->hd.stream_id;
    nghttp2_session_set_stream_user_data(s, r->id, r);
    return 0;
  }
  static int onHeader(nghttp2_session* s, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t, void*) {
    auto* r = static_cast<Req*>(nghttp2_session_get_stream_user_data(s, frame->hd.stream_id));
    if (r && std::string_view(reinterpret_cast<const char*>(name), namelen) == ":path") {
      r->path.assign(reinterpret_cast<const char*>(value), valuelen);
    }
    return 0;
  }
  static int onChunk(nghttp2_session* s, uint8_t, int32_t id, const uint8_t* data, size_t len,
                     void*) {
    auto* r = static_cast<Req*>(nghttp2_session_get_stream_user_data(s, id));
    if (r) r->body.append(reinterpret_cast<const char*>(data), len);
    return 0;
  }
  static int onFrame(nghttp2_session* s, const nghttp2_frame* frame, void* user) {
    if ((frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) ||
        !(frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
      return 0;
    }
    auto* r = static_cast<Req*>(nghttp2_session_get_stream_user_data(s, frame->hd.stream_id));
    if (r) static_cast<H2ServerConn*>(user)->dispatch(r);
    return 0;
  }
  static int onClose(nghttp2_session* s, int32_t id, uint32_t, void* user) {
    auto* r = static_cast<Req*>(nghttp2_session_get_stream_user_data(s, id));
    if (!r) return 0;
    static_cast<H2ServerConn*>(user)->held_.erase(id);
    delete r;
    return 0;
  }
  static ssize_t readBody(nghttp2_session*, int32_t, uint8_t* buf, size_t length, uint32_t* flags,
                          nghttp2_data_source* src, void*) {
    auto* r = static_cast<Req*>(src->ptr);
    size_t n = 0;
    if (r->outOff < r->out.size()) {
      n = std::min(length, r->out.size() - r->outOff);
      std::memcpy(buf, r->out.data() + r->outOff, n);
      r->outOff += n;
      if (r->outOff == r->out.size()) {
        r->out.clear();
        r->outOff = 0;
      }
    } else if (r->dl > 0) {
      n = size_t(std::min<uint64_t>({length, r->dl, kChunk}));
      std::memcpy(buf, pattern().data(), n);
      r->dl -= n;
    } else if (r->tailOff < r->tail.size()) {
      n = std::min(length, r->tail.size() - r->tailOff);
      std::memcpy(buf, r->tail.data() + r->tailOff, n);
      r->tailOff += n;
    }
    bool drained = r->out.empty() && r->dl == 0 && r->tailOff == r->tail.size();
    if (drained && r->finished) {
      *flags |= NGHTTP2_DATA_FLAG_EOF;
      return ssize_t(n);
    }
    if (n == 0) {
      r->deferred = true;
      return NGHTTP2_ERR_DEFERRED;
    }
    return ssize_t(n);
  }

  void respond(Req* r) {
    static const std::string k200 = "200";
    nghttp2_nv nva[] = {{reinterpret_cast<uint8_t*>(const_cast<char*>(":status")),
                         reinterpret_cast<uint8_t*>(const_cast<char*>(k200.data())), 7, 3,
                         NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE}};
    nghttp2_data_provider prd;
    prd.source.ptr = r;
    prd.read_callback = readBody;
    nghttp2_submit_response(session_, r->id, nva, 1, &prd);
  }

  void dispatch(Req* r) {
    if (r->path == "/echo") {
      appendMsg(r->out, 'R', r->body);
      r->finished = true;
      respond(r);
    } else if (r->path == "/hold") {
      appendMsg(r->out, 'E', "started");
      held_[r->id] = r;
      respond(r);
    } else if (r->path == "/release") {
      size_t n = 0;
      for (auto& [id, h] : held_) {
        if (h == r) continue;
        appendMsg(h->out, 'R', "released");
        h->finished = true;
        if (h->deferred) {
          h->deferred = false;
          nghttp2_session_resume_data(session_, id);
        }
        ++n;
      }
      held_.clear();
      appendMsg(r->out, 'R', std::to_string(n));
      r->finished = true;
      respond(r);
    } else if (r->path == "/download") {
      r->dl = std::stoull(r->body);
      r->out = msgHeader('D', r->dl);
      appendMsg(r->tail, 'R', "done");
      r->finished = true;
      respond(r);
    } else {
      appendMsg(r->out, 'R', "no method");
      r->finished = true;
      respond(r);
    }
  }

  std::unordered_map<int32_t, Req*> held_;  // strand only
};

int serveMain(const std::string& proto) {
  Runtime rt(RuntimeOptions{1, 2});
  uint16_t port;
  int lfd = listenLoopback(&port);
  std::printf("port %u\n", port);
  std::fflush(stdout);
  std::unique_ptr<FramedServer> framed;
  std::vector<std::shared_ptr<H2ServerConn>> h2;
  if (proto == "framed") framed = std::make_unique<FramedServer>(rt);
  std::thread acceptor([&] {
    for (;;) {
      int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      if (framed) {
        framed->accept(fd);
      } else {
        h2.push_back(H2ServerConn::make(rt, fd));
      }
    }
  });
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  std::fflush(stdout);
  ::_exit(0);  // no teardown: the parent is done with us
}

// ---- the measurements ------------------------------------------------------------

struct ServerProc {
  pid_t pid = -1;
  int toChild = -1;
  uint16_t port = 0;
  void start(const std::string& proto) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) die("pipe");
    pid = ::fork();
    if (pid == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      const char* argv[] = {"dsec-link-bench", "--serve", proto.c_str(), nullptr};
      ::execv("/proc/self/exe", const_cast<char* const*>(argv));
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    toChild = in[1];
    std::string line;
    char ch;
    while (::read(out[0], &ch, 1) == 1 && ch != '\n') line.push_back(ch);
    ::close(out[0]);
    if (line.rfind("port ", 0) != 0) die("server child did not start");
    port = uint16_t(std::atoi(line.c_str() + 5));
  }
  void stop() {
    if (pid < 0) return;
    ::close(toChild);
    int st;
    ::waitpid(pid, &st, 0);
    pid = -1;
  }
};

bool waitUntil(const std::function<bool()>& pred, double seconds) {
  double end = now() + seconds;
  while (!pred()) {
    if (now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Closed loop: `inflight` echo calls at all times for `seconds`.
json unary(BenchClient& c, const std::string& proto, int inflight, double seconds) {
  struct State {
    std::mutex mu;  // guards lat
    std::vector<double> lat;
    std::atomic<bool> stop{false};
    std::atomic<int> outstanding{0};
    std::atomic<uint64_t> failed{0};
  };
  auto st = std::make_shared<State>();
  st->lat.reserve(1u << 20);
  std::string args(kEchoArgs, 'a');
  auto issue = std::make_shared<std::function<void()>>();
  *issue = [&c, st, args, issue] {
    double t0 = now();
    Handler h;
    h.onDone = [st, t0, issue](bool ok, std::string_view) {
      double dt = now() - t0;
      if (!ok) ++st->failed;
      {
        std::lock_guard lk(st->mu);
        st->lat.push_back(dt);
      }
      if (!st->stop) {
        (*issue)();
      } else {
        --st->outstanding;
      }
    };
    c.start("echo", args, std::move(h));
  };
  st->outstanding = inflight;
  double t0 = now();
  for (int i = 0; i < inflight; ++i) (*issue)();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  st->stop = true;
  double t1 = now();
  size_t n;
  {
    std::lock_guard lk(st->mu);
    n = st->lat.size();
  }
  if (!waitUntil([&] { return st->outstanding.load() == 0; }, 60)) die("unary calls never ended");
  *issue = nullptr;  // breaks the cycle
  std::vector<double> lat;
  {
    std::lock_guard lk(st->mu);
    lat = st->lat;
  }
  json j = {{"event", "unary"},
            {"proto", proto},
            {"inflight", inflight},
            {"calls", lat.size()},
            {"failed", st->failed.load()},
            {"calls_per_s", double(n) / (t1 - t0)},
            {"p50_us", percentile(lat, 50) * 1e6},
            {"p99_us", percentile(lat, 99) * 1e6}};
  emit(j);
  return j;
}

json held(BenchClient& c, const std::string& proto, int n, pid_t server) {
  pid_t self = ::getpid();
  // Let the allocator settle, then the baseline.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int64_t rssC0 = rssBytes(self), rssS0 = rssBytes(server);
  double cpuC0 = cpuSeconds(self), cpuS0 = cpuSeconds(server);
  std::atomic<int> started{0}, done{0}, failed{0};
  double t0 = now();
  for (int i = 0; i < n; ++i) {
    Handler h;
    h.onEvent = [&](std::string_view) { ++started; };
    h.onDone = [&](bool ok, std::string_view r) {
      if (!ok || r != "released") ++failed;
      ++done;
    };
    c.start("hold", "", std::move(h));
  }
  if (!waitUntil([&] { return started.load() + failed.load() >= n; }, 120)) {
    die(proto + ": held calls did not all start (" + std::to_string(started.load()) + ")");
  }
  double tOpen = now() - t0;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int64_t rssC1 = rssBytes(self), rssS1 = rssBytes(server);
  std::atomic<bool> released{false};
  Handler rel;
  rel.onDone = [&](bool ok, std::string_view r) {
    if (!ok || r != std::to_string(n))
      std::fprintf(stderr, "release answered %s\n", std::string(r).c_str());
    released = true;
  };
  c.start("release", "", std::move(rel));
  if (!waitUntil([&] { return done.load() == n && released.load(); }, 120)) {
    die(proto + ": held calls did not all end");
  }
  double tAll = now() - t0;
  double cpuC1 = cpuSeconds(self), cpuS1 = cpuSeconds(server);
  json j = {{"event", "held"},
            {"proto", proto},
            {"calls", n},
            {"failed", failed.load()},
            {"open_s", tOpen},
            {"open_and_complete_s", tAll},
            {"client_bytes_per_call", double(rssC1 - rssC0) / n},
            {"server_bytes_per_call", double(rssS1 - rssS0) / n},
            {"client_cpu_us_per_call", (cpuC1 - cpuC0) * 1e6 / n},
            {"server_cpu_us_per_call", (cpuS1 - cpuS0) * 1e6 / n}};
  emit(j);
  return j;
}

json stream(BenchClient& c, const std::string& proto, uint64_t bytes, int smallInflight) {
  struct State {
    std::mutex mu;  // guards lat
    std::vector<double> lat;
    std::atomic<bool> stop{false};
    std::atomic<int> outstanding{0};
  };
  auto st = std::make_shared<State>();
  std::string args(kEchoArgs, 's');
  auto issue = std::make_shared<std::function<void()>>();
  *issue = [&c, st, args, issue] {
    double t0 = now();
    Handler h;
    h.onDone = [st, t0, issue](bool, std::string_view) {
      {
        std::lock_guard lk(st->mu);
        st->lat.push_back(now() - t0);
      }
      if (!st->stop) {
        (*issue)();
      } else {
        --st->outstanding;
      }
    };
    c.start("echo", args, std::move(h));
  };
  std::atomic<uint64_t> got{0};
  std::atomic<bool> dlDone{false}, dlOk{false};
  st->outstanding = smallInflight;
  for (int i = 0; i < smallInflight; ++i) (*issue)();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  double t0 = now();
  Handler h;
  h.onData = [&](std::string_view d) { got += d.size(); };
  h.onDone = [&](bool ok, std::string_view) {
    dlOk = ok;
    dlDone = true;
  };
  c.start("download", std::to_string(bytes), std::move(h));
  if (!waitUntil([&] { return dlDone.load(); }, 300)) die(proto + ": download did not end");
  double dt = now() - t0;
  st->stop = true;
  std::vector<double> lat;
  {
    std::lock_guard lk(st->mu);
    lat = st->lat;
  }
  if (!waitUntil([&] { return st->outstanding.load() == 0; }, 60)) die("small calls never ended");
  *issue = nullptr;
  if (!dlOk || got.load() != bytes) die(proto + ": download incomplete");
  json j = {{"event", "stream"},
            {"proto", proto},
            {"mib", double(bytes) / (1 << 20)},
            {"seconds", dt},
            {"mib_per_s", double(bytes) / (1 << 20) / dt},
            {"small_inflight", smallInflight},
            {"small_calls", lat.size()},
            {"small_p50_us", percentile(lat, 50) * 1e6},
            {"small_p99_us", percentile(lat, 99) * 1e6}};
  emit(j);
  return j;
}

struct Args {
  std::vector<std::string> protos = {"framed", "h2"};
  std::string one;  // internal: measure this protocol in this process
  double seconds = 2;
  int held = 32768;
  uint64_t streamMiB = 64;
  std::vector<int> levels = {1, 64, 1024};
};

void usage() {
  std::fprintf(stderr,
               "usage: dsec-link-bench [--proto framed|h2|both] [--seconds S] [--held N]\n"
               "                       [--stream-mib M] [--quick]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (k == "--serve") {
      return serveMain(val());
    } else if (k == "--one") {
      a.one = val();
    } else if (k == "--proto") {
      std::string p = val();
      if (p == "both") {
        a.protos = {"framed", "h2"};
      } else if (p == "framed" || p == "h2") {
        a.protos = {p};
      } else {
        usage();
      }
    } else if (k == "--seconds") {
      a.seconds = std::atof(val().c_str());
    } else if (k == "--held") {
      a.held = std::atoi(val().c_str());
    } else if (k == "--stream-mib") {
      a.streamMiB = uint64_t(std::atoll(val().c_str()));
    } else if (k == "--quick") {
      a.seconds = 0.5;
      a.held = 4096;
      a.streamMiB = 16;
    } else {
      usage();
    }
  }
  if (a.seconds <= 0 || a.held <= 0 || a.streamMiB == 0) usage();

  std::map<std::string, std::map<std::string, double>> fig;  // proto -> figure -> value
  if (a.one.empty()) {
    // Each protocol's client in a fresh process of its own (and its server in
    // another), so neither inherits the other's heap: RSS per call is clean.
    for (const auto& proto : a.protos) {
      char self[4096];
      ssize_t sl = ::readlink("/proc/self/exe", self, sizeof self - 1);
      if (sl <= 0) die("readlink /proc/self/exe");
      self[sl] = '\0';
      std::string cmd = std::string(self) + " --one " + proto + " --seconds " +
                        std::to_string(a.seconds) + " --held " + std::to_string(a.held) +
                        " --stream-mib " + std::to_string(a.streamMiB);
      FILE* p = ::popen(cmd.c_str(), "r");
      if (!p) die("popen");
      char* line = nullptr;
      size_t cap = 0;
      while (::getline(&line, &cap, p) > 0) {
        json j = json::parse(line, nullptr, false);
        if (j.is_object() && j.value("event", "") == "figures") {
          for (auto& [k, v] : j.items()) {
            if (v.is_number()) fig[proto][k] = v.get<double>();
          }
        } else {
          std::fputs(line, stdout);
          std::fflush(stdout);
        }
      }
      std::free(line);
      if (::pclose(p) != 0) die(proto + ": the measuring process failed");
    }
  }
  for (const auto& proto : a.protos) {
    if (a.one != proto) continue;
    ServerProc srv;
    srv.start(proto);
    emit({{"event", "server"}, {"proto", proto}, {"pid", srv.pid}, {"port", srv.port}});
    {
      Runtime rt(RuntimeOptions{1, 2});
      std::shared_ptr<BenchClient> client;
      if (proto == "framed") {
        client = std::make_shared<FramedClient>(rt, srv.port);
      } else {
        client = H2Client::connect(rt, srv.port);
      }
      auto& f = fig[proto];
      // Held calls first, on a fresh heap on both ends.
      json h = held(*client, proto, a.held, srv.pid);
      f["held_client_bytes_per_call"] = h["client_bytes_per_call"];
      f["held_server_bytes_per_call"] = h["server_bytes_per_call"];
      f["held_client_cpu_us_per_call"] = h["client_cpu_us_per_call"];
      f["held_server_cpu_us_per_call"] = h["server_cpu_us_per_call"];
      f["held_open_s"] = h["open_s"];
      unary(*client, proto, 16, std::min(0.5, a.seconds));  // warm-up
      for (int level : a.levels) {
        json j = unary(*client, proto, level, a.seconds);
        std::string p = "c" + std::to_string(level) + "_";
        f[p + "calls_per_s"] = j["calls_per_s"];
        f[p + "p50_us"] = j["p50_us"];
        f[p + "p99_us"] = j["p99_us"];
      }
      json s = stream(*client, proto, a.streamMiB << 20, 16);
      f["stream_mib_per_s"] = s["mib_per_s"];
      f["stream_small_p50_us"] = s["small_p50_us"];
      f["stream_small_p99_us"] = s["small_p99_us"];
      // The client goes before its Runtime (an H2Client's strand lives there).
      rt.stop();
    }
    srv.stop();
    json out = {{"event", "figures"}, {"proto", proto}};
    for (auto& [k, v] : fig[proto]) out[k] = v;
    emit(out);
    return 0;
  }

  json sum = {{"bench", "link"},
              {"held_calls", a.held},
              {"stream_mib", a.streamMiB},
              {"seconds_per_level", a.seconds},
              {"loadavg_1m", loadavg1()}};
  for (auto& [proto, f] : fig) {
    for (auto& [k, v] : f) sum[proto + "_" + k] = v;
  }
  if (fig.count("framed") && fig.count("h2")) {
    for (auto& [k, v] : fig["framed"]) {
      double h = fig["h2"][k];
      if (h != 0) sum["ratio_" + k] = v / h;
    }
  }
  emit(sum);
  return 0;
}
