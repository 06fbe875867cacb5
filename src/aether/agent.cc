#include "aether/agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

#include "aether/json_fields.h"
#include "aether/seccomp.h"

namespace dsec::aether {

namespace {

using proto::Frame;
using proto::FrameType;

// epoll_data.u64 = kind << 32 | stream. Events carry no pointers, so an
// event for an exec that ended earlier in the same batch finds nothing (or a
// newer exec on the same stream, for which a spurious nonblocking read or
// write is harmless).
enum Kind : uint64_t {
  kConnKind = 1,
  kSignalKind,
  kStdoutKind,
  kStderrKind,
  kStdinKind,
  kTimerKind,
  kSeccompKind,  // the "stream" is the listener's fd
  kDeniedTimerKind,
  kZygoteKind,  // the "stream" is the zygote's control socket fd
  kCallKind,    // a zygote call's own socket
};

// Denied-syscall counts go to the edge unasked, at most this often, so a
// flood of refused calls costs one small frame per interval.
constexpr int64_t kDeniedPushIntervalMs = 100;

int64_t monotonicMs() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

constexpr uint64_t tag(Kind kind, uint32_t stream) { return (uint64_t{kind} << 32) | stream; }

constexpr size_t kOutChunk = 256u << 10;  // outgoing queue string size before starting another
constexpr size_t kReadSize = 256u << 10;  // connection read size

int64_t elapsedUs(const struct timespec& start) {
  struct timespec now;
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return (int64_t{now.tv_sec} - start.tv_sec) * 1000000 + (now.tv_nsec - start.tv_nsec) / 1000;
}

void logError(const char* what, const Status& st) {
  std::fprintf(stderr, "dsec-aether: %s: %s\n", what, st.toString().c_str());
}

}  // namespace

Agent::Agent(UniqueFd conn, AgentOptions options, proto::FrameDecoder decoder)
    : conn_(std::move(conn)), options_(std::move(options)), decoder_(std::move(decoder)) {}

Agent::~Agent() { shutdown(); }

Status Agent::start() {
  int flags = ::fcntl(conn_.get(), F_GETFL);
  if (flags < 0 || ::fcntl(conn_.get(), F_SETFL, flags | O_NONBLOCK) < 0) {
    return sysError("fcntl connection");
  }
  // execs must not inherit the connection.
  if (::fcntl(conn_.get(), F_SETFD, FD_CLOEXEC) < 0) return sysError("fcntl connection");

  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  if (::sigprocmask(SIG_BLOCK, &set, nullptr) < 0) return sysError("sigprocmask");
  sigchld_.reset(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!sigchld_) return sysError("signalfd");
  // A write to a closed stdin pipe or connection must be an error, not death.
  ::signal(SIGPIPE, SIG_IGN);
  // Children reset just what is not at SIG_DFL here (inherited SIG_IGNs too).
  options_.exec.reset_signals = nonDefaultSignals();
  // As PID 1 orphans come to aether anyway; elsewhere (tests) ask for them.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);

  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) return sysError("epoll_create1");
  struct epoll_event ev {};
  ev.events = EPOLLIN;
  ev.data.u64 = tag(kSignalKind, 0);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, sigchld_.get(), &ev) < 0) {
    return sysError("epoll_ctl signalfd");
  }
  ev.events = EPOLLIN;
  ev.data.u64 = tag(kConnKind, 0);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conn_.get(), &ev) < 0) {
    return sysError("epoll_ctl connection");
  }
  conn_events_ = EPOLLIN;
  if (options_.reattach_fd >= 0) {
    // A copy of the /dev/null holding reattach_fd, to put back after a
    // reattach (the sandbox's own /dev is not to be trusted by then).
    reattach_null_.reset(::fcntl(options_.reattach_fd, F_DUPFD_CLOEXEC, 10));
    if (!reattach_null_) return sysError("dup reattach fd");
  }
  scratch_.resize(proto::kDataChunk);
  in_buf_.reset(new char[kReadSize]);
  if (options_.fncall) {
    // Calls share a uid with their zygote and the next spare: none may
    // change another's rlimits, priority or scheduling (seccomp.h).
    options_.exec.self_only = true;
    // Every exec of a fncall sandbox writes only beneath /scratch: Landlock
    // under the read-only root (a second layer, and the one that also covers
    // /dev/shm and /proc's writable files); where the kernel scopes signals
    // (Landlock ABI 6), each exec is its own domain for signals and abstract
    // unix sockets too (fncall.h).
    Result<UniqueFd> rs = buildScratchRuleset();
    if (rs.isOk()) {
      scratch_landlock_ = std::move(*rs);
      options_.exec.base_landlock_ruleset = scratch_landlock_.get();
    } else if (rs.status().code() != Code::kFailedPrecondition) {
      return rs.status();
    }
    for (const auto& lang : options_.fncall->prestart) {
      if (auto z = zygoteFor(lang); !z.isOk()) logError("zygote", z.status());
    }
  }

  // The create's first phase comes with init: no round trip after the hello.
  if (options_.initial_policy) RETURN_IF_ERROR(applyPolicy(*options_.initial_policy).status());
  Json hello = {{"version", 1}, {"pid", ::getpid()}};
  sendFrame(0, FrameType::kHello, dumpJson(hello));
  return Status::ok();
}

int Agent::run() {
  // Frames that arrived together with the init frame.
  Frame f;
  while (!done_ && decoder_.next(f)) handleFrame(f);

  struct epoll_event events[64];
  while (!done_) {
    flushOutput();
    finishedCalls();
    pumpFileReads();
    flushOutput();
    if (done_) break;
    updateInterest();
    int timeout = !reads_.empty() && queued_ < kQueueHighWater ? 0 : -1;
    int n = ::epoll_wait(epoll_.get(), events, 64, timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      logError("epoll_wait", sysError("epoll_wait"));
      exit_code_ = 1;
      break;
    }
    for (int i = 0; i < n && !done_; ++i) {
      // A call that ended in the previous event is cleaned up before the
      // next event can bring a frame of the edge.
      finishedCalls();
      uint32_t ev = events[i].events;
      auto kind = static_cast<Kind>(events[i].data.u64 >> 32);
      auto stream = static_cast<uint32_t>(events[i].data.u64);
      switch (kind) {
        case kConnKind:
          if (ev & EPOLLOUT) flushOutput();
          if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) handleConnReadable();
          break;
        case kSignalKind:
          reapChildren();
          break;
        case kStdoutKind:
          onPipeReadable(stream, 0);
          break;
        case kStderrKind:
          onPipeReadable(stream, 1);
          break;
        case kStdinKind:
          onStdinWritable(stream);
          break;
        case kTimerKind:
          onTimer(stream);
          break;
        case kSeccompKind:
          onSeccompNotify(static_cast<int>(stream), ev);
          break;
        case kZygoteKind:
          onZygoteReadable(static_cast<int>(stream));
          break;
        case kCallKind:
          onCallSocket(stream);
          break;
        case kDeniedTimerKind: {
          uint64_t expirations;
          (void)!::read(denied_timer_.get(), &expirations, sizeof expirations);
          denied_timer_armed_ = false;
          pushDenied();
          break;
        }
      }
    }
  }
  shutdown();
  return exit_code_;
}

