// User namespaces for container sandboxes (issue 4): root inside a sandbox is
// root only within a user namespace that maps 0..width-1 to a host range
// base..base+width-1, so on the host it is an unprivileged uid. Each sandbox
// has a range of its own (issue 31, edge/id_range_pool.h), allocated from
// the node's window when its agent is cloned.
//
// Design (docs/container-backend.md, "User namespaces"): the edge, as host
// root in the initial user namespace, builds each sandbox's overlay itself
// over idmapped clones of the node's EROFS layer mounts, made through the
// sandbox's own user namespace (files owned by 0 appear as host `base`),
// with the upper dir owned by host `base`, and hands the finished detached
// mount to the sandbox's init as an fd. The sandbox
// never mounts its own root: overlayfs inside a user namespace would ignore
// the trusted.overlay.* xattrs image layers use for opaque dirs.
//
// Everything here works on mount fds (open_tree, mount_setattr, fsopen,
// fsconfig, fsmount); the kernel needs Linux >= 6.8 ("lowerdir+" by fd) and
// idmapped mounts on EROFS and on the sandbox's upper filesystem.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "edge/id_range_pool.h"

namespace dsec::edge {

// The node's window of host ids for sandboxes, the ids each one maps, and
// whether user namespaces are used.
struct UsernsOptions {
  std::string mode = "auto";                 // "auto": on where the kernel supports it; "off"
  uint32_t windowFirst = kDefaultUsernsFirst;  // host ids the ranges come from
  uint32_t windowLast = kDefaultUsernsLast;
  uint32_t width = kDefaultUsernsWidth;  // ids 0..width-1 inside each sandbox are mapped
  // Host ids never handed out: the host's /etc/subuid and /etc/subgid
  // entries (readSubordinateIds()).
  std::vector<IdRange> excluded;
};

// What detectUserns found. Read-only after start.
struct Userns {
  bool enabled = false;
  uint32_t windowFirst = 0, windowLast = 0, width = 0;
  std::string reason;  // why it is off (or "on": the ranges), for logs and GET /v1/node
  // The node's ranges, empty (capacity 0) when off: the owner copies it.
  IdRangePool pool;
};

// kInvalidArgument for a mode other than auto/off (field "userns") or a
// window and width IdRangePool::make refuses (fields "userns-window",
// "userns-width"). Otherwise an enabled Userns when mode is auto and this
// kernel can: create a user namespace, idmap a mount, and take overlay lower
// layers by fd; else a disabled one whose reason says which step failed.
Result<Userns> detectUserns(const UsernsOptions& opts);

// "FIRST-LAST" (`--userns-window`) as host ids; kInvalidArgument (field
// "userns-window") for anything else. IdRangePool::make checks the values.
Result<std::pair<uint32_t, uint32_t>> parseIdWindow(const std::string& text);
// `--userns-width N`: a whole number from 65536 to 2^31; kInvalidArgument
// (field "userns-width") for anything else. IdRangePool::make checks that it
// is a multiple of 65536.
Result<uint32_t> parseIdWidth(const std::string& text);

// The host's /etc/subuid and /etc/subgid entries (ids delegated to users,
// who may map them into namespaces of their own): none when the files are
// missing.
std::vector<IdRange> readSubordinateIds();

// The single extent of /proc/<pid>/uid_map ("0 B L"), checked to equal
// gid_map: a sandbox's range as the kernel has it. kFailedPrecondition when
// the maps are not one identical extent starting at 0; sysError of a read.
Result<IdRange> readIdMap(pid_t pid);

// A user namespace whose uid_map and gid_map are both `map` ("0 100000
// 65536"), kept alive by the returned /proc/PID/ns/user fd after the
// throwaway child that made it has exited. Errors name the failing step.
Result<UniqueFd> makeUsernsFd(const std::string& map);

// Writes `map` ("0 100000 65536\n") to /proc/PID/uid_map and gid_map of a
// child just cloned into a new user namespace (setgroups stays "allow", so
// the sandbox's own setgroups(2) works). sysError of the failing write.
Status writeIdMaps(pid_t pid, const std::string& map);

// A detached clone of the mount at `dir` (not recursive) idmapped through
// `usernsFd` (-1: not idmapped); read-only when asked. `dir` may lie in a
// detached mount (/proc/self/fd/N/...). The caller owns the mount: closing the
// fd drops it. sysError of open_tree or mount_setattr (EINVAL: the
// filesystem does not support idmapped mounts).
Result<UniqueFd> idmappedClone(const std::string& dir, int usernsFd, bool readOnly);

// Sets or clears MOUNT_ATTR_RDONLY on the mount `mountFd` refers to (that
// mount only, not its clones). sysError of mount_setattr.
Status setMountReadOnly(int mountFd, bool readOnly);

// A detached overlay mount (nodev, like the sandboxes' roots have always
// been) of `lowerFds` (mount fds, top layer first) with `upper` and `work`
// (host paths), index, metacopy and redirect_dir off, xino on. The error carries the
// kernel's fs_context log line when it has one.
Result<UniqueFd> makeOverlay(const std::vector<int>& lowerFds, const std::string& upper,
                             const std::string& work);

// The same with the lower layers named by path (top layer first): the
// node's layer mounts, in our mount namespace. `upper` and `work` may lie in
// a detached mount reached through /proc/self/fd/N (Linux >= 6.15 lets
// overlayfs clone a detached mount privately; probeDetachedDisks checks).
Result<UniqueFd> makeOverlay(const std::vector<std::string>& lowerPaths, const std::string& upper,
                             const std::string& work);

// Attaches a detached mount at `target` (an existing directory).
Status attachMount(int mountFd, const std::string& target);

}  // namespace dsec::edge
