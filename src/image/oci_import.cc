#include "image/oci_import.h"

#include "image/layer_converter.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/util.h"

namespace dsec::image {

using json = nlohmann::json;

namespace {

constexpr const char* kWhiteoutPrefix = ".wh.";
constexpr const char* kOpaqueMarker = ".wh..wh..opq";

bool isDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0;
}

// Lists the member names of a tar archive (only the first few hundred are
// needed to find index.json / manifest.json at its top).
Result<std::vector<std::string>> tarMembers(const std::string& tar) {
  std::string out = "/tmp/dsec-tar-list-" + randomHex(6);
  Status st = runCommand({"sh", "-c", "tar -tf \"$0\" > \"$1\"", tar, out});
  auto text = readFile(out);
  ::unlink(out.c_str());
  if (!st.isOk()) return invalidArg("path", tar + " is not a tar archive: " + st.message());
  if (!text.isOk()) return std::move(text).takeStatus();
  std::vector<std::string> names;
  for (auto& n : splitString(*text, '\n')) {
    std::string s = n;
    if (startsWith(s, "./")) s = s.substr(2);
    if (!s.empty()) names.push_back(s);
  }
  return names;
}

Status extractArchive(const std::string& tar, const std::string& dir, bool preserve) {
  RETURN_IF_ERROR(makeDirs(dir, 0755));
  std::vector<std::string> argv = {"tar"};
  if (preserve) {
    for (const char* a : {"--numeric-owner", "--xattrs", "--xattrs-include=*",
                          "--same-permissions", "--same-owner"}) {
      argv.push_back(a);
    }
  }
  argv.insert(argv.end(), {"-xf", tar, "-C", dir});
  Status st = runCommand(argv);
  if (!st.isOk()) return invalidArg("path", "cannot extract " + tar + ": " + st.message());
  return Status::ok();
}

Result<json> readJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, readFile(path));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return invalidArg("path", path + " is not valid JSON");
  return j;
}

std::string blobFile(const std::string& root, const std::string& digest) {
  size_t colon = digest.find(':');
  if (colon == std::string::npos) return {};
  std::string algo = digest.substr(0, colon), hex = digest.substr(colon + 1);
  if (algo.find('/') != std::string::npos || hex.find('/') != std::string::npos ||
      hex.find("..") != std::string::npos) {
    return {};
  }
  return root + "/blobs/" + algo + "/" + hex;
}

// What an image archive holds: its layer tars, bottom first, and its config file.
struct ArchiveParts {
  std::vector<std::string> layers;
  std::string config;
};

// The layer blobs and config blob of an OCI layout.
Result<ArchiveParts> ociParts(const std::string& root) {
  ASSIGN_OR_RETURN(json node, readJson(root + "/index.json"));
  for (int depth = 0; depth < 4; ++depth) {
    if (!node.contains("manifests") && node.contains("layers")) break;  // an image manifest
    auto ms = node.find("manifests");
    if (ms == node.end() || !ms->is_array() || ms->empty()) {
      return invalidArg("path", "OCI index lists no manifests");
    }
    const json* pick = &(*ms)[0];
    for (auto& m : *ms) {
      auto pl = m.find("platform");
      if (pl != m.end() && pl->value("os", "") == "linux" &&
          pl->value("architecture", "") == "amd64") {
        pick = &m;
        break;
      }
    }
    std::string file = blobFile(root, pick->value("digest", ""));
    if (file.empty()) return invalidArg("path", "bad manifest digest in OCI index");
    ASSIGN_OR_RETURN(node, readJson(file));
  }
  auto layers = node.find("layers");
  if (layers == node.end() || !layers->is_array()) {
    return invalidArg("path", "OCI manifest has no layers");
  }
  ArchiveParts out;
  for (auto& l : *layers) {
    std::string file = blobFile(root, l.value("digest", ""));
    if (file.empty() || !exists(file)) {
      return invalidArg("path", "layer blob " + l.value("digest", "?") + " missing from layout");
    }
    out.layers.push_back(file);
  }
  std::string digest;
  if (auto c = node.find("config"); c != node.end() && c->is_object()) {
    if (auto d = c->find("digest"); d != c->end() && d->is_string()) digest = d->get<std::string>();
  }
  if (digest.empty()) return invalidArg("path", "OCI manifest names no config blob");
  out.config = blobFile(root, digest);
  if (out.config.empty() || !exists(out.config)) {
    return invalidArg("path", "config blob " + digest + " missing from layout");
  }
  return out;
}

