// Start-up of a container sandbox (docs/agent-protocol.md, "Start-up"): the
// `init` frame, and turning the fresh namespaces the edge cloned aether into
// into the sandbox's root. Runs once, before the event loop, as PID 1.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "aether/fncall.h"
#include "aether/json_fields.h"
#include "common/status.h"

namespace dsec::aether {

struct RootfsConfig {
  // mount_fd: the edge built the root (user namespace mode) and passed it as
  // a mount fd with the init frame; lower, upper and work are then absent
  // and target may be relative to aether's working directory.
  bool mountFd = false;
  // With mount_fd: a second fd came along, a read-only clone of the
  // sandbox's disk that PID 1 keeps (close-on-exec) at a fixed number, so a
  // restarted edge can take it back with pidfd_getfd (aether/main.cc).
  // target (relative) then lies in the private stage and is made if missing.
  bool diskFd = false;
  std::vector<std::string> lower;  // top layer first
  std::string upper;
  std::string work;
  std::string target;
};

struct InitConfig {
  std::string hostname;
  std::optional<RootfsConfig> rootfs;  // absent: stay in the current root
  std::vector<std::string> env;        // default environment of execs
  // Outlive the edge: wait for the next one to reattach instead of exiting
  // when the connection closes (AgentOptions::reattach_fd).
  bool reattach = false;
  // A fncall sandbox (fncall.h): read-only root, tmpfs /scratch, calls.
  std::optional<FncallConfig> fncall;
  // The first phase's policy (a policy frame's body), applied before the
  // hello (AgentOptions::initial_policy).
  std::optional<Json> policy;
  // Made (mkdir -p, 0755) before the policy applies; empty for none.
  std::string working_dir;
};

// kInvalidArgument (with the field) on malformed JSON, paths that would
// break overlayfs' option syntax (',' or ':' in a layer path), or a relative
// target with a ".." component.
Result<InitConfig> parseInitConfig(std::string_view payload);

// With a rootfs: private mounts, overlay (or, with mount_fd, attaching
// `rootfsFd`, the mount the edge passed with the init frame), /proc, /sys, /dev, Docker's masked
// and read-only /proc and /sys paths, pivot_root,
// hostname and /etc/hosts, lo up, a new cgroup namespace. Always: aether's
// own oom_score_adj -1000 (best effort: a user namespace may not allow it).
// The first failing step's error comes back with the step as context
// ("mount overlay: …").
// kInvalidArgument when mount_fd and rootfsFd disagree.
//
// `staged`: where prestage() left /proc, /sys and /dev (moved into the root
// instead of mounted there), or empty to mount them now.
//
// `maskDir` (both here and in prestage): the node's empty read-only
// directory (the edge's `--mask=DIR`, relative to the working directory),
// bound over each masked directory; without one (or if it is not empty and
// read-only) each gets a read-only tmpfs of its own, a superblock apiece.
Status setupContainer(const InitConfig& config, int rootfsFd = -1,
                      const std::string& staged = {}, const std::string& maskDir = {});

// A spare agent's work before it knows its sandbox (`dsec-aether
// --prestage`): makes every mount slave (host mounts, such as layers mounted
// later, still arrive; none of ours leaves) and mounts the sandbox's /proc,
// /sys and /dev, with their masked and read-only paths, on a private tmpfs
// over `stageDir` (relative: to the working directory) in the agent's own
// mount namespace; brings lo up. Returns the staging directory for
// setupContainer. Needs its own mount, pid and net namespaces (the edge's
// clone gives them), as the same mounts at init would. The tmpfs hides
// whatever lies under `stageDir` from the agent, so the edge names an empty
// directory of its own (never one above its data directory, such as /tmp).
constexpr const char* kStageDir = "/tmp";
//
// `pivot` (`--pivot`: the edge's detached layout, whose init brings the
// rootfs as a mount fd): also pivot_root into the stage and drop the host's
// tree, here rather than on the create path; returns "/", and init then
// mounts the rootfs at /root on the stage and enters it with MS_MOVE onto
// "/" and chroot (no pivot_root, no unmount at create).
Result<std::string> prestage(const std::string& stageDir = kStageDir,
                             const std::string& maskDir = {}, bool pivot = false);

// Sets the IFF_UP flag of interface `name` through SIOCSIFFLAGS.
Status bringUpInterface(const char* name);

}  // namespace dsec::aether