void Agent::edgeGone() {
  if (options_.reattach_fd < 0) {
    done_ = true;
    return;
  }
  // Nobody is left to tell how the running requests end: kill them, as a
  // closed connection always did. What the sandbox started in the
  // background, its files and its policy stay.
  for (auto& [stream, e] : execs_) {
    killGroup(*e, SIGKILL);
    closeStdin(*e);
    if (e->call) finishCall(*e);
  }
  execs_.clear();
  pid_streams_.clear();
  writes_.clear();
  reads_.clear();
  packs_.clear();
  out_.clear();
  out_off_ = 0;
  queued_ = 0;
  stdin_buffered_ = 0;
  pipes_paused_ = false;
  decoder_ = proto::FrameDecoder{};
  unwatch(conn_.get());
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) {
    logError("reattach", sysError("socketpair"));
    exit_code_ = 1;
    done_ = true;
    return;
  }
  UniqueFd edge_end(sv[1]);
  conn_.reset(sv[0]);
  // The edge's end blocks like any socket the edge is handed.
  int flags = ::fcntl(edge_end.get(), F_GETFL);
  if (flags >= 0) ::fcntl(edge_end.get(), F_SETFL, flags & ~O_NONBLOCK);
  if (::dup3(edge_end.get(), options_.reattach_fd, O_CLOEXEC) < 0) {
    logError("reattach", sysError("dup3"));
    exit_code_ = 1;
    done_ = true;
    return;
  }
  struct epoll_event ev {};
  ev.events = EPOLLIN;
  ev.data.u64 = tag(kConnKind, 0);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conn_.get(), &ev) < 0) {
    logError("reattach", sysError("epoll_ctl"));
    exit_code_ = 1;
    done_ = true;
    return;
  }
  conn_events_ = EPOLLIN;
  awaiting_reattach_ = true;
}

void Agent::handleReattach(const Frame&) {
  if (awaiting_reattach_) {
    // The edge holds its end now; ours must go, or its death would not be EOF.
    if (::dup3(reattach_null_.get(), options_.reattach_fd, O_CLOEXEC) < 0) {
      logError("reattach", sysError("dup3"));
    }
    awaiting_reattach_ = false;
  }
  Json hello = {{"version", 1}, {"pid", ::getpid()}, {"reattached", true}};
  sendFrame(0, FrameType::kHello, dumpJson(hello));
  // The new edge knows nothing of what was refused so far.
  denied_pushed_ = 0;
  pushDenied();
}

void Agent::shutdown() {
  finishedCalls();
  for (auto& [stream, e] : execs_) {
    killGroup(*e, SIGKILL);
    closeStdin(*e);
    if (e->call) finishCall(*e);
  }
  execs_.clear();
  pid_streams_.clear();
  writes_.clear();  // removes temporary files
  reads_.clear();
  packs_.clear();
  done_ = true;
}

// ---- the connection ----

void Agent::handleConnReadable() {
  ssize_t n = ::read(conn_.get(), in_buf_.get(), kReadSize);
  if (n < 0) {
    if (errno == EINTR || errno == EAGAIN) return;
    edgeGone();
    return;
  }
  if (n == 0) {
    edgeGone();
    return;
  }
  Status st = decoder_.feed(in_buf_.get(), static_cast<size_t>(n));
  if (!st.isOk()) {
    // Framing is lost for good: nothing after this point can be trusted.
    logError("connection", st);
    exit_code_ = 1;
    done_ = true;
    return;
  }
  Frame f;
  while (!done_ && decoder_.next(f)) handleFrame(f);
}

void Agent::sendFrame(uint32_t stream, FrameType type, std::string_view payload) {
  if (out_.empty() || out_.back().size() >= kOutChunk) {
    out_.emplace_back();
    out_.back().reserve(kOutChunk + proto::kHeaderSize + payload.size());
  }
  proto::appendFrame(out_.back(), stream, type, payload);
  queued_ += proto::kHeaderSize + payload.size();
}

void Agent::sendError(uint32_t stream, const Status& status) {
  sendFrame(stream, FrameType::kResult, errorJson(status));
}

namespace {

// A file operation's error about its path (refused, missing, not a
// directory, exists, not empty) names the request field "path", like a bad
// path does; running out of room or an internal error is not the path's.
Status withPathField(Status st) {
  if (st.isOk() || !st.field().empty()) return st;
  switch (st.code()) {
    case Code::kPermissionDenied:
    case Code::kNotFound:
    case Code::kInvalidArgument:
    case Code::kAlreadyExists:
    case Code::kFailedPrecondition:
      return Status(st.code(), st.message(), st.sysErrno(), "path");
    default:
      return st;
  }
}

}  // namespace

void Agent::flushOutput() {
  while (!out_.empty() && !done_) {
    std::string& front = out_.front();
    ssize_t n = ::write(conn_.get(), front.data() + out_off_, front.size() - out_off_);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;
      edgeGone();  // EPIPE, ECONNRESET
      return;
    }
    out_off_ += static_cast<size_t>(n);
    queued_ -= static_cast<size_t>(n);
    if (out_off_ == front.size()) {
      out_.pop_front();
      out_off_ = 0;
    }
  }
}

void Agent::watch(int fd, uint64_t t, uint32_t events) {
  struct epoll_event ev {};
  ev.events = events;
  ev.data.u64 = t;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) < 0) {
    logError("epoll_ctl add", sysError("epoll_ctl"));
  }
}

void Agent::unwatch(int fd) { ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr); }

void Agent::updateInterest() {
  bool pause = queued_ > kQueueHighWater;
  if (pause != pipes_paused_) {
    pipes_paused_ = pause;
    // Removed rather than masked: epoll reports EPOLLHUP even for an empty
    // event mask, and a finished writer would spin the loop.
    for (auto& [stream, e] : execs_) {
      for (int which = 0; which < 2; ++which) {
        OutPipe& p = e->out[which];
        if (!p.fd) continue;
        if (pause && p.watched) {
          unwatch(p.fd.get());
          p.watched = false;
        } else if (!pause && !p.watched) {
          watch(p.fd.get(), tag(which == 0 ? kStdoutKind : kStderrKind, stream), EPOLLIN);
          p.watched = true;
        }
      }
    }
  }
  uint32_t want = 0;
  if (queued_ <= kQueueHardLimit && stdin_buffered_ <= kStdinHighWater) want |= EPOLLIN;
  if (queued_ > 0) want |= EPOLLOUT;
  if (want != conn_events_) {
    struct epoll_event ev {};
    ev.events = want;
    ev.data.u64 = tag(kConnKind, 0);
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, conn_.get(), &ev) == 0) conn_events_ = want;
  }
}

// ---- requests ----

bool Agent::busy(uint32_t stream) const {
  return execs_.count(stream) > 0 || writes_.count(stream) > 0 || reads_.count(stream) > 0 ||
         packs_.count(stream) > 0;
}

bool Agent::acceptRequest(const Frame& f) {
  if (f.stream == 0) {
    sendError(0, invalidArg("stream",
                            std::string(proto::frameTypeName(f.type)) + " needs a nonzero stream"));
    return false;
  }
  if (busy(f.stream)) {
    sendError(f.stream, Status(Code::kFailedPrecondition,
                               "stream " + std::to_string(f.stream) + " is busy", 0, "stream"));
    return false;
  }
  return true;
}

