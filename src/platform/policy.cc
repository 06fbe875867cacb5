#include "platform/policy.h"

#include "common/util.h"

namespace dsec::platform {

const std::vector<Policy>& builtinPolicies() {
  static const std::vector<Policy> kPolicies = {
      {"default", "closed: no egress; the sandbox may change any of its own files", {}, {}, {}},
      {"rollout", "an agent at work: no egress; the sandbox may change any of its own files",
       {}, {}, {}},
      {"eval",
       "grading: no egress; system paths read-only for every process whatever its uid (no "
       "replacing /bin/bash or a library); more paths may be hidden or made read-only",
       {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/boot"},
       {},
       {}},
  };
  return kPolicies;
}

Result<Policy> findPolicy(const std::string& name, const std::string& field) {
  for (const auto& p : builtinPolicies()) {
    if (p.name == name) return p;
  }
  std::string names;
  for (const auto& p : builtinPolicies()) names += (names.empty() ? "" : ", ") + p.name;
  return invalidArg(field, "unknown policy '" + name + "' (available: " + names + ")");
}

Status validatePolicyPaths(const std::vector<std::string>& paths, const std::string& field) {
  if (paths.size() > 64) return invalidArg(field, "at most 64 paths");
  for (const auto& p : paths) {
    if (p.size() < 2 || p[0] != '/' || p.size() > 1024 || p.find('\0') != std::string::npos) {
      return invalidArg(field, "'" + p + "' is not an absolute path below /");
    }
    for (const auto& part : splitString(p.substr(1), '/')) {
      if (part.empty() || part == "." || part == "..") {
        return invalidArg(field, "'" + p + "' is not a normalised path");
      }
    }
    for (const char* sys : {"/proc", "/sys", "/dev"}) {
      if (p == sys || startsWith(p, std::string(sys) + "/")) {
        return invalidArg(field, "'" + p + "' is under " + sys + ", which policies leave alone");
      }
    }
  }
  return Status::ok();
}

}  // namespace dsec::platform
