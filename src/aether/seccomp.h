// The syscall profile every sandboxed process runs under: a seccomp-BPF
// filter installed by each exec'd child just before execve, after
// no_new_privs. It refuses (EPERM) what a workplace never needs and what has
// been the kernel's soft underbelly: module loading, kexec, bpf,
// perf_event_open, keyrings, userfaultfd, io_uring, mount and the new mount
// API, namespace creation and entry (unshare, setns, clone with CLONE_NEW*),
// swap, reboot, clock setting, accounting, quotactl, handle-based opens,
// port I/O, kernel log, fanotify, and terminal injection (TIOCSTI,
// TIOCLINUX). clone3 answers ENOSYS, since its flags sit in memory a filter
// cannot read, and libc falls back to clone. Other architectures and the x32
// ABI are refused outright. (Capabilities outside Docker's default set are
// dropped as well; see exec.cc.)
#pragma once

#include <linux/filter.h>

#include <string>
#include <vector>

namespace dsec::aether {

// With notify, the refused calls stop at SECCOMP_RET_USER_NOTIF instead of
// failing in the kernel, so the agent can count them (audit) before it
// answers EPERM; install with SECCOMP_FILTER_FLAG_NEW_LISTENER then.
std::vector<sock_filter> defaultSyscallFilter(bool notify = false);

// Syscall numbers refused with EPERM (for tests and docs).
const std::vector<int>& deniedSyscalls();
// "mount" for SYS_mount, "clone" for namespace-creating clones, "ioctl" for
// TIOCSTI/TIOCLINUX; "syscall-<nr>" for anything else (the x32 ABI).
std::string syscallName(int nr);

}  // namespace dsec::aether
