// The streaming layer converter, tar side: turns an OCI layer as it arrives
// from a registry (a gzip, zstd or plain tar stream) into an FsTree
// (fs_tree.h) and the layer's data blob, without extracting anything to disk.
// The EROFS writer (erofs_writer.h) then makes the metadata image from the
// tree; together they are the pair buildLayer makes with mkfs.erofs.
//
//   auto src = openFileSource(spool);                       // or any ByteSource
//   auto layer = readTarLayer(**src, LayerCompression::kGzip, workDir + "/layer.data");
//   // layer->tree -> the EROFS writer; layer->chunks is the blob's ChunkIndex
//
// Data blob layout (what the tree's chunk addresses point at). A regular file
// is cut into kChunkSize (128 KiB) chunks as its bytes arrive:
//   - a chunk that reads as zeros (written zeros or a sparse hole) takes no
//     blob space: kHoleChunk;
//   - a chunk whose bytes equal one already stored in this layer (same length,
//     same sha256) points at that copy: full chunks and short ones (small
//     files, file tails) alike (TarLayerOptions::dedup);
//   - otherwise it is appended: a file of at least kChunkSize puts each chunk
//     at a 128 KiB-aligned blob offset, so each chunk is exactly one slice of
//     the blob's ChunkIndex and an on-demand reader fetches one chunk per file
//     chunk; a smaller file starts at the next 4 KiB-aligned offset. The gap is
//     zeros, written.
// The blob ends padded with zeros to a multiple of kFsBlockSize.
//
// Memory: the tree (fs_tree.h: ~150 bytes an entry plus names, 4 bytes a
// chunk), ~100 bytes per distinct stored chunk for deduplication, and fixed
// buffers: 1 MiB of tar input, 256 KiB of compressed input, one 128 KiB chunk,
// a 1 MiB write buffer, and the decompressor's state (85 KiB of ISA-L inflate
// state for gzip, up to 128 MiB for zstd: windowLogMax 27). Nothing grows with
// a file's size but its chunk list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "image/chunk_index.h"
#include "image/fs_tree.h"
#include "image/layer_builder.h"
#include "image/registry_client.h"  // LayerCompression

namespace dsec::image {

// A pull stream of bytes. Not thread-safe; one reader at a time.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Reads up to `n` (> 0) bytes into `buf` and returns how many: at least 1,
  // or 0 only at the end of the stream (and on every call after). A source
  // over a file still being written (a download's spool) blocks until bytes
  // arrive or the download ends, and returns 0 only then. Errors: the source's
  // own (sysError for a failed read(2); kDataLoss, kInvalidArgument or
  // kResourceExhausted from a decompressor, below).
  virtual Result<size_t> read(char* buf, size_t n) = 0;
};

// Reads a file descriptor it owns (EINTR retried). Errors: sysError("read
// <name>").
class FdSource final : public ByteSource {
 public:
  FdSource(UniqueFd fd, std::string name) : fd_(std::move(fd)), name_(std::move(name)) {}
  Result<size_t> read(char* buf, size_t n) override;

 private:
  UniqueFd fd_;
  std::string name_;
};

// Opens `path` for reading. Errors: sysError("open <path>").
Result<std::unique_ptr<ByteSource>> openFileSource(const std::string& path);

// Serves bytes it holds (tests, small in-memory blobs).
class MemorySource final : public ByteSource {
 public:
  explicit MemorySource(std::string bytes) : bytes_(std::move(bytes)) {}
  Result<size_t> read(char* buf, size_t n) override;

 private:
  std::string bytes_;
  size_t pos_ = 0;
};

// Passes `in`'s bytes through, counting them and (unless `hash` is false)
// hashing them with SHA-256. `in` is borrowed and must outlive this source.
class HashingSource final : public ByteSource {
 public:
  explicit HashingSource(ByteSource& in, bool hash = true);
  ~HashingSource() override;
  Result<size_t> read(char* buf, size_t n) override;
  int64_t bytes() const { return bytes_; }
  // "sha256:<hex>" of every byte read so far ("" when not hashing). Call
  // once, after the last read.
  std::string digest();

 private:
  struct Impl;
  ByteSource& in_;
  std::unique_ptr<Impl> impl_;
  int64_t bytes_ = 0;
  bool hash_ = true;
};

// For decompressing() and readTarLayer(): tell the compression from the
// stream's first bytes (1f 8b: gzip; 28 b5 2f fd: zstd; anything else: none;
// xz and bzip2 are refused by name).
inline constexpr std::optional<LayerCompression> kDetectCompression = std::nullopt;

