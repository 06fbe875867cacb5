#include "image/tar_stream.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <locale.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "common/util.h"
#include "image/erofs_writer.h"
#include "image/layer_converter.h"
#include "image/oci_import.h"

namespace dsec::image {
namespace {

constexpr uint64_t kC = kChunkSize;

// ---- making tars ------------------------------------------------------------

struct Ent {
  std::string path;
  unsigned type = AE_IFREG;
  int perm = 0644;
  int64_t uid = 0, gid = 0;
  int64_t mtime = 1700000000;
  long nsec = 0;
  std::string data;
  std::string symlink;
  std::string hardlink;
  unsigned major = 0, minor = 0;
  std::vector<std::pair<std::string, std::string>> xattrs;
};

Ent file(std::string path, std::string data, int perm = 0644) {
  Ent e;
  e.path = std::move(path);
  e.data = std::move(data);
  e.perm = perm;
  return e;
}
Ent dir(std::string path, int perm = 0755) {
  Ent e;
  e.path = std::move(path);
  e.type = AE_IFDIR;
  e.perm = perm;
  return e;
}
Ent link(std::string path, std::string target) {
  Ent e;
  e.path = std::move(path);
  e.hardlink = std::move(target);
  return e;
}

// A PAX tar (libarchive's writer: xattrs as LIBARCHIVE.xattr.* and
// SCHILY.xattr.*), padded to 10240 bytes as tar does.
void writeTar(const std::string& path, const std::vector<Ent>& ents) {
  struct archive* a = archive_write_new();
  archive_write_set_format_pax(a);
  archive_write_add_filter_none(a);
  ASSERT_EQ(archive_write_open_filename(a, path.c_str()), ARCHIVE_OK);
  for (const auto& x : ents) {
    struct archive_entry* e = archive_entry_new();
    archive_entry_copy_pathname(e, x.path.c_str());
    archive_entry_set_uid(e, x.uid);
    archive_entry_set_gid(e, x.gid);
    archive_entry_set_mtime(e, x.mtime, x.nsec);
    archive_entry_set_perm(e, mode_t(x.perm));
    if (!x.hardlink.empty()) {
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_copy_hardlink(e, x.hardlink.c_str());
      archive_entry_set_size(e, 0);
    } else {
      archive_entry_set_filetype(e, x.type);
      if (x.type == AE_IFREG) archive_entry_set_size(e, la_int64_t(x.data.size()));
      if (x.type == AE_IFLNK) archive_entry_copy_symlink(e, x.symlink.c_str());
      if (x.type == AE_IFCHR || x.type == AE_IFBLK) {
        archive_entry_set_rdevmajor(e, x.major);
        archive_entry_set_rdevminor(e, x.minor);
      }
    }
    for (auto& [n, v] : x.xattrs) archive_entry_xattr_add_entry(e, n.c_str(), v.data(), v.size());
    ASSERT_EQ(archive_write_header(a, e), ARCHIVE_OK) << x.path << ": " << archive_error_string(a);
    if (x.type == AE_IFREG && x.hardlink.empty() && !x.data.empty()) {
      ASSERT_EQ(archive_write_data(a, x.data.data(), x.data.size()), la_ssize_t(x.data.size()));
    }
    archive_entry_free(e);
  }
  ASSERT_EQ(archive_write_close(a), ARCHIVE_OK);
  archive_write_free(a);
}

Status sh(const std::string& cmd) { return runCommand({"sh", "-c", cmd}); }

std::string randomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng() & 0xff);
  return s;
}

std::string slurp(const std::string& path) {
  auto r = readFile(path);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  return r.isOk() ? *r : "";
}

// ---- reading results back ----------------------------------------------------

const FsInode* at(const FsTree& t, const std::string& path) {
  const FsInode* cur = &t.inodes[0];
  for (auto& c : splitString(path, '/')) {
    if (c.empty()) continue;
    auto it = std::lower_bound(cur->children.begin(), cur->children.end(), c,
                               [](const auto& a, const std::string& b) { return a.first < b; });
    if (it == cur->children.end() || it->first != c) return nullptr;
    cur = &t.inodes[it->second];
  }
  return cur;
}

uint32_t indexOf(const FsTree& t, const std::string& path) {
  const FsInode* p = at(t, path);
  return p ? uint32_t(p - t.inodes.data()) : kHoleChunk;
}

// `len` bytes of a regular file from `off`, through its chunk addresses.
std::string readRange(const FsInode& ino, const std::string& dataPath, uint64_t off, uint64_t len) {
  std::string out;
  int fd = ::open(dataPath.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  struct stat st;
  ::fstat(fd, &st);
  uint64_t end = std::min(ino.size, off + len);
  while (off < end) {
    uint64_t i = off / kC, inChunk = off % kC;
    uint64_t chunkLen = std::min(kC, ino.size - i * kC);
    uint64_t take = std::min(chunkLen - inChunk, end - off);
    EXPECT_LT(i, ino.chunks.size());
    if (i >= ino.chunks.size()) break;
    if (ino.chunks[i] == kHoleChunk) {
      out.append(take, '\0');
    } else {
      uint64_t at = uint64_t(ino.chunks[i]) * kFsBlockSize;
      EXPECT_LE(at + chunkLen, uint64_t(st.st_size)) << "chunk " << i << " past the blob";
      std::string b(take, '\0');
      EXPECT_EQ(::pread(fd, b.data(), take, off_t(at + inChunk)), ssize_t(take));
      out += b;
    }
    off += take;
  }
  ::close(fd);
  return out;
}

std::string contentOf(const FsInode& ino, const std::string& dataPath) {
  EXPECT_EQ(ino.chunks.size(), (ino.size + kC - 1) / kC);
  return readRange(ino, dataPath, 0, ino.size);
}

size_t reachable(const FsTree& t) {
  std::vector<bool> seen(t.inodes.size());
  std::vector<uint32_t> q = {0};
  seen[0] = true;
  for (size_t i = 0; i < q.size(); ++i) {
    for (auto& [n, c] : t.inodes[q[i]].children) {
      if (!seen[c]) {
        seen[c] = true;
        q.push_back(c);
      }
    }
  }
  return q.size();
}

// Children sorted, every index in range, directories named once.
void expectWellFormed(const FsTree& t) {
  ASSERT_FALSE(t.inodes.empty());
  EXPECT_TRUE(S_ISDIR(t.inodes[0].mode));
  std::vector<int> dirNames(t.inodes.size());
  for (auto& ino : t.inodes) {
    for (size_t i = 0; i < ino.children.size(); ++i) {
      ASSERT_LT(ino.children[i].second, t.inodes.size());
      if (i > 0) {
        EXPECT_LT(ino.children[i - 1].first, ino.children[i].first);
      }
      if (S_ISDIR(t.inodes[ino.children[i].second].mode)) ++dirNames[ino.children[i].second];
    }
    if (!S_ISDIR(ino.mode)) {
      EXPECT_TRUE(ino.children.empty());
    }
    if (S_ISREG(ino.mode)) {
      EXPECT_EQ(ino.chunks.size(), (ino.size + kC - 1) / kC);
    }
    for (uint32_t c : ino.chunks) {
      if (c != kHoleChunk) {
        EXPECT_LT(uint64_t(c) * kFsBlockSize, t.dataSize);
      }
    }
  }
  for (size_t i = 1; i < t.inodes.size(); ++i) {
    if (S_ISDIR(t.inodes[i].mode)) {
      EXPECT_EQ(dirNames[i], 1) << "inode " << i;
    }
  }
  EXPECT_EQ(reachable(t), t.inodes.size()) << "unreachable inodes left in the tree";
  EXPECT_EQ(t.dataSize % kFsBlockSize, 0u);
}

// A canonical description of a tree: what tar extraction, translateWhiteouts
// and our converter must agree on (mtimes aside: extraction touches
// directories).
struct Node {
  uint32_t mode = 0, uid = 0, gid = 0, rdev = 0;
  std::string content;  // regular files: sha256; symlinks: target
  std::vector<std::pair<std::string, std::string>> xattrs;  // sorted
  std::string linkGroup;  // non-directories with several names: the first name
  bool operator==(const Node&) const = default;
};
std::ostream& operator<<(std::ostream& o, const Node& n) {
  o << std::oct << n.mode << std::dec << " " << n.uid << ":" << n.gid << " rdev " << n.rdev << " ["
    << n.content << "] link[" << n.linkGroup << "] xattrs{";
  for (auto& [k, v] : n.xattrs) o << k << "=" << sha256Hex(v).substr(0, 8) << " ";
  return o << "}";
}
using Description = std::map<std::string, Node>;

Description describeDir(const std::string& root) {
  Description out;
  std::map<ino_t, std::vector<std::string>> names;
  std::vector<std::string> dirs = {""};
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::string rel = dirs[i];
    std::string abs = rel.empty() ? root : root + "/" + rel;
    struct stat st;
    EXPECT_EQ(::lstat(abs.c_str(), &st), 0) << abs;
    Node n;
    n.mode = st.st_mode;
    n.uid = st.st_uid;
    n.gid = st.st_gid;
    if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) n.rdev = uint32_t(st.st_rdev);
    if (S_ISREG(st.st_mode)) n.content = sha256Hex(slurp(abs));
    if (S_ISLNK(st.st_mode)) {
      char buf[8192];
      ssize_t len = ::readlink(abs.c_str(), buf, sizeof buf);
      n.content.assign(buf, size_t(std::max<ssize_t>(len, 0)));
    }
    char list[65536];
    ssize_t ll = ::llistxattr(abs.c_str(), list, sizeof list);
    for (ssize_t p = 0; p < ll; p += ssize_t(strlen(list + p)) + 1) {
      std::string v(65536, '\0');
      ssize_t vl = ::lgetxattr(abs.c_str(), list + p, v.data(), v.size());
      v.resize(size_t(std::max<ssize_t>(vl, 0)));
      n.xattrs.emplace_back(list + p, v);
    }
    std::sort(n.xattrs.begin(), n.xattrs.end());
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1) names[st.st_ino].push_back(rel);
    out[rel] = n;
    if (!S_ISDIR(st.st_mode)) continue;
    DIR* d = ::opendir(abs.c_str());
    while (auto* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      dirs.push_back(rel.empty() ? name : rel + "/" + name);
    }
    ::closedir(d);
  }
  for (auto& [ino, ns] : names) {
    if (ns.size() < 2) continue;
    std::string first = *std::min_element(ns.begin(), ns.end());
    for (auto& n : ns) out[n].linkGroup = first;
  }
  return out;
}

