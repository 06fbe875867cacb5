// fncall: function calls in a sandbox (docs/fncall.md). A fncall sandbox is
// a container sandbox whose root is read-only and whose only writable place
// is a bounded tmpfs at /scratch; every exec in it is a "call": it runs under
// per-call resource limits, and when its main process ends every process it
// left behind is killed.
//
// A call may name a language instead of an argv. For languages with a
// zygote (python) aether keeps one pre-started, pre-imported interpreter per
// language that forks a fresh child per call; the child is not aether's, so
// the zygote reports its exit status (aether reaps it itself if the zygote
// died first: aether is a subreaper). Other languages (bash, and any the init
// frame configures) are exec'd afresh per call.
//
// Everything here runs on the agent's single thread.
#pragma once

#include <sys/types.h>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "aether/exec.h"
#include "aether/json_fields.h"
#include "common/fd.h"
#include "common/status.h"

namespace dsec::aether {

constexpr const char* kScratchDir = "/scratch";
// How long a zygote may take to start (imports included).
inline constexpr int kZygoteStartMs = 20000;
// Per-call working directories of one-shot calls (fresh_dir) live here.
constexpr const char* kRunDir = "/scratch/.run";

// Resource limits of one call; 0 = not set (then the sandbox's cgroup limits
// are the only bound).
struct CallLimits {
  int64_t cpu_s = 0;
  int64_t memory_mb = 0;  // RLIMIT_AS
  int64_t processes = 0;  // RLIMIT_NPROC (counts the user's processes in the sandbox)
  int64_t file_size_mb = 0;
  int64_t open_files = 0;
};

// The init frame's "fncall" object.
struct FncallConfig {
  int64_t scratch_mb = 64;
  // Languages exec'd per call: name -> argv the code is appended to. python
  // and bash are built in (python through its zygote).
  std::map<std::string, std::vector<std::string>> languages;
  std::vector<std::string> prestart;  // zygotes to start at init
  // A zygote is retired after forking this many calls and the next call
  // starts a new one, with a new hash secret (PYTHONHASHSEED): so at most
  // this many calls share one (docs/fncall.md). A zygote's start (~50 ms of
  // CPU) is spread over its calls: at 64, a fifth of all the CPU of
  // `print(1)` calls back to back.
  int64_t zygote_max_calls = 1024;
  CallLimits defaults;                // limits of calls that give none
};

Result<FncallConfig> parseFncallConfig(const Json& j);

// Read-only root (remounted) plus a tmpfs of scratch_mb at /scratch. After
// pivot_root, before anything runs.
Status setupFncallRoot(const FncallConfig& config);

// A Landlock ruleset allowing writes only beneath /scratch and to the
// character devices of /dev (null, zero, full, tty, pts).
// kFailedPrecondition when the kernel lacks Landlock.
Result<UniqueFd> buildScratchRuleset();

// An exec frame's "fncall" object.
struct CallRequest {
  std::string language;  // empty: the exec's argv runs as the call
  std::string code;
  bool fresh_dir = false;  // run in a new dir under kRunDir, removed afterwards
  std::vector<std::pair<std::string, std::string>> files;  // relative path -> bytes (fresh_dir)
  bool exclusive = false;  // the caller runs nothing else here: afterwards kill all but zygotes
  std::optional<CallLimits> limits;
};

Result<CallRequest> parseCallRequest(const Json& j, const FncallConfig& config);

// The setrlimit pairs of `limits`.
std::vector<std::pair<int, struct rlimit>> callRlimits(const CallLimits& limits);

// Kills (SIGKILL) the processes a call left: those of its session or process
// group `pid` and their descendants; with `everything`, every process of the
// sandbox except aether, `keep` (the zygotes) and the zygotes' spare children
// (still in a zygote's session). Repeats until a scan finds none it has not
// killed already (a fork bomb races the scan); returns without waiting for
// the killed to be freed.
void killCallProcesses(pid_t pid, bool everything, const std::set<pid_t>& keep);

// After an exclusive (one-shot) call: empties /scratch but for the run dir
// root, and removes every System V shared memory segment, message queue and
// semaphore set of the sandbox's IPC namespace, which would otherwise
// outlive the call's processes.
void wipeSandboxState();

// One language's zygote process.
class Zygote {
 public:
  // Starts the interpreter through spawnExec (so it runs under the sandbox's
  // seccomp profile, Landlock and capabilities) and returns at once;
  // `listener` receives its seccomp listener (to be watched). The control
  // socket says "ready" when it is: pollReady() reads that without
  // blocking, awaitReady() waits up to timeoutMs (and kills it on failure).
  // Nothing else may be asked of it before.
  static Result<std::unique_ptr<Zygote>> begin(const std::string& language,
                                               const ExecSettings& settings,
                                               UniqueFd& listener);
  enum ReadyState { kStarting, kReady, kFailed };
  ReadyState pollReady();
  Status awaitReady(int timeoutMs);
  bool ready() const { return ready_; }
  ~Zygote();