void Agent::handleFrame(Frame& f) {
  // JSON access goes through json_fields.h, which does not throw; this is the
  // last line of defence (say, std::bad_alloc) for a PID 1 whose death ends
  // the sandbox.
  try {
    dispatch(f);
  } catch (const std::exception& e) {
    logError("request", internalError(e.what()));
    if (!busy(f.stream)) sendError(f.stream, internalError(e.what()));
  }
}

void Agent::dispatch(Frame& f) {
  switch (f.type) {
    case FrameType::kExec:
      handleExec(f);
      return;
    case FrameType::kStdin:
      handleStdin(f);
      return;
    case FrameType::kSignal:
      handleSignal(f);
      return;
    case FrameType::kResize:
      handleResize(f);
      return;
    case FrameType::kCancel:
      handleCancel(f);
      return;
    case FrameType::kFileWrite:
      handleFileWrite(f);
      return;
    case FrameType::kData:
      handleData(f);
      return;
    case FrameType::kFileRead:
      handleFileRead(f);
      return;
    case FrameType::kPackUpper:
      handlePackUpper(f);
      return;
    case FrameType::kAudit:
      handleAudit(f);
      return;
    case FrameType::kPolicy:
      handlePolicy(f);
      return;
    case FrameType::kReattach:
      if (f.stream == 0) {
        handleReattach(f);
        return;
      }
      break;
    case FrameType::kList:
    case FrameType::kStat:
    case FrameType::kMkdir:
    case FrameType::kRemove:
    case FrameType::kSetMeta:
      handleSimpleFileOp(f);
      return;
    case FrameType::kInit:
      if (f.stream == 0) {
        sendError(0, Status(Code::kFailedPrecondition, "init was already done"));
        return;
      }
      break;
    default:
      break;
  }
  // A frame aether never receives. On a live stream it is dropped, so a
  // confused edge cannot end someone else's request with a stray result.
  if (busy(f.stream)) return;
  sendError(f.stream, invalidArg("type", "unexpected frame type " +
                                             std::to_string(static_cast<int>(f.type))));
}

void Agent::handleExec(const Frame& f) {
  if (!acceptRequest(f)) return;
  Result<ExecRequest> req = parseExecRequest(f.payload);
  if (!req.isOk()) return sendError(f.stream, req.status());
  std::optional<CallRequest> call;
  {
    Result<Json> j = parseObject(f.payload);
    auto it = j.isOk() ? j->find("fncall") : Json::iterator();
    bool has = j.isOk() && it != j->end() && !it->is_null();
    if (has && !options_.fncall) {
      return sendError(f.stream, invalidArg("fncall", "this is not a fncall sandbox"));
    }
    if (options_.fncall) {
      Result<CallRequest> c =
          has ? parseCallRequest(*it, *options_.fncall) : Result<CallRequest>(CallRequest{});
      if (!c.isOk()) return sendError(f.stream, c.status());
      call = std::move(*c);
    }
  }

  auto e = std::make_unique<Exec>();
  e->stream = f.stream;
  e->max_output = req->max_output;
  // Made before fork: once the process runs, nothing may fail that would
  // leave it untracked.
  if (req->timeout_ms > 0) {
    e->timer.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!e->timer) return sendError(f.stream, sysError("timerfd_create"));
  }
  std::vector<std::pair<pid_t, int>> exits;
  Result<SpawnedExec> spawned =
      call ? spawnCall(*req, *call, *e, exits) : spawnExec(*req, options_.exec);
  if (!spawned.isOk()) {
    if (!e->run_dir.empty()) (void)removePath(e->run_dir, true);
    for (auto& [pid, status] : exits) onReaped(pid, status);
    return sendError(f.stream, spawned.status());
  }
  e->proc = std::move(spawned).value();
  if (e->proc.seccomp_listener) {
    int fd = e->proc.seccomp_listener.get();
    watch(fd, tag(kSeccompKind, static_cast<uint32_t>(fd)), EPOLLIN);
    listeners_[fd] = std::move(e->proc.seccomp_listener);
  }
  e->out[0].fd = std::move(e->proc.stdout_r);
  e->out[1].fd = std::move(e->proc.stderr_r);
  if (e->call_sock) watch(e->call_sock.get(), tag(kCallKind, f.stream), EPOLLIN);

  if (e->timer) {
    struct itimerspec its {};
    its.it_value.tv_sec = req->timeout_ms / 1000;
    its.it_value.tv_nsec = (req->timeout_ms % 1000) * 1000000;
    ::timerfd_settime(e->timer.get(), 0, &its, nullptr);
    watch(e->timer.get(), tag(kTimerKind, f.stream), EPOLLIN);
  }
  if (!pipes_paused_) {
    for (int which = 0; which < 2; ++which) {
      if (!e->out[which].fd) continue;  // a PTY exec has no stderr
      watch(e->out[which].fd.get(), tag(which == 0 ? kStdoutKind : kStderrKind, f.stream), EPOLLIN);
      e->out[which].watched = true;
    }
  }
  // Before any output: the pid names the process to the edge's callers.
  sendFrame(f.stream, FrameType::kStarted, dumpJson(Json{{"pid", e->proc.pid}}));
  pid_streams_[e->proc.pid] = f.stream;
  execs_[f.stream] = std::move(e);
  for (auto& [pid, status] : exits) onReaped(pid, status);
}

void Agent::onSeccompNotify(int fd, uint32_t events) {
  auto it = listeners_.find(fd);
  if (it == listeners_.end()) return;
  if (events & EPOLLIN) {
    // Each refused call waits in the kernel until answered: answer every one.
    for (;;) {
      struct seccomp_notif req;
      std::memset(&req, 0, sizeof req);
      if (::ioctl(fd, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) break;  // EAGAIN, or the caller died
      ++denied_[syscallName(req.data.nr)];
      ++denied_total_;
      struct seccomp_notif_resp resp;
      std::memset(&resp, 0, sizeof resp);
      resp.id = req.id;
      resp.error = -EPERM;
      (void)::ioctl(fd, SECCOMP_IOCTL_NOTIF_SEND, &resp);  // ENOENT: the caller is gone
    }
    scheduleDeniedPush();
  }
  if (events & (EPOLLHUP | EPOLLERR)) {
    unwatch(fd);
    listeners_.erase(it);
  }
}

void Agent::scheduleDeniedPush() {
  if (denied_total_ == denied_pushed_ || denied_timer_armed_) return;
  int64_t now = monotonicMs();
  if (now - denied_pushed_at_ms_ >= kDeniedPushIntervalMs) return pushDenied();
  // Within the interval: one trailing push carries whatever came meanwhile.
  if (!denied_timer_) {
    denied_timer_.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!denied_timer_) return pushDenied();
    watch(denied_timer_.get(), tag(kDeniedTimerKind, 0), EPOLLIN);
  }
  struct itimerspec its {};
  int64_t wait = kDeniedPushIntervalMs - (now - denied_pushed_at_ms_);
  its.it_value.tv_sec = wait / 1000;
  its.it_value.tv_nsec = (wait % 1000) * 1000000;
  ::timerfd_settime(denied_timer_.get(), 0, &its, nullptr);
  denied_timer_armed_ = true;
}

void Agent::pushDenied() {
  if (denied_total_ == denied_pushed_) return;
  denied_pushed_ = denied_total_;
  denied_pushed_at_ms_ = monotonicMs();
  sendFrame(0, FrameType::kDenied, dumpJson(Json{{"denied_total", denied_total_}}));
}

