// The vm backend's guest channel (docs/vm.md): qemu-guest-agent's JSON
// protocol over a virtio-serial port that QEMU exposes as a unix socket, and
// a bridge that serves the edge's agent protocol (docs/agent-protocol.md) on
// top of it, so exec and file calls reach a foreign guest through the same
// AgentConn as every other backend.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/frame.h"
#include "common/status.h"

namespace dsec::edge {

// One connection to qemu-guest-agent. qga answers one request at a time, in
// order; call() serializes callers. Thread-safe.
class QgaClient {
 public:
  explicit QgaClient(UniqueFd sock) : sock_(std::move(sock)) {}

  // Resynchronizes the stream (guest-sync-delimited, after a 0xFF that resets
  // qga's parser) until `deadline` (monoSeconds). kDeadlineExceeded when the
  // guest never answered: not booted yet, or no qga in it.
  Status sync(double deadline);
  // Runs one command; its "return" value. A qga error is kInternal with its
  // description (mapped to a closer code where the text names an errno, see
  // codeFromText). A reply later than timeoutS leaves the stream to be
  // resynchronized before the next call.
  Result<nlohmann::json> call(const std::string& command, const nlohmann::json& args,
                              double timeoutS = 30);
  // Unblocks a waiting call and fails all later ones (the VM is going).
  void close();

 private:
  Status syncLocked(double deadline);
  Result<nlohmann::json> readReply(double deadline);

  std::mutex mu_;  // guards sock_ use, buf_, desynced_, nextSync_
  UniqueFd sock_;
  std::string buf_;
  bool desynced_ = true;
  uint64_t nextSync_ = 0;
  std::atomic<bool> closed_{false};
};

// Status code of an error text that names an errno ("No such file or
// directory" is kNotFound, ...); kInternal otherwise.
Code codeFromText(const std::string& text);

// Serves the agent protocol on `agentEnd` (the other end is the edge's
// AgentConn) by translating requests into qga commands:
//   exec: guest-exec with captured output, polled with guest-exec-status; the
//     output arrives at the end (qga cannot stream); the timeout is enforced
//     in the guest by `timeout -s KILL`, cwd by `sh -c 'cd ..'`, user by
//     runuser/setpriv; signal and cancel become a guest `kill`.
//   file_read / file_write: guest-file-open/seek/read/write/close (base64);
//     a write goes to a temp file renamed over the target (with its mode set)
//     by one guest command.
//   stat / list / mkdir / remove: guest commands (stat, find, mkdir, rm).
//   policy: accepted when it has no file rules; audit: nothing denied.
// Sends hello on stream 0 at start and after init/reattach. Thread-safe.
class QgaBridge {
 public:
  QgaBridge(UniqueFd agentEnd, std::shared_ptr<QgaClient> qga);
  ~QgaBridge();
  // Starts the serving thread and sends hello.
  Status start();
  // Stops serving: closes qga and the socket, waits for request threads.
  void stop();

 private:
  struct Pending;  // an exec waiting for stdin, or a file write collecting data
  void loop();
  void dispatch(proto::Frame f);
  void send(uint32_t stream, proto::FrameType type, std::string_view payload);
  void sendResult(uint32_t stream, const Status& st, nlohmann::json extra = {});
  void spawn(std::function<void()> work);
  void runExec(uint32_t stream, nlohmann::json req, std::string stdinData);
  void runFileRead(uint32_t stream, nlohmann::json req);
  void runFileWrite(uint32_t stream, nlohmann::json req, std::string data);
  void runSimple(uint32_t stream, proto::FrameType type, nlohmann::json req);
  // A guest command run to its end: exit code, stdout, stderr.
  struct CmdResult {
    int exitCode = -1;
    std::string out, err;
  };
  Result<CmdResult> runGuest(const std::vector<std::string>& argv, double timeoutS = 30);

  UniqueFd sock_;
  std::shared_ptr<QgaClient> qga_;
  std::mutex writeMu_;  // whole frames on sock_
  std::mutex mu_;       // guards pending_, guestPids_, cancelled_, active_, stopping_
  std::map<uint32_t, std::shared_ptr<Pending>> pending_;
  std::map<uint32_t, int64_t> guestPids_;  // running execs by stream
  std::map<uint32_t, bool> cancelled_;
  int active_ = 0;  // request threads running (detached; stop() waits for 0)
  std::condition_variable idleCv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dsec::edge