  pid_t pid() const { return pid_; }
  // Calls forked so far.
  int64_t calls() const { return calls_; }
  // The process was reaped elsewhere: the destructor must not signal its pid.
  void forgetPid() { pid_ = -1; }
  int ctlFd() const { return ctl_.get(); }
  // Hands a call to a spare (a child the zygote forked ahead, waiting for
  // one request): the child gets in/out/err as its stdio and runs `code` in
  // `cwd` with `env` and the limits. Waits for a spare if none is held (at
  // most kZygoteAnswerMs). Returns the child's pid and aether's end of its
  // socket, on which the call says "memory" / "file_size" (a limit stopped
  // it) and "exit:RC" (its exit status, just before it exits). Exit reports
  // of other calls that arrive meanwhile are appended to `exits`. Errors:
  // kUnavailable (the zygote is gone or silent), kInternal (it refused).
  Result<std::pair<pid_t, UniqueFd>> spawn(const std::string& code, const std::string& cwd,
                                           const std::vector<std::string>& env,
                                           const CallLimits& limits, int in, int out, int err,
                                           std::vector<std::pair<pid_t, int>>& exits);
  // Asks the zygote for the next spare, unless one is held or asked for.
  // Called when a call has ended, so the fork and its page copies do not
  // compete with a running call.
  void requestSpare();
  // Reads the messages waiting on the control socket: exit reports of its
  // calls (appended to `exits`; those of other children are dropped) and
  // spares. False once the zygote has hung up (it died).
  bool readExits(std::vector<std::pair<pid_t, int>>& exits);
  // The call `pid` said its own exit status: the zygote's later report of
  // it is dropped.
  void endedEarly(pid_t pid) { live_.erase(pid); }
  // Spares held (for tests and metrics).
  size_t spares() const { return spares_.size(); }
  // The zygote closed its end of the control socket (it died).
  bool hungUp() const;

 private:
  struct Spare {
    pid_t pid;
    UniqueFd sock;
  };
  Zygote() = default;
  // One message of the control socket (with the fd it carried, if any).
  // False for a message that is neither an exit report nor a spare.
  bool handleMessage(const std::string& msg, UniqueFd fd,
                     std::vector<std::pair<pid_t, int>>& exits);
  // recvmsg of one control message, its fd close-on-exec. <0: errno set
  // (EAGAIN with dontwait); 0: hung up.
  ssize_t recvControl(std::string& msg, UniqueFd& fd, bool dontwait);

  pid_t pid_ = -1;
  UniqueFd ctl_;
  UniqueFd stderr_;  // the zygote's own stderr, read for a start-up failure
  std::deque<Spare> spares_;  // forked ahead, waiting for a request
  bool spareAsked_ = true;    // the first spare comes unasked
  bool ready_ = false;        // it said "ready"
  std::set<pid_t> live_;      // calls handed out whose end is not known yet
  int64_t calls_ = 0;
};

// The limit a call's exit status points at, beyond a signal aether sees
// itself: a shell's exit code 128+SIGXFSZ / 128+SIGXCPU (its command was
// killed by that signal) when the call set that limit. Empty if none.
std::string shellLimitOf(int waitStatus, const CallLimits& limits);

// The zygote's Python source (python3 -c), exposed for tests.
extern const char* const kPythonZygote;

}  // namespace dsec::aether