void Agent::handleAudit(const Frame& f) {
  if (!acceptRequest(f)) return;
  Json denied = Json::object();
  uint64_t total = 0;
  for (auto& [name, n] : denied_) {
    denied[name] = n;
    total += n;
  }
  Json out = {{"ok", true}, {"denied_syscalls", denied}, {"denied_total", total}};
  sendFrame(f.stream, FrameType::kResult, dumpJson(out));
}

void Agent::handlePolicy(const Frame& f) {
  if (!acceptRequest(f)) return;
  Result<Json> j = parseObject(f.payload);
  if (!j.isOk()) return sendError(f.stream, j.status());
  Result<Json> applied = applyPolicy(*j);
  if (!applied.isOk()) return sendError(f.stream, applied.status());
  sendFrame(f.stream, FrameType::kResult, dumpJson(*applied));
}

Result<Json> Agent::applyPolicy(const Json& j) {
  if (!j.is_object()) return invalidArg("policy", "policy must be an object");
  std::vector<std::string> lists[2];
  const char* names[2] = {"readonly", "hidden"};
  for (int k = 0; k < 2; ++k) {
    auto it = j.find(names[k]);
    if (it == j.end()) continue;
    if (!it->is_array()) return invalidArg(names[k], "must be a list of paths");
    for (auto& p : *it) {
      if (!p.is_string() || p.get<std::string>().empty() || p.get<std::string>()[0] != '/') {
        return invalidArg(names[k], "paths must be absolute");
      }
      lists[k].push_back(p.get<std::string>());
    }
  }
  std::string resolvConf;
  if (auto it = j.find("dns"); it != j.end()) {
    if (!it->is_array()) return invalidArg("dns", "must be a list of addresses");
    for (auto& a : *it) {
      unsigned char buf[16];
      if (!a.is_string() || (inet_pton(AF_INET, a.get<std::string>().c_str(), buf) != 1 &&
                             inet_pton(AF_INET6, a.get<std::string>().c_str(), buf) != 1)) {
        return invalidArg("dns", "resolvers must be IP addresses");
      }
      resolvConf += "nameserver " + a.get<std::string>() + "\n";
    }
    if (!resolvConf.empty()) resolvConf = "# written by dsec for the sandbox's policy\n" + resolvConf;
  }
  SyscallProfile profile = SyscallProfile::kDefault;
  if (auto it = j.find("syscalls"); it != j.end()) {
    if (!it->is_string() || !parseSyscallProfile(it->get<std::string>(), &profile)) {
      return invalidArg("syscalls", "syscalls must be default or strict");
    }
  }
  RETURN_IF_ERROR(fs_policy_.apply(lists[0], lists[1], resolvConf));
  options_.exec.syscall_profile = profile;
  // And Landlock for execs from now on: a second layer under the mounts, for
  // top-level paths only (/usr, /etc, ...). A Landlock rule covers all that is
  // beneath it, so a deeper path would make its parent refuse new entries
  // (/root could take no new file to keep /root/answers read-only); those
  // rest on the mounts alone.
  std::vector<std::string> locked;
  for (const auto& list : lists) {
    for (const auto& p : list) {
      if (p.size() > 1 && p.find('/', 1) == std::string::npos) locked.push_back(p);
    }
  }
  landlock_.reset();
  options_.exec.landlock_ruleset = -1;
  bool landlocked = false;
  if (!locked.empty()) {
    Result<UniqueFd> rs = buildWriteRuleset(locked);
    if (rs.isOk()) {
      landlock_ = std::move(*rs);
      options_.exec.landlock_ruleset = landlock_.get();
      landlocked = true;
    } else if (rs.status().code() != Code::kFailedPrecondition) {
      (void)fs_policy_.apply({}, {});
      return rs.status();
    }
  }
  return Json{{"ok", true}, {"mounts", fs_policy_.mounts()}, {"landlock", landlocked}};
}

void Agent::handleStdin(const Frame& f) {
  auto it = execs_.find(f.stream);
  // Stdin racing the process's exit (or for stdin:false) has nowhere to go.
  if (it == execs_.end()) return;
  Exec& e = *it->second;
  if (e.reaped || !e.proc.stdin_w || e.stdin_close) return;
  if (f.payload.empty()) {
    e.stdin_close = true;
    if (e.stdin_off == e.stdin_buf.size()) closeStdin(e);
    return;
  }
  if (e.stdin_off > 0 && e.stdin_off == e.stdin_buf.size()) {
    e.stdin_buf.clear();
    e.stdin_off = 0;
  }
  e.stdin_buf.append(f.payload);
  stdin_buffered_ += f.payload.size();
  flushStdin(e);
}

void Agent::handleSignal(const Frame& f) {
  auto it = execs_.find(f.stream);
  if (it == execs_.end()) return;
  // The stream belongs to a running exec: a result here would read as its
  // end, so a malformed signal request is dropped with a log line.
  Result<Json> j = parseObject(f.payload);
  int64_t sig = 0;
  Status st = j.isOk() ? readInt(*j, "signal", 1, 64, sig) : j.status();
  if (st.isOk() && sig == 0) st = invalidArg("signal", "signal is required");
  if (!st.isOk()) return logError("signal", st);
  Exec& e = *it->second;
  // On a terminal, a signal goes where a typed ^C would: to its foreground
  // process group only (the job the shell runs, or the shell at its prompt).
  // A shell that got SIGINT too would abandon the rest of its command line.
  if (e.proc.pty_master && !e.reaped && sig != SIGKILL) {
    pid_t fg = ::tcgetpgrp(e.proc.pty_master.get());
    if (fg > 0 && ::kill(-fg, static_cast<int>(sig)) == 0) return;
  }
  killGroup(e, static_cast<int>(sig));
}

void Agent::handleResize(const Frame& f) {
  auto it = execs_.find(f.stream);
  if (it == execs_.end()) return;
  // As with signal: a result would end the stream, so errors are logged.
  Exec& e = *it->second;
  if (!e.proc.pty_master) return logError("resize", invalidArg("pty", "the exec has no terminal"));
  Result<PtySize> size = parsePtySize(f.payload);
  if (!size.isOk()) return logError("resize", size.status());
  Status st = setWindowSize(e.proc.pty_master.get(), *size);
  if (!st.isOk()) logError("resize", st);
}

void Agent::handleCancel(const Frame& f) {
  if (auto it = execs_.find(f.stream); it != execs_.end()) {
    // The exec still ends with its exit frame once the group is gone.
    killGroup(*it->second, SIGKILL);
    return;
  }
  // A cancelled transfer just stops: no further frames on the stream.
  writes_.erase(f.stream);
  reads_.erase(f.stream);
  packs_.erase(f.stream);  // thaws the disk
}

void Agent::handleFileWrite(const Frame& f) {
  if (!acceptRequest(f)) return;
  if (!packs_.empty()) {
    return sendError(f.stream, Status(Code::kUnavailable,
                                      "a pack_diff is reading the sandbox's disk; retry"));
  }
  Result<Json> j = parseObject(f.payload);
  if (!j.isOk()) return sendError(f.stream, j.status());
  std::string path;
  int64_t mode = 0644;
  bool append = false;
  Status st = readPath(*j, "path", path);
  if (st.isOk()) st = readInt(*j, "mode", 0, 07777, mode);
  if (st.isOk()) st = readBool(*j, "append", append);
  if (st.isOk()) st = fncallWritable(path);
  if (!st.isOk()) return sendError(f.stream, st);
  bool mode_given = j->contains("mode") && !(*j)["mode"].is_null();
  Result<FileWriter> w = FileWriter::open(path, static_cast<mode_t>(mode), mode_given, append);
  // After an early error the stream's data frames find no writer and are dropped.
  if (!w.isOk()) return sendError(f.stream, withPathField(w.status()));
  writes_.emplace(f.stream, std::move(w).value());
}