Description describeTree(const TarLayer& l, const std::string& dataPath) {
  Description out;
  std::map<uint32_t, std::vector<std::string>> names;
  std::vector<std::pair<std::string, uint32_t>> q = {{"", 0}};
  for (size_t i = 0; i < q.size(); ++i) {
    auto [rel, idx] = q[i];
    const FsInode& ino = l.tree.inodes[idx];
    Node n;
    n.mode = ino.mode;
    n.uid = ino.uid;
    n.gid = ino.gid;
    n.rdev = ino.rdev;
    if (S_ISREG(ino.mode)) n.content = sha256Hex(contentOf(ino, dataPath));
    if (S_ISLNK(ino.mode)) n.content = ino.symlink;
    n.xattrs = ino.xattrs;
    std::sort(n.xattrs.begin(), n.xattrs.end());
    if (!S_ISDIR(ino.mode)) names[idx].push_back(rel);
    out[rel] = n;
    for (auto& [name, c] : ino.children) q.emplace_back(rel.empty() ? name : rel + "/" + name, c);
  }
  for (auto& [idx, ns] : names) {
    if (ns.size() < 2) continue;
    std::string first = *std::min_element(ns.begin(), ns.end());
    for (auto& n : ns) out[n].linkGroup = first;
  }
  return out;
}

class TarStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dsec-tar-stream-test-" + randomHex(4);
    ASSERT_TRUE(makeDirs(dir_, 0755).isOk());
    data_ = dir_ + "/layer.data";
  }
  void TearDown() override { (void)removeTree(dir_); }

  Result<TarLayer> read(const std::string& path,
                        std::optional<LayerCompression> c = kDetectCompression,
                        const TarLayerOptions& opts = {}) {
    auto src = openFileSource(path);
    if (!src.isOk()) return std::move(src).takeStatus();
    return readTarLayer(**src, c, data_, opts);
  }

  // Extracts `tar` as buildLayer does, applies translateWhiteouts, and
  // compares with the converter's tree, and the owner reports.
  void expectMatchesExtraction(const std::string& tar, const TarLayer& l) {
    std::string x = dir_ + "/x-" + randomHex(3);
    ASSERT_TRUE(makeDirs(x, 0755).isOk());
    ::umask(022);
    Status st = runCommand({"tar", "--numeric-owner", "--xattrs", "--xattrs-include=*",
                            "--same-permissions", "--same-owner", "-xf", tar, "-C", x});
    ASSERT_TRUE(st.isOk()) << st.toString();
    ASSERT_TRUE(translateWhiteouts(x).isOk());
    expectSame(describeDir(x), describeTree(l, data_));
    auto owners = scanOwners(x, kDefaultOwnerWidth);
    ASSERT_TRUE(owners.isOk());
    EXPECT_EQ(l.owners.width, owners->width);
    EXPECT_EQ(l.owners.entries, owners->entries);
    EXPECT_EQ(l.owners.outside, owners->outside);
    EXPECT_EQ(l.owners.maxUid, owners->maxUid);
    EXPECT_EQ(l.owners.maxGid, owners->maxGid);
    EXPECT_EQ(l.owners.examples, owners->examples);
  }

  static void expectSame(const Description& want, const Description& got) {
    for (auto& [p, n] : want) {
      auto it = got.find(p);
      if (it == got.end()) {
        ADD_FAILURE() << "missing: \"" << p << "\" " << n;
      } else {
        EXPECT_EQ(it->second, n) << "at \"" << p << "\"";
      }
    }
    for (auto& [p, n] : got) {
      if (!want.count(p)) ADD_FAILURE() << "not in the extraction: \"" << p << "\" " << n;
    }
  }

  void expectIndexMatches(const TarLayer& l) {
    auto idx = ChunkIndex::build(data_, kChunkSize);
    ASSERT_TRUE(idx.isOk());
    EXPECT_EQ(l.chunks.chunkSize, idx->chunkSize);
    EXPECT_EQ(l.chunks.dataSize, idx->dataSize);
    EXPECT_TRUE(l.chunks.digests == idx->digests) << "incremental ChunkIndex differs";
    EXPECT_EQ(l.dataDigest, "sha256:" + *sha256File(data_));
    struct stat st;
    ASSERT_EQ(::stat(data_.c_str(), &st), 0);
    EXPECT_EQ(uint64_t(st.st_size), l.tree.dataSize);
    EXPECT_EQ(l.stats.dataBytes, st.st_size);
  }

  bool canMknod() {
    std::string p = dir_ + "/probe-" + randomHex(3);
    bool ok = ::mknod(p.c_str(), S_IFCHR, makedev(0, 0)) == 0;
    ::unlink(p.c_str());
    std::string f = dir_ + "/probe-x-" + randomHex(3);
    ok = ok && writeFileAtomic(f, "").isOk() &&
         ::lsetxattr(f.c_str(), "trusted.dsec", "y", 1, 0) == 0;
    ::unlink(f.c_str());
    return ok && geteuid() == 0;
  }

  std::string dir_, data_;
};

// ---- decompression ------------------------------------------------------------

std::string drain(ByteSource& s, size_t step = 70001) {
  std::string out, buf(step, '\0');
  for (;;) {
    auto r = s.read(buf.data(), buf.size());
    EXPECT_TRUE(r.isOk()) << r.status().toString();
    if (!r.isOk() || *r == 0) break;
    out.append(buf.data(), *r);
  }
  return out;
}

Status drainStatus(ByteSource& s) {
  std::string buf(65536, '\0');
  for (;;) {
    auto r = s.read(buf.data(), buf.size());
    if (!r.isOk()) return std::move(r).takeStatus();
    if (*r == 0) return Status::ok();
  }
}

Result<std::unique_ptr<ByteSource>> decoderOf(const std::string& path,
                                              std::optional<LayerCompression> c,
                                              LayerCompression* used = nullptr) {
  auto f = openFileSource(path);
  if (!f.isOk()) return std::move(f).takeStatus();
  return decompressing(std::move(*f), c, used);
}

TEST_F(TarStreamTest, DecompressesGzipMembersZstdFramesAndPlain) {
  std::string plain = randomBytes(3 << 20, 1) + std::string(1 << 20, 'a');
  ASSERT_TRUE(writeFileAtomic(dir_ + "/p", plain).isOk());
  std::string d = dir_;
  // Two gzip members and two zstd frames, split at an odd byte.
  ASSERT_TRUE(sh("head -c 1048593 " + d + "/p | gzip -c > " + d + "/p.gz && tail -c +1048594 " + d +
                 "/p | gzip -1 -c >> " + d + "/p.gz")
                  .isOk());
  ASSERT_TRUE(sh("head -c 1048593 " + d + "/p | zstd -q -c > " + d + "/p.zst && tail -c +1048594 " +
                 d + "/p | zstd -q -c >> " + d + "/p.zst")
                  .isOk());
  for (auto [file, c] :
       {std::pair{"p.gz", LayerCompression::kGzip}, std::pair{"p.zst", LayerCompression::kZstd},
        std::pair{"p", LayerCompression::kNone}}) {
    for (bool detect : {false, true}) {
      LayerCompression used = LayerCompression::kNone;
      auto s = decoderOf(dir_ + "/" + file, detect ? kDetectCompression : std::optional(c), &used);
      ASSERT_TRUE(s.isOk()) << s.status().toString();
      EXPECT_EQ(used, c) << file;
      std::string got = drain(**s);
      EXPECT_TRUE(got == plain) << file << " detect=" << detect << ": " << got.size() << " bytes";
      char b;
      auto again = (*s)->read(&b, 1);
      ASSERT_TRUE(again.isOk());
      EXPECT_EQ(*again, 0u) << "reads after the end return 0";
    }
  }
}

