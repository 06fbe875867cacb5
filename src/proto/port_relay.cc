#include "proto/port_relay.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>

namespace dsec::proto {

namespace asio = boost::asio;

namespace {
// One socket read: a link data frame's worth.
constexpr size_t kReadChunk = 64u << 10;
// Reads in a row before the relay lets other work on the io thread run.
constexpr int kReadsPerTurn = 16;
}  // namespace

// Everything below `strand` is touched only on the strand (the atomics are
// also read from other threads).
struct PortRelay::Impl : std::enable_shared_from_this<PortRelay::Impl> {
  Impl(Runtime& rt, UniqueFd fd, std::string name, bool client)
      : isClient(client), label(std::move(name)), strand(asio::make_strand(rt.io())), sock(strand) {
    fdNum = fd.get();
    boost::system::error_code ec;
    sock.assign(fd.release(), ec);
    if (ec) {
      ::close(fdNum);
      broken = Status(Code::kInternal, label + ": " + ec.message());
    }
  }

  const bool isClient;
  const std::string label;
  asio::strand<asio::io_context::executor_type> strand;
  std::atomic<bool> ended{false};
  std::atomic<uint64_t> toCall{0}, toSocket{0};

  asio::posix::stream_descriptor sock;
  int fdNum = -1;
  Status broken;  // the socket could not be taken over
  std::shared_ptr<ServerCall> server;
  std::shared_ptr<ClientCall> clientCall;
  bool attached = false;     // client: clientCall is set
  size_t pendingCredit = 0;  // client: taken before attach
  Status abortBeforeAttach;  // client: ended before attach, with this
  // socket -> call
  std::string pendingSend;  // refused by the link: sent again on writable
  bool waitingWritable = false, reading = false;
  bool sockEof = false, endSent = false;
  // call -> socket
  std::deque<std::string> wq;
  size_t wqOff = 0;
  bool writing = false;
  bool callEnded = false, sockShut = false;
  bool peerDone = false;  // client: the call's outcome was a success

  // Runs fn on the strand.
  void post(std::function<void(Impl&)> fn) {
    asio::post(strand, [self = shared_from_this(), fn = std::move(fn)] { fn(*self); });
  }

  Status sockError(const char* what, int err) const {
    return Status(Code::kUnavailable, label + ": " + what + ": " + std::strerror(err), err);
  }

  bool callReady() const { return !isClient || attached; }
  Status callSend(std::string_view b) { return isClient ? clientCall->send(b) : server->send(b); }
  Status callEnd() { return isClient ? clientCall->end() : server->end(); }
  void credit(size_t n) {
    if (ended) return;
    if (!isClient) {
      server->consumed(n);
    } else if (attached) {
      clientCall->consumed(n);
    } else {
      pendingCredit += n;
    }
  }

  void start() {
    if (!broken.isOk()) return fail(broken);
    pump();
  }

  // socket -> call.
  void pump() {
    if (ended || sockEof || !callReady() || reading || waitingWritable) return;
    // One buffer per io thread, not per connection (an idle one holds no
    // buffer): the link copies what it takes, and a refused read is kept
    // in pendingSend.
    static thread_local std::unique_ptr<char[]> buf;
    if (!buf) buf = std::make_unique_for_overwrite<char[]>(kReadChunk);
    char* readBuf = buf.get();
    for (int i = 0; i < kReadsPerTurn; ++i) {
      ssize_t n = ::recv(fdNum, readBuf, kReadChunk, MSG_DONTWAIT);
      if (n > 0) {
        std::string_view chunk(readBuf, size_t(n));
        Status st = callSend(chunk);
        if (st.code() == Code::kResourceExhausted) {
          pendingSend.assign(chunk);
          waitingWritable = true;  // onWritable sends it and reads on
          return;
        }
        if (!st.isOk()) return fail(st);
        toCall += uint64_t(n);
        continue;
      }
      if (n == 0) return onSockEof();
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        reading = true;
        sock.async_wait(asio::posix::descriptor_base::wait_read,
                        [self = shared_from_this()](const boost::system::error_code& ec) {
                          self->reading = false;
                          if (!ec) self->pump();
                        });
        return;
      }
      return fail(sockError("read", errno));
    }
    // More may be there: go on after whatever else waits for this thread.
    reading = true;
    post([](Impl& r) {
      r.reading = false;
      r.pump();
    });
  }

