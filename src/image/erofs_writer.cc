#include "image/erofs_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/util.h"

namespace dsec::image {
namespace {

// On-disk constants, from the kernel's fs/erofs/erofs_fs.h.
constexpr uint32_t kBlockSize = 4096;
constexpr uint8_t kBlockBits = 12;
static_assert(kBlockSize == static_cast<uint32_t>(kFsBlockSize));
constexpr uint32_t kMagic = 0xE0F5E1E2;
constexpr uint64_t kSuperOffset = 1024;
constexpr uint64_t kSuperSize = 128;
constexpr uint64_t kDevtSlotSize = 128;
// The device table right after the superblock (where mkfs.erofs 1.5 puts
// its one slot), a slot per data blob, the inodes right after that.
constexpr uint16_t kDevtSlotOff = (kSuperOffset + kSuperSize) / kDevtSlotSize;
uint64_t firstInodeOffset(size_t devices) { return (kDevtSlotOff + devices) * kDevtSlotSize; }
constexpr uint32_t kNullAddr = 0xffffffff;
constexpr uint32_t kCompatSbChksum = 0x1;
constexpr uint32_t kCompatMtime = 0x2;
constexpr uint32_t kIncompatChunkedFile = 0x4;
constexpr uint32_t kIncompatDeviceTable = 0x8;
constexpr uint8_t kLayoutFlatPlain = 0;
constexpr uint8_t kLayoutFlatInline = 2;
constexpr uint8_t kLayoutChunkBased = 4;
constexpr uint16_t kChunkFormatIndexes = 0x20;
constexpr uint32_t kCompactInodeSize = 32;
constexpr uint32_t kExtendedInodeSize = 64;
constexpr uint64_t kNidUnit = 32;  // inodes are 32-byte aligned; nid = offset / 32
constexpr uint32_t kChunkIndexSize = 8;
constexpr uint32_t kDirentSize = 12;
constexpr uint32_t kXattrHeaderSize = 12;
constexpr uint32_t kXattrEntryHeaderSize = 4;
constexpr size_t kMaxNameLen = 255;
constexpr size_t kMaxSymlinkLen = 4095;  // PATH_MAX - 1
constexpr size_t kMaxXattrValue = 65535;
constexpr size_t kMaxGaps = 256;
constexpr size_t kFlushBytes = 1 << 20;

enum FileType : uint8_t {
  kFtUnknown = 0,
  kFtRegular = 1,
  kFtDir = 2,
  kFtChr = 3,
  kFtBlk = 4,
  kFtFifo = 5,
  kFtSock = 6,
  kFtSymlink = 7,
};

uint8_t fileType(uint32_t mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return kFtRegular;
    case S_IFDIR:
      return kFtDir;
    case S_IFCHR:
      return kFtChr;
    case S_IFBLK:
      return kFtBlk;
    case S_IFIFO:
      return kFtFifo;
    case S_IFSOCK:
      return kFtSock;
    case S_IFLNK:
      return kFtSymlink;
    default:
      return kFtUnknown;
  }
}

uint64_t roundUp(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

void put16(char* p, uint16_t v) {
  p[0] = static_cast<char>(v);
  p[1] = static_cast<char>(v >> 8);
}
void put32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void put64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}

// What the writer decided for one reachable inode.
struct Plan {
  uint64_t off = 0;     // byte offset of the on-disk inode in the image
  uint64_t size = 0;    // i_size (derived for directories and symlinks)
  uint32_t parent = 0;  // directories: the parent's index (the root: itself)
  uint32_t nlink = 0;
  uint32_t ino = 0;              // 1 + breadth-first position; 0: not reached (yet)
  uint32_t dataBlk = kNullAddr;  // directories, symlinks: first block of data
  uint32_t xattrSize = 0;        // bytes of the inline xattr body, 0: none
  uint8_t layout = kLayoutFlatPlain;
  bool extended = false;