TEST_F(TarStreamTest, CorruptOrTruncatedCompressedStreamsAreDataLoss) {
  std::string plain = randomBytes(1 << 20, 2);
  ASSERT_TRUE(writeFileAtomic(dir_ + "/p", plain).isOk());
  ASSERT_TRUE(sh("gzip -c " + dir_ + "/p > " + dir_ + "/p.gz").isOk());
  ASSERT_TRUE(sh("zstd -q -c " + dir_ + "/p > " + dir_ + "/p.zst").isOk());
  std::string gz = slurp(dir_ + "/p.gz"), zst = slurp(dir_ + "/p.zst");

  auto expectLoss = [&](const std::string& bytes, LayerCompression c, const std::string& what) {
    auto s = decompressing(std::make_unique<MemorySource>(bytes), c);
    if (!s.isOk()) {
      ADD_FAILURE() << what << ": " << s.status().toString();
      return std::string();
    }
    Status st = drainStatus(**s);
    EXPECT_EQ(st.code(), Code::kDataLoss) << what << ": " << st.toString();
    return st.message();
  };
  std::string flipped = gz;
  flipped[gz.size() / 2] ^= 0x55;
  std::string msg = expectLoss(flipped, LayerCompression::kGzip, "flipped gzip");
  EXPECT_NE(msg.find("gzip"), std::string::npos) << msg;
  msg = expectLoss(gz.substr(0, gz.size() - 9), LayerCompression::kGzip, "truncated gzip");
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  expectLoss(gz + "garbage!", LayerCompression::kGzip, "gzip with trailing garbage");
  expectLoss(gz + std::string(512, '\0'), LayerCompression::kGzip, "gzip with trailing zeros");
  expectLoss("", LayerCompression::kGzip, "empty gzip");
  expectLoss(plain, LayerCompression::kGzip, "not gzip");
  std::string zflipped = zst;
  zflipped[zst.size() / 2] ^= 0x55;
  expectLoss(zflipped, LayerCompression::kZstd, "flipped zstd");
  msg = expectLoss(zst.substr(0, zst.size() - 100), LayerCompression::kZstd, "truncated zstd");
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  expectLoss("", LayerCompression::kZstd, "empty zstd");

  // A zstd frame asking for a 1 GiB window (windowLog 30): refused by its header.
  std::string big("\x28\xb5\x2f\xfd\x00\xa0\x09\x00\x00x", 10);
  auto s = decompressing(std::make_unique<MemorySource>(big), LayerCompression::kZstd);
  ASSERT_TRUE(s.isOk());
  Status st = drainStatus(**s);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_NE(st.message().find("window"), std::string::npos) << st.toString();
  // The same frame with windowLog 20 decodes.
  std::string small("\x28\xb5\x2f\xfd\x00\x50\x09\x00\x00x", 10);
  s = decompressing(std::make_unique<MemorySource>(small), kDetectCompression);
  ASSERT_TRUE(s.isOk());
  EXPECT_EQ(drain(**s), "x");

  auto xz = decompressing(std::make_unique<MemorySource>(std::string("\xfd"
                                                                     "7zXZ\0rest",
                                                                     10)),
                          kDetectCompression);
  EXPECT_EQ(xz.status().code(), Code::kInvalidArgument);
  EXPECT_NE(xz.status().message().find("xz"), std::string::npos);
}

// Serves `bytes` a few at a time (1..maxStep a read, at random): headers,
// blocks and trailers split at every kind of offset.
class ChunkedSource final : public ByteSource {
 public:
  ChunkedSource(std::string bytes, size_t maxStep, uint32_t seed)
      : bytes_(std::move(bytes)), maxStep_(maxStep), rng_(seed) {}
  Result<size_t> read(char* buf, size_t n) override {
    size_t take = std::min({n, bytes_.size() - pos_, size_t(rng_() % maxStep_ + 1)});
    std::memcpy(buf, bytes_.data() + pos_, take);
    pos_ += take;
    return take;
  }

 private:
  std::string bytes_;
  size_t pos_ = 0;
  size_t maxStep_;
  std::mt19937 rng_;
};

uint32_t crc32Of(const std::string& s) {
  uint32_t c = 0xffffffff;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
  }
  return ~c;
}

// A gzip member header (RFC 1952 2.3) with the optional fields `flags` asks for.
std::string gzipHeader(uint8_t flags, const std::string& extra, const std::string& name,
                       const std::string& comment) {
  std::string h("\x1f\x8b\x08", 3);
  h.push_back(char(flags));
  h += std::string("\x00\x09\x3d\x65\x00\x03", 6);  // mtime, XFL, OS
  if (flags & 0x04) {
    h.push_back(char(extra.size() & 0xff));
    h.push_back(char(extra.size() >> 8));
    h += extra;
  }
  if (flags & 0x08) h += name + std::string(1, '\0');
  if (flags & 0x10) h += comment + std::string(1, '\0');
  if (flags & 0x02) {
    uint32_t c = crc32Of(h);
    h.push_back(char(c & 0xff));
    h.push_back(char((c >> 8) & 0xff));
  }
  return h;
}

// Words from a small vocabulary: deflate finds matches at every distance.
std::string wordy(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> words(600);
  for (auto& w : words) {
    for (size_t i = 0, len = 2 + rng() % 9; i < len; i++) w.push_back(char('a' + rng() % 26));
  }
  std::string s;
  while (s.size() < n) s += words[rng() % words.size()] + (rng() % 11 ? " " : "\n");
  s.resize(n);
  return s;
}

TEST_F(TarStreamTest, GzipHeaderFieldsTrailersAndMembersSplitAnywhere) {
  std::string a = wordy(300000, 3), b = randomBytes(70000, 4), c = wordy(5000, 5);
  std::string d = dir_;
  ASSERT_TRUE(writeFileAtomic(d + "/a", a).isOk());
  ASSERT_TRUE(writeFileAtomic(d + "/b", b).isOk());
  ASSERT_TRUE(writeFileAtomic(d + "/c", c).isOk());
  // gzip -n: a bare 10-byte header, so what follows it is the deflate data and
  // the trailer, to put behind headers of our own.
  ASSERT_TRUE(sh("gzip -n -6 -c " + d + "/a > " + d + "/a.gz && gzip -n -1 -c " + d + "/b > " + d +
                 "/b.gz && gzip -n -9 -c " + d + "/c > " + d +
                 "/c.gz && gzip -n -c < /dev/null > " + d + "/e.gz")
                  .isOk());
  auto body = [&](const std::string& f) {
    std::string g = slurp(d + "/" + f);
    EXPECT_EQ(g.substr(0, 4), std::string("\x1f\x8b\x08\x00", 4)) << f;
    return g.substr(10);
  };
  // FEXTRA (one subfield), FNAME, FCOMMENT and FHCRC; a plain member of
  // stored blocks; FNAME and FHCRC; an empty member with FTEXT and FCOMMENT.
  std::string all = gzipHeader(0x1e, std::string("ds\x04\x00seca", 8), "layer.tar", "by hand") +
                    body("a.gz") + slurp(d + "/b.gz") + gzipHeader(0x0a, "", "c", "") +
                    body("c.gz") + gzipHeader(0x11, "", "", "empty") + body("e.gz");
  std::string want = a + b + c;
  // Input reads of at most maxStep bytes, output reads of outStep.
  const std::pair<size_t, size_t> kReads[] = {
      {1, 7}, {3, 70001}, {17, 65536}, {4096, 1}, {size_t(1) << 20, 4093}};
  for (auto [maxStep, outStep] : kReads) {
    LayerCompression used = LayerCompression::kNone;
    auto s = decompressing(std::make_unique<ChunkedSource>(all, maxStep, uint32_t(maxStep)),
                           kDetectCompression, &used);
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    EXPECT_EQ(used, LayerCompression::kGzip);
    std::string got = drain(**s, outStep);
    EXPECT_TRUE(got == want) << "reads of at most " << maxStep << " bytes, " << outStep
                             << " out: " << got.size() << " of " << want.size() << " bytes";
  }

  auto expectLoss = [&](const std::string& bytes, size_t maxStep, const std::string& what,
                        const std::string& says) {
    auto s =
        decompressing(std::make_unique<ChunkedSource>(bytes, maxStep, 7), LayerCompression::kGzip);
    ASSERT_TRUE(s.isOk()) << what << ": " << s.status().toString();
    Status st = drainStatus(**s);
    EXPECT_EQ(st.code(), Code::kDataLoss) << what << ": " << st.toString();
    EXPECT_NE(st.message().find(says), std::string::npos) << what << ": " << st.toString();
  };
  std::string one = slurp(d + "/a.gz");
  for (size_t maxStep : {size_t(3), size_t(1) << 20}) {
    // The trailer: CRC-32, then ISIZE.
    std::string bad = one;
    bad[bad.size() - 8] ^= 1;
    expectLoss(bad, maxStep, "a wrong CRC-32", "CRC-32");
    bad = one;
    bad[bad.size() - 1] ^= 0x40;
    expectLoss(bad, maxStep, "a wrong ISIZE", "CRC-32 or length");
    // The header: its own CRC, reserved flags, the method.
    std::string h = gzipHeader(0x0a, "", "x", "");
    h[h.size() - 1] ^= 1;
    expectLoss(h + body("a.gz"), maxStep, "a wrong header CRC", "header crc");
    expectLoss(one + gzipHeader(0x20, "", "", "") + body("c.gz"), maxStep, "reserved flag",
               "(after member 1): unknown header flags");
    bad = one;
    bad[2] = 7;
    expectLoss(bad, maxStep, "method 7", "compression method");
    // After a whole member: a few bytes of garbage, or the start of a header.
    expectLoss(one + "garbage!", maxStep, "trailing garbage",
               "after member 1): not a gzip member header");
    expectLoss(one + "\x1f", maxStep, "trailing 1f",
               "truncated gzip stream: it ends inside member 2");
    expectLoss(one + "\x1fX", maxStep, "trailing 1f X", "not a gzip member header");
    expectLoss(one + gzipHeader(0x1e, "ab", "name", "comment").substr(0, 17), maxStep,
               "a header cut short", "ends inside member 2");
  }
  // A distance reaching before the first byte (a fixed-Huffman block: a match
  // of 3 at distance 1, then the end), which zlib calls too far back.
  expectLoss(gzipHeader(0, "", "", "") + std::string("\x03\x02\x00", 3) + std::string(8, '\0'),
             1 << 20, "distance before the start", "too far back");
}