  void onWritable() {
    if (ended || !waitingWritable) return;
    Status st = callSend(pendingSend);
    if (st.code() == Code::kResourceExhausted) return;  // still full: the next one
    if (!st.isOk()) return fail(st);
    toCall += pendingSend.size();
    std::string().swap(pendingSend);
    waitingWritable = false;
    pump();
  }

  void onSockEof() {
    sockEof = true;
    if (!sockShut) {
      // Shut both ways while its write side was still open: by someone else
      // (the node's cut, the caller's close), not the peer's half-close.
      pollfd p{fdNum, 0, 0};
      if (::poll(&p, 1, 0) == 1 && (p.revents & POLLHUP)) {
        return fail(Status(Code::kUnavailable, label + ": the connection was closed"));
      }
    }
    Status st = callEnd();
    if (!st.isOk()) return fail(st);
    endSent = true;
    if (!sockShut) watchHangup();
    maybeFinish();
  }

  // Half-closed by the peer, the other way still open: nothing is read any
  // more, so a later cut (or the caller's close) is noticed by waiting for
  // the hang-up (EPOLLHUP, EPOLLERR wake error waits), not by a read.
  void watchHangup() {
    sock.async_wait(asio::posix::descriptor_base::wait_error,
                    [self = shared_from_this()](const boost::system::error_code& ec) {
                      if (ec || self->ended || self->sockShut) return;
                      pollfd p{self->fdNum, 0, 0};
                      (void)::poll(&p, 1, 0);
                      int err = 0;
                      socklen_t len = sizeof err;
                      (void)::getsockopt(self->fdNum, SOL_SOCKET, SO_ERROR, &err, &len);
                      if (err != 0) return self->fail(self->sockError("socket", err));
                      if (p.revents & POLLHUP) {
                        return self->fail(Status(Code::kUnavailable,
                                                 self->label + ": the connection was closed"));
                      }
                      self->watchHangup();  // something else (urgent data): wait on
                    });
  }

  // call -> socket.
  void onCallData(std::string bytes) {
    if (ended || bytes.empty()) return;
    wq.push_back(std::move(bytes));
    flushWrites();
  }

  void onCallEnd() {
    if (ended) return;
    callEnded = true;
    flushWrites();
  }

  void flushWrites() {
    if (ended || writing) return;
    while (!wq.empty()) {
      const std::string& front = wq.front();
      ssize_t n =
          ::send(fdNum, front.data() + wqOff, front.size() - wqOff, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        wqOff += size_t(n);
        toSocket += uint64_t(n);
        if (wqOff == front.size()) {
          size_t done = front.size();
          wq.pop_front();
          wqOff = 0;
          credit(done);  // the sender may send that much more
        }
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        writing = true;
        sock.async_wait(asio::posix::descriptor_base::wait_write,
                        [self = shared_from_this()](const boost::system::error_code& ec) {
                          self->writing = false;
                          if (!ec) self->flushWrites();
                        });
        return;
      }
      return fail(sockError("write", errno));
    }
    if (callEnded && !sockShut) {
      // ENOTCONN: shut already (or reset: the read side reports that).
      if (::shutdown(fdNum, SHUT_WR) != 0 && errno != ENOTCONN) {
        return fail(sockError("shutdown", errno));
      }
      sockShut = true;
    }
    maybeFinish();
  }

  void maybeFinish() {
    if (ended || !wq.empty() || writing) return;
    bool both = sockEof && endSent && sockShut;
    if (!both && !(isClient && peerDone)) return;
    ended = true;
    closeSocket();
    if (!isClient) (void)server->reply("{}");
    dropCall();
  }

  // Ends with an error, telling the call: the edge fails it, the platform
  // cancels it.
  void fail(const Status& why) {
    if (ended) return;
    ended = true;
    closeSocket();
    if (!isClient) {
      (void)server->fail(why);
    } else if (attached) {
      clientCall->cancel(why);
    } else {
      abortBeforeAttach = why;
    }
    dropCall();
  }

