// The file requests of docs/agent-protocol.md ("Files"). All synchronous:
// they touch the sandbox's local disk only, so the event loop calls them
// directly. Paths have been checked to be absolute and NUL-free by the caller.
// Errors are sysError()s whose message names the operation and path
// ("open /x: No such file or directory") and keeps errno.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "aether/json_fields.h"
#include "common/fd.h"
#include "common/status.h"

namespace dsec::aether {

// lstat(): {"name","path","type","size","mode","mtime","uid","gid","target"?}.
Result<Json> statPath(const std::string& path);

// The whole `list` result payload, {"ok":true,"entries":[…]}, sorted by name.
// If the entries would not fit in `max_payload` bytes (or number more than
// 20000) the list is cut after the first ones by name and "truncated":true added.
Result<std::string> listDir(const std::string& path, size_t max_payload);

// mkdir, or mkdir -p with `parents` (an existing directory is then fine). New
// directories get exactly `mode` (umask does not apply); intermediate ones 0755.
Status makeDir(const std::string& path, bool parents, mode_t mode);

// A path's metadata: its "user.meta.<key>" extended attributes (not
// following a symlink), set key by key (an empty value removes the key).
// Keys are 1-128 of [a-z0-9._-], values at most 4096 printable ASCII bytes
// (kInvalidArgument, field "meta"); a file system without user xattrs is
// kFailedPrecondition.
Status setMeta(const std::string& path, const std::map<std::string, std::string>& meta);
// What setMeta set: key -> value (empty when none, or unreadable).
Json metaOf(const std::string& path);

// unlink / rmdir; with `recursive`, a whole tree without following symlinks.
// "/" is refused (kInvalidArgument); a non-empty directory without
// `recursive` is kFailedPrecondition.
Status removePath(const std::string& path, bool recursive);

// One file_write in progress. A non-append write goes to a temporary file in
// the target's directory, renamed over the target by commit(); destroying an
// uncommitted writer removes the temporary file.
class FileWriter {
 public:
  // `mode_given`: the request named a mode. New files always get `mode`; an
  // existing file appended to keeps its mode unless one was given.
  static Result<FileWriter> open(const std::string& path, mode_t mode, bool mode_given,
                                 bool append);
  FileWriter(FileWriter&& o) noexcept { *this = std::move(o); }
  FileWriter& operator=(FileWriter&& o) noexcept;
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  ~FileWriter() { abort(); }

  Status write(std::string_view data);
  // Returns the number of bytes written. The writer is finished either way.
  Result<uint64_t> commit();
  void abort();

 private:
  FileWriter() = default;
  UniqueFd fd_;
  std::string path_;      // the target
  std::string tmp_path_;  // empty for append
  uint64_t written_ = 0;
};

// One file_read: a range of a regular file, read in chunks.
class FileReader {
 public:
  // `length` -1 reads to the end of the file. A directory is EISDIR, any other
  // non-regular file kInvalidArgument (a FIFO or /dev/zero would never end).
  static Result<FileReader> open(const std::string& path, uint64_t offset, int64_t length);
  FileReader(FileReader&&) noexcept = default;
  FileReader& operator=(FileReader&&) noexcept = default;

  uint64_t size() const { return size_; }
  mode_t mode() const { return mode_; }
  // Replaces `out` with up to `max` next bytes of the range; empty at its end
  // (the file may be shorter than it was at open()).
  Status readChunk(std::string& out, size_t max);

 private:
  FileReader() = default;
  UniqueFd fd_;
  std::string path_;
  uint64_t size_ = 0;
  mode_t mode_ = 0;
  uint64_t pos_ = 0;        // next offset to read
  uint64_t remaining_ = 0;  // UINT64_MAX: to the end
};

}  // namespace dsec::aether
