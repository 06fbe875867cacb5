// Security policies: named documents a sandbox runs under, switched live by
// phase (setup → rollout → eval). Today a policy carries file rules (paths
// read-only or hidden for every process in the sandbox, whatever its uid) and
// its egress, which is always none: a sandbox's network namespace has only
// loopback until egress allow-lists (eBPF cgroup filters) exist.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::platform {

struct Policy {
  std::string name;
  std::string description;
  std::vector<std::string> readonlyPaths;
  std::vector<std::string> hiddenPaths;
  std::vector<std::string> egress;  // allow-list; empty: none
};

// The built-in policies: default, rollout, eval.
const std::vector<Policy>& builtinPolicies();
// kInvalidArgument naming `field` for an unknown name.
Result<Policy> findPolicy(const std::string& name, const std::string& field);
// Checks extra paths a caller adds to a policy: absolute, normalised, not "/"
// and not under /proc, /sys or /dev (the sandbox needs them as they are).
Status validatePolicyPaths(const std::vector<std::string>& paths, const std::string& field);

}  // namespace dsec::platform
