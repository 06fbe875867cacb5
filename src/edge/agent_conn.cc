#include "edge/agent_conn.h"

#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/util.h"

namespace dsec::edge {

using json = nlohmann::json;

Result<proto::Frame> AgentStream::next(double deadline) {
  std::unique_lock lk(mu_);
  for (;;) {
    if (!q_.empty()) {
      proto::Frame f = std::move(q_.front());
      q_.pop_front();
      return f;
    }
    if (!failed_.isOk()) return failed_;
    double left = deadline - monoSeconds();
    if (left <= 0) return Status(Code::kDeadlineExceeded, "agent did not answer in time");
    cv_.wait_for(lk, std::chrono::duration<double>(left));
  }
}

void AgentStream::push(proto::Frame f) {
  if (handler_.onFrame) {
    handler_.onFrame(f);  // the reactor thread delivers one frame at a time
    return;
  }
  std::lock_guard lk(mu_);
  q_.push_back(std::move(f));
  cv_.notify_one();
}

void AgentStream::fail(const Status& why) {
  {
    std::lock_guard lk(mu_);
    if (!failed_.isOk()) return;
    failed_ = why;
    cv_.notify_all();
  }
  if (handler_.onFail) handler_.onFail(why);
}

AgentConn::AgentConn(UniqueFd sock, std::string name)
    : sock_(std::move(sock)), name_(std::move(name)), control_(std::make_shared<AgentStream>(0)) {
  // A wedged agent must not hold an API thread forever.
  timeval tv{30, 0};
  setsockopt(sock_.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  streams_[0] = control_;
}

AgentConn::~AgentConn() { fail(Status(Code::kUnavailable, "agent connection closed")); }

std::shared_ptr<AgentStream> AgentConn::openStream(StreamHandler h) {
  std::shared_ptr<AgentStream> s;
  Status dead;
  {
    std::lock_guard lk(mu_);
    uint32_t id = nextId_++;
    if (nextId_ == 0) nextId_ = 1;
    s = std::make_shared<AgentStream>(id, std::move(h));
    if (dead_) {
      dead = deathReason_;
    } else {
      streams_[id] = s;
    }
  }
  if (!dead.isOk()) s->fail(dead);  // outside mu_: a handler may call back in
  return s;
}

void AgentConn::closeStream(uint32_t id) {
  std::lock_guard lk(mu_);
  if (id != 0) streams_.erase(id);
}

std::shared_ptr<AgentStream> AgentConn::streamFor(uint32_t id) {
  std::lock_guard lk(mu_);
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : it->second;
}

bool AgentConn::dead() const {
  std::lock_guard lk(mu_);
  return dead_;
}

Status AgentConn::send(uint32_t stream, proto::FrameType type, std::string_view payload,
                       int passFd) {
  std::vector<int> fds;
  if (passFd >= 0) fds.push_back(passFd);
  return send(stream, type, payload, fds);
}

Status AgentConn::send(uint32_t stream, proto::FrameType type, std::string_view payload,
                       const std::vector<int>& passFds) {
  if (passFds.size() > kMaxPassFds) return invalidArg("fds", "too many descriptors for one frame");
  if (payload.size() > proto::kMaxPayload) return internalError("frame payload too large");
  std::string wire;
  wire.reserve(payload.size() + proto::kHeaderSize);
  proto::appendFrame(wire, stream, type, payload);
  std::lock_guard wl(writeMu_);
  if (dead()) return Status(Code::kUnavailable, "sandbox agent is gone");
  size_t off = 0;
  while (off < wire.size()) {
    ssize_t n;
    if (off == 0 && !passFds.empty()) {
      struct iovec iov = {wire.data(), wire.size()};
      alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassFds)] = {};
      struct msghdr msg = {};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * passFds.size());
      struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * passFds.size());
      std::memcpy(CMSG_DATA(c), passFds.data(), sizeof(int) * passFds.size());
      n = ::sendmsg(sock_.get(), &msg, MSG_NOSIGNAL);
    } else {
      n = ::send(sock_.get(), wire.data() + off, wire.size() - off, MSG_NOSIGNAL);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      Status st = errno == EAGAIN ? Status(Code::kUnavailable, "sandbox agent stopped reading")
                                  : sysError("send to agent");
      fail(st);
      return st;
    }
    off += size_t(n);
  }
  return Status::ok();
}

