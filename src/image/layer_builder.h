// Builds an EROFS layer blob from a root filesystem directory or tarball
// (first cut of image import; OCI import comes with the images issue).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::image {

// A layer is a small EROFS metadata image (its identity) plus a chunked data
// blob (mkfs.erofs --chunksize --blobdev): a node fetches the metadata whole
// and can read the data on demand; the mount names the blob with device=.
// Ids a container sandbox maps by default, 0..65535 (`dsec up --userns-width`,
// edge::kDefaultUsernsWidth): files owned by larger ids show as 65534 inside
// and cannot be changed (docs/images.md, "Owners outside the sandbox's id
// mapping").
inline constexpr uint32_t kDefaultOwnerWidth = 65536;
// How many entries outside the width an OwnerReport names.
inline constexpr size_t kOwnerExamples = 10;

// An entry whose uid or gid is outside the width.
struct OwnerExample {
  std::string path;  // relative to the scanned tree ("." for its root)
  uint32_t uid = 0;
  uint32_t gid = 0;
  bool operator==(const OwnerExample&) const = default;
};

// The owners of a tree's entries, judged against the ids a sandbox maps
// (0..width-1).
struct OwnerReport {
  uint32_t width = 0;   // what the entries were judged against; 0: not scanned
  int64_t entries = 0;  // entries looked at, the root included
  int64_t outside = 0;  // entries whose uid or gid is >= width
  uint32_t maxUid = 0;  // over all entries
  uint32_t maxGid = 0;
  std::vector<OwnerExample> examples;  // the first kOwnerExamples outside, walk order

  // Adds another tree's report (an image's next layer): counts add up, maxima
  // combine, and examples are appended up to kOwnerExamples, skipping paths
  // already named (a file a later layer replaces is counted in both layers but
  // named once). `width` is taken from `other` when this one has none.
  void add(const OwnerReport& other);
};

// Walks `tree` (a directory; symlinks are never followed, so every entry is
// judged by its own owner, with one lstat each) and reports the entries owned
// by ids >= `width`. Errors: kInvalidArgument (field "owner-width") for a
// width of 0; the errno and path of an open, readdir or stat that fails.
Result<OwnerReport> scanOwners(const std::string& tree, uint32_t width);

struct BuiltLayer {
  std::string path;    // the EROFS metadata image
  std::string digest;  // "sha256:<hex>" of it: the layer's digest
  int64_t size = 0;
  std::string dataPath;    // the data blob
  std::string dataDigest;  // "sha256:<hex>" of it
  int64_t dataSize = 0;
  // "disk": not a layer but a whole disk image (a vm's pack_diff, docs/vm.md):
  // `path` only, no data blob.
  std::string kind;
  // The tree's owners against buildLayer's `ownerWidth` (width 0: not scanned).
  OwnerReport owners;
};

// Bytes per data chunk: the unit a node fetches, verifies and caches. 128 KiB
// because bench/lazy (32 starts of python and gcc from a 1.28 GB image over a
// 100 MB/s link) fetched 11.8% of the image with 1 MiB chunks and 6.6% with
// 128 KiB, and all 32 were ready 3.1-3.5x against 4.3-5.0x sooner than after
// a whole download (256 KiB: 7.5%, 4.0x; 64 KiB: 5.9%, 3.5x, the per-chunk
// cost taking over). Indexes of layers made with another size keep theirs.
constexpr int kChunkSize = 128 << 10;

// `source`: a directory, or a tar archive (plain, gzip, xz, zstd: whatever GNU
// tar detects). Owners, modes, xattrs, symlinks, hard links and device nodes
// are preserved (extraction runs as root with --numeric-owner). `workDir` is
// scratch space; the result is written there. A non-zero `ownerWidth` also
// scans the tree's owners into `owners` (scanOwners) before the image is made;
// 0 skips the scan (pack_diff: nobody reads a report there).
Result<BuiltLayer> buildLayer(const std::string& source, const std::string& workDir,
                              uint32_t ownerWidth = 0);

// Runs argv (argv[0] looked up in PATH), waits; error with its stderr tail on
// a non-zero exit.
Status runCommand(const std::vector<std::string>& argv);

}  // namespace dsec::image
