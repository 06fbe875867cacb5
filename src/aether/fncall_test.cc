#include "aether/fncall.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "aether/landlock.h"

namespace dsec::aether {
namespace {

Json parse(const char* s) { return Json::parse(s); }

TEST(FncallConfig, DefaultsAndLanguages) {
  auto c = parseFncallConfig(parse(R"({"scratch_mb": 32, "prestart": ["python"],
                                       "languages": {"node": ["node", "-e"]},
                                       "limits": {"cpu_s": 5}})"));
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  EXPECT_EQ(c->scratch_mb, 32);
  EXPECT_EQ(c->languages.at("node"), (std::vector<std::string>{"node", "-e"}));
  EXPECT_EQ(c->defaults.cpu_s, 5);
}

TEST(FncallConfig, RejectsBadInput) {
  EXPECT_EQ(parseFncallConfig(parse(R"({"languages": {"python": ["x"]}})")).status().field(),
            "fncall.languages");
  EXPECT_EQ(parseFncallConfig(parse(R"({"languages": {"a b": ["x"]}})")).status().field(),
            "fncall.languages");
  EXPECT_EQ(parseFncallConfig(parse(R"({"prestart": ["bash"]})")).status().field(),
            "fncall.prestart");
  EXPECT_EQ(parseFncallConfig(parse(R"({"limits": {"bogus": 1}})")).status().field(),
            "fncall.limits.bogus");
  EXPECT_FALSE(parseFncallConfig(parse(R"({"scratch_mb": 0})")).isOk());
  EXPECT_EQ(parseFncallConfig(parse(R"({"zygote_max_calls": 0})")).status().field(),
            "fncall.zygote_max_calls");
  EXPECT_EQ(parseFncallConfig(parse(R"({"zygote_max_calls": "x"})")).status().field(),
            "fncall.zygote_max_calls");
}

TEST(FncallConfig, ZygoteMaxCalls) {
  EXPECT_EQ(parseFncallConfig(parse("{}"))->zygote_max_calls, 1024);
  EXPECT_EQ(parseFncallConfig(parse(R"({"zygote_max_calls": 3})"))->zygote_max_calls, 3);
}

// W_EXITCODE without <sys/wait.h>'s macro spelling differences.
int exited(int code) { return (code & 0xff) << 8; }

TEST(ShellLimitOf, OnlyUnderTheLimitGiven) {
  CallLimits none;
  CallLimits fsize;
  fsize.file_size_mb = 1;
  CallLimits cpu;
  cpu.cpu_s = 1;
  EXPECT_EQ(shellLimitOf(exited(128 + SIGXFSZ), fsize), "file_size");
  EXPECT_EQ(shellLimitOf(exited(128 + SIGXFSZ), none), "");
  EXPECT_EQ(shellLimitOf(exited(128 + SIGXCPU), cpu), "cpu");
  EXPECT_EQ(shellLimitOf(exited(128 + SIGXCPU), fsize), "");
  EXPECT_EQ(shellLimitOf(exited(1), fsize), "");
  EXPECT_EQ(shellLimitOf(SIGKILL, fsize), "");  // killed, not exited
}

TEST(CallRequest, Parses) {
  FncallConfig cfg;
  cfg.languages["node"] = {"node", "-e"};
  auto r = parseCallRequest(parse(R"J({"language": "python", "code": "print(1)",
      "fresh_dir": true, "files": {"a/b.txt": "aGk="}, "limits": {"memory_mb": 64}})J"), cfg);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_EQ(r->files.size(), 1u);
  EXPECT_EQ(r->files[0].first, "a/b.txt");
  EXPECT_EQ(r->files[0].second, "hi");
  EXPECT_EQ(r->limits->memory_mb, 64);
  EXPECT_TRUE(parseCallRequest(parse(R"({"language": "node", "code": "1"})"), cfg).isOk());
  EXPECT_TRUE(parseCallRequest(parse(R"({})"), cfg).isOk());  // argv call
}

TEST(CallRequest, RejectsBadInput) {
  FncallConfig cfg;
  auto field = [&](const char* s) { return parseCallRequest(parse(s), cfg).status().field(); };
  EXPECT_EQ(field(R"({"language": "cobol", "code": "x"})"), "language");
  EXPECT_EQ(field(R"({"language": "python"})"), "code");
  EXPECT_EQ(field(R"({"language": "python", "code": "a\u0000b"})"), "code");
  EXPECT_EQ(field(R"({"code": "x", "files": {"a": "aGk="}})"), "files");  // needs fresh_dir
  EXPECT_EQ(field(R"({"fresh_dir": true, "files": {"../a": "aGk="}})"), "files");
  EXPECT_EQ(field(R"({"fresh_dir": true, "files": {"/a": "aGk="}})"), "files");
  EXPECT_EQ(field(R"({"fresh_dir": true, "files": {"a": "not base64!"}})"), "files");
  EXPECT_EQ(field(R"({"limits": {"cpu_s": -1}})"), "cpu_s");
}

TEST(CallRlimits, SetOnlyWhatIsGiven) {
  CallLimits l;
  EXPECT_TRUE(callRlimits(l).empty());
  l.cpu_s = 2;
  l.file_size_mb = 1;
  auto r = callRlimits(l);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].first, RLIMIT_CPU);
  EXPECT_EQ(r[0].second.rlim_cur, 2u);
  EXPECT_EQ(r[0].second.rlim_max, 3u);  // SIGKILL a second after SIGXCPU
  EXPECT_EQ(r[1].first, RLIMIT_FSIZE);
  EXPECT_EQ(r[1].second.rlim_cur, 1u << 20);
}