// ---- entries -------------------------------------------------------------------

TEST_F(TarStreamTest, ReadsEveryEntryTypeWithItsAttributes) {
  // security.capability as the kernel stores it: VFS_CAP_REVISION_2, effective,
  // CAP_NET_RAW permitted.
  std::string cap(
      "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 20);
  std::string binary("\x00\x01\xff\xfe value", 10);
  Ent root = dir(".", 0750);
  root.uid = 5;
  root.gid = 6;
  root.mtime = 42;
  Ent passwd = file("etc/passwd", "root:x:0:0::/root:/bin/sh\n");
  passwd.mtime = 1600000000;
  passwd.nsec = 123456789;
  passwd.xattrs = {{"user.note", "hello"}, {"trusted.overlay.origin", binary}};
  Ent ping = file("bin/ping", randomBytes(5000, 3), 04755);
  ping.xattrs = {{"security.capability", cap}};
  Ent sym;
  sym.path = "etc/localtime";
  sym.type = AE_IFLNK;
  sym.perm = 0777;
  sym.symlink = "../usr/share/zoneinfo/UTC";
  Ent null;
  null.path = "dev/null";
  null.type = AE_IFCHR;
  null.perm = 0666;
  null.major = 1;
  null.minor = 3;
  Ent sda;
  sda.path = "dev/sda";
  sda.type = AE_IFBLK;
  sda.perm = 0660;
  sda.gid = 6;
  sda.major = 8;
  sda.minor = 0;
  Ent fifo;
  fifo.path = "run/fifo";
  fifo.type = AE_IFIFO;
  fifo.perm = 0600;
  Ent owned = file("home/u/f", "mine", 0600);
  owned.uid = 100000;
  owned.gid = 200000;
  ping.xattrs.emplace_back("foo.bar", "dropped");  // no such namespace in EROFS
  Ent bin = dir("bin", 0711);  // after bin/ping: takes its attributes, keeps ping
  bin.mtime = 77;
  Ent etcdir = dir("etc/");
  etcdir.xattrs = {{"user.d", "1"}};
  std::vector<Ent> ents = {root,
                           etcdir,
                           passwd,
                           sym,
                           link("etc/passwd-", "etc/passwd"),
                           ping,
                           null,
                           sda,
                           fifo,
                           owned,
                           bin,
                           file("empty", "")};
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, ents);
  auto l = read(tar);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  expectWellFormed(l->tree);
  const FsTree& t = l->tree;

  const FsInode& r = t.inodes[0];
  EXPECT_EQ(r.mode, uint32_t(S_IFDIR | 0750));
  EXPECT_EQ(r.uid, 5u);
  EXPECT_EQ(r.gid, 6u);
  EXPECT_EQ(r.mtime, 42);

  const FsInode* p = at(t, "etc/passwd");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->mode, uint32_t(S_IFREG | 0644));
  EXPECT_EQ(p->mtime, 1600000000);
  EXPECT_EQ(p->mtimeNsec, 123456789u);
  EXPECT_EQ(contentOf(*p, data_), passwd.data);
  auto xs = p->xattrs;
  std::sort(xs.begin(), xs.end());
  decltype(xs) wantX = {{"trusted.overlay.origin", binary}, {"user.note", "hello"}};
  EXPECT_EQ(xs, wantX);
  EXPECT_EQ(indexOf(t, "etc/passwd-"), indexOf(t, "etc/passwd")) << "a hard link shares the inode";
  EXPECT_EQ(at(t, "etc")->xattrs,
            (std::vector<std::pair<std::string, std::string>>{{"user.d", "1"}}));

  const FsInode* ln = at(t, "etc/localtime");
  ASSERT_TRUE(ln);
  EXPECT_EQ(ln->mode, uint32_t(S_IFLNK | 0777));
  EXPECT_EQ(ln->symlink, "../usr/share/zoneinfo/UTC");
  const FsInode* pg = at(t, "bin/ping");
  ASSERT_TRUE(pg);
  EXPECT_EQ(pg->mode, uint32_t(S_IFREG | 04755));
  ASSERT_EQ(pg->xattrs.size(), 1u);
  EXPECT_EQ(pg->xattrs[0].second, cap);
  EXPECT_EQ(contentOf(*pg, data_), ping.data);
  const FsInode* b = at(t, "bin");
  EXPECT_EQ(b->mode, uint32_t(S_IFDIR | 0711));
  EXPECT_EQ(b->mtime, 77);
  EXPECT_EQ(at(t, "dev/null")->mode, uint32_t(S_IFCHR | 0666));
  EXPECT_EQ(at(t, "dev/null")->rdev, uint32_t(makedev(1, 3)));
  EXPECT_EQ(at(t, "dev/sda")->mode, uint32_t(S_IFBLK | 0660));
  EXPECT_EQ(at(t, "dev/sda")->rdev, uint32_t(makedev(8, 0)));
  EXPECT_EQ(at(t, "run/fifo")->mode, uint32_t(S_IFIFO | 0600));
  // Implicit parents: 0755, 0:0, mtime 0.
  for (const char* d : {"dev", "run", "home", "home/u"}) {
    const FsInode* x = at(t, d);
    ASSERT_TRUE(x) << d;
    EXPECT_EQ(x->mode, uint32_t(S_IFDIR | 0755)) << d;
    EXPECT_EQ(x->uid, 0u);
    EXPECT_EQ(x->mtime, 0);
  }
  EXPECT_EQ(l->stats.implicitDirs, 5);  // bin, dev, run, home, home/u
  EXPECT_EQ(at(t, "home/u/f")->uid, 100000u);
  EXPECT_EQ(at(t, "empty")->chunks.size(), 0u);
  EXPECT_EQ(l->stats.entries, int64_t(ents.size()));
  EXPECT_EQ(l->stats.hardLinks, 1);
  EXPECT_EQ(l->stats.replaced, 1);  // bin
  EXPECT_EQ(l->stats.warnings, 2);  // libarchive's writer stores it twice: SCHILY. and LIBARCHIVE.
  EXPECT_NE(l->stats.firstWarning.find("foo.bar"), std::string::npos) << l->stats.firstWarning;

  EXPECT_EQ(l->owners.width, kDefaultOwnerWidth);
  EXPECT_EQ(l->owners.outside, 1);
  EXPECT_EQ(l->owners.maxUid, 100000u);
  ASSERT_EQ(l->owners.examples.size(), 1u);
  EXPECT_EQ(l->owners.examples[0], (OwnerExample{"home/u/f", 100000, 200000}));
  EXPECT_EQ(l->owners.entries, int64_t(reachable(t)) + 1);  // etc/passwd- counted by name

  EXPECT_EQ(l->compression, LayerCompression::kNone);
  EXPECT_EQ(l->diffId, "sha256:" + *sha256File(tar));
  EXPECT_EQ(l->digest, l->diffId);
  expectIndexMatches(*l);
  if (!canMknod())
    GTEST_SKIP() << "needs root with mknod and trusted.* xattrs to compare with tar -x";
  expectMatchesExtraction(tar, *l);
}

TEST_F(TarStreamTest, NormalisesNamesAndRefusesDotDot) {
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, {file("./a//b/./c", "1"), file("/abs", "2"), dir("./d/"), dir("d//e/")});
  auto l = read(tar);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  EXPECT_TRUE(at(l->tree, "a/b/c"));
  EXPECT_TRUE(at(l->tree, "abs"));
  ASSERT_TRUE(at(l->tree, "d"));
  EXPECT_TRUE(S_ISDIR(at(l->tree, "d")->mode));
  ASSERT_TRUE(at(l->tree, "d/e"));
  EXPECT_EQ(l->tree.inodes[0].children.size(), 3u);  // a, abs, d

  for (const char* bad : {"../x", "a/../../x", "a/..", "ok/../x"}) {
    writeTar(tar, {file("fine", "1"), file(bad, "2")});
    auto r = read(tar);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(r.status().field(), "layer");
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().toString();
    EXPECT_NE(::access(data_.c_str(), F_OK), 0) << "no data blob left after a failure";
  }
  writeTar(tar, {file(std::string(300, 'n'), "x")});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument) << "a 300-byte component";
  std::string longPath;
  for (int i = 0; i < 40; ++i) longPath += std::string(110, 'a' + i % 26) + "/";
  writeTar(tar, {file(longPath + "f", "x")});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument) << "a 4.4 KB path";
  writeTar(tar, {file("a", "1"), file("a/b", "2")});
  auto np = read(tar);
  EXPECT_EQ(np.status().code(), Code::kInvalidArgument);
  EXPECT_NE(np.status().message().find("not a directory"), std::string::npos);
  Ent rootFile = file(".", "x");
  writeTar(tar, {rootFile});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument);
}

