// Import of OCI image layouts (directory or tar) and `docker save` archives:
// every image layer becomes one dsec layer, with OCI whiteouts translated to
// overlayfs form (".wh.NAME" -> a 0:0 character device NAME; ".wh..wh..opq"
// -> trusted.overlay.opaque=y on its directory), so the layers stack under
// overlayfs exactly as the image's layers stack under a container runtime.
// The image config's User, Env and WorkingDir come along, so commands can run
// as the image meant them to (as Docker runs them).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "image/image_config.h"
#include "image/layer_builder.h"

namespace dsec::image {

enum class ArchiveFormat { kRootfs, kOciLayout, kDockerSave };

const char* formatName(ArchiveFormat f);
// Looks at `path` (a directory or a tar archive) to tell the three apart.
Result<ArchiveFormat> detectFormat(const std::string& path);

struct ImportedImage {
  std::vector<BuiltLayer> layers;  // bottom first
  ImageConfig config;              // empty for a root filesystem import
  // The layers' owner reports added up (OwnerReport::add), bottom first.
  OwnerReport owners;
};

// Builds one layer per image layer, bottom first, and reads the image config
// (an OCI layout's manifest `config.digest` blob; `manifest.json[0].Config`
// of a `docker save` archive). `workDir` is scratch space (the results live
// there). For a multi-platform index the linux/amd64 manifest is used, else
// the first. Errors (kInvalidArgument, field "path"): no manifest, a layer or
// the config missing or outside the archive, a config that is not JSON or
// whose User/Env/WorkingDir have the wrong type or a relative WorkingDir.
// Values are not judged further here; the platform validates them.
// Every layer's tree is scanned against `ownerWidth` (buildLayer, scanOwners;
// 0: no scan) and `owners` sums the reports: owners outside the width are
// reported, not refused, since the image still works (they show as 65534).
Result<ImportedImage> importImage(const std::string& path, ArchiveFormat format,
                                  const std::string& workDir,
                                  uint32_t ownerWidth = kDefaultOwnerWidth);

// Reads User, Env and WorkingDir from the text of an image config blob
// (`{"config": {"User": ..., "Env": [...], "WorkingDir": ...}, ...}`); absent
// fields, a null or absent "config" are empty. WorkingDir is normalised
// lexically ("/a/./b/" -> "/a/b"). Errors as importImage's, naming `what`.
Result<ImageConfig> parseImageConfig(const std::string& text, const std::string& what);

// Rewrites OCI whiteouts under `root` into overlayfs whiteouts, in place.
Status translateWhiteouts(const std::string& root);

}  // namespace dsec::image