// The uncompressed bytes of `in`, decompressed as they are pulled.
//   kGzip: RFC 1952, several members one after another (pigz, `cat a.gz
//     b.gz`) read as one stream; anything after a member that is not another
//     member is an error (as Go's gzip reader, which made most layers' digests).
//   kZstd: any number of frames (skippable ones skipped), a window of at most
//     128 MiB (windowLogMax 27, containerd's limit).
//   kNone: `in` as it is.
// When `c` is kDetectCompression the first bytes are read now to decide, so
// this may fail with `in`'s errors. `*used` (if given) receives the
// compression in force. Errors from the returned source's read():
//   kDataLoss: corrupt or truncated compressed data (the message says which
//     and at what compressed offset)
//   kInvalidArgument (field "layer"): a zstd frame needing a larger window;
//     from this call, an xz or bzip2 stream under detection
//   kResourceExhausted: the decompressor could not allocate memory
//   `in`'s own errors, as they are.
Result<std::unique_ptr<ByteSource>> decompressing(std::unique_ptr<ByteSource> in,
                                                  std::optional<LayerCompression> c,
                                                  LayerCompression* used = nullptr);

// Chunks other layers stored already, found by content: the converter's way
// to deduplicate across layers and images (docs/images.md). The platform's
// implementation asks its chunk table and keeps every blob it answered with
// from garbage collection until it is destroyed.
class ChunkSource {
 public:
  struct Location {
    std::string data;   // the data blob holding the chunk, "sha256:<hex>"
    uint64_t dataSize;  // its size in bytes
    uint32_t block;     // the chunk's first byte, in kFsBlockSize blocks
  };
  virtual ~ChunkSource() = default;
  // Where a chunk of `length` bytes whose sha256 is `sha` (64 lower-case hex)
  // is stored, if anywhere. An error fails the conversion.
  virtual Result<std::optional<Location>> find(const std::string& sha, uint64_t length) = 0;
};

// A chunk the converter stored in the layer's own blob (TarLayer::stored).
struct StoredChunk {
  std::string sha;  // 64 lower-case hex of its bytes
  uint32_t length = 0;
  uint32_t block = 0;
};

struct TarLayerOptions {
  // Owners are judged against ids 0..ownerWidth-1 (OwnerReport); 0 skips the
  // report (its width stays 0).
  uint32_t ownerWidth = kDefaultOwnerWidth;
  // Tar entries plus directories made implicitly: more is kResourceExhausted.
  int64_t maxEntries = 4'000'000;
  // An entry's name or hard link target, in bytes as stored (PATH_MAX). A
  // symlink's target may have at most maxPathBytes - 1 (what symlink(2) takes).
  size_t maxPathBytes = 4096;
  // One xattr's name (XATTR_NAME_MAX) and value (what EROFS's u16 holds), and
  // all of one entry's names and values together.
  size_t maxXattrNameBytes = 255;
  size_t maxXattrValueBytes = 65535;
  size_t maxXattrBytesPerEntry = 65536;
  // Names, symlink targets and xattrs of the whole layer, summed: bounds the
  // tree's memory (kResourceExhausted beyond).
  int64_t maxMetadataBytes = int64_t(1) << 30;
  // Regular files' lengths, summed (sparse holes included): bounds the chunk
  // lists (4 bytes per 128 KiB) and the time spent on holes.
  int64_t maxFileBytes = int64_t(1) << 42;  // 4 TiB
  // Store identical chunks once (see the top of this file).
  bool dedup = true;
  // Asked for each chunk not stored in this layer yet (after the in-layer
  // check): a hit points the chunk at that blob, one of at most
  // kMaxExtraBlobs (FsTree::extraBlobs); past that, chunks are stored here.
  // Borrowed; null: no deduplication across layers.
  ChunkSource* shared = nullptr;
  // Chunks shorter than this are not looked up in `shared` (where a lookup
  // costs more than the block it would save).
  uint32_t minSharedChunk = 0;
  // Hash the bytes read (TarLayer::digest) and the uncompressed tar
  // (TarLayer::diffId). A caller that verified the blob already (a registry
  // pull checks every blob against its digest as it downloads) and has no
  // use for the diff_id turns them off: each is a SHA-256 pass over the layer.
  bool hashInput = true;
  bool hashDiffId = true;
};

struct TarLayerStats {
  int64_t entries = 0;       // tar entries read (".", markers and hard links included)
  int64_t implicitDirs = 0;  // parents made because an entry came before its directory
  int64_t replaced = 0;      // entries that replaced an earlier one of the same path
  int64_t hardLinks = 0;
  int64_t whiteouts = 0;         // character devices made from ".wh." markers
  int64_t whiteoutsDropped = 0;  // markers for a name this same layer has
  int64_t opaqueDirs = 0;        // directories marked ".wh..wh..opq"
  int64_t fileBytes = 0;      // lengths of the regular files read (holes, replaced ones included)
  int64_t dataBytes = 0;      // the data blob's size, padding included
  int64_t chunksWritten = 0;  // chunks stored in the blob
  int64_t chunksDeduplicated = 0;
  int64_t bytesDeduplicated = 0;
  int64_t holeChunks = 0;  // chunks of zeros (written or sparse) given no space
  int64_t chunksShared = 0;  // chunks found in other layers' blobs (ChunkSource)
  int64_t bytesShared = 0;
  // libarchive warnings other than names it could not convert to the locale
  // (which are expected: names are taken as raw bytes, below), and xattrs
  // dropped because EROFS cannot store their namespace.
  int64_t warnings = 0;
  std::string firstWarning;
};

