// The edge's side of the agent protocol (docs/agent-protocol.md): a Reactor
// thread reads every agent connection and routes frames to per-request
// streams; callers block on their stream. Also watches pidfds so the edge
// learns when a sandbox's agent dies.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include <thread>
#include <unordered_map>

#include "common/fd.h"
#include "common/frame.h"
#include "common/status.h"

namespace dsec::edge {

// Where a stream's frames go when they are not queued for next(): called on
// the reactor thread, in order; must not block. onFail runs once, when the
// connection dies (after the last frame).
struct StreamHandler {
  std::function<void(proto::Frame& f)> onFrame;
  std::function<void(const Status& why)> onFail;
};

// Inbox of one request's frames, or (opened with a StreamHandler) the route
// of its frames to a callback. Thread-safe.
class AgentStream {
 public:
  explicit AgentStream(uint32_t id, StreamHandler h = {}) : id_(id), handler_(std::move(h)) {}
  uint32_t id() const { return id_; }
  // Next frame, waiting until `deadline` (monoSeconds()). kDeadlineExceeded on
  // timeout; kUnavailable once the connection has died and the inbox is empty.
  // Not for a stream with a handler.
  Result<proto::Frame> next(double deadline);

 private:
  friend class AgentConn;
  void push(proto::Frame f);
  void fail(const Status& why);

  const uint32_t id_;
  const StreamHandler handler_;
  std::mutex mu_;  // guards q_, failed_
  std::condition_variable cv_;
  std::deque<proto::Frame> q_;
  Status failed_;
};

// One agent connection. Writes from any thread (serialized); reads only from
// the Reactor.
class AgentConn {
 public:
  AgentConn(UniqueFd sock, std::string name);
  ~AgentConn();

  int fd() const { return sock_.get(); }
  const std::string& name() const { return name_; }

  // Stream 0: start-up frames (hello).
  std::shared_ptr<AgentStream> control() { return control_; }
  // A new request stream; frames for it queue until closeStream(), or go to
  // `h` (an exec in flight costs no waiting thread). A dead connection fails
  // the stream at once (h.onFail runs before this returns).
  std::shared_ptr<AgentStream> openStream(StreamHandler h = {});
  void closeStream(uint32_t id);

  // Sends one frame whole. Blocks while the socket is full (bounded by a send
  // timeout). kUnavailable once the connection is dead. passFd >= 0 goes
  // along with the frame's first byte (SCM_RIGHTS; the caller keeps its
  // copy): the init frame's rootfs mount in user namespace mode.
  Status send(uint32_t stream, proto::FrameType type, std::string_view payload, int passFd = -1);
  // The same with up to kMaxPassFds descriptors, in order (the init frame's
  // rootfs mount, then its disk clone). kInvalidArgument for more.
  static constexpr size_t kMaxPassFds = 4;
  Status send(uint32_t stream, proto::FrameType type, std::string_view payload,
              const std::vector<int>& passFds);

  // Reactor side: drains readable bytes. False once the connection is dead.
  bool onReadable();
  // Fails every stream with `why` and refuses further sends.
  void fail(const Status& why);
  bool dead() const;
  // Syscalls the sandbox's seccomp profile refused, as the agent last said
  // (it tells unasked, at most every 100 ms; kDenied frames).
  uint64_t deniedSyscalls() const { return deniedSyscalls_.load(std::memory_order_relaxed); }

 private:
  std::shared_ptr<AgentStream> streamFor(uint32_t id);

  UniqueFd sock_;
  const std::string name_;
  std::shared_ptr<AgentStream> control_;
  proto::FrameDecoder decoder_;  // used only by the reactor thread
  std::mutex writeMu_;           // serializes whole frames on the socket
  mutable std::mutex mu_;        // guards streams_, nextId_, dead_, deathReason_
  std::unordered_map<uint32_t, std::shared_ptr<AgentStream>> streams_;
  uint32_t nextId_ = 1;
  bool dead_ = false;
  Status deathReason_;
  std::atomic<uint64_t> deniedSyscalls_{0};
};

// One epoll thread for all agent connections and agent pidfds of an edge.
// Exit callbacks run one at a time on a worker thread the Reactor owns, so
// stop() can wait for them.
class Reactor {
 public:
  Reactor();
  ~Reactor();
  Status start();
  // Stops the epoll thread, then waits for exit callbacks queued or running.
  void stop();

  Status add(std::shared_ptr<AgentConn> conn);
  void remove(const std::shared_ptr<AgentConn>& conn);
  // Calls onExit once (on the exit worker) when the process behind pidfd exits.
  Status watchExit(int pidfd, std::function<void()> onExit);
  void unwatchExit(int pidfd);

 private:
  // Registrations are keyed by a never-reused id, not by fd: an event read
  // for a closed fd must not reach whatever reuses that fd number.
  struct Entry {
    int fd = -1;
    std::shared_ptr<AgentConn> conn;  // or
    std::function<void()> onExit;
  };
  void loop();
  void exitLoop();
  Status addEntry(Entry e);
  void removeByFd(int fd);

  UniqueFd epoll_;
  UniqueFd wake_;  // eventfd that stops the loop
  std::thread thread_;
  std::mutex mu_;  // guards entries_, byFd_, nextId_
  std::unordered_map<uint64_t, Entry> entries_;
  std::unordered_map<int, uint64_t> byFd_;
  uint64_t nextId_ = 1;

  std::mutex exitMu_;  // guards exitQueue_, exitStop_
  std::condition_variable exitCv_;
  std::deque<std::function<void()>> exitQueue_;
  bool exitStop_ = false;
  std::thread exitThread_;
};

// Runs a blocking request/response pair on a fresh stream: sends `type` with
// `json`, waits for the kResult, and maps ok:false into a Status.
Result<std::string> agentCall(AgentConn& conn, proto::FrameType type, const std::string& json,
                              double timeoutSeconds);
// Turns a kResult payload with ok:false into its Status (code, message, errno).
Status resultStatus(const std::string& payload);
// Waits until `deadline` (monoSeconds) for the agent's hello on stream 0
// (after init or reattach); a result there is the agent's refusal. Errors
// carry `code` and `what`.
Status awaitHello(AgentConn& conn, double deadline, Code code, const std::string& what);
// SIGKILLs the process of `pidfd` and waits until it has exited: reaped when
// it is our child, else (a sandbox adopted from an earlier edge) until the
// pidfd turns readable. A PID 1 exits only after the rest of its namespace.
void killAndWait(int pidfd);

}  // namespace dsec::edge
