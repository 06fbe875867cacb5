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
  // this many calls share one (docs/fncall.md).
  int64_t zygote_max_calls = 64;
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
// (still in a zygote's session). Repeats until none is found (a fork bomb
// races the scan).
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
  // seccomp profile, Landlock and capabilities) and waits for it to say it
  // is ready. `listener` receives its seccomp listener (to be watched).
  static Result<std::unique_ptr<Zygote>> start(const std::string& language,
                                               const ExecSettings& settings,
                                               UniqueFd& listener);
  ~Zygote();

  pid_t pid() const { return pid_; }
  // Calls forked so far.
  int64_t calls() const { return calls_; }
  // The process was reaped elsewhere: the destructor must not signal its pid.
  void forgetPid() { pid_ = -1; }
  int ctlFd() const { return ctl_.get(); }
  // Forks a call: the child gets in/out/err as its stdio and runs `code` in
  // `cwd` with `env` and the limits. Returns the child's pid. Exit reports
  // that arrive meanwhile are appended to `exits`.
  Result<pid_t> spawn(const std::string& code, const std::string& cwd,
                      const std::vector<std::string>& env, const CallLimits& limits, int in,
                      int out, int err, std::vector<std::pair<pid_t, int>>& exits);
  // Reads the exit reports waiting on the control socket. False once the
  // zygote has hung up (it died).
  bool readExits(std::vector<std::pair<pid_t, int>>& exits);
  // The limit (docs/fncall.md: "memory", "file_size") the call `pid` told its
  // zygote stopped it (an uncaught MemoryError under memory_mb, an uncaught
  // EFBIG under file_size_mb), once, with its exit report; empty if none.
  std::string takeLimitHint(pid_t pid);

 private:
  Zygote() = default;
  bool handleMessage(const std::string& msg, pid_t* spawned,
                     std::vector<std::pair<pid_t, int>>& exits);

  pid_t pid_ = -1;
  UniqueFd ctl_;
  UniqueFd stderr_;  // the zygote's own stderr, read for a start-up failure
  std::map<pid_t, std::string> limitHints_;  // reported, not yet taken
  int64_t calls_ = 0;
};

// The limit a call's exit status points at, beyond a signal aether sees
// itself: a shell's exit code 128+SIGXFSZ / 128+SIGXCPU (its command was
// killed by that signal) when the call set that limit. Empty if none.
std::string shellLimitOf(int waitStatus, const CallLimits& limits);

// The zygote's Python source (python3 -c), exposed for tests.
extern const char* const kPythonZygote;

}  // namespace dsec::aether
