#include "aether/upper_tar.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "common/fd.h"

namespace dsec::aether {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

// A tree with what an overlay upper dir holds, streamed and extracted again
// by GNU tar (as the edge does), must come back the same.
TEST(UpperTar, RoundTripsThroughGnuTar) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (whiteouts, owners)";
  char tmpl[] = "/tmp/upper-tar-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string base = tmpl;
  std::string src = base + "/src", dst = base + "/dst";
  ASSERT_EQ(::mkdir(src.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((src + "/dir").c_str(), 0750), 0);
  ASSERT_EQ(::mkdir((src + "/opaque").c_str(), 0755), 0);
  ASSERT_EQ(::setxattr((src + "/opaque").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  // a trusted.overlay xattr a layer must not carry
  ASSERT_EQ(::setxattr((src + "/dir").c_str(), "trusted.overlay.origin", "zz", 2, 0), 0);
  std::string big(700000, 'x');
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = char('a' + i % 26);
  spit(src + "/dir/big", big);
  spit(src + "/dir/empty", "");
  ASSERT_EQ(::chown((src + "/dir/big").c_str(), 123, 456), 0);
  ASSERT_EQ(::chmod((src + "/dir/big").c_str(), 04711), 0);
  ASSERT_EQ(::setxattr((src + "/dir/big").c_str(), "user.note", "hi", 2, 0), 0);
  ASSERT_EQ(::link((src + "/dir/big").c_str(), (src + "/hard").c_str()), 0);
  ASSERT_EQ(::symlink("/etc/passwd", (src + "/abs-link").c_str()), 0);
  std::string longName = src + "/" + std::string(150, 'n');
  spit(longName, "long\n");
  ASSERT_EQ(::mknod((src + "/whiteout").c_str(), S_IFCHR | 0, makedev(0, 0)), 0);
  ASSERT_EQ(::mkfifo((src + "/fifo").c_str(), 0640), 0);

  UniqueFd root(::open(src.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(root);
  auto t = UpperTar::open(root.get(), false);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  std::string tar, chunk;
  for (;;) {
    ASSERT_TRUE((*t)->readChunk(chunk, 65536).isOk());
    if (chunk.empty()) break;
    EXPECT_EQ(chunk.size() % 512, 0u);
    tar += chunk;
  }
  spit(base + "/t.tar", tar);
  ASSERT_EQ(::mkdir(dst.c_str(), 0700), 0);
  std::string cmd = "tar --numeric-owner --xattrs --xattrs-include='user.*' "
                    "--xattrs-include=trusted.overlay.opaque --same-permissions --same-owner "
                    "-xf " + base + "/t.tar -C " + dst + " 2>" + base + "/err";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(base + "/err");

  EXPECT_EQ(slurp(dst + "/dir/big"), big);
  EXPECT_EQ(slurp(dst + "/dir/empty"), "");
  EXPECT_EQ(slurp(dst + "/" + std::string(150, 'n')), "long\n");
  struct stat st;
  ASSERT_EQ(::lstat((dst + "/dir/big").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 123u);
  EXPECT_EQ(st.st_gid, 456u);
  EXPECT_EQ(st.st_mode & 07777, 04711u);
  EXPECT_EQ(st.st_nlink, 2u);
  struct stat sst;
  ASSERT_EQ(::lstat((src + "/dir/big").c_str(), &sst), 0);
  EXPECT_EQ(st.st_mtim.tv_sec, sst.st_mtim.tv_sec);
  EXPECT_EQ(st.st_mtim.tv_nsec, sst.st_mtim.tv_nsec);
  ASSERT_EQ(::lstat((dst + "/dir").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0750u);
  char v[16] = {};
  EXPECT_EQ(::getxattr((dst + "/dir/big").c_str(), "user.note", v, sizeof v), 2);
  EXPECT_EQ(std::string(v, 2), "hi");
  EXPECT_EQ(::getxattr((dst + "/opaque").c_str(), "trusted.overlay.opaque", v, sizeof v), 1);
  EXPECT_EQ(v[0], 'y');
  EXPECT_LT(::getxattr((dst + "/dir").c_str(), "trusted.overlay.origin", v, sizeof v), 0);
  char target[64] = {};
  EXPECT_EQ(::readlink((dst + "/abs-link").c_str(), target, sizeof target), 11);
  EXPECT_STREQ(target, "/etc/passwd");
  ASSERT_EQ(::lstat((dst + "/whiteout").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  ASSERT_EQ(::lstat((dst + "/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  std::filesystem::remove_all(base);
}

TEST(UpperTar, PaxRecordLengthsCountThemselves) {
  std::string out;
  appendTarHeader(out, "./" + std::string(200, 'p'), '0', 0644, 0, 0, 0, 1, 5, "", 0, 0,
                  {{"user.k", std::string(95, 'v')}});
  ASSERT_EQ(out.size(), 3u * 512);  // pax header, its records, the entry
  std::string records = out.substr(512, 512);
  size_t pos = 0;
  while (pos < records.size() && records[pos] != '\0') {
    size_t sp = records.find(' ', pos);
    size_t len = std::stoul(records.substr(pos, sp - pos));
    ASSERT_EQ(records[pos + len - 1], '\n') << records.substr(pos, len);
    pos += len;
  }
}

}  // namespace
}  // namespace dsec::aether
