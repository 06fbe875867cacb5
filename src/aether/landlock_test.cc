#include "aether/landlock.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace dsec::aether {
namespace {

// errno of creating `path` in a child restricted by `ruleset` (0: it worked).
int createIn(int ruleset, const std::string& path) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        ::syscall(SYS_landlock_restrict_self, ruleset, 0) != 0) {
      ::_exit(250);
    }
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::_exit(fd >= 0 ? 0 : errno);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 255;
}

TEST(LandlockTest, ReadOnlyPathsRefuseWritesEverythingElseIsFree) {
  if (landlockAbi() <= 0) GTEST_SKIP() << "Landlock is not available on this kernel";
  char tmpl[] = "/tmp/dsec-landlock-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string root = tmpl;
  for (const char* d : {"/rw", "/ro", "/mixed", "/mixed/ro", "/mixed/rw"}) {
    ASSERT_EQ(::mkdir((root + d).c_str(), 0755), 0);
  }
  ASSERT_EQ(::symlink("ro", (root + "/link").c_str()), 0);
  auto rs = buildWriteRuleset({root + "/ro", root + "/mixed/ro"}, root);
  ASSERT_TRUE(rs.isOk()) << rs.status().toString();
  EXPECT_EQ(createIn(rs->get(), root + "/rw/f"), 0);
  EXPECT_EQ(createIn(rs->get(), root + "/mixed/rw/f"), 0);
  EXPECT_EQ(createIn(rs->get(), root + "/ro/f"), EACCES);
  EXPECT_EQ(createIn(rs->get(), root + "/mixed/ro/f"), EACCES);
  EXPECT_EQ(createIn(rs->get(), root + "/link/f"), EACCES);  // through a symlink: its target's rule
  EXPECT_EQ(createIn(rs->get(), root + "/new-top-level"), EACCES);
  EXPECT_EQ(createIn(rs->get(), root + "/mixed/new"), EACCES);  // an ancestor of a read-only path
  std::string cmd = "rm -rf " + root;
  ASSERT_EQ(::system(cmd.c_str()), 0);
}

}  // namespace
}  // namespace dsec::aether
