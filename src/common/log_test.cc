#include "common/log.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "common/util.h"

namespace dsec::log {
namespace {

long long sizeOf(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 ? st.st_size : -1;
}

// In a child process: the log sink is process-wide.
int inChild(void (*fn)(const std::string&), const std::string& path) {
  pid_t pid = ::fork();
  if (pid == 0) {
    fn(path);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(LogTest, FileIsRotatedPastItsSize) {
  std::string dir = "/tmp/dsec-log-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  EXPECT_EQ(inChild([](const std::string& p) {
              if (!setFile(p, 10000)) ::_exit(3);
              std::string msg(90, 'x');
              for (int i = 0; i < 500; ++i) {  // ~50 KB in under a second's budget
                info(msg);
              }
            }, dir + "/dsec.log"),
            0);
  EXPECT_GT(sizeOf(dir + "/dsec.log"), 0);
  EXPECT_LE(sizeOf(dir + "/dsec.log"), 10000 + 200);
  EXPECT_GE(sizeOf(dir + "/dsec.log.1"), 10000);
  EXPECT_LE(sizeOf(dir + "/dsec.log.1"), 10000 + 200);
  EXPECT_EQ(sizeOf(dir + "/dsec.log.2"), -1);
  ASSERT_TRUE(removeTree(dir).isOk());
}

TEST(LogTest, FloodsAreCutAndCounted) {
  std::string dir = "/tmp/dsec-log-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir).isOk());
  EXPECT_EQ(inChild([](const std::string& p) {
              if (!setFile(p, 100 << 20)) ::_exit(3);
              for (int i = 0; i < 20000; ++i) warn("flood");
              ::sleep(1);
              error("after");  // the next second: the count of what was dropped first
            }, dir + "/dsec.log"),
            0);
  auto text = readFile(dir + "/dsec.log");
  ASSERT_TRUE(text.isOk());
  size_t lines = 0;
  for (char c : *text) lines += c == '\n';
  EXPECT_LT(lines, 20000u);
  EXPECT_NE(text->find("log: dropped "), std::string::npos);
  EXPECT_NE(text->find("after"), std::string::npos);
  ASSERT_TRUE(removeTree(dir).isOk());
}

}  // namespace
}  // namespace dsec::log
