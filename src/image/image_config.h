// The parts of an image's runtime config that dsec honours: who commands run
// as, their environment and their working directory (OCI image spec "config"
// object User/Env/WorkingDir, which `docker save` shares). Header-only, so the
// platform's store can hold one without linking the importer.
#pragma once

#include <string>
#include <vector>

namespace dsec::image {

// Empty fields mean unset: root, no extra environment, the user's home.
struct ImageConfig {
  std::string user;              // "User": name, uid, name:group or uid:gid
  std::vector<std::string> env;  // "Env": "K=V" entries, in image order (a later key wins)
  std::string workingDir;        // "WorkingDir": absolute and lexically normalised
  bool empty() const { return user.empty() && env.empty() && workingDir.empty(); }
  bool operator==(const ImageConfig&) const = default;
};

}  // namespace dsec::image