struct TarLayer {
  FsTree tree;
  LayerCompression compression = LayerCompression::kNone;  // as decoded
  std::string digest;  // "sha256:<hex>" of the bytes read from `in`: the blob digest
  int64_t compressedSize = 0;
  std::string diffId;  // "sha256:<hex>" of the uncompressed tar: the OCI diff_id
  int64_t uncompressedSize = 0;
  std::string dataDigest;  // "sha256:<hex>" of the data blob
  ChunkIndex chunks;       // of the data blob, kChunkSize slices
  // Every chunk stored in the data blob (not those found in this layer or
  // elsewhere already): what the platform records for later layers to find.
  std::vector<StoredChunk> stored;
  // Owners of the final tree (whiteout devices and implicit directories
  // included, each name counted once, hard links once per name), judged as
  // scanOwners judges the extracted tree: breadth first, names in byte order
  // in each directory, the root as ".". Equal to scanOwners of the tree
  // extracted and passed through translateWhiteouts.
  OwnerReport owners;
  TarLayerStats stats;
};

// Reads the layer `in` (compressed as `c`, or detected) to its end and builds
// its tree, writing file data to a new file at `dataPath` (created or
// truncated, mode 0644, not fsynced). Every byte of `in` is read, including
// what follows the tar's end-of-archive blocks, so the digests cover the whole
// blob.
//
// The tree, as `tar -x --numeric-owner --xattrs` as root and then
// translateWhiteouts (oci_import.h) would leave it:
//   - names are byte strings, taken as stored (PAX names are UTF-8 by
//     standard but are not normalised or validated: libarchive is run in the
//     C locale so it does no conversion); a leading "./" or "/", "." and empty
//     components are dropped; ".." is refused;
//   - "." (or "/") sets the root's attributes; otherwise the root is 0755,
//     0:0, mtime 0; a directory missing when something inside it arrives is
//     made the same way, and takes its attributes if its own entry comes later;
//   - a later entry for a path replaces the earlier: a directory over a
//     directory takes the new attributes and keeps the children; anything else
//     drops what was there (a directory's whole subtree);
//   - a hard link names the inode its target names at that point of the
//     stream; its own header's attributes, and any data it carries, are
//     ignored (as GNU tar and Docker do);
//   - uid and gid are the numeric ids (user and group names are ignored);
//     xattrs are PAX SCHILY.xattr.* and LIBARCHIVE.xattr.*, the last of a
//     name winning; those outside user., trusted., security. and
//     system.posix_acl_{access,default} are dropped with a warning (EROFS
//     cannot store them; tar -x fails to set them and goes on); POSIX ACLs in
//     SCHILY.acl.* are ignored (GNU tar -x without --acls ignores them too);
//     mtime keeps its nanoseconds;
//   - after the last entry, in each directory: ".wh..wh..opq" becomes
//     trusted.overlay.opaque=y on the directory; ".wh.X" becomes a character
//     device 0:0 named X, mode 0, owned by 0:0, with the marker's mtime, unless
//     the directory has an X of this layer (then nothing); the markers
//     themselves go. As translateWhiteouts: ".wh..wh.X" makes a device
//     ".wh.X". Markers are taken in byte order; the order of the tar does not
//     matter.
//   - children sorted in byte order; inodes renumbered breadth first from the
//     root, with nothing unreachable left.
// Errors (all leave no file at `dataPath`, once it was created):
//   kInvalidArgument (field "layer"), naming the entry: not a tar; a ".."
//     component or a name component over 255 bytes; a parent that is not a
//     directory; a hard link to a name absent from the layer or to a
//     directory; "." not a directory; an empty symlink target; an entry type
//     a filesystem cannot hold; ids over 4294967294; a device number over
//     4095:1048575; an over-long name, target or xattr (the limits above); a
//     whiteout marker that is a directory, or ".wh." alone
//   kDataLoss: a truncated or corrupt tar (a bad header checksum, data cut
//     short), or corrupt compressed data (decompressing())
//   kResourceExhausted: more than maxEntries entries, maxMetadataBytes of
//     names and xattrs, maxFileBytes of file data, or a blob over 16 TiB
//   `in`'s errors; sysError for writing `dataPath`.
// Thread-safe with respect to other calls (it switches the calling thread's
// locale to "C" while it runs, and back).
Result<TarLayer> readTarLayer(ByteSource& in, std::optional<LayerCompression> c,
                              const std::string& dataPath, const TarLayerOptions& opts = {});

}  // namespace dsec::image
