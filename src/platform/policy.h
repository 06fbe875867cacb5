// Security policies: named documents a sandbox runs under, switched live by
// phase (setup → rollout → eval). A policy carries file rules (paths
// read-only or hidden for every process in the sandbox, whatever its uid) and
// network egress: an allow-list of addresses, prefixes and host names with
// ports (edge/net/egress_rules.h), enforced by the edge's eBPF cgroup filter,
// and the DNS resolvers the sandbox may use (written to its /etc/resolv.conf
// and allowed on port 53). No egress entry means no egress: the sandbox's
// network namespace then reaches only its own loopback.
//
// Built-ins: default, setup, rollout, eval. `setup` allows what the operator
// gives `dsec up --setup-egress/--setup-dns` (e.g. a package mirror), nothing
// by default. Users add their own policies through the API; those are stored
// and survive restarts. Built-ins cannot be replaced or deleted.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace dsec::platform {

class Store;

// Ceilings a policy puts on a sandbox while it runs under it; 0: none. The
// cgroup limits in force are the lower of these and the sandbox's own
// (create-time) limits, rewritten at every switch; an exec asking for more
// output or time than the policy allows gets the policy's figure.
struct PolicyLimits {
  double cpu = 0;  // cores
  int64_t memoryMb = 0;
  int64_t pids = 0;
  int64_t maxOutputBytes = 0;  // per exec and stream
  double maxExecTimeoutS = 0;
  bool operator==(const PolicyLimits&) const = default;
};

struct Policy {
  std::string name;
  std::string description;
  std::vector<std::string> readonlyPaths;
  std::vector<std::string> hiddenPaths;
  std::vector<std::string> egress;  // allow-list entries; empty: no egress
  std::vector<std::string> dns;     // resolver addresses; each allowed on port 53
  PolicyLimits limits;
  // The seccomp profile of execs under the policy: "default", or "strict"
  // (also no ptrace, no other processes' memory, only unix/inet/inet6/netlink
  // sockets; src/aether/seccomp.h).
  std::string syscalls = "default";
  bool builtin = false;
  double createdAt = 0;

  nlohmann::json toJson() const;
};

// The built-in policies; `setup` with the given allow-list and resolvers.
std::vector<Policy> builtinPolicies(const std::vector<std::string>& setupEgress = {},
                                    const std::vector<std::string>& setupDns = {});

// Checks extra paths a caller adds to a policy: absolute, normalised, not "/"
// and not under /proc, /sys or /dev (the sandbox needs them as they are).
Status validatePolicyPaths(const std::vector<std::string>& paths, const std::string& field);
// Checks egress entries (syntax only; host names are resolved when applied).
Status validateEgress(const std::vector<std::string>& entries, const std::string& field);
// Checks resolver addresses: IPv4 or IPv6 literals, at most 3 (resolv.conf's limit).
Status validateDns(const std::vector<std::string>& servers, const std::string& field);

// Built-ins plus the user's policies. Thread-safe.
class Policies {
 public:
  // Loads the user's policies from `store` (kept, not owned).
  static Result<std::unique_ptr<Policies>> open(Store* store, std::vector<Policy> builtins);

  // kInvalidArgument naming `field` for an unknown name, listing the names.
  Result<Policy> find(const std::string& name, const std::string& field) const;
  std::vector<Policy> list() const;
  // Just the limits of a policy (every exec asks), without copying the rest;
  // none for an unknown name.
  PolicyLimits limitsOf(const std::string& name) const;
  // Validates a policy document from the API ({"name", "description",
  // "readonly_paths", "hidden_paths", "egress", "dns", "limits"}) and stores it before
  // returning. kAlreadyExists (409) for a name in use, built-in or not.
  Result<Policy> create(const nlohmann::json& doc);
  // kNotFound for an unknown name; kFailedPrecondition for a built-in.
  // The caller checks that no live sandbox runs under it.
  Status remove(const std::string& name);

 private:
  Policies() = default;
  Store* store_ = nullptr;
  std::vector<Policy> builtins_;
  mutable std::mutex mu_;  // guards custom_
  std::map<std::string, Policy> custom_;
};

}  // namespace dsec::platform