bool AgentConn::onReadable() {
  char buf[65536];
  for (int round = 0; round < 64; ++round) {
    ssize_t n = ::recv(sock_.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return true;
      fail(sysError("read from agent"));
      return false;
    }
    if (n == 0) {
      fail(Status(Code::kUnavailable, "sandbox agent exited"));
      return false;
    }
    Status st = decoder_.feed(buf, size_t(n));
    if (!st.isOk()) {
      fail(st.withContext("agent protocol"));
      return false;
    }
    proto::Frame f;
    while (decoder_.next(f)) {
      if (f.stream == 0 && f.type == proto::FrameType::kDenied) {
        auto j = nlohmann::json::parse(f.payload, nullptr, false);
        if (j.is_object() && j.contains("denied_total") && j["denied_total"].is_number_unsigned()) {
          deniedSyscalls_.store(j["denied_total"].get<uint64_t>(), std::memory_order_relaxed);
        }
        continue;
      }
      if (auto s = streamFor(f.stream)) {
        s->push(std::move(f));
      }
      // Frames for closed streams (a request whose caller gave up) are dropped.
    }
  }
  return true;  // more may be pending; epoll is level-triggered
}

void AgentConn::fail(const Status& why) {
  std::unordered_map<uint32_t, std::shared_ptr<AgentStream>> streams;
  {
    std::lock_guard lk(mu_);
    if (!dead_) {
      dead_ = true;
      deathReason_ = why;
      // The agent sees EOF and exits, so its death is reported through the
      // pidfd instead of the sandbox lingering with a connection nobody uses.
      ::shutdown(sock_.get(), SHUT_RDWR);
    }
    streams.swap(streams_);
  }
  for (auto& [id, s] : streams) s->fail(why);
  control_->fail(why);
}

Reactor::Reactor() = default;
Reactor::~Reactor() { stop(); }

Status Reactor::start() {
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) return sysError("epoll_create1");
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) return sysError("eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // id 0: the wake fd
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev) != 0) {
    return sysError("epoll_ctl wake");
  }
  thread_ = std::thread([this] { loop(); });
  exitThread_ = std::thread([this] { exitLoop(); });
  return Status::ok();
}

void Reactor::stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    thread_.join();
  }
  if (exitThread_.joinable()) {
    {
      std::lock_guard lk(exitMu_);
      exitStop_ = true;
    }
    exitCv_.notify_all();
    exitThread_.join();
  }
}

Status Reactor::addEntry(Entry e) {
  std::lock_guard lk(mu_);
  uint64_t id = nextId_++;
  epoll_event ev{};
  ev.events = e.conn ? (EPOLLIN | EPOLLRDHUP) : EPOLLIN;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, e.fd, &ev) != 0) return sysError("epoll_ctl add");
  byFd_[e.fd] = id;
  entries_[id] = std::move(e);
  return Status::ok();
}

