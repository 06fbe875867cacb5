#include "aether/seccomp.h"

#include <linux/audit.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <utility>

namespace dsec::aether {

namespace {
constexpr uint32_t kX32Bit = 0x40000000;
constexpr uint32_t kNamespaceFlags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                                     CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP |
                                     0x80 /*CLONE_NEWTIME*/;

sock_filter stmt(uint16_t code, uint32_t k) { return BPF_STMT(code, k); }
sock_filter jump(uint16_t code, uint32_t k, uint8_t jt, uint8_t jf) {
  return BPF_JUMP(code, k, jt, jf);
}
}  // namespace

const std::vector<int>& deniedSyscalls() {
  static const std::vector<int> kDenied = {
      SYS_init_module,
      SYS_finit_module,
      SYS_delete_module,
      SYS_kexec_load,
      SYS_kexec_file_load,
      SYS_bpf,
      SYS_perf_event_open,
      SYS_keyctl,
      SYS_add_key,
      SYS_request_key,
      SYS_userfaultfd,
      SYS_io_uring_setup,
      SYS_io_uring_enter,
      SYS_io_uring_register,
      SYS_mount,
      SYS_umount2,
      SYS_pivot_root,
      SYS_move_mount,
      SYS_open_tree,
      SYS_fsopen,
      SYS_fsconfig,
      SYS_fsmount,
      SYS_fspick,
      SYS_mount_setattr,
      SYS_unshare,
      SYS_setns,
      SYS_swapon,
      SYS_swapoff,
      SYS_reboot,
      SYS_settimeofday,
      SYS_clock_settime,
      SYS_clock_adjtime,
      SYS_acct,
      SYS_quotactl,
      SYS_lookup_dcookie,
      SYS_open_by_handle_at,
      SYS_name_to_handle_at,
      SYS_iopl,
      SYS_ioperm,
      SYS_syslog,
      SYS_fanotify_init,
      SYS_uselib,
      SYS_vhangup,
      SYS_nfsservctl,
      SYS_create_module,
      SYS_get_kernel_syms,
      SYS_query_module,
      SYS__sysctl,
      SYS_afs_syscall,
      SYS_tuxcall,
      SYS_security,
      SYS_vserver,
      SYS_kcmp,
      SYS_process_vm_writev,
  };
  return kDenied;
}

const std::vector<int>& strictDeniedSyscalls() {
  static const std::vector<int> kDenied = {SYS_ptrace, SYS_process_vm_readv, SYS_personality,
                                           SYS_pidfd_getfd};
  return kDenied;
}

bool parseSyscallProfile(const std::string& name, SyscallProfile* out) {
  if (name == "default")
    *out = SyscallProfile::kDefault;
  else if (name == "strict")
    *out = SyscallProfile::kStrict;
  else
    return false;
  return true;
}

std::string syscallName(int nr) {
  static const std::pair<int, const char*> kNames[] = {
      {SYS_init_module, "init_module"},
      {SYS_finit_module, "finit_module"},
      {SYS_delete_module, "delete_module"},
      {SYS_kexec_load, "kexec_load"},
      {SYS_kexec_file_load, "kexec_file_load"},
      {SYS_bpf, "bpf"},
      {SYS_perf_event_open, "perf_event_open"},
      {SYS_keyctl, "keyctl"},
      {SYS_add_key, "add_key"},
      {SYS_request_key, "request_key"},
      {SYS_userfaultfd, "userfaultfd"},
      {SYS_io_uring_setup, "io_uring_setup"},
      {SYS_io_uring_enter, "io_uring_enter"},
      {SYS_io_uring_register, "io_uring_register"},
      {SYS_mount, "mount"},
      {SYS_umount2, "umount2"},
      {SYS_pivot_root, "pivot_root"},
      {SYS_move_mount, "move_mount"},
      {SYS_open_tree, "open_tree"},
      {SYS_fsopen, "fsopen"},
      {SYS_fsconfig, "fsconfig"},
      {SYS_fsmount, "fsmount"},
      {SYS_fspick, "fspick"},
      {SYS_mount_setattr, "mount_setattr"},
      {SYS_unshare, "unshare"},
      {SYS_setns, "setns"},
      {SYS_swapon, "swapon"},
      {SYS_swapoff, "swapoff"},
      {SYS_reboot, "reboot"},
      {SYS_settimeofday, "settimeofday"},
      {SYS_clock_settime, "clock_settime"},
      {SYS_clock_adjtime, "clock_adjtime"},
      {SYS_acct, "acct"},
      {SYS_quotactl, "quotactl"},
      {SYS_lookup_dcookie, "lookup_dcookie"},
      {SYS_open_by_handle_at, "open_by_handle_at"},
      {SYS_name_to_handle_at, "name_to_handle_at"},
      {SYS_iopl, "iopl"},
      {SYS_ioperm, "ioperm"},
      {SYS_syslog, "syslog"},
      {SYS_fanotify_init, "fanotify_init"},
      {SYS_uselib, "uselib"},
      {SYS_vhangup, "vhangup"},
      {SYS_kcmp, "kcmp"},
      {SYS_process_vm_writev, "process_vm_writev"},
      {SYS_ptrace, "ptrace"},
      {SYS_process_vm_readv, "process_vm_readv"},
      {SYS_personality, "personality"},
      {SYS_pidfd_getfd, "pidfd_getfd"},
      {SYS_socket, "socket"},
      {SYS_clone, "clone"},
      {SYS_ioctl, "ioctl"},
  };
  for (auto& [n, name] : kNames) {
    if (n == nr) return name;
  }
  return "syscall-" + std::to_string(nr);
}

std::vector<sock_filter> syscallFilter(SyscallProfile profile, bool notify) {
  const bool strict = profile == SyscallProfile::kStrict;
  std::vector<sock_filter> f;
  auto eperm = notify ? SECCOMP_RET_USER_NOTIF : SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA);
  // Architecture: x86-64 only.
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  // The x32 ABI shares the architecture value; refuse its numbers.
  f.push_back(jump(BPF_JMP | BPF_JGE | BPF_K, kX32Bit, 0, 1));
  f.push_back(stmt(BPF_RET | BPF_K, eperm));
  for (int nr : deniedSyscalls()) {
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, uint32_t(nr), 0, 1));
    f.push_back(stmt(BPF_RET | BPF_K, eperm));
  }
  if (strict) {
    for (int nr : strictDeniedSyscalls()) {
      f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, uint32_t(nr), 0, 1));
      f.push_back(stmt(BPF_RET | BPF_K, eperm));
    }
  }
  // socket(domain, ...): never vsock; under strict only unix, inet, inet6,
  // netlink. (The accumulator is reloaded with nr after, for what follows.)
  if (strict) {
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, SYS_socket, 0, 7));
    f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AF_UNIX, 4, 0));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AF_INET, 3, 0));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AF_INET6, 2, 0));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AF_NETLINK, 1, 0));
    f.push_back(stmt(BPF_RET | BPF_K, eperm));
    f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  } else {
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, SYS_socket, 0, 4));
    f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AF_VSOCK, 0, 1));
    f.push_back(stmt(BPF_RET | BPF_K, eperm));
    f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  }
  // clone3: ENOSYS, so libc falls back to clone, whose flags we can read.
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)));
  // clone(flags, ...): no new namespaces. (x86-64: flags are the first argument.)
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 4));
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
  f.push_back(jump(BPF_JMP | BPF_JSET | BPF_K, kNamespaceFlags, 0, 1));
  f.push_back(stmt(BPF_RET | BPF_K, eperm));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  // ioctl(fd, TIOCSTI | TIOCLINUX, ...): no typing into someone's terminal.
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, SYS_ioctl, 0, 5));
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[1])));
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, TIOCSTI, 2, 0));
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, TIOCLINUX, 1, 0));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  f.push_back(stmt(BPF_RET | BPF_K, eperm));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  return f;
}