  uint64_t nid() const { return off / kNidUnit; }
  uint32_t inodeSize() const { return extended ? kExtendedInodeSize : kCompactInodeSize; }
  // Directories and symlinks: the bytes kept inline after the inode.
  uint32_t tailSize() const {
    return layout == kLayoutFlatInline ? static_cast<uint32_t>(size % kBlockSize) : 0;
  }
  // Directories and symlinks: the blocks of data outside the inode.
  uint64_t dataBlocks() const {
    return layout == kLayoutFlatInline ? size / kBlockSize : roundUp(size, kBlockSize) / kBlockSize;
  }
};

Status badInode(uint32_t index, std::string field, const std::string& message) {
  return invalidArg(std::move(field), "inode " + std::to_string(index) + ": " + message);
}

// Calls fn(name, index) for the entries of a directory in on-disk order: its
// children with "." (self) and ".." (parent) merged in, all sorted bytewise
// (the kernel's lookup binary-searches across blocks, so "-x" comes before ".").
template <typename Fn>
void forEachDirent(const FsInode& dir, uint32_t self, uint32_t parent, Fn&& fn) {
  static constexpr std::string_view kDots[2] = {".", ".."};
  const uint32_t targets[2] = {self, parent};
  int dots = 0;
  for (const auto& [name, index] : dir.children) {
    while (dots < 2 && kDots[dots] < std::string_view(name)) {
      fn(kDots[dots], targets[dots]);
      ++dots;
    }
    fn(std::string_view(name), index);
  }
  for (; dots < 2; ++dots) fn(kDots[dots], targets[dots]);
}

// A directory's i_size: its dirent blocks, each holding as many
// {dirent, name} as fit, all but the last counted whole (as mkfs.erofs does).
uint64_t dirSize(const FsInode& dir) {
  uint64_t size = 0;
  uint32_t used = 0;
  forEachDirent(dir, 0, 0, [&](std::string_view name, uint32_t) {
    uint32_t len = kDirentSize + static_cast<uint32_t>(name.size());
    if (used + len > kBlockSize) {
      size += kBlockSize;
      used = 0;
    }
    used += len;
  });
  return size + used;
}

// Calls emit(blockNumber, bytes) for each dirent block of directory `d`: all
// but the last padded to a block, the last only as long as it is used.
template <typename Emit>
void buildDirBlocks(const FsTree& tree, const std::vector<Plan>& plan, uint32_t d,
                    std::string& block, Emit&& emit) {
  std::vector<std::pair<std::string_view, uint32_t>> ents;
  uint32_t used = 0;
  uint32_t blockNo = 0;
  auto flush = [&](bool last) {
    block.assign(last ? used : kBlockSize, '\0');
    uint32_t nameOff = static_cast<uint32_t>(ents.size()) * kDirentSize;
    char* p = block.data();
    for (size_t k = 0; k < ents.size(); ++k) {
      const auto& [name, index] = ents[k];
      put64(p + k * kDirentSize, plan[index].nid());
      put16(p + k * kDirentSize + 8, static_cast<uint16_t>(nameOff));
      p[k * kDirentSize + 10] = static_cast<char>(fileType(tree.inodes[index].mode));
      std::memcpy(p + nameOff, name.data(), name.size());
      nameOff += static_cast<uint32_t>(name.size());
    }
    emit(blockNo++, std::string_view(block));
    ents.clear();
    used = 0;
  };
  forEachDirent(tree.inodes[d], d, plan[d].parent, [&](std::string_view name, uint32_t index) {
    uint32_t len = kDirentSize + static_cast<uint32_t>(name.size());
    if (used + len > kBlockSize) flush(false);
    ents.emplace_back(name, index);
    used += len;
  });
  flush(true);
}

struct Xattr {
  uint8_t index;
  std::string_view suffix;
  std::string_view value;
};

// Splits full xattr names into EROFS name indexes and suffixes, sorted.
Result<std::vector<Xattr>> parseXattrs(const FsInode& in, uint32_t index) {
  struct Prefix {
    std::string_view name;
    uint8_t index;
    bool exact;
  };
  static constexpr Prefix kPrefixes[] = {
      {"user.", 1, false},
      {"system.posix_acl_access", 2, true},
      {"system.posix_acl_default", 3, true},
      {"trusted.", 4, false},
      {"security.", 6, false},
  };
  std::vector<Xattr> out;
  out.reserve(in.xattrs.size());
  for (const auto& [name, value] : in.xattrs) {
    const Prefix* match = nullptr;
    for (const auto& p : kPrefixes) {
      if (p.exact ? name == p.name : (name.size() > p.name.size() && startsWith(name, p.name))) {
        match = &p;
        break;
      }
    }
    if (!match) {
      return badInode(index, "xattrs",
                      "xattr \"" + name +
                          "\" has no prefix EROFS can store (user., trusted., "
                          "security., system.posix_acl_access/default)");
    }
    std::string_view suffix = std::string_view(name).substr(match->name.size());
    if (suffix.size() > kMaxNameLen) {
      return badInode(index, "xattrs", "xattr name \"" + name + "\" is too long");
    }
    if (value.size() > kMaxXattrValue) {
      return badInode(index, "xattrs", "xattr \"" + name + "\" has a value over 65535 bytes");
    }
    out.push_back({match->index, suffix, value});
  }
  auto key = [](const Xattr& x) { return std::pair(x.index, x.suffix); };
  std::sort(out.begin(), out.end(),
            [&](const Xattr& a, const Xattr& b) { return key(a) < key(b); });
  for (size_t k = 1; k < out.size(); ++k) {
    if (key(out[k - 1]) == key(out[k])) {
      return badInode(index, "xattrs",
                      "xattr \"" + std::string(out[k].suffix) + "\" is duplicated");
    }
  }
  return out;
}

uint32_t xattrEntrySize(const Xattr& x) {
  return static_cast<uint32_t>(
      roundUp(kXattrEntryHeaderSize + x.suffix.size() + x.value.size(), 4));
}

// Writes the image sequentially (offsets only grow), zero-filling between
// records, and keeps a copy of block 0 for the superblock checksum.
class ImageWriter {
 public:
  ImageWriter(int fd, const std::string& path) : fd_(fd), path_(path) {}

