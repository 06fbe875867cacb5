#include "image/layer_builder.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <tuple>

#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"

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

Result<BuiltLayer> buildLayer(const std::string& source, const std::string& workDir) {
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
  out.path = workDir + "/layer.erofs";
  out.dataPath = workDir + "/layer.data";
  Status mk = runCommand({"mkfs.erofs", "--quiet", "-U", "6c617965-722d-6473-6563-000000000001",
                          "--preserve-mtime", "--chunksize=" + std::to_string(kChunkSize),
                          "--blobdev=" + out.dataPath, out.path, tree});
  if (!extracted.empty()) (void)removeTree(extracted);
  RETURN_IF_ERROR(mk);
  for (auto [path, digest, size] : {std::tuple{&out.path, &out.digest, &out.size},
                                    std::tuple{&out.dataPath, &out.dataDigest, &out.dataSize}}) {
    ASSIGN_OR_RETURN(std::string hex, sha256File(*path));
    *digest = "sha256:" + hex;
    if (::stat(path->c_str(), &st) != 0) return sysError("stat " + *path);
    *size = st.st_size;
  }
  return out;
}

}  // namespace dsec::image
