// Builds an EROFS layer blob from a root filesystem directory or tarball
// (first cut of image import; OCI import comes with the images issue).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::image {

// A layer is a small EROFS metadata image (its identity) plus a chunked data
// blob (mkfs.erofs --chunksize --blobdev): a node fetches the metadata whole
// and can read the data on demand; the mount names the blob with device=.
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
// scratch space; the result is written there.
Result<BuiltLayer> buildLayer(const std::string& source, const std::string& workDir);

// Runs argv (argv[0] looked up in PATH), waits; error with its stderr tail on
// a non-zero exit.
Status runCommand(const std::vector<std::string>& argv);

}  // namespace dsec::image
