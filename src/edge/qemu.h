// What the two QEMU backends (backends/microvm, backends/vm) share: finding
// QEMU, probing KVM for real, starting QEMU confined (own namespaces, the
// sandbox's cgroup, no inherited descriptors), QMP, and removing what a VM
// left behind. Thread-safe (no state).
#pragma once

#include <sys/types.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "edge/agent_conn.h"
#include "edge/cgroup.h"

namespace dsec::edge {
struct SandboxState;
}

namespace dsec::edge::qemu {

// prog itself when it has a '/' and is executable, else its first match in
// PATH; "" when not found.
std::string which(const std::string& prog);

// "" when /dev/kvm ran a five-byte real-mode guest (`mov al,0x42; out
// 0x10,al; hlt`) in a child process within 3 s, else why not.
std::string probeKvm();

// What run() saw of a program run to its end.
struct RunResult {
  int status = 0;         // as waitpid(2) gives it
  bool timedOut = false;  // killed (SIGKILL) at the deadline
  bool stopped = false;   // killed (SIGKILL) when `stopWhen` said so
  std::string out, err;   // all of its stdout and stderr (to then)
};

// Runs args (args[0] a path, no PATH search) with `input` on its stdin (a
// pipe's worth at most: it is written before any output is read; then the
// pipe is closed) and its stdout and stderr captured, until it exits, or
// until timeoutS (0: no deadline) when it is killed, or until `stopWhen`
// (asked after each read with what was read so far) says to kill it.
// Errors: the pipes or the fork failing; the program's own failure is in the
// RunResult.
Result<RunResult> run(const std::vector<std::string>& args, const std::string& input = "",
                      double timeoutS = 0,
                      const std::function<bool(const RunResult&)>& stopWhen = nullptr);

// run() without input or deadline: the program's stdout, or an error
// carrying its stderr (its status when that is empty) when it fails.
Result<std::string> runCapture(const std::vector<std::string>& args);

// "" when QEMU itself (`qemu`, machine type `machine`, -accel kvm -cpu host,
// as the backends run it) starts under KVM and quits when told to (stopped
// before the guest runs, -S; ~40 ms), else why not: a KVM that runs the
// real-mode probe may still refuse what QEMU sets up (nested KVM on some
// hosts fails the vCPU's MSRs: "failed to set MSR 0x10a", and QEMU aborts).
std::string probeQemuKvm(const std::string& qemu, const std::string& machine);

// "" when QEMU (`qemu`, machine type `machine`, -accel kvm -cpu host)
// boots `kernel` (an x86-64 Linux, PVH ELF or bzImage) to its end under
// KVM within timeoutS: without a root filesystem it panics, panic=-1
// reboots and -no-reboot makes QEMU exit (~0.2-1 s where KVM works), its
// console saying "Kernel panic"; else why not. QEMU starting is not enough:
// nested KVM on some hosts fails instructions the guest kernel runs early
// (a `lock cmpxchg16b`: "KVM internal error. Suberror: 1 ... emulation
// failure"), after which QEMU stops the vCPU and waits, and every VM would
// hang before its agent answers. Such an error on QEMU's stderr ends the
// probe at once.
std::string probeQemuKvmBoot(const std::string& qemu, const std::string& machine,
                             const std::string& kernel, double timeoutS = 30);

// The accelerator to use: "kvm" when `want` is "kvm" or "auto" and the
// probes pass (probeKvm, then probeQemuKvm with `qemu` and `machine`, then,
// when `kernel` is given, probeQemuKvmBoot with it and 5 s: its verdict is
// kept in /run/dsec for this boot, QEMU, machine and kernel, so later starts
// of the edge do not wait for it again), "tcg" when `want` is
// "tcg" or "auto" and one fails. Empty (with *why saying so) when `want` is
// "kvm" and KVM does not work. *why also says how the choice was made.
std::string chooseAccel(const std::string& want, const std::string& qemu,
                        const std::string& machine, std::string* why,
                        const std::string& kernel = "");

// Connects to the unix socket `name` in the directory of dirFd (through
// /proc/self/fd, so a long directory path does not hit sun_path's limit).
Result<UniqueFd> connectUnix(int dirFd, const std::string& name);

// One QMP command (with arguments, may be null) on a fresh connection to
// `dir`/qmp.sock (QEMU serves one client at a time); its "return" value.
// Errors carry QEMU's description. Bounded by timeoutS per read.
Result<nlohmann::json> qmp(const std::string& dir, const std::string& command,
                           const nlohmann::json& args = nullptr, double timeoutS = 5);

// True once the process behind pidfd has exited.
bool exited(int pidfd);

// The last `max` bytes of a file, trailing newlines dropped ("" if unreadable).
std::string tailFile(const std::string& path, size_t max);

// The names of the "sb-*" entries of dir.
std::vector<std::string> sandboxDirs(const std::string& root);

// A guest's NIC (SandboxSpec::network): QEMU user-mode networking (libslirp),
// so that every packet the guest sends becomes a socket call of QEMU itself,
// made in QEMU's own netns and cgroup, where the edge's veth, nftables and
// eBPF egress filter govern it exactly as a container's (docs/microvm.md,
// "Network"). The guest sees 10.0.2.15/24, gateway 10.0.2.2; slirp's own
// DNS forwarder (10.0.2.3) is not used: the guest's resolv.conf names the
// policy's resolvers. IPv4 only, as the veth.
inline constexpr const char* kGuestAddr = "10.0.2.15";
inline constexpr int kGuestPrefix = 24;
inline constexpr const char* kGuestGateway = "10.0.2.2";
inline constexpr const char* kGuestMac = "52:54:00:12:34:56";

// The QEMU arguments of that NIC; `device` is "virtio-net-device" (microvm's
// virtio-mmio) or "virtio-net-pci" (q35).
std::vector<std::string> nicArgs(const std::string& device);

// An fd of the netns of QEMU process `pid` (pidfd: the same process, checked
// alive after the open, so a reused pid is never mistaken for it). When
// `network` is false, kFailedPrecondition (field "egress") saying that the
// `kind` was booted without a network device.
Result<UniqueFd> openNetns(pid_t pid, int pidfd, bool network, const std::string& kind);

// A started QEMU.
struct Process {
  pid_t pid = -1;
  UniqueFd pidfd;
};

// Starts argv[0] with cwd `dir`, stdin /dev/null, stdout and stderr to
// dir/qemu.log (and an empty dir/console.log made first), in a new session
// and new pid (it is PID 1 there), mount, network (empty: no host network),
// IPC and UTS namespaces, every other descriptor closed, and attached to the
// sandbox `cgroupId` of `cgroups` before it execs.
Result<Process> spawnConfined(const std::vector<std::string>& argv, const std::string& dir,
                              Cgroups* cgroups, const std::string& cgroupId);

// A create's boot with the one retry the issue asks for. `once` is one
// attempt: on error it leaves nothing running and sets *hung when the guest
// simply never answered. A hung first attempt is logged with the tail of
// dir/console.log and tried again; a second hang is kUnavailable "the `kind`
// did not boot within N s (why), twice (console log: consoleLog)".
Status bootWithRetry(const std::string& kind, const std::string& id, const std::string& dir,
                     double timeoutS, const std::string& consoleLog,
                     const std::function<Status(bool* hung)>& once);

// The end of a create once the guest answered: records QEMU's pid in
// dir/qemu.pid (for a restarted edge's cleanup of orphans) and has
// `reactor` call onDeath when it exits.
Status recordAndWatch(const std::string& dir, pid_t pid, int pidfd, Reactor* reactor,
                      std::function<void()> onDeath);

// The start of adopting a VM an earlier edge left running: a pidfd of
// state.pid if that is still the recorded QEMU (kNotFound if not), after
// `reconnect` (given that pidfd) reached its guest again. A paused guest cannot answer: it is
// continued for `reconnect` and stopped again after.
Result<UniqueFd> adoptQemu(const SandboxState& state, const std::string& dir,
                           const std::function<Status(int pidfd)>& reconnect);

// Memory snapshots (docs/microvm.md, "Pause to disk"). QEMU 7.2 has no `file:`
// migration and `-sandbox on,spawn=deny` refuses `exec:`, so the edge is the
// other end of a `unix:` migration socket in the VM's directory.
//
// saveState: stops the guest (QMP `stop`), lifts the migration bandwidth cap
// and migrates to `mig.sock` in dir, which this call listens on, writing the
// stream to `statePath` (created, fsynced; the caller renames it into place).
// On success the guest is stopped for good (QEMU in `postmigrate`, its disks
// flushed and released) and the bytes written are returned; the caller quits
// QEMU. On error the migration is cancelled, statePath removed and the guest
// left stopped (the caller `cont`s it). Bounded by timeoutS in all.
Result<uint64_t> saveState(const std::string& dir, const std::string& statePath, double timeoutS);

// loadState: for a QEMU started with the same devices and `-incoming defer`:
// `migrate-incoming` on `in.sock` in dir, sends statePath into it and waits
// until QEMU says the migration completed. The guest is then loaded and
// stopped; the caller `cont`s it. Bounded by timeoutS.
Status loadState(const std::string& dir, const std::string& statePath, double timeoutS);

// Waits until QEMU's qmp.sock in dir accepts (QEMU opens it early at start),
// or fails when the process of pidfd exited or the deadline passed.
Status awaitQmp(const std::string& dir, int pidfd, double deadline);

// Pause to disk, the part both VM backends share (docs/microvm.md, "Pause
// to disk"). Files of a VM's directory: the saved state, and the console
// log of the runs before the current one.
inline constexpr const char* kStateFile = "memory.state";
inline constexpr const char* kPrevConsole = "console.prev.log";

// Once the guest's agent channel let go: saves the guest (saveState) to
// dir/memory.state.tmp, renames it to dir/memory.state, fsyncs the
// directory, then runs `persist` (the node's record says hibernated). On
// error no state file is left and the guest is stopped: the caller `cont`s
// it. Returns the bytes saved.
Result<uint64_t> saveToStateFile(const std::string& dir, const std::function<Status()>& persist);

// After saveToStateFile: QEMU of *pidfd (no longer watched by `reactor`)
// quits (QMP `quit`, SIGKILL after 5 s) and is reaped, *pidfd reset; the
// files `gone` of dir (its sockets) and qemu.pid go, and console.log is
// appended to console.prev.log (a restored QEMU starts a new one).
void endSavedQemu(const std::string& dir, UniqueFd* pidfd, Reactor* reactor,
                  const std::vector<std::string>& gone);

// The start of a restore: QEMU of `args` plus `-incoming defer`, spawned as
// spawnConfined does in the sandbox's cgroup (*pid, *pidfd set at once),
// dir/memory.state loaded into it, then `beforeRun` (the caller plumbs the
// new process's netns), then QMP `cont`. The files `gone` of dir (stale
// sockets) are removed first. On error the new QEMU is killed and *pidfd
// reset.
Status startFromStateFile(const std::vector<std::string>& args, const std::string& dir,
                          Cgroups* cgroups, const std::string& id,
                          const std::vector<std::string>& gone, pid_t* pid, UniqueFd* pidfd,
                          const std::function<Status()>& beforeRun);

// After a failed restore of sandbox `id`: its new QEMU (*pidfd) killed
// and *pidfd reset, *pid -1, the console logs of every run (console.prev.log,
// then console.log) moved to `kept` (replacing what was there); the error
// to return, saying why with QEMU's last words and where the log is.
Status failedRestore(const std::string& id, const std::string& dir, const std::string& kept,
                     pid_t* pid, UniqueFd* pidfd, const Status& why);

// A failed save or restore is the node's failure, not the caller's: codes
// that would blame the request (a file's EISDIR is kInvalidArgument) become
// kInternal; running out of something or of time stays what it is.
Code nodeFailure(Code c);

// The agent connection of a hibernated VM: none, every call on it fails
// kUnavailable saying so.
std::shared_ptr<AgentConn> hibernatedConn(const std::string& id);

// How many times `needle` occurs in the file (0 when unreadable).
size_t countInFile(const std::string& path, const std::string& needle);

// Appends the file `from` to `to` (created 0600 if missing) and removes
// `from`; a missing `from` is fine.
void appendAndRemove(const std::string& from, const std::string& to);

// Kills what is left of the VM whose directory is `dir` and sandbox id `id`:
// its cgroup (which holds its QEMU), a QEMU outside it by dir/qemu.pid if
// that process's cwd is still `dir`, then the directory.
void removeLeftovers(Cgroups* cgroups, const std::string& id, const std::string& dir);

}  // namespace dsec::edge::qemu