  Status put(uint64_t off, std::string_view bytes) {
    uint64_t end = bufStart_ + buf_.size();
    if (off < end)
      return internalError("erofs writer: overlapping records at " + std::to_string(off));
    if (off < kBlockSize) {
      std::memcpy(block0_.data() + off, bytes.data(),
                  std::min<uint64_t>(bytes.size(), kBlockSize - off));
    }
    if (off - end > kFlushBytes) {
      RETURN_IF_ERROR(flush());
      bufStart_ = off;
    } else {
      buf_.append(off - end, '\0');
    }
    buf_.append(bytes);
    if (buf_.size() >= kFlushBytes) RETURN_IF_ERROR(flush());
    return Status::ok();
  }

  Status flush() {
    size_t done = 0;
    while (done < buf_.size()) {
      ssize_t n = ::pwrite(fd_, buf_.data() + done, buf_.size() - done,
                           static_cast<off_t>(bufStart_ + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return sysError("write " + path_);
      }
      done += static_cast<size_t>(n);
    }
    bufStart_ += buf_.size();
    buf_.clear();
    return Status::ok();
  }

  std::array<char, kBlockSize>& block0() { return block0_; }

 private:
  int fd_;
  const std::string& path_;
  std::string buf_;
  uint64_t bufStart_ = 0;
  std::array<char, kBlockSize> block0_{};
};

// Places records in the inode area: at the cursor, or in a gap an earlier
// block-start left, so records that must not cross a block (inline data)
// waste little.
class InodeArea {
 public:
  explicit InodeArea(uint64_t start) : pos_(start) {}
  uint64_t place(uint64_t len, bool withinBlock) {
    uint64_t need = roundUp(len, kNidUnit);
    for (size_t k = 0; k < gaps_.size(); ++k) {
      if (gaps_[k].second >= need) {
        uint64_t off = gaps_[k].first;
        gaps_[k].first += need;
        gaps_[k].second -= need;
        if (gaps_[k].second < kNidUnit) gaps_.erase(gaps_.begin() + static_cast<ptrdiff_t>(k));
        return off;
      }
    }
    uint64_t inBlock = pos_ % kBlockSize;
    if (withinBlock && inBlock + len > kBlockSize) {
      if (gaps_.size() < kMaxGaps) gaps_.emplace_back(pos_, kBlockSize - inBlock);
      pos_ = roundUp(pos_, kBlockSize);
    }
    uint64_t off = pos_;
    pos_ += need;
    return off;
  }
  uint64_t end() const { return pos_; }