void Reactor::removeByFd(int fd) {
  // Caller holds mu_.
  auto it = byFd_.find(fd);
  if (it == byFd_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  entries_.erase(it->second);
  byFd_.erase(it);
}

Status Reactor::add(std::shared_ptr<AgentConn> conn) {
  int fd = conn->fd();
  return addEntry(Entry{fd, std::move(conn), nullptr});
}

void Reactor::remove(const std::shared_ptr<AgentConn>& conn) {
  std::lock_guard lk(mu_);
  auto it = byFd_.find(conn->fd());
  if (it == byFd_.end() || entries_[it->second].conn != conn) return;
  removeByFd(conn->fd());
}

Status Reactor::watchExit(int pidfd, std::function<void()> onExit) {
  return addEntry(Entry{pidfd, nullptr, std::move(onExit)});
}

void Reactor::unwatchExit(int pidfd) {
  std::lock_guard lk(mu_);
  auto it = byFd_.find(pidfd);
  if (it == byFd_.end() || entries_[it->second].conn) return;
  removeByFd(pidfd);
}

void Reactor::loop() {
  epoll_event events[128];
  for (;;) {
    int n = ::epoll_wait(epoll_.get(), events, 128, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      log::error("reactor epoll_wait: " + std::string(strerror(errno)));
      return;
    }
    for (int i = 0; i < n; ++i) {
      uint64_t id = events[i].data.u64;
      if (id == 0) return;
      std::shared_ptr<AgentConn> conn;
      std::function<void()> onExit;
      {
        std::lock_guard lk(mu_);
        auto it = entries_.find(id);
        if (it == entries_.end()) continue;  // removed since epoll_wait returned
        if (it->second.conn) {
          conn = it->second.conn;
        } else {
          onExit = std::move(it->second.onExit);
          removeByFd(it->second.fd);
        }
      }
      if (conn && !conn->onReadable()) {
        std::lock_guard lk(mu_);
        auto it = entries_.find(id);
        if (it != entries_.end()) removeByFd(it->second.fd);
      }
      // Exit handlers persist state and tear down; keep them off this thread.
      if (onExit) {
        std::lock_guard lk(exitMu_);
        exitQueue_.push_back(std::move(onExit));
        exitCv_.notify_one();
      }
    }
  }
}

void Reactor::exitLoop() {
  std::unique_lock lk(exitMu_);
  for (;;) {
    exitCv_.wait(lk, [&] { return exitStop_ || !exitQueue_.empty(); });
    if (exitQueue_.empty()) return;  // stopping and drained
    auto fn = std::move(exitQueue_.front());
    exitQueue_.pop_front();
    lk.unlock();
    fn();
    lk.lock();
  }
}

namespace {
Status resultStatusOf(const json& j);
}  // namespace

Status resultStatus(const std::string& payload) {
  json j = json::parse(payload, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return internalError("agent sent a malformed result");
  try {
    return resultStatusOf(j);
  } catch (const json::exception&) {
    return internalError("agent sent a malformed result");
  }
}

namespace {
Status resultStatusOf(const json& j) {
  if (j.value("ok", false)) return Status::ok();
  std::string code = j.value("code", "internal");
  Code c = Code::kInternal;
  static const std::map<std::string, Code> kCodes = {
      {"invalid_argument", Code::kInvalidArgument},
      {"permission_denied", Code::kPermissionDenied},
      {"not_found", Code::kNotFound},
      {"already_exists", Code::kAlreadyExists},
      {"failed_precondition", Code::kFailedPrecondition},
      {"resource_exhausted", Code::kResourceExhausted},
      {"conflict", Code::kConflict}};
  if (auto it = kCodes.find(code); it != kCodes.end()) c = it->second;
  // Bad input (invalid_argument) and a path refused, missing, existing...
  // (the files API) name the request field at fault.
  std::string field = c == Code::kInternal ? "" : j.value("field", "");
  return Status(c, j.value("message", "agent error"), j.value("errno", 0), field);
}
}  // namespace

Result<std::string> agentCall(AgentConn& conn, proto::FrameType type, const std::string& body,
                              double timeoutSeconds) {
  auto stream = conn.openStream();
  struct Closer {
    AgentConn& c;
    uint32_t id;
    ~Closer() { c.closeStream(id); }
  } closer{conn, stream->id()};
  RETURN_IF_ERROR(conn.send(stream->id(), type, body));
  double deadline = monoSeconds() + timeoutSeconds;
  for (;;) {
    ASSIGN_OR_RETURN(proto::Frame f, stream->next(deadline));
    if (f.type != proto::FrameType::kResult) continue;
    RETURN_IF_ERROR(resultStatus(f.payload));
    return std::move(f.payload);
  }
}

Status awaitHello(AgentConn& conn, double deadline, Code code, const std::string& what) {
  for (;;) {
    auto f = conn.control()->next(deadline);
    if (!f.isOk()) return Status(code, what + ": " + f.status().message());
    if (f->type == proto::FrameType::kHello) return Status::ok();
    if (f->type == proto::FrameType::kResult) {
      Status st = resultStatus(f->payload);
      return st.isOk() ? internalError(what + ": unexpected result") : st;
    }
  }
}

void killAndWait(int pidfd) {
  if (pidfd < 0) return;
  syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
  siginfo_t info;
  int rc;
  while ((rc = waitid(idtype_t(P_PIDFD), id_t(pidfd), &info, WEXITED)) != 0 && errno == EINTR) {
  }
  if (rc != 0 && errno == ECHILD) {
    struct pollfd p = {pidfd, POLLIN, 0};
    while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace dsec::edge
