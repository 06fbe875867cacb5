// Users and groups of the sandbox, read from its own /etc/passwd and
// /etc/group. dsec-aether is linked statically, where glibc's getpwnam() and
// friends would need NSS modules at run time, so it parses the files itself.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace dsec::aether {

struct PasswdEntry {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::string home;
  std::string shell;
};

struct GroupEntry {
  std::string name;
  gid_t gid = 0;
  std::vector<std::string> members;
};

// Parse the text of a passwd / group file. Blank, comment, NIS ("+"/"-") and
// malformed lines are skipped rather than failing the whole file: one bad line
// written by a sandboxed program must not make every exec fail.
std::vector<PasswdEntry> parsePasswd(std::string_view text);
std::vector<GroupEntry> parseGroup(std::string_view text);

// Who an exec runs as.
struct Credentials {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups, primary gid included
  std::string home;           // HOME for the process
};

// Resolves an exec's "user": a name, "uid", or "user:group" where each side
// is a name or a number. A name must exist (kInvalidArgument, field "user",
// otherwise), except "root", which is uid 0 even without a passwd file. A
// number need not exist; without a passwd entry its gid is the same number and
// HOME is "/" ("/root" for uid 0). Supplementary groups are those of
// /etc/group listing the user's name. Missing files count as empty.
Result<Credentials> resolveUser(std::string_view spec, std::string_view passwd_text,
                                std::string_view group_text);

// Whether the user namespace maps `c`'s uid, gid and supplementary groups:
// `uid_map` and `gid_map` are /proc/self/uid_map and gid_map ("inside
// outside count" lines; empty: no user namespace, everything mapped). An id
// outside is kInvalidArgument, field "user", naming the id and the ids the
// sandbox maps (a sandbox maps 0..width-1 only: docs/security.md, "Ids
// outside the mapping"), instead of setuid's bare EINVAL.
Status checkMapped(const Credentials& c, std::string_view uid_map, std::string_view gid_map);

// Reads a whole small file; a missing file reads as empty.
Result<std::string> readSmallFile(const std::string& path, size_t max_size = 16u << 20);

}  // namespace dsec::aether