 private:
  uint64_t pos_;
  std::vector<std::pair<uint64_t, uint64_t>> gaps_;  // {offset, length}, within one block
};

// Checks the entries of directory `d` and walks them breadth first: assigns
// ino (the placement order), parents and link counts.
Status walkTree(const FsTree& tree, std::vector<Plan>& plan, std::vector<uint32_t>& order) {
  const size_t n = tree.inodes.size();
  plan[0].ino = 1;
  plan[0].parent = 0;
  plan[0].nlink = 2;
  order.push_back(0);
  for (size_t q = 0; q < order.size(); ++q) {
    const uint32_t d = order[q];
    const FsInode& dir = tree.inodes[d];
    if (!S_ISDIR(dir.mode)) continue;
    for (size_t k = 0; k < dir.children.size(); ++k) {
      const auto& [name, c] = dir.children[k];
      std::string what = "entry \"" + name + "\" ";
      if (name.empty() || name == "." || name == ".." || name.size() > kMaxNameLen ||
          name.find('/') != std::string::npos || name.find('\0') != std::string::npos) {
        return badInode(d, "children", what + "is not a valid name");
      }
      if (k > 0 && !(dir.children[k - 1].first < name)) {
        return badInode(d, "children", what + "is out of order or duplicated");
      }
      if (c >= n) return badInode(d, "children", what + "names missing inode " + std::to_string(c));
      if (c == 0) return badInode(d, "children", what + "names the root");
      Plan& p = plan[c];
      const bool isDir = S_ISDIR(tree.inodes[c].mode);
      if (p.ino != 0 && isDir) {
        return badInode(
            d, "children",
            what + "names directory " + std::to_string(c) + ", already named by another entry");
      }
      if (p.ino == 0) {
        if (order.size() >= kNullAddr) return invalidArg("inodes", "too many inodes");
        p.ino = static_cast<uint32_t>(order.size() + 1);
        order.push_back(c);
        if (isDir) {
          p.parent = d;
          p.nlink = 2;
        }
      }
      if (isDir) {
        ++plan[d].nlink;
      } else {
        ++p.nlink;
      }
    }
  }
  return Status::ok();
}

// The most common (mtime, nsec) among the reachable inodes, non-negative
// only: the epoch compact inodes inherit their mtime from.
std::pair<int64_t, uint32_t> pickEpoch(const FsTree& tree, const std::vector<uint32_t>& order) {
  std::vector<std::pair<int64_t, uint32_t>> times;
  times.reserve(order.size());
  for (uint32_t i : order) {
    const FsInode& in = tree.inodes[i];
    if (in.mtime >= 0) times.emplace_back(in.mtime, in.mtimeNsec);
  }
  std::sort(times.begin(), times.end());
  std::pair<int64_t, uint32_t> best{0, 0};
  size_t bestCount = 0;
  for (size_t k = 0; k < times.size();) {
    size_t e = k;
    while (e < times.size() && times[e] == times[k]) ++e;
    if (e - k > bestCount) {
      bestCount = e - k;
      best = times[k];
    }
    k = e;
  }
  return best;
}

// Checks one inode and decides its size, layout and xattr size.
Status planInode(const FsTree& tree, uint32_t i, const ErofsWriterOptions& opts,
                 std::pair<int64_t, uint32_t> epoch, Plan& p) {
  const FsInode& in = tree.inodes[i];
  if ((in.mode & ~static_cast<uint32_t>(S_IFMT | 07777)) != 0 || fileType(in.mode) == kFtUnknown) {
    return badInode(i, "mode",
                    "mode " + std::to_string(in.mode) + " is not a file type and permissions");
  }
  if (in.mtimeNsec >= 1000000000u) return badInode(i, "mtimeNsec", "nanoseconds over 999999999");
  ASSIGN_OR_RETURN(std::vector<Xattr> xattrs, parseXattrs(in, i));
  uint64_t xsize = 0;
  if (!xattrs.empty()) {
    xsize = kXattrHeaderSize;
    for (const auto& x : xattrs) xsize += xattrEntrySize(x);
    // i_xattr_icount is 16 bits: (xsize - 12) / 4 + 1 of them.
    if ((xsize - kXattrHeaderSize) / 4 + 1 > 0xffff) {
      return badInode(i, "xattrs", "xattrs take over 256 KiB");
    }
  }
  p.xattrSize = static_cast<uint32_t>(xsize);
  switch (in.mode & S_IFMT) {
    case S_IFREG: {
      uint64_t want = in.size == 0 ? 0 : (in.size - 1) / opts.chunkSize + 1;
      if (in.chunks.size() != want) {
        return badInode(i, "chunks",
                        std::to_string(in.chunks.size()) + " chunks for " +
                            std::to_string(in.size) + " bytes, want " + std::to_string(want));
      }
      if (!in.chunkDevices.empty() && in.chunkDevices.size() != in.chunks.size()) {
        return badInode(i, "chunkDevices",
                        std::to_string(in.chunkDevices.size()) + " devices for " +
                            std::to_string(in.chunks.size()) + " chunks");
      }
      for (size_t k = 0; k < in.chunks.size(); ++k) {
        if (in.chunks[k] == kHoleChunk) continue;
        const uint8_t dev = in.chunkDevices.empty() ? 0 : in.chunkDevices[k];
        if (dev > tree.extraBlobs.size()) {
          return badInode(i, "chunkDevices",
                          "chunk " + std::to_string(k) + " names blob " + std::to_string(dev) +
                              " of " + std::to_string(tree.extraBlobs.size()) + " extra blobs");
        }
        const uint64_t blobSize = dev == 0 ? tree.dataSize : tree.extraBlobs[dev - 1].size;
        uint64_t len = std::min<uint64_t>(opts.chunkSize, in.size - k * opts.chunkSize);
        if (static_cast<uint64_t>(in.chunks[k]) * kBlockSize + roundUp(len, kBlockSize) >
            roundUp(blobSize, kBlockSize)) {
          return badInode(i, "chunks",
                          "chunk " + std::to_string(k) + " at block " +
                              std::to_string(in.chunks[k]) + " lies beyond the " +
                              (dev == 0 ? std::string("data blob's ")
                                        : "extra blob " + std::to_string(dev) + "'s ") +
                              std::to_string(blobSize) + " bytes");
        }
      }
      p.size = in.size;
      p.layout = in.size == 0 ? kLayoutFlatPlain : kLayoutChunkBased;
      break;
    }
    case S_IFDIR:
      p.size = dirSize(in);
      break;
    case S_IFLNK:
      if (in.symlink.empty() || in.symlink.size() > kMaxSymlinkLen) {
        return badInode(
            i, "symlink",
            "symlink target of " + std::to_string(in.symlink.size()) + " bytes (want 1 to 4095)");
      }
      p.size = in.symlink.size();
      break;
    default:
      p.size = 0;
      break;
  }
  p.extended = !opts.compactInodes || in.uid > 0xffff || in.gid > 0xffff || p.nlink > 0xffff ||
               p.size > 0xffffffffu || in.mtime != epoch.first || in.mtimeNsec != epoch.second;
  if (S_ISDIR(in.mode) || S_ISLNK(in.mode)) {
    // Tail-pack the last partial block after the inode when all fits a block.
    uint64_t tail = p.size % kBlockSize;
    p.layout = tail != 0 && p.inodeSize() + p.xattrSize + tail <= kBlockSize ? kLayoutFlatInline
                                                                             : kLayoutFlatPlain;
  }
  return Status::ok();
}

// Bytes of an inode's record: inode, xattrs, then chunk indexes (8-aligned)
// or inline data.
uint64_t recordSize(const FsTree& tree, uint32_t i, const Plan& p) {
  uint64_t len = p.inodeSize() + p.xattrSize;
  if (p.layout == kLayoutChunkBased) {
    return roundUp(len, kChunkIndexSize) + kChunkIndexSize * tree.inodes[i].chunks.size();
  }
  return len + p.tailSize();
}

uint32_t chunkBits(uint32_t chunkSize) {
  uint32_t bits = 0;
  while ((1u << bits) < chunkSize) ++bits;
  return bits;
}

// Serialises inode `i`'s record into `rec`.
void encodeRecord(const FsTree& tree, const std::vector<Plan>& plan, uint32_t i,
                  const ErofsWriterOptions& opts, std::string& rec, std::string& scratch) {
  const FsInode& in = tree.inodes[i];
  const Plan& p = plan[i];
  rec.assign(recordSize(tree, i, p), '\0');
  char* r = rec.data();
  uint32_t iu = 0;
  switch (in.mode & S_IFMT) {
    case S_IFREG:
      if (p.layout == kLayoutChunkBased) {
        iu = (chunkBits(opts.chunkSize) - kBlockBits) | kChunkFormatIndexes;
      }
      break;
    case S_IFDIR:
    case S_IFLNK:
      iu = p.dataBlocks() == 0 ? kNullAddr : p.dataBlk;
      break;
    case S_IFCHR:
    case S_IFBLK:
      // FsInode::rdev is glibc's makedev() cut to 32 bits, which for every
      // device Linux can name (12-bit major, 20-bit minor) is the kernel's
      // new_encode_dev() form EROFS stores.
      iu = in.rdev;
      break;
    default:
      break;
  }
  const uint16_t icount =
      p.xattrSize == 0 ? 0 : static_cast<uint16_t>((p.xattrSize - kXattrHeaderSize) / 4 + 1);
  if (p.extended) {
    put16(r + 0, static_cast<uint16_t>(1 | (p.layout << 1)));
    put16(r + 2, icount);
    put16(r + 4, static_cast<uint16_t>(in.mode));
    put64(r + 8, p.size);
    put32(r + 16, iu);
    put32(r + 20, p.ino);
    put32(r + 24, in.uid);
    put32(r + 28, in.gid);
    put64(r + 32, static_cast<uint64_t>(in.mtime));
    put32(r + 40, in.mtimeNsec);
    put32(r + 44, p.nlink);
  } else {
    put16(r + 0, static_cast<uint16_t>(p.layout << 1));
    put16(r + 2, icount);
    put16(r + 4, static_cast<uint16_t>(in.mode));
    put16(r + 6, static_cast<uint16_t>(p.nlink));
    put32(r + 8, static_cast<uint32_t>(p.size));
    // 12: i_mtime, seconds after the epoch on kernels from 6.15, reserved
    // before: 0 on both, as the inode's mtime is the epoch.
    put32(r + 16, iu);
    put32(r + 20, p.ino);
    put16(r + 24, static_cast<uint16_t>(in.uid));
    put16(r + 26, static_cast<uint16_t>(in.gid));
  }
  uint64_t pos = p.inodeSize();
  if (p.xattrSize != 0) {
    // The ibody header (no name filter, no shared xattrs) is all zeros.
    pos += kXattrHeaderSize;
    auto xattrs = parseXattrs(in, i);  // already checked by planInode
    for (const auto& x : *xattrs) {
      r[pos] = static_cast<char>(x.suffix.size());
      r[pos + 1] = static_cast<char>(x.index);
      put16(r + pos + 2, static_cast<uint16_t>(x.value.size()));
      std::memcpy(r + pos + 4, x.suffix.data(), x.suffix.size());
      std::memcpy(r + pos + 4 + x.suffix.size(), x.value.data(), x.value.size());
      pos += xattrEntrySize(x);
    }
  }
  if (p.layout == kLayoutChunkBased) {
    pos = roundUp(pos, kChunkIndexSize);
    for (size_t k = 0; k < in.chunks.size(); ++k) {
      const uint32_t blk = in.chunks[k];
      // {startblk_hi (mkfs 1.5: advise) 0, device_id, startblk_lo}: device 1
      // is the layer's own data blob, 2.. the extra blobs.
      const uint16_t dev = 1 + (in.chunkDevices.empty() ? 0 : in.chunkDevices[k]);
      put16(r + pos, 0);
      put16(r + pos + 2, blk == kHoleChunk ? 1 : dev);
      put32(r + pos + 4, blk == kHoleChunk ? kNullAddr : blk);
      pos += kChunkIndexSize;
    }
  } else if (p.layout == kLayoutFlatInline) {
    if (S_ISLNK(in.mode)) {
      std::memcpy(r + pos, in.symlink.data(), in.symlink.size());
    } else {
      uint64_t lastBlock = p.size / kBlockSize;
      buildDirBlocks(tree, plan, i, scratch, [&](uint32_t blockNo, std::string_view bytes) {
        if (blockNo == lastBlock) std::memcpy(r + pos, bytes.data(), bytes.size());
      });
    }
  }
}

// Writes the data blocks of directories and symlinks kept outside their inodes.
Status writeDataBlocks(const FsTree& tree, const std::vector<Plan>& plan,
                       const std::vector<uint32_t>& order, ImageWriter& out) {
  std::string block, scratch;
  for (uint32_t i : order) {
    const Plan& p = plan[i];
    const FsInode& in = tree.inodes[i];
    if ((!S_ISDIR(in.mode) && !S_ISLNK(in.mode)) || p.dataBlocks() == 0) continue;
    const uint64_t base = static_cast<uint64_t>(p.dataBlk) * kBlockSize;
    if (S_ISLNK(in.mode)) {
      block.assign(in.symlink);
      block.resize(kBlockSize, '\0');
      RETURN_IF_ERROR(out.put(base, block));
      continue;
    }
    const uint64_t nblocks = p.dataBlocks();
    Status st;
    buildDirBlocks(tree, plan, i, scratch, [&](uint32_t blockNo, std::string_view bytes) {
      if (!st.isOk() || blockNo >= nblocks) return;  // the inline tail
      block.assign(bytes);
      block.resize(kBlockSize, '\0');
      st = out.put(base + static_cast<uint64_t>(blockNo) * kBlockSize, block);
    });
    RETURN_IF_ERROR(st);
  }
  return Status::ok();
}

void encodeSuperblock(char* b0, const FsTree& tree, const ErofsWriterOptions& opts,
                      uint64_t rootNid, uint64_t inodes, std::pair<int64_t, uint32_t> epoch,
                      uint32_t blocks, uint32_t dataBlocks) {
  char* sb = b0 + kSuperOffset;
  std::memset(sb, 0, kSuperSize);
  put32(sb + 0, kMagic);
  put32(sb + 8, kCompatSbChksum | kCompatMtime);
  sb[12] = static_cast<char>(kBlockBits);
  put16(sb + 14, static_cast<uint16_t>(rootNid));
  put64(sb + 16, inodes);
  put64(sb + 24, static_cast<uint64_t>(epoch.first));
  put32(sb + 32, epoch.second);
  put32(sb + 36, blocks);
  // 40: meta_blkaddr 0, 44: xattr_blkaddr 0
  std::memcpy(sb + 48, opts.uuid.data(), opts.uuid.size());
  put32(sb + 80, kIncompatChunkedFile | kIncompatDeviceTable);
  put16(sb + 86, static_cast<uint16_t>(1 + tree.extraBlobs.size()));  // extra_devices
  put16(sb + 88, kDevtSlotOff);
  // {tag[64], blocks, mapped_blkaddr 0, reserved}: the own blob, then the
  // extra blobs, each tagged with its digest's hex.
  auto slot = [&](size_t k, std::string_view tag, uint64_t blobBlocks) {
    char* p = b0 + (kDevtSlotOff + k) * kDevtSlotSize;
    std::memset(p, 0, kDevtSlotSize);
    std::memcpy(p, tag.data(), tag.size());
    put32(p + 64, static_cast<uint32_t>(blobBlocks));
  };
  slot(0, opts.deviceTag, dataBlocks);
  for (size_t k = 0; k < tree.extraBlobs.size(); ++k) {
    const auto& x = tree.extraBlobs[k];
    slot(k + 1, std::string_view(x.digest).substr(x.digest.find(':') + 1),
         roundUp(x.size, kBlockSize) / kBlockSize);
  }
  put32(sb + 4, erofsCrc32c(~0u, sb, kBlockSize - kSuperOffset));
}

}  // namespace

uint32_t erofsCrc32c(uint32_t crc, const void* data, size_t len) {
  static const std::array<uint32_t, 256> kTable = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t k = 0; k < len; ++k) crc = kTable[(crc ^ p[k]) & 0xff] ^ (crc >> 8);
  return crc;
}

