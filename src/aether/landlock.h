// Landlock, the second layer under a policy's read-only paths: execs started
// while the rules are in force run in a Landlock domain in which nothing
// under those paths may be written, created, removed, renamed or truncated
// (reads and execution stay free), whatever the process's uid or
// capabilities and even if the read-only bind mounts (fs_policy.h) were gone.
// A rule covers everything beneath its path, so the parents of read-only
// paths take no new entries either; agent.cc therefore locks top-level paths
// this way (making "/" itself refuse new entries) and leaves deeper ones to
// the mounts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"

namespace dsec::aether {

// The kernel's Landlock ABI version; 0 when Landlock is unavailable.
int landlockAbi();

// The write-class filesystem rights of `abi` (what both rulesets handle),
// and those of them a rule on a non-directory may carry.
uint64_t writeRights(int abi);
uint64_t fileRights(int abi);

// A new ruleset (close-on-exec) handling `handledFs`. With `scope` and ABI
// 6 (Linux 6.12) or later it also scopes signals and abstract unix sockets:
// a process in a domain made from it may signal, or connect to an abstract
// socket of, only processes in that domain or nested in it.
Result<UniqueFd> createRuleset(int abi, uint64_t handledFs, bool scope);

// Grants `access` beneath `path` in `ruleset` (the path itself if it is not a
// directory); a missing path is no error. `noFollow`: a symlink is not
// followed.
Status allowBeneath(int ruleset, const std::string& path, uint64_t access, bool noFollow);

// A ruleset fd (close-on-exec) for landlock_restrict_self(2): write-class
// rights are handled and granted beneath every path except `readonly` ones,
// found by walking from `root` down the ancestors of those paths (new
// top-level entries made later get no rule: they are read-only too).
// kFailedPrecondition when the kernel lacks Landlock.
Result<UniqueFd> buildWriteRuleset(const std::vector<std::string>& readonly,
                                   const std::string& root = "/");

}  // namespace dsec::aether