// The layer tars and config file of a `docker save` archive.
Result<ArchiveParts> dockerParts(const std::string& root) {
  ASSIGN_OR_RETURN(json m, readJson(root + "/manifest.json"));
  if (!m.is_array() || m.empty() || !m[0].contains("Layers") || !m[0]["Layers"].is_array()) {
    return invalidArg("path", "manifest.json lists no image with Layers");
  }
  // Paths inside the archive only: a crafted manifest must not make the
  // import read the importing host's files.
  auto inside = [&](const std::string& rel) {
    return !rel.empty() && rel[0] != '/' && rel.find("..") == std::string::npos;
  };
  ArchiveParts out;
  for (auto& l : m[0]["Layers"]) {
    if (!l.is_string()) return invalidArg("path", "bad Layers entry in manifest.json");
    std::string rel = l.get<std::string>();
    if (!inside(rel)) return invalidArg("path", "layer path " + rel + " leaves the archive");
    if (!exists(root + "/" + rel)) return invalidArg("path", "layer " + rel + " missing");
    out.layers.push_back(root + "/" + rel);
  }
  auto config = m[0].find("Config");
  if (config == m[0].end() || !config->is_string()) {
    return invalidArg("path", "manifest.json names no Config");
  }
  std::string rel = config->get<std::string>();
  if (!inside(rel)) return invalidArg("path", "config path " + rel + " leaves the archive");
  if (!exists(root + "/" + rel)) return invalidArg("path", "config " + rel + " missing");
  out.config = root + "/" + rel;
  return out;
}

// "/a/./b//../c/" -> "/a/c", as Go's path.Clean (what Docker applies to WORKDIR).
std::string cleanAbsolutePath(const std::string& p) {
  std::vector<std::string> parts;
  for (auto& part : splitString(p, '/')) {
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
      continue;
    }
    parts.push_back(part);
  }
  std::string out;
  for (auto& part : parts) out += "/" + part;
  return out.empty() ? "/" : out;
}

}  // namespace

const char* formatName(ArchiveFormat f) {
  switch (f) {
    case ArchiveFormat::kRootfs: return "rootfs";
    case ArchiveFormat::kOciLayout: return "oci";
    case ArchiveFormat::kDockerSave: return "docker";
  }
  return "?";
}

Result<ArchiveFormat> detectFormat(const std::string& path) {
  if (isDir(path)) {
    if (exists(path + "/oci-layout") && exists(path + "/index.json")) {
      return ArchiveFormat::kOciLayout;
    }
    if (exists(path + "/manifest.json") && !exists(path + "/etc")) {
      return ArchiveFormat::kDockerSave;
    }
    return ArchiveFormat::kRootfs;
  }
  if (!exists(path)) return notFound(path + " does not exist");
  ASSIGN_OR_RETURN(auto names, tarMembers(path));
  bool index = false, layout = false, manifest = false, etc = false;
  for (auto& n : names) {
    index = index || n == "index.json";
    layout = layout || n == "oci-layout";
    manifest = manifest || n == "manifest.json";
    etc = etc || startsWith(n, "etc/");
  }
  if (index && layout) return ArchiveFormat::kOciLayout;
  if (manifest && !etc) return ArchiveFormat::kDockerSave;
  return ArchiveFormat::kRootfs;
}

Status translateWhiteouts(const std::string& root) {
  // Depth first, so a directory's markers are handled after its children.
  std::vector<std::string> dirs = {root};
  for (size_t i = 0; i < dirs.size(); ++i) {
    DIR* d = ::opendir(dirs[i].c_str());
    if (!d) return sysError("opendir " + dirs[i]);
    std::vector<std::string> names;
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      names.push_back(n);
      if (e->d_type == DT_DIR) dirs.push_back(dirs[i] + "/" + n);
    }
    ::closedir(d);
    for (auto& n : names) {
      if (!startsWith(n, kWhiteoutPrefix)) continue;
      std::string marker = dirs[i] + "/" + n;
      if (::unlink(marker.c_str()) != 0) return sysError("unlink " + marker);
      if (n == kOpaqueMarker) {
        if (::lsetxattr(dirs[i].c_str(), "trusted.overlay.opaque", "y", 1, 0) != 0) {
          return sysError("set opaque on " + dirs[i]);
        }
        continue;
      }
      std::string target = dirs[i] + "/" + n.substr(std::string(kWhiteoutPrefix).size());
      if (target == dirs[i] + "/") return invalidArg("path", "empty whiteout in " + dirs[i]);
      // A whiteout hides only lower layers' files (OCI image spec); a file of
      // the same layer stays.
      if (exists(target)) continue;
      if (::mknod(target.c_str(), S_IFCHR | 0000, makedev(0, 0)) != 0) {
        return sysError("whiteout " + target);
      }
    }
  }
  return Status::ok();
}