Result<ErofsImageInfo> writeErofs(const FsTree& tree, const std::string& metaPath,
                                  const ErofsWriterOptions& opts) {
  if (opts.chunkSize < kBlockSize || opts.chunkSize > (1u << 31) ||
      (opts.chunkSize & (opts.chunkSize - 1)) != 0) {
    return invalidArg("chunkSize", "chunk size " + std::to_string(opts.chunkSize) +
                                       " is not a power of two from 4 KiB to 2 GiB");
  }
  if (opts.deviceTag.size() > 64) return invalidArg("deviceTag", "device tag over 64 bytes");
  if (tree.inodes.empty() || !S_ISDIR(tree.inodes[0].mode)) {
    return invalidArg("inodes", "the tree has no root directory (inodes[0])");
  }
  const uint64_t dataBlocks = roundUp(tree.dataSize, kBlockSize) / kBlockSize;
  if (dataBlocks >= kNullAddr) return invalidArg("dataSize", "data blob over 16 TiB");
  if (tree.extraBlobs.size() > kMaxExtraBlobs) {
    return invalidArg("extraBlobs", std::to_string(tree.extraBlobs.size()) +
                                        " extra blobs, more than " +
                                        std::to_string(kMaxExtraBlobs));
  }
  for (const auto& x : tree.extraBlobs) {
    std::string_view hex = std::string_view(x.digest).substr(x.digest.find(':') + 1);
    if (x.digest.find(':') == std::string::npos || hex.size() > 64) {
      return invalidArg("extraBlobs", "extra blob \"" + x.digest + "\" is not sha256:<hex>");
    }
    if (roundUp(x.size, kBlockSize) / kBlockSize >= kNullAddr) {
      return invalidArg("extraBlobs", "extra blob " + x.digest + " over 16 TiB");
    }
  }

  // Walk, check and lay out. Breadth first from the root, which comes first
  // so its nid fits the superblock's 16 bits.
  std::vector<Plan> plan(tree.inodes.size());
  std::vector<uint32_t> order;
  RETURN_IF_ERROR(walkTree(tree, plan, order));
  const auto epoch = opts.compactInodes ? pickEpoch(tree, order) : std::pair<int64_t, uint32_t>{};
  InodeArea area(firstInodeOffset(1 + tree.extraBlobs.size()));
  for (uint32_t i : order) {
    Plan& p = plan[i];
    RETURN_IF_ERROR(planInode(tree, i, opts, epoch, p));
    p.off = area.place(recordSize(tree, i, p), p.layout == kLayoutFlatInline);
  }
  if (plan[0].nid() > 0xffff) return internalError("erofs writer: root nid over 16 bits");
  uint64_t nextBlk = roundUp(area.end(), kBlockSize) / kBlockSize;
  for (uint32_t i : order) {
    Plan& p = plan[i];
    const uint32_t type = tree.inodes[i].mode & S_IFMT;
    if ((type != S_IFDIR && type != S_IFLNK) || p.dataBlocks() == 0) continue;
    if (nextBlk + p.dataBlocks() >= kNullAddr) {
      return invalidArg("inodes", "metadata over 16 TiB");
    }
    p.dataBlk = static_cast<uint32_t>(nextBlk);
    nextBlk += p.dataBlocks();
  }
  const uint64_t totalBlocks = nextBlk;

  // Write a temporary file beside metaPath, records in offset order.
  const std::string tmp = metaPath + ".tmp-" + randomHex(4);
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!fd) return sysError("create " + tmp);
  auto written = [&]() -> Status {
    ImageWriter out(fd.get(), tmp);
    std::vector<uint32_t> byOffset = order;
    std::sort(byOffset.begin(), byOffset.end(),
              [&](uint32_t a, uint32_t b) { return plan[a].off < plan[b].off; });
    std::string rec, scratch;
    for (uint32_t i : byOffset) {
      encodeRecord(tree, plan, i, opts, rec, scratch);
      RETURN_IF_ERROR(out.put(plan[i].off, rec));
    }
    std::vector<uint32_t>().swap(byOffset);
    RETURN_IF_ERROR(writeDataBlocks(tree, plan, order, out));
    RETURN_IF_ERROR(out.flush());
    if (::ftruncate(fd.get(), static_cast<off_t>(totalBlocks * kBlockSize)) != 0) {
      return sysError("truncate " + tmp);
    }
    char* b0 = out.block0().data();
    encodeSuperblock(b0, tree, opts, plan[0].nid(), order.size(), epoch,
                     static_cast<uint32_t>(totalBlocks), static_cast<uint32_t>(dataBlocks));
    if (::pwrite(fd.get(), b0, kBlockSize, 0) != static_cast<ssize_t>(kBlockSize)) {
      return sysError("write " + tmp);
    }
    if (::fsync(fd.get()) != 0) return sysError("fsync " + tmp);
    if (::close(fd.release()) != 0) return sysError("close " + tmp);
    if (::rename(tmp.c_str(), metaPath.c_str()) != 0) return sysError("rename to " + metaPath);
    return Status::ok();
  }();
  if (!written.isOk()) {
    fd.reset();
    ::unlink(tmp.c_str());
    return written;
  }
  ErofsImageInfo info;
  info.size = totalBlocks * kBlockSize;
  info.inodes = order.size();
  info.rootNid = plan[0].nid();
  return info;
}

