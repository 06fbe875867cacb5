// The syscall profile every sandboxed process runs under: a seccomp-BPF
// filter installed by each exec'd child just before execve, after
// no_new_privs. It refuses (EPERM) what a workplace never needs and what has
// been the kernel's soft underbelly: module loading, kexec, bpf,
// perf_event_open, keyrings, userfaultfd, io_uring, mount and the new mount
// API, namespace creation and entry (unshare, setns, clone with CLONE_NEW*),
// swap, reboot, clock setting, accounting, quotactl, handle-based opens,
// port I/O, kernel log, fanotify, and terminal injection (TIOCSTI,
// TIOCLINUX), vsock sockets (not network-namespaced: they would reach the
// host's vsock services). clone3 answers ENOSYS, since its flags sit in
// memory a filter cannot read, and libc falls back to clone. Other
// architectures and the x32 ABI are refused outright. (Capabilities outside
// Docker's default set are dropped as well; see exec.cc.)
//
// The strict profile (a policy's "syscalls": "strict", e.g. eval) refuses
// more of what graded or hostile code never needs: ptrace and reading or
// writing other processes' memory (process_vm_readv, pidfd_getfd),
// personality changes, and sockets of any family but unix, inet, inet6 and
// netlink (AF_ALG, AF_PACKET, AF_KEY, AF_TIPC, ...: rarely used kernel code).
#pragma once

#include <linux/filter.h>

#include <string>
#include <vector>

namespace dsec::aether {

// With notify, the refused calls stop at SECCOMP_RET_USER_NOTIF instead of
// failing in the kernel, so the agent can count them (audit) before it
// answers EPERM; install with SECCOMP_FILTER_FLAG_NEW_LISTENER then.
enum class SyscallProfile { kDefault, kStrict };

std::vector<sock_filter> syscallFilter(SyscallProfile profile, bool notify = false);
inline std::vector<sock_filter> defaultSyscallFilter(bool notify = false) {
  return syscallFilter(SyscallProfile::kDefault, notify);
}
// fncall sandboxes (fncall.h) add this filter: the calls of one sandbox, its
// zygote and the spare forked for the next call share a uid, and the kernel
// lets a process change those of its uid (a lower hard rlimit, a higher nice
// value, SCHED_IDLE, one CPU, idle I/O priority), which every later spare of
// a poisoned zygote would inherit. Here prlimit64, setpriority,
// sched_setaffinity, sched_setscheduler, sched_setparam, sched_setattr and
// ioprio_set work only on the caller itself (pid / who 0, PRIO_PROCESS,
// IOPRIO_WHO_PROCESS) and refuse anything else with EPERM. (Signals between
// calls are Landlock's: fncall.h, buildScratchRuleset.)
std::vector<sock_filter> selfOnlyFilter();

// "default" or "strict"; false for anything else.
bool parseSyscallProfile(const std::string& name, SyscallProfile* out);

// Syscall numbers refused with EPERM (for tests and docs), and those the
// strict profile refuses on top.
const std::vector<int>& deniedSyscalls();
const std::vector<int>& strictDeniedSyscalls();
// "mount" for SYS_mount, "clone" for namespace-creating clones, "ioctl" for
// TIOCSTI/TIOCLINUX; "syscall-<nr>" for anything else (the x32 ABI).
std::string syscallName(int nr);

}  // namespace dsec::aether
