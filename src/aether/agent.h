// The agent's event loop: one connection to the edge, many concurrent execs
// and file transfers on it (docs/agent-protocol.md).
//
// Single-threaded epoll loop over: the connection (nonblocking, with an
// outgoing frame queue), a signalfd for SIGCHLD, each running exec's pipes and
// timeout timerfd. File requests run synchronously (local disk); a file_read's
// data is produced in chunks only while the outgoing queue is short.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "aether/exec.h"
#include "aether/files.h"
#include "aether/fncall.h"
#include "aether/fs_policy.h"
#include "aether/json_fields.h"
#include "aether/landlock.h"
#include "common/fd.h"
#include "common/frame.h"
#include "common/status.h"
#include "aether/upper_tar.h"

namespace dsec::aether {

// While more than this is queued for the edge, exec pipes and file reads
// pause (the spec's flow control).
constexpr size_t kQueueHighWater = 4u << 20;
// While more than this is queued, aether also stops reading requests: only an
// edge that sends without ever reading gets here.
constexpr size_t kQueueHardLimit = 16u << 20;
// While more stdin than this waits for processes to read it, aether stops
// reading the connection, so stdin pushes back on the edge like a socket.
// Generous, because the pause holds up every stream of the sandbox: two execs
// with the API's largest stdin (16 MiB) that do not read it must not stall
// the connection.
constexpr size_t kStdinHighWater = 32u << 20;

struct AgentOptions {
  ExecSettings exec;
  // When >= 0 (a sandbox's PID 1): losing the edge does not end the agent.
  // Its execs are killed and unfinished transfers dropped, as at the end of
  // run(), but the sandbox lives on: aether makes a fresh socket pair, keeps
  // one end as its connection and puts the other on this descriptor (which
  // must be held open, on /dev/null, meanwhile). A restarted edge takes that
  // end with pidfd_getfd(2) and sends kReattach, whereupon aether puts
  // /dev/null back on the descriptor (so the edge's death is an EOF again)
  // and answers with a hello.
  int reattach_fd = -1;
  // A fncall sandbox (fncall.h): every exec is a call; zygotes per language.
  std::optional<FncallConfig> fncall;
  // The sandbox's first policy (the body of a policy frame), applied by
  // start() before the hello: a failure is start()'s.
  std::optional<Json> initial_policy;
  // A microvm guest's overlay upper dir (guest_init.cc), open across the
  // switch of root: pack_upper streams it (upper_tar.h). -1: pack_upper is
  // refused.
  int upper_fd = -1;
  // Whether pack_upper freezes upper_fd's file system meanwhile (the guest's
  // own disk); tests of the agent on a host file system turn it off.
  bool upper_freeze = true;
};

class Agent {
 public:
  // Takes the connection (made nonblocking and close-on-exec by start()).
  // `decoder` may already hold frames that arrived with the init frame.
  Agent(UniqueFd conn, AgentOptions options, proto::FrameDecoder decoder = {});
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Blocks SIGCHLD (for the signalfd) and ignores SIGPIPE process-wide,
  // becomes a child subreaper, sets up epoll and queues the hello frame.
  // Call once, from the process's only thread: the loop reaps every child of
  // the process, tracked or not.
  Status start();

  // Serves until the connection reaches EOF or fails (returns 0) or a frame
  // cannot be decoded (returns 1). Either way every exec's process group is
  // SIGKILLed first and unfinished file writes are discarded.
  int run();

 private:
  struct OutPipe {
    UniqueFd fd;
    bool watched = false;              // in epoll
    uint64_t delivered = 0;            // bytes sent to the edge
    uint64_t drain_left = UINT64_MAX;  // after reaping: bytes still to read
  };
  struct Exec {
    uint32_t stream = 0;
    SpawnedExec proc;
    uint64_t max_output = 0;
    OutPipe out[2];  // stdout, stderr
    std::string stdin_buf;
    size_t stdin_off = 0;
    bool stdin_close = false;  // close once stdin_buf is written
    bool stdin_watched = false;
    UniqueFd timer;
    bool reaped = false;
    int wait_status = 0;
    int64_t duration_us = 0;
    bool timed_out = false;
    bool truncated = false;
    // fncall (fncall.h): ends by killing what the call left, and its fresh
    // dir (when it has one) is removed.
    bool call = false;
    bool exclusive = false;
    std::string run_dir;
    CallLimits limits;            // the call's, for which limit stopped it
    bool zygote_started = false;  // it had to start its zygote (metrics)
    // A zygote's call: its socket (limit hints, "exit:RC"), the limit it
    // said stopped it, the language of its zygote.
    UniqueFd call_sock;
    std::string hint;
    std::string zygote_lang;
  };

  void handleConnReadable();
  void handleFrame(proto::Frame& f);
  void dispatch(proto::Frame& f);
  void handleExec(const proto::Frame& f);
  void handleStdin(const proto::Frame& f);
  void handleSignal(const proto::Frame& f);
  void handleResize(const proto::Frame& f);
  void handleCancel(const proto::Frame& f);
  bool acceptRequest(const proto::Frame& f);
  void handleFileWrite(const proto::Frame& f);
  void handleData(const proto::Frame& f);
  void handleFileRead(const proto::Frame& f);
  void handlePackUpper(const proto::Frame& f);
  void handleSimpleFileOp(const proto::Frame& f);
  void handleAudit(const proto::Frame& f);
  // Tells the edge the denied-syscall total, now or at the end of the
  // current interval (kDeniedPushIntervalMs).
  void scheduleDeniedPush();
  void pushDenied();
  void handlePolicy(const proto::Frame& f);
  // What a policy frame asks (read-only and hidden paths, resolvers, syscall
  // profile, Landlock); the result frame's body.
  Result<Json> applyPolicy(const Json& policy);
  void handleReattach(const proto::Frame& f);
  // The edge closed the connection or it failed: ends run(), or with
  // reattach_fd waits for the next edge.
  void edgeGone();
  void onSeccompNotify(int fd, uint32_t events);