Status setErofsDeviceTag(const std::string& metaPath, std::string_view tag) {
  if (tag.size() > 64) return invalidArg("layer", "device tag over 64 bytes");
  UniqueFd fd(::open(metaPath.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) return sysError("open " + metaPath);
  std::string b0(kBlockSize, '\0');
  ssize_t n = ::pread(fd.get(), b0.data(), b0.size(), 0);
  if (n < 0) return sysError("read " + metaPath);
  if (n != ssize_t(b0.size())) return invalidArg("layer", metaPath + " is not an EROFS image");
  auto get16 = [&](size_t off) {
    return uint16_t(uint8_t(b0[off]) | uint16_t(uint8_t(b0[off + 1])) << 8);
  };
  auto get32 = [&](size_t off) {
    return uint32_t(get16(off)) | uint32_t(get16(off + 2)) << 16;
  };
  char* sb = b0.data() + kSuperOffset;
  if (get32(kSuperOffset) != kMagic) return invalidArg("layer", metaPath + " is not an EROFS image");
  const uint16_t devices = get16(kSuperOffset + 86);
  const size_t slot = size_t(get16(kSuperOffset + 88)) * kDevtSlotSize;
  if (devices < 1 || slot < kSuperOffset + 128 || slot + kDevtSlotSize > kBlockSize) {
    return invalidArg("layer", metaPath + " has no device slot in its first block");
  }
  std::memset(b0.data() + slot, 0, 64);
  std::memcpy(b0.data() + slot, tag.data(), tag.size());
  if (get32(kSuperOffset + 8) & kCompatSbChksum) {
    put32(sb + 4, 0);
    put32(sb + 4, erofsCrc32c(~0u, sb, kBlockSize - kSuperOffset));
  }
  if (::pwrite(fd.get(), b0.data(), b0.size(), 0) != ssize_t(b0.size())) {
    return sysError("write " + metaPath);
  }
  if (::fsync(fd.get()) != 0) return sysError("fsync " + metaPath);
  return Status::ok();
}

}  // namespace dsec::image