void Agent::handleData(const Frame& f) {
  auto it = writes_.find(f.stream);
  if (it == writes_.end()) return;
  if (!f.payload.empty()) {
    Status st = it->second.write(f.payload);
    if (!st.isOk()) {
      writes_.erase(it);
      sendError(f.stream, st);
    }
    return;
  }
  Result<uint64_t> size = it->second.commit();
  writes_.erase(it);
  if (!size.isOk()) return sendError(f.stream, size.status());
  sendFrame(f.stream, FrameType::kResult, dumpJson(Json{{"ok", true}, {"size", *size}}));
}

void Agent::handleFileRead(const Frame& f) {
  if (!acceptRequest(f)) return;
  Result<Json> j = parseObject(f.payload);
  if (!j.isOk()) return sendError(f.stream, j.status());
  std::string path;
  int64_t offset = 0;
  int64_t length = -1;
  Status st = readPath(*j, "path", path);
  if (st.isOk()) st = readInt(*j, "offset", 0, INT64_MAX, offset);
  if (st.isOk()) st = readInt(*j, "length", -1, INT64_MAX, length);
  if (!st.isOk()) return sendError(f.stream, st);
  Result<FileReader> r = FileReader::open(path, static_cast<uint64_t>(offset), length);
  if (!r.isOk()) return sendError(f.stream, withPathField(r.status()));
  sendFrame(f.stream, FrameType::kResult,
            dumpJson(Json{{"ok", true}, {"size", r->size()}, {"mode", unsigned{r->mode()}}}));
  // The data follows from pumpFileReads(), paced by the outgoing queue.
  reads_.emplace(f.stream, std::move(r).value());
}

void Agent::handlePackUpper(const Frame& f) {
  if (!acceptRequest(f)) return;
  if (options_.upper_fd < 0) {
    return sendError(f.stream, Status(Code::kFailedPrecondition,
                                      "pack_upper is served only by a microvm guest"));
  }
  if (!packs_.empty() || !writes_.empty()) {
    // A write in flight would hang on the frozen disk, and this loop with it.
    return sendError(f.stream, Status(Code::kUnavailable,
                                      "file transfers in progress; retry the pack_diff"));
  }
  Result<std::unique_ptr<UpperTar>> t = UpperTar::open(options_.upper_fd, options_.upper_freeze);
  if (!t.isOk()) return sendError(f.stream, t.status());
  sendFrame(f.stream, FrameType::kResult, R"({"ok":true})");
  // The tar follows from pumpFileReads(), paced like a file read; the disk
  // thaws when it ends (or the stream is cancelled or the edge goes).
  packs_.emplace(f.stream, std::move(t).value());
}

void Agent::pumpFileReads() {
  while (!packs_.empty() && queued_ < kQueueHighWater && !done_) {
    auto it = packs_.begin();
    uint32_t stream = it->first;
    Status st = it->second->readChunk(scratch_, proto::kDataChunk);
    if (!st.isOk()) {
      // After the ok result: a second result ends the stream (as file_read).
      packs_.erase(it);
      sendError(stream, st);
      break;
    }
    if (scratch_.empty()) {
      packs_.erase(it);
      sendFrame(stream, FrameType::kData, {});
    } else {
      sendFrame(it->first, FrameType::kData, scratch_);
    }
  }
  while (!reads_.empty() && queued_ < kQueueHighWater && !done_) {
    auto it = reads_.lower_bound(next_read_);
    if (it == reads_.end()) it = reads_.begin();
    uint32_t stream = it->first;
    next_read_ = stream + 1;  // round robin, so one large read does not starve others
    Status st = it->second.readChunk(scratch_, proto::kDataChunk);
    if (!st.isOk()) {
      // The ok result went out already: a second result (instead of the
      // empty data frame) ends the stream.
      reads_.erase(it);
      sendError(stream, st);
    } else if (scratch_.empty()) {
      reads_.erase(it);
      sendFrame(stream, FrameType::kData, {});
    } else {
      sendFrame(stream, FrameType::kData, scratch_);
    }
  }
}

void Agent::handleSimpleFileOp(const Frame& f) {
  if (!acceptRequest(f)) return;
  Result<Json> j = parseObject(f.payload);
  if (!j.isOk()) return sendError(f.stream, j.status());
  std::string path;
  Status st = readPath(*j, "path", path);
  if (!st.isOk()) return sendError(f.stream, st);
  static const std::string kOk = R"({"ok":true})";
  if (f.type != FrameType::kList && f.type != FrameType::kStat && !packs_.empty()) {
    // The disk is frozen: a write would hang this loop, which must thaw it.
    return sendError(f.stream, Status(Code::kUnavailable,
                                      "a pack_diff is reading the sandbox's disk; retry"));
  }
  switch (f.type) {
    case FrameType::kList: {
      Result<std::string> payload = listDir(path, proto::kMaxPayload);
      if (!payload.isOk()) return sendError(f.stream, withPathField(payload.status()));
      return sendFrame(f.stream, FrameType::kResult, *payload);
    }
    case FrameType::kStat: {
      Result<Json> s = statPath(path);
      if (!s.isOk()) return sendError(f.stream, withPathField(s.status()));
      (*s)["ok"] = true;
      return sendFrame(f.stream, FrameType::kResult, dumpJson(*s));
    }
    case FrameType::kMkdir: {
      bool parents = true;
      int64_t mode = 0755;
      st = readBool(*j, "parents", parents);
      if (st.isOk()) st = readInt(*j, "mode", 0, 07777, mode);
      if (st.isOk()) st = fncallWritable(path);
      if (st.isOk()) st = withPathField(makeDir(path, parents, static_cast<mode_t>(mode)));
      if (!st.isOk()) return sendError(f.stream, st);
      return sendFrame(f.stream, FrameType::kResult, kOk);
    }
    case FrameType::kSetMeta: {
      auto meta = j->find("meta");
      std::map<std::string, std::string> kv;
      if (meta == j->end() || !meta->is_object()) {
        st = invalidArg("meta", "meta must be an object of strings");
      } else {
        for (auto it = meta->begin(); it != meta->end() && st.isOk(); ++it) {
          if (!it->is_string()) st = invalidArg("meta", "meta values must be strings");
          else kv[it.key()] = it->get<std::string>();
        }
      }
      if (st.isOk()) st = fncallWritable(path);
      if (st.isOk()) st = withPathField(setMeta(path, kv));
      if (!st.isOk()) return sendError(f.stream, st);
      return sendFrame(f.stream, FrameType::kResult, kOk);
    }
    case FrameType::kRemove: {
      bool recursive = false;
      st = readBool(*j, "recursive", recursive);
      if (st.isOk()) st = fncallWritable(path);
      if (st.isOk()) st = withPathField(removePath(path, recursive));
      if (!st.isOk()) return sendError(f.stream, st);
      return sendFrame(f.stream, FrameType::kResult, kOk);
    }
    default:
      return;
  }
}