  void reapChildren();
  // What finishCall does, for an exec already gone.
  void cleanUpCall(pid_t pid, bool exclusive, const std::string& run_dir);
  // Cleans up the calls whose results were sent (after flushing them).
  void finishedCalls();
  struct FinishedCall {
    pid_t pid;
    bool exclusive;
    std::string run_dir;
    std::string zygote_lang;
  };
  std::vector<FinishedCall> finished_calls_;
  // A zygote's call wrote on its socket: a limit hint, or its exit status
  // just before exiting (handled as its end).
  void onCallSocket(uint32_t stream);
  // A tracked or untracked child ended (reaped by us, or by a zygote).
  void onReaped(pid_t pid, int status);
  // fncall: starts the call's process (argv, fresh exec of an interpreter,
  // or a fork of the language's zygote). Exit reports of other calls that a
  // zygote sent meanwhile land in `exits`.
  Result<SpawnedExec> spawnCall(ExecRequest& req, const CallRequest& call, Exec& e,
                                std::vector<std::pair<pid_t, int>>& exits);
  // The language's zygote: the one running, else its successor once ready,
  // else a new one (waiting for it to start).
  Result<Zygote*> zygoteFor(const std::string& language);
  // Zygote::begin with its control socket and seccomp listener watched.
  Result<std::unique_ptr<Zygote>> beginZygote(const std::string& language);
  // After a call: starts the successor of a zygote near its quota.
  void beginSuccessor(const std::string& language);
  void dropSuccessor(const std::string& language, bool reaped);
  void onZygoteReadable(int fd);
  void dropZygote(const std::string& language, bool reaped);
  std::set<pid_t> zygotePids() const;
  void finishCall(Exec& e);
  // fncall sandboxes: file calls may change only what is beneath /scratch.
  Status fncallWritable(const std::string& path) const;
  void onPipeReadable(uint32_t stream, int which);
  void onStdinWritable(uint32_t stream);
  void onTimer(uint32_t stream);
  void pumpPipe(Exec& e, int which);
  void deliver(Exec& e, int which, std::string_view data);
  void closePipe(Exec& e, int which);
  void flushStdin(Exec& e);
  void closeStdin(Exec& e);
  void maybeFinish(Exec& e);
  void killGroup(const Exec& e, int sig);
  void pumpFileReads();

  bool busy(uint32_t stream) const;
  void sendFrame(uint32_t stream, proto::FrameType type, std::string_view payload);
  void sendError(uint32_t stream, const Status& status);
  void flushOutput();
  void updateInterest();
  void watch(int fd, uint64_t tag, uint32_t events);
  void unwatch(int fd);
  void shutdown();

  UniqueFd conn_;
  AgentOptions options_;
  proto::FrameDecoder decoder_;
  UniqueFd epoll_;
  UniqueFd sigchld_;
  bool done_ = false;
  int exit_code_ = 0;
  bool awaiting_reattach_ = false;  // reattach_fd holds the edge's end of conn_
  UniqueFd reattach_null_;          // /dev/null, put back on reattach_fd after a reattach

  // Outgoing frames, in chunks of a few hundred KiB; the front is partly sent.
  std::deque<std::string> out_;
  size_t out_off_ = 0;
  size_t queued_ = 0;
  uint32_t conn_events_ = 0;  // what the connection is registered for
  bool pipes_paused_ = false;
  size_t stdin_buffered_ = 0;

  std::map<uint32_t, std::unique_ptr<Exec>> execs_;
  // Seccomp listeners of live process trees, by fd; a listener hangs up when
  // the last process under its filter is gone.
  std::map<int, UniqueFd> listeners_;
  std::map<std::string, uint64_t> denied_;  // refused syscalls by name (audit)
  uint64_t denied_total_ = 0;
  uint64_t denied_pushed_ = 0;      // the total the edge was last told (kDenied)
  int64_t denied_pushed_at_ms_ = -1000000;
  UniqueFd denied_timer_;           // the trailing push within an interval
  bool denied_timer_armed_ = false;
  FsPolicy fs_policy_;
  UniqueFd landlock_;  // the ruleset later execs run under (landlock.h); -1: none
  std::unordered_map<pid_t, uint32_t> pid_streams_;
  // fncall: zygotes by language; the Landlock ruleset keeping writes in /scratch.
  std::map<std::string, std::unique_ptr<Zygote>> zygotes_;
  // Zygotes started ahead to replace a zygote near its zygote_max_calls
  // (beginSuccessor); promoted by zygoteFor once the old one is retired.
  std::map<std::string, std::unique_ptr<Zygote>> successors_;
  UniqueFd scratch_landlock_;
  uint64_t call_seq_ = 0;
  std::map<uint32_t, FileWriter> writes_;
  std::map<uint32_t, FileReader> reads_;
  // pack_upper transfers (at most one): the guest's disk is frozen while one
  // lives, so requests that write are refused meanwhile.
  std::map<uint32_t, std::unique_ptr<UpperTar>> packs_;
  uint32_t next_read_ = 0;  // round-robin position among reads_
  std::string scratch_;     // pipe/file read buffer
  // Connection read buffer, deliberately left uninitialised: zero-filling it
  // would fault in every page at start-up, which costs milliseconds where
  // page faults are expensive (nested virtualisation).
  std::unique_ptr<char[]> in_buf_;
};

}  // namespace dsec::aether