// A process whose main thread called exit(2) alone shows as a zombie while
// its other thread runs on: it is killed with what a call left, not skipped.
TEST(ScratchRuleset, EachExecIsItsOwnDomainForSignals) {
  int abi = landlockAbi();
  if (abi < 6) GTEST_SKIP() << "Landlock ABI " << abi << " has no signal scoping (needs 6)";
  auto rs = buildScratchRuleset();
  ASSERT_TRUE(rs.isOk()) << rs.status().toString();
  // A process outside the domain (a zygote, a spare) and one inside it.
  pid_t outside = fork();
  if (outside == 0) {
    pause();
    _exit(0);
  }
  pid_t child = fork();
  if (child == 0) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        syscall(SYS_landlock_restrict_self, rs->get(), 0) != 0) {
      _exit(100);
    }
    if (kill(outside, SIGSTOP) == 0 || errno != EPERM) _exit(101);
    if (kill(getppid(), 0) == 0 || errno != EPERM) _exit(102);
    pid_t mine = fork();  // its own children are in its domain
    if (mine == 0) {
      pause();
      _exit(0);
    }
    if (kill(mine, SIGKILL) != 0) _exit(103);
    waitpid(mine, nullptr, 0);
    _exit(0);
  }
  int ws = 0;
  ASSERT_EQ(waitpid(child, &ws, 0), child);
  kill(outside, SIGKILL);
  waitpid(outside, nullptr, 0);
  ASSERT_TRUE(WIFEXITED(ws));
  EXPECT_EQ(WEXITSTATUS(ws), 0) << "100: no domain, 101/102: signalled outside, 103: not inside";
}

// State and session of `pid` from /proc/PID/stat; false if it is gone.
bool readStat(pid_t pid, char& state, pid_t& sid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512] = {};
  size_t got = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const char* rp = std::strrchr(buf, ')');  // comm may hold anything
  int ppid = 0, pgid = 0, s = 0;
  if (got == 0 || !rp || std::sscanf(rp + 1, " %c %d %d %d", &state, &ppid, &pgid, &s) != 4) {
    return false;
  }
  sid = s;
  return true;
}

TEST(KillCallProcesses, KillsAZombieLeaderWithLiveThreads) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setsid();
    pthread_t t;
    ::pthread_create(&t, nullptr, [](void*) -> void* {
      for (;;) ::pause();
    }, nullptr);
    ::close(ready[0]);
    ::close(ready[1]);
    ::syscall(SYS_exit, 0);  // this thread only
  }
  ::close(ready[1]);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 0);  // the leader has closed its end
  ::close(ready[0]);
  // Wait until the leader is a zombie with its thread alive.
  for (int i = 0; i < 500; ++i) {
    char state = 0;
    pid_t sid = 0;
    ASSERT_TRUE(readStat(child, state, sid));
    if (state == 'Z') break;
    ::usleep(10000);
  }
  killCallProcesses(child, false, {});
  int status = 0;
  pid_t got = 0;
  for (int i = 0; i < 500 && got == 0; ++i) {
    got = ::waitpid(child, &status, WNOHANG);
    if (got == 0) ::usleep(10000);
  }
  if (got == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the zombie leader's thread survived killCallProcesses";
  }
  ASSERT_EQ(got, child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

// Live (not zombie) processes of session `sid`, from /proc.
int liveInSession(pid_t sid) {
  int n = 0;
  DIR* d = ::opendir("/proc");
  if (!d) return -1;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    char state = 0;
    pid_t s = 0;
    if (readStat(pid_t(pid), state, s) && s == sid && state != 'Z') ++n;
  }
  ::closedir(d);
  return n;
}

TEST(KillCallProcesses, EndsAForkingChainWithoutWaitingForEachToBeFreed) {
  // A session whose newest process keeps forking the next (a chain growing
  // every ~0.2 ms, bounded): a process forked between a scan and its
  // parent's kill is caught by the next scan, though the function does not
  // wait for each killed process to leave /proc.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setsid();
    ::close(ready[0]);
    // Growing for 2 s at most, whatever happens to the test.
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    const time_t until = now.tv_sec + 2;
    for (int depth = 0;; ++depth) {
      if (depth == 20 && ::write(ready[1], "r", 1) != 1) ::_exit(1);  // it is growing
      ::usleep(200);
      ::clock_gettime(CLOCK_MONOTONIC, &now);
      if (now.tv_sec >= until || ::fork() != 0) break;  // a parent stays
    }
    for (;;) ::pause();
  }
  // Whatever the outcome, nothing of the chain outlives the test (its
  // process group is the leader's pid; a group kill races no fork).
  struct GroupKill {
    pid_t pgid;
    ~GroupKill() { ::kill(-pgid, SIGKILL); }
  } group_kill{child};
  ::close(ready[1]);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  killCallProcesses(child, false, {});
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  int left = -1;
  for (int i = 0; i < 300 && left != 0; ++i) {
    left = liveInSession(child);
    if (left != 0) ::usleep(10000);
  }
  EXPECT_EQ(left, 0) << "processes of the call's session outlived killCallProcesses";
}

}  // namespace
}  // namespace dsec::aether
