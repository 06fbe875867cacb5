// The parts of an image's runtime config that dsec keeps: who commands run
// as, their environment and their working directory (applied to sandboxes),
// and the entrypoint, command and labels (recorded, shown, carried through
// builds and imports; a sandbox runs what its caller execs). OCI image spec
// "config" object User/Env/WorkingDir/Entrypoint/Cmd/Labels, which `docker
// save` shares. Header-only, so the platform's store can hold one without
// linking the importer.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace dsec::image {

// Empty fields mean unset: root, no extra environment, the user's home.
struct ImageConfig {
  std::string user;              // "User": name, uid, name:group or uid:gid
  std::vector<std::string> env;  // "Env": "K=V" entries, in image order (a later key wins)
  std::string workingDir;        // "WorkingDir": absolute and lexically normalised
  std::vector<std::string> entrypoint;        // "Entrypoint": argv
  std::vector<std::string> cmd;               // "Cmd": argv (the entrypoint's arguments)
  std::map<std::string, std::string> labels;  // "Labels"
  bool empty() const {
    return user.empty() && env.empty() && workingDir.empty() && entrypoint.empty() &&
           cmd.empty() && labels.empty();
  }
  bool operator==(const ImageConfig&) const = default;
};

}  // namespace dsec::image