TEST_F(TarStreamTest, HardLinksAndReplacedPaths) {
  std::string tar = dir_ + "/t.tar";
  Ent e2 = dir("e", 0700);
  e2.uid = 9;
  writeTar(tar,
           {
               file("x", "first"), file("x", "second"),  // last wins
               dir("d"), file("d/f", "in d"), link("d/g", "d/f"),
               file("d", "d is a file now"),  // drops d's subtree
               dir("e"), file("e/f", "kept"),
               e2,  // a directory over a directory keeps children
               file("h1", "old"), link("h2", "h1"), file("h1", "new"),  // h2 keeps the old inode
               link("h3", "d/g"),  // gone with d: but h3 came later, so refused below
           });
  auto l = read(tar);
  ASSERT_EQ(l.status().code(), Code::kInvalidArgument) << "link to a dropped path";
  EXPECT_NE(l.status().message().find("d/g"), std::string::npos) << l.status().toString();

  writeTar(tar, {
                    file("x", "first"),
                    file("x", "second"),
                    dir("d"),
                    file("d/f", "in d"),
                    link("d/g", "d/f"),
                    link("outside", "d/f"),  // the file survives d's removal through this name
                    file("d", "d is a file now"),
                    dir("e"),
                    file("e/f", "kept"),
                    e2,
                    file("h1", "old"),
                    link("h2", "h1"),
                    file("h1", "new"),
                    link("self", "x"),
                    link("self", "self"),
                });
  l = read(tar);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const FsTree& t = l->tree;
  expectWellFormed(t);
  EXPECT_EQ(contentOf(*at(t, "x"), data_), "second");
  EXPECT_TRUE(S_ISREG(at(t, "d")->mode));
  EXPECT_EQ(at(t, "d/f"), nullptr);
  EXPECT_EQ(contentOf(*at(t, "outside"), data_), "in d");
  EXPECT_EQ(at(t, "e")->mode, uint32_t(S_IFDIR | 0700));
  EXPECT_EQ(at(t, "e")->uid, 9u);
  ASSERT_TRUE(at(t, "e/f"));
  EXPECT_EQ(contentOf(*at(t, "h1"), data_), "new");
  EXPECT_EQ(contentOf(*at(t, "h2"), data_), "old");
  EXPECT_EQ(indexOf(t, "self"), indexOf(t, "x"));
  EXPECT_EQ(l->stats.replaced, 5);  // x, d, e, h1, self
  // (No comparison with tar -x here: GNU tar refuses to put a file over a
  // non-empty directory, where Docker and this converter replace it.)

  writeTar(tar, {file("a", "1"), link("b", "nope")});
  auto missing = read(tar);
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  writeTar(tar, {dir("a"), link("b", "a")});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument) << "a hard link to a directory";
}

TEST_F(TarStreamTest, WhiteoutsAsTranslateWhiteoutsMakesThem) {
  std::string tar = dir_ + "/t.tar";
  Ent wh = file("a/.wh.gone", "");
  wh.mtime = 1234;
  wh.uid = 7;  // ignored: translateWhiteouts makes 0:0 devices
  writeTar(tar, {
                    file("a/.wh.keep", ""),  // before its file: still dropped
                    dir("a"),
                    file("a/keep", "k"),
                    wh,
                    file("b/.wh..wh..opq", ""),
                    dir("b"),
                    file("b/f", "f"),
                    file("c/.wh..wh..opq", ""),  // c only implicit
                    file(".wh.top", ""),
                    file("d/e/.wh.x", ""),
                    file("a/.wh..wh.plnk", ""),  // as translateWhiteouts: a device ".wh.plnk"
                    file("z", "after the markers"),
                });
  auto l = read(tar);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const FsTree& t = l->tree;
  expectWellFormed(t);
  const FsInode* g = at(t, "a/gone");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->mode, uint32_t(S_IFCHR));
  EXPECT_EQ(g->rdev, 0u);
  EXPECT_EQ(g->uid, 0u);
  EXPECT_EQ(g->mtime, 1234);
  EXPECT_TRUE(S_ISREG(at(t, "a/keep")->mode));
  EXPECT_EQ(at(t, "a/.wh.keep"), nullptr);
  EXPECT_EQ(at(t, "a/.wh.gone"), nullptr);
  EXPECT_TRUE(S_ISCHR(at(t, "top")->mode));
  EXPECT_TRUE(S_ISCHR(at(t, "d/e/x")->mode));
  EXPECT_TRUE(S_ISCHR(at(t, "a/.wh.plnk")->mode));
  using X = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(at(t, "b")->xattrs, (X{{"trusted.overlay.opaque", "y"}}));
  EXPECT_EQ(at(t, "c")->xattrs, (X{{"trusted.overlay.opaque", "y"}}));
  EXPECT_EQ(at(t, "b/.wh..wh..opq"), nullptr);
  EXPECT_EQ(l->stats.whiteouts, 4);
  EXPECT_EQ(l->stats.whiteoutsDropped, 1);
  EXPECT_EQ(l->stats.opaqueDirs, 2);
  if (!canMknod())
    GTEST_SKIP() << "needs root with mknod and trusted.* xattrs to compare with tar -x";
  expectMatchesExtraction(tar, *l);

  writeTar(tar, {file("a/.wh.", "")});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument) << "an empty whiteout";
  writeTar(tar, {file(".wh.dir/x", "")});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument) << "a whiteout that is a directory";
}

// ---- data placement ---------------------------------------------------------------

TEST_F(TarStreamTest, PlacesChunksAlignedDeduplicatedAndSkipsZeros) {
  std::string a = randomBytes(100, 10), b = randomBytes(300 << 10, 11), c = randomBytes(5000, 12),
              m = std::string(kC, '\0') + randomBytes(kC, 13);
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, {file("a", a), file("b", b), file("c", c), file("z", std::string(200 << 10, '\0')),
                 file("m", m), file("dup", b), file("adup", a), file("e", "")});
  for (bool dedup : {true, false}) {
    SCOPED_TRACE(dedup ? "dedup" : "no dedup");
    TarLayerOptions opts;
    opts.dedup = dedup;
    auto l = read(tar, kDetectCompression, opts);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    const FsTree& t = l->tree;
    expectWellFormed(t);
    using V = std::vector<uint32_t>;
    EXPECT_EQ(at(t, "a")->chunks, V{0});             // 0..100
    EXPECT_EQ(at(t, "b")->chunks, (V{32, 64, 96}));  // 128K-aligned: 128K, 256K, 384K
    EXPECT_EQ(at(t, "c")->chunks, V{107});           // after b's 44K tail: 428K
    EXPECT_EQ(at(t, "z")->chunks, (V{kHoleChunk, kHoleChunk}));
    EXPECT_EQ(at(t, "m")->chunks, (V{kHoleChunk, 128}));  // 432K+904 -> 512K
    if (dedup) {
      EXPECT_EQ(at(t, "dup")->chunks, (V{32, 64, 96}));
      EXPECT_EQ(at(t, "adup")->chunks, V{0});
      EXPECT_EQ(t.dataSize, 640u << 10);
      EXPECT_EQ(l->stats.chunksDeduplicated, 4);
      EXPECT_EQ(l->stats.bytesDeduplicated, int64_t(b.size() + a.size()));
      EXPECT_EQ(l->stats.chunksWritten, 6);  // a, b x3, c, m
    } else {
      EXPECT_EQ(at(t, "dup")->chunks, (V{160, 192, 224}));
      EXPECT_EQ(at(t, "adup")->chunks, V{235});  // after dup's tail: 896K+44K
      EXPECT_EQ(t.dataSize, (940u << 10) + 4096);
      EXPECT_EQ(l->stats.chunksDeduplicated, 0);
    }
    EXPECT_TRUE(at(t, "e")->chunks.empty());
    EXPECT_EQ(l->stats.holeChunks, 3);
    EXPECT_EQ(l->stats.fileBytes,
              int64_t(a.size() * 2 + b.size() * 2 + c.size() + m.size() + (200 << 10)));
    for (auto [n, want] :
         {std::pair{"a", &a}, {"b", &b}, {"c", &c}, {"m", &m}, {"dup", &b}, {"adup", &a}}) {
      EXPECT_TRUE(contentOf(*at(t, n), data_) == *want) << n;
    }
    EXPECT_EQ(contentOf(*at(t, "z"), data_), std::string(200 << 10, '\0'));
    expectIndexMatches(*l);
  }
}

