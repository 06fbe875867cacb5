// pack_upper (docs/agent-protocol.md): a microvm guest's overlay upper dir
// streamed to the edge as a POSIX (pax) tar, for pack_diff. The upper dir is
// on the guest's writable disk, out of the host's reach; the edge turns the
// tar back into a directory and builds the diff layer from it exactly as
// from a container's upper dir.
//
// While an UpperTar lives, the file system holding the tree is frozen
// (FIFREEZE): the tar is one consistent moment, and writers in the guest
// wait. The destructor thaws it, so a dropped transfer never leaves the
// guest's disk frozen.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/status.h"

namespace dsec::aether {

class UpperTar {
 public:
  // `root`: the tree's directory (not owned; must outlive this). With
  // `freeze`, its file system is synced and frozen until destruction.
  static Result<std::unique_ptr<UpperTar>> open(int root, bool freeze);
  ~UpperTar();
  UpperTar(const UpperTar&) = delete;
  UpperTar& operator=(const UpperTar&) = delete;

  // Replaces `out` with up to about `max` next bytes of the tar (whole
  // 512-byte blocks); empty once the end-of-archive blocks are out.
  //
  // Entries: "./" first, then depth first in name order. Owners are numeric,
  // mtimes to the nanosecond; directories, regular files (a second name of a
  // hard-linked file is a link entry), symlinks, FIFOs and character
  // devices (overlayfs whiteouts are 0:0); sockets are skipped (tar cannot
  // hold them). Of the xattrs only those a layer keeps travel: user.*,
  // security.capability and trusted.overlay.opaque.
  Status readChunk(std::string& out, size_t max);

 private:
  UpperTar() = default;
  struct Dir {
    UniqueFd fd;
    std::string rel;  // "./" or "./a/b/"
    std::vector<std::string> names;
    size_t next = 0;
  };
  Status pushDir(UniqueFd fd, std::string rel);
  // Queues the next entry's header (and opens its data), or the end blocks.
  Status nextEntry();
  Status addEntry(int parent, const std::string& name, const std::string& rel);

  int root_ = -1;
  UniqueFd frozen_;  // the file system to thaw; -1 when not frozen
  std::vector<Dir> stack_;
  std::string pending_;  // header blocks and padding not yet handed out
  size_t pendingOff_ = 0;
  UniqueFd file_;        // the current regular file's data
  uint64_t fileLeft_ = 0;
  uint64_t padLeft_ = 0;  // zeros after the data, up to the next block
  std::map<std::pair<dev_t, ino_t>, std::string> links_;  // first name of each
  bool ended_ = false;   // end blocks queued
};

// One pax/ustar header (and its extended header when needed), appended to
// out. `type` is the ustar typeflag. Exposed for tests.
void appendTarHeader(std::string& out, const std::string& name, char type, mode_t mode,
                     uid_t uid, gid_t gid, uint64_t size, int64_t mtimeSec, long mtimeNsec,
                     const std::string& linkName, unsigned devMajor, unsigned devMinor,
                     const std::vector<std::pair<std::string, std::string>>& xattrs);

}  // namespace dsec::aether
