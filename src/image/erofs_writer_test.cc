#include "image/erofs_writer.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/util.h"
#include "image/layer_builder.h"

namespace dsec::image {
namespace {

constexpr uint32_t kChunk = 128 << 10;
constexpr int64_t kMtime = 1700000000;  // most inodes': the image's epoch

// A scratch directory, removed (with whatever is under it) on destruction.
class TempDir {
 public:
  TempDir() : path_("/tmp/dsec-erofs-test-" + randomHex(4)) {
    EXPECT_TRUE(makeDirs(path_, 0755).isOk()) << path_;
  }
  ~TempDir() { (void)removeTree(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A mount, detached on destruction (so a failing test leaves none behind).
class Mount {
 public:
  Mount() = default;
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;
  ~Mount() {
    if (!target_.empty()) ::umount2(target_.c_str(), MNT_DETACH);
  }
  // 0 or the errno of mount(2): source = the metadata image (file-backed EROFS).
  int erofs(const std::string& meta, const std::string& blob, const std::string& target) {
    if (::mkdir(target.c_str(), 0755) != 0 && errno != EEXIST) return errno;
    std::string opts = "device=" + blob;
    if (::mount(meta.c_str(), target.c_str(), "erofs", MS_RDONLY, opts.c_str()) != 0) return errno;
    target_ = target;
    return 0;
  }
  int overlay(const std::string& lowerdirs, const std::string& target) {
    if (::mkdir(target.c_str(), 0755) != 0 && errno != EEXIST) return errno;
    std::string opts = "lowerdir=" + lowerdirs;
    if (::mount("overlay", target.c_str(), "overlay", MS_RDONLY, opts.c_str()) != 0) return errno;
    target_ = target;
    return 0;
  }

 private:
  std::string target_;
};

// Skips the test when this host cannot mount (not root, no erofs, EPERM).
#define MOUNT_OR_SKIP(expr)                                                        \
  do {                                                                             \
    int mountErr_ = (expr);                                                        \
    if (mountErr_ == EPERM || mountErr_ == ENODEV || mountErr_ == ENOTBLK)         \
      GTEST_SKIP() << "cannot mount here (" << strerror(mountErr_) << "): " #expr; \
    ASSERT_EQ(mountErr_, 0) << #expr << ": " << strerror(mountErr_);               \
  } while (0)

// The data blob: chunks appended at block boundaries.
class Blob {
 public:
  explicit Blob(const std::string& path)
      : path_(path), fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) {
    EXPECT_TRUE(fd_.valid()) << path << ": " << strerror(errno);
  }
  // Appends `bytes` at the next block boundary; returns that block's number.
  uint32_t append(std::string_view bytes) {
    uint32_t blk = static_cast<uint32_t>(size_ / kFsBlockSize);
    EXPECT_EQ(::pwrite(fd_.get(), bytes.data(), bytes.size(), static_cast<off_t>(size_)),
              static_cast<ssize_t>(bytes.size()));
    size_ = (size_ + bytes.size() + kFsBlockSize - 1) / kFsBlockSize * kFsBlockSize;
    EXPECT_EQ(::ftruncate(fd_.get(), static_cast<off_t>(size_)), 0);
    return blk;
  }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  UniqueFd fd_;
  uint64_t size_ = 0;
};

std::string pseudoRandom(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : s) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<char>(x);
  }
  return s;
}

// What a regular file must read as: `size` bytes, zero but for `pieces`.
struct Content {
  uint64_t size = 0;
  std::vector<std::pair<uint64_t, std::string>> pieces;
  bool holes = false;  // some chunk is a hole (fsck.erofs 1.5 extracts those wrongly)
};

// Builds an FsTree and its data blob, remembering what files must contain.
class Builder {
 public:
  explicit Builder(const std::string& blobPath) : blob_(blobPath) {
    tree_.inodes.push_back(attrs(S_IFDIR | 0755));
  }
  static FsInode attrs(uint32_t mode, uint32_t uid = 0, uint32_t gid = 0, int64_t mtime = kMtime,
                       uint32_t nsec = 0) {
    FsInode in;
    in.mode = mode;
    in.uid = uid;
    in.gid = gid;
    in.mtime = mtime;
    in.mtimeNsec = nsec;
    return in;
  }
  FsInode& at(uint32_t i) { return tree_.inodes[i]; }
  void link(uint32_t parent, const std::string& name, uint32_t i) {
    tree_.inodes[parent].children.emplace_back(name, i);
  }
  uint32_t add(uint32_t parent, const std::string& name, FsInode in) {
    tree_.inodes.push_back(std::move(in));
    uint32_t i = static_cast<uint32_t>(tree_.inodes.size() - 1);
    link(parent, name, i);
    return i;
  }
  uint32_t dir(uint32_t parent, const std::string& name, uint32_t perm = 0755) {
    return add(parent, name, attrs(S_IFDIR | perm));
  }
  // A file of `data`; all-zero chunks listed in `holes` are left as holes.
  uint32_t file(uint32_t parent, const std::string& name, const std::string& data,
                FsInode in = attrs(S_IFREG | 0644), const std::set<size_t>& holes = {}) {
    in.size = data.size();
    Content c{data.size(), {{0, data}}, !holes.empty()};
    for (size_t k = 0; k * kChunk < data.size(); ++k) {
      std::string_view chunk = std::string_view(data).substr(k * kChunk, kChunk);
      if (holes.count(k) != 0) {
        EXPECT_EQ(chunk.find_first_not_of('\0'), std::string_view::npos);
        in.chunks.push_back(kHoleChunk);
      } else {
        in.chunks.push_back(blob_.append(chunk));
      }
    }
    uint32_t i = add(parent, name, std::move(in));
    contents_[i] = std::move(c);
    return i;
  }
  // A file of `size` bytes, all holes but `data` (chunk number -> bytes).
  uint32_t sparse(uint32_t parent, const std::string& name, uint64_t size,
                  const std::map<size_t, std::string>& data) {
    FsInode in = attrs(S_IFREG | 0644);
    in.size = size;
    Content c{size, {}, true};
    in.chunks.assign((size + kChunk - 1) / kChunk, kHoleChunk);
    for (const auto& [k, bytes] : data) {
      in.chunks[k] = blob_.append(bytes);
      c.pieces.emplace_back(k * static_cast<uint64_t>(kChunk), bytes);
    }
    uint32_t i = add(parent, name, std::move(in));
    contents_[i] = std::move(c);
    return i;
  }
  uint32_t symlink(uint32_t parent, const std::string& name, const std::string& target) {
    FsInode in = attrs(S_IFLNK | 0777);
    in.symlink = target;
    return add(parent, name, std::move(in));
  }
  uint32_t node(uint32_t parent, const std::string& name, uint32_t mode, dev_t rdev = 0) {
    FsInode in = attrs(mode);
    in.rdev = static_cast<uint32_t>(rdev);
    return add(parent, name, std::move(in));
  }
  // The tree, children sorted, dataSize set.
  FsTree finish() {
    for (auto& in : tree_.inodes) std::sort(in.children.begin(), in.children.end());
    tree_.dataSize = blob_.size();
    return tree_;
  }
  const std::map<uint32_t, Content>& contents() const { return contents_; }
  const Blob& blob() const { return blob_; }