TEST_F(TarStreamTest, ManyFilesThroughGzipReadBackExactly) {
  std::mt19937 rng(99);
  std::vector<Ent> ents;
  std::vector<std::string> pool;
  for (int i = 0; i < 300; ++i) {
    std::string path = "d" + std::to_string(i % 7) + "/f" + std::to_string(i);
    size_t size = (rng() % 4 == 0) ? rng() % (600 << 10) : rng() % 9000;
    std::string data;
    switch (rng() % 6) {
      case 0:
        data = std::string(size, '\0');
        break;
      case 1:
        if (!pool.empty()) {
          data = pool[rng() % pool.size()];
          break;
        }
        [[fallthrough]];
      default:
        data = randomBytes(size, rng());
        break;
    }
    if (rng() % 5 == 0 && data.size() > kC + 10) {  // a zero chunk in the middle
      std::memset(data.data(), 0, kC);
    }
    pool.push_back(data);
    ents.push_back(file(path, data));
  }
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, ents);
  std::string t = tar;
  ASSERT_TRUE(sh("head -c 700001 " + t + " | gzip -c > " + t + ".gz && tail -c +700002 " + t +
                 " | gzip -c >> " + t + ".gz")
                  .isOk());
  auto l = read(tar + ".gz", LayerCompression::kGzip);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  expectWellFormed(l->tree);
  for (const auto& e : ents) {
    const FsInode* f = at(l->tree, e.path);
    ASSERT_TRUE(f) << e.path;
    EXPECT_EQ(f->size, e.data.size());
    EXPECT_TRUE(contentOf(*f, data_) == e.data) << e.path;
    for (size_t i = 0; e.data.size() >= kC && i < f->chunks.size(); ++i) {
      if (f->chunks[i] != kHoleChunk) {
        EXPECT_EQ(f->chunks[i] % (kC / kFsBlockSize), 0u) << e.path << " chunk " << i;
      }
    }
  }
  EXPECT_GT(l->stats.chunksDeduplicated, 0);
  EXPECT_GT(l->stats.holeChunks, 0);
  EXPECT_EQ(l->compression, LayerCompression::kGzip);
  EXPECT_EQ(l->diffId, "sha256:" + *sha256File(tar));
  EXPECT_EQ(l->digest, "sha256:" + *sha256File(tar + ".gz"));
  struct stat st;
  ASSERT_EQ(::stat((tar + ".gz").c_str(), &st), 0);
  EXPECT_EQ(l->compressedSize, st.st_size);
  ASSERT_EQ(::stat(tar.c_str(), &st), 0);
  EXPECT_EQ(l->uncompressedSize, st.st_size);
  expectIndexMatches(*l);

  // The same through zstd, detected: the same tree and blob.
  ASSERT_TRUE(sh("zstd -q -c " + tar + " > " + tar + ".zst").isOk());
  std::string firstBlob = data_ + ".1";
  ASSERT_EQ(::rename(data_.c_str(), firstBlob.c_str()), 0);
  auto z = read(tar + ".zst");
  ASSERT_TRUE(z.isOk()) << z.status().toString();
  EXPECT_EQ(z->compression, LayerCompression::kZstd);
  EXPECT_EQ(z->diffId, l->diffId);
  EXPECT_EQ(z->dataDigest, l->dataDigest);
  EXPECT_EQ(z->digest, "sha256:" + *sha256File(tar + ".zst"));
}

TEST_F(TarStreamTest, ASparseTwoGigabyteFileStaysSmall) {
  std::string src = dir_ + "/src";
  ASSERT_TRUE(makeDirs(src).isOk());
  std::string f = src + "/sparse";
  ASSERT_TRUE(sh("truncate -s 2G " + f).isOk());
  std::string x = randomBytes(4096, 20), y = randomBytes(10000, 21);
  uint64_t xAt = 1 << 20, yAt = (3ull << 29) + 100;  // 1 MiB; 1.5 GiB + 100 (straddles nothing)
  int fd = ::open(f.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, x.data(), x.size(), off_t(xAt)), ssize_t(x.size()));
  ASSERT_EQ(::pwrite(fd, y.data(), y.size(), off_t(yAt)), ssize_t(y.size()));
  ::close(fd);
  std::string tar = dir_ + "/s.tar";
  ASSERT_TRUE(sh("tar --sparse --format=posix -cf " + tar + " -C " + src + " sparse").isOk());
  struct stat st;
  ASSERT_EQ(::stat(tar.c_str(), &st), 0);
  ASSERT_LT(st.st_size, 1 << 20) << "GNU tar did not store the file as sparse";

  auto l = read(tar);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const FsInode* s = at(l->tree, "sparse");
  ASSERT_TRUE(s) << "the GNU sparse name was not resolved";
  EXPECT_EQ(s->size, 2ull << 30);
  ASSERT_EQ(s->chunks.size(), size_t((2ull << 30) / kC));
  EXPECT_EQ(l->stats.holeChunks, int64_t(s->chunks.size()) - 2);
  EXPECT_EQ(l->tree.dataSize, 256u << 10);  // two 128 KiB-aligned chunks
  EXPECT_EQ(readRange(*s, data_, xAt - 10, x.size() + 20),
            std::string(10, '\0') + x + std::string(10, '\0'));
  EXPECT_EQ(readRange(*s, data_, yAt, y.size()), y);
  EXPECT_EQ(readRange(*s, data_, (2ull << 30) - 5000, 5000), std::string(5000, '\0'));
  expectIndexMatches(*l);
}

// ---- names ------------------------------------------------------------------------

TEST_F(TarStreamTest, NonAsciiNamesSurviveByteExactInAnyLocale) {
  std::string src = dir_ + "/src";
  ASSERT_TRUE(makeDirs(src).isOk());
  const std::vector<std::string> names = {
      "caf\xc3\xa9",                           // NFC é
      "nfd_e\xcc\x81",                         // NFD: e + combining acute
      "bad\xff\xfe",                           // not UTF-8
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",  // 日本語
  };
  for (auto& n : names) ASSERT_TRUE(writeFileAtomic(src + "/" + n, n).isOk());
  ASSERT_EQ(::symlink(names[1].c_str(), (src + "/\xe2\x86\x92link").c_str()), 0);
  ASSERT_EQ(::link((src + "/" + names[0]).c_str(), (src + "/hard\xc3\xbc").c_str()), 0);
  for (const char* format : {"posix", "gnu"}) {
    std::string tar = dir_ + "/n-" + format + ".tar";
    ASSERT_TRUE(sh("LANG=C.UTF-8 LC_ALL=C.UTF-8 tar --format=" + std::string(format) + " -cf " +
                   tar + " -C " + src + " .")
                    .isOk());
    for (const char* locale : {"C", "C.UTF-8"}) {
      SCOPED_TRACE(std::string(format) + " in locale " + locale);
      std::string old = setlocale(LC_ALL, nullptr);
      if (!setlocale(LC_ALL, locale)) GTEST_SKIP() << "no locale " << locale;
      auto l = read(tar);
      setlocale(LC_ALL, old.c_str());
      ASSERT_TRUE(l.isOk()) << l.status().toString();
      for (auto& n : names) {
        const FsInode* f = at(l->tree, n);
        ASSERT_TRUE(f) << "missing " << n;
        EXPECT_EQ(contentOf(*f, data_), n);
      }
      const FsInode* ln = at(l->tree, "\xe2\x86\x92link");
      ASSERT_TRUE(ln);
      EXPECT_EQ(ln->symlink, names[1]);
      EXPECT_EQ(indexOf(l->tree, "hard\xc3\xbc"), indexOf(l->tree, names[0]));
      EXPECT_EQ(l->tree.inodes[0].children.size(), names.size() + 2);
      EXPECT_EQ(l->stats.warnings, 0) << l->stats.firstWarning;
    }
  }
}

TEST_F(TarStreamTest, ARealTreeInGnuAndPosixFormatsMatchesExtraction) {
  const std::string zi = "/usr/share/zoneinfo";
  if (::access(zi.c_str(), R_OK) != 0) GTEST_SKIP() << zi << " not installed";
  if (!canMknod())
    GTEST_SKIP() << "needs root with mknod and trusted.* xattrs to compare with tar -x";
  // zoneinfo has symlinks and (on some systems) hard links; add long names
  // (GNU ././@LongLink entries, PAX path records) and a deep implicit parent.
  std::string src = dir_ + "/src";
  ASSERT_TRUE(sh("cp -a " + zi + " " + src).isOk());
  std::string deep = src + "/" + std::string(120, 'L') + "/" + std::string(130, 'M');
  ASSERT_TRUE(makeDirs(deep).isOk());
  ASSERT_TRUE(writeFileAtomic(deep + "/" + std::string(200, 'n'), "long").isOk());
  ASSERT_EQ(::link((src + "/UTC").c_str(), (deep + "/utc-link").c_str()), 0);
  for (const char* format : {"gnu", "posix"}) {
    SCOPED_TRACE(format);
    std::string tar = dir_ + "/z-" + format + ".tar";
    std::string xattrs = std::string(format) == "posix" ? "--xattrs " : "";  // PAX only
    Status made = sh("tar " + xattrs + "--format=" + format + " -cf " + tar + " -C " + src + " .");
    ASSERT_TRUE(made.isOk()) << made.toString();
    auto l = read(tar);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    expectWellFormed(l->tree);
    EXPECT_GT(l->stats.entries, 100);
    EXPECT_EQ(l->diffId, "sha256:" + *sha256File(tar));
    expectIndexMatches(*l);
    expectMatchesExtraction(tar, *l);
  }
}

