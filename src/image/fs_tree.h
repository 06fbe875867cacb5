// The in-memory tree of one layer, between a tar stream and an EROFS image.
//
// The streaming converter (tar_stream.h) fills an FsTree from a layer's tar as
// it arrives, appending file data straight to the layer's data blob, so the
// tree holds only metadata and, for each regular file, where its chunks lie in
// that blob. The EROFS writer (erofs_writer.h) then serialises the tree into
// the layer's metadata image, whose chunk indexes point into the data blob as
// device 1: the same pair `mkfs.erofs --chunksize=131072 --blobdev=` makes,
// mounted the same way (`device=` the data blob).
//
// Memory: about 150 bytes per entry plus its name, xattrs and symlink target,
// and 4 bytes per chunk of file data (kChunkSize each).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace dsec::image {

// A chunk of a regular file that reads as zeros and has no blob space.
inline constexpr uint32_t kHoleChunk = std::numeric_limits<uint32_t>::max();
// The unit of addresses in the data blob (EROFS block size).
inline constexpr int kFsBlockSize = 4096;

struct FsInode {
  uint32_t mode = 0;  // the whole st_mode: S_IFMT type and permission bits
  uint32_t uid = 0;
  uint32_t gid = 0;
  int64_t mtime = 0;  // seconds since the epoch (may be negative)
  uint32_t mtimeNsec = 0;
  // Regular files: the file's length. Others: ignored (the writer derives
  // directories' and symlinks' sizes).
  uint64_t size = 0;
  uint32_t rdev = 0;     // character and block devices: makedev(major, minor)
  std::string symlink;   // symlinks: the target, as stored (not resolved)
  // Full names ("user.x", "trusted.overlay.opaque", "security.capability",
  // "system.posix_acl_access" in the kernel's binary form), in any order,
  // no duplicates.
  std::vector<std::pair<std::string, std::string>> xattrs;
  // Regular files: one entry per kChunkSize chunk of the file, in order,
  // ceil(size / kChunkSize) of them: the 4 KiB block address of the chunk's
  // first byte in the data blob, or kHoleChunk. A chunk's bytes lie
  // contiguously from that address (the last chunk may be short).
  std::vector<uint32_t> chunks;
  // Regular files: where each chunk lies. Empty: every chunk is in the
  // layer's own data blob (EROFS device 1). Otherwise one entry per chunk: 0
  // for the own blob, k for FsTree::extraBlobs[k - 1] (EROFS device k + 1),
  // a chunk deduplicated against another layer's blob.
  std::vector<uint8_t> chunkDevices;
  // Directories: entries by name (no "." or ".."), sorted by name in byte
  // order, each the index of an inode in FsTree::inodes. Several entries (in
  // one directory or several) naming the same non-directory inode are hard
  // links; a directory is named by exactly one entry.
  std::vector<std::pair<std::string, uint32_t>> children;
};

struct FsTree {
  // inodes[0] is the root directory.
  std::vector<FsInode> inodes;
  // Bytes written to the data blob so far: every chunk address lies below.
  // The data blob is padded to a multiple of kFsBlockSize.
  uint64_t dataSize = 0;
  // Data blobs of other layers that some chunks point into (chunkDevices),
  // in device order: EROFS devices 2, 3, ... each mounted with a further
  // device=. At most kMaxExtraBlobs.
  struct ExtraBlob {
    std::string digest;  // "sha256:<hex>", also the device slot's tag
    uint64_t size = 0;   // bytes (a multiple of kFsBlockSize)
  };
  std::vector<ExtraBlob> extraBlobs;
};

// Other layers' blobs one layer may point into: each is one more device to
// mount (and one more disk for a microvm).
inline constexpr size_t kMaxExtraBlobs = 8;

}  // namespace dsec::image
