// Process sessions: commands that outlive the HTTP request that started them
// (docs/processes.md). A terminal (PTY) or a background command runs as one
// interactive exec on its node; its session here keeps the call, a window
// of its output for clients that attach (or reattach after dropping), and
// its end. Clients send input, resizes and signals through the session.
//
// One replica holds a session: the one whose API started it.
//
// Thread-safety: everything is thread-safe. Exec callbacks feed a session
// (never concurrently, per ExecCallbacks); watchers pull from it under their
// own lock, so each sees output once and in order (lock order: watcher,
// then session; a session never calls a watcher while holding its lock).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/edge_link.h"
#include "proto/types.h"

namespace dsec::platform {

// Output a session keeps for clients that attach later: a window of the
// latest bytes (older ones are dropped; offsets keep counting them).
inline constexpr size_t kProcessOutputKept = 1u << 20;
// Sessions one sandbox may have: running ones are refused past it (HTTP 429,
// field "processes"); finished ones make room, oldest first.
inline constexpr size_t kMaxProcessesPerSandbox = 64;

class ProcessSession {
 public:
  struct Chunk {
    uint64_t offset = 0;  // of its first byte, in the output of both streams
    bool isErr = false;
    std::string data;
  };
  // What a watcher gets from `from` on: an offset below the window is
  // `gap` (the first kept offset), then chunks, then the end once the
  // process has ended and every byte was read.
  struct Read {
    std::optional<uint64_t> gap;
    std::vector<Chunk> chunks;
    uint64_t next = 0;  // where the next read starts
    bool ended = false;
    std::optional<Result<proto::ExecResult>> result;  // when ended
  };

  ProcessSession(std::string sandbox, proto::ExecSpec spec, std::string tag, double now);

  // The exec's callbacks.
  void started(int pid);
  void output(bool isErr, std::string_view data);
  void done(Result<proto::ExecResult> r);
  void setCall(std::shared_ptr<proto::ExecCall> call);

  // The pid once started; the exec's error if it ended before telling one
  // (kFailedPrecondition "cannot run sessions" when it ended without a pid,
  // as a node that predates sessions does); kDeadlineExceeded after timeoutS.
  Result<int> awaitStart(double timeoutS);

  // Up to maxBytes of output from `from` on.
  Read read(uint64_t from, size_t maxBytes) const;
  // Calls fn (without the session's lock) whenever output or the end
  // arrives, until it returns false or is removed. Returns a handle for unwatch.
  uint64_t watch(std::function<bool()> fn);
  void unwatch(uint64_t handle);

  // Input, resize, signal, kill: the exec call's (kFailedPrecondition once ended).
  Status sendInput(std::string_view bytes);
  Status resize(proto::TermSize size);
  Status signal(int sig);
  void kill();

  int pid() const;
  bool running() const;
  // What it runs (as started), and where its output has got to.
  const std::vector<std::string>& argv() const { return spec_.argv; }
  const std::string& cwd() const { return spec_.cwd; }
  const std::string& tag() const { return tag_; }
  bool hasPty() const { return spec_.pty.has_value(); }
  // The environment the start asked for (on top of the sandbox's).
  const std::map<std::string, std::string>& askedEnv() const { return askedEnv_; }
  void setAskedEnv(std::map<std::string, std::string> env) { askedEnv_ = std::move(env); }
  uint64_t outputEnd() const;
  const std::string& sandbox() const { return sandbox_; }
  // The API's Process object.
  std::string infoJson() const;

 private:
  void notify();

  const std::string sandbox_;
  const proto::ExecSpec spec_;
  const std::string tag_;
  const double startedAt_;
  std::map<std::string, std::string> askedEnv_;  // set before the session is shared
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<proto::ExecCall> call_;
  int pid_ = 0;
  std::deque<Chunk> kept_;
  size_t keptBytes_ = 0;
  uint64_t end_ = 0;  // total bytes of output so far
  std::optional<Result<proto::ExecResult>> result_;
  double endedAt_ = 0;
  std::map<uint64_t, std::function<bool()>> watchers_;
  uint64_t nextWatcher_ = 1;
};

// The sessions of every sandbox, by pid.
class ProcessTable {
 public:
  // Checks room before a start: kResourceExhausted (field "processes") when
  // the sandbox has kMaxProcessesPerSandbox running.
  Status checkRoom(const std::string& sandbox) const;
  // Adds a started session (replacing a finished one of the same pid, which
  // the kernel reused); drops the oldest finished ones past the limit.
  void add(std::shared_ptr<ProcessSession> s);
  std::shared_ptr<ProcessSession> find(const std::string& sandbox, int pid) const;
  // Oldest first.
  std::vector<std::shared_ptr<ProcessSession>> list(const std::string& sandbox) const;
  // The sandbox is gone: its sessions are dropped (running ones killed).
  void dropSandbox(const std::string& sandbox);
  size_t runningTotal() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::shared_ptr<ProcessSession>>> bySandbox_;
};

}  // namespace dsec::platform