// The whole path: tar -> tree and data blob -> writeErofs -> the kernel's
// mount, against tar -x and translateWhiteouts of the same tar.
TEST_F(TarStreamTest, TheConvertedLayerMountsAsTheExtraction) {
  if (!canMknod()) GTEST_SKIP() << "needs root with mknod and trusted.* xattrs";
  std::string cap(
      "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 20);
  Ent ping = file("usr/bin/ping", randomBytes(300 << 10, 30), 04755);
  ping.xattrs = {{"security.capability", cap}, {"user.a", "1"}};
  Ent sym;
  sym.path = "usr/lib/libx.so";
  sym.type = AE_IFLNK;
  sym.perm = 0777;
  sym.symlink = "libx.so.1";
  Ent null;
  null.path = "dev/null";
  null.type = AE_IFCHR;
  null.perm = 0666;
  null.major = 1;
  null.minor = 3;
  Ent fifo;
  fifo.path = "run/fifo";
  fifo.type = AE_IFIFO;
  fifo.perm = 0600;
  Ent owned = file("home/u/.profile", "x", 0600);
  owned.uid = 100000;
  owned.gid = 100000;
  std::string sparse = std::string(kC, '\0') + randomBytes(1000, 31) + std::string(kC, '\0');
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, {dir(".", 0755), ping, sym, file("usr/lib/libx.so.1", randomBytes(9000, 32)),
                 link("usr/bin/ping6", "usr/bin/ping"), null, fifo, owned,
                 file("var/sparse", sparse), file("var/dup", randomBytes(300 << 10, 30)),
                 file("etc/.wh.gone", ""), file("etc/.wh..wh..opq", ""), file("etc/keep", "k")});
  std::string src = dir_ + "/zi";
  ASSERT_TRUE(sh("cp -a /usr/share/zoneinfo " + src + " 2>/dev/null || mkdir " + src).isOk());
  std::string ziTar = dir_ + "/zi.tar";
  ASSERT_TRUE(sh("tar --xattrs --format=posix -cf " + ziTar + " -C " + src + " .").isOk());

  for (const std::string& t : {tar, ziTar}) {
    SCOPED_TRACE(t);
    auto l = read(t);
    ASSERT_TRUE(l.isOk()) << l.status().toString();
    std::string meta = dir_ + "/layer.erofs";
    auto img = writeErofs(l->tree, meta);
    ASSERT_TRUE(img.isOk()) << img.status().toString();
    std::string mnt = dir_ + "/mnt";
    ASSERT_TRUE(makeDirs(mnt).isOk());
    std::string opts = "device=" + data_;
    if (::mount(meta.c_str(), mnt.c_str(), "erofs", MS_RDONLY, opts.c_str()) != 0) {
      int err = errno;
      if (err == EPERM || err == ENODEV || err == ENOTBLK) {
        GTEST_SKIP() << "cannot mount erofs here: " << strerror(err);
      }
      FAIL() << "mount erofs: " << strerror(err);
    }
    Description got = describeDir(mnt);
    ::umount2(mnt.c_str(), MNT_DETACH);
    EXPECT_GT(got.size(), 15u);
    std::string x = dir_ + "/x";
    ASSERT_TRUE(makeDirs(x, 0755).isOk());
    ::umask(022);
    Status st = runCommand({"tar", "--numeric-owner", "--xattrs", "--xattrs-include=*",
                            "--same-permissions", "--same-owner", "-xf", t, "-C", x});
    ASSERT_TRUE(st.isOk()) << st.toString();
    ASSERT_TRUE(translateWhiteouts(x).isOk());
    expectSame(describeDir(x), got);
    ASSERT_TRUE(removeTree(x).isOk());
  }
}

// ---- chunks shared with other layers ---------------------------------------------------

// A chunk table over other layers' stored chunks, as the platform keeps one.
class FakeChunkSource : public ChunkSource {
 public:
  void add(const TarLayer& l) {
    for (const auto& c : l.stored) {
      table.emplace(c.sha + "/" + std::to_string(c.length),
                    Location{l.dataDigest, l.tree.dataSize, c.block});
    }
  }
  Result<std::optional<Location>> find(const std::string& sha, uint64_t length) override {
    ++lookups;
    if (!fail.isOk()) return fail;
    auto it = table.find(sha + "/" + std::to_string(length));
    if (it == table.end()) return std::optional<Location>();
    return std::optional{it->second};
  }
  std::map<std::string, Location> table;
  int lookups = 0;
  Status fail;
};

TEST_F(TarStreamTest, SharesChunksWithOtherLayersAndMountsWithTheirBlobs) {
  std::string big = randomBytes(300 << 10, 40), small = randomBytes(5000, 41),
              fresh = randomBytes(200 << 10, 42);
  std::string tarA = dir_ + "/a.tar", tarB = dir_ + "/b.tar";
  writeTar(tarA, {file("big", big), file("small", small), file("tiny", "hi")});
  // B: the same bytes under other names and times, so no layer is shared.
  Ent bigB = file("copy/big", big);
  bigB.mtime = 1;
  writeTar(tarB, {bigB, file("copy/small", small), file("copy/tiny", "hi"), file("fresh", fresh),
                  file("twice", big)});
  auto a = read(tarA);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(a->stored.size(), 5u);  // big x3, small, tiny
  std::string dataA = dir_ + "/a.data";
  ASSERT_EQ(::rename(data_.c_str(), dataA.c_str()), 0);
  FakeChunkSource src;
  src.add(*a);

  TarLayerOptions opts;
  opts.shared = &src;
  auto b = read(tarB, kDetectCompression, opts);
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  const FsTree& t = b->tree;
  ASSERT_EQ(t.extraBlobs.size(), 1u);
  EXPECT_EQ(t.extraBlobs[0].digest, a->dataDigest);
  EXPECT_EQ(t.extraBlobs[0].size, a->tree.dataSize);
  const FsInode* bigA = at(a->tree, "big");
  for (const char* n : {"copy/big", "twice"}) {
    SCOPED_TRACE(n);
    EXPECT_EQ(at(t, n)->chunks, bigA->chunks);
    EXPECT_EQ(at(t, n)->chunkDevices, (std::vector<uint8_t>{1, 1, 1}));
  }
  EXPECT_EQ(at(t, "copy/small")->chunks, at(a->tree, "small")->chunks);
  EXPECT_EQ(at(t, "copy/tiny")->chunkDevices, std::vector<uint8_t>{1});
  EXPECT_TRUE(at(t, "fresh")->chunkDevices.empty());
  // Only `fresh` is stored; `twice` is found in this layer's own map, not
  // looked up again.
  EXPECT_EQ(b->stats.chunksWritten, 2);
  EXPECT_EQ(b->stats.chunksShared, 8);
  EXPECT_EQ(b->stats.bytesShared, int64_t(2 * big.size() + small.size() + 2));
  EXPECT_EQ(src.lookups, 7);  // big x3, small, tiny, fresh x2
  EXPECT_EQ(t.dataSize, 200u << 10);  // fresh: 128K + 72K
  EXPECT_EQ(b->stored.size(), 2u);

  // The kernel reads B with A's blob as its second device.
  std::string meta = dir_ + "/b.erofs";
  auto img = writeErofs(t, meta);
  ASSERT_TRUE(img.isOk()) << img.status().toString();
  std::string mnt = dir_ + "/mnt";
  ASSERT_TRUE(makeDirs(mnt).isOk());
  std::string mopts = "device=" + data_ + ",device=" + dataA;
  if (::mount(meta.c_str(), mnt.c_str(), "erofs", MS_RDONLY, mopts.c_str()) != 0) {
    int err = errno;
    if (err == EPERM || err == ENODEV || err == ENOTBLK) {
      GTEST_SKIP() << "cannot mount erofs here: " << strerror(err);
    }
    FAIL() << "mount erofs: " << strerror(err);
  }
  std::map<std::string, std::string> want = {{"copy/big", big},    {"copy/small", small},
                                             {"copy/tiny", "hi"},  {"fresh", fresh},
                                             {"twice", big}};
  for (auto& [n, w] : want) EXPECT_TRUE(slurp(mnt + "/" + n) == w) << n;
  ::umount2(mnt.c_str(), MNT_DETACH);

  // Without the second device the mount is refused (or its reads fail):
  // the layer names the blob it needs.
  if (::mount(meta.c_str(), mnt.c_str(), "erofs", MS_RDONLY, ("device=" + data_).c_str()) == 0) {
    int fd = ::open((mnt + "/copy/big").c_str(), O_RDONLY | O_CLOEXEC);
    char c;
    EXPECT_TRUE(fd < 0 || ::pread(fd, &c, 1, 0) < 0);
    if (fd >= 0) ::close(fd);
    ::umount2(mnt.c_str(), MNT_DETACH);
  }

  // C reads from both: device 2 is B's blob (found first), device 3 A's.
  std::string dataB = dir_ + "/b.data";
  ASSERT_EQ(::rename(data_.c_str(), dataB.c_str()), 0);
  src.add(*b);
  std::string tarC = dir_ + "/c.tar", mine = randomBytes(10000, 43);
  writeTar(tarC, {file("x/fresh", fresh), file("x/big", big), file("x/mine", mine)});
  auto c = read(tarC, kDetectCompression, opts);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  ASSERT_EQ(c->tree.extraBlobs.size(), 2u);
  EXPECT_EQ(c->tree.extraBlobs[0].digest, b->dataDigest);
  EXPECT_EQ(c->tree.extraBlobs[1].digest, a->dataDigest);
  EXPECT_EQ(at(c->tree, "x/fresh")->chunkDevices, (std::vector<uint8_t>{1, 1}));
  EXPECT_EQ(at(c->tree, "x/big")->chunkDevices, (std::vector<uint8_t>{2, 2, 2}));
  // What each layer reads of its extra blobs (gc keeps those chunks): B
  // reads every chunk A stored; C reads B's `fresh` and A's `big`, not
  // A's `small` or `tiny`.
  auto blocksOf = [](const TarLayer& l, const std::set<uint32_t>& only) {
    BlockRanges r;
    for (const auto& st : l.stored) {
      if (only.empty() || only.count(st.block)) r.add(st.block, (st.length + 4095) / 4096);
    }
    return r;
  };
  auto readsB = extraReadsOf(b->tree);
  ASSERT_EQ(readsB.size(), 1u);
  EXPECT_EQ(readsB[0], blocksOf(*a, {})) << readsB[0].format();
  auto readsC = extraReadsOf(c->tree);
  ASSERT_EQ(readsC.size(), 2u);
  EXPECT_EQ(readsC[0], blocksOf(*b, {})) << readsC[0].format();
  std::set<uint32_t> bigChunks(bigA->chunks.begin(), bigA->chunks.end());
  EXPECT_EQ(readsC[1], blocksOf(*a, bigChunks)) << readsC[1].format();
  EXPECT_FALSE(readsC[1].intersects(at(a->tree, "small")->chunks[0], 1));
  EXPECT_TRUE(extraReadsOf(a->tree).empty());
  std::string metaC = dir_ + "/c.erofs";
  ASSERT_TRUE(writeErofs(c->tree, metaC).isOk());
  std::string optsC = "device=" + data_ + ",device=" + dataB + ",device=" + dataA;
  ASSERT_EQ(::mount(metaC.c_str(), mnt.c_str(), "erofs", MS_RDONLY, optsC.c_str()), 0)
      << strerror(errno);
  EXPECT_TRUE(slurp(mnt + "/x/fresh") == fresh);
  EXPECT_TRUE(slurp(mnt + "/x/big") == big);
  EXPECT_TRUE(slurp(mnt + "/x/mine") == mine);
  ::umount2(mnt.c_str(), MNT_DETACH);
}