 private:
  Blob blob_;
  FsTree tree_;
  std::map<uint32_t, Content> contents_;
};

// The tree of every case the writer must get right.
FsTree kitchenSink(Builder& b) {
  b.file(0, "empty", "");
  b.file(0, "small", "hello\n", Builder::attrs(S_IFREG | 0644, 1000, 1000));
  b.file(0, "exact128k", pseudoRandom(kChunk, 1));
  // chunk 0 data, chunk 1 a hole, chunk 2 data, a 1000-byte tail chunk
  std::string multi = pseudoRandom(3 * kChunk + 1000, 2);
  std::fill_n(multi.begin() + kChunk, kChunk, '\0');
  b.file(0, "multi", multi, Builder::attrs(S_IFREG | 0640, 70000, 70000), {1});
  b.sparse(0, "sparse2g", 2ull << 30, {{8000, pseudoRandom(kChunk, 3)}});
  b.file(0, "setuid", "#!/bin/sh\n", Builder::attrs(S_IFREG | 04755));
  b.file(0, "setgid", "x", Builder::attrs(S_IFREG | 02711, 0, 2147483648u));
  b.file(0, "nothing", "no perms", Builder::attrs(S_IFREG | 0000, 2147483648u, 1000));
  b.dir(0, "sticky", 01777);

  uint32_t d = b.dir(0, "dir", 0750);
  uint32_t a = b.dir(d, "a");
  uint32_t bb = b.dir(a, "b");
  uint32_t c = b.dir(bb, "c", 0700);
  b.file(c, "deep.txt", "deep\n");
  b.dir(d, "empty-dir");
  b.at(d).uid = 1000;
  b.at(d).gid = 70000;

  // Mtimes: pre-1970 with nanoseconds, the last nanosecond, 0, beyond 2038.
  b.file(0, "old", "1969", Builder::attrs(S_IFREG | 0644, 0, 0, -31536000, 123456789));
  b.file(0, "nsec", "n", Builder::attrs(S_IFREG | 0644, 0, 0, kMtime, 999999999));
  b.file(0, "epoch0", "0", Builder::attrs(S_IFREG | 0644, 0, 0, 0, 0));
  b.file(0, "future", "f", Builder::attrs(S_IFREG | 0644, 0, 0, 8589934592, 1));

  uint32_t big = b.dir(0, "big");
  for (int k = 0; k < 5000; ++k) {
    char name[32];
    snprintf(name, sizeof name, "entry-%05d%s", k, k % 7 == 0 ? "-with-a-longer-name" : "");
    if (k % 500 == 0) {
      b.dir(big, name);
    } else {
      b.file(big, name, k % 3 == 0 ? std::string(k % 50, 'x') : "",
             Builder::attrs(S_IFREG | 0644, k % 2 == 0 ? 0 : 1000));
    }
  }

  uint32_t names = b.dir(0, "names");
  for (std::string n :
       std::vector<std::string>{"-dash", "#hash", "+plus", "!bang", ".hidden", "..dots", "a b",
                                "\xc3\xbc"
                                "n\xc3\xaf"
                                "c\xc3\xb6"
                                "d\xc3\xa9-\xe5\x90\x8d\xe5\x89\x8d",
                                "\xf0\x9f\x98\x80", std::string(255, 'L'),
                                "\x7f"
                                "del"}) {
    b.file(names, n, n);
  }

  // A directory whose dirents fill exactly one block: FLAT_PLAIN, size 4096.
  uint32_t full = b.dir(0, "fullblock");
  for (char ch = 'a'; ch < 'a' + 15; ++ch) b.file(full, std::string(255, ch), "");
  b.file(full, std::string(52, 'z'), "");

  uint32_t links = b.dir(0, "links");
  b.symlink(links, "short", "../small");
  b.symlink(links, "abs", "/etc/passwd");
  b.symlink(links, "long4000", std::string(4000, 'p'));
  b.symlink(links, "long4095", std::string(4094, 'q') + "r");
  uint32_t sl = b.symlink(links, "with-xattr", "target");
  b.at(sl).xattrs = {{"trusted.sym", "on a link"}};

  uint32_t hard = b.dir(0, "hard");
  uint32_t h = b.file(hard, "h1", "linked\n", Builder::attrs(S_IFREG | 0644, 1000));
  b.link(0, "h2", h);
  uint32_t hfifo = b.node(hard, "fifo1", S_IFIFO | 0600);
  b.link(hard, "fifo2", hfifo);

  uint32_t dev = b.dir(0, "dev");
  b.node(dev, "null", S_IFCHR | 0666, makedev(1, 3));
  b.node(dev, "sda", S_IFBLK | 0660, makedev(8, 0));
  b.node(dev, "bigminor", S_IFCHR | 0600, makedev(250, 70000));
  b.node(dev, "fifo", S_IFIFO | 0644);
  b.node(dev, "sock", S_IFSOCK | 0755);
  b.node(dev, "whiteout", S_IFCHR | 0000, makedev(0, 0));

  uint32_t xd = b.dir(0, "xattrs");
  // security.capability v2: cap_net_bind_service permitted + effective
  std::string cap(
      "\x01\x00\x00\x02\x00\x04\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 20);
  uint32_t xf = b.file(xd, "capable", "cap");
  b.at(xf).xattrs = {{"user.foo", "bar"}, {"security.capability", cap}, {"user.empty", ""}};
  uint32_t opq = b.dir(xd, "opaque");
  b.at(opq).xattrs = {{"trusted.overlay.opaque", "y"}};
  b.file(opq, "inside", "in");
  uint32_t many = b.file(xd, "many", "m");
  for (int k = 0; k < 40; ++k) {
    b.at(many).xattrs.emplace_back("user.attr" + std::to_string(k), std::string(k * 7, 'v'));
  }
  b.at(many).xattrs.emplace_back("user.big", pseudoRandom(3000, 9));
  b.at(many).xattrs.emplace_back("trusted.t", "t");
  // A directory with xattrs and an inline tail.
  uint32_t xdir = b.dir(xd, "dir-with-xattrs");
  b.at(xdir).xattrs = {{"user.d", std::string(1500, 'd')}, {"security.selinux", "label"}};
  for (int k = 0; k < 60; ++k) b.file(xdir, "f" + std::to_string(k), "");
  return b.finish();
}

std::string readAll(const std::string& path) {
  auto r = readFile(path);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  return r.isOk() ? *r : "";
}

std::map<std::string, std::string> listXattrs(const std::string& path) {
  std::map<std::string, std::string> out;
  std::string names(65536, '\0');
  ssize_t n = ::llistxattr(path.c_str(), names.data(), names.size());
  EXPECT_GE(n, 0) << path << ": " << strerror(errno);
  if (n <= 0) return out;
  for (size_t p = 0; p < static_cast<size_t>(n);) {
    std::string name(names.c_str() + p);
    p += name.size() + 1;
    std::string value(65536, '\0');
    ssize_t v = ::lgetxattr(path.c_str(), name.c_str(), value.data(), value.size());
    EXPECT_GE(v, 0) << path << " " << name << ": " << strerror(errno);
    value.resize(v < 0 ? 0 : v);
    out[name] = value;
  }
  return out;
}

std::vector<std::string> listDir(const std::string& path,
                                 std::map<std::string, ino_t>* inos = nullptr) {
  std::vector<std::string> out;
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(path.c_str()), ::closedir);
  EXPECT_TRUE(d) << path << ": " << strerror(errno);
  if (!d) return out;
  while (struct dirent* e = ::readdir(d.get())) {
    if (inos) (*inos)[e->d_name] = e->d_ino;
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) out.push_back(e->d_name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Checks that the file at `path` reads as `c`.
void expectContent(const std::string& path, const Content& c) {
  if (c.size <= (64u << 20)) {
    std::string want(c.size, '\0');
    for (const auto& [off, bytes] : c.pieces) want.replace(off, bytes.size(), bytes);
    std::string got = readAll(path);
    EXPECT_EQ(got.size(), want.size()) << path;
    EXPECT_TRUE(got == want) << path << ": contents differ";
    return;
  }
  // Large (sparse) files: the pieces and some of the zeros around them.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid()) << path;
  std::vector<std::pair<uint64_t, std::string>> probes = c.pieces;
  for (uint64_t off : {uint64_t{0}, c.size / 2, c.size - 4096})
    probes.emplace_back(off, std::string(4096, '\0'));
  for (const auto& [off, bytes] : c.pieces) {
    if (off >= 4096) probes.emplace_back(off - 4096, std::string(4096, '\0'));
    probes.emplace_back(off + bytes.size(), std::string(4096, '\0'));
  }
  for (const auto& [off, bytes] : probes) {
    std::string got(bytes.size(), 'X');
    ASSERT_EQ(::pread(fd.get(), got.data(), got.size(), static_cast<off_t>(off)),
              static_cast<ssize_t>(got.size()))
        << path << " at " << off;
    EXPECT_TRUE(got == bytes) << path << ": differs at " << off;
  }
}

enum class Via { kKernel, kFsckExtract };

// Checks every entry of the tree as seen under `root`: the kernel's mount, or
// what fsck.erofs --extract made of it (which keeps no xattrs or hard links,
// drops hole chunks, and whose lchown after chmod clears setuid/setgid).
void expectTree(const FsTree& tree, const std::map<uint32_t, Content>& contents,
                const std::string& root, Via via) {
  std::map<uint32_t, ino_t> inoOf;
  std::set<ino_t> seenInos;
  std::map<uint32_t, uint32_t> links;
  for (const auto& in : tree.inodes) {
    for (const auto& [name, c] : in.children) ++links[c];
  }
  std::function<void(uint32_t, const std::string&, ino_t)> walk =
      [&](uint32_t i, const std::string& path, ino_t parentIno) {
        const FsInode& in = tree.inodes[i];
        struct stat st;
        ASSERT_EQ(::lstat(path.c_str(), &st), 0) << path << ": " << strerror(errno);
        uint32_t mode = in.mode;
        if (via == Via::kFsckExtract && S_ISREG(mode)) mode &= ~(S_ISUID | S_ISGID);
        EXPECT_EQ(st.st_mode, mode) << path;
        EXPECT_EQ(st.st_uid, in.uid) << path;
        EXPECT_EQ(st.st_gid, in.gid) << path;
        bool checkTime = via == Via::kKernel || !S_ISDIR(in.mode);
        if (checkTime) {
          EXPECT_EQ(st.st_mtim.tv_sec, in.mtime) << path;
          EXPECT_EQ(st.st_mtim.tv_nsec, in.mtimeNsec) << path;
        }
        if (S_ISDIR(in.mode)) {
          uint32_t subdirs = 0;
          for (const auto& [n, c] : in.children) subdirs += S_ISDIR(tree.inodes[c].mode);
          EXPECT_EQ(st.st_nlink, 2 + subdirs) << path;
        } else if (via == Via::kKernel) {
          EXPECT_EQ(st.st_nlink, links[i]) << path;
        }
        if (via == Via::kKernel) {
          auto [it, fresh] = inoOf.emplace(i, st.st_ino);
          if (fresh) {
            EXPECT_TRUE(seenInos.insert(st.st_ino).second) << path << ": inode number reused";
          } else {
            EXPECT_EQ(st.st_ino, it->second) << path << ": hard link to another inode";
          }
          std::map<std::string, std::string> want(in.xattrs.begin(), in.xattrs.end());
          EXPECT_EQ(listXattrs(path), want) << path;
        }
        if (S_ISCHR(in.mode) || S_ISBLK(in.mode)) {
          EXPECT_EQ(major(st.st_rdev), major(in.rdev)) << path;
          EXPECT_EQ(minor(st.st_rdev), minor(in.rdev)) << path;
        }
        if (S_ISLNK(in.mode)) {
          std::string target(8192, '\0');
          ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
          ASSERT_GE(n, 0) << path;
          target.resize(n);
          EXPECT_EQ(target, in.symlink) << path;
          EXPECT_EQ(st.st_size, static_cast<off_t>(in.symlink.size())) << path;
        }
        if (S_ISREG(in.mode)) {
          auto c = contents.find(i);
          ASSERT_NE(c, contents.end()) << path;
          if (via == Via::kKernel || !c->second.holes) {
            EXPECT_EQ(static_cast<uint64_t>(st.st_size), in.size) << path;
            expectContent(path, c->second);
          }
        }
        if (S_ISDIR(in.mode)) {
          std::map<std::string, ino_t> direntInos;
          std::vector<std::string> want;
          for (const auto& [n, c] : in.children) want.push_back(n);
          EXPECT_EQ(listDir(path, via == Via::kKernel ? &direntInos : nullptr), want) << path;
          if (via == Via::kKernel) {
            EXPECT_EQ(direntInos["."], st.st_ino) << path;
            EXPECT_EQ(direntInos[".."], parentIno) << path;
          }
          for (const auto& [n, c] : in.children) {
            walk(c, path + "/" + n, st.st_ino);
            if (testing::Test::HasFatalFailure()) return;
            if (via == Via::kKernel) {
              EXPECT_EQ(direntInos[n], inoOf[c]) << path << "/" << n << ": dirent's inode";
            }
          }
        }
      };
  struct stat rootSt;
  ASSERT_EQ(::lstat(root.c_str(), &rootSt), 0);
  walk(0, root, rootSt.st_ino);
}

Status run(const std::vector<std::string>& argv) { return runCommand(argv); }

bool haveTool(const char* name) {
  return run({"sh", "-c", std::string("command -v ") + name}).isOk();
}

uint32_t le32(const std::string& s, size_t off) {
  uint32_t v = 0;
  for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(s[off + k]);
  return v;
}
uint16_t le16(const std::string& s, size_t off) {
  return static_cast<uint16_t>(static_cast<uint8_t>(s[off]) | static_cast<uint8_t>(s[off + 1])
                                                                  << 8);
}

TEST(ErofsWriterTest, SuperblockAndDeterminism) {
  TempDir tmp;
  Builder b(tmp / "blob");
  FsTree tree = kitchenSink(b);
  auto info = writeErofs(tree, tmp / "a.erofs");
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  std::string img = readAll(tmp / "a.erofs");
  ASSERT_EQ(img.size(), info->size);
  EXPECT_EQ(img.size() % 4096, 0u);
  EXPECT_EQ(info->inodes, tree.inodes.size());
  EXPECT_EQ(info->rootNid, 40u);
  const size_t sb = 1024;
  EXPECT_EQ(le32(img, sb), 0xE0F5E1E2u);
  EXPECT_EQ(le32(img, sb + 8), 3u);    // SB_CHKSUM | MTIME, as mkfs.erofs 1.5
  EXPECT_EQ(img[sb + 12], 12);         // 4 KiB blocks
  EXPECT_EQ(le16(img, sb + 14), 40u);  // root nid
  EXPECT_EQ(le32(img, sb + 24), static_cast<uint32_t>(kMtime));  // the commonest mtime
  EXPECT_EQ(le32(img, sb + 36), img.size() / 4096);
  EXPECT_EQ(img.substr(sb + 48, 16),
            std::string(reinterpret_cast<const char*>(kLayerUuid.data()), 16));
  EXPECT_EQ(le32(img, sb + 80), 0xCu);  // CHUNKED_FILE | DEVICE_TABLE
  EXPECT_EQ(le16(img, sb + 86), 1u);    // one extra device
  EXPECT_EQ(le16(img, sb + 88), 9u);    // its slot at 1152
  EXPECT_EQ(le32(img, 1152 + 64), b.blob().size() / 4096);
  std::string zeroed = img.substr(sb, 4096 - sb);
  uint32_t stored = le32(zeroed, 4);
  std::fill_n(zeroed.begin() + 4, 4, '\0');
  EXPECT_EQ(erofsCrc32c(~0u, zeroed.data(), zeroed.size()), stored);
  // A 2 GiB file of holes but one chunk takes one chunk of blob, and 16384
  // chunk indexes (128 KiB) of metadata.
  {
    Builder sb2(tmp / "sparse.data");
    sb2.sparse(0, "sparse2g", 2ull << 30, {{8000, pseudoRandom(kChunk, 3)}});
    auto s = writeErofs(sb2.finish(), tmp / "sparse.erofs");
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    EXPECT_EQ(sb2.blob().size(), kChunk);
    EXPECT_LE(s->size, (128u << 10) + 2 * 4096);
  }

  // Same tree, same bytes; xattr order does not matter.
  ASSERT_TRUE(writeErofs(tree, tmp / "b.erofs").isOk());
  EXPECT_TRUE(readAll(tmp / "b.erofs") == img);
  for (auto& in : tree.inodes) std::reverse(in.xattrs.begin(), in.xattrs.end());
  ASSERT_TRUE(writeErofs(tree, tmp / "c.erofs").isOk());
  EXPECT_TRUE(readAll(tmp / "c.erofs") == img);
  // All-extended inodes: bigger, epoch 0.
  ErofsWriterOptions ext;
  ext.compactInodes = false;
  ext.deviceTag = "sha256:0123";
  auto e = writeErofs(tree, tmp / "d.erofs", ext);
  ASSERT_TRUE(e.isOk()) << e.status().toString();
  std::string eimg = readAll(tmp / "d.erofs");
  EXPECT_EQ(le32(eimg, sb + 24), 0u);
  EXPECT_EQ(eimg.substr(1152, 11), "sha256:0123");
  EXPECT_GT(e->size, info->size);
}

TEST(ErofsWriterTest, RejectsBadTrees) {
  TempDir tmp;
  auto expectBad = [&](const FsTree& t, const std::string& field,
                       const ErofsWriterOptions& o = {}) {
    auto r = writeErofs(t, tmp / "bad.erofs", o);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << field << ": " << r.status().toString();
    EXPECT_EQ(r.status().field(), field) << r.status().toString();
    EXPECT_EQ(listDir(tmp.path()), std::vector<std::string>{"blob"}) << "left files behind";
  };
  Builder b(tmp / "blob");
  b.file(0, "f", "data");
  b.dir(0, "d");
  const FsTree good = b.finish();
  ASSERT_TRUE(writeErofs(good, tmp / "good.erofs").isOk());
  ASSERT_EQ(::unlink((tmp / "good.erofs").c_str()), 0);

  expectBad(FsTree{}, "inodes");
  FsTree t = good;
  t.inodes[0].mode = S_IFREG | 0644;
  expectBad(t, "inodes");
  t = good;
  std::swap(t.inodes[0].children[0], t.inodes[0].children[1]);
  expectBad(t, "children");  // out of order
  t = good;
  t.inodes[0].children.emplace_back("g/h", 1);
  expectBad(t, "children");
  t = good;
  t.inodes[0].children.emplace_back("z", 99);
  expectBad(t, "children");
  t = good;
  t.inodes[0].children.emplace_back("z", 2);  // a second name for directory "d"
  expectBad(t, "children");
  t = good;
  t.inodes[0].children.emplace_back("z", 0);
  expectBad(t, "children");
  t = good;
  t.inodes[0].children.emplace_back(std::string(256, 'z'), 1);
  expectBad(t, "children");
  t = good;
  t.inodes[1].chunks.push_back(0);
  expectBad(t, "chunks");
  t = good;
  t.inodes[1].chunks[0] = 1;  // beyond the one-block blob
  expectBad(t, "chunks");
  t = good;
  t.inodes[1].xattrs = {{"system.nfs4_acl", "x"}};
  expectBad(t, "xattrs");
  t = good;
  t.inodes[1].xattrs = {{"user.a", "1"}, {"user.a", "2"}};
  expectBad(t, "xattrs");
  t = good;
  t.inodes[1].xattrs = {{"user.a", std::string(70000, 'v')}};
  expectBad(t, "xattrs");
  t = good;
  t.inodes[1].mode = 0644;  // no file type
  expectBad(t, "mode");
  t = good;
  t.inodes[1].mode = S_IFLNK | 0777;
  t.inodes[1].chunks.clear();
  expectBad(t, "symlink");  // empty target
  // Chunks in other layers' blobs (devices 2..).
  t = good;
  t.inodes[1].chunkDevices = {1};  // no extra blob 1
  expectBad(t, "chunkDevices");
  t.extraBlobs = {{"sha256:" + std::string(64, 'e'), 4096}};
  t.inodes[1].chunks[0] = 1;  // beyond the extra blob's one block
  expectBad(t, "chunks");
  t.inodes[1].chunks[0] = 0;
  t.inodes[1].chunkDevices = {1, 0};  // not one per chunk
  expectBad(t, "chunkDevices");
  t.inodes[1].chunkDevices = {1};
  ASSERT_TRUE(writeErofs(t, tmp / "good.erofs").isOk());
  ASSERT_EQ(::unlink((tmp / "good.erofs").c_str()), 0);
  t.extraBlobs.assign(kMaxExtraBlobs + 1, t.extraBlobs[0]);
  expectBad(t, "extraBlobs");
  t.extraBlobs = {{"e", 4096}};
  expectBad(t, "extraBlobs");
  ErofsWriterOptions o;
  o.chunkSize = 3000;
  expectBad(good, "chunkSize", o);
}

TEST(ErofsWriterTest, LeavesOutUnreachableInodes) {
  TempDir tmp;
  Builder b(tmp / "blob");
  b.file(0, "kept", "k");
  FsTree t = b.finish();
  t.inodes.push_back(Builder::attrs(S_IFREG | 0644));  // replaced by a later tar entry, say
  auto info = writeErofs(t, tmp / "meta");
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  EXPECT_EQ(info->inodes, 2u);
  EXPECT_EQ(le32(readAll(tmp / "meta"), 1024 + 16), 2u);  // the superblock's inode count
}

TEST(ErofsWriterTest, FsckExtractsWhatWasWritten) {
  if (!haveTool("fsck.erofs")) GTEST_SKIP() << "fsck.erofs not installed";
  if (geteuid() != 0)
    GTEST_SKIP() << "needs root for fsck.erofs --extract to keep owners and make devices";
  TempDir tmp;
  Builder b(tmp / "blob");
  FsTree tree = kitchenSink(b);
  auto info = writeErofs(tree, tmp / "meta");
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  Status st =
      run({"fsck.erofs", "--device=" + tmp / "blob", "--extract=" + tmp / "out", tmp / "meta"});
  ASSERT_TRUE(st.isOk()) << st.toString();
  expectTree(tree, b.contents(), tmp / "out", Via::kFsckExtract);
  // fsck without --extract reads every chunk too.
  st = run({"fsck.erofs", "--device=" + tmp / "blob", tmp / "meta"});
  EXPECT_TRUE(st.isOk()) << st.toString();
}

TEST(ErofsWriterTest, KernelMountShowsEveryAttribute) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to mount";
  TempDir tmp;
  Builder b(tmp / "blob");
  FsTree tree = kitchenSink(b);
  auto info = writeErofs(tree, tmp / "meta");
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  Mount m;
  MOUNT_OR_SKIP(m.erofs(tmp / "meta", tmp / "blob", tmp / "mnt"));
  expectTree(tree, b.contents(), tmp / "mnt", Via::kKernel);
  // Lookups by name in the 5000-entry directory (binary search across blocks).
  for (int k : {0, 1, 499, 500, 2500, 4998, 4999}) {
    char name[64];
    snprintf(name, sizeof name, "entry-%05d%s", k, k % 7 == 0 ? "-with-a-longer-name" : "");
    struct stat st;
    EXPECT_EQ(::lstat((tmp / "mnt/big/" + name).c_str(), &st), 0) << name;
  }
  struct stat st;
  EXPECT_NE(::lstat((tmp / "mnt/big/entry-00007").c_str(), &st), 0);
  EXPECT_EQ(errno, ENOENT);
  // The same with all-extended inodes.
  ErofsWriterOptions ext;
  ext.compactInodes = false;
  ASSERT_TRUE(writeErofs(tree, tmp / "meta-ext", ext).isOk());
  Mount m2;
  MOUNT_OR_SKIP(m2.erofs(tmp / "meta-ext", tmp / "blob", tmp / "mnt-ext"));
  expectTree(tree, b.contents(), tmp / "mnt-ext", Via::kKernel);
}

// Reads a directory from disk into an FsTree, writing file data to a blob
// (all-zero chunks become holes), as the tar converter would.
FsTree fromDirectoryForTest(const std::string& dir, Blob& blob) {
  FsTree t;
  std::map<std::pair<dev_t, ino_t>, uint32_t> seen;
  std::function<uint32_t(const std::string&)> add = [&](const std::string& path) -> uint32_t {
    struct stat st;
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1) {
      auto it = seen.find({st.st_dev, st.st_ino});
      if (it != seen.end()) return it->second;
    }
    uint32_t i = static_cast<uint32_t>(t.inodes.size());
    t.inodes.emplace_back();
    seen[{st.st_dev, st.st_ino}] = i;
    FsInode in;
    in.mode = st.st_mode;
    in.uid = st.st_uid;
    in.gid = st.st_gid;
    in.mtime = st.st_mtim.tv_sec;
    in.mtimeNsec = static_cast<uint32_t>(st.st_mtim.tv_nsec);
    in.rdev = static_cast<uint32_t>(st.st_rdev);
    in.xattrs.clear();
    for (auto& [k, v] : listXattrs(path)) in.xattrs.emplace_back(k, v);
    if (S_ISREG(st.st_mode)) {
      std::string data = readAll(path);
      in.size = data.size();
      for (size_t off = 0; off < data.size(); off += kChunk) {
        std::string_view chunk = std::string_view(data).substr(off, kChunk);
        bool zero = chunk.find_first_not_of('\0') == std::string_view::npos;
        in.chunks.push_back(zero ? kHoleChunk : blob.append(chunk));
      }
    } else if (S_ISLNK(st.st_mode)) {
      in.symlink.assign(4096, '\0');
      ssize_t n = ::readlink(path.c_str(), in.symlink.data(), in.symlink.size());
      in.symlink.resize(n < 0 ? 0 : n);
    } else if (S_ISDIR(st.st_mode)) {
      for (const auto& name : listDir(path)) in.children.emplace_back(name, add(path + "/" + name));
    }
    t.inodes[i] = std::move(in);
    return i;
  };
  add(dir);
  t.dataSize = blob.size();
  return t;
}

// Checks that two mounted trees hold the same entries, attributes, contents
// and hard links (directory sizes and inode numbers aside).
void expectSameTrees(const std::string& a, const std::string& b) {
  std::map<ino_t, ino_t> inoMap;
  std::function<void(const std::string&)> cmp = [&](const std::string& rel) {
    std::string pa = a + rel, pb = b + rel;
    struct stat sa, sb;
    ASSERT_EQ(::lstat(pa.c_str(), &sa), 0) << pa;
    ASSERT_EQ(::lstat(pb.c_str(), &sb), 0) << pb;
    EXPECT_EQ(sa.st_mode, sb.st_mode) << rel;
    EXPECT_EQ(sa.st_uid, sb.st_uid) << rel;
    EXPECT_EQ(sa.st_gid, sb.st_gid) << rel;
    EXPECT_EQ(sa.st_nlink, sb.st_nlink) << rel;
    EXPECT_EQ(sa.st_rdev, sb.st_rdev) << rel;
    EXPECT_EQ(sa.st_mtim.tv_sec, sb.st_mtim.tv_sec) << rel;
    EXPECT_EQ(sa.st_mtim.tv_nsec, sb.st_mtim.tv_nsec) << rel;
    EXPECT_EQ(listXattrs(pa), listXattrs(pb)) << rel;
    auto [it, fresh] = inoMap.emplace(sa.st_ino, sb.st_ino);
    EXPECT_EQ(it->second, sb.st_ino) << rel << ": hard links differ";
    if (S_ISDIR(sa.st_mode)) {
      auto na = listDir(pa), nb = listDir(pb);
      EXPECT_EQ(na, nb) << rel;
      if (na != nb) return;
      for (const auto& n : na) cmp(rel + "/" + n);
      return;
    }
    EXPECT_EQ(sa.st_size, sb.st_size) << rel;
    if (S_ISREG(sa.st_mode)) {
      EXPECT_TRUE(readAll(pa) == readAll(pb)) << rel << ": contents differ";
    }
    if (S_ISLNK(sa.st_mode)) {
      char ta[4096], tb[4096];
      ssize_t la = ::readlink(pa.c_str(), ta, sizeof ta),
              lb = ::readlink(pb.c_str(), tb, sizeof tb);
      EXPECT_EQ(std::string(ta, std::max<ssize_t>(la, 0)),
                std::string(tb, std::max<ssize_t>(lb, 0)))
          << rel;
    }
  };
  cmp("");
}

void writeFileOrFail(const std::string& path, const std::string& data, int mode = 0644) {
  ASSERT_TRUE(writeFileAtomic(path, data, mode).isOk()) << path;
}

void setTimes(const std::string& path, int64_t sec, long nsec) {
  struct timespec ts[2] = {{sec, nsec}, {sec, nsec}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, AT_SYMLINK_NOFOLLOW), 0) << path;
}

TEST(ErofsWriterTest, MatchesMkfsErofsOnTheSameTree) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown, mknod and mount";
  if (!haveTool("mkfs.erofs")) GTEST_SKIP() << "mkfs.erofs not installed";
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_TRUE(makeDirs(src + "/sub/deeper", 0755).isOk());
  ASSERT_TRUE(makeDirs(src + "/opaque", 0755).isOk());
  ASSERT_TRUE(makeDirs(src + "/many", 0755).isOk());
  writeFileOrFail(src + "/empty", "");
  writeFileOrFail(src + "/small", "small file\n");
  writeFileOrFail(src + "/exact", pseudoRandom(kChunk, 11));
  std::string holed = pseudoRandom(4 * kChunk + 17, 12);
  std::fill_n(holed.begin() + 2 * kChunk, kChunk, '\0');  // a zero chunk: a hole here
  writeFileOrFail(src + "/holed", holed);
  writeFileOrFail(src + "/sub/deeper/file", pseudoRandom(5000, 13), 0600);
  writeFileOrFail(src + "/setuid", "suid", 04755);
  writeFileOrFail(src + "/\xc3\xa9t\xc3\xa9", "utf8");
  writeFileOrFail(src + "/opaque/x", "x");
  for (int k = 0; k < 700; ++k) {
    writeFileOrFail(src + "/many/n" + std::to_string(k * 7919 % 100000), std::to_string(k));
  }
  ASSERT_EQ(::link((src + "/small").c_str(), (src + "/sub/hardlink").c_str()), 0);
  ASSERT_EQ(::symlink("small", (src + "/link").c_str()), 0);
  ASSERT_EQ(::symlink(std::string(3000, 's').c_str(), (src + "/longlink").c_str()), 0);
  ASSERT_EQ(::mknod((src + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);
  ASSERT_EQ(::mknod((src + "/loop").c_str(), S_IFBLK | 0660, makedev(7, 300)), 0);
  ASSERT_EQ(::mknod((src + "/whiteout").c_str(), S_IFCHR, makedev(0, 0)), 0);
  ASSERT_EQ(::mkfifo((src + "/fifo").c_str(), 0640), 0);
  {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::string sp = src + "/sock";
    ASSERT_LT(sp.size(), sizeof addr.sun_path);
    memcpy(addr.sun_path, sp.c_str(), sp.size());
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0)
        << strerror(errno);
  }
  ASSERT_EQ(::lsetxattr((src + "/small").c_str(), "user.k", "v", 1, 0), 0) << strerror(errno);
  ASSERT_EQ(::lsetxattr((src + "/opaque").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  const char cap[20] = {1, 0, 0, 2, 0, 4};
  ASSERT_EQ(::lsetxattr((src + "/setuid").c_str(), "security.capability", cap, sizeof cap, 0), 0);
  ASSERT_EQ(::lchown((src + "/small").c_str(), 1000, 1000), 0);
  ASSERT_EQ(::lchown((src + "/exact").c_str(), 70000, 2147483648u), 0);
  ASSERT_EQ(::lchown((src + "/link").c_str(), 1000, 70000), 0);
  ASSERT_EQ(::lchown((src + "/sub").c_str(), 65535, 65536), 0);
  ASSERT_EQ(::chmod((src + "/setuid").c_str(), 04755), 0);  // after any chown
  ASSERT_EQ(::chmod((src + "/sub").c_str(), 01777), 0);
  setTimes(src + "/small", -1000000, 5);
  setTimes(src + "/exact", 1234567890, 999999999);
  setTimes(src + "/link", 1000, 1);
  setTimes(src + "/sub/deeper", 42, 42);  // directories after their contents
  setTimes(src + "/sub", 1600000000, 0);

  auto built = buildLayer(src, tmp / "mkfs");
  ASSERT_TRUE(built.isOk()) << built.status().toString();
  // Our superblock checksum is the one mkfs.erofs computes.
  std::string mk = readAll(built->path);
  std::string zeroed = mk.substr(1024, 3072);
  uint32_t stored = le32(zeroed, 4);
  std::fill_n(zeroed.begin() + 4, 4, '\0');
  EXPECT_EQ(erofsCrc32c(~0u, zeroed.data(), zeroed.size()), stored);

  Blob blob(tmp / "ours.data");
  FsTree tree = fromDirectoryForTest(src, blob);
  if (HasFailure()) return;
  auto info = writeErofs(tree, tmp / "ours.erofs");
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  // Same superblock flags, uuid and device count as mkfs.erofs.
  std::string ours = readAll(tmp / "ours.erofs");
  for (size_t off : {1024 + 8, 1024 + 80}) EXPECT_EQ(le32(ours, off), le32(mk, off)) << off;
  EXPECT_EQ(ours.substr(1024 + 48, 16), mk.substr(1024 + 48, 16));
  EXPECT_EQ(le16(ours, 1024 + 86), le16(mk, 1024 + 86));
  // Holes keep our blob smaller than mkfs's (which stores a zero chunk once).
  EXPECT_LE(blob.size(), static_cast<uint64_t>(built->dataSize));

  Mount mm, mo;
  MOUNT_OR_SKIP(mm.erofs(built->path, built->dataPath, tmp / "mnt-mkfs"));
  MOUNT_OR_SKIP(mo.erofs(tmp / "ours.erofs", tmp / "ours.data", tmp / "mnt-ours"));
  expectSameTrees(tmp / "mnt-mkfs", tmp / "mnt-ours");
  // And both match the source tree (whose directories may differ in size).
  expectSameTrees(src, tmp / "mnt-ours");
}

// The same comparison over a real tree of the host's, on demand (it reads
// the whole tree twice): DSEC_EROFS_DIFF_TREE=/usr/lib erofs_writer_test.
TEST(ErofsWriterTest, MatchesMkfsErofsOnAHostTree) {
  const char* src = getenv("DSEC_EROFS_DIFF_TREE");
  if (!src) GTEST_SKIP() << "set DSEC_EROFS_DIFF_TREE to a directory to compare on";
  if (geteuid() != 0) GTEST_SKIP() << "needs root to mount";
  if (!haveTool("mkfs.erofs")) GTEST_SKIP() << "mkfs.erofs not installed";
  TempDir tmp;
  auto built = buildLayer(src, tmp / "mkfs");
  ASSERT_TRUE(built.isOk()) << built.status().toString();
  Blob blob(tmp / "ours.data");
  FsTree tree = fromDirectoryForTest(src, blob);
  if (HasFailure()) return;
  auto start = std::chrono::steady_clock::now();
  auto info = writeErofs(tree, tmp / "ours.erofs");
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  printf(
      "%s: %zu inodes; metadata: mkfs.erofs %lld bytes, ours %llu (%.3f s); data: mkfs.erofs "
      "%lld bytes, ours %llu\n",
      src, tree.inodes.size(), static_cast<long long>(built->size),
      static_cast<unsigned long long>(info->size), secs, static_cast<long long>(built->dataSize),
      static_cast<unsigned long long>(blob.size()));
  Mount mm, mo;
  MOUNT_OR_SKIP(mm.erofs(built->path, built->dataPath, tmp / "mnt-mkfs"));
  MOUNT_OR_SKIP(mo.erofs(tmp / "ours.erofs", tmp / "ours.data", tmp / "mnt-ours"));
  expectSameTrees(tmp / "mnt-mkfs", tmp / "mnt-ours");
}

TEST(ErofsWriterTest, OverlayHonoursWhiteoutsAndOpaqueDirs) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to mount";
  TempDir tmp;
  Builder lower(tmp / "lower.data");
  uint32_t la = lower.dir(0, "a");
  lower.file(la, "file1", "one");
  lower.file(la, "file2", "two");
  uint32_t lb = lower.dir(0, "b");
  lower.file(lb, "x", "x");
  lower.file(0, "keep", "keep");
  FsTree lt = lower.finish();
  Builder upper(tmp / "upper.data");
  uint32_t ua = upper.dir(0, "a");
  upper.node(ua, "file1", S_IFCHR | 0000, makedev(0, 0));  // whiteout
  uint32_t ub = upper.dir(0, "b");
  upper.at(ub).xattrs = {{"trusted.overlay.opaque", "y"}};
  upper.file(ub, "y", "y");
  upper.file(0, "new", "new");
  FsTree ut = upper.finish();
  ASSERT_TRUE(writeErofs(lt, tmp / "lower.erofs").isOk());
  ASSERT_TRUE(writeErofs(ut, tmp / "upper.erofs").isOk());
  Mount ml, mu, mo;
  MOUNT_OR_SKIP(ml.erofs(tmp / "lower.erofs", tmp / "lower.data", tmp / "l"));
  MOUNT_OR_SKIP(mu.erofs(tmp / "upper.erofs", tmp / "upper.data", tmp / "u"));
  MOUNT_OR_SKIP(mo.overlay(tmp / "u" + ":" + tmp / "l", tmp / "o"));
  EXPECT_EQ(listDir(tmp / "o"), (std::vector<std::string>{"a", "b", "keep", "new"}));
  EXPECT_EQ(listDir(tmp / "o/a"), std::vector<std::string>{"file2"});
  EXPECT_EQ(listDir(tmp / "o/b"), std::vector<std::string>{"y"});
  struct stat st;
  EXPECT_NE(::lstat((tmp / "o/a/file1").c_str(), &st), 0);
  EXPECT_NE(::lstat((tmp / "o/b/x").c_str(), &st), 0);
  EXPECT_EQ(readAll(tmp / "o/a/file2"), "two");
  EXPECT_EQ(readAll(tmp / "o/keep"), "keep");
  EXPECT_EQ(readAll(tmp / "o/b/y"), "y");
}

TEST(ErofsWriterTest, HundredThousandEntries) {
  TempDir tmp;
  Blob blob(tmp / "blob");
  uint32_t shared = blob.append(pseudoRandom(100, 5));
  FsTree t;
  t.inodes.push_back(Builder::attrs(S_IFDIR | 0755));
  const int kDirs = 100, kPerDir = 1000;
  t.inodes.reserve(1 + kDirs * (kPerDir + 1));
  for (int d = 0; d < kDirs; ++d) {
    uint32_t di = static_cast<uint32_t>(t.inodes.size());
    t.inodes.push_back(Builder::attrs(S_IFDIR | 0755));
    t.inodes[0].children.emplace_back("dir" + std::to_string(d), di);
    for (int f = 0; f < kPerDir; ++f) {
      FsInode in = Builder::attrs(S_IFREG | 0644, f % 3 == 0 ? 100000 : 0, 0, kMtime + f % 5);
      if (f % 10 == 9) {
        in.mode = S_IFLNK | 0777;
        in.symlink = "../dir0/file-" + std::to_string(f);
      } else {
        in.size = 100;
        in.chunks = {shared};
      }
      t.inodes[di].children.emplace_back("file-" + std::to_string(f), t.inodes.size());
      t.inodes.push_back(std::move(in));
    }
  }
  for (auto& in : t.inodes) std::sort(in.children.begin(), in.children.end());
  t.dataSize = blob.size();
  auto start = std::chrono::steady_clock::now();
  auto info = writeErofs(t, tmp / "meta");
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  printf("%zu inodes: %.3f s, image %llu bytes (%.1f per inode), max rss %ld KiB\n",
         t.inodes.size(), secs, static_cast<unsigned long long>(info->size),
         static_cast<double>(info->size) / t.inodes.size(), ru.ru_maxrss);
  EXPECT_EQ(info->inodes, t.inodes.size());
  EXPECT_LT(secs, 20.0);
  if (haveTool("fsck.erofs")) {
    Status st = run({"fsck.erofs", "--device=" + tmp / "blob", tmp / "meta"});
    EXPECT_TRUE(st.isOk()) << st.toString();
  }
  if (geteuid() != 0) GTEST_SKIP() << "needs root to mount";
  Mount m;
  MOUNT_OR_SKIP(m.erofs(tmp / "meta", tmp / "blob", tmp / "mnt"));
  size_t seen = 0;
  for (int d = 0; d < kDirs; d += 1) {
    std::string dir = tmp / "mnt/dir" + std::to_string(d);
    auto names = listDir(dir);
    seen += names.size();
    if (d % 10 != 0) continue;
    for (const auto& n : names) {
      struct stat st;
      ASSERT_EQ(::lstat((dir + "/" + n).c_str(), &st), 0) << n;
      int f = std::stoi(n.substr(5));
      EXPECT_EQ(st.st_uid, f % 3 == 0 ? 100000u : 0u) << n;
      EXPECT_EQ(st.st_mtim.tv_sec, kMtime + f % 5) << n;
    }
  }
  EXPECT_EQ(seen, static_cast<size_t>(kDirs * kPerDir));
  EXPECT_EQ(readAll(tmp / "mnt/dir99/file-998"), pseudoRandom(100, 5));
}

}  // namespace
}  // namespace dsec::image
