// File rules of a sandbox's security policy, applied by aether inside the
// sandbox's mount namespace so they bind every process there, running ones
// included, whatever their uid: read-only paths become read-only bind mounts,
// hidden paths are covered (an empty read-only tmpfs over a directory, an
// empty read-only file over a file). The sandbox's processes cannot undo
// either: they have neither CAP_SYS_ADMIN nor mount(2) (seccomp).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::aether {

class FsPolicy {
 public:
  // Replaces the rules in force with these. Paths are absolute inside the
  // sandbox; missing ones and symlinks (their targets are listed too, or not
  // at all) are skipped. On failure the previous rules are gone and none of
  // the new ones is left half-applied. A non-empty `resolvConf` replaces
  // /etc/resolv.conf (the policy's DNS resolvers) while no rule is in force,
  // so it is written even when the new rules make /etc read-only.
  Status apply(const std::vector<std::string>& readonly, const std::vector<std::string>& hidden,
               const std::string& resolvConf = {});
  const std::vector<std::string>& mounts() const { return mounts_; }

 private:
  void clear();
  std::vector<std::string> mounts_;  // in the order made
};

}  // namespace dsec::aether