// ---- running execs ----

void Agent::killGroup(const Exec& e, int sig) {
  // Once reaped the pid may belong to someone else.
  if (e.reaped) return;
  // Before the child's setsid() there is no group yet.
  if (::kill(-e.proc.pid, sig) < 0 && errno == ESRCH) ::kill(e.proc.pid, sig);
  // A terminal's shell runs its jobs in groups of their own: a kill takes
  // the one in the foreground too.
  if (sig == SIGKILL && e.proc.pty_master) {
    pid_t fg = ::tcgetpgrp(e.proc.pty_master.get());
    if (fg > 0 && fg != e.proc.pid) ::kill(-fg, SIGKILL);
  }
}

void Agent::reapChildren() {
  struct signalfd_siginfo si;
  while (::read(sigchld_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
  }
  // SIGCHLDs coalesce, and as PID 1 aether inherits every orphan: reap all.
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) break;
    onReaped(pid, status);
  }
}

void Agent::onReaped(pid_t pid, int status) {
  for (auto& [lang, z] : zygotes_) {
    if (z->pid() == pid) {
      dropZygote(lang, true);
      return;
    }
  }
  for (auto& [lang, z] : successors_) {
    if (z->pid() == pid) {
      dropSuccessor(std::string(lang), true);
      return;
    }
  }
  {
    auto pit = pid_streams_.find(pid);
    if (pit == pid_streams_.end()) return;
    uint32_t stream = pit->second;
    pid_streams_.erase(pit);
    auto eit = execs_.find(stream);
    if (eit == execs_.end()) return;
    Exec& e = *eit->second;
    e.reaped = true;
    e.wait_status = status;
    e.duration_us = elapsedUs(e.proc.started);
    if (e.timer) {
      unwatch(e.timer.get());
      e.timer.reset();
    }
    std::string failure = spawnFailureMessage(e.proc);
    if (!failure.empty()) deliver(e, 1, failure);
    e.proc.status_r.reset();
    // What the process wrote before exiting is in the pipes now; output that
    // background processes write later is not waited for.
    for (int which = 0; which < 2; ++which) {
      OutPipe& p = e.out[which];
      if (!p.fd) continue;
      int avail = 0;
      if (::ioctl(p.fd.get(), FIONREAD, &avail) < 0) avail = 0;
      p.drain_left = static_cast<uint64_t>(std::max(avail, 0));
      if (p.drain_left == 0) closePipe(e, which);
    }
    // While paused, the rest is read when the queue drains (the pipes are
    // re-watched then).
    if (!pipes_paused_) {
      for (int which = 0; which < 2; ++which) {
        while (e.out[which].fd) pumpPipe(e, which);
      }
    }
    maybeFinish(e);
  }
}

void Agent::onPipeReadable(uint32_t stream, int which) {
  auto it = execs_.find(stream);
  if (it == execs_.end()) return;
  pumpPipe(*it->second, which);
  maybeFinish(*it->second);
}

void Agent::pumpPipe(Exec& e, int which) {
  OutPipe& p = e.out[which];
  if (!p.fd) return;
  size_t want = static_cast<size_t>(std::min<uint64_t>(proto::kDataChunk, p.drain_left));
  scratch_.resize(proto::kDataChunk);
  ssize_t n = ::read(p.fd.get(), scratch_.data(), want);
  if (n > 0) {
    if (p.drain_left != UINT64_MAX) p.drain_left -= static_cast<uint64_t>(n);
    deliver(e, which, std::string_view(scratch_.data(), static_cast<size_t>(n)));
    if (p.drain_left == 0) closePipe(e, which);
    return;
  }
  if (n < 0 && errno == EINTR) return;
  // EAGAIN after reaping: what was there at exit has been read.
  if (n < 0 && errno == EAGAIN && !e.reaped) return;
  closePipe(e, which);
}

void Agent::deliver(Exec& e, int which, std::string_view data) {
  OutPipe& p = e.out[which];
  uint64_t room = p.delivered < e.max_output ? e.max_output - p.delivered : 0;
  size_t keep = static_cast<size_t>(std::min<uint64_t>(room, data.size()));
  // Past the cap the pipe is still drained, so the writer never blocks on us.
  if (keep < data.size()) e.truncated = true;
  while (keep > 0) {
    size_t n = std::min(keep, proto::kDataChunk);
    sendFrame(e.stream, which == 0 ? FrameType::kStdout : FrameType::kStderr, data.substr(0, n));
    p.delivered += n;
    data.remove_prefix(n);
    keep -= n;
  }
}

void Agent::closePipe(Exec& e, int which) {
  OutPipe& p = e.out[which];
  if (p.watched) unwatch(p.fd.get());
  p.watched = false;
  p.fd.reset();
}

void Agent::maybeFinish(Exec& e) {
  if (!e.reaped || e.out[0].fd || e.out[1].fd) return;
  closeStdin(e);
  int code = WIFEXITED(e.wait_status) ? WEXITSTATUS(e.wait_status) : -1;
  int sig = WIFSIGNALED(e.wait_status) ? WTERMSIG(e.wait_status) : 0;
  Json exit = {{"exit_code", code},
               {"signal", sig},
               {"timed_out", e.timed_out},
               {"truncated", e.truncated},
               {"duration_us", e.duration_us}};
  if (e.call) {
    // Which limit stopped it, when one did (docs/fncall.md).
    const char* limit = nullptr;
    if (e.timed_out) {
      limit = "timeout";
    } else if (sig == SIGXCPU) {
      limit = "cpu";
    } else if (sig == SIGXFSZ) {
      limit = "file_size";
    }
    // What only the call (on its socket) or its shell's exit code tells:
    // an uncaught MemoryError / EFBIG, a command killed by SIGXFSZ.
    std::string hinted = e.hint;
    if (!limit) {
      if (hinted.empty()) hinted = shellLimitOf(e.wait_status, e.limits);
      if (!hinted.empty()) limit = hinted.c_str();
    }
    if (!limit && e.truncated) limit = "output";
    exit["limit"] = limit ? Json(limit) : Json(nullptr);
    if (e.zygote_started) exit["zygote_start"] = true;
  }
  sendFrame(e.stream, FrameType::kExit, dumpJson(exit));
  if (e.call) {
    // The result goes out first (the main loop flushes it, then runs
    // finishedCalls), and what the clean-up takes is off its path. No
    // frame of the edge is read before the clean-up is done (one thread),
    // so the next call still finds nothing of this one.
    finished_calls_.push_back(
        FinishedCall{e.proc.pid, e.exclusive, std::move(e.run_dir), e.zygote_lang});
    e.run_dir.clear();
    if (e.call_sock) unwatch(e.call_sock.get());
  }
  execs_.erase(e.stream);  // `e` is gone from here on
}

void Agent::flushStdin(Exec& e) {
  while (e.stdin_off < e.stdin_buf.size()) {
    ssize_t n = ::write(e.proc.stdin_w.get(), e.stdin_buf.data() + e.stdin_off,
                        e.stdin_buf.size() - e.stdin_off);
    if (n > 0) {
      e.stdin_off += static_cast<size_t>(n);
      stdin_buffered_ -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      if (!e.stdin_watched) {
        watch(e.proc.stdin_w.get(), tag(kStdinKind, e.stream), EPOLLOUT);
        e.stdin_watched = true;
      }
      return;
    }
    // EPIPE: the process closed its stdin; the rest is dropped, as a pipe would.
    closeStdin(e);
    return;
  }
  e.stdin_buf.clear();
  e.stdin_off = 0;
  if (e.stdin_watched) {
    unwatch(e.proc.stdin_w.get());
    e.stdin_watched = false;
  }
  if (e.stdin_close) closeStdin(e);
}

