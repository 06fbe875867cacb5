// Starting one exec: parsing the request, and fork + the child's setup up to
// execve. Watching the running process (pipes, timeout, reaping) is the
// agent's job (agent.h); this file owns everything on the child's side.
#pragma once

#include <sys/resource.h>
#include <sys/types.h>
#include <time.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "aether/seccomp.h"
#include "common/fd.h"
#include "common/status.h"

namespace dsec::aether {

constexpr uint64_t kDefaultMaxOutput = 1u << 20;
constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// A pseudo-terminal's window, in character cells.
struct PtySize {
  uint16_t rows = 24;
  uint16_t cols = 80;
};

// An `exec` frame's JSON (docs/agent-protocol.md, "Exec").
struct ExecRequest {
  std::vector<std::string> argv;                // non-empty
  std::optional<std::vector<std::string>> env;  // absent: the init frame's env
  std::optional<std::string> cwd;               // absolute when present
  std::string user;                             // empty: root
  int64_t timeout_ms = 0;                       // 0 = none
  uint64_t max_output = kDefaultMaxOutput;      // per stream
  bool stdin_pipe = false;
  // Run on a fresh pseudo-terminal of this size: stdin, stdout and stderr
  // are its slave (stderr arrives as stdout), which is the child's
  // controlling terminal; input goes to the master (implies stdin_pipe).
  std::optional<PtySize> pty;
  // Not from the frame (fncall.h sets them): a descriptor to give the child
  // as its stdin instead of /dev/null or a pipe (not taken over), and
  // resource limits the child sets (soft and hard) before exec.
  int stdin_fd = -1;
  std::vector<std::pair<int, struct rlimit>> rlimits;
};

// kInvalidArgument (with the field) on anything malformed.
Result<ExecRequest> parseExecRequest(std::string_view payload);
// A `resize` frame's {"rows":R,"cols":C} (each 1..65535).
Result<PtySize> parsePtySize(std::string_view payload);
// TIOCSWINSZ on a PTY master: the kernel sends SIGWINCH to the terminal's
// foreground process group when the size changes.
Status setWindowSize(int master, PtySize size);

// Agent-wide settings that shape every exec.
struct ExecSettings {
  std::vector<std::string> default_env;  // the init frame's "env"
  std::string passwd_path = "/etc/passwd";
  std::string group_path = "/etc/group";
  // Drop capabilities outside Docker's default set from the child's bounding
  // and inheritable sets. Needs CAP_SETPCAP, so only meaningful as root.
  bool drop_caps = true;
  // Run children under the default syscall profile (seccomp.h) with no_new_privs.
  bool seccomp = true;
  // Refused syscalls go to a listener the agent answers (and counts) rather
  // than failing in the kernel (SpawnedExec::seccomp_listener).
  bool seccomp_notify = true;
  // A Landlock ruleset (landlock.h) each child restricts itself with; -1: none.
  int landlock_ruleset = -1;
  // fncall sandboxes (fncall.h): a second ruleset every child also enters
  // (writes only beneath the scratch dir); -1: none.
  int base_landlock_ruleset = -1;
  // fncall sandboxes: also seccomp.h's selfOnlyFilter (prlimit, priorities
  // and scheduling only on the caller itself). Needs `seccomp`.
  bool self_only = false;
  // The seccomp profile of execs from now on (a policy's "syscalls").
  SyscallProfile syscall_profile = SyscallProfile::kDefault;
  // aether raises its own open-file limit to serve many execs; children get
  // this one back (nullopt: leave theirs as inherited).
  std::optional<struct rlimit> child_nofile;
  // Signals (bit sig-1) whose disposition the child must set back to
  // SIG_DFL before exec: those not at SIG_DFL in aether (nonDefaultSignals()).
  // All by default; an agent narrows it once it has set its own.
  uint64_t reset_signals = ~uint64_t{0};
};

// The signals (bit sig-1, 1..64) whose disposition in this process is not
// SIG_DFL now: SIG_IGN survives execve, so children reset those.
uint64_t nonDefaultSignals();

struct SpawnedExec {
  pid_t pid = -1;           // also the process group id (the child setsid()s)
  UniqueFd stdin_w;         // invalid unless the request had stdin:true; nonblocking
  UniqueFd stdout_r;        // nonblocking
  UniqueFd stderr_r;        // nonblocking
  UniqueFd status_r;        // nonblocking; for spawnFailureMessage()
  // A PTY exec: the master (stdout_r and stdin_w are duplicates of it, and
  // stderr_r is invalid), for resizing and its foreground process group.
  UniqueFd pty_master;
  UniqueFd seccomp_listener;  // notifications of refused syscalls (settings.seccomp_notify)
  int32_t fail_stage = 0;     // a failure the child reported before exec (0: none)
  int32_t fail_errno = 0;
  struct timespec started;  // CLOCK_MONOTONIC at fork
  std::string argv0;
  std::string cwd;
};

// Resolves the user, builds environment and PATH candidates, then forks. The
// child does only async-signal-safe work. Errors (unknown user → kInvalidArgument
// field "user"; pipe/fork failures → sysError) mean no process was started.
Result<SpawnedExec> spawnExec(const ExecRequest& req, const ExecSettings& settings);

// After the child has been reaped: the "dsec: exec <argv0>: <strerror>\n" line
// (or the failing setup step's) when the child never reached the new program,
// empty when execve succeeded. Never blocks: the child is gone, so the status
// pipe holds either a report or EOF.
std::string spawnFailureMessage(const SpawnedExec& spawned);

}  // namespace dsec::aether