TEST_F(TarStreamTest, SharedChunksStopAtTheDeviceLimitAndErrorsFailTheLayer) {
  // Each file's bytes live in a blob of their own elsewhere: past
  // kMaxExtraBlobs distinct blobs, chunks are stored here.
  std::vector<Ent> ents;
  FakeChunkSource src;
  for (size_t i = 0; i < kMaxExtraBlobs + 2; ++i) {
    std::string bytes = randomBytes(8192, uint32_t(50 + i));
    ents.push_back(file("f" + std::to_string(i), bytes));
    src.table.emplace(sha256Hex(bytes) + "/8192",
                      ChunkSource::Location{"sha256:" + std::string(63, 'a') + char('a' + i),
                                            1 << 20, uint32_t(i)});
  }
  std::string tar = dir_ + "/t.tar";
  writeTar(tar, ents);
  TarLayerOptions opts;
  opts.shared = &src;
  auto l = read(tar, kDetectCompression, opts);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  EXPECT_EQ(l->tree.extraBlobs.size(), kMaxExtraBlobs);
  EXPECT_EQ(l->stats.chunksShared, int64_t(kMaxExtraBlobs));
  EXPECT_EQ(l->stats.chunksWritten, 2);
  EXPECT_EQ(at(l->tree, "f0")->chunks, std::vector<uint32_t>{0});
  EXPECT_EQ(at(l->tree, "f0")->chunkDevices, std::vector<uint8_t>{1});
  EXPECT_TRUE(at(l->tree, "f9")->chunkDevices.empty());
  auto img = writeErofs(l->tree, dir_ + "/l.erofs");
  EXPECT_TRUE(img.isOk()) << img.status().toString();

  // Short chunks below minSharedChunk are not looked up.
  src.lookups = 0;
  opts.minSharedChunk = 16384;
  ASSERT_TRUE(read(tar, kDetectCompression, opts).isOk());
  EXPECT_EQ(src.lookups, 0);

  src.fail = Status(Code::kUnavailable, "chunk table down");
  opts.minSharedChunk = 0;
  auto bad = read(tar, kDetectCompression, opts);
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().code(), Code::kUnavailable);
  EXPECT_NE(::access(data_.c_str(), F_OK), 0);
}

// ---- limits and bad input ----------------------------------------------------------------

TEST_F(TarStreamTest, BadTarsAndLimits) {
  std::string tar = dir_ + "/t.tar";
  std::vector<Ent> ents;
  for (int i = 0; i < 10; ++i) ents.push_back(file("f" + std::to_string(i), "x"));
  writeTar(tar, ents);
  TarLayerOptions opts;
  opts.maxEntries = 5;
  auto r = read(tar, kDetectCompression, opts);
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted) << r.status().toString();
  EXPECT_NE(::access(data_.c_str(), F_OK), 0);
  writeTar(tar, {file("a/b/c/d/e/f/g", "deep")});  // 6 implicit directories
  r = read(tar, kDetectCompression, opts);
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted) << r.status().toString();

  Ent big = file("x", "1");
  big.xattrs = {{"user.big", std::string(70000, 'v')}};
  writeTar(tar, {big});
  EXPECT_EQ(read(tar).status().code(), Code::kInvalidArgument);

  TarLayerOptions small;
  small.maxFileBytes = 1000;
  writeTar(tar, {file("x", std::string(600, 'a')), file("y", std::string(600, 'b'))});
  EXPECT_EQ(read(tar, kDetectCompression, small).status().code(), Code::kResourceExhausted);

  // Truncated inside a file's data; not a tar at all; a bad header checksum.
  writeTar(tar, {file("x", randomBytes(100000, 5))});
  std::string bytes = slurp(tar);
  ASSERT_TRUE(writeFileAtomic(tar, bytes.substr(0, 50000)).isOk());
  r = read(tar);
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
  ASSERT_TRUE(writeFileAtomic(tar, randomBytes(20000, 6)).isOk());
  r = read(tar);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().toString();
  writeTar(tar, {file("a", "1"), file("b", "2")});
  bytes = slurp(tar);
  size_t second = std::string::npos;  // the ustar header of "b"
  for (size_t off = 0; off + 512 <= bytes.size(); off += 512) {
    if (bytes.compare(off, 2, std::string("b\0", 2)) == 0 &&
        bytes.compare(off + 257, 5, "ustar") == 0) {
      second = off;
    }
  }
  ASSERT_NE(second, std::string::npos);
  bytes[second + 148] ^= 1;  // its checksum field
  ASSERT_TRUE(writeFileAtomic(tar, bytes).isOk());
  r = read(tar);
  EXPECT_FALSE(r.isOk());
  EXPECT_TRUE(r.status().code() == Code::kDataLoss) << r.status().toString();

  // A corrupt gzip layer: kDataLoss, no data blob left.
  writeTar(tar, ents);
  ASSERT_TRUE(sh("gzip -c " + tar + " > " + tar + ".gz").isOk());
  bytes = slurp(tar + ".gz");
  bytes[bytes.size() / 2] ^= 0x40;
  ASSERT_TRUE(writeFileAtomic(tar + ".gz", bytes).isOk());
  r = read(tar + ".gz");
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().toString();
  EXPECT_NE(::access(data_.c_str(), F_OK), 0);
}

TEST_F(TarStreamTest, EmptyLayers) {
  ASSERT_TRUE(writeFileAtomic(dir_ + "/zero", "").isOk());
  ASSERT_TRUE(writeFileAtomic(dir_ + "/blocks", std::string(1024, '\0')).isOk());
  ASSERT_TRUE(sh("gzip -c " + dir_ + "/blocks > " + dir_ + "/blocks.gz").isOk());
  for (const char* f : {"zero", "blocks", "blocks.gz"}) {
    auto l = read(dir_ + "/" + f);
    ASSERT_TRUE(l.isOk()) << f << ": " << l.status().toString();
    EXPECT_EQ(l->tree.inodes.size(), 1u);
    EXPECT_EQ(l->tree.inodes[0].mode, uint32_t(S_IFDIR | 0755));
    EXPECT_EQ(l->tree.dataSize, 0u);
    EXPECT_EQ(l->chunks.chunkCount(), 0);
    EXPECT_EQ(l->owners.entries, 1);
    expectIndexMatches(*l);
  }
}

}  // namespace
}  // namespace dsec::image