void Agent::onStdinWritable(uint32_t stream) {
  auto it = execs_.find(stream);
  if (it == execs_.end() || !it->second->proc.stdin_w) return;
  flushStdin(*it->second);
}

void Agent::closeStdin(Exec& e) {
  if (!e.proc.stdin_w) return;
  if (e.stdin_watched) unwatch(e.proc.stdin_w.get());
  e.stdin_watched = false;
  stdin_buffered_ -= e.stdin_buf.size() - e.stdin_off;
  e.stdin_buf.clear();
  e.stdin_off = 0;
  e.stdin_close = true;
  e.proc.stdin_w.reset();
}

void Agent::onTimer(uint32_t stream) {
  auto it = execs_.find(stream);
  if (it == execs_.end() || !it->second->timer) return;
  Exec& e = *it->second;
  uint64_t expirations = 0;
  if (::read(e.timer.get(), &expirations, sizeof expirations) != sizeof expirations) return;
  unwatch(e.timer.get());
  e.timer.reset();
  if (e.reaped) return;
  e.timed_out = true;
  killGroup(e, SIGKILL);
}

}  // namespace dsec::aether

// ---- fncall (fncall.h, docs/fncall.md) ----

namespace dsec::aether {

namespace {

Status pipeCloexec(UniqueFd& r, UniqueFd& w) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) < 0) return sysError("pipe");
  r.reset(fds[0]);
  w.reset(fds[1]);
  return Status::ok();
}

Status nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return sysError("fcntl");
  return Status::ok();
}

bool hasEnv(const std::vector<std::string>& env, std::string_view name) {
  for (const auto& e : env) {
    if (e.size() > name.size() && e.compare(0, name.size(), name) == 0 && e[name.size()] == '=') {
      return true;
    }
  }
  return false;
}

Status writeWhole(const std::string& path, const std::string& data) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) return sysError("create " + path);
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd.get(), data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return sysError("write " + path);
    off += size_t(n);
  }
  return Status::ok();
}

}  // namespace

Result<SpawnedExec> Agent::spawnCall(ExecRequest& req, const CallRequest& call, Exec& e,
                                     std::vector<std::pair<pid_t, int>>& exits) {
  const FncallConfig& cfg = *options_.fncall;
  e.call = true;
  e.exclusive = call.exclusive;
  CallLimits limits = call.limits ? *call.limits : cfg.defaults;
  e.limits = limits;
  std::vector<std::string> env = req.env ? *req.env : options_.exec.default_env;
  if (call.fresh_dir) {
    // A new working dir per one-shot call, with the call's files; removed
    // (with whatever the call wrote there) when it ends.
    e.run_dir = std::string(kRunDir) + "/c" + std::to_string(++call_seq_);
    if (::mkdir(e.run_dir.c_str(), 0777) < 0) return sysError("mkdir " + e.run_dir);
    ::chmod(e.run_dir.c_str(), 0777);
    for (const auto& [rel, data] : call.files) {
      std::string path = e.run_dir + "/" + rel;
      if (size_t slash = path.rfind('/'); slash > e.run_dir.size()) {
        RETURN_IF_ERROR(makeDir(path.substr(0, slash), true, 0777));
      }
      RETURN_IF_ERROR(writeWhole(path, data).withContext("files"));
    }
    req.cwd = e.run_dir;
  } else if (!req.cwd) {
    req.cwd = kScratchDir;
  }
  if (!hasEnv(env, "TMPDIR")) env.push_back("TMPDIR=" + *req.cwd);
  req.env = env;

  // A python call whose env sets PYTHONHASHSEED (a fixed seed, or "random":
  // one of its own) runs as a fresh `python3 -c`: the zygote's forks all
  // share its hash secret.
  bool freshPython = call.language == "python" && hasEnv(env, "PYTHONHASHSEED");
  if (call.language.empty() || call.language != "python" || freshPython) {
    if (freshPython) {
      req.argv = {"python3", "-c", call.code};
    } else if (call.language == "bash") {
      req.argv = {"bash", "-c", call.code};
    } else if (!call.language.empty()) {
      req.argv = cfg.languages.at(call.language);
      req.argv.push_back(call.code);
    }
    req.rlimits = callRlimits(limits);
    return spawnExec(req, options_.exec);
  }

  // Bounds how many calls share a hash secret: a zygote that has forked
  // its quota is replaced now, before this call rather than after the last
  // (whose exit report, with its limit hint, it has most likely sent).
  // Calls of it still running go on, re-parented to aether.
  if (auto it = zygotes_.find(call.language);
      it != zygotes_.end() && it->second->calls() >= cfg.zygote_max_calls) {
    dropZygote(call.language, false);
  }
  e.zygote_started = !zygotes_.count(call.language);
  ASSIGN_OR_RETURN(Zygote * z, zygoteFor(call.language));
  SpawnedExec out;
  UniqueFd child_in, child_out, child_err;
  if (req.stdin_pipe) {
    RETURN_IF_ERROR(pipeCloexec(child_in, out.stdin_w));
    RETURN_IF_ERROR(nonblocking(out.stdin_w.get()));
  } else {
    child_in.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!child_in) return sysError("open /dev/null");
  }
  RETURN_IF_ERROR(pipeCloexec(out.stdout_r, child_out));
  RETURN_IF_ERROR(pipeCloexec(out.stderr_r, child_err));
  RETURN_IF_ERROR(nonblocking(out.stdout_r.get()));
  RETURN_IF_ERROR(nonblocking(out.stderr_r.get()));
  if (!hasEnv(env, "PATH")) env.push_back(std::string("PATH=") + kDefaultPath);
  if (!hasEnv(env, "HOME")) env.push_back("HOME=/root");
  ::clock_gettime(CLOCK_MONOTONIC, &out.started);
  auto spawned = z->spawn(call.code, *req.cwd, env, limits, child_in.get(), child_out.get(),
                          child_err.get(), exits);
  if (!spawned.isOk() && z->hungUp() && !e.zygote_started) {
    // It died after its last call (a call may kill it; that call's result
    // can come, from its own socket, before aether sees the zygote go):
    // this call starts a new one.
    dropZygote(call.language, false);
    e.zygote_started = true;
    ASSIGN_OR_RETURN(z, zygoteFor(call.language));
    spawned = z->spawn(call.code, *req.cwd, env, limits, child_in.get(), child_out.get(),
                       child_err.get(), exits);
  }
  if (!spawned.isOk()) {
    // A zygote that fails a request is replaced on the next call.
    dropZygote(call.language, false);
    return spawned.status();
  }
  out.pid = spawned->first;
  e.call_sock = std::move(spawned->second);
  e.zygote_lang = call.language;
  out.argv0 = call.language;
  out.cwd = *req.cwd;
  return out;
}