std::vector<sock_filter> selfOnlyFilter() {
  // x86-64 (the main filter kills other architectures); pids and `which`
  // are ints, so the low word of each argument is what the kernel reads.
  constexpr uint32_t kPrioProcess = 0;     // PRIO_PROCESS
  constexpr uint32_t kIoprioWhoProcess = 1;  // IOPRIO_WHO_PROCESS
  const uint32_t eperm = SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA);
  std::vector<sock_filter> f;
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  // The first argument is a pid that must be 0 (the caller).
  for (int nr : {SYS_prlimit64, SYS_sched_setaffinity, SYS_sched_setscheduler,
                 SYS_sched_setparam, SYS_sched_setattr}) {
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, uint32_t(nr), 0, 4));
    f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1));
    f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
    f.push_back(stmt(BPF_RET | BPF_K, eperm));
  }
  // (which, who): the calling process only.
  for (auto [nr, which] : {std::pair<int, uint32_t>{SYS_setpriority, kPrioProcess},
                           std::pair<int, uint32_t>{SYS_ioprio_set, kIoprioWhoProcess}}) {
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, uint32_t(nr), 0, 6));
    f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, which, 0, 3));
    f.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[1])));
    f.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1));
    f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
    f.push_back(stmt(BPF_RET | BPF_K, eperm));
  }
  f.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  return f;
}

}  // namespace dsec::aether
