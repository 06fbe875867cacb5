// Import of OCI image layouts (directory or tar) and `docker save` archives:
// every image layer becomes one dsec layer, with OCI whiteouts translated to
// overlayfs form (".wh.NAME" -> a 0:0 character device NAME; ".wh..wh..opq"
// -> trusted.overlay.opaque=y on its directory), so the layers stack under
// overlayfs exactly as the image's layers stack under a container runtime.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "image/layer_builder.h"

namespace dsec::image {

enum class ArchiveFormat { kRootfs, kOciLayout, kDockerSave };

const char* formatName(ArchiveFormat f);
// Looks at `path` (a directory or a tar archive) to tell the three apart.
Result<ArchiveFormat> detectFormat(const std::string& path);

// Builds one layer per image layer, bottom first. `workDir` is scratch space
// (the results live there). For a multi-platform index the linux/amd64
// manifest is used, else the first.
Result<std::vector<BuiltLayer>> importImage(const std::string& path, ArchiveFormat format,
                                            const std::string& workDir);

// Rewrites OCI whiteouts under `root` into overlayfs whiteouts, in place.
Status translateWhiteouts(const std::string& root);

}  // namespace dsec::image
