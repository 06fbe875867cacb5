#include "common/util.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>

#include "common/sha256.h"

namespace dsec {
namespace {

TEST(UtilTest, RandomHexHasLengthAndVaries) {
  auto a = randomHex(8), b = randomHex(8);
  EXPECT_EQ(a.size(), 16u);
  EXPECT_NE(a, b);
}

TEST(UtilTest, IsoTime) { EXPECT_EQ(isoTime(0.5), "1970-01-01T00:00:00.500Z"); }

TEST(UtilTest, AsciiCaseAndOws) {
  EXPECT_EQ(asciiLower("Content-TYPE: X/Y-9"), "content-type: x/y-9");
  EXPECT_TRUE(asciiIEquals("Upgrade", "uPGRADE"));
  EXPECT_FALSE(asciiIEquals("Upgrade", "Upgrades"));
  EXPECT_FALSE(asciiIEquals("a", "b"));
  EXPECT_EQ(trimOws(" \t gzip ;q=0 \t"), "gzip ;q=0");
  EXPECT_EQ(trimOws(" \t "), "");
}

TEST(UtilTest, HmacSha256Hex) {
  // RFC 4231, test case 2.
  EXPECT_EQ(hmacSha256Hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(UtilTest, SecretEquals) {
  EXPECT_TRUE(secretEquals("abc", "abc"));
  EXPECT_FALSE(secretEquals("abc", "abd"));
  EXPECT_FALSE(secretEquals("abc", "ab"));
  EXPECT_FALSE(secretEquals("", "a"));
}

TEST(UtilTest, FilesAndTrees) {
  std::string dir = "/tmp/dsec-util-test-" + randomHex(4);
  ASSERT_TRUE(makeDirs(dir + "/a/b/c").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/a/b/c/f", "hello", 0600).isOk());
  auto got = readFile(dir + "/a/b/c/f");
  ASSERT_TRUE(got.isOk());
  EXPECT_EQ(*got, "hello");
  struct stat st;
  ASSERT_EQ(stat((dir + "/a/b/c/f").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(symlink("/etc", (dir + "/a/link").c_str()), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
  EXPECT_NE(stat(dir.c_str(), &st), 0);
  EXPECT_EQ(stat("/etc/hostname", &st), 0) << "removeTree must not follow symlinks";
  EXPECT_EQ(readFile(dir + "/nope").status().code(), Code::kNotFound);
}

// Makes `depth` nested directories named `name` under `dir` through fds (the
// path is far beyond PATH_MAX), with a file every 100 levels.
void makeDeepTree(const std::string& dir, int depth, const std::string& name) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < depth; ++i) {
    if (i % 100 == 0) {
      int f = openat(fd, "file", O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      ASSERT_GE(f, 0);
      close(f);
    }
    ASSERT_EQ(mkdirat(fd, name.c_str(), 0755), 0) << "level " << i;
    int next = openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(next, 0);
    close(fd);
    fd = next;
  }
  close(fd);
}

TEST(UtilTest, RemoveTreeDeeperThanPathMax) {
  std::string dir = "/tmp/dsec-util-deep-" + randomHex(4);
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  const int kDepth = 1000;
  const std::string kName = "level-dir";  // 10 bytes a level: ~10 KB of path
  static_assert(1000 * 10 > 2 * PATH_MAX);
  makeDeepTree(dir, kDepth, kName);
  // Remove in a child limited to 200 fds: the walk must stay within a bounded budget.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    struct rlimit rl = {200, 200};
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(2);
    Status st = removeTree(dir);
    if (!st.isOk()) {
      fprintf(stderr, "removeTree: %s\n", st.toString().c_str());
      _exit(1);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  struct stat st;
  EXPECT_NE(lstat(dir.c_str(), &st), 0) << "the deep tree must be gone";
}

TEST(UtilTest, RemoveTreeDeepWithBranches) {
  // Branches at many depths, so the walk resumes in levels it had to close and reopen.
  std::string dir = "/tmp/dsec-util-branches-" + randomHex(4);
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  makeDeepTree(dir, 300, "a");
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 300; ++i) {
    ASSERT_EQ(mkdirat(fd, "b", 0755), 0);
    int b = openat(fd, "b", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(b, 0);
    ASSERT_EQ(mkdirat(b, "c", 0), 0);  // mode 000, like overlayfs's work/work
    ASSERT_EQ(symlinkat("/etc", b, "up"), 0);
    close(b);
    int next = openat(fd, "a", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(next, 0);
    close(fd);
    fd = next;
  }
  close(fd);
  ASSERT_TRUE(removeTree(dir).isOk());
  struct stat st;
  EXPECT_NE(lstat(dir.c_str(), &st), 0);
  EXPECT_EQ(stat("/etc/hostname", &st), 0);
}

TEST(UtilTest, RemoveTreeNeverFollowsSymlinks) {
  std::string outside = "/tmp/dsec-util-outside-" + randomHex(4);
  std::string dir = "/tmp/dsec-util-links-" + randomHex(4);
  ASSERT_TRUE(makeDirs(outside + "/sub").isOk());
  ASSERT_TRUE(writeFileAtomic(outside + "/sub/keep", "keep").isOk());
  ASSERT_TRUE(makeDirs(dir + "/x/y").isOk());
  ASSERT_EQ(symlink(outside.c_str(), (dir + "/x/dirlink").c_str()), 0);
  ASSERT_EQ(symlink((outside + "/sub/keep").c_str(), (dir + "/x/y/filelink").c_str()), 0);
  ASSERT_EQ(symlink(outside.c_str(), (dir + "/rootlink").c_str()), 0);
  // The path itself a symlink (even with a trailing slash): only the link goes.
  ASSERT_TRUE(removeTree(dir + "/rootlink/").isOk());
  struct stat st;
  EXPECT_NE(lstat((dir + "/rootlink").c_str(), &st), 0);
  ASSERT_TRUE(removeTree(dir).isOk());
  EXPECT_NE(lstat(dir.c_str(), &st), 0);
  auto kept = readFile(outside + "/sub/keep");
  ASSERT_TRUE(kept.isOk()) << "removeTree followed a symlink out of the tree";
  EXPECT_EQ(*kept, "keep");
  ASSERT_TRUE(removeTree(outside).isOk());
}

TEST(UtilTest, RemoveTreeFileAndMissingPath) {
  std::string f = "/tmp/dsec-util-file-" + randomHex(4);
  ASSERT_TRUE(writeFileAtomic(f, "x").isOk());
  ASSERT_TRUE(removeTree(f).isOk());
  struct stat st;
  EXPECT_NE(lstat(f.c_str(), &st), 0);
  EXPECT_TRUE(removeTree(f).isOk()) << "a missing path is fine";
  EXPECT_TRUE(removeTree("/tmp/dsec-util-missing-" + randomHex(4) + "/a/b").isOk());
  EXPECT_EQ(removeTree("/").code(), Code::kInvalidArgument);
  EXPECT_EQ(removeTree("").code(), Code::kInvalidArgument);
}

TEST(UtilTest, RemoveTreeStopsAtMounts) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to mount";
  std::string outside = "/tmp/dsec-util-bindsrc-" + randomHex(4);
  std::string dir = "/tmp/dsec-util-mounts-" + randomHex(4);
  ASSERT_TRUE(makeDirs(outside).isOk());
  ASSERT_TRUE(writeFileAtomic(outside + "/keep", "keep").isOk());
  ASSERT_TRUE(makeDirs(dir + "/a/tmpfs").isOk());
  ASSERT_TRUE(makeDirs(dir + "/b/bind").isOk());
  ASSERT_TRUE(makeDirs(dir + "/c/d").isOk());
  ASSERT_TRUE(writeFileAtomic(dir + "/c/d/gone", "x").isOk());
  // Mounts in a private mount namespace of a child, which reports by exit code.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0) _exit(77);
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(77);
    if (mount("tmpfs", (dir + "/a/tmpfs").c_str(), "tmpfs", 0, nullptr) != 0) _exit(77);
    // A bind mount of the same filesystem: same st_dev, another mount.
    if (mount(outside.c_str(), (dir + "/b/bind").c_str(), nullptr, MS_BIND, nullptr) != 0) {
      _exit(77);
    }
    if (!writeFileAtomic(dir + "/a/tmpfs/inside", "x").isOk()) _exit(3);
    Status st = removeTree(dir);
    if (st.isOk()) _exit(4);
    if (st.sysErrno() != EXDEV) _exit(5);
    if (st.message().find(dir + "/a/tmpfs") == std::string::npos &&
        st.message().find(dir + "/b/bind") == std::string::npos) {
      _exit(6);
    }
    struct stat sb;
    // Nothing deleted inside the mount; the rest of the tree went.
    if (stat((dir + "/a/tmpfs/inside").c_str(), &sb) != 0) _exit(7);
    if (stat((dir + "/c").c_str(), &sb) == 0) _exit(8);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot make a mount namespace here";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  auto kept = readFile(outside + "/keep");
  ASSERT_TRUE(kept.isOk()) << "removeTree deleted into a bind mount";
  // The child's namespace is gone, and its mounts with it.
  EXPECT_TRUE(removeTree(dir).isOk());
  EXPECT_TRUE(removeTree(outside).isOk());
}

TEST(UtilTest, Sha256) {
  EXPECT_EQ(sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(UtilTest, Split) {
  auto v = splitString("a=b=c", '=');
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[2], "c");
}

}  // namespace
}  // namespace dsec

namespace dsec {
namespace {
TEST(UtilTest, Base64RoundTrip) {
  for (std::string s : {std::string(""), std::string("f"), std::string("fo"), std::string("foo"),
                        std::string("\0\xff\x10zz", 5)}) {
    auto d = base64Decode(base64Encode(s));
    ASSERT_TRUE(d.isOk());
    EXPECT_EQ(*d, s);
  }
  EXPECT_EQ(base64Encode("foob"), "Zm9vYg==");
  EXPECT_FALSE(base64Decode("Zm9v!A==").isOk());
  EXPECT_FALSE(base64Decode("Zm9").isOk());
}
}  // namespace
}  // namespace dsec
