#include "common/util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include "common/sha256.h"

namespace dsec {
namespace {

TEST(UtilTest, RandomHexHasLengthAndVaries) {
  auto a = randomHex(8), b = randomHex(8);
  EXPECT_EQ(a.size(), 16u);
  EXPECT_NE(a, b);
}

TEST(UtilTest, IsoTime) { EXPECT_EQ(isoTime(0.5), "1970-01-01T00:00:00.500Z"); }

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