  // The call ended first (cancelled on the edge; failed on the platform):
  // the socket goes at once.
  void closeQuietly() {
    if (ended) return;
    ended = true;
    closeSocket();
    dropCall();
  }

  void onCallDone(bool ok) {
    if (!ok) return closeQuietly();
    peerDone = true;
    maybeFinish();  // at once, or when the last bytes are written
  }

  void attach(std::shared_ptr<ClientCall> call) {
    if (ended) {
      if (!abortBeforeAttach.isOk()) call->cancel(abortBeforeAttach);
      return;
    }
    clientCall = std::move(call);
    attached = true;
    if (pendingCredit > 0) clientCall->consumed(std::exchange(pendingCredit, 0));
    start();
  }

  void closeSocket() {
    boost::system::error_code ec;
    sock.close(ec);  // pending waits end with operation_aborted
    wq.clear();
    std::string().swap(pendingSend);
  }

  // The call's callbacks hold this; without the reverse, nothing cycles.
  void dropCall() {
    server.reset();
    clientCall.reset();
  }
};

std::shared_ptr<PortRelay> PortRelay::serve(Runtime& rt, UniqueFd fd,
                                            std::shared_ptr<ServerCall> call, std::string label) {
  auto impl = std::make_shared<Impl>(rt, std::move(fd), std::move(label), false);
  impl->server = call;
  call->onCancel([impl](const Status&) { impl->post([](Impl& r) { r.closeQuietly(); }); });
  call->onWritable([impl] { impl->post([](Impl& r) { r.onWritable(); }); });
  call->onData(
      [impl](std::string_view b) {
        impl->post([bytes = std::string(b)](Impl& r) mutable { r.onCallData(std::move(bytes)); });
      },
      [impl] { impl->post([](Impl& r) { r.onCallEnd(); }); }, /*manualCredit=*/true);
  impl->post([](Impl& r) { r.start(); });
  return std::make_shared<PortRelay>(impl);
}

std::shared_ptr<PortRelay> PortRelay::client(Runtime& rt, UniqueFd fd, std::string label) {
  return std::make_shared<PortRelay>(
      std::make_shared<Impl>(rt, std::move(fd), std::move(label), true));
}

CallHandler PortRelay::handler(std::function<void(std::string_view)> onEvent,
                               std::function<void(const Result<std::string>&)> onDone) {
  auto impl = impl_;
  CallHandler h;
  h.manualCredit = true;
  h.onEvent = [impl, onEvent = std::move(onEvent)](std::string_view p) {
    if (onEvent) onEvent(p);
    size_t n = p.size();
    impl->post([n](Impl& r) { r.credit(n); });
  };
  h.onData = [impl](std::string_view b) {
    impl->post([bytes = std::string(b)](Impl& r) mutable { r.onCallData(std::move(bytes)); });
  };
  h.onEnd = [impl] { impl->post([](Impl& r) { r.onCallEnd(); }); };
  h.onWritable = [impl] { impl->post([](Impl& r) { r.onWritable(); }); };
  h.onDone = [impl, onDone = std::move(onDone)](Result<std::string> outcome) {
    if (onDone) onDone(outcome);
    bool ok = outcome.isOk();
    impl->post([ok](Impl& r) { r.onCallDone(ok); });
  };
  return h;
}

void PortRelay::attach(std::shared_ptr<ClientCall> call) {
  impl_->post([call = std::move(call)](Impl& r) mutable { r.attach(std::move(call)); });
}

void PortRelay::abort(Status why) {
  if (why.isOk()) why = Status(Code::kUnavailable, impl_->label + ": aborted");
  impl_->post([why = std::move(why)](Impl& r) { r.fail(why); });
}

bool PortRelay::ended() const { return impl_->ended.load(); }
uint64_t PortRelay::bytesToCall() const { return impl_->toCall.load(); }
uint64_t PortRelay::bytesToSocket() const { return impl_->toSocket.load(); }

}  // namespace dsec::proto