void Agent::onCallSocket(uint32_t stream) {
  auto it = execs_.find(stream);
  if (it == execs_.end() || !it->second->call_sock) return;
  Exec& e = *it->second;
  char buf[64];
  for (;;) {
    ssize_t got = ::recv(e.call_sock.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (got <= 0) {
      // Hung up without "exit:" (killed, or it died in its set-up): its
      // zygote reports the wait status once it reaps it.
      unwatch(e.call_sock.get());
      e.call_sock.reset();
      return;
    }
    std::string_view m(buf, size_t(got));
    // Only names aether itself would give: a call cannot forge others.
    if (m == "memory" || m == "file_size") {
      e.hint = std::string(m);
    } else if (m.starts_with("exit:") && !e.reaped) {
      int rc = 0;
      for (char c : m.substr(5)) {
        if (c < '0' || c > '9' || rc > 255) return;
        rc = rc * 10 + (c - '0');
      }
      // Said just before its _exit: the result need not wait for the
      // kernel to free its copy of the zygote's memory, nor for the zygote
      // to reap it. A call that says it early only ends itself: what it
      // left is killed as any call's (finishCall).
      if (auto z = zygotes_.find(e.zygote_lang); z != zygotes_.end()) {
        z->second->endedEarly(e.proc.pid);
      }
      onReaped(e.proc.pid, (rc & 0xFF) << 8);  // may end `e`
      return;
    }
  }
}

Result<std::unique_ptr<Zygote>> Agent::beginZygote(const std::string& language) {
  UniqueFd listener;
  Result<std::unique_ptr<Zygote>> z = Zygote::begin(language, options_.exec, listener);
  if (listener) {
    int fd = listener.get();
    (void)nonblocking(fd);
    watch(fd, tag(kSeccompKind, static_cast<uint32_t>(fd)), EPOLLIN);
    listeners_[fd] = std::move(listener);
  }
  if (!z.isOk()) return z.status();
  watch((*z)->ctlFd(), tag(kZygoteKind, static_cast<uint32_t>((*z)->ctlFd())), EPOLLIN);
  return z;
}

Result<Zygote*> Agent::zygoteFor(const std::string& language) {
  if (auto it = zygotes_.find(language); it != zygotes_.end()) return it->second.get();
  std::unique_ptr<Zygote> z;
  if (auto s = successors_.find(language); s != successors_.end()) {
    // Started ahead (beginSuccessor): most or all of its start-up is done.
    z = std::move(s->second);
    successors_.erase(s);
    if (Status st = z->awaitReady(kZygoteStartMs); !st.isOk()) {
      unwatch(z->ctlFd());
      logError("zygote started ahead", st);
      z.reset();
    }
  }
  if (!z) {
    ASSIGN_OR_RETURN(z, beginZygote(language));
    if (Status st = z->awaitReady(kZygoteStartMs); !st.isOk()) {
      unwatch(z->ctlFd());
      return st;
    }
  }
  Zygote* raw = z.get();
  zygotes_[language] = std::move(z);
  return raw;
}

void Agent::beginSuccessor(const std::string& language) {
  // A zygote is retired after zygote_max_calls calls; its successor starts
  // once three quarters of them are done, so the call that finds the quota
  // full does not wait for an interpreter to start and import (~0.1-0.5 s).
  auto it = zygotes_.find(language);
  if (it == zygotes_.end() || successors_.count(language)) return;
  const int64_t max = options_.fncall->zygote_max_calls;
  if (it->second->calls() < max - max / 4) return;
  auto z = beginZygote(language);
  if (!z.isOk()) {
    logError("zygote successor", z.status());
    return;
  }
  successors_[language] = std::move(*z);
}

void Agent::dropSuccessor(const std::string& language, bool reaped) {
  auto it = successors_.find(language);
  if (it == successors_.end()) return;
  unwatch(it->second->ctlFd());
  if (reaped) it->second->forgetPid();
  successors_.erase(it);  // the destructor kills it unless reaped
}

void Agent::onZygoteReadable(int fd) {
  for (auto& [lang, z] : successors_) {
    if (z->ctlFd() != fd) continue;
    std::string name = lang;  // dropSuccessor erases the entry
    if (!z->ready()) {
      if (z->pollReady() == Zygote::kFailed) dropSuccessor(name, false);
      return;
    }
    // Its first spare (and, were one to die, its exit report) until it is
    // promoted: no call of its own has run.
    std::vector<std::pair<pid_t, int>> exits;
    if (!z->readExits(exits)) dropSuccessor(name, false);
    return;
  }
  for (auto& [lang, z] : zygotes_) {
    if (z->ctlFd() != fd) continue;
    std::vector<std::pair<pid_t, int>> exits;
    bool alive = z->readExits(exits);
    std::string name = lang;  // dropZygote erases the entry
    if (!alive) dropZygote(name, false);
    for (auto& [pid, status] : exits) onReaped(pid, status);
    return;
  }
}

void Agent::dropZygote(const std::string& language, bool reaped) {
  auto it = zygotes_.find(language);
  if (it == zygotes_.end()) return;
  unwatch(it->second->ctlFd());
  // Reaped: its pid is free and must not be signalled. Otherwise the
  // destructor kills it and reapChildren reaps it; the calls it had forked
  // are then aether's (a subreaper) and reaped here as usual.
  if (reaped) {
    auto doomed = std::move(it->second);
    zygotes_.erase(it);
    doomed->forgetPid();
    return;
  }
  zygotes_.erase(it);
}

Status Agent::fncallWritable(const std::string& path) const {
  if (!options_.fncall) return Status::ok();
  std::string_view p = path;
  std::string_view dir = kScratchDir;
  if (p.size() > dir.size() && p.substr(0, dir.size()) == dir && p[dir.size()] == '/' &&
      p.find("/../") == std::string_view::npos && !p.ends_with("/..")) {
    return Status::ok();
  }
  return Status(Code::kPermissionDenied,
                "a fncall sandbox is read-only outside /scratch: " + path, EROFS, "path");
}

std::set<pid_t> Agent::zygotePids() const {
  std::set<pid_t> out;
  for (auto& [lang, z] : zygotes_) out.insert(z->pid());
  for (auto& [lang, z] : successors_) out.insert(z->pid());
  return out;
}

void Agent::finishCall(Exec& e) {
  cleanUpCall(e.proc.pid, e.exclusive, e.run_dir);
  e.run_dir.clear();
}

void Agent::cleanUpCall(pid_t pid, bool exclusive, const std::string& run_dir) {
  // Nothing a call started survives it: its session, process group and
  // their descendants (an exclusive caller: everything but the zygotes).
  killCallProcesses(pid, exclusive, zygotePids());
  if (!run_dir.empty()) {
    Status st = removePath(run_dir, true);
    if (!st.isOk()) logError("remove call dir", st);
  }
  if (exclusive) wipeSandboxState();
}

void Agent::finishedCalls() {
  if (finished_calls_.empty()) return;
  flushOutput();  // their results first
  auto done = std::move(finished_calls_);
  finished_calls_.clear();
  for (auto& c : done) {
    cleanUpCall(c.pid, c.exclusive, c.run_dir);
    // The next spare is forked now, not while a call runs (docs/fncall.md:
    // forked as a call starts, it slows that call down more than it saves).
    if (auto it = zygotes_.find(c.zygote_lang); it != zygotes_.end()) it->second->requestSpare();
    beginSuccessor(c.zygote_lang);
  }
}

}  // namespace dsec::aether
