// Serialises an FsTree (fs_tree.h) into an EROFS metadata image whose regular
// files are chunk-based and point into the layer's data blob as extra device
// 1: the pair `mkfs.erofs --chunksize=131072 --blobdev=` makes, mounted the
// same way (`mount -t erofs -o device=<data blob> <meta image>`).
//
// On-disk choices (the kernel's fs/erofs/erofs_fs.h; erofs-utils 1.5 reads
// them too):
//  - 4 KiB blocks; the superblock at 1024 with SB_CHKSUM (crc32c of the rest
//    of block 0) and MTIME compat flags and CHUNKED_FILE | DEVICE_TABLE
//    incompat flags, as mkfs.erofs 1.5 sets them for --blobdev; the device
//    table at 1152: the data blob (its size in blocks, `deviceTag`), then one
//    slot per FsTree::extraBlobs entry (tagged with its digest's hex).
//  - Inodes right after the device table (byte 1280 of block 0 for a layer
//    with no extra blobs; meta_blkaddr 0), 32-byte aligned, the root first
//    (nid 40 there, or 128 when its inline data does not fit block 0),
//    the rest in breadth-first order so a directory's entries lie together.
//    An inode is compact (32 bytes) when its owner ids and link count fit 16
//    bits, its size 32 bits, and its mtime equals the image's epoch (the most
//    common mtime in the tree), else extended (64 bytes). Files keep mtime to
//    the nanosecond either way.
//  - Regular files: EROFS_INODE_CHUNK_BASED with 8-byte chunk indexes
//    {0, device, block} (0xffffffff for a hole): device 1 is the data blob,
//    device k + 1 FsTree::extraBlobs[k - 1] (FsInode::chunkDevices); empty
//    files FLAT_PLAIN. Mounted with one device= per blob, in that order.
//  - Directories ('.' and '..' included, names sorted bytewise across blocks)
//    and symlinks: FLAT_INLINE, their last partial block packed right after
//    the inode when inode, xattrs and tail fit one block, the full blocks (or
//    everything, FLAT_PLAIN, when the tail does not fit) in blocks after the
//    inode area.
//  - Xattrs inline in the inode (no shared xattr area), sorted by name.
// The output depends only on the tree and the options: same tree, same bytes.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "image/fs_tree.h"

namespace dsec::image {

// The volume UUID every dsec layer carries (the one buildLayer passes to
// mkfs.erofs -U): "layer-dsec" then 1.
inline constexpr std::array<uint8_t, 16> kLayerUuid = {
    0x6c, 0x61, 0x79, 0x65, 0x72, 0x2d, 0x64, 0x73, 0x65, 0x63, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01};

struct ErofsWriterOptions {
  // Bytes per entry of FsInode::chunks: a power of two from 4 KiB to 2 GiB.
  // Must be what the tree was filled with (kChunkSize in layer_builder.h).
  uint32_t chunkSize = 128 << 10;
  std::array<uint8_t, 16> uuid = kLayerUuid;
  // The data blob's device slot tag (at most 64 bytes; e.g. its digest). The
  // kernel reads it only when no device= path is given (fscache); mkfs.erofs
  // 1.5 leaves it empty.
  std::string deviceTag;
  // false: every inode extended (64 bytes), epoch 0.
  bool compactInodes = true;
};

struct ErofsImageInfo {
  uint64_t size = 0;    // bytes of the metadata image (a whole number of blocks)
  uint64_t inodes = 0;  // inodes written (those reachable from the root)
  uint64_t rootNid = 0;
};

// Writes the metadata image of `tree` to `metaPath` (through a temporary file
// beside it, fsynced and renamed over it: on failure nothing is left there).
// The data blob is not touched; its size is taken from tree.dataSize.
// Inodes no directory entry reaches are left out. Memory: about 64 bytes per
// inode beside the tree, plus the largest directory's entries and xattrs.
// Errors:
//  - kInvalidArgument, naming the inode index (and entry name) in the message
//    and the offending FsTree field in field(): an empty tree or a root that is
//    not a directory; a mode that is not one of the seven file types or has
//    bits beyond 07777; a directory entry named "", "." or "..", with '/' or
//    NUL, longer than 255 bytes, out of order or duplicated, naming the root,
//    a missing inode or a directory already named elsewhere; a regular file
//    whose chunk count is not ceil(size / chunkSize), whose chunkDevices is
//    neither empty nor one per chunk or names a blob beyond extraBlobs, or
//    whose chunk lies beyond its blob's size; more than kMaxExtraBlobs extra
//    blobs, or one not named sha256:<hex>; a symlink target empty or over 4095 bytes; an xattr
//    whose name has no EROFS prefix (user., trusted., security.,
//    system.posix_acl_access/default), whose name after the prefix is over
//    255 bytes or whose value is over 65535 bytes, duplicated names; bad
//    options (chunkSize, deviceTag over 64 bytes); a tree too large for
//    32-bit block addresses.
//  - the errno and path of a failed create, write, fsync or rename.
// Thread safety: none needed; `tree` is only read.
Result<ErofsImageInfo> writeErofs(const FsTree& tree, const std::string& metaPath,
                                  const ErofsWriterOptions& opts = {});

// Writes `tag` (at most 64 bytes) into the first device slot of the EROFS
// image at `metaPath` (ours or mkfs.erofs --blobdev's) and fixes the
// superblock checksum, in place. A layer's identity is the digest of its
// metadata image, which describes its files but not their bytes: two layers
// whose files differ only in content would share a digest. Binding the data
// blob's digest into the image (its hex as the tag) makes the digest name the
// content too. The kernel does not read the tag when the blob is given with
// device=. Errors: kInvalidArgument (field "layer") for an image that is not
// EROFS or has no device slot in its first block; the errno and path of a
// failed read or write.
Status setErofsDeviceTag(const std::string& metaPath, std::string_view tag);

// crc32c (Castagnoli) without pre- or post-inversion, as the kernel's
// crc32c(seed, ...): the EROFS superblock checksum is crc32c(~0, block 0 from
// byte 1024 with the checksum field zeroed).
uint32_t erofsCrc32c(uint32_t seed, const void* data, size_t len);

}  // namespace dsec::image
