#include "aether/seccomp.h"

#include <gtest/gtest.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sched.h>
#include <sys/resource.h>

#include <cerrno>
#include <functional>

namespace dsec::aether {
namespace {

// Installs `filter` in a forked child, runs `probe` there and returns its
// errno (0: the call worked), or -1 if the child died otherwise.
int underFilter(std::vector<sock_filter> filter, const std::function<int()>& probe) {
  pid_t pid = fork();
  if (pid == 0) {
    sock_fprog prog{static_cast<unsigned short>(filter.size()), filter.data()};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) {
      _exit(200);
    }
    _exit(probe());
  }
  int ws = 0;
  waitpid(pid, &ws, 0);
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

int underProfile(SyscallProfile profile, const std::function<int()>& probe) {
  return underFilter(syscallFilter(profile, false), probe);
}

int socketErrno(int family, int type) {
  int fd = socket(family, type, 0);
  if (fd >= 0) {
    close(fd);
    return 0;
  }
  return errno;
}

TEST(SeccompTest, ProfilesParse) {
  SyscallProfile p = SyscallProfile::kStrict;
  EXPECT_TRUE(parseSyscallProfile("default", &p));
  EXPECT_EQ(p, SyscallProfile::kDefault);
  EXPECT_TRUE(parseSyscallProfile("strict", &p));
  EXPECT_EQ(p, SyscallProfile::kStrict);
  EXPECT_FALSE(parseSyscallProfile("lenient", &p));
  EXPECT_EQ(syscallName(SYS_ptrace), "ptrace");
  EXPECT_EQ(syscallName(SYS_socket), "socket");
}

TEST(SeccompTest, StrictAddsPtraceAndSocketFamilies) {
  auto traceme = [] { return ptrace(PTRACE_TRACEME, 0, nullptr, nullptr) == 0 ? 0 : errno; };
  EXPECT_EQ(underProfile(SyscallProfile::kDefault, traceme), 0);
  EXPECT_EQ(underProfile(SyscallProfile::kStrict, traceme), EPERM);
  auto vsock = [] { return socketErrno(AF_VSOCK, SOCK_STREAM); };
  EXPECT_EQ(underProfile(SyscallProfile::kDefault, vsock), EPERM);
  EXPECT_EQ(underProfile(SyscallProfile::kStrict, vsock), EPERM);
  auto alg = [] { return socketErrno(AF_ALG, SOCK_SEQPACKET); };
  EXPECT_NE(underProfile(SyscallProfile::kDefault, alg), EPERM);  // absent here, or works
  EXPECT_EQ(underProfile(SyscallProfile::kStrict, alg), EPERM);
  for (int family : {AF_UNIX, AF_INET, AF_INET6}) {
    EXPECT_EQ(underProfile(SyscallProfile::kStrict,
                           [family] { return socketErrno(family, SOCK_STREAM); }),
              0)
        << family;
  }
  // Other calls still go through the rest of the filter (the accumulator is
  // the syscall number again after the socket check).
  EXPECT_EQ(underProfile(SyscallProfile::kStrict, [] { return unshare(CLONE_NEWNS) ? errno : 0; }),
            EPERM);
  EXPECT_EQ(underProfile(SyscallProfile::kStrict, [] { return getpid() > 0 ? 0 : 1; }), 0);
}

int underSelfOnly(const std::function<int()>& probe) {
  return underFilter(selfOnlyFilter(), probe);
}

int err(long rc) { return rc == 0 ? 0 : errno; }

TEST(SeccompTest, SelfOnlyLimitsPrioritiesAndSchedulingOfTheCallerOnly) {
  // Another process of the same uid (this test's own process, the child's
  // parent) is what a call must not reach: its zygote or the next spare.
  const pid_t other = getpid();
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(prlimit(0, RLIMIT_NOFILE, &lim, nullptr)); }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(setrlimit(RLIMIT_NOFILE, &lim)); }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(prlimit(other, RLIMIT_NOFILE, nullptr, &lim)); }),
            EPERM);
  EXPECT_EQ(underSelfOnly([&] { return err(prlimit(other, RLIMIT_NOFILE, &lim, nullptr)); }),
            EPERM);
  EXPECT_EQ(underSelfOnly([] { return err(setpriority(PRIO_PROCESS, 0, 1)); }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(setpriority(PRIO_PROCESS, other, 1)); }), EPERM);
  EXPECT_EQ(underSelfOnly([] { return err(setpriority(PRIO_PGRP, 0, 1)); }), EPERM);
  EXPECT_EQ(underSelfOnly([] { return err(setpriority(PRIO_USER, 0, 1)); }), EPERM);
  cpu_set_t cpus;
  ASSERT_EQ(sched_getaffinity(0, sizeof cpus, &cpus), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(sched_setaffinity(0, sizeof cpus, &cpus)); }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(sched_setaffinity(other, sizeof cpus, &cpus)); }),
            EPERM);
  sched_param param{};
  EXPECT_EQ(underSelfOnly([&] { return err(sched_setscheduler(0, SCHED_BATCH, &param)); }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(sched_setscheduler(other, SCHED_IDLE, &param)); }),
            EPERM);
  EXPECT_EQ(underSelfOnly([&] { return err(sched_setparam(other, &param)); }), EPERM);
  EXPECT_EQ(underSelfOnly([&] { return err(syscall(SYS_sched_setattr, other, nullptr, 0)); }),
            EPERM);
  // <linux/ioprio.h> is not C++: IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
  // IOPRIO_WHO_PROCESS, IOPRIO_WHO_USER.
  const int idle = 3 << 13;
  constexpr int IOPRIO_WHO_PROCESS = 1, IOPRIO_WHO_USER = 3;
  EXPECT_EQ(underSelfOnly([&] { return err(syscall(SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, idle)); }),
            0);
  EXPECT_EQ(
      underSelfOnly([&] { return err(syscall(SYS_ioprio_set, IOPRIO_WHO_PROCESS, other, idle)); }),
      EPERM);
  EXPECT_EQ(underSelfOnly([&] { return err(syscall(SYS_ioprio_set, IOPRIO_WHO_USER, 0, idle)); }),
            EPERM);
  // Everything else passes.
  EXPECT_EQ(underSelfOnly([] { return getpid() > 0 ? 0 : 1; }), 0);
  EXPECT_EQ(underSelfOnly([&] { return err(kill(other, 0)); }), 0);
}

}  // namespace
}  // namespace dsec::aether
