// Builds an EROFS layer blob from a root filesystem directory or tarball
// (first cut of image import; OCI import comes with the images issue).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::image {

struct BuiltLayer {
  std::string path;    // the EROFS image file
  std::string digest;  // "sha256:<hex>" of that file
  int64_t size = 0;
};

// `source`: a directory, or a tar archive (plain, gzip, xz, zstd: whatever GNU
// tar detects). Owners, modes, xattrs, symlinks, hard links and device nodes
// are preserved (extraction runs as root with --numeric-owner). `workDir` is
// scratch space; the result is written there.
Result<BuiltLayer> buildLayer(const std::string& source, const std::string& workDir);

// Runs argv (argv[0] looked up in PATH), waits; error with its stderr tail on
// a non-zero exit.
Status runCommand(const std::vector<std::string>& argv);

}  // namespace dsec::image
