#include "image/layer_builder.h"

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <tuple>

#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"
#include "image/erofs_writer.h"

extern char** environ;

namespace dsec::image {

Status runCommand(const std::vector<std::string>& argv) {
  std::string errFile = "/tmp/dsec-cmd-" + randomHex(6) + ".err";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, errFile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ::unlink(errFile.c_str());
    return sysError("spawn " + argv[0], rc);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::string err = readFile(errFile).isOk() ? *readFile(errFile) : "";
  ::unlink(errFile.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::ok();
  if (err.size() > 2000) err = "..." + err.substr(err.size() - 2000);
  return Status(Code::kInternal, argv[0] + " failed (status " + std::to_string(status) + "): " + err);
}

void OwnerReport::add(const OwnerReport& other) {
  if (width == 0) width = other.width;
  entries += other.entries;
  outside += other.outside;
  maxUid = std::max(maxUid, other.maxUid);
  maxGid = std::max(maxGid, other.maxGid);
  for (const auto& e : other.examples) {
    if (examples.size() >= kOwnerExamples) break;
    bool named = std::any_of(examples.begin(), examples.end(),
                             [&](const OwnerExample& x) { return x.path == e.path; });
    if (!named) examples.push_back(e);
  }
}

Result<OwnerReport> scanOwners(const std::string& tree, uint32_t width) {
  if (width == 0) return invalidArg("owner-width", "the owner width must be positive");
  OwnerReport out;
  out.width = width;
  auto note = [&](const std::string& rel, const struct stat& st) {
    ++out.entries;
    out.maxUid = std::max<uint32_t>(out.maxUid, st.st_uid);
    out.maxGid = std::max<uint32_t>(out.maxGid, st.st_gid);
    if (st.st_uid < width && st.st_gid < width) return;
    ++out.outside;
    if (out.examples.size() < kOwnerExamples) {
      out.examples.push_back({rel.empty() ? "." : rel, st.st_uid, st.st_gid});
    }
  };
  UniqueFd root(::open(tree.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root) return sysError("open " + tree);
  struct stat st;
  if (::fstat(root.get(), &st) != 0) return sysError("stat " + tree);
  note("", st);
  // Breadth first, relative paths opened beneath the root with O_NOFOLLOW, so
  // no fd is held per level of depth and a symlink is never entered. Names are
  // sorted so the examples do not depend on the filesystem's readdir order.
  std::vector<std::string> dirs = {""};
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string rel = dirs[i];  // a copy: push_back below may move dirs
    int fd = rel.empty() ? ::dup(root.get())
                         : ::openat(root.get(), rel.c_str(),
                                    O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return sysError("open " + tree + "/" + rel);
    std::unique_ptr<DIR, int (*)(DIR*)> d(::fdopendir(fd), ::closedir);
    if (!d) {
      int err = errno;
      ::close(fd);
      return sysError("opendir " + tree + "/" + rel, err);
    }
    std::vector<std::string> names;
    while (true) {
      errno = 0;
      struct dirent* e = ::readdir(d.get());
      if (!e) {
        if (errno != 0) return sysError("readdir " + tree + "/" + rel);
        break;
      }
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        names.emplace_back(e->d_name);
      }
    }
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      std::string child = rel.empty() ? n : rel + "/" + n;
      if (::fstatat(::dirfd(d.get()), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        return sysError("stat " + tree + "/" + child);
      }
      note(child, st);
      if (S_ISDIR(st.st_mode)) dirs.push_back(std::move(child));
    }
  }
  return out;
}

Result<BuiltLayer> buildLayer(const std::string& source, const std::string& workDir,
                              uint32_t ownerWidth) {
  struct stat st;
  if (::stat(source.c_str(), &st) != 0) return sysError("stat " + source);
  RETURN_IF_ERROR(makeDirs(workDir, 0700));
  std::string tree = source;
  std::string extracted;
  if (!S_ISDIR(st.st_mode)) {
    extracted = workDir + "/rootfs";
    RETURN_IF_ERROR(makeDirs(extracted, 0755));
    Status t = runCommand({"tar", "--numeric-owner", "--xattrs", "--xattrs-include=*",
                           "--same-permissions", "--same-owner", "-xf", source, "-C", extracted});
    if (!t.isOk()) {
      (void)removeTree(extracted);
      return invalidArg("path", "cannot extract " + source + ": " + t.message());
    }
    tree = extracted;
  }
  BuiltLayer out;
  if (ownerWidth != 0) {
    auto owners = scanOwners(tree, ownerWidth);
    if (!owners.isOk()) {
      if (!extracted.empty()) (void)removeTree(extracted);
      return std::move(owners).takeStatus();
    }
    out.owners = std::move(owners).value();
  }
  out.path = workDir + "/layer.erofs";
  out.dataPath = workDir + "/layer.data";
  Status mk = runCommand({"mkfs.erofs", "--quiet", "-U", "6c617965-722d-6473-6563-000000000001",
                          "--preserve-mtime", "--chunksize=" + std::to_string(kChunkSize),
                          "--blobdev=" + out.dataPath, out.path, tree});
  if (!extracted.empty()) (void)removeTree(extracted);
  RETURN_IF_ERROR(mk);
  // The data blob first: its digest goes into the metadata image, so the
  // layer's digest names the files' bytes, not only their names and
  // attributes (setErofsDeviceTag).
  for (auto [path, digest, size] : {std::tuple{&out.dataPath, &out.dataDigest, &out.dataSize},
                                    std::tuple{&out.path, &out.digest, &out.size}}) {
    if (path == &out.path) RETURN_IF_ERROR(setErofsDeviceTag(out.path, out.dataDigest.substr(7)));
    ASSIGN_OR_RETURN(std::string hex, sha256File(*path));
    *digest = "sha256:" + hex;
    if (::stat(path->c_str(), &st) != 0) return sysError("stat " + *path);
    *size = st.st_size;
  }
  return out;
}

}  // namespace dsec::image