Result<ImageConfig> parseImageConfig(const std::string& text, const std::string& what) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return invalidArg("path", "image config " + what + " is not a JSON object");
  }
  ImageConfig out;
  auto c = j.find("config");
  if (c == j.end() || c->is_null()) return out;
  if (!c->is_object()) return invalidArg("path", "\"config\" of " + what + " is not an object");
  auto readString = [&](const char* key, std::string* dst) -> Status {
    auto it = c->find(key);
    if (it == c->end() || it->is_null()) return Status::ok();
    if (!it->is_string()) {
      return invalidArg("path", std::string("config.") + key + " of " + what + " is not a string");
    }
    *dst = it->get<std::string>();
    return Status::ok();
  };
  RETURN_IF_ERROR(readString("User", &out.user));
  RETURN_IF_ERROR(readString("WorkingDir", &out.workingDir));
  if (!out.workingDir.empty()) {
    if (out.workingDir[0] != '/') {
      return invalidArg("path",
                        "config.WorkingDir of " + what + " is not absolute: " + out.workingDir);
    }
    out.workingDir = cleanAbsolutePath(out.workingDir);
  }
  for (auto [key, dst] : {std::pair{"Env", &out.env}, std::pair{"Entrypoint", &out.entrypoint},
                          std::pair{"Cmd", &out.cmd}}) {
    auto list = c->find(key);
    if (list == c->end() || list->is_null()) continue;
    if (!list->is_array()) {
      return invalidArg("path", std::string("config.") + key + " of " + what + " is not a list");
    }
    for (auto& e : *list) {
      if (!e.is_string()) {
        return invalidArg("path",
                          std::string("config.") + key + " of " + what + " holds a non-string");
      }
      dst->push_back(e.get<std::string>());
    }
  }
  if (auto labels = c->find("Labels"); labels != c->end() && !labels->is_null()) {
    if (!labels->is_object()) {
      return invalidArg("path", "config.Labels of " + what + " is not an object");
    }
    for (auto& [k, v] : labels->items()) {
      if (!v.is_string()) {
        return invalidArg("path", "config.Labels of " + what + " holds a non-string");
      }
      out.labels[k] = v.get<std::string>();
    }
  }
  return out;
}

Result<ImportedImage> importImage(const std::string& path, ArchiveFormat format,
                                  const std::string& workDir, uint32_t ownerWidth) {
  RETURN_IF_ERROR(makeDirs(workDir, 0700));
  ImportedImage out;
  if (format == ArchiveFormat::kRootfs) {
    ASSIGN_OR_RETURN(BuiltLayer l, buildLayer(path, workDir + "/layer0", ownerWidth));
    out.owners.add(l.owners);
    out.layers.push_back(std::move(l));
    return out;
  }
  std::string root = path;
  if (!isDir(path)) {
    root = workDir + "/archive";
    RETURN_IF_ERROR(extractArchive(path, root, false));
  }
  ASSIGN_OR_RETURN(ArchiveParts parts,
                   format == ArchiveFormat::kOciLayout ? ociParts(root) : dockerParts(root));
  if (parts.layers.empty()) return invalidArg("path", "the image has no layers");
  // The config first: it is cheap, and a bad one should fail before minutes
  // of layer building.
  ASSIGN_OR_RETURN(std::string configText, readFile(parts.config));
  ASSIGN_OR_RETURN(out.config, parseImageConfig(configText, parts.config.substr(root.size() + 1)));
  // Each layer streams from its (compressed) tar into EROFS: nothing is
  // extracted (layer_converter.h).
  TarLayerOptions topts;
  topts.ownerWidth = ownerWidth;
  for (size_t i = 0; i < parts.layers.size(); ++i) {
    auto built = convertTarFile(parts.layers[i], std::nullopt,
                                workDir + "/layer" + std::to_string(i), topts);
    if (!built.isOk()) {
      Status st = built.status();
      return Status(st.code(), "layer " + std::to_string(i) + ": " + st.message(), st.sysErrno(),
                    st.field() == "layer" ? "path" : st.field());
    }
    out.owners.add(built->layer.owners);
    out.layers.push_back(std::move(built->layer));
  }
  if (root != path) (void)removeTree(root);
  return out;
}

}  // namespace dsec::image
